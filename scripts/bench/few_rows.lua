-- Few-rows products (decode's projections): gp.k.rows_linear, the kernel
-- gp.linear takes for them (a warp a row of w for one row of at most 1024;
-- tensor cores for up to 16 rows of K a multiple of 32), against cuBLAS
-- (gp.k.matmul) on the same bf16 operands, for the projections of GPT-2,
-- SmolLM2 and the d1024 Llama and two LM heads. Each time is one CUDA graph
-- of calls on weights rotated out of L2 (the kernels back to back), in us a
-- call. GPUSH_ROWS_MMA=1 runs one row on tensor cores too.
--   gpush scripts/bench/few_rows.lua [--rows 1,8,16] [--quick]
-- Without a GPU (or with --quick) the shapes are tiny: the run checks that
-- every row works; its numbers are not a benchmark.
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'rows', '1,8,16', 'row counts of x, comma-separated'},
  {'quick', false, 'tiny shapes (automatic without a GPU)'},
}, {usage = 'gpush scripts/bench/few_rows.lua [flags]', description = 'Few-rows products against cuBLAS.'})

local dev = gp.device()
local quick = a.quick or dev ~= 'cuda'
local o = {dtype = dev == 'cuda' and 'bf16' or 'f32', device = dev}
local rows = {}
for r in a.rows:gmatch('%d+') do rows[#rows + 1] = tonumber(r) end
local shapes = quick and {{64, 96}, {96, 50}} or
  {{768, 2304}, {768, 768}, {768, 3072}, {3072, 768}, {576, 960}, {576, 3072}, {1536, 576}, {1024, 3072},
   {1024, 5632}, {2816, 1024}, {576, 49152}, {768, 50257}, {768, 50304}}
local function us(g, R)
  return gp.time(function() g:replay() end, {warmup = quick and 1 or 3, iters = quick and 2 or 20}) / R * 1e3
end
print(string.format('few-rows products on %s%s, %s, us a call (rows kernel / gp.k.matmul, cuBLAS on the GPU; - : no rows kernel)', dev,
  quick and ' (quick: tiny shapes, not a benchmark)' or '', o.dtype))
for _, s in ipairs(shapes) do
  local K, N = s[1], s[2]
  local R = quick and 1 or math.max(2, math.min(32, math.floor(150e6 / (2 * N * K))))
  local ws = {}
  for i = 1, R do ws[i] = gp.randn({N, K}, o) end
  local line = {}
  for _, M in ipairs(rows) do
    local x, y = gp.randn({M, K}, o), gp.empty({M, N}, o)
    local ok = pcall(gp.k.rows_linear, y, x, ws[1])
    local function timed(f)
      if dev ~= 'cuda' then return gp.time(function() for i = 1, R do f(i) end end, {warmup = 1, iters = 2}) / R * 1e3 end
      local g = gp.graph(function() for i = 1, R do f(i) end end)
      local t = us(g, R)
      g:free()
      return t
    end
    local tr = ok and timed(function(i) gp.k.rows_linear(y, x, ws[i]) end)
    local tc = timed(function(i) gp.k.matmul(y, x, ws[i]:t()) end)
    line[#line + 1] = string.format('%2d rows %7s / %7.2f', M, tr and string.format('%.2f', tr) or '-', tc)
  end
  print(string.format('%5d -> %5d: %s', K, N, table.concat(line, ' | ')))
end
