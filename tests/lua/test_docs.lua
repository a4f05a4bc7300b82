-- The documentation beside the code: README.md stays short (at most 15 KB),
-- and every relative Markdown link in README.md, BENCHMARKS.md,
-- kernels/README.md and docs/*.md points to a file that exists (and, with a
-- #fragment, to a heading of that file). Links inside code blocks are not
-- links. docs/api.md is what `make docs` generates from the gp.doc records
-- and the kernel registry.
local T = require 'lib'

local root = GPUSH_ROOT or '.'

local function read(path)
  local h = io.open(root .. '/' .. path)
  if not h then return nil end
  local s = h:read('*a')
  h:close()
  return s
end

local function without_code(s) return (s:gsub('\n```.-\n```', '\n')) end

-- a relative path joined to a directory, with . and .. resolved
local function join(dir, rel)
  local parts = {}
  for p in ((dir ~= '' and dir .. '/' or '') .. rel):gmatch('[^/]+') do
    if p == '..' then
      if #parts == 0 then return nil end
      parts[#parts] = nil
    elseif p ~= '.' then
      parts[#parts + 1] = p
    end
  end
  return table.concat(parts, '/')
end

-- GitHub's heading anchors: lower case, punctuation dropped, spaces to -
local function anchors(text)
  local out = {}
  for line in (without_code(text) .. '\n'):gmatch('([^\n]*)\n') do
    local h = line:match('^#+%s+(.-)%s*$')
    if h then out[(h:lower():gsub('[^%w%- _]', ''):gsub(' ', '-'))] = true end
  end
  return out
end

local files = {'README.md', 'BENCHMARKS.md', 'kernels/README.md'}
local ls = io.popen('ls "' .. root .. '"/docs/*.md 2>/dev/null')
for f in ls:lines() do files[#files + 1] = 'docs/' .. f:match('[^/]*$') end
ls:close()

T.test('README.md is at most 15 KB (15360 bytes)', function()
  local s = read('README.md')
  T.ok(s, 'README.md not found under ' .. root)
  T.ok(#s <= 15360, 'README.md has ' .. #s .. ' bytes')
end)

T.test('docs/ has its index and topic pages', function()
  for _, p in ipairs {'README.md', 'architecture.md', 'api.md', 'tensors.md', 'autograd-nn.md', 'kernels.md', 'attention.md', 'generation.md',
                      'training.md', 'experiments.md', 'benchmarks.md', 'models.md'} do
    T.ok(read('docs/' .. p), 'docs/' .. p .. ' is missing')
  end
end)

T.test('every relative link in the Markdown pages resolves', function()
  local bad = {}
  for _, f in ipairs(files) do
    local text = read(f)
    T.ok(text, f .. ' not found')
    local dir = f:match('^(.*)/[^/]*$') or ''
    for link in without_code(text):gmatch('%]%(([^)%s]+)%)') do
      if not link:match('^%a+://') and not link:match('^mailto:') then
        local path, frag = link:match('^([^#]*)#?(.*)$')
        local target = path == '' and f or join(dir, path)
        local body = target and read(target)
        if not body then
          bad[#bad + 1] = f .. ': ' .. link .. ' (no file ' .. tostring(target) .. ')'
        elseif body and frag ~= '' and target:match('%.md$') and not anchors(body)[frag] then
          bad[#bad + 1] = f .. ': ' .. link .. ' (no heading #' .. frag .. ' in ' .. target .. ')'
        end
      end
    end
  end
  T.ok(#bad == 0, #bad .. ' broken links:\n  ' .. table.concat(bad, '\n  '))
end)

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
