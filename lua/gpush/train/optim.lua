-- gp.optim: SGD and AdamW over the multi-tensor kernels (one launch per list
-- of parameters), gradient clipping on the device, learning-rate schedules
-- and bf16 mixed precision with f32 master weights.
--
-- Lists. At each step the parameters that have a gradient are put in buckets
-- by (param group, weight decay on/off, gradient dtype, parameter dtype);
-- each bucket is one gp_tlist {p, m, v, g} and one gp_multi_adamw launch. A
-- bucket's list is made once and kept while its gradient tensors stay the
-- same objects; it is re-made only when a gradient object changes (e.g.
-- after p.grad = nil).
--
-- Mixed precision: a bucket of bf16 (or f16) parameters updates their f32
-- master copies ({master, m, v, g}) and its list has a fifth group, the
-- parameters themselves, into which the same launch stores each updated
-- master rounded as k.copy rounds it. f32 parameters (no master) are in
-- other buckets, so a step is one launch per bucket whatever the mix. A
-- low-precision parameter that is not contiguous (or f64) is bucketed apart
-- and copied back from its master with one k.copy after the launch.
--
-- zero_grad zeroes in place instead of setting grads to nil: the gradients
-- are views of one flat buffer per dtype, owned by the optimizer, so zeroing
-- is one fill launch per dtype, autograd accumulates into the same objects
-- (it adds into an existing p.grad), and the lists stay valid from step to
-- step (no re-upload of the pointer table, no allocation). A parameter that
-- gets no gradient in a step still has a zero gradient (and still decays).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local C, raise, is_tensor = rt.C, rt.raise, tensor.is_tensor

local doc = require('gpush.core.doc').doc
local M = {}
local gp = require 'gpush.core'

-- a flat list of distinct parameters from a list, a module (m:parameters())
-- or a list of param groups
local function params_of(x, op)
  if type(x) == 'table' and not is_tensor(x) and type(x.parameters) == 'function' then x = x:parameters() end
  if is_tensor(x) then x = {x} end
  if type(x) ~= 'table' then raise(op .. ': needs a list of parameter tensors or a module') end
  return x
end

local tlist_box = ffi.new('gp_tlist*[1]')

-- a gp_tlist over groups of tensors (lists of equal length), freed by the GC
local function make_tlist(op, groups)
  local n, ng = #groups[1], #groups
  local ts = ffi.new('const gp_tensor *[?]', ng * n)
  for g = 1, ng do
    for i = 1, n do ts[(g - 1) * n + i - 1] = groups[g][i].c end
  end
  local rc = C.gp_tlist_create(tlist_box, ng, n, ts)
  if rc ~= 0 then raise(op .. ': ' .. rt.last_error()) end
  return ffi.gc(tlist_box[0], C.gp_tlist_free)
end

---------------------------------------------------------------------------
-- the optimizer object

local Optimizer = {}
Optimizer.__index = Optimizer
M.Optimizer = Optimizer

