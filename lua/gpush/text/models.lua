-- models: the "model" of a Hugging Face tokenizer.json, which turns one
-- pre-tokenized word into ids: BPE (byte-level or with byte fallback, as the
-- tokenizers library's models/bpe), WordPiece, WordLevel, and llama.cpp's
-- SentencePiece-style merging by scores (SPM, for GGUF 'llama' vocabularies).
-- A model is {vocab = {token = id}, vocab_r = {[id] = token}, size = n,
-- tokenize = function(word) -> {ids}}; ids are 0-based.
local U = require 'gpush.text.unicode'
local N = require 'gpush.text.normalizers'
local rt = require 'gpush.core.runtime'
local null = require('gpush.core.json').null

local M = {}
local floor, byte, sub = math.floor, string.byte, string.sub
local SH = 4194304 -- 2^22: ids and merge ranks below it pack into one number

local function opt(v) if v == null then return nil end return v end

-- the fields a model reads, checked before it is built: a tokenizer.json with
-- a value of the wrong type is an error naming the field, not a failure
-- somewhere inside the model later
local function check_vocab(spec, kind, where)
  local vocab = spec.vocab
  if type(vocab) ~= 'table' then rt.raise(string.format('tokenizer: the %s model has no vocab in %s', kind, where)) end
  for tok, id in pairs(vocab) do
    if type(tok) ~= 'string' or type(id) ~= 'number' or id < 0 or id >= SH or id ~= floor(id) then
      rt.raise(string.format('tokenizer: the %s vocab maps %s to %s; it needs token strings and integer ids in [0, %d) (%s)',
        kind, tostring(tok), tostring(id), SH, where))
    end
  end
  return vocab
end
local function opt_of(spec, key, ty, kind, where)
  local v = opt(spec[key])
  if v ~= nil and type(v) ~= ty then
    rt.raise(string.format('tokenizer: the %s model\'s %s is a %s, not a %s (%s)', kind, key, type(v), ty, where))
  end
  return v
end

-- id -> token; of tokens that share an id (a broken file), the first in byte
-- order, so that the same file decodes the same in every process (pairs
-- follows string hashes, seeded per process)
local function reverse(vocab)
  local r, size = {}, 0
  for tok, id in pairs(vocab) do
    local had = r[id]
    if had == nil or tok < had then r[id] = tok end
    if id + 1 > size then size = id + 1 end
  end
  return r, size
end

-- the characters of w as (string, byte length) pairs, in order
local function char_len(b) return b < 0x80 and 1 or b < 0xE0 and 2 or b < 0xF0 and 3 or 4 end

---------------------------------------------------------------------------
-- BPE

-- merge the symbols (ids) of a word by rank, lowest first and leftmost among
-- equals, until no adjacent pair has a merge (tokenizers' Word::merge_all)
local function merge_small(syms, merges)
  local n = #syms
  while n > 1 do
    local best, bi = math.huge, 0
    local a = syms[1]
    for i = 1, n - 1 do
      local b = syms[i + 1]
      local v = merges[a * SH + b]
      if v and v < best then best, bi = v, i end
      a = b
    end
    if bi == 0 then break end
    syms[bi] = best % SH
    table.remove(syms, bi + 1)
    n = n - 1
  end
  return syms
end

-- the same with a binary heap and a linked list, for long words
local PSH = 16777216 -- 2^24 positions
local function merge_heap(syms, merges)
  local n = #syms
  local nxt, prv, alive = {}, {}, {}
  for i = 1, n do nxt[i], prv[i], alive[i] = i + 1, i - 1, true end
  nxt[n] = 0
  local heap, hn = {}, 0
  local function push(k)
    hn = hn + 1
    local i = hn
    while i > 1 do
      local p = floor(i / 2)
      if heap[p] <= k then break end
      heap[i] = heap[p]
      i = p
    end
    heap[i] = k
  end
  local function pop()
    local top = heap[1]
    local last = heap[hn]
    heap[hn] = nil
    hn = hn - 1
    if hn > 0 then
      local i = 1
      while true do
        local c = 2 * i
        if c > hn then break end
        if c < hn and heap[c + 1] < heap[c] then c = c + 1 end
        if heap[c] >= last then break end
        heap[i] = heap[c]
        i = c
      end
      heap[i] = last
    end
    return top
  end
  local function try(i)
    local j = nxt[i]
    if i < 1 or j == 0 then return end
    local v = merges[syms[i] * SH + syms[j]]
    if v then push(floor(v / SH) * PSH + i) end
  end
  for i = 1, n - 1 do try(i) end
  while hn > 0 do
    local k = pop()
    local rank, i = floor(k / PSH), k % PSH
    local j = nxt[i]
    if alive[i] and j ~= 0 then
      local v = merges[syms[i] * SH + syms[j]]
      if v and floor(v / SH) == rank then
        syms[i] = v % SH
        alive[j] = false
        local jn = nxt[j]
        nxt[i] = jn
        if jn ~= 0 then prv[jn] = i end
        if prv[i] >= 1 then try(prv[i]) end
        try(i)
      end
    end
  end
  local out = {}
  local i = 1
  while i ~= 0 do
    out[#out + 1] = syms[i]
    i = nxt[i]
  end
  return out
end

function M.bpe(spec, where)
  local vocab = check_vocab(spec, 'BPE', where)
  local dropout = opt_of(spec, 'dropout', 'number', 'BPE', where)
  if dropout and dropout > 0 then N.unsupported('BPE dropout', spec.dropout, where) end
  local prefix = opt_of(spec, 'continuing_subword_prefix', 'string', 'BPE', where)
  local suffix = opt_of(spec, 'end_of_word_suffix', 'string', 'BPE', where)
  local unk, fuse_unk, byte_fallback = opt_of(spec, 'unk_token', 'string', 'BPE', where), spec.fuse_unk == true,
    spec.byte_fallback == true
  if opt(spec.merges) ~= nil and type(spec.merges) ~= 'table' then
    rt.raise('tokenizer: the BPE merges are not a list (' .. where .. ')')
  end
  local ignore_merges = spec.ignore_merges == true
  local vocab_r, size = reverse(vocab)
  local merges = {}
  local plen = prefix and #prefix or 0
  for rank, m in ipairs(spec.merges or {}) do
    local a, b
    if type(m) == 'string' then
      local sp = m:find(' ', 2, true)
      if sp then a, b = sub(m, 1, sp - 1), sub(m, sp + 1) end
    elseif type(m) == 'table' then
      a, b = m[1], m[2]
    end
    if type(a) ~= 'string' or type(b) ~= 'string' then
      rt.raise(string.format('tokenizer: bad merge %s in %s', type(m) == 'string' and m or type(m), where))
    end
    local ia, ib = vocab[a], vocab[b]
    local new = vocab[a .. sub(b, plen + 1)]
    if not ia or not ib or not new then
      rt.raise(string.format("tokenizer: the merge '%s %s' uses a token that is not in the vocab (%s)", a, b, where))
    end
    merges[ia * SH + ib] = (rank - 1) * SH + new
  end
  local byte_ids
  if byte_fallback then
    byte_ids = {}
    for bt = 0, 255 do byte_ids[bt] = vocab[string.format('<0x%02X>', bt)] end
  end
  local unk_id
  if unk then
    unk_id = vocab[unk]
  end

  local function tokenize(w)
    if w == '' then return {} end
    if ignore_merges then
      local id = vocab[w]
      if id then return {id} end
    end
    local syms, n = {}, #w
    local i = 1
    local pend -- a pending unknown (fuse_unk)
    while i <= n do
      local l = char_len(byte(w, i))
      local s = sub(w, i, i + l - 1)
      if prefix and i > 1 then s = prefix .. s end
      if suffix and i + l > n then s = s .. suffix end
      local id = vocab[s]
      if id then
        if pend then syms[#syms + 1] = pend; pend = nil end
        syms[#syms + 1] = id
      else
        local done = false
        if byte_fallback then
          local ids, ok = {}, true
          for k = 1, #s do
            local bid = byte_ids[byte(s, k)]
            if not bid then ok = false break end
            ids[k] = bid
          end
          if ok then
            -- a pending unknown stays pending across byte tokens, as in tokenizers
            for _, bid in ipairs(ids) do syms[#syms + 1] = bid end
            done = true
          end
        end
        if not done and unk then
          if not unk_id then rt.raise(string.format("tokenizer: the unk_token '%s' is not in the vocab (%s)", unk, where)) end
          if pend and not fuse_unk then syms[#syms + 1] = pend end
          pend = unk_id
        end
      end
      i = i + l
    end
    if pend then syms[#syms + 1] = pend end
    if #syms <= 48 then return merge_small(syms, merges) end
    return merge_heap(syms, merges)
  end
  return {kind = 'BPE', vocab = vocab, vocab_r = vocab_r, size = size, tokenize = tokenize, unk_token = unk}
end

---------------------------------------------------------------------------
-- WordPiece: the longest vocabulary prefix, then ##-continuations; a word
-- with an unknown part (or longer than max_input_chars_per_word) is [UNK]

function M.wordpiece(spec, where)
  local vocab = check_vocab(spec, 'WordPiece', where)
  local unk = opt_of(spec, 'unk_token', 'string', 'WordPiece', where) or '[UNK]'
  local prefix = opt_of(spec, 'continuing_subword_prefix', 'string', 'WordPiece', where) or '##'
  local max_chars = opt_of(spec, 'max_input_chars_per_word', 'number', 'WordPiece', where) or 100
  local vocab_r, size = reverse(vocab)
  local function unk_ids()
    local id = vocab[unk]
    if not id then rt.raise(string.format("tokenizer: the unk_token '%s' is not in the vocab (%s)", unk, where)) end
    return {id}
  end
  local function tokenize(w)
    if w == '' then return {} end
    if U.len(w) > max_chars then return unk_ids() end
    local out, start, n = {}, 1, #w
    while start <= n do
      local stop = n
      local found
      while stop >= start do
        local s = sub(w, start, stop)
        if start > 1 then s = prefix .. s end
        local id = vocab[s]
        if id then found = id break end
        -- back up one character
        stop = stop - 1
        while stop >= start and byte(w, stop + 1) >= 0x80 and byte(w, stop + 1) < 0xC0 do stop = stop - 1 end
      end
      if not found then return unk_ids() end
      out[#out + 1] = found
      start = stop + 1
    end
    return out
  end
  return {kind = 'WordPiece', vocab = vocab, vocab_r = vocab_r, size = size, tokenize = tokenize, unk_token = unk,
          prefix = prefix}
end

---------------------------------------------------------------------------
-- WordLevel: the word's id or the unknown token's

function M.wordlevel(spec, where)
  local vocab = check_vocab(spec, 'WordLevel', where)
  local unk = opt_of(spec, 'unk_token', 'string', 'WordLevel', where)
  local vocab_r, size = reverse(vocab)
  local function tokenize(w)
    local id = vocab[w]
    if id then return {id} end
    if unk and vocab[unk] then return {vocab[unk]} end
    rt.raise(string.format("tokenizer: '%s' is not in the WordLevel vocab and there is no unk_token (%s)", w, where))
  end
  return {kind = 'WordLevel', vocab = vocab, vocab_r = vocab_r, size = size, tokenize = tokenize, unk_token = unk}
end

---------------------------------------------------------------------------
-- SPM: llama.cpp's llm_tokenizer_spm_session. Start from the characters,
-- repeatedly merge the adjacent pair whose concatenation is the vocabulary
-- token of highest score (the leftmost among equals), then write each symbol
-- as its token, or as byte tokens <0xXX> when it is not one.
-- spec: vocab, scores ({[id] = score}), byte_ids ({[byte] = id})

function M.spm(spec)
  local vocab, scores, byte_ids = spec.vocab, spec.scores, spec.byte_ids
  local vocab_r, size = reverse(vocab)
  local function tokenize(w)
    local n = #w
    if n == 0 then return {} end
    local start, len, nxt, prv = {}, {}, {}, {}
    local i, k = 1, 0
    while i <= n do
      local l = char_len(byte(w, i))
      if i + l - 1 > n then l = n - i + 1 end
      k = k + 1
      start[k], len[k], prv[k], nxt[k] = i, l, k - 1, k + 1
      i = i + l
    end
    nxt[k] = 0
    -- a max-heap of bigrams: score first, then the smaller left index
    local hs, hl, hr, hsize, hn = {}, {}, {}, {}, 0
    local function above(a, b) return hs[a] > hs[b] or (hs[a] == hs[b] and hl[a] < hl[b]) end
    local heap = {}
    local function push(score, left, right, size_)
      hn = hn + 1
      local e = hn
      hs[e], hl[e], hr[e], hsize[e] = score, left, right, size_
      local j = #heap + 1
      heap[j] = e
      while j > 1 do
        local p = floor(j / 2)
        if not above(heap[j], heap[p]) then break end
        heap[j], heap[p] = heap[p], heap[j]
        j = p
      end
    end
    local function pop()
      local top = heap[1]
      local m = #heap
      heap[1] = heap[m]
      heap[m] = nil
      m = m - 1
      local j = 1
      while true do
        local c = 2 * j
        if c > m then break end
        if c < m and above(heap[c + 1], heap[c]) then c = c + 1 end
        if not above(heap[c], heap[j]) then break end
        heap[j], heap[c] = heap[c], heap[j]
        j = c
      end
      return top
    end
    local function try(a, b)
      if a < 1 or b < 1 then return end
      local t = sub(w, start[a], start[b] + len[b] - 1)
      local id = vocab[t]
      if id then push(scores[id] or 0, a, b, #t) end
    end
    for j = 2, k do try(j - 1, j) end
    while #heap > 0 do
      local e = pop()
      local a, b = hl[e], hr[e]
      if len[a] > 0 and len[b] > 0 and len[a] + len[b] == hsize[e] then
        len[a] = len[a] + len[b]
        len[b] = 0
        nxt[a] = nxt[b]
        if nxt[b] ~= 0 then prv[nxt[b]] = a end
        try(prv[a], a)
        try(a, nxt[a])
      end
    end
    local out = {}
    local j = 1
    while j ~= 0 do
      local t = sub(w, start[j], start[j] + len[j] - 1)
      local id = vocab[t]
      if id then
        out[#out + 1] = id
      else
        for q = 1, #t do
          local bid = byte_ids[byte(t, q)] or vocab[sub(t, q, q)]
          if bid then out[#out + 1] = bid end
        end
      end
      j = nxt[j]
    end
    return out
  end
  return {kind = 'SPM', vocab = vocab, vocab_r = vocab_r, size = size, tokenize = tokenize}
end

function M.build(spec, where)
  local t = spec and spec.type
  if t == nil and spec and spec.merges then t = 'BPE' end
  if t == 'BPE' then return M.bpe(spec, where) end
  if t == 'WordPiece' then return M.wordpiece(spec, where) end
  if t == 'WordLevel' then return M.wordlevel(spec, where) end
  N.unsupported('model', t, where)
end

return M
