-- Measured cuBLASLt algorithms: gpush scripts/bench/matmul_tune.lua [--quick] [--iters N] [--dtype bf16]
--
-- The products of one Llama-shaped training step (tokens 8192 = batch 4 x
-- 2048, d 1024, 8 heads of 128, SwiGLU hidden 2816, vocabulary 32000), as
-- gp.linear and its backward make them: forward y = x @ W^T (W (out, in), a
-- transposed view), dX = dY @ W and dW = dY^T @ X (dY^T a transposed view),
-- for the projections qkv (1024 -> 3072), attention out (1024 -> 1024),
-- gate/up (1024 -> 2 x 2816), down (2816 -> 1024) and the head (1024 ->
-- 32000). Each row: the time of gp.k.matmul with gp.matmul_option('tune',
-- 0) (cublasGemmEx) and with 'tune' 1 (after the first call tuned it: up to
-- 8 cuBLASLt candidates and cublasGemmEx timed, the fastest cached), each the
-- fastest of 3 medians taken in turns, TFLOP/s of each and the speedup; then the step's sum,
-- the largest TFLOP/s of the run and the peak of an 8192^3 GEMM (cuBLAS
-- called directly). Without a GPU (or with --quick) the shapes are tiny and
-- both columns time the CPU reference: tuning applies to cuda only; the run
-- only checks that every row works.
local gp = rawget(_G, 'gp') or require 'gpush'
local ffi = require 'ffi'
local a = gp.args.parse(arg, {
  {'quick', false, 'tiny shapes (automatic without a GPU)'},
  {'iters', 20, 'timed calls per row (median)'},
  {'dtype', 'bf16', 'bf16, f16 or f32'},
}, {usage = 'gpush scripts/bench/matmul_tune.lua [flags]',
    description = "cuBLASLt algorithms chosen by measurement (gp.matmul_option('tune', 1)) on a training step's products."})

local DEV = gp.device()
local CUDA = DEV == 'cuda'
local QUICK = a.quick or not CUDA
local ITERS = QUICK and 2 or a.iters
local ROUNDS = QUICK and 1 or 3
local DT = a.dtype
local TOK, D, FF, V = 8192, 1024, 2816, 32000
if QUICK then TOK, D, FF, V = 64, 32, 48, 200 end

print(string.format('matmul tune bench on %s, %s%s', DEV, DT, QUICK and ' (quick: tiny shapes, not a benchmark)' or ''))
if not CUDA then print('tuning applies to cuda only: on the cpu both columns time the CPU reference') end
print(string.format('tokens %d, d %d, SwiGLU %d, vocabulary %d', TOK, D, FF, V))

local function ms_of(fn) return (gp.time(fn, {warmup = QUICK and 1 or 3, iters = ITERS})) end
local function release() collectgarbage('collect'); collectgarbage('collect'); if CUDA then gp.empty_cache() end end
local function rand(shape) return gp.randn(shape, {dtype = DT, device = DEV}) end

-- the projections, {label, in, out}
local PROJ = {{'qkv', D, 3 * D}, {'o', D, D}, {'gate_up', D, 2 * FF}, {'down', FF, D}, {'head', D, V}}
local INPUT = {qkv = 'x', o = 'a', gate_up = 'x', down = 'h', head = 'x'}
-- the rows: label, M, N, K, and a function making (out, a, b)
local rows = {}
for _, p in ipairs(PROJ) do
  local name, n_in, n_out = p[1], p[2], p[3]
  rows[#rows + 1] = {string.format('%s @ W%s', INPUT[name], name), TOK, n_out, n_in,
    function() return gp.empty({TOK, n_out}, {dtype = DT, device = DEV}), rand {TOK, n_in}, rand({n_out, n_in}):t() end}
end
for _, p in ipairs(PROJ) do
  local name, n_in, n_out = p[1], p[2], p[3]
  rows[#rows + 1] = {'dX ' .. name, TOK, n_in, n_out,
    function() return gp.empty({TOK, n_in}, {dtype = DT, device = DEV}), rand {TOK, n_out}, rand {n_out, n_in} end}
end
for _, p in ipairs(PROJ) do
  local name, n_in, n_out = p[1], p[2], p[3]
  rows[#rows + 1] = {'dW ' .. name, n_out, n_in, TOK,
    function() return gp.empty({n_out, n_in}, {dtype = DT, device = DEV}), rand({TOK, n_out}):t(), rand {TOK, n_in} end}
end

local prev = gp.matmul_option('tune', -1)
gp.matmul_tune_clear()
print()
print(string.format('%-14s %-22s %10s %10s %9s %9s %8s', 'product', 'M x N x K', 'off_us', 'tuned_us', 'off TF/s',
  'tuned TF/s', 'speedup'))
local sum_off, sum_on, best = 0, 0, 0
for _, r in ipairs(rows) do
  local label, M, N, K = r[1], r[2], r[3], r[4]
  local o, x, y = r[5]()
  local function call() gp.k.matmul(o, x, y) end
  gp.matmul_option('tune', 1)
  call() -- a miss: the candidates are timed and the fastest stored
  local off, on = math.huge, math.huge
  for _ = 1, ROUNDS do -- alternating, so that drifting clocks favour neither
    gp.matmul_option('tune', 0)
    off = math.min(off, ms_of(call))
    gp.matmul_option('tune', 1)
    on = math.min(on, ms_of(call))
  end
  gp.matmul_option('tune', 0)
  local flop = 2 * M * N * K
  local tf_off, tf_on = flop / (off * 1e-3) / 1e12, flop / (on * 1e-3) / 1e12
  best = math.max(best, tf_off, tf_on)
  sum_off, sum_on = sum_off + off, sum_on + on
  print(string.format('%-14s %-22s %10.1f %10.1f %9.4g %9.4g %7.3fx', label, M .. 'x' .. N .. 'x' .. K, off * 1e3,
    on * 1e3, tf_off, tf_on, off / on))
  o, x, y = nil, nil, nil -- luacheck: ignore 311 (dropped before release() collects)
  release()
end
gp.matmul_option('tune', prev)
local s = gp.matmul_tune_stats()
print(string.format('%-14s %-22s %10.1f %10.1f %9s %9s %7.3fx', 'step total', '', sum_off * 1e3, sum_on * 1e3, '', '',
  sum_off / sum_on))
print(string.format('tune cache: %d entries, %d misses, %d hits, %.1f ms spent tuning', s.entries, s.misses, s.hits,
  s.tuned_ms))
print(string.format('largest of this run: %.4g TFLOP/s', best))
if CUDA and not QUICK then
  local P = 8192
  local x, y = rand {P, P}, rand {P, P}
  local o = gp.empty({P, P}, {dtype = DT, device = DEV})
  local box = ffi.new('double[1]')
  if gp.C.gp_bench_cublas_gemm(box, o.c, x.c, y.c, 10) == 0 then
    print(string.format('cuBLAS GEMM peak %s %d^3: %.1f TFLOP/s (cublasGemmEx called directly)', DT, P,
      2 * P ^ 3 / (box[0] * 1e-3) / 1e12))
  end
end
