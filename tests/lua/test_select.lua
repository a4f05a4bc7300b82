-- topk and sort: Lua oracle (value order, NaN largest, ties to the lower index), dims, bad input.
local T = require 'lib'
local gp = require 'gpush'

local cpu = {device = 'cpu'}

-- sorted {value, index} pairs of a Lua row
local function order(row, desc)
  local p = {}
  for i = 1, #row do p[i] = {row[i], i - 1} end
  local function gt(a, b)
    if a ~= a then return b == b end
    if b ~= b then return false end
    return a > b
  end
  table.sort(p, function(a, b)
    local x = desc and gt(a[1], b[1]) or (not desc and gt(b[1], a[1]))
    local y = desc and gt(b[1], a[1]) or (not desc and gt(a[1], b[1]))
    return x or (not y and a[2] < b[2])
  end)
  return p
end

local function check_rows(x, v, i, desc, k)
  local xt, vt, it = x:totable(), v:totable(), i:totable()
  for r = 1, #xt do
    local p = order(xt[r], desc)
    for j = 1, k or #p do
      local a, b = vt[r][j], p[j][1]
      T.ok(a == b or (a ~= a and b ~= b), string.format('row %d pos %d value %s vs %s', r, j, a, b))
      T.eq(it[r][j], p[j][2], string.format('row %d pos %d index', r, j))
    end
  end
end

T.test('topk: values and indices, ties to the lower index, NaN first', function()
  local v, i = gp.tensor({{3, 1, 4, 1, 5, 9, 2, 6}}, cpu):topk(3)
  T.same(v:totable(), {{9, 6, 5}})
  T.same(i:totable(), {{5, 7, 4}})
  T.eq(i.dtype, 'i64')
  v, i = gp.tensor({{2, 7, 7, 1, 7}}, {dtype = 'i32', device = 'cpu'}):topk(4)
  T.same(v:totable(), {{7, 7, 7, 2}})
  T.same(i:totable(), {{1, 2, 4, 0}})
  local x = gp.tensor({{1, 0 / 0, 3, 2}}, cpu)
  i = select(2, x:topk(2))
  T.same(i:totable(), {{1, 2}})
  for _, dt in ipairs {'f32', 'bf16', 'i64', 'u8', 'f64'} do
    local r = gp.randint(0, 20, {6, 37}, cpu):to(dt)
    check_rows(r, select(1, r:topk(11)), select(2, r:topk(11)), true, 11)
  end
  local r = gp.randn({5, 200}, cpu)
  local tv, ti = r:topk(64)
  check_rows(r, tv, ti, true, 64)
  -- another dim
  local y = gp.randn({9, 4}, cpu)
  local yv, yi = y:topk(2, 1)
  T.same(yv.shape, {2, 4})
  check_rows(y:t(), yv:t(), yi:t(), true, 2)
end)

T.test('sort: ascending and descending, stable, every dtype, dims', function()
  local v, i = gp.tensor({3, 1, 2, 1}, cpu):sort()
  T.same(v:totable(), {1, 1, 2, 3})
  T.same(i:totable(), {1, 3, 2, 0})
  v, i = gp.tensor({3, 1, 2, 1}, cpu):sort {descending = true}
  T.same(v:totable(), {3, 2, 1, 1})
  T.same(i:totable(), {0, 2, 1, 3})
  for _, dt in ipairs {'f32', 'f16', 'i32', 'u8'} do
    local r = gp.randint(0, 9, {4, 23}, cpu):to(dt)
    for _, desc in ipairs {false, true} do
      local sv, si = r:sort {descending = desc}
      check_rows(r, sv, si, desc)
    end
  end
  local r = gp.randn({3, 5, 6}, cpu)
  local sv, si = r:sort {dim = 2, descending = true}
  T.same(sv.shape, {3, 5, 6})
  local c = r:transpose(2, 3):contiguous():reshape {18, 5}
  check_rows(c, sv:transpose(2, 3):contiguous():reshape {18, 5}, si:transpose(2, 3):contiguous():reshape {18, 5}, true)
end)

