-- The Lua parsers of outside input under random input (issue 26): chat
-- templates from a grammar and mutated real ones, tokenizer.json files with
-- fields dropped, retyped and broken (tests/fuzz/random_text.lua), each run
-- in a process of its own. Every input must render, load, or fail with one of
-- gpush's own errors. Longer runs by hand:
--   build/gpush tests/fuzz/random_text.lua jinja 200000 SEED
local T = require 'lib'

local function run(kind, n, seed)
  local out, rc = T.sh(string.format('%s %s/tests/fuzz/random_text.lua %s %d %d', T.exe, T.root, kind, n, seed))
  T.ok(rc == 0, string.format('%s: exit status %s (the number of findings):\n%s', kind, tostring(rc), out:sub(1, 6000)))
  T.ok(out:find(string.format('%s: %d inputs, 0 findings', kind, n), 1, true), out:sub(1, 2000))
end

T.test('chat templates: 3000 random and mutated templates render or fail with a template error', function()
  run('jinja', 3000, 26)
end)

T.test('tokenizer.json: 400 broken files load and encode, or fail with a tokenizer error', function()
  run('tokenizer', 400, 26)
end)

T.test('randomized inputs: a seed draws the same inputs in every process (FUZZ_TEXT_DIGEST)', function()
  for _, kind in ipairs {'jinja', 'tokenizer'} do
    local digests = {}
    for i = 1, 2 do
      local out = T.sh(string.format('FUZZ_TEXT_DIGEST=1 %s %s/tests/fuzz/random_text.lua %s 200 5', T.exe, T.root, kind))
      digests[i] = out:match('digest of the inputs %(seed 5%): (%x+)')
      T.ok(digests[i], out:sub(1, 2000))
    end
    T.eq(digests[1], digests[2], kind .. ': the digests of two runs')
  end
end)

T.test('fuzz check: a bug phrase counts where Lua raised it, not where a message quotes the input', function()
  package.path = T.root .. '/tests/fuzz/?.lua;' .. package.path
  local F = require 'fuzz'
  local function finding(err, input)
    local ok, e = pcall(F.check, err, 'what', input)
    return not ok and tostring(e):find('^FINDING: what: ') ~= nil
  end
  T.ok(finding('lua/gpush/text/models.lua:12: attempt to index a nil value', '{}'))
  T.ok(finding('lua/gpush/text/models.lua:12: attempt to index a nil value', '"attempt to "')) -- Lua's own
  T.ok(finding("models.lua:3: tokenizer: wrapped: bad argument #1 to 'insert'", '{}')) -- the input has no such text
  -- a fuzzer's input naming a type after a bug phrase (the fuzzers learn them from this check's compares)
  T.ok(not finding("fuzz.lua:44: tokenizer: unsupported pre_tokenizer 'Bnumber has no integer representationx'",
    '{"pre_tokenizer": {"type": "Bnumber has no integer representationx"}}'))
  T.ok(not finding('fuzz.lua:44: tokenizer: the vocabulary is empty', '{}'))
  T.ok(not finding('chat template: attempt to call an undefined value (line 1)', '{{ x() }}'))
end)
