-- Fused ops against their unfused compositions, SwiGLU backward against
-- finite differences (f64, CPU), errors, CUDA sizes with tails.
local T = require 'lib'
local gp = require 'gpush'
local fd = require 'fd'

T.test('swiglu, add_rms_norm, add_layer_norm, bias_gelu match their compositions', function()
  local g, u = gp.randn({5, 13}, {device = 'cpu'}), gp.randn({5, 13}, {device = 'cpu'})
  T.ok(T.relnorm(gp.swiglu(g, u), g:silu() * u) < 1e-6)
  local w = gp.randn({13}, {device = 'cpu'})
  local out, res_out, rstd = gp.add_rms_norm(g, u, w, 1e-5)
  T.ok(T.relnorm(res_out, g + u) < 1e-7)
  local ref, rref = gp.rms_norm(g + u, w, 1e-5)
  T.ok(T.relnorm(out, ref) < 1e-6)
  T.ok(T.relnorm(rstd, rref) < 1e-6)
  local b = gp.randn({13}, {device = 'cpu'})
  T.ok(T.relnorm(gp.bias_gelu(g, b), (g + b):gelu()) < 1e-6)
  local lout, lres, mean, lrstd = gp.add_layer_norm(g, u, w, b, 1e-5)
  local lref, mref, rref2 = gp.layer_norm(g + u, w, b, 1e-5)
  T.ok(T.relnorm(lres, g + u) < 1e-7 and T.relnorm(lout, lref) < 1e-6, 'add_layer_norm')
  T.ok(T.relnorm(mean, mref) < 1e-6 and T.relnorm(lrstd, rref2) < 1e-6, 'add_layer_norm statistics')
  T.raises(function() gp.add_layer_norm(g, u, gp.randn({12}, {device = 'cpu'})) end, 'add_layer_norm', 'w is (12)')
  T.raises(function() gp.add_layer_norm(g, gp.randn({5, 12}, {device = 'cpu'})) end, 'add_layer_norm', 'res is (5,12)')
  -- non-contiguous gate/up
  local gt, ut = g:t(), u:t()
  T.ok(T.relnorm(gp.swiglu(gt, ut), gt:silu() * ut) < 1e-6)
end)

T.test('swiglu_linear: (silu(gate) * up) @ w^T for few rows, as gp.swiglu then gp.linear; errors', function()
  local CPU = {device = 'cpu'}
  local gu, w = gp.randn({1, 3, 26}, CPU), gp.randn({9, 13}, CPU)
  local want = gp.linear(gp.swiglu(gu:narrow(3, 1, 13), gu:narrow(3, 14, 13)), w)
  local got = gp.swiglu_linear(gu, w)
  T.eq(table.concat(got.shape, 'x'), '1x3x9')
  T.ok(T.relnorm(got, want) < 1e-6)
  T.raises(function() gp.swiglu_linear(gu, gp.randn({9, 12}, CPU)) end, 'swiglu_linear', '(1,3,26)', '(9,12)')
  T.raises(function() gp.swiglu_linear(gp.randn({5, 26}, CPU), w) end, 'swiglu_linear', '5 rows', 'gp.swiglu')
  T.raises(function() gp.swiglu_linear(gp.randn({17, 64}, {dtype = 'bf16', device = 'cpu'}), gp.randn({9, 32}, CPU)) end,
    'swiglu_linear', '17 rows', '16 rows')
  T.raises(function() gp.swiglu_linear(gu, 3) end, 'swiglu_linear', 'w')
  if gp.cuda_available() then
    T.raises(function() gp.swiglu_linear(gu, w:cuda()) end, 'swiglu_linear', 'w is on cuda')
  end
end)

