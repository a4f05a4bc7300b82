-- nn.Linear, nn.Embedding, nn.Dropout.
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
local doc = gp.doc
local raise = rt.raise
local Module, param, need_int = nn.Module, nn.new_param, nn.need_int

-- y = x @ w^T + b; w (out, in) ~ U(-1/sqrt(in), 1/sqrt(in)) like torch
local Linear = Module:extend('Linear')
nn.Linear = Linear
function Linear:init(n_in, n_out, opts)
  need_int('Linear', 'in', n_in)
  need_int('Linear', 'out', n_out)
  opts = opts or {}
  self.in_features, self.out_features = n_in, n_out
  local k = 1 / math.sqrt(n_in)
  self.weight = nn.init.uniform_(param({n_out, n_in}, opts), -k, k)
  if opts.bias ~= false then self.bias = nn.init.uniform_(param({n_out}, opts), -k, k) end
end
function Linear:forward(x) return gp.linear(x, self.weight, self.bias) end
function Linear:extra_repr()
  return string.format('%d -> %d%s', self.in_features, self.out_features, self.bias and '' or ', no bias')
end

-- a language model's loss from its final hidden states h (..., d): the cross-entropy of targets (...) through
-- model.lm_head (an unbiased nn.Linear) by gp.linear_cross_entropy, without the logits whole (GPT:loss, Llama:loss)
function nn.head_loss(model, op, h, targets, opts)
  local head = model.lm_head
  if getmetatable(head) ~= Linear._imt or head.bias ~= nil then
    raise(op .. ': lm_head must be an unbiased nn.Linear (not quantized, no adapter) for the fused loss; take ' ..
      'the logits of model(idx) and gp.cross_entropy instead')
  end
  return gp.linear_cross_entropy(h, head.weight, targets, opts)
end
doc(nn.head_loss, 'gp.nn.head_loss(model, op, h, targets, opts)',
  'the cross-entropy of targets through model.lm_head (an unbiased nn.Linear) from the final hidden states h by gp.linear_cross_entropy, the logits never whole; op names the caller in errors (what GPT:loss and Llama:loss run)')

-- rows of a (n, d) table picked by 0-based ids; weight ~ N(0, 1)
local Embedding = Module:extend('Embedding')
nn.Embedding = Embedding
function Embedding:init(n, d, opts)
  need_int('Embedding', 'n', n)
  need_int('Embedding', 'd', d)
  self.num_embeddings, self.embedding_dim = n, d
  self.weight = nn.init.normal_(param({n, d}, opts), 0, 1)
end
function Embedding:forward(idx) return gp.embedding(self.weight, idx) end
function Embedding:extra_repr() return string.format('%d, %d', self.num_embeddings, self.embedding_dim) end

-- zeroes elements with probability p in training mode (scaling the rest by 1/(1-p)); identity in eval mode
local Dropout = Module:extend('Dropout')
nn.Dropout = Dropout
function Dropout:init(p)
  p = p or 0.5
  if type(p) ~= 'number' or p < 0 or p > 1 then raise('Dropout: p must be a number in [0, 1], got ' .. tostring(p)) end
  self.p = p
end
function Dropout:forward(x)
  if self.training and self.p > 0 then return (gp.dropout(x, self.p)) end
  return x
end
function Dropout:extra_repr() return string.format('p=%g', self.p) end

doc(nn.Linear, 'nn.Linear(in, out, {bias=true, device=, dtype=})', 'y = x @ w^T + b, w (out, in) ~ U(-1/sqrt(in), 1/sqrt(in))')
doc(nn.Embedding, 'nn.Embedding(n, d, {device=, dtype=})', 'rows of weight (n, d) picked by 0-based ids; weight ~ N(0, 1)')
doc(nn.Dropout, 'nn.Dropout(p=0.5)', 'gp.dropout in training mode, the identity in eval mode')

return nn
