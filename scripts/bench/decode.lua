-- Decode benchmark: tokens/s of gp.generate for a randomly initialized GPT
-- (default d768, 12 layers, 12 heads: GPT-2 small sized, byte vocabulary)
-- at batch 1 and 16, 200 new tokens after a short prompt, with the decode
-- step captured as a CUDA graph (graph on) and run eagerly (graph off),
-- beside a PyTorch loop with a KV cache (scripts/bench/torch_decode.py) when
-- python3 has torch.
--   gpush scripts/bench/decode.lua [--batches 1,16] [--max-new 200] [--bf16] [--greedy]
-- tokens/s counts every row's new tokens over the whole generate call
-- (prefill included), median of --reps calls after one warm-up call.
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'n-embd', 768, 'embedding width'}, {'n-layer', 12, 'blocks'}, {'n-head', 12, 'heads'},
  {'block', 1024, 'block size (position table)'}, {'vocab', 256, 'vocabulary'},
  {'batches', '1,16', 'batch sizes (rows generated together)'}, {'max-new', 200, 'new tokens per row'},
  {'prompt-len', 8, 'prompt tokens'}, {'reps', 3, 'timed generate calls per setting'},
  {'bf16', false, 'bf16 model'}, {'greedy', false, 'argmax instead of sampling (temperature 1, top-k 50)'},
  {'no-torch', false, 'skip the PyTorch peer'},
}, {usage = 'gpush scripts/bench/decode.lua [flags]'})

local dev = gp.device()
gp.manual_seed(1)
local model = gp.nn.GPT {vocab_size = a.vocab, block_size = a.block, n_embd = a.n_embd, n_layer = a.n_layer,
                         n_head = a.n_head}
if a.bf16 then model:to('bf16') end
model:eval()
print(string.format('decode bench: d%d, %d layers, %d heads, vocab %d, %d new tokens, prompt %d, %s%s, device %s',
  a.n_embd, a.n_layer, a.n_head, a.vocab, a.max_new, a.prompt_len, a.bf16 and 'bf16' or 'f32',
  a.greedy and ', greedy' or ', sampling', dev))

local prompt = {}
for i = 1, a.prompt_len do prompt[i] = (i * 7) % a.vocab end

local function run(B, graph)
  local o = {n = B, max_new = a.max_new, graph = graph}
  if a.greedy then o.greedy = true else o.temperature = 1.0; o.top_k = 50 end
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
  print(string.format('{"batch": %d, "graph_tokens_per_s": %.1f, "graph_s": %.4f, "captured": %s, "eager_tokens_per_s": %.1f, "eager_s": %.4f}',
    B, on, t_on, tostring(captured), off, t_off))
end

if dev == 'cuda' and not a.no_torch then
  local cmd = string.format('python3 scripts/bench/torch_decode.py --n-embd %d --n-layer %d --n-head %d --block %d ' ..
    '--vocab %d --batches %s --max-new %d --prompt-len %d%s%s 2>&1', a.n_embd, a.n_layer, a.n_head, a.block, a.vocab,
    a.batches, a.max_new, a.prompt_len, a.bf16 and ' --bf16' or '', a.greedy and ' --greedy' or '')
  local p = io.popen(cmd)
  local txt = p and p:read('*a') or ''
  if p then p:close() end
  local peer = {}
  for B, tps in txt:gmatch('"batch": (%d+), "torch_tokens_per_s": ([%d%.]+)') do peer[tonumber(B)] = tonumber(tps) end
  if next(peer) == nil then
    print('pytorch peer: not run (' .. (txt:gsub('%s+$', ''):sub(-300)) .. ')')
  else
    for _, r in ipairs(rows) do
      local t = peer[r.B]
      if t then
        print(string.format('batch %2d: gpush graph %8.1f tok/s | gpush eager %8.1f tok/s | pytorch %8.1f tok/s | graph/pytorch %.2fx',
          r.B, r.on, r.off, t, r.on / t))
      end
    end
  end
end
