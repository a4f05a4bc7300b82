-- Matrix products: semantics against a Lua oracle, every shape case of
-- gp.matmul and gp.linear, accumulation, bias and GELU epilogues, transposed
-- and strided views; on a GPU, cuBLAS against the CPU reference on every path
-- (GEMM, gemv, cuBLASLt epilogues, scratch copies, TF32); bad input.
local T = require 'lib'
local gp = require 'gpush'

local function oracle(A, B) -- nested tables, 2-d
  local M, K, N = #A, #B, #B[1]
  local C = {}
  for i = 1, M do
    C[i] = {}
    for j = 1, N do
      local s = 0
      for k = 1, K do s = s + A[i][k] * B[k][j] end
      C[i][j] = s
    end
  end
  return C
end

local function gelu_tanh(x) return 0.5 * x * (1 + math.tanh(0.7978845608028654 * (x + 0.044715 * x ^ 3))) end

local function cpu(shape, dtype) return gp.randn(shape, {dtype = dtype or 'f32', device = 'cpu'}) end

T.test('matmul: known values', function()
  local a = gp.tensor({{1, 2}, {3, 4}}, {device = 'cpu'})
  local b = gp.tensor({{5, 6}, {7, 8}}, {device = 'cpu'})
  T.same(a:matmul(b):totable(), {{19, 22}, {43, 50}})
  T.same(gp.matmul(a, b, {trans_a = true}):totable(), {{26, 30}, {38, 44}})
  T.same(gp.matmul(a, b, {trans_b = true}):totable(), {{17, 23}, {39, 53}})
  T.same(gp.matmul(a:t(), b:t()):totable(), {{23, 31}, {34, 46}})
end)

