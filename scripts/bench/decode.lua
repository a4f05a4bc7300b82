-- Decode benchmark: tokens/s of gp.generate for a model of random weights
-- at batch 1 and 16, 200 new tokens after a short prompt, with the decode
-- step captured as a CUDA graph (graph on) and run eagerly (graph off),
-- beside PyTorch loops of the same model shape with a static KV cache, eager
-- and compiled with torch.compile(mode="reduce-overhead")
-- (scripts/bench/torch_decode.py) when python3 has torch.
--   gpush scripts/bench/decode.lua [--model gpt] [--batches 1,16] [--max-new 200] [--bf16] [--nf4] [--greedy] [--top-p 1]
-- --model: gpt (nn.GPT of --n-embd, --n-layer, --n-head, --vocab, --block;
-- default d768, 12 layers, 12 heads, byte vocabulary), gpt2 (GPT-2 small:
-- d768, 12 layers, vocabulary 50,257), or a Llama of gp.models.SHAPES
-- (llama1024: issue 23's d1024 8-layer model; smollm2: SmolLM2-135M's
-- shapes); --layers N keeps the first N layers of a Llama. --nf4 (with
-- --bf16) quantizes the attention and MLP Linears to NF4 (gp.nn.quantize_linears;
-- decode runs the fused dequant-GEMV); the PyTorch peer stays bf16.
-- tokens/s counts every row's new tokens over the whole generate call
-- (prefill included), median of --reps calls after one warm-up call. "of
-- floor" is that over the floor of a step: the weights and the KV cache's
-- filled positions (on average prompt + max_new / 2) read once at the copy
-- bandwidth measured in the same run, B tokens a step (prefill counted as
-- steps, so a lower bound of the decode loop's own fraction).
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'model', 'gpt', 'gpt, gpt2, llama1024 or smollm2 (random weights)'},
  {'n-embd', 768, 'embedding width (gpt)'}, {'n-layer', 12, 'blocks (gpt)'}, {'n-head', 12, 'heads (gpt)'},
  {'block', 1024, 'block size (position table; gpt)'}, {'vocab', 256, 'vocabulary (gpt)'},
  {'layers', 0, 'keep this many layers of a Llama (0: all)'},
  {'batches', '1,16', 'batch sizes (rows generated together)'}, {'max-new', 200, 'new tokens per row'},
  {'prompt-len', 8, 'prompt tokens'}, {'reps', 3, 'timed generate calls per setting'},
  {'bf16', false, 'bf16 model'}, {'nf4', false, 'NF4 attention and MLP weights (needs --bf16)'}, {'greedy', false, 'argmax instead of sampling (temperature 1, top-k 50)'},
  {'top-p', 1, 'top-p of the sampling (1: off; with top-k 50)'},
  {'no-torch', false, 'skip the PyTorch peer'}, {'torch-modes', 'eager,compile', 'PyTorch loops to run'},
}, {usage = 'gpush scripts/bench/decode.lua [flags]'})

local dev = gp.device()
gp.manual_seed(1)
local model, desc, kv -- kv: {layers, heads, head_dim} of the cache
if a.model == 'gpt' or a.model == 'gpt2' then
  local g2 = a.model == 'gpt2'
  local cfg = {vocab_size = g2 and 50257 or a.vocab, block_size = g2 and 1024 or a.block, n_embd = g2 and 768 or a.n_embd,
               n_layer = g2 and 12 or a.n_layer, n_head = g2 and 12 or a.n_head}
  a.vocab, a.block, a.n_embd, a.n_layer, a.n_head = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.n_head
  model = gp.nn.GPT(cfg)
  desc = string.format('%s d%d, %d layers, %d heads, vocab %d', a.model, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size)
  kv = {cfg.n_layer, cfg.n_head, cfg.n_embd / cfg.n_head}
elseif gp.models.SHAPES[a.model] then
  local cfg = {}
  for k, v in pairs(gp.models.SHAPES[a.model]) do cfg[k] = v end
  if a.layers > 0 then cfg.num_hidden_layers = a.layers end
  a.vocab = cfg.vocab_size
  model = gp.models.Llama(cfg, {dtype = a.bf16 and 'bf16' or 'f32'})
  desc = string.format('%s (random weights) d%d, %d layers, %d heads (%d KV), vocab %d', a.model, cfg.hidden_size,
    cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size)
  kv = {cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size / cfg.num_attention_heads}
  a.peer = string.format('--arch llama --hidden %d --inter %d --layers %d --heads %d --kv-heads %d --theta %g --vocab %d%s',
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
    cfg.rope_theta, cfg.vocab_size, cfg.tie_word_embeddings and ' --tied' or '')
