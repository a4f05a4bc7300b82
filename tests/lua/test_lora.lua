-- LoRA: starts as the base, trains only the adapters, gradients by finite
-- differences (f64), merge/unmerge, adapters saved and loaded on their own.
local T = require 'lib'
local gp = require 'gpush'
local fd = require 'fd'
local nn = gp.nn

local cpu = {device = 'cpu'}

local function tiny_gpt(dtype)
  gp.manual_seed(5)
  return nn.GPT {vocab_size = 11, block_size = 8, n_embd = 16, n_layer = 2, n_head = 2, device = 'cpu', dtype = dtype}
end

T.test('lora: wraps attention and MLP Linears, starts as the base, keeps the base keys', function()
  local m = tiny_gpt()
  local keys0 = {}
  for k in pairs(m:state_dict()) do keys0[#keys0 + 1] = k end
  local x = gp.randint(0, 11, {2, 8}, {dtype = 'i64', device = 'cpu'})
  local y0 = m(x)
  local ad = gp.lora.apply(m, {rank = 4, alpha = 8})
  T.eq(#ad, 2 * 4 * 2) -- qkv, proj, fc, proj per block: A and B each
  T.eq(#gp.lora.modules(m), 8)
  -- (to rounding: the base MLP runs as one gp.linear_gelu_linear, GELU on the unrounded product)
  T.ok(T.relnorm(m(x), y0) < 1e-6, 'B = 0 at init: the adapted model is the base')
  local sd = m:state_dict()
  for _, k in ipairs(keys0) do T.ok(sd[k] ~= nil, 'base key kept: ' .. k) end
  T.ok(sd['h.1.attn.qkv.lora_A'] ~= nil and sd['h.2.mlp.proj.lora_B'] ~= nil)
  -- only the adapters require grad
  local n = 0
  for _, p in ipairs(m:parameters()) do if p:needs_grad() then n = n + 1 end end
  T.eq(n, #ad)
end)

T.test('lora: only adapters get gradients; finite differences in f64', function()
  local m = tiny_gpt()
  gp.lora.apply(m, {rank = 2})
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.1) end
  local x = gp.randint(0, 11, {2, 8}, {dtype = 'i64', device = 'cpu'})
  local _, loss = m(x, x)
  loss:backward()
  local l1 = gp.lora.modules(m)[1][2]
  T.ok(l1.lora_A.grad ~= nil and l1.lora_B.grad ~= nil)
  T.ok(l1.weight.grad == nil and m.wte.weight.grad == nil, 'the base is frozen')
  -- one LoRA layer in f64: gradients of A, B and x
  gp.manual_seed(3)
  local lin = nn.Linear(5, 3, {dtype = 'f64', device = 'cpu'})
  local lo = nn.LoRA(lin, {rank = 2, alpha = 3})
  nn.init.normal_(lo.lora_B, 0, 0.5)
  local a0, b0 = lo.lora_A, lo.lora_B
  local xin = fd.randn {4, 5}
  T.ok(gp.gradcheck(function(a, b, xx)
    lo.lora_A, lo.lora_B = a, b
    return lo(xx)
  end, {a0:detach():contiguous(), b0:detach():contiguous(), xin}))
end)

T.test('lora: merge equals the adapted forward, unmerge restores exactly; merged() runs a function merged', function()
  local m = tiny_gpt()
  gp.lora.apply(m, {rank = 4})
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.2) end
  local x = gp.randint(0, 11, {3, 8}, {dtype = 'i64', device = 'cpu'})
  local y = m(x)
  local w0 = m.h[1].attn.qkv.weight:clone()
  gp.lora.merge(m)
  T.ok(m.h[1].attn.qkv.merged)
  T.ok(T.relnorm(m(x), y) < 1e-5)
  T.raises(function() gp.lora.without(m, function() return m(x) end) end, 'merged')
  gp.lora.unmerge(m)
  T.ok(T.relnorm(m.h[1].attn.qkv.weight, w0) == 0)
  T.ok(T.relnorm(m(x), y) == 0)
  -- without(): the base output, then the adapters are back
  local base = gp.lora.without(m, function() return m(x) end)
  T.ok(T.relnorm(base, y) > 1e-3)
  T.ok(T.relnorm(m(x), y) == 0)
  -- merged(): fn's results with the adapters merged, the weights restored exactly after, also on error
  local a, b = gp.lora.merged(m, function(v) T.ok(m.h[1].attn.qkv.merged); return m(v), 7 end, x)
  T.ok(T.relnorm(a, y) < 1e-5)
  T.eq(b, 7)
  T.ok(not m.h[1].attn.qkv.merged and T.relnorm(m.h[1].attn.qkv.weight, w0) == 0)
  T.raises(function() gp.lora.merged(m, function() error('boom') end) end, 'boom')
  T.ok(not m.h[1].attn.qkv.merged and T.relnorm(m.h[1].attn.qkv.weight, w0) == 0)
end)

T.test('lora: adapters save and load on their own', function()
  local m = tiny_gpt()
  gp.lora.apply(m, {rank = 3, alpha = 6})
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.2) end
  local path = os.tmpname()
  gp.lora.save(path, m, {step = 7})
  local sd, meta = gp.load(path)
  local n = 0
  for k in pairs(sd) do n = n + 1; T.ok(k:find('lora_[AB]$'), k) end
  T.eq(n, 16)
  T.eq(meta.lora.rank, 3)
  T.eq(meta.step, 7)
  local m2 = tiny_gpt() -- same seed: the same base
  gp.lora.apply(m2, {rank = 3, alpha = 6})
  gp.lora.load(m2, path)
  os.remove(path)
  local x = gp.randint(0, 11, {2, 8}, {dtype = 'i64', device = 'cpu'})
  T.ok(T.relnorm(m2(x), m(x)) == 0)
  -- errors
  local m3 = tiny_gpt()
  T.raises(function() gp.lora.load(m3, sd) end, 'lora.load', 'no LoRA')
  gp.lora.apply(m3, {rank = 3, targets = {'attn%.qkv$'}})
  T.raises(function() gp.lora.load(m3, sd) end, 'lora.load', 'unexpected', 'mlp.fc.lora_A')
  T.raises(function() nn.LoRA(nn.Embedding(3, 4, cpu)) end, 'LoRA', 'nn.Linear')
  T.raises(function() nn.LoRA(nn.Linear(3, 4, cpu), {rank = 0}) end, 'LoRA', 'rank')
  T.raises(function() gp.lora.apply(tiny_gpt(), {targets = {'nothing'}}) end, 'lora.apply', 'nothing')
end)

-- the unfused composition gp.lora_linear replaces
local function lora_ref(x, w, b, A, B, s) return gp.linear(x, w, b) + gp.linear(gp.linear(x, A), B) * s end

T.test('lora: gp.lora_linear is one node equal to linear + s (x A^T) B^T; gradients by finite differences (f64)', function()
  gp.manual_seed(8)
  local f64 = {dtype = 'f64', device = 'cpu'}
  local w, b = gp.randn({6, 16}, f64), gp.randn({6}, f64)
  local A, B = gp.randn({3, 16}, f64), gp.randn({6, 3}, f64)
  local x = gp.randn({2, 5, 16}, f64)
  local y = gp.lora_linear(x, w, b, A, B, 0.7)
  T.same(y.shape, {2, 5, 6})
  T.ok(T.relnorm(y, lora_ref(x, w, b, A, B, 0.7)) < 1e-12)
  -- gradients of x, A, B (and of a trainable w and b) against finite differences
  T.ok(gp.gradcheck(function(xx, aa, bb) return gp.lora_linear(xx, w, b, aa, bb, 0.7) end,
    {fd.randn {2, 3, 16}, fd.randn {3, 16}, fd.randn {6, 3}}))
  T.ok(gp.gradcheck(function(ww, bias) return gp.lora_linear(x, ww, bias, A, B, 2) end, {fd.randn {6, 16}, fd.randn {6}}))
  -- an NF4 base: the same as the composition over the quantized weight (w frozen)
  local q = gp.quantize(w, {block = 16})
  T.ok(gp.gradcheck(function(xx, aa, bb) return gp.lora_linear(xx, q, nil, aa, bb, 0.5) end,
    {fd.randn {4, 16}, fd.randn {3, 16}, fd.randn {6, 3}}))
  -- one autograd node; the grads equal the composition's
  local xa, Aa, Ba = x:clone():requires_grad(), A:clone():requires_grad(), B:clone():requires_grad()
  local xb, Ab, Bb = x:clone():requires_grad(), A:clone():requires_grad(), B:clone():requires_grad()
  local ya = gp.lora_linear(xa, w, b, Aa, Ba, 0.7)
  T.eq(rawget(ya, '_node').name, 'lora_linear')
  local g = gp.randn(ya.shape, f64)
  ya:backward(g)
  lora_ref(xb, w, b, Ab, Bb, 0.7):backward(g)
  for _, pr in ipairs {{xa, xb}, {Aa, Ab}, {Ba, Bb}} do T.ok(T.relnorm(pr[1].grad, pr[2].grad) < 1e-12) end
  -- bad input: clear errors naming the op and the shapes
  T.raises(function() gp.lora_linear(x, w, b, gp.randn({3, 7}, f64), B, 1) end, 'lora_linear: x (2,5,16), w (6,16), A (3,7)')
  T.raises(function() gp.lora_linear(x, w, b, A:float(), B, 1) end, 'lora_linear: A is f32 on cpu but x is f64 on cpu')
  T.raises(function() gp.lora_linear(x, w, b, A, B, 'x') end, 'lora_linear: the scaling s must be a number')
end)

T.test('lora: gp.lora_linear in bf16 on the GPU equals the composition, forward and gradients (cuda)', function()
  T.cuda()
  gp.manual_seed(9)
  local o = {dtype = 'bf16', device = 'cuda'}
  local w = gp.randn({192, 128}, o)
  for _, base in ipairs {w, gp.quantize(w, {block = 64})} do
    local A, B = gp.randn({16, 128}, o) * 0.1, gp.randn({192, 16}, o) * 0.1
    local x = gp.randn({3, 40, 128}, o)
    local xa, Aa, Ba = x:clone():requires_grad(), A:clone():requires_grad(), B:clone():requires_grad()
    local xb, Ab, Bb = x:clone():requires_grad(), A:clone():requires_grad(), B:clone():requires_grad()
    local ya, yb = gp.lora_linear(xa, base, nil, Aa, Ba, 2), lora_ref(xb, base, nil, Ab, Bb, 2)
    T.ok(T.relnorm(ya:float(), yb:float()) < 1e-2)
    local g = gp.randn(ya.shape, o)
    ya:backward(g)
    yb:backward(g)
    for _, pr in ipairs {{xa, xb}, {Aa, Ab}, {Ba, Bb}} do T.ok(T.relnorm(pr[1].grad:float(), pr[2].grad:float()) < 2e-2) end
  end
end)

-- gp.lora_linear_group over 3 projections of x (16 in; outs 6, 4, 4; ranks 3, 2, 2): the base weights as row
-- blocks of one tensor (fused) or tensors of their own, or NF4; the A as row blocks of one tensor (as
-- gp.lora.apply makes them) or of their own; biases on the first and last projection
local OUTS, RANKS = {6, 4, 4}, {3, 2, 2}
local function blocks(t, sizes)
  local r, off = {}, 1
  for i, n in ipairs(sizes) do r[i] = t:narrow(1, off, n); off = off + n end
  return r
end
local function group_case(base, fusedA, o)
  gp.manual_seed(21)
  o = o or {dtype = 'f64', device = 'cpu'}
  local W = gp.randn({14, 16}, o)
  local ws = blocks(W, OUTS)
  if base == 'alone' then for i = 1, 3 do ws[i] = ws[i]:clone() end end
  if base == 'nf4' then for i = 1, 3 do ws[i] = gp.quantize(ws[i]:contiguous(), {block = 16}) end end
  local A = gp.randn({7, 16}, o)
  local As = blocks(A, RANKS)
  if not fusedA then for i = 1, 3 do As[i] = As[i]:clone() end end
  local Bs = {gp.randn({6, 3}, o), gp.randn({4, 2}, o), gp.randn({4, 2}, o)}
  return ws, {gp.randn({6}, o), nil, gp.randn({4}, o)}, As, Bs
end

-- the adapters made leaves that require grad, in place (the A stay views of one tensor when they were)
local function leaves(As, Bs)
  for i = 1, 3 do As[i]:requires_grad(); Bs[i] = Bs[i]:clone():requires_grad() end
  return As, Bs
end

-- a loss that uses each output differently
local function group_loss(ys) return ys[1]:tanh():sum() + (ys[2] * ys[2]):sum() + ys[3]:sin():sum() end

T.test('lora: gp.lora_linear_group is one node equal to one gp.lora_linear a projection, forward and gradients (fused, separate and NF4 bases)', function()
  local f64 = {dtype = 'f64', device = 'cpu'}
  for _, base in ipairs {'fused', 'alone', 'nf4'} do
    for _, fusedA in ipairs {true, false} do
      for _, bias in ipairs {true, false} do
        local what = string.format('%s base, %s A, %s', base, fusedA and 'fused' or 'separate', bias and 'biases' or 'no bias')
        local ws, bs, As0, Bs0 = group_case(base, fusedA)
        if not bias then bs = nil end
        local x0 = gp.randn({2, 5, 16}, f64)
        -- the group, and each projection alone (the same numbers: A cloned)
        local x1, x2 = x0:clone():requires_grad(), x0:clone():requires_grad()
        local A2, B2 = leaves({As0[1]:clone(), As0[2]:clone(), As0[3]:clone()}, {Bs0[1], Bs0[2], Bs0[3]})
        local A1, B1 = leaves({As0[1], As0[2], As0[3]}, {Bs0[1], Bs0[2], Bs0[3]})
        local ys, c = T.counted(function() return {gp.lora_linear_group(x1, ws, bs, A1, B1, 0.7)} end)
        local refs = {}
        for i = 1, 3 do refs[i] = gp.lora_linear(x2, ws[i], bs and bs[i], A2[i], B2[i], 0.7) end
        T.eq(#ys, 3)
        local node = rawget(ys[1], '_node')
        T.eq(node.name, 'lora_linear_group', what)
        T.ok(rawget(ys[2], '_node') == node and rawget(ys[3], '_node') == node, what .. ': one node for the three outputs')
        -- products: the base (one when fused), one for every A, one per B
        local nbase = base == 'fused' and 1 or base == 'alone' and 3 or nil
        if nbase then T.eq(c.products, nbase + 1 + 3, what .. ': products') end
        for i = 1, 3 do
          T.same(ys[i].shape, {2, 5, OUTS[i]})
          T.ok(T.relnorm(ys[i], refs[i]) < 1e-12, what .. ': y' .. i .. ' ' .. T.relnorm(ys[i], refs[i]))
        end
        gp.manual_seed(5)
        group_loss(ys):backward()
        group_loss(refs):backward()
        T.ok(T.relnorm(x1.grad, x2.grad) < 1e-12, what .. ': dx ' .. T.relnorm(x1.grad, x2.grad))
        for i = 1, 3 do
          T.ok(T.relnorm(A1[i].grad, A2[i].grad) < 1e-12, what .. ': dA' .. i)
          T.ok(T.relnorm(B1[i].grad, B2[i].grad) < 1e-12, what .. ': dB' .. i)
        end
      end
    end
  end
end)

T.test('lora: gp.lora_linear_group gradients by finite differences (f64): x, A, B, a trainable base and its biases', function()
  local ws, bs, As, Bs = group_case('fused', false)
  local x = fd.randn {3, 16}
  -- x, the A and B; the outputs joined by cat (their gradients are column blocks of one tensor: dx one product
  -- over the fused base) or each changed first (gradients of their own: dx a product a projection)
  local joins = {function(ys) return gp.cat(ys, -1) end, function(ys) return gp.cat({ys[1]:tanh(), ys[2] * 2, ys[3]}, -1) end}
  -- the backward's products: 3 dB, 3 dh, one dA, dx over the base (1 or 3) and one dx += dh A
  for j, want in ipairs {9, 11} do
    local xx = x:clone():requires_grad()
    local A, B = leaves({As[1]:clone(), As[2]:clone(), As[3]:clone()}, {Bs[1], Bs[2], Bs[3]})
    local out = joins[j] {gp.lora_linear_group(xx, ws, bs, A, B, 0.7)}
    local _, c = T.counted(function() out:backward(gp.ones_like(out)) end)
    T.eq(c.products, want, 'backward products')
  end
  for _, join in ipairs(joins) do
    T.ok(gp.gradcheck(function(xx, a1, a2, a3, b1, b2, b3)
      return join {gp.lora_linear_group(xx, ws, bs, {a1, a2, a3}, {b1, b2, b3}, 0.7)}
    end, {x, As[1]:contiguous(), As[2]:contiguous(), As[3]:contiguous(), Bs[1]:contiguous(), Bs[2]:contiguous(), Bs[3]:contiguous()}))
  end
  -- leading dims, and the base weights and biases trainable (their own tensors)
  local x3 = fd.randn {2, 2, 16}
  T.ok(gp.gradcheck(function(w1, w2, w3, c1, c3)
    return gp.cat({gp.lora_linear_group(x3, {w1, w2, w3}, {c1, nil, c3}, As, Bs, 1.5)}, -1)
  end, {fd.randn {6, 16}, fd.randn {4, 16}, fd.randn {4, 16}, fd.randn {6}, fd.randn {4}}))
  -- an NF4 base (frozen) with x and the A, B
  local qs = group_case('nf4', true)
  T.ok(gp.gradcheck(function(xx, a1, a2, a3, b1)
    return gp.cat({gp.lora_linear_group(xx, qs, nil, {a1, a2, a3}, {b1, Bs[2], Bs[3]}, 0.5)}, -1)
  end, {fd.randn {2, 3, 16}, fd.randn {3, 16}, fd.randn {2, 16}, fd.randn {2, 16}, fd.randn {6, 3}}))
end)

T.test('lora: gp.lora_linear_group adds dA into the A\'s gradients with one GEMM when those are one tensor\'s row blocks', function()
  local f64 = {dtype = 'f64', device = 'cpu'}
  local ws, bs, As0, Bs0 = group_case('fused', true)
  local x, G0 = gp.randn({4, 16}, f64), gp.randn({7, 16}, f64)
  local function run(flat)
    local As, Bs = leaves(blocks(gp.cat(As0, 1), RANKS), {Bs0[1], Bs0[2], Bs0[3]})
    local G = G0:clone() -- gradients held from before: the backward adds to them
    local gs = flat and blocks(G, RANKS) or {G:narrow(1, 1, 3):clone(), G:narrow(1, 4, 2):clone(), G:narrow(1, 6, 2):clone()}
    for i = 1, 3 do rawset(As[i], 'grad', gs[i]); rawset(Bs[i], 'grad', gp.zeros({OUTS[i], RANKS[i]}, f64)) end
    local ys = {gp.lora_linear_group(x, ws, bs, As, Bs, 0.7)}
    local Tensor = require('gpush.core.tensor').Tensor
    local _, c = T.counted(function() group_loss(ys):backward() end, {add = {Tensor, 'add_'}})
    for i = 1, 3 do T.ok(rawget(As[i], 'grad') == gs[i], 'the gradient tensors kept') end
    return gp.cat(gs, 1), c
  end
  local g1, c1 = run(true)
  local g2, c2 = run(false)
  T.eq(c1.add, 0, 'one tensor: added by the GEMM')
  T.eq(c2.add, 3, 'tensors of their own: row blocks of dA added to each')
  T.eq(c1.products, c2.products)
  T.ok(T.relnorm(g1, g2) < 1e-12)
end)

T.test('lora: gp.lora_linear_group on bad input is a clear error naming the op and the shapes', function()
  local f64 = {dtype = 'f64', device = 'cpu'}
  local ws, bs, As, Bs = group_case('fused', true)
  local x = gp.randn({2, 5, 16}, f64)
  local G = gp.lora_linear_group
  T.raises(function() G(x, ws, bs, {As[1], gp.randn({2, 7}, f64), As[3]}, Bs, 1) end,
    'lora_linear_group: projection 2: x (2,5,16), w (4,16), A (2,7), B (4,2)')
  T.raises(function() G(x, ws, bs, As, {Bs[1], Bs[2], gp.randn({5, 2}, f64)}, 1) end, 'lora_linear_group: projection 3', 'B (5,2)')
  T.raises(function() G(gp.randn({2, 15}, f64), ws, bs, As, Bs, 1) end, 'lora_linear_group: projection 1: x (2,15), w (6,16)')
  T.raises(function() G(x, ws, bs, {As[1], As[2]}, Bs, 1) end, 'lora_linear_group: 3 weights, 2 A and 3 B given')
  T.raises(function() G(x, ws, bs, As[1], Bs, 1) end, 'lora_linear_group: As must be a non-empty list, got a tensor')
  T.raises(function() G(x, {}, bs, As, Bs, 1) end, 'lora_linear_group: ws must be a non-empty list')
  T.raises(function() G(x, ws, bs, {As[1]:float(), As[2], As[3]}, Bs, 1) end, 'lora_linear_group: A[1] is f32 on cpu but x is f64 on cpu')
  T.raises(function() G(x, {ws[1]:float(), ws[2], ws[3]}, bs, As, Bs, 1) end, 'lora_linear_group: ws[1] is f32 on cpu but x is f64 on cpu')
  T.raises(function() G(x, {ws[1], 'w', ws[3]}, bs, As, Bs, 1) end, 'lora_linear_group: ws[2] must be a 2-d weight')
  T.raises(function() G(x, ws, {gp.randn({5}, f64)}, As, Bs, 1) end, 'lora_linear_group: bs[1] must be a (6) tensor of f64 on cpu, got f64 (5) on cpu')
  T.raises(function() G(x, ws, bs[1], As, Bs, 1) end, 'lora_linear_group: bs must be nil or a list')
  T.raises(function() G(x, ws, bs, As, Bs, 'x') end, 'lora_linear_group: the scaling s must be a number')
  T.raises(function() G(x:long(), ws, bs, As, Bs, 1) end, 'lora_linear_group: x is i64')
  T.raises(function() G(nil, ws, bs, As, Bs, 1) end, 'lora_linear_group: x must be a tensor')
end)

T.test('lora: gp.lora_linear_group in bf16 on the GPU equals one gp.lora_linear a projection, forward and gradients (cuda)', function()
  T.cuda()
  local o = {dtype = 'bf16', device = 'cuda'}
  gp.manual_seed(9)
  local W = gp.randn({448, 128}, o) -- q 192, k 128, v 128 rows of one tensor
  local sizes = {192, 128, 128}
  for _, base in ipairs {'fused', 'nf4'} do
    local ws = blocks(W, sizes)
    if base == 'nf4' then for i = 1, 3 do ws[i] = gp.quantize(ws[i]:contiguous(), {block = 64}) end end
    local A = gp.randn({48, 128}, o) * 0.1
    local Bs = {gp.randn({192, 16}, o) * 0.1, gp.randn({128, 16}, o) * 0.1, gp.randn({128, 16}, o) * 0.1}
    local bs = base == 'fused' and {gp.randn({192}, o), gp.randn({128}, o), gp.randn({128}, o)} or nil
    local x0 = gp.randn({3, 40, 128}, o)
    local x1, x2 = x0:clone():requires_grad(), x0:clone():requires_grad()
    local A1, B1 = leaves(blocks(A:clone(), {16, 16, 16}), {Bs[1], Bs[2], Bs[3]})
    local A2, B2 = leaves(blocks(A:clone(), {16, 16, 16}), {Bs[1], Bs[2], Bs[3]})
    for i = 1, 3 do A2[i] = A2[i]:detach():clone():requires_grad() end
    local ys = {gp.lora_linear_group(x1, ws, bs, A1, B1, 2)}
    local refs = {}
    for i = 1, 3 do refs[i] = gp.lora_linear(x2, ws[i], bs and bs[i], A2[i], B2[i], 2) end
    for i = 1, 3 do T.ok(T.relnorm(ys[i]:float(), refs[i]:float()) < 1e-2, base .. ': y' .. i) end
    local gs = {gp.randn(ys[1].shape, o), gp.randn(ys[2].shape, o), gp.randn(ys[3].shape, o)}
    local function loss(t) return (t[1] * gs[1]):sum() + (t[2] * gs[2]):sum() + (t[3] * gs[3]):sum() end
    loss(ys):backward()
    loss(refs):backward()
    T.ok(T.relnorm(x1.grad:float(), x2.grad:float()) < 2e-2, base .. ': dx')
    for i = 1, 3 do
      T.ok(T.relnorm(A1[i].grad:float(), A2[i].grad:float()) < 2e-2, base .. ': dA' .. i)
      T.ok(T.relnorm(B1[i].grad:float(), B2[i].grad:float()) < 2e-2, base .. ': dB' .. i)
    end
  end
end)
