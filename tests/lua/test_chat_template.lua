-- Chat templates: the Jinja subset of gpush.text.jinja against jinja2 set up
-- as transformers sets it up (trim_blocks, lstrip_blocks, loopcontrols,
-- raise_exception, strftime_now, a tojson that keeps non-ASCII): the chat
-- templates of SmolLM2, Qwen2.5 and Llama 3, 3.1 and 3.2 on conversations
-- with system prompts, several turns, Unicode, tools and tool calls, and one
-- small template per construct. Expected texts: tests/fixtures/tokenizers/make.py.
local T = require 'lib'

local root = (GPUSH_ROOT or '.') .. '/tests/fixtures/tokenizers'
local json = gp.json

local function read(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end

local E = json.decode(read(root .. '/templates/chat_expected.json'))

-- the variables transformers passes: the special tokens, tools and documents
-- (None unless given), the case's own; strftime_now pinned to the fixture's date
local function vars_of(c)
  local vars = {messages = E.chats[c.chat], tools = json.null, documents = json.null}
  for k, v in pairs(c.special) do vars[k] = v end
  for k, v in pairs(c.vars) do vars[k] = v end
  vars.strftime_now = function() return E.strftime_now end
  return vars
end

local function first_difference(a, b)
  local i = 1
  while i <= #a and i <= #b and a:sub(i, i) == b:sub(i, i) do i = i + 1 end
  return string.format('first difference at byte %d:\n  got  %q\n  want %q', i, a:sub(math.max(1, i - 40), i + 40), b:sub(math.max(1, i - 40), i + 40))
end

local by_template = {}
for _, c in ipairs(E.cases) do
  by_template[c.template] = by_template[c.template] or {}
  table.insert(by_template[c.template], c)
end
local names = {}
for name in pairs(by_template) do names[#names + 1] = name end
table.sort(names)
for _, name in ipairs(names) do
  local cases = by_template[name]
  T.test(string.format('chat template %s: %d conversations rendered as jinja2 renders them', name, #cases), function()
    local tpl = gp.tokenizer.template(read(root .. '/templates/' .. name .. '.jinja'))
    for _, c in ipairs(cases) do
      local got = tpl:render(vars_of(c))
      if got ~= c.expected then
        T.ok(false, string.format('%s, %s, %s: %s', name, c.chat, json.encode(c.vars), first_difference(got, c.expected)))
      end
    end
  end)
end

T.test(string.format('chat templates: %d constructs one at a time, as jinja2 renders them (or fails)', #E.units), function()
  for _, u in ipairs(E.units) do
    local ok, got = pcall(function() return gp.tokenizer.template(u.source):render(u.vars) end)
    if u.error then
      T.ok(not ok, 'no error from ' .. u.source .. ' (jinja2: ' .. u.jinja2_error .. ')')
      T.ok(tostring(got):find('chat template', 1, true) and tostring(got):find(u.error, 1, true),
        string.format('the error of %q is %q; it should mention %q', u.source, tostring(got), u.error))
    else
      T.ok(ok, string.format('%q failed: %s', u.source, tostring(got)))
      T.ok(got == u.expected, string.format('%q: %s', u.source, first_difference(got, u.expected)))
    end
  end
end)

T.test('chat template: tok:apply_chat_template from tokenizer_config.json and from GGUF metadata (SmolLM2)', function()
  local toks = {gp.tokenizer.load(root .. '/smollm2'),
                gp.tokenizer.from_gguf(json.decode(read(root .. '/smollm2/gguf_meta.json')))}
  local n = 0
  for _, tok in ipairs(toks) do
    for _, c in ipairs(E.cases) do
      if c.template == 'smollm2' then
        local opts = {}
        for k, v in pairs(c.vars) do opts[k] = v end
        local got = tok:apply_chat_template(E.chats[c.chat], opts)
        T.ok(got == c.expected, first_difference(got, c.expected))
        n = n + 1
      end
    end
  end
  T.ok(n >= 12)
  local tok = toks[1]
  local chat = {{role = 'user', content = 'Hi'}}
  local text = tok:apply_chat_template(chat, {add_generation_prompt = true})
  T.eq(text, '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' ..
    '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')
  -- tokenize = true encodes without adding special tokens, as transformers does
  local ids = tok:apply_chat_template(chat, {add_generation_prompt = true, tokenize = true})
  T.eq(table.concat(ids, ' '), table.concat(tok:encode(text, {add_special_tokens = false}), ' '))
  T.eq(ids[1], tok.bos_id)
  -- another template for one call
  T.eq(tok:apply_chat_template(chat, {chat_template = '{{ bos_token }}{{ messages[0].content }}'}), '<|im_start|>Hi')
  -- extra options are template variables
  T.eq(tok:apply_chat_template(chat, {chat_template = '{{ greeting }} {{ tools is none }}', greeting = 'hey'}), 'hey True')
  T.raises(function() tok:apply_chat_template('hi') end, 'messages must be a list')
end)

T.test('chat template: chat_template.jinja beside tokenizer.json when tokenizer_config.json has none', function()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute('mkdir -p "' .. dir .. '" && cp "' .. root .. '/gpt2/tokenizer.json" "' .. dir .. '/"')
  local f = assert(io.open(dir .. '/chat_template.jinja', 'wb'))
  f:write('{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\n')
  f:close()
  local tok = gp.tokenizer.load(dir)
  T.eq(tok:apply_chat_template({{role = 'user', content = 'hi'}}), '<user>hi')
  T.eq(tok.bos_token, '<|endoftext|>') -- no config: found by its usual name
  os.execute('rm -rf "' .. dir .. '"')
end)

T.test('chat template: dictionaries keep the order their metatable gives, else sorted; an empty table is a list', function()
  local tpl = gp.tokenizer.template('{{ d | tojson }} {% for k, v in d.items() %}{{ k }}{% endfor %} {{ e | tojson }}')
  T.eq(tpl:render{d = {b = 1, a = 2}, e = {}}, '{"a": 2, "b": 1} ab []')
  T.eq(tpl:render{d = setmetatable({b = 1, a = 2}, {__keys = {'b', 'a'}}), e = {}}, '{"b": 1, "a": 2} ba []')
end)

T.test('chat template: slice bounds that are not integers are a template error (fuzz finding)', function()
  local t = gp.tokenizer.template("{{ 'abcdef'[1:4] }}|{{ [1, 2, 3][::-1] }}")
  T.eq(t:render({}), 'bcd|[3, 2, 1]')
  for _, src in ipairs {"{{ 'abc'[1:'x'] }}", "{{ [1, 2][x:] }}", "{{ 'abc'[0.5:] }}"} do
    local ok, err = pcall(function() return gp.tokenizer.template(src):render({x = {1}}) end)
    T.ok(not ok and tostring(err):find('slice indices must be integers or none', 1, true), src .. ': ' .. tostring(err))
  end
end)

T.test('chat template: a macro nests 100 calls deep, then fails at once (a fuzzer input recursed to a stack overflow)', function()
  local src = '{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% else %}bottom{% endif %}{% endmacro %}{{ f(N) }}'
  T.eq(gp.tokenizer.template(src:gsub('N', '99')):render({}), 'bottom')
  T.raises(function() gp.tokenizer.template(src:gsub('N', '100')):render({}) end, 'nested too deeply')
  -- a macro that calls itself: the error within a few thousand instructions, not a million
  local t = gp.tokenizer.template('{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}')
  local n = 0
  debug.sethook(function() n = n + 1 end, '', 1000)
  local ok, err = pcall(t.render, t, {})
  debug.sethook()
  T.ok(not ok and tostring(err):find('nested too deeply (a macro that calls itself?)', 1, true), tostring(err))
  T.ok(n < 200, n .. ' thousand instructions')
  -- the depth is of calls under way: many calls one after another, and a break out of a macro, are fine
  local seq = gp.tokenizer.template('{% macro g() %}{% break %}{% endmacro %}{% macro h() %}x{% endmacro %}' ..
    '{% for i in range(300) %}{{ g() }}{% endfor %}{% for i in range(300) %}{{ h() }}{% endfor %}')
  T.eq(#seq:render({}), 300)
  T.eq(gp.tokenizer.template(src:gsub('N', '99')):render({}), 'bottom', 'again, in a second render')
end)
