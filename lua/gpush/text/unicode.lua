-- unicode: what the tokenizers need to know about characters, through the
-- LuaJIT FFI: PCRE2 (regular expressions with Unicode classes, JIT-compiled),
-- linked into the gpush binary (Makefile: -lpcre2-8) so that ffi.C resolves
-- it, and utf8proc (general categories, case mapping, NFC/NFD/NFKC/NFKD),
-- loaded on first use (Debian's libutf8proc2): only text that is not ASCII
-- going through a normalizer, a category test or a case change needs it, so
-- a machine without it builds and runs gpush, and byte-level BPE tokenizers.
-- Strings are Lua byte strings holding UTF-8; offsets are 0-based byte
-- offsets, ends exclusive, as PCRE2 reports them.
local ffi = require 'ffi'
local bit = require 'bit'
local rt = require 'gpush.core.runtime'

local C = ffi.C
local M = {}

-- The few prototypes used, from pcre2.h (10.42, code unit width 8) and
-- utf8proc.h (2.8): opaque handles and scalars only, no struct layouts.
ffi.cdef [[
typedef struct pcre2_real_code_8 pcre2_code_8;
typedef struct pcre2_real_match_data_8 pcre2_match_data_8;
pcre2_code_8 *pcre2_compile_8(const uint8_t *pattern, size_t length, uint32_t options, int *errorcode,
                              size_t *erroroffset, void *ccontext);
int pcre2_jit_compile_8(pcre2_code_8 *code, uint32_t options);
void pcre2_code_free_8(pcre2_code_8 *code);
pcre2_match_data_8 *pcre2_match_data_create_from_pattern_8(const pcre2_code_8 *code, void *gcontext);
void pcre2_match_data_free_8(pcre2_match_data_8 *match_data);
int pcre2_match_8(const pcre2_code_8 *code, const uint8_t *subject, size_t length, size_t startoffset,
                  uint32_t options, pcre2_match_data_8 *match_data, void *mcontext);
size_t *pcre2_get_ovector_pointer_8(pcre2_match_data_8 *match_data);
int pcre2_get_error_message_8(int errorcode, uint8_t *buffer, size_t bufflen);

ptrdiff_t utf8proc_decompose(const uint8_t *str, ptrdiff_t strlen, int32_t *buffer, ptrdiff_t bufsize, int options);
ptrdiff_t utf8proc_reencode(int32_t *buffer, ptrdiff_t length, int options);
const char *utf8proc_version(void);
int utf8proc_category(int32_t codepoint);
int32_t utf8proc_tolower(int32_t c);
int32_t utf8proc_toupper(int32_t c);
const char *utf8proc_errmsg(ptrdiff_t errcode);
]]

-- utf8proc: in the binary if it was linked in, else the shared library
local utf8proc
local function U8()
  if utf8proc then return utf8proc end
  if pcall(function() return C.utf8proc_version end) then
    utf8proc = C
    return C
  end
  for _, name in ipairs {'utf8proc', 'libutf8proc.so.2', 'libutf8proc.so.3'} do
    local ok, lib = pcall(ffi.load, name)
    if ok then
      utf8proc = lib
      return lib
    end
  end
  rt.raise('unicode: libutf8proc is not installed (Debian: libutf8proc2, which `make deps` installs); ' ..
    'tokenizers need it for the Unicode categories, case and normalization forms of text that is not ASCII')
end
M.utf8proc = U8

local PCRE2_CASELESS, PCRE2_UCP, PCRE2_UTF = 0x00000008, 0x00020000, 0x00080000
local PCRE2_NO_UTF_CHECK, PCRE2_JIT_COMPLETE, PCRE2_ERROR_NOMATCH = 0x40000000, 1, -1
local UTF8PROC_STABLE, UTF8PROC_COMPAT, UTF8PROC_COMPOSE, UTF8PROC_DECOMPOSE = 2, 4, 8, 16

---------------------------------------------------------------------------
-- UTF-8

-- the code point at byte i (1-based) of s and the byte after it; a malformed
-- sequence (a stray continuation byte, a lead byte whose continuation bytes
-- are missing or wrong, a byte 0xF8..0xFF) is one U+FFFD for its first byte,
-- as decoders that replace errors read it, so text from outside never stops
-- the tokenizer
local byte, char, sub = string.byte, string.char, string.sub
local function cont(c) return c and c >= 0x80 and c < 0xC0 end
function M.decode_at(s, i)
  local b = byte(s, i)
  if b < 0x80 then return b, i + 1 end
  if b < 0xC0 or b >= 0xF8 then return 0xFFFD, i + 1 end
  if b < 0xE0 then
    local b1 = byte(s, i + 1)
    if not cont(b1) then return 0xFFFD, i + 1 end
    return bit.bor(bit.lshift(b - 0xC0, 6), b1 - 0x80), i + 2
  end
  if b < 0xF0 then
    local b1, b2 = byte(s, i + 1, i + 2)
    if not (cont(b1) and cont(b2)) then return 0xFFFD, i + 1 end
    return bit.bor(bit.lshift(b - 0xE0, 12), bit.lshift(b1 - 0x80, 6), b2 - 0x80), i + 3
  end
  local b1, b2, b3 = byte(s, i + 1, i + 3)
  if not (cont(b1) and cont(b2) and cont(b3)) then return 0xFFFD, i + 1 end
  return bit.bor(bit.lshift(b - 0xF0, 18), bit.lshift(b1 - 0x80, 12), bit.lshift(b2 - 0x80, 6), b3 - 0x80), i + 4
end
local decode_at = M.decode_at

-- the UTF-8 bytes of a code point
function M.encode(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + bit.rshift(cp, 6), 0x80 + bit.band(cp, 0x3F)) end
  if cp < 0x10000 then
    return char(0xE0 + bit.rshift(cp, 12), 0x80 + bit.band(bit.rshift(cp, 6), 0x3F), 0x80 + bit.band(cp, 0x3F))
  end
  return char(0xF0 + bit.rshift(cp, 18), 0x80 + bit.band(bit.rshift(cp, 12), 0x3F),
    0x80 + bit.band(bit.rshift(cp, 6), 0x3F), 0x80 + bit.band(cp, 0x3F))
end
local encode = M.encode

-- The valid range of the second byte after a lead byte, and the sequence
-- length (RFC 3629; what Rust's String::from_utf8_lossy accepts).
local LEAD = {}
for b = 0xC2, 0xDF do LEAD[b] = {2, 0x80, 0xBF} end
LEAD[0xE0] = {3, 0xA0, 0xBF}
for b = 0xE1, 0xEF do LEAD[b] = {3, 0x80, 0xBF} end
LEAD[0xED] = {3, 0x80, 0x9F}
LEAD[0xF0] = {4, 0x90, 0xBF}
for b = 0xF1, 0xF3 do LEAD[b] = {4, 0x80, 0xBF} end
LEAD[0xF4] = {4, 0x80, 0x8F}

-- the byte offset (1-based) of the first invalid UTF-8 sequence in s, or nil
function M.invalid_at(s)
  local n, i = #s, 1
  local p = ffi.cast('const uint8_t *', s)
  while i <= n do
    local b = p[i - 1]
    if b < 0x80 then
      i = i + 1
    else
      local l = LEAD[b]
      if not l or i + l[1] - 1 > n then return i end
      local b1 = p[i]
      if b1 < l[2] or b1 > l[3] then return i end
      for k = 2, l[1] - 1 do
        local c = p[i - 1 + k]
        if c < 0x80 or c > 0xBF then return i end
      end
      i = i + l[1]
    end
  end
  return nil
end

-- s with every maximal invalid subsequence replaced by U+FFFD, as Rust's
-- String::from_utf8_lossy (and Python's errors='replace') do
local FFFD = '\239\191\189'
function M.lossy(s)
  if not M.invalid_at(s) then return s end
  local out, n, i = {}, #s, 1
  while i <= n do
    local b = byte(s, i)
    if b < 0x80 then
      out[#out + 1] = char(b)
      i = i + 1
    else
      local l = LEAD[b]
      if not l then
        out[#out + 1] = FFFD
        i = i + 1
      else
        local j, ok = i + 1, true
        for k = 1, l[1] - 1 do
          local c = byte(s, j)
          local lo, hi = 0x80, 0xBF
          if k == 1 then lo, hi = l[2], l[3] end
          if not c or c < lo or c > hi then ok = false break end
          j = j + 1
        end
        out[#out + 1] = ok and sub(s, i, j - 1) or FFFD
        i = j
      end
    end
  end
  return table.concat(out)
end

-- the code points of s as a Lua array
function M.codepoints(s)
  local out, i, n = {}, 1, #s
  while i <= n do
    local cp
    cp, i = decode_at(s, i)
    out[#out + 1] = cp
  end
  return out
end

-- the characters of s (as strings) as a Lua array
function M.chars(s)
  local out, i, n = {}, 1, #s
  while i <= n do
    local b = byte(s, i)
    local l = b < 0x80 and 1 or b < 0xE0 and 2 or b < 0xF0 and 3 or 4
    out[#out + 1] = sub(s, i, i + l - 1)
    i = i + l
  end
  return out
end

-- the number of code points of s
function M.len(s)
  local n = 0
  local p, m = ffi.cast('const uint8_t *', s), #s
  for i = 0, m - 1 do
    if bit.band(p[i], 0xC0) ~= 0x80 then n = n + 1 end
  end
  return n
end

---------------------------------------------------------------------------
-- character classes (utf8proc's general categories, Unicode 15)

M.category = function(cp) return (utf8proc or U8()).utf8proc_category(cp) end
local category = M.category
-- category numbers (utf8proc_category_t)
local CN, LU, LO, MN, ME, ND, NO, PC, PO, CC, CO = 0, 1, 5, 6, 8, 9, 11, 12, 18, 26, 29
local ZS, ZP = 23, 25

-- Unicode's White_Space property (PropList.txt): what Rust's char::is_whitespace,
-- Oniguruma's \s and Python's str.strip() (but for U+001C..U+001F) take as space
local WHITE = {}
for _, cp in ipairs {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000} do
  WHITE[cp] = true
end
for cp = 0x2000, 0x200A do WHITE[cp] = true end
M.WHITE = WHITE
function M.is_whitespace(cp) return WHITE[cp] == true end
function M.is_letter(cp) local c = category(cp) return c >= LU and c <= LO end
function M.is_mark(cp) local c = category(cp) return c >= MN and c <= ME end
function M.is_nonspacing_mark(cp) return category(cp) == MN end
function M.is_numeric(cp) local c = category(cp) return c >= ND and c <= NO end
function M.is_punctuation(cp) local c = category(cp) return c >= PC and c <= PO end
-- Cc, Cf, Cs, Co and unassigned (unicode_categories' is_other)
function M.is_other(cp) local c = category(cp) return c == CN or (c >= CC and c <= CO) end
function M.is_separator(cp) local c = category(cp) return c >= ZS and c <= ZP end
-- a "word" character as Oniguruma's \w: letter, mark, number, connector punctuation
function M.is_word(cp) local c = category(cp) return (c >= LU and c <= NO) or c == PC end
function M.is_ascii_punctuation(cp)
  return (cp >= 33 and cp <= 47) or (cp >= 58 and cp <= 64) or (cp >= 91 and cp <= 96) or (cp >= 123 and cp <= 126)
end

-- lower case, code point by code point (Rust's char::to_lowercase: the one
-- unconditional multi-character mapping is U+0130)
function M.lower(s)
  if not s:find('[\128-\255A-Z]') then return s end
  if not s:find('[\128-\255]') then return s:lower() end
  local out, i, n = {}, 1, #s
  while i <= n do
    local cp
    cp, i = decode_at(s, i)
    if cp == 0x130 then out[#out + 1] = 'i\204\135' else out[#out + 1] = encode((utf8proc or U8()).utf8proc_tolower(cp)) end
  end
  return table.concat(out)
end

function M.upper(s)
  if not s:find('[\128-\255]') then return s:upper() end
  local out, i, n = {}, 1, #s
  while i <= n do
    local cp
    cp, i = decode_at(s, i)
    out[#out + 1] = encode((utf8proc or U8()).utf8proc_toupper(cp))
  end
  return table.concat(out)
end

-- s with only the code points for which keep(cp) is true
function M.filter(s, keep)
  local out, i, n = {}, 1, #s
  while i <= n do
    local j = i
    local cp
    cp, i = decode_at(s, i)
    if keep(cp) then out[#out + 1] = sub(s, j, i - 1) end
  end
  return table.concat(out)
end

-- s with each code point replaced by map(cp, ch) (a string) or kept (nil)
function M.map(s, f)
  local out, i, n = {}, 1, #s
  while i <= n do
    local j = i
    local cp
    cp, i = decode_at(s, i)
    local ch = sub(s, j, i - 1)
    out[#out + 1] = f(cp, ch) or ch
  end
  return table.concat(out)
end

---------------------------------------------------------------------------
-- normalization forms

local NF = {
  NFC = UTF8PROC_STABLE + UTF8PROC_COMPOSE,
  NFD = UTF8PROC_STABLE + UTF8PROC_DECOMPOSE,
  NFKC = UTF8PROC_STABLE + UTF8PROC_COMPOSE + UTF8PROC_COMPAT,
  NFKD = UTF8PROC_STABLE + UTF8PROC_DECOMPOSE + UTF8PROC_COMPAT,
}
-- s in normalization form 'NFC', 'NFD', 'NFKC' or 'NFKD'. utf8proc_map's
-- steps into a buffer Lua owns (utf8proc_map mallocs its result: an error
-- raised between the call and the free, such as a debug hook's, leaked it;
-- the Lua fuzzer found that): the decomposed code points, then re-encoded
-- (and composed) in place as UTF-8, NUL-terminated, in the same buffer
local function u8err(L, n) rt.raise('unicode.normalize: ' .. ffi.string(L.utf8proc_errmsg(n))) end
function M.normalize(s, form)
  local opt = NF[form]
  if not opt then rt.raise('unicode.normalize: unknown form ' .. tostring(form)) end
  if not s:find('[\128-\255]') then return s end -- ASCII is in every form
  local L = utf8proc or U8()
  local n = tonumber(L.utf8proc_decompose(s, #s, nil, 0, opt))
  if n < 0 then u8err(L, n) end
  local buf = ffi.new('int32_t[?]', n + 1)
  n = tonumber(L.utf8proc_decompose(s, #s, buf, n, opt))
  if n < 0 then u8err(L, n) end
  n = tonumber(L.utf8proc_reencode(buf, n, opt))
  if n < 0 then u8err(L, n) end
  return ffi.string(ffi.cast('const char *', buf), n)
end

---------------------------------------------------------------------------
-- regular expressions

-- Oniguruma (what the tokenizers library uses) and PCRE2 differ in \w (PCRE2's
-- has no marks), \s (PCRE2's also has U+180E) and \h; the pattern is rewritten
-- so that the classes mean what Oniguruma means (Unicode White_Space, and
-- letters, marks, numbers and connector punctuation).
local SPACE = [[\t\n\x{0B}\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}]]
local WORD = [[\p{L}\p{M}\p{N}\p{Pc}]]
local CLASS = {s = SPACE, w = WORD}
local function translate(pat)
  local out, i, n, in_class = {}, 1, #pat, false
  while i <= n do
    local c = sub(pat, i, i)
    if c == '\\' then
      local e = sub(pat, i + 1, i + 1)
      local lower = e:lower()
      if CLASS[lower] and (e == lower or not in_class) then
        if e == lower then
          out[#out + 1] = in_class and CLASS[e] or ('[' .. CLASS[e] .. ']')
        else
          out[#out + 1] = '[^' .. CLASS[lower] .. ']'
        end
      else
        out[#out + 1] = c .. e
      end
      i = i + 2
    else
      if c == '[' and not in_class then
        in_class = true
        out[#out + 1] = c
        -- a ] right after [ or [^ is a literal
        if sub(pat, i + 1, i + 1) == '^' then out[#out + 1] = '^'; i = i + 1 end
        if sub(pat, i + 1, i + 1) == ']' then out[#out + 1] = ']'; i = i + 1 end
      elseif c == '[' and sub(pat, i + 1, i + 1) == ':' then
        local j = pat:find(':]', i + 2, true) -- a POSIX class such as [:alpha:]
        local stop = j and j + 1 or i
        out[#out + 1] = sub(pat, i, stop)
        i = stop
      elseif c == ']' and in_class then
        in_class = false
        out[#out + 1] = c
      else
        out[#out + 1] = c
      end
      i = i + 1
    end
  end
  return table.concat(out)
end
M.translate = translate

local Regex = {}
Regex.__index = Regex

local errcode, erroffset = ffi.new('int[1]'), ffi.new('size_t[1]')
local errbuf = ffi.new('uint8_t[256]')

-- a compiled pattern; opts.caseless; opts.literal (match the text itself);
-- opts.onig = false keeps PCRE2's meaning of \s and \w
function M.regex(pattern, opts)
  opts = opts or {}
  local pat = pattern
  if opts.literal then
    pat = '\\Q' .. pattern:gsub('\\E', '\\E\\\\E\\Q') .. '\\E'
  elseif opts.onig ~= false then
    pat = translate(pattern)
  end
  local flags = PCRE2_UTF + PCRE2_UCP + (opts.caseless and PCRE2_CASELESS or 0)
  local code = C.pcre2_compile_8(pat, #pat, flags, errcode, erroffset, nil)
  if code == nil then
    C.pcre2_get_error_message_8(errcode[0], errbuf, 256)
    error(string.format('bad regular expression %q: %s at offset %d', pattern, ffi.string(errbuf), tonumber(erroffset[0])), 0)
  end
  code = ffi.gc(code, C.pcre2_code_free_8)
  C.pcre2_jit_compile_8(code, PCRE2_JIT_COMPLETE) -- falls back to the interpreter when the JIT is unavailable
  local md = ffi.gc(C.pcre2_match_data_create_from_pattern_8(code, nil), C.pcre2_match_data_free_8)
  return setmetatable({code = code, md = md, ov = C.pcre2_get_ovector_pointer_8(md), pattern = pattern}, Regex)
end

-- the first match of s at or after byte offset `from` (0-based): start, stop
-- (0-based, exclusive), or nil. s must be valid UTF-8: PCRE2 is told not to
-- check it (each() and test() do, once a text), and its compiled matcher
-- reads past the end of an invalid sequence
function Regex:find(s, from, len)
  local rc = C.pcre2_match_8(self.code, s, len or #s, from, PCRE2_NO_UTF_CHECK, self.md, nil)
  if rc < 0 then
    if rc == PCRE2_ERROR_NOMATCH then return nil end
    error(string.format('regular expression %q failed on the text (PCRE2 error %d)', self.pattern, rc), 0)
  end
  local ov = self.ov
  return tonumber(ov[0]), tonumber(ov[1])
end

-- f(start, stop) for each match of s in order, as Oniguruma's find_iter: an
-- empty match right where the previous match ended is skipped
local function valid(re, s)
  local bad = M.invalid_at(s)
  if bad then
    error(string.format('regular expression %q: the text is not valid UTF-8 (byte %d)', re.pattern, bad), 0)
  end
end

function Regex:each(s, f)
  valid(self, s)
  local n, pos, last_end = #s, 0, -1
  while pos <= n do
    local a, b = self:find(s, pos, n)
    if not a then return end
    if a == b and b == last_end then
      -- step over one character and look again
      if pos >= n then return end
      local c = byte(s, pos + 1)
      pos = pos + (c < 0x80 and 1 or c < 0xE0 and 2 or c < 0xF0 and 3 or 4)
    else
      f(a, b)
      pos, last_end = b, b
      if a == b then
        -- an empty match: the next search starts at the same place and is skipped there
        last_end = b
      end
    end
  end
end

-- does the pattern match somewhere in s
function Regex:test(s)
  valid(self, s)
  return self:find(s, 0) ~= nil
end

-- Rust's regex crate (which tokenizers uses beside Oniguruma) takes \w as
-- Unicode's word characters (UTS #18): alphabetic, marks, decimal digits,
-- connector punctuation, joiners
M.RUST_WORD = [[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]]
local rust_word
function M.is_rust_word(cp)
  rust_word = rust_word or M.regex('^[' .. M.RUST_WORD .. ']', {onig = false})
  return rust_word:test(encode(cp))
end
M.SPACE = SPACE

return M
