-- Per-row ops: t:softmax(d), t:log_softmax(d), gp.layer_norm, gp.rms_norm
-- (kernels/rows.*). The kernels work on the contiguous last dim; another dim
-- is moved last (transpose + contiguous) and the result moved back.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local common = require 'gpush.core.ops.common'
local floatc, like, param, norm_w, norm_outs = common.floatc, common.like, common.norm_param, common.norm_w, common.norm_outs
local raise, empty, Tensor = rt.raise, tensor.empty, tensor.Tensor
local K = tensor.K

local function need(x, op, name)
  if not tensor.is_tensor(x) then raise(string.format('%s: %s must be a tensor, got %s', op, name, type(x))) end
  if x:dim() == 0 then raise(string.format('%s: %s is 0-dim; at least one dim is needed', op, name)) end
end

local function def(name)
  Tensor[name] = function(x, d)
    need(x, name, 'x')
    local n = x:dim()
    local d0 = tensor.dim0(x, d or -1, name) + 1
    local src = d0 == n and x or x:transpose(d0, n)
    src = floatc(src)
    local out = empty(src.shape, src.dtype, src.device, name)
    K[name](out, src)
    if d0 ~= n then out = out:transpose(d0, n) end
    return out
  end
  gp[name] = function(x, d) return Tensor[name](x, d) end
  gp.doc(Tensor[name], 't:' .. name .. '(d=-1)', name .. ' over dim d (f32 math; the last dim is the fast one)')
  gp.doc(gp[name], 'gp.' .. name .. '(x, d=-1)', 'the same as x:' .. name .. '(d)')
end
def('softmax')
def('log_softmax')


local function lead(x) local s = x.shape; s[#s] = nil; return s end

function gp.layer_norm(x, w, b, eps)
  need(x, 'layer_norm', 'x')
  x = floatc(x)
  local D = x:size(-1)
  w = w and param(w, x, 'layer_norm', 'w', D) or gp.ones({D}, {dtype = x.dtype, device = x.device})
  b = b and param(b, x, 'layer_norm', 'b', D) or gp.zeros({D}, {dtype = x.dtype, device = x.device})
  local out = empty(x.shape, x.dtype, x.device, 'layer_norm')
  local mean = empty(lead(x), 'f32', x.device, 'layer_norm')
  local rstd = empty(lead(x), 'f32', x.device, 'layer_norm')
  K.layer_norm(out, mean, rstd, x, w, b, eps or 1e-5)
  return out, mean, rstd
end
gp.doc(gp.layer_norm, 'gp.layer_norm(x, w, b, eps=1e-5)',
  'LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * w + b (w, b may be nil); also returns the saved mean and rstd (f32)')

function gp.rms_norm(x, w, eps)
  need(x, 'rms_norm', 'x')
  x = floatc(x)
  local D = x:size(-1)
  w = w and param(w, x, 'rms_norm', 'w', D) or gp.ones({D}, {dtype = x.dtype, device = x.device})
  local out = empty(x.shape, x.dtype, x.device, 'rms_norm')
  local rstd = empty(lead(x), 'f32', x.device, 'rms_norm')
  K.rms_norm(out, rstd, x, w, eps or 1e-5)
  return out, rstd
end
gp.doc(gp.rms_norm, 'gp.rms_norm(x, w, eps=1e-5)',
  'RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * w (w may be nil); also returns the saved rstd (f32)')

---------------------------------------------------------------------------
-- softmax and log_softmax through their backward kernels

local function rows_backward(kname)
  return function(g, a, o)
    local x, y, dy = a[1], o[1], g[1]
    local n = x:dim()
    local d0 = tensor.dim0(x, a[2] or -1, kname) + 1
    if d0 ~= n then y, dy = y:transpose(d0, n), dy:transpose(d0, n) end
    y = y:contiguous()
    dy = like(dy, y)
    local dx = empty(y.shape, y.dtype, y.device, kname)
    K[kname](dx, y, dy)
    if d0 ~= n then dx = dx:transpose(d0, n) end
    return dx
  end
end
autograd.def_method('softmax', rows_backward('softmax_backward'))
autograd.def_method('log_softmax', rows_backward('log_softmax_backward'))

---------------------------------------------------------------------------
-- norms: the forward returns out and its saved statistics; only out is
-- differentiable (the statistics come back detached) and the rule reads the
-- statistics from the node

autograd.def_function('layer_norm', function(g, a, o)
  local x, w, b = floatc(a[1]), a[2], a[3]
  local D = x:size(-1)
  local dx = empty(x.shape, x.dtype, x.device, 'layer_norm')
  local dw, db, acc, rw, rb = norm_outs(x, D, 'layer_norm', w, b, true)
  K.layer_norm_backward(dx, dw, db, x, norm_w(w, x, D), o[2], o[3], like(g[1], x), acc)
  return dx, rw, rb
end, {nout = 1})

autograd.def_function('rms_norm', function(g, a, o)
  local x, w = floatc(a[1]), a[2]
  local D = x:size(-1)
  local dx = empty(x.shape, x.dtype, x.device, 'rms_norm')
  local dw, _, acc, rw = norm_outs(x, D, 'rms_norm', w)
  K.rms_norm_backward(dx, dw, x, norm_w(w, x, D), o[2], like(g[1], x), acc)
  return dx, rw
end, {nout = 1})

-- add_rms_norm: h = x + res (returned as res_out), out = rms_norm(h) * w

return gp
