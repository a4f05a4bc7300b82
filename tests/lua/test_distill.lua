-- distill_loss: equal to a plain composition of log_softmax, exp, sum and mean
-- in f64 (all three kinds, T != 1, alpha 0 / 0.5 / 1, ignored rows), its
-- gradient to the composition's autograd gradient, gradcheck, wide rows,
-- CUDA against the CPU, bad input.
local T = require 'lib'
local gp = require 'gpush'

local CPU64 = {dtype = 'f64', device = 'cpu'}
local I64 = {dtype = 'i64', device = 'cpu'}

-- the composition: per-row alpha T^2 D + (1 - alpha) CE, mean over kept rows
local function compose(s, t, tg, o)
  local N, V = s:size(1), s:size(2)
  local temp, alpha, kind = o.temperature or 1, o.alpha, o.kind or 'forward_kl'
  local a, b = (s / temp):log_softmax(2), (t / temp):log_softmax(2)
  local p, q = a:exp(), b:exp()
  local D
  if kind == 'forward_kl' then D = (q * (b - a)):sum(2)
  elseif kind == 'reverse_kl' then D = (p * (a - b)):sum(2)
  else
    local m = ((p + q) * 0.5):log()
    D = ((q * (b - m)):sum(2) + (p * (a - m)):sum(2)) * 0.5
  end
  local keep, safe, nkeep = {}, {}, 0
  local tt = tg:totable()
  for n = 1, N do
    keep[n] = tt[n] == (o.ignore_index or -100) and 0 or 1
    safe[n] = keep[n] == 1 and tt[n] or 0
    nkeep = nkeep + keep[n]
  end
  local ce = -s:log_softmax(2):gather(2, gp.tensor(safe, I64):view {N, 1}):view {N}
  assert(V > 0)
  local row = (D * (alpha * temp * temp) + ce * (1 - alpha)) * gp.tensor(keep, CPU64)
  if o.reduction == 'none' then return row end
  if o.reduction == 'sum' then return row:sum() end
  return row:sum() / nkeep
end

local KINDS = {'forward_kl', 'reverse_kl', 'jsd'}

T.test('distill_loss equals log_softmax/exp/sum/mean in f64: kinds, T, alpha, ignored rows, reductions; and its gradient', function()
  gp.manual_seed(3)
  local N, V = 6, 11
  local s0, t0 = gp.randn({N, V}, CPU64) * 2, gp.randn({N, V}, CPU64) * 2
  local tg = gp.tensor({3, -100, 10, 0, 7, -100}, I64)
  for _, kind in ipairs(KINDS) do
    for _, temp in ipairs {1, 2.5, 0.7} do
      for _, alpha in ipairs {0, 0.5, 1} do
        for _, red in ipairs {'mean', 'sum', 'none'} do
          local o = {temperature = temp, alpha = alpha, kind = kind, targets = tg, reduction = red}
          local what = string.format('%s T=%g alpha=%g %s', kind, temp, alpha, red)
          local s1, s2 = s0:clone():requires_grad(), s0:clone():requires_grad()
          local got = gp.distill_loss(s1, t0, o)
          local want = compose(s2, t0, tg, o)
          T.eq(got.dtype, 'f32')
          T.ok(T.relnorm(got, want) < 1e-6, what .. ': loss ' .. T.relnorm(got, want))
          local up = red == 'none' and gp.randn({N}, CPU64) or gp.full({}, 1.7, CPU64)
          got:backward(up)
          want:backward(up)
          T.ok(T.relnorm(s1.grad, s2.grad) < 1e-6, what .. ': grad ' .. T.relnorm(s1.grad, s2.grad))
        end
      end
    end
  end
  -- loss:backward() with no argument (the seed: the kernel's dstudent, already / count, is the
  -- gradient as it is), on a leaf and through a non-leaf (a product before the loss)
  for _, kind in ipairs(KINDS) do
    local o = {temperature = 2, alpha = 0.5, kind = kind, targets = tg}
    local w0 = gp.randn({V, V}, CPU64)
    local s1, s2 = s0:clone():requires_grad(), s0:clone():requires_grad()
    gp.distill_loss(s1:matmul(w0), t0, o):backward()
    compose(s2:matmul(w0), t0, tg, o):backward()
    T.ok(T.relnorm(s1.grad, s2.grad) < 1e-6, kind .. ': seed path through a product')
    local s3, s4 = s0:clone():requires_grad(), s0:clone():requires_grad()
    gp.distill_loss(s3, t0, o):backward()
    compose(s4, t0, tg, o):backward()
    T.ok(T.relnorm(s3.grad, s4.grad) < 1e-6, kind .. ': seed path on a leaf')
    -- a retained graph: the second backward adds the same gradient again (the first .grad was a copy)
    local s5 = s0:clone():requires_grad()
    local l5 = gp.distill_loss(s5, t0, o)
    l5:backward(nil, {retain_graph = true})
    l5:backward()
    T.ok(T.relnorm(s5.grad, s4.grad * 2) < 1e-6, kind .. ': retained graph, two backwards')
  end
  -- no targets: distillation only (alpha 1), every row counts; leading dims
  local s3, t3 = gp.randn({2, 3, V}, CPU64), gp.randn({2, 3, V}, CPU64)
  local want = compose(s3:reshape {6, V}, t3:reshape {6, V}, gp.zeros({6}, I64), {temperature = 2, alpha = 1})
  T.ok(T.relnorm(gp.distill_loss(s3, t3, {temperature = 2}), want) < 1e-6)
  -- identical logits: KL and JSD are 0
  for _, kind in ipairs(KINDS) do T.near(gp.distill_loss(s3, s3, {kind = kind, temperature = 3}):item(), 0, 1e-6) end
end)

