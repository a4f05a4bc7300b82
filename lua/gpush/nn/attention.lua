-- nn.attention (the swappable attention core), nn.causal_mask and
-- nn.CausalSelfAttention (multi-head, with a KV-cache path for generation).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
require 'gpush.nn.layers'
local doc = gp.doc
local raise, is_tensor, shape_str = rt.raise, tensor.is_tensor, tensor.shape_str
local Module, need_int = nn.Module, nn.need_int
local Linear, Dropout = nn.Linear, nn.Dropout

-- additive causal masks (0 on and below the diagonal, -inf above), cached per
-- (T, S, device, dtype): query i (of T, the last T of S positions) sees keys j <= i + S - T
local masks = {}
function nn.causal_mask(T, S, device, dtype)
  S = S or T
  local key = T .. ',' .. S .. ',' .. device .. ',' .. dtype
  local m = masks[key]
  if not m then
    m = gp.no_grad(function()
      local j = gp.arange(S, {device = device}):view {1, S}
      local i = gp.arange(T, {device = device}):view {T, 1} + (S - T)
      return gp.where(j:gt(i), -math.huge, 0):to(dtype)
    end)
    masks[key] = m
  end
  return m
end
function nn.clear_mask_cache() masks = {} end

-- softmax(q k^T * scale [+ causal mask] [+ opts.mask]) v over the last two dims; q (..., T, d),
-- k (..., S, d), v (..., S, dv) with the same leading dims. The one function
-- attention layers call: assign nn.attention to swap the core (flash attention).
-- whether flash attention is the better path at head dim D over S keys (asked of C)
local function flash_dim(dt, D, S) return gp.attention_supported('flash', dt, D, S) end

-- k or v (B, Hkv, S, d) -> (B, H, S, d): each KV head repeated for the H / Hkv
-- query heads that read it (a copy; the flash kernels take the groups as they are)
function nn.repeat_kv(t, H)
  local B, Hkv, S, d = t:size(1), t:size(2), t:size(3), t:size(4)
  if Hkv == H then return t end
  if Hkv < 1 or H % Hkv ~= 0 then
    raise(string.format('repeat_kv: %s has %d heads, which do not divide %d', shape_str(t.shape), Hkv, H))
  end
  return t:unsqueeze(3):expand {B, Hkv, H / Hkv, S, d}:reshape {B, H, S, d}
end

