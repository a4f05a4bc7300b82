-- moe.lua: a GPT with Mixture-of-Experts feed-forward layers (8 experts,
-- top-2, load-balancing and z losses) against two dense baselines, trained on
-- the same real text with the same batches:
--   dense        equal ACTIVE parameters: a SwiGLU MLP of hidden H against E experts of hidden H/k
--   dense_total  equal TOTAL parameters: a SwiGLU MLP of hidden H E / k (the experts' sum)
-- The text is the Shakespeare corpus of `make models` when present (the last
-- whole plays held out, never trained on), else data/corpus.txt; --data
-- facts is the synthetic encyclopedia, --data FILE any text; characters, or
-- --tokenizer gpt2 for BPE. Prints each model's held-out loss (final and
-- best of the evaluations) against the unigram baseline, the expert load per
-- layer (share of assignments relative to uniform, over the final
-- evaluation) and tokens/s; --plot FILE draws the curves and the load.
--
--   gpush scripts/moe.lua                      -- the defaults
--   gpush scripts/moe.lua --iters 2000 --bf16 --capacity-factor 1.25
--   gpush scripts/moe.lua --experts 64 --k 8   -- fine-grained experts (hidden H/8 each)
--   gpush scripts/moe.lua --runs dense,moe     -- the equal-active comparison only
--   gpush scripts/moe.lua --infer              -- dense vs MoE generation with a KV cache (d 768, 12 layers, 8 heads, 200 new tokens)
--   gpush scripts/moe.lua --tiny --plot moe.png   -- a seconds-long CPU run and its picture (the test suite runs it)
--   gpush scripts/moe.lua --ckpt run.ckpt --ckpt-every 100; gpush scripts/moe.lua --resume run.ckpt
local gp = rawget(_G, 'gp') or require 'gpush'

local script_dir = (arg and arg[0] or 'scripts/moe.lua'):match('^(.*)/[^/]*$') or '.'

local o = gp.args.parse(arg, {
  {'data', '', 'a text file, shakespeare, corpus (data/corpus.txt) or facts (gp.data.facts_text, a synthetic encyclopedia); default: Shakespeare when `make models` fetched it, else corpus'},
  {'tokenizer', '', 'BPE tokens instead of characters: gpt2, smollm2, a tokenizer.json or a Hugging Face directory'},
  {'entities', 1000, '--data facts: creatures in the synthetic encyclopedia'},
  {'data-bytes', 400000, '--data facts: its size in bytes'},
  {'runs', 'dense,moe,dense_total', 'the models, in order: dense (equal active parameters), moe, dense_total (equal total parameters)'},
  {'plot', '', 'draw the curves (loss, held-out loss, tokens/s) and the expert load into this .png or .svg (gnuplot); the log goes beside it unless --log'},
  {'n-embd', 128, 'embedding width'},
  {'n-layer', 4, 'transformer blocks'},
  {'n-head', 4, 'attention heads'},
  {'block', 64, 'context length (tokens)'},
  {'batch', 32, 'sequences per step'},
  {'iters', 3000, 'optimizer steps (each model)'},
  {'lr', 1e-3, 'peak learning rate'},
  {'warmup', 50, 'warmup steps'},
  {'weight-decay', 0.1, 'AdamW weight decay'},
  {'dropout', 0.1, 'dropout probability'},
  {'hidden', 0, 'dense MLP hidden size (default 4 n_embd); each expert gets hidden / k'},
  {'experts', 8, 'experts per MoE layer'},
  {'k', 2, 'experts per token'},
  {'act', 'swiglu', 'swiglu or gelu (dense MLP and experts)'},
  {'capacity-factor', 0, 'slots per expert = ceil(cf N k / E), the rest dropped (0: dropless)'},
  {'aux-alpha', 0.1, 'weight of the load-balancing loss'},
  {'z-alpha', 0.001, 'weight of the router z-loss'},
  {'eval-every', 100, 'evaluate every N steps (the best validation loss is reported too)'},
  {'eval-iters', 20, 'batches per loss estimate'},
  {'log-every', 50, 'progress line every N steps'},
  {'bf16', false, 'bf16 parameters (f32 master weights in AdamW)'},
  {'device', '', 'cpu or cuda (default: cuda when a GPU is usable)'},
  {'seed', 1337, 'random seed'},
  {'only', '', 'train only this one of --runs (dense, moe or dense_total)'},
  {'infer', false, 'generation benchmark instead of training: dense vs MoE with a KV cache'},
  {'infer-embd', 768, '--infer: embedding width'},
  {'infer-layer', 12, '--infer: blocks'},
  {'infer-head', 8, '--infer: heads'},
  {'infer-batch', 1, '--infer: sequences generated together'},
  {'new-tokens', 200, '--infer: tokens generated per sequence'},
  {'tiny', false, 'a tiny config that runs on the CPU in seconds'},
  {'quiet', false, 'no progress lines'},
  {'log', '', 'write a JSONL record of every logged step here (both models)'},
  {'ckpt', '', 'a training checkpoint to resume from (model, optimizer, step, random state), written every --ckpt-every steps and at the end of each model'},
  {'ckpt-every', 0, 'steps between --ckpt checkpoints (0: at the end of each model only)'},
  {'resume', '', 'continue the run of this --ckpt checkpoint: its flags (except those given here) and its state'},
  {'stop-after', 0, 'end after this many steps (counted over the models in order) as if cut off there; --ckpt is written first'},
}, {usage = 'gpush scripts/moe.lua [flags]', description = 'Dense vs Mixture-of-Experts character-level GPT.'})

