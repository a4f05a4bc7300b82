-- gpush.core: tensors, kernels, autograd and the runtime around them. Loading
-- it loads the core's modules in dependency order; each adds its functions to
-- the core namespace (gpush.core.ns), which this returns: the functions the
-- gp facade re-exports (gp.zeros, gp.matmul, gp.no_grad, gp.save, ...).
local ffi = require 'ffi'
local tensor = require 'gpush.core.tensor'
local kernels = require 'gpush.core.kernels'
local gp = require 'gpush.core.ns'

gp.Tensor, gp.is_tensor, gp.C, gp.ffi = tensor.Tensor, tensor.is_tensor, require 'gpush.core.ffi', ffi
gp.k = kernels.k

require 'gpush.core.device'     -- devices, seeds, memory, sync, timing, streams
require 'gpush.core.graph'      -- gp.graph
require 'gpush.core.factory'    -- creation, cat, stack, where
require 'gpush.core.print'      -- tostring(t)

-- the op families: tensor methods, gp functions and their gradient rules
require 'gpush.core.ops.index'      -- embedding, gather, index_select, scatter_add
require 'gpush.core.ops.loss'       -- cross_entropy
require 'gpush.core.ops.distill'    -- distill_loss
require 'gpush.core.ops.select'     -- topk, sort, ...
require 'gpush.core.ops.random'     -- dropout, multinomial
require 'gpush.core.ops.reduce'     -- sum, mean, max, var, norm, cumsum
require 'gpush.core.ops.rows'       -- softmax, log_softmax, layer_norm, rms_norm
require 'gpush.core.ops.fused'      -- swiglu, add_rms_norm, bias_gelu
require 'gpush.core.ops.matmul'     -- matmul, linear, linear_gelu_linear
require 'gpush.core.ops.sample'     -- sample, repetition_penalty
require 'gpush.core.ops.attention'  -- attention, attention_qkv, attention_decode, KVCache
require 'gpush.core.ops.moe'        -- moe_router, moe_ffn, ...
require 'gpush.core.ops.titans'     -- titans_coef, titans_scan
require 'gpush.core.ops.conv'       -- causal_conv1d
require 'gpush.core.ops.diversity'  -- set_diversity, distinct_n
require 'gpush.core.ops.rope'       -- rope, rope_inv_freq
require 'gpush.core.ops.nf4'        -- quantize (NF4), nf4_linear

-- checkpoints and JSON
local checkpoint = require 'gpush.core.checkpoint'
local doc = gp.doc
gp.save = doc(checkpoint.save, "gp.save('m.safetensors', {name = tensor, ...}, {step = 10, config = {...}})",
  'write tensors (moved to the cpu) and metadata in the safetensors format; atomic (a temporary file, then a rename)')
gp.load = doc(checkpoint.load, "gp.load('m.safetensors', {device = 'cuda'})",
  'read a safetensors file: returns {name = tensor}, metadata; every header entry is checked before reading')
gp.json = require 'gpush.core.json'
doc(gp.json.encode, 'gp.json.encode(value)', 'JSON text of a Lua value (tables with keys 1..n are arrays; object keys in byte order, the same text in every process)')
doc(gp.json.decode, 'gp.json.decode(text)', 'a Lua value from JSON text (null is gp.json.null)')

-- autograd: wraps the differentiable methods and functions defined above
local autograd = require 'gpush.core.autograd'
autograd.install(gp)
gp.no_grad = doc(autograd.no_grad, 'gp.no_grad(fn, ...)', 'run fn(...) without recording operations for autograd')
gp.enable_grad = doc(autograd.enable_grad, 'gp.enable_grad(fn, ...)', 'run fn(...) with autograd recording (inside no_grad)')
gp.gradcheck = doc(autograd.gradcheck, 'gp.gradcheck(fn, {x, y, ...}, {eps=1e-6, atol=1e-5, rtol=1e-4})',
  'compare the gradients of fn at f64 CPU inputs with central differences; raises on a mismatch')
gp.autograd_hook = doc(autograd.register_post_accumulate_hook, 'gp.autograd_hook(t, fn)',
  "fn(t) runs in loss:backward() once t's gradient is complete; returns {remove = function}")

function gp.kernels()
  local lines = {}
  for _, k in ipairs(kernels.list) do
    lines[#lines + 1] = {name = k.name, family = k.family, usage = kernels.usage(k), doc = k.doc, signature = k.signature, spec = k.spec}
  end
  return setmetatable(lines, {__tostring = function(l)
    local out, fam = {}, nil
    for _, k in ipairs(l) do
      if k.family ~= fam then fam = k.family; out[#out + 1] = '-- ' .. fam end
      out[#out + 1] = string.format('  %-52s %s', k.usage, k.doc)
    end
    return table.concat(out, '\n')
  end})
end
doc(gp.kernels, 'gp.kernels()', 'every kernel with its arguments and one-line doc (print it)')
doc(gp.is_tensor, 'gp.is_tensor(x)', 'true when x is a gp tensor')
doc(gp.doc, 'gp.doc(fn, usage, text)', 'register the doc that help(fn) prints; returns fn')

return gp