T.test('rows_linear: gp.linear of few rows takes it on the GPU, equal to the product; gradients', function()
  local CPU = {device = 'cpu'}
  -- the kernel's CPU reference against the product, and its limits
  local x, w = gp.randn({3, 40}, CPU), gp.randn({17, 40}, CPU)
  local out = gp.empty({3, 17}, CPU)
  gp.k.rows_linear(out, x, w)
  T.ok(T.relnorm(out, gp.linear(x, w)) < 1e-6)
  T.raises(function() gp.k.rows_linear(gp.empty({5, 17}, CPU), gp.randn({5, 40}, CPU), w) end, 'rows_linear', '5 rows',
    'gp.linear')
  T.cuda()
  for _, dt in ipairs {'bf16', 'f16'} do
    local o = {dtype = dt, device = 'cuda'}
    for _, shape in ipairs {{1, 1, 576, 960}, {1, 1, 1024, 3072}, {1, 1, 33, 7}, {2, 1, 576, 50}, {1, 1, 2048, 50}} do
      local B, T_, K, N = shape[1], shape[2], shape[3], shape[4]
      local xg, wg = gp.randn({B, T_, K}, o), gp.randn({N, K}, o) * (1 / math.sqrt(K))
      local want = gp.matmul(xg:reshape {B * T_, K}:to('f32'), wg:to('f32'), {trans_b = true}):view {B, T_, N}
      local got, n = T.launches(function() return gp.linear(xg, wg) end)
      local want_rows = (B * T_ == 1 and K <= 1024) or (B * T_ <= 16 and K % 32 == 0 and (N <= 4096 or N % 8 ~= 0))
      T.eq(n.rows_linear, want_rows and 1 or 0, 'rows_linear launches at ' .. table.concat(shape, 'x'))
      T.ok(T.relnorm(got:to('f32'), want) < (dt == 'bf16' and 1e-2 or 2e-3), dt .. ' ' .. table.concat(shape, 'x'))
    end
    -- under autograd the forward may take it; the gradients are linear's rule
    local xg, wg = gp.randn({1, 64}, o):requires_grad_(), gp.randn({8, 64}, o):requires_grad_()
    local gy = gp.randn({1, 8}, o)
    local y = gp.linear(xg, wg)
    ;(y * gy):sum():backward()
    local xf, wf = xg:detach():to('f32'), wg:detach():to('f32')
    T.ok(T.relnorm(xg.grad:to('f32'), gy:to('f32'):matmul(wf)) < 2e-2, dt .. ' dx')
    T.ok(T.relnorm(wg.grad:to('f32'), gy:to('f32'):t():matmul(xf)) < 2e-2, dt .. ' dw')
  end
end)

