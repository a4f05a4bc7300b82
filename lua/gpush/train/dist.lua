-- gp.dist: several processes, one GPU each (src/dist.c, src/launch.c).
--
--   gpush --nproc 2 train.lua            -- two ranks; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set
--   gp.dist.init()                       -- rendezvous at MASTER_ADDR:MASTER_PORT, then NCCL
--   gp.dist.allreduce(t, 'avg')          -- in place, queued on the current stream
--   local ddp = gp.dist.DDP(model)       -- broadcast rank 0's parameters; gradient buckets
--   loss:backward(); ddp:sync(); opt:step()
--
-- Ranks and roots are 0-based (as RANK is). Collectives dispatch on the
-- tensor's device: cuda tensors through NCCL (loaded at run time: gpush runs
-- where NCCL is absent, and only init{backend='nccl'} reports it), cpu
-- tensors over the TCP links of the rendezvous (backend 'tcp', or beside NCCL).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local dtype = require 'gpush.core.dtype'
local tensor = require 'gpush.core.tensor'
local stream = require 'gpush.core.stream'
local C, raise, is_tensor = rt.C, rt.raise, tensor.is_tensor

local doc = require('gpush.core.doc').doc
local M = {}
local gp = require 'gpush.core'

local OPS = {sum = 0, prod = 1, max = 2, min = 3, avg = 4, mean = 4}
local BACKENDS = {tcp = 0, nccl = 1}
local BACKEND_NAME = {[0] = 'tcp', 'nccl'}

local ib = ffi.new('int[3]')

local function env_int(name, default)
  local v = os.getenv(name)
  if v == nil or v == '' then return default end
  local n = tonumber(v)
  if not n or n ~= math.floor(n) then raise(string.format("dist: $%s is '%s', not an integer", name, v)) end
  return n
end

local function info()
  local on = C.gp_dist_info(ib, ib + 1, ib + 2) == 1
  return on, ib[0], ib[1], ib[2]
end

function M.is_initialized() return (info()) end
-- this process's rank and the number of ranks: from init, else the environment
function M.rank()
  local on, _, r = info()
  if on then return r end
  return env_int('RANK', 0)
end
function M.world_size()
  local on, _, _, w = info()
  if on then return w end
  return env_int('WORLD_SIZE', 1)
end
function M.local_rank() return env_int('LOCAL_RANK', 0) end
function M.backend()
  local on, b = info()
  return on and BACKEND_NAME[b] or nil
end
function M.is_main() return M.rank() == 0 end
-- true in a process started by gpush --nproc (or another launcher setting RANK)
function M.launched() return os.getenv('RANK') ~= nil and os.getenv('WORLD_SIZE') ~= nil end

-- NCCL's version code and file, or nil and why not
function M.nccl()
  local v = ffi.new('int[1]')
  local buf = ffi.new('char[512]')
  if C.gp_dist_nccl_load(v, buf, 512) ~= 0 then return nil, rt.last_error() end
  return v[0], ffi.string(buf)
end

-- opts: backend ('nccl' default; 'tcp': cpu tensors only), rank, world_size,
-- addr (MASTER_ADDR, default 127.0.0.1), port (MASTER_PORT, default 29500),
-- timeout (seconds for the rendezvous and each tcp collective; $GPUSH_DIST_TIMEOUT, 300)
function M.init(opts)
  opts = opts or {}
  if type(opts) ~= 'table' then raise("dist.init: options must be a table like {backend='nccl'}") end
  local bname = opts.backend or 'nccl'
  local backend = BACKENDS[bname]
  if not backend then raise(string.format("dist.init: unknown backend '%s' (nccl or tcp)", tostring(bname))) end
  local rank = opts.rank or env_int('RANK', 0)
  local world = opts.world_size or env_int('WORLD_SIZE', 1)
  local addr = opts.addr or os.getenv('MASTER_ADDR') or '127.0.0.1'
  local port = opts.port or env_int('MASTER_PORT', 29500)
  local timeout = opts.timeout or env_int('GPUSH_DIST_TIMEOUT', 300)
  if backend == 1 then
    local ok, why = M.nccl()
    if not ok then raise('dist.init: ' .. why:gsub('^dist: ', '') .. "; gp.dist.init{backend='tcp'} works on cpu tensors without it") end
    if not gp.cuda_available() then
      raise('dist.init: the nccl backend needs a CUDA GPU, and ' .. rt.last_error())
    end
    local lw = env_int('LOCAL_WORLD_SIZE', 0)
    local n = C.gp_cuda_device_count()
    if lw > n then
      raise(string.format('dist.init: %d processes on this node but only %d CUDA device%s visible (one GPU per process)', lw, n,
        n == 1 and ' is' or 's are'))
    end
  end
  rt.call(C.gp_dist_init, backend, rank, world, addr, port, timeout)
  return M
