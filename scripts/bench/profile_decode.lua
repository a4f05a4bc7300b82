-- profile_decode.lua: one decode step of a Llama-family model, kernel by
-- kernel: the step gp.generate captures as a CUDA graph (the token's forward
-- at a device position over a KV cache filled with --context tokens), run
-- eagerly under gp.profile (events around every gp.k call: the matmuls are
-- cuBLAS's), then timed eagerly and as a replayed graph.
--   gpush scripts/bench/profile_decode.lua [--model smollm2] [--batch 1] [--context 128]
-- --random smollm2 builds a Llama of SmolLM2-135M's shapes (or of a
-- config.json's) with random weights instead of loading a checkpoint: the
-- kernels and their times are the same, and nothing needs `make models`
-- (--layers N keeps the first N layers). --nf4 quantizes the attention and
-- MLP Linears to NF4 first (the step then runs the NF4 GEMV).
-- The floor printed is the bytes a step reads, the weights' and the KV
-- cache's (every layer's keys and values; --kv-dtype int8 / fp8: codes and
-- scales), over the copy bandwidth measured in the same run (gp.k.copy of
-- 512 MB): a step cannot read them faster.
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'model', 'smollm2', 'a short name, a Hugging Face directory or a .gguf file'},
  {'dtype', '', 'the model\'s dtype (default bf16 on the GPU, f32 on the CPU)'},
  {'batch', 1, 'rows decoded together'}, {'context', 128, 'cached positions before the step'},
  {'kv-dtype', '', 'the KV cache stored as int8 or fp8 (default: the model\'s dtype)'},
  {'top', 20, 'kernels listed'},
  {'random', '', 'smollm2, llama1024, gpt2 or a config.json: that model\'s shapes with random weights (no checkpoint)'},
  {'layers', 0, 'with --random: keep this many layers (0: the config\'s)'},
  {'nf4', false, 'quantize the attention and MLP Linears to NF4 (gp.nn.quantize_linears, blocks of 64)'},
}, {usage = 'gpush scripts/bench/profile_decode.lua [flags]', description = 'A decode step, kernel by kernel.'})

local dev = gp.device()
local dtype = a.dtype ~= '' and a.dtype or (dev == 'cuda' and 'bf16' or 'f32')
local model
if a.random == 'gpt2' then -- GPT-2 small's shapes (nn.GPT: LayerNorm, biases, GELU, learned positions)
  model = gp.nn.GPT({vocab_size = 50257, block_size = 1024, n_embd = 768, n_layer = a.layers > 0 and a.layers or 12,
    n_head = 12}):to(dtype):eval()
  local C, H = model.config.n_embd, model.config.n_head
  model.new_cache = function(_, B, cap, dt, dv, kvd)
    return gp.KVCache {batch = B, heads = H, capacity = cap, head_dim = C / H, layers = model.config.n_layer, dtype = dt,
      device = dv, kv_dtype = kvd}
  end
elseif a.random ~= '' then
  local cfg = gp.models.SHAPES[a.random] or require('gpush.models.hf').read_json(a.random)
  if a.layers > 0 then
    local c2 = {}
    for k, v in pairs(cfg) do c2[k] = v end
    c2.num_hidden_layers = a.layers
    cfg = c2
  end
  model = gp.models.Llama(cfg, {dtype = dtype}):eval()
else
  model = gp.models.load(a.model, {dtype = dtype})
end
if a.nf4 then gp.nn.quantize_linears(model, {kind = 'nf4', block = 64}) end
local c, B = model.config, a.batch
local cache = model:new_cache(B, a.context + 1, dtype, dev, a.kv_dtype ~= '' and a.kv_dtype or nil)
local pos = gp.full({1}, a.context, {dtype = 'i64', device = dev})
local nxt = gp.zeros({B, 1}, {dtype = 'i64', device = dev})
gp.no_grad(function()
  model:forward_cached(gp.randint(0, c.vocab_size, {B, a.context}, {device = dev}), cache, 0)
end)
local function step() gp.no_grad(function() model:forward_cached(nxt, cache, pos) end) end

local bytes = gp.nn.weight_bytes(model)
local wbytes, kvbytes = bytes, cache:nbytes() * a.context / (a.context + 1) -- the filled positions
bytes = bytes + kvbytes
local copy_bw
do
  local n = dev == 'cuda' and 128 * 2 ^ 20 or 2 ^ 20
  local s, d = gp.empty({n}, {device = dev}), gp.empty({n}, {device = dev})
  copy_bw = 2 * 4 * n / (gp.time(function() gp.k.copy(d, s) end, {warmup = 2, iters = 10}) * 1e6)
end
print(string.format('decode step profile: %s %s%s on %s, batch %d after %d cached positions (%s cache); %.1f MB of weights + ' ..
  '%.3f MB of KV cache, copy %.0f GB/s: floor %.1f us',
  a.random ~= '' and ('random ' .. a.random .. (a.layers > 0 and (', ' .. a.layers .. ' layers') or '')) or a.model, dtype,
  a.nf4 and ' (NF4 Linears)' or '', dev, B,
  a.context, a.kv_dtype ~= '' and a.kv_dtype or dtype, wbytes / 1e6, kvbytes / 1e6, copy_bw, bytes / copy_bw / 1e3))
local p = gp.profile(step, {warmup = 2, iters = 5})
print(string.format('%d kernels a step, %.1f us of kernel time a step (events around each)', p.calls / p.iters,
  p.kernel_ms * 1e3 / p.iters))
print(string.format('  %-28s %7s %10s %9s %6s', 'kernel', 'calls', 'us a step', 'mean us', '%'))
for i = 1, math.min(a.top, #p.kernels) do
  local k = p.kernels[i]
  print(string.format('  %-28s %7d %10.1f %9.2f %6.1f', k.name, k.calls / p.iters, k.total_us / p.iters, k.mean_us, k.pct))
end
local eager = gp.time(step, {warmup = 2, iters = 20})
local line = string.format('step: eager %.1f us', eager * 1e3)
if dev == 'cuda' then
  local g = gp.graph(step)
  local ms = gp.time(function() g:replay() end, {warmup = 3, iters = 50})
  line = line .. string.format(', CUDA graph %.1f us (%.0f steps/s, %.1f%% of the floor)', ms * 1e3, 1e3 / ms,
    100 * bytes / copy_bw / 1e6 / ms)
  g:free()
end
print(line)
