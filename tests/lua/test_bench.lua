-- The benchmark suite (scripts/bench/suite.lua, `make bench`) in its tiny
-- mode: every row is printed and the run exits 0. Its numbers are not
-- checked (timings belong in benchmarks, never in tests).
local T = require 'lib'

local root = GPUSH_ROOT or '.'
local exe = T.exe
local suite = root .. '/scripts/bench/suite.lua'

-- every row label the suite prints (one per workload shape)
local ROWS = {
  'add', 'mul', 'exp', 'swiglu', 'rms_norm', 'softmax', 'layer_norm', 'matmul', 'cross_entropy fwd+bwd', 'distill fwd+bwd',
  'fused linear CE fwd+bwd', 'AdamW step',
  'train_gpt default step', 'bf16 step', 'attention fwd', 'attention fwd+bwd', 'decode attention', 'MoE layer fwd',
  'diversity', 'Titans step', 'polychromic step', 'dispatch a:add_(b)', 'dispatch gp.k.add_s',
}

local function timeout(s)
  local _, rc = T.sh('command -v timeout >/dev/null')
  return rc == 0 and ('timeout ' .. s .. ' ') or ''
end

-- the table's rows: {label = {cells...}}
local function rows_of(out)
  local rows = {}
  for l in out:gmatch('[^\n]+') do
    if l:sub(1, 2) == '| ' then
      local cells = {}
      for c in l:gmatch('|%s*([^|]-)%s*%f[|]') do cells[#cells + 1] = c end
      if cells[1] and cells[1] ~= 'workload' and not cells[1]:match('^%-+$') then
        rows[#rows + 1] = cells
      end
    end
  end
  return rows
end

local function find_row(rows, label)
  for _, r in ipairs(rows) do if r[1] == label then return r end end
  for _, r in ipairs(rows) do if r[1]:sub(-#label) == label then return r end end
end

T.test('suite --quick --no-torch prints every row and exits 0', function()
  local out, rc = T.sh(timeout(300) .. exe .. ' ' .. suite .. ' --quick --no-torch')
  T.eq(rc, 0, out)
  local rows = rows_of(out)
  for _, label in ipairs(ROWS) do
    local r = find_row(rows, label)
    T.ok(r, 'no row ' .. label .. ' in\n' .. out)
    T.eq(#r, 9, 'columns of ' .. label)
    local built = r[3] ~= 'not built yet'
    if built then
      T.ok(tonumber(r[3]), label .. ': gpush column is ' .. r[3])
      T.eq(r[5], 'no torch', label)
      T.eq(r[7], 'no torch', label)
    end
  end
  T.ok(out:find('elapsed', 1, true), 'no elapsed time')
  T.ok(out:find('0 failed', 1, true), out)
end)

T.test('suite: a row whose gpush function is missing says not built yet', function()
  local out, rc = T.sh(timeout(120) .. exe .. " -e 'gp.optim.AdamW = nil' " ..
    suite .. ' --quick --no-torch --only AdamW')
  T.eq(rc, 0, out)
  local r = find_row(rows_of(out), 'AdamW step')
  T.ok(r, out)
  T.eq(r[3], 'not built yet')
  T.ok(r[9]:find('gp.optim.AdamW is nil', 1, true), r[9])
end)

-- the peer protocol with a stand-in for python3: one call per workload, JSON
-- lines matched to rows by their shape key, ratios computed
T.test('suite reads the peer JSON lines and prints ratios', function()
  local _, has_py = T.sh('command -v python3 >/dev/null')
  if has_py ~= 0 then T.skip('no python3') end
  local dir = os.tmpname()
  os.remove(dir)
  T.sh('mkdir -p ' .. dir)
  local fake = dir .. '/py'
  local f = assert(io.open(fake, 'w'))
  f:write([[#!/bin/sh
if [ "$1" = "-c" ]; then echo "9.9.9 12.8 True"; exit 0; fi
echo "$3" >> "]] .. dir .. [[/calls"
exec python3 - "$@" <<'PY'
import json, sys
a = sys.argv[1:]
cases = json.load(open(a[a.index('--cases') + 1]))
print(json.dumps({"torch": "fake"}))
for c in cases:
    print(json.dumps({"workload": a[2], "shape": c["key"], "eager_ms": 2 * c.get("iters", 1), "compile_ms": None,
                      "compile_error": "skipped"}))
PY
]])
  f:close()
  T.sh('chmod +x ' .. fake)
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. suite .. ' --quick --python ' .. fake .. ' --only add')
  T.eq(rc, 0, out)
  local rows = rows_of(out)
  local r = find_row(rows, 'add')
  T.ok(r, out)
  T.ok(out:find('torch 9.9.9', 1, true), out)
  -- eager = 2 * iters ms, shown in us; the ratio is gpush / eager
  local eager = tonumber(r[5])
  T.ok(eager and eager > 0, 'eager ' .. tostring(r[5]))
  T.eq(r[6], 'skipped')
  T.ok(tonumber(r[7]), 'ratio ' .. tostring(r[7]))
  T.near(tonumber(r[7]), tonumber(r[3]) / eager, 0.05)
  local d = find_row(rows, 'dispatch a:add_(b)')
  T.ok(d and tonumber(d[7]), out)
  -- one peer call per workload: elementwise (the add rows) and dispatch
  local calls = io.open(dir .. '/calls'):read('*a')
  T.eq(calls, 'elementwise\ndispatch\n')
  T.sh('rm -rf ' .. dir)
end)

-- the real peer, where python3 has torch (e.g. the GPU machine): eager only, tiny shapes
T.test('suite with the PyTorch peer (where torch is importable)', function()
  local _, rc0 = T.sh("python3 -c 'import torch' >/dev/null 2>&1")
  if rc0 ~= 0 then T.skip('python3 with torch not found') end
  local out, rc = T.sh(timeout(300) .. exe .. ' ' .. suite .. ' --quick --only add')
  T.eq(rc, 0, out)
  local rows = rows_of(out)
  for _, label in ipairs {'add', 'dispatch a:add_(b)', 'dispatch gp.k.add_s'} do
    local r = find_row(rows, label)
    T.ok(r, out)
    if r[5] == 'no torch' then T.skip('torch cannot use this device') end
    T.ok(tonumber(r[5]), label .. ': eager ' .. r[5] .. '\n' .. out)
    T.ok(tonumber(r[7]), label .. ': ratio ' .. r[7])
  end
end)

T.test('models bench (scripts/bench/models.lua) runs on a fixture model and prints its rows', function()
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/models.lua --model ' .. root ..
    '/tests/fixtures/models/llama_gqa --dtype f32 --prompt-len 16 --batches 1,2 --max-new 4 --reps 1 --no-torch')
  T.eq(rc, 0, out)
  T.ok(out:find('gpush prefill 16 tokens', 1, true), out)
  T.ok(out:find('gpush decode batch 2:', 1, true), out)
end)

T.test('lora launches (scripts/bench/lora_launches.lua) counts an update\'s kernels by name, and call sites', function()
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/lora_launches.lua --layers 2 --sites fill')
  T.eq(rc, 0, out)
  local total = tonumber(out:match('bf16 base, 2 layers, 4 x 24 tokens: (%d+) launches'))
  T.ok(total, out)
  local sum = 0
  for n in out:gmatch('\n  [%w_]+%s+(%d+)') do sum = sum + tonumber(n) end
  T.eq(sum, total, 'the rows add up to the total')
  T.eq(tonumber(out:match('\n  fill%s+(%d+)')), 3, out) -- none a layer (tests/lua/test_models.lua)
  T.ok(out:find('---- 1 x fill', 1, true), 'a call site of fill\n' .. out)
  out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/lora_launches.lua --layers 1 --nf4 --rows 3')
  T.eq(rc, 0, out)
  T.ok(out:find('NF4 base, 1 layers, 3 x 24 tokens', 1, true) and out:find('nf4_', 1, true), out)
  out, rc = T.sh(exe .. ' ' .. root .. '/scripts/bench/lora_launches.lua --layers x')
  T.ok(rc ~= 0 and out:find('--layers needs a number', 1, true), out)
end)

T.test('decode bench (scripts/bench/decode.lua): GPT and Llama shapes, tokens/s beside the floor', function()
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/decode.lua --model smollm2 --layers 1 ' ..
    '--batches 1,2 --max-new 2 --prompt-len 2 --reps 1 --top-p 0.9')
  T.eq(rc, 0, out)
  T.ok(out:find('smollm2 (random weights) d576, 1 layers, 9 heads (3 KV), vocab 49152', 1, true), out)
  T.ok(out:find('sampling (top-p 0.9)', 1, true), out)
  for _, B in ipairs {1, 2} do
    local tps, floor, frac = out:match('"batch": ' .. B .. ', "graph_tokens_per_s": ([%d.]+).-"floor_tokens_per_s": ([%d.]+), ' ..
      '"graph_of_floor": ([%d.]+)')
    T.ok(tonumber(tps) and tonumber(floor) > 0, 'batch ' .. B .. ' in\n' .. out)
    T.near(tonumber(frac), tonumber(tps) / tonumber(floor), 2e-3 + 1e-2 * tonumber(frac), 'batch ' .. B .. ' of floor')
  end
  out, rc = T.sh(timeout(60) .. exe .. ' ' .. root .. '/scripts/bench/decode.lua --n-embd 32 --n-layer 1 --n-head 2 ' ..
    '--batches 1 --max-new 2 --reps 1 --no-torch')
  T.eq(rc, 0, out)
  T.ok(out:find('gpt d32, 1 layers, 2 heads, vocab 256', 1, true) and out:find('"graph_of_floor"', 1, true), out)
  -- NF4 weights: the step reads fewer bytes (codes and scales counted), and --nf4 needs --bf16
  local mb = {}
  for _, f in ipairs {'', ' --nf4'} do
    out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/decode.lua --model smollm2 --layers 1 --bf16' .. f ..
      ' --batches 1 --max-new 2 --prompt-len 2 --reps 1')
    T.eq(rc, 0, out)
    mb[#mb + 1] = tonumber(out:match('; ([%d.]+) MB of weights'))
  end
  T.ok(out:find('NF4 attention and MLP weights', 1, true), out)
  -- one layer's Linears: 3,538,944 bf16 weights (7.08 MB) become 1.77 MB of codes + 0.22 MB of f32 absmax
  T.near(mb[1] - mb[2], 7.078 - 1.769 - 0.221, 0.05, 'MB saved by NF4')
  out, rc = T.sh(exe .. ' ' .. root .. '/scripts/bench/decode.lua --model smollm2 --nf4')
  T.ok(rc ~= 0 and out:find('--nf4 needs --bf16', 1, true), out)
  out, rc = T.sh(exe .. ' ' .. root .. '/scripts/bench/decode.lua --model nope')
  T.ok(rc ~= 0 and out:find('--model must be gpt, gpt2, llama1024, smollm2; got "nope"', 1, true), out)
end)

T.test('kv decode bench (scripts/bench/kv_decode.lua) prints a row per cache dtype', function()
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/kv_decode.lua --len 64 --batch 1 ' ..
    '--heads 4 --kv-heads 2 --head-dim 64 --iters 1')
  T.eq(rc, 0, out)
  for _, kvd in ipairs {'bf16', 'int8', 'fp8'} do
    local mb, ms, gbs, diff = out:match('\n  ' .. kvd .. '%s+(%S+)%s+(%S+)%s+(%S+)%s+(%S+)')
    T.ok(tonumber(mb) and tonumber(ms) and tonumber(gbs), kvd .. ' row in\n' .. out)
    T.ok(tonumber(diff) < 5e-2, kvd .. ': output differs from the bf16 cache\'s by ' .. tostring(diff))
  end
end)

