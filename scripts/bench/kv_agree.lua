-- Compressed KV caches on a real model: greedy continuations of 20 chat
-- prompts with the cache in bf16, int8 and fp8 (gp.generate{kv_dtype = ...}),
-- and how many cached positions fit in a memory budget with each.
--
--   gpush scripts/bench/kv_agree.lua [--model smollm2] [--max-new 32] [--budget-mb 256]
--
-- Agreement: a continuation counts when its --max-new tokens equal those of
-- the cache in the model's dtype, token for token (the issue's bar: 90% of
-- them); the first token where they part is printed for the others. With
-- --vs-f32 the model loaded in f32 is compared with the same reference: how
-- often two float precisions of the same weights agree, for scale; with
-- --center-off also an int8 cache that quantizes the keys as they are
-- (gp.KVCache{center = false}, the cache before 2026-11-30). Every row and the
-- reference run the op-by-op decode step (gp.decode_step(false)): a compressed
-- cache always takes it, and the one-kernel step of a bf16 model sums in
-- another order. With --floor also the reference's cache with the one-kernel
-- step (the default for a bf16 model): the same numbers summed in another
-- order, so the agreement a change of rounding alone reaches on this model;
-- and the reference again, run to run (a deterministic step gives 100%).
-- With --forced each row is also fed the reference's continuation token by
-- token (teacher forcing: one decode step a token over the row's cache) and
-- counts the positions whose argmax is the reference's token: free-running
-- continuations part for good at the first near tie, so this counts every
-- position once and tells caches apart where the first measure cannot.
-- Capacity: the largest KV cache of the model (every layer, batch 1) that
-- gp.KVCache can allocate under
-- gp.set_memory_limit (a binary search over the capacity; the limit is the
-- bytes the weights already hold plus the budget: the allocator's reserved
-- device bytes, host bytes on the CPU), beside the bytes a position takes.
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'model', 'smollm2', 'a short name, a Hugging Face directory or a .gguf file'},
  {'max-new', 32, 'tokens a continuation'},
  {'dtype', '', 'the model\'s dtype (default bf16 on the GPU, f32 on the CPU)'},
  {'prompts', 20, 'how many of the 20 prompts (fewer for a quick CPU run)'},
  {'budget-mb', 256, 'the memory budget of the capacity search (MiB)'},
  {'vs-f32', false, 'also the same model in f32 (f32 cache) against the reference: the agreement two float precisions reach'},
  {'center-off', false, 'also an int8 cache whose keys are quantized as they are (center = false; "int8 raw")'},
  {'forced', false, 'also the teacher-forced top-1 agreement of each row over the reference\'s continuations'},
  {'floor', false, 'also the reference run again, and with the one-kernel decode step (gp.decode_step(true)): the agreement a change of summation order alone reaches'},
}, {usage = 'gpush scripts/bench/kv_agree.lua [flags]', description = 'bf16 / int8 / fp8 KV caches: greedy agreement and capacity.'})

