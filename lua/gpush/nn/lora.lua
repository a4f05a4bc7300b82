-- gp.lora and nn.LoRA: low-rank adapters around nn.Linear (Hu et al., 2021).
--
--   local adapters = gp.lora.apply(model, {rank = 8, alpha = 16})  -- attention and MLP Linears
--   local opt = gp.optim.AdamW(adapters, {lr = 1e-3, weight_decay = 0})
--   ...
--   gp.lora.save('adapters.safetensors', model)      -- the adapters only
--   gp.lora.load(model, 'adapters.safetensors')
--   gp.lora.without(model, function() return model(x) end)  -- the frozen base
--
-- y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T with W (and b) frozen;
-- W may be a quantized weight (an nn.Linear4 wrapped: QLoRA, the adapters in
-- the base's compute dtype),
-- A (rank, in) ~ U(-1/sqrt(in), 1/sqrt(in)), B (out, rank) = 0 at the start
-- (so the adapted model starts as the base). The LoRA module keeps the
-- Linear's own weight and bias tensors under the same names, so the model's
-- state_dict keys of the base are unchanged (h.1.attn.qkv.weight) and a base
-- checkpoint still loads; the adapters add lora_A and lora_B beside them.
-- merge() adds the low-rank product into W (one matmul, no extra work per
-- forward afterwards) and keeps a copy of W so that unmerge() restores it
-- exactly.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
require 'gpush.nn.layers'
local raise, is_tensor = rt.raise, tensor.is_tensor
local doc = gp.doc

local LoRA = nn.Module:extend('LoRA')
nn.LoRA = LoRA

-- an nn.Linear, or an nn.Linear4 (a frozen quantized weight, nn/quant.lua: QLoRA)
local function is_linear(m)
  if not nn.is_module(m) then return false end
  local mt = getmetatable(m)
  return mt == nn.Linear._imt or (nn.Linear4 ~= nil and mt == nn.Linear4._imt)
end

function LoRA:init(linear, opts)
  if not is_linear(linear) then raise('LoRA: needs an nn.Linear or nn.Linear4 to wrap, got ' .. tostring(linear)) end
  opts = opts or {}
  local r, alpha, p = opts.rank or 8, opts.alpha, opts.dropout or 0
  if type(r) ~= 'number' or r < 1 or r ~= math.floor(r) then raise('LoRA: rank must be a positive integer, got ' .. tostring(r)) end
  alpha = alpha or 2 * r
  if type(alpha) ~= 'number' then raise('LoRA: alpha must be a number, got ' .. tostring(alpha)) end
  self.in_features, self.out_features = linear.in_features, linear.out_features
  self.rank, self.alpha, self.scaling = r, alpha, alpha / r
  local w = linear.weight -- a tensor, or a quantized weight (frozen by nature)
  self.weight = w
  if is_tensor(w) then w:requires_grad(false) end
  if linear.bias then
    self.bias = linear.bias
    self.bias:requires_grad(false)
  end
  local o = {dtype = w.dtype, device = w.device}
  local k = 1 / math.sqrt(self.in_features)
  self.lora_A = nn.Parameter(nn.init.uniform_(gp.empty({r, self.in_features}, o), -k, k))
  self.lora_B = nn.Parameter(nn.init.zeros_(gp.empty({self.out_features, r}, o)))
  self.drop = nn.Dropout(p)
  rawset(self, 'merged', false)
  rawset(self, 'enabled', true)
end

-- the low-rank update (alpha / rank) B A, (out, in)
function LoRA:delta()
  return gp.no_grad(function() return self.lora_B:matmul(self.lora_A) * self.scaling end)
end

function LoRA:forward(x)
  if self.merged and not self.enabled then
    raise('LoRA: the adapters are merged into the weight; unmerge() before disabling them')
  end
  if self.merged or not self.enabled then return gp.linear(x, self.weight, self.bias) end
  if self.drop.training and self.drop.p > 0 then -- dropout on the adapter's input only
    local y = gp.linear(x, self.weight, self.bias)
    return y + gp.linear(gp.linear(self.drop(x), self.lora_A), self.lora_B) * self.scaling
  end
  -- one node of three products, the adapter's added into the base's output by the GEMM
  return gp.lora_linear(x, self.weight, self.bias, self.lora_A, self.lora_B, self.scaling)
end

-- LoRA.forward_group(x, m1, m2, ...): LoRA modules that read the same input
-- (a Llama's q/k/v, gate/up) as one gp.lora_linear_group node, when each
-- would run as one gp.lora_linear (unmerged, enabled, no dropout while
-- training) and all have one scaling: their outputs; else nil (the caller
-- runs the modules one by one)
function LoRA.forward_group(x, ...)
  local n = select('#', ...)
  local ws, bs, As, Bs, s = {}, {}, {}, {}, nil
  for i = 1, n do
    local m = select(i, ...)
    if getmetatable(m) ~= LoRA._imt or m.merged or not m.enabled or (m.drop.training and m.drop.p > 0) or
      (s ~= nil and m.scaling ~= s) then
      return nil
    end
    s = m.scaling
    ws[i], bs[i], As[i], Bs[i] = m.weight, rawget(m, 'bias'), m.lora_A, m.lora_B
  end
  return gp.lora_linear_group(x, ws, bs, As, Bs, s)
end

function LoRA:merge()
  if self.merged then return self end
  if not is_tensor(self.weight) then
    raise(string.format('LoRA: cannot merge into a quantized (%s) weight: the sum would have to be quantized again; ' ..
      'run with the adapters, or merge into a dense copy of the base', self.weight.kind))
  end
  gp.no_grad(function()
    rawset(self, '_base', self.weight:clone())
    self.weight:add_(self:delta():to(self.weight.dtype))
  end)
  rawset(self, 'merged', true)
  return self
end

function LoRA:unmerge()
  if not self.merged then return self end
  gp.no_grad(function()
    local base = rawget(self, '_base')
    if base then self.weight:copy_(base) else self.weight:sub_(self:delta():to(self.weight.dtype)) end
  end)
  rawset(self, '_base', nil)
  rawset(self, 'merged', false)
  return self
end

function LoRA:extra_repr()
  return string.format('%d -> %d, rank=%d, alpha=%g%s', self.in_features, self.out_features, self.rank, self.alpha,
    self.merged and ', merged' or '')
end

doc(LoRA, 'nn.LoRA(linear, {rank=8, alpha=2*rank, dropout=0})',
  'wrap an nn.Linear (or an nn.Linear4: QLoRA): y = linear(x) + (alpha/rank) * dropout(x) A^T B^T; the Linear\'s weight and bias are frozen and kept under their names, only lora_A (rank, in) and lora_B (out, rank, zero at init) train')
doc(LoRA.merge, 'lora:merge()', 'add (alpha/rank) B A into the weight (keeps a copy for unmerge); forward then costs one matmul')
doc(LoRA.unmerge, 'lora:unmerge()', 'restore the weight saved by merge() exactly')
doc(LoRA.delta, 'lora:delta()', 'the low-rank update (alpha/rank) B A as an (out, in) tensor')
doc(LoRA.forward_group, 'nn.LoRA.forward_group(x, m1, m2, ...)',
  'the outputs of LoRA modules that read the same x (q/k/v, gate/up) as one gp.lora_linear_group node, when each would run as one gp.lora_linear (unmerged, enabled, no dropout while training) with one scaling; else nil (run them one by one)')

local L = {}

-- default targets: the Linears of attention and MLP blocks (not the lm_head,
-- which is tied to the token embedding in nn.GPT): nn.GPT's names and the
-- Llama family's (q_proj ... o_proj, gate_proj, up_proj, down_proj)
L.default_targets = {'attn%.qkv$', 'attn%.proj$', 'mlp%.fc$', 'mlp%.proj$', 'mlp%.gate$', 'mlp%.up$',
                     'self_attn%.[qkvo]_proj$', 'mlp%.gate_proj$', 'mlp%.up_proj$', 'mlp%.down_proj$'}

local function matches(name, targets)
  for _, pat in ipairs(targets) do if name:find(pat) then return true end end
  return false
end

-- every LoRA module of the model, {name, module}
function L.modules(model)
  local r = {}
  nn.walk(model, '', function(kind, name, v)
    if kind == 'module' and getmetatable(v) == LoRA._imt then r[#r + 1] = {name, v} end
  end)
  return r
end

-- the adapters of a module's projection groups (owner.lora_groups: lists of
-- the names of sibling Linears that read one input, such as a Llama's q/k/v),
-- all just made (made[m]) and of one input size, dtype and device: their A
-- become row blocks of one tensor (separate parameters, views of it), so
-- that gp.lora_linear_group computes x A^T for all of them as one product
local function group_adapters(owner, made)
  for _, names in ipairs(owner.lora_groups or {}) do
    local ms, As = {}, {}
    for i, nm in ipairs(names) do
      local m = rawget(owner, nm)
      if not made[m] then ms = nil; break end
      local a, a1 = m.lora_A, ms[1] and ms[1].lora_A
      if a1 and (a:size(2) ~= a1:size(2) or a.dtype ~= a1.dtype or a.device ~= a1.device) then ms = nil; break end
      ms[i], As[i] = m, a:detach()
    end
    if ms and #ms > 1 then
      local A = gp.cat(As, 1)
      local off = 1
      for _, m in ipairs(ms) do
        m.lora_A = nn.Parameter(A:narrow(1, off, m.rank))
        off = off + m.rank
      end
    end
  end
end

function L.apply(model, opts)
  if not nn.is_module(model) then raise('lora.apply: needs a module, got ' .. type(model)) end
  opts = opts or {}
  local targets = opts.targets or L.default_targets
  if type(targets) == 'string' then targets = {targets} end
  local found, names = {}, {}
  nn.walk(model, '', function(kind, name, v, owner, key)
    if kind == 'module' and is_linear(v) then
      names[#names + 1] = name
      if matches(name, targets) then found[#found + 1] = {owner, key, v} end
    end
  end)
  local function listed()
    local shown = {unpack(names, 1, math.min(#names, 8))}
    return #names == 0 and 'none' or table.concat(shown, ', ') .. (#names > 8 and string.format(', ... (%d)', #names) or '')
  end
  if #found == 0 then
    raise('lora.apply: no nn.Linear of the model matches the targets ' .. table.concat(targets, ', ') .. '; its Linears: ' .. listed())
  end
  -- targets given by name: each must name a module of the model (a misspelt one would silently adapt less)
  if opts.targets then
    for _, pat in ipairs(targets) do
      local hit = false
      for _, nm in ipairs(names) do if nm:find(pat) then hit = true; break end end
      if not hit then
        raise(string.format("lora.apply: the target '%s' matches no nn.Linear of the model; its Linears: %s", pat, listed()))
      end
    end
  end
  model:requires_grad_(false)
  local made, owners, seen = {}, {}, {}
  for _, f in ipairs(found) do
    local owner, key, lin = f[1], f[2], f[3]
    local m = LoRA(lin, opts)
    rawset(owner, key, m)
    made[m] = true
    if not seen[owner] then seen[owner] = true; owners[#owners + 1] = owner end
  end
  for _, owner in ipairs(owners) do group_adapters(owner, made) end
  return L.parameters(model)
end

-- the adapter tensors (lora_A, lora_B of every LoRA module); the A of a group
-- (row blocks of one tensor) side by side, then their B, so that an
-- optimizer's flat gradient buffer holds the A's gradients as one tensor too
-- (gp.lora_linear_group's dA is then one GEMM into it)
function L.parameters(model)
  local r, run = {}, {}
  local function flush()
    for _, m in ipairs(run) do r[#r + 1] = m.lora_A end
    for _, m in ipairs(run) do r[#r + 1] = m.lora_B end
    run = {}
  end
  for _, nm in ipairs(L.modules(model)) do
    local m = nm[2]
    if #run > 0 and not tensor.span({run[#run].lora_A, m.lora_A}, 1) then flush() end
    run[#run + 1] = m
  end
  flush()
  return r
end

function L.state_dict(model)
  local sd = {}
  for name, t in pairs(model:state_dict()) do
    if name:find('%.lora_[AB]$') then sd[name] = t end
  end
  return sd
end

local function config_of(model)
  local mods = L.modules(model)
  if #mods == 0 then raise('lora: the model has no LoRA modules (gp.lora.apply first)') end
  local m = mods[1][2]
  local names = {}
  for i, nm in ipairs(mods) do names[i] = nm[1] end
  return {rank = m.rank, alpha = m.alpha, modules = names}
end

function L.save(path, model, meta)
  local m = {}
  for k, v in pairs(meta or {}) do m[k] = v end
  m.lora = config_of(model)
  gp.save(path, L.state_dict(model), m)
end

-- load adapters (from a file or a {name = tensor} table) into a model that
-- has the same LoRA modules; every adapter must be present, nothing else
function L.load(model, src)
  local sd = src
  if type(src) == 'string' then sd = gp.load(src) end
  if type(sd) ~= 'table' then raise('lora.load: needs a path or a table of tensors') end
  local own = L.state_dict(model)
  if next(own) == nil then raise('lora.load: the model has no LoRA modules (gp.lora.apply first)') end
  local missing, unexpected = {}, {}
  for name in pairs(own) do if sd[name] == nil then missing[#missing + 1] = name end end
  for name, t in pairs(sd) do
    if own[name] == nil then unexpected[#unexpected + 1] = tostring(name)
    elseif not is_tensor(t) then unexpected[#unexpected + 1] = tostring(name) .. ' (not a tensor)' end
  end
  table.sort(missing)
  table.sort(unexpected)
  if #missing > 0 or #unexpected > 0 then
    raise(string.format('lora.load: missing adapters: %s; unexpected: %s', #missing > 0 and table.concat(missing, ', ') or 'none',
      #unexpected > 0 and table.concat(unexpected, ', ') or 'none'))
  end
  model:load_state_dict(sd, {strict = false})
  return model
end

local function each(model, f) for _, nm in ipairs(L.modules(model)) do f(nm[2]) end end
function L.merge(model) each(model, function(m) m:merge() end); return model end
function L.unmerge(model) each(model, function(m) m:unmerge() end); return model end

-- run fn with the adapters switched off: the frozen base model
function L.without(model, fn, ...)
  local mods = L.modules(model)
  for _, nm in ipairs(mods) do
    if nm[2].merged then raise('lora.without: the adapters are merged; unmerge first') end
    rawset(nm[2], 'enabled', false)
  end
  local r = {pcall(fn, ...)}
  for _, nm in ipairs(mods) do rawset(nm[2], 'enabled', true) end
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, table.maxn(r))
end

-- run fn with the adapters merged into their dense weights (the ones not
-- merged yet and enabled; adapters over quantized weights run as they are),
-- then restore the weights exactly, also when fn fails. Generation this way
-- costs what the base does (and a Llama's q/k/v and gate/up run fused again);
-- the exact restore holds a copy of each merged weight while fn runs.
function L.merged(model, fn, ...)
  local done = {}
  for _, nm in ipairs(L.modules(model)) do
    local m = nm[2]
    if not m.merged and m.enabled and is_tensor(m.weight) then
      m:merge()
      done[#done + 1] = m
    end
  end
  local r = {pcall(fn, ...)}
  for _, m in ipairs(done) do m:unmerge() end
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, table.maxn(r))
end

-- write into dense, a model of model's architecture with plain dense weights
-- (the checkpoint loaded again), model's weights with every enabled adapter
-- merged and every quantized weight dequantized; model is not changed. Every
-- parameter and buffer of dense is written (a tied one once), from the tensor
-- or quantized weight of the same name in model; the adapter's B A (times its
-- scaling) added by one product with beta = 1 into the dequantized block
function L.dense_copy(dense, model)
  if not nn.is_module(dense) or not nn.is_module(model) then
    raise('lora.dense_copy: needs two modules (dense, model), got ' .. type(dense) .. ' and ' .. type(model))
  end
  local mods = {[''] = model}
  nn.walk(model, '', function(kind, name, v) if kind == 'module' then mods[name] = v end end)
  local jobs, seen = {}, {}
  nn.walk(dense, '', function(kind, name, t)
    if (kind ~= 'param' and kind ~= 'buffer') or seen[t] then return end
    seen[t] = true
    local path, field = name:match('^(.*)%.([^.]+)$')
    if not path then path, field = '', name end
    local m = mods[path]
    local src = m and rawget(m, field)
    local ok = is_tensor(src) or gp.is_quantized(src)
    if not ok or tensor.shape_str(src.shape) ~= tensor.shape_str(t.shape) then
      raise(string.format('lora.dense_copy: the dense model\'s %s %s is %s in the model', name,
        tensor.shape_str(t.shape), ok and ('of shape ' .. tensor.shape_str(src.shape)) or 'missing'))
    end
    jobs[#jobs + 1] = {t, src, m, field}
  end)
  gp.no_grad(function()
    for _, j in ipairs(jobs) do
      local t, src, m, field = j[1], j[2], j[3], j[4]
      if gp.is_quantized(src) then
        if t:is_contiguous() then src:dequantize(t) else t:copy_(src:dequantize(t.dtype)) end
      elseif src ~= t then
        t:copy_(src)
      end
      if field == 'weight' and getmetatable(m) == LoRA._imt and m.enabled and not m.merged then
        if t:is_contiguous() and m.lora_B.dtype == t.dtype then
          gp.k.matmul(t, m.lora_B, m.lora_A, m.scaling, 1)
        else
          t:add_(m:delta():to(t.dtype))
        end
      end
    end
  end)
  return dense
end

doc(L.apply, "gp.lora.apply(model, {rank=8, alpha=2*rank, dropout=0, targets={'attn%.qkv$', ...}})",
  'wrap the model\'s nn.Linear (and nn.Linear4) modules whose dotted names match a target pattern (default: attention and MLP) in nn.LoRA, freeze every other parameter; returns the adapter parameters. Given targets must each match a Linear (an error names the one that does not and lists the model\'s Linears)')
doc(L.parameters, 'gp.lora.parameters(model)', 'the lora_A and lora_B tensors of every LoRA module (what the optimizer trains)')
doc(L.modules, 'gp.lora.modules(model)', 'a list of {dotted.name, LoRA module}')
doc(L.state_dict, 'gp.lora.state_dict(model)', '{name = tensor} of the adapters only')
doc(L.save, "gp.lora.save('a.safetensors', model, meta)", 'write the adapters only (gp.save), with their rank, alpha and module names in the metadata')
doc(L.load, "gp.lora.load(model, 'a.safetensors' | tensors)", 'load adapters into a model with the same LoRA modules (every adapter present, nothing else)')
doc(L.merge, 'gp.lora.merge(model)', 'merge every adapter into its weight (generation without the extra matmuls)')
doc(L.unmerge, 'gp.lora.unmerge(model)', 'restore every merged weight exactly')
doc(L.merged, 'gp.lora.merged(model, fn, ...)', 'run fn with the dense weights\' adapters merged (one product a projection), then restore the weights exactly, also on error (a copy of each merged weight is held meanwhile); returns what fn returns')
doc(L.dense_copy, 'gp.lora.dense_copy(dense, model)', 'write into dense (a model of the same architecture with plain dense weights, e.g. the checkpoint loaded again) model\'s weights with every enabled adapter merged and every quantized weight dequantized, model unchanged: a copy to sample from at a dense model\'s speed while model keeps its 4-bit base and unmerged adapters; returns dense')
doc(L.without, 'gp.lora.without(model, fn, ...)', 'run fn with the adapters switched off (the frozen base model); returns what fn returns')
return L
