-- The GELU MLP as one node: the kernels matmul_bias_gelu_aux (GELU_AUX_BIAS
-- epilogue) and matmul_dgelu (DGELU epilogue) against a Lua oracle and, on a
-- GPU, against the CPU reference and gelu_tanh_bwd; gp.linear_gelu_linear
-- (gradcheck, accumulation into .grad); nn.MLP fused vs unfused (values, every
-- gradient, a GPT's training losses); bad input.
local T = require 'lib'
local gp = require 'gpush'
local nn = gp.nn

local CPU = {device = 'cpu'}
local CPU64 = {dtype = 'f64', device = 'cpu'}
local function cpu(shape, dtype) return gp.randn(shape, {dtype = dtype or 'f32', device = 'cpu'}) end

local K0 = 0.7978845608028654
local function gelu(x) return 0.5 * x * (1 + math.tanh(K0 * (x + 0.044715 * x ^ 3))) end
local function dgelu(x)
  local t = math.tanh(K0 * (x + 0.044715 * x ^ 3))
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * K0 * (1 + 3 * 0.044715 * x * x)
end

-- a @ b over the last two dims as a tensor of a's dtype (the CPU matmul kernel)
local function mm(a, b)
  local s = {}
  for i = 1, a:dim() - 1 do s[i] = a:size(i) end
  s[#s + 1] = b:size(-1)
  local o = gp.empty(s, {dtype = a.dtype, device = a.device})
  gp.k.matmul(o, a, b)
  return o
end

T.test('matmul_bias_gelu_aux and matmul_dgelu: values on the CPU', function()
  local a, b, bias = cpu({3, 4}, 'f64'), cpu({4, 5}, 'f64'), cpu({5}, 'f64')
  local ab = T.flat(mm(a, b))
  local bv = T.flat(bias)
  local out, aux = gp.empty({3, 5}, CPU64), gp.empty({3, 5}, CPU64)
  gp.k.matmul_bias_gelu_aux(out, aux, a, b, bias)
  local fo, fx = T.flat(out), T.flat(aux)
  for i = 1, 15 do
    local pre = ab[i] + bv[(i - 1) % 5 + 1]
    T.near(fx[i], pre, 1e-12)
    T.near(fo[i], gelu(pre), 1e-12)
  end
  -- dgelu: (a @ b) * gelu'(aux), the gelu_tanh_bwd formula
  local pre = cpu({3, 5}, 'f64')
  local d = gp.empty({3, 5}, CPU64)
  gp.k.matmul_dgelu(d, a, b, pre)
  local fd, fp = T.flat(d), T.flat(pre)
  for i = 1, 15 do T.near(fd[i], ab[i] * dgelu(fp[i]), 1e-12) end
  local ref = gp.empty({3, 5}, CPU64)
  gp.k.gelu_tanh_bwd(ref, pre, mm(a, b))
  T.ok(T.relnorm(d, ref) < 1e-14)
  -- batched, b a transposed view, f32
  local x, w = cpu {2, 3, 4}, cpu {6, 4}
  local bias6 = cpu {6}
  local o3, x3 = gp.empty({2, 3, 6}, CPU), gp.empty({2, 3, 6}, CPU)
  gp.k.matmul_bias_gelu_aux(o3, x3, x, w:t():unsqueeze(1):expand {2, 4, 6}, bias6)
  local want = gp.linear(x, w, bias6)
  T.ok(T.relnorm(x3, want) < 1e-6)
  T.ok(T.relnorm(o3, want:gelu_tanh()) < 1e-6)
  -- out may be aux itself
  local g = cpu {2, 3, 5}
  local w2 = cpu {5, 6}
  local dd = gp.empty({2, 3, 6}, CPU)
  gp.k.matmul_dgelu(dd, g, w2:unsqueeze(1):expand {2, 5, 6}, x3)
  local inplace = x3:clone()
  gp.k.matmul_dgelu(inplace, g, w2:unsqueeze(1):expand {2, 5, 6}, inplace)
  T.ok(T.relnorm(inplace, dd) == 0)
end)

-- the CPU and CUDA results of f(device, inputs) (a list of tensors) by relative norm
local function vs_cpu(name, inputs, f, tol)
  local rc = f('cpu', inputs)
  local moved = {}
  for k, v in pairs(inputs) do moved[k] = v:cuda() end
  local rg = f('cuda', moved)
  for i = 1, #rc do
    local e = T.relnorm(rg[i]:cpu(), rc[i])
    if not (e <= tol) then error(string.format('%s: result %d: cuda vs cpu relative norm %g > %g', name, i, e, tol), 2) end
  end
end

-- f32 1e-4: cuBLASLt's GELU epilogue evaluates tanh less exactly than the CPU
-- (a 1.8e-5 relative norm at 1x8x8 on the H100)
local TOL = {f32 = 1e-4, bf16 = 1e-2, f16 = 2e-3}

-- f with the cuBLASLt epilogues on (lt 1) and off (lt 0: GEMM + epilogue
-- kernel); the option is restored even when f fails
local function both_paths(f)
  for _, lt in ipairs {1, 0} do
    local prev = gp.matmul_option('lt', lt)
    local ok, err = pcall(f, lt)
    gp.matmul_option('lt', prev)
    if not ok then error(string.format('matmul_option lt %d: %s', lt, tostring(err)), 0) end
  end
end

-- M, K, N: odd sizes (the fallback GEMM and epilogue kernel), multiples of 8
-- (cuBLASLt's GELU_AUX_BIAS and DGELU, aux's leading dim a multiple of 8)
local SIZES = {{33, 65, 17}, {64, 96, 128}, {40, 24, 200}, {1, 8, 8}, {7, 16, 3}}

T.test('matmul_bias_gelu_aux and matmul_dgelu cuda: CPU reference, odd and multiple-of-8 sizes, batched, transposed', function()
  T.cuda()
  both_paths(function()
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    for _, s in ipairs(SIZES) do
      local M, Kd, N = s[1], s[2], s[3]
      local I = {a = cpu({M, Kd}, dt), b = cpu({Kd, N}, dt), bt = cpu({N, Kd}, dt), bias = cpu({N}, dt),
                 aux = cpu({M, N}, dt), xa = cpu({3, M, Kd}, dt), xb = cpu({3, Kd, N}, dt), xaux = cpu({3, M, N}, dt)}
      local name = string.format('%s %dx%dx%d', dt, M, Kd, N)
      local function fwd(a, b, bias)
        return function(d, t)
          local sh = {}
          for i = 1, t[a]:dim() - 1 do sh[i] = t[a]:size(i) end
          sh[#sh + 1] = N
          local o = gp.empty(sh, {dtype = dt, device = d})
          local x = gp.empty(sh, {dtype = dt, device = d})
          gp.k.matmul_bias_gelu_aux(o, x, t[a], b(t), t[bias])
          return {o, x}
        end
      end
      vs_cpu(name .. ' gelu_aux', I, fwd('a', function(t) return t.b end, 'bias'), TOL[dt])
      vs_cpu(name .. ' gelu_aux b^T', I, fwd('a', function(t) return t.bt:t() end, 'bias'), TOL[dt])
      vs_cpu(name .. ' gelu_aux batched', I, fwd('xa', function(t) return t.xb end, 'bias'), TOL[dt])
      local function bwd(a, b, aux)
        return function(d, t)
          local o = gp.empty(t[aux].shape, {dtype = dt, device = d})
          gp.k.matmul_dgelu(o, t[a], b(t), t[aux])
          return {o}
        end
      end
      vs_cpu(name .. ' dgelu', I, bwd('a', function(t) return t.b end, 'aux'), TOL[dt])
      vs_cpu(name .. ' dgelu b^T', I, bwd('a', function(t) return t.bt:t() end, 'aux'), TOL[dt])
      vs_cpu(name .. ' dgelu batched', I, bwd('xa', function(t) return t.xb end, 'xaux'), TOL[dt])
      vs_cpu(name .. ' dgelu in place', I, function(d, t)
        local o = t.aux:clone()
        gp.k.matmul_dgelu(o, t.a, t.b, o)
        return {o}
      end, TOL[dt])
    end
  end
  end)
end)

-- cuBLASLt's epilogues against the separate kernels they replace, on the GPU:
-- a failure here means its GELU (or GELU derivative) is not the tanh form
-- gelu_tanh / gelu_tanh_bwd compute (the message gives the relative norm)
T.test('matmul_bias_gelu_aux and matmul_dgelu cuda: the same as matmul_bias + gelu_tanh and matmul + gelu_tanh_bwd', function()
  T.cuda()
  both_paths(function(lt)
  for _, dt in ipairs {'f32', 'bf16'} do
    local o = {dtype = dt, device = 'cuda'}
    for _, s in ipairs {{256, 128, 512}, {64, 768, 3072}, {33, 65, 17}} do
      local M, Kd, N = s[1], s[2], s[3]
      local a, b, bias = gp.randn({M, Kd}, o), gp.randn({Kd, N}, o) * (1 / math.sqrt(Kd)), gp.randn({N}, o)
      local out, aux = gp.empty({M, N}, o), gp.empty({M, N}, o)
      gp.k.matmul_bias_gelu_aux(out, aux, a, b, bias)
      local pre = gp.empty({M, N}, o)
      gp.k.matmul_bias(pre, a, b, bias, 1, 0)
      local name = string.format('lt %d %s %dx%dx%d', lt, dt, M, Kd, N)
      local e1, e2 = T.relnorm(aux:float():cpu(), pre:float():cpu()), T.relnorm(out:float():cpu(), pre:gelu_tanh():float():cpu())
      T.ok(e1 <= TOL[dt], name .. ': aux vs matmul_bias: ' .. e1)
      T.ok(e2 <= TOL[dt], name .. ': out vs gelu_tanh(matmul_bias): ' .. e2)
      local d = gp.empty({M, N}, o)
      local g = gp.randn({M, Kd}, o)
      gp.k.matmul_dgelu(d, g, b, aux)
      local p = gp.empty({M, N}, o)
      gp.k.matmul(p, g, b, 1, 0)
      local ref = gp.empty({M, N}, o)
      gp.k.gelu_tanh_bwd(ref, aux, p)
      local e3 = T.relnorm(d:float():cpu(), ref:float():cpu())
      T.ok(e3 <= TOL[dt], name .. ': matmul_dgelu vs gelu_tanh_bwd(matmul): ' .. e3)
    end
  end
  end)
end)

T.test('gradcheck gp.linear_gelu_linear in f64 (3-d and 2-d x, a transposed view)', function()
  local rn = function(s) return gp.randn(s, CPU64) end
  local w1, b1, w2, b2 = rn {6, 4}, rn {6}, rn {3, 6}, rn {3}
  T.ok(gp.gradcheck(gp.linear_gelu_linear, {rn {2, 3, 4}, w1, b1, w2, b2}))
  T.ok(gp.gradcheck(function(x, ...) return gp.linear_gelu_linear(x:t(), ...) end, {rn {4, 5}, w1, b1, w2, b2}))
end)

-- the unfused path: a forward on the instance (a swapped Linear) keeps MLP on the module calls
local function unfuse(mlp)
  for _, m in ipairs {mlp.fc, mlp.proj} do
    rawset(m, 'forward', function(self, x) return gp.linear(x, self.weight, self.bias) end)
  end
end

local function node_name(t)
  local n = rawget(t, '_node')
  return n and n.name
end

local function mlp_pair(dev, dt)
  gp.manual_seed(7)
  local a = nn.MLP(8, 24, {device = dev, dtype = dt})
  local b = nn.MLP(8, 24, {device = dev, dtype = dt})
  b:load_state_dict(a:state_dict())
  unfuse(b)
  return a, b
end

local function mlp_same(dev, dt, tol)
  local fused, plain = mlp_pair(dev, dt)
  local x0 = gp.randn({2, 5, 8}, {device = dev, dtype = dt})
  local xa, xb = x0:clone():requires_grad_(), x0:clone():requires_grad_()
  local ya, yb = fused(xa), plain(xb)
  T.eq(node_name(ya), 'linear_gelu_linear')
  T.ok(node_name(yb) ~= 'linear_gelu_linear')
  T.ok(T.relnorm(ya:float(), yb:float()) <= tol, 'values')
  local w = gp.randn(ya.shape, {device = dev, dtype = dt})
  for _ = 1, 2 do -- twice: the second backward accumulates into the existing .grad (GEMMs with beta = 1)
    (ya * w):sum():backward()
    ;(yb * w):sum():backward()
    ya, yb = fused(xa), plain(xb)
  end
  T.ok(T.relnorm(xa.grad:float(), xb.grad:float()) <= tol, 'x.grad')
  local pa, pb = fused:named_parameters(), plain:named_parameters()
  T.eq(#pa, 4)
  for i = 1, #pa do
    local e = T.relnorm(pa[i][2].grad:float(), pb[i][2].grad:float())
    T.ok(e <= tol, pa[i][1] .. '.grad: ' .. e)
  end
end

T.test('nn.MLP: fused and unfused give the same values and gradients (CPU)', function()
  mlp_same('cpu', 'f32', 1e-5)
end)

T.test('nn.MLP: fused and unfused give the same values and gradients (CUDA f32, bf16)', function()
  T.cuda()
  mlp_same('cuda', 'f32', 1e-5)
  mlp_same('cuda', 'bf16', 2e-2)
end)

T.test('nn.MLP: the fused op only for plain Linears with biases; dropout still applies', function()
  gp.manual_seed(3)
  local x = gp.randn({2, 8}, CPU)
  local m = nn.MLP(8, 16, {device = 'cpu'})
  T.eq(node_name(m(x)), 'linear_gelu_linear')
  -- LoRA-wrapped Linears: the module calls
  local l = nn.MLP(8, 16, {device = 'cpu'})
  gp.lora.apply(l, {rank = 2, targets = {'fc', 'proj'}})
  T.ok(getmetatable(l.fc) ~= getmetatable(m.proj))
  T.ok(node_name(l(x)) ~= 'linear_gelu_linear')
  -- no bias: the module calls
  local nb = nn.MLP(8, 16, {device = 'cpu', bias = false})
  T.ok(node_name(nb(x)) ~= 'linear_gelu_linear')
  -- dropout after proj, in training mode
  local d = nn.MLP(8, 16, {device = 'cpu', dropout = 0.5})
  local y = d(x)
  T.ok(node_name(y) == 'dropout')
  d:eval()
  T.eq(node_name(d(x)), 'linear_gelu_linear')
end)

T.test('a tiny GPT trains the same losses with the fused MLP and without', function()
  local cfg = {vocab_size = 7, block_size = 8, n_embd = 16, n_layer = 2, n_head = 2, device = 'cpu'}
  gp.manual_seed(11)
  local a = nn.GPT(cfg)
  local b = nn.GPT(cfg)
  b:load_state_dict(a:state_dict())
  for _, blk in ipairs(b.h) do unfuse(blk.mlp) end
  local idx = gp.randint(0, 7, {2, 8}, {dtype = 'i64', device = 'cpu'})
  local tg = gp.randint(0, 7, {2, 8}, {dtype = 'i64', device = 'cpu'})
  local function step(m)
    m:zero_grad()
    local _, loss = m(idx, tg)
    loss:backward()
    gp.no_grad(function()
      for _, p in ipairs(m:parameters()) do p:sub_(p.grad * 0.3) end
    end)
    return loss:item()
  end
  for i = 1, 5 do
    local la, lb = step(a), step(b)
    T.near(la, lb, 1e-5 * math.max(1, math.abs(lb)), 'step ' .. i)
  end
end)

T.test('linear_gelu_linear: bad input names the op and the shapes', function()
  local x, w1, b1, w2, b2 = cpu {2, 4}, cpu {6, 4}, cpu {6}, cpu {3, 6}, cpu {3}
  T.raises(function() return gp.linear_gelu_linear(cpu {2, 5}, w1, b1, w2, b2) end,
    'linear_gelu_linear: x (2,5), w1 (6,4), b1 (6), w2 (3,6), b2 (3)')
  T.raises(function() return gp.linear_gelu_linear(x, w1, b1, cpu {3, 5}, b2) end, 'linear_gelu_linear:', 'w2 (3,5)')
  T.raises(function() return gp.linear_gelu_linear(x, w1, cpu {5}, w2, b2) end, 'linear_gelu_linear:', 'b1 (5)')
  T.raises(function() return gp.linear_gelu_linear(x, w1, b1, w2, cpu {4}) end, 'linear_gelu_linear:', 'b2 (4)')
  T.raises(function() return gp.linear_gelu_linear(x, cpu {6}, b1, w2, b2) end, 'linear_gelu_linear:', 'w1 (6)')
  T.raises(function() return gp.linear_gelu_linear(x, w1, nil, w2, b2) end, 'linear_gelu_linear: b1 must be a tensor')
  T.raises(function() return gp.linear_gelu_linear(x, w1:to('f64'), b1, w2, b2) end, 'linear_gelu_linear: w1 is f64 but x is f32')
  -- the kernels check their own arguments
  local o, aux = gp.empty({2, 6}, CPU), gp.empty({2, 6}, CPU)
  T.raises(function() gp.k.matmul_bias_gelu_aux(o, gp.empty({2, 5}, CPU), x, w1:t(), b1) end,
    'matmul_bias_gelu_aux:', '(2,5)')
  T.raises(function() gp.k.matmul_bias_gelu_aux(o, aux:t():contiguous():t(), x, w1:t(), b1) end, 'matmul_bias_gelu_aux:')
  T.raises(function() gp.k.matmul_bias_gelu_aux(o, o, x, w1:t(), b1) end, 'matmul_bias_gelu_aux: aux (2,6) shares storage with out')
  T.raises(function() gp.k.matmul_dgelu(o, x, cpu {3, 6}, aux) end, 'matmul_dgelu:', '(3,6)')
  T.raises(function() gp.k.matmul_dgelu(o, cpu {2, 3}, cpu {3, 6}, gp.empty({2, 5}, CPU)) end, 'matmul_dgelu:', '(2,5)')
  -- out another view of aux's storage
  local buf = gp.empty({12}, CPU)
  T.raises(function() gp.k.matmul_dgelu(buf:narrow(1, 7, 6):view {2, 3}, cpu {2, 5}, cpu {5, 3}, buf:narrow(1, 1, 6):view {2, 3}) end,
    'matmul_dgelu: aux (2,3) shares storage with out (2,3)')
end)

T.test('linear_gelu_linear: device mismatch is an error', function()
  T.cuda()
  local x = gp.randn({2, 4}, {device = 'cuda'})
  T.raises(function() return gp.linear_gelu_linear(x, cpu {6, 4}, cpu {6}, cpu {3, 6}, cpu {3}) end,
    'linear_gelu_linear: w1 is on cpu but x is on cuda')
end)
