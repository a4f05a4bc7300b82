-- dropout and multinomial: the Philox scheme (same mask as gp.rand would give),
-- a chi-square frequency check, CPU/CUDA agreement, bad input.
local T = require 'lib'
local gp = require 'gpush'

local cpu = {device = 'cpu'}

T.test('dropout: mask = (rand >= p) for the same seed; out = x * mask / (1 - p)', function()
  local x = gp.randn({37, 11}, cpu)
  for _, p in ipairs {0, 0.1, 0.5, 0.9, 1} do
    gp.manual_seed(7)
    local u = gp.rand({37, 11}, cpu):totable()
    gp.manual_seed(7)
    local out, mask = gp.dropout(x, p)
    T.eq(mask.dtype, 'u8')
    local o, m, xt = out:totable(), mask:totable(), x:totable()
    local kept = 0
    for i = 1, 37 do
      for j = 1, 11 do
        local keep = u[i][j] >= p
        T.eq(m[i][j], keep and 1 or 0)
        T.near(o[i][j], keep and xt[i][j] / (1 - p) or 0, 1e-6)
        if keep then kept = kept + 1 end
      end
    end
    if p == 0 then T.eq(kept, 37 * 11) elseif p == 1 then T.eq(kept, 0) end
  end
  local _, m = gp.dropout(gp.ones({100000}, cpu), 0.3)
  local s = 0
  for _, v in ipairs(m:totable()) do s = s + v end
  T.near(s / 100000, 0.7, 0.01)
  T.raises(function() gp.dropout(x, 1.5) end, 'dropout', 'p')
  T.raises(function() gp.dropout(gp.zeros({3}, {dtype = 'i32', device = 'cpu'}), 0.5) end, 'dropout', 'float')
end)

T.test('multinomial: chi-square over 20000 draws of 5 categories; zero weights never drawn', function()
  local w = {1, 2, 3, 0, 4}
  local rows = {}
  for i = 1, 20000 do rows[i] = w end
  gp.manual_seed(3)
  local d = gp.multinomial(gp.tensor(rows, cpu))
  T.eq(d.dtype, 'i64')
  T.same(d.shape, {20000})
  local count = {0, 0, 0, 0, 0}
  for _, v in ipairs(d:totable()) do count[v + 1] = count[v + 1] + 1 end
  T.eq(count[4], 0)
  local chi = 0
  for c = 1, 5 do
    local e = 20000 * w[c] / 10
    if e > 0 then chi = chi + (count[c] - e) ^ 2 / e end
  end
  T.ok(chi < 16.27, 'chi-square ' .. chi .. ' with 3 dof above the 0.001 critical value') -- 3 dof: category 4 is empty
  -- 1-d probs, a method, other dtypes
  T.same(gp.tensor({0, 0, 5}, cpu):multinomial():totable(), {2})
  T.same(gp.multinomial(gp.tensor({{0, 1}, {1, 0}}, cpu):bf16()):totable(), {1, 0})
end)

T.test('multinomial: bad input', function()
  T.raises(function() gp.multinomial(gp.tensor({{1, -1}}, cpu)) end, 'multinomial', '-1', 'row 0')
  T.raises(function() gp.multinomial(gp.tensor({{0, 0}}, cpu)) end, 'multinomial', 'no positive weight')
  T.raises(function() gp.multinomial(gp.tensor({{0, 0 / 0}}, cpu)) end, 'multinomial')
  T.raises(function() gp.multinomial(gp.ones({2, 2, 2}, cpu)) end, 'multinomial', '(2,2,2)')
  T.raises(function() gp.multinomial(gp.ones({2, 2}, cpu), 3) end, 'multinomial', 'one draw')
end)

T.test('dropout and multinomial (cuda): the same draws as the CPU for the same seed', function()
  T.cuda()
  local x = gp.randn({1001, 13}, cpu)
  gp.manual_seed(5)
  local o1, m1 = gp.dropout(x, 0.3)
  gp.manual_seed(5)
  local o2, m2 = gp.dropout(x:cuda(), 0.3)
  T.same(m2:totable(), m1:totable())
  T.ok(T.relnorm(o2, o1) < 1e-6)
  for _, V in ipairs {1, 5, 33, 50304} do
    local p = gp.rand({64, V}, cpu)
    gp.manual_seed(9)
    local a = gp.multinomial(p)
    gp.manual_seed(9)
    local b = gp.multinomial(p:cuda())
    T.same(b:totable(), a:totable())
  end
end)

-- the draws move a counter's four elements as one vector when the tensor is aligned for it, one at a time
-- otherwise and in the tail: both ways equal the CPU's draws for the same seed
T.test('rand_uniform, rand_normal, randint and dropout (cuda): vectors, tails and unaligned views equal the CPU',
  function()
    T.cuda()
    for _, dt in ipairs {'f32', 'bf16', 'i64', 'u8'} do
      for _, n in ipairs {1, 3, 4, 7, 64, 1001} do
        for _, off in ipairs {0, 1} do
          local function draw(dev, kind)
            local t = gp.zeros({n + off}, {dtype = dt, device = dev}):narrow(1, off + 1, n)
            gp.manual_seed(11)
            if kind == 'int' then gp.k.randint(t, 0, 200)
            elseif kind == 'u' then gp.k.rand_uniform(t, -2, 3)
            else gp.k.rand_normal(t, 1, 2) end
            return t:float():cpu()
          end
          local what = string.format('%s n %d offset %d', dt, n, off)
          for _, kind in ipairs((dt == 'i64' or dt == 'u8') and {'int'} or {'u', 'n'}) do
            local a, b = draw('cpu', kind), draw('cuda', kind)
            if kind == 'int' then T.same(b:totable(), a:totable(), 0, what)
            else T.ok(T.relnorm(b, a) < (dt == 'bf16' and 1e-2 or 1e-5), what .. ' ' .. kind) end
          end
          if dt == 'f32' or dt == 'bf16' then
            local x = gp.randn({n + off}, {dtype = dt, device = 'cpu'}):narrow(1, off + 1, n)
            gp.manual_seed(13)
            local o1, m1 = gp.dropout(x, 0.4)
            gp.manual_seed(13)
            local o2, m2 = gp.dropout(x:cuda(), 0.4)
            T.same(m2:totable(), m1:totable(), 0, what .. ' dropout mask')
            T.ok(T.relnorm(o2:float():cpu(), o1:float()) < 1e-6, what .. ' dropout')
          end
        end
      end
    end
  end)