local dev = gp.device()
local dtype = a.dtype ~= '' and a.dtype or (dev == 'cuda' and 'bf16' or 'f32')
local model, tok = gp.models.load(a.model, {dtype = dtype})
local QUESTIONS = {
  'What is the capital of France?', 'Write a haiku about the sea.', 'Explain photosynthesis in two sentences.',
  'Give me three tips for learning to program.', 'What is 17 times 23?', 'Who wrote Romeo and Juliet?',
  'Describe a cat to someone who has never seen one.', 'What causes the seasons on Earth?',
  'Translate "good morning" into Spanish and French.', 'Name the planets of the solar system.',
  'Why is the sky blue?', 'Suggest a name for a small bakery.', 'What is a prime number?',
  'How do I boil an egg?', 'Summarize the plot of Cinderella.', 'What is the difference between weather and climate?',
  'Write a short thank-you note to a teacher.', 'What does a CPU do?', 'List three uses of a paperclip.',
  'What is the boiling point of water in Fahrenheit?',
}
local prompts = {}
for i = 1, math.min(a.prompts, #QUESTIONS) do
  if tok then
    local text = tok:apply_chat_template({{role = 'user', content = QUESTIONS[i]}}, {add_generation_prompt = true})
    prompts[i] = tok:encode(text, {add_special_tokens = false})
  else -- a model without a tokenizer (a test fixture): made-up ids
    prompts[i] = {}
    for t = 1, 8 + i do prompts[i][t] = (i * 31 + t * 7) % model.config.vocab_size end
  end
end

-- row's cache of model m for capacity positions (batch 1)
local function row_cache(row, m, capacity)
  return gp.KVCache {batch = 1, heads = model.config.num_key_value_heads, capacity = capacity,
                     head_dim = model.config.head_dim, layers = model.config.num_hidden_layers,
                     dtype = m.lm_head.weight.dtype, device = dev, kv_dtype = row.kvd, center = not row.raw}
end

-- one prompt at a time (no padding): the continuation's ids. row.kvd: the
-- cache's kv_dtype (nil: the model's dtype); row.model: another model;
-- row.raw: an int8 cache whose keys are quantized as they are (center =
-- false); row.kernel: the one-kernel decode step; an explicit cache (raw,
-- kernel, again) keeps the step captured for the reference from being reused
local function run(row)
  local out = {}
  gp.decode_step(row.kernel == true)
  for i, p in ipairs(prompts) do
    local cache = (row.raw or row.kernel or row.again) and row_cache(row, row.model or model, #p + a.max_new) or nil
    local r = gp.generate(row.model or model, {p},
      {max_new = a.max_new, greedy = true, stop = {}, kv_dtype = row.kvd, cache = cache})
    out[i] = r.lists[1]
  end
  return out
end

print(string.format('kv agree: %s %s on %s, %d prompts, %d greedy tokens each', a.model, dtype, dev, #prompts, a.max_new))
local ref = run {}
local rows = {{name = 'int8', kvd = 'int8'}, {name = 'fp8', kvd = 'fp8'}}
if a.center_off then table.insert(rows, 2, {name = 'int8 raw', kvd = 'int8', raw = true}) end
if a.floor then
  table.insert(rows, 1, {name = 'one kernel', kernel = true})
  table.insert(rows, 1, {name = 'again', again = true})
  if dtype ~= 'bf16' or dev ~= 'cuda' then
    print('  (the one-kernel step is bf16\'s, on the GPU: here it is the op-by-op step, the reference itself)')
  end
end
if a.vs_f32 and dtype ~= 'f32' then
  rows[#rows + 1] = {name = 'f32 model', model = (gp.models.load(a.model, {dtype = 'f32'}))}
end
for _, row in ipairs(rows) do
  local got, same, parted = run(row), 0, {}
  for i = 1, #prompts do
    local k = 1
    while k <= #ref[i] and ref[i][k] == got[i][k] do k = k + 1 end
    if k > #ref[i] and #got[i] == #ref[i] then same = same + 1 else parted[#parted + 1] = tostring(k) end
  end
  print(string.format('  %-9s identical continuations: %d of %d (%.0f%%)%s', row.name, same, #prompts, 100 * same / #prompts,
    #parted > 0 and ('; the others part at token ' .. table.concat(parted, ', ')) or ''))
end
if tok then print(string.format('  %s reply to prompt 1: %q', dtype, tok:decode(ref[1]))) end

-- teacher forcing: each prompt, then the reference's continuation one token a
-- decode step (device positions where the model takes them, as gp.generate's
-- step) over the row's cache;
-- the positions whose argmax is the reference's next token
local function forced(row)
  gp.decode_step(row.kernel == true)
  local m, same, total = row.model or model, 0, 0
  local pos = gp.zeros({1}, {dtype = 'i64', device = dev})
  gp.no_grad(function()
    for i, p in ipairs(prompts) do
      local r = ref[i]
      local cache = row_cache(row, m, #p + #r)
      local dpos = m.supports_device_positions and m:supports_device_positions(cache)
      local lg = m:forward_cached(gp.tensor({p}, {dtype = 'i64', device = dev}), cache, 0):select(2, #p)
      for k = 1, #r do
        if lg:view({-1}):argmax():item() == r[k] then same = same + 1 end
        total = total + 1
        if k == #r then break end
        local at = #p + k - 1
        if dpos then gp.k.fill(pos, at) end
        lg = m:forward_cached(gp.tensor({{r[k]}}, {dtype = 'i64', device = dev}), cache, dpos and pos or at)
      end
    end
  end)
  return same, total
end
if a.forced then
  for _, row in ipairs(rows) do
    local same, total = forced(row)
    print(string.format('  %-9s teacher-forced top-1: %d of %d positions (%.1f%%)', row.name, same, total,
      100 * same / total))
  end
end

-- capacity under a budget
collectgarbage('collect')
gp.empty_cache()
local m0 = gp.memory()
local budget = a.budget_mb * 2 ^ 20 + (dev == 'cuda' and m0.reserved or m0.host_in_use)
local function fits(kvd, cap)
  gp.set_memory_limit(budget)
  local ok = pcall(model.new_cache, model, 1, cap, dtype, dev, kvd)
  gp.set_memory_limit(0)
  collectgarbage('collect')
  gp.empty_cache()
  return ok
end
local caps = {}
for _, kvd in ipairs {dtype, 'int8', 'fp8'} do
  local k = kvd ~= dtype and kvd or nil
  local lo, hi = 0, 1
  while fits(k, hi) do lo, hi = hi, hi * 2 end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if fits(k, mid) then lo = mid else hi = mid end
  end
  caps[kvd] = lo
  local per = model:new_cache(1, 2, dtype, dev, k):nbytes() - model:new_cache(1, 1, dtype, dev, k):nbytes()
  print(string.format('  %-5s most positions in %d MiB: %d (%.0f bytes a position, every layer)', kvd, a.budget_mb, lo,
    per))
end
print(string.format('  int8 / %s capacity: %.2fx, fp8 / %s: %.2fx', dtype, caps.int8 / caps[dtype], dtype, caps.fp8 / caps[dtype]))
