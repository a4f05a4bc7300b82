-- Titans chunk weights (kernels/titans.*): gp.titans_coef, differentiable.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local FLOAT = require('gpush.core.dtype').FLOAT
local raise, empty, shape_str, is_tensor = rt.raise, tensor.empty, tensor.shape_str, tensor.is_tensor
local K = tensor.K

-- eta and alpha as contiguous (N, L) tensors of one float dtype
local function prepare(eta, alpha)
  local op = 'titans_coef'
  if not is_tensor(eta) then raise(op .. ': eta must be a tensor, got ' .. type(eta)) end
  if not is_tensor(alpha) then raise(op .. ': alpha must be a tensor, got ' .. type(alpha)) end
  if eta:dim() ~= 2 or shape_str(alpha.shape) ~= shape_str(eta.shape) then
    raise(string.format('%s: eta and alpha must both be (N, L); got eta %s, alpha %s', op, shape_str(eta.shape),
      shape_str(alpha.shape)))
  end
  if eta:size(2) < 1 then raise(string.format('%s: eta is %s; a chunk has at least one token', op, shape_str(eta.shape))) end
  if alpha.device ~= eta.device then
    raise(string.format('%s: alpha is on %s but eta is on %s (move one with :to())', op, alpha.device, eta.device))
  end
  local e = (FLOAT[eta.dtype] and eta or tensor.to_dtype(eta, 'f32')):contiguous()
  return e, tensor.to_dtype(alpha, e.dtype):contiguous()
end

function gp.titans_coef(eta, alpha)
  local e, a = prepare(eta, alpha)
  local N, L = e:size(1), e:size(2)
  local w = empty({N, L}, e.dtype, e.device, 'titans_coef')
  local c = empty({N, L}, e.dtype, e.device, 'titans_coef')
  local p = empty({N, 3}, e.dtype, e.device, 'titans_coef')
  K.titans_coef(w, c, p, e, a)
  return w, c, p
end
gp.doc(gp.titans_coef, 'gp.titans_coef(eta, alpha)',
  'the weights of the Titans recurrence S_t = eta_t S_{t-1} + u_t, M_t = (1 - alpha_t) M_{t-1} + S_t over each ' ..
  'row (a chunk of L tokens) of eta, alpha (N, L): returns w, c (N, L) and p (N, 3) with S_L = p[1] S_0 + ' ..
  'sum_s w_s u_s and M_L = p[2] M_0 + p[3] S_0 + sum_s c_s u_s; differentiable')

autograd.def_function('titans_coef', function(g, a, o)
  local e, al = prepare(a[1], a[2])
  local function grad(x, like) return x and tensor.to_dtype(x, e.dtype):contiguous() or gp.zeros_like(like) end
  local dw, dc, dp = grad(g[1], o[1]), grad(g[2], o[2]), grad(g[3], o[3])
  local de = empty(e.shape, e.dtype, e.device, 'titans_coef')
  local da = empty(e.shape, e.dtype, e.device, 'titans_coef')
  K.titans_coef_backward(de, da, e, al, o[1], o[2], dw, dc, dp)
  return de, da
end)

return gp
