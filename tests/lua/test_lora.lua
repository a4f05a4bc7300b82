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