else
  local names = {}
  for k in pairs(gp.models.SHAPES) do names[#names + 1] = k end
  table.sort(names)
  io.stderr:write(string.format('decode.lua: --model must be gpt, gpt2, %s; got %q\n', table.concat(names, ', '), a.model))
  os.exit(2)
end
if a.bf16 then model:to('bf16') end
if a.nf4 then
  if not a.bf16 then
    io.stderr:write('decode.lua: --nf4 needs --bf16 (NF4 products compute in bf16)\n')
    os.exit(2)
  end
  gp.nn.quantize_linears(model, {kind = 'nf4', block = 64})
  desc = desc .. ', NF4 attention and MLP weights'
end
model:eval()
local esize = a.bf16 and 2 or 4
local wbytes = gp.nn.weight_bytes(model) -- parameters and quantized weights (codes and scales)
local copy_bw
do
  local n = dev == 'cuda' and 128 * 2 ^ 20 or 2 ^ 20
  local s, d = gp.empty({n}, {device = dev}), gp.empty({n}, {device = dev})
  copy_bw = 2 * 4 * n / (gp.time(function() gp.k.copy(d, s) end, {warmup = 2, iters = 10}) * 1e6) -- GB/s
end
print(string.format('decode bench: %s, %d new tokens, prompt %d, %s%s, device %s; %.1f MB of weights, copy %.0f GB/s',
  desc, a.max_new, a.prompt_len, a.bf16 and 'bf16' or 'f32',
  a.greedy and ', greedy' or (', sampling' .. (a.top_p < 1 and string.format(' (top-p %g)', a.top_p) or '')), dev,
  wbytes / 1e6, copy_bw))
-- the floor's tokens/s at batch B: B tokens a step of (weights + the mean filled KV cache) bytes
local function floor_tps(B)
  local kvb = 2 * kv[1] * B * kv[2] * kv[3] * esize * (a.prompt_len + a.max_new / 2)
  return B / ((wbytes + kvb) / (copy_bw * 1e9))
end

local prompt = {}
for i = 1, a.prompt_len do prompt[i] = (i * 7) % a.vocab end

local function run(B, graph)
  local o = {n = B, max_new = a.max_new, graph = graph}
  if a.greedy then o.greedy = true else o.temperature = 1.0; o.top_k = 50; o.top_p = a.top_p < 1 and a.top_p or nil end
  local r = gp.generate(model, {prompt}, o) -- warm-up
  local times = {}
  for i = 1, a.reps do
    gp.sync()
    local t0 = gp.train.now()
    r = gp.generate(model, {prompt}, o)
    gp.sync()
    times[i] = gp.train.now() - t0
  end
  table.sort(times)
  local t = times[math.floor((#times + 1) / 2)]
  return B * a.max_new / t, t, r.graph
end

local rows = {}
for b in tostring(a.batches):gmatch('%d+') do
  local B = tonumber(b)
  local on, t_on, captured = run(B, true)
  local off, t_off = run(B, false)
  rows[#rows + 1] = {B = B, on = on, off = off}
  print(string.format('{"batch": %d, "graph_tokens_per_s": %.1f, "graph_s": %.4f, "captured": %s, "eager_tokens_per_s": %.1f, ' ..
    '"eager_s": %.4f, "floor_tokens_per_s": %.1f, "graph_of_floor": %.3f}', B, on, t_on, tostring(captured), off, t_off,
    floor_tps(B), on / floor_tps(B)))
end

if dev == 'cuda' and not a.no_torch then
  local arch = a.peer or string.format('--arch gpt --hidden %d --layers %d --heads %d --block %d --vocab %d', a.n_embd,
    a.n_layer, a.n_head, a.block, a.vocab)
  local cmd = string.format('python3 scripts/bench/torch_decode.py %s --batches %s --max-new %d --prompt-len %d ' ..
    '--top-p %g --modes %s --reps %d%s%s 2>&1', arch, a.batches, a.max_new, a.prompt_len, a.top_p, a.torch_modes, a.reps,
    a.bf16 and ' --bf16' or '', a.greedy and ' --greedy' or '')
  local p = io.popen(cmd)
  local txt = p and p:read('*a') or ''
  if p then p:close() end
  local peer = {}
  for line in txt:gmatch('[^\n]+') do
    local B = tonumber(line:match('^{"batch": (%d+)'))
    if B then
      peer[B] = {eager = tonumber(line:match('"torch_tokens_per_s": ([%d%.]+)')),
                 compile = tonumber(line:match('"compile_tokens_per_s": ([%d%.]+)'))}
    end
  end
  if next(peer) == nil then
    print('pytorch peer: not run (' .. (txt:gsub('%s+$', ''):sub(-600)) .. ')')
  else
    print('pytorch: ' .. (txt:match('{"torch":[^\n]*') or '?'))
    local function f(v) return v and string.format('%8.1f', v) or '       -' end
    local function x(u, v) return v and string.format('%.2fx', u / v) or '-' end
    for _, r in ipairs(rows) do
      local t = peer[r.B]
      if t then
        print(string.format('batch %2d: gpush graph %8.1f tok/s | gpush eager %8.1f | torch eager %s | torch compile ' ..
          '(reduce-overhead) %s | graph/eager %s | graph/compile %s', r.B, r.on, r.off, f(t.eager), f(t.compile),
          x(r.on, t.eager), x(r.on, t.compile)))
      end
    end
  end
end
