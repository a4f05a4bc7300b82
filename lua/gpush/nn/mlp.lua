-- nn.MLP (GELU) and nn.SwiGLUMLP: the feed-forward layers of a transformer block.
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
require 'gpush.nn.layers'
local doc = gp.doc
local is_tensor = tensor.is_tensor
local Module = nn.Module
local Linear, Dropout = nn.Linear, nn.Dropout

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
-- instance) keeps the MLPs on the module calls; with a bias (biased) or without
local linear_forward = Linear.forward
local function plain_linear(m, biased)
  return getmetatable(m) == Linear._imt and m.forward == linear_forward and is_tensor(rawget(m, 'weight'))
    and (biased and is_tensor(rawget(m, 'bias')) or not biased and rawget(m, 'bias') == nil)
end
function MLP:forward(x)
  local fc, proj = self.fc, self.proj
  if plain_linear(fc, true) and plain_linear(proj, true) then -- one node, GELU in the GEMM epilogues
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
  -- gate's and up's weights as the row blocks of one (2 hidden, d) tensor, so
  -- that gp.linear_group runs them as one product (forward and backward);
  -- a weight replaced later (:to, loading a checkpoint into new tensors)
  -- just runs alone
  local W = gp.cat({self.gate.weight:detach(), self.up.weight:detach()}, 1)
  self.gate.weight = nn.Parameter(W:narrow(1, 1, hidden))
  self.up.weight = nn.Parameter(W:narrow(1, hidden + 1, hidden))
end
function SwiGLUMLP:forward(x)
  local gate, up = self.gate, self.up
  local g, u
  if plain_linear(gate, false) and plain_linear(up, false) then -- one node: the backward's dx without an add kernel
    g, u = gp.linear_group(x, {gate.weight, up.weight})
  else
    g, u = gate(x), up(x)
  end
  return self.drop(self.proj(gp.swiglu(g, u)))
end

doc(nn.MLP, 'nn.MLP(d, hidden=4d, {dropout=0})', 'Linear(d, hidden), GELU (tanh form), Linear(hidden, d)')
doc(nn.SwiGLUMLP, 'nn.SwiGLUMLP(d, hidden=4d)', "proj(silu(gate(x)) * up(x)) without biases; gate's and up's weights are the row blocks of one (2 hidden, d) tensor (kept so by :to and mixed_precision), so that both run as one product forward and backward (gp.linear_group)")

return nn
