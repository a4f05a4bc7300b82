-- polychromic.lua: set-level RL fine-tuning with LoRA (gp.polychromic).
--
--   gpush scripts/polychromic.lua                      -- built-in task; on the CPU rl and poly side by side (as --compare), on a GPU poly
--                                                         (on a GPU with SmolLM2 fetched: --model smollm2; --tiny keeps the built-in task)
--   gpush scripts/polychromic.lua --compare            -- rl and poly, same seeds and steps, side by side
--   gpush scripts/polychromic.lua --objective poly     -- poly alone (--no-compare: the same)
--   gpush scripts/polychromic.lua --save-base b.st --save-adapters a.st, then --checkpoint b.st --load-adapters a.st
--   gpush scripts/polychromic.lua --compare --set-div pair --floor 0  -- the paper's all-pairs product
--   gpush scripts/polychromic.lua --objective rl --steps 200 --n 8
--   gpush scripts/polychromic.lua --data pairs.jsonl --reward reward.lua --checkpoint base.safetensors
--   gpush scripts/polychromic.lua --model smollm2     -- QLoRA on SmolLM2 with MiniLM diversity (the GPU default; scripts/polychromic_lm.lua)
--   gpush scripts/polychromic.lua --help
--
-- Without --checkpoint a character-level GPT is pretrained on the task's
-- valid examples first (short: it answers validly often, not always); the
-- base is then frozen and LoRA adapters are fine-tuned. Defaults depend on
-- the device: a GPU gets a harder task (operands up to 40, where the base is
-- valid about 1 time in 6), more fine-tuning steps, more prompts per step and,
-- with --compare, sets of 16; the CPU a configuration that finishes in a few
-- minutes and, unless --objective or --no-compare is given, compares rl and poly
-- to the base in one table and ends with a verdict line.
local gp = rawget(_G, 'gp') or require 'gpush'
local P = gp.polychromic
local D = P.defaults

