-- Real-model benchmark: a loaded model's prefill tokens/s (one forward over
-- --prompt-len tokens at batch 1) and decode tokens/s (gp.generate, greedy,
-- --max-new new tokens after a short prompt, at each of --batches), beside
-- transformers on the same weights (scripts/bench/torch_models.py: eager, and
-- generate with the static cache compiled by torch.compile) when python3 has
-- torch and transformers. The weights reach transformers through
-- gp.models.save (the model as gpush loaded it, e.g. SmolLM2 dequantized from
-- its GGUF), so both sides compute with the same numbers.
--   gpush scripts/bench/models.lua [--model smollm2] [--dtype bf16] [--batches 1,16] [--no-torch]
-- Times: prefill the median of gp.time; decode the median of --reps generate
-- calls after a warm-up one, new tokens of every row over the whole call
-- (prefill included).
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'model', 'smollm2', 'a short name, a Hugging Face directory or a .gguf file'},
  {'dtype', 'bf16', 'f32, bf16 or f16'},
  {'prompt-len', 512, 'prefill tokens'},
  {'batches', '1,16', 'decode batch sizes'},
  {'max-new', 128, 'new tokens per row when decoding'},
  {'reps', 3, 'timed generate calls per batch'},
  {'no-torch', false, 'skip the transformers peer'},
  {'torch-modes', 'eager,compile', 'the peer\'s modes: eager, compile (static cache + torch.compile)'},
  {'json', '', 'append the results as JSON lines to this file'},
}, {usage = 'gpush scripts/bench/models.lua [flags]'})

local dev = gp.device()
local t0 = gp.train.now()
local model, tok = gp.models.load(a.model, {dtype = a.dtype})
local c = model.config
print(string.format('models bench: %s (%s, %d layers, d %d, %d heads, %s params) %s on %s, loaded in %.1f s',
  a.model, c.model_type or '?', c.n_layer or 0, c.n_embd or 0, c.n_head or 0, model:num_parameters(), a.dtype, dev,
  gp.train.now() - t0))

-- a fixed prompt of real text
local text = ('To be, or not to be, that is the question: whether \'tis nobler in the mind to suffer the slings and arrows '
  .. 'of outrageous fortune, or to take arms against a sea of troubles. '):rep(64)
local ids = {}
if tok then ids = tok:encode(text, {add_special_tokens = false})
else for i = 1, 2048 do ids[i] = (i * 7) % c.vocab_size end end -- a model without a tokenizer: made-up ids
local function first(n) return {unpack(ids, 1, n)} end
local results = {}

-- prefill
local x = gp.tensor({first(a.prompt_len)}, {dtype = 'i64', device = dev})
local pre_ms = gp.time(function() return gp.no_grad(model.forward, model, x) end, {warmup = 3, iters = 10})
results[#results + 1] = {what = 'prefill', tokens = a.prompt_len, ms = pre_ms, tokens_per_s = a.prompt_len / pre_ms * 1e3}
print(string.format('gpush prefill %d tokens: %.2f ms, %.0f tokens/s', a.prompt_len, pre_ms, a.prompt_len / pre_ms * 1e3))

-- decode
local prompt = first(16)
for b in tostring(a.batches):gmatch('%d+') do
  local B = tonumber(b)
  local o = {n = B, max_new = a.max_new, greedy = true}
  local r = gp.generate(model, {prompt}, o)
  local times = {}
  for i = 1, a.reps do
    gp.sync()
    local s = gp.train.now()
    r = gp.generate(model, {prompt}, o)
    gp.sync()
    times[i] = gp.train.now() - s
  end
  table.sort(times)
  local t = times[math.floor((#times + 1) / 2)]
  results[#results + 1] = {what = 'decode', batch = B, new = a.max_new, s = t, tokens_per_s = B * a.max_new / t,
                           graph = r.graph == true}
  print(string.format('gpush decode batch %d: %.0f tokens/s (%.3f s for %d new tokens a row%s)', B, B * a.max_new / t, t,
    a.max_new, r.graph and ', CUDA graph' or ''))
end

if dev == 'cuda' and not a.no_torch then
  local dir = os.tmpname()
  os.remove(dir)
  gp.models.save(model, dir)
  local f = assert(io.open(dir .. '/ids.json', 'w'))
  f:write(gp.json.encode({prefill = first(a.prompt_len), prompt = prompt}))
  f:close()
  local here = (arg[0]:match('^(.*)/[^/]*$') or '.')
  local cmd = string.format("python3 %s/torch_models.py --dir '%s' --dtype %s --batches %s --max-new %d --reps %d --modes %s 2>&1",
    here, dir, a.dtype, a.batches, a.max_new, a.reps, a.torch_modes)
  local p = io.popen(cmd)
  for line in p:lines() do
    local ok, v = pcall(gp.json.decode, line)
    if ok and type(v) == 'table' then
      results[#results + 1] = v
      print(string.format('torch %s %s: %.0f tokens/s', v.mode, v.what .. (v.batch and (' batch ' .. v.batch) or ''), v.tokens_per_s))
    else
      print('torch: ' .. line)
    end
  end
  p:close()
  os.execute("rm -rf '" .. dir .. "'")
end

if a.json ~= '' then
  local f = assert(io.open(a.json, 'a'))
  for _, r in ipairs(results) do r.model = a.model; r.dtype = a.dtype; r.device = dev; f:write(gp.json.encode(r), '\n') end
  f:close()
end