function nn.attention(q, k, v, opts)
  opts = opts or {}
  if not (is_tensor(q) and is_tensor(k) and is_tensor(v)) then raise('attention: q, k and v must be tensors') end
  local s = q.shape
  local nd = #s
  if nd < 2 or k:dim() ~= nd or v:dim() ~= nd then
    raise(string.format('attention: q %s, k %s and v %s must have the same number (>= 2) of dims', shape_str(s),
      shape_str(k.shape), shape_str(v.shape)))
  end
  local T, D, S, Dv = s[nd - 1], s[nd], k:size(-2), v:size(-1)
  -- grouped-query attention: 4-d q (B, H, T, d) over k, v (B, Hkv, S, d), Hkv dividing H
  local grouped = nd == 4 and k:size(2) ~= s[2] and k:size(2) == v:size(2) and k:size(2) > 0 and s[2] % k:size(2) == 0
  local lead = 1
  for i = 1, nd - 2 do
    lead = lead * s[i]
    if not (grouped and i == 2) and (k:size(i) ~= s[i] or v:size(i) ~= s[i]) then
      raise(string.format('attention: q %s, k %s and v %s must agree in the leading dims (or, 4-d, k and v may have ' ..
        'Hkv heads dividing q\'s H)', shape_str(s), shape_str(k.shape), shape_str(v.shape)))
    end
  end
  if k:size(-1) ~= D or v:size(-2) ~= S then
    raise(string.format('attention: q %s, k %s, v %s: k must be (..., S, %d) and v (..., S, dv)', shape_str(s),
      shape_str(k.shape), shape_str(v.shape), D))
  end
  local os = {unpack(s)}
  os[nd] = Dv
  -- flash attention (gp.attention) where it applies: no dropout, head dim 64
  -- or 128 (or 32 up to S 512: no tensor-core kernel there, so the launches it
  -- saves only pay at short lengths), one dtype, and S >= T when causal; else
  -- the matmul path below
  if gp.attention and not opts.mask and (opts.dropout or 0) == 0 and flash_dim(q.dtype, D, S) and Dv == D and k.dtype == q.dtype and
    v.dtype == q.dtype and (not opts.causal or T <= S) then
    local y = gp.attention(nd == 4 and q or q:reshape {lead, 1, T, D}, nd == 4 and k or k:reshape {lead, 1, S, D},
      nd == 4 and v or v:reshape {lead, 1, S, D}, {causal = opts.causal and true or false, scale = opts.scale})
    return nd == 4 and y or y:view(os)
  end
  if grouped then k, v = nn.repeat_kv(k, s[2]), nn.repeat_kv(v, s[2]) end -- the matmul path needs every head
  local q3, k3, v3 = q:reshape {lead, T, D}, k:reshape {lead, S, D}, v:reshape {lead, S, Dv}
  local att = gp.matmul(q3, k3, {trans_b = true, alpha = opts.scale or 1 / math.sqrt(D)})
  if opts.causal then att = att + nn.causal_mask(T, S, att.device, att.dtype) end
  if opts.mask then -- additive, broadcast over q's leading dims and (T, S): (B, 1, 1, S) masks padded keys
    local full = {unpack(s, 1, nd - 2)}
    full[#full + 1], full[#full + 2] = T, S
    att = (att:view(full) + opts.mask):view {lead, T, S}
  end
  att = att:softmax(-1)
  if opts.dropout and opts.dropout > 0 then att = (gp.dropout(att, opts.dropout)) end
  return att:matmul(v3):view(os)
end
local default_attention = nn.attention

-- multi-head causal self-attention: x (B, T, C) -> (B, T, C)
local CausalSelfAttention = Module:extend('CausalSelfAttention')
nn.CausalSelfAttention = CausalSelfAttention
function CausalSelfAttention:init(cfg)
  cfg = cfg or {}
  local C, H = cfg.n_embd, cfg.n_head
  need_int('CausalSelfAttention', 'n_embd', C)
  need_int('CausalSelfAttention', 'n_head', H)
  if C % H ~= 0 then raise(string.format('CausalSelfAttention: n_embd %d is not a multiple of n_head %d', C, H)) end
  self.n_embd, self.n_head, self.dropout = C, H, cfg.dropout or 0
  local o = {bias = cfg.bias, dtype = cfg.dtype, device = cfg.device}
  self.qkv = Linear(C, 3 * C, o)
  self.proj = Linear(C, C, o)
  self.resid_drop = Dropout(self.dropout)
end
function CausalSelfAttention:forward(x)
  if x:dim() ~= 3 or x:size(3) ~= self.n_embd then
    raise(string.format('CausalSelfAttention: x must be (B, T, %d), got %s', self.n_embd, shape_str(x.shape)))
  end
  local B, T, C = x:size(1), x:size(2), x:size(3)
  local H = self.n_head
  local hd = C / H
  local qkv = self.qkv(x)
  local dropout = self.training and self.dropout or 0
  local y
  -- flash attention straight from the qkv buffer (no permute copies) where
  -- nn.attention would take flash attention: the head dims of flash_dim, no
  -- attention dropout, and nn.attention not swapped for another core
  if gp.attention and gp.attention_qkv and nn.attention == default_attention and dropout == 0 and flash_dim(x.dtype, hd, T) then
    y = gp.attention_qkv(qkv, H, {causal = true})
  else
    local function head(i) return qkv:narrow(3, (i - 1) * C + 1, C):reshape {B, T, H, hd}:transpose(2, 3) end
    y = nn.attention(head(1), head(2), head(3), {causal = true, dropout = dropout})
    y = y:transpose(2, 3):reshape {B, T, C}
  end
  return self.resid_drop(self.proj(y))
end
-- incremental attention: x (B, Tnew, C) holds positions pos .. pos+Tnew-1; their
-- keys and values are appended to layer `layer` of the KV cache and the queries
-- attend over every cached position (causally within the new ones). Uses
-- gp.attention (prefill) and gp.attention_decode (one token) when gpush has
-- them, else nn.attention (matmuls) over cache:keys(layer), cache:values(layer).
-- hd / 2 zero rotary frequencies (f32) on device, kept
local zeros_kept = {}
local function zero_freqs(hd, device)
  local key = hd .. device
  local z = zeros_kept[key]
  if not z then z = gp.zeros({hd / 2}, {dtype = 'f32', device = device}); zeros_kept[key] = z end
  return z
end

function CausalSelfAttention:forward_cached(x, cache, layer, pos)
  local B, T, C = x:size(1), x:size(2), x:size(3)
  local H = self.n_head
  local hd = C / H
  local qkv = self.qkv(x)
  local function head(i) return qkv:narrow(3, (i - 1) * C + 1, C):reshape {B, T, H, hd}:transpose(2, 3) end
  local q = head(1)
  if type(pos) == 'table' then -- device positions (one token; see GPT:forward_cached): nothing read on the host
    if T == 1 and cache.rope_append_at and hd % 2 == 0 and (cache.kv_dtype or cache.dtype == qkv.dtype) then
      -- k and v written and q copied out in one kernel: rope_kv_at turned by zero angles (cos 0 = 1 and sin 0 = 0
      -- exactly: no rotation)
      local q1 = cache:rope_append_at(layer, qkv:reshape {B, 3 * C}, pos.pos, zero_freqs(hd, x.device), H)
      local y = cache:attend_at(layer, q1, pos.lens, {scale = 1 / math.sqrt(hd)})
      return self.proj(y:view {B, T, C})
    end
    cache:append_at(layer, head(2), head(3), pos.pos)
    local y = cache:attend_at(layer, q:reshape {B, H, hd}, pos.lens, {scale = 1 / math.sqrt(hd)})
    return self.proj(y:reshape {B, H, 1, hd}:transpose(2, 3):reshape {B, T, C})
  end
  cache:append(layer, head(2), head(3))
  local function check_len(S)
    if S ~= pos + T then
      raise(string.format('forward_cached: layer %d of the cache holds %d positions after appending %d at position %d (expected %d)',
        layer, S, T, pos, pos + T))
    end
  end
  local y
  if cache.kv_dtype then -- a compressed gp.KVCache: decode reads its codes; a prefill at 0 attends over its own k, v
    check_len(cache:len(layer))
    if T == 1 then
      y = cache:attend(layer, q:reshape {B, H, hd}, {scale = 1 / math.sqrt(hd)}):reshape {B, H, 1, hd}
    else
      if pos > 0 and gp.attention_supported('decode', q.dtype, hd) then -- the codes read directly
        y = cache:attend_chunk(layer, q:transpose(2, 3), {scale = 1 / math.sqrt(hd)}):transpose(2, 3)
      else
        local keys, vals = head(2), head(3)
        if pos > 0 then keys, vals = cache:keys(layer), cache:values(layer) end
        y = nn.attention(q, keys, vals, {causal = true})
      end
    end
    return self.proj(y:transpose(2, 3):reshape {B, T, C})
  end
  local keys, vals = cache:keys(layer), cache:values(layer)
  local S = keys:size(3)
  check_len(S)
  if T == 1 and gp.attention_decode and gp.attention_supported('decode', q.dtype, hd) and keys.dtype == q.dtype then
    local lens = gp.full({B}, S, {dtype = 'i64', device = x.device})
    y = gp.attention_decode(q:reshape {B, H, hd}, keys, vals, lens, {scale = 1 / math.sqrt(hd)}):reshape {B, H, 1, hd}
  else -- nn.attention takes flash attention (gp.attention) where it applies
    y = nn.attention(q, keys, vals, {causal = T > 1})
  end
  y = y:transpose(2, 3):reshape {B, T, C}
  return self.proj(y)
end
function CausalSelfAttention:extra_repr() return string.format('n_embd=%d, n_head=%d', self.n_embd, self.n_head) end

doc(nn.attention, 'nn.attention(q, k, v, {causal=false, scale=1/sqrt(d), dropout=0, mask=nil})',
  'softmax(q k^T * scale + mask) v over the last two dims; q (..., T, d), k (..., S, d), v (..., S, dv); 4-d q (B, H, T, d) may take k, v with Hkv heads dividing H (grouped-query attention: passed as they are to flash attention, repeated with nn.repeat_kv on the matmul path); mask: an additive mask broadcast to (..., T, S) (e.g. (B, 1, 1, S), -inf on padding); the attention core (assign nn.attention to swap it); flash attention (gp.attention) when there is no mask, dropout is 0, d = dv, gp.attention_supported(\'flash\', dtype, d, S) and S >= T if causal')
doc(nn.repeat_kv, 'nn.repeat_kv(t, H)', 'k or v (B, Hkv, S, d) -> (B, H, S, d), each KV head repeated for its H / Hkv query heads (a copy; t itself when Hkv = H)')
doc(nn.causal_mask, 'nn.causal_mask(T, S, device, dtype)', 'the cached additive causal mask (T, S): 0 where key j <= i + S - T, else -inf')
doc(nn.clear_mask_cache, 'nn.clear_mask_cache()', 'forget the cached causal masks')
doc(nn.CausalSelfAttention, 'nn.CausalSelfAttention{n_embd=, n_head=, dropout=0, bias=true}',
  'multi-head causal self-attention on (B, T, n_embd) through nn.attention (through gp.attention_qkv, ' ..
  'straight from the qkv buffer, where nn.attention would take flash attention and is not swapped)')

return nn
