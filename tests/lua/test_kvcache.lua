-- Compressed KV caches (gp.KVCache{kv_dtype = 'int8' | 'fp8'}): the codes
-- the quantize-append kernel writes (kernels/kvquant.h), decode attention
-- over the codes against the same cache in bf16, the cache's methods, greedy
-- generation with a fixture model, memory, bad input. The GPU cases (the
-- kernels' bytes and decode against the CPU) skip without a GPU; the generic
-- CPU-vs-GPU kernel test covers kv_quant_append, kv_dequant and
-- attn_decode_q too (test_kernels.lua).
local T = require 'lib'
local gp = require 'gpush'

local CPU = {device = 'cpu'}
local FMT = {int8 = 1, fp8 = 2}
local root = (GPUSH_ROOT or '.') .. '/tests/fixtures/models'

local function rn(shape, o) return gp.randn(shape, o or CPU) end

-- codes and scales of x (B, H, K, D) less center (B, H, D; default 0) quantized into a fresh cache of K positions
local function quantize(x, fmt, dev, center)
  dev = dev or 'cpu'
  local B, H, K, D = unpack(x.shape)
  local codes, scales = gp.zeros({B, H, K, D}, {dtype = 'u8', device = dev}), gp.zeros({B, H, K}, {device = dev})
  center = center or gp.zeros({B, H, D}, CPU)
  gp.k.kv_quant_append(codes, scales, x:to(dev), center:to(dev), gp.zeros({1}, {dtype = 'i64', device = dev}), fmt)
  return codes, scales
end
local function zc(B, H, D) return gp.zeros({B, H, D}, CPU) end
-- {int8 = {kcodes, vcodes, kscales, vscales}, fp8 = ...} of keys k (less the center kcen when given) and values v
local function codes_of(k, v, kcen)
  local codes = {}
  for name, fmt in pairs(FMT) do
    local kc, ks = quantize(k, fmt, nil, kcen)
    local vc, vs = quantize(v, fmt)
    codes[name] = {kc, vc, ks, vs}
  end
  return codes
end

T.test('kv_quant_append: fp8 e4m3 codes rounded to nearest even and saturated; int8 codes to +-127', function()
  -- one row whose max |x| is 448 (the scale is 1: the codes are e4m3(x) itself)
  local vals = {448, 1, -2, 1.0625, 1.1875, 2 ^ -6, 2 ^ -9, 2 ^ -10, -2 ^ -10 * 3, 0.3, 240, -448}
  local want = {0x7e, 0x38, 0xc0, 0x38, 0x3a, 0x08, 0x01, 0x00, 0x82, 0x2a, 0x77, 0xfe}
  local x = gp.tensor({{{vals}}}, CPU)
  local codes, scales = quantize(x, FMT.fp8)
  T.eq(scales:item(), 1)
  local got = codes:view {#vals}:totable()
  for i = 1, #vals do T.eq(got[i], want[i], string.format('e4m3(%g)', vals[i])) end
  -- int8: the largest |x| is +-127 (here 127: the scale is 1), ties round to even
  local xi = gp.tensor({{{{-127, 63.5, 0.5, 1.5, 2.5, 0}}}}, CPU)
  local ci, si = quantize(xi, FMT.int8)
  T.eq(si:item(), 1)
  T.eq(table.concat(ci:view {6}:totable(), ','), table.concat({129, 64, 0, 2, 2, 0}, ','), 'int8 codes (two\'s complement)')
  -- an all-zero row: scale 0, codes 0
  local cz, sz = quantize(gp.zeros({1, 1, 1, 8}, CPU), FMT.int8)
  T.eq(sz:item(), 0)
  T.eq(cz:sum():item(), 0)
end)

T.test('kv_quant_append then kv_dequant: every element within the format\'s rounding of the row scale', function()
  gp.manual_seed(3)
  local x = rn {2, 3, 9, 64}
  for name, fmt in pairs(FMT) do
    local codes, scales = quantize(x, fmt)
    local y = gp.empty(x.shape, CPU)
    gp.k.kv_dequant(y, codes, scales, zc(2, 3, 64), fmt)
    local amax = x:abs():max(-1)
    -- int8: half a step (amax / 254); e4m3: 2^-4 relative (3 mantissa bits) plus half a subnormal step
    local err = (y - x):abs()
    local bound = name == 'int8' and (amax / 254):unsqueeze(-1):expand(x.shape) + 1e-6 or
      x:abs() * (1 / 16) + (amax * (2 ^ -10 / 448)):unsqueeze(-1):expand(x.shape) + 1e-6
    T.eq((err - bound):max():item() <= 0, true, name .. ': max excess ' .. (err - bound):max():item())
    T.ok(T.relnorm(scales, amax / (name == 'int8' and 127 or 448)) < 1e-6, name .. ' scales')
  end
  -- positions: rows written at pos .. pos + K - 1, the others untouched
  local codes, scales = gp.zeros({1, 1, 6, 64}, {dtype = 'u8', device = 'cpu'}), gp.zeros({1, 1, 6}, CPU)
  local function at(p) return gp.tensor({p}, {dtype = 'i64', device = 'cpu'}) end
  gp.k.kv_quant_append(codes, scales, rn {1, 1, 2, 64}, zc(1, 1, 64), at(3), 1)
  local s = scales:view {6}:totable()
  T.ok(s[1] == 0 and s[2] == 0 and s[3] == 0 and s[4] > 0 and s[5] > 0 and s[6] == 0, 'scales at 3 and 4 only')
  T.raises(function()
    gp.k.kv_quant_append(codes, scales, rn {1, 1, 2, 64}, zc(1, 1, 64), at(5), 1)
  end, 'kv_quant_append', 'position 5', '6 positions')
  T.raises(function() gp.k.kv_quant_append(codes, scales, rn {1, 1, 2, 64}, zc(1, 1, 64), at(0), 3) end,
    'kv_quant_append', 'fmt')
  T.raises(function() gp.k.kv_quant_append(codes, scales, rn {1, 1, 2, 64}, zc(1, 1, 32), at(0), 1) end,
    'kv_quant_append', 'center')
  T.raises(function() gp.k.kv_dequant(gp.empty({1, 1, 7, 64}, CPU), codes, scales, zc(1, 1, 64), 1) end, 'kv_dequant', '7 positions')
end)

-- a bf16 cache and a compressed one holding the same keys and values
local function caches(o, kv_dtype, k, v)
  local c16 = gp.KVCache {batch = o.B, heads = o.Hkv, capacity = o.C, head_dim = o.D, dtype = 'bf16', device = o.device}
  local cq = gp.KVCache {batch = o.B, heads = o.Hkv, capacity = o.C, head_dim = o.D, dtype = 'bf16', device = o.device,
                         kv_dtype = kv_dtype}
  for _, c in ipairs {c16, cq} do
    c:append(1, k:narrow(3, 1, o.S - 1), v:narrow(3, 1, o.S - 1))
    c:append(1, k:narrow(3, o.S, 1), v:narrow(3, o.S, 1))
  end
  return c16, cq
end

T.test('decode attention over an int8 cache within 2e-2 of the bf16 cache, fp8 within 5e-2 (GQA, windows, D 64, 128)', function()
  gp.manual_seed(7)
  for _, o in ipairs {
    {B = 2, H = 4, Hkv = 2, S = 50, C = 64, D = 64, opts = {}},
    {B = 1, H = 9, Hkv = 3, S = 300, C = 300, D = 64, opts = {window = 100, n_global = 4}},
    {B = 2, H = 4, Hkv = 1, S = 77, C = 80, D = 128, opts = {scale = 0.1}},
  } do
    o.device = 'cpu'
    local k, v = rn({o.B, o.Hkv, o.S, o.D}):bf16(), rn({o.B, o.Hkv, o.S, o.D}):bf16()
    local q = rn({o.B, o.H, o.D}):bf16()
    for _, kvd in ipairs {'int8', 'fp8'} do
      local c16, cq = caches(o, kvd, k, v)
      local ref, got = c16:attend(1, q, o.opts), cq:attend(1, q, o.opts)
      T.same(got.shape, {o.B, o.H, o.D})
      T.eq(got.dtype, 'bf16')
      local name = string.format('%s H %d Hkv %d S %d D %d', kvd, o.H, o.Hkv, o.S, o.D)
      -- int8: within 2e-2 (here 8e-3 to 1e-2); fp8 e4m3 has 3 mantissa bits: each element is off by up to
      -- 2^-4 of itself (about 2.5e-2 on average), the output by 3.2e-2 to 3.9e-2 here: within 5e-2
      local rel = T.relnorm(got:float(), ref:float())
      T.ok(rel < (kvd == 'int8' and 2e-2 or 5e-2), name .. ': ' .. rel)
      -- the kernel reads the codes as dequantizing them first (in f32) would
      local function deq(codes, scales, center)
        local t = gp.empty({o.B, o.Hkv, o.S, o.D}, CPU)
        gp.k.kv_dequant(t, codes, scales, center, FMT[kvd])
        return t
      end
      -- the keys' center: int8, the mean of the S - 1 keys of the first append; fp8, 0
      if kvd == 'int8' then
        T.ok(T.relnorm(cq.kc[1], k:narrow(3, 1, o.S - 1):float():mean(3)) < 1e-6, name .. ': the keys\' center')
      else
        T.eq(cq.kc[1]:abs():max():item(), 0, name .. ': no center')
      end
      local dq = gp.attention_decode(q:float(), deq(cq.k[1], cq.ks[1], cq.kc[1]), deq(cq.v[1], cq.vs[1], cq._c0), o.S,
        o.opts)
      T.ok(T.relnorm(got:float(), dq) < 1e-2, name .. ' vs the dequantized cache')
      T.ok(T.relnorm(cq:keys(1):float(), deq(cq.k[1], cq.ks[1], cq.kc[1])) < 1e-2,
        name .. ' keys(): the dequantized keys in bf16')
      local exact = gp.empty({o.B, o.H, o.D}, CPU)
      gp.k.attn_decode_q(exact, q:float(), cq.k[1], cq.v[1], cq.ks[1], cq.vs[1], cq:lens(1), o.opts.scale or 0,
        o.opts.window or 0, o.opts.n_global or 0, FMT[kvd])
      T.ok(T.relnorm(exact, dq) < 1e-6, name .. ' (f32 query) vs the dequantized cache')
    end
  end
end)

T.test('keys with offsets per channel: the cache\'s center keeps int8 decode attention 3x closer than codes of the ' ..
  'raw keys', function()
  gp.manual_seed(23)
  local o = {B = 1, H = 4, Hkv = 2, S = 200, C = 200, D = 64, device = 'cpu'}
  -- a real model's keys: a large offset on some channels (SmolLM2: a row's max |k| 7-15, 2.5-4 once centered)
  local off = rn({o.B, o.Hkv, o.D}) * 6
  local k, v = (rn {o.B, o.Hkv, o.S, o.D} + off:unsqueeze(3)):bf16(), rn({o.B, o.Hkv, o.S, o.D}):bf16()
  local q = rn({o.B, o.H, o.D}):bf16()
  local c16, cq = caches(o, 'int8', k, v)
  local ref = c16:attend(1, q):float()
  local centered = T.relnorm(cq:attend(1, q):float(), ref)
  -- the same values' codes, keys quantized as they are (center 0)
  local kc, ks = quantize(k, FMT.int8)
  local raw = gp.empty({o.B, o.H, o.D}, CPU)
  gp.k.attn_decode_q(raw, q:float(), kc, cq.v[1], ks, cq.vs[1], cq:lens(1), 0, 0, 0, FMT.int8)
  local plain = T.relnorm(raw, ref)
  T.ok(centered < plain / 3, string.format('%.3g centered against %.3g', centered, plain))
  T.ok(T.relnorm(cq:keys(1):float(), k:float()) < 1e-2, 'keys() adds the center back')
end)

T.test('compressed KVCache: append, append_at, keys/values, reset, memory, errors', function()
  gp.manual_seed(9)
  local B, H, C, D = 2, 2, 10, 64
  local cache = gp.KVCache {batch = B, heads = H, capacity = C, head_dim = D, layers = 2, device = 'cpu', kv_dtype = 'int8'}
  T.eq(cache.k[1].dtype, 'u8')
  T.ok(tostring(cache):find('stored int8', 1, true), tostring(cache))
  local k, v = rn {B, H, 4, D}, rn {B, H, 4, D}
  cache:append(2, k:narrow(3, 1, 3), v:narrow(3, 1, 3))
  cache:append_at(2, k:narrow(3, 4, 1), v:narrow(3, 4, 1), gp.tensor({3}, {dtype = 'i64', device = 'cpu'}))
  cache:set_len(4)
  T.same(cache:keys(2).shape, {B, H, 4, D})
  T.eq(cache:keys(2).dtype, 'f32')
  T.ok(T.relnorm(cache:keys(2), k) < 1e-2 and T.relnorm(cache:values(2), v) < 1e-2, 'dequantized keys and values')
  -- attend_at (device lengths) equals attend
  local q = rn {B, 4, D}
  T.ok(T.relnorm(cache:attend(2, q), cache:attend_at(2, q, gp.full({B}, 4, {dtype = 'i64', device = 'cpu'}))) == 0)
  -- memory: codes of D bytes and an f32 scale per position, head, key or value, layer; the keys' center per head
  T.eq(cache:nbytes(), 2 * (2 * B * H * C * (D + 4) + 4 * B + 4 * B * H * D))
  local plain = gp.KVCache {batch = B, heads = H, capacity = C, head_dim = D, layers = 2, dtype = 'bf16', device = 'cpu'}
  T.eq(plain:nbytes(), 2 * (2 * B * H * C * D * 2 + 4 * B))
  T.eq(gp.KVCache {batch = 1, heads = 1, capacity = 2, head_dim = 64, kv_dtype = 'f32', device = 'cpu'}.kv_dtype, nil,
    'kv_dtype = dtype is the plain cache')
  T.ok(cache.kc[2]:abs():max():item() > 0 and cache.kc[1]:abs():max():item() == 0, 'the first append sets the center')
  cache:reset()
  T.eq(cache:len(2), 0)
  T.eq(cache.kc[2]:abs():max():item(), 0, 'reset: center 0')
  cache:append(2, k:narrow(3, 1, 1), v:narrow(3, 1, 1))
  T.eq(cache.kc[2]:abs():max():item(), 0, 'one token: center 0')
  local raw = gp.KVCache {batch = B, heads = H, capacity = C, head_dim = D, device = 'cpu', kv_dtype = 'int8',
                          center = false}
  raw:append(1, k, v)
  T.eq(raw.kc[1]:abs():max():item(), 0, 'center = false: keys quantized as they are')
  T.raises(function() gp.KVCache {batch = 1, heads = 1, capacity = 2, head_dim = 64, kv_dtype = 'int8', center = 1} end,
    'KVCache: center must be true or false, got 1')
  T.raises(function() gp.KVCache {batch = 1, heads = 1, capacity = 2, head_dim = 64, kv_dtype = 'int4'} end, 'KVCache',
    'kv_dtype', "'int8' or 'fp8'", "'int4'")
  T.raises(function() cache:append(1, rn {B, H + 1, 1, D}, rn {B, H + 1, 1, D}) end, 'KVCache:append', '(2, 2, Tnew, 64)')
  T.raises(function() cache:append(1, rn {B, H, C + 1, D}, rn {B, H, C + 1, D}) end, 'capacity')
  T.raises(function() gp.generate(gp.models.load(root .. '/llama3_rope', {dtype = 'f32', device = 'cpu'}), {{1, 2}},
    {max_new = 2, kv_dtype = 'q4'}) end, 'KVCache', 'kv_dtype', "'q4'")
end)

-- greedy tokens of prompt lists with a cache of kv_dtype
local function greedy(m, prompts, kv_dtype)
  local r = gp.generate(m, prompts, {max_new = 8, greedy = true, kv_dtype = kv_dtype})
  local out = {}
  for i, l in ipairs(r.lists) do out[i] = table.concat(l, ',') end
  return out
end

-- (the fixtures' random weights give near-ties between the top logits: a
-- quantized cache's small logit changes (about 1e-2 relative for int8, 3e-2
-- for fp8) flip some of them, and one flip changes the rest of the row; 8
-- new tokens keep most rows equal, 24 keep about half with int8)
T.test('greedy generation with an int8 / fp8 cache equals the f32 cache on most prompts (fixture models)', function()
  local prompts = {}
  for i = 1, 16 do prompts[i] = {(i * 7) % 50 + 3, (i * 13) % 60 + 5, (i * 29) % 70 + 2, i + 10, (i * 3) % 40 + 1} end
  -- llama3_rope: head dim 64, one KV head (decode attention over the codes); llama_gqa: head dim 32, 4:2
  -- (decode through the dequantized cache)
  for _, name in ipairs {'llama3_rope', 'llama_gqa'} do
    local m = gp.models.load(root .. '/' .. name, {dtype = 'f32', device = 'cpu'})
    local base = greedy(m, prompts)
    for _, kvd in ipairs {'int8', 'fp8'} do
      local got = greedy(m, prompts, kvd)
      local same = 0
      for i = 1, #prompts do if got[i] == base[i] then same = same + 1 end end
      -- int8 keeps more bits than e4m3 (here: int8 13 and 16 of 16, fp8 11 and 12)
      T.ok(same >= (kvd == 'int8' and 12 or 10), string.format('%s %s: %d of %d prompts give the same tokens', name, kvd,
        same, #prompts))
    end
  end
end)

-- KVCache:rope_append_at (kernel rope_kv_at): a decode token's fused projection
-- [q | k | v] turned and written in one kernel, against gp.rope + append_at on
-- the CPU in f32 (the same inputs on dev in dt)
local function rope_append_check(dev, dt, tol)
  local B, H, J, D, C = 3, 9, 3, 64, 12
  gp.manual_seed(4)
  local qkv = rn {B, (H + 2 * J) * D}
  local inv = gp.rope_inv_freq(D, CPU)
  local a = gp.KVCache {batch = B, heads = J, capacity = C, head_dim = D, layers = 1, dtype = dt, device = dev}
  local q = a:rope_append_at(1, qkv:to {dtype = dt, device = dev}, gp.full({1}, 5, {dtype = 'i64', device = dev}),
    inv:to(dev), H)
  local b = gp.KVCache {batch = B, heads = J, capacity = C, head_dim = D, layers = 1, device = 'cpu'}
  local x = qkv:view {B, 1, H + 2 * J, D}
  local r = gp.rope(x:narrow(3, 1, H + J), 5, inv)
  b:append_at(1, r:narrow(3, H + 1, J):transpose(2, 3), x:narrow(3, H + J + 1, J):transpose(2, 3),
    gp.full({1}, 5, {dtype = 'i64', device = 'cpu'}))
  T.ok(T.relnorm(q:float():cpu(), r:narrow(3, 1, H):reshape {B, H, D}) <= tol, dev .. ' q')
  T.ok(T.relnorm(a.k[1]:float():cpu(), b.k[1]) <= tol, dev .. ' k')
  T.ok(T.relnorm(a.v[1]:float():cpu(), b.v[1]) <= tol, dev .. ' v')
end

-- the same into a compressed cache (kernel rope_kv_quant_at): the codes and
-- scales gp.rope then append_at (kv_quant_append) write, in the same dtype
-- on the CPU (the same bytes) and on the GPU (f32 sincos: the dequantized
-- rows within rounding); both caches' keys less the same center
local function rope_quant_check(dev, dt, kvd)
  local B, H, J, D, C, pos = 3, 9, 3, 64, 12, 5
  gp.manual_seed(6)
  local qkv = rn({B, (H + 2 * J) * D}):to(dt)
  local inv = gp.rope_inv_freq(D, CPU)
  local o = {batch = B, heads = J, capacity = C, head_dim = D, layers = 1, dtype = dt, kv_dtype = kvd}
  o.device = dev
  local a = gp.KVCache(o)
  local cen = rn {B, J, D}
  a.kc[1]:copy_(cen:to(dev))
  local q = a:rope_append_at(1, qkv:to(dev), gp.full({1}, pos, {dtype = 'i64', device = dev}), inv:to(dev), H)
  o.device = 'cpu'
  local b = gp.KVCache(o)
  b.kc[1]:copy_(cen)
  local x = qkv:view {B, 1, H + 2 * J, D}
  local r = gp.rope(x:narrow(3, 1, H + J), pos, inv)
  b:append_at(1, r:narrow(3, H + 1, J):transpose(2, 3), x:narrow(3, H + J + 1, J):transpose(2, 3),
    gp.full({1}, pos, {dtype = 'i64', device = 'cpu'}))
  local name = string.format('%s %s %s', dev, dt, kvd)
  T.eq(q.dtype, dt, name .. ': q in qkv\'s dtype')
  local function deq(codes, scales, center)
    local t = gp.empty({B, J, C, D}, CPU)
    gp.k.kv_dequant(t, codes:cpu(), scales:cpu(), center or zc(B, J, D), a.fmt)
    return t
  end
  if dev == 'cpu' then
    T.ok(T.relnorm(q:float(), r:narrow(3, 1, H):reshape {B, H, D}:float()) == 0, name .. ' q')
    for _, f in ipairs {{'k', 'ks'}, {'v', 'vs'}} do
      T.eq((a[f[1]][1]:int() - b[f[1]][1]:int()):abs():max():item(), 0, name .. ': the same ' .. f[1] .. ' codes')
      T.ok(T.relnorm(a[f[2]][1], b[f[2]][1]) == 0, name .. ': the same ' .. f[1] .. ' scales')
    end
  else
    T.ok(T.relnorm(q:float():cpu(), r:narrow(3, 1, H):reshape {B, H, D}:float()) < 1e-2, name .. ' q')
    T.ok(T.relnorm(deq(a.k[1], a.ks[1], cen), deq(b.k[1], b.ks[1], cen)) < 1e-2, name .. ' k')
    T.ok(T.relnorm(deq(a.v[1], a.vs[1]), deq(b.v[1], b.vs[1])) < 1e-6, name .. ' v')
  end
end

T.test('KVCache:rope_append_at: q and k turned, k and v written at the device position, as gp.rope then append_at', function()
  rope_append_check('cpu', 'f32', 1e-6)
  local c = gp.KVCache {batch = 1, heads = 1, capacity = 4, head_dim = 64, layers = 1, device = 'cpu'}
  local bad = gp.full({1}, 4, {dtype = 'i64', device = 'cpu'})
  T.raises(function() c:rope_append_at(1, rn {1, 192}, bad, gp.rope_inv_freq(64, CPU), 1) end, 'rope_kv_at', 'position 4')
  T.raises(function() c:rope_append_at(1, rn {1, 190}, bad, gp.rope_inv_freq(64, CPU), 1) end, 'rope_kv_at', '(1,190)')
  local cq = gp.KVCache {batch = 1, heads = 1, capacity = 4, head_dim = 64, layers = 1, kv_dtype = 'int8', device = 'cpu'}
  T.raises(function() cq:rope_append_at(1, rn {1, 192}, bad, gp.rope_inv_freq(64, CPU), 1) end, 'rope_kv_quant_at',
    'position 4')
  T.raises(function() gp.k.rope_kv_quant_at(rn {1, 1, 64}, cq.k[1], cq.v[1], cq.ks[1], cq.vs[1], cq.kc[1], rn {1, 192},
    gp.zeros({1}, {dtype = 'i64', device = 'cpu'}), gp.rope_inv_freq(64, CPU), 3) end, 'rope_kv_quant_at', 'fmt')
  for _, kvd in ipairs {'int8', 'fp8'} do
    for _, dt in ipairs {'f32', 'bf16'} do rope_quant_check('cpu', dt, kvd) end
  end
  if not gp.cuda_available() then return end
  rope_append_check('cuda', 'f32', 1e-5)
  rope_append_check('cuda', 'bf16', 1e-2)
  for _, kvd in ipairs {'int8', 'fp8'} do
    for _, dt in ipairs {'f32', 'bf16'} do rope_quant_check('cuda', dt, kvd) end
  end
end)

T.test('Llama decode at device positions: q, k, v through one rope_kv_at a layer, the tokens of the host-position loop', function()
  local K = require('gpush.core.tensor').K
  local devs = {'cpu'}
  if gp.cuda_available() then devs[2] = 'cuda' end
  for _, dev in ipairs(devs) do
    for _, name in ipairs {'llama3_rope'} do -- head dim 64 (device positions take the decode kernel's head dims)
      local m = gp.models.load(root .. '/' .. name, {dtype = 'f32', device = dev})
      local prompts = {{3, 5, 7, 9}, {11, 2}}
      local f, calls = K.rope_kv_at, 0
      K.rope_kv_at = function(...) calls = calls + 1; return f(...) end
      local ok, a = pcall(gp.generate, m, prompts, {greedy = true, max_new = 6})
      K.rope_kv_at = f
      assert(ok, a)
      local b = gp.generate(m, prompts, {greedy = true, max_new = 6, device_pos = false})
      T.ok(a.device_positions, name)
      T.ok(calls > 0, name .. ': rope_kv_at ran')
      T.same(a.tokens:totable(), b.tokens:totable())
    end
  end
end)

-- the layout of attn_chunk_q: q, out (B, T, H, D), query t of row b at position lens[b] - T + t
local function chunk_q(q, c, lens, o, fmt, dev)
  local out = gp.empty(q.shape, {dtype = q.dtype, device = dev or 'cpu'})
  local function on(t) return dev and t:to(dev) or t end
  gp.k.attn_chunk_q(out, on(q), on(c[1]), on(c[2]), on(c[3]), on(c[4]), on(lens), o.scale or 0, o.window or 0,
    o.n_global or 0, fmt)
  return out
end

T.test('attn_chunk_q (a prefill chunk over codes): each query as decode at its position, and as flash attention ' ..
  'over the dequantized cache', function()
  gp.manual_seed(41)
  local B, Hkv, C, D, Tq = 2, 2, 40, 64, 6
  for _, G in ipairs {1, 3} do
    local H = Hkv * G
    -- keys with an offset per channel, quantized less a center: the kernel's scores all move by q . center
    local kcen = rn({B, Hkv, D}) * 3
    local k, v = rn {B, Hkv, C, D} + kcen:unsqueeze(3), rn {B, Hkv, C, D}
    local q = rn {B, Tq, H, D}
    local all = codes_of(k, v, kcen)
    for name, fmt in pairs(FMT) do
      local c = all[name]
      local kc, vc, ks, vs = unpack(c)
      for _, o in ipairs {{}, {window = 7, n_global = 2, scale = 0.2}} do
        local tag = string.format('%s G %d window %d', name, G, o.window or 0)
        local lens = gp.tensor({C, 4}, {dtype = 'i64', device = 'cpu'}) -- row 2: queries 0, 1 before position 0
        local got = chunk_q(q, c, lens, o, fmt)
        for t = 1, Tq do
          local n = gp.tensor({C - Tq + t, math.max(0, 4 - Tq + t)}, {dtype = 'i64', device = 'cpu'})
          local want = gp.empty({B, H, D}, CPU)
          gp.k.attn_decode_q(want, q:select(2, t):contiguous(), kc, vc, ks, vs, n, o.scale or 0, o.window or 0,
            o.n_global or 0, fmt)
          T.ok(T.relnorm(got:select(2, t):contiguous(), want) < 1e-6, tag .. ': query ' .. t .. ' as decode')
        end
        T.eq(got:narrow(1, 2, 1):narrow(2, 1, Tq - 4):abs():max():item(), 0, tag .. ': nothing visible gives 0')
        -- row 1 through flash attention's reference over the dequantized cache (queries the last Tq of C keys)
        local function deq(codes, scales, center)
          local t = gp.empty({B, Hkv, C, D}, CPU)
          gp.k.kv_dequant(t, codes, scales, center, fmt)
          return t:narrow(1, 1, 1)
        end
        local ref = gp.attention(q:narrow(1, 1, 1):transpose(2, 3), deq(kc, ks, kcen), deq(vc, vs, zc(B, Hkv, D)),
          {causal = true, scale = o.scale, window = o.window, n_global = o.n_global})
        T.ok(T.relnorm(got:narrow(1, 1, 1), ref:transpose(2, 3)) < 1e-5, tag .. ': as gp.attention, dequantized')
      end
    end
  end
  -- the cache's method: a chunk after its append, as the same kernel on the cache's tensors
  local cache = gp.KVCache {batch = 1, heads = 2, capacity = 16, head_dim = D, device = 'cpu', kv_dtype = 'int8'}
  cache:append(1, rn {1, 2, 9, D}, rn {1, 2, 9, D})
  local q4 = rn {1, 3, 4, D}
  local y = cache:attend_chunk(1, q4)
  T.same(y.shape, {1, 3, 4, D})
  local want = chunk_q(q4, {cache.k[1], cache.v[1], cache.ks[1], cache.vs[1]}, cache:lens(1), {}, FMT.int8)
  T.ok(T.relnorm(y, want) == 0, 'attend_chunk is attn_chunk_q over the layer')
  -- a cache in its own dtype: the same through attention over its keys and values
  local plain = gp.KVCache {batch = 1, heads = 2, capacity = 16, head_dim = D, device = 'cpu'}
  plain:append(1, cache:keys(1), cache:values(1))
  T.ok(T.relnorm(plain:attend_chunk(1, q4), y) < 1e-5, 'a plain cache gives the same')
  T.ok(T.relnorm(plain:attend_chunk(1, q4, {window = 3}), cache:attend_chunk(1, q4, {window = 3})) < 1e-5, 'with a window')
  T.raises(function() cache:attend_chunk(1, rn {1, 3, 3, D}) end, 'KVCache:attend_chunk: q must be (1, T, Hq, 64) ' ..
    'with Hq a multiple of the cache\'s 2 heads, got (1,3,3,64)')
  T.raises(function() cache:attend_chunk(1, rn {1, 10, 2, D}) end, 'q holds 10 queries but layer 1 holds 9 positions')
  T.raises(function() cache:attend_chunk(1, q4, {window = -1}) end, 'window must be an integer >= 0')
  T.raises(function() cache:attend_chunk(1, q4:int()) end, 'q must be a float tensor')
  local odd = gp.KVCache {batch = 1, heads = 1, capacity = 4, head_dim = 48, device = 'cpu'}
  odd:append(1, rn {1, 1, 2, 48}, rn {1, 1, 2, 48})
  T.raises(function() odd:attend_chunk(1, rn {1, 2, 1, 48}) end, 'KVCache:attend_chunk: head dim 48 is not supported')
end)

T.test('Llama prefill in two chunks over a compressed cache: the second chunk reads the codes of the first', function()
  local m = gp.models.load(root .. '/llama3_rope', {dtype = 'f32', device = 'cpu'})
  local ids = gp.tensor({{10, 16, 31, 11, 4, 7, 9, 3}, {5, 6, 7, 8, 9, 10, 11, 12}}, {dtype = 'i64', device = 'cpu'})
  local full = m(ids)
  for _, kvd in ipairs {'int8', 'fp8'} do
    local cache = m:new_cache(2, 12, 'f32', 'cpu', kvd)
    T.eq(cache.kv_dtype, kvd)
    local a = m:forward_cached(ids:narrow(2, 1, 5), cache, 0)
    T.ok(T.relnorm(a, full:narrow(2, 1, 5)) < 1e-5, kvd .. ': the first chunk attends over its own keys and values')
    local snap = {}
    for l = 1, cache.layers do snap[l] = {cache.k[l]:clone(), cache.v[l]:clone(), cache.ks[l]:clone(), cache.vs[l]:clone()} end
    local b = m:forward_cached(ids:narrow(2, 6, 3), cache, 5)
    local rel = T.relnorm(b, full:narrow(2, 6, 3))
    -- (logits through 2 layers: int8 about 1e-2 here, fp8 about 5e-2)
    T.ok(rel > 0 and rel < (kvd == 'int8' and 2e-2 or 8e-2), kvd .. ': the second chunk ' .. rel)
    T.eq(cache:len(1), 8)
    -- the same chunk through a dequantized copy of the first (the path of head dims decode does not take)
    for l = 1, cache.layers do
      for i, t in ipairs {cache.k[l], cache.v[l], cache.ks[l], cache.vs[l]} do t:copy_(snap[l][i]) end
    end
    cache:set_len(5)
    cache.attend_chunk = false
    local b2 = m:forward_cached(ids:narrow(2, 6, 3), cache, 5)
    T.ok(T.relnorm(b, b2) < 1e-5, kvd .. ': codes read directly as the dequantized copy: ' .. T.relnorm(b, b2))
  end
end)

T.test('nn.GPT generates through a compressed cache: device positions and host positions give the same tokens', function()
  gp.manual_seed(17)
  -- head dim 64 (decode attention over the codes), 2 heads
  local m = gp.nn.GPT {vocab_size = 40, block_size = 32, n_embd = 128, n_layer = 2, n_head = 2, device = 'cpu'}
  local prompts = {{1, 2, 3}, {7, 8}, {4, 5, 6, 7, 9}, {11}}
  local base = gp.generate(m, prompts, {greedy = true, max_new = 8})
  for _, kvd in ipairs {'int8', 'fp8'} do
    local a = gp.generate(m, prompts, {greedy = true, max_new = 8, kv_dtype = kvd})
    local b = gp.generate(m, prompts, {greedy = true, max_new = 8, kv_dtype = kvd, device_pos = false})
    local same = 0
    for i = 1, #prompts do
      T.eq(table.concat(a.lists[i], ','), table.concat(b.lists[i], ','), kvd .. ' row ' .. i .. ': device vs host positions')
      if table.concat(a.lists[i], ',') == table.concat(base.lists[i], ',') then same = same + 1 end
    end
    T.ok(same >= 3, string.format('%s: %d of %d rows equal the f32 cache\'s', kvd, same, #prompts))
  end
end)

T.test('nn.GPT prefill in two chunks over a compressed cache: the second chunk reads the codes (attend_chunk)', function()
  gp.manual_seed(19)
  local m = gp.nn.GPT {vocab_size = 40, block_size = 32, n_embd = 128, n_layer = 2, n_head = 2, device = 'cpu'}
  m:eval()
  local ids = gp.tensor({{1, 5, 9, 3, 7, 2, 8, 4, 6}, {11, 12, 13, 14, 15, 16, 17, 18, 19}}, {dtype = 'i64', device = 'cpu'})
  local full = m(ids)
  for _, kvd in ipairs {'int8', 'fp8'} do
    local cache = gp.KVCache {batch = 2, heads = 2, capacity = 16, head_dim = 64, layers = 2, device = 'cpu', kv_dtype = kvd}
    m:forward_cached(ids:narrow(2, 1, 4), cache, 0)
    local calls = 0
    local orig = cache.attend_chunk
    cache.attend_chunk = function(...) calls = calls + 1; return orig(...) end
    local b = m:forward_cached(ids:narrow(2, 5, 5), cache, 4)
    T.eq(calls, 2, kvd .. ': one attend_chunk a layer')
    local rel = T.relnorm(b, full:narrow(2, 5, 5))
    T.ok(rel > 0 and rel < (kvd == 'int8' and 2e-2 or 8e-2), kvd .. ': the second chunk ' .. rel)
  end
end)

-- grouped-query heads of bf16/f16 queries take the tensor-core decode kernel
-- (kernels/attention_decode.cu; GP_ATTN_DECODE=cores: the CUDA-core one):
-- every group size up to 8 heads a block (16: two blocks), both head dims,
-- per-row lengths (0 included), windows, a sharper softmax, caches in q's
-- dtype and int8 / fp8 codes, against the CPU on the same values and codes
T.test('grouped-query decode on the GPU: the tensor-core kernel equals the CPU (G 2 to 16, D 64 and 128, codes)', function()
  T.cuda()
  gp.manual_seed(33)
  local B, Hkv, C = 3, 2, 1100
  local lens = gp.tensor({C, 0, 517}, {dtype = 'i32', device = 'cpu'})
  for _, D in ipairs {64, 128} do
    local k, v = rn {B, Hkv, C, D}, rn {B, Hkv, C, D}
    for _, G in ipairs {2, 3, 4, 6, 8, 16} do
      local H = Hkv * G
      for _, dt in ipairs {'bf16', 'f16'} do
        local q, kd, vd = rn({B, H, D}):to(dt), k:to(dt), v:to(dt)
        local codes = codes_of(kd, vd)
        for _, o in ipairs {{}, {window = 200, n_global = 3}, {scale = 0.5}} do
          local name = string.format('%s D %d G %d window %d scale %g', dt, D, G, o.window or 0, o.scale or 0)
          local ref = gp.attention_decode(q:float(), kd:float(), vd:float(), lens, o)
          local got = gp.attention_decode(q:cuda(), kd:cuda(), vd:cuda(), lens:cuda(), o):float():cpu()
          T.ok(T.relnorm(got, ref) < 1e-2, name .. ': ' .. T.relnorm(got, ref))
          T.eq(got:narrow(1, 2, 1):abs():max():item(), 0, name .. ': an empty row is zeros')
          for cname, fmt in pairs(FMT) do
            local c = codes[cname]
            local want = gp.empty({B, H, D}, CPU)
            gp.k.attn_decode_q(want, q:float(), c[1], c[2], c[3], c[4], lens, o.scale or 0, o.window or 0,
              o.n_global or 0, fmt)
            local out = gp.empty({B, H, D}, {dtype = dt, device = 'cuda'})
            gp.k.attn_decode_q(out, q:cuda(), c[1]:cuda(), c[2]:cuda(), c[3]:cuda(), c[4]:cuda(), lens:cuda(),
              o.scale or 0, o.window or 0, o.n_global or 0, fmt)
            local err = T.relnorm(out:float():cpu(), want)
            T.ok(err < 1e-2, string.format('%s %s: %.3g', name, cname, err))
          end
        end
      end
    end
  end
end)

T.test('attn_chunk_q on the GPU equals the CPU (G 1 to 8, D 64 and 128, bf16/f16/f32 queries, int8/fp8, windows)', function()
  T.cuda()
  gp.manual_seed(43)
  local B, C = 2, 700
  local lens = gp.tensor({C, 9}, {dtype = 'i32', device = 'cpu'})
  for _, D in ipairs {64, 128} do
    local codes = codes_of(rn {B, 1, C, D}, rn {B, 1, C, D})
    for _, G in ipairs {1, 3, 8} do
      for _, Tq in ipairs {4, 17} do
        local q = rn {B, Tq, G, D}
        for _, o in ipairs {{}, {window = 200, n_global = 3}} do
          for cname, fmt in pairs(FMT) do
            for _, dt in ipairs {'bf16', 'f16', 'f32'} do
              local qd = q:to(dt)
              local want = chunk_q(qd:float(), codes[cname], lens, o, fmt)
              local got = chunk_q(qd, codes[cname], lens, o, fmt, 'cuda'):float():cpu()
              local err = T.relnorm(got, want)
              T.ok(err < 1e-2, string.format('%s %s D %d G %d T %d window %d: %.3g', cname, dt, D, G, Tq,
                o.window or 0, err))
            end
          end
        end
      end
    end
  end
  -- a chunk whose rows fill the GPU (4 x 8 KV heads x 80 x 4 rows: 160 blocks of 64): the many-row kernel by default
  do
    local kc, ks = quantize(rn {4, 8, 300, 64}, FMT.int8)
    local vc, vs = quantize(rn {4, 8, 300, 64}, FMT.int8)
    local q = rn({4, 80, 32, 64}):bf16()
    local L = gp.tensor({300, 80, 200, 50}, {dtype = 'i64', device = 'cpu'})
    local want = chunk_q(q:float(), {kc, vc, ks, vs}, L, {}, FMT.int8)
    local got = chunk_q(q, {kc, vc, ks, vs}, L, {}, FMT.int8, 'cuda'):float():cpu()
    T.ok(T.relnorm(got, want) < 1e-2, 'B 4 Hkv 8 G 4 T 80: ' .. T.relnorm(got, want))
  end
  -- every case above through the many-row kernel (GP_ATTN_CHUNK=rows: whenever the queries are bf16/f16)
  if not os.getenv('GP_ATTN_CHUNK') then
    local out, rc = T.sh('GP_ATTN_CHUNK=rows ' .. T.exe .. ' ' .. T.root .. '/tests/lua/run.lua "attn_chunk_q on the GPU"')
    T.ok(rc == 0 and out:find('1 passed, 0 failed', 1, true), out)
  end
  -- more rows than one launch's grid (65535 blocks): the last queries equal the same queries as a chunk of their own
  local n, D = 70000, 64
  local kc, ks = quantize(rn {1, 1, n, D}, FMT.int8, 'cuda')
  local vc, vs = quantize(rn {1, 1, n, D}, FMT.int8, 'cuda')
  local c, o = {kc, vc, ks, vs}, {window = 16}
  local q = rn({1, n, 1, D}, {device = 'cuda'})
  local L = gp.tensor({n}, {dtype = 'i64', device = 'cuda'})
  local all = chunk_q(q, c, L, o, FMT.int8, 'cuda')
  local tail = chunk_q(q:narrow(2, n - 999, 1000):contiguous(), c, L, o, FMT.int8, 'cuda')
  T.ok(T.relnorm(all:narrow(2, n - 999, 1000):cpu(), tail:cpu()) < 1e-6, 'rows past the first launch')
end)

T.test('compressed caches on the GPU: the kernels write the CPU\'s bytes; decode and generation match the CPU', function()
  T.cuda()
  gp.manual_seed(21)
  for _, D in ipairs {64, 128} do
    for _, dt in ipairs {'bf16', 'f16', 'f32'} do
      local x = rn({2, 3, 17, D}):to(dt)
      for name, fmt in pairs(FMT) do
        local c1, s1 = quantize(x, fmt)
        local c2, s2 = quantize(x, fmt, 'cuda')
        T.eq((c1:int() - c2:cpu():int()):abs():max():item(), 0, string.format('%s %s D %d: the same codes', name, dt, D))
        T.ok(T.relnorm(s2:cpu(), s1) == 0, name .. ' the same scales')
      end
    end
    local o = {B = 2, H = 8, Hkv = 2, S = 1500, C = 2000, D = D, opts = {window = 700, n_global = 3}}
    local k, v, q = rn {o.B, o.Hkv, o.S, D}, rn {o.B, o.Hkv, o.S, D}, rn {o.B, o.H, D}
    for _, kvd in ipairs {'int8', 'fp8'} do
      o.device = 'cpu'
      local _, ccpu = caches(o, kvd, k:bf16(), v:bf16())
      o.device = 'cuda'
      local g16, gq = caches(o, kvd, k:bf16():cuda(), v:bf16():cuda())
      local got = gq:attend(1, q:bf16():cuda(), o.opts):float():cpu()
      T.ok(T.relnorm(got, ccpu:attend(1, q:bf16(), o.opts):float()) < 1e-2, kvd .. ' GPU vs CPU decode')
      -- e4m3 keeps 3 mantissa bits: fp8 is within 5e-2 of the bf16 cache (docs/generation.md), int8 within 2e-2
      local bound = kvd == 'fp8' and 5e-2 or 2e-2
      local err = T.relnorm(got, g16:attend(1, q:bf16():cuda(), o.opts):float():cpu())
      T.ok(err < bound, string.format('%s vs the bf16 cache: %.3g (bound %g)', kvd, err, bound))
    end
  end
  local m = gp.models.load(root .. '/llama3_rope', {dtype = 'f32', device = 'cuda'})
  local mc = gp.models.load(root .. '/llama3_rope', {dtype = 'f32', device = 'cpu'})
  local prompts = {{5, 9, 2, 11}, {7, 3, 30, 1}}
  for _, kvd in ipairs {'int8', 'fp8'} do
    local a, b = greedy(m, prompts, kvd), greedy(mc, prompts, kvd)
    T.eq(a[1] .. ';' .. a[2], b[1] .. ';' .. b[2], kvd .. ': GPU greedy tokens (a CUDA graph) equal the CPU\'s')
  end
end)