T.test('kv agreement bench (scripts/bench/kv_agree.lua) compares the caches and their capacity', function()
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/kv_agree.lua --model ' .. root ..
    '/tests/fixtures/models/llama_gqa --dtype f32 --prompts 3 --max-new 4 --budget-mb 1 --center-off --floor --forced')
  T.eq(rc, 0, out)
  -- on the CPU the step is op by op either way (the one-kernel step only on the GPU): the floor row is the reference
  T.eq(out:match('\n  one kernel%s+identical continuations: (%d+) of 3'), '3', out)
  T.eq(out:match('\n  again%s+identical continuations: (%d+) of 3'), '3', out)
  -- teacher forcing over the reference's own cache and step gives back its greedy tokens at every position
  T.eq(out:match('\n  again%s+teacher%-forced top%-1: (%d+ of %d+) positions'), '12 of 12', out)
  for _, kvd in ipairs {'int8', 'int8 raw', 'fp8'} do
    local same = out:match('\n  ' .. kvd .. '%s+identical continuations: (%d+) of 3')
    T.ok(tonumber(same), kvd .. ' row in\n' .. out)
    local fs, ft = out:match('\n  ' .. kvd:gsub(' ', '%%s') .. '%s+teacher%-forced top%-1: (%d+) of (%d+) positions')
    T.ok(tonumber(fs) and tonumber(ft) == 12, kvd .. ' teacher-forced row in\n' .. out)
  end
  local f32, i8 = out:match('f32%s+most positions in 1 MiB: (%d+)'), out:match('int8%s+most positions in 1 MiB: (%d+)')
  T.ok(tonumber(f32) and tonumber(f32) > 0, out)
  T.ok(tonumber(i8) > 3 * tonumber(f32), 'int8 codes and scales hold more than 3x the f32 positions:\n' .. out)
