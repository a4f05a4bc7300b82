-- MoE layer benchmark: forward and forward + backward of nn.MoE (router,
-- top-k, permutation, batched expert GEMMs over padded groups, combine, the
-- load-balancing and z losses) in tokens/s, beside the Mixtral-style PyTorch
-- eager loop over experts (scripts/bench/torch_moe.py, same sizes, same run)
-- when python3 has torch and a GPU. Defaults: N 8192 tokens, C 768, H 2048,
-- 8 experts, top-2, SwiGLU experts, bf16.
--   gpush scripts/bench/moe.lua [--tokens 8192] [--d 768] [--hidden 2048] [--capacity-factor 1.25] [--act gelu]
local a = gp.args.parse(arg, {
  {'tokens', 8192, 'tokens N'}, {'d', 768, 'model width C'}, {'hidden', 2048, 'expert hidden size H'},
  {'experts', 8, 'experts E'}, {'k', 2, 'experts per token'}, {'act', 'swiglu', 'swiglu or gelu'},
  {'dtype', 'bf16', 'bf16, f16 or f32'}, {'capacity-factor', 0, 'capacity factor (0: dropless; one host read per forward)'},
  {'iters', 20, 'timed iterations'}, {'no-torch', false, 'skip the PyTorch peer'},
}, {usage = 'gpush scripts/bench/moe.lua [flags]'})
if not gp.cuda_available() then
  print('moe bench: no CUDA GPU, nothing to measure')
  return
end
local N, C, H, E, k = a.tokens, a.d, a.hidden, a.experts, a.k
gp.manual_seed(0)
local moe = gp.nn.MoE(C, H, {experts = E, k = k, act = a.act, dtype = a.dtype, device = 'cuda',
  capacity_factor = a.capacity_factor > 0 and a.capacity_factor or nil})
local x = gp.randn({N, C}, {device = 'cuda'}):to(a.dtype):requires_grad()
local proj = gp.randn({N, C}, {device = 'cuda'}):to(a.dtype)
local opts = {warmup = 3, iters = a.iters}

local fwd_ms = gp.no_grad(function() return (gp.time(function() moe(x) end, opts)) end)
moe:train()
local fb_ms = gp.time(function()
  local y = moe(x)
  local loss = (y * proj):sum():to('f32') + moe.aux_loss
  loss:backward()
  moe:zero_grad()
  x:zero_grad()
end, opts)
local gemms = a.act == 'swiglu' and 3 or 2
local flops = 2 * gemms * N * k * C * H -- the expert GEMMs of the routed tokens (padding not counted)
print(string.format('MoE layer %s N=%d C=%d H=%d E=%d top-%d %s, %s', a.dtype, N, C, H, E, k, a.act,
  a.capacity_factor > 0 and ('capacity factor ' .. a.capacity_factor) or 'dropless'))
print(string.format('  gpush fwd      %8.3f ms  %10.0f tokens/s  %6.1f TFLOP/s', fwd_ms, N / fwd_ms * 1e3, flops / fwd_ms / 1e9))
print(string.format('  gpush fwd+bwd  %8.3f ms  %10.0f tokens/s  %6.1f TFLOP/s', fb_ms, N / fb_ms * 1e3, 3 * flops / fb_ms / 1e9))

if a.no_torch then return end
local cmd = string.format('python3 scripts/bench/torch_moe.py --tokens %d --d %d --hidden %d --experts %d --k %d --act %s --dtype %s --iters %d 2>&1',
  N, C, H, E, k, a.act, a.dtype, a.iters)
local p = io.popen(cmd)
local txt = p and p:read('*a') or ''
if p then p:close() end
local tf = tonumber(txt:match('torch_moe fwd ([%d%.]+) ms'))
local tfb = tonumber(txt:match('torch_moe fwd_bwd ([%d%.]+) ms'))
if tf and tfb then
  print(string.format('  torch eager fwd     %8.3f ms  %10.0f tokens/s   gpush/torch %.2fx', tf, N / tf * 1e3, tf / fwd_ms))
  print(string.format('  torch eager fwd+bwd %8.3f ms  %10.0f tokens/s   gpush/torch %.2fx', tfb, N / tfb * 1e3, tfb / fb_ms))
else
  print('  (no PyTorch peer: ' .. (txt:match('[^\n]+') or 'python3 with torch and a GPU not found') .. ')')
end
