-- gp.matmul_option('tune', 1): cuBLASLt algorithms chosen by timing and cached
-- per product key (kernels/matmul.cu). On the CPU: the option, its
-- validation, the environment switch, the stats and the benchmark's quick
-- mode. On a GPU: tuned products of every dtype and layout (plain, batched,
-- transposed, accumulating, bias and GELU epilogues) equal the untuned ones
-- and the CPU reference; a repeated key is a hit; inside gp.graph capture a
-- miss runs untuned and is not stored, a hit uses the stored algorithm;
-- tuning leaves no device memory held.
local T = require 'lib'
local gp = require 'gpush'

local function cpu(shape, dtype) return gp.randn(shape, {dtype = dtype or 'f32', device = 'cpu'}) end
local ENV_ON = os.getenv('GPUSH_MATMUL_TUNE') == '1'

-- f() with the tune option set to v, restored after (also on error)
local function with_tune(v, f)
  local prev = gp.matmul_option('tune', v)
  local r = {pcall(f)}
  gp.matmul_option('tune', prev)
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2)
end

T.test('matmul tune: the option reads, toggles and restores; stats and clear exist', function()
  T.eq(gp.matmul_option('tune', -1), ENV_ON and 1 or 0)
  T.eq(gp.matmul_option('tune'), ENV_ON and 1 or 0, 'nil only reads')
  local prev = gp.matmul_option('tune', 1)
  T.eq(gp.matmul_option('tune', -1), 1)
  T.eq(gp.matmul_option('tune', 0), 1)
  T.eq(gp.matmul_option('tune', -1), 0)
  gp.matmul_option('tune', prev)
  local s = gp.matmul_tune_stats()
  for _, k in ipairs {'entries', 'hits', 'misses', 'uncached', 'tuned_ms'} do
    T.eq(type(s[k]), 'number', k)
    T.ok(s[k] >= 0, k)
  end
  gp.matmul_tune_clear()
  s = gp.matmul_tune_stats()
  T.eq(s.entries, 0)
  T.eq(s.hits, 0)
  T.eq(s.misses, 0)
  T.eq(s.tuned_ms, 0)
end)

T.test('matmul tune: values other than 0 and 1 are an error naming the op; the option is unchanged', function()
  local before = gp.matmul_option('tune', -1)
  for _, v in ipairs {2, -2, 0.5, 'yes', true} do
    T.raises(function() gp.matmul_option('tune', v) end, 'matmul_option: tune must be 0 or 1', tostring(v))
  end
  T.raises(function() gp.matmul_option('gemv', 3) end, 'matmul_option: gemv must be 0 or 1')
  T.eq(gp.matmul_option('tune', -1), before)
  -- the C entry checks too
  T.eq(gp.C.gp_matmul_option('tune', 7, nil), 1)
  T.ok(require('ffi').string(gp.C.gp_last_error()):find('matmul_option: tune must be 0 or 1', 1, true))
  T.eq(gp.matmul_option('tune', -1), before)
end)

T.test('matmul tune: GPUSH_MATMUL_TUNE=1 turns it on, 0 leaves it off', function()
  local exe = T.exe .. ' --device cpu'
  local out, rc = T.sh('GPUSH_MATMUL_TUNE=1 ' .. exe .. " -e \"print('tune=' .. gp.matmul_option('tune'))\"")
  T.eq(rc, 0, out)
  T.ok(out:find('tune=1', 1, true), out)
  out, rc = T.sh('GPUSH_MATMUL_TUNE=0 ' .. exe .. " -e \"print('tune=' .. gp.matmul_option('tune'))\"")
  T.eq(rc, 0, out)
  T.ok(out:find('tune=0', 1, true), out)
end)

T.test('matmul tune: CPU products are unchanged and never counted', function()
  local a, b, bias = cpu {7, 9}, cpu {9, 5}, cpu {5}
  local ref, refb = a:matmul(b), gp.matmul(a, b, {bias = bias, act = 'gelu_tanh'})
  gp.matmul_tune_clear()
  with_tune(1, function()
    T.same(a:matmul(b):totable(), ref:totable(), 0)
    T.same(gp.matmul(a, b, {bias = bias, act = 'gelu_tanh'}):totable(), refb:totable(), 0)
  end)
  local s = gp.matmul_tune_stats()
  T.eq(s.entries + s.hits + s.misses + s.uncached, 0)
end)