end)

T.test('decode step profile with --random: SmolLM2\'s shapes, random weights, no checkpoint; the fused decode kernels', function()
  -- the op-by-op step (on a GPU the default runs the layers as one kernel: gp.decode_step)
  -- (f32 here and with --nf4 below, the CPU's default, so that the weights' MB compare on a GPU too)
  local cmd = '/scripts/bench/profile_decode.lua --random smollm2 --layers 1 --context 4 --top 12'
  local out, rc = T.sh('GPUSH_DECODE_STEP=0 ' .. timeout(120) .. exe .. ' ' .. root .. cmd .. ' --dtype f32')
  T.eq(rc, 0, out)
  T.ok(out:find('random smollm2, 1 layers', 1, true), out)
  T.ok(tonumber(out:match('(%d+) kernels a step')) < 20, out)
  T.ok(out:find('\n  rope_kv_at%s+1 '), out)
  T.ok(out:find('\n  swiglu_linear%s+1 '), out)
  local mb = tonumber(out:match('; ([%d.]+) MB of weights'))
  if gp.cuda_available() then -- the default (bf16): the embedding, the one kernel, the head
    local o2, rc2 = T.sh(timeout(120) .. exe .. ' ' .. root .. cmd)
    T.eq(rc2, 0, o2)
    T.ok(tonumber(o2:match('(%d+) kernels a step')) < 10, o2)
  end
  -- --nf4: q/k/v and gate/up stacked, so 4 NF4 GEMVs a layer; the weights counted as codes and scales
  out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. cmd .. ' --dtype f32 --nf4')
  T.eq(rc, 0, out)
  T.ok(out:find('(NF4 Linears)', 1, true), out)
  T.ok(out:find('\n  nf4_gemv%s+4 '), out)
  -- one layer's Linears in f32 (14.16 MB) become 1.77 MB of codes + 0.22 MB of absmax
  T.near(mb - tonumber(out:match('; ([%d.]+) MB of weights')), 14.156 - 1.769 - 0.221, 0.05, 'MB saved by NF4')