-- a resumed run takes the flags it was started with, except those given again
local resume_meta
if o.resume ~= '' then
  local _, meta = gp.load(o.resume, {meta_only = true})
  if type(meta.args) ~= 'table' or type(meta.moe) ~= 'table' then
    error('moe: ' .. o.resume .. ' is not a --ckpt checkpoint of this script')
  end
  gp.train.resume_args(o, meta.args, {'resume', 'stop-after'})
  o.tiny = false -- the saved flags already hold what --tiny set
  resume_meta = meta.moe
end

if o.tiny then -- flags given on the command line win
  local tiny = {n_embd = 32, n_layer = 2, n_head = 2, block = 16, batch = 4, iters = 60, eval_every = 20, eval_iters = 2,
                log_every = 5, warmup = 2, experts = 4, infer_embd = 32, infer_layer = 2, infer_head = 2, new_tokens = 8,
                entities = 100, data_bytes = 20000, runs = 'dense,moe'}
  for k, v in pairs(tiny) do if not o._given[k] then o[k] = v end end
end
if o.device ~= '' then gp.set_device(o.device) end
local nn = gp.nn
local dev = gp.device()
local hidden = o.hidden > 0 and o.hidden or 4 * o.n_embd
if hidden % o.k ~= 0 then error(string.format('--hidden %d must be a multiple of --k %d', hidden, o.k)) end
local moe_cfg = {experts = o.experts, k = o.k, act = o.act, aux_alpha = o.aux_alpha, z_alpha = o.z_alpha,
                 capacity_factor = o.capacity_factor > 0 and o.capacity_factor or nil}
local dense_mlp = o.act == 'swiglu' and 'swiglu' or 'gelu'

local function count_params(m)
  local total, active = 0, 0
  for _, nt in ipairs(m:named_parameters()) do
    local name, p = nt[1], nt[2]
    total = total + p:numel()
    -- of an expert tensor (E, ., .) a token uses k of E slices
    if name:match('%.mlp%.w%d$') then active = active + p:numel() * o.k / o.experts
    else active = active + p:numel() end
  end
  return total, active
end

---------------------------------------------------------------------------
-- inference: dense vs MoE generation with a KV cache

