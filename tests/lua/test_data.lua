-- gp.data: byte-level datasets (vocabularies, encode/decode, the unigram
-- baseline), device batches from the seeded generator, JSONL reading.
local T = require 'lib'
local data = gp.data

local TEXT = 'the cat sat on the mat. the dog sat on the log. ' .. string.rep('a quick brown fox jumps. ', 20)

T.test('vocabularies, encode and decode', function()
  local ds = data.text {text = 'abcab', val_fraction = 0}
  T.eq(ds.vocab_size, 3)
  T.same(ds:encode('cab'), {2, 0, 1})
  T.eq(ds:decode({2, 0, 1}), 'cab')
  T.eq(ds:decode(gp.tensor({0, 1, 2}, {dtype = 'i64'})), 'abc')
  T.raises(function() ds:encode('abz') end, 'byte 122 at position 3')
  T.raises(function() ds:decode({5}) end, 'id 5 at position 1')
  local all = data.text {text = 'abcab', vocab = 'bytes'}
  T.eq(all.vocab_size, 256)
  T.same(all:encode('a'), {97})
  T.eq(all:decode(all:encode(TEXT)), TEXT)
  -- printable: the printable ASCII, tab and newline, and any other byte of the text
  local pr = data.text {text = 'ab\xc3\xa9', vocab = 'printable'}
  T.eq(pr.vocab_size, 95 + 2 + 2)
  T.eq(pr:decode(pr:encode('ROMEO:\tHi ~\n')), 'ROMEO:\tHi ~\n')
  T.eq(pr:decode(pr:encode('\xc3\xa9')), '\xc3\xa9')
  T.same(pr:encode('\t\n '), {0, 1, 2})
  T.raises(function() pr:encode('\r') end, 'byte 13')
  T.raises(function() data.text {text = 'x', vocab = 'words'} end, 'vocab', 'printable')
  T.raises(function() data.text {} end, 'needs text')
  -- the unigram entropy in nats
  local u = data.text {text = 'aab'}
  T.near(u.unigram_entropy, -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)), 1e-12)
  -- train/val split: the last val_fraction of the text
  local d = data.text {text = string.rep('x', 100), val_fraction = 0.2}
  T.eq(d.train:numel(), 80); T.eq(d.val:numel(), 20)
end)

