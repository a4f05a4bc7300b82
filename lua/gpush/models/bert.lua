-- BERT encoders (BertModel) in Hugging Face's names and layout, and the
-- sentence-transformers encoder around one: token embeddings through the
-- encoder, mean pooling over the tokens, L2 normalization.
--
--   local enc = gp.models.load('all-minilm-l6-v2')      -- make models
--   local e = enc:embed({'A sentence.', 'Another one.'})  -- (2, 384) f32, unit rows
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn'
local raise, is_tensor, shape_str = rt.raise, tensor.is_tensor, tensor.shape_str
local Module, Linear, LayerNorm = nn.Module, nn.Linear, nn.LayerNorm

local M = {}

local function config_of(c)
  local function need(k)
    local v = c[k]
    if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
      raise(string.format('Bert: config field %s must be a positive integer, got %s', k, tostring(v)))
    end
    return v
  end
  local cfg = {vocab_size = need('vocab_size'), hidden_size = need('hidden_size'), num_hidden_layers = need('num_hidden_layers'),
               num_attention_heads = need('num_attention_heads'), intermediate_size = need('intermediate_size'),
               max_position_embeddings = c.max_position_embeddings or 512, type_vocab_size = c.type_vocab_size or 2,
               layer_norm_eps = c.layer_norm_eps or 1e-12, hidden_act = c.hidden_act or 'gelu'}
  if cfg.hidden_act ~= 'gelu' then raise(string.format("Bert: hidden_act '%s' is not supported (gelu)", tostring(cfg.hidden_act))) end
  if (c.position_embedding_type or 'absolute') ~= 'absolute' then
    raise(string.format("Bert: position_embedding_type '%s' is not supported (absolute)", tostring(c.position_embedding_type)))
  end
  if cfg.hidden_size % cfg.num_attention_heads ~= 0 then
    raise(string.format('Bert: hidden_size %d is not a multiple of num_attention_heads %d', cfg.hidden_size, cfg.num_attention_heads))
  end
  return cfg
end

local function lin(i, o, opts) return Linear(i, o, {dtype = opts.dtype, device = opts.device}) end
local function norm(d, cfg, opts) return LayerNorm(d, {eps = cfg.layer_norm_eps, dtype = opts.dtype, device = opts.device}) end

-- the modules below carry Hugging Face's names: attention.self.query, attention.output.dense, ...
local SelfAttn = Module:extend('BertSelfAttention')
function SelfAttn:init(cfg, o)
  local d = cfg.hidden_size
  self.query, self.key, self.value = lin(d, d, o), lin(d, d, o), lin(d, d, o)
end
local Out = Module:extend('BertOutput')
function Out:init(i, d, cfg, o)
  self.dense = lin(i, d, o)
  self.LayerNorm = norm(d, cfg, o)
end
local Attn = Module:extend('BertAttention')
function Attn:init(cfg, o)
  self.self = SelfAttn(cfg, o)
  self.output = Out(cfg.hidden_size, cfg.hidden_size, cfg, o)
end
local Inter = Module:extend('BertIntermediate')
function Inter:init(cfg, o) self.dense = lin(cfg.hidden_size, cfg.intermediate_size, o) end
local Layer = Module:extend('BertLayer')
function Layer:init(cfg, o)
  self.attention = Attn(cfg, o)
  self.intermediate = Inter(cfg, o)
  self.output = Out(cfg.intermediate_size, cfg.hidden_size, cfg, o)
  self.H = cfg.num_attention_heads
end

-- x (B, T, d); mask nil or an additive (B, 1, 1, T) mask (0 keep, -inf for padding)
function Layer:forward(x, mask)
  local B, T, d = x:size(1), x:size(2), x:size(3)
  local H = self.H
  local sa = self.attention.self
  local function heads(l) return l(x):view {B, T, H, d / H}:transpose(2, 3) end
  local y = nn.attention(heads(sa.query), heads(sa.key), heads(sa.value), {mask = mask})
  y = self.attention.output.dense(y:transpose(2, 3):reshape {B, T, d})
  x = self.attention.output.LayerNorm(y + x)
  local h = self.intermediate.dense(x):gelu()
  return self.output.LayerNorm(self.output.dense(h) + x)
end

local Embeddings = Module:extend('BertEmbeddings')
function Embeddings:init(cfg, o)
  self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, o)
  self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, o)
  self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, o)
  self.LayerNorm = norm(cfg.hidden_size, cfg, o)
end

local Encoder = Module:extend('BertEncoder')
function Encoder:init(cfg, o)
  self._index_base = 0
  local layers = {}
  for i = 1, cfg.num_hidden_layers do layers[i] = Layer(cfg, o) end
  self.layer = layers
end

local Pooler = Module:extend('BertPooler') -- kept for the checkpoint (sentence encoders pool the tokens instead)
function Pooler:init(cfg, o) self.dense = lin(cfg.hidden_size, cfg.hidden_size, o) end

local Bert = Module:extend('Bert')
M.Bert = Bert
Bert.ignore_keys = {'^embeddings%.position_ids$'}

