-- gp.models: model classes and gp.models.load, which reads Hugging Face
-- directories (config.json + safetensors), GGUF files and the short names of
-- models fetched by `make models`.
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local hf = require 'gpush.models.hf'
local raise = rt.raise

local M = {
  GPT = require 'gpush.models.gpt',
  GPT2 = require 'gpush.models.gpt2',
  Llama = require 'gpush.models.llama',
  generate = require('gpush.models.generate').generate,
}

local function is_dir(path)
  local f = io.open(path .. '/.', 'rb')
  if f then f:close() return true end
  return false
end

-- model, config for path: a Hugging Face directory; opts {dtype=, device=}
function M.load(path, opts)
  if type(path) ~= 'string' then raise('models.load: the path must be a string (a model directory or a .gguf file)') end
  opts = opts or {}
  if is_dir(path) then return hf.load_dir(path, opts) end
  raise(string.format('models.load: %s is not a model directory', path))
end
gp.doc(M.load, "gp.models.load(path, {dtype=, device=gp.device()})",
  'a model from a Hugging Face directory (config.json, model.safetensors or its sharded index): the Llama family ' ..
  '(llama, mistral, qwen2, SmolLM) or GPT-2; returns model, config (the model in eval mode, its weights checked against the config)')

return M
