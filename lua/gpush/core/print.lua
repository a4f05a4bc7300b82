-- Printing tensors like PyTorch: nested brackets, values in a common format,
-- long dims summarized to their first and last 3 entries.
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'

local M = {threshold = 1000, edgeitems = 3, precision = 4}

local function fmt_values(vals, is_float)
  if not is_float then
    local r = {}
    for i, v in ipairs(vals) do r[i] = string.format('%d', v) end
    return r
  end
  local maxa, mina, allint = 0, math.huge, true
  for _, v in ipairs(vals) do
    if v == v and v ~= math.huge and v ~= -math.huge then
      local a = math.abs(v)
      if a > maxa then maxa = a end
      if a > 0 and a < mina then mina = a end
      if v ~= math.floor(v) then allint = false end
    end
  end
  local sci = maxa >= 1e8 or (mina < 1e-4 and not allint) or (mina ~= math.huge and maxa / mina > 1e6 and not allint)
  local r = {}
  for i, v in ipairs(vals) do
    if v ~= v then r[i] = 'nan'
    elseif v == math.huge then r[i] = 'inf'
    elseif v == -math.huge then r[i] = '-inf'
    elseif sci then r[i] = string.format('%.' .. M.precision .. 'e', v)
    elseif allint then r[i] = string.format('%.0f.', v)
    else r[i] = string.format('%.' .. M.precision .. 'f', v) end
  end
  return r
end

function M.format(t)
  local shape = t.shape
  local n = t:numel()
  local summarize = n > M.threshold
  local e = M.edgeitems
  -- cut long dims down to their edges
  local src, cut = t, {}
  if summarize then
    for d = 1, #shape do
      if shape[d] > 2 * e then
        src = gp.cat({src:narrow(d, 1, e), src:narrow(d, shape[d] - e + 1, e)}, d)
        cut[d] = true
      end
    end
  end
  local vals = {}
  if n > 0 then
    local buf, m = tensor.to_doubles(src)
    for i = 0, m - 1 do vals[i + 1] = buf[i] end
  end
  local strs = fmt_values(vals, t:is_floating_point())
  local w = 0
  for _, s in ipairs(strs) do if #s > w then w = #s end end
  local ss = src.shape
  local pos = 0
  local prefix = 'tensor('
  local function build(d, indent)
    if d > #ss then pos = pos + 1; return string.format('%' .. w .. 's', strs[pos]) end
    local items = {}
    for i = 1, ss[d] do
      items[#items + 1] = build(d + 1, indent .. ' ')
      if cut[d] and i == e then items[#items + 1] = '...' end
    end
    local sep = d == #ss and ', ' or (',' .. string.rep('\n', #ss - d) .. indent .. ' ')
    return '[' .. table.concat(items, sep) .. ']'
  end
  local body
  if #shape == 0 then body = strs[1] or '?'
  elseif n == 0 then body = '[]'
  else body = build(1, string.rep(' ', #prefix)) end
  -- autograd, as PyTorch shows it: a leaf that requires grad, or the op that made it
  local node, grad = rawget(t, '_node'), ''
  if node then grad = ', grad_fn=' .. tostring(node.name)
  elseif rawget(t, '_rg') then grad = ', requires_grad=true' end
  return string.format('%s%s, shape=%s, dtype=%s, device=%s%s)', prefix, body, tensor.shape_str(shape), t.dtype, t.device, grad)
end

tensor.mt.__tostring = M.format

return M
