-- Real model formats: tiny Hugging Face checkpoints with random weights
-- (tests/fixtures/models/NAME, made by make.py there with transformers) and
-- the logits and greedy tokens transformers computed with them.
local T = require 'lib'
local nn = gp.nn
local root = (GPUSH_ROOT or '.') .. '/tests/fixtures/models'
local ARCHS = {'llama_gqa', 'llama3_rope', 'qwen2', 'gpt2'}

local function expected(name) return gp.load(root .. '/' .. name .. '/expected.safetensors') end

local function greedy(m, e)
  local prompt = {unpack(e.ids:totable()[1], 1, 8)}
  local r = gp.generate(m, {prompt}, {max_new = 32, greedy = true})
  return r.lists[1]
end

for _, name in ipairs(ARCHS) do
  for _, device in ipairs {'cpu', 'cuda'} do
    T.test(string.format('models: %s logits and greedy tokens equal transformers\' (f32, %s)', name, device), function()
      if device == 'cuda' then T.cuda() end
      local m = gp.models.load(root .. '/' .. name, {dtype = 'f32', device = device})
      local e = expected(name)
      local lg = m(e.ids:to(device))
      T.ok(T.relnorm(lg:cpu(), e.logits) < 1e-4, 'logits: ' .. T.relnorm(lg:cpu(), e.logits))
      local want = e.greedy:totable()[1]
      local got = greedy(m, e)
      T.eq(table.concat(got, ','), table.concat(want, ','))
    end)
  end
  T.test(string.format('models: %s in bf16 within 2e-2 of transformers\' f32 logits', name), function()
    local device = gp.cuda_available() and 'cuda' or 'cpu'
    local m = gp.models.load(root .. '/' .. name, {dtype = 'bf16', device = device})
    local e = expected(name)
    local lg = m(e.ids:to(device)):float():cpu()
    T.ok(T.relnorm(lg, e.logits) < 2e-2, 'logits: ' .. T.relnorm(lg, e.logits))
  end)
end

-- f()'s result, its calls of gp.linear and of gp.lora_linear (a LoRA projection: its base product is one of
-- the former, its two adapter products are inside it), and all its counts: those two, lora_linear_group
-- calls and the matrix products launched (products, T.counted)
local function counted(f)
  local core = require 'gpush.core' -- the table the models call through
  local r, n = T.counted(f, {linear = {core, 'linear'}, lora = {core, 'lora_linear'}, group = {core, 'lora_linear_group'}})
  return r, n.linear, n.lora, n
end

