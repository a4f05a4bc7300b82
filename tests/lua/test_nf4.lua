-- NF4 weights (gp.quantize, gp.nf4_linear, nn.Linear4, QLoRA): the codes
-- against a direct evaluation of the codebook rule written here in Lua, the
-- products against x @ dequant(W)^T in f64, gradients by finite differences,
-- bytes a parameter, bad input. (The CUDA kernels against the CPU reference:
-- the nf4 cases of test_kernels.lua; here the GPU cases repeat the checks on
-- the device when there is one.)
local T = require 'lib'
local gp = require 'gpush'
local ffi = require 'ffi'
local fd = require 'fd'
local nn = gp.nn

local cpu = {device = 'cpu'}

-- bitsandbytes' codebook (the values as the QLoRA paper prints them)
local CODES = {-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
               -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
               0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
               0.7229568362236023, 1.0}

local fbuf = ffi.new('float[1]')
local function f32(v) fbuf[0] = v; return fbuf[0] end -- v rounded to float
local FC = {}
for i = 1, 16 do FC[i] = f32(CODES[i]) end
-- bitsandbytes' decision thresholds (dQuantizeNF4's literals, the midpoints of
-- neighbouring codes) as the compilers round them to float; MID[i] lies
-- between codes i - 1 and i (0-based)
local MID = {-0.8480964303016663, -0.6106328964233398, -0.4599952697753906, -0.33967941999435425, -0.23460739850997925,
             -0.13791173696517944, -0.045525018125772476, 0.03979014977812767, 0.1202552542090416, 0.2035212516784668,
             0.2920137643814087, 0.3893125355243683, 0.5016633868217468, 0.6427869200706482, 0.8614783883094788}

-- the float next to v (a float) by d ulps
local ubuf = ffi.new('union { float f; int32_t i; }')
local function fstep(v, d)
  ubuf.f = v
  ubuf.i = ubuf.i + (v >= 0 and d or -d)
  return ubuf.f
end

-- the rule: the nearest code of v (a float); a value equal to a threshold takes the lower code
local function code_of(v)
  if v ~= v then return 0 end -- NaN: bitsandbytes' tree ends at code 0
  local best, bd = 0, math.huge
  for i = 1, 16 do
    local d = math.abs(v - FC[i])
    if d < bd then best, bd = i - 1, d end
  end
  if best > 0 and v == MID[best] then best = best - 1 end -- on the threshold below the nearest code
  return best
end

-- the expected (codes, absmax, dequantized values) of one block of floats, as
-- bitsandbytes computes: scale = float(1 / absmax), v = float(w * scale); an
-- all-zero block takes the code of 0, and a block whose 1 / absmax overflows
-- divides by absmax
local function expect_block(vals)
  local m = 0
  for _, v in ipairs(vals) do if math.abs(v) > m then m = math.abs(v) end end
  local scale = m == 0 and 0 or f32(1 / m)
  local divide = scale == math.huge
  local codes, deq = {}, {}
  for i, v in ipairs(vals) do
    local s = divide and f32(v / m) or f32(v * scale)
    codes[i] = code_of(s)
    deq[i] = f32(FC[codes[i] + 1] * m)
  end
  return codes, m, deq
end

