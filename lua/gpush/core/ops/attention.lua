-- Attention (kernels/attention.*): gp.attention (flash attention, with
-- autograd), gp.attention_qkv (the same straight from a fused (B, T, 3C) qkv
-- buffer: no permute copies), gp.attention_decode (one new token over a KV
-- cache) and gp.KVCache (preallocated per-layer key/value buffers). Keys and
-- values may have fewer heads than the queries (grouped-query attention: Hkv
-- dividing H, query head h reading KV head h / (H / Hkv)); the kernels take
-- them as they are, never repeated in memory.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local dtype = require 'gpush.core.dtype'
local ffi = require 'ffi'
local FLOAT = dtype.FLOAT
local raise, empty, shape_str, is_tensor = rt.raise, tensor.empty, tensor.shape_str, tensor.is_tensor
local K, C = tensor.K, rt.C

-- what the attention kernels take is asked of C (kernels/attention.c holds the table)
function gp.attention_supported(kind, dt, head_dim, seq_k)
  return C.gp_attention_supported(kind, dtype.DT[dt] or -1, head_dim, seq_k or 0) == 1
end
gp.doc(gp.attention_supported, "gp.attention_supported('fwd'|'bwd'|'decode'|'flash', dtype, head_dim, seq_k)",
  "true when that attention kernel takes q of this dtype and head dim ('flash': when nn.attention takes the flash kernels for seq_k keys)")
local dims_buf = ffi.new('char[128]')
local function head_dims(kind) return ffi.string(C.gp_attention_head_dims(dims_buf, 128, kind)) end

local function need(x, op, name)
  if not is_tensor(x) then raise(string.format('%s: %s must be a tensor, got %s', op, name, type(x))) end
end
local function nonneg_int(op, name, v)
  if v == nil then return 0 end
  if type(v) ~= 'number' or v ~= math.floor(v) or v < 0 then
    raise(string.format('%s: %s must be an integer >= 0, got %s', op, name, tostring(v)))
  end
  return v
end
local function same_dev(op, a, an, b, bn)
  if b.device ~= a.device then
    raise(string.format('%s: %s is on %s but %s is on %s (move one with :to())', op, bn, b.device, an, a.device))
  end
end
-- the flash kernels read q, k, v, out, dout, dq, dk, dv at any strides on
-- the leading dims with stride 1 on the last; bf16/f16 take the tensor-core
-- path when the base is 16-byte aligned and every other stride (of a dim
-- longer than 1) a multiple of 8 elements. fits(t): t may go to the kernel
-- as it is (else it is made contiguous, one copy).
local HALF = {bf16 = true, f16 = true}
local function fits(t)
  local n = t:dim()
  if t:size(n) > 1 and t:stride(n) ~= 1 then return false end
  if not HALF[t.dtype] then return true end
  for d = 1, n - 1 do
    if t:size(d) > 1 and t:stride(d) % 8 ~= 0 then return false end
  end
  local c = t.c
  return tonumber(ffi.cast('uintptr_t', c.data) % 16) == 0 and tonumber(c.offset) % 8 == 0
end
local function usable(t) return fits(t) and t or t:contiguous() end
-- b in a's dtype, in a layout the flash kernels read as it is
local function as(b, a) return usable(tensor.to_dtype(b, a.dtype)) end
-- b in a's dtype, contiguous (attn_decode)
local function as_contiguous(b, a) return tensor.to_dtype(b, a.dtype):contiguous() end

-- an empty (B, H, R, D) tensor of dtype, dense in x's order of the B, H, R
-- dims (D last): the gradient of a permuted view (a head of a (B, T, H, D)
-- buffer) comes out as the same permutation of a contiguous tensor, so the
-- permute's backward gives a contiguous gradient (no copy afterwards)
local function empty_like_rows(x, dt, op)
  local s, st = x.shape, x:stride()
  local order = {1, 2, 3}
  table.sort(order, function(a, b)
    if st[a] ~= st[b] then return st[a] > st[b] end
    return a < b
  end)
  local t = empty({s[order[1]], s[order[2]], s[order[3]], s[4]}, dt, x.device, op)
  if order[1] == 1 and order[2] == 2 then return t end
  local inv = {}
  for i = 1, 3 do inv[order[i]] = i end
  return t:permute {inv[1], inv[2], inv[3], 4}
end

-- causal, scale, window, n_global from opts; the S >= T check
local function attn_opts(op, D, Tq, S, opts, shapes)
  opts = opts or {}
  local causal = opts.causal
  if causal == nil then causal = true end
  local window = nonneg_int(op, 'window', opts.window)
  local n_global = nonneg_int(op, 'n_global', opts.n_global)
  local scale = opts.scale or 1 / math.sqrt(D)
  if (causal or window > 0) and Tq > S then
    raise(string.format('%s: causal or windowed attention needs S >= T (queries are the last T of S positions); %s',
      op, shapes()))
  end
  return scale, window, n_global, causal and 1 or 0
