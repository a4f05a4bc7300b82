-- GGUF model files (llama.cpp's format) onto gp.models.Llama: the config from
-- the `ARCH.*` metadata, the tensors renamed to Hugging Face's names and
-- dequantized (gp.gguf) on the device, the tokenizer and chat template from
-- the `tokenizer.*` metadata. llama.cpp's converter permutes the rows of
-- attn_q and attn_k of 'llama' models for its interleaved rotary layout; they
-- are permuted back here, so one rotary layout (Hugging Face's) serves both.
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local Llama = require 'gpush.models.llama'
local text = require 'gpush.text'
local gguf = require 'gpush.core.gguf'
local raise = rt.raise

local M = {}

-- GGUF general.architecture -> config.json model_type, and whether q/k rows are permuted
M.ARCH = {llama = {'llama', true}, qwen2 = {'qwen2', false}, mistral = {'mistral', true}}

-- the config.json fields of a GGUF file's metadata
function M.config_of(g)
  local meta = g.meta
  local arch = meta['general.architecture']
  local a = M.ARCH[arch]
  if not a then
    local names = {}
    for k in pairs(M.ARCH) do names[#names + 1] = k end
    table.sort(names)
    raise(string.format("models.load: %s: general.architecture '%s' is not supported (%s)", g.path, tostring(arch), table.concat(names, ', ')))
  end
  local function get(key, default)
    local v = meta[arch .. '.' .. key]
    if v == nil then
      if default == nil then raise(string.format('models.load: %s: the metadata has no %s.%s', g.path, arch, key)) end
      return default
    end
    return tonumber(v)
  end
  local tokens = meta['tokenizer.ggml.tokens']
  local heads = get('attention.head_count')
  local c = {
    model_type = a[1], vocab_size = get('vocab_size', tokens and #tokens or 0), hidden_size = get('embedding_length'),
    intermediate_size = get('feed_forward_length'), num_hidden_layers = get('block_count'), num_attention_heads = heads,
    num_key_value_heads = get('attention.head_count_kv', heads), rope_theta = get('rope.freq_base', 10000),
    rms_norm_eps = get('attention.layer_norm_rms_epsilon', 1e-5), max_position_embeddings = get('context_length', 2048),
    tie_word_embeddings = g.by_name['output.weight'] == nil, hidden_act = 'silu',
    bos_token_id = tonumber(meta['tokenizer.ggml.bos_token_id']), eos_token_id = tonumber(meta['tokenizer.ggml.eos_token_id']),
  }
  local kl = get('attention.key_length', 0)
  if kl > 0 then c.head_dim = kl end
  local rdim = get('rope.dimension_count', 0)
  local hd = c.head_dim or c.hidden_size / heads
  if rdim > 0 and rdim ~= hd then
    raise(string.format('models.load: %s: %s.rope.dimension_count %d is not the head dim %d (partial rotary is not supported)', g.path, arch, rdim, hd))
  end
  local st = meta[arch .. '.rope.scaling.type']
  if st and st ~= 'none' then
    if st ~= 'linear' then raise(string.format("models.load: %s: %s.rope.scaling.type '%s' is not supported (linear)", g.path, arch, st)) end
    c.rope_scaling = {type = 'linear', factor = get('rope.scaling.factor')}
  end
  return c, a[2]
end

-- GGUF tensor names -> Hugging Face's
local LAYER = {
  attn_norm = 'input_layernorm', ffn_norm = 'post_attention_layernorm', attn_q = 'self_attn.q_proj',
  attn_k = 'self_attn.k_proj', attn_v = 'self_attn.v_proj', attn_output = 'self_attn.o_proj',
  ffn_gate = 'mlp.gate_proj', ffn_up = 'mlp.up_proj', ffn_down = 'mlp.down_proj',
}
local TOP = {['token_embd.weight'] = 'model.embed_tokens.weight', ['output_norm.weight'] = 'model.norm.weight',
             ['output.weight'] = 'lm_head.weight'}
function M.hf_name(name)
  if TOP[name] then return TOP[name] end
  local i, part, leaf = name:match('^blk%.(%d+)%.([%w_]+)%.(%a+)$')
  if i and LAYER[part] then return string.format('model.layers.%d.%s.%s', tonumber(i), LAYER[part], leaf) end
end

-- rows of attn_q / attn_k back from llama.cpp's permutation: (heads, hd/2, 2) -> (heads, 2, hd/2)
local function unpermute(t, heads)
  local rows = t:size(1)
  local hd = rows / heads
  if t:dim() == 1 then return t:view {heads, hd / 2, 2}:transpose(2, 3):contiguous():view {rows} end
  return t:view {heads, hd / 2, 2, t:size(2)}:transpose(2, 3):contiguous():view {rows, t:size(2)}
end

-- model, tokenizer, config of a GGUF file; opts {dtype=, device=}
function M.load(path, opts)
  opts = opts or {}
  local g = gguf.open(path)
  local ok, res = pcall(function()
    local c, permuted = M.config_of(g)
    local device = opts.device or gp.device()
    local dtype = opts.dtype or (device == 'cuda' and 'bf16' or 'f32')
    local model = Llama(c, {dtype = dtype, device = device, init = false})
    local sd = {}
    for _, t in ipairs(g.tensors) do
      local name = M.hf_name(t.name)
      if name then
        local w = g:read(t.name, {dtype = dtype, device = device})
        if permuted and name:match('self_attn%.q_proj%.') then w = unpermute(w, c.num_attention_heads)
        elseif permuted and name:match('self_attn%.k_proj%.') then w = unpermute(w, c.num_key_value_heads) end
        sd[name] = w
      elseif t.name == 'rope_freqs.weight' then -- llama3 scaling, as per-frequency divisors
        local f = g:read(t.name, {dtype = 'f32', device = 'cpu'})
        local inv = rawget(model, '_inv_freq').cpu
        rawget(model, '_inv_freq').cpu = inv / f
      else
        raise(string.format("tensor '%s' has no place in a %s model", t.name, c.model_type))
      end
    end
    model:load_state_dict(sd)
    local tok = text.tokenizer.from_gguf(g.meta)
    return {model, tok, c}
  end)
  g:close()
  if not ok then raise(string.format('models.load: %s: %s', path, tostring(res):gsub('^.-:%d+: ', ''):gsub('^models%.load: ', ''))) end
  res[1].generation_config = {bos_token_id = res[3].bos_token_id, eos_token_id = res[3].eos_token_id}
  res[1].hf_config = res[3]
  return res[1]:eval(), res[2], res[3]
end

return M