T.test('distill_loss: dstudent from the kernel against finite differences (gradcheck in f64)', function()
  local s, t = gp.randn({5, 7}, CPU64), gp.randn({5, 7}, CPU64)
  local tg = gp.tensor({0, 6, -100, 3, 3}, I64)
  -- the loss is f32: a larger step keeps the rounding out of the differences
  local o = {eps = 1e-2, atol = 1e-4, rtol = 1e-3}
  for _, kind in ipairs(KINDS) do
    for _, red in ipairs {'mean', 'none'} do
      T.ok(gp.gradcheck(function(x)
        return gp.distill_loss(x, t, {kind = kind, temperature = 1.7, alpha = 0.3, targets = tg, reduction = red})
      end, {s}, o))
    end
  end
  -- grad=true returns dstudent (already / count for 'mean'), detached; the teacher gets no gradient
  local x, y = s:detach():clone():requires_grad(), t:clone():requires_grad()
  local loss, ds = gp.distill_loss(x, y, {targets = tg, temperature = 2, grad = true})
  T.ok(loss:needs_grad() and not ds:needs_grad())
  loss:backward()
  T.ok(T.relnorm(x.grad, ds) < 1e-6)
  T.ok(y.grad == nil)
  -- ignored rows: zero gradient
  T.same(T.flat(ds:narrow(1, 3, 1)), {0, 0, 0, 0, 0, 0, 0})
end)

T.test('distill_loss: wide rows (V = 131072 and an odd 50305) in f32 and bf16 match the f64 composition', function()
  for _, V in ipairs {131072, 50305} do
    local s, t = gp.randn({2, V}, CPU64) * 3, gp.randn({2, V}, CPU64) * 3
    local tg = gp.tensor({V - 1, 5}, I64)
    for _, kind in ipairs(KINDS) do
      local o = {kind = kind, temperature = 2, alpha = 0.5, targets = tg, reduction = 'none'}
      local want = compose(s, t, tg, o)
      T.ok(T.relnorm(gp.distill_loss(s:float(), t:float(), o), want) < 1e-5, kind .. ' f32 V=' .. V)
      -- bf16 logits: the same values rounded; compared with the composition of the rounded values
      local sb, tb = s:bf16(), t:bf16()
      local wb = compose(sb:to('f64'), tb:to('f64'), tg, o)
      T.ok(T.relnorm(gp.distill_loss(sb, tb, o), wb) < 1e-5, kind .. ' bf16 V=' .. V)
    end
  end
end)