T.test('a file on disk', function()
  local path = os.tmpname()
  local f = assert(io.open(path, 'wb')); f:write(TEXT); f:close()
  local ds = data.text {path = path}
  os.remove(path)
  T.eq(ds.text_len, #TEXT)
  T.eq(ds:decode(ds.data), TEXT)
  T.raises(function() data.text {path = '/nonexistent/file.txt'} end, 'cannot open')
end)

T.test('batches: shapes, dtype, range, targets shifted by one, positions from the text', function()
  local ds = data.text {text = TEXT, val_fraction = 0.25}
  for _, split in ipairs {'train', 'val'} do
    local x, y = ds:batch(split, 5, 7)
    T.same(x.shape, {5, 7}); T.same(y.shape, {5, 7})
    T.eq(x.dtype, 'i64'); T.eq(y.dtype, 'i64')
    T.eq(x.device, gp.device())
    local xs, ys = x:cpu():totable(), y:cpu():totable()
    local src = ds:decode(split == 'train' and ds.train or ds.val)
    for b = 1, 5 do
      for t = 1, 7 do
        T.ok(xs[b][t] >= 0 and xs[b][t] < ds.vocab_size, 'in range')
        if t < 7 then T.eq(ys[b][t], xs[b][t + 1], 'y is x shifted') end
      end
      local sx = ds:decode(xs[b])
      local i = src:find(sx, 1, true)
      T.ok(i, 'a row is a piece of the split: ' .. sx)
      T.ok(src:find(ds:decode(ys[b]), 1, true), 'so is its target row')
    end
  end
  T.raises(function() ds:batch('test', 2, 2) end, "'train' or 'val'")
  T.raises(function() ds:batch('val', 2, 1000) end, 'needs at least 1001')
  local nv = data.text {text = TEXT, val_fraction = 0}
  T.raises(function() nv:batch('val', 2, 2) end, 'no validation split')
end)

T.test('batches: the same seed gives the same batch, another seed another', function()
  local ds = data.text {text = TEXT}
  gp.manual_seed(5)
  local a = ds:batch('train', 4, 8):cpu():totable()
  gp.manual_seed(5)
  local b = ds:batch('train', 4, 8):cpu():totable()
  T.same(a, b, 0)
  gp.manual_seed(6)
  local c = ds:batch('train', 4, 8):cpu():totable()
  local differ = false
  for i = 1, 4 do for j = 1, 8 do if a[i][j] ~= c[i][j] then differ = true end end end
  T.ok(differ)
end)

T.test('gp.k.windows: values, wrap-around, a bad start named on the CPU', function()
  local cpu, i64 = {device = 'cpu'}, {dtype = 'i64', device = 'cpu'}
  local src = gp.arange(10, cpu)
  local out = gp.empty({3, 4}, i64)
  gp.k.windows(out, src, gp.tensor({0, 5, 8}, i64))
  T.same(out:totable(), {{0, 1, 2, 3}, {5, 6, 7, 8}, {8, 9, 0, 1}}, 0)
  local o8 = gp.empty({1, 3}, {dtype = 'u8', device = 'cpu'})
  gp.k.windows(o8, gp.tensor({7, 8, 9}, {dtype = 'u8', device = 'cpu'}), gp.tensor({2}, {dtype = 'i32', device = 'cpu'}))
  T.same(o8:totable(), {{9, 7, 8}}, 0)
  T.raises(function() gp.k.windows(out, src, gp.tensor({0, 10, 1}, i64)) end, 'windows', 'start[1] = 10', '[0, 10)')
  T.raises(function() gp.k.windows(out, src, gp.tensor({0, -1, 1}, i64)) end, 'start[1] = -1')
end)

T.test('batches on CUDA', function()
  T.cuda()
  local ds = data.text {text = TEXT, device = 'cuda'}
  local x, y = ds:batch('train', 3, 9)
  T.eq(x.device, 'cuda')
  local xs, ys = x:cpu():totable(), y:cpu():totable()
  for b = 1, 3 do for t = 1, 8 do T.eq(ys[b][t], xs[b][t + 1]) end end
  -- a start outside [0, N) wraps on the GPU (no flag is read back)
  local out = gp.empty({2, 3}, {dtype = 'i64', device = 'cuda'})
  gp.k.windows(out, gp.arange(10, {device = 'cuda'}), gp.tensor({12, -1}, {dtype = 'i64', device = 'cuda'}))
  T.same(out:cpu():totable(), {{2, 3, 4}, {9, 0, 1}}, 0)
end)

T.test('JSONL: values, blank lines skipped, a bad line names its number', function()
  local path = os.tmpname()
  local f = assert(io.open(path, 'wb'))
  f:write('{"a": 1, "b": [1, 2]}\n\n"text"\n{"a": 2}\n')
  f:close()
  local l = data.jsonl(path)
  T.eq(#l, 3)
  T.eq(l[1].a, 1); T.eq(l[1].b[2], 2); T.eq(l[2], 'text'); T.eq(l[3].a, 2)
  local lines = {}
  for n, v in data.jsonl_lines(path) do lines[#lines + 1] = n end
  T.same(lines, {1, 3, 4})
  f = assert(io.open(path, 'wb'))
  f:write('{"a": 1}\n{"a": 2}\n{"a": oops}\n{"a": 4}\n')
  f:close()
  T.raises(function() data.jsonl(path) end, 'jsonl: ' .. path .. ':3:')
  data.write_jsonl(path, {{x = 1}, {x = 2}})
  local back = data.jsonl(path)
  T.eq(back[2].x, 2)
  os.remove(path)
  T.raises(function() data.jsonl('/nonexistent/x.jsonl') end, 'cannot open')
end)

T.test('facts_text: deterministic, the requested size, and every fact stated the same way each time', function()
  local a = gp.data.facts_text {entities = 50, bytes = 20000, seed = 3}
  T.eq(a, gp.data.facts_text {entities = 50, bytes = 20000, seed = 3}, 'the same seed gives the same text')
  T.ok(a ~= gp.data.facts_text {entities = 50, bytes = 20000, seed = 4}, 'another seed, another text')
  T.ok(#a >= 20000 and #a < 20200, 'about the requested size: ' .. #a)
  -- a creature's colour never changes between sentences
  local colour, n = {}, 0
  for name, c in a:gmatch('\n([A-Z]%a+) is an? (%a+) %a+ from') do
    n = n + 1
    if colour[name] then T.eq(colour[name], c, name) else colour[name] = c end
  end
  T.ok(n > 10, 'enough colour sentences to check: ' .. n)
  local ds = gp.data.text {text = a}
  T.ok(ds.vocab_size < 60, 'letters, digits, punctuation: ' .. ds.vocab_size)
  T.raises(function() gp.data.facts_text {entities = 1} end, 'entities')
end)

-- a text in the Shakespeare corpus' layout: titles, a blank line, "by William
-- Shakespeare"; a work's last line runs into the next title
local function works_text()
  local parts = {}
  for i, title in ipairs {'THE FIRST PLAY', "KING JOHN'S SECOND", 'THE LAST, A POEM'} do
    parts[#parts + 1] = title .. '\n\nby William Shakespeare\n\n' .. string.rep(string.format('Line %d of the work.\n', i), 40) ..
      (i < 3 and 'THE END' or '')
  end
  return table.concat(parts)
end

T.test('works: titles found, the held-out cut at the start of a whole work', function()
  local text = works_text()
  local w = data.works(text)
  T.eq(#w, 3)
  T.eq(w[1].title, 'THE FIRST PLAY'); T.eq(w[1].pos, 1)
  T.eq(w[2].title, "KING JOHN'S SECOND")
  T.eq(w[3].title, 'THE LAST, A POEM')
  T.eq(text:sub(w[3].pos, w[3].pos + 7), 'THE LAST')
  local cut, held = data.works_cut(text, 0.1)
  T.eq(cut, w[3].pos)
  T.eq(#held, 1); T.eq(held[1], 'THE LAST, A POEM')
  cut, held = data.works_cut(text, 0.5) -- more than the last work: the last two
  T.eq(cut, w[2].pos); T.eq(#held, 2)
end)

T.test('corpus: a Shakespeare-layout file held out by whole works, never in the training split', function()
  local path = os.tmpname()
  local f = assert(io.open(path, 'wb')); f:write(works_text()); f:close()
  local ds = data.shakespeare {path = path, vocab = 'present'}
  local text = works_text()
  local w = data.works(text)
  T.eq(ds.val_start, w[3].pos)
  T.eq(ds.train:numel(), w[3].pos - 1)
  T.eq(ds:decode(ds.val):sub(1, 8), 'THE LAST')
  T.ok(ds.description:find('THE LAST, A POEM', 1, true), ds.description)
  -- every training window ends before the cut
  gp.manual_seed(3)
  local x = ds:batch('train', 64, 8)
  T.ok(not ds:decode(x:view {x:numel()}):find('POEM', 1, true), 'a training batch holds held-out text')
  -- a plain file: its last val_fraction held out
  local ds2 = data.corpus {data = path, val_fraction = 0.25}
  T.eq(ds2.text_len - ds2.val_start + 1, math.floor(#text * 0.25))
  T.ok(ds2.description:find('held out', 1, true))
  -- data = 'corpus': the fallback file
  local ds3 = data.corpus {data = 'corpus', fallback = path}
  T.eq(ds3.path, path)
  T.raises(function() data.corpus {data = 'corpus'} end, 'no data')
  T.raises(function() data.shakespeare {path = path .. '.missing'} end, 'make models')
  os.remove(path)
end)

T.test('a tokenizer dataset: the two splits encoded apart, the unigram baseline per token', function()
  -- a stand-in tokenizer: one id per word and per space
  local vocab, words = {}, {}
  local tok = {vocab_size = 0}
  function tok:encode(s)
    local out = {}
    for piece in s:gmatch('%S+%s*') do
      if not vocab[piece] then vocab[piece] = #words; words[#words + 1] = piece; self.vocab_size = #words end
      out[#out + 1] = vocab[piece]
    end
    return out
  end
  function tok:decode(ids)
    local t = {}
    for i, id in ipairs(ids) do t[i] = words[id + 1] end
    return table.concat(t)
  end
  for _, w in ipairs {'a ', 'b ', 'c ', 'd '} do tok:encode(w) end
  local text = string.rep('a b c ', 30) .. 'd d d d '
  local ds = data.text {text = text, tokenizer = tok, val_start = #text - 7}
  T.eq(ds.train:numel(), 90); T.eq(ds.val:numel(), 4)
  T.same(ds.val:totable(), {3, 3, 3, 3})
  T.near(ds.bytes_per_token, #text / 94, 1e-9)
  T.near(ds.unigram_entropy, -(3 * (30 / 94) * math.log(30 / 94) + (4 / 94) * math.log(4 / 94)), 1e-9)
  T.eq(ds:decode({0, 1}), 'a b ')
  T.raises(function() data.text {text = text, tokenizer = {}} end, 'gp.tokenizer')
  T.raises(function() data.text {text = text, val_start = 1} end, 'val_start')
end)
