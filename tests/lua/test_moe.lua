-- Mixture-of-Experts: the routing and permutation kernels on hand-made cases
-- (stable order, capacity drops), routing edge cases (every token to one
-- expert, experts with no tokens, k = 1, E = 1, capacity overflow) on the CPU
-- and against CUDA, gradchecks of the router, gather, combine and the whole
-- layer with its auxiliary losses in f64, nn.MoE inside a GPT (training step,
-- cached decoding equals the full forward, greedy CUDA decoding equals the
-- CPU), bad input, and scripts/moe.lua --tiny.
local T = require 'lib'
local gp = require 'gpush'
local nn = gp.nn
local cpu = {device = 'cpu'}
local I32 = {dtype = 'i32', device = 'cpu'}

local function ids_of(rows) return gp.tensor(rows, I32) end

---------------------------------------------------------------------------
-- router

T.test('moe_router: softmax, top-k by logit (ties to the lower index), renormalized weights', function()
  local logits = gp.tensor({{1, 3, 2, 3}, {0, 0, 0, 0}, {-1, 5, 4, -2}}, cpu)
  local w, ids, probs = gp.moe_router(logits, 2)
  T.same(ids:totable(), {{1, 3}, {0, 1}, {1, 2}})
  T.same(probs:sum(2):totable(), {1, 1, 1}, 1e-6)
  local p = logits:softmax(2):totable()
  T.same(probs:totable(), p, 1e-6)
  T.same(w:totable()[1], {0.5, 0.5}, 1e-6)
  local e4, e5 = math.exp(4), math.exp(5)
  T.same(w:totable()[3], {e5 / (e4 + e5), e4 / (e4 + e5)}, 1e-6)
  -- without renormalization the weights are the probabilities
  local w1 = gp.moe_router(logits, 2, {renorm = false})
  T.same(w1:totable()[3], {p[3][2], p[3][3]}, 1e-6)
  -- k = 1 keeps the probability (no renormalization by default); E = 1 gives weight 1
  local wk1, idk1 = gp.moe_router(logits, 1)
  T.same(idk1:totable(), {{1}, {0}, {1}})
  T.same(wk1:totable()[3], {p[3][2]}, 1e-6)
  local we1, ide1 = gp.moe_router(gp.randn({5, 1}, cpu), 1)
  T.same(ide1:totable(), {{0}, {0}, {0}, {0}, {0}})
  T.same(we1:totable(), {{1}, {1}, {1}, {1}, {1}}, 1e-6)
end)

T.test('moe_router: gradcheck in f64 through the weights and the probabilities', function()
  gp.manual_seed(3)
  local proj = gp.randn({6, 5}, {dtype = 'f64', device = 'cpu'})
  for _, renorm in ipairs {true, false} do
    for _, k in ipairs {1, 2, 3} do
      local logits = gp.randn({6, 5}, {dtype = 'f64', device = 'cpu'})
      gp.gradcheck(function(l)
        local w, _, probs = gp.moe_router(l, k, {renorm = renorm})
        return w:sum(2) * 0.3 + (w * w):sum(2) + (probs * proj):sum(2)
      end, {logits})
    end
  end
end)

---------------------------------------------------------------------------
-- permutation

T.test('moe_permute: stable slots per expert, capacity drops, counts before capacity', function()
  -- tokens 0..4, k = 2; expert 1 gets 4 assignments, expert 3 none
  local ids = ids_of({{1, 0}, {2, 1}, {1, 2}, {0, 1}, {2, 0}})
  local dest, src, counts = gp.moe_permute(ids, 4, 5)
  T.same(counts:totable(), {3, 4, 3, 0})
  -- flat assignments in order: a=0 (e1) a=1 (e0) a=2 (e2) a=3 (e1) a=4 (e1) a=5 (e2) a=6 (e0) a=7 (e1) a=8 (e2) a=9 (e0)
  T.same(dest:totable(), {{5, 0}, {10, 6}, {7, 11}, {1, 8}, {12, 2}})
  T.same(src:totable(), {1, 6, 9, -1, -1, 0, 3, 4, 7, -1, 2, 5, 8, -1, -1, -1, -1, -1, -1, -1})
  -- capacity 2: the third and later assignments of an expert are dropped
  local d2, s2, c2 = gp.moe_permute(ids, 4, 2)
  T.same(c2:totable(), {3, 4, 3, 0})
  T.same(d2:totable(), {{2, 0}, {4, 3}, {-1, 5}, {1, -1}, {-1, -1}})
  T.same(s2:totable(), {1, 6, 0, 3, 2, 5, -1, -1})
  T.eq(gp.moe_dropped(c2, 2):item(), 4)
  T.eq(gp.moe_dropped(counts, 5):item(), 0)
  T.same(gp.moe_histogram(ids, 4):totable(), {3, 4, 3, 0})
  -- capacity 0: everything dropped
  local d0, s0 = gp.moe_permute(ids, 4, 0)
  T.eq(s0:numel(), 0)
  T.eq(d0:max():item(), -1)
end)

