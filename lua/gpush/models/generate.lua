-- gp.generate: batched autoregressive generation with a KV cache.
--
--   local r = gp.generate(model, {'Hello', 'The'}, {n = 4, max_new = 100, temperature = 0.8, top_p = 0.9})
--   r.text[1] .. r.text[8]     -- B prompts x n samples, prompt-major (row (b-1)*n + s)
--
-- All B x n rows run together in one batch: one prefill over the common
-- prompt prefix, then one decode step per position. Rows whose prompt is
-- longer than the shortest are fed their own prompt tokens during the first
-- decode steps (the sampled token is replaced by the prompt token), so every
-- row sits at the same position and no padding or masks are needed.
--
-- A decode step queues only kernels: the penalty and sampling kernels write
-- into buffers made before the loop, the prompt override, the token write and
-- the stop-token bookkeeping are kernels on device tensors, and nothing is
-- read on the host unless a callback is given or the stop check is due
-- (every `check_every` steps). With a model that takes device positions
-- (nn.GPT with a head dim decode attention takes, and a gp.KVCache), the step reads its
-- position from a device scalar (KV-cache writes, the position embedding,
-- the decode-attention lengths, the token column), so on the GPU it is
-- captured as a CUDA graph (gp.graph) after one eager warm-up step, and
-- replayed per token; the graph and its buffers (the KV cache included) stay
-- on the model for the next call with the same shape, sampling options and
-- parameter tensors, which replays it at once (opts.keep_graph = false frees
-- them at the end of the call instead); random draws come from the seeded
-- generator as the eager step would take them, so opts.graph = false (the
-- same step run eagerly) gives the same tokens. opts.device_pos = false
-- takes the older host-position loop.
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local lora = require 'gpush.nn.lora'
local raise = rt.raise

local M = {}

-- byte-level tokenizer: ids 0..255 are the bytes
M.bytes = {
  encode = function(_, s)
    local r = {}
    for i = 1, #s do r[i] = s:byte(i) end
    return r
  end,
  decode = function(_, ids)
    local c = {}
    for i, v in ipairs(ids) do c[i] = string.char(v % 256) end
    return table.concat(c)
  end,
}

-- a KV cache for gpush builds without gp.KVCache: per layer a (B, H, capacity, D)
-- key and value buffer; append copies into the next positions
local SimpleCache = {}
SimpleCache.__index = SimpleCache
M.SimpleCache = SimpleCache
function M.simple_cache(o)
  local self = setmetatable({o = o, k = {}, v = {}, n = {}}, SimpleCache)
  for l = 1, o.layers do
    self.k[l] = gp.empty({o.batch, o.heads, o.capacity, o.head_dim}, {dtype = o.dtype, device = o.device})
    self.v[l] = gp.empty({o.batch, o.heads, o.capacity, o.head_dim}, {dtype = o.dtype, device = o.device})
    self.n[l] = 0
  end
  return self
end
function SimpleCache:append(layer, k, v)
  local n, t = self.n[layer], k:size(3)
  if n + t > self.o.capacity then
    raise(string.format('KVCache: appending %d positions to the %d held exceeds the capacity %d', t, n, self.o.capacity))
  end
  self.k[layer]:narrow(3, n + 1, t):copy_(k)
  self.v[layer]:narrow(3, n + 1, t):copy_(v)
  self.n[layer] = n + t
