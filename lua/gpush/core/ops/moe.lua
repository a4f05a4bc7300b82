-- Mixture-of-Experts ops (kernels/moe.*): routing, token permutation by
-- expert into padded groups, expert FFNs as batched GEMMs over the groups,
-- the weighted combine, and the auxiliary losses.
--
--   local w, ids, probs = gp.moe_router(logits, k)          -- differentiable in logits
--   local dest, src, counts = gp.moe_permute(ids, E, cap)   -- slots: expert e's rows are e*cap .. e*cap+cap-1
--   local xs = gp.moe_gather(x, src, dest)                  -- (E*cap, C), differentiable in x
--   local out = gp.moe_combine(ys, w, dest, src)            -- (N, C), differentiable in ys and w
--   local out, info = gp.moe_ffn(x, router_w, w1, w2, w3, {k = 2})  -- all of it
--
-- An assignment a = n*k + j is token n's j-th expert; dest (N, k) holds its
-- slot (-1: dropped by the capacity), src (E*cap) the assignment in each slot
-- (-1: empty). Index tensors are i32 and 0-based.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local FLOAT = require('gpush.core.dtype').FLOAT
local raise, empty, is_tensor, shape_str = rt.raise, tensor.empty, tensor.is_tensor, tensor.shape_str
local K = tensor.K
local doc = gp.doc

local function need(op, name, x, dims)
  if not is_tensor(x) then raise(string.format('%s: %s must be a tensor, got %s', op, name, type(x))) end
  if dims and x:dim() ~= dims then
    raise(string.format('%s: %s must have %d dims, got %s', op, name, dims, shape_str(x.shape)))
  end
end
local function need_float(op, name, x, dims)
  need(op, name, x, dims)
  if not FLOAT[x.dtype] then raise(string.format('%s: %s must be a float tensor, got %s', op, name, x.dtype)) end
end
local function need_int(op, name, v, lo)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < (lo or 1) then
    raise(string.format('%s: %s must be an integer >= %d, got %s', op, name, lo or 1, tostring(v)))
  end
end
local function ids32(op, ids)
  need(op, 'ids', ids, 2)
  if ids.dtype ~= 'i32' and ids.dtype ~= 'i64' then raise(string.format('%s: ids must be i32 or i64, got %s', op, ids.dtype)) end
  return tensor.to_dtype(ids, 'i32'):contiguous()
end
-- the router's arithmetic dtype: f32, or f64 for f64 logits
local function rdt(x) return x.dtype == 'f64' and 'f64' or 'f32' end
local function as(x, dt) return tensor.to_dtype(x, dt):contiguous() end

---------------------------------------------------------------------------
-- routing

local function renorm_of(opts, k)
  local r = opts and opts.renorm
  if r == nil then return k > 1 end
  return r and true or false
end

function gp.moe_router(logits, k, opts)
  local op = 'moe_router'
  need_float(op, 'logits', logits, 2)
  need_int(op, 'k', k)
  if opts ~= nil and type(opts) ~= 'table' then raise(op .. ': opts must be a table like {renorm = true}') end
  local N, E = logits:size(1), logits:size(2)
  if E > 256 or k > 8 or k > E then
    raise(string.format('moe_router: logits is %s and k = %d: at most 256 experts and k <= min(8, E)', shape_str(logits.shape), k))
  end
  local l = as(logits, rdt(logits))
  local w = empty({N, k}, l.dtype, l.device, op)
  local ids = empty({N, k}, 'i32', l.device, op)
  local probs = empty({N, E}, l.dtype, l.device, op)
  K.moe_router(w, ids, probs, l, renorm_of(opts, k) and 1 or 0)
  return w, ids, probs
end
doc(gp.moe_router, 'gp.moe_router(logits, k, {renorm=(k > 1)})',
  'logits (N, E) -> weights (N, k), expert ids (N, k) i32, probs (N, E): softmax in f32 (f64 for f64 logits), the k largest logits (ties: lower index), weights renormalized to sum 1 when renorm; differentiable in logits through weights and probs')

autograd.def_function('moe_router', function(g, a, o)
  local probs, ids = o[3], o[2]
  local N, E, k = probs:size(1), probs:size(2), ids:size(2)
  local dw = g[1] and as(g[1], probs.dtype) or gp.zeros({N, k}, {dtype = probs.dtype, device = probs.device})
  local dp = g[3] and as(g[3], probs.dtype) or gp.zeros({N, E}, {dtype = probs.dtype, device = probs.device})
  local dl = empty({N, E}, probs.dtype, probs.device, 'moe_router')
  K.moe_router_backward(dl, probs, ids, dw, dp, renorm_of(a[3], k) and 1 or 0)
  return dl
end)

function gp.moe_histogram(ids, E)
  local op = 'moe_histogram'
  ids = ids32(op, ids)
  need_int(op, 'E', E)
  local counts = empty({E}, 'i32', ids.device, op)
  K.moe_histogram(counts, ids)
  return counts
end
doc(gp.moe_histogram, 'gp.moe_histogram(ids, E)', 'counts (E) i32: how many entries of ids (N, k) name each expert')

