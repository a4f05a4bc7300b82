-- common: small helpers the op families and their gradient rules share.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local autograd = require 'gpush.core.autograd'
local gp = require 'gpush.core.ns'
local FLOAT = require('gpush.core.dtype').FLOAT
local shape_str = tensor.shape_str
local raise = rt.raise

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
-- comes out final; 1 otherwise. One launch (gp.k.loss_count).
function M.grad_count(op, tg, ignore, red)
  local cnt = tensor.empty({1}, 'f32', tg.device, op)
  gp.k.loss_count(cnt, tg, ignore, red == 'mean' and 1 or 0)
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
  seed_unread = true,
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

---------------------------------------------------------------------------
-- losses fused with the LM head's product (gp.linear_cross_entropy,
-- gp.linear_distill_loss), chunk by chunk over the rows: per chunk, logits =
-- h_c @ w^T into one (chunk, V) scratch, the loss kernel writes the rows'
-- losses and dlogits over the logits in place, then dh_c = dlogits @ w and
-- dw += dlogits^T @ h_c. The (N, V) logits never exist whole. The gradients
-- come with the loss, unscaled; autograd's path (grad = 'raw') scales them by
-- upstream / count in its backward.

-- lead .. {last}: a shape for messages
function M.with_last(lead, last)
  local s = {unpack(lead)}
  s[#s + 1] = last
  return s
end

-- 16-bit outputs of a count n that is not a multiple of 8 (GPT-2's 50257) make cuBLAS take slow kernels, in the
-- forward and in both products of the backward (H200, 768 -> 50257 at 8192 rows: 6.67, 6.22 and 4.34 ms), and
-- for rows padded to a multiple of 8 too. gp.linear and the losses fused with the head compute the first na (a
-- multiple of 8) outputs and the rest as two products into rows padded to na + 8 (out_parts), and take the
-- gradient into such rows the same way (1.62 ms forward, the copy out into packed rows included; 0.83 + 0.81 ms
-- backward after the copy in). Returns na where that applies.
local HALF = {bf16 = true, f16 = true}
M.HALF = HALF
function M.padded_outs(x, n)
  if HALF[x.dtype] and n % 8 ~= 0 and n >= 4096 and x.device == 'cuda' then return n - n % 8 end
end
-- the two column ranges {first (1-based), count} of n outputs split at na
function M.out_parts(n, na) return {{1, na}, {na + 1, n - na}} end

-- rows per chunk: a scratch of at most about 256 MiB, at most N, the chunks
-- of one size (a multiple of 8 rows where it can be): 8192 rows at V 50257
-- are 4 chunks of 2048, not 3 of 2670 and a slow one of 182
local function head_chunk(N, V, es)
  local C = math.max(1, math.min(N, math.floor(2 ^ 28 / math.max(V * es, 1))))
  if C >= N then return C end
  local n = math.ceil(N / C)
  local even = math.ceil(N / n)
  local r8 = math.ceil(even / 8) * 8
  return r8 <= C and r8 or even
end

-- h (..., D) and w (V, D) checked; {N, D, V, lead, hh (N, D), h, w, C}
function M.head_args(op, h, w, opts)
  if not FLOAT[h.dtype] or h.dtype ~= w.dtype then
    raise(string.format('%s: h and w must have one float dtype, got %s and %s', op, h.dtype, w.dtype))
  end
  if h.device ~= w.device then
    raise(string.format('%s: h and w must be on one device, got %s and %s', op, h.device, w.device))
  end
  if h:dim() < 1 or w:dim() ~= 2 or w:size(2) ~= h:size(-1) then
    raise(string.format('%s: h is %s and w is %s: w must be (V, D) with D = the last dim of h (logits = h @ w^T)', op,
      shape_str(h.shape), shape_str(w.shape)))
  end
  local red = opts.reduction or 'mean'
  if red ~= 'mean' and red ~= 'sum' and red ~= 'none' then
    raise(op .. ": reduction must be 'mean', 'sum' or 'none', got " .. tostring(red))
  end
  if opts.grad and red == 'none' then
    raise(op .. ": reduction 'none' has no fused gradient (each row's upstream gradient would be needed before the " ..
      "chunks' products): use 'mean' or 'sum', or the unfused loss on h @ w^T")
  end
  local D, V = h:size(-1), w:size(1)
  local N = D > 0 and h:numel() / D or 0
  local es = h.dtype == 'f32' and 4 or h.dtype == 'f64' and 8 or 2
  local C = opts.chunk or head_chunk(N, V, es)
  if type(C) ~= 'number' or C < 1 or C ~= math.floor(C) then
    raise(op .. ': chunk must be a positive integer (rows per chunk), got ' .. tostring(C))
  end
  return {op = op, h = h, w = w, N = N, D = D, V = V, lead = {unpack(h.shape, 1, h:dim() - 1)},
    hh = h:contiguous():reshape {N, D}, C = math.min(C, math.max(N, 1))}
end

-- the chunk loop; kernel(loss_c, logits_c, tg_c, count, r0) writes the
-- chunk's losses and, when count (a device tensor of 1) is given, dlogits
-- over the logits divided by it: the mean's count of kept rows, counted on
-- the device first (grad_count), so that dh and dw come out final (padded:
-- the kernel takes rows padded past V with -inf, logits_c then (c, na + 8)).
-- Returns the loss ('none': per row), and with opts.grad dh, dw
function M.head_loss(hd, tg, ignore, opts, kernel, padded)
  local op, h, w, N, D, V, C = hd.op, hd.h, hd.w, hd.N, hd.D, hd.V, hd.C
  local red, grad, dev = opts.reduction or 'mean', opts.grad, h.device
  local loss = tensor.empty({N}, 'f32', dev, op)
  -- (padded_outs) each product in two parts over rows padded to a multiple of 8; a kernel that takes those rows
  -- (padded: the cross-entropy, whose extra columns are filled with -inf) reads and writes them in place, the
  -- others get the logits copied to and from a scratch of packed rows
  local na = M.padded_outs(h, V)
  local pad, parts = na and tensor.empty({C, na + 8}, h.dtype, dev, op), na and M.out_parts(V, na)
  local direct = pad and padded
  local scratch = not direct and tensor.empty({C, V}, h.dtype, dev, op)
  local dh = grad and opts.grad_h ~= false and tensor.empty({N, D}, h.dtype, dev, op) or nil
  -- (the first chunk's product writes dw, the others add to it; no chunk: zeros)
  local dw = grad and opts.grad_w ~= false and (N > 0 and tensor.empty({V, D}, w.dtype, dev, op) or
    gp.zeros({V, D}, {dtype = w.dtype, device = dev})) or nil
  local k, wt = gp.k, w:transpose(1, 2) -- (D, V): a transposed view, no copy
  local cnt = grad and M.grad_count(op, tg, ignore, red)
  local at -- the first row of the chunk in flight (0-based)
  local ok, err = pcall(function()
    for r0 = 0, N - 1, C do
      at = r0
      local c = math.min(C, N - r0)
      local hc = hd.hh:narrow(1, r0 + 1, c)
      local lp = pad and pad:narrow(1, 1, c)
      local lg = direct and lp or scratch:narrow(1, 1, c)
      if pad then
        for _, p in ipairs(parts) do k.matmul(lp:narrow(2, p[1], p[2]), hc, wt:narrow(2, p[1], p[2])) end
        if direct then k.fill(lp:narrow(2, V + 1, na + 8 - V), -math.huge) else k.copy(lg, lp:narrow(2, 1, V)) end
      else
        k.matmul(lg, hc, wt)
      end
      kernel(loss:narrow(1, r0 + 1, c), lg, tg:narrow(1, r0 + 1, c), cnt, r0)
      if pad and not direct and (dh or dw) then k.copy(lp:narrow(2, 1, V), lg) end -- dlogits
      if dh then
        local o = dh:narrow(1, r0 + 1, c)
        if pad then
          for i, p in ipairs(parts) do k.matmul(o, lp:narrow(2, p[1], p[2]), w:narrow(1, p[1], p[2]), 1, i - 1) end
        else
          k.matmul(o, lg, w)
        end
      end
      if dw then
        local beta = r0 == 0 and 0 or 1
        if pad then
          for _, p in ipairs(parts) do
            k.matmul(dw:narrow(1, p[1], p[2]), lp:narrow(2, p[1], p[2]):transpose(1, 2), hc, 1, beta)
          end
        else
          k.matmul(dw, lg:transpose(1, 2), hc, 1, beta)
        end
      end
    end
  end)
  -- (a bad target on the CPU: the chunk kernel's error, named for this op and the whole h)
  if not ok then
    raise(string.format('%s (h %s, w %s; the chunk from row %d, 0-based): %s', op, shape_str(h.shape), shape_str(w.shape),
      at or 0, (tostring(err):gsub('^.-: ', '', 1))))
  end
  if red == 'none' then return loss:view(hd.lead) end
  local r, n = tensor.empty({1}, 'f32', dev, op), tensor.empty({1}, 'f32', dev, op)
  k.loss_reduce(r, n, loss, tg, ignore, red == 'mean' and 1 or 0)
  local out = r:view {}
  if not grad then return out end
  if dh then dh = dh:view(h.shape) end
  return out, dh, dw
end

-- autograd: f(h, w, third, opts) gives dh, dw final with the loss; backward
-- returns them as they are for the seed of loss:backward() (fresh: leaves
-- take them without a copy; not when the caller asked for them too,
-- grad=true) and scales them by any other incoming gradient
function M.head_loss_rule(g, a, _, saved)
  local dh, dw, gl = saved[1], saved[2], g[1]
  if rawget(gl, '_seed') then
    local held = type(a[4]) == 'table' and a[4].grad
    local function give(t) return t and (held and t or {fresh = t}) or nil end
    return give(dh), give(dw), nil, nil
  end
  local gh = dh and dh * tensor.to_dtype(gl, dh.dtype) or nil
  local gw = dw and dw * tensor.to_dtype(gl, dw.dtype) or nil
  return gh, gw, nil, nil
end
M.head_loss_opts = {
  nout = 1,
  seed_unread = true,
  forward = function(f, h, w, third, opts)
    if type(opts) ~= 'table' and opts ~= nil then return nil, f(h, w, third, opts) end -- f raises
    opts = opts or {}
    local o2 = {}
    for k, v in pairs(opts) do o2[k] = v end
    o2.grad = true
    o2.grad_h, o2.grad_w = autograd.needs(h), autograd.needs(w)
    local loss, dh, dw = f(h, w, third, o2)
    if opts.grad then return {dh, dw}, loss, dh, dw end
    return {dh, dw}, loss
  end,
}

return M
