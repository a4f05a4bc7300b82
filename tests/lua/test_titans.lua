-- Titans memory: the chunk-weight kernels (gradcheck, CPU vs CUDA), the
-- chunked memory against a plain-Lua f64 reference of the definition (chunk 1
-- is the token-by-token recurrence), gradchecks of the whole update chain for
-- both memory kinds, the MAC and SWA models, and a recall smoke run of
-- scripts/titans.lua.
local T = require 'lib'
local gp = require 'gpush'
local titans = gp.titans

local F64 = {dtype = 'f64', device = 'cpu'}

-- plain Lua helpers on nested tables
local function tab(t) return t:totable() end
local function matvec(M, x)
  local r = {}
  for i = 1, #M do
    local s = 0
    for j = 1, #x do s = s + M[i][j] * x[j] end
    r[i] = s
  end
  return r
end
local function matTvec(M, x) -- M^T x
  local r = {}
  for j = 1, #M[1] do
    local s = 0
    for i = 1, #M do s = s + M[i][j] * x[i] end
    r[j] = s
  end
  return r
end
local function sig(z) return 1 / (1 + math.exp(-z)) end
local function silu(z) return z * sig(z) end
local function dsilu(z) local s = sig(z); return s * (1 + z * (1 - s)) end
local function zeros(r, c)
  local m = {}
  for i = 1, r do m[i] = {}; for j = 1, c do m[i][j] = 0 end end
  return m
end
local function copy(m)
  local r = {}
  for i = 1, #m do r[i] = {unpack(m[i])} end
  return r
end

