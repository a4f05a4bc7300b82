-- gpush: GPU tensors and every CUDA kernel as Lua functions. This file is the
-- gp facade: it only re-exports the layers below it (docs/architecture.md).
-- `gp` is preloaded in scripts and the prompt; `local gp = require 'gpush'` also works.
--
--   core/         tensors, kernels (gp.k), ops, autograd, streams, graphs, checkpoints, GGUF (gp.gguf)
--   nn/           modules and layers             -> gp.nn, gp.lora
--   text/         tokenizers, chat templates     -> gp.tokenizer
--   models/       models and generation          -> gp.models, gp.generate
--   train/        optimizers, data, logs, dist   -> gp.optim, gp.data, gp.train, gp.dist
--   experiments/  research libraries             -> gp.polychromic, gp.titans
--   tools/        prompt, help, profiler, tracer, NVRTC, plots -> gp.help, gp.profile, gp.trace, gp.rtc, gp.args, gp.plot
local core = require 'gpush.core'
local autograd = require 'gpush.core.autograd'

local gp = {}
for k, v in pairs(core) do gp[k] = v end
autograd.install(gp) -- rules defined later (by users, on gp) wrap gp's functions too
gp.gguf = require 'gpush.core.gguf'

gp.nn = require 'gpush.nn'
gp.tokenizer = require('gpush.text').tokenizer
gp.lora = require 'gpush.nn.lora'

gp.models = require 'gpush.models'
gp.generate = gp.models.generate

gp.optim = require 'gpush.train.optim'
gp.data = require 'gpush.train.data'
gp.train = require 'gpush.train.logger'
for k, v in pairs(require 'gpush.train.state') do gp.train[k] = v end -- save_state, load_state, resume_args
gp.dist = require 'gpush.train.dist'

gp.titans = require 'gpush.experiments.titans'
gp.polychromic = require 'gpush.experiments.polychromic'
gp.polychromic.lm = require 'gpush.experiments.polychromic_lm'

gp.help = require('gpush.tools.help').help
gp.profile = require('gpush.tools.profile').profile
gp.trace = require('gpush.tools.trace').trace
gp.rtc = require('gpush.tools.rtc').api
gp.args = require 'gpush.tools.args'
gp.plot = require 'gpush.tools.plot'

-- the names the layers had under gp.nn before they moved out of it
local nn, titans = gp.nn, gp.titans
nn.GPT = gp.models.GPT
nn.NeuralMemory, nn.MACBlock, nn.SWABlock, nn.TitansLM = titans.NeuralMemory, titans.MACBlock, titans.SWABlock, titans.TitansLM

-- a mistyped name (gp.zeross) is an error that suggests the real one; gp.debug
-- (full tracebacks at the prompt) reads as nil until set
require('gpush.core.suggest').strict(gp, 'gp', {debug = true})

return gp
