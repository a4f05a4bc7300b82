-- softmax, log_softmax, LayerNorm, RMSNorm: Lua oracles, finite-difference
-- checks of every backward kernel (f64 on the CPU), errors, CUDA row shapes.
local T = require 'lib'
local gp = require 'gpush'
local fd = require 'fd'

T.test('softmax and log_softmax against a Lua oracle, any dim', function()
  local x = gp.randn({3, 4, 5}, {device = 'cpu'})
  for _, d in ipairs {3, -1, 1, 2} do
    local s, ls = x:softmax(d), x:log_softmax(d)
    local xt, st, lt = x:totable(), s:totable(), ls:totable()
    for a = 1, 3 do for b = 1, 4 do for c = 1, 5 do
      local idx = {a, b, c}
      local dd = d < 0 and 3 + d + 1 or d
      local n = ({3, 4, 5})[dd]
      local m, z = -math.huge, 0
      local pos = idx[dd]
      for k = 1, n do idx[dd] = k; m = math.max(m, xt[idx[1]][idx[2]][idx[3]]) end
      for k = 1, n do idx[dd] = k; z = z + math.exp(xt[idx[1]][idx[2]][idx[3]] - m) end
      idx[dd] = pos
      local v = xt[a][b][c]
      T.near(st[a][b][c], math.exp(v - m) / z, 1e-6)
      T.near(lt[a][b][c], v - m - math.log(z), 1e-5)
    end end end
  end
end)

T.test('layer_norm and rms_norm against a Lua oracle', function()
  local x = gp.randn({5, 9}, {device = 'cpu'})
  local w, b = gp.randn({9}, {device = 'cpu'}), gp.randn({9}, {device = 'cpu'})
  local y, mean, rstd = gp.layer_norm(x, w, b, 1e-5)
  local r, rr = gp.rms_norm(x, w, 1e-6)
  local xt, wt, bt, yt, rt = x:totable(), w:totable(), b:totable(), y:totable(), r:totable()
  for i = 1, 5 do
    local m, v, q = 0, 0, 0
    for j = 1, 9 do m = m + xt[i][j] / 9; q = q + xt[i][j] ^ 2 / 9 end
    for j = 1, 9 do v = v + (xt[i][j] - m) ^ 2 / 9 end
    T.near(mean:totable()[i], m, 1e-6)
    T.near(rstd:totable()[i], 1 / math.sqrt(v + 1e-5), 1e-5)
    T.near(rr:totable()[i], 1 / math.sqrt(q + 1e-6), 1e-5)
    for j = 1, 9 do
      T.near(yt[i][j], (xt[i][j] - m) / math.sqrt(v + 1e-5) * wt[j] + bt[j], 1e-5)
      T.near(rt[i][j], xt[i][j] / math.sqrt(q + 1e-6) * wt[j], 1e-5)
    end
  end
  -- without weights: plain normalization
  local z = gp.layer_norm(x)
  T.ok(math.abs(z:sum(2):totable()[1]) < 1e-4)
end)

-- backward kernels against finite differences of their forward (f64, CPU)
T.test('softmax/log_softmax backward: finite differences', function()
  for _, lg in ipairs {false, true} do
    local fwd = lg and 'log_softmax' or 'softmax'
    local x, dy = fd.randn {3, 7}, fd.randn {3, 7}
    local y = x[fwd](x)
    local dx = gp.empty({3, 7}, {dtype = 'f64', device = 'cpu'})
    gp.k[fwd .. '_backward'](dx, y, dy)
    fd.check(fwd .. ' dx', dx, fd.grad(function(t) return t[fwd](t) end, {x}, 1, dy), 1e-6)
  end
end)