end
function SimpleCache:len() return self.n[#self.n] end
function SimpleCache:reset() for l = 1, #self.n do self.n[l] = 0 end end
function SimpleCache:keys(layer) return self.k[layer]:narrow(3, 1, self.n[layer]) end
function SimpleCache:values(layer) return self.v[layer]:narrow(3, 1, self.n[layer]) end

local function encode_prompts(prompts, tok, V)
  if type(prompts) == 'string' then prompts = {prompts} end
  if type(prompts) ~= 'table' or #prompts == 0 then raise('generate: prompts must be a non-empty list of strings or token lists') end
  local lists = {}
  for b, p in ipairs(prompts) do
    local ids
    if type(p) == 'string' then ids = tok:encode(p)
    elseif type(p) == 'table' then ids = p
    else raise(string.format('generate: prompt %d is a %s, not a string or a list of token ids', b, type(p))) end
    if #ids == 0 then raise(string.format('generate: prompt %d is empty (give at least one token)', b)) end
    for i, v in ipairs(ids) do
      if type(v) ~= 'number' or v < 0 or v >= V or v ~= math.floor(v) then
        raise(string.format('generate: prompt %d token %d is %s, not an id in [0, %d)', b, i, tostring(v), V))
      end
    end
    lists[b] = ids
  end
  return lists
end

-- what a captured decode step depends on: the batch and positions, the
-- sampling options (kernel arguments in the graph) and the address of every
-- parameter (a replaced weight, LoRA adapters added, :to(), ... make another
-- key: the graph would read the old memory); in-place updates keep the key.
-- LoRA adapters merged or not, enabled or not run different kernels over the
-- same tensors: their states are part of the key
local function session_key(model, R, total, dtype, kvd, temp, top_k, top_p, min_p, pen, stops, pad)
  local k = {R, total, dtype, tostring(kvd), temp, top_k, top_p, min_p, pen, tostring(pad), table.concat(stops, ',')}
  for _, p in ipairs(model:parameters()) do
    local c = p.c
    k[#k + 1] = string.format('%s+%d', tostring(c.data), tonumber(c.offset))
  end
  for _, nm in ipairs(lora.modules(model)) do
    k[#k + 1] = (nm[2].merged and 'M' or 'm') .. (nm[2].enabled and 'E' or 'e')
  end
  return table.concat(k, '|')
end

function M.generate(model, prompts, opts)
  opts = opts or {}
  if type(model) ~= 'table' or not model.forward_cached then raise('generate: the model needs forward_cached (nn.GPT has it)') end
  local cfg = model.config or {}
  local V, H, C, L, bs = cfg.vocab_size, cfg.n_head, cfg.n_embd, cfg.n_layer, cfg.block_size
  if not (V and H and C and L and bs) then raise('generate: model.config needs vocab_size, n_head, n_embd, n_layer, block_size') end
  local tok = opts.tokenizer or M.bytes
  local lists = encode_prompts(prompts, tok, V)
  local n = opts.n or 1
  if n < 1 or n ~= math.floor(n) then raise('generate: n (samples per prompt) must be a positive integer, got ' .. tostring(n)) end
  local max_new = opts.max_new or 64
  if max_new < 1 or max_new ~= math.floor(max_new) then raise('generate: max_new must be a positive integer') end
  local temp, top_k, top_p, min_p, pen = gp.sample_options(opts, V)
  local R = #lists * n
  local lmin, lmax = math.huge, 0
  for _, ids in ipairs(lists) do lmin, lmax = math.min(lmin, #ids), math.max(lmax, #ids) end
  local total = lmax + max_new
  if total > bs then
    raise(string.format('generate: the longest prompt (%d tokens) + max_new (%d) = %d positions is longer than the cache and the model\'s block_size (%d)',
      lmax, max_new, total, bs))
  end
  -- stop: explicit ids, else the tokenizer's end-of-reply ids (tok:stop_ids(): eos, <|im_end|>, ...), else none
  local stops = opts.stop
  if stops == nil then stops = opts.tokenizer and opts.tokenizer.stop_ids and opts.tokenizer:stop_ids() or {} end
  if type(stops) == 'number' then stops = {stops} end
  local w = model.lm_head and model.lm_head.weight or model:parameters()[1]
  local dev, dtype = w.device, w.dtype
  local Cache = gp.KVCache or function(o) return M.simple_cache(o) end
  local kvd = opts.kv_dtype -- 'int8' / 'fp8': a compressed gp.KVCache (gp.KVCache checks the name)
  local use_graph = opts.graph
  if use_graph == nil then use_graph = true end
  -- the last call's captured step, reused when this call has the same shape,
  -- options and parameter tensors (session_key): its buffers are refilled
  local key = use_graph and dev == 'cuda' and not opts.cache and opts.keep_graph ~= false and
    session_key(model, R, total, dtype, kvd, temp, top_k, top_p, min_p, pen, stops, opts.pad)
  local session = rawget(model, '_generate_session')
  if session and session.key ~= key then
    session.g:free()
    rawset(model, '_generate_session', nil)
    session = nil
  end
  local cache = opts.cache or session and session.cache or
    (model.new_cache and model:new_cache(R, total, dtype, dev, kvd)) or
    Cache {batch = R, heads = H, capacity = total, head_dim = C / H, layers = L, dtype = dtype, device = dev,
           kv_dtype = kvd}
  if session then cache:reset() end

  -- prompts (row-major, prompt-major rows) and the mask of prompt positions
  local tok_h, mask_h = {}, {}
  for b, ids in ipairs(lists) do
    for s = 1, n do
      local r = (b - 1) * n + s
      local tr, mr = {}, {}
      for j = 1, total do tr[j] = ids[j] or 0; mr[j] = ids[j] and 1 or 0 end
      tok_h[r], mask_h[r] = tr, mr
    end
  end
  -- the decode step's buffers: the kept step's own, refilled, or new ones
  local b = session and session.buf
  if b then
    b.tokens:copy_(gp.tensor(tok_h, {dtype = 'i64'}))
    b.mask:copy_(gp.tensor(mask_h, {dtype = 'u8'}))
    for _, t in ipairs {b.lens, b.nxt, b.done, b.hit} do gp.k.fill(t, 0) end
  else
    local function z(shape, dt) return gp.zeros(shape, {dtype = dt, device = dev}) end
    b = {tokens = gp.tensor(tok_h, {dtype = 'i64', device = dev}), mask = gp.tensor(mask_h, {dtype = 'u8', device = dev}),
         lens = z({R}, 'i64'), nxt = z({R}, 'i64'), probs = gp.empty({R, V}, {dtype = dtype, device = dev}),
         penalized = pen ~= 1 and gp.empty({R, V}, {dtype = dtype, device = dev}) or nil,
         done = z({R}, 'u8'), hit = z({R}, 'u8'), zero8 = z({R}, 'u8'),
         pad = gp.full({R}, opts.pad or (stops[1] or 0), {dtype = 'i64', device = dev}),
         pos = z({1}, 'i64'), tcol = z({R, 1, 1}, 'i64'), mcol = z({R, 1, 1}, 'u8')}
  end
  local tokens, mask, lens, nxt, probs, penalized, done, hit, zero8, pad =
    b.tokens, b.mask, b.lens, b.nxt, b.probs, b.penalized, b.done, b.hit, b.zero8, b.pad
  local callback, check_every = opts.callback, opts.check_every or 16

  local was_training = model.training
  model:eval()
  local device_pos = opts.device_pos ~= false and model.supports_device_positions ~= nil and
    model:supports_device_positions(cache)
  local stats = {graph = false, steps = 0, reused = false}
  -- the penalty (lens: the history length, set by set_lens) and the draw into nxt
  local function draw(x, set_lens)
    if penalized then
      set_lens(lens)
      gp.k.repetition_penalty(penalized, x, tokens, lens, pen)
      x = penalized
    end
    gp.k.sample(nxt, probs, x, temp, top_k, top_p, min_p)
  end
  local ok, err = pcall(gp.no_grad, function()
    local logits = model:forward_cached(tokens:narrow(2, 1, lmin), cache, 0)
    local last = logits:select(2, lmin):contiguous()
    if device_pos then
      -- The decode step reads its position from device memory (pos, i64 [1]:
      -- the position being filled), so the same queued kernels serve every
      -- token: on the GPU the step is captured once as a CUDA graph and
      -- replayed per token (opts.graph = false runs it eagerly: the same
      -- kernels, the same numbers).
      local pos, tcol, mcol = b.pos, b.tcol, b.mcol
      gp.k.fill(pos, lmin)
      local tok3, tok4 = tokens:view {R, total, 1}, tokens:view {R, 1, total, 1}
      local mask3 = mask:view {R, total, 1}
      local tcol1, mcol1, nxt4 = tcol:view {R}, mcol:view {R}, nxt:view {R, 1, 1, 1}
      -- sample position pos from logits x, apply the prompt and stop rules, write the token
      local function set_lens(l) gp.k.copy(l, pos) end
      local function sample_at(x)
        draw(x, set_lens)
        gp.k.index_select(tcol, tok3, pos)
        gp.k.index_select(mcol, mask3, pos)
        gp.k.where(nxt, mcol1, tcol1, nxt) -- rows still in their prompt
        gp.k.where(nxt, done, pad, nxt)    -- finished rows
        gp.k.write_at(tok4, nxt4, pos)
        for _, st in ipairs(stops) do
          gp.k.eq_s(hit, nxt, st)
          gp.k.where(hit, mcol1, zero8, hit)
          gp.k.maximum(done, done, hit)
        end
      end
      -- one token: the forward of nxt at pos, then the next position sampled
      local function step()
        local lg = model:forward_cached(nxt:view {R, 1}, cache, pos):view {R, V}
        gp.k.add_s(pos, pos, 1)
        sample_at(lg)
      end
      sample_at(last)
      local cur, g = lmin, session and session.g
      stats.reused = g ~= nil
      while true do
        stats.steps = cur - lmin + 1
        if callback then callback(stats.steps, nxt:totable()) end
        if cur == total - 1 then break end
        if #stops > 0 and stats.steps % check_every == 0 and done:min():item() == 1 then break end
        cur = cur + 1
        if g then
          g:replay()
          stats.graph = true
        elseif use_graph and dev == 'cuda' and cur > lmin + 1 then -- after one eager step (warm-up)
          g = gp.graph(step)
          g:replay()
          stats.graph = true
        else
          step()
        end
      end
      if g and key and not session then -- kept for the next call of the same shape
        rawset(model, '_generate_session', {key = key, g = g, cache = cache, buf = b})
      elseif g and not session then
        g:free()
      end
      if cache.set_len then cache:set_len(cur) end
      return
    end
    local step = 0
    for cur = lmin, total - 1 do -- cur: the 0-based position being filled
      step = step + 1
      draw(last, function(l) gp.k.fill(l, cur) end)
      local tcol, mcol = tokens:select(2, cur + 1), mask:select(2, cur + 1)
      if cur < lmax then gp.k.where(nxt, mcol, tcol, nxt) end -- rows still in their prompt
      gp.k.where(nxt, done, pad, nxt)                            -- finished rows
      gp.k.copy(tcol, nxt)
      for _, s in ipairs(stops) do
        gp.k.eq_s(hit, nxt, s)
        gp.k.where(hit, mcol, zero8, hit)
        gp.k.maximum(done, done, hit)
      end
      if callback then callback(step, nxt:totable()) end
      if cur == total - 1 then break end
      if #stops > 0 and step % check_every == 0 and done:min():item() == 1 then break end
      last = model:forward_cached(nxt:view {R, 1}, cache, cur):view {R, V}
    end
  end)
  model:train(was_training)
  if not ok then error(err, 0) end

  -- results: the max_new ids after each prompt (rows with shorter prompts ran
  -- further: they are cut), ended before the first stop token
  local all = tokens:cpu():totable()
  local stopset = {}
  for _, s in ipairs(stops) do stopset[s] = true end
  local out = {tokens = tokens:cpu(), lists = {}, text = {}, prompt_lens = {}, n = n, graph = stats.graph,
               graph_reused = stats.reused,
               device_positions = device_pos}
  for r = 1, R do
    local plen = #lists[math.floor((r - 1) / n) + 1]
    local g = {}
    for j = plen + 1, plen + max_new do
      local v = all[r][j]
      if stopset[v] then break end
      g[#g + 1] = v
    end
    out.lists[r], out.prompt_lens[r] = g, plen
    out.text[r] = tok:decode(g)
  end
  return out
end

gp.doc(M.generate, 'gp.generate(model, prompts, {n=1, max_new=64, temperature=1, greedy=false, top_k=0, top_p=1, min_p=0, repetition_penalty=1, stop={ids} (default: tokenizer:stop_ids() when it has them), tokenizer=, callback=function(step, ids) end, check_every=16, kv_dtype=nil, graph=true, keep_graph=true})',
  'B prompts (strings or 0-based id lists) x n samples in one batch with a KV cache (prefill, then decode): {tokens = i64 (B*n, L) cpu, lists = generated ids per row, text = decoded per row}; rows are prompt-major; kv_dtype = \'int8\' or \'fp8\': a compressed cache (gp.KVCache); on the GPU the decode step is a CUDA graph kept on the model for the next call of the same shape, options and parameters (r.graph_reused; keep_graph = false frees it)')

return M
