-- Attention: the CPU reference against a matmul/softmax oracle (causal,
-- prefill T < S, windows with global keys, not causal, D 64 and 128), the
-- backward against central differences (f64), decode attention against the
-- last row of full attention, the KV cache, nn.attention's flash path,
-- grouped-query attention (k, v with fewer heads) against repeated k, v, and
-- bad input. GPU-vs-CPU comparisons of the kernels run in test_kernels.
local T = require 'lib'
local gp = require 'gpush'

local CPU = {device = 'cpu'}
local CPU64 = {dtype = 'f64', device = 'cpu'}

-- additive mask (T, S): 0 where key j is visible to query i (at p = i + S - T)
local function mask(Tq, S, causal, window, ng)
  local rows = {}
  for i = 1, Tq do
    local p, r = i - 1 + S - Tq, {}
    for j = 0, S - 1 do
      local ok = not (causal and j > p) and not (window > 0 and p - j >= window and j >= ng)
      r[j + 1] = ok and 0 or -math.huge
    end
    rows[i] = r
  end
  return gp.tensor(rows, CPU64)
end

-- plain attention in f64 through matmul and softmax; returns out and lse
-- (k, v with fewer heads than q: repeated, each KV head for its H / Hkv query heads)
local function oracle(q, k, v, o)
  o = o or {}
  local B, H, Tq, D = unpack(q.shape)
  local S = k:size(3)
  k, v = gp.nn.repeat_kv(k, H), gp.nn.repeat_kv(v, H)
  local causal = o.causal ~= false
  local q3, k3, v3 = q:double():reshape {B * H, Tq, D}, k:double():reshape {B * H, S, D}, v:double():reshape {B * H, S, D}
  local sc = gp.matmul(q3, k3, {trans_b = true, alpha = o.scale or 1 / math.sqrt(D)})
  sc = sc + mask(Tq, S, causal, o.window or 0, o.n_global or 0)
  local lse = sc:exp():sum(-1):log():view {B, H, Tq}
  return sc:softmax(-1):matmul(v3):view {B, H, Tq, D}, lse
end

local function rn(shape, o) return gp.randn(shape, o or CPU) end

T.test('attention matches a matmul/softmax oracle (causal, prefill, windows, not causal, D 64 and 128)', function()
  local cases = {
    {B = 1, H = 2, T = 7, S = 7, D = 64},
    {B = 2, H = 1, T = 5, S = 12, D = 64},                               -- prefill: the last 5 of 12 positions
    {B = 1, H = 1, T = 13, S = 13, D = 128, window = 4, n_global = 2},
    {B = 1, H = 2, T = 9, S = 11, D = 64, window = 3},
    {B = 1, H = 1, T = 6, S = 4, D = 64, causal = false, scale = 0.3},   -- cross attention, T > S
    {B = 1, H = 1, T = 1, S = 9, D = 128},                               -- one query
  }
  for _, c in ipairs(cases) do
    local q, k, v = rn {c.B, c.H, c.T, c.D}, rn {c.B, c.H, c.S, c.D}, rn {c.B, c.H, c.S, c.D}
    local o = {causal = c.causal, scale = c.scale, window = c.window, n_global = c.n_global}
    local out, lse = gp.attention(q, k, v, o)
    local ro, rl = oracle(q, k, v, o)
    T.same(out.shape, {c.B, c.H, c.T, c.D})
    T.same(lse.shape, {c.B, c.H, c.T})
    T.ok(T.relnorm(out, ro) < 1e-5, 'out')
    T.ok(T.relnorm(lse, rl) < 1e-5, 'lse')
  end
  -- f64 and non-contiguous inputs (a transposed view) go through the same kernel
  local q = rn({1, 5, 2, 64}, CPU64):transpose(2, 3)
  local k = rn({1, 5, 2, 64}, CPU64):transpose(2, 3)
  local v = rn({1, 5, 2, 64}, CPU64):transpose(2, 3)
  T.ok(T.relnorm(gp.attention(q, k, v), (oracle(q, k, v))) < 1e-12)
end)

-- out is laid out as q: for q the heads of a (B, T, H, D) buffer, out:transpose(2, 3) is a contiguous
-- (B, T, H, D), so the output projection's (B, T, H * D) input is a view (a copy a layer fewer in a Llama)
T.test('attention: out in the layout of q (heads of a (B, T, H, D) buffer); values and gradients unchanged', function()
  for _, c in ipairs {{B = 2, T = 5, H = 4, Hkv = 2, D = 64}, {B = 1, T = 9, H = 2, Hkv = 2, D = 32}} do
    local x = rn({c.B, c.T, (c.H + 2 * c.Hkv) * c.D}, CPU64)
    local function heads(t, first, n) return t:narrow(3, first * c.D + 1, n * c.D):view {c.B, t:size(2), n, c.D}:transpose(2, 3) end
    local q, k, v = heads(x, 0, c.H), heads(x, c.H, c.Hkv), heads(x, c.H + c.Hkv, c.Hkv)
    local out, lse = gp.attention(q, k, v)
    T.ok(out:transpose(2, 3):is_contiguous(), 'out:transpose(2, 3) contiguous')
    local ro, rl = gp.attention(q:contiguous(), k:contiguous(), v:contiguous())
    T.ok(ro:is_contiguous(), 'a contiguous q gives a contiguous out')
    T.eq(T.relnorm(out, ro), 0)
    T.eq(T.relnorm(lse, rl), 0)
    local y, n = T.launches(function() return out:transpose(2, 3):reshape {c.B, c.T, c.H * c.D} end)
    T.eq(n.copy, 0, 'the merge of the heads is a view')
    T.same(y.shape, {c.B, c.T, c.H * c.D})
    -- the gradient through the strided heads and the merged view, in double
    T.ok(gp.gradcheck(function(t)
      local a, b, d = heads(t, 0, c.H), heads(t, c.H, c.Hkv), heads(t, c.H + c.Hkv, c.Hkv)
      return (gp.attention(a, b, d)):transpose(2, 3):reshape {c.B, t:size(2), c.H * c.D}
    end, {rn({c.B, 3, (c.H + 2 * c.Hkv) * c.D}, CPU64)}))
  end
end)

T.test('attention: out in the layout of q on the GPU (bf16 tensor cores, f32) equals the CPU, forward and gradient', function()
  T.cuda()
  for _, dt in ipairs {'bf16', 'f32'} do
    local B, Tn, H, Hkv, D = 2, 37, 4, 2, 64
    local function heads(x, first, n) return x:narrow(3, first * D + 1, n * D):view {B, Tn, n, D}:transpose(2, 3) end
    T.cuda_matches_cpu(function(x)
      return gp.attention(heads(x, 0, H), heads(x, H, Hkv), heads(x, H + Hkv, Hkv)):transpose(2, 3):reshape {B, Tn, H * D}
    end, rn({B, Tn, (H + 2 * Hkv) * D}):to(dt), dt == 'bf16' and 1e-2 or 1e-4, dt)
  end
end)

T.test('attention backward: central differences in f64 (causal, prefill, window + n_global, not causal)', function()
  gp.manual_seed(3)
  for _, c in ipairs {
    {T = 4, S = 4, o = {}},
    {T = 3, S = 6, o = {window = 2, n_global = 1}},
    {T = 4, S = 3, o = {causal = false, scale = 0.2}},
  } do
    local q, k, v = rn({1, 2, c.T, 64}, CPU64), rn({1, 2, c.S, 64}, CPU64), rn({1, 2, c.S, 64}, CPU64)
    T.ok(gp.gradcheck(function(a, b, d) return (gp.attention(a, b, d, c.o)) end, {q, k, v}))
  end
  -- the kernel itself against the oracle's autograd (matmul/softmax rules) in f64
  local q, k, v = rn({2, 1, 5, 64}, CPU64), rn({2, 1, 7, 64}, CPU64), rn({2, 1, 7, 64}, CPU64)
  local o = {window = 3, n_global = 2}
  local out, lse = gp.attention(q, k, v, o)
  local dout = rn({2, 1, 5, 64}, CPU64)
  local dq, dk, dv = gp.empty(q.shape, CPU64), gp.empty(k.shape, CPU64), gp.empty(v.shape, CPU64)
  gp.k.attn_bwd(dq, dk, dv, q, k, v, out, lse, dout, 1 / 8, 3, 2, 1)
  local qq, kk, vv = q:clone():requires_grad(), k:clone():requires_grad(), v:clone():requires_grad()
  local ro = oracle(qq, kk, vv, o)
  ro:backward(dout)
  T.ok(T.relnorm(dq, qq.grad) < 1e-6) -- (lse is f32)
  T.ok(T.relnorm(dk, kk.grad) < 1e-6) -- (lse is f32)
  T.ok(T.relnorm(dv, vv.grad) < 1e-6) -- (lse is f32)
end)

