-- gp.models: model classes and gp.models.load, which reads Hugging Face
-- directories (config.json + safetensors), GGUF files and the short names of
-- models fetched by `make models`.
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local hf = require 'gpush.models.hf'
local text = require 'gpush.text'
local core_gguf = require 'gpush.core.gguf'
local gguf = require 'gpush.models.gguf'
local raise = rt.raise

local M = {
  GPT = require 'gpush.models.gpt',
  GPT2 = require 'gpush.models.gpt2',
  Llama = require 'gpush.models.llama',
  Bert = require('gpush.models.bert').Bert,
  generate = require('gpush.models.generate').generate,
}

-- the models `make models` fetches, by short name: where they land under models_dir()
M.NAMES = {smollm2 = 'smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', ['all-minilm-l6-v2'] = 'all-minilm-l6-v2',
           shakespeare = 'shakespeare/shakespeare.txt'} -- the last a text, not a model (gp.models.path only)

-- config.json fields of model shapes the benchmarks build with random weights
-- (gp.models.Llama(gp.models.SHAPES.smollm2)): SmolLM2-135M-Instruct's, and
-- issue 23's d1024 Llama (8 layers, 8 heads of 128, SwiGLU 2816, vocabulary 32,000)
M.SHAPES = {
  smollm2 = {hidden_size = 576, intermediate_size = 1536, num_hidden_layers = 30, num_attention_heads = 9,
    num_key_value_heads = 3, vocab_size = 49152, rms_norm_eps = 1e-5, rope_theta = 100000, tie_word_embeddings = true,
    max_position_embeddings = 8192, hidden_act = 'silu', model_type = 'llama'},
  llama1024 = {hidden_size = 1024, intermediate_size = 2816, num_hidden_layers = 8, num_attention_heads = 8,
    num_key_value_heads = 8, vocab_size = 32000, rms_norm_eps = 1e-5, rope_theta = 10000, tie_word_embeddings = false,
    max_position_embeddings = 4096, hidden_act = 'silu', model_type = 'llama'},
}

-- $GPUSH_CACHE/models (default ~/.cache/gpush/models)
function M.dir() return (rt.cache_dir() or '.') .. '/models' end
gp.doc(M.dir, 'gp.models.dir()', 'where `make models` puts what it fetches: $GPUSH_CACHE/models (default ~/.cache/gpush/models)')

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end

