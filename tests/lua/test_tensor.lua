-- The tensor API of the contract, on the CPU and (when present) the GPU.
local T = require 'lib'
local gp = require 'gpush'

local DEVICES = {'cpu', 'cuda'}
local DTYPES = {'f32', 'bf16', 'f16', 'i32', 'i64', 'u8'}

-- run fn(device) on every device; the cuda case is skipped without a GPU
local function each_device(name, fn)
  for _, dev in ipairs(DEVICES) do
    T.test(name .. ' [' .. dev .. ']', function()
      if dev == 'cuda' then T.cuda() end
      fn(dev)
    end)
  end
end

each_device('creation and info', function(dev)
  local o = {device = dev}
  local t = gp.tensor({{1, 2, 3}, {4, 5, 6}}, o)
  T.same(t.shape, {2, 3})
  T.eq(t:size(1), 2); T.eq(t:size(-1), 3); T.eq(t:dim(), 2); T.eq(t:numel(), 6)
  T.eq(t.dtype, 'f32'); T.eq(t.device, dev); T.ok(t:is_contiguous())
  T.same(t:totable(), {{1, 2, 3}, {4, 5, 6}})
  T.same(gp.zeros({2, 3}, o):totable(), {{0, 0, 0}, {0, 0, 0}})
  T.same(gp.ones(2, 2, o):totable(), {{1, 1}, {1, 1}})
  T.same(gp.full({2}, 7, o):totable(), {7, 7})
  T.same(gp.arange(5, o):totable(), {0, 1, 2, 3, 4})
  T.eq(gp.arange(5, o).dtype, 'i64')
  T.same(gp.arange(1, 2, 0.25, o):totable(), {1, 1.25, 1.5, 1.75})
  T.same(gp.arange(5, -1, -2, o):totable(), {5, 3, 1})
  T.same(gp.arange(2 ^ 40, 2 ^ 40 + 3, o):totable(), {2 ^ 40, 2 ^ 40 + 1, 2 ^ 40 + 2}) -- i64 exact past f32's 2^24
  T.same(gp.arange(0, 4, {dtype = 'bf16', device = dev}):totable(), {0, 1, 2, 3})
  T.eq(gp.empty({2, 3}, o):numel(), 6)
  T.eq(gp.tensor(3.5, o):item(), 3.5)
  T.eq(gp.tensor(3.5, o):dim(), 0)
  T.same(gp.zeros({0, 3}, o).shape, {0, 3})
  T.same(gp.zeros_like(t):totable(), {{0, 0, 0}, {0, 0, 0}})
end)

each_device('round trip of every dtype', function(dev)
  local vals = {{0, 1, -2, 3}, {100, -7, 42, 5}}
  for _, dt in ipairs(DTYPES) do
    local v = vals
    if dt == 'u8' then v = {{0, 1, 2, 3}, {100, 7, 42, 5}} end
    local t = gp.tensor(v, {dtype = dt})
    local back = t:to(dev):to('cpu')
    T.eq(back.dtype, dt)
    T.same(back:totable(), v)
    -- a big one: random bits survive host -> device -> host
    local r = gp.randint(0, 100, {1000003}, {dtype = dt, device = 'cpu'})
    T.eq(T.relnorm(r:to(dev):cpu(), r), 0, dt)
  end
end)

each_device('casts between every dtype', function(dev)
  local src = gp.tensor({{1.75, -2.5, 3}, {250, 0, -0.25}}, {device = dev})
  local ref = src:cpu()
  for _, a in ipairs(DTYPES) do
    for _, b in ipairs(DTYPES) do
      local x = ref:to(a)
      local on_dev = x:to(dev):to(b):cpu()
      local on_cpu = x:to(b)
      T.eq(T.relnorm(on_dev, on_cpu), 0, a .. '->' .. b)
    end
  end
  T.same(gp.tensor({1.75, -2.5, 300}, {device = dev}):to('i32'):totable(), {1, -2, 300})
  T.same(gp.tensor({1.75, 2.5, 300}, {device = dev}):to('u8'):totable(), {1, 2, 255})
  T.same(gp.tensor({1, 2, 3}, {device = dev}):bf16():float():totable(), {1, 2, 3})
end)