-- c: the fields of config.json; opts {dtype=, device=}
function Bert:init(c, opts)
  opts = opts or {}
  local cfg = config_of(c)
  self.config = cfg
  local o = {dtype = opts.dtype or 'f32', device = opts.device or gp.device()}
  self.embeddings = Embeddings(cfg, o)
  self.encoder = Encoder(cfg, o)
  if c.add_pooling_layer ~= false then self.pooler = Pooler(cfg, o) end
end

-- ids (B, T) i64 token ids, mask nil or (B, T) (1 token, 0 padding) -> hidden states (B, T, d)
function Bert:forward(ids, attention_mask)
  if not is_tensor(ids) or ids:dim() ~= 2 then
    raise('Bert: ids must be a (B, T) tensor of token ids, got ' .. (is_tensor(ids) and shape_str(ids.shape) or type(ids)))
  end
  local B, T = ids:size(1), ids:size(2)
  if T > self.config.max_position_embeddings then
    raise(string.format('Bert: %d tokens is more than max_position_embeddings %d', T, self.config.max_position_embeddings))
  end
  local e = self.embeddings
  local pos = gp.arange(T, {device = ids.device})
  local x = e.word_embeddings(ids) + e.position_embeddings(pos) + e.token_type_embeddings.weight:narrow(1, 1, 1)
  x = e.LayerNorm(x)
  local mask
  if attention_mask then
    mask = gp.where(attention_mask:view {B, 1, 1, T}:ne(0), 0, -math.huge):to(x.dtype)
  end
  for _, layer in ipairs(self.encoder.layer) do x = layer(x, mask) end
  return x
end

gp.doc(Bert, "gp.models.Bert(config, {dtype='f32', device=gp.device()})",
  'a BERT encoder (BertModel) from the fields of a config.json, in Hugging Face\'s names: model(ids (B, T)[, attention_mask (B, T)]) -> hidden states (B, T, d)')

---------------------------------------------------------------------------
-- sentence-transformers: a Transformer module, then Pooling (and Normalize)

local Sentence = {}
Sentence.__index = Sentence
M.Sentence = Sentence

-- model: a Bert; tok: its tokenizer; o: {pooling = 'mean'|'cls', normalize = true, max_seq_length = 256}
function M.sentence(model, tok, o)
  return setmetatable({model = model, tok = tok, pooling = o.pooling or 'mean', normalize = o.normalize ~= false,
                       max_seq_length = o.max_seq_length or 256, dim = model.config.hidden_size}, Sentence)
end

-- texts: a list of strings -> (N, d) f32 embeddings (unit rows when the model normalizes), on the model's device.
-- Texts run sorted by token count, batch_size at a time, each batch padded to its longest text with an
-- attention mask (pads are masked out of attention and pooling, as sentence-transformers' padded batches)
function Sentence:embed(texts, opts)
  if type(texts) == 'string' then texts = {texts} end
  if type(texts) ~= 'table' or #texts == 0 then raise('embed: needs a list of strings') end
  opts = opts or {}
  local batch = opts.batch_size or 256
  local ids, order = {}, {}
  for i, s in ipairs(texts) do
    if type(s) ~= 'string' then raise(string.format('embed: text %d is a %s, not a string', i, type(s))) end
    local t = self.tok:encode(s, {truncation = false, padding = false})
    if #t > self.max_seq_length then -- truncated as sentence-transformers does: keep [SEP] last
      local last = t[#t]
      t = {unpack(t, 1, self.max_seq_length)}
      t[#t] = last
    end
    ids[i], order[i] = t, i
  end
  table.sort(order, function(a, b) return #ids[a] < #ids[b] or (#ids[a] == #ids[b] and a < b) end)
  local dev = self.model.embeddings.word_embeddings.weight.device
  local parts, where = {}, {} -- where[i]: the row of text i in the concatenated parts (0-based)
  gp.no_grad(function()
    for s = 1, #order, batch do
      local e = math.min(#order, s + batch - 1)
      local L = #ids[order[e]]
      local rows, keep, padded = {}, {}, false
      for j = s, e do
        local t = ids[order[j]]
        local r, k = {}, {}
        for c = 1, L do r[c], k[c] = t[c] or 0, t[c] and 1 or 0 end
        padded = padded or #t < L
        rows[#rows + 1], keep[#keep + 1] = r, k
        where[order[j]] = j - 1
      end
      local mask = padded and gp.tensor(keep, {dtype = 'f32', device = dev}) or nil
      local h = self.model(gp.tensor(rows, {dtype = 'i64', device = dev}), mask):float()
      local v
      if self.pooling == 'cls' then v = h:select(2, 1)
      elseif mask then
        local m = mask:view {#rows, L, 1}
        v = (h * m):sum(2) / m:sum(2)
      else v = h:mean(2) end
      if self.normalize then v = v / (v * v):sum(2, {keepdim = true}):sqrt():clamp(1e-12) end
      parts[#parts + 1] = v
    end
  end)
  local out = #parts == 1 and parts[1] or gp.cat(parts, 1)
  return out:index_select(1, gp.tensor(where, {dtype = 'i64', device = dev}))
end

gp.doc(Sentence.embed, "enc:embed({'text', ...}, {batch_size=256})",
  '(N, d) f32 sentence embeddings: the encoder\'s hidden states mean-pooled over the tokens (truncated to max_seq_length), L2-normalized as sentence-transformers\' encode(..., normalize_embeddings=True)')

return M
