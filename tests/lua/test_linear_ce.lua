-- linear_cross_entropy: equal to cross_entropy(h @ w^T) in f64 (loss and the
-- gradients of h and w) for any chunk, gradcheck, CUDA against the CPU, bad input.
local T = require 'lib'
local gp = require 'gpush'

local CPU64 = {dtype = 'f64', device = 'cpu'}
local I64 = {dtype = 'i64', device = 'cpu'}

T.test('linear_cross_entropy equals cross_entropy(h @ w^T) in f64: loss, dh, dw; every chunk size; ignored rows', function()
  gp.manual_seed(5)
  local h0, w0 = gp.randn({3, 5, 6}, CPU64), gp.randn({11, 6}, CPU64)
  local tg = gp.tensor({{3, -100, 10, 0, 7}, {1, 1, -100, 9, 2}, {0, 4, 5, 6, 10}}, I64)
  for _, red in ipairs {'mean', 'sum'} do
    local h2, w2 = h0:clone():requires_grad(), w0:clone():requires_grad()
    local want = gp.cross_entropy(h2:matmul(w2:transpose(1, 2)), tg, {reduction = red})
    local up = gp.full({}, 1.3, CPU64)
    want:backward(up)
    for _, chunk in ipairs {1, 4, 7, 15, 100} do
      local h1, w1 = h0:clone():requires_grad(), w0:clone():requires_grad()
      local got = gp.linear_cross_entropy(h1, w1, tg, {reduction = red, chunk = chunk})
      local what = red .. ' chunk ' .. chunk
      T.ok(T.relnorm(got, want) < 1e-6, what .. ': loss')
      got:backward(up)
      T.ok(T.relnorm(h1.grad, h2.grad) < 1e-6, what .. ': dh ' .. T.relnorm(h1.grad, h2.grad))
      T.ok(T.relnorm(w1.grad, w2.grad) < 1e-6, what .. ': dw ' .. T.relnorm(w1.grad, w2.grad))
    end
  end
  -- 'none': the per-row losses (no gradient); the default chunk
  local none = gp.linear_cross_entropy(h0, w0, tg, {reduction = 'none'})
  T.eq(none.shape[1], 3); T.eq(none.shape[2], 5)
  T.ok(T.relnorm(none, gp.cross_entropy(h0:matmul(w0:transpose(1, 2)), tg, {reduction = 'none'})) < 1e-6)
  -- only w needs a gradient (a frozen input): h gets none
  local w3 = w0:clone():requires_grad()
  gp.linear_cross_entropy(h0, w3, tg, {chunk = 4}):backward()
  T.ok(w3.grad ~= nil and h0.grad == nil)
  -- grad = true: the loss and both gradients, already / count for 'mean'
  local h4, w4 = h0:clone():requires_grad(), w0:clone():requires_grad()
  gp.cross_entropy(h4:matmul(w4:transpose(1, 2)), tg):backward()
  local _, dh, dw = gp.linear_cross_entropy(h0, w0, tg, {grad = true, chunk = 4})
  T.ok(T.relnorm(dh, h4.grad) < 1e-6 and T.relnorm(dw, w4.grad) < 1e-6)
end)

T.test('linear_cross_entropy: gradcheck in f64 (h and w)', function()
  -- small values: the differences' step then sees little curvature
  local h, w = gp.randn({7, 4}, CPU64) * 0.5, gp.randn({9, 4}, CPU64) * 0.5
  local tg = gp.tensor({0, 8, -100, 3, 3, 5, 1}, I64)
  local o = {eps = 1e-2, atol = 1e-4, rtol = 1e-3} -- the loss is f32
  T.ok(gp.gradcheck(function(a, b) return gp.linear_cross_entropy(a, b, tg, {chunk = 3}) end, {h, w}, o))
  T.ok(gp.gradcheck(function(a, b) return gp.linear_cross_entropy(a, b, tg, {chunk = 2, reduction = 'sum'}) end, {h, w}, o))
end)

