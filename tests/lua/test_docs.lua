-- The docs beside the code: docs/api.md is what `make docs` generates from
-- the gp.doc records and the kernel registry.
local T = require 'lib'
local root = GPUSH_ROOT or '.'

local function read(path)
  local f = io.open(root .. '/' .. path, 'rb')
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  return s
end

T.test('docs/api.md is up to date (make docs regenerates it)', function()
  local want = require('gpush.tools.apidoc').markdown()
  local have = read('docs/api.md')
  T.ok(have, 'docs/api.md is missing: run make docs')
  if have ~= want then
    local i = 1
    while have:sub(i, i) == want:sub(i, i) do i = i + 1 end
    local line = select(2, have:sub(1, i):gsub('\n', '')) + 1
    T.ok(false, string.format('docs/api.md is stale from line %d: run make docs and commit it\n  file:      %s\n  generated: %s', line,
      have:match('([^\n]*)', have:sub(1, i):match('.*\n()') or 1), want:match('([^\n]*)', want:sub(1, i):match('.*\n()') or 1)))
  end
end)

T.test('docs/api.md lists every kernel and every documented gp function', function()
  local md = require('gpush.tools.apidoc').markdown()
  for _, k in ipairs(gp.kernels()) do T.ok(md:find('`gp.k.' .. k.name .. '(', 1, true), k.name) end
  for _, name in ipairs {'gp.zeros{2,3}', 'nn.Linear(', 'gp.optim.AdamW(', 'gp.polychromic.finetune(', 'm:parameters()', 't:sum('} do
    T.ok(md:find(name, 1, true), name)
  end
end)