each_device('views share storage', function(dev)
  local t = gp.arange(12, {dtype = 'f32', device = dev})
  local v = t:view {3, 4}
  T.same(v.shape, {3, 4})
  T.same(v:totable(), {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}})
  T.same(t:view(2, -1).shape, {2, 6})
  local tr = v:transpose(1, 2)
  T.same(tr.shape, {4, 3}); T.ok(not tr:is_contiguous())
  T.same(tr:totable()[1], {0, 4, 8})
  T.same(v:permute {2, 1}:totable(), tr:totable())
  T.same(v:narrow(2, 2, 2):totable(), {{1, 2}, {5, 6}, {9, 10}})
  T.same(v:narrow(1, -1, 1):totable(), {{8, 9, 10, 11}})
  T.same(tr:reshape {12}:totable(), {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11})
  T.same(tr:contiguous():view {12}:totable(), tr:reshape {12}:totable())
  T.same(gp.tensor({1, 2, 3}, {device = dev}):view(3, 1):expand(3, 2):totable(), {{1, 1}, {2, 2}, {3, 3}})
  T.same(v:unsqueeze(1).shape, {1, 3, 4})
  T.same(v:unsqueeze(-1).shape, {3, 4, 1})
  T.same(v:unsqueeze(1):squeeze().shape, {3, 4})
  T.same(v:flatten().shape, {12})
  T.same(v:t():totable(), tr:totable())
  T.same(v:select(1, 2):totable(), {4, 5, 6, 7})
  -- writes through a view reach the base
  v:narrow(1, 2, 1):fill_(-1)
  T.same(t:totable(), {0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, 11})
  tr:narrow(1, 1, 1):add_(100)
  T.same(v:totable()[1], {100, 1, 2, 3})
  -- a clone does not share
  local c = v:clone()
  c:fill_(0)
  T.eq(v:totable()[3][4], 11)
end)

-- the Lua-side oracle for the elementwise semantics of the CPU reference
local ORACLE = {
  add = function(a, b) return a + b end, sub = function(a, b) return a - b end,
  mul = function(a, b) return a * b end, div = function(a, b) return a / b end,
  pow = function(a, b) return a ^ b end, maximum = math.max, minimum = math.min,
}
local UNARY = {
  neg = function(x) return -x end, abs = math.abs, exp = math.exp, log = math.log, sqrt = math.sqrt,
  rsqrt = function(x) return 1 / math.sqrt(x) end, tanh = function(x) return (math.exp(2 * x) - 1) / (math.exp(2 * x) + 1) end,
  sigmoid = function(x) return 1 / (1 + math.exp(-x)) end, relu = function(x) return math.max(x, 0) end,
  silu = function(x) return x / (1 + math.exp(-x)) end, sin = math.sin, cos = math.cos,
  gelu_tanh = function(x) local u = 0.7978845608028654 * (x + 0.044715 * x ^ 3); return 0.5 * x * (1 + (math.exp(2 * u) - 1) / (math.exp(2 * u) + 1)) end,
}

each_device('elementwise values match a Lua oracle', function(dev)
  local av = {{0.5, 1.25, 2}, {3, 0.75, 1.5}}
  local bv = {0.25, 2, 1.5}
  local a = gp.tensor(av, {device = dev})
  local b = gp.tensor(bv, {device = dev})
  for name, f in pairs(ORACLE) do
    local r = a[name](a, b):totable()
    for i = 1, 2 do for j = 1, 3 do T.near(r[i][j], f(av[i][j], bv[j]), 1e-6, name) end end
    local rs = a[name](a, 2):totable()
    for i = 1, 2 do for j = 1, 3 do T.near(rs[i][j], f(av[i][j], 2), 1e-6, name .. ' scalar') end end
  end
  for name, f in pairs(UNARY) do
    local r = a[name](a):totable()
    for i = 1, 2 do for j = 1, 3 do T.near(r[i][j], f(av[i][j]), 2e-6, name) end end
  end
  -- erf GELU at known points: x * Phi(x)
  T.near(gp.tensor({1}, {device = dev}):gelu():item(), 0.8413447460685429, 1e-6)
  T.near(gp.tensor({-1}, {device = dev}):gelu():item(), -0.15865525393145707, 1e-6)
end)