-- the expected codes (packed bytes), absmax and dequantized values of a weight w (out, in), blocks of b
local function expect(w, b)
  local vals = T.flat(w)
  local bytes, am, deq = {}, {}, {}
  for s = 1, #vals, b do
    local codes, m, d = expect_block({unpack(vals, s, s + b - 1)})
    am[#am + 1] = m
    for i = 1, b, 2 do bytes[#bytes + 1] = codes[i] * 16 + codes[i + 1] end
    for i = 1, b do deq[#deq + 1] = d[i] end
  end
  return bytes, am, deq
end

local function same_list(a, b, what)
  T.eq(#a, #b, what .. ' length')
  for i = 1, #a do
    if a[i] ~= b[i] then error(string.format('%s: element %d is %.9g, expected %.9g', what, i, a[i], b[i]), 2) end
  end
end

-- a weight (rows, 64) with the hard cases: exact zeros, an all-zero block,
-- a block of values so small that 1 / absmax overflows (denormal in f32),
-- denormal values beside normal ones, values on the thresholds and next to them
local function hard_weight(dt)
  gp.manual_seed(7)
  local w = gp.randn({6, 64}, cpu)
  w:narrow(1, 4, 2):mul_(0.1) -- rows 4 and 5: absmax 1 (set below)
  w:narrow(1, 1, 1):narrow(2, 1, 5):zero_()
  w:narrow(1, 2, 1):narrow(2, 17, 16):zero_()                 -- an all-zero block (blocks of 16)
  w:narrow(1, 3, 1):narrow(2, 1, 16):mul_(1e-40)               -- tiny block
  w:narrow(1, 3, 1):narrow(2, 33, 8):mul_(1e-39)               -- denormals beside normal values
  local p = ffi.cast('float *', w.c.data) + w.c.offset
  -- row 4: each block of 16 starts with 1.0 (absmax 1), then every threshold and the floats around it
  for i = 1, 15 do
    for k = 0, 3 do
      local e = 16 * k + i -- blocks k = 0..3, slots 1..15
      p[3 * 64 + e] = fstep(MID[i], k - 1) -- one ulp below, on, one and two ulps above
    end
  end
  for k = 0, 3 do p[3 * 64 + 16 * k] = 1 end
  return dt == 'f32' and w or w:to(dt)
end

for _, dt in ipairs {'f32', 'bf16', 'f16'} do
  T.test('nf4: quantize and dequantize equal the codebook rule (' .. dt .. ', hard cases)', function()
    for _, block in ipairs {16, 64} do
      local w = hard_weight(dt)
      local q = gp.quantize(w, {block = block})
      T.eq(q.kind, 'nf4'); T.eq(q.block, block); T.eq(q.dtype, dt); T.eq(q.device, 'cpu')
      T.same(q.shape, {6, 64})
      local bytes, am, deq = expect(w, block)
      same_list(T.flat(q.data), bytes, 'codes (block ' .. block .. ')')
      same_list(T.flat(q.absmax), am, 'absmax')
      local d = q:dequantize()
      T.eq(d.dtype, dt)
      -- the expected values are floats; rounded once more to dt
      local want = T.flat(gp.tensor(deq, cpu):to(dt))
      same_list(T.flat(d:reshape {6 * 64}), want, 'dequantized')
      for _, v in ipairs(T.flat(d)) do T.ok(v == v, 'no NaN') end
    end
  end)
end

T.test('nf4: the rule at the thresholds (midpoints; a value on one takes the lower code), packing order', function()
  -- the thresholds are the midpoints of the codes, to half an ulp
  for i = 1, 15 do
    local m = (FC[i] + FC[i + 1]) / 2 -- exact in double
    T.ok(math.abs(MID[i] - m) <= math.abs(fstep(MID[i], 1) - MID[i]) / 2, 'threshold ' .. i)
  end
  local w = hard_weight('f32')
  for _, block in ipairs {16, 64} do
    local q = gp.quantize(w, {block = block})
    local bytes = T.flat(q.data)
    local function code(e) -- of element e (0-based) of row 4
      local b = bytes[3 * 32 + math.floor(e / 2) + 1]
      return e % 2 == 0 and math.floor(b / 16) or b % 16
    end
    for k = 0, 3 do
      T.eq(code(16 * k), 15, '1.0')
      for i = 1, 15 do -- threshold i lies between codes i - 1 and i
        T.eq(code(16 * k + i), k <= 1 and i - 1 or i, string.format('threshold %d, %d ulps', i, k - 1))
      end
    end
  end
  -- the all-zero block of row 2 (blocks of 16): code 7 (0.0) everywhere, absmax 0, zeros back
  local q16 = gp.quantize(w, {block = 16})
  T.eq(T.flat(q16.absmax)[6], 0)
  for j = 1, 8 do T.eq(T.flat(q16.data)[32 + 8 + j], 0x77) end
  local d = T.flat(q16:dequantize():narrow(1, 2, 1):narrow(2, 17, 16):contiguous())
  for _, v in ipairs(d) do T.eq(v, 0) end
end)

T.test('nf4: random weights, block sizes 16 to 512', function()
  gp.manual_seed(3)
  for _, b in ipairs {16, 32, 128, 512} do
    local w = gp.randn({3, 1024}, cpu) * 0.05
    local q = gp.quantize(w, {block = b})
    local bytes, am, deq = expect(w, b)
    same_list(T.flat(q.data), bytes, 'codes')
    same_list(T.flat(q.absmax), am, 'absmax')
    same_list(T.flat(q:dequantize():reshape {3 * 1024}), deq, 'dequantized')
    T.near(q.nbytes / q:numel(), 0.5 + 4 / b, 1e-12)
  end
end)

T.test('nf4: the GPU quantizes and dequantizes bit for bit as the CPU (cuda)', function()
  T.cuda()
  for _, dt in ipairs {'f32', 'bf16', 'f16'} do
    local w = hard_weight(dt)
    local qc = gp.quantize(w, {block = 16})
    local qg = gp.quantize(w:cuda(), {block = 16})
    T.eq(qg.device, 'cuda')
    same_list(T.flat(qg.data:cpu()), T.flat(qc.data), 'codes ' .. dt)
    same_list(T.flat(qg.absmax:cpu()), T.flat(qc.absmax), 'absmax ' .. dt)
    same_list(T.flat(qg:dequantize():cpu()), T.flat(qc:dequantize()), 'dequantized ' .. dt)
    same_list(T.flat(qc:to('cuda'):dequantize():cpu()), T.flat(qc:dequantize()), 'moved ' .. dt)
  end
end)

---------------------------------------------------------------------------
-- products

-- x @ dequant(W)^T + b in f64 on the CPU
local function reference(x, q, b)
  local wd = q:cpu():dequantize('f64')
  local y = x:cpu():to('f64'):matmul(wd:t())
  if b then y = y + b:cpu():to('f64') end
  return y
end

local function check_products(dev)
  gp.manual_seed(11)
  local old = gp.nf4_option('chunk_bytes', 1000) -- chunks of 2 rows (f32) or 5 (bf16) at K = 96
  local ok, err = pcall(function()
    for _, shape in ipairs {{37, 96, 32}, {37, 96, 16}, {5, 80, 16}, {37, 192, 64}, {21, 256, 128}} do
      local N, Kd, block = shape[1], shape[2], shape[3]
      local w = gp.randn({N, Kd}, {device = dev}) * 0.1
      local b = gp.randn({N}, {device = dev})
      local q = gp.quantize(w, {block = block})
      for _, M in ipairs {1, 7, 32, 33, 200} do
        for _, dt in ipairs {'f32', 'bf16'} do
          local x = gp.randn({M, Kd}, {device = dev}):to(dt)
          local bb = b:to(dt)
          local y = gp.nf4_linear(x, q, bb)
          T.eq(y.dtype, dt); T.same(y.shape, {M, N})
          local r = T.relnorm(y, reference(x, q, bb))
          local tol = dt == 'f32' and 1e-5 or 1e-2
          T.ok(r < tol, string.format('%s M=%d N=%d K=%d block %d %s: relative error %g', dev, M, N, Kd, block, dt, r))
          -- without bias, and through gp.linear with leading dims
          local y2 = gp.linear(x:view {1, M, Kd}, q)
          T.same(y2.shape, {1, M, N})
          T.ok(T.relnorm(y2, reference(x, q)) < tol)
        end
      end
    end
  end)
  gp.nf4_option('chunk_bytes', old)
  if not ok then error(err, 0) end
end

T.test('nf4: gp.nf4_linear (GEMV up to 32 rows, chunks beyond) equals x @ dequant(W)^T in f64', function()
  check_products('cpu')
end)

T.test('nf4: gp.nf4_linear on the GPU equals x @ dequant(W)^T in f64 (cuda)', function()
  T.cuda()
  check_products('cuda')
  -- rows of x whose staged tile filled the 48 KB of shared memory beside the
  -- kernel's static table (4 rows, K 4096, two splits): the launch was refused
  local w = gp.randn({11008, 4096}, {device = 'cuda'}):bf16()
  local q = gp.quantize(w, {block = 64})
  for _, m in ipairs {1, 2, 4, 8, 32} do
    local x = gp.randn({m, 4096}, {device = 'cuda'}):bf16()
    local want = x:float():matmul(q:dequantize():float():t())
    T.ok(T.relnorm(gp.nf4_linear(x, q):float(), want) < 1e-2, 'M ' .. m)
  end
  -- the tensor-core GEMV (bf16 and f16 x, K a multiple of 64) at every row
  -- count of its three tiles and past them, rows of W not a multiple of 16:
  -- x @ dequant(W)^T within the codes' and the output's rounding. 1000 rows:
  -- a row tile a CTA, warps without work; 2500 x 576: CTAs of one or two row
  -- tiles, 9 blocks a row (a last stage of one block, absmax loaded one by
  -- one); 3000 x 2048: row tiles split between warps, their sums added in
  -- shared memory (the same bits on every call)
  for _, s in ipairs {{1000, 1536}, {2500, 576}, {3000, 2048}} do
    w = gp.randn(s, {device = 'cuda'})
    q = gp.quantize(w, {block = 64})
    local wd = q:dequantize()
    for _, dt in ipairs {'bf16', 'f16'} do
      for _, m in ipairs {1, 3, 8, 9, 16, 17, 32, 40, 64} do
        local x = gp.randn({m, s[2]}, {device = 'cuda'}):to(dt)
        local y = gp.empty({m, s[1]}, {dtype = dt, device = 'cuda'})
        gp.k.nf4_gemv(y, x, q.data, q.absmax)
        local want = x:float():matmul(wd:t())
        local what = string.format('%d x %d %s M %d: %g', s[1], s[2], dt, m, T.relnorm(y:float(), want))
        T.ok(T.relnorm(y:float(), want) < 5e-3, what)
        local y2 = gp.empty({m, s[1]}, {dtype = dt, device = 'cuda'})
        gp.k.nf4_gemv(y2, x, q.data, q.absmax)
        T.same(y2:float():totable(), y:float():totable(), 0, what)
      end
    end
  end
end)

T.test('nf4: gradients of x and b by finite differences (f64), both paths; W gets none', function()
  gp.manual_seed(5)
  local w = gp.randn({7, 32}, {dtype = 'f64', device = 'cpu'})
  local q = gp.quantize(w, {block = 16})
  T.eq(q.dtype, 'f64')
  local old = gp.nf4_option('gemv_rows')
  local ok, err = pcall(function()
    for _, rows in ipairs {32, 1} do -- 3 rows of x: the GEMV, then chunks
      gp.nf4_option('gemv_rows', rows)
      T.ok(gp.gradcheck(function(x, b) return gp.nf4_linear(x, q, b) end,
        {fd.randn {3, 32}, fd.randn {7}}))
      T.ok(gp.gradcheck(function(x) return gp.linear(x, q):tanh() end, {fd.randn {2, 3, 32}}))
    end
  end)
  gp.nf4_option('gemv_rows', old)
  if not ok then error(err, 0) end
  -- the same gradient as the dense product over the dequantized weight
  local x = gp.randn({40, 32}, {dtype = 'f64', device = 'cpu'}):requires_grad()
  local g = gp.randn({40, 7}, {dtype = 'f64', device = 'cpu'})
  gp.nf4_linear(x, q):backward(g)
  T.ok(T.relnorm(x.grad, g:matmul(q:dequantize())) < 1e-12)
end)

T.test('nf4: the chunked product uses a bounded scratch, never a whole dequantized copy', function()
  local N, Kd = 64, 256
  local w = gp.randn({N, Kd}, cpu)
  local q = gp.quantize(w, {block = 64})
  local x = gp.randn({100, Kd}, cpu)
  collectgarbage('collect')
  local m0 = gp.memory().host_in_use
  gp.nf4_linear(x, q)
  -- live now: only y (100 x 64 floats); the scratch (a quarter of W) was freed at once
  T.ok(gp.memory().host_in_use - m0 <= 100 * N * 4, 'scratch released')
end)

---------------------------------------------------------------------------
T.test('gp.quantized_cat: row blocks stacked equal the parts, one product equals the parts\' products; views, errors', function()
  gp.manual_seed(9)
  for _, dev in ipairs(gp.cuda_available() and {'cpu', 'cuda'} or {'cpu'}) do
    local ws = {gp.randn({6, 64}, {device = dev}), gp.randn({2, 64}, {device = dev}), gp.randn({4, 64}, {device = dev})}
    local qs = {}
    for i, w in ipairs(ws) do qs[i] = gp.quantize(w, {block = 32}) end
    local all, parts = gp.quantized_cat(qs)
    T.eq(all.shape[1], 12); T.eq(all.shape[2], 64); T.eq(all.block, 32)
    T.eq(all.nbytes, qs[1].nbytes + qs[2].nbytes + qs[3].nbytes)
    T.eq(T.relnorm(all:dequantize(), gp.cat({qs[1]:dequantize(), qs[2]:dequantize(), qs[3]:dequantize()}, 1)), 0, dev)
    local x = gp.randn({3, 64}, {device = dev})
    local y = gp.nf4_linear(x, all)
    for i, p in ipairs(parts) do
      T.ok(p.data.c.data == all.data.c.data, 'a view of the stack')
      T.eq(T.relnorm(p:dequantize(), qs[i]:dequantize()), 0)
      local r0 = i == 1 and 1 or i == 2 and 7 or 9
      T.ok(T.relnorm(y:narrow(2, r0, p.shape[1]), gp.nf4_linear(x, qs[i])) < 1e-6, dev .. ' part ' .. i)
    end
  end
  T.raises(function() gp.quantized_cat({gp.quantize(gp.randn({4, 64}, {device = 'cpu'}), {block = 32}),
      gp.quantize(gp.randn({4, 64}, {device = 'cpu'}), {block = 64})}) end,
    'quantized_cat: item 2 is nf4 (4,64) block 64 f32 on cpu but item 1 is nf4 (4,64) block 32 f32 on cpu')
  T.raises(function() gp.quantized_cat({gp.quantize(gp.randn {4, 64}), gp.randn {4, 64}}) end, 'quantized_cat: item 2 is not a quantized weight')
  T.raises(function() gp.quantized_cat({}) end, 'quantized_cat: needs a list of quantized weights')
end)

-- nn: Linear4, quantize_linears, QLoRA

local function tiny_gpt(dtype)
  gp.manual_seed(5)
  return nn.GPT {vocab_size = 11, block_size = 8, n_embd = 16, n_layer = 2, n_head = 2, device = 'cpu', dtype = dtype}
end

T.test('nn.quantize_linears: the model becomes its dequantized self; 0.5625 bytes a parameter', function()
  local m = tiny_gpt()
  local x = gp.randint(0, 11, {2, 8}, {dtype = 'i64', device = 'cpu'})
  -- the dense model with its weights replaced by their NF4 round trips
  local ref = tiny_gpt()
  local n, numel = 0, 0
  for _, nm in ipairs(ref:named_parameters()) do
    local name, p = nm[1], nm[2]
    if name:match('attn%.qkv%.weight$') or name:match('attn%.proj%.weight$') or name:match('mlp%.fc%.weight$')
      or name:match('mlp%.proj%.weight$') then
      gp.no_grad(function() p:copy_(gp.quantize(p, {block = 16}):dequantize()) end)
      n, numel = n + 1, numel + p:numel()
    end
  end
  T.eq(n, 8)
  collectgarbage('collect')
  local before = gp.memory().host_in_use
  nn.quantize_linears(m, {block = 16})
  local after = gp.memory().host_in_use
  T.ok(getmetatable(m.h[1].attn.qkv) == nn.Linear4._imt)
  T.ok(T.relnorm(m(x), ref(x)) < 1e-5)
  -- the frozen base: codes and absmax, 0.5 + 4/16 bytes a parameter here; the dense weights are gone
  local qbytes = 0
  for _, mod in ipairs(m:modules()) do
    if getmetatable(mod) == nn.Linear4._imt then
      qbytes = qbytes + mod.weight.nbytes
      T.ok(mod.bias == nil or not mod.bias:needs_grad(), 'the bias is frozen')
    end
  end
  T.eq(qbytes, numel * (0.5 + 4 / 16))
  T.ok(after - before <= qbytes - numel * 4, string.format('host bytes %d -> %d', before, after))
  -- blocks of 64: at most 0.6 bytes a parameter
  local w = gp.randn({128, 256}, cpu)
  local q = gp.quantize(w)
  T.eq(q.block, 64)
  T.ok(q.nbytes / q:numel() <= 0.6)
  T.eq(q.nbytes / q:numel(), 0.5625)
end)

T.test('nn.quantize_linears: state_dict keys weight.nf4 and weight.absmax; save and load; to() keeps their dtypes', function()
  local m = nn.quantize_linears(tiny_gpt(), {block = 16})
  local sd = m:state_dict()
  T.eq(sd['h.1.attn.qkv.weight.nf4'].dtype, 'u8')
  T.same(sd['h.1.attn.qkv.weight.nf4'].shape, {48, 8})
  T.eq(sd['h.1.attn.qkv.weight.absmax'].dtype, 'f32')
  T.same(sd['h.1.attn.qkv.weight.absmax'].shape, {48, 1})
  T.ok(sd['h.1.attn.qkv.bias'] ~= nil and sd['h.1.attn.qkv.weight'] == nil)
  local path = os.tmpname()
  gp.save(path, sd)
  local m2 = nn.quantize_linears(tiny_gpt(), {block = 16})
  gp.no_grad(function() m2.h[1].attn.qkv.weight.data:zero_() end)
  m2:load_state_dict(gp.load(path))
  os.remove(path)
  local x = gp.randint(0, 11, {2, 8}, {dtype = 'i64', device = 'cpu'})
  T.ok(T.relnorm(m2(x), m(x)) == 0)
  -- a cast keeps the codes u8 and absmax f32; the product follows x's dtype
  m2:to('f64')
  local q = m2.h[1].attn.qkv.weight
  T.eq(q.data.dtype, 'u8'); T.eq(q.absmax.dtype, 'f32'); T.eq(m2.h[1].attn.qkv.bias.dtype, 'f64')
  T.ok(T.relnorm(m2(x), m(x)) < 1e-5)
  T.ok(tostring(m2):find('Linear4(16 -> 48, nf4 block 16)', 1, true))
end)

T.test('QLoRA: LoRA over the quantized base trains only the adapters; gradients in f64', function()
  local m = nn.quantize_linears(tiny_gpt(), {block = 16})
  local x = gp.randint(0, 11, {2, 8}, {dtype = 'i64', device = 'cpu'})
  local y0 = m(x)
  local ad = gp.lora.apply(m, {rank = 4})
  T.eq(#ad, 16)
  T.ok(T.relnorm(m(x), y0) < 1e-6, 'B = 0: the adapted model is the base')
  T.ok(m:state_dict()['h.1.attn.qkv.weight.nf4'] ~= nil, 'the base keys stay')
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.1) end
  local _, loss = m(x, x)
  loss:backward()
  local n = 0
  for _, p in ipairs(m:parameters()) do if p.grad ~= nil then n = n + 1 end end
  T.eq(n, #ad)
  T.raises(function() gp.lora.merge(m) end, 'cannot merge into a quantized (nf4) weight')
  -- one quantized LoRA layer in f64: gradients of A, B and x
  gp.manual_seed(3)
  local lin = nn.Linear(32, 5, {dtype = 'f64', device = 'cpu'})
  local lo = nn.LoRA(nn.Linear4.from_linear(lin, {block = 16}), {rank = 2, alpha = 3})
  T.eq(lo.lora_A.dtype, 'f64')
  nn.init.normal_(lo.lora_B, 0, 0.5)
  T.ok(gp.gradcheck(function(a, b, xx)
    lo.lora_A, lo.lora_B = a, b
    return lo(xx)
  end, {lo.lora_A:detach():contiguous(), lo.lora_B:detach():contiguous(), fd.randn {4, 32}}))
end)

T.test('QLoRA on a Llama-family model: every projection quantized, adapters train, generation runs', function()
  gp.manual_seed(9)
  local cfg = {vocab_size = 40, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4,
               num_key_value_heads = 2, max_position_embeddings = 64, model_type = 'qwen2'}
  local m = gp.models.Llama(cfg, {device = 'cpu'})
  local ids = gp.randint(0, 40, {2, 12}, {dtype = 'i64', device = 'cpu'})
  local dense = m(ids)
  nn.quantize_linears(m, {block = 16})
  local n = 0
  for _, mod in ipairs(m:modules()) do if getmetatable(mod) == nn.Linear4._imt then n = n + 1 end end
  T.eq(n, 2 * 7) -- q, k, v, o, gate, up, down in each layer; lm_head stays dense
  T.ok(getmetatable(m.lm_head) == nn.Linear._imt)
  T.ok(m:state_dict()['model.layers.0.self_attn.q_proj.bias'] ~= nil, "qwen2's q/k/v biases kept")
  local base = m(ids)
  local r = T.relnorm(base, dense)
  T.ok(r > 0 and r < 0.3, 'near the dense model: ' .. r)
  local ad = gp.lora.apply(m, {rank = 2})
  T.eq(#ad, 2 * 14)
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.1) end
  local opt = gp.optim.AdamW(ad, {lr = 1e-2, weight_decay = 0})
  local _, l0 = m(ids, ids)
  for _ = 1, 5 do
    opt:zero_grad()
    local _, loss = m(ids, ids)
    loss:backward()
    opt:step()
  end
  local _, l1 = m(ids, ids)
  T.ok(l1:item() < l0:item(), 'the adapters learn')
  local out = gp.generate(m, {{1, 2, 3, 4}}, {max_new = 3, greedy = true})
  T.eq(#out.lists[1], 3)
end)

T.test('gp.lora.dense_copy: a dense model equal to a QLoRA model (dequantized base, adapters merged); q:dequantize(out); sampling from it', function()
  gp.manual_seed(13)
  local cfg = {vocab_size = 40, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4,
               num_key_value_heads = 2, max_position_embeddings = 64, tie_word_embeddings = true}
  local m = gp.models.Llama(cfg, cpu)
  local ids = gp.randint(0, 40, {2, 9}, {dtype = 'i64', device = 'cpu'})
  nn.quantize_linears(m, {block = 16})
  nn.quantize_embeddings(m, {block = 16})
  gp.lora.apply(m, {rank = 2})
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.2) end
  -- q:dequantize(out) writes the same values into a given tensor (and checks it)
  local q = m.model.layers[1].self_attn.q_proj.weight
  local out = gp.empty(q.shape, cpu)
  T.ok(q:dequantize(out) == out)
  T.eq(T.relnorm(out, q:dequantize()), 0)
  T.raises(function() q:dequantize(gp.empty({2, 32}, cpu)) end, 'dequantize: out must be a contiguous float tensor (32,32) on cpu, got f32 (2,32)')
  T.raises(function() q:dequantize(gp.empty({32, 64}, cpu):narrow(2, 1, 32)) end, 'not contiguous')
  -- the copy: every weight the dequantized base plus (alpha / rank) B A; the logits those of the QLoRA model
  local d = gp.models.Llama(cfg, cpu)
  T.ok(gp.lora.dense_copy(d, m) == d)
  local lq = m.model.layers[2].mlp.down_proj
  T.ok(T.relnorm(d.model.layers[2].mlp.down_proj.weight, lq.weight:dequantize() + lq:delta()) < 1e-6)
  T.eq(T.relnorm(d.model.embed_tokens.weight, m.model.embed_tokens.weight:dequantize()), 0)
  T.ok(T.relnorm(d(ids), m(ids)) < 1e-5, 'the dense copy computes the QLoRA model')
  -- adapters switched off are not merged; the QLoRA model itself is unchanged
  gp.lora.without(m, function()
    gp.lora.dense_copy(d, m)
    T.ok(T.relnorm(d(ids), m(ids)) < 1e-5, 'the dense copy of the base alone')
  end)
  T.ok(gp.lora.modules(m)[1][2].lora_B:abs():max():item() > 0)
  -- another architecture: an error naming the parameter
  local other = gp.models.Llama({vocab_size = 40, hidden_size = 32, intermediate_size = 48, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64}, cpu)
  T.raises(function() gp.lora.dense_copy(other, m) end, 'lora.dense_copy: the dense model\'s model.layers.0.mlp')
  T.raises(function() gp.lora.dense_copy(d, {}) end, 'lora.dense_copy: needs two modules')
  -- rollouts sample from the dense copy (gp.polychromic.sample_from): the same replies as from the QLoRA model
  local tok = {stop = 0, encode = function(_, p) return {(#p % 39) + 1, 3, 5} end,
               decode = function(_, t) return table.concat(t, ',') end}
  local function replies()
    gp.manual_seed(21)
    return gp.polychromic.rollout(m, tok, {'ab', 'abc'}, {n = 2, max_new = 5, temperature = 1, top_p = 1}).replies
  end
  local plain = replies()
  T.ok(#table.concat(plain) > 8, 'replies: ' .. table.concat(plain, '|'))
  gp.polychromic.sample_from(m, gp.models.Llama(cfg, cpu))
  T.eq(table.concat(replies(), '|'), table.concat(plain, '|'))
  gp.polychromic.sample_from(m, nil)
  T.raises(function() gp.polychromic.sample_from(m, 3) end, 'polychromic.sample_from: dense must be a module or nil')
end)

T.test('nn.quantize_embeddings: q:rows, nn.Embedding4 and the tied head on one quantized weight; the whole base 4-bit', function()
  gp.manual_seed(11)
  local cfg = {vocab_size = 48, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 2,
               num_key_value_heads = 1, max_position_embeddings = 32, tie_word_embeddings = true}
  local m = gp.models.Llama(cfg, cpu)
  local ids = gp.tensor({{0, 5, 47, 5}, {9, 3, 2, 1}}, {dtype = 'i64', device = 'cpu'})
  local q = gp.quantize(m.model.embed_tokens.weight:detach(), {block = 16})
  -- q:rows: the dequantized rows, (idx shape..., in), in f32 and bf16
  local ref = q:dequantize():index_select(1, ids:view {8}):view {2, 4, 32}
  T.eq(T.relnorm(q:rows(ids), ref), 0)
  T.eq(T.relnorm(q:rows(ids:view {8}, 'bf16'):float(), q:dequantize('bf16'):float():index_select(1, ids:view {8})), 0)
  T.eq(q:rows(gp.zeros({0}, {dtype = 'i64', device = 'cpu'})):size(1), 0)
  nn.quantize_linears(m, {block = 16})
  nn.quantize_embeddings(m, {block = 16})
  T.ok(getmetatable(m.model.embed_tokens) == nn.Embedding4._imt)
  T.ok(getmetatable(m.lm_head) == nn.Linear4._imt)
  T.ok(m.lm_head.weight == m.model.embed_tokens.weight, 'the tied head shares the quantized weight')
  -- gp.nn.weight_bytes: the norms in f32, the embedding (and its tied head) once, 7 projections, all at 0.75 bytes
  T.eq(nn.weight_bytes(m), 96 * 4 + 10752 * 0.75)
  T.raises(function() nn.weight_bytes({}) end, 'weight_bytes: needs a module')
  T.eq(T.relnorm(m.model.embed_tokens(ids), ref), 0)
  -- the model equals the dense model over the dequantized weights
  local d = gp.models.Llama(cfg, cpu)
  gp.no_grad(function()
    d.model.embed_tokens.weight:copy_(q:dequantize())
    for i, layer in ipairs(m.model.layers) do
      for _, part in ipairs {{'self_attn', {'q_proj', 'k_proj', 'v_proj', 'o_proj'}}, {'mlp', {'gate_proj', 'up_proj', 'down_proj'}}} do
        for _, nm in ipairs(part[2]) do d.model.layers[i][part[1]][nm].weight:copy_(layer[part[1]][nm].weight:dequantize()) end
      end
      d.model.layers[i].input_layernorm.weight:copy_(layer.input_layernorm.weight)
      d.model.layers[i].post_attention_layernorm.weight:copy_(layer.post_attention_layernorm.weight)
    end
  end)
  T.ok(T.relnorm(m(ids), d(ids)) < 1e-5, 'the quantized model is its dequantized self')
  -- adapters still train over the whole 4-bit base; the base is 0.5 + 4/16 bytes a parameter but for the norms
  gp.lora.apply(m, {rank = 2})
  local mem = gp.polychromic.lm.base_memory(m)
  -- 10752 weights at 0.75 bytes (the embedding and head once, 7 projections), 96 norm weights in f32
  T.eq(mem.params, 10752 + 96)
  T.near(mem.bytes_per_param, (10752 * 0.75 + 96 * 4) / (10752 + 96), 1e-12)
  T.eq(mem.quant_params, 10752)
  -- gp.nn.weight_stats, which both use: with the adapters (skip nothing), and with them left out
  local all, base = nn.weight_stats(m), nn.weight_stats(m, (function()
    local set = {}
    for _, p in ipairs(gp.lora.parameters(m)) do set[p] = true end
    return set
  end)())
  T.ok(all.params > base.params and base.params == mem.params and all.quant_bytes == base.quant_bytes)
  T.eq(all.bytes, nn.weight_bytes(m))
  local out = gp.generate(m, {{1, 2, 3}}, {max_new = 2, greedy = true})
  T.eq(#out.lists[1], 2)
  -- bad input
  T.raises(function() q:rows(gp.tensor({1.5}, cpu)) end, 'QuantizedWeight:rows: idx must be an i64 or i32 tensor', 'f32')
  T.raises(function() nn.Embedding4(gp.zeros({2, 16}, cpu)) end, 'Embedding4: needs a quantized weight')
  T.raises(function() nn.quantize_embeddings(nn.Linear(4, 4, cpu)) end, 'quantize_embeddings: the model has no token embedding')
  T.raises(function() nn.quantize_embeddings(gp.models.Llama(cfg, cpu), {block = 64}) end,
    'quantize_embeddings: model.embed_tokens.weight is (48,32): block 64 does not divide its rows')
end)

T.test('nf4: q:rows on the GPU equals the CPU bit for bit, f32 and bf16 (cuda)', function()
  T.cuda()
  gp.manual_seed(12)
  local q = gp.quantize(gp.randn({300, 128}, cpu), {block = 64})
  local idx = gp.tensor({{0, 299, 7}, {7, 150, 1}}, {dtype = 'i64', device = 'cpu'})
  local qc = q:to('cuda')
  for _, dt in ipairs {'f32', 'bf16'} do
    local a, b = q:rows(idx, dt):float(), qc:rows(idx:to('cuda'), dt):float():cpu()
    T.eq((a - b):abs():max():item(), 0, dt)
  end
  T.raises(function() qc:rows(idx) end, 'QuantizedWeight:rows: idx is on cpu but the weight is on cuda')
end)

T.test('QLoRA: a quantized model moved to the GPU computes what it computed on the CPU (cuda)', function()
  T.cuda()
  local m = nn.quantize_linears(tiny_gpt(), {block = 16})
  gp.lora.apply(m, {rank = 2})
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.1) end
  local x = gp.randint(0, 11, {2, 8}, {dtype = 'i64', device = 'cpu'})
  local y = m(x)
  m:to('cuda')
  local q = m.h[1].attn.qkv.weight
  T.eq(q.device, 'cuda'); T.eq(q.data.dtype, 'u8'); T.eq(q.absmax.dtype, 'f32')
  T.ok(T.relnorm(m(x:cuda()), y) < 1e-4)
  local _, loss = m(x:cuda(), x:cuda())
  loss:backward()
  T.ok(gp.lora.modules(m)[1][2].lora_A.grad ~= nil)
end)

---------------------------------------------------------------------------
-- bad input

T.test('nf4: bad input gives errors naming the op and the shapes', function()
  local w = gp.randn({5, 48}, cpu)
  T.raises(function() gp.quantize(gp.zeros({4, 64}, {dtype = 'i64', device = 'cpu'})) end, 'quantize: w is i64 (4,64)', 'float')
  T.raises(function() gp.quantize(w) end, 'quantize: block 64 does not divide the rows of w (5,48)')
  T.raises(function() gp.quantize(w, {block = 24}) end, 'quantize: block must be a power of two >= 16, got 24')
  T.raises(function() gp.quantize(w, {block = 8}) end, 'power of two >= 16')
  T.raises(function() gp.quantize(gp.randn({2, 3, 64}, cpu)) end, 'quantize: w must be 2-d (out, in), got (2,3,64)')
  T.raises(function() gp.quantize(w, {kind = 'int8'}) end, "kind 'int8' is not supported")
  T.raises(function() gp.quantize('w') end, 'quantize: w must be a tensor')
  local q = gp.quantize(w, {block = 16})
  T.raises(function() gp.nf4_linear(gp.randn({3, 40}, cpu), q) end, 'nf4_linear: x is (3,40) but q is (5,48)')
  T.raises(function() gp.nf4_linear(gp.randn({3, 48}, cpu), w) end, 'nf4_linear: q must be a quantized weight')
  T.raises(function() gp.nf4_linear(gp.randn({3, 48}, cpu), q, gp.randn({4}, cpu)) end, 'nf4_linear: b is (4) but q is (5,48)')
  T.raises(function() gp.nf4_linear(gp.randn({3, 48}, cpu), q, gp.randn({5}, {dtype = 'f64', device = 'cpu'})) end,
    'nf4_linear: b is f64 but x is f32')
  T.raises(function() gp.linear(gp.randn({3, 47}, cpu), q) end, 'nf4_linear: x is (3,47)')
  T.raises(function() q:to('i32') end, 'QuantizedWeight:to')
  T.raises(function() gp.nf4_option('tiles', 3) end, "unknown option 'tiles'")
  -- the kernels check their shapes
  local qq, am = gp.empty({2, 12}, {dtype = 'u8', device = 'cpu'}), gp.empty({2}, cpu)
  T.raises(function() gp.k.nf4_quantize(qq, am, gp.randn({2, 24}, cpu)) end, 'nf4_quantize', 'power of two >= 16')
  T.raises(function() gp.k.nf4_quantize(qq, am, gp.randn({2, 32}, cpu)) end, 'nf4_quantize')
  T.raises(function()
    gp.k.nf4_gemv(gp.empty({1, 5}, cpu), gp.randn({1, 48}, cpu), q.data, gp.empty({5, 5}, cpu))
  end, 'nf4_gemv: x is (1,48), q (5,24) and absmax (5,5)')
  T.raises(function()
    gp.k.nf4_gemv(gp.empty({1, 5}, cpu), gp.randn({1, 48}, cpu), q.data, gp.empty({5, 2}, cpu))
  end, 'nf4_gemv: blocks of 24 values', 'power of two >= 16')
  T.raises(function() nn.Linear4(w) end, 'Linear4: needs a quantized weight')
  T.raises(function() nn.quantize_linears(tiny_gpt(), {targets = 'nothing$'}) end, 'quantize_linears: no nn.Linear')
  T.raises(function() nn.quantize_linears(tiny_gpt(), {block = 32}) end, 'quantize_linears: h.1.attn.qkv.weight is (48,16): block 32 does not divide its rows')
end)

T.test('nf4: mixing devices is an error (cuda)', function()
  T.cuda()
  local q = gp.quantize(gp.randn({5, 64}, {device = 'cuda'}))
  T.raises(function() gp.nf4_linear(gp.randn({2, 64}, cpu), q) end, 'nf4_linear: x is on cpu but q is on cuda')
end)

T.test('scripts/bench/nf4.lua --quick runs every part', function()
  local top = GPUSH_ROOT or '.'
  local out, rc = T.sh(top .. '/build/gpush --device cpu ' .. top .. '/scripts/bench/nf4.lua --quick')
  T.eq(rc, 0, out)
  for _, s in ipairs {'copy bandwidth', 'fused dequant-GEMV', 'gp.nf4_linear with many rows', 'quantize and dequantize'} do
    T.ok(out:find(s, 1, true), s .. ' in\n' .. out)
  end
end)
