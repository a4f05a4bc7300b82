-- train_gpt.lua: a character-level GPT on a text file (or the built-in
-- corpus, data/corpus.txt): AdamW with a cosine schedule, gradient clipping
-- on the device, optional gradient accumulation and bf16 mixed precision.
--
--   gpush scripts/train_gpt.lua                       -- the defaults, on data/corpus.txt
--   gpush scripts/train_gpt.lua --data input.txt --iters 5000 --bf16 --out gpt.safetensors
--   gpush scripts/train_gpt.lua --help                -- every flag
--
--   gpush scripts/train_gpt.lua --nproc 2 --bf16      -- data parallel on 2 GPUs (gp.dist, NCCL)
--
-- Data parallel (--nproc N, or run under gpush --nproc N): --batch is per
-- rank, the global batch is N x batch. Every rank draws the same global batch
-- (same seed) and keeps its own rows, so N ranks x batch B see exactly the
-- data of one GPU with batch N x B; gradients are averaged over the ranks in
-- buckets during backward (gp.dist.DDP). Only rank 0 prints, logs and saves.
--
-- Checkpoints to resume from: --ckpt FILE (--ckpt-every N) writes the model,
-- AdamW's state, the step and the generator's state (the batches come from
-- it) atomically; --resume FILE continues such a run exactly where it was:
--
--   gpush scripts/train_gpt.lua --iters 5000 --ckpt run.ckpt --ckpt-every 500
--   gpush scripts/train_gpt.lua --resume run.ckpt     -- after a crash, a kill, a time limit
--
-- The loss stays on the device; the host reads it every --log-every steps.
-- At the end: train and validation loss, tokens/s, and the unigram baseline
-- (the entropy of the byte distribution: what a model that ignores context
-- would score).
local gp = rawget(_G, 'gp') or require 'gpush'

local script_dir = (arg and arg[0] or 'scripts/train_gpt.lua'):match('^(.*)/[^/]*$') or '.'

local o = gp.args.parse(arg, {
  {'data', '', 'a text file (default: the built-in corpus, data/corpus.txt)'},
  {'n-embd', 128, 'embedding width'},
  {'n-layer', 4, 'transformer blocks'},
  {'n-head', 4, 'attention heads'},
  {'block', 64, 'context length (tokens)'},
  {'batch', 16, 'sequences per micro-batch'},
  {'iters', 1000, 'optimizer steps'},
  {'lr', 3e-4, 'peak learning rate'},
  {'min-lr', -1, 'final learning rate of the cosine schedule (default lr/10)'},
  {'warmup', -1, 'warmup steps (default min(100, iters/10))'},
  {'weight-decay', 0.1, 'AdamW weight decay (on matrices only)'},
  {'grad-clip', 1.0, 'clip the gradient norm to this (0: no clipping)'},
  {'grad-accum', 1, 'micro-batches per step (the loss is scaled by 1/grad-accum)'},
  {'dropout', 0, 'dropout probability'},
  {'mlp', 'gelu', 'gelu or swiglu'},
  {'norm', 'layer', 'layer or rms'},
  {'vocab', 'printable', 'printable (the printable ASCII, tab and newline, plus any other byte of the text: any prompt typed on a keyboard can be sampled from), present (the bytes of the text only) or bytes (all 256)'},
  {'val-fraction', 0.1, 'the last part of the text held out for validation'},
  {'bf16', false, 'bf16 parameters for the forward and backward, f32 master weights in AdamW'},
  {'device', '', 'cpu or cuda (default: cuda when a GPU is usable)'},
  {'seed', 1337, 'random seed (model init, batches, dropout)'},
  {'log-every', 10, 'read the loss and print a progress line every N steps'},
  {'eval-every', 200, 'estimate train and validation loss every N steps (0: only at the end)'},
  {'eval-iters', 20, 'batches per loss estimate'},
  {'out', '', 'write a checkpoint here (gp.save; the config and step in the metadata)'},
  {'ckpt', '', 'a training checkpoint to resume from (model, optimizer, step, random state: gp.train.save_state), written every --ckpt-every steps and at the end'},
  {'ckpt-every', 0, 'steps between --ckpt checkpoints (0: at the end only)'},
  {'resume', '', 'continue the run of this --ckpt checkpoint: its flags (except those given here) and its state; the loss curve goes on exactly'},
  {'stop-after', 0, 'end after this step as if cut off there (with --ckpt, the checkpoint is written first)'},
  {'log', '', 'write a JSONL record of every logged step here'},
  {'model', '', 'a Lua file returning function(gp, config) -> model (default: gp.nn.GPT)'},
  {'quiet', false, 'no progress lines'},
  {'nproc', 1, 'data parallel over N processes, one GPU each (re-runs this script under gpush --nproc N)'},
  {'bucket-mb', 25, 'data parallel: gradient bucket size in MB'},
  {'graph', true, 'on one GPU, capture the training step (batch, forward, backward, clip, AdamW) as a CUDA graph after one eager step and replay it (--no-graph: eager steps)'},
}, {usage = 'gpush scripts/train_gpt.lua [flags]', description = 'Train a character-level GPT.'})