each_device('arithmetic operators, broadcasting and promotion', function(dev)
  local o = {device = dev}
  local a = gp.tensor({{1, 2}, {3, 4}}, o)
  local b = gp.tensor({10, 20}, o)
  T.same((a + b):totable(), {{11, 22}, {13, 24}})
  T.same((b + a):totable(), {{11, 22}, {13, 24}})
  T.same((a - 1):totable(), {{0, 1}, {2, 3}})
  T.same((1 - a):totable(), {{0, -1}, {-2, -3}})
  T.same((2 * a):totable(), {{2, 4}, {6, 8}})
  T.same((a / 2):totable(), {{0.5, 1}, {1.5, 2}})
  T.same((8 / a):totable(), {{8, 4}, {8 / 3, 2}}, 1e-6)
  T.same((a ^ 2):totable(), {{1, 4}, {9, 16}})
  T.same((2 ^ a):totable(), {{2, 4}, {8, 16}})
  T.same((-a):totable(), {{-1, -2}, {-3, -4}})
  T.same((a * b:view(2, 1)):totable(), {{10, 20}, {60, 80}})
  T.same(a:maximum(2.5):totable(), {{2.5, 2.5}, {3, 4}})
  T.same(a:clamp(2, 3):totable(), {{2, 2}, {3, 3}})
  -- integers stay integers, / gives f32
  local i = gp.tensor({7, -7, 2}, {dtype = 'i32', device = dev})
  T.eq((i + 1).dtype, 'i32')
  T.eq((i + 0.5).dtype, 'f32')
  T.eq((i / 2).dtype, 'f32')
  T.same((i / 2):totable(), {3.5, -3.5, 1})
  T.same((i * i):totable(), {49, 49, 4})
  T.eq((i + a:narrow(1, 1, 1):view {2}:narrow(1, 1, 1)).dtype, 'f32')
  T.eq(i:exp().dtype, 'f32')
  -- mixed float dtypes
  T.eq((a:bf16() + a:half()).dtype, 'f32')
  T.eq((a:bf16() + a).dtype, 'f32')
  T.eq((a:bf16() * 2).dtype, 'bf16')
  -- comparisons and where
  T.same(a:gt(2):totable(), {{0, 0}, {1, 1}})
  T.eq(a:gt(2).dtype, 'u8')
  T.same(a:le(b:view(2, 1) / 10):totable(), {{1, 0}, {0, 0}})
  T.same(a:eq(a:t()):totable(), {{1, 0}, {0, 1}})
  T.same(gp.where(a:gt(2), a, -a):totable(), {{-1, -2}, {3, 4}})
  T.same(gp.where(a:gt(2), 1, 0):totable(), {{0, 0}, {1, 1}})
  -- in place
  local c = a:clone()
  c:add_(1):mul_(2)
  T.same(c:totable(), {{4, 6}, {8, 10}})
  c:exp_()
  T.near(c:totable()[1][1], math.exp(4), 1e-6)
end)

each_device('cat, stack and copies', function(dev)
  local o = {device = dev}
  local a = gp.tensor({{1, 2}, {3, 4}}, o)
  T.same(gp.cat({a, a}, 1).shape, {4, 2})
  T.same(gp.cat({a, a * 10}, 2):totable(), {{1, 2, 10, 20}, {3, 4, 30, 40}})
  T.same(gp.stack({a, a}, 1).shape, {2, 2, 2})
  T.same(gp.stack({a, a}, 3):totable()[2][1], {3, 3})
  local z = gp.zeros({2, 2}, o)
  z:copy_(gp.tensor({5, 6}))   -- from the CPU, broadcast
  T.same(z:totable(), {{5, 6}, {5, 6}})
end)

