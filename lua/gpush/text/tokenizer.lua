-- tokenizer: a Hugging Face tokenizer.json run in Lua, giving the ids the
-- tokenizers library gives (Tokenizer.encode(text).ids) and the text its
-- decode gives. The pipeline, as tokenizers/src/tokenizer/mod.rs runs it:
--
--   added tokens split out of the raw text (those not normalized)
--   -> the normalizer on each remaining piece -> normalized added tokens split out
--   -> the pre-tokenizer (words) -> the model (ids; cached per word)
--   -> truncation -> the post-processor (special tokens) -> padding
--
-- decode: ids -> tokens (special ones skipped on request) -> the decoder.
local U = require 'gpush.text.unicode'
local N = require 'gpush.text.normalizers'
local P = require 'gpush.text.pretokenizers'
local models = require 'gpush.text.models'
local D = require 'gpush.text.decoders'
local jinja = require 'gpush.text.jinja'
local json = require 'gpush.core.json'
local tensor = require 'gpush.core.tensor'
local rt = require 'gpush.core.runtime'

local null = json.null
local raise = rt.raise
local M = {}
local sub, byte = string.sub, string.byte

local function opt(v) if v == null then return nil end return v end

local Tokenizer = {}
Tokenizer.__index = Tokenizer
M.Tokenizer = Tokenizer

---------------------------------------------------------------------------
-- added tokens

