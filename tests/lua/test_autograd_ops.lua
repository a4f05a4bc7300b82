-- Autograd rules of the op families (lua/gpush/grad_rules.lua): every rule
-- against central differences in f64 on the CPU (gp.gradcheck), and the same
-- gradients on the GPU against the CPU when one exists.
local T = require 'lib'
local gp = require 'gpush'

local CPU64 = {dtype = 'f64', device = 'cpu'}
local function rn(shape) return gp.randn(shape, CPU64) end
local function check(fn, inputs, opts) T.ok(gp.gradcheck(fn, inputs, opts)) end

T.test('gradcheck sum and mean: every dim, keepdim, negative dims, whole tensor', function()
  local x = rn {2, 3, 4}
  for _, op in ipairs {'sum', 'mean'} do
    for _, d in ipairs {1, 2, 3, -1} do
      check(function(t) return t[op](t, d):sin() end, {x})
      check(function(t) return t[op](t, d, {keepdim = true}):sin() end, {x})
    end
    check(function(t) return t[op](t):sin() end, {x})
    check(function(t) return t[op](t, {keepdim = true}):sin() end, {x})
  end
end)

T.test('gradcheck max and min: values with a dim (to the arg-extremum) and over everything', function()
  local x = rn {3, 5}
  for _, op in ipairs {'max', 'min'} do
    for _, d in ipairs {1, 2, -1} do
      check(function(t) return (t[op](t, d)) * 2 end, {x})
      check(function(t) return (t[op](t, d, {keepdim = true})) * 2 end, {x})
    end
    check(function(t) return t[op](t) * 3 end, {x})
  end
  -- the gradient lands on the first arg-extremum only
  local y = gp.tensor({{1, 5, 2}, {7, 0, 7}}, {device = 'cpu'}):requires_grad()
  local v = y:max(2)
  v:sum():backward()
  T.same(y.grad:totable(), {{0, 1, 0}, {1, 0, 0}})
end)

T.test('gradcheck var and std (corrections, dims, whole tensor)', function()
  local x = rn {3, 4}
  for _, op in ipairs {'var', 'std'} do
    check(function(t) return t[op](t, 2) end, {x})
    check(function(t) return t[op](t, 1, {correction = 0, keepdim = true}) end, {x})
    check(function(t) return t[op](t) end, {x})
  end
end)

T.test('gradcheck norm: p = 2, 1, 3, inf, dims', function()
  local x = rn {3, 4}
  check(function(t) return t:norm() end, {x})
  check(function(t) return t:norm(2, 2) end, {x})
  check(function(t) return t:norm(1, 1, {keepdim = true}) end, {x})
  check(function(t) return t:norm(3, -1) end, {x})
  check(function(t) return t:norm(math.huge, 2) end, {x})
  check(function(t) return t:norm(0, 2) end, {x}) -- a count: zero gradient
end)

T.test('gradcheck cumsum along each dim and flattened', function()
  local x = rn {3, 4}
  check(function(t) return t:cumsum(1):sin() end, {x})
  check(function(t) return t:cumsum(2):sin() end, {x})
  check(function(t) return t:cumsum(-1):sin() end, {x})
  check(function(t) return t:cumsum():sin() end, {x})
end)

T.test('gradcheck softmax and log_softmax on the last and other dims', function()
  local x = rn {3, 4, 5}
  for _, op in ipairs {'softmax', 'log_softmax'} do
    check(function(t) return t[op](t) end, {x})
    check(function(t) return t[op](t, 2) end, {x})
    check(function(t) return t[op](t, 1) end, {x})
    check(function(t) return gp[op](t, -1) end, {x})
  end
end)

