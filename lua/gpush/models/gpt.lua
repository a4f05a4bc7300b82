-- GPT: token and position embeddings, n_layer transformer blocks, a final
-- norm and the language-model head (tied to the token embedding by default);
-- a KV-cache forward for generation, and a device-position step that a CUDA
-- graph can replay per token (gp.generate).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn'
local doc = gp.doc
local raise, is_tensor, shape_str = rt.raise, tensor.is_tensor, tensor.shape_str
local need_int = nn.need_int
local Linear, Embedding, Dropout, TransformerBlock = nn.Linear, nn.Embedding, nn.Dropout, nn.TransformerBlock

local GPT = nn.Module:extend('GPT')
function GPT:init(cfg)
  cfg = cfg or {}
  for _, k in ipairs {'vocab_size', 'block_size', 'n_embd', 'n_layer', 'n_head'} do need_int('GPT', k, cfg[k]) end
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.dropout = c.dropout or 0
  c.mlp = c.mlp or 'gelu'
  c.norm = c.norm or 'layer'
  if c.tie_weights == nil then c.tie_weights = true end
  self.config = c
  local o = {dtype = c.dtype, device = c.device}
  self.wte = Embedding(c.vocab_size, c.n_embd, o)
  self.wpe = Embedding(c.block_size, c.n_embd, o)
  self.drop = Dropout(c.dropout)
  local blocks = {}
  for i = 1, c.n_layer do blocks[i] = TransformerBlock(c) end
  self.h = blocks
  self.ln_f = nn.make_norm(c.norm, c.n_embd, c)
  self.lm_head = Linear(c.n_embd, c.vocab_size, {bias = false, dtype = c.dtype, device = c.device})
  if c.tie_weights then self.lm_head.weight = self.wte.weight end
  self:init_weights()
end

-- GPT-2 init: weights ~ N(0, 0.02), residual projections ~ N(0, 0.02 / sqrt(2 n_layer)), biases 0
function GPT:init_weights(std)
  std = std or 0.02
  for _, m in ipairs(self:modules()) do
    if getmetatable(m) == Linear._imt or getmetatable(m) == Embedding._imt then
      nn.init.normal_(m.weight, 0, std)
      if m.bias then nn.init.zeros_(m.bias) end
    end
  end
  local rstd = std / math.sqrt(2 * self.config.n_layer)
  for _, b in ipairs(self.h) do
    nn.init.normal_(b.attn.proj.weight, 0, rstd)
    if b.mlp.init_weights then b.mlp:init_weights(std, rstd) else nn.init.normal_(b.mlp.proj.weight, 0, rstd) end
  end
  return self
end

-- positions 0..T-1 (i64), cached per (T, device)
function GPT:positions(T, device)
  local cache = rawget(self, '_pos')
  if not cache then cache = {}; rawset(self, '_pos', cache) end
  local key = T .. device
  local p = cache[key]
  if not p then p = gp.arange(T, {device = device}); cache[key] = p end
  return p
end