T.test('decode attention equals the last row of full attention over the same keys', function()
  local B, H, S, C, D = 2, 3, 9, 16, 64
  local q, k, v = rn {B, H, S, D}, rn {B, H, S, D}, rn {B, H, S, D}
  local kc, vc = gp.zeros({B, H, C, D}, CPU), gp.zeros({B, H, C, D}, CPU)
  kc:narrow(3, 1, S):copy_(k)
  vc:narrow(3, 1, S):copy_(v)
  for _, o in ipairs {{}, {window = 4, n_global = 2}, {scale = 0.2}} do
    local full = gp.attention(q, k, v, o)
    local last = full:narrow(3, S, 1):reshape {B, H, D}
    T.ok(T.relnorm(gp.attention_decode(q:narrow(3, S, 1):reshape {B, H, D}, kc, vc, S, o), last) < 1e-6)
    -- (B, H, 1, D) queries keep their shape
    local d4 = gp.attention_decode(q:narrow(3, S, 1), kc, vc, S, o)
    T.same(d4.shape, {B, H, 1, D})
    T.ok(T.relnorm(d4:reshape {B, H, D}, last) < 1e-6)
  end
  -- per-sequence lengths (i32 and i64): sequence 2 holds only its first 5 keys
  for _, dt in ipairs {'i32', 'i64'} do
    local lens = gp.tensor({S, 5}, {dtype = dt, device = 'cpu'})
    local out = gp.attention_decode(q:narrow(3, S, 1):reshape {B, H, D}, kc, vc, lens)
    local r2 = gp.attention(q:narrow(1, 2, 1):narrow(3, S, 1), k:narrow(1, 2, 1):narrow(3, 1, 5),
      v:narrow(1, 2, 1):narrow(3, 1, 5))
    T.ok(T.relnorm(out:narrow(1, 2, 1):reshape {H, D}, r2:reshape {H, D}) < 1e-6)
  end
  -- an empty sequence gives zeros
  local z = gp.attention_decode(q:narrow(3, 1, 1):reshape {B, H, D}, kc, vc, 0)
  T.ok(z:abs():max():item() == 0)
  -- an f32 query over a bf16 cache: the query takes the cache's dtype, the result the query's
  local q1 = q:narrow(3, S, 1):reshape {B, H, D}
  local mixed = gp.attention_decode(q1, kc:bf16(), vc:bf16(), S)
  T.eq(mixed.dtype, 'f32')
  T.ok(T.relnorm(mixed, gp.attention_decode(q1, kc, vc, S)) < 2e-2)
end)

T.test('KV cache: append in place, views of the filled part, len, reset, attend, capacity', function()
  local B, H, C, D = 2, 2, 8, 64
  local cache = gp.KVCache {batch = B, heads = H, capacity = C, head_dim = D, layers = 2, device = 'cpu'}
  T.eq(cache:len(), 0)
  T.same(cache:keys(1).shape, {B, H, 0, D})
  local k1, v1 = rn {B, H, 3, D}, rn {B, H, 3, D}
  local k2, v2 = rn {B, H, 2, D}, rn {B, H, 2, D}
  local storage = cache.k[1]
  local before = gp.memory().host_allocs
  cache:append(1, k1, v1)
  cache:append(1, k2, v2)
  T.eq(gp.memory().host_allocs, before) -- no allocation per append
  T.ok(rawequal(cache.k[1], storage))
  T.eq(cache:len(), 5)
  T.eq(cache:len(2), 0)
  T.ok(T.relnorm(cache:keys(1), gp.cat({k1, k2}, 3)) == 0)
  T.ok(T.relnorm(cache:values(1), gp.cat({v1, v2}, 3)) == 0)
  T.same(cache:lens(1):totable(), {5, 5})
  -- prefill attention over the cache, then one decode step through attend
  local q = rn {B, H, 5, D}
  local full = gp.attention(q, cache:keys(1), cache:values(1))
  local step = cache:attend(1, q:narrow(3, 5, 1):reshape {B, H, D})
  T.ok(T.relnorm(step, full:narrow(3, 5, 1):reshape {B, H, D}) < 1e-6)
  -- a different dtype is cast on the way in
  cache:append(2, k1:bf16(), v1:bf16())
  T.ok(T.relnorm(cache:keys(2), k1) < 1e-2)
  -- going past capacity is an error, never growth; nothing is written
  T.raises(function() cache:append(1, rn {B, H, 4, D}, rn {B, H, 4, D}) end, 'KVCache:append', 'capacity', '5 of 8')
  T.eq(cache:len(), 5)
  cache:append(1, rn {B, H, 3, D}, rn {B, H, 3, D}) -- exactly full
  T.eq(cache:len(), 8)
  T.raises(function() cache:append(1, rn {B, H, 1, D}, rn {B, H, 1, D}) end, 'capacity')
  -- bad shapes and layers
  T.raises(function() cache:append(1, rn {B, H, 1, 32}, rn {B, H, 1, 32}) end, 'KVCache:append', '(2,2,1,32)')
  T.raises(function() cache:append(1, rn {B, H, 1, D}, rn {B, H, 2, D}) end, 'KVCache:append', 'differ')
  T.raises(function() cache:append(3, k1, v1) end, 'KVCache:append', 'layer')
  T.raises(function() gp.KVCache {batch = 1, heads = 1, capacity = 0, head_dim = 64} end, 'KVCache', 'capacity')
  cache:reset()
  T.eq(cache:len(), 0)
  T.same(cache:lens(1):totable(), {0, 0})
  T.ok(tostring(cache):find('KVCache') ~= nil)
end)

T.test('nn.attention takes the flash path for head dims 64/128 and matches the matmul path', function()
  local nn = gp.nn
  local q, k, v = rn {2, 2, 6, 64}, rn {2, 2, 6, 64}, rn {2, 2, 6, 64}
  T.ok(T.relnorm(nn.attention(q, k, v, {causal = true}), (oracle(q, k, v))) < 1e-5)
  T.ok(T.relnorm(nn.attention(q, k, v), (oracle(q, k, v, {causal = false}))) < 1e-5)
  -- 3-d (..., T, d) and an unsupported head dim (matmul path) give the same answers
  local q3, k3, v3 = rn {3, 5, 64}, rn {3, 5, 64}, rn {3, 5, 64}
  local r = oracle(q3:view {1, 3, 5, 64}, k3:view {1, 3, 5, 64}, v3:view {1, 3, 5, 64})
  T.ok(T.relnorm(nn.attention(q3, k3, v3, {causal = true}), r:view {3, 5, 64}) < 1e-5)
  local a, b, c = rn {1, 2, 5, 16}, rn {1, 2, 5, 16}, rn {1, 2, 5, 16}
  T.ok(T.relnorm(nn.attention(a, b, c, {causal = true}), (oracle(a, b, c))) < 1e-5)
  -- gradients through the flash path
  local x = rn({1, 1, 4, 64}, CPU64)
  T.ok(gp.gradcheck(function(t) return nn.attention(t, t * 0.5, t, {causal = true}) end, {x}))
end)

T.test('attention errors name the op and the shapes', function()
  local q = rn {1, 2, 4, 48}
  T.raises(function() gp.attention(q, q, q) end, 'attention', 'head dim 48', 'supported: 32, 64, 128')
  T.raises(function() gp.k.attn_fwd(gp.empty(q.shape, CPU), gp.empty({1, 2, 4}, CPU), q, q, q) end, 'attn_fwd',
    'head dim 48', 'supported: 32, 64, 128')
  local q32 = rn {1, 2, 4, 32} -- head dim 32: attention, not the decode kernel
  T.raises(function() gp.attention_decode(rn {1, 2, 32}, q32, q32, 2) end, 'attention_decode', 'supported: 64, 128')
  T.raises(function() gp.k.attn_decode(gp.empty({1, 2, 32}, CPU), rn {1, 2, 32}, q32, q32, gp.full({1}, 2, {dtype = 'i64', device = 'cpu'})) end,
    'attn_decode', 'head dim 32', 'supported: 64, 128')
  local a, b = rn {1, 2, 4, 64}, rn {1, 3, 4, 64}
  T.raises(function() gp.attention(a, b, b) end, 'attention', '(1,2,4,64)', '(1,3,4,64)')
  T.raises(function() gp.attention(a, a, rn {1, 2, 5, 64}) end, 'attention', '(1,2,5,64)')
  T.raises(function() gp.attention(a, a) end, 'attention', 'v must be a tensor')
  T.raises(function() gp.attention(rn {2, 4, 64}, a, a) end, 'attention', '(B, H, T, D)')
  T.raises(function() gp.attention(rn {1, 2, 6, 64}, a, a) end, 'attention', 'S >= T', '(1,2,6,64)')
  T.raises(function() gp.attention(a, a, a, {window = -1}) end, 'attention', 'window')
  T.raises(function() gp.k.attn_fwd(gp.empty({1, 2, 6, 64}, CPU), gp.empty({1, 2, 6}, CPU), rn {1, 2, 6, 64}, a, a)
  end, 'attn_fwd', 'S >= T')
  T.raises(function() gp.k.attn_fwd(gp.empty(a.shape, CPU), gp.empty({1, 2, 5}, CPU), a, a, a) end, 'attn_fwd')
  -- decode: a sequence longer than the cache, bad shapes
  local kc = gp.zeros({1, 2, 8, 64}, CPU)
  local q1 = rn {1, 2, 64}
  T.raises(function() gp.attention_decode(q1, kc, kc, 9) end, 'attention_decode', 'outside [0, 8]')
  T.raises(function() gp.attention_decode(q1, kc, kc, gp.tensor({9}, {dtype = 'i32', device = 'cpu'})) end,
    'attn_decode', 'lens[0] = 9', 'outside [0, 8]')
  T.raises(function() gp.attention_decode(q1, kc, gp.zeros({1, 2, 7, 64}, CPU), 3) end, 'attention_decode', '(1,2,7,64)')
  T.raises(function() gp.attention_decode(rn {1, 3, 64}, kc, kc, 3) end, 'attention_decode', '(1,3,64)')
end)

