-- gp.nn: the Module protocol and the layers of a GPT.
--
-- A module is an object whose fields hold its parameters (nn.Parameter
-- tensors), buffers (self:buffer(name, t)), submodules, and lists of those
-- ({m1, m2, ...}). They are found by walking the fields: in the order they
-- were first assigned, then any others by sorted name, so parameters() and
-- named_parameters() have a stable order. A tensor shared by two modules
-- (tied weights) is listed once, under its first name.
--
--   local Net = nn.Module:extend('Net')
--   function Net:init(d) self.fc = nn.Linear(d, d) end
--   function Net:forward(x) return self.fc(x):relu() end
--   local net = Net(8); local y = net(x)
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local doc = gp.doc
local raise, is_tensor, shape_str = rt.raise, tensor.is_tensor, tensor.shape_str

local nn = {}

---------------------------------------------------------------------------
-- classes

local function is_module(x) return type(x) == 'table' and rawget(x, '_order') ~= nil and getmetatable(x) ~= nil end
nn.is_module = is_module
local function is_param(x) return is_tensor(x) and rawget(x, '_param') == true end
local function is_plain(x) return type(x) == 'table' and getmetatable(x) == nil end

-- new fields holding tensors, modules or lists are remembered in order
local function newindex(self, k, v)
  if type(k) == 'string' and type(v) == 'table' then
    local order = rawget(self, '_order')
    order[#order + 1] = k
  end
  rawset(self, k, v)
end

local function make_class(name, parent)
  local cls = setmetatable({_name = name, _parent = parent}, {
    __index = parent,
    __call = function(c, ...) return c:new(...) end,
    __tostring = function(c) return 'nn.' .. rawget(c, '_name') .. ' (class)' end,
  })
  cls._imt = {
    __index = cls,
    __newindex = newindex,
    __call = function(self, ...) return self:forward(...) end,
    __tostring = function(self) return self:repr() end,
    __name = 'nn.' .. name,
  }
  return cls
end

local Module = make_class('Module', nil)
nn.Module = Module

-- a subclass: local C = nn.Module:extend('C'); function C:init(...) end; function C:forward(...) end
function Module:extend(name)
  if type(name) ~= 'string' then raise('Module:extend: give the class a name, e.g. nn.Module:extend(\'MyBlock\')') end
  return make_class(name, self)
end

function Module:new(...)
  local m = setmetatable({_order = {}, _buffers = {}, training = true}, self._imt)
  m:init(...)
  return m
end
function Module:init() end
function Module:forward()
  raise(string.format('%s: forward is not defined (define function %s:forward(...))', self._name, self._name))
end
function Module:class_name() return self._name end

---------------------------------------------------------------------------
-- parameters, buffers, walking

-- mark t as a parameter: a leaf that requires grad (detached when it is a result)
function nn.Parameter(t, requires_grad)
  if not is_tensor(t) then raise('nn.Parameter: needs a tensor, got ' .. type(t)) end
  if not t:is_leaf() then t = t:detach() end
  rawset(t, '_param', true)
  if requires_grad ~= false then t:requires_grad() end
  return t
end

-- register a buffer: a tensor saved in state_dict and moved by :to(), without gradients
function Module:buffer(name, t)
  if type(name) ~= 'string' then raise('buffer: the name must be a string') end
  if t ~= nil and not is_tensor(t) then raise('buffer: ' .. name .. ' must be a tensor') end
  rawget(self, '_buffers')[name] = true
  self[name] = t
  return t
end

-- fields of m that may hold modules or tensors: {key, value} in a stable order
local function fields(m)
  local seen, out = {}, {}
  for _, k in ipairs(rawget(m, '_order')) do
    if not seen[k] then
      seen[k] = true
      local v = rawget(m, k)
      if type(v) == 'table' then out[#out + 1] = {k, v} end
    end
  end
  local extra = {}
  for k, v in pairs(m) do
    if type(k) == 'string' and not seen[k] and type(v) == 'table' and k:sub(1, 1) ~= '_' then extra[#extra + 1] = k end
  end
  table.sort(extra)
  for _, k in ipairs(extra) do out[#out + 1] = {k, rawget(m, k)} end
  return out
end

-- visit(kind, name, value, owner, key) for every module ('module', self not
-- included), parameter ('param') and buffer ('buffer') below m, depth first
local function walk(m, prefix, visit)
  local buffers = rawget(m, '_buffers')
  for _, kv in ipairs(fields(m)) do
    local k, v = kv[1], kv[2]
    local name = prefix .. k
    if is_module(v) then
      visit('module', name, v, m, k)
      walk(v, name .. '.', visit)
    elseif is_param(v) then
      visit('param', name, v, m, k)
    elseif is_tensor(v) then
      if buffers[k] then visit('buffer', name, v, m, k) end
    elseif gp.is_quantized(v) then
      -- a quantized weight (gp.quantize): its codes and block absmax are
      -- buffers, name.nf4 (u8) and name.absmax (f32)
      visit('buffer', name .. '.' .. v.kind, rawget(v, 'data'), v, 'data')
      visit('buffer', name .. '.absmax', rawget(v, 'absmax'), v, 'absmax')
    elseif is_plain(v) then
      -- list elements are named 1, 2, ... (0, 1, ... when the module sets
      -- _index_base = 0, as checkpoints in Hugging Face's layout name them)
      local base = (rawget(m, '_index_base') or 1) - 1
      for i, x in ipairs(v) do
        local n = name .. '.' .. (i + base)
        if is_module(x) then
          visit('module', n, x, v, i)
          walk(x, n .. '.', visit)
        elseif is_param(x) then
          visit('param', n, x, v, i)
        end
      end
    end
  end
end
nn.walk = walk

-- {name, tensor} of every parameter or buffer (each tensor once), and the tensors alone
local function named(m, want)
  local r, seen = {}, {}
  walk(m, '', function(kind, name, v)
    if kind == want and not seen[v] then seen[v] = true; r[#r + 1] = {name, v} end
  end)
  return r
end
local function values(list)
  local r = {}
  for i, nt in ipairs(list) do r[i] = nt[2] end
  return r
end
function Module:named_parameters() return named(self, 'param') end
function Module:parameters() return values(named(self, 'param')) end
function Module:named_buffers() return named(self, 'buffer') end
function Module:buffers() return values(named(self, 'buffer')) end

-- direct submodules: {name, module} ('k', or 'k.i' for the elements of a list field) and the modules alone
function Module:named_children()
  local r = {}
  for _, kv in ipairs(fields(self)) do
    local k, v = kv[1], kv[2]
    if is_module(v) then
      r[#r + 1] = {k, v}
    elseif is_plain(v) then
      local base = (rawget(self, '_index_base') or 1) - 1
      for i, x in ipairs(v) do if is_module(x) then r[#r + 1] = {k .. '.' .. (i + base), x} end end
    end
  end
  return r
end
function Module:children() return values(self:named_children()) end
-- every module below and including self (each once), depth first
function Module:modules()
  local r, seen = {self}, {[self] = true}
  walk(self, '', function(kind, _, v)
    if kind == 'module' and not seen[v] then seen[v] = true; r[#r + 1] = v end
  end)
  return r
end
function Module:apply(fn)
  for _, m in ipairs(self:modules()) do fn(m) end
  return self
end

function Module:train(flag)
  if flag == nil then flag = true end
  for _, m in ipairs(self:modules()) do rawset(m, 'training', flag and true or false) end
  return self
end
function Module:eval() return self:train(false) end

function Module:zero_grad()
  for _, p in ipairs(self:parameters()) do rawset(p, 'grad', nil) end
  return self
end

function Module:num_parameters()
  local n = 0
  for _, p in ipairs(self:parameters()) do n = n + p:numel() end
  return n
end

-- freeze (false) or unfreeze every parameter
function Module:requires_grad_(flag)
  for _, p in ipairs(self:parameters()) do p:requires_grad(flag ~= false) end
  return self
end

---------------------------------------------------------------------------
-- state

function Module:state_dict()
  local sd, seen = {}, {}
  walk(self, '', function(kind, name, v)
    if (kind == 'param' or kind == 'buffer') and not seen[v] then seen[v] = true; sd[name] = v end
  end)
  return sd
end

local function names_of(list, n)
  table.sort(list)
  if #list > (n or 8) then
    local r = {unpack(list, 1, n or 8)}
    return table.concat(r, ', ') .. string.format(' (and %d more)', #list - (n or 8))
  end
  return table.concat(list, ', ')
end

-- copy the tensors of sd into the module (moved to its device, cast to its
-- dtypes); strict (the default): every key must match both ways. Shapes must
-- always match. Nothing is copied when an error is raised. Returns
-- {missing = {...}, unexpected = {...}} (non-empty only when not strict).
function Module:load_state_dict(sd, opts)
  opts = opts or {}
  if type(sd) ~= 'table' then raise('load_state_dict: needs a table {name = tensor}, got ' .. type(sd)) end
  local strict = opts.strict ~= false
  local own = Module.state_dict(self) -- the module's own names (a subclass that renames in state_dict translates sd first)
  local missing, unexpected, bad = {}, {}, {}
  for name, t in pairs(own) do
    local v = sd[name]
    if v == nil then
      missing[#missing + 1] = name
    elseif not is_tensor(v) then
      bad[#bad + 1] = string.format('%s is a %s, not a tensor', name, type(v))
    elseif shape_str(v.shape) ~= shape_str(t.shape) then
      bad[#bad + 1] = string.format('%s is %s in the state dict but %s in the model', name, shape_str(v.shape),
        shape_str(t.shape))
    end
  end
  for name in pairs(sd) do
    if own[name] == nil then unexpected[#unexpected + 1] = tostring(name) end
  end
  local errs = {}
  if #bad > 0 then table.sort(bad); errs[#errs + 1] = 'shape mismatch: ' .. table.concat(bad, '; ') end
  if strict and #missing > 0 then errs[#errs + 1] = 'missing keys: ' .. names_of(missing) end
  if strict and #unexpected > 0 then errs[#errs + 1] = 'unexpected keys: ' .. names_of(unexpected) end
  if #errs > 0 then
    raise(string.format('load_state_dict (%s): %s', self._name, table.concat(errs, '; ')))
  end
  gp.no_grad(function()
    for name, t in pairs(own) do
      local v = sd[name]
      if v ~= nil and v ~= t then t:copy_(v) end
    end
  end)
  table.sort(missing)
  table.sort(unexpected)
  return {missing = missing, unexpected = unexpected}
end

-- the device named by Module:to's arguments, if any
local function target_device(a, b)
  local dev
  for i = 1, 2 do
    local x = i == 1 and a or b
    if is_tensor(x) then dev = x.device
    elseif type(x) == 'table' then dev = x.device or dev
    elseif x == 'cpu' or x == 'cuda' then dev = x end
  end
  return dev
end

-- move/cast every parameter and buffer: m:to('cuda'), m:to('f64'), m:to{device=, dtype=}.
-- The tensors are replaced (tied ones stay tied); make optimizers after this.
-- Buffers marked to keep their dtype (a quantized weight's codes and absmax)
-- are only moved.
function Module:to(a, b)
  local memo = {}
  gp.no_grad(function()
    -- parameters that are row blocks of one tensor (a fused gate/up weight) stay so
    local ps = {}
    walk(self, '', function(kind, _, v)
      if kind == 'param' and not rawget(v, '_keep_dtype') then ps[#ps + 1] = v end
    end)
    local blocks = tensor.convert_blocks(ps, function(w) return w:to(a, b) end)
    walk(self, '', function(kind, _, v, owner, key)
      if kind ~= 'param' and kind ~= 'buffer' then return end
      local nt = memo[v]
      if not nt and rawget(v, '_keep_dtype') then
        local dev = target_device(a, b)
        nt = dev and v:to(dev) or v
        rawset(nt, '_keep_dtype', true)
        memo[v] = nt
      end
      if not nt then
        nt = blocks[v] or v:to(a, b)
        if nt ~= v and kind == 'param' then
          if not v:is_floating_point() or not nt:is_floating_point() then
            raise('Module:to: parameters must stay floating point')
          end
          rawset(nt, '_param', true)
          if rawget(v, '_rg') then nt:requires_grad() end
        end
        memo[v] = nt
      end
      rawset(owner, key, nt)
    end)
  end)
  return self
end
function Module:cuda() return self:to('cuda') end
function Module:cpu() return self:to('cpu') end
function Module:float() return self:to('f32') end
function Module:double() return self:to('f64') end
function Module:bf16() return self:to('bf16') end

-- text: the module tree with parameter shapes
function Module:extra_repr() return '' end
function Module:repr(indent)
  indent = indent or ''
  local lines = {self._name .. '(' .. self:extra_repr() .. ')'}
  local kids = self:named_children()
  if #kids == 0 then return lines[1] end
  lines[1] = self._name .. '(' .. self:extra_repr() .. ') {'
  for _, nm in ipairs(kids) do
    lines[#lines + 1] = indent .. '  ' .. nm[1] .. ': ' .. nm[2]:repr(indent .. '  ')
  end
  lines[#lines + 1] = indent .. '}'
  return table.concat(lines, '\n')
end

---------------------------------------------------------------------------
-- initialization (in place, from the seeded generator gp.manual_seed)

nn.init = {}
function nn.init.normal_(t, mean, std) gp.k.rand_normal(t, mean or 0, std or 1); return t end
function nn.init.uniform_(t, lo, hi) gp.k.rand_uniform(t, lo or 0, hi or 1); return t end
function nn.init.zeros_(t) gp.k.fill(t, 0); return t end
function nn.init.ones_(t) gp.k.fill(t, 1); return t end

-- a new parameter of a shape, {dtype = 'f32', device = gp.device()} unless opts say
function nn.new_param(shape, opts)
  opts = opts or {}
  return nn.Parameter(gp.empty(shape, {dtype = opts.dtype or 'f32', device = opts.device or gp.device()}))
end

-- raise unless v is a positive integer
function nn.need_int(op, name, v)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < 1 then
    raise(string.format('%s: %s must be a positive integer, got %s', op, name, tostring(v)))
  end
end

doc(nn.Parameter, 'nn.Parameter(t)', 'mark t as a module parameter (a leaf that requires grad); assign it to a module field')
doc(Module.extend, "nn.Module:extend('Name')", 'a new module class: define Name:init(...) and Name:forward(...); instances are called as m(x)')
doc(Module.parameters, 'm:parameters()', 'every parameter tensor once, in a stable order (fields in assignment order)')
doc(Module.named_parameters, 'm:named_parameters()', 'a list of {dotted.name, tensor}')
doc(Module.state_dict, 'm:state_dict()', '{dotted.name = tensor} of parameters and buffers (gp.save writes it)')
doc(Module.load_state_dict, 'm:load_state_dict(sd, {strict=true})',
  'copy tensors in by name (moved and cast); errors name missing and unexpected keys and shape mismatches')
doc(Module.to, "m:to('cuda' | 'f64' | {device=, dtype=})", 'move or cast every parameter and buffer (replaces the tensors; tied ones stay tied)')
doc(Module.train, 'm:train(flag=true)', 'set training mode on m and every submodule (Dropout is active)')
doc(Module.eval, 'm:eval()', 'set evaluation mode (Dropout is the identity)')
doc(Module.zero_grad, 'm:zero_grad()', 'drop the .grad of every parameter')
doc(Module.num_parameters, 'm:num_parameters()', 'the number of parameter elements (tied tensors counted once)')
doc(nn.is_module, 'nn.is_module(x)', 'true when x is a module instance')
doc(nn.walk, "nn.walk(m, '', function(kind, name, value, owner, key) end)",
  "visit every submodule ('module'), parameter ('param') and buffer ('buffer') below m, depth first, in field order")
doc(nn.init.normal_, 'nn.init.normal_(t, mean=0, std=1)', 'fill t from N(mean, std^2) (seeded generator); returns t')
doc(nn.init.uniform_, 'nn.init.uniform_(t, lo=0, hi=1)', 'fill t from U[lo, hi) (seeded generator); returns t')
doc(nn.init.zeros_, 'nn.init.zeros_(t)', 'fill t with 0; returns t')
doc(nn.init.ones_, 'nn.init.ones_(t)', 'fill t with 1; returns t')
doc(nn.new_param, 'nn.new_param(shape, {dtype=\'f32\', device=gp.device()})', 'an uninitialized parameter (for a module\'s init)')
doc(nn.need_int, 'nn.need_int(op, name, v)', 'raise "op: name must be a positive integer" unless v is one')

return nn
