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
  -- (2-d logits and 1-d targets as they are: a view is a tensor object more a call)
  local lg = logits:contiguous()
  if lg:dim() ~= 2 then lg = lg:reshape {N, V} end
  local tg = targets:contiguous()
  if tg:dim() ~= 1 then tg = tg:reshape {N} end
  local loss = empty({N}, 'f32', logits.device, 'cross_entropy')
  if opts.grad then
    -- one pass: dlogits final (/ the count of kept rows for 'mean', counted on the device first)
    -- (dlogits made before the count's launch: nothing on the host between it and the kernel that reads it)
    local dl = empty({N, V}, logits.dtype, logits.device, 'cross_entropy')
    local cnt = common.grad_count('cross_entropy', tg, ignore, red)
    gp.k.cross_entropy_fwd_bwd(loss, dl, lg, tg, cnt, ignore, 1)
    return common.reduce_rows(loss, tg, ignore, red, targets.shape), logits:dim() == 2 and dl or dl:view(logits.shape)
  end
  gp.k.cross_entropy(loss, lg, tg, ignore)
  return common.reduce_rows(loss, tg, ignore, red, targets.shape)
end
doc(gp.cross_entropy, "gp.cross_entropy(logits, targets, {ignore_index=-100, reduction='mean', grad=false})",
  "softmax cross-entropy of logits (..., V) against 0-based targets (...): a 0-dim f32 device tensor ('mean' over rows whose target is not ignore_index, or 'sum'), or per-row losses ('none'); with grad=true also d(loss)/d(logits)")

---------------------------------------------------------------------------
-- linear_cross_entropy: the LM head's product and the cross-entropy chunk by
-- chunk over the rows (the Liger-Kernel design; the loop: common.head_loss):
-- the (N, V) logits never exist whole; the same code is the CPU reference
-- (its products and kernel are the CPU ones).
function gp.linear_cross_entropy(h, w, targets, opts)
  opts = opts or {}
  local op = 'linear_cross_entropy'
  if not is_tensor(h) or not is_tensor(w) or not is_tensor(targets) then
    raise(op .. ': h, w and targets must be tensors')
  end
  if type(opts) ~= 'table' then raise(op .. ": options must be a table like {ignore_index=-100, reduction='mean', chunk=1024}") end
  local hd = common.head_args(op, h, w, opts)
  if (targets.dtype ~= 'i32' and targets.dtype ~= 'i64') or targets:numel() ~= hd.N or targets:dim() ~= h:dim() - 1 then
    raise(string.format('%s: h is %s so targets must be %s of i32 or i64 class ids, got %s %s', op, shape_str(h.shape),
      shape_str(hd.lead), targets.dtype, shape_str(targets.shape)))
  end
  if targets.device ~= h.device then
    raise(string.format('%s: h, w and targets must be on one device, got %s, %s and %s', op, h.device, w.device, targets.device))
  end
  local ignore = opts.ignore_index or -100
  local k = gp.k
  -- (rows padded past V with -inf, read in place: classes = V bounds the targets)
  local V = hd.V
  return common.head_loss(hd, targets:contiguous():reshape {hd.N}, ignore, opts, function(lc, lg, tc, cnt)
    if cnt then k.cross_entropy_fwd_bwd(lc, lg, lg, tc, cnt, ignore, 1, V) -- dlogits over the logits
    else k.cross_entropy(lc, lg, tc, ignore, V) end
  end, true)
end
doc(gp.linear_cross_entropy, "gp.linear_cross_entropy(h, w, targets, {ignore_index=-100, reduction='mean', chunk=nil, grad=false})",
  "cross_entropy(h @ w^T, targets) for h (..., D) and an LM head's weight w (V, D), computed chunk by chunk over the rows so that the (N, V) logits never exist whole (a (chunk, V) scratch, default about 256 MiB); differentiable in h and w ('mean' or 'sum'); with grad=true also returns d(loss)/dh, d(loss)/dw")

autograd.def_function('linear_cross_entropy', common.head_loss_rule, common.head_loss_opts)

---------------------------------------------------------------------------
-- cross_entropy: the fused kernel gives dlogits final with the loss (saved by
-- the forward); backward returns it for loss:backward() and otherwise only
-- scales it by the incoming gradient (ops/common.lua)
autograd.def_function('cross_entropy', common.fused_loss_rule, common.fused_loss_opts)

return gp
