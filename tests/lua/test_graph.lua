-- gp.graph: CUDA graph capture and replay (a plain function call on the CPU),
-- the graph-private allocator pool, graph-safe random numbers, deferred
-- index errors from replays, and what is refused during a capture.
local T = require 'lib'
local gp = require 'gpush'
local cpu = {device = 'cpu'}
local cuda = {device = 'cuda'}

T.test('graph (cpu): fn runs at creation and at each replay; outputs are updated in place', function()
  local x = gp.randn({3, 4}, cpu)
  local calls = 0
  local g = gp.graph(function() calls = calls + 1; return x * 2, {x + 1} end, cpu)
  T.eq(calls, 1)
  local y, t = g.outputs[1], g.outputs[2]
  T.same(y:totable(), (x * 2):totable())
  x:fill_(3)
  local y2 = g:replay()
  T.eq(calls, 2)
  T.ok(y2 == y, 'replay returns the same output tensor')
  T.same(y:totable(), gp.full({3, 4}, 6, cpu):totable())
  T.same(t[1]:totable(), gp.full({3, 4}, 4, cpu):totable())
  T.ok(tostring(g):find('Graph%(cpu'), tostring(g))
  g:free()
  T.raises(function() g:replay() end, 'graph:replay', 'freed')
  T.raises(function() gp.graph(42) end, 'graph', 'function')
  T.raises(function() gp.graph(function() end, {device = 'tpu'}) end, 'graph', 'device')
end)

T.test('graph (cpu): random draws advance at every replay', function()
  gp.manual_seed(3)
  local g = gp.graph(function() return gp.rand({8}, cpu) end, cpu)
  local a = g.outputs[1]:totable()
  local b = g:replay():totable()
  T.ok(a[1] ~= b[1], 'fresh numbers')
end)

T.test('graph (cuda): replays equal the eager result; inputs in place; pool addresses stay the same', function()
  T.cuda()
  local x = gp.randn({33, 65}, cuda)
  local w = gp.randn({65, 17}, cuda)
  local function f() return ((x:matmul(w)):relu() * 0.5 + 1):sum(2) end
  local g = gp.graph(f)
  local y = g.outputs[1]
  g:replay()
  T.ok(T.relnorm(y, f()) < 1e-6, 'first replay')
  for _ = 1, 3 do
    x:copy_(gp.randn({33, 65}, cuda))
    local y2 = g:replay()
    T.ok(y2 == y, 'same output tensor')
    T.ok(T.relnorm(y, f()) < 1e-6, 'replay after an input update')
  end
  -- allocations after the capture never reuse the pool: y keeps its value
  local before = y:clone()
  for _ = 1, 10 do local _ = gp.randn({33, 65}, cuda) * 3 end
  T.same(y:totable(), before:totable())
  g:free()
  T.raises(function() g:replay() end, 'graph:replay', 'freed')
end)

T.test('graph (cuda): random kernels draw fresh numbers each replay, as the eager calls would', function()
  T.cuda()
  gp.manual_seed(11)
  local e1 = gp.rand({1003}, cuda):totable()
  local e2 = gp.randn({1003}, cuda):totable()
  local e3 = gp.rand({1003}, cuda):totable()
  local e4 = gp.randn({1003}, cuda):totable()
  gp.manual_seed(11)
  local g = gp.graph(function() return gp.rand({1003}, cuda), gp.randn({1003}, cuda) end)
  local a, b = g:replay()
  T.same(a:totable(), e1)
  T.same(b:totable(), e2)
  g:replay()
  T.same(a:totable(), e3)
  T.same(b:totable(), e4)
  -- eager draws after the replays go on from where the replays left off
  local e5 = gp.rand({5}, cuda):totable()
  gp.manual_seed(11)
  for _ = 1, 4 do gp.rand({1003}, cuda) end
  T.same(gp.rand({5}, cuda):totable(), e5)
  -- sampling inside a graph
  local logits = gp.randn({4, 50}, cuda)
  local out, probs = gp.empty({4}, {dtype = 'i64', device = 'cuda'}), gp.empty({4, 50}, cuda)
  gp.manual_seed(2)
  gp.k.sample(out, probs, logits, 1.0, 0, 1.0, 0)
  local s1 = out:totable()
  gp.k.sample(out, probs, logits, 1.0, 0, 1.0, 0)
  local s2 = out:totable()
  gp.manual_seed(2)
  local gs = gp.graph(function() gp.k.sample(out, probs, logits, 1.0, 0, 1.0, 0) end)
  gs:replay(); T.same(out:totable(), s1)
  gs:replay(); T.same(out:totable(), s2)
end)

