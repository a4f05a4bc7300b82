-- dtype: the dtypes and devices, as the C ABI defines them. Every list here is
-- built from the C table (src/gpush.h's X-macro through gp_dtype_get), so a
-- dtype's name, size and kind are written once.
local C = require 'gpush.core.ffi'
local ffi = require 'ffi'

local M = {
  DT = {},        -- name -> enum value
  DTNAME = {},    -- enum value -> name
  ELSIZE = {},    -- enum value -> bytes
  FLOAT = {},     -- name -> true for the float dtypes
  ALIAS = {},     -- any accepted spelling -> name
  names = {},     -- names in enum order
  DEV = {cpu = C.GP_CPU, cuda = C.GP_CUDA},
  DEVNAME = {[C.GP_CPU] = 'cpu', [C.GP_CUDA] = 'cuda'},
}

-- TEMP until the C table lands
local TMP = {{'f32',4,1,'float float32'},{'bf16',2,1,'bfloat16'},{'f16',2,1,'half float16'},{'i32',4,0,'int int32'},{'i64',8,0,'long int64'},{'u8',1,0,'bool uint8 byte'},{'f64',8,1,'double float64'}}
local have = pcall(function() return C.gp_dtype_count end)
for i = 0, (have and C.gp_dtype_count() or #TMP) - 1 do
  local d = have and C.gp_dtype_get(i) or {name = TMP[i+1][1], size = TMP[i+1][2], is_float = TMP[i+1][3], aliases = TMP[i+1][4]}
  if not have then d.name = ffi.new('char[?]', #d.name + 1, d.name); d.aliases = ffi.new('char[?]', #d.aliases + 1, d.aliases) end
  local name = ffi.string(d.name)
  M.DT[name], M.DTNAME[i], M.ELSIZE[i] = i, name, d.size
  M.names[#M.names + 1] = name
  if d.is_float ~= 0 then M.FLOAT[name] = true end
  M.ALIAS[name] = name
  for a in ffi.string(d.aliases):gmatch('%S+') do M.ALIAS[a] = name end
end

-- type promotion: a float wins over an integer; two floats of different kinds
-- give f32 (f64 when either is f64); two integers give the wider
function M.promote(a, b)
  if a == b then return a end
  local fa, fb = M.FLOAT[a], M.FLOAT[b]
  if fa and fb then return (a == 'f64' or b == 'f64') and 'f64' or 'f32' end
  if fa then return a end
  if fb then return b end
  return M.ELSIZE[M.DT[a]] >= M.ELSIZE[M.DT[b]] and a or b
end

function M.is_float(name) return M.FLOAT[name] == true end

return M