-- a resumed run takes the flags it was started with, except those given again
local OWN_FLAGS = {'resume', 'stop-after', 'nproc'}
if o.resume ~= '' then
  local _, meta = gp.load(o.resume, {meta_only = true})
  if type(meta.args) ~= 'table' then error('train_gpt: ' .. o.resume .. ' has no flags stored (not a --ckpt checkpoint)') end
  gp.train.resume_args(o, meta.args, OWN_FLAGS)
end

local dist = gp.dist
if o.nproc > 1 and not dist.launched() then
  os.exit(dist.launch(o.nproc, dist.script_argv(arg, {nproc = true})))
end

if o.device ~= '' then gp.set_device(o.device) end
local world = dist.world_size()
if world > 1 then dist.init {backend = gp.device() == 'cuda' and 'nccl' or 'tcp'} end
local main = dist.rank() == 0
if not main then o.quiet = true end
local say = main and print or function() end
gp.manual_seed(o.seed)

local data_path = o.data ~= '' and o.data or (script_dir .. '/../data/corpus.txt')
local ds = gp.data.text {path = data_path, vocab = o.vocab, val_fraction = o.val_fraction}
local B, T, accum = o.batch, o.block, o.grad_accum
if accum < 1 or accum ~= math.floor(accum) then error('--grad-accum must be a positive integer') end

local config = {
  vocab_size = ds.vocab_size, block_size = T, n_embd = o.n_embd, n_layer = o.n_layer, n_head = o.n_head,
  dropout = o.dropout, mlp = o.mlp, norm = o.norm,
}
local model
if o.model ~= '' then
  model = assert(loadfile(o.model))()(gp, config)
else
  if not (gp.nn and gp.nn.GPT) then error('train_gpt: gp.nn.GPT is not available in this gpush') end
  model = gp.nn.GPT(config)
end
if o.bf16 then gp.optim.mixed_precision(model) end
-- data parallel: rank 0's parameters everywhere, gradients averaged in buckets during backward
local ddp = world > 1 and dist.DDP(model, {bucket_mb = o.bucket_mb}) or nil

-- a batch of this rank: the global batch (world x B rows, the same on every
-- rank: same seed) and this rank's B rows of it
local function batch(split)
  local x, y = ds:batch(split, B * world, T)
  if world > 1 then x, y = dist.shard(x), dist.shard(y) end
  return x, y
