-- gp.models: model classes and gp.models.load, which reads Hugging Face
-- directories (config.json + safetensors), GGUF files and the short names of
-- models fetched by `make models`.
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local hf = require 'gpush.models.hf'
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