T.test('models: without autograd q/k/v and gate/up run as one product each, with the same logits; a replaced weight ends it', function()
  for _, name in ipairs {'llama_gqa', 'qwen2'} do -- qwen2: q, k, v with biases
    local m = gp.models.load(root .. '/' .. name, {dtype = 'f32', device = 'cpu'})
    local e = expected(name)
    local L = m.config.num_hidden_layers
    local with_grad, n1 = counted(function() return m(e.ids) end)
    local fused, n2 = counted(function() return gp.no_grad(m.forward, m, e.ids) end)
    T.eq(n1, 7 * L + 1, name .. ': products with autograd')
    T.eq(n2, 4 * L + 1, name .. ': products without')
    T.ok(T.relnorm(fused, with_grad) < 1e-6, name .. ': ' .. T.relnorm(fused, with_grad))
    T.ok(T.relnorm(fused, e.logits) < 1e-4, name .. ': ' .. T.relnorm(fused, e.logits))
    -- the state dict holds the blocks as the checkpoint's tensors
    local sd = m:state_dict()
    local q = sd['model.layers.0.self_attn.q_proj.weight']
    T.eq(q:size(1), m.config.num_attention_heads * m.config.head_dim)
    T.ok(q:is_contiguous())
    -- a replaced weight (here v_proj's) ends the sharing in that layer only: products alone again
    local v = m.model.layers[1].self_attn.v_proj
    v.weight = nn.Parameter(v.weight:clone())
    local after, n3 = counted(function() return gp.no_grad(m.forward, m, e.ids) end)
    T.eq(n3, 4 * L + 1 + 2, name .. ': products after one replaced weight')
    T.ok(T.relnorm(after, fused) < 1e-6)
  end
end)

T.test('models: LoRA on a Llama: unmerged, the adapters count without autograd too; merged, q/k/v and gate/up run fused again', function()
  local m = gp.models.load(root .. '/llama_gqa', {dtype = 'f32', device = 'cpu'})
  local e = expected('llama_gqa')
  local L = m.config.num_hidden_layers
  local base = gp.no_grad(m.forward, m, e.ids)
  gp.lora.apply(m, {rank = 4})
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.1) end
  local with_grad = m(e.ids)
  local without, n1, l1, c1 = counted(function() return gp.no_grad(m.forward, m, e.ids) end)
  T.ok(T.relnorm(without, with_grad) < 1e-6, 'no_grad ' .. T.relnorm(without, with_grad))
  T.ok(T.relnorm(without, base) > 1e-3, 'the adapters change the logits')
  -- q/k/v and gate/up: one gp.lora_linear_group each (one base product over the fused weight); o and down alone
  T.eq(n1, 4 * L + 1, 'unmerged: one base product for q/k/v, one for gate/up, o and down alone')
  T.eq(c1.group, 2 * L, 'unmerged: q/k/v and gate/up each one gp.lora_linear_group')
  T.eq(l1, 2 * L, 'unmerged: o and down each one gp.lora_linear')
  gp.lora.merge(m)
  local merged, n2, _, c2 = counted(function() return gp.no_grad(m.forward, m, e.ids) end)
  T.eq(n2, 4 * L + 1, 'merged: one product for q/k/v and one for gate/up again')
  T.eq(c2.group, 0, 'merged: no adapter products')
  T.ok(T.relnorm(merged, without) < 1e-5, 'merged ' .. T.relnorm(merged, without))
  gp.lora.unmerge(m)
  local after, n3, l3, c3 = counted(function() return gp.no_grad(m.forward, m, e.ids) end)
  T.eq(n3, 4 * L + 1)
  T.eq(l3, 2 * L)
  T.eq(c3.group, 2 * L)
  T.ok(T.relnorm(after, without) < 1e-6, 'unmerged again ' .. T.relnorm(after, without))
  T.eq(T.relnorm(gp.lora.without(m, function() return gp.no_grad(m.forward, m, e.ids) end), base), 0, 'disabled: the base')
  -- NF4 quantization replaces the modules: the record is dropped (its tensor can be freed); without
  -- autograd the Linear4s share a stacked quantized weight instead (one NF4 product for q/k/v, one for gate/up)
  local q = gp.models.load(root .. '/llama_gqa', {dtype = 'f32', device = 'cpu'})
  gp.nn.quantize_linears(q, {kind = 'nf4', block = 32})
  local core = require 'gpush.core'
  local function nf4_counted(f) local r, n = T.counted(f, {nf4 = {core, 'nf4_linear'}}); return r, n.nf4 end
  local alone, k1 = nf4_counted(function() return q(e.ids) end) -- autograd on: each projection alone
  local stacked, k2 = nf4_counted(function() return gp.no_grad(q.forward, q, e.ids) end)
  local at = q.model.layers[1].self_attn
  T.eq(rawget(at, '_qkv'), nil)
  T.eq(k1, 7 * L, 'NF4 products a forward with autograd')
  T.eq(k2, 4 * L, 'NF4 products without: q/k/v and gate/up stacked')
  T.ok(T.relnorm(stacked, alone) < 1e-6, 'NF4 stacked ' .. T.relnorm(stacked, alone))
  local st = rawget(at, '_qkv4').q
  T.eq(st.shape[1], (m.config.num_attention_heads + 2 * m.config.num_key_value_heads) * m.config.head_dim)
  T.eq(st.shape[2], m.config.hidden_size)
  T.ok(at.q_proj.weight.data.c.data == st.data.c.data and at.v_proj.weight.absmax.c.data == st.absmax.c.data,
    'the Linear4s hold views of the stack')
  local sd = q:state_dict()
  local kn = sd['model.layers.0.self_attn.k_proj.weight.nf4']
  T.ok(kn:size(1) == m.config.num_key_value_heads * m.config.head_dim and kn:size(2) == m.config.hidden_size / 2, 'k_proj.weight.nf4')
  -- a LoRA over the quantized projections runs them alone again, with the same base
  gp.lora.apply(q, {rank = 4})
  local _, k3 = nf4_counted(function() return gp.no_grad(q.forward, q, e.ids) end)
  T.eq(k3, 7 * L, 'NF4 products under LoRA')
  T.ok(T.relnorm(gp.no_grad(q.forward, q, e.ids), stacked) < 1e-6, 'LoRA (B = 0) over the stacked views')
end)

