-- Checkpoints: safetensors round trips, metadata, and a loader that refuses
-- truncated, oversized, hostile and randomly corrupted files with an error.
local T = require 'lib'
local gp = require 'gpush'

local path = os.tmpname() .. '.safetensors'

local function read_all(p)
  local f = assert(io.open(p, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end
local function write_all(p, s)
  local f = assert(io.open(p, 'wb'))
  f:write(s)
  f:close()
end
local function u64le(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end
local function with_header(h, data) return u64le(#h) .. h .. (data or '') end

T.test('round trip of every dtype, with metadata', function()
  local t = {
    w = gp.randn({3, 5}, {device = 'cpu'}), b = gp.randn({5}, {dtype = 'bf16', device = 'cpu'}),
    h = gp.randn({2, 2}, {dtype = 'f16', device = 'cpu'}), i = gp.randint(-9, 9, {4}, {dtype = 'i32', device = 'cpu'}),
    l = gp.randint(0, 1e9, {3}, {device = 'cpu'}), m = gp.randint(0, 2, {6}, {dtype = 'u8', device = 'cpu'}),
    d = gp.randn({2}, {dtype = 'f64', device = 'cpu'}), s = gp.tensor(4.5, {device = 'cpu'}),
    e = gp.zeros({0, 3}, {device = 'cpu'}), v = gp.randn({4, 3}, {device = 'cpu'}):t(),
  }
  gp.save(path, t, {step = 7, config = {n_embd = 128, name = 'gpt'}, note = 'hello'})
  local r, meta = gp.load(path)
  for k, v in pairs(t) do
    T.ok(r[k], k)
    T.eq(r[k].dtype, v.dtype, k)
    T.same(r[k].shape, v.shape)
    T.eq(T.relnorm(r[k], v), 0, k)
  end
  T.eq(meta.step, 7)
  T.eq(meta.config.n_embd, 128)
  T.eq(meta.config.name, 'gpt')
  T.eq(meta.note, 'hello')
  os.remove(path)
end)

T.test('a file from another writer (hand-made header) loads', function()
  -- what Python's safetensors writes for {"x": torch.arange(4, dtype=torch.float32)}
  local data = string.char(0, 0, 0, 0, 0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64)
  write_all(path, with_header('{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}      ', data))
  local r = gp.load(path)
  T.same(r.x:totable(), {0, 1, 2, 3})
end)

T.test('hostile and truncated files give errors', function()
  local cases = {
    {'', 'truncated'},
    {'abc', 'truncated'},
    {u64le(2 ^ 40) .. '{}', 'header length'},
    {u64le(100) .. '{}', 'header length'},
    {u64le(0), 'header length'},
    {with_header('{"x":'), 'not a JSON object'},
    {with_header('[1,2]'), 'not a JSON object'},
    {with_header('{"x":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}}', 'a'), 'dtype F8'},
    {with_header('{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', 'abcd'), 'bad size'},
    {with_header('{"x":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}', 'abcd'), 'bad size'},
    {with_header('{"x":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}}', 'abcd'), 'bad shape'},
    {with_header('{"x":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}', 'abcd'), 'too large'},
    {with_header('{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 'abcd'), 'outside'},
    {with_header('{"x":{"dtype":"F32","shape":[2],"data_offsets":[4,0]}}', 'abcdabcd'), 'outside'},
    {with_header('{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', 'abcdabcd'), 'need 8'},
    {with_header('{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"y":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}', 'abcdabcd'), 'overlaps'},
    {with_header('{"x":{"dtype":"F32","shape":[1]}}', 'abcd'), 'data_offsets'},
    {with_header('{"x":3}'), 'not an object'},
    {with_header('{"__metadata__":{"a":1}}'), 'metadata'},
  }
  collectgarbage()
  local m0 = gp.memory().host_in_use
  for i, c in ipairs(cases) do
    write_all(path, c[1])
    local err = T.raises(function() return gp.load(path) end, 'load')
    if not err:find(c[2], 1, true) then error(string.format('case %d: %q does not mention %q', i, err, c[2])) end
  end
  T.raises(function() return gp.load('/nonexistent/file.safetensors') end, 'load', 'cannot open')
  collectgarbage()
  T.eq(gp.memory().host_in_use, m0, 'nothing leaked')
  os.remove(path)
end)

T.test('fuzz: 2000 corrupted and truncated files never crash', function()
  local good = {}
  for i = 1, 4 do good['t' .. i] = gp.randn({i, 3}, {device = 'cpu'}) end
  gp.save(path, good, {k = 'v'})
  local bytes = read_all(path)
  math.randomseed(12345)
  local loaded, refused = 0, 0
  for it = 1, 2000 do
    local s
    local mode = it % 4
    if mode == 0 then
      s = bytes:sub(1, math.random(0, #bytes))
    else
      local b = {bytes:byte(1, -1)}
      for _ = 1, math.random(1, 8) do
        local at = mode == 1 and math.random(1, math.min(#b, 8 + 40)) or math.random(1, #b)
        b[at] = math.random(0, 255)
      end
      s = string.char(unpack(b))
    end
    write_all(path, s)
    local ok = pcall(gp.load, path)
    if ok then loaded = loaded + 1 else refused = refused + 1 end
  end
  T.ok(refused > 500, 'most corruptions are refused: ' .. refused)
  T.ok(loaded > 0, 'data-only corruptions still load: ' .. loaded)
  os.remove(path)
end)

T.test('save errors leave no file behind', function()
  T.raises(function() gp.save(path, {x = 3}) end, 'save', "'x'", 'not a tensor')
  T.raises(function() gp.save(path, {[1] = gp.zeros {1}}) end, 'save', 'strings')
  T.raises(function() gp.save('/nonexistent/dir/m.safetensors', {x = gp.zeros {1}}) end, 'save', 'cannot write')
  T.eq(io.open(path, 'rb'), nil)
end)
