-- The FFI binding: the declarations come from src/gpush.h, preprocessed at
-- build time and embedded in the gpush binary (package.loaded['gpush.core.cdef']).
local ffi = require 'ffi'
local cdef = package.loaded['gpush.core.cdef']
if type(cdef) ~= 'string' then
  error('gpush: the FFI declarations are missing; run this file with the gpush binary', 2)
end
ffi.cdef(cdef)
return ffi.C
