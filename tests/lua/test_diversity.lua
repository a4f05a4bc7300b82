-- Set diversity: against a composition of plain ops (normalize, matmul, upper
-- triangle), gradchecks in f64, the autograd rule, distinct-n by hand, bad
-- input, and CPU vs CUDA (forward and backward, f32 and bf16).
local T = require 'lib'
local gp = require 'gpush'
local fd = require 'fd'

local cpu = {device = 'cpu'}

-- the mean of 1 - cos over pairs i < j, from plain ops (Lua loop over sets)
local function reference(x)
  local S, N = x:size(1), x:size(2)
  local r = {}
  for s = 1, S do
    local xs = x:select(1, s):to('f64')
    local nrm = (xs * xs):sum(2, {keepdim = true}):sqrt()
    local u = xs / nrm
    local c = u:matmul(u:t()):totable()
    local acc = 0
    for i = 1, N do for j = i + 1, N do acc = acc + 1 - c[i][j] end end
    r[s] = N > 1 and acc / (N * (N - 1) / 2) or 0
  end
  return r
end

T.test('set_diversity matches the pairwise definition', function()
  for _, sz in ipairs {{1, 1, 3}, {2, 2, 5}, {3, 7, 11}, {2, 16, 40}} do
    local x = gp.randn(sz, cpu)
    T.same(gp.set_diversity(x):totable(), reference(x), 1e-5)
  end
  -- identical vectors: 0; opposite pairs: 2; orthogonal: 1
  local v = gp.randn({1, 1, 6}, cpu)
  T.near(gp.set_diversity(gp.cat({v, v, v}, 2)):item(), 0, 1e-6)
  T.near(gp.set_diversity(gp.cat({v, -v}, 2)):item(), 2, 1e-6)
  T.near(gp.set_diversity(gp.tensor({{1, 0}, {0, 3}}, cpu)):item(), 1, 1e-6) -- (N, D): one set, 0-dim
  -- scale invariance per vector
  local x = gp.randn({2, 5, 7}, cpu)
  T.same(gp.set_diversity(x * gp.rand({2, 5, 1}, cpu) * 10):totable(), gp.set_diversity(x):totable(), 1e-5)
  -- bf16 input: f32 accumulation, rounded once
  T.ok(T.relnorm(gp.set_diversity(x:bf16()):float(), gp.set_diversity(x:bf16():float())) < 1e-2)
end)

T.test('set_diversity backward: finite differences (f64) and autograd', function()
  local x, dout = fd.randn {3, 5, 4}, fd.randn {3}
  local dx = gp.set_diversity_backward(x, dout)
  fd.check('set_diversity dx', dx, fd.grad(function(a) return gp.set_diversity(a) end, {x}, 1, dout), 1e-7)
  -- one set of two, and a set of one (no pairs: zero gradient)
  local y, d2 = fd.randn {1, 2, 3}, fd.randn {1}
  fd.check('set_diversity N=2', gp.set_diversity_backward(y, d2), fd.grad(function(a) return gp.set_diversity(a) end, {y}, 1, d2), 1e-7)
  local z = fd.randn {2, 1, 3}
  T.eq(gp.set_diversity_backward(z, fd.randn {2}):abs():sum():item(), 0)
  -- a clamped (zero) vector still gets a gradient, the linear one
  local w = fd.randn {1, 3, 4}
  w:narrow(2, 2, 1):zero_()
  local d3 = fd.randn {1}
  local eps = 1e-3
  local f = function(a) return gp.set_diversity(a, {eps = eps}) end
  fd.check('set_diversity clamped row', gp.set_diversity_backward(w, d3, {eps = eps}), fd.grad(f, {w}, 1, d3, 1e-7), 1e-5)
  -- gp.gradcheck through the autograd rule, composed with other ops
  T.ok(gp.gradcheck(function(a) return (gp.set_diversity(a:tanh()) * 3):sum() end, {fd.randn {2, 4, 6}}))
  T.ok(gp.gradcheck(function(a) return gp.set_diversity(a) end, {fd.randn {6, 5}}))
end)

T.test('set_diversity: autograd leaves and f32', function()
  local x = gp.randn({2, 4, 8}, cpu):requires_grad()
  local loss = gp.set_diversity(x):sum()
  loss:backward()
  T.ok(x.grad ~= nil)
  local ref = gp.set_diversity_backward(x:detach(), gp.ones({2}, cpu))
  T.ok(T.relnorm(x.grad, ref) < 1e-6)
end)

T.test('distinct_n counts distinct n-grams over a set', function()
  -- set 1: "abab" and "abab" -> 2-grams ab ba ab | ab ba ab: 2 distinct of 6
  -- set 2: lens 3 and 0 of "abcx": ab bc -> 2 of 2
  local t = gp.tensor({{{1, 2, 1, 2}, {1, 2, 1, 2}}, {{1, 2, 3, 9}, {5, 5, 5, 5}}}, {dtype = 'i64', device = 'cpu'})
  local lens = gp.tensor({{4, 4}, {3, 0}}, {dtype = 'i64', device = 'cpu'})
  T.same(gp.distinct_n(t, lens, 2):totable(), {2 / 6, 1}, 1e-7)
  T.same(gp.distinct_n(t, lens, 1):totable(), {2 / 8, 3 / 3}, 1e-7)
  -- n longer than every sequence: no n-grams, 0
  T.same(gp.distinct_n(t, lens, 5):totable(), {0, 0})
  -- default lens (all L), (N, L) input
  T.near(gp.distinct_n(t:select(1, 1)):item(), 2 / 6, 1e-7)
end)

