-- fusion_drift.lua: 100 bf16 training steps of a small Llama-shaped GPT (4
-- layers of 256, SwiGLU, RMSNorm, heads of 128) on data/corpus.txt's bytes,
-- the residual adds chained into the norms (gp.add_rms_norm, the default)
-- against the unfused path (ln_f's forward swapped for the same computation
-- turns the chaining off), and the unfused path once more (the spread of the
-- GPU's own nondeterminism): the losses side by side and the largest
-- relative difference (issue 24: the fused step's losses against the
-- unfused one's). Small batches on the CPU.
--   gpush scripts/bench/fusion_drift.lua
local DEV = gp.cuda_available() and 'cuda' or 'cpu'
local f = assert(io.open('data/corpus.txt', 'rb'))
local text = f:read('*a')
f:close()
local bytes = {}
for i = 1, #text do bytes[i] = text:byte(i) end
local T, B = DEV == "cuda" and 128 or 16, DEV == "cuda" and 16 or 2
math.randomseed(7)
local starts = {}
for s = 1, 100 do
  starts[s] = {}
  for b = 1, B do starts[s][b] = math.random(1, #bytes - T - 1) end
end
local function batch(s)
  local x, y = {}, {}
  for b = 1, B do
    local r, q = {}, {}
    for t = 1, T do r[t], q[t] = bytes[starts[s][b] + t - 1], bytes[starts[s][b] + t] end
    x[b], y[b] = r, q
  end
  return gp.tensor(x, {dtype = 'i64', device = DEV}), gp.tensor(y, {dtype = 'i64', device = DEV})
end
local function run(chain)
  gp.manual_seed(1)
  local m = gp.nn.GPT {vocab_size = 256, block_size = T, n_embd = 256, n_layer = 4, n_head = 2, mlp = 'swiglu',
                       mlp_hidden = 704, norm = 'rms', bias = false, device = DEV}
  gp.optim.mixed_precision(m)
  if not chain then rawset(m.ln_f, 'forward', function(self, x) return (gp.rms_norm(x, self.weight, self.eps)) end) end
  local opt = gp.optim.AdamW(m, {lr = 2e-3, weight_decay = 0.1})
  m:train()
  local losses = {}
  for s = 1, 100 do
    local x, y = batch(s)
    opt:zero_grad()
    local _, loss = m(x, y)
    loss:backward()
    gp.optim.clip_grad_norm(opt, 1.0)
    opt:step()
    losses[s] = loss:item()
  end
  return losses
end
local a, b, c = run(true), run(false), run(false)
local function worst(p, q)
  local w, at = 0, 0
  for s = 1, 100 do
    local r = math.abs(p[s] - q[s]) / math.abs(q[s])
    if r > w then w, at = r, s end
  end
  return w, at
end
local w1, s1 = worst(a, b)
local w2, s2 = worst(c, b)
print(string.format('%s, 100 bf16 steps: chained %.4f -> %.4f, unfused %.4f -> %.4f, unfused again -> %.4f', DEV, a[1], a[100], b[1], b[100], c[100]))
print(string.format('largest relative loss difference: chained vs unfused %.2e (step %d); unfused vs unfused again %.2e (step %d)', w1, s1, w2, s2))
for _, s in ipairs {1, 2, 5, 10, 25, 50, 75, 100} do print(s, string.format('%.5f %.5f %.5f', a[s], b[s], c[s])) end
