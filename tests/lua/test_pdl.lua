-- Chains of dependent launches (gp.pdl, src/cuda.cu): the decode step's
-- kernels start while the kernel before them finishes (programmatic
-- dependent launch, compute capability 9.0). On the CPU: the option, its
-- validation, the environment switch and the stats. On a GPU: a Llama
-- decode step, eager and as a captured graph, equals the step without
-- chains bit for bit, and on a GPU that has them the chains were used; a
-- weight written by a kernel of the chain is not read before that kernel
-- finishes (rows_linear is then launched the usual way).
local T = require 'lib'
local gp = require 'gpush'

T.test('pdl: the option reads, toggles and restores; stats have their fields', function()
  local prev = gp.pdl()
  T.eq(type(prev), 'boolean')
  T.eq(gp.pdl(false), prev)
  T.eq(gp.pdl(), false)
  T.eq(gp.pdl(true), false)
  T.eq(gp.pdl(), true)
  gp.pdl(prev)
  local s = gp.pdl_stats()
  T.eq(type(s.chained), 'number')
  T.eq(type(s.plain), 'number')
  T.eq(type(s.on), 'boolean')
  T.eq(type(s.supported), 'boolean')
  if not gp.cuda_available() then T.eq(s.supported, false, 'no GPU, no chains') end
  gp.pdl_stats(true)
  s = gp.pdl_stats()
  T.eq(s.chained, 0)
  T.eq(s.plain, 0)
  T.raises(function() gp.pdl('yes') end, 'pdl: on must be true, false or nil')
  T.eq(gp.C.gp_pdl_option(3, nil), 1)
  T.ok(require('ffi').string(gp.C.gp_last_error()):find('pdl: the option must be 0 or 1', 1, true))
  T.eq(gp.pdl(), prev, 'unchanged by the refused values')
end)

T.test('pdl: GPUSH_PDL=0 turns it off', function()
  local out = T.sh('GPUSH_PDL=0 ' .. T.exe .. " --device cpu -e \"print('pdl=' .. tostring(gp.pdl()))\"")
  T.ok(out:find('pdl=false', 1, true), out)
end)

-- a small Llama (head dim 64, grouped-query heads) on the GPU in bf16
local function llama()
  gp.manual_seed(3)
  local cfg = {vocab_size = 256, hidden_size = 128, intermediate_size = 256, num_hidden_layers = 3,
               num_attention_heads = 2, num_key_value_heads = 1, max_position_embeddings = 64, model_type = 'llama'}
  return gp.models.Llama(cfg, {dtype = 'bf16', device = 'cuda'}):eval()
end

-- one decode step after 16 cached positions, with chains on or off: eager
-- logits, the logits of three graph replays, and the chain counts of each
local function step(m, on)
  local prev, prev_step = gp.pdl(on), gp.decode_step(false) -- the op-by-op step (its chains)
  local ok, r = pcall(function()
    gp.manual_seed(5)
    local cache = m:new_cache(1, 33, 'bf16', 'cuda')
    local ids = gp.randint(0, 256, {1, 16}, {device = 'cuda'})
    gp.no_grad(function() m:forward_cached(ids, cache, 0) end)
    local pos = gp.full({1}, 16, {dtype = 'i64', device = 'cuda'})
    local nxt = gp.full({1, 1}, 7, {dtype = 'i64', device = 'cuda'})
    local function f() return gp.no_grad(function() return m:forward_cached(nxt, cache, pos) end) end
    gp.pdl_stats(true)
    local eager = f():float():totable()
    local se = gp.pdl_stats(true)
    local g = gp.graph(f)
    local sg = gp.pdl_stats(true)
    local reps = {}
    for i = 1, 3 do reps[i] = g:replay():float():totable() end
    g:free()
    return {eager = eager, reps = reps, se = se, sg = sg}
  end)
  gp.pdl(prev)
  gp.decode_step(prev_step)
  if not ok then error(r, 0) end
  return r
end

T.test('pdl: a Llama decode step with chains equals the step without, eager and as a graph', function()
  T.cuda()
  local m = llama()
  local on, off = step(m, true), step(m, false)
  T.same(on.eager, off.eager, 0, 'eager')
  for i = 1, 3 do
    T.same(on.reps[i], off.eager, 0, 'replay ' .. i .. ' (chains on)')
    T.same(off.reps[i], off.eager, 0, 'replay ' .. i .. ' (chains off)')
  end
  T.eq(off.se.chained + off.sg.chained, 0, 'no chained launch with chains off')
  if gp.pdl_stats().supported then
    -- every layer: add_rms_norm (the first layer: rms_norm, not a chain kernel), q/k/v (rows_linear), rope_kv_at,
    -- attn_decode, o (rows_linear), add_rms_norm, gate/up (rows_linear), swiglu_linear
    T.ok(on.se.chained >= 3 * 6, 'eager chained launches: ' .. on.se.chained)
    T.ok(on.sg.chained >= 3 * 6, 'captured chained launches: ' .. on.sg.chained)
  end
end)

T.test('pdl: a weight the chain wrote is read after the kernel that wrote it; a parameter before', function()
  T.cuda()
  local prev = gp.pdl(true)
  local ok, err = pcall(function()
    gp.manual_seed(11)
    local x, r = gp.randn({8, 256}, {dtype = 'bf16'}), gp.randn({8, 256}, {dtype = 'bf16'})
    local W = gp.randn({64, 256}, {dtype = 'bf16'})
    for trial = 1, 10 do
      local h = gp.randn({1, 256}, {dtype = 'bf16'})
      gp.pdl_stats(true)
      local w = gp.add_rms_norm(x, r) -- written by the chain's first kernel ...
      local y = gp.linear(h, w)        -- ... then w of rows_linear, whose loads of w come before its wait
      local s1 = gp.pdl_stats(true)
      local n = gp.add_rms_norm(x, r)
      local z = gp.linear(n:narrow(1, 1, 1), W) -- a parameter: read before the wait
      local s2 = gp.pdl_stats(true)
      local want = gp.linear(h:to('cpu'):float(), w:to('cpu'):float())
      T.ok(T.relnorm(y:to('cpu'):float(), want) < 1e-2, 'trial ' .. trial)
      local wz = gp.linear(n:narrow(1, 1, 1):to('cpu'):float(), W:to('cpu'):float())
      T.ok(T.relnorm(z:to('cpu'):float(), wz) < 1e-2, 'trial ' .. trial)
      if s1.supported then
        T.eq(s1.chained, 0, 'rows_linear over a weight the chain wrote: launched the usual way')
        T.eq(s2.chained, 1, 'rows_linear over a parameter: chained')
      end
    end
  end)
  gp.pdl(prev)
  if not ok then error(err, 0) end
end)

T.test('pdl: a decode step over NF4 projections (the GEMV loads its codes before the wait) equals the step without', function()
  T.cuda()
  local m = llama()
  gp.nn.quantize_linears(m, {kind = 'nf4', block = 64})
  local on, off = step(m, true), step(m, false)
  T.same(on.eager, off.eager, 0, 'eager')
  for i = 1, 3 do T.same(on.reps[i], off.eager, 0, 'replay ' .. i) end
  if gp.pdl_stats().supported then
    T.ok(on.se.chained >= 3 * 4, 'eager chained launches: ' .. on.se.chained)
    T.ok(on.sg.chained >= 3 * 4, 'captured chained launches: ' .. on.sg.chained)
  end
end)
