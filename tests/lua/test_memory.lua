-- Memory: temporaries are collected, the cache bounds reserved memory, and
-- running out of memory is a clear error after one retry.
local T = require 'lib'
local gp = require 'gpush'

T.test('100,000 temporary 1 MB tensors keep memory bounded', function()
  local dev = gp.device()
  local m0 = gp.memory()
  for _ = 1, 100000 do
    gp.empty({262144}, {device = dev}) -- 1 MB of f32, garbage at once
  end
  local m = gp.memory()
  -- a full collection runs once the collector's floor of new tensors is
  -- allocated (256 MB, runtime.lua's GC_MIN; with device memory in use the
  -- floor follows the collections' cost up to GC_CAP, 4 GiB), so garbage stays
  -- under that plus what is live
  if dev == 'cuda' then
    local fl = require('gpush.core.runtime').gc_floor()
    T.ok(fl >= 256 * 1048576 and fl <= 4096 * 1048576, 'the floor ' .. fl)
    T.ok(m.reserved - m0.reserved < 4160 * 1048576, 'reserved grew by ' .. (m.reserved - m0.reserved))
    -- (up to the cap's 4,096 blocks come from cudaMalloc before the first collection frees any)
    T.ok(m.cache_hits - m0.cache_hits > 95000, 'the cache served the allocations: ' .. (m.cache_hits - m0.cache_hits))
    -- GPUSH_GC_PACE=0: the floor stays at 256 MB
    local f = os.tmpname()
    local h = assert(io.open(f, 'w'))
    h:write([[
local m0 = gp.memory()
for _ = 1, 20000 do gp.empty({262144}, {device = 'cuda'}) end
local m = gp.memory()
print(string.format('FLOOR %d GREW %d', require('gpush.core.runtime').gc_floor(), tonumber(m.reserved - m0.reserved)))
]])
    h:close()
    local out = T.sh('GPUSH_GC_PACE=0 ' .. T.exe .. ' ' .. f)
    os.remove(f)
    local fl0, grew = out:match('FLOOR (%d+) GREW (%-?%d+)')
    T.eq(tonumber(fl0), 256 * 1048576, out)
    T.ok(tonumber(grew) < 320 * 1048576, 'reserved grew by ' .. tostring(grew))
  else
    T.ok(m.host_peak < m0.host_peak + 320 * 1048576, 'host peak ' .. m.host_peak)
  end
end)

T.test('out of memory: a clear error with the stats, then recovery', function()
  local dev = gp.device()
  local keep = gp.ones({1024}, {device = dev})
  gp.set_memory_limit(64 * 1048576)
  local ok, err = pcall(function() return gp.empty({1024, 1024, 32}, {device = dev}) end) -- 128 MB
  gp.set_memory_limit(0)
  T.ok(not ok)
  T.ok(err:find('out of memory', 1, true), err)
  T.ok(err:find('memory:', 1, true), 'prints the stats: ' .. err)
  -- garbage is collected before giving up: 40 x 4 MB of garbage under a 64 MB cap
  gp.set_memory_limit(64 * 1048576)
  local ok2, err2 = pcall(function()
    for _ = 1, 40 do gp.empty({1048576}, {device = dev}) end
  end)
  gp.set_memory_limit(0)
  T.ok(ok2, err2)
  T.eq(keep:totable()[7], 1)
  T.same((keep + 1):narrow(1, 1, 2):totable(), {2, 2})
end)

T.test('memory stats', function()
  local m = gp.memory()
  for _, k in ipairs {'in_use', 'reserved', 'peak', 'allocs', 'cache_hits', 'fragmentation', 'host_in_use'} do
    T.ok(type(m[k]) == 'number', k)
  end
  T.ok(tostring(m):find('reserved', 1, true))
end)

T.test('gp.reset_peak_memory: the high-water marks start anew at what is in use', function()
  local dev = gp.device()
  gp.empty({4 * 1048576}, {device = dev}) -- 16 MB, garbage at once
  collectgarbage()
  collectgarbage()
  gp.reset_peak_memory()
  local m = gp.memory()
  T.eq(m.peak, m.in_use)
  T.eq(m.host_peak, m.host_in_use)
  local keep = gp.empty({262144}, {device = dev}) -- 1 MB
  local m2 = gp.memory()
  local used, peak = dev == 'cuda' and m2.in_use or m2.host_in_use, dev == 'cuda' and m2.peak or m2.host_peak
  T.eq(peak, used, 'the peak follows what is allocated after the reset')
  T.ok(used - (dev == 'cuda' and m.in_use or m.host_in_use) >= 1048576)
  T.eq(keep:numel(), 262144)
end)
