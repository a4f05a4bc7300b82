-- bench/titans.lua: the Titans memory update step (gp.titans.memory_scan:
-- retrieval, chunk gradients, the titans_coef scan and the state updates over
-- a whole sequence) at the sizes of `scripts/titans.lua`'s default flags
-- (batch 4, 8 heads of 40, 4096 tokens, chunks of 512), f32, forward (no
-- grad) and forward + backward, beside the same update in PyTorch
-- (scripts/bench/torch_titans.py) when python3 has torch and a GPU.
--
--   gpush scripts/bench/titans.lua [--batch 4 --heads 8 --seq 4096 --head-dim 40 --chunk 512 --kind both]
local gp = rawget(_G, 'gp') or require 'gpush'
local o = gp.args.parse(arg, {
  {'batch', 4, 'batch rows'}, {'heads', 8, 'memory heads'}, {'seq', 4096, 'tokens'},
  {'head-dim', 40, 'memory width'}, {'hidden', 0, 'MLP memory hidden size (default 4 head-dim)'},
  {'chunk', 512, 'chunk size'}, {'kind', 'both', 'linear, mlp or both'},
  {'torch', true, 'run the PyTorch peer (--no-torch: skip it)'},
}, {usage = 'gpush scripts/bench/titans.lua [flags]'})

local N, Tn, d, b = o.batch * o.heads, o.seq, o.head_dim, o.chunk
local h = o.hidden > 0 and o.hidden or 4 * d
local nc = Tn / b
if nc ~= math.floor(nc) then error('--seq must be a multiple of --chunk') end
local dev = gp.device()
local opts = {warmup = 3, iters = dev == 'cuda' and 20 or 2}
print(string.format('titans memory update: N %d (batch %d x heads %d), T %d, d %d, chunk %d, f32, %s', N, o.batch, o.heads,
  Tn, d, b, dev))

local kinds = o.kind == 'both' and {'linear', 'mlp'} or {o.kind}
local mine = {}
for _, kind in ipairs(kinds) do
  gp.manual_seed(0)
  local f = {device = dev}
  local k = gp.titans.l2norm(gp.randn({N, Tn, d}, f))
  local q = gp.titans.l2norm(gp.randn({N, Tn, d}, f))
  local v = gp.randn({N, Tn, d}, f)
  local theta = gp.rand({N, Tn}, f) * 0.2
  -- eta, alpha per chunk, expanded over the chunk's tokens (as nn.NeuralMemory does)
  local function per_chunk(t) return t:reshape {N, nc, 1}:expand {N, nc, b}:reshape {N, Tn} end
  local eta_c, alpha_c = gp.rand({N, nc}, f) * 0.5 + 0.45, gp.rand({N, nc}, f) * 0.05
  local init = kind == 'linear' and {M = gp.randn({N, d, d}, f) / math.sqrt(d)} or
    {W1 = gp.randn({N, h, d}, f) / math.sqrt(d), W2 = gp.randn({N, d, h}, f) / math.sqrt(h)}
  local leaves = {k, q, v, theta, eta_c, alpha_c}
  for _, w in pairs(init) do leaves[#leaves + 1] = w end
  for _, t in ipairs(leaves) do t:requires_grad() end
  local function scan()
    return gp.titans.memory_scan {kind = kind, init = init, k = k, v = v, q = q, theta = theta, eta = per_chunk(eta_c),
                                  alpha = per_chunk(alpha_c), chunk = b}
  end
  local fwd = gp.time(function() gp.no_grad(scan) end, opts)
  local fb = gp.time(function()
    local y, st = scan()
    local loss = (y * y):sum()
    for _, n in ipairs(gp.titans.NAMES[kind]) do loss = loss + (st[n] * st[n]):sum() end
    loss:backward()
    for _, t in ipairs(leaves) do t:zero_grad() end
  end, opts)
  local e1 = gp.rand({N * nc, b}, f) * 0.5 + 0.45
  local a1 = gp.rand({N * nc, b}, f) * 0.05
  local coef = gp.time(function() gp.titans_coef(e1, a1) end, opts)
  mine[kind] = {fwd = fwd, fb = fb}
  print(string.format('  gpush %-6s  fwd %8.3f ms  fwd+bwd %8.3f ms  (%.0f / %.0f tokens/s; titans_coef %.3f ms for %d rows of %d)',
    kind, fwd, fb, o.batch * Tn / fwd * 1e3, o.batch * Tn / fb * 1e3, coef, N * nc, b))
end

if not o.torch or dev ~= 'cuda' then return end
local cmd = string.format('python3 scripts/bench/torch_titans.py --batch %d --heads %d --seq %d --head-dim %d --hidden %d ' ..
  '--chunk %d --kind %s 2>/dev/null', o.batch, o.heads, Tn, d, h, b, o.kind)
local p = io.popen(cmd)
local out = p:read('*a')
p:close()
local any = false
for line in out:gmatch('[^\n]+') do
  local ok, r = pcall(gp.json.decode, line)
  if ok and type(r) == 'table' and r.kind and mine[r.kind] then
    any = true
    local m = mine[r.kind]
    print(string.format('  torch %-6s  fwd %8.3f ms  fwd+bwd %8.3f ms  gpush/torch time: fwd %.2fx, fwd+bwd %.2fx', r.kind,
      r.fwd_ms, r.fwdbwd_ms, m.fwd / r.fwd_ms, m.fb / r.fwdbwd_ms))
  end
end
if not any then print('  (no PyTorch peer: python3 with torch and a GPU not found)') end
