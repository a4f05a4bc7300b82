-- cross-entropy: known values, ignore_index and reductions, dlogits against
-- finite differences in f64, large and odd V, bad input.
local T = require 'lib'
local gp = require 'gpush'

local cpu = {device = 'cpu'}
local flat = T.flat

-- per-row losses in double from host tables
local function oracle(lg, tg, ign)
  local out = {}
  for n = 1, #lg do
    local t = tg[n]
    if t == ign then out[n] = 0 else
      local row, m, s = lg[n], -math.huge, 0
      for j = 1, #row do m = math.max(m, row[j]) end
      for j = 1, #row do s = s + math.exp(row[j] - m) end
      out[n] = m + math.log(s) - row[t + 1]
    end
  end
  return out
end

T.test('cross_entropy: known values, 0-dim result, reductions, ignore_index', function()
  local lg = gp.tensor({{1, 2, 3}, {1, 1, 1}, {0, 0, 5}}, cpu)
  local tg = gp.tensor({2, 0, -100}, {dtype = 'i64', device = 'cpu'})
  local l1, l2 = 3 + math.log(1 + math.exp(-1) + math.exp(-2)) - 3, math.log(3)
  local m = gp.cross_entropy(lg, tg)
  T.eq(m:dim(), 0)
  T.eq(m.device, 'cpu')
  T.near(m:item(), (l1 + l2) / 2, 1e-6)
  T.near(gp.cross_entropy(lg, tg, {reduction = 'sum'}):item(), l1 + l2, 1e-6)
  T.same(gp.cross_entropy(lg, tg, {reduction = 'none'}):totable(), {l1, l2, 0}, 1e-6)
  T.same(gp.cross_entropy(lg, gp.tensor({2, 0, 1}, {dtype = 'i32', device = 'cpu'}), {ignore_index = 0, reduction = 'none'}):totable(),
    {l1, 0, 5 + math.log(1 + 2 * math.exp(-5))}, 1e-6)
  -- leading dims: logits (2, 2, 3), targets (2, 2)
  local l4 = gp.randn({2, 2, 3}, cpu)
  local t4 = gp.tensor({{0, 1}, {2, 1}}, {dtype = 'i64', device = 'cpu'})
  local want = oracle(l4:reshape {4, 3}:totable(), {0, 1, 2, 1}, -100)
  T.near(gp.cross_entropy(l4, t4):item(), (want[1] + want[2] + want[3] + want[4]) / 4, 1e-6)
end)

T.test('cross_entropy: dlogits match finite differences of the loss in f64', function()
  local N, V = 4, 7
  local lg = gp.randn({N, V}, {dtype = 'f64', device = 'cpu'})
  local tg = gp.tensor({3, 1, 6, 0}, {dtype = 'i64', device = 'cpu'})
  local ign = 1
  local loss = gp.empty({N}, cpu)
  local dl = gp.empty({N, V}, {dtype = 'f64', device = 'cpu'})
  local scale = 0.37
  gp.k.cross_entropy_fwd_bwd(loss, dl, lg, tg, gp.full({1}, 2, cpu), ign, scale * 2) -- scale * 2 / count 2
  local x = lg:totable()
  local tt = {3, 1, 6, 0}
  T.same(loss:totable(), oracle(x, tt, ign), 1e-6)
  local function f()
    local s = 0
    for _, v in ipairs(oracle(x, tt, ign)) do s = s + v end
    return s * scale
  end
  local h = 1e-6
  local g = flat(dl)
  for n = 1, N do
    for j = 1, V do
      local v = x[n][j]
      x[n][j] = v + h
      local fp = f()
      x[n][j] = v - h
      local fm = f()
      x[n][j] = v
      T.near(g[(n - 1) * V + j], (fp - fm) / (2 * h), 1e-7)
    end
  end
  -- ignored row: zero gradient; the mean's gradient through gp.cross_entropy
  T.same(flat(dl:narrow(1, 2, 1)), {0, 0, 0, 0, 0, 0, 0})
  local m, dm = gp.cross_entropy(lg, tg, {ignore_index = ign, grad = true})
  local ref = flat(dl)
  local got = flat(dm)
  for i = 1, #ref do T.near(got[i], ref[i] / scale / 3, 1e-12) end
  T.eq(m:dim(), 0)
end)

