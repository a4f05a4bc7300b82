-- 07_profiling.lua: where the time goes. gp.time gives the median time of a
-- function (CUDA events on the GPU, a host clock on the CPU); gp.profile
-- times every kernel call; gp.memory shows the caching allocator.
local n = gp.device() == 'cuda' and 16 * 1024 * 1024 or 100000
local x = gp.randn{n}
local function step()
  local y = (x * 2 + 1):exp()
  return y:sigmoid() - y:tanh()
end

local ms = gp.time(step, {iters = 10})
print(string.format('gp.time: %.3f ms per call (%d elements)', ms, n))

local p = gp.profile(step, {iters = 5})
print(p)                                       -- a table per kernel: calls, us, %, GB/s, regs, occupancy
print(string.format('profile: %.3f ms per call; the slowest kernel is %s', p.per_iter_ms, p.kernels[1].name))

-- streams: kernels inside gp.with_stream are queued on that stream
local s = gp.stream()
local r = gp.with_stream(s, step)
gp.default_stream():wait(s:record())          -- order the default stream after s
print('computed on ' .. tostring(s), r:numel())
print(gp.memory())