T.test('scripts/bench/matmul_tune.lua --quick runs on the CPU', function()
  local out, rc = T.sh(T.exe .. ' --device cpu ' .. (GPUSH_ROOT or '.') .. '/scripts/bench/matmul_tune.lua --quick')
  T.eq(rc, 0, out)
  for _, s in ipairs {'tuning applies to cuda', 'x @ Wqkv', 'dW head', 'largest'} do
    T.ok(out:find(s, 1, true), s .. ' in\n' .. out)
  end
end)

---------------------------------------------------------------------------
-- CUDA

local TOL = {f32 = 1e-5, bf16 = 1e-2, f16 = 2e-3}

-- f(inputs on the device) tuned, untuned and on the CPU: each GPU result
-- within tol of the CPU's, the tuned within tol of the untuned
local function tuned_vs(name, inputs, f, tol)
  local moved = {}
  for k, v in pairs(inputs) do moved[k] = gp.is_tensor(v) and v:cuda() or v end
  local r_cpu = f('cpu', inputs)
  local r_off = with_tune(0, function() return f('cuda', moved):cpu() end)
  local r_on = with_tune(1, function() return f('cuda', moved):cpu() end)
  local r_hit = with_tune(1, function() return f('cuda', moved):cpu() end) -- the stored algorithm
  for what, r in pairs {untuned = r_off, tuned = r_on, hit = r_hit} do
    local e = T.relnorm(r, r_cpu)
    if not (e <= tol) then error(string.format('%s %s: cuda vs cpu relative norm %g > %g', name, what, e, tol), 0) end
  end
  local e = T.relnorm(r_on, r_off)
  if not (e <= tol) then error(string.format('%s: tuned vs untuned relative norm %g > %g', name, e, tol), 0) end
end

