-- The Llama family (Llama 2 and 3, Mistral, Qwen2, SmolLM, ...): RMSNorm,
-- rotary positions, grouped-query attention, a SwiGLU MLP. Parameters carry
-- the names and layouts of Hugging Face's LlamaForCausalLM, so state_dict()
-- reads and writes the checkpoints transformers reads and writes:
--   model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ...,
--   model.layers.0.mlp.gate_proj.weight, model.norm.weight, lm_head.weight
--
--   local m = gp.models.Llama(cfg)      -- cfg: a config.json table (gp.models.load reads one)
--   local logits = m(ids)                -- ids (B, T) i64 -> (B, T, vocab)
--   local logits, loss = m(ids, targets)
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn'
local raise, is_tensor, shape_str = rt.raise, tensor.is_tensor, tensor.shape_str
local Module, Linear = nn.Module, nn.Linear
local autograd = require 'gpush.core.autograd'

-- the config fields gpush reads, with Hugging Face's defaults; the model keeps them in .config
local function config_of(c)
  local function need(k)
    local v = c[k]
    if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
      raise(string.format('Llama: config field %s must be a positive integer, got %s', k, tostring(v)))
    end
    return v
  end
  local d, H = need('hidden_size'), need('num_attention_heads')
  local hd = c.head_dim or d / H
  -- transformers 5 writes rope_parameters {rope_type, rope_theta, factor, ...}; earlier ones rope_theta and rope_scaling
  local rp = c.rope_parameters
  local scaling = c.rope_scaling
  if rp and (rp.rope_type or rp.type or 'default') ~= 'default' then scaling = scaling or rp end
  local cfg = {
    model_type = c.model_type or 'llama', vocab_size = need('vocab_size'), hidden_size = d,
    intermediate_size = need('intermediate_size'), num_hidden_layers = need('num_hidden_layers'),
    num_attention_heads = H, num_key_value_heads = c.num_key_value_heads or H, head_dim = hd,
    max_position_embeddings = c.max_position_embeddings or 2048, rms_norm_eps = c.rms_norm_eps or 1e-6,
    rope_theta = c.rope_theta or (rp and rp.rope_theta) or 10000, rope_scaling = scaling, tie_word_embeddings = c.tie_word_embeddings == true,
    attention_bias = c.attention_bias == true, hidden_act = c.hidden_act or 'silu', sliding_window = c.sliding_window,
    bos_token_id = c.bos_token_id, eos_token_id = c.eos_token_id,
  }
  if cfg.model_type == 'qwen2' then cfg.qkv_bias = true else cfg.qkv_bias = cfg.attention_bias end
  if hd ~= math.floor(hd) or hd % 2 ~= 0 then
    raise(string.format('Llama: hidden_size %d / num_attention_heads %d = %s is not an even head dim', d, H, tostring(hd)))
  end
  if H % cfg.num_key_value_heads ~= 0 then
    raise(string.format('Llama: num_attention_heads %d is not a multiple of num_key_value_heads %d', H, cfg.num_key_value_heads))
  end
  if cfg.hidden_act ~= 'silu' then
    raise(string.format("Llama: hidden_act '%s' is not supported (silu)", tostring(cfg.hidden_act)))
  end
  if type(cfg.sliding_window) == 'number' and c.use_sliding_window == false then cfg.sliding_window = nil end
  -- the names the rest of gpush reads (gp.generate, the experiments)
  cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.n_layer = d, H, cfg.num_key_value_heads, cfg.num_hidden_layers
  cfg.block_size = cfg.max_position_embeddings
  return cfg
end

---------------------------------------------------------------------------

