-- The causal depthwise convolution over time (kernels/conv.*): gp.causal_conv1d, differentiable.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local FLOAT = require('gpush.core.dtype').FLOAT
local raise, empty, shape_str, is_tensor = rt.raise, tensor.empty, tensor.shape_str, tensor.is_tensor
local K = tensor.K

-- x (B, T, C) and w (K, C) contiguous, w in x's float dtype
local function prepare(x, w)
  local op = 'causal_conv1d'
  if not is_tensor(x) or not is_tensor(w) then
    raise(string.format('%s: x and w must be tensors, got %s and %s', op, type(x), type(w)))
  end
  if x:dim() ~= 3 or w:dim() ~= 2 or w:size(2) ~= x:size(3) then
    raise(string.format('%s: x must be (B, T, C) and w (K, C) with the same C; got x %s, w %s', op, shape_str(x.shape),
      shape_str(w.shape)))
  end
  if w.device ~= x.device then raise(string.format('%s: w is on %s but x is on %s (move one with :to())', op, w.device, x.device)) end
  if not FLOAT[x.dtype] then raise(string.format('%s: x must be a float tensor, got %s', op, x.dtype)) end
  return x:contiguous(), tensor.to_dtype(w, x.dtype):contiguous()
end

function gp.causal_conv1d(x, w)
  local xc, wc = prepare(x, w)
  local y = empty(xc.shape, xc.dtype, xc.device, 'causal_conv1d')
  K.causal_conv1d(y, xc, wc)
  return y
end
gp.doc(gp.causal_conv1d, 'gp.causal_conv1d(x, w)',
  'causal depthwise convolution over time: x (B, T, C), w (K, C) -> y (B, T, C), y[b,t,c] = sum_j w[j,c] ' ..
  'x[b,t-K+1+j,c] (tokens before the first are 0; w[K] weighs the token itself); one kernel, differentiable')

autograd.def_function('causal_conv1d', function(g, a)
  local x, w = prepare(a[1], a[2])
  local dy = tensor.to_dtype(g[1], x.dtype):contiguous()
  local dx = empty(x.shape, x.dtype, x.device, 'causal_conv1d')
  local dw = empty(w.shape, w.dtype, w.device, 'causal_conv1d')
  K.causal_conv1d_backward(dx, dw, x, w, dy)
  if a[2].dtype ~= dw.dtype then dw = tensor.to_dtype(dw, a[2].dtype) end
  return dx, dw
end)

return gp
