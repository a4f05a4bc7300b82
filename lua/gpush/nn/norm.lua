-- nn.LayerNorm and nn.RMSNorm: the norms over the last dim.
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
local doc = gp.doc
local Module, param, need_int = nn.Module, nn.new_param, nn.need_int

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

doc(nn.LayerNorm, 'nn.LayerNorm(d, {eps=1e-5, bias=true})', 'gp.layer_norm over the last dim with weight 1 and bias 0 at init')
doc(nn.RMSNorm, 'nn.RMSNorm(d, {eps=1e-5})', 'gp.rms_norm over the last dim with weight 1 at init')

return nn
