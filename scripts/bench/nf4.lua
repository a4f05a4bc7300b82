-- NF4 benchmark: gpush scripts/bench/nf4.lua [--quick] [--iters N] [--only gemv|linear|quant]
--
-- 1. the fused dequant-GEMV (gp.k.nf4_gemv) of decode: out (M, N) = x (M, K)
--    @ W^T for M = 1 .. 32 rows, W an NF4 weight (N, K) with blocks of 64.
--    Bytes moved: N K / 2 (the packed codes) + 4 N K / 64 (absmax) + M K e
--    (x) + M N e (out), e = 2 for bf16. The rows print the median time, GB/s
--    of those bytes and GB/s of the packed codes alone, and the fraction of
--    the copy bandwidth measured at the start of the run (gp.k.copy of 512 MB,
--    bytes read + written): the acceptance asks >= 0.70 of it for the packed
--    weight at M = 1 (decode); beside it, cuBLAS on the dense bf16 weight of
--    the same shape (gp.k.matmul, x @ W^T), which reads 4x the bytes.
-- 2. the training / prefill product gp.nf4_linear with many rows (the weight
--    dequantized by chunks into a bounded scratch, cuBLAS per chunk), forward
--    and forward + backward (dx), against gp.linear over the dense bf16 weight
--    of the same shape: the acceptance asks at most 1.5x its time.
-- 3. gp.quantize and q:dequantize() as GB/s of the dense bytes.
-- Weights rotate over enough copies that the 50 MB L2 of an H100 holds none
-- between calls; the GEMV rows time one CUDA graph of a call on each copy
-- (the kernels back to back, without the host's launch cost). Without a GPU (or with --quick) the shapes are tiny: the run
-- checks that every row works; its numbers are not a benchmark.
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'quick', false, 'tiny shapes (automatic without a GPU)'},
  {'iters', 50, 'timed calls per row (median)'},
  {'only', '', 'gemv, linear or quant: run that part only'},
}, {usage = 'gpush scripts/bench/nf4.lua [flags]', description = 'NF4 GEMV, chunked product and quantization speeds.'})

local DEV = gp.device()
local QUICK = a.quick or DEV ~= 'cuda'
local ITERS = QUICK and 2 or a.iters
local L2 = 50e6
local function part(p) return a.only == '' or a.only == p end
local function ms_of(fn) return (gp.time(fn, {warmup = QUICK and 1 or 5, iters = ITERS})) end
local function release() collectgarbage('collect'); collectgarbage('collect'); if DEV == 'cuda' then gp.empty_cache() end end
local function sets_for(bytes) return math.max(1, math.min(16, math.ceil(4 * L2 / math.max(bytes, 1)))) end

print(string.format('nf4 bench on %s%s', DEV, QUICK and ' (quick: tiny shapes, not a benchmark)' or ''))
local COPY_N = QUICK and 2 ^ 18 or 128 * 2 ^ 20
local copy_bw
do
  local src, dst = gp.empty({COPY_N}, {device = DEV}), gp.empty({COPY_N}, {device = DEV})
  gp.k.fill(src, 1)
  copy_bw = 2 * COPY_N * 4 / (ms_of(function() gp.k.copy(dst, src) end) * 1e-3) / 1e9
  print(string.format('copy bandwidth: %.1f GB/s (gp.k.copy of %d f32, bytes read + written)', copy_bw, COPY_N))
end
release()

local function weight(N, K, block)
  local w = gp.randn({N, K}, {dtype = 'bf16', device = DEV}) * 0.02
  return gp.quantize(w, {block = block}), w
end

