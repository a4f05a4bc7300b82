-- nn.MoE: a Mixture-of-Experts feed-forward layer (gp.moe_ffn) usable in
-- place of a transformer block's MLP (nn.GPT{mlp = 'moe', moe = {experts = 8, k = 2}}).
--
--   local moe = nn.MoE(C, H, {experts = 8, k = 2, act = 'swiglu'})   -- act: 'gelu' (default) or 'swiglu'
--   local y = moe(x)                 -- x (..., C); in training mode moe.aux_loss is set
--   loss = ce + model:aux_loss()     -- a GPT sums its MoE layers' auxiliary losses
--
-- Parameters: router.weight (E, C), w1 and w3 (E, C, H) (w3 only for SwiGLU),
-- w2 (E, H, C). In training mode each forward leaves the auxiliary loss
-- aux_alpha * load_balance + z_alpha * z_loss in m.aux_loss (differentiable)
-- and every forward leaves the expert counts in m.counts (device, i32);
-- m:track_load(true) sums the counts over forwards into m.load.
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
local raise = rt.raise

local MoE = nn.Module:extend('MoE')
nn.MoE = MoE

local function pint(name, v)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < 1 then
    raise(string.format('MoE: %s must be a positive integer, got %s', name, tostring(v)))
  end
end

-- nn.MoE(d, hidden, opts) or nn.MoE{d_model=, d_hidden=, n_experts=, top_k=, ...opts}
function MoE:init(d, hidden, opts)
  if type(d) == 'table' then
    opts = {}
    for k, v in pairs(d) do opts[k] = v end
    d, hidden = opts.d_model, opts.d_hidden
    opts.experts, opts.k = opts.experts or opts.n_experts, opts.k or opts.top_k
  end
  opts = opts or {}
  pint('d', d)
  hidden = hidden or 4 * d
  pint('hidden', hidden)
  local E, k = opts.experts or 8, opts.k or 2
  pint('experts', E)
  pint('k', k)
  if E > 256 or k > 8 or k > E then
    raise(string.format('MoE: experts = %d and k = %d: at most 256 experts and k <= min(8, experts)', E, k))
  end
  local act = opts.act or 'gelu'
  if act ~= 'swiglu' and act ~= 'gelu' then raise("MoE: act must be 'swiglu' or 'gelu', got " .. tostring(act)) end
  self.d, self.hidden, self.experts, self.k, self.act = d, hidden, E, k, act
  self.capacity_factor, self.renorm = opts.capacity_factor, opts.renorm
  self.aux_alpha, self.z_alpha = opts.aux_alpha or 0.01, opts.z_alpha or 1e-3
  local o = {dtype = opts.dtype or 'f32', device = opts.device or gp.device()}
  self.router = nn.Linear(d, E, {bias = false, dtype = o.dtype, device = o.device})
  local function expert(shape, fan_in)
    local b = 1 / math.sqrt(fan_in)
    return nn.init.uniform_(nn.Parameter(gp.empty(shape, o)), -b, b)
  end
  self.w1 = expert({E, d, hidden}, d)
  if act == 'swiglu' then self.w3 = expert({E, d, hidden}, d) end
  self.w2 = expert({E, hidden, d}, hidden)
  self.drop = nn.Dropout(opts.dropout or 0)
end

-- GPT init: router and w1, w3 ~ N(0, std); w2 (a residual projection) ~ N(0, rstd)
function MoE:init_weights(std, rstd)
  std = std or 0.02
  nn.init.normal_(self.router.weight, 0, std)
  nn.init.normal_(self.w1, 0, std)
  if self.w3 then nn.init.normal_(self.w3, 0, std) end
  nn.init.normal_(self.w2, 0, rstd or std)
  return self
end

function MoE:forward(x)
  local s = x.shape
  if #s < 1 or s[#s] ~= self.d then
    raise(string.format('MoE: x must be (..., %d), got %s', self.d, tensor.shape_str(s)))
  end
  local N = x:numel() / self.d
  local out, info = gp.moe_ffn(x:reshape {N, self.d}, self.router.weight, self.w1, self.w2, self.w3,
    {k = self.k, act = self.act, capacity_factor = self.capacity_factor, renorm = self.renorm})
  rawset(self, 'counts', info.counts)
  rawset(self, 'cap', info.cap)
  if rawget(self, 'load') then gp.no_grad(function() self.load:add_(info.counts:to('i64')) end) end
  local aux
  if self.training and (self.aux_alpha ~= 0 or self.z_alpha ~= 0) then
    aux = gp.moe_aux_loss(info.probs, info.counts, self.k) * self.aux_alpha
    if self.z_alpha ~= 0 then aux = aux + gp.moe_z_loss(info.logits) * self.z_alpha end
  end
  rawset(self, 'aux_loss', aux)
  return self.drop(out:view(s))
end

-- sum the expert counts of every forward into self.load (i64, E) until track_load(false)
function MoE:track_load(on)
  if on == false then rawset(self, 'load', nil)
  else rawset(self, 'load', gp.zeros({self.experts}, {dtype = 'i64', device = self.router.weight.device})) end
  return self
end

function MoE:extra_repr()
  return string.format('d=%d, hidden=%d, experts=%d, k=%d, act=%s%s', self.d, self.hidden, self.experts, self.k, self.act,
    self.capacity_factor and string.format(', capacity_factor=%g', self.capacity_factor) or '')
end

-- the MoE layers of a model (any module), in order
local function moe_layers(m)
  local r = {}
  for _, x in ipairs(m:modules()) do if getmetatable(x) == MoE._imt then r[#r + 1] = x end end
  return r
end
nn.moe_layers = moe_layers

gp.doc(nn.MoE, "nn.MoE(d, hidden=4d, {experts=8, k=2, act='gelu'|'swiglu', capacity_factor=nil, aux_alpha=0.01, z_alpha=1e-3, renorm=(k > 1), dropout=0})",
  '(or nn.MoE{d_model=, d_hidden=, n_experts=, top_k=, ...}) a Mixture-of-Experts FFN (gp.moe_ffn) on (..., d): router (E, d), experts w1, w3 (E, d, hidden), w2 (E, hidden, d); sets m.aux_loss (training mode) and m.counts')
gp.doc(MoE.track_load, 'moe:track_load(true|false)', 'sum the expert counts of every forward into moe.load (i64, E)')
gp.doc(MoE.init_weights, 'moe:init_weights(std=0.02, rstd=std)', 'router, w1, w3 ~ N(0, std); w2 ~ N(0, rstd)')
gp.doc(nn.moe_layers, 'nn.moe_layers(model)', 'the nn.MoE modules of a model, in order')

return nn
