-- Hugging Face model directories: config.json, model.safetensors (or the
-- shards of model.safetensors.index.json), generation_config.json, and the
-- tokenizer beside them. Every tensor the model needs must be there with the
-- shape the config implies; anything else is an error that names the file.
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local Llama = require 'gpush.models.llama'
local GPT2 = require 'gpush.models.gpt2'
local text = require 'gpush.text'
local bert = require 'gpush.models.bert'
local raise = rt.raise

local M = {}

-- the model class for a config.json's model_type
M.ARCH = {llama = Llama, mistral = Llama, qwen2 = Llama, smollm = Llama, gpt2 = GPT2, bert = bert.Bert}

local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end

local function read_json(path)
  local f, err = io.open(path, 'rb')
  if not f then raise('models.load: cannot read ' .. path .. ': ' .. tostring(err)) end
  local s = f:read('*a')
  f:close()
  local ok, v = pcall(gp.json.decode, s)
  if not ok or type(v) ~= 'table' then raise('models.load: ' .. path .. ' is not a JSON object: ' .. tostring(v)) end
  -- a null field is an absent one (as transformers reads it)
  local function strip(t)
    for k, x in pairs(t) do
      if x == gp.json.null then t[k] = nil elseif type(x) == 'table' then strip(x) end
    end
    return t
  end
  return strip(v)
end
M.read_json = read_json

-- {name = tensor} of every weight file of dir (cpu), and the files read
function M.read_weights(dir)
  local single = dir .. '/model.safetensors'
  if exists(single) then return (gp.load(single)), {single} end
  local index = dir .. '/model.safetensors.index.json'
  if not exists(index) then raise('models.load: ' .. dir .. ' has neither model.safetensors nor model.safetensors.index.json') end
  local map = read_json(index).weight_map
  if type(map) ~= 'table' then raise('models.load: ' .. index .. ' has no weight_map') end
  local files, out, seen = {}, {}, {}
  for name, file in pairs(map) do
    if type(file) ~= 'string' or file:find('/', 1, true) or file:find('..', 1, true) then
      raise(string.format('models.load: %s: tensor %s maps to a bad file name %s', index, tostring(name), tostring(file)))
    end
    if not seen[file] then seen[file] = true; files[#files + 1] = file end
  end
  table.sort(files)
  for _, file in ipairs(files) do
    for k, t in pairs((gp.load(dir .. '/' .. file))) do
      if map[k] ~= file then raise(string.format('models.load: %s holds %s, which the index puts in %s', file, k, tostring(map[k]))) end
      out[k] = t
    end
  end
  for name, file in pairs(map) do
    if not out[name] then raise(string.format('models.load: %s: tensor %s is not in %s', index, name, file)) end
  end
  return out, files
end

-- the dtype a checkpoint declares (config.json torch_dtype/dtype), as a gpush dtype name
local DT = {float32 = 'f32', bfloat16 = 'bf16', float16 = 'f16'}

-- model, tokenizer (nil without tokenizer.json), config from a Hugging Face directory; opts: {dtype=, device=}
function M.load_dir(dir, opts)
  opts = opts or {}
  local cpath = dir .. '/config.json'
  if not exists(cpath) then raise('models.load: ' .. dir .. ' has no config.json') end
  local c = read_json(cpath)
  local kind = c.model_type
  local cls = M.ARCH[kind]
  if not cls then
    local names = {}
    for k in pairs(M.ARCH) do names[#names + 1] = k end
    table.sort(names)
    raise(string.format("models.load: %s: model_type '%s' is not supported (%s)", cpath, tostring(kind), table.concat(names, ', ')))
  end
  local sd, files = M.read_weights(dir)
  local dtype = opts.dtype or DT[c.torch_dtype or c.dtype or ''] or 'f32'
  local ok, model = pcall(cls, c, {dtype = dtype, device = opts.device or gp.device(), init = false})
  if not ok then raise(cpath .. ': ' .. tostring(model):gsub('^.-:%d+: ', '')) end
  for k in pairs(sd) do -- buffers older checkpoints saved that are computed, not loaded (position ids, rotary frequencies)
    for _, pat in ipairs(cls.ignore_keys or {}) do if k:match(pat) then sd[k] = nil end end
  end
  local ok2, err = pcall(model.load_state_dict, model, sd)
  if not ok2 then raise(string.format('models.load: %s: %s', table.concat(files, ', '), tostring(err):gsub('^.-:%d+: ', ''))) end
  local gpath = dir .. '/generation_config.json'
  model.generation_config = exists(gpath) and read_json(gpath) or {}
  model.hf_config = c
  local tok = exists(dir .. '/tokenizer.json') and text.tokenizer.load(dir) or nil
  if exists(dir .. '/modules.json') then return M.sentence(dir, model:eval(), tok), tok, c end
  return model:eval(), tok, c
end

-- a sentence-transformers directory: modules.json lists Transformer, Pooling (1_Pooling/config.json) and Normalize
function M.sentence(dir, model, tok)
  if not tok then raise('models.load: ' .. dir .. ': a sentence encoder needs its tokenizer.json') end
  local mods = read_json(dir .. '/modules.json')
  local pooling, normalize
  for _, m in ipairs(mods) do
    local kind = tostring(m.type):match('([%w_]+)$')
    if kind == 'Pooling' then
      local pc = dir .. '/' .. (m.path ~= '' and m.path or '1_Pooling') .. '/config.json'
      if not exists(pc) then raise('models.load: ' .. dir .. ': the Pooling module has no ' .. pc) end
      local p = read_json(pc)
      if p.pooling_mode_mean_tokens then pooling = 'mean' elseif p.pooling_mode_cls_token then pooling = 'cls'
      else raise('models.load: ' .. pc .. ': only mean and cls pooling are supported') end
    elseif kind == 'Normalize' then normalize = true
    elseif kind ~= 'Transformer' then
      raise(string.format("models.load: %s/modules.json: module type '%s' is not supported (Transformer, Pooling, Normalize)", dir, tostring(m.type)))
    end
  end
  if not pooling then raise('models.load: ' .. dir .. ': modules.json has no Pooling module (a sentence encoder needs its pooling config)') end
  local sc = dir .. '/sentence_bert_config.json'
  local max_len = exists(sc) and read_json(sc).max_seq_length or nil
  return bert.sentence(model, tok, {pooling = pooling, normalize = normalize == true, max_seq_length = max_len})
end

return M
