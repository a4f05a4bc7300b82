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
local core = require 'gpush.core'
local tensor = require 'gpush.tensor'
local raise, is_tensor, shape_str = core.raise, tensor.is_tensor, tensor.shape_str

local nn = {}
local gp -- bound by nn.bind(gp) from init.lua

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
  local self = setmetatable({_order = {}, _buffers = {}, training = true}, self._imt)
  self:init(...)
  return self
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
    elseif is_plain(v) then
      for i, x in ipairs(v) do
        local n = name .. '.' .. i
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
      for i, x in ipairs(v) do if is_module(x) then r[#r + 1] = {k .. '.' .. i, x} end end
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
  local own = self:state_dict()
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

-- move/cast every parameter and buffer: m:to('cuda'), m:to('f64'), m:to{device=, dtype=}.
-- The tensors are replaced (tied ones stay tied); make optimizers after this.
function Module:to(a, b)
  local memo = {}
  gp.no_grad(function()
    walk(self, '', function(kind, _, v, owner, key)
      if kind ~= 'param' and kind ~= 'buffer' then return end
      local nt = memo[v]
      if not nt then
        nt = v:to(a, b)
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

local function topts(o) o = o or {}; return {dtype = o.dtype or 'f32', device = o.device or gp.device()} end
local function param(shape, o) return nn.Parameter(gp.empty(shape, topts(o))) end

local function need_int(op, name, v)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < 1 then
    raise(string.format('%s: %s must be a positive integer, got %s', op, name, tostring(v)))
  end
end

---------------------------------------------------------------------------
-- layers

-- y = x @ w^T + b; w (out, in) ~ U(-1/sqrt(in), 1/sqrt(in)) like torch
local Linear = Module:extend('Linear')
nn.Linear = Linear
function Linear:init(n_in, n_out, opts)
  need_int('Linear', 'in', n_in)
  need_int('Linear', 'out', n_out)
  opts = opts or {}
  self.in_features, self.out_features = n_in, n_out
  local k = 1 / math.sqrt(n_in)
  self.weight = nn.init.uniform_(param({n_out, n_in}, opts), -k, k)
  if opts.bias ~= false then self.bias = nn.init.uniform_(param({n_out}, opts), -k, k) end
end
function Linear:forward(x) return gp.linear(x, self.weight, self.bias) end
function Linear:extra_repr()
  return string.format('%d -> %d%s', self.in_features, self.out_features, self.bias and '' or ', no bias')
end

-- rows of a (n, d) table picked by 0-based ids; weight ~ N(0, 1)
local Embedding = Module:extend('Embedding')
nn.Embedding = Embedding
function Embedding:init(n, d, opts)
  need_int('Embedding', 'n', n)
  need_int('Embedding', 'd', d)
  self.num_embeddings, self.embedding_dim = n, d
  self.weight = nn.init.normal_(param({n, d}, opts), 0, 1)
end
function Embedding:forward(idx) return gp.embedding(self.weight, idx) end
function Embedding:extra_repr() return string.format('%d, %d', self.num_embeddings, self.embedding_dim) end

local LayerNorm = Module:extend('LayerNorm')
nn.LayerNorm = LayerNorm
function LayerNorm:init(d, opts)
  need_int('LayerNorm', 'd', d)
  opts = opts or {}
  self.d, self.eps = d, opts.eps or 1e-5
  self.weight = nn.init.ones_(param({d}, opts))
  if opts.bias ~= false then self.bias = nn.init.zeros_(param({d}, opts)) end
end
function LayerNorm:forward(x) return (gp.layer_norm(x, self.weight, self.bias, self.eps)) end
function LayerNorm:extra_repr() return string.format('%d, eps=%g', self.d, self.eps) end

local RMSNorm = Module:extend('RMSNorm')
nn.RMSNorm = RMSNorm
function RMSNorm:init(d, opts)
  need_int('RMSNorm', 'd', d)
  opts = opts or {}
  self.d, self.eps = d, opts.eps or 1e-5
  self.weight = nn.init.ones_(param({d}, opts))
end
function RMSNorm:forward(x) return (gp.rms_norm(x, self.weight, self.eps)) end
function RMSNorm:extra_repr() return string.format('%d, eps=%g', self.d, self.eps) end

-- zeroes elements with probability p in training mode (scaling the rest by 1/(1-p)); identity in eval mode
local Dropout = Module:extend('Dropout')
nn.Dropout = Dropout
function Dropout:init(p)
  p = p or 0.5
  if type(p) ~= 'number' or p < 0 or p > 1 then raise('Dropout: p must be a number in [0, 1], got ' .. tostring(p)) end
  self.p = p
end
function Dropout:forward(x)
  if self.training and self.p > 0 then return (gp.dropout(x, self.p)) end
  return x
end
function Dropout:extra_repr() return string.format('p=%g', self.p) end

-- Linear -> GELU (tanh form) -> Linear (-> Dropout)
local MLP = Module:extend('MLP')
nn.MLP = MLP
function MLP:init(d, hidden, opts)
  opts = opts or {}
  hidden = hidden or 4 * d
  self.fc = Linear(d, hidden, opts)
  self.proj = Linear(hidden, d, opts)
  self.drop = Dropout(opts.dropout or 0)
end
-- the Linear class's own forward, so that a swapped one (on the class or the
-- instance) keeps MLP on the module calls
local linear_forward = Linear.forward
local function plain_linear(m)
  return getmetatable(m) == Linear._imt and m.forward == linear_forward and is_tensor(rawget(m, 'weight'))
    and is_tensor(rawget(m, 'bias'))
end
function MLP:forward(x)
  local fc, proj = self.fc, self.proj
  if plain_linear(fc) and plain_linear(proj) then -- one node, GELU in the GEMM epilogues
    return self.drop(gp.linear_gelu_linear(x, fc.weight, fc.bias, proj.weight, proj.bias))
  end
  return self.drop(proj(fc(x):gelu_tanh()))
end

-- proj(silu(gate(x)) * up(x)), no biases (LLaMA style)
local SwiGLUMLP = Module:extend('SwiGLUMLP')
nn.SwiGLUMLP = SwiGLUMLP
function SwiGLUMLP:init(d, hidden, opts)
  opts = opts or {}
  hidden = hidden or 4 * d
  local o = {bias = false, dtype = opts.dtype, device = opts.device}
  self.gate = Linear(d, hidden, o)
  self.up = Linear(d, hidden, o)
  self.proj = Linear(hidden, d, o)
  self.drop = Dropout(opts.dropout or 0)
end
function SwiGLUMLP:forward(x) return self.drop(self.proj(gp.swiglu(self.gate(x), self.up(x)))) end

---------------------------------------------------------------------------
-- attention

-- additive causal masks (0 on and below the diagonal, -inf above), cached per
-- (T, S, device, dtype): query i (of T, the last T of S positions) sees keys j <= i + S - T
local masks = {}
function nn.causal_mask(T, S, device, dtype)
  S = S or T
  local key = T .. ',' .. S .. ',' .. device .. ',' .. dtype
  local m = masks[key]
  if not m then
    m = gp.no_grad(function()
      local j = gp.arange(S, {device = device}):view {1, S}
      local i = gp.arange(T, {device = device}):view {T, 1} + (S - T)
      return gp.where(j:gt(i), -math.huge, 0):to(dtype)
    end)
    masks[key] = m
  end
  return m
end
function nn.clear_mask_cache() masks = {} end

-- softmax(q k^T * scale [+ causal mask]) v over the last two dims; q (..., T, d),
-- k (..., S, d), v (..., S, dv) with the same leading dims. The one function
-- attention layers call: assign nn.attention to swap the core (flash attention).
-- head dims with a flash kernel: 64 and 128 (tensor cores for bf16/f16), and
-- 32 up to S 512 (the plain kernels)
local function flash_dim(D, S) return D == 64 or D == 128 or (D == 32 and S <= 512) end

function nn.attention(q, k, v, opts)
  opts = opts or {}
  if not (is_tensor(q) and is_tensor(k) and is_tensor(v)) then raise('attention: q, k and v must be tensors') end
  local s = q.shape
  local nd = #s
  if nd < 2 or k:dim() ~= nd or v:dim() ~= nd then
    raise(string.format('attention: q %s, k %s and v %s must have the same number (>= 2) of dims', shape_str(s),
      shape_str(k.shape), shape_str(v.shape)))
  end
  local T, D, S, Dv = s[nd - 1], s[nd], k:size(-2), v:size(-1)
  local lead = 1
  for i = 1, nd - 2 do
    lead = lead * s[i]
    if k:size(i) ~= s[i] or v:size(i) ~= s[i] then
      raise(string.format('attention: q %s, k %s and v %s must agree in the leading dims', shape_str(s),
        shape_str(k.shape), shape_str(v.shape)))
    end
  end
  if k:size(-1) ~= D or v:size(-2) ~= S then
    raise(string.format('attention: q %s, k %s, v %s: k must be (..., S, %d) and v (..., S, dv)', shape_str(s),
      shape_str(k.shape), shape_str(v.shape), D))
  end
  local os = {unpack(s)}
  os[nd] = Dv
  -- flash attention (gp.attention) where it applies: no dropout, head dim 64
  -- or 128 (or 32 up to S 512: no tensor-core kernel there, so the launches it
  -- saves only pay at short lengths), one dtype, and S >= T when causal; else
  -- the matmul path below
  if gp.attention and (opts.dropout or 0) == 0 and flash_dim(D, S) and Dv == D and k.dtype == q.dtype and
    v.dtype == q.dtype and (not opts.causal or T <= S) then
    local y = gp.attention(nd == 4 and q or q:reshape {lead, 1, T, D}, nd == 4 and k or k:reshape {lead, 1, S, D},
      nd == 4 and v or v:reshape {lead, 1, S, D}, {causal = opts.causal and true or false, scale = opts.scale})
    return nd == 4 and y or y:view(os)
  end
  local q3, k3, v3 = q:reshape {lead, T, D}, k:reshape {lead, S, D}, v:reshape {lead, S, Dv}
  local att = gp.matmul(q3, k3, {trans_b = true, alpha = opts.scale or 1 / math.sqrt(D)})
  if opts.causal then att = att + nn.causal_mask(T, S, att.device, att.dtype) end
  att = att:softmax(-1)
  if opts.dropout and opts.dropout > 0 then att = (gp.dropout(att, opts.dropout)) end
  return att:matmul(v3):view(os)
end
local default_attention = nn.attention

-- multi-head causal self-attention: x (B, T, C) -> (B, T, C)
local CausalSelfAttention = Module:extend('CausalSelfAttention')
nn.CausalSelfAttention = CausalSelfAttention
function CausalSelfAttention:init(cfg)
  cfg = cfg or {}
  local C, H = cfg.n_embd, cfg.n_head
  need_int('CausalSelfAttention', 'n_embd', C)
  need_int('CausalSelfAttention', 'n_head', H)
  if C % H ~= 0 then raise(string.format('CausalSelfAttention: n_embd %d is not a multiple of n_head %d', C, H)) end
  self.n_embd, self.n_head, self.dropout = C, H, cfg.dropout or 0
  local o = {bias = cfg.bias, dtype = cfg.dtype, device = cfg.device}
  self.qkv = Linear(C, 3 * C, o)
  self.proj = Linear(C, C, o)
  self.resid_drop = Dropout(self.dropout)
end
function CausalSelfAttention:forward(x)
  if x:dim() ~= 3 or x:size(3) ~= self.n_embd then
    raise(string.format('CausalSelfAttention: x must be (B, T, %d), got %s', self.n_embd, shape_str(x.shape)))
  end
  local B, T, C = x:size(1), x:size(2), x:size(3)
  local H = self.n_head
  local hd = C / H
  local qkv = self.qkv(x)
  local dropout = self.training and self.dropout or 0
  local y
  -- flash attention straight from the qkv buffer (no permute copies) where
  -- nn.attention would take flash attention: the head dims of flash_dim, no
  -- attention dropout, and nn.attention not swapped for another core
  if gp.attention and gp.attention_qkv and nn.attention == default_attention and dropout == 0 and flash_dim(hd, T) then
    y = gp.attention_qkv(qkv, H, {causal = true})
  else
    local function head(i) return qkv:narrow(3, (i - 1) * C + 1, C):reshape {B, T, H, hd}:transpose(2, 3) end
    y = nn.attention(head(1), head(2), head(3), {causal = true, dropout = dropout})
    y = y:transpose(2, 3):reshape {B, T, C}
  end
  return self.resid_drop(self.proj(y))
end
-- incremental attention: x (B, Tnew, C) holds positions pos .. pos+Tnew-1; their
-- keys and values are appended to layer `layer` of the KV cache and the queries
-- attend over every cached position (causally within the new ones). Uses
-- gp.attention (prefill) and gp.attention_decode (one token) when gpush has
-- them, else nn.attention (matmuls) over cache:keys(layer), cache:values(layer).
function CausalSelfAttention:forward_cached(x, cache, layer, pos)
  local B, T, C = x:size(1), x:size(2), x:size(3)
  local H = self.n_head
  local hd = C / H
  local qkv = self.qkv(x)
  local function head(i) return qkv:narrow(3, (i - 1) * C + 1, C):reshape {B, T, H, hd}:transpose(2, 3) end
  local q = head(1)
  if type(pos) == 'table' then -- device positions (one token; see GPT:forward_cached): nothing read on the host
    cache:append_at(layer, head(2), head(3), pos.pos)
    local y = cache:attend_at(layer, q:reshape {B, H, hd}, pos.lens, {scale = 1 / math.sqrt(hd)})
    return self.proj(y:reshape {B, H, 1, hd}:transpose(2, 3):reshape {B, T, C})
  end
  cache:append(layer, head(2), head(3))
  local keys, vals = cache:keys(layer), cache:values(layer)
  local S = keys:size(3)
  if S ~= pos + T then
    raise(string.format('forward_cached: layer %d of the cache holds %d positions after appending %d at position %d (expected %d)',
      layer, S, T, pos, pos + T))
  end
  local y
  if T == 1 and gp.attention_decode and (hd == 64 or hd == 128) and keys.dtype == q.dtype then
    local lens = gp.full({B}, S, {dtype = 'i64', device = x.device})
    y = gp.attention_decode(q:reshape {B, H, hd}, keys, vals, lens, {scale = 1 / math.sqrt(hd)}):reshape {B, H, 1, hd}
  else -- nn.attention takes flash attention (gp.attention) where it applies
    y = nn.attention(q, keys, vals, {causal = T > 1})
  end
  y = y:transpose(2, 3):reshape {B, T, C}
  return self.proj(y)
end
function CausalSelfAttention:extra_repr() return string.format('n_embd=%d, n_head=%d', self.n_embd, self.n_head) end

---------------------------------------------------------------------------
-- transformer

local function make_norm(kind, d, cfg)
  local o = {eps = cfg.eps, dtype = cfg.dtype, device = cfg.device, bias = cfg.bias}
  if kind == nil or kind == 'layer' then return LayerNorm(d, o) end
  if kind == 'rms' then return RMSNorm(d, o) end
  raise("norm must be 'layer' or 'rms', got " .. tostring(kind))
end

-- pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x))
local TransformerBlock = Module:extend('TransformerBlock')
nn.TransformerBlock = TransformerBlock
function TransformerBlock:init(cfg)
  cfg = cfg or {}
  local C = cfg.n_embd
  need_int('TransformerBlock', 'n_embd', C)
  self.ln1 = make_norm(cfg.norm, C, cfg)
  self.attn = CausalSelfAttention(cfg)
  self.ln2 = make_norm(cfg.norm, C, cfg)
  local hidden = cfg.mlp_hidden or 4 * C
  local o = {dropout = cfg.dropout, dtype = cfg.dtype, device = cfg.device, bias = cfg.bias}
  if cfg.mlp == nil or cfg.mlp == 'gelu' then self.mlp = MLP(C, hidden, o)
  elseif cfg.mlp == 'swiglu' then self.mlp = SwiGLUMLP(C, hidden, o)
  elseif cfg.mlp == 'moe' and nn.MoE then -- lua/gpush/moe.lua; cfg.moe = {experts=8, k=2, ...}
    local mo = {}
    for k, v in pairs(cfg.moe or {}) do mo[k] = v end
    mo.dtype, mo.device, mo.dropout = cfg.dtype, cfg.device, mo.dropout or cfg.dropout
    self.mlp = nn.MoE(C, hidden, mo)
  else raise("TransformerBlock: mlp must be 'gelu', 'swiglu' or 'moe', got " .. tostring(cfg.mlp)) end
