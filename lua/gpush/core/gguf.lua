-- gp.gguf: GGUF files (llama.cpp's model format, versions 2 and 3) through
-- src/gguf.c. open() maps the file, checks its whole header and reads the
-- metadata into Lua values and the tensor infos into a list; tensor data is
-- read only by :raw and :read, so opening a large file is quick. :read turns
-- the ggml types gpush can decode (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
-- Q8_0, Q4_K, Q5_K, Q6_K) into float tensors in PyTorch's shape, on the
-- device asked for (quantized blocks are copied there and decoded there, by
-- the gp.k.dequant_* kernels).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local kernels = require 'gpush.core.kernels'
local doc = require('gpush.core.doc').doc
local C, raise = rt.C, rt.raise

local M = {}
local File = {}
File.__index = File
M.File = File

-- GGUF value types, by their number in the file
local VT = {[0] = 'u8', 'i8', 'u16', 'i16', 'u32', 'i32', 'f32', 'bool', 'string', 'array', 'u64', 'i64', 'f64'}
local STRING, ARRAY, BOOL, U64, I64 = 8, 9, 7, 10, 11

-- the kernel that decodes each quantized type (gp.k.NAME(out (N, block), raw (N, bytes)))
M.dequant_kernels = {Q4_0 = 'dequant_q4_0', Q4_1 = 'dequant_q4_1', Q5_0 = 'dequant_q5_0', Q5_1 = 'dequant_q5_1',
                     Q8_0 = 'dequant_q8_0', Q4_K = 'dequant_q4_k', Q5_K = 'dequant_q5_k', Q6_K = 'dequant_q6_k'}
-- the gpush dtype that holds each unquantized type as it is
local NATIVE = {F32 = 'f32', F16 = 'f16', BF16 = 'bf16', F64 = 'f64', I32 = 'i32', I64 = 'i64'}
local FLOATS = {f32 = true, bf16 = true, f16 = true, f64 = true}

local sbox, lbox = ffi.new('const char *[1]'), ffi.new('int64_t[1]')
local tbox, ebox, nbox = ffi.new('int[1]'), ffi.new('int[1]'), ffi.new('int64_t[1]')
local ibox, dbox = ffi.new('int64_t[1]'), ffi.new('double[1]')
local dims, offbox, nbbox, ndbox = ffi.new('int64_t[4]'), ffi.new('int64_t[1]'), ffi.new('int64_t[1]'), ffi.new('int[1]')
local blkbox, bytbox = ffi.new('int[1]'), ffi.new('int[1]')

-- a 64-bit integer that a double cannot hold exactly stays a cdata (int64_t, or uint64_t for u64)
local function big_int(g, i, j, et)
  rt.call(C.gp_gguf_meta_int, ibox, g, i, j)
  return et == U64 and ffi.cast('uint64_t', ibox[0]) or ffi.new('int64_t', ibox[0])
end

local function read_meta(g)
  local meta, types = {}, {}
  local call, gstr, str = rt.call, C.gp_gguf_meta_string, ffi.string
  for i = 0, tonumber(C.gp_gguf_meta_count(g)) - 1 do
    call(C.gp_gguf_meta_key, sbox, lbox, g, i)
    local key = str(sbox[0], lbox[0])
    call(C.gp_gguf_meta_type, tbox, ebox, nbox, g, i)
    local ty, et, n = tbox[0], ebox[0], tonumber(nbox[0])
    local v
    if ty == ARRAY then
      v = {}
      if et == STRING then
        for j = 0, n - 1 do
          if gstr(sbox, lbox, g, i, j) ~= 0 then rt.raise(rt.last_error()) end
          v[j + 1] = str(sbox[0], lbox[0])
        end
      elseif n > 0 then
        local buf = ffi.new('double[?]', n)
        call(C.gp_gguf_meta_numbers, buf, g, i, 0, n)
        if et == BOOL then
          for j = 0, n - 1 do v[j + 1] = buf[j] ~= 0 end
        else
          for j = 0, n - 1 do v[j + 1] = buf[j] end
          if et == U64 or et == I64 then
            for j = 0, n - 1 do if math.abs(buf[j]) >= 2 ^ 53 then v[j + 1] = big_int(g, i, j, et) end end
          end
        end
      end
      types[key] = 'array of ' .. VT[et]
    elseif ty == STRING then
      call(gstr, sbox, lbox, g, i, 0)
      v = str(sbox[0], lbox[0])
      types[key] = 'string'
    else
      call(C.gp_gguf_meta_number, dbox, g, i, 0)
      local d = dbox[0]
      if ty == BOOL then v = d ~= 0
      elseif (ty == U64 or ty == I64) and math.abs(d) >= 2 ^ 53 then v = big_int(g, i, 0, ty)
      else v = d end
      types[key] = VT[ty]
    end
    meta[key] = v
  end
  return meta, types
end

local function read_tensors(g)
  local list, by_name = {}, {}
  for i = 0, tonumber(C.gp_gguf_tensor_count(g)) - 1 do
    rt.call(C.gp_gguf_tensor_info, sbox, tbox, ndbox, dims, offbox, nbbox, g, i)
    local shape, torch_shape = {}, {}
    local nd = ndbox[0]
    for d = 1, nd do shape[d] = tonumber(dims[d - 1]) end
    for d = 1, nd do torch_shape[d] = shape[nd + 1 - d] end
    local id = tbox[0]
    local t = {name = ffi.string(sbox[0]), type = ffi.string(C.gp_gguf_type_name(id)), type_id = id, shape = shape,
               torch_shape = torch_shape, nbytes = tonumber(nbbox[0]), offset = tonumber(offbox[0]), index = i}
    list[i + 1] = t
    by_name[t.name] = t
  end
  return list, by_name
end

function M.open(path)
  if type(path) ~= 'string' then raise('gguf.open: the path must be a string, got a ' .. type(path)) end
  local box = ffi.new('gp_gguf *[1]')
  rt.call(C.gp_gguf_open, box, path)
  local g = ffi.gc(box[0], C.gp_gguf_close)
  local meta, types = read_meta(g)
  local list, by_name = read_tensors(g)
  return setmetatable({
    path = path, version = C.gp_gguf_version(g), alignment = tonumber(C.gp_gguf_alignment(g)),
    data_offset = tonumber(C.gp_gguf_data_offset(g)), meta = meta, meta_types = types, tensors = list,
    by_name = by_name, _g = g,
  }, File)
end
doc(M.open, 'gp.gguf.open(path)',
  'open a GGUF file (v2, v3): .version, .meta (key -> number, bool, string or array), .meta_types, '
    .. '.tensors ({name, type, shape (ggml order, ne0 first), torch_shape, nbytes}), .by_name; the header is checked whole')

-- the tensor entry and the open handle, or an error naming the file and the tensor
local function entry(self, name, op)
  if getmetatable(self) ~= File then raise('gguf:' .. op .. ': call it as f:' .. op .. '(name)') end
  if not self._g then raise(string.format('gguf:%s: %s is closed', op, self.path)) end
  if type(name) ~= 'string' then raise(string.format('gguf:%s: the tensor name must be a string, got a %s', op, type(name))) end
  local t = self.by_name[name]
  if not t then
    raise(string.format("gguf: %s: no tensor '%s' (the file has %d tensors%s)", self.path, name, #self.tensors,
      #self.tensors > 0 and (", e.g. '" .. self.tensors[1].name .. "'") or ''))
  end
  return t
end

local function read_into(self, t, out)
  rt.call(C.gp_gguf_read, self._g, t.index, out.c)
  return out
end

function File:raw(name, opts)
  local t = entry(self, name, 'raw')
  local device = opts and opts.device or 'cpu'
  return read_into(self, t, tensor.empty({t.nbytes}, 'u8', device, 'gguf:raw'))
end
doc(File.raw, "gguf:raw(name, {device='cpu'})", "the tensor's bytes as they are in the file: a u8 tensor of nbytes")

function File:read(name, opts)
  local t = entry(self, name, 'read')
  opts = opts or {}
  if type(opts) ~= 'table' then raise("gguf:read: options must be a table like {dtype = 'bf16', device = 'cuda'}") end
  local device = opts.device or tensor.state.device
  local native = NATIVE[t.type]
  local dt = rt.dtype(opts.dtype or ((native == 'i32' or native == 'i64') and native or 'f32'), 'gguf:read')
  local kname = M.dequant_kernels[t.type]
  if kname then
    if not FLOATS[dt] then
      raise(string.format("gguf: %s: tensor '%s' (%s) dequantizes to a float dtype, not %s", self.path, name, t.type, dt))
    end
    rt.call(C.gp_gguf_type_size, blkbox, bytbox, t.type_id)
    local block, bytes = blkbox[0], bytbox[0]
    local nblocks = t.nbytes / bytes
    -- f64 lives on the cpu: decode there, then cast and move
    local dev = dt == 'f64' and 'cpu' or device
    local raw = read_into(self, t, tensor.empty({nblocks, bytes}, 'u8', dev, 'gguf:read'))
    local out = tensor.empty(t.torch_shape, dt, dev, 'gguf:read')
    kernels.k[kname](out:view {nblocks, block}, raw)
    return dev == device and out or out:to(device)
  end
  if not native then
    local names = {}
    for k in pairs(M.dequant_kernels) do names[#names + 1] = k end
    table.sort(names)
    raise(string.format("gguf: %s: tensor '%s' has ggml type %s, which gp.gguf cannot decode (it reads F32, F16, BF16, "
      .. 'I32, I64, F64, %s); :raw(name) gives its bytes', self.path, name, t.type, table.concat(names, ', ')))
  end
  -- read as stored (straight into device memory when it can live there), then cast where it lands
  local dev = (native == 'f64' or dt == 'f64') and 'cpu' or device
  local x = read_into(self, t, tensor.empty(t.torch_shape, native, dev, 'gguf:read'))
  if native ~= dt then x = x:to(dt) end
  return dev == device and x or x:to(device)
end
doc(File.read, "gguf:read(name, {dtype='f32', device=gp.device()})",
  'tensor name decoded to dtype (f32, bf16, f16) in torch_shape on device; quantized types (Q4_0, Q4_1, Q5_0, Q5_1, '
    .. 'Q8_0, Q4_K, Q5_K, Q6_K) are decoded there by gp.k.dequant_*. The values are as the file holds them: '
    .. "llama.cpp's converter permutes the rows of Llama attn_q and attn_k weights for its RoPE, and this does not undo it")

function File:close()
  if getmetatable(self) ~= File then raise('gguf:close: call it as f:close()') end
  if self._g then
    C.gp_gguf_close(ffi.gc(self._g, nil))
    self._g = nil
  end
end
doc(File.close, 'gguf:close()', 'unmap the file now (else when the object is collected); tensors already read stay valid')

return M