T.test('gradcheck layer_norm and rms_norm (with and without w, b); stats come back detached', function()
  local x, w, b = rn {2, 3, 6}, rn {6}, rn {6}
  check(function(t, ww, bb) return (gp.layer_norm(t, ww, bb)) end, {x, w, b})
  check(function(t) return (gp.layer_norm(t)) end, {x})
  check(function(t, ww) return (gp.layer_norm(t, ww, nil, 1e-3)) end, {x, w})
  check(function(t, ww) return (gp.rms_norm(t, ww)) end, {x, w})
  check(function(t) return (gp.rms_norm(t, nil, 1e-2)) end, {x})
  local xr = rn({4, 6}):requires_grad()
  local out, mean, rstd = gp.layer_norm(xr)
  T.ok(out:needs_grad() and not mean:needs_grad() and not rstd:needs_grad())
  local o2, r2 = gp.rms_norm(xr)
  T.ok(o2:needs_grad() and not r2:needs_grad())
end)

T.test('gradcheck swiglu, add_rms_norm and add_layer_norm (both outputs), bias_gelu', function()
  local a, b = rn {3, 5}, rn {3, 5}
  check(function(x, y) return gp.swiglu(x, y) end, {a, b})
  local w = rn {5}
  check(function(x, r, ww) return (gp.add_rms_norm(x, r, ww)) end, {a, b, w})
  check(function(x, r, ww)
    local out, res = gp.add_rms_norm(x, r, ww)
    return out * 2 + res:sin()
  end, {a, b, w})
  check(function(x, r) local _, res = gp.add_rms_norm(x, r); return res * 3 end, {a, b})
  local lb = rn {5}
  check(function(x, r, ww, b2) return (gp.add_layer_norm(x, r, ww, b2)) end, {a, b, w, lb})
  check(function(x, r, ww, b2)
    local out, res = gp.add_layer_norm(x, r, ww, b2)
    return out * 2 + res:sin()
  end, {a, b, w, lb})
  check(function(x, r) local _, res = gp.add_layer_norm(x, r); return res * 3 end, {a, b})
  check(function(x, bb) return gp.bias_gelu(x, bb) end, {rn {2, 3, 5}, w})
end)

T.test('gradcheck matmul: every shape pair, batch broadcast, transposed views', function()
  local cases = {
    {{4}, {4, 3}}, {{2, 4}, {4}}, {{2, 4}, {4, 3}}, {{2, 3, 4}, {2, 4, 5}}, {{1, 3, 4}, {2, 4, 5}},
    {{2, 3, 4}, {1, 4, 5}}, {{2, 3, 4}, {4, 5}}, {{3, 4}, {2, 4, 5}},
  }
  for _, c in ipairs(cases) do
    check(function(x, y) return x:matmul(y) end, {rn(c[1]), rn(c[2])})
    check(function(x, y) return gp.matmul(x, y) end, {rn(c[1]), rn(c[2])})
  end
  -- a transposed (non-contiguous) operand
  check(function(x, y) return x:t():matmul(y) end, {rn {4, 2}, rn {4, 3}})
  -- one side constant
  local c = rn {4, 3}
  check(function(x) return x:matmul(c) end, {rn {2, 4}})
  check(function(y) return c:t():matmul(y) end, {rn {4, 2}})
end)

T.test('gradcheck gp.matmul options: trans_a, trans_b, alpha, bias, act', function()
  local a, b, bias = rn {4, 3}, rn {5, 4}, rn {5}
  check(function(x, y) return gp.matmul(x, y, {trans_a = true, trans_b = true}) end, {a, b})
  check(function(x, y) return gp.matmul(x, y, {trans_a = true, trans_b = true, alpha = 0.5}) end, {a, b})
  check(function(x, y, bb) return gp.matmul(x, y, {trans_a = true, trans_b = true, bias = bb}) end, {a, b, bias})
  check(function(x, y, bb) return gp.matmul(x, y, {trans_a = true, trans_b = true, bias = bb, act = 'gelu_tanh'}) end,
    {a, b, bias})
  check(function(bb) return gp.matmul(a:t(), b:t(), {bias = bb}) end, {bias})
  check(function(x, y) return gp.matmul(x, y, {trans_b = true}) end, {rn {2, 3, 4}, rn {2, 5, 4}})
  local x = rn({2, 4}):requires_grad()
  T.raises(function() gp.matmul(x, rn {4, 3}, {out = gp.empty({2, 3}, CPU64)}) end, 'matmul', 'not differentiable')
end)