end
function TransformerBlock:forward(x)
  x = x + self.attn(self.ln1(x))
  return x + self.mlp(self.ln2(x))
end

function TransformerBlock:forward_cached(x, cache, layer, pos)
  x = x + self.attn:forward_cached(self.ln1(x), cache, layer, pos)
  return x + self.mlp(self.ln2(x))
end

-- GPT: token and position embeddings, n_layer blocks, a final norm and the
-- language-model head (tied to the token embedding by default)
local GPT = Module:extend('GPT')
nn.GPT = GPT
function GPT:init(cfg)
  cfg = cfg or {}
  for _, k in ipairs {'vocab_size', 'block_size', 'n_embd', 'n_layer', 'n_head'} do need_int('GPT', k, cfg[k]) end
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  c.dropout = c.dropout or 0
  c.mlp = c.mlp or 'gelu'
  c.norm = c.norm or 'layer'
  if c.tie_weights == nil then c.tie_weights = true end
  self.config = c
  local o = {dtype = c.dtype, device = c.device}
  self.wte = Embedding(c.vocab_size, c.n_embd, o)
  self.wpe = Embedding(c.block_size, c.n_embd, o)
  self.drop = Dropout(c.dropout)
  local blocks = {}
  for i = 1, c.n_layer do blocks[i] = TransformerBlock(c) end
  self.h = blocks
  self.ln_f = make_norm(c.norm, c.n_embd, c)
  self.lm_head = Linear(c.n_embd, c.vocab_size, {bias = false, dtype = c.dtype, device = c.device})
  if c.tie_weights then self.lm_head.weight = self.wte.weight end
  self:init_weights()
