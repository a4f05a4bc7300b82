-- Training checkpoints a run resumes from (gp.train.save_state / load_state):
-- the model, the optimizer (moments, master weights, its step count and
-- hyperparameters), the step, the generator's state (which also fixes the
-- data position: gp.data draws its batches from the generator) and the
-- script's own metadata (its flags, a config), in one safetensors file that
-- gp.save writes atomically: a run killed at any moment leaves the previous
-- checkpoint whole. A resumed run continues the loss curve exactly (on the
-- CPU, bit for bit).
--
--   gp.train.save_state('run.ckpt', {model = m, optimizer = opt, step = step, meta = {args = o}})
--   local step, meta = gp.train.load_state('run.ckpt', {model = m, optimizer = opt})
local gp = require 'gpush.core'
local rt = require 'gpush.core.runtime'
local doc = require('gpush.core.doc').doc
local raise = rt.raise

local M = {}
local KEY = 'gpush.train'

local function check(s, op, need_step)
  if type(s) ~= 'table' or type(s.model) ~= 'table' or type(s.model.state_dict) ~= 'function' then
    raise(op .. ': needs {model = a module, optimizer = an optimizer, ...}')
  end
  if s.optimizer ~= nil and (type(s.optimizer) ~= 'table' or type(s.optimizer.state_dict) ~= 'function') then
    raise(op .. ': optimizer must be a gp.optim optimizer')
  end
  if need_step and (type(s.step) ~= 'number' or s.step < 0 or s.step ~= math.floor(s.step)) then
    raise(op .. ': step must be an integer >= 0')
  end
end

function M.save_state(path, s)
  local op = 'save_state'
  check(s, op, true)
  local tensors, meta = {}, {}
  for k, t in pairs(s.model:state_dict()) do tensors['model.' .. k] = t end
  local om
  if s.optimizer then
    local ot
    ot, om = s.optimizer:state_dict()
    for k, t in pairs(ot) do tensors['optimizer.' .. k] = t end
  end
  for k, v in pairs(s.meta or {}) do
    if k == KEY then raise(op .. ": the metadata key '" .. KEY .. "' is gpush's own") end
    meta[k] = v
  end
  meta[KEY] = {step = s.step, rng = gp.rng_state(), optimizer = om}
  return gp.save(path, tensors, meta)
end
doc(M.save_state, 'gp.train.save_state(path, {model=, optimizer=, step=, meta={}})',
  "a checkpoint to resume training from: the model's and the optimizer's state, the step, the generator's state and meta, written atomically")

function M.load_state(path, s)
  local op = 'load_state'
  check(s, op, false)
  local tensors, meta = gp.load(path)
  local st = meta[KEY]
  if type(st) ~= 'table' or type(st.step) ~= 'number' or type(st.rng) ~= 'table' then
    raise(string.format('%s: %s is not a training checkpoint (no %s metadata: it was not written by save_state)', op,
      path, KEY))
  end
  local mt, ot = {}, {}
  for k, t in pairs(tensors) do
    local m = k:match('^model%.(.*)$')
    local o = k:match('^optimizer%.(.*)$')
    if m then mt[m] = t elseif o then ot[o] = t
    else raise(string.format("%s: %s has a tensor '%s' that is neither model. nor optimizer.", op, path, k)) end
  end
  s.model:load_state_dict(mt)
  if s.optimizer then
    if not st.optimizer then raise(string.format('%s: %s holds no optimizer state', op, path)) end
    s.optimizer:load_state_dict(ot, st.optimizer)
  end
  gp.set_rng_state(st.rng)
  meta[KEY] = nil
  return st.step, meta
end
doc(M.load_state, 'gp.train.load_state(path, {model=, optimizer=})',
  "restore a gp.train.save_state checkpoint into the model and optimizer, and the generator's state; returns step, meta")

-- the flags worth saving with a checkpoint (o from gp.args.parse, without its bookkeeping)
function M.saved_args(o)
  local r = {}
  for k, v in pairs(o) do if k ~= '_rest' and k ~= '_given' then r[k] = v end end
  return r
end
doc(M.saved_args, 'gp.train.saved_args(o)', 'the flags of gp.args.parse to store in a checkpoint (for resume_args)')

-- a resumed run's flags: the checkpoint's, except those given on this command
-- line and those listed in `own` (flags of one invocation, such as --resume)
function M.resume_args(o, saved, own)
  if type(saved) ~= 'table' then return o end
  local given, skip = o._given or {}, {}
  for _, k in ipairs(own or {}) do skip[(k:gsub('-', '_'))] = true end
  for k, v in pairs(saved) do
    if k ~= '_rest' and k ~= '_given' and not given[k] and not skip[k] and o[k] ~= nil then o[k] = v end
  end
  return o
end
doc(M.resume_args, 'gp.train.resume_args(o, saved, {own flags})',
  'the flags of a resumed run: those saved in its checkpoint, except the ones given on the command line and the listed ones (o from gp.args.parse)')

return M
