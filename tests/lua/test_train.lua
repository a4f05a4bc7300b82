-- Training UX and scripts/train_gpt.lua: the logger reads the loss only
-- every `every` steps, prints \r lines on a terminal and plain lines
-- otherwise, and writes JSONL; the script runs end to end on the CPU (with a
-- stand-in model now; with gp.nn.GPT once it exists, where the validation
-- loss must end well below the unigram baseline).
local T = require 'lib'
local Tensor = gp.Tensor

local root = GPUSH_ROOT or '.'
local exe = T.exe

local sh = T.sh

T.test('logger: the loss is read once per report, JSONL records, plain lines off a terminal', function()
  local path = os.tmpname()
  local log = gp.train.logger {steps = 10, every = 5, tokens_per_step = 100, file = path, print = false}
  local reads, item = 0, Tensor.item
  Tensor.item = function(...) reads = reads + 1; return item(...) end
  local ok, err = pcall(function()
    for step = 1, 10 do
      local loss = gp.full({}, step)   -- a device scalar, as a model returns it
      local rec = log:step(step, loss, 0.1)
      if step % 5 ~= 0 then T.eq(rec, nil) end
      T.eq(reads, math.floor(step / 5), 'reads after step ' .. step)
    end
  end)
  Tensor.item = item
  if not ok then error(err, 0) end
  log:write {step = 10, val_loss = 1.5}
  log:finish()
  local recs = gp.data.jsonl(path)
  os.remove(path)
  T.eq(#recs, 3)
  T.eq(recs[1].step, 5); T.near(recs[1].loss, 3, 1e-6, 'mean of steps 1..5')
  T.eq(recs[2].step, 10); T.near(recs[2].loss, 8, 1e-6, 'mean of steps 6..10')
  T.near(recs[1].lr, 0.1, 1e-12)
  T.ok(recs[1].tokens_per_s >= 0 and recs[1].time >= 0)
  T.eq(recs[3].val_loss, 1.5)
  -- micro-steps: add() several losses, one step
  local l2 = gp.train.logger {steps = 1, every = 1, print = false}
  l2:add(gp.full({}, 1)); l2:add(gp.full({}, 3))
  T.near(l2:step(1, nil, 0).loss, 2, 1e-6)
end)

T.test('logger: \\r updates on a terminal, plain lines otherwise', function()
  local code = "local l = gp.train.logger{steps=3, every=1, tokens_per_step=10, tty=%s}; " ..
               "for s=1,3 do l:step(s, gp.full({}, s), 0.01) end; l:finish()"
  local out, rc = sh(exe .. ' --device cpu -e "' .. code:format('true') .. '"')
  T.eq(rc, 0, out)
  T.ok(out:find('\r', 1, true), 'carriage returns on a terminal')
  T.ok(out:find('step 3/3 | loss 3.0000', 1, true), out)
  T.ok(out:find('ETA', 1, true) and out:find('tok/s', 1, true), out)
  out, rc = sh(exe .. ' --device cpu -e "' .. code:format('false') .. '"')
  T.eq(rc, 0, out)
  T.ok(not out:find('\r', 1, true), 'no carriage return off a terminal')
  local n = 0
  for _ in out:gmatch('step %d/3[^\n]*\n') do n = n + 1 end
  T.eq(n, 3, out)
end)

local function final_of(out)
  local tr, va, uni, tps = out:match('final: train loss ([%d.]+) | val loss ([%d.]+) | unigram baseline ([%d.]+) nats | ([%d.]+) tokens/s')
  return tonumber(tr), tonumber(va), tonumber(uni), tonumber(tps)
end

T.test('train_gpt runs end to end with a stand-in model: log, checkpoint, accumulation, bf16', function()
  local ck, logf = os.tmpname(), os.tmpname()
  local base = exe .. ' ' .. root .. '/scripts/train_gpt.lua --device cpu --model ' .. root ..
               '/tests/lua/stub_gpt.lua --iters 20 --lr 0.05 --log-every 5 --eval-every 10 --eval-iters 2 --batch 4 --block 8'
  local out, rc = sh(base .. ' --out ' .. ck .. ' --log ' .. logf .. ' --grad-accum 2')
  T.eq(rc, 0, out)
  local tr, va, uni, tps = final_of(out)
  T.ok(tr and va and uni and tps, out)
  T.ok(va < 0.1, 'the stand-in loss falls: ' .. out)
  T.ok(uni > 2 and uni < 4, 'the byte entropy of the English corpus')
  T.ok(out:find('step 10: train loss', 1, true), out)
  local recs = gp.data.jsonl(logf)
  local steps = {}
  for _, r in ipairs(recs) do if r.loss then steps[#steps + 1] = r.step end end
  T.same(steps, {5, 10, 15, 20})
  T.ok(recs[#recs].final and recs[#recs].val_loss, 'a final record')
  local sd, meta = gp.load(ck)
  T.ok(sd.w and sd.b, 'the model tensors')
  T.eq(meta.step, 20)
  T.eq(meta.config.n_embd, 128)
  T.eq(meta.config.block_size, 8)
  T.eq(#meta.vocab, meta.config.vocab_size)
  os.remove(ck); os.remove(logf)
  out, rc = sh(base .. ' --bf16 --quiet')
  T.eq(rc, 0, out)
  va = select(2, final_of(out))
  T.ok(va and va < 0.1, out)
  T.ok(out:find('bf16', 1, true))
  out, rc = sh(base .. ' --no-such-flag')
  T.eq(rc, 1); T.ok(out:find('unknown flag --no-such-flag', 1, true), out)
  out, rc = sh(exe .. ' ' .. root .. '/scripts/train_gpt.lua --help')
  T.eq(rc, 0); T.ok(out:find('--grad-accum N', 1, true) and out:find('--bf16', 1, true), out)
end)

T.test('train_gpt with gp.nn.GPT on the CPU: validation loss well below the unigram baseline', function()
  if not (gp.nn and gp.nn.GPT) then T.skip('gp.nn.GPT is not in this gpush yet (the nn module)') end
  local out, rc = sh(exe .. ' ' .. root .. '/scripts/train_gpt.lua --device cpu --iters 500 --n-embd 32 --n-layer 1' ..
                     ' --n-head 2 --block 16 --batch 8 --lr 1e-2 --eval-every 0 --eval-iters 10 --quiet')
  T.eq(rc, 0, out)
  local tr, va, uni = final_of(out)
  T.ok(va, out)
  T.ok(va < 0.9 * uni, string.format('val loss %.3f vs unigram %.3f\n%s', va, uni, out))
  T.ok(tr < 0.9 * uni, out)
end)

T.test('train_gpt on CUDA: the captured step (CUDA graph) follows the eager steps', function()
  T.cuda()
  local function run(flag)
    local log = os.tmpname()
    local out, rc = sh(exe .. ' ' .. root .. '/scripts/train_gpt.lua --device cuda --iters 40 --log-every 10' ..
                       ' --eval-every 0 --eval-iters 2 --quiet --grad-accum 2 --log ' .. log .. ' ' .. flag)
    T.eq(rc, 0, out)
    local losses = {}
    for line in io.lines(log) do
      local l = line:match('"loss":%s*([%d%.e%-]+)')
      if l then losses[#losses + 1] = tonumber(l) end
    end
    os.remove(log)
    return losses, out
  end
  local g, og = run('--graph')
  local e, oe = run('--no-graph')
  T.ok(#g == 4 and #e == 4, og .. oe)
  for i = 1, #e do T.ok(math.abs(g[i] - e[i]) < 1e-4 * math.abs(e[i]), string.format('step %d: graph %.6f eager %.6f', 10 * i, g[i], e[i])) end
end)

---------------------------------------------------------------------------
-- resumable training (issue 26, M): --ckpt / --resume continue the loss curve
-- exactly, bit for bit on the CPU

-- step -> loss of a JSONL log
local function losses(path)
  local r = {}
  for _, rec in ipairs(gp.data.jsonl(path)) do if rec.loss and rec.step then r[rec.step] = rec.loss end end
  return r
end

local function same_losses(full, part, from, to, what)
  for s = from, to do
    T.ok(part[s] ~= nil, string.format('%s: step %d is missing', what, s))
    T.ok(full[s] == part[s], string.format('%s: step %d: %.17g in one go, %.17g resumed', what, s, full[s] or 0 / 0,
      part[s] or 0 / 0))
  end
end

local TINY = '--device cpu --n-embd 32 --n-layer 1 --n-head 2 --block 16 --batch 4 --eval-every 5 --eval-iters 2 ' ..
             '--log-every 1 --dropout 0.1 --quiet'

-- --fused-loss on trains through model:loss (gp.linear_cross_entropy): the
-- same losses as model(x, y) within f32 rounding; off, and auto at a small
-- vocabulary, through model(x, y); a bad value is an error
T.test('train_gpt --fused-loss: model:loss gives model(x, y)\'s losses (cpu)', function()
  local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d)
  local script = root .. '/scripts/train_gpt.lua'
  local flags = TINY:gsub('%-%-dropout 0.1', '--dropout 0')
  local runs = {}
  for _, v in ipairs {'on', 'off', 'auto'} do
    local out, rc = sh(string.format('%s %s %s --iters 6 --fused-loss %s --log %s/%s.jsonl', exe, script, flags, v, d, v))
    T.eq(rc, 0, out)
    runs[v] = losses(d .. '/' .. v .. '.jsonl')
  end
  for s = 1, 6 do
    T.ok(runs.on[s] and math.abs(runs.on[s] - runs.off[s]) < 1e-4 * math.abs(runs.off[s]),
      string.format('step %d: %s fused, %s not', s, tostring(runs.on[s]), tostring(runs.off[s])))
    T.eq(runs.auto[s], runs.off[s], 'auto at a small vocabulary: model(x, y)')
  end
  local out, rc = sh(string.format('%s %s %s --iters 1 --fused-loss maybe', exe, script, flags))
  T.ok(rc ~= 0 and out:find('--fused-loss: on, off or auto', 1, true), out)
  os.execute('rm -rf ' .. d)
end)

T.test('train_gpt --resume: N steps in one go equal K steps, a checkpoint, then N-K resumed (bitwise, cpu)', function()
  local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d)
  local script = root .. '/scripts/train_gpt.lua'
  for _, extra in ipairs {'', '--bf16 --grad-accum 2'} do
    local out, rc = sh(string.format('%s %s %s %s --iters 12 --log %s/a.jsonl', exe, script, TINY, extra, d))
    T.eq(rc, 0, out)
    out, rc = sh(string.format('%s %s %s %s --iters 12 --log %s/b.jsonl --ckpt %s/b.ckpt --stop-after 7', exe, script,
      TINY, extra, d, d))
    T.eq(rc, 0, out)
    T.ok(out:find('stopped after step 7 of 12', 1, true), out)
    -- the resumed run takes its flags from the checkpoint
    out, rc = sh(string.format('%s %s --resume %s/b.ckpt --log %s/c.jsonl', exe, script, d, d))
    T.eq(rc, 0, out)
    T.ok(out:find('resumed from', 1, true), out)
    local a, b, c = losses(d .. '/a.jsonl'), losses(d .. '/b.jsonl'), losses(d .. '/c.jsonl')
    same_losses(a, b, 1, 7, 'first part ' .. extra)
    same_losses(a, c, 8, 12, 'resumed ' .. extra)
    T.eq(c[7], nil, 'the resumed run starts after step 7')
    -- the final evaluation (random batches: the generator's state came back too)
    local fa, fc = gp.data.jsonl(d .. '/a.jsonl'), gp.data.jsonl(d .. '/c.jsonl')
    T.eq(fa[#fa].val_loss, fc[#fc].val_loss, 'final val loss ' .. extra)
    os.execute(string.format('rm -f %s/*', d))
  end
  os.execute('rm -rf ' .. d)
end)

T.test('train_gpt killed with SIGKILL at a random moment: the last checkpoint loads and --resume continues it', function()
  local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d)
  local script = root .. '/scripts/train_gpt.lua'
  local flags = TINY .. ' --n-embd 64 --block 32 --iters 60'
  local out, rc = sh(string.format('%s %s %s --log %s/a.jsonl', exe, script, flags, d))
  T.eq(rc, 0, out)
  -- the same run with a checkpoint every step, killed once its log shows some progress
  math.randomseed(os.time())
  local pid = io.popen(string.format('%s %s %s --log %s/b.jsonl --ckpt %s/b.ckpt --ckpt-every 1 > %s/b.out 2>&1 & echo $!',
    exe, script, flags, d, d, d)):read('*l')
  local want = math.random(3, 40)
  for _ = 1, 1000 do
    local f = io.open(d .. '/b.jsonl')
    local n = 0
    if f then for _ in f:lines() do n = n + 1 end; f:close() end
    if n >= want then break end
    os.execute('sleep 0.01')
  end
  os.execute(string.format('sleep %.3f; kill -9 %s 2>/dev/null; sleep 0.1', math.random() * 0.05, pid))
  local _, meta = gp.load(d .. '/b.ckpt') -- whole, whatever the moment was
  local k = meta['gpush.train'].step
  T.ok(k >= 1 and k <= 60, 'checkpoint of step ' .. tostring(k))
  out, rc = sh(string.format('%s %s --resume %s/b.ckpt --log %s/c.jsonl', exe, script, d, d))
  T.eq(rc, 0, out)
  local a, c = losses(d .. '/a.jsonl'), losses(d .. '/c.jsonl')
  same_losses(a, c, k + 1, 60, string.format('resumed after step %d (killed at about %d)', k, want))
  os.execute('rm -rf ' .. d)
end)

T.test('gp.train.save_state / load_state: model, optimizer, step and generator state; a foreign file is refused', function()
  local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d)
  gp.manual_seed(5)
  local function make()
    local m = gp.nn.Linear(4, 3)
    return m, gp.optim.AdamW(m, {lr = 1e-2})
  end
  local function step(m, opt)
    opt:zero_grad()
    local x = gp.randn {2, 4}
    local loss = m(x):pow(2):mean()
    loss:backward()
    opt:step()
    return loss:item()
  end
  local m, opt = make()
  for _ = 1, 3 do step(m, opt) end
  gp.train.save_state(d .. '/s.ckpt', {model = m, optimizer = opt, step = 3, meta = {note = 'x'}})
  local want = {step(m, opt), step(m, opt)}
  local m2, opt2 = make()
  gp.manual_seed(99)
  local s, meta = gp.train.load_state(d .. '/s.ckpt', {model = m2, optimizer = opt2})
  T.eq(s, 3); T.eq(meta.note, 'x')
  T.eq(step(m2, opt2), want[1]); T.eq(step(m2, opt2), want[2])
  gp.save(d .. '/plain.st', m:state_dict())
  T.raises(function() gp.train.load_state(d .. '/plain.st', {model = m2, optimizer = opt2}) end, 'not a training checkpoint')
  -- the generator's state round-trips exactly, 64-bit values included
  local st = gp.rng_state()
  local r1 = gp.rand {5}:totable()
  gp.set_rng_state(st)
  T.same(gp.rand {5}:totable(), r1, 0)
  gp.set_rng_state {seed = '18446744073709551615', offset = '12345678901234567'}
  T.eq(gp.rng_state().seed, '18446744073709551615'); T.eq(gp.rng_state().offset, '12345678901234567')
  T.raises(function() gp.set_rng_state {seed = '18446744073709551616', offset = '0'} end, 'larger than')
  T.raises(function() gp.set_rng_state {seed = 'x', offset = '0'} end, 'decimal string')
  os.execute('rm -rf ' .. d)
end)

-- a GPT-2-style tokenizer directory (encoder.json: every byte's character,
-- a few merges; vocab.bpe) written on the spot, as `make models` lays out gpt2-tokenizer
local function gpt2_dir()
  local function utf8(cp)
    if cp < 0x80 then return string.char(cp) end
    return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64)
  end
  -- GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n
  local enc, n, id = {}, 0, 0
  local chars = {}
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174 and b <= 255)
    local cp = printable and b or 256 + n
    if not printable then n = n + 1 end
    chars[b] = utf8(cp)
  end
  for b = 0, 255 do enc[#enc + 1] = string.format('%q: %d', chars[b], id); id = id + 1 end
  local sp = chars[32] -- the space's character (U+0120)
  local merges = {sp .. ' t', sp .. 't h', sp .. 'th e', 't h', 'th e'}
  for _, m in ipairs(merges) do enc[#enc + 1] = string.format('%q: %d', (m:gsub(' ', '')), id); id = id + 1 end
  enc[#enc + 1] = string.format('"<|endoftext|>": %d', id)
  local d = os.tmpname(); os.remove(d)
  assert(os.execute('mkdir -p ' .. d) == 0)
  local f = assert(io.open(d .. '/encoder.json', 'w')); f:write('{', table.concat(enc, ', '), '}'); f:close()
  f = assert(io.open(d .. '/vocab.bpe', 'w')); f:write('#version: 0.2\n', table.concat(merges, '\n'), '\n'); f:close()
  return d, id + 1
end

T.test('gp.models.tokenizer on GPT-2 files, and train_gpt --tokenizer: BPE ids, the held-out loss per token and per byte', function()
  local d, V = gpt2_dir()
  local tok = gp.models.tokenizer(d)
  T.eq(tok.vocab_size, V)
  local ids = tok:encode('the the', {add_special_tokens = false})
  T.eq(#ids, 2, 'the, then " the" merged')
  T.eq(tok:decode(ids), 'the the')
  T.raises(function() gp.models.tokenizer(d .. '/missing') end, 'neither a short name')
  local out, rc = sh(string.format('%s %s/scripts/train_gpt.lua --device cpu --data corpus --tokenizer %s --iters 3 --n-embd 16' ..
    ' --n-layer 1 --n-head 2 --block 16 --batch 2 --eval-every 0 --eval-iters 1 --quiet', exe, root, d))
  T.eq(rc, 0, out)
  T.ok(out:find('vocab ' .. V, 1, true), out)
  T.ok(out:find('nats per token %([%d.]+ per byte%)'), out)
  os.execute('rm -rf ' .. d)
end)

T.test('train_gpt --config shakespeare: nanoGPT\'s shakespeare_char flags, command-line flags win; --tiny', function()
  local out, rc = sh(string.format('%s %s/scripts/train_gpt.lua --device cpu --data corpus --config shakespeare --iters 1' ..
    ' --n-layer 1 --block 16 --batch 2 --eval-iters 1 --quiet', exe, root))
  T.eq(rc, 0, out)
  T.ok(out:find('config shakespeare', 1, true), out)
  T.ok(out:find('n_layer 1, n_head 6, n_embd 384, block 16, batch 2 x 1 accum, 1 steps, lr 0.001', 1, true), out)
  T.ok(out:find('nanoGPT shakespeare reaches about 1.47', 1, true), out)
  out, rc = sh(string.format('%s %s/scripts/train_gpt.lua --device cpu --config nope', exe, root))
  T.ok(rc ~= 0 and out:find("unknown config 'nope'", 1, true), out)
end)