end

-- Hkv (k's heads) must divide H (q's): grouped-query attention, H / Hkv query
-- heads to a KV head (1: multi-query); what names the shapes in the error
local function check_groups(op, H, Hkv, what)
  if Hkv < 1 and H > 0 or Hkv > 0 and H % Hkv ~= 0 then
    raise(string.format('%s: the %d KV heads must divide the %d query heads (grouped-query attention: query head h ' ..
      'reads KV head h / (H / Hkv)); %s', op, Hkv, H, what()))
  end
end

-- checks q (B, H, T, D), k and v (B, Hkv, S, D) with Hkv dividing H; returns
-- them in q's dtype, in a layout the kernels read (views as they are), and the options
local function prepare(op, q, k, v, opts)
  need(q, op, 'q'); need(k, op, 'k'); need(v, op, 'v')
  same_dev(op, q, 'q', k, 'k'); same_dev(op, q, 'q', v, 'v')
  if not FLOAT[q.dtype] then raise(string.format('%s: q must be a float tensor, got %s', op, q.dtype)) end
  local qs, ks, vs = q.shape, k.shape, v.shape
  local function shapes() return string.format('got q %s, k %s, v %s', shape_str(qs), shape_str(ks), shape_str(vs)) end
  if #qs ~= 4 or #ks ~= 4 or #vs ~= 4 or ks[1] ~= qs[1] or ks[4] ~= qs[4] or shape_str(vs) ~= shape_str(ks) then
    raise(string.format('%s: q must be (B, H, T, D) and k, v (B, Hkv, S, D) with Hkv dividing H; %s', op, shapes()))
  end
  check_groups(op, qs[2], ks[2], shapes)
  if not gp.attention_supported('fwd', q.dtype, qs[4]) then
    raise(string.format('%s: head dim %d is not supported (supported: %s); q is %s', op, qs[4], head_dims('fwd'), shape_str(qs)))
  end
  local scale, window, n_global, causal = attn_opts(op, qs[4], qs[3], ks[3], opts, function()
    return string.format('q is %s, k is %s', shape_str(qs), shape_str(ks))
  end)
  return usable(q), as(k, q), as(v, q), scale, window, n_global, causal
end

-- out in q's layout (the kernels write it at any strides): for heads of a
-- (B, T, H, D) buffer, out:transpose(2, 3) is a contiguous (B, T, H, D), so
-- the (B, T, H * D) input of the output projection is a view, not a copy
function gp.attention(q, k, v, opts)
  local qc, kc, vc, scale, window, ng, causal = prepare('attention', q, k, v, opts)
  local s = qc.shape
  local out = empty_like_rows(qc, qc.dtype, 'attention')
  local lse = empty({s[1], s[2], s[3]}, 'f32', qc.device, 'attention')
  K.attn_fwd(out, lse, qc, kc, vc, scale, window, ng, causal)
  return out, lse
end
gp.doc(gp.attention, 'gp.attention(q, k, v, {causal=true, scale=1/sqrt(D), window=0, n_global=0})',
  'flash attention: softmax(q k^T * scale + mask) v for q (B, H, T, D), k, v (B, Hkv, S, D), D a head dim gp.attention_supported(\'fwd\', ...) takes; ' ..
  'Hkv < H is grouped-query attention (Hkv divides H; query head h reads KV head h / (H / Hkv); Hkv 1: multi-query), ' ..
  'k and v never repeated in memory; ' ..
  'queries are the last T of S positions (query i sees keys j <= i + S - T when causal); window > 0 keeps keys ' ..
  'with p - j < window, plus the first n_global keys; returns out (B, H, T, D), laid out as q is (the heads of a ' ..
  '(B, T, H, D) buffer give out:transpose(2, 3) contiguous), and lse (B, H, T) (f32 logsumexp); differentiable ' ..
  '(dk, dv have Hkv heads: summed over each KV head\'s query heads)')

autograd.def_function('attention', function(g, a, o)
  if not g[1] then return end
  local qc, kc, vc, scale, window, ng, causal = prepare('attention', a[1], a[2], a[3], a[4])
  -- gradients in the layout of their inputs (a[i], before any cast or copy)
  local function like(x, c) return empty_like_rows(fits(x) and x or c, qc.dtype, 'attention') end
  local dq, dk, dv = like(a[1], qc), like(a[2], kc), like(a[3], vc)
  K.attn_bwd(dq, dk, dv, qc, kc, vc, o[1], o[2], as(g[1], qc), scale, window, ng, causal)
  return dq, dk, dv
end, {nout = 1})