local o = gp.args.parse(arg, {
  {'objective', '', 'poly | additive | rl | sft (default: poly; on the CPU rl and poly compared, unless --no-compare)'},
  {'compare', nil, 'run rl and poly from the same base with the same seeds and steps; print both (the default on the CPU when no --objective is given)', type = 'flag'},
  {'n', 0, 'samples per prompt (0: ' .. D.n .. '; with --compare 8 on the CPU, 16 on the GPU, so that a set can hold several distinct valid replies)'},
  {'temperature', D.temperature, 'sampling temperature'},
  {'top-p', D.top_p, 'nucleus sampling threshold'},
  {'steps', 0, 'fine-tuning steps (0: 100 on the CPU, 400 on the GPU)'},
  {'prompts-per-step', 0, 'prompts per step B (0: ' .. D.prompts_per_step .. ' on the CPU, 16 on the GPU)'},
  {'lambda', D.lambda, 'diversity weight of the additive objective'},
  {'kl', D.kl, 'KL penalty to the base model (k3 estimator per token)'},
  {'clip', D.clip, 'PPO ratio clip'},
  {'epochs', 2, 'PPO passes over each batch'},
  {'lr', 3e-3, 'adapter learning rate (AdamW)'},
  {'lora-rank', 8, 'LoRA rank'},
  {'lora-alpha', 16, 'LoRA alpha (scaling alpha / rank)'},
  {'lora-dropout', 0, 'LoRA dropout'},
  {'subset-size', 0, 'poly/additive subset size m (0: n/2, at least 2)'},
  {'max-subsets', D.max_subsets, 'subsets per prompt (all of them when C(n, m) is at most this)'},
  {'adv-norm', D.adv_norm, 'advantage scaling: batch | set | none'},
  {'floor', -1, 'poly: f = mean reward * (floor + diversity) (-1: 1 with --set-div distinct, else 0, the paper\'s pure product)'},
  {'valid-only', false, 'poly/additive with --set-div pair: a pair counts toward diversity with weight r_i r_j (diversity among rewarded replies only)'},
  {'set-div', '', 'poly: the subset diversity: distinct (the default: effective number of different replies among the rewarded ones, over the subset size) | pair (mean pair distance over all pairs, the paper\'s form)'},
  {'embed', '', 'reply embeddings for diversity: exact (the default with distinct: one-hot of the whole reply, identical or not) | ngram (the default with pair: token 2- and 3-gram sets) | base (mean-pooled hidden states of the frozen base)'},
  {'eval-n', 0, 'samples per prompt in the evaluation, pass@eval-n (0: ' .. D.eval_n .. '; with --compare, n)'},
  {'max-new', 0, 'longest reply in tokens (0: from the task)'},
  {'data', '', 'JSONL file of {"prompt": ..., "reply": ...} pairs (default: the built-in sum task)'},
  {'reward', '', 'a Lua file returning function(prompt, reply) -> number (default: the task\'s reward)'},
  {'task-max', 0, 'built-in task: operands 0..max, prompts S= for S = 0..2 max (0: 12 on the CPU, 40 on the GPU)'},
  {'checkpoint', '', 'a base model checkpoint (gp.save of an nn.GPT with its config and vocab in the metadata)'},
  {'save-base', '', 'write the pretrained base here'},
  {'save-adapters', '', 'write the fine-tuned adapters here (gp.lora.save)'},
  {'load-adapters', '', 'evaluate the adapters of this file (--save-adapters) beside the base instead of fine-tuning; the base must be the one they were trained on: give it with --checkpoint (--save-base wrote it), or the same pretraining flags and --seed'},
  {'pretrain-steps', 600, 'pretraining steps of the base (batch 32: the base answers validly about half the time)'},
  {'n-embd', 32, 'base width'},
  {'n-layer', 2, 'base blocks'},
  {'n-head', 2, 'base heads'},
  {'device', '', 'cpu or cuda (default: cuda when a GPU is usable)'},
  {'graph', true, 'on a GPU, run the PPO update as CUDA graphs over rows padded to a fixed width (--no-graph: eager updates)'},
  {'seed', 1234, 'random seed'},
  {'log-every', 10, 'print a line every N steps'},
  {'json', '', 'append the final metrics as a JSON line to this file'},
  -- the real-model experiment (issue 20): --model smollm2
  {'model', '', 'the reply model: smollm2 (or a Llama-family .gguf or Hugging Face directory) for the real-model experiment, toy for the character model (default: smollm2 on a GPU when fetched, else toy)'},
  {'tiny', nil, 'the character-model task (the same as --model toy)', type = 'flag'},
  {'base', 'nf4', 'real model: the frozen base: nf4 (the linears re-quantized to NF4, QLoRA) or bf16 (dense; f32 on the CPU)'},
  {'block', 64, 'real model: NF4 block size'},
  {'sample', 'auto', 'real model, --base nf4: rollouts sample from a dense copy refreshed from the 4-bit base and the adapters before each (dense: the one-kernel decode step, 2 more bytes a parameter), from the 4-bit weights with the adapters unmerged (nf4), or auto (dense when the copy takes at most 1 GiB)'},
  {'embed-nf4', nil, 'real model, --base nf4: quantize the token embedding and the head tied to it too (the whole base 4-bit)', type = 'flag'},
  {'seeds', 0, 'real model: seeds to average over (0: 3 on the GPU, 1 on the CPU); seed, seed+1, ...'},
  {'eval-prompts', 0, 'real model: held-out prompts (0: 32 on the GPU, 2 on the CPU)'},
  {'max-words', 25, 'real model: the word limit of a reply'},
  {'encoder', 'all-minilm-l6-v2', 'real model: the sentence encoder of the diversity (a sentence-transformers directory or short name)'},
  {'text', '', 'real model: the text whose lines make the prompts (default: the Shakespeare corpus of make models)'},
  {'log', '', 'real model: write a JSONL line per step and per evaluation of every run here'},
  {'bench-step', nil, 'real model: time the polychromic step (generation, reward, encoder, update) on fixed prompts and print seconds a step as JSON', type = 'flag'},
  {'bench-steps', 5, 'real model: timed steps of --bench-step (after 2 warm-up steps)'},
  {'save-hf', '', 'real model: write the dense model as a Hugging Face directory here (with polychromic_bench.json: the bench prompts and settings, for scripts/bench/torch_polychromic.py) and exit'},
}, {usage = 'gpush scripts/polychromic.lua [flags]',
    description = 'Set-level RL fine-tuning with LoRA: polychromic, additive, rl or sft objective on a built-in task or, with --model smollm2, QLoRA on a real instruct model.'})

if o.device ~= '' then gp.set_device(o.device) end
local on_gpu = gp.device() == 'cuda'

