-- 04_gradient.lua: a hand-written gradient with gp.k kernels, checked against
-- central finite differences in f64 on the CPU.
--   f(x) = sum(tanh(x)^2),  df/dx = 2 tanh(x) (1 - tanh(x)^2)
local function sum(t) local s = 0; for _, v in ipairs(t:contiguous():view{t:numel()}:totable()) do s = s + v end; return s end

local function f(x) local t = x:tanh(); return sum(t * t) end
local function grad(x)
  local t = x:tanh()
  return t * 2 * (1 - t * t)                 -- 1 - t*t uses the scalar kernel rsub_s
end

gp.manual_seed(0)
local x = gp.randn({6}, {dtype = 'f64', device = 'cpu'})
local g = grad(x):totable()
local eps, worst = 1e-6, 0
for i = 1, 6 do
  local xp, xm = x:clone(), x:clone()
  xp:narrow(1, i, 1):add_(eps)
  xm:narrow(1, i, 1):add_(-eps)
  local fd = (f(xp) - f(xm)) / (2 * eps)
  worst = math.max(worst, math.abs(fd - g[i]))
  print(string.format('x=%8.4f  analytic %10.6f  finite difference %10.6f', x:totable()[i], g[i], fd))
end
print(string.format('largest difference %.2e', worst))
assert(worst < 1e-6, 'the gradient does not match')

-- the same gradient on the default device (the GPU when there is one)
local xd = x:float():to(gp.device())
print('on ' .. gp.device() .. ':', grad(xd))
