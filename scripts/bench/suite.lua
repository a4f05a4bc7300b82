-- The benchmark suite beside PyTorch (`make bench`):
--
--   gpush scripts/bench/suite.lua [--quick] [--no-torch] [--no-compile] [--only TEXT] [--json FILE]
--
-- One row per workload and shape: gpush's median time (CUDA events through
-- gp.time, after warm-up, inputs rotated over enough buffer sets that the
-- L2 holds none of them between calls), then the same workload in PyTorch
-- eager and torch.compile measured in the same run by
-- scripts/bench/torch_peer.py (called once per workload with all its shapes;
-- JSON lines back), and the ratios gpush time / PyTorch time (below 1:
-- gpush is faster). The note column gives the fraction of the copy
-- bandwidth or GEMM peak measured at the start of the run, or tokens/s.
--
-- Without a GPU (or with --quick) the shapes are tiny and torch.compile is
-- not called: the run checks that every row works, its numbers are not a
-- benchmark. Without an importable torch the ratio columns say "no torch".
--
-- A workload is one entry of WORKLOADS below: a name (the peer's workload
-- name too), `needs` (the gpush functions it calls: while one is nil the
-- rows say "not built yet"), `cases` (its rows: a label, a shape string and
-- the parameters both sides build from) and `run` (the gpush side of one
-- case: returns milliseconds, and optionally a note).
local gp = rawget(_G, 'gp') or require 'gpush'
local ffi = require 'ffi'
local json = gp.json
local T0 = gp.train.now()

---------------------------------------------------------------------------
-- options

local o = gp.args.parse(arg, {
  {'quick', false, 'tiny shapes and few iterations (automatic without a GPU); no torch.compile'},
  {'torch', true, 'call the PyTorch peer (--no-torch: do not)'},
  {'compile', true, 'time torch.compile too (--no-compile: PyTorch eager only)'},
  {'only', '', 'run only the workloads whose name or row label contains this text'},
  {'json', '', 'also write every row as a JSON line to this file'},
  {'python', 'python3', 'the Python that runs scripts/bench/torch_peer.py'},
  {'peer-timeout', 300, 'seconds one peer call may take'},
}, {usage = 'gpush scripts/bench/suite.lua [flags]', description = 'gpush benchmarks beside PyTorch eager and torch.compile.'})

local DEV = gp.device()
local CUDA = DEV == 'cuda'
local QUICK = o.quick or not CUDA
local COMPILE = not QUICK and o.compile
local script_dir = (arg and arg[0] or 'scripts/bench/suite.lua'):match('^(.*)/[^/]*$') or '.'
local PEER = script_dir .. '/torch_peer.py'

local function S(full, quick) if QUICK then return quick end return full end
local L2 = 50e6                                     -- bytes of L2 on an H100 / H200
local NMEM = S(64 * 2 ^ 20, 2 ^ 14)                  -- elements of the memory-bound workloads
local DROW = S(4096, 128)                            -- row length of the row workloads
local KERNEL_IT = {warmup = S(5, 1), iters = S(30, 2)}
local TRAIN_IT = {warmup = S(3, 1), iters = S(10, 2)}
-- the loss rows through autograd leave each call's gradient (128 MB to 1 GB)
-- to the collector: until a process's first collection every call's
-- gradient is a new cudaMalloc'd block (garbage may reach the collector's
-- floor, up to 4 GB: runtime.lua), so their warm-up runs past that point and
-- the median is the per-call time of a loop that has run a while
local LOSS_IT = {warmup = S(40, 1), iters = S(30, 2)}
local DISPATCH_N = S(100000, 1000)

-- rotate over enough sets that 4x the L2 lies between two uses of one set
local function sets_for(bytes) return math.max(1, math.min(8, math.ceil(4 * L2 / math.max(bytes, 1)))) end
local function esize(dt) return dt == 'f32' and 4 or 2 end

local function sh(cmd)
  local f = io.popen(cmd .. ' 2>/dev/null')
  if not f then return '' end
  local s = f:read('*a') or ''
  f:close()
  return (s:gsub('%s+$', ''))
end

local function release()
  collectgarbage('collect')
  collectgarbage('collect')
  if CUDA then gp.empty_cache() end
end

local function fill(t) gp.k.rand_uniform(t, 0.5, 1.5); return t end
local function rand(shape, dt) return fill(gp.empty(shape, {dtype = dt or 'f32'})) end

-- gp.time over rotated argument sets: fn(set) for the next set each call
local function time_sets(sets, fn, it)
  local i = 0
  return (gp.time(function()
    i = i % #sets + 1
    fn(sets[i])
  end, it or KERNEL_IT))
end

local function fmt_n(n)
  if n >= 2 ^ 20 and n % 2 ^ 20 == 0 then return (n / 2 ^ 20) .. 'M' end
  if n >= 1024 and n % 1024 == 0 then return (n / 1024) .. 'K' end
  return tostring(n)
end

-- resolve 'gp.nn.MoE' to its value (nil when any part is missing)
local function lookup(path)
  local v = _G
  for part in path:gmatch('[^.]+') do
    if type(v) ~= 'table' then return nil end
    v = (part == 'gp' and v == _G) and gp or v[part]
    if v == nil then return nil end
  end
  return v
end

---------------------------------------------------------------------------
-- ceilings measured in this run

