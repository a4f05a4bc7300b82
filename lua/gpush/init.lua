-- gpush: GPU tensors and every CUDA kernel as Lua functions.
-- `gp` is preloaded in scripts and the prompt; `local gp = require 'gpush'` also works.
local ffi = require 'ffi'
local core = require 'gpush.core'
local tensor = require 'gpush.tensor'
local C, raise = core.C, core.raise
local Tensor, is_tensor, empty, parse_shape = tensor.Tensor, tensor.is_tensor, tensor.empty, tensor.parse_shape

local gp = {Tensor = Tensor, is_tensor = is_tensor, C = C, ffi = ffi}
local docs = {}   -- function -> {usage, doc}
gp._docs = docs
local function doc(fn, usage, text) docs[fn] = {usage = usage, doc = text}; return fn end
gp.doc = doc

-- kernels: gp.k.NAME, and the short names the tensor methods use
local kernels = require 'gpush.kernels'
gp.k = {}
for _, k in ipairs(kernels.list) do
  gp.k[k.name] = k.fn
  tensor.K[k.name] = k.fn
  docs[k.fn] = {usage = kernels.usage(k), doc = k.doc, kernel = k}
end

---------------------------------------------------------------------------
-- devices, seeds, memory

local state = tensor.state
state.device = C.gp_cuda_available() == 1 and 'cuda' or 'cpu'

function gp.device() return state.device end
doc(gp.device, 'gp.device()', "the default device for new tensors: 'cuda' when a GPU is usable, else 'cpu'")

function gp.cuda_available() return C.gp_cuda_available() == 1 end
doc(gp.cuda_available, 'gp.cuda_available()', 'true when a CUDA GPU is usable')

function gp.set_device(name)
  if name ~= 'cpu' and name ~= 'cuda' then raise(string.format("set_device: unknown device '%s' (cpu or cuda)", tostring(name))) end
  if name == 'cuda' and C.gp_cuda_available() ~= 1 then
    raise('set_device: cuda asked for but ' .. core.last_error())
  end
  state.device = name
end
doc(gp.set_device, "gp.set_device('cpu'|'cuda')", 'set the default device for new tensors')

function gp.manual_seed(s)
  if type(s) ~= 'number' or s < 0 or s ~= math.floor(s) then raise('manual_seed: the seed must be a non-negative integer') end
  C.gp_manual_seed(s)
end
doc(gp.manual_seed, 'gp.manual_seed(n)', 'reseed the Philox generator: the same seed gives the same numbers on the same device')

function gp.memory()
  local s = core.memory_stats()
  return setmetatable(s, {__tostring = core.memory_summary})
end
doc(gp.memory, 'gp.memory()', 'allocator stats: in_use, reserved, peak, allocs, cache_hits, device_mallocs, frees, cached_blocks, largest_cached, fragmentation, pending_blocks/pending_bytes (held after stream use), host_in_use, host_peak')

function gp.empty_cache() C.gp_empty_cache() end
doc(gp.empty_cache, 'gp.empty_cache()', 'return cached device blocks to the driver')

function gp.set_memory_limit(bytes) core.call(C.gp_set_memory_limit, bytes or 0) end
doc(gp.set_memory_limit, 'gp.set_memory_limit(bytes)', 'soft cap on reserved device bytes and host tensor bytes (0: none)')

function gp.sync() core.call(C.gp_sync) end
doc(gp.sync, 'gp.sync()', 'wait for all queued GPU work')

gp.time = require('gpush.timing').time
gp.time_once = require('gpush.timing').time_once
doc(gp.time, 'gp.time(fn, {warmup=3, iters=20, min_ms=0})',
  'median milliseconds of fn() after warm-up, from CUDA events on the GPU (a host clock on the CPU); second result: min, max, mean, n, samples')
doc(gp.time_once, 'gp.time_once(fn)',
  "fn() once between two events: its milliseconds on the device (the host clock on the CPU), then fn's results (waits for fn's work only)")

---------------------------------------------------------------------------
-- profiling, streams, run-time compiled kernels

