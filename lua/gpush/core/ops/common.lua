-- common: small helpers the op families and their gradient rules share.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local autograd = require 'gpush.core.autograd'
local gp = require 'gpush.core.ns'
local FLOAT = require('gpush.core.dtype').FLOAT
local shape_str = tensor.shape_str

local M = {}

-- x as a contiguous float tensor (integers become f32)
function M.floatc(x) return (FLOAT[x.dtype] and x or tensor.to_dtype(x, 'f32')):contiguous() end

-- t in x's dtype, contiguous
function M.like(t, x) return tensor.to_dtype(t, x.dtype):contiguous() end

-- a leaf's existing .grad that a kernel can accumulate into (a GEMM with
-- beta = 1, a norm backward with accumulate = 1), as autograd's add_ would:
-- saves a launch and a pass over the gradient
function M.grad_buffer(p, dt, dev)
  if rawget(p, '_node') then return nil end
  local gr = rawget(p, 'grad')
  if gr and gr.dtype == dt and gr.device == dev and gr:is_contiguous() and shape_str(gr.shape) == shape_str(p.shape) then
    return gr
  end
end

-- w (and b) must be 1-d of size D, on x's device; they take x's dtype
function M.norm_param(p, x, op, name, D)
  if not tensor.is_tensor(p) then rt.raise(string.format('%s: %s must be a tensor, got %s', op, name, type(p))) end
  if p.device ~= x.device then
    rt.raise(string.format('%s: %s is on %s but x is on %s (move one with :to())', op, name, p.device, x.device))
  end
  if p:dim() ~= 1 or p:size(1) ~= D then
    rt.raise(string.format('%s: %s is %s but x is %s (%s must be (%d))', op, name, shape_str(p.shape), shape_str(x.shape), name, D))
  end
  return tensor.to_dtype(p, x.dtype):contiguous()
end

-- the norms' gradient rules (rows, fused)
function M.norm_w(w, x, D)
  if w then return M.like(w, x) end
  return gp.ones({D}, {dtype = x.dtype, device = x.device})
end

-- dw (and db when has_b) for a norm backward over x's last dim D: the .grad
-- of w (b) where the kernel can add into it, else a new tensor; with either
-- .grad taken the kernel accumulates (accumulate = 1) and the other output
-- is a zeroed scratch. Returns dw, db, accumulate and the gradients for the
-- rule to return (nil where the kernel added into .grad)
function M.norm_outs(x, D, op, w, b, has_b)
  local gw = w and autograd.needs(w) and M.grad_buffer(w, x.dtype, x.device)
  local gb = has_b and b and autograd.needs(b) and M.grad_buffer(b, x.dtype, x.device)
  local acc = (gw or gb) and 1 or 0
  local function out(buf)
    if buf then return buf end
    local t = tensor.empty({D}, x.dtype, x.device, op)
    if acc == 1 then t:zero_() end
    return t
  end
  local dw, db = out(gw), has_b and out(gb) or nil
  return dw, db, acc, (w and not gw) and dw or nil, (b and not gb) and db or nil
end

-- the end of a fused loss (cross_entropy, distill_loss): its per-row f32
-- losses (N) reduced by gp.k.loss_reduce ('mean' over the rows whose target
-- is not ignore_index, 'sum'), or viewed as row_shape ('none'); with dx (the
-- kernel's d(loss)/dx, unscaled) also dx viewed as x_shape, divided by the
-- count for 'mean' -- except on autograd's path (grad = 'raw'), which takes
-- dx unscaled and the count: its backward scales by upstream / count in the
-- one pass it makes anyway
function M.reduce_rows(op, loss, dx, tg, ignore, red, grad, row_shape, x_shape)
  local out
  if red == 'none' then
    out = loss:view(row_shape)
  else
    local r = tensor.empty({1}, 'f32', loss.device, op)
    local cnt = tensor.empty({1}, 'f32', loss.device, op)
    gp.k.loss_reduce(r, cnt, loss, tg, ignore, red == 'mean' and 1 or 0)
    out = r:view {}
    if dx and red == 'mean' then
      if grad == 'raw' then return out, dx:view(x_shape), cnt end
      gp.k.div(dx, dx, cnt:to(dx.dtype))
    end
  end
  if dx then return out, dx:view(x_shape) end
  return out
end

-- the gradient rule of a fused loss f(x, y, opts) (cross_entropy),
-- whose kernel gives d(loss)/dx with the loss. saved: dx, and
-- for 'mean' without grad=true the count of rows the mean is over (dx then
-- unscaled): one pass of dx * (upstream / count) over the (N, V) logits
-- instead of a divide in forward and a multiply here. y gets no gradient.
function M.fused_loss_rule(g, a, _, saved)
  local opts = type(a[3]) == 'table' and a[3] or {}
  local dx, cnt = saved[1], saved[2]
  local gl = g[1]
  if (opts.reduction or 'mean') == 'none' then gl = gl:unsqueeze(-1) end
  if cnt then gl = tensor.to_dtype(gl, 'f32') / cnt:view {} end
  return dx * tensor.to_dtype(gl, dx.dtype), nil, nil
end
M.fused_loss_opts = {
  nout = 1,
  forward = function(f, x, y, opts)
    if type(opts) ~= 'table' and opts ~= nil then return nil, f(x, y, opts) end -- f raises
    opts = opts or {}
    local o2 = {}
    for k, v in pairs(opts) do o2[k] = v end
    o2.grad = opts.grad and true or 'raw' -- grad = true: the caller gets the scaled dx too
    local loss, dx, cnt = f(x, y, o2)
    if opts.grad then return {dx}, loss, dx end
    return {dx, cnt}, loss
  end,
}

return M
