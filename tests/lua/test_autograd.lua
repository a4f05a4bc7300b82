-- Autograd: gradients of every differentiable op against central
-- differences in f64 on the CPU, accumulation, no_grad, detach, in-place guard.
local T = require 'lib'
local gp = require 'gpush'

local function r(shape, lo) -- f64 cpu inputs, away from kinks when lo is given
  local x = gp.rand(shape, {dtype = 'f64', device = 'cpu'})
  return lo and (x + lo) or (x * 4 - 2)
end

local UNARY = {'neg', 'exp', 'tanh', 'sigmoid', 'silu', 'gelu', 'gelu_tanh', 'sin', 'cos'}
for _, name in ipairs(UNARY) do
  T.test('gradcheck ' .. name, function()
    T.ok(gp.gradcheck(function(x) return x[name](x) end, {r {3, 4}}))
  end)
end

T.test('gradcheck log, sqrt, rsqrt, abs, relu, clamp (away from kinks)', function()
  for _, name in ipairs {'log', 'sqrt', 'rsqrt'} do
    T.ok(gp.gradcheck(function(x) return x[name](x) end, {r({5}, 0.5)}), name)
  end
  T.ok(gp.gradcheck(function(x) return (x + 0.5):abs() end, {r({6}, 0.2)}))
  T.ok(gp.gradcheck(function(x) return (x - 3):relu() end, {r({6}, 3.2)}))
  T.ok(gp.gradcheck(function(x) return x:clamp(0.3, 0.7) end, {gp.tensor({0.1, 0.4, 0.6, 0.9}, {dtype = 'f64', device = 'cpu'})}))
end)

T.test('gradcheck binary ops, scalars on both sides', function()
  local a, b = r {2, 3}, r({2, 3}, 0.5)
  T.ok(gp.gradcheck(function(x, y) return x + y end, {a, b}))
  T.ok(gp.gradcheck(function(x, y) return x - y end, {a, b}))
  T.ok(gp.gradcheck(function(x, y) return x * y end, {a, b}))
  T.ok(gp.gradcheck(function(x, y) return x / y end, {a, b}))
  T.ok(gp.gradcheck(function(x, y) return y ^ x end, {a, b}))
  T.ok(gp.gradcheck(function(x, y) return x:maximum(y) end, {a, b}))
  T.ok(gp.gradcheck(function(x, y) return x:minimum(y) end, {a, b}))
  T.ok(gp.gradcheck(function(x) return 3 - x * 2 + x / 4 end, {a}))
  T.ok(gp.gradcheck(function(y) return 2 / y + y ^ 3 + 2 ^ y end, {b}))
end)

T.test('gradcheck views, cat, stack, where', function()
  local a = r {2, 3, 4}
  T.ok(gp.gradcheck(function(x) return x:transpose(1, 3):contiguous():view {4, 6} * 2 end, {a}))
  T.ok(gp.gradcheck(function(x) return x:permute {3, 1, 2}:reshape {24}:exp() end, {a}))
  T.ok(gp.gradcheck(function(x) return x:narrow(2, 2, 2):sin() end, {a}))
  T.ok(gp.gradcheck(function(x) return x:select(3, 2):unsqueeze(1):squeeze(1) * 3 end, {a}))
  T.ok(gp.gradcheck(function(x) return x:flatten():tanh() end, {a}))
  local b = r {2, 3, 4}
  T.ok(gp.gradcheck(function(x, y) return gp.cat({x, y * 2}, 2) end, {a, b}))
  T.ok(gp.gradcheck(function(x, y) return gp.stack({x, y}, 4) end, {a, b}))
  local m = gp.rand({2, 3, 4}, {device = 'cpu'}):gt(0.5)
  T.ok(gp.gradcheck(function(x, y) return gp.where(m, x, y * y) end, {a, b}))
end)