T.test('layer_norm backward: finite differences of dx, dw, db', function()
  local R, D = 4, 6
  local x, w, b, dout = fd.randn {R, D}, fd.randn {D}, fd.randn {D}, fd.randn {R, D}
  local f = function(xx, ww, bb) return (gp.layer_norm(xx, ww, bb, 1e-5)) end
  local _, mean, rstd = gp.layer_norm(x, w, b, 1e-5)
  local dx = gp.empty({R, D}, {dtype = 'f64', device = 'cpu'})
  local dw, db = gp.empty({D}, {dtype = 'f64', device = 'cpu'}), gp.empty({D}, {dtype = 'f64', device = 'cpu'})
  gp.k.layer_norm_backward(dx, dw, db, x, w, mean, rstd, dout)
  -- mean and rstd are saved in f32: gradients agree to f32 precision
  fd.check('layer_norm dx', dx, fd.grad(f, {x, w, b}, 1, dout), 1e-5)
  fd.check('layer_norm dw', dw, fd.grad(f, {x, w, b}, 2, dout), 1e-5)
  fd.check('layer_norm db', db, fd.grad(f, {x, w, b}, 3, dout), 1e-5)
end)

T.test('rms_norm backward: finite differences of dx, dw', function()
  local R, D = 3, 8
  local x, w, dout = fd.randn {R, D}, fd.randn {D}, fd.randn {R, D}
  local f = function(xx, ww) return (gp.rms_norm(xx, ww, 1e-5)) end
  local _, rstd = gp.rms_norm(x, w, 1e-5)
  local dx, dw = gp.empty({R, D}, {dtype = 'f64', device = 'cpu'}), gp.empty({D}, {dtype = 'f64', device = 'cpu'})
  gp.k.rms_norm_backward(dx, dw, x, w, rstd, dout)
  fd.check('rms_norm dx', dx, fd.grad(f, {x, w}, 1, dout), 1e-5)
  fd.check('rms_norm dw', dw, fd.grad(f, {x, w}, 2, dout), 1e-5)
end)

-- through gp.add_<norm>_norm's rule (nparam: w, or w and b): the same gradients
-- as the norm and the add apart (gradcheck in f64), and the residual stream's
-- gradient added by <norm>_norm_backward_add, no add kernel
local function fused_rule(norm, nparam)
  local cpu = {dtype = 'f64', device = 'cpu'}
  local f = gp['add_' .. norm .. '_norm']
  local ps = {}
  for i = 1, nparam do ps[i] = gp.randn({9}, cpu) end
  gp.gradcheck(function(a, b, ...)
    local n, h = f(a, b, ...)
    return n * 0.5 + h * h -- both outputs carry a gradient
  end, {gp.randn({3, 4, 9}, cpu), gp.randn({3, 4, 9}, cpu), unpack(ps)})
  local xr, rr = gp.randn({3, 4, 9}, cpu):requires_grad(), gp.randn({3, 4, 9}, cpu):requires_grad()
  local n, h = f(xr, rr, unpack(ps))
  local loss = (n * gp.randn({3, 4, 9}, cpu) + h * gp.randn({3, 4, 9}, cpu)):sum()
  local _, k = T.launches(function() loss:backward() end)
  T.eq(k[norm .. '_norm_backward_add'], 1)
  T.eq(k[norm .. '_norm_backward'], 0)
  T.eq(k.add, 0, 'no add kernel in add_' .. norm .. '_norm\'s backward')
end

-- run(dev, dt, R, D, acc, seed)'s first outputs (named by names) on the GPU
-- against the CPU, f32 and bf16, accumulate 0 and 1, over shapes {R, D}
local function cuda_vs_cpu(run, names, shapes)
  for _, dt in ipairs {'f32', 'bf16'} do
    local tol = dt == 'f32' and 1e-4 or 1e-2
    for _, c in ipairs(shapes) do
      for _, acc in ipairs {0, 1} do
        local g = {run('cuda', dt, c[1], c[2], acc, 5)}
        local r = {run('cpu', dt, c[1], c[2], acc, 5)}
        local what = string.format('%s %dx%d acc %d', dt, c[1], c[2], acc)
        for i, nm in ipairs(names) do
          local e = T.relnorm(g[i]:float(), r[i]:float())
          T.ok(e < tol, what .. ' ' .. nm .. ' ' .. e)
        end
      end
    end
  end
