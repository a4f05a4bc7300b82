-- gp.trace(fn): what the GPU ran while fn ran, from CUPTI's activity records
-- (src/trace.cu): every kernel, memset and memcpy with the GPU's own start and
-- end times. Unlike gp.profile (a pair of events around each gp.k call) it
-- sees cuBLAS's and NCCL's kernels and the nodes of CUDA graph replays, costs
-- nothing a call, and measures the idle time between kernels: the table a
-- step's optimization starts from.
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local C = rt.C

local M = {}
local KIND = {[0] = 'kernel', 'memset', 'memcpy'}

local function trunc(s, n) return #s > n and s:sub(1, n - 3) .. '...' or s end

-- recs: {name, start, finish (us, any origin), graph, kind, grid, block, regs, bytes}
-- -> the summary gp.trace returns (exposed for tests: M.summarize)
function M.summarize(recs, iters, ngaps)
  table.sort(recs, function(a, b) return a.start < b.start or (a.start == b.start and a.finish < b.finish) end)
  local by, list = {}, {}
  local busy, gaps, reach, last = 0, {}, nil, nil -- last: the activity that ended at reach
  for _, r in ipairs(recs) do
    local k = by[r.name]
    if not k then
      k = {name = r.name, kind = r.kind, calls = 0, total_us = 0, bytes = 0, grid = r.grid, block = r.block, regs = r.regs,
        graph_calls = 0}
      by[r.name] = k
      list[#list + 1] = k
    end
    local d = r.finish - r.start
    k.calls = k.calls + 1
    k.total_us = k.total_us + d
    k.bytes = k.bytes + (r.bytes or 0)
    if (r.graph or 0) ~= 0 then k.graph_calls = k.graph_calls + 1 end
    -- busy: the union of the intervals (kernels of two streams may overlap)
    if not reach or r.start >= reach then
      if reach and r.start > reach then gaps[#gaps + 1] = {us = r.start - reach, before = last.name, after = r.name} end
      busy = busy + d
      reach, last = r.finish, r
    elseif r.finish > reach then
      busy = busy + r.finish - reach
      reach, last = r.finish, r
    end
  end
  local wall = #recs > 0 and reach - recs[1].start or 0
  for _, k in ipairs(list) do
    k.mean_us = k.total_us / k.calls
    k.pct = busy > 0 and 100 * k.total_us / busy or 0
    k.gbps = k.bytes > 0 and k.total_us > 0 and k.bytes / (k.total_us * 1e3) or nil
  end
  table.sort(list, function(a, b) return a.total_us > b.total_us end)
  table.sort(gaps, function(a, b) return a.us > b.us end)
  local idle = wall - busy
  for i = (ngaps or 10) + 1, #gaps do gaps[i] = nil end
  iters = iters or 1
  return {iters = iters, calls = #recs, wall_us = wall, busy_us = busy, idle_us = idle,
    per_iter_us = wall / iters, kernels = list, by_name = by, gaps = gaps, records = recs}
end

local function fmt(t)
  local out = {string.format(
    'gp.trace: %d GPU activities over %d run(s): %.1f us first start to last end (%.1f a run), busy %.1f us, idle %.1f us (%.1f%%)',
    t.calls, t.iters, t.wall_us, t.per_iter_us, t.busy_us, t.idle_us, t.wall_us > 0 and 100 * t.idle_us / t.wall_us or 0)}
  local w = 22
  for _, k in ipairs(t.kernels) do w = math.max(w, math.min(#k.name, 96)) end
  local function pad(n) n = trunc(n, 96); return '  ' .. n .. string.rep(' ', w - #n) end
  out[#out + 1] = pad('kernel') .. string.format(' %7s %11s %10s %6s %7s %6s %5s', 'calls', 'total us', 'mean us',
    '%busy', 'grid', 'block', 'regs')
  for _, k in ipairs(t.kernels) do
    out[#out + 1] = pad(k.name) .. string.format(' %7d %11.1f %10.2f %6.1f %7s %6s %5s', k.calls, k.total_us, k.mean_us,
      k.pct, k.grid and k.grid > 0 and tostring(k.grid) or '-', k.block and k.block > 0 and tostring(k.block) or '-',
      k.regs and k.regs > 0 and tostring(k.regs) or '-')
  end
  if #t.gaps > 0 then
    out[#out + 1] = 'largest idle gaps:'
    for _, g in ipairs(t.gaps) do
      out[#out + 1] = string.format('  %8.2f us  after %s, before %s', g.us, trunc(g.before, 60), trunc(g.after, 60))
    end
  end
  return table.concat(out, '\n')
end

local rec = ffi.new('gp_trace_rec[1]')
local count = ffi.new('int64_t[1]')

-- opts: warmup (1), iters (1), gaps (10: how many of the largest idle gaps to keep)
function M.trace(fn, opts)
  if type(fn) ~= 'function' then rt.raise('trace: needs a function') end
  opts = opts or {}
  if type(opts) ~= 'table' then rt.raise('trace: options must be a table') end
  if not gp.cuda_available() then
    rt.raise('trace: needs a CUDA GPU (CUPTI records what the GPU ran; gp.profile times CPU kernels)')
  end
  for _ = 1, opts.warmup or 1 do fn() end
  gp.sync()
  rt.call(C.gp_trace_start)
  local iters = opts.iters or 1
  local ok, err = pcall(function() for _ = 1, iters do fn() end end)
  local stop_ok, stop_err = pcall(rt.call, C.gp_trace_stop, count)
  if not ok then error(err, 0) end
  if not stop_ok then error(stop_err, 0) end
  local recs = {}
  for i = 0, tonumber(count[0]) - 1 do
    rt.call(C.gp_trace_get, i, rec)
    local r = rec[0]
    recs[#recs + 1] = {name = ffi.string(r.name), start = tonumber(r.start) / 1e3, finish = tonumber(r['end']) / 1e3,
      graph = tonumber(r.graph), stream = tonumber(r.stream), kind = KIND[r.kind] or 'kernel', grid = r.grid,
      block = r.block, regs = r.regs, bytes = tonumber(r.bytes)}
  end
  local t = M.summarize(recs, iters, opts.gaps)
  local t0 = recs[1] and recs[1].start or 0
  for _, r in ipairs(recs) do r.start, r.finish = r.start - t0, r.finish - t0 end
  return setmetatable(t, {__tostring = fmt})
end

gp.doc(M.trace, 'gp.trace(fn, {warmup=1, iters=1, gaps=10})',
  'run fn iters times and list what the GPU ran, from CUPTI (libcupti; GPUSH_CUPTI names its file): per kernel (cuBLAS\'s and CUDA graph nodes included) calls, total/mean us, % of busy time, grid, block, registers; the wall (first start to last end), busy and idle time and the largest idle gaps (print it); .records holds every activity {name, start, finish (us from the first), graph, kind}')

return M
