-- tests/fuzz/random_text.lua: a randomized test of the Lua parsers of outside
-- input, run in a process of its own by tests/lua/test_fuzz_text.lua (and by
-- hand for longer runs):
--
--   build/gpush tests/fuzz/random_text.lua [jinja|tokenizer] [iterations] [seed]
--   FUZZ_TEXT_DIGEST=1 build/gpush tests/fuzz/random_text.lua jinja 3000 26   (and a digest of the inputs)
--
-- A seed draws the same inputs on every run (keys are sorted before a draw,
-- gp.json.encode writes them sorted): the digest shows it.
-- jinja: templates drawn from a grammar of the Jinja subset (text, {{ }},
-- if/elif/else, for with loop.*, set, namespace, macros, filters, tests,
-- slices, every operator) and the fixture templates with bytes and tokens
-- changed, each compiled and rendered with several conversations.
-- tokenizer: the seed tokenizer.json files (tests/fuzz/corpus/tokenizer)
-- changed where it hurts (a key dropped, a value of another type, a number
-- out of range, an array entry doubled, a merge or vocab entry broken), each
-- loaded and used to encode and decode texts.
-- An input may be refused, but only with one of gpush's own errors
-- (tests/fuzz/fuzz.lua): anything else is a finding, printed with its input
-- (%q) and counted; the exit status is the number of findings (at most 100).
local root = rawget(_G, 'GPUSH_ROOT') or '.'
package.path = root .. '/tests/fuzz/?.lua;' .. package.path
local F = require 'fuzz'

