-- Streams and events. gp.stream() is a non-blocking CUDA stream;
-- gp.with_stream(s, fn) queues the kernels fn launches on s (entering waits
-- for the work already queued on the enclosing stream, so memory the caching
-- allocator hands out again is never touched early); events order streams:
-- local e = s:record(); other:wait(e). On the CPU backend streams and events
-- are no-ops and everything runs in order.
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local C = rt.C

local M = {}
local Stream = {}
Stream.__index = Stream
local Event = {}
Event.__index = Event
M.Stream, M.Event = Stream, Event

local box = ffi.new('void*[1]')
local ebox = ffi.new('gp_event*[1]')
local ms = ffi.new('double[1]')

local function cuda() return C.gp_cuda_available() == 1 end

function M.event()
  rt.call(C.gp_event_create, ebox)
  return setmetatable({e = ffi.gc(ebox[0], C.gp_event_destroy)}, Event)
end

local default
function M.default_stream()
  default = default or setmetatable({h = nil, name = 'default'}, Stream)
  return default
end

function M.stream()
  local s = setmetatable({name = 'stream'}, Stream)
  if cuda() then
    rt.call(C.gp_stream_create, box)
    s.h = ffi.gc(box[0], C.gp_stream_destroy)
  else
    s.cpu = true -- no-op stream: work runs in order
  end
  return s
end

local stack = {}
function M.current()
  return stack[#stack] or M.default_stream()
end

function M.with_stream(s, fn)
  if getmetatable(s) ~= Stream then rt.raise('with_stream: the first argument must be a gp.stream()') end
  if type(fn) ~= 'function' then rt.raise('with_stream: the second argument must be a function') end
  if not cuda() then return fn() end
  local prev = M.current()
  rt.call(C.gp_stream_set_current, s.h)
  stack[#stack + 1] = s
  local res = {pcall(fn)}
  stack[#stack] = nil
  local rc = C.gp_stream_set_current(prev.h)
  if not res[1] then error(res[2], 0) end
  if rc ~= 0 then rt.raise(rt.last_error()) end
  return unpack(res, 2, table.maxn(res))
end

-- record an event on the stream (a new one unless given); returns it
function Stream:record(ev)
  ev = ev or M.event()
  if getmetatable(ev) ~= Event then rt.raise('stream:record: expects a gp.event()') end
  rt.call(C.gp_event_record_stream, ev.e, self.h)
  return ev
end

-- work queued on this stream from now on waits for the event
function Stream:wait(ev)
  if getmetatable(ev) ~= Event then rt.raise('stream:wait: expects an event (from s:record())') end
  if self.cpu then return end
  rt.call(C.gp_event_wait, self.h, ev.e)
end

function Stream:synchronize() rt.call(C.gp_stream_synchronize, self.h) end
function Stream:query() return C.gp_stream_query(self.h) == 1 end
Stream.__tostring = function(s) return string.format('gp.stream(%s%s)', s.name, s.cpu and ', cpu: no-op' or '') end

function Event:synchronize() rt.call(C.gp_event_synchronize, self.e) end
function Event:query()
  local r = C.gp_event_query(self.e)
  if r < 0 then rt.raise(rt.last_error()) end
  return r == 1
end
-- milliseconds from this event to a later one
function Event:elapsed(later)
  if getmetatable(later) ~= Event then rt.raise('event:elapsed: expects another event') end
  rt.call(C.gp_event_elapsed, ms, self.e, later.e)
  return ms[0]
end
Event.__tostring = function() return 'gp.event' end

return M
