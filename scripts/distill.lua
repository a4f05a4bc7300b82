-- distill.lua: knowledge distillation from a real teacher. SmolLM2-135M-Instruct
-- (frozen; its logits computed on the fly, in bf16 on the GPU) teaches a
-- smaller student of the same tokenizer and vocabulary: a Llama-family
-- config of --n-layer layers of width --n-embd, initialized at random
-- (transformers' init, std 0.02: the teacher's width differs, so its layers
-- cannot be copied). The text is the Shakespeare corpus of `make models`,
-- BPE-tokenized with the teacher's tokenizer; its last --heldout fraction is
-- never trained on. Per seed, two students from the same initial weights
-- see the same batches for the same steps: one trained on the hard targets
-- only (cross-entropy), one on gp.distill_loss (alpha * T^2 * KL(teacher_T ||
-- student_T) + (1 - alpha) * cross-entropy). Both are scored by the
-- cross-entropy of the next token on the held-out tokens.
--
--   gpush scripts/distill.lua                          -- the defaults (a GPU: a few minutes)
--   gpush scripts/distill.lua --steps 600 --seeds 2 --log distill.jsonl
--   gpush scripts/distill.lua --kind jsd --temperature 1 --alpha 0.9
--   gpush scripts/distill.lua --tiny                   -- seconds on the CPU: the committed fixture
--        teacher (tests/fixtures/models/llama_gqa, vocabulary 128, random weights) and byte tokens
local gp = rawget(_G, 'gp') or require 'gpush'

local script_dir = (arg and arg[0] or 'scripts/distill.lua'):match('^(.*)/[^/]*$') or '.'

local o = gp.args.parse(arg, {
  {'teacher', 'smollm2', 'the teacher: a short name, a Hugging Face directory or a .gguf file'},
  {'data', '', 'a text file (default: the Shakespeare corpus of make models, gp.models.path("shakespeare"))'},
  {'max-bytes', 0, 'bytes of the text used, from its start (0: all of it; tokenizing is on the host, about 2 s for the 5 MB corpus)'},
  {'heldout', 0.05, 'fraction of the tokens, at the end, held out for the evaluation (never trained on)'},
  {'n-layer', 6, 'student layers'},
  {'n-embd', 384, 'student width'},
  {'n-head', 6, 'student attention heads'},
  {'n-kv-head', 2, 'student key/value heads (grouped-query attention)'},
  {'mlp', 1024, 'student SwiGLU hidden size'},
  {'block', 256, 'tokens per sequence'},
  {'batch', 16, 'sequences per step'},
  {'steps', 1000, 'optimizer steps per student'},
  {'lr', 2e-3, 'peak learning rate (cosine to lr/10 after warmup)'},
  {'warmup', 40, 'warmup steps'},
  {'weight-decay', 0.1, 'AdamW weight decay'},
  {'temperature', 2, 'distillation temperature T'},
  {'alpha', 0.5, 'weight of the distillation term (1 - alpha on the hard-target cross-entropy)'},
  {'kind', 'forward_kl', 'forward_kl (KL(teacher || student)), reverse_kl or jsd'},
  {'seeds', 2, 'seeds (each: a hard-target and a distilled student from the same init and batches)'},
  {'seed', 1, 'first seed'},
  {'eval-every', 100, 'held-out evaluation every N steps (and at the end)'},
  {'eval-tokens', 65536, 'held-out tokens scored per evaluation (consecutive windows from the held-out start)'},
  {'log-every', 25, 'progress line every N steps'},
  {'log', '', 'write a JSONL record of every logged step, evaluation and result here'},
  {'bf16', true, 'on the GPU: bf16 student parameters (f32 master weights) and a bf16 teacher (--no-bf16: f32)'},
  {'tiny', false, 'the fixture teacher, a 1-layer student, byte tokens: seconds on the CPU'},
  {'quiet', false, 'no progress lines'},
}, {usage = 'gpush scripts/distill.lua [flags]', description = 'Distil a teacher LM into a smaller student against hard-target training.'})

if o.tiny then
  o.teacher = script_dir .. '/../tests/fixtures/models/llama_gqa'
  if o.data == '' then o.data = script_dir .. '/../tests/fixtures/tokenizers/shakespeare.txt' end
  o.n_layer, o.n_embd, o.n_head, o.n_kv_head, o.mlp = 1, 32, 2, 1, 64
  o.block, o.batch, o.steps, o.warmup, o.eval_every, o.eval_tokens, o.log_every = 32, 4, 12, 2, 6, 512, 4
  o.max_bytes = 20000
