-- nn.TransformerBlock: pre-norm attention and MLP (GELU, SwiGLU or MoE) with residuals.
local rt = require 'gpush.core.runtime'
local gp = require 'gpush.core'
local nn = require 'gpush.nn.module'
require 'gpush.nn.norm'
require 'gpush.nn.mlp'
require 'gpush.nn.attention'
require 'gpush.nn.moe'
local doc = gp.doc
local raise = rt.raise
local Module, need_int = nn.Module, nn.need_int
local LayerNorm, RMSNorm, MLP, SwiGLUMLP = nn.LayerNorm, nn.RMSNorm, nn.MLP, nn.SwiGLUMLP
local CausalSelfAttention = nn.CausalSelfAttention

-- nn.LayerNorm (kind 'layer', the default) or nn.RMSNorm ('rms') of size d
function nn.make_norm(kind, d, cfg)
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
  self.ln1 = nn.make_norm(cfg.norm, C, cfg)
  self.attn = CausalSelfAttention(cfg)
  self.ln2 = nn.make_norm(cfg.norm, C, cfg)
  local hidden = cfg.mlp_hidden or 4 * C
  local o = {dropout = cfg.dropout, dtype = cfg.dtype, device = cfg.device, bias = cfg.bias}
  if cfg.mlp == nil or cfg.mlp == 'gelu' then self.mlp = MLP(C, hidden, o)
  elseif cfg.mlp == 'swiglu' then self.mlp = SwiGLUMLP(C, hidden, o)
  elseif cfg.mlp == 'moe' then -- nn.MoE (nn/moe.lua); cfg.moe = {experts=8, k=2, ...}
    local mo = {}
    for k, v in pairs(cfg.moe or {}) do mo[k] = v end
    mo.dtype, mo.device, mo.dropout = cfg.dtype, cfg.device, mo.dropout or cfg.dropout
    self.mlp = nn.MoE(C, hidden, mo)
  else raise("TransformerBlock: mlp must be 'gelu', 'swiglu' or 'moe', got " .. tostring(cfg.mlp)) end
end
-- an nn.RMSNorm as it comes (no forward swapped on the instance)
local function plain_rms(m) return m._name == 'RMSNorm' and rawget(m, 'forward') == nil end
-- an nn.RMSNorm or nn.LayerNorm as it comes: a norm that a fused residual add + norm may stand in for
local function plain_norm(m) return (m._name == 'RMSNorm' or m._name == 'LayerNorm') and rawget(m, 'forward') == nil end
-- m(x + a) and x + a in one kernel (m a plain norm): gp.add_rms_norm or gp.add_layer_norm
local function add_norm(m, a, x)
  if m._name == 'RMSNorm' then
    local n, h = gp.add_rms_norm(a, x, m.weight, m.eps)
    return n, h
  end
  local n, h = gp.add_layer_norm(a, x, m.weight, m.bias, m.eps)
  return n, h
end

-- forward and forward_cached (cache given): x + attn(ln1(x)), then that plus
-- mlp(ln2(it)); with a plain norm ln2 the first add runs inside it
-- (forward_pending: gp.add_rms_norm or gp.add_layer_norm, and backward the
-- residual's gradient added to the norm's)
local function block(self, x, cache, layer, pos)
  if plain_norm(self.ln2) then
    local h, m = self:forward_pending(x, nil, cache, layer, pos)
    return h + m
  end
  local n1 = self.ln1(x)
  x = x + (cache and self.attn:forward_cached(n1, cache, layer, pos) or self.attn(n1))
  return x + self.mlp(self.ln2(x))
end
function TransformerBlock:forward(x) return block(self, x) end
function TransformerBlock:forward_cached(x, cache, layer, pos) return block(self, x, cache, layer, pos) end

-- the block as forward / forward_cached (cache given) computes it, its two
-- residual adds left to the norms after them: x + a (a, the previous block's
-- MLP output, not yet added; nil for the first block) goes through the first
-- norm as one gp.add_rms_norm, and the block returns (h, m) with its output
-- h + m, m its MLP's, for the next block's first norm (or the model's last)
-- to add. For blocks whose norms are plain nn.RMSNorms or nn.LayerNorms
-- (TransformerBlock.chains)
function TransformerBlock:forward_pending(x, a, cache, layer, pos)
  local n1
  if a then n1, x = add_norm(self.ln1, a, x) else n1 = self.ln1(x) end
  local att = cache and self.attn:forward_cached(n1, cache, layer, pos) or self.attn(n1)
  local n2, h = add_norm(self.ln2, att, x)
  return h, self.mlp(n2)
end
-- blk runs TransformerBlock's own forward with plain norms: forward_pending
-- computes the same
function TransformerBlock.chains(blk)
  return getmetatable(blk) == TransformerBlock._imt and rawget(blk, 'forward') == nil and
    rawget(blk, 'forward_cached') == nil and plain_norm(blk.ln1) and plain_norm(blk.ln2)
end
nn.plain_rms, nn.plain_norm, nn.add_norm = plain_rms, plain_norm, add_norm
doc(nn.plain_rms, 'nn.plain_rms(m)',
  'true when m is an nn.RMSNorm with its own forward (none set on the instance): a norm that gp.add_rms_norm may stand in for')
doc(nn.plain_norm, 'nn.plain_norm(m)',
  'true when m is an nn.RMSNorm or nn.LayerNorm with its own forward (none set on the instance): a norm that nn.add_norm may stand in for')
doc(nn.add_norm, 'nn.add_norm(m, a, x)',
  'm(x + a), x + a in one kernel for a plain norm m (gp.add_rms_norm or gp.add_layer_norm with m\'s weight, bias and eps)')


doc(nn.TransformerBlock, "nn.TransformerBlock{n_embd=, n_head=, mlp='gelu'|'swiglu'|'moe', moe={experts=8, k=2, ...}, norm='layer'|'rms', dropout=0, mlp_hidden=4 n_embd}",
  'pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))')
doc(nn.make_norm, "nn.make_norm('layer'|'rms', d, {eps=, dtype=, device=, bias=})", 'nn.LayerNorm (the default) or nn.RMSNorm of size d')

return nn
