-- gguf: a tokenizer from the tokenizer.* metadata of a GGUF file, as
-- llama.cpp (src/llama-vocab.cpp) builds it. 'gpt2' vocabularies become a
-- byte-level BPE whose pre-tokenizer is llama.cpp's list of regular
-- expressions for tokenizer.ggml.pre (each one splits the pieces of the one
-- before, matches isolated); 'llama' vocabularies are SentencePiece-style:
-- spaces as U+2581 with one in front of each text piece, merged by token
-- score, unknown bytes as <0xXX> tokens.
local T = require 'gpush.text.tokenizer'
local models = require 'gpush.text.models'
local rt = require 'gpush.core.runtime'
local json = require 'gpush.core.json'

local M = {}
local raise = rt.raise
local null = json.null

-- llama.cpp's pre-tokenizer regular expressions (llm_tokenizer_bpe), by type
local GPT2 = [=['s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)]=]
local LLAMA3 = [=[(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+]=]
local QWEN2 = [=[(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+]=]
local REGEXES = {
  default = {[=[[\p{P}\$\+<=>\^~\|]+]=], GPT2, [=[\p{N}+]=], [=[[0-9][0-9][0-9]]=]},
  llama3 = {LLAMA3},
  gpt2 = {GPT2},
  qwen2 = {QWEN2},
  starcoder = {[=[\p{N}]=], GPT2},
  falcon = {[=[[\p{P}\$\+<=>\^~\|`]+]=], GPT2, [=[[0-9][0-9][0-9]]=]},
  deepseek_coder = {'[\r\n]', [=[\s?\p{L}+]=], [=[\s?\p{P}+]=], '[一-龥ࠀ-一가-퟿]+', [=[\p{N}]=]},
  deepseek_llm = {'[\r\n]',
    [=[\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+]=],
    [=[\s?[!-/:-~！-／：-～‘-‟　-。]+]=], [=[\s+$]=], '[一-龥ࠀ-一가-퟿]+', [=[\p{N}+]=]},
  deepseek3 = {[=[\p{N}{1,3}]=], '[一-龥぀-ゟ゠-ヿ]+',
    [=[[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+]=]},
  poro = {[=[ ?[^(\s|.,!?…。，、।۔،)]+]=]},
  tekken = {[=[[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+]=]},
  gpt4o = {[=[[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+]=]},
}
-- tokenizer.ggml.pre -> {regex list, ignore_merges, add_bos by default}
local PRE = {}
local function pre(names, key, ignore_merges, add_bos)
  for _, n in ipairs(names) do PRE[n] = {key = key, ignore_merges = ignore_merges, add_bos = add_bos} end
end
pre({'default'}, 'default')
pre({'llama3', 'llama-v3', 'llama-bpe', 'falcon3'}, 'llama3', true, true)
pre({'dbrx', 'smaug-bpe', 'chatglm-bpe'}, 'llama3')
pre({'gpt-2', 'phi-2', 'jina-es', 'jina-de', 'gigachat', 'jina-v1-en', 'jina-v2-es', 'jina-v2-de', 'jina-v2-code',
     'roberta-bpe', 'mpt', 'olmo', 'jais', 'trillion', 'granite-docling'}, 'gpt2')
pre({'qwen2', 'stablelm2', 'megrez', 'hunyuan', 'solar-open'}, 'qwen2')
pre({'starcoder', 'refact', 'command-r', 'smollm', 'codeshell', 'exaone', 'minerva-7b'}, 'starcoder')
pre({'falcon'}, 'falcon')
pre({'deepseek-coder'}, 'deepseek_coder')
pre({'deepseek-llm'}, 'deepseek_llm')
pre({'deepseek-v3'}, 'deepseek3')
pre({'poro-chat', 'bloom', 'gpt3-finnish'}, 'poro')
pre({'tekken'}, 'tekken', true, true)
pre({'gpt-4o'}, 'gpt4o')
M.PRE, M.REGEXES = PRE, REGEXES

local TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_BYTE = 2, 3, 4, 6

local function get(meta, key) local v = meta[key] if v == null then return nil end return v end
local function num(v) if v == nil then return nil end return tonumber(v) end
-- element i (1-based) of an array the GGUF reader gives: a Lua list or an FFI array
local function at(arr, i)
  if arr == nil then return nil end
  if type(arr) == 'cdata' then return arr[i - 1] end
  return arr[i]
end

-- the added tokens of a GGUF vocabulary: control and unknown tokens are
-- special, user-defined ones are not (tokenizers' added_tokens)
local function added_tokens(tokens, types)
  local added = {}
  if not types then return added end
  for i, t in ipairs(tokens) do
    local ty = num(at(types, i))
    if ty == TYPE_CONTROL or ty == TYPE_UNKNOWN or ty == TYPE_USER_DEFINED then
      added[#added + 1] = {id = i - 1, content = t, special = ty ~= TYPE_USER_DEFINED, normalized = false}
    end
  end
  return added
end

local function post_processor(add_bos, add_eos, bos, eos, tokens)
  local single, specials = {}, {}
  local function sp(id)
    local name = tokens[id + 1]
    single[#single + 1] = {SpecialToken = {id = name, type_id = 0}}
    specials[name] = {id = name, ids = {id}, tokens = {name}}
  end
  if add_bos and bos then sp(bos) end
  single[#single + 1] = {Sequence = {id = 'A', type_id = 0}}
  if add_eos and eos then sp(eos) end
  return {type = 'TemplateProcessing', single = single, special_tokens = specials}
end

-- a tokenizer from GGUF metadata: a Lua table with the tokenizer.ggml.* keys
function M.from_gguf(meta)
  if type(meta) ~= 'table' then raise('tokenizer.from_gguf: expected a table of GGUF metadata') end
  local where = 'gguf metadata'
  local model = get(meta, 'tokenizer.ggml.model')
  local tokens = get(meta, 'tokenizer.ggml.tokens')
  if type(model) ~= 'string' then raise('tokenizer.from_gguf: no tokenizer.ggml.model in the ' .. where) end
  if type(tokens) ~= 'table' or #tokens == 0 then raise('tokenizer.from_gguf: no tokenizer.ggml.tokens in the ' .. where) end
  local types = get(meta, 'tokenizer.ggml.token_type')
  local bos, eos = num(get(meta, 'tokenizer.ggml.bos_token_id')), num(get(meta, 'tokenizer.ggml.eos_token_id'))
  local unk, pad = num(get(meta, 'tokenizer.ggml.unknown_token_id')), num(get(meta, 'tokenizer.ggml.padding_token_id'))
  local add_bos, add_eos = get(meta, 'tokenizer.ggml.add_bos_token'), get(meta, 'tokenizer.ggml.add_eos_token')
  local vocab = {}
  for i, t in ipairs(tokens) do
    if vocab[t] == nil then vocab[t] = i - 1 end
  end
  local spec = {added_tokens = added_tokens(tokens, types)}
  local extra = {chat_template = get(meta, 'tokenizer.chat_template')}

  if model == 'gpt2' then
    local pre_name = get(meta, 'tokenizer.ggml.pre') or 'default'
    local p = PRE[pre_name]
    if not p then
      local known = {}
      for k in pairs(PRE) do known[#known + 1] = k end
      table.sort(known)
      raise(string.format("tokenizer: unsupported tokenizer.ggml.pre '%s' in %s (known: %s)", tostring(pre_name), where,
        table.concat(known, ', ')))
    end
    local merges = get(meta, 'tokenizer.ggml.merges')
    if type(merges) ~= 'table' then raise('tokenizer.from_gguf: no tokenizer.ggml.merges in the ' .. where) end
    spec.model = {type = 'BPE', vocab = vocab, merges = merges, ignore_merges = p.ignore_merges == true}
    local steps = {}
    for _, re in ipairs(REGEXES[p.key]) do
      steps[#steps + 1] = {type = 'Split', pattern = {Regex = re}, behavior = 'Isolated', invert = false}
    end
    steps[#steps + 1] = {type = 'ByteLevel', add_prefix_space = false, trim_offsets = false, use_regex = false}
    spec.pre_tokenizer = {type = 'Sequence', pretokenizers = steps}
    spec.decoder = {type = 'ByteLevel'}
    if add_bos == nil then add_bos = p.add_bos == true end
    spec.post_processor = post_processor(add_bos, add_eos, bos, eos, tokens)
  elseif model == 'llama' then
    local scores = get(meta, 'tokenizer.ggml.scores') or {}
    local sc, byte_ids = {}, {}
    for i = 1, #tokens do
      sc[i - 1] = num(at(scores, i)) or 0
      if types and num(at(types, i)) == TYPE_BYTE then
        local hex = tokens[i]:match('^<0x(%x%x)>$')
        if hex then byte_ids[tonumber(hex, 16)] = i - 1 end
      end
    end
    extra.model = models.spm{vocab = vocab, scores = sc, byte_ids = byte_ids}
    spec.model = {type = 'SPM'}
    local space_prefix = get(meta, 'tokenizer.ggml.add_space_prefix')
    if space_prefix == nil then space_prefix = true end
    local norm = {{type = 'Replace', pattern = {String = ' '}, content = '\226\150\129'}}
    if space_prefix then table.insert(norm, 1, {type = 'Prepend', prepend = '\226\150\129'}) end
    spec.normalizer = {type = 'Sequence', normalizers = norm}
    local dec = {{type = 'Replace', pattern = {String = '\226\150\129'}, content = ' '}, {type = 'ByteFallback'}, {type = 'Fuse'}}
    if space_prefix then dec[#dec + 1] = {type = 'Strip', content = ' ', start = 1, stop = 0} end
    spec.decoder = {type = 'Sequence', decoders = dec}
    bos, eos, unk = bos or 1, eos or 2, unk or 0
    if add_bos == nil then add_bos = true end
    spec.post_processor = post_processor(add_bos, add_eos, bos, eos, tokens)
  else
    raise(string.format("tokenizer: unsupported tokenizer.ggml.model '%s' in %s (supported: gpt2, llama)", model, where))
  end
  extra.bos_id, extra.eos_id, extra.unk_id, extra.pad_id = bos, eos, unk, pad
  -- the other named templates (tokenizer.chat_template.NAME)
  local named
  for k, v in pairs(meta) do
    local name = type(k) == 'string' and k:match('^tokenizer%.chat_template%.(.+)$')
    if name and type(v) == 'string' then
      named = named or {}
      named[name] = v
    end
  end
  local tok = T.from_spec(spec, where, extra)
  if named then
    named.default = tok.chat_template
    tok.chat_templates = named
  end
  tok.gguf_pre = get(meta, 'tokenizer.ggml.pre')
  tok.vocab_size = #tokens -- llama.cpp's n_vocab, duplicates included
  return tok
end

return M