-- the path of a fetched model by short name ('smollm2'); an error saying to run `make models` when it is absent
function M.path(name)
  local rel = M.NAMES[name]
  if not rel then
    local names = {}
    for k in pairs(M.NAMES) do names[#names + 1] = k end
    table.sort(names)
    raise(string.format("models.path: no model named '%s' (%s)", tostring(name), table.concat(names, ', ')))
  end
  local p = M.dir() .. '/' .. rel
  if not exists(p) then raise(string.format("models: '%s' is not fetched (%s is missing): run `make models`", name, p)) end
  return p
end
gp.doc(M.path, "gp.models.path('smollm2')", 'the file or directory of a model `make models` fetched, by its short name (also \'shakespeare\': the text)')

-- GPT-2's byte-level BPE from its original files (encoder.json: token -> id,
-- vocab.bpe: the merges), as the gpt2-tokenizer of `make models` holds them
local function gpt2_files(dir)
  local enc = hf.read_json(dir .. '/encoder.json')
  local f = io.open(dir .. '/vocab.bpe', 'rb')
  if not f then raise('models.tokenizer: no vocab.bpe in ' .. dir) end
  local merges = {}
  for line in f:lines() do
    if not line:match('^#version') and line:find('%S') then merges[#merges + 1] = line end
  end
  f:close()
  local added = {}
  if enc['<|endoftext|>'] then added[1] = {id = enc['<|endoftext|>'], content = '<|endoftext|>', special = true} end
  local tok = text.tokenizer.from_json({
    model = {type = 'BPE', vocab = enc, merges = merges},
    pre_tokenizer = {type = 'ByteLevel', add_prefix_space = false, use_regex = true, trim_offsets = true},
    decoder = {type = 'ByteLevel', add_prefix_space = false, use_regex = true, trim_offsets = true},
    added_tokens = added,
  })
  tok.path = dir
  return tok
end

-- tokenizers by short name (besides the models' own): where they land under dir()
M.TOKENIZERS = {gpt2 = 'gpt2-tokenizer', ['gpt2-tokenizer'] = 'gpt2-tokenizer'}

-- a tokenizer without its model: a short name (gpt2, or a model's: smollm2,
-- all-minilm-l6-v2), a Hugging Face directory or tokenizer.json, a .gguf file
-- (its metadata only: no tensor is read) or a directory of GPT-2's
-- encoder.json and vocab.bpe
function M.tokenizer(name)
  if type(name) ~= 'string' or name == '' then raise('models.tokenizer: needs a name or a path') end
  local path = name
  if M.TOKENIZERS[name] and not exists(name) then
    path = M.dir() .. '/' .. M.TOKENIZERS[name]
    if not exists(path .. '/encoder.json') then
      raise(string.format("models: the tokenizer '%s' is not fetched (%s is missing): run `make models`", name, path))
    end
  elseif M.NAMES[name] and not exists(name) then
    path = M.path(name)
  end
  if path:match('%.gguf$') then
    local g = core_gguf.open(path)
    local tok = text.tokenizer.from_gguf(g.meta)
    g:close()
    tok.path = path
    return tok
  end
  if exists(path .. '/encoder.json') and exists(path .. '/vocab.bpe') then return gpt2_files(path) end
  if exists(path) then return text.tokenizer.load(path) end
  raise(string.format('models.tokenizer: %s is neither a short name (%s) nor a tokenizer file or directory', name,
    'gpt2, smollm2, all-minilm-l6-v2'))
end
gp.doc(M.tokenizer, "gp.models.tokenizer('gpt2' | 'smollm2' | 'tokenizer.json' | 'dir' | 'model.gguf')",
  "a tokenizer alone: a short name fetched by make models (gpt2: GPT-2's encoder.json and vocab.bpe), a Hugging Face directory or tokenizer.json, or a GGUF file's metadata")

-- the architectures entry of a config.json, by model_type
local CLASS = {llama = 'LlamaForCausalLM', mistral = 'MistralForCausalLM', qwen2 = 'Qwen2ForCausalLM', gpt2 = 'GPT2LMHeadModel',
               bert = 'BertModel'}
local DTNAME = {f32 = 'float32', bf16 = 'bfloat16', f16 = 'float16'}

-- write model (loaded by gp.models.load) as a Hugging Face directory transformers loads:
-- config.json (its config, the dtype of its weights) and model.safetensors (state_dict(): the checkpoint's names and layout)
function M.save(model, dir)
  local c = type(model) == 'table' and rawget(model, 'hf_config')
  if not c then raise('models.save: the model has no Hugging Face config (load it with gp.models.load)') end
  local st = os.execute("mkdir -p '" .. dir:gsub("'", "'\\''") .. "'")
  if st ~= 0 and st ~= true then raise('models.save: cannot make the directory ' .. dir) end
  local sd = model:state_dict()
  local cfg = {}
  for k, v in pairs(c) do cfg[k] = v end
  local any = next(sd) and sd[next(sd)]
  cfg.torch_dtype = any and DTNAME[any.dtype] or cfg.torch_dtype
  cfg.dtype = cfg.torch_dtype
  cfg.architectures = cfg.architectures or {CLASS[cfg.model_type]}
  local f, err = io.open(dir .. '/config.json', 'w')
  if not f then raise('models.save: ' .. tostring(err)) end
  f:write(gp.json.encode(cfg))
  f:close()
  gp.save(dir .. '/model.safetensors', sd, {format = 'pt'})
  return dir
end
gp.doc(M.save, "gp.models.save(model, 'dir')", "a Hugging Face directory of a loaded model: config.json and model.safetensors (state_dict()'s names and layout), for transformers' from_pretrained")

local function is_dir(path)
  local f = io.open(path .. '/.', 'rb')
  if f then f:close() return true end
  return false
end

-- model, tokenizer, config for path: a Hugging Face directory, a .gguf file or a fetched short name; opts {dtype=, device=}
function M.load(path, opts)
  if type(path) ~= 'string' then raise('models.load: the path must be a string (a model directory or a .gguf file)') end
  opts = opts or {}
  if M.NAMES[path] and not is_dir(path) and not exists(path) then
    path = M.path(path)
    if path:match('%.txt$') then raise(string.format("models.load: '%s' is a text, not a model (gp.models.path gives its file)", path)) end
  end
  if is_dir(path) then return hf.load_dir(path, opts) end
  if path:match('%.gguf$') then return gguf.load(path, opts) end
  raise(string.format('models.load: %s is neither a model directory nor a .gguf file (nor a short name: gp.models.NAMES)', path))
end
gp.doc(M.load, "gp.models.load(path, {dtype=, device=gp.device()})",
  'a model from a Hugging Face directory (config.json, model.safetensors or its sharded index, tokenizer.json), a GGUF file ' ..
  '(llama, qwen2 architectures; tensors dequantized on the device) or a short name fetched by make models (smollm2): the ' ..
  'Llama family (llama, mistral, qwen2, SmolLM) or GPT-2; returns model (eval mode, weights checked against the config), tokenizer, config')

return M
