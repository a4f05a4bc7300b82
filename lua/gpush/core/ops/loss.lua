-- loss ops: gp.cross_entropy and gp.linear_cross_entropy. The loss stays on the
-- device (no host sync).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local common = require 'gpush.core.ops.common'
local raise = rt.raise
local is_tensor, empty, shape_str = tensor.is_tensor, tensor.empty, tensor.shape_str
local doc = gp.doc
local FLOAT = require('gpush.core.dtype').FLOAT

-- logits (..., V), targets (...) of 0-based class ids
function gp.cross_entropy(logits, targets, opts)
  opts = opts or {}
  if not is_tensor(logits) or not is_tensor(targets) then raise('cross_entropy: logits and targets must be tensors') end
  if type(opts) ~= 'table' then raise("cross_entropy: options must be a table like {ignore_index=-100, reduction='mean'}") end
  local ignore = opts.ignore_index or -100
  local red = opts.reduction or 'mean'
  if red ~= 'mean' and red ~= 'sum' and red ~= 'none' then
    raise("cross_entropy: reduction must be 'mean', 'sum' or 'none', got " .. tostring(red))
  end
  if logits:dim() < 1 then raise('cross_entropy: logits must have a class dim') end
  local V = logits:size(-1)
  local N = V > 0 and logits:numel() / V or 0
  if targets:numel() ~= N or targets:dim() ~= logits:dim() - 1 then
    raise(string.format('cross_entropy: logits are %s so targets must be %s, got %s', shape_str(logits.shape),
      shape_str({unpack(logits.shape, 1, logits:dim() - 1)}), shape_str(targets.shape)))
  end
  local lg = logits:contiguous():reshape {N, V}
  local tg = targets:contiguous():reshape {N}
  local loss = empty({N}, 'f32', logits.device, 'cross_entropy')
  if opts.grad then
    -- one pass: dlogits final (/ the count of kept rows for 'mean', counted on the device first)
    local cnt = common.grad_count('cross_entropy', loss, tg, ignore, red)
    local dl = empty({N, V}, logits.dtype, logits.device, 'cross_entropy')
    gp.k.cross_entropy_fwd_bwd(loss, dl, lg, tg, cnt, ignore, 1)
    return common.reduce_rows(loss, tg, ignore, red, targets.shape), dl:view(logits.shape)
  end
  gp.k.cross_entropy(loss, lg, tg, ignore)
  return common.reduce_rows(loss, tg, ignore, red, targets.shape)
end
doc(gp.cross_entropy, "gp.cross_entropy(logits, targets, {ignore_index=-100, reduction='mean', grad=false})",
  "softmax cross-entropy of logits (..., V) against 0-based targets (...): a 0-dim f32 device tensor ('mean' over rows whose target is not ignore_index, or 'sum'), or per-row losses ('none'); with grad=true also d(loss)/d(logits)")

---------------------------------------------------------------------------
-- linear_cross_entropy: the LM head's product and the cross-entropy chunk by
-- chunk over the rows (the Liger-Kernel design): per chunk, logits = h_c @ w^T
-- into one (chunk, V) scratch, the fused cross-entropy kernel writes dlogits
-- over them in place, then dh_c = dlogits @ w and dw += dlogits^T @ h_c. The
-- (N, V) logits never exist whole; the same code is the CPU reference (its
-- products and kernel are the CPU ones). The gradients come with the loss,
-- unscaled, as cross_entropy's do (grad = 'raw' on autograd's path).

-- rows per chunk: a scratch of about 256 MiB, at most N
local function lce_chunk(N, V, es) return math.max(1, math.min(N, math.floor(2 ^ 28 / math.max(V * es, 1)))) end