T.test('cross_entropy: V = 50305 (odd, large) and V = 1', function()
  local V = 50305
  local lg = gp.randn({2, V}, cpu)
  local tg = gp.tensor({50304, 7}, {dtype = 'i64', device = 'cpu'})
  local want = oracle(lg:totable(), {50304, 7}, -100)
  T.same(gp.cross_entropy(lg, tg, {reduction = 'none'}):totable(), want, 1e-5)
  local one = gp.cross_entropy(gp.randn({3, 1}, cpu), gp.zeros({3}, {dtype = 'i64', device = 'cpu'}), {reduction = 'sum'})
  T.near(one:item(), 0, 1e-7)
end)

T.test('cross_entropy: bad input', function()
  local lg = gp.randn({3, 5}, cpu)
  local i64 = {dtype = 'i64', device = 'cpu'}
  T.raises(function() gp.cross_entropy(lg, gp.tensor({0, 5, 1}, i64)) end, 'cross_entropy', 'target 5', '5 classes')
  T.raises(function() gp.cross_entropy(lg, gp.tensor({0, -2, 1}, i64)) end, 'cross_entropy', 'target -2')
  T.raises(function() gp.cross_entropy(lg, gp.tensor({0, 1}, i64)) end, 'cross_entropy', '(3,5)', '(2)')
  T.raises(function() gp.cross_entropy(lg, gp.tensor({0, 1, 2}, cpu)) end, 'cross_entropy', 'targets', 'f32')
  T.raises(function() gp.cross_entropy(lg, gp.tensor({0, 1, 2}, i64), {reduction = 'avg'}) end, 'cross_entropy', 'reduction')
  T.raises(function() gp.cross_entropy(gp.randint(0, 3, {3, 5}, i64), gp.tensor({0, 1, 2}, i64)) end, 'cross_entropy', 'float')
  -- all rows ignored: the mean is NaN (0 / 0), the sum 0
  local all = gp.full({3}, -100, i64)
  T.ok(gp.cross_entropy(lg, all):item() ~= gp.cross_entropy(lg, all):item())
  T.eq(gp.cross_entropy(lg, all, {reduction = 'sum'}):item(), 0)
end)