T.test('distill_loss (cuda): matches the CPU for every dtype and kind, forward and backward; a bad target is reported', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    for _, V in ipairs {1, 7, 64, 49152, 50305, 131072} do
      for _, kind in ipairs(KINDS) do
        local s = gp.randn({5, V}, {device = 'cpu'}):to(dt)
        local t = (gp.randn({5, V}, {device = 'cpu'}) * 2):to(dt)
        local tg = gp.randint(0, V, {5}, {device = 'cpu'})
        tg = gp.cat({tg:narrow(1, 1, 4), gp.full({1}, -100, I64)})
        local o = {kind = kind, temperature = 1.5, alpha = 0.5, targets = tg, grad = true, reduction = 'sum'}
        local l, d = gp.distill_loss(s, t, o)
        o.targets = tg:cuda()
        local lc, dc = gp.distill_loss(s:cuda(), t:cuda(), o)
        local tol = dt == 'f32' and 1e-5 or 1e-2
        local what = string.format('%s %s V=%d', dt, kind, V)
        T.ok(T.relnorm(lc, l) < 1e-4, what .. ' loss ' .. T.relnorm(lc, l))
        T.ok(T.relnorm(dc, d) < tol, what .. ' dstudent ' .. T.relnorm(dc, d))
      end
    end
  end
  local loss = gp.distill_loss(gp.randn({2, 5}, {device = 'cuda'}), gp.randn({2, 5}, {device = 'cuda'}),
    {targets = gp.tensor({1, 9}, {dtype = 'i64', device = 'cuda'}), reduction = 'none'})
  T.raises(function() loss:totable() end, 'distill', 'target 9', 'size 5', 'next synchronization')
end)

-- bf16/f16 rows up to about 56K (f32 up to 28K) are held in shared memory and each block
-- takes several rows (the next row loads while this one is finished): many rows, ignored
-- ones and a bad one among them, against the CPU
T.test('distill_loss (cuda): many rows held on chip (several a block), ignored and bad rows among them', function()
  T.cuda()
  local N = 200
  for _, c in ipairs {{'bf16', 49152}, {'f16', 50304}, {'f32', 20000}, {'f16', 16384}} do
    local dt, V = c[1], c[2]
    local s = gp.randn({N, V}, {device = 'cpu'}):to(dt)
    local t = (gp.randn({N, V}, {device = 'cpu'}) * 2):to(dt)
    local tg = gp.randint(0, V, {N}, {device = 'cpu'}):totable()
    for i = 3, N, 7 do tg[i] = -100 end
    tg = gp.tensor(tg, I64)
    local opts = {{temperature = 2, alpha = 0.5}, {temperature = 1, alpha = 0.3}, {temperature = 2}}
    for i, kind in ipairs(KINDS) do -- each kind with other options (no alpha: no targets, alpha 1)
      local o = opts[i]
      o.kind, o.grad, o.reduction = kind, true, 'none'
      o.targets = o.alpha and tg or nil
      local l, d = gp.distill_loss(s, t, o)
      o.targets = o.alpha and tg:cuda() or nil
      local lc, dc = gp.distill_loss(s:cuda(), t:cuda(), o)
      local what = string.format('%s V=%d %s T=%g alpha=%s', dt, V, kind, o.temperature, tostring(o.alpha))
      T.ok(T.relnorm(lc, l) < 1e-4, what .. ' loss ' .. T.relnorm(lc, l))
      T.ok(T.relnorm(dc, d) < (dt == 'f32' and 1e-5 or 1e-2), what .. ' dstudent ' .. T.relnorm(dc, d))
    end
  end
  -- a bad target: its row NaN, the others right, the error at the next synchronization
  local V = 49152
  local s, t = gp.randn({300, V}, {dtype = 'bf16', device = 'cuda'}), gp.randn({300, V}, {dtype = 'bf16', device = 'cuda'})
  local tg = gp.zeros({300}, {dtype = 'i64', device = 'cuda'})
  tg[200] = V + 3
  local l, d = gp.distill_loss(s, t, {targets = tg, grad = true, reduction = 'none'})
  T.raises(function() l:totable() end, 'distill', 'target ' .. (V + 3), 'next synchronization')
  local lt, dt = l:totable(), d:narrow(1, 200, 1):float():totable()[1]
  T.ok(lt[200] ~= lt[200] and dt[1] ~= dt[1] and dt[V] ~= dt[V])
  T.ok(lt[199] == lt[199] and lt[201] == lt[201])
  local l2, d2 = gp.distill_loss(s:narrow(1, 201, 100), t:narrow(1, 201, 100),
    {targets = tg:narrow(1, 201, 100), grad = true, reduction = 'none'})
  T.ok(T.relnorm(l:narrow(1, 201, 100), l2) < 1e-6 and T.relnorm(d:narrow(1, 201, 100), d2) < 1e-6)
end)