if part('gemv') then
  print()
  print('fused dequant-GEMV (gp.k.nf4_gemv), bf16, blocks of 64')
  print(string.format('%-18s %4s %10s %10s %10s %8s %12s %8s', 'N x K', 'M', 'median_us', 'GB/s all', 'GB/s q', 'of copy',
    'cuBLAS bf16', 'ratio'))
  local shapes = QUICK and {{64, 128}, {33, 192}} or
    {{576, 576}, {1536, 576}, {576, 1536}, {2048, 2048}, {4096, 4096}, {11008, 4096}, {4096, 11008}, {14336, 4096}}
  local Ms = QUICK and {1, 7} or {1, 2, 4, 8, 16, 32}
  for _, s in ipairs(shapes) do
    local N, K = s[1], s[2]
    local qbytes = N * K / 2 + 4 * N * K / 64
    local r = sets_for(qbytes)
    local qs, ws = {}, {}
    for i = 1, r do qs[i], ws[i] = weight(N, K, 64) end
    for _, M in ipairs(Ms) do
      local x = gp.randn({M, K}, {dtype = 'bf16', device = DEV})
      local out = gp.empty({M, N}, {dtype = 'bf16', device = DEV})
      -- one CUDA graph of a call on each copy: the kernels' time, not the host's launches
      local g = gp.graph(function() for i = 1, r do gp.k.nf4_gemv(out, x, qs[i].data, qs[i].absmax) end end)
      local ms = ms_of(function() g:replay() end) / r
      local bytes = qbytes + 2 * M * K + 2 * M * N
      local gbs, gbq = bytes / (ms * 1e-3) / 1e9, N * K / 2 / (ms * 1e-3) / 1e9
      -- the dense product on cuBLAS: x @ W^T
      local rd = math.max(1, math.min(r, sets_for(2 * N * K)))
      local gd = gp.graph(function() for j = 1, rd do gp.k.matmul(out, x, ws[j]:t()) end end)
      local dms = ms_of(function() gd:replay() end) / rd
      print(string.format('%-18s %4d %10.1f %10.1f %10.1f %8.2f %12.1f %8.2f', N .. ' x ' .. K, M, ms * 1e3, gbs, gbq,
        gbq / copy_bw, dms * 1e3, ms / dms))
    end
    qs, ws = nil, nil -- luacheck: ignore 311
    release()
  end
  print('GB/s all: every byte moved (q, absmax, x, out); GB/s q: the packed codes alone; of copy: GB/s q / copy bandwidth (acceptance at M = 1: >= 0.70); ratio: nf4 time / cuBLAS bf16 time')
end

if part('linear') then
  print()
  print('gp.nf4_linear with many rows (chunked dequantization + cuBLAS) vs gp.linear over the dense bf16 weight')
  print(string.format('%-24s %12s %12s %8s %14s %14s %8s', 'rows x N x K', 'nf4_us', 'dense_us', 'ratio', 'nf4 f+b_us',
    'dense f+b_us', 'ratio'))
  local shapes = QUICK and {{40, 64, 128}} or
    {{4096, 4096, 4096}, {2048, 11008, 4096}, {2048, 4096, 11008}, {4096, 576, 576}, {4096, 1536, 576}, {512, 4096, 4096}}
  for _, s in ipairs(shapes) do
    local R, N, K = s[1], s[2], s[3]
    local q, w = weight(N, K, 64)
    local x = gp.randn({R, K}, {dtype = 'bf16', device = DEV})
    local g = gp.randn({R, N}, {dtype = 'bf16', device = DEV})
    local t = {}
    t.nf4 = ms_of(function() gp.no_grad(gp.nf4_linear, x, q) end)
    t.dense = ms_of(function() gp.no_grad(gp.linear, x, w) end)
    local xg = x:detach():requires_grad()
    t.nf4b = ms_of(function() gp.nf4_linear(xg, q):backward(g); xg:zero_grad() end)
    t.denseb = ms_of(function() gp.linear(xg, w):backward(g); xg:zero_grad() end)
    print(string.format('%-24s %12.1f %12.1f %8.2f %14.1f %14.1f %8.2f', R .. ' x ' .. N .. ' x ' .. K, t.nf4 * 1e3,
      t.dense * 1e3, t.nf4 / t.dense, t.nf4b * 1e3, t.denseb * 1e3, t.nf4b / t.denseb))
    q, w, x, g, xg = nil, nil, nil, nil, nil -- luacheck: ignore 311
    release()
  end
  print('ratio: nf4 time / dense bf16 time (acceptance: <= 1.5); f+b: forward and dx (the weight is frozen: no dW on either side)')
end

if part('quant') then
  print()
  print('quantize and dequantize (bf16, blocks of 64): GB/s of the dense bf16 bytes')
  local N, K = QUICK and 64 or 8192, QUICK and 128 or 8192
  local w = gp.randn({N, K}, {dtype = 'bf16', device = DEV})
  local q
  local qms = ms_of(function() q = gp.quantize(w) end)
  local dms = ms_of(function() q:dequantize() end)
  print(string.format('%d x %d: quantize %.1f us (%.1f GB/s), dequantize %.1f us (%.1f GB/s)', N, K, qms * 1e3,
    2 * N * K / (qms * 1e-3) / 1e9, dms * 1e3, 2 * N * K / (dms * 1e-3) / 1e9))
end
