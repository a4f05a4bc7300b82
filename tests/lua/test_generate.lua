-- gp.generate and GPT:forward_cached: cached logits equal the full forward,
-- greedy generation equals the argmax of the full forward token by token,
-- n samples per prompt in one batch, stop tokens, streaming, bad input.
local T = require 'lib'
local gp = require 'gpush'
local nn = gp.nn
local cpu = {device = 'cpu'}

local function small_gpt(device, vocab)
  gp.manual_seed(5)
  local m = nn.GPT {vocab_size = vocab or 37, block_size = 24, n_embd = 32, n_layer = 2, n_head = 4, device = device}
  -- larger weights than the GPT-2 init so that logits are far from uniform
  m:init_weights(0.2)
  return m:eval()
end

local function new_cache(gp_, m, batch, cap)
  local c = m.config
  local Cache = gp_.KVCache or function(o) return require('gpush.models.generate').simple_cache(o) end
  return Cache {batch = batch, heads = c.n_head, capacity = cap, head_dim = c.n_embd / c.n_head, layers = c.n_layer,
                dtype = 'f32', device = m.wte.weight.device}
end

T.test('forward_cached: prefill then one token at a time equals the full forward (cpu)', function()
  local m = small_gpt('cpu')
  gp.no_grad(function()
    local idx = gp.randint(0, 37, {3, 9}, {device = 'cpu'})
    local full = m(idx)
    local cache = new_cache(gp, m, 3, 12)
    local pre = m:forward_cached(idx:narrow(2, 1, 5), cache, 0)
    T.ok(T.relnorm(pre, full:narrow(2, 1, 5)) < 1e-5, 'prefill logits')
    for t = 6, 9 do
      local lg = m:forward_cached(idx:narrow(2, t, 1):contiguous(), cache, t - 1)
      T.ok(T.relnorm(lg, full:narrow(2, t, 1)) < 1e-5, 'decode logits at ' .. t)
    end
    T.eq(cache:len(), 9)
    -- a chunk of several new tokens after a prefill (causal within the chunk)
    cache:reset()
    m:forward_cached(idx:narrow(2, 1, 3), cache, 0)
    local chunk = m:forward_cached(idx:narrow(2, 4, 6), cache, 3)
    T.ok(T.relnorm(chunk, full:narrow(2, 4, 6)) < 1e-5, 'chunked prefill')
  end)
end)

