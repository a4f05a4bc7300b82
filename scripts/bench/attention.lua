-- Flash attention benchmark: bf16, causal, B 4, H 16, T 4096, D 64 (change
-- with --batch --heads --seq --head-dim): forward, backward and forward +
-- backward in TFLOP/s (causal flops: 4 B H T^2 D / 2 forward, 2.5x that
-- backward, 3.5x forward + backward), timed with gp.time, beside PyTorch's
-- scaled_dot_product_attention (scripts/bench/torch_peer.py attention) when
-- python3 has torch; and decode attention over a long cache in GB/s.
--   gpush scripts/bench/attention.lua [--seq 4096] [--head-dim 64]
local a = gp.args.parse(arg, {
  {'batch', 4, 'batch size'}, {'heads', 16, 'heads'}, {'seq', 4096, 'sequence length T'},
  {'head-dim', 64, 'head dim (64 or 128)'}, {'iters', 20, 'timed iterations'},
  {'decode-len', 32768, 'cache length of the decode benchmark'},
}, {usage = 'gpush scripts/bench/attention.lua [flags]'})
if not gp.cuda_available() then
  print('attention bench: no CUDA GPU, nothing to measure')
  return
end
local B, H, Tn, D = a.batch, a.heads, a.seq, a.head_dim
local CU = {dtype = 'bf16', device = 'cuda'}
local q, k, v = gp.randn({B, H, Tn, D}, CU), gp.randn({B, H, Tn, D}, CU), gp.randn({B, H, Tn, D}, CU)
local dout = gp.randn({B, H, Tn, D}, CU)
local out = gp.empty({B, H, Tn, D}, CU)
local lse = gp.empty({B, H, Tn}, {dtype = 'f32', device = 'cuda'})
local dq, dk, dv = gp.empty({B, H, Tn, D}, CU), gp.empty({B, H, Tn, D}, CU), gp.empty({B, H, Tn, D}, CU)
local scale = 1 / math.sqrt(D)
local flops = 4 * B * H * Tn * Tn * D / 2
local opts = {warmup = 3, iters = a.iters}

local fwd_ms = gp.time(function() gp.k.attn_fwd(out, lse, q, k, v, scale, 0, 0, 1) end, opts)
local bwd_ms = gp.time(function() gp.k.attn_bwd(dq, dk, dv, q, k, v, out, lse, dout, scale, 0, 0, 1) end, opts)
local fb_ms = fwd_ms + bwd_ms
print(string.format('attention bf16 causal B=%d H=%d T=%d D=%d (GP_ATTN_IMPL=%s%s)', B, H, Tn, D,
  os.getenv('GP_ATTN_IMPL') or 'default: wg on compute capability 9.0, else new',
  os.getenv('GP_ATTN_DETERMINISTIC') and (' GP_ATTN_DETERMINISTIC=' .. os.getenv('GP_ATTN_DETERMINISTIC')) or ''))
print(string.format('  forward          %8.3f ms  %7.1f TFLOP/s', fwd_ms, flops / fwd_ms / 1e9))
print(string.format('  backward         %8.3f ms  %7.1f TFLOP/s', bwd_ms, 2.5 * flops / bwd_ms / 1e9))
print(string.format('  forward+backward %8.3f ms  %7.1f TFLOP/s', fb_ms, 3.5 * flops / fb_ms / 1e9))

-- PyTorch SDPA on the same sizes (same process time base: CUDA events, median)
local cmd = string.format('python3 scripts/bench/torch_peer.py attention --batch %d --heads %d --seq %d --head-dim %d 2>/dev/null',
  B, H, Tn, D)
local p = io.popen(cmd)
local txt = p and p:read('*a') or ''
if p then p:close() end
local tf = tonumber(txt:match('attention fwd ([%d%.]+)'))
local tfb = tonumber(txt:match('attention fwd_bwd ([%d%.]+)'))
if tf and tfb then
  print(string.format('  torch SDPA fwd   %8.3f ms  %7.1f TFLOP/s   gpush/torch %.2fx', tf, flops / tf / 1e9, tf / fwd_ms))
  print(string.format('  torch SDPA f+b   %8.3f ms  %7.1f TFLOP/s   gpush/torch %.2fx', tfb, 3.5 * flops / tfb / 1e9,
    tfb / fb_ms))
else
  print('  (no PyTorch peer: python3 with torch and a GPU not found)')
end

-- decode: one query per sequence over a long cache (bytes: the keys and values read once)
local C = a.decode_len
local kc, vc = gp.randn({B, H, C, D}, CU), gp.randn({B, H, C, D}, CU)
local q1, o1 = gp.randn({B, H, D}, CU), gp.empty({B, H, D}, CU)
local lens = gp.full({B}, C, {dtype = 'i32', device = 'cuda'})
local dms = gp.time(function() gp.k.attn_decode(o1, q1, kc, vc, lens, scale, 0, 0) end, opts)
print(string.format('  decode C=%d      %8.3f ms  %7.1f GB/s', C, dms, 2 * B * H * C * D * 2 / dms / 1e6))
