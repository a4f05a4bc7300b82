-- gp.sample: the filtered distributions against a sort-based Lua oracle, a
-- chi-square test of the draws, greedy, the repetition penalty, seeds, CPU vs
-- CUDA, bad input.
local T = require 'lib'
local gp = require 'gpush'

local cpu = {device = 'cpu'}

-- the sort-based oracle: the filtered, renormalized distribution of one row
-- (a Lua list of logits) under opts, as a Lua list
local function oracle(x, o)
  local V = #x
  local temp = o.greedy and 0 or (o.temperature or 1)
  local xs, m, am = {}, -math.huge, 1
  for j = 1, V do
    local v = x[j]
    if v ~= v then v = -math.huge end
    xs[j] = v
    if v > m then m, am = v, j end
  end
  local p = {}
  if temp == 0 then
    for j = 1, V do p[j] = j == am and 1 or 0 end
    return p
  end
  local w, keep = {}, {}
  for j = 1, V do w[j] = math.exp((xs[j] - m) / temp); keep[j] = true end
  local ord = {}
  for j = 1, V do ord[j] = j end
  table.sort(ord, function(a, b) if xs[a] ~= xs[b] then return xs[a] > xs[b] end return a < b end)
  local k = o.top_k or 0
  if k > 0 and k < V then
    local kth = xs[ord[k]]
    for j = 1, V do if xs[j] < kth then keep[j] = false end end
  end
  local mp = o.min_p or 0
  if mp > 0 then
    for j = 1, V do if xs[j] < m + temp * math.log(mp) then keep[j] = false end end
  end
  local tp = o.top_p or 1
  if tp < 1 then
    local mass = 0
    for j = 1, V do if keep[j] then mass = mass + w[j] end end
    local acc, cut = 0, nil
    for _, j in ipairs(ord) do
      if keep[j] then
        acc = acc + w[j]
        if acc >= tp * mass then cut = xs[j]; break end
      end
    end
    for j = 1, V do if xs[j] < cut then keep[j] = false end end
  end
  local s = 0
  for j = 1, V do if keep[j] then s = s + w[j] end end
  for j = 1, V do p[j] = keep[j] and w[j] / s or 0 end
  return p
end

local function check_rows(logits, o, tol, label)
  local _, probs = gp.sample(logits, o)
  local pt, xt = probs:float():cpu():totable(), logits:float():cpu():totable()
  for r = 1, #xt do
    local want = oracle(xt[r], o)
    for j = 1, #want do
      if math.abs(pt[r][j] - want[j]) > tol then
        error(string.format('%s: row %d token %d: probs %.7g, oracle %.7g (opts %s)', label, r, j, pt[r][j], want[j],
          gp.json.encode(o)))
      end
    end
  end
end

local OPTS = {
  {},
  {temperature = 0.7},
  {temperature = 1.3, top_k = 5},
  {top_k = 1},
  {top_p = 0.5},
  {top_p = 0.9, temperature = 0.8},
  {min_p = 0.1},
  {top_k = 20, top_p = 0.8, min_p = 0.02, temperature = 1.1},
  {greedy = true},
  {temperature = 0, top_p = 0.3},
  {top_p = 1, top_k = 0, min_p = 0},
}

T.test('sample: filtered distributions match the sort-based oracle (cpu, f32 and bf16)', function()
  gp.manual_seed(1)
  for _, V in ipairs {1, 2, 7, 65, 300} do
    local x = gp.randn({6, V}, cpu) * 2
    for i, o in ipairs(OPTS) do
      if (o.top_k or 0) <= V then
        check_rows(x, o, 1e-6, 'f32 V=' .. V .. ' opts ' .. i)
        check_rows(x:bf16(), o, 1e-2, 'bf16 V=' .. V .. ' opts ' .. i)
      end
    end
  end
end)

