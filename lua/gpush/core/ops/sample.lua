-- sampling: gp.sample(logits, opts) -> tokens, probs (kernels/sample.{c,cu}).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local raise = rt.raise
local is_tensor, empty, shape_str = tensor.is_tensor, tensor.empty, tensor.shape_str
local doc = gp.doc

local function num(o, name, default)
  local v = o[name]
  if v == nil then return default end
  if type(v) ~= 'number' or v ~= v then raise(string.format('sample: %s must be a number, got %s', name, tostring(v))) end
  return v
end

-- the checked sampling options of a call: temperature (0 when greedy), top_k, top_p, min_p, penalty
local function options(o, V)
  if type(o) ~= 'table' then raise('sample: options must be a table {temperature=, top_k=, top_p=, ...}') end
  local temp = num(o, 'temperature', 1)
  if temp < 0 or temp == math.huge then raise('sample: temperature must be >= 0 (0: greedy), got ' .. temp) end
  if o.greedy then temp = 0 end
  local k = num(o, 'top_k', 0)
  if k < 0 or k ~= math.floor(k) then raise('sample: top_k must be a non-negative integer (0: off), got ' .. k) end
  if V and k > V then raise(string.format('sample: top_k = %d is larger than the vocabulary (V = %d)', k, V)) end
  local p = num(o, 'top_p', 1)
  if not (p > 0 and p <= 1) then raise('sample: top_p must be in (0, 1], got ' .. p) end
  local mp = num(o, 'min_p', 0)
  if not (mp >= 0 and mp <= 1) then raise('sample: min_p must be in [0, 1], got ' .. mp) end
  local pen = num(o, 'repetition_penalty', 1)
  if not (pen > 0 and pen < math.huge) then raise('sample: repetition_penalty must be > 0, got ' .. pen) end
  return temp, k, p, mp, pen
end
gp.sample_options = options
doc(gp.sample_options, 'gp.sample_options(opts, V)',
  'the checked sampling options: temperature (0 when greedy), top_k, top_p, min_p, repetition_penalty; bad values raise')

-- logits (N, V) or (V); opts: temperature=1, greedy=false, top_k=0, top_p=1, min_p=0,
-- repetition_penalty=1 with history (N, L) i64 and history_len (a number or an i64 (N) tensor),
-- out (i64 (N)) and probs ((N, V)) to write into instead of allocating
function gp.sample(logits, opts)
  opts = opts or {}
  if not is_tensor(logits) then raise('sample: logits must be a tensor') end
  local d = logits:dim()
  if d ~= 1 and d ~= 2 then raise('sample: logits must be (V) or (N, V), got ' .. shape_str(logits.shape)) end
  if not logits:is_floating_point() then raise('sample: logits must be a float tensor, got ' .. logits.dtype) end
  local x = logits:contiguous()
  if d == 1 then x = x:view {1, logits:size(1)} end
  local N, V = x:size(1), x:size(2)
  local temp, k, p, mp, pen = options(opts, V)
  if pen ~= 1 and opts.history ~= nil then
    local h = opts.history
    if not is_tensor(h) or h.dtype ~= 'i64' or h:dim() ~= 2 or h:size(1) ~= N then
      raise(string.format('sample: history must be an i64 (N = %d, L) tensor, got %s', N,
        is_tensor(h) and (h.dtype .. ' ' .. shape_str(h.shape)) or type(h)))
    end
    h = h:contiguous()
    local lens = opts.history_len
    if lens == nil then lens = h:size(2) end
    if type(lens) == 'number' then
      if lens < 0 or lens > h:size(2) or lens ~= math.floor(lens) then
        raise(string.format('sample: history_len %s must be an integer in [0, %d]', tostring(lens), h:size(2)))
      end
      lens = gp.full({N}, lens, {dtype = 'i64', device = x.device})
    end
    local px = empty(x.shape, x.dtype, x.device, 'sample')
    gp.k.repetition_penalty(px, x, h, lens, pen)
    x = px
  end
  local out = opts.out or empty({N}, 'i64', x.device, 'sample')
  local probs = opts.probs or empty(x.shape, x.dtype, x.device, 'sample')
  gp.k.sample(out, probs, x, temp, k, p, mp)
  if d == 1 then return out, probs:view {V} end
  return out, probs
end
doc(gp.sample, 'gp.sample(logits, {temperature=1, greedy=false, top_k=0, top_p=1, min_p=0, repetition_penalty=1, history=, history_len=})',
  'one token per row of logits (N, V): i64 (N) ids and the filtered, renormalized probs (N, V); filters: top-k and min-p, then top-p; Philox draws (gp.manual_seed)')

function gp.repetition_penalty(logits, history, history_len, penalty)
  if not is_tensor(logits) or logits:dim() ~= 2 then raise('repetition_penalty: logits must be a (N, V) tensor') end
  local _, _, _, _, pen = options({repetition_penalty = penalty})
  local x = logits:contiguous()
  local N = x:size(1)
  if not is_tensor(history) or history.dtype ~= 'i64' then raise('repetition_penalty: history must be an i64 (N, L) tensor') end
  local lens = history_len or history:size(2)
  if type(lens) == 'number' then lens = gp.full({N}, lens, {dtype = 'i64', device = x.device}) end
  local out = empty(x.shape, x.dtype, x.device, 'repetition_penalty')
  gp.k.repetition_penalty(out, x, history:contiguous(), lens, pen)
  return out
end
doc(gp.repetition_penalty, 'gp.repetition_penalty(logits, history, history_len, penalty)',
  'logits (N, V) with the ids of history (N, L) (first history_len of each row) penalized: x / penalty if x > 0 else x * penalty')

return gp
