-- index ops: embedding (+ backward), gather, index_select, scatter_add:
-- known values, Lua oracles, finite-difference gradients in f64, bad input.
local T = require 'lib'
local gp = require 'gpush'

local flat = T.flat
local function dot(a, b)
  local x, y, s = flat(a), flat(b), 0
  for i = 1, #x do s = s + x[i] * y[i] end
  return s
end
local cpu64 = {dtype = 'f64', device = 'cpu'}

-- central differences of f (a number) at every element of x (f64, contiguous)
local fd_grad = require('fd').scalar

T.test('embedding: rows by index, any idx shape, i32 and i64', function()
  local w = gp.tensor({{1, 2}, {3, 4}, {5, 6}}, {device = 'cpu'})
  for _, dt in ipairs {'i32', 'i64'} do
    local e = gp.embedding(w, gp.tensor({{2, 0, 1}, {1, 1, 0}}, {dtype = dt, device = 'cpu'}))
    T.same(e.shape, {2, 3, 2})
    T.same(e:totable(), {{{5, 6}, {1, 2}, {3, 4}}, {{3, 4}, {3, 4}, {1, 2}}})
  end
  T.same(gp.embedding(w:to('bf16'), gp.tensor({1}, {dtype = 'i64', device = 'cpu'})):totable(), {{3, 4}})
end)

T.test('embedding: out-of-range index is an error naming the op, the index and the size', function()
  local w = gp.randn({5, 3}, {device = 'cpu'})
  T.raises(function() gp.embedding(w, gp.tensor({0, 7}, {dtype = 'i64', device = 'cpu'})) end, 'embedding', '7', 'size 5')
  T.raises(function() gp.embedding(w, gp.tensor({-1}, {dtype = 'i32', device = 'cpu'})) end, 'embedding', '-1')
  T.raises(function() gp.embedding(w, gp.tensor({0}, {device = 'cpu'})) end, 'embedding', 'i32 or i64')
  local out = gp.empty({2, 4}, {device = 'cpu'})
  T.raises(function() gp.k.embedding(out, w, gp.tensor({0, 1}, {dtype = 'i64', device = 'cpu'})) end, 'embedding', '(2,4)')
end)

T.test('embedding_backward: finite differences in f64, repeated indices', function()
  local V, D = 4, 3
  local w = gp.randn({V, D}, cpu64)
  local idx = gp.tensor({{0, 2, 2}, {3, 0, 2}}, {dtype = 'i64', device = 'cpu'})
  local g = gp.randn({2, 3, D}, cpu64)
  local dw = gp.embedding_backward(g, idx, V)
  local num = fd_grad(function() return dot(gp.embedding(w, idx), g) end, w)
  T.same(flat(dw), num, 1e-7)
  T.same(flat(dw:narrow(1, 2, 1)), {0, 0, 0}) -- row 1 is never used
end)

