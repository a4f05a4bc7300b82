-- titans.lua: Titans (memory as context) against a sliding-window-attention
-- baseline and a full-attention one (the upper baseline), both of MAC's
-- parameter count, on bytes.
--
--   gpush scripts/titans.lua --model mac --dim 320 --num-layers 6 --num-heads 8 --chunk-size 512 \
--     --seq-len 4096 --batch-size 4 --gradient-accumulation-steps 32 --lr 4e-4 --weight-decay 0.1 \
--     --mixed-precision bf16 --max-steps 100 --data FILE      -- pretraining (Shakespeare when fetched, else data/corpus.txt)
--   gpush scripts/titans.lua --task recall                     -- MAC, SWA and full attention: accuracy against the gap
--   gpush scripts/titans.lua --task recall --window 16,32 --gap 0,32,64,128,192 --plot recall.png
--   gpush scripts/titans.lua --task recall --tiny --plot recall.png   -- seconds on a CPU
--   gpush scripts/titans.lua --help
--
-- Pretraining: AdamW (cosine schedule, warmup, clipping at 1), the progress
-- line shows the loss and tokens/s, the end the held-out loss (the last 10%
-- of the text, never trained on); --out writes a checkpoint (every
-- --save-every steps and at the end). --ckpt FILE (--ckpt-every N) writes a
-- checkpoint to resume from (model, optimizer, step, both generators' state)
-- and --resume FILE continues that run exactly, on either task. On one GPU the
-- training step (forward, backward, clipping, AdamW) is captured as a CUDA
-- graph after one eager step and replayed (--no-graph: eager): MAC's memory
-- runs a chunk at a time, and replaying removes the Lua between its launches.
--
-- The recall task: a sequence holds --recall-pairs key-value pairs ("K v"),
-- then a gap of filler digits, then the same keys queried in another order
-- at its end; filler before the pairs makes up the length. The loss and the
-- accuracy count only the value after each queried key. Training draws the
-- gap uniformly from 0 to the longest that fits, so one model is measured at
-- every gap of --gap. For each window of --window, MAC (chunk = window: the
-- span its attention sees) and SWA (that window) are trained; full causal
-- attention once. SWA and full get wider MLPs so that their parameter counts
-- match MAC's (gp.titans.matched_hidden). SWA can only answer when the pairs
-- are within its window (gap + 4 pairs <= window); MAC's memory can carry them
-- further; full attention sees everything.
local gp = rawget(_G, 'gp') or require 'gpush'
local ffi = require 'ffi'

local script_dir = (arg and arg[0] or 'scripts/titans.lua'):match('^(.*)/[^/]*$') or '.'

local o = gp.args.parse(arg, {
  {'task', 'lm', 'lm (byte-level pretraining) or recall (synthetic long-range recall: MAC, SWA and full attention)'},
  {'model', 'mac', 'lm task: mac (memory as context), swa (sliding-window attention, window = chunk size) or full (causal attention)'},
  {'models', 'mac,swa,full', 'recall: the models to train'},
  {'window', '', 'recall: attention windows to sweep, comma-separated: MAC chunk = SWA window (default: --chunk-size)'},
  {'gap', '', 'recall: gaps between the pairs and the queries to measure, comma-separated (default: 0, w/2, w, 2w, 4w, ... up to the longest)'},
  {'match-params', true, 'recall: widen the MLPs of SWA and full attention to MAC\'s parameter count'},
  {'graph', true, 'on one GPU, capture the training step as a CUDA graph after one eager step and replay it (--no-graph: eager)'},
  {'plot', '', 'draw the curves (and for recall, accuracy against the gap) into this .png or .svg (gnuplot); the log goes beside it unless --log'},
  {'eval-iters', 20, 'lm: batches for the held-out loss'},
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
  {'data', '', 'lm task: a text file, shakespeare or corpus (default: Shakespeare when `make models` fetched it, else data/corpus.txt)'},
  {'pos', '', 'positions: learned (absolute embeddings) or rope (rotary, in every attention); default learned for lm, rope for recall'},
  {'recall-pairs', 8, 'recall: key-value pairs per sequence'},
  {'peer', false, 'recall: also train the full-attention model in PyTorch (scripts/bench/torch_recall.py: same task, model, steps and seed) when python3 has torch, and print its accuracy by gap beside'},
  {'filler', 'digits', 'recall: digits (random digits between the pairs) or text (a needle in a haystack: the pairs, as bytes 128+, inside real text; training text from the training split, measured on held-out text)'},
  {'eval-batches', -1, 'recall: batches for the accuracy at each gap (default 8; 2 with --tiny)'},
  {'device', '', 'cpu or cuda (default: cuda when a GPU is usable)'},
  {'seed', 1337, 'random seed'},
  {'log-every', 10, 'read the loss and print a progress line every N steps'},
  {'quiet', false, 'no progress lines'},
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
  pos = o.pos ~= '' and o.pos or (recall and 'rope' or 'learned'),
}
cfg.mem_heads = o.mem_heads > 0 and o.mem_heads or cfg.num_heads
local B, accum = pick(o.batch_size, 4, 32, 2), pick(o.gradient_accumulation_steps, 32, 1, 1)
local steps, lr = pick(o.max_steps, 1000, 1500, 30), pick(o.lr, 4e-4, 2e-3, 3e-3)
if o.tiny and o.resume == '' and not o._given.log_every then o.log_every = 5 end -- (a resumed run keeps its saved value)
local bf16 = o.mixed_precision == 'bf16' and not o.tiny
if o.mixed_precision ~= 'bf16' and o.mixed_precision ~= 'no' then error("--mixed-precision must be 'bf16' or 'no'") end
if cfg.seq_len % cfg.chunk ~= 0 then error(string.format('--seq-len %d must be a multiple of --chunk-size %d', cfg.seq_len, cfg.chunk)) end
local log_path = o.log ~= '' and o.log or (o.plot ~= '' and gp.plot.log_path(o.plot)) or nil

-- a comma-separated list of positive integers (or nil when empty)
local function int_list(flag, s)
  if s == '' then return nil end
  local out = {}
  for w in s:gmatch('[^,%s]+') do
    local n = tonumber(w)
    if not n or n ~= math.floor(n) or n < 0 then error(string.format('--%s: %s is not a non-negative integer', flag, w)) end
    out[#out + 1] = n
  end
  return out
end

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

-- one training run; batch() -> x, y (B, T) i64 on the device (host_batch:
-- made on the host, so a captured step reads them from buffers filled before
-- each replay). run: {name =, model = 'mac'|'swa'|'full', window =,
-- chunk =, mlp_hidden =}. phase: 1, 2, ... (the runs in order: steps count on
-- across them for --stop-after); done: the results of the runs before it
-- (kept in the checkpoint). Returns model, tokens/s, seconds, config, or nil
-- when --stop-after cut the run off.
local function train(run, batch, host_batch, phase, done)
  gp.manual_seed(o.seed)
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.model, c.window, c.mlp_hidden = run.model, run.window, run.mlp_hidden
  if run.chunk then c.chunk = run.chunk end
  local model = gp.nn.TitansLM(c)
  if bf16 then gp.optim.mixed_precision(model) end
  local use_graph = o.graph and gp.device() == 'cuda' and (accum == 1 or not host_batch)
  local opt = gp.optim.AdamW(model, {lr = lr, betas = {0.9, 0.95}, weight_decay = o.weight_decay, device_hyper = use_graph})
  local warmup = o.warmup >= 0 and o.warmup or math.min(100, math.floor(steps / 10))
  local sched = gp.optim.schedule.cosine {lr = lr, min_lr = lr / 10, warmup = warmup, max_steps = steps}
  local T = cfg.seq_len
  local attn = run.model == 'mac' and string.format('chunk %d, memory %s', c.chunk, c.memory) or
               run.model == 'swa' and string.format('window %d', c.window or c.chunk) or 'full attention'
  print(string.format('%s: %d parameters, dim %d, %d layers, %d heads, %s%s, seq %d, batch %d x %d accum, %d steps, lr %g, ' ..
    '%s%s%s', run.name, model:num_parameters(), c.dim, c.num_layers, c.num_heads, attn .. ', ' .. c.pos .. ' positions',
    c.mlp_hidden and string.format(', MLP hidden %d', c.mlp_hidden) or '', T, B, accum, steps, lr, gp.device(),
    bf16 and ', bf16' or '', use_graph and ', CUDA graph' or ''))
  local start = 0
  if resume_meta and resume_meta.phase == run.name then
    start = gp.train.load_state(o.resume, {model = model, optimizer = opt})
    reseed_host(resume_meta.rng_calls)
    print(string.format('%s: resumed from %s after step %d', run.name, o.resume, start))
  end
  local function save_ckpt(step)
    if o.ckpt == '' then return end
    local ts = gp.train.now()
    gp.train.save_state(o.ckpt, {model = model, optimizer = opt, step = step,
      meta = {args = gp.train.saved_args(o), config = c,
              titans = {phase = run.name, rng_calls = rng_calls, done = done or {}}}})
    return gp.train.now() - ts
  end
  local log = gp.train.logger {steps = steps, every = o.log_every, tokens_per_step = B * T * accum,
                               file = log_path, start = start, append = resume_meta ~= nil or phase > 1,
                               print = not o.quiet}
  -- the step: its micro-batches (xs, ys: given batches, else drawn), clipping, AdamW; the mean loss
  local function step_fn(xs, ys)
    opt:zero_grad()
    local sum
    for i = 1, accum do
      local x, y
      if xs then x, y = xs[i], ys[i] else x, y = batch() end
      local _, loss = model(x, y)
      local l = loss:detach():to('f32'):reshape {1}
      sum = sum and sum + l or l
      if accum > 1 then loss = loss / accum end
      loss:backward()
    end
    if o.grad_clip > 0 then gp.optim.clip_grad_norm(opt, o.grad_clip) end
    opt:step()
    return accum > 1 and sum / accum or sum
  end
  local graph, sx, sy -- the captured step and, for host batches, the buffers it reads
  -- the rate leaves out the first WARM steps (the eager step, then the capture) of every model: they hold the
  -- process's one-time start-up (cuBLAS, each kernel's first load), which lands on whichever model runs first
  local WARM, t_warm, paused = 2, nil, 0
  local function exclude(sec)
    log:exclude(sec)
    if t_warm then paused = paused + sec end
  end
  local t0 = gp.train.now()
  model:train()
  for step = start + 1, steps do
    opt:set_lr(sched(step))
    if use_graph and step > start + 1 and graph ~= false then
      if host_batch then
        local x, y = batch()
        if not sx then sx, sy = x:clone(), y:clone() else sx:copy_(x); sy:copy_(y) end
      end
      if not graph then
        local ok, g = pcall(opt.capture, opt, function() return step_fn(sx and {sx}, sy and {sy}) end)
        if ok then graph = g else
          graph = false
          print(string.format('%s: the step could not be captured as a CUDA graph, eager steps instead: %s', run.name, tostring(g)))
        end
      end
      if graph then
        opt:prepare_replay()
        log:add(graph:replay())
      else
        log:add(step_fn(sx and {sx}, sy and {sy}))
      end
    else
      log:add(step_fn())
    end
    log:step(step, nil, opt:get_lr(), {model = run.name})
    if step == start + WARM and steps > step then
      gp.sync()
      t_warm = gp.train.now()
    end
    if o.out ~= '' and o.save_every > 0 and step % o.save_every == 0 and step < steps then
      local ts = gp.train.now()
      gp.save(o.out, model:state_dict(), {config = c, step = step})
      exclude(gp.train.now() - ts)
    end
    local global = (phase - 1) * steps + step
    if (o.ckpt_every > 0 and step % o.ckpt_every == 0) or step == steps or global == o.stop_after then
      exclude(save_ckpt(step) or 0)
    end
    if global == o.stop_after then
      log:finish()
      print(string.format('stopped after step %d%s', global, o.ckpt ~= '' and ('; resume with --resume ' .. o.ckpt) or ''))
      return nil
    end
  end
  gp.sync()
  local t1 = gp.train.now()
  local dt = t1 - t0
  log:finish()
  if graph then graph:free() end
  local tok = B * T * accum
  local all = (steps - start) * tok / math.max(dt, 1e-9)
  local steady = t_warm and (steps - start - WARM) * tok / math.max(t1 - t_warm - paused, 1e-9) or all
  return model, steady, dt, c, all
end

-- a record appended to the log (after a run's logger closed it)
local function append_log(rec)
  if not log_path then return end
  local f = assert(io.open(log_path, 'a'))
  f:write(gp.json.encode(rec), '\n')
  f:close()
end

if not recall then
  if o.model ~= 'mac' and o.model ~= 'swa' and o.model ~= 'full' then
    error("--model must be 'mac', 'swa' or 'full', got " .. o.model)
  end
  gp.manual_seed(o.seed)
  local ds = gp.data.corpus {data = o.data, fallback = script_dir .. '/../data/corpus.txt', vocab = 'bytes'}
  print('data: ' .. ds.description)
  local model, tps, dt, c, tps_all = train({name = o.model, model = o.model}, function() return ds:batch('train', B, cfg.seq_len) end,
    false, 1)
  if not model then return end
  local va
  if ds.val and ds.val:numel() > cfg.seq_len then
    model:eval()
    gp.manual_seed(o.seed + 7)
    va = gp.no_grad(function()
      local acc
      for _ = 1, o.eval_iters do
        local x, y = ds:batch('val', B, cfg.seq_len)
        local _, loss = model(x, y)
        loss = loss:to('f32'):reshape {1}
        acc = acc and acc + loss or loss
      end
      return acc:item() / o.eval_iters
    end)
    model:train()
  else
    print(string.format('held-out loss: none (the held-out part has fewer than %d bytes)', cfg.seq_len + 1))
  end
  print(string.format('final: held-out loss %s nats per byte | unigram baseline %.4f | %.0f tokens/s after the first ' ..
    'two steps (%.0f over all) | %.1f s', va and string.format('%.4f', va) or '-', ds.unigram_entropy, tps, tps_all, dt))
  append_log {step = steps, model = o.model, val_loss = va, tokens_per_s = tps, unigram_entropy = ds.unigram_entropy,
              final = true}
  if o.out ~= '' then
    gp.save(o.out, model:state_dict(), {config = c, step = steps})
    print('checkpoint: ' .. o.out)
  end
  if o.plot ~= '' then
    gp.plot.try(function(path)
      local recs = gp.plot.read_jsonl(log_path)
      local S = gp.plot.series
      local hl = {{y = ds.unigram_entropy, title = string.format('unigram %.2f', ds.unigram_entropy)}}
      if va then hl[2] = {y = va, title = string.format('held-out %.3f', va), color = '#aa0000'} end
      return gp.plot.draw {out = path, title = string.format('titans.lua %s on %s: %d layers, %d wide, seq %d', o.model,
        ds.name, c.num_layers, c.dim, c.seq_len), panels = {
          {title = 'loss', xlabel = 'step', ylabel = 'nats per byte', lines = {S(recs, 'step', 'loss', {title = 'train'})}, hlines = hl},
          {title = 'learning rate', xlabel = 'step', lines = {S(recs, 'step', 'lr')}, key = false},
          {title = 'tokens/s', xlabel = 'step', lines = {S(recs, 'step', 'tokens_per_s')}, key = false},
        }}
    end, o.plot, log_path)
  end
  return
end

---------------------------------------------------------------------------
-- recall: keys 'A'.., values 'a'.., filler digits

local P, T = o.tiny and math.min(o.recall_pairs, 2) or o.recall_pairs, cfg.seq_len
local KEY0, VAL0, NKEY, NVAL = 65, 97, 26, 26
-- --filler text: the haystack is real text (Shakespeare when fetched, bytes
-- of its training split for training, of the held-out works for the
-- accuracy); keys and values are bytes 128 and up, which the text never holds
local hay
if o.filler == 'text' then
  KEY0, VAL0 = 128, 160
  local ds = gp.data.corpus {data = o.data, fallback = script_dir .. '/../data/corpus.txt', vocab = 'bytes'}
  local text = gp.data.read_file(ds.path)
  hay = {train = text:sub(1, ds.val_start - 1), val = text:sub(ds.val_start), name = ds.name}
  for _, part in pairs {hay.train, hay.val} do
    if #part < T + 1 then error(string.format('recall --filler text: %s has a part of %d bytes, fewer than --seq-len %d', ds.name, #part, T)) end
    if part:find('[\128-\255]') then error('recall --filler text: the text holds bytes >= 128, which mark the keys and values') end
  end
elseif o.filler ~= 'digits' then
  error("--filler must be 'digits' or 'text', got " .. o.filler)
end
if P > NKEY then error('--recall-pairs must be at most ' .. NKEY) end
local max_gap = T - 4 * P -- the pairs first, the queries last
if max_gap < 1 then error(string.format('recall: --seq-len %d is too short for %d pairs and their queries', T, P)) end
local windows = int_list('window', o.window) or {cfg.chunk}
for _, w in ipairs(windows) do
  if w < 1 or T % w ~= 0 then error(string.format('--window %d: a window must divide --seq-len %d', w, T)) end
end
local gaps = int_list('gap', o.gap)
if not gaps then
  gaps = {0}
  local w = windows[1]
  for _, g in ipairs {math.floor(w / 2), w, 2 * w, 4 * w, 8 * w, 16 * w, 32 * w} do
    if g < max_gap and g > gaps[#gaps] then gaps[#gaps + 1] = g end
  end
  if gaps[#gaps] < max_gap then gaps[#gaps + 1] = max_gap end
end
for _, g in ipairs(gaps) do
  if g > max_gap then error(string.format('--gap %d: at most %d fits in --seq-len %d with %d pairs', g, max_gap, T, P)) end
end

-- a batch of recall sequences; gap: the filler between the pairs and the
-- queries (nil: each sequence draws one from 0 .. max_gap)
local function recall_batch(gap, split)
  -- written into host tensors through their pointers (nested Lua tables made the batch cost about 1.9 ms
  -- a step on the host: as long as a whole SWA step on the GPU)
  local hx, hy = gp.empty({B, T}, {dtype = 'i64', device = 'cpu'}), gp.empty({B, T}, {dtype = 'i64', device = 'cpu'})
  local px, py = ffi.cast('int64_t *', hx.c.data) + hx.c.offset, ffi.cast('int64_t *', hy.c.data) + hy.c.offset
  for b = 1, B do
    local g = gap or rng(0, max_gap)
    local p0 = T - 4 * P - g -- filler before the pairs
    local qstart = p0 + 2 * P + g
    local keys, pool = {}, {}
    for i = 0, NKEY - 1 do pool[i + 1] = i end
    for i = 1, P do local j = rng(i, NKEY); pool[i], pool[j] = pool[j], pool[i]; keys[i] = pool[i] end
    local vals = {}
    for i = 1, P do vals[i] = rng(0, NVAL - 1) end
    local seq = {}
    if hay then
      local src = hay[split or 'train']
      local off = rng(0, #src - T)
      for t = 1, T - 2 * P do seq[t] = src:byte(off + t) end
    else
      for t = 1, T - 2 * P do seq[t] = 48 + rng(0, 9) end
    end
    for i = 1, P do seq[p0 + 2 * i - 1] = KEY0 + keys[i]; seq[p0 + 2 * i] = VAL0 + vals[i] end
    local order = {}
    for i = 1, P do order[i] = i end
    for i = P, 2, -1 do local j = rng(1, i); order[i], order[j] = order[j], order[i] end
    for i = 1, P do
      seq[qstart + 2 * i - 1] = KEY0 + keys[order[i]]
      seq[qstart + 2 * i] = VAL0 + vals[order[i]]
    end
    local row = (b - 1) * T - 1 -- px[row + t] is token t
    for t = 1, T do
      px[row + t] = seq[t]
      py[row + t] = -100
    end
    -- the target after each queried key is its value (x[t+1])
    for i = 1, P do local t = qstart + 2 * i - 1; py[row + t] = seq[t + 1] end
  end
  return hx:to(gp.device()), hy:to(gp.device())
end

-- accuracy on the queried values at a gap
local function accuracy(model, gap)
  model:eval()
  local hit, n
  gp.no_grad(function()
    for _ = 1, (o.eval_batches > 0 and o.eval_batches or (o.tiny and 2 or 8)) do
      local x, y = recall_batch(gap, 'val')
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

-- the runs: per window MAC (chunk = window) and SWA (that window), then full
-- attention; SWA and full with MAC's parameter count
local want = {}
for m in o.models:gmatch('[^,%s]+') do
  if m ~= 'mac' and m ~= 'swa' and m ~= 'full' then error(string.format("--models: unknown model '%s' (mac, swa, full)", m)) end
  want[m] = true
end
local runs = {}
for _, w in ipairs(windows) do
  local hidden = nil
  if o.match_params then
    local c = {}
    for k, v in pairs(cfg) do c[k] = v end
    c.chunk = w
    hidden = gp.titans.matched_hidden(c)
  end
  local suffix = #windows > 1 and ('@' .. w) or ''
  if want.mac then runs[#runs + 1] = {name = 'mac' .. suffix, model = 'mac', chunk = w, window = w} end
  if want.swa then runs[#runs + 1] = {name = 'swa' .. suffix, model = 'swa', chunk = w, window = w, mlp_hidden = hidden} end
  if want.full and w == windows[#windows] then
    runs[#runs + 1] = {name = 'full', model = 'full', chunk = w, mlp_hidden = hidden}
  end
end
if #runs == 0 then error('--models: no model to train') end

print(string.format('recall: %d pairs in %s, sequences of %d, gaps drawn from 0 to %d in training; accuracy measured at gaps %s',
  P, hay and (hay.name .. ' text (its held-out works for the accuracy)') or 'random digits', T, max_gap, table.concat(gaps, ', ')))
local res = resume_meta and resume_meta.done or {}
for phase, run in ipairs(runs) do
  if res[run.name] then -- trained before the run was resumed
    print(string.format('recall %s: accuracy %.3f (before the resume)', run.name, res[run.name].acc))
  else
    reseed_host(0)
    local model, tps, dt, _, tps_all = train(run, function() return recall_batch(nil, 'train') end, true, phase, res)
    if not model then return end
    local r = {acc = 0, by_gap = {}, tps = tps, tps_all = tps_all, dt = dt, params = model:num_parameters(),
               window = run.window, model = run.model}
    for i, g in ipairs(gaps) do
      r.by_gap[i] = accuracy(model, g)
      r.acc = r.acc + r.by_gap[i] / #gaps
      append_log {run = run.name, gap = g, accuracy = r.by_gap[i]}
    end
    res[run.name] = r
    append_log {run = run.name, model = run.model, window = run.window, accuracy = r.acc, tokens_per_s = tps,
                tokens_per_s_all = tps_all, params = r.params, final = true}
    print(string.format('recall %s: accuracy %.3f (mean over the gaps) | %.0f tokens/s (%.0f with the first two steps) ' ..
      '| %.1f s | %d parameters', run.name, r.acc, tps, tps_all, dt, r.params))
  end
end

-- --peer: the full-attention model trained in PyTorch on the same task (a column 'torch' of accuracy by gap), or nil
local function torch_peer()
  local full
  for _, run in ipairs(runs) do if run.model == 'full' then full = run end end
  local why = not full and 'it needs the full model in --models' or hay and 'it has no --filler text' or
              cfg.pos ~= 'rope' and 'it has rotary positions only (--pos rope)' or nil
  if not why then
    local rc = os.execute('python3 -c "import torch" >/dev/null 2>&1') -- LuaJIT: the exit status (0: found)
    if rc ~= 0 and rc ~= true then why = 'python3 cannot import torch' end
  end
  if why then print('peer: no PyTorch column: ' .. why); return nil end
  local cmd = string.format("python3 '%s/bench/torch_recall.py' --steps %d --dim %d --layers %d --heads %d --mlp-hidden %d " ..
    '--lr %.10g --batch %d --seq %d --pairs %d --seed %d --gaps %s --eval-batches %d 2>&1', script_dir, steps, cfg.dim,
    cfg.num_layers, cfg.num_heads, full.mlp_hidden or 4 * cfg.dim, lr, B, T, P, o.seed, table.concat(gaps, ','),
    o.eval_batches > 0 and o.eval_batches or (o.tiny and 2 or 8))
  print('peer: ' .. cmd)
  local f = io.popen(cmd)
  local out = f:read('*a')
  f:close()
  local r, n = {acc = 0, by_gap = {}}, 0
  for g, a in out:gmatch('gap%s+(%d+): accuracy ([%d.]+)') do
    n = n + 1
    if tonumber(g) ~= gaps[n] then break end
    r.by_gap[n] = tonumber(a)
    r.acc = r.acc + r.by_gap[n] / #gaps
    append_log {run = 'torch_full', gap = gaps[n], accuracy = r.by_gap[n]}
  end
  if n ~= #gaps then print('peer: torch_recall.py gave no accuracy for every gap:\n' .. out); return nil end
  return r
end
local peer = o.peer and torch_peer() or nil

-- accuracy against the gap, one row per gap
print('')
local head = {string.format('%6s', 'gap')}
for _, run in ipairs(runs) do head[#head + 1] = string.format('%8s', run.name) end
if peer then head[#head + 1] = string.format('%8s', 'torch') end
print(table.concat(head, ' '))
for i, g in ipairs(gaps) do
  local row = {string.format('%6d', g)}
  for _, run in ipairs(runs) do row[#row + 1] = string.format('%8.3f', res[run.name].by_gap[i]) end
  if peer then row[#row + 1] = string.format('%8.3f', peer.by_gap[i]) end
  print(table.concat(row, ' '))
end
local summary, speed = {}, {}
for _, run in ipairs(runs) do
  summary[#summary + 1] = string.format('%s %.3f', run.name, res[run.name].acc)
  speed[#speed + 1] = string.format('%s %.0f', run.name, res[run.name].tps)
  if res[run.name].tps_all then speed[#speed] = speed[#speed] .. string.format(' (%.0f)', res[run.name].tps_all) end
end
if peer then summary[#summary + 1] = string.format('full in PyTorch %.3f', peer.acc) end
print(string.format('recall accuracy: %s | chance %.3f (%d pairs; SWA sees the pairs when gap + %d <= window %s)',
  table.concat(summary, ' | '), 1 / NVAL, P, 4 * P, table.concat(windows, ',')))
print('tokens/s after the first two steps (over all steps): ' .. table.concat(speed, ' | '))
local mac, swa = res[runs[1].name], nil
for _, run in ipairs(runs) do if run.model == 'swa' and run.window == runs[1].window then swa = res[run.name] end end
if mac and swa and runs[1].model == 'mac' then
  print(string.format('MAC / SWA tokens/s: %.2f (window %d; over all steps %s)', mac.tps / swa.tps, runs[1].window,
    mac.tps_all and swa.tps_all and string.format('%.2f', mac.tps_all / swa.tps_all) or '-'))
end

if o.plot ~= '' then
  gp.plot.try(function(path)
    local recs = gp.plot.read_jsonl(log_path)
    local S = gp.plot.series
    local acc, loss = {}, {}
    local labels, tps = {}, {}
    for _, run in ipairs(runs) do
      acc[#acc + 1] = S(recs, 'gap', 'accuracy', {where = {run = run.name}, title = run.name, style = 'linespoints'})
      loss[#loss + 1] = S(recs, 'step', 'loss', {where = {model = run.name}, title = run.name})
      labels[#labels + 1] = run.name
      tps[#tps + 1] = res[run.name].tps
    end
    if peer then
      acc[#acc + 1] = S(recs, 'gap', 'accuracy', {where = {run = 'torch_full'}, title = 'full (PyTorch)', style = 'linespoints'})
    end
    return gp.plot.draw {out = path, title = string.format('titans.lua recall: %d pairs, seq %d, %d layers, %d wide', P, T,
      cfg.num_layers, cfg.dim), panels = {
        {title = 'recall accuracy against the gap', xlabel = 'gap (tokens between the pairs and the queries)',
         ylabel = 'accuracy', lines = acc, yrange = {0, 1.05}, hlines = {{y = 1 / NVAL, title = 'chance'}}},
        {title = 'training loss (on the queried values)', xlabel = 'step', ylabel = 'nats', lines = loss},
        {title = 'tokens/s', bars = {labels = labels, groups = {{title = 'tokens/s', values = tps}}}, key = false},
      }}
  end, o.plot, log_path)
end
