-- The generic kernel test: for every registry entry, random inputs built from
-- its argument spec (odd and large sizes, broadcast and non-contiguous
-- views, every dtype the spec allows), outputs poisoned first.
--  * every device: the kernel runs twice with different poison; equal results
--    prove every element was written;
--  * with a GPU: the CUDA result matches the CPU reference by relative norm
--    (f32 1e-5, f16 2e-3, bf16 1e-2, integers exactly).
local T = require 'lib'
local gp = require 'gpush'
local kernels = require 'gpush.core.kernels'

-- f64 is CPU-only: its cases run the CPU reference and skip the GPU
local FLOATS = {'f32', 'bf16', 'f16', 'f64'}
local ALL = {'f32', 'bf16', 'f16', 'i32', 'i64', 'u8', 'f64'}
local TOL = {f32 = 1e-5, bf16 = 1e-2, f16 = 2e-3, i32 = 0, i64 = 0, u8 = 0}
local SCALARS = {lo = 3, hi = 17, std = 1.5, mean = 0.5, value = 2.5, s = 1.5, correction = 0}
SCALARS.ignore_index = 1 -- cross-entropy: rows whose target is 1 are ignored

-- per-kernel symbol sizes where the case's size does not fit (function of the
-- case; symbols not returned get case.sym)
local SYMS = {}
local function gather_syms(case)
  if case.big then return {A = 1000, B = 37, K = 11, C = 3} end
  return {B = case.sym + 3}
end
SYMS.gather, SYMS.index_select, SYMS.scatter_add = gather_syms, gather_syms, gather_syms
SYMS.topk = function(case) return {K = math.max(1, math.min(case.sym - 2, 64))} end
-- write_at: K new entries at a position P values leave room for (pos in [0, C - K])
SYMS.write_at = function(case)
  if case.big then return {B = 2, H = 3, C = 1000, K = 7, D = 64, P = 994} end
  local c = case.sym + 2
  return {C = c, K = 2, P = c - 1}
end

-- the out shape for each size case; symbols get these values
local CASES = {
  {name = '1', shape = {1}, sym = 1},
  {name = '7', shape = {7}, sym = 7},
  {name = '3x5x7', shape = {3, 5, 7}, sym = 5},
  {name = '1000003', shape = {1000003}, sym = 1000, big = true},
}

