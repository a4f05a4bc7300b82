-- The documentation beside the code: README.md stays short (at most 15 KB),
-- and every relative Markdown link in README.md, BENCHMARKS.md,
-- kernels/README.md and docs/*.md points to a file that exists (and, with a
-- #fragment, to a heading of that file). Links inside code blocks are not
-- links. docs/architecture.md and docs/api.md are checked when present.
local T = require 'lib'

local root = GPUSH_ROOT or '.'
local MAY_BE_ABSENT = {['docs/architecture.md'] = true, ['docs/api.md'] = true}

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
  for _, p in ipairs {'README.md', 'tensors.md', 'autograd-nn.md', 'kernels.md', 'attention.md', 'generation.md',
                      'training.md', 'experiments.md', 'benchmarks.md'} do
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
        if not body and not (target and MAY_BE_ABSENT[target]) then
          bad[#bad + 1] = f .. ': ' .. link .. ' (no file ' .. tostring(target) .. ')'
        elseif body and frag ~= '' and target:match('%.md$') and not anchors(body)[frag] then
          bad[#bad + 1] = f .. ': ' .. link .. ' (no heading #' .. frag .. ' in ' .. target .. ')'
        end
      end
    end
  end
  T.ok(#bad == 0, #bad .. ' broken links:\n  ' .. table.concat(bad, '\n  '))
end)
