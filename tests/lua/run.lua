-- The Lua test runner: gpush tests/lua/run.lua [substring]
-- Runs every tests/lua/test_*.lua; prints a line per case and
-- 'N passed, N failed, N skipped' last; exits non-zero on any failure.
local root = (arg and arg[0] or 'tests/lua/run.lua'):match('^(.*)/[^/]*$') or '.'
package.path = root .. '/?.lua;' .. package.path
local T = require 'lib'
local filter = arg and arg[1]

local files = {}
for f in io.popen('ls "' .. root .. '"/test_*.lua 2>/dev/null'):lines() do files[#files + 1] = f end
table.sort(files)
for _, f in ipairs(files) do
  T.current_file = f:match('[^/]*$')
  local chunk, err = loadfile(f)
  if not chunk then
    T.test(T.current_file .. ' (load)', function() error(err) end)
  else
    chunk()
  end
end

local passed, failed, skipped = 0, 0, 0
local t0 = os.clock()
for _, c in ipairs(T.cases) do
  local full = c.file:gsub('%.lua$', '') .. ': ' .. c.name
  if not filter or full:find(filter, 1, true) then
    gp.manual_seed(1234)
    local ok, err = xpcall(c.fn, function(e)
      if type(e) == 'table' and e.skip then return e end
      return debug.traceback(tostring(e), 2)
    end)
    if ok then
      passed = passed + 1
      print('ok    ' .. full)
    elseif type(err) == 'table' and err.skip then
      skipped = skipped + 1
      print('skip  ' .. full .. ' (' .. err.skip .. ')')
    else
      failed = failed + 1
      print('FAIL  ' .. full .. '\n' .. err)
    end
    io.stdout:flush()
  end
end
print(string.format('lua tests: %.1f s of CPU', os.clock() - t0))
print(string.format('%d passed, %d failed, %d skipped', passed, failed, skipped))
io.stdout:flush()
-- then the work the GPU still owes (an asynchronous error of the last case)
-- and the finalizers of the cases' objects, each said before it is done: a
-- failure there is a failed run, and a process that dies there (under a
-- sanitizer, say) shows where it died
for _, step in ipairs {{'collecting garbage (finalizers)', function() collectgarbage('collect') end},
                       {'synchronizing the device', function() gp.sync() end}} do
  io.stdout:write('lua tests: after the last case: ', step[1], '\n')
  io.stdout:flush()
  local ok, err = pcall(step[2])
  if not ok then
    failed = failed + 1
    print('FAIL  (after the last case, ' .. step[1] .. ') ' .. tostring(err))
    print(string.format('%d passed, %d failed, %d skipped', passed, failed, skipped))
  end
end
io.stdout:flush()
if failed > 0 then os.exit(1) end