T.test('gradcheck gp.linear: 1-d, 2-d and 3-d x, with and without bias', function()
  local w, b = rn {3, 4}, rn {3}
  check(function(x, ww, bb) return gp.linear(x, ww, bb) end, {rn {2, 5, 4}, w, b})
  check(function(x, ww, bb) return gp.linear(x, ww, bb) end, {rn {5, 4}, w, b})
  check(function(x, ww, bb) return gp.linear(x, ww, bb) end, {rn {4}, w, b})
  check(function(x, ww) return gp.linear(x, ww) end, {rn {2, 4}, w})
  check(function(x, ww) return gp.linear(x:transpose(1, 2), ww) end, {rn {4, 2}, w}) -- x a transposed view
end)

T.test('gradcheck embedding, gather, index_select, scatter_add (repeated indices accumulate)', function()
  local idx = gp.tensor({{0, 2, 2}, {1, 0, 3}}, {dtype = 'i64', device = 'cpu'})
  check(function(w) return gp.embedding(w, idx) end, {rn {4, 3}})
  local x = rn {3, 4}
  local gi = gp.tensor({{0, 0, 3}, {2, 1, 1}, {3, 3, 3}}, {dtype = 'i64', device = 'cpu'})
  check(function(t) return t:gather(2, gi) end, {x})
  local gi1 = gp.tensor({{0, 2, 1, 0}, {2, 2, 0, 1}}, {dtype = 'i32', device = 'cpu'})
  check(function(t) return t:gather(1, gi1) end, {x})
  local si = gp.tensor({2, 0, 2, 1, 2}, {dtype = 'i64', device = 'cpu'})
  check(function(t) return t:index_select(1, si) end, {x})
  check(function(t) return t:index_select(2, gp.tensor({3, 3, 0}, {dtype = 'i64', device = 'cpu'})) end, {x})
  check(function(t, s) return t:scatter_add(2, gi, s) end, {x, rn {3, 3}})
end)

T.test('gradcheck cross_entropy: mean, sum, none, ignore_index; matches log_softmax + gather', function()
  local logits = rn {5, 7}
  local tg = gp.tensor({0, 6, 3, -100, 3}, {dtype = 'i64', device = 'cpu'})
  -- the loss is f32: a larger step keeps the rounding out of the differences
  local o = {eps = 1e-2, atol = 1e-4, rtol = 1e-3}
  check(function(l) return gp.cross_entropy(l, tg) end, {logits}, o)
  check(function(l) return gp.cross_entropy(l, tg, {reduction = 'sum'}) end, {logits}, o)
  check(function(l) return gp.cross_entropy(l, tg, {reduction = 'none'}) end, {logits}, o)
  local tg3 = gp.tensor({0, 6, 3, 1, 3}, {dtype = 'i64', device = 'cpu'})
  check(function(l) return gp.cross_entropy(l:view {1, 5, 7}, tg3:view {1, 5}, {ignore_index = 3}) end, {logits}, o)
  -- exact oracle in f64: mean over the kept rows of -log_softmax at the target
  local keep = gp.tensor({0, 6, 3, 0, 3}, {dtype = 'i64', device = 'cpu'})
  local w = gp.tensor({1, 1, 1, 0, 1}, CPU64)
  local a = logits:detach():clone():requires_grad()
  gp.cross_entropy(a, tg):backward()
  local b = logits:detach():clone():requires_grad()
  local nll = -(b:log_softmax(2):gather(2, keep:view {5, 1}):view {5} * w):sum() / 4
  nll:backward()
  T.ok(T.relnorm(a.grad, b.grad) < 1e-6)
  -- grad=true also returns dlogits, detached
  local c = logits:detach():clone():requires_grad()
  local loss, dl = gp.cross_entropy(c, tg, {grad = true})
  T.ok(loss:needs_grad() and not dl:needs_grad())
end)

