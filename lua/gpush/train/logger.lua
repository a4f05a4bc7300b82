-- gp.train: the progress line and JSONL log of a training loop.
--
--   local log = gp.train.logger{steps = 1000, every = 10, tokens_per_step = B * T * accum, file = 'log.jsonl'}
--   for step = 1, 1000 do
--     ...
--     log:step(step, loss, opt:get_lr())   -- loss stays on the device
--   end
--   log:finish()
--
-- Between logged steps the loss is added into a device scalar (no host
-- synchronization); every `every` steps (and at the last) the mean is read
-- once, and a line is printed: step, loss, lr, tokens/s, elapsed and ETA.
-- On a terminal the line is rewritten in place (\r); otherwise (a pipe, a
-- file) each report is a plain line. Every report is also a JSON line of the
-- log file: {step, loss, lr, tokens_per_s, time} (and any extra fields).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local raise = rt.raise

local doc = require('gpush.core.doc').doc
local M = {}
local gp = require 'gpush.core'

local function now_s() return rt.C.gp_wall_ms() / 1000 end
M.now = now_s

ffi.cdef 'int isatty(int fd);'
function M.isatty(fd) return ffi.C.isatty(fd or 1) == 1 end

local function fmt_time(s)
  if s ~= s or s == math.huge then return '?' end
  s = math.floor(s + 0.5)
  if s >= 3600 then return string.format('%dh%02dm', math.floor(s / 3600), math.floor(s % 3600 / 60)) end
  if s >= 60 then return string.format('%dm%02ds', math.floor(s / 60), s % 60) end
  return string.format('%ds', s)
end

local Logger = {}
Logger.__index = Logger

-- opts: steps (total, for the ETA), every (10), tokens_per_step, file (a
-- JSONL path, optional; append: add to it), start (the step a resumed run
-- starts after), tty (default: stdout is a terminal), print (false: silent)
function M.logger(opts)
  opts = opts or {}
  local self = setmetatable({
    steps = opts.steps, every = opts.every or 10, tokens_per_step = opts.tokens_per_step or 0,
    tty = opts.tty, quiet = opts.print == false, t0 = now_s(), records = {},
  }, Logger)
  if self.tty == nil then self.tty = M.isatty(1) end
  if type(self.every) ~= 'number' or self.every < 1 then raise('logger: every must be >= 1') end
  if opts.file then
    local f, err = io.open(opts.file, opts.append and 'a' or 'w')
    if not f then raise('logger: cannot open the log: ' .. tostring(err)) end
    self.file = f
  end
  self.t_last, self.step_last = self.t0, opts.start or 0
  self.start = opts.start or 0
  self.acc, self.nacc = nil, 0
  return self
end

-- add a loss (a device tensor or a number) for this step; report when step
-- is a multiple of `every` or the last step. Returns the record when it
-- reported (its loss is the mean since the last report), else nil.
function Logger:step(step, loss, lr, extra)
  if loss ~= nil then self:add(loss) end
  if step % self.every ~= 0 and step ~= self.steps then return nil end
  return self:report(step, lr, extra)
end

-- add a loss without ending a step (micro-steps of gradient accumulation);
-- the report shows the mean of the losses added since the last one
function Logger:add(loss)
  if tensor.is_tensor(loss) then
    local l = gp.no_grad(function() return loss:detach():to('f32'):reshape {1} end)
    if self.acc then self.acc:add_(l) else self.acc = l:clone() end
  else
    self.acc_num = (self.acc_num or 0) + loss
  end
  self.nacc = self.nacc + 1
end

-- leave `seconds` (an evaluation, a checkpoint) out of tokens/s and the ETA
function Logger:exclude(seconds)
  self.t0 = self.t0 + seconds
  self.t_last = self.t_last + seconds
end

-- read the accumulated loss (the one host sync) and print and log a record
function Logger:report(step, lr, extra)
  local t = now_s()
  local loss
  if self.nacc > 0 then
    local s = (self.acc and self.acc:item() or 0) + (self.acc_num or 0)
    loss = s / self.nacc
  end
  local dt = t - self.t_last
  local tps = dt > 0 and self.tokens_per_step * (step - self.step_last) / dt or 0
  local elapsed = t - self.t0
  local rec = {step = step, loss = loss, lr = lr, tokens_per_s = tps, time = elapsed}
  for k, v in pairs(extra or {}) do rec[k] = v end
  self.acc, self.acc_num, self.nacc = nil, nil, 0
  self.t_last, self.step_last = t, step
  self.records[#self.records + 1] = rec
  self:write(rec)
  if not self.quiet then
    local eta = self.steps and step > self.start and elapsed / (step - self.start) * (self.steps - step) or nil
    local parts = {string.format('step %d%s', step, self.steps and ('/' .. self.steps) or '')}
    if loss then parts[#parts + 1] = string.format('loss %.4f', loss) end
    for k, v in pairs(extra or {}) do
      if type(v) == 'number' then parts[#parts + 1] = string.format('%s %.4f', k, v) end
    end
    if lr then parts[#parts + 1] = string.format('lr %.3g', lr) end
    parts[#parts + 1] = string.format('%.0f tok/s', tps)
    parts[#parts + 1] = fmt_time(elapsed) .. (eta and (' ETA ' .. fmt_time(eta)) or '')
    local line = table.concat(parts, ' | ')
    if self.tty then
      io.stdout:write('\r', line, '\027[K')
      self.open_line = true
    else
      io.stdout:write(line, '\n')
    end
    io.stdout:flush()
  end
  return rec
end

-- a JSON line in the log file (any record: evaluations, the final summary)
function Logger:write(rec)
  if self.file then
    self.file:write(gp.json.encode(rec), '\n')
    self.file:flush()
  end
end

-- print a line of its own (ends the \r line first on a terminal)
function Logger:print(...)
  if self.quiet then return end
  if self.open_line then io.stdout:write('\n'); self.open_line = false end
  print(...)
end

function Logger:finish()
  if self.open_line then io.stdout:write('\n'); self.open_line = false end
  if self.file then self.file:close(); self.file = nil end
  io.stdout:flush()
end

doc(M.now, 'gp.train.now()', 'seconds on the host monotonic clock')
doc(M.isatty, 'gp.train.isatty(fd)', 'true when the file descriptor (1: stdout) is a terminal')
doc(M.logger, 'gp.train.logger{steps=, every=10, tokens_per_step=, file=}',
  'progress lines (\\r on a terminal) and a JSONL log; log:step(step, loss, lr) reads the loss only every `every` steps')

return M