T.test('matmul tune cuda: every dtype, layout and epilogue equals the untuned product', function()
  T.cuda()
  gp.matmul_tune_clear()
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    local I = {a = cpu({64, 96}, dt), b = cpu({96, 40}, dt), x = cpu({3, 64, 96}, dt), y = cpu({3, 96, 40}, dt),
               w = cpu({64, 104}, dt), bias = cpu({40}, dt), out = cpu({64, 40}, dt), aux = cpu({64, 40}, dt),
               o = cpu({33, 17}, dt), p = cpu({33, 65}, dt), q = cpu({65, 17}, dt), xa = cpu({3, 64, 40}, dt)}
    local function mk(d, s) return gp.empty(s, {dtype = dt, device = d}) end
    local cases = {
      plain = function(_, t) return t.a:matmul(t.b) end,
      odd = function(_, t) return t.p:matmul(t.q) end,
      trans_a = function(_, t) return gp.matmul(t.a:t():contiguous(), t.b, {trans_a = true}) end,
      trans_b = function(_, t) return gp.matmul(t.a, t.b:t():contiguous(), {trans_b = true}) end,
      both_t = function(_, t) return t.a:t():contiguous():t():matmul(t.b:t():contiguous():t()) end,
      ld = function(_, t) return t.w:narrow(2, 3, 96):matmul(t.b) end,
      batched = function(_, t) return t.x:matmul(t.y) end,
      batched_t = function(_, t) return t.x:transpose(2, 3):contiguous():transpose(2, 3):matmul(t.y) end,
      bcast_b = function(_, t) return t.x:transpose(2, 3):contiguous():transpose(2, 3):matmul(t.b) end,
      bcast_a = function(_, t) return gp.matmul(t.a, t.y) end,
      flat_rows = function(_, t) return t.x:matmul(t.b) end,
      accum = function(_, t) local o = t.out:clone(); return gp.matmul(t.a, t.b, {out = o, alpha = 1.5, beta = -0.5}) end,
      accum_odd = function(_, t) local o = t.o:clone(); return gp.matmul(t.p, t.q, {out = o, beta = 1}) end,
      accum_batched = function(_, t) local o = t.xa:clone(); return gp.matmul(t.x, t.y, {out = o, beta = 2}) end,
      out_t = function(d, t) local o = mk(d, {40, 64}):zero_():t(); return gp.matmul(t.a, t.b, {out = o}) end,
      bias = function(_, t) return gp.matmul(t.a, t.b, {bias = t.bias}) end,
      bias_accum = function(_, t) local o = t.out:clone(); return gp.matmul(t.a, t.b, {bias = t.bias, out = o, alpha = 2, beta = 1}) end,
      bias_batched = function(_, t) return gp.matmul(t.x, t.y, {bias = t.bias}) end,
      gelu = function(_, t) return gp.matmul(t.a, t.b, {bias = t.bias, act = 'gelu_tanh'}) end,
      gelu_batched_t = function(_, t) return gp.matmul(t.x, t.y:transpose(2, 3):contiguous():transpose(2, 3), {bias = t.bias, act = 'gelu_tanh'}) end,
      gelu_aux = function(d, t)
        local o, x = mk(d, {64, 40}), mk(d, {64, 40})
        gp.k.matmul_bias_gelu_aux(o, x, t.a, t.b, t.bias)
        return gp.cat({o, x}, 1)
      end,
      dgelu = function(d, t) local o = mk(d, {64, 40}); gp.k.matmul_dgelu(o, t.a, t.b, t.aux); return o end,
      dgelu_in_place = function(_, t) local x = t.aux:clone(); gp.k.matmul_dgelu(x, t.a, t.b, x); return x end,
      linear = function(_, t) return gp.linear(t.x, t.b:t(), t.bias) end,
    }
    for name, f in pairs(cases) do tuned_vs(dt .. ' ' .. name, I, f, TOL[dt]) end
  end
  -- TF32 compute is part of the key: an f32 product tuned with and without it
  local I = {a = cpu {200, 300}, b = cpu {300, 152}}
  tuned_vs('tf32', I, function(_, t) return gp.matmul(t.a, t.b, {tf32 = true}) end, 3e-3)
  local s = gp.matmul_tune_stats()
  T.ok(s.misses > 20, 'misses ' .. s.misses)
  T.ok(s.hits >= s.misses, 'every case ran again as a hit: hits ' .. s.hits .. ', misses ' .. s.misses)
  T.eq(s.entries, s.misses)
  T.eq(s.uncached, 0)
  T.ok(s.tuned_ms > 0)
end)

T.test('matmul tune cuda: a repeated key is a hit; beta, alignment and shape make new keys', function()
  T.cuda()
  gp.matmul_tune_clear()
  with_tune(1, function()
    local a = gp.randn({128, 256}, {dtype = 'bf16', device = 'cuda'})
    local b = gp.randn({256, 64}, {dtype = 'bf16', device = 'cuda'})
    local ref = with_tune(0, function() return a:matmul(b) end)
    local r1 = a:matmul(b)
    local s = gp.matmul_tune_stats()
    T.eq(s.misses, 1)
    T.eq(s.hits, 0)
    T.eq(s.entries, 1)
    for _ = 1, 3 do
      local r = a:matmul(b)
      T.ok(T.relnorm(r, ref) < 1e-2)
    end
    T.ok(T.relnorm(r1, ref) < 1e-2)
    s = gp.matmul_tune_stats()
    T.eq(s.misses, 1)
    T.eq(s.hits, 3)
    T.eq(s.entries, 1)
    -- beta != 0: another key
    local o = gp.zeros({128, 64}, {dtype = 'bf16', device = 'cuda'})
    gp.matmul(a, b, {out = o, beta = 1})
    gp.matmul(a, b, {out = o, beta = 1})
    T.ok(T.relnorm(o, ref * 2) < 1e-2)
    s = gp.matmul_tune_stats()
    T.eq(s.entries, 2)
    T.eq(s.hits, 4)
    -- an operand at a 2-byte offset: another alignment, another key
    local wide = gp.randn({128, 264}, {dtype = 'bf16', device = 'cuda'})
    local an = wide:narrow(2, 2, 256)
    local rn = an:matmul(b)
    T.ok(T.relnorm(rn, with_tune(0, function() return an:matmul(b) end)) < 1e-2)
    s = gp.matmul_tune_stats()
    T.eq(s.entries, 3)
    -- another shape
    local _ = a:narrow(1, 1, 96):matmul(b)
    T.eq(gp.matmul_tune_stats().entries, 4)
  end)
  -- tune off: nothing counted
  local before = gp.matmul_tune_stats()
  with_tune(0, function() local _ = gp.randn({64, 64}, {device = 'cuda'}):matmul(gp.randn({64, 64}, {device = 'cuda'})) end)
  local after = gp.matmul_tune_stats()
  T.eq(after.hits + after.misses, before.hits + before.misses)
  gp.matmul_tune_clear()
  T.eq(gp.matmul_tune_stats().entries, 0)
end)

