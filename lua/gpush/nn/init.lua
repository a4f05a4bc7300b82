-- gp.nn: the Module protocol (nn/module.lua) and the layers built on it, one
-- concern per file. Each file adds its classes to the one nn table.
local nn = require 'gpush.nn.module'
require 'gpush.nn.layers'      -- Linear, Embedding, Dropout
require 'gpush.nn.norm'        -- LayerNorm, RMSNorm
require 'gpush.nn.mlp'         -- MLP, SwiGLUMLP
require 'gpush.nn.attention'   -- attention, causal_mask, CausalSelfAttention
require 'gpush.nn.moe'         -- MoE
require 'gpush.nn.transformer' -- TransformerBlock
require 'gpush.nn.lora'        -- LoRA (and gp.lora's helpers)
require 'gpush.nn.quant'       -- Linear4, quantize_linears (NF4 bases for QLoRA)
return nn
