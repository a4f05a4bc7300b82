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

-- the count a fused loss's kernel divides dx by (cross_entropy,
-- distill_loss, with grad): for 'mean', the rows whose target is not
-- ignore_index, counted on the device before the launch (no host sync), so dx
-- comes out final; ones otherwise. loss: the (N) f32 losses (zeroed here).
function M.grad_count(op, loss, tg, ignore, red)
  if red ~= 'mean' then return gp.ones({1}, {device = loss.device}) end
  local r = tensor.empty({1}, 'f32', loss.device, op)
  local cnt = tensor.empty({1}, 'f32', loss.device, op)
  gp.k.fill(loss, 0)
  gp.k.loss_reduce(r, cnt, loss, tg, ignore, 0)
  return cnt
end

-- the end of a fused loss (cross_entropy, distill_loss): its per-row f32
-- losses (N) reduced by gp.k.loss_reduce ('mean' over the rows whose target
-- is not ignore_index, 'sum'), or viewed as row_shape ('none')
function M.reduce_rows(loss, tg, ignore, red, row_shape)
  if red == 'none' then return loss:view(row_shape) end
  local r = tensor.empty({1}, 'f32', loss.device, 'loss')
  local cnt = tensor.empty({1}, 'f32', loss.device, 'loss')
  gp.k.loss_reduce(r, cnt, loss, tg, ignore, red == 'mean' and 1 or 0)
  return r:view {}
end

-- the gradient rule of a fused loss f(x, y, opts) whose kernel gives dx =
-- d(loss)/dx final (already / count for 'mean', grad_count) with the loss,
-- saved by the forward: backward returns it as it is for the seed of
-- loss:backward() (a gradient of ones; fresh: a leaf takes it without a
-- copy), so forward + backward is one pass over x, and scales it by any other
-- incoming gradient; y gets none
function M.fused_loss_rule(g, a, _, saved)
  local dx, gl = saved[1], g[1]
  local opts = type(a[3]) == 'table' and a[3] or {}
  -- (with grad=true the caller holds dx too: not fresh)
  if rawget(gl, '_seed') then return opts.grad and dx or {fresh = dx}, nil, nil end
  if (opts.reduction or 'mean') == 'none' then gl = gl:unsqueeze(-1) end
  return dx * tensor.to_dtype(gl, dx.dtype), nil, nil
end
M.fused_loss_opts = {
  nout = 1,
  forward = function(f, x, y, opts)
    if type(opts) ~= 'table' and opts ~= nil then return nil, f(x, y, opts) end -- f raises
    local o2 = {}
    for k, v in pairs(opts or {}) do o2[k] = v end
    o2.grad = true
    local loss, dx = f(x, y, o2)
    if opts and opts.grad then return {dx}, loss, dx end
    return {dx}, loss
  end,
}

return M