-- Projections that read the same input share one weight: the Linears' weights
-- (and biases) are row blocks of one (sum of outs, in) tensor, so that
-- without autograd (generation, evaluation) one product serves them all (a
-- decode step launches one GEMM for q, k and v instead of three, one for gate
-- and up instead of two). Checkpoints load into the blocks in place
-- (load_state_dict copies); anything that replaces a weight (:to, NF4
-- quantization) ends the sharing and the Linears run alone (fused_weight);
-- NF4-quantized projections share a stacked quantized weight instead
-- (fused_quant).
local function fuse(owner, names)
  local ls = {}
  for i, name in ipairs(names) do ls[i] = owner[name] end
  local w0 = ls[1].weight
  local ws, bs = {}, {}
  for i, l in ipairs(ls) do ws[i], bs[i] = l.weight:detach(), rawget(l, 'bias') and l.bias:detach() end
  local W = gp.cat(ws, 1)
  local B = bs[1] and gp.cat(bs, 1) or nil
  local r0 = 1
  for i, l in ipairs(ls) do
    local n = ws[i]:size(1)
    l.weight = nn.Parameter(W:narrow(1, r0, n), rawget(w0, '_rg') == true)
    if B then l.bias = nn.Parameter(B:narrow(1, r0, n), rawget(w0, '_rg') == true) end
    r0 = r0 + n
  end
  return {w = W, b = B, ls = ls, names = names}
end

-- the fused weight and bias that owner[key] records, when the owner's
-- modules still are those plain Linears and their weights and biases its row
-- blocks; nil otherwise. A LoRA over the same weight keeps the record: merged
-- (gp.lora.merge adds B A into the block in place) it runs fused too,
-- unmerged or disabled it runs alone. Any other module (NF4 quantization) or
-- a replaced weight drops the record, so the fused tensor is freed once
-- nothing else holds its blocks.
local function fused_weight(owner, key)
  local f = rawget(owner, key)
  if not f then return nil end
  local W, B = f.w, f.b
  local off, boff = W.c.offset, B and B.c.offset
  local alone = false
  for i, l in ipairs(f.ls) do
    local m = rawget(owner, f.names[i])
    local plain = m == l and getmetatable(l) == Linear._imt
    local lora = not plain and nn.LoRA and getmetatable(m) == nn.LoRA._imt
    local w, b = rawget(lora and m or l, 'weight'), rawget(lora and m or l, 'bias')
    if not (plain or lora) or not is_tensor(w) or w.c.data ~= W.c.data or w.c.offset ~= off or (B == nil) ~= (b == nil) or
      (B and (b.c.data ~= B.c.data or b.c.offset ~= boff)) then
      rawset(owner, key, nil)
      return nil
    end
    if lora and not (m.merged and m.enabled) then alone = true end
    off = off + w.c.shape[0] * w.c.shape[1]
    if B then boff = boff + b.c.shape[0] end
  end
  if alone or autograd.enabled then return nil end
  return W, B
end

-- the same for projections quantized to NF4 (nn.quantize_linears): when each
-- of owner's `names` is a bias-free nn.Linear4 and nothing records gradients,
-- their weights stacked row-wise (gp.quantized_cat; built on first use, the
-- Linear4s then hold views of it, so no second copy stays); nil otherwise (a
-- LoRA over them, a bias, autograd on)
local function fused_quant(owner, key, names)
  if autograd.enabled or not nn.Linear4 then return nil end
  local f = rawget(owner, key)
  for i, name in ipairs(names) do
    local m = rawget(owner, name)
    if getmetatable(m) ~= nn.Linear4._imt or rawget(m, 'bias') ~= nil then return nil end
    if f and rawget(m, 'weight') ~= f.parts[i] then f = nil end
  end
  if not f then
    local qs = {}
    for i, name in ipairs(names) do qs[i] = rawget(owner, name).weight end
    local all, parts = gp.quantized_cat(qs)
    for i, name in ipairs(names) do rawset(rawget(owner, name), 'weight', parts[i]) end
    f = {q = all, parts = parts}
    rawset(owner, key, f)
  end
  return f.q
end

