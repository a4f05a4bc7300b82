-- gp.dist: the launcher (gpush --nproc), the TCP rendezvous and cpu
-- collectives, post-accumulate hooks, data-parallel training (DDP), and,
-- with 2 GPUs, NCCL collectives against the CPU and the loss-curve
-- equivalence of 2 GPUs x B with 1 GPU x 2B.
local T = require 'lib'

local root = GPUSH_ROOT or '.'
local exe = T.exe
local here = root .. '/tests/lua'
local sh = T.sh

local function write(path, text)
  local f = assert(io.open(path, 'w'))
  f:write(text)
  f:close()
end

local function count(s, pat)
  local n = 0
  for _ in s:gmatch(pat) do n = n + 1 end
  return n
end

-- the losses of a JSONL training log, in step order
local function losses(path)
  local out = {}
  for _, rec in ipairs(gp.data.jsonl(path)) do
    if rec.loss and not rec.final then out[#out + 1] = rec.loss end
  end
  return out
end

local function two_gpus()
  T.cuda()
  if gp.C.gp_cuda_device_count() < 2 then T.skip('fewer than 2 GPUs') end
  if not gp.dist.nccl() then T.skip('NCCL cannot be loaded: ' .. select(2, gp.dist.nccl())) end
end

T.test('init without NCCL or without a GPU is a clear error; the rest works', function()
  local v, why = gp.dist.nccl()
  T.ok(v or why:find('NCCL is not available', 1, true), why)
  if gp.cuda_available() and v then T.skip('NCCL and a GPU are here') end
  local ok, err = pcall(gp.dist.init, {rank = 0, world_size = 1})
  T.ok(not ok)
  T.ok(err:find('dist.init:', 1, true) and (err:find('NCCL', 1, true) or err:find('CUDA GPU', 1, true)), err)
  T.ok(err:find("backend='tcp'", 1, true) or err:find('CUDA GPU', 1, true), err)
  T.eq(gp.dist.is_initialized(), false)
  T.eq((gp.ones {3} + 1):sum():item(), 6)
end)

T.test('collectives before init and bad arguments name the op', function()
  T.raises(function() gp.dist.allreduce(gp.zeros {2}) end, 'dist.allreduce: not initialized')
  T.raises(function() gp.dist.barrier() end, 'dist.barrier: not initialized')
  T.raises(function() gp.dist.init {backend = 'mpi'} end, "unknown backend 'mpi'")
  gp.dist.init {backend = 'tcp', rank = 0, world_size = 1}
  local ok, err = pcall(function()
    T.raises(function() gp.dist.init {backend = 'tcp', rank = 0, world_size = 1} end, 'already initialized')
    T.raises(function() gp.dist.allreduce(gp.zeros {2, 3}:t()) end, 'must be contiguous')
    T.raises(function() gp.dist.allreduce(gp.zeros {2}, 'median') end, "unknown reduction 'median'")
    T.raises(function() gp.dist.broadcast(gp.zeros {2}, 1) end, 'root 1 is not a rank')
    -- one rank: the identity
    local t = gp.tensor {1, 2, 3}
    gp.dist.allreduce(t, 'avg')
    T.same(t:totable(), {1, 2, 3})
    T.same(gp.dist.allgather(t):totable(), {1, 2, 3})
    T.same(gp.dist.reduce_scatter(t, 'sum'):totable(), {1, 2, 3})
    gp.dist.barrier()
    T.eq(gp.dist.backend(), 'tcp')
    T.eq(#gp.dist.uid(), 128)
  end)
  gp.dist.destroy()
  T.eq(gp.dist.is_initialized(), false)
  if not ok then error(err, 0) end
end)

T.test('post-accumulate hooks run once per leaf, after its last contribution', function()
  local w1 = gp.randn({3, 3}, {dtype = 'f64', device = 'cpu'}):requires_grad()
  local w2 = gp.randn({3, 3}, {dtype = 'f64', device = 'cpu'}):requires_grad()
  local seen = {}
  local h1 = gp.autograd_hook(w1, function(t) seen[#seen + 1] = {'w1', t.grad:clone()} end)
  local h2 = gp.autograd_hook(w2, function(t) seen[#seen + 1] = {'w2', t.grad:clone()} end)
  local x = gp.randn({2, 3}, {dtype = 'f64', device = 'cpu'})
  -- w1 is used first and last (tied), w2 in between
  local loss = (x:matmul(w1):matmul(w2):matmul(w1)):sum()
  loss:backward()
  T.eq(#seen, 2)
  T.eq(seen[1][1], 'w2')
  T.eq(seen[2][1], 'w1')
  T.ok(T.relnorm(seen[2][2], w1.grad) == 0, 'w1 hook saw its complete gradient')
  h1.remove(); h2.remove()
  loss = (x:matmul(w1)):sum()
  loss:backward()
  T.eq(#seen, 2)
end)

T.test('gpush --nproc: environment, rank prefixes, exit status', function()
  local out, rc = sh(exe .. [[ --nproc 2 -e 'print(os.getenv("RANK"), os.getenv("WORLD_SIZE"), os.getenv("LOCAL_RANK"), os.getenv("NCCL_NVLS_ENABLE"), gp.dist.world_size(), gp.dist.rank())']])
  T.eq(rc, 0, out)
  T.ok(out:find('[0] 0\t2\t0\t0\t2\t0\n', 1, true), out)
  T.ok(out:find('[1] 1\t2\t1\t0\t2\t1\n', 1, true), out)
  out, rc = sh('NCCL_NVLS_ENABLE=1 ' .. exe .. [[ --nproc 2 -e 'io.write(os.getenv("NCCL_NVLS_ENABLE"), "\n")']])
  T.eq(rc, 0)
  T.eq(count(out, '%] 1\n'), 2, out)
  out, rc = sh(exe .. ' --nproc 0 -e 1')
  T.ok(rc ~= 0 and out:find('--nproc must be in 1..1024', 1, true), out)
end)

T.test('a failing rank stops the others and the launcher exits non-zero', function()
  local script = os.tmpname()
  write(script, [[
if os.getenv('RANK') == '1' then error('rank one fails') end
print('rank 0 waits')
os.execute('sleep 30')
print('rank 0 finished')
]])
  local t0 = gp.train.now()
  local out, rc = sh(exe .. ' --nproc 2 ' .. script)
  local dt = gp.train.now() - t0
  os.remove(script)
  T.eq(rc, 1, out)
  T.ok(out:find('[1] gpush: ' .. script .. ':1: rank one fails', 1, true), out)
  T.ok(out:find('rank 1 exited with status 1; stopping the other ranks', 1, true), out)
  T.ok(not out:find('rank 0 finished', 1, true), out)
  T.ok(dt < 20, string.format('the launcher took %.1f s: rank 0 was not stopped', dt))
end)

T.test('rendezvous: a missing rank is a timeout naming it, not a hang', function()
  local port = 20000 + math.random(0, 20000)
  local out, rc = sh(string.format([[RANK=1 WORLD_SIZE=2 MASTER_PORT=%d GPUSH_DIST_TIMEOUT=1 %s -e "gp.dist.init{backend='tcp'}"]], port, exe))
  T.eq(rc, 1)
  T.ok(out:find('rank 1 timed out after 1 s connecting to rank 0 at 127.0.0.1:' .. port, 1, true), out)
  out, rc = sh(string.format([[RANK=0 WORLD_SIZE=3 MASTER_PORT=%d GPUSH_DIST_TIMEOUT=1 %s -e "gp.dist.init{backend='tcp'}"]], port, exe))
  T.eq(rc, 1)
  T.ok(out:find('2 of 2 ranks did not connect (rank 1 is missing', 1, true), out)
  out, rc = sh(string.format([[RANK=2 WORLD_SIZE=2 %s -e "gp.dist.init{backend='tcp'}"]], exe))
  T.ok(rc == 1 and out:find('RANK 2 is not in 0..1', 1, true), out)
end)

T.test('tcp backend: 3 ranks agree on the id; collectives of cpu tensors match the host', function()
  local out, rc = sh(exe .. ' --nproc 3 ' .. here .. '/dist_worker.lua cpu 1 7 1000')
  T.eq(rc, 0, out)
  T.eq(count(out, '%] done\n'), 3, out)
  T.eq(count(out, '%] ok mismatch\n'), 3, out)
  local ids = {}
  for id in out:gmatch('%] uid (%x+)\n') do ids[#ids + 1] = id end
  T.eq(#ids, 3, out)
  T.ok(ids[1] == ids[2] and ids[2] == ids[3], out)
end)

-- train_gpt twice: 1 rank with batch 2B and `nproc` ranks with batch B
local function equivalence(device, nproc, extra, tol)
  local cfg = string.format('--device %s --n-embd 32 --n-layer 2 --n-head 2 --block 16 --iters 6 --log-every 1 ' ..
    '--eval-every 3 --eval-iters 2 --lr 1e-2 --warmup 0 --seed 7 %s', device, extra or '')
  local l1, l2 = os.tmpname(), os.tmpname()
  local out, rc = sh(string.format('%s %s/scripts/train_gpt.lua %s --batch 4 --log %s', exe, root, cfg, l1))
  T.eq(rc, 0, out)
  out, rc = sh(string.format('%s %s/scripts/train_gpt.lua %s --batch %d --nproc %d --log %s', exe, root, cfg, 4 / nproc,
    nproc, l2))
  T.eq(rc, 0, out)
  T.ok(out:find('[0] final:', 1, true) and not out:find('[1] final:', 1, true), 'only rank 0 reports: ' .. out)
  local a, b = losses(l1), losses(l2)
  os.remove(l1); os.remove(l2)
  T.eq(#a, 6)
  T.eq(#b, 6)
  for i = 1, #a do
    T.ok(math.abs(a[i] - b[i]) <= tol * math.abs(a[i]),
      string.format('step %d: 1 rank x batch 4 loss %.7f, %d ranks loss %.7f', i, a[i], nproc, b[i]))
  end
  T.ok(a[6] < a[1], 'the loss goes down')
  return out
end

T.test('DDP on cpu: 2 ranks x batch 2 follow 1 rank x batch 4', function()
  local out = equivalence('cpu', 2, '--bucket-mb 0.004', 1e-5)
  -- small buckets: every one launched from the backward hooks, in place in the optimizer's gradient buffer
  local inb, ins = out:match('(%d+) bucket all%-reduces launched during backward, (%d+) at sync')
  T.ok(tonumber(inb) > 6 and tonumber(ins) == 0, out)
  -- gradient accumulation (no_sync on the first micro-batch)
  equivalence('cpu', 2, '--grad-accum 2', 1e-5)
end)

T.test('DDP copies gradients that are not in one buffer', function()
  local script = os.tmpname()
  write(script, [[
gp.set_device('cpu')
gp.dist.init{backend = 'tcp'}
gp.manual_seed(1 + gp.dist.rank())          -- different inits: DDP broadcasts rank 0's
local m = gp.nn.Linear(3, 2)
local ddp = gp.dist.DDP(m, {bucket_mb = 1e-5})
local x = gp.full({4, 3}, gp.dist.rank() + 1)
local loss = m(x):sum()
loss:backward()                              -- grads made by autograd: separate tensors
ddp:sync()
local w = m.weight:clone()
gp.dist.allreduce(w, 'max')
local same = (w - m.weight):abs():max():item() == 0
-- d loss / d W = sum over rows of x = 4 * (rank + 1) per element; the mean over 2 ranks is 6
print('grad', m.weight.grad:mean():item(), 'same params', same, 'copied', ddp.stats.copied)
]])
  local out, rc = sh(exe .. ' --nproc 2 ' .. script)
  os.remove(script)
  T.eq(rc, 0, out)
  T.eq(count(out, 'grad\t6\tsame params\ttrue\tcopied\t%d+\n'), 2, out)
end)

T.test('DDP with one process is a no-op', function()
  local m = gp.nn.Linear(3, 2, {device = 'cpu'})
  local ddp = gp.dist.DDP(m)
  local loss = m(gp.ones({1, 3}, {device = 'cpu'})):sum()
  loss:backward()
  ddp:sync()
  T.same(m.bias.grad:totable(), {1, 1})
end)

T.test('the scaling benchmark runs (cpu, tiny)', function()
  local out, rc = sh(exe .. ' ' .. root .. "/scripts/bench/dist.lua --n-embd 16 --n-layer 1 --n-head 2 --block 8 " ..
    "--batch 2 --iters 4 --log-every 2 --no-bf16 --model-flags '--device cpu'")
  T.eq(rc, 0, out)
  T.ok(out:find('"scaling":', 1, true) and out:find('scaling [%d.]+x'), out)
end)

T.test('NCCL: collectives of 2 GPUs against the CPU (f32, bf16; 1, 7, 1000003)', function()
  two_gpus()
  local out, rc = sh(exe .. ' --nproc 2 ' .. here .. '/dist_worker.lua cuda 1 7 1000003')
  T.eq(rc, 0, out)
  T.eq(count(out, '%] done\n'), 2, out)
end)

T.test('NCCL: train_gpt on 2 GPUs x batch 2 follows 1 GPU x batch 4', function()
  two_gpus()
  equivalence('cuda', 2, '', 2e-3)
end)
