-- normalizers: the "normalizer" of a Hugging Face tokenizer.json as a Lua
-- function from string to string (the tokenizers library's normalizers/*.rs;
-- offsets are not tracked, since only ids are produced). build(spec, where)
-- returns the function, or nil for a null normalizer; an unknown type is an
-- error naming it and `where` (the file).
local U = require 'gpush.text.unicode'
local rt = require 'gpush.core.runtime'
local null = require('gpush.core.json').null

local M = {}

local function unsupported(kind, name, where)
  rt.raise(string.format("tokenizer: unsupported %s '%s' in %s", kind, tostring(name), where))
end
M.unsupported = unsupported

-- a {String = s} or {Regex = r} pattern of tokenizer.json as a compiled regex
function M.pattern(p, kind, where)
  if type(p) == 'string' then return U.regex(p, {literal = true}) end
  if type(p) ~= 'table' then unsupported(kind .. ' pattern', p, where) end
  if p.String then return U.regex(p.String, {literal = true}) end
  if p.Regex then
    local ok, r = pcall(U.regex, p.Regex)
    if not ok then rt.raise(string.format('tokenizer: %s in %s: %s', kind, where, r)) end
    return r
  end
  unsupported(kind .. ' pattern', next(p), where)
end

-- every match of re in s replaced by content
function M.replace(s, re, content)
  local out, prev = {}, 0
  re:each(s, function(a, b)
    out[#out + 1] = s:sub(prev + 1, a)
    out[#out + 1] = content
    prev = b
  end)
  if prev == 0 and #out == 0 then return s end
  out[#out + 1] = s:sub(prev + 1)
  return table.concat(out)
end

-- every occurrence of the string a in s replaced by b
local function replace_plain(s, a, b)
  local i = s:find(a, 1, true)
  if not i then return s end
  local out, j = {}, 1
  while i do
    out[#out + 1] = s:sub(j, i - 1)
    out[#out + 1] = b
    j = i + #a
    i = s:find(a, j, true)
  end
  out[#out + 1] = s:sub(j)
  return table.concat(out)
end
M.replace_plain = replace_plain

-- a function s -> s replacing what a tokenizer.json pattern matches by content
function M.replacer(p, content, kind, where)
  content = content or ''
  if type(p) == 'table' and type(p.String) == 'string' and p.String ~= '' then
    local a = p.String
    return function(s) return replace_plain(s, a, content) end
  end
  local re = M.pattern(p, kind, where)
  return function(s) return M.replace(s, re, content) end
end

local WHITE = U.WHITE
local function strip(s, left, right)
  local cps = U.codepoints(s)
  local i, j = 1, #cps
  if left then while i <= j and WHITE[cps[i]] do i = i + 1 end end
  if right then while j >= i and WHITE[cps[j]] do j = j - 1 end end
  if i == 1 and j == #cps then return s end
  local out = {}
  for k = i, j do out[#out + 1] = U.encode(cps[k]) end
  return table.concat(out)
end
M.strip = strip

-- the CJK blocks BERT puts spaces around (tokenizers' bert.rs is_chinese_char)
local function is_chinese(cp)
  return (cp >= 0x4E00 and cp <= 0x9FFF) or (cp >= 0x3400 and cp <= 0x4DBF) or (cp >= 0x20000 and cp <= 0x2A6DF) or
    (cp >= 0x2A700 and cp <= 0x2B73F) or (cp >= 0x2B740 and cp <= 0x2B81F) or (cp >= 0x2B920 and cp <= 0x2CEAF) or
    (cp >= 0xF900 and cp <= 0xFAFF) or (cp >= 0x2F800 and cp <= 0x2FA1F)
end
M.is_chinese = is_chinese

local function strip_accents(s)
  if not s:find('[\128-\255]') then return s end
  return U.filter(U.normalize(s, 'NFD'), function(cp) return not U.is_nonspacing_mark(cp) end)
end

-- f on the ASCII runs of s and g on the others (a run of bytes >= 0x80 holds
-- whole characters, and NFD only reorders marks, which are never ASCII)
local function by_runs(s, f, g)
  if not s:find('[\128-\255]') then return f(s) end
  local out, i, n = {}, 1, #s
  while i <= n do
    local a, b = s:find('[\128-\255]+', i)
    if not a then
      out[#out + 1] = f(s:sub(i))
      break
    end
    if a > i then out[#out + 1] = f(s:sub(i, a - 1)) end
    out[#out + 1] = g(s:sub(a, b))
    i = b + 1
  end
  return table.concat(out)
end

local function bert(spec)
  local clean, chinese, lower = spec.clean_text ~= false, spec.handle_chinese_chars ~= false, spec.lowercase ~= false
  local accents = spec.strip_accents
  if accents == nil or accents == null then accents = lower end
  -- ASCII: controls go (but tab, newline and return, which become spaces); nothing to strip
  local function ascii(s)
    if clean then s = s:gsub('[%z\1-\8\11\12\14-\31\127]', ''):gsub('[\t\n\r]', ' ') end
    if lower then s = s:lower() end
    return s
  end
  local function other(s)
    if clean then
      s = U.map(s, function(cp)
        if cp == 0xFFFD or U.is_other(cp) then return '' end
        if WHITE[cp] then return ' ' end
      end)
    end
    if chinese and s:find('[\227-\240]') then
      s = U.map(s, function(cp, ch) if is_chinese(cp) then return ' ' .. ch .. ' ' end end)
    end
    if accents then s = strip_accents(s) end
    if lower then s = U.lower(s) end
    return s
  end
  return function(s) return by_runs(s, ascii, other) end
end

-- the byte-to-character table of GPT-2's byte-level BPE (tokenizers'
-- bytes_char): printable bytes stand for themselves, the rest map to U+0100..
local BYTE_CHAR, CHAR_BYTE = {}, {}
do
  local n = 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174 and b <= 255)
    local cp = printable and b or 256 + n
    if not printable then n = n + 1 end
    BYTE_CHAR[b] = U.encode(cp)
    CHAR_BYTE[cp] = b
  end
end
M.BYTE_CHAR, M.CHAR_BYTE = BYTE_CHAR, CHAR_BYTE
local byte_map = {}
for b = 0, 255 do byte_map[string.char(b)] = BYTE_CHAR[b] end
function M.byte_level(s) return (s:gsub('.', byte_map)) end

-- the function of a normalizer spec (nil for none)
function M.build(spec, where)
  if spec == nil or spec == null then return nil end
  local t = spec.type
  if t == 'Sequence' then
    local fs = {}
    for _, sub in ipairs(spec.normalizers or {}) do fs[#fs + 1] = M.build(sub, where) end
    return function(s)
      for _, f in ipairs(fs) do s = f(s) end
      return s
    end
  elseif t == 'NFC' or t == 'NFD' or t == 'NFKC' or t == 'NFKD' then
    return function(s) return U.normalize(s, t) end
  elseif t == 'Lowercase' then
    return U.lower
  elseif t == 'Strip' then
    local l, r = spec.strip_left ~= false, spec.strip_right ~= false
    return function(s) return strip(s, l, r) end
  elseif t == 'StripAccents' then
    return function(s)
      if not s:find('[\128-\255]') then return s end
      return U.filter(s, function(cp) return not U.is_mark(cp) end)
    end
  elseif t == 'Replace' then
    return M.replacer(spec.pattern, spec.content, 'Replace normalizer', where)
  elseif t == 'Prepend' then
    local p = spec.prepend
    if p == nil or p == null then p = ''
    elseif type(p) ~= 'string' then rt.raise(string.format('tokenizer: Prepend normalizer in %s: prepend is a %s, not a string', where, type(p))) end
    return function(s) if s == '' then return s end return p .. s end
  elseif t == 'BertNormalizer' then
    return bert(spec)
  elseif t == 'ByteLevel' then
    return M.byte_level
  end
  unsupported('normalizer', t, where)
end

return M