T.test('sample: known values (top-k, top-p, min-p, ties, -inf, greedy ties)', function()
  local x = gp.tensor({{1, 2, 3, 4}}, cpu)
  local _, p = gp.sample(x, {top_k = 2})
  local e3, e4 = math.exp(3), math.exp(4)
  T.same(p:totable(), {{0, 0, e3 / (e3 + e4), e4 / (e3 + e4)}}, 1e-6)
  -- top-p: 0.6 of the mass needs the two largest; ties at the cut are all kept
  local _, q = gp.sample(gp.tensor({0, 0, math.log(2), math.log(2)}, cpu), {top_p = 0.3})
  T.same(q:totable(), {0, 0, 0.5, 0.5}, 1e-6)
  -- min-p 0.5: keeps p >= max / 2
  local _, r = gp.sample(gp.tensor({math.log(4), math.log(2), math.log(1.9), 0}, cpu), {min_p = 0.5})
  T.same(r:totable(), {4 / 6, 2 / 6, 0, 0}, 1e-6)
  -- -inf logits are never drawn; greedy takes the lowest index among ties
  local t = gp.sample(gp.tensor({{-math.huge, 0, -math.huge}}, cpu))
  T.same(t:totable(), {1})
  T.same(gp.sample(gp.tensor({{1, 5, 5, 2}}, cpu), {greedy = true}):totable(), {1})
  T.same(gp.sample(gp.tensor({{1, 5, 5, 2}}, cpu), {temperature = 0}):totable(), {1})
  local g = gp.sample(gp.tensor({1, 9, 3}, cpu), {temperature = 0})
  T.same(g.shape, {1})
  T.eq(g:item(), 1)
end)

-- chi-square of sampled frequencies against the oracle's distribution
local function chi_square(device)
  local row = {0.5, 1.0, -0.3, 2.0, 0.0, 1.5, -1.0, 0.7}
  local o = {temperature = 0.8, top_k = 6, top_p = 0.95, min_p = 0.05}
  local want = oracle(row, o)
  local n = 20000
  local rows = {}
  for i = 1, n do rows[i] = row end
  gp.manual_seed(11)
  local tok = gp.sample(gp.tensor(rows, {device = device}), o)
  local count = {}
  for j = 1, #row do count[j] = 0 end
  for _, v in ipairs(tok:cpu():totable()) do count[v + 1] = count[v + 1] + 1 end
  local chi, dof = 0, -1
  for j = 1, #row do
    if want[j] == 0 then
      T.eq(count[j], 0, 'filtered-out token ' .. (j - 1) .. ' drawn')
    else
      chi = chi + (count[j] - n * want[j]) ^ 2 / (n * want[j])
      dof = dof + 1
    end
  end
  -- 0.001 critical values by degrees of freedom
  local crit = ({10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32})[dof]
  T.ok(dof >= 2, 'at least 3 tokens kept')
  T.ok(chi < crit, string.format('chi-square %.2f with %d dof above %.2f', chi, dof, crit))
end

T.test('sample: chi-square of 20000 draws against the filtered distribution (cpu)', function() chi_square('cpu') end)
T.test('sample: chi-square of 20000 draws against the filtered distribution (cuda)', function()
  T.cuda()
  chi_square('cuda')
end)

T.test('sample: the same seed gives the same tokens; draws advance the generator', function()
  local x = gp.randn({50, 30}, cpu)
  gp.manual_seed(4)
  local a = gp.sample(x, {top_p = 0.9}):totable()
  local a2 = gp.sample(x, {top_p = 0.9}):totable()
  gp.manual_seed(4)
  local b = gp.sample(x, {top_p = 0.9}):totable()
  T.same(a, b)
  local diff = 0
  for i = 1, 50 do if a[i] ~= a2[i] then diff = diff + 1 end end
  T.ok(diff > 0, 'a second draw differs')
end)

