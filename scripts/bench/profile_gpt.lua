-- profile_gpt.lua: one training step of a GPT-2-small-sized model (bf16, AdamW), per kernel.
-- Run: gpush scripts/bench/profile_gpt.lua [--llama] [--per-head] [--unfused-mlp] [--vocab N] [--loss] [--shapes] [--trace]
-- --trace (GPU): the step captured as a CUDA graph and traced by gp.trace (CUPTI: what
-- the GPU ran, cuBLAS's kernels included, and the idle time between kernels)
-- instead of gp.profile's events around each gp.k call
-- --shapes: a row per kernel and argument shapes (gp.profile's shapes option)
-- --loss: the loss by model:loss(x, y) (gp.linear_cross_entropy, the logits never
-- whole) instead of model(x, y)
-- --vocab N: the vocabulary (default 50304, the bench suite's GPT-2 row)
-- --llama: the suite's Llama-shaped model instead (d 1024, 8 layers, 8 heads
-- of 128, SwiGLU 2816, RMSNorm, no biases, V 32,000, batch 4 x 2048)
-- --per-head: attention through the per-head views and nn.attention (the path
-- before gp.attention_qkv; nn.attention swapped for a wrapper turns it off)
-- --unfused-mlp: the MLPs as fc, gelu_tanh, proj (the path before
-- gp.linear_gelu_linear; a Linear forward swapped on the instance turns it off)
local unfused_mlp, V, llama, fused_loss, shapes, trace = false, 50304, false, false, false, false
for i, a in ipairs(arg or {}) do
  if a == '--llama' then
    llama = true
  elseif a == '--shapes' then
    shapes = true
  elseif a == '--trace' then
    trace = true
  elseif a == '--loss' then
    fused_loss = true
  elseif a == '--vocab' then
    V = tonumber(arg[i + 1]) or error('--vocab needs a number')
  elseif a == '--per-head' then
    local flash = gp.nn.attention
    gp.nn.attention = function(...) return flash(...) end
    print('attention: per-head path (narrow/transpose + gp.attention)')
  elseif a == '--unfused-mlp' then
    unfused_mlp = true
    print('mlp: unfused path (linear, gelu_tanh, linear)')
  end
end
if trace and not gp.cuda_available() then error('profile_gpt: --trace needs a CUDA GPU (gp.trace lists what the GPU ran)', 0) end
local cfg = {vocab_size = V, block_size = 1024, n_embd = 768, n_layer = 12, n_head = 12, dropout = 0}
local B = 8
if llama then
  cfg = {vocab_size = 32000, block_size = 2048, n_embd = 1024, n_layer = 8, n_head = 8, dropout = 0, mlp = 'swiglu',
         mlp_hidden = 2816, norm = 'rms', bias = false}
  B = 4
end
local T0 = gp.train.now()
local model = gp.nn.GPT(cfg)
print('build', gp.train.now() - T0)
if unfused_mlp then
  local function linear(self, x) return gp.linear(x, self.weight, self.bias) end
  for _, blk in ipairs(model.h) do
    rawset(blk.mlp.fc, 'forward', linear)
    rawset(blk.mlp.proj, 'forward', linear)
  end
end
gp.optim.mixed_precision(model)
local opt = gp.optim.AdamW(model, {lr = 3e-4, device_hyper = trace})
local x = gp.randint(0, cfg.vocab_size, {B, cfg.block_size})
local y = gp.randint(0, cfg.vocab_size, {B, cfg.block_size})
local function step()
  opt:zero_grad()
  local loss
  if fused_loss then loss = model:loss(x, y) else local _; _, loss = model(x, y) end
  loss:backward()
  gp.optim.clip_grad_norm(opt, 1.0)
  opt:step()
end
for i = 1, 2 do local t = gp.train.now(); step(); gp.sync(); print('step', i, gp.train.now() - t) end
print('gp.time step ms', (gp.time(step, {warmup = 1, iters = 5})))
if trace then
  local g = opt:capture(step)
  local function replay() opt:prepare_replay(); g:replay() end
  print('graph step ms', (gp.time(replay, {warmup = 3, iters = 20})))
  print(gp.trace(replay, {iters = 2, warmup = 1}))
  return
end
local p = gp.profile(step, {iters = 2, warmup = 0, shapes = shapes})
print(p)