-- qkv (B, T, (H + 2 Hkv) D) as a fused qkv Linear writes it (q | k | v with
-- H, Hkv, Hkv heads; Hkv = opts.n_kv_head, default H): the tensor the kernels
-- read (qkv itself when it fits, else a contiguous copy) and B, T, H, Hkv, D
local function qkv_input(op, qkv, n_head, opts)
  need(qkv, op, 'qkv')
  if type(n_head) ~= 'number' or n_head ~= math.floor(n_head) or n_head < 1 then
    raise(string.format('%s: n_head must be an integer >= 1, got %s', op, tostring(n_head)))
  end
  local n_kv = opts and opts.n_kv_head or n_head
  if type(n_kv) ~= 'number' or n_kv ~= math.floor(n_kv) or n_kv < 1 then
    raise(string.format('%s: n_kv_head must be an integer >= 1, got %s', op, tostring(n_kv)))
  end
  local s = qkv.shape
  local parts = n_head + 2 * n_kv
  local kv_str = n_kv == n_head and '' or string.format(' and n_kv_head %d', n_kv)
  if #s ~= 3 or s[3] % parts ~= 0 then
    raise(string.format('%s: qkv must be (B, T, (n_head + 2 * n_kv_head) * D) with n_head %d%s; got %s', op, n_head,
      kv_str, shape_str(s)))
  end
  check_groups(op, n_head, n_kv, function() return string.format('qkv is %s with n_head %d%s', shape_str(s), n_head, kv_str) end)
  local D = s[3] / parts
  if not gp.attention_supported('fwd', qkv.dtype, D) then
    raise(string.format('%s: head dim %d is not supported (supported: %s); qkv is %s with n_head %d%s', op, D,
      head_dims('fwd'), shape_str(s), n_head, kv_str))
  end
  if not FLOAT[qkv.dtype] then raise(string.format('%s: qkv must be a float tensor, got %s', op, qkv.dtype)) end
  return usable(qkv), s[1], s[2], n_head, n_kv, D
end
-- the (B, h, T, D) views of q, k and v in x (B, T, (H + 2 Hkv) D): q's head h at columns h D ..,
-- k's at (H + h) D .., v's at (H + Hkv + h) D ..
local function heads3(x, B, T, H, Hkv, D)
  local function part(first, n) return x:narrow(3, first * D + 1, n * D):view {B, T, n, D}:transpose(2, 3) end
  return part(0, H), part(H, Hkv), part(H + Hkv, Hkv)
end

function gp.attention_qkv(qkv, n_head, opts)
  local op = 'attention_qkv'
  local x, B, T, H, Hkv, D = qkv_input(op, qkv, n_head, opts)
  local scale, window, ng, causal = attn_opts(op, D, T, T, opts)
  local y = empty({B, T, H, D}, x.dtype, x.device, op)
  local lse = empty({B, H, T}, 'f32', x.device, op)
  local q, k, v = heads3(x, B, T, H, Hkv, D)
  K.attn_fwd(y:transpose(2, 3), lse, q, k, v, scale, window, ng, causal)
  return y:view {B, T, H * D}, lse
end
gp.doc(gp.attention_qkv, 'gp.attention_qkv(qkv, n_head, {causal=true, scale=1/sqrt(D), window=0, n_global=0, n_kv_head=n_head})',
  'gp.attention straight from a fused qkv buffer: qkv (B, T, 3C) holds q | k | v along the last dim (head h of ' ..
  'each at columns h*D .. h*D+D-1, C = n_head * D, D as for gp.attention), as a Linear(C, 3C) writes it; with ' ..
  'n_kv_head = Hkv < n_head (grouped-query attention, Hkv dividing n_head) the buffer is (B, T, (n_head + 2 Hkv) D): ' ..
  'q | k | v with n_head, Hkv, Hkv heads; returns y ' ..
  '(B, T, C) (heads side by side, ready for the output projection) and lse (B, H, T); the kernels read the ' ..
  'strided heads in place (no permute copies); differentiable: one node whose backward writes dq, dk, dv ' ..
  'into one gradient of qkv\'s shape')

autograd.def_function('attention_qkv', function(g, a, o)
  if not g[1] then return end
  local op = 'attention_qkv'
  local x, B, T, H, Hkv, D = qkv_input(op, a[1], a[2], a[3])
  local scale, window, ng, causal = attn_opts(op, D, T, T, a[3])
  local gy = tensor.to_dtype(g[1], x.dtype)
  if not fits(gy) then gy = gy:contiguous() end
  local dqkv = empty({B, T, (H + 2 * Hkv) * D}, x.dtype, x.device, op)
  local dq, dk, dv = heads3(dqkv, B, T, H, Hkv, D)
  local q, k, v = heads3(x, B, T, H, Hkv, D)
  local function hv(t) return t:view {B, T, H, D}:transpose(2, 3) end
  K.attn_bwd(dq, dk, dv, q, k, v, hv(o[1]), o[2], hv(gy), scale, window, ng, causal)
  return dqkv
end, {nout = 1})

