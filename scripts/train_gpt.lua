-- train_gpt.lua: a GPT on real text: the Shakespeare corpus of `make models`
-- by default (the last whole plays held out, never trained on), else the
-- offline fallback data/corpus.txt, or --data FILE; character level, or a real
-- tokenizer's ids (--tokenizer gpt2). AdamW with a cosine schedule, gradient
-- clipping on the device, optional gradient accumulation and bf16 mixed
-- precision; on one GPU the whole step is a replayed CUDA graph.
--
--   gpush scripts/train_gpt.lua                       -- the seed config (4 layers, 128 wide; fewer steps on a CPU)
--   gpush scripts/train_gpt.lua --config shakespeare --bf16   -- nanoGPT's shakespeare_char (6 layers, 384 wide)
--   gpush scripts/train_gpt.lua --tiny --plot out.png -- a CPU run of a few seconds, and its curves
--   gpush scripts/train_gpt.lua --tokenizer gpt2      -- BPE tokens (GPT-2's vocabulary) instead of characters
--   gpush scripts/train_gpt.lua --data input.txt --iters 5000 --bf16 --out gpt.safetensors --log train.jsonl
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
-- At the end: train and held-out loss, tokens/s, the unigram baseline (the
-- entropy of the token distribution: what a model that ignores context would
-- score) and, for --config shakespeare, nanoGPT's published
-- validation loss. --plot FILE draws the loss (train and held-out), the
-- learning rate and tokens/s from the JSONL log (gnuplot).
local gp = rawget(_G, 'gp') or require 'gpush'

local script_dir = (arg and arg[0] or 'scripts/train_gpt.lua'):match('^(.*)/[^/]*$') or '.'

-- nanoGPT's config/train_shakespeare_char.py, and its validation loss there
-- (about 1.47 nats on tiny shakespeare, the last 10% of a 1.1 MB file)
local CONFIGS = {
  shakespeare = {n_layer = 6, n_head = 6, n_embd = 384, block = 256, batch = 64, dropout = 0.2, lr = 1e-3,
                      min_lr = 1e-4, warmup = 100, iters = 5000, beta2 = 0.99, weight_decay = 0.1, grad_clip = 1.0,
                      eval_every = 500, eval_iters = 200, log_every = 50, bias = false},
}
CONFIGS.shakespeare_char = CONFIGS.shakespeare
local REFERENCE = {shakespeare = 1.47, shakespeare_char = 1.47}
-- a CPU run of seconds (the test suite draws its picture)
local TINY = {n_layer = 2, n_head = 2, n_embd = 32, block = 32, batch = 8, iters = 150, eval_every = 50, eval_iters = 4,
              log_every = 10, lr = 3e-3}

local o = gp.args.parse(arg, {
  {'data', '', 'a text file, shakespeare or corpus (default: the Shakespeare corpus of `make models` when present, else data/corpus.txt)'},
  {'tokenizer', '', 'BPE tokens instead of characters: a short name (gpt2, smollm2), a tokenizer.json, a Hugging Face directory or a .gguf file'},
  {'config', '', 'a named config: shakespeare (nanoGPT\'s shakespeare_char: 6 layers, 384 wide, 6 heads, block 256, dropout 0.2, lr 1e-3, 5000 steps of 64); flags given override it'},
  {'tiny', false, 'a tiny config that trains in seconds on a CPU (2 layers, 32 wide, 150 steps)'},
  {'plot', '', 'draw the curves (loss, held-out loss, lr, tokens/s) into this .png or .svg (gnuplot); the log goes beside it unless --log'},
  {'n-embd', 128, 'embedding width'},
  {'n-layer', 4, 'transformer blocks'},
  {'n-head', 4, 'attention heads'},
  {'block', 64, 'context length (tokens)'},
  {'batch', 16, 'sequences per micro-batch'},
  {'iters', 1000, 'optimizer steps (on a CPU without --config or --tiny: 200)'},
  {'lr', 3e-4, 'peak learning rate'},
  {'min-lr', -1, 'final learning rate of the cosine schedule (default lr/10)'},
  {'warmup', -1, 'warmup steps (default min(100, iters/10))'},
  {'weight-decay', 0.1, 'AdamW weight decay (on matrices only)'},
  {'beta2', 0.95, 'AdamW beta2'},
  {'bias', true, 'biases in the linear layers and norms (--no-bias: none, as nanoGPT\'s configs)'},
  {'grad-clip', 1.0, 'clip the gradient norm to this (0: no clipping)'},
  {'grad-accum', 1, 'micro-batches per step (the loss is scaled by 1/grad-accum)'},
  {'dropout', 0, 'dropout probability'},
  {'mlp', 'gelu', 'gelu or swiglu'},
  {'norm', 'layer', 'layer or rms'},
  {'vocab', 'printable', 'printable (the printable ASCII, tab and newline, plus any other byte of the text: any prompt typed on a keyboard can be sampled from), present (the bytes of the text only) or bytes (all 256)'},
  {'val-fraction', 0.1, 'the last part of the text held out (never trained on; for Shakespeare rounded up to whole works)'},
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
  {'fused-loss', 'auto', 'the training loss by model:loss (gp.linear_cross_entropy: the logits never whole): on, off, or auto (on at a vocabulary of 8192 or more that is not a multiple of 8, when the model has :loss)'},
  {'graph', true, 'on one GPU, capture the training step (batch, forward, backward, clip, AdamW) as a CUDA graph after one eager step and replay it (--no-graph: eager steps)'},
}, {usage = 'gpush scripts/train_gpt.lua [flags]', description = 'Train a GPT on text (character level or BPE).'})

if o.config ~= '' then
  gp.args.preset(o, CONFIGS[o.config] or error(string.format("--config: unknown config '%s' (shakespeare)", o.config)))
end
if o.tiny then gp.args.preset(o, TINY) end

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
-- the CPU default: the seed config for fewer steps (about 4 minutes on 2 cores, not 20)
if gp.device() == 'cpu' and o.config == '' and not o.tiny and o.resume == '' then gp.args.preset(o, {iters = 200, eval_every = 100}) end
local world = dist.world_size()
if world > 1 then dist.init {backend = gp.device() == 'cuda' and 'nccl' or 'tcp'} end
local main = dist.rank() == 0
if not main then o.quiet = true end
local say = main and print or function() end
gp.manual_seed(o.seed)

local tok = o.tokenizer ~= '' and gp.models.tokenizer(o.tokenizer) or nil
local ds = gp.data.corpus {data = o.data, fallback = script_dir .. '/../data/corpus.txt', vocab = o.vocab, tokenizer = tok,
                           val_fraction = o.val_fraction}
local B, T, accum = o.batch, o.block, o.grad_accum
if accum < 1 or accum ~= math.floor(accum) then error('--grad-accum must be a positive integer') end

local config = {
  vocab_size = ds.vocab_size, block_size = T, n_embd = o.n_embd, n_layer = o.n_layer, n_head = o.n_head,
  dropout = o.dropout, mlp = o.mlp, norm = o.norm, bias = o.bias,
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
say('data: ' .. ds.description)
say(string.format('train_gpt: %s, vocab %d (%s), %d parameters, device %s%s', o.config ~= '' and ('config ' .. o.config) or
  (o.tiny and 'tiny' or 'seed config'), ds.vocab_size, tok and string.format('%s, %.2f bytes a token', tostring(tok.path or
  o.tokenizer), ds.bytes_per_token) or 'characters', nparams, gp.device(), o.bf16 and ', bf16' or ''))
say(string.format('  n_layer %d, n_head %d, n_embd %d, block %d, batch %d x %d accum, %d steps, lr %g',
  o.n_layer, o.n_head, o.n_embd, T, B, accum, o.iters, o.lr))
if world > 1 then
  say(string.format('  data parallel: %d ranks (%s), global batch %d, %s', world, dist.backend(), B * world, tostring(ddp)))
end

-- a captured step replays its launches with no Lua in between: one GPU, no
-- data parallel (NCCL calls from the DDP hooks are not captured here)
local use_graph = o.graph and gp.device() == 'cuda' and world == 1
local opt = gp.optim.AdamW(model, {lr = o.lr, betas = {0.9, o.beta2}, weight_decay = o.weight_decay,
                                   device_hyper = use_graph})
local warmup = math.min(o.warmup >= 0 and o.warmup or math.min(100, math.floor(o.iters / 10)), o.iters)
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

-- the training loss: at a large vocabulary that is not a multiple of 8
-- (GPT-2's 50257) through model:loss (gp.linear_cross_entropy: the logits
-- never whole, no padded rows copied; the GPT-2-small step 18.07 -> 17.05 ms
-- on an H200, BENCHMARKS.md 2026-11-29 (g)); else (at 50304: 16.74 ms
-- through model(x, y), 17.0 through model:loss), or for a model of --model
-- without :loss, through model(x, y)
if o.fused_loss ~= 'auto' and o.fused_loss ~= 'on' and o.fused_loss ~= 'off' then
  error("--fused-loss: on, off or auto, got '" .. tostring(o.fused_loss) .. "'")
end
local fused_loss = o.fused_loss == 'on' or (o.fused_loss == 'auto' and ds.vocab_size >= 8192 and ds.vocab_size % 8 ~= 0)
if fused_loss and type(model.loss) ~= 'function' then
  if o.fused_loss == 'on' then error('--fused-loss on: the model has no :loss(idx, targets)') end
  fused_loss = false
end
local function train_loss(x, y)
  if fused_loss then return model:loss(x, y) end
  local _, loss = model(x, y)
  return loss
end

-- one optimizer step: its micro-batches' losses go to add(loss)
local function train_step(add)
  opt:zero_grad()
  for micro = 1, accum do
    local function run()
      local x, y = batch('train')
      local loss = train_loss(x, y)
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
local log_path = o.log ~= '' and o.log or (o.plot ~= '' and gp.plot.log_path(o.plot)) or nil
local log = gp.train.logger {steps = o.iters, every = o.log_every, tokens_per_step = B * world * T * accum,
                             file = main and log_path or nil, print = not o.quiet,
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
local ref = not tok and REFERENCE[o.config] or nil
if va then
  local gap = ds.unigram_entropy - va
  say(string.format('held-out loss %.4f nats per %s (%.4f per byte) on %s: %.4f %s the unigram baseline (%.4f)%s',
    va, tok and 'token' or 'character', va / ds.bytes_per_token, ds.name, math.abs(gap), gap >= 0 and 'below' or 'ABOVE',
    ds.unigram_entropy,
    ref and string.format('; nanoGPT %s reaches about %.2f on tiny shakespeare (%s)', o.config, ref,
      va <= ref + 0.03 and 'matched' or string.format('%+.3f from it', va - ref)) or ''))
end

local function draw(path)
  local recs = gp.plot.read_jsonl(log_path)
  local steps, final = {}, nil
  for _, r in ipairs(recs) do if r.final then final = r else steps[#steps + 1] = r end end
  local S = gp.plot.series
  local hl = {{y = ds.unigram_entropy, title = string.format('unigram baseline %.2f', ds.unigram_entropy)}}
  if ref then hl[2] = {y = ref, title = string.format('nanoGPT %s %.2f', o.config, ref), color = '#aa0000'} end
  local loss = {S(steps, 'step', 'loss', {title = 'train (batch)'}),
                S(recs, 'step', 'train_loss', {title = 'train (estimate)', style = 'linespoints'}),
                S(recs, 'step', 'val_loss', {title = 'held-out', style = 'linespoints'})}
  return gp.plot.draw {out = path, title = string.format('train_gpt on %s: %d layers, %d wide, %d steps%s', ds.name,
    o.n_layer, o.n_embd, o.iters, final and final.val_loss and string.format(', held-out %.3f', final.val_loss) or ''),
    panels = {
      {title = 'loss', xlabel = 'step', ylabel = 'nats per ' .. (tok and 'token' or 'character'), lines = loss, hlines = hl},
      {title = 'learning rate', xlabel = 'step', lines = {S(steps, 'step', 'lr', {title = 'lr'})}, key = false},
      {title = 'tokens/s', xlabel = 'step', lines = {S(steps, 'step', 'tokens_per_s', {title = 'tokens/s'})}, key = false},
    }}
end
if main and o.plot ~= '' then gp.plot.try(draw, o.plot, log_path) end

if main and o.out ~= '' then
  local vocab
  if not tok then
    vocab = {}
    for i = 0, ds.vocab_size - 1 do vocab[i + 1] = ds.itos[i] end
  end
  gp.save(o.out, model:state_dict(), {config = config, step = o.iters, vocab = vocab, train_loss = tr, val_loss = va,
                                      seed = o.seed, tokenizer = tok and (tok.path or o.tokenizer) or nil})
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