each_device('random numbers: seeds and statistics', function(dev)
  local o = {device = dev}
  gp.manual_seed(42)
  local a = gp.rand({1000}, o):totable()
  gp.manual_seed(42)
  local b = gp.rand({1000}, o):totable()
  T.same(a, b)
  local c = gp.rand({1000}, o):totable()
  T.ok(a[1] ~= c[1] or a[2] ~= c[2], 'the generator moves on')
  local n = 1000003
  local function mv(t)
    local x = t:float():totable()
    local s, ss = 0, 0
    for i = 1, #x do s = s + x[i]; ss = ss + x[i] * x[i] end
    local mean = s / #x
    return mean, ss / #x - mean * mean, x
  end
  local m, v, x = mv(gp.rand({n}, o))
  T.near(m, 0.5, 0.003); T.near(v, 1 / 12, 0.003)
  for i = 1, #x do if x[i] < 0 or x[i] >= 1 then error('uniform out of [0,1): ' .. x[i]) end end
  m, v = mv(gp.randn({n}, o))
  T.near(m, 0, 0.004); T.near(v, 1, 0.005)
  m, v = mv(gp.randn({n}, o) * 2 + 3)
  T.near(m, 3, 0.01); T.near(v, 4, 0.02)
  m, v, x = mv(gp.randint(0, 10, {n}, o))
  T.near(m, 4.5, 0.01); T.near(v, 8.25, 0.03)
  local seen = {}
  for i = 1, #x do seen[x[i]] = true; if x[i] < 0 or x[i] > 9 or x[i] ~= math.floor(x[i]) then error('randint out of range') end end
  for k = 0, 9 do T.ok(seen[k], 'every value drawn') end
  m, v = mv(gp.randn({n}, {device = dev, dtype = 'bf16'}))
  T.near(m, 0, 0.01); T.near(v, 1, 0.02)
end)

T.test('random: the same seed gives the same uniform numbers on cpu and cuda', function()
  T.cuda()
  gp.manual_seed(7)
  local a = gp.rand({1001}, {device = 'cpu'})
  gp.manual_seed(7)
  local b = gp.rand({1001}, {device = 'cuda'})
  T.ok(T.relnorm(b:cpu(), a) < 1e-7)
end)

