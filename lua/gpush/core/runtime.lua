-- runtime: the bridge to the C ABI. Status codes become Lua errors that name
-- the op; out-of-memory is retried once after a full collection and emptying
-- the allocator cache; the collector is stepped in proportion to the bytes
-- that tensors hold outside the Lua heap.
local ffi = require 'ffi'
local C = require 'gpush.core.ffi'
local dtype = require 'gpush.core.dtype'

local M = {C = C, ffi = ffi}

-- The frame of the caller outside the gpush library, for error positions.
local function user_level()
  local level = 3
  while true do
    local info = debug.getinfo(level, 'S')
    if not info then return 0 end
    if not info.source:find('lua/gpush/', 1, true) and not info.source:find('^=gp%.k%.') and info.what ~= 'C' then return level - 1 end
    level = level + 1
  end
end

function M.raise(msg)
  error(msg, user_level())
end

-- the canonical name of a dtype spelling ('float' -> 'f32'), or an error naming op
function M.dtype(name, op)
  local d = dtype.ALIAS[name]
  if not d then
    M.raise(string.format("%s: unknown dtype '%s' (%s)", op or 'dtype', tostring(name), table.concat(dtype.names, ', ')))
  end
  return d
end
-- gpush's cache directory: $GPUSH_CACHE, else ~/.cache/gpush (compiled kernels, fetched models)
function M.cache_dir()
  local d = os.getenv('GPUSH_CACHE')
  if d and d ~= '' then return d end
  local home = os.getenv('HOME')
  return home and home .. '/.cache/gpush' or nil
end

local box_stats = ffi.new('gp_memstats[1]')
function M.memory_stats()
  C.gp_memory_stats(box_stats)
  local s = box_stats[0]
  local t = {}
  for _, k in ipairs {'in_use', 'reserved', 'peak', 'allocs', 'cache_hits', 'device_mallocs', 'frees', 'oom',
                      'cached_blocks', 'limit', 'host_in_use', 'host_peak', 'host_allocs', 'pending_blocks', 'pending_bytes',
                      'largest_cached'} do
    t[k] = tonumber(s[k])
  end
  t.fragmentation = t.reserved > 0 and (t.reserved - t.in_use) / t.reserved or 0
  return t
end

local function mib(b) return string.format('%.1f MiB', b / 1048576) end
function M.memory_summary(s)
  s = s or M.memory_stats()
  return string.format(
    'cuda: %s in use, %s reserved, %s peak, %d allocations (%d from the cache), %d cudaMalloc, %d cached blocks%s; cpu: %s in use, %s peak',
    mib(s.in_use), mib(s.reserved), mib(s.peak), s.allocs, s.cache_hits, s.device_mallocs, s.cached_blocks,
    (s.limit > 0 and (', limit ' .. mib(s.limit)) or '') ..
      (s.pending_blocks > 0 and string.format(', %d blocks (%s) held until a sync after stream use', s.pending_blocks,
        mib(s.pending_bytes)) or ''), mib(s.host_in_use), mib(s.host_peak))
end

function M.last_error() return ffi.string(C.gp_last_error()) end

-- A failed call: retry once after freeing what can be freed if it ran out of
-- memory, else raise the C message.
function M.fail(rc, f, ...)
  if rc == 2 then
    collectgarbage('collect')
    C.gp_empty_cache()
    rc = f(...)
    if rc == 0 then return end
    if rc == 2 then M.raise(M.last_error() .. '\n  memory: ' .. M.memory_summary()) end
  end
  M.raise(M.last_error())
end

-- call f(...) and raise on failure
function M.call(f, ...)
  local rc = f(...)
  if rc ~= 0 then M.fail(rc, f, ...) end
end

-- GC pacing: device and host tensor bytes are invisible to the Lua GC, so
-- tensors allocated since the last collection count as debt, and once the
-- debt reaches the bytes still held by live tensors after that collection
-- (at least the floor) a full collection runs: garbage tensors never hold
-- more than about as much again as the live ones (or the floor), and a
-- training step that allocates gigabytes pays for a few collections, not one
-- per allocation. The floor starts at GC_MIN; in a process that holds device
-- memory it follows what collections cost: one that took more than 5% of the
-- wall time since the previous one doubles it (up to GC_CAP), one under 1%
-- halves it. A large Lua heap (tokenizers' vocabularies, models' modules)
-- makes a full collection cost 10-37 ms, and with the fixed 256 MB floor an
-- eager step could spend a fifth of its time in them (BENCHMARKS.md,
-- 2026-11-30 (i)). GPUSH_GC_PACE=0 keeps the floor at GC_MIN.
local GC_MIN, GC_CAP = 256 * 1048576, 4096 * 1048576
local debt, budget, floor, last = 0, GC_MIN, GC_MIN, nil
local pace = os.getenv('GPUSH_GC_PACE') ~= '0'
local stats = ffi.new('gp_memstats')
function M.gc_account(bytes)
  debt = debt + bytes
  if debt >= budget then
    local t0 = C.gp_wall_ms()
    collectgarbage('collect')
    local t1 = C.gp_wall_ms()
    debt = 0
    C.gp_memory_stats(stats)
    if pace and stats.reserved > 0 and last then
      local d, w = t1 - t0, t0 - last
      if d > 0.05 * w then floor = math.min(GC_CAP, floor * 2)
      elseif d < 0.01 * w then floor = math.max(GC_MIN, floor / 2) end
    end
    last = t1
    budget = math.max(floor, tonumber(stats.in_use + stats.host_in_use))
  end
end
-- the collector's floor now (bytes): what gc_account lets garbage reach when few tensors are live
function M.gc_floor() return floor end

return M