-- the outputs of sibling LoRA projections of x as one node (nn.LoRA.forward_group), or nil
local function lora_group(x, ...)
  if not nn.LoRA then return nil end
  return nn.LoRA.forward_group(x, ...)
end

local Attention = Module:extend('LlamaAttention')
-- projections of one input: gp.lora.apply makes their adapters' A row blocks of one tensor
Attention.lora_groups = {{'q_proj', 'k_proj', 'v_proj'}}
function Attention:init(cfg, o)
  local d, H, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  self.H, self.Hkv, self.hd = H, Hkv, hd
  local ob = {bias = cfg.qkv_bias, dtype = o.dtype, device = o.device}
  self.q_proj = Linear(d, H * hd, ob)
  self.k_proj = Linear(d, Hkv * hd, ob)
  self.v_proj = Linear(d, Hkv * hd, ob)
  self.o_proj = Linear(H * hd, d, {bias = cfg.attention_bias, dtype = o.dtype, device = o.device})
  self.window = cfg.sliding_window
  rawset(self, '_qkv', fuse(self, {'q_proj', 'k_proj', 'v_proj'}))
end

-- q (B, H, T, hd) over k, v (B, Hkv, S, hd), the queries being the last T of S
-- positions: grouped-query attention, k and v as they are (the flash kernels
-- read KV head h / (H / Hkv) for query head h; nn.attention repeats them only
-- on its matmul path)
function Attention:attend(q, k, v)
  local S = k:size(3)
  local scale = 1 / math.sqrt(self.hd)
  if self.window and S > self.window then
    if not gp.attention_supported('fwd', q.dtype, self.hd) then
      raise(string.format('Llama: a sliding window (%d) over %d keys needs flash attention at head dim %d', self.window, S, self.hd))
    end
    return (gp.attention(q, k, v, {causal = true, scale = scale, window = self.window}))
  end
  return nn.attention(q, k, v, {causal = true, scale = scale})
end

-- decode attention options (the sliding window, where the model has one)
function Attention:decode_opts()
  local o = rawget(self, '_dec_opts')
  if not o then
    o = {scale = 1 / math.sqrt(self.hd), window = self.window or 0}
    rawset(self, '_dec_opts', o)
  end
  return o
end

