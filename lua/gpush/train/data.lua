-- gp.data: byte-level text datasets and JSONL files.
--
--   local ds = gp.data.text{path = 'input.txt'}          -- or {text = '...'}
--   ds.vocab_size, ds:encode('hi'), ds:decode({7, 8})     -- ids are 0-based
--   local x, y = ds:batch('train', 16, 64)                -- (16,64) i64 on the device
--   ds.unigram_entropy                                    -- the byte-frequency baseline, in nats
--
-- The text is encoded once (on the host, then moved to the device); a batch
-- is gp.randint offsets from the seeded generator and two gp.k.windows
-- launches (x and the shifted y) over the token tensor, all on the device:
-- the same seed gives the same batches, no per-batch host loop touches the
-- tokens, and nothing waits for the GPU (index_select would read back its
-- range flag; windows' starts are in range by construction).
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

-- opts: text= or path=; vocab = 'present' (the bytes that occur, default),
-- 'printable' (the printable ASCII, tab and newline, and any other byte that
-- occurs: whatever a user types can be encoded) or 'bytes' (all 256);
-- val_fraction (0.1; the last part of the text); device
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
  local vocab = opts.vocab or 'present'
  local device = opts.device or tensor.state.device
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
  local H = 0
  for b = 0, 255 do
    local c = counts[b]
    if c > 0 then local p = c / n; H = H - p * math.log(p) end
  end
  -- ids as i64 on the host in one pass, then one transfer
  local ids = tensor.empty({n}, 'i64', 'cpu', op)
  local p = ffi.cast('int64_t *', ids.c.data) + ids.c.offset
  for i = 0, n - 1 do p[i] = stoi[bytes[i]] end
  ids = ids:to(device)
  local nval = math.floor(n * vf)
  local ntrain = n - nval
  local self = setmetatable({
    text_len = n, vocab = vocab, vocab_size = V, stoi = stoi, itos = itos, device = device,
    unigram_entropy = H, data = ids, counts = counts,
  }, Text)
  self.train = ids:narrow(1, 1, ntrain)
  self.val = nval > 0 and ids:narrow(1, ntrain + 1, nval) or nil
  return self
end

-- string -> Lua list of 0-based ids (an unknown byte is an error)
function Text:encode(s)
  if type(s) ~= 'string' then raise('encode: needs a string') end
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
doc(M.text, "gp.data.text{path=FILE | text=STRING, vocab='present'|'printable'|'bytes', val_fraction=0.1}",
  'a byte-level dataset: vocab_size, encode, decode, batch(split, B, T) -> x, y (i64 on the device), unigram_entropy')
doc(M.facts_text, 'gp.data.facts_text{entities=1000, bytes=400000, seed=1}',
  'a synthetic encyclopedia: fixed facts about invented creatures in seeded sentences (a capacity test; moe.lua\'s default data)')
doc(M.jsonl, 'gp.data.jsonl(path)', 'the values of a JSONL file as a list (a bad line is an error naming its line number)')
doc(M.jsonl_lines, 'gp.data.jsonl_lines(path)', 'iterator over lineno, value of a JSONL file')

return M
