-- nn.Linear4 and nn.quantize_linears: linear layers over frozen 4-bit NF4
-- weights (gp.quantize), the base of QLoRA:
--
--   nn.quantize_linears(model, {kind = 'nf4', block = 64})  -- attention and MLP Linears
--   local adapters = gp.lora.apply(model, {rank = 8})       -- LoRA over the quantized base
--
-- A Linear4 keeps the quantized weight under `weight` and the bias (frozen
-- too) under `bias`; its state_dict entries are name.weight.nf4 (u8 (out,
-- in/2): two codes a byte, element 2j in the high nibble) and
-- name.weight.absmax (f32 (out, in/block)), plus name.bias. A model saved
-- this way loads into the same model quantized with the same block size.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
require 'gpush.nn.layers'
local lora = require 'gpush.nn.lora'
local raise, is_tensor, shape_str = rt.raise, tensor.is_tensor, tensor.shape_str
local doc = gp.doc

local Linear4 = nn.Module:extend('Linear4')
nn.Linear4 = Linear4

function Linear4:init(q, bias)
  if not gp.is_quantized(q) then raise('Linear4: needs a quantized weight (gp.quantize(w)), got ' .. type(q)) end
  self.in_features, self.out_features = q.shape[2], q.shape[1]
  self.weight = q
  if bias ~= nil then
    if not is_tensor(bias) or bias:dim() ~= 1 or bias:size(1) ~= q.shape[1] then
      raise(string.format('Linear4: bias must be a tensor (%d), got %s', q.shape[1],
        is_tensor(bias) and shape_str(bias.shape) or type(bias)))
    end
    if bias.device ~= q.device then raise(string.format('Linear4: bias is on %s but the weight is on %s', bias.device, q.device)) end
    self.bias = nn.Parameter(bias, false)
    self.bias:requires_grad(false)
  end
end

function Linear4:forward(x) return gp.nf4_linear(x, self.weight, self.bias) end

function Linear4:extra_repr()
  return string.format('%d -> %d, %s block %d%s', self.in_features, self.out_features, self.weight.kind, self.weight.block,
    self.bias and '' or ', no bias')
end

-- a Linear4 from an nn.Linear: its weight quantized, its bias kept (frozen)
function Linear4.from_linear(linear, opts)
  if not (nn.is_module(linear) and getmetatable(linear) == nn.Linear._imt) then
    raise('Linear4.from_linear: needs an nn.Linear, got ' .. tostring(linear))
  end
  local q = gp.quantize(linear.weight:detach(), opts)
  return Linear4(q, linear.bias and linear.bias:detach() or nil)
end

doc(Linear4, 'nn.Linear4(q, bias)',
  'y = x @ q:dequantize()^T + bias over a frozen quantized weight q (gp.quantize), through gp.nf4_linear; the bias is frozen too; state_dict: weight.nf4, weight.absmax, bias')
doc(Linear4.from_linear, "nn.Linear4.from_linear(linear, {kind='nf4', block=64})", "an nn.Linear's weight quantized (and its bias) as a Linear4")

-- found: {owner, key, module, name} entries; an error naming the first weight whose rows the block does not divide
local function check_blocks(op, found, block)
  for _, f in ipairs(found) do
    local w = f[3].weight
    if type(block) == 'number' and w:size(2) % block ~= 0 then
      raise(string.format('%s: %s.weight is %s: block %s does not divide its rows', op, f[4], shape_str(w.shape), tostring(block)))
    end
  end
end

-- an embedding table over a frozen quantized weight (vocab, dim): a lookup dequantizes only the rows it reads
local Embedding4 = nn.Module:extend('Embedding4')
nn.Embedding4 = Embedding4

function Embedding4:init(q)
  if not gp.is_quantized(q) then raise('Embedding4: needs a quantized weight (gp.quantize(w)), got ' .. type(q)) end
  self.num_embeddings, self.embedding_dim = q.shape[1], q.shape[2]
  self.weight = q
end

function Embedding4:forward(idx) return self.weight:rows(idx) end

function Embedding4:extra_repr()
  return string.format('%d x %d, %s block %d', self.num_embeddings, self.embedding_dim, self.weight.kind, self.weight.block)
end
doc(Embedding4, 'nn.Embedding4(q)', 'an embedding table over a frozen quantized weight q (vocab, dim): emb(idx) = q:rows(idx), only the rows looked up dequantized; state_dict: weight.nf4, weight.absmax')

