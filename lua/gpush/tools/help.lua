-- help(x): the usage line and doc of a gpush function, kernel or tensor method
-- (x itself, or its name: help('zeros'), help('rms_norm')), from the records
-- that gp.doc keeps (gpush.core.doc).
local gp = require 'gpush.core'
local docs = require('gpush.core.doc').docs
local Tensor = gp.Tensor

local M = {}

-- the documented gp.NAME function, by its usage line
local function by_name(name)
  local pat = '^gp%.' .. name:gsub('%.', '%%.') .. '[^%w_]'
  for f, d in pairs(docs) do
    if (d.usage .. ' '):find(pat) then return f end
  end
end

function M.help(x)
  if x == nil then
    return print('gpush ' .. gp.version() .. [[

  help(f)            the doc of a gpush function, e.g. help(gp.k.add) or help(gp.zeros)
  print(gp.kernels()) every kernel: gp.k.NAME(outputs..., inputs..., scalars...)
  gp.tensor, gp.zeros, gp.ones, gp.full, gp.rand, gp.randn, gp.randint, gp.arange: creation
  t:to('cuda'), t:view{...}, t:transpose(1,2), a + b, a:exp(), ...: see README.md and docs/]])
  end
  if type(x) == 'string' then x = by_name(x) or rawget(gp.k, x) or Tensor[x] end
  local d = docs[x]
  if not d then
    for name, f in pairs(Tensor) do if f == x then d = docs[f] or {usage = 't:' .. name .. '(...)', doc = 'a tensor method (docs/tensors.md)'} end end
  end
  if not d then return print('no gpush doc for ' .. tostring(x)) end
  local s = d.usage .. '\n  ' .. d.doc
  if d.kernel then s = s .. '\n  C: int gp_k_' .. d.kernel.name .. d.kernel.signature end
  print(s)
end
gp.doc(M.help, 'help(x) / gp.help(x)', "print the usage and doc of a gpush function, kernel or tensor method (x may be a name: help('zeros'))")

return M
