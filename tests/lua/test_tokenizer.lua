-- gp.tokenizer against Hugging Face tokenizers: the ids of 2,000 lines of
-- Shakespeare and of hand-written edge cases (Unicode, emoji, CJK, accents,
-- code, numbers, whitespace, special tokens), the decoded texts, for GPT-2's
-- byte-level BPE, SmolLM2's, a BPE with byte fallback in the Llama 2 layout,
-- all-MiniLM-L6-v2's WordPiece and variants of them, and the same
-- vocabularies read from GGUF metadata. The fixtures and the expected values
-- come from tests/fixtures/tokenizers/make.py (tokenizers 0.23).
local T = require 'lib'

local root = (GPUSH_ROOT or '.') .. '/tests/fixtures/tokenizers'
local json = gp.json

local function read(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end

local function lines_of(path)
  local out = {}
  for l in read(path):gmatch('([^\n]*)\n') do out[#out + 1] = l end
  return out
end

-- the hash make.py computes: the ids and their number
local function id_hash(ids)
  local h = 0
  for _, i in ipairs(ids) do h = (h * 1000003 + i + 1) % 2147483647 end
  return (h * 1000003 + #ids) % 2147483647
end

-- base with 'a.b' = value changes (the way make.py applies them)
local function apply(base, set)
  for path, v in pairs(set or {}) do
    local t, keys = base, {}
    for k in path:gmatch('[^.]+') do keys[#keys + 1] = k end
    for i = 1, #keys - 1 do t = t[keys[i]] end
    t[keys[#keys]] = v
  end
  return base
end

local function cut(ids, pad)
  local out = {}
  for i, x in ipairs(ids) do out[i] = x end
  if pad then while #out > 0 and out[#out] == pad do out[#out] = nil end end
  return out
end

local function show(ids) return '{' .. table.concat(ids, ' ') .. '}' end

-- every difference from the expected values, as lines of text
local function compare(tok, ex, edge, text)
  local bad = {}
  local function add(msg) if #bad < 12 then bad[#bad + 1] = msg end end
  local pad = ex.padded_to and tok.padding and tok.padding.pad_id
  for i, s in ipairs(edge) do
    local got = tok:encode(s)
    if ex.padded_to and #ex.edge[i] < ex.padded_to and #got ~= ex.padded_to then
      add(string.format('edge %d %q: %d ids, padding to %d expected', i, s, #got, ex.padded_to))
    end
    got = cut(got, pad)
    if show(got) ~= show(ex.edge[i]) then add(string.format('edge %d %q:\n    got  %s\n    want %s', i, s, show(got), show(ex.edge[i]))) end
    local d = tok:decode(ex.edge[i])
    if d ~= ex.edge_decoded[i] then add(string.format('decode of edge %d: %q, want %q', i, d, ex.edge_decoded[i])) end
    if ex.edge_decoded_skip then
      d = tok:decode(tok:encode(s), {skip_special_tokens = true})
      if d ~= ex.edge_decoded_skip[i] then add(string.format('decode (skipping special tokens) of edge %d: %q, want %q', i, d, ex.edge_decoded_skip[i])) end
    end
  end
  for i, ids in ipairs(ex.no_special) do
    local got = tok:encode(edge[i], {add_special_tokens = false})
    if show(got) ~= show(ids) then add(string.format('edge %d without special tokens: %s, want %s', i, show(got), show(ids))) end
  end
  for i, h in ipairs(ex.lines) do
    local got = tok:encode(text[i])
    if id_hash(got) ~= h then
      add(string.format('line %d %q: %s%s', i, text[i], show(cut(got, pad)), ex.full[i] and ('\n    want ' .. show(ex.full[i])) or ''))
    end
  end
  for i, ids in ipairs(ex.full) do
    local d = tok:decode(ids)
    if d ~= ex.decoded[i] then add(string.format('decode of line %d: %q, want %q', i, d, ex.decoded[i])) end
  end
  if tok.vocab_size ~= ex.vocab_size then add(string.format('vocab_size %d, want %d', tok.vocab_size, ex.vocab_size)) end
  return bad
end

-- Without libutf8proc (a GPU machine without make deps), the tokenizers that
-- need Unicode tables for non-ASCII text say so; those cases are skipped.
local function needs_utf8proc(fn)
  return function()
    local ok, err = pcall(fn)
    if not ok then
      if tostring(err):find('libutf8proc is not installed', 1, true) then T.skip('libutf8proc is not installed') end
      error(err, 0)
    end
  end
end

local E = json.decode(read(root .. '/expected.json'))
local edge = json.decode(read(root .. '/edge.json'))
local text = lines_of(root .. '/shakespeare.txt')

local function variant(name)
  local v = E.variants[name]
  return gp.tokenizer.from_json(apply(json.decode(read(root .. '/' .. v.base)), v.set)), v.expected
end

local names = {}
for name in pairs(E.variants) do names[#names + 1] = name end
table.sort(names)
for _, name in ipairs(names) do
  local n = #E.variants[name].expected.lines
  T.test(string.format('tokenizer %s: the ids of %d lines and %d edge cases, and decode, as tokenizers gives them', name, n, #edge), needs_utf8proc(function()
    local tok, ex = variant(name)
    local bad = compare(tok, ex, edge, text)
    T.ok(#bad == 0, table.concat(bad, '\n  '))
  end))
end

local gnames = {}
for name in pairs(E.gguf) do gnames[#gnames + 1] = name end
table.sort(gnames)
for _, name in ipairs(gnames) do
  local g = E.gguf[name]
  T.test(string.format('tokenizer from_gguf %s: the ids of the %s variant', name, g.same_as), needs_utf8proc(function()
    local meta = json.decode(read(root .. '/' .. g.meta))
    for k, v in pairs(g.set or {}) do meta[k] = v end
    local tok = gp.tokenizer.from_gguf(meta)
    local ex = E.variants[g.same_as].expected
    local bad = compare(tok, ex, edge, text)
    T.ok(#bad == 0, table.concat(bad, '\n  '))
  end))
end

T.test('tokenizer: the full GPT-2 and SmolLM2 vocabularies (GPUSH_TOKENIZER_FULL=DIR from make.py --full DIR)', function()
  local dir = os.getenv('GPUSH_TOKENIZER_FULL')
  if not dir or dir == '' then T.skip('GPUSH_TOKENIZER_FULL is not set') end
  local F = json.decode(read(dir .. '/expected.json'))
  for name, v in pairs(F.variants) do
    local bad = compare(gp.tokenizer.load(dir .. '/' .. v.base), v.expected, edge, text)
    T.ok(#bad == 0, name .. ':\n  ' .. table.concat(bad, '\n  '))
  end
  for name, g in pairs(F.gguf) do
    local tok = gp.tokenizer.from_gguf(json.decode(read(dir .. '/' .. g.meta)))
    local bad = compare(tok, F.variants[g.same_as].expected, edge, text)
    T.ok(#bad == 0, name .. ':\n  ' .. table.concat(bad, '\n  '))
  end
end)

T.test('tokenizer: byte-level BPE decodes what it encodes, byte for byte', function()
  local tok = gp.tokenizer.load(root .. '/gpt2/tokenizer.json')
  local all = {}
  for _, s in ipairs(text) do all[#all + 1] = s end
  for _, s in ipairs(edge) do all[#all + 1] = s end
  all[#all + 1] = table.concat(text, '\n')
  for _, s in ipairs(all) do
    T.eq(tok:decode(tok:encode(s)), s)
  end
  -- NUL bytes (which JSON fixtures cannot carry through cJSON): ids from tokenizers
  T.eq(show(tok:encode('a\0b')), '{64 188 65}')
  T.eq(tok:decode({64, 188, 65}), 'a\0b')
  -- ids cut in the middle of a character decode to U+FFFD, as tokenizers does
  local ids = tok:encode('\u{1F600}')
  T.ok(#ids > 1)
  T.eq(tok:decode({ids[1]}), '\u{FFFD}')
end)

T.test('tokenizer: a Hugging Face directory with tokenizer_config.json (SmolLM2)', function()
  local tok = gp.tokenizer.load(root .. '/smollm2')
  T.eq(tok.bos_token, '<|im_start|>')
  T.eq(tok.bos_id, 1)
  T.eq(tok.eos_token, '<|im_end|>')
  T.eq(tok.eos_id, 2)
  T.eq(tok.pad_id, 2)
  T.eq(tok:token_to_id('<|im_end|>'), 2)
  T.eq(tok:id_to_token(2), '<|im_end|>')
  T.eq(tok:token_to_id('Ġthe'), tok:encode(' the')[1])
  T.eq(tok:id_to_token(tok:token_to_id('Ġthe')), 'Ġthe')
  T.eq(tok:token_to_id('no such token'), nil)
  T.eq(tok:id_to_token(10 ^ 7), nil)
  T.ok(tok.chat_template:find('<|im_start|>', 1, true))
  T.eq(show(tok:encode('<|im_start|>user\nHi<|im_end|>')), show(tok:encode('<|im_start|>user\nHi<|im_end|>', {add_special_tokens = false})))
  T.eq(tok:encode('<|im_start|>')[1], 1)
  T.ok(tostring(tok):find('BPE', 1, true))
  -- the same from the GGUF metadata
  local g = gp.tokenizer.from_gguf(json.decode(read(root .. '/smollm2/gguf_meta.json')))
  T.eq(g.bos_id, 1)
  T.eq(g.eos_id, 2)
  T.eq(g.bos_token, '<|im_start|>')
  T.eq(g.eos_token, '<|im_end|>')
  T.eq(g.pad_id, 2)
  T.eq(g.unk_id, 0)
  T.eq(g.chat_template, tok.chat_template)
  T.eq(g.vocab_size, tok.vocab_size)
end)

T.test('tokenizer from_gguf: arrays as FFI arrays, named chat templates', function()
  local ffi = require 'ffi'
  local meta = json.decode(read(root .. '/bpe_fallback/gguf_meta.json'))
  local n = #meta['tokenizer.ggml.tokens']
  local types, scores = ffi.new('int32_t[?]', n), ffi.new('float[?]', n)
  for i = 1, n do
    types[i - 1] = meta['tokenizer.ggml.token_type'][i]
    scores[i - 1] = meta['tokenizer.ggml.scores'][i]
  end
  local want = gp.tokenizer.from_gguf(meta)
  meta['tokenizer.ggml.token_type'], meta['tokenizer.ggml.scores'] = types, scores
  meta['tokenizer.ggml.bos_token_id'] = ffi.new('uint32_t', 1)
  meta['tokenizer.chat_template'] = '{{ bos_token }}default'
  meta['tokenizer.chat_template.tool_use'] = '{{ bos_token }}tools'
  local tok = gp.tokenizer.from_gguf(meta)
  for _, s in ipairs {'Hello world', text[1], '\u{1F600} <0x41> <s>x</s>'} do
    T.eq(show(tok:encode(s)), show(want:encode(s)))
  end
  T.eq(tok.bos_id, 1)
  T.eq(tok.vocab_size, n)
  local chat = {{role = 'user', content = 'x'}}
  T.eq(tok:apply_chat_template(chat), '<s>default')
  T.eq(tok:apply_chat_template(chat, {chat_template = 'tool_use'}), '<s>tools')
end)

T.test('tokenizer: WordPiece padding, truncation and the attention mask (all-MiniLM-L6-v2)', needs_utf8proc(function()
  local tok = gp.tokenizer.load(root .. '/minilm')
  local ids, mask = tok:encode('Hello world', {attention_mask = true})
  T.eq(#ids, 128) -- the file pads to 128
  T.eq(show({ids[1], ids[2], ids[3], ids[4], ids[5]}), '{101 7592 2088 102 0}')
  T.eq(mask[4], 1)
  T.eq(mask[5], 0)
  T.eq(show(tok:encode('Hello world', {padding = false})), '{101 7592 2088 102}')
  local long = string.rep('word ', 300)
  T.eq(#tok:encode(long), 128) -- truncated to 128, [SEP] kept
  T.eq(tok:encode(long)[128], 102)
  T.eq(#tok:encode(long, {padding = false, truncation = false}), 302)
  T.eq(show(tok:encode(long, {max_length = 5, padding = false})), '{101 2773 2773 2773 102}')
  T.eq(show(tok:encode('Hello world', {add_special_tokens = false, padding = false})), '{7592 2088}')
  local batch = tok:encode_batch({'a', 'b c'}, {padding = false})
  T.eq(show(batch[1]), '{101 1037 102}')
  T.eq(show(batch[2]), '{101 1038 1039 102}')
  -- ids from a tensor
  T.eq(tok:decode(gp.tensor({101, 7592, 2088, 102}, {dtype = 'i64'})), '[CLS] hello world [SEP]')
  T.eq(tok:decode({101, 7592, 2088, 102}, {skip_special_tokens = true}), 'hello world')
  T.eq(tok.unk_id, 100)
  T.eq(tok.pad_id, 0)
end))

T.test('tokenizer: the cache of words does not change the ids', function()
  local tok = gp.tokenizer.load(root .. '/smollm2/tokenizer.json')
  local s = table.concat(text, '\n', 1, 200)
  local a = tok:encode(s)
  local b = tok:encode(s)
  tok.cache, tok.cache_n = {}, 0
  T.eq(show(tok:encode(s)), show(a))
  T.eq(show(b), show(a))
end)

T.test('tokenizer: bad files and bad input are errors that say what and where', function()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute('mkdir -p "' .. dir .. '"')
  local function write(name, s)
    local f = assert(io.open(dir .. '/' .. name, 'wb'))
    f:write(s)
    f:close()
    return dir .. '/' .. name
  end
  local base = read(root .. '/bpe_fallback/tokenizer.json')
  local spec = json.decode(base)
  spec.model.type = 'Unigram'
  local p = write('unknown_model.json', json.encode(spec))
  T.raises(function() gp.tokenizer.load(p) end, "tokenizer: unsupported model 'Unigram'", p)
  spec = json.decode(base)
  spec.pre_tokenizer = {type = 'Sequence', pretokenizers = {{type = 'UnicodeScripts'}}}
  p = write('unknown_pre.json', json.encode(spec))
  T.raises(function() gp.tokenizer.load(p) end, "tokenizer: unsupported pre_tokenizer 'UnicodeScripts'", p)
  spec = json.decode(base)
  spec.normalizer = {type = 'Precompiled'}
  p = write('unknown_norm.json', json.encode(spec))
  T.raises(function() gp.tokenizer.load(p) end, "unsupported normalizer 'Precompiled'", p)
  spec = json.decode(base)
  spec.decoder = {type = 'CTC'}
  p = write('unknown_dec.json', json.encode(spec))
  T.raises(function() gp.tokenizer.load(p) end, "unsupported decoder 'CTC'", p)
  spec = json.decode(base)
  spec.post_processor = {type = 'Frobnicate'}
  p = write('unknown_post.json', json.encode(spec))
  T.raises(function() gp.tokenizer.load(p) end, "unsupported post_processor 'Frobnicate'", p)
  spec = json.decode(base)
  spec.pre_tokenizer = {type = 'Split', pattern = {Regex = '(unclosed'}, behavior = 'Isolated', invert = false}
  p = write('bad_regex.json', json.encode(spec))
  T.raises(function() gp.tokenizer.load(p) end, 'Split pre_tokenizer', p, '(unclosed')
  spec = json.decode(base)
  table.insert(spec.model.merges, 'nosuch token')
  p = write('bad_merge.json', json.encode(spec))
  T.raises(function() gp.tokenizer.load(p) end, "merge 'nosuch token'", 'not in the vocab')
  p = write('malformed.json', base:sub(1, 5000))
  T.raises(function() gp.tokenizer.load(p) end, p, 'is not valid JSON')
  p = write('nomodel.json', '{"version": "1.0"}')
  T.raises(function() gp.tokenizer.load(p) end, 'no model', p)
  T.raises(function() gp.tokenizer.load(dir .. '/missing.json') end, 'tokenizer: cannot open', 'missing.json')
  T.raises(function() gp.tokenizer.load(dir) end, 'no tokenizer.json in', dir)
  T.raises(function() gp.tokenizer.load(42) end, 'the path must be a string')
  T.raises(function() gp.tokenizer.from_json('{oops') end, 'not valid JSON')
  os.execute('rm -rf "' .. dir .. '"')

  local tok = gp.tokenizer.load(root .. '/gpt2/tokenizer.json')
  T.raises(function() tok:encode('ok \255\254 bad') end, 'not valid UTF-8', 'byte 4')
  T.raises(function() tok:encode(42) end, 'must be a string')
  T.raises(function() tok:decode('abc') end, 'expected a list of ids')
  T.raises(function() tok:decode(gp.zeros {2, 2}) end, '1-D')
  T.raises(function() tok:apply_chat_template({{role = 'user', content = 'x'}}) end, 'no chat template')
  -- it still works after the errors
  T.eq(tok:decode(tok:encode('still fine')), 'still fine')

  local meta = json.decode(read(root .. '/smollm2/gguf_meta.json'))
  meta['tokenizer.ggml.pre'] = 'no-such-pre'
  T.raises(function() gp.tokenizer.from_gguf(meta) end, "unsupported tokenizer.ggml.pre 'no-such-pre'", 'smollm')
  meta['tokenizer.ggml.model'] = 't5'
  T.raises(function() gp.tokenizer.from_gguf(meta) end, "unsupported tokenizer.ggml.model 't5'")
  T.raises(function() gp.tokenizer.from_gguf({['tokenizer.ggml.model'] = 'gpt2'}) end, 'no tokenizer.ggml.tokens')
  T.raises(function() gp.tokenizer.from_gguf('x') end, 'expected a table')
end)

T.test('scripts/bench/tokenizer.lua runs (encode, decode, the round trip)', function()
  local top = GPUSH_ROOT or '.'
  local out, rc = T.sh(T.exe .. ' ' .. top .. '/scripts/bench/tokenizer.lua --mb 0.05 --no-peer --tokenizer ' .. root .. '/gpt2')
  T.eq(rc, 0, out)
  T.ok(out:find('encode (cold cache)', 1, true) and out:find('MB/s', 1, true), out)
  T.ok(out:find('decode(encode(text)) == text: true', 1, true), out)
end)

T.test('malformed UTF-8 decodes as U+FFFD a byte; a null Prepend is no prepend (fuzz findings)', function()
  local U = require 'gpush.text.unicode'
  local function cps(s)
    local out, i = {}, 1
    while i <= #s do out[#out + 1], i = U.decode_at(s, i) end
    return table.concat(out, ' ')
  end
  T.eq(cps('a\xC3\xA9b'), '97 233 98')                -- é
  T.eq(cps('\xE2\x82\xAC'), '8364')                    -- €
  T.eq(cps('\xF0\x9F\x98\x80'), '128512')              -- an emoji
  T.eq(cps('\xE2\x82'), '65533 65533')                 -- truncated at the end of the text
  T.eq(cps('\xC3A'), '65533 65')                       -- a lead byte without its continuation
  T.eq(cps('\x80\xFF'), '65533 65533')                 -- stray continuation, invalid byte
  local spec = json.decode([[{"version":"1.0","model":{"type":"WordLevel","vocab":{"[UNK]":0,"hi":1},"unk_token":"[UNK]"},
    "normalizer":{"type":"Prepend","prepend":null},"pre_tokenizer":{"type":"Whitespace"}}]])
  local tok = gp.tokenizer.from_json(spec)
  T.eq(show(tok:encode('hi')), '{1}')
  spec.normalizer.prepend = 3
  T.raises(function() gp.tokenizer.from_json(spec) end, 'prepend is a number, not a string')
end)

T.test('text that is not UTF-8 never reaches a regular expression (fuzz finding: a Replace content of bytes 0xFF crashed PCRE2)', function()
  local U = require 'gpush.text.unicode'
  local re = U.regex('\\p{L}+')
  T.raises(function() re:each('ab\xFFcd', function() end) end, 'not valid UTF-8', 'byte 3')
  T.raises(function() re:test('\xE2\x82') end, 'not valid UTF-8', 'byte 1')
  local n = 0
  re:each('héllo wörld', function() n = n + 1 end)
  T.eq(n, 2)
  local doc = [[{"version":"1.0","model":{"type":"WordLevel","vocab":{"[UNK]":0,"hi":1},"unk_token":"[UNK]"},
    "normalizer":{"type":"Replace","pattern":{"String":"i"},"content":"X"},"pre_tokenizer":{"type":"BertPreTokenizer"}}]]
  T.raises(function() gp.tokenizer.from_json((doc:gsub('"X"', '"\xFF\xFE"'))) end, 'from_json', 'not valid UTF-8')
  -- a table spec can still carry such bytes: the encode is an error, not a crash
  local spec = json.decode(doc)
  spec.normalizer.content = '\xFF\xFE'
  local tok = gp.tokenizer.from_json(spec)
  T.raises(function() tok:encode('hi') end, 'not valid UTF-8')
  spec.normalizer.content = 'i'
  T.eq(show(gp.tokenizer.from_json(spec):encode('hi')), '{1}')
end)

T.test('tok:stop_ids(): eos and the end-of-turn tokens; gp.generate stops at them by default', function()
  local tok = gp.tokenizer.load(root .. '/smollm2')
  local stops = tok:stop_ids()
  T.ok(#stops >= 1, 'no stop ids')
  local im_end = tok:token_to_id('<|im_end|>')
  local has = false
  for _, id in ipairs(stops) do has = has or id == im_end end
  T.ok(has, '<|im_end|> is a stop id: ' .. table.concat(stops, ' '))
  -- a model that always answers <|im_end|>: the reply ends before it unless stop = {} says otherwise
  local V = tok.vocab_size
  local model = gp.nn.GPT {vocab_size = V, block_size = 16, n_embd = 8, n_layer = 1, n_head = 1}
  gp.no_grad(function()
    model.lm_head.weight:zero_()
    model.lm_head.weight:narrow(1, im_end + 1, 1):fill_(1)
    model.ln_f.bias:fill_(1)
  end)
  local r = gp.generate(model, {{1, 2}}, {max_new = 4, greedy = true, tokenizer = tok})
  T.eq(#r.lists[1], 0)
  r = gp.generate(model, {{1, 2}}, {max_new = 4, greedy = true, tokenizer = tok, stop = {}})
  T.eq(#r.lists[1], 4)
end)

T.test('a typed tokenizer.json field that is null is absent (fuzz finding: truncation.max_length null)', function()
  local spec = json.decode([[{"version":"1.0","model":{"type":"WordLevel","vocab":{"[UNK]":0,"hi":1},"unk_token":"[UNK]"},
    "pre_tokenizer":{"type":"Whitespace"},"truncation":{"max_length":null,"stride":0,"strategy":"LongestFirst","direction":"Right"}}]])
  local tok = gp.tokenizer.from_json(spec)
  T.eq(show(tok:encode('hi hi hi')), '{1 1 1}')
end)

T.test('ByteFallback decodes <0xXX> with two hex digits only (fuzz finding: <0x-1> raised in string.char)', function()
  local tok = gp.tokenizer.from_json(json.decode([[{"model":{"type":"WordLevel",
    "vocab":{"<0x-1>":0,"<0x41>":1,"<0x 5>":2,"<0x+1>":3,"<0xe9>":4,"<0xc3>":5,"<0xa9>":6},"unk_token":"<0x-1>"},
    "pre_tokenizer":{"type":"Whitespace"},"decoder":{"type":"ByteFallback"}}]]))
  T.eq(show(tok:encode('x y')), '{0 0}')
  T.eq(tok:decode({1, 0, 2, 3, 1}), 'A<0x-1><0x 5><0x+1>A')
  T.eq(tok:decode({5, 6}), 'é', 'bytes that make UTF-8 join')
  T.eq(tok:decode({4, 1}), '\239\191\189\239\191\189', 'a run of bytes that is not UTF-8: U+FFFD each (as tokenizers)')
end)

T.test('tokens that share an id: the first in byte order names it, in every process', function()
  local src = [[{"model":{"type":"WordLevel","vocab":{"zz":0,"b":0,"a":0,"c":1},"unk_token":"c"},
    "pre_tokenizer":{"type":"Whitespace"}}]]
  T.eq(gp.tokenizer.from_json(json.decode(src)):id_to_token(0), 'a')
  local out = T.sh(string.format("%s -e %q", T.exe,
    'io.write(gp.tokenizer.from_json(gp.json.decode([==[' .. src .. ']==])):decode({0, 0, 1}))'))
  T.eq(out, 'a a c', 'in a process of its own')
end)
