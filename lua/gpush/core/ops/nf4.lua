-- NF4 weights (QLoRA; kernels/nf4.*, the codes and roundings in kernels/nf4.h):
--
--   local q = gp.quantize(w, {kind = 'nf4', block = 64})  -- w (out, in) float
--   q.shape, q.kind, q.block, q.dtype, q.device, q.nbytes; q:dequantize()
--   local y = gp.nf4_linear(x, q, b)   -- = x @ q:dequantize()^T + b; also gp.linear(x, q, b)
--
-- A quantized weight holds q.data, u8 (out, in / 2): two 4-bit codes a byte,
-- element 2j of a row in the high nibble of byte j, and q.absmax, f32 (out,
-- in / block): the largest |w| of each block of `block` consecutive values of
-- a row (bitsandbytes' layout, rows kept apart). 0.5 + 4 / block bytes a
-- parameter: 0.5625 for blocks of 64.
--
-- gp.nf4_linear is differentiable in x and b; the weight is frozen. With at
-- most gemv_rows rows (decode) it is one fused kernel that reads the packed
-- weight (gp.k.nf4_gemv; past 32 rows only for weights of at most 2^24
-- values: it reads the weight once per 32 rows, and on larger weights
-- dequantize + cuBLAS wins there); with more, the weight is dequantized a chunk of
-- output rows at a time into one scratch of at most chunk_bytes (and at most
-- a quarter of the dequantized weight) and each chunk is a cuBLAS product
-- into its columns of the output; the backward dx = dy @ W goes the same
-- way. No full dequantized copy of the weight is ever made.
local ffi = require 'ffi'
local bit = require 'bit'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local dtype = require 'gpush.core.dtype'
local FLOAT = dtype.FLOAT
local C, raise = rt.C, rt.raise
local empty, is_tensor, shape_str = tensor.empty, tensor.is_tensor, tensor.shape_str
local K = tensor.K
local doc = gp.doc

local OPTS = {gemv_rows = 128, chunk_bytes = 64 * 1048576}
local GEMV_BIG_ROWS, GEMV_SMALL = 32, 2 ^ 24 -- see above

function gp.nf4_option(name, value)
  local old = OPTS[name]
  if old == nil then raise(string.format("nf4_option: unknown option '%s' (gemv_rows, chunk_bytes)", tostring(name))) end
  if value ~= nil then
    if type(value) ~= 'number' or value < 1 or value ~= math.floor(value) then
      raise(string.format('nf4_option: %s must be a positive integer, got %s', name, tostring(value)))
    end
    OPTS[name] = value
  end
  return old
end
doc(gp.nf4_option, "gp.nf4_option('gemv_rows' | 'chunk_bytes', value)",
  'set an NF4 product option (value nil only reads) and return the previous value: gemv_rows (128: products with at most this many rows of x use the fused GEMV kernel, past 32 rows only for weights of at most 2^24 values), chunk_bytes (64 MiB: the most scratch a larger product dequantizes into at a time)')

---------------------------------------------------------------------------
-- the quantized weight

local Q = {}
local QMT = {__name = 'gp.QuantizedWeight'}
QMT.__index = function(self, k)
  if k == 'device' then return rawget(self, 'data').device end
  if k == 'nbytes' then return rawget(self, 'data'):numel() + 4 * rawget(self, 'absmax'):numel() end
  return Q[k]
end
QMT.__tostring = function(self)
  return string.format('QuantizedWeight(%s, %s, block %d, %s on %s, %d bytes: %.4g a parameter)', self.kind,
    shape_str(self.shape), self.block, self.dtype, self.device, self.nbytes, self.nbytes / self:numel())
end

local function is_quantized(x) return getmetatable(x) == QMT end
gp.is_quantized = is_quantized
doc(is_quantized, 'gp.is_quantized(x)', 'true when x is a quantized weight (gp.quantize)')

-- the buffers of a quantized weight keep their dtypes when a module is cast
-- (nn's Module:to moves them only)
local function keep(t) rawset(t, '_keep_dtype', true); return t end

local function new(kind, block, shape, dt, data, absmax)
  return setmetatable({kind = kind, block = block, shape = {shape[1], shape[2]}, dtype = dt, data = keep(data),
                       absmax = keep(absmax)}, QMT)
end

-- free a tensor made here now (scratch and the views of it): the caching
-- allocator gets the bytes back in stream order, without waiting for the GC
local function release(t) C.gp_tensor_free(ffi.gc(rawget(t, 'c'), nil)); rawset(t, 'c', nil) end

local function need_block(op, block)
  if type(block) ~= 'number' or block < 16 or block ~= math.floor(block) or bit.band(block, block - 1) ~= 0 then
    raise(string.format('%s: block must be a power of two >= 16, got %s', op, tostring(block)))
  end
end

function gp.quantize(w, opts)
  opts = opts or {}
  if type(opts) ~= 'table' then raise("quantize: options must be a table like {kind = 'nf4', block = 64}") end
  local kind, block = opts.kind or 'nf4', opts.block or 64
  if kind ~= 'nf4' then raise(string.format("quantize: kind '%s' is not supported (nf4)", tostring(kind))) end
  if not is_tensor(w) then raise('quantize: w must be a tensor, got ' .. type(w)) end
  if not FLOAT[w.dtype] then
    raise(string.format('quantize: w is %s %s; a float weight (f32, bf16, f16) is needed', w.dtype, shape_str(w.shape)))
  end
  if w:dim() ~= 2 then raise(string.format('quantize: w must be 2-d (out, in), got %s', shape_str(w.shape))) end
  need_block('quantize', block)
  local O, I = w:size(1), w:size(2)
  if I % block ~= 0 then
    raise(string.format('quantize: block %d does not divide the rows of w %s (in = %d)', block, shape_str(w.shape), I))
  end
  local data = empty({O, I / 2}, 'u8', w.device, 'quantize')
  local absmax = empty({O, I / block}, 'f32', w.device, 'quantize')
  local nb = O * I / block
  if nb > 0 then
    local wc = w:contiguous()
    gp.no_grad(function() K.nf4_quantize(data:view {nb, block / 2}, absmax:view {nb}, wc:view {nb, block}) end)
  end
  return new('nf4', block, {O, I}, w.dtype, data, absmax)
end
doc(gp.quantize, "gp.quantize(w, {kind='nf4', block=64})",
  "a quantized copy of the 2-d float weight w (out, in): NF4 as bitsandbytes defines it (blocks of `block` values of a row, a power of two >= 16 dividing in; absmax per block, the nearest of 16 codes, two a byte); q.shape, q.kind, q.block, q.dtype (w's), q.device, q.nbytes (0.5 + 4/block a parameter), q:dequantize(), q:to(device)")

-- quantized weights of the same in-features stacked row-wise: blocks run along
-- a row, so the codes and scales of the stack are the parts' rows one after
-- another. Returns the stacked weight and, per part, a weight over its row
-- block of the stack (views: no copy of the parts is kept)
function gp.quantized_cat(qs)
  if type(qs) ~= 'table' or #qs == 0 then raise('quantized_cat: needs a list of quantized weights') end
  local q1 = qs[1]
  local datas, maxes, O = {}, {}, 0
  for i, q in ipairs(qs) do
    if not is_quantized(q) then raise(string.format('quantized_cat: item %d is not a quantized weight (gp.quantize), got %s', i, type(q))) end
    if q.kind ~= q1.kind or q.block ~= q1.block or q.shape[2] ~= q1.shape[2] or q.dtype ~= q1.dtype or q.device ~= q1.device then
      raise(string.format('quantized_cat: item %d is %s %s block %d %s on %s but item 1 is %s %s block %d %s on %s', i, q.kind,
        shape_str(q.shape), q.block, q.dtype, q.device, q1.kind, shape_str(q1.shape), q1.block, q1.dtype, q1.device))
    end
    datas[i], maxes[i], O = q.data, q.absmax, O + q.shape[1]
  end
  local all = new(q1.kind, q1.block, {O, q1.shape[2]}, q1.dtype, gp.cat(datas, 1), gp.cat(maxes, 1))
  local parts, r0 = {}, 1
  for i, q in ipairs(qs) do
    local n = q.shape[1]
    parts[i] = new(q.kind, q.block, q.shape, q.dtype, all.data:narrow(1, r0, n), all.absmax:narrow(1, r0, n))
    r0 = r0 + n
  end
  return all, parts
end
doc(gp.quantized_cat, 'gp.quantized_cat({q1, q2, ...})',
  "quantized weights of one kind, block, dtype, device and in-features stacked row-wise (one product for projections of the same input): returns the stacked weight and a list of weights over its row blocks (views, equal to the parts)")

function Q:numel() return self.shape[1] * self.shape[2] end
function Q:dim() return 2 end
function Q:size(d)
  if d == nil then return {self.shape[1], self.shape[2]} end
  if d < 0 then d = d + 3 end
  return self.shape[d]
end

-- rows [n0, n0 + n) (0-based n0) of the weight dequantized into out ((n, in), dtype dt), contiguous
local function dequant_rows(q, n0, n, out)
  local I, block = q.shape[2], q.block
  local nb = n * I / block
  if nb == 0 then return out end
  local d = q.data:narrow(1, n0 + 1, n)
  local a = q.absmax:narrow(1, n0 + 1, n)
  local dv, av, ov = d:view {nb, block / 2}, a:view {nb}, out:view {nb, block}
  K.nf4_dequantize(ov, dv, av)
  release(dv); release(av); release(ov); release(d); release(a)
  return out
end

function Q:dequantize(dt)
  local out
  if is_tensor(dt) then -- into a given tensor
    out = dt
    if not FLOAT[out.dtype] or out:dim() ~= 2 or out.shape[1] ~= self.shape[1] or out.shape[2] ~= self.shape[2] or
      out.device ~= self.device or not out:is_contiguous() then
      raise(string.format('dequantize: out must be a contiguous float tensor %s on %s, got %s %s on %s%s',
        shape_str(self.shape), self.device, out.dtype, shape_str(out.shape), out.device,
        out:is_contiguous() and '' or ' (not contiguous)'))
    end
  else
    dt = dt or self.dtype
    if not FLOAT[dt] then raise(string.format('dequantize: %s is not a float dtype', tostring(dt))) end
    out = empty(self.shape, dt, self.device, 'dequantize')
  end
  return gp.no_grad(dequant_rows, self, 0, self.shape[1], out)
end

-- the rows idx (an integer tensor of row numbers, 0-based, any shape) dequantized: (idx's shape..., in),
-- reading only those rows' codes and absmax (an embedding lookup over a quantized table)
function Q:rows(idx, dt)
  dt = dt or self.dtype
  if not is_tensor(idx) or (idx.dtype ~= 'i64' and idx.dtype ~= 'i32') then
    raise('QuantizedWeight:rows: idx must be an i64 or i32 tensor of row numbers, got ' ..
      (is_tensor(idx) and (idx.dtype .. ' ' .. shape_str(idx.shape)) or type(idx)))
  end
  if idx.device ~= self.device then
    raise(string.format('QuantizedWeight:rows: idx is on %s but the weight is on %s', idx.device, self.device))
  end
  if not FLOAT[dt] then raise(string.format('QuantizedWeight:rows: %s is not a float dtype', tostring(dt))) end
  local I, block = self.shape[2], self.block
  local flat = idx:contiguous():view {idx:numel()}
  local n = flat:size(1)
  local shape = {}
  for i = 1, idx:dim() do shape[i] = idx:size(i) end
  shape[#shape + 1] = I
  local out = empty(shape, dt, self.device, 'nf4 rows')
  if n == 0 then return out end
  return gp.no_grad(function()
    local d, a = self.data:index_select(1, flat), self.absmax:index_select(1, flat)
    local nb = n * I / block
    K.nf4_dequantize(out:view {nb, block}, d:view {nb, block / 2}, a:view {nb})
    return out
  end)
end

-- q:to('cuda'), q:to('bf16') (the compute dtype), q:to{device=, dtype=}
function Q:to(a, b)
  local dev, dt = self.device, self.dtype
  local function one(x)
    if x == nil then return end
    if type(x) == 'table' then dev = x.device or dev; dt = x.dtype or dt
    elseif x == 'cpu' or x == 'cuda' then dev = x
    elseif FLOAT[x] then dt = x
    else raise(string.format("QuantizedWeight:to: expected a device ('cpu', 'cuda'), a float dtype or {device=, dtype=}, got %s", tostring(x))) end
  end
  one(a); one(b)
  if dev == self.device and dt == self.dtype then return self end
  return new(self.kind, self.block, self.shape, dt, self.data:to(dev), self.absmax:to(dev))
end
function Q:cuda() return self:to('cuda') end
function Q:cpu() return self:to('cpu') end

doc(Q.dequantize, 'q:dequantize(dtype=q.dtype) or q:dequantize(out)', 'the weight (out, in) as a float tensor: code * absmax of every element, rounded once to dtype; given a contiguous float tensor out of that shape on the same device, written into it (returns out)')
doc(Q.to, "q:to('cuda' | 'bf16' | {device=, dtype=})", 'the quantized weight on another device (the codes and absmax moved) or with another compute dtype; q itself when nothing changes')
doc(Q.rows, 'q:rows(idx, dtype=q.dtype)', 'the rows idx (i64/i32 row numbers, any shape) dequantized, (idx shape..., in): an embedding lookup that reads only those rows\' codes and absmax')
doc(Q.cuda, 'q:cuda()', 'q:to(\'cuda\')')
doc(Q.cpu, 'q:cpu()', 'q:to(\'cpu\')')
doc(Q.numel, 'q:numel()', 'the number of weights (out * in)')
doc(Q.size, 'q:size(d)', 'the size of dim d of the weight (out or in; negative d from the end); no d: {out, in}')
doc(Q.dim, 'q:dim()', '2')

---------------------------------------------------------------------------
-- products

local function check_linear(op, x, q, b)
  if not is_tensor(x) then raise(op .. ': x must be a tensor, got ' .. type(x)) end
  if not is_quantized(q) then raise(op .. ': q must be a quantized weight (gp.quantize), got ' .. type(q)) end
  if not FLOAT[x.dtype] then raise(string.format('%s: x is %s; a float dtype is needed', op, x.dtype)) end
  local sx = x.shape
  if #sx < 1 or sx[#sx] ~= q.shape[2] then
    raise(string.format('%s: x is %s but q is %s (the last dim of x must be q:size(2))', op, shape_str(sx), shape_str(q.shape)))
  end
  if x.device ~= q.device then raise(string.format('%s: x is on %s but q is on %s (move one with :to())', op, x.device, q.device)) end
  if b ~= nil then
    if not is_tensor(b) then raise(op .. ': b must be a tensor or nil, got ' .. type(b)) end
    if b.device ~= x.device then raise(string.format('%s: b is on %s but x is on %s', op, b.device, x.device)) end
    if b.dtype ~= x.dtype then raise(string.format('%s: b is %s but x is %s', op, b.dtype, x.dtype)) end
    if b:dim() ~= 1 or b:size(1) ~= q.shape[1] then
      raise(string.format('%s: b is %s but q is %s (b must be (%d))', op, shape_str(b.shape), shape_str(q.shape), q.shape[1]))
    end
  end
end

-- rows of the weight a chunk: at most chunk_bytes of scratch and a quarter of the dequantized weight
local function chunk_rows(q, dt)
  local O, I = q.shape[1], q.shape[2]
  local row = I * dtype.ELSIZE[dtype.DT[dt]]
  local cap = math.min(OPTS.chunk_bytes, math.ceil(O * row / 4))
  return math.max(1, math.min(O, math.floor(cap / row)))
end

-- for every chunk of weight rows: fn(n0 (0-based), n, w) with w (n, in) the
-- dequantized rows in dtype dt (a view of one scratch, released afterwards)
local function each_chunk(q, dt, fn)
  local O, I = q.shape[1], q.shape[2]
  local cr = chunk_rows(q, dt)
  local scratch = empty({cr, I}, dt, q.device, 'nf4_linear')
  for n0 = 0, O - 1, cr do
    local n = math.min(cr, O - n0)
    local w = n == cr and scratch or scratch:narrow(1, 1, n)
    dequant_rows(q, n0, n, w)
    fn(n0, n, w)
    if w ~= scratch then release(w) end
  end
  release(scratch)
end

local function nf4_linear(x, q, b)
  check_linear('nf4_linear', x, q, b)
  local O, I = q.shape[1], q.shape[2]
  local sx = x.shape
  local rows, oshape = 1, {}
  for i = 1, #sx - 1 do rows = rows * sx[i]; oshape[i] = sx[i] end
  oshape[#sx] = O
  local x2 = x:reshape {rows, I}:contiguous()
  local y = empty({rows, O}, x.dtype, x.device, 'nf4_linear')
  if rows == 0 or O == 0 then return y:view(oshape) end
  if rows <= OPTS.gemv_rows and (rows <= GEMV_BIG_ROWS or O * I <= GEMV_SMALL) then
    K.nf4_gemv(y, x2, q.data, q.absmax)
    if b then y:add_(b) end
  else
    each_chunk(q, x.dtype, function(n0, n, w)
      local yo, wt = y:narrow(2, n0 + 1, n), w:t()
      if b then
        local bn = b:narrow(1, n0 + 1, n):contiguous()
        K.matmul_bias(yo, x2, wt, bn, 1, 0)
        release(bn)
      else
        K.matmul(yo, x2, wt, 1, 0)
      end
      release(yo); release(wt)
    end)
  end
  return y:view(oshape)
end

gp.nf4_linear = nf4_linear -- autograd records it (the rule below); the forward runs untracked
doc(gp.nf4_linear, 'gp.nf4_linear(x, q, b)',
  'x @ q:dequantize()^T + b for a quantized weight q (out, in), x (..., in) in any float dtype (the product is computed in it), b (out) or nil; differentiable in x and b, q frozen. Up to gp.nf4_option(\'gemv_rows\') rows: one fused kernel reading the packed weight; more: dequantized a chunk of rows at a time into a bounded scratch, cuBLAS for each chunk. gp.linear(x, q, b) does the same')

-- d (rows, in) = g2 @ W (+ d when acc) for g2 (rows, out), W = q dequantized
-- by chunks of its rows: the input gradient of x @ W^T
local function dx_into(d, g2, q, acc)
  if g2:size(1) == 0 or q.shape[1] == 0 then
    if not acc then d:zero_() end
    return d
  end
  each_chunk(q, d.dtype, function(n0, n, w)
    local gn = g2:narrow(2, n0 + 1, n)
    K.matmul(d, gn, w, 1, (n0 == 0 and not acc) and 0 or 1)
    release(gn)
  end)
  return d
end
gp._nf4_dx_into = dx_into

-- dx = dy @ W (rows, in) by chunks of W's rows, and db = the column sums of dy
local function backward(g, a)
  local x, q, b = a[1], a[2], a[3]
  local O, I = q.shape[1], q.shape[2]
  local rows = x:numel() / math.max(I, 1)
  local g2 = tensor.to_dtype(g[1], x.dtype):reshape {rows, O}:contiguous()
  local dx, db
  if autograd.needs(x) then dx = dx_into(empty({rows, I}, x.dtype, x.device, 'nf4_linear'), g2, q):view(x.shape) end
  if b and autograd.needs(b) then db = g2:sum(1) end
  return dx, nil, db
end
gp._nf4_linear_backward = backward
autograd.def_function('nf4_linear', backward)

return gp
