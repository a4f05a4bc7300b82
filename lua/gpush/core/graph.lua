-- CUDA graphs: capture a function's GPU work once, replay it with one launch.
--
--   local x = gp.randn{64, 64}                    -- inputs made before the capture
--   local g = gp.graph(function() return (x:matmul(x)):relu() end)
--   local y = g.outputs[1]                        -- a tensor of the graph's pool
--   x:copy_(new_x); g:replay()                    -- y now holds relu(new_x @ new_x)
--
-- On the GPU, gp.graph(fn) captures gpush's current stream while fn runs
-- (fn's kernels are recorded, not run) and instantiates the graph; g:replay()
-- launches it on the current stream, reading and writing the same addresses
-- every time. So: inputs are tensors made before the capture, updated in
-- place between replays (copy_, fill_, ...); outputs are the tensors fn
-- returns (g.outputs, also returned by each replay), overwritten by each
-- replay. Tensors made during the capture come from a graph-private pool of
-- the caching allocator that stays reserved while the graph lives (g:free(),
-- or when g is collected).
--
-- Not capturable, and an error that ends the capture cleanly (the stream and
-- the allocator stay usable): reading values on the host (item, totable,
-- print), gp.sync and other synchronizations, host-to-device tensors
-- (gp.tensor{...} on cuda), cpu tensors, changing streams. Host-side control
-- flow in fn runs once, at the capture: a replay repeats the kernels chosen
-- then. Random kernels (rand, randn, dropout, multinomial, sample) draw fresh
-- numbers on every replay: each replay takes its draws from the seeded
-- generator as the same calls made eagerly at that point would.
--
-- On the CPU, a "graph" simply calls fn: once at creation, then at every
-- replay, copying the results into the tensors the first call returned (so
-- g.outputs behave as on the GPU).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local C, raise, is_tensor = rt.C, rt.raise, tensor.is_tensor

local M = {}
local Graph = {}
Graph.__index = Graph
M.Graph = Graph

local box = ffi.new('gp_graph*[1]')

local function pack(...) return {n = select('#', ...), ...} end

function M.graph(fn, opts)
  if type(fn) ~= 'function' then raise('graph: needs a function, gp.graph(fn)') end
  opts = opts or {}
  local device = opts.device or tensor.state.device
  if device ~= 'cuda' and device ~= 'cpu' then raise("graph: device must be 'cuda' or 'cpu'") end
  local self = setmetatable({device = device, fn = fn, replays = 0}, Graph)
  if device == 'cpu' then
    local r = pack(fn())
    self.outputs = r
    return self
  end
  rt.call(C.gp_graph_begin, box)
  local h = box[0]
  M.capturing = true
  local r = pack(pcall(fn))
  M.capturing = false
  if not r[1] then
    C.gp_graph_end(h, 0)
    error('graph: the captured function failed (the capture was dropped): ' .. tostring(r[2]), 0)
  end
  if C.gp_graph_end(h, 1) ~= 0 then raise(rt.last_error()) end
  self.h = ffi.gc(h, C.gp_graph_free)
  local outs = {n = r.n - 1}
  for i = 2, r.n do outs[i - 1] = r[i] end
  self.outputs = outs
  return self
end

-- copy a fresh result into the tensor the first call returned (cpu graphs)
local function refresh(old, new)
  if is_tensor(old) and is_tensor(new) then
    old:copy_(new)
  elseif type(old) == 'table' and type(new) == 'table' then
    for k, v in pairs(old) do refresh(v, new[k]) end
  end
end

function Graph:replay()
  if self.device == 'cpu' then
    if self.freed then raise('graph:replay: the graph was freed') end
    local r = pack(self.fn())
    for i = 1, self.outputs.n do refresh(self.outputs[i], r[i]) end
  else
    if not self.h then raise('graph:replay: the graph was freed') end
    rt.call(C.gp_graph_replay, self.h)
  end
  self.replays = self.replays + 1
  return unpack(self.outputs, 1, self.outputs.n)
end

function Graph:free()
  if self.h then
    local h = self.h
    self.h = nil
    C.gp_graph_free(ffi.gc(h, nil))
  end
  self.freed = true
end

function Graph:__tostring()
  return string.format('Graph(%s, %d outputs, %d replays%s)', self.device, self.outputs and self.outputs.n or 0,
    self.replays, (self.freed and ', freed' or ''))
end

local doc = gp.doc
gp.graph = doc(M.graph, "gp.graph(fn, {device=gp.device()})",
  'capture the GPU work of fn once as a CUDA graph (not run at capture); g:replay() launches it on the current ' ..
  'stream, overwriting g.outputs (what fn returned); inputs are tensors made before, updated in place; host reads ' ..
  'and syncs inside fn are errors; random kernels draw fresh numbers each replay; on the CPU fn is simply called ' ..
  '(at creation and each replay)')
doc(Graph.replay, 'g:replay()', 'launch the captured graph (on the CPU: call fn again); returns g.outputs')
doc(Graph.free, 'g:free()', "release the graph and its memory pool (also done when g is collected)")
gp.GraphClass = Graph

-- the Llama decode step as one kernel (models/llama.lua, Llama:_step_plan)
local step_mode = os.getenv('GPUSH_DECODE_STEP') ~= '0'
gp.decode_step = doc(function(on)
  if on ~= nil and type(on) ~= 'boolean' and on ~= 'always' then
    raise('decode_step: on must be true, false, \'always\' or nil, got ' .. tostring(on))
  end
  local prev = step_mode
  if on ~= nil then step_mode = on end
  return prev
end, "gp.decode_step(on)", "the Llama decode step (one token a row at device positions, gp.generate's step) as one " ..
  "persistent kernel (docs/generation.md): true (the default: on the GPU, up to 4 rows; GPUSH_DECODE_STEP=0 sets " ..
  "false), false (the op-by-op step), 'always' (up to 8 rows, and on the CPU through the kernel's C reference); nil " ..
  "only reads; returns the previous setting")

-- chains of dependent launches (src/gpush.h, gp_pdl_option)
local pdl_old, pdl_box = ffi.new('int[1]'), ffi.new('gp_pdl_stats[1]')
gp.pdl = doc(function(on)
  if on ~= nil and type(on) ~= 'boolean' then raise('pdl: on must be true, false or nil, got ' .. type(on)) end
  rt.call(C.gp_pdl_option, on == nil and -1 or (on and 1 or 0), pdl_old)
  return pdl_old[0] == 1
end, 'gp.pdl(on)', 'programmatic dependent launch for the decode step\'s kernels (add_rms_norm, rows_linear, ' ..
  'swiglu_linear, rope_kv_at, attn_decode, the NF4 GEMV): each may start while the kernel before it finishes, reading only the ' ..
  'weights before that kernel\'s results are visible (compute capability 9.0; on by default there, GPUSH_PDL=0 ' ..
  'turns it off). on true/false sets it (graphs captured before keep theirs), nil only reads; returns the previous setting')
gp.pdl_stats = doc(function(clear)
  rt.call(C.gp_pdl_get_stats, pdl_box, clear and 1 or 0)
  local t = pdl_box[0]
  return {chained = tonumber(t.chained), plain = tonumber(t.plain), on = t.on == 1, supported = t.supported == 1}
end, 'gp.pdl_stats(clear)', 'chain launches so far: {chained= (overlapped the kernel before them), plain= (a ' ..
  'chain\'s first, or one whose weights the chain wrote: launched the usual way), on=, supported= (this GPU can)}; ' ..
  'clear true zeroes the counts after reading')

return M
