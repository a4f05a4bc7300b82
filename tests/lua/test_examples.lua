-- Every examples/*.lua runs on the CPU (gpush --device cpu) and exits 0.
local T = require 'lib'

local function gpush_binary() return T.exe end

local root = GPUSH_ROOT or '.'
local files = {}
local ls = io.popen('ls "' .. root .. '"/examples/*.lua 2>/dev/null')
for f in ls:lines() do files[#files + 1] = f end
ls:close()
table.sort(files)

T.test('there are examples', function() T.ok(#files >= 6, #files .. ' examples') end)

for _, f in ipairs(files) do
  T.test('example ' .. f:match('[^/]*$') .. ' runs on the cpu', function()
    local log = os.tmpname()
    local cmd = string.format("'%s' --device cpu '%s' > '%s' 2>&1", gpush_binary(), f, log)
    local rc = os.execute(cmd)
    local h = io.open(log)
    local out = h and h:read('*a') or ''
    if h then h:close() end
    os.remove(log)
    T.ok(rc == 0 or rc == true, 'exit status ' .. tostring(rc) .. ':\n' .. out:sub(-2000))
  end)
end