end
if o.seeds < 1 or o.steps < 1 then error('distill: --seeds and --steps must be positive') end
if not (o.heldout > 0 and o.heldout < 1) then error('distill: --heldout must be in (0, 1)') end

local dev = gp.device()
local half = dev == 'cuda' and o.bf16
local dtype = half and 'bf16' or 'f32'

-- parameters of a model (tied weights once)
local function count(m)
  local seen, c = {}, 0
  for _, p in ipairs(m:parameters()) do
    if not seen[p] then seen[p] = true; c = c + p:numel() end
  end
  return c
end

---------------------------------------------------------------------------
-- teacher, text, tokens

local teacher, tok = gp.models.load(o.teacher, {dtype = dtype})
teacher:eval() -- frozen: its forwards run under gp.no_grad, nothing reaches its parameters
local tc = teacher.config
local V = tc.vocab_size

local path = o.data ~= '' and o.data or gp.models.path('shakespeare')
local text = gp.data.read_file(path)
if o.max_bytes > 0 and #text > o.max_bytes then text = text:sub(1, o.max_bytes) end
local t0 = gp.train.now()
local ids
if tok then
  ids = tok:encode(text, {add_special_tokens = false})
else
  -- a teacher without a tokenizer (the --tiny fixture): bytes, folded into its vocabulary
  ids = {}
  for i = 1, #text do ids[i] = text:byte(i) % V end
end
local n = #ids
local nval = math.floor(n * o.heldout)
local ntrain = n - nval
if ntrain < o.block + 1 or nval < o.block + 1 then
  error(string.format('distill: %d tokens leave too few for a block of %d in each split (--heldout %g)', n, o.block, o.heldout))
end
local all = gp.tensor(ids, {dtype = 'i64', device = 'cpu'})
-- the data object gp.data.Text:batch draws windows from (train / val splits on the device)
local ds = {train = all:narrow(1, 1, ntrain):to(dev), val = all:narrow(1, ntrain + 1, nval):to(dev), device = dev}
local function batch(B, T) return gp.data.Text.batch(ds, 'train', B, T) end

-- the held-out evaluation set: consecutive windows from the start of the held-out split, fixed for every run
local nwin = math.max(1, math.min(math.floor((nval - 1) / o.block), math.floor(o.eval_tokens / o.block)))
local ev_x = all:narrow(1, ntrain + 1, nwin * o.block):reshape {nwin, o.block}:to(dev)
local ev_y = all:narrow(1, ntrain + 2, nwin * o.block):reshape {nwin, o.block}:to(dev)
local EVAL_B = math.max(1, math.min(nwin, o.batch))

-- mean next-token cross-entropy of model on the held-out windows (nats)
local function heldout_loss(model)
  return gp.no_grad(function()
    model:eval()
    local sum, cnt = 0, 0
    for i = 1, nwin, EVAL_B do
      local b = math.min(EVAL_B, nwin - i + 1)
      local logits = model(ev_x:narrow(1, i, b))
      sum = sum + gp.cross_entropy(logits, ev_y:narrow(1, i, b), {reduction = 'sum'}):item()
      cnt = cnt + b * o.block
    end
    model:train()
    return sum / cnt
  end)
end

print(string.format('distill: teacher %s (%s; %d parameters, %s), text %s: %d bytes -> %d tokens in %.1fs (%s), %d train, %d held out',
  o.teacher, teacher:extra_repr(), count(teacher), dtype, path, #text, n, gp.train.now() - t0,
  tok and "the teacher's tokenizer" or 'bytes', ntrain, nval))
local teacher_loss = heldout_loss(teacher)
print(string.format('teacher held-out loss %.4f (%d windows of %d tokens)', teacher_loss, nwin, o.block))

---------------------------------------------------------------------------
-- students

local student_cfg = {
  model_type = 'llama', vocab_size = V, hidden_size = o.n_embd, intermediate_size = o.mlp, num_hidden_layers = o.n_layer,
  num_attention_heads = o.n_head, num_key_value_heads = o.n_kv_head, max_position_embeddings = math.max(o.block, 128),
  rms_norm_eps = tc.rms_norm_eps, rope_theta = tc.rope_theta, tie_word_embeddings = true, initializer_range = 0.02,
}

local function build(seed)
  gp.manual_seed(seed)
  local m = gp.models.Llama(student_cfg, {device = dev})
  if half then gp.optim.mixed_precision(m) end
  m:train()
  return m