local copy_gbs, gemm_tflops = nil, nil
local function ceilings()
  local n = S(128 * 2 ^ 20, 2 ^ 16)
  local src, dst = rand({n}), gp.empty({n})
  local ms = gp.time(function() gp.k.copy(dst, src) end, KERNEL_IT)
  copy_gbs = 2 * n * 4 / (ms * 1e-3) / 1e9
  src, dst = nil, nil
  release()
  if CUDA and not QUICK then
    local P = 8192
    local a, b, c = rand({P, P}, 'bf16'), rand({P, P}, 'bf16'), gp.empty({P, P}, {dtype = 'bf16'})
    local box = ffi.new('double[1]')
    if gp.C.gp_bench_cublas_gemm(box, c.c, a.c, b.c, 10) == 0 then gemm_tflops = 2 * P ^ 3 / (box[0] * 1e-3) / 1e12 end
    a, b, c = nil, nil, nil -- luacheck: ignore 311 (dropped before release() collects)
    release()
  end
end

local function of_copy(bytes, ms)
  if not copy_gbs then return nil end
  return string.format('%.2f of copy', bytes / (ms * 1e-3) / 1e9 / copy_gbs)
end

---------------------------------------------------------------------------
-- the workloads

local function ew_cases()
  local cs = {}
  for _, op in ipairs {'add', 'mul', 'exp', 'swiglu', 'rms_norm', 'softmax', 'layer_norm'} do
    for _, dt in ipairs {'f32', 'bf16'} do
      local rows = op == 'rms_norm' or op == 'softmax' or op == 'layer_norm'
      local nin = (op == 'add' or op == 'mul' or op == 'swiglu') and 2 or 1
      local bytes = (nin + 1) * NMEM * esize(dt)
      local p = {op = op, dtype = dt, n = NMEM, D = rows and DROW or nil, sets = sets_for(bytes)}
      for k, v in pairs(KERNEL_IT) do p[k] = v end
      cs[#cs + 1] = {row = op, shape = dt .. ' ' .. (rows and (NMEM / DROW) .. 'x' .. DROW or fmt_n(NMEM)), p = p,
                     bytes = bytes}
    end
  end
  return cs
end

