-- Tokenizer speed: encode and decode a megabyte of text on the host.
--
--   gpush scripts/bench/tokenizer.lua [--tokenizer DIR_OR_JSON] [--text FILE] [--mb 1] [--no-peer]
--
-- The text (Shakespeare from the test fixtures by default) is repeated up to
-- --mb megabytes and encoded as one string, first with an empty word cache
-- (cold) and then again (warm); then decoded. Each line gives MB/s, tokens
-- and tokens/s. With python3 and the `tokenizers` package importable, the
-- same file is encoded by Hugging Face tokenizers in the same run (the peer
-- line; --no-peer skips it) and the ids are compared.
local gp = rawget(_G, 'gp') or require 'gpush'
local root = GPUSH_ROOT or '.'
local fixtures = root .. '/tests/fixtures/tokenizers'

local o = gp.args.parse(arg, {
  {'tokenizer', fixtures .. '/smollm2', 'a Hugging Face directory or tokenizer.json'},
  {'text', fixtures .. '/shakespeare.txt', 'the text to encode'},
  {'mb', 1, 'megabytes of text (the file repeated)'},
  {'peer', true, 'time Hugging Face tokenizers too (--no-peer: do not)'},
  {'python', 'python3', 'the Python of the peer'},
}, {usage = 'gpush scripts/bench/tokenizer.lua [flags]', description = 'Tokenizer encode and decode speed on the host.'})

local f = assert(io.open(o.text, 'rb'))
local piece = f:read('*a')
f:close()
local want = math.floor(o.mb * 1048576)
local parts, n = {}, 0
while n < want do
  parts[#parts + 1] = piece
  n = n + #piece
end
local text = table.concat(parts):sub(1, want)
-- do not cut a character in two
while #text > 0 and text:byte(#text) >= 0x80 and text:byte(#text) < 0xC0 do text = text:sub(1, -2) end
if #text > 0 and text:byte(#text) >= 0xC0 then text = text:sub(1, -2) end

local tok = gp.tokenizer.load(o.tokenizer)
local mb = #text / 1048576
local function line(what, secs, ntok)
  print(string.format('%-28s %8.3f s  %7.2f MB/s  %9d tokens  %10.0f tokens/s', what, secs, mb / secs, ntok, ntok / secs))
end
print(string.format('%s, %.2f MB of %s', tostring(tok), mb, o.text))

tok.cache, tok.cache_n = {}, 0
collectgarbage()
local t0 = gp.train.now()
local ids = tok:encode(text, {padding = false, truncation = false})
line('gpush encode (cold cache)', gp.train.now() - t0, #ids)
collectgarbage()
t0 = gp.train.now()
ids = tok:encode(text, {padding = false, truncation = false})
line('gpush encode (warm cache)', gp.train.now() - t0, #ids)
collectgarbage()
t0 = gp.train.now()
local back = tok:decode(ids)
line('gpush decode', gp.train.now() - t0, #ids)
print('decode(encode(text)) == text: ' .. tostring(back == text))

if o.peer then
  local tmp = os.tmpname()
  local w = assert(io.open(tmp, 'wb'))
  w:write(text)
  w:close()
  local file = o.tokenizer
  if not file:match('%.json$') then file = file .. '/tokenizer.json' end
  local py = [[
import sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1]); tok.no_padding(); tok.no_truncation()
text = open(sys.argv[2], encoding='utf-8').read()
t0 = time.perf_counter(); e = tok.encode(text); t1 = time.perf_counter()
print(t1 - t0, len(e.ids), sum((i + 1) * (k % 1000 + 1) for k, i in enumerate(e.ids)) % 1000000007)
]]
  local script = os.tmpname()
  w = assert(io.open(script, 'wb'))
  w:write(py)
  w:close()
  local p = io.popen(string.format("%s '%s' '%s' '%s' 2>/dev/null", o.python, script, file, tmp))
  local out = p:read('*a')
  p:close()
  os.remove(tmp)
  os.remove(script)
  local secs, count, sum = out:match('^(%S+) (%d+) (%d+)')
  if secs then
    line('HF tokenizers encode (peer)', tonumber(secs), tonumber(count))
    local s = 0
    for k, i in ipairs(ids) do s = (s + (i + 1) * ((k - 1) % 1000 + 1)) % 1000000007 end
    print('same ids as the peer: ' .. tostring(tonumber(count) == #ids and tonumber(sum) == s))
  else
    print('peer: python3 with the tokenizers package is not available')
  end
end
