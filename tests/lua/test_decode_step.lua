-- The Llama decode step as one kernel (gp.decode_step, gp_decode_plan,
-- kernels/decode_step.c and .cu). On the CPU: the plan's C reference
-- ('always') equals the op-by-op step (logits and the cache), plans are
-- refused for models the kernel does not take (the op-by-op step runs), the
-- option and the run's argument checks. On a GPU: the kernel against the
-- op-by-op step, eager and as a graph, at head dims 64 and 128, one and
-- several rows (the products on CUDA cores and on tensor cores), a short
-- cache (one chunk of positions a head) and a long one (chunks merged), the
-- default's row limit, and gp.generate's greedy tokens with it on and off.
local T = require 'lib'
local gp = require 'gpush'

local function llama(dev, o)
  o = o or {}
  gp.manual_seed(o.seed or 3)
  local cfg = {vocab_size = 256, hidden_size = o.d or 256, intermediate_size = o.I or 384,
               num_hidden_layers = o.layers or 3, num_attention_heads = o.H or 4, num_key_value_heads = o.J or 2,
               max_position_embeddings = 4096, model_type = 'llama'}
  return gp.models.Llama(cfg, {dtype = o.dtype or 'bf16', device = dev}):eval()
end

-- fn() with gp.decode_step(mode), the setting restored after it (also on an error)
local function with_mode(mode, fn)
  local prev = gp.decode_step(mode)
  local ok, r = pcall(fn)
  gp.decode_step(prev)
  if not ok then error(r, 0) end
  return r
end

-- one step of B rows at position P after a prefill of P tokens: the op-by-op
-- step (mode false) or the kernel's; the logits (B, V) and the cache
local function step(m, mode, dev, B, P, cap)
  return with_mode(mode, function()
    gp.manual_seed(5)
    local cache = m:new_cache(B, cap or (P + 17), 'bf16', dev)
    local ids = gp.randint(0, 256, {B, P}, {device = dev})
    gp.no_grad(function() m:forward_cached(ids, cache, 0) end)
    local nxt = gp.randint(0, 256, {B, 1}, {device = dev})
    local logits
    if dev == 'cuda' then
      local pos = gp.full({1}, P, {dtype = 'i64', device = dev})
      logits = gp.no_grad(function() return m:forward_cached(nxt, cache, pos) end)
    else -- device positions on the CPU (the plan's reference; decode attention there is the host-position step's)
      local at = {pos = gp.full({1}, P, {dtype = 'i64', device = 'cpu'}),
                  lens = gp.full({B}, P + 1, {dtype = 'i64', device = 'cpu'})}
      logits = gp.no_grad(function()
        if mode then return m.lm_head(m:_body(nxt, nil, cache, at)) end
        return m:forward_cached(nxt, cache, P)
      end)
    end
    return {logits = logits:float():view {B, -1}, cache = cache}
  end)
end

T.test('decode_step: the option reads, toggles and restores', function()
  local prev = gp.decode_step()
  T.eq(gp.decode_step(false), prev)
  T.eq(gp.decode_step(), false)
  T.eq(gp.decode_step('always'), false)
  T.eq(gp.decode_step(), 'always')
  gp.decode_step(prev)
  T.raises(function() gp.decode_step('yes') end, "decode_step: on must be true, false, 'always' or nil")
  local out = T.sh('GPUSH_DECODE_STEP=0 ' .. T.exe .. " --device cpu -e \"print('step=' .. tostring(gp.decode_step()))\"")
  T.ok(out:find('step=false', 1, true), out)
end)

T.test('decode_step: the C reference equals the op-by-op step (logits, keys, values)', function()
  for _, o in ipairs {{B = 1, P = 5}, {B = 3, P = 16}} do
    local m = llama('cpu')
    local a, b = step(m, 'always', 'cpu', o.B, o.P), step(m, false, 'cpu', o.B, o.P)
    T.ok(rawget(a.cache, '_step_plans') ~= nil and rawget(a.cache, '_step_why') == nil, 'the plan ran')
    T.ok(rawget(b.cache, '_step_plans') == nil, 'no plan with the option off')
    T.ok(T.relnorm(a.logits, b.logits) < 1e-2, 'logits, B ' .. o.B)
    for l = 1, 3 do
      T.same(a.cache.k[l]:float():totable(), b.cache.k[l]:float():totable(), 1e-2, 'keys of layer ' .. l)
      T.same(a.cache.v[l]:float():totable(), b.cache.v[l]:float():totable(), 0, 'values of layer ' .. l)
    end
  end
end)