local function new(kind, params, opts, defaults)
  opts = opts or {}
  if type(opts) ~= 'table' then raise(kind .. ': options must be a table') end
  local self = setmetatable({kind = kind, param_groups = {}, params = {}, info = {}, state = {}, step_count = 0,
                             _lists = {}, _flat = {}}, Optimizer)
  local hyper = {}
  for k, v in pairs(defaults) do hyper[k] = v end
  for k, v in pairs(opts) do hyper[k] = v end
  self.defaults = hyper
  self.master_weights = hyper.master_weights ~= false
  self.device_hyper = hyper.device_hyper == true
  self.decay_min_dim = hyper.decay_min_dim or 2
  -- groups: a list of tensors (or a module), or a list of {params=..., <overrides>}
  local list = params_of(params, kind)
  local groups = {{params = list}}
  if list[1] ~= nil and not is_tensor(list[1]) and type(list[1]) == 'table' and list[1].params then groups = list end
  local seen = {}
  for gi, g in ipairs(groups) do
    local grp = {}
    for k, v in pairs(hyper) do grp[k] = v end
    for k, v in pairs(g) do if k ~= 'params' then grp[k] = v end end
    grp.params = {}
    for j, p in ipairs(params_of(g.params, kind)) do
      if not is_tensor(p) then raise(string.format('%s: parameter %d of group %d is a %s, not a tensor', kind, j, gi, type(p))) end
      if not p:is_floating_point() then raise(string.format('%s: parameter %d of group %d is %s; parameters must be float', kind, j, gi, p.dtype)) end
      if seen[p] then raise(string.format('%s: parameter %d of group %d appears twice', kind, j, gi)) end
      seen[p] = true
      grp.params[#grp.params + 1] = p
      self.params[#self.params + 1] = p
      self.info[#self.params] = {group = gi, decay = p:dim() >= self.decay_min_dim}
    end
    self.param_groups[gi] = grp
  end
  if #self.params == 0 then raise(kind .. ': no parameters given') end
  self.index = {}
  for i, p in ipairs(self.params) do self.index[p] = i end
  return self
end

function Optimizer:__tostring()
  return string.format('%s(%d parameters in %d groups, lr %g, step %d)', self.kind, #self.params, #self.param_groups,
    self.param_groups[1].lr, self.step_count)
end

-- set the learning rate of every group (a group's lr_scale multiplies it)
function Optimizer:set_lr(lr)
  if type(lr) ~= 'number' or not (lr >= 0) then raise('set_lr: the learning rate must be a number >= 0') end
  for _, g in ipairs(self.param_groups) do g.lr = lr * (g.lr_scale or 1) end
end
function Optimizer:get_lr() return self.param_groups[1].lr end

-- gradients as views of one zeroed flat buffer per (device, dtype); see the
-- note at the top. zero_grad{set_to_none=true} drops them instead.
function Optimizer:zero_grad(opts)
  if opts and opts.set_to_none then
    for _, p in ipairs(self.params) do rawset(p, 'grad', nil) end
    return
  end
  local flat = self._flat
  if not flat.views then
    local total, order = {}, {}
    for _, p in ipairs(self.params) do
      local key = p.device .. ':' .. p.dtype
      if not total[key] then total[key] = 0; order[#order + 1] = {key = key, device = p.device, dtype = p.dtype} end
      total[key] = total[key] + p:numel()
    end
    flat.bufs, flat.views = {}, {}
    for _, o in ipairs(order) do
      flat.bufs[o.key] = tensor.empty({total[o.key]}, o.dtype, o.device, 'zero_grad')
    end
    local off = {}
    for i, p in ipairs(self.params) do
      local key = p.device .. ':' .. p.dtype
      local n = p:numel()
      off[key] = (off[key] or 0)
      flat.views[i] = flat.bufs[key]:narrow(1, off[key] + 1, n):view(p.shape)
      off[key] = off[key] + n
    end
  end
  for _, b in pairs(flat.bufs) do gp.k.fill(b, 0) end
  for i, p in ipairs(self.params) do
    local v = flat.views[i]
    if rawget(p, 'grad') ~= v then rawset(p, 'grad', v) end
  end
end

-- how a parameter is updated: 0 f32 (in place), 1 bf16 / 2 f16 (its master,
-- and the kernel writes the parameter), 3 another (its master, then a copy)
local function param_kind(p)
  local dt = p.dtype
  if dt == 'f32' then return 0 end
  if (dt == 'bf16' or dt == 'f16') and p:is_contiguous() then return dt == 'bf16' and 1 or 2 end
  return 3
end

-- the buckets of this step: params with a gradient by (group, decay, grad
-- dtype, param_kind)
function Optimizer:_buckets(op)
  local buckets, order = {}, {}
  for i, p in ipairs(self.params) do
    local g = rawget(p, 'grad')
    if g ~= nil then
      if not is_tensor(g) then raise(string.format('%s: the grad of parameter %d is a %s', op, i, type(g))) end
      if g:numel() ~= p:numel() or g.device ~= p.device then
        raise(string.format('%s: parameter %d is %s on %s but its grad is %s on %s', op, i, tensor.shape_str(p.shape),
          p.device, tensor.shape_str(g.shape), g.device))
      end
      if not g:is_contiguous() then raise(string.format('%s: the grad of parameter %d is not contiguous', op, i)) end
      local info = self.info[i]
      local pk = param_kind(self.params[i])
      local key = ((info.group * 2 + (info.decay and 1 or 0)) * 8 + g.c.dtype) * 4 + pk
      local b = buckets[key]
      if not b then
        b = {key = key, group = info.group, decay = info.decay, low = pk == 1 or pk == 2, idx = {}, grads = {}}
        buckets[key] = b
        order[#order + 1] = b
      end
      b.idx[#b.idx + 1] = i
      b.grads[#b.grads + 1] = g
      local s = rawget(p, '_gscale')
      if s ~= nil then
        if b.gscale ~= nil and b.gscale ~= s then raise(op .. ': parameters of one group were clipped by different clip_grad_norm calls') end
        b.gscale = s
        rawset(p, '_gscale', nil)
      end
    end
  end
  return order
end

-- the cached list of a bucket, re-made when a gradient object changed
function Optimizer:_list(b, make_groups, op)
  local c = self._lists[b.key]
  if c and #c.idx == #b.idx then
    local same = true
    for j = 1, #b.idx do
      local g = b.grads[j]
      if c.idx[j] ~= b.idx[j] or c.grads[j] ~= g or c.cs[j] ~= g.c or c.ps[j] ~= self.params[b.idx[j]].c then
        same = false
        break
      end
    end
    if same then return c end
  end
  local groups = make_groups(b)
  if b.low then
    -- the low-precision parameters, written by the kernel from their masters
    local lows = {}
    for j, i in ipairs(b.idx) do lows[j] = self.params[i] end
    groups[#groups + 1] = lows
  end
  c = {idx = b.idx, grads = b.grads, cs = {}, ps = {}, groups = groups, low = b.low, tl = make_tlist(op, groups)}
  for j, g in ipairs(b.grads) do c.cs[j] = g.c; c.ps[j] = self.params[b.idx[j]].c end
  self._lists[b.key] = c
  return c
end

-- the f32 tensor the kernel updates: the parameter, or its f32 master copy
function Optimizer:_master(i, op)
  local p, st = self.params[i], self.state[i]
  if p.dtype == 'f32' then
    if not p:is_contiguous() then raise(string.format('%s: parameter %d is not contiguous', op, i)) end
    return p
  end
  if not self.master_weights then
    raise(string.format('%s: parameter %d is %s; the kernels update f32 tensors, so use master_weights=true (the default)', op, i, p.dtype))
  end
  if not st.master then st.master = gp.no_grad(function() return p:detach():to('f32'):contiguous() end) end
  return st.master
end

-- the masters of a bucket whose kernel did not write the parameters
function Optimizer:_copy_back(c)
  if c.low then return end
  local k = gp.k
  for j, i in ipairs(c.idx) do
    local st = self.state[i]
    if st.master then k.copy(self.params[i], st.master) end
  end
end

-- the gradient scale of this step: set by clip_grad_norm, else none
function Optimizer:_scale(b)
  local s = self._gscale or b.gscale
  return s and s.c or nil
end

-- Graph-safe hyper-parameters: with opt.device_hyper = true the kernels
-- read the learning rate (and AdamW's bias corrections) from a small device
-- tensor per bucket instead of launch arguments. step() writes it before the
-- launch; while a graph is being captured (opt._capturing) it only launches,
-- and opt:prepare_replay() advances the step and writes the values before
-- each replay of the captured step.
-- The values go through one host tensor per bucket (c.hyper_host, made with
-- c.hyper), so writing them allocates nothing. It is plain (pageable) host
-- memory on purpose: a copy from it returns once the bytes are staged, so the
-- next write may reuse it at once (a pinned buffer would need an event).
local hyper_vals = ffi.new('double[3]')
local function write_hyper(self, c, t)
  local g, n = c.hyper_group, 1
  hyper_vals[0] = g.lr
  if self.kind == 'AdamW' then
    hyper_vals[1], hyper_vals[2], n = 1 - g.betas[1] ^ t, 1 - g.betas[2] ^ t, 3
  end
  if c.hyper_host then
    rt.call(C.gp_from_doubles, c.hyper_host.c, hyper_vals, n)
    rt.call(C.gp_transfer, c.hyper.c, c.hyper_host.c)
  else
    rt.call(C.gp_from_doubles, c.hyper.c, hyper_vals, n)
  end
end
function Optimizer:_hyper(c, g, t)
  if not self.device_hyper then return nil end
  c.hyper_group = g
  if not c.hyper then
    local n, dev = self.kind == 'AdamW' and 3 or 1, c.groups[1][1].device
    c.hyper = tensor.empty({n}, 'f32', dev, 'hyper')
    if dev ~= 'cpu' then c.hyper_host = tensor.empty({n}, 'f32', 'cpu', 'hyper') end
  end
  if not self._capturing then write_hyper(self, c, t) end
  return c.hyper.c
end
function Optimizer:capture(fn)
  if not self.device_hyper then raise('capture: the optimizer was not made with device_hyper = true') end
  self._capturing = true
  local ok, g = pcall(gp.graph, fn)
  self._capturing = nil
  if not ok then error(g, 0) end
  return g
end
function Optimizer:prepare_replay()
  if not self.device_hyper then raise('prepare_replay: the optimizer was not made with device_hyper = true') end
  self.step_count = self.step_count + 1
  for _, c in pairs(self._lists) do if c.hyper then write_hyper(self, c, self.step_count) end end
end

---------------------------------------------------------------------------
-- AdamW

function M.AdamW(params, opts)
  local self = new('AdamW', params, opts, {lr = 3e-4, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1})
  for _, g in ipairs(self.param_groups) do
    local b = g.betas
    if type(b) ~= 'table' or type(b[1]) ~= 'number' or type(b[2]) ~= 'number' then raise('AdamW: betas must be {beta1, beta2}') end
  end
  return self
end

local function adamw_step(self)
  local op = 'AdamW.step'
  if not self._capturing then self.step_count = self.step_count + 1 end
  local t = self.step_count
  for _, b in ipairs(self:_buckets(op)) do
    local c = self:_list(b, function(bk)
      local ps, ms, vs = {}, {}, {}
      for j, i in ipairs(bk.idx) do
        local p, st = self.params[i], self.state[i]
        if not st then st = {}; self.state[i] = st end
        if not st.exp_avg then
          st.exp_avg = tensor.empty(p.shape, 'f32', p.device, op); gp.k.fill(st.exp_avg, 0)
          st.exp_avg_sq = tensor.empty(p.shape, 'f32', p.device, op); gp.k.fill(st.exp_avg_sq, 0)
        end
        ps[j], ms[j], vs[j] = self:_master(i, op), st.exp_avg, st.exp_avg_sq
      end
      return {ps, ms, vs, bk.grads}
    end, op)
    local g = self.param_groups[b.group]
    local wd = b.decay and g.weight_decay or 0
    rt.call(C.gp_multi_adamw, c.tl, self:_scale(b), self:_hyper(c, g, t), g.lr, g.betas[1], g.betas[2], g.eps, wd, t)
    self:_copy_back(c)
  end
  self._gscale = nil
end

---------------------------------------------------------------------------
-- SGD

function M.SGD(params, opts)
  local self = new('SGD', params, opts, {lr = 0.01, momentum = 0, nesterov = false, weight_decay = 0})
  for _, g in ipairs(self.param_groups) do
    if g.nesterov and not (g.momentum > 0) then raise('SGD: nesterov needs momentum > 0') end
  end
  return self
end

local function sgd_step(self)
  local op = 'SGD.step'
  if not self._capturing then self.step_count = self.step_count + 1 end
  for _, b in ipairs(self:_buckets(op)) do
    local c = self:_list(b, function(bk)
      local ps, bufs = {}, {}
      for j, i in ipairs(bk.idx) do
        local p, st = self.params[i], self.state[i]
        if not st then st = {}; self.state[i] = st end
        if not st.momentum_buffer then
          st.momentum_buffer = tensor.empty(p.shape, 'f32', p.device, op); gp.k.fill(st.momentum_buffer, 0)
        end
        ps[j], bufs[j] = self:_master(i, op), st.momentum_buffer
      end
      return {ps, bufs, bk.grads}
    end, op)
    local g = self.param_groups[b.group]
    local wd = b.decay and g.weight_decay or 0
    rt.call(C.gp_multi_sgd, c.tl, self:_scale(b), self:_hyper(c, g, self.step_count), g.lr, g.momentum, wd, g.nesterov and 1 or 0)
    self:_copy_back(c)
  end
  self._gscale = nil
end

function Optimizer:step()
  if self.kind == 'AdamW' then adamw_step(self) else sgd_step(self) end
end

---------------------------------------------------------------------------
-- state: tensors named '<state>.<param index>' and metadata, for gp.save:
--   gp.save(path, opt:state_dict())          -- tensors, metadata
--   opt:load_state_dict(gp.load(path))

local STATE_NAMES = {'exp_avg', 'exp_avg_sq', 'momentum_buffer', 'master'}

function Optimizer:state_dict()
  local tensors = {}
  for i, st in pairs(self.state) do
    for _, k in ipairs(STATE_NAMES) do
      if st[k] then tensors[k .. '.' .. i] = st[k] end
    end
  end
  local groups = {}
  for gi, g in ipairs(self.param_groups) do
    local h = {}
    for k, v in pairs(g) do if k ~= 'params' then h[k] = v end end
    groups[gi] = h
  end
  return tensors, {optimizer = self.kind, step = self.step_count, nparams = #self.params, groups = groups}
end

function Optimizer:load_state_dict(tensors, meta)
  local op = self.kind .. '.load_state_dict'
  if type(tensors) ~= 'table' then raise(op .. ': needs the tensors of a state_dict (and its metadata)') end
  meta = meta or {}
  if meta.optimizer and meta.optimizer ~= self.kind then
    raise(string.format('%s: the state is of a %s optimizer', op, tostring(meta.optimizer)))
  end
  if meta.nparams and meta.nparams ~= #self.params then
    raise(string.format('%s: the state has %d parameters but this optimizer has %d', op, meta.nparams, #self.params))
  end
  local new_state = {}
  for name, t in pairs(tensors) do
    local k, i = name:match('^([%w_]+)%.(%d+)$')
    i = tonumber(i)
    local known = false
    for _, s in ipairs(STATE_NAMES) do if s == k then known = true end end
    if not known or not i or not self.params[i] then raise(string.format("%s: unknown entry '%s'", op, name)) end
    local p = self.params[i]
    if not is_tensor(t) or t:numel() ~= p:numel() then
      raise(string.format("%s: '%s' is %s but parameter %d is %s", op, name, is_tensor(t) and tensor.shape_str(t.shape) or type(t),
        i, tensor.shape_str(p.shape)))
    end
    new_state[i] = new_state[i] or {}
    new_state[i][k] = t:to {dtype = 'f32', device = p.device}:contiguous():view(p.shape):clone()
  end
  self.state = new_state
  self._lists = {}
  if meta.step then self.step_count = meta.step end
  if type(meta.groups) == 'table' then
    for gi, h in ipairs(meta.groups) do
      local g = self.param_groups[gi]
      if g and type(h) == 'table' then for k, v in pairs(h) do g[k] = v end end
    end
  end
  local k = gp.k
  for i, st in pairs(self.state) do if st.master then k.copy(self.params[i], st.master) end end
end

---------------------------------------------------------------------------
-- gradient clipping: ||g|| over all grads on the device (gp_multi_sumsq per
-- dtype), the clip factor min(1, max_norm / (||g|| + 1e-6)) on the device,
-- handed to the next opt:step() as its gradient scale: no host sync, no extra
-- pass over the gradients (p.grad itself is left as it is).

local clip_cache = setmetatable({}, {__mode = 'k'})

function M.clip_grad_norm(target, max_norm, opts)
  local op = 'clip_grad_norm'
  if type(max_norm) ~= 'number' or not (max_norm > 0) then raise(op .. ': max_norm must be a number > 0') end
  local opt = getmetatable(target) == Optimizer and target or nil
  local params = opt and opt.params or params_of(target, op)
  -- grads by (device, dtype)
  local by, order = {}, {}
  for i, p in ipairs(params) do
    if not is_tensor(p) then raise(string.format('%s: element %d is not a tensor', op, i)) end
    local g = rawget(p, 'grad')
    if g ~= nil then
      if not g:is_contiguous() then raise(string.format('%s: the grad of parameter %d is not contiguous', op, i)) end
      local key = g.device .. ':' .. g.dtype
      if not by[key] then by[key] = {}; order[#order + 1] = key end
      local l = by[key]
      l[#l + 1] = g
    end
  end
  if #order == 0 then raise(op .. ': no parameter has a gradient') end
  local anchor = params[1]
  local cache = clip_cache[anchor]
  if not cache then cache = {}; clip_cache[anchor] = cache end
  local total
  for _, key in ipairs(order) do
    local grads = by[key]
    local c = cache[key]
    local same = c and #c.grads == #grads
    if same then
      for j, g in ipairs(grads) do if c.grads[j] ~= g or c.cs[j] ~= g.c then same = false; break end end
    end
    if not same then
      c = {grads = grads, cs = {}, tl = make_tlist(op, {grads}), sumsq = tensor.empty({1}, 'f32', grads[1].device, op)}
      for j, g in ipairs(grads) do c.cs[j] = g.c end
      cache[key] = c
    end
    rt.call(C.gp_multi_sumsq, c.sumsq.c, c.tl)
    if total then
      if c.sumsq.device ~= total.device then raise(op .. ': the gradients are on more than one device') end
      total = total + c.sumsq
    else
      total = #order > 1 and c.sumsq:clone() or c.sumsq
    end
  end
  local scale = tensor.empty({1}, 'f32', total.device, op)
  gp.k.clip_coef(scale, total, max_norm, (opts and opts.eps) or 1e-6)
  local norm = total:sqrt():view {}
  if opt then
    opt._gscale = scale
  else
    for _, p in ipairs(params) do if rawget(p, 'grad') ~= nil then rawset(p, '_gscale', scale) end end
  end
  return norm
end

---------------------------------------------------------------------------
-- learning-rate schedules: functions step -> lr (steps count from 1)

M.schedule = {}

local function need(o, k, op)
  if type(o[k]) ~= 'number' then raise(string.format('%s: needs a number %s=', op, k)) end
  return o[k]
end

-- linear warmup from lr/warmup to lr over `warmup` steps, then constant
function M.schedule.warmup(o)
  local lr, w = need(o, 'lr', 'schedule.warmup'), o.warmup or 0
  return function(step)
    if w > 0 and step <= w then return lr * step / w end
    return lr
  end
end

-- warmup, then a decay from lr to min_lr at max_steps (min_lr after) whose
-- shape f maps the progress in [0, 1] to the fraction of (lr - min_lr) left
local function decaying(name, f)
  return function(o)
    local op = 'schedule.' .. name
    local lr, n = need(o, 'lr', op), need(o, 'max_steps', op)
    local w, lo = o.warmup or 0, o.min_lr or 0
    if w > n then raise(op .. ': warmup must be <= max_steps') end
    return function(step)
      if w > 0 and step <= w then return lr * step / w end
      if step >= n then return lo end
      return lo + (lr - lo) * f((step - w) / (n - w))
    end
  end
end

M.schedule.cosine = decaying('cosine', function(x) return 0.5 * (1 + math.cos(math.pi * x)) end)
M.schedule.linear = decaying('linear', function(x) return 1 - x end)

---------------------------------------------------------------------------
-- mixed precision: the model's f32 parameters become bf16 in place (the same
-- Lua tensor objects, so the model's references stay valid); an optimizer
-- made afterwards keeps f32 master copies and updates them from bf16 grads.

function M.mixed_precision(model, opts)
  local dt = rt.dtype((opts and opts.dtype) or 'bf16', 'mixed_precision')
  if dt ~= 'bf16' and dt ~= 'f16' then raise('mixed_precision: dtype must be bf16 or f16') end
  local seen, f32 = {}, {}
  for _, p in ipairs(params_of(model, 'mixed_precision')) do
    if p.dtype == 'f32' then f32[#f32 + 1] = p end
  end
  -- parameters that are row blocks of one tensor (a fused gate/up weight) stay so
  local blocks = gp.no_grad(function() return tensor.convert_blocks(f32, function(w) return w:detach():to(dt) end) end)
  for _, p in ipairs(f32) do
    if not seen[p] then
      seen[p] = true
      local low = blocks[p] or gp.no_grad(function() return p:detach():to(dt) end)
      rawset(p, 'c', low.c)
      rawset(p, 'grad', nil)
    end
  end
  return model
end

doc(M.AdamW, 'gp.optim.AdamW(params, {lr=3e-4, betas={0.9,0.95}, eps=1e-8, weight_decay=0.1, master_weights=true})',
  'AdamW over multi-tensor lists (one launch per group and grad dtype); weight decay only on params of dim >= 2; f32 master copies of bf16 params')
doc(M.SGD, 'gp.optim.SGD(params, {lr=0.01, momentum=0, nesterov=false, weight_decay=0})', 'SGD with momentum over multi-tensor lists')
doc(M.clip_grad_norm, 'gp.optim.clip_grad_norm(opt_or_params, max_norm)',
  'the global grad norm as a 0-dim device tensor; the clip factor is computed on the device and scales the next opt:step() (no host sync)')
doc(M.mixed_precision, "gp.optim.mixed_precision(model, {dtype='bf16'})", "the model's f32 parameters become bf16 in place (make the optimizer afterwards: it keeps f32 masters)")
doc(M.schedule.cosine, 'gp.optim.schedule.cosine{lr=, max_steps=, warmup=0, min_lr=0}', 'step -> lr: linear warmup, then cosine decay to min_lr')
doc(M.schedule.linear, 'gp.optim.schedule.linear{lr=, max_steps=, warmup=0, min_lr=0}', 'step -> lr: linear warmup, then linear decay to min_lr')
doc(M.schedule.warmup, 'gp.optim.schedule.warmup{lr=, warmup=}', 'step -> lr: linear warmup, then constant')
do
  local O = M.Optimizer
  doc(O.step, 'opt:step()', 'one optimizer step: one multi-tensor launch per bucket (group, decay, grad dtype, param dtype; it also writes bf16/f16 params from their f32 masters); uses the clip factor of clip_grad_norm')
  doc(O.zero_grad, 'opt:zero_grad({set_to_none=false})', "zero the grads in place (views of the optimizer's flat buffers: one fill per dtype, the lists stay valid)")
  doc(O.set_lr, 'opt:set_lr(lr)', "set every group's lr (times its lr_scale)")
  doc(O.capture, 'opt:capture(step_fn)', 'with device_hyper=true: gp.graph(step_fn) with this optimizer\'s step() launching on the device values that prepare_replay writes (the count is not advanced at the capture)')
  doc(O.prepare_replay, 'opt:prepare_replay()', 'with device_hyper=true: advance the step count and write this step\'s lr (and bias corrections) to the device, before replaying a captured step')
  doc(O.get_lr, 'opt:get_lr()', "the first group's lr")
  doc(O.state_dict, 'opt:state_dict()', "tensors {'exp_avg.i', 'exp_avg_sq.i', 'momentum_buffer.i', 'master.i'} and metadata {optimizer, step, groups}: gp.save(path, opt:state_dict())")
  doc(O.load_state_dict, 'opt:load_state_dict(tensors, meta)', 'restore a state_dict: opt:load_state_dict(gp.load(path))')
end

return M