-- the real-model experiment unless the toy is asked for (or the model is not fetched)
if o.model == '' then
  local fetched = pcall(gp.models.path, 'smollm2')
  o.model = (on_gpu and fetched and not o.tiny) and 'smollm2' or 'toy'
end
if o.tiny and o.model ~= 'toy' then error('--tiny is the character model; it does not combine with --model ' .. o.model) end
local script_dir = (arg and arg[0] or 'scripts/polychromic.lua'):match('^(.*)/[^/]*$') or '.'
if o.model ~= 'toy' then return dofile(script_dir .. '/polychromic_lm.lua')(o) end
local loading = o.load_adapters ~= ''
if loading and o.compare then error('--load-adapters evaluates saved adapters; it does not fine-tune, so it does not combine with --compare') end
-- the CPU default (make run without a GPU): rl and poly beside the base
if o.compare == nil then o.compare = not on_gpu and o.objective == '' and not loading end
if o.objective == '' then o.objective = 'poly' end
local function pick(v, cpu, gpu) if v ~= 0 then return v end; return on_gpu and gpu or cpu end
o.steps = pick(o.steps, 100, 400)
o.task_max = pick(o.task_max, 12, 40)
o.prompts_per_step = pick(o.prompts_per_step, D.prompts_per_step, 16)
if o.n == 0 then o.n = o.compare and (on_gpu and 16 or 8) or D.n end
if o.eval_n == 0 then o.eval_n = o.compare and o.n or D.eval_n end
local OBJ = {poly = true, additive = true, rl = true, sft = true}
if not OBJ[o.objective] then error('--objective must be poly, additive, rl or sft, got ' .. o.objective) end
if o.n < 2 and o.objective ~= 'sft' then error('--n must be at least 2 (a set needs pairs)') end
-- poly's defaults: distinct replies among the rewarded ones, counted exactly,
-- with floor 1 (f = mean reward + distinct / m); additive: pair distances
if o.set_div == '' then o.set_div = (o.objective == 'additive' or o.valid_only) and 'pair' or 'distinct' end
if o.embed == '' then o.embed = o.set_div == 'distinct' and 'exact' or 'ngram' end
if o.floor < 0 then o.floor = o.set_div == 'distinct' and 1 or 0 end
if o.set_div ~= 'pair' and o.set_div ~= 'distinct' then error('--set-div must be pair or distinct, got ' .. o.set_div) end
if o.set_div == 'distinct' then
  if o.objective == 'additive' and not o.compare then error('--set-div distinct is for the poly objective, not additive') end
  if o.valid_only then error('--valid-only weights pairs (--set-div pair); --set-div distinct counts rewarded replies only already') end
end
local EMB = {ngram = P.ngram_embed, exact = P.exact_embed, base = P.base_embed}
local embed = EMB[o.embed] or error('--embed must be ngram, exact or base, got ' .. o.embed)

-- the task
local reward_fn = o.reward ~= '' and P.load_reward(o.reward) or nil
local task
if o.data ~= '' then
  task = P.jsonl_task(o.data, reward_fn)
else
  task = P.sum_task {max = o.task_max}
  if reward_fn then task.reward = reward_fn end