end
-- the mean over ranks of a device scalar (for the log: the global batch's loss)
local function global_mean(loss)
  local l = gp.no_grad(function() return loss:detach():to('f32'):reshape {1}:clone() end)
  if world > 1 then dist.allreduce(l, 'avg') end
  return l
end

local nparams = 0
for _, p in ipairs(model:parameters()) do nparams = nparams + p:numel() end
say(string.format('train_gpt: %s, %d bytes, vocab %d, %d parameters, device %s%s', data_path, ds.text_len,
  ds.vocab_size, nparams, gp.device(), o.bf16 and ', bf16' or ''))
say(string.format('  n_layer %d, n_head %d, n_embd %d, block %d, batch %d x %d accum, %d steps, lr %g',
  o.n_layer, o.n_head, o.n_embd, T, B, accum, o.iters, o.lr))
if world > 1 then
  say(string.format('  data parallel: %d ranks (%s), global batch %d, %s', world, dist.backend(), B * world, tostring(ddp)))
end

-- a captured step replays its launches with no Lua in between: one GPU, no
-- data parallel (NCCL calls from the DDP hooks are not captured here)
local use_graph = o.graph and gp.device() == 'cuda' and world == 1
local opt = gp.optim.AdamW(model, {lr = o.lr, betas = {0.9, 0.95}, weight_decay = o.weight_decay,
                                   device_hyper = use_graph})
local warmup = o.warmup >= 0 and o.warmup or math.min(100, math.floor(o.iters / 10))
local sched = gp.optim.schedule.cosine {lr = o.lr, min_lr = o.min_lr >= 0 and o.min_lr or o.lr / 10, warmup = warmup,
                                         max_steps = o.iters}
-- mean loss over eval_iters batches of a split, read once
local function estimate(split)
  local acc
  for _ = 1, o.eval_iters do
    local x, y = batch(split)
    local _, loss = model(x, y)
    loss = loss:to('f32'):reshape {1}
    acc = acc and acc + loss or loss
  end
  if world > 1 then dist.allreduce(acc:contiguous(), 'avg') end
  return acc:item() / o.eval_iters
end

local function evaluate()
  local t0 = gp.train.now()
  model:eval()
  local tr, va = gp.no_grad(function() return estimate('train'), ds.val and estimate('val') or nil end)
  model:train()
  return tr, va, gp.train.now() - t0
end

-- one optimizer step: its micro-batches' losses go to add(loss)
local function train_step(add)
  opt:zero_grad()
  for micro = 1, accum do
    local function run()
      local x, y = batch('train')
      local _, loss = model(x, y)
      add(world > 1 and global_mean(loss) or loss)
      if accum > 1 then loss = loss / accum end
      loss:backward()
    end
    if ddp and micro < accum then ddp:no_sync(run) else run() end
  end
  if ddp then ddp:sync() end
  if o.grad_clip > 0 then gp.optim.clip_grad_norm(opt, o.grad_clip) end
  opt:step()
end

-- a step that returns the mean loss of its micro-batches (the captured
-- graph's output; the eager first step logs it the same way)
local function mean_loss_step()
  local sum
  train_step(function(l) l = l:detach():to('f32'):reshape {1}; sum = sum and sum + l or l end)
  return accum > 1 and sum / accum or sum
end
local graph

-- training checkpoints (rank 0): everything a resumed run needs, written atomically
local function save_ckpt(step)
  if not main or o.ckpt == '' then return 0 end
  local t0 = gp.train.now()
  gp.train.save_state(o.ckpt, {model = model, optimizer = opt, step = step,
                               meta = {args = gp.train.saved_args(o), config = config}})
  return gp.train.now() - t0
end
local start = 0
if o.resume ~= '' then
  start = gp.train.load_state(o.resume, {model = model, optimizer = opt})
  say(string.format('  resumed from %s after step %d', o.resume, start))
end
local log = gp.train.logger {steps = o.iters, every = o.log_every, tokens_per_step = B * world * T * accum,
                             file = (main and o.log ~= '') and o.log or nil, print = not o.quiet,
                             start = start, append = start > 0}

model:train()
local t_start = gp.train.now()
local excluded = 0
local last = o.stop_after > 0 and math.min(o.stop_after, o.iters) or o.iters
for step = start + 1, last do
  opt:set_lr(sched(step))
  if use_graph and step > start + 1 then
    graph = graph or opt:capture(mean_loss_step)
    opt:prepare_replay()
    log:add(graph:replay())
  elseif use_graph then
    log:add(mean_loss_step())
  else
    train_step(function(l) log:add(l) end)
  end
  log:step(step, nil, opt:get_lr())
  if o.eval_every > 0 and step % o.eval_every == 0 and step < o.iters then
    local tr, va, dt = evaluate()
    log:exclude(dt)
    excluded = excluded + dt
    log:print(string.format('step %d: train loss %.4f, val loss %s', step, tr, va and string.format('%.4f', va) or '-'))
    log:write {step = step, train_loss = tr, val_loss = va}
  end
  if (o.ckpt_every > 0 and step % o.ckpt_every == 0) or step == last then
    local dt = save_ckpt(step)
    log:exclude(dt)
    excluded = excluded + dt
  end
end
if last < o.iters then -- --stop-after: cut off here, as a killed run would be
  log:finish()
  say(string.format('stopped after step %d of %d%s', last, o.iters, o.ckpt ~= '' and ('; resume with --resume ' .. o.ckpt) or ''))
  if world > 1 then dist.barrier(); dist.destroy() end
  return
end
gp.sync()
local train_time = gp.train.now() - t_start - excluded
local tokens_per_s = (o.iters - start) * B * world * T * accum / train_time

if graph then graph:free() end
local tr, va = evaluate()
log:write {step = o.iters, train_loss = tr, val_loss = va, tokens_per_s = tokens_per_s,
           unigram_entropy = ds.unigram_entropy, final = true}
log:finish()
say(string.format('final: train loss %.4f | val loss %s | unigram baseline %.4f nats | %.0f tokens/s | %.1f s',
  tr, va and string.format('%.4f', va) or '-', ds.unigram_entropy, tokens_per_s, train_time))

if main and o.out ~= '' then
  local vocab = {}
  for i = 0, ds.vocab_size - 1 do vocab[i + 1] = ds.itos[i] end
  gp.save(o.out, model:state_dict(), {config = config, step = o.iters, vocab = vocab, train_loss = tr, val_loss = va,
                                      seed = o.seed})
  print('checkpoint: ' .. o.out)
end
if ddp then
  local st = ddp.stats
  say(string.format('data parallel: %d bucket all-reduces launched during backward, %d at sync; %d in place, %d copied',
    st.in_backward, st.in_sync, st.in_place, st.copied))
end
if world > 1 then
  dist.barrier()
  dist.destroy()
end
