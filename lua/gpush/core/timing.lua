-- gp.time: the median time of fn() after warm-up, from CUDA events queued on
-- the stream (a host clock on the CPU).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local DEV = require('gpush.core.dtype').DEV
local state = require('gpush.core.tensor').state
local C = rt.C

local M = {}
local box = ffi.new('gp_event*[1]')
local ms = ffi.new('double[1]')

local function event()
  rt.call(C.gp_event_create, box)
  return ffi.gc(box[0], C.gp_event_destroy)
end

-- opts: warmup (3), iters (20), device (gp.device()), min_ms (0: stop after iters)
function M.time(fn, opts)
  if type(fn) ~= 'function' then rt.raise('time: needs a function') end
  opts = opts or {}
  local dev = DEV[opts.device or state.device]
  if not dev then rt.raise('time: unknown device ' .. tostring(opts.device)) end
  for _ = 1, opts.warmup or 3 do fn() end
  local a, b = event(), event()
  local samples = {}
  local total, iters, min_ms = 0, opts.iters or 20, opts.min_ms or 0
  local i = 0
  while i < iters or total < min_ms do
    i = i + 1
    rt.call(C.gp_event_record, a, dev)
    fn()
    rt.call(C.gp_event_record, b, dev)
    rt.call(C.gp_event_elapsed, ms, a, b)
    samples[i] = ms[0]
    total = total + ms[0]
    if i >= 100000 then break end
  end
  table.sort(samples)
  local n = #samples
  local median = n % 2 == 1 and samples[(n + 1) / 2] or (samples[n / 2] + samples[n / 2 + 1]) / 2
  return median, {min = samples[1], max = samples[n], mean = total / n, n = n, samples = samples}
end

-- fn() once between two events: its milliseconds on the device (the host
-- clock on the CPU), then fn's results; waits for the second event only
local once_a, once_b
function M.time_once(fn, opts)
  if type(fn) ~= 'function' then rt.raise('time_once: needs a function') end
  local dev = DEV[(opts and opts.device) or state.device]
  if not dev then rt.raise('time_once: unknown device') end
  if not once_a then once_a, once_b = event(), event() end
  rt.call(C.gp_event_record, once_a, dev)
  local r = {fn()}
  rt.call(C.gp_event_record, once_b, dev)
  rt.call(C.gp_event_elapsed, ms, once_a, once_b)
  return ms[0], unpack(r)
end

return M