T.test('rows_linear_bias: gp.linear with a bias and the GELU MLP of one row take it on the GPU (cuda)', function()
  T.cuda()
  for _, dt in ipairs {'bf16', 'f16'} do
    local o = {dtype = dt, device = 'cuda'}
    local tol = dt == 'bf16' and 1e-2 or 2e-3
    -- GPT-2's projections: qkv, proj, the MLP's fc (with GELU) and its proj (3072 wide: cuBLAS)
    for _, shape in ipairs {{768, 2304}, {768, 768}, {33, 7}, {1024, 50}} do
      local K, N = shape[1], shape[2]
      local xg, wg, bg = gp.randn({1, 1, K}, o), gp.randn({N, K}, o) * (1 / math.sqrt(K)), gp.randn({N}, o)
      local want = gp.matmul(xg:reshape {1, K}:to('f32'), wg:to('f32'), {trans_b = true}):view {1, 1, N} + bg:to('f32')
      local got, n = T.launches(function() return gp.linear(xg, wg, bg) end)
      T.eq(n.rows_linear_bias, 1, 'rows_linear_bias at ' .. K .. ' -> ' .. N)
      T.ok(T.relnorm(got:to('f32'), want) < tol, dt .. ' ' .. K .. ' -> ' .. N)
    end
    local d, h = 768, 3072
    local x = gp.randn({1, 1, d}, o)
    local w1, b1 = gp.randn({h, d}, o) * (1 / math.sqrt(d)), gp.randn({h}, o)
    local w2, b2 = gp.randn({d, h}, o) * (1 / math.sqrt(h)), gp.randn({d}, o)
    local got, n = T.launches(function() return gp.linear_gelu_linear(x, w1, b1, w2, b2) end)
    T.eq(n.rows_linear_bias, 2, 'the fc (GELU in its epilogue) and the proj (3072 wide: on tensor cores) in few-rows kernels')
    T.eq((n.matmul_bias_gelu_tanh or 0) + (n.matmul_bias or 0), 0, 'no GEMM')
    local hf = (x:to('f32'):matmul(w1:to('f32'):t()) + b1:to('f32')):gelu_tanh()
    local want = hf:to(dt):to('f32'):matmul(w2:to('f32'):t()) + b2:to('f32')
    T.ok(T.relnorm(got:to('f32'), want) < tol, dt .. ' linear_gelu_linear')
    -- 17 rows: cuBLAS's epilogues as before (narrow weights: cuBLAS's split-K bias kernels, which racecheck
    -- flags inside the library, are not taken)
    local v1, c1 = gp.randn({512, 256}, o), gp.randn({512}, o)
    local v2, c2 = gp.randn({256, 512}, o), gp.randn({256}, o)
    local _, n2 = T.launches(function() return gp.linear_gelu_linear(gp.randn({17, 256}, o), v1, c1, v2, c2) end)
    T.eq(n2.matmul_bias_gelu_tanh, 1, '17 rows: the GELU GEMM')
  end
  -- add_layer_norm on the GPU against the CPU (rows of 768 in vectors, 1001 one element at a time, 40000 a block a row)
  for _, D in ipairs {768, 1001, 40000} do
    for _, dt in ipairs {'f32', 'bf16'} do
      local c = {device = 'cpu', dtype = dt}
      local x, r, w, b = gp.randn({3, D}, c), gp.randn({3, D}, c), gp.randn({D}, c), gp.randn({D}, c)
      local oc, hc, mc, sc = gp.add_layer_norm(x, r, w, b)
      local og, hg, mg, sg = gp.add_layer_norm(x:cuda(), r:cuda(), w:cuda(), b:cuda())
      local tol = dt == 'f32' and 1e-5 or 1e-2
      T.ok(T.relnorm(og:cpu(), oc) < tol and T.relnorm(hg:cpu(), hc) < tol, dt .. ' D ' .. D)
      T.ok(T.relnorm(mg:cpu(), mc) < 1e-4 and T.relnorm(sg:cpu(), sc) < 1e-4, dt .. ' D ' .. D .. ' statistics')
    end
  end
end)

-- the few-rows products on tensor cores (2 to 16 rows of bf16 / f16, K a multiple of 32; one row too with
-- GPUSH_ROWS_MMA=1): rows_linear, rows_linear_bias (GELU) and swiglu_linear against their CPU references, over
-- K split between the warps of a block (K 4096 and 8192: 8 warps, 2 and 4 rounds of loads a warp) and N past a 16-row tile
T.test('rows_linear, rows_linear_bias, swiglu_linear on tensor cores equal the CPU at 1 to 16 rows (cuda)', function()
  T.cuda()
  local one = os.getenv('GPUSH_ROWS_MMA') == '1'
  for _, dt in ipairs {'bf16', 'f16'} do
    local c = {dtype = dt, device = 'cpu'}
    for _, s in ipairs {{768, 2304}, {576, 50}, {4096, 100}, {8192, 40}, {32, 17}} do
      local K, N = s[1], s[2]
      local w, b = gp.randn({N, K}, c) * (1 / math.sqrt(K)), gp.randn({N}, c)
      local wg, bg = w:cuda(), b:cuda()
      for _, M in ipairs(one and {1} or {2, 3, 5, 8, 9, 16}) do
        local x, gu = gp.randn({M, K}, c), gp.randn({M, 2 * K}, c)
        local what = string.format('%s M %d K %d N %d', dt, M, K, N)
        local function check(name, f)
          local yc, yg = gp.empty({M, N}, c), gp.empty({M, N}, {dtype = dt, device = 'cuda'})
          f(yc, false)
          f(yg, true)
          local r = T.relnorm(yg:cpu():to('f32'), yc:to('f32'))
          T.ok(r < (dt == 'bf16' and 1e-2 or 2e-3), name .. ' ' .. what .. ': ' .. r)
        end
        check('rows_linear', function(y, g) gp.k.rows_linear(y, g and x:cuda() or x, g and wg or w) end)
        check('rows_linear_bias gelu', function(y, g)
          gp.k.rows_linear_bias(y, g and x:cuda() or x, g and wg or w, g and bg or b, 1)
        end)
        check('swiglu_linear', function(y, g) gp.k.swiglu_linear(y, g and gu:cuda() or gu, g and wg or w) end)
      end
    end
  end
  if not os.getenv('GPUSH_ROWS_MMA') then
    -- one row on tensor cores too
    local out, rc = T.sh('GPUSH_ROWS_MMA=1 ' .. T.exe .. ' ' .. T.root .. '/tests/lua/run.lua "on tensor cores equal the CPU"')
    T.ok(rc == 0 and out:find('1 passed, 0 failed', 1, true), 'GPUSH_ROWS_MMA=1: ' .. out)
    -- gp.linear takes them for 2 to 16 rows
    local o = {dtype = 'bf16', device = 'cuda'}
    local w, b = gp.randn({300, 768}, o), gp.randn({300}, o)
    for _, M in ipairs {2, 16, 17} do
      local x = gp.randn({M, 768}, o)
      local y, n = T.launches(function() return gp.linear(x, w, b) end)
      T.eq(n.rows_linear_bias or 0, M <= 16 and 1 or 0, 'rows_linear_bias at ' .. M .. ' rows')
      T.ok(T.relnorm(y:to('f32'), x:to('f32'):matmul(w:to('f32'):t()) + b:to('f32')) < 1e-2, M .. ' rows')
    end
    -- an f32 x of 5 rows has no kernel: a clear error
    T.raises(function()
      gp.k.rows_linear(gp.empty({5, 8}, {device = 'cuda'}), gp.randn({5, 64}, {device = 'cuda'}), gp.randn({8, 64}, {device = 'cuda'}))
    end, 'rows_linear', '5 rows of 64', '16 rows of bf16 / f16')
  end
end)