-- q (B, H, D) or (B, H, 1, D); kcache, vcache (B, H, C, D); lens [B] or a number
-- a number of cached keys as a (B) i32 tensor, kept for the next call with
-- the same (B, length, device) (weak: collected when no longer used)
local LENS = setmetatable({}, {__mode = 'v'})
local function lens_tensor(b, n, device)
  local key = device .. ':' .. b .. ':' .. n
  local t = LENS[key]
  if not t then
    t = gp.full({b}, n, {dtype = 'i32', device = device})
    LENS[key] = t
  end
  return t
end

-- decode attention of q over kcache, vcache (quant nil) or over a compressed
-- cache: kcache, vcache u8 codes and quant = {fmt = 1 | 2, ks =, vs =} their scales
local function decode(op, q, kcache, vcache, lens, opts, quant)
  need(q, op, 'q'); need(kcache, op, 'kcache'); need(vcache, op, 'vcache')
  same_dev(op, q, 'q', kcache, 'kcache'); same_dev(op, q, 'q', vcache, 'vcache')
  local qs, ks = q.shape, kcache.shape
  local q4 = #qs == 4
  if q4 and qs[3] ~= 1 then
    raise(string.format('%s: q must be (B, H, D) or (B, H, 1, D), got %s', op, shape_str(qs)))
  end
  local q3 = q4 and q:reshape {qs[1], qs[2], qs[4]} or q
  local s3 = q3.shape
  local vs = vcache.shape
  local function shapes()
    return string.format('got q %s, kcache %s, vcache %s', shape_str(qs), shape_str(ks), shape_str(vs))
  end
  if #s3 ~= 3 or #ks ~= 4 or ks[1] ~= s3[1] or ks[4] ~= s3[3] or #vs ~= 4 or vs[1] ~= ks[1] or
    vs[2] ~= ks[2] or vs[3] ~= ks[3] or vs[4] ~= ks[4] then
    raise(string.format('%s: q must be (B, H, D) and kcache, vcache (B, Hkv, C, D) with Hkv dividing H; %s', op, shapes()))
  end
  check_groups(op, s3[2], ks[2], shapes)
  if not FLOAT[q.dtype] then raise(string.format('%s: q must be a float tensor, got %s', op, q.dtype)) end
  if not gp.attention_supported('decode', q.dtype, s3[3]) then
    raise(string.format('%s: head dim %d is not supported (supported: %s); q is %s', op, s3[3], head_dims('decode'), shape_str(qs)))
  end
  if type(lens) == 'number' then
    if lens ~= math.floor(lens) or lens < 0 or lens > ks[3] then
      raise(string.format('%s: length %s is outside [0, %d] (kcache %s)', op, tostring(lens), ks[3], shape_str(ks)))
    end
    lens = lens_tensor(s3[1], lens, q.device)
  end
  need(lens, op, 'lens')
  same_dev(op, q, 'q', lens, 'lens')
  if lens.dtype ~= 'i32' and lens.dtype ~= 'i64' then lens = lens:to('i64') end
  opts = opts or {}
  -- the query takes the cache's dtype (never the other way: no copy of the cache per step)
  local cdt = not quant and FLOAT[kcache.dtype] and kcache.dtype or q.dtype
  local qc = tensor.to_dtype(q3, cdt):contiguous()
  local out = empty(s3, cdt, q.device, op)
  local scale, window, ng = opts.scale or 1 / math.sqrt(s3[3]), nonneg_int(op, 'window', opts.window),
    nonneg_int(op, 'n_global', opts.n_global)
  if quant then
    K.attn_decode_q(out, qc, kcache, vcache, quant.ks, quant.vs, lens:contiguous(), scale, window, ng, quant.fmt)
  else
    K.attn_decode(out, qc, as_contiguous(kcache, qc), as_contiguous(vcache, qc), lens:contiguous(), scale, window, ng)
  end
  if cdt ~= q.dtype then out = tensor.to_dtype(out, q.dtype) end
  return q4 and out:view(qs) or out
end
function gp.attention_decode(q, kcache, vcache, lens, opts)
  return decode('attention_decode', q, kcache, vcache, lens, opts)
end
gp.doc(gp.attention_decode, 'gp.attention_decode(q, kcache, vcache, lens, {scale=, window=0, n_global=0})',
  'one new query per sequence (q (B, H, D) or (B, H, 1, D)) over the first lens[b] entries of kcache, vcache ' ..
  '(B, Hkv, C, D), at position lens[b] - 1 (window and n_global as in gp.attention); Hkv dividing H: grouped-query ' ..
  'attention (query head h reads KV head h / (H / Hkv)); lens: i32/i64 [B] or a number; ' ..
  'split along the cache on the GPU (flash-decoding)')

