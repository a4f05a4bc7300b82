-- strided.lua: elementwise kernels on broadcast and transposed operands (the strided path).
local n = 8192
local function bw(name, bytes, fn) local ms = gp.time(fn, {iters = 20}); print(string.format('%-28s %8.1f us %7.1f GB/s', name, ms * 1e3, bytes / ms / 1e6)) end
for _, dt in ipairs {'f32', 'bf16'} do
  local o = {dtype = dt}
  local a, b, bias = gp.randn({n, n}, o), gp.randn({n, n}, o), gp.randn({n}, o)
  local out = gp.empty({n, n}, o)
  local es = dt == 'f32' and 4 or 2
  bw('add contiguous ' .. dt, 3 * n * n * es, function() gp.k.add(out, a, b) end)
  bw('add bias (N,D)+(D) ' .. dt, 2 * n * n * es, function() gp.k.add(out, a, bias) end)
  bw('add a + b^T ' .. dt, 3 * n * n * es, function() gp.k.add(out, a, b:t()) end)
  bw('copy transposed ' .. dt, 2 * n * n * es, function() gp.k.copy(out, a:t()) end)
  local x = gp.randn({64, 128, 1024}, o)
  local y = gp.empty({64, 1024, 128}, o)
  bw('copy permute (1,3,2) ' .. dt, 2 * x:numel() * es, function() gp.k.copy(y, x:transpose(2, 3)) end)
end
-- the permutes around attention: (B,T,H,D) <-> (B,H,T,D), the last dim stays contiguous
for _, dt in ipairs {'f32', 'bf16'} do
  local o = {dtype = dt}
  local es = dt == 'f32' and 4 or 2
  local x = gp.randn({8, 1024, 12, 64}, o)
  local y = gp.empty({8, 12, 1024, 64}, o)
  bw('copy (B,T,H,D)->(B,H,T,D) ' .. dt, 2 * x:numel() * es, function() gp.k.copy(y, x:permute {1, 3, 2, 4}) end)
end
