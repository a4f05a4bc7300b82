-- loss ops: gp.cross_entropy. The loss stays on the device (no host sync).
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
  local lg = logits:contiguous():reshape {N, V}
  local tg = targets:contiguous():reshape {N}
  local loss = empty({N}, 'f32', logits.device, 'cross_entropy')
  local dl
  if opts.grad then
    dl = empty({N, V}, logits.dtype, logits.device, 'cross_entropy')
    gp.k.cross_entropy_fwd_bwd(loss, dl, lg, tg, ignore, 1)
  else
    gp.k.cross_entropy(loss, lg, tg, ignore)
  end
  return common.reduce_rows('cross_entropy', loss, dl, tg, ignore, red, opts.grad, targets.shape, logits.shape)
end
doc(gp.cross_entropy, "gp.cross_entropy(logits, targets, {ignore_index=-100, reduction='mean', grad=false})",
  "softmax cross-entropy of logits (..., V) against 0-based targets (...): a 0-dim f32 device tensor ('mean' over rows whose target is not ignore_index, or 'sum'), or per-row losses ('none'); with grad=true also d(loss)/d(logits)")

---------------------------------------------------------------------------
-- cross_entropy: the fused kernel gives dlogits with the loss (saved by the
-- forward); backward only scales it by the incoming gradient (ops/common.lua)
autograd.def_function('cross_entropy', common.fused_loss_rule, common.fused_loss_opts)

return gp
