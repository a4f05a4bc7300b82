-- gp.k: one Lua function per registry entry (kernels/*.def), generated from
-- the entry's argument spec: tensors are checked to be gp tensors, scalars to
-- be numbers (or take their default), then the C entry gp_k_NAME is called
-- and a failed status becomes an error naming the kernel.
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local docs = require('gpush.core.doc').docs
local C = rt.C

-- k: gp.k, one function per kernel by name (the tensor methods use tensor.K)
local M = {list = {}, by_name = {}, by_fn = {}, k = {}}

-- parse "&out:F[*,D]! x:F[~] eps:f=1e-5" into {name, out, scalar, type, dims, default}
local function parse_spec(spec)
  local args = {}
  for tok in spec:gmatch('%S+') do
    local out, name, ty, rest = tok:match('^([&^]?)([%w_]+):(%a[%w]*)(.*)$')
    if not name then error('bad spec token ' .. tok) end
    local a = {name = name, out = out ~= '', inout = out == '^', type = ty, raw = tok}
    a.scalar = ty == 'f' or ty == 'i'
    a.dims = rest:match('^%[([^%]]*)%]')
    a.contiguous = rest:find('!', 1, true) ~= nil
    a.rows = rest:find('/', 1, true) ~= nil -- stride 1 on the last dim only
    local def = rest:match('=(.+)$')
    if def then a.default = tonumber(def) end
    a.lt = rest:match('<(%u)')
    a.positive = rest:match('%+') ~= nil
    args[#args + 1] = a
  end
  return args
end
M.parse_spec = parse_spec

local function bad(kname, aname, v, want)
  rt.raise(string.format('%s: argument %s must be %s, got %s', kname, aname, want, v == nil and 'nil' or type(v)))
end

local function make(name, args, f)
  local params, checks, cargs = {}, {}, {}
  for i, a in ipairs(args) do
    local p = 'a' .. i
    params[i] = p
    if a.scalar then
      if a.default then checks[#checks + 1] = string.format('if %s == nil then %s = %s end', p, p, a.default) end
      checks[#checks + 1] = string.format("if type(%s) ~= 'number' then bad(%q, %q, %s, 'a number') end", p, name, a.name, p)
      cargs[i] = p
    else
      checks[#checks + 1] = string.format("if getmetatable(%s) ~= mt then bad(%q, %q, %s, 'a tensor') end", p, name, a.name, p)
      cargs[i] = p .. '.c'
    end
  end
  local src = string.format([[
local f, fail, mt, bad = ...
return function(%s)
  %s
  local rc = f(%s)
  if rc ~= 0 then fail(rc, f, %s) end
  return %s
end]], table.concat(params, ', '), table.concat(checks, '\n  '), table.concat(cargs, ', '),
    table.concat(cargs, ', '), params[1] or 'nil')
  return assert(loadstring(src, '=gp.k.' .. name))(f, rt.fail, tensor.mt, bad)
end

for i = 0, C.gp_kernel_count() - 1 do
  local info = C.gp_kernel_get(i)
  local k = {
    name = ffi.string(info.name), family = ffi.string(info.family), signature = ffi.string(info.signature),
    spec = ffi.string(info.spec), doc = ffi.string(info.doc),
  }
  k.args = parse_spec(k.spec)
  k.fn = make(k.name, k.args, C['gp_k_' .. k.name])
  M.list[#M.list + 1] = k
  M.by_name[k.name] = k
  M.by_fn[k.fn] = k
end

-- "gp.k.add(out:T, a:T[~], b:T[~])"
function M.usage(k)
  local parts = {}
  for _, a in ipairs(k.args) do
    parts[#parts + 1] = a.raw:gsub('^[&^]', ''):gsub('<%u', ''):gsub('%+$', '')
  end
  return string.format('gp.k.%s(%s)', k.name, table.concat(parts, ', '))
end

for _, k in ipairs(M.list) do
  M.k[k.name] = k.fn
  tensor.K[k.name] = k.fn
  docs[k.fn] = {usage = M.usage(k), doc = k.doc, kernel = k}
end
-- gp.k.rms_nrom: an error that suggests gp.k.rms_norm
require('gpush.core.suggest').strict(M.k, 'gp.k')

return M
