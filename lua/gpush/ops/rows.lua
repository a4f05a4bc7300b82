-- Per-row ops: t:softmax(d), t:log_softmax(d), gp.layer_norm, gp.rms_norm
-- (kernels/rows.*). The kernels work on the contiguous last dim; another dim
-- is moved last (transpose + contiguous) and the result moved back.
return function(gp, tensor)
  local core = require 'gpush.core'
  local raise, empty, Tensor, shape_str = core.raise, tensor.empty, tensor.Tensor, tensor.shape_str
  local K = tensor.K
  local FLOAT = {f32 = true, bf16 = true, f16 = true, f64 = true}

  local function need(x, op, name)
    if not tensor.is_tensor(x) then raise(string.format('%s: %s must be a tensor, got %s', op, name, type(x))) end
    if x:dim() == 0 then raise(string.format('%s: %s is 0-dim; at least one dim is needed', op, name)) end
  end
  local function floatc(x) return (FLOAT[x.dtype] and x or tensor.to_dtype(x, 'f32')):contiguous() end

  local function def(name)
    Tensor[name] = function(x, d)
      need(x, name, 'x')
      local n = x:dim()
      local d0 = tensor.dim0(x, d or -1, name) + 1
      local src = d0 == n and x or x:transpose(d0, n)
      src = floatc(src)
      local out = empty(src.shape, src.dtype, src.device, name)
      K[name](out, src)
      if d0 ~= n then out = out:transpose(d0, n) end
      return out
    end
    gp[name] = function(x, d) return Tensor[name](x, d) end
    gp.doc(Tensor[name], 't:' .. name .. '(d=-1)', name .. ' over dim d (f32 math; the last dim is the fast one)')
    gp.doc(gp[name], 'gp.' .. name .. '(x, d=-1)', 'the same as x:' .. name .. '(d)')
  end
  def('softmax')
  def('log_softmax')

  -- w (and b) must be 1-d of size D, on x's device; they take x's dtype
  local function param(p, x, op, name, D)
    if not tensor.is_tensor(p) then raise(string.format('%s: %s must be a tensor, got %s', op, name, type(p))) end
    if p.device ~= x.device then
      raise(string.format('%s: %s is on %s but x is on %s (move one with :to())', op, name, p.device, x.device))
    end
    if p:dim() ~= 1 or p:size(1) ~= D then
      raise(string.format('%s: %s is %s but x is %s (%s must be (%d))', op, name, shape_str(p.shape), shape_str(x.shape), name, D))
    end
    return tensor.to_dtype(p, x.dtype):contiguous()
  end
  tensor.norm_param = param

  local function lead(x) local s = x.shape; s[#s] = nil; return s end

  function gp.layer_norm(x, w, b, eps)
    need(x, 'layer_norm', 'x')
    x = floatc(x)
    local D = x:size(-1)
    w = w and param(w, x, 'layer_norm', 'w', D) or gp.ones({D}, {dtype = x.dtype, device = x.device})
    b = b and param(b, x, 'layer_norm', 'b', D) or gp.zeros({D}, {dtype = x.dtype, device = x.device})
    local out = empty(x.shape, x.dtype, x.device, 'layer_norm')
    local mean = empty(lead(x), 'f32', x.device, 'layer_norm')
    local rstd = empty(lead(x), 'f32', x.device, 'layer_norm')
    K.layer_norm(out, mean, rstd, x, w, b, eps or 1e-5)
    return out, mean, rstd
  end
  gp.doc(gp.layer_norm, 'gp.layer_norm(x, w, b, eps=1e-5)',
    'LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * w + b (w, b may be nil); also returns the saved mean and rstd (f32)')

  function gp.rms_norm(x, w, eps)
    need(x, 'rms_norm', 'x')
    x = floatc(x)
    local D = x:size(-1)
    w = w and param(w, x, 'rms_norm', 'w', D) or gp.ones({D}, {dtype = x.dtype, device = x.device})
    local out = empty(x.shape, x.dtype, x.device, 'rms_norm')
    local rstd = empty(lead(x), 'f32', x.device, 'rms_norm')
    K.rms_norm(out, rstd, x, w, eps or 1e-5)
    return out, rstd
  end
  gp.doc(gp.rms_norm, 'gp.rms_norm(x, w, eps=1e-5)',
    'RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * w (w may be nil); also returns the saved rstd (f32)')
end