function gp.moe_permute(ids, E, cap)
  local op = 'moe_permute'
  ids = ids32(op, ids)
  need_int(op, 'E', E)
  need_int(op, 'cap', cap, 0)
  local dest = empty(ids.shape, 'i32', ids.device, op)
  local src = empty({E * cap}, 'i32', ids.device, op)
  local counts = empty({E}, 'i32', ids.device, op)
  K.moe_permute(dest, src, counts, ids)
  return dest, src, counts
end
doc(gp.moe_permute, 'gp.moe_permute(ids, E, cap)',
  'stable slots by expert: dest (N, k) i32 = e*cap + rank (-1 when rank >= cap: dropped), src (E*cap) i32 = the flat assignment n*k+j in each slot (-1: empty), counts (E) i32 before capacity')

function gp.moe_dropped(counts, cap)
  need('moe_dropped', 'counts', counts, 1)
  return gp.no_grad(function() return (counts:to('i64') - cap):clamp(0, math.huge):sum() end)
end
doc(gp.moe_dropped, 'gp.moe_dropped(counts, cap)', 'the number of assignments dropped by the capacity: sum of max(counts - cap, 0), a device scalar')

---------------------------------------------------------------------------
-- gather and combine

local function check_rows(op, x, xn, idx, iname, n)
  if idx.device ~= x.device then
    raise(string.format('%s: %s is on %s but %s is on %s', op, iname, idx.device, xn, x.device))
  end
  if n and idx:size(1) ~= n then
    raise(string.format('%s: %s is %s but %s is %s', op, xn, shape_str(x.shape), iname, shape_str(idx.shape)))
  end
end

function gp.moe_gather(x, src, dest)
  local op = 'moe_gather'
  need_float(op, 'x', x, 2)
  need(op, 'src', src, 1)
  need(op, 'dest', dest, 2)
  check_rows(op, x, 'x', src)
  check_rows(op, x, 'x', dest, 'dest', x:size(1))
  local xc = x:contiguous()
  local N, k = x:size(1), dest:size(2)
  local out = empty({src:size(1), x:size(2)}, x.dtype, x.device, op)
  K.moe_gather(out, xc, as(src, 'i32'), gp.ones({N, k}, {dtype = x.dtype, device = x.device}))
  return out
end
doc(gp.moe_gather, 'gp.moe_gather(x, src, dest)',
  'x (N, C) -> (S, C): row s is x[src[s] // k] (k = dest:size(2)), zero where src[s] = -1; differentiable in x (the backward sums each token\'s k slots)')

autograd.def_function('moe_gather', function(g, a)
  local x, dest = a[1], a[3]
  local N, k = x:size(1), dest:size(2)
  local dx = empty(x.shape, x.dtype, x.device, 'moe_gather')
  K.moe_combine(dx, as(g[1], x.dtype), as(dest, 'i32'), gp.ones({N, k}, {dtype = x.dtype, device = x.device}))
  return dx
end)

function gp.moe_combine(ys, w, dest, src)
  local op = 'moe_combine'
  need_float(op, 'ys', ys, 2)
  need_float(op, 'w', w, 2)
  need(op, 'dest', dest, 2)
  need(op, 'src', src, 1)
  check_rows(op, ys, 'ys', src, 'src', ys:size(1))
  check_rows(op, ys, 'ys', dest)
  if w.device ~= ys.device or w:size(1) ~= dest:size(1) or w:size(2) ~= dest:size(2) then
    raise(string.format('moe_combine: w is %s on %s but dest is %s on %s (w must be like dest, on ys\'s device)',
      shape_str(w.shape), w.device, shape_str(dest.shape), dest.device))
  end
  local out = empty({dest:size(1), ys:size(2)}, ys.dtype, ys.device, op)
  K.moe_combine(out, ys:contiguous(), as(dest, 'i32'), as(w, ys.dtype))
  return out
end
doc(gp.moe_combine, 'gp.moe_combine(ys, w, dest, src)',
  'ys (S, C) -> (N, C): out[n] = sum_j w[n,j] * ys[dest[n,j]] (dropped assignments left out); differentiable in ys and w (src is used by the backward)')

autograd.def_function('moe_combine', function(g, a)
  local ys, w, dest, src = a[1], a[2], a[3], a[4]
  local dout = as(g[1], ys.dtype)
  local dys, dw
  if autograd.needs(ys) then
    dys = empty(ys.shape, ys.dtype, ys.device, 'moe_combine')
    K.moe_gather(dys, dout, as(src, 'i32'), as(w, ys.dtype))
  end
  if autograd.needs(w) then
    dw = empty(w.shape, ys.dtype, ys.device, 'moe_combine')
    K.moe_combine_dw(dw, dout, ys:contiguous(), as(dest, 'i32'))
  end
  return dys, dw
end)

---------------------------------------------------------------------------
-- auxiliary losses

