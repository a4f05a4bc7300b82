-- Set diversity (kernels/diversity.*): gp.set_diversity (differentiable) and
-- gp.distinct_n, for set-level RL (lua/gpush/polychromic.lua).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local FLOAT = require('gpush.core.dtype').FLOAT
local raise, is_tensor, empty, shape_str = rt.raise, tensor.is_tensor, tensor.empty, tensor.shape_str
local K = tensor.K
local INDEX = {i32 = true, i64 = true}

local function eps_of(opts, op)
  if opts == nil then return 1e-8 end
  if type(opts) ~= 'table' then raise(op .. ': options must be a table like {eps=1e-8}') end
  local eps = opts and opts.eps or 1e-8
  if type(eps) ~= 'number' or not (eps > 0) then raise(op .. ': eps must be a number > 0, got ' .. tostring(eps)) end
  return eps
end

-- x (S, N, D) or (N, D) -> (S, N, D) contiguous float, S; the common case
-- (a contiguous float (S, N, D)) makes no new tensor
local function sets_of(x, op)
  if not is_tensor(x) then raise(op .. ': x must be a tensor of embeddings (S, N, D) or (N, D), got ' .. type(x)) end
  local nd = x.c.ndim
  if nd ~= 2 and nd ~= 3 then
    raise(string.format('%s: x must be (S sets, N, D) or (N, D), got %s', op, shape_str(x.shape)))
  end
  if not FLOAT[x.dtype] then x = tensor.to_dtype(x, 'f32') end
  x = x:contiguous()
  if nd == 2 then x = x:view {1, tonumber(x.c.shape[0]), tonumber(x.c.shape[1])} end
  return x, tonumber(x.c.shape[0])
end

function gp.set_diversity(x, opts)
  local eps = eps_of(opts, 'set_diversity')
  local x3, S = sets_of(x, 'set_diversity')
  local out = empty({S}, x3.dtype, x3.device, 'set_diversity')
  K.set_diversity(out, x3, eps)
  return x.c.ndim == 2 and out:view {} or out
end
gp.doc(gp.set_diversity, 'gp.set_diversity(x, {eps=1e-8})',
  'mean pairwise cosine distance 1 - cos(x_i, x_j) over the pairs i < j of each set: x (S, N, D) -> (S), or (N, D) -> a 0-dim tensor; one launch for all sets, f32 accumulation, output in x\'s dtype; differentiable')

-- the gradient of set_diversity: dout (S) (or 0-dim for an (N, D) x) -> dx like x
function gp.set_diversity_backward(x, dout, opts)
  local eps = eps_of(opts, 'set_diversity_backward')
  local x3, S = sets_of(x, 'set_diversity_backward')
  if not is_tensor(dout) or dout:numel() ~= S then
    raise(string.format('set_diversity_backward: dout must hold one value per set (%d), got %s', S,
      is_tensor(dout) and shape_str(dout.shape) or type(dout)))
  end
  if dout.c.device ~= x3.c.device then
    raise(string.format('set_diversity_backward: dout is on %s but x is on %s', dout.device, x3.device))
  end
  local d = tensor.to_dtype(dout, x3.dtype):contiguous()
  if d.c.ndim ~= 1 then d = d:view {S} end
  local dx = empty(x3.shape, x3.dtype, x3.device, 'set_diversity_backward')
  K.set_diversity_backward(dx, x3, d, eps)
  return x.c.ndim == 3 and dx or dx:view(x.shape)
end
gp.doc(gp.set_diversity_backward, 'gp.set_diversity_backward(x, dout, {eps=1e-8})',
  'dx = dout[s] * d set_diversity(x)[s] / dx (what the autograd rule of gp.set_diversity runs)')

-- tokens (S, N, L) ids, lens (S, N) valid lengths (default: all L) -> (S) f32
function gp.distinct_n(tokens, lens, n)
  if not is_tensor(tokens) or not INDEX[tokens.dtype] or (tokens:dim() ~= 3 and tokens:dim() ~= 2) then
    raise('distinct_n: tokens must be an i64 (or i32) tensor (S sets, N sequences, L) or (N, L), got ' ..
      (is_tensor(tokens) and (tokens.dtype .. ' ' .. shape_str(tokens.shape)) or type(tokens)))
  end
  local two = tokens:dim() == 2
  local t3 = tokens:contiguous()
  if two then t3 = t3:view {1, t3:size(1), t3:size(2)} end
  local S, N, L = t3:size(1), t3:size(2), t3:size(3)
  if lens == nil then
    lens = gp.full({S, N}, L, {dtype = 'i64', device = t3.device})
  elseif not is_tensor(lens) or not INDEX[lens.dtype] or lens:numel() ~= S * N then
    raise(string.format('distinct_n: lens must be an index tensor of %d lengths (%s), got %s', S * N,
      shape_str(two and {N} or {S, N}), is_tensor(lens) and (lens.dtype .. ' ' .. shape_str(lens.shape)) or type(lens)))
  end
  if lens.device ~= t3.device then raise(string.format('distinct_n: lens is on %s but tokens are on %s', lens.device, t3.device)) end
  local out = empty({S}, 'f32', t3.device, 'distinct_n')
  K.distinct_n(out, t3, lens:contiguous():view {S, N}, n or 2)
  return two and out:view {} or out
end
gp.doc(gp.distinct_n, 'gp.distinct_n(tokens, lens=nil, n=2)',
  'distinct n-grams / all n-grams over the N sequences of each set: tokens (S, N, L) ids, lens (S, N) valid lengths (default L) -> (S) f32; (N, L) -> 0-dim')

-- autograd: the kernel's exact gradient
autograd.def_function('set_diversity', function(g, a)
  return gp.set_diversity_backward(a[1], g[1], a[2])
end, {check = function(x)
  if is_tensor(x) and not FLOAT[x.dtype] then raise('set_diversity: x must be a float tensor to differentiate') end
end})

return gp