---------------------------------------------------------------------------
-- KV cache: per layer (B, H, capacity, D) keys and values, filled in place;
-- H is the model's KV heads (grouped-query attention stores each once), and
-- attend / attend_at take queries with any multiple of H heads

local KVCache = {}
KVCache.__index = KVCache
-- compressed caches: kv_dtype -> the kvcache kernels' fmt (kernels/kvquant.h)
local KV_FMT = {int8 = 1, fp8 = 2}
gp.KVCacheClass = KVCache

local function pos_int(op, name, v, default)
  if v == nil then v = default end
  if type(v) ~= 'number' or v ~= math.floor(v) or v < 1 then
    raise(string.format('%s: %s must be an integer >= 1, got %s', op, name, tostring(v)))
  end
  return v
end

function gp.KVCache(o)
  local op = 'KVCache'
  if type(o) ~= 'table' then raise('KVCache: give a table {batch=, heads=, capacity=, head_dim=, layers=, dtype=, device=}') end
  local self = setmetatable({}, KVCache)
  self.batch = pos_int(op, 'batch', o.batch)
  self.heads = pos_int(op, 'heads', o.heads)
  self.capacity = pos_int(op, 'capacity', o.capacity)
  self.head_dim = pos_int(op, 'head_dim', o.head_dim)
  self.layers = pos_int(op, 'layers', o.layers, 1)
  self.dtype = o.dtype or 'f32'
  self.device = o.device or gp.device()
  local kvd = o.kv_dtype
  if kvd == self.dtype then kvd = nil end
  if kvd ~= nil and not KV_FMT[kvd] then
    raise(string.format("KVCache: kv_dtype must be 'int8' or 'fp8' (compressed keys and values), or nil / the dtype " ..
      "(%s), got %s", self.dtype, type(kvd) == 'string' and "'" .. kvd .. "'" or tostring(kvd)))
  end
  self.kv_dtype, self.fmt = kvd, KV_FMT[kvd]
  if o.center ~= nil and type(o.center) ~= 'boolean' then
    raise(string.format('KVCache: center must be true or false, got %s', tostring(o.center)))
  end
  self.center = kvd == 'int8' and o.center ~= false
  self.k, self.v, self._lens, self.fill = {}, {}, {}, {}
  local shape = {self.batch, self.heads, self.capacity, self.head_dim}
  local to = {dtype = self.fmt and 'u8' or self.dtype, device = self.device}
  if self.fmt then
    -- codes (u8) and an f32 scale per position and head; kc: the keys' center per head (kernels/kvquant.h): int8,
    -- the mean of the keys a prefill appends to the empty layer (0 until then); fp8 (whose error is relative to
    -- each element, not to the row's max) and center = false, 0; _c0 the values' (0); _pos: append's position on
    -- the device
    self.ks, self.vs, self.kc = {}, {}, {}
    self._c0 = gp.zeros({self.batch, self.heads, self.head_dim}, {device = self.device})
    self._pos = gp.zeros({1}, {dtype = 'i64', device = self.device})
  end
  for l = 1, self.layers do
    self.k[l] = gp.zeros(shape, to)
    self.v[l] = gp.zeros(shape, to)
    if self.fmt then
      self.ks[l] = gp.zeros({self.batch, self.heads, self.capacity}, {device = self.device})
      self.vs[l] = gp.zeros({self.batch, self.heads, self.capacity}, {device = self.device})
      self.kc[l] = gp.zeros({self.batch, self.heads, self.head_dim}, {device = self.device})
    end
    self._lens[l] = gp.zeros({self.batch}, {dtype = 'i32', device = self.device})
    self.fill[l] = 0
  end
  return self
end
gp.doc(gp.KVCache, 'gp.KVCache{batch=, heads=, capacity=, head_dim=, layers=1, dtype=f32, device=, kv_dtype=nil, center=true}',
  'preallocated keys and values per layer (B, H, capacity, D), H the KV heads (grouped-query attention: fewer than ' ..
  'the query heads, which attend and attend_at take as they are): cache:append(layer, k, v) writes (B, H, Tnew, D) ' ..
  'in place (no device allocation), cache:len(), cache:reset(), cache:keys(layer), cache:values(layer) (views of ' ..
  'the filled part), cache:lens(layer) (i32 [B] on the device), cache:attend(layer, q, opts) (decode attention), ' ..
  'cache:attend_chunk(layer, q, opts) (a prefill chunk after its append); never grows: going past capacity is an ' ..
  'error. kv_dtype = \'int8\' or \'fp8\' (e4m3) stores keys and values as one-byte codes with an f32 scale per ' ..
  'position and head (quantized on append, read directly by decode attention and attend_chunk; keys/values return ' ..
  'dequantized copies in dtype); int8 quantizes keys less a center per head, the mean of the keys appended first ' ..
  '(a shift softmax does not see; center = false: as they are); cache:nbytes() is the device memory it holds')

function KVCache:_layer(op, layer)
  if type(layer) ~= 'number' or layer ~= math.floor(layer) or layer < 1 or layer > self.layers then
    raise(string.format('KVCache:%s: layer must be an integer in 1..%d, got %s', op, self.layers, tostring(layer)))
  end
  return layer
end

function KVCache:append(layer, k, v)
  self:_layer('append', layer)
  local want = string.format('(%d, %d, Tnew, %d)', self.batch, self.heads, self.head_dim)
  for _, x in ipairs {{k, 'k'}, {v, 'v'}} do
    local t, name = x[1], x[2]
    need(t, 'KVCache:append', name)
    local s = t.shape
    if #s ~= 4 or s[1] ~= self.batch or s[2] ~= self.heads or s[4] ~= self.head_dim then
      raise(string.format('KVCache:append: %s must be %s, got %s', name, want, shape_str(s)))
    end
    if t.device ~= self.device then
      raise(string.format('KVCache:append: %s is on %s but the cache is on %s', name, t.device, self.device))
    end
  end
  local n = k:size(3)
  if v:size(3) ~= n then
    raise(string.format('KVCache:append: k %s and v %s differ in length', shape_str(k.shape), shape_str(v.shape)))
  end
  local pos = self.fill[layer]
  if pos + n > self.capacity then
    raise(string.format('KVCache:append: layer %d holds %d of %d positions; %d more would exceed the capacity ' ..
      '(the cache never grows)', layer, pos, self.capacity, n))
  end
  if n == 0 then return self end
  if self.fmt then
    K.fill(self._pos, pos)
    -- the first keys of a layer set its center (in place: a captured decode step reads the same tensor)
    if pos == 0 and self.center then
      K.copy(self.kc[layer], n > 1 and tensor.to_dtype(k, 'f32'):mean(3) or self._c0)
    end
    self:_quant(layer, k, v, self._pos)
  else
    K.copy(self.k[layer]:narrow(3, pos + 1, n), k)
    K.copy(self.v[layer]:narrow(3, pos + 1, n), v)
  end
  self.fill[layer] = pos + n
  K.fill(self._lens[layer], pos + n)
  return self
end

-- device positions: k, v (B, H, Tnew, D) written at the position held by pos
-- (an i32/i64 [1] tensor on the cache's device), read on the device (for
-- steps captured as CUDA graphs); the host count (len) is not advanced and
-- going past capacity is an error at the next synchronization on the GPU
function KVCache:append_at(layer, k, v, pos)
  self:_layer('append_at', layer)
  need(pos, 'KVCache:append_at', 'pos')
  if self.fmt then return self:_quant(layer, k, v, pos) end
  K.write_at(self.k[layer], k, pos)
  K.write_at(self.v[layer], v, pos)
  return self
end
-- one decode token a row from its fused projection qkv (B, (H + 2 Hkv) D) =
-- [q heads | k heads | v heads]: k turned by pos * inv_freq and written with v
-- at the device position pos, in one kernel (rope_kv_at; a compressed cache:
-- rope_kv_quant_at, k and v quantized as they are written); returns q (B, H,
-- D) turned the same (gp.rope's layout)
function KVCache:rope_append_at(layer, qkv, pos, inv_freq, H)
  layer = self:_layer('rope_append_at', layer)
  need(qkv, 'KVCache:rope_append_at', 'qkv')
  need(pos, 'KVCache:rope_append_at', 'pos')
  local kc = self.k[layer]
  local q = empty({qkv:size(1), H, kc:size(4)}, self.fmt and qkv.dtype or kc.dtype, kc.device, 'KVCache:rope_append_at')
  if self.fmt then
    K.rope_kv_quant_at(q, kc, self.v[layer], self.ks[layer], self.vs[layer], self.kc[layer], qkv, pos, inv_freq,
      self.fmt)
  else
    K.rope_kv_at(q, kc, self.v[layer], qkv, pos, inv_freq)
  end
  return q
end
-- compressed: k, v quantized into layer's codes and scales at the device position pos
function KVCache:_quant(layer, k, v, pos)
  K.kv_quant_append(self.k[layer], self.ks[layer], usable(k), self.kc[layer], pos, self.fmt)
  K.kv_quant_append(self.v[layer], self.vs[layer], usable(v), self._c0, pos, self.fmt)
  return self
end
-- decode attention of q (B, H, D) over the first lens[b] positions of layer
function KVCache:attend_at(layer, q, lens, opts)
  layer = self:_layer('attend_at', layer)
  if self.fmt then
    return decode('KVCache:attend_at', q, self.k[layer], self.v[layer], lens, opts,
      {fmt = self.fmt, ks = self.ks[layer], vs = self.vs[layer]})
  end
  return gp.attention_decode(q, self.k[layer], self.v[layer], lens, opts)
end
-- a prefill chunk: q (B, T, Hq, D), the queries of the layer's last T
-- positions (appended already), over every filled position up to each (causal;
-- opts.scale, window, n_global as in gp.attention); returns (B, T, Hq, D), the
-- model's layout. A compressed cache's codes are read directly
-- (gp.k.attn_chunk_q: no dequantized copy); a cache in its dtype goes to
-- gp.attention over keys/values (head dims 32, 64, 128)
function KVCache:attend_chunk(layer, q, opts)
  local op = 'KVCache:attend_chunk'
  layer = self:_layer('attend_chunk', layer)
  need(q, op, 'q')
  opts = opts or {}
  local s, n = q.shape, self.fill[layer]
  if #s ~= 4 or s[1] ~= self.batch or s[4] ~= self.head_dim or s[3] < 1 or s[3] % self.heads ~= 0 then
    raise(string.format('%s: q must be (%d, T, Hq, %d) with Hq a multiple of the cache\'s %d heads, got %s', op,
      self.batch, self.head_dim, self.heads, shape_str(s)))
  end
  if s[2] > n then
    raise(string.format('%s: q holds %d queries but layer %d holds %d positions (append the chunk\'s keys and ' ..
      'values first)', op, s[2], layer, n))
  end
  same_dev(op, self.k[layer], 'the cache', q, 'q')
  if not FLOAT[q.dtype] then raise(string.format('%s: q must be a float tensor, got %s', op, q.dtype)) end
  local scale = opts.scale or 1 / math.sqrt(s[4])
  local window, ng = nonneg_int(op, 'window', opts.window), nonneg_int(op, 'n_global', opts.n_global)
  if not self.fmt or not gp.attention_supported('decode', q.dtype, s[4]) then
    -- a cache in its dtype (or a head dim the decode kernels do not take): flash attention over keys/values
    if not gp.attention_supported('fwd', q.dtype, s[4]) then
      raise(string.format('%s: head dim %d is not supported (supported: %s); nn.attention over cache:keys(layer), ' ..
        'cache:values(layer) takes any', op, s[4], head_dims('fwd')))
    end
    local keys, vals = tensor.to_dtype(self:keys(layer), q.dtype), tensor.to_dtype(self:values(layer), q.dtype)
    local y = gp.attention(q:transpose(2, 3), keys, vals, {causal = true, scale = scale, window = window, n_global = ng})
    return y:transpose(2, 3)
  end
  local qc = q:contiguous()
  local out = empty(s, q.dtype, q.device, op)
  K.attn_chunk_q(out, qc, self.k[layer], self.v[layer], self.ks[layer], self.vs[layer], self._lens[layer], scale,
    window, ng, self.fmt)
  return out
end
-- the lengths of a device-position decode step (one token per row at the
-- position held by pos, for CUDA graphs): checks idx (B, 1) and pos (i64 [1]
-- on idx's device) in the name of op and returns an i64 [B] tensor holding
-- pos + 1, kept on the cache and refilled on the device each call
function KVCache:step_lens(op, idx, pos)
  local B, T = idx:size(1), idx:size(2)
  if T ~= 1 or pos:numel() ~= 1 or pos.dtype ~= 'i64' or pos.device ~= idx.device then
    raise(string.format('%s: with a device position, idx must be (B, 1) and pos an i64 [1] tensor on %s; ' ..
      'got idx %s, pos %s %s on %s', op, idx.device, shape_str(idx.shape), pos.dtype, shape_str(pos.shape), pos.device))
  end
  local lens = rawget(self, '_step_lens')
  if not lens or lens:size(1) ~= B or lens.device ~= idx.device then
    lens = empty({B}, 'i64', idx.device, op)
    rawset(self, '_step_lens', lens)
  end
  K.add_s(lens, pos:view {1}, 1) -- every row attends over positions 0..pos
  return lens
end
-- set the host count of every layer (after appends at device positions)
function KVCache:set_len(n)
  if type(n) ~= 'number' or n ~= math.floor(n) or n < 0 or n > self.capacity then
    raise(string.format('KVCache:set_len: n must be an integer in [0, %d], got %s', self.capacity, tostring(n)))
  end
  for l = 1, self.layers do
    self.fill[l] = n
    K.fill(self._lens[l], n)
  end
  return self
end

function KVCache:len(layer) return self.fill[self:_layer('len', layer or 1)] end
function KVCache:reset()
  for l = 1, self.layers do
    self.fill[l] = 0
    K.fill(self._lens[l], 0)
    if self.fmt then K.fill(self.kc[l], 0) end
  end
  return self
end
-- the filled part of codes t with scales sc and center c, dequantized into a new (B, H, len, D) tensor of the cache's dtype
function KVCache:_dequant(layer, t, sc, c)
  local out = empty({self.batch, self.heads, self.fill[layer], self.head_dim}, self.dtype, self.device, 'KVCache')
  K.kv_dequant(out, t, sc, c, self.fmt)
  return out
end
function KVCache:keys(layer)
  layer = self:_layer('keys', layer or 1)
  if self.fmt then return self:_dequant(layer, self.k[layer], self.ks[layer], self.kc[layer]) end
  return self.k[layer]:narrow(3, 1, self.fill[layer])
end
function KVCache:values(layer)
  layer = self:_layer('values', layer or 1)
  if self.fmt then return self:_dequant(layer, self.v[layer], self.vs[layer], self._c0) end
  return self.v[layer]:narrow(3, 1, self.fill[layer])
end
function KVCache:lens(layer) return self._lens[self:_layer('lens', layer or 1)] end
function KVCache:attend(layer, q, opts)
  layer = self:_layer('attend', layer)
  return self:attend_at(layer, q, self._lens[layer], opts)
end
-- device bytes held: codes (or values), scales and lengths
function KVCache:nbytes()
  local n = 0
  for l = 1, self.layers do
    for _, t in ipairs {self.k[l], self.v[l], self._lens[l], self.ks and self.ks[l], self.vs and self.vs[l],
                        self.kc and self.kc[l]} do
      if t then n = n + t:numel() * t:element_size() end
    end
  end
  return n
end
local D = gp.doc
D(KVCache.append, 'cache:append(layer, k, v)', 'write k, v (B, H, Tnew, D) at the next positions of layer, in place; an error past capacity')
D(KVCache.len, 'cache:len(layer=1)', 'positions filled in layer')
D(KVCache.append_at, 'cache:append_at(layer, k, v, pos)', 'write k, v (B, H, Tnew, D) at the position held by the device tensor pos (i64 [1]); for CUDA graphs: nothing read on the host, len not advanced')
D(KVCache.rope_append_at, 'cache:rope_append_at(layer, qkv, pos, inv_freq, H)', 'one decode token a row from its fused projection qkv (B, (H + 2 Hkv) D) = [q heads | k heads | v heads]: k turned by pos * inv_freq (gp.rope\'s layout) and written with v at the position held by the device tensor pos, in one kernel (gp.k.rope_kv_at; a compressed cache: gp.k.rope_kv_quant_at, k and v quantized as written); returns q (B, H, D) turned the same')
D(KVCache.attend_chunk, 'cache:attend_chunk(layer, q, {scale=, window=0, n_global=0})', 'a prefill chunk after its append: q (B, T, Hq, D) holds the queries of layer\'s last T positions, each attending causally over the filled positions up to it; returns (B, T, Hq, D) (the model\'s layout). kv_dtype int8/fp8: the codes are read directly (gp.k.attn_chunk_q, no dequantized copy; head dims 64 and 128)')
D(KVCache.attend_at, 'cache:attend_at(layer, q, lens, opts)', 'gp.attention_decode of q (B, Hq, D) over the first lens[b] positions of layer (lens a device tensor; Hq a multiple of the cache\'s heads)')
D(KVCache.step_lens, 'cache:step_lens(op, idx, pos)', 'i64 [B] device lengths pos + 1 for a device-position decode step of idx (B, 1) at pos (i64 [1]); an error naming op otherwise')
D(KVCache.set_len, 'cache:set_len(n)', 'set the filled count of every layer (after append_at)')
D(KVCache.reset, 'cache:reset()', 'empty every layer (the buffers are kept)')
D(KVCache.keys, 'cache:keys(layer=1)', 'view (B, H, len, D) of the filled keys (kv_dtype int8/fp8: a dequantized copy in dtype)')
D(KVCache.values, 'cache:values(layer=1)', 'view (B, H, len, D) of the filled values (kv_dtype int8/fp8: a dequantized copy in dtype)')
D(KVCache.nbytes, 'cache:nbytes()', 'device bytes the cache holds (keys, values, their scales and the keys\' centers when compressed, lengths)')
D(KVCache.lens, 'cache:lens(layer=1)', 'i32 [B] device tensor holding len (for gp.attention_decode)')
D(KVCache.attend, 'cache:attend(layer, q, opts)', 'gp.attention_decode of q (B, Hq, D) over the filled part of layer (Hq a multiple of the cache\'s heads: grouped-query attention)')
KVCache.__tostring = function(self)
  return string.format('KVCache(batch=%d, heads=%d, capacity=%d, head_dim=%d, layers=%d, %s%s, %s, len=%d)',
    self.batch, self.heads, self.capacity, self.head_dim, self.layers, self.dtype,
    self.kv_dtype and ' (stored ' .. self.kv_dtype .. ')' or '', self.device, self.fill[1])
end

return gp
