-- 01_tensors.lua: tensors on the CPU and the GPU.
-- Run: gpush examples/01_tensors.lua   (add --device cpu to stay on the CPU)
print('default device: ' .. gp.device())

local a = gp.tensor({{1, 2, 3}, {4, 5, 6}})      -- f32 on gp.device()
local b = gp.arange(3):float()                    -- 0, 1, 2 (arange of integers is i64)
print(a + b)                                      -- b broadcasts over the rows
print((a * 2):transpose(1, 2))                    -- a view: no copy until needed

gp.manual_seed(42)
local x = gp.randn {1000, 1000}
local y = (x * x):sigmoid()
print('shape', table.concat(y.shape, 'x'), 'dtype', y.dtype, 'device', y.device)
print('corner:', y:narrow(1, 1, 2):narrow(2, 1, 3))

-- low-level kernels write into outputs you give them
local out = gp.empty {2, 3}
gp.k.mul_s(out, a, 10)
print(out:cpu():totable()[2][3])                  -- 60

print(gp.memory())
