-- autograd: reverse-mode differentiation over the tensor ops.
--
-- A differentiable op is a tensor method or gp function with a rule here.
-- When grad mode is on and an argument requires grad, the op runs untracked
-- inside and its outputs get a node {rule, args, outs}. backward() orders the
-- nodes reachable from the root (depth first), runs the rules in reverse
-- under no_grad, and accumulates into leaves' .grad. Rules return one
-- gradient per argument in the output's shape and dtype; accumulation sums
-- broadcast dims away and casts to the argument's dtype and device. After
-- backward the graph is dropped (intermediates freed) unless retain_graph.
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local docs = require('gpush.core.doc').docs
local gp = require 'gpush.core.factory' -- the core namespace: zeros_like, where, randn
local Tensor, is_tensor, raise = tensor.Tensor, tensor.is_tensor, rt.raise

local A = {enabled = true, rules = {}}
local run_hooks, each_leaf, count_hooked

local function needs(t) return is_tensor(t) and (rawget(t, '_rg') or rawget(t, '_node')) ~= nil end
A.needs = needs

local function any_needs(n, ...)
  for i = 1, n do
    local a = select(i, ...)
    if needs(a) then return true end
    if type(a) == 'table' and not is_tensor(a) then -- a list of tensors or an options table ({bias = b})
      for _, x in pairs(a) do if needs(x) then return true end end
    end
  end
  return false
end

-- run f(...) with grad mode set to `on`, restoring it even on error
local function restore(prev, ok, ...)
  A.enabled = prev
  if not ok then error((...), 0) end
  return ...
end
local function with_mode(on, f, ...)
  local prev = A.enabled
  A.enabled = on
  return restore(prev, pcall(f, ...))
end

function A.no_grad(f, ...) return with_mode(false, f, ...) end
function A.enable_grad(f, ...) return with_mode(true, f, ...) end

-- wrap tbl[name] so that calls on tensors needing grad are recorded.
-- opts (from def_method/def_function) may give:
--   check(...)        called with the arguments before a recorded call (raise
--                     for argument combinations the rule cannot differentiate)
--   forward(f, ...)   runs the op in place of f(...) (grad mode off) and
--                     returns saved, outputs...; saved reaches the rule as its
--                     4th argument (e.g. a gradient the forward kernel made)
--   nout              only outputs 1..nout get the node (the others, such as
--                     saved statistics, are returned detached)
local wrapped = setmetatable({}, {__mode = 'k'}) -- the wrappers made here
-- the values of a call as {n = count, ...} (pack_saved: the first one as .saved)
local function pack(...) return {n = select('#', ...), ...} end
local function pack_saved(s, ...) return {n = select('#', ...), saved = s, ...} end
local function wrap(tbl, name, rules, opts)
  local f = tbl[name]
  if not f or wrapped[f] then return end
  opts = opts or {}
  local check, fwd, nout = opts.check, opts.forward, opts.nout
  -- the recorded call is a function of its own, so that the untracked call
  -- (every op in no_grad and inference) stays short
  local recorded
  local g = function(...)
    if not A.enabled or not any_needs(select('#', ...), ...) then return f(...) end
    return recorded(...)
  end
  recorded = function(...)
    if check then check(...) end
    local args = {n = select('#', ...), ...}
    local outs, saved
    if fwd then
      outs = pack_saved(with_mode(false, fwd, f, ...))
      saved = outs.saved
      outs.saved = nil
    else
      outs = pack(with_mode(false, f, ...))
    end
    local node = {name = name, rule = rules[name], args = args, outs = outs, saved = saved}
    for i = 1, math.min(outs.n, nout or outs.n) do
      local o = outs[i]
      -- an op that returns its argument itself (t:contiguous() of a contiguous
      -- t, t:to() of its own dtype) adds nothing: the tensor keeps its node
      local same = false
      for k = 1, args.n do if rawequal(args[k], o) then same = true end end
      if is_tensor(o) and o:is_floating_point() and not same then rawset(o, '_node', node) end
    end
    return unpack(outs, 1, outs.n)
  end
  tbl[name] = g
  wrapped[g] = true
  if docs[f] then docs[g] = docs[f] end