T.test('repetition_penalty: CTRL rule on the first history_len ids, duplicates once', function()
  local x = gp.tensor({{1, -1, 2, 0.5}, {3, 3, -2, 1}}, cpu)
  local h = gp.tensor({{0, 1, 1, 3}, {2, 2, 2, 2}}, {dtype = 'i64', device = 'cpu'})
  local y = gp.repetition_penalty(x, h, 3, 1.5)
  T.same(y:totable(), {{1 / 1.5, -1.5, 2, 0.5}, {3, 3, -3, 1}}, 1e-6)
  local lens = gp.tensor({4, 0}, {dtype = 'i64', device = 'cpu'})
  T.same(gp.repetition_penalty(x, h, lens, 2):totable(), {{0.5, -2, 2, 0.25}, {3, 3, -2, 1}}, 1e-6)
  -- through gp.sample: the penalized distribution
  local _, p = gp.sample(x, {repetition_penalty = 1.5, history = h, history_len = 3})
  local want = oracle({1 / 1.5, -1.5, 2, 0.5}, {})
  T.same(p:totable()[1], want, 1e-6)
  -- a huge penalty on a greedy pick moves greedy to the next best token
  local g = gp.sample(gp.tensor({{1, 5, 4}}, cpu), {greedy = true, repetition_penalty = 100,
    history = gp.tensor({{1}}, {dtype = 'i64', device = 'cpu'})})
  T.same(g:totable(), {2})
end)

T.test('sample: bad input', function()
  local x = gp.randn({2, 5}, cpu)
  T.raises(function() gp.sample(x, {top_p = 0}) end, 'sample', 'top_p', '(0, 1]')
  T.raises(function() gp.sample(x, {top_p = 1.5}) end, 'sample', 'top_p')
  T.raises(function() gp.sample(x, {temperature = -1}) end, 'sample', 'temperature')
  T.raises(function() gp.sample(x, {top_k = 6}) end, 'sample', 'top_k', 'V = 5')
  T.raises(function() gp.sample(x, {top_k = 1.5}) end, 'sample', 'top_k')
  T.raises(function() gp.sample(x, {min_p = 2}) end, 'sample', 'min_p')
  T.raises(function() gp.sample(x, {repetition_penalty = 0}) end, 'sample', 'repetition_penalty')
  T.raises(function() gp.sample(gp.randn({2, 2, 2}, cpu)) end, 'sample', '(2,2,2)')
  T.raises(function() gp.sample(gp.tensor({{1, 2}}, {dtype = 'i64', device = 'cpu'})) end, 'sample', 'float')
  T.raises(function() gp.sample(gp.tensor({{-math.huge, -math.huge}}, cpu)) end, 'sample', 'finite')
  -- the kernel checks too
  local out, probs = gp.empty({2}, {dtype = 'i64', device = 'cpu'}), gp.empty({2, 5}, cpu)
  T.raises(function() gp.k.sample(out, probs, x, 1, 9, 1, 0) end, 'sample', 'top_k')
  T.raises(function() gp.k.sample(out, probs, x, 1, 0, 0, 0) end, 'sample', 'top_p')
  T.raises(function() gp.k.sample(out, probs, x, -0.5, 0, 1, 0) end, 'sample', 'temperature')
  T.raises(function() gp.k.sample(out, gp.empty({2, 4}, cpu), x, 1, 0, 1, 0) end, 'sample', '(2,4)')
  local h = gp.tensor({{0, 7}, {1, 2}}, {dtype = 'i64', device = 'cpu'})
  T.raises(function() gp.repetition_penalty(x, h, 2, 1.2) end, 'repetition_penalty', 'history[0, 1] = 7')
  T.raises(function() gp.repetition_penalty(x, h, gp.tensor({3, 0}, {dtype = 'i64', device = 'cpu'}), 1.2) end,
    'repetition_penalty', 'lens[0] = 3')
  T.raises(function() gp.sample(x, {repetition_penalty = 1.2, history = gp.zeros({3, 2}, cpu)}) end, 'sample', 'history')
end)

