-- 05_mlp.lua: a tiny MLP (1 -> 16 -> 1, tanh) fit to sin(x) with hand-written
-- gradients. There is no matmul here: with one input and one output the
-- layers are broadcasts, and sums over a dim are halvings of narrow views.
local function sum_dim(t, d)                  -- sum over dim d, keeping it with size 1
  while t:size(d) > 1 do
    local n = t:size(d)
    local h = math.floor(n / 2)
    local s = t:narrow(d, 1, h) + t:narrow(d, h + 1, h)
    if n % 2 == 1 then s = s + t:narrow(d, n, 1) end
    t = s
  end
  return t
end

gp.manual_seed(1)
local N, H, lr = 64, 16, 0.05
local x = gp.arange(N):float() * (6 / N) - 3   -- (N) in [-3, 3)
x = x:view{N, 1}
local y = x:sin()
local w1, b1 = gp.randn{1, H}, gp.zeros{1, H}
local w2, b2 = gp.randn{1, H} * 0.3, gp.zeros{1, 1}

local loss
for step = 1, 300 do
  -- forward
  local h = (x * w1 + b1):tanh()              -- (N, H)
  local pred = sum_dim(h * w2, 2) + b2        -- (N, 1)
  local err = pred - y
  -- backward of mean((pred - y)^2)
  local dpred = err * (2 / N)                 -- (N, 1)
  local dw2 = sum_dim(dpred * h, 1)           -- (1, H)
  local db2 = sum_dim(dpred, 1)
  local dz = dpred * w2 * (1 - h * h)         -- (N, H): through tanh
  local dw1 = sum_dim(dz * x, 1)
  local db1 = sum_dim(dz, 1)
  -- SGD
  w1:sub_(dw1 * lr); b1:sub_(db1 * lr); w2:sub_(dw2 * lr); b2:sub_(db2 * lr)
  if step % 100 == 0 or step == 1 then
    loss = sum_dim(err * err, 1):item() / N
    print(string.format('step %3d  loss %.5f', step, loss))
  end
end
assert(loss < 0.05, 'the MLP did not learn sin(x)')