T.test('moe_gather and moe_combine: rows by slot, weighted sums by token, drops left out', function()
  local x = gp.tensor({{1, 2}, {3, 4}, {5, 6}}, cpu)
  local ids = ids_of({{0, 1}, {1, 0}, {1, 0}})
  local dest, src = gp.moe_permute(ids, 2, 2) -- expert 0: a=0, a=3 (a=5 dropped); expert 1: a=1, a=2 (a=4 dropped)
  T.same(dest:totable(), {{0, 2}, {3, 1}, {-1, -1}})
  local xs = gp.moe_gather(x, src, dest)
  T.same(xs:totable(), {{1, 2}, {3, 4}, {1, 2}, {3, 4}})
  local ys = gp.tensor({{1, 0}, {0, 1}, {2, 0}, {0, 2}}, cpu)
  local w = gp.tensor({{0.5, 0.25}, {0.1, 0.9}, {1, 1}}, cpu)
  local out = gp.moe_combine(ys, w, dest, src)
  T.same(out:totable(), {{0.5 + 0.5, 0}, {0, 0.2 + 0.9}, {0, 0}}, 1e-6)
end)

T.test('moe_gather and moe_combine: gradcheck in f64 (with dropped assignments)', function()
  gp.manual_seed(4)
  local N, E, k, C = 7, 3, 2, 5
  local F64 = {dtype = 'f64', device = 'cpu'}
  local _, ids = gp.moe_router(gp.randn({N, E}, cpu), k)
  local dest, src = gp.moe_permute(ids, E, 4) -- 14 assignments into 12 slots: some dropped
  local x = gp.randn({N, C}, F64)
  gp.gradcheck(function(a) return gp.moe_gather(a, src, dest) end, {x})
  local ys, w = gp.randn({E * 4, C}, F64), gp.randn({N, k}, F64)
  gp.gradcheck(function(a, b) return gp.moe_combine(a, b, dest, src) end, {ys, w})
end)

---------------------------------------------------------------------------
-- the layer

local function layer_inputs(dtype, N, C, H, E, swiglu)
  local o = {dtype = dtype, device = 'cpu'}
  local x = gp.randn({N, C}, o)
  local wr = gp.randn({E, C}, o)
  local w1 = gp.randn({E, C, H}, o) * (1 / math.sqrt(C))
  local w2 = gp.randn({E, H, C}, o) * (1 / math.sqrt(H))
  local w3 = swiglu and gp.randn({E, C, H}, o) * (1 / math.sqrt(C)) or nil
  return x, wr, w1, w2, w3
end

-- the layer plus both auxiliary losses (so that the router gets gradient from all paths)
local function layer_loss(opts)
  return function(x, wr, w1, w2, w3)
    local out, info = gp.moe_ffn(x, wr, w1, w2, w3, opts)
    local aux = gp.moe_aux_loss(info.probs, info.counts, info.k) * 0.3 + gp.moe_z_loss(info.logits) * 0.2
    return out + aux
  end
end

