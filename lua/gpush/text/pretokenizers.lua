-- pretokenizers: the "pre_tokenizer" of a Hugging Face tokenizer.json (the
-- tokenizers library's pre_tokenizers/*.rs). A pre-tokenizer is a list of
-- stages; a stage is a function (piece, at_start, emit) that calls
-- emit(sub, sub_at_start) for each non-empty piece it cuts piece into, so the
-- stages chain without building lists. at_start says that the piece begins
-- at the start of the input (Metaspace's prepend_scheme 'first' asks).
local U = require 'gpush.text.unicode'
local N = require 'gpush.text.normalizers'
local null = require('gpush.core.json').null

local M = {}
local sub = string.sub

-- The split behaviors (tokenizers' SplitDelimiterBehavior) over the matches
-- that iter(s, f) reports as f(start, stop): 0-based, exclusive, in order.
local function split(s, at_start, emit, iter, behavior, invert)
  local n = #s
  if n == 0 then return end
  if behavior == 'Removed' and invert then
    -- the matches are what is kept
    iter(s, function(a, b)
      if b > a then emit(sub(s, a + 1, b), at_start and a == 0) end
    end)
    return
  end
  if (behavior == 'Isolated' or behavior == 'Removed') and not invert then
    local prev = 0
    local keep = behavior == 'Isolated'
    iter(s, function(a, b)
      if a > prev then emit(sub(s, prev + 1, a), at_start and prev == 0) end
      if keep and b > a then emit(sub(s, a + 1, b), at_start and a == 0) end
      prev = b
    end)
    if prev < n then emit(sub(s, prev + 1), at_start and prev == 0) end
    return
  end
  -- the segments (start, stop, is_match) covering s
  local seg = {}
  local prev = 0
  iter(s, function(a, b)
    if a > prev then seg[#seg + 1] = {prev, a, false} end
    seg[#seg + 1] = {a, b, true}
    prev = b
  end)
  if prev < n then seg[#seg + 1] = {prev, n, false} end
  if invert then for _, g in ipairs(seg) do g[3] = not g[3] end end
  local out = {}
  if behavior == 'Isolated' then
    out = seg
  elseif behavior == 'Removed' then
    for _, g in ipairs(seg) do if not g[3] then out[#out + 1] = g end end
  elseif behavior == 'Contiguous' then
    local pm = false
    for _, g in ipairs(seg) do
      if g[3] == pm and #out > 0 then out[#out][2] = g[2] else out[#out + 1] = {g[1], g[2]} end
      pm = g[3]
    end
  elseif behavior == 'MergedWithPrevious' then
    local pm = false
    for _, g in ipairs(seg) do
      if g[3] and not pm and #out > 0 then out[#out][2] = g[2] else out[#out + 1] = {g[1], g[2]} end
      pm = g[3]
    end
  elseif behavior == 'MergedWithNext' then
    local pm, rev = false, {}
    for i = #seg, 1, -1 do
      local g = seg[i]
      if g[3] and not pm and #rev > 0 then rev[#rev][1] = g[1] else rev[#rev + 1] = {g[1], g[2]} end
      pm = g[3]
    end
    for i = #rev, 1, -1 do out[#out + 1] = rev[i] end
  else
    error('unknown split behavior ' .. tostring(behavior), 0)
  end
  for _, g in ipairs(out) do
    if g[2] > g[1] then emit(sub(s, g[1] + 1, g[2]), at_start and g[1] == 0) end
  end
end
M.split = split

-- an iter for split: each code point for which pred(cp) is true is a match
local function chars_where(pred)
  return function(s, f)
    local i, n = 1, #s
    while i <= n do
      local cp, j = U.decode_at(s, i)
      if pred(cp) then f(i - 1, j - 1) end
      i = j
    end
  end
end
local function regex_iter(re) return function(s, f) re:each(s, f) end end

local BEHAVIOR = {removed = 'Removed', isolated = 'Isolated', merged_with_previous = 'MergedWithPrevious',
                  merged_with_next = 'MergedWithNext', contiguous = 'Contiguous'}
local function behavior_of(b, where)
  local v = BEHAVIOR[b] or (b and BEHAVIOR[b:gsub('(%l)(%u)', '%1_%2'):lower()]) or nil
  if not v then N.unsupported('split behavior', b, where) end
  return v
end

-- GPT-2's pre-tokenization regex (tokenizers' byte_level.rs)
M.GPT2_REGEX = [['s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+]]
local gpt2_re

-- ByteLevel: a prefix space, the GPT-2 regex, then bytes as characters. With
-- map = false the last step is left to the caller (who caches by raw piece).
function M.byte_level(spec, map)
  local prefix = spec.add_prefix_space == true
  local use_regex = spec.use_regex ~= false
  gpt2_re = gpt2_re or U.regex(M.GPT2_REGEX)
  local iter = regex_iter(gpt2_re)
  local bl = N.byte_level
  return function(s, at_start, emit)
    if prefix and sub(s, 1, 1) ~= ' ' then s = ' ' .. s end
    local out = emit
    if map then out = function(p, a) emit(bl(p), a) end end
    if use_regex then split(s, at_start, out, iter, 'Isolated') else out(s, at_start) end
  end
end

local function metaspace(spec, where)
  local rep = spec.replacement or '\226\150\129'
  local scheme = spec.prepend_scheme
  if scheme == nil or scheme == null then scheme = 'always' end
  if spec.add_prefix_space == false then scheme = 'never' end
  local do_split = spec.split ~= false
  local rep_cp = U.decode_at(rep, 1)
  local iter = chars_where(function(cp) return cp == rep_cp end)
  if scheme ~= 'always' and scheme ~= 'first' and scheme ~= 'never' then N.unsupported('Metaspace prepend_scheme', scheme, where) end
  return function(s, at_start, emit)
    s = s:gsub(' ', rep)
    if (scheme == 'always' or (scheme == 'first' and at_start)) and sub(s, 1, #rep) ~= rep then s = rep .. s end
    if do_split then split(s, at_start, emit, iter, 'MergedWithNext') else emit(s, at_start) end
  end
end

local function is_bert_punct(cp) return U.is_ascii_punctuation(cp) or U.is_punctuation(cp) end
local is_white = U.is_whitespace

-- the stages of a pre-tokenizer spec, appended to list
local function stages(spec, where, list)
  local t = spec.type
  if t == 'Sequence' then
    for _, s in ipairs(spec.pretokenizers or {}) do stages(s, where, list) end
  elseif t == 'ByteLevel' then
    list[#list + 1] = {type = 'ByteLevel', spec = spec, fn = M.byte_level(spec, true)}
  elseif t == 'Split' then
    local re = N.pattern(spec.pattern, 'Split pre_tokenizer', where)
    local behavior, invert = behavior_of(spec.behavior, where), spec.invert == true
    local iter = regex_iter(re)
    list[#list + 1] = {type = t, fn = function(s, a, emit) split(s, a, emit, iter, behavior, invert) end}
  elseif t == 'Digits' then
    local iter = regex_iter(U.regex(spec.individual_digits and '\\p{N}' or '\\p{N}+'))
    list[#list + 1] = {type = t, fn = function(s, a, emit) split(s, a, emit, iter, 'Isolated') end}
  elseif t == 'Metaspace' then
    list[#list + 1] = {type = t, fn = metaspace(spec, where)}
  elseif t == 'BertPreTokenizer' then
    -- whitespace removed, each punctuation character isolated (ASCII
    -- punctuation, symbols included, and Unicode's P categories): in one pass,
    -- the runs of other characters and the punctuation characters are kept
    local punct = [=[\p{P}!-/:-@\[-`{-~]=]
    local iter = regex_iter(U.regex('[^' .. U.SPACE .. punct .. ']+|[' .. punct .. ']', {onig = false}))
    list[#list + 1] = {type = t, fn = function(s, a, emit) split(s, a, emit, iter, 'Removed', true) end}
  elseif t == 'Whitespace' then
    -- \w+|[^\w\s]+ in Rust's regex crate
    local w = U.RUST_WORD
    local iter = regex_iter(U.regex('[' .. w .. ']+|[^' .. w .. U.SPACE .. ']+', {onig = false}))
    list[#list + 1] = {type = t, fn = function(s, a, emit) split(s, a, emit, iter, 'Removed', true) end}
  elseif t == 'WhitespaceSplit' then
    local iter = chars_where(is_white)
    list[#list + 1] = {type = t, fn = function(s, a, emit) split(s, a, emit, iter, 'Removed') end}
  elseif t == 'Punctuation' then
    local iter, behavior = chars_where(is_bert_punct), behavior_of(spec.behavior or 'Isolated', where)
    list[#list + 1] = {type = t, fn = function(s, a, emit) split(s, a, emit, iter, behavior) end}
  elseif t == 'CharDelimiterSplit' then
    local d = U.decode_at(spec.delimiter, 1)
    local iter = chars_where(function(cp) return cp == d end)
    list[#list + 1] = {type = t, fn = function(s, a, emit) split(s, a, emit, iter, 'Removed') end}
  else
    N.unsupported('pre_tokenizer', t, where)
  end
  return list
end

-- The pre-tokenizer of spec as one stage function (nil for none), and
-- whether its last stage is a ByteLevel whose byte mapping was left out (the
-- caller then applies normalizers.byte_level to each piece, after its cache).
function M.build(spec, where)
  if spec == nil or spec == null then return nil, false end
  local list = stages(spec, where, {})
  local deferred = false
  local last = list[#list]
  if last and last.type == 'ByteLevel' then
    last.fn = M.byte_level(last.spec, false)
    deferred = true
  end
  local fn = function(s, a, emit) emit(s, a) end
  for i = #list, 1, -1 do
    local stage, nxt = list[i].fn, fn
    fn = function(s, a, emit) stage(s, a, function(p, pa) nxt(p, pa, emit) end) end
  end
  if #list == 1 then fn = list[1].fn end
  return fn, deferred
end

return M
