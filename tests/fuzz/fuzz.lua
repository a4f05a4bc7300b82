-- tests/fuzz/fuzz.lua: what the Lua fuzzers run with one input: the entries
-- of the libFuzzer harness tests/fuzz/fuzz_lua.c (make fuzz) and of the
-- randomized test tests/lua/test_fuzz_text.lua. An input may fail, but only
-- with one of gpush's own errors: an error that the code did not raise on
-- purpose (an "attempt to index a nil value", a "bad argument" from the
-- standard library, ...) is a finding, raised as "FINDING: ...".
local gp = rawget(_G, 'gp') or require 'gpush'
local M = {}

-- the errors of a bug, as opposed to the message of a refused input
local BUG = {'attempt to ', 'bad argument', 'table index is nil', 'table index is NaN', 'stack overflow',
             'invalid order function', 'string length overflow', 'number has no integer representation',
             'C stack overflow', 'error in error handling'}

-- the error a fuzzer raises when an input has run too long (a table, so that
-- no error handler takes it for a message): it ends the input, it is no finding
M.BUDGET = rawget(_G, 'FUZZ_BUDGET') or setmetatable({}, {__tostring = function() return 'fuzz: budget' end})

-- err: a refused input (fine) or the fuzzer's budget (fine), else a finding.
-- input: the text under test; a message may quote it (an unknown type name),
-- and the fuzzers learn the phrases below from the compares of this very
-- function, so a phrase that the input holds counts only where Lua itself
-- put it: right after the "chunk:line: " that starts a runtime error
local function lua_error_is(err, b)
  local at = err:find(b, 1, true)
  while at do
    if err:sub(1, at - 1):find('^[^%s]+:%d+: $') then return true end
    at = err:find(b, at + 1, true)
  end
  return false
end
function M.check(err, what, input)
  if err == M.BUDGET then error(err, 0) end -- stop this input
  if type(err) ~= 'string' then error(string.format('FINDING: %s raised a %s, not a message', what, type(err)), 0) end
  if err:find('^chat template') then return end -- the template language's own errors
  for _, b in ipairs(BUG) do
    if err:find(b, 1, true) and (not (input and input:find(b, 1, true)) or lua_error_is(err, b)) then
      error(string.format('FINDING: %s: %s', what, err), 0)
    end
  end
end

-- run fn(...) with a budget of about n thousand VM instructions (the JIT off:
-- count hooks do not reach compiled code); returns pcall's results
function M.bounded(n, fn, ...)
  local left = n
  debug.sethook(function() left = left - 1; if left <= 0 then error(M.BUDGET, 0) end end, '', 1000)
  local r = {pcall(fn, ...)}
  debug.sethook()
  return unpack(r, 1, table.maxn(r))
end

-- texts to encode: few and short (each input encodes them all; a padded
-- tokenizer makes hundreds of ids of each), between them: none, blanks,
-- words, accents, digits, punctuation, CJK, control bytes and NUL, added
-- and special tokens, bytes that are not UTF-8
local TEXTS = {'', ' ', 'Hello world', 'héllo  wörld 12345 !! 日本語の ab ab', 'a\0b\t\n\r  x',
               '<|endoftext|> and <s>[CLS]', '\xff\xfe bytes'}

-- a tokenizer.json document: load it, then encode and decode a few texts
-- (and name each id the encodings hold, once)
function M.tokenizer(s)
  local ok, tok = pcall(gp.tokenizer.from_json, s)
  if not ok then return M.check(tok, 'from_json', s) end
  local named = {}
  for _, text in ipairs(TEXTS) do
    local ok2, ids = pcall(tok.encode, tok, text)
    if not ok2 then M.check(ids, 'encode', s)
    else
      local ok3, back = pcall(tok.decode, tok, ids)
      if not ok3 then M.check(back, 'decode', s) end
      for _, id in ipairs(ids) do
        if not named[id] then
          named[id] = true
          local ok4, t = pcall(tok.id_to_token, tok, id)
          if not ok4 then M.check(t, 'id_to_token', s) end
        end
      end
    end
  end
end

local MESSAGES = {
  {role = 'system', content = 'You are helpful.'},
  {role = 'user', content = 'Hi <b>there</b>'},
  {role = 'assistant', content = 'Hello!', tool_calls = {{['function'] = {name = 'f', arguments = {x = 1}}}}},
  {role = 'user', content = {{type = 'text', text = 'part'}, {type = 'image'}}},
  {role = 'tool', content = '42', name = 'f'},
}
local CONTEXTS = {
  {messages = MESSAGES, add_generation_prompt = true, bos_token = '<s>', eos_token = '</s>'},
  {messages = {MESSAGES[2]}, add_generation_prompt = false, tools = {{name = 'f', description = 'd'}}},
  {messages = {}, bos_token = '', custom = {1, 2, 3}, n = 0},
}

-- a chat template: compile it, then render it with a few conversations
function M.jinja(s)
  local ok, tpl = pcall(gp.tokenizer.template, s)
  if not ok then return M.check(tpl, 'compile', s) end
  for _, vars in ipairs(CONTEXTS) do
    local ok2, out = pcall(tpl.render, tpl, vars)
    if not ok2 then M.check(out, 'render', s)
    elseif type(out) ~= 'string' then error('FINDING: render returned a ' .. type(out), 0) end
  end
end

return M
