-- jinja: the subset of Jinja2 that model chat templates use, rendered as
-- transformers renders them (a sandboxed Environment with trim_blocks and
-- lstrip_blocks, the loopcontrols extension, raise_exception and
-- strftime_now; no autoescaping). Python's value semantics are followed where
-- templates can see them (truthiness, `+` on strings and lists, `and`/`or`
-- returning operands, 0-based indexing and slices, str() of None, True,
-- lists and dicts). A construct outside the subset is an error naming it.
--
--   local t = jinja.compile(source, name)   t:render{messages = {...}, add_generation_prompt = true}
--
-- Values: Lua strings, numbers, booleans; jinja.none (gp.json.null) is None;
-- a table is a list when it has [1] (or is empty), else a dict. Dict keys are
-- visited in sorted order (Lua tables keep no order), unless the table's
-- metatable lists them: setmetatable(t, {__keys = {'b', 'a'}}).
local U = require 'gpush.text.unicode'
local json = require 'gpush.core.json'

local M = {}
local none = json.null
M.none = none
local sub, byte, concat, format, find = string.sub, string.byte, table.concat, string.format, string.find
local unpack = unpack or table.unpack -- luacheck: ignore 143

-- the undefined value, remembering the name that was looked up
local Undefined = {}
Undefined.__index = Undefined
local function undefined(name) return setmetatable({name = name}, Undefined) end
local function is_undef(v) return getmetatable(v) == Undefined end
M.undefined = undefined

local Namespace, Loop, Macro = {}, {}, {}
Namespace.__index = Namespace
Loop.__index = Loop

local function fail(msg, line)
  error((line and format('chat template: %s (line %d)', msg, line) or ('chat template: ' .. msg)), 0)
end

---------------------------------------------------------------------------
-- Python values

local function is_list(v)
  if type(v) ~= 'table' then return false end
  local mt = getmetatable(v)
  if mt then return mt.__list == true end
  return v[1] ~= nil or next(v) == nil
end
local function is_dict(v)
  if type(v) ~= 'table' or v == none then return false end
  local mt = getmetatable(v)
  if mt then return mt.__keys ~= nil or mt == Namespace end
  return v[1] == nil and next(v) ~= nil
end