T.test('matmul: every shape case against a Lua oracle (f32 and f64)', function()
  for _, dt in ipairs {'f32', 'f64'} do
    local tol = dt == 'f64' and 1e-12 or 1e-5
    local a, b = cpu({5, 7}, dt), cpu({7, 3}, dt)
    local want = oracle(a:totable(), b:totable())
    T.same(a:matmul(b):totable(), want, tol)
    -- transposed views, no copies
    T.same(gp.matmul(a:t():contiguous(), b, {trans_a = true}):totable(), want, tol)
    T.same(a:t():contiguous():t():matmul(b:t():contiguous():t()):totable(), want, tol)
    -- rows with a leading dim larger than the row (a narrowed view)
    local wide = cpu({5, 10}, dt)
    local an = wide:narrow(2, 2, 7)
    T.same(an:matmul(b):totable(), oracle(an:totable(), b:totable()), tol)
    -- 1-d x 2-d and 2-d x 1-d
    local v = cpu({7}, dt)
    local vb = oracle({v:totable()}, b:totable())[1]
    T.same(v:matmul(b):totable(), vb, tol)
    T.eq(#v:matmul(b).shape, 1)
    local av = a:matmul(v)
    T.eq(av:dim(), 1)
    local col = {}
    for i = 1, 7 do col[i] = {v:totable()[i]} end
    local ac = oracle(a:totable(), col)
    for i = 1, 5 do T.near(av:totable()[i], ac[i][1], tol) end
    -- batched: 3-d x 3-d, 3-d x 2-d (contiguous and not), 2-d x 3-d, batch 1 broadcast
    local x, y = cpu({4, 5, 7}, dt), cpu({4, 7, 3}, dt)
    local xy = x:matmul(y)
    T.same(xy.shape, {4, 5, 3})
    local x3, y3 = x:totable(), y:totable()
    for bi = 1, 4 do T.same(xy:totable()[bi], oracle(x3[bi], y3[bi]), tol) end
    local xb = x:matmul(b)
    for bi = 1, 4 do T.same(xb:totable()[bi], oracle(x3[bi], b:totable()), tol) end
    local xt = x:transpose(2, 3):contiguous():transpose(2, 3) -- per-batch column-major
    local xtb = xt:matmul(b)
    for bi = 1, 4 do T.same(xtb:totable()[bi], oracle(x3[bi], b:totable()), tol) end
    local ay = gp.matmul(a, y)
    for bi = 1, 4 do T.same(ay:totable()[bi], oracle(a:totable(), y3[bi]), tol) end
    local one = x:narrow(1, 1, 1)
    local oy = one:matmul(y)
    T.same(oy.shape, {4, 5, 3})
    for bi = 1, 4 do T.same(oy:totable()[bi], oracle(x3[1], y3[bi]), tol) end
  end
end)

T.test('matmul: alpha, beta accumulate into out; out may be a view', function()
  local a, b = cpu {6, 4}, cpu {4, 5}
  local ab = oracle(a:totable(), b:totable())
  local out = cpu {6, 5}
  local o0 = out:totable()
  local r = gp.matmul(a, b, {out = out, alpha = 2, beta = 0.5})
  T.ok(r == out, 'returns out')
  local want = {}
  for i = 1, 6 do
    want[i] = {}
    for j = 1, 5 do want[i][j] = 2 * ab[i][j] + 0.5 * o0[i][j] end
  end
  T.same(out:totable(), want, 1e-5)
  -- a transposed out
  local ot = gp.zeros({5, 6}, {device = 'cpu'}):t()
  gp.matmul(a, b, {out = ot})
  T.same(ot:totable(), ab, 1e-5)
  -- beta = 0 never reads out (NaN stays out of the result)
  local nan = gp.full({6, 5}, 0 / 0, {device = 'cpu'})
  gp.matmul(a, b, {out = nan})
  T.same(nan:totable(), ab, 1e-5)
  -- out aliasing an input
  local sq, w = cpu {4, 4}, cpu {4, 4}
  local want2 = oracle(sq:totable(), w:totable())
  gp.k.matmul(sq, sq, w)
  T.same(sq:totable(), want2, 1e-5)
end)

T.test('matmul: bias and gelu_tanh epilogues; gp.linear', function()
  local a, b, bias = cpu {3, 4}, cpu {4, 5}, cpu {5}
  local ab, bv = oracle(a:totable(), b:totable()), bias:totable()
  local want, wantg = {}, {}
  for i = 1, 3 do
    want[i], wantg[i] = {}, {}
    for j = 1, 5 do
      want[i][j] = ab[i][j] + bv[j]
      wantg[i][j] = gelu_tanh(ab[i][j] + bv[j])
    end
  end
  T.same(gp.matmul(a, b, {bias = bias}):totable(), want, 1e-5)
  T.same(gp.matmul(a, b, {bias = bias, act = 'gelu_tanh'}):totable(), wantg, 1e-5)
  -- bias with alpha and beta
  local out = cpu {3, 5}
  local o0 = out:totable()
  gp.matmul(a, b, {bias = bias, out = out, alpha = -1, beta = 2})
  for i = 1, 3 do for j = 1, 5 do T.near(out:totable()[i][j], -ab[i][j] + 2 * o0[i][j] + bv[j], 1e-5) end end
  -- linear: x @ w^T + b, w (out, in)
  local w = cpu {5, 4}
  local wt = w:t():contiguous()
  local xw = oracle(a:totable(), wt:totable())
  local lin = gp.linear(a, w, bias)
  for i = 1, 3 do for j = 1, 5 do T.near(lin:totable()[i][j], xw[i][j] + bv[j], 1e-5) end end
  T.same(gp.linear(a, w):totable(), xw, 1e-5)
  local x1 = a:select(1, 2)
  T.same(gp.linear(x1, w).shape, {5})
  T.same(gp.linear(x1, w):totable(), xw[2], 1e-5)
  local x3 = gp.stack({a, a}, 1)
  local y3 = gp.linear(x3, w, bias)
  T.same(y3.shape, {2, 3, 5})
  T.same(y3:totable()[2], lin:totable(), 1e-6)
end)

T.test('matmul: empty inner dim gives beta * out (+ bias)', function()
  local a, b = gp.empty({2, 0}, {device = 'cpu'}), gp.empty({0, 3}, {device = 'cpu'})
  T.same(a:matmul(b):totable(), {{0, 0, 0}, {0, 0, 0}})
  local out = gp.full({2, 3}, 4, {device = 'cpu'})
  gp.matmul(a, b, {out = out, beta = 0.5, bias = gp.tensor({1, 2, 3}, {device = 'cpu'})})
  T.same(out:totable(), {{3, 4, 5}, {3, 4, 5}})
  T.same(gp.matmul(gp.empty({0, 4}, {device = 'cpu'}), cpu {4, 3}).shape, {0, 3})
end)

T.test('matmul: bf16 and f16 on the CPU round the f32 result', function()
  local a, b = cpu {9, 33}, cpu {33, 11}
  local ref = a:matmul(b)
  for _, dt in ipairs {'bf16', 'f16'} do
    local r = a:to(dt):matmul(b:to(dt))
    T.eq(r.dtype, dt)
    local e = T.relnorm(r, ref:to(dt))
    T.ok(e < (dt == 'bf16' and 1e-2 or 2e-3), dt .. ' relnorm ' .. e)
  end
end)

T.test('matmul: options', function()
  T.eq(gp.tf32(), false)
  gp.set_tf32(true)
  T.eq(gp.tf32(), true)
  gp.set_tf32(false)
  T.eq(gp.matmul_option('gemv', -1), 0)
  T.eq(gp.matmul_option('lt', -1), 1)
  T.raises(function() gp.matmul_option('fast', 1) end, "unknown option 'fast'")
  -- a per-call tf32 option leaves the switch as it was, also after an error
  gp.matmul(cpu {2, 2}, cpu {2, 2}, {tf32 = true})
  T.eq(gp.tf32(), false)
end)

---------------------------------------------------------------------------
-- CUDA against the CPU reference

-- run f(device, inputs moved there) on both devices and compare the results
local function vs_cpu(name, inputs, f, tol)
  local r_cpu = f('cpu', inputs)
  local moved = {}
  for k, v in pairs(inputs) do moved[k] = gp.is_tensor(v) and v:cuda() or v end
  local r_gpu = f('cuda', moved)
  T.eq(r_gpu.device, 'cuda', name)
  local e = T.relnorm(r_gpu:cpu(), r_cpu)
  if not (e <= tol) then error(string.format('%s: cuda vs cpu relative norm %g > %g', name, e, tol), 2) end
end

local TOL = {f32 = 1e-5, bf16 = 1e-2, f16 = 2e-3}

T.test('matmul cuda: every layout and shape case matches the CPU', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    local tol = TOL[dt]
    local I = {a = cpu({33, 65}, dt), b = cpu({65, 17}, dt), x = cpu({3, 33, 65}, dt), y = cpu({3, 65, 17}, dt),
               w = cpu({33, 80}, dt), v = cpu({65}, dt), bias = cpu({17}, dt), out = cpu({33, 17}, dt),
               p = cpu({65, 3, 33}, dt)}
    local cases = {
      plain = function(_, t) return t.a:matmul(t.b) end,
      trans_a = function(_, t) return gp.matmul(t.a:t():contiguous(), t.b, {trans_a = true}) end,
      trans_b = function(_, t) return gp.matmul(t.a, t.b:t():contiguous(), {trans_b = true}) end,
      both_t = function(_, t) return t.a:t():contiguous():t():matmul(t.b:t():contiguous():t()) end,
      ld = function(_, t) return t.w:narrow(2, 3, 65):matmul(t.b) end,
      vec_mat = function(_, t) return t.v:matmul(t.b) end,
      mat_vec = function(_, t) return t.a:matmul(t.v) end,
      batched = function(_, t) return t.x:matmul(t.y) end,
      batched_t = function(_, t) return t.x:transpose(2, 3):contiguous():transpose(2, 3):matmul(t.y) end,
      bcast_b = function(_, t) return t.x:transpose(2, 3):contiguous():transpose(2, 3):matmul(t.b) end,
      bcast_a = function(_, t) return gp.matmul(t.a, t.y) end,
      flat_rows = function(_, t) return t.x:matmul(t.b) end,
      scratch = function(_, t) return t.p:permute(2, 3, 1):matmul(t.y) end, -- batch dims do not collapse
      accum = function(_, t) local o = t.out:clone(); return gp.matmul(t.a, t.b, {out = o, alpha = 1.5, beta = -0.5}) end,
      out_t = function(d, t) local o = gp.zeros({17, 33}, {dtype = dt, device = d}):t(); return gp.matmul(t.a, t.b, {out = o}) end,
      alias = function(_, t) local s = t.a:narrow(2, 1, 17):contiguous(); gp.k.matmul(s, s, t.b:narrow(1, 1, 17):narrow(2, 1, 17)); return s end,
      bias = function(_, t) return gp.matmul(t.a, t.b, {bias = t.bias}) end,
      bias_accum = function(_, t) local o = t.out:clone(); return gp.matmul(t.a, t.b, {bias = t.bias, out = o, alpha = 2, beta = 1}) end,
      bias_batched = function(_, t) return gp.matmul(t.x, t.y, {bias = t.bias}) end,
      bias_bcast = function(_, t) return gp.matmul(t.x:transpose(2, 3):contiguous():transpose(2, 3), t.b, {bias = t.bias}) end,
      gelu = function(_, t) return gp.matmul(t.a, t.b, {bias = t.bias, act = 'gelu_tanh'}) end,
      gelu_batched_t = function(_, t) return gp.matmul(t.x, t.y:transpose(2, 3):contiguous():transpose(2, 3), {bias = t.bias, act = 'gelu_tanh'}) end,
      bias_odd_ptr = function(_, t) return gp.matmul(t.a, t.b, {bias = t.out:select(1, 1):narrow(1, 1, 17)}) end,
      linear = function(_, t) return gp.linear(t.x, t.b:t(), t.bias) end,
    }
    for name, f in pairs(cases) do vs_cpu(dt .. ' ' .. name, I, f, tol) end
  end
end)

T.test('matmul cuda: gemv option, m = 1 and n = 1, batched and strided', function()
  T.cuda()
  local prev = gp.matmul_option('gemv', 1)
  local ok, err = pcall(function()
    for _, dt in ipairs {'f32', 'bf16', 'f16'} do
      local I = {a = cpu({1, 300}, dt), b = cpu({300, 257}, dt), c = cpu({129, 64}, dt), d = cpu({64, 1}, dt),
                 x = cpu({4, 1, 64}, dt), y = cpu({4, 64, 33}, dt), z = cpu({4, 33, 64}, dt), out = cpu({1, 257}, dt)}
      local cases = {
        m1 = function(_, t) return t.a:matmul(t.b) end,
        m1_t = function(_, t) return t.a:matmul(t.b:t():contiguous():t()) end,
        m1_accum = function(_, t) local o = t.out:clone(); return gp.matmul(t.a, t.b, {out = o, alpha = 0.5, beta = 2}) end,
        n1 = function(_, t) return t.c:matmul(t.d) end,
        n1_t = function(_, t) return t.c:t():contiguous():t():matmul(t.d) end,
        vec = function(_, t) return t.c:matmul(t.d:view {64}) end,
        batched_m1 = function(_, t) return t.x:matmul(t.y) end,
        batched_n1 = function(_, t) return t.z:matmul(t.x:transpose(2, 3)) end,
        strided_x = function(_, t) return t.a:t():contiguous():t():narrow(2, 1, 300):matmul(t.b) end,
      }
      for name, f in pairs(cases) do vs_cpu(dt .. ' gemv ' .. name, I, f, TOL[dt]) end
    end
  end)
  gp.matmul_option('gemv', prev)
  if not ok then error(err, 0) end
end)

-- 16-bit outputs of a count that is not a multiple of 8 (GPT-2's 50257): gp.linear computes them as two products
-- into rows padded to a multiple of 8, forward and backward (cuBLAS is slow on the unaligned shape); values and
-- gradients against f32 products, into kept .grad buffers and fresh ones, for a few rows and for many
T.test('linear cuda: 16-bit outputs not a multiple of 8 (padded rows), forward and backward', function()
  T.cuda()
  for _, dt in ipairs {'bf16', 'f16'} do
    local o = {dtype = dt, device = 'cuda'}
    for _, c in ipairs {{33, 96, 4099}, {300, 64, 8197}, {2, 3, 40, 4103}} do
      local lead, K, N = {unpack(c, 1, #c - 2)}, c[#c - 1], c[#c]
      local xs = {unpack(lead)}; xs[#xs + 1] = K
      local rows = 1
      for _, d in ipairs(lead) do rows = rows * d end
      local x = (gp.randn(xs, o) * 0.5):requires_grad_()
      local w = (gp.randn({N, K}, o) * (1 / math.sqrt(K))):requires_grad_()
      local b = gp.randn({N}, o):requires_grad_()
      local ys = {unpack(lead)}; ys[#ys + 1] = N
      local gy = gp.randn(ys, o)
      local what = dt .. ' ' .. table.concat(c, 'x')
      local y, n = T.launches(function() return gp.linear(x, w, b) end)
      T.eq(n.matmul_bias, 2, what .. ': two products')
      T.ok(y:is_contiguous(), what .. ': packed rows')
      local xf, wf, bf, gf = x:detach():to('f32'):reshape {rows, K}, w:detach():to('f32'), b:detach():to('f32'),
        gy:to('f32'):reshape {rows, N}
      T.ok(T.relnorm(y:to('f32'):reshape {rows, N}, xf:matmul(wf:t()) + bf) < 1e-2, what .. ' y')
      T.raises(function() gp.linear(x:detach(), w:detach(), gp.zeros({5}, o)) end, 'linear', 'b must be (' .. N .. ')')
      for round = 1, 2 do -- a fresh .grad, then accumulated into the kept one
        y = gp.linear(x, w, b)
        y:backward(gy)
        T.ok(T.relnorm(x.grad:to('f32'):reshape {rows, K}, gf:matmul(wf) * round) < 2e-2, what .. ' dx ' .. round)
        T.ok(T.relnorm(w.grad:to('f32'), gf:t():matmul(xf) * round) < 2e-2, what .. ' dw ' .. round)
        T.ok(T.relnorm(b.grad:to('f32'), gf:sum(1) * round) < 2e-2, what .. ' db ' .. round)
      end
    end
  end
end)

T.test('matmul cuda: TF32 within 3e-3, exact f32 without', function()
  T.cuda()
  local I = {a = cpu {200, 300}, b = cpu {300, 150}}
  vs_cpu('tf32', I, function(_, t) return gp.matmul(t.a, t.b, {tf32 = true}) end, 3e-3)
  gp.set_tf32(true)
  local ok, err = pcall(vs_cpu, 'tf32 switch', I, function(_, t) return gp.matmul(t.a, t.b, {bias = t.b:select(1, 1)}) end, 3e-3)
  gp.set_tf32(false)
  if not ok then error(err, 0) end
  vs_cpu('f32', I, function(_, t) return t.a:matmul(t.b) end, 1e-5)
end)

T.test('matmul cuda: empty products and the direct cuBLAS benchmark entry', function()
  T.cuda()
  local a, b = gp.empty({2, 0}, {device = 'cuda'}), gp.empty({0, 3}, {device = 'cuda'})
  T.same(a:matmul(b):totable(), {{0, 0, 0}, {0, 0, 0}})
  local out = gp.full({2, 3}, 4, {device = 'cuda'})
  gp.matmul(a, b, {out = out, beta = 0.5, bias = gp.tensor({1, 2, 3}, {device = 'cuda'}), act = nil})
  T.same(out:totable(), {{3, 4, 5}, {3, 4, 5}})
  local ffi = require 'ffi'
  local ms = ffi.new('double[1]')
  local x, y = gp.randn({64, 64}, {device = 'cuda'}), gp.randn({64, 64}, {device = 'cuda'})
  local o = gp.empty({64, 64}, {device = 'cuda'})
  T.eq(gp.C.gp_bench_cublas_gemm(ms, o.c, x.c, y.c, 5), 0)
  T.ok(ms[0] > 0)
  T.ok(T.relnorm(o, x:matmul(y)) < 1e-6)
end)

---------------------------------------------------------------------------
-- bad input

T.test('matmul: bad input names the op and the shapes', function()
  local a, b = cpu {2, 3}, cpu {4, 5}
  T.raises(function() return a:matmul(b) end, "matmul: inner dimensions differ: a is (2,3), b is (4,5); a's last dim must equal b's first")
  T.raises(function() return a:matmul(cpu {2, 3}) end,
    "matmul: inner dimensions differ: a is (2,3), b is (2,3); a's last dim must equal b's first")
  T.raises(function() return gp.matmul(cpu {3, 2, 3}, cpu {3, 4, 5}) end,
    "matmul: inner dimensions differ: a is (3,2,3), b is (3,4,5); a's last dim must equal b's second-to-last")
  T.raises(function() return cpu {2, 3}:matmul(cpu {4}) end, "a is (2,3), b is (4); a's last dim must equal b's only dim")
  T.raises(function() return gp.matmul(cpu {3, 2, 3}, cpu {2, 3, 5}) end, 'batch sizes differ')
  T.raises(function() return a:matmul(cpu({3, 5}, 'bf16')) end, 'matmul: a is f32 but b is bf16')
  T.raises(function() return gp.randint(0, 3, {2, 3}):matmul(gp.randint(0, 3, {3, 2})) end, 'a float dtype')
  T.raises(function() return cpu {3}:matmul(cpu {3}) end, 'matmul: a is (3) and b is (3); supported')
  T.raises(function() return cpu {2, 2, 2, 2}:matmul(cpu {2, 2}) end, 'supported')
  T.raises(function() return gp.matmul(a, cpu {3, 5}, {out = cpu {3, 5}}) end, 'matmul: out is (3,5) but the product is (2,5)')
  T.raises(function() return gp.matmul(a, cpu {3, 5}, {beta = 1}) end, 'beta needs out=')
  T.raises(function() return gp.matmul(a, cpu {3, 5}, {bias = cpu {4}}) end, 'matmul: bias is (4) but the product is (2,5)')
  T.raises(function() return gp.matmul(a, cpu {3, 5}, {act = 'relu'}) end, "act must be 'gelu_tanh'")
  T.raises(function() return gp.matmul(cpu {3}, cpu {3, 5}, {trans_a = true}) end, 'trans_a needs')
  T.raises(function() return gp.matmul(a, 3) end, 'matmul: b must be a tensor')
  T.raises(function() return gp.linear(cpu {4, 3}, cpu {5, 4}) end, 'linear: x is (4,3) but w is (5,4)')
  T.raises(function() return gp.linear(cpu {4, 3}, cpu {3}) end, 'linear: w must be 2-d')
  -- the kernels check their own arguments too
  T.raises(function() gp.k.matmul(cpu {2, 5}, a, b) end, 'matmul:', '(2,3)', '(4,5)')
  T.raises(function() gp.k.matmul(cpu({2, 5}, 'f16'), a, cpu {3, 5}) end, 'matmul:', 'f16', 'f32')
  T.raises(function() gp.k.matmul_bias(cpu {2, 5}, a, cpu {3, 5}, cpu {4}) end, 'matmul_bias:', '(4)')
end)

T.test('matmul: device mismatch is an error, never a copy', function()
  T.cuda()
  local a, b = cpu {2, 3}, gp.randn({3, 4}, {device = 'cuda'})
  T.raises(function() return a:matmul(b) end, 'matmul: a is on cpu but b is on cuda')
  T.raises(function() return gp.matmul(b:t(), b, {bias = cpu {4}}) end, 'matmul: bias is on cpu but a is on cuda')
  T.raises(function() gp.k.matmul(gp.empty({2, 4}, {device = 'cuda'}), a, b) end, 'matmul:', 'cpu', 'cuda')
end)
