-- Forward row kernels against a device-to-device copy of the same bytes:
--   gpush scripts/bench/rows.lua [n_elements] [row_len]
-- Times SwiGLU, RMSNorm, softmax and LayerNorm forward (f32 and bf16) with
-- gp.time (CUDA events on the GPU) and prints µs, GB/s (bytes read + written)
-- and the fraction of the copy bandwidth measured in the same run.
local gp = require 'gpush'
local dev = gp.device()
local N = tonumber(arg and arg[1]) or (dev == 'cuda' and 64 * 1024 * 1024 or 64 * 1024)
local ROWS_OF = {tonumber(arg and arg[2]) or 4096, 8192}
if arg and arg[2] then ROWS_OF = {tonumber(arg[2])} end
if dev ~= 'cuda' then
  print('note: no GPU, these are CPU numbers (reference kernels, small sizes): not a GPU benchmark')
end
print(string.format('device %s, %d elements per tensor', dev, N))
local opts = {warmup = 3, iters = dev == 'cuda' and 50 or 3}

local function row(name, dt, D, ms, bytes, copy_gbs)
  local gbs = bytes / (ms * 1e-3) / 1e9
  print(string.format('%-10s %-5s %-8s %10.1f us %9.1f GB/s %6.1f%% of copy', name, dt, D and 'D=' .. D or '', ms * 1e3, gbs,
    100 * gbs / copy_gbs))
  return gbs
end

for _, dt in ipairs {'f32', 'bf16'} do
  local es = dt == 'f32' and 4 or 2
  -- the ceiling: copy of one N-element tensor (read N + write N)
  local a = gp.randn({N}):to(dt)
  local b = gp.empty({N}, {dtype = dt})
  local cms = gp.time(function() gp.k.copy(b, a) end, opts)
  local copy_gbs = 2 * N * es / (cms * 1e-3) / 1e9
  print(string.format('%-10s %-5s %-8s %10.1f us %9.1f GB/s (the ceiling)', 'copy', dt, '', cms * 1e3, copy_gbs))
  -- SwiGLU: read gate and up, write out
  local up = gp.randn({N}):to(dt)
  local out = gp.empty({N}, {dtype = dt})
  row('swiglu', dt, nil, gp.time(function() gp.k.swiglu(out, a, up) end, opts), 3 * N * es, copy_gbs)
  up = nil
  for _, D in ipairs(ROWS_OF) do
    local R = math.floor(N / D)
    local x = a:narrow(1, 1, R * D):view {R, D}
    local y = out:narrow(1, 1, R * D):view {R, D}
    local w, bb = gp.randn({D}):to(dt), gp.randn({D}):to(dt)
    local mean, rstd = gp.empty {R}, gp.empty {R}
    local bytes = 2 * R * D * es
    row('rms_norm', dt, D, gp.time(function() gp.k.rms_norm(y, rstd, x, w, 1e-5) end, opts), bytes, copy_gbs)
    row('softmax', dt, D, gp.time(function() gp.k.softmax(y, x) end, opts), bytes, copy_gbs)
    row('layer_norm', dt, D, gp.time(function() gp.k.layer_norm(y, mean, rstd, x, w, bb, 1e-5) end, opts), bytes, copy_gbs)
  end
  a, b, out = nil, nil, nil
  collectgarbage()
end
