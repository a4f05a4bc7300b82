-- The kernel benchmark: gpush scripts/bench/kernels.lua [filter] [--iters N]
--
-- Per kernel and dtype: the shape (of the largest tensor argument; m x n x k
-- for products), the median time from CUDA events
-- (gp.time), GB/s (every tensor argument read or written once) or TFLOP/s,
-- and the fraction of a ceiling measured in the same run: the copy
-- bandwidth of a large contiguous gp.k.copy (bytes read + written), or the
-- peak of a large cuBLAS GEMM (8192^3, bf16, f32 and TF32, cuBLAS called
-- directly). Inputs are rotated over several buffer sets so that the 50 MB L2
-- of an H100 holds none of them between calls. Then: gp.k.matmul against
-- cuBLAS called directly in the same binary (acceptance: within 5%), and the
-- gemv option against GEMM for m = 1 and n = 1. On the CPU the sizes are tiny
-- and the ceilings are the CPU's own copy and GEMM; the numbers say so.
--
-- A kernel is one line of BENCH. Kernels without a line are benchmarked as
-- flat elementwise kernels when their spec allows (every tensor the out
-- shape or broadcast to it); the others are listed at the end as missing.
local gp = gp or require 'gpush'
local ffi = require 'ffi'
local kernels = require 'gpush.core.kernels'
local C = gp.C

local filter, ITERS = nil, 20
do
  local i = 1
  while arg and arg[i] do
    if arg[i] == '--iters' then ITERS = tonumber(arg[i + 1]); i = i + 1 else filter = arg[i] end
    i = i + 1
  end
end

local DEV = gp.device()
local CUDA = DEV == 'cuda'
local L2 = 50e6                     -- bytes of L2 on an H100 (and H200)
local NMEM = CUDA and 64 * 2 ^ 20 or 2 ^ 16   -- elements for memory-bound kernels
local G = CUDA and 4096 or 128      -- GEMM size
local MAX_SET_BYTES = 6e9           -- rotation never holds more than this
local function S(gpu, cpu) return CUDA and gpu or cpu end
local function bytes_of(t) return t:numel() * t:element_size() end

-- scalars the kernels get unless the line or the spec's default says otherwise
local SCALARS = {lo = 0, hi = 100, mean = 0, std = 1, value = 1, s = 1.5, eps = 1e-5}