function gp.profile(fn, opts) return require('gpush.profile').profile(gp, fn, opts) end
doc(gp.profile, 'gp.profile(fn, {warmup=1, iters=1})',
  'run fn with every gp.k call timed by events: per kernel calls, total/mean us, % of time, GB/s, registers, occupancy (print it)')

local stream = require 'gpush.stream'
gp.stream = doc(stream.stream, 'gp.stream()', 'a new non-blocking CUDA stream (a no-op stream on the CPU); s:record(), s:wait(ev), s:synchronize(), s:query()')
gp.with_stream = doc(stream.with_stream, 'gp.with_stream(s, fn)', 'run fn with its kernels queued on stream s (s first waits for the work queued before); returns what fn returns')
gp.current_stream = doc(stream.current, 'gp.current_stream()', 'the stream kernels are queued on now')
gp.default_stream = doc(stream.default_stream, 'gp.default_stream()', "gpush's own stream, current outside gp.with_stream")
require('gpush.graph').bind(gp)
gp.event = doc(stream.event, 'gp.event()', 'an event to record on a stream: s:record(ev), other:wait(ev), ev:synchronize(), ev:query(), a:elapsed(b)')

do
  local rtc = require 'gpush.rtc'
  gp.rtc = {
    kernel = doc(rtc.kernel, "gp.rtc.kernel(src, name, {args={'ptr','int',...}, options={...}})",
      'compile CUDA C with NVRTC for this GPU (cached in memory and $GPUSH_CACHE or ~/.cache/gpush); call it as k(args..., {grid=, block=, shared=})'),
    map = doc(rtc.map, "gp.rtc.map('y = x > 0.f ? x : 0.f')", 'an elementwise f32 kernel over tensors named by the free names of the expression; m(x, ...) returns y'),
    compile = doc(rtc.compile, "gp.rtc.compile(src, name, {arch='sm_90'})", 'compile (or fetch from the caches) to a cubin: returns {code, lowered, log}, and memory|disk|compiled'),
    arch = doc(rtc.arch, 'gp.rtc.arch()', "the current GPU's architecture, e.g. 'sm_90'"),
    cache_dir = doc(rtc.cache_dir, 'gp.rtc.cache_dir()', 'where compiled kernels are cached on disk ($GPUSH_CACHE or ~/.cache/gpush)'),
    clear_memory_cache = doc(rtc.clear_memory_cache, 'gp.rtc.clear_memory_cache()', 'forget the compiled and loaded kernels held in memory'),
    stats = rtc.stats,
  }
end

function gp.version()
  local buf = ffi.new('char[512]')
  C.gp_runtime_info(buf, 512)
  return ffi.string(C.gp_version()), ffi.string(buf)
end
doc(gp.version, 'gp.version()', 'the gpush version and a line about the CUDA runtime, driver and GPU')

---------------------------------------------------------------------------
-- creation

local function opts_of(o, op)
  o = o or {}
  if type(o) ~= 'table' then raise(op .. ': options must be a table like {dtype=, device=}') end
  return o.dtype and core.dtype(o.dtype, op) or nil, o.device or state.device
end