-- The kernels' CPU-vs-GPU cases (the tensor-core forward and backward for
-- bf16/f16, the plain kernels for f32): odd lengths, T < S, windows with
-- leading always-visible keys, not causal, D 64 and 128. The reference is the
-- CPU kernel in f32 on the same (rounded) inputs; its backward takes the
-- forward's out rounded to the dtype, as the GPU's does.
local KCASES = {
  {B = 1, H = 2, T = 1, S = 1, D = 64, o = {}},
  {B = 2, H = 1, T = 7, S = 7, D = 128, o = {}},
  {B = 1, H = 2, T = 65, S = 65, D = 64, o = {window = 16, n_global = 3}},
  {B = 1, H = 1, T = 129, S = 129, D = 128, o = {window = 40, n_global = 5}},
  {B = 1, H = 2, T = 200, S = 200, D = 64, o = {}},
  {B = 1, H = 1, T = 65, S = 200, D = 64, o = {window = 70, n_global = 2}},
  {B = 1, H = 1, T = 129, S = 65, D = 128, o = {causal = false}},
  {B = 1, H = 1, T = 7, S = 200, D = 64, o = {causal = false, window = 50, n_global = 1, scale = 0.2}},
  {B = 1, H = 1, T = 200, S = 200, D = 128, o = {window = 1}},
  {B = 2, H = 2, T = 67, S = 67, D = 32, o = {}},                         -- head dim 32: the plain kernels
  {B = 1, H = 1, T = 33, S = 90, D = 32, o = {window = 20, n_global = 2}},
  -- grouped-query attention: Hkv KV heads (dk, dv summed over H / Hkv query heads)
  {B = 1, H = 4, Hkv = 1, T = 65, S = 65, D = 64, o = {}},                 -- multi-query
  {B = 2, H = 9, Hkv = 3, T = 130, S = 130, D = 64, o = {window = 40, n_global = 3}}, -- SmolLM2's 9:3
  {B = 1, H = 4, Hkv = 2, T = 129, S = 200, D = 128, o = {}},
  {B = 1, H = 6, Hkv = 2, T = 70, S = 40, D = 64, o = {causal = false}},
  {B = 1, H = 4, Hkv = 2, T = 67, S = 67, D = 32, o = {}},
  -- causal without a window, query and key tiles whole: the diagonal tiles' one-compare mask (tile_mask 2)
  {B = 1, H = 2, T = 256, S = 256, D = 64, o = {}},
  {B = 1, H = 2, T = 130, S = 258, D = 64, o = {}},
  {B = 1, H = 4, Hkv = 2, T = 192, S = 320, D = 128, o = {}},
}

-- GPU against CPU tolerances per dtype
local TOL = {bf16 = 1e-2, f16 = 3e-3, f32 = 1e-4}

local function kargs(c)
  local o = c.o
  return o.scale or 1 / math.sqrt(c.D), o.window or 0, o.n_global or 0, o.causal == false and 0 or 1
end

-- inputs rounded to dt (as f32 CPU tensors) and the f32 CPU reference of the forward and backward
local function kref(c, dt)
  local function r(n, h) return rn({c.B, h or c.H, n, c.D}):to(dt):float() end
  local x = {q = r(c.T), k = r(c.S, c.Hkv), v = r(c.S, c.Hkv), dout = r(c.T)}
  local sc, w, ng, cz = kargs(c)
  x.out, x.lse = gp.empty(x.q.shape, CPU), gp.empty({c.B, c.H, c.T}, CPU)
  gp.k.attn_fwd(x.out, x.lse, x.q, x.k, x.v, sc, w, ng, cz)
  x.out_r = x.out:to(dt):float()
  x.dq, x.dk, x.dv = gp.empty(x.q.shape, CPU), gp.empty(x.k.shape, CPU), gp.empty(x.v.shape, CPU)
  gp.k.attn_bwd(x.dq, x.dk, x.dv, x.q, x.k, x.v, x.out_r, x.lse, x.dout, sc, w, ng, cz)
  return x
end

T.test('attention kernels: the CPU reference of the GPU cases matches the f64 oracle (forward and grads)', function()
  gp.manual_seed(11)
  for _, c in ipairs(KCASES) do
    local x = kref(c, 'bf16')
    local qq, kk, vv = x.q:double():requires_grad(), x.k:double():requires_grad(), x.v:double():requires_grad()
    local ro, rl = oracle(qq, kk, vv, c.o)
    local name = string.format('H %d Hkv %d T %d S %d D %d', c.H, c.Hkv or c.H, c.T, c.S, c.D)
    T.ok(T.relnorm(x.out, ro) < 1e-5, name .. ' out')
    T.ok(T.relnorm(x.lse, rl) < 1e-5, name .. ' lse')
    ro:backward(x.dout:double())
    -- the reference backward took the bf16-rounded out: its grads are near, not equal
    T.ok(T.relnorm(x.dq, qq.grad) < 1e-2, name .. ' dq')
    T.ok(T.relnorm(x.dk, kk.grad) < 1e-2, name .. ' dk')
    T.ok(T.relnorm(x.dv, vv.grad) < 1e-5, name .. ' dv')
  end
end)

T.test('attention kernels on the GPU: forward and backward against the CPU (bf16, f16 tensor cores; f32)', function()
  T.cuda()
  gp.manual_seed(11)
  for _, c in ipairs(KCASES) do
    for _, dt in ipairs {'bf16', 'f16', 'f32'} do
      local x = kref(c, dt)
      local sc, w, ng, cz = kargs(c)
      local function cu(t) return t:to(dt):cuda() end
      local q, k, v, dout = cu(x.q), cu(x.k), cu(x.v), cu(x.dout)
      local out = gp.empty(q.shape, {dtype = dt, device = 'cuda'})
      local lse = gp.empty({c.B, c.H, c.T}, {device = 'cuda'})
      gp.k.attn_fwd(out, lse, q, k, v, sc, w, ng, cz)
      local name = string.format('%s H %d Hkv %d T %d S %d D %d', dt, c.H, c.Hkv or c.H, c.T, c.S, c.D)
      T.ok(T.relnorm(out:float():cpu(), x.out) < TOL[dt], name .. ' out')
      T.ok(T.relnorm(lse:cpu(), x.lse) < 1e-4, name .. ' lse')
      local dq = gp.empty(q.shape, {dtype = dt, device = 'cuda'})
      local dk, dv = gp.empty(k.shape, {dtype = dt, device = 'cuda'}), gp.empty(v.shape, {dtype = dt, device = 'cuda'})
      -- the backward from the GPU's own forward (its out is x.out_r up to rounding)
      gp.k.attn_bwd(dq, dk, dv, q, k, v, out, lse, dout, sc, w, ng, cz)
      T.ok(T.relnorm(dq:float():cpu(), x.dq) < TOL[dt], name .. ' dq')
      T.ok(T.relnorm(dk:float():cpu(), x.dk) < TOL[dt], name .. ' dk')
      T.ok(T.relnorm(dv:float():cpu(), x.dv) < TOL[dt], name .. ' dv')
    end
  end
  -- autograd in bf16 end to end (the tensor-core backward through gp.attention)
  local c = KCASES[6]
  local x = kref(c, 'bf16')
  local function run(dev, dt)
    local function leaf(t) return t:to(dt):to(dev):clone():requires_grad() end
    local a, b, d = leaf(x.q), leaf(x.k), leaf(x.v)
    local y = gp.attention(a, b, d, c.o)
    y:backward(x.dout:to(dt):to(dev))
    return a.grad:float():cpu(), b.grad:float():cpu(), d.grad:float():cpu()
  end
  local c1, c2, c3 = run('cpu', 'f32')
  local g1, g2, g3 = run('cuda', 'bf16')
  T.ok(T.relnorm(g1, c1) < 2e-2 and T.relnorm(g2, c2) < 2e-2 and T.relnorm(g3, c3) < 2e-2, 'bf16 autograd grads')
end)

-- more query tiles than the GPU has SMs: Hopper's forward runs one block an
-- SM over a sequence of tiles handed out by a counter (two Q buffers, a ring
-- of K/V stages carried from tile to tile), so these reuse every buffer
-- several times
local PCASES = {
  {B = 3, H = 48, T = 300, S = 300, D = 64, o = {}},
  {B = 2, H = 32, Hkv = 8, T = 260, S = 260, D = 128, o = {causal = false}},
  {B = 2, H = 40, T = 129, S = 400, D = 64, o = {window = 100, n_global = 4}},
  {B = 2, H = 70, T = 300, S = 65, D = 64, o = {causal = false}, dt = 'f16'},
  {B = 1, H = 24, T = 1024, S = 1024, D = 128, o = {}},
  {B = 1, H = 1, T = 4100, S = 4100, D = 64, o = {}}, -- causal D 64 from T 4096
}

T.test('attention forward on the GPU with many tiles a block: against the CPU', function()
  T.cuda()
  gp.manual_seed(12)
  for _, c in ipairs(PCASES) do
    local dt = c.dt or 'bf16'
    local function r(n, h) return rn({c.B, h or c.H, n, c.D}):to(dt):float() end
    local q, k, v = r(c.T), r(c.S, c.Hkv), r(c.S, c.Hkv)
    local sc, w, ng, cz = kargs(c)
    local out, lse = gp.empty(q.shape, CPU), gp.empty({c.B, c.H, c.T}, CPU)
    gp.k.attn_fwd(out, lse, q, k, v, sc, w, ng, cz)
    local go = gp.empty(q.shape, {dtype = dt, device = 'cuda'})
    local gl = gp.empty({c.B, c.H, c.T}, {device = 'cuda'})
    -- twice: the second launch's counter starts where the first one's ended (at zero)
    for round = 1, 2 do
      go:fill_(0)
      gp.k.attn_fwd(go, gl, q:to(dt):cuda(), k:to(dt):cuda(), v:to(dt):cuda(), sc, w, ng, cz)
      local name = string.format('%s B %d H %d Hkv %d T %d S %d D %d, launch %d', dt, c.B, c.H, c.Hkv or c.H, c.T,
        c.S, c.D, round)
      T.ok(T.relnorm(go:float():cpu(), out) < TOL[dt], name .. ' out')
      T.ok(T.relnorm(gl:cpu(), lse) < 1e-4, name .. ' lse')
    end
  end
end)