end

-- GPT-2 init: weights ~ N(0, 0.02), residual projections ~ N(0, 0.02 / sqrt(2 n_layer)), biases 0
function GPT:init_weights(std)
  std = std or 0.02
  for _, m in ipairs(self:modules()) do
    if getmetatable(m) == Linear._imt or getmetatable(m) == Embedding._imt then
      nn.init.normal_(m.weight, 0, std)
      if m.bias then nn.init.zeros_(m.bias) end
    end
  end
  local rstd = std / math.sqrt(2 * self.config.n_layer)
  for _, b in ipairs(self.h) do
    nn.init.normal_(b.attn.proj.weight, 0, rstd)
    if b.mlp.init_weights then b.mlp:init_weights(std, rstd) else nn.init.normal_(b.mlp.proj.weight, 0, rstd) end
  end
  return self
end

-- positions 0..T-1 (i64), cached per (T, device)
function GPT:positions(T, device)
  local cache = rawget(self, '_pos')
  if not cache then cache = {}; rawset(self, '_pos', cache) end
  local key = T .. device
  local p = cache[key]
  if not p then p = gp.arange(T, {device = device}); cache[key] = p end
  return p
end

-- idx (B, T) of 0-based token ids -> logits (B, T, vocab); with targets (B, T) also the mean cross-entropy
function GPT:forward(idx, targets)
  if not is_tensor(idx) or idx:dim() ~= 2 or (idx.dtype ~= 'i64' and idx.dtype ~= 'i32') then
    raise('GPT: idx must be a (B, T) tensor of i64 (or i32) token ids, got ' ..
      (is_tensor(idx) and (idx.dtype .. ' ' .. shape_str(idx.shape)) or type(idx)))
  end
  local T = idx:size(2)
  if T > self.config.block_size then
    raise(string.format('GPT: the sequence has %d tokens but block_size is %d', T, self.config.block_size))
  end
  local x = self.wte(idx) + self.wpe(self:positions(T, idx.device))
  x = self.drop(x)
  for _, b in ipairs(self.h) do x = b(x) end
  local logits = self.lm_head(self.ln_f(x))
  if targets ~= nil then return logits, gp.cross_entropy(logits, targets) end
  return logits
