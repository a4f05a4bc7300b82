-- decoders: the "decoder" of a Hugging Face tokenizer.json, from the tokens
-- of some ids back to text (the tokenizers library's decoders/*.rs). Each
-- decoder maps a list of token strings to a list of strings (decode_chain);
-- the text is their concatenation. Without a decoder, tokens are joined with
-- spaces, as tokenizers does.
local U = require 'gpush.text.unicode'
local N = require 'gpush.text.normalizers'
local null = require('gpush.core.json').null

local M = {}
local sub, concat = string.sub, table.concat

local CHAR_BYTE = N.CHAR_BYTE

-- byte-level: every character of a token back to its byte (a token with a
-- character outside the table stays as it is), then invalid UTF-8 replaced
local byte_memo = {} -- token -> its bytes (at most the tokens of the vocabularies in use)
local function token_bytes(t)
  local r = byte_memo[t]
  if r then return r end
  local bytes, i, n = {}, 1, #t
  while i <= n do
    local cp
    cp, i = U.decode_at(t, i)
    local b = CHAR_BYTE[cp]
    if not b then
      bytes = nil
      break
    end
    bytes[#bytes + 1] = string.char(b)
  end
  r = bytes and concat(bytes) or t
  byte_memo[t] = r
  return r
end
local function byte_level(tokens)
  local out = {}
  for i, t in ipairs(tokens) do out[i] = token_bytes(t) end
  return {U.lossy(concat(out))}
end

local function byte_fallback(tokens)
  local out, pending = {}, {}
  local function flush()
    if #pending > 0 then
      local s = concat(pending)
      if U.invalid_at(s) then
        for _ = 1, #pending do out[#out + 1] = '\239\191\189' end
      else
        out[#out + 1] = s
      end
      pending = {}
    end
  end
  for _, t in ipairs(tokens) do
    -- two hex digits, as u8::from_str_radix reads them (tonumber takes '-1'
    -- and ' 5' too: string.char(-1) raised, a fuzz finding)
    local hex = #t == 6 and t:match('^<0x(%x%x)>$')
    if hex then
      pending[#pending + 1] = string.char(tonumber(hex, 16))
    else
      flush()
      out[#out + 1] = t
    end
  end
  flush()
  return out
end

local function strip(content, start, stop)
  local c = U.decode_at(content, 1)
  return function(tokens)
    local out = {}
    for i, t in ipairs(tokens) do
      local cps = U.codepoints(t)
      local a, b = 1, #cps
      for k = 1, math.min(start, #cps) do
        if cps[k] == c then a = k + 1 else break end
      end
      for k = 0, stop - 1 do
        local idx = #cps - k
        if idx < 1 then break end
        if cps[idx] == c then b = idx - 1 else break end
      end
      local r = {}
      for k = a, b do r[#r + 1] = U.encode(cps[k]) end
      out[i] = concat(r)
    end
    return out
  end
end

-- WordPiece's cleanup of tokenization spaces (tokenizers' decoders/wordpiece.rs)
local CLEANUP = {{' .', '.'}, {' ?', '?'}, {' !', '!'}, {' ,', ','}, {" ' ", "'"}, {" n't", "n't"}, {" 'm", "'m"},
                 {' do not', " don't"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}}
local function replace_all(s, a, b)
  local out, i = {}, 1
  while true do
    local j = s:find(a, i, true)
    if not j then break end
    out[#out + 1] = sub(s, i, j - 1)
    out[#out + 1] = b
    i = j + #a
  end
  if i == 1 then return s end
  out[#out + 1] = sub(s, i)
  return concat(out)
end
M.replace_all = replace_all
function M.cleanup(s)
  if not s:find(" [.?!,'nd]") then return s end -- how every pattern starts (most tokens: none)
  for _, p in ipairs(CLEANUP) do s = replace_all(s, p[1], p[2]) end
  return s
end

local function build(spec, where)
  local t = spec.type
  if t == 'Sequence' then
    local fs = {}
    for _, d in ipairs(spec.decoders or {}) do fs[#fs + 1] = build(d, where) end
    return function(tokens)
      for _, f in ipairs(fs) do tokens = f(tokens) end
      return tokens
    end
  elseif t == 'ByteLevel' then
    return byte_level
  elseif t == 'ByteFallback' then
    return byte_fallback
  elseif t == 'Fuse' then
    return function(tokens) return {concat(tokens)} end
  elseif t == 'Strip' then
    return strip(spec.content or ' ', spec.start or 0, spec.stop or 0)
  elseif t == 'Replace' then
    local f = N.replacer(spec.pattern, spec.content, 'Replace decoder', where)
    return function(tokens)
      local out = {}
      for i, tok in ipairs(tokens) do out[i] = f(tok) end
      return out
    end
  elseif t == 'Metaspace' then
    local rep = spec.replacement or '\226\150\129'
    local scheme = spec.prepend_scheme
    if scheme == nil or scheme == null then scheme = 'always' end
    if spec.add_prefix_space == false then scheme = 'never' end
    return function(tokens)
      local out = {}
      for i, tok in ipairs(tokens) do
        out[i] = replace_all(tok, rep, (i == 1 and scheme ~= 'never') and '' or ' ')
      end
      return out
    end
  elseif t == 'WordPiece' then
    local prefix, cleanup = spec.prefix or '##', spec.cleanup ~= false
    return function(tokens)
      local out = {}
      for i, tok in ipairs(tokens) do
        if i > 1 then
          if sub(tok, 1, #prefix) == prefix then tok = sub(tok, #prefix + 1) else tok = ' ' .. tok end
        end
        if cleanup then tok = M.cleanup(tok) end
        out[i] = tok
      end
      return out
    end
  elseif t == 'BPEDecoder' then
    local suffix = spec.suffix or '</w>'
    return function(tokens)
      local out = {}
      for i, tok in ipairs(tokens) do out[i] = replace_all(tok, suffix, i == #tokens and '' or ' ') end
      return out
    end
  end
  N.unsupported('decoder', t, where)
end

-- the text of a list of tokens under a decoder spec (nil: joined with spaces)
function M.build(spec, where)
  if spec == nil or spec == null then
    return function(tokens) return concat(tokens, ' ') end
  end
  local f = build(spec, where)
  return function(tokens) return concat(f(tokens)) end
end

return M