-- the blocks over x (cache: forward_cached's), then ln_f. When every block
-- chains (plain RMSNorms or LayerNorms, TransformerBlock.chains) and ln_f is
-- a plain norm, each residual add runs inside the norm after it
-- (nn.add_norm: no add kernel forward, the residual's gradient added to the
-- norm's in the backward)
local function blocks_norm(self, x, cache, pos)
  local chain = #self.h > 0 and nn.plain_norm(self.ln_f)
  for _, b in ipairs(self.h) do chain = chain and TransformerBlock.chains(b) end
  if chain then
    local a
    for i, b in ipairs(self.h) do x, a = b:forward_pending(x, a, cache, i, pos) end
    return (nn.add_norm(self.ln_f, a, x))
  end
  if cache then
    for i, b in ipairs(self.h) do x = b:forward_cached(x, cache, i, pos) end
  else
    for _, b in ipairs(self.h) do x = b(x) end
  end
  return self.ln_f(x)
end

-- idx (B, T) of 0-based token ids -> the final hidden states (B, T, n_embd) (ln_f applied; lm_head of them
-- gives the logits)
function GPT:hidden(idx, op)
  op = op or 'GPT'
  if not is_tensor(idx) or idx:dim() ~= 2 or (idx.dtype ~= 'i64' and idx.dtype ~= 'i32') then
    raise(op .. ': idx must be a (B, T) tensor of i64 (or i32) token ids, got ' ..
      (is_tensor(idx) and (idx.dtype .. ' ' .. shape_str(idx.shape)) or type(idx)))
  end
  local T = idx:size(2)
  if T > self.config.block_size then
    raise(string.format('%s: the sequence has %d tokens but block_size is %d', op, T, self.config.block_size))
  end
  local x = self.wte(idx) + self.wpe(self:positions(T, idx.device))
  return blocks_norm(self, self.drop(x))
end

-- idx (B, T) of 0-based token ids -> logits (B, T, vocab); with targets (B, T) also the mean cross-entropy
function GPT:forward(idx, targets)
  local logits = self.lm_head(self:hidden(idx))
  if targets ~= nil then return logits, gp.cross_entropy(logits, targets) end
  return logits
end

-- the cross-entropy of targets (B, T) without the logits: gp.linear_cross_entropy over the final hidden states
-- and the head's weight, chunk by chunk (opts: its ignore_index, reduction, chunk)
function GPT:loss(idx, targets, opts)
  return nn.head_loss(self, 'GPT:loss', self:hidden(idx, 'GPT:loss'), targets, opts)
end
-- incremental forward for generation (eval mode, no dropout): idx_new (B, Tnew)
-- are the tokens at positions pos .. pos+Tnew-1 (pos defaults to cache:len());
-- layer i appends its keys and values to layer i of cache (a gp.KVCache or
-- anything with append/keys/values) and attends over all cached positions.
-- Returns logits (B, Tnew, vocab).
function GPT:forward_cached(idx, cache, pos)
  if not is_tensor(idx) or idx:dim() ~= 2 or (idx.dtype ~= 'i64' and idx.dtype ~= 'i32') then
    raise('GPT:forward_cached: idx must be a (B, T) tensor of i64 (or i32) token ids, got ' ..
      (is_tensor(idx) and (idx.dtype .. ' ' .. shape_str(idx.shape)) or type(idx)))
  end
  if type(cache) ~= 'table' or not cache.append then raise('GPT:forward_cached: needs a KV cache (gp.KVCache{...})') end
  if is_tensor(pos) then return self:_forward_at(idx, cache, pos) end
  pos = pos or cache:len()
  local T, bs = idx:size(2), self.config.block_size
  if pos + T > bs then
    raise(string.format('GPT:forward_cached: positions %d..%d are beyond block_size %d', pos, pos + T - 1, bs))
  end
  local x = self.wte(idx) + self.wpe(self:positions(bs, idx.device):narrow(1, pos + 1, T))
  return self.lm_head(blocks_norm(self, x, cache, pos))
end
-- device positions: one new token per row at the position held by pos (an
-- i64 [1] tensor on the model's device), so the step reads nothing on the
-- host and can be captured as a CUDA graph and replayed per token (gp.generate).
-- The cache must be a gp.KVCache (append_at, attend_at) and the head dim one
-- that decode attention takes (gp.attention_supported('decode', ...)): it
-- attends over the whole capacity, lens[b] = pos + 1. The cache's host count
-- (cache:len()) is not advanced.
function GPT:supports_device_positions(cache)
  local c = self.config
  return type(cache) == 'table' and cache.append_at ~= nil and
    gp.attention_supported('decode', cache.dtype or self.wte.weight.dtype, c.n_embd / c.n_head)
end
function GPT:_forward_at(idx, cache, pos)
  if not self:supports_device_positions(cache) then
    raise('GPT:forward_cached: device positions need a gp.KVCache and a head dim that decode attention takes (gp.attention_supported)')
  end
  local lens = cache:step_lens('GPT:forward_cached', idx, pos)
  local at = {pos = pos, lens = lens}
  local x = self.wte(idx) + self.wpe(pos:view {1, 1})
  return self.lm_head(blocks_norm(self, x, cache, at))
end

doc(GPT.hidden, 'model:hidden(idx)', 'the final hidden states (B, T, n_embd) of token ids idx (B, T): ln_f applied, before lm_head')
doc(GPT.loss, 'model:loss(idx, targets, opts)',
  'the mean cross-entropy of targets (B, T) computed by gp.linear_cross_entropy over the final hidden states and lm_head\'s weight: the (B T, vocab) logits never exist whole (opts: ignore_index, reduction, chunk)')

function GPT:extra_repr()
  local c = self.config
  return string.format('vocab_size=%d, block_size=%d, n_embd=%d, n_layer=%d, n_head=%d, mlp=%s, norm=%s',
    c.vocab_size, c.block_size, c.n_embd, c.n_layer, c.n_head, c.mlp, c.norm)
end

-- the sum of the auxiliary losses of the model's MoE layers from its last
-- forward (training mode), or nil when there are none
function GPT:aux_loss()
  local s
  for _, m in ipairs(nn.moe_layers(self)) do
    local a = rawget(m, 'aux_loss')
    if a then s = s and s + a or a end
  end
  return s
end

doc(GPT.forward_cached, 'gpt:forward_cached(idx_new, cache, pos=cache:len())',
  'logits (B, Tnew, V) of tokens idx_new (B, Tnew) at positions pos..; appends every layer\'s keys and values to the KV cache')
doc(GPT, "gp.models.GPT{vocab_size=, block_size=, n_embd=, n_layer=, n_head=, dropout=0, mlp='gelu', norm='layer', tie_weights=true}",
  '(also nn.GPT) a GPT with GPT-2 init: model(idx) -> logits (B, T, V); model(idx, targets) -> logits, mean cross-entropy')
doc(GPT.aux_loss, 'gpt:aux_loss()', 'the sum of the MoE layers\' auxiliary losses of the last training-mode forward (nil without MoE layers)')

return GPT
