-- device: the default device, seeds, memory, synchronization, timing, streams
-- and events, and the version line.
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local timing = require 'gpush.core.timing'
local stream = require 'gpush.core.stream'
local gp = require 'gpush.core.ns'
local doc = gp.doc
local C, raise = rt.C, rt.raise

---------------------------------------------------------------------------
-- devices, seeds, memory

local state = tensor.state
state.device = state.device or (C.gp_cuda_available() == 1 and 'cuda' or 'cpu')

function gp.device() return state.device end
doc(gp.device, 'gp.device()', "the default device for new tensors: 'cuda' when a GPU is usable, else 'cpu'")

function gp.cuda_available() return C.gp_cuda_available() == 1 end
doc(gp.cuda_available, 'gp.cuda_available()', 'true when a CUDA GPU is usable')

function gp.set_device(name)
  name = tensor.device_name(name, 'set_device')
  if name == 'cuda' and C.gp_cuda_available() ~= 1 then
    raise('set_device: cuda asked for but ' .. rt.last_error())
  end
  state.device = name
end
doc(gp.set_device, "gp.set_device('cpu'|'cuda')", "set the default device for new tensors ('cuda:N' names this process's GPU)")

function gp.manual_seed(s)
  if type(s) ~= 'number' or s < 0 or s ~= math.floor(s) or s >= 2^53 then
    raise('manual_seed: the seed must be an integer in [0, 2^53)')
  end
  C.gp_manual_seed(s)
end
doc(gp.manual_seed, 'gp.manual_seed(n)', 'reseed the Philox generator: the same seed gives the same numbers on the same device')

-- uint64 <-> decimal string, exactly (Lua numbers hold 53 bits)
local function u64_str(v) return (tostring(ffi.cast('uint64_t', v)):gsub('ULL$', '')) end
local function str_u64(s, what)
  if type(s) == 'number' and s >= 0 and s < 2^53 and s == math.floor(s) then return ffi.cast('uint64_t', s) end
  if type(s) ~= 'string' or not s:match('^%d+$') or #s > 20 then
    raise(string.format('set_rng_state: %s must be a decimal string (as gp.rng_state gives), got %s', what, tostring(s)))
  end
  if #s == 20 and s > '18446744073709551615' then raise('set_rng_state: ' .. what .. ' is larger than 2^64 - 1') end
  local v = ffi.new('uint64_t', 0)
  for i = 1, #s do v = v * 10 + (s:byte(i) - 48) end
  return v
end

function gp.rng_state()
  return {seed = u64_str(C.gp_seed()), offset = u64_str(C.gp_rng_offset())}
end
doc(gp.rng_state, 'gp.rng_state()',
  "the generator's state {seed=, offset=} (decimal strings, exact): save it with a checkpoint, restore it with gp.set_rng_state")

function gp.set_rng_state(st)
  if type(st) ~= 'table' then raise('set_rng_state: needs the table gp.rng_state() returned') end
  C.gp_set_rng_state(str_u64(st.seed, 'seed'), str_u64(st.offset, 'offset'))
end
doc(gp.set_rng_state, 'gp.set_rng_state{seed=, offset=}',
  'restore a state from gp.rng_state(): the numbers drawn next are those that followed it')

function gp.memory()
  local s = rt.memory_stats()
  return setmetatable(s, {__tostring = rt.memory_summary})
end
doc(gp.memory, 'gp.memory()', 'allocator stats: in_use, reserved, peak, allocs, cache_hits, device_mallocs, frees, cached_blocks, largest_cached, fragmentation, pending_blocks/pending_bytes (held after stream use), host_in_use, host_peak')

function gp.reset_peak_memory() C.gp_reset_peak_memory() end
doc(gp.reset_peak_memory, 'gp.reset_peak_memory()',
  "start the high-water marks anew: gp.memory().peak = in_use, host_peak = host_in_use (then peak - in_use is a step's transient bytes)")

function gp.empty_cache() C.gp_empty_cache() end
doc(gp.empty_cache, 'gp.empty_cache()', 'return cached device blocks to the driver')

function gp.set_memory_limit(bytes) rt.call(C.gp_set_memory_limit, bytes or 0) end
doc(gp.set_memory_limit, 'gp.set_memory_limit(bytes)', 'soft cap on reserved device bytes and host tensor bytes (0: none)')

function gp.sync() rt.call(C.gp_sync) end
doc(gp.sync, 'gp.sync()', 'wait for all queued GPU work')

gp.time = timing.time
gp.time_once = timing.time_once
doc(gp.time, 'gp.time(fn, {warmup=3, iters=20, min_ms=0})',
  'median milliseconds of fn() after warm-up, from CUDA events on the GPU (a host clock on the CPU); second result: min, max, mean, n, samples')
doc(gp.time_once, 'gp.time_once(fn)',
  "fn() once between two events: its milliseconds on the device (the host clock on the CPU), then fn's results (waits for fn's work only)")

---------------------------------------------------------------------------
-- profiling, streams, run-time compiled kernels

gp.stream = doc(stream.stream, 'gp.stream()', 'a new non-blocking CUDA stream (a no-op stream on the CPU); s:record(), s:wait(ev), s:synchronize(), s:query()')
gp.with_stream = doc(stream.with_stream, 'gp.with_stream(s, fn)', 'run fn with its kernels queued on stream s (s first waits for the work queued before); returns what fn returns')
gp.current_stream = doc(stream.current, 'gp.current_stream()', 'the stream kernels are queued on now')
gp.default_stream = doc(stream.default_stream, 'gp.default_stream()', "gpush's own stream, current outside gp.with_stream")
gp.event = doc(stream.event, 'gp.event()', 'an event to record on a stream: s:record(ev), other:wait(ev), ev:synchronize(), ev:query(), a:elapsed(b)')

function gp.version()
  local buf = ffi.new('char[512]')
  C.gp_runtime_info(buf, 512)
  return ffi.string(C.gp_version()), ffi.string(buf)
end
doc(gp.version, 'gp.version()', 'the gpush version and a line about the CUDA runtime, driver and GPU')

return gp
