-- chat.lua: chat with a real model through its chat template, tokens streamed.
--
--   gpush scripts/chat.lua                                  -- SmolLM2-135M-Instruct (make models), interactive
--   gpush scripts/chat.lua --prompt 'What is the capital of France?'
--   gpush scripts/chat.lua --model path/to/hf_dir --system 'You answer in one line.'
--   gpush scripts/chat.lua --compare smollm2 smollm2+adapters.safetensors --prompt 'Say hello'
--
-- A model is a short name (gp.models.NAMES), a Hugging Face directory or a
-- .gguf file; MODEL+ADAPTERS.safetensors adds the LoRA adapters that
-- gp.lora.save wrote. With --compare both models answer every prompt with
-- the same seed, one after the other. At the prompt: /reset forgets the
-- conversation, /system TEXT sets the system prompt, /quit (or Ctrl-D) leaves.
-- The oldest turns are dropped when the conversation would no longer fit in
-- the model's context with --max-new tokens to spare.
local gp = rawget(_G, 'gp') or require 'gpush'

local o = gp.args.parse(arg, {
  {'model', 'smollm2', 'a short name, a Hugging Face directory or a .gguf file (+ADAPTERS.safetensors for LoRA adapters)'},
  {'compare', false, 'the next two arguments are two models answering side by side (same prompts, same seed)'},
  {'prompt', '', 'answer this one message and exit'},
  {'system', '', 'the system prompt (default: the template\'s own, if any)'},
  {'max-new', 256, 'longest answer in tokens'},
  {'temperature', 0.7, 'softmax temperature'},
  {'top-p', 0.9, 'nucleus sampling threshold (1: off)'},
  {'top-k', 0, 'keep the k most likely tokens (0: off)'},
  {'min-p', 0.0, 'keep tokens with p >= min-p * max p (0: off)'},
  {'repetition-penalty', 1.1, 'CTRL penalty on tokens already in the conversation (1: off)'},
  {'greedy', false, 'argmax decoding'},
  {'dtype', '', 'f32, bf16 or f16 (default: bf16 on the GPU, f32 on the CPU)'},
  {'device', '', 'cpu or cuda (default: cuda when a GPU is usable)'},
  {'seed', 1234, 'random seed (each answer starts from it: the same prompt gives the same answer)'},
}, {usage = 'gpush scripts/chat.lua [--model M] [--prompt TEXT] [--compare A B] [flags]',
    description = 'Chat with a model through its chat template.'})

if o.device ~= '' then gp.set_device(o.device) end
local dtype = o.dtype ~= '' and o.dtype or (gp.device() == 'cuda' and 'bf16' or 'f32')

-- a model spec: NAME_OR_PATH[+ADAPTERS]
local function load(spec)
  local base, adapters = spec:match('^(.-)%+(.+%.safetensors)$')
  base = base or spec
  local model, tok = gp.models.load(base, {dtype = dtype})
  if not tok then error('chat: ' .. base .. ' has no tokenizer') end
  if adapters then
    gp.lora.apply(model, {rank = 1}) -- the saved rank and targets replace these (gp.lora.load)
    gp.lora.load(model, adapters)
  end
  return {name = spec, model = model:eval(), tok = tok}
end

local specs = {o.model}
if o.compare then
  specs = {o._rest[1], o._rest[2]}
  if not (specs[1] and specs[2]) then error('chat: --compare needs two models: --compare A B') end
end
local bots = {}
for i, s in ipairs(specs) do bots[i] = load(s) end

-- print the text of ids as it grows, holding back an unfinished UTF-8 sequence
local function streamer(tok, prefix)
  local shown = 0
  io.write(prefix)
  return function(ids)
    local text = tok:decode(ids, {skip_special_tokens = true})
    local n = #text
    local i = n
    while i > 0 and i > n - 4 do -- a lead byte whose sequence is cut off: wait for the rest
      local b = text:byte(i)
      if b < 0x80 then break end
      if b >= 0xC0 then
        local need = b >= 0xF0 and 4 or b >= 0xE0 and 3 or 2
        if n - i + 1 < need then n = i - 1 end
        break
      end
      i = i - 1
    end
    if n > shown then io.write(text:sub(shown + 1, n)); io.flush(); shown = n end
  end
end

local function answer(bot, messages)
  local tok, model = bot.tok, bot.model
  local ctx = model.config.block_size or model.config.max_position_embeddings
  local msgs = messages
  local ids = tok:encode(tok:apply_chat_template(msgs, {add_generation_prompt = true}), {add_special_tokens = false})
  -- the context guard: drop the oldest turns (after a system message) until prompt + max_new fits
  while #ids + o.max_new > ctx and #msgs > 1 do
    local start = msgs[1].role == 'system' and 2 or 1
    if #msgs - start < 1 then break end
    local kept = {}
    for i, m in ipairs(msgs) do if i ~= start then kept[#kept + 1] = m end end
    msgs = kept
    ids = tok:encode(tok:apply_chat_template(msgs, {add_generation_prompt = true}), {add_special_tokens = false})
  end
  if #ids + o.max_new > ctx then
    error(string.format('chat: the message is %d tokens; with --max-new %d it does not fit in the context of %d', #ids, o.max_new, ctx))
  end
  gp.manual_seed(o.seed)
  local out = {}
  local show = streamer(tok, #bots > 1 and ('[' .. bot.name .. '] ') or '')
  local t0 = gp.train.now()
  local r = gp.generate(model, {ids}, {
    max_new = o.max_new, temperature = o.temperature, top_p = o.top_p, top_k = o.top_k, min_p = o.min_p,
    repetition_penalty = o.repetition_penalty, greedy = o.greedy, stop = tok:stop_ids(),
    callback = function(_, step_ids) out[#out + 1] = step_ids[1]; show(out) end,
  })
  local dt = gp.train.now() - t0
  local reply = tok:decode(r.lists[1], {skip_special_tokens = true})
  io.write(string.format('\n(%d tokens, %.1f tokens/s)\n', #r.lists[1], #r.lists[1] / dt))
  return reply
end

local history = {}
for i = 1, #bots do history[i] = {} end
local system = o.system

local function turn(text)
  for i, bot in ipairs(bots) do
    local h = history[i]
    local msgs = {}
    if system ~= '' then msgs[1] = {role = 'system', content = system} end
    for _, m in ipairs(h) do msgs[#msgs + 1] = m end
    msgs[#msgs + 1] = {role = 'user', content = text}
    local reply = answer(bot, msgs)
    h[#h + 1] = {role = 'user', content = text}
    h[#h + 1] = {role = 'assistant', content = reply}
  end
end

if o.prompt ~= '' then
  turn(o.prompt)
  return
end

local ok_rl, rl = pcall(require, 'gpush.tools.repl_c')
local tty = ok_rl and rl.isatty(0)
print(string.format('chat: %s on %s (%s); /reset, /system TEXT, /quit', table.concat(specs, ' vs '), gp.device(), dtype))
while true do
  local line
  if tty then line = rl.readline('you> ') else io.write('you> '); io.flush(); line = io.read('*l') end
  if line == nil or line == '/quit' then break end
  if line ~= false and line:find('%S') then
    if tty then rl.add_history(line) end
    if line == '/reset' then
      for i = 1, #bots do history[i] = {} end
      print('(the conversation is forgotten)')
    elseif line:match('^/system') then
      system = line:match('^/system%s*(.*)$')
      for i = 1, #bots do history[i] = {} end
      print('(system prompt set; the conversation is forgotten)')
    else
      turn(line)
    end
  end
end