-- the token embedding of a model (an nn.Embedding named embed_tokens or wte) quantized, and a head tied to it
-- (an nn.Linear holding the same tensor) made a Linear4 over the same quantized weight
function nn.quantize_embeddings(model, opts)
  if not nn.is_module(model) then raise('quantize_embeddings: needs a module, got ' .. type(model)) end
  opts = opts or {}
  local q = {kind = opts.kind or 'nf4', block = opts.block or 64}
  local emb, heads = {}, {}
  nn.walk(model, '', function(kind, name, v, owner, key)
    if kind ~= 'module' then return end
    local mt = getmetatable(v)
    if mt == nn.Embedding._imt and (key == 'embed_tokens' or key == 'wte') then emb[#emb + 1] = {owner, key, v, name}
    elseif mt == nn.Linear._imt then heads[#heads + 1] = {owner, key, v, name} end
  end)
  if #emb == 0 then raise('quantize_embeddings: the model has no token embedding (an nn.Embedding named embed_tokens or wte)') end
  check_blocks('quantize_embeddings', emb, q.block)
  for _, e in ipairs(emb) do
    local w = e[3].weight
    local qw = gp.quantize(w:detach(), q)
    rawset(e[1], e[2], Embedding4(qw))
    for _, h in ipairs(heads) do
      if h[3].weight == w then rawset(h[1], h[2], Linear4(qw, h[3].bias and h[3].bias:detach() or nil)) end
    end
  end
  collectgarbage('collect')
  return model
end
doc(nn.quantize_embeddings, "gp.nn.quantize_embeddings(model, {kind='nf4', block=64})",
  'replace the token embedding (an nn.Embedding named embed_tokens or wte) by a frozen nn.Embedding4 over its quantized weight, and a head tied to it (an nn.Linear holding the same tensor) by an nn.Linear4 over the same quantized weight; with quantize_linears the whole frozen base of a Llama with a tied head is 4-bit')

local function matches(name, targets)
  for _, pat in ipairs(targets) do if name:find(pat) then return true end end
  return false
end

-- dense weights dropped since the last collection (bytes): collected every 256 MB so that the
-- peak while quantizing a loaded model stays near its dense size
local GC_EVERY = 256 * 1048576

function nn.quantize_linears(model, opts)
  if not nn.is_module(model) then raise('quantize_linears: needs a module, got ' .. type(model)) end
  opts = opts or {}
  local targets = opts.targets or lora.default_targets
  if type(targets) == 'string' then targets = {targets} end
  local found = {}
  nn.walk(model, '', function(kind, name, v, owner, key)
    if kind == 'module' and getmetatable(v) == nn.Linear._imt and matches(name, targets) then
      found[#found + 1] = {owner, key, v, name}
    end
  end)
  if #found == 0 then
    raise('quantize_linears: no nn.Linear of the model matches the targets ' .. table.concat(targets, ', '))
  end
  local q = {kind = opts.kind or 'nf4', block = opts.block or 64}
  check_blocks('quantize_linears', found, q.block) -- every target checked before any is replaced
  local dropped = 0
  for _, f in ipairs(found) do
    local owner, key, lin = f[1], f[2], f[3]
    rawset(owner, key, Linear4.from_linear(lin, q))
    local w = rawget(lin, 'weight')
    dropped = dropped + w:numel() * w:element_size()
    rawset(lin, 'weight', nil)
    if dropped >= GC_EVERY then collectgarbage('collect'); dropped = 0 end
  end
  collectgarbage('collect')
  return model
end

doc(nn.quantize_linears, "gp.nn.quantize_linears(model, {kind='nf4', block=64, targets={'attn%.qkv$', ...}})",
  "replace the model's nn.Linear modules whose dotted names match a target pattern (default: gp.lora's, the attention and MLP Linears) by frozen nn.Linear4 over their quantized weights; returns the model. QLoRA: this, then gp.lora.apply(model)")


-- the model's weights on the device, each tensor once (a tied head shares its
-- embedding's; a quantized weight at its codes' and scales' size): bytes and
-- parameters of all, and of the quantized weights alone; skip: a set of
-- parameters left out (a model's LoRA adapters)
function nn.weight_stats(model, skip)
  if not nn.is_module(model) then raise('weight_stats: needs a module, got ' .. type(model)) end
  skip = skip or {}
  local r = {bytes = 0, params = 0, quant_bytes = 0, quant_params = 0}
  local seen = {}
  for _, m in ipairs(model:modules()) do
    local w = rawget(m, 'weight')
    if gp.is_quantized(w) and not seen[w] then
      seen[w] = true
      local n = w.shape[1] * w.shape[2]
      r.bytes, r.params = r.bytes + w.nbytes, r.params + n
      r.quant_bytes, r.quant_params = r.quant_bytes + w.nbytes, r.quant_params + n
    end
  end
  for _, p in ipairs(model:parameters()) do
    if not seen[p] and not skip[p] then
      seen[p] = true
      r.bytes, r.params = r.bytes + p:numel() * p:element_size(), r.params + p:numel()
    end
  end
  return r
end
doc(nn.weight_stats, 'gp.nn.weight_stats(model, skip=nil)',
  "{bytes, params, quant_bytes, quant_params}: the model's weights on the device, each tensor once (a tied head once, quantized weights at their packed size), and the quantized weights alone; skip: a set of parameters to leave out")

-- every weight byte a forward reads: what a decode step reads besides the KV cache
function nn.weight_bytes(model)
  if not nn.is_module(model) then raise('weight_bytes: needs a module, got ' .. type(model)) end
  return nn.weight_stats(model).bytes
end
doc(nn.weight_bytes, 'gp.nn.weight_bytes(model)',
  "the bytes of the model's weights: its parameters (each once) and its quantized weights' codes and scales (each once); what a decode step reads besides the KV cache")

return nn