end
-- incremental forward for generation (eval mode, no dropout): idx_new (B, Tnew)
-- are the tokens at positions pos .. pos+Tnew-1 (pos defaults to cache:len());
-- layer i appends its keys and values to layer i of cache (a gp.KVCache or
-- anything with append/keys/values) and attends over all cached positions.
-- Returns logits (B, Tnew, vocab).
function GPT:forward_cached(idx, cache, pos)
  if not is_tensor(idx) or idx:dim() ~= 2 or (idx.dtype ~= 'i64' and idx.dtype ~= 'i32') then
    raise('GPT:forward_cached: idx must be a (B, T) tensor of i64 (or i32) token ids, got ' ..
      (is_tensor(idx) and (idx.dtype .. ' ' .. shape_str(idx.shape)) or type(idx)))
  end
  if type(cache) ~= 'table' or not cache.append then raise('GPT:forward_cached: needs a KV cache (gp.KVCache{...})') end
  if is_tensor(pos) then return self:_forward_at(idx, cache, pos) end
  pos = pos or cache:len()
  local T, bs = idx:size(2), self.config.block_size
  if pos + T > bs then
    raise(string.format('GPT:forward_cached: positions %d..%d are beyond block_size %d', pos, pos + T - 1, bs))
  end
  local x = self.wte(idx) + self.wpe(self:positions(bs, idx.device):narrow(1, pos + 1, T))
  for i, b in ipairs(self.h) do x = b:forward_cached(x, cache, i, pos) end
  return self.lm_head(self.ln_f(x))
