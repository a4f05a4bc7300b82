-- 06_sampling.lua: sampling with the Philox generator: uniform and normal
-- draws, integers, and a categorical distribution by inverse CDF.
gp.manual_seed(7)
local n = 100000

-- Monte Carlo: the fraction of points of the unit square inside the quarter circle
local u, v = gp.rand{n}, gp.rand{n}
local inside = (u * u + v * v):le(1):float()
local count = 0
for _, b in ipairs(inside:totable()) do count = count + b end
print(string.format('pi ~ %.4f', 4 * count / n))

-- a categorical distribution p = {0.1, 0.2, 0.3, 0.4}: class = #{k : u >= cdf_k}
local cdf = {0.1, 0.3, 0.6}
local r = gp.rand{n}
local class = gp.zeros{n}
for _, c in ipairs(cdf) do class = class + r:ge(c):float() end
local hist = {0, 0, 0, 0}
for _, k in ipairs(class:totable()) do hist[k + 1] = hist[k + 1] + 1 end
for k = 1, 4 do print(string.format('class %d: %.3f (p = %.1f)', k - 1, hist[k] / n, k / 10)) end

-- integers and normals
print('dice:', gp.randint(1, 7, {10}))
local z = gp.randn{n}:totable()
local m, s2 = 0, 0
for _, x in ipairs(z) do m = m + x end
m = m / n
for _, x in ipairs(z) do s2 = s2 + (x - m) ^ 2 end
print(string.format('normal: mean %.3f, std %.3f', m, math.sqrt(s2 / n)))

-- the same seed gives the same numbers
gp.manual_seed(3); local a = gp.rand{4}:totable()
gp.manual_seed(3); local b = gp.rand{4}:totable()
assert(a[1] == b[1] and a[4] == b[4])