-- x (B, T, d) at positions pos .. pos + T - 1 (a number, or an i64 tensor of T
-- positions); with a cache, at = {pos = i64 [1], lens = i64 [B]} marks a
-- device-position step (one token: Llama:forward_cached)
function Attention:forward(x, pos, inv_freq, cache, layer, at)
  local B, T = x:size(1), x:size(2)
  local H, Hkv, hd = self.H, self.Hkv, self.hd
  local p = at and at.pos or pos
  local q, k, v
  local W, Wb = fused_weight(self, '_qkv')
  if not W then W = fused_quant(self, '_qkv4', {'q_proj', 'k_proj', 'v_proj'}) end
  if W then -- one product, then row blocks of its output (rope and the cache take strided views)
    local y = gp.linear(x, W, Wb)
    local nq, nkv = H * hd, Hkv * hd
    if at and T == 1 and cache.rope_append_at then
      -- a device-position decode step: q and k turned and k, v written (a compressed cache: quantized) by one kernel
      local q1 = cache:rope_append_at(layer, y:view {B, nq + 2 * nkv}, at.pos, inv_freq, H)
      local o = cache:attend_at(layer, q1, at.lens, self:decode_opts())
      return self.o_proj(o:view {B, T, H * hd})
    end
    if B * T == 1 then -- one token: q and k roped by one kernel (their views of its output are contiguous)
      local r = gp.rope(y:narrow(3, 1, nq + nkv):view {B, T, H + Hkv, hd}, p, inv_freq)
      q, k = r:narrow(3, 1, H):transpose(2, 3), r:narrow(3, H + 1, Hkv):transpose(2, 3)
    else
      q = gp.rope(y:narrow(3, 1, nq):view {B, T, H, hd}, p, inv_freq):transpose(2, 3)
      k = gp.rope(y:narrow(3, nq + 1, nkv):view {B, T, Hkv, hd}, p, inv_freq):transpose(2, 3)
    end
    v = y:narrow(3, nq + nkv + 1, nkv):view {B, T, Hkv, hd}:transpose(2, 3)
  else
    -- LoRA adapters on all three (unmerged): one node (gp.lora_linear_group); else each alone
    local yq, yk, yv = lora_group(x, self.q_proj, self.k_proj, self.v_proj)
    if not yq then yq, yk, yv = self.q_proj(x), self.k_proj(x), self.v_proj(x) end
    q = gp.rope(yq:view {B, T, H, hd}, p, inv_freq):transpose(2, 3)
    k = gp.rope(yk:view {B, T, Hkv, hd}, p, inv_freq):transpose(2, 3)
    v = yv:view {B, T, Hkv, hd}:transpose(2, 3)
  end
  local y
  if at then -- nothing read on the host: the cache written and read at device positions
    cache:append_at(layer, k, v, at.pos)
    y = cache:attend_at(layer, q:reshape {B, H, hd}, at.lens, self:decode_opts()):view {B, H, 1, hd}
  elseif cache then
    local first = cache:len(layer) == 0
    cache:append(layer, k, v)
    if T == 1 and cache.attend and gp.attention_supported('decode', cache.dtype or q.dtype, hd) then
      -- one token over the grouped cache (split along the cache on the GPU; a compressed cache's codes read directly)
      y = cache:attend(layer, q:reshape {B, H, hd}, self:decode_opts()):view {B, H, 1, hd}
    elseif first and cache.kv_dtype then
      -- a prefill into an empty compressed cache attends over the chunk's own k, v (not their codes)
      y = self:attend(q, k, v)
    elseif cache.kv_dtype and cache.attend_chunk and gp.attention_supported('decode', q.dtype, hd) then
      -- a later chunk over a compressed cache: its codes read directly (q's (B, T, H, hd) layout in and out)
      y = cache:attend_chunk(layer, q:transpose(2, 3), self:decode_opts()):transpose(2, 3)
    else
      y = self:attend(q, cache:keys(layer), cache:values(layer))
    end
  else
    y = self:attend(q, k, v)
  end
  return self.o_proj(y:transpose(2, 3):reshape {B, T, H * hd})
end

local MLP = Module:extend('LlamaMLP')
MLP.lora_groups = {{'gate_proj', 'up_proj'}}
function MLP:init(cfg, o)
  local d, h = cfg.hidden_size, cfg.intermediate_size
  local ob = {bias = false, dtype = o.dtype, device = o.device}
  self.gate_proj = Linear(d, h, ob)
  self.up_proj = Linear(d, h, ob)
  self.down_proj = Linear(h, d, ob)
  rawset(self, '_gate_up', fuse(self, {'gate_proj', 'up_proj'}))
end
function MLP:forward(x)
  local W = fused_weight(self, '_gate_up') or fused_quant(self, '_gate_up4', {'gate_proj', 'up_proj'})
  if W then
    local y, h = gp.linear(x, W), self.gate_proj.out_features
    local n = y:dim()
    local down = self.down_proj
    -- few rows (decode): SwiGLU and the down projection in one kernel
    if getmetatable(down) == Linear._imt and rawget(down, 'bias') == nil and is_tensor(rawget(down, 'weight')) and
      y:numel() <= 8 * h and (y:numel() / 2) * y:element_size() <= 48 * 1024 then
      return gp.swiglu_linear(y, down.weight)
    end
    return down(gp.swiglu(y:narrow(n, 1, h), y:narrow(n, h + 1, h)))
  end
  local gate, up = lora_group(x, self.gate_proj, self.up_proj)
  if not gate then gate, up = self.gate_proj(x), self.up_proj(x) end
  return self.down_proj(gp.swiglu(gate, up))
end

local Layer = Module:extend('LlamaDecoderLayer')
function Layer:init(cfg, o)
  local ro = {eps = cfg.rms_norm_eps, dtype = o.dtype, device = o.device}
  self.input_layernorm = nn.RMSNorm(cfg.hidden_size, ro)
  self.self_attn = Attention(cfg, o)
  self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, ro)
  self.mlp = MLP(cfg, o)
end
function Layer:forward(x, pos, inv_freq, cache, layer, at)
  x = x + self.self_attn(self.input_layernorm(x), pos, inv_freq, cache, layer, at)
  return x + self.mlp(self.post_attention_layernorm(x))
end

-- the decoder without the head: model.embed_tokens, model.layers.N, model.norm
local Body = Module:extend('LlamaModel')
function Body:init(cfg, o)
  self._index_base = 0 -- layers.0, layers.1, ... as in the checkpoints
  self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, o)
  local layers = {}
  for i = 1, cfg.num_hidden_layers do layers[i] = Layer(cfg, o) end
  self.layers = layers
  self.norm = nn.RMSNorm(cfg.hidden_size, {eps = cfg.rms_norm_eps, dtype = o.dtype, device = o.device})
