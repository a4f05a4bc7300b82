-- Decode attention over a long KV cache held in bf16, int8 and fp8 (e4m3)
-- (gp.KVCache{kv_dtype = ...}): one query per sequence and head over S
-- cached positions (default B 4, 32 query heads over 8 KV heads, D 128, S
-- 32768), timed with gp.time; GB/s counts the cache bytes a step reads
-- once: 2 B Hkv S D x 2 bytes (bf16), 2 B Hkv S (D + 4) bytes (codes and
-- their f32 scales), and "of copy" is that over the copy bandwidth measured
-- in the same run. A sample times --reps calls back to back (the kernels
-- as a decode step's graph runs them, without the host's launch gaps).
-- Grouped-query heads of bf16/f16 queries run on tensor cores;
-- GP_ATTN_DECODE=cores times the CUDA-core kernel instead. The
-- quantize-on-append kernel is timed too (one token appended to every
-- layer's row: the per-step write).
-- --chunk T adds a prefill chunk: T queries a sequence at the cache's last T
-- positions over everything before them (cache:attend_chunk; on the
-- compressed caches the codes are read directly, beside the dequantized copy
-- + flash attention that ran before, and flash attention over the bf16 cache).
--   gpush scripts/bench/kv_decode.lua [--len 32768] [--batch 4] [--heads 32] [--kv-heads 8] [--head-dim 128] [--reps 10]
--     [--chunk 0]
-- Without a GPU it runs the CPU references at --len 512 (CPU timings).
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'len', 0, 'cached positions S (0: 32768 on the GPU, 512 on the CPU)'}, {'batch', 4, 'sequences B'},
  {'heads', 32, 'query heads H'}, {'kv-heads', 8, 'KV heads (dividing H)'}, {'head-dim', 128, 'head dim (64 or 128)'},
  {'iters', 20, 'timed samples'}, {'reps', 10, 'calls a sample, back to back (1 on the CPU)'},
  {'chunk', 0, 'also time a prefill chunk of this many queries over the cache (0: not)'},
}, {usage = 'gpush scripts/bench/kv_decode.lua [flags]'})
local dev = gp.cuda_available() and 'cuda' or 'cpu'
local S = a.len > 0 and a.len or (dev == 'cuda' and 32768 or 512)
local B, H, Hkv, D = a.batch, a.heads, a.kv_heads, a.head_dim
gp.manual_seed(1)
print(string.format('kv decode bench: B=%d H=%d Hkv=%d D=%d S=%d, device %s%s', B, H, Hkv, D, S, dev,
  dev == 'cpu' and ' (CPU reference timings)' or ''))
local k, v = gp.randn({B, Hkv, S, D}, {device = dev}):bf16(), gp.randn({B, Hkv, S, D}, {device = dev}):bf16()
local q = gp.randn({B, H, D}, {device = dev}):bf16()
local k1, v1 = k:narrow(3, 1, 1):contiguous(), v:narrow(3, 1, 1):contiguous()
local opts = {warmup = 2, iters = dev == 'cuda' and a.iters or 2}
local reps = dev == 'cuda' and math.max(1, a.reps) or 1
local copy_bw
do
  local n = dev == 'cuda' and 2 ^ 27 or 2 ^ 20
  local src, dst = gp.ones({n}, {device = dev}), gp.empty({n}, {device = dev})
  copy_bw = 2 * n * 4 / gp.time(function() gp.k.copy(dst, src) end, opts) / 1e6
  print(string.format('  copy bandwidth %.1f GB/s (gp.k.copy of %d f32, bytes read + written); %d calls a sample%s', copy_bw,
    n, reps, os.getenv('GP_ATTN_DECODE') and ', GP_ATTN_DECODE=' .. os.getenv('GP_ATTN_DECODE') or ''))
end
local ref
print(string.format('  %-6s %10s %10s %10s %8s %12s %12s', 'cache', 'MB/layer', 'decode ms', 'GB/s', 'of copy', 'vs bf16 out',
  'append us'))
for _, kvd in ipairs {'bf16', 'int8', 'fp8'} do
  local cache = gp.KVCache {batch = B, heads = Hkv, capacity = S, head_dim = D, dtype = 'bf16', device = dev,
                            kv_dtype = kvd ~= 'bf16' and kvd or nil}
  cache:append(1, k, v)
  local out = cache:attend(1, q)
  local ms = gp.time(function() for _ = 1, reps do cache:attend(1, q) end end, opts) / reps
  local bytes = kvd == 'bf16' and 2 * B * Hkv * S * D * 2 or 2 * B * Hkv * S * (D + 4)
  ref = ref or out:float()
  -- one token appended at the last position (the step's write), S times the bytes above / S
  local pos = gp.full({1}, S - 1, {dtype = 'i64', device = dev})
  local app = gp.time(function() cache:append_at(1, k1, v1, pos) end, opts)
  print(string.format('  %-6s %10.1f %10.3f %10.1f %8.2f %12.2e %12.2f', kvd, cache:nbytes() / 2 ^ 20, ms, bytes / ms / 1e6,
    bytes / ms / 1e6 / copy_bw,
    (out:float() - ref):pow(2):sum():sqrt():item() / ref:pow(2):sum():sqrt():item(), app * 1e3))
end

if a.chunk > 0 then
  local Tq = math.min(a.chunk, S)
  local qc = gp.randn({B, Tq, H, D}, {device = dev}):bf16()
  -- FLOPs: q k^T and p v over the keys each query sees (S - Tq + t for query t)
  local flops = 4 * B * H * D * (Tq * (S - Tq) + Tq * (Tq + 1) / 2)
  print(string.format('  prefill chunk of %d queries a sequence at the end of the cache (%.1f GFLOP):', Tq, flops / 1e9))
  print(string.format('  %-6s %-34s %10s %10s %12s', 'cache', 'path', 'ms', 'TFLOP/s', 'vs bf16 out'))
  local cref
  for _, kvd in ipairs {'bf16', 'int8', 'fp8'} do
    local cache = gp.KVCache {batch = B, heads = Hkv, capacity = S, head_dim = D, dtype = 'bf16', device = dev,
                              kv_dtype = kvd ~= 'bf16' and kvd or nil}
    cache:append(1, k, v)
    local paths = {{kvd == 'bf16' and 'flash over the cache' or 'codes read directly (attn_chunk_q)',
      function() return cache:attend_chunk(1, qc) end}}
    if kvd ~= 'bf16' then
      paths[2] = {'dequantized copy + flash', function()
        return (gp.attention(qc:transpose(2, 3), cache:keys(1), cache:values(1), {causal = true})):transpose(2, 3)
      end}
    end
    for _, pth in ipairs(paths) do
      local out = pth[2]():float()
      cref = cref or out
      local ms = gp.time(function() for _ = 1, reps do pth[2]() end end, opts) / reps
      print(string.format('  %-6s %-34s %10.3f %10.1f %12.2e', kvd, pth[1], ms, flops / ms / 1e9,
        (out - cref):pow(2):sum():sqrt():item() / cref:pow(2):sum():sqrt():item()))
    end
  end
end
