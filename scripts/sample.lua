-- sample.lua: generate text from a GPT checkpoint written by train_gpt.lua
-- (or a freshly initialized model with --random), n samples per prompt in one
-- batch with a KV cache, tokens streamed to the terminal.
--
--   gpush scripts/sample.lua --ckpt gpt.safetensors 'ROMEO:' 'The '
--   gpush scripts/sample.lua --ckpt gpt.safetensors --n 4 --top-p 0.9 --temperature 0.8 'Once'
--   gpush scripts/sample.lua --random --n-embd 768 --n-layer 12 --n-head 12 --block 1024 --max-new 256 --n 8 'x'
--
-- With one row (one prompt, --n 1) the text is streamed as it is generated;
-- with several, each step prints a dot and the texts come at the end.
-- tokens/s counts generated tokens of every row over the time of the whole
-- generate call (prefill included).
local gp = rawget(_G, 'gp') or require 'gpush'

local o = gp.args.parse(arg, {
  {'ckpt', '', 'a checkpoint of scripts/train_gpt.lua (gp.save: config and vocab in the metadata)'},
  {'random', false, 'a freshly initialized GPT instead (byte vocabulary of 256)'},
  {'n-embd', 128, '--random: embedding width'},
  {'n-layer', 4, '--random: transformer blocks'},
  {'n-head', 4, '--random: attention heads'},
  {'block', 256, '--random: context length'},
  {'n', 1, 'samples per prompt'},
  {'max-new', 100, 'tokens to generate per row'},
  {'temperature', 1.0, 'softmax temperature (0: greedy)'},
  {'top-k', 0, 'keep the k most likely tokens (0: off)'},
  {'top-p', 1.0, 'nucleus: the smallest set of tokens with this much mass (1: off)'},
  {'min-p', 0.0, 'keep tokens with p >= min-p * max p (0: off)'},
  {'repetition-penalty', 1.0, 'CTRL penalty on tokens already in the row (1: off)'},
  {'greedy', false, 'argmax decoding'},
  {'stop', '', 'a stop string: its first token ends a row'},
  {'seed', 1337, 'random seed'},
  {'device', '', 'cpu or cuda (default: cuda when a GPU is usable)'},
  {'bf16', false, 'run the model in bf16'},
  {'quiet', false, 'no streaming, only the final texts'},
}, {usage = "gpush scripts/sample.lua (--ckpt FILE | --random) [flags] 'prompt' ...",
    description = 'Sample from a GPT with a KV cache.'})

if o.device ~= '' then gp.set_device(o.device) end
gp.manual_seed(o.seed)

local model, tok
if o.random then
  model = gp.nn.GPT {vocab_size = 256, block_size = o.block, n_embd = o.n_embd, n_layer = o.n_layer, n_head = o.n_head}
  tok = require('gpush.models.generate').bytes
elseif o.ckpt ~= '' then
  local sd, meta = gp.load(o.ckpt, {device = gp.device()})
  local cfg = meta.config
  if type(cfg) ~= 'table' then error('sample: ' .. o.ckpt .. ' has no config in its metadata (write it with train_gpt.lua --out)') end
  cfg.dropout = 0
  model = gp.nn.GPT(cfg)
  model:load_state_dict(sd)
  local vocab = meta.vocab
  if type(vocab) == 'table' then -- vocab[id + 1] = the byte of token id
    local stoi = {}
    for i, b in ipairs(vocab) do stoi[b] = i - 1 end
    tok = {
      encode = function(_, s)
        local r = {}
        for i = 1, #s do
          local id = stoi[s:byte(i)]
          if not id then
            error(string.format("sample: the prompt's byte %d (%q) is not in the checkpoint's vocabulary of %d symbols; " ..
              'train_gpt.lua --vocab printable (the default) covers the printable ASCII, --vocab bytes every byte', s:byte(i),
              s:sub(i, i), #vocab), 0)
          end
          r[i] = id
        end
        return r
      end,
      decode = function(_, ids)
        local c = {}
        for i, v in ipairs(ids) do c[i] = string.char(vocab[v + 1] or 63) end
        return table.concat(c)
      end,
    }
  else
    tok = require('gpush.models.generate').bytes
  end
else
  error('sample: give --ckpt FILE or --random (see --help)')
end
if o.bf16 then model:bf16() end
model:eval()

local prompts = o._rest
if #prompts == 0 then prompts = {'\n'} end
local stop = {}
if o.stop ~= '' then stop = {tok:encode(o.stop)[1]} end
local rows = #prompts * o.n
local stream = not o.quiet
print(string.format('sample: %d prompt(s) x %d = %d rows, max_new %d, %s, %d parameters', #prompts, o.n, rows,
  o.max_new, gp.device(), model:num_parameters()))
local first = true
local function callback(_, ids)
  if rows == 1 then
    if first then io.write(prompts[1]); first = false end
    io.write(tok:decode({ids[1]}))
  else
    io.write('.')
  end
  io.flush()
end

local t0 = gp.train.now()
local r = gp.generate(model, prompts, {
  n = o.n, max_new = o.max_new, temperature = o.temperature, top_k = o.top_k, top_p = o.top_p, min_p = o.min_p,
  repetition_penalty = o.repetition_penalty, greedy = o.greedy, tokenizer = tok, stop = stop,
  callback = stream and callback or nil,
})
gp.sync()
local dt = gp.train.now() - t0
if stream then io.write('\n') end
if rows > 1 or not stream then
  for i, text in ipairs(r.text) do
    local b = math.floor((i - 1) / o.n) + 1
    print(string.format('--- prompt %d, sample %d ---', b, (i - 1) % o.n + 1))
    print(prompts[b] .. text)
  end
end
local ntok = 0
for _, l in ipairs(r.lists) do ntok = ntok + #l end
print(string.format('%d tokens in %.3f s: %.1f tokens/s (%d rows)', ntok, dt, ntok / dt, rows))
