-- tests/fuzz/make_seeds.lua: the seed corpora of the fuzzers (tests/fuzz/corpus/NAME),
-- small files made from the fixtures and by hand. Run from the checkout:
--   build/gpush tests/fuzz/make_seeds.lua
local root = rawget(_G, 'GPUSH_ROOT') or '.'
local out = root .. '/tests/fuzz/corpus'

local function write(path, s)
  local f = assert(io.open(path, 'wb'))
  f:write(s)
  f:close()
end
local function read(path) local f = assert(io.open(path, 'rb')); local s = f:read('*a'); f:close(); return s end

-- tokenizer.json: the fixtures with their vocabularies cut to the first ids
-- (and the merges of those), so that an input loads in a millisecond
local function shrink(path, keep)
  local t = gp.json.decode(read(path))
  local m = t.model
  local vocab, ok = {}, {}
  for tok, id in pairs(m.vocab) do if id < keep then vocab[tok] = id; ok[tok] = true end end
  m.vocab = vocab
  if m.merges then
    local merges = {}
    for _, mg in ipairs(m.merges) do
      local a, b
      if type(mg) == 'string' then a, b = mg:match('^(%S+) (%S+)$') else a, b = mg[1], mg[2] end
      if a and ok[a] and ok[b] and ok[a .. b] then merges[#merges + 1] = mg end
    end
    m.merges = merges
  end
  local added = {}
  for _, a in ipairs(t.added_tokens or {}) do
    a.id = a.id < keep and a.id or keep + #added
    added[#added + 1] = a
  end
  t.added_tokens = added
  return gp.json.encode(t)
end
os.execute('mkdir -p ' .. out .. '/tokenizer ' .. out .. '/jinja ' .. out .. '/json ' .. out .. '/safetensors')
local fx = root .. '/tests/fixtures/tokenizers/'
write(out .. '/tokenizer/gpt2_bytelevel_bpe.json', shrink(fx .. 'gpt2/tokenizer.json', 400))
write(out .. '/tokenizer/bpe_byte_fallback.json', shrink(fx .. 'bpe_fallback/tokenizer.json', 400))
write(out .. '/tokenizer/wordpiece_bert.json', shrink(fx .. 'minilm/tokenizer.json', 1200))
write(out .. '/tokenizer/wordlevel.json', gp.json.encode {
  version = '1.0', normalizer = {type = 'Lowercase'}, pre_tokenizer = {type = 'Whitespace'},
  model = {type = 'WordLevel', vocab = {['[UNK]'] = 0, hello = 1, world = 2, ['!'] = 3}, unk_token = '[UNK]'},
  added_tokens = {{id = 4, content = '<eos>', special = true, single_word = false, lstrip = false, rstrip = false,
                   normalized = false}},
  decoder = {type = 'WordPiece', prefix = '##', cleanup = true},
})

-- chat templates: the fixtures and small pieces of the language
for name in io.popen('ls ' .. fx .. 'templates/*.jinja'):lines() do
  write(out .. '/jinja/' .. name:match('[^/]+$'), read(name))
end
local pieces = {
  'loop_filters.jinja', [[{% for m in messages %}{{ loop.index }}:{{ m.role | upper }}={{ m.content | trim | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]],
  'set_macro.jinja', [[{% set ns = namespace(n=0) %}{% macro f(x, y=2) %}{{ x * y }}{% endmacro %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% endfor %}{{ f(ns.n) }} {{ [1,2,3] | join('-') }} {{ {'a': 1}['a'] }}]],
  'tests_slices.jinja', [[{% if messages[0]['role'] == 'system' %}{{ messages[0].content[:5] }}{% elif messages is defined %}{{ messages | length }}{% else %}none{% endif %}{{ 'x' ~ 1 ~ none }}{{ "a,b".split(",")[1] }}]],
  'strings.jinja', [[{{ bos_token }}{%- for m in messages -%}{{ '<|' + m['role'] + '|>\n' + (m.content if m.content is string else '') | replace('<', '&lt;') + '<|end|>\n' }}{%- endfor -%}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}]],
  'raise.jinja', [[{% if messages | selectattr('role', 'equalto', 'tool') | list | length > 3 %}{{ raise_exception('too many') }}{% endif %}{{ (tools or []) | tojson(indent=2) }}]],
}
for i = 1, #pieces, 2 do write(out .. '/jinja/' .. pieces[i], pieces[i + 1]) end

-- JSON: configs, escapes, numbers, nesting
local docs = {
  'config.json', read(root .. '/tests/fixtures/tokenizers/bpe_fallback/tokenizer_config.json'),
  'numbers.json', '[0, -0, 1e308, 1e-308, -1.5e+10, 123456789012345678, 0.1, 3.14159265358979]',
  'escapes.json', '{"s": "a\\"b\\\\c\\/d\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00", "e": "", "n": null, "t": true, "f": false}',
  'nested.json', '{"a": [[[[{"b": [1, {"c": {}}]}]]]], "d": {"e": {"f": []}}}',
  'metadata.json', '{"config": {"vocab_size": 65, "n_layer": 4}, "step": 1000, "gpush.json_keys": "[\\"config\\",\\"step\\"]"}',
}
for i = 1, #docs, 2 do write(out .. '/json/' .. docs[i], docs[i + 1]) end

-- safetensors: every dtype, odd shapes, metadata, an empty tensor
local st = out .. '/safetensors/'
gp.save(st .. 'dtypes.safetensors', {
  f32 = gp.randn {2, 3}, bf16 = gp.randn {3}:bf16(), f16 = gp.randn {1, 2}:half(), i32 = gp.arange(4):int(),
  i64 = gp.arange(3), u8 = gp.ones {5}:to('u8'), f64 = gp.randn {2}:double(), scalar = gp.full({}, 7),
  empty = gp.zeros {2, 0},
}, {format = 'pt', config = {a = 1}})
gp.save(st .. 'one.safetensors', {w = gp.ones {4, 4}})
gp.save(st .. 'meta_only.safetensors', {}, {k = 'v'})
print('seeds written under ' .. out)