-- accumulate = 1 adds into dweight (a kept .grad): the embedding's rule does
-- that when the weight has a .grad, so a tied head's gradient and the
-- embedding's meet without a (V, D) tensor and an add; on the GPU the sums run
-- in f32 over the rows idx names only (a skewed idx: one row named 3000 times)
T.test('embedding_backward accumulate: dweight + the scatter; the rule adds into .grad (cpu; cuda against the cpu)', function()
  local function run(dev, dt, V, D, idx, seed)
    gp.manual_seed(seed)
    local o = {dtype = dt, device = 'cpu'}
    local gs = {unpack(idx.shape)}
    gs[#gs + 1] = D
    local g, d0 = gp.randn(gs, o), gp.randn({V, D}, o)
    local dw = d0:clone():to(dev)
    gp.k.embedding_backward(dw, g:to(dev), idx:to(dev), 1)
    local fresh = gp.full({V, D}, 5, {dtype = dt, device = dev})
    gp.k.embedding_backward(fresh, g:to(dev), idx:to(dev)) -- accumulate 0 overwrites every row
    return dw:cpu():float(), (d0:float() + gp.embedding_backward(g, idx, V):float()), fresh:cpu():float(),
      gp.embedding_backward(g, idx, V):float()
  end
  local small = gp.tensor({0, 2, 2, 3, 0, 2}, {dtype = 'i64', device = 'cpu'})
  local a, want, f, fwant = run('cpu', 'f64', 4, 3, small, 1)
  T.ok(T.relnorm(a, want) < 1e-6 and T.relnorm(f, fwant) < 1e-6) -- (compared as f32)
  T.raises(function() gp.k.embedding_backward(gp.empty({4, 3}, cpu64), gp.randn({6, 3}, cpu64), small, 2) end,
    'embedding_backward', 'accumulate')
  -- the rule: a leaf weight with a .grad gets the gradient added in place, no add kernel
  local w = gp.randn({4, 3}, cpu64):requires_grad()
  local g0 = gp.randn({4, 3}, cpu64)
  w.grad = g0:clone()
  local buf = w.grad
  local gout = gp.randn({6, 3}, cpu64)
  local _, k = T.launches(function() (gp.embedding(w, small) * gout):sum():backward() end)
  T.ok(rawequal(w.grad, buf), 'the same .grad')
  T.ok(T.relnorm(w.grad, g0 + gp.embedding_backward(gout, small, 4)) < 1e-15)
  T.eq(k.add or 0, 0, 'no add kernel')
  T.cuda()
  local skew = gp.randint(0, 50, {4096}, {dtype = 'i32', device = 'cpu'})
  skew:narrow(1, 1, 3000):fill_(7)
  for _, dt in ipairs {'f32', 'bf16'} do
    for _, c in ipairs {{50, 33, gp.randint(0, 50, {7, 9}, {device = 'cpu'})}, {50, 768, skew}, {50257, 64, gp.randint(0, 50257, {2048}, {device = 'cpu'})}} do
      local a1, w1, f1, fw1 = run('cuda', dt, c[1], c[2], c[3], 3)
      local a2, w2 = run('cpu', dt, c[1], c[2], c[3], 3)
      local tol = dt == 'f32' and 1e-5 or 1e-2
      local what = string.format('%s V %d D %d', dt, c[1], c[2])
      T.ok(T.relnorm(a1, a2) < tol, what .. ' accumulate ' .. T.relnorm(a1, a2))
      T.ok(T.relnorm(f1, fw1) < tol, what .. ' overwrite ' .. T.relnorm(f1, fw1))
      T.ok(T.relnorm(w1, w2) < 1e-6)
    end
  end
  -- an f32 dweight whose rows do not start on 16 bytes (a view one element in): scalar atomics
  local V, D, id = 50, 64, gp.randint(0, 50, {300}, {device = 'cpu'})
  local base = gp.randn({V * D + 1}, {device = 'cpu'})
  local g = gp.randn({300, D}, {device = 'cpu'})
  local expect = base:narrow(1, 2, V * D):view {V, D} + gp.embedding_backward(g, id, V)
  local gb = base:cuda()
  local dw = gb:narrow(1, 2, V * D):view {V, D}
  gp.k.embedding_backward(dw, g:cuda(), id:cuda(), 1)
  T.ok(T.relnorm(dw:cpu(), expect) < 1e-5, 'unaligned f32 rows')
  T.eq(gb:narrow(1, 1, 1):item(), base:narrow(1, 1, 1):item(), 'the element before the view untouched')
end)

-- Lua oracle of gather along d (1-based) for 3-d tables
local function gather3(x, d, idx)
  local out = {}
  for i = 1, #idx do
    out[i] = {}
    for j = 1, #idx[i] do
      out[i][j] = {}
      for k = 1, #idx[i][j] do
        local p = {i, j, k}
        p[d] = idx[i][j][k] + 1
        out[i][j][k] = x[p[1]][p[2]][p[3]]
      end
    end
  end
  return out
end

T.test('gather: torch.gather semantics along every dim, strided input', function()
  local x = gp.randn({3, 4, 5}, {device = 'cpu'})
  for d = 1, 3 do
    local s = {3, 4, 5}
    s[d] = 6
    local idx = gp.randint(0, x:size(d), s, {device = 'cpu'})
    T.same(x:gather(d, idx):totable(), gather3(x:totable(), d, idx:totable()))
    T.same(x:gather(d - 4, idx):totable(), gather3(x:totable(), d, idx:totable()))
  end
  local xt = gp.randn({5, 4}, {device = 'cpu'}):t()
  local idx = gp.tensor({{4, 0, 1, 4, 2}, {0, 0, 3, 1, 2}, {1, 1, 1, 1, 1}, {2, 3, 4, 0, 1}}, {dtype = 'i32', device = 'cpu'})
  local want = xt:contiguous():gather(2, idx):totable()
  T.same(xt:gather(2, idx):totable(), want)
end)

T.test('index_select: slices along a dim', function()
  local x = gp.tensor({{1, 2, 3}, {4, 5, 6}}, {device = 'cpu'})
  local i = gp.tensor({2, 0, 2}, {dtype = 'i64', device = 'cpu'})
  T.same(x:index_select(2, i):totable(), {{3, 1, 3}, {6, 4, 6}})
  T.same(x:index_select(1, gp.tensor({1}, {dtype = 'i32', device = 'cpu'})):totable(), {{4, 5, 6}})
  T.raises(function() x:index_select(1, gp.tensor({2}, {dtype = 'i64', device = 'cpu'})) end, 'index_select', '2', 'size 2')
end)

T.test("scatter_add: torch semantics and gather's adjoint by finite differences in f64", function()
  local x = gp.tensor({{1, 1, 1}, {2, 2, 2}}, {device = 'cpu'})
  local idx = gp.tensor({{2, 2}, {1, 0}}, {dtype = 'i64', device = 'cpu'})
  local src = gp.tensor({{1, 2}, {3, 4}}, {device = 'cpu'})
  T.same(x:scatter_add(2, idx, src):totable(), {{1, 1, 4}, {6, 5, 2}})
  local y = x:clone()
  y:scatter_add_(2, idx, src)
  T.same(y:totable(), {{1, 1, 4}, {6, 5, 2}})
  T.same(x:totable(), {{1, 1, 1}, {2, 2, 2}})
  -- d/dx sum(gather(x, idx) * g) = zeros:scatter_add(idx, g)
  for d = 1, 3 do
    local xx = gp.randn({3, 4, 2}, cpu64)
    local s = {3, 4, 2}
    s[d] = 5
    local ix = gp.randint(0, xx:size(d), s, {device = 'cpu'})
    local g = gp.randn(s, cpu64)
    local grad = gp.zeros({3, 4, 2}, cpu64):scatter_add(d, ix, g)
    local num = fd_grad(function() return dot(xx:gather(d, ix), g) end, xx)
    T.same(flat(grad), num, 1e-7)
  end
end)

T.test('index ops: bad shapes, dtypes and ranges', function()
  local x = gp.randn({3, 4}, {device = 'cpu'})
  local i64 = {dtype = 'i64', device = 'cpu'}
  T.raises(function() x:gather(2, gp.tensor({{0}}, i64)) end, 'gather', '(1,1)', '(3,4)')
  T.raises(function() x:gather(2, gp.full({3, 2}, 4, i64)) end, 'gather', 'index 4', 'size 4')
  T.raises(function() x:gather(3, gp.zeros({3, 2}, i64)) end, 'gather', 'dim 3')
  T.raises(function() x:scatter_add(1, gp.full({3, 4}, 3, i64), gp.ones({3, 4}, {device = 'cpu'})) end, 'scatter_add', 'index 3', 'size 3')
  T.raises(function() x:scatter_add(1, gp.zeros({3, 4}, i64), gp.ones({2, 4}, {device = 'cpu'})) end, 'scatter_add', '(2,4)')
  T.raises(function() gp.randint(0, 5, {3, 4}, i64):scatter_add(1, gp.zeros({3, 4}, i64), gp.zeros({3, 4}, i64)) end,
    'scatter_add', 'float')
end)

T.test('index ops (cuda): match the CPU; an out-of-range index is an error and the GPU keeps working', function()
  T.cuda()
  local w = gp.randn({50, 33}, {device = 'cpu'})
  local idx = gp.randint(0, 50, {7, 9}, {device = 'cpu'})
  T.same(gp.embedding(w:cuda(), idx:cuda()):totable(), gp.embedding(w, idx):totable())
  -- the GPU does not wait for the index check: the error comes at the next
  -- synchronization (gp.sync, item, totable, print, ...) and names the op
  local bad = gp.tensor({1, 50, 2}, {dtype = 'i64', device = 'cuda'})
  local later = 'reported at the next synchronization'
  T.raises(function() gp.embedding(w:cuda(), bad); gp.sync() end, 'embedding', '50', 'size 50', later)
  T.raises(function() gp.embedding(w:cuda(), idx) end, 'embedding', 'cpu', 'cuda')
  T.raises(function() gp.embedding_backward(gp.randn({3, 33}, {device = 'cuda'}), bad, 50):totable() end,
    'embedding_backward', '50', later)
  local x = gp.randn({4, 6}, {device = 'cuda'})
  T.raises(function() x:gather(2, gp.full({4, 2}, -3, {dtype = 'i32', device = 'cuda'})); gp.sync() end, 'gather', '-3', 'size 6', later)
  T.raises(function() x:index_select(1, gp.tensor({9}, {dtype = 'i64', device = 'cuda'})); gp.sync() end, 'index_select', '9')
  T.raises(function() print(x:scatter_add(2, gp.full({4, 6}, 6, {dtype = 'i64', device = 'cuda'}), x)) end, 'scatter_add', '6')
  -- the first bad launch is the one reported; the flag is cleared after the report
  T.raises(function()
    gp.embedding(w:cuda(), bad)
    x:index_select(1, gp.tensor({9}, {dtype = 'i64', device = 'cuda'}))
    gp.default_stream():synchronize()
  end, 'embedding', '50')
  gp.sync()
  -- still working
  T.same(gp.embedding(w:cuda(), idx:cuda()):totable(), gp.embedding(w, idx):totable())
  local g = gp.randn({7, 9, 33}, {device = 'cpu'})
  T.ok(T.relnorm(gp.embedding_backward(g:cuda(), idx:cuda(), 50), gp.embedding_backward(g, idx, 50)) < 1e-5)
  local gb = gp.embedding_backward(g:cuda():bf16(), idx:cuda(), 50):float()
  T.ok(T.relnorm(gb, gp.embedding_backward(g:bf16(), idx, 50)) < 1e-2)
end)

-- gather, index_select and scatter_add take a warp a row of 16 or more elements (index_select in 16-, 8- or
-- 4-byte units where x's rows allow), an element a thread below that: each way, contiguous and strided x,
-- equals the CPU; a bad index inside a row is still reported
T.test('gather, index_select, scatter_add (cuda): rows of every length and layout equal the CPU', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'i64'} do
    for _, C in ipairs {1, 5, 16, 33, 64} do
      local x = gp.randn({3, 7, C}, {device = 'cpu'}):mul(10):type(dt)
      local xt = gp.randn({3, C, 7}, {device = 'cpu'}):mul(10):type(dt):transpose(2, 3) -- x's rows strided
      local idx = gp.randint(0, 7, {3, 5, C}, {device = 'cpu'})
      local sel = gp.randint(0, 7, {6}, {device = 'cpu'})
      for _, X in ipairs {x, xt} do
        local what = string.format('%s C %d%s', dt, C, X == xt and ' strided' or '')
        T.same(X:cuda():gather(2, idx:cuda()):float():cpu():totable(), X:gather(2, idx):float():totable(), 0,
          what .. ' gather')
        T.same(X:cuda():index_select(2, sel:cuda()):float():cpu():totable(),
          X:index_select(2, sel):float():totable(), 0, what .. ' index_select')
        -- a narrowed x: rows that start off a 16-byte boundary
        if C > 1 then
          T.same(X:cuda():narrow(3, 2, C - 1):index_select(2, sel:cuda()):float():cpu():totable(),
            X:narrow(3, 2, C - 1):index_select(2, sel):float():totable(), 0, what .. ' index_select of a narrowed x')
        end
        if dt ~= 'i64' then
          local src = gp.randn({3, 5, C}, {device = 'cpu'}):type(dt)
          local want = X:scatter_add(2, idx, src):float()
          local got = X:cuda():scatter_add(2, idx:cuda(), src:cuda()):float():cpu()
          T.ok(T.relnorm(got, want) < (dt == 'bf16' and 1e-2 or 1e-6), what .. ' scatter_add')
        end
      end
    end
  end
  local x = gp.randn({2, 4, 40}, {device = 'cuda'})
  local bad = gp.zeros({2, 3, 40}, {dtype = 'i64', device = 'cuda'})
  bad:narrow(3, 17, 1):fill_(4)
  local later = 'reported at the next synchronization'
  T.raises(function() x:gather(2, bad); gp.sync() end, 'gather', '4', later)
  T.raises(function() x:scatter_add(2, bad, gp.ones({2, 3, 40}, {device = 'cuda'})); gp.sync() end, 'scatter_add',
    '4', later)
  T.raises(function() x:index_select(2, gp.tensor({1, 4}, {dtype = 'i64', device = 'cuda'})); gp.sync() end,
    'index_select', '4', later)
  T.same(x:index_select(2, gp.tensor({1, 3}, {dtype = 'i64', device = 'cuda'})):cpu():totable(),
    x:cpu():index_select(2, gp.tensor({1, 3}, {dtype = 'i64', device = 'cpu'})):totable())
end)
