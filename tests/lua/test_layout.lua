-- The layout of lua/gpush (docs/architecture.md): the require graph has no
-- cycle and no upward edge, and no module reaches the gp facade.
local T = require 'lib'
local root = (GPUSH_ROOT or '.') .. '/lua'

-- which layers each layer may require (besides itself)
local MAY = {
  core = {},
  text = {core = true},
  nn = {core = true},
  models = {core = true, nn = true, text = true},
  train = {core = true, nn = true, text = true},
  experiments = {core = true, nn = true, models = true, train = true, text = true},
  tools = {core = true},
}
-- modules the gpush binary preloads from C (no Lua file)
local PRELOADED = {['gpush.core.cdef'] = true, ['gpush.core.json'] = true, ['gpush.tools.repl_c'] = true}

local function layer(mod)
  if mod == 'gpush' then return 'facade' end
  return mod:match('^gpush%.([%w_]+)')
end

-- every module of lua/gpush and the gpush modules it requires (anywhere in
-- the file: lazy requires count), with the lines that do it
local function graph()
  local mods = {}
  for path in io.popen('cd "' .. root .. '" && find gpush -name "*.lua" | sort'):lines() do
    local mod = path:gsub('%.lua$', ''):gsub('/init$', ''):gsub('/', '.')
    local src = assert(io.open(root .. '/' .. path)):read('*a')
    local deps, n = {}, 0
    for line in (src .. '\n'):gmatch('([^\n]*)\n') do
      n = n + 1
      local code = line:gsub('%-%-.*$', '')
      for dep in code:gmatch('require%s*%(?%s*[\'"](gpush[%w_.]*)[\'"]') do deps[#deps + 1] = {mod = dep, line = n} end
      T.ok(not code:find('require%s*%(?%s*[\'"]gpush%.[%w_.]*[\'"]%s*%.%.'),
        string.format('%s:%d builds a module name at run time; require each module by its name', path, n))
    end
    mods[mod] = {path = path, deps = deps}
  end
  return mods
end

-- the edges against the rules, as 'path:line: ...' lines
local function bad_edges(mods)
  local bad = {}
  for mod, m in pairs(mods) do
    local from = layer(mod)
    if from ~= 'facade' and not MAY[from] then bad[#bad + 1] = mod .. ' is in no known layer' end
    for _, d in ipairs(m.deps) do
      local where = string.format('%s:%d', m.path, d.line)
      if not mods[d.mod] and not PRELOADED[d.mod] then bad[#bad + 1] = where .. ' requires ' .. d.mod .. ', which does not exist' end
      local to = layer(d.mod)
      if from ~= 'facade' and to ~= from and not (MAY[from] or {})[to] then
        bad[#bad + 1] = string.format('%s: %s (%s) requires %s (%s)', where, mod, from, d.mod, to)
      end
    end
  end
  table.sort(bad)
  return bad
end

-- a cycle of the graph as 'a -> b -> a', or nil
local function find_cycle(mods)
  local state, stack = {}, {}
  local function visit(mod)
    if state[mod] == 'done' or not mods[mod] then return end
    stack[#stack + 1] = mod
    if state[mod] == 'open' then
      local i = #stack - 1
      while stack[i] ~= mod do i = i - 1 end
      return table.concat(stack, ' -> ', i)
    end
    state[mod] = 'open'
    for _, d in ipairs(mods[mod].deps) do
      local c = visit(d.mod)
      if c then return c end
    end
    state[mod] = 'done'
    stack[#stack] = nil
  end
  local names = {}
  for mod in pairs(mods) do names[#names + 1] = mod end
  table.sort(names)
  for _, mod in ipairs(names) do
    local c = visit(mod)
    if c then return c end
  end
end

T.test('layout: every required gpush module exists; no upward edge, none to the facade', function()
  local bad = bad_edges(graph())
  T.ok(#bad == 0, 'edges against the layering:\n  ' .. table.concat(bad, '\n  '))
end)

T.test('layout: the require graph of lua/gpush has no cycle', function()
  local c = find_cycle(graph())
  T.ok(c == nil, 'a require cycle: ' .. tostring(c))
end)

T.test('layout: the checks find an upward edge, a missing module and a cycle', function()
  local function m(path, ...)
    local deps = {}
    for i, d in ipairs {...} do deps[i] = {mod = d, line = i} end
    return {path = path, deps = deps}
  end
  local mods = {
    ['gpush.core.a'] = m('gpush/core/a.lua', 'gpush.nn.b'),
    ['gpush.nn.b'] = m('gpush/nn/b.lua', 'gpush.core.a', 'gpush.nn.missing'),
    ['gpush.tools.c'] = m('gpush/tools/c.lua', 'gpush'),
  }
  local bad = table.concat(bad_edges(mods), '\n')
  T.ok(bad:find('gpush.core.a (core) requires gpush.nn.b (nn)', 1, true), bad)
  T.ok(bad:find('gpush.nn.missing, which does not exist', 1, true), bad)
  T.ok(bad:find('gpush.tools.c (tools) requires gpush (facade)', 1, true), bad)
  T.eq(find_cycle(mods), 'gpush.core.a -> gpush.nn.b -> gpush.core.a')
end)