end

-- rms_norm_backward_add: dx + dres in one pass (add_rms_norm's backward: the
-- norm's gradient of h plus the residual stream's), dw as rms_norm_backward
T.test('rms_norm_backward_add: rms_norm_backward\'s dx plus dres, dw unchanged (cpu; cuda against the cpu)', function()
  local function run(dev, dt, R, D, acc, seed)
    gp.manual_seed(seed)
    local o = {dtype = dt, device = 'cpu'}
    local x, w, dout, dres = gp.randn({R, D}, o), gp.randn({D}, o), gp.randn({R, D}, o), gp.randn({R, D}, o)
    local dw0 = gp.randn({D}, o)
    x, w, dout, dres = x:to(dev), w:to(dev), dout:to(dev), dres:to(dev)
    local _, rs = gp.rms_norm(x, w)
    -- (dw0:clone(): on the CPU :to(dev) is dw0 itself, and both calls would accumulate into it)
    local dx, dw = gp.full({R, D}, 77, {dtype = dt, device = dev}), dw0:clone():to(dev)
    gp.k.rms_norm_backward_add(dx, dw, x, w, rs, dout, dres, acc)
    local rdx, rdw = gp.empty({R, D}, {dtype = dt, device = dev}), dw0:clone():to(dev)
    gp.k.rms_norm_backward(rdx, rdw, x, w, rs, dout, acc)
    return dx:cpu(), dw:cpu(), rdx:cpu(), rdw:cpu(), dres:cpu()
  end
  for _, acc in ipairs {0, 1} do
    local dx, dw, rdx, rdw, dres = run('cpu', 'f64', 5, 7, acc, 3)
    T.ok(T.relnorm(dx, rdx + dres) < 1e-15, 'dx + dres')
    T.eq(T.relnorm(dw, rdw), 0, 'dw')
  end
  fused_rule('rms', 1)
  T.cuda()
  cuda_vs_cpu(run, {'dx', 'dw'}, {{4096, 128}, {64, 4096}, {300, 33}, {1, 5}, {7, 576}})
end)

