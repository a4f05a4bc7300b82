-- Fused ops (kernels/fused.*): gp.swiglu, gp.add_rms_norm, gp.add_layer_norm, gp.bias_gelu.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local FLOAT = require('gpush.core.dtype').FLOAT
local common = require 'gpush.core.ops.common'
local floatc, like_dt, norm_w, norm_outs = common.floatc, common.like, common.norm_w, common.norm_outs
local raise, empty, shape_str = rt.raise, tensor.empty, tensor.shape_str
local K = tensor.K

local function need(x, op, name)
  if not tensor.is_tensor(x) then raise(string.format('%s: %s must be a tensor, got %s', op, name, type(x))) end
end
-- b like a: same shape and device (its dtype becomes a's)
local function like(op, a, an, b, bn)
  need(b, op, bn)
  if b.device ~= a.device then
    raise(string.format('%s: %s is on %s but %s is on %s (move one with :to())', op, bn, b.device, an, a.device))
  end
  if shape_str(b.shape) ~= shape_str(a.shape) then
    raise(string.format('%s: %s is %s but %s is %s', op, bn, shape_str(b.shape), an, shape_str(a.shape)))
  end
  return tensor.to_dtype(b, a.dtype)
end

function gp.swiglu(gate, up)
  need(gate, 'swiglu', 'gate')
  gate = FLOAT[gate.dtype] and gate or tensor.to_dtype(gate, 'f32')
  up = like('swiglu', gate, 'gate', up, 'up')
  local out = empty(gate.shape, gate.dtype, gate.device, 'swiglu')
  K.swiglu(out, gate, up)
  return out
end
gp.doc(gp.swiglu, 'gp.swiglu(gate, up)', 'silu(gate) * up in one pass (16-byte vectors)')

-- silu(gate) * up times w^T in one kernel, for few rows (decode): gu (..., 2I)
-- = [gate | up] (a fused gate/up product's output), w (N, I); not differentiable
function gp.swiglu_linear(gu, w)
  need(gu, 'swiglu_linear', 'gu')
  need(w, 'swiglu_linear', 'w')
  gu = floatc(gu)
  if gu:dim() < 1 or w:dim() ~= 2 or gu:size(-1) ~= 2 * w:size(2) then
    raise(string.format('swiglu_linear: gu is %s and w %s; gu (..., 2I) = [gate | up] and w (N, I)', shape_str(gu.shape),
      shape_str(w.shape)))
  end
  if w.device ~= gu.device then
    raise(string.format('swiglu_linear: w is on %s but gu is on %s (move one with :to())', w.device, gu.device))
  end
  local s = gu.shape
  local M = gu:numel() / gu:size(-1)
  s[#s] = w:size(1)
  local out = empty(s, gu.dtype, gu.device, 'swiglu_linear')
  K.swiglu_linear(out:view {M, w:size(1)}, gu:view {M, gu:size(-1)}, tensor.to_dtype(w, gu.dtype):contiguous())
  return out
end
gp.doc(gp.swiglu_linear, 'gp.swiglu_linear(gu, w)',
  '(silu(gate) * up) @ w^T in one kernel for few rows (decode: up to 16 rows of bf16 / f16 with I a multiple of 32; else at most 4 rows, and rows x I x the element size at most 48 KB): gu (..., 2I) = [gate | up], w (N, I); silu(gate) * up rounded to the dtype as gp.swiglu writes it; not differentiable')

-- the checked operands of a residual add + norm and its outputs: x, res, w (ones when nil), out, res_out and
-- the rows' shape (x's without the last dim) for the saved statistics
local function add_norm_args(op, x, res, w)
  need(x, op, 'x')
  if x:dim() == 0 then raise(op .. ': x is 0-dim; at least one dim is needed') end
  x = floatc(x)
  res = like(op, x, 'x', res, 'res'):contiguous()
  local D = x:size(-1)
  w = w and common.norm_param(w, x, op, 'w', D) or gp.ones({D}, {dtype = x.dtype, device = x.device})
  local s = x.shape
  s[#s] = nil
  return x, res, w, empty(x.shape, x.dtype, x.device, op), empty(x.shape, x.dtype, x.device, op), s
end

function gp.add_rms_norm(x, res, w, eps)
  local out, res_out, s
  x, res, w, out, res_out, s = add_norm_args('add_rms_norm', x, res, w)
  local rstd = empty(s, 'f32', x.device, 'add_rms_norm')
  K.add_rms_norm(out, res_out, rstd, x, res, w, eps or 1e-5)
  return out, res_out, rstd
end
gp.doc(gp.add_rms_norm, 'gp.add_rms_norm(x, res, w, eps=1e-5)',
  'res_out = x + res; out = rms_norm(res_out, w, eps), one pass; returns out, res_out, rstd')

function gp.add_layer_norm(x, res, w, b, eps)
  local out, res_out, s
  x, res, w, out, res_out, s = add_norm_args('add_layer_norm', x, res, w)
  local D = x:size(-1)
  b = b and common.norm_param(b, x, 'add_layer_norm', 'b', D) or gp.zeros({D}, {dtype = x.dtype, device = x.device})
  local mean, rstd = empty(s, 'f32', x.device, 'add_layer_norm'), empty(s, 'f32', x.device, 'add_layer_norm')
  K.add_layer_norm(out, res_out, mean, rstd, x, res, w, b, eps or 1e-5)
  return out, res_out, mean, rstd
end
gp.doc(gp.add_layer_norm, 'gp.add_layer_norm(x, res, w, b, eps=1e-5)',
  'res_out = x + res; out = layer_norm(res_out, w, b, eps), one pass; returns out, res_out, mean, rstd')

function gp.bias_gelu(x, b)
  need(x, 'bias_gelu', 'x')
  if x:dim() == 0 then raise('bias_gelu: x is 0-dim; at least one dim is needed') end
  x = floatc(x)
  local D = x:size(-1)
  local bb = common.norm_param(b, x, 'bias_gelu', 'b', D)
  local out = empty(x.shape, x.dtype, x.device, 'bias_gelu')
  K.bias_gelu(out, x, bb)
  return out
end
gp.doc(gp.bias_gelu, 'gp.bias_gelu(x, b)', 'gelu(x + b) (erf form), b of size x:size(-1) broadcast over rows')

-- add_rms_norm: h = x + res (returned as res_out), out = rms_norm(h) * w; h's
-- gradient is the norm's plus the one h got downstream (the residual stream),
-- added by the norm's backward kernel as it writes dx (no add kernel)
autograd.def_function('add_rms_norm', function(g, a, o)
  local w = a[3]
  local h = o[2]
  local dh, rw = g[2], nil
  if g[1] then
    local D = h:size(-1)
    local dx = empty(h.shape, h.dtype, h.device, 'add_rms_norm')
    local dw, _, acc
    dw, _, acc, rw = norm_outs(h, D, 'add_rms_norm', w)
    if dh then
      K.rms_norm_backward_add(dx, dw, h, norm_w(w, h, D), o[3], like_dt(g[1], h), like_dt(dh, h), acc)
    else
      K.rms_norm_backward(dx, dw, h, norm_w(w, h, D), o[3], like_dt(g[1], h), acc)
    end
    dh = dx
  end
  return dh, dh, rw
end, {nout = 2})

-- add_layer_norm: the same with LayerNorm (h's gradient: the norm's backward
-- from the saved mean and rstd, plus the residual stream's, added by the
-- kernel as it writes dx)
autograd.def_function('add_layer_norm', function(g, a, o)
  local w, b = a[3], a[4]
  local h = o[2]
  local dh, rw, rb = g[2], nil, nil
  if g[1] then
    local D = h:size(-1)
    local dx = empty(h.shape, h.dtype, h.device, 'add_layer_norm')
    local dw, db, acc
    dw, db, acc, rw, rb = norm_outs(h, D, 'add_layer_norm', w, b, true)
    if dh then
      K.layer_norm_backward_add(dx, dw, db, h, norm_w(w, h, D), o[3], o[4], like_dt(g[1], h), like_dt(dh, h), acc)
    else
      K.layer_norm_backward(dx, dw, db, h, norm_w(w, h, D), o[3], o[4], like_dt(g[1], h), acc)
    end
    dh = dx
  end
  return dh, dh, rw, rb
end, {nout = 2})

-- t in dtype dt for a kernel that reads rows at any strides (spec '/'): copied only when its last dim is strided
local function rows_dt(t, dt)
  t = tensor.to_dtype(t, dt)
  if t:dim() > 0 and t:size(-1) > 1 and t:stride(-1) ~= 1 then return t:contiguous() end
  return t
end

-- the kernel reads gate and up where they lie (a Llama's are column blocks of
-- its gate/up product); when they are adjacent blocks of one tensor, dgate and
-- dup are written as the same blocks of one gradient, which the product's
-- backward then takes as one tensor (gp.lora_linear_group: one dx product)
autograd.def_function('swiglu', function(g, a)
  local dt = FLOAT[a[1].dtype] and a[1].dtype or 'f32'
  local gate, up, dout = rows_dt(a[1], dt), rows_dt(a[2], dt), rows_dt(g[1], dt)
  local n = gate:dim()
  local whole = n > 0 and tensor.span({gate, up}, n)
  local dgate, dup
  if whole then
    local d, h = empty(whole.shape, dt, gate.device, 'swiglu'), gate:size(n)
    dgate, dup = d:narrow(n, 1, h), d:narrow(n, h + 1, h)
  else
    dgate = empty(gate.shape, dt, gate.device, 'swiglu')
    dup = empty(gate.shape, dt, gate.device, 'swiglu')
  end
  K.swiglu_backward(dgate, dup, gate, up, dout)
  return dgate, dup
end)

-- bias_gelu: out = gelu(x + b); db sums the pre-activation gradient over rows
autograd.def_function('bias_gelu', function(g, a)
  local x = floatc(a[1])
  local D = x:size(-1)
  local pre = x + like_dt(a[2], x)
  local dpre = empty(x.shape, x.dtype, x.device, 'bias_gelu')
  K.gelu_bwd(dpre, pre, like_dt(g[1], x))
  return dpre, dpre:view {x:numel() / math.max(D, 1), D}:sum(1)
end)

return gp