-- A matcher finds added tokens leftmost-longest (as tokenizers' Aho-Corasick
-- automaton does): a byte trie, entered only at bytes that start a token.
local function matcher(list)
  if #list == 0 then return nil end
  local root, firsts = {}, {}
  for _, t in ipairs(list) do
    local node = root
    local pat = t.pattern
    for i = 1, #pat do
      local b = byte(pat, i)
      node[b] = node[b] or {}
      node = node[b]
    end
    node.tok = t
    firsts[byte(pat, 1)] = true
  end
  -- a Lua pattern class of the first bytes
  local chars = {}
  for b in pairs(firsts) do chars[#chars + 1] = b end
  table.sort(chars)
  local set = {}
  for _, b in ipairs(chars) do
    local c = string.char(b)
    set[#set + 1] = c:match('%w') and c or ('%' .. c)
  end
  local class = '[' .. table.concat(set) .. ']'
  if #chars == 1 then class = set[1] end
  -- the first match at or after byte i (1-based): start, stop (inclusive), token
  return function(s, i)
    local n = #s
    while true do
      local a = s:find(class, i)
      if not a then return nil end
      local node, best, stop = root, nil, nil
      local j = a
      while j <= n do
        node = node[byte(s, j)]
        if not node then break end
        if node.tok then best, stop = node.tok, j end
        j = j + 1
      end
      if best then return a, stop, best end
      i = a + 1
    end
  end
end

-- the code point that ends at byte i (1-based, inclusive) of s
local function cp_before(s, i)
  local j = i
  while j > 1 and byte(s, j) >= 0x80 and byte(s, j) < 0xC0 do j = j - 1 end
  return (U.decode_at(s, j))
end

-- Cut s at the added tokens of find (tokenizers' AddedVocabulary::find_matches):
-- calls piece(text, start) for the text between tokens (start 1-based) and
-- token(t) for each token, in order.
local function split_added(s, find, piece, token)
  if not find or s == '' then
    if s ~= '' then piece(s, 1) end
    return
  end
  local n = #s
  local offset = 1 -- the first byte not yet emitted
  local i = 1
  while i <= n do
    local a, b, t = find(s, i)
    if not a then break end
    i = b + 1
    local ok = true
    if t.single_word then
      local start_space = a == 1 or not U.is_rust_word(cp_before(s, a - 1))
      local stop_space = b == n or not U.is_rust_word((U.decode_at(s, b + 1)))
      ok = start_space and stop_space
    end
    if ok then
      if t.lstrip then
        local k = a
        while k > 1 do
          local cp = cp_before(s, k - 1)
          if not U.WHITE[cp] then break end
          k = k - #U.encode(cp)
        end
        a = math.max(k, offset)
      end
      if t.rstrip then
        while b < n do
          local cp, nx = U.decode_at(s, b + 1)
          if not U.WHITE[cp] then break end
          b = nx - 1
        end
      end
      if a > offset then piece(sub(s, offset, a - 1), offset) end
      token(t)
      offset = b + 1
    end
  end
  if offset <= n then piece(sub(s, offset), offset) end
end

---------------------------------------------------------------------------
-- post-processors: {single = function(ids, add_special) -> ids, added = n}

local function special_ids(spec, name, where)
  local st = spec.special_tokens and spec.special_tokens[name]
  if not st then raise(string.format("tokenizer: TemplateProcessing names the special token '%s' but does not define it (%s)", name, where)) end
  return st.ids
end

local function processor(spec, where)
  if spec == nil or spec == null then
    return {added = 0, single = function(ids) return ids end}
  end
  local t = spec.type
  local pre, post = {}, {}
  if t == 'TemplateProcessing' then
    local seen = false
    for _, item in ipairs(spec.single or {}) do
      if item.SpecialToken then
        local dst = seen and post or pre
        for _, id in ipairs(special_ids(spec, item.SpecialToken.id, where)) do dst[#dst + 1] = id end
      elseif item.Sequence then
        if seen then raise('tokenizer: TemplateProcessing with the sequence twice in single is not supported (' .. where .. ')') end
        seen = true
      end
    end
  elseif t == 'BertProcessing' or t == 'RobertaProcessing' then
    pre[1], post[1] = spec.cls[2], spec.sep[2]
  elseif t == 'ByteLevel' then
    pre, post = {}, {} -- offsets only
  elseif t == 'Sequence' then
    local ps = {}
    for _, p in ipairs(spec.processors or {}) do ps[#ps + 1] = processor(p, where) end
    local added = 0
    for _, p in ipairs(ps) do added = added + p.added end
    return {added = added, single = function(ids, add)
      for _, p in ipairs(ps) do ids = p.single(ids, add) end
      return ids
    end}
  else
    N.unsupported('post_processor', t, where)
  end
  return {added = #pre + #post, pre = pre, post = post, single = function(ids, add)
    if not add or (#pre == 0 and #post == 0) then return ids end
    local out = {}
    for _, id in ipairs(pre) do out[#out + 1] = id end
    for _, id in ipairs(ids) do out[#out + 1] = id end
    for _, id in ipairs(post) do out[#out + 1] = id end
    return out
  end}
end

---------------------------------------------------------------------------
-- building

local CACHE_MAX, CACHE_WORD = 200000, 256 -- words cached, bytes of the longest cached word

-- The builders of the parts other than the model (models.lua checks its
-- fields) read a tokenizer.json's fields as the format has them; a field of
-- another type makes one fail inside (Lua's "attempt to index a number
-- value"): that is the file's fault, reported naming the part.
local BUG_SIGNS = {'attempt to ', 'bad argument', 'table index is', 'invalid value', 'number expected', 'string expected'}
local function built(where, part, f, ...)
  local r = {pcall(f, ...)}
  if r[1] then return unpack(r, 2, table.maxn(r)) end
  local err = r[2]
  if type(err) == 'string' then
    for _, b in ipairs(BUG_SIGNS) do
      if err:find(b, 1, true) then
        raise(string.format('tokenizer: the %s in %s has a field of the wrong type or shape', part, where))
      end
    end
  end
  error(err, 0)
end

-- The type of every field the parts read (a name means the same in every
-- part that has it): checked over the whole file but the model (models.lua
-- checks its own) and the added tokens before anything is built, so a value
-- of another type is an error naming it, never a failure inside encode; a
-- null one is removed.
local FIELD_TYPES = {
  type = 'string', pattern = 'table string', content = 'string', Regex = 'string', String = 'string',
  add_prefix_space = 'boolean', replacement = 'string', prepend_scheme = 'string', behavior = 'string',
  use_regex = 'boolean', suffix = 'string', prefix = 'string', prepend = 'string', delimiter = 'string',
  strip_left = 'boolean', strip_right = 'boolean', strip_accents = 'boolean', lowercase = 'boolean',
  invert = 'boolean', individual_digits = 'boolean', handle_chinese_chars = 'boolean', clean_text = 'boolean',
  cleanup = 'boolean', split = 'boolean', trim_offsets = 'boolean', start = 'number', stop = 'number',
  normalizers = 'table', pretokenizers = 'table', decoders = 'table', processors = 'table',
  single = 'table', pair = 'table', special_tokens = 'table', sep = 'table', cls = 'table', ids = 'table',
  tokens = 'table', type_id = 'number',
  max_length = 'number', stride = 'number', strategy = 'string table', direction = 'string',
  pad_to_multiple_of = 'number', pad_id = 'number', pad_type_id = 'number', pad_token = 'string', Fixed = 'number',
}
local function check_fields(v, path, where, depth)
  if type(v) ~= 'table' or v == null then return end
  if depth > 32 then raise(string.format('tokenizer: %s nests too deeply in %s', path, where)) end
  for k, x in pairs(v) do
    local want = type(k) == 'string' and FIELD_TYPES[k]
    -- a typed field that is null is absent (as tokenizers reads it): the code
    -- after this never meets the null sentinel where it expects a value
    if want and x == null then v[k] = nil end
    if want and x ~= null and not want:find(type(x), 1, true) then
      raise(string.format('tokenizer: %s.%s is a %s, not a %s (%s)', path, k, type(x), want:gsub(' ', ' or '), where))
    end
    if type(x) == 'number' and (x ~= x or x == math.huge or x == -math.huge) then
      raise(string.format('tokenizer: %s.%s is not a finite number (%s)', path, tostring(k), where))
    end
    check_fields(x, path .. '.' .. tostring(k), where, depth + 1)
  end
end

-- a tokenizer from a decoded tokenizer.json table; where names it in errors;
-- extra: {config = tokenizer_config.json table, chat_template =, bos_token =, eos_token =, ...}
function M.from_spec(spec, where, extra)
  where = where or 'the tokenizer table'
  extra = extra or {}
  if type(spec) ~= 'table' then raise('tokenizer: expected a tokenizer.json table in ' .. where) end
  if type(spec.model) ~= 'table' then raise('tokenizer: no model in ' .. where) end
  for _, part in ipairs {'normalizer', 'pre_tokenizer', 'post_processor', 'decoder', 'truncation', 'padding'} do
    check_fields(spec[part], part, where, 0)
  end
  local self = setmetatable({where = where}, Tokenizer)
  self.model = extra.model or built(where, 'model', models.build, spec.model, where)
  self.normalizer = built(where, 'normalizer', N.build, opt(spec.normalizer), where)
  self.pre, self.deferred_bytes = built(where, 'pre_tokenizer', P.build, opt(spec.pre_tokenizer), where)
  self.post = built(where, 'post_processor', processor, opt(spec.post_processor), where)
  self.decoder = built(where, 'decoder', D.build, opt(spec.decoder), where)
  self.truncation = opt(spec.truncation)
  self.padding = opt(spec.padding)
  if self.truncation ~= nil and type(self.truncation) ~= 'table' then raise('tokenizer: truncation is not an object in ' .. where) end
  if self.padding ~= nil and type(self.padding) ~= 'table' then raise('tokenizer: padding is not an object in ' .. where) end
  if spec.added_tokens ~= nil and spec.added_tokens ~= null and type(spec.added_tokens) ~= 'table' then
    raise('tokenizer: added_tokens is not a list in ' .. where)
  end

  -- added tokens. Their ids are not read from the file: as tokenizers does
  -- when it loads one, a token of the model's vocabulary keeps its id, the
  -- others are numbered from the size of the model's vocabulary on.
  local model_size = 0
  for _ in pairs(self.model.vocab) do model_size = model_size + 1 end
  local next_id = model_size
  self.added, self.added_by_content, self.added_by_id, self.special = {}, {}, {}, {}
  local raw, norm = {}, {}
  for _, a in ipairs(opt(spec.added_tokens) or {}) do
    if type(a) == 'table' and type(a.content) == 'string' and a.content ~= '' then
      local t = {content = a.content, special = a.special == true, lstrip = a.lstrip == true,
                 rstrip = a.rstrip == true, single_word = a.single_word == true, normalized = a.normalized == true}
      local old = self.added_by_content[t.content]
      t.id = (old and old.id) or self.model.vocab[t.content]
      if t.id == nil then
        t.id = next_id
        next_id = next_id + 1
      end
      t.pattern = t.content
      if t.normalized and self.normalizer then t.pattern = self.normalizer(t.content) end
      if old then
        for i, x in ipairs(self.added) do if x == old then table.remove(self.added, i) break end end
      end
      self.added[#self.added + 1] = t
      self.added_by_content[t.content] = t
      self.added_by_id[t.id] = t
      if t.special then self.special[t.content] = true end
    end
  end
  for _, t in ipairs(self.added) do
    if t.pattern ~= '' then
      if t.normalized then norm[#norm + 1] = t else raw[#raw + 1] = t end
    end
  end
  self.find_raw, self.find_norm = matcher(raw), matcher(norm)

  -- sizes and well-known tokens
  local size = model_size
  for _, t in ipairs(self.added) do
    if self.model.vocab[t.content] == nil then size = size + 1 end
  end
  self.vocab_size = size
  self.cache, self.cache_n = {}, 0

  local cfg = extra.config or {}
  local function tok_of(v)
    v = opt(v)
    if type(v) == 'table' then v = opt(v.content) end
    return type(v) == 'string' and v or nil
  end
  for _, k in ipairs {'bos', 'eos', 'unk', 'pad', 'sep', 'cls', 'mask'} do
    local s = tok_of(extra[k .. '_token']) or tok_of(cfg[k .. '_token'])
    if s then
      self[k .. '_token'] = s
      self[k .. '_id'] = self:token_to_id(s)
    end
  end
  for _, k in ipairs {'bos', 'eos', 'unk', 'pad'} do
    local id = extra[k .. '_id']
    if id and not self[k .. '_id'] then
      self[k .. '_id'] = id
      self[k .. '_token'] = self:id_to_token(id)
    end
  end
  if not extra.config and not extra.bos_id then self:guess_special() end
  if not self.unk_token and self.model.unk_token then
    self.unk_token, self.unk_id = self.model.unk_token, self.model.vocab[self.model.unk_token]
  end
  if not self.pad_id and self.padding then
    self.pad_id, self.pad_token = self.padding.pad_id, opt(self.padding.pad_token)
  end
  local tpl = opt(extra.chat_template) or opt(cfg.chat_template)
  if type(tpl) == 'table' then
    -- a list of named templates: the default one
    local named = {}
    for _, e in ipairs(tpl) do named[e.name] = e.template end
    self.chat_templates = named
    tpl = named.default
  end
  self.chat_template = tpl
  return self
end

-- bos and eos by the usual names, for a tokenizer.json without its config
local BOS = {'<|begin_of_text|>', '<s>', '<bos>', '<|startoftext|>', '<|endoftext|>'}
local EOS = {'<|end_of_text|>', '</s>', '<eos>', '<|endoftext|>'}
function Tokenizer:guess_special()
  local function first(names)
    for _, s in ipairs(names) do
      local t = self.added_by_content[s]
      if t and t.special then return s, t.id end
    end
  end
  if not self.bos_id then self.bos_token, self.bos_id = first(BOS) end
  if not self.eos_id then self.eos_token, self.eos_id = first(EOS) end
end

---------------------------------------------------------------------------
-- encoding

function Tokenizer:token_to_id(s)
  local t = self.added_by_content[s]
  if t then return t.id end
  return self.model.vocab[s]
end

-- the ids that end a generated reply: eos and the end-of-turn tokens of the
-- chat templates this vocabulary has (ChatML's <|im_end|>, Llama 3's
-- <|eot_id|>, ...), each once
local END_OF_TURN = {'<|im_end|>', '<|eot_id|>', '<|end_of_text|>', '<|endoftext|>', '</s>', '<end_of_turn>'}
function Tokenizer:stop_ids()
  local r, seen = {}, {}
  local function add(id) if id and not seen[id] then seen[id] = true; r[#r + 1] = id end end
  add(self.eos_id)
  for _, t in ipairs(END_OF_TURN) do add(self:token_to_id(t)) end
  return r
end

function Tokenizer:id_to_token(id)
  local t = self.added_by_id[id]
  if t then return t.content end
  return self.model.vocab_r[id]
end

-- the ids of one piece of normalized text (pre-tokenizer and model), appended to out
function Tokenizer:encode_piece(s, at_start, out)
  local cache, model, deferred = self.cache, self.model, self.deferred_bytes
  local byte_level = N.byte_level
  local function sink(w)
    local ids = cache[w]
    if not ids then
      ids = model.tokenize(deferred and byte_level(w) or w)
      if #w < CACHE_WORD then -- long words are rare and would fill the cache (tokenizers: the same bound)
        if self.cache_n >= CACHE_MAX then
          cache = {}
          self.cache, self.cache_n = cache, 0
        end
        cache[w] = ids
        self.cache_n = self.cache_n + 1
      end
    end
    local n = #out
    for i = 1, #ids do out[n + i] = ids[i] end
  end
  if self.pre then self.pre(s, at_start, sink) else sink(s) end
end

local function check_text(text)
  if type(text) ~= 'string' then raise('tokenizer.encode: the text must be a string, got ' .. type(text)) end
  local bad = U.invalid_at(text)
  if bad then raise(string.format('tokenizer.encode: the text is not valid UTF-8 (byte %d)', bad)) end
end

-- the ids of text before post-processing
function Tokenizer:encode_raw(text)
  local out = {}
  local normalizer, find_norm = self.normalizer, self.find_norm
  local function add_token(t) out[#out + 1] = t.id end
  split_added(text, self.find_raw, function(s, start)
    if normalizer then s = normalizer(s) end
    local first = start == 1
    split_added(s, find_norm, function(p, pstart)
      self:encode_piece(p, first and pstart == 1, out)
    end, add_token)
  end, add_token)
  return out
end

-- ids of text, 0-based, as tokenizers' Tokenizer.encode(text, add_special_tokens).ids
-- opts: add_special_tokens (true), truncation (true: the file's setting), max_length,
-- padding (true: the file's setting); returns ids and, with opts.attention_mask, the mask
function Tokenizer:encode(text, opts)
  opts = opts or {}
  check_text(text)
  local add = opts.add_special_tokens ~= false
  local ids = self:encode_raw(text)
  -- truncation (before the special tokens, leaving room for them)
  local trunc = self.truncation
  local max_len = opts.max_length or (opts.truncation ~= false and trunc and trunc.max_length)
  if max_len then
    local room = max_len - ((add and self.post.added) or 0)
    if room < 0 then room = 0 end
    if #ids > room then
      local left = trunc and trunc.direction == 'Left'
      local kept = {}
      local from = left and (#ids - room + 1) or 1
      for i = 0, room - 1 do kept[i + 1] = ids[from + i] end
      ids = kept
    end
  end
  ids = self.post.single(ids, add)
  local n_real = #ids
  local pad = self.padding
  if pad and opts.padding ~= false then
    local target = n_real
    local strategy = pad.strategy
    if type(strategy) == 'table' and strategy.Fixed then target = strategy.Fixed end
    local mult = opt(pad.pad_to_multiple_of)
    if mult and mult > 0 and target % mult > 0 then target = target + mult - target % mult end
    if n_real < target then
      local pid = pad.pad_id or 0
      if pad.direction == 'Left' then
        local padded = {}
        for i = 1, target - n_real do padded[i] = pid end
        for i = 1, n_real do padded[target - n_real + i] = ids[i] end
        ids = padded
      else
        for i = n_real + 1, target do ids[i] = pid end
      end
    end
  end
  if opts.attention_mask then
    local mask = {}
    local left = pad and pad.direction == 'Left'
    local first = left and (#ids - n_real + 1) or 1
    for i = 1, #ids do mask[i] = (i >= first and i < first + n_real) and 1 or 0 end
    return ids, mask
  end
  return ids
end

-- the ids of several texts (a list of lists)
function Tokenizer:encode_batch(texts, opts)
  local out = {}
  for i, t in ipairs(texts) do out[i] = self:encode(t, opts) end
  return out
end

---------------------------------------------------------------------------
-- decoding

-- the text of ids (a Lua list or a 1-D integer tensor), as tokenizers'
-- decode; opts.skip_special_tokens (false, as transformers' decode)
function Tokenizer:decode(ids, opts)
  opts = opts or {}
  if tensor.is_tensor(ids) then
    if ids:dim() ~= 1 then raise('tokenizer.decode: expected a 1-D tensor of ids, got ' .. ids:dim() .. '-D') end
    ids = ids:totable()
  end
  if type(ids) ~= 'table' then raise('tokenizer.decode: expected a list of ids, got ' .. type(ids)) end
  local skip = opts.skip_special_tokens == true
  local tokens = {}
  local added_by_id, vocab_r, special = self.added_by_id, self.model.vocab_r, self.special
  for _, id in ipairs(ids) do
    if type(id) == 'cdata' then id = tonumber(id) end
    local a = added_by_id[id]
    local tok
    if a then
      tok = a.normalized and a.pattern or a.content
    else
      tok = vocab_r[id]
    end
    if tok and not (skip and special[tok]) then tokens[#tokens + 1] = tok end
  end
  return self.decoder(tokens)
end

function Tokenizer:__tostring()
  return string.format('Tokenizer(%s, %d tokens, %s)', self.model.kind, self.vocab_size, self.where)
end

---------------------------------------------------------------------------
-- chat templates

-- the model's chat template rendered for messages, as transformers'
-- apply_chat_template(messages, tokenize=False, ...) renders it
function Tokenizer:apply_chat_template(messages, opts)
  opts = opts or {}
  if type(messages) ~= 'table' then raise('apply_chat_template: messages must be a list of {role =, content =} tables') end
  local src = opts.chat_template
  if type(src) == 'string' and self.chat_templates and self.chat_templates[src] then src = self.chat_templates[src] end
  src = src or self.chat_template
  if type(src) ~= 'string' then raise('apply_chat_template: this tokenizer has no chat template (' .. self.where .. ')') end
  self.compiled = self.compiled or {}
  local tpl = self.compiled[src]
  if not tpl then
    tpl = jinja.compile(src, 'chat template')
    self.compiled[src] = tpl
  end
  local vars = {}
  for _, k in ipairs {'bos', 'eos', 'unk', 'pad', 'sep', 'cls', 'mask'} do vars[k .. '_token'] = self[k .. '_token'] end
  for k, v in pairs(opts) do
    if k ~= 'tokenize' and k ~= 'chat_template' then vars[k] = v end
  end
  vars.messages = messages
  vars.add_generation_prompt = opts.add_generation_prompt == true
  if vars.tools == nil then vars.tools = null end
  if vars.documents == nil then vars.documents = null end
  local text = tpl:render(vars)
  if opts.tokenize then return self:encode(text, {add_special_tokens = false}) end
  return text
end

---------------------------------------------------------------------------
-- files

local function read(path)
  local f, err = io.open(path, 'rb')
  if not f then raise('tokenizer: cannot open ' .. tostring(err)) end
  local s = f:read('*a')
  f:close()
  if not s then raise('tokenizer: cannot read ' .. path) end
  return s
end

local function decode_json(text, path)
  local bad = U.invalid_at(text) -- tokenizers reads the file into a Rust String: UTF-8 or an error
  if bad then raise(string.format('tokenizer: %s is not valid UTF-8 (byte %d)', path, bad)) end
  local ok, v = pcall(json.decode, text)
  if not ok then raise(string.format('tokenizer: %s is not valid JSON (%s)', path, tostring(v):gsub('^.-json%.decode: ', ''))) end
  return v
end

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() return true end
  return false
end

local function is_dir(path)
  local f = io.open(path .. '/.', 'rb')
  if f then f:close() return true end
  return false
end

-- a tokenizer from a Hugging Face directory (tokenizer.json, and
-- tokenizer_config.json when there) or a tokenizer.json file
function M.load(path)
  if type(path) ~= 'string' then raise('tokenizer.load: the path must be a string') end
  local dir, file
  if is_dir(path) then
    dir = path:gsub('/+$', '')
    file = dir .. '/tokenizer.json'
    if not exists(file) then raise('tokenizer: no tokenizer.json in ' .. dir) end
  else
    file = path
    dir = path:match('^(.*)/[^/]*$') or '.'
  end
  local spec = decode_json(read(file), file)
  local extra = {}
  local cfg_path = dir .. '/tokenizer_config.json'
  if exists(cfg_path) then
    extra.config = decode_json(read(cfg_path), cfg_path)
  end
  -- newer repositories keep the template in a file of its own
  if not (extra.config and opt(extra.config.chat_template)) then
    local jinja_path, json_path = dir .. '/chat_template.jinja', dir .. '/chat_template.json'
    if exists(jinja_path) then
      extra.chat_template = read(jinja_path)
    elseif exists(json_path) then
      extra.chat_template = opt(decode_json(read(json_path), json_path).chat_template)
    end
  end
  local tok = M.from_spec(spec, file, extra)
  tok.path = file
  return tok
end

-- the added-token split, for tools that run parts of the pipeline
M.split_added = split_added

return M