-- layer_norm_backward_add: the same for LayerNorm (add_layer_norm's backward), dw and db as layer_norm_backward
T.test('layer_norm_backward_add: layer_norm_backward\'s dx plus dres, dw and db unchanged (cpu; cuda against the cpu)', function()
  local function run(dev, dt, R, D, acc, seed)
    gp.manual_seed(seed)
    local o = {dtype = dt, device = 'cpu'}
    local x, w, b, dout, dres = gp.randn({R, D}, o), gp.randn({D}, o), gp.randn({D}, o), gp.randn({R, D}, o),
      gp.randn({R, D}, o)
    local dw0, db0 = gp.randn({D}, o), gp.randn({D}, o)
    x, w, b, dout, dres = x:to(dev), w:to(dev), b:to(dev), dout:to(dev), dres:to(dev)
    local _, mean, rs = gp.layer_norm(x, w, b)
    local dx, dw, db = gp.full({R, D}, 77, {dtype = dt, device = dev}), dw0:clone():to(dev), db0:clone():to(dev)
    gp.k.layer_norm_backward_add(dx, dw, db, x, w, mean, rs, dout, dres, acc)
    local rdx, rdw, rdb = gp.empty({R, D}, {dtype = dt, device = dev}), dw0:clone():to(dev), db0:clone():to(dev)
    gp.k.layer_norm_backward(rdx, rdw, rdb, x, w, mean, rs, dout, acc)
    return dx:cpu(), dw:cpu(), db:cpu(), rdx:cpu(), rdw:cpu(), rdb:cpu(), dres:cpu()
  end
  for _, acc in ipairs {0, 1} do
    local dx, dw, db, rdx, rdw, rdb, dres = run('cpu', 'f64', 5, 7, acc, 3)
    T.ok(T.relnorm(dx, rdx + dres) < 1e-15, 'dx + dres')
    T.eq(T.relnorm(dw, rdw), 0, 'dw')
    T.eq(T.relnorm(db, rdb), 0, 'db')
  end
  fused_rule('layer', 2)
  T.cuda()
  cuda_vs_cpu(run, {'dx', 'dw', 'db'}, {{4096, 128}, {64, 4096}, {300, 33}, {1, 5}, {7, 576}, {8192, 768}})
end)

T.test('rows errors name the op and the shapes', function()
  local x = gp.randn({4, 8}, {device = 'cpu'})
  T.raises(function() gp.layer_norm(x, gp.ones({7}, {device = 'cpu'})) end, 'layer_norm', 'w', '(7)', '(4,8)')
  T.raises(function() gp.rms_norm(x, gp.ones({2, 4}, {device = 'cpu'})) end, 'rms_norm', '(2,4)')
  T.raises(function() gp.layer_norm(x, nil, 3) end, 'layer_norm', 'b must be a tensor')
  T.raises(function() x:softmax(3) end, 'softmax', 'out of range')
  T.raises(function() gp.k.softmax(gp.empty({4, 7}, {device = 'cpu'}), x) end, 'softmax', '(4,7)', '(4,8)')
  T.raises(function() gp.k.softmax(gp.empty({4, 8}, {dtype = 'bf16', device = 'cpu'}), x) end, 'softmax', 'bf16', 'f32')
  T.raises(function() gp.k.softmax(gp.empty({8, 4}, {device = 'cpu'}):t(), x) end, 'softmax', 'contiguous')
  T.raises(function()
    gp.k.rms_norm(gp.empty({4, 8}, {device = 'cpu'}), gp.empty({4}, {dtype = 'bf16', device = 'cpu'}), x, gp.ones({8}, {device = 'cpu'}))
  end, 'rms_norm', 'rstd', 'f32')
  T.raises(function() gp.k.layer_norm(x, gp.empty({4}), gp.empty({4}), x, gp.ones {8}, gp.zeros {8}, -1) end, 'layer_norm')
  T.cuda()
  T.raises(function() gp.layer_norm(x:cuda(), gp.ones({8}, {device = 'cpu'})) end, 'layer_norm', 'cpu', 'cuda')
end)

-- CUDA: the bench shapes, unaligned rows (scalar path) and long rows (fallback) against the CPU
T.test('cuda rows against the cpu: wide, unaligned, long rows', function()
  T.cuda()
  local cases = {{64, 4096}, {16, 8192}, {3, 16384}, {2, 40000}, {300, 33}, {5, 1}}
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    local tol = dt == 'f32' and 1e-5 or dt == 'f16' and 2e-3 or 1e-2
    for _, c in ipairs(cases) do
      local R, D = c[1], c[2]
      for _, off in ipairs {0, 1} do
        local base = gp.randn({R * D + 1}, {device = 'cpu'}):to(dt)
        local xc = base:narrow(1, 1 + off, R * D):view {R, D}
        local xg = base:cuda():narrow(1, 1 + off, R * D):view {R, D}
        local w = gp.randn({D}, {device = 'cpu'}):to(dt)
        local b = gp.randn({D}, {device = 'cpu'}):to(dt)
        local what = string.format('%s %dx%d offset %d', dt, R, D, off)
        T.ok(T.relnorm(xg:softmax(), xc:softmax()) <= tol, 'softmax ' .. what)
        T.ok(T.relnorm(xg:log_softmax(), xc:log_softmax()) <= tol, 'log_softmax ' .. what)
        T.ok(T.relnorm(gp.layer_norm(xg, w:cuda(), b:cuda()), gp.layer_norm(xc, w, b)) <= tol, 'layer_norm ' .. what)
        T.ok(T.relnorm(gp.rms_norm(xg, w:cuda()), gp.rms_norm(xc, w)) <= tol, 'rms_norm ' .. what)
        local oc, rc = gp.add_rms_norm(xc, xc, w)
        local og, rg = gp.add_rms_norm(xg, xg, w:cuda())
        T.ok(T.relnorm(og, oc) <= tol and T.relnorm(rg, rc) <= tol, 'add_rms_norm ' .. what)
        T.ok(T.relnorm(gp.bias_gelu(xg, b:cuda()), gp.bias_gelu(xc, b)) <= tol, 'bias_gelu ' .. what)
      end
    end
  end
end)

-- accumulate = 1 adds dw, db into random existing values (f32 partial sums,
-- one add at the end); many rows: the column sums are split over blocks
T.test('layer_norm_backward and rms_norm_backward: accumulate into dw, db (cpu exact; cuda against the cpu)', function()
  local function run(dev, dt, R, D, acc, seed)
    gp.manual_seed(seed)
    local o = {dtype = dt, device = 'cpu'}
    local x, w, b, dout = gp.randn({R, D}, o), gp.randn({D}, o), gp.randn({D}, o), gp.randn({R, D}, o)
    local dw, db, rdw = gp.randn({D}, o), gp.randn({D}, o), gp.randn({D}, o)
    local old = {dw:clone(), db:clone(), rdw:clone()}
    x, w, b, dout, dw, db, rdw = x:to(dev), w:to(dev), b:to(dev), dout:to(dev), dw:to(dev), db:to(dev), rdw:to(dev)
    local _, mean, rstd = gp.layer_norm(x, w, b)
    local dx = gp.empty({R, D}, {dtype = dt, device = dev})
    gp.k.layer_norm_backward(dx, dw, db, x, w, mean, rstd, dout, acc)
    local _, rs = gp.rms_norm(x, w)
    local rdx = gp.empty({R, D}, {dtype = dt, device = dev})
    gp.k.rms_norm_backward(rdx, rdw, x, w, rs, dout, acc)
    return {dx:cpu(), dw:cpu(), db:cpu(), rdx:cpu(), rdw:cpu()}, old
  end
  -- cpu: accumulate = 1 gives the old values plus accumulate = 0's; dx is overwritten
  local a0 = run('cpu', 'f64', 5, 7, 0, 3)
  local a1, old = run('cpu', 'f64', 5, 7, 1, 3)
  T.ok(T.relnorm(a1[1], a0[1]) == 0 and T.relnorm(a1[4], a0[4]) == 0, 'dx is overwritten')
  T.ok(T.relnorm(a1[2], old[1] + a0[2]) < 1e-14, 'dw added')
  T.ok(T.relnorm(a1[3], old[2] + a0[3]) < 1e-14, 'db added')
  T.ok(T.relnorm(a1[5], old[3] + a0[5]) < 1e-14, 'rms dw added')
  T.cuda()
  local names = {'dx', 'dw', 'db', 'rms dx', 'rms dw'}
  for _, dt in ipairs {'f32', 'bf16'} do
    local tol = dt == 'f32' and 1e-4 or 1e-2
    for _, c in ipairs {{4096, 128}, {64, 4096}, {300, 33}, {1, 5}, {2000, 1024}, {513, 2048}} do
      for _, acc in ipairs {0, 1} do
        local g, ref = run('cuda', dt, c[1], c[2], acc, 5), (run('cpu', dt, c[1], c[2], acc, 5))
        for i = 1, 5 do
          local r = T.relnorm(g[i], ref[i])
          T.ok(r <= tol, string.format('%s %s %dx%d accumulate %d: relative norm %g', names[i], dt, c[1], c[2], acc, r))
        end
      end
    end
  end
end)
