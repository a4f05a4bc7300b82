-- GPT-2 as Hugging Face ships it (GPT2LMHeadModel), on the gp.models.GPT
-- module: learned positions, pre-norm LayerNorm blocks, fused qkv, GELU
-- (tanh form, transformers' gelu_new) MLP, the head tied to the embedding.
-- state_dict() and load_state_dict() speak transformers' names and layout:
-- transformer.h.0.attn.c_attn.weight is a Conv1D weight (in, out), the
-- transpose of the Linear's (out, in).
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local GPT = require 'gpush.models.gpt'
local raise = rt.raise

local GPT2 = GPT:extend('GPT2')

-- our name -> Hugging Face's, and whether the weight is a transposed Conv1D
local function hf_name(name)
  if name == 'wte.weight' or name == 'wpe.weight' or name:match('^ln_f%.') then return 'transformer.' .. name, false end
  local i, rest = name:match('^h%.(%d+)%.(.*)$')
  if not i then return nil end
  local map = {['ln1.'] = 'ln_1.', ['ln2.'] = 'ln_2.', ['attn.qkv.'] = 'attn.c_attn.', ['attn.proj.'] = 'attn.c_proj.',
               ['mlp.fc.'] = 'mlp.c_fc.', ['mlp.proj.'] = 'mlp.c_proj.'}
  for ours, theirs in pairs(map) do
    if rest:sub(1, #ours) == ours then
      local leaf = rest:sub(#ours + 1)
      return string.format('transformer.h.%d.%s%s', tonumber(i) - 1, theirs, leaf), leaf == 'weight' and not ours:match('^ln')
    end
  end
end

-- cfg: the fields of GPT-2's config.json; opts: {dtype=, device=}
function GPT2:init(c, opts)
  if type(c) ~= 'table' then raise('GPT2: needs a config table (the fields of config.json)') end
  opts = opts or {}
  local act = c.activation_function or 'gelu_new'
  if act ~= 'gelu_new' and act ~= 'gelu_pytorch_tanh' then
    raise(string.format("GPT2: activation_function '%s' is not supported (gelu_new)", tostring(act)))
  end
  if c.scale_attn_by_inverse_layer_idx or c.reorder_and_upcast_attn then
    raise('GPT2: scale_attn_by_inverse_layer_idx and reorder_and_upcast_attn are not supported')
  end
  GPT.init(self, {vocab_size = c.vocab_size, block_size = c.n_positions or c.n_ctx or 1024, n_embd = c.n_embd,
                  n_layer = c.n_layer, n_head = c.n_head, eps = c.layer_norm_epsilon or 1e-5, dropout = 0,
                  dtype = opts.dtype, device = opts.device, tie_weights = c.tie_word_embeddings ~= false})
  self.config.model_type = 'gpt2'
end

-- {Hugging Face name = tensor} (Conv1D weights transposed back to (in, out))
function GPT2:state_dict()
  local out = {}
  for name, t in pairs(GPT.state_dict(self)) do
    local h, conv = hf_name(name)
    if not h then
      if name ~= 'lm_head.weight' then raise('GPT2:state_dict: no Hugging Face name for ' .. name) end
      h = name
    end
    out[h] = conv and t:t():contiguous() or t
  end
  return out
end

-- a state dict in Hugging Face's names and layout (attn.bias and attn.masked_bias buffers of older checkpoints are skipped)
function GPT2:load_state_dict(sd, opts)
  local own = {}
  local theirs = {}
  for name in pairs(GPT.state_dict(self)) do
    local h, conv = hf_name(name)
    theirs[h or name] = {name, conv}
  end
  for k, t in pairs(sd) do
    local m = theirs[k]
    if m then own[m[1]] = m[2] and t:t() or t
    elseif not (k:match('%.attn%.bias$') or k:match('%.attn%.masked_bias$')) then own[k] = t end -- unexpected: named by the check
  end
  if self.config.tie_weights then own['lm_head.weight'] = nil end
  return GPT.load_state_dict(self, own, opts)
end

gp.doc(GPT2, 'gp.models.GPT2(config, {dtype=, device=})',
  'GPT-2 from the fields of its config.json (a gp.models.GPT): state_dict() and load_state_dict() in transformers\' names and Conv1D layout')
return GPT2
