-- Reductions: known values, a Lua oracle over every dim, options, errors,
-- and the CUDA paths (row/column, splits, unaligned starts) against the CPU.
local T = require 'lib'
local gp = require 'gpush'

local function cpu(t, dt) return gp.tensor(t, {dtype = dt or 'f32', device = 'cpu'}) end

T.test('sum/mean/max/min/argmax/var/norm/cumsum known values', function()
  local x = cpu {{1, 2, 3}, {4, 5, 6}}
  T.same(x:sum(1):totable(), {5, 7, 9})
  T.same(x:sum(2):totable(), {6, 15})
  T.eq(x:sum():dim(), 0)
  T.eq(x:sum():item(), 21)
  T.eq(x:mean():item(), 3.5)
  T.same(x:mean(-1):totable(), {2, 5})
  local v, i = x:max(2)
  T.same(v:totable(), {3, 6})
  T.same(i:totable(), {2, 2})
  T.eq(i.dtype, 'i64')
  v, i = x:min(1)
  T.same(v:totable(), {1, 2, 3})
  T.same(i:totable(), {0, 0, 0})
  T.eq(x:max():item(), 6)
  T.eq(x:argmax():item(), 5)
  T.eq(x:argmin():item(), 0)
  T.same(x:var(2):totable(), {1, 1}, 1e-6)
  T.same(x:var(2, {correction = 0}):totable(), {2 / 3, 2 / 3}, 1e-6)
  T.same(x:norm(2, 2):totable(), {math.sqrt(14), math.sqrt(77)}, 1e-6)
  T.near(x:norm(1):item(), 21, 1e-6)
  T.near((-x):norm(math.huge):item(), 6, 1e-6)
  T.near(x:norm(0):item(), 6, 1e-6)
  T.near(x:norm(3):item(), (1 + 8 + 27 + 64 + 125 + 216) ^ (1 / 3), 1e-6)
  T.same(x:cumsum(2):totable(), {{1, 3, 6}, {4, 9, 15}})
  T.same(x:cumsum(1):totable(), {{1, 2, 3}, {5, 7, 9}})
  T.same(x:cumsum():totable(), {1, 3, 6, 10, 15, 21})
  T.same(x:sum(2, {keepdim = true}).shape, {2, 1})
  T.same(x:sum {keepdim = true}.shape, {1, 1})
  T.same(x:std(2):totable(), {1, 1}, 1e-6)
end)

T.test('ties give the first index, NaN propagates', function()
  local x = cpu {3, 1, 3, 1}
  T.eq(x:argmax():item(), 0)
  T.eq(x:argmin():item(), 1)
  local n = cpu {1, 0 / 0, 5}
  T.ok(n:max():item() ~= n:max():item())
  T.eq(n:argmax():item(), 1)
  T.ok(n:sum():item() ~= n:sum():item())
end)

T.test('integer inputs: sum in f32, max keeps the dtype', function()
  local x = gp.tensor({{1, 2}, {3, 4}}, {dtype = 'i32', device = 'cpu'})
  T.eq(x:sum().dtype, 'f32')
  T.eq(x:sum():item(), 10)
  T.eq(x:max().dtype, 'i32')
  T.eq(x:max():item(), 4)
  T.same(x:cumsum(1):totable(), {{1, 2}, {4, 6}})
end)

