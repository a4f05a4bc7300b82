-- select ops: topk and sort (values and 0-based i64 indices). Ties go to the
-- lower index; NaN counts as larger than every number.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local raise = rt.raise
local Tensor, empty, dim0 = tensor.Tensor, tensor.empty, tensor.dim0
local doc = gp.doc

-- run f on x with dim d0 moved last; the results moved back
local function along(x, d0, f)
  local last = x:dim() - 1
  if d0 == last then return f(x:contiguous()) end
  local v, i = f(x:transpose(d0 + 1, last + 1):contiguous())
  return v:transpose(d0 + 1, last + 1), i:transpose(d0 + 1, last + 1)
end

function Tensor:topk(k, dim)
  if type(k) ~= 'number' or k < 0 or k ~= math.floor(k) then raise('topk: k must be a non-negative integer, got ' .. tostring(k)) end
  if self:dim() == 0 then raise('topk: needs at least 1 dim') end
  local d0 = dim0(self, dim or -1, 'topk')
  return along(self, d0, function(x)
    local s = x.shape
    if k > s[#s] then
      raise(string.format('topk: k = %d is larger than the row (%d elements along dim %d of %s)', k, s[#s], d0 + 1,
        tensor.shape_str(self.shape)))
    end
    s[#s] = k
    local v = empty(s, x.dtype, x.device, 'topk')
    local i = empty(s, 'i64', x.device, 'topk')
    gp.k.topk(v, i, x)
    return v, i
  end)
end
doc(Tensor.topk, 't:topk(k[, dim=-1])', 'the k (<= 64) largest along dim, descending: values, indices (i64, 0-based; ties: lower index first)')

-- t:sort(), t:sort{descending=true, dim=-1}, t:sort(dim[, descending])
function Tensor:sort(a, b)
  local dim, desc = -1, false
  if type(a) == 'table' then dim, desc = a.dim or -1, a.descending and true or false
  elseif a ~= nil then dim, desc = a, b and true or false end
  if self:dim() == 0 then raise('sort: needs at least 1 dim') end
  local d0 = dim0(self, dim, 'sort')
  return along(self, d0, function(x)
    local v = empty(x.shape, x.dtype, x.device, 'sort')
    local i = empty(x.shape, 'i64', x.device, 'sort')
    gp.k.sort(v, i, x, desc and 1 or 0)
    return v, i
  end)
end
doc(Tensor.sort, 't:sort{descending=false, dim=-1}', 'values sorted along dim and their source indices (i64, 0-based; stable)')

return gp