end

local B, T = o.batch, o.block
local dl_opts = {temperature = o.temperature, alpha = o.alpha, kind = o.kind}

-- one student: arm 'hard' (cross-entropy) or 'distill'; returns its results
local function train(arm, seed, first)
  local model = build(seed)
  local opt = gp.optim.AdamW(model, {lr = o.lr, betas = {0.9, 0.95}, weight_decay = o.weight_decay})
  local sched = gp.optim.schedule.cosine {lr = o.lr, min_lr = o.lr / 10, warmup = math.min(o.warmup, o.steps), max_steps = o.steps}
  local log = gp.train.logger {steps = o.steps, every = o.log_every, tokens_per_step = B * T, print = not o.quiet,
                               file = o.log ~= '' and o.log or nil, append = not first}
  local curve = {}
  local function evaluate(step)
    local e0 = gp.train.now()
    local v = heldout_loss(model)
    log:exclude(gp.train.now() - e0)
    curve[#curve + 1] = {step = step, heldout = v}
    log:write({event = 'eval', arm = arm, seed = seed, step = step, heldout_loss = v})
    log:print(string.format('%s seed %d step %d: held-out loss %.4f', arm, seed, step, v))
    return v
  end
  log:print(string.format('-- %s targets, seed %d', arm == 'hard' and 'hard' or 'distilled from the teacher +', seed))
  gp.manual_seed(seed + 1000) -- the same batches for both arms of a seed
  local ts = gp.train.now()
  for step = 1, o.steps do
    opt:zero_grad()
    local x, y = batch(B, T)
    local logits = model(x)
    local loss
    if arm == 'hard' then
      loss = gp.cross_entropy(logits, y)
    else
      local tl = gp.no_grad(function() return teacher(x) end)
      dl_opts.targets = y:view {B * T}
      loss = gp.distill_loss(logits:view {B * T, V}, tl:view {B * T, V}, dl_opts)
    end
    log:add(loss)
    loss:backward()
    gp.optim.clip_grad_norm(opt, 1.0)
    opt:set_lr(sched(step))
    opt:step()
    log:step(step, nil, opt:get_lr(), {arm = arm, run = arm .. '/' .. seed})
    if o.eval_every > 0 and step % o.eval_every == 0 and step < o.steps then evaluate(step) end
  end
  gp.sync()
  local secs = gp.train.now() - ts
  local final = evaluate(o.steps)
  log:write({event = 'result', arm = arm, seed = seed, steps = o.steps, tokens = o.steps * B * T, heldout_loss = final})
  log:finish()
  return {arm = arm, seed = seed, heldout = final, secs = secs, curve = curve}
end

do
  local probe = build(o.seed)
  print(string.format('student: %s; %d parameters, random init (std 0.02), tied embeddings; %d steps of %d x %d tokens; ' ..
    'distill: %s, T %g, alpha %g; device %s%s', probe:extra_repr(), count(probe), o.steps, B, T, o.kind, o.temperature,
    o.alpha, dev, half and ', bf16' or ''))
end

local results = {}
for s = 0, o.seeds - 1 do
  local seed = o.seed + s
  for _, arm in ipairs {'hard', 'distill'} do
    results[#results + 1] = train(arm, seed, #results == 0)
  end
end

print('')
print(string.format('held-out loss (nats/token; teacher %.4f), %d steps x %d tokens each:', teacher_loss, o.steps, B * T))
local dsum, wins = 0, 0
for i = 1, #results, 2 do
  local h, d = results[i], results[i + 1]
  local diff = d.heldout - h.heldout
  dsum = dsum + diff
  if diff < 0 then wins = wins + 1 end
  print(string.format('  seed %d: hard targets %.4f | distilled %.4f | distilled - hard %+.4f (%.0fs, %.0fs)', h.seed,
    h.heldout, d.heldout, diff, h.secs, d.secs))
end
local mean = dsum / o.seeds
print(string.format('distilled - hard, mean over %d seeds: %+.4f (negative: distillation better; better on %d of %d seeds)',
  o.seeds, mean, wins, o.seeds))
if o.log ~= '' then
  local f = assert(io.open(o.log, 'a'))
  f:write(gp.json.encode({event = 'summary', teacher_heldout_loss = teacher_loss, mean_diff = mean, wins = wins,
                          seeds = o.seeds, steps = o.steps, kind = o.kind, temperature = o.temperature, alpha = o.alpha}), '\n')
  f:close()
end