T.test('moe_ffn: gradcheck of the layer with aux and z losses in f64 (E=4, k=2, C=8, H=16, N=6)', function()
  gp.manual_seed(11)
  for _, case in ipairs {
    {act = 'swiglu', k = 2},
    {act = 'gelu', k = 2},
    {act = 'swiglu', k = 1},
    {act = 'gelu', k = 2, capacity_factor = 0.5}, -- cap 3 of 12 assignments over 4 experts: drops
  } do
    local x, wr, w1, w2, w3 = layer_inputs('f64', 6, 8, 16, 4, case.act == 'swiglu')
    local inputs = {x, wr, w1, w2}
    if w3 then inputs[5] = w3 end
    gp.gradcheck(function(a, b, c, d, e) return layer_loss(case)(a, b, c, d, e) end, inputs)
  end
end)

T.test('moe_ffn: equals a per-token loop over its top-k experts (dropless)', function()
  gp.manual_seed(12)
  local N, C, H, E, k = 9, 6, 10, 4, 2
  local x, wr, w1, w2, w3 = layer_inputs('f64', N, C, H, E, true)
  local out, info = gp.no_grad(gp.moe_ffn, x, wr, w1, w2, w3, {k = k})
  T.eq(gp.moe_dropped(info.counts, info.cap):item(), 0)
  local ids, w = info.ids:totable(), info.weights:totable()
  local want = gp.zeros({N, C}, {dtype = 'f64', device = 'cpu'})
  gp.no_grad(function()
    for n = 1, N do
      local xr = x:narrow(1, n, 1)
      for j = 1, k do
        local e = ids[n][j] + 1
        local h = gp.swiglu(xr:matmul(w1:select(1, e)), xr:matmul(w3:select(1, e)))
        want:narrow(1, n, 1):add_(h:matmul(w2:select(1, e)) * w[n][j])
      end
    end
  end)
  T.ok(T.relnorm(out, want) < 1e-12, 'relnorm ' .. T.relnorm(out, want))
end)

T.test('moe routing edge cases on the CPU: one expert for all, idle experts, k=1, E=1, overflow', function()
  gp.manual_seed(13)
  local N, C, H = 10, 4, 6
  -- every token to expert 2 (router weight makes its logit dominate)
  local x = gp.rand({N, C}, cpu) + 0.5
  local E = 4
  local wr = gp.zeros({E, C}, cpu)
  wr:narrow(1, 3, 1):fill_(5)
  local _, w1, w2, w3 = select(2, layer_inputs('f32', N, C, H, E, true))
  local out, info = gp.no_grad(gp.moe_ffn, x, wr, w1, w2, w3, {k = 1})
  T.same(info.counts:totable(), {0, 0, N, 0})
  T.eq(info.cap, N)
  T.ok(out:abs():sum():item() > 0)
  -- with a capacity factor 1: cap = ceil(N/E) = 3, 7 dropped (their output rows are 0)
  local out2, info2 = gp.no_grad(gp.moe_ffn, x, wr, w1, w2, w3, {k = 1, capacity_factor = 1})
  T.eq(info2.cap, 3)
  T.eq(gp.moe_dropped(info2.counts, info2.cap):item(), 7)
  T.ok(T.relnorm(out2:narrow(1, 1, 3), out:narrow(1, 1, 3)) < 1e-6, 'kept tokens unchanged')
  T.eq(out2:narrow(1, 4, 7):abs():sum():item(), 0)
  -- E = 1, k = 1: a dense FFN with weight 1
  local xa, wra, w1a, w2a, w3a = layer_inputs('f64', 5, C, H, 1, true)
  local o1 = gp.no_grad(gp.moe_ffn, xa, wra, w1a, w2a, w3a, {k = 1})
  local dense = gp.no_grad(function()
    return gp.swiglu(xa:matmul(w1a:select(1, 1)), xa:matmul(w3a:select(1, 1))):matmul(w2a:select(1, 1))
  end)
  T.ok(T.relnorm(o1, dense) < 1e-12)
end)

---------------------------------------------------------------------------
-- CPU against CUDA