end
-- device positions: one new token per row at the position held by pos (an
-- i64 [1] tensor on the model's device), so the step reads nothing on the
-- host and can be captured as a CUDA graph and replayed per token (gp.generate).
-- The cache must be a gp.KVCache (append_at, attend_at) and the head dim 64
-- or 128 (decode attention over the whole capacity, lens[b] = pos + 1). The
-- cache's host count (cache:len()) is not advanced.
function GPT:supports_device_positions(cache)
  local c = self.config
  local hd = c.n_embd / c.n_head
  return (hd == 64 or hd == 128) and type(cache) == 'table' and cache.append_at ~= nil and gp.attention_decode ~= nil
end
function GPT:_forward_at(idx, cache, pos)
  local B, T = idx:size(1), idx:size(2)
  if T ~= 1 or pos:numel() ~= 1 or pos.dtype ~= 'i64' or pos.device ~= idx.device then
    raise(string.format('GPT:forward_cached: with a device position, idx must be (B, 1) and pos an i64 [1] tensor on %s; ' ..
      'got idx %s, pos %s %s on %s', idx.device, shape_str(idx.shape), pos.dtype, shape_str(pos.shape), pos.device))
  end
  if not self:supports_device_positions(cache) then
    raise('GPT:forward_cached: device positions need a gp.KVCache and a head dim of 64 or 128')
  end
  local lens = rawget(cache, '_step_lens')
  if not lens or lens:size(1) ~= B or lens.device ~= idx.device then
    lens = gp.empty({B}, {dtype = 'i64', device = idx.device})
    rawset(cache, '_step_lens', lens)
  end
  gp.k.add_s(lens, pos:view {1}, 1) -- every row attends over positions 0..pos
  local at = {pos = pos, lens = lens}
  local x = self.wte(idx) + self.wpe(pos:view {1, 1})
  for i, b in ipairs(self.h) do x = b:forward_cached(x, cache, i, at) end
  return self.lm_head(self.ln_f(x))
end

function GPT:extra_repr()
  local c = self.config
  return string.format('vocab_size=%d, block_size=%d, n_embd=%d, n_layer=%d, n_head=%d, mlp=%s, norm=%s',
    c.vocab_size, c.block_size, c.n_embd, c.n_layer, c.n_head, c.mlp, c.norm)
end

---------------------------------------------------------------------------

function nn.bind(g)
  gp = g
  local doc = gp.doc
  doc(nn.Parameter, 'nn.Parameter(t)', 'mark t as a module parameter (a leaf that requires grad); assign it to a module field')
  doc(nn.attention, 'nn.attention(q, k, v, {causal=false, scale=1/sqrt(d), dropout=0})',
    'softmax(q k^T * scale + mask) v over the last two dims; q (..., T, d), k (..., S, d), v (..., S, dv); the attention core (assign nn.attention to swap it); flash attention (gp.attention) when dropout is 0, d = dv = 64 or 128 and S >= T if causal')
  doc(nn.causal_mask, 'nn.causal_mask(T, S, device, dtype)', 'the cached additive causal mask (T, S): 0 where key j <= i + S - T, else -inf')
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
  doc(nn.bind, 'nn.bind(gp)', 'connect gp.nn to gpush (init.lua does it)')
  doc(nn.clear_mask_cache, 'nn.clear_mask_cache()', 'forget the cached causal masks')
  doc(nn.is_module, 'nn.is_module(x)', 'true when x is a module instance')
  doc(nn.walk, "nn.walk(m, '', function(kind, name, value, owner, key) end)",
    "visit every submodule ('module'), parameter ('param') and buffer ('buffer') below m, depth first, in field order")
  doc(nn.init.normal_, 'nn.init.normal_(t, mean=0, std=1)', 'fill t from N(mean, std^2) (seeded generator); returns t')
  doc(nn.init.uniform_, 'nn.init.uniform_(t, lo=0, hi=1)', 'fill t from U[lo, hi) (seeded generator); returns t')
  doc(nn.init.zeros_, 'nn.init.zeros_(t)', 'fill t with 0; returns t')
  doc(nn.init.ones_, 'nn.init.ones_(t)', 'fill t with 1; returns t')
  doc(nn.Linear, 'nn.Linear(in, out, {bias=true, device=, dtype=})', 'y = x @ w^T + b, w (out, in) ~ U(-1/sqrt(in), 1/sqrt(in))')
  doc(nn.Embedding, 'nn.Embedding(n, d, {device=, dtype=})', 'rows of weight (n, d) picked by 0-based ids; weight ~ N(0, 1)')
  doc(nn.LayerNorm, 'nn.LayerNorm(d, {eps=1e-5, bias=true})', 'gp.layer_norm over the last dim with weight 1 and bias 0 at init')
  doc(nn.RMSNorm, 'nn.RMSNorm(d, {eps=1e-5})', 'gp.rms_norm over the last dim with weight 1 at init')
  doc(nn.Dropout, 'nn.Dropout(p=0.5)', 'gp.dropout in training mode, the identity in eval mode')
  doc(nn.MLP, 'nn.MLP(d, hidden=4d, {dropout=0})', 'Linear(d, hidden), GELU (tanh form), Linear(hidden, d)')
  doc(nn.SwiGLUMLP, 'nn.SwiGLUMLP(d, hidden=4d)', 'proj(silu(gate(x)) * up(x)) without biases')
  doc(nn.CausalSelfAttention, 'nn.CausalSelfAttention{n_embd=, n_head=, dropout=0, bias=true}',
    'multi-head causal self-attention on (B, T, n_embd) through nn.attention (through gp.attention_qkv, ' ..
    'straight from the qkv buffer, where nn.attention would take flash attention and is not swapped)')
  doc(nn.TransformerBlock, "nn.TransformerBlock{n_embd=, n_head=, mlp='gelu'|'swiglu'|'moe', moe={experts=8, k=2, ...}, norm='layer'|'rms', dropout=0, mlp_hidden=4 n_embd}",
    'pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))')
  doc(GPT.forward_cached, 'gpt:forward_cached(idx_new, cache, pos=cache:len())',
    'logits (B, Tnew, V) of tokens idx_new (B, Tnew) at positions pos..; appends every layer\'s keys and values to the KV cache')
  doc(nn.GPT, "nn.GPT{vocab_size=, block_size=, n_embd=, n_layer=, n_head=, dropout=0, mlp='gelu', norm='layer', tie_weights=true}",
    'a GPT with GPT-2 init: model(idx) -> logits (B, T, V); model(idx, targets) -> logits, mean cross-entropy')
  return nn
end

return nn
