-- gp.polychromic.lm: the polychromic experiment on a real instruct model
-- (issue 20): QLoRA fine-tuning of a Llama-family reply model (SmolLM2) with
-- a reward a program checks and set diversity from a sentence encoder
-- (all-MiniLM-L6-v2), on prompts made from lines of real text.
--
--   local m, hf = gp.models.load('smollm2')
--   gp.nn.quantize_linears(m)                        -- the frozen NF4 base
--   gp.lora.apply(m, {rank = 16, alpha = 32})
--   local tok = L.tokenizer(hf)
--   local task = L.reply_task(L.text_lines(path), tok)
--   local enc = gp.models.load('all-minilm-l6-v2')
--   local report = L.run(m, tok, task, enc, {modes = {'base', 'rl', 'poly'}, seeds = {1, 2, 3}, steps = 60})
--
-- The task: "Reply to this message in under N words and use the word X:
-- <line>", a line of the text and a word of a fixed list, in the model's chat
-- template. The reward (L.reply_reward) is 1 when every check passes (ends,
-- 3..N words, uses X, not a copy of the line, no repetition, mostly letters)
-- and otherwise half the fraction of checks passed, so a reply is valid
-- (reward > 0.5) exactly when it passes them all. Lines are split into train
-- and held-out prompts by a fixed rule (every 10th usable line is held out).
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
local lora = require 'gpush.nn.lora'
require 'gpush.nn.quant' -- nn.weight_stats
local logger = require 'gpush.train.logger'
local P = require 'gpush.experiments.polychromic'
local raise = rt.raise
local doc = gp.doc

local L = {}

-- the words a reply must use: concrete, common, unrelated to any one line
L.WORDS = {'river', 'crown', 'garden', 'storm', 'candle', 'winter', 'honey', 'mirror', 'thunder', 'lantern', 'ocean',
           'silver', 'forest', 'feather', 'bridge', 'harvest', 'shadow', 'morning', 'stone', 'window', 'apple', 'castle',
           'music', 'letter', 'journey', 'cloud', 'fire', 'bread', 'horse', 'moon', 'tiger', 'violin', 'rain', 'coffee',
           'train', 'book', 'sword', 'island', 'dragon', 'pocket', 'friend', 'clock', 'summer', 'ship', 'flower', 'road',
           'bell', 'mountain'}

---------------------------------------------------------------------------
-- text and task

local SKIP = {Enter = true, Exit = true, Exeunt = true, ACT = true, SCENE = true, Scene = true, Act = true}