end
local max_new = o.max_new > 0 and o.max_new or task.max_reply + 1
local longest = 0
for _, p in ipairs(task.prompts) do longest = math.max(longest, #p) end

-- the base model: a checkpoint, or pretrained here on the task's valid examples
local base_sd, config, tok
local t_start = gp.train.now()
gp.manual_seed(o.seed)
math.randomseed(o.seed)
if o.checkpoint ~= '' then
  local sd, meta = gp.load(o.checkpoint)
  if type(meta.config) ~= 'table' or type(meta.vocab) ~= 'table' then
    error('--checkpoint: the metadata needs config and vocab (a list of characters), as scripts/train_gpt.lua writes')
  end
  config = meta.config
  tok = P.char_tokenizer(table.concat(meta.vocab))
  if tok.vocab_size ~= config.vocab_size then error('--checkpoint: the vocab does not match config.vocab_size') end
  base_sd = sd
  print(string.format('base: %s (%d-layer, n_embd %d)', o.checkpoint, config.n_layer, config.n_embd))
else
  tok = P.char_tokenizer(task.chars)
  config = {vocab_size = tok.vocab_size, block_size = longest + max_new + 2, n_embd = o.n_embd, n_layer = o.n_layer,
            n_head = o.n_head}
  local base = gp.nn.GPT(config)
  print(string.format('pretraining the base on %s: %d steps, %d parameters, device %s', task.name, o.pretrain_steps,
    base:num_parameters(), gp.device()))
  local loss = P.pretrain(base, task, tok, {steps = o.pretrain_steps, batch = 32, rand = math.random,
    log_every = 50, log = function(s, l) print(string.format('  pretrain step %d: loss %.4f', s, l)) end})
  print(string.format('  done: loss %.4f, %.1f s', loss, gp.train.now() - t_start))
  base_sd = base:state_dict()
  if o.save_base ~= '' then
    gp.save(o.save_base, base_sd, {config = config, vocab = tok.chars})
    print('base: ' .. o.save_base)
  end
end

local eval_opts = {eval_n = o.eval_n, max_new = max_new, temperature = o.temperature, top_p = o.top_p, embed = embed}

-- a fresh policy: the base weights and new adapters (same seed every time)
local function policy()
  gp.manual_seed(o.seed + 1)
  local m = gp.nn.GPT(config)
  m:load_state_dict(base_sd)
  gp.lora.apply(m, {rank = o.lora_rank, alpha = o.lora_alpha, dropout = o.lora_dropout})
  return m
end

local function run(objective)
  local m = policy()
  gp.manual_seed(o.seed + 2)
  local r = P.finetune(m, tok, task, {objective = objective, steps = o.steps, n = o.n, prompts_per_step = o.prompts_per_step,
    temperature = o.temperature, top_p = o.top_p, lambda = o.lambda, kl = o.kl, clip = o.clip, lr = o.lr,
    epochs = o.epochs, adv_norm = o.adv_norm, subset_size = o.subset_size > 0 and o.subset_size or nil,
    max_subsets = o.max_subsets, floor = o.floor, valid_only = o.valid_only, set_div = o.set_div, max_new = max_new, embed = embed, seed = o.seed, log_every = o.log_every, log = print,
    graph = o.graph})
  gp.manual_seed(o.seed + 3) -- the same evaluation draws for every objective
  r.eval = P.evaluate(m, tok, task, eval_opts)
  r.model = m
  return r
end

local function metrics_line(name, e)
  return string.format('%-10s %12.3f %10.3f %14.3f %16.2f', name, e.mean_reward, e.pass_at_n, e.set_diversity, e.distinct_valid)
end
local function header(k)
  return string.format('%-10s %12s %10s %14s %16s', 'objective', 'mean reward', 'pass@' .. k, 'set diversity', 'distinct valid')
end
local function times_line(name, r)
  local t = r.times
  local total = t.generation + t.diversity + t.update
  local per = function(x) return x / r.steps * 1000 end
  return string.format('%-10s step %8.1f ms = generation %7.1f ms (%2.0f%%) + diversity %7.1f ms (%2.0f%%) + update %7.1f ms (%2.0f%%); set_diversity kernel %.3f ms',
    name, per(total), per(t.generation), 100 * t.generation / total, per(t.diversity), 100 * t.diversity / total,
    per(t.update), 100 * t.update / total, per(t.kernel))
end

gp.manual_seed(o.seed + 3)
local base_eval = P.evaluate(policy(), tok, task, eval_opts)
local objectives = o.compare and {'rl', 'poly'} or {o.objective}
local results = {}
if loading then
  -- saved adapters on this base, evaluated with the draws a fine-tuning run uses
  local sd, meta = gp.load(o.load_adapters)
  local lc = type(meta.lora) == 'table' and meta.lora or
    error('--load-adapters: ' .. o.load_adapters .. ' has no LoRA metadata (write it with --save-adapters or gp.lora.save)')
  local c = type(meta.config) == 'table' and meta.config or {}
  for _, k in ipairs {'vocab_size', 'n_embd', 'n_layer', 'n_head'} do
    if c[k] ~= nil and c[k] ~= config[k] then
      error(string.format('--load-adapters: the adapters were trained on a base with %s %s, this base has %s (give their base with --checkpoint)',
        k, tostring(c[k]), tostring(config[k])))
    end
  end
  o.lora_rank, o.lora_alpha = lc.rank or o.lora_rank, lc.alpha or o.lora_alpha
  local m = policy()
  gp.lora.load(m, sd)
  print(string.format('adapters: %s (objective %s, rank %d, alpha %g), evaluated without fine-tuning', o.load_adapters,
    tostring(meta.objective or '?'), o.lora_rank, o.lora_alpha))
  gp.manual_seed(o.seed + 3)
  objectives = {'adapters'}
  results.adapters = {eval = P.evaluate(m, tok, task, eval_opts), model = m}
end
for _, obj in ipairs(loading and {} or objectives) do
  print(string.format('fine-tuning LoRA adapters (rank %d): objective %s%s, %d steps, %d prompts x %d samples per step',
    o.lora_rank, obj, obj == 'poly' and string.format(' (set diversity %s, embed %s, floor %g)', o.set_div, o.embed, o.floor) or '',
    o.steps, o.prompts_per_step, o.n))
  results[obj] = run(obj)
end

print('')
print(string.format('evaluation: %d prompts x %d samples (temperature %g, top-p %g)', #task.eval_prompts, o.eval_n,
  o.temperature, o.top_p))
print(header(o.eval_n))
print(metrics_line('base', base_eval))
for _, obj in ipairs(objectives) do print(metrics_line(obj, results[obj].eval)) end
print('')
if not loading then
  print('time per fine-tuning step:')
  for _, obj in ipairs(objectives) do print(times_line(obj, results[obj])) end
end
print(string.format('total %.1f s', gp.train.now() - t_start))

-- the verdict: b against a (rl, or the base) on what each objective is for
local function verdict(bname, b, aname, a)
  local function rel(x, y, eps, word_more, word_less, word_same)
    if x > y + eps then return word_more elseif x < y - eps then return word_less end
    return word_same
  end
  local div = rel(b.distinct_valid, a.distinct_valid, 0.005, 'more distinct valid replies per prompt than',
    'fewer distinct valid replies per prompt than', 'as many distinct valid replies per prompt as')
  local rw = rel(b.mean_reward, a.mean_reward, 0.0005, string.format('a mean reward %.3f higher', b.mean_reward - a.mean_reward),
    string.format('a mean reward %.3f lower', a.mean_reward - b.mean_reward), 'the same mean reward')
  local pn = rel(b.pass_at_n, a.pass_at_n, 0.0005, 'higher', 'lower', 'the same')
  return string.format('verdict: %s kept %s %s (%.2f vs %.2f%s), at %s (%.3f vs %.3f); pass@%d %s (%.3f vs %.3f)',
    bname, div, aname, b.distinct_valid, a.distinct_valid, aname ~= 'the base' and string.format('; the base %.2f', base_eval.distinct_valid) or '',
    rw, b.mean_reward, a.mean_reward, o.eval_n, pn, b.pass_at_n, a.pass_at_n)
end
if o.compare then
  local a, b = results.rl.eval, results.poly.eval
  print(string.format('poly vs rl: distinct valid %+.2f, pass@%d %+.3f, mean reward %+.3f', b.distinct_valid - a.distinct_valid,
    o.eval_n, b.pass_at_n - a.pass_at_n, b.mean_reward - a.mean_reward))
  local dv, pn = b.distinct_valid > a.distinct_valid, b.pass_at_n > a.pass_at_n
  print(string.format('poly beat rl on distinct valid replies: %s; on pass@%d: %s%s', dv and 'yes' or 'no', o.eval_n,
    pn and 'yes' or (b.pass_at_n == a.pass_at_n and 'no (tie)' or 'no'), (dv and pn) and ' -- poly beat rl on both' or ''))
  print(verdict('poly', b, 'rl', a))
else
  local name = objectives[1]
  print(verdict(name, results[name].eval, 'the base', base_eval))
end

if o.save_adapters ~= '' and not loading then
  local r = results[objectives[#objectives]]
  gp.lora.save(o.save_adapters, r.model, {objective = objectives[#objectives], config = config})
  print('adapters: ' .. o.save_adapters)
end
if o.json ~= '' then
  local f = assert(io.open(o.json, 'a'))
  local rec = {base = base_eval, device = gp.device(), steps = o.steps, n = o.n, seed = o.seed, set_div = o.set_div, embed = o.embed,
               floor = o.floor}
  for _, obj in ipairs(objectives) do rec[obj] = {eval = results[obj].eval, times = results[obj].times} end
  f:write(gp.json.encode(rec), '\n')
  f:close()
end