-- Per-kernel or per-family hooks (looked up by k.name, then k.family):
--  KCASES: the size cases, when the default ones do not fit the spec; a case's
--    `syms` gives sizes to named symbols (others get `sym`), `shape` gives the
--    leading dims that `*` stands for (all but its last entry), `tol` overrides
--    the tolerance by dtype for that case;
--  KTOL: tolerances by dtype (e.g. looser f32 after long reductions).
local KCASES, KTOL = {}, {}
-- reduce: x is (A, B, C), B reduced; C == 1 is the contiguous-row path, C > 1 the strided one
KCASES.reduce = {
  {name = '1x1x1', shape = {1}, syms = {A = 1, B = 1, C = 1}},
  {name = '7x7x1', shape = {1}, syms = {A = 7, B = 7, C = 1}},
  {name = '3x5x7', shape = {1}, syms = {A = 3, B = 5, C = 7}},
  {name = '5x1000x1', shape = {1}, syms = {A = 5, B = 1000, C = 1}},
  {name = '2x300x40', shape = {1}, syms = {A = 2, B = 300, C = 40}},
  {name = '1x1000003x1', shape = {1}, syms = {A = 1, B = 1000003, C = 1}, big = true},
  {name = '1x20011x50', shape = {1}, syms = {A = 1, B = 20011, C = 50}, big = true},
}
KTOL.reduce = {f32 = 1e-4}
-- distill: a kind (and T, alpha) per case; rows up to 128K wide (the kernel streams them)
KCASES.distill = {
  {name = '1x1 forward_kl', shape = {1}, syms = {N = 1, V = 1}, scalars = {kind = 0}},
  {name = '7x7 reverse_kl', shape = {1}, syms = {N = 7, V = 7}, scalars = {kind = 1}},
  {name = '5x1000 jsd', shape = {1}, syms = {N = 5, V = 1000}, scalars = {kind = 2}},
  {name = '5x1000 T=1 alpha=1', shape = {1}, syms = {N = 5, V = 1000}, scalars = {kind = 0, temperature = 1, alpha = 1}},
  {name = '3x64 alpha=0', shape = {1}, syms = {N = 3, V = 64}, scalars = {kind = 1, alpha = 0}},
  {name = '2x131072 jsd', shape = {1}, syms = {N = 2, V = 131072}, scalars = {kind = 2}, big = true},
  {name = '2x50305 forward_kl', shape = {1}, syms = {N = 2, V = 50305}, scalars = {kind = 0}, big = true},
}
KTOL.distill = {f32 = 1e-4}
-- rows: [*, D] with warp rows, block rows (vector and scalar), and one row too long for registers
KCASES.rows = {
  {name = '1', shape = {1}, syms = {D = 1}},
  {name = '7', shape = {7}, syms = {D = 7}},
  {name = '3x5x7', shape = {3, 5, 7}, syms = {D = 7}},
  {name = '4x1000', shape = {4, 0}, syms = {D = 1000}},
  {name = '3x1003', shape = {3, 0}, syms = {D = 1003}},
  {name = '2x8200', shape = {2, 0}, syms = {D = 8200}},
  {name = '1000003', shape = {1000003}, syms = {D = 1000003}, big = true, tol = {f32 = 1e-4}},
}
KCASES.add_rms_norm, KCASES.bias_gelu = KCASES.rows, KCASES.rows
-- norm backward: the rows cases, then accumulate = 1 (dw, db are read and
-- written: random values added to, the sums over rows, warp, block and long rows)
local NORM_BWD = {}
for i, c in ipairs(KCASES.rows) do NORM_BWD[i] = c end
for _, c in ipairs {
  {name = '7 accumulate', shape = {7}, syms = {D = 7}},
  {name = '3x5x7 accumulate', shape = {3, 5, 7}, syms = {D = 7}},
  {name = '300x1003 accumulate', shape = {300, 0}, syms = {D = 1003}},
  {name = '2x8200 accumulate', shape = {2, 0}, syms = {D = 8200}},
} do
  c.scalars = {accumulate = 1}
  NORM_BWD[#NORM_BWD + 1] = c
end
KCASES.layer_norm_backward, KCASES.rms_norm_backward, KCASES.rms_norm_backward_add = NORM_BWD, NORM_BWD, NORM_BWD
KCASES.layer_norm_backward_add = NORM_BWD
-- optimizer updates: no 1-element case, where m' = b1 m + (1 - b1) g can cancel
-- and make f32 against double meaningless; f32 updates carry ~1e-6 relative error
KCASES.optim = {
  {name = '7', shape = {7}, sym = 7},
  {name = '3x5x7', shape = {3, 5, 7}, sym = 5},
  {name = '1000003', shape = {1000003}, sym = 1000, big = true},
}
KTOL.optim = {f32 = 1e-4}
-- per kernel (by name or family): size cases, and scalars that differ from SCALARS.
-- A case's syms give symbols their own sizes; its shape gives only the * dims
-- (all but its last); variant fixes the layout (2: transposed views).
local MM_CASES = {
  {name = '1', shape = {1}, syms = {M = 1, K = 1, N = 1}},
  {name = '7', shape = {1}, sym = 7, variant = 2},
  {name = '33x65x17', shape = {1}, syms = {M = 33, K = 65, N = 17}, variant = 0},
  {name = '33x65x17 transposed', shape = {1}, syms = {M = 33, K = 65, N = 17}, variant = 2},
  {name = 'batch 3 33x65x17', shape = {3, 1}, syms = {M = 33, K = 65, N = 17}, variant = 0},
  {name = 'batch 3 transposed', shape = {3, 1}, syms = {M = 17, K = 33, N = 65}, variant = 2},
  {name = 'batch 2x3 7x9x5', shape = {2, 3, 1}, syms = {M = 7, K = 9, N = 5}},
  {name = 'm=1 (gemv)', shape = {1}, syms = {M = 1, K = 300, N = 257}},
  {name = 'n=1 (gemv) transposed', shape = {1}, syms = {M = 129, K = 64, N = 1}, variant = 2},
  {name = '256x384x320', shape = {1}, syms = {M = 256, K = 384, N = 320}, big = true, variant = 0},
}
KCASES.matmul = MM_CASES
-- per kernel (by name or family): scalars that differ from SCALARS
local SCALARS_FOR = {matmul = {alpha = 1.25, beta = 0}} -- beta = 0: out is written, not read
-- sampling: rows N of V logits (warp-, block- and long-row block sizes), history of L ids
KCASES.sample = {
  {name = '1x1', shape = {1}, syms = {N = 1, V = 1, L = 1}},
  {name = '3x7', shape = {1}, syms = {N = 3, V = 7, L = 5}},
  {name = '5x1000', shape = {1}, syms = {N = 5, V = 1000, L = 40}},
  {name = '4x9000', shape = {1}, syms = {N = 4, V = 9000, L = 64}},
  {name = '2x50304', shape = {1}, syms = {N = 2, V = 50304, L = 100}, big = true},
}
SCALARS_FOR.sample = {temperature = 0.8, top_k = 0, top_p = 0.9, min_p = 0.01}
SCALARS_FOR.repetition_penalty = {penalty = 1.3}
-- per kernel: a custom CUDA-vs-CPU check of output j (returns nil or a message),
-- for outputs that float rounding may legitimately change: a sampled token
-- flips when u lands within rounding of a cumulative-mass boundary, and the
-- top-p cut may keep one more or one less token of tiny mass
local KCHECK = {}
KCHECK.sample = function(j, g, c, tol)
  if j == 1 then
    local a, b, diff = g:totable(), c:totable(), 0
    for i = 1, #a do if a[i] ~= b[i] then diff = diff + 1 end end
    if diff > math.max(1, #a / 10) then return string.format('%d of %d tokens differ', diff, #a) end
    return nil
  end
  if T.relnorm(g, c) <= tol then return nil end
  local a, b = T.flat(g), T.flat(c)
  local big = 0
  for i = 1, #a do if math.abs(a[i] - b[i]) > math.max(1e-3, 4 * tol * math.abs(b[i])) then big = big + 1 end end
  if big > 0 then return string.format('probs: %d elements differ by more than 1e-3', big) end
  return nil
end
-- rope_kv_quant_at: the GPU turns k in f32 sincos, the CPU in double, so a
-- code may land one step over (two's complement: 0 and 255 are neighbours);
-- q and the scales by tolerance
KCHECK.rope_kv_quant_at = function(_, g, c, tol)
  if g.dtype ~= 'u8' then
    local r = T.relnorm(g, c)
    return r > math.max(tol, 1e-5) and string.format('relative norm %g', r) or nil
  end
  local a, b, diff = T.flat(g), T.flat(c), 0
  for i = 1, #a do
    local d = math.abs(a[i] - b[i])
    if d ~= 0 then
      if d ~= 1 and d ~= 255 then return string.format('code %d: %d against %d', i, a[i], b[i]) end
      diff = diff + 1
    end
  end
  if diff > math.max(2, #a / 100) then return string.format('%d of %d codes differ', diff, #a) end
  return nil
end
-- attention: q (B, H, T, D) over k, v (B, H/G, S, D) (S >= T when causal: the
-- last T positions; G query heads to a KV head, 1 unless the case names G),
-- decode over a cache of C (attn_decode_q: u8 codes, fmt 1 int8 unless the
-- case's scalars say 2, fp8); a case's `scalars` set scale,
-- window, n_global, causal, fmt (SCALARS_FOR wins over them). attn_bwd gets random
-- out and lse (positive, `+`): a small scale keeps exp(s - lse) and the
-- gradients inside f16's range.
KCASES.attention = {
  {name = '1x2x7x7 d64', shape = {1}, syms = {B = 1, H = 2, T = 7, S = 7, D = 64, C = 9}},
  {name = '2x1x33x50 d64 window 16 global 3', shape = {1}, syms = {B = 2, H = 1, T = 33, S = 50, D = 64, C = 50},
    scalars = {window = 16, n_global = 3}},
  {name = '1x2x1x70 d128 scale 0.3 (fp8)', shape = {1}, syms = {B = 1, H = 2, T = 1, S = 70, D = 128, C = 70},
    scalars = {scale = 0.3, fmt = 2}},
  {name = '1x1x45x20 d64 not causal', shape = {1}, syms = {B = 1, H = 1, T = 45, S = 20, D = 64, C = 20},
    scalars = {causal = 0}},
  {name = '1x1x150x200 d128 window 70 global 5', shape = {1}, syms = {B = 1, H = 1, T = 150, S = 200, D = 128, C = 300},
    scalars = {window = 70, n_global = 5}, big = true},
  {name = '2x2x200x200 d64', shape = {1}, syms = {B = 2, H = 2, T = 200, S = 200, D = 64, C = 700}, big = true},
  -- grouped-query attention: k, v (and dk, dv, the caches) have H / G heads
  {name = 'G 2: 2x4(2)x33x50 d64 window 16 global 3', shape = {1},
    syms = {B = 2, H = 4, G = 2, T = 33, S = 50, D = 64, C = 50}, scalars = {window = 16, n_global = 3}},
  {name = 'G 3 (9:3, SmolLM2): 1x9(3)x70x70 d64', shape = {1}, syms = {B = 1, H = 9, G = 3, T = 70, S = 70, D = 64, C = 80}},
  {name = 'G 4 (MQA): 1x4(1)x1x70 d128 scale 0.3', shape = {1}, syms = {B = 1, H = 4, G = 4, T = 1, S = 70, D = 128, C = 70},
    scalars = {scale = 0.3}},
  {name = 'G 2: 1x2(1)x45x20 d128 not causal', shape = {1}, syms = {B = 1, H = 2, G = 2, T = 45, S = 20, D = 128, C = 20},
    scalars = {causal = 0}},
  {name = 'G 3: 2x6(2)x200x200 d64', shape = {1}, syms = {B = 2, H = 6, G = 3, T = 200, S = 200, D = 64, C = 300},
    big = true},
  {name = 'G 4 (MQA): 1x4(1)x150x200 d128 window 70 global 5 (fp8)', shape = {1},
    syms = {B = 1, H = 4, G = 4, T = 150, S = 200, D = 128, C = 300}, scalars = {window = 70, n_global = 5, fmt = 2},
    big = true},
}
KTOL.attention = {f32 = 1e-4, f16 = 3e-3}
-- kvcache: K new rows at pos in [0, P) of a cache of C (P = C - K + 1); kv_dequant reads its first N;
-- codes are random bytes below 100 (no fp8 NaN codes)
KCASES.kvcache = {
  {name = '2x3 C 20 D 64 K 5', shape = {1}, syms = {B = 2, H = 3, C = 20, D = 64, K = 5, P = 16, N = 20}},
  {name = '1x1 C 7 D 128 K 1 (fp8)', shape = {1}, syms = {B = 1, H = 1, C = 7, D = 128, K = 1, P = 7, N = 3},
    scalars = {fmt = 2}},
  {name = '2x2 C 300 D 40 K 33', shape = {1}, syms = {B = 2, H = 2, C = 300, D = 40, K = 33, P = 268, N = 111}},
  {name = '1x8 C 1000 D 128 K 100 (fp8)', shape = {1}, syms = {B = 1, H = 8, C = 1000, D = 128, K = 100, P = 901,
    N = 1000}, scalars = {fmt = 2}, big = true},
}
-- rope_kv_at: B decode rows of a fused projection W = (H + 2J) D wide, caches of C positions (E = D / 2)
KCASES.rope_kv_at = {
  {name = '1x2(1) d64 C 9', shape = {1}, syms = {B = 1, H = 2, J = 1, C = 9, D = 64, E = 32, W = 256}},
  {name = '3x9(3) d64 C 20 (SmolLM2)', shape = {1}, syms = {B = 3, H = 9, J = 3, C = 20, D = 64, E = 32, W = 960}},
  {name = '2x4(4) d128 C 5', shape = {1}, syms = {B = 2, H = 4, J = 4, C = 5, D = 128, E = 64, W = 1536}},
}
-- rope_kv_quant_at: the same into compressed caches (fmt 1 int8, 2 fp8)
KCASES.rope_kv_quant_at = {
  {name = '1x2(1) d64 C 9 int8', shape = {1}, syms = {B = 1, H = 2, J = 1, C = 9, D = 64, E = 32, W = 256}},
  {name = '3x9(3) d64 C 20 (SmolLM2) fp8', shape = {1}, syms = {B = 3, H = 9, J = 3, C = 20, D = 64, E = 32, W = 960},
    scalars = {fmt = 2}},
  {name = '2x4(4) d128 C 5 int8', shape = {1}, syms = {B = 2, H = 4, J = 4, C = 5, D = 128, E = 64, W = 1536}},
}
-- swiglu_linear: M rows of [gate | up] (K = 2I) times w (N, I); M <= 4 and M I elements in 48 KB
-- rows_linear: M rows (at most 4, M K elements in 48 KB) times w (N, K)
KCASES.rows_linear = {
  {name = '1x5 -> 7', shape = {1}, syms = {M = 1, N = 7, K = 5}},
  {name = '3x64 -> 33', shape = {1}, syms = {M = 3, N = 33, K = 64}},
  {name = '4x96 -> 40', shape = {1}, syms = {M = 4, N = 40, K = 96}},
  {name = '2x3000 -> 100 (past the registers)', shape = {1}, syms = {M = 2, N = 100, K = 3000}},
}
-- rows_linear_bias: the same with a bias (and GELU with the scalar act = 1)
KCASES.rows_linear_bias = {
  {name = '1x5 -> 7', shape = {1}, syms = {M = 1, N = 7, K = 5}},
  {name = '3x64 -> 33 gelu', shape = {1}, syms = {M = 3, N = 33, K = 64}, scalars = {act = 1}},
  {name = '4x96 -> 40', shape = {1}, syms = {M = 4, N = 40, K = 96}},
  {name = '1x768 -> 300 gelu (GPT-2\'s fc)', shape = {1}, syms = {M = 1, N = 300, K = 768}, scalars = {act = 1}},
  {name = '2x3000 -> 100 (past the registers)', shape = {1}, syms = {M = 2, N = 100, K = 3000}},
}
KCASES.swiglu_linear = {
  {name = '1x5 -> 7', shape = {1}, syms = {M = 1, N = 7, I = 5, K = 10}},
  {name = '3x64 -> 33', shape = {1}, syms = {M = 3, N = 33, I = 64, K = 128}},
  {name = '4x96 -> 40', shape = {1}, syms = {M = 4, N = 40, I = 96, K = 192}},
  {name = '2x3000 -> 100 (past the registers)', shape = {1}, syms = {M = 2, N = 100, I = 3000, K = 6000}},
}
-- moe: N tokens, E experts, K per token (<= min(8, E)), S = E * cap slots, C columns
KCASES.moe = {
  {name = '1x1 k1', shape = {1}, syms = {N = 1, E = 1, K = 1, S = 1, C = 1}},
  {name = '7x5 k2 cap3', shape = {1}, syms = {N = 7, E = 5, K = 2, S = 15, C = 7}},
  {name = '33x8 k2 cap3', shape = {1}, syms = {N = 33, E = 8, K = 2, S = 24, C = 40}},
  {name = '100x64 k8 cap20', shape = {1}, syms = {N = 100, E = 64, K = 8, S = 1280, C = 96}},
  {name = '300x256 k4 cap8', shape = {1}, syms = {N = 300, E = 256, K = 4, S = 2048, C = 130}},
  {name = '3000x8 k2 cap800', shape = {1}, syms = {N = 3000, E = 8, K = 2, S = 6400, C = 768}, big = true},
}
KTOL.moe = {f32 = 1e-4}
-- titans: chunk weights over rows of L tokens; eta, alpha drawn positive (0.1..3
-- for `+`) would overflow long products, so short rows and the default fill
KCASES.titans = {
  {name = '1x1', shape = {1}, syms = {N = 1, L = 1}},
  {name = '7x5', shape = {1}, syms = {N = 7, L = 5}},
  {name = '33x9', shape = {1}, syms = {N = 33, L = 9}},
}
KTOL.titans = {f32 = 1e-4, f16 = 3e-3, bf16 = 2e-2}
-- titans_scan: N memories of a D x D state over C chunks of T / C tokens; a chunk of
-- 35 tokens is a full tile of 32 and a part; D 40 and 64 take 3 and 4 blocks a memory
local SCAN_CASES = {
  {name = '1x1 d1', shape = {1}, syms = {N = 1, T = 1, D = 1, C = 1}},
  {name = '3x12 d5 3 chunks', shape = {1}, syms = {N = 3, T = 12, D = 5, C = 3}},
  {name = '2x70 d40 2 chunks', shape = {1}, syms = {N = 2, T = 70, D = 40, C = 2}},
  {name = '2x64 d64 1 chunk', shape = {1}, syms = {N = 2, T = 64, D = 64, C = 1}},
  {name = '1x96 d17 3 chunks', shape = {1}, syms = {N = 1, T = 96, D = 17, C = 3}},
  -- chunks of 128 tokens or more: token slices over blocks (150: four slices of 32 and one of 22)
  {name = '2x300 d40 2 chunks of 150', shape = {1}, syms = {N = 2, T = 300, D = 40, C = 2}},
  {name = '1x256 d64 1 chunk of 256', shape = {1}, syms = {N = 1, T = 256, D = 64, C = 1}},
  {name = '3x520 d17 4 chunks of 130', shape = {1}, syms = {N = 3, T = 520, D = 17, C = 4}},
}
KCASES.titans_scan, KCASES.titans_scan_backward = SCAN_CASES, SCAN_CASES
KTOL.titans_scan = {f32 = 1e-4, f16 = 5e-3, bf16 = 3e-2}
KTOL.titans_scan_backward = KTOL.titans_scan
-- titans_gates: B x T tokens of H heads in chunks of b (one token, a part of a warp, a warp and more);
-- titans_prep: rows of D (one lane, a part of a warp, two passes of a warp and more)
local GATES_CASES = {
  {name = '1x1 h1 b1', shape = {1}, syms = {B = 1, T = 1, H = 1}, scalars = {b = 1}},
  {name = '3x12 h5 b4', shape = {1}, syms = {B = 3, T = 12, H = 5}, scalars = {b = 4}},
  {name = '2x256 h2 b32', shape = {1}, syms = {B = 2, T = 256, H = 2}, scalars = {b = 32}},
  {name = '2x600 h3 b100', shape = {1}, syms = {B = 2, T = 600, H = 3}, scalars = {b = 100}},
}
KCASES.titans_gates, KCASES.titans_gates_backward = GATES_CASES, GATES_CASES
local PREP_CASES = {
  -- (a row of one normalized is +-1 and its gradient about eps / y^3: f32 cancels it, so this one without the norm)
  {name = '1x1 h1 d1', shape = {1}, syms = {B = 1, T = 1, H = 1, D = 1}, scalars = {norm = 0}},
  {name = '3x7 h5 d17', shape = {1}, syms = {B = 3, T = 7, H = 5, D = 17}},
  {name = '2x64 h2 d64', shape = {1}, syms = {B = 2, T = 64, H = 2, D = 64}},
  {name = '2x9 h3 d130', shape = {1}, syms = {B = 2, T = 9, H = 3, D = 130}},
}
KCASES.titans_prep, KCASES.titans_prep_backward = PREP_CASES, PREP_CASES
for _, k in ipairs {'titans_gates', 'titans_gates_backward', 'titans_prep', 'titans_prep_backward'} do
  KTOL[k] = {f32 = 1e-5, f16 = 2e-3, bf16 = 1e-2}
end
-- conv: B x T x C tokens, K taps (wider than T in one case: every output reads the zeros before the start)
KCASES.conv = {
  {name = '1x1x1 k1', shape = {1}, syms = {B = 1, T = 1, C = 1, K = 1}},
  {name = '2x7x5 k4', shape = {1}, syms = {B = 2, T = 7, C = 5, K = 4}},
  {name = '3x5x40 k7', shape = {1}, syms = {B = 3, T = 5, C = 40, K = 7}},
  {name = '2x300x129 k4', shape = {1}, syms = {B = 2, T = 300, C = 129, K = 4}},
  {name = '3x40x33 k12 (dw per tap)', shape = {1}, syms = {B = 3, T = 40, C = 33, K = 12}},
  {name = '4x4096x320 k4 (past one grid)', shape = {1}, syms = {B = 4, T = 4096, C = 320, K = 4}, big = true},
}
KTOL.conv = {f32 = 1e-5}
SCALARS_FOR.attn_bwd = {scale = 0.05}
-- set diversity: S sets of N vectors of D (a set of one, warp-sized, the
-- n = 64, d = 384 of the benchmark, long rows, several row batches per warp in
-- the vectorized kernels); distinct-n: L ids per sequence
KCASES.diversity = {
  {name = '1x1x1', shape = {1}, syms = {S = 1, N = 1, D = 1, L = 1}},
  {name = '3x7x5', shape = {1}, syms = {S = 3, N = 7, D = 5, L = 9}},
  {name = '2x4x1000', shape = {1}, syms = {S = 2, N = 4, D = 1000, L = 12}},
  {name = '4x64x384', shape = {1}, syms = {S = 4, N = 64, D = 384, L = 16}, big = true},
  {name = '2x100x256', shape = {1}, syms = {S = 2, N = 100, D = 256, L = 8}, big = true},
}
KTOL.diversity = {f32 = 1e-4}
-- rope: x (*, T, H, D) with D = 2E frequencies; positions in [0, P)
KCASES.rope = {
  {name = '1x1x2', shape = {1}, syms = {T = 1, H = 1, D = 2, E = 1, P = 1}},
  {name = '7x3x64', shape = {1}, syms = {T = 7, H = 3, D = 64, E = 32, P = 40}},
  {name = '2x33x5x128', shape = {2, 1}, syms = {T = 33, H = 5, D = 128, E = 64, P = 100}},
  {name = '1000x4x64', shape = {1}, syms = {T = 1000, H = 4, D = 64, E = 32, P = 4096}, big = true},
}
KTOL.rope = {f32 = 1e-4}
-- nf4: N blocks of B = 2H values (quantize, dequantize), from one block of 16 to
-- blocks of 4096; the GEMV: x (M, K) over q (N, H = K/2) with absmax (N, G =
-- K/B): the 16-byte path (K % 32 == 0) and the byte path (K % 32 == 16),
-- every tile of rows (1, 2, 4, 8, 16, 32), two tiles (M = 33), split K
local NF4_BLOCKS = {
  {name = '1 block of 16', shape = {1}, syms = {N = 1, B = 16, H = 8}},
  {name = '7 blocks of 64', shape = {1}, syms = {N = 7, B = 64, H = 32}},
  {name = '33 blocks of 256', shape = {1}, syms = {N = 33, B = 256, H = 128}},
  {name = '3 blocks of 4096', shape = {1}, syms = {N = 3, B = 4096, H = 2048}},
  {name = '20000 blocks of 64', shape = {1}, syms = {N = 20000, B = 64, H = 32}, big = true},
}
KCASES.nf4_quantize, KCASES.nf4_dequantize = NF4_BLOCKS, NF4_BLOCKS
KCASES.nf4_gemv = {
  {name = '1x1x16 block 16', shape = {1}, syms = {M = 1, N = 1, K = 16, H = 8, G = 1}},
  {name = '7x33x96 block 32', shape = {1}, syms = {M = 7, N = 33, K = 96, H = 48, G = 3}},
  {name = '3x17x48 block 16', shape = {1}, syms = {M = 3, N = 17, K = 48, H = 24, G = 3}},
  {name = '5x20x272 block 16', shape = {1}, syms = {M = 5, N = 20, K = 272, H = 136, G = 17}},
  {name = '1x300x576 block 64', shape = {1}, syms = {M = 1, N = 300, K = 576, H = 288, G = 9}},
  {name = '2x129x1024 block 64', shape = {1}, syms = {M = 2, N = 129, K = 1024, H = 512, G = 16}},
  {name = '12x40x768 block 256', shape = {1}, syms = {M = 12, N = 40, K = 768, H = 384, G = 3}},
  {name = '32x65x512 block 128', shape = {1}, syms = {M = 32, N = 65, K = 512, H = 256, G = 4}},
  {name = '33x31x256 block 64', shape = {1}, syms = {M = 33, N = 31, K = 256, H = 128, G = 4}},
  {name = '1x1000x4096 block 64', shape = {1}, syms = {M = 1, N = 1000, K = 4096, H = 2048, G = 64}, big = true},
  {name = '16x513x1536 block 64', shape = {1}, syms = {M = 16, N = 513, K = 1536, H = 768, G = 24}, big = true},
  {name = '40x77x320 block 64', shape = {1}, syms = {M = 40, N = 77, K = 320, H = 160, G = 5}},
  {name = '9x16x192 block 64', shape = {1}, syms = {M = 9, N = 16, K = 192, H = 96, G = 3}},
}
KTOL.nf4_gemv = {f32 = 1e-4}

-- per kernel (by name or family): fix up the inputs make_args drew (args on the cpu)
local KFILL = {}
-- dequant: x holds quantized blocks: random bytes, except the fp16 scales (at these
-- byte offsets of each block), which get magnitudes 2^-7 .. 2^-3 so that values stay in f16's range
local SCALE_BYTES = {dequant_q4_0 = {0}, dequant_q4_1 = {0, 2}, dequant_q5_0 = {0}, dequant_q5_1 = {0, 2},
                     dequant_q8_0 = {0}, dequant_q4_k = {0, 2}, dequant_q5_k = {0, 2}, dequant_q6_k = {208}}
KFILL.dequant = function(k, args)
  local x = args[2]
  local r = gp.empty(x.shape, {dtype = 'i32', device = 'cpu'})
  gp.k.randint(r, 0, 256)
  x:copy_(r)
  local p = require('ffi').cast('uint8_t *', x.c.data) + x.c.offset
  local nb, bytes = x.shape[1], x.shape[2]
  for b = 0, nb - 1 do
    for _, o in ipairs(SCALE_BYTES[k.name]) do
      p[b * bytes + o] = math.random(0, 255)
      p[b * bytes + o + 1] = math.random(0, 1) * 128 + 0x20 + math.random(0, 15)
    end
  end
end

-- attn_decode_q, attn_chunk_q: codes are random bytes below 100; scales of about 0.03 keep the scores near
-- those of unit-scale keys (a softmax that is not one-hot: every key's value counts)
KFILL.attn_decode_q = function(_, args)
  for i = 5, 6 do args[i]:copy_(args[i]:abs() * 0.02) end
end
KFILL.attn_chunk_q = KFILL.attn_decode_q -- the same arguments, q and out (B, T, H, D)

-- titans_scan: small surprise rates (theta) and contracting chunk factors (p), as titans_coef gives them:
-- random ones grow the state chunk after chunk past f16's range
KFILL.titans_scan = function(_, args)
  args[8]:copy_(args[8]:abs() * 0.01)
  args[11]:copy_(args[11]:abs() * 0.5)
end
KFILL.titans_scan_backward = function(_, args)
  args[13]:copy_(args[13]:abs() * 0.01)
  args[16]:copy_(args[16]:abs() * 0.5)
end

-- nf4: packed codes are any bytes; the weights to quantize get an all-zero
-- block, exact zeros and a block of values so small (denormal in f32) that
-- 1 / absmax overflows
local function random_bytes(t)
  local r = gp.empty(t.shape, {dtype = 'i32', device = 'cpu'})
  gp.k.randint(r, 0, 256)
  t:copy_(r)
end
KFILL.nf4_dequantize = function(_, args) random_bytes(args[2]) end
KFILL.nf4_gemv = function(_, args) random_bytes(args[3]) end
KFILL.nf4_quantize = function(_, args)
  local w = args[3]
  local n, b = w:size(1), w:size(2)
  w:narrow(1, 1, 1):narrow(2, 1, math.min(3, b)):zero_()
  if n >= 2 then w:narrow(1, 2, 1):zero_() end
  if n >= 3 then w:narrow(1, 3, 1):mul_(1e-40) end
end

local function rand_fill(dst, positive)
  local t = gp.empty(dst.shape, {dtype = dst.dtype, device = dst.device})
  local dt = t.dtype
  if dt == 'u8' then gp.k.randint(t, positive and 1 or 0, 100)
  elseif dt == 'i32' or dt == 'i64' then gp.k.randint(t, positive and 1 or -50, 50)
  elseif positive then gp.k.rand_uniform(t, 0.1, 3)
  else gp.k.rand_normal(t, 0, 1.5) end
  return dst:copy_(t)
end

local function mask_fill(dst)
  local t = gp.empty(dst.shape, {dtype = dst.dtype, device = dst.device})
  gp.k.randint(t, 0, 2)
  return dst:copy_(t)
end

-- `<V`: integers in [0, size of V)
local function range_fill(dst, n)
  local t = gp.empty(dst.shape, {dtype = dst.dtype, device = dst.device})
  gp.k.randint(t, 0, n)
  return dst:copy_(t)
end

-- a tensor of the given shape whose strides are not the contiguous ones;
-- rows (spec `/`): stride 1 on the last dim, the two dims before it swapped
-- (a head view of a (B, T, H, D) buffer) and rows 8 elements longer
local function noncontig(shape, dtype, device, rows)
  local s = {}
  for i = 1, #shape do s[i] = shape[i] end
  local o = {dtype = dtype, device = device or 'cpu'}
  if rows then
    local n = #s
    s[n] = s[n] + 8
    if n >= 3 then s[n - 1], s[n - 2] = s[n - 2], s[n - 1] end
    local t = gp.empty(s, o)
    if n >= 3 then t = t:transpose(n - 2, n - 1) end
    return t:narrow(n, 1, shape[n])
  end
  if #shape >= 2 then
    s[#s], s[#s - 1] = s[#s - 1], s[#s]
    return gp.empty(s, o):transpose(-1, -2)
  end
  s[#s + 1] = 2
  return gp.empty(s, o):select(-1, 1)
end

-- a shape that broadcasts to `shape`: some dims 1, maybe fewer leading dims
local function bcast_of(shape, variant)
  if variant == 0 or #shape == 1 then return shape end
  local s = {}
  for i = 1, #shape do s[i] = shape[i] end
  if variant == 1 then s[1] = 1 else table.remove(s, 1); s[#s] = 1 end
  return s
end

-- build the argument list (on the CPU) for one case
local function make_args(k, case, dts, variant)
  local args, syms = {}, {}
  local over = SYMS[k.name] and SYMS[k.name](case) or {}
  local first_shape
  local kscalars = SCALARS_FOR[k.name] or SCALARS_FOR[k.family] or {}
  for i, a in ipairs(k.args) do
    if a.scalar then
      args[i] = kscalars[a.name] or (case.scalars and case.scalars[a.name]) or SCALARS[a.name] or a.default or 0.75
    else
      local dt = dts[i]
      local shape
      if a.dims == '~' then shape = bcast_of(first_shape, variant)
      elseif a.dims == '=' or a.dims == nil then shape = first_shape or case.shape
      else
        shape = {}
        local function sym(n) syms[n] = syms[n] or over[n] or (case.syms and case.syms[n]) or case.sym; return syms[n] end
        for tok in a.dims:gmatch('[^,]+') do
          local num, den = tok:match('^(%u)/(%u)$')
          if tok == '*' then for _ = 1, #case.shape - 1 do shape[#shape + 1] = case.shape[_] end
          elseif tonumber(tok) then shape[#shape + 1] = tonumber(tok)
          elseif num then -- H/G: H / G, G (a divisor of H) from the case, else 1
            syms[den] = syms[den] or over[den] or (case.syms and case.syms[den]) or 1
            assert(sym(num) % syms[den] == 0, k.name .. ' case ' .. case.name .. ': ' .. den .. ' must divide ' .. num)
            shape[#shape + 1] = syms[num] / syms[den]
          else shape[#shape + 1] = sym(tok) end
        end
      end
      first_shape = first_shape or shape
      local t
      if variant == 2 and not a.contiguous and not case.big then
        t = noncontig(shape, dt, 'cpu', a.rows)
      else
        t = gp.empty(shape, {dtype = dt, device = 'cpu'})
      end
      if not a.out or a.inout then
        if a.lt then range_fill(t, syms[a.lt] or over[a.lt] or (case.syms and case.syms[a.lt]) or case.sym)
        elseif a.type == 'B' then mask_fill(t) else rand_fill(t, a.positive) end
      end
      args[i] = t
    end
  end
  return args
end

local function poison(t, v)
  gp.k.fill(t, v)
end

-- run k on a copy of args on a device; returns the outputs (on that device)
local function run_on(k, args, device, poison_value, seed)
  local dargs = {}
  for i, a in ipairs(k.args) do
    local x = args[i]
    if not a.scalar then
      -- always a new tensor: runs must not share outputs or in-out state
      local y = x:is_contiguous() and (x.device == device and x:clone() or x:to(device))
        or noncontig(x.shape, x.dtype, device, a.rows):copy_(x)
      if a.out and not a.inout then poison(y, poison_value) end
      dargs[i] = y
    else
      dargs[i] = x
    end
  end
  gp.manual_seed(seed)
  k.fn(unpack(dargs, 1, #k.args))
  local outs = {}
  for i, a in ipairs(k.args) do if a.out then outs[#outs + 1] = dargs[i] end end
  return outs
end

-- dtype assignments for a spec: one per F/T choice; N args vary with the case
local function dtype_sets(k)
  local has = {}
  for _, a in ipairs(k.args) do if not a.scalar then has[a.type] = true end end
  local list = has.T and ALL or (has.F and FLOATS) or {'f32'}
  local sets = {}
  for idx, main in ipairs(list) do
    local d = {}
    for i, a in ipairs(k.args) do
      if not a.scalar then
        if a.type == 'F' or a.type == 'T' then d[i] = main
        elseif a.type == 'B' then d[i] = 'u8'
        elseif a.type == 'I' then d[i] = idx % 2 == 0 and 'i32' or 'i64'
        elseif a.type == 'N' then d[i] = ALL[(idx + i * 2) % #ALL + 1]
        else d[i] = a.type end
      end
    end
    sets[#sets + 1] = d
  end
  -- N args: every output dtype once more with each input dtype (casts)
  if has.N and #k.args == 2 and not k.args[2].scalar then
    for _, o in ipairs(ALL) do for _, s in ipairs(ALL) do sets[#sets + 1] = {o, s} end end
  end
  return sets
end

for _, k in ipairs(kernels.list) do
  T.test('kernel ' .. k.name, function()
    local ran, compared = 0, 0
    local cases = KCASES[k.name] or KCASES[k.family] or CASES
    local ktol = KTOL[k.name] or KTOL[k.family] or {}
    for si, dts in ipairs(dtype_sets(k)) do
      for ci, case in ipairs(cases) do
        -- large sizes: the first two dtype sets only
        if not (case.big and si > 2) then
          local variant = case.variant or (si + ci) % 3
          local args = make_args(k, case, dts, variant)
          local kfill = KFILL[k.name] or KFILL[k.family]
          if kfill then kfill(k, args, case) end
          local seed = 99 + si * 7 + ci
          local dev = gp.cuda_available() and 'cuda' or 'cpu'
          -- every element written: two runs with different poison agree
          local o1 = run_on(k, args, 'cpu', 77, seed)
          local o2 = run_on(k, args, 'cpu', 11, seed)
          for j = 1, #o1 do
            local r = T.relnorm(o1[j], o2[j])
            if r ~= 0 then
              error(string.format('%s %s case %s: cpu output not fully written (poisons disagree: %g)', k.name,
                table.concat(dts, ','), case.name, r))
            end
          end
          ran = ran + 1
          local cpu_only = false
          for _, d in pairs(dts) do if d == 'f64' then cpu_only = true end end
          if dev == 'cuda' and not cpu_only then
            local g1 = run_on(k, args, 'cuda', 77, seed)
            local g2 = run_on(k, args, 'cuda', 11, seed)
            for j = 1, #o1 do
              -- (kernels that add with atomics may differ in the last bits between runs)
              if T.relnorm(g1[j], g2[j]) > 1e-6 then
                error(string.format('%s case %s: cuda output not fully written', k.name, case.name))
              end
              local odt = o1[j].dtype
              local tol = case.tol and case.tol[odt] or ktol[odt] or TOL[odt]
              local kcheck = KCHECK[k.name]
              local msg = kcheck and kcheck(j, g1[j], o1[j], tol)
              if msg then
                error(string.format('%s dtypes %s case %s: cuda vs cpu: %s', k.name, table.concat(dts, ','), case.name, msg))
              end
              local r = kcheck and 0 or T.relnorm(g1[j], o1[j])
              if not (r <= tol) then
                error(string.format('%s dtypes %s case %s variant %d: cuda vs cpu relative norm %g > %g', k.name,
                  table.concat(dts, ','), case.name, variant, r, tol))
              end
            end
            compared = compared + 1
          end
        end
      end
    end
    T.ok(ran > 0)
  end)
end