-- name, dtypes, then options:
--   shape: the shape of [~], [=] and undimensioned arguments ({NMEM} by default)
--   star: the * dims of [*,...] arguments (default: all dims of shape but the last)
--   syms: sizes of upper-case symbols (default: the last dim of shape)
--   dts: dtype per tensor argument (casts); transpose: argument names made as transposed views
--   scalars: {name = value}; tf32: TF32 on; label: the row's name
--   metric: 'bw' (GB/s against the copy bandwidth) or 'flops' (the matmul family's default)
--   bytes: function(args, sum of all tensor bytes) -> the bytes the kernel really moves
local BENCH = {
  {'copy', {'f32', 'bf16'}},
  {'copy', {'f32'}, dts = {'bf16', 'f32'}, label = 'copy f32->bf16'},
  {'copy', {'bf16'}, dts = {'f32', 'bf16'}, label = 'copy bf16->f32'},
  {'copy', {'f32'}, shape = {8192, NMEM / 8192}, transpose = {'src'}, label = 'copy transposed'},
  {'fill', {'f32', 'bf16'}},
  {'rand_uniform', {'f32', 'bf16'}},
  {'rand_normal', {'f32', 'bf16'}},
  {'randint', {'i32', 'i64'}},
  {'add', {'f32', 'bf16'}},
  {'mul', {'f32', 'bf16'}},
  {'add_s', {'f32', 'bf16'}},
  {'exp', {'f32', 'bf16'}},
  {'pow_s', {'f32', 'bf16'}},
  {'pow_s', {'f32', 'bf16'}, scalars = {s = 2}, label = 'pow_s 2 (a product)'},
  {'gelu', {'f32', 'bf16'}},
  {'matmul', {'bf16', 'f16', 'f32'}, star = {}, syms = {M = G, N = G, K = G}},
  {'matmul', {'f32'}, star = {}, syms = {M = G, N = G, K = G}, tf32 = true, label = 'matmul tf32'},
  {'matmul', {'bf16'}, star = {}, syms = {M = G, N = G, K = G}, transpose = {'b'}, label = 'matmul b^T'},
  {'matmul', {'bf16'}, star = {32}, syms = {M = G / 4, N = G / 4, K = G / 4}, label = 'matmul batched'},
  {'matmul', {'bf16', 'f32'}, star = {}, syms = {M = 1, N = 2 * G, K = 2 * G}, transpose = {'b'}, metric = 'bw',
   label = 'matmul m=1'},
  {'matmul_bias', {'bf16'}, star = {}, syms = {M = G, N = G, K = G}},
  {'matmul_bias_gelu_tanh', {'bf16'}, star = {}, syms = {M = G, N = G, K = G}},
  -- p, m, v (f32) are read and written
  {'adamw', {'f32', 'bf16'}, star = {NMEM}, bytes = function(a, b) return b + 12 * a[1]:numel() end},
  {'sgd', {'f32', 'bf16'}, star = {NMEM}, bytes = function(a, b) return b + 8 * a[1]:numel() end},
  {'sumsq', {'f32', 'bf16'}},
  {'clip_coef', {'f32'}, label = 'clip_coef (launch)'},
  -- gathers read only the selected rows: out twice (read and written) and the indices
  {'embedding', {'bf16', 'f32'}, star = {S(16384, 64)}, syms = {D = S(4096, 64), V = S(50304, 1000)},
   bytes = function(a) return 2 * bytes_of(a[1]) + bytes_of(a[3]) end},
  {'embedding_backward', {'f32'}, star = {S(16384, 64)}, syms = {D = S(1024, 64), V = S(50304, 1000)}},
  {'gather', {'bf16', 'f32'}, syms = {A = S(64, 4), B = S(4096, 64), K = S(2048, 32), C = S(512, 16)},
   bytes = function(a) return 2 * bytes_of(a[1]) + bytes_of(a[3]) end},
  {'index_select', {'bf16', 'f32'}, syms = {A = S(64, 4), B = S(4096, 64), K = S(2048, 32), C = S(512, 16)},
   bytes = function(a) return 2 * bytes_of(a[1]) + bytes_of(a[3]) end},
  {'scatter_add', {'f32'}, syms = {A = S(64, 4), B = S(4096, 64), K = S(2048, 32), C = S(512, 16)}},
  {'cross_entropy', {'bf16', 'f32'}, syms = {N = S(2048, 16), V = S(50304, 1000)}},
  {'cross_entropy_fwd_bwd', {'bf16', 'f32'}, syms = {N = S(2048, 16), V = S(50304, 1000)}},
  -- short rows (a character model's 65 classes, 1000): a group of lanes a row, several rows a block
  {'cross_entropy', {'bf16', 'f32'}, syms = {N = S(32768, 16), V = 1000}, label = 'cross_entropy V=1000'},
  {'cross_entropy_fwd_bwd', {'bf16', 'f32'}, syms = {N = S(65536, 16), V = S(65, 65)}, label = 'cross_entropy_fwd_bwd V=65'},
  -- a decode step's draw: one row (batch 1) and 32 rows of SmolLM2's and Llama 3's vocabularies, top-p 0.9 (one
  -- block a row: latency, not bandwidth, bounds it; GB/s is the logits read and probs written once)
  {'sample', {'bf16'}, syms = {N = 1, V = S(49152, 1000)}, scalars = {top_p = 0.9}, label = 'sample N1 top-p'},
  {'sample', {'bf16'}, syms = {N = 32, V = S(49152, 1000)}, scalars = {top_p = 0.9}, label = 'sample N32 top-p'},
  {'sample', {'bf16'}, syms = {N = 32, V = S(49152, 1000)}, scalars = {top_k = 50, top_p = 0.9},
   label = 'sample N32 top-k top-p'},
  {'sample', {'bf16'}, syms = {N = 1, V = S(128256, 1000)}, scalars = {top_p = 0.9}, label = 'sample N1 V128K top-p'},
  {'distill_loss', {'bf16', 'f32'}, syms = {N = S(8192, 16), V = S(49152, 1000)}},
  {'distill_fwd_bwd', {'bf16', 'f32'}, syms = {N = S(8192, 16), V = S(49152, 1000)}},
  {'loss_reduce', {'f32'}, syms = {N = NMEM}},
  {'topk', {'f32', 'bf16'}, star = {S(65536, 64)}, syms = {N = 1024, K = 64}},
  {'sort', {'f32', 'bf16'}, star = {S(65536, 64)}, syms = {N = 1024}},
  {'multinomial', {'f32'}, syms = {N = S(4096, 16), V = S(50304, 1000)}},
  -- NF4 (blocks of 64); the GEMV's bytes are its arguments': N K / 2 + 4 N K / 64 + M K e + M N e
  {'nf4_quantize', {'bf16', 'f32'}, syms = {N = NMEM / 64, B = 64, H = 32}},
  {'nf4_dequantize', {'bf16', 'f32'}, syms = {N = NMEM / 64, B = 64, H = 32}},
  {'nf4_gemv', {'bf16'}, syms = {M = 1, N = S(4096, 64), K = S(4096, 128), H = S(2048, 64), G = S(64, 2)}, label = 'nf4_gemv m=1'},
  {'nf4_gemv', {'bf16'}, syms = {M = 1, N = S(14336, 64), K = S(4096, 128), H = S(2048, 64), G = S(64, 2)},
   label = 'nf4_gemv m=1 wide'},
  {'nf4_gemv', {'bf16'}, syms = {M = 8, N = S(4096, 64), K = S(4096, 128), H = S(2048, 64), G = S(64, 2)}, label = 'nf4_gemv m=8'},
  {'nf4_gemv', {'bf16'}, syms = {M = 32, N = S(4096, 64), K = S(4096, 128), H = S(2048, 64), G = S(64, 2)}, label = 'nf4_gemv m=32'},
}

local shape_str = require('gpush.core.tensor').shape_str

local function fill(t)
  local dt = t.dtype
  if dt == 'u8' then gp.k.randint(t, 0, 2)
  elseif dt == 'i32' or dt == 'i64' then gp.k.randint(t, 1, 50)
  else gp.k.rand_uniform(t, 0.5, 1.5) end -- positive: log, sqrt, pow are fine
end

local function has(list, x)
  for _, v in ipairs(list or {}) do if v == x then return true end end
  return false
end

-- the shape of a tensor argument from its spec dims
local function arg_shape(a, shape, syms, star)
  if a.dims == nil or a.dims == '~' or a.dims == '=' then return shape end
  local s = {}
  for tok in a.dims:gmatch('[^,]+') do
    if tok == '*' then
      if star then for i = 1, #star do s[#s + 1] = star[i] end
      else for i = 1, #shape - 1 do s[#s + 1] = shape[i] end end
    elseif tonumber(tok) then s[#s + 1] = tonumber(tok)
    else s[#s + 1] = (syms and syms[tok]) or shape[#shape] end
  end
  return s
end

local function arg_dtype(a, dt, e, ti)
  if e.dts and e.dts[ti] then return e.dts[ti] end
  local ty = a.type
  if ty == 'F' or ty == 'T' or ty == 'N' then return dt end
  if ty == 'B' then return 'u8' end
  if ty == 'I' then return 'i64' end
  return ty
end

-- one set of arguments; returns args, bytes of all tensor arguments
local function build(k, e, dt)
  local args, bytes, ti = {}, 0, 0
  local shape = e.shape or {NMEM}
  for i, a in ipairs(k.args) do
    if a.scalar then
      local v = e.scalars and e.scalars[a.name]
      if v == nil then v = a.default end
      if v == nil then v = SCALARS[a.name] or 1 end
      args[i] = v
    else
      ti = ti + 1
      local s = arg_shape(a, shape, e.syms, e.star)
      local tr = has(e.transpose, a.name) and #s >= 2
      local alloc = {unpack(s)}
      if tr then alloc[#alloc], alloc[#alloc - 1] = alloc[#alloc - 1], alloc[#alloc] end
      local t = gp.empty(alloc, {dtype = arg_dtype(a, dt, e, ti), device = DEV})
      if a.lt then gp.k.randint(t, 0, (e.syms and e.syms[a.lt]) or shape[#shape]) else fill(t) end
      if tr then t = t:transpose(-1, -2) end
      args[i] = t
      bytes = bytes + t:numel() * t:element_size()
    end
  end
  return args, bytes
end

local function median_ms(fn, iters) return (gp.time(fn, {warmup = 3, iters = iters or ITERS})) end

local function gemm_flops(args) return 2 * args[1]:numel() * args[2]:size(-1) end

local function release()
  collectgarbage('collect')
  collectgarbage('collect')
  if CUDA then gp.empty_cache() end
end

---------------------------------------------------------------------------
-- ceilings

print(string.format('gpush %s', gp.version()))
local _, v2 = gp.version()
print(v2)
if not CUDA then
  print('** CPU numbers: no CUDA GPU; tiny sizes; the ceilings are this CPU\'s copy and GEMM (gp.k reference code) **')
end

local COPY_N = CUDA and 128 * 2 ^ 20 or 2 ^ 20
local copy_bw
do
  local src = gp.empty({COPY_N}, {device = DEV})
  local dst = gp.empty({COPY_N}, {device = DEV})
  gp.k.fill(src, 1)
  local ms = median_ms(function() gp.k.copy(dst, src) end)
  copy_bw = 2 * COPY_N * 4 / (ms * 1e-3) / 1e9
  print(string.format('copy bandwidth: %.1f GB/s (gp.k.copy of %d f32, bytes read + written)', copy_bw, COPY_N))
end
release()

local peak = {}
local msbox = ffi.new('double[1]')
local function direct_ms(o, a, b, iters)
  local rc = C.gp_bench_cublas_gemm(msbox, o.c, a.c, b.c, iters or ITERS)
  if rc ~= 0 then error(ffi.string(C.gp_last_error())) end
  return msbox[0]
end
if CUDA then
  local P = 8192
  for _, p in ipairs {{'bf16', 'bf16', false}, {'f32', 'f32', false}, {'tf32', 'f32', true}} do
    local key, dt, tf32 = p[1], p[2], p[3]
    local a = gp.empty({P, P}, {dtype = dt, device = DEV}); fill(a)
    local b = gp.empty({P, P}, {dtype = dt, device = DEV}); fill(b)
    local o = gp.empty({P, P}, {dtype = dt, device = DEV})
    gp.set_tf32(tf32)
    local ms = direct_ms(o, a, b, 10)
    gp.set_tf32(false)
    peak[key] = 2 * P ^ 3 / (ms * 1e-3) / 1e12
    print(string.format('cuBLAS GEMM peak %-5s %d^3: %.1f TFLOP/s (cublasGemmEx called directly)', key, P, peak[key]))
    a, b, o = nil, nil, nil -- luacheck: ignore 311 (dropped before release() collects)
    release()
  end
else
  local a, b, o = gp.randn {G, G}, gp.randn {G, G}, gp.empty {G, G}
  local ms = median_ms(function() gp.k.matmul(o, a, b) end, 5)
  local p = 2 * G ^ 3 / (ms * 1e-3) / 1e12
  peak.bf16, peak.f32, peak.tf32 = p, p, p
  print(string.format('CPU GEMM %d^3 f32 (gp.k.matmul): %.4f TFLOP/s', G, p))
end
peak.f16 = peak.bf16

---------------------------------------------------------------------------
-- every kernel

-- kernels without a line: flat elementwise ones get a default line
local listed = {}
for _, e in ipairs(BENCH) do listed[e[1]] = true end
local missing = {}
for _, k in ipairs(kernels.list) do
  if not listed[k.name] then
    local flat, types = true, {}
    for _, a in ipairs(k.args) do
      if not a.scalar then
        if not (a.dims == nil or a.dims == '~' or a.dims == '=') then flat = false end
        types[a.type] = true
      end
    end
    if flat then
      BENCH[#BENCH + 1] = {k.name, (types.F or types.T) and {'f32', 'bf16'} or {'f32'}}
    else
      missing[#missing + 1] = k.name
    end
  end
end

print()
print(string.format('%-24s %-5s %-22s %10s %9s %8s  %s', 'kernel', 'dtype', 'shape', 'median_us', 'GB/s', 'TFLOP/s',
  'of ceiling'))
for _, e in ipairs(BENCH) do
  local k = kernels.by_name[e[1]]
  local label = e.label or e[1]
  if not k then
    print(string.format('%-24s (no such kernel on this build)', label))
  elseif not filter or label:find(filter, 1, true) then
    for _, dt in ipairs(e[2]) do
      local ok, err = pcall(function()
        local sets = {}
        local args, bytes = build(k, e, dt)
        sets[1] = args
        local r = math.min(8, math.max(1, math.ceil(4 * L2 / math.max(bytes, 1))))
        r = math.max(1, math.min(r, math.floor(MAX_SET_BYTES / math.max(bytes, 1))))
        for i = 2, r do sets[i] = (build(k, e, dt)) end
        local fn, n, i = k.fn, #k.args, 0
        local prev_tf32 = gp.tf32()
        gp.set_tf32(e.tf32 == true)
        local ms = median_ms(function()
          i = i % r + 1
          fn(unpack(sets[i], 1, n))
        end)
        gp.set_tf32(prev_tf32)
        if e.bytes then bytes = e.bytes(args, bytes) end
        local metric = e.metric or (k.family == 'matmul' and 'flops' or 'bw')
        local gbs = bytes / (ms * 1e-3) / 1e9
        local shape
        if k.family == 'matmul' then
          local o, a = args[1], args[2]
          shape = table.concat(o.shape, 'x', 1, #o.shape - 1) .. 'x' .. a:size(-1) .. 'x' .. o:size(-1)
          shape = shape .. (e.transpose and ' (' .. table.concat(e.transpose, ',') .. '^T)' or '')
        else
          local big = args[1] -- the largest tensor argument
          for j = 1, n do
            if gp.is_tensor(args[j]) and args[j]:numel() > big:numel() then big = args[j] end
          end
          shape = shape_str(big.shape) .. (e.transpose and ' (' .. table.concat(e.transpose, ',') .. '^T)' or '')
        end
        local tf, frac, of = ''
        if metric == 'flops' then
          local t = gemm_flops(args) / (ms * 1e-3) / 1e12
          local key = e.tf32 and 'tf32' or dt
          tf = string.format('%.4g', t)
          frac, of = t / peak[key], 'GEMM ' .. key
        else
          frac, of = gbs / copy_bw, 'copy bw'
          if k.family == 'matmul' then tf = string.format('%.4g', gemm_flops(args) / (ms * 1e-3) / 1e12) end
        end
        print(string.format('%-24s %-5s %-22s %10.1f %9.1f %8s  %.2f %s (%d set%s)', label, dt, shape, ms * 1e3, gbs,
          tf, frac, of, r, r > 1 and 's' or ''))
      end)
      if not ok then print(string.format('%-24s %-5s failed: %s', label, dt, tostring(err))) end
      release()
    end
  end
end
if #missing > 0 then
  print('no bench line (add one to BENCH in scripts/bench/kernels.lua): ' .. table.concat(missing, ', '))
end

---------------------------------------------------------------------------
-- gp.k.matmul against cuBLAS called directly (same buffers, same handle)

if CUDA and (not filter or ('matmul'):find(filter, 1, true)) then
  print()
  print('gp.k.matmul vs cuBLAS called directly (acceptance: within 5%)')
  print(string.format('%-28s %-5s %12s %12s %8s', 'shape', 'dtype', 'gp.k_us', 'cublas_us', 'ratio'))
  local worst = 0
  for _, c in ipairs {
    {'bf16', nil, 8192, 8192, 8192}, {'bf16', nil, 4096, 4096, 4096}, {'f16', nil, 4096, 4096, 4096},
    {'f32', nil, 4096, 4096, 4096}, {'tf32', nil, 4096, 4096, 4096}, {'bf16', 16, 1024, 1024, 1024},
    {'bf16', nil, 4096, 4096, 1024}, {'bf16', nil, 1024, 1024, 1024},
  } do
    local key, B, M, N, K = c[1], c[2], c[3], c[4], c[5]
    local dt = key == 'tf32' and 'f32' or key
    local function mk(s) local t = gp.empty(s, {dtype = dt, device = DEV}); fill(t); return t end
    local a = mk(B and {B, M, K} or {M, K})
    local b = mk(B and {B, K, N} or {K, N})
    local o = gp.empty(B and {B, M, N} or {M, N}, {dtype = dt, device = DEV})
    gp.set_tf32(key == 'tf32')
    -- alternate the two so clocks and thermals treat them alike
    local ours, direct = math.huge, math.huge
    for _ = 1, 3 do
      ours = math.min(ours, median_ms(function() gp.k.matmul(o, a, b) end))
      direct = math.min(direct, direct_ms(o, a, b))
    end
    gp.set_tf32(false)
    local ratio = ours / direct
    worst = math.max(worst, ratio)
    print(string.format('%-28s %-5s %12.1f %12.1f %8.3f %s', (B and B .. 'x' or '') .. M .. 'x' .. N .. 'x' .. K, key,
      ours * 1e3, direct * 1e3, ratio, ratio <= 1.05 and 'ok' or 'SLOWER'))
    a, b, o = nil, nil, nil
    release()
  end
  print(string.format('worst ratio %.3f: %s', worst, worst <= 1.05 and 'gp.k.matmul is within 5% of cuBLAS' or
    'NOT within 5% of cuBLAS'))

  -- m = 1 and n = 1: GEMM (the default) or cuBLAS gemv (gp.matmul_option('gemv', 1))
  print()
  print('m = 1 / n = 1: GEMM with m = 1 (default) vs cuBLAS gemv (gp.matmul_option("gemv", 1))')
  print(string.format('%-28s %-5s %12s %12s  %s', 'shape', 'dtype', 'gemm_us', 'gemv_us', 'faster'))
  local wins = {gemm = 0, gemv = 0}
  for _, c in ipairs {
    {'bf16', 1, 8192, 8192, true}, {'bf16', 1, 8192, 8192, false}, {'f32', 1, 8192, 8192, true},
    {'f16', 1, 8192, 8192, true}, {'bf16', 8192, 1, 8192, false}, {'f32', 8192, 1, 8192, false},
    {'bf16', 1, 4096, 4096, true},
  } do
    local dt, M, N, K, bt = c[1], c[2], c[3], c[4], c[5]
    local function mk(s) local t = gp.empty(s, {dtype = dt, device = DEV}); fill(t); return t end
    local a = mk {M, K}
    local b = bt and mk({N, K}):t() or mk {K, N}
    local o = gp.empty({M, N}, {dtype = dt, device = DEV})
    local t = {}
    for mode = 0, 1 do
      local prev = gp.matmul_option('gemv', mode)
      t[mode] = median_ms(function() gp.k.matmul(o, a, b) end)
      gp.matmul_option('gemv', prev)
    end
    local win = t[1] < t[0] and 'gemv' or 'gemm'
    wins[win] = wins[win] + 1
    print(string.format('%-28s %-5s %12.1f %12.1f  %s', M .. 'x' .. N .. 'x' .. K .. (bt and ' (b^T)' or ''), dt,
      t[0] * 1e3, t[1] * 1e3, win))
    a, b, o = nil, nil, nil
    release()
  end
  print(string.format('gemv faster in %d of %d cases; the default is GEMM (option gemv = 0)', wins.gemv,
    wins.gemv + wins.gemm))
end
