-- Rotary position embeddings: gp.rope against a rotation written out in Lua,
-- its gradient, and the frequencies with the llama3 and linear scalings.
local T = require 'lib'
local cpu = {dtype = 'f64', device = 'cpu'}

T.test('rope: each head turned by pos * inv_freq in the planes (i, i + D/2)', function()
  local x = gp.randn({2, 3, 2, 6}, cpu) -- (B, T, H, D)
  local f = gp.tensor({0.5, 0.1, 0.01}, cpu)
  local y = gp.rope(x, 4, f)
  local xs, ys, fs = x:totable(), y:totable(), f:totable()
  for b = 1, 2 do for t = 1, 3 do for h = 1, 2 do
    for i = 1, 3 do
      local th = (4 + t - 1) * fs[i]
      local a, c = xs[b][t][h][i], xs[b][t][h][i + 3]
      T.near(ys[b][t][h][i], a * math.cos(th) - c * math.sin(th), 1e-6)
      T.near(ys[b][t][h][i + 3], c * math.cos(th) + a * math.sin(th), 1e-6)
    end
  end end end
  -- positions as a tensor, and the rotation back (sign -1) restores x
  local pos = gp.tensor({4, 5, 6}, {dtype = 'i64', device = 'cpu'})
  T.ok(T.relnorm(gp.rope(x, pos, f), y) < 1e-12)
  local back = gp.empty({2, 3, 2, 6}, cpu)
  gp.k.rope(back, y, pos, f:float(), -1)
  T.ok(T.relnorm(back, x) < 1e-6)
end)

T.test('rope: strided heads (a view of a qkv buffer) and the gradient in double', function()
  local qkv = gp.randn({2, 5, 3 * 8}, cpu)
  local q = qkv:narrow(3, 1, 8):view {2, 5, 2, 4}
  local f = gp.rope_inv_freq(4, {theta = 100, device = 'cpu'}):double()
  -- read where it lies: no copy of the view (two per layer of a Llama: q and k of its q/k/v product)
  local f32 = f:float()
  local y, n = T.launches(function() return gp.rope(q, 0, f32) end)
  T.eq(n.copy, 0, 'copies')
  T.eq(n.rope, 1)
  T.ok(T.relnorm(y, gp.rope(q:contiguous(), 0, f)) < 1e-12)
  gp.gradcheck(function(x) return gp.rope(x, 2, f) end, {gp.randn({1, 4, 3, 4}, cpu)})
  -- the gradient through a strided view of a larger tensor (only its columns get one)
  gp.gradcheck(function(x) return gp.rope(x:narrow(3, 3, 8):view {1, 4, 2, 4}, 2, f) end, {gp.randn({1, 4, 12}, cpu)})
  -- an f32 view with a stride 2 on the last dim is copied first (the kernel needs stride 1 there)
  local odd = gp.randn({2, 5, 2, 4, 2}, {device = 'cpu'}):select(5, 1)
  T.ok(T.relnorm(gp.rope(odd, 1, f:float()), gp.rope(odd:contiguous(), 1, f:float())) < 1e-6)
end)

T.test('rope: strided heads on the GPU equal the CPU (bf16, f32), forward and gradient', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16'} do
    local f = gp.rope_inv_freq(32, {device = 'cpu'})
    T.cuda_matches_cpu(function(x, dev) return gp.rope(x:narrow(3, 65, 64):view {2, 7, 2, 32}, 3, f:to(dev)) end,
      gp.randn({2, 7, 3 * 64}, {device = 'cpu'}):to(dt), dt == 'bf16' and 1e-2 or 1e-5, dt)
  end
end)

T.test('rope_inv_freq: plain, linear and llama3 scaling (the values of transformers\' formulas)', function()
  local f = gp.rope_inv_freq(8, {theta = 10000}):totable()
  T.same(f, {1, 0.1, 0.01, 0.001}, 1e-6)
  T.same(gp.rope_inv_freq(8, {theta = 10000, scaling = {type = 'linear', factor = 4}}):totable(), {0.25, 0.025, 0.0025, 0.00025}, 1e-6)
  local l3 = gp.rope_inv_freq(16, {theta = 500000, scaling = {rope_type = 'llama3', factor = 8, low_freq_factor = 1,
    high_freq_factor = 4, original_max_position_embeddings = 16}}):totable()
  T.same(l3, {0.576056401, 0.0242403431, 0.00470075387, 0.000911583092, 0.000176776695, 3.4281022e-05, 6.64786987e-06,
              1.28917317e-06}, 1e-6)
  T.raises(function() gp.rope_inv_freq(8, {scaling = {type = 'yarn', factor = 2}}) end, 'rope_inv_freq', 'yarn', 'not supported')
  T.raises(function() gp.rope_inv_freq(7) end, 'rope_inv_freq', 'even')
end)

T.test('rope: bad input names the op and the shapes', function()
  local f = gp.rope_inv_freq(8)
  T.raises(function() gp.rope(gp.randn {3, 8}, 0, f) end, 'rope', '(3,8)')
  T.raises(function() gp.rope(gp.randn {1, 2, 3, 6}, 0, f) end, 'rope', '(1,2,3,6)', 'twice')
  T.raises(function() gp.rope(gp.randn {1, 2, 3, 8}, -1, f) end, 'rope', 'start position')
end)