-- a Llama fixture with LoRA on every projection (B random: the adapters count), over an NF4 base with nf4
local function lora_llama(name, nf4)
  gp.manual_seed(11)
  local m = gp.models.load(root .. '/' .. name, {dtype = 'f32', device = 'cpu'})
  if nf4 then gp.nn.quantize_linears(m, {kind = 'nf4', block = 32}) end
  local ad = gp.lora.apply(m, {rank = 4})
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.1) end
  return m, ad
end

-- products a layer in a training step (forward and backward), LoRA on all 7 projections, dense base:
-- module by module 7 x (3 + 5) = 56; grouped q/k/v 5 + 11 (9 + 15 before) and gate/up 4 + 7 (6 + 10: swiglu's
-- backward writes dgate and dup as column blocks of one gradient, so dx is one product over the fused
-- weight), o and down 8 each: 43, 13 fewer; over NF4 (the base one product a projection either way) 9 fewer. The
-- first layer's input needs no gradient (the embedding is frozen): its q/k/v skip their dx products, 6
-- module by module and 4 grouped, so that layer saves 2 fewer.
T.test('models: LoRA on a Llama under autograd: q/k/v and gate/up one node each, the same logits and adapter gradients as module by module, fewer products', function()
  local span = require('gpush.core.tensor').span
  for _, case in ipairs {{'llama_gqa', false, 13}, {'qwen2', false, 13}, {'llama_gqa', true, 9}} do
    local name, nf4, fewer = case[1], case[2], case[3]
    local what = name .. (nf4 and ' (NF4)' or '')
    local m, ad = lora_llama(name, nf4)
    local e = expected(name)
    local L = m.config.num_hidden_layers
    -- gp.lora.apply made each group's A row blocks of one tensor, listed side by side (then their B)
    local at = m.model.layers[1].self_attn
    T.ok(span({at.q_proj.lora_A, at.k_proj.lora_A, at.v_proj.lora_A}, 1), what .. ': q/k/v A one tensor')
    T.ok(ad[1] == at.q_proj.lora_A and ad[3] == at.v_proj.lora_A and ad[4] == at.q_proj.lora_B, what .. ': parameter order')
    local mlp = m.model.layers[1].mlp
    T.ok(span({mlp.gate_proj.lora_A, mlp.up_proj.lora_A}, 1), what .. ': gate/up A one tensor')
    gp.lora.load(m, gp.lora.state_dict(m)) -- loading copies into the blocks: still one tensor
    T.ok(span({at.q_proj.lora_A, at.k_proj.lora_A, at.v_proj.lora_A}, 1), what .. ': q/k/v A one tensor after lora.load')
    -- the optimizer's flat gradient buffer: the A of a group have one gradient tensor (dA one GEMM into it)
    local opt = gp.optim.AdamW(ad, {lr = 1e-3, weight_decay = 0})
    local function step()
      opt:zero_grad()
      local lg, loss = m(e.ids, e.ids)
      loss:backward()
      local gs = {}
      for i, p in ipairs(ad) do gs[i] = p.grad:clone() end
      return {lg, gs}
    end
    local r1, _, l1, c1 = counted(step)
    -- module by module: nn.LoRA.forward_group declines, every projection is one gp.lora_linear
    local fg = nn.LoRA.forward_group
    nn.LoRA.forward_group = function() return nil end
    local ok, r2, _, l2, c2 = pcall(counted, step)
    nn.LoRA.forward_group = fg
    assert(ok, r2)
    T.eq(c1.group, 2 * L, what .. ': q/k/v and gate/up one node each')
    T.eq(l1, 2 * L, what .. ': o and down alone')
    T.eq(c2.group + 0, 0)
    T.eq(l2, 7 * L)
    T.eq(c2.products - c1.products, fewer * L - 2, what .. ': products ' .. c2.products .. ' -> ' .. c1.products)
    T.ok(T.relnorm(r1[1], r2[1]) < 1e-6, what .. ': logits ' .. T.relnorm(r1[1], r2[1]))
    for i = 1, #ad do
      T.ok(T.relnorm(r1[2][i], r2[2][i]) < 1e-5, what .. ': adapter gradient ' .. i .. ' ' .. T.relnorm(r1[2][i], r2[2][i]))
    end
  end
end)