end

-- rules for methods (Tensor[name]) and functions (gp[name]); each is
-- rule(g, args, outs, saved) -> grads per argument, g[i] the gradient of
-- outs[i] (nil when no gradient reached it); opts: see wrap above. A rule
-- defined after install wraps Tensor[name] and the installed tables' name at
-- once; defining a rule again replaces it (the wrapper reads the rule when
-- it records).
A.method_rules, A.method_opts = {}, {}
A.function_rules, A.function_opts = {}, {}
A.tables = {} -- the function tables installed (the core namespace, the gp facade)
function A.def_method(name, rule, opts)
  A.method_rules[name] = rule; A.method_opts[name] = opts
  if A.installed then wrap(Tensor, name, A.method_rules, opts) end
end
-- rules that never read the values of backward()'s seed (opts.seed_unread: a
-- fused loss returns the gradient its kernel saved): the seed is not filled
A.seed_unread = {}
function A.def_function(name, rule, opts)
  A.function_rules[name] = rule; A.function_opts[name] = opts
  if opts and opts.seed_unread then A.seed_unread[rule] = true end
  for _, t in ipairs(A.tables) do wrap(t, name, A.function_rules, opts) end
end

-- sum g down to `shape` (undo broadcasting)
local function unbroadcast(g, shape)
  local gs = g.shape
  if #gs == #shape then
    local same = true
    for i = 1, #gs do if gs[i] ~= shape[i] then same = false end end
    if same then return g end
  end
  local lead = #gs - #shape
  local r = g
  -- the leading dims that are all summed away (a bias's gradient over
  -- (B, T, C)): one reduction over their product instead of one per dim
  local k = 0
  while k < #gs and (k < lead or (shape[k + 1 - lead] == 1 and gs[k + 1] ~= 1)) do k = k + 1 end
  if k >= 2 and g:is_contiguous() then
    local ns, n = {1}, 1
    for d = 1, k do n = n * gs[d] end
    ns[1] = n
    for d = k + 1, #gs do ns[#ns + 1] = gs[d] end
    r = g:view(ns):sum(1, {keepdim = true})
    gs = r.shape
    lead = #gs - #shape
    if lead < 0 then r = r:view(shape); gs = r.shape; lead = 0 end
  end
  for d = #gs, 1, -1 do
    local want = d > lead and shape[d - lead] or nil
    if (want == nil or want == 1) and gs[d] ~= 1 then r = r:sum(d, {keepdim = true}) end
  end
  return r:reshape(shape)
end
A.unbroadcast = unbroadcast

-- narrow's rule returns {slice = {dim, start, len}, g = g}: the gradient is g
-- in that slice and 0 elsewhere. The first such gradient of a tensor becomes a
-- zero buffer this backward owns; later slices are added into it in place
-- (q, k, v narrowed out of one qkv: one fill, a copy and two slice adds
-- instead of three fills, three copies and two whole-tensor adds).
local owned = setmetatable({}, {__mode = 'k'})
local function slice_grad(grads, a, s)
  local old = rawget(a, '_node') and grads[a]
  if old and owned[old] then
    old:narrow(s.slice[1], s.slice[2], s.slice[3]):add_(s.g) -- slices may overlap
    return nil
  end
  local z = gp.zeros_like(a)
  z:narrow(s.slice[1], s.slice[2], s.slice[3]):copy_(s.g)
  if rawget(a, '_node') and not old then owned[z] = true end
  return z
end

