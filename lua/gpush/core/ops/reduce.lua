-- Reductions as tensor methods: t:sum(d), t:mean(d), t:max(d), t:min(d),
-- t:argmax(d), t:argmin(d), t:var(d), t:norm(p, d), t:cumsum(d).
-- The tensor is made contiguous and viewed as (A, B, C) with B the reduced dim
-- (d nil: the whole tensor, (1, numel, 1), giving a 0-dim result); the reduce
-- kernels (kernels/reduce.*) do the rest. Integer tensors are computed in f32
-- (sum, mean, var, norm, cumsum give f32; max and min give the input dtype back).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local FLOAT = require('gpush.core.dtype').FLOAT
local raise, empty, Tensor, is_tensor = rt.raise, tensor.empty, tensor.Tensor, tensor.is_tensor
local K = tensor.K

local function check(x, op)
  if not tensor.is_tensor(x) then raise(op .. ': needs a tensor, got ' .. type(x)) end
end

-- options may come as the last argument: t:sum(d, {keepdim=true}) or t:sum{keepdim=true}
local function split_opts(d, opts)
  if type(d) == 'table' and not tensor.is_tensor(d) then return nil, d end
  return d, opts or {}
end

-- (A, B, C) and the result shape for reducing x over d
local function geometry(x, d, keepdim, op)
  local s = x.shape
  if d == nil then
    local rs = {}
    if keepdim then for i = 1, #s do rs[i] = 1 end end
    return 1, x:numel(), 1, rs
  end
  local d0 = tensor.dim0(x, d, op) + 1
  local A, C = 1, 1
  for i = 1, d0 - 1 do A = A * s[i] end
  for i = d0 + 1, #s do C = C * s[i] end
  local rs = {}
  for i = 1, #s do
    if i ~= d0 then rs[#rs + 1] = s[i] elseif keepdim then rs[#rs + 1] = 1 end
  end
  return A, s[d0], C, rs
end

local function float_of(x) return FLOAT[x.dtype] and x or tensor.to_dtype(x, 'f32') end

-- run kernel kname into a new tensor of dtype odt (nil: x's float dtype)
local function run(kname, x, d, opts, odt, ...)
  local A, B, C, rs = geometry(x, d, opts.keepdim, kname)
  if B == 0 and (kname == 'max' or kname == 'min' or kname == 'argmax' or kname == 'argmin') then
    raise(string.format('%s: cannot reduce an empty dim (shape %s)', kname, tensor.shape_str(x.shape)))
  end
  local xf = float_of(x):contiguous()
  local out = empty(rs, odt or xf.dtype, x.device, kname)
  if A * C == 0 then return out end
  if B == 0 then -- an empty sum is 0; an empty mean or variance is NaN
    return out:fill_((kname == 'mean' or kname == 'var') and 0 / 0 or 0)
  end
  K[kname](out:view {A, C}, xf:view {A, B, C}, ...)
  return out
end

local function def(name, doc)
  Tensor[name] = function(x, d, opts)
    check(x, name)
    d, opts = split_opts(d, opts)
    return run(name, x, d, opts)
  end
  gp.doc(Tensor[name], 't:' .. name .. '(d, {keepdim=false})', doc)
end
def('sum', 'sum over dim d (nil: every element, a 0-dim result); integers are summed in f32')
def('mean', 'mean over dim d (nil: every element); integers give f32')

-- max/min: with d, values and 0-based indices (i64); without, the value only
local function def_ext(name, arg)
  Tensor[name] = function(x, d, opts)
    check(x, name)
    d, opts = split_opts(d, opts)
    local v = run(name, x, d, opts)
    if not FLOAT[x.dtype] then v = tensor.to_dtype(v, x.dtype) end
    if d == nil then return v end
    return v, run(arg, x, d, opts, 'i64')
  end
  gp.doc(Tensor[name], 't:' .. name .. '(d, {keepdim=false})',
    name .. ' over dim d: values and 0-based indices (i64); d nil: the ' .. name .. ' of every element (NaN propagates)')
end
def_ext('max', 'argmax')
def_ext('min', 'argmin')

for _, name in ipairs {'argmax', 'argmin'} do
  Tensor[name] = function(x, d, opts)
    check(x, name)
    d, opts = split_opts(d, opts)
    return run(name, x, d, opts, 'i64')
  end
  gp.doc(Tensor[name], 't:' .. name .. '(d, {keepdim=false})',
    '0-based index (i64) of the ' .. name:sub(4) .. ' over dim d, the first one on ties (d nil: index into the flattened tensor)')
end

function Tensor.var(x, d, opts)
  check(x, 'var')
  d, opts = split_opts(d, opts)
  local corr = opts.correction
  if corr == nil then corr = opts.unbiased == false and 0 or 1 end
  if type(corr) ~= 'number' then raise('var: correction must be a number') end
  return run('var', x, d, opts, nil, corr)
end
gp.doc(Tensor.var, 't:var(d, {correction=1, keepdim=false})',
  'variance over dim d, sum (x - mean)^2 / (n - correction) (1: unbiased, 0: population); NaN when n <= correction')
function Tensor.std(x, d, opts) return Tensor.var(x, d, opts):sqrt() end
gp.doc(Tensor.std, 't:std(d, {correction=1, keepdim=false})', 'sqrt of t:var')

function Tensor.norm(x, p, d, opts)
  check(x, 'norm')
  if type(p) == 'table' then p, d, opts = nil, nil, p end
  d, opts = split_opts(d, opts)
  p = p or 2
  if p == 'inf' then p = math.huge end
  if type(p) ~= 'number' or p ~= p or p < 0 then raise('norm: p must be a number >= 0 (or math.huge), got ' .. tostring(p)) end
  return run('norm', x, d, opts, nil, p)
end
gp.doc(Tensor.norm, 't:norm(p=2, d, {keepdim=false})',
  'p-norm over dim d (nil: every element): (sum |x|^p)^(1/p); p = math.huge: max |x|; p = 0: count of nonzeros')

function Tensor.cumsum(x, d)
  check(x, 'cumsum')
  local xf = float_of(x):contiguous()
  local out = empty(x.shape, xf.dtype, x.device, 'cumsum')
  if x:numel() == 0 then return d == nil and out:view {0} or out end
  if d == nil then
    local n = x:numel()
    out = out:view {n}
    K.cumsum(out:view {1, n, 1}, xf:view {1, n, 1})
    return out
  end
  local A, B, C = geometry(x, d, false, 'cumsum')
  K.cumsum(out:view {A, B, C}, xf:view {A, B, C})
  return out
end
gp.doc(Tensor.cumsum, 't:cumsum(d)', 'running sum along dim d (nil: over the flattened tensor, 1-d result); integers give f32')

---------------------------------------------------------------------------
-- reductions: x:op(d, {keepdim=}) or x:op{keepdim=}

local function red_args(a) return split_opts(a[2], a[3]) end

-- a reduced gradient g back to a (broadcast) view of x's shape
local function unreduce(g, x, d, keepdim)
  local s = x.shape
  if d == nil then
    local ones = {}
    for i = 1, #s do ones[i] = 1 end
    return g:reshape(ones):expand(s)
  end
  if not keepdim then g = g:unsqueeze(d) end
  return g:expand(s)
end
local function count(x, d) return d == nil and x:numel() or x:size(d) end

autograd.def_method('sum', function(g, a)
  local d, o = red_args(a)
  return unreduce(g[1], a[1], d, o.keepdim)
end)
autograd.def_method('mean', function(g, a)
  local d, o = red_args(a)
  return unreduce(g[1] / count(a[1], d), a[1], d, o.keepdim)
end)

-- max/min: the gradient goes to the (first) arg-extremum
local function extremum(arg)
  return function(g, a, o)
    local x = a[1]
    local d, opts = red_args(a)
    local z = gp.zeros_like(x)
    if d == nil then
      local idx = x[arg](x)
      return z:view {x:numel()}:scatter_add(1, idx:reshape {1}, g[1]:reshape {1}):view(x.shape)
    end
    local idx, gv = o[2], g[1]
    if not opts.keepdim then idx, gv = idx:unsqueeze(d), gv:unsqueeze(d) end
    return z:scatter_add(d, idx, gv)
  end
end
autograd.def_method('max', extremum('argmax'))
autograd.def_method('min', extremum('argmin'))

autograd.def_method('var', function(g, a)
  local x = a[1]
  local d, o = red_args(a)
  local corr = o.correction
  if corr == nil then corr = o.unbiased == false and 0 or 1 end
  local mu = d == nil and x:mean() or x:mean(d, {keepdim = true})
  return unreduce(g[1], x, d, o.keepdim) * (x - mu) * (2 / (count(x, d) - corr))
end)
-- t:std is t:var(...):sqrt(), differentiated through both

autograd.def_method('norm', function(g, a, out)
  local x, p, d, o = a[1], a[2], a[3], a[4]
  if type(p) == 'table' then p, d, o = nil, nil, p end
  if type(d) == 'table' and not is_tensor(d) then d, o = nil, d end
  o = o or {}
  p = p or 2
  if p == 'inf' then p = math.huge end
  if p == 0 then return gp.zeros_like(x) end
  local gb = unreduce(g[1], x, d, o.keepdim)
  local nb = unreduce(out[1], x, d, o.keepdim)
  local sign = gp.where(x:ge(0), 1, -1)
  local dx
  if p == math.huge then -- shared evenly between the elements at the max
    local m = x:abs():eq(nb):to(x.dtype)
    local cnt = d == nil and m:sum() or m:sum(d, {keepdim = true})
    dx = gb * sign * m / cnt
  elseif p == 1 then
    dx = gb * sign
  else
    dx = gb * sign * x:abs() ^ (p - 1) / nb ^ (p - 1)
  end
  return gp.where(nb:eq(0), 0, dx)
end)

-- cumsum's adjoint: the reversed running sum (flip, cumsum, flip)
autograd.def_method('cumsum', function(g, a)
  local x, d = a[1], a[2]
  local gg, dd = g[1], d or 1
  local n = gg:size(dd)
  if n == 0 then return gp.zeros_like(x) end
  local rev = gp.arange(n - 1, -1, -1, {device = gg.device})
  local r = gg:index_select(dd, rev):cumsum(dd):index_select(dd, rev)
  return r:reshape(x.shape)
end)

return gp
