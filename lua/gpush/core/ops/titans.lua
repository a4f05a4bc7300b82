-- Titans kernels (kernels/titans.*): gp.titans_coef, gp.titans_scan, gp.titans_gates, gp.titans_prep, differentiable.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local FLOAT = require('gpush.core.dtype').FLOAT
local raise, empty, shape_str, is_tensor = rt.raise, tensor.empty, tensor.shape_str, tensor.is_tensor
local K = tensor.K

-- an output's gradient in dtype dt, contiguous (zeros when none reached it)
local function grad_in(g, like, dt) return g and tensor.to_dtype(g, dt):contiguous() or gp.zeros_like(like) end

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
  local dw, dc, dp = grad_in(g[1], o[1], e.dtype), grad_in(g[2], o[2], e.dtype), grad_in(g[3], o[3], e.dtype)
  local de = empty(e.shape, e.dtype, e.device, 'titans_coef')
  local da = empty(e.shape, e.dtype, e.device, 'titans_coef')
  K.titans_coef_backward(de, da, e, al, o[1], o[2], dw, dc, dp)
  return de, da
end)

-- the linear memory over whole sequences (kernels titans_scan and its backward)
local SCAN_ARGS = {'k', 'v', 'q', 'theta', 'w', 'c', 'p', 'M0', 'S0'}
local function scan_prepare(...)
  local a = {...}
  for i, name in ipairs(SCAN_ARGS) do
    if not is_tensor(a[i]) then raise(string.format('titans_scan: %s must be a tensor, got %s', name, type(a[i]))) end
    if a[i].device ~= a[1].device then
      raise(string.format('titans_scan: %s is on %s but k is on %s (move one with :to())', name, a[i].device, a[1].device))
    end
  end
  local dt = FLOAT[a[1].dtype] and a[1].dtype or 'f32'
  for i = 1, #SCAN_ARGS do a[i] = tensor.to_dtype(a[i], dt):contiguous() end
  return a
end

function gp.titans_scan(k, v, q, theta, w, c, p, M0, S0)
  local a = scan_prepare(k, v, q, theta, w, c, p, M0, S0)
  local k_, M0_ = a[1], a[8]
  if k_:dim() ~= 3 or p:dim() ~= 3 then
    raise(string.format('titans_scan: k must be (N, T, D) and p (N, C, 3); got k %s, p %s', shape_str(k.shape), shape_str(p.shape)))
  end
  local N, D, C = k_:size(1), k_:size(3), a[7]:size(2)
  local y = empty(k_.shape, k_.dtype, k_.device, 'titans_scan')
  local st = empty({N, C, 2, D, D}, k_.dtype, k_.device, 'titans_scan')
  local M = empty(M0_.shape, k_.dtype, k_.device, 'titans_scan')
  local S = empty(M0_.shape, k_.dtype, k_.device, 'titans_scan')
  K.titans_scan(y, st, M, S, unpack(a, 1, 9))
  return y, M, S, st
end
gp.doc(gp.titans_scan, 'gp.titans_scan(k, v, q, theta, w, c, p, M0, S0)',
  'the Titans linear memory over C chunks of T / C tokens in one kernel: k, v, q (N, T, D), theta, w, c (N, T) ' ..
  '(w, c: titans_coef of each chunk laid out per token), p (N, C, 3), the starting state M0, S0 (N, D, D). ' ..
  'Returns y (N, T, D) (y_t = M q_t, M the state at the start of t\'s chunk), the final M, S and the chunk ' ..
  'starts (N, C, 2, D, D); differentiable in all nine. gp.titans.memory_scan uses it for the linear memory')

autograd.def_function('titans_scan', function(g, a, o)
  local x = scan_prepare(unpack(a, 1, 9))
  local dt = x[1].dtype
  local dy, dM, dS = grad_in(g[1], o[1], dt), grad_in(g[2], o[2], dt), grad_in(g[3], o[3], dt)
  local out = {}
  for i = 1, 9 do out[i] = empty(x[i].shape, x[i].dtype, x[i].device, 'titans_scan') end
  K.titans_scan_backward(out[1], out[2], out[3], out[4], out[5], out[6], out[7], out[8], out[9],
    x[1], x[2], x[3], x[4], x[5], x[6], x[7], o[4], dy, dM, dS)
  for i = 1, 9 do
    if a[i].dtype ~= out[i].dtype then out[i] = tensor.to_dtype(out[i], a[i].dtype) end
  end
  return unpack(out, 1, 9)
end, {nout = 3})

-- the memory's gates and inputs (kernels titans_gates, titans_prep and their backwards)
local function float_input(op, name, x, dims)
  if not is_tensor(x) then raise(string.format('%s: %s must be a tensor, got %s', op, name, type(x))) end
  if x:dim() ~= dims then raise(string.format('%s: %s must have %d dims, got %s', op, name, dims, shape_str(x.shape))) end
  return (FLOAT[x.dtype] and x or tensor.to_dtype(x, 'f32')):contiguous()
end

function gp.titans_gates(g, b)
  local x = float_input('titans_gates', 'g (B, T, 3, H)', g, 4)
  local B, Tn, H = x:size(1), x:size(2), x:size(4)
  local outs = {}
  for i = 1, 3 do outs[i] = empty({B, H, Tn}, x.dtype, x.device, 'titans_gates') end
  K.titans_gates(outs[1], outs[2], outs[3], x, b)
  return outs[1], outs[2], outs[3]
end
gp.doc(gp.titans_gates, 'gp.titans_gates(g, b)',
  'the Titans memory gates from the gate projection g (B, T, 3, H) (logits of theta, eta, alpha per token and head) ' ..
  'over chunks of b tokens: theta = sigmoid(g[.,.,1]) / b per token, eta = sigmoid(m1) and alpha = 1 - sigmoid(-m2)^(1/b) ' ..
  '(m: the chunk means of g[.,.,2] and g[.,.,3]) per chunk; returns theta, eta, alpha (B, H, T); differentiable')
autograd.def_function('titans_gates', function(gr, a, o)
  local x = float_input('titans_gates', 'g', a[1], 4)
  local dg = empty(x.shape, x.dtype, x.device, 'titans_gates')
  K.titans_gates_backward(dg, x, grad_in(gr[1], o[1], x.dtype), grad_in(gr[2], o[2], x.dtype), grad_in(gr[3], o[3], x.dtype),
    a[2])
  return tensor.to_dtype(dg, a[1].dtype)
end)

function gp.titans_prep(y, norm, eps)
  local x = float_input('titans_prep', 'y (B, T, H, D)', y, 4)
  local out = empty({x:size(1), x:size(3), x:size(2), x:size(4)}, x.dtype, x.device, 'titans_prep')
  K.titans_prep(out, x, norm and 1 or 0, eps or 1e-6)
  return out
end
gp.doc(gp.titans_prep, 'gp.titans_prep(y, norm, eps=1e-6)',
  'a Titans memory input from its projection y (B, T, H, D): silu(y), with norm divided by sqrt(sum over D of ' ..
  'silu(y)^2 + eps) (keys, queries), laid out per memory (B, H, T, D); differentiable')
autograd.def_function('titans_prep', function(gr, a)
  local x = float_input('titans_prep', 'y', a[1], 4)
  local dy = empty(x.shape, x.dtype, x.device, 'titans_prep')
  K.titans_prep_backward(dy, x, tensor.to_dtype(gr[1], x.dtype):contiguous(), a[2] and 1 or 0, a[3] or 1e-6)
  return tensor.to_dtype(dy, a[1].dtype)
end)

return gp