-- a rule may return {fresh = t}: a gradient nothing else refers to once this
-- backward frees the graph (a fused loss's saved gradient, returned as it is):
-- a leaf without a .grad takes it as its .grad, without the copy (kept when
-- the graph is retained: the next backward would return the same tensor)
local retaining = false

-- two tensors of one shape (their C sizes compared: no shape tables made)
local function same_shape(x, y)
  local cx, cy = x.c, y.c
  if cx.ndim ~= cy.ndim then return false end
  for i = 0, cx.ndim - 1 do if cx.shape[i] ~= cy.shape[i] then return false end end
  return true
end

local function accumulate(grads, a, g)
  if g == nil then return end
  if type(a) == 'table' and not is_tensor(a) then
    for j, x in pairs(a) do if g[j] ~= nil then accumulate(grads, x, g[j]) end end
    return
  end
  if not needs(a) then return end
  if type(g) == 'table' and not is_tensor(g) and g.fresh then
    local t = g.fresh
    if not retaining and not rawget(a, '_node') and rawget(a, 'grad') == nil and t.dtype == a.dtype and
        t.device == a.device and same_shape(t, a) then
      rawset(a, 'grad', t)
      return
    end
    g = t
  end
  if type(g) == 'table' and not is_tensor(g) and g.slice then
    g = slice_grad(grads, a, g)
    if g == nil then return end
  end
  if not is_tensor(g) then raise('backward: a rule returned a ' .. type(g) .. ' gradient') end
  g = unbroadcast(g, a.shape)
  if g.dtype ~= a.dtype or g.device ~= a.device then g = g:to {dtype = a.dtype, device = a.device} end
  if rawget(a, '_node') then
    local old = grads[a]
    grads[a] = old and old + g or g
  else
    local old = rawget(a, 'grad')
    if old then old:add_(g) else rawset(a, 'grad', g:clone()) end
  end
end

-- hooks run after a leaf's gradient is complete in a backward: fn(t), with
-- t.grad final (gp.dist's data-parallel helper launches all-reduces from them)
A.hooked = setmetatable({}, {__mode = 'k'})  -- leaf -> true while it has hooks

function A.register_post_accumulate_hook(t, fn)
  if not is_tensor(t) then raise('register_post_accumulate_hook: needs a tensor') end
  if type(fn) ~= 'function' then raise('register_post_accumulate_hook: needs a function') end
  local hs = rawget(t, '_pahooks')
  if not hs then hs = {}; rawset(t, '_pahooks', hs) end
  hs[#hs + 1] = fn
  A.hooked[t] = true
  return {remove = function()
    for i = #hs, 1, -1 do if hs[i] == fn then table.remove(hs, i) end end
    if #hs == 0 then rawset(t, '_pahooks', nil); A.hooked[t] = nil end
  end}
end

function run_hooks(t)
  for _, fn in ipairs(rawget(t, '_pahooks') or {}) do fn(t) end
end

-- the tensor arguments of a node that are leaves needing grad, once per use
function each_leaf(node, f)
  for k = 1, node.args.n do
    local a = node.args[k]
    if is_tensor(a) then
      if rawget(a, '_rg') and not rawget(a, '_node') then f(a) end
    elseif type(a) == 'table' then
      for _, x in pairs(a) do
        if is_tensor(x) and rawget(x, '_rg') and not rawget(x, '_node') then f(x) end
      end
    end
  end
end

-- how many uses each hooked leaf has among the nodes of this backward
function count_hooked(order)
  local pending, any = {}, false
  for _, node in ipairs(order) do
    each_leaf(node, function(t)
      if rawget(t, '_pahooks') then pending[t] = (pending[t] or 0) + 1; any = true end
    end)
  end
  return any and pending or nil
end

function A.backward(root, grad, opts)
  opts = opts or {}
  if not needs(root) then raise('backward: the tensor does not require grad (call :requires_grad() on an input)') end
  if grad == nil then
    if root:numel() ~= 1 then
      raise(string.format('backward: a gradient is needed for a non-scalar output of shape %s', tensor.shape_str(root.shape)))
    end
    -- the seed: a rule may return a gradient it saved as it is when its
    -- incoming gradient is this one (a fused loss whose kernel already wrote
    -- the final gradient: distill_loss); such a rule's seed is left unfilled
    local rn = rawget(root, '_node')
    grad = rn and A.seed_unread[rn.rule] and tensor.empty(root.shape, root.dtype, root.device, 'backward') or
      gp.ones_like(root)
    rawset(grad, '_seed', true)
  end
  -- nodes reachable from the root, inputs before users
  local order, seen = {}, {}
  local function visit(t)
    local node = rawget(t, '_node')
    if not node or seen[node] then return end
    seen[node] = true
    for i = 1, node.args.n do
      local a = node.args[i]
      if is_tensor(a) then visit(a)
      elseif type(a) == 'table' then for _, x in pairs(a) do if is_tensor(x) then visit(x) end end end
    end
    order[#order + 1] = node
  end
  visit(root)
  local grads = {}
  accumulate(grads, root, grad)
  if not rawget(root, '_node') then
    if rawget(root, '_pahooks') then run_hooks(root) end
    return
  end
  -- post-accumulate hooks: a leaf's hooks run once its last contribution in
  -- this backward is added (the node that uses it earliest in the forward)
  local pending = next(A.hooked) and count_hooked(order) or nil
  retaining = opts.retain_graph and true or false
  A.no_grad(function()
    for i = #order, 1, -1 do
      local node = order[i]
      local gouts, any = {}, false
      for k = 1, node.outs.n do
        local o = node.outs[k]
        if is_tensor(o) then gouts[k] = grads[o]; grads[o] = nil; any = any or gouts[k] ~= nil end
      end
      if any then
        local gins = {node.rule(gouts, node.args, node.outs, node.saved)}
        for k = 1, node.args.n do accumulate(grads, node.args[k], gins[k]) end
      end
      if pending then
        each_leaf(node, function(t)
          local c = pending[t]
          if c then
            if c == 1 then pending[t] = nil; run_hooks(t) else pending[t] = c - 1 end
          end
        end)
      end
    end
  end)
  if not opts.retain_graph then
    for _, node in ipairs(order) do
      for k = 1, node.outs.n do if is_tensor(node.outs[k]) then rawset(node.outs[k], '_node', nil) end end
      node.args, node.outs, node.saved = {n = 0}, {n = 0}, nil
    end
  end
end

---------------------------------------------------------------------------
-- tensor methods

function Tensor:requires_grad(flag)
  if flag == false then rawset(self, '_rg', nil); return self end
  if not self:is_floating_point() then
    raise(string.format('requires_grad: only float tensors can require grad, this one is %s', self.dtype))
  end
  rawset(self, '_rg', true)
  return self
end
Tensor.requires_grad_ = Tensor.requires_grad
function Tensor:needs_grad() return needs(self) end
function Tensor:is_leaf() return rawget(self, '_node') == nil end
function Tensor:backward(grad, opts) return A.backward(self, grad, opts) end
function Tensor:detach()
  return A.no_grad(function() return self:view(self.shape) end)
end
function Tensor:zero_grad() rawset(self, 'grad', nil) end

-- in-place ops would silently corrupt gradients of tensors in a graph
local INPLACE = {'add_', 'sub_', 'mul_', 'div_', 'pow_', 'maximum_', 'minimum_', 'copy_', 'fill_', 'zero_', 'clamp_',
                 'neg_', 'abs_', 'exp_', 'log_', 'sqrt_', 'rsqrt_', 'tanh_', 'sigmoid_', 'relu_', 'silu_', 'gelu_',
                 'gelu_tanh_', 'sin_', 'cos_'}

---------------------------------------------------------------------------
-- rules

local function zeros_like(t) return gp.zeros_like(t) end
local M = A.def_method

M('add', function(g) return g[1], g[1] end)
M('sub', function(g) return g[1], -g[1] end)
M('mul', function(g, a) return g[1] * a[2], g[1] * a[1] end)
M('div', function(g, a, o) return g[1] / a[2], is_tensor(a[2]) and (-g[1] * o[1] / a[2]) or nil end)
M('pow', function(g, a, o)
  local x, y = a[1], a[2]
  local gx, gy
  if is_tensor(x) then gx = g[1] * y * (x ^ (y - 1)) end
  if is_tensor(y) then gy = g[1] * o[1] * (is_tensor(x) and x:log() or math.log(x)) end
  return gx, gy
end)
M('maximum', function(g, a)
  local x, y = a[1], a[2]
  local m = x:ge(y)
  return g[1] * m, is_tensor(y) and g[1] * m:eq(0) or nil
end)
M('minimum', function(g, a)
  local x, y = a[1], a[2]
  local m = x:le(y)
  return g[1] * m, is_tensor(y) and g[1] * m:eq(0) or nil
end)
M('neg', function(g) return -g[1] end)
M('abs', function(g, a) return gp.where(a[1]:ge(0), g[1], -g[1]) end)
M('exp', function(g, a, o) return g[1] * o[1] end)
M('log', function(g, a) return g[1] / a[1] end)
M('sqrt', function(g, a, o) return g[1] * 0.5 / o[1] end)
M('rsqrt', function(g, a, o) return g[1] * -0.5 * o[1] * o[1] * o[1] end)
M('tanh', function(g, a, o) return g[1] * (1 - o[1] * o[1]) end)
M('sigmoid', function(g, a, o) return g[1] * o[1] * (1 - o[1]) end)
M('relu', function(g, a) return g[1] * a[1]:gt(0) end)
M('sin', function(g, a) return g[1] * a[1]:cos() end)
M('cos', function(g, a) return -g[1] * a[1]:sin() end)
local function act(kernel)
  return function(g, a)
    local x = a[1]
    local dx = tensor.empty(x.shape, x.dtype, x.device, kernel)
    tensor.K[kernel](dx, x, g[1]:to(x.dtype))
    return dx
  end
end
M('silu', act('silu_bwd'))
M('gelu', act('gelu_bwd'))
M('gelu_tanh', act('gelu_tanh_bwd'))
M('clamp', function(g, a)
  local x, lo, hi = a[1], a[2] or -math.huge, a[3] or math.huge
  return g[1] * x:ge(lo) * x:le(hi)
end)

-- views and copies
local function back_to_shape(g, a) return g[1]:reshape(a[1].shape) end
for _, name in ipairs {'view', 'reshape', 'flatten', 'unsqueeze', 'squeeze', 'expand', 'expand_as'} do
  M(name, name:find('^expand') and function(g) return g[1] end or back_to_shape)
end
M('transpose', function(g, a) return g[1]:transpose(a[2], a[3]) end)
M('t', function(g) return g[1]:t() end)
M('permute', function(g, a)
  local p = type(a[2]) == 'table' and a[2] or {unpack(a, 2, a.n)}
  local inv, n = {}, #p
  for i, d in ipairs(p) do
    local d1 = d < 0 and n + d + 1 or d
    inv[d1] = i
  end
  return g[1]:permute(inv)
end)
M('narrow', function(g, a) return {slice = {a[2], a[3], a[4]}, g = g[1]} end)
M('select', function(g, a)
  local z = zeros_like(a[1])
  z:narrow(a[2], a[3], 1):copy_(g[1]:unsqueeze(a[2] < 0 and a[2] or a[2]))
  return z
end)
for _, name in ipairs {'contiguous', 'clone', 'to', 'cuda', 'cpu', 'float', 'bf16', 'half', 'double', 'type'} do
  M(name, function(g) return g[1] end)
end

local F = A.def_function
F('cat', function(g, a)
  local list, d = a[1], a[2] or 1
  local gs, off = {}, 1
  for i, t in ipairs(list) do
    local n = t:size(d)
    gs[i] = g[1]:narrow(d, off, n)
    off = off + n
  end
  return gs
end)
F('stack', function(g, a)
  local list, d = a[1], a[2] or 1
  local gs = {}
  for i, t in ipairs(list) do gs[i] = g[1]:narrow(d, i, 1):reshape(t.shape) end
  return gs
end)
F('where', function(g, a)
  local m = a[1]
  if m.dtype ~= 'u8' then m = m:ne(0) end
  return nil, gp.where(m, g[1], 0), gp.where(m, 0, g[1])
end)

---------------------------------------------------------------------------
-- install: wrap every method and function that has a rule

-- install(tbl): wrap the functions of tbl that have rules (now and when rules
-- are defined later); the first install also wraps the methods, guards the
-- in-place methods and points the operators at the wrapped methods
function A.install(tbl)
  A.tables[#A.tables + 1] = tbl
  for name in pairs(A.function_rules) do wrap(tbl, name, A.function_rules, A.function_opts[name]) end
  if A.installed then return end
  A.installed = true
  for name in pairs(A.method_rules) do wrap(Tensor, name, A.method_rules, A.method_opts[name]) end
  for _, name in ipairs(INPLACE) do
    local f = Tensor[name]
    if f then
      Tensor[name] = function(self, ...)
        if A.enabled and needs(self) then
          raise(string.format('%s: in-place op on a tensor that requires grad (use the out-of-place form, or gp.no_grad)', name))
        end
        return f(self, ...)
      end
    end
  end
  -- the operators call the (now wrapped) methods
  local mt = tensor.mt
  mt.__add = function(x, y) return Tensor.add(x, y) end
  mt.__sub = function(x, y) return Tensor.sub(x, y) end
  mt.__mul = function(x, y) return Tensor.mul(x, y) end
  mt.__div = function(x, y) return Tensor.div(x, y) end
  mt.__pow = function(x, y) return Tensor.pow(x, y) end
  mt.__unm = function(x) return Tensor.neg(x) end
end

---------------------------------------------------------------------------
-- gradcheck: analytic gradients of fn at inputs (f64 CPU tensors) against
-- central differences of <fn(inputs), proj> for a random projection proj

function A.gradcheck(fn, inputs, opts)
  opts = opts or {}
  local h, atol, rtol = opts.eps or 1e-6, opts.atol or 1e-5, opts.rtol or 1e-4
  for i, x in ipairs(inputs) do
    if not is_tensor(x) or x.dtype ~= 'f64' or x.device ~= 'cpu' or not x:is_contiguous() then
      raise(string.format('gradcheck: input %d must be a contiguous f64 tensor on the cpu', i))
    end
    x:requires_grad()
    x:zero_grad()
  end
  local out = fn(unpack(inputs))
  if not is_tensor(out) then raise('gradcheck: fn must return a tensor') end
  local proj = gp.randn(out.shape, {dtype = 'f64', device = 'cpu'})
  local function value()
    local o = A.no_grad(fn, unpack(inputs))
    local a, n = tensor.to_doubles(o)
    local b = tensor.to_doubles(proj)
    local s = 0
    for k = 0, n - 1 do s = s + a[k] * b[k] end
    return s
  end
  out:backward(proj)
  local worst = 0
  for i, x in ipairs(inputs) do
    local g = rawget(x, 'grad')
    local ga = g and tensor.to_doubles(g) or nil
    local p = ffi.cast('double *', x.c.data) + x.c.offset
    for k = 0, x:numel() - 1 do
      local v = p[k]
      p[k] = v + h
      local fp = value()
      p[k] = v - h
      local fm = value()
      p[k] = v
      local num = (fp - fm) / (2 * h)
      local ana = ga and ga[k] or 0
      local err = math.abs(ana - num)
      if err > atol + rtol * math.abs(num) then
        raise(string.format('gradcheck: input %d element %d: analytic %.10g, numeric %.10g', i, k + 1, ana, num))
      end
      if err > worst then worst = err end
    end
  end
  return true, worst
end

return A
