-- random ops: dropout and multinomial, from the Philox generator (gp.manual_seed).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local raise = rt.raise
local Tensor, is_tensor, empty, shape_str = tensor.Tensor, tensor.is_tensor, tensor.empty, tensor.shape_str
local doc = gp.doc

function gp.dropout(x, p)
  if not is_tensor(x) then raise('dropout: x must be a tensor') end
  p = p or 0.5
  if type(p) ~= 'number' or not (p >= 0 and p <= 1) then raise('dropout: p must be a number in [0, 1], got ' .. tostring(p)) end
  local xc = x:contiguous()
  local out = empty(x.shape, x.dtype, x.device, 'dropout')
  local mask = empty(x.shape, 'u8', x.device, 'dropout')
  gp.k.dropout(out, mask, xc, p)
  return out, mask
end
doc(gp.dropout, 'gp.dropout(x, p=0.5)',
  'out, mask: mask = (u >= p) with u as gp.rand would draw it, out = x * mask / (1 - p); mask is u8 (for the backward)')

function gp.multinomial(probs, n)
  if not is_tensor(probs) then raise('multinomial: probs must be a tensor') end
  if n ~= nil and n ~= 1 then raise('multinomial: one draw per row is supported, got ' .. tostring(n)) end
  local d = probs:dim()
  if d ~= 1 and d ~= 2 then raise('multinomial: probs must be 1-d or 2-d (rows, categories), got ' .. shape_str(probs.shape)) end
  local p2 = probs:contiguous()
  if d == 1 then p2 = p2:view {1, probs:size(1)} end
  local out = empty({p2:size(1)}, 'i64', probs.device, 'multinomial')
  gp.k.multinomial(out, p2)
  return out
end
doc(gp.multinomial, 'gp.multinomial(probs)',
  'one 0-based category per row of non-negative weights probs (V) or (N, V): i64 (1) or (N)')
Tensor.multinomial = gp.multinomial

---------------------------------------------------------------------------
-- dropout: out = x * mask / (1 - p)

autograd.def_function('dropout', function(g, a, o)
  local p = a[2] or 0.5
  if p >= 1 then return gp.zeros_like(a[1]) end
  return g[1] * o[2] * (1 / (1 - p))
end, {nout = 1})

return gp