end

local Llama = Module:extend('Llama')
Llama.ignore_keys = {'%.rotary_emb%.inv_freq$'}

-- cfg: the fields of a config.json; opts: {dtype = 'f32', device = gp.device(), init = true}
function Llama:init(c, opts)
  if type(c) ~= 'table' then raise('Llama: needs a config table (the fields of config.json)') end
  opts = opts or {}
  local cfg = config_of(c)
  self.config = cfg
  local o = {dtype = opts.dtype or 'f32', device = opts.device or gp.device()}
  self.model = Body(cfg, o)
  if cfg.tie_word_embeddings then
    self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, {bias = false, dtype = o.dtype, device = o.device})
    self.lm_head.weight = self.model.embed_tokens.weight
  else
    self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, {bias = false, dtype = o.dtype, device = o.device})
  end
  -- the rotary frequencies, computed from the config (not saved, as transformers does), per device
  self._inv_freq = {cpu = gp.rope_inv_freq(cfg.head_dim, {theta = cfg.rope_theta, scaling = cfg.rope_scaling, device = 'cpu'})}
  if opts.init ~= false then self:init_weights(c.initializer_range or 0.02) end
end

-- transformers' init: every Linear and Embedding weight ~ N(0, std), biases 0, norms 1
function Llama:init_weights(std)
  gp.no_grad(function()
    for _, m in ipairs(self:modules()) do
      local mt = getmetatable(m)
      if mt == Linear._imt or mt == nn.Embedding._imt then
        nn.init.normal_(m.weight, 0, std)
        if rawget(m, 'bias') then nn.init.zeros_(m.bias) end
      end
    end
  end)
  return self
end

local function check_ids(op, idx)
  if not is_tensor(idx) or idx:dim() ~= 2 or (idx.dtype ~= 'i64' and idx.dtype ~= 'i32') then
    raise(op .. ': idx must be a (B, T) tensor of i64 (or i32) token ids, got ' ..
      (is_tensor(idx) and (idx.dtype .. ' ' .. shape_str(idx.shape)) or type(idx)))
  end
end

-- the final hidden states (after model.norm, before lm_head)
-- the norms of the residual stream, when they are all plain nn.RMSNorm (not
-- replaced or wrapped): each can run fused with the add before it
local function plain_norms(body)
  local rms = nn.RMSNorm._imt
  if getmetatable(body.norm) ~= rms then return false end
  for _, l in ipairs(body.layers) do
    if getmetatable(l) ~= Layer._imt or getmetatable(l.input_layernorm) ~= rms or
      getmetatable(l.post_attention_layernorm) ~= rms then
      return false
    end
  end
  return true
end

