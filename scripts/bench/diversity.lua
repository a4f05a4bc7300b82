-- Set diversity (mean pairwise cosine distance) on the GPU:
--   gpush scripts/bench/diversity.lua [n] [d]        (default n = 64, d = 384)
-- Times the forward kernel (gp.k.set_diversity, one launch for all sets), the
-- wrapper gp.set_diversity (allocation and checks included), and the backward
-- kernel, for 1 and 64 sets, f32 and bf16, with gp.time (CUDA events). Prints
-- µs and GB/s (the set read once). Compare the S = 1 f32 forward line with
-- scripts/bench/torch_diversity.py, which times the same computation in
-- PyTorch eager.
local gp = require 'gpush'
local n = tonumber(arg and arg[1]) or 64
local d = tonumber(arg and arg[2]) or 384
local dev = gp.device()
if dev ~= 'cuda' then print('note: no GPU, these are CPU numbers (reference kernels): not a GPU benchmark') end
local opts = {warmup = 10, iters = dev == 'cuda' and 200 or 3}
print(string.format('device %s, n = %d, d = %d', dev, n, d))
for _, dt in ipairs {'f32', 'bf16'} do
  for _, S in ipairs {1, 64} do
    local x = gp.randn({S, n, d}):to(dt)
    local out = gp.empty({S}, {dtype = dt})
    local dout = gp.ones({S}, {dtype = dt})
    local dx = gp.empty({S, n, d}, {dtype = dt})
    local bytes = S * n * d * (dt == 'f32' and 4 or 2)
    local function line(name, ms, rw)
      print(string.format('%-26s %-5s S=%-3d %9.2f us %8.1f GB/s', name, dt, S, ms * 1e3, rw * bytes / (ms * 1e-3) / 1e9))
    end
    line('set_diversity kernel', gp.time(function() gp.k.set_diversity(out, x, 1e-8) end, opts), 1)
    line('gp.set_diversity', gp.time(function() gp.set_diversity(x) end, opts), 1)
    line('set_diversity_backward', gp.time(function() gp.k.set_diversity_backward(dx, x, dout, 1e-8) end, opts), 2)
  end
end