-- nested Lua tables -> shape and row-major values
local function flatten(data, op)
  if type(data) == 'number' then return {}, {data} end
  if type(data) == 'boolean' then return {}, {data and 1 or 0} end
  if type(data) ~= 'table' then raise(op .. ': expected a number or a nested table of numbers, got ' .. type(data)) end
  local shape, d = {}, data
  while type(d) == 'table' do
    shape[#shape + 1] = #d
    d = d[1]
    if #shape > 8 then raise(op .. ': more than 8 levels of nesting') end
  end
  local vals = {}
  local function walk(x, depth, path)
    if depth > #shape then
      if type(x) == 'boolean' then x = x and 1 or 0 end
      if type(x) ~= 'number' then raise(string.format('%s: element %s is a %s, not a number', op, path, type(x))) end
      vals[#vals + 1] = x
      return
    end
    if type(x) ~= 'table' or #x ~= shape[depth] then
      raise(string.format('%s: ragged nested table: %s has %s entries, expected %d', op, path == '' and 'the table' or path,
        type(x) == 'table' and tostring(#x) or 'no', shape[depth]))
    end
    for i = 1, #x do walk(x[i], depth + 1, path .. '[' .. i .. ']') end
  end
  walk(data, 1, '')
  return shape, vals
end

local function from_values(shape, vals, dtype, device, op)
  local t = empty(shape, dtype, device, op)
  local n = #vals
  local buf = ffi.new('double[?]', n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = vals[i] end
  core.call(C.gp_from_doubles, t.c, buf, n)
  return t
end

function gp.tensor(data, opts)
  local dtype, device = opts_of(opts, 'tensor')
  if is_tensor(data) then return data:to {dtype = dtype, device = device}:clone() end
  local shape, vals = flatten(data, 'tensor')
  return from_values(shape, vals, dtype or 'f32', device, 'tensor')
end
doc(gp.tensor, "gp.tensor(data, {dtype='f32', device=gp.device()})", 'a tensor from a number or nested tables of numbers')

local function creator(name, fill)
  return function(...)
    local shape, o = parse_shape(name, ...)
    local dtype, device = opts_of(o, name)
    local t = empty(shape, dtype or 'f32', device, name)
    if fill then fill(t, o) end
    return t
  end
end
gp.empty = doc(creator('empty'), 'gp.empty{2,3}', 'an uninitialized tensor')
gp.zeros = doc(creator('zeros', function(t) gp.k.fill(t, 0) end), 'gp.zeros{2,3}', 'a tensor of zeros')
gp.ones = doc(creator('ones', function(t) gp.k.fill(t, 1) end), 'gp.ones{2,3}', 'a tensor of ones')
gp.rand = doc(creator('rand', function(t) gp.k.rand_uniform(t, 0, 1) end), 'gp.rand{2,3}', 'uniform in [0, 1)')
gp.randn = doc(creator('randn', function(t) gp.k.rand_normal(t, 0, 1) end), 'gp.randn{2,3}', 'standard normal')

function gp.full(shape, value, opts)
  if type(value) ~= 'number' then raise('full: the value must be a number') end
  local s = parse_shape('full', shape)
  local dtype, device = opts_of(opts, 'full')
  local t = empty(s, dtype or 'f32', device, 'full')
  gp.k.fill(t, value)
  return t
end
doc(gp.full, 'gp.full({2,3}, 7)', 'a tensor filled with a value')

function gp.randint(lo, hi, shape, opts)
  if type(lo) ~= 'number' or type(hi) ~= 'number' then raise('randint: usage gp.randint(lo, hi, {shape}) with integers lo < hi') end
  local s = parse_shape('randint', shape)
  local dtype, device = opts_of(opts, 'randint')
  local t = empty(s, dtype or 'i64', device, 'randint')
  gp.k.randint(t, lo, hi)
  return t
end
doc(gp.randint, 'gp.randint(lo, hi, {shape})', 'uniform integers in [lo, hi) (i64 unless a dtype is given)')

-- arange(n) = 0..n-1; arange(a, b[, step]) = a, a+step, ... < b
function gp.arange(a, b, step, opts)
  if type(b) == 'table' then opts, b = b, nil end
  if type(step) == 'table' then opts, step = step, nil end
  local start, stop = b and a or 0, b or a
  step = step or 1
  if type(start) ~= 'number' or type(stop) ~= 'number' or type(step) ~= 'number' or step == 0 then
    raise('arange: usage gp.arange(n) or gp.arange(start, stop[, step]) with step ~= 0')
  end
  local n = math.max(0, math.ceil((stop - start) / step))
  local dtype, device = opts_of(opts, 'arange')
  local int = start == math.floor(start) and step == math.floor(step)
  local vals = {}
  for i = 1, n do vals[i] = start + (i - 1) * step end
  return from_values({n}, vals, dtype or (int and 'i64' or 'f32'), device, 'arange')
end
doc(gp.arange, 'gp.arange(n) / gp.arange(start, stop, step)', 'evenly spaced values in [start, stop) (i64 for integer arguments)')

local function like(name, f)
  gp[name .. '_like'] = function(t)
    if not is_tensor(t) then raise(name .. '_like: needs a tensor') end
    return f(t.shape, {dtype = t.dtype, device = t.device})
  end
end
like('zeros', function(s, o) return gp.zeros(s, o) end)
like('ones', function(s, o) return gp.ones(s, o) end)
like('empty', function(s, o) return gp.empty(s, o) end)
like('rand', function(s, o) return gp.rand(s, o) end)
like('randn', function(s, o) return gp.randn(s, o) end)
gp.full_like = function(t, v) return gp.full(t.shape, v, {dtype = t.dtype, device = t.device}) end
for _, name in ipairs {'zeros', 'ones', 'empty', 'rand', 'randn'} do
  doc(gp[name .. '_like'], 'gp.' .. name .. '_like(t)', 'gp.' .. name .. ' with the shape, dtype and device of t')
end
doc(gp.full_like, 'gp.full_like(t, v)', 'gp.full with the shape, dtype and device of t')
doc(gp.is_tensor, 'gp.is_tensor(x)', 'true when x is a gp tensor')
doc(gp.doc, 'gp.doc(fn, usage, text)', 'register the doc that help(fn) prints; returns fn')

---------------------------------------------------------------------------
-- joining and selecting

function gp.cat(list, dim)
  if type(list) ~= 'table' or #list == 0 then raise('cat: needs a non-empty list of tensors') end
  dim = dim or 1
  local first = list[1]
  if not is_tensor(first) then raise('cat: element 1 is not a tensor') end
  local d0 = tensor.dim0(first, dim, 'cat')
  local shape, dt, total = first.shape, first.dtype, 0
  for i, t in ipairs(list) do
    if not is_tensor(t) then raise(string.format('cat: element %d is not a tensor', i)) end
    if t.device ~= first.device then
      raise(string.format('cat: element %d is on %s but element 1 is on %s', i, t.device, first.device))
    end
    local s = t.shape
    local ok = #s == #shape
    for k = 1, #s do if k ~= d0 + 1 and s[k] ~= shape[k] then ok = false end end
    if not ok then
      raise(string.format('cat: element %d is %s but element 1 is %s (dim %d may differ)', i, tensor.shape_str(s),
        tensor.shape_str(shape), d0 + 1))
    end
    dt = tensor.promote(dt, t.dtype)
    total = total + s[d0 + 1]
  end
  shape[d0 + 1] = total
  local out = empty(shape, dt, first.device, 'cat')
  local off = 1
  for _, t in ipairs(list) do
    local n = t:size(d0 + 1)
    if n > 0 then gp.k.copy(out:narrow(d0 + 1, off, n), t) end
    off = off + n
  end
  return out
end
doc(gp.cat, 'gp.cat({a, b}, dim)', 'join tensors along an existing dim')

function gp.stack(list, dim)
  if type(list) ~= 'table' or #list == 0 then raise('stack: needs a non-empty list of tensors') end
  dim = dim or 1
  local us = {}
  for i, t in ipairs(list) do
    if not is_tensor(t) then raise(string.format('stack: element %d is not a tensor', i)) end
    if i > 1 and tensor.shape_str(t.shape) ~= tensor.shape_str(list[1].shape) then
      raise(string.format('stack: element %d is %s but element 1 is %s', i, tensor.shape_str(t.shape),
        tensor.shape_str(list[1].shape)))
    end
    us[i] = t:unsqueeze(dim)
  end
  return gp.cat(us, dim)
end
doc(gp.stack, 'gp.stack({a, b}, dim)', 'join tensors along a new dim')

function gp.where(mask, a, b)
  if not is_tensor(mask) then raise('where: mask must be a tensor') end
  local dev = mask.device
  local dt = is_tensor(a) and (is_tensor(b) and tensor.promote(a.dtype, b.dtype) or a.dtype)
    or (is_tensor(b) and b.dtype or 'f32')
  local function as_t(x, name)
    if type(x) == 'number' then return gp.full({}, x, {dtype = dt, device = dev}) end
    if not is_tensor(x) then raise('where: ' .. name .. ' must be a tensor or a number') end
    if x.device ~= dev then raise(string.format('where: %s is on %s but mask is on %s', name, x.device, dev)) end
    return x:to(dt)
  end
  a, b = as_t(a, 'a'), as_t(b, 'b')
  if mask.dtype ~= 'u8' then mask = mask:ne(0) end
  local s = tensor.broadcast_shapes('where', tensor.broadcast_shapes('where', mask.shape, a.shape), b.shape)
  local out = empty(s, dt, dev, 'where')
  gp.k.where(out, mask, a, b)
  return out
end
doc(gp.where, 'gp.where(mask, a, b)', 'mask ? a : b elementwise (a, b tensors or numbers)')

---------------------------------------------------------------------------
-- op families: each lua/gpush/ops/<name>.lua returns function(gp, tensor)
-- that adds its tensor methods (tensor.Tensor) and gp functions
for _, name in ipairs {'index', 'loss', 'select', 'random', 'reduce', 'rows', 'fused', 'matmul', 'sample', 'attention', 'moe', 'titans', 'diversity'} do
  require('gpush.ops.' .. name)(gp, tensor)
end

---------------------------------------------------------------------------
-- checkpoints and JSON
local checkpoint = require 'gpush.checkpoint'
gp.save = doc(checkpoint.save, "gp.save('m.safetensors', {name = tensor, ...}, {step = 10, config = {...}})",
  'write tensors (moved to the cpu) and metadata in the safetensors format; atomic (a temporary file, then a rename)')
gp.load = doc(checkpoint.load, "gp.load('m.safetensors', {device = 'cuda'})",
  'read a safetensors file: returns {name = tensor}, metadata; every header entry is checked before reading')
gp.json = require 'gpush.json'
doc(gp.json.encode, 'gp.json.encode(value)', 'JSON text of a Lua value (tables with keys 1..n are arrays)')
doc(gp.json.decode, 'gp.json.decode(text)', 'a Lua value from JSON text (null is gp.json.null)')

---------------------------------------------------------------------------
-- autograd: wraps the differentiable methods and functions defined above
local autograd = require 'gpush.autograd'
autograd.install(gp)
gp.no_grad = doc(autograd.no_grad, 'gp.no_grad(fn, ...)', 'run fn(...) without recording operations for autograd')
gp.enable_grad = doc(autograd.enable_grad, 'gp.enable_grad(fn, ...)', 'run fn(...) with autograd recording (inside no_grad)')
gp.gradcheck = doc(autograd.gradcheck, 'gp.gradcheck(fn, {x, y, ...}, {eps=1e-6, atol=1e-5, rtol=1e-4})',
  'compare the gradients of fn at f64 CPU inputs with central differences; raises on a mismatch')

---------------------------------------------------------------------------
-- nn: modules (after autograd, which they rely on)
gp.nn = require('gpush.nn').bind(gp)
require('gpush.moe')(gp) -- nn.MoE
-- Titans memory and the MAC model (registers nn.NeuralMemory, nn.MACBlock, nn.SWABlock, nn.TitansLM)
gp.titans = require('gpush.titans').bind(gp)
gp.lora = require('gpush.lora').bind(gp) -- nn.LoRA and the adapter helpers
gp.polychromic = require('gpush.polychromic').bind(gp) -- set-level RL (scripts/polychromic.lua)

-- training: optimizers, data, command-line flags, progress and logs
gp.optim = require 'gpush.optim'
doc(gp.optim.AdamW, 'gp.optim.AdamW(params, {lr=3e-4, betas={0.9,0.95}, eps=1e-8, weight_decay=0.1, master_weights=true})',
  'AdamW over multi-tensor lists (one launch per group and grad dtype); weight decay only on params of dim >= 2; f32 master copies of bf16 params')
doc(gp.optim.SGD, 'gp.optim.SGD(params, {lr=0.01, momentum=0, nesterov=false, weight_decay=0})', 'SGD with momentum over multi-tensor lists')
doc(gp.optim.clip_grad_norm, 'gp.optim.clip_grad_norm(opt_or_params, max_norm)',
  'the global grad norm as a 0-dim device tensor; the clip factor is computed on the device and scales the next opt:step() (no host sync)')
doc(gp.optim.mixed_precision, "gp.optim.mixed_precision(model, {dtype='bf16'})", "the model's f32 parameters become bf16 in place (make the optimizer afterwards: it keeps f32 masters)")
doc(gp.optim.schedule.cosine, 'gp.optim.schedule.cosine{lr=, max_steps=, warmup=0, min_lr=0}', 'step -> lr: linear warmup, then cosine decay to min_lr')
doc(gp.optim.schedule.linear, 'gp.optim.schedule.linear{lr=, max_steps=, warmup=0, min_lr=0}', 'step -> lr: linear warmup, then linear decay to min_lr')
doc(gp.optim.schedule.warmup, 'gp.optim.schedule.warmup{lr=, warmup=}', 'step -> lr: linear warmup, then constant')
do
  local O = gp.optim.Optimizer
  doc(O.step, 'opt:step()', 'one optimizer step: one multi-tensor launch per bucket (group, decay, grad dtype, param dtype; it also writes bf16/f16 params from their f32 masters); uses the clip factor of clip_grad_norm')
  doc(O.zero_grad, 'opt:zero_grad({set_to_none=false})', "zero the grads in place (views of the optimizer's flat buffers: one fill per dtype, the lists stay valid)")
  doc(O.set_lr, 'opt:set_lr(lr)', "set every group's lr (times its lr_scale)")
  doc(O.capture, 'opt:capture(step_fn)', 'with device_hyper=true: gp.graph(step_fn) with this optimizer\'s step() launching on the device values that prepare_replay writes (the count is not advanced at the capture)')
  doc(O.prepare_replay, 'opt:prepare_replay()', 'with device_hyper=true: advance the step count and write this step\'s lr (and bias corrections) to the device, before replaying a captured step')
  doc(O.get_lr, 'opt:get_lr()', "the first group's lr")
  doc(O.state_dict, 'opt:state_dict()', "tensors {'exp_avg.i', 'exp_avg_sq.i', 'momentum_buffer.i', 'master.i'} and metadata {optimizer, step, groups}: gp.save(path, opt:state_dict())")
  doc(O.load_state_dict, 'opt:load_state_dict(tensors, meta)', 'restore a state_dict: opt:load_state_dict(gp.load(path))')
end
gp.data = require 'gpush.data'
doc(gp.data.Text.batch, "ds:batch('train'|'val', B, T)", 'x, y: (B, T) i64 on the device from random starts (y = x shifted by one); no host sync')
doc(gp.data.Text.encode, 'ds:encode(s)', 'a string -> a list of 0-based ids')
doc(gp.data.Text.decode, 'ds:decode(ids)', 'a list or tensor of ids -> a string')
doc(gp.data.read_file, 'gp.data.read_file(path)', 'the bytes of a file as a string')
doc(gp.data.write_jsonl, 'gp.data.write_jsonl(path, list)', 'write a list of values, one JSON line each')
doc(gp.data.text, "gp.data.text{path=FILE | text=STRING, vocab='present'|'bytes', val_fraction=0.1}",
  'a byte-level dataset: vocab_size, encode, decode, batch(split, B, T) -> x, y (i64 on the device), unigram_entropy')
doc(gp.data.facts_text, 'gp.data.facts_text{entities=1000, bytes=400000, seed=1}',
  'a synthetic encyclopedia: fixed facts about invented creatures in seeded sentences (a capacity test; moe.lua\'s default data)')
doc(gp.data.jsonl, 'gp.data.jsonl(path)', 'the values of a JSONL file as a list (a bad line is an error naming its line number)')
doc(gp.data.jsonl_lines, 'gp.data.jsonl_lines(path)', 'iterator over lineno, value of a JSONL file')
gp.args = require 'gpush.cli'
doc(gp.args.parse, "gp.args.parse(arg, {{'iters', 1000, 'help'}, ...}, {usage=})", 'script flags: --name value, --name=value, --flag, --no-flag, --help')
doc(gp.args.help, 'gp.args.help(spec, {usage=, description=})', 'the --help text of a flag spec')
gp.train = require 'gpush.train'
doc(gp.train.now, 'gp.train.now()', 'seconds on the host monotonic clock')
doc(gp.train.isatty, 'gp.train.isatty(fd)', 'true when the file descriptor (1: stdout) is a terminal')
doc(gp.train.logger, 'gp.train.logger{steps=, every=10, tokens_per_step=, file=}',
  'progress lines (\\r on a terminal) and a JSONL log; log:step(step, loss, lr) reads the loss only every `every` steps')

---------------------------------------------------------------------------
-- several processes: collectives, the launcher, data-parallel gradients
gp.dist = require 'gpush.dist'
do
  local D = gp.dist
  doc(D.init, "gp.dist.init{backend='nccl'|'tcp', rank=, world_size=, addr=, port=, timeout=300}",
    'join the process group: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment (gpush --nproc sets them); rank 0 listens, the others connect and get the NCCL id; tcp: cpu tensors only, no NCCL needed')
  doc(D.destroy, 'gp.dist.destroy()', 'leave the process group (NCCL communicator and sockets)')
  doc(D.is_initialized, 'gp.dist.is_initialized()', 'true after gp.dist.init()')
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
  doc(D.script_argv, 'gp.dist.script_argv(arg, {nproc=true})', "this script's command line for gp.dist.launch, without the named flags")
  doc(D.DDP, 'gp.dist.DDP(model, {bucket_mb=25, overlap=true, broadcast=true})',
    "data parallel: rank 0's parameters everywhere; during backward the gradients are averaged over ranks in buckets (NCCL on a side stream); call ddp:sync() before opt:step()")
  doc(D.DDP_class.sync, 'ddp:sync()', 'after the last backward of a step: launch the remaining buckets and wait for them (grads are the mean over ranks)')
  doc(D.DDP_class.parameters, 'ddp:parameters()', 'the parameters it synchronizes')
  doc(D.DDP_class.remove_hooks, 'ddp:remove_hooks()', 'stop launching all-reduces from backward (ddp:sync() then does them all)')
  doc(D.DDP_class.no_sync, 'ddp:no_sync(fn)', 'run fn (forward and backward of a micro-batch) without synchronizing gradients')
end
gp.autograd_hook = doc(autograd.register_post_accumulate_hook, 'gp.autograd_hook(t, fn)',
  "fn(t) runs in loss:backward() once t's gradient is complete; returns {remove = function}")

---------------------------------------------------------------------------
-- help

function gp.kernels()
  local lines = {}
  for _, k in ipairs(kernels.list) do
    lines[#lines + 1] = {name = k.name, family = k.family, usage = kernels.usage(k), doc = k.doc, signature = k.signature, spec = k.spec}
  end
  return setmetatable(lines, {__tostring = function(l)
    local out, fam = {}, nil
    for _, k in ipairs(l) do
      if k.family ~= fam then fam = k.family; out[#out + 1] = '-- ' .. fam end
      out[#out + 1] = string.format('  %-52s %s', k.usage, k.doc)
    end
    return table.concat(out, '\n')
  end})
end
doc(gp.kernels, 'gp.kernels()', 'every kernel with its arguments and one-line doc (print it)')

function gp.help(x)
  local d
  if x == nil then
    return print('gpush ' .. gp.version() .. [[

  help(f)            the doc of a gpush function, e.g. help(gp.k.add) or help(gp.zeros)
  print(gp.kernels()) every kernel: gp.k.NAME(outputs..., inputs..., scalars...)
  gp.tensor, gp.zeros, gp.ones, gp.full, gp.rand, gp.randn, gp.randint, gp.arange: creation
  t:to('cuda'), t:view{...}, t:transpose(1,2), a + b, a:exp(), ...: see README.md]])
  end
  if type(x) == 'string' then
    x = gp[x] or gp.k[x] or Tensor[x]
  end
  d = docs[x]
  if not d then
    for name, f in pairs(Tensor) do if f == x then d = docs[f] or {usage = 't:' .. name .. '(...)', doc = 'a tensor method (README.md)'} end end
  end
  if not d then return print('no gpush doc for ' .. tostring(x)) end
  local s = d.usage .. '\n  ' .. d.doc
  if d.kernel then s = s .. '\n  C: int gp_k_' .. d.kernel.name .. d.kernel.signature end
  print(s)
end
doc(gp.help, 'help(x) / gp.help(x)', "print the usage and doc of a gpush function, kernel or tensor method (x may be a name: help('zeros'))")

return gp