-- The decode step as one kernel (gp_decode_plan, kernels/decode_step.cu):
-- gp.decode_step(on) switches it (on by default, GPUSH_DECODE_STEP=0 turns it
-- off; 'always' takes it up to 8 rows and on the CPU too, where its C
-- reference runs). A step takes it when the model is a plain bf16 Llama:
-- RMSNorms, the fused q/k/v and gate/up weights without biases (no unmerged
-- LoRA, no NF4), o and down plain Linears without biases, no sliding window,
-- head dim 64 or 128, at most 4 rows (past 4 the op-by-op step was as fast on
-- the H200: BENCHMARKS.md 2026-11-30), a bf16 cache that is not compressed.
-- Otherwise, or when the plan cannot be made on this device
-- (cache._step_why says why), the op-by-op step runs.
local ffi, C = require 'ffi', rt.C
local plan_box = ffi.new('gp_decode_plan*[1]')

-- the plan of a one-kernel decode step of B rows over cache, or nil (the op-by-op step then runs)
function Llama:_step_plan(cache, B, dev)
  local mode = gp.decode_step()
  if not mode or (dev ~= 'cuda' and mode ~= 'always') then return nil end
  if type(cache) ~= 'table' or cache.fmt or type(cache.k) ~= 'table' or cache.dtype ~= 'bf16' or
    B > (mode == 'always' and 8 or 4) or
    cache.batch ~= B or not plain_norms(self.model) then
    return nil
  end
  local body, ts, n = self.model, {}, 0
  local scale
  for li, l in ipairs(body.layers) do
    local at, mlp = l.self_attn, l.mlp
    local W, Wb = fused_weight(at, '_qkv')
    local G, Gb = fused_weight(mlp, '_gate_up')
    local o, dn = rawget(at, 'o_proj'), rawget(mlp, 'down_proj')
    if not W or Wb or not G or Gb or getmetatable(o) ~= Linear._imt or rawget(o, 'bias') or
      getmetatable(dn) ~= Linear._imt or rawget(dn, 'bias') or (at.window or 0) ~= 0 then
      return nil
    end
    local opts = at:decode_opts()
    if scale and opts.scale ~= scale then return nil end
    scale = opts.scale
    for _, t in ipairs {W, o.weight, G, dn.weight, l.input_layernorm.weight, l.post_attention_layernorm.weight,
                        cache.k[li], cache.v[li]} do
      if not is_tensor(t) or t.dtype ~= 'bf16' or t.device ~= dev then return nil end
      n = n + 1
      ts[n] = t
    end
  end
  local norm = body.norm.weight
  if n == 0 or norm.dtype ~= 'bf16' then return nil end
  local parts = {}
  for i = 1, n do parts[i] = tostring(ffi.cast('uintptr_t', ts[i].c.data)) .. '+' .. tostring(ts[i].c.offset) end
  local key = table.concat(parts, ' ') .. ' ' .. tostring(ffi.cast('uintptr_t', norm.c.data)) .. ' ' ..
    tostring(body.norm.eps)
  -- every plan made stays with the cache (a captured graph keeps using its scratch)
  local plans = rawget(cache, '_step_plans')
  if not plans then plans = {}; rawset(cache, '_step_plans', plans) end
  local p = plans[key]
  if p == nil then
    local arr = ffi.new('const gp_tensor *[?]', n)
    for i = 1, n do arr[i - 1] = ts[i].c end
    if C.gp_decode_plan_create(plan_box, n / 8, arr, norm.c, body.norm.eps) ~= 0 then
      rawset(cache, '_step_why', rt.last_error())
      p = false
    else
      -- keep and norm hold the tensors the plan points at
      p = {c = ffi.gc(plan_box[0], C.gp_decode_plan_free), keep = ts, norm = norm, scale = scale}
    end
    plans[key] = p
  end
  return p or nil
end

