-- Attention (kernels/attention.*): gp.attention (flash attention, with
-- autograd), gp.attention_decode (one new token over a KV cache) and
-- gp.KVCache (preallocated per-layer key/value buffers).
return function(gp, tensor)
  local core = require 'gpush.core'
  local raise, empty, shape_str, is_tensor = core.raise, tensor.empty, tensor.shape_str, tensor.is_tensor
  local K = tensor.K
  local FLOAT = {f32 = true, bf16 = true, f16 = true, f64 = true}
  local HEAD_DIMS = {[64] = true, [128] = true}

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
  -- b as a contiguous tensor of a's dtype
  local function as(b, a) return tensor.to_dtype(b, a.dtype):contiguous() end

  -- checks q (B, H, T, D), k and v (B, H, S, D); returns them contiguous in q's dtype and the options
  local function prepare(op, q, k, v, opts)
    need(q, op, 'q'); need(k, op, 'k'); need(v, op, 'v')
    same_dev(op, q, 'q', k, 'k'); same_dev(op, q, 'q', v, 'v')
    if not FLOAT[q.dtype] then raise(string.format('%s: q must be a float tensor, got %s', op, q.dtype)) end
    local qs, ks, vs = q.shape, k.shape, v.shape
    if #qs ~= 4 or #ks ~= 4 or #vs ~= 4 or ks[1] ~= qs[1] or ks[2] ~= qs[2] or ks[4] ~= qs[4] or
      shape_str(vs) ~= shape_str(ks) then
      raise(string.format('%s: q must be (B, H, T, D) and k, v (B, H, S, D); got q %s, k %s, v %s', op, shape_str(qs),
        shape_str(ks), shape_str(vs)))
    end
    if not HEAD_DIMS[qs[4]] then
      raise(string.format('%s: head dim %d is not supported (supported: 64, 128); q is %s', op, qs[4], shape_str(qs)))
    end
    opts = opts or {}
    local causal = opts.causal
    if causal == nil then causal = true end
    local window = nonneg_int(op, 'window', opts.window)
    local n_global = nonneg_int(op, 'n_global', opts.n_global)
    local scale = opts.scale or 1 / math.sqrt(qs[4])
    if (causal or window > 0) and qs[3] > ks[3] then
      raise(string.format('%s: causal or windowed attention needs S >= T (queries are the last T of S positions); ' ..
        'q is %s, k is %s', op, shape_str(qs), shape_str(ks)))
    end
    return q:contiguous(), as(k, q), as(v, q), scale, window, n_global, causal and 1 or 0
  end

  function gp.attention(q, k, v, opts)
    local qc, kc, vc, scale, window, ng, causal = prepare('attention', q, k, v, opts)
    local s = qc.shape
    local out = empty(s, qc.dtype, qc.device, 'attention')
    local lse = empty({s[1], s[2], s[3]}, 'f32', qc.device, 'attention')
    K.attn_fwd(out, lse, qc, kc, vc, scale, window, ng, causal)
    return out, lse
  end
  gp.doc(gp.attention, 'gp.attention(q, k, v, {causal=true, scale=1/sqrt(D), window=0, n_global=0})',
    'flash attention: softmax(q k^T * scale + mask) v for q (B, H, T, D), k, v (B, H, S, D), D = 64 or 128; ' ..
    'queries are the last T of S positions (query i sees keys j <= i + S - T when causal); window > 0 keeps keys ' ..
    'with p - j < window, plus the first n_global keys; returns out and lse (B, H, T) (f32 logsumexp); differentiable')

  require('gpush.autograd').def_function('attention', function(g, a, o)
    if not g[1] then return end
    local qc, kc, vc, scale, window, ng, causal = prepare('attention', a[1], a[2], a[3], a[4])
    local dq = empty(qc.shape, qc.dtype, qc.device, 'attention')
    local dk = empty(kc.shape, qc.dtype, qc.device, 'attention')
    local dv = empty(kc.shape, qc.dtype, qc.device, 'attention')
    K.attn_bwd(dq, dk, dv, qc, kc, vc, o[1], o[2], as(g[1], qc), scale, window, ng, causal)
    return dq, dk, dv
  end, {nout = 1})

  -- q (B, H, D) or (B, H, 1, D); kcache, vcache (B, H, C, D); lens [B] or a number
  function gp.attention_decode(q, kcache, vcache, lens, opts)
    local op = 'attention_decode'
    need(q, op, 'q'); need(kcache, op, 'kcache'); need(vcache, op, 'vcache')
    same_dev(op, q, 'q', kcache, 'kcache'); same_dev(op, q, 'q', vcache, 'vcache')
    local qs, ks = q.shape, kcache.shape
    local q4 = #qs == 4
    if q4 and qs[3] ~= 1 then
      raise(string.format('%s: q must be (B, H, D) or (B, H, 1, D), got %s', op, shape_str(qs)))
    end
    local q3 = q4 and q:reshape {qs[1], qs[2], qs[4]} or q
    local s3 = q3.shape
    if #s3 ~= 3 or #ks ~= 4 or ks[1] ~= s3[1] or ks[2] ~= s3[2] or ks[4] ~= s3[3] or
      shape_str(vcache.shape) ~= shape_str(ks) then
      raise(string.format('%s: q must be (B, H, D) and kcache, vcache (B, H, C, D); got q %s, kcache %s, vcache %s', op,
        shape_str(qs), shape_str(ks), shape_str(vcache.shape)))
    end
    if not FLOAT[q.dtype] then raise(string.format('%s: q must be a float tensor, got %s', op, q.dtype)) end
    if not HEAD_DIMS[s3[3]] then
      raise(string.format('%s: head dim %d is not supported (supported: 64, 128); q is %s', op, s3[3], shape_str(qs)))
    end
    if type(lens) == 'number' then
      if lens ~= math.floor(lens) or lens < 0 or lens > ks[3] then
        raise(string.format('%s: length %s is outside [0, %d] (kcache %s)', op, tostring(lens), ks[3], shape_str(ks)))
      end
      lens = gp.full({s3[1]}, lens, {dtype = 'i32', device = q.device})
    end
    need(lens, op, 'lens')
    same_dev(op, q, 'q', lens, 'lens')
    if lens.dtype ~= 'i32' and lens.dtype ~= 'i64' then lens = lens:to('i64') end
    opts = opts or {}
    -- the query takes the cache's dtype (never the other way: no copy of the cache per step)
    local cdt = FLOAT[kcache.dtype] and kcache.dtype or q.dtype
    local qc = tensor.to_dtype(q3, cdt):contiguous()
    local out = empty(s3, cdt, q.device, op)
    K.attn_decode(out, qc, as(kcache, qc), as(vcache, qc), lens:contiguous(),
      opts.scale or 1 / math.sqrt(s3[3]), nonneg_int(op, 'window', opts.window),
      nonneg_int(op, 'n_global', opts.n_global))
    if cdt ~= q.dtype then out = tensor.to_dtype(out, q.dtype) end
    return q4 and out:view(qs) or out
  end
  gp.doc(gp.attention_decode, 'gp.attention_decode(q, kcache, vcache, lens, {scale=, window=0, n_global=0})',
    'one new query per sequence (q (B, H, D) or (B, H, 1, D)) over the first lens[b] entries of kcache, vcache ' ..
    '(B, H, C, D), at position lens[b] - 1 (window and n_global as in gp.attention); lens: i32/i64 [B] or a number; ' ..
    'split along the cache on the GPU (flash-decoding)')

  ---------------------------------------------------------------------------
  -- KV cache: per layer (B, H, capacity, D) keys and values, filled in place

  local KVCache = {}
  KVCache.__index = KVCache
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
    self.k, self.v, self._lens, self.fill = {}, {}, {}, {}
    local shape = {self.batch, self.heads, self.capacity, self.head_dim}
    local to = {dtype = self.dtype, device = self.device}
    for l = 1, self.layers do
      self.k[l] = gp.zeros(shape, to)
      self.v[l] = gp.zeros(shape, to)
      self._lens[l] = gp.zeros({self.batch}, {dtype = 'i32', device = self.device})
      self.fill[l] = 0
    end
    return self
  end
  gp.doc(gp.KVCache, 'gp.KVCache{batch=, heads=, capacity=, head_dim=, layers=1, dtype=f32, device=}',
    'preallocated keys and values per layer (B, H, capacity, D): cache:append(layer, k, v) writes (B, H, Tnew, D) ' ..
    'in place (no device allocation), cache:len(), cache:reset(), cache:keys(layer), cache:values(layer) (views of ' ..
    'the filled part), cache:lens(layer) (i32 [B] on the device), cache:attend(layer, q, opts) (decode attention); ' ..
    'never grows: going past capacity is an error')

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
    K.copy(self.k[layer]:narrow(3, pos + 1, n), k)
    K.copy(self.v[layer]:narrow(3, pos + 1, n), v)
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
    K.write_at(self.k[layer], k, pos)
    K.write_at(self.v[layer], v, pos)
    return self
  end
  -- decode attention of q (B, H, D) over the first lens[b] positions of layer
  function KVCache:attend_at(layer, q, lens, opts)
    layer = self:_layer('attend_at', layer)
    return gp.attention_decode(q, self.k[layer], self.v[layer], lens, opts)
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
    end
    return self
  end
  function KVCache:keys(layer)
    layer = self:_layer('keys', layer or 1)
    return self.k[layer]:narrow(3, 1, self.fill[layer])
  end
  function KVCache:values(layer)
    layer = self:_layer('values', layer or 1)
    return self.v[layer]:narrow(3, 1, self.fill[layer])
  end
  function KVCache:lens(layer) return self._lens[self:_layer('lens', layer or 1)] end
  function KVCache:attend(layer, q, opts)
    layer = self:_layer('attend', layer)
    return gp.attention_decode(q, self.k[layer], self.v[layer], self._lens[layer], opts)
  end
  local D = gp.doc
  D(KVCache.append, 'cache:append(layer, k, v)', 'write k, v (B, H, Tnew, D) at the next positions of layer, in place; an error past capacity')
  D(KVCache.len, 'cache:len(layer=1)', 'positions filled in layer')
  D(KVCache.append_at, 'cache:append_at(layer, k, v, pos)', 'write k, v (B, H, Tnew, D) at the position held by the device tensor pos (i64 [1]); for CUDA graphs: nothing read on the host, len not advanced')
  D(KVCache.attend_at, 'cache:attend_at(layer, q, lens, opts)', 'gp.attention_decode of q (B, H, D) over the first lens[b] positions of layer (lens a device tensor)')
  D(KVCache.set_len, 'cache:set_len(n)', 'set the filled count of every layer (after append_at)')
  D(KVCache.reset, 'cache:reset()', 'empty every layer (the buffers are kept)')
  D(KVCache.keys, 'cache:keys(layer=1)', 'view (B, H, len, D) of the filled keys')
  D(KVCache.values, 'cache:values(layer=1)', 'view (B, H, len, D) of the filled values')
  D(KVCache.lens, 'cache:lens(layer=1)', 'i32 [B] device tensor holding len (for gp.attention_decode)')
  D(KVCache.attend, 'cache:attend(layer, q, opts)', 'gp.attention_decode of q (B, H, D) over the filled part of layer')
  KVCache.__tostring = function(self)
    return string.format('KVCache(batch=%d, heads=%d, capacity=%d, head_dim=%d, layers=%d, %s, %s, len=%d)',
      self.batch, self.heads, self.capacity, self.head_dim, self.layers, self.dtype, self.device, self.fill[1])
  end
end