local kind, iters, seed = arg[1] or 'jinja', tonumber(arg[2]) or 2000, tonumber(arg[3]) or 1
jit.off() -- the budget's count hook (fuzz.lua: bounded) sees interpreted code only
math.randomseed(seed)
local R = math.random
local function pick(t) return t[R(1, #t)] end
local function read(path) local f = assert(io.open(path, 'rb')); local s = f:read('*a'); f:close(); return s end

---------------------------------------------------------------------------
-- jinja: a grammar

local NAMES = {'messages', 'm', 'message', 'loop', 'bos_token', 'eos_token', 'add_generation_prompt', 'tools', 'ns',
               'x', 'i', 'custom', 'n', 'undefined_name', 'none', 'true', 'false', 'range', 'namespace', 'raise_exception'}
local FILTERS = {'trim', 'upper', 'lower', 'length', 'tojson', 'string', 'int', 'float', 'first', 'last', 'list',
                 'join', "join(', ')", "replace('a', 'b')", 'reverse', 'sort', 'unique', 'items', 'default("d")',
                 "selectattr('role', 'equalto', 'user')", "rejectattr('role')", "map(attribute='role')", 'capitalize',
                 'title', 'tojson(indent=2)', 'safe', 'e', 'abs', 'round', "indent(4)", 'wordcount', 'count', 'sum',
                 'max', 'min', 'dictsort', "split(',')", 'batch(2)', 'slice(2)', 'center(9)'}
local TESTS = {'defined', 'undefined', 'none', 'string', 'number', 'mapping', 'iterable', 'sequence', 'true', 'false',
               'odd', 'even', 'divisibleby(3)', "equalto('user')", 'boolean', 'integer', 'float', 'callable', 'in([1])'}
local BINOPS = {'+', '-', '*', '/', '//', '%', '**', '~', '==', '!=', '<', '<=', '>', '>=', 'and', 'or', 'in', 'not in',
                'is', 'is not'}

local expr
local function atom(d)
  local c = R(1, 12)
  if c <= 3 or d > 3 then return pick(NAMES)
  elseif c == 4 then return tostring(R(-3, 1000) / pick {1, 1, 1, 2, 0.5, 3})
  elseif c == 5 then return pick {"'user'", '"assistant"', "'<|im_start|>'", "''", "'\\n'", "'a\\'b'", '"x\\u00e9"'}
  elseif c == 6 then return '[' .. expr(d + 1) .. ', ' .. expr(d + 1) .. ']'
  elseif c == 7 then return "{'role': " .. expr(d + 1) .. ', ' .. expr(d + 1) .. ': 1}'
  elseif c == 8 then return '(' .. expr(d + 1) .. ')'
  elseif c == 9 then return pick(NAMES) .. '.' .. pick {'role', 'content', 'index0', 'first', 'last', 'length', 'n',
    'strip()', 'split()', 'startswith("a")', 'endswith("b")', 'get("k")', 'items()', 'keys()', 'values()', 'upper()',
    'lstrip("x")', 'format(1)', 'append(1)', 'update({})', 'tool_calls', 'function', 'arguments', 'previtem'}
  elseif c == 10 then return pick(NAMES) .. '[' .. pick {'0', '-1', "'role'", '1:', ':2', '::-1', '::0', '5:1', expr(d + 1)} .. ']'
  elseif c == 11 then return pick {'range', 'namespace', 'raise_exception', 'dict', 'strftime_now', 'x'} .. '(' ..
    pick {'', expr(d + 1), expr(d + 1) .. ', ' .. expr(d + 1), 'n=1', '10**9', '-1', '3, 0'} .. ')'
  else return pick {'not ', '-', '+'} .. expr(d + 1) end
end
expr = function(d)
  d = d or 0
  local e = atom(d)
  for _ = 1, R(0, d > 2 and 0 or 2) do
    local c = R(1, 5)
    if c <= 2 then e = e .. ' ' .. pick(BINOPS) .. ' ' .. atom(d + 1)
    elseif c == 3 then e = e .. ' | ' .. pick(FILTERS)
    elseif c == 4 then e = e .. ' is ' .. pick {'', 'not '} .. pick(TESTS)
    else e = e .. ' if ' .. atom(d + 1) .. ' else ' .. atom(d + 1) end
  end
  return e
end

local function ws() return pick {'', '', '-', '+'} end
local block
local function stmt(d)
  local c = R(1, d > 3 and 3 or 12)
  if c == 1 then return pick {'text ', '\n', '<|im_start|>', '  ', '{#c#}', '}}', '%}', '{', 'é'} end
  if c <= 3 then return '{{' .. ws() .. ' ' .. expr() .. ' ' .. ws() .. '}}' end
  if c <= 5 then
    local s = '{%' .. ws() .. ' if ' .. expr() .. ' %}' .. block(d + 1)
    for _ = 1, R(0, 2) do s = s .. '{% elif ' .. expr() .. ' %}' .. block(d + 1) end
    if R(1, 2) == 1 then s = s .. '{% else %}' .. block(d + 1) end
    return s .. '{%' .. ws() .. ' endif ' .. ws() .. '%}'
  end
  if c <= 7 then
    return '{% for ' .. pick {'x', 'm', 'k, v', 'i'} .. ' in ' .. expr() .. pick {'', ' if ' .. expr(), ' recursive'} ..
      ' %}' .. block(d + 1) .. pick {'', '{% break %}', '{% continue %}', '{{ loop.index }}'} ..
      (R(1, 3) == 1 and '{% else %}' .. block(d + 1) or '') .. '{% endfor %}'
  end
  if c == 8 then return '{% set ' .. pick {'x', 'ns.n', 'ns', 'y'} .. ' = ' .. expr() .. ' %}' end
  if c == 9 then return '{% set ns = namespace(n=' .. expr() .. ') %}' end
  if c == 10 then
    return '{% macro ' .. pick {'f', 'g'} .. '(' .. pick {'', 'a', 'a, b=2'} .. ') %}' .. block(d + 1) ..
      '{% endmacro %}{{ ' .. pick {'f', 'g'} .. '(' .. pick {'', '1', '1, 2', 'b=3'} .. ') }}'
  end
  if c == 11 then return '{% generation %}' .. block(d + 1) .. '{% endgeneration %}' end
  return pick {'{% raw %}{{ x }}{% endraw %}', '{%- if true -%} t {%- endif -%}', '{{- "x" -}}', '{% filter upper %}a{% endfilter %}'}
end
block = function(d)
  local s = {}
  for i = 1, R(0, 4) do s[i] = stmt(d) end
  return table.concat(s)
end

-- byte and token edits of a text
local PIECES = {'{{', '}}', '{%', '%}', '{#', '#}', 'endif', 'endfor', 'else', '|', '(', ')', '[', ']', "'", '"', '.',
                ',', ':', '-', '~', 'loop', 'in', 'not', '\0', '\255', '\n'}
local function mutate(s)
  for _ = 1, R(1, 6) do
    local i = R(1, #s + 1)
    local c = R(1, 4)
    if c == 1 then s = s:sub(1, i - 1) .. s:sub(i + R(1, 8))
    elseif c == 2 then s = s:sub(1, i - 1) .. pick(PIECES) .. s:sub(i)
    elseif c == 3 then s = s:sub(1, i - 1) .. string.char(R(0, 255)) .. s:sub(i + 1)
    else local j = R(1, #s + 1); s = s:sub(1, i - 1) .. s:sub(j, j + R(0, 40)) .. s:sub(i) end
  end
  return s
end

local templates = {}
for name in io.popen('ls ' .. root .. '/tests/fuzz/corpus/jinja/*'):lines() do templates[#templates + 1] = read(name) end

---------------------------------------------------------------------------
-- tokenizer.json: structural changes of the seeds

local seeds = {}
for name in io.popen('ls ' .. root .. '/tests/fuzz/corpus/tokenizer/*.json'):lines() do
  seeds[#seeds + 1] = read(name)
end

-- numbers (array indices) before strings, each in their order
local function by_key(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return ta < tb end
  return a < b
end

local function paths(t, prefix, out, depth)
  out[#out + 1] = prefix
  if depth > 6 or type(t) ~= 'table' then return out end
  local keys, n = {}, 0
  for k in pairs(t) do n = n + 1; keys[n] = k end
  -- in a fixed order before drawing: pairs follows string hashes that differ
  -- from process to process (and gp.json.encode writes keys sorted), so that
  -- a seed draws the same inputs on every run
  table.sort(keys, by_key)
  -- a vocabulary of thousands: a few of its entries
  for _ = 1, math.min(n, 12) do
    local k = keys[R(1, n)]
    paths(t[k], (function() local p = {unpack(prefix)}; p[#p + 1] = k; return p end)(), out, depth + 1)
  end
  return out
end

local VALUES = {function() return gp.json.null end, function() return R(-5, 300000) end, function() return -1.5 end,
                function() return 2 ^ 60 end, function() return '' end, function() return 'Ġ' end,
                function() return true end, function() return {} end, function() return {1, 'a'} end,
                function() return {type = 'BPE'} end, function() return {type = pick {'Sequence', 'Replace', 'Split',
                  'ByteLevel', 'Metaspace', 'WordPiece', 'NFC', 'NFKC', 'Lowercase', 'Strip', 'Prepend', 'TemplateProcessing',
                  'BertProcessing', 'RobertaProcessing', 'ByteFallback', 'Fuse', 'Digits', 'Punctuation', 'Whitespace'}} end,
                function() return {pattern = {Regex = pick {'(', '[a-', '\\p{L}+', '.*', '(?<=x)'}}, content = 'x'} end}

local function change(doc)
  for _ = 1, R(1, 3) do
    local ps = paths(doc, {}, {}, 0)
    local p = ps[R(2, math.max(2, #ps))] or {}
    if #p == 0 then break end
    local parent = doc
    for i = 1, #p - 1 do parent = parent[p[i]] end
    local k, c = p[#p], R(1, 5)
    if type(parent) ~= 'table' then break end
    if c == 1 then parent[k] = nil
    elseif c <= 3 then parent[k] = pick(VALUES)()
    elseif c == 4 and type(parent[k]) == 'table' and #parent[k] > 0 then
      local a = parent[k]
      a[#a + 1] = a[R(1, #a)]
    elseif type(parent[k]) == 'string' then parent[k] = mutate(parent[k])
    elseif type(parent[k]) == 'number' then parent[k] = pick {0, -1, 1e9, 0.5, parent[k] + 1} end
  end
  return doc
end

---------------------------------------------------------------------------

-- FUZZ_TEXT_DIGEST=1: print a digest of every input drawn (FNV-1a, 32 bits),
-- the same for the same seed on every run and machine
local digest = os.getenv('FUZZ_TEXT_DIGEST') and 2166136261
local function add_digest(s)
  local h, byte, bxor, tobit, lshift = digest, string.byte, bit.bxor, bit.tobit, bit.lshift
  h = tobit(lshift(bxor(h, #s), 24) + bxor(h, #s) * 403)
  for i = 1, #s do
    h = bxor(h, byte(s, i))
    h = tobit(lshift(h, 24) + h * 403) -- h * 16777619 modulo 2^32
  end
  digest = h
end

local findings, t0 = 0, os.clock()
for it = 1, iters do
  local input
  if kind == 'jinja' then
    local c = R(1, 3)
    input = c == 1 and mutate(pick(templates)) or block(0)
  else
    local ok, doc = pcall(gp.json.decode, pick(seeds))
    assert(ok)
    local ok2, text = pcall(gp.json.encode, change(doc)) -- a change may make a table JSON cannot write
    input = ok2 and (R(1, 8) == 1 and mutate(text) or text) or pick(seeds)
  end
  if digest then add_digest(input) end
  local ok, err = F.bounded(500, F[kind], input) -- the harness's budget (fuzz_lua.c)
  if not ok and tostring(err):find('FINDING', 1, true) then
    findings = findings + 1
    print(string.format('finding %d (iteration %d, seed %d): %s\ninput: %q', findings, it, seed, tostring(err),
      #input < 4000 and input or input:sub(1, 4000)))
    if findings >= 100 then break end
  end
end
print(string.format('%s: %d inputs, %d findings, %.1f s', kind, iters, findings, os.clock() - t0))
if digest then print(string.format('%s: digest of the inputs (seed %d): %08x', kind, seed, digest % 2 ^ 32)) end
os.exit(findings)