function Llama:_body(idx, pos, cache, at)
  local x = self.model.embed_tokens(idx)
  local freqs = rawget(self, '_inv_freq')
  local inv_freq = freqs[x.device]
  if not inv_freq then inv_freq = freqs.cpu:to(x.device); freqs[x.device] = inv_freq end
  if at and idx:size(2) == 1 then
    local plan = self:_step_plan(cache, idx:size(1), x.device)
    if plan then
      local out = tensor.empty(x.shape, x.dtype, x.device, 'Llama:forward_cached')
      rt.call(C.gp_decode_plan_run, plan.c, out.c, x.c, at.pos.c, at.lens.c, inv_freq.c, plan.scale)
      return out
    end
  end
  local layers = self.model.layers
  if #layers == 0 or not plain_norms(self.model) then
    for i, layer in ipairs(layers) do x = layer(x, pos, inv_freq, cache, i, at) end
    return self.model.norm(x)
  end
  -- Layer:forward's arithmetic with every residual add fused into the norm
  -- after it (gp.add_rms_norm: h = h + branch, n = rms_norm(h) * w in one
  -- kernel): two kernels a layer for its two adds and two norms
  local n, h = layers[1].input_layernorm(x), x
  for i, l in ipairs(layers) do
    local pn = l.post_attention_layernorm
    n, h = gp.add_rms_norm(l.self_attn(n, pos, inv_freq, cache, i, at), h, pn.weight, pn.eps)
    local nx = i < #layers and layers[i + 1].input_layernorm or self.model.norm
    n, h = gp.add_rms_norm(l.mlp(n), h, nx.weight, nx.eps)
  end
  return n
end

function Llama:_run(idx, pos, cache, at) return self.lm_head(self:_body(idx, pos, cache, at)) end

-- idx (B, T) -> the final hidden states (B, T, d) (model.norm applied; lm_head of them gives the logits)
function Llama:hidden(idx)
  check_ids('Llama:hidden', idx)
  if idx:size(2) > self.config.max_position_embeddings then
    raise(string.format('Llama:hidden: the sequence has %d tokens but max_position_embeddings is %d', idx:size(2),
      self.config.max_position_embeddings))
  end
  return self:_body(idx, 0)
end

-- idx (B, T) 0-based token ids -> logits (B, T, vocab); with targets (B, T) also the mean cross-entropy
function Llama:forward(idx, targets)
  check_ids('Llama', idx)
  local T = idx:size(2)
  if T > self.config.max_position_embeddings then
    raise(string.format('Llama: the sequence has %d tokens but max_position_embeddings is %d', T, self.config.max_position_embeddings))
  end
  local logits = self:_run(idx, 0)
  if targets ~= nil then return logits, gp.cross_entropy(logits, targets) end
  return logits
end

-- the cross-entropy of targets (B, T) without the logits (gp.linear_cross_entropy; see GPT:loss)
function Llama:loss(idx, targets, opts)
  return nn.head_loss(self, 'Llama:loss', self:hidden(idx), targets, opts)
end

-- a KV cache for this model: Hkv heads per layer (grouped-query attention stores each KV head once)
-- (kv_dtype 'int8' or 'fp8': compressed keys and values, gp.KVCache)
function Llama:new_cache(batch, capacity, dtype, device, kv_dtype)
  local c = self.config
  return gp.KVCache {batch = batch, heads = c.num_key_value_heads, capacity = capacity, head_dim = c.head_dim,
                     layers = c.num_hidden_layers, dtype = dtype or self.lm_head.weight.dtype,
                     device = device or self.lm_head.weight.device, kv_dtype = kv_dtype}
end