T.test('swiglu backward: finite differences', function()
  local g, u, dout = fd.randn {4, 5}, fd.randn {4, 5}, fd.randn {4, 5}
  local dg, du = gp.empty({4, 5}, {dtype = 'f64', device = 'cpu'}), gp.empty({4, 5}, {dtype = 'f64', device = 'cpu'})
  gp.k.swiglu_backward(dg, du, g, u, dout)
  local f = function(a, b) return gp.swiglu(a, b) end
  fd.check('swiglu dgate', dg, fd.grad(f, {g, u}, 1, dout), 1e-7)
  fd.check('swiglu dup', du, fd.grad(f, {g, u}, 2, dout), 1e-7)
end)

-- gate and up as column blocks of one (rows, 2h) product (a Llama's gate/up
-- with LoRA): the backward reads them where they lie and writes dgate and dup
-- as the same blocks of one gradient
T.test('swiglu backward: row-strided gate, up and gradients, no copy; finite differences through the views', function()
  local cpu = {dtype = 'f64', device = 'cpu'}
  -- the kernel on strided rows equals it on contiguous copies; strided outputs too, every element written
  for _, shape in ipairs {{4, 5, 7}, {1, 9}, {6, 1}, {3, 2, 8}} do
    local n = #shape
    local h = shape[n]
    local big = {}
    for i = 1, n do big[i] = shape[i] end
    big[n] = 2 * h + 3
    local y, d = gp.randn(big, cpu), gp.randn(big, cpu)
    local g, u, dout = y:narrow(n, 1, h), y:narrow(n, h + 1, h), d:narrow(n, h + 3, h)
    local o = gp.full(big, 77, cpu)
    local dg, du = o:narrow(n, 1, h), o:narrow(n, h + 1, h)
    gp.k.swiglu_backward(dg, du, g, u, dout)
    local rg, ru = gp.empty(shape, cpu), gp.empty(shape, cpu)
    gp.k.swiglu_backward(rg, ru, g:contiguous(), u:contiguous(), dout:contiguous())
    T.eq(T.relnorm(dg, rg), 0, 'dgate ' .. table.concat(shape, 'x'))
    T.eq(T.relnorm(du, ru), 0, 'dup ' .. table.concat(shape, 'x'))
    -- the columns past both blocks untouched
    T.eq(o:narrow(n, 2 * h + 1, 3):eq(77):float():sum():item(), o:numel() / big[n] * 3)
    -- leading dims that do not merge (the rows of a transposed buffer)
    if n == 3 then
      local t = gp.randn({shape[2], shape[1], 2 * h}, cpu):transpose(1, 2)
      local tg, tu = t:narrow(3, 1, h), t:narrow(3, h + 1, h)
      gp.k.swiglu_backward(rg, ru, tg, tu, dout)
      local cg, cu = gp.empty(shape, cpu), gp.empty(shape, cpu)
      gp.k.swiglu_backward(cg, cu, tg:contiguous(), tu:contiguous(), dout:contiguous())
      T.eq(T.relnorm(rg, cg) + T.relnorm(ru, cu), 0, 'transposed rows')
    end
  end
  -- autograd: no copy, one gradient tensor for both blocks
  local y = gp.randn({3, 4, 10}, cpu):requires_grad()
  local z = y * 1 -- a non-leaf, as a product's output is
  local out = gp.swiglu(z:narrow(3, 1, 5), z:narrow(3, 6, 5))
  local gout = gp.randn({3, 4, 5}, cpu)
  local _, n = T.launches(function() out:backward(gout) end)
  T.eq(n.swiglu_backward, 1)
  -- two copies, neither swiglu's: the first narrow's gradient into z's zeros, y's first .grad (a leaf's clone)
  T.eq(n.copy, 2, 'copies')
  local zc = z:detach()
  local sg, su = zc:narrow(3, 1, 5), zc:narrow(3, 6, 5)
  local dg, du = gp.empty({3, 4, 5}, cpu), gp.empty({3, 4, 5}, cpu)
  gp.k.swiglu_backward(dg, du, sg:contiguous(), su:contiguous(), gout)
  T.ok(T.relnorm(y.grad, gp.cat({dg, du}, 3)) < 1e-15, 'the gradient')
  -- the gradient through the views in double
  gp.gradcheck(function(x) return gp.swiglu(x:narrow(3, 1, 5), x:narrow(3, 6, 5)) end, {gp.randn({2, 3, 10}, cpu)})
  gp.gradcheck(function(x) return gp.swiglu(x:narrow(2, 2, 4), x:narrow(2, 7, 4)) end, {gp.randn({3, 11}, cpu)})
end)

T.test('fused errors name the op and the shapes', function()
  local a = gp.randn({3, 4}, {device = 'cpu'})
  T.raises(function() gp.swiglu(a, gp.randn({3, 5}, {device = 'cpu'})) end, 'swiglu', '(3,5)', '(3,4)')
  T.raises(function() gp.swiglu(a, 2) end, 'swiglu', 'up must be a tensor')
  T.raises(function() gp.add_rms_norm(a, gp.randn({4, 3}, {device = 'cpu'})) end, 'add_rms_norm', '(4,3)')
  T.raises(function() gp.add_rms_norm(a, a, gp.ones({5}, {device = 'cpu'})) end, 'add_rms_norm', 'w', '(5)')
  T.raises(function() gp.bias_gelu(a, gp.ones({3}, {device = 'cpu'})) end, 'bias_gelu', 'b', '(3)', '(3,4)')
  T.raises(function() gp.k.swiglu_backward(a, a, a, a:t(), a) end, 'swiglu_backward')
  -- rows at any strides, but stride 1 along them
  local at = gp.randn({4, 3}, {device = 'cpu'}):t()
  T.raises(function() gp.k.swiglu_backward(a, a:clone(), at, a, a) end, 'swiglu_backward', 'gate', 'stride 1 on its last dim')
  T.raises(function() gp.k.swiglu_backward(at, a:clone(), a, a, a) end, 'swiglu_backward', 'dgate', 'stride 1 on its last dim')
  T.cuda()
  T.raises(function() gp.swiglu(a:cuda(), a) end, 'swiglu', 'cpu', 'cuda')
end)

T.test('cuda swiglu forward/backward with tails and unaligned starts', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16'} do
    local tol = dt == 'f32' and 1e-5 or 1e-2
    for _, n in ipairs {1, 7, 1000003} do
      for _, off in ipairs {0, 1} do
        local function mk() return gp.randn({n + 1}, {device = 'cpu'}):to(dt):narrow(1, 1 + off, n):contiguous() end
        local g, u, d = mk(), mk(), mk()
        local gg, ug, dg = g:cuda(), u:cuda(), d:cuda()
        T.ok(T.relnorm(gp.swiglu(gg, ug), gp.swiglu(g, u)) <= tol, 'swiglu ' .. dt .. ' ' .. n)
        local base = gp.empty({n + 1}, {dtype = dt}):narrow(1, 1 + off, n) -- unaligned outputs on the GPU
        local a1, a2 = gp.empty({n}, {dtype = dt, device = 'cpu'}), gp.empty({n}, {dtype = dt, device = 'cpu'})
        gp.k.swiglu_backward(a1, a2, g, u, d)
        local b2 = gp.empty({n}, {dtype = dt})
        gp.k.swiglu_backward(base, b2, gg, ug, dg)
        T.ok(T.relnorm(base, a1) <= tol and T.relnorm(b2, a2) <= tol, 'swiglu_backward ' .. dt .. ' ' .. n)
      end
    end
  end
end)

T.test('cuda swiglu backward on row-strided operands (column blocks, transposed rows, unaligned) equals the CPU', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    local tol = dt == 'f32' and 1e-5 or 1e-2
    -- h: 8-multiples take 16-byte vectors (f32: 4-multiples), 7 and 1 do not; off shifts every row's start
    for _, c in ipairs {{3, 5, 64, 0}, {2, 33, 1536, 0}, {3, 5, 64, 1}, {4, 3, 7, 0}, {5, 2, 1, 0}, {1, 1, 24, 0}} do
      local B, Tn, h, off = c[1], c[2], c[3], c[4]
      local what = string.format('%s %dx%dx%d off %d', dt, B, Tn, h, off)
      local y = gp.randn({B, Tn, 2 * h + off}, {device = 'cpu'}):to(dt)
      local d = gp.randn({B, Tn, h}, {device = 'cpu'}):to(dt)
      local g, u = y:narrow(3, 1 + off, h), y:narrow(3, h + 1 + off, h)
      local rg, ru = gp.empty({B, Tn, h}, {dtype = dt, device = 'cpu'}), gp.empty({B, Tn, h}, {dtype = dt, device = 'cpu'})
      gp.k.swiglu_backward(rg, ru, g, u, d)
      local yc, dc = y:cuda(), d:cuda()
      local o = gp.full({B, Tn, 2 * h + off}, 7, {dtype = dt})
      local og, ou = o:narrow(3, 1 + off, h), o:narrow(3, h + 1 + off, h)
      gp.k.swiglu_backward(og, ou, yc:narrow(3, 1 + off, h), yc:narrow(3, h + 1 + off, h), dc)
      T.ok(T.relnorm(og:cpu(), rg) <= tol, what .. ' dgate ' .. T.relnorm(og:cpu(), rg))
      T.ok(T.relnorm(ou:cpu(), ru) <= tol, what .. ' dup ' .. T.relnorm(ou:cpu(), ru))
      if off > 0 then T.eq(o:narrow(3, 1, off):cpu():float():eq(7):float():sum():item(), B * Tn * off, what .. ' untouched') end
      -- rows of a transposed buffer (the leading dims do not merge)
      local t = gp.randn({Tn, B, 2 * h}, {device = 'cpu'}):to(dt):transpose(1, 2)
      gp.k.swiglu_backward(rg, ru, t:narrow(3, 1, h), t:narrow(3, h + 1, h), d)
      local tc = t:cuda()
      local cg, cu = gp.empty({B, Tn, h}, {dtype = dt}), gp.empty({B, Tn, h}, {dtype = dt})
      gp.k.swiglu_backward(cg, cu, tc:narrow(3, 1, h), tc:narrow(3, h + 1, h), dc)
      T.ok(T.relnorm(cg:cpu(), rg) <= tol and T.relnorm(cu:cpu(), ru) <= tol, what .. ' transposed rows')
    end
  end
end)