T.test('decode_step: models and caches the kernel does not take run op by op', function()
  -- head dim 32, f32 weights, a compressed cache, more than 8 rows, a sliding window
  local cases = {
    {m = llama('cpu', {d = 128}), B = 1, why = 'head dim 32'},
    {m = llama('cpu', {dtype = 'f32'}), B = 1, why = 'f32'},
    {m = llama('cpu'), B = 9, why = '9 rows'},
  }
  with_mode('always', function()
    for _, c in ipairs(cases) do
      local cache = c.m:new_cache(c.B, 8, 'bf16', 'cpu')
      T.eq(gp.no_grad(function() return c.m:_step_plan(cache, c.B, 'cpu') end), nil, c.why)
    end
    local m = llama('cpu')
    local function plan(mm, c) return gp.no_grad(function() return mm:_step_plan(c, 1, 'cpu') end) end
    T.ok(plan(m, m:new_cache(1, 8, 'bf16', 'cpu')), 'a plan for the plain model')
    T.eq(plan(m, m:new_cache(1, 8, 'bf16', 'cpu', 'int8')), nil, 'int8 cache')
    m.model.layers[2].self_attn.window = 4
    T.eq(plan(m, m:new_cache(1, 8, 'bf16', 'cpu')), nil, 'sliding window')
    gp.decode_step(true)
    local m2 = llama('cpu')
    T.eq(plan(m2, m2:new_cache(1, 8, 'bf16', 'cpu')), nil, 'on: the GPU only')
  end)
end)