each_device('printing', function(dev)
  local s = tostring(gp.tensor({{1, 2.5}, {-3, 4}}, {device = dev}))
  T.eq(s, 'tensor([[ 1.0000,  2.5000],\n        [-3.0000,  4.0000]], shape=(2,2), dtype=f32, device=' .. dev .. ')')
  s = tostring(gp.arange(3, {device = dev}))
  T.eq(s, 'tensor([0, 1, 2], shape=(3), dtype=i64, device=' .. dev .. ')')
  s = tostring(gp.zeros({100, 100}, {device = dev}))
  T.ok(s:find('...', 1, true), 'summarized')
  T.ok(#s < 1000, 'summary is short')
  T.ok(tostring(gp.tensor(2, {device = dev})):find('tensor%(2%., shape=%(%)'))
end)

T.test('f64 lives on the CPU', function()
  local x = gp.tensor({1, 2}, {dtype = 'f64', device = 'cpu'})
  T.eq((x / 3).dtype, 'f64')
  T.eq((x + x:float()).dtype, 'f64')
  T.near((x / 3):totable()[1], 1 / 3, 1e-15)
  if gp.cuda_available() then
    T.raises(function() return gp.zeros({2}, {dtype = 'f64', device = 'cuda'}) end, 'f64', 'CPU only')
  end
end)

T.test('gp.device and set_device', function()
  local d = gp.device()
  T.ok(d == 'cpu' or d == 'cuda')
  T.eq(d == 'cuda', gp.cuda_available())
  gp.set_device('cpu')
  T.eq(gp.zeros {2}.device, 'cpu')
  gp.set_device(d)
end)

T.test('kernels are listed and documented', function()
  local ks = gp.kernels()
  T.ok(#ks >= 40)
  T.ok(tostring(ks):find('gp.k.add(out:T, a:T[~], b:T[~])', 1, true))
  local buf = {}
  local p = print
  print = function(s) buf[#buf + 1] = s end -- luacheck: ignore 121 (help prints)
  gp.help(gp.k.add)
  gp.help(gp.zeros)
  print = p -- luacheck: ignore 121
  T.ok(buf[1]:find('out = a + b', 1, true))
  T.ok(buf[2]:find('zeros', 1, true))
end)

T.test('t[i] and t[i] = v: 1-based positions along dim 1, as in Torch7', function()
  local t = gp.arange(6, {device = 'cpu'}):view(2, 3)
  T.same(t[1]:totable(), {0, 1, 2})                  -- a view of the first row
  T.same(t[-1]:totable(), {3, 4, 5})                 -- negative counts from the end
  T.eq(t[2][3], 5)                                   -- a 1-d tensor's element is a number
  T.eq(t[1][-1], 2)
  local row = t[2]
  row[1] = 30                                        -- writes through the view
  T.eq(t[2][1], 30)
  t[1] = 7                                           -- a number fills the slice
  T.same(t:totable(), {{7, 7, 7}, {30, 4, 5}})
  t[-1] = gp.tensor({1, 2, 3}, {dtype = 'i64', device = 'cpu'})  -- a tensor is copied in
  T.same(t:totable(), {{7, 7, 7}, {1, 2, 3}})
  local b = gp.ones({2, 2, 2}, {device = 'cpu'})
  b[2] = gp.zeros({2}, {device = 'cpu'})             -- broadcast into the (2,2) slice
  T.same(b:sum(1):totable(), {{1, 1}, {1, 1}})
  -- never a silent nil: out of range, 0, a fraction, a 0-dim tensor, a bad value
  T.raises(function() return t[3] end, 't[3]', 'out of range', 'dim 1 of size 2', '(2,3)')
  T.raises(function() return t[-3] end, 't[-3]', 'out of range')
  T.raises(function() return t[0] end, 't[0]', '1-based')
  T.raises(function() return t[1.5] end, 'integer')
  T.raises(function() t[5] = 1 end, 't[5]', 'out of range')
  T.raises(function() t[1] = 'x' end, 't[1] = v', 'string')
  T.raises(function() return gp.tensor(3, {device = 'cpu'})[1] end, '0-dim', 'item')
  -- fields and methods are unchanged; unknown names are errors that suggest the real one
  T.same(t.shape, {2, 3}); T.eq(t.dtype, 'i64'); T.eq(t.device, 'cpu'); T.eq(t.ndim, 2)
  T.eq(t.grad, nil)
  T.raises(function() return t:tranpose(1, 2) end, "no method or field 'tranpose'", "did you mean 'transpose'")
  T.raises(function() return t.shap end, "'shap'", "'shape'")
  T.raises(function() return t.zzzzzz end, "no method or field 'zzzzzz'")
  T.raises(function() t.shape = {6} end, 'shape', 'cannot be assigned')
  t.note = 'a user field'                            -- other fields may be set
  T.eq(t.note, 'a user field')
end)

T.test('t[i] is differentiable (a select) and in-place writes are guarded', function()
  local x = gp.randn({3, 2}, {device = 'cpu'}):requires_grad()
  local y = (x[2] * 3):sum()
  y:backward()
  T.same(x.grad:totable(), {{0, 0}, {3, 3}, {0, 0}})
  T.raises(function() x[1] = 0 end, 'in-place', 'requires grad')
end)

T.test('did you mean: gp fields and kernels', function()
  T.raises(function() return gp.zeross {2} end, "gp: no field 'zeross'", "did you mean 'gp.zeros'")
  T.raises(function() return gp.k.rms_nrom end, "gp.k: no field 'rms_nrom'", 'gp.k.rms_norm')
  T.eq(gp.debug, nil) -- optional: reads as nil until set
  local s = require 'gpush.core.suggest'
  T.eq(s.distance('tranpose', 'transpose'), 1)
  T.eq(s.distance('trasnpose', 'transpose'), 1) -- a swap of neighbours
  T.eq(s.distance('abc', 'xyz'), 3)
  T.same(#s.closest('qqqqqq', {'zeros', 'ones'}), 0)
end)

T.test('device strings: cuda:N names the GPU in use', function()
  local t = gp.ones({2}, {device = 'cpu'})
  T.raises(function() return t:to('tpu') end, 'to', "unknown dtype 'tpu'")
  T.raises(function() return t:to('cuda:x') end, 'to', "unknown device 'cuda:x'", 'cuda:N')
  T.raises(function() return gp.zeros({2}, {device = 'cuda:y'}) end, 'zeros', "unknown device 'cuda:y'")
  T.eq(t:to('cpu').device, 'cpu')
  if gp.cuda_available() then
    local n = gp.C.gp_cuda_current_device()
    T.eq(t:to('cuda:' .. n).device, 'cuda')
    T.eq(gp.zeros({2}, {device = 'cuda:' .. n}).device, 'cuda')
    T.eq(t:to {device = 'cuda:' .. n, dtype = 'bf16'}.device, 'cuda')
    T.raises(function() return t:to('cuda:' .. (n + 1)) end, 'cuda:' .. (n + 1), 'this process uses cuda:' .. n,
      'GPUSH_CUDA_DEVICE')
  else
    T.raises(function() return t:to('cuda:0') end, 'to', 'cuda')
    T.raises(function() gp.set_device('cuda:0') end, 'set_device', 'cuda')
  end
end)

T.test('printing shows requires_grad, and the op of a result', function()
  local x = gp.ones({2}, {device = 'cpu'}):requires_grad()
  T.ok(tostring(x):find('requires_grad=true)', 1, true), tostring(x))
  T.ok(tostring(x * 2):find('grad_fn=mul)', 1, true), tostring(x * 2))
  T.ok(not tostring(gp.ones {2}):find('grad', 1, true))
end)

-- copies between packed rows and rows padded apart (gp.linear's padded products): the GPU's row kernel
-- (16-byte vectors on the packed side) equals the CPU's copy, both ways, for widths that are not a multiple of
-- the vector, and a copy that does not fit it (both sides padded) still runs the generic kernel
T.test('copy (cuda): packed rows to padded rows and back equal the CPU', function()
  T.cuda()
  local function same(a, b, what)
    local fa, fb = T.flat(a:cpu():to('f64')), T.flat(b:to('f64'))
    T.eq(#fa, #fb, what)
    for k = 1, #fa do if fa[k] ~= fb[k] then T.eq(fa[k], fb[k], what .. ' at ' .. k) end end
  end
  for _, dt in ipairs {'bf16', 'f16', 'f32', 'u8', 'i64'} do
    for _, s in ipairs {{7, 13, 3}, {33, 1001, 7}, {3, 4099, 5}, {2, 1, 1}} do
      local rows, n, pad = s[1], s[2], s[3]
      local c = (gp.randn({rows, n + pad}, {device = 'cpu'}) * 50):to(dt)
      local g = c:cuda()
      local what = string.format('%s %dx%d (+%d)', dt, rows, n, pad)
      local packed = g:narrow(2, 1, n):contiguous() -- padded -> packed
      same(packed, c:narrow(2, 1, n):contiguous(), what .. ' to packed')
      local dst = gp.zeros({rows, n + pad}, {dtype = dt, device = 'cuda'})
      dst:narrow(2, 1, n):copy_(packed) -- packed -> padded
      local want = gp.zeros({rows, n + pad}, {dtype = dt, device = 'cpu'})
      want:narrow(2, 1, n):copy_(c:narrow(2, 1, n))
      same(dst, want, what .. ' to padded (the pads untouched)')
      local both = gp.zeros({rows, n + pad + 1}, {dtype = dt, device = 'cuda'})
      both:narrow(2, 1, n):copy_(g:narrow(2, 1, n)) -- padded -> padded
      same(both:narrow(2, 1, n), c:narrow(2, 1, n), what .. ' padded to padded')
    end
  end
end)

-- where over dense operands of one shape (a or b may be one broadcast value) moves 16 bytes a thread when all
-- are aligned for it; unaligned views and the tail go one element at a time: every way equals the CPU
T.test('where (cuda): dense vectors, broadcast values, tails and unaligned views equal the CPU', function()
  T.cuda()
  for _, dt in ipairs(DTYPES) do
    for _, n in ipairs {1, 5, 16, 37, 4099} do
      for _, off in ipairs {0, 1} do
        local function view(t) return t:narrow(1, off + 1, n) end
        local M = gp.rand({n + off}, {device = 'cpu'}):gt(0.5)
        local A = gp.randn({n + off}, {device = 'cpu'}):mul(50):type(dt)
        local B = gp.randn({n + off}, {device = 'cpu'}):mul(50):type(dt)
        local m, a, b = view(M), view(A), view(B)
        local want = gp.where(m, a, b):float():totable()
        local got = gp.where(view(M:cuda()), view(A:cuda()), view(B:cuda())):float():cpu():totable()
        T.same(got, want, 0, string.format('%s n %d offset %d', dt, n, off))
        local o = view(gp.zeros({n + off}, {dtype = dt, device = 'cuda'}))
        gp.k.where(o, m:cuda(), a:cuda(), b:cuda())
        T.same(o:float():cpu():totable(), want, 0,
          string.format('%s n %d offset %d, an unaligned out', dt, n, off))
        -- a number for a or b (one broadcast value), or both
        for _, ab in ipairs {{a, -7}, {3, b}, {2, -5}} do
          local gw = gp.where(view(M:cuda()), type(ab[1]) == 'number' and ab[1] or view(A:cuda()),
            type(ab[2]) == 'number' and ab[2] or view(B:cuda()))
          T.same(gw:float():cpu():totable(), gp.where(m, ab[1], ab[2]):float():totable(), 0,
            string.format('%s n %d offset %d, a %s, b %s', dt, n, off, type(ab[1]), type(ab[2])))
        end
      end
    end
  end
end)

-- a copy that transposes (out contiguous along the dim src strides, src contiguous along another) moves
-- 32 x 32 tiles through shared memory: transposes, batched ones and casting ones equal the CPU
T.test('contiguous copies of transposed views (cuda): tiles equal the CPU', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'i64', 'u8'} do
    for _, sh in ipairs {{31, 40}, {33, 64}, {100, 70}, {3, 45, 37}} do
      local x = gp.randn(sh, {device = 'cpu'}):mul(20):type(dt)
      local d = #sh
      local want = x:transpose(d - 1, d):contiguous():float():totable()
      local got = x:cuda():transpose(d - 1, d):contiguous():float():cpu():totable()
      T.same(got, want, 0, dt .. ' ' .. table.concat(sh, 'x'))
      local o = gp.zeros(x:transpose(d - 1, d).shape, {dtype = 'f32', device = 'cuda'})
      o:copy_(x:cuda():transpose(d - 1, d))
      T.same(o:cpu():totable(), want, 0, dt .. ' ' .. table.concat(sh, 'x') .. ' into f32')
    end
  end
end)

-- x ^ 2, x ^ 0.5 and x ^ -1 are one correctly rounded operation on the GPU: exactly the CPU's (double pow
-- rounded), NaN, infinities, -0 and random values included
T.test('pow by 2, 0.5 and -1 (cuda): one operation, equal to the CPU', function()
  T.cuda()
  gp.manual_seed(5)
  local v = {0 / 0, 1 / 0, -1 / 0, -0.0, 0.0, 1e-30, -3.5, 1e20, 0.1, 7}
  for _, e in ipairs(gp.randn({990}, {device = 'cpu'}):mul(30):totable()) do v[#v + 1] = e end
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    local x = gp.tensor(v, {device = 'cpu'}):type(dt)
    local function tbl(t)
      local r = t:float():cpu():totable()
      for i, e in ipairs(r) do r[i] = e ~= e and 'nan' or tostring(e) end
      return table.concat(r, ' ')
    end
    for _, p in ipairs {2, 0.5, -1} do
      local name = string.format('%s ^ %g', dt, p)
      T.eq(tbl(x:cuda():pow(p)), tbl(x:pow(p)), name .. ' pow_s')
      T.eq(tbl(x:cuda():pow(gp.full({#v}, p, {dtype = dt, device = 'cuda'}))), tbl(x:pow(p)), name .. ' pow')
    end
  end
end)
