-- titans.lua: Titans (memory as context) against a sliding-window-attention
-- baseline of the same size, on bytes.
--
--   gpush scripts/titans.lua --model mac --dim 320 --num-layers 6 --num-heads 8 --chunk-size 512 \
--     --seq-len 4096 --batch-size 4 --gradient-accumulation-steps 32 --lr 4e-4 --weight-decay 0.1 \
--     --mixed-precision bf16 --max-steps 100 --data FILE      -- pretraining (built-in corpus by default)
--   gpush scripts/titans.lua --task recall                     -- MAC and SWA on synthetic long-range recall
--   gpush scripts/titans.lua --help
--
-- Pretraining: AdamW (cosine schedule, warmup, clipping at 1), the progress
-- line shows the loss and tokens/s; --out writes a checkpoint (every
-- --save-every steps and at the end). --ckpt FILE (--ckpt-every N) writes a
-- checkpoint to resume from (model, optimizer, step, both generators' state)
-- and --resume FILE continues that run exactly, on either task. The recall task: each sequence starts
-- with --recall-pairs key-value pairs ("K v"), then filler, then the same keys
-- queried in another order at the end, further back than the attention window
-- (the chunk size) can see; the loss and the accuracy count only the value
-- after each queried key. MAC (whose memory can carry the pairs) and SWA are
-- trained with the same flags and both accuracies are printed.
local gp = rawget(_G, 'gp') or require 'gpush'

local script_dir = (arg and arg[0] or 'scripts/titans.lua'):match('^(.*)/[^/]*$') or '.'

local o = gp.args.parse(arg, {
  {'task', 'lm', 'lm (byte-level pretraining) or recall (synthetic long-range recall: MAC and SWA)'},
  {'model', 'mac', 'mac (memory as context) or swa (sliding-window attention, window = chunk size); lm task'},
  {'memory', 'linear', 'the neural memory: linear or mlp (two layers)'},
  {'dim', -1, 'model width (default: 320 for lm, 128 for recall)'},
  {'num-layers', -1, 'blocks (default: 6 for lm, 2 for recall)'},
  {'num-heads', -1, 'attention heads (default: 8 for lm, 2 for recall)'},
  {'mem-heads', -1, 'memory heads (default: num-heads)'},
  {'persistent', 4, 'persistent-memory tokens per MAC segment'},
  {'conv', true, 'causal depthwise convolution (width 4) on the memory keys, values and queries (--no-conv: off)'},
  {'chunk-size', -1, 'memory chunk = MAC segment = SWA window (default: 512 for lm, 32 for recall)'},
  {'seq-len', -1, 'tokens per sequence (default: 4096 for lm, 256 for recall)'},
  {'batch-size', -1, 'sequences per micro-batch (default: 4 for lm, 32 for recall)'},
  {'gradient-accumulation-steps', -1, 'micro-batches per step (default: 32 for lm, 1 for recall)'},
  {'lr', -1, 'peak learning rate (default: 4e-4 for lm, 2e-3 for recall)'},
  {'weight-decay', 0.1, 'AdamW weight decay (matrices only)'},
  {'warmup', -1, 'warmup steps (default: min(100, max-steps/10))'},
  {'grad-clip', 1.0, 'clip the gradient norm (0: off)'},
  {'mixed-precision', 'bf16', 'bf16 (bf16 parameters, f32 master weights; the memory runs in f32) or no'},
  {'max-steps', -1, 'optimizer steps (default: 1000 for lm, 1500 per model for recall)'},
  {'data', '', 'a text file for the lm task (default: the built-in corpus, data/corpus.txt)'},
  {'recall-pairs', 8, 'recall: key-value pairs per sequence'},
  {'eval-batches', -1, 'recall: batches for the final accuracy (default 8; 1 with --tiny)'},
  {'device', '', 'cpu or cuda (default: cuda when a GPU is usable)'},
  {'seed', 1337, 'random seed'},
  {'log-every', 10, 'read the loss and print a progress line every N steps'},
  {'out', '', 'lm: write a checkpoint here (the config and step in the metadata)'},
  {'save-every', 0, 'lm: also checkpoint every N steps (0: only at the end)'},
  {'log', '', 'write a JSONL record of every logged step here'},
  {'ckpt', '', 'a training checkpoint to resume from (model, optimizer, step, random state), written every --ckpt-every steps and at the end of each model'},
  {'ckpt-every', 0, 'steps between --ckpt checkpoints (0: at the end of each model only)'},
  {'resume', '', 'continue the run of this --ckpt checkpoint: its flags (except those given here) and its state'},
  {'stop-after', 0, 'end after this many steps (counted over the models in order) as if cut off there; --ckpt is written first'},
  {'tiny', false, 'a tiny configuration that runs on the CPU in seconds (smoke test)'},
}, {usage = 'gpush scripts/titans.lua [flags]', description = 'Titans MAC vs sliding-window attention.'})

-- a resumed run takes the flags it was started with, except those given again
local resume_meta
if o.resume ~= '' then
  local _, meta = gp.load(o.resume, {meta_only = true})
  if type(meta.args) ~= 'table' or type(meta.titans) ~= 'table' then
    error('titans: ' .. o.resume .. ' is not a --ckpt checkpoint of this script')
  end
  gp.train.resume_args(o, meta.args, {'resume', 'stop-after'})
  resume_meta = meta.titans
end

if o.device ~= '' then gp.set_device(o.device) end
local recall = o.task == 'recall'
if o.task ~= 'lm' and not recall then error("--task must be 'lm' or 'recall', got " .. o.task) end
local function pick(v, lm, rc, tiny) if v ~= -1 then return v end; if o.tiny then return tiny end; return recall and rc or lm end
local cfg = {
  dim = pick(o.dim, 320, 128, 16), num_layers = pick(o.num_layers, 6, 2, 2), num_heads = pick(o.num_heads, 8, 2, 2),
  chunk = pick(o.chunk_size, 512, 32, 8), seq_len = pick(o.seq_len, 4096, 256, 32),
  persistent = o.persistent, memory = o.memory, conv = o.conv,
}
cfg.mem_heads = o.mem_heads > 0 and o.mem_heads or cfg.num_heads
local B, accum = pick(o.batch_size, 4, 32, 2), pick(o.gradient_accumulation_steps, 32, 1, 1)
local steps, lr = pick(o.max_steps, 1000, 1500, 3), pick(o.lr, 4e-4, 2e-3, 1e-3)
local bf16 = o.mixed_precision == 'bf16' and not o.tiny
if o.mixed_precision ~= 'bf16' and o.mixed_precision ~= 'no' then error("--mixed-precision must be 'bf16' or 'no'") end
if cfg.seq_len % cfg.chunk ~= 0 then error(string.format('--seq-len %d must be a multiple of --chunk-size %d', cfg.seq_len, cfg.chunk)) end

-- the recall task's host generator: math.random, counted so that a resumed
-- run can bring it back to where it was (each call advances it one step)
local rng_calls = 0
local function rng(a, b)
  rng_calls = rng_calls + 1
  return math.random(a, b)
end
local function reseed_host(calls)
  math.randomseed(o.seed)
  for _ = 1, calls or 0 do math.random() end
  rng_calls = calls or 0
end

-- one training run; batch() -> x, y (B, T) i64 on the device. phase: 1, 2 (the
-- models in order: steps count on across them for --stop-after); done: the
-- results of the models before it (kept in the checkpoint). Returns model,
-- tokens/s, seconds, config, or nil when --stop-after cut the run off.
local function train(model_kind, batch, tag, phase, done)
  gp.manual_seed(o.seed)
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.model = model_kind
  local model = gp.nn.TitansLM(c)
  if bf16 then gp.optim.mixed_precision(model) end
  local opt = gp.optim.AdamW(model, {lr = lr, betas = {0.9, 0.95}, weight_decay = o.weight_decay})
  local warmup = o.warmup >= 0 and o.warmup or math.min(100, math.floor(steps / 10))
  local sched = gp.optim.schedule.cosine {lr = lr, min_lr = lr / 10, warmup = warmup, max_steps = steps}
  local T = cfg.seq_len
  print(string.format('%s: model %s, %d parameters, dim %d, %d layers, %d heads, chunk %d, seq %d, batch %d x %d accum, ' ..
    '%d steps, lr %g, %s, %s%s', tag, model_kind, model:num_parameters(), c.dim, c.num_layers, c.num_heads, c.chunk, T, B,
    accum, steps, lr, model_kind == 'mac' and ('memory ' .. c.memory) or ('window ' .. c.chunk), gp.device(),
    bf16 and ', bf16' or ''))
  local start = 0
  if resume_meta and resume_meta.phase == model_kind then
    start = gp.train.load_state(o.resume, {model = model, optimizer = opt})
    reseed_host(resume_meta.rng_calls)
    print(string.format('%s: resumed from %s after step %d', tag, o.resume, start))
  end
  local function save_ckpt(step)
    if o.ckpt == '' then return end
    local ts = gp.train.now()
    gp.train.save_state(o.ckpt, {model = model, optimizer = opt, step = step,
      meta = {args = gp.train.saved_args(o), config = c,
              titans = {phase = model_kind, rng_calls = rng_calls, done = done or {}}}})
    return gp.train.now() - ts
  end
  local log = gp.train.logger {steps = steps, every = o.log_every, tokens_per_step = B * T * accum,
                               file = o.log ~= '' and o.log or nil, start = start,
                               append = resume_meta ~= nil or phase > 1}
  local t0 = gp.train.now()
  model:train()
  for step = start + 1, steps do
    opt:zero_grad()
    for _ = 1, accum do
      local x, y = batch()
      local _, loss = model(x, y)
      log:add(loss)
      if accum > 1 then loss = loss / accum end
      loss:backward()
    end
    if o.grad_clip > 0 then gp.optim.clip_grad_norm(opt, o.grad_clip) end
    opt:set_lr(sched(step))
    opt:step()
    log:step(step, nil, opt:get_lr(), {model = model_kind})
    if o.out ~= '' and o.save_every > 0 and step % o.save_every == 0 and step < steps then
      local ts = gp.train.now()
      gp.save(o.out, model:state_dict(), {config = c, step = step})
      log:exclude(gp.train.now() - ts)
    end
    local global = (phase - 1) * steps + step
    if (o.ckpt_every > 0 and step % o.ckpt_every == 0) or step == steps or global == o.stop_after then
      log:exclude(save_ckpt(step) or 0)
    end
    if global == o.stop_after then
      log:finish()
      print(string.format('stopped after step %d%s', global, o.ckpt ~= '' and ('; resume with --resume ' .. o.ckpt) or ''))
      return nil
    end
  end
  gp.sync()
  local dt = gp.train.now() - t0
  log:finish()
  return model, (steps - start) * B * T * accum / math.max(dt, 1e-9), dt, c
end

if not recall then
  gp.manual_seed(o.seed)
  local path = o.data ~= '' and o.data or (script_dir .. '/../data/corpus.txt')
  local ds = gp.data.text {path = path, vocab = 'bytes', val_fraction = 0}
  print(string.format('titans: %s, %d bytes', path, ds.text_len))
  local model, tps, dt, c = train(o.model, function() return ds:batch('train', B, cfg.seq_len) end, 'titans', 1)
  if not model then return end
  print(string.format('final: %.0f tokens/s | %.1f s', tps, dt))
  if o.out ~= '' then
    gp.save(o.out, model:state_dict(), {config = c, step = steps})
    print('checkpoint: ' .. o.out)
  end
  return
end

---------------------------------------------------------------------------
-- recall: keys 'A'.., values 'a'.., filler digits

local P, T = o.tiny and math.min(o.recall_pairs, 2) or o.recall_pairs, cfg.seq_len
local KEY0, VAL0, NKEY, NVAL = 65, 97, 26, 26
if P > NKEY then error('--recall-pairs must be at most ' .. NKEY) end
local qstart = T - 2 * P -- the queries fill the end of the sequence
if qstart - 2 * P < cfg.chunk then
  error(string.format('recall: --seq-len %d is too short: the queries must be more than a window (%d) after the pairs', T, cfg.chunk))
end
local function recall_batch()
  local xs, ys = {}, {}
  for b = 1, B do
    local keys, pool = {}, {}
    for i = 0, NKEY - 1 do pool[i + 1] = i end
    for i = 1, P do local j = rng(i, NKEY); pool[i], pool[j] = pool[j], pool[i]; keys[i] = pool[i] end
    local vals = {}
    for i = 1, P do vals[i] = rng(0, NVAL - 1) end
    local seq = {}
    for i = 1, P do seq[2 * i - 1] = KEY0 + keys[i]; seq[2 * i] = VAL0 + vals[i] end
    for t = 2 * P + 1, qstart do seq[t] = 48 + rng(0, 9) end
    local order = {}
    for i = 1, P do order[i] = i end
    for i = P, 2, -1 do local j = rng(1, i); order[i], order[j] = order[j], order[i] end
    for i = 1, P do
      seq[qstart + 2 * i - 1] = KEY0 + keys[order[i]]
      seq[qstart + 2 * i] = VAL0 + vals[order[i]]
    end
    local x, y = {}, {}
    for t = 1, T do
      x[t] = seq[t]
      y[t] = -100
    end
    -- the target after each queried key is its value (x[t+1])
    for i = 1, P do local t = qstart + 2 * i - 1; y[t] = seq[t + 1] end
    xs[b], ys[b] = x, y
  end
  local dev = {dtype = 'i64', device = gp.device()}
  return gp.tensor(xs, dev), gp.tensor(ys, dev)
end

local function accuracy(model)
  model:eval()
  local hit, n
  gp.no_grad(function()
    for _ = 1, (o.eval_batches > 0 and o.eval_batches or (o.tiny and 1 or 8)) do
      local x, y = recall_batch()
      local pred = model(x):argmax(-1)
      local mask = y:ne(-100)
      local h = (pred:eq(y) * mask):to('f32'):sum()
      local c = mask:to('f32'):sum()
      hit, n = hit and hit + h or h, n and n + c or c
    end
  end)
  model:train()
  return hit:item() / n:item()
end

local res = resume_meta and resume_meta.done or {}
for phase, kind in ipairs {'mac', 'swa'} do
  if res[kind] then -- trained before the run was resumed
    print(string.format('recall %s: accuracy %.3f (before the resume)', kind, res[kind].acc))
  else
    reseed_host(0)
    local model, tps, dt = train(kind, recall_batch, 'recall', phase, res)
    if not model then return end
    res[kind] = {acc = accuracy(model), tps = tps, dt = dt}
    print(string.format('recall %s: accuracy %.3f | %.0f tokens/s | %.1f s', kind, res[kind].acc, tps, dt))
  end
end
print(string.format('recall accuracy: mac %.3f | swa %.3f | chance %.3f (%d pairs, queries %d tokens after them, window %d)',
  res.mac.acc, res.swa.acc, 1 / NVAL, P, qstart - 2 * P, cfg.chunk))
