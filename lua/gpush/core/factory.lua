-- factory: tensors from values, shapes and other tensors (gp.tensor, gp.zeros,
-- gp.arange, gp.zeros_like, ...), and joining and selecting (gp.cat,
-- gp.stack, gp.where).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local kernels = require 'gpush.core.kernels'
local doc = require('gpush.core.doc').doc
local gp = require 'gpush.core.ns'
local C, raise = rt.C, rt.raise
local is_tensor, empty, parse_shape = tensor.is_tensor, tensor.empty, tensor.parse_shape
local state = tensor.state
local K = kernels.k

-- creation

local function opts_of(o, op)
  o = o or {}
  if type(o) ~= 'table' then raise(op .. ': options must be a table like {dtype=, device=}') end
  return o.dtype and rt.dtype(o.dtype, op) or nil, o.device and tensor.device_name(o.device, op) or state.device
end

-- nested Lua tables -> shape and row-major values
local function flatten(data, op)
  if type(data) == 'number' then return {}, {data} end
  if type(data) == 'boolean' then return {}, {data and 1 or 0} end
  if type(data) ~= 'table' then raise(op .. ': expected a number or a nested table of numbers, got ' .. type(data)) end
  local shape, d = {}, data
  while type(d) == 'table' and not is_tensor(d) do
    shape[#shape + 1] = #d
    d = d[1]
    if #shape > 8 then raise(op .. ': more than 8 levels of nesting') end
  end
  local vals = {}
  local function walk(x, depth, path)
    if is_tensor(x) then
      raise(string.format('%s: %s is a tensor; gp.stack joins tensors (or t:item() for a number)', op,
        path == '' and 'the data' or 'element ' .. path))
    end
    if depth > #shape then
      if type(x) == 'boolean' then x = x and 1 or 0 end
      if type(x) ~= 'number' then raise(string.format('%s: element %s is a %s, not a number', op, path, type(x))) end
      vals[#vals + 1] = x
      return
    end
    if type(x) ~= 'table' or #x ~= shape[depth] then
      raise(string.format('%s: ragged nested table: %s has %s entries, expected %d', op, path == '' and 'the table' or path,
        type(x) == 'table' and tostring(#x) or 'no', shape[depth]))
    end
    for i = 1, #x do walk(x[i], depth + 1, path .. '[' .. i .. ']') end
  end
  walk(data, 1, '')
  return shape, vals
end

local function from_values(shape, vals, dtype, device, op)
  local t = empty(shape, dtype, device, op)
  local n = #vals
  local buf = ffi.new('double[?]', n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = vals[i] end
  rt.call(C.gp_from_doubles, t.c, buf, n)
  return t
end

function gp.tensor(data, opts)
  local dtype, device = opts_of(opts, 'tensor')
  if is_tensor(data) then return data:to {dtype = dtype, device = device}:clone() end
  local shape, vals = flatten(data, 'tensor')
  return from_values(shape, vals, dtype or 'f32', device, 'tensor')
end
doc(gp.tensor, "gp.tensor(data, {dtype='f32', device=gp.device()})", 'a tensor from a number or nested tables of numbers')

local function creator(name, fill)
  return function(...)
    local shape, o = parse_shape(name, ...)
    local dtype, device = opts_of(o, name)
    local t = empty(shape, dtype or 'f32', device, name)
    if fill then fill(t, o) end
    return t
  end
end
gp.empty = doc(creator('empty'), 'gp.empty{2,3}', 'an uninitialized tensor')
gp.zeros = doc(creator('zeros', function(t) K.fill(t, 0) end), 'gp.zeros{2,3}', 'a tensor of zeros')
gp.ones = doc(creator('ones', function(t) K.fill(t, 1) end), 'gp.ones{2,3}', 'a tensor of ones')
gp.rand = doc(creator('rand', function(t) K.rand_uniform(t, 0, 1) end), 'gp.rand{2,3}', 'uniform in [0, 1)')
gp.randn = doc(creator('randn', function(t) K.rand_normal(t, 0, 1) end), 'gp.randn{2,3}', 'standard normal')

function gp.full(shape, value, opts)
  if type(value) ~= 'number' then raise('full: the value must be a number') end
  local s = parse_shape('full', shape)
  local dtype, device = opts_of(opts, 'full')
  local t = empty(s, dtype or 'f32', device, 'full')
  K.fill(t, value)
  return t
end
doc(gp.full, 'gp.full({2,3}, 7)', 'a tensor filled with a value')

function gp.randint(lo, hi, shape, opts)
  if type(lo) ~= 'number' or type(hi) ~= 'number' then raise('randint: usage gp.randint(lo, hi, {shape}) with integers lo < hi') end
  local s = parse_shape('randint', shape)
  local dtype, device = opts_of(opts, 'randint')
  local t = empty(s, dtype or 'i64', device, 'randint')
  K.randint(t, lo, hi)
  return t
end
doc(gp.randint, 'gp.randint(lo, hi, {shape})', 'uniform integers in [lo, hi) (i64 unless a dtype is given)')

-- arange(n) = 0..n-1; arange(a, b[, step]) = a, a+step, ... < b
function gp.arange(a, b, step, opts)
  if type(b) == 'table' then opts, b = b, nil end
  if type(step) == 'table' then opts, step = step, nil end
  local start, stop = b and a or 0, b or a
  step = step or 1
  if type(start) ~= 'number' or type(stop) ~= 'number' or type(step) ~= 'number' or step == 0 then
    raise('arange: usage gp.arange(n) or gp.arange(start, stop[, step]) with step ~= 0')
  end
  local n = math.max(0, math.ceil((stop - start) / step))
  if n ~= n or n >= 2^53 then -- inf, NaN or beyond exact integers: never start building it
    raise(string.format('arange: %s values from %s to %s by %s are too many', tostring(n), tostring(start),
      tostring(stop), tostring(step)))
  end
  local dtype, device = opts_of(opts, 'arange')
  local int = start == math.floor(start) and step == math.floor(step)
  -- the tensor first (too large fails here, at once), then the values by a kernel on its device (no copy from the
  -- host, so it also runs inside a CUDA graph's capture)
  local t = empty({n}, dtype or (int and 'i64' or 'f32'), device, 'arange')
  K.arange(t, start, step)
  return t
end
doc(gp.arange, 'gp.arange(n) / gp.arange(start, stop, step)',
  'evenly spaced values in [start, stop) (i64 for integer arguments), made on their device by gp.k.arange')

local function like(name, f)
  gp[name .. '_like'] = function(t)
    if not is_tensor(t) then raise(name .. '_like: needs a tensor') end
    return f(t.shape, {dtype = t.dtype, device = t.device})
  end
end
like('zeros', function(s, o) return gp.zeros(s, o) end)
like('ones', function(s, o) return gp.ones(s, o) end)
like('empty', function(s, o) return gp.empty(s, o) end)
like('rand', function(s, o) return gp.rand(s, o) end)
like('randn', function(s, o) return gp.randn(s, o) end)
gp.full_like = function(t, v) return gp.full(t.shape, v, {dtype = t.dtype, device = t.device}) end
for _, name in ipairs {'zeros', 'ones', 'empty', 'rand', 'randn'} do
  doc(gp[name .. '_like'], 'gp.' .. name .. '_like(t)', 'gp.' .. name .. ' with the shape, dtype and device of t')
end
doc(gp.full_like, 'gp.full_like(t, v)', 'gp.full with the shape, dtype and device of t')

---------------------------------------------------------------------------
-- joining and selecting

function gp.cat(list, dim)
  if type(list) ~= 'table' or #list == 0 then raise('cat: needs a non-empty list of tensors') end
  dim = dim or 1
  local first = list[1]
  if not is_tensor(first) then raise('cat: element 1 is not a tensor') end
  local d0 = tensor.dim0(first, dim, 'cat')
  local shape, dt, total = first.shape, first.dtype, 0
  for i, t in ipairs(list) do
    if not is_tensor(t) then raise(string.format('cat: element %d is not a tensor', i)) end
    if t.device ~= first.device then
      raise(string.format('cat: element %d is on %s but element 1 is on %s', i, t.device, first.device))
    end
    local s = t.shape
    local ok = #s == #shape
    for k = 1, #s do if k ~= d0 + 1 and s[k] ~= shape[k] then ok = false end end
    if not ok then
      raise(string.format('cat: element %d is %s but element 1 is %s (dim %d may differ)', i, tensor.shape_str(s),
        tensor.shape_str(shape), d0 + 1))
    end
    dt = tensor.promote(dt, t.dtype)
    total = total + s[d0 + 1]
  end
  shape[d0 + 1] = total
  local out = empty(shape, dt, first.device, 'cat')
  local off = 1
  for _, t in ipairs(list) do
    local n = t:size(d0 + 1)
    if n > 0 then K.copy(out:narrow(d0 + 1, off, n), t) end
    off = off + n
  end
  return out
end
doc(gp.cat, 'gp.cat({a, b}, dim)', 'join tensors along an existing dim')

function gp.stack(list, dim)
  if type(list) ~= 'table' or #list == 0 then raise('stack: needs a non-empty list of tensors') end
  dim = dim or 1
  local us = {}
  for i, t in ipairs(list) do
    if not is_tensor(t) then raise(string.format('stack: element %d is not a tensor', i)) end
    if i > 1 and tensor.shape_str(t.shape) ~= tensor.shape_str(list[1].shape) then
      raise(string.format('stack: element %d is %s but element 1 is %s', i, tensor.shape_str(t.shape),
        tensor.shape_str(list[1].shape)))
    end
    us[i] = t:unsqueeze(dim)
  end
  return gp.cat(us, dim)
end
doc(gp.stack, 'gp.stack({a, b}, dim)', 'join tensors along a new dim')

function gp.where(mask, a, b)
  if not is_tensor(mask) then raise('where: mask must be a tensor') end
  local dev = mask.device
  local dt = is_tensor(a) and (is_tensor(b) and tensor.promote(a.dtype, b.dtype) or a.dtype)
    or (is_tensor(b) and b.dtype or 'f32')
  local function as_t(x, name)
    if type(x) == 'number' then return gp.full({}, x, {dtype = dt, device = dev}) end
    if not is_tensor(x) then raise('where: ' .. name .. ' must be a tensor or a number') end
    if x.device ~= dev then raise(string.format('where: %s is on %s but mask is on %s', name, x.device, dev)) end
    return x:to(dt)
  end
  if mask.dtype ~= 'u8' then
    raise(string.format('where: mask must be a bool (u8) tensor, got %s; make one with a comparison (x:gt(0)) or mask:ne(0)',
      mask.dtype))
  end
  a, b = as_t(a, 'a'), as_t(b, 'b')
  local s = tensor.broadcast_shapes('where', tensor.broadcast_shapes('where', mask.shape, a.shape), b.shape)
  local out = empty(s, dt, dev, 'where')
  K.where(out, mask, a, b)
  return out
end
doc(gp.where, 'gp.where(mask, a, b)', 'mask ? a : b elementwise (mask a bool (u8) tensor as comparisons give; a, b tensors or numbers)')


return gp