T.test('cross_entropy (cuda): matches the CPU for every dtype; a bad target gives NaN and an error at the next sync', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    for _, V in ipairs {1, 7, 64, 50304, 50305} do
      local lg = gp.randn({5, V}, cpu):to(dt)
      local tg = gp.randint(0, V, {5}, {device = 'cpu'})
      tg = gp.cat({tg:narrow(1, 1, 4), gp.full({1}, -100, {dtype = 'i64', device = 'cpu'})})
      local l, d = gp.cross_entropy(lg, tg, {grad = true, reduction = 'sum'})
      local lc, dc = gp.cross_entropy(lg:cuda(), tg:cuda(), {grad = true, reduction = 'sum'})
      local tol = dt == 'f32' and 1e-5 or 1e-2
      T.ok(T.relnorm(lc, l) < tol, dt .. ' loss V=' .. V)
      T.ok(T.relnorm(dc, d) < tol, dt .. ' dlogits V=' .. V)
    end
  end
  -- rows of 50257 bf16 (each its own distance from a 16-byte boundary): logits a row past the start of their
  -- storage, dlogits fresh (not the same distance: one element a thread) or over the logits (vectors between
  -- each row's head and tail)
  local V = 50257
  local big = gp.randn({6, V}, cpu):bf16()
  local lg, tg = big:narrow(1, 2, 5), gp.randint(0, V, {5}, {device = 'cpu'})
  local l, d = gp.cross_entropy(lg, tg, {grad = true, reduction = 'none'})
  local lcd = big:cuda():narrow(1, 2, 5)
  local lc, dc = gp.cross_entropy(lcd, tg:cuda(), {grad = true, reduction = 'none'})
  T.ok(T.relnorm(lc, l) < 1e-5 and T.relnorm(dc, d) < 1e-2, 'V 50257, apart')
  local li = gp.empty({5}, {device = 'cuda'})
  gp.k.cross_entropy_fwd_bwd(li, lcd, lcd, tg:cuda(), gp.full({1}, 1, {device = 'cuda'}), -100, 1)
  T.ok(T.relnorm(li, l) < 1e-5 and T.relnorm(lcd, d) < 1e-2, 'V 50257, in place')
  local loss = gp.cross_entropy(gp.randn({2, 5}, {device = 'cuda'}), gp.tensor({1, 9}, {dtype = 'i64', device = 'cuda'}), {reduction = 'none'})
  T.raises(function() loss:totable() end, 'cross_entropy', 'target 9', 'size 5', 'next synchronization')
  local v = loss:totable() -- reported once; the row holds NaN
  T.ok(v[1] == v[1] and v[2] ~= v[2], 'row 2 NaN')
  T.near(gp.cross_entropy(gp.zeros({2, 4}, {device = 'cuda'}), gp.tensor({1, 3}, {dtype = 'i64', device = 'cuda'})):item(), math.log(4), 1e-6)
end)

-- N rows of each {dtype, V} of cases against the CPU: every 9th row from the 2nd ignored, the loss and
-- dlogits, the forward alone, and in place with i32 targets (dlogits over the logits, as
-- gp.linear_cross_entropy's chunks)
local function rows_vs_cpu(N, cases)
  for _, c in ipairs(cases) do
    local dt, V = c[1], c[2]
    local lg = (gp.randn({N, V}, cpu) * 3):to(dt)
    local tg = gp.randint(0, V, {N}, {device = 'cpu'}):totable()
    for i = 2, N, 9 do tg[i] = -100 end
    tg = gp.tensor(tg, {dtype = 'i64', device = 'cpu'})
    local l, d = gp.cross_entropy(lg, tg, {grad = true, reduction = 'none'})
    local lc, dc = gp.cross_entropy(lg:cuda(), tg:cuda(), {grad = true, reduction = 'none'})
    local what = string.format('%s V=%d', dt, V)
    T.ok(T.relnorm(lc, l) < 1e-5, what .. ' loss ' .. T.relnorm(lc, l))
    T.ok(T.relnorm(dc, d) < (dt == 'f32' and 1e-5 or 1e-2), what .. ' dlogits ' .. T.relnorm(dc, d))
    T.ok(T.relnorm(gp.cross_entropy(lg:cuda(), tg:cuda(), {reduction = 'none'}), l) < 1e-5, what .. ' forward alone')
    local x, ti = lg:cuda(), tg:cuda():to('i32')
    local li = gp.empty({N}, {device = 'cuda'})
    gp.k.cross_entropy_fwd_bwd(li, x, x, ti, gp.full({1}, 4, {device = 'cuda'}), -100, 4)
    T.ok(T.relnorm(li, l) < 1e-5 and T.relnorm(x, dc) < 1e-6, what .. ' in place')
  end
end

-- a target of V in row r of N (dtype dt): an error at the next synchronization, NaN in that row alone
local function bad_row(N, V, dt, r)
  local tg = gp.zeros({N}, {dtype = 'i64', device = 'cuda'})
  tg[r] = V
  local l, d = gp.cross_entropy(gp.randn({N, V}, {dtype = dt, device = 'cuda'}), tg, {grad = true, reduction = 'none'})
  T.raises(function() l:totable() end, 'cross_entropy', 'target ' .. V, 'next synchronization')
  local lt, dr = l:totable(), d:narrow(1, r, 1):float():totable()[1]
  T.ok(lt[r] ~= lt[r] and dr[1] ~= dr[1] and lt[r - 1] == lt[r - 1] and lt[r + 1] == lt[r + 1] and lt[N] == lt[N])
  -- the NaN row's dlogits stop at its ends (rows off a 16-byte boundary share a vector with each neighbour)
  local dr2 = d:narrow(1, r, 1):float()
  local before, after = d:narrow(1, r - 1, 1):float():sum():item(), d:narrow(1, r + 1, 1):float():sum():item()
  T.ok(before == before and after == after and dr2:narrow(2, V, 1):item() ~= dr2:narrow(2, V, 1):item())
end

-- rows from 48 KB up to what fits in shared memory are held on chip, several a block
-- (the next row loads while this one is finished), wider ones (128,256 in bf16) split
-- over a cluster of 2 or 4 blocks on Hopper: many rows, ignored and bad ones among them
T.test('cross_entropy (cuda): many rows held on chip, ignored and bad rows, in place', function()
  T.cuda()
  rows_vs_cpu(400, {{'bf16', 50304}, {'f16', 32000}, {'f32', 16384}, {'bf16', 100000}, {'bf16', 128256},
                    {'f32', 65536}})
  bad_row(300, 50304, 'bf16', 150)
end)

-- rows of 8 to 48 KB are held on chip by blocks of 64, 128 or 256 threads (the fewest that hold a row in 12
-- slots each): more rows than resident blocks (each block loops, the next row loading while this one is
-- finished), the boundaries of each block size, ignored and bad rows. Rows of more than 16 KB that start off a
-- 16-byte boundary (V 8195, 12291, 4097, 50257) are held as the vectors that cover them, the neighbours'
-- elements left alone; shorter ones (V 4099) take a group of lanes a row
T.test('cross_entropy (cuda): rows of 8 KB and more on chip in small blocks, rows off a 16-byte boundary', function()
  T.cuda()
  rows_vs_cpu(5000, {{'bf16', 4096}, {'bf16', 4099}})
  rows_vs_cpu(3000, {{'bf16', 8195}})
  rows_vs_cpu(1500, {{'bf16', 16384}})
  -- (odd row counts: the logits end off a 16-byte boundary, so the last row takes the streaming kernel)
  rows_vs_cpu(601, {{'bf16', 50257}})
  rows_vs_cpu(201, {{'f16', 6144}, {'f16', 12291}, {'bf16', 12288}, {'f32', 12288}, {'f32', 12291}, {'f32', 4097}})
  bad_row(3000, 4096, 'bf16', 2500)
  bad_row(3000, 8195, 'bf16', 2500)
  bad_row(200, 12288, 'f32', 7)
end)

-- rows of up to 16 KB take a group of 4 to 32 lanes a row, several rows a block: row counts that leave a block
-- part empty, rows that start off a 16-byte boundary (V 1003, 65), every group size
T.test('cross_entropy (cuda): short rows a group of lanes each, ignored and bad rows, in place', function()
  T.cuda()
  rows_vs_cpu(37, {{'f32', 1000}, {'bf16', 1003}, {'f16', 65}, {'f32', 7}, {'bf16', 256}, {'f32', 256},
                   {'bf16', 8192}, {'f32', 4096}, {'f32', 4097}})
  bad_row(37, 1000, 'f32', 20)
  bad_row(37, 65, 'bf16', 5)
end)

-- rows padded past their V classes with -inf (gp.linear_cross_entropy's chunks of 50257 outputs): the same loss and
-- gradient as the packed rows, a 0 gradient on the padding, and targets bounded by classes, not by the padded width
T.test('cross_entropy kernels: rows padded with -inf, targets bounded by classes', function()
  local N, V, P = 6, 13, 16
  for _, dev in ipairs(gp.cuda_available() and {'cpu', 'cuda'} or {'cpu'}) do
    for _, dt in ipairs {'f32', 'bf16'} do
      local o = {dtype = dt, device = dev}
      local lg = gp.randn({N, V}, o)
      local tg = gp.tensor({0, 12, -100, 5, 12, 3}, {dtype = 'i64', device = dev})
      local lp = gp.full({N, P}, -math.huge, o)
      lp:narrow(2, 1, V):copy_(lg)
      local cnt = gp.full({1}, 5, {device = dev})
      local l, dl = gp.empty({N}, {device = dev}), gp.empty({N, V}, o)
      gp.k.cross_entropy_fwd_bwd(l, dl, lg, tg, cnt, -100, 1)
      local lp2, dp = gp.empty({N}, {device = dev}), gp.empty({N, P}, o)
      gp.k.cross_entropy_fwd_bwd(lp2, dp, lp, tg, cnt, -100, 1, V)
      local what = dev .. ' ' .. dt
      T.same(lp2:totable(), l:totable(), 1e-6, what .. ' loss')
      T.same(dp:narrow(2, 1, V):float():totable(), dl:float():totable(), 1e-6, what .. ' dlogits')
      T.eq(dp:narrow(2, V + 1, P - V):float():abs():sum():item(), 0, what .. ' padding')
      local l3 = gp.empty({N}, {device = dev})
      gp.k.cross_entropy(l3, lp, tg, -100, V)
      T.same(l3:totable(), l:totable(), 1e-6, what .. ' forward only')
      local bad = gp.tensor({0, 1, 2, V + 1, 4, 5}, {dtype = 'i64', device = dev})
      if dev == 'cpu' then
        T.raises(function() gp.k.cross_entropy(l3, lp, bad, -100, V) end, 'cross_entropy', 'target 14', '13 classes')
        T.raises(function() gp.k.cross_entropy_fwd_bwd(lp2, dp, lp, bad, cnt, -100, 1, V) end,
          'cross_entropy_fwd_bwd', 'target 14', '13 classes')
      else
        gp.k.cross_entropy_fwd_bwd(lp2, dp, lp, bad, cnt, -100, 1, V)
        T.raises(function() lp2:totable() end, 'cross_entropy_fwd_bwd', 'target 14', 'next synchronization')
      end
      T.raises(function() gp.k.cross_entropy(l3, lp, tg, -100, P + 1) end, 'cross_entropy', 'classes', '[0, 16]')
      T.raises(function() gp.k.cross_entropy(l3, lp, tg, -100, 2.5) end, 'cross_entropy', 'classes', '2.5')
    end
  end
end)

T.test('cross_entropy backward: upstream x dlogits / count in one pass, with ignored rows (mean, sum, none)', function()
  local opts = {dtype = 'f64', device = 'cpu'}
  local logits0 = gp.randn({6, 5}, opts)
  local tg = gp.tensor({1, -100, 4, 0, -100, 2}, {dtype = 'i64', device = 'cpu'})
  for _, red in ipairs {'mean', 'sum', 'none'} do
    local x = logits0:clone():requires_grad()
    local loss = gp.cross_entropy(x, tg, {reduction = red})
    local up = red == 'none' and gp.randn({6}, opts) or gp.full({}, 3, opts)
    loss:backward(up)
    local _, dl = gp.cross_entropy(logits0, tg, {reduction = red, grad = true}) -- already / count for mean
    local want = dl * (red == 'none' and up:unsqueeze(-1) or up)
    T.ok(T.relnorm(x.grad, want) < 1e-6, red) -- (the loss, and so its upstream gradient, is f32)
  end
end)

T.test('cross_entropy forward + backward: three launches (count, fused kernel, reduction), the seed not filled', function()
  for _, dev in ipairs(gp.cuda_available() and {'cpu', 'cuda'} or {'cpu'}) do
    local o = {device = dev}
    local tg = gp.tensor({1, -100, 4, 0, -100, 2, 3}, {dtype = 'i64', device = dev})
    local cnt = gp.empty({1}, o)
    T.eq(gp.k.loss_count(cnt, tg, -100, 1):item(), 5, dev)
    T.eq(gp.k.loss_count(cnt, tg, -100, 0):item(), 1, dev)
    T.eq(gp.k.loss_count(cnt, tg, 4, 1):item(), 6, dev)
    for _, red in ipairs {'mean', 'sum'} do
      local x0 = gp.randn({7, 5}, o)
      local x = x0:clone():requires_grad()
      local _, n = T.launches(function() gp.cross_entropy(x, tg, {reduction = red}):backward() end)
      T.eq(n.loss_count, 1, red)
      T.eq(n.cross_entropy_fwd_bwd, 1, red)
      T.eq(n.loss_reduce, 1, red)
      T.eq(n.fill, 0, red .. ': no fill (the count needs no zeroed losses; the seed is not read)')
      local _, want = gp.cross_entropy(x0, tg, {reduction = red, grad = true})
      T.ok(T.relnorm(x.grad, want) < 1e-6, red)
    end
  end
end)
