-- suggest: "did you mean" for a mistyped name, by edit distance against the
-- real names (insertions, deletions, substitutions and swaps of two
-- neighbouring letters each cost 1).
local M = {}

-- the optimal-string-alignment distance between a and b, or a number above
-- limit as soon as it must exceed it
function M.distance(a, b, limit)
  limit = limit or math.huge
  local la, lb = #a, #b
  if math.abs(la - lb) > limit then return limit + 1 end
  local prev2, prev, cur = {}, {}, {}
  for j = 0, lb do prev[j] = j end
  for i = 1, la do
    cur[0] = i
    local best = i
    local ca = a:byte(i)
    for j = 1, lb do
      local cb = b:byte(j)
      local d = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca == cb and 0 or 1))
      if i > 1 and j > 1 and ca == b:byte(j - 1) and a:byte(i - 1) == cb then d = math.min(d, prev2[j - 2] + 1) end
      cur[j] = d
      if d < best then best = d end
    end
    if best > limit then return limit + 1 end
    prev2, prev, cur = prev, cur, prev2
  end
  return prev[lb]
end

-- the names among `names` (a list, or a table whose string keys are the
-- names) closest to `name`: at most 3, nearest first; names that differ
-- only in case count as distance 0
function M.closest(name, names)
  if type(name) ~= 'string' then return {} end
  local list = {}
  if names[1] ~= nil then
    for _, n in ipairs(names) do list[#list + 1] = n end
  else
    for n in pairs(names) do if type(n) == 'string' then list[#list + 1] = n end end
  end
  local limit = #name <= 3 and 1 or (#name <= 6 and 2 or 3)
  local lower = name:lower()
  local found = {}
  for _, n in ipairs(list) do
    if n ~= name then
      local d = n:lower() == lower and 0 or M.distance(lower, n:lower(), limit)
      -- a name that starts with what was typed (sz -> size) is a fair guess too
      if d > limit and #name >= 3 and n:sub(1, #name) == name then d = limit end
      if d <= limit then found[#found + 1] = {n = n, d = d} end
    end
  end
  table.sort(found, function(x, y) if x.d ~= y.d then return x.d < y.d end return x.n < y.n end)
  local r = {}
  for i = 1, math.min(3, #found) do r[i] = found[i].n end
  return r
end

-- ' (did you mean 'a' or 'b'?)', or '' when nothing is close
function M.hint(name, names, prefix)
  local c = M.closest(name, names)
  if #c == 0 then return '' end
  prefix = prefix or ''
  for i, n in ipairs(c) do c[i] = "'" .. prefix .. n .. "'" end
  local s = #c == 1 and c[1] or table.concat(c, ', ', 1, #c - 1) .. ' or ' .. c[#c]
  return ' (did you mean ' .. s .. '?)'
end

-- make a table strict: reading a name it lacks is an error naming `what` and
-- the closest names (optional: names that read as nil instead)
function M.strict(tbl, what, optional)
  optional = optional or {}
  return setmetatable(tbl, {__index = function(t, k)
    if optional[k] or type(k) ~= 'string' then return nil end
    error(string.format("%s: no field '%s'%s", what, k, M.hint(k, t, what .. '.')), 2)
  end})
end

return M