function gp.moe_aux_loss(probs, counts, k)
  local op = 'moe_aux_loss'
  need_float(op, 'probs', probs, 2)
  need(op, 'counts', counts, 1)
  need_int(op, 'k', k)
  local N, E = probs:size(1), probs:size(2)
  if counts:size(1) ~= E then
    raise(string.format('moe_aux_loss: probs is %s but counts is %s', shape_str(probs.shape), shape_str(counts.shape)))
  end
  local f = tensor.to_dtype(counts, probs.dtype) / math.max(1, N * k)
  return (probs:mean(1) * f):sum() * E
end
doc(gp.moe_aux_loss, 'gp.moe_aux_loss(probs, counts, k)',
  'the Switch Transformer load-balancing loss E * sum_i f_i * P_i: f_i = counts_i / (N k) the share of assignments (no gradient), P_i the mean router probability; 1 when balanced')

function gp.moe_z_loss(logits)
  need_float('moe_z_loss', 'logits', logits, 2)
  local l = tensor.to_dtype(logits, rdt(logits))
  local m = gp.no_grad(function() return (l:max(2, {keepdim = true})) end)
  local lse = (l - m):exp():sum(2, {keepdim = true}):log() + m
  return (lse * lse):mean()
end
doc(gp.moe_z_loss, 'gp.moe_z_loss(logits)', 'the router z-loss: mean over tokens of logsumexp(logits)^2 (ST-MoE)')

---------------------------------------------------------------------------
-- the whole layer

-- slots per expert: opts.capacity_factor -> ceil(cf * N k / E); else
-- dropless: N when N <= 64 (no host read: decoding), else the largest
-- count (one small device-to-host read) rounded up to a multiple of 8
local function capacity(opts, ids, N, E, k)
  local cf = opts.capacity_factor
  if cf then
    if type(cf) ~= 'number' or not (cf > 0) then raise('moe_ffn: capacity_factor must be a positive number') end
    return math.min(N, math.max(1, math.ceil(cf * N * k / E)))
  end
  if N <= 64 then return N end
  local m = gp.moe_histogram(ids, E):max():item()
  return math.min(N, math.max(8, math.ceil(m / 8) * 8))
end

function gp.moe_ffn(x, router_w, w1, w2, w3, opts)
  local op = 'moe_ffn'
  opts = opts or {}
  if type(opts) ~= 'table' then raise(op .. ': opts must be a table') end
  need_float(op, 'x', x, 2)
  need_float(op, 'router_w', router_w, 2)
  need_float(op, 'w1', w1, 3)
  need_float(op, 'w2', w2, 3)
  local act = opts.act or (w3 and 'swiglu' or 'gelu')
  if act ~= 'swiglu' and act ~= 'gelu' then raise("moe_ffn: act must be 'swiglu' or 'gelu', got " .. tostring(act)) end
  if act == 'swiglu' then need_float(op, 'w3', w3, 3) end
  local N, C = x:size(1), x:size(2)
  local E, H = w1:size(1), w1:size(3)
  local bad = router_w:size(1) ~= E or router_w:size(2) ~= C or w1:size(2) ~= C or w2:size(1) ~= E or
    w2:size(2) ~= H or w2:size(3) ~= C or (act == 'swiglu' and shape_str(w3.shape) ~= shape_str(w1.shape))
  if bad then
    raise(string.format('moe_ffn: x %s, router_w %s, w1 %s, w2 %s%s: need router_w (E, C), w1 and w3 (E, C, H), w2 (E, H, C)',
      shape_str(x.shape), shape_str(router_w.shape), shape_str(w1.shape), shape_str(w2.shape),
      act == 'swiglu' and (', w3 ' .. shape_str(w3.shape)) or ''))
  end
  local k = opts.k or 2
  need_int(op, 'k', k)
  if k > E then raise(string.format('moe_ffn: k = %d is more than the %d experts', k, E)) end
  local logits = gp.linear(x, router_w)
  local w, ids, probs = gp.moe_router(logits, k, {renorm = opts.renorm})
  local cap = capacity(opts, ids, N, E, k)
  local dest, src, counts = gp.moe_permute(ids, E, cap)
  local xs = gp.moe_gather(x, src, dest):view {E, cap, C}
  local h
  if act == 'swiglu' then h = gp.swiglu(xs:matmul(w1), xs:matmul(w3))
  else h = xs:matmul(w1):gelu_tanh() end
  local ys = h:matmul(w2):view {E * cap, C}
  local out = gp.moe_combine(ys, w, dest, src)
  return out, {logits = logits, weights = w, ids = ids, probs = probs, counts = counts, dest = dest, src = src,
               cap = cap, k = k, experts = E}
end
doc(gp.moe_ffn, "gp.moe_ffn(x, router_w, w1, w2, w3, {k=2, act='swiglu'|'gelu', capacity_factor=nil, renorm=(k > 1)})",
  'a Mixture-of-Experts FFN on x (N, C): router_w (E, C), experts w1, w3 (E, C, H) and w2 (E, H, C) (w3 nil for gelu); tokens routed to their top-k experts, grouped into E padded groups of cap rows (capacity_factor: cap = ceil(cf N k / E), the rest dropped; else dropless), three batched GEMMs, the weighted combine. Returns out (N, C) and info {logits, weights, ids, probs, counts, dest, src, cap}')

return gp