if o.infer then
  local V, Tn, B = 256, o.new_tokens + 8, o.infer_batch
  local function model(kind)
    gp.manual_seed(o.seed)
    local cfg = {vocab_size = V, block_size = Tn, n_embd = o.infer_embd, n_layer = o.infer_layer,
                 n_head = o.infer_head, mlp = kind == 'moe' and 'moe' or dense_mlp,
                 mlp_hidden = kind == 'moe' and 4 * o.infer_embd / o.k or 4 * o.infer_embd,
                 moe = moe_cfg}
    local m = nn.GPT(cfg)
    if o.bf16 then m:bf16() end
    return m:eval()
  end
  local prompts = {}
  for b = 1, B do prompts[b] = {10 + b, 20, 30, 40, 50, 60, 70, 80} end
  print(string.format('moe --infer: d %d, %d layers, %d heads, batch %d, %d new tokens (greedy, KV cache), %s%s',
    o.infer_embd, o.infer_layer, o.infer_head, B, o.new_tokens, dev, o.bf16 and ', bf16' or ', f32'))
  for _, kind in ipairs {'dense', 'moe'} do
    local m = model(kind)
    local total, active = count_params(m)
    gp.generate(m, prompts, {greedy = true, max_new = 4}) -- warm-up: allocator, cuBLAS handles
    gp.sync()
    local t0 = gp.train.now()
    local r = gp.generate(m, prompts, {greedy = true, max_new = o.new_tokens})
    gp.sync()
    local dt = gp.train.now() - t0
    print(string.format('%s: %.0f tokens/s (%.2f ms per step), %d params (%d active per token), first tokens %s', kind,
      B * o.new_tokens / dt, 1000 * dt / o.new_tokens, total, active,
      table.concat({unpack(r.lists[1], 1, math.min(8, #r.lists[1]))}, ',')))
    m = nil -- luacheck: ignore 311 (dropped before the collection)
    collectgarbage()
  end
  return
end

---------------------------------------------------------------------------
-- training

local ds
local tok = o.tokenizer ~= '' and gp.models.tokenizer(o.tokenizer) or nil
if o.data == 'facts' then
  ds = gp.data.text {text = gp.data.facts_text {entities = o.entities, bytes = o.data_bytes, seed = o.seed},
                     vocab = 'present', val_fraction = 0.1, tokenizer = tok}
  ds.name = 'facts'
  ds.description = string.format('gp.data.facts_text{entities=%d, bytes=%d}; the last 10%% held out', o.entities, o.data_bytes)
else
  ds = gp.data.corpus {data = o.data, fallback = script_dir .. '/../data/corpus.txt', vocab = 'present', tokenizer = tok}
end
local B, Tn = o.batch, o.block
local runs = {}
for name in o.runs:gmatch('[^,%s]+') do
  if name ~= 'dense' and name ~= 'moe' and name ~= 'dense_total' then
    error(string.format("--runs: unknown model '%s' (dense, moe, dense_total)", name))
  end
  if o.only == '' or o.only == name then runs[#runs + 1] = name end
end
if #runs == 0 then error(string.format('--runs %s --only %s: no model to train', o.runs, o.only)) end
local log_path = o.log ~= '' and o.log or (o.plot ~= '' and gp.plot.log_path(o.plot)) or nil
print('data: ' .. ds.description)
print(string.format('moe: vocab %d (%s), device %s%s; n_layer %d, n_head %d, n_embd %d, block %d, batch %d, %d steps',
  ds.vocab_size, tok and 'BPE' or 'characters', dev, o.bf16 and ', bf16' or '', o.n_layer, o.n_head, o.n_embd, Tn, B,
  o.iters))

local function build(kind)
  local cfg = {vocab_size = ds.vocab_size, block_size = Tn, n_embd = o.n_embd, n_layer = o.n_layer, n_head = o.n_head,
               dropout = o.dropout}
  if kind == 'moe' then
    cfg.mlp, cfg.mlp_hidden, cfg.moe = 'moe', hidden / o.k, moe_cfg
  elseif kind == 'dense_total' then -- the experts' parameters in one MLP
    cfg.mlp, cfg.mlp_hidden = dense_mlp, hidden * o.experts / o.k
  else
    cfg.mlp, cfg.mlp_hidden = dense_mlp, hidden
  end
  gp.manual_seed(o.seed)
  local m = nn.GPT(cfg)
  if o.bf16 then gp.optim.mixed_precision(m) end
  return m
end

-- the mean loss over eval_iters batches drawn from seed (the same batches at every evaluation); the training's
-- random state is put back after it (reseeding it here had made training draw the same 100 batches after
-- every evaluation, so that the models memorised them)
local function estimate(model, split, seed)
  local state = gp.rng_state()
  gp.manual_seed(seed)
  local acc
  for _ = 1, o.eval_iters do
    local x, y = ds:batch(split, B, Tn)
    local _, loss = model(x, y)
    loss = loss:to('f32'):reshape {1}
    acc = acc and acc + loss or loss
  end
  gp.set_rng_state(state)
  return acc:item() / o.eval_iters
end

-- one model's training; phase: 1, 2 (steps count on across the models for
-- --stop-after); done: the results of the models before it (kept in the
-- checkpoint). Returns its results, or nil when --stop-after cut the run off.
local function train(kind, phase, done)
  local model = build(kind)
  local total, active = count_params(model)
  print(string.format('%s: %d parameters, %d active per token%s', kind, total, active,
    kind == 'moe' and string.format(' (%d experts of hidden %d, top-%d, %s%s)', o.experts, hidden / o.k, o.k, o.act,
      moe_cfg.capacity_factor and (', capacity factor ' .. moe_cfg.capacity_factor) or ', dropless') or
      string.format(' (%s MLP of hidden %d)', dense_mlp, kind == 'dense_total' and hidden * o.experts / o.k or hidden)))
  local opt = gp.optim.AdamW(model, {lr = o.lr, betas = {0.9, 0.95}, weight_decay = o.weight_decay})
  local sched = gp.optim.schedule.cosine {lr = o.lr, min_lr = o.lr / 10, warmup = o.warmup, max_steps = o.iters}
  local best, excluded = math.huge, 0
  local log -- the progress log, made once the starting step is known
  local function evaluate(step)
    local t0 = gp.train.now()
    model:eval()
    local va = gp.no_grad(function() return estimate(model, 'val', 7) end)
    model:train()
    if va < best then best = va end
    local dt = gp.train.now() - t0
    log:exclude(dt)
    excluded = excluded + dt
    log:print(string.format('%s step %d: val loss %.4f', kind, step, va))
    log:write {step = step, val_loss = va, model = kind}
    return va
  end
  gp.manual_seed(o.seed + 1) -- the same batches for both models
  local start = 0
  if resume_meta and resume_meta.kind == kind then
    start = gp.train.load_state(o.resume, {model = model, optimizer = opt})
    best = resume_meta.best or best
    print(string.format('%s: resumed from %s after step %d', kind, o.resume, start))
  end
  log = gp.train.logger {steps = o.iters, every = o.log_every, tokens_per_step = B * Tn, print = not o.quiet,
                         file = log_path, start = start,
                         append = resume_meta ~= nil or phase > 1}
  local function save_ckpt(step)
    if o.ckpt == '' then return 0 end
    local t0 = gp.train.now()
    gp.train.save_state(o.ckpt, {model = model, optimizer = opt, step = step,
      meta = {args = gp.train.saved_args(o), moe = {kind = kind, best = best < math.huge and best or nil, done = done}}})
    return gp.train.now() - t0
  end
  model:train()
  local t_start = gp.train.now()
  for step = start + 1, o.iters do
    opt:zero_grad()
    local x, y = ds:batch('train', B, Tn)
    local _, loss = model(x, y)
    log:add(loss)
    local aux = model.aux_loss and model:aux_loss()
    if aux then loss = loss + aux end
    loss:backward()
    gp.optim.clip_grad_norm(opt, 1.0)
    opt:set_lr(sched(step))
    opt:step()
    log:step(step, nil, opt:get_lr(), {model = kind})
    if o.eval_every > 0 and step % o.eval_every == 0 and step < o.iters then evaluate(step) end
    local global = (phase - 1) * o.iters + step
    if (o.ckpt_every > 0 and step % o.ckpt_every == 0) or step == o.iters or global == o.stop_after then
      local dt = save_ckpt(step)
      log:exclude(dt)
      excluded = excluded + dt
    end
    if global == o.stop_after then
      log:finish()
      print(string.format('stopped after step %d%s', global, o.ckpt ~= '' and ('; resume with --resume ' .. o.ckpt) or ''))
      return nil
    end
  end
  gp.sync()
  local tps = (o.iters - start) * B * Tn / math.max(gp.train.now() - t_start - excluded, 1e-9)
  log:finish()
  -- final evaluation, with the expert load counted over its batches
  local layers = nn.moe_layers(model)
  for _, l in ipairs(layers) do l:track_load(true) end
  local va = evaluate(o.iters)
  local tr = gp.no_grad(function() model:eval(); local r = estimate(model, 'train', 8); model:train(); return r end)
  local loads, worst = {}, 0
  for i, l in ipairs(layers) do
    local c = l.load:cpu():to('f64'):totable()
    local sum = 0
    for _, v in ipairs(c) do sum = sum + v end
    local rel = {}
    for e, v in ipairs(c) do
      rel[e] = v * #c / math.max(sum, 1)
      worst = math.max(worst, math.abs(rel[e] - 1))
    end
    loads[i] = rel
    l:track_load(false)
  end
  local r = {kind = kind, val = va, best = best, train = tr, tps = tps, loads = loads, worst = worst, params = total,
             active = active}
  if log_path then
    local f = assert(io.open(log_path, 'a'))
    f:write(gp.json.encode {step = o.iters, model = kind, val_loss = va, train_loss = tr, tokens_per_s = tps, final = true,
      params = total, active_params = active, load = #loads > 0 and loads or nil,
      load_worst = #loads > 0 and worst or nil, unigram_entropy = ds.unigram_entropy}, '\n')
    f:close()
  end
  return r
end

local results = resume_meta and resume_meta.done or {}
local phase = 0
for _, kind in ipairs(runs) do
  phase = phase + 1
  if phase > #results then -- not trained before the run was resumed
    local r = train(kind, phase, results)
    if not r then return end
    results[#results + 1] = r
  end
end

print('')
for _, r in ipairs(results) do
  print(string.format('%s: val loss %.4f (best %.4f) | train loss %.4f | %.0f tokens/s | %d params, %d active', r.kind,
    r.val, r.best, r.train, r.tps, r.params or 0, r.active or 0))
  for i, rel in ipairs(r.loads) do
    local cells = {}
    for e, v in ipairs(rel) do cells[e] = string.format('%.2f', v) end
    print(string.format('  layer %d load (share x E, 1 = uniform): %s', i, table.concat(cells, ' ')))
  end
  if #r.loads > 0 then
    print(string.format('  largest deviation from uniform: %.1f%% (%s 20%%)', 100 * r.worst, r.worst <= 0.2 and 'within' or 'OUTSIDE'))
  end
end
local by = {}
for _, r in ipairs(results) do by[r.kind] = r end
print(string.format('unigram baseline: %.4f nats per %s (%s)', ds.unigram_entropy, tok and 'token' or 'character', ds.name))
for _, base in ipairs {{'dense', 'equal active parameters'}, {'dense_total', 'equal total parameters'}} do
  local d, m = by[base[1]], by.moe
  if d and m then
    print(string.format('moe - %s (%s): val %+.4f, best val %+.4f (negative: MoE better); tokens/s ratio %.2f', base[1],
      base[2], m.val - d.val, m.best - d.best, m.tps / d.tps))
  end
end

-- the picture: loss per model, held-out loss, tokens/s, the MoE's expert load per layer
local function draw(path)
  local recs, steps = gp.plot.read_jsonl(log_path), {}
  for _, r in ipairs(recs) do if not r.final then steps[#steps + 1] = r end end
  local S = gp.plot.series
  local loss, val, tps = {}, {}, {}
  for _, r in ipairs(results) do
    local w = {model = r.kind}
    loss[#loss + 1] = S(steps, 'step', 'loss', {where = w, title = r.kind})
    val[#val + 1] = S(recs, 'step', 'val_loss', {where = w, title = r.kind, style = 'linespoints'})
    tps[#tps + 1] = S(steps, 'step', 'tokens_per_s', {where = w, title = r.kind})
  end
  local hl = {{y = ds.unigram_entropy, title = string.format('unigram %.2f', ds.unigram_entropy)}}
  local panels = {
    {title = 'training loss', xlabel = 'step', ylabel = 'nats', lines = loss, hlines = hl},
    {title = 'held-out loss', xlabel = 'step', ylabel = 'nats', lines = val},
    {title = 'tokens/s', xlabel = 'step', lines = tps},
  }
  local m = by.moe
  if m and #m.loads > 0 then
    local labels, groups = {}, {}
    for e = 1, #m.loads[1] do labels[e] = tostring(e) end
    for i, rel in ipairs(m.loads) do groups[i] = {title = 'layer ' .. i, values = rel} end
    panels[#panels + 1] = {title = string.format('expert load (1 = uniform; worst %.0f%%)', 100 * m.worst),
      xlabel = 'expert', bars = {labels = labels, groups = groups},
      hlines = {{y = 0.8, title = '-20%'}, {y = 1.2, title = '+20%', color = '#aa0000'}}}
  end
  return gp.plot.draw {out = path, title = string.format('moe.lua on %s: %d experts top-%d, %d layers, %d wide, %d steps',
    ds.name, o.experts, o.k, o.n_layer, o.n_embd, o.iters), panels = panels}
end
if o.plot ~= '' then gp.plot.try(draw, o.plot, log_path) end