-- each kind has its own on-chip kernel (the forward KL two: without hard targets, alpha 1, and with them); they
-- sum each thread's exponentials against its first vector's max: logits far above the rest of their row (sums
-- past 2^64, summed again exactly), a teacher's -inf (a student's for the reverse KL), targets at a row's ends,
-- ignored rows, T = 1 (one exponential for both student terms) and the kernel's scale negative, against the CPU
T.test('distill_loss (cuda): every kind on chip: spikes, -inf, targets, a negative scale', function()
  T.cuda()
  local N = 150
  for _, c in ipairs {{'bf16', 49152}, {'f32', 20000}, {'f16', 16384}} do
    local dt, V = c[1], c[2]
    local s, t = gp.randn({N, V}, {device = 'cpu'}), gp.randn({N, V}, {device = 'cpu'}) * 2
    local function set(x, r, j, v) x:narrow(1, r, 1):narrow(2, j, 1):fill_(v) end
    set(s, 5, V - 3, 300)
    set(t, 9, 1000, 250)
    set(s, 9, 7, 200)
    set(t, 20, V, -math.huge)
    s, t = s:to(dt), t:to(dt)
    local tg = gp.randint(0, V, {N}, {device = 'cpu'}):totable()
    tg[1], tg[2], tg[5], tg[9] = 0, V - 1, V - 4, 7
    for i = 4, N, 9 do tg[i] = -100 end
    tg = gp.tensor(tg, I64)
    local tol = dt == 'f32' and 1e-5 or 1e-2
    -- the reverse KL: a student's -inf (p = 0) instead of the teacher's (an infinite divergence)
    local sr, tr = s:clone(), t:clone()
    set(tr, 20, V, 0)
    set(sr, 21, 3, -math.huge)
    local kinds = {[0] = 'forward_kl', 'reverse_kl', 'jsd'}
    for _, a in ipairs {{2}, {2, 0.5}, {1, 0.3}, {2, 0}, {2, nil, 1}, {1, 0.5, 1}, {2, 0.7, 1}, {2, nil, 2},
                        {1, 0.5, 2}} do
      local kind = a[3] or 0
      local o = {kind = kinds[kind], temperature = a[1], alpha = a[2], targets = a[2] and tg, grad = true,
                 reduction = 'none'}
      -- at a student's spike the reverse KL's and the JSD's gradients are near 0 by cancellation: the reverse
      -- KL's p ((x - y) / T - E_p[(x - y) / T]) of two terms near 100 at row 9 (f32's spacing there is 7.6e-6),
      -- the JSD's p (log p - log m - KL(p || m)) of a p that carries the rounding of the row's log-sum near 150
      -- (1.5e-5; the CPU computes in f64)
      local tk = kind > 0 and dt == 'f32' and 2e-4 or tol
      local what = string.format('%s %s T=%g alpha=%s', dt, o.kind, a[1], tostring(a[2]))
      local ss, tt = kind == 1 and sr or s, kind == 1 and tr or t
      local l, d = gp.distill_loss(ss, tt, o)
      o.targets = a[2] and tg:cuda()
      local lc, dc = gp.distill_loss(ss:cuda(), tt:cuda(), o)
      T.ok(T.relnorm(lc, l) < 1e-4, what .. ' loss ' .. T.relnorm(lc, l))
      T.ok(T.relnorm(dc, d) < tk, what .. ' dstudent ' .. T.relnorm(dc, d))
      local li, di = gp.empty({N}, {device = 'cuda'}), gp.empty({N, V}, {dtype = dt, device = 'cuda'})
      gp.k.distill_fwd_bwd(li, di, ss:cuda(), tt:cuda(), a[2] and tg:cuda() or gp.zeros({N}, {dtype = 'i64', device = 'cuda'}),
        gp.full({1}, 4, {device = 'cuda'}), a[1], a[2] or 1, kind, -100, -3)
      T.ok(T.relnorm(li, l) < 1e-4 and T.relnorm(di, d:float() * (-3 / 4)) < tk, what .. ' scale -3 / 4')
    end
  end
end)

