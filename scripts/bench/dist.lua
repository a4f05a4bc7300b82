-- Data-parallel scaling: train_gpt.lua tokens/s on 1 GPU and on N GPUs
-- (gpush --nproc N through gp.dist.DDP), GPT-2-small-sized by default, and
-- the ratio (N GPUs process N x the tokens per step: the ideal is N).
--
--   gpush scripts/bench/dist.lua                     -- 768 wide, 12 layers, 12 heads, block 1024, batch 8, bf16
--   gpush scripts/bench/dist.lua --nproc 2 --iters 30 --log-every 10
--   gpush scripts/bench/dist.lua --model-flags '--n-layer 4'   -- anything more for train_gpt.lua
--
-- tokens/s is the steady state: the mean of the logger's intervals after the
-- first (which holds the warm-up: cuBLAS handles, NCCL set-up, allocations).
local gp = rawget(_G, 'gp') or require 'gpush'

local o = gp.args.parse(arg, {
  {'nproc', 2, 'GPUs of the data-parallel run'},
  {'iters', 30, 'optimizer steps per run'},
  {'log-every', 10, 'steps per timed interval'},
  {'n-embd', 768, 'embedding width'},
  {'n-layer', 12, 'transformer blocks'},
  {'n-head', 12, 'attention heads'},
  {'block', 1024, 'context length'},
  {'batch', 8, 'sequences per GPU per step'},
  {'bf16', true, 'bf16 mixed precision'},
  {'model-flags', '', 'more flags for train_gpt.lua'},
  {'single', true, 'also run the 1-GPU baseline'},
}, {usage = 'gpush scripts/bench/dist.lua [flags]', description = 'tokens/s of train_gpt.lua on 1 GPU and on --nproc GPUs'})

local root = rawget(_G, 'GPUSH_ROOT') or '.'
local exe = root .. '/build/gpush'
local script = root .. '/scripts/train_gpt.lua'

local flags = string.format('--n-embd %d --n-layer %d --n-head %d --block %d --batch %d %s --iters %d --log-every %d '
  .. '--eval-every 0 --eval-iters 1 --val-fraction 0 --warmup 0 %s', o.n_embd, o.n_layer, o.n_head, o.block, o.batch,
  o.bf16 and '--bf16' or '', o.iters, o.log_every, o.model_flags)

local function run(nproc)
  local log = os.tmpname()
  -- the data-parallel steps run eagerly (train_gpt captures a CUDA graph only
  -- on one GPU), so the 1-GPU reference runs eagerly too: the ratio is scaling
  local cmd = string.format('%s %s %s %s --log %s 2>&1', exe, script, flags, nproc > 1 and ('--nproc ' .. nproc) or '--no-graph', log)
  print('$ ' .. cmd)
  local p = io.popen(cmd)
  local out = p:read('*a')
  local ok = p:close()
  local lines = {}
  for l in out:gmatch('[^\n]+') do if l:find('final:', 1, true) or l:find('data parallel', 1, true) or l:find('rror') then lines[#lines + 1] = '  ' .. l end end
  print(table.concat(lines, '\n'))
  if not ok then
    io.stderr:write(out)
    error(string.format('dist bench: the %d-process run failed', nproc))
  end
  local recs = gp.data.jsonl(log)
  os.remove(log)
  local sum, n = 0, 0
  local intervals = 0
  for _, r in ipairs(recs) do
    if r.tokens_per_s and not r.final then
      intervals = intervals + 1
      if intervals > 1 then sum, n = sum + r.tokens_per_s, n + 1 end
    end
  end
  if n == 0 then error('dist bench: no steady-state interval; raise --iters above --log-every') end
  return sum / n
end

local single = o.single and run(1) or nil
local multi = run(o.nproc)
local res = {bench = 'dist', config = string.format('%d-%d-%d block %d batch %d%s', o.n_layer, o.n_head, o.n_embd, o.block,
  o.batch, o.bf16 and ' bf16' or ''), nproc = o.nproc, tokens_per_s_1 = single, tokens_per_s_n = multi,
  scaling = single and multi / single or nil}
print(gp.json.encode(res))
if single then
  print(string.format('1 GPU %.0f tok/s | %d GPUs %.0f tok/s | scaling %.2fx (ideal %d, target >= %.1f)', single, o.nproc,
    multi, multi / single, o.nproc, 0.9 * o.nproc))
end
