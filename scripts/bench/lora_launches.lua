-- lora_launches.lua: the kernel launches of one LoRA update of the polychromic
-- experiment (issue #20), by kernel name, and where chosen kernels are called
-- from. The update: token log-probs of the last positions with autograd, the
-- PPO loss, backward, gradient clipping, the AdamW step, over a Llama of the
-- tiny fixture's widths with --layers layers (30: SmolLM2's depth) and tied
-- embeddings. Counts are device-independent (the same Lua runs the same kernels).
-- Run: gpush scripts/bench/lora_launches.lua [--nf4] [--layers 30] [--rows 4] [--len 24] [--dtype bf16]
--        [--sites copy,fill]   (a traceback per call site of those kernels, by count)
local o = {nf4 = false, layers = 30, rows = 4, len = 24, dtype = 'bf16', sites = ''}
local i = 1
while arg and arg[i] do
  local a = arg[i]
  if a == '--nf4' then o.nf4 = true
  elseif a == '--layers' or a == '--rows' or a == '--len' then
    o[a:sub(3)] = tonumber(arg[i + 1]) or error(a .. ' needs a number'); i = i + 1
  elseif a == '--dtype' or a == '--sites' then
    o[a:sub(3)] = arg[i + 1] or error(a .. ' needs a value'); i = i + 1
  else error('unknown option ' .. a) end
  i = i + 1
end
local tensor = require 'gpush.core.tensor'
local root = (GPUSH_ROOT or '.') .. '/tests/fixtures/models/llama_gqa'
local c = {}
for k, v in pairs(gp.models.load(root, {dtype = o.dtype, device = 'cpu'}).config) do c[k] = v end
c.num_hidden_layers, c.tie_word_embeddings = o.layers, true
gp.manual_seed(1)
local m = gp.models.Llama(c, {dtype = o.dtype, device = 'cpu'})
if o.nf4 then gp.nn.quantize_linears(m, {kind = 'nf4', block = 64}) end
gp.lora.apply(m, {rank = 16, alpha = 32})
for _, nm in ipairs(gp.lora.modules(m)) do gp.nn.init.normal_(nm[2].lora_B, 0, 0.02) end
local opt = gp.optim.AdamW(gp.lora.parameters(m), {lr = 1e-4, weight_decay = 0})
local from = math.min(6, o.len - 1)
local full = gp.randint(0, c.vocab_size, {o.rows, o.len}, {dtype = 'i64', device = 'cpu'})
local tg = gp.randint(0, c.vocab_size, {o.rows, o.len - from}, {dtype = 'i64', device = 'cpu'})
local mask, adv = tg:ne(-100):float(), gp.randn({o.rows}, {device = 'cpu'})
m:train()
local old
local function update() local _; _, old = gp.polychromic.ppo_step(m, opt, full, tg, adv, mask, {old = old, clip = 0.2}) end
update() -- the optimizer's state and the old log-probs
local counts, sites, want = {}, {}, {}
for s in o.sites:gmatch('[^,]+') do want[s] = true end
local saved = {}
for _, tbl in ipairs {gp.k, tensor.K} do
  local names = {}
  for name in pairs(tbl) do names[#names + 1] = name end
  for _, name in ipairs(names) do
    local f = tbl[name]
    saved[#saved + 1] = {tbl, name, f}
    tbl[name] = function(...)
      counts[name] = (counts[name] or 0) + 1
      if want[name] then
        local key = name .. debug.traceback('', 2):gsub('\n%s*%[C%]: in function[^\n]*', '')
        sites[key] = (sites[key] or 0) + 1
      end
      return f(...)
    end
  end
end
local ok, err = pcall(update)
for j = #saved, 1, -1 do saved[j][1][saved[j][2]] = saved[j][3] end
if not ok then error(err, 0) end
local list, total = {}, 0
for k, v in pairs(counts) do list[#list + 1] = {k, v}; total = total + v end
table.sort(list, function(a, b) return a[2] > b[2] or (a[2] == b[2] and a[1] < b[1]) end)
print(string.format('one LoRA update: %s base, %d layers, %d x %d tokens: %d launches', o.nf4 and 'NF4' or o.dtype,
  o.layers, o.rows, o.len, total))
for _, kv in ipairs(list) do print(string.format('  %-26s %6d', kv[1], kv[2])) end
local sl = {}
for k, v in pairs(sites) do sl[#sl + 1] = {k, v} end
table.sort(sl, function(a, b) return a[2] > b[2] end)
for _, kv in ipairs(sl) do print(string.format('---- %d x %s', kv[2], kv[1])) end