local function run_ew(c)
  local p = c.p
  local shape = p.D and {p.n / p.D, p.D} or {p.n}
  local D = shape[#shape]
  local w, b = rand({D}, p.dtype), rand({D}, p.dtype)
  local R = shape[1]
  local sets = {}
  for i = 1, p.sets do
    local s = {x = rand(shape, p.dtype), out = gp.empty(shape, {dtype = p.dtype})}
    if p.op == 'add' or p.op == 'mul' or p.op == 'swiglu' then s.y = rand(shape, p.dtype) end
    if p.D then s.mean, s.rstd = gp.empty({R}), gp.empty({R}) end
    sets[i] = s
  end
  local k = gp.k
  local f = ({
    add = function(s) k.add(s.out, s.x, s.y) end,
    mul = function(s) k.mul(s.out, s.x, s.y) end,
    exp = function(s) k.exp(s.out, s.x) end,
    swiglu = function(s) k.swiglu(s.out, s.x, s.y) end,
    rms_norm = function(s) k.rms_norm(s.out, s.rstd, s.x, w, 1e-5) end,
    softmax = function(s) k.softmax(s.out, s.x) end,
    layer_norm = function(s) k.layer_norm(s.out, s.mean, s.rstd, s.x, w, b, 1e-5) end,
  })[p.op]
  local ms = time_sets(sets, f, p)
  return ms, of_copy(c.bytes, ms)
end

local function mm_cases()
  local n = S(4096, 64)
  local bytes = 3 * n * n * 2
  local p = {dtype = 'bf16', m = n, n = n, k = n, sets = sets_for(bytes)}
  for k, v in pairs(KERNEL_IT) do p[k] = v end
  return {{row = 'matmul', shape = 'bf16 ' .. n .. '^3', p = p}}
end

local function run_mm(c)
  local p = c.p
  local sets = {}
  for i = 1, p.sets do
    sets[i] = {a = rand({p.m, p.k}, p.dtype), b = rand({p.k, p.n}, p.dtype), o = gp.empty({p.m, p.n}, {dtype = p.dtype})}
  end
  local ms = time_sets(sets, function(s) gp.k.matmul(s.o, s.a, s.b) end, p)
  local tf = 2 * p.m * p.n * p.k / (ms * 1e-3) / 1e12
  return ms, gemm_tflops and string.format('%.0f TFLOP/s, %.2f of GEMM peak', tf, tf / gemm_tflops) or
    string.format('%.3g TFLOP/s', tf)
end

local function ce_cases()
  local N, V = S(2048, 16), S(50304, 1000)
  local cs = {}
  for _, dt in ipairs {'bf16', 'f32'} do
    local bytes = 2 * N * V * esize(dt)
    local p = {dtype = dt, n = N, v = V, sets = sets_for(bytes)}
    for k, v in pairs(LOSS_IT) do p[k] = v end
    cs[#cs + 1] = {row = 'cross_entropy fwd+bwd', shape = dt .. ' ' .. N .. 'x' .. V, p = p, bytes = bytes}
  end
  -- rows of 16 KB (held on chip by blocks of 128 threads) and GPT-2's 50257 columns (rows off a 16-byte boundary)
  for _, nv in ipairs {{S(8192, 16), S(8192, 1000)}, {S(8192, 16), S(50257, 1001)}} do
    local bytes = 2 * nv[1] * nv[2] * 2
    local p = {dtype = 'bf16', n = nv[1], v = nv[2], sets = sets_for(bytes)}
    for k, v in pairs(LOSS_IT) do p[k] = v end
    cs[#cs + 1] = {row = 'cross_entropy fwd+bwd', shape = 'bf16 ' .. nv[1] .. 'x' .. nv[2], p = p, bytes = bytes}
  end
  -- Llama 3's vocabulary (issue 24): rows split over a cluster of blocks
  local N3, V3 = S(4096, 16), S(128256, 1000)
  local b3 = 2 * N3 * V3 * 2
  local p3 = {dtype = 'bf16', n = N3, v = V3, sets = sets_for(b3)}
  for k, v in pairs(LOSS_IT) do p3[k] = v end
  cs[#cs + 1] = {row = 'cross_entropy fwd+bwd', shape = 'bf16 ' .. N3 .. 'x' .. V3, p = p3, bytes = b3}
  return cs
end

-- autograd's path: gp.cross_entropy records the fused fwd+bwd kernel, backward scales dlogits
local function run_ce(c)
  local p = c.p
  local sets = {}
  for i = 1, p.sets do
    sets[i] = {logits = gp.randn({p.n, p.v}):to(p.dtype):requires_grad(), t = gp.randint(0, p.v, {p.n})}
  end
  local ms = time_sets(sets, function(s)
    s.logits.grad = nil
    gp.cross_entropy(s.logits, s.t):backward()
  end, p)
  return ms, of_copy(c.bytes, ms) -- logits read, dlogits written
end

-- the distillation loss (issue 21): SmolLM2's vocabulary, 8 x 1024 rows, T = 2,
-- no hard targets (alpha 1), as the PyTorch expression
-- F.kl_div(F.log_softmax(s/T), F.log_softmax(t/T), log_target=True, reduction='batchmean') * T^2
local function distill_cases()
  local N, V = S(8 * 1024, 16), S(49152, 1000)
  local bytes = 3 * N * V * 2 -- student and teacher read once, dstudent written once (bf16)
  local p = {dtype = 'bf16', n = N, v = V, temperature = 2, sets = sets_for(bytes)}
  for k, v in pairs(LOSS_IT) do p[k] = v end
  return {{row = 'distill fwd+bwd', shape = 'bf16 ' .. N .. 'x' .. V .. ' T=2', p = p, bytes = bytes}}
end

-- autograd's path: gp.distill_loss records the fused fwd+bwd kernel, backward scales dstudent
local function run_distill(c)
  local p = c.p
  local sets = {}
  for i = 1, p.sets do
    sets[i] = {s = gp.randn({p.n, p.v}):to(p.dtype):requires_grad(), t = gp.randn({p.n, p.v}):to(p.dtype)}
  end
  local dopts = {temperature = p.temperature}
  local ms = time_sets(sets, function(s)
    s.s.grad = nil
    gp.distill_loss(s.s, s.t, dopts):backward()
  end, p)
  local note = of_copy(c.bytes, ms)
  return ms, string.format('%.3g GB/s', c.bytes / (ms * 1e-3) / 1e9) .. (note and ', ' .. note or '')
end

-- the fused linear cross-entropy (issue 24): Llama 3's vocabulary, 4096 tokens
-- of width 2048, bf16; h and w both take gradients, against the head product +
-- F.cross_entropy (eager: the (N, V) logits and their gradient held whole);
-- on the GPU both sides also report the step's transient peak (c.peak)
local function lce_cases()
  local N, D, V = S(4096, 64), S(2048, 32), S(128256, 1000)
  local p = {dtype = 'bf16', n = N, d = D, v = V, sets = 1, peak = CUDA}
  for k, v in pairs(TRAIN_IT) do p[k] = v end
  return {{row = 'fused linear CE fwd+bwd', shape = string.format('bf16 %dx%d V=%d', N, D, V), p = p}}
end

local function run_lce(c)
  local p = c.p
  local h = gp.randn({p.n, p.d}):to(p.dtype):requires_grad()
  local w = (gp.randn({p.v, p.d}) * 0.02):to(p.dtype):requires_grad()
  local t = gp.randint(0, p.v, {p.n})
  local function step()
    h.grad, w.grad = nil, nil
    gp.linear_cross_entropy(h, w, t):backward()
  end
  local ms = time_sets({1}, step, p)
  if p.peak then -- bytes held at the peak beyond the inputs and the gradients it leaves (torch_peer's transient_peak)
    h.grad, w.grad = nil, nil
    release()
    gp.sync()
    local base = gp.memory().in_use
    gp.reset_peak_memory()
    step()
    gp.sync()
    c.peak = gp.memory().peak - base - (h:numel() + w:numel()) * esize(p.dtype)
  end
  local tf = 6 * p.n * p.d * p.v / (ms * 1e-3) / 1e12 -- the three products
  local chunk = math.max(1, math.min(p.n, math.floor(2 ^ 28 / (p.v * 2))))
  return ms, string.format('%.3g TFLOP/s%s; logits scratch %.3g MB (whole: %.3g MB)', tf,
    gemm_tflops and string.format(', %.2f of GEMM peak', tf / gemm_tflops) or '', chunk * p.v * 2 / 2 ^ 20,
    p.n * p.v * 2 / 2 ^ 20)
end

-- GPT-2 small (124M parameters) and the default train_gpt.lua config (with the
-- vocabulary of 51 that data/corpus.txt's bytes gave; train_gpt's default is now
-- --vocab printable, 97: V51 keeps the rows comparable with BENCHMARKS.md)
local GPT2 = S({vocab = 50304, block = 1024, n_embd = 768, n_layer = 12, n_head = 12, batch = 8},
               {vocab = 64, block = 32, n_embd = 48, n_layer = 2, n_head = 2, batch = 2})
local GPT2_NAME = S('GPT-2 small', 'tiny GPT')
local SMALL = S({vocab = 51, block = 64, n_embd = 128, n_layer = 4, n_head = 4, batch = 16},
                {vocab = 51, block = 16, n_embd = 32, n_layer = 1, n_head = 2, batch = 2})

-- the Llama-shaped model of issue 24: learned positions, RMSNorm, SwiGLU, no
-- biases, heads of 128, Llama 2's vocabulary (the head tied, as GPT-2's)
local LLAMA = S({vocab = 32000, block = 2048, n_embd = 1024, n_layer = 8, n_head = 8, batch = 4, mlp = 'swiglu',
                 mlp_hidden = 2816, norm = 'rms', bias = false},
                {vocab = 64, block = 32, n_embd = 64, n_layer = 2, n_head = 2, batch = 2, mlp = 'swiglu',
                 mlp_hidden = 96, norm = 'rms', bias = false})

local function gpt_model(c)
  return gp.nn.GPT {vocab_size = c.vocab, block_size = c.block, n_embd = c.n_embd, n_layer = c.n_layer,
                    n_head = c.n_head, dropout = 0, mlp = c.mlp, mlp_hidden = c.mlp_hidden, norm = c.norm,
                    bias = c.bias}
end

-- the dense bf16 matrix-product peak of this GPU (a 8192^3 product, once a
-- run): the denominator of the model FLOP utilization; the higher of
-- gp.matmul's and cuBLAS's own (the ceilings line), which can differ by 10-25%
-- on an H200 (clocks under load)
local gemm_peak
local function peak_tflops()
  if not gemm_peak then
    local n = S(8192, 64)
    local a, b = gp.randn({n, n}):to('bf16'), gp.randn({n, n}):to('bf16')
    local ms = gp.time(function() gp.matmul(a, b) end, KERNEL_IT)
    gemm_peak = math.max(2 * n ^ 3 / ms / 1e9, gemm_tflops or 0)
  end
  return gemm_peak
end

local function adamw_cases()
  local shapes = {}
  local model = gpt_model(GPT2)
  for i, q in ipairs(model:parameters()) do shapes[i] = q.shape end
  model = nil -- luacheck: ignore 311 (dropped before release() collects)
  release()
  local n = 0
  for _, s in ipairs(shapes) do
    local e = 1
    for _, d in ipairs(s) do e = e * d end
    n = n + e
  end
  local p = {shapes = shapes, compile = false}
  for k, v in pairs(KERNEL_IT) do p[k] = v end
  -- p, m, v read and written, g read: 28 bytes per f32 parameter
  return {{row = 'AdamW step', shape = string.format('%s, %d tensors, %.1fM f32', GPT2_NAME, #shapes, n / 1e6), p = p,
           bytes = 28 * n}}
end

local function run_adamw(c)
  local params = {}
  for i, s in ipairs(c.p.shapes) do params[i] = gp.randn(s) * 0.02 end
  local opt = gp.optim.AdamW(params, {lr = 3e-4, betas = {0.9, 0.95}, weight_decay = 0.1})
  opt:zero_grad()
  for _, q in ipairs(params) do gp.k.rand_normal(q.grad, 0, 1) end
  local ms = gp.time(function() opt:step() end, c.p)
  return ms, of_copy(c.bytes, ms)
end

local function train_cases()
  local cs = {}
  for _, e in ipairs {{'train_gpt default step', SMALL, false}, {'train_gpt default step, CUDA graph', SMALL, false, true},
                      {GPT2_NAME .. ' bf16 step', GPT2, true}, {GPT2_NAME .. ' bf16 step, CUDA graph', GPT2, true, true},
                      {'Llama-shaped bf16 step', LLAMA, true, false, true},
                      {'Llama-shaped bf16 step, CUDA graph', LLAMA, true, true, true}} do
    local p = {clip = 1.0, bf16 = e[3], graph = e[4], mfu = e[5]}
    for k, v in pairs(e[2]) do p[k] = v end
    for k, v in pairs(TRAIN_IT) do p[k] = v end
    cs[#cs + 1] = {row = e[1], unit = 'ms/step', scale = 1, p = p,
                   shape = string.format('L%d d%d h%d B%d T%d V%d%s', p.n_layer, p.n_embd, p.n_head, p.batch, p.block,
                     p.vocab, p.mlp and string.format(' %s %d, %s norm', p.mlp, p.mlp_hidden, p.norm) or '')}
  end
  return cs
end

-- one step of train_gpt.lua: zero_grad, forward, backward, clip on the device, AdamW
local function run_train(c)
  local p = c.p
  gp.manual_seed(0)
  local model = gpt_model(p)
  if p.bf16 then gp.optim.mixed_precision(model) end
  local graph = p.graph and gp.device() == 'cuda'
  local opt = gp.optim.AdamW(model, {lr = 3e-4, betas = {0.9, 0.95}, weight_decay = 0.1, device_hyper = graph})
  local x, y = gp.randint(0, p.vocab, {p.batch, p.block}), gp.randint(0, p.vocab, {p.batch, p.block})
  model:train()
  local function step()
    opt:zero_grad()
    local _, loss = model(x, y)
    loss:backward()
    if p.clip > 0 then gp.optim.clip_grad_norm(opt, p.clip) end
    opt:step()
  end
  local ms
  if graph then -- as train_gpt.lua does: one eager step, then the captured step replayed
    step()
    local g = opt:capture(step)
    ms = gp.time(function() opt:prepare_replay(); g:replay() end, p)
    g:free()
  else
    ms = gp.time(step, p)
  end
  local extra = string.format('%.1fK tok/s', p.batch * p.block / ms)
  if p.mfu then
    -- model FLOPs a token: 6 x the parameters that multiply (all but the
    -- position table; the tied head counted once) + the causal attention's
    -- 6 L T d (forward 2 x 2 L T d / 2, backward twice that)
    local n = 0
    for _, q in ipairs(model:parameters()) do n = n + q:numel() end
    n = n - p.block * p.n_embd
    local tf = (6 * n + 6 * p.n_layer * p.block * p.n_embd) * p.batch * p.block / ms / 1e9
    extra = string.format('%s, %.0f TFLOP/s, MFU %.0f%% of %.0f', extra, tf, 100 * tf / peak_tflops(), peak_tflops())
  end
  return ms, extra
end

-- attention (B, H, T, hd), causal
local ATT = S({b = 8, h = 12, t = 1024, hd = 64}, {b = 1, h = 2, t = 16, hd = 64})
local function att_cases(backward)
  local p = {dtype = 'bf16', backward = backward}
  for k, v in pairs(ATT) do p[k] = v end
  p.sets = sets_for(4 * p.b * p.h * p.t * p.hd * 2)
  for k, v in pairs(KERNEL_IT) do p[k] = v end
  return {{row = backward and 'attention fwd+bwd' or 'attention fwd', p = p,
           shape = string.format('bf16 B%d H%d T%d hd%d causal', p.b, p.h, p.t, p.hd)}}
end

local function att_flops(p) return (p.backward and 3.5 or 1) * 2 * p.b * p.h * p.t * p.t * p.hd end -- causal: half of 4BHT^2hd

local function run_att(c)
  local p = c.p
  local sets = {}
  for i = 1, p.sets do
    local s = {}
    for _, n in ipairs {'q', 'k', 'v'} do
      s[n] = gp.randn({p.b, p.h, p.t, p.hd}):to(p.dtype)
      if p.backward then s[n]:requires_grad() end
    end
    s.dout = gp.randn({p.b, p.h, p.t, p.hd}):to(p.dtype)
    sets[i] = s
  end
  local ms = time_sets(sets, function(s)
    if p.backward then
      s.q.grad, s.k.grad, s.v.grad = nil, nil, nil
      gp.attention(s.q, s.k, s.v, {causal = true}):backward(s.dout)
    else
      gp.attention(s.q, s.k, s.v, {causal = true})
    end
  end, p)
  return ms, string.format('%.3g TFLOP/s', att_flops(p) / (ms * 1e-3) / 1e12)
end

-- one decoding step: a query per sequence against a KV cache of S tokens
local DEC = S({b = 8, h = 12, s = 4096, hd = 64}, {b = 2, h = 2, s = 32, hd = 64})
local function dec_cases()
  local p = {dtype = 'bf16'}
  for k, v in pairs(DEC) do p[k] = v end
  p.sets = sets_for(2 * p.b * p.h * p.s * p.hd * 2)
  for k, v in pairs(KERNEL_IT) do p[k] = v end
  return {{row = 'decode attention', p = p, bytes = 2 * p.b * p.h * p.s * p.hd * 2,
           shape = string.format('bf16 B%d H%d S%d hd%d', p.b, p.h, p.s, p.hd)}}
end

local function run_dec(c)
  local p = c.p
  local sets = {}
  for i = 1, p.sets do
    sets[i] = {q = gp.randn({p.b, p.h, 1, p.hd}):to(p.dtype), k = gp.randn({p.b, p.h, p.s, p.hd}):to(p.dtype),
               v = gp.randn({p.b, p.h, p.s, p.hd}):to(p.dtype)}
  end
  local ms = time_sets(sets, function(s) gp.attention_decode(s.q, s.k, s.v, p.s) end, p)
  return ms, of_copy(c.bytes, ms) -- the KV cache read once
end

local MOE = S({tokens = 8192, d = 768, hidden = 3072, experts = 8, top_k = 2}, {tokens = 32, d = 16, hidden = 32,
  experts = 4, top_k = 2})
local function moe_cases()
  local p = {dtype = 'bf16', sets = 1}
  for k, v in pairs(MOE) do p[k] = v end
  for k, v in pairs(KERNEL_IT) do p[k] = v end
  return {{row = 'MoE layer fwd', p = p, shape = string.format('bf16 N%d d%d h%d E%d top%d', p.tokens, p.d, p.hidden,
    p.experts, p.top_k)}}
end

local function run_moe(c)
  local p = c.p
  local moe = gp.nn.MoE {d_model = p.d, d_hidden = p.hidden, n_experts = p.experts, top_k = p.top_k, dtype = p.dtype}
  local x = gp.randn({p.tokens, p.d}):to(p.dtype)
  local ms = gp.no_grad(function() return (gp.time(function() moe(x) end, p)) end)
  return ms
end

local DIV = S({prompts = 64, samples = 16, d = 768}, {prompts = 2, samples = 4, d = 8})
local function div_cases()
  local p = {dtype = 'bf16', sets = 1}
  for k, v in pairs(DIV) do p[k] = v end
  for k, v in pairs(KERNEL_IT) do p[k] = v end
  return {{row = 'diversity', p = p, shape = string.format('bf16 P%d n%d d%d', p.prompts, p.samples, p.d)}}
end

local function run_div(c)
  local p = c.p
  local e = gp.randn({p.prompts, p.samples, p.d}):to(p.dtype)
  local out = gp.empty({p.prompts}, {dtype = p.dtype})
  local ms = gp.time(function() gp.k.set_diversity(out, e, 1e-8) end, p)
  return ms
end

-- the Titans memory update over a sequence (gp.titans.memory_scan), forward + backward, f32
local TITANS = S({batch = 4, heads = 8, seq = 4096, head_dim = 40, chunk = 512}, {batch = 1, heads = 2, seq = 64,
  head_dim = 8, chunk = 16})
local function titans_cases()
  local r = {}
  for _, kind in ipairs {'linear', 'mlp'} do
    local p = {kind = kind, hidden = 4 * TITANS.head_dim, compile = false}
    for k, v in pairs(TITANS) do p[k] = v end
    for k, v in pairs(TRAIN_IT) do p[k] = v end
    r[#r + 1] = {row = 'Titans step', p = p, shape = string.format('%s memory f+b N%d T%d d%d c%d', kind,
      p.batch * p.heads, p.seq, p.head_dim, p.chunk)}
  end
  return r
end

local function run_titans(c)
  local p = c.p
  local N, Tn, d, b, h = p.batch * p.heads, p.seq, p.head_dim, p.chunk, p.hidden
  local nc = Tn / b
  gp.manual_seed(0)
  local k, q = gp.titans.l2norm(gp.randn {N, Tn, d}), gp.titans.l2norm(gp.randn {N, Tn, d})
  local v, theta = gp.randn {N, Tn, d}, gp.rand {N, Tn} * 0.2
  local eta, alpha = gp.rand {N, nc} * 0.5 + 0.45, gp.rand {N, nc} * 0.05
  local init = p.kind == 'linear' and {M = gp.randn {N, d, d} / math.sqrt(d)} or
    {W1 = gp.randn {N, h, d} / math.sqrt(d), W2 = gp.randn {N, d, h} / math.sqrt(h)}
  local leaves = {k, q, v, theta, eta, alpha}
  for _, w in pairs(init) do leaves[#leaves + 1] = w end
  for _, t in ipairs(leaves) do t:requires_grad() end
  local function per_chunk(t) return t:reshape {N, nc, 1}:expand {N, nc, b}:reshape {N, Tn} end
  local ms = gp.time(function()
    local y, st = gp.titans.memory_scan {kind = p.kind, init = init, k = k, v = v, q = q, theta = theta,
                                         eta = per_chunk(eta), alpha = per_chunk(alpha), chunk = b}
    local loss = (y * y):sum()
    for _, n in ipairs(gp.titans.NAMES[p.kind]) do loss = loss + (st[n] * st[n]):sum() end
    loss:backward()
    for _, t in ipairs(leaves) do t:zero_grad() end
  end, p)
  return ms, string.format('%.0f tokens/s', p.batch * Tn / ms * 1e3)
end

-- one polychromic fine-tuning step (generation, diversity, PPO update) of a small GPT with LoRA
local POLY = S({prompts = 32, samples = 4, d = 128, iters = 5}, {prompts = 2, samples = 2, d = 16, iters = 1})
local function poly_cases()
  local p = {}
  for k, v in pairs(POLY) do p[k] = v end
  return {{row = 'polychromic step', p = p, shape = string.format('P%d n%d d%d', p.prompts, p.samples, p.d)}}
end

local function run_poly(c)
  local p, P = c.p, gp.polychromic
  local task = P.sum_task {max = 12}
  local tok = P.char_tokenizer(task.chars)
  local m = gp.nn.GPT {vocab_size = tok.vocab_size, block_size = 12, n_embd = p.d, n_layer = 2, n_head = 2}
  gp.lora.apply(m, {rank = 8})
  local fo = {objective = 'poly', steps = 1, n = p.samples, prompts_per_step = p.prompts, max_new = 6, seed = 1}
  P.finetune(m, tok, task, fo)
  gp.sync()
  local t0 = gp.train.now()
  for _ = 1, p.iters do P.finetune(m, tok, task, fo) end
  gp.sync()
  return (gp.train.now() - t0) * 1e3 / p.iters
end

local function dispatch_cases()
  return {
    {row = 'dispatch a:add_(b)', unit = 'us/op', scale = 1e3, p = {op = 'add_', n = DISPATCH_N, compile = false},
     shape = '1 element x ' .. fmt_n(DISPATCH_N)},
    {row = 'dispatch gp.k.add_s', unit = 'us/op', scale = 1e3, p = {op = 'add_s', n = DISPATCH_N, compile = false},
     shape = '1 element x ' .. fmt_n(DISPATCH_N)},
  }
end

-- host time per op of n tiny in-place adds issued from Lua, then one sync (ms per op)
local function run_dispatch(c)
  local n = c.p.n
  local a, b = gp.zeros({1}), gp.ones({1})
  local f
  if c.p.op == 'add_' then f = function() a:add_(b) end else f = function() gp.k.add_s(a, a, 1) end end
  for _ = 1, math.min(n, 1000) do f() end
  gp.sync()
  local t0 = gp.train.now()
  if c.p.op == 'add_' then
    for _ = 1, n do a:add_(b) end
  else
    local add_s = gp.k.add_s
    for _ = 1, n do add_s(a, a, 1) end
  end
  gp.sync()
  return (gp.train.now() - t0) * 1e3 / n
end

local WORKLOADS = {
  {name = 'elementwise', cases = ew_cases, run = run_ew},
  {name = 'matmul', cases = mm_cases, run = run_mm},
  {name = 'cross_entropy', cases = ce_cases, run = run_ce},
  {name = 'distill', needs = {'gp.distill_loss'}, cases = distill_cases, run = run_distill},
  {name = 'linear_cross_entropy', needs = {'gp.linear_cross_entropy'}, cases = lce_cases, run = run_lce},
  {name = 'adamw', needs = {'gp.optim.AdamW'}, cases = adamw_cases, run = run_adamw},
  {name = 'train', needs = {'gp.nn.GPT'}, cases = train_cases, run = run_train},
  {name = 'attention', needs = {'gp.attention'}, run = run_att,
   cases = function() return {att_cases(false)[1], att_cases(true)[1]} end},
  {name = 'decode', needs = {'gp.attention_decode'}, cases = dec_cases, run = run_dec},
  {name = 'moe', needs = {'gp.nn.MoE'}, cases = moe_cases, run = run_moe},
  {name = 'diversity', needs = {'gp.k.set_diversity'}, cases = div_cases, run = run_div},
  {name = 'titans', needs = {'gp.titans'}, cases = titans_cases, run = run_titans},
  {name = 'polychromic', needs = {'gp.polychromic'}, cases = poly_cases, run = run_poly},
  {name = 'dispatch', cases = dispatch_cases, run = run_dispatch},
}

---------------------------------------------------------------------------
-- the PyTorch peer

local torch_info, torch_why
if not o.torch then
  torch_why = 'no torch'
else
  local out = sh(o.python .. ' -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"')
  local ver, cu, avail = out:match('(%S+) (%S+) (%S+)$')
  if not ver then
    torch_why = 'no torch'
  elseif CUDA and avail ~= 'True' then
    torch_why = 'no torch'
    torch_info = 'torch ' .. ver .. ' cannot use the GPU'
  else
    torch_info = string.format('torch %s (CUDA %s)', ver, cu)
  end
end

local function tmpname()
  local n = os.tmpname()
  os.remove(n)
  return n
end

-- { [shape key] = {eager_ms=, compile_ms=, error=, compile_error=} } or nil, why
local function peer(name, cases)
  local cf, ef = tmpname() .. '.json', tmpname() .. '.log'
  local list = {}
  for i, c in ipairs(cases) do
    local e = {key = c.key}
    for k, v in pairs(c.p) do e[k] = v end
    list[i] = e
  end
  local f = assert(io.open(cf, 'w'))
  f:write(json.encode(list))
  f:close()
  local cmd = string.format("%s%s '%s' run %s --cases '%s' --device %s%s 2>'%s'",
    sh('command -v timeout') ~= '' and ('timeout ' .. math.floor(o.peer_timeout) .. ' ') or '', o.python, PEER, name,
    cf, DEV, COMPILE and '' or ' --no-compile', ef)
  local p = io.popen(cmd)
  local res = {}
  for line in p:lines() do
    if line:sub(1, 1) == '{' then
      local ok, v = pcall(json.decode, line)
      if ok and type(v) == 'table' and v.shape then res[v.shape] = v end
    end
  end
  local _, _, code = p:close()
  local errf = io.open(ef)
  local err = errf and errf:read('*a') or ''
  if errf then errf:close() end
  os.remove(cf)
  os.remove(ef)
  if next(res) == nil then
    local last = err:gsub('%s+$', ''):match('([^\n]*)$') or ''
    return nil, 'peer failed' .. (code and code ~= 0 and ' (exit ' .. tostring(code) .. ')' or '') .. ': ' .. last
  end
  return res
end

---------------------------------------------------------------------------
-- the run

local rows, failures, notes, peer_times = {}, 0, {}, {}
local COLS = {'workload', 'shape', 'gpush', 'unit', 'eager', 'compile', 'gpush/eager', 'gpush/compile', 'note'}
local W = {24, 34, 13, 7, 10, 10, 11, 13, 0}

local function line(cells)
  local out = {}
  for i, c in ipairs(cells) do
    c = tostring(c)
    out[i] = W[i] > 0 and c .. string.rep(' ', W[i] - #c) or c
  end
  return '| ' .. table.concat(out, ' | ') .. ' |'
end

-- a number from the peer (JSON null decodes to a table) times scale, or nil
local function scaled(v, scale) return type(v) == 'number' and v * scale or nil end

local function num(v, scale)
  if type(v) ~= 'number' then return nil end
  v = v * (scale or 1)
  if v >= 100 then return string.format('%.1f', v) end
  if v >= 1 then return string.format('%.3f', v) end
  return string.format('%.4g', v)
end

local function ratio(a, b)
  if type(a) ~= 'number' or type(b) ~= 'number' or b <= 0 then return nil end
  local r = a / b
  return string.format(r >= 0.1 and '%.2f' or '%.2g', r)
end

print(string.format('gpush %s | %s', gp.version()))
if CUDA then
  local smi = sh('nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1')
  if smi ~= '' then print('GPU: ' .. smi) end
end
print(string.format('date %s | PyTorch: %s%s', os.date('!%Y-%m-%d %H:%M UTC'), torch_info or torch_why,
  (torch_info and not COMPILE) and ' (torch.compile not run)' or ''))
if QUICK then
  print(string.format('** %s: tiny shapes, few iterations; these numbers are not a benchmark **',
    CUDA and '--quick' or 'no CUDA GPU'))
end
ceilings()
print(string.format('ceilings: copy %.1f GB/s (%s f32 gp.k.copy, bytes read + written)%s', copy_gbs,
  fmt_n(S(128 * 2 ^ 20, 2 ^ 16)),
  gemm_tflops and string.format(', bf16 GEMM 8192^3 %.0f TFLOP/s (cuBLAS called directly)', gemm_tflops) or ''))
print(string.format('times: median of %s after warm-up; ratios are gpush time / PyTorch time (below 1: gpush is faster)',
  CUDA and 'CUDA events' or 'host clock readings'))
print()
print(line(COLS))
local sep = {}
for i = 1, #COLS do sep[i] = string.rep('-', math.max(3, W[i])) end
print(line(sep))
io.stdout:flush()

local jf = o.json ~= '' and assert(io.open(o.json, 'w')) or nil

for _, w in ipairs(WORKLOADS) do
  local ok_cases, cases = pcall(w.cases)
  if not ok_cases then cases = {{row = w.name, shape = '-', p = {}, setup_error = tostring(cases)}} end
  local wanted = {}
  for _, c in ipairs(cases) do
    c.key = c.row .. ' ' .. c.shape
    if o.only == '' or w.name:find(o.only, 1, true) or c.row:find(o.only, 1, true) then wanted[#wanted + 1] = c end
  end
  local missing
  for _, path in ipairs(w.needs or {}) do
    if lookup(path) == nil then missing = path; break end
  end
  -- the gpush side of every case
  for _, c in ipairs(wanted) do
    if missing then
      c.status = 'not built yet'
      c.note = missing .. ' is nil'
    elseif c.setup_error then
      c.status, c.note = 'failed', c.setup_error
    else
      local ok, ms, note = pcall(w.run, c)
      if ok and type(ms) == 'number' then
        c.ms, c.note = ms, note
      else
        c.status, c.note = 'failed', tostring(ok and 'returned no time' or ms)
        failures = failures + 1
      end
      release()
    end
  end
  -- the PyTorch side: one call with every case that ran
  local run = {}
  for _, c in ipairs(wanted) do if c.ms then run[#run + 1] = c end end
  local res, why
  if #run > 0 then
    if torch_why then
      why = torch_why
    else
      local t = gp.train.now()
      res, why = peer(w.name, run)
      peer_times[#peer_times + 1] = string.format('%s %.0f s', w.name, gp.train.now() - t)
    end
  end
  for _, c in ipairs(wanted) do
    local r = res and res[c.key]
    local scale = c.scale or 1e3
    local unit = c.status and '-' or c.unit or 'us'
    local ours = c.status or num(c.ms, scale)
    local eager, comp, re, rc
    if c.status then
      eager, comp, re, rc = '-', '-', '-', '-'
    elseif r then
      eager = num(r.eager_ms, scale) or 'failed'
      comp = num(r.compile_ms, scale) or (r.compile_error == 'skipped' and 'skipped' or 'failed')
      re = ratio(c.ms, r.eager_ms) or '-'
      rc = ratio(c.ms, r.compile_ms) or '-'
      if r.error then notes[#notes + 1] = c.key .. ': PyTorch eager: ' .. r.error end
      if r.compile_error and r.compile_error ~= 'skipped' then
        notes[#notes + 1] = c.key .. ': torch.compile: ' .. r.compile_error
      end
    else
      local short = why == 'no torch' and 'no torch' or 'no peer'
      eager, comp, re, rc = short, short, short, short
      if res then why = 'the PyTorch peer printed no line for it (timed out?)' end
      if why and why ~= 'no torch' then notes[#notes + 1] = c.key .. ': ' .. why end
    end
    local note = c.note or ''
    if c.peak and r then -- the transient peaks, both sides
      local function mib(b) return type(b) == 'number' and string.format('%.0f MiB', b / 2 ^ 20) or '-' end
      note = string.format('%s; transient peak gpush %s, eager %s, compile %s%s', note, mib(c.peak), mib(r.eager_peak),
        mib(r.compile_peak), type(r.compile_peak) == 'number' and c.peak > 0 and
        string.format(' (%.1fx less than compile)', r.compile_peak / c.peak) or '')
    end
    if c.status == 'failed' then
      notes[#notes + 1] = c.key .. ': gpush: ' .. note
      note = 'see below'
    end
    print(line {c.row, c.shape, ours, unit, eager, comp, re, rc, note})
    io.stdout:flush()
    rows[#rows + 1] = c
    if jf then
      jf:write(json.encode {workload = w.name, row = c.row, shape = c.shape, unit = unit, gpush = c.ms and c.ms * scale,
        status = c.status, eager = r and scaled(r.eager_ms, scale), compile = r and scaled(r.compile_ms, scale),
        peak = c.peak, eager_peak = r and scaled(r.eager_peak, 1), compile_peak = r and scaled(r.compile_peak, 1),
        note = c.note}, '\n')
    end
  end
end
if jf then jf:close() end

print()
for _, n in ipairs(notes) do print('note: ' .. n) end
if #peer_times > 0 then print('PyTorch peer calls: ' .. table.concat(peer_times, ', ')) end
print(string.format('%d rows, %d failed; elapsed %.1f s%s', #rows, failures, gp.train.now() - T0,
  QUICK and '' or ' (budget 600 s)'))
if failures > 0 then os.exit(1) end
