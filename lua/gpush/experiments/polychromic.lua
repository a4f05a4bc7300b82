-- gp.polychromic: set-level RL fine-tuning (Hamid et al., 2025, "Polychromic
-- Objectives for Reinforcement Learning", arXiv 2509.25424) with LoRA adapters.
--
-- Each step samples n replies for each of B prompts in ONE gp.generate call,
-- scores them (a reward function of prompt and reply), embeds them (mean-pooled
-- hidden states of the frozen base model by default), and turns rewards and
-- set diversity into per-sample advantages:
--   poly      f(S') = mean reward(S') * diversity(S') over subsets S' of size m
--             of a prompt's n samples; advantage(i) = mean f of the subsets that
--             hold i - mean f of all of them (the marginal advantage)
--   additive  the same with f(S') = mean reward(S') + lambda * diversity(S')
--   rl        advantage(i) = r_i - mean r of its set
--   sft       no sampling for the loss: cross-entropy on valid (prompt, reply) pairs
-- The distance of every pair of every prompt's samples comes from one launch
-- of the set_diversity kernel; a subset's diversity is the mean of its pairs'.
-- Variants: a floor (f = mean r * (floor + diversity)); valid_only (a pair
-- counts with weight r_i r_j); set_div = 'distinct' (diversity = the effective
-- fraction of different replies among the rewarded ones, so an invalid reply
-- is never paid for being different and a subset with one valid reply scores
-- its mean reward, as rl would). floor = 0, set_div = 'pair' without
-- valid_only (these functions' defaults) is the paper's product;
-- scripts/polychromic.lua defaults to set_div = 'distinct' over exact reply
-- embeddings with floor = 1 (README: how that was chosen). The update is the PPO clipped surrogate on the
-- sampled tokens' log-probabilities (a teacher-forced forward of the policy
-- over prompt + reply; prompt and post-stop positions masked), plus an
-- optional KL penalty (k3 estimator) to the base model (the adapters off).
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local lora = require 'gpush.nn.lora'
local nn = require 'gpush.nn.module'
local optim = require 'gpush.train.optim'
local data = require 'gpush.train.data'
local logger = require 'gpush.train.logger'
local generate = require('gpush.models.generate').generate
local raise = rt.raise
local doc = gp.doc

local P = {}

-- the defaults of the options below (scripts/polychromic.lua's flags start from them)
P.defaults = {n = 4, max_new = 8, temperature = 0.9, top_p = 0.9, prompts_per_step = 8, lr = 2e-3, epochs = 1,
              set_div = 'pair', subset_size = nil, max_subsets = 64, lambda = 0.3, floor = 0, clip = 0.2, kl = 0,
              adv_norm = 'batch', eval_n = 8}
local DEF = P.defaults

-- the device of a policy: nn.GPT's token embedding, a Llama's head, else its first parameter
local function device_of(m)
  local w = (m.wte and m.wte.weight) or (m.lm_head and m.lm_head.weight)
  if w then return w.device end
  return m:parameters()[1].device
end
P.device_of = device_of
doc(P.device_of, 'gp.polychromic.device_of(policy)', "the device of a policy's weights (nn.GPT's token embedding, a Llama's head, else its first parameter)")

---------------------------------------------------------------------------
-- tokenizer: the characters of the task's language

function P.char_tokenizer(chars)
  if type(chars) ~= 'string' or #chars == 0 then raise('polychromic.char_tokenizer: needs a string of characters') end
  local set, list = {}, {}
  for i = 1, #chars do
    local c = chars:sub(i, i)
    if not set[c] then set[c] = true; list[#list + 1] = c end
  end
  if not set['\n'] then list[#list + 1] = '\n' end
  table.sort(list)
  local stoi = {}
  for i, c in ipairs(list) do stoi[c] = i - 1 end
  local tok = {vocab_size = #list, chars = list, stoi = stoi, stop = stoi['\n']}
  function tok.encode(_, s)
    local r = {}
    for i = 1, #s do
      local id = stoi[s:sub(i, i)]
      if id == nil then raise(string.format('polychromic: the character %q is not in the vocabulary', s:sub(i, i))) end
      r[i] = id
    end
    return r
  end
  function tok.decode(_, ids)
    local c = {}
    for i, v in ipairs(ids) do c[i] = list[v + 1] or '?' end
    return table.concat(c)
  end
  return tok
end
doc(P.char_tokenizer, 'gp.polychromic.char_tokenizer(chars)',
  "a character tokenizer over the given characters (plus '\\n', the stop token): tok:encode(s), tok:decode(ids), tok.vocab_size, tok.stop")

---------------------------------------------------------------------------
-- tasks: prompts, a reward, valid examples for pretraining and sft

-- "S=" -> "a+b" with a + b = S and 0 <= a, b <= max (no leading zeros): many valid replies
function P.sum_task(opts)
  opts = opts or {}
  local mx = opts.max or 12
  local task = {name = 'sum', chars = '0123456789+=\n', prompts = {}, valid = {}}
  for s = 0, 2 * mx do
    local p = tostring(s) .. '='
    task.prompts[#task.prompts + 1] = p
    local v = {}
    for a = math.max(0, s - mx), math.min(mx, s) do v[#v + 1] = a .. '+' .. (s - a) end
    task.valid[p] = v
  end
  task.eval_prompts = task.prompts
  function task.reward(prompt, reply)
    local s = tonumber(prompt:match('^(%d+)=$'))
    local a, b = reply:match('^(%d+)%+(%d+)$')
    if not (s and a and b) then return 0 end
    if tostring(tonumber(a)) ~= a or tostring(tonumber(b)) ~= b then return 0 end
    a, b = tonumber(a), tonumber(b)
    return (a <= mx and b <= mx and a + b == s) and 1 or 0
  end
  -- a valid example: a uniform prompt, then a uniform valid reply
  function task.example(rand)
    local p = task.prompts[rand(#task.prompts)]
    local v = task.valid[p]
    return p, v[rand(#v)]
  end
  task.max_reply = #tostring(mx) * 2 + 1
  return task
end
doc(P.sum_task, 'gp.polychromic.sum_task{max=12}',
  "the built-in task: prompts 'S=' for S = 0..2 max, valid replies 'a+b' with a + b = S (0 <= a, b <= max): up to max + 1 valid replies per prompt; reward 1 for a valid reply, else 0")

-- a task from JSONL {prompt, reply} lines; the reward: reward_fn(prompt, reply)
-- or, without one, 1 when the reply is one of the data's replies to the prompt
function P.jsonl_task(path, reward_fn)
  local rows = data.jsonl(path)
  local task = {name = path, prompts = {}, valid = {}}
  local chars = {'\n'}
  local maxr = 1
  for i, r in ipairs(rows) do
    if type(r) ~= 'table' or type(r.prompt) ~= 'string' or type(r.reply) ~= 'string' or #r.prompt == 0 then
      raise(string.format('polychromic: %s line %d needs string fields prompt (non-empty) and reply', path, i))
    end
    if not task.valid[r.prompt] then
      task.valid[r.prompt] = {}
      task.prompts[#task.prompts + 1] = r.prompt
    end
    local v = task.valid[r.prompt]
    v[#v + 1] = r.reply
    chars[#chars + 1] = r.prompt
    chars[#chars + 1] = r.reply
    maxr = math.max(maxr, #r.reply)
  end
  if #task.prompts == 0 then raise('polychromic: ' .. path .. ' has no examples') end
  task.chars = table.concat(chars)
  task.eval_prompts = task.prompts
  task.max_reply = maxr
  function task.example(rand)
    local p = task.prompts[rand(#task.prompts)]
    local v = task.valid[p]
    return p, v[rand(#v)]
  end
  if reward_fn then
    task.reward = reward_fn
  else
    local sets = {}
    for p, v in pairs(task.valid) do
      sets[p] = {}
      for _, r in ipairs(v) do sets[p][r] = true end
    end
    function task.reward(prompt, reply) return (sets[prompt] and sets[prompt][reply]) and 1 or 0 end
  end
  return task
end
doc(P.jsonl_task, 'gp.polychromic.jsonl_task(path, reward_fn=nil)',
  'a task from JSONL lines {"prompt": ..., "reply": ...}; reward: reward_fn(prompt, reply) or 1 when the reply is one of the data\'s replies to that prompt')

function P.load_reward(path)
  local chunk, err = loadfile(path)
  if not chunk then raise('polychromic: cannot load the reward file: ' .. tostring(err)) end
  local f = chunk()
  if type(f) ~= 'function' then raise('polychromic: ' .. path .. ' must return function(prompt, reply) -> number') end
  return f
end
doc(P.load_reward, 'gp.polychromic.load_reward(path)', 'a Lua file returning function(prompt, reply) -> number')

---------------------------------------------------------------------------
-- model pieces

-- final hidden states (B, T, C) of an nn.GPT or a Llama (after the final norm): model:hidden
function P.hidden(model, idx) return model:hidden(idx) end
doc(P.hidden, 'gp.polychromic.hidden(model, idx)', 'the final hidden states (B, T, C) of an nn.GPT or a Llama (model:hidden: after the final norm, before lm_head)')

-- pretrain the base on valid examples: one example per row, "prompt reply\n",
-- left-aligned, the loss on every token of the example
function P.pretrain(model, task, tok, opts)
  opts = opts or {}
  local steps, B, lr = opts.steps or 300, opts.batch or 32, opts.lr or 3e-3
  local T = model.config.block_size
  local dev = device_of(model)
  local opt = optim.AdamW(model, {lr = lr, weight_decay = 0.01})
  local sched = optim.schedule.cosine {lr = lr, min_lr = lr / 10, warmup = math.min(20, math.floor(steps / 10)), max_steps = steps}
  local rand = opts.rand or math.random
  local last
  model:train()
  for step = 1, steps do
    local xs, ys = {}, {}
    for b = 1, B do
      local p, r = task.example(rand)
      local ids = tok:encode(p .. r .. '\n')
      if #ids > T + 1 then raise(string.format('polychromic.pretrain: an example has %d tokens; block_size is %d', #ids, T)) end
      local x, y = {}, {}
      for j = 1, T do
        x[j] = ids[j] or tok.stop
        y[j] = ids[j + 1] or -100
      end
      xs[b], ys[b] = x, y
    end
    local x = gp.tensor(xs, {dtype = 'i64', device = dev})
    local y = gp.tensor(ys, {dtype = 'i64', device = dev})
    opt:zero_grad()
    local _, loss = model(x, y)
    loss:backward()
    optim.clip_grad_norm(opt, 1.0)
    opt:set_lr(sched(step))
    opt:step()
    if step == steps or (opts.log_every and step % opts.log_every == 0) then
      last = loss:item()
      if opts.log then opts.log(step, last) end
    end
  end
  return last
end
doc(P.pretrain, 'gp.polychromic.pretrain(gpt, task, tok, {steps=300, batch=32, lr=3e-3, log=fn})',
  "train the base on the task's valid examples (a row each: prompt .. reply .. '\\n'); returns the last loss")

---------------------------------------------------------------------------
-- sampling: B prompts x n samples in one gp.generate call, then the padded
-- token rows, the target ids (-100 off the reply), and the reply mask

function P.rollout(policy, tok, prompts, opts)
  local n, max_new = opts.n or DEF.n, opts.max_new or DEF.max_new
  -- the adapters merged into dense weights while sampling: a decode step then
  -- costs what the base's does (the update reads the adapters as they are);
  -- with a dense sampler (P.sample_from) it is refreshed and sampled instead
  local go = {n = n, max_new = max_new, temperature = opts.temperature or DEF.temperature,
    top_p = opts.top_p or DEF.top_p, stop = {tok.stop}, tokenizer = tok}
  local dense = rawget(policy, '_sampler')
  local r
  if dense then
    r = generate(lora.dense_copy(dense, policy), prompts, go)
  else
    r = lora.merged(policy, generate, policy, prompts, go)
  end
  local R = #prompts * n
  local rows, Tm = {}, 0
  local ro = {prompts = {}, replies = {}, lens = {}, plens = {}, stopped = {}, n = n, B = #prompts, R = R}
  for i = 1, R do
    local p = prompts[math.floor((i - 1) / n) + 1]
    local pid = tok:encode(p)
    local reply = r.lists[i]
    local stopped = #reply < max_new -- ended at the stop token (else cut at max_new: no stop token to score)
    local row = {}
    for _, v in ipairs(pid) do row[#row + 1] = v end
    for _, v in ipairs(reply) do row[#row + 1] = v end
    if stopped then row[#row + 1] = tok.stop end
    rows[i] = row
    Tm = math.max(Tm, #row)
    ro.prompts[i], ro.replies[i], ro.lens[i], ro.plens[i], ro.stopped[i] = p, r.text[i], #reply, #pid, stopped
    ro.ids = ro.ids or {}
    ro.ids[i] = reply
  end
  -- full (R, Tm) rows (padded with the stop id); targets (R, Tm-1): the
  -- next token on reply positions (the stop token included), else -100;
  -- pool (R, Tm): 1 on the reply's positions (and the stop) for embeddings
  local full, tgt, pool = {}, {}, {}
  for i = 1, R do
    local row, pl = rows[i], ro.plens[i]
    local f, t, m = {}, {}, {}
    for j = 1, Tm do
      f[j] = row[j] or tok.stop
      m[j] = (j > pl and j <= #row) and 1 or 0
    end
    for j = 1, Tm - 1 do t[j] = (j >= pl and j < #row) and row[j + 1] or -100 end
    full[i], tgt[i], pool[i] = f, t, m
  end
  local dev = device_of(policy)
  ro.full = gp.tensor(full, {dtype = 'i64', device = dev})
  ro.targets = gp.tensor(tgt, {dtype = 'i64', device = dev})
  ro.pool = gp.tensor(pool, {dtype = 'f32', device = dev})
  ro.T = Tm
  -- the first target column that can be scored (the shortest prompt's last position): a model with
  -- :hidden (nn.GPT, the Llama family) computes its head over columns from there on only (token_logp)
  local pmin = math.huge
  for i = 1, R do pmin = math.min(pmin, ro.plens[i]) end
  ro.from = policy.hidden and pmin or 1
  return ro
end
-- rollouts of policy sample from dense (a model of its architecture with plain
-- dense weights) after gp.lora.dense_copy(dense, policy); nil: from policy
function P.sample_from(policy, dense)
  if dense ~= nil and not nn.is_module(dense) then raise('polychromic.sample_from: dense must be a module or nil, got ' .. type(dense)) end
  rawset(policy, '_sampler', dense)
  return policy
end
doc(P.sample_from, 'gp.polychromic.sample_from(policy, dense)', 'rollouts of policy sample from dense instead (a model of the same architecture with plain dense weights, e.g. the checkpoint loaded again), refreshed by gp.lora.dense_copy(dense, policy) before each: a 4-bit base\'s sampling at the dense model\'s speed (the one-kernel decode step of a bf16 Llama) for 2 more bytes a parameter; nil: sample from policy itself')

doc(P.rollout, string.format('gp.polychromic.rollout(policy, tok, prompts, {n=%d, max_new=%d, temperature=%g, top_p=%g})',
  DEF.n, DEF.max_new, DEF.temperature, DEF.top_p),
  'sample n replies per prompt in one gp.generate call; returns replies (prompt-major), the padded rows full (R, T), targets (R, T-1) (-100 off the reply) and the reply mask pool (R, T)')

-- per-token log-probabilities (R, T-1) of the targets (0 where ignored), with grad
-- targets (R, K) with K < T-1: the last K columns only (a model with :hidden, whose head then runs on K positions)
function P.token_logp(model, full, targets)
  local T, K = full:size(2), targets:size(2)
  local x = full:narrow(2, 1, T - 1)
  local logits
  if K == T - 1 then
    logits = model(x)
  elseif K < T - 1 and model.hidden then
    logits = model.lm_head(model:hidden(x):narrow(2, T - K, K))
  else
    raise(string.format('polychromic.token_logp: targets have %d columns for rows of %d tokens (T-1 = %d, or fewer with a model that has :hidden)',
      K, T, T - 1))
  end
  return -gp.cross_entropy(logits, targets, {reduction = 'none'})
end
doc(P.token_logp, 'gp.polychromic.token_logp(model, full, targets)',
  'teacher-forced log p of every target token (R, T-1), 0 where the target is -100; differentiable. Targets of K < T-1 columns score the last K positions only (models with :hidden, nn.GPT and the Llama family: the head runs on those K)')

-- the scored target columns of a rollout: ro.from .. T-1
local function scored_targets(ro)
  local from = ro.from or 1
  if from <= 1 then return ro.targets end
  return ro.targets:narrow(2, from, ro.T - from)
end
P.scored_targets = scored_targets
doc(P.scored_targets, 'gp.polychromic.scored_targets(rollout)', 'the target columns of a rollout that can be scored, rollout.from .. T-1 (all of them for models without :hidden): what token_logp and the PPO mask take')

-- default embedder: mean-pooled final hidden states of the frozen base over
-- the reply positions, centered over the batch (the common direction of all
-- hidden states would make every cosine near 1)
function P.base_embed(policy, ro)
  return gp.no_grad(function()
    local h = lora.without(policy, function() return P.hidden(policy, ro.full) end)
    local m = ro.pool:unsqueeze(3)
    local cnt = ro.pool:sum(2, {keepdim = true}):clamp(1, math.huge)
    local e = (h * m):sum(2) / cnt
    return e - e:mean(1, {keepdim = true})
  end)
end
doc(P.base_embed, 'gp.polychromic.base_embed(policy, rollout)',
  "reply embeddings (R, C): the frozen base's (adapters off) final hidden states mean-pooled over each reply, centered over the batch")

-- token n-gram embedder: each reply (its token ids, with a boundary symbol at
-- both ends) as the 0/1 presence vector of its n-grams (n = opts.ngrams,
-- default {2, 3}), hashed into dim (default 512) buckets. 1 - cos of two such
-- vectors is 1 - |A and B| / sqrt(|A| |B|) over the replies' n-gram sets
-- (the Ochiai form of 1 - Jaccard): 0 for identical replies, 1 for replies
-- that share no n-gram, and never above 1, so a reply cannot look more
-- different than "shares nothing"
function P.ngram_embed(policy, ro, opts)
  opts = opts or {}
  local dim = opts.dim or 512
  local ns = opts.ngrams or {2, 3}
  local R = ro.R
  local rows = {}
  local BOUND = 1000003 -- a symbol no token id takes
  for i = 1, R do
    local ids = ro.ids[i]
    local seq = {BOUND}
    for _, v in ipairs(ids) do seq[#seq + 1] = v end
    seq[#seq + 1] = BOUND
    local row = {}
    for j = 1, dim do row[j] = 0 end
    for _, n in ipairs(ns) do
      for s = 1, #seq - n + 1 do
        local h = 2166136261
        h = (h * 31 + n) % 4294967296
        for k = s, s + n - 1 do h = (h * 1000003 + seq[k] + 7) % 4294967291 end
        row[h % dim + 1] = 1
      end
    end
    rows[i] = row
  end
  return gp.tensor(rows, {dtype = 'f32', device = device_of(policy)})
end
doc(P.ngram_embed, 'gp.polychromic.ngram_embed(policy, rollout, {ngrams={2,3}, dim=512})',
  "reply embeddings (R, dim): the 0/1 presence of each reply's token n-grams (boundaries included), hashed; 1 - cos is an n-gram set distance in [0, 1]")

-- exact-match embedder: each reply (its whole token sequence) as a one-hot
-- vector in dim (default 4096) buckets of a hash of the sequence, so 1 - cos
-- is 0 for identical replies and 1 for different ones (two different replies
-- that share a bucket, about 1 pair in dim, count as identical). With
-- set_div = 'distinct' a subset's distinct count is then the number of
-- different rewarded replies. One scatter_add on the device builds the rows.
function P.exact_embed(policy, ro, opts)
  opts = opts or {}
  local dim = opts.dim or 4096
  if type(dim) ~= 'number' or dim < 1 or dim % 1 ~= 0 then
    raise('polychromic.exact_embed: dim must be a positive integer, got ' .. tostring(dim))
  end
  local R = ro.R
  local BOUND = 1000003 -- a symbol no token id takes: ends the sequence
  local bucket = {}
  for i = 1, R do
    local h = 2166136261
    for _, v in ipairs(ro.ids[i]) do h = (h * 1000003 + v + 7) % 4294967291 end
    h = (h * 1000003 + BOUND) % 4294967291
    bucket[i] = {h % dim}
  end
  local dev = device_of(policy)
  local idx = gp.tensor(bucket, {dtype = 'i64', device = dev})
  return gp.zeros({R, dim}, {device = dev}):scatter_add(2, idx, gp.ones({R, 1}, {device = dev}))
end
doc(P.exact_embed, 'gp.polychromic.exact_embed(policy, rollout, {dim=4096})',
  "reply embeddings (R, dim): a one-hot row in the bucket of a hash of the reply's whole token sequence; 1 - cos is 0 for identical replies and 1 for different ones (up to hash collisions, about 1 pair in dim)")

---------------------------------------------------------------------------
-- advantages

-- the subsets of {1..n} of size m: all of them when there are at most k,
-- else k distinct random ones (rand(n) -> 1..n)
function P.subsets(n, m, k, rand)
  local all = {}
  local function rec(start, cur)
    if #cur == m then all[#all + 1] = {unpack(cur)}; return end
    for i = start, n do
      cur[#cur + 1] = i
      rec(i + 1, cur)
      cur[#cur] = nil
      if #all > k then return end
    end
  end
  local total = 1
  for i = 1, m do total = total * (n - m + i) / i end
  if total <= k then rec(1, {}); return all end
  local seen, out = {}, {}
  while #out < k do
    local pick, used = {}, {}
    while #pick < m do
      local i = rand(n)
      if not used[i] then used[i] = true; pick[#pick + 1] = i end
    end
    table.sort(pick)
    local key = table.concat(pick, ',')
    if not seen[key] then seen[key] = true; out[#out + 1] = pick end
  end
  return out
end
doc(P.subsets, 'gp.polychromic.subsets(n, m, k, rand)', 'subsets of {1..n} of size m: all of them when C(n, m) <= k, else k distinct random ones')

-- per-sample advantages (a Lua list of R = B n numbers) and set statistics.
-- rewards: a list of R numbers; emb: (R, D) embeddings (poly, additive)
function P.advantages(objective, rewards, emb, B, n, opts)
  opts = opts or {}
  local adv = {}
  local stats = {}
  if objective == 'rl' then
    for b = 1, B do
      local s = 0
      for i = 1, n do s = s + rewards[(b - 1) * n + i] end
      for i = 1, n do adv[(b - 1) * n + i] = rewards[(b - 1) * n + i] - s / n end
    end
    return adv, stats
  end
  if objective ~= 'poly' and objective ~= 'additive' then raise('polychromic: unknown objective ' .. tostring(objective)) end
  local set_div = opts.set_div or DEF.set_div
  if set_div ~= 'pair' and set_div ~= 'distinct' then
    raise(string.format("polychromic.advantages: set_div must be 'pair' or 'distinct', got %s", tostring(set_div)))
  end
  local distinct = set_div == 'distinct'
  if distinct and objective ~= 'poly' then
    raise("polychromic.advantages: set_div 'distinct' is for the poly objective (f = mean reward x diversity), not " .. objective)
  end
  if distinct and opts.valid_only then
    raise("polychromic.advantages: valid_only weights pairs (set_div 'pair'); 'distinct' already counts rewarded replies only")
  end
  local m = math.max(2, math.min(n, opts.subset_size or math.max(2, math.floor(n / 2))))
  local subs = P.subsets(n, m, opts.max_subsets or DEF.max_subsets, opts.rand or math.random)
  local K = #subs
  -- the distance of every pair of every prompt's samples: one (B C(n,2), 2, D)
  -- gather and one kernel launch; a subset's diversity is the mean of its pairs'
  local pid, pairs = {}, {}
  for i = 1, n do pid[i] = {} end
  for i = 1, n do
    for j = i + 1, n do pairs[#pairs + 1] = {i, j}; pid[i][j] = #pairs end
  end
  local NP = #pairs
  local idx = {}
  for b = 1, B do
    for _, pr in ipairs(pairs) do
      idx[#idx + 1] = (b - 1) * n + pr[1] - 1
      idx[#idx + 1] = (b - 1) * n + pr[2] - 1
    end
  end
  local D = emb:size(2)
  local it = gp.tensor(idx, {dtype = 'i64', device = emb.device})
  local x = emb:index_select(1, it):view {B * NP, 2, D}:float()
  local kms, dist = gp.time_once(function() return gp.set_diversity(x) end) -- the kernel alone, on the device
  stats.kernel_s = kms / 1000
  dist = dist:totable()
  local lam, floor, valid_only = opts.lambda or DEF.lambda, opts.floor or DEF.floor, opts.valid_only
  local npair = m * (m - 1) / 2
  -- distinct: with s_ij = 1 - d_ij clamped to [0, 1] (s_ii = 1), reply i's
  -- soft cluster in S' has the reward mass M_i = sum_{j in S'} r_j s_ij >= r_i;
  -- the distinct count sum_{i in S', r_i > 0} r_i^2 / M_i is the number of
  -- different rewarded replies (identical ones count 1 together) for 0/1
  -- rewards, and diversity = that count / sum r (1 when sum r = 0), in (0, 1]:
  -- 1 when the rewarded replies are all different or at most one is rewarded
  local function sim(b, i, j)
    local s = 1 - dist[(b - 1) * NP + (i < j and pid[i][j] or pid[j][i])]
    return s < 0 and 0 or (s > 1 and 1 or s)
  end
  for b = 1, B do
    local o = (b - 1) * n
    local fsum, contain, cnt = 0, {}, {}
    for i = 1, n do contain[i], cnt[i] = 0, 0 end
    for _, sub in ipairs(subs) do
      local r, d = 0, 0
      if distinct then
        for a = 1, m do
          local i = sub[a]
          local ri = rewards[o + i]
          r = r + ri
          if ri ~= 0 then
            local mass = ri
            for c = 1, m do
              local j = sub[c]
              if j ~= i then mass = mass + rewards[o + j] * sim(b, i, j) end
            end
            d = d + ri * ri / mass
          end
        end
        d = r ~= 0 and d / r or 1
        r = r / m
      else
        for a = 1, m do
          local i = sub[a]
          r = r + rewards[o + i]
          for c = a + 1, m do
            local j = sub[c]
            local w = valid_only and rewards[o + i] * rewards[o + j] or 1
            d = d + w * dist[(b - 1) * NP + pid[i][j]]
          end
        end
        r, d = r / m, d / npair
      end
      local f = objective == 'poly' and r * (floor + d) or r + lam * d
      fsum = fsum + f
      for _, i in ipairs(sub) do contain[i] = contain[i] + f; cnt[i] = cnt[i] + 1 end
    end
    local mean = fsum / K
    for i = 1, n do adv[o + i] = cnt[i] > 0 and contain[i] / cnt[i] - mean or 0 end
  end
  stats.subsets = K
  stats.subset_size = m
  stats.set_div = set_div
  return adv, stats
end
doc(P.advantages, string.format("gp.polychromic.advantages('poly'|'additive'|'rl', rewards, emb, B, n, {subset_size=n/2, max_subsets=%d, lambda=%g, floor=%g, valid_only=false, set_div='%s'})",
  DEF.max_subsets, DEF.lambda, DEF.floor, DEF.set_div),
  'per-sample advantages: poly/additive score subsets of each prompt\'s n samples (f = mean r * (floor + diversity), or mean r + lambda * diversity) and give each sample the mean score of its subsets minus the mean of all; rl: r - mean r of the set. '
  .. "set_div 'pair': diversity = mean pair distance d = 1 - cos (valid_only weights a pair by r_i r_j); "
  .. "set_div 'distinct' (poly only): diversity = distinct / sum r (1 when sum r = 0), distinct = sum over rewarded i of r_i^2 / sum_j r_j s_ij with s = 1 - d clamped to [0, 1], s_ii = 1 (the number of different rewarded replies for 0/1 rewards), so f = floor * mean r + distinct / m. "
  .. 'Every pair distance of every prompt comes from one set_diversity launch')

-- scale advantages by the std over the batch ('batch'), per set ('set'), or not ('none')
function P.normalize(adv, B, n, how)
  if how == 'none' then return adv end
  local function std(lo, hi)
    local s, s2 = 0, 0
    for i = lo, hi do s = s + adv[i]; s2 = s2 + adv[i] * adv[i] end
    local k = hi - lo + 1
    return math.sqrt(math.max(0, s2 / k - (s / k) ^ 2))
  end
  local out = {}
  if how == 'set' then
    for b = 1, B do
      local lo, hi = (b - 1) * n + 1, b * n
      local sd = std(lo, hi)
      for i = lo, hi do out[i] = adv[i] / (sd + 1e-4) end
    end
  else
    local sd = std(1, B * n)
    for i = 1, B * n do out[i] = adv[i] / (sd + 1e-4) end
  end
  return out
end
doc(P.normalize, "gp.polychromic.normalize(adv, B, n, 'batch'|'set'|'none')", 'advantages over their std (over the batch or per set)')

-- PPO clipped surrogate over the reply tokens (+ kl * k3 KL to the base)
function P.ppo_loss(logp, old, adv, mask, opts)
  opts = opts or {}
  local clip = opts.clip or DEF.clip
  local ratio = (logp - old):exp()
  local a = adv:view {adv:numel(), 1}
  local s1 = ratio * a
  local s2 = ratio:clamp(1 - clip, 1 + clip) * a
  local ntok = mask:sum():clamp(1, math.huge)
  local loss = -(s1:minimum(s2) * mask):sum() / ntok
  if opts.kl and opts.kl > 0 and opts.base_logp then
    local d = opts.base_logp - logp
    loss = loss + ((d:exp() - d - 1) * mask):sum() / ntok * opts.kl
  end
  return loss
end
doc(P.ppo_loss, string.format('gp.polychromic.ppo_loss(logp, old_logp, adv, mask, {clip=%g, kl=%g, base_logp=})', DEF.clip, DEF.kl),
  'the PPO clipped surrogate -mean over reply tokens of min(ratio A, clip(ratio) A) with ratio = exp(logp - old), plus kl times the k3 estimate of KL(policy || base)')

-- one update of the adapters: the log-probs with autograd, the PPO loss (old:
-- the first pass's log-probs, taken from this one when nil), backward,
-- clipping to norm 1, the optimizer's step; returns the loss and old
function P.ppo_step(policy, opt, full, targets, adv, mask, opts)
  opts = opts or {}
  opt:zero_grad()
  local logp = P.token_logp(policy, full, targets)
  local old = opts.old or logp:detach()
  local loss = P.ppo_loss(logp, old, adv, mask, {clip = opts.clip, kl = opts.kl, base_logp = opts.base_logp})
  loss:backward()
  optim.clip_grad_norm(opt, 1.0)
  opt:step()
  return loss, old
end
doc(P.ppo_step, 'gp.polychromic.ppo_step(policy, opt, full, targets, adv, mask, {old=, clip=, kl=, base_logp=})',
  'one PPO update: zero_grad, token_logp with autograd, ppo_loss against old (this pass\'s log-probs detached when nil), backward, clip_grad_norm to 1, opt:step(); returns the loss and old')

-- the set diversity of the valid replies: per prompt, the mean pair distance
-- 1 - cos(e_i, e_j) over the pairs of its replies with reward > thr (0.5);
-- returns the mean over the B prompts (a prompt with fewer than 2 valid
-- replies counts 0) and the mean over the prompts with at least 2 (nil if none)
function P.valid_set_diversity(emb, rewards, B, n, thr)
  thr = thr or 0.5
  local e = emb:float():cpu():totable()
  local function cos(a, b)
    local ab, aa, bb = 0, 0, 0
    for k = 1, #a do ab, aa, bb = ab + a[k] * b[k], aa + a[k] * a[k], bb + b[k] * b[k] end
    return ab / math.max(math.sqrt(aa * bb), 1e-12)
  end
  local total, with2, nwith2 = 0, 0, 0
  for b = 1, B do
    local v = {}
    for i = (b - 1) * n + 1, b * n do if rewards[i] > thr then v[#v + 1] = e[i] end end
    if #v >= 2 then
      local d, np = 0, 0
      for i = 1, #v do
        for j = i + 1, #v do d, np = d + 1 - cos(v[i], v[j]), np + 1 end
      end
      d = d / np
      total, with2, nwith2 = total + d, with2 + d, nwith2 + 1
    end
  end
  return total / B, nwith2 > 0 and with2 / nwith2 or nil
end
doc(P.valid_set_diversity, 'gp.polychromic.valid_set_diversity(emb, rewards, B, n, thr=0.5)',
  'the MiniLM-style set diversity of the valid replies: per prompt the mean 1 - cos over pairs of its replies with reward > thr; returns the mean over prompts (0 for fewer than 2 valid) and the mean over prompts with at least 2 valid')

---------------------------------------------------------------------------
-- evaluation: k samples for each eval prompt

function P.evaluate(policy, tok, task, opts)
  local k = opts.eval_n or DEF.eval_n
  local prompts = task.eval_prompts
  local ro = P.rollout(policy, tok, prompts, {n = k, max_new = opts.max_new, temperature = opts.temperature, top_p = opts.top_p})
  local thr = opts.valid_threshold or 0.5
  local sum_r, passed, distinct, nvalid = 0, 0, 0, 0
  for b = 1, #prompts do
    local any, seen, nd = false, {}, 0
    for i = 1, k do
      local j = (b - 1) * k + i
      local r = task.reward(ro.prompts[j], ro.replies[j])
      sum_r = sum_r + r
      if r > thr then
        any = true
        nvalid = nvalid + 1
        if not seen[ro.replies[j]] then seen[ro.replies[j]] = true; nd = nd + 1 end
      end
    end
    if any then passed = passed + 1 end
    distinct = distinct + nd
  end
  local embed = opts.embed or P.base_embed
  local e = embed(policy, ro)
  local div = gp.set_diversity(e:float():view {#prompts, k, e:size(2)}):mean():item()
  return {mean_reward = sum_r / (#prompts * k), pass_at_n = passed / #prompts, n = k,
          distinct_valid = distinct / #prompts, set_diversity = div, valid_fraction = nvalid / (#prompts * k)}
end
doc(P.evaluate, string.format('gp.polychromic.evaluate(policy, tok, task, {eval_n=%d, temperature=, top_p=, max_new=})', DEF.eval_n),
  'k samples per eval prompt: mean_reward, pass_at_n (a valid reply among the k), distinct_valid (distinct valid replies per prompt), set_diversity (mean over prompts)')

---------------------------------------------------------------------------
-- the PPO update as CUDA graphs (finetune's `graph`, on the GPU): the
-- rollout's rows are copied into static tensors of a fixed width (its
-- columns rounded up to a multiple of 32, at most the model's block_size + 1;
-- scored from a column rounded down to one past a multiple of 16), so one
-- capture serves every step until a rollout needs more columns or an earlier
-- first scored column (then the graphs are made again, after one eager
-- update). The padding adds only
-- ignored targets (-100, mask 0): the loss and the gradients are those of the
-- rows as they are. Epoch 1 keeps its own log-probs as old (one graph), later
-- epochs read them (a second graph). Returns {update = function(ro, at,
-- epochs, kl) -> the last epoch's loss, free = function() (the graphs),
-- captures = how many graphs were captured}; opt needs device_hyper.
function P.graph_updater(policy, opt, o, stop)
  local self = {captures = 0}
  local cap
  local function free()
    if cap then
      for _, k in ipairs {'g1', 'g2'} do if cap[k] then cap[k]:free() end end
      cap = nil
    end
  end
  local function make(R, T, from, kl)
    free()
    local c = {R = R, T = T, from = from}
    c.full = gp.full({R, T}, stop, {dtype = 'i64', device = 'cuda'})
    c.targets = gp.full({R, T - 1}, -100, {dtype = 'i64', device = 'cuda'})
    c.tg = c.targets:narrow(2, from, T - from)
    c.at = gp.zeros({R}, {device = 'cuda'})
    c.old = gp.zeros({R, T - from}, {device = 'cuda'})
    c.base = kl > 0 and gp.zeros({R, T - from}, {device = 'cuda'}) or nil
    cap = c
  end
  local function pass(first)
    return function()
      local mask = cap.tg:ne(-100):float()
      local loss, old = P.ppo_step(policy, opt, cap.full, cap.tg, cap.at, mask,
        {old = not first and cap.old or nil, clip = o.clip, kl = o.kl, base_logp = cap.base})
      if first then cap.old:copy_(old) end
      return loss
    end
  end
  local function update(ro, at, epochs, kl)
    local R, from = ro.full:size(1), ro.from or 1
    -- (the model reads T - 1 columns: at most its positions)
    local bs = type(policy.config) == 'table' and policy.config.block_size or math.huge
    local T = math.max(ro.T, math.min(math.ceil(ro.T / 32) * 32, bs + 1))
    local f0 = from == 1 and 1 or math.max(1, math.floor((from - 1) / 16) * 16 + 1)
    if not cap or cap.R ~= R or ro.T > cap.T or from < cap.from or (kl > 0) ~= (cap.base ~= nil) then
      make(R, math.max(T, cap and cap.R == R and cap.T or 0), math.min(f0, cap and cap.R == R and cap.from or f0), kl)
    end
    cap.full:fill_(stop)
    cap.full:narrow(2, 1, ro.T):copy_(ro.full)
    cap.targets:fill_(-100)
    cap.targets:narrow(2, 1, ro.T - 1):copy_(ro.targets)
    cap.at:copy_(at)
    if cap.base then
      gp.no_grad(function()
        cap.base:copy_(lora.without(policy, function() return P.token_logp(policy, cap.full, cap.tg) end))
      end)
    end
    local loss
    for e = 1, epochs do
      local key = e == 1 and 'g1' or 'g2'
      if cap[key] then
        opt:prepare_replay()
        loss = cap[key]:replay()
      else -- this epoch eagerly (it updates), then its capture for the next steps
        loss = pass(e == 1)()
        collectgarbage('collect')
        cap[key] = opt:capture(pass(e == 1))
        self.captures = self.captures + 1
      end
    end
    return loss
  end
  self.update, self.free = update, free
  return self
end
doc(P.graph_updater, 'gp.polychromic.graph_updater(policy, opt, {clip=, kl=}, stop)',
  "the PPO update as CUDA graphs (what finetune's graph option runs; opt made with device_hyper = true): u.update(rollout, adv, epochs, kl) copies the rollout's rows into static tensors padded to a fixed width (stop tokens, ignored targets), replays the captured epochs (after one eager update and a capture when the rollout needs more columns or an earlier first scored column) and returns the last loss; u.free() releases the graphs; u.captures counts them")

---------------------------------------------------------------------------
-- one fine-tuning run

-- o: objective, n, temperature, top_p, steps, prompts_per_step, lambda, kl,
-- clip, lr, epochs, adv_norm, subset_size, max_subsets, floor, valid_only,
-- set_div ('pair' | 'distinct'), max_new, seed, embed (function(policy, rollout) -> (R, D); default base_embed), log (function(line)),
-- on_step (function(record) after every step), prompt_list (the same B prompts every step), valid_diversity (records
-- valid_set_diversity too)
function P.finetune(policy, tok, task, o)
  local say = o.log or function() end
  local rng_state = o.seed or 1
  local function rand(n) -- a small LCG: the same subsets and prompts for every objective
    rng_state = (rng_state * 1103515245 + 12345) % 2147483648
    return math.floor(rng_state / 2147483648 * n) + 1
  end
  local params = lora.parameters(policy)
  -- the PPO update as CUDA graphs (graph_updater) on the GPU unless o.graph == false
  local use_graph = o.graph ~= false and o.objective ~= 'sft' and device_of(policy) == 'cuda'
  local opt = optim.AdamW(params, {lr = o.lr or DEF.lr, weight_decay = 0, device_hyper = use_graph})
  local gu = use_graph and P.graph_updater(policy, opt, o, tok.stop) or nil
  local B, n = o.prompts_per_step or DEF.prompts_per_step, o.n or DEF.n
  local embed = o.embed or P.base_embed
  local times = {generation = 0, diversity = 0, update = 0, kernel = 0}
  local hist = {}
  for step = 1, o.steps do
    local prompts = {}
    for b = 1, B do prompts[b] = o.prompt_list and o.prompt_list[b] or task.prompts[rand(#task.prompts)] end
    local t0 = logger.now()
    local rec = {step = step}
    if o.objective == 'sft' then
      -- cross-entropy on valid replies of the same prompts
      local full, tgt = {}, {}
      local rows, Tm = {}, 0
      for b = 1, B do
        local v = task.valid[prompts[b]]
        local reply = v[rand(#v)]
        local ids = tok:encode(prompts[b] .. reply .. '\n')
        rows[b] = {ids, #tok:encode(prompts[b])}
        Tm = math.max(Tm, #ids)
      end
      for b = 1, B do
        local ids, pl = rows[b][1], rows[b][2]
        local f, t = {}, {}
        for j = 1, Tm do f[j] = ids[j] or tok.stop end
        for j = 1, Tm - 1 do t[j] = (j >= pl and j < #ids) and ids[j + 1] or -100 end
        full[b], tgt[b] = f, t
      end
      local dev = device_of(policy)
      local ft, tt = gp.tensor(full, {dtype = 'i64', device = dev}), gp.tensor(tgt, {dtype = 'i64', device = dev})
      gp.sync()
      local t1 = logger.now()
      times.generation = times.generation + (t1 - t0)
      opt:zero_grad()
      policy:train()
      local loss = gp.cross_entropy(policy(ft:narrow(2, 1, Tm - 1)), tt)
      loss:backward()
      opt:step()
      rec.loss = loss:item()
      times.update = times.update + (logger.now() - t1)
    else
      local ro = P.rollout(policy, tok, prompts, {n = n, max_new = o.max_new, temperature = o.temperature, top_p = o.top_p})
      local rewards, sr, nd = {}, 0, 0
      for b = 1, B do
        local seen = {}
        for i = (b - 1) * n + 1, b * n do
          rewards[i] = task.reward(ro.prompts[i], ro.replies[i])
          sr = sr + rewards[i]
          if rewards[i] > 0.5 and not seen[ro.replies[i]] then seen[ro.replies[i]] = true; nd = nd + 1 end
        end
      end
      gp.sync()
      local t1 = logger.now()
      times.generation = times.generation + (t1 - t0)
      -- diversity: embeddings (also for rl, to report it), advantages
      local emb = embed(policy, ro)
      local adv, st = P.advantages(o.objective, rewards, emb, B, n, {subset_size = o.subset_size,
        max_subsets = o.max_subsets, lambda = o.lambda, floor = o.floor, valid_only = o.valid_only, set_div = o.set_div,
        rand = rand})
      local sdiv = gp.set_diversity(emb:float():view {B, n, emb:size(2)}):mean():item()
      if o.valid_diversity then rec.valid_diversity = P.valid_set_diversity(emb, rewards, B, n) end
      adv = P.normalize(adv, B, n, o.adv_norm or DEF.adv_norm)
      local base_logp
      local tg = scored_targets(ro)
      if (o.kl or DEF.kl) > 0 and not use_graph then
        base_logp = gp.no_grad(function()
          return lora.without(policy, function() return P.token_logp(policy, ro.full, tg) end)
        end)
      end
      gp.sync()
      local t2 = logger.now()
      times.diversity = times.diversity + (t2 - t1)
      times.kernel = times.kernel + (st.kernel_s or 0)
      -- update: PPO epochs over the batch; old log-probs from the first pass
      local dev = device_of(policy)
      local at = gp.tensor(adv, {dtype = 'f32', device = dev})
      local old, loss
      policy:train()
      if use_graph then
        loss = gu.update(ro, at, o.epochs or DEF.epochs, o.kl or DEF.kl)
      else
        local mask = tg:ne(-100):float()
        for _ = 1, o.epochs or DEF.epochs do
          loss, old = P.ppo_step(policy, opt, ro.full, tg, at, mask, {old = old, clip = o.clip, kl = o.kl, base_logp = base_logp})
        end
      end
      rec.loss = loss:item()
      local t3 = logger.now()
      times.update = times.update + (t3 - t2)
      rec.generation_s, rec.diversity_s, rec.update_s, rec.s = t1 - t0, t2 - t1, t3 - t2, t3 - t0
      local toks = 0
      for i = 1, ro.R do toks = toks + ro.lens[i] end
      rec.reply_tokens = toks / ro.R
      rec.reward = sr / ro.R
      rec.set_diversity = sdiv
      rec.distinct = nd / B
    end
    hist[#hist + 1] = rec
    if o.on_step then o.on_step(rec) end
    if o.log_every and (step % o.log_every == 0 or step == o.steps) then
      say(string.format('  %s step %d/%d: loss %.4f%s%s', o.objective, step, o.steps, rec.loss,
        rec.reward and string.format(', reward %.3f', rec.reward) or '',
        rec.set_diversity and string.format(', set diversity %.3f', rec.set_diversity) or '',
        rec.distinct and string.format(', distinct valid %.2f', rec.distinct) or ''))
    end
  end
  if gu then gu.free() end
  return {history = hist, times = times, steps = o.steps}
end
doc(P.defaults, 'gp.polychromic.defaults', 'the default options of rollout, advantages, ppo_loss, evaluate and finetune')
doc(P.finetune, string.format("gp.polychromic.finetune(policy, tok, task, {objective='poly', steps=, n=%d, prompts_per_step=%d, lr=%g, epochs=%d, set_div='%s', ...})",
  DEF.n, DEF.prompts_per_step, DEF.lr, DEF.epochs, DEF.set_div),
  'fine-tune the LoRA adapters of policy with the objective (set_div, floor, valid_only, subset_size, max_subsets as in advantages); on_step(record) after each step (loss, reward, set_diversity, distinct, the step\'s seconds and its parts), prompt_list: the same prompts every step; graph (true: on the GPU the PPO update runs as CUDA graphs over rows padded to a fixed width, captured after one eager update and made again when a rollout needs more columns; false: eager updates); returns {history, times = {generation, diversity, update, kernel} in seconds}')

return P
