-- gp.profile(fn): per-kernel calls, time, share, achieved bandwidth, registers
-- and theoretical occupancy. While profiling, every gp.k function (and the
-- tensor methods' kernel table) is replaced by a wrapper that records a pair
-- of events (CUDA events on the GPU, the host clock on the CPU) around the
-- call; afterwards the original functions are put back, so profiling costs
-- nothing when it is off.
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local dtype = require 'gpush.core.dtype'
local DEV = dtype.DEV
local C = rt.C

local M = {}
local info = ffi.new('gp_launch_info[1]')
local ms = ffi.new('double[1]')
local box = ffi.new('gp_event*[1]')

local pool, used = {}, 0
local function event()
  used = used + 1
  local e = pool[used]
  if not e then
    rt.call(C.gp_event_create, box)
    e = ffi.gc(box[0], C.gp_event_destroy)
    pool[used] = e
  end
  return e
end

-- bytes a tensor argument occupies: distinct elements (broadcast dims count once)
local function tensor_bytes(t)
  local c = t.c
  local n = 1
  for d = 0, c.ndim - 1 do
    if c.stride[d] ~= 0 then n = n * tonumber(c.shape[d]) end
  end
  return n * dtype.ELSIZE[c.dtype]
end

-- the shapes of a call's tensor arguments (a view's own), a 'T' after one whose last two
-- dims are transposed (columns contiguous), 'x' between them: the key of
-- gp.profile's {shapes = true}
local function signature(...)
  local mt, parts = tensor.mt, {}
  for i = 1, select('#', ...) do
    local x = select(i, ...)
    if getmetatable(x) == mt then
      local c, dims = x.c, {}
      for d = 0, c.ndim - 1 do dims[#dims + 1] = tostring(tonumber(c.shape[d])) end
      local n = c.ndim
      local t = n >= 2 and c.stride[n - 1] ~= 1 and c.stride[n - 2] == 1 and c.shape[n - 2] > 1 and 'T' or ''
      parts[#parts + 1] = table.concat(dims, 'x') .. t
    end
  end
  return table.concat(parts, ' ')
end

local function wrapper(name, f, rec, shapes)
  local mt = tensor.mt
  return function(...)
    local first = ...
    local dev = getmetatable(first) == mt and first.c.device or DEV[tensor.state.device]
    local a, b = event(), event()
    C.gp_last_launch(info) -- forget an earlier note
    rt.call(C.gp_event_record, a, dev)
    local r = f(...)
    rt.call(C.gp_event_record, b, dev)
    local bytes = 0
    for i = 1, select('#', ...) do
      local x = select(i, ...)
      if getmetatable(x) == mt then bytes = bytes + tensor_bytes(x) end
    end
    C.gp_last_launch(info)
    local l = info[0]
    rec[#rec + 1] = {name = shapes and name .. ' ' .. signature(...) or name, a = a, b = b, bytes = bytes,
      regs = l.fn ~= nil and l.regs or nil, block = l.fn ~= nil and l.block or nil,
      occupancy = l.fn ~= nil and l.occupancy or nil}
    return r
  end
end

local function fmt(p)
  local out = {string.format('gp.profile: %.3f ms total over %d run(s) on %s; %.3f ms in %d kernel calls (%.1f%%)',
    p.total_ms, p.iters, p.device, p.kernel_ms, p.calls, p.total_ms > 0 and 100 * p.kernel_ms / p.total_ms or 0)}
  local w = 22 -- the kernel column's width (string.format pads to 99 at most)
  for _, k in ipairs(p.kernels) do w = math.max(w, #k.name) end
  local function pad(n) return '  ' .. n .. string.rep(' ', w - #n) end
  out[#out + 1] = pad('kernel') ..
    string.format(' %7s %11s %10s %6s %9s %5s %6s', 'calls', 'total us', 'mean us', '%', 'GB/s', 'regs', 'occ')
  for _, k in ipairs(p.kernels) do
    out[#out + 1] = pad(k.name) .. string.format(' %7d %11.1f %10.2f %6.1f %9s %5s %6s', k.calls, k.total_us, k.mean_us,
      k.pct, k.gbps and string.format('%.1f', k.gbps) or '-', k.regs and tostring(k.regs) or '-',
      k.occupancy and string.format('%.0f%%', 100 * k.occupancy) or '-')
  end
  return table.concat(out, '\n')
end

-- opts: warmup (1), iters (1), device (gp.device()), shapes (false: one row a
-- kernel; true: one row a kernel and its arguments' shapes, see signature)
function M.profile(fn, opts)
  if type(fn) ~= 'function' then rt.raise('profile: needs a function') end
  opts = opts or {}
  if M.active then rt.raise('profile: already profiling (profile calls do not nest)') end
  local devname = opts.device or tensor.state.device
  local dev = DEV[devname]
  if not dev then rt.raise('profile: unknown device ' .. tostring(devname)) end
  for _ = 1, opts.warmup or 1 do fn() end
  gp.sync()
  local rec = {}
  local saved_k, saved_t = {}, {}
  for name, f in pairs(gp.k) do
    saved_k[name] = f
    gp.k[name] = wrapper(name, f, rec, opts.shapes)
  end
  for name, f in pairs(tensor.K) do
    saved_t[name] = f
    tensor.K[name] = gp.k[name] or wrapper(name, f, rec, opts.shapes)
  end
  M.active = true
  used = 0
  local iters = opts.iters or 1
  local ta, tb = event(), event()
  local ok, err = pcall(function()
    rt.call(C.gp_event_record, ta, dev)
    for _ = 1, iters do fn() end
    rt.call(C.gp_event_record, tb, dev)
  end)
  for name, f in pairs(saved_k) do gp.k[name] = f end
  for name, f in pairs(saved_t) do tensor.K[name] = f end
  M.active = false
  if not ok then error(err, 0) end
  gp.sync()
  rt.call(C.gp_event_elapsed, ms, ta, tb)
  local total_ms = ms[0]
  local by, list, kernel_ms = {}, {}, 0
  for _, r in ipairs(rec) do
    rt.call(C.gp_event_elapsed, ms, r.a, r.b)
    local k = by[r.name]
    if not k then
      k = {name = r.name, calls = 0, total_us = 0, bytes = 0}
      by[r.name] = k
      list[#list + 1] = k
    end
    k.calls = k.calls + 1
    k.total_us = k.total_us + ms[0] * 1e3
    k.bytes = k.bytes + r.bytes
    k.regs = k.regs or r.regs
    k.block = k.block or r.block
    k.occupancy = k.occupancy or r.occupancy
    kernel_ms = kernel_ms + ms[0]
  end
  for _, k in ipairs(list) do
    k.mean_us = k.total_us / k.calls
    k.pct = total_ms > 0 and 100 * k.total_us / 1e3 / total_ms or 0
    k.gbps = k.bytes > 0 and k.total_us > 0 and k.bytes / (k.total_us * 1e3) or nil
  end
  table.sort(list, function(x, y) return x.total_us > y.total_us end)
  local ncalls = #rec
  return setmetatable({total_ms = total_ms, kernel_ms = kernel_ms, per_iter_ms = total_ms / iters, iters = iters,
    calls = ncalls, device = devname, kernels = list, by_name = by}, {__tostring = fmt})
end

gp.doc(M.profile, 'gp.profile(fn, {warmup=1, iters=1, shapes=false})',
  'run fn with every gp.k call timed by events: per kernel calls, total/mean us, % of time, GB/s, registers, occupancy (print it); shapes = true: a row per kernel and argument shapes (a T after a transposed operand)')

return M