T.test('diversity errors name the op and the shapes', function()
  T.raises(function() gp.set_diversity(gp.randn({4}, cpu)) end, 'set_diversity', '(4)')
  T.raises(function() gp.set_diversity(gp.randn({2, 3, 4}, cpu), {eps = 0}) end, 'set_diversity', 'eps')
  T.raises(function() gp.k.set_diversity(gp.empty({3}, cpu), gp.randn({2, 3, 4}, cpu)) end, 'set_diversity', '(3)')
  T.raises(function() gp.set_diversity_backward(gp.randn({2, 3, 4}, cpu), gp.randn({3}, cpu)) end, 'set_diversity_backward', '(3)')
  local t = gp.zeros({1, 2, 4}, {dtype = 'i64', device = 'cpu'})
  T.raises(function() gp.distinct_n(t, gp.tensor({{5, 1}}, {dtype = 'i64', device = 'cpu'})) end, 'distinct_n', 'lens', '(1,2,4)')
  T.raises(function() gp.distinct_n(t, nil, 0) end, 'distinct_n', 'n = 0')
  T.raises(function() gp.distinct_n(gp.randn({1, 2, 4}, cpu)) end, 'distinct_n', 'tokens')
  T.cuda()
  T.raises(function() gp.set_diversity_backward(gp.randn({2, 3, 4}), gp.randn({2}, cpu)) end, 'set_diversity_backward', 'cpu')
end)

-- forward and backward of x (on the cpu) against xc (its copy on the GPU)
local function cuda_matches(x, xc, tol, name)
  local d = gp.randn({x:size(1)}, cpu):to(x.dtype)
  T.ok(T.relnorm(gp.set_diversity(xc), gp.set_diversity(x)) <= tol, 'forward ' .. name)
  T.ok(T.relnorm(gp.set_diversity_backward(xc, d:cuda()), gp.set_diversity_backward(x, d)) <= tol, 'backward ' .. name)
end

T.test('cuda set_diversity forward and backward match the cpu', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16'} do
    local tol = dt == 'f32' and 1e-4 or 2e-2
    for _, sz in ipairs {{1, 1, 7}, {3, 2, 5}, {5, 7, 33}, {4, 64, 384}, {2, 100, 1000}, {1, 4, 3000}, {2, 70, 1024}} do
      local x = gp.randn(sz, cpu):to(dt)
      cuda_matches(x, x:cuda(), tol, dt .. ' ' .. table.concat(sz, 'x'))
    end
  end
  -- the vectorized kernels (D a multiple of 16 bytes, aligned): a pair, one and
  -- several row batches per warp, 1, 2 and 4 vectors per lane, f16; and from
  -- storage offsets, aligned (vectorized) and not (the scalar kernels)
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    local tol = dt == 'f32' and 1e-4 or 2e-2
    for _, sz in ipairs {{3, 2, 16}, {2, 100, 256}, {3, 9, 512}, {2, 70, 1024}, {1, 64, 384}} do
      local x = gp.randn(sz, cpu):to(dt)
      cuda_matches(x, x:cuda(), tol, dt .. ' ' .. table.concat(sz, 'x'))
    end
    for _, off in ipairs {1, 8} do
      local S, N, D = 2, 5, 64
      local flat = gp.randn({S * N * D + off}, cpu):to(dt)
      cuda_matches(flat:narrow(1, off + 1, S * N * D):view {S, N, D},
        flat:cuda():narrow(1, off + 1, S * N * D):view {S, N, D}, tol, dt .. ' offset ' .. off)
    end
  end
  -- near-identical vectors (diversity near 0) still agree in absolute terms
  local v = gp.randn({1, 1, 64}, cpu)
  local x = gp.cat({v, v, v, v}, 2) + gp.randn({1, 4, 64}, cpu) * 1e-2
  T.near(gp.set_diversity(x:cuda()):item(), gp.set_diversity(x):item(), 1e-5)
  -- a zero vector (clamped norm), in the vectorized kernels (D = 8) and the scalar ones (D = 7)
  for _, D in ipairs {8, 7} do
    local z = gp.randn({1, 3, D}, cpu)
    z:narrow(2, 2, 1):zero_()
    T.ok(T.relnorm(gp.set_diversity(z:cuda()), gp.set_diversity(z)) < 1e-5, 'forward zero row D=' .. D)
    T.ok(T.relnorm(gp.set_diversity_backward(z:cuda(), gp.ones({1})), gp.set_diversity_backward(z, gp.ones({1}, cpu))) < 1e-4,
      'backward zero row D=' .. D)
  end
  -- distinct-n with i32 and clamped lens on the GPU
  local t = gp.randint(0, 3, {4, 5, 9}, {dtype = 'i64', device = 'cpu'})
  local lens = gp.randint(0, 10, {4, 5}, {dtype = 'i64', device = 'cpu'})
  T.same(gp.distinct_n(t:cuda(), lens:cuda(), 2):totable(), gp.distinct_n(t, lens, 2):totable(), 1e-6)
  T.same(gp.distinct_n(t:int():cuda(), lens:int():cuda(), 3):totable(), gp.distinct_n(t, lens, 3):totable(), 1e-6)
end)