T.test('decode_step: bad arguments to the plan are errors naming the op and the shapes', function()
  with_mode('always', function()
    local m = llama('cpu')
    local cache = m:new_cache(2, 8, 'bf16', 'cpu')
    T.eq(m:_step_plan(cache, 2, 'cpu'), nil, 'none while autograd records (the fused weights are not used then)')
    local p = gp.no_grad(function() return m:_step_plan(cache, 2, 'cpu') end)
    T.ok(p, 'a plan')
    local C, rt = gp.C, require 'gpush.core.runtime'
    local function z(shape, dt) return gp.zeros(shape, {dtype = dt or 'bf16', device = 'cpu'}) end
    local function full(shape, v, dt) return gp.full(shape, v, {dtype = dt, device = 'cpu'}) end
    local x, out = z {2, 256}, z {2, 256}
    local pos, lens = full({1}, 3, 'i64'), full({2}, 4, 'i64')
    local inv = m._inv_freq.cpu
    local function run(o, xx, ps, ls, f, s) rt.call(C.gp_decode_plan_run, p.c, o.c, xx.c, ps.c, ls.c, f.c, s) end
    run(out, x, pos, lens, inv, 0.125)
    T.raises(function() run(out, z {3, 256}, pos, lens, inv, 0.125) end,
      'decode_step: x and out must be bf16 with 2 rows of 256')
    T.raises(function() run(out, x, pos, full({2}, 4, 'i32'), inv, 0.125) end, 'decode_step: lens must be i64 (2)')
    T.raises(function() run(out, x, pos, lens, z({7}, 'f32'), 0.125) end, 'decode_step: inv_freq must be f32 (32)')
    T.raises(function() run(out, x, full({1}, 8, 'i64'), lens, inv, 0.125) end,
      "decode_step: position 8 is outside the caches' 8")
    T.raises(function() run(out, x, pos, lens, inv, 0) end, 'decode_step: scale must be > 0')
    -- a plan over mismatched layers
    local l1 = m.model.layers[1]
    local ts = {l1.self_attn._qkv.w, l1.self_attn.o_proj.weight, l1.mlp._gate_up.w, l1.mlp.down_proj.weight,
                l1.input_layernorm.weight, l1.post_attention_layernorm.weight, cache.k[1], cache.v[1]}
    local ffi = require 'ffi'
    local function create(list, norm)
      local arr = ffi.new('const gp_tensor *[?]', #list)
      for i, t in ipairs(list) do arr[i - 1] = t.c end
      rt.call(C.gp_decode_plan_create, ffi.new('gp_decode_plan*[1]'), 1, arr, norm.c, 1e-5)
    end
    local bad = {unpack(ts)}
    bad[2] = z {256, 128}
    T.raises(function() create(bad, m.model.norm.weight) end, 'decode_plan: the shapes do not make a Llama layer')
    bad = {unpack(ts)}
    bad[4] = l1.mlp.down_proj.weight:float()
    T.raises(function() create(bad, m.model.norm.weight) end, "decode_plan: layer 1's wdown is f32; the step is bf16")
    T.raises(function() create(ts, z {128}) end,
      "decode_plan: the final norm's weight must be a contiguous bf16 (256)")
  end)
end)

-- the GPU: kernel against the op-by-op step, eager and replayed
local function gpu_case(o)
  local m = llama('cuda', o)
  local a, b = step(m, 'always', 'cuda', o.B, o.P, o.cap), step(m, false, 'cuda', o.B, o.P, o.cap)
  local what = string.format('d %d, H %d, J %d, B %d, P %d', o.d or 256, o.H or 4, o.J or 2, o.B, o.P)
  T.ok(rawget(a.cache, '_step_why') == nil, 'plan: ' .. tostring(rawget(a.cache, '_step_why')))
  T.ok(rawget(a.cache, '_step_plans') ~= nil, 'the kernel ran: ' .. what)
  local e = T.relnorm(a.logits:cpu(), b.logits:cpu())
  T.ok(e < 2e-2, what .. ': logits off by ' .. e)
  for l = 1, #m.model.layers do
    local ka, kb = a.cache.k[l]:narrow(3, o.P + 1, 1):float():cpu(), b.cache.k[l]:narrow(3, o.P + 1, 1):float():cpu()
    T.ok(T.relnorm(ka, kb) < 2e-2, what .. ': the new keys of layer ' .. l)
  end
end

T.test('decode_step: the kernel equals the op-by-op step on the GPU (head dims 64 and 128, rows 1 to 8)', function()
  T.cuda()
  gpu_case {B = 1, P = 16}
  gpu_case {B = 5, P = 40}
  gpu_case {B = 8, P = 7, d = 512, H = 4, J = 1, I = 1024} -- head dim 128
  gpu_case {B = 2, P = 100, d = 576, H = 9, J = 3, I = 1536, layers = 2} -- SmolLM2's widths
end)

T.test('decode_step: long caches (chunks of a head merged) equal the op-by-op step', function()
  T.cuda()
  gpu_case {B = 1, P = 1500, cap = 2048}
  gpu_case {B = 3, P = 777, cap = 1024, d = 512, H = 4, J = 2}
end)

T.test('decode_step: by default up to 4 rows take the kernel, more run op by op', function()
  T.cuda()
  local m = llama('cuda')
  with_mode(true, function()
    local function plan(B) return gp.no_grad(function() return m:_step_plan(m:new_cache(B, 8, 'bf16', 'cuda'), B, 'cuda') end) end
    T.ok(plan(1) and plan(4), 'rows 1 and 4: the kernel')
    T.eq(plan(5), nil, 'row 5: op by op')
  end)
end)

T.test('decode_step: a captured step replays what the eager kernel computes; generate greedy is unchanged', function()
  T.cuda()
  local m = llama('cuda')
  with_mode(true, function()
    gp.manual_seed(5)
    local cache = m:new_cache(2, 40, 'bf16', 'cuda')
    gp.no_grad(function() m:forward_cached(gp.randint(0, 256, {2, 20}, {device = 'cuda'}), cache, 0) end)
    local pos = gp.full({1}, 20, {dtype = 'i64', device = 'cuda'})
    local nxt = gp.full({2, 1}, 9, {dtype = 'i64', device = 'cuda'})
    local function f() return gp.no_grad(function() return m:forward_cached(nxt, cache, pos) end) end
    local eager = f():float():totable()
    local g = gp.graph(f)
    for i = 1, 3 do T.same(g:replay():float():totable(), eager, 0, 'replay ' .. i) end
    g:free()
    local prompts = {{1, 2, 3, 4}, {9, 8, 7, 6}}
    local on = gp.generate(m, prompts, {max_new = 24, greedy = true})
    gp.decode_step(false)
    local off = gp.generate(m, prompts, {max_new = 24, greedy = true})
    T.eq(on.graph, true)
    local same = 0
    for r = 1, 2 do
      local a, b = on.lists[r], off.lists[r]
      local n = 0
      while n < #a and a[n + 1] == b[n + 1] do n = n + 1 end
      same = same + n
    end
    T.ok(same >= 40, 'greedy tokens agree for ' .. same .. ' of 48')
  end)
end)
