-- Rotary position embeddings (kernels/rope.*): gp.rope(x, pos, inv_freq) turns
-- each head of x (..., T, H, D) by pos[t] * inv_freq[i] in the planes of dims
-- (i, i + D/2), as Hugging Face's Llama applies it to q and k;
-- gp.rope_inv_freq(head_dim, {theta=, scaling=}) gives the frequencies,
-- with the linear and llama3 scalings of config.json's rope_scaling.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local common = require 'gpush.core.ops.common'
local raise, empty, is_tensor, shape_str = rt.raise, tensor.empty, tensor.is_tensor, tensor.shape_str
local K = tensor.K
local FLOAT = require('gpush.core.dtype').FLOAT

-- positions: a tensor of T i32/i64 ids, or a number: start, start + 1, ...
local function positions(pos, T, device)
  if type(pos) == 'number' then
    if pos ~= math.floor(pos) or pos < 0 then raise('rope: the start position must be an integer >= 0, got ' .. pos) end
    return gp.arange(pos, pos + T, {dtype = 'i64', device = device})
  end
  if not is_tensor(pos) or (pos.dtype ~= 'i64' and pos.dtype ~= 'i32') then
    raise('rope: pos must be a number or an i32/i64 tensor of positions')
  end
  return pos
end

function gp.rope(x, pos, inv_freq)
  if not is_tensor(x) or x:dim() < 3 then
    raise('rope: x must be a tensor (..., T, H, D), got ' .. (is_tensor(x) and shape_str(x.shape) or type(x)))
  end
  if not is_tensor(inv_freq) then raise('rope: inv_freq must be a tensor (gp.rope_inv_freq)') end
  -- a strided view (the q or k heads of a fused product's output) is read as it is: the kernel takes any strides
  -- but the last dim's
  if not FLOAT[x.dtype] then x = tensor.to_dtype(x, 'f32') end
  if x:stride(-1) ~= 1 then x = x:contiguous() end
  local T = x:size(-3)
  local p = positions(pos, T, x.device)
  if inv_freq.device ~= x.device or inv_freq.dtype ~= 'f32' then inv_freq = inv_freq:to {dtype = 'f32', device = x.device} end
  local out = empty(x.shape, x.dtype, x.device, 'rope')
  K.rope(out, x, p, inv_freq:contiguous(), 1)
  return out
end
gp.doc(gp.rope, 'gp.rope(x, pos, inv_freq)',
  'x (..., T, H, D) with each head turned by pos[t] * inv_freq[i] in the plane of dims i and i + D/2 (the Llama layout); ' ..
  'pos an i32/i64 tensor of T positions or the first position (a number); differentiable in x')

autograd.def_function('rope', function(g, a)
  local x, inv_freq = a[1], a[3]
  local p = positions(a[2], x:size(-3), x.device)
  local gx = common.like(g[1], x)
  local dx = empty(gx.shape, gx.dtype, gx.device, 'rope')
  K.rope(dx, gx, p, inv_freq:to {dtype = 'f32', device = gx.device}:contiguous(), -1)
  return dx
end)

-- frequencies 1 / theta^(2i / D), i = 0 .. D/2 - 1, then the scaling:
-- {type = 'linear', factor = f} divides them by f; {type = 'llama3', factor,
-- low_freq_factor, high_freq_factor, original_max_position_embeddings}
-- divides the low frequencies by factor and blends the middle band (as
-- transformers' _compute_llama3_parameters does)
function gp.rope_inv_freq(head_dim, opts)
  opts = opts or {}
  if type(head_dim) ~= 'number' or head_dim < 2 or head_dim % 2 ~= 0 then
    raise('rope_inv_freq: the head dim must be an even number >= 2, got ' .. tostring(head_dim))
  end
  local theta = opts.theta or 10000
  local f = {}
  for i = 0, head_dim / 2 - 1 do f[i + 1] = 1 / theta ^ (2 * i / head_dim) end
  local sc = opts.scaling
  local kind = sc and (sc.rope_type or sc.type) or 'default'
  if kind == 'linear' then
    for i = 1, #f do f[i] = f[i] / sc.factor end
  elseif kind == 'llama3' then
    local factor, lo, hi, old = sc.factor, sc.low_freq_factor, sc.high_freq_factor, sc.original_max_position_embeddings
    if not (factor and lo and hi and old) then
      raise('rope_inv_freq: llama3 scaling needs factor, low_freq_factor, high_freq_factor and original_max_position_embeddings')
    end
    local lo_wave, hi_wave = old / lo, old / hi
    for i = 1, #f do
      local wave = 2 * math.pi / f[i]
      if wave > lo_wave then
        f[i] = f[i] / factor
      elseif wave >= hi_wave then -- the middle band: a blend of scaled and unscaled
        local s = (old / wave - lo) / (hi - lo)
        f[i] = (1 - s) * f[i] / factor + s * f[i]
      end
    end
  elseif kind ~= 'default' then
    raise(string.format("rope_inv_freq: rope scaling type '%s' is not supported (linear, llama3)", tostring(kind)))
  end
  return gp.tensor(f, {dtype = 'f32', device = opts.device})
end
gp.doc(gp.rope_inv_freq, "gp.rope_inv_freq(head_dim, {theta=10000, scaling={type='linear'|'llama3', factor=, ...}, device=})",
  'the f32 (head_dim / 2) rotary frequencies 1 / theta^(2i / head_dim), scaled as config.json\'s rope_scaling says')

return gp
