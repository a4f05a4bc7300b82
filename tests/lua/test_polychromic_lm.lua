-- gp.polychromic.lm: the real-model polychromic experiment (issue 20) on the
-- committed fixtures: the llama GGUF (its 128-token byte tokenizer) as the
-- reply model over an NF4 base with LoRA, the BERT fixture as the sentence
-- encoder, the Shakespeare fixture text; the checked reward by hand, the task
-- split, the narrowed log-probabilities, the loop end to end, bad input.
local T = require 'lib'
local gp = require 'gpush'
local L = gp.polychromic.lm
local P = gp.polychromic

local cpu = {dtype = 'f32', device = 'cpu'}
local fx = T.root .. '/tests/fixtures'

T.test('polychromic.lm: the reply reward checks length, the word, copies, repetition and language', function()
  local line = 'To be, or not to be, that is the question.'
  local r, failed = L.reply_reward(line, 'river', 'I would rather sit by the river and think it over.')
  T.eq(r, 1)
  T.eq(#failed, 0)
  -- the plural and a capital count; punctuation around the word too
  T.eq((L.reply_reward(line, 'river', 'Rivers know the answer, friend.')), 1)
  T.eq((L.reply_reward(line, 'river', '"River!" she said, and left.')), 1)
  -- one check failed of five: 0.5 * 4/5
  r, failed = L.reply_reward(line, 'river', 'I would rather sit by the sea and think it over.')
  T.near(r, 0.4, 1e-12)
  T.eq(#failed, 1)
  T.eq(failed[1], 'word')
  local long = 'river ' .. string.rep('and then some more words ', 6)
  local _, f3 = L.reply_reward(line, 'river', long)
  T.eq(f3[1], 'length')
  T.eq(select(2, L.reply_reward(line, 'river', 'river sky'))[1], 'length') -- fewer than 3 words
  -- a copy of the line (with the word added) is not a reply
  local _, f4 = L.reply_reward(line, 'river', 'To be, or not to be, that is the question, river.')
  T.eq(f4[1], 'not_copy')
  local _, f5 = L.reply_reward(line, 'river', 'the river the river the river is here')
  T.eq(f5[1], 'no_repeat')
  local _, f6 = L.reply_reward(line, 'river', 'the river flows 1234567890 1234567890')
  T.eq(f6[1], 'language')
  T.eq(select(2, L.reply_reward(line, 'river', 'the river \226\128\148 flows on <|im_end|>'))[1], 'language')
  -- nothing passes: empty reply
  local r0 = L.reply_reward(line, 'river', '')
  T.ok(r0 < 0.5, 'an empty reply is invalid')
  -- max_words
  T.eq((L.reply_reward(line, 'river', 'a river runs through here today', {max_words = 4})) < 0.5, true)
end)

T.test('polychromic.lm: usable lines, the fixed train / held-out split and the chat template', function()
  local lines = L.text_lines(fx .. '/tokenizers/shakespeare.txt')
  T.ok(#lines > 100, 'lines: ' .. #lines)
  local seen = {}
  for _, s in ipairs(lines) do
    T.ok(#s >= 25 and #s <= 100 and s:match('^%u') and s:match('[%.!%?]$'), s)
    T.ok(not seen[s], 'each line once')
    seen[s] = true
  end
  local hf = gp.tokenizer.load(fx .. '/tokenizers/smollm2')
  local tok = L.tokenizer(hf)
  T.eq(tok.stop, hf:token_to_id('<|im_end|>'))
  local task = L.reply_task(lines, tok, {eval_prompts = 5, train_prompts = 20})
  T.eq(#task.eval_prompts, 5)
  T.eq(#task.prompts, 20)
  local train_lines = {}
  for _, p in ipairs(task.prompts) do
    T.ok(p:find('^<|im_start|>system\n'), 'the chat template: ' .. p)
    T.ok(p:find('<|im_start|>assistant\n$'), 'ends with the generation prompt')
    train_lines[task.meta[p].line] = true
  end
  for _, p in ipairs(task.eval_prompts) do
    local m = task.meta[p]
    T.ok(not train_lines[m.line], 'a held-out line is not a train line')
    T.ok(p:find('use the word ' .. m.word .. ': ' .. m.line, 1, true), p)
    -- held out: a line at an index divisible by 10
    local idx
    for i, s in ipairs(lines) do if s == m.line then idx = i end end
    T.eq(idx % 10, 0)
    T.eq(task.reward(p, 'A ' .. m.word .. ' for you, my friend, and for me.'), 1)
  end
  -- the same split every time
  local again = L.reply_task(lines, tok, {eval_prompts = 5, train_prompts = 20})
  T.eq(again.eval_prompts[2], task.eval_prompts[2])
  -- the special tokens are written by the template, not added by encode; decode skips them
  local ids = tok:encode(task.prompts[1])
  T.eq(ids[1], hf:token_to_id('<|im_start|>'))
  T.eq(tok:decode({hf:token_to_id('<|im_end|>')}), '')
end)

-- the fixture pieces: reply model (NF4 + LoRA), tokenizer, task, encoder
local function fixture(block)
  local m, hf = gp.models.load(fx .. '/models/llama_gqa.gguf', cpu)
  local params = m:num_parameters()
  gp.nn.quantize_linears(m, {block = block or 32})
  gp.lora.apply(m, {rank = 4, alpha = 8})
  local tok = L.tokenizer(hf)
  local lines = L.text_lines(fx .. '/tokenizers/shakespeare.txt')
  -- a short message: the fixture's byte tokenizer and 128 positions
  local task = L.reply_task(lines, tok, {eval_prompts = 2, train_prompts = 8,
    message = function(w, l) return w .. ': ' .. l:sub(1, 30) end})
  local b = gp.models.load(fx .. '/models/bert', cpu)
  local btok = {encode = function(_, s)
    local r = {1}
    for i = 1, math.min(#s, 20) do r[#r + 1] = 3 + s:byte(i) % 120 end
    r[#r + 1] = 2
    return r
  end}
  local enc = require('gpush.models.bert').sentence(b, btok, {pooling = 'mean', normalize = true, max_seq_length = 32})
  return m, tok, task, enc, params
end

T.test('polychromic.lm: log-probabilities over the reply columns only equal the full ones', function()
  local m, tok, task = fixture()
  gp.manual_seed(5)
  local ro = P.rollout(m, tok, {task.prompts[1], task.prompts[2]}, {n = 2, max_new = 5, temperature = 1, top_p = 1})
  T.ok(ro.from > 1, 'a Llama scores from the shortest prompt on')
  local tg = P.scored_targets(ro)
  T.eq(tg:size(2), ro.T - ro.from)
  gp.no_grad(function()
    local full = P.token_logp(m, ro.full, ro.targets)
    local part = P.token_logp(m, ro.full, tg)
    T.ok(T.relnorm(part, full:narrow(2, ro.from, ro.T - ro.from)) < 1e-5, 'the same log-probabilities')
    -- nothing scored before from
    T.eq(ro.targets:narrow(2, 1, ro.from - 1):ne(-100):sum():item(), 0)
  end)
  -- a model without :hidden scores every column; an nn.GPT has :hidden, and its head runs on the last columns only
  local plain = setmetatable({}, {__call = function(_, x) return gp.zeros({x:size(1), x:size(2), 8}) end})
  T.raises(function() P.token_logp(plain, gp.zeros({1, 6}, {dtype = 'i64', device = 'cpu'}),
    gp.zeros({1, 3}, {dtype = 'i64', device = 'cpu'})) end, 'token_logp', 'targets have 3 columns for rows of 6 tokens')
  local g = gp.nn.GPT {vocab_size = 8, block_size = 8, n_embd = 8, n_layer = 1, n_head = 1}
  local ids, t5 = gp.randint(0, 8, {2, 6}), gp.randint(0, 8, {2, 5})
  gp.no_grad(function()
    T.ok(T.relnorm(P.token_logp(g, ids, t5:narrow(2, 3, 3)), P.token_logp(g, ids, t5):narrow(2, 3, 3)) < 1e-5,
      'nn.GPT: the last columns alone')
  end)
end)

T.test('polychromic.lm: rollouts from a dense copy (sample_from) equal the QLoRA model\'s, the adapters merged into it', function()
  local m, tok, task = fixture()
  for _, e in ipairs(gp.lora.modules(m)) do gp.nn.init.normal_(e[2].lora_B, 0, 0.3) end
  local prompts = {task.prompts[1], task.prompts[2]}
  local function replies()
    gp.manual_seed(7)
    return table.concat(P.rollout(m, tok, prompts, {n = 3, max_new = 6, temperature = 1, top_p = 1}).replies, '|')
  end
  local plain = replies()
  local dense = gp.models.load(fx .. '/models/llama_gqa.gguf', cpu)
  P.sample_from(m, dense)
  T.eq(replies(), plain)
  -- the copy holds the dequantized base plus the adapters (not the checkpoint's own weights)
  local lq = m.model.layers[1].self_attn.v_proj
  T.ok(T.relnorm(dense.model.layers[1].self_attn.v_proj.weight, lq.weight:dequantize() + lq:delta()) < 1e-6)
  P.sample_from(m, nil)
end)

T.test('polychromic.lm: the experiment end to end on the fixtures (NF4 base, LoRA, checked rewards, encoder diversity, report)', function()
  local m, tok, task, enc, params = fixture()
  -- the frozen base before
  local q = m.model.layers[1].self_attn.q_proj.weight
  local base_before = {emb = m.model.embed_tokens.weight:clone(), head = m.lm_head.weight:clone(),
                       q = q:dequantize():clone(), norm = m.model.norm.weight:clone()}
  local log = os.tmpname()
  local rep = L.run(m, tok, task, enc, {modes = {'base', 'rl', 'poly'}, seeds = {1, 2}, steps = 2, n = 3,
    prompts_per_step = 2, eval_n = 3, max_new = 6, temperature = 1, top_p = 1, lr = 1e-2, epochs = 2, set_div = 'pair',
    valid_only = true, floor = 1, log = log})
  -- the JSONL: a line per step of rl and poly and per evaluation, for both seeds
  local steps, evals = 0, 0
  for line in io.lines(log) do
    local r = gp.json.decode(line)
    T.ok(r.run and r.mode and r.seed, 'run, mode and seed on every line')
    if r.eval then
      evals = evals + 1
      for _, k in ipairs {'mean_reward', 'pass_at_n', 'distinct_valid', 'set_diversity'} do T.ok(type(r[k]) == 'number', k) end
    else
      steps = steps + 1
      T.ok(r.reward >= 0 and r.reward <= 1, 'a reward in [0, 1]')
      for _, k in ipairs {'loss', 'set_diversity', 'valid_diversity', 's', 'generation_s', 'update_s'} do
        T.ok(type(r[k]) == 'number', k)
      end
    end
  end
  os.remove(log)
  T.eq(steps, 2 * 2 * 2)
  T.eq(evals, 3 * 2)
  -- the report: means over seeds of every mode, examples side by side, the base's bytes
  for _, mode in ipairs {'base', 'rl', 'poly'} do
    local mm = rep.mean[mode]
    for _, k in ipairs {'mean_reward', 'pass_at_n', 'distinct_valid', 'set_diversity', 'all_diversity'} do
      T.ok(type(mm[k]) == 'number', mode .. ' ' .. k)
    end
    T.eq(#rep.per_seed[mode], 2)
  end
  T.eq(#rep.times.rl, 2)
  T.eq(#rep.examples, 2)
  -- the rewards of the example sets are the checker's
  for _, ex in ipairs(rep.examples) do
    for _, mode in ipairs {'base', 'rl', 'poly'} do
      T.eq(#ex.sets[mode], 3)
      for _, r in ipairs(ex.sets[mode]) do T.eq(r.reward, (L.reply_reward(ex.line, ex.word, r.text, {max_words = 25}))) end
    end
  end
  local bm = rep.base_memory
  T.near(bm.quant_bytes_per_param, 0.5 + 4 / 32, 1e-12) -- NF4 at block 32
  T.eq(bm.params, params) -- every base parameter, the quantized ones included, none of the adapters
  T.ok(bm.bytes_per_param < 4 and bm.bytes_per_param > bm.quant_bytes_per_param, 'the NF4 linears pack the base')
  local text = L.format(rep)
  for _, s in ipairs {'mean reward', 'pass@3', 'distinct valid', 'set diversity', 'example 1', 'bytes a parameter', 'peak memory'} do
    T.ok(text:find(s, 1, true), 'the report shows ' .. s)
  end
  -- the adapters moved (the last run: poly, seed 2), the base did not
  local moved = 0
  for _, e in ipairs(gp.lora.modules(m)) do moved = moved + e[2].lora_B:abs():sum():item() end
  T.ok(moved > 0, 'the adapters changed')
  T.eq((m.model.embed_tokens.weight - base_before.emb):abs():max():item(), 0)
  T.eq((m.lm_head.weight - base_before.head):abs():max():item(), 0)
  T.eq((q:dequantize() - base_before.q):abs():max():item(), 0)
  T.eq((m.model.norm.weight - base_before.norm):abs():max():item(), 0)
  -- reset: the adapters back to the base (B = 0)
  L.reset_adapters(m, 1)
  for _, e in ipairs(gp.lora.modules(m)) do T.eq(e[2].lora_B:abs():sum():item(), 0) end
end)

T.test('polychromic.lm: bad input gives clear errors', function()
  T.raises(function() L.text_lines('/no/such/file.txt') end, 'text_lines: cannot read /no/such/file.txt')
  local empty = os.tmpname()
  local f = io.open(empty, 'w'); f:write('ACT I.\nshort.\n'); f:close()
  T.raises(function() L.text_lines(empty) end, 'has no usable lines')
  os.remove(empty)
  T.raises(function() L.reply_task({'One line.'}, {}) end, 'reply_task: needs a list of at least 10 lines')
  T.raises(function() L.tokenizer(nil) end, 'polychromic.lm.tokenizer: needs a tokenizer')
  T.raises(function() L.encoder_embed({}) end, 'encoder_embed: needs a sentence encoder')
  local m = gp.models.load(fx .. '/models/llama_gqa', cpu)
  T.raises(function() L.reset_adapters(m, 1) end, 'reset_adapters: the model has no LoRA adapters')
  -- LoRA on a module name the model does not have: named, with the model's Linears
  T.raises(function() gp.lora.apply(m, {targets = {'self_attn%.q_proj$', 'self_attn%.qkv$'}}) end,
    "lora.apply: the target 'self_attn%.qkv$' matches no nn.Linear", 'model.layers.0.self_attn.q_proj')
  T.raises(function() gp.lora.apply(m, {targets = 'nothing'}) end, 'lora.apply: no nn.Linear of the model matches the targets nothing')
  -- quantizing: a non-float weight, a block that does not divide the rows
  T.raises(function() gp.quantize(gp.zeros({4, 64}, {dtype = 'i32', device = 'cpu'})) end, 'quantize: w is i32 (4,64)')
  T.raises(function() gp.nn.quantize_linears(m, {block = 256}) end, 'quantize_linears', 'block 256 does not divide its rows')
  -- the text is not a model
  T.raises(function() gp.models.path('no-such-text') end, "no model named 'no-such-text'")
end)

T.test('polychromic.lm: a sentence-transformers directory without its pooling config is an error', function()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute(string.format("mkdir -p '%s' && cp '%s'/models/bert/config.json '%s'/models/bert/model.safetensors '%s'/tokenizers/minilm/tokenizer.json '%s'/",
    dir, fx, fx, fx, dir))
  local function modules(json)
    local f = io.open(dir .. '/modules.json', 'w')
    f:write(json)
    f:close()
  end
  modules('[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]')
  T.raises(function() gp.models.load(dir, cpu) end, 'modules.json has no Pooling module', 'pooling config')
  modules('[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},' ..
    '{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]')
  T.raises(function() gp.models.load(dir, cpu) end, 'the Pooling module has no', '1_Pooling/config.json')
  -- with its pooling config it loads, an encoder
  os.execute(string.format("mkdir -p '%s/1_Pooling' && echo '{\"pooling_mode_mean_tokens\": true}' > '%s/1_Pooling/config.json'", dir, dir))
  local enc = gp.models.load(dir, cpu)
  T.ok(enc.embed ~= nil, 'a sentence encoder')
  os.execute("rm -rf '" .. dir .. "'")
end)
