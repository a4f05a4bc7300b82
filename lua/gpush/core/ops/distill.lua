-- distillation loss: gp.distill_loss over the fused kernels of kernels/distill.*
-- (online softmax of student and teacher rows in one pass; the probabilities
-- never reach device memory). The loss stays on the device.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local common = require 'gpush.core.ops.common'
local FLOAT = require('gpush.core.dtype').FLOAT
local raise = rt.raise
local is_tensor, empty, shape_str = tensor.is_tensor, tensor.empty, tensor.shape_str
local doc = gp.doc

local KINDS = {forward_kl = 0, reverse_kl = 1, jsd = 2}

-- the options shared by gp.distill_loss and gp.linear_distill_loss, checked:
-- T, alpha, kind (0-2), red, and the targets (N) with their ignore_index
-- (without targets: zeros and -1, every row counted, the CE's weight 0)
local function distill_opts(op, opts, N, lead, dev, shape)
  local T = opts.temperature or 1
  if type(T) ~= 'number' or not (T > 0) or T == math.huge then
    raise(op .. ': temperature must be a positive number, got ' .. tostring(T))
  end
  local kind = KINDS[opts.kind or 'forward_kl']
  if not kind then
    raise(op .. ": kind must be 'forward_kl', 'reverse_kl' or 'jsd', got " .. tostring(opts.kind))
  end
  local red = opts.reduction or 'mean'
  if red ~= 'mean' and red ~= 'sum' and red ~= 'none' then
    raise(op .. ": reduction must be 'mean', 'sum' or 'none', got " .. tostring(red))
  end
  local targets, ignore = opts.targets, opts.ignore_index or -100
  local alpha = opts.alpha or (targets and 0.5 or 1)
  if type(alpha) ~= 'number' or not (alpha >= 0 and alpha <= 1) then
    raise(op .. ': alpha must be a number in [0, 1] (the weight of the distillation term), got ' .. tostring(alpha))
  end
  if targets == nil then
    if alpha ~= 1 then
      raise(string.format('%s: alpha = %g mixes in the cross-entropy, which needs targets (opts.targets)', op, alpha))
    end
    -- no hard targets: every row counts; the CE term has weight 0 (the kernel skips it)
    targets = gp.zeros(lead, {dtype = 'i32', device = dev})
    ignore = -1
  elseif not is_tensor(targets) or (targets.dtype ~= 'i32' and targets.dtype ~= 'i64') then
    raise(op .. ': targets must be an i32 or i64 tensor of 0-based class ids')
  elseif targets.device ~= dev then
    raise(string.format('%s: targets are on %s but the logits are on %s', op, targets.device, dev))
  elseif targets:numel() ~= N or targets:dim() ~= #lead then
    raise(string.format('%s: logits are %s so targets must be %s, got %s', op, shape_str(shape), shape_str(lead),
      shape_str(targets.shape)))
  end
  return T, alpha, kind, red, targets:contiguous():reshape {N}, ignore
end

-- student (..., V), teacher (..., V); opts.targets (...) of 0-based ids
function gp.distill_loss(student, teacher, opts)
  opts = opts or {}
  local op = 'distill_loss'
  if not is_tensor(student) or not is_tensor(teacher) then
    raise(op .. ': student and teacher logits must be tensors')
  end
  if type(opts) ~= 'table' then
    raise(op .. ": options must be a table like {temperature=2, alpha=0.5, targets=t, kind='forward_kl'}")
  end
  if not FLOAT[student.dtype] or not FLOAT[teacher.dtype] then
    raise(string.format('%s: logits must be floating point, got student %s and teacher %s', op, student.dtype, teacher.dtype))
  end
  if student.device ~= teacher.device then
    raise(string.format('%s: student is on %s but teacher is on %s (move one with :to())', op, student.device, teacher.device))
  end
  if student:dim() < 1 or shape_str(student.shape) ~= shape_str(teacher.shape) then
    raise(string.format('%s: student logits %s and teacher logits %s must have the same shape (same vocabulary, same rows)',
      op, shape_str(student.shape), shape_str(teacher.shape)))
  end
  local V = student:size(-1)
  local N = V > 0 and student:numel() / V or 0
  local lead = {unpack(student.shape, 1, student:dim() - 1)}
  local T, alpha, kind, red, tg, ignore = distill_opts(op, opts, N, lead, student.device, student.shape)
  local s = student:contiguous():reshape {N, V}
  local t = tensor.to_dtype(teacher, student.dtype):contiguous():reshape {N, V}
  local dev = student.device
  local loss = empty({N}, 'f32', dev, op)
  local ds
  if opts.grad then
    -- one pass: dstudent final (/ the count of kept rows for 'mean', counted on the device first)
    ds = empty({N, V}, student.dtype, dev, op) -- (before the count's launch, as cross_entropy's)
    local cnt = common.grad_count(op, tg, ignore, red)
    gp.k.distill_fwd_bwd(loss, ds, s, t, tg, cnt, T, alpha, kind, ignore, 1)
  else
    gp.k.distill_loss(loss, s, t, tg, T, alpha, kind, ignore)
  end
  local out = common.reduce_rows(loss, tg, ignore, red, lead)
  if ds then return out, ds:view(student.shape) end
  return out
end
doc(gp.distill_loss,
  "gp.distill_loss(student_logits, teacher_logits, {temperature=1, alpha=0.5, targets=t, ignore_index=-100, kind='forward_kl', reduction='mean', grad=false})",
  "knowledge-distillation loss per row: alpha * T^2 * D + (1 - alpha) * cross_entropy(student, targets), D = KL(softmax(teacher/T) || softmax(student/T)) ('forward_kl'), KL(student_T || teacher_T) ('reverse_kl') or their Jensen-Shannon divergence ('jsd'); alpha defaults to 0.5 with targets, 1 (distillation only) without; rows whose target is ignore_index count in neither term; 'mean' over the other rows. Differentiable in the student logits only (the teacher is a constant); with grad=true also returns d(loss)/d(student)")

-- h (..., D), w (V, D): the student's logits h @ w^T, chunk by chunk with the
-- LM head's product (ops/common.lua head_loss), never whole; teacher (..., V)
function gp.linear_distill_loss(h, w, teacher, opts)
  opts = opts or {}
  local op = 'linear_distill_loss'
  if not is_tensor(h) or not is_tensor(w) or not is_tensor(teacher) then
    raise(op .. ': h, w and the teacher logits must be tensors')
  end
  if type(opts) ~= 'table' then
    raise(op .. ": options must be a table like {temperature=2, alpha=0.5, targets=t, kind='forward_kl', chunk=1024}")
  end
  local hd = common.head_args(op, h, w, opts)
  local lead, N, V = hd.lead, hd.N, hd.V
  if not FLOAT[teacher.dtype] or teacher.device ~= h.device or teacher:dim() ~= #lead + 1 or teacher:numel() ~= N * V or
    teacher:size(-1) ~= V then
    raise(string.format('%s: h is %s and w %s, so the teacher logits must be a float %s on %s, got %s %s on %s', op,
      shape_str(h.shape), shape_str(w.shape), shape_str(common.with_last(lead, V)), h.device, teacher.dtype,
      shape_str(teacher.shape), teacher.device))
  end
  local T, alpha, kind, _, tg, ignore = distill_opts(op, opts, N, lead, h.device, common.with_last(lead, V))
  local t = tensor.to_dtype(teacher, h.dtype):contiguous():reshape {N, V}
  local k = gp.k
  return common.head_loss(hd, tg, ignore, opts, function(lc, lg, tc, cnt, r0)
    local tt = t:narrow(1, r0 + 1, lg:size(1))
    if cnt then k.distill_fwd_bwd(lc, lg, lg, tt, tc, cnt, T, alpha, kind, ignore, 1) -- dstudent over the logits
    else k.distill_loss(lc, lg, tt, tc, T, alpha, kind, ignore) end
  end)
end
doc(gp.linear_distill_loss,
  "gp.linear_distill_loss(h, w, teacher_logits, {temperature=1, alpha, targets, ignore_index=-100, kind='forward_kl', reduction='mean', chunk=nil, grad=false})",
  "gp.distill_loss(h @ w^T, teacher_logits, opts) for the student's last hidden states h (..., D) and its LM head's weight w (V, D), computed chunk by chunk over the rows so that the student's (N, V) logits never exist whole (a (chunk, V) scratch, default about 256 MiB; the teacher's logits are an input); differentiable in h and w ('mean' or 'sum'); with grad=true also returns d(loss)/dh, d(loss)/dw")

autograd.def_function('linear_distill_loss', common.head_loss_rule, common.head_loss_opts)

---------------------------------------------------------------------------
-- distill_loss: the fused kernel gives dstudent final with the loss (saved by
-- the forward); backward returns it for loss:backward() and otherwise only
-- scales it by the incoming gradient; the teacher gets none (ops/common.lua)
autograd.def_function('distill_loss', common.fused_loss_rule, common.fused_loss_opts)

return gp