local function cuda_vs_cpu_layer(dtype, tol, opts, N, C, H, E, swiglu, make_router, positive_x)
  gp.manual_seed(21)
  local x, wr, w1, w2, w3 = layer_inputs('f32', N, C, H, E, swiglu)
  if make_router then wr = make_router(E, C) end
  if positive_x == 'ints' then -- integer logits: exact in bf16 on both devices, so the routing agrees
    x = gp.randint(-3, 4, {N, C}, cpu):to('f32')
    wr = gp.randint(-2, 3, {E, C}, cpu):to('f32')
  elseif positive_x then
    x = gp.rand({N, C}, cpu) + 0.5
  end
  local proj = gp.randn({N, C}, cpu)
  local function run(dev)
    -- detach: on the CPU `to` returns the input itself, which must not become a
    -- leaf that the CUDA copy is then recorded from
    local function p(t) return t and t:detach():to {dtype = dtype, device = dev}:requires_grad() or nil end
    local a, b, c, d, e = p(x), p(wr), p(w1), p(w2), p(w3)
    local out, info = gp.moe_ffn(a, b, c, d, e, opts)
    local total = (out:to('f32') * proj:to(dev)):sum() + gp.moe_aux_loss(info.probs, info.counts, info.k) +
      gp.moe_z_loss(info.logits) * 0.1
    total:backward()
    return {out = out, a = a, b = b, c = c, d = d, e = e, info = info}
  end
  local rc, rg = run('cpu'), run('cuda')
  T.same(rg.info.ids:cpu():totable(), rc.info.ids:cpu():totable())
  T.same(rg.info.counts:cpu():totable(), rc.info.counts:cpu():totable())
  T.same(rg.info.dest:cpu():totable(), rc.info.dest:cpu():totable())
  T.same(rg.info.src:cpu():totable(), rc.info.src:cpu():totable())
  T.eq(rg.info.cap, rc.info.cap)
  local function cmp(name, a, b)
    local r = T.relnorm(a:cpu(), b:cpu())
    if not (r <= tol) then error(string.format('%s %s: cuda vs cpu relative norm %g > %g', dtype, name, r, tol)) end
  end
  cmp('out', rg.out, rc.out)
  for _, n in ipairs {'a', 'b', 'c', 'd', 'e'} do
    if rc[n] then
      T.ok(rg[n].grad ~= nil and rc[n].grad ~= nil, dtype .. ': both devices give a gradient for input ' .. n)
      cmp('grad ' .. n, rg[n].grad, rc[n].grad)
    end
  end
  return rc.info
end

T.test('moe_ffn (cuda): forward, backward and routing equal the CPU (f32, bf16; edge cases)', function()
  T.cuda()
  -- a large router weight makes routing decisions well separated (no near-ties across devices)
  local function sharp(E, C) return gp.randn({E, C}, cpu) * 3 end
  cuda_vs_cpu_layer('f32', 1e-4, {k = 2, act = 'swiglu'}, 300, 64, 96, 8, true, sharp)
  cuda_vs_cpu_layer('f32', 1e-4, {k = 2, act = 'gelu'}, 40, 24, 40, 5, false, sharp) -- cap = N path
  cuda_vs_cpu_layer('f32', 1e-4, {k = 1, act = 'swiglu'}, 200, 33, 20, 4, true, sharp) -- odd C: scalar rows
  local info = cuda_vs_cpu_layer('f32', 1e-4, {k = 2, act = 'swiglu', capacity_factor = 0.6}, 150, 32, 48, 8, true, sharp)
  T.ok(gp.moe_dropped(info.counts, info.cap):item() > 0, 'capacity overflow drops')
  cuda_vs_cpu_layer('f32', 1e-4, {k = 1, act = 'gelu'}, 90, 16, 32, 1, false, sharp) -- E = 1
  -- positive x: every token picks experts 3 and 1; experts 0, 2, 4, 5 get none
  local function one(E, C)
    local w = gp.zeros({E, C}, cpu)
    w:narrow(1, 4, 1):fill_(4)
    w:narrow(1, 2, 1):fill_(2)
    return w
  end
  info = cuda_vs_cpu_layer('f32', 1e-4, {k = 2, act = 'swiglu'}, 130, 16, 24, 6, true, one, true)
  T.same(info.counts:totable(), {0, 130, 0, 130, 0, 0})
  cuda_vs_cpu_layer('bf16', 3e-2, {k = 2, act = 'swiglu'}, 256, 64, 128, 8, true, nil, 'ints')
end)