T.test('matmul tune cuda: inside gp.graph a miss runs untuned and is not stored; after a warm-up the stored algorithm is captured', function()
  T.cuda()
  gp.matmul_tune_clear()
  with_tune(1, function()
    local x = gp.randn({96, 128}, {dtype = 'bf16', device = 'cuda'})
    local w = gp.randn({80, 128}, {dtype = 'bf16', device = 'cuda'})
    local bias = gp.randn({80}, {dtype = 'bf16', device = 'cuda'})
    local function f() return gp.matmul(x, w:t()), gp.linear(x, w, bias) end
    local want1, want2 = with_tune(0, f)
    -- no warm-up: both products miss during the capture
    local g = gp.graph(f)
    local s = gp.matmul_tune_stats()
    T.eq(s.uncached, 2)
    T.eq(s.entries, 0)
    T.eq(s.misses, 0)
    g:replay()
    T.ok(T.relnorm(g.outputs[1], want1) < 1e-2, 'captured miss, plain')
    T.ok(T.relnorm(g.outputs[2], want2) < 1e-2, 'captured miss, bias')
    -- eager: tuned and stored
    local e1, e2 = f()
    T.ok(T.relnorm(e1, want1) < 1e-2)
    T.ok(T.relnorm(e2, want2) < 1e-2)
    s = gp.matmul_tune_stats()
    T.eq(s.misses, 2)
    T.eq(s.entries, 2)
    -- a capture after the warm-up finds both
    local g2 = gp.graph(f)
    s = gp.matmul_tune_stats()
    T.eq(s.hits, 2)
    T.eq(s.uncached, 2)
    x:copy_(gp.randn({96, 128}, {dtype = 'bf16', device = 'cuda'}))
    local n1, n2 = with_tune(0, f)
    for _ = 1, 2 do
      g2:replay()
      T.ok(T.relnorm(g2.outputs[1], n1) < 1e-2, 'captured hit, plain')
      T.ok(T.relnorm(g2.outputs[2], n2) < 1e-2, 'captured hit, bias')
    end
    g:free()
    g2:free()
  end)
  gp.matmul_tune_clear()
end)

T.test('matmul tune cuda: tuning holds no device memory after the product', function()
  T.cuda()
  gp.matmul_tune_clear()
  local a = gp.randn({512, 384}, {dtype = 'bf16', device = 'cuda'})
  local b = gp.randn({384, 256}, {dtype = 'bf16', device = 'cuda'})
  local o = gp.zeros({512, 256}, {dtype = 'bf16', device = 'cuda'})
  gp.k.matmul(o, a, b, 1, 1) -- handles and workspace made
  gp.sync()
  local before = gp.memory().in_use
  with_tune(1, function()
    gp.k.matmul(o, a, b, 1, 1) -- a miss: scratch output for the candidates
    gp.k.matmul(o, a, b, 1, 0)
  end)
  gp.sync()
  T.eq(gp.memory().in_use, before)
  T.eq(gp.matmul_tune_stats().misses, 2)
  gp.matmul_tune_clear()
end)