-- the backward's determinism contract: dk and dv are written once (bitwise
-- repeatable); dq is too under GP_ATTN_DETERMINISTIC=1, while the Hopper
-- default adds it with f32 atomics (repeatable up to rounding)
local DET_SNIPPET = [[
gp.manual_seed(5)
local CU = {dtype = 'bf16', device = 'cuda'}
local sh, kvsh = {2, 3, 300, HD}, {2, HKV, 300, HD}
local q, k, v, g = gp.randn(sh, CU), gp.randn(kvsh, CU), gp.randn(kvsh, CU), gp.randn(sh, CU)
local out, lse = gp.empty(sh, CU), gp.empty({2, 3, 300}, {device = 'cuda'})
gp.k.attn_fwd(out, lse, q, k, v, 0, 0, 0, 1)
local function grads()
  local dq, dk, dv = gp.empty(sh, CU), gp.empty(kvsh, CU), gp.empty(kvsh, CU)
  gp.k.attn_bwd(dq, dk, dv, q, k, v, out, lse, g, 0, 0, 0, 1)
  return {dq, dk, dv}
end
local a, b = grads(), grads()
local td = require('gpush.core.tensor').to_doubles
local r = {}
for i = 1, 3 do
  local x, n = td(a[i]:float():cpu())
  local y = td(b[i]:float():cpu())
  local diff, big = 0, 0
  for e = 0, n - 1 do
    diff = diff + (x[e] ~= y[e] and 1 or 0)
    big = math.max(big, math.abs(x[e] - y[e]) / (math.abs(x[e]) + 1e-3))
  end
  r[i] = string.format('%d:%g', diff, big)
end
print('DET ' .. table.concat(r, ' '))
]]
-- runs the Lua code in a fresh gpush under the environment settings env; its output
local function run_snippet(env, code)
  local f = os.tmpname()
  local h = assert(io.open(f, 'w'))
  h:write(code)
  h:close()
  local out, rc = T.sh(string.format('%s %s %s', env, T.exe, f))
  os.remove(f)
  T.eq(rc, 0, out)
  return out