T.test('gradcheck dropout with a fixed mask; p = 0 and p = 1', function()
  local x = rn {4, 6}
  for _, p in ipairs {0, 0.3, 1} do
    check(function(t) gp.manual_seed(7); return (gp.dropout(t, p)) end, {x})
  end
  gp.manual_seed(7)
  local xr = x:detach():clone():requires_grad()
  local out, mask = gp.dropout(xr, 0.5)
  out:sum():backward()
  T.same(T.flat(xr.grad), T.flat(mask:to('f64') * 2))
end)

-- GPU vs CPU: the same graph, gradients compared by relative norm
T.test('autograd rules on the GPU match the CPU', function()
  T.cuda()
  local function run(dev)
    gp.manual_seed(3)
    local o = {device = 'cpu'}
    local x = gp.randn({2, 5, 8}, o)
    local w1, b1 = gp.randn({16, 8}, o) * 0.3, gp.randn({16}, o)
    local lw, lb = gp.randn({8}, o), gp.randn({8}, o)
    local emb = gp.randn({11, 8}, o)
    local idx = gp.randint(0, 11, {2, 5}, o)
    local tg = gp.randint(0, 16, {2, 5}, o)
    local ins = {x, w1, b1, lw, lb, emb}
    for i, t in ipairs(ins) do ins[i] = t:to(dev):requires_grad() end
    x, w1, b1, lw, lb, emb = unpack(ins)
    idx, tg = idx:to(dev), tg:to(dev)
    local h = gp.embedding(emb, idx) + x
    h = gp.layer_norm(h, lw, lb)
    local r = gp.rms_norm(h, lw)
    local y = gp.linear(r, w1, b1)
    local s = gp.swiglu(y, y:tanh()) + gp.bias_gelu(y, b1)
    local att = s:matmul(s:transpose(2, 3)):softmax(-1)
    local z = att:matmul(s):log_softmax(2) + s:cumsum(2) * 0.1 + s:max(3):unsqueeze(3) * 0.1
    local loss = gp.cross_entropy(z, tg) + z:var(3):mean() + z:norm() * 0.01
      + z:gather(3, tg:unsqueeze(3)):sum() * 0.01 + z:index_select(2, gp.tensor({1, 1, 4}, {dtype = 'i64', device = dev})):mean()
    loss:backward()
    local grads = {}
    for i, t in ipairs(ins) do grads[i] = t.grad:cpu() end
    return loss:cpu(), grads
  end
  local lc, gc = run('cpu')
  local lg, gg = run('cuda')
  T.ok(T.relnorm(lg, lc) < 1e-4, 'loss')
  for i = 1, #gc do
    local r = T.relnorm(gg[i], gc[i])
    T.ok(r < 1e-3, 'gradient ' .. i .. ': relative norm ' .. r)
  end
end)

T.test('ops that return their argument itself keep the graph (contiguous, to, item)', function()
  local x = gp.randn({3}, CPU64):requires_grad()
  local y = (x * 2):sum()
  T.ok(rawequal(y:contiguous(), y) and rawequal(y:to('f64'), y))
  y:item()
  y:backward()
  T.same(x.grad:totable(), {2, 2, 2})
end)

T.test('a rule defined after loading wraps the function at once (README example)', function()
  local A = require 'gpush.core.autograd'
  local calls = 0
  function gp.twice_test(x) return x * 2 end
  A.def_function('twice_test', function(g) calls = calls + 1; return g[1] * 2 end)
  check(function(x) return gp.twice_test(x) end, {rn {3}})
  T.eq(calls, 1)
  gp.twice_test = nil
end)

T.test('README custom module example runs', function()
  local nn = gp.nn
  local Residual = nn.Module:extend('Residual')
  function Residual:init(d, hidden)
    self.norm = nn.RMSNorm(d)
    self.up = nn.Linear(d, hidden)
    self.down = nn.Linear(hidden, d)
    self.gain = nn.Parameter(gp.ones {1})
  end
  function Residual:forward(x) return x + self.down(self.up(self.norm(x)):relu()) * self.gain end
  local m = Residual(8, 16)
  local y = m(gp.randn {2, 8})
  y:sum():backward()
  T.eq(#m:parameters(), 6)
  for _, p in ipairs(m:parameters()) do T.ok(p.grad ~= nil) end
end)
