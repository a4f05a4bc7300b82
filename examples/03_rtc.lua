-- 03_rtc.lua: a new CUDA kernel written at run time, compiled by NVRTC for the
-- GPU present and cached (in memory and in $GPUSH_CACHE or ~/.cache/gpush).
if not gp.cuda_available() or gp.device() ~= 'cuda' then
  print('note: gp.rtc compiles CUDA kernels for a GPU; no GPU is in use here (' .. gp.device() .. '), so this example only prints this note.')
  return
end

local src = [[
extern "C" __global__ void saxpy(float *y, const float *x, float a, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    y[i] = a * x[i] + y[i];
}]]
local saxpy = gp.rtc.kernel(src, 'saxpy')       -- argument types come from the parameter list
print(saxpy)

local n = 1000000
local x, y = gp.randn{n}, gp.ones{n}
local ref = (x * 3 + y):cpu()
saxpy(y, x, 3, n, {grid = math.ceil(n / 256), block = 256})
local worst = 0
for i, v in ipairs((y:cpu() - ref):abs():totable()) do worst = math.max(worst, v) end
print(string.format('largest difference from the built-in kernels: %.2e', worst))

-- elementwise maps: inputs are the free names of the expression, the output is y
local leaky = gp.rtc.map('y = x > 0.f ? x : 0.01f * x')
print(leaky(gp.tensor({-100, -1, 0, 2})))

-- compile errors are Lua errors carrying the compiler's log
local ok, err = pcall(gp.rtc.kernel, 'extern "C" __global__ void broken(float *y) { y[0] = nope; }', 'broken')
print('compile error caught:', not ok)
print(err)
print('cache:', gp.rtc.stats.compiles, 'compiled,', gp.rtc.stats.memory_hits + gp.rtc.stats.disk_hits, 'from the cache')