-- (V = 50257 in 16 bits: each chunk's products in two parts over rows padded to a multiple of 8)
T.test('linear_cross_entropy default chunks: at most about 256 MiB of logits, of one size, multiples of 8 rows', function()
  local head_args = require('gpush.core.ops.common').head_args
  local function C(N, V, dt)
    local o = {dtype = dt or 'bf16', device = 'cpu'}
    return head_args('t', gp.empty({N, 8}, o), gp.empty({V, 8}, o), {}).C
  end
  T.eq(C(8192, 50257), 2048) -- 4 chunks of 2048, not 3 of 2670 and one of 182
  T.eq(C(4096, 128256), 1024)
  T.eq(C(8192, 32000), 4096)
  T.eq(C(100, 50257), 100) -- one chunk: all rows
  T.eq(C(9000, 50257, 'f32'), 1288) -- 7 chunks, the last 1272 rows
  T.eq(head_args('t', gp.empty({10, 8}, CPU64), gp.empty({5, 8}, CPU64), {chunk = 3}).C, 3) -- chunk= as given
  for _, c in ipairs {{8192, 50257}, {4096, 128256}, {9000, 50257, 'f32'}, {12345, 151936}} do
    local n = C(c[1], c[2], c[3])
    T.ok(n * c[2] * (c[3] == 'f32' and 4 or 2) <= 2 ^ 28 * 1.01, 'about 256 MiB at most')
  end
end)

T.test('linear_cross_entropy (cuda): matches the CPU in f32 and bf16, chunks of 1000 rows over V = 50304 and 50257', function()
  T.cuda()
  for _, V in ipairs {50304, 50257} do
    for _, dt in ipairs {'f32', 'bf16'} do
      local h = gp.randn({2500, 64}, {device = 'cpu'}):to(dt)
      local w = (gp.randn({V, 64}, {device = 'cpu'}) * 0.1):to(dt)
      local tg = gp.randint(0, V, {2500}, {device = 'cpu'})
      local l, dh, dw = gp.linear_cross_entropy(h, w, tg, {grad = true, chunk = 1000})
      local lc, dhc, dwc = gp.linear_cross_entropy(h:cuda(), w:cuda(), tg:cuda(), {grad = true, chunk = 1000})
      local tol, what = dt == 'f32' and 1e-4 or 2e-2, dt .. ' V ' .. V
      T.ok(T.relnorm(lc, l) < tol, what .. ' loss ' .. T.relnorm(lc, l))
      T.ok(T.relnorm(dhc, dh) < tol, what .. ' dh ' .. T.relnorm(dhc, dh))
      T.ok(T.relnorm(dwc, dw) < tol, what .. ' dw ' .. T.relnorm(dwc, dw))
    end
  end
  -- V = 50257 in bf16 reads the padded rows in place (their 7 extra columns -inf): a target among them is still
  -- out of range
  local V = 50257
  local h, w = gp.randn({300, 64}, {dtype = 'bf16', device = 'cuda'}), gp.randn({V, 64}, {dtype = 'bf16', device = 'cuda'})
  local tg = gp.randint(0, V, {300}, {device = 'cuda'})
  tg[7] = V + 3
  T.raises(function() gp.linear_cross_entropy(h, w, tg):item() end, 'target ' .. (V + 3), 'next synchronization')
  T.raises(function() gp.linear_cross_entropy(h, w, tg, {grad = true}):item() end, 'target ' .. (V + 3))
end)

T.test('linear_cross_entropy: bad input', function()
  local h, w = gp.randn({4, 6}, CPU64), gp.randn({10, 6}, CPU64)
  local tg = gp.tensor({0, 1, 2, 3}, I64)
  T.raises(function() gp.linear_cross_entropy(h, gp.randn({10, 5}, CPU64), tg) end, 'linear_cross_entropy', '(4,6)', '(10,5)')
  T.raises(function() gp.linear_cross_entropy(h, w, gp.tensor({0, 1}, I64)) end, 'linear_cross_entropy', '(4)', '(2)')
  T.raises(function() gp.linear_cross_entropy(h, w, gp.tensor({0, 1, 2, 3}, CPU64)) end, 'linear_cross_entropy', 'i64')
  T.raises(function() gp.linear_cross_entropy(h, w:float(), tg) end, 'linear_cross_entropy', 'f64', 'f32')
  T.raises(function() gp.linear_cross_entropy(h, w, tg, {chunk = 0}) end, 'linear_cross_entropy', 'chunk')
  T.raises(function() gp.linear_cross_entropy(h, w, tg, {reduction = 'avg'}) end, 'linear_cross_entropy', 'reduction')
  T.raises(function() gp.linear_cross_entropy(h, w, gp.tensor({0, 10, 2, 3}, I64)) end, 'linear_cross_entropy', 'target 10')
  T.raises(function() gp.linear_cross_entropy(h:clone():requires_grad(), w, tg, {reduction = 'none'}) end,
    'linear_cross_entropy', "'none'", 'gradient')
end)
