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

for i = 0, C.gp_dtype_count() - 1 do
  local d = C.gp_dtype_get(i)
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
