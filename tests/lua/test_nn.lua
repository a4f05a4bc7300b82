-- gp.nn: the Module protocol, gradients of every module against central
-- differences in f64 on the CPU, state dicts through gp.save/gp.load,
-- train/eval, the GPT (shapes, causality, a few SGD steps), and GPU vs CPU.
local T = require 'lib'
local gp = require 'gpush'
local nn = gp.nn

local CPU = {device = 'cpu'}
local CPU64 = {dtype = 'f64', device = 'cpu'}
local function rn(shape) return gp.randn(shape, CPU64) end
local shape_str = require('gpush.core.tensor').shape_str
local tensor = require 'gpush.core.tensor'

-- gradcheck of m(x...) with respect to the inputs and every parameter
local function check_module(m, inputs, opts)
  local ps = m:parameters()
  local all = {}
  for _, x in ipairs(inputs) do all[#all + 1] = x end
  for _, p in ipairs(ps) do all[#all + 1] = p end
  local n = #inputs
  T.ok(gp.gradcheck(function(...) return m(unpack({...}, 1, n)) end, all, opts))
end

local function tiny_gpt(extra, dev)
  local cfg = {vocab_size = 5, block_size = 6, n_embd = 4, n_layer = 1, n_head = 2, mlp_hidden = 8, device = dev or 'cpu'}
  for k, v in pairs(extra or {}) do cfg[k] = v end
  return nn.GPT(cfg)
end

T.test('Module protocol: fields in order, dotted names, lists, children, train/eval, zero_grad, num_parameters', function()
  local Net = nn.Module:extend('Net')
  function Net:init(d)
    self.fc2 = nn.Linear(d, 3, {device = 'cpu'})
    self.fc1 = nn.Linear(3, d, {bias = false, device = 'cpu'})
    self.blocks = {nn.LayerNorm(d, {device = 'cpu'}), nn.Dropout(0.1)}
    self.scale = nn.Parameter(gp.ones({1}, CPU))
    self.note = {1, 2, 3}            -- a plain table: not a parameter
    self.cache = gp.zeros({2}, CPU)  -- a plain tensor: not state
  end
  function Net:forward(x) return self.blocks[1](self.fc1(self.fc2(x))) * self.scale end
  local m = Net(4)
  local names = {}
  for i, nt in ipairs(m:named_parameters()) do names[i] = nt[1] end
  T.same(#names, 6)
  T.eq(table.concat(names, ' '), 'fc2.weight fc2.bias fc1.weight blocks.1.weight blocks.1.bias scale')
  T.eq(#m:parameters(), 6)
  T.eq(m:num_parameters(), 4 * 3 + 3 + 3 * 4 + 4 + 4 + 1)
  local kids = m:named_children()
  T.eq(#kids, 4)
  T.eq(kids[3][1], 'blocks.1')
  T.eq(#m:children(), 4)
  T.eq(#m:modules(), 5)
  T.ok(m.training and m.blocks[2].training)
  m:eval()
  T.ok(not m.training and not m.blocks[2].training and not m.fc1.training)
  m:train()
  T.ok(m.blocks[2].training)
  local y = m(gp.randn({2, 4}, CPU))
  T.eq(shape_str(y.shape), '(2,4)')
  y:sum():backward()
  for _, p in ipairs(m:parameters()) do T.ok(p.grad ~= nil) end
  m:zero_grad()
  for _, p in ipairs(m:parameters()) do T.eq(p.grad, nil) end
  T.ok(tostring(m):find('Net', 1, true) and tostring(m):find('Linear(4 -> 3)', 1, true))
  T.raises(function() nn.Module:extend('X')():forward() end, 'X', 'forward')
  -- subclass of a subclass calls the parent's init
  local Scaled = nn.Linear:extend('Scaled')
  function Scaled:init(i, o) nn.Linear.init(self, i, o, {device = 'cpu'}); self.k = 2 end
  function Scaled:forward(x) return nn.Linear.forward(self, x) * self.k end
  local s = Scaled(3, 2)
  T.eq(#s:parameters(), 2)
  T.eq(shape_str(s(gp.randn({5, 3}, CPU)).shape), '(5,2)')
end)

T.test('to(dtype) keeps tied weights tied and parameters leaves; requires_grad_ freezes', function()
  local m = tiny_gpt()
  T.ok(rawequal(m.lm_head.weight, m.wte.weight))
  local n = m:num_parameters()
  m:to('f64')
  T.ok(rawequal(m.lm_head.weight, m.wte.weight))
  T.eq(m.wte.weight.dtype, 'f64')
  T.eq(m:num_parameters(), n)
  for _, p in ipairs(m:parameters()) do T.ok(p:is_leaf() and p:needs_grad()) end
  m:requires_grad_(false)
  T.eq(#m:parameters(), #m:named_parameters())
  for _, p in ipairs(m:parameters()) do T.ok(not p:needs_grad()) end
  -- untied: one more parameter
  T.eq(#tiny_gpt({tie_weights = false}):parameters(), #m:parameters() + 1)
end)

T.test('gradcheck Linear, Embedding, LayerNorm, RMSNorm, Dropout in f64', function()
  check_module(nn.Linear(3, 4, {device = 'cpu'}):to('f64'), {rn {2, 3}})
  check_module(nn.Linear(3, 4, {bias = false, device = 'cpu'}):to('f64'), {rn {2, 5, 3}})
  local e = nn.Embedding(6, 3, {device = 'cpu'}):to('f64')
  local idx = gp.tensor({{0, 5, 5}, {2, 0, 1}}, {dtype = 'i64', device = 'cpu'})
  T.ok(gp.gradcheck(function(w) return e(idx) end, {e.weight}))
  check_module(nn.LayerNorm(5, {device = 'cpu'}):to('f64'), {rn {3, 5}})
  check_module(nn.RMSNorm(5, {eps = 1e-3, device = 'cpu'}):to('f64'), {rn {2, 2, 5}})
  local d = nn.Dropout(0.4)
  T.ok(gp.gradcheck(function(x) gp.manual_seed(11); return d(x) end, {rn {4, 5}}))
  d:eval()
  check_module(d, {rn {4, 5}})
end)

T.test('gradcheck MLP, SwiGLUMLP, attention, CausalSelfAttention in f64', function()
  check_module(nn.MLP(4, 6, {device = 'cpu'}):to('f64'), {rn {2, 3, 4}})
  check_module(nn.SwiGLUMLP(4, 6, {device = 'cpu'}):to('f64'), {rn {2, 3, 4}})
  T.ok(gp.gradcheck(function(q, k, v) return nn.attention(q, k, v, {causal = true}) end, {rn {2, 2, 4, 3}, rn {2, 2, 4, 3}, rn {2, 2, 4, 5}}))
  T.ok(gp.gradcheck(function(q, k, v) return nn.attention(q, k, v) end, {rn {3, 2, 3}, rn {3, 4, 3}, rn {3, 4, 2}}))
  T.ok(gp.gradcheck(function(q, k, v) return nn.attention(q, k, v, {causal = true, scale = 0.7}) end, {rn {1, 2, 3}, rn {1, 4, 3}, rn {1, 4, 2}}))
  check_module(nn.CausalSelfAttention {n_embd = 4, n_head = 2, device = 'cpu'}:to('f64'), {rn {2, 3, 4}})
end)

T.test('gp.linear_group: the values and gradients of separate gp.linear calls, one node, dx without an add kernel', function()
  local x, w1, w2, w3, b1 = rn {2, 3, 4}, rn {5, 4}, rn {6, 4}, rn {2, 4}, rn {5}
  T.ok(gp.gradcheck(function(a, p, q, r, bb)
    local y1, y2, y3 = gp.linear_group(a, {p, q, r}, {bb})
    return y1:sum() + (y2 * y2):sum() + (y3 * 3):sum()
  end, {x, w1, w2, w3, b1}))
  T.ok(gp.gradcheck(function(a, b, c) local y1, y2 = gp.linear_group(a, {b, c}); return y1:sum() + (y2 * y2):sum() end,
    {x, w1, w2}))
  -- against the module calls: values, gradients accumulated twice into .grad, one output unused
  local function grads(group)
    local xs, ws = x:clone():requires_grad_(), {w1:clone():requires_grad_(), w2:clone():requires_grad_()}
    local bb = b1:clone():requires_grad_()
    local ya, yb
    for _ = 1, 2 do
      if group then ya, yb = gp.linear_group(xs, ws, {bb}) else ya, yb = gp.linear(xs, ws[1], bb), gp.linear(xs, ws[2]) end
      (ya:sum() * 2):backward()
    end
    return ya, yb, xs.grad, ws[1].grad, ws[2].grad, bb.grad
  end
  local a, b = {grads(true)}, {grads(false)}
  T.eq(a[5], nil, 'no gradient for the unused output\'s weight')
  for _, i in ipairs {1, 2, 3, 4, 6} do T.ok(T.relnorm(a[i], b[i]) < 1e-14, 'result ' .. i) end
  -- nn.SwiGLUMLP takes it for plain unbiased gate and up: no add kernel in its backward
  local m = nn.SwiGLUMLP(4, 6, {device = 'cpu'})
  local xi = gp.randn({2, 3, 4}, CPU):requires_grad_()
  local y = m(xi)
  local _, n = T.launches(function() y:sum():backward() end)
  T.eq(n.add, 0, 'add kernels in the SwiGLU MLP\'s backward')
  rawset(m.up, 'forward', function(self, t) return gp.linear(t, self.weight) end) -- a swapped forward: the module calls
  local y2 = m(xi)
  T.ok(T.relnorm(y2, y) < 1e-6)
  T.raises(function() gp.linear_group(x, {}) end, 'linear_group: ws must be a non-empty list')
  T.raises(function() gp.linear_group(x, {w1, rn {3, 5}}) end, 'linear_group: ws[2] must be a 2-d weight (out, 4) for x (2,3,4), got (3,5)')
  T.raises(function() gp.linear_group(x, {w1}, w1) end, 'linear_group: bs must be nil or a list of biases')
end)

T.test('gp.linear_group over row blocks of one weight: one product forward, one dx and one weight-gradient product', function()
  local x, W = rn {2, 3, 4}, rn {12, 4}
  T.ok(gp.gradcheck(function(a, w)
    local g, u = gp.linear_group(a, {w:narrow(1, 1, 6), w:narrow(1, 7, 6)})
    return gp.swiglu(g, u)
  end, {x, W}))
  -- nn.SwiGLUMLP's gate and up are such blocks, and stay so through :to and mixed precision
  local m = nn.SwiGLUMLP(4, 6, {device = 'cpu'})
  local function fused() return tensor.span({m.gate.weight, m.up.weight}, 1) ~= nil end
  T.ok(fused(), 'gate and up are row blocks of one tensor')
  m:to('f64')
  T.ok(fused() and m.gate.weight.dtype == 'f64', 'after :to(f64)')
  m:to('f32')
  gp.optim.mixed_precision(m)
  T.ok(fused() and m.up.weight.dtype == 'bf16', 'after mixed_precision')
  m:to('f32')
  -- against the same weights as separate tensors: values, gradients in the optimizer's flat buffer, the products
  local sep = nn.SwiGLUMLP(4, 6, {device = 'cpu'})
  for _, k in ipairs {'gate', 'up', 'proj'} do sep[k].weight = nn.Parameter(m[k].weight:detach():clone()) end
  local res = {}
  for i, mm in ipairs {m, sep} do
    local opt = gp.optim.AdamW(mm:parameters(), {lr = 1e-3})
    opt:zero_grad()
    local xi = x:detach():float():requires_grad_()
    local y = mm(xi)
    local nf = select(2, T.launches(function() y = mm(xi) end)).matmul
    local nb = select(2, T.launches(function() (y * y):sum():backward() end)).matmul
    res[i] = {y = y, dx = xi.grad, dg = mm.gate.weight.grad, du = mm.up.weight.grad, nf = nf, nb = nb}
  end
  T.eq(res[1].nf, 2, 'forward products (gate/up as one)')
  T.eq(res[2].nf, 3, 'forward products (separate)')
  T.eq(res[1].nb, 4, 'backward products (dx and the gate/up weights\' gradient one each)')
  for _, k in ipairs {'y', 'dx', 'dg', 'du'} do T.ok(T.relnorm(res[1][k], res[2][k]) < 1e-5, k) end
end)

T.test('gradcheck TransformerBlock (gelu/layer, swiglu/rms) and GPT logits and loss in f64', function()
  check_module(nn.TransformerBlock {n_embd = 4, n_head = 2, mlp_hidden = 6, device = 'cpu'}:to('f64'), {rn {1, 3, 4}})
  check_module(nn.TransformerBlock {n_embd = 4, n_head = 1, mlp = 'swiglu', norm = 'rms', mlp_hidden = 6, device = 'cpu'}
    :to('f64'), {rn {2, 2, 4}})
  local m = tiny_gpt():to('f64')
  local idx = gp.tensor({{0, 4, 2}, {3, 3, 1}}, {dtype = 'i64', device = 'cpu'})
  T.ok(gp.gradcheck(function() return m(idx) end, m:parameters()))
  -- the loss path: the same gradients as an f64 cross-entropy written out from the logits
  local tg = gp.tensor({{4, 2, 1}, {3, 1, 0}}, {dtype = 'i64', device = 'cpu'})
  m:zero_grad()
  local _, loss = m(idx, tg)
  loss:backward()
  local g1 = {}
  for i, p in ipairs(m:parameters()) do g1[i] = p.grad; p:zero_grad() end
  local logits = m(idx)
  local nll = -logits:log_softmax(-1):gather(3, tg:view {2, 3, 1}):mean()
  T.near(nll:item(), loss:item(), 1e-6)
  nll:backward()
  for i, p in ipairs(m:parameters()) do T.ok(T.relnorm(g1[i], p.grad) < 1e-6, 'parameter ' .. i .. ': ' .. T.relnorm(g1[i], p.grad)) end
end)

T.test('nn.attention is causal, swappable, and its mask is cached per (T, S, device, dtype)', function()
  local m1 = nn.causal_mask(4, 4, 'cpu', 'f32')
  T.ok(rawequal(m1, nn.causal_mask(4, 4, 'cpu', 'f32')))
  T.ok(not rawequal(m1, nn.causal_mask(4, 4, 'cpu', 'f64')))
  local v = m1:totable()
  T.eq(v[1][1], 0); T.eq(v[1][2], -math.huge); T.eq(v[4][4], 0); T.eq(v[4][1], 0)
  T.eq(nn.causal_mask(2, 4, 'cpu', 'f32'):totable()[1][3], 0) -- the last query of 2 sees 4 keys, the first 3
  local m = tiny_gpt():eval()
  local a = gp.tensor({{1, 2, 3, 4}}, {dtype = 'i64', device = 'cpu'})
  local b = gp.tensor({{1, 2, 3, 0}}, {dtype = 'i64', device = 'cpu'})
  local la, lb = m(a), m(b)
  T.ok(T.relnorm(la:narrow(2, 1, 3), lb:narrow(2, 1, 3)) < 1e-6) -- a later token changes no earlier logit
  T.ok(T.relnorm(la:narrow(2, 4, 1), lb:narrow(2, 4, 1)) > 1e-3)
  local orig, calls = nn.attention, 0
  nn.attention = function(q, k, vv, o) calls = calls + 1; T.ok(o.causal); return orig(q, k, vv, o) end
  local ok, err = pcall(m, a)
  nn.attention = orig
  T.ok(ok, tostring(err))
  T.eq(calls, 1)
end)

T.test('state_dict round trip through gp.save and gp.load', function()
  local path = os.tmpname() .. '.safetensors'
  gp.manual_seed(1)
  local m = tiny_gpt({n_layer = 2, mlp = 'swiglu', norm = 'rms'})
  local sd = m:state_dict()
  T.eq(sd['lm_head.weight'], nil) -- tied: saved once, as wte.weight
  T.ok(sd['wte.weight'] and sd['h.2.mlp.gate.weight'])
  gp.save(path, sd)
  gp.manual_seed(2)
  local m2 = tiny_gpt({n_layer = 2, mlp = 'swiglu', norm = 'rms'})
  local idx = gp.tensor({{0, 1, 2, 3}}, {dtype = 'i64', device = 'cpu'})
  T.ok(T.relnorm(m2(idx), m(idx)) > 1e-3)
  local loaded = gp.load(path)
  local r = m2:load_state_dict(loaded)
  T.eq(#r.missing + #r.unexpected, 0)
  T.ok(T.relnorm(m2(idx), m(idx)) == 0)
  T.ok(rawequal(m2.lm_head.weight, m2.wte.weight))
  os.remove(path)
end)

T.test('load_state_dict names missing and unexpected keys and shape mismatches; nothing is copied on error', function()
  local m = nn.Linear(3, 2, {device = 'cpu'})
  local w0 = m.weight:clone()
  T.raises(function() m:load_state_dict({weight = gp.zeros({2, 3}, CPU)}) end, 'load_state_dict', 'missing keys: bias')
  T.eq(T.relnorm(m.weight, w0), 0)
  T.raises(function() m:load_state_dict({weight = gp.zeros({2, 3}, CPU), bias = gp.zeros({2}, CPU), extra = gp.zeros({1}, CPU)}) end,
    'unexpected keys: extra')
  T.raises(function() m:load_state_dict({weight = gp.zeros({3, 2}, CPU), bias = gp.zeros({2}, CPU)}) end,
    'shape mismatch', 'weight is (3,2) in the state dict but (2,3) in the model')
  T.raises(function() m:load_state_dict({weight = 3, bias = gp.zeros({2}, CPU)}) end, 'weight is a number')
  T.raises(function() m:load_state_dict(5) end, 'load_state_dict', 'table')
  -- not strict: loads what matches, reports the rest
  local r = m:load_state_dict({weight = gp.ones({2, 3}, {dtype = 'f64', device = 'cpu'}), extra = gp.zeros({1}, CPU)}, {strict = false})
  T.eq(#r.missing, 1); T.eq(r.missing[1], 'bias')
  T.eq(#r.unexpected, 1); T.eq(r.unexpected[1], 'extra')
  T.eq(m.weight.dtype, 'f32')
  T.same(T.flat(m.weight), {1, 1, 1, 1, 1, 1})
end)

T.test('train/eval switch dropout; GPT with dropout is deterministic in eval mode', function()
  local d = nn.Dropout(0.5)
  local x = gp.ones({1000}, CPU)
  local y = d(x)
  local zeros = 0
  for _, v in ipairs(T.flat(y)) do if v == 0 then zeros = zeros + 1 else T.eq(v, 2) end end
  T.ok(zeros > 400 and zeros < 600, 'zeros: ' .. zeros)
  d:eval()
  T.ok(rawequal(d(x), x))
  local m = tiny_gpt({dropout = 0.3})
  local idx = gp.tensor({{0, 1, 2}}, {dtype = 'i64', device = 'cpu'})
  T.ok(T.relnorm(m(idx), m(idx)) > 0)
  m:eval()
  T.eq(T.relnorm(m(idx), m(idx)), 0)
end)

T.test('GPT: shapes, loss near log(V) at init, init statistics, errors', function()
  gp.manual_seed(5)
  local m = nn.GPT {vocab_size = 11, block_size = 8, n_embd = 16, n_layer = 2, n_head = 4, device = 'cpu'}
  local idx = gp.randint(0, 11, {3, 8}, CPU)
  local logits, loss = m(idx, idx)
  T.eq(shape_str(logits.shape), '(3,8,11)')
  T.eq(loss:dim(), 0)
  T.near(loss:item(), math.log(11), 0.1)
  T.eq(shape_str(m(idx:narrow(2, 1, 5)).shape), '(3,5,11)')
  T.near(m.h[1].attn.qkv.weight:std():item(), 0.02, 0.15)
  T.near(m.h[2].mlp.proj.weight:std():item(), 0.02 / math.sqrt(4), 0.15)
  T.eq(m.h[1].attn.qkv.bias:abs():max():item(), 0)
  T.eq(m.ln_f.weight:min():item(), 1)
  T.raises(function() m(gp.randint(0, 11, {1, 9}, CPU)) end, 'GPT', '9 tokens', 'block_size is 8')
  T.raises(function() m(gp.randn({1, 4}, CPU)) end, 'GPT', 'idx')
  T.raises(function() nn.GPT {vocab_size = 11, block_size = 8, n_embd = 10, n_layer = 1, n_head = 4} end, 'n_embd 10', 'n_head 4')
  T.raises(function() nn.GPT {vocab_size = 11, block_size = 8, n_embd = 8, n_layer = 1, n_head = 4, mlp = 'relu'} end, 'mlp')
  T.raises(function() nn.GPT {vocab_size = 11} end, 'GPT', 'block_size')
end)

T.test('a few SGD steps reduce the loss on a repeated sequence', function()
  gp.manual_seed(3)
  local m = nn.GPT {vocab_size = 6, block_size = 8, n_embd = 16, n_layer = 1, n_head = 2, device = 'cpu'}
  local seq = {}
  for i = 1, 9 do seq[i] = (i - 1) % 3 end
  local idx = gp.tensor({{unpack(seq, 1, 8)}}, {dtype = 'i64', device = 'cpu'})
  local tg = gp.tensor({{unpack(seq, 2, 9)}}, {dtype = 'i64', device = 'cpu'})
  local first, last
  for step = 1, 30 do
    m:zero_grad()
    local _, loss = m(idx, tg)
    if step == 1 then first = loss:item() end
    last = loss:item()
    loss:backward()
    gp.no_grad(function()
      for _, p in ipairs(m:parameters()) do p:sub_(p.grad * 0.5) end
    end)
  end
  T.ok(last < first * 0.5, string.format('loss %g -> %g', first, last))
end)

T.test('a tiny GPT on the GPU matches the CPU: logits, loss and every gradient', function()
  T.cuda()
  local cfg = {vocab_size = 13, block_size = 8, n_embd = 16, n_layer = 2, n_head = 4}
  local mc = tiny_gpt(cfg, 'cpu')
  local mg = tiny_gpt(cfg, 'cuda')
  mg:load_state_dict(mc:state_dict())
  local idx = gp.randint(0, 13, {2, 8}, CPU)
  local tg = gp.randint(0, 13, {2, 8}, CPU)
  local lc, lossc = mc(idx, tg)
  local lg, lossg = mg(idx:cuda(), tg:cuda())
  T.ok(T.relnorm(lg:cpu(), lc) < 1e-4, 'logits')
  T.ok(T.relnorm(lossg:cpu(), lossc) < 1e-4, 'loss')
  lossc:backward()
  lossg:backward()
  local pc, pg = mc:named_parameters(), mg:named_parameters()
  T.eq(#pc, #pg)
  for i, nt in ipairs(pc) do
    T.eq(pg[i][1], nt[1])
    local r = T.relnorm(pg[i][2].grad:cpu(), nt[2].grad)
    T.ok(r < 1e-3, nt[1] .. ': gradient relative norm ' .. r)
  end
end)

T.test('Linear weight and bias gradients accumulate into an existing .grad (in place) exactly as fresh ones', function()
  gp.manual_seed(5)
  local lin = nn.Linear(6, 4, {dtype = 'f64', device = 'cpu'})
  local x = rn {3, 2, 6}
  local function loss() return (lin(x) * lin(x)):sum() end
  loss():backward()                      -- no .grad yet: a new tensor
  local first, bfirst = lin.weight.grad:clone(), lin.bias.grad:clone()
  local buf, bbuf = lin.weight.grad, lin.bias.grad
  loss():backward()                      -- accumulates into the same tensors
  T.ok(rawequal(lin.weight.grad, buf) and rawequal(lin.bias.grad, bbuf), 'the same .grad tensors')
  T.ok(T.relnorm(lin.weight.grad, first * 2) < 1e-12, 'two backwards')
  T.ok(T.relnorm(lin.bias.grad, bfirst * 2) < 1e-12, 'two backwards (bias)')
  lin.weight.grad:zero_()
  lin.bias.grad:zero_()
  loss():backward()
  T.ok(T.relnorm(lin.weight.grad, first) < 1e-12, 'after zero_')
  T.ok(T.relnorm(lin.bias.grad, bfirst) < 1e-12, 'after zero_ (bias)')
  -- the reference: the weight gradient as x^T-weighted sum, from the formula
  local y = gp.no_grad(function() return lin(x) end)
  local want = (y * 2):reshape {6, 4}:t():matmul(x:reshape {6, 6})
  T.ok(T.relnorm(first, want) < 1e-12, 'against the formula')
  T.ok(T.relnorm(bfirst, (y * 2):reshape {6, 4}:sum(1)) < 1e-12, 'bias against the formula')
end)

-- norm backward kernels add their weight/bias gradients straight into an
-- existing .grad (accumulate = 1) instead of a new tensor and an add_
T.test('LayerNorm, RMSNorm, add_rms_norm: weight/bias gradients accumulate into an existing .grad in place', function()
  gp.manual_seed(7)
  local D = 6
  local x, r = rn {3, 2, D}, rn {3, 2, D}
  local ln, rms = nn.LayerNorm(D, {device = 'cpu'}):to('f64'), nn.RMSNorm(D, {device = 'cpu'}):to('f64')
  local aw = rn({D}):requires_grad()
  gp.no_grad(function()
    ln.weight:copy_(rn {D}); ln.bias:copy_(rn {D}); rms.weight:copy_(rn {D})
  end)
  local cases = {
    {'LayerNorm', {ln.weight, ln.bias}, function() return (ln(x):sin() * x):sum() end},
    {'RMSNorm', {rms.weight}, function() return (rms(x):sin() * x):sum() end},
    {'add_rms_norm', {aw}, function()
      local out, res = gp.add_rms_norm(x, r, aw)
      return (out:sin() * x + res):sum()
    end},
  }
  for _, c in ipairs(cases) do
    local name, ps, loss = c[1], c[2], c[3]
    for _, p in ipairs(ps) do p:zero_grad() end
    loss():backward()                    -- no .grad yet: new tensors
    local first, bufs = {}, {}
    for i, p in ipairs(ps) do first[i], bufs[i] = p.grad:clone(), p.grad end
    loss():backward()                    -- accumulates into the same tensors
    for i, p in ipairs(ps) do
      T.ok(rawequal(p.grad, bufs[i]), name .. ' param ' .. i .. ': the same .grad tensor')
      T.ok(T.relnorm(p.grad, first[i] * 2) < 1e-12, name .. ' param ' .. i .. ': two backwards')
    end
    -- random existing values (not zeros): old + one gradient
    local old = {}
    for i, p in ipairs(ps) do old[i] = rn {D}; p.grad:copy_(old[i]) end
    loss():backward()
    for i, p in ipairs(ps) do
      T.ok(T.relnorm(p.grad, old[i] + first[i]) < 1e-12, name .. ' param ' .. i .. ': added to random values')
    end
  end
  -- LayerNorm with only one of w, b holding a .grad: the other gets its own gradient
  ln.weight:zero_grad(); ln.bias:zero_grad()
  local function lnloss() return (ln(x):sin() * x):sum() end
  lnloss():backward()
  local w1, b1 = ln.weight.grad:clone(), ln.bias.grad:clone()
  ln.bias:zero_grad()
  lnloss():backward()                    -- weight accumulates, bias is new
  T.ok(T.relnorm(ln.weight.grad, w1 * 2) < 1e-12 and T.relnorm(ln.bias.grad, b1) < 1e-12, 'w buffer, b new')
  ln.weight:zero_grad()
  lnloss():backward()                    -- bias accumulates, weight is new
  T.ok(T.relnorm(ln.weight.grad, w1) < 1e-12 and T.relnorm(ln.bias.grad, b1 * 2) < 1e-12, 'b buffer, w new')
  -- a frozen bias keeps no gradient while the weight accumulates
  ln.bias:requires_grad(false)
  ln.bias:zero_grad()
  lnloss():backward()
  T.ok(ln.bias.grad == nil and T.relnorm(ln.weight.grad, w1 * 2) < 1e-12, 'frozen bias')
  ln.bias:requires_grad()
  -- a .grad the kernel cannot add into (another dtype) still accumulates through add_
  ln.weight.grad = w1:to('f32')
  ln.bias:zero_grad()
  lnloss():backward()
  T.ok(ln.weight.grad.dtype == 'f32' and T.relnorm(ln.weight.grad:to('f64'), w1 * 2) < 1e-6, 'f32 .grad of an f64 weight')
end)

-- kernel calls while fn runs (gp.k wrapped as gp.profile does), and the
-- calls that are given one of the tensors in watch (by data pointer and offset)
local function count_k(fn, watch)
  local tensor_mod = require 'gpush.core.tensor'
  local n, touched, saved_k, saved_t = 0, {}, {}, {}
  local ptrs = {}
  local function key(t) return tostring(t.c.data) .. '+' .. tostring(t.c.offset) end
  for _, t in ipairs(watch or {}) do ptrs[key(t)] = true end
  for name, f in pairs(gp.k) do
    saved_k[name] = f
    gp.k[name] = function(...)
      n = n + 1
      for i = 1, select('#', ...) do
        local a = select(i, ...)
        if gp.is_tensor(a) and ptrs[key(a)] then touched[name] = (touched[name] or 0) + 1 end
      end
      return f(...)
    end
  end
  for name, f in pairs(tensor_mod.K) do saved_t[name] = f; tensor_mod.K[name] = gp.k[name] end
  local ok, err = pcall(fn)
  for name, f in pairs(saved_k) do gp.k[name] = f end
  for name, f in pairs(saved_t) do tensor_mod.K[name] = f end
  if not ok then error(err, 0) end
  return n, touched
end

T.test('a GPT training step: norm weight/bias gradients need no extra launches', function()
  for _, norm in ipairs {'layer', 'rms'} do
    gp.manual_seed(11)
    local m = tiny_gpt({norm = norm, n_layer = 2})
    local opt = gp.optim.AdamW(m, {lr = 1e-3})
    local idx = gp.tensor({{1, 2, 3, 4, 0, 1}}, {dtype = 'i64', device = 'cpu'})
    local tg = gp.tensor({{2, 3, 4, 0, 1, 2}}, {dtype = 'i64', device = 'cpu'})
    local norms = {}
    for _, nt in ipairs(m:named_parameters()) do
      if nt[1]:match('ln') then norms[#norms + 1] = nt[2] end
    end
    T.eq(#norms, norm == 'layer' and 10 or 5, norm .. ': norm parameters')
    local function step()
      local _, loss = m(idx, tg)
      loss:backward()
    end
    opt:zero_grad()
    step()
    opt:step()
    -- the baseline: norm .grad set to none, so the rule makes new tensors and
    -- autograd copies them in (one launch each, as the add_ into a kept .grad was)
    opt:zero_grad()
    for _, p in ipairs(norms) do p:zero_grad() end
    local base = count_k(step)
    opt:zero_grad()
    local grads = {}
    for i, p in ipairs(norms) do grads[i] = p.grad end
    local n, touched = count_k(step, grads)
    T.eq(base - n, #norms, norm .. ': launches saved per step (' .. base .. ' -> ' .. n .. ')')
    local names = {}
    for k in pairs(touched) do names[#names + 1] = k end
    table.sort(names)
    -- (a block's second norm takes the residual add with it: add_rms_norm, add_layer_norm)
    local want = norm == 'layer' and 'layer_norm_backward,layer_norm_backward_add' or 'rms_norm_backward,rms_norm_backward_add'
    T.eq(table.concat(names, ','), want, norm .. ': the only kernel given a norm .grad')
  end
end)

T.test('cuda: LayerNorm and RMSNorm gradients accumulated into random .grad values match the cpu', function()
  T.cuda()
  gp.manual_seed(13)
  local D = 96
  local x = gp.randn({4, 50, D}, CPU)
  for _, kind in ipairs {'LayerNorm', 'RMSNorm'} do
    local mc, mg = nn[kind](D, CPU), nn[kind](D, {device = 'cuda'})
    local ps_c, ps_g = mc:parameters(), mg:parameters()
    for i, p in ipairs(ps_c) do
      gp.no_grad(function() p:copy_(gp.randn({D}, CPU)); ps_g[i]:copy_(p:cuda()) end)
      p.grad = gp.randn({D}, CPU)
      ps_g[i].grad = p.grad:cuda()
    end
    local bufs = {}
    for i, p in ipairs(ps_g) do bufs[i] = p.grad end
    for _ = 1, 2 do
      (mc(x):sin() * x):sum():backward()
      local xg = x:cuda();
      (mg(xg):sin() * xg):sum():backward()
    end
    for i, p in ipairs(ps_c) do
      T.ok(rawequal(ps_g[i].grad, bufs[i]), kind .. ' param ' .. i .. ': the same .grad')
      local r = T.relnorm(ps_g[i].grad:cpu(), p.grad)
      T.ok(r < 1e-4, kind .. ' param ' .. i .. ': relative norm ' .. r)
    end
  end
end)

-- A GPT of RMSNorms or LayerNorms runs each residual add inside the norm
-- after it (TransformerBlock:forward_pending, nn.add_norm: gp.add_rms_norm or
-- gp.add_layer_norm); swapping ln_f's forward for the same computation turns
-- the chaining off: logits, loss and every gradient agree (f64), and the
-- chained forward runs no add kernel for the residual stream
T.test('GPT with RMSNorm or LayerNorm: the residual adds fused into the norms give the unfused logits, loss and gradients', function()
  for _, norm in ipairs {'rms', 'layer'} do
    local function run(chain)
      gp.manual_seed(4)
      local m = tiny_gpt({norm = norm, mlp = norm == 'rms' and 'swiglu' or 'gelu', n_layer = 3, dtype = 'f64'})
      if not chain then
        rawset(m.ln_f, 'forward', function(self, x)
          if norm == 'rms' then return (gp.rms_norm(x, self.weight, self.eps)) end
          return (gp.layer_norm(x, self.weight, self.bias, self.eps))
        end)
      end
      local idx = gp.tensor({{1, 2, 3, 4, 0, 1}, {4, 3, 2, 1, 0, 2}}, {dtype = 'i64', device = 'cpu'})
      local logits, loss
      local _, kf = T.launches(function() logits, loss = m(idx, idx) end)
      local _, kb = T.launches(function() loss:backward() end)
      local grads = {}
      for _, nt in ipairs(m:named_parameters()) do grads[nt[1]] = nt[2].grad end
      return logits, loss, grads, kf, kb
    end
    local l1, s1, g1, f1, b1 = run(true)
    local l2, s2, g2, f2 = run(false)
    T.ok(T.relnorm(l1, l2) < 1e-13, norm .. ': logits')
    T.ok(math.abs(s1:item() - s2:item()) < 1e-13, norm .. ': loss')
    for name, g in pairs(g2) do T.ok(T.relnorm(g1[name], g) < 1e-12, norm .. ': ' .. name) end
    -- the forward's residual adds: all in the norms (unfused, each block's second add is a kernel)
    T.eq((f2.add or 0) - (f1.add or 0), 3, norm .. ': add launches saved in the forward')
    T.eq(f1['add_' .. norm .. '_norm'], 6, norm .. ': fused norms')
    -- every norm after a residual add whose sum is used again (2 a block, less the first block's ln1; ln_f's
    -- sum has no other use: its plain backward)
    T.eq(b1[norm .. '_norm_backward_add'], 5, norm .. ': fused norm backwards')
  end
end)