end

function M.destroy() rt.call(C.gp_dist_finalize) end

-- the 128 bytes rank 0 handed out at the rendezvous (NCCL's unique id), as a string
function M.uid()
  local b = ffi.new('uint8_t[128]')
  rt.call(C.gp_dist_uid, b)
  return ffi.string(b, 128)
end

local function need_init(op)
  if not M.is_initialized() then raise('dist.' .. op .. ': not initialized (call gp.dist.init() first)') end
end

local function tensor_arg(op, t, name)
  if not is_tensor(t) then raise(string.format('dist.%s: %s must be a tensor', op, name or 'the argument')) end
  if not t:is_contiguous() then raise(string.format('dist.%s: %s %s must be contiguous', op, name or 'the tensor', tensor.shape_str(t.shape))) end
end

local function op_of(op, name)
  local o = OPS[name or 'sum']
  if not o then raise(string.format("dist.%s: unknown reduction '%s' (sum, avg, max, min, prod)", op, tostring(name))) end
  return o
end

local function stream_of(opts)
  local s = opts and opts.stream
  if s == nil then return nil end
  if getmetatable(s) ~= stream.Stream then raise('dist: opts.stream must be a gp.stream()') end
  return s.h
end

-- in place on every rank: t = op over the ranks' t
function M.allreduce(t, op, opts)
  need_init('allreduce')
  tensor_arg('allreduce', t)
  rt.call(C.gp_dist_allreduce, t.c, op_of('allreduce', op), stream_of(opts))
  return t
end

-- in place: every rank gets rank root's t
function M.broadcast(t, root, opts)
  need_init('broadcast')
  tensor_arg('broadcast', t)
  root = root or 0
  if type(root) ~= 'number' or root ~= math.floor(root) then raise('dist.broadcast: root must be a rank number (0-based)') end
  rt.call(C.gp_dist_broadcast, t.c, root, stream_of(opts))
  return t
end

-- the ranks' t stacked along dim 1 in rank order: (world * n1, n2, ...)
function M.allgather(t, out, opts)
  need_init('allgather')
  tensor_arg('allgather', t, 'the input')
  if not is_tensor(out) then
    opts = opts or out
    local s = t.shape
    if #s == 0 then s = {1} end
    s[1] = s[1] * M.world_size()
    out = tensor.empty(s, t.dtype, t.device, 'allgather')
  end
  tensor_arg('allgather', out, 'out')
  rt.call(C.gp_dist_allgather, out.c, t.c, stream_of(opts))
  return out
end

-- op over the ranks' t, then this rank's part of dim 1: (n1 / world, n2, ...)
function M.reduce_scatter(t, op, out, opts)
  need_init('reduce_scatter')
  tensor_arg('reduce_scatter', t, 'the input')
  local w = M.world_size()
  if not is_tensor(out) then
    opts = opts or out
    local s = t.shape
    if #s == 0 or s[1] % w ~= 0 then
      raise(string.format('dist.reduce_scatter: dim 1 of the input %s must be a multiple of the world size %d', tensor.shape_str(t.shape), w))
    end
    s[1] = s[1] / w
    out = tensor.empty(s, t.dtype, t.device, 'reduce_scatter')
  end
  tensor_arg('reduce_scatter', out, 'out')
  rt.call(C.gp_dist_reduce_scatter, out.c, t.c, op_of('reduce_scatter', op), stream_of(opts))
  return out
end

-- every rank's queued GPU work is done and every rank got here
function M.barrier()
  need_init('barrier')
  gp.sync()
  rt.call(C.gp_dist_barrier)
end

-- fn() with its NCCL collectives fused in one group (ncclGroupStart/End)
function M.group(fn)
  need_init('group')
  rt.call(C.gp_dist_group, 1)
  local ok, err = pcall(fn)
  local rc = C.gp_dist_group(0)
  if not ok then error(err, 0) end
  if rc ~= 0 then raise(rt.last_error()) end
end

-- this rank's rows of a global batch: x:narrow(1, rank * n + 1, n), n = rows / world
function M.shard(x, dim)
  dim = dim or 1
  local w, r = M.world_size(), M.rank()
  if w == 1 then return x end
  local n = x:size(dim)
  if n % w ~= 0 then raise(string.format('dist.shard: dim %d of %s is not a multiple of the world size %d', dim, tensor.shape_str(x.shape), w)) end
  return x:narrow(dim, r * (n / w) + 1, n / w)
end

---------------------------------------------------------------------------
-- the launcher, from Lua: run argv (a script and its arguments) as nproc ranks

function M.launch(nproc, argv, opts)
  opts = opts or {}
  if type(nproc) ~= 'number' or nproc < 1 then raise('dist.launch: nproc must be a number >= 1') end
  if type(argv) ~= 'table' or #argv == 0 then raise('dist.launch: argv must be a list like {script, args...}') end
  local n = #argv + 1
  local a = ffi.new('const char *[?]', n)
  local keep = {}
  a[0] = 'gpush'
  for i, s in ipairs(argv) do keep[i] = tostring(s); a[i] = keep[i] end
  local code = ffi.new('int[1]')
  io.stdout:flush()
  rt.call(C.gp_dist_launch, code, nproc, opts.nnodes or 1, opts.node_rank or 0, opts.addr, opts.port or 0, n, a)
  return code[0]
end

-- The command line of this script for the launcher: gpush's options before
-- the script, the script, then its arguments without those `drop` names
-- (e.g. {nproc = true}: '--nproc 2' and '--nproc=2').
function M.script_argv(args, drop)
  args = args or rawget(_G, 'arg') or {}
  drop = drop or {}
  local lo = 0
  while args[lo - 1] ~= nil do lo = lo - 1 end
  local out = {}
  for i = lo + 1, 0 do out[#out + 1] = args[i] end
  local i = 1
  while args[i] ~= nil do
    local a = args[i]
    local name = a:match('^%-%-([^=]+)')
    if name and drop[name] then
      if not a:find('=', 1, true) then i = i + 1 end
    else
      out[#out + 1] = a
    end
    i = i + 1
  end
  return out
end

---------------------------------------------------------------------------
-- DDP: data-parallel gradients. Buckets of about bucket_mb (25) MB are made
-- from the parameters in reverse order (the order backward produces their
-- gradients), one dtype each. During loss:backward() a post-accumulate hook
-- marks a parameter done; when all of a bucket's are, its all-reduce (the
-- mean over ranks) is launched on a communication stream while backward goes
-- on, in bucket order on every rank. ddp:sync() launches what is left, makes
-- the current stream wait for the communication, and copies back.
--
-- A bucket whose gradients are adjacent in one buffer (the optimizer's flat
-- gradient buffer after opt:zero_grad()) is reduced in place; otherwise the
-- gradients are copied into a flat buffer of the bucket and back.

local DDP = {}
DDP.__index = DDP
M.DDP_class = DDP

local AVG = OPS.avg

function M.DDP(model, opts)
  opts = opts or {}
  local params = model
  if type(model) == 'table' and not is_tensor(model) and type(model.parameters) == 'function' then params = model:parameters() end
  if is_tensor(params) then params = {params} end
  if type(params) ~= 'table' or #params == 0 then raise('dist.DDP: needs a module or a list of parameter tensors') end
  local self = setmetatable({model = model, params = params, require_sync = true, overlap = opts.overlap ~= false,
                             bucket_bytes = (opts.bucket_mb or 25) * 1048576, buckets = {}, bucket_of = {},
                             world = M.world_size(), stats = {in_backward = 0, in_sync = 0, in_place = 0, copied = 0}}, DDP)
  if self.world > 1 then need_init('DDP') end
  for i, p in ipairs(params) do
    if not is_tensor(p) then raise(string.format('dist.DDP: parameter %d is a %s', i, type(p))) end
  end
  if self.world == 1 then return self end
  -- the same start everywhere: rank 0's parameters
  if opts.broadcast ~= false then
    for i, p in ipairs(params) do
      if not p:is_contiguous() then raise(string.format('dist.DDP: parameter %d is not contiguous', i)) end
    end
    -- cuda parameters in one NCCL group (one launch), cpu ones one by one over TCP
    local cuda = {}
    for _, p in ipairs(params) do
      if p.device == 'cuda' then cuda[#cuda + 1] = p else rt.call(C.gp_dist_broadcast, p.c, 0, nil) end
    end
    if #cuda > 0 then
      M.group(function()
        for _, p in ipairs(cuda) do rt.call(C.gp_dist_broadcast, p.c, 0, nil) end
      end)
    end
  end
  -- buckets, walking backwards; one open bucket per (device, dtype)
  local open = {}
  local function close(key)
    local b = open[key]
    if b then
      -- ascending parameter order inside (the layout of a flat gradient buffer)
      local ps = {}
      for j = #b.params, 1, -1 do ps[#ps + 1] = b.params[j] end
      b.params = ps
      self.buckets[#self.buckets + 1] = b
      b.index = #self.buckets
      open[key] = nil
    end
  end
  for i = #params, 1, -1 do
    local p = params[i]
    local key = p.device .. ':' .. p.dtype
    local b = open[key]
    if not b then
      b = {params = {}, n = 0, dtype = p.dtype, device = p.device}
      open[key] = b
    end
    b.params[#b.params + 1] = p
    b.n = b.n + p:numel()
    self.bucket_of[p] = b
    if b.n * dtype.ELSIZE[dtype.DT[p.dtype]] >= self.bucket_bytes then close(key) end
  end
  local keys = {}
  for k in pairs(open) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do close(k) end
  for _, b in ipairs(self.buckets) do
    b.offsets = {}
    local off = 0
    for j, p in ipairs(b.params) do b.offsets[j] = off; off = off + p:numel() end
    if b.device == 'cuda' then self.cuda = true end
  end
  if self.cuda then
    self.comm = stream.stream()
    self.ev_ready, self.ev_done = stream.event(), stream.event()
  end
  self:_reset()
  if self.overlap then
    local A = require 'gpush.core.autograd'
    self.hooks = {}
    local fn = function(p) self:_ready(p) end
    for _, p in ipairs(params) do self.hooks[#self.hooks + 1] = A.register_post_accumulate_hook(p, fn) end
  end
  return self
end

function DDP:__call(...) return self.model(...) end
function DDP:parameters() return self.params end

function DDP:_reset()
  for _, b in ipairs(self.buckets) do b.nready, b.launched = 0, false end
  self.done = {}
  self.next_launch = 1
  self.launched_any = false
end

-- a 1-D view over the bucket's gradients when they are adjacent in one buffer
local shp, std = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
local function flat_region(b)
  local gs = {}
  for j, p in ipairs(b.params) do
    local g = rawget(p, 'grad')
    if not is_tensor(g) then return nil end
    gs[j] = g
  end
  local c = b.cache
  if c then
    local same = true
    for j, g in ipairs(gs) do if c.grads[j] ~= g or c.cs[j] ~= g.c then same = false; break end end
    if same then return c.region end
  end
  local first = gs[1]
  local off = tonumber(first.c.offset)
  local region
  local ok = true
  for j, g in ipairs(gs) do
    if not g:is_contiguous() or g.dtype ~= b.dtype or g.device ~= b.device or C.gp_same_storage(g.c, first.c) ~= 1
      or tonumber(g.c.offset) ~= off then ok = false; break end
    off = off + g:numel()
  end
  if ok then
    region = gp.no_grad(function() return first:detach():view {first:numel()} end)
    shp[0], std[0] = b.n, 1
    if C.gp_as_strided(region.c, first.c, 1, shp, std, first.c.offset) ~= 0 then region = nil end
  end
  b.cache = {grads = gs, cs = {}, region = region or false}
  for j, g in ipairs(gs) do b.cache.cs[j] = g.c end
  return region or false
end

function DDP:_launch(b)
  local k = gp.k
  local region = flat_region(b)
  if not region then
    -- copy mode: gather the gradients into the bucket's own buffer
    if not b.buf then
      b.buf = tensor.empty({b.n}, b.dtype, b.device, 'DDP')
      b.slices = {}
      for j, p in ipairs(b.params) do b.slices[j] = b.buf:narrow(1, b.offsets[j] + 1, p:numel()) end
    end
    gp.no_grad(function()
      for j, p in ipairs(b.params) do
        local g = rawget(p, 'grad')
        if not is_tensor(g) then
          g = gp.zeros_like(p)
          rawset(p, 'grad', g)
        end
        k.copy(b.slices[j]:view(g.shape), g)
      end
    end)
    region = b.buf
    b.copy_back = true
    self.stats.copied = self.stats.copied + 1
  else
    b.copy_back = false
    self.stats.in_place = self.stats.in_place + 1
  end
  if b.device == 'cuda' then
    -- the communication stream starts after the work queued so far
    stream.current():record(self.ev_ready)
    self.comm:wait(self.ev_ready)
    rt.call(C.gp_dist_allreduce, region.c, AVG, self.comm.h)
  else
    rt.call(C.gp_dist_allreduce, region.c, AVG, nil)
  end
  b.launched = true
  self.launched_any = true
end

-- launch the ready buckets in bucket order (the same order on every rank)
function DDP:_launch_ready()
  while self.next_launch <= #self.buckets do
    local b = self.buckets[self.next_launch]
    if b.nready < #b.params then return end
    self:_launch(b)
    self.stats.in_backward = self.stats.in_backward + 1
    self.next_launch = self.next_launch + 1
  end
end

function DDP:_ready(p)
  if not self.require_sync then return end
  local b = self.bucket_of[p]
  if not b then return end
  if self.done[p] then
    if b.launched then
      raise('dist.DDP: a gradient was accumulated after its bucket was all-reduced; run the earlier backward passes '
        .. 'of gradient accumulation inside ddp:no_sync(fn) and call ddp:sync() after the last')
    end
    return
  end
  self.done[p] = true
  b.nready = b.nready + 1
  if b.nready == #b.params then self:_launch_ready() end
end

-- after the (last) backward of a step: every gradient is the mean over ranks
function DDP:sync()
  if self.world == 1 then return end
  while self.next_launch <= #self.buckets do
    self:_launch(self.buckets[self.next_launch])
    self.stats.in_sync = self.stats.in_sync + 1
    self.next_launch = self.next_launch + 1
  end
  if self.cuda then
    self.comm:record(self.ev_done)
    stream.current():wait(self.ev_done)
  end
  local k = gp.k
  gp.no_grad(function()
    for _, b in ipairs(self.buckets) do
      if b.copy_back then
        for j, p in ipairs(b.params) do
          local g = rawget(p, 'grad')
          k.copy(g, b.slices[j]:view(g.shape))
        end
      end
    end
  end)
  self:_reset()
end

-- fn() without gradient synchronization (the first micro-batches of accumulation)
function DDP:no_sync(fn)
  local prev = self.require_sync
  self.require_sync = false
  local ok, err = pcall(fn)
  self.require_sync = prev
  if not ok then error(err, 0) end
end

function DDP:remove_hooks()
  for _, h in ipairs(self.hooks or {}) do h.remove() end
  self.hooks = nil
end

function DDP:__tostring()
  return string.format('gp.dist.DDP(%d parameters, %d buckets, world %d%s)', #self.params, #self.buckets, self.world,
    self.overlap and ', overlapped with backward' or '')
end

do
  local D = M
  doc(D.init, "gp.dist.init{backend='nccl'|'tcp', rank=, world_size=, addr=, port=, timeout=300}",
    'join the process group: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment (gpush --nproc sets them); rank 0 listens, the others connect and get the NCCL id; tcp: cpu tensors only, no NCCL needed')
  doc(D.destroy, 'gp.dist.destroy()', 'leave the process group (NCCL communicator and sockets)')
  doc(D.is_initialized, 'gp.dist.is_initialized()', 'true after M.init()')
  doc(D.rank, 'gp.dist.rank()', 'this process rank, 0-based (from init, else $RANK, else 0)')
  doc(D.world_size, 'gp.dist.world_size()', 'the number of ranks (from init, else $WORLD_SIZE, else 1)')
  doc(D.local_rank, 'gp.dist.local_rank()', 'the rank on this node ($LOCAL_RANK); it picks the GPU')
  doc(D.backend, 'gp.dist.backend()', "'nccl', 'tcp', or nil before init")
  doc(D.is_main, 'gp.dist.is_main()', 'true on rank 0 (the one that logs and saves)')
  doc(D.launched, 'gp.dist.launched()', 'true in a process started by gpush --nproc (RANK and WORLD_SIZE set)')
  doc(D.nccl, 'gp.dist.nccl()', "NCCL's version code and file, or nil and why it cannot be loaded ($GP_NCCL_LIB overrides the path)")
  doc(D.uid, 'gp.dist.uid()', 'the 128 bytes rank 0 handed out at the rendezvous (the NCCL unique id), as a string')
  doc(D.allreduce, "gp.dist.allreduce(t, 'sum'|'avg'|'max'|'min'|'prod', {stream=})", 'in place over the ranks; cuda: NCCL on the current stream, cpu: over TCP')
  doc(D.broadcast, 'gp.dist.broadcast(t, root=0, {stream=})', "in place: every rank gets rank root's t")
  doc(D.allgather, 'gp.dist.allgather(t[, out], {stream=})', "the ranks' t concatenated along dim 1 in rank order")
  doc(D.reduce_scatter, "gp.dist.reduce_scatter(t, 'sum'[, out], {stream=})", "the reduction over ranks, then this rank's 1/world part of dim 1")
  doc(D.barrier, 'gp.dist.barrier()', "wait for this rank's GPU work, then for every rank to get here")
  doc(D.group, 'gp.dist.group(fn)', 'run fn with its NCCL collectives in one group (ncclGroupStart/End)')
  doc(D.shard, 'gp.dist.shard(x, dim=1)', "this rank's equal part of a global batch: rows rank*n+1 .. (rank+1)*n")
  doc(D.launch, 'gp.dist.launch(nproc, {script, args...}, {nnodes=, node_rank=, addr=, port=})', 'run a script as nproc ranks (gpush --nproc); returns the exit status')
  doc(D.script_argv, 'gp.dist.script_argv(arg, {nproc=true})', "this script's command line for M.launch, without the named flags")
  doc(D.DDP, 'gp.dist.DDP(model, {bucket_mb=25, overlap=true, broadcast=true})',
    "data parallel: rank 0's parameters everywhere; during backward the gradients are averaged over ranks in buckets (NCCL on a side stream); call ddp:sync() before opt:step()")
  doc(D.DDP_class.sync, 'ddp:sync()', 'after the last backward of a step: launch the remaining buckets and wait for them (grads are the mean over ranks)')
  doc(D.DDP_class.parameters, 'ddp:parameters()', 'the parameters it synchronizes')
  doc(D.DDP_class.remove_hooks, 'ddp:remove_hooks()', 'stop launching all-reduces from backward (ddp:sync() then does them all)')
  doc(D.DDP_class.no_sync, 'ddp:no_sync(fn)', 'run fn (forward and backward of a micro-batch) without synchronizing gradients')
end

return M