-- one LoRA update of the polychromic experiment (issue #20: launch-bound): the
-- token log-probs of the last K positions with autograd, the PPO loss,
-- backward, gradient clipping and the AdamW step; its kernel launches by name
local function lora_update(m, ad)
  gp.manual_seed(5)
  local V = m.config.vocab_size
  local full = gp.randint(0, V, {3, 12}, {dtype = 'i64', device = 'cpu'})
  local tg = gp.randint(0, V, {3, 8}, {dtype = 'i64', device = 'cpu'})
  local mask, adv = tg:ne(-100):float(), gp.randn({3}, {device = 'cpu'})
  local opt = gp.optim.AdamW(ad, {lr = 1e-3, weight_decay = 0})
  local old
  local function step()
    local loss
    loss, old = gp.polychromic.ppo_step(m, opt, full, tg, adv, mask, {old = old, clip = 0.2})
    return loss
  end
  step() -- the optimizer's state, the old log-probs
  local _, n = T.launches(step)
  return n
end

-- where the fills and copies of an update come from, per layer (L) and once.
-- Fills: none per layer (no bias zeros for bias-free groups); once: zero_grad's
-- flat buffer, backward's seed, the narrowed hidden's gradient (the loss's
-- count is gp.k.loss_count's own launch).
-- Copies per layer: none for rope (it reads q and k where the q/k/v product put
-- them), nor for swiglu's backward (it reads gate and up, column views of the
-- gate/up product, where they lie), nor for the attention output's (B, H, T, hd)
-- -> (B, T, H * hd) (gp.attention writes it in q's layout: a view). Once: 8 (the narrowed ids and hidden states, the narrow's
-- gradient, dtype casts in the loss's backward)
T.test('models: a LoRA update of a Llama launches no per-layer fill or copy', function()
  for _, case in ipairs {{'llama_gqa', false, 0}, {'llama_gqa', true, 0}, {'qwen2', false, 0}} do
    local m, ad = lora_llama(case[1], case[2])
    local n = lora_update(m, ad)
    local L = m.config.num_hidden_layers
    local what = case[1] .. (case[2] and ' (NF4)' or '')
    T.eq(n.fill, 3, what .. ': fills')
    T.eq(n.copy, case[3] * L + 8, what .. ': copies')
  end
end)

T.test('models: the residual adds run fused with the norms after them: the same logits and gradients as layer by layer', function()
  local m = gp.models.load(root .. '/llama_gqa', {dtype = 'f32', device = 'cpu'})
  local e = expected('llama_gqa')
  local L = m.config.num_hidden_layers
  local function run()
    for _, p in ipairs(m:parameters()) do p:zero_grad() end
    local lg, loss = m(e.ids, e.ids)
    loss:backward()
    return lg, m.model.embed_tokens.weight.grad:clone(), m.model.layers[1].self_attn.q_proj.weight.grad:clone()
  end
  local core = require 'gpush.core'
  local add_rms, calls = core.add_rms_norm, 0
  core.add_rms_norm = function(...) calls = calls + 1; return add_rms(...) end
  local ok, lg1, ge1, gq1 = pcall(run)
  core.add_rms_norm = add_rms
  assert(ok, lg1)
  T.eq(calls, 2 * L)
  -- a norm that is not a plain nn.RMSNorm (here a subclass) makes the body run layer by layer
  local Norm = nn.RMSNorm:extend('TestNorm')
  setmetatable(m.model.norm, Norm._imt)
  local lg2, ge2, gq2 = run()
  T.ok(T.relnorm(lg1, lg2) < 1e-6, 'logits ' .. T.relnorm(lg1, lg2))
  T.ok(T.relnorm(ge1, ge2) < 1e-5, 'embedding grad ' .. T.relnorm(ge1, ge2))
  T.ok(T.relnorm(gq1, gq2) < 1e-5, 'q_proj grad ' .. T.relnorm(gq1, gq2))
  T.ok(T.relnorm(lg1, e.logits) < 1e-4)
end)

-- model:loss (GPT and Llama): gp.linear_cross_entropy over the final hidden states and the head, never the whole
-- logits: the loss and every gradient of the logits' path (a tied head's too), its options, and the heads it
-- cannot take
T.test('models: model:loss equals cross_entropy of the logits, gradients too, without the logits', function()
  for _, name in ipairs {'llama_gqa', 'gpt2'} do
    local m = gp.models.load(root .. '/' .. name, {dtype = 'f32', device = 'cpu'})
    local e = expected(name)
    local ids = e.ids
    local tg = ids:clone()
    tg:narrow(2, 1, 2):fill_(-100) -- ignored positions
    local params = m:parameters()
    local function grads(f)
      for _, p in ipairs(params) do p:zero_grad() end
      local l = f()
      l:backward()
      local g = {}
      for i, p in ipairs(params) do g[i] = p.grad and p.grad:clone() end
      return l, g
    end
    local l1, g1 = grads(function() local _, l = m(ids, tg); return l end)
    local launched
    local l2, g2 = grads(function()
      local l, n = T.launches(function() return m:loss(ids, tg, {chunk = 3}) end)
      launched = n
      return l
    end)
    T.near(l2:item(), l1:item(), 1e-5, name .. ' loss')
    -- chunks of 3 rows: each chunk's logits, loss and gradient, dh and dw (the whole logits never made)
    local chunks = math.ceil(ids:numel() / 3)
    T.eq(launched.cross_entropy_fwd_bwd, chunks, name .. ': a loss kernel a chunk')
    local _, body = T.launches(function() return m:hidden(ids) end)
    T.eq(launched.matmul - (body.matmul or 0), 3 * chunks, name .. ': three products a chunk')
    for i = 1, #params do
      if g1[i] then T.ok(T.relnorm(g2[i], g1[i]) < 1e-4, name .. ' grad ' .. i .. ': ' .. T.relnorm(g2[i], g1[i])) end
    end
    local s = m:loss(ids, tg, {reduction = 'sum'})
    T.near(s:item(), l1:item() * (tg:numel() - 2 * tg:size(1)), 1e-4, name .. ' sum')
    T.raises(function() m:loss(ids, gp.zeros({1, 3}, {dtype = 'i64', device = 'cpu'})) end, 'linear_cross_entropy',
      'targets')
  end
  local m = gp.nn.GPT {vocab_size = 20, block_size = 8, n_embd = 16, n_layer = 1, n_head = 2}
  m.lm_head = nn.Linear(16, 20)
  T.raises(function() m:loss(gp.zeros({1, 4}, {dtype = 'i64'}), gp.zeros({1, 4}, {dtype = 'i64'})) end, 'GPT:loss',
    'unbiased nn.Linear')
  T.raises(function() m:loss(gp.zeros({1, 9}, {dtype = 'i64'}), gp.zeros({1, 9}, {dtype = 'i64'})) end, 'GPT:loss',
    'block_size')
end)

T.test('models: a Llama decode step runs SwiGLU and the down projection as one kernel: the logits of the two kernels', function()
  local devs = {'cpu'}
  if gp.cuda_available() then devs[2] = 'cuda' end
  for _, dev in ipairs(devs) do
    local m = gp.models.load(root .. '/llama_gqa', {dtype = 'f32', device = dev})
    local e = expected('llama_gqa')
    local core = require 'gpush.core'
    local f, calls = core.swiglu_linear, 0
    core.swiglu_linear = function(...) calls = calls + 1; return f(...) end
    local ids = e.ids:to(dev):narrow(2, 1, 1)
    local ok, a = pcall(gp.no_grad, function() return m(ids) end)
    core.swiglu_linear = f
    assert(ok, a)
    T.eq(calls, m.config.num_hidden_layers, dev)
    -- a down projection that is not a plain nn.Linear (here a subclass) takes gp.swiglu and the product
    local Lin = nn.Linear:extend('TestLinear')
    for _, l in ipairs(m.model.layers) do setmetatable(l.mlp.down_proj, Lin._imt) end
    local b = gp.no_grad(function() return m(ids) end)
    T.ok(T.relnorm(a:cpu(), b:cpu()) < 1e-5, dev .. ' ' .. T.relnorm(a:cpu(), b:cpu()))
  end
end)

T.test('models: state_dict() gives back the checkpoint\'s names, shapes and values', function()
  for _, name in ipairs(ARCHS) do
    local file = gp.load(root .. '/' .. name .. '/model.safetensors')
    local m = gp.models.load(root .. '/' .. name, {device = 'cpu'})
    local sd = m:state_dict()
    for k, t in pairs(file) do
      T.ok(sd[k], name .. ': ' .. k .. ' missing from state_dict()')
      T.eq(table.concat(sd[k].shape, 'x'), table.concat(t.shape, 'x'), name .. ' ' .. k)
      T.eq(sd[k].dtype, t.dtype, name .. ' ' .. k)
      T.eq((sd[k]:float() - t:float()):abs():max():item(), 0, name .. ' ' .. k)
    end
    for k in pairs(sd) do T.ok(file[k], name .. ': state_dict() has ' .. k .. ', which the checkpoint does not') end
  end
end)

T.test('models: gp.models.save writes a directory that loads back (the fine-tuned model transformers can read)', function()
  for _, name in ipairs {'llama_gqa', 'gpt2'} do
    local m = gp.models.load(root .. '/' .. name, {dtype = 'f32', device = 'cpu'})
    local dir = os.tmpname()
    os.remove(dir)
    gp.models.save(m, dir)
    local m2 = gp.models.load(dir, {device = 'cpu'})
    T.eq(m2.lm_head.weight.dtype, 'f32', name .. ': saved in the dtype of its weights')
    local e = expected(name)
    T.ok(T.relnorm(m2(e.ids), e.logits) < 1e-4, name)
    os.execute('rm -rf ' .. dir)
  end
  T.raises(function() gp.models.save(gp.nn.Linear(2, 2), '/tmp/x') end, 'models.save', 'Hugging Face config')
end)

-- a copy of a fixture with config.json changed by edit(config)
local function with_config(name, edit)
  local dir = os.tmpname()
  os.remove(dir)
  os.execute(string.format('mkdir -p %s && cp %s/%s/model.safetensors %s/', dir, root, name, dir))
  local f = assert(io.open(root .. '/' .. name .. '/config.json'))
  local c = gp.json.decode(f:read('*a'))
  f:close()
  edit(c)
  local out = assert(io.open(dir .. '/config.json', 'w'))
  out:write(gp.json.encode(c))
  out:close()
  return dir
end

T.test('models: a config that disagrees with the weights, an unknown architecture or field value is a clear error', function()
  local cases = {
    {function(c) c.intermediate_size = 100 end, 'gate_proj.weight', 'model.safetensors', '(192,128)'},
    {function(c) c.model_type = 'mamba' end, 'config.json', "model_type 'mamba' is not supported"},
    {function(c) c.hidden_act = 'relu' end, 'config.json', "hidden_act 'relu'"},
    {function(c) c.rope_scaling = {rope_type = 'yarn', factor = 4} end, 'yarn', 'not supported'},
    {function(c) c.num_key_value_heads = 3 end, 'num_key_value_heads 3'},
    {function(c) c.num_hidden_layers = 3 end, 'missing keys', 'model.layers.2'},
  }
  for _, case in ipairs(cases) do
    local dir = with_config('llama_gqa', case[1])
    local err = T.raises(function() gp.models.load(dir, {device = 'cpu'}) end, unpack(case, 2))
    T.ok(not err:find('traceback', 1, true))
    os.execute('rm -rf ' .. dir)
  end
  T.raises(function() gp.models.load(root .. '/no_such_model') end, 'no_such_model')
  T.raises(function() gp.models.load('gpt-17') end, 'gpt-17')
end)

T.test('models: a BERT encoder equals transformers\' hidden states (padding masked), and mean pooling its embeddings', function()
  local devices = {'cpu'}
  if gp.cuda_available() then devices[2] = 'cuda' end
  local e = expected('bert')
  for _, device in ipairs(devices) do
    local m = gp.models.load(root .. '/bert', {dtype = 'f32', device = device})
    local h = m(e.ids:to(device), e.mask:to(device)):cpu()
    -- padded positions of the second row are not compared (their values are not used)
    T.ok(T.relnorm(h:narrow(1, 1, 1), e.hidden:narrow(1, 1, 1)) < 1e-4, device .. ' row 1')
    T.ok(T.relnorm(h:narrow(1, 2, 1):narrow(2, 1, 18), e.hidden:narrow(1, 2, 1):narrow(2, 1, 18)) < 1e-4, device .. ' row 2')
    -- the sentence wrapper: texts are id lists here (a stand-in tokenizer), padded to the batch's longest and masked
    local rows = e.ids:totable()
    local tok = {encode = function(_, s) return s == 'a' and rows[1] or {unpack(rows[2], 1, 18)} end}
    local enc = require('gpush.models.bert').sentence(m, tok, {pooling = 'mean', normalize = true})
    local emb = enc:embed({'a', 'b', 'a'}):cpu()
    T.ok(T.relnorm(emb:narrow(1, 1, 2), e.embed) < 1e-4, device .. ' embed')
    T.ok(T.relnorm(emb:narrow(1, 3, 1), e.embed:narrow(1, 1, 1)) < 1e-6, device .. ' the same text, the same row')
    -- a text at a time (no padding) gives the padded batch's embeddings
    local one = enc:embed({'a', 'b', 'a'}, {batch_size = 1}):cpu()
    T.ok(T.relnorm(one, emb) < 1e-5, device .. ' unpadded ' .. T.relnorm(one, emb))
  end
end)

T.test('models: a llama GGUF (llama.cpp\'s q/k row permutation, F16, F32 and Q8_0 tensors) equals the same weights from safetensors', function()
  local path = root .. '/llama_gqa.gguf' -- written by make_gguf.py from the llama_gqa fixture
  local g, tok, cfg = gp.models.load(path, {dtype = 'f32', device = 'cpu'})
  T.eq(cfg.num_key_value_heads, 2)
  T.eq(tok.vocab_size, 128)
  local hf = gp.models.load(root .. '/llama_gqa', {dtype = 'f32', device = 'cpu'})
  -- the two Q8_0 tensors: the HF model takes their dequantized values, then both hold the same numbers
  local f = gp.gguf.open(path)
  local sd = hf:state_dict()
  gp.no_grad(function()
    sd['model.layers.0.mlp.up_proj.weight']:copy_(f:read('blk.0.ffn_up.weight', {dtype = 'f32', device = 'cpu'}))
    sd['model.layers.1.self_attn.v_proj.weight']:copy_(f:read('blk.1.attn_v.weight', {dtype = 'f32', device = 'cpu'}))
  end)
  f:close()
  local e = expected('llama_gqa')
  T.ok(T.relnorm(g(e.ids), hf(e.ids)) < 1e-6, 'the GGUF and the safetensors model')
  T.ok(T.relnorm(g(e.ids), e.logits) < 2e-2, 'within Q8_0 rounding of transformers')
end)

T.test('scripts/perplexity.lua scores every token once (windows overlapping by half)', function()
  local txt = os.tmpname()
  local f = assert(io.open(txt, 'w'))
  f:write(('the quick brown fox jumps over the lazy dog. '):rep(6))
  f:close()
  local out, rc = T.sh(string.format('%s/build/gpush %s/scripts/perplexity.lua --model %s/llama_gqa.gguf --file %s --tokens 100 --window 32',
    GPUSH_ROOT or '.', GPUSH_ROOT or '.', root, txt))
  os.remove(txt)
  T.eq(rc, 0, out)
  local n = tonumber(out:match('over (%d+) tokens'))
  local total = tonumber(out:match('on the last (%d+) tokens'))
  T.eq(n, total - 1, out)
end)