function gp.linear_cross_entropy(h, w, targets, opts)
  opts = opts or {}
  local op = 'linear_cross_entropy'
  if not is_tensor(h) or not is_tensor(w) or not is_tensor(targets) then
    raise(op .. ': h, w and targets must be tensors')
  end
  if type(opts) ~= 'table' then raise(op .. ": options must be a table like {ignore_index=-100, reduction='mean', chunk=1024}") end
  if not FLOAT[h.dtype] or h.dtype ~= w.dtype then
    raise(string.format('%s: h and w must have one float dtype, got %s and %s', op, h.dtype, w.dtype))
  end
  if h.device ~= w.device or h.device ~= targets.device then
    raise(string.format('%s: h, w and targets must be on one device, got %s, %s and %s', op, h.device, w.device, targets.device))
  end
  if h:dim() < 1 or w:dim() ~= 2 or w:size(2) ~= h:size(-1) then
    raise(string.format('%s: h is %s and w is %s: w must be (V, D) with D = the last dim of h (logits = h @ w^T)', op,
      shape_str(h.shape), shape_str(w.shape)))
  end
  local D, V = h:size(-1), w:size(1)
  local N = D > 0 and h:numel() / D or 0
  local lead = {unpack(h.shape, 1, h:dim() - 1)}
  if (targets.dtype ~= 'i32' and targets.dtype ~= 'i64') or targets:numel() ~= N or targets:dim() ~= h:dim() - 1 then
    raise(string.format('%s: h is %s so targets must be %s of i32 or i64 class ids, got %s %s', op, shape_str(h.shape),
      shape_str(lead), targets.dtype, shape_str(targets.shape)))
  end
  local ignore, red = opts.ignore_index or -100, opts.reduction or 'mean'
  if red ~= 'mean' and red ~= 'sum' and red ~= 'none' then
    raise(op .. ": reduction must be 'mean', 'sum' or 'none', got " .. tostring(red))
  end
  local grad = opts.grad
  if grad and red == 'none' then
    raise(op .. ": reduction 'none' has no fused gradient (each row's upstream gradient would be needed before the " ..
      "chunks' products): use 'mean' or 'sum', or gp.cross_entropy on h @ w^T")
  end
  local es = h.dtype == 'f32' and 4 or h.dtype == 'f64' and 8 or 2
  local C = opts.chunk or lce_chunk(N, V, es)
  if type(C) ~= 'number' or C < 1 or C ~= math.floor(C) then
    raise(op .. ': chunk must be a positive integer (rows per chunk), got ' .. tostring(C))
  end
  C = math.min(C, math.max(N, 1))
  local dev = h.device
  local hh = h:contiguous():reshape {N, D}
  local wt = w:transpose(1, 2) -- (D, V): a transposed view, no copy
  local tg = targets:contiguous():reshape {N}
  local loss = empty({N}, 'f32', dev, op)
  local scratch = empty({C, V}, h.dtype, dev, op)
  local dh = grad and opts.grad_h ~= false and empty({N, D}, h.dtype, dev, op) or nil
  local dw = grad and opts.grad_w ~= false and gp.zeros({V, D}, {dtype = w.dtype, device = dev}) or nil
  local k = gp.k
  local one = grad and gp.ones({1}, {device = dev}) -- the chunks' dlogits unscaled
  local at -- the first row of the chunk in flight (0-based)
  local ok, err = pcall(function()
    for r0 = 0, N - 1, C do
      at = r0
      local c = math.min(C, N - r0)
      local lg, hc = scratch:narrow(1, 1, c), hh:narrow(1, r0 + 1, c)
      local lc, tc = loss:narrow(1, r0 + 1, c), tg:narrow(1, r0 + 1, c)
      k.matmul(lg, hc, wt)
      if grad then
        k.cross_entropy_fwd_bwd(lc, lg, lg, tc, one, ignore, 1) -- dlogits over the logits
        if dh then k.matmul(dh:narrow(1, r0 + 1, c), lg, w) end
        if dw then k.matmul(dw, lg:transpose(1, 2), hc, 1, 1) end
      else
        k.cross_entropy(lc, lg, tc, ignore)
      end
    end
  end)
  -- (a bad target on the CPU: the chunk kernel's error, named for this op and the whole h)
  if not ok then
    raise(string.format('%s (h %s, w %s; the chunk from row %d, 0-based): %s', op, shape_str(h.shape), shape_str(w.shape),
      at or 0, (tostring(err):gsub('^.-: ', '', 1))))
  end
  if red == 'none' then return loss:view(lead) end
  local r, cnt = empty({1}, 'f32', dev, op), empty({1}, 'f32', dev, op)
  k.loss_reduce(r, cnt, loss, tg, ignore, red == 'mean' and 1 or 0)
  local out = r:view {}
  if not grad then return out end
  if dh then dh = dh:view(h.shape) end
  if grad == 'raw' then return out, dh, dw, red == 'mean' and cnt or nil end
  if red == 'mean' then
    if dh then k.div(dh, dh, cnt:to(dh.dtype)) end
    if dw then k.div(dw, dw, cnt:to(dw.dtype)) end
  end
  return out, dh, dw
end
doc(gp.linear_cross_entropy, "gp.linear_cross_entropy(h, w, targets, {ignore_index=-100, reduction='mean', chunk=nil, grad=false})",
  "cross_entropy(h @ w^T, targets) for h (..., D) and an LM head's weight w (V, D), computed chunk by chunk over the rows so that the (N, V) logits never exist whole (a (chunk, V) scratch, default about 256 MiB); differentiable in h and w ('mean' or 'sum'); with grad=true also returns d(loss)/dh, d(loss)/dw")

autograd.def_function('linear_cross_entropy', function(g, _, _, saved)
  local dh, dw, cnt = saved[1], saved[2], saved[3]
  local gl = g[1]
  if cnt then gl = tensor.to_dtype(gl, 'f32') / cnt:view {} end
  local gh = dh and dh * tensor.to_dtype(gl, dh.dtype) or nil
  local gw = dw and dw * tensor.to_dtype(gl, dw.dtype) or nil
  return gh, gw, nil, nil
end, {
  nout = 1,
  forward = function(f, h, w, targets, opts)
    if type(opts) ~= 'table' and opts ~= nil then return nil, f(h, w, targets, opts) end -- f raises
    opts = opts or {}
    local o2 = {}
    for k, v in pairs(opts) do o2[k] = v end
    o2.grad = opts.grad and true or 'raw'
    o2.grad_h, o2.grad_w = autograd.needs(h), autograd.needs(w)
    local loss, dh, dw, cnt = f(h, w, targets, o2)
    if opts.grad then return {dh, dw}, loss, dh, dw end
    return {dh, dw, cnt}, loss
  end,
})

---------------------------------------------------------------------------
-- cross_entropy: the fused kernel gives dlogits final with the loss (saved by
-- the forward); backward returns it for loss:backward() and otherwise only
-- scales it by the incoming gradient (ops/common.lua)
autograd.def_function('cross_entropy', common.fused_loss_rule, common.fused_loss_opts)

return gp