T.test('moe kernels (cuda): permutation of a large batch with heavy imbalance equals the CPU exactly', function()
  T.cuda()
  gp.manual_seed(31)
  for _, case in ipairs {{N = 5000, E = 8, k = 2, cap = 900}, {N = 3001, E = 256, k = 8, cap = 64},
                         {N = 2048, E = 1, k = 1, cap = 2048}, {N = 777, E = 16, k = 4, cap = 5}} do
    -- skewed ids: most assignments to the low experts, several experts empty
    local u = gp.rand({case.N, case.k}, cpu)
    local ids = (u * u * u * (case.E / 2)):to('i32') -- truncation: u >= 0
    local dc, sc, cc = gp.moe_permute(ids, case.E, case.cap)
    local dg, sg, cg = gp.moe_permute(ids:cuda(), case.E, case.cap)
    T.same(cg:cpu():totable(), cc:totable())
    T.same(dg:cpu():totable(), dc:totable())
    T.same(sg:cpu():totable(), sc:totable())
    T.same(gp.moe_histogram(ids:cuda(), case.E):cpu():totable(), cc:totable())
    T.eq(gp.moe_dropped(cg, case.cap):item(), gp.moe_dropped(cc, case.cap):item())
  end
end)

---------------------------------------------------------------------------
-- nn.MoE in a GPT

local function moe_gpt(device, extra)
  gp.manual_seed(5)
  local cfg = {vocab_size = 29, block_size = 16, n_embd = 32, n_layer = 2, n_head = 4, device = device, mlp = 'moe',
               mlp_hidden = 48, moe = {experts = 4, k = 2, act = 'swiglu'}}
  for k, v in pairs(extra or {}) do cfg[k] = v end
  return nn.GPT(cfg)
end