end)

T.test('decode step profile with --random gpt2: the norms take the residual adds, one rope_kv_at a layer', function()
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. root ..
    '/scripts/bench/profile_decode.lua --random gpt2 --layers 1 --context 4 --top 12')
  T.eq(rc, 0, out)
  T.ok(out:find('random gpt2, 1 layers', 1, true), out)
  T.ok(out:find('\n  add_layer_norm%s+2 ') and out:find('\n  rope_kv_at%s+1 '), out)
  T.ok(not out:find('write_at', 1, true), out)
end)

T.test('few-rows products bench (scripts/bench/few_rows.lua) prints a row per shape', function()
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/few_rows.lua --quick --rows 1,8')
  T.eq(rc, 0, out)
  T.ok(out:find('64 ->    96:  1 rows', 1, true) and out:find('8 rows', 1, true), out)
end)

T.test('decode step profile with --kv-dtype int8: the step reads the codes (attn_decode_q), the floor counts the cache', function()
  local out, rc = T.sh(timeout(120) .. exe .. ' ' .. root .. '/scripts/bench/profile_decode.lua --model ' .. root ..
    '/tests/fixtures/models/llama3_rope --context 16 --top 30 --kv-dtype int8')
  T.eq(rc, 0, out)
  T.ok(out:find('(int8 cache)', 1, true), out)
  T.ok(out:find('\n  attn_decode_q%s+%d+'), out)
  local kv = tonumber(out:match('MB of weights %+ ([%d.]+) MB of KV cache'))
  T.ok(kv and kv > 0, out)
end)