T.test('distill_loss: bad input', function()
  local s, t = gp.randn({3, 5}, CPU64), gp.randn({3, 5}, CPU64)
  local tg = gp.tensor({0, 1, 2}, I64)
  T.raises(function() gp.distill_loss(s, gp.randn({3, 6}, CPU64)) end, 'distill_loss', '(3,5)', '(3,6)', 'vocabulary')
  T.raises(function() gp.distill_loss(s, t, {temperature = 0}) end, 'distill_loss', 'temperature', '0')
  T.raises(function() gp.distill_loss(s, t, {temperature = -1}) end, 'distill_loss', 'temperature')
  T.raises(function() gp.distill_loss(s, t, {kind = 'kl'}) end, 'distill_loss', 'kind', 'kl')
  T.raises(function() gp.distill_loss(s, t, {targets = gp.tensor({0, 1}, I64)}) end, 'distill_loss', '(3,5)', '(3)', '(2)')
  T.raises(function() gp.distill_loss(s, t, {targets = gp.tensor({0, 1, 2}, CPU64)}) end, 'distill_loss', 'targets', 'i64')
  T.raises(function() gp.distill_loss(s, t, {targets = gp.tensor({0, 5, 1}, I64)}) end, 'distill_loss', 'target 5', '5 classes')
  T.raises(function() gp.distill_loss(s, t, {alpha = 0.5}) end, 'distill_loss', 'alpha', 'targets')
  T.raises(function() gp.distill_loss(s, t, {alpha = 2, targets = tg}) end, 'distill_loss', 'alpha', '[0, 1]')
  T.raises(function() gp.distill_loss(s, t, {reduction = 'avg'}) end, 'distill_loss', 'reduction')
  T.raises(function() gp.distill_loss(s, 3) end, 'distill_loss', 'tensors')
  T.raises(function() gp.distill_loss(gp.randint(0, 3, {3, 5}, I64), t) end, 'distill_loss', 'floating point')
  -- the kernel checks its scalars too
  local loss = gp.empty({3}, {device = 'cpu'})
  T.raises(function() gp.k.distill_loss(loss, s, t, tg, 0, 0.5, 0, -100) end, 'distill_loss', 'temperature')
  T.raises(function() gp.k.distill_loss(loss, s, t, tg, 1, 0.5, 3, -100) end, 'distill_loss', 'kind')
end)