T.test('nn.MoE: module API, a GPT with MoE blocks trains a step with aux losses', function()
  local m = nn.MoE(8, 16, {experts = 4, k = 2, device = 'cpu'})
  T.eq(#m:parameters(), 3)
  local m2 = nn.MoE {d_model = 8, d_hidden = 16, n_experts = 4, top_k = 2, device = 'cpu', act = 'swiglu'}
  T.eq(#m2:parameters(), 4)
  T.ok(tostring(m2):find('experts=4', 1, true))
  local y = m2(gp.randn({2, 3, 8}, cpu))
  T.same(y.shape, {2, 3, 8})
  T.ok(m2.aux_loss ~= nil)
  m2:eval()
  m2(gp.randn({5, 8}, cpu))
  T.ok(m2.aux_loss == nil)
  -- in a GPT
  local g = moe_gpt('cpu')
  T.eq(#nn.moe_layers(g), 2)
  local opt = gp.optim.AdamW(g, {lr = 1e-3})
  local x = gp.randint(0, 29, {3, 16}, {device = 'cpu'})
  local y2 = gp.randint(0, 29, {3, 16}, {device = 'cpu'})
  local _, ce = g(x, y2)
  local aux = g:aux_loss()
  T.ok(aux ~= nil)
  T.ok(aux:item() > 0)
  local before = g.h[1].mlp.w1:clone()
  ;(ce + aux):backward()
  T.ok(g.h[1].mlp.router.weight.grad ~= nil, 'router grad')
  T.ok(g.h[1].mlp.w2.grad ~= nil, 'expert grad')
  opt:step()
  T.ok(T.relnorm(g.h[1].mlp.w1, before) > 0)
  -- load tracking
  local l = nn.moe_layers(g)[1]:track_load(true)
  gp.no_grad(function() g(x) end)
  T.eq(l.load:sum():item(), 3 * 16 * 2)
end)

T.test('nn.MoE: cached decoding equals the full forward (cpu)', function()
  local m = moe_gpt('cpu'):eval()
  m:init_weights(0.2)
  gp.no_grad(function()
    local idx = gp.randint(0, 29, {2, 9}, {device = 'cpu'})
    local full = m(idx)
    local cache = require('gpush.models.generate').simple_cache({batch = 2, heads = 4, capacity = 12, head_dim = 8,
      layers = 2, dtype = 'f32', device = 'cpu'})
    local pre = m:forward_cached(idx:narrow(2, 1, 5), cache, 0)
    T.ok(T.relnorm(pre, full:narrow(2, 1, 5)) < 1e-5, 'prefill')
    for t = 6, 9 do
      local lg = m:forward_cached(idx:narrow(2, t, 1):contiguous(), cache, t - 1)
      T.ok(T.relnorm(lg, full:narrow(2, t, 1)) < 1e-5, 'decode at ' .. t)
    end
  end)
end)

T.test('nn.MoE (cuda): greedy decoding equals the CPU token for token', function()
  T.cuda()
  local m = moe_gpt('cpu', {n_embd = 64, n_head = 4, mlp_hidden = 64, block_size = 32}):eval()
  m:init_weights(0.2)
  local mc = moe_gpt('cpu', {n_embd = 64, n_head = 4, mlp_hidden = 64, block_size = 32})
  mc:load_state_dict(m:state_dict())
  mc:to('cuda'):eval()
  local prompts = {{1, 2, 3}, {7}, {4, 5, 6, 7}}
  local a = gp.generate(m, prompts, {greedy = true, max_new = 20})
  local b = gp.generate(mc, prompts, {greedy = true, max_new = 20})
  T.same(b.lists, a.lists)
end)

---------------------------------------------------------------------------
-- bad input

T.test('moe ops: bad input gives errors naming the op and shapes', function()
  T.raises(function() gp.moe_router(gp.randn({3, 300}, cpu), 2) end, 'moe_router', '(3,300)')
  T.raises(function() gp.moe_router(gp.randn({3, 4}, cpu), 5) end, 'moe_router', 'k = 5')
  T.raises(function() gp.moe_router(gp.randn({3, 4}, cpu), 9) end, 'moe_router')
  T.raises(function() gp.moe_router(gp.randn({3}, cpu), 1) end, 'moe_router', 'logits')
  T.raises(function() gp.moe_router(gp.zeros({3, 4}, I32), 1) end, 'moe_router', 'float')
  local ids = ids_of({{0, 1}, {2, 5}})
  T.raises(function() gp.moe_permute(ids, 4, 2) end, 'moe_permute', 'ids', '5')
  T.raises(function() gp.moe_histogram(ids_of({{-1, 0}}), 4) end, 'moe_histogram', '-1')
  T.raises(function() gp.k.moe_permute(gp.empty({2, 2}, I32), gp.empty({7}, I32), gp.empty({4}, I32), ids_of({{0, 1}, {2, 3}})) end,
    'moe_permute', '(7)', '(4)')
  T.raises(function() gp.moe_permute(ids_of({{0, 1}}), 300, 1) end, 'moe_permute', '256')
  local x = gp.randn({2, 3}, cpu)
  local dest, src = gp.moe_permute(ids_of({{0, 1}, {1, 0}}), 2, 2)
  T.raises(function() gp.moe_gather(x, gp.tensor({0, 9, -1, 1}, I32), dest) end, 'moe_gather', 'src', '9')
  T.raises(function() gp.moe_gather(x, src, ids_of({{0, 1}})) end, 'moe_gather', '(2,3)', '(1,2)')
  T.raises(function() gp.moe_combine(gp.randn({4, 3}, cpu), gp.randn({2, 3}, cpu), dest, src) end, 'moe_combine', 'w')
  T.raises(function() gp.moe_combine(gp.randn({4, 3}, cpu), gp.randn({2, 2}, cpu), ids_of({{0, 8}, {1, 2}}), src) end,
    'moe_combine', 'dest', '8')
  local xx, wr, w1, w2, w3 = layer_inputs('f32', 4, 8, 6, 3, true)
  T.raises(function() gp.moe_ffn(xx, wr, w1, w2:narrow(3, 1, 4), w3) end, 'moe_ffn', 'w2')
  T.raises(function() gp.moe_ffn(xx, wr, w1, w2, w3, {k = 4}) end, 'moe_ffn', 'k = 4')
  T.raises(function() gp.moe_ffn(xx, wr, w1, w2, w3, {capacity_factor = -1}) end, 'capacity_factor')
  T.raises(function() nn.MoE(8, 16, {experts = 4, k = 5}) end, 'MoE', 'k = 5')
  T.raises(function() nn.MoE(8, 16, {act = 'relu'}) end, 'MoE', 'act')
  T.raises(function() nn.MoE(8, 16, {device = 'cpu'})(gp.randn({2, 7}, cpu)) end, 'MoE', '(2,7)')
  T.raises(function() nn.GPT {vocab_size = 5, block_size = 4, n_embd = 8, n_layer = 1, n_head = 2, mlp = 'mixture'} end,
    'TransformerBlock', 'moe')
end)

---------------------------------------------------------------------------
-- the script

T.test('scripts/moe.lua --tiny: dense and MoE train, val losses, load histogram, inference mode', function()
  local exe = T.exe
  local script = (GPUSH_ROOT or '.') .. '/scripts/moe.lua'
  local out, rc = T.sh(exe .. ' --device cpu ' .. script .. ' --tiny')
  T.eq(rc, 0, out)
  T.ok(out:find('dense: val loss', 1, true), out)
  T.ok(out:find('moe: val loss', 1, true), out)
  T.ok(out:find('layer 1 load', 1, true), out)
  T.ok(out:find('tokens/s', 1, true), out)
  out, rc = T.sh(exe .. ' --device cpu ' .. script .. ' --tiny --infer')
  T.eq(rc, 0, out)
  T.ok(out:find('dense: ', 1, true) and out:find('moe: ', 1, true), out)
  T.ok(out:find('tokens/s', 1, true), out)
end)

T.test('scripts/moe.lua --resume: stopped within each model and resumed, the losses equal one run (bitwise, cpu)', function()
  local cmd = string.format('%s --device cpu %s/scripts/moe.lua --tiny --iters 12 --eval-every 6 --log-every 1 --quiet', T.exe, T.root)
  T.check_resume(cmd, {5, 17}) -- in the dense model, in the MoE one (12 steps each)
end)

T.test('scripts/moe.lua: evaluations leave the training run as it is (the same losses with and without them, bitwise)', function()
  local d = os.tmpname()
  local function losses(every)
    local path = d .. '.' .. every .. '.jsonl'
    local out, rc = T.sh(string.format('%s --device cpu %s/scripts/moe.lua --tiny --quiet --iters 12 --runs dense --log-every 1 ' ..
      '--eval-every %d --log %s', T.exe, T.root, every, path))
    T.eq(rc, 0, out)
    local r = {}
    for line in io.lines(path) do
      local rec = gp.json.decode(line)
      if rec.loss and rec.step then r[rec.step] = rec.loss end
    end
    os.remove(path)
    return r
  end
  local plain, evaluated = losses(0), losses(3)
  for step = 1, 12 do
    T.ok(plain[step] ~= nil and plain[step] == evaluated[step],
      string.format('step %d: %s without evaluations, %s with one every 3 steps', step, tostring(plain[step]), tostring(evaluated[step])))
  end
  os.remove(d)
end)

T.test('scripts/moe.lua: dense at equal active and at equal total parameters beside the MoE (tiny, cpu)', function()
  local out, rc = T.sh(string.format('%s --device cpu %s/scripts/moe.lua --tiny --quiet --iters 4 --eval-every 0 --runs dense,moe,dense_total',
    T.exe, T.root))
  T.eq(rc, 0, out)
  local p = {}
  for kind, total, active in out:gmatch('\n(%S+): val loss [^\n]* | (%d+) params, (%d+) active') do p[kind] = {tonumber(total), tonumber(active)} end
  T.ok(p.dense and p.moe and p.dense_total, out)
  T.ok(math.abs(p.dense[1] - p.moe[2]) / p.moe[2] < 0.02, 'dense: the MoE\'s active count')
  T.ok(math.abs(p.dense_total[1] - p.moe[1]) / p.moe[1] < 0.02, 'dense_total: the MoE\'s total count')
  T.ok(out:find('(equal active parameters)', 1, true) and out:find('(equal total parameters)', 1, true), out)
  out, rc = T.sh(string.format('%s --device cpu %s/scripts/moe.lua --tiny --runs dense,sparse', T.exe, T.root))
  T.ok(rc ~= 0 and out:find("unknown model 'sparse'", 1, true), out)
end)