-- the definition, token by token inside each chunk, in doubles: gradients of
-- ||M(k_t) - v_t||^2 at the chunk's starting weights, S_t = eta_t S_{t-1} -
-- theta_t grad, W_t = (1 - alpha_t) W_{t-1} + S_t, y_t = M_start(q_t)
local function reference(kind, init, k, v, q, theta, eta, alpha, b)
  local K, V, Q, TH, E, A = tab(k), tab(v), tab(q), tab(theta), tab(eta), tab(alpha)
  local names = kind == 'linear' and {'M'} or {'W1', 'W2'}
  local Y, FIN = {}, {}
  for n = 1, #K do
    local W, S = {}, {}
    for _, nm in ipairs(names) do
      W[nm] = copy(tab(init[nm])[n])
      S[nm] = zeros(#W[nm], #W[nm][1])
    end
    Y[n] = {}
    local Tn = #K[n]
    local t0 = 1
    while t0 <= Tn do
      local t1 = math.min(Tn, t0 + b - 1)
      local W0 = {}
      for _, nm in ipairs(names) do W0[nm] = copy(W[nm]) end
      for t = t0, t1 do
        local kt, vt, qt = K[n][t], V[n][t], Q[n][t]
        local grads = {}
        if kind == 'linear' then
          Y[n][t] = matvec(W0.M, qt)
          local o = matvec(W0.M, kt)
          local g = zeros(#o, #kt)
          for i = 1, #o do for j = 1, #kt do g[i][j] = 2 * (o[i] - vt[i]) * kt[j] end end
          grads.M = g
        else
          local hq = matvec(W0.W1, qt)
          for i = 1, #hq do hq[i] = silu(hq[i]) end
          Y[n][t] = matvec(W0.W2, hq)
          local z = matvec(W0.W1, kt)
          local a = {}
          for i = 1, #z do a[i] = silu(z[i]) end
          local o = matvec(W0.W2, a)
          local e = {}
          for i = 1, #o do e[i] = 2 * (o[i] - vt[i]) end
          local g2 = zeros(#o, #a)
          for i = 1, #o do for j = 1, #a do g2[i][j] = e[i] * a[j] end end
          local da = matTvec(W0.W2, e)
          local g1 = zeros(#z, #kt)
          for i = 1, #z do for j = 1, #kt do g1[i][j] = da[i] * dsilu(z[i]) * kt[j] end end
          grads.W1, grads.W2 = g1, g2
        end
        for _, nm in ipairs(names) do
          local s, w, g = S[nm], W[nm], grads[nm]
          for i = 1, #s do
            for j = 1, #s[1] do
              s[i][j] = E[n][t] * s[i][j] - TH[n][t] * g[i][j]
              w[i][j] = (1 - A[n][t]) * w[i][j] + s[i][j]
            end
          end
        end
      end
      t0 = t1 + 1
    end
    FIN[n] = {W = W, S = S}
  end
  return Y, FIN
end

local function inputs(kind, N, Tn, d, h, dt, dev)
  local o = {dtype = dt or 'f64', device = dev or 'cpu'}
  local r = {
    k = titans.l2norm(gp.randn({N, Tn, d}, o)), v = gp.randn({N, Tn, d}, o), q = titans.l2norm(gp.randn({N, Tn, d}, o)),
    theta = gp.rand({N, Tn}, o) * 0.5, eta = gp.rand({N, Tn}, o) * 0.5 + 0.4, alpha = gp.rand({N, Tn}, o) * 0.2,
  }
  if kind == 'linear' then r.init = {M = gp.randn({N, d, d}, o) * 0.5}
  else r.init = {W1 = gp.randn({N, h, d}, o) * 0.5, W2 = gp.randn({N, d, h}, o) * 0.5} end
  return r
end
local function run_scan(kind, x, b)
  return titans.memory_scan {kind = kind, init = x.init, k = x.k, v = x.v, q = x.q, theta = x.theta, eta = x.eta,
                             alpha = x.alpha, chunk = b}
end

for _, kind in ipairs {'linear', 'mlp'} do
  for _, b in ipairs {1, 3, 4, 5, 11} do -- 1 and 5: whole chunks (the linear memory's fused kernel)
    T.test(string.format('titans %s memory, chunk %d: equals the plain-Lua definition%s', kind, b,
      b == 1 and ' (the token-by-token recurrence)' or ''), function()
      gp.manual_seed(7 + b)
      local N, Tn, d, h = 2, 10, 3, 5
      local x = inputs(kind, N, Tn, d, h)
      local y, st = run_scan(kind, x, b)
      local Y, FIN = reference(kind, x.init, x.k, x.v, x.q, x.theta, x.eta, x.alpha, b)
      local tol = 1e-12
      T.same(y:totable(), Y, tol, 'y')
      for _, nm in ipairs(titans.NAMES[kind]) do
        local W, S = st[nm]:totable(), st['S_' .. nm]:totable()
        for n = 1, N do
          T.same(W[n], FIN[n].W[nm], tol, nm)
          T.same(S[n], FIN[n].S[nm], tol, 'S_' .. nm)
        end
      end
    end)
  end

  T.test('titans ' .. kind .. ' memory: gradcheck of the update chain (f64, chunk 2 with a tail)', function()
    gp.manual_seed(3)
    local N, Tn, d, h = 2, 5, 2, 3
    local x = inputs(kind, N, Tn, d, h)
    local names = titans.NAMES[kind]
    local list = {x.k, x.v, x.q, x.theta, x.eta, x.alpha}
    for _, nm in ipairs(names) do list[#list + 1] = x.init[nm]:contiguous() end
    for i, t in ipairs(list) do list[i] = t:detach():contiguous() end
    T.ok(gp.gradcheck(function(k, v, q, th, e, a, w1, w2)
      local init = kind == 'linear' and {M = w1} or {W1 = w1, W2 = w2}
      local y, st = titans.memory_scan {kind = kind, init = init, k = k, v = v, q = q, theta = th, eta = e, alpha = a,
                                        chunk = 2}
      local parts = {y:reshape {-1}}
      for _, nm in ipairs(names) do
        parts[#parts + 1] = st[nm]:reshape {-1}
        parts[#parts + 1] = st['S_' .. nm]:reshape {-1}
      end
      return gp.cat(parts, 1)
    end, list))
  end)
end

T.test('titans linear memory: the fused kernel (gp.titans_scan) equals the chunk loop in y, the state and every gradient (f64)', function()
  gp.manual_seed(5)
  local N, Tn, d, b = 3, 12, 5, 4
  local x = inputs('linear', N, Tn, d)
  local S0 = gp.randn({N, d, d}, F64) * 0.1
  local leaves = {x.k, x.v, x.q, x.theta, x.eta, x.alpha, x.init.M, S0}
  for _, t in ipairs(leaves) do t:requires_grad_() end
  local gy, gm, gs = gp.randn({N, Tn, d}, F64), gp.randn({N, d, d}, F64), gp.randn({N, d, d}, F64)
  local function run(fused)
    for _, t in ipairs(leaves) do t.grad = nil end
    local y, st
    local _, n = T.launches(function()
      y, st = titans.memory_scan {kind = 'linear', init = x.init, momentum = {M = S0}, k = x.k, v = x.v, q = x.q,
                                  theta = x.theta, eta = x.eta, alpha = x.alpha, chunk = b, fused = fused}
      ;((y * gy):sum() + (st.M * gm):sum() + (st.S_M * gs):sum()):backward()
    end)
    T.eq(n.titans_scan, fused == false and 0 or 1, 'titans_scan launches')
    T.eq(n.titans_scan_backward, fused == false and 0 or 1, 'titans_scan_backward launches')
    local g = {}
    for i, t in ipairs(leaves) do g[i] = t.grad end
    return y, st, g
  end
  local y1, s1, g1 = run(nil)
  local y2, s2, g2 = run(false)
  T.ok(T.relnorm(y1, y2) < 1e-13, 'y')
  T.ok(T.relnorm(s1.M, s2.M) < 1e-13 and T.relnorm(s1.S_M, s2.S_M) < 1e-13, 'final state')
  for i = 1, #leaves do T.ok(T.relnorm(g1[i], g2[i]) < 1e-12, 'gradient ' .. i) end
end)

T.test('titans_scan: gradcheck of all nine inputs (f64), and bad input', function()
  gp.manual_seed(9)
  local N, Tn, d, C = 2, 6, 2, 3
  local o = F64
  local args = {titans.l2norm(gp.randn({N, Tn, d}, o)), gp.randn({N, Tn, d}, o), titans.l2norm(gp.randn({N, Tn, d}, o)),
                gp.rand({N, Tn}, o) * 0.5, gp.rand({N, Tn}, o), gp.rand({N, Tn}, o), gp.rand({N, C, 3}, o),
                gp.randn({N, d, d}, o) * 0.5, gp.randn({N, d, d}, o) * 0.1}
  T.ok(gp.gradcheck(function(...)
    local y, M, S = gp.titans_scan(...)
    return gp.cat({y:reshape {-1}, M:reshape {-1}, S:reshape {-1}}, 1)
  end, args))
  local bad = {unpack(args)}
  bad[7] = gp.rand({N, 4, 3}, o)
  T.raises(function() gp.titans_scan(unpack(bad)) end, 'titans_scan', '6 tokens', '4 chunks')
  bad[7] = args[7]
  bad[2] = gp.randn({N, Tn, d + 1}, o)
  T.raises(function() gp.titans_scan(unpack(bad)) end, 'titans_scan')
  bad[2] = args[2]
  bad[9] = 'S'
  T.raises(function() gp.titans_scan(unpack(bad)) end, 'titans_scan', 'S0 must be a tensor')
end)

T.test('causal_conv1d: equals the shifted sum, gradcheck (f64), bad input', function()
  gp.manual_seed(4)
  local x, w = gp.randn({2, 7, 3}, F64), gp.randn({4, 3}, F64)
  local y = gp.causal_conv1d(x, w)
  local X, W, Y = x:totable(), w:totable(), y:totable()
  for b = 1, 2 do
    for t = 1, 7 do
      for c = 1, 3 do
        local s = 0
        for j = 1, 4 do
          local u = t - 4 + j
          if u >= 1 then s = s + W[j][c] * X[b][u][c] end
        end
        T.near(Y[b][t][c], s, 1e-12, 'y')
      end
    end
  end
  T.ok(gp.gradcheck(function(a, b) return gp.causal_conv1d(a, b) end, {x, w}))
  -- x in f32 and w in f64: w is used in x's dtype, its gradient comes back in f64
  local wf = gp.randn({4, 3}, F64):requires_grad_()
  gp.causal_conv1d(gp.randn({2, 7, 3}, {device = 'cpu'}), wf):sum():backward()
  T.eq(wf.grad.dtype, 'f64')
  T.raises(function() gp.causal_conv1d(x, gp.randn({4, 2}, F64)) end, 'causal_conv1d', '(2,7,3)', '(4,2)')
  T.raises(function() gp.causal_conv1d(x:reshape {14, 3}, w) end, 'causal_conv1d', '(B, T, C)')
end)

-- the compositions titans_gates and titans_prep replace (what NeuralMemory computed before them)
local function gates_ref(g, b)
  local B, Tn, H = g:size(1), g:size(2), g:size(4)
  local function heads(t) return t:transpose(2, 3):reshape {B * H, Tn} end
  local th = g:select(3, 1):sigmoid() * (1 / b)
  local m = g:narrow(3, 2, 2):reshape {B, Tn / b, b, 2, H}:mean(3) -- (B, nc, 2, H)
  local e = m:select(3, 1):sigmoid()
  local keep = ((m:select(3, 2) * -1):sigmoid():log() * (1 / b)):exp()
  local function per_token(t) return t:reshape {B, Tn / b, 1, H}:expand {B, Tn / b, b, H}:reshape {B, Tn, H} end
  return heads(th), heads(per_token(e)), heads(per_token(1 - keep))
end
local function prep_ref(y, norm)
  local B, Tn, H, d = y:size(1), y:size(2), y:size(3), y:size(4)
  local s = y:silu():transpose(2, 3):reshape {B * H, Tn, d}
  return norm and titans.l2norm(s) or s
end

T.test('titans_gates, titans_prep: equal their compositions and gradcheck (f64); bad input', function()
  gp.manual_seed(5)
  for _, c in ipairs {{2, 12, 3, 4}, {1, 5, 1, 1}, {3, 8, 2, 8}} do
    local B, Tn, H, b = c[1], c[2], c[3], c[4]
    local g = gp.randn({B, Tn, 3, H}, F64) * 2
    local got, want = {gp.titans_gates(g, b)}, {gates_ref(g, b)}
    for i = 1, 3 do T.ok(T.relnorm(got[i]:reshape {B * H, Tn}, want[i]) < 1e-14, 'gates output ' .. i) end
    T.ok(gp.gradcheck(function(x)
      local th, e, a = gp.titans_gates(x, b)
      return gp.cat({th:reshape {-1}, e:reshape {-1} * 2, a:reshape {-1} * 3}, 1)
    end, {g}))
  end
  for _, norm in ipairs {true, false} do
    local y = gp.randn({2, 5, 3, 7}, F64)
    T.ok(T.relnorm(gp.titans_prep(y, norm):reshape {6, 5, 7}, prep_ref(y, norm)) < 1e-14, 'prep, norm ' .. tostring(norm))
    T.ok(gp.gradcheck(function(x) return gp.titans_prep(x, norm) end, {y}))
  end
  T.raises(function() gp.titans_gates(gp.randn({2, 6, 3, 2}, F64), 4) end, 'titans_gates', 'b = 4', 'divides T = 6')
  T.raises(function() gp.titans_gates(gp.randn({2, 6, 2, 2}, F64), 3) end, 'titans_gates')
  T.raises(function() gp.titans_gates(gp.randn({2, 6, 6}, F64), 3) end, 'titans_gates', '4 dims', '(2,6,6)')
  T.raises(function() gp.titans_prep('y', true) end, 'titans_prep', 'must be a tensor')
  T.raises(function() gp.k.titans_prep(gp.empty({1, 2, 2, 4}, F64), gp.randn({1, 2, 2, 4}, F64), 2, 1e-6) end,
    'titans_prep', 'norm must be 0 or 1')
end)

T.test('titans_coef: gradcheck and chunk weights of a hand example', function()
  gp.manual_seed(5)
  local e = gp.rand({3, 6}, F64) * 0.8 + 0.1
  local a = gp.rand({3, 6}, F64) * 0.5
  T.ok(gp.gradcheck(function(e_, a_) local w, c, p = gp.titans_coef(e_, a_); return gp.cat({w, c * 0.5, p}, 2) end, {e, a}))
  -- L = 2: w = (eta2, 1), c = ((1-alpha2) + eta2, 1), p = (eta1 eta2, (1-a1)(1-a2), eta1 c1)
  local w, c, p = gp.titans_coef(gp.tensor({{0.5, 0.25}}, F64), gp.tensor({{0.1, 0.2}}, F64))
  T.same(w:totable(), {{0.25, 1}}, 1e-15)
  T.same(c:totable(), {{1.05, 1}}, 1e-15)
  T.same(p:totable(), {{0.125, 0.72, 0.525}}, 1e-15)
end)

T.test('titans_coef: bad input', function()
  T.raises(function() gp.titans_coef(gp.rand {3, 4}, gp.rand {3, 5}) end, 'titans_coef', '(3,4)', '(3,5)')
  T.raises(function() gp.titans_coef(gp.rand {3}, gp.rand {3}) end, 'titans_coef', '(N, L)')
  T.raises(function() gp.titans_coef(gp.empty {3, 0}, gp.empty {3, 0}) end, 'titans_coef', 'at least one token')
  T.raises(function() titans.memory_scan {kind = 'conv'} end, 'memory_scan', 'kind')
  local x = inputs('linear', 2, 4, 3, 0, 'f32')
  x.theta = gp.rand {2, 5}
  T.raises(function() run_scan('linear', x, 2) end, 'memory_scan', 'theta must be (2, 4)')
end)

-- the CPU is the default device inside: the reference side is built there and
-- the CUDA side moved explicitly
local function on_cpu(fn)
  return function()
    local prev = gp.device()
    gp.set_device('cpu')
    local ok, err = pcall(fn)
    gp.set_device(prev)
    if not ok then error(err, 0) end
  end
end

T.test('titans kernels: CUDA vs CPU (coef, its backward, the memory chain)', on_cpu(function()
  T.cuda()
  for _, L in ipairs {1, 7, 64, 512, 2000} do
    local e = gp.rand({33, L}) * 0.6 + 0.35
    local a = gp.rand({33, L}) * 0.1
    local w, c, p = gp.titans_coef(e, a)
    local wg, cg, pg = gp.titans_coef(e:cuda(), a:cuda())
    -- one f32 thread scans the row on the GPU, the CPU in double: the rounding
    -- grows with the row length
    local tol = L > 1000 and 1e-3 or 1e-4
    T.ok(T.relnorm(wg:cpu(), w) < tol, 'coef w L ' .. L)
    T.ok(T.relnorm(cg:cpu(), c) < tol, 'coef c L ' .. L)
    -- p holds products over the whole row: past a few hundred tokens they
    -- are below f32's range (0 on the GPU, denormal doubles on the CPU)
    T.ok(T.relnorm(pg:cpu(), p) < tol or (pg:cpu() - p):abs():max():item() < 1e-30, 'coef p L ' .. L)
    local dw, dc, dp = gp.randn {33, L}, gp.randn {33, L}, gp.randn {33, 3}
    local de, da = gp.empty {33, L}, gp.empty {33, L}
    gp.k.titans_coef_backward(de, da, e, a, w, c, dw, dc, dp)
    local deg, dag = gp.empty({33, L}, {device = 'cuda'}), gp.empty({33, L}, {device = 'cuda'})
    gp.k.titans_coef_backward(deg, dag, e:cuda(), a:cuda(), w:cuda(), c:cuda(), dw:cuda(), dc:cuda(), dp:cuda())
    T.ok(T.relnorm(deg:cpu(), de) < tol, 'coef backward deta L ' .. L)
    T.ok(T.relnorm(dag:cpu(), da) < tol, 'coef backward dalpha L ' .. L)
  end
  -- the gates and the memory inputs (their kernel cases run in test_kernels; here a model's sizes, bf16 in)
  local g = gp.randn({4, 256, 3, 2}) * 2
  local dg = {gp.randn {4, 2, 256}, gp.randn {4, 2, 256}, gp.randn {4, 2, 256}}
  for _, dt in ipairs {'f32', 'bf16'} do
    local gc, gg = g:to(dt):to('f32'):detach():requires_grad(), g:to(dt):cuda():detach():requires_grad()
    local oc, og = {gp.titans_gates(gc, 32)}, {gp.titans_gates(gg, 32)}
    local lc, lg = 0, 0
    for i = 1, 3 do
      T.ok(T.relnorm(og[i]:cpu():to('f32'), oc[i]) < (dt == 'f32' and 1e-5 or 1e-2), dt .. ' gates output ' .. i)
      lc, lg = lc + (oc[i] * dg[i]):sum(), lg + (og[i]:to('f32') * dg[i]:cuda()):sum()
    end
    lc:backward(); lg:backward()
    T.ok(T.relnorm(gg.grad:cpu():to('f32'), gc.grad) < (dt == 'f32' and 1e-5 or 2e-2), dt .. ' gates gradient')
  end
  local y = gp.randn({4, 64, 2, 64})
  for _, norm in ipairs {true, false} do
    local yc, yg = y:clone():requires_grad(), y:cuda():requires_grad()
    local oc, og = gp.titans_prep(yc, norm), gp.titans_prep(yg, norm)
    T.ok(T.relnorm(og:cpu(), oc) < 1e-5, 'prep output')
    local w = gp.randn(oc.shape)
    ;(oc * w):sum():backward()
    ;(og * w:cuda()):sum():backward()
    T.ok(T.relnorm(yg.grad:cpu(), yc.grad) < 1e-5, 'prep gradient')
  end
  -- the fused linear memory: head dims 16, 40 and 64, chunks of 35 (a tile and a part); 40 memories of 64
  -- take the backward's 16-row blocks (fewer memories, 8-row ones); chunks of 160 split over token slices
  for _, case in ipairs {{'linear', 16, 32, 6, 96}, {'mlp', 16, 32, 6, 96}, {'linear', 64, 35, 6, 70},
                         {'linear', 40, 35, 6, 70}, {'linear', 64, 35, 40, 70}, {'linear', 40, 160, 6, 320}} do
    local kind, d, b, N, Tn = case[1], case[2], case[3], case[4], case[5]
    gp.manual_seed(11)
    local x = inputs(kind, N, Tn, d, 32, 'f32')
    local function leaves(dev)
      local r = {}
      for key, t in pairs(x) do
        if key == 'init' then
          r.init = {}
          for nm, w in pairs(t) do r.init[nm] = w:detach():to(dev):requires_grad() end
        else r[key] = t:detach():to(dev):requires_grad() end
      end
      return r
    end
    local xc, xg = leaves('cpu'), leaves('cuda')
    local yc, sc = run_scan(kind, xc, b)
    local yg, sg = run_scan(kind, xg, b)
    T.ok(T.relnorm(yg:cpu(), yc) < 1e-4, kind .. ' y')
    local nm = titans.NAMES[kind][1]
    T.ok(T.relnorm(sg[nm]:cpu(), sc[nm]) < 1e-4, kind .. ' state')
    local pc = gp.randn(yc.shape)
    ;(yc * pc):sum():backward()
    ;(yg * pc:cuda()):sum():backward()
    for _, key in ipairs {'k', 'v', 'q', 'theta', 'eta', 'alpha'} do
      T.ok(T.relnorm(xg[key].grad:cpu(), xc[key].grad) < 1e-3, kind .. ' d ' .. d .. ' grad ' .. key)
    end
    T.ok(T.relnorm(xg.init[nm].grad:cpu(), xc.init[nm].grad) < 1e-3, kind .. ' d ' .. d .. ' grad of the initial state')
  end
end))

local function tiny_lm(model, memory, dt)
  return gp.nn.TitansLM {model = model, memory = memory, seq_len = 16, dim = 16, num_layers = 2, num_heads = 2, chunk = 4,
                         persistent = 2, device = 'cpu', dtype = dt}
end

T.test('titans: NeuralMemory, MAC and SWA models run forward and backward (cpu)', function()
  gp.manual_seed(1)
  local nm = gp.nn.NeuralMemory {dim = 8, heads = 2, chunk = 4, kind = 'mlp', conv = true, device = 'cpu'}
  local x = gp.randn({2, 8, 8}, {device = 'cpu'})
  local y = nm(x)
  T.eq(table.concat(y.shape, 'x'), '2x8x8')
  y:sum():backward()
  T.ok(nm.W1_0.grad ~= nil and nm.gates.weight.grad ~= nil and nm.conv_k.grad ~= nil)
  T.raises(function() nm(gp.randn({2, 6, 8}, {device = 'cpu'})) end, 'NeuralMemory', 'multiple of the chunk size 4')
  for _, cfg in ipairs {{'mac', 'linear'}, {'mac', 'mlp'}, {'swa'}} do
    local m = tiny_lm(cfg[1], cfg[2])
    local idx = gp.randint(0, 256, {2, 16}, {device = 'cpu'})
    local logits, loss = m(idx, idx)
    T.eq(table.concat(logits.shape, 'x'), '2x16x256')
    loss:backward()
    for _, p in ipairs(m:parameters()) do T.ok(p.grad ~= nil, cfg[1] .. ': a parameter got no gradient') end
  end
end)

T.test('titans: MAC is causal (changing a later token leaves earlier logits unchanged)', on_cpu(function()
  gp.manual_seed(2)
  local m = tiny_lm('mac', 'mlp', 'f64')
  local idx = gp.randint(0, 256, {1, 16}, {device = 'cpu'})
  local a = m(idx):totable()
  local t = idx:totable()
  t[1][10] = (t[1][10] + 7) % 256
  local b = m(gp.tensor(t, {dtype = 'i64', device = 'cpu'})):totable()
  T.same(b[1][9], a[1][9], 1e-12, 'logits before the change')
  T.same(b[1][2], a[1][2], 1e-12, 'logits of the first segment')
  local diff = 0
  for j = 1, 256 do diff = diff + math.abs(b[1][10][j] - a[1][10][j]) end
  T.ok(diff > 0, 'the changed token changes its own logits')
end))

T.test('titans.lua: recall task smoke run (tiny, cpu)', function()
  local out, rc = T.sh(T.exe .. ' --device cpu ' .. T.root .. '/scripts/titans.lua --task recall --tiny')
  if rc ~= 0 then error('titans.lua failed:\n' .. out) end
  T.ok(out:find('recall accuracy: mac', 1, true) and out:find('swa', 1, true), out)
end)

T.test('titans.lua --resume: both tasks stopped and resumed log the losses of one run (bitwise, cpu)', function()
  local base = string.format('%s --device cpu %s/scripts/titans.lua --tiny --log-every 1', T.exe, T.root)
  T.check_resume(base .. ' --task recall --max-steps 4', {2, 6}) -- math.random batches: in mac, in swa
  T.check_resume(base .. ' --task lm --max-steps 4', {3})
end)

T.test('full attention and matched parameters: full sees past the window, SWA does not; counts within 1%', function()
  local cfg = {seq_len = 32, dim = 16, num_layers = 2, num_heads = 2, chunk = 8, device = 'cpu'}
  local hidden, mac, matched = gp.titans.matched_hidden(cfg)
  T.ok(hidden > 4 * cfg.dim, 'a wider MLP than 4 dim: ' .. hidden)
  T.ok(math.abs(matched - mac) / mac < 0.01, string.format('MAC %d, matched %d', mac, matched))
  local function logits_change(model)
    gp.manual_seed(1)
    local m = gp.nn.TitansLM {model = model, seq_len = 32, dim = 16, num_layers = 2, num_heads = 2, chunk = 8,
                              mlp_hidden = hidden, device = 'cpu'}
    T.eq(m:num_parameters(), matched)
    local t = {}
    for i = 1, 32 do t[i] = 48 + i % 10 end
    local a = m(gp.tensor({t}, {dtype = 'i64', device = 'cpu'})):totable()
    t[2] = 65
    local b = m(gp.tensor({t}, {dtype = 'i64', device = 'cpu'})):totable()
    local diff = 0
    for j = 1, 256 do diff = diff + math.abs(a[1][32][j] - b[1][32][j]) end
    return diff
  end
  T.ok(logits_change('full') > 0, 'full attention: the last token sees the second')
  T.eq(logits_change('swa'), 0, 'a window of 8: the last token does not see the second')
  T.raises(function() gp.nn.TitansLM {model = 'nope', seq_len = 8, dim = 8, num_layers = 1, num_heads = 1, chunk = 8} end,
    "'mac', 'swa' or 'full'")
end)

T.test('titans.lua recall: --window and --gap sweeps, a row per gap, full attention beside MAC and SWA (tiny, cpu)', function()
  local out, rc = T.sh(T.exe .. ' --device cpu ' .. T.root .. '/scripts/titans.lua --task recall --tiny --quiet --max-steps 2' ..
    ' --window 4,8 --gap 0,8,24')
  T.eq(rc, 0, out)
  for _, name in ipairs {'mac@4', 'swa@4', 'mac@8', 'swa@8', 'full'} do T.ok(out:find('recall ' .. name .. ':', 1, true), out) end
  T.ok(out:find('\n%s+24%s+[%d.]+%s+[%d.]+%s+[%d.]+%s+[%d.]+%s+[%d.]+\n'), 'a row for gap 24 with 5 accuracies: ' .. out)
  T.ok(out:find('MAC / SWA tokens/s', 1, true), out)
  -- a needle in a haystack: the pairs inside real text, measured on held-out text
  out, rc = T.sh(T.exe .. ' --device cpu ' .. T.root .. '/scripts/titans.lua --task recall --tiny --quiet --max-steps 2 --filler text')
  T.eq(rc, 0, out)
  T.ok(out:find('text (its held-out works for the accuracy)', 1, true) and out:find('recall accuracy: mac', 1, true), out)
  out, rc = T.sh(T.exe .. ' --device cpu ' .. T.root .. '/scripts/titans.lua --task recall --tiny --filler noise')
  T.ok(rc ~= 0 and out:find("'digits' or 'text'", 1, true), out)
  out, rc = T.sh(T.exe .. ' --device cpu ' .. T.root .. '/scripts/titans.lua --task recall --tiny --gap 25')
  T.ok(rc ~= 0 and out:find('at most 24', 1, true), out)
  out, rc = T.sh(T.exe .. ' --device cpu ' .. T.root .. '/scripts/titans.lua --task recall --tiny --window 5')
  T.ok(rc ~= 0 and out:find('must divide', 1, true), out)
end)

T.test('TitansLM pos = rope: no position table, MAC still causal, SWA logits depend on relative positions only; bad input', on_cpu(function()
  local function lm(model, pos)
    gp.manual_seed(3)
    return gp.nn.TitansLM {model = model, pos = pos, seq_len = 32, dim = 16, num_layers = 2, num_heads = 2, chunk = 8,
                           persistent = 2, device = 'cpu', dtype = 'f64'}
  end
  T.eq(lm('swa', 'learned'):num_parameters() - lm('swa', 'rope'):num_parameters(), 32 * 16, 'the position table is gone')
  local t = {}
  for i = 1, 40 do t[i] = (i * 37 + 11) % 256 end
  local function run(m, first)
    local s = {}
    for i = 1, 32 do s[i] = t[first + i] end
    return m(gp.tensor({s}, {dtype = 'i64', device = 'cpu'})):totable()[1]
  end
  -- a window of 8 in each of 2 layers: the logits at position p see tokens p-14 .. p; shifted by 8, the same
  -- tokens give the same logits
  local function shift_gap(m)
    local a, b = run(m, 8), run(m, 0)
    local gap = 0
    for p = 15, 24 do for j = 1, 256 do gap = math.max(gap, math.abs(a[p][j] - b[p + 8][j])) end end
    return gap
  end
  T.ok(shift_gap(lm('swa', 'rope')) < 1e-10, 'rope: shifted input, shifted logits')
  T.ok(shift_gap(lm('swa', 'learned')) > 1e-6, 'learned positions: absolute')
  local m = lm('mac', 'rope')
  local idx = gp.randint(0, 256, {1, 32}, {device = 'cpu'})
  local logits, loss = m(idx, idx)
  loss:backward()
  for _, p in ipairs(m:parameters()) do T.ok(p.grad ~= nil, 'mac rope: a parameter got no gradient') end
  local a = logits:totable()
  local u = idx:totable()
  u[1][20] = (u[1][20] + 7) % 256
  local b = m(gp.tensor(u, {dtype = 'i64', device = 'cpu'})):totable()
  T.same(b[1][19], a[1][19], 1e-12, 'mac rope: logits before the change')
  T.raises(function() lm('swa', 'sinusoid') end, 'TitansLM', "pos must be 'learned' or 'rope'")
  T.raises(function()
    gp.nn.TitansLM {model = 'swa', pos = 'rope', seq_len = 8, dim = 6, num_layers = 1, num_heads = 2, chunk = 8, device = 'cpu'}
  end, 'TitansLM', 'even head dim, got 3')
end))

T.test('titans.lua recall --peer: the PyTorch full model\'s accuracy by gap as a column (a stand-in python3 here), or why not', function()
  local d = os.tmpname()
  os.remove(d)
  assert(os.execute('mkdir -p ' .. d) == 0)
  -- a python3 that has "torch" and answers torch_recall.py with accuracy 0.5 at each gap it is asked for
  local f = assert(io.open(d .. '/python3', 'w'))
  f:write([[#!/bin/sh
[ "$1" = "-c" ] && exit 0
echo "$@" > "$(dirname "$0")/args"
gaps=$(echo "$@" | sed 's/.*--gaps \([0-9,]*\).*/\1/' | tr ',' ' ')
for g in $gaps; do echo "gap $g: accuracy 0.500"; done
]])
  f:close()
  assert(os.execute('chmod +x ' .. d .. '/python3') == 0)
  local log = d .. '/r.jsonl'
  local out, rc = T.sh(string.format('PATH=%s:$PATH %s --device cpu %s/scripts/titans.lua --task recall --tiny --quiet --max-steps 2 ' ..
    '--gap 0,8,24 --peer --log %s', d, T.exe, T.root, log))
  T.eq(rc, 0, out)
  T.ok(out:find('\n%s+gap%s+mac%s+swa%s+full%s+torch\n'), 'a torch column: ' .. out)
  T.ok(out:find('\n%s+24%s+[%d.]+%s+[%d.]+%s+[%d.]+%s+0%.500\n'), out)
  T.ok(out:find('full in PyTorch 0.500', 1, true), out)
  local args = io.open(d .. '/args'):read('*a')
  for _, want in ipairs {'--steps 2 ', '--dim 16 ', '--layers 2 ', '--heads 2 ', '--seq 32 ', '--pairs 2 ', '--seed 1337 ',
                         '--gaps 0,8,24 '} do
    T.ok(args:find(want, 1, true), 'torch_recall.py gets ' .. want .. ': ' .. args)
  end
  local n = 0
  for line in io.lines(log) do if line:find('"run":"torch_full"', 1, true) then n = n + 1 end end
  T.eq(n, 3, 'a log record per gap')
  out, rc = T.sh(string.format('PATH=%s:$PATH %s --device cpu %s/scripts/titans.lua --task recall --tiny --quiet --max-steps 2 ' ..
    '--models mac,swa --peer', d, T.exe, T.root))
  T.eq(rc, 0, out)
  T.ok(out:find('peer: no PyTorch column: it needs the full model', 1, true), out)
  os.execute('rm -rf ' .. d)
end)
