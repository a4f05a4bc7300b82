-- Fused ops against their unfused compositions, SwiGLU backward against
-- finite differences (f64, CPU), errors, CUDA sizes with tails.
local T = require 'lib'
local gp = require 'gpush'
local fd = require 'fd'

T.test('swiglu, add_rms_norm, bias_gelu match their compositions', function()
  local g, u = gp.randn({5, 13}, {device = 'cpu'}), gp.randn({5, 13}, {device = 'cpu'})
  T.ok(T.relnorm(gp.swiglu(g, u), g:silu() * u) < 1e-6)
  local w = gp.randn({13}, {device = 'cpu'})
  local out, res_out, rstd = gp.add_rms_norm(g, u, w, 1e-5)
  T.ok(T.relnorm(res_out, g + u) < 1e-7)
  local ref, rref = gp.rms_norm(g + u, w, 1e-5)
  T.ok(T.relnorm(out, ref) < 1e-6)
  T.ok(T.relnorm(rstd, rref) < 1e-6)
  local b = gp.randn({13}, {device = 'cpu'})
  T.ok(T.relnorm(gp.bias_gelu(g, b), (g + b):gelu()) < 1e-6)
  -- non-contiguous gate/up
  local gt, ut = g:t(), u:t()
  T.ok(T.relnorm(gp.swiglu(gt, ut), gt:silu() * ut) < 1e-6)
end)

T.test('swiglu backward: finite differences', function()
  local g, u, dout = fd.randn {4, 5}, fd.randn {4, 5}, fd.randn {4, 5}
  local dg, du = gp.empty({4, 5}, {dtype = 'f64', device = 'cpu'}), gp.empty({4, 5}, {dtype = 'f64', device = 'cpu'})
  gp.k.swiglu_backward(dg, du, g, u, dout)
  local f = function(a, b) return gp.swiglu(a, b) end
  fd.check('swiglu dgate', dg, fd.grad(f, {g, u}, 1, dout), 1e-7)
  fd.check('swiglu dup', du, fd.grad(f, {g, u}, 2, dout), 1e-7)
end)

T.test('fused errors name the op and the shapes', function()
  local a = gp.randn({3, 4}, {device = 'cpu'})
  T.raises(function() gp.swiglu(a, gp.randn({3, 5}, {device = 'cpu'})) end, 'swiglu', '(3,5)', '(3,4)')
  T.raises(function() gp.swiglu(a, 2) end, 'swiglu', 'up must be a tensor')
  T.raises(function() gp.add_rms_norm(a, gp.randn({4, 3}, {device = 'cpu'})) end, 'add_rms_norm', '(4,3)')
  T.raises(function() gp.add_rms_norm(a, a, gp.ones({5}, {device = 'cpu'})) end, 'add_rms_norm', 'w', '(5)')
  T.raises(function() gp.bias_gelu(a, gp.ones({3}, {device = 'cpu'})) end, 'bias_gelu', 'b', '(3)', '(3,4)')
  T.raises(function() gp.k.swiglu_backward(a, a, a, a:t(), a) end, 'swiglu_backward')
  T.cuda()
  T.raises(function() gp.swiglu(a:cuda(), a) end, 'swiglu', 'cpu', 'cuda')
end)

T.test('cuda swiglu forward/backward with tails and unaligned starts', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16'} do
    local tol = dt == 'f32' and 1e-5 or 1e-2
    for _, n in ipairs {1, 7, 1000003} do
      for _, off in ipairs {0, 1} do
        local function mk() return gp.randn({n + 1}, {device = 'cpu'}):to(dt):narrow(1, 1 + off, n):contiguous() end
        local g, u, d = mk(), mk(), mk()
        local gg, ug, dg = g:cuda(), u:cuda(), d:cuda()
        T.ok(T.relnorm(gp.swiglu(gg, ug), gp.swiglu(g, u)) <= tol, 'swiglu ' .. dt .. ' ' .. n)
        local base = gp.empty({n + 1}, {dtype = dt}):narrow(1, 1 + off, n) -- unaligned outputs on the GPU
        local a1, a2 = gp.empty({n}, {dtype = dt, device = 'cpu'}), gp.empty({n}, {dtype = dt, device = 'cpu'})
        gp.k.swiglu_backward(a1, a2, g, u, d)
        local b2 = gp.empty({n}, {dtype = dt})
        gp.k.swiglu_backward(base, b2, gg, ug, dg)
        T.ok(T.relnorm(base, a1) <= tol and T.relnorm(b2, a2) <= tol, 'swiglu_backward ' .. dt .. ' ' .. n)
      end
    end
  end
end)