local function keys_of(d)
  local mt = getmetatable(d)
  if mt and mt.__keys then return mt.__keys end
  local ks = {}
  for k in pairs(d) do ks[#ks + 1] = k end
  table.sort(ks, function(a, b)
    if type(a) == type(b) then return a < b end
    return type(a) == 'number'
  end)
  return ks
end
M.keys_of = keys_of

local function truthy(v)
  if v == nil or v == false or v == none or v == 0 or v == '' then return false end
  if type(v) == 'table' then
    local mt = getmetatable(v)
    if mt == Undefined then return false end
    if mt == nil or mt.__keys or mt.__list then return next(v) ~= nil end
  end
  return true
end
M.truthy = truthy

-- Python's repr of a float (the shortest text that reads back), or an int
local function num_str(x)
  if x ~= x then return 'nan' end
  if x == math.huge then return 'inf' end
  if x == -math.huge then return '-inf' end
  if x == math.floor(x) and math.abs(x) < 1e16 then return format('%d', x) end
  local s
  for p = 1, 17 do
    s = format('%.' .. p .. 'g', x)
    if tonumber(s) == x then break end
  end
  local mant, exp = s:match('^(.-)e([-+]%d+)$')
  if mant then
    local e = tonumber(exp)
    s = mant .. 'e' .. (e < 0 and '-' or '+') .. format('%02d', math.abs(e))
  elseif not s:find('[.e]') then
    s = s .. '.0'
  end
  return s
end
M.num_str = num_str

local function py_repr_str(s)
  local q = "'"
  if s:find("'", 1, true) and not s:find('"', 1, true) then q = '"' end
  local out = s:gsub('\\', '\\\\'):gsub('\n', '\\n'):gsub('\r', '\\r'):gsub('\t', '\\t')
  if q == "'" then out = out:gsub("'", "\\'") end
  out = out:gsub('[%z\1-\31\127]', function(c) return format('\\x%02x', byte(c)) end)
  return q .. out .. q
end

local str
local function repr(v)
  if type(v) == 'string' then return py_repr_str(v) end
  return str(v)
end

-- Python's str() of a value
function str(v)
  local t = type(v)
  if t == 'string' then return v end
  if t == 'number' then return num_str(v) end
  if t == 'boolean' then return v and 'True' or 'False' end
  if v == nil or v == none then return 'None' end
  if t == 'table' then
    local mt = getmetatable(v)
    if mt == Undefined then return '' end
    if mt == Namespace then return '<Namespace>' end
    if mt == Loop then return '<LoopContext>' end
    if mt == Macro then return '<Macro>' end
    if is_list(v) then
      local parts = {}
      for i = 1, #v do parts[i] = repr(v[i]) end
      return '[' .. concat(parts, ', ') .. ']'
    end
    local parts = {}
    for _, k in ipairs(keys_of(v)) do parts[#parts + 1] = repr(k) .. ': ' .. repr(v[k]) end
    return '{' .. concat(parts, ', ') .. '}'
  end
  if t == 'function' then return '<function>' end
  return tostring(v)
end
M.str = str

local function py_eq(a, b)
  if a == b then return true end
  if is_undef(a) or is_undef(b) then return is_undef(a) and is_undef(b) end
  if type(a) == 'table' and type(b) == 'table' and a ~= none and b ~= none then
    if is_list(a) ~= is_list(b) then return false end
    if is_list(a) then
      if #a ~= #b then return false end
      for i = 1, #a do if not py_eq(a[i], b[i]) then return false end end
      return true
    end
    for k, x in pairs(a) do if not py_eq(x, b[k]) then return false end end
    for k in pairs(b) do if a[k] == nil then return false end end
    return true
  end
  return false
end

-- JSON as Python's json.dumps(x, ensure_ascii=False, indent=indent, separators=..., sort_keys=...)
local ESC = {['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t', ['\b'] = '\\b', ['\f'] = '\\f'}
local function json_str(s)
  return '"' .. s:gsub('[%z\1-\31"\\]', function(c) return ESC[c] or format('\\u%04x', byte(c)) end) .. '"'
end
local function tojson(v, indent, item_sep, key_sep, sort_keys, level)
  level = level or 0
  local t = type(v)
  if t == 'string' then return json_str(v) end
  if t == 'number' then
    if v ~= v then return 'NaN' end
    if v == math.huge then return 'Infinity' end
    if v == -math.huge then return '-Infinity' end
    return num_str(v)
  end
  if t == 'boolean' then return v and 'true' or 'false' end
  if v == nil or v == none then return 'null' end
  if is_undef(v) then fail("tojson: '" .. tostring(v.name) .. "' is undefined (Object of type Undefined is not JSON serializable)") end
  if t ~= 'table' then fail('tojson: a ' .. t .. ' is not JSON serializable') end
  local nl, pad, pad_in = '', '', ''
  if indent then
    nl = '\n'
    pad = string.rep(' ', indent * level)
    pad_in = string.rep(' ', indent * (level + 1))
  end
  local parts = {}
  if is_list(v) then
    if #v == 0 then return '[]' end
    for i = 1, #v do parts[i] = pad_in .. tojson(v[i], indent, item_sep, key_sep, sort_keys, level + 1) end
    return '[' .. nl .. concat(parts, item_sep .. nl) .. nl .. pad .. ']'
  end
  local ks = keys_of(v)
  if #ks == 0 then return '{}' end
  for _, k in ipairs(ks) do
    local key = type(k) == 'string' and json_str(k) or json_str(str(k))
    parts[#parts + 1] = pad_in .. key .. key_sep .. tojson(v[k], indent, item_sep, key_sep, sort_keys, level + 1)
  end
  return '{' .. nl .. concat(parts, item_sep .. nl) .. nl .. pad .. '}'
end
function M.tojson(v, opts)
  opts = opts or {}
  local indent = opts.indent
  if indent == none then indent = nil end
  local item_sep, key_sep = indent and ',' or ', ', ': '
  if type(opts.separators) == 'table' then item_sep, key_sep = opts.separators[1], opts.separators[2] end
  return tojson(v, indent, item_sep, key_sep, opts.sort_keys)
end

---------------------------------------------------------------------------
-- lexing: the template into text and tags, each tag into tokens

local CLOSER_START = {['-'] = true, ['+'] = true, ['%'] = true, ['}'] = true}
local function lex_expr(src, pos, line, closers)
  -- tokens from pos until a closer (at bracket depth 0); returns tokens, the
  -- position after the closer, the closer found
  local toks, depth = {}, {}
  local n = #src
  while true do
    local ws_end = find(src, '[^ \t\n\r\f\v]', pos) or n + 1
    if ws_end > pos then
      line = line + select(2, sub(src, pos, ws_end - 1):gsub('\n', ''))
      pos = ws_end
    end
    if pos > n then fail('unterminated tag', line) end
    local c = sub(src, pos, pos)
    if #depth == 0 and CLOSER_START[c] then -- every closer starts with one of these
      for _, cl in ipairs(closers) do
        if sub(src, pos, pos + #cl - 1) == cl then return toks, pos + #cl, cl, line end
      end
    end
    local tok
    if c:match('[%a_]') then
      local w = src:match('^[%w_]+', pos)
      tok = {'name', w}
      pos = pos + #w
    elseif c:match('%d') then
      local num = src:match('^%d[%d_]*%.%d[%d_]*[eE][-+]?%d+', pos) or src:match('^%d[%d_]*%.%d[%d_]*', pos) or
        src:match('^%d[%d_]*[eE][-+]?%d+', pos) or src:match('^%d[%d_]*', pos)
      tok = {'num', tonumber((num:gsub('_', '')))}
      pos = pos + #num
    elseif c == "'" or c == '"' then
      local j, buf = pos + 1, {}
      local stop = c == "'" and "[\\\n']" or '[\\\n"]' -- what ends a run of plain characters
      while true do
        local k = find(src, stop, j)
        if not k then fail('unterminated string', line) end
        if k > j then buf[#buf + 1] = sub(src, j, k - 1) end
        j = k
        local d = sub(src, j, j)
        if d == c then break end
        if d == '\\' then
          local e = sub(src, j + 1, j + 1)
          local simple = ({n = '\n', t = '\t', r = '\r', ['\\'] = '\\', ["'"] = "'", ['"'] = '"', a = '\a', b = '\b',
                           f = '\f', v = '\v', ['\n'] = ''})[e]
          if simple then
            buf[#buf + 1] = simple
            j = j + 2
          elseif e == 'x' or e == 'u' or e == 'U' then
            local len = ({x = 2, u = 4, U = 8})[e]
            local hex = sub(src, j + 2, j + 1 + len)
            if not hex:match('^%x+$') or #hex ~= len then fail('bad \\' .. e .. ' escape in a string', line) end
            buf[#buf + 1] = U.encode(tonumber(hex, 16))
            j = j + 2 + len
          elseif e:match('[0-7]') then
            local oct = src:match('^[0-7][0-7]?[0-7]?', j + 1)
            buf[#buf + 1] = U.encode(tonumber(oct, 8))
            j = j + 1 + #oct
          else
            buf[#buf + 1] = '\\' .. e
            j = j + 2
          end
        else -- a newline
          line = line + 1
          buf[#buf + 1] = d
          j = j + 1
        end
      end
      tok = {'str', concat(buf)}
      pos = j + 1
    else
      local op = src:match('^%*%*', pos) or src:match('^//', pos) or src:match('^[=!<>]=', pos) or c
      if not op:match('^[%+%-%*/%%~<>=!%(%)%[%]{}%.,:|]') and op ~= '**' and op ~= '//' then
        fail("unexpected character '" .. c .. "'", line)
      end
      if op == '!' then fail("unexpected '!'", line) end
      if op == '(' or op == '[' or op == '{' then depth[#depth + 1] = op end
      if op == ')' or op == ']' or op == '}' then
        if #depth == 0 then fail("unexpected '" .. op .. "'", line) end
        depth[#depth] = nil
      end
      tok = {'op', op}
      pos = pos + #op
    end
    tok.line = line
    toks[#toks + 1] = tok
  end
end

local function rstrip_ws(s) return (s:gsub('[ \t\n\r\f\v]+$', '')) end

-- the template as a list of {'text', s} | {'var', tokens} | {'stmt', tokens}
local function lex(src)
  src = src:gsub('\r\n', '\n'):gsub('\r', '\n')
  if sub(src, -1) == '\n' then src = sub(src, 1, -2) end -- keep_trailing_newline=False
  local items, pos, n, line = {}, 1, #src, 1
  local line_starting = true
  while pos <= n do
    local a = src:find('{[{%%#]', pos)
    local text = sub(src, pos, (a or n + 1) - 1)
    if not a then
      items[#items + 1] = {'text', text}
      break
    end
    local kind, mod = sub(src, a + 1, a + 1), sub(src, a + 2, a + 2)
    if mod == '-' then
      text = rstrip_ws(text)
    elseif mod ~= '+' and kind ~= '{' then
      -- lstrip_blocks: the spaces and tabs before a block tag on its line
      local l_pos = 0
      for i = #text, 1, -1 do if byte(text, i) == 10 then l_pos = i break end end
      if l_pos > 0 or line_starting then
        local tail = sub(text, l_pos + 1)
        if tail ~= '' and tail:match('^[ \t\f\v]+$') then text = sub(text, 1, l_pos) end
      end
    end
    if text ~= '' then items[#items + 1] = {'text', text} end
    line = line + select(2, sub(src, pos, a - 1):gsub('\n', ''))
    local start = a + 2 + ((mod == '-' or mod == '+') and 1 or 0)
    local stop, ended
    if kind == '#' then
      local e = src:find('#}', start, true)
      if not e then fail('missing end of comment tag', line) end
      line = line + select(2, sub(src, start, e):gsub('\n', ''))
      stop, ended = e + 2, sub(src, e - 1, e - 1) == '-' and '-#}' or (sub(src, e - 1, e - 1) == '+' and '+#}' or '#}')
    else
      local closers = kind == '{' and {'-}}', '}}'} or {'-%}', '+%}', '%}'}
      local toks
      toks, stop, ended, line = lex_expr(src, start, line, closers)
      if kind == '%' and toks[1] and toks[1][1] == 'name' and toks[1][2] == 'raw' then
        -- {% raw %}...{% endraw %}: the text as it is
        local ra, rb = src:find('{%%[-+]?%s*endraw%s*[-+]?%%}', stop)
        if not ra then fail('missing endraw', line) end
        local body = sub(src, stop, ra - 1)
        if ended == '-%}' then body = body:gsub('^[ \t\n\r\f\v]+', '') end
        if sub(src, ra + 2, ra + 2) == '-' then body = rstrip_ws(body) end
        items[#items + 1] = {'text', body}
        stop, ended = rb + 1, sub(src, rb - 2, rb)
      else
        items[#items + 1] = {kind == '{' and 'var' or 'stmt', toks, line = line}
      end
    end
    pos = stop
    -- what the end tag takes after it
    local consumed = ''
    if ended:sub(1, 1) == '-' then
      consumed = src:match('^[ \t\n\r\f\v]*', pos)
    elseif kind ~= '{' and ended:sub(1, 1) ~= '+' and sub(src, pos, pos) == '\n' then
      consumed = '\n' -- trim_blocks
    end
    line = line + select(2, consumed:gsub('\n', ''))
    pos = pos + #consumed
    if #consumed > 0 then line_starting = sub(consumed, -1) == '\n' else line_starting = false end
  end
  return items
end

---------------------------------------------------------------------------
-- parsing

local Parser = {}
Parser.__index = Parser

function Parser:peek(k) return self.toks[self.i + (k or 0)] end
function Parser:next()
  local t = self.toks[self.i]
  self.i = self.i + 1
  return t
end
function Parser:is(kind, value, k)
  local t = self.toks[self.i + (k or 0)]
  return t ~= nil and t[1] == kind and (value == nil or t[2] == value)
end
function Parser:accept(kind, value) -- self:is(kind, value) and self:next(), a call less (the parser's most run line)
  local t = self.toks[self.i]
  if t ~= nil and t[1] == kind and (value == nil or t[2] == value) then
    self.i = self.i + 1
    return t
  end
end
function Parser:expect(kind, value)
  local t = self:next()
  if not t or t[1] ~= kind or (value and t[2] ~= value) then
    fail(format("expected %s, got %s", value and ("'" .. value .. "'") or kind, t and ("'" .. tostring(t[2]) .. "'") or 'the end of the tag'), self.line)
  end
  return t
end
function Parser:done() return self.i > #self.toks end

local function node(t, line) t.line = line return t end

function Parser:expression(no_cond)
  local e = self:or_expr()
  if not no_cond and self:is('name', 'if') then
    self:next()
    local cond = self:or_expr()
    local alt
    if self:accept('name', 'else') then alt = self:expression() end
    e = node({'cond', cond, e, alt}, self.line)
  end
  return e
end

function Parser:or_expr()
  local e = self:and_expr()
  while self:accept('name', 'or') do e = node({'or', e, self:and_expr()}, self.line) end
  return e
end

function Parser:and_expr()
  local e = self:not_expr()
  while self:accept('name', 'and') do e = node({'and', e, self:not_expr()}, self.line) end
  return e
end

function Parser:not_expr()
  if self:accept('name', 'not') then return node({'not', self:not_expr()}, self.line) end
  return self:compare()
end

local CMP = {['=='] = true, ['!='] = true, ['<'] = true, ['>'] = true, ['<='] = true, ['>='] = true}
function Parser:compare()
  local e = self:math1()
  local ops = {}
  while true do
    local t = self:peek()
    if t and t[1] == 'op' and CMP[t[2]] then
      self:next()
      ops[#ops + 1] = {t[2], self:math1()}
    elseif self:is('name', 'in') then
      self:next()
      ops[#ops + 1] = {'in', self:math1()}
    elseif self:is('name', 'not') and self:is('name', 'in', 1) then
      self:next()
      self:next()
      ops[#ops + 1] = {'notin', self:math1()}
    else
      break
    end
  end
  if #ops == 0 then return e end
  return node({'compare', e, ops}, self.line)
end

-- the operator token at the parser's position if it is one of ops, then past it
local function op_in(self, ops)
  local t = self.toks[self.i]
  if t and t[1] == 'op' and ops[t[2]] then
    self.i = self.i + 1
    return t[2]
  end
end

local MATH1, MATH2 = {['+'] = true, ['-'] = true}, {['*'] = true, ['/'] = true, ['//'] = true, ['%'] = true}
function Parser:math1()
  local e = self:concat()
  while true do
    local op = op_in(self, MATH1)
    if not op then return e end
    e = node({'bin', op, e, self:concat()}, self.line)
  end
end

function Parser:concat()
  local e = self:math2()
  while self:accept('op', '~') do e = node({'bin', '~', e, self:math2()}, self.line) end
  return e
end

function Parser:math2()
  local e = self:pow()
  while true do
    local op = op_in(self, MATH2)
    if not op then return e end
    e = node({'bin', op, e, self:pow()}, self.line)
  end
end

function Parser:pow()
  local e = self:unary()
  while self:accept('op', '**') do e = node({'bin', '**', e, self:unary()}, self.line) end
  return e
end

function Parser:unary(no_filter)
  local e
  if self:accept('op', '-') then
    e = node({'neg', self:unary(true)}, self.line)
  elseif self:accept('op', '+') then
    e = self:unary(true)
  else
    e = self:postfix(self:primary())
  end
  if not no_filter then e = self:filter_expr(e) end
  return e
end

function Parser:args()
  -- after '(': positional and keyword arguments up to ')'
  local args, kwargs = {}, {}
  while not self:accept('op', ')') do
    if #args + (next(kwargs) and 1 or 0) > 0 then self:expect('op', ',') end
    if self:accept('op', ')') then break end
    if self:is('name') and self:is('op', '=', 1) then
      local k = self:next()[2]
      self:next()
      kwargs[k] = self:expression()
    else
      args[#args + 1] = self:expression()
    end
  end
  return args, kwargs
end

function Parser:primary()
  local t = self:next()
  if not t then fail('unexpected end of the expression', self.line) end
  local line = t.line
  if t[1] == 'str' then
    local s = t[2]
    while self:is('str') do s = s .. self:next()[2] end -- adjacent literals join
    return node({'lit', s}, line)
  elseif t[1] == 'num' then
    return node({'lit', t[2]}, line)
  elseif t[1] == 'name' then
    local w = t[2]
    if w == 'true' or w == 'True' then return node({'lit', true}, line) end
    if w == 'false' or w == 'False' then return node({'lit', false}, line) end
    if w == 'none' or w == 'None' then return node({'lit', none}, line) end
    return node({'name', w}, line)
  elseif t[1] == 'op' and t[2] == '(' then
    if self:accept('op', ')') then return node({'list', {}}, line) end
    local e = self:expression()
    if self:is('op', ',') then
      local items = {e}
      while self:accept('op', ',') do
        if self:is('op', ')') then break end
        items[#items + 1] = self:expression()
      end
      e = node({'list', items}, line)
    end
    self:expect('op', ')')
    return e
  elseif t[1] == 'op' and t[2] == '[' then
    local items = {}
    while not self:accept('op', ']') do
      if #items > 0 then self:expect('op', ',') end
      if self:accept('op', ']') then break end
      items[#items + 1] = self:expression()
    end
    return node({'list', items}, line)
  elseif t[1] == 'op' and t[2] == '{' then
    local pairs_ = {}
    while not self:accept('op', '}') do
      if #pairs_ > 0 then self:expect('op', ',') end
      if self:accept('op', '}') then break end
      local k = self:expression()
      self:expect('op', ':')
      pairs_[#pairs_ + 1] = {k, self:expression()}
    end
    return node({'dict', pairs_}, line)
  end
  fail("unexpected '" .. tostring(t[2]) .. "'", line)
end

function Parser:postfix(e)
  while true do
    if self:accept('op', '.') then
      local t = self:next()
      if not t or (t[1] ~= 'name' and t[1] ~= 'num') then fail("expected a name after '.'", self.line) end
      e = node({'getattr', e, t[2]}, self.line)
    elseif self:accept('op', '[') then
      local a, b, c
      local is_slice = false
      if not self:is('op', ':') then a = self:expression() end
      if self:accept('op', ':') then
        is_slice = true
        if not self:is('op', ']') and not self:is('op', ':') then b = self:expression() end
        if self:accept('op', ':') then
          if not self:is('op', ']') then c = self:expression() end
        end
      end
      self:expect('op', ']')
      if is_slice then e = node({'slice', e, a, b, c}, self.line) else e = node({'getitem', e, a}, self.line) end
    elseif self:accept('op', '(') then
      local args, kwargs = self:args()
      e = node({'call', e, args, kwargs}, self.line)
    else
      return e
    end
  end
end

function Parser:filter_expr(e)
  while true do
    if self:accept('op', '|') then
      local name = self:expect('name')[2]
      while self:accept('op', '.') do name = name .. '.' .. self:expect('name')[2] end
      local args, kwargs = {}, {}
      if self:accept('op', '(') then args, kwargs = self:args() end
      e = node({'filter', name, e, args, kwargs}, self.line)
    elseif self:is('name', 'is') then
      self:next()
      local negated = self:accept('name', 'not') ~= nil
      local t = self:next()
      if not t or (t[1] ~= 'name' and not (t[1] == 'op' and CMP[t[2]])) then fail("expected a test name after 'is'", self.line) end
      local name = t[2]
      local args, kwargs = {}, {}
      if self:accept('op', '(') then
        args, kwargs = self:args()
      elseif self:peek() and (self:is('str') or self:is('num') or (self:is('name') and not ({['else'] = 1, ['or'] = 1,
          ['and'] = 1, ['if'] = 1, ['is'] = 1, ['in'] = 1, ['not'] = 1})[self:peek()[2]]) or self:is('op', '[') or self:is('op', '{') or self:is('op', '(')) then
        args = {self:postfix(self:primary())}
      end
      e = node({'test', name, e, args, kwargs, negated}, self.line)
    elseif self:is('op', '(') then
      self:next()
      local args, kwargs = self:args()
      e = node({'call', e, args, kwargs}, self.line)
    else
      return e
    end
  end
end

-- assignment targets: a name, a name.attr, or names separated by commas
function Parser:targets()
  local ts = {}
  repeat
    local name = self:expect('name')[2]
    if self:accept('op', '.') then
      ts[#ts + 1] = {'attr', name, self:expect('name')[2]}
    else
      ts[#ts + 1] = {'name', name}
    end
  until not self:accept('op', ',')
  return ts
end

local function parse(items)
  local idx = 1
  local function parser_of(item)
    return setmetatable({toks = item[2], i = 1, line = item.line}, Parser)
  end
  -- statements up to one of the end tags; returns the body and the parser at the end tag
  local function body(ends)
    local out = {}
    while idx <= #items do
      local item = items[idx]
      idx = idx + 1
      if item[1] == 'text' then
        out[#out + 1] = {'text', item[2]}
      elseif item[1] == 'var' then
        local p = parser_of(item)
        local e = p:expression()
        if not p:done() then fail("unexpected '" .. tostring(p:peek()[2]) .. "' in {{ }}", item.line) end
        out[#out + 1] = node({'output', e}, item.line)
      else
        local p = parser_of(item)
        local kw = p:expect('name')[2]
        if ends and ends[kw] then return out, kw, p end
        local line = item.line
        local function header_done(q)
          if not q:done() then fail("unexpected '" .. tostring(q:peek()[2]) .. "' in {% " .. kw .. " %}", line) end
        end
        if kw == 'if' then
          local branches = {{p:expression()}}
          header_done(p)
          local els
          while true do
            local b, e, q = body({elif = true, ['else'] = true, endif = true})
            if not e then fail('missing endif', line) end
            branches[#branches][2] = b
            if e == 'endif' then header_done(q) break end
            if e == 'elif' then
              branches[#branches + 1] = {q:expression()}
              header_done(q)
            else
              header_done(q)
              local b2, e2, q2 = body({endif = true})
              if not e2 then fail('missing endif', line) end
              header_done(q2)
              els = b2
              break
            end
          end
          out[#out + 1] = node({'if', branches, els}, line)
        elseif kw == 'for' then
          local targets = p:targets()
          p:expect('name', 'in')
          local iter = p:expression(true)
          local cond
          if p:accept('name', 'if') then cond = p:expression(true) end
          if p:accept('name', 'recursive') then fail("unsupported 'for ... recursive'", line) end
          header_done(p)
          local b, e = body({['else'] = true, endfor = true})
          if not e then fail('missing endfor', line) end
          local els
          if e == 'else' then
            local e2
            els, e2 = body({endfor = true})
            if not e2 then fail('missing endfor', line) end
          end
          out[#out + 1] = node({'for', targets, iter, cond, b, els}, line)
        elseif kw == 'set' then
          local targets = p:targets()
          if p:accept('op', '=') then
            out[#out + 1] = node({'set', targets, p:expression()}, line)
          else
            local b, e = body({endset = true})
            if not e then fail('missing endset', line) end
            out[#out + 1] = node({'setblock', targets, b}, line)
          end
        elseif kw == 'macro' then
          local name = p:expect('name')[2]
          p:expect('op', '(')
          local params = {}
          while not p:accept('op', ')') do
            if #params > 0 then p:expect('op', ',') end
            local pn = p:expect('name')[2]
            local default
            if p:accept('op', '=') then default = p:expression() end
            params[#params + 1] = {pn, default}
          end
          local b, e = body({endmacro = true})
          if not e then fail('missing endmacro', line) end
          out[#out + 1] = node({'macro', name, params, b}, line)
        elseif kw == 'with' then
          local assigns = {}
          while not p:done() do
            if #assigns > 0 then p:expect('op', ',') end
            local n = p:expect('name')[2]
            p:expect('op', '=')
            assigns[#assigns + 1] = {n, p:expression()}
          end
          local b, e = body({endwith = true})
          if not e then fail('missing endwith', line) end
          out[#out + 1] = node({'with', assigns, b}, line)
        elseif kw == 'generation' then
          local b, e = body({endgeneration = true})
          if not e then fail('missing endgeneration', line) end
          out[#out + 1] = node({'block', b}, line)
        elseif kw == 'filter' then
          local name = p:expect('name')[2]
          local args, kwargs = {}, {}
          if p:accept('op', '(') then args, kwargs = p:args() end
          local b, e = body({endfilter = true})
          if not e then fail('missing endfilter', line) end
          out[#out + 1] = node({'filterblock', name, args, kwargs, b}, line)
        elseif kw == 'break' or kw == 'continue' then
          out[#out + 1] = node({kw}, line)
        elseif kw == 'do' then
          out[#out + 1] = node({'do', p:expression()}, line)
        elseif kw:match('^end') or kw == 'elif' or kw == 'else' then
          fail("unexpected '{% " .. kw .. " %}'", line)
        else
          fail("unsupported tag '" .. kw .. "'", line)
        end
        if kw == 'set' or kw == 'break' or kw == 'continue' or kw == 'do' then header_done(p) end
      end
    end
    if ends then return out, nil end
    return out
  end
  return (body(nil))
end

---------------------------------------------------------------------------
-- evaluation

local Scope = {}
Scope.__index = Scope
local function scope(parent) return setmetatable({vars = {}, parent = parent}, Scope) end
function Scope:get(name)
  local s = self
  while s do
    local v = s.vars[name]
    if v ~= nil then return v end
    s = s.parent
  end
  return nil
end
function Scope:set(name, v) self.vars[name] = v end

local BreakSignal, ContinueSignal = {}, {}

local eval, exec, filters, tests

local function check_defined(v, what, line)
  if is_undef(v) then fail(format("'%s' is undefined%s", tostring(v.name), what and (' (' .. what .. ')') or ''), line) end
  return v
end

local function len_of(v)
  if type(v) == 'string' then return U.len(v) end
  if type(v) == 'table' and v ~= none then
    if is_undef(v) then return 0 end
    if is_list(v) then return #v end
    return #keys_of(v)
  end
  fail("object of type '" .. type(v) .. "' has no len()")
end

-- the items a for loop visits
local function iterate(v, line)
  if type(v) == 'string' then return U.chars(v) end
  if is_undef(v) then return {} end
  if type(v) ~= 'table' or v == none then fail("'" .. str(v) .. "' is not iterable", line) end
  if getmetatable(v) == Namespace or getmetatable(v) == Loop then fail('the object is not iterable', line) end
  if is_list(v) then return v end
  return keys_of(v)
end
M.iterate = iterate

local WS = '[ \t\n\r\f\v]'
local function py_strip(s, chars, left, right)
  if chars == nil or chars == none then
    -- Python's str.strip(): Unicode whitespace (and U+001C..U+001F)
    local cps = U.codepoints(s)
    local function sp(cp) return U.WHITE[cp] or (cp >= 0x1C and cp <= 0x1F) end
    local i, j = 1, #cps
    if left then while i <= j and sp(cps[i]) do i = i + 1 end end
    if right then while j >= i and sp(cps[j]) do j = j - 1 end end
    if i == 1 and j == #cps then return s end
    local out = {}
    for k = i, j do out[#out + 1] = U.encode(cps[k]) end
    return concat(out)
  end
  local set = {}
  for _, c in ipairs(U.codepoints(chars)) do set[c] = true end
  local cps = U.codepoints(s)
  local i, j = 1, #cps
  if left then while i <= j and set[cps[i]] do i = i + 1 end end
  if right then while j >= i and set[cps[j]] do j = j - 1 end end
  local out = {}
  for k = i, j do out[#out + 1] = U.encode(cps[k]) end
  return concat(out)
end
M.py_strip = py_strip

local function py_split(s, sep, maxsplit)
  local out = {}
  maxsplit = (maxsplit == nil or maxsplit == none) and -1 or maxsplit
  if sep == nil or sep == none then
    local n = 0
    local rest = s:gsub('^' .. WS .. '+', '')
    while rest ~= '' do
      if maxsplit >= 0 and n >= maxsplit then out[#out + 1] = rest:gsub(WS .. '+$', '') break end
      local a, b = rest:find(WS .. '+')
      if not a then out[#out + 1] = rest break end
      out[#out + 1] = sub(rest, 1, a - 1)
      rest = sub(rest, b + 1)
      n = n + 1
    end
    return out
  end
  if sep == '' then fail('split: empty separator') end
  local i, n = 1, 0
  while true do
    if maxsplit >= 0 and n >= maxsplit then break end
    local a = s:find(sep, i, true)
    if not a then break end
    out[#out + 1] = sub(s, i, a - 1)
    i = a + #sep
    n = n + 1
  end
  out[#out + 1] = sub(s, i)
  return out
end

local function replace_str(s, old, new, count)
  count = (count == nil or count == none) and -1 or count
  if old == '' then fail('replace: empty pattern is not supported') end
  local out, i, n = {}, 1, 0
  while count < 0 or n < count do
    local a = s:find(old, i, true)
    if not a then break end
    out[#out + 1] = sub(s, i, a - 1)
    out[#out + 1] = new
    i = a + #old
    n = n + 1
  end
  out[#out + 1] = sub(s, i)
  return concat(out)
end

local function title(s)
  return (s:gsub('(%a)([%w]*)', function(a, b) return a:upper() .. b:lower() end))
end

-- the methods of strings and dicts that templates call
local function str_method(s, name)
  local m = {
    strip = function(chars) return py_strip(s, chars, true, true) end,
    lstrip = function(chars) return py_strip(s, chars, true, false) end,
    rstrip = function(chars) return py_strip(s, chars, false, true) end,
    split = function(sep, maxsplit) return py_split(s, sep, maxsplit) end,
    startswith = function(p)
      if type(p) == 'table' then
        for _, q in ipairs(p) do if sub(s, 1, #q) == q then return true end end
        return false
      end
      return sub(s, 1, #p) == p
    end,
    endswith = function(p)
      if type(p) == 'table' then
        for _, q in ipairs(p) do if q == '' or sub(s, -#q) == q then return true end end
        return false
      end
      return p == '' or sub(s, -#p) == p
    end,
    upper = function() return U.upper(s) end,
    lower = function() return U.lower(s) end,
    replace = function(old, new, count) return replace_str(s, old, new, count) end,
    title = function() return title(s) end,
    capitalize = function() return U.upper(sub(s, 1, 1)) .. U.lower(sub(s, 2)) end,
    find = function(x)
      local a = s:find(x, 1, true)
      return a and U.len(sub(s, 1, a - 1)) or -1
    end,
    count = function(x)
      local n, i = 0, 1
      while true do
        local a = s:find(x, i, true)
        if not a then return n end
        n, i = n + 1, a + math.max(#x, 1)
      end
    end,
    join = function(list)
      local parts = {}
      for i, v in ipairs(iterate(list)) do parts[i] = str(v) end
      return concat(parts, s)
    end,
    splitlines = function()
      local out = {}
      for l in (s .. '\n'):gmatch('([^\n]*)\n') do out[#out + 1] = l end
      if s == '' or sub(s, -1) == '\n' then out[#out] = nil end
      return out
    end,
    isdigit = function() return s ~= '' and s:match('^%d+$') ~= nil end,
    isalpha = function() return s ~= '' and s:match('^%a+$') ~= nil end,
    isspace = function() return s ~= '' and s:match('^' .. WS .. '+$') ~= nil end,
    islower = function() return s:match('%l') ~= nil and s:match('%u') == nil end,
    isupper = function() return s:match('%u') ~= nil and s:match('%l') == nil end,
  }
  return m[name]
end

local function dict_method(d, name)
  local m = {
    items = function()
      local out = {}
      for _, k in ipairs(keys_of(d)) do out[#out + 1] = {k, d[k]} end
      return out
    end,
    keys = function() local ks = {} for i, k in ipairs(keys_of(d)) do ks[i] = k end return ks end,
    values = function()
      local out = {}
      for _, k in ipairs(keys_of(d)) do out[#out + 1] = d[k] end
      return out
    end,
    get = function(k, default)
      local v = d[k]
      if v == nil then
        if default == nil then return none end
        return default
      end
      return v
    end,
  }
  return m[name]
end

local function getattr(obj, name, line)
  if is_undef(obj) then check_defined(obj, nil, line) end
  local mt = type(obj) == 'table' and getmetatable(obj)
  if mt == Loop or mt == Namespace then
    local v = obj[name]
    if v == nil then return undefined(name) end
    return v
  end
  if type(obj) == 'string' then
    local f = str_method(obj, name)
    if f then return f end
    return undefined(name)
  end
  if type(obj) == 'table' and obj ~= none then
    if not is_list(obj) or next(obj) == nil then
      local f = dict_method(obj, name)
      if f then return f end
    end
    local v = obj[name]
    if v ~= nil then return v end
  end
  return undefined(name)
end

local function index_of(i, n)
  if type(i) ~= 'number' or i ~= math.floor(i) then return nil end
  if i < 0 then i = i + n end
  if i < 0 or i >= n then return nil end
  return i + 1
end

local function getitem(obj, key, line)
  if is_undef(obj) then check_defined(obj, nil, line) end
  if type(obj) == 'string' then
    local cs = U.chars(obj)
    local i = index_of(key, #cs)
    if i then return cs[i] end
    return undefined(tostring(key))
  end
  if type(obj) == 'table' and obj ~= none then
    local mt = getmetatable(obj)
    if mt == Loop or mt == Namespace then return getattr(obj, key, line) end
    if is_list(obj) and type(key) == 'number' then
      local i = index_of(key, #obj)
      if i then return obj[i] end
      return undefined(tostring(key))
    end
    local v = obj[key]
    if v ~= nil then return v end
    if type(key) == 'string' then return getattr(obj, key, line) end
  end
  return undefined(tostring(key))
end

local function slice(obj, a, b, c, line)
  check_defined(obj, nil, line)
  local items = type(obj) == 'string' and U.chars(obj) or obj
  if type(items) ~= 'table' or items == none then fail('cannot slice a ' .. type(obj), line) end
  local n = #items
  -- bounds and step are integers or none (Python: "slice indices must be integers or None")
  for _, x in ipairs {a == nil and none or a, b == nil and none or b, c == nil and none or c} do
    if x ~= none and (type(x) ~= 'number' or x ~= math.floor(x)) then
      fail('slice indices must be integers or none, not a ' .. (type(x) == 'number' and 'float' or type(x)), line)
    end
  end
  local step = (c == nil or c == none) and 1 or c
  if step == 0 then fail('slice step cannot be zero', line) end
  local function norm(x, default)
    if x == nil or x == none then return default end
    if x < 0 then x = x + n end
    if step > 0 then return math.max(0, math.min(x, n)) end
    return math.max(-1, math.min(x, n - 1))
  end
  local start = norm(a, step > 0 and 0 or n - 1)
  local stop = norm(b, step > 0 and n or -1)
  local out = {}
  local i = start
  while (step > 0 and i < stop) or (step < 0 and i > stop) do
    out[#out + 1] = items[i + 1]
    i = i + step
  end
  if type(obj) == 'string' then return concat(out) end
  return out
end

local function arith(op, a, b, line)
  if is_undef(a) then check_defined(a, nil, line) end
  if is_undef(b) then check_defined(b, nil, line) end
  local ta, tb = type(a), type(b)
  if ta == 'boolean' then a, ta = a and 1 or 0, 'number' end
  if tb == 'boolean' then b, tb = b and 1 or 0, 'number' end
  if op == '+' then
    if ta == 'number' and tb == 'number' then return a + b end
    if ta == 'string' and tb == 'string' then return a .. b end
    if ta == 'table' and tb == 'table' and is_list(a) and is_list(b) then
      local out = {}
      for _, v in ipairs(a) do out[#out + 1] = v end
      for _, v in ipairs(b) do out[#out + 1] = v end
      return out
    end
  elseif ta == 'number' and tb == 'number' then
    if op == '-' then return a - b end
    if op == '*' then return a * b end
    if op == '/' then
      if b == 0 then fail('division by zero', line) end
      return a / b
    end
    if op == '//' then
      if b == 0 then fail('integer division by zero', line) end
      return math.floor(a / b)
    end
    if op == '%' then
      if b == 0 then fail('modulo by zero', line) end
      return a - math.floor(a / b) * b
    end
    if op == '**' then return a ^ b end
  elseif op == '*' and ((ta == 'string' and tb == 'number') or (ta == 'number' and tb == 'string')) then
    if ta == 'number' then a, b = b, a end
    return string.rep(a, math.max(0, b))
  end
  fail(format("unsupported operand types for %s: '%s' and '%s'", op, ta, tb), line)
end

local function less(a, b, line)
  if type(a) == 'number' and type(b) == 'number' then return a < b end
  if type(a) == 'string' and type(b) == 'string' then return a < b end
  fail(format("'<' not supported between '%s' and '%s'", type(a), type(b)), line)
end

local function contains(container, x, line)
  if type(container) == 'string' then
    if type(x) ~= 'string' then fail("'in <string>' requires a string on the left", line) end
    return container:find(x, 1, true) ~= nil
  end
  if is_undef(container) or container == nil then return false end
  if type(container) ~= 'table' or container == none then fail("argument of type '" .. type(container) .. "' is not iterable", line) end
  if is_list(container) and (next(container) ~= nil or type(x) ~= 'string') then
    for _, v in ipairs(container) do if py_eq(v, x) then return true end end
    return false
  end
  return container[x] ~= nil
end

-- A built-in (a function, a method, a filter or a test) given arguments it
-- cannot take fails inside with whatever Lua says ("attempt to perform
-- arithmetic on a string value"); that becomes a template error naming the
-- built-in and the types it got. Template errors, loop signals (tables) and
-- other non-string errors pass through as they are.
local function kind_of(v)
  if v == none then return 'none' end
  if is_undef(v) then return 'undefined' end
  if type(v) == 'table' then return is_list(v) and 'list' or 'dict' end
  return type(v)
end
local function guarded(what, line, f, ...)
  local r = {pcall(f, ...)}
  if r[1] then return unpack(r, 2, table.maxn(r)) end
  local err = r[2]
  if type(err) ~= 'string' or err:find('^chat template') then error(err, 0) end
  if err:find('stack overflow', 1, true) then fail('nested too deeply', line) end
  local n, kinds = select('#', ...), {}
  for i = 1, math.min(n, 6) do kinds[i] = kind_of((select(i, ...))) end
  fail(format('%s cannot take a %s', what, table.concat(kinds, ', ')), line)
end

local function call(fn, args, kwargs, line)
  if is_undef(fn) then fail(format("'%s' is undefined", tostring(fn.name)), line) end
  if type(fn) == 'table' and getmetatable(fn) == Macro then return fn.call(args, kwargs) end
  if type(fn) ~= 'function' then fail("'" .. str(fn) .. "' is not callable", line) end
  if next(kwargs) then return guarded('this function', line, fn, kwargs, unpack(args)) end
  return guarded('this function', line, fn, unpack(args))
end

local function eval_args(e, sc)
  local args, kwargs = {}, {}
  for i, a in ipairs(e) do args[i] = eval(a, sc) end
  return args, kwargs
end
local function eval_kwargs(kw, sc)
  local out = {}
  for k, v in pairs(kw) do out[k] = eval(v, sc) end
  return out
end

function eval(e, sc)
  local k = e[1]
  if k == 'lit' then return e[2] end
  if k == 'name' then
    local v = sc:get(e[2])
    if v == nil then return undefined(e[2]) end
    return v
  end
  if k == 'getattr' then return getattr(eval(e[2], sc), e[3], e.line) end
  if k == 'getitem' then return getitem(eval(e[2], sc), eval(e[3], sc), e.line) end
  if k == 'slice' then
    local a = e[3] and eval(e[3], sc)
    local b = e[4] and eval(e[4], sc)
    local c = e[5] and eval(e[5], sc)
    return slice(eval(e[2], sc), a, b, c, e.line)
  end
  if k == 'and' then
    local a = eval(e[2], sc)
    if not truthy(a) then return a end
    return eval(e[3], sc)
  end
  if k == 'or' then
    local a = eval(e[2], sc)
    if truthy(a) then return a end
    return eval(e[3], sc)
  end
  if k == 'not' then return not truthy(eval(e[2], sc)) end
  if k == 'neg' then
    local v = check_defined(eval(e[2], sc), nil, e.line)
    if type(v) ~= 'number' then fail("bad operand type for unary -: '" .. type(v) .. "'", e.line) end
    return -v
  end
  if k == 'bin' then
    local a, b = eval(e[3], sc), eval(e[4], sc)
    if e[2] == '~' then return str(a) .. str(b) end
    return arith(e[2], a, b, e.line)
  end
  if k == 'compare' then
    local a = eval(e[2], sc)
    for _, op in ipairs(e[3]) do
      local b = eval(op[2], sc)
      local r
      local o = op[1]
      if o == '==' then r = py_eq(a, b)
      elseif o == '!=' then r = not py_eq(a, b)
      elseif o == '<' then r = less(a, b, e.line)
      elseif o == '>' then r = less(b, a, e.line)
      elseif o == '<=' then r = not less(b, a, e.line)
      elseif o == '>=' then r = not less(a, b, e.line)
      elseif o == 'in' then r = contains(b, a, e.line)
      elseif o == 'notin' then r = not contains(b, a, e.line)
      end
      if not r then return false end
      a = b
    end
    return true
  end
  if k == 'cond' then
    if truthy(eval(e[2], sc)) then return eval(e[3], sc) end
    if e[4] then return eval(e[4], sc) end
    return undefined('(else)')
  end
  if k == 'list' then
    local out = {}
    for i, x in ipairs(e[2]) do out[i] = eval(x, sc) end
    return out
  end
  if k == 'dict' then
    local out, ks = {}, {}
    for _, p in ipairs(e[2]) do
      local key = eval(p[1], sc)
      if out[key] == nil then ks[#ks + 1] = key end
      out[key] = eval(p[2], sc)
    end
    return setmetatable(out, {__keys = ks})
  end
  if k == 'call' then
    local fn = eval(e[2], sc)
    local args = eval_args(e[3], sc)
    return call(fn, args, eval_kwargs(e[4], sc), e.line)
  end
  if k == 'filter' then
    local f = filters[e[2]]
    if not f then fail("unsupported filter '" .. e[2] .. "'", e.line) end
    local v = eval(e[3], sc)
    local args = eval_args(e[4], sc)
    return guarded("filter '" .. e[2] .. "'", e.line, f, v, args, eval_kwargs(e[5], sc), e.line, sc)
  end
  if k == 'test' then
    local t = tests[e[2]]
    if not t then fail("unsupported test '" .. e[2] .. "'", e.line) end
    local v = eval(e[3], sc)
    local args = eval_args(e[4], sc)
    local r = guarded("test '" .. e[2] .. "'", e.line, t, v, args, e.line, sc)
    if e[6] then return not r end
    return r
  end
  fail('cannot evaluate ' .. tostring(k), e.line)
end

local function assign(targets, v, sc, line)
  if #targets == 1 then
    local t = targets[1]
    if t[1] == 'name' then
      sc:set(t[2], v)
    else
      local ns = sc:get(t[2])
      if type(ns) ~= 'table' or getmetatable(ns) ~= Namespace then
        fail("cannot assign attribute on non-namespace object '" .. t[2] .. "'", line)
      end
      ns[t[3]] = v
    end
    return
  end
  if type(v) ~= 'table' or not is_list(v) then fail('cannot unpack a non-sequence', line) end
  if #v ~= #targets then fail(format('cannot unpack %d values into %d names', #v, #targets), line) end
  for i, t in ipairs(targets) do
    if t[1] ~= 'name' then fail('cannot unpack into an attribute', line) end
    sc:set(t[2], v[i])
  end
end

-- macro calls under way: a macro that calls itself fails at this depth, long
-- before Lua's stack overflows (which took a megabyte of stack and a million
-- instructions a render)
local MAX_MACRO_DEPTH, macro_depth = 100, 0

local function render_body(b, sc)
  local buf = {}
  exec(b, sc, buf)
  return concat(buf)
end

function exec(body, sc, out)
  for _, s in ipairs(body) do
    local k = s[1]
    if k == 'text' then
      out[#out + 1] = s[2]
    elseif k == 'output' then
      out[#out + 1] = str(eval(s[2], sc))
    elseif k == 'if' then
      local done = false
      for _, br in ipairs(s[2]) do
        if truthy(eval(br[1], sc)) then
          exec(br[2], sc, out)
          done = true
          break
        end
      end
      if not done and s[3] then exec(s[3], sc, out) end
    elseif k == 'for' then
      local items = iterate(eval(s[3], sc), s.line)
      if s[4] then
        local kept = {}
        for _, it in ipairs(items) do
          local ls = scope(sc)
          assign(s[2], it, ls, s.line)
          if truthy(eval(s[4], ls)) then kept[#kept + 1] = it end
        end
        items = kept
      end
      local n = #items
      if n == 0 then
        if s[6] then exec(s[6], sc, out) end
      else
        local loop = setmetatable({length = n, depth = 1, depth0 = 0}, Loop)
        local last_changed
        loop.changed = function(...)
          local v = {...}
          if last_changed and py_eq(last_changed, v) then return false end
          last_changed = v
          return true
        end
        for i = 1, n do
          loop.index, loop.index0 = i, i - 1
          loop.revindex, loop.revindex0 = n - i + 1, n - i
          loop.first, loop.last = i == 1, i == n
          loop.previtem = i > 1 and items[i - 1] or undefined('previtem')
          loop.nextitem = i < n and items[i + 1] or undefined('nextitem')
          loop.cycle = function(...)
            local c = {...}
            if #c == 0 then fail('no items for cycling given', s.line) end
            return c[(i - 1) % #c + 1]
          end
          local ls = scope(sc)
          ls:set('loop', loop)
          assign(s[2], items[i], ls, s.line)
          local ok, err = pcall(exec, s[5], ls, out)
          if not ok then
            if err == BreakSignal then break end
            if err ~= ContinueSignal then error(err, 0) end
          end
        end
      end
    elseif k == 'set' then
      assign(s[2], eval(s[3], sc), sc, s.line)
    elseif k == 'setblock' then
      assign(s[2], render_body(s[3], sc), sc, s.line)
    elseif k == 'macro' then
      local params, b, def_scope = s[3], s[4], sc
      local m = setmetatable({name = s[2]}, Macro)
      m.call = function(args, kwargs)
        local ms = scope(def_scope)
        for i, p in ipairs(params) do
          local v = args[i]
          if v == nil then v = kwargs[p[1]] end
          if v == nil then
            if p[2] then v = eval(p[2], ms) else v = undefined(p[1]) end
          end
          ms:set(p[1], v)
        end
        if macro_depth >= MAX_MACRO_DEPTH then fail('nested too deeply (a macro that calls itself?)', s.line) end
        macro_depth = macro_depth + 1
        local ok, r = pcall(render_body, b, ms)
        macro_depth = macro_depth - 1
        if not ok then error(r, 0) end
        return r
      end
      sc:set(s[2], m)
    elseif k == 'with' then
      local ws = scope(sc)
      for _, a in ipairs(s[2]) do ws:set(a[1], eval(a[2], sc)) end
      exec(s[3], ws, out)
    elseif k == 'block' then
      exec(s[2], sc, out)
    elseif k == 'filterblock' then
      local f = filters[s[2]]
      if not f then fail("unsupported filter '" .. s[2] .. "'", s.line) end
      out[#out + 1] = str(f(render_body(s[5], sc), eval_args(s[3], sc), eval_kwargs(s[4], sc), s.line, sc))
    elseif k == 'do' then
      eval(s[2], sc)
    elseif k == 'break' then
      error(BreakSignal, 0)
    elseif k == 'continue' then
      error(ContinueSignal, 0)
    end
  end
end

---------------------------------------------------------------------------
-- filters and tests

local function test_fn(name, line)
  local t = tests[name]
  if not t then fail("unsupported test '" .. tostring(name) .. "'", line) end
  return t
end

local function attr_path(v, path, line)
  for part in tostring(path):gmatch('[^.]+') do
    local n = tonumber(part)
    v = getitem(v, n or part, line)
  end
  return v
end

local function select_items(v, args, line, sc, want, attr)
  local out = {}
  local name = args[1]
  local rest = {}
  for i = 2, #args do rest[#rest + 1] = args[i] end
  for _, x in ipairs(iterate(v, line)) do
    local subject = attr and attr_path(x, attr, line) or x
    local r
    if name == nil then r = truthy(subject) else r = test_fn(name, line)(subject, rest, line, sc) end
    if r == want then out[#out + 1] = x end
  end
  return out
end

filters = {
  trim = function(v, args) return py_strip(str(check_defined(v)), args[1], true, true) end,
  length = function(v) return len_of(v) end,
  upper = function(v) return U.upper(str(v)) end,
  lower = function(v) return U.lower(str(v)) end,
  capitalize = function(v) local s = str(v) return U.upper(sub(s, 1, 1)) .. U.lower(sub(s, 2)) end,
  title = function(v) return title(str(v)) end,
  string = function(v) return str(v) end,
  tojson = function(v, args, kw)
    local indent = kw.indent
    if indent == nil then indent = args[1] end
    return M.tojson(v, {indent = indent, separators = kw.separators, sort_keys = kw.sort_keys})
  end,
  default = function(v, args, kw)
    local boolean = args[2] or kw.boolean
    local d = args[1] or kw.default_value
    if d == nil then d = '' end
    if is_undef(v) or (truthy(boolean) and not truthy(v)) then return d end
    return v
  end,
  join = function(v, args, kw, line)
    local sep = args[1] or kw.d or ''
    local attr = args[2] or kw.attribute
    local parts = {}
    for i, x in ipairs(iterate(v, line)) do
      if attr then x = attr_path(x, attr, line) end
      parts[i] = str(x)
    end
    return concat(parts, str(sep))
  end,
  items = function(v, _, _, line)
    if is_undef(v) then return {} end
    if type(v) ~= 'table' or is_list(v) and next(v) ~= nil then fail('items: expected a mapping', line) end
    return dict_method(v, 'items')()
  end,
  list = function(v, _, _, line)
    local out = {}
    for i, x in ipairs(iterate(v, line)) do out[i] = x end
    return out
  end,
  first = function(v, _, _, line)
    local it = iterate(v, line)
    if #it == 0 then return undefined('first') end
    return it[1]
  end,
  last = function(v, _, _, line)
    local it = iterate(v, line)
    if #it == 0 then return undefined('last') end
    return it[#it]
  end,
  reverse = function(v, _, _, line)
    if type(v) == 'string' then
      local cs = U.chars(v)
      local out = {}
      for i = #cs, 1, -1 do out[#out + 1] = cs[i] end
      return concat(out)
    end
    local it, out = iterate(v, line), {}
    for i = #it, 1, -1 do out[#out + 1] = it[i] end
    return out
  end,
  select = function(v, args, _, line, sc) return select_items(v, args, line, sc, true) end,
  reject = function(v, args, _, line, sc) return select_items(v, args, line, sc, false) end,
  selectattr = function(v, args, _, line, sc)
    local rest = {}
    for i = 2, #args do rest[#rest + 1] = args[i] end
    return select_items(v, rest, line, sc, true, args[1])
  end,
  rejectattr = function(v, args, _, line, sc)
    local rest = {}
    for i = 2, #args do rest[#rest + 1] = args[i] end
    return select_items(v, rest, line, sc, false, args[1])
  end,
  map = function(v, args, kw, line, sc)
    local out = {}
    for i, x in ipairs(iterate(v, line)) do
      if kw.attribute then
        local r = attr_path(x, kw.attribute, line)
        if is_undef(r) and kw.default ~= nil then r = kw.default end
        out[i] = r
      else
        local f = filters[args[1]]
        if not f then fail("unsupported filter '" .. tostring(args[1]) .. "'", line) end
        local rest = {}
        for j = 2, #args do rest[#rest + 1] = args[j] end
        out[i] = f(x, rest, {}, line, sc)
      end
    end
    return out
  end,
  replace = function(v, args) return replace_str(str(v), str(args[1]), str(args[2]), args[3]) end,
  int = function(v, args)
    local n = tonumber(v)
    if type(v) == 'boolean' then n = v and 1 or 0 end
    if not n then return args[1] or 0 end
    return n >= 0 and math.floor(n) or math.ceil(n)
  end,
  float = function(v, args)
    local n = tonumber(v)
    if not n then return args[1] or 0 end
    return n
  end,
  abs = function(v) return math.abs(v) end,
  round = function(v, args, kw)
    local p = args[1] or kw.precision or 0
    local method = args[2] or kw.method or 'common'
    local m = 10 ^ p
    if method == 'ceil' then return math.ceil(v * m) / m end
    if method == 'floor' then return math.floor(v * m) / m end
    local x = v * m
    return (x >= 0 and math.floor(x + 0.5) or -math.floor(-x + 0.5)) / m
  end,
  sum = function(v, args, kw, line)
    local total = args[2] or kw.start or 0
    for _, x in ipairs(iterate(v, line)) do
      if kw.attribute or args[1] then x = attr_path(x, kw.attribute or args[1], line) end
      total = total + x
    end
    return total
  end,
  unique = function(v, _, _, line)
    local out = {}
    for _, x in ipairs(iterate(v, line)) do
      local seen = false
      for _, y in ipairs(out) do if py_eq(x, y) then seen = true break end end
      if not seen then out[#out + 1] = x end
    end
    return out
  end,
  sort = function(v, args, kw, line)
    local out = {}
    for i, x in ipairs(iterate(v, line)) do out[i] = x end
    local attr = kw.attribute
    local rev = args[1] or kw.reverse
    table.sort(out, function(a, b)
      if attr then a, b = attr_path(a, attr, line), attr_path(b, attr, line) end
      if rev then return less(b, a, line) end
      return less(a, b, line)
    end)
    return out
  end,
  min = function(v, _, _, line)
    local best
    for _, x in ipairs(iterate(v, line)) do if best == nil or less(x, best, line) then best = x end end
    return best == nil and undefined('min') or best
  end,
  max = function(v, _, _, line)
    local best
    for _, x in ipairs(iterate(v, line)) do if best == nil or less(best, x, line) then best = x end end
    return best == nil and undefined('max') or best
  end,
  safe = function(v) return v end,
  escape = function(v)
    return (str(v):gsub('[&<>"\']', {['&'] = '&amp;', ['<'] = '&lt;', ['>'] = '&gt;', ['"'] = '&#34;', ["'"] = '&#39;'}))
  end,
  indent = function(v, args, kw)
    local width = args[1] or kw.width or 4
    local first = args[2] or kw.first
    local blank = args[3] or kw.blank
    local pad = type(width) == 'string' and width or string.rep(' ', width)
    local lines = py_split(str(v), '\n')
    for i, l in ipairs(lines) do
      if (i > 1 or truthy(first)) and (truthy(blank) or l ~= '') then lines[i] = pad .. l end
    end
    return concat(lines, '\n')
  end,
  wordcount = function(v) return #py_split(str(v)) end,
  dictsort = function(v)
    local out = {}
    for _, k in ipairs(keys_of(v)) do out[#out + 1] = {k, v[k]} end
    return out
  end,
}
filters.count, filters.d, filters.e = filters.length, filters.default, filters.escape

local function is_number(v) return type(v) == 'number' end
tests = {
  defined = function(v) return not is_undef(v) end,
  undefined = function(v) return is_undef(v) end,
  none = function(v) return v == none end,
  string = function(v) return type(v) == 'string' end,
  number = is_number,
  integer = function(v) return is_number(v) and v == math.floor(v) end,
  float = function(v) return is_number(v) and v ~= math.floor(v) end,
  boolean = function(v) return type(v) == 'boolean' end,
  ['true'] = function(v) return v == true end,
  ['false'] = function(v) return v == false end,
  mapping = function(v) return is_dict(v) end,
  sequence = function(v) return type(v) == 'string' or (v ~= none and is_list(v) and not is_undef(v)) end,
  iterable = function(v)
    if type(v) == 'string' then return true end
    if type(v) ~= 'table' or v == none or is_undef(v) then return false end
    local mt = getmetatable(v)
    return mt ~= Namespace and mt ~= Loop and mt ~= Macro
  end,
  callable = function(v) return type(v) == 'function' or (type(v) == 'table' and getmetatable(v) == Macro) end,
  equalto = function(v, args) return py_eq(v, args[1]) end,
  ne = function(v, args) return not py_eq(v, args[1]) end,
  lt = function(v, args, line) return less(v, args[1], line) end,
  gt = function(v, args, line) return less(args[1], v, line) end,
  le = function(v, args, line) return not less(args[1], v, line) end,
  ge = function(v, args, line) return not less(v, args[1], line) end,
  odd = function(v) return v % 2 == 1 end,
  even = function(v) return v % 2 == 0 end,
  divisibleby = function(v, args) return v % args[1] == 0 end,
  ['in'] = function(v, args, line) return contains(args[1], v, line) end,
  sameas = function(v, args) return v == args[1] end,
  lower = function(v) return type(v) == 'string' and U.lower(v) == v end,
  upper = function(v) return type(v) == 'string' and U.upper(v) == v end,
}
tests.eq, tests['=='], tests['!='], tests['<'], tests['>'], tests['<='], tests['>='] =
  tests.equalto, tests.equalto, tests.ne, tests.lt, tests.gt, tests.le, tests.ge
tests.greaterthan, tests.lessthan = tests.gt, tests.lt

M.filters, M.tests = filters, tests

---------------------------------------------------------------------------
-- the environment transformers gives chat templates

local function globals()
  return {
    raise_exception = function(msg) error('chat template: ' .. str(msg), 0) end,
    strftime_now = function(fmt) return os.date(fmt) end,
    namespace = function(kw, ...)
      local ns = setmetatable({}, Namespace)
      if type(kw) == 'table' then for k, v in pairs(kw) do ns[k] = v end end
      if select('#', ...) > 0 then fail('namespace() takes keyword arguments') end
      return ns
    end,
    range = function(a, b, c)
      if b == nil then a, b = 0, a end
      c = c or 1
      local out = {}
      local i = a
      while (c > 0 and i < b) or (c < 0 and i > b) do
        out[#out + 1] = i
        i = i + c
      end
      return out
    end,
    dict = function(kw)
      local d = {}
      if type(kw) == 'table' then for k, v in pairs(kw) do d[k] = v end end
      return d
    end,
  }
end

local Template = {}
Template.__index = Template
M.Template = Template

-- a compiled template; name is used in error messages
function M.compile(source, name)
  if type(source) ~= 'string' then error('jinja.compile: the template must be a string', 2) end
  local ok, r = pcall(function() return parse(lex(source)) end)
  if not ok then
    if type(r) == 'string' and r:find('stack overflow', 1, true) then r = 'chat template: nested too deeply' end
    if name and name ~= 'chat template' then r = tostring(r):gsub('^chat template', name) end
    error(r, 0)
  end
  return setmetatable({body = r, source = source, name = name}, Template)
end

-- the text of the template with vars (a table of names to values)
function Template:render(vars)
  macro_depth = 0
  local root = scope(nil)
  for k, v in pairs(globals()) do root:set(k, v) end
  local sc = scope(root)
  for k, v in pairs(vars or {}) do sc:set(k, v) end
  local out = {}
  local ok, err = pcall(exec, self.body, sc, out)
  if not ok then
    if err == BreakSignal or err == ContinueSignal then err = 'chat template: break or continue outside a loop' end
    if type(err) == 'string' and err:find('stack overflow', 1, true) then
      err = 'chat template: nested too deeply (a macro that calls itself?)'
    end
    error(err, 0)
  end
  return concat(out)
end

-- the whole environment in one call
function M.render(source, vars) return M.compile(source):render(vars) end

return M
