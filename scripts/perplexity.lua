-- perplexity.lua: a language model's perplexity on a text (by default the end
-- of the Shakespeare corpus that `make models` fetches: a passage no gpush
-- script trains on), in windows of --window tokens that overlap by half, each
-- token scored once with at least --window/2 tokens of context (as Hugging
-- Face's perplexity guide computes it).
--   gpush scripts/perplexity.lua [--model smollm2] [--file FILE] [--tokens 4096] [--window 1024]
local gp = rawget(_G, 'gp') or require 'gpush'
local a = gp.args.parse(arg, {
  {'model', 'smollm2', 'a short name, a Hugging Face directory or a .gguf file'},
  {'file', '', 'the text (default: the last --tokens tokens of the Shakespeare corpus from make models)'},
  {'tokens', 4096, 'tokens of the text to score (from its end)'},
  {'window', 1024, 'tokens a forward sees'},
  {'dtype', '', 'f32, bf16 or f16 (default: bf16 on the GPU, f32 on the CPU)'},
}, {usage = 'gpush scripts/perplexity.lua [flags]', description = 'Perplexity of a model on a held-out text.'})

local dtype = a.dtype ~= '' and a.dtype or (gp.device() == 'cuda' and 'bf16' or 'f32')
local file = a.file ~= '' and a.file or (gp.models.dir() .. '/shakespeare/shakespeare.txt')
local f = io.open(file, 'rb')
if not f then error('perplexity: cannot read ' .. file .. (a.file == '' and ' (run `make models`)' or '')) end
-- the last bytes only: enough for --tokens tokens (about 4 bytes a token in English)
local size = f:seek('end')
f:seek('set', math.max(0, size - a.tokens * 6))
local text = f:read('*a')
f:close()

local model, tok = gp.models.load(a.model, {dtype = dtype})
local ids = tok:encode(text, {add_special_tokens = false})
if #ids > a.tokens then ids = {unpack(ids, #ids - a.tokens + 1)} end
local W, stride = a.window, math.floor(a.window / 2)
local nll, n = 0, 0
local dev = gp.device()
gp.no_grad(function()
  local start = 1
  while true do
    local stop = math.min(start + W - 1, #ids)
    local chunk = {unpack(ids, start, stop)}
    local x = gp.tensor({chunk}, {dtype = 'i64', device = dev})
    -- targets: the next token; the ones already scored by the previous window are ignored (-100)
    local y, first_new = {}, start == 1 and 1 or W - stride
    for j = 1, #chunk - 1 do y[j] = j >= first_new and chunk[j + 1] or -100 end
    y[#chunk] = -100
    local logits = model(x)
    local loss = gp.cross_entropy(logits:view {#chunk, -1}, gp.tensor(y, {dtype = 'i64', device = dev}), {reduction = 'sum'})
    local scored = 0
    for _, v in ipairs(y) do if v >= 0 then scored = scored + 1 end end
    nll, n = nll + loss:item(), n + scored
    if stop == #ids then break end
    start = start + stride
  end
end)
print(string.format('perplexity of %s on the last %d tokens of %s: %.3f (mean NLL %.4f nats over %d tokens, window %d, %s on %s)',
  a.model, #ids, file, math.exp(nll / n), nll / n, n, W, dtype, dev))
