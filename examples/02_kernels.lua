-- 02_kernels.lua: every kernel is a Lua function gp.k.NAME(outputs..., inputs..., scalars...).
-- Try the same lines at the prompt (gpush with no arguments): Tab completes gp.k.<TAB>.
print(gp.kernels())                       -- every kernel, its arguments and a one-line doc
help(gp.k.add)                            -- the usage, the doc and the C signature

local x = gp.tensor({-2, -1, 0, 1, 2})
local out = gp.empty_like(x)
gp.k.relu(out, x)                         -- kernels write into the outputs you give them
print('relu', out)
gp.k.mul_s(out, out, 10)                  -- outputs may alias inputs for elementwise kernels
print('x10 ', out)

-- the methods are built on the same kernels, and allocate their outputs
print('x * x + 1 =', x * x + 1)

-- bad input is a Lua error naming the kernel and the shapes, never a crash
local ok, err = pcall(gp.k.add, gp.empty{3}, gp.ones{2}, gp.ones{4})
print('error caught:', ok == false, err)