-- replay one row with the full, uncached forward: every generated token is the argmax
local function check_greedy(m, prompt, gen)
  local seq = {}
  for i, v in ipairs(prompt) do seq[i] = v end
  gp.no_grad(function()
    for i, g in ipairs(gen) do
      local logits = m(gp.tensor({seq}, {dtype = 'i64', device = 'cpu'}))
      local want = logits:select(2, #seq):argmax(-1):item()
      T.eq(g, want, 'greedy token ' .. i)
      seq[#seq + 1] = g
    end
  end)
end

T.test('generate: greedy equals the argmax of the full forward token by token (cpu, prompts of different lengths)', function()
  local m = small_gpt('cpu')
  local prompts = {{1, 2, 3}, {7}, {4, 5, 6, 7, 8, 9}}
  local r = gp.generate(m, prompts, {greedy = true, max_new = 10, n = 2})
  T.eq(#r.lists, 6)
  T.same(r.tokens.shape, {6, 16})
  for row = 1, 6 do
    local b = math.floor((row - 1) / 2) + 1
    T.eq(#r.lists[row], 10)
    check_greedy(m, prompts[b], r.lists[row])
    -- the prompt is kept at the start of its row
    local t = r.tokens:totable()[row]
    for i, v in ipairs(prompts[b]) do T.eq(t[i], v) end
  end
  -- both samples of a prompt agree under greedy
  T.same(r.lists[1], r.lists[2])
  T.eq(m.training, false)
end)

T.test('generate: n samples per prompt in one batch, streamed, seeded, decoded with the byte tokenizer', function()
  local m = small_gpt('cpu', 256)
  local steps, widths = 0, {}
  gp.manual_seed(3)
  local r = gp.generate(m, {'ab', 'xyz'}, {n = 3, max_new = 6, temperature = 1.0, top_k = 50, top_p = 0.95,
    callback = function(step, ids) steps = step; widths[#widths + 1] = #ids end})
  -- prefill over the common prefix (2 tokens): positions 2..8 are decode steps
  T.eq(steps, 7)
  for _, w in ipairs(widths) do T.eq(w, 6) end
  T.eq(#r.text, 6)
  for row = 1, 6 do T.eq(type(r.text[row]), 'string') end
  -- 'xyz' rows: the decode step at position 2 feeds the prompt's 'z', not a sample
  T.eq(r.tokens:totable()[4][3], string.byte('z'))
  gp.manual_seed(3)
  local r2 = gp.generate(m, {'ab', 'xyz'}, {n = 3, max_new = 6, temperature = 1.0, top_k = 50, top_p = 0.95})
  T.same(r2.lists, r.lists)
  -- with min-p and a repetition penalty
  local r3 = gp.generate(m, {'ab'}, {n = 4, max_new = 5, min_p = 0.05, repetition_penalty = 1.3})
  T.eq(#r3.lists, 4)
end)

T.test('generate: stop tokens end a row (not counted), prompts may contain them', function()
  local m = small_gpt('cpu')
  local g = gp.generate(m, {{1, 2, 3}}, {greedy = true, max_new = 8})
  local stop = g.lists[1][3]
  local first
  for i, v in ipairs(g.lists[1]) do if v == stop then first = i; break end end
  local r = gp.generate(m, {{1, 2, 3}, {stop, 2, 3}}, {greedy = true, max_new = 8, stop = {stop}, check_every = 1})
  T.eq(#r.lists[1], first - 1)
  for i = 1, first - 1 do T.eq(r.lists[1][i], g.lists[1][i]) end
  -- the second prompt starts with the stop token: it does not end the row
  T.ok(#r.lists[2] > 0 or r.tokens:totable()[2][4] == stop)
end)

T.test('generate and KV caches: bad input gives clear errors', function()
  local m = small_gpt('cpu')
  T.raises(function() gp.generate(m, {{1, 2, 3}}, {max_new = 22}) end, 'generate', 'block_size', '25')
  T.raises(function() gp.generate(m, {{1, 2}}, {top_p = 0}) end, 'top_p')
  T.raises(function() gp.generate(m, {{1, 2}}, {temperature = -1}) end, 'temperature')
  T.raises(function() gp.generate(m, {{1, 2}}, {top_k = 38}) end, 'top_k', 'V = 37')
  T.raises(function() gp.generate(m, {{1, 40}}) end, 'generate', 'prompt 1 token 2')
  T.raises(function() gp.generate(m, {{}}) end, 'generate', 'empty')
  T.raises(function() gp.generate(m, {{1}}, {n = 0}) end, 'generate', 'n')
  T.raises(function() gp.generate({}, {{1}}) end, 'generate', 'forward_cached')
  -- a sequence longer than the cache
  local cache = new_cache(gp, m, 2, 4)
  gp.no_grad(function()
    m:forward_cached(gp.zeros({2, 3}, {dtype = 'i64', device = 'cpu'}), cache, 0)
    T.raises(function() m:forward_cached(gp.zeros({2, 2}, {dtype = 'i64', device = 'cpu'}), cache, 3) end, 'capacity')
    T.raises(function() m:forward_cached(gp.zeros({2, 30}, {dtype = 'i64', device = 'cpu'}), cache, 0) end, 'block_size')
    T.raises(function() m:forward_cached(gp.zeros({2, 2}, cpu), cache, 0) end, 'forward_cached', 'i64')
  end)
end)

T.test('generate (cuda): greedy tokens equal the CPU ones; sampling runs', function()
  T.cuda()
  local m = small_gpt('cpu')
  local prompts = {{1, 2, 3}, {7}, {4, 5, 6, 7}}
  local a = gp.generate(m, prompts, {greedy = true, max_new = 8})
  local mc = small_gpt('cuda')
  local b = gp.generate(mc, prompts, {greedy = true, max_new = 8})
  T.same(b.lists, a.lists)
  local s = gp.generate(mc, prompts, {n = 4, max_new = 8, top_p = 0.9, repetition_penalty = 1.2, stop = {0}})
  T.eq(#s.lists, 12)
end)

T.test('scripts/sample.lua: a train_gpt.lua checkpoint and --random, streamed, tokens/s', function()
  local exe = T.exe
  local ck = os.tmpname() .. '.safetensors'
  local out, rc = T.sh(exe .. ' --device cpu scripts/train_gpt.lua --iters 2 --n-embd 16 --n-layer 1 --n-head 2 --block 16' ..
    ' --batch 2 --eval-every 0 --eval-iters 1 --quiet --out ' .. ck)
  T.eq(rc, 0, out)
  out, rc = T.sh(exe .. " --device cpu scripts/sample.lua --ckpt " .. ck .. " --max-new 6 --greedy 'the '")
  T.eq(rc, 0, out)
  T.ok(out:find('the ', 1, true) and out:find('6 tokens in', 1, true) and out:find('tokens/s', 1, true), out)
  -- the README's prompt: 'R' is not in data/corpus.txt, but the default vocabulary (printable) has it
  out, rc = T.sh(exe .. " --device cpu scripts/sample.lua --ckpt " .. ck .. " --max-new 4 'ROMEO:'")
  T.eq(rc, 0, out)
  T.ok(out:find('ROMEO:', 1, true), out)
  -- a byte outside the vocabulary is a clear error that says which vocabularies have it
  out, rc = T.sh(exe .. " --device cpu scripts/sample.lua --ckpt " .. ck .. " --max-new 4 'caf\xc3\xa9'")
  os.remove(ck)
  T.ok(rc ~= 0 and out:find('byte 195', 1, true) and out:find('--vocab bytes', 1, true), out)
  out, rc = T.sh(exe .. " --device cpu scripts/sample.lua --random --n-embd 16 --n-layer 1 --n-head 2 --block 32" ..
    " --max-new 5 --n 3 --top-k 40 --top-p 0.9 --temperature 0.8 'ab' 'c'")
  T.eq(rc, 0, out)
  T.ok(out:find('prompt 2, sample 3', 1, true) and out:find('30 tokens in', 1, true), out)
  out, rc = T.sh(exe .. " --device cpu scripts/sample.lua --random --n-embd 16 --n-layer 1 --n-head 2 --block 8 --max-new 20 'ab'")
  T.ok(rc ~= 0 and out:find('block_size', 1, true), out)
end)

-- head dim 64: the decode step takes its position from device memory (the
-- path CUDA graphs capture); it must give the tokens of the host-position loop
local function gpt64(device)
  gp.manual_seed(9)
  local m = nn.GPT {vocab_size = 29, block_size = 20, n_embd = 64, n_layer = 2, n_head = 1, device = device}
  m:init_weights(0.2)
  return m:eval()
end

-- the same seeded sampling run with opts[off] = true (default) and false: equal tokens
local function sampled_twice(m, prompts, n, off)
  local o = {n = n, max_new = 8, temperature = 0.9, top_k = 10, top_p = 0.95, repetition_penalty = 1.3, stop = {3},
             check_every = 2}
  gp.manual_seed(21)
  local c = gp.generate(m, prompts, o)
  gp.manual_seed(21)
  o[off] = false
  local d = gp.generate(m, prompts, o)
  T.same(c.tokens:totable(), d.tokens:totable())
  return c, d
end

T.test('generate: the device-position step equals the host-position loop (cpu; greedy, sampling, penalty, stops)', function()
  local m = gpt64('cpu')
  T.ok(m:supports_device_positions(gp.KVCache {batch = 1, heads = 1, capacity = 4, head_dim = 64, device = 'cpu'}))
  local prompts = {{1, 2, 3}, {4, 5, 6, 7, 8}}
  local a = gp.generate(m, prompts, {greedy = true, max_new = 9, n = 2})
  local b = gp.generate(m, prompts, {greedy = true, max_new = 9, n = 2, device_pos = false})
  T.ok(a.device_positions and not b.device_positions)
  T.same(a.tokens:totable(), b.tokens:totable())
  local c, d = sampled_twice(m, prompts, 3, 'device_pos')
  T.same(c.lists, d.lists)
  -- streaming through the callback
  local seen = 0
  gp.generate(m, {{1}}, {greedy = true, max_new = 4, callback = function(step, ids) seen = step; T.eq(#ids, 1) end})
  T.eq(seen, 4)
  -- the cache's host count follows the device positions
  local cache = gp.KVCache {batch = 1, heads = 1, capacity = 20, head_dim = 64, layers = 2, device = 'cpu'}
  gp.generate(m, {{1, 2}}, {greedy = true, max_new = 5, cache = cache})
  T.eq(cache:len(), 6)
  -- the step writes k and v and copies q out in one kernel a layer (rope_kv_at at zero angles), and its residual
  -- adds run in the LayerNorms (add_layer_norm)
  local _, k = T.launches(function()
    m:forward_cached(gp.zeros({1, 1}, {dtype = 'i64', device = 'cpu'}), cache, gp.full({1}, 6, {dtype = 'i64', device = 'cpu'}))
  end)
  T.eq(k.rope_kv_at, 2, 'rope_kv_at a layer')
  T.eq(k.write_at or 0, 0, 'no separate k and v writes')
  T.eq(k.add_layer_norm, 4, 'residual adds in the norms')
  -- a device position past the cache is an error
  local small = gp.KVCache {batch = 1, heads = 1, capacity = 6, head_dim = 64, layers = 2, device = 'cpu'}
  local pos = gp.full({1}, 6, {dtype = 'i64', device = 'cpu'})
  T.raises(function() m:forward_cached(gp.zeros({1, 1}, {dtype = 'i64', device = 'cpu'}), small, pos) end, 'rope_kv_at', 'position 6')
end)

T.test('generate (cuda): the decode step replayed as a CUDA graph equals the eager step exactly', function()
  T.cuda()
  local m = gpt64('cuda')
  local prompts = {{1, 2, 3}, {4, 5, 6, 7, 8}}
  local a = gp.generate(m, prompts, {greedy = true, max_new = 12, n = 2})
  T.ok(a.graph, 'captured')
  local b = gp.generate(m, prompts, {greedy = true, max_new = 12, n = 2, graph = false})
  T.ok(not b.graph)
  T.same(a.tokens:totable(), b.tokens:totable())
  local cpu_m = gpt64('cpu')
  T.same(gp.generate(cpu_m, prompts, {greedy = true, max_new = 12, n = 2}).tokens:totable(), a.tokens:totable())
  sampled_twice(m, prompts, 4, 'graph')
end)

T.test('generate (cuda): the captured step is kept for the next call of the same shape; new weights are read, a replaced one captures anew', function()
  T.cuda()
  local m = gpt64('cuda')
  local prompts = {{1, 2, 3}, {4, 5, 6, 7, 8}}
  local o = {n = 2, max_new = 8, temperature = 0.9, top_k = 10, top_p = 0.95, repetition_penalty = 1.3, stop = {3},
             check_every = 2}
  local function run(seed, p, graph)
    o.graph = graph
    gp.manual_seed(seed)
    local r = gp.generate(m, p, o)
    o.graph = nil
    return r
  end
  local a = run(21, prompts)
  T.ok(a.graph and not a.graph_reused, 'captured')
  local b = run(21, prompts)
  T.ok(b.graph_reused, 'the second call replays the kept graph')
  T.same(a.tokens:totable(), b.tokens:totable())
  -- other prompts of the same shape, and weights changed in place: replayed, equal to the eager step
  gp.no_grad(function() m.ln_f.weight:mul_(1.7) end)
  local p2 = {{7, 7, 1}, {2, 2, 2, 2, 9}}
  local c = run(4, p2)
  T.ok(c.graph_reused)
  local d = run(4, p2, false) -- another key: the kept graph is freed
  T.ok(not d.graph and not d.graph_reused)
  T.same(c.tokens:totable(), d.tokens:totable())
  T.eq(rawget(m, '_generate_session'), nil)
  local e = run(4, p2)
  T.ok(e.graph and not e.graph_reused)
  -- a replaced weight: captured anew (the kept graph would read the old tensor)
  m.ln_f.weight = nn.Parameter(gp.no_grad(function() return m.ln_f.weight:clone():mul_(0.5) end))
  local f = run(4, p2)
  T.ok(f.graph and not f.graph_reused, 'a replaced parameter captures anew')
  T.same(f.tokens:totable(), run(4, p2, false).tokens:totable())
  -- keep_graph = false: nothing kept
  o.keep_graph = false
  run(4, p2)
  T.eq(rawget(m, '_generate_session'), nil)
end)

T.test('generate (cuda): LoRA adapters unmerged, merged (gp.lora.merged) or switched off each get their own graph', function()
  T.cuda()
  local m = gpt64('cuda')
  local prompts = {{1, 2, 3}, {4, 5, 6, 7, 8}}
  local o = {n = 2, max_new = 8, greedy = true}
  local base = gp.generate(m, prompts, o).tokens:totable()
  gp.lora.apply(m, {rank = 4})
  for _, nm in ipairs(gp.lora.modules(m)) do nn.init.normal_(nm[2].lora_B, 0, 0.5) end
  local function eager() o.graph = false; local r = gp.generate(m, prompts, o); o.graph = nil; return r.tokens:totable() end
  local want = eager()
  T.ok(T.relnorm(gp.tensor(want), gp.tensor(base)) > 0, 'the adapters change the tokens')
  local a = gp.generate(m, prompts, o)
  T.same(a.tokens:totable(), want)
  local b = gp.lora.merged(m, gp.generate, m, prompts, o)
  T.ok(not b.graph_reused, 'merged: another graph')
  T.same(b.tokens:totable(), want)
  local c = gp.lora.without(m, gp.generate, m, prompts, o)
  T.ok(not c.graph_reused, 'switched off: another graph')
  T.same(c.tokens:totable(), base)
  T.same(gp.generate(m, prompts, o).tokens:totable(), want)
end)