T.test('topk and sort: bad input', function()
  local x = gp.randn({3, 5}, cpu)
  T.raises(function() x:topk(6) end, 'topk', 'k = 6', 'larger than the row')
  T.raises(function() gp.randn({2, 100}, cpu):topk(65) end, 'topk', '64')
  T.raises(function() x:topk(-1) end, 'topk', 'non-negative')
  T.raises(function() x:sort {dim = 3} end, 'sort', 'dim 3')
  local v, i = gp.empty({3, 2}, cpu), gp.empty({3, 2}, {dtype = 'i32', device = 'cpu'})
  T.raises(function() gp.k.topk(v, i, x) end, 'topk', 'i32', 'i64')
  T.raises(function() gp.k.topk(v, gp.empty({3, 2}, {dtype = 'i64', device = 'cpu'}), x:t()) end, 'topk')
end)

T.test('topk and sort (cuda): match the CPU, small and large rows', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'f16', 'i32', 'i64', 'u8'} do
    for _, n in ipairs {1, 5, 100, 2048, 2049, 5000, 50304} do
      local x = (dt == 'f32' and gp.randn({3, n}, cpu) or gp.randint(0, 50, {3, n}, cpu)):to(dt)
      local k = math.min(n, 64)
      local v1, i1 = x:topk(k)
      local v2, i2 = x:cuda():topk(k)
      T.same(v2:totable(), v1:totable())
      T.same(i2:totable(), i1:totable())
      if n <= 5000 then
        for _, desc in ipairs {false, true} do
          local s1, j1 = x:sort {descending = desc}
          local s2, j2 = x:cuda():sort {descending = desc}
          T.same(s2:totable(), s1:totable())
          T.same(j2:totable(), j1:totable())
        end
      end
    end
  end
  T.raises(function() gp.randn({2, 3}, {device = 'cuda'}):topk(4) end, 'topk', 'larger than the row')
end)

-- rows of 128 to 2048 take CUB's block radix sort on the GPU: NaN above +inf, -0 level with +0, ties in index
-- order, both directions, every dtype: the same values and indices as the CPU
T.test('topk and sort (cuda): the radix rows keep the order (NaN, -0, ties)', function()
  T.cuda()
  local function nonan(v) -- NaN and the infinities as numbers T.same can subtract
    local t = v:float():cpu():totable()
    for _, r in ipairs(t) do
      for j, e in ipairs(r) do r[j] = e ~= e and 3e38 or e == 1 / 0 and 2e38 or e == -1 / 0 and -2e38 or e end
    end
    return t
  end
  for _, dt in ipairs {'f32', 'bf16', 'f16', 'i32', 'i64', 'u8'} do
    for _, n in ipairs {128, 700, 2048} do
      local x = gp.randint(0, 9, {4, n}, cpu):float()
      if dt == 'f32' or dt == 'bf16' or dt == 'f16' then
        x = x:sub(4)
        local t = x:totable()
        for r = 1, 4 do
          for j = 1, n, 7 do t[r][j] = ({0 / 0, -0.0, 0.0, 1 / 0, -1 / 0, -(0 / 0)})[(j + r) % 6 + 1] end
        end
        x = gp.tensor(t, cpu)
      end
      x = x:type(dt)
      for _, desc in ipairs {false, true} do
        local s1, j1 = x:sort {descending = desc}
        local s2, j2 = x:cuda():sort {descending = desc}
        local what = string.format('%s n %d desc %s', dt, n, tostring(desc))
        T.same(j2:totable(), j1:totable(), 0, what .. ': indices')
        T.same(nonan(s2), nonan(s1), 0, what .. ': values')
      end
      local v1, i1 = x:topk(64)
      local v2, i2 = x:cuda():topk(64)
      T.same(i2:totable(), i1:totable(), 0, string.format('%s n %d topk indices', dt, n))
      T.same(nonan(v2), nonan(v1), 0, string.format('%s n %d topk values', dt, n))
    end
  end
end)
