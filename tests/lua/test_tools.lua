-- The tools around the kernels: docs for every public function, the profiler,
-- streams and events, run-time compiled kernels (NVRTC), REPL helpers.
local T = require 'lib'
local test = T.test
local function list_eq(a, b) T.eq(table.concat(a or {'<nil>'}, ' '), table.concat(b, ' ')) end

---------------------------------------------------------------------------
-- docs

test('every public gp function and kernel has a doc', function()
  local missing = {}
  local skip = {Tensor = true, C = true, ffi = true, _docs = true}
  local function walk(t, path, seen)
    if seen[t] then return end
    seen[t] = true
    for k, v in pairs(t) do
      if type(k) == 'string' and not k:match('^_') and not skip[k] then
        local name = path .. '.' .. k
        if type(v) == 'function' then
          if not gp._docs[v] then missing[#missing + 1] = name end
        elseif type(v) == 'table' and getmetatable(v) == nil and k ~= 'stats' then
          walk(v, name, seen)
        end
      end
    end
  end
  walk(gp, 'gp', {})
  table.sort(missing)
  T.ok(#missing == 0, 'undocumented: ' .. table.concat(missing, ', '))
end)

test('help and gp.kernels cover every kernel', function()
  local ks = gp.kernels()
  local n = 0
  for _ in pairs(gp.k) do n = n + 1 end
  T.eq(#ks, n)
  for _, k in ipairs(ks) do
    T.ok(k.doc ~= '' and k.usage:find('gp.k.' .. k.name, 1, true), k.name)
    T.ok(gp._docs[gp.k[k.name]].kernel, k.name)
  end
  T.ok(tostring(ks):find('gp.k.add', 1, true))
end)

---------------------------------------------------------------------------
-- profiler

local function workload(n, dev)
  local x = gp.randn({n}, {device = dev})
  return function()
    local y = (x * 2 + 1):exp()
    return y:neg()
  end
end

test('profile lists every kernel launched (cpu, host timing)', function()
  local p = gp.profile(workload(1000, 'cpu'), {iters = 2, device = 'cpu'})
  local names = {}
  for _, k in ipairs(p.kernels) do names[k.name] = k end
  for _, k in ipairs {'mul_s', 'add_s', 'exp', 'neg'} do
    T.ok(names[k], 'profile misses ' .. k)
    T.eq(names[k].calls, 2, k)
    T.ok(names[k].total_us >= 0 and names[k].gbps == nil or names[k].gbps > 0)
  end
  T.eq(p.calls, 8)
  T.ok(p.total_ms > 0 and p.kernel_ms <= p.total_ms * 1.05)
  T.ok(tostring(p):find('exp', 1, true))
  -- profiling is off afterwards: the original kernels are back
  T.eq(gp.k.exp, gp._docs[gp.k.exp] and gp.k.exp)
  T.ok(gp._docs[gp.k.exp].kernel)
  -- an error inside leaves the kernels restored
  T.raises(function() gp.profile(function() error('inside') end) end, 'inside')
  T.ok(gp._docs[gp.k.add].kernel)
end)

test('profile by shapes: a row per kernel and argument shapes, transposes marked', function()
  local a, b = gp.randn({4, 3}, {device = 'cpu'}), gp.randn({5, 3}, {device = 'cpu'})
  local c = gp.randn({4, 6}, {device = 'cpu'})
  local p = gp.profile(function()
    gp.matmul(a, b:t())
    gp.matmul(a, b:t())
    gp.matmul(c:t(), a)
  end, {device = 'cpu', shapes = true, iters = 1})
  local names = {}
  for _, k in ipairs(p.kernels) do names[k.name] = k.calls end
  T.eq(names['matmul 4x5 4x3 3x5T'], 2)
  T.eq(names['matmul 6x3 6x4T 4x3'], 1)
  T.ok(tostring(p):find('matmul 6x3 6x4T 4x3', 1, true))
  -- names past string.format's 99-column limit still print
  for _, k in ipairs(p.kernels) do k.name = k.name .. string.rep('x', 120) end
  T.ok(tostring(p):find('matmul 4x5 4x3 3x5T' .. string.rep('x', 120) .. '       2', 1, true))
  -- without the option, one row a kernel
  p = gp.profile(function() gp.matmul(a, b:t()) end, {device = 'cpu'})
  T.eq(p.kernels[1].name, 'matmul')
end)

test('profile total agrees with gp.time within 50% (cuda)', function()
  T.cuda()
  local fn = workload(67108864, 'cuda') -- large kernels: the per-kernel events cost little next to them
  local best
  for _ = 1, 3 do -- the first tries absorb one-off noise
    local p = gp.profile(fn, {iters = 10, warmup = 3, device = 'cuda'})
    -- gp.time's mean, not its median: a collection of the garbage every few
    -- iterations (runtime.lua's paced floor) falls in both means, in few samples
    local _, st = gp.time(fn, {iters = 10, warmup = 3, device = 'cuda'})
    local t = st.mean
    local rel = math.abs(p.per_iter_ms - t) / t
    best = math.min(best or rel, rel)
    local names = {}
    for _, k in ipairs(p.kernels) do names[k.name] = k end
    for _, k in ipairs {'mul_s', 'add_s', 'exp', 'neg'} do
      T.ok(names[k] and names[k].calls == 10, 'profile misses ' .. k)
      T.ok(names[k].regs and names[k].regs > 0, 'registers of ' .. k)
      T.ok(names[k].occupancy and names[k].occupancy > 0 and names[k].occupancy <= 1, 'occupancy of ' .. k)
      T.ok(names[k].gbps and (names[k].gbps > 10 or os.getenv('GPUSH_SANITIZER')), 'GB/s of ' .. k) -- instrumented: slow
    end
    if best < 0.5 then break end
  end
  -- a units or double-counting error shows as a factor; the two clocks differ
  -- by host gaps and event overhead (10-22% on a shared H100), so the bound is
  -- loose; under compute-sanitizer (make sanitize) every kernel is instrumented
  -- and the two clocks say nothing of each other
  if os.getenv('GPUSH_SANITIZER') then return end
  T.ok(best < 0.5, string.format('profile and gp.time differ by %.1f%%', 100 * best))
end)

---------------------------------------------------------------------------
-- tracer (CUPTI)

test('trace summary: per-name sums, busy time as the union of intervals, idle gaps', function()
  local S = require('gpush.tools.trace').summarize
  local t = S({
    {name = 'b', start = 10, finish = 14, graph = 7, kind = 'kernel'},
    {name = 'a', start = 0, finish = 5, graph = 0, kind = 'kernel'},
    {name = 'a', start = 3, finish = 8, graph = 0, kind = 'kernel'}, -- overlaps the first (two streams)
    {name = 'm', start = 4, finish = 6, kind = 'memset', bytes = 4000},   -- inside it
    {name = 'a', start = 20, finish = 21, graph = 0, kind = 'kernel'},
  }, 2, 1)
  T.eq(t.calls, 5)
  T.eq(t.wall_us, 21)
  T.eq(t.busy_us, 8 + 4 + 1)
  T.eq(t.idle_us, 2 + 6)
  T.eq(t.per_iter_us, 10.5)
  T.eq(#t.gaps, 1) -- the largest only
  T.eq(t.gaps[1].us, 6)
  T.eq(t.gaps[1].before, 'b')
  T.eq(t.gaps[1].after, 'a')
  T.eq(t.kernels[1].name, 'a')
  T.eq(t.kernels[1].calls, 3)
  T.eq(t.kernels[1].total_us, 11)
  T.eq(t.by_name.b.graph_calls, 1)
  T.eq(t.by_name.m.gbps, 2)
  T.eq(t.records[1].name, 'a') -- sorted by start
  -- the gap's 'before' is the activity that ended last, not the one that started last
  t = S({{name = 'long', start = 0, finish = 30}, {name = 'short', start = 5, finish = 6}, {name = 'next', start = 40, finish = 41}}, 1)
  T.eq(t.gaps[1].us, 10)
  T.eq(t.gaps[1].before, 'long')
  local e = S({}, 1)
  T.eq(e.wall_us, 0)
  T.eq(#e.kernels, 0)
end)

test('trace: bad arguments and no GPU are clear errors', function()
  T.raises(function() gp.trace(5) end, 'trace: needs a function')
  T.raises(function() gp.trace(function() end, 3) end, 'trace: options must be a table')
  if not gp.cuda_available() then T.raises(function() gp.trace(function() end) end, 'trace: needs a CUDA GPU') end
end)

test('trace lists every kernel the GPU ran: gpush\'s, cuBLAS\'s and a graph\'s nodes (cuda)', function()
  T.cuda()
  local x = gp.zeros({1048576}, {device = 'cuda'})
  local a, b = gp.randn({256, 512}, {device = 'cuda'}), gp.randn({512, 128}, {device = 'cuda'})
  local t = gp.trace(function()
    for _ = 1, 3 do gp.k.fill(x, 1) end
    gp.matmul(a, b)
  end, {iters = 2})
  T.eq(t.iters, 2)
  local fill, other = nil, 0
  for _, k in ipairs(t.kernels) do
    if k.name:find('FillF', 1, true) then fill = k elseif k.kind == 'kernel' then other = other + k.calls end
  end
  T.ok(fill and fill.calls == 6, 'the fill kernel, 6 calls: ' .. tostring(t))
  T.ok(fill.grid > 0 and fill.block > 0 and fill.regs > 0 and fill.mean_us > 0)
  T.ok(other >= 2 and other % 2 == 0, 'the product\'s kernels, the same in each run: ' .. tostring(t))
  T.ok(t.busy_us > 0 and t.busy_us <= t.wall_us + 1e-6 and t.idle_us >= -1e-6)
  T.ok(tostring(t):find('largest idle gaps', 1, true))
  -- a CUDA graph's replays: its nodes, marked with the graph
  local g = gp.graph(function() gp.k.fill(x, 2); gp.k.fill(x, 3) end)
  t = gp.trace(function() g:replay() end, {iters = 3, warmup = 1})
  local n = 0
  for _, r in ipairs(t.records) do
    if r.kind == 'kernel' then T.ok(r.graph ~= 0, 'a replayed node has its graph id: ' .. r.name) end
    if r.name:find('FillF', 1, true) then n = n + 1 end
  end
  T.eq(n, 6, tostring(t))
  T.eq(x:sum():item(), 3 * 1048576)
  -- an error inside fn ends the trace; the next one works; traces do not nest
  T.raises(function() gp.trace(function() error('inside') end, {warmup = 0}) end, 'inside')
  T.raises(function() gp.trace(function() gp.trace(function() end) end, {warmup = 0}) end, 'already tracing')
  t = gp.trace(function() gp.k.fill(x, 4) end, {warmup = 0})
  T.eq(t.calls, 1)
end)

---------------------------------------------------------------------------
-- streams

test('streams on the cpu run in order', function()
  local s = gp.stream()
  local y = gp.with_stream(s, function() return gp.ones({3}, {device = 'cpu'}) * 3 end)
  T.same(y:totable(), {3, 3, 3})
  local e = s:record()
  gp.default_stream():wait(e)
  e:synchronize()
  T.ok(e:query())
  s:synchronize()
  T.ok(s:query())
  T.raises(function() gp.with_stream(s, function() error('boom') end) end, 'boom')
  T.eq(gp.current_stream(), gp.default_stream())
  T.raises(function() gp.with_stream(42, print) end, 'with_stream')
end)

test('streams on the gpu: work on two streams, ordered by events', function()
  T.cuda()
  local s1, s2 = gp.stream(), gp.stream()
  local x = gp.randn({1048576}, {device = 'cuda'})
  local a = gp.with_stream(s1, function()
    T.eq(gp.current_stream(), s1)
    return (x * 2):exp()
  end)
  local ev = s1:record()
  s2:wait(ev)
  local b = gp.with_stream(s2, function() return a + 1 end)
  T.eq(gp.current_stream(), gp.default_stream())
  gp.default_stream():wait(s2:record())
  local ref = (x:cpu() * 2):exp() + 1
  T.ok(T.relnorm(b:cpu(), ref) < 1e-5)
  -- memory freed while streams run waits for a device-wide sync before reuse
  gp.with_stream(s1, function() for _ = 1, 4 do gp.empty{1024} end collectgarbage() end)
  gp.sync()
  T.eq(gp.memory().pending_blocks, 0)
  s1:synchronize(); s2:synchronize()
end)

---------------------------------------------------------------------------
-- rtc

local SCALE = [[
extern "C" __global__ void scale(float *y, const float *x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i];
}]]

test('rtc: a clear error without a GPU', function()
  if gp.cuda_available() then T.skip('a GPU is usable') end
  T.raises(function() gp.rtc.kernel(SCALE, 'scale') end, 'rtc.kernel', 'GPU')
  T.raises(function() gp.rtc.map('y = x * 2.f') end, 'rtc.map')
end)

test('rtc: argument types from the parameter list; free names of a map', function()
  local rtc = require 'gpush.tools.rtc'
  list_eq(rtc.parse_args(SCALE, 'scale'), {'ptr', 'ptr', 'float', 'int'})
  list_eq(rtc.parse_args('__global__ void k(const float* __restrict__ a, long long n, unsigned m) {}', 'k'),
    {'ptr', 'i64', 'u32'})
  T.eq(rtc.parse_args('__global__ void k(float *a) {}', 'other'), nil)
  list_eq(rtc.free_names('x > 0.f ? x * expf(-b) : 1e-3f + c.w'), {'x', 'b', 'c'})
end)

test('rtc: compile cache in memory and on disk; compile errors show the log', function()
  if not gp.cuda_available() and gp.C.gp_cuda_compiled() ~= 1 then T.skip('built without CUDA') end
  local rtc = require 'gpush.tools.rtc'
  local dir = os.tmpname()
  os.remove(dir)
  local old = rtc.cache_dir
  rtc.cache_dir = function() return dir end
  local ok, err = pcall(function()
    local src = SCALE .. '\n// ' .. tostring(os.time()) .. tostring(math.random(1e9))
    local arch = gp.cuda_available() and gp.rtc.arch() or 'sm_90'
    local s0 = {}
    for k, v in pairs(gp.rtc.stats) do s0[k] = v end
    local e, from = gp.rtc.compile(src, 'scale', {arch = arch})
    T.eq(from, 'compiled')
    T.ok(#e.code > 100 and e.lowered == 'scale')
    local _, from2 = gp.rtc.compile(src, 'scale', {arch = arch})
    T.eq(from2, 'memory')
    gp.rtc.clear_memory_cache()
    local e3, from3 = gp.rtc.compile(src, 'scale', {arch = arch})
    T.eq(from3, 'disk')
    T.eq(e3.code, e.code)
    T.eq(gp.rtc.stats.compiles - s0.compiles, 1)
    T.eq(gp.rtc.stats.memory_hits - s0.memory_hits, 1)
    T.eq(gp.rtc.stats.disk_hits - s0.disk_hits, 1)
    local msg = T.raises(function()
      gp.rtc.compile('extern "C" __global__ void bad(float *y) { y[0] = undefined_name }', 'bad', {arch = arch})
    end, 'rtc', 'bad', 'undefined_name')
    T.ok(msg:find('error', 1, true), msg)
  end)
  rtc.cache_dir = old
  os.execute("rm -rf '" .. dir .. "'")
  if not ok then error(err, 0) end
end)

test('rtc: a kernel compiled at run time matches the CPU (cuda)', function()
  T.cuda()
  local k = gp.rtc.kernel(SCALE, 'scale')
  local n = 1000003
  local x = gp.randn({n}, {device = 'cuda'})
  local y = gp.empty({n}, {device = 'cuda'})
  k(y, x, 2.5, n, {grid = math.ceil(n / 256), block = 256})
  T.ok(T.relnorm(y:cpu(), x:cpu() * 2.5) < 1e-6)
  local k2, from = gp.rtc.kernel(SCALE, 'scale')
  T.eq(k2, k)
  T.eq(from, 'memory')
  T.raises(function() k(y, x, 2.5, {grid = 1}) end, 'scale', '3 arguments given')
  T.raises(function() k(y, x:cpu(), 2.5, n, {grid = 1}) end, 'argument 2 is on cpu')
  local relu = gp.rtc.map('y = x > 0.f ? x : 0.f')
  list_eq(relu.inputs, {'x'})
  T.ok(T.relnorm(relu(x):cpu(), x:cpu():relu()) == 0)
  local fma = gp.rtc.map('y = a * b + c')
  local a, b, c = gp.randn{7, 5}, gp.randn{7, 5}, gp.randn{7, 5}
  T.ok(T.relnorm(fma(a, b, c):cpu(), (a:cpu() * b:cpu() + c:cpu())) < 1e-6)
  T.ok(T.relnorm(fma{a = a, b = b, c = c}:cpu(), (a:cpu() * b:cpu() + c:cpu())) < 1e-6)
  T.raises(function() gp.rtc.kernel('extern "C" __global__ void k(float *y) { y[0] = ; }', 'k') end, 'rtc', 'error')
  -- a launch error is an error, not a crash
  T.raises(function() k(y, x, 1, n, {grid = 1, block = 4096}) end, 'rtc')
end)

---------------------------------------------------------------------------
-- REPL helpers (the terminal itself is tested by tests/repl/test_repl.sh)

test('repl: completion of globals, gp fields and tensor methods', function()
  local repl = require 'gpush.tools.repl'
  local c = repl.complete('gp.ze')
  T.ok(#c >= 1 and c[1] == 'gp.zeros', table.concat(c, ' '))
  rawset(_G, 'repl_t_', gp.ones{2})
  local m = repl.complete('repl_t_:tr')
  T.ok(#m >= 1 and m[1] == 'repl_t_:transpose', table.concat(m, ' '))
  T.ok(#repl.complete('repl_t_.sha') == 1)
  rawset(_G, 'repl_t_', nil)
  local g = repl.complete('whi')
  T.ok(g[1] == 'while')
  list_eq(repl.complete('gp.k.add_s'), {'gp.k.add_s'})
  T.eq(#repl.complete('nosuchthing.x'), 0)
end)

test('repl: incomplete chunks ask for more; values print', function()
  local repl = require 'gpush.tools.repl'
  local f, err = repl.compile('function f()')
  T.eq(f, nil)
  T.eq(err, 'more')
  T.ok(repl.compile('1 + 1'))
  T.eq(select(2, repl.compile('1 +* 2')) ~= 'more', true)
  T.eq(repl.format({1, 2, a = 'x'}), '{1, 2, a = "x"}')
end)

test('repl: locals persist (a line starting with local declares session globals); =expr', function()
  local repl = require 'gpush.tools.repl'
  T.eq(repl.rewrite_locals('local y = 5'), 'y = 5')
  T.eq(repl.rewrite_locals('  local a, b = 1, 2; print(a)'), '  a, b = 1, 2; print(a)')
  T.eq(repl.rewrite_locals('local function f(x) return x end'), 'function f(x) return x end')
  T.eq(repl.rewrite_locals('local z'), 'z = nil ')
  T.eq(repl.rewrite_locals('do local q = 1 end'), 'do local q = 1 end') -- inside a block: stays local
  T.eq(repl.rewrite_locals('localx = 1'), 'localx = 1')
  assert(repl.compile('local repl_y_ = 5'))()
  T.eq(rawget(_G, 'repl_y_'), 5)
  T.eq(assert(repl.compile('=repl_y_ + 1'))(), 6)
  rawset(_G, 'repl_y_', nil)
end)

test('repl: errors point at stdin and show the typed code\'s frames only (all with gp.debug)', function()
  local repl = require 'gpush.tools.repl'
  local function run(src)
    local f = assert(repl.compile(src))
    local ok, e = xpcall(f, function(e) return repl.error_text(e, 2) end)
    T.ok(not ok)
    return e
  end
  -- an expression whose error is raised inside gpush (no tail call hides the typed line)
  local e = run("gp.zeros{'3'}")
  T.ok(e:find("^stdin:1: zeros: size '3'"), e)
  T.ok(not e:find('lua/gpush/', 1, true) and not e:find('traceback', 1, true), e)
  e = run("error('boom')")
  T.ok(e:find('^stdin:1: boom'), e)
  -- a function typed at the prompt: its frame is kept, gpush's are not
  assert(repl.compile('function repl_f_(t) local r = t:matmul(t); return r end'))()
  e = run('repl_f_(gp.zeros{2,3})')
  T.ok(e:find('^stdin:1: matmul: inner dimensions differ'), e)
  T.ok(e:find("in function 'repl_f_'", 1, true), e)
  T.ok(not e:find('lua/gpush/', 1, true), e)
  gp.debug = true
  e = run('repl_f_(gp.zeros{2,3})')
  gp.debug = nil
  T.ok(e:find('lua/gpush/', 1, true), 'gp.debug = true shows every frame: ' .. e)
  rawset(_G, 'repl_f_', nil)
end)

test('help(t) of a tensor lists its methods by group, every method once', function()
  local help = require 'gpush.tools.help'
  local t = gp.zeros {2, 3}
  local s = help.tensor_methods(t)
  T.ok(s:find('(2,3)', 1, true), s)
  for _, g in ipairs {'views', 'reductions', 'autograd', 'arithmetic'} do T.ok(s:find(g, 1, true), g .. ' in ' .. s) end
  for name, f in pairs(gp.Tensor) do
    if type(f) == 'function' then
      local n = select(2, s:gsub('%f[%w_]' .. name:gsub('_', '%%_') .. '%f[^%w_]', ''))
      T.ok(n >= 1, name .. ' missing from help(t)')
    end
  end
end)
