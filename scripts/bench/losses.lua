-- The loss kernels alone against the copy bandwidth: gp.k.distill_fwd_bwd
-- for each kind (forward KL with and without hard targets, reverse KL, JSD)
-- and gp.k.cross_entropy_fwd_bwd, forward + backward in one launch, the
-- median of --iters calls after warm-up (gp.time: CUDA events), --rounds
-- times in one process. Bytes moved: distillation reads the student and the
-- teacher and writes dstudent (3 row-sizes), the cross-entropy reads the
-- logits and writes their gradient (2). The ceiling is gp.k.copy of 1 GB
-- (bytes read + written, as kernels.lua's) measured before each round (one
-- of 512 MB ran 2% slower on the H200: 3.84-3.85 TB/s against 3.93 in one
-- process). BENCHMARKS.md 2026-12-01 (g) and (h) have its numbers.
--
--   gpush scripts/bench/losses.lua                       -- the shapes of BENCHMARKS.md (H200: 2 GB a case)
--   gpush scripts/bench/losses.lua --only ce --rounds 1
--   gpush scripts/bench/losses.lua --rows 64 --vocab 4096 -- one shape for every case (the CPU: 16 x 4096)
local gp = rawget(_G, 'gp') or require 'gpush'

local o = gp.args.parse(arg, {
  {'only', '', "'distill' or 'ce' (both when empty)"},
  {'rounds', 2, 'rounds of every case in this process'},
  {'iters', 30, 'timed calls a case'},
  {'rows', 0, 'rows of every case (0: each case its own)'},
  {'vocab', 0, 'vocabulary of every case (0: each case its own)'},
}, {usage = 'gpush scripts/bench/losses.lua [flags]', description = 'the loss kernels alone, as a fraction of copy'})
if o.only ~= '' and o.only ~= 'distill' and o.only ~= 'ce' then
  error("losses.lua: --only is 'distill' or 'ce', not '" .. o.only .. "'", 0)
end
if o.rounds < 1 or o.iters < 1 or o.rows < 0 or o.vocab < 0 then
  error('losses.lua: --rounds and --iters at least 1, --rows and --vocab not negative', 0)
end

local CUDA = gp.device() == 'cuda'
local DEV = {device = gp.device()}
local N0 = CUDA and 128 * 2 ^ 20 or 2 ^ 18
local rows = o.rows > 0 and o.rows or (not CUDA and 16 or nil)
local vocab = o.vocab > 0 and o.vocab or (not CUDA and 4096 or nil)
if not CUDA then print('** CPU numbers: no CUDA GPU; small sizes; the ceiling is this CPU\'s copy **') end

-- {dtype, rows, vocab, temperature, alpha (nil: no hard targets), kind, label}
local DISTILL = {
  {'bf16', 8192, 49152, 2, nil, 0, 'forward KL, T 2, alpha 1'},
  {'bf16', 8192, 49152, 2, 0.5, 0, 'forward KL, T 2, alpha 0.5'},
  {'bf16', 8192, 49152, 1, 0.5, 0, 'forward KL, T 1, alpha 0.5'},
  {'bf16', 8192, 49152, 2, nil, 1, 'reverse KL, T 2, alpha 1'},
  {'bf16', 8192, 49152, 2, 0.5, 1, 'reverse KL, T 2, alpha 0.5'},
  {'bf16', 8192, 49152, 1, 0.5, 1, 'reverse KL, T 1, alpha 0.5'},
  {'bf16', 8192, 49152, 2, nil, 2, 'JSD, T 2, alpha 1'},
  {'f32', 8192, 20000, 2, 0.5, 0, 'forward KL, T 2, alpha 0.5'},
  {'bf16', 2048, 32768, 2, 0.5, 0, 'forward KL, T 2, alpha 0.5'},
}
local CE = {{'bf16', 8192, 49152}, {'bf16', 8192, 128256}, {'bf16', 4096, 128256}, {'bf16', 8192, 32768}}

local function copy_bw()
  local src, dst = gp.empty({N0}, DEV), gp.empty({N0}, DEV)
  gp.k.fill(src, 1)
  local ms = gp.time(function() gp.k.copy(dst, src) end, {iters = o.iters})
  return 2 * N0 * 4 / (ms * 1e-3) / 1e9
end

local function line(what, ms, bytes, bw)
  local gbs = bytes / (ms * 1e-3) / 1e9
  print(string.format('%-52s %9.1f us %8.1f GB/s %6.3f of copy', what, ms * 1e3, gbs, gbs / bw))
end

for r = 1, o.rounds do
  local bw = copy_bw()
  collectgarbage()
  print(string.format('round %d: copy %.0f GB/s (gp.k.copy of %d f32, bytes read + written)', r, bw, N0))
  if o.only ~= 'ce' then
    for _, c in ipairs(DISTILL) do
      local dt, N, V, T, a, kind, label = c[1], rows or c[2], vocab or c[3], c[4], c[5], c[6], c[7]
      local td = {dtype = dt, device = DEV.device}
      local s, t = gp.randn({N, V}, td), gp.randn({N, V}, td)
      local tg = gp.randint(0, V, {N}, DEV)
      local li, ds, cnt = gp.empty({N}, DEV), gp.empty({N, V}, td), gp.full({1}, N, DEV)
      local ms = gp.time(function() gp.k.distill_fwd_bwd(li, ds, s, t, tg, cnt, T, a or 1, kind, -100, 1) end,
        {iters = o.iters})
      line(string.format('distill %s %d x %d %s', dt, N, V, label), ms, 3 * N * V * s:element_size(), bw)
      s, t, ds = nil, nil, nil -- luacheck: ignore 311 (dropped before the collection)
      collectgarbage()
    end
  end
  if o.only ~= 'distill' then
    for _, c in ipairs(CE) do
      local dt, N, V = c[1], rows or c[2], vocab or c[3]
      local td = {dtype = dt, device = DEV.device}
      local lg, tg = gp.randn({N, V}, td), gp.randint(0, V, {N}, DEV)
      local li, dl, cnt = gp.empty({N}, DEV), gp.empty({N, V}, td), gp.full({1}, N, DEV)
      local ms = gp.time(function() gp.k.cross_entropy_fwd_bwd(li, dl, lg, tg, cnt, -100, 1) end, {iters = o.iters})
      line(string.format('cross_entropy %s %d x %d', dt, N, V), ms, 2 * N * V * lg:element_size(), bw)
      lg, dl = nil, nil -- luacheck: ignore 311 (dropped before the collection)
      collectgarbage()
    end
  end
end
