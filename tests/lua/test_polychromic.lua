-- gp.polychromic: the built-in task's reward, subsets, advantages by hand,
-- the PPO loss gradient, and a few steps of every objective on a tiny model.
local T = require 'lib'
local gp = require 'gpush'
local P = gp.polychromic

local cpu = {device = 'cpu'}

T.test('polychromic: sum task reward and tokenizer', function()
  local task = P.sum_task {max = 5}
  T.eq(#task.prompts, 11)
  T.eq(task.reward('7=', '3+4'), 1)
  T.eq(task.reward('7=', '2+5'), 1)
  T.eq(task.reward('7=', '03+4'), 0) -- leading zero
  T.eq(task.reward('7=', '1+6'), 0)  -- 6 > max
  T.eq(task.reward('7=', '3+3'), 0)
  T.eq(task.reward('7=', '3+4x'), 0)
  T.eq(#task.valid['5='], 6)
  local tok = P.char_tokenizer(task.chars)
  T.eq(tok:decode(tok:encode('12=3+9\n')), '12=3+9\n')
  T.eq(tok:decode({tok.stop}), '\n')
  T.raises(function() tok:encode('a') end, 'not in the vocabulary')
end)

T.test('polychromic: subsets and advantages by hand', function()
  local all = P.subsets(4, 2, 64, math.random)
  T.eq(#all, 6)
  local some = P.subsets(10, 3, 7, function(n) return math.random(n) end)
  T.eq(#some, 7)
  -- rl: r - mean r per set
  local adv = P.advantages('rl', {1, 0, 0, 0, 1, 1, 0, 0}, nil, 2, 4)
  T.same(adv, {0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5}, 1e-12)
  -- poly with m = 2 over orthogonal embeddings (every pair distance 1):
  -- f(pair) = mean r; sample 1 (r = 1): pairs (1,2),(1,3),(1,4) score 0.5 each
  local emb = gp.tensor({{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}, {0, 0, 0, 1}}, cpu)
  local a = P.advantages('poly', {1, 0, 0, 0}, emb, 1, 4, {subset_size = 2})
  T.same(a, {0.25, -0.25 / 3, -0.25 / 3, -0.25 / 3}, 1e-6)
  -- identical embeddings: no diversity, every score 0
  local same = gp.ones({4, 3}, cpu)
  T.same(P.advantages('poly', {1, 1, 0, 1}, same, 1, 4, {subset_size = 3}), {0, 0, 0, 0}, 1e-6)
  -- at equal reward, leave-one-out scores: f(without 1) = f(without 2) =
  -- f(without 3) = 4/3, f(without 4) = 2/3, mean 7/6; adv = (mean - f(without i)) / 3
  local e2 = gp.tensor({{1, 0}, {1, 0}, {0, 1}, {-1, 0}}, cpu)
  local a2 = P.advantages('poly', {1, 1, 1, 1}, e2, 1, 4, {subset_size = 3})
  T.same(a2, {-1 / 18, -1 / 18, -1 / 18, 1 / 6}, 1e-6)
  -- additive = rl-like reward part + lambda * diversity part
  local a3 = P.advantages('additive', {1, 0, 0, 0}, same, 1, 4, {subset_size = 2, lambda = 0.3})
  T.same(a3, {0.25, -0.25 / 3, -0.25 / 3, -0.25 / 3}, 1e-6)
  T.raises(function() P.advantages('nope', {1}, emb, 1, 1) end, 'unknown objective')
  T.same(P.normalize({1, -1, 3, -3}, 2, 2, 'set'), {1 / 1.0001, -1 / 1.0001, 3 / 3.0001, -3 / 3.0001}, 1e-9)
end)

T.test('polychromic: n-gram embeddings give set distances in [0, 1]', function()
  -- replies as token ids: identical -> 0, no shared 2-/3-gram -> 1
  local ro = {R = 4, ids = {{1, 2, 3}, {1, 2, 3}, {3, 2, 1}, {1, 2, 4}}}
  local pol = {wte = {weight = gp.zeros({1, 1}, cpu)}}
  local e = P.ngram_embed(pol, ro)
  T.eq(e:size(1), 4)
  local d = function(i, j)
    local x = e:index_select(1, gp.tensor({i - 1, j - 1}, {dtype = 'i64', device = 'cpu'})):view {1, 2, e:size(2)}
    return gp.set_diversity(x):item()
  end
  T.near(d(1, 2), 0, 1e-6)
  T.near(d(1, 3), 1, 1e-6)
  -- 1 2 3 vs 1 2 4: shared ^1, 12, ^12 of 7 n-grams each: 1 - 3/7
  T.near(d(1, 4), 1 - 3 / 7, 1e-6)
end)

T.test('polychromic: exact embeddings: identical replies -> identical rows, different -> orthogonal', function()
  local pol = {wte = {weight = gp.zeros({1, 1}, cpu)}}
  local ro = {R = 5, ids = {{1, 2, 3}, {1, 2, 3}, {3, 2, 1}, {1, 2}, {}}}
  local e = P.exact_embed(pol, ro)
  T.eq(e:size(1), 5)
  T.eq(e:size(2), 4096)
  local rows = e:totable()
  local function dot(a, b) local s = 0; for k = 1, #a do s = s + a[k] * b[k] end; return s end
  for i = 1, 5 do T.near(dot(rows[i], rows[i]), 1, 0) end -- one-hot
  T.same(rows[1], rows[2], 0)
  for _, p in ipairs {{1, 3}, {1, 4}, {1, 5}, {3, 4}, {3, 5}, {4, 5}} do
    T.near(dot(rows[p[1]], rows[p[2]]), 0, 0, 'replies ' .. p[1] .. ' and ' .. p[2])
  end
  T.eq(P.exact_embed(pol, ro, {dim = 64}):size(2), 64)
  T.raises(function() P.exact_embed(pol, ro, {dim = 0}) end, 'exact_embed', 'dim')
end)

T.test('polychromic: distinct set diversity by hand', function()
  local pol = {wte = {weight = gp.zeros({1, 1}, cpu)}}
  -- replies 1 and 2 identical and valid, 3 invalid, 4 a different valid one
  local emb = P.exact_embed(pol, {R = 4, ids = {{5, 6}, {5, 6}, {7}, {6, 5}}})
  local r = {1, 1, 0, 1}
  -- m = 2, the 6 pairs: f = (number of different rewarded replies) / 2:
  -- {1,2} 1/2 (one cluster), {1,3} 1/2, {1,4} 1, {2,3} 1/2, {2,4} 1, {3,4} 1/2;
  -- mean 4/6; the pairs holding 1: (1/2 + 1/2 + 1) / 3 = 2/3 -> 0, same for 2;
  -- 3: 3/2 / 3 = 1/2 -> -1/6; 4: 5/2 / 3 = 5/6 -> +1/6
  local a = P.advantages('poly', r, emb, 1, 4, {subset_size = 2, set_div = 'distinct'})
  T.same(a, {0, 0, -1 / 6, 1 / 6}, 1e-6)
  T.ok(a[1] < a[4] and a[3] < a[1], 'the duplicate valid reply below the unique one, the invalid one lowest')
  -- the pair form pays the invalid reply for being different: there 3 ties with 1
  -- ({1,2}: 1 x 0, {1,3}: 1/2 x 1, {1,4}: 1 x 1; 3: {1,3}, {2,3}, {3,4} at 1/2 each)
  local ap = P.advantages('poly', r, emb, 1, 4, {subset_size = 2})
  T.near(ap[1], ap[3], 1e-6)
  -- m = 3, the 4 triples: {1,2,3} 1/3, {1,2,4} 2/3, {1,3,4} 2/3, {2,3,4} 2/3; mean 7/12;
  -- holding 1 (or 2, or 3): 5/9 -> -1/36; holding 4: 2/3 -> +1/12
  local a3 = P.advantages('poly', r, emb, 1, 4, {subset_size = 3, set_div = 'distinct'})
  T.same(a3, {-1 / 36, -1 / 36, -1 / 36, 1 / 12}, 1e-6)
  -- floor F: f = F mean r + distinct / m; the F mean r part over the pairs:
  -- holding 1, 2, 4: (1 + 1/2 + 1) / 3 = 5/6, holding 3: 1/2, mean 3/4
  local af = P.advantages('poly', r, emb, 1, 4, {subset_size = 2, set_div = 'distinct', floor = 0.5})
  T.same(af, {0.5 / 12, 0.5 / 12, -1 / 6 - 0.5 / 4, 1 / 6 + 0.5 / 12}, 1e-6)
  -- two prompts in one call: the second set (all valid, all different) is independent of the first
  local emb2 = P.exact_embed(pol, {R = 8, ids = {{5, 6}, {5, 6}, {7}, {6, 5}, {1}, {2}, {3}, {4}}})
  local a2 = P.advantages('poly', {1, 1, 0, 1, 1, 1, 1, 1}, emb2, 2, 4, {subset_size = 2, set_div = 'distinct'})
  T.same(a2, {0, 0, -1 / 6, 1 / 6, 0, 0, 0, 0}, 1e-6)
end)

T.test('polychromic: distinct with all replies different scores the mean reward (as rl would)', function()
  local pol = {wte = {weight = gp.zeros({1, 1}, cpu)}}
  local emb = P.exact_embed(pol, {R = 4, ids = {{1}, {2}, {3}, {4}}})
  -- f = mean r over the 6 pairs, r = {1, 0, 1, 1/2}, sum 5/2, mean 5/8:
  -- the pairs holding i average (r_i + (5/2 - r_i) / 3) / 2
  -- r = 1: 3/4 -> +1/8; r = 0: 5/12 -> -5/24; r = 1/2: 7/12 -> -1/24
  local a = P.advantages('poly', {1, 0, 1, 0.5}, emb, 1, 4, {subset_size = 2, set_div = 'distinct'})
  T.same(a, {1 / 8, -5 / 24, 1 / 8, -1 / 24}, 1e-6)
  -- no reward anywhere: every f is 0
  T.same(P.advantages('poly', {0, 0, 0, 0}, emb, 1, 4, {subset_size = 3, set_div = 'distinct'}), {0, 0, 0, 0}, 1e-12)
  -- a soft similarity (n-gram embeddings): replies 1 2 3 and 1 2 4 share 3 of 7 n-grams, s = 3/7;
  -- the pair {1, 2} has distinct count 2 x 1 / (1 + 3/7) = 7/5 -> f = 7/10
  local e = P.ngram_embed(pol, {R = 3, ids = {{1, 2, 3}, {1, 2, 4}, {9, 9, 9}}})
  -- the 3 pairs: {1,2} 7/10, {1,3} 1, {2,3} 1 (9 9 9 shares nothing); mean 9/10;
  -- holding 1: 17/20 -> -1/20, same for 2; holding 3: 1 -> +1/10
  T.same(P.advantages('poly', {1, 1, 1}, e, 1, 3, {subset_size = 2, set_div = 'distinct'}), {-1 / 20, -1 / 20, 1 / 10}, 1e-6)
end)

T.test('polychromic: set_div bad values and combinations give clear errors', function()
  local emb = gp.tensor({{1, 0}, {0, 1}, {1, 1}}, cpu)
  T.raises(function() P.advantages('poly', {1, 0, 1}, emb, 1, 3, {set_div = 'nope'}) end, 'set_div', 'nope')
  T.raises(function() P.advantages('additive', {1, 0, 1}, emb, 1, 3, {set_div = 'distinct'}) end, 'distinct', 'poly')
  T.raises(function() P.advantages('poly', {1, 0, 1}, emb, 1, 3, {set_div = 'distinct', valid_only = true}) end, 'valid_only')
  -- rl ignores the set diversity
  T.same(P.advantages('rl', {1, 0, 1}, nil, 1, 3, {set_div = 'distinct'}), {1 / 3, -2 / 3, 1 / 3}, 1e-12)
end)

T.test('polychromic: the PPO loss gradient at ratio 1 is -A mask / tokens', function()
  local logp = gp.randn({2, 3}, {dtype = 'f64', device = 'cpu'}):requires_grad()
  local old = logp:detach()
  local adv = gp.tensor({2, -1}, {dtype = 'f64', device = 'cpu'})
  local mask = gp.tensor({{1, 1, 0}, {0, 1, 1}}, {dtype = 'f64', device = 'cpu'})
  P.ppo_loss(logp, old, adv, mask, {clip = 0.2}):backward()
  T.same(logp.grad:totable(), {{-2 / 4, -2 / 4, 0}, {0, 1 / 4, 1 / 4}}, 1e-12)
  -- clipped: a ratio above 1 + clip with A > 0 gives no gradient
  local lp = (old + 1):detach():requires_grad()
  P.ppo_loss(lp, old, adv, mask, {clip = 0.2}):backward()
  T.same(lp.grad:select(1, 1):totable(), {0, 0, 0}, 1e-12)
  -- the KL term: zero value and zero gradient when policy = base
  local l2 = logp:detach():requires_grad()
  local with = P.ppo_loss(l2, old, adv, mask, {kl = 0.5, base_logp = old})
  T.near(with:item(), P.ppo_loss(old, old, adv, mask):item(), 1e-12)
end)

T.test('polychromic: a few steps of every objective on a tiny model', function()
  gp.manual_seed(7)
  local task = P.sum_task {max = 3}
  local tok = P.char_tokenizer(task.chars)
  local m = gp.nn.GPT {vocab_size = tok.vocab_size, block_size = 10, n_embd = 16, n_layer = 1, n_head = 2, device = 'cpu'}
  P.pretrain(m, task, tok, {steps = 2, batch = 4})
  gp.lora.apply(m, {rank = 2})
  local ro = P.rollout(m, tok, {'3=', '5='}, {n = 3, max_new = 4})
  T.eq(ro.R, 6)
  T.eq(ro.full:size(1), 6)
  T.eq(ro.targets:size(2), ro.full:size(2) - 1)
  local e = P.base_embed(m, ro)
  T.eq(e:size(1), 6)
  for _, obj in ipairs {'poly', 'additive', 'rl', 'sft'} do
    local r = P.finetune(m, tok, task, {objective = obj, steps = 2, n = 3, prompts_per_step = 2, max_new = 4, kl = 0.1,
      epochs = 2, seed = 3})
    T.eq(#r.history, 2)
    T.ok(r.history[2].loss == r.history[2].loss, obj .. ': finite loss')
  end
  local ev = P.evaluate(m, tok, task, {eval_n = 2, max_new = 4})
  T.ok(ev.pass_at_n >= 0 and ev.pass_at_n <= 1 and ev.set_diversity >= 0)
end)

T.test('polychromic: the PPO update as CUDA graphs equals the eager update (epochs 1 and 2, kl, graphs made again) (cuda)', function()
  T.cuda()
  local V, R, stop = 20, 6, 0
  local function model()
    gp.manual_seed(21)
    local m = gp.nn.GPT {vocab_size = V, block_size = 48, n_embd = 32, n_layer = 2, n_head = 2, device = 'cuda'}
    gp.lora.apply(m, {rank = 4})
    for _, e in ipairs(gp.lora.modules(m)) do gp.nn.init.normal_(e[2].lora_B, 0, 0.1) end
    m:train()
    return m
  end
  -- rollouts of T columns whose replies start after `from` tokens (targets -100 before)
  local function rollout(cols, from)
    local full = gp.randint(1, V, {R, cols}, {dtype = 'i64', device = 'cuda'})
    local tg = full:narrow(2, 2, cols - 1):contiguous()
    tg:narrow(2, 1, from - 1):fill_(-100)
    return {full = full, targets = tg, T = cols, from = from}, gp.randn({R}, {device = 'cuda'})
  end
  for _, c in ipairs {{1, 0, 2}, {2, 0.1, 4}} do
    local epochs, kl, captures = c[1], c[2], c[3]
    local mg, me = model(), model()
    local og = gp.optim.AdamW(gp.lora.parameters(mg), {lr = 1e-2, weight_decay = 0, device_hyper = true})
    local oe = gp.optim.AdamW(gp.lora.parameters(me), {lr = 1e-2, weight_decay = 0})
    local u = P.graph_updater(mg, og, {clip = 0.2, kl = kl}, stop)
    gp.manual_seed(22)
    -- the first makes the graphs, the second replays them, the third needs more columns and an earlier start
    for i, shape in ipairs {{30, 20}, {28, 18}, {40, 10}, {26, 12}} do
      local ro, at = rollout(shape[1], shape[2])
      local lg = u.update(ro, at, epochs, kl):item()
      local tg = ro.targets:narrow(2, ro.from, ro.T - ro.from)
      local mask, old, le = tg:ne(-100):float(), nil, nil
      local base = kl > 0 and gp.no_grad(function()
        return gp.lora.without(me, function() return P.token_logp(me, ro.full, tg) end)
      end) or nil
      for _ = 1, epochs do le, old = P.ppo_step(me, oe, ro.full, tg, at, mask, {old = old, clip = 0.2, kl = kl, base_logp = base}) end
      local what = string.format('epochs %d kl %g, update %d', epochs, kl, i)
      T.ok(math.abs(lg - le:item()) <= 1e-3 * math.max(1, math.abs(le:item())), what .. ': loss ' .. lg .. ' vs ' .. le:item())
      local pe = gp.lora.parameters(me)
      for j, p in ipairs(gp.lora.parameters(mg)) do
        T.ok(T.relnorm(p, pe[j]) < 1e-3, what .. ': parameter ' .. j .. ' ' .. T.relnorm(p, pe[j]))
      end
    end
    T.eq(u.captures, captures)
    u.free()
  end
end)

T.test('scripts/polychromic.lua --compare (tiny): both objectives, the report table and the step times', function()
  local exe = T.exe
  local script = (GPUSH_ROOT or '.') .. '/scripts/polychromic.lua'
  local out, rc = T.sh(exe .. ' --device cpu ' .. script ..
    ' --compare --steps 2 --pretrain-steps 4 --prompts-per-step 2 --n 3 --task-max 4 --log-every 1')
  T.eq(rc, 0, out)
  T.ok(out:find('pass@3', 1, true), 'with --compare, eval-n defaults to n: ' .. out)
  for _, row in ipairs {'\nbase ', '\nrl ', '\npoly ', 'poly vs rl:', 'set_diversity kernel',
                       'set diversity distinct, embed exact, floor 1'} do -- poly's defaults
    T.ok(out:find(row, 1, true), row .. ' in ' .. out)
  end
end)

T.test('scripts/polychromic.lua --set-div pair --floor 0 (tiny), additive\'s defaults, and bad values', function()
  local exe = T.exe
  local script = (GPUSH_ROOT or '.') .. '/scripts/polychromic.lua'
  local base = exe .. ' --device cpu ' .. script .. ' --steps 2 --pretrain-steps 4 --prompts-per-step 2 --n 3 --task-max 4 --log-every 1'
  local out, rc = T.sh(base .. ' --compare --set-div pair --floor 0')
  T.eq(rc, 0, out)
  for _, row in ipairs {'set diversity pair, embed ngram, floor 0', '\nrl ', '\npoly ', 'poly vs rl:'} do
    T.ok(out:find(row, 1, true), row .. ' in ' .. out)
  end
  -- additive takes pair distances by default (distinct is poly's)
  out, rc = T.sh(base .. ' --objective additive')
  T.eq(rc, 0, out)
  for _, c in ipairs {{'--set-div nope', '--set-div must be pair or distinct'}, {'--embed nope', '--embed must be ngram, exact or base'},
                      {'--set-div distinct --objective additive', 'poly objective'},
                      {'--set-div distinct --valid-only', '--valid-only'}} do
    local o2, rc2 = T.sh(base .. ' ' .. c[1])
    T.ok(rc2 ~= 0, c[1] .. ' must fail: ' .. o2)
    T.ok(o2:find(c[2], 1, true), c[2] .. ' in ' .. o2)
    T.ok(not o2:find('pretraining', 1, true), c[1] .. ': the error comes before pretraining')
  end
end)

T.test('scripts/polychromic.lua on the CPU by default: base, rl and poly in one table, then a verdict', function()
  local exe = (GPUSH_ROOT or '.') .. '/build/gpush'
  local script = (GPUSH_ROOT or '.') .. '/scripts/polychromic.lua'
  local base = exe .. ' --device cpu ' .. script .. ' --steps 2 --pretrain-steps 4 --prompts-per-step 2 --n 3 --task-max 4 --log-every 1'
  local out, rc = T.sh(base)
  T.eq(rc, 0, out)
  for _, row in ipairs {'\nbase ', '\nrl ', '\npoly ', 'poly vs rl:', '\nverdict: poly kept ', 'pass@3'} do
    T.ok(out:find(row, 1, true), row .. ' in ' .. out)
  end
  T.ok(out:find('verdict: poly kept [^\n]* rl %([^\n]*; the base [^\n]*mean reward'), out)
  T.ok(out:find('verdict: [^\n]*\n?$'), 'the verdict is the last line: ' .. out)
  -- one objective: --objective, or --no-compare; its verdict is against the base
  for _, flag in ipairs {'--objective poly', '--no-compare'} do
    out, rc = T.sh(base .. ' ' .. flag)
    T.eq(rc, 0, out)
    T.ok(not out:find('\nrl ', 1, true) and out:find('\npoly ', 1, true), flag .. ': ' .. out)
    T.ok(out:find('verdict: poly kept [^\n]* the base %('), flag .. ': ' .. out)
  end
end)

T.test('scripts/polychromic.lua --load-adapters evaluates what --save-adapters wrote, on the same base', function()
  local exe = (GPUSH_ROOT or '.') .. '/build/gpush'
  local script = (GPUSH_ROOT or '.') .. '/scripts/polychromic.lua'
  local dir = T.sh('mktemp -d'):gsub('%s+$', '')
  local base = exe .. ' --device cpu ' .. script ..
    ' --steps 3 --pretrain-steps 150 --prompts-per-step 2 --n 3 --task-max 4 --log-every 1 --eval-n 4'
  local out, rc = T.sh(base .. ' --objective poly --save-base ' .. dir .. '/base.st --save-adapters ' .. dir .. '/a.st --json ' ..
    dir .. '/j1')
  T.eq(rc, 0, out)
  out, rc = T.sh(base .. ' --checkpoint ' .. dir .. '/base.st --load-adapters ' .. dir .. '/a.st --json ' .. dir .. '/j2')
  T.eq(rc, 0, out)
  T.ok(out:find('evaluated without fine-tuning', 1, true) and out:find('\nadapters ', 1, true), out)
  T.ok(not out:find('fine-tuning LoRA', 1, true), 'no fine-tuning: ' .. out)
  local j1, j2 = gp.data.jsonl(dir .. '/j1')[1], gp.data.jsonl(dir .. '/j2')[1]
  for _, k in ipairs {'mean_reward', 'pass_at_n', 'set_diversity', 'distinct_valid'} do
    T.eq(j2.adapters.eval[k], j1.poly.eval[k], k .. ': the loaded adapters evaluate as the fine-tuned ones did')
  end
  -- adapters of another base, or with --compare: clear errors
  out, rc = T.sh(base .. ' --n-embd 16 --pretrain-steps 2 --load-adapters ' .. dir .. '/a.st')
  T.ok(rc ~= 0 and out:find('n_embd 32, this base has 16', 1, true), out)
  out, rc = T.sh(base .. ' --compare --load-adapters ' .. dir .. '/a.st')
  T.ok(rc ~= 0 and out:find('does not combine with --compare', 1, true), out)
  os.execute('rm -rf ' .. dir)
end)

T.test('make run | cat: the first progress line arrives within seconds (stdout is line-buffered in a pipe)', function()
  local exe = (GPUSH_ROOT or '.') .. '/build/gpush'
  local script = (GPUSH_ROOT or '.') .. '/scripts/polychromic.lua'
  local t0 = gp.train.now()
  -- head exits after one line; the job then ends at its next line (SIGPIPE)
  local out = T.sh('timeout 120 sh -c "' .. exe .. ' ' .. script .. ' | head -n 1"')
  local dt = gp.train.now() - t0
  -- the character task, or on a GPU with SmolLM2 fetched the real-model experiment
  T.ok(out:find('^pretraining the base') or (gp.cuda_available() and out:find('^reply model: smollm2')), out)
  T.ok(dt < 15, string.format('the first line took %.1f s', dt))
end)