T.test('decode step profile (scripts/bench/profile_decode.lua) lists the step\'s kernels', function()
  -- op by op (on a GPU the default step is one kernel for the layers)
  local out, rc = T.sh('GPUSH_DECODE_STEP=0 ' .. timeout(120) .. exe .. ' ' .. root ..
    '/scripts/bench/profile_decode.lua --model ' .. root .. '/tests/fixtures/models/llama3_rope --context 16 --top 5')
  T.eq(rc, 0, out)
  local n = tonumber(out:match('(%d+) kernels a step'))
  T.ok(n and n > 10, out)
  -- the projections: cuBLAS on the CPU's and wider steps, gp.k.rows_linear for one row of at most 1024 on the GPU
  T.ok(out:find('\n  matmul%s+%d+') or out:find('\n  rows_linear%s+%d+'), out)
  T.ok(out:find('step: eager [%d.]+ us'), out)
end)

T.test('loss kernels bench (scripts/bench/losses.lua): a row per distillation kind and cross-entropy case', function()
  local cmd = exe .. ' ' .. root .. '/scripts/bench/losses.lua'
  local out, rc = T.sh(timeout(120) .. cmd .. ' --rounds 1 --iters 1 --rows 4 --vocab 256')
  T.eq(rc, 0, out)
  T.ok(out:find('round 1: copy', 1, true), out)
  local n = 0
  for l in out:gmatch('[^\n]+') do
    if l:find(' of copy$') then
      T.ok(tonumber(l:match('([%d.]+) us')) > 0, l)
      n = n + 1
    end
  end
  T.eq(n, 13, out) -- 9 distillation cases, 4 cross-entropy ones
  T.ok(select(2, T.sh(cmd .. ' --only ce --rounds 1 --iters 1 --rows 2 --vocab 64')) == 0)
  out, rc = T.sh(cmd .. ' --only x')
  T.ok(rc ~= 0 and out:find("--only is 'distill' or 'ce'", 1, true), out)
end)
