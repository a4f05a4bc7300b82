-- Autograd rules of the op families: reductions (reduce.lua), per-row ops
-- (rows.lua), fused ops (fused.lua), matrix products (matmul.lua), index ops
-- (index.lua), cross-entropy (loss.lua) and dropout (random.lua).
-- Each rule(g, args, outs, saved) returns one gradient per argument (see
-- autograd.lua); the rules run under no_grad and use the backward kernels
-- where there are some (softmax_backward, layer_norm_backward, ...).
local core = require 'gpush.core'
local tensor = require 'gpush.tensor'
local is_tensor, empty, raise, shape_str = tensor.is_tensor, tensor.empty, core.raise, tensor.shape_str
local K = tensor.K
local FLOAT = {f32 = true, bf16 = true, f16 = true, f64 = true}

return function(A)
  local M, F = A.def_method, A.def_function
  local function gpmod() return require 'gpush' end
  local function floatc(x) return (FLOAT[x.dtype] and x or tensor.to_dtype(x, 'f32')):contiguous() end
  local function like(t, x) return tensor.to_dtype(t, x.dtype):contiguous() end

  -- a leaf's existing .grad that a kernel can accumulate into (a GEMM with
  -- beta = 1, a norm backward with accumulate = 1), as accumulate's add_
  -- would: saves a launch and a pass over the gradient
  local function grad_buffer(p, dt, dev)
    if rawget(p, '_node') then return nil end
    local gr = rawget(p, 'grad')
    if gr and gr.dtype == dt and gr.device == dev and gr:is_contiguous() and shape_str(gr.shape) == shape_str(p.shape) then
      return gr
    end
  end

  ---------------------------------------------------------------------------
  -- reductions: x:op(d, {keepdim=}) or x:op{keepdim=}

  local function red_args(a) return tensor.reduce_opts(a[2], a[3]) end

  -- a reduced gradient g back to a (broadcast) view of x's shape
  local function unreduce(g, x, d, keepdim)
    local s = x.shape
    if d == nil then
      local ones = {}
      for i = 1, #s do ones[i] = 1 end
      return g:reshape(ones):expand(s)
    end
    if not keepdim then g = g:unsqueeze(d) end
    return g:expand(s)
  end
  local function count(x, d) return d == nil and x:numel() or x:size(d) end

  M('sum', function(g, a)
    local d, o = red_args(a)
    return unreduce(g[1], a[1], d, o.keepdim)
  end)
  M('mean', function(g, a)
    local d, o = red_args(a)
    return unreduce(g[1] / count(a[1], d), a[1], d, o.keepdim)
  end)

  -- max/min: the gradient goes to the (first) arg-extremum
  local function extremum(arg)
    return function(g, a, o)
      local x = a[1]
      local d, opts = red_args(a)
      local z = gpmod().zeros_like(x)
      if d == nil then
        local idx = x[arg](x)
        return z:view {x:numel()}:scatter_add(1, idx:reshape {1}, g[1]:reshape {1}):view(x.shape)
      end
      local idx, gv = o[2], g[1]
      if not opts.keepdim then idx, gv = idx:unsqueeze(d), gv:unsqueeze(d) end
      return z:scatter_add(d, idx, gv)
    end
  end
  M('max', extremum('argmax'))
  M('min', extremum('argmin'))

  M('var', function(g, a)
    local x = a[1]
    local d, o = red_args(a)
    local corr = o.correction
    if corr == nil then corr = o.unbiased == false and 0 or 1 end
    local mu = d == nil and x:mean() or x:mean(d, {keepdim = true})
    return unreduce(g[1], x, d, o.keepdim) * (x - mu) * (2 / (count(x, d) - corr))
  end)
  -- t:std is t:var(...):sqrt(), differentiated through both

  M('norm', function(g, a, out)
    local x, p, d, o = a[1], a[2], a[3], a[4]
    if type(p) == 'table' then p, d, o = nil, nil, p end
    if type(d) == 'table' and not is_tensor(d) then d, o = nil, d end
    o = o or {}
    p = p or 2
    if p == 'inf' then p = math.huge end
    local gp = gpmod()
    if p == 0 then return gp.zeros_like(x) end
    local gb = unreduce(g[1], x, d, o.keepdim)
    local nb = unreduce(out[1], x, d, o.keepdim)
    local sign = gp.where(x:ge(0), 1, -1)
    local dx
    if p == math.huge then -- shared evenly between the elements at the max
      local m = x:abs():eq(nb):to(x.dtype)
      local cnt = d == nil and m:sum() or m:sum(d, {keepdim = true})
      dx = gb * sign * m / cnt
    elseif p == 1 then
      dx = gb * sign
    else
      dx = gb * sign * x:abs() ^ (p - 1) / nb ^ (p - 1)
    end
    return gp.where(nb:eq(0), 0, dx)
  end)

  -- cumsum's adjoint: the reversed running sum (flip, cumsum, flip)
  M('cumsum', function(g, a)
    local x, d = a[1], a[2]
    local gp = gpmod()
    local gg, dd = g[1], d or 1
    local n = gg:size(dd)
    if n == 0 then return gp.zeros_like(x) end
    local rev = gp.arange(n - 1, -1, -1, {device = gg.device})
    local r = gg:index_select(dd, rev):cumsum(dd):index_select(dd, rev)
    return r:reshape(x.shape)
  end)

  ---------------------------------------------------------------------------
  -- softmax and log_softmax through their backward kernels

  local function rows_backward(kname)
    return function(g, a, o)
      local x, y, dy = a[1], o[1], g[1]
      local n = x:dim()
      local d0 = tensor.dim0(x, a[2] or -1, kname) + 1
      if d0 ~= n then y, dy = y:transpose(d0, n), dy:transpose(d0, n) end
      y = y:contiguous()
      dy = like(dy, y)
      local dx = empty(y.shape, y.dtype, y.device, kname)
      K[kname](dx, y, dy)
      if d0 ~= n then dx = dx:transpose(d0, n) end
      return dx
    end
  end
  M('softmax', rows_backward('softmax_backward'))
  M('log_softmax', rows_backward('log_softmax_backward'))

  ---------------------------------------------------------------------------
  -- norms: the forward returns out and its saved statistics; only out is
  -- differentiable (the statistics come back detached) and the rule reads the
  -- statistics from the node

  local function norm_w(w, x, D)
    if w then return like(w, x) end
    return gpmod().ones({D}, {dtype = x.dtype, device = x.device})
  end

  -- dw (and db when has_b) for a norm backward over x's last dim D: the .grad
  -- of w (b) where the kernel can add into it, else a new tensor; with either
  -- .grad taken the kernel accumulates (accumulate = 1) and the other output
  -- is a zeroed scratch. Returns dw, db, accumulate and the gradients for the
  -- rule to return (nil where the kernel added into .grad)
  local function norm_outs(x, D, op, w, b, has_b)
    local gw = w and A.needs(w) and grad_buffer(w, x.dtype, x.device)
    local gb = has_b and b and A.needs(b) and grad_buffer(b, x.dtype, x.device)
    local acc = (gw or gb) and 1 or 0
    local function out(buf)
      if buf then return buf end
      local t = empty({D}, x.dtype, x.device, op)
      if acc == 1 then t:zero_() end
      return t
    end
    local dw, db = out(gw), has_b and out(gb) or nil
    return dw, db, acc, (w and not gw) and dw or nil, (b and not gb) and db or nil
  end

  F('layer_norm', function(g, a, o)
    local x, w, b = floatc(a[1]), a[2], a[3]
    local D = x:size(-1)
    local dx = empty(x.shape, x.dtype, x.device, 'layer_norm')
    local dw, db, acc, rw, rb = norm_outs(x, D, 'layer_norm', w, b, true)
    K.layer_norm_backward(dx, dw, db, x, norm_w(w, x, D), o[2], o[3], like(g[1], x), acc)
    return dx, rw, rb
  end, {nout = 1})

  F('rms_norm', function(g, a, o)
    local x, w = floatc(a[1]), a[2]
    local D = x:size(-1)
    local dx = empty(x.shape, x.dtype, x.device, 'rms_norm')
    local dw, _, acc, rw = norm_outs(x, D, 'rms_norm', w)
    K.rms_norm_backward(dx, dw, x, norm_w(w, x, D), o[2], like(g[1], x), acc)
    return dx, rw
  end, {nout = 1})

  -- add_rms_norm: h = x + res (returned as res_out), out = rms_norm(h) * w
  F('add_rms_norm', function(g, a, o)
    local w = a[3]
    local h = o[2]
    local dh, rw = g[2], nil
    if g[1] then
      local D = h:size(-1)
      local dx = empty(h.shape, h.dtype, h.device, 'add_rms_norm')
      local dw, _, acc
      dw, _, acc, rw = norm_outs(h, D, 'add_rms_norm', w)
      K.rms_norm_backward(dx, dw, h, norm_w(w, h, D), o[3], like(g[1], h), acc)
      dh = dh and dx + dh or dx
    end
    return dh, dh, rw
  end, {nout = 2})

  F('swiglu', function(g, a)
    local gate = floatc(a[1])
    local up = like(a[2], gate)
    local dgate = empty(gate.shape, gate.dtype, gate.device, 'swiglu')
    local dup = empty(gate.shape, gate.dtype, gate.device, 'swiglu')
    K.swiglu_backward(dgate, dup, gate, up, like(g[1], gate))
    return dgate, dup
  end)

  -- bias_gelu: out = gelu(x + b); db sums the pre-activation gradient over rows
  F('bias_gelu', function(g, a)
    local x = floatc(a[1])
    local D = x:size(-1)
    local pre = x + like(a[2], x)
    local dpre = empty(x.shape, x.dtype, x.device, 'bias_gelu')
    K.gelu_bwd(dpre, pre, like(g[1], x))
    return dpre, dpre:view {x:numel() / math.max(D, 1), D}:sum(1)
  end)

  ---------------------------------------------------------------------------
  -- matrix products: y = alpha * A @ B (+ bias), with A, B of 1 to 3 dims
  -- (a 2-d operand broadcast over the other's batch, or a batch of 1)

  -- gradients of the effective operands A and B (as multiplied) from g
  local function mm_grads(g, Aop, Bop, alpha, needA, needB)
    if alpha ~= 1 then g = g * alpha end
    local A2, B2, g2 = Aop, Bop, g
    if Aop:dim() == 1 then A2 = Aop:unsqueeze(1); g2 = g2:unsqueeze(-2) end
    if Bop:dim() == 1 then B2 = Bop:unsqueeze(2); g2 = g2:unsqueeze(-1) end
    local dA, dB
    if needA then
      dA = g2:matmul(B2:transpose(-1, -2)) -- 2x2, 3x3 (broadcast), 3x2, 3x3 for 2-d A (summed by accumulate)
      if Aop:dim() == 1 then dA = dA:reshape(Aop.shape) end
    end
    if needB then
      if A2:dim() == 3 and B2:dim() == 2 then -- one GEMM over every row of the batch
        local s = A2.shape
        local rows = s[1] * s[2]
        dB = A2:reshape {rows, s[3]}:t():matmul(g2:reshape {rows, g2:size(-1)})
      else
        dB = A2:transpose(-1, -2):matmul(g2)
      end
      if Bop:dim() == 1 then dB = dB:reshape(Bop.shape) end
    end
    return dA, dB
  end

  local function bias_grad(g)
    local N = g:size(-1)
    return g:reshape {g:numel() / math.max(N, 1), N}:sum(1)
  end

  M('matmul', function(g, a)
    return mm_grads(g[1], a[1], a[2], 1, A.needs(a[1]), A.needs(a[2]))
  end)

  F('matmul', function(g, a, out)
    local x, y, o = a[1], a[2], a[3] or {}
    local gy = g[1]
    if o.act then -- recompute the pre-activation (the forward kept only gelu's output)
      local pre = gpmod().matmul(x, y, {bias = o.bias, trans_a = o.trans_a, trans_b = o.trans_b, tf32 = o.tf32})
      local d = empty(pre.shape, pre.dtype, pre.device, 'matmul')
      K.gelu_tanh_bwd(d, pre, like(gy, pre))
      gy = d
    end
    local Aop = o.trans_a and x:transpose(-1, -2) or x
    local Bop = o.trans_b and y:transpose(-1, -2) or y
    local dA, dB = mm_grads(gy, Aop, Bop, o.alpha or 1, A.needs(x), A.needs(y))
    if dA and o.trans_a then dA = dA:transpose(-1, -2) end
    if dB and o.trans_b then dB = dB:transpose(-1, -2) end
    local db
    if o.bias and A.needs(o.bias) then db = bias_grad(gy) end
    if db then return dA, dB, {bias = db} end
    return dA, dB
  end, {check = function(_, _, o)
    if type(o) == 'table' and (o.out ~= nil or (o.beta or 0) ~= 0) then
      raise('matmul: out= and beta are not differentiable (call it under gp.no_grad, or without out=)')
    end
  end})

  -- a cached ones vector (rows) for bias gradients as one GEMV into .grad; none
  -- is made while a graph is being captured (it would live in the graph's pool)
  local ones_cache = {}
  local function ones_col(rows, dt, dev)
    local key = rows .. dt .. dev
    local o = ones_cache[key]
    if not o and not require('gpush.graph').capturing then
      o = gpmod().ones({rows}, {dtype = dt, device = dev})
      ones_cache[key] = o
    end
    return o
  end

  -- the gradient of a weight w (out, in) of a product g2 = x2 w^T, g2 (rows,
  -- out), x2 (rows, in): g2^T x2 accumulated into w.grad by the GEMM (nil
  -- returned) where there is one to accumulate into, else returned
  local function weight_grad(w, g2, x2)
    if not A.needs(w) then return nil end
    local gw = x2.dtype == g2.dtype and grad_buffer(w, g2.dtype, g2.device)
    if gw then gpmod().matmul(g2:t(), x2, {out = gw, beta = 1}); return nil end
    return g2:t():matmul(x2)
  end

  -- the gradient of a bias b (out) from g2 (rows, out), the same way
  local function bias_grad_into(b, g2)
    if not (b and A.needs(b)) then return nil end
    local gb = grad_buffer(b, g2.dtype, g2.device)
    local ones = gb and ones_col(g2:size(1), g2.dtype, g2.device)
    if ones then -- db += g2^T 1: one GEMV instead of a column sum and an add
      gpmod().matmul(g2:t(), ones, {out = gb, beta = 1, tf32 = g2.dtype == 'f32' and false or nil})
      return nil
    end
    return g2:sum(1)
  end

  -- gp.linear(x, w, b): x (..., in) @ w^T + b, w (out, in)
  F('linear', function(g, a)
    local x, w, b = a[1], a[2], a[3]
    local O, I = w:size(1), w:size(2)
    local rows = x:numel() / math.max(I, 1)
    local g2 = g[1]:reshape {rows, O}
    local dx
    if A.needs(x) then dx = g2:matmul(w):reshape(x.shape) end
    return dx, weight_grad(w, g2, x:reshape {rows, I}), bias_grad_into(b, g2)
  end)

  -- gp.linear_gelu_linear(x, w1, b1, w2, b2) = gelu_tanh(x w1^T + b1) w2^T + b2.
  -- The forward saves h (rows, hidden) and the pre-activation pre (the GEMM's
  -- GELU_AUX_BIAS epilogue); backward: dw2 = g^T h, db2, dpre = (g w2) *
  -- gelu_tanh'(pre) in one GEMM (DGELU epilogue), dw1 = dpre^T x, db1, dx = dpre w1.
  F('linear_gelu_linear', function(g, a, _, saved)
    local x, w1, b1, w2, b2 = a[1], a[2], a[3], a[4], a[5]
    local D, H, D2 = w1:size(2), w1:size(1), w2:size(1)
    local rows = x:numel() / math.max(D, 1)
    local g2 = tensor.to_dtype(g[1], x.dtype):reshape {rows, D2}
    local dw2, db2 = weight_grad(w2, g2, saved.h), bias_grad_into(b2, g2)
    local dx, dw1, db1
    if A.needs(x) or A.needs(w1) or A.needs(b1) then
      local dpre = empty({rows, H}, x.dtype, x.device, 'linear_gelu_linear')
      K.matmul_dgelu(dpre, g2, w2, saved.aux)
      if A.needs(x) then dx = dpre:matmul(w1):reshape(x.shape) end
      dw1, db1 = weight_grad(w1, dpre, x:reshape {rows, D}), bias_grad_into(b1, dpre)
    end
    return dx, dw1, db1, dw2, db2
  end, {
    forward = function(_, x, w1, b1, w2, b2)
      local y, h, aux = gpmod()._linear_gelu_linear_saved(x, w1, b1, w2, b2)
      return {h = h, aux = aux}, y
    end,
  })

  ---------------------------------------------------------------------------
  -- index ops

  F('embedding', function(g, a)
    local w = a[1]
    return gpmod().embedding_backward(like(g[1], w), a[2], w:size(1))
  end)

  M('gather', function(g, a)
    local x, d, idx = a[1], a[2], a[3]
    return gpmod().zeros_like(x):scatter_add(d, idx, g[1])
  end)

  M('index_select', function(g, a)
    local x, d, idx = a[1], a[2], a[3]
    local d0 = tensor.dim0(x, d, 'index_select') + 1
    local vs = {}
    for i = 1, x:dim() do vs[i] = 1 end
    vs[d0] = idx:numel()
    local gi = g[1]
    return gpmod().zeros_like(x):scatter_add(d, idx:reshape(vs):expand(gi.shape), gi)
  end)

  M('scatter_add', function(g, a)
    local d, idx, src = a[2], a[3], a[4]
    return g[1], nil, nil, is_tensor(src) and A.needs(src) and g[1]:gather(d, idx) or nil
  end)

  ---------------------------------------------------------------------------
  -- cross_entropy: the fused kernel gives dlogits with the loss (saved by the
  -- forward); backward only scales it by the incoming gradient

  -- saved: dlogits, and for 'mean' without grad=true the count of rows the
  -- mean is over (dlogits then unscaled): one pass of dl * (upstream / count)
  -- over the (N, V) logits instead of a divide in forward and a multiply here
  F('cross_entropy', function(g, a, o, saved)
    local opts = type(a[3]) == 'table' and a[3] or {}
    local dl, cnt = saved[1], saved[2]
    local gl = g[1]
    if (opts.reduction or 'mean') == 'none' then gl = gl:unsqueeze(-1) end
    if cnt then gl = tensor.to_dtype(gl, 'f32') / cnt:view {} end
    return dl * tensor.to_dtype(gl, dl.dtype), nil, nil
  end, {
    nout = 1,
    forward = function(f, logits, targets, opts)
      if type(opts) ~= 'table' and opts ~= nil then return nil, f(logits, targets, opts) end -- f raises
      opts = opts or {}
      local o2 = {}
      for k, v in pairs(opts) do o2[k] = v end
      o2.grad = opts.grad and true or 'raw' -- grad = true: the caller gets the scaled dl too
      local loss, dl, cnt = f(logits, targets, o2)
      if opts.grad then return {dl}, loss, dl end
      return {dl, cnt}, loss
    end,
  })

  ---------------------------------------------------------------------------
  -- dropout: out = x * mask / (1 - p)

  F('dropout', function(g, a, o)
    local p = a[2] or 0.5
    if p >= 1 then return gpmod().zeros_like(a[1]) end
    return g[1] * o[2] * (1 / (1 - p))
  end, {nout = 1})

end