-- bf16 logits: the keys of one sign share their two low bytes, so the GPU's
-- radix selects skip those passes (the values above, below and across zero)
T.test('sample (cuda): bf16 rows agree with the CPU (select passes skipped)', function()
  T.cuda()
  for _, V in ipairs {300, 5000, 50304} do
    for _, shift in ipairs {0, 30, -30} do
      local x = (gp.randn({8, V}, cpu) * 2 + shift):bf16()
      for i, o in ipairs(OPTS) do
        gp.manual_seed(23)
        local a, pa = gp.sample(x, o)
        gp.manual_seed(23)
        local b, pb = gp.sample(x:cuda(), o)
        local what = string.format('V=%d shift %d opts %d', V, shift, i)
        if T.relnorm(pb:float(), pa:float()) > 1e-2 then
          local fa, fb = T.flat(pa:float()), T.flat(pb:cpu():float())
          for j = 1, #fa do T.ok(math.abs(fa[j] - fb[j]) < 1e-2, 'probs ' .. what) end
        end
        local ta, tb, same = a:totable(), b:totable(), 0
        for r = 1, 8 do if ta[r] == tb[r] then same = same + 1 end end
        T.ok(same >= 7, string.format('tokens %s: %d of 8 agree', what, same))
      end
    end
  end
end)

T.test('sample (cuda): the same distributions and tokens as the CPU for the same seed', function()
  T.cuda()
  for _, V in ipairs {1, 7, 300, 5000, 50304} do
    local x = gp.randn({16, V}, cpu) * 2
    for i, o in ipairs(OPTS) do
      if (o.top_k or 0) <= V then
        gp.manual_seed(21)
        local a, pa = gp.sample(x, o)
        gp.manual_seed(21)
        local b, pb = gp.sample(x:cuda(), o)
        -- equal up to rounding, except that the top-p cut may keep one more or one
        -- less token of tiny mass when the cumulative mass falls within rounding of it
        if T.relnorm(pb, pa) > 1e-5 then
          local fa, fb = T.flat(pa), T.flat(pb:cpu())
          for j = 1, #fa do T.ok(math.abs(fa[j] - fb[j]) < 1e-3, 'probs V=' .. V .. ' opts ' .. i) end
        end
        local ta, tb, same = a:totable(), b:totable(), 0
        for r = 1, 16 do if ta[r] == tb[r] then same = same + 1 end end
        T.ok(same >= 15, string.format('tokens V=%d opts %d: %d of 16 agree', V, i, same))
      end
    end
  end
  -- the cases above and the chi-square again with each row split over a cluster of 8, 4 or 2 blocks (down to
  -- slices left empty: V 1, 7 and 8), and with one block a row (here V >= 4096 takes clusters on a Hopper GPU)
  if not os.getenv('GPUSH_SAMPLE_CLUSTER') then
    for _, c in ipairs {'1', '2', '4', '8'} do
      for _, name in ipairs {'the same distributions and tokens as the CPU', 'filtered distribution (cuda)',
                             'bf16 rows agree with the CPU'} do
        local out, rc = T.sh('GPUSH_SAMPLE_CLUSTER=' .. c .. ' ' .. T.exe .. ' ' .. T.root .. '/tests/lua/run.lua "' .. name .. '"')
        T.ok(rc == 0 and out:find('1 passed, 0 failed', 1, true), 'GPUSH_SAMPLE_CLUSTER=' .. c .. ': ' .. out)
      end
    end
  end
  -- the repetition penalty on the GPU
  local x = gp.randn({4, 100}, cpu)
  local h = gp.randint(0, 100, {4, 30}, {device = 'cpu'})
  local lens = gp.tensor({0, 5, 30, 17}, {dtype = 'i64', device = 'cpu'})
  local a = gp.repetition_penalty(x, h, lens, 1.7)
  local b = gp.repetition_penalty(x:cuda(), h:cuda(), lens:cuda(), 1.7)
  T.ok(T.relnorm(b, a) < 1e-6)
end)