-- incremental forward for generation: idx_new (B, Tnew) at positions pos .. (default cache:len());
-- every layer appends its keys and values (after the rotation) to the cache
-- (Hkv heads: grouped-query attention stores each KV head once) and attends
-- over it; one token attends with gp.attention_decode. pos may be an i64 [1]
-- device tensor (see supports_device_positions).
function Llama:forward_cached(idx, cache, pos)
  check_ids('Llama:forward_cached', idx)
  if type(cache) ~= 'table' or not cache.append then raise('Llama:forward_cached: needs a KV cache (model:new_cache)') end
  if is_tensor(pos) then return self:_forward_at(idx, cache, pos) end
  pos = pos or cache:len()
  if type(pos) ~= 'number' then raise('Llama:forward_cached: pos must be a number (the first position of idx)') end
  local T = idx:size(2)
  if pos + T > self.config.max_position_embeddings then
    raise(string.format('Llama:forward_cached: positions %d..%d are beyond max_position_embeddings %d', pos, pos + T - 1,
      self.config.max_position_embeddings))
  end
  return self:_run(idx, pos, cache)
end

-- device positions: one new token per row at the position held by pos (an
-- i64 [1] tensor on the model's device): the rotation, the cache write
-- (append_at) and decode attention's lengths (attend_at, lens[b] = pos + 1)
-- read it from device memory, so the step reads nothing on the host and
-- gp.generate captures it as a CUDA graph and replays it per token. Needs a
-- gp.KVCache and a head dim that decode attention takes; the cache's host
-- count (cache:len()) is not advanced (cache:set_len).
function Llama:supports_device_positions(cache)
  return type(cache) == 'table' and cache.append_at ~= nil and cache.attend_at ~= nil and
    gp.attention_supported('decode', cache.dtype or self.lm_head.weight.dtype, self.config.head_dim)
end
function Llama:_forward_at(idx, cache, pos)
  if not self:supports_device_positions(cache) then
    raise('Llama:forward_cached: device positions need a gp.KVCache and a head dim that decode attention takes (gp.attention_supported)')
  end
  local lens = cache:step_lens('Llama:forward_cached', idx, pos)
  return self:_run(idx, nil, cache, {pos = pos:view {1}, lens = lens})
end

function Llama:extra_repr()
  local c = self.config
  return string.format('%s: vocab %d, d %d, %d layers, %d heads (%d KV) of %d, mlp %d', c.model_type, c.vocab_size,
    c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size)
end

gp.doc(Llama, 'gp.models.Llama(config, {dtype=\'f32\', device=gp.device(), init=true})',
  'a Llama-family causal LM (llama, mistral, qwen2, SmolLM) from the fields of a config.json: RMSNorm, RoPE (linear and llama3 ' ..
  'scaling), grouped-query attention, SwiGLU; parameters named as in Hugging Face checkpoints; model(ids[, targets])')
gp.doc(Llama.forward_cached, 'llama:forward_cached(idx_new, cache, pos=cache:len())',
  'logits (B, Tnew, V) of tokens at positions pos..; appends every layer\'s rotated keys and values (Hkv heads) to the ' ..
  'cache; one token attends with gp.attention_decode over the grouped cache; pos an i64 [1] device tensor: one ' ..
  'token per row at a device position (CUDA graphs; llama:supports_device_positions(cache))')
gp.doc(Llama.supports_device_positions, 'llama:supports_device_positions(cache)',
  'true when forward_cached can take a device position with this cache (a gp.KVCache, a head dim decode attention ' ..
  'takes): gp.generate then replays its decode step as a CUDA graph')
gp.doc(Llama.new_cache, 'llama:new_cache(batch, capacity, dtype, device, kv_dtype=nil)', 'a gp.KVCache with the model\'s KV heads per layer (kv_dtype \'int8\' or \'fp8\': compressed)')
gp.doc(Llama.loss, 'llama:loss(idx, targets, opts)',
  'the mean cross-entropy of targets (B, T) by gp.linear_cross_entropy over the final hidden states and lm_head\'s weight: the (B T, vocab) logits never exist whole (opts: ignore_index, reduction, chunk)')
gp.doc(Llama.hidden, 'llama:hidden(idx)', 'the final hidden states (B, T, d) of ids (B, T): after model.norm, before lm_head (logits = llama.lm_head(h))')

Llama.config_of = config_of
return Llama
