-- The interactive prompt: readline editing with persistent history
-- (~/.gpush_history, or $GPUSH_HISTORY), multi-line chunks while the input is
-- incomplete, expressions (and `=expr`) print their values (tensors
-- pretty-printed), `local x = ...` at the start of a line makes a session
-- global, tab completion of globals, fields and methods (t:tr<TAB>), Ctrl-C
-- stops running code (and drops the line at the prompt, history included),
-- errors print as stdin:LINE: message with the typed code's frames only (all
-- with gp.debug = true) and never leave the prompt.
-- The C half (readline, the SIGINT hook, the completion callback) is src/repl.c.
local M = {}

local keywords = {}
for w in ([[and break do else elseif end false for function goto if in local nil not or repeat return then true
until while]]):gmatch('%a+') do keywords[#keywords + 1] = w end

---------------------------------------------------------------------------
-- printing values

local function short(v, depth)
  local ty = type(v)
  if ty == 'string' then return string.format('%q', v) end
  if ty ~= 'table' then return tostring(v) end
  local mt = getmetatable(v)
  if mt and mt.__tostring then return tostring(v) end
  if depth > 1 then return tostring(v) end
  local parts, n = {}, 0
  for i = 1, #v do
    n = n + 1
    if n > 20 then parts[#parts + 1] = '...'; break end
    parts[#parts + 1] = short(v[i], depth + 1)
  end
  local keys = {}
  for k in pairs(v) do
    if not (type(k) == 'number' and k >= 1 and k <= #v and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do
    n = n + 1
    if n > 20 then parts[#parts + 1] = '...'; break end
    local ks = type(k) == 'string' and k:match('^[%a_][%w_]*$') and k or '[' .. short(k, 2) .. ']'
    parts[#parts + 1] = ks .. ' = ' .. short(v[k], depth + 1)
  end
  return '{' .. table.concat(parts, ', ') .. '}'
end
M.format = function(v) return short(v, 1) end

local function show(...)
  local n = select('#', ...)
  if n == 0 then return end
  local parts = {}
  for i = 1, n do parts[i] = short((select(i, ...)), 1) end
  print(table.concat(parts, '\t'))
end

---------------------------------------------------------------------------
-- compiling: as an expression first, then as statements; 'more' when incomplete

-- Locals persist between lines the way Torch's th keeps them: a chunk whose
-- first statement is `local x = ...` (or `local a, b = ...`, `local x`,
-- `local function f`) declares globals of the session instead; locals inside
-- blocks and functions stay local.
function M.rewrite_locals(src)
  local lead, rest = src:match('^(%s*)local%s+(.*)$')
  if not lead then return src end
  if rest:match('^function[%s(]') then return lead .. rest end
  local names, tail = rest:match('^([%a_][%w_]*[%w_%s,]*)(.*)$')
  if not names then return src end
  if tail:match('^=') then return lead .. rest end
  -- `local x` alone (maybe `; more`): x = nil
  names = names:gsub('%s+$', '')
  return lead .. names .. ' = nil ' .. tail
end

-- An expression is compiled inside a call, `return (function(...) return ...
-- end)(EXPR)`, so that the chunk's own frame stays on the stack while EXPR
-- runs (`return f(x)` would be a tail call): errors raised in gpush then
-- point at stdin:LINE like every other error typed at the prompt.
-- (text only: LuaJIT does not verify bytecode, which could crash the process)
local function compile(src)
  if src:sub(1, 1) == '=' then src = src:sub(2) end -- '=expr', as in Lua 5.1's prompt
  src = M.rewrite_locals(src)
  local f = load('return (function(...) return ... end)(' .. src .. '\n)', '=stdin', 't')
  if f then return f end
  local err
  f, err = load(src, '=stdin', 't')
  if f then return f end
  if err:find('<eof>', 1, true) then return nil, 'more' end
  return nil, err
end
M.compile = compile

---------------------------------------------------------------------------
-- completion

local function add_keys(set, t, want_fn, seen)
  seen = seen or {}
  if type(t) ~= 'table' or seen[t] then return end
  seen[t] = true
  for k, v in pairs(t) do
    if type(k) == 'string' and k:match('^[%a_][%w_]*$') and (not want_fn or type(v) == 'function') then set[k] = true end
  end
  local mt = getmetatable(t)
  if type(mt) == 'table' and type(mt.__index) == 'table' then add_keys(set, mt.__index, want_fn, seen) end
end

-- walk a.b.c from the globals without calling anything but __index of gp tensors
local function lookup(path)
  local v = _G
  for name in path:gmatch('[^%.]+') do
    if type(v) ~= 'table' then return nil end
    local ok, r = pcall(function() return v[name] end)
    if not ok then return nil end
    v = r
  end
  return v
end

-- the candidates for a word: 'gp.ze' -> {'gp.zeros', 'gp.zeros_like'}; 't:tr' -> {'t:transpose'}
function M.complete(word)
  local set = {}
  local head, sep, tail = word:match('^(.-)([%.:])([%w_]*)$')
  if head and head:match('^[%a_][%w_%.]*$') then
    local obj = lookup(head)
    local gp = rawget(_G, 'gp')
    if gp and gp.is_tensor and gp.is_tensor(obj) then
      add_keys(set, gp.Tensor, sep == ':')
      if sep == '.' then for _, f in ipairs {'shape', 'dtype', 'device', 'c'} do set[f] = true end end
    elseif type(obj) == 'table' then
      add_keys(set, obj, sep == ':')
    elseif type(obj) == 'string' then
      add_keys(set, string, sep == ':')
    else
      return {}
    end
  else
    if not word:match('^[%a_]?[%w_]*$') then return {} end
    head, sep, tail = '', '', word
    add_keys(set, _G)
    for _, k in ipairs(keywords) do set[k] = true end
  end
  local out = {}
  for k in pairs(set) do
    if k:sub(1, #tail) == tail then out[#out + 1] = head .. sep .. k end
  end
  table.sort(out)
  return out
end

---------------------------------------------------------------------------
-- the loop

local function history_path()
  local p = os.getenv('GPUSH_HISTORY')
  if p and p ~= '' then return p end
  local home = os.getenv('HOME')
  return home and home .. '/.gpush_history' or nil
end

-- run a compiled chunk: Ctrl-C raises 'interrupted' inside it. Code typed at
-- the prompt runs in the interpreter (jit.off) so that the hook can always
-- stop it: a JIT-compiled loop never looks at hooks.
-- gpush's own frames, C functions and the JIT's builtins: left out of
-- tracebacks unless gp.debug is set
local function internal_frame(line)
  return line:find('lua/gpush/', 1, true) or line:find('^%s*%[C%]:') or line:find('^%s*%[builtin#')
    or line:find('^%s*gp%.k%.') or line:find('^%s*%(tail call%)') or line:find('^%s*%.%.%.')
end

-- the message and the traceback of an error at the prompt: the frames of the
-- code typed (and of scripts), down to the prompt's own; gpush's frames too
-- with gp.debug = true; no traceback when only the typed line is left
function M.error_text(e, level)
  local msg
  if type(e) == 'string' or type(e) == 'number' then msg = tostring(e)
  else
    local mt = getmetatable(e)
    msg = (mt and mt.__tostring) and tostring(e) or '(error object is a ' .. type(e) .. ' value)'
  end
  -- Ctrl-C (src/repl.c's hook raises 'interrupted'): one word, after the ^C the terminal echoed
  if msg == 'interrupted' or msg:match('^[^\n]*:%d+: interrupted$') then return '\ninterrupted' end
  local gp = rawget(_G, 'gp')
  local full = type(gp) == 'table' and rawget(gp, 'debug')
  local tb = debug.traceback('', (level or 1) + 1)
  tb = tb:gsub('\n%s*%[C%]: in function \'xpcall\'.*$', '')
  local frames = {}
  for line in tb:gmatch('\n([^\n]*)') do
    if line ~= 'stack traceback:' and (full or not internal_frame(line)) then frames[#frames + 1] = line end
  end
  if #frames == 0 or (not full and #frames == 1 and frames[1]:find('^%s*stdin:%d+: in main chunk')) then return msg end
  return msg .. '\nstack traceback' .. (full and '' or ' (gp.debug = true shows gpush\'s frames too)') .. ':\n' ..
    table.concat(frames, '\n')
end

local function run_chunk(c, f)
  jit.off(f, true)
  if c then c.run_begin() end
  local res = {xpcall(f, function(e) return M.error_text(e, 2) end)}
  if c then c.run_end() end
  if res[1] then
    local ok, err = pcall(show, unpack(res, 2, table.maxn(res)))
    if not ok then print('(cannot print the value: ' .. tostring(err) .. ')') end
  else
    print(res[2])
  end
end

function M.run()
  local c = require 'gpush.tools.repl_c'
  local tty = c.isatty(0)
  local hist = tty and history_path()
  if tty then
    c.set_completer(M.complete)
    if hist then c.load_history(hist) end
    local gp = rawget(_G, 'gp')
    print('gpush ' .. (gp and gp.version() or '') .. '  (help() for help, Tab completes, Ctrl-D leaves)')
  end
  local function read(prompt)
    if tty then return c.readline(prompt) end
    io.write(prompt)
    io.flush()
    return io.read('*l')
  end
  while true do
    local line = read('gp> ')
    if line == nil then if tty then io.write('\n') end break end
    if line ~= false then
      local src = line
      local f, err = compile(src)
      local dropped = false
      while not f and err == 'more' do
        local more = read('>> ')
        -- Ctrl-C (false) drops the unfinished chunk, kept out of the history;
        -- the end of input (nil) ends it: its syntax error is printed
        if more == false then dropped = true; break end
        if more == nil then
          local _, e = loadstring(src, '=stdin')
          print(e)
          dropped = true
          break
        end
        src = src .. '\n' .. more
        f, err = compile(src)
      end
      if not dropped then
        if tty and src:find('%S') then
          local entry = src:find('--', 1, true) and src or src:gsub('\n', ' ')
          c.add_history(entry)
          if hist then c.append_history(hist) end
        end
        if f then
          run_chunk(tty and c or nil, f)
        elseif err ~= 'more' and src:find('%S') then
          print(err)
        end
      end
    end
  end
end

return M