-- Lua oracle over every dim of a 3-d tensor, non-contiguous input too
T.test('every dim of a 3-d tensor against a Lua oracle', function()
  local x = gp.randn({4, 5, 6}, {device = 'cpu'})
  local xt = x:transpose(1, 3) -- (6, 5, 4), non-contiguous
  for _, src in ipairs {x, xt} do
    local t = src:totable()
    local s = src.shape
    for d = 1, 3 do
      local got = {sum = src:sum(d):totable(), max = src:max(d):totable(), var = src:var(d):totable(),
                   am = src:argmax(d):totable(), cs = src:cumsum(d):totable()}
      for a = 1, s[1] do for b = 1, s[2] do for c = 1, s[3] do
        local idx = {a, b, c}
        if idx[d] == 1 then
          local vals = {}
          for k = 1, s[d] do idx[d] = k; vals[k] = t[idx[1]][idx[2]][idx[3]] end
          idx[d] = 1
          local sum, mx, am = 0, -math.huge, 0
          for k, v in ipairs(vals) do
            sum = sum + v
            if v > mx then mx, am = v, k - 1 end
          end
          local m, q = sum / #vals, 0
          for _, v in ipairs(vals) do q = q + (v - m) ^ 2 end
          local r = {}
          for k = 1, 3 do if k ~= d then r[#r + 1] = idx[k] end end
          T.near(got.sum[r[1]][r[2]], sum, 1e-5)
          T.near(got.max[r[1]][r[2]], mx, 1e-6)
          T.eq(got.am[r[1]][r[2]], am)
          T.near(got.var[r[1]][r[2]], q / (#vals - 1), 1e-5)
          local run = 0
          for k = 1, #vals do
            run = run + vals[k]
            idx[d] = k
            T.near(got.cs[idx[1]][idx[2]][idx[3]], run, 1e-5)
          end
        end
      end end end
    end
  end
end)

T.test('reduce errors name the op and the shapes', function()
  local x = gp.zeros({2, 3}, {device = 'cpu'})
  T.raises(function() x:sum(3) end, 'sum', 'out of range', '(2,3)')
  T.raises(function() x:max(0) end, 'max')
  T.raises(function() gp.zeros({2, 0}, {device = 'cpu'}):max(2) end, 'max', 'empty', '(2,0)')
  T.raises(function() x:norm(-1) end, 'norm', 'p')
  T.raises(function() x:var(1, {correction = 'a'}) end, 'var', 'correction')
  T.raises(function() gp.k.sum(gp.empty({3, 3}, {device = 'cpu'}), x:view {2, 3, 1}) end, 'sum', '(3,3)', '(2,3,1)')
  T.raises(function() gp.k.argmax(gp.empty({2, 1}, {device = 'cpu'}), x:view {2, 3, 1}) end, 'argmax', 'f32', 'i32')
  T.raises(function() gp.k.sum(gp.empty({3}, {device = 'cpu'}), x:view {2, 3, 1}) end, 'sum')
  T.same(gp.zeros({2, 0}, {device = 'cpu'}):sum(2):totable(), {0, 0})
  T.ok(gp.zeros({0}, {device = 'cpu'}):mean():item() ~= 0)
end)

-- CUDA: the row path (unaligned starts, splits), the column path, p values, against the CPU
T.test('cuda reductions against the cpu on awkward geometries', function()
  T.cuda()
  local shapes = {{1, 1000003, 1}, {3, 70001, 1}, {1000, 37, 1}, {2, 5000, 3}, {1, 100000, 33}, {7, 9, 1000}}
  for _, dt in ipairs {'f32', 'bf16'} do
    for _, s in ipairs(shapes) do
      local n = s[1] * s[2] * s[3]
      local base = gp.randn({n + 1}, {device = 'cpu'}):to(dt)
      local xc = base:narrow(1, 2, n):view(s) -- starts one element past 16-byte alignment
      local xg = base:cuda():narrow(1, 2, n):view(s)
      for _, name in ipairs {'sum', 'mean', 'max', 'min', 'argmax', 'argmin', 'var', 'norm', 'cumsum'} do
        local a = xc[name](xc, 2)
        local b = xg[name](xg, 2)
        local tol = dt == 'bf16' and 1e-2 or 1e-4
        if name == 'argmax' or name == 'argmin' then tol = 0 end
        local r = T.relnorm(b, a)
        if not (r <= tol) then error(string.format('%s %s %s: %g', name, dt, table.concat(s, 'x'), r)) end
      end
      for _, p in ipairs {1, 3, math.huge, 0} do
        T.ok(T.relnorm(xg:norm(p, 2), xc:norm(p, 2)) <= (dt == 'bf16' and 1e-2 or 1e-4), 'norm p=' .. p)
      end
    end
  end
  -- aligned columns that are a multiple of 16 bytes: the vectorized column sum
  -- (a bias gradient), with and without splits over the reduced dim
  for _, dt in ipairs {'f32', 'bf16'} do
    for _, s in ipairs {{1, 8192, 768}, {3, 100, 264}, {2, 7, 256}, {1, 5000, 64}, {4, 1, 8}, {1, 20000, 8}} do
      local xc = gp.randn(s, {device = 'cpu'}):to(dt)
      local xg = xc:cuda()
      for _, name in ipairs {'sum', 'mean'} do
        local r = T.relnorm(xg[name](xg, 2), xc[name](xc, 2))
        if not (r <= (dt == 'bf16' and 1e-2 or 1e-5)) then error(string.format('%s %s %s: %g', name, dt, table.concat(s, 'x'), r)) end
      end
    end
  end
  -- ties and NaN on the GPU follow the CPU
  local t = gp.tensor({{5, 1, 5, 5}, {0 / 0, 2, 0 / 0, 1}}):cuda()
  T.same(t:argmax(2):totable(), {0, 0})
  T.same(t:argmin(2):totable(), {1, 0})
  T.ok(t:max(2):totable()[2] ~= t:max(2):totable()[2])
end)