-- the usable lines of a text file, in file order: trimmed, 25..100 characters,
-- 5+ words, starting with a capital letter and ending a sentence (. ! ?),
-- letters, spaces and common punctuation only, not a stage direction or a title
function L.text_lines(path, opts)
  opts = opts or {}
  local f = io.open(path, 'rb')
  if not f then raise('polychromic.lm.text_lines: cannot read ' .. tostring(path)) end
  local out, seen = {}, {}
  local lo, hi = opts.min_chars or 25, opts.max_chars or 100
  for line in f:lines() do
    local s = line:gsub('^%s+', ''):gsub('%s+$', '')
    if #s >= lo and #s <= hi and s:match('^%u') and s:match('[%.!%?]$') and not s:find("[^%a%s,;:'%.!%?%-]")
      and not SKIP[s:match('^(%a+)')] and not seen[s] then
      local words, upper, letters = 0, 0, 0
      for _ in s:gmatch('%S+') do words = words + 1 end
      for c in s:gmatch('%a') do
        letters = letters + 1
        if c:match('%u') then upper = upper + 1 end
      end
      if words >= 5 and upper <= 0.2 * letters then
        seen[s] = true
        out[#out + 1] = s
      end
    end
  end
  f:close()
  if #out == 0 then raise('polychromic.lm.text_lines: ' .. path .. ' has no usable lines (25..100 characters, whole sentences)') end
  return out
end
doc(L.text_lines, 'gp.polychromic.lm.text_lines(path, {min_chars=25, max_chars=100})',
  'the usable lines of a text, in order: whole sentences of 5+ words starting with a capital, letters and punctuation only, no stage directions or titles, each once')

local function words_of(s)
  local w = {}
  for x in s:gmatch('%S+') do
    local k = x:lower():gsub("^[^%a]+", ''):gsub("[^%a]+$", '')
    if #k > 0 then w[#w + 1] = k end
  end
  return w
end

-- reward of a reply to a line with the required word: 1 when every check
-- passes, else 0.5 * (checks passed) / (checks); and the failed checks' names
function L.reply_reward(line, word, reply, opts)
  opts = opts or {}
  local max_words = opts.max_words or 25
  local w = words_of(reply)
  local checks = {}
  checks[#checks + 1] = {'length', #w >= 3 and #w <= max_words}
  local has = false
  local wl = word:lower()
  for _, x in ipairs(w) do
    if x == wl or x == wl .. 's' or x == wl .. "'s" or x == wl .. 'es' then has = true end
  end
  checks[#checks + 1] = {'word', has}
  -- not a copy: the line's words make up less than 60% of the reply's distinct words, and the line is not in it
  local lw, distinct, inline = {}, {}, 0
  for _, x in ipairs(words_of(line)) do lw[x] = true end
  for _, x in ipairs(w) do
    if not distinct[x] then
      distinct[x] = true
      if lw[x] then inline = inline + 1 end
    end
  end
  local nd = 0
  for _ in pairs(distinct) do nd = nd + 1 end
  local squash = function(s) return table.concat(words_of(s), ' ') end
  local copy = (nd > 0 and inline / nd >= 0.6) or (#w > 0 and squash(reply):find(squash(line), 1, true) ~= nil)
  checks[#checks + 1] = {'not_copy', not copy}
  -- no repetition: no word of 3+ letters more than 3 times, no repeated 3 words
  local count, tri, rep = {}, {}, false
  for i, x in ipairs(w) do
    if #x >= 3 then
      count[x] = (count[x] or 0) + 1
      if count[x] > 3 then rep = true end
    end
    if i >= 3 then
      local k = w[i - 2] .. ' ' .. w[i - 1] .. ' ' .. x
      if tri[k] then rep = true end
      tri[k] = true
    end
  end
  checks[#checks + 1] = {'no_repeat', not rep}
  -- language: printable ASCII, at least 70% of the non-space characters letters
  local letters, other = 0, 0
  for c in reply:gmatch('%S') do
    if c:match('%a') then letters = letters + 1 else other = other + 1 end
  end
  local ascii = not reply:find('[^\t\n\r\32-\126]') and not reply:find('<|', 1, true)
  checks[#checks + 1] = {'language', ascii and letters > 0 and letters >= 0.7 * (letters + other)}
  local passed, failed = 0, {}
  for _, c in ipairs(checks) do
    if c[2] then passed = passed + 1 else failed[#failed + 1] = c[1] end
  end
  if passed == #checks then return 1, failed end
  return 0.5 * passed / #checks, failed
end
doc(L.reply_reward, 'gp.polychromic.lm.reply_reward(line, word, reply, {max_words=25})',
  'the checked reward of a reply: 1 when it has 3..max_words words, uses word (or its plural), is not a copy of line (< 60% of its distinct words from the line, the line not inside), repeats no word of 3+ letters over 3 times nor any 3 words, and is printable ASCII with >= 70% letters; else 0.5 x the fraction of checks passed. Returns the reward and the failed checks\' names')

-- a reply model's tokenizer for the polychromic loop: encode without
-- special tokens (the chat template writes them), decode skipping them,
-- stop at the end-of-turn token; encodings are memoized (prompts repeat)
function L.tokenizer(hf, opts)
  opts = opts or {}
  if type(hf) ~= 'table' or not hf.encode then raise('polychromic.lm.tokenizer: needs a tokenizer (gp.models.load gives one)') end
  local stop = opts.stop or (hf.token_to_id and hf:token_to_id('<|im_end|>')) or hf.eos_id
  if type(stop) ~= 'number' then raise('polychromic.lm.tokenizer: the tokenizer has no end-of-turn or eos token; give opts.stop') end
  local memo = {}
  local t = {hf = hf, stop = stop, vocab_size = hf.vocab_size}
  function t.encode(_, s)
    local ids = memo[s]
    if not ids then
      ids = hf:encode(s, {add_special_tokens = false})
      memo[s] = ids
    end
    return ids
  end
  function t.decode(_, ids) return hf:decode(ids, {skip_special_tokens = true}) end
  -- the prompt text of a user message: the chat template when the tokenizer has one
  function t.chat(_, msg)
    if hf.chat_template then
      return hf:apply_chat_template({{role = 'user', content = msg}}, {add_generation_prompt = true})
    end
    return 'User: ' .. msg .. '\nAssistant:'
  end
  return t
end
doc(L.tokenizer, 'gp.polychromic.lm.tokenizer(hf_tokenizer, {stop=})',
  "the loop's tokenizer over a model's: encode without special tokens (memoized), decode skipping them, stop = <|im_end|> or eos, tok:chat(msg) = the chat template's prompt for one user message (or 'User: msg\\nAssistant:' without a template)")

local function spread(list, k)
  if k >= #list then return list end
  local out = {}
  for i = 1, k do out[i] = list[math.floor((i - 1) * #list / k) + 1] end
  return out
end

-- the reply task over lines: line i (1-based, in order) is held out when i % 10 == 0;
-- opts.train_prompts (2000) and opts.eval_prompts (32) lines are taken evenly spread from each side
function L.reply_task(lines, tok, opts)
  opts = opts or {}
  if type(lines) ~= 'table' or #lines < 10 then raise('polychromic.lm.reply_task: needs a list of at least 10 lines') end
  local max_words = opts.max_words or 25
  local train, held = {}, {}
  for i, s in ipairs(lines) do
    local item = {line = s, word = L.WORDS[(i * 7) % #L.WORDS + 1]}
    if i % 10 == 0 then held[#held + 1] = item else train[#train + 1] = item end
  end
  train, held = spread(train, opts.train_prompts or 2000), spread(held, opts.eval_prompts or 32)
  local task = {name = 'reply', prompts = {}, eval_prompts = {}, meta = {}, max_words = max_words}
  local function add(list, item)
    local msg = opts.message and opts.message(item.word, item.line, max_words) or
      string.format('Reply to this message in under %d words and use the word %s: %s', max_words, item.word, item.line)
    local p = tok:chat(msg)
    task.meta[p] = item
    list[#list + 1] = p
  end
  for _, it in ipairs(train) do add(task.prompts, it) end
  for _, it in ipairs(held) do add(task.eval_prompts, it) end
  function task.reward(prompt, reply)
    local m = task.meta[prompt]
    if not m then raise('polychromic.lm: a reward asked for a prompt that is not in the task') end
    return (L.reply_reward(m.line, m.word, reply, {max_words = max_words}))
  end
  return task
end
doc(L.reply_task, 'gp.polychromic.lm.reply_task(lines, tok, {train_prompts=2000, eval_prompts=32, max_words=25, message=function(word, line, max_words)})',
  "the reply task: prompts 'Reply to this message in under 25 words and use the word X: <line>' in tok's chat template; every 10th line held out (eval_prompts), the rest train; task.reward(prompt, reply) = reply_reward; task.meta[prompt] = {line, word}; message: another wording of the user message")

---------------------------------------------------------------------------
-- the encoder, the adapters, the base's memory

-- the loop's embed function: the encoder's (normalized) embeddings of the replies' text
function L.encoder_embed(enc)
  if type(enc) ~= 'table' or not enc.embed then raise('polychromic.lm.encoder_embed: needs a sentence encoder (enc:embed(texts))') end
  return function(_, ro) return enc:embed(ro.replies) end
end
doc(L.encoder_embed, 'gp.polychromic.lm.encoder_embed(enc)', "function(policy, rollout) -> enc:embed(rollout.replies): set diversity from a sentence encoder's embeddings")

-- every adapter back to its start (A uniform from the seed, B zero): the model is its base again
function L.reset_adapters(model, seed)
  local mods = lora.modules(model)
  if #mods == 0 then raise('polychromic.lm.reset_adapters: the model has no LoRA adapters (gp.lora.apply)') end
  gp.manual_seed(seed)
  gp.no_grad(function()
    for _, e in ipairs(mods) do
      local m = e[2]
      local k = 1 / math.sqrt(m.in_features)
      nn.init.uniform_(m.lora_A, -k, k)
      nn.init.zeros_(m.lora_B)
    end
  end)
end
doc(L.reset_adapters, 'gp.polychromic.lm.reset_adapters(model, seed)', 'every LoRA adapter to its initial state (A ~ U(+-1/sqrt(in)) drawn from seed, B = 0): the model equals its base')

-- the frozen base on the device: bytes and parameters of everything but the
-- adapters (quantized weights at their packed size), and of the quantized linears alone
function L.base_memory(model)
  local adapter = {}
  for _, p in ipairs(lora.parameters(model)) do adapter[p] = true end
  local r = nn.weight_stats(model, adapter)
  r.bytes_per_param = r.params > 0 and r.bytes / r.params or 0
  r.quant_bytes_per_param = r.quant_params > 0 and r.quant_bytes / r.quant_params or nil
  return r
end
doc(L.base_memory, 'gp.polychromic.lm.base_memory(model)',
  'the frozen base\'s device memory: {bytes, params, bytes_per_param} of every tensor but the adapters (quantized weights at their packed size, a tied head once), and quant_bytes, quant_params, quant_bytes_per_param of the quantized linears alone')

---------------------------------------------------------------------------
-- evaluation and the experiment

-- k replies for each held-out prompt: mean reward, pass@k, distinct valid
-- replies, the encoder's set diversity of the valid replies; and the reply sets
function L.evaluate(policy, tok, task, enc, opts)
  opts = opts or {}
  local k = opts.eval_n or 8
  local prompts = task.eval_prompts
  local ro = P.rollout(policy, tok, prompts, {n = k, max_new = opts.max_new, temperature = opts.temperature, top_p = opts.top_p})
  local rewards, sum_r, passed, distinct = {}, 0, 0, 0
  local sets = {}
  for b = 1, #prompts do
    local any, seen, nd = false, {}, 0
    local set = {prompt = prompts[b], line = task.meta[prompts[b]].line, word = task.meta[prompts[b]].word, replies = {}}
    for i = 1, k do
      local j = (b - 1) * k + i
      local r = task.reward(ro.prompts[j], ro.replies[j])
      rewards[j] = r
      sum_r = sum_r + r
      set.replies[i] = {text = ro.replies[j], reward = r}
      if r > 0.5 then
        any = true
        if not seen[ro.replies[j]] then seen[ro.replies[j]] = true; nd = nd + 1 end
      end
    end
    if any then passed = passed + 1 end
    distinct = distinct + nd
    sets[b] = set
  end
  local emb = enc:embed(ro.replies)
  local div, div2 = P.valid_set_diversity(emb, rewards, #prompts, k)
  local all_div = gp.set_diversity(emb:float():view {#prompts, k, emb:size(2)}):mean():item()
  return {mean_reward = sum_r / (#prompts * k), pass_at_n = passed / #prompts, n = k, prompts = #prompts,
          distinct_valid = distinct / #prompts, set_diversity = div, set_diversity_2 = div2, all_diversity = all_div,
          sets = sets}
end
doc(L.evaluate, 'gp.polychromic.lm.evaluate(policy, tok, task, enc, {eval_n=8, max_new=, temperature=, top_p=})',
  "eval_n replies for each held-out prompt: mean_reward, pass_at_n, distinct_valid (distinct valid replies a prompt), set_diversity (the encoder's mean pair 1 - cos of each prompt's valid replies, 0 for fewer than 2, mean over prompts), set_diversity_2 (the same over prompts with 2+ valid), all_diversity (over all replies), sets (the replies and rewards)")

local METRICS = {'mean_reward', 'pass_at_n', 'distinct_valid', 'set_diversity', 'set_diversity_2', 'all_diversity'}
L.METRICS = METRICS

-- modes (base: no training; rl, poly, additive: fine-tuned) x seeds from the same base;
-- o: the finetune options (steps, n, prompts_per_step, lr, epochs, clip, kl, set_div, floor, valid_only, ...),
-- eval_n, log (a JSONL path: a line per step and per evaluation), say (print), examples (eval prompts kept, 3)
function L.run(model, tok, task, enc, o)
  o = o or {}
  local say = o.say or function() end
  local modes, seeds = o.modes or {'base', 'rl', 'poly'}, o.seeds or {1}
  local logf
  if o.log and o.log ~= '' then
    logf = io.open(o.log, 'w')
    if not logf then raise('polychromic.lm.run: cannot write the log ' .. o.log) end
  end
  local function log(rec)
    if logf then logf:write(gp.json.encode(rec), '\n'); logf:flush() end
  end
  local embed = L.encoder_embed(enc)
  local eval_opts = {eval_n = o.eval_n or o.n or 8, max_new = o.max_new, temperature = o.temperature, top_p = o.top_p}
  local report = {modes = modes, seeds = seeds, per_seed = {}, mean = {}, times = {}, examples = {}, runs = {},
                  eval_n = eval_opts.eval_n}
  local nex = o.examples or 3
  for si, seed in ipairs(seeds) do
    for _, mode in ipairs(modes) do
      local run = string.format('%s-seed%d', mode, seed)
      L.reset_adapters(model, seed)
      local r
      local t0 = logger.now()
      if mode ~= 'base' then
        say(string.format('%s: %d steps, %d prompts x %d replies a step', run, o.steps, o.prompts_per_step or 8, o.n or 8))
        gp.manual_seed(seed + 2)
        local fo = {}
        for key, v in pairs(o) do fo[key] = v end
        fo.objective, fo.seed, fo.embed, fo.valid_diversity = mode, seed, embed, true
        fo.log = say
        fo.on_step = function(rec)
          log({run = run, mode = mode, seed = seed, step = rec.step, loss = rec.loss, reward = rec.reward,
               set_diversity = rec.set_diversity, valid_diversity = rec.valid_diversity, distinct = rec.distinct, s = rec.s,
               generation_s = rec.generation_s, diversity_s = rec.diversity_s, update_s = rec.update_s,
               reply_tokens = rec.reply_tokens})
        end
        r = P.finetune(model, tok, task, fo)
        report.times[mode] = report.times[mode] or {}
        table.insert(report.times[mode], (logger.now() - t0) / o.steps)
      end
      gp.manual_seed(seed + 3) -- the same evaluation draws for every mode
      local e = L.evaluate(model, tok, task, enc, eval_opts)
      say(string.format('%s: mean reward %.3f, pass@%d %.3f, distinct valid %.2f, set diversity %.3f', run, e.mean_reward,
        e.n, e.pass_at_n, e.distinct_valid, e.set_diversity))
      local rec = {run = run, mode = mode, seed = seed, eval = true}
      for _, k in ipairs(METRICS) do rec[k] = e[k] end
      log(rec)
      report.per_seed[mode] = report.per_seed[mode] or {}
      report.per_seed[mode][si] = rec
      if si == 1 then
        for b = 1, math.min(nex, #e.sets) do
          report.examples[b] = report.examples[b] or {line = e.sets[b].line, word = e.sets[b].word, sets = {}}
          report.examples[b].sets[mode] = e.sets[b].replies
        end
      end
      report.runs[#report.runs + 1] = {run = run, history = r and r.history or nil}
    end
  end
  for _, mode in ipairs(modes) do
    local m = {}
    for _, k in ipairs(METRICS) do
      local s, c = 0, 0
      for _, rec in ipairs(report.per_seed[mode]) do
        if rec[k] then s, c = s + rec[k], c + 1 end
      end
      m[k] = c > 0 and s / c or nil
    end
    report.mean[mode] = m
  end
  report.base_memory = L.base_memory(model)
  report.memory = gp.memory and gp.memory() or nil
  if logf then logf:close() end
  return report
end
doc(L.run, "gp.polychromic.lm.run(model, tok, task, enc, {modes={'base','rl','poly'}, seeds={1}, steps=, n=, prompts_per_step=, eval_n=, log='run.jsonl', ...})",
  'the experiment: for each seed and mode the adapters reset (base: evaluated as is; rl, poly, additive: fine-tuned by gp.polychromic.finetune with the encoder\'s embeddings), then evaluated on the held-out prompts; returns {per_seed, mean (over seeds, per mode: the evaluate metrics), times (seconds a step), examples (reply sets of the first eval prompts, seed 1), base_memory, memory}; log: a JSONL line per step and per evaluation')

-- format a report: the table of means, the examples side by side, memory
function L.format(report)
  local lines = {}
  local function add(s) lines[#lines + 1] = s end
  local k = report.eval_n
  add(string.format('held-out prompts, mean over %d seed(s):', #report.seeds))
  add(string.format('%-8s %12s %9s %15s %14s %16s %15s', 'mode', 'mean reward', 'pass@' .. tostring(k), 'distinct valid',
    'set diversity', 'diversity (2+)', 's a step'))
  for _, mode in ipairs(report.modes) do
    local m = report.mean[mode]
    local t = report.times[mode]
    local ts = ''
    if t then
      local s = 0
      for _, x in ipairs(t) do s = s + x end
      ts = string.format('%.2f', s / #t)
    end
    add(string.format('%-8s %12.3f %9.3f %15.2f %14.3f %16s %15s', mode, m.mean_reward, m.pass_at_n, m.distinct_valid,
      m.set_diversity, m.set_diversity_2 and string.format('%.3f', m.set_diversity_2) or '-', ts))
  end
  for i, ex in ipairs(report.examples) do
    add('')
    add(string.format('example %d: use the word "%s": %s', i, ex.word, ex.line))
    for _, mode in ipairs(report.modes) do
      for j, r in ipairs(ex.sets[mode] or {}) do
        add(string.format('  %-5s %s %s', j == 1 and mode or '', r.reward > 0.5 and '+' or '-', (r.text:gsub('%s+', ' '))))
      end
    end
  end
  local bm = report.base_memory
  add('')
  add(string.format('frozen base: %.1f MiB for %.1fM parameters = %.3f bytes a parameter%s', bm.bytes / 1048576, bm.params / 1e6,
    bm.bytes_per_param, bm.quant_bytes_per_param and string.format(' (the quantized linears: %.1fM parameters, %.4f bytes a parameter)',
      bm.quant_params / 1e6, bm.quant_bytes_per_param) or ''))
  if report.memory then
    add(string.format('peak memory: device %.1f MiB, host %.1f MiB', report.memory.peak / 1048576, report.memory.host_peak / 1048576))
  end
  return table.concat(lines, '\n')
end
doc(L.format, 'gp.polychromic.lm.format(report)', 'the report of gp.polychromic.lm.run as text: the table of means over seeds, the example reply sets (+ valid, - not) mode beside mode, the frozen base\'s bytes a parameter, peak memory')

return L