-- the head-fused variant: the student's logits h @ w^T made chunk by chunk, never whole
T.test('linear_distill_loss equals distill_loss(h @ w^T) in f64: loss, dh, dw; kinds, chunks, ignored rows, no targets', function()
  local h0, w0 = gp.randn({2, 3, 6}, CPU64), gp.randn({11, 6}, CPU64)
  local t0 = gp.randn({2, 3, 11}, CPU64) * 2
  local tg = gp.tensor({{1, -100, 4}, {0, 10, 3}}, I64)
  for _, kind in ipairs(KINDS) do
    for _, c in ipairs {{chunk = 1, alpha = 0.3, targets = tg}, {chunk = 4, reduction = 'sum'}, {chunk = 6, targets = tg}} do
      local o = {kind = kind, temperature = 2, alpha = c.alpha, targets = c.targets, reduction = c.reduction, chunk = c.chunk}
      local h1, w1 = h0:clone():requires_grad(), w0:clone():requires_grad()
      local got = gp.linear_distill_loss(h1, w1, t0, o)
      T.eq(rawget(got, '_node').name, 'linear_distill_loss')
      got:backward()
      local h2, w2 = h0:clone():requires_grad(), w0:clone():requires_grad()
      local want = gp.distill_loss(h2:matmul(w2:t()), t0, o)
      want:backward()
      local what = string.format('%s chunk %d', kind, c.chunk)
      T.ok(T.relnorm(got, want) < 1e-12, what .. ' loss')
      -- (1e-6: the loss, so its upstream gradient and the mean's 1 / count, are f32)
      T.ok(T.relnorm(h1.grad, h2.grad) < 1e-6 and T.relnorm(w1.grad, w2.grad) < 1e-6, what .. ' dh, dw')
    end
  end
  -- (the loss is f32: a larger step keeps the rounding out of the differences)
  T.ok(gp.gradcheck(function(hh, ww) return gp.linear_distill_loss(hh, ww, t0, {kind = 'jsd', targets = tg, chunk = 4}) end,
    {h0:clone(), w0:clone()}, {eps = 1e-2, atol = 1e-4, rtol = 1e-3}))
  local l, dh, dw = gp.linear_distill_loss(h0, w0, t0, {targets = tg, grad = true})
  local s = h0:matmul(w0:t()):requires_grad()
  gp.distill_loss(s, t0, {targets = tg}):backward()
  T.ok(T.relnorm(dh, s.grad:matmul(w0)) < 1e-6 and T.relnorm(dw, s.grad:reshape {6, 11}:t():matmul(h0:reshape {6, 6})) < 1e-6)
  T.eq(l:dim(), 0)
  local none = gp.linear_distill_loss(h0, w0, t0, {reduction = 'none', chunk = 4})
  T.same(none.shape, {2, 3})
  T.ok(T.relnorm(none, gp.distill_loss(h0:matmul(w0:t()), t0, {reduction = 'none'})) < 1e-12)
end)

T.test('linear_distill_loss: bad input', function()
  local h, w, t = gp.randn({4, 6}, CPU64), gp.randn({10, 6}, CPU64), gp.randn({4, 10}, CPU64)
  T.raises(function() gp.linear_distill_loss(h, gp.randn({10, 5}, CPU64), t) end, 'linear_distill_loss', '(4,6)', '(10,5)')
  T.raises(function() gp.linear_distill_loss(h, w, gp.randn({4, 9}, CPU64)) end, 'linear_distill_loss', '(4,10)', '(4,9)')
  T.raises(function() gp.linear_distill_loss(h, w, t, {temperature = 0}) end, 'linear_distill_loss', 'temperature')
  T.raises(function() gp.linear_distill_loss(h, w, t, {alpha = 0.5}) end, 'linear_distill_loss', 'targets')
  T.raises(function() gp.linear_distill_loss(h, w, t, {chunk = 0}) end, 'linear_distill_loss', 'chunk')
  T.raises(function() gp.linear_distill_loss(h:clone():requires_grad(), w, t, {reduction = 'none'}) end,
    'linear_distill_loss', "'none'", 'gradient')
  T.raises(function() gp.linear_distill_loss(h, w, t, {targets = gp.tensor({0, 1, 2}, I64)}) end, 'linear_distill_loss', '(4)', '(3)')
end)

T.test('linear_distill_loss (cuda): bf16 at SmolLM2\'s vocabulary equals distill_loss(h @ w^T), loss and gradients', function()
  T.cuda()
  local o = {dtype = 'bf16', device = 'cuda'}
  local h0, w0 = gp.randn({300, 64}, o), gp.randn({49152, 64}, o) * 0.2
  local t0 = gp.randn({300, 49152}, o) * 2
  local tg = gp.randint(0, 49152, {300}, {device = 'cuda'})
  local op = {temperature = 2, alpha = 0.5, targets = tg, chunk = 128}
  local h1, w1 = h0:clone():requires_grad(), w0:clone():requires_grad()
  local got = gp.linear_distill_loss(h1, w1, t0, op)
  got:backward()
  local h2, w2 = h0:clone():requires_grad(), w0:clone():requires_grad()
  local want = gp.distill_loss(h2:matmul(w2:t()), t0, op)
  want:backward()
  T.ok(T.relnorm(got, want) < 1e-3, 'loss ' .. T.relnorm(got, want))
  T.ok(T.relnorm(h1.grad:float(), h2.grad:float()) < 2e-2, 'dh ' .. T.relnorm(h1.grad:float(), h2.grad:float()))
  T.ok(T.relnorm(w1.grad:float(), w2.grad:float()) < 2e-2, 'dw ' .. T.relnorm(w1.grad:float(), w2.grad:float()))
end)

T.test('scripts/distill.lua --tiny: hard-target and distilled students, 2 seeds, held-out losses, JSONL log', function()
  local log = os.tmpname()
  local out, rc = T.sh(string.format('%s --device cpu %s/scripts/distill.lua --tiny --quiet --log %s', T.exe, T.root, log))
  T.eq(rc, 0, out)
  T.ok(out:find('teacher held-out loss', 1, true), out)
  T.ok(out:find('seed 1: hard targets', 1, true) and out:find('seed 2: hard targets', 1, true), out)
  T.ok(out:find('mean over 2 seeds', 1, true), out)
  local recs = gp.data.jsonl(log)
  os.remove(log)
  local results, summary = {}, nil
  for _, r in ipairs(recs) do
    if r.event == 'result' then results[#results + 1] = r end
    if r.event == 'summary' then summary = r end
  end
  T.eq(#results, 4)
  for _, r in ipairs(results) do T.ok(r.heldout_loss > 0 and r.heldout_loss < 10, 'a finite held-out loss') end
  -- the same init and batches: the two arms of a seed differ only by the loss
  T.ok(results[1].arm == 'hard' and results[2].arm == 'distill' and results[1].seed == results[2].seed)
  T.ok(summary and math.abs(summary.mean_diff - ((results[2].heldout_loss - results[1].heldout_loss) +
    (results[4].heldout_loss - results[3].heldout_loss)) / 2) < 1e-9)
end)