end
-- causal head dim 64 and 128 forwards (the diagonal tiles' one-compare mask,
-- tiles past a warpgroup's rows skipped) by the default warp-specialized
-- kernel, its producer copying by TMA (the default) or by cp.async
-- (GP_ATTN_TMA=0), and by the block-synchronous one (GP_ATTN_WS=0)
local WS_SNIPPET = [[
gp.manual_seed(4)
local C = {device = 'cpu'}
for _, c in ipairs {{2, 70, 300, 64}, {1, 9, 1030, 64}, {3, 5, 64, 64}, {1, 4, 530, 128}} do
  local B, H, T, D = unpack(c)
  local function r() return gp.randn({B, H, T, D}, C):bf16():float() end
  local q, k, v = r(), r(), r()
  local out, lse = gp.empty({B, H, T, D}, C), gp.empty({B, H, T}, C)
  gp.k.attn_fwd(out, lse, q, k, v, 1 / math.sqrt(D), 0, 0, 1)
  local CU = {dtype = 'bf16', device = 'cuda'}
  local go, gl = gp.empty({B, H, T, D}, CU), gp.empty({B, H, T}, {device = 'cuda'})
  gp.k.attn_fwd(go, gl, q:bf16():cuda(), k:bf16():cuda(), v:bf16():cuda(), 1 / math.sqrt(D), 0, 0, 1)
  local d = (go:float():cpu() - out):abs():max():item()
  local dl = (gl:cpu() - lse):abs():max():item()
  print(string.format('WS T %d: out %.3g lse %.3g', T, d, dl))
  assert(d < 0.05 and dl < 1e-3, 'the forward differs from the CPU')
end
]]
T.test('attention forward on the GPU: causal, the warp-specialized kernel (TMA copies or cp.async) and GP_ATTN_WS=0', function()
  T.cuda()
  for _, env in ipairs {'GP_ATTN_WS=1', 'GP_ATTN_WS=1 GP_ATTN_TMA=0', 'GP_ATTN_WS=0'} do
    local out = run_snippet(env, WS_SNIPPET)
    T.ok(select(2, out:gsub('WS T', '')) == 4, env .. ': ' .. out)
  end
end)

T.test('attention backward on the GPU at head dim 128: each dQ path (GP_ATTN_FUSED_BWD 0, 1, 2) against the CPU', function()
  T.cuda()
  -- 0: the dk/dv and dq kernels; 1: dQ by atomics from one warpgroup of 64 keys; 2: from two of 128 keys
  -- (the default by the key count); the kernel test's cases in a process each
  for _, v in ipairs {0, 1, 2} do
    local out, rc = T.sh(string.format('GP_ATTN_FUSED_BWD=%d %s %s/tests/lua/run.lua %q', v, T.exe, T.root,
      'test_attention: attention kernels on the GPU: forward and backward'))
    T.ok(rc == 0 and out:find('1 passed, 0 failed', 1, true), 'GP_ATTN_FUSED_BWD=' .. v .. ': ' .. out)
  end
end)

local function det_run(env, hkv, hd)
  local out = run_snippet(env, (DET_SNIPPET:gsub('HKV', tostring(hkv or 3)):gsub('HD', tostring(hd or 64))))
  local dq, dqr, dk, dv = out:match('DET (%d+):(%S+) (%d+):%S+ (%d+):%S+')
  T.ok(dq, out)
  return tonumber(dq), tonumber(dqr), tonumber(dk), tonumber(dv)
end
T.test('attention backward on the GPU: GP_ATTN_DETERMINISTIC=1 repeats bitwise; the default repeats dk, dv bitwise (D 64, 128)', function()
  T.cuda()
  -- 3 KV heads (multi-head) and 1 (multi-query: dk, dv summed over 3 query heads); at both head dims the
  -- default adds dQ by atomics in the dk/dv kernel, the deterministic backward runs a dq kernel
  for _, hd in ipairs {64, 128} do
    for _, hkv in ipairs {3, 1} do
      local what = string.format('D %d, Hkv %d', hd, hkv)
      local dq, _, dk, dv = det_run('GP_ATTN_DETERMINISTIC=1', hkv, hd)
      T.eq(dq + dk + dv, 0, 'elements that differ between two deterministic backwards, ' .. what)
      local dqr
      _, dqr, dk, dv = det_run('GP_ATTN_DETERMINISTIC=0', hkv, hd)
      T.eq(dk + dv, 0, 'dk, dv elements that differ between two default backwards, ' .. what)
      T.ok(dqr < 2e-2, 'dq of two default backwards within bf16 rounding (' .. what .. '): ' .. dqr)
    end
  end
end)

T.test('attention on the GPU: forward, backward and decode against the CPU (bf16, f16, f32)', function()
  T.cuda()
  local CU = {device = 'cuda'}
  for _, c in ipairs {
    {B = 2, H = 3, T = 300, S = 300, D = 64, o = {}},
    {B = 1, H = 2, T = 200, S = 333, D = 128, o = {window = 100, n_global = 7}},
    {B = 1, H = 1, T = 129, S = 129, D = 64, o = {window = 64}},
    {B = 1, H = 1, T = 77, S = 50, D = 128, o = {causal = false}},
  } do
    for _, dt in ipairs {'bf16', 'f16', 'f32'} do
      local q, k, v = rn {c.B, c.H, c.T, c.D}, rn {c.B, c.H, c.S, c.D}, rn {c.B, c.H, c.S, c.D}
      q, k, v = q:to(dt), k:to(dt), v:to(dt)
      local ro, rl = gp.attention(q:float(), k:float(), v:float(), c.o)
      local go, gl = gp.attention(q:cuda(), k:cuda(), v:cuda(), c.o)
      local tol = dt == 'f32' and 1e-5 or dt == 'f16' and 3e-3 or 1e-2
      T.ok(T.relnorm(go:float():cpu(), ro) < tol, dt .. ' out')
      T.ok(T.relnorm(gl:cpu(), rl) < 1e-4, dt .. ' lse')
      -- backward through autograd on both devices
      local function grads(dev)
        -- fresh leaves on each device (detach: the f32 inputs themselves must not become leaves that need grad)
        local function leaf(t) return t:detach():float():to(dev):requires_grad() end
        local a, b, d = leaf(q), leaf(k), leaf(v)
        local y = gp.attention(a, b, d, c.o)
        y:backward(gp.ones(y.shape, {device = dev}))
        return a.grad:cpu(), b.grad:cpu(), d.grad:cpu()
      end
      local c1, c2, c3 = grads('cpu')
      local g1, g2, g3 = grads('cuda')
      T.ok(T.relnorm(g1, c1) < 1e-4 and T.relnorm(g2, c2) < 1e-4 and T.relnorm(g3, c3) < 1e-4, dt .. ' grads')
    end
  end
  -- decode through a cache on the GPU (a long cache: several splits)
  local B, H, C, D = 2, 4, 2000, 128
  local cache = gp.KVCache {batch = B, heads = H, capacity = C, head_dim = D, dtype = 'bf16', device = 'cuda'}
  local k, v = rn({B, H, 1500, D}, CU):bf16(), rn({B, H, 1500, D}, CU):bf16()
  local before = gp.memory().allocs
  cache:append(1, k, v)
  T.eq(gp.memory().allocs, before)
  local q = rn({B, H, D}, CU):bf16()
  for _, o in ipairs {{}, {window = 300, n_global = 4}} do
    local got = cache:attend(1, q, o)
    local ref = gp.attention_decode(q:float():cpu(), cache.k[1]:float():cpu(), cache.v[1]:float():cpu(),
      cache:lens(1):cpu(), o)
    T.ok(T.relnorm(got:float():cpu(), ref) < 1e-2)
  end
  -- the kernel for each dtype and head dim, per-row lengths (0 included),
  -- with operands 16-byte aligned and starting one element in (element loads)
  for _, D2 in ipairs {64, 128} do
    for _, dt in ipairs {'bf16', 'f16', 'f32'} do
      for _, odd in ipairs {false, true} do
        local function mk(shape)
          local n = 1
          for _, e in ipairs(shape) do n = n * e end
          local flat = rn({n + 1}, CU):to(dt)
          return flat:narrow(1, odd and 2 or 1, n):view(shape)
        end
        local q2, kc, vc = mk {3, 2, D2}, mk {3, 2, 700, D2}, mk {3, 2, 700, D2}
        local lens = gp.tensor({700, 0, 333}, {dtype = 'i32', device = 'cuda'})
        for _, o in ipairs {{}, {window = 100, n_global = 5}} do
          local got = gp.attention_decode(q2, kc, vc, lens, o)
          local ref = gp.attention_decode(q2:float():cpu(), kc:float():cpu(), vc:float():cpu(), lens:cpu(), o)
          local name = string.format('decode %s D %d%s window %d', dt, D2, odd and ' (unaligned)' or '', o.window or 0)
          T.ok(T.relnorm(got:float():cpu(), ref) < (dt == 'f32' and 1e-5 or 1e-2), name)
          T.eq(got:float():cpu():sum():item() == got:float():cpu():sum():item(), true, name .. ': no NaN')
        end
      end
    end
  end
end)

---------------------------------------------------------------------------
-- strided operands: the kernels read q, k, v, out, dout, dq, dk, dv at any
-- strides on B, H and T (stride 1 on D); gp.attention_qkv reads the heads
-- straight from a fused (B, T, 3C) qkv buffer

-- n (B, H, R, D) operands of dtype dt on dev: 'contig' n separate tensors,
-- 'qkv' the heads of one (B, R, n, H, D) buffer (16-byte aligned rows: the
-- tensor-core path for bf16/f16), 'odd' the same with rows of D + 1 (odd
-- strides: the plain path)
local function operands(dev, dt, layout, B, H, R, D, n)
  local to = {dtype = dt, device = dev}
  local r = {}
  if layout == 'contig' then
    for i = 1, n do r[i] = gp.empty({B, H, R, D}, to) end
    return unpack(r)
  end
  local buf = layout == 'qkv' and gp.empty({B, R, n, H, D}, to) or gp.empty({B, R, n, H, D + 1}, to):narrow(5, 1, D)
  for i = 1, n do r[i] = buf:select(3, i):transpose(2, 3) end
  return unpack(r)
end

-- attn_fwd and attn_bwd on dev in dtype dt with every operand in `layout`,
-- from the f32 CPU tensors x.q, x.k, x.v, x.dout; the backward takes the
-- forward's out rounded to dt (round) or as it is. Returns f32 CPU tensors.
local function run_layout(dev, dt, layout, c, x, round)
  local B, H, Tq, S, D = c.B, c.H, c.T, c.S, c.D
  local q = operands(dev, dt, layout, B, H, Tq, D, 1)
  local k, v = operands(dev, dt, layout, B, H, S, D, 2)
  local out, dout = operands(dev, dt, layout, B, H, Tq, D, 2)
  local dq = operands(dev, dt, layout, B, H, Tq, D, 1)
  local dk, dv = operands(dev, dt, layout, B, H, S, D, 2)
  q:copy_(x.q:to(dt)); k:copy_(x.k:to(dt)); v:copy_(x.v:to(dt)); dout:copy_(x.dout:to(dt))
  for _, t in ipairs {out, dq, dk, dv} do t:fill_(7) end -- poison
  local lse = gp.empty({B, H, Tq}, {device = dev})
  local sc, w, ng, cz = kargs(c)
  gp.k.attn_fwd(out, lse, q, k, v, sc, w, ng, cz)
  local o = out
  if round then o = operands(dev, dt, layout, B, H, Tq, D, 1); o:copy_(out:to(round):to(dt)) end
  gp.k.attn_bwd(dq, dk, dv, q, k, v, o, lse, dout, sc, w, ng, cz)
  local function f(t) return t:float():cpu():contiguous() end
  return {out = f(out), lse = f(lse), dq = f(dq), dk = f(dk), dv = f(dv)}
end

local SCASES = {
  {B = 2, H = 2, T = 7, S = 7, D = 64, o = {}},
  {B = 1, H = 3, T = 5, S = 9, D = 128, o = {window = 3, n_global = 1}},
  {B = 1, H = 2, T = 6, S = 4, D = 64, o = {causal = false, scale = 0.3}},
}
local GCASES = {
  {B = 2, H = 3, T = 77, S = 77, D = 64, o = {}},
  {B = 1, H = 2, T = 65, S = 130, D = 128, o = {window = 40, n_global = 3}},
  {B = 2, H = 1, T = 129, S = 129, D = 64, o = {window = 16}},
  {B = 1, H = 2, T = 33, S = 20, D = 128, o = {causal = false}},
}

local function inputs(c, dt)
  local function r(n) return rn({c.B, c.H, n, c.D}):to(dt):float() end
  return {q = r(c.T), k = r(c.S), v = r(c.S), dout = r(c.T)}
end

T.test('attention kernels on the CPU: strided views of a qkv buffer and a transposed out equal contiguous operands', function()
  gp.manual_seed(5)
  for _, c in ipairs(SCASES) do
    for _, dt in ipairs {'f32', 'f64'} do
      local x = inputs(c, dt)
      local ref = run_layout('cpu', dt, 'contig', c, x)
      for _, layout in ipairs {'qkv', 'odd'} do
        local got = run_layout('cpu', dt, layout, c, x)
        for _, key in ipairs {'out', 'lse', 'dq', 'dk', 'dv'} do
          T.ok(T.relnorm(got[key], ref[key]) < 1e-6, string.format('%s %s T %d %s', dt, layout, c.T, key))
        end
      end
    end
  end
end)

T.test('attention kernels on the GPU: strided operands against the CPU (tensor cores and plain; f32, bf16, f16)', function()
  T.cuda()
  gp.manual_seed(13)
  for _, c in ipairs(GCASES) do
    for _, dt in ipairs {'f32', 'bf16', 'f16'} do
      local x = inputs(c, dt)
      -- the reference: contiguous f32 on the CPU, its backward from its out rounded to dt
      local ref = run_layout('cpu', 'f32', 'contig', c, x, dt)
      for _, layout in ipairs {'qkv', 'odd', 'contig'} do
        local got = run_layout('cuda', dt, layout, c, x)
        for _, key in ipairs {'out', 'lse', 'dq', 'dk', 'dv'} do
          local tol = key == 'lse' and 1e-4 or TOL[dt]
          T.ok(T.relnorm(got[key], ref[key]) < tol, string.format('%s %s T %d S %d D %d %s', dt, layout, c.T, c.S,
            c.D, key))
        end
      end
    end
  end
end)

-- the old path: narrow / reshape / transpose per head, gp.attention, and back
local function attention_heads(qkv, H, o)
  local B, Tq, C3 = unpack(qkv.shape)
  local C = C3 / 3
  local function head(i) return qkv:narrow(3, (i - 1) * C + 1, C):reshape {B, Tq, H, C / H}:transpose(2, 3) end
  return (gp.attention(head(1), head(2), head(3), o)):transpose(2, 3):reshape {B, Tq, C}
end

local function compare_qkv(dev, dt, B, Tq, H, D, o, tol)
  local qkv0 = rn({B, Tq, 3 * H * D}, {device = dev}):to(dt)
  local g = rn({B, Tq, H * D}, {device = dev}):to(dt)
  local a, b = qkv0:clone():requires_grad(), qkv0:clone():requires_grad()
  local ya, lse = gp.attention_qkv(a, H, o)
  local yb = attention_heads(b, H, o)
  T.same(ya.shape, {B, Tq, H * D})
  T.same(lse.shape, {B, H, Tq})
  ya:backward(g)
  yb:backward(g)
  local name = string.format('%s %s T %d D %d', dev, dt, Tq, D)
  T.ok(T.relnorm(ya:float(), yb:float()) <= tol, name .. ' y')
  T.ok(T.relnorm(a.grad:float(), b.grad:float()) <= tol, name .. ' dqkv')
end

T.test('attention_qkv equals narrow/transpose + gp.attention (values and gradients) on the CPU', function()
  gp.manual_seed(17)
  compare_qkv('cpu', 'f32', 2, 5, 2, 64, {}, 1e-6)
  compare_qkv('cpu', 'f32', 1, 7, 1, 128, {window = 3, n_global = 1}, 1e-6)
  compare_qkv('cpu', 'f64', 1, 4, 2, 64, {causal = false, scale = 0.2}, 1e-12)
  -- no copies: the forward allocates y and lse only
  local qkv = rn {1, 5, 384}
  local before = gp.memory().host_allocs
  gp.attention_qkv(qkv, 2)
  T.eq(gp.memory().host_allocs - before, 2)
  -- a qkv that is not contiguous on its last dim is copied once and gives the same answer
  local qt = rn {1, 384, 5}
  T.ok(T.relnorm(gp.attention_qkv(qt:transpose(2, 3), 2), gp.attention_qkv(qt:transpose(2, 3):contiguous(), 2)) == 0)
end)

T.test('attention_qkv: gradcheck in f64 (B 1, T 5, H 2, D 64)', function()
  gp.manual_seed(19)
  local qkv = rn({1, 5, 3 * 2 * 64}, CPU64)
  T.ok(gp.gradcheck(function(t) return (gp.attention_qkv(t, 2)) end, {qkv}))
  T.ok(gp.gradcheck(function(t) return (gp.attention_qkv(t, 2, {window = 2, n_global = 1})) end, {qkv}))
end)

T.test('head dim 32: gradcheck of gp.attention and attention_qkv in f64; attention_qkv equals the per-head path', function()
  gp.manual_seed(23)
  local q, k, v = rn({1, 2, 4, 32}, CPU64), rn({1, 2, 5, 32}, CPU64), rn({1, 2, 5, 32}, CPU64)
  T.ok(gp.gradcheck(function(a, b, d) return (gp.attention(a, b, d)) end, {q, k, v}))
  T.ok(gp.gradcheck(function(t) return (gp.attention_qkv(t, 2)) end, {rn({1, 5, 3 * 2 * 32}, CPU64)}))
  compare_qkv('cpu', 'f32', 2, 9, 2, 32, {}, 1e-6)
end)

T.test('attention_qkv errors name the op and the shapes', function()
  T.raises(function() gp.attention_qkv(rn {1, 4, 100}, 2) end, 'attention_qkv', '(1,4,100)', 'n_head 2')
  T.raises(function() gp.attention_qkv(rn {1, 4, 288}, 2) end, 'attention_qkv', 'head dim 48', '(1,4,288)')
  T.raises(function() gp.attention_qkv(rn {4, 384}, 2) end, 'attention_qkv', '(4,384)')
  T.raises(function() gp.attention_qkv(rn {1, 4, 384}, 0) end, 'attention_qkv', 'n_head')
  T.raises(function() gp.attention_qkv(rn {1, 4, 384}, 2, {window = -1}) end, 'attention_qkv', 'window')
  T.raises(function() gp.attention_qkv('x', 2) end, 'attention_qkv', 'qkv must be a tensor')
end)

-- a tiny GPT (head dim 64) trained a few steps through CausalSelfAttention:
-- the qkv path (gp.attention_qkv) and the old per-head path (nn.attention
-- swapped for a wrapper, which turns the qkv path off) give the same losses
local function train_losses(dev, old_path)
  local nn = gp.nn
  local saved = nn.attention
  if old_path then nn.attention = function(...) return saved(...) end end
  local ok, res = pcall(function()
    gp.manual_seed(23)
    local m = nn.GPT {vocab_size = 11, block_size = 8, n_embd = 128, n_layer = 1, n_head = 2, device = dev}
    local idx = gp.randint(0, 11, {2, 8}, {device = 'cpu'}):to(dev)
    local tg = gp.randint(0, 11, {2, 8}, {device = 'cpu'}):to(dev)
    local opt = gp.optim.AdamW(m:parameters(), {lr = 1e-2})
    local losses = {}
    for step = 1, 4 do
      opt:zero_grad()
      local _, loss = m(idx, tg)
      losses[step] = loss:item()
      loss:backward()
      opt:step()
    end
    return losses
  end)
  nn.attention = saved
  if not ok then error(res, 0) end
  return res
end

T.test('a GPT with head dim 64 trains to the same losses through attention_qkv as through the per-head path', function()
  local a, b = train_losses('cpu', false), train_losses('cpu', true)
  for i = 1, #a do T.ok(math.abs(a[i] - b[i]) <= 1e-5 * math.abs(b[i]), string.format('step %d: %g vs %g', i, a[i], b[i])) end
  T.ok(a[4] < a[1], 'the loss goes down')
end)

T.test('attention_qkv on the GPU: equals the per-head path and the CPU (f32, bf16); GPT losses', function()
  T.cuda()
  gp.manual_seed(29)
  compare_qkv('cuda', 'f32', 2, 77, 3, 64, {}, 1e-5)
  compare_qkv('cuda', 'bf16', 2, 77, 3, 64, {}, 1e-2)
  compare_qkv('cuda', 'bf16', 1, 130, 2, 128, {window = 40, n_global = 2}, 1e-2)
  compare_qkv('cuda', 'f16', 1, 65, 2, 64, {causal = false}, 3e-3)
  compare_qkv('cuda', 'f32', 2, 70, 4, 32, {}, 1e-5)
  compare_qkv('cuda', 'bf16', 1, 70, 4, 32, {}, 1e-2)
  -- against the CPU (f32 on rounded inputs)
  for _, dt in ipairs {'f32', 'bf16'} do
    local qkv = rn {2, 33, 384}:to(dt):float()
    local g = rn {2, 33, 128}:to(dt):float()
    local function run(dev, d)
      local x = qkv:to(d):to(dev):detach():requires_grad() -- (to() of the same dtype and device is qkv itself)
      local y = gp.attention_qkv(x, 2)
      y:backward(g:to(d):to(dev))
      return y:float():cpu(), x.grad:float():cpu()
    end
    local yc, gc = run('cpu', 'f32')
    local yg, gg = run('cuda', dt)
    local tol = dt == 'f32' and 1e-5 or 2e-2
    T.ok(T.relnorm(yg, yc) < tol, dt .. ' y')
    T.ok(T.relnorm(gg, gc) < tol, dt .. ' dqkv')
  end
  -- no copies on the device: the forward allocates y and lse only
  local x = rn({4, 64, 768}, {device = 'cuda'}):bf16()
  gp.attention_qkv(x, 4) -- (warm)
  local before = gp.memory().allocs
  gp.attention_qkv(x, 4)
  T.eq(gp.memory().allocs - before, 2)
  local a, b = train_losses('cuda', false), train_losses('cuda', true)
  for i = 1, #a do T.ok(math.abs(a[i] - b[i]) <= 1e-4 * math.abs(b[i]), string.format('step %d: %g vs %g', i, a[i], b[i])) end
end)

---------------------------------------------------------------------------
-- grouped-query attention: k, v (and the KV cache) with Hkv heads dividing
-- H; query head h reads KV head h / (H / Hkv), dk and dv sum over the group

local repeat_kv = gp.nn.repeat_kv
local GQA = {
  {B = 1, H = 4, Hkv = 2, T = 5, S = 5, D = 64, o = {}},                                  -- G 2
  {B = 2, H = 9, Hkv = 3, T = 4, S = 7, D = 64, o = {window = 3, n_global = 1}},        -- G 3 (SmolLM2's 9:3)
  {B = 1, H = 4, Hkv = 1, T = 6, S = 4, D = 128, o = {causal = false, scale = 0.3}},    -- G 4 (multi-query)
  {B = 1, H = 6, Hkv = 3, T = 3, S = 5, D = 32, o = {}},                                  -- G 2, head dim 32
  {B = 1, H = 3, Hkv = 3, T = 4, S = 4, D = 64, o = {}},                                  -- G 1
}

T.test('grouped-query attention equals attention over repeated k, v: values and gradients (f64 cpu, G 1 to 4)', function()
  gp.manual_seed(31)
  for _, c in ipairs(GQA) do
    local name = string.format('H %d Hkv %d T %d S %d D %d', c.H, c.Hkv, c.T, c.S, c.D)
    local q, k, v = rn({c.B, c.H, c.T, c.D}, CPU64), rn({c.B, c.Hkv, c.S, c.D}, CPU64), rn({c.B, c.Hkv, c.S, c.D}, CPU64)
    local dout = rn({c.B, c.H, c.T, c.D}, CPU64)
    local function run(rep)
      local a, b, d = q:clone():requires_grad(), k:clone():requires_grad(), v:clone():requires_grad()
      local kk, vv = b, d
      if rep then kk, vv = repeat_kv(b, c.H), repeat_kv(d, c.H) end
      local out, lse = gp.attention(a, kk, vv, c.o)
      out:backward(dout)
      return out, lse, a.grad, b.grad, d.grad
    end
    local o1, l1, dq1, dk1, dv1 = run(false)
    local o2, l2, dq2, dk2, dv2 = run(true)
    T.same(o1.shape, {c.B, c.H, c.T, c.D})
    T.same(dk1.shape, {c.B, c.Hkv, c.S, c.D})
    T.ok(T.relnorm(o1, o2) < 1e-12, name .. ' out')
    T.ok(T.relnorm(l1, l2) < 1e-6, name .. ' lse') -- (lse is f32)
    T.ok(T.relnorm(dq1, dq2) < 1e-12, name .. ' dq')
    T.ok(T.relnorm(dk1, dk2) < 1e-12, name .. ' dk: the sum over the group')
    T.ok(T.relnorm(dv1, dv2) < 1e-12, name .. ' dv: the sum over the group')
    T.ok(T.relnorm(o1, (oracle(q, k, v, c.o))) < 1e-12, name .. ' oracle')
  end
end)

T.test('grouped-query attention: gradcheck in f64 (multi-query, 9:3 with a window, head dim 32)', function()
  gp.manual_seed(37)
  for _, c in ipairs {
    {H = 2, Hkv = 1, T = 3, S = 3, D = 64, o = {}},
    {H = 9, Hkv = 3, T = 2, S = 4, D = 64, o = {window = 2, n_global = 1}},
    {H = 4, Hkv = 2, T = 3, S = 2, D = 32, o = {causal = false}},
  } do
    local q, k, v = rn({1, c.H, c.T, c.D}, CPU64), rn({1, c.Hkv, c.S, c.D}, CPU64), rn({1, c.Hkv, c.S, c.D}, CPU64)
    T.ok(gp.gradcheck(function(a, b, d) return (gp.attention(a, b, d, c.o)) end, {q, k, v}),
      string.format('H %d Hkv %d', c.H, c.Hkv))
  end
end)

T.test('grouped-query attention: the kernels on strided views of a (B, T, H + 2 Hkv, D) buffer equal contiguous operands', function()
  gp.manual_seed(41)
  local B, H, Hkv, Tq, D = 2, 4, 2, 6, 64
  local buf = rn({B, Tq, H + 2 * Hkv, D}, CPU64)
  local q, k, v = buf:narrow(3, 1, H):transpose(2, 3), buf:narrow(3, H + 1, Hkv):transpose(2, 3),
    buf:narrow(3, H + Hkv + 1, Hkv):transpose(2, 3)
  local dout = rn({B, H, Tq, D}, CPU64)
  local function run(a, b, d)
    local out, lse = gp.empty({B, H, Tq, D}, CPU64), gp.empty({B, H, Tq}, CPU)
    gp.k.attn_fwd(out, lse, a, b, d, 0, 0, 0, 1)
    local dq, dk, dv = gp.empty(a.shape, CPU64), gp.empty(b.shape, CPU64), gp.empty(d.shape, CPU64)
    gp.k.attn_bwd(dq, dk, dv, a, b, d, out, lse, dout, 0, 0, 0, 1)
    return {out, lse, dq, dk, dv}
  end
  local x, y = run(q, k, v), run(q:contiguous(), k:contiguous(), v:contiguous())
  for i = 1, 5 do T.ok(T.relnorm(x[i], y[i]) == 0, 'output ' .. i) end
end)

T.test('attention_qkv with n_kv_head: q | k | v with H, Hkv, Hkv heads equals gp.attention on the parts', function()
  gp.manual_seed(43)
  for _, c in ipairs {
    {B = 2, T = 5, H = 4, Hkv = 2, D = 64, o = {}},
    {B = 1, T = 6, H = 9, Hkv = 3, D = 64, o = {window = 2, n_global = 1}},
    {B = 1, T = 4, H = 2, Hkv = 1, D = 32, o = {causal = false, scale = 0.2}},
  } do
    local H, Hkv, D = c.H, c.Hkv, c.D
    local qkv0 = rn({c.B, c.T, (H + 2 * Hkv) * D}, CPU64)
    local g = rn({c.B, c.T, H * D}, CPU64)
    local a, b = qkv0:clone():requires_grad(), qkv0:clone():requires_grad()
    local o = {n_kv_head = Hkv}
    for kk, vv in pairs(c.o) do o[kk] = vv end
    local ya, lse = gp.attention_qkv(a, H, o)
    T.same(ya.shape, {c.B, c.T, H * D})
    T.same(lse.shape, {c.B, H, c.T})
    local function part(first, n) return b:narrow(3, first * D + 1, n * D):view {c.B, c.T, n, D}:transpose(2, 3) end
    local yb = gp.attention(part(0, H), part(H, Hkv), part(H + Hkv, Hkv), c.o):transpose(2, 3):reshape {c.B, c.T, H * D}
    ya:backward(g)
    yb:backward(g)
    T.ok(T.relnorm(ya, yb) < 1e-12, 'y')
    T.ok(T.relnorm(a.grad, b.grad) < 1e-12, 'dqkv')
  end
  local qkv = rn({1, 3, (2 + 2) * 64}, CPU64)
  T.ok(gp.gradcheck(function(t) return (gp.attention_qkv(t, 2, {n_kv_head = 1})) end, {qkv}))
  T.raises(function() gp.attention_qkv(rn {1, 4, 640}, 4, {n_kv_head = 3}) end, 'attention_qkv', 'n_kv_head 3', '(1,4,640)',
    'must divide')
  T.raises(function() gp.attention_qkv(rn {1, 4, 500}, 4, {n_kv_head = 2}) end, 'attention_qkv', 'n_kv_head 2', '(1,4,500)')
  T.raises(function() gp.attention_qkv(rn {1, 4, 512}, 4, {n_kv_head = 0}) end, 'attention_qkv', 'n_kv_head')
end)

T.test('grouped-query decode: attention_decode and a KVCache of Hkv heads equal full attention and repeated caches', function()
  gp.manual_seed(47)
  local B, H, Hkv, S, C, D = 2, 9, 3, 7, 10, 64
  local q, k, v = rn {B, H, S, D}, rn {B, Hkv, S, D}, rn {B, Hkv, S, D}
  local kc, vc = gp.zeros({B, Hkv, C, D}, CPU), gp.zeros({B, Hkv, C, D}, CPU)
  kc:narrow(3, 1, S):copy_(k)
  vc:narrow(3, 1, S):copy_(v)
  local q1 = q:narrow(3, S, 1):reshape {B, H, D}
  for _, o in ipairs {{}, {window = 3, n_global = 1}, {scale = 0.2}} do
    local last = gp.attention(q, k, v, o):narrow(3, S, 1):reshape {B, H, D}
    local got = gp.attention_decode(q1, kc, vc, S, o)
    T.ok(T.relnorm(got, last) < 1e-6, 'decode vs the last row')
    local rep = gp.attention_decode(q1, repeat_kv(kc, H), repeat_kv(vc, H), S, o)
    T.ok(T.relnorm(got, rep) == 0, 'decode vs repeated caches')
  end
  -- per-row lengths
  local lens = gp.tensor({S, 4}, {dtype = 'i64', device = 'cpu'})
  local got = gp.attention_decode(q1, kc, vc, lens)
  local r2 = gp.attention(q:narrow(1, 2, 1):narrow(3, S, 1), k:narrow(1, 2, 1):narrow(3, 1, 4), v:narrow(1, 2, 1):narrow(3, 1, 4))
  T.ok(T.relnorm(got:narrow(1, 2, 1):reshape {H, D}, r2:reshape {H, D}) < 1e-6, 'row 2 over its 4 keys')
  -- multi-query: one KV head
  local k1, v1 = rn {B, 1, S, D}, rn {B, 1, S, D}
  local full = gp.attention(q, k1, v1):narrow(3, S, 1):reshape {B, H, D}
  T.ok(T.relnorm(gp.attention_decode(q1, k1, v1, S), full) < 1e-6, 'multi-query decode')
  -- the cache holds Hkv heads; attend takes the H query heads
  local cache = gp.KVCache {batch = B, heads = Hkv, capacity = C, head_dim = D, layers = 1, device = 'cpu'}
  cache:append(1, k:narrow(3, 1, S - 1), v:narrow(3, 1, S - 1))
  cache:append(1, k:narrow(3, S, 1), v:narrow(3, S, 1))
  T.ok(T.relnorm(cache:attend(1, q1), gp.attention_decode(q1, kc, vc, S)) == 0, 'cache:attend')
  local pos = gp.full({1}, S, {dtype = 'i64', device = 'cpu'})
  local k8, v8 = rn {B, Hkv, 1, D}, rn {B, Hkv, 1, D}
  cache:append_at(1, k8, v8, pos)
  local lens8 = gp.full({B}, S + 1, {dtype = 'i64', device = 'cpu'})
  local qn = rn {B, H, D}
  local want = gp.attention(qn:view {B, H, 1, D}, gp.cat({k, k8}, 3), gp.cat({v, v8}, 3)):reshape {B, H, D}
  T.ok(T.relnorm(cache:attend_at(1, qn, lens8), want) < 1e-6, 'cache:attend_at after append_at')
  -- errors name the shapes
  T.raises(function() cache:attend(1, rn {B, 4, D}) end, 'attention_decode', '(2,4,64)', '(2,3,10,64)', 'must divide')
  T.raises(function() gp.attention_decode(rn {B, 4, D}, kc, vc, S) end, 'attention_decode', '3 KV heads', '4 query heads')
  T.raises(function() gp.k.attn_decode(gp.empty({B, 4, D}, CPU), rn {B, 4, D}, kc, vc, lens) end, 'attn_decode', 'kcache',
    '(2,3,10,64)', 'must divide H = 4')
end)

T.test('grouped-query attention: nn.attention passes k, v to flash attention and repeats them on the matmul path', function()
  local nn = gp.nn
  gp.manual_seed(53)
  local q, k, v = rn {2, 6, 5, 64}, rn {2, 2, 5, 64}, rn {2, 2, 5, 64}
  T.ok(T.relnorm(nn.attention(q, k, v, {causal = true}), (oracle(q, k, v))) < 1e-5, 'flash path')
  -- the matmul path: head dim 16, a mask, dropout
  local a, b, c = rn {1, 4, 5, 16}, rn {1, 1, 5, 16}, rn {1, 1, 5, 16}
  T.ok(T.relnorm(nn.attention(a, b, c, {causal = true}), (oracle(a, b, c))) < 1e-5, 'matmul path')
  local m = gp.zeros({1, 1, 1, 5}, CPU)
  T.ok(T.relnorm(nn.attention(q, k, v, {mask = m}), (oracle(q, k, v, {causal = false}))) < 1e-5, 'masked (matmul) path')
  -- gradients through both paths reach k and v with their Hkv heads
  local x, y = rn({1, 4, 4, 64}, CPU64), rn({1, 2, 4, 64}, CPU64)
  T.ok(gp.gradcheck(function(s, t) return nn.attention(s, t, t * 0.5, {causal = true}) end, {x, y}))
  local x2, y2 = rn({1, 4, 4, 16}, CPU64), rn({1, 2, 4, 16}, CPU64)
  T.ok(gp.gradcheck(function(s, t) return nn.attention(s, t, t * 0.5, {causal = true}) end, {x2, y2}))
  T.same(repeat_kv(y2, 4).shape, {1, 4, 4, 16})
  T.ok(rawequal(repeat_kv(x2, 4), x2))
  T.raises(function() nn.attention(q, rn {2, 4, 5, 64}, rn {2, 4, 5, 64}) end, 'attention', '(2,6,5,64)', '(2,4,5,64)')
  T.raises(function() repeat_kv(rn {1, 4, 2, 16}, 6) end, 'repeat_kv', 'divide')
end)

-- grouped-query attention on the GPU, run in a fresh process per
-- implementation (GP_ATTN_IMPL is read once a process): the kernels' forward
-- and backward and decode over a cache of Hkv heads, bf16 and f16, D 64 and
-- 128, causal (with a window) and not; ODD puts every operand one element off
-- 16-byte alignment (the plain kernels; decode's element loads). Prints
-- 'REL value tol name' per comparison against the f32 CPU reference.
local GQA_GPU_SNIPPET = [[
gp.manual_seed(61)
local CPU = {device = 'cpu'}
local td = require('gpush.core.tensor').to_doubles
local function rel(a, b)
  local x, n = td(a:float():cpu():contiguous())
  local y = td(b:float():cpu():contiguous())
  local num, den = 0, 0
  for e = 0, n - 1 do num = num + (x[e] - y[e]) ^ 2; den = den + y[e] ^ 2 end
  return math.sqrt(num / math.max(den, 1e-30))
end
-- t (an f32 CPU tensor) on the GPU in dt, one element off alignment under ODD
local function dev(t, dt)
  if not ODD then return t:to(dt):cuda() end
  local n = t:numel()
  local y = gp.empty({n + 1}, {dtype = dt, device = 'cuda'}):narrow(1, 2, n):view(t.shape)
  y:copy_(t:to(dt):cuda())
  return y
end
local TOL = {bf16 = 1e-2, f16 = 3e-3}
for _, c in ipairs {
  {B = 1, H = 4, Hkv = 1, T = 65, S = 65, D = 64, causal = 1},
  {B = 2, H = 6, Hkv = 2, T = 130, S = 130, D = 128, causal = 1, window = 40, ng = 3},
  {B = 2, H = 9, Hkv = 3, T = 100, S = 150, D = 64, causal = 1},
  {B = 1, H = 4, Hkv = 2, T = 70, S = 40, D = 64, causal = 0},
  {B = 1, H = 8, Hkv = 2, T = 129, S = 200, D = 128, causal = 0},
} do
  for _, dt in ipairs {'bf16', 'f16'} do
    local function r(h, n) return gp.randn({c.B, h, n, c.D}, CPU):to(dt):float() end
    local q, k, v, g = r(c.H, c.T), r(c.Hkv, c.S), r(c.Hkv, c.S), r(c.H, c.T)
    local sc, w, ng = 1 / math.sqrt(c.D), c.window or 0, c.ng or 0
    local out, lse = gp.empty(q.shape, CPU), gp.empty({c.B, c.H, c.T}, CPU)
    gp.k.attn_fwd(out, lse, q, k, v, sc, w, ng, c.causal)
    local dq, dk, dv = gp.empty(q.shape, CPU), gp.empty(k.shape, CPU), gp.empty(v.shape, CPU)
    gp.k.attn_bwd(dq, dk, dv, q, k, v, out:to(dt):float(), lse, g, sc, w, ng, c.causal)
    local function z(t) return dev(gp.zeros(t.shape, CPU), dt) end
    local Q, K, V, G = dev(q, dt), dev(k, dt), dev(v, dt), dev(g, dt)
    local O, L = z(q), gp.empty({c.B, c.H, c.T}, {device = 'cuda'})
    gp.k.attn_fwd(O, L, Q, K, V, sc, w, ng, c.causal)
    local DQ, DK, DV = z(q), z(k), z(v)
    gp.k.attn_bwd(DQ, DK, DV, Q, K, V, O, L, G, sc, w, ng, c.causal)
    local name = string.format('%s H %d Hkv %d T %d S %d D %d causal %d', dt, c.H, c.Hkv, c.T, c.S, c.D, c.causal)
    print('REL', rel(O, out), TOL[dt], name .. ' out')
    print('REL', rel(L, lse), 1e-4, name .. ' lse')
    print('REL', rel(DQ, dq), TOL[dt], name .. ' dq')
    print('REL', rel(DK, dk), TOL[dt], name .. ' dk')
    print('REL', rel(DV, dv), TOL[dt], name .. ' dv')
    -- decode: the last query of each row over a cache of Hkv heads (per-row lengths)
    local C = c.S + 3
    local kc, vc = gp.zeros({c.B, c.Hkv, C, c.D}, CPU), gp.zeros({c.B, c.Hkv, C, c.D}, CPU)
    kc:narrow(3, 1, c.S):copy_(k)
    vc:narrow(3, 1, c.S):copy_(v)
    local lv = {}
    for b = 1, c.B do lv[b] = c.S - (b - 1) * 7 end
    local lens = gp.tensor(lv, {dtype = 'i32', device = 'cpu'})
    local q1 = q:narrow(3, c.T, 1):reshape {c.B, c.H, c.D}
    local ref = gp.attention_decode(q1, kc, vc, lens, {window = w, n_global = ng})
    local got = gp.attention_decode(dev(q1, dt), dev(kc, dt), dev(vc, dt), lens:cuda(), {window = w, n_global = ng})
    print('REL', rel(got, ref), TOL[dt], name .. ' decode')
  end
end
print('DONE')
]]
T.test('grouped-query attention on the GPU: wgmma (Hopper default), mma, plain (unaligned) and decode against the CPU', function()
  T.cuda()
  for _, run in ipairs {{'', ''}, {'GP_ATTN_IMPL=mma', ''}, {'', 'ODD = true\n'}} do
    local out = run_snippet(run[1], run[2] .. GQA_GPU_SNIPPET)
    T.ok(out:find('DONE', 1, true), out)
    local n = 0
    for val, tol, name in out:gmatch('REL%s+(%S+)%s+(%S+)%s+([^\n]+)') do
      n = n + 1
      T.ok(tonumber(val) and tonumber(val) < tonumber(tol), string.format('%s%s %s: %s (tolerance %s)', run[1],
        run[2] ~= '' and ' unaligned' or '', name, val, tol))
    end
    T.eq(n, 5 * 2 * 6, 'comparisons made: ' .. out)
  end
end)

T.test('grouped-query attention errors name the op and the shapes', function()
  local q = rn {1, 6, 4, 64}
  T.raises(function() gp.attention(q, rn {1, 4, 4, 64}, rn {1, 4, 4, 64}) end, 'attention', '4 KV heads', '6 query heads',
    '(1,6,4,64)', '(1,4,4,64)')
  T.raises(function() gp.attention(q, rn {1, 2, 4, 64}, rn {1, 3, 4, 64}) end, 'attention', '(1,2,4,64)', '(1,3,4,64)')
  local out, lse = gp.empty(q.shape, CPU), gp.empty({1, 6, 4}, CPU)
  T.raises(function() gp.k.attn_fwd(out, lse, q, rn {1, 4, 4, 64}, rn {1, 4, 4, 64}) end, 'attn_fwd', 'k has shape (1,4,4,64)',
    'must divide H = 6', '(1,6,4,64)')
  T.raises(function() gp.k.attn_fwd(out, lse, q, rn {1, 2, 4, 64}, rn {1, 3, 4, 64}) end, 'attn_fwd', 'v is (1,3,4,64)',
    'k is (1,2,4,64)')
  local k, v = rn {1, 2, 4, 64}, rn {1, 2, 4, 64}
  T.raises(function() gp.k.attn_bwd(gp.empty(q.shape, CPU), gp.empty({1, 6, 4, 64}, CPU), gp.empty(k.shape, CPU), q, k, v,
    out, lse, q) end, 'attn_bwd', 'dk', 'dv')
end)

-- The Hopper kernels run their blocks head group by head group (a group's
-- K/V or Q/dO/dQ within GP_ATTN_L2_MB); a 1 MB budget splits these shapes
-- into groups of one or a few heads, 0 is the tile-major order over all
-- heads: the outputs must agree (forward bitwise, dq up to its f32 atomics'
-- order, dk and dv bitwise: each element written once).
local L2_SNIPPET = [[
gp.manual_seed(5)
local CU = {dtype = 'bf16', device = 'cuda'}
for ci, c in ipairs {{1, 8, 2, 2048, 128, 1}, {2, 8, 8, 1024, 64, 0}, {1, 6, 2, 1536, 64, 1}} do
  local B, H, Hkv, T, D, causal = unpack(c)
  local q, k, v = gp.randn({B, H, T, D}, CU), gp.randn({B, Hkv, T, D}, CU), gp.randn({B, Hkv, T, D}, CU)
  local dout = gp.randn({B, H, T, D}, CU)
  local out, lse = gp.empty({B, H, T, D}, CU), gp.empty({B, H, T}, {device = 'cuda'})
  local dq, dk, dv = gp.empty({B, H, T, D}, CU), gp.empty({B, Hkv, T, D}, CU), gp.empty({B, Hkv, T, D}, CU)
  gp.k.attn_fwd(out, lse, q, k, v, 1 / math.sqrt(D), 0, 0, causal)
  gp.k.attn_bwd(dq, dk, dv, q, k, v, out, lse, dout, 1 / math.sqrt(D), 0, 0, causal)
  for name, t in pairs {out = out, lse = lse, dq = dq, dk = dk, dv = dv} do
    gp.save(string.format('%s/%d_%s.safetensors', os.getenv('L2_DIR'), ci, name), {t = t:float():cpu()})
  end
end
print('DONE')
]]
T.test('Hopper attention: the head-grouped block order gives the outputs of the tile-major order', function()
  T.cuda()
  local base = os.tmpname()
  os.remove(base)
  local dirs = {base .. '_g', base .. '_t'}
  for i, mb in ipairs {1, 0} do
    os.execute('mkdir -p ' .. dirs[i])
    local out = run_snippet(string.format('L2_DIR=%s GP_ATTN_L2_MB=%d', dirs[i], mb), L2_SNIPPET)
    T.ok(out:find('DONE', 1, true), out)
  end
  for c = 1, 3 do
    for _, name in ipairs {'out', 'lse', 'dq', 'dk', 'dv'} do
      local function load(d) return gp.load(string.format('%s/%d_%s.safetensors', d, c, name)).t end
      local r = T.relnorm(load(dirs[1]), load(dirs[2]))
      -- (dq: the f32 atomics add in another order, then round to bf16)
      T.ok(r <= (name == 'dq' and 1e-3 or 0), string.format('case %d %s: relative difference %g', c, name, r))
    end
  end
  for _, d in ipairs(dirs) do os.execute('rm -rf ' .. d) end
end)