T.test('graph (cuda): syncs and host copies inside the capture are clear errors; the GPU keeps working', function()
  T.cuda()
  local x = gp.randn({16}, cuda)
  local function keeps_working()
    local y = (x * 2):sum():item()
    T.near(y, 2 * x:sum():item(), 1e-4)
    gp.sync()
    local m = gp.memory()
    T.ok(m.in_use >= 0)
  end
  T.raises(function() gp.graph(function() return (x * 2):sum():item() end) end, 'graph', 'captured function failed',
    'cannot wait for the GPU')
  keeps_working()
  T.raises(function() gp.graph(function() gp.sync() end) end, 'graph', 'cannot wait')
  keeps_working()
  T.raises(function() gp.graph(function() return gp.tensor({1, 2, 3}, cuda) end) end, 'graph', 'host to device')
  keeps_working()
  T.raises(function() gp.graph(function() return x:cpu() end) end, 'graph')
  keeps_working()
  T.raises(function() gp.graph(function() print(x) end) end, 'graph')
  keeps_working()
  T.raises(function() gp.graph(function() error('boom') end) end, 'graph', 'boom')
  keeps_working()
  T.raises(function() gp.graph(function() gp.graph(function() end) end) end, 'graph', 'nest')
  keeps_working()
  -- a good capture still works after the failed ones
  local g = gp.graph(function() return x + 1 end)
  g:replay()
  T.ok(T.relnorm(g.outputs[1], x + 1) < 1e-7)
end)

T.test('graph (cuda): gp.arange and gp.rope at a numeric start are captured (made on the device, no host copy)', function()
  T.cuda()
  local x = gp.randn({2, 6, 3, 8}, cuda)
  local inv = gp.rope_inv_freq(8, cuda)
  local g = gp.graph(function() return gp.arange(4, 10, cuda), gp.rope(x, 4, inv) end)
  g:replay()
  T.same(g.outputs[1]:totable(), {4, 5, 6, 7, 8, 9})
  T.ok(T.relnorm(g.outputs[2], gp.rope(x, gp.arange(4, 10, cuda), inv)) < 1e-7, 'rope at start 4')
  g:free()
end)

T.test('graph (cuda): an index error in a replay is reported at the next synchronization', function()
  T.cuda()
  local w = gp.randn({10, 8}, cuda)
  local idx = gp.tensor({1, 2, 3}, {dtype = 'i64', device = 'cuda'})
  local g = gp.graph(function() return gp.embedding(w, idx) end)
  g:replay()
  T.ok(T.relnorm(g.outputs[1], gp.embedding(w, idx)) < 1e-7)
  idx:copy_(gp.tensor({1, 12, 3}, {dtype = 'i64', device = 'cuda'}))
  g:replay()
  T.raises(function() gp.sync() end, 'embedding', '12', 'size 10', 'next synchronization')
  gp.sync() -- reported once
end)

T.test('graph (cuda): the pool is given back when the graph is freed', function()
  T.cuda()
  gp.sync()
  local x = gp.randn({256, 256}, cuda)
  local g = gp.graph(function() return ((x * 2):exp() + x):sum() end)
  for _ = 1, 3 do g:replay() end
  local held = gp.memory().reserved
  g:free()
  collectgarbage(); collectgarbage()
  gp.empty_cache()
  T.ok(gp.memory().reserved <= held, 'reserved does not grow after free')
end)