T.test('gradients accumulate; no_grad and detach stop them', function()
  local x = gp.tensor({1, 2, 3}, {device = 'cpu'}):requires_grad()
  local y = x * x
  y:backward(gp.ones({3}, {device = 'cpu'}))
  T.same(x.grad:totable(), {2, 4, 6})
  local z = x * 3
  z:backward(gp.ones({3}, {device = 'cpu'}))
  T.same(x.grad:totable(), {5, 7, 9})
  x:zero_grad()
  T.eq(x.grad, nil)
  local w = gp.no_grad(function() return x * 2 end)
  T.ok(not w:needs_grad())
  local d = (x * 2):detach()
  T.ok(not d:needs_grad())
  T.ok((x + 1):needs_grad())
  T.raises(function() x:add_(1) end, 'add_', 'requires grad')
  gp.no_grad(function() x:add_(1) end)
  T.same(x:totable(), {2, 3, 4})
  T.raises(function() (x * 2):backward() end, 'backward', 'non-scalar', '(3)')
  T.raises(function() gp.zeros({2}, {device = 'cpu'}):backward() end, 'backward', 'does not require grad')
  T.raises(function() gp.arange(3, {device = 'cpu'}):requires_grad() end, 'requires_grad', 'i64')
end)

T.test('a shared subexpression gets the sum of its uses', function()
  local x = gp.tensor({0.5, -1}, {dtype = 'f64', device = 'cpu'}):requires_grad()
  local e = x:exp()
  local y = e * e + e
  y:backward(gp.ones({2}, {dtype = 'f64', device = 'cpu'}))
  local g = x.grad:totable()
  T.near(g[1], 2 * math.exp(1) + math.exp(0.5), 1e-12)
  T.near(g[2], 2 * math.exp(-2) + math.exp(-1), 1e-12)
end)

T.test('autograd on the GPU matches the CPU', function()
  T.cuda()
  local xc = gp.randn({4, 5}, {device = 'cpu'})
  local function f(x) return (x:tanh() * x:sigmoid() + x:gelu()) / 2 end
  local a = xc:clone():requires_grad()
  f(a):backward(gp.ones({4, 5}, {device = 'cpu'}))
  local b = xc:cuda():requires_grad()
  f(b):backward(gp.ones({4, 5}, {device = 'cuda'}))
  T.ok(T.relnorm(b.grad:cpu(), a.grad) < 1e-5)
end)

T.test('narrow gradients of one tensor: slices share one buffer, overlaps add, mixed with other uses in any order', function()
  local opts = {dtype = 'f64', device = 'cpu'}
  local x0 = gp.randn({3, 8}, opts)
  local w = gp.randn({3, 8}, opts)
  local function run(order)
    local x = x0:clone():requires_grad()
    local h = x * 1 -- a non-leaf: narrow's gradients meet in the backward's table
    local parts = {
      function() return (h:narrow(2, 1, 4) * w:narrow(2, 1, 4)):sum() end,
      function() return (h:narrow(2, 3, 4) * w:narrow(2, 3, 4) * 2):sum() end, -- overlaps the first
      function() return (h:narrow(2, 7, 2) * 3):sum() end,
      function() return (h * w):sum() end, -- a whole-tensor use
    }
    local loss
    for _, i in ipairs(order) do loss = loss and loss + parts[i]() or parts[i]() end
    loss:backward()
    return x.grad
  end
  -- d/dx: w on cols 1-4, 2w on cols 3-6, 3 on cols 7-8, plus w everywhere
  local want = w:clone()
  want:narrow(2, 1, 4):add_(w:narrow(2, 1, 4))
  want:narrow(2, 3, 4):add_(w:narrow(2, 3, 4) * 2)
  want:narrow(2, 7, 2):add_(gp.full({3, 2}, 3, opts))
  for _, order in ipairs {{1, 2, 3, 4}, {4, 1, 2, 3}, {2, 4, 3, 1}, {3, 1}} do
    local g = run(order)
    local exp = want
    if #order == 2 then
      exp = gp.zeros({3, 8}, opts)
      exp:narrow(2, 1, 4):add_(w:narrow(2, 1, 4))
      exp:narrow(2, 7, 2):add_(gp.full({3, 2}, 3, opts))
    end
    T.ok(T.relnorm(g, exp) < 1e-12, 'order ' .. table.concat(order, ','))
  end
end)
