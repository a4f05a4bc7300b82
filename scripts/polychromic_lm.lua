-- polychromic_lm.lua: the real-model branch of scripts/polychromic.lua
-- (issue 20), run as `gpush scripts/polychromic.lua --model smollm2`: QLoRA
-- fine-tuning of SmolLM2-135M-Instruct (GGUF Q4_1, re-quantized to NF4, or
-- dense with --base bf16) on replies to lines of the Shakespeare corpus, with
-- a checked reward and set diversity from all-MiniLM-L6-v2; modes base, rl
-- and poly (or --objective X: base and X) over --seeds; a report of the
-- held-out metrics, example reply sets, the base's bytes a parameter and peak
-- memory. --bench-step times one step as JSON; --save-hf writes the weights
-- for scripts/bench/torch_polychromic.py. This file returns a function of
-- the parsed flags (scripts/polychromic.lua's).
local gp = rawget(_G, 'gp') or require 'gpush'
local L = gp.polychromic.lm

return function(o)
  local on_gpu = gp.device() == 'cuda'
  local given = o._given
  local function pick(key, cpu, gpu)
    if given[key] then return o[key] end
    return on_gpu and gpu or cpu
  end
  if o.base ~= 'nf4' and o.base ~= 'bf16' then error('--base must be nf4 or bf16, got ' .. o.base) end
  if o.embed_nf4 and o.base ~= 'nf4' then error('--embed-nf4 quantizes the embedding of an NF4 base; it does not combine with --base ' .. o.base) end
  local steps = pick('steps', 2, 60)
  local n = pick('n', 2, 8)
  local B = pick('prompts_per_step', 1, 8)
  local eval_n = pick('eval_n', n, n)
  local eval_prompts = pick('eval_prompts', 2, 32)
  local nseeds = pick('seeds', 1, 3)
  local max_new = pick('max_new', 24, 48)
  local rank = pick('lora_rank', 16, 16)
  local alpha = pick('lora_alpha', 2 * rank, 2 * rank)
  local lr = pick('lr', 3e-4, 3e-4)
  local epochs = pick('epochs', 1, 1)
  if n < 2 then error('--n must be at least 2 (a set needs pairs)') end
  if steps < 1 or B < 1 or eval_prompts < 1 or nseeds < 1 then
    error('--steps, --prompts-per-step, --eval-prompts and --seeds must be at least 1')
  end
  local modes = {'base', 'rl', 'poly'}
  if o.objective ~= '' then
    if o.objective ~= 'rl' and o.objective ~= 'poly' and o.objective ~= 'additive' then
      error('--objective with --model must be rl, poly or additive, got ' .. o.objective)
    end
    modes = {'base', o.objective}
  end
  -- poly's set diversity here: the paper's mean pair distance, among the rewarded replies (valid-only), with floor 1
  local set_div = o.set_div ~= '' and o.set_div or 'pair'
  local valid_only = given.valid_only and o.valid_only or (not given.valid_only and set_div == 'pair')
  local floor = o.floor >= 0 and o.floor or 1
  local dtype = on_gpu and 'bf16' or 'f32'

  local t0 = gp.train.now()
  local model, hf = gp.models.load(o.model, {dtype = dtype})
  print(string.format('reply model: %s (%s, %.1fM parameters) on %s, loaded in %.1f s', o.model, dtype,
    model:num_parameters() / 1e6, gp.device(), gp.train.now() - t0))
  local tok = L.tokenizer(hf)
  local text = o.text ~= '' and o.text or gp.models.path('shakespeare')
  local task = L.reply_task(L.text_lines(text), tok, {eval_prompts = eval_prompts, max_words = o.max_words})
  print(string.format('task: %d train and %d held-out prompts from %s (every 10th usable line held out)', #task.prompts,
    #task.eval_prompts, text))
  -- the bench prompts: the first B train prompts, the same every step (and in the PyTorch peer)
  local bench_prompts = {}
  for b = 1, B do bench_prompts[b] = task.prompts[b] end

  if o.save_hf ~= '' then
    gp.models.save(model, o.save_hf)
    local ids, meta = {}, {}
    for b, p in ipairs(bench_prompts) do
      ids[b] = tok:encode(p)
      meta[b] = task.meta[p]
    end
    local toks, special = {}, {}
    for i = 0, hf.vocab_size - 1 do
      toks[i + 1] = hf:id_to_token(i) or ''
      if hf.special and hf.special[toks[i + 1]] then special[#special + 1] = i end
    end
    local f = assert(io.open(o.save_hf .. '/polychromic_bench.json', 'w'))
    f:write(gp.json.encode({prompt_ids = ids, prompts = meta, stop = tok.stop, tokens = toks, special = special,
      n = n, max_new = max_new, temperature = o.temperature, top_p = o.top_p, lr = lr, epochs = epochs, clip = o.clip,
      rank = rank, alpha = alpha, max_words = o.max_words, subset_size = o.subset_size > 0 and o.subset_size or nil,
      max_subsets = o.max_subsets, floor = floor, valid_only = valid_only, set_div = set_div}))
    f:close()
    print(string.format('wrote %s (config.json, model.safetensors, polychromic_bench.json: %d prompts x %d replies, max_new %d)',
      o.save_hf, B, n, max_new))
    return
  end

  if o.base == 'nf4' then gp.nn.quantize_linears(model, {kind = 'nf4', block = o.block}) end
  if o.embed_nf4 then gp.nn.quantize_embeddings(model, {kind = 'nf4', block = o.block}) end
  gp.lora.apply(model, {rank = rank, alpha = alpha, dropout = o.lora_dropout})
  local encoder = gp.models.load(o.encoder)
  if not encoder.embed then error('--encoder: ' .. o.encoder .. ' is not a sentence encoder (a sentence-transformers directory)') end
  local mem = L.base_memory(model)
  print(string.format('frozen base: %s, %.1f MiB for %.1fM parameters = %.3f bytes a parameter%s; LoRA rank %d on every attention and MLP linear',
    o.base == 'nf4' and ('NF4 block ' .. o.block .. (o.embed_nf4 and ', the embedding and head too' or '')) or dtype, mem.bytes / 1048576, mem.params / 1e6, mem.bytes_per_param,
    mem.quant_bytes_per_param and string.format(' (the NF4 linears: %.4f)', mem.quant_bytes_per_param) or '', rank))

  -- where rollouts sample from (--sample): a dense copy of an NF4 base, refreshed before each rollout
  if o.sample ~= 'auto' and o.sample ~= 'dense' and o.sample ~= 'nf4' then error('--sample must be auto, dense or nf4, got ' .. o.sample) end
  local dense_bytes = mem.params * (dtype == 'bf16' and 2 or 4)
  local sample = o.base == 'nf4' and (o.sample == 'dense' or (o.sample == 'auto' and dense_bytes <= 2 ^ 30)) and 'dense' or o.base
  if sample == 'dense' then
    gp.polychromic.sample_from(model, gp.models.load(o.model, {dtype = dtype}))
    print(string.format('rollouts: sampled from a dense %s copy (%.1f MiB) refreshed from the NF4 base and the adapters before each',
      dtype, dense_bytes / 1048576))
  end

  local fopts = {steps = steps, n = n, prompts_per_step = B, eval_n = eval_n, max_new = max_new, temperature = o.temperature,
                 top_p = o.top_p, lr = lr, epochs = epochs, clip = o.clip, kl = o.kl, lambda = o.lambda, adv_norm = o.adv_norm,
                 subset_size = o.subset_size > 0 and o.subset_size or nil, max_subsets = o.max_subsets, floor = floor,
                 valid_only = valid_only, set_div = set_div, log_every = o.log_every, graph = o.graph}

  if o.bench_step then
    local warm = 2
    fopts.steps = warm + o.bench_steps
    fopts.objective = 'poly'
    fopts.prompt_list = bench_prompts
    fopts.embed = L.encoder_embed(encoder)
    fopts.log_every = nil
    L.reset_adapters(model, o.seed)
    gp.manual_seed(o.seed)
    local r = gp.polychromic.finetune(model, tok, task, fopts)
    local function median(key)
      local v = {}
      for i = warm + 1, #r.history do v[#v + 1] = r.history[i][key] end
      table.sort(v)
      local k = #v
      return k % 2 == 1 and v[(k + 1) / 2] or (v[k / 2] + v[k / 2 + 1]) / 2
    end
    local plen = 0
    for _, p in ipairs(bench_prompts) do plen = plen + #tok:encode(p) end
    local m = gp.memory()
    print(gp.json.encode({impl = 'gpush', base = o.base .. (o.embed_nf4 and '+embedding' or ''), sample = sample, graph = o.graph and on_gpu, dtype = dtype, device = gp.device(), prompts = B, n = n,
      max_new = max_new, epochs = epochs, rank = rank, steps = o.bench_steps, s_per_step = median('s'),
      generation_s = median('generation_s'), diversity_s = median('diversity_s'), update_s = median('update_s'),
      reply_tokens = median('reply_tokens'), prompt_tokens = plen / B, peak_mib = m.peak / 1048576,
      base_bytes_per_param = mem.bytes_per_param}))
    return
  end

  local seeds = {}
  for i = 1, nseeds do seeds[i] = o.seed + i - 1 end
  print(string.format('modes %s, seeds %s: %d steps of %d prompts x %d replies (max %d tokens, temperature %g, top-p %g), lr %g, poly: set diversity %s%s, floor %g',
    table.concat(modes, ', '), table.concat(seeds, ', '), steps, B, n, max_new, o.temperature, o.top_p, lr, set_div,
    valid_only and ' among rewarded replies' or '', floor))
  if not on_gpu then print('(on the CPU this is a smoke run: a few steps of tiny batches; the experiment runs on a GPU)') end
  fopts.modes, fopts.seeds, fopts.log, fopts.say = modes, seeds, o.log, print
  local report = L.run(model, tok, task, encoder, fopts)
  print('')
  print(L.format(report))
  if o.log ~= '' then print('log: ' .. o.log) end
  print(string.format('total %.1f s', gp.train.now() - t0))
  if o.json ~= '' then
    local f = assert(io.open(o.json, 'a'))
    f:write(gp.json.encode({model = o.model, base = o.base, device = gp.device(), steps = steps, n = n, prompts_per_step = B,
      seeds = seeds, mean = report.mean, per_seed = report.per_seed, base_memory = report.base_memory,
      peak_mib = report.memory and report.memory.peak / 1048576}), '\n')
    f:close()
  end
end
