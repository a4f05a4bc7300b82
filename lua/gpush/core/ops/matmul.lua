-- Matrix products: a:matmul(b), gp.matmul(a, b, opts), gp.linear(x, w, b),
-- gp.set_tf32(on). The kernels (kernels/matmul.def) take [*,M,K] x [*,K,N];
-- this layer maps the supported shapes onto them with views only (a 2-D
-- operand is broadcast over the batch by a stride-0 expand; transposes are
-- views that cuBLAS reads with its transpose flag).
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local graph = require 'gpush.core.graph'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local common = require 'gpush.core.ops.common'
local C, raise = rt.C, rt.raise
local like, grad_buffer = common.like, common.grad_buffer
local K = tensor.K
local FLOAT = require('gpush.core.dtype').FLOAT
local HALF = common.HALF
local Tensor, empty, is_tensor, shape_str = tensor.Tensor, tensor.empty, tensor.is_tensor, tensor.shape_str
local doc = gp.doc
local old = ffi.new('int[1]')

-- set a matmul option (value 0 or 1) and return its previous value; value -1 (or nil) only reads
local function option(name, value)
  if value == nil then value = -1 end
  if value ~= -1 and value ~= 0 and value ~= 1 then
    raise(string.format('matmul_option: %s must be 0 or 1 (-1 only reads), got %s', tostring(name), tostring(value)))
  end
  rt.call(C.gp_matmul_option, name, value, old)
  return old[0]
end
gp.matmul_option = option
doc(option, "gp.matmul_option('tf32'|'gemv'|'lt'|'tune', value)",
  'set a matmul option to 0 or 1 (value -1 or nil only reads) and return the previous value: tf32 (1: f32 GEMMs may use TF32), gemv (1: m == 1 or n == 1 through cuBLAS gemv instead of GEMM), lt (1, the default: bias/GELU epilogues through cuBLASLt where it has an algorithm; 0: always a GEMM and an epilogue kernel), tune (1: each product shape\'s cuBLASLt algorithm chosen by timing up to 8 candidates (and cublasGemmEx for plain products) once, then cached for the process; a miss during gp.graph capture runs untuned and is not cached; default 0, or 1 with GPUSH_MATMUL_TUNE=1 in the environment)')

local tune_box = ffi.new('gp_matmul_tunestats[1]')
function gp.matmul_tune_stats()
  rt.call(C.gp_matmul_tune_stats, tune_box)
  local t = tune_box[0]
  return {entries = tonumber(t.entries), hits = tonumber(t.hits), misses = tonumber(t.misses),
          uncached = tonumber(t.uncached), tuned_ms = tonumber(t.tuned_ms)}
end
doc(gp.matmul_tune_stats, 'gp.matmul_tune_stats()',
  "the algorithm cache of gp.matmul_option('tune', 1): {entries=, hits=, misses= (tuned and stored), uncached= (misses during a CUDA graph capture, run untuned), tuned_ms= (host ms spent timing candidates)}")
function gp.matmul_tune_clear() rt.call(C.gp_matmul_tune_clear) end
doc(gp.matmul_tune_clear, 'gp.matmul_tune_clear()', "empty the algorithm cache of gp.matmul_option('tune', 1) and zero its counters (the next product of each shape is timed again)")

function gp.set_tf32(on) option('tf32', on and 1 or 0) end
doc(gp.set_tf32, 'gp.set_tf32(true|false)', 'let f32 matrix products use TF32 tensor cores (off by default; ~1e-3 relative error)')
function gp.tf32() return option('tf32', -1) == 1 end
doc(gp.tf32, 'gp.tf32()', 'true when f32 matrix products may use TF32')

local function check_pair(op, a, b)
  if not is_tensor(a) then raise(string.format('%s: a must be a tensor, got %s', op, type(a))) end
  if not is_tensor(b) then raise(string.format('%s: b must be a tensor, got %s', op, type(b))) end
  if a.device ~= b.device then
    raise(string.format('%s: a is on %s but b is on %s (move one with :to())', op, a.device, b.device))
  end
  if a.dtype ~= b.dtype then
    raise(string.format('%s: a is %s but b is %s (convert one with :to())', op, a.dtype, b.dtype))
  end
  if not FLOAT[a.dtype] then
    raise(string.format('%s: a and b are %s; a float dtype (f32, bf16, f16, f64) is needed', op, a.dtype))
  end
end

-- kernel operands A [*,M,K], B [*,K,N], the kernel's out shape, the result
-- shape, and a function mapping a result-shaped out onto the kernel's shape
local function operands(op, a, b, out_given)
  local sa, sb = a.shape, b.shape
  local na, nb = #sa, #sb
  local function mismatch()
    raise(string.format("%s: inner dimensions differ: a is %s, b is %s; a's last dim must equal b's %s", op, shape_str(sa),
      shape_str(sb), nb == 1 and 'only dim' or (nb == 2 and 'first' or 'second-to-last')))
  end
  local same = function(t) return t end
  if na == 1 and nb == 2 then
    if sa[1] ~= sb[1] then mismatch() end
    return a:unsqueeze(1), b, {1, sb[2]}, {sb[2]}, function(t) return t:unsqueeze(1) end
  elseif na == 2 and nb == 1 then
    if sa[2] ~= sb[1] then mismatch() end
    return a, b:unsqueeze(2), {sa[1], 1}, {sa[1]}, function(t) return t:unsqueeze(2) end
  elseif na == 2 and nb == 2 then
    if sa[2] ~= sb[1] then mismatch() end
    return a, b, {sa[1], sb[2]}, {sa[1], sb[2]}, same
  elseif na == 3 and nb == 3 then
    if sa[3] ~= sb[2] then mismatch() end
    local n = sa[1]
    if sa[1] ~= sb[1] then
      if sa[1] == 1 then n = sb[1]; a = a:expand {n, sa[2], sa[3]}
      elseif sb[1] == 1 then b = b:expand {n, sb[2], sb[3]}
      else raise(string.format('%s: a is %s but b is %s (batch sizes differ)', op, shape_str(sa), shape_str(sb))) end
    end
    return a, b, {n, sa[2], sb[3]}, {n, sa[2], sb[3]}, same
  elseif na == 3 and nb == 2 then
    if sa[3] ~= sb[1] then mismatch() end
    local r = {sa[1], sa[2], sb[2]}
    -- one GEMM over every row when a (and out) can be viewed as rows
    if a:is_contiguous() and (out_given == nil or out_given:is_contiguous()) then
      return a:view {sa[1] * sa[2], sa[3]}, b, {sa[1] * sa[2], sb[2]}, r,
        function(t) return t:view {sa[1] * sa[2], sb[2]} end
    end
    return a, b:unsqueeze(1):expand {sa[1], sb[1], sb[2]}, r, r, same
  elseif na == 2 and nb == 3 then
    if sa[2] ~= sb[2] then mismatch() end
    local r = {sb[1], sa[1], sb[3]}
    return a:unsqueeze(1):expand {sb[1], sa[1], sa[2]}, b, r, r, same
  end
  raise(string.format('%s: a is %s and b is %s; supported: 1-d x 2-d, 2-d x 1-d, 2-d x 2-d, 3-d x 3-d, 3-d x 2-d, 2-d x 3-d',
    op, shape_str(sa), shape_str(sb)))
end

local function run(kout, A, B, bias, alpha, beta, act)
  if act then gp.k.matmul_bias_gelu_tanh(kout, A, B, bias)
  elseif bias then gp.k.matmul_bias(kout, A, B, bias, alpha, beta)
  else gp.k.matmul(kout, A, B, alpha, beta) end
end

local function mm(op, a, b, o)
  o = o or {}
  if type(o) ~= 'table' then raise(op .. ': options must be a table like {out=, bias=, alpha=, beta=}') end
  check_pair(op, a, b)
  if o.trans_a then
    if a:dim() < 2 then raise(string.format('%s: trans_a needs a with 2 or more dims, got %s', op, shape_str(a.shape))) end
    a = a:transpose(-1, -2)
  end
  if o.trans_b then
    if b:dim() < 2 then raise(string.format('%s: trans_b needs b with 2 or more dims, got %s', op, shape_str(b.shape))) end
    b = b:transpose(-1, -2)
  end
  local out = o.out
  if out ~= nil and not is_tensor(out) then raise(op .. ': out must be a tensor') end
  local A, B, kshape, rshape, map = operands(op, a, b, out)
  local alpha, beta = o.alpha or 1, o.beta or 0
  if type(alpha) ~= 'number' or type(beta) ~= 'number' then raise(op .. ': alpha and beta must be numbers') end
  local act = o.act
  if act ~= nil and act ~= 'gelu_tanh' then raise(string.format("%s: act must be 'gelu_tanh', got %s", op, tostring(act))) end
  if act and (alpha ~= 1 or beta ~= 0) then raise(op .. ': act does not combine with alpha or beta') end
  local N = kshape[#kshape]
  local bias = o.bias
  if bias ~= nil then
    if not is_tensor(bias) then raise(op .. ': bias must be a tensor') end
    if bias.device ~= a.device then raise(string.format('%s: bias is on %s but a is on %s', op, bias.device, a.device)) end
    if bias.dtype ~= a.dtype then raise(string.format('%s: bias is %s but a is %s', op, bias.dtype, a.dtype)) end
    if bias:dim() ~= 1 or bias:size(1) ~= N then
      raise(string.format('%s: bias is %s but the product is %s (bias must be (%d))', op, shape_str(bias.shape),
        shape_str(rshape), N))
    end
    bias = bias:contiguous()
  elseif act then
    bias = gp.zeros({N}, {dtype = a.dtype, device = a.device})
  end
  local kout, result
  if out ~= nil then
    if shape_str(out.shape) ~= shape_str(rshape) then
      raise(string.format('%s: out is %s but the product is %s', op, shape_str(out.shape), shape_str(rshape)))
    end
    if out.device ~= a.device then raise(string.format('%s: out is on %s but a is on %s', op, out.device, a.device)) end
    if out.dtype ~= a.dtype then raise(string.format('%s: out is %s but a is %s', op, out.dtype, a.dtype)) end
    kout, result = map(out), out
  else
    if beta ~= 0 then raise(op .. ': beta needs out= (the tensor to accumulate into)') end
    kout = empty(kshape, a.dtype, a.device, op)
    result = kout:view(rshape)
  end
  if o.tf32 == nil then
    run(kout, A, B, bias, alpha, beta, act)
  else -- this call only: restore the switch even when the kernel fails
    local prev = option('tf32', o.tf32 and 1 or 0)
    local ok, err = pcall(run, kout, A, B, bias, alpha, beta, act)
    option('tf32', prev)
    if not ok then error(err, 0) end
  end
  return result
end

function gp.matmul(a, b, opts) return mm('matmul', a, b, opts) end
doc(gp.matmul, 'gp.matmul(a, b, {out=, bias=, alpha=1, beta=0, trans_a=, trans_b=, act=, tf32=})',
  "out = alpha * a @ b + beta * out + bias (act='gelu_tanh' applies GELU after the bias); 1-d x 2-d, 2-d x 1-d, 2-d x 2-d, 3-d x 3-d (batch 1 broadcasts), 3-d x 2-d, 2-d x 3-d; transposed views need no copy; beta needs out=")

function Tensor:matmul(b) return mm('matmul', self, b) end
doc(Tensor.matmul, 'a:matmul(b)', 'the matrix product a @ b (see gp.matmul)')

-- t's first element on a 16-byte boundary (16-bit dtypes)
local function aligned16(t)
  local c = t.c
  return tonumber(ffi.cast('uintptr_t', c.data) % 16) == 0 and tonumber(c.offset) % 8 == 0
end
-- gp.linear's few-rows kernels for bf16/f16 on the GPU, w (and b) contiguous, of x's dtype (gp.k.rows_linear):
-- one row in at most 1024 (a warp a row of w), or up to 16 rows with K a multiple of 32 and at most 4096 outputs
-- or a count of them that is not a multiple of 8 (tensor cores: x contiguous and aligned). Wider outputs (the LM
-- heads) and more rows stay on cuBLAS, which wins there (H200, 8 rows: 17.9 against 20.9 us at 576 -> 49152;
-- the tensor-core kernel 2.5 against 3.3 us at 576 -> 960), except for rows of outputs that are not 16-byte
-- aligned (GPT-2's 50257: the decode step at 8 rows 400 against 485 us)
local function rows_path(x, w, b, rows)
  local k, n = x:size(-1), w:size(1)
  return HALF[x.dtype] and w.dtype == x.dtype and x.device == 'cuda' and w.device == 'cuda' and w:is_contiguous() and
    (rows == 1 and k <= 1024 or
     rows <= 16 and k % 32 == 0 and (n <= 4096 or n % 8 ~= 0) and x:is_contiguous() and aligned16(x) and
       aligned16(w)) and
    (b == nil or (is_tensor(b) and b.dtype == x.dtype and b.device == 'cuda' and b:dim() == 1 and
      b:size(1) == w:size(1) and b:is_contiguous()))
end

local padded_outs = common.padded_outs

function gp.linear(x, w, b)
  if gp.is_quantized(w) then return gp.nf4_linear(x, w, b) end -- a quantized weight (ops/nf4.lua)
  if not is_tensor(x) then raise('linear: x must be a tensor') end
  if not is_tensor(w) then raise('linear: w must be a tensor') end
  if w:dim() ~= 2 then raise(string.format('linear: w must be 2-d (out, in), got %s', shape_str(w.shape))) end
  local sx = x.shape
  if #sx < 1 or sx[#sx] ~= w:size(2) then
    raise(string.format('linear: x is %s but w is %s (the last dim of x must be w:size(2))', shape_str(sx),
      shape_str(w.shape)))
  end
  local rows, oshape = 1, {}
  for i = 1, #sx - 1 do rows = rows * sx[i]; oshape[i] = sx[i] end
  oshape[#sx] = w:size(1)
  -- few rows (a decode step) of bf16/f16 on the GPU: gp.k.rows_linear (with a bias gp.k.rows_linear_bias)
  -- where rows_path says it beats cuBLAS. The gradient is linear's rule either way.
  if rows_path(x, w, b, rows) then
    local y = empty(oshape, x.dtype, x.device, 'linear')
    if b == nil then K.rows_linear(y:view {rows, w:size(1)}, x:reshape {rows, sx[#sx]}:contiguous(), w)
    else K.rows_linear_bias(y:view {rows, w:size(1)}, x:reshape {rows, sx[#sx]}:contiguous(), w, b, 0) end
    return y
  end
  local x2 = #sx == 2 and x or x:reshape {rows, sx[#sx]}
  local na = padded_outs(x, w:size(1))
  if na then
    local n = w:size(1)
    if b ~= nil and not (is_tensor(b) and b:dim() == 1 and b:size(1) == n) then
      raise(string.format('linear: b must be (%d) for w %s, got %s', n, shape_str(w.shape),
        is_tensor(b) and shape_str(b.shape) or type(b)))
    end
    local yp = empty({rows, na + 8}, x.dtype, x.device, 'linear')
    for _, p in ipairs(common.out_parts(n, na)) do
      local i, m = p[1], p[2]
      mm('linear', x2, w:narrow(1, i, m):t(), {bias = b and b:narrow(1, i, m), out = yp:narrow(2, i, m)})
    end
    return yp:narrow(2, 1, n):contiguous():view(oshape)
  end
  local y = mm('linear', x2, w:t(), {bias = b})
  return y:view(oshape)
end
doc(gp.linear, 'gp.linear(x, w, b)', 'x @ w^T + b with w (out, in) like torch; x (..., in); b (out) or nil; w may be a quantized weight (gp.quantize: then gp.nf4_linear); up to 16 rows of bf16/f16 on the GPU take gp.k.rows_linear where it beats cuBLAS; 16-bit outputs of a count (4096 or more) that is not a multiple of 8 run as two products into rows padded to a multiple of 8, forward and backward')

-- gp.lora_linear(x, w, b, A, B, s) = x w^T + b + s (x A^T) B^T: a LoRA
-- projection as one autograd node of three products, the adapter's added
-- into the base's output by the GEMM (alpha s, beta 1); it saves h = x A^T
-- (rows, rank). Backward: gh = s g B, dB = s g^T h, dA = gh^T x, dx = g w +
-- gh A (accumulated by the GEMM): no elementwise kernel and one node where
-- linear, linear, mul and add made four. w may be quantized (NF4).
local function lora_linear(x, w, b, A, B, s, save)
  local op = 'lora_linear'
  if not is_tensor(x) then raise(op .. ': x must be a tensor') end
  for _, nm in ipairs {{'A', A}, {'B', B}} do
    local t = nm[2]
    if not is_tensor(t) or t:dim() ~= 2 then raise(string.format('%s: %s must be a 2-d tensor', op, nm[1])) end
    if t.dtype ~= x.dtype or t.device ~= x.device then
      raise(string.format('%s: %s is %s on %s but x is %s on %s', op, nm[1], t.dtype, t.device, x.dtype, x.device))
    end
  end
  if type(s) ~= 'number' then raise(op .. ': the scaling s must be a number, got ' .. type(s)) end
  local ws = w and w.shape
  if not ws or #ws ~= 2 then raise(op .. ': w must be a 2-d weight (out, in)') end
  local O, I, r = ws[1], ws[2], A:size(1)
  local sx = x.shape
  if #sx < 1 or sx[#sx] ~= I or A:size(2) ~= I or B:size(1) ~= O or B:size(2) ~= r then
    raise(string.format('%s: x %s, w %s, A %s, B %s; needed: x (..., in), w (out, in), A (rank, in), B (out, rank)', op,
      shape_str(sx), shape_str(ws), shape_str(A.shape), shape_str(B.shape)))
  end
  local rows, oshape = 1, {}
  for i = 1, #sx - 1 do rows = rows * sx[i]; oshape[i] = sx[i] end
  oshape[#sx] = O
  local x2 = x:reshape {rows, I}
  local y = gp.linear(x2, w, b):contiguous()
  local h = x2:matmul(A:t())
  gp.matmul(h, B:t(), {out = y, alpha = s, beta = 1})
  if save then return y:view(oshape), h end
  return y:view(oshape)
end
function gp.lora_linear(x, w, b, A, B, s) return (lora_linear(x, w, b, A, B, s)) end
doc(gp.lora_linear, 'gp.lora_linear(x, w, b, A, B, s)',
  'x @ w^T + b + s (x @ A^T) @ B^T (a LoRA projection: w (out, in) dense or quantized, b (out) or nil, A (rank, in), B (out, rank)) as three products and one autograd node: the adapter\'s product is added by the GEMM, the backward has no elementwise kernel')

-- gp.lora_linear_group(x, ws, bs, As, Bs, s): n LoRA projections of one
-- input (q, k and v; gate and up) as one autograd node, y_i = x w_i^T + b_i
-- + s (x A_i^T) B_i^T. Forward: the base as ONE product when the w_i are
-- consecutive row blocks of one dense tensor (a Llama's fused weight; the
-- b_i likewise or concatenated), else one per projection (NF4); ONE product
-- h = x [A_1; ...; A_n]^T (the A_i row blocks of one tensor as gp.lora.apply
-- makes them, else concatenated), and each B_i's product added into its
-- output by the GEMM (alpha s, beta 1). The outputs are column blocks of one
-- (rows, sum of outs) tensor when the base was one product, else tensors of
-- their own. It saves h (rows, sum of ranks) and the concatenated A.
local function group_args(op, x, ws, bs, As, Bs, s)
  if not is_tensor(x) then raise(op .. ': x must be a tensor, got ' .. type(x)) end
  if not FLOAT[x.dtype] then raise(string.format('%s: x is %s; a float dtype (f32, bf16, f16, f64) is needed', op, x.dtype)) end
  for _, nl in ipairs {{'ws', ws}, {'As', As}, {'Bs', Bs}} do
    if type(nl[2]) ~= 'table' or is_tensor(nl[2]) or #nl[2] == 0 then
      raise(string.format('%s: %s must be a non-empty list, got %s', op, nl[1], is_tensor(nl[2]) and 'a tensor' or type(nl[2])))
    end
  end
  local n = #ws
  if #As ~= n or #Bs ~= n then
    raise(string.format('%s: %d weights, %d A and %d B given; one each per projection', op, n, #As, #Bs))
  end
  if bs ~= nil and (type(bs) ~= 'table' or is_tensor(bs)) then
    raise(op .. ': bs must be nil or a list of biases (entries may be nil)')
  end
  if type(s) ~= 'number' then raise(op .. ': the scaling s must be a number, got ' .. type(s)) end
  local sx = x.shape
  local I = sx[#sx]
  for i = 1, n do
    local w, b, A, B = ws[i], bs and bs[i], As[i], Bs[i]
    for _, nm in ipairs {{'A', A}, {'B', B}} do
      local t = nm[2]
      if not is_tensor(t) or t:dim() ~= 2 then raise(string.format('%s: %s[%d] must be a 2-d tensor', op, nm[1], i)) end
      if t.dtype ~= x.dtype or t.device ~= x.device then
        raise(string.format('%s: %s[%d] is %s on %s but x is %s on %s', op, nm[1], i, t.dtype, t.device, x.dtype, x.device))
      end
    end
    local q = gp.is_quantized(w)
    if not (q or (is_tensor(w) and w:dim() == 2)) then
      raise(string.format('%s: ws[%d] must be a 2-d weight (out, in), dense or quantized', op, i))
    end
    if not q and (w.dtype ~= x.dtype or w.device ~= x.device) then
      raise(string.format('%s: ws[%d] is %s on %s but x is %s on %s', op, i, w.dtype, w.device, x.dtype, x.device))
    end
    local O = w.shape[1]
    if #sx < 1 or w.shape[2] ~= I or A:size(2) ~= I or B:size(1) ~= O or B:size(2) ~= A:size(1) then
      raise(string.format('%s: projection %d: x %s, w %s, A %s, B %s; needed: x (..., in), w (out, in), A (rank, in), B (out, rank)',
        op, i, shape_str(sx), shape_str(w.shape), shape_str(A.shape), shape_str(B.shape)))
    end
    if b ~= nil and not (is_tensor(b) and b:dim() == 1 and b:size(1) == O and b.dtype == x.dtype and b.device == x.device) then
      raise(string.format('%s: bs[%d] must be a (%d) tensor of %s on %s, got %s', op, i, O, x.dtype, x.device,
        is_tensor(b) and (b.dtype .. ' ' .. shape_str(b.shape) .. ' on ' .. b.device) or type(b)))
    end
  end
  return n
end

-- the biases of a fused base product: nil (none), their span, or concatenated (zeros for the missing)
local function group_bias(bs, ws, n, x)
  if not bs then return nil end
  local any = false
  for i = 1, n do any = any or bs[i] ~= nil end
  if not any then return nil end -- (no zeros made to be thrown away: a fill each)
  local list = {}
  for i = 1, n do list[i] = bs[i] or gp.zeros({ws[i].shape[1]}, {dtype = x.dtype, device = x.device}) end
  return tensor.span(list, 1) or gp.cat(list, 1)
end

local function lora_group(x, ws, bs, As, Bs, s, save)
  local op = 'lora_linear_group'
  local n = group_args(op, x, ws, bs, As, Bs, s)
  local sx = x.shape
  local I = sx[#sx]
  local rows = 1
  for i = 1, #sx - 1 do rows = rows * sx[i] end
  local x2 = x:reshape {rows, I}
  local W = tensor.span(ws, 1) -- nil for quantized weights
  local ys, outs = {}, {}
  local function oshape(O)
    local o = {}
    for i = 1, #sx - 1 do o[i] = sx[i] end
    o[#sx] = O
    return o
  end
  if W then -- one product; the outputs are its column blocks
    local y = gp.linear(x2, W, group_bias(bs, ws, n, x))
    local yv, off = y:view(oshape(W:size(1))), 0
    for i = 1, n do
      local O = ws[i].shape[1]
      ys[i], outs[i] = y:narrow(2, off + 1, O), yv:narrow(#sx, off + 1, O)
      off = off + O
    end
  else
    for i = 1, n do
      ys[i] = gp.linear(x2, ws[i], bs and bs[i]):contiguous()
      outs[i] = ys[i]:view(oshape(ws[i].shape[1]))
    end
  end
  local Acat = tensor.span(As, 1) or gp.cat(As, 1)
  local h = x2:matmul(Acat:t())
  local off = 0
  for i = 1, n do
    local r = As[i]:size(1)
    gp.matmul(h:narrow(2, off + 1, r), Bs[i]:t(), {out = ys[i], alpha = s, beta = 1})
    off = off + r
  end
  if save then return {h = h, A = Acat, W = W}, outs end
  return outs
end

function gp.lora_linear_group(x, ws, bs, As, Bs, s) return unpack(lora_group(x, ws, bs, As, Bs, s)) end
doc(gp.lora_linear_group, 'gp.lora_linear_group(x, ws, bs, As, Bs, s)',
  'y_1, ..., y_n with y_i = x @ ws[i]^T + bs[i] + s (x @ As[i]^T) @ Bs[i]^T: n LoRA projections of one input (q, k, v; gate, up) as one autograd node; bs nil or a list (entries may be nil). One base product when the ws are consecutive row blocks of one dense tensor (else one each: quantized weights), one product x @ [As]^T for all the adapters (one tensor when the As are its row blocks, as gp.lora.apply makes them), one per B added by the GEMM; the backward makes one dA product and one dx product for the adapters')

-- gp.linear_group(x, ws, bs): y_i = x w_i^T + b_i, n projections of one
-- input (a SwiGLU MLP's gate and up) as one autograd node. When the w_i are
-- consecutive row blocks of one tensor (nn.SwiGLUMLP makes them so) and
-- there are no biases, ONE product, the outputs its column blocks; else one
-- gp.linear each. The backward makes dx one product when the g_i are column
-- blocks of one tensor (gp.swiglu's backward writes them so), else adds the
-- g_i w_i into one dx by the GEMMs (beta 1); the weights' gradients are one
-- product when their .grad are consecutive blocks too (the optimizer's flat
-- buffer in parameter order)
local function group_check(x, ws, bs)
  local op = 'linear_group'
  if not is_tensor(x) then raise(op .. ': x must be a tensor, got ' .. type(x)) end
  if type(ws) ~= 'table' or is_tensor(ws) or #ws == 0 then raise(op .. ': ws must be a non-empty list of weights') end
  if bs ~= nil and (type(bs) ~= 'table' or is_tensor(bs)) then raise(op .. ': bs must be nil or a list of biases') end
  local I = x.shape[#x.shape]
  for i, w in ipairs(ws) do
    if not is_tensor(w) or w:dim() ~= 2 or w:size(2) ~= I then
      raise(string.format('%s: ws[%d] must be a 2-d weight (out, %d) for x %s, got %s', op, i, I or 0,
        shape_str(x.shape), is_tensor(w) and shape_str(w.shape) or type(w)))
    end
  end
end
local function has_bias(bs) return bs ~= nil and next(bs) ~= nil end
function gp.linear_group(x, ws, bs)
  group_check(x, ws, bs)
  local ys = {}
  local W = not has_bias(bs) and #ws > 1 and tensor.span(ws, 1)
  if W then
    local y, n, off = gp.linear(x, W), x:dim(), 0
    for i, w in ipairs(ws) do
      ys[i] = y:narrow(n, off + 1, w:size(1))
      off = off + w:size(1)
    end
    return unpack(ys)
  end
  for i, w in ipairs(ws) do ys[i] = gp.linear(x, w, bs and bs[i]) end
  return unpack(ys)
end
doc(gp.linear_group, 'gp.linear_group(x, ws, bs)',
  'y_1, ..., y_n with y_i = x @ ws[i]^T + bs[i] (bs nil or a list whose entries may be nil): n projections of one input (a SwiGLU MLP\'s gate and up) as one autograd node. Without biases, when the ws are consecutive row blocks of one tensor, one product (the outputs its column blocks) and a backward of one dx product (when the gradients are column blocks of one tensor, as gp.swiglu makes them) and one weight-gradient product (when the .grad buffers are row blocks of one); else one product each and every g_i @ ws[i] added into one dx by the GEMMs')

-- gp.linear_gelu_linear(x, w1, b1, w2, b2) = gelu_tanh(x w1^T + b1) w2^T + b2:
-- two products, GELU in the first one's epilogue. With save (autograd's
-- forward, grad_rules.lua) it also returns h = gelu_tanh(pre) and pre (aux),
-- both (rows, hidden), from the GELU_AUX_BIAS epilogue.
local function lgl(x, w1, b1, w2, b2, save)
  local op = 'linear_gelu_linear'
  local names = {'x', 'w1', 'b1', 'w2', 'b2'}
  local args = {x, w1, b1, w2, b2}
  for i = 1, 5 do
    if not is_tensor(args[i]) then raise(string.format('%s: %s must be a tensor, got %s', op, names[i], type(args[i]))) end
    if args[i].device ~= x.device then
      raise(string.format('%s: %s is on %s but x is on %s', op, names[i], args[i].device, x.device))
    end
    if args[i].dtype ~= x.dtype then raise(string.format('%s: %s is %s but x is %s', op, names[i], args[i].dtype, x.dtype)) end
  end
  if not FLOAT[x.dtype] then raise(string.format('%s: x is %s; a float dtype (f32, bf16, f16, f64) is needed', op, x.dtype)) end
  local sx = x.shape
  local s1, s2 = w1.shape, w2.shape
  local H, D, D2 = s1[1], s1[2], s2[1]
  if #s1 ~= 2 or #s2 ~= 2 or #sx < 1 or sx[#sx] ~= D or s2[2] ~= H or b1:dim() ~= 1 or b1:size(1) ~= H
    or b2:dim() ~= 1 or b2:size(1) ~= D2 then
    raise(string.format('%s: x %s, w1 %s, b1 %s, w2 %s, b2 %s; needed: x (..., d), w1 (hidden, d), b1 (hidden), w2 (d2, hidden), b2 (d2)',
      op, shape_str(sx), shape_str(w1.shape), shape_str(b1.shape), shape_str(w2.shape), shape_str(b2.shape)))
  end
  local rows, oshape = 1, {}
  for i = 1, #sx - 1 do rows = rows * sx[i]; oshape[i] = sx[i] end
  oshape[#sx] = D2
  local x2 = x:reshape {rows, D}
  local h = empty({rows, H}, x.dtype, x.device, op)
  if not save and rows_path(x, w1, b1, rows) then -- a decode step: GELU in the few-rows kernel's epilogue
    K.rows_linear_bias(h, x2:contiguous(), w1, b1, 1)
    return gp.linear(h, w2, b2):view(oshape), h
  end
  local aux
  if save then
    aux = empty({rows, H}, x.dtype, x.device, op)
    gp.k.matmul_bias_gelu_aux(h, aux, x2, w1:t(), b1:contiguous())
  else
    gp.k.matmul_bias_gelu_tanh(h, x2, w1:t(), b1:contiguous())
  end
  local y = empty({rows, D2}, x.dtype, x.device, op)
  gp.k.matmul_bias(y, h, w2:t(), b2:contiguous(), 1, 0)
  return y:view(oshape), h, aux
end

function gp.linear_gelu_linear(x, w1, b1, w2, b2) return (lgl(x, w1, b1, w2, b2)) end
doc(gp.linear_gelu_linear, 'gp.linear_gelu_linear(x, w1, b1, w2, b2)',
  'gelu_tanh(x @ w1^T + b1) @ w2^T + b2 (a GELU MLP) with x (..., d), w1 (hidden, d), b1 (hidden), w2 (d2, hidden), b2 (d2): GELU in the first GEMM\'s epilogue; one autograd node that saves the pre-activation from the forward GEMM (GELU_AUX_BIAS) and applies gelu\' in the epilogue of the backward GEMM (DGELU)')
-- for autograd's forward: y, h and the pre-activation (rows, hidden)
function gp._linear_gelu_linear_saved(x, w1, b1, w2, b2) return lgl(x, w1, b1, w2, b2, true) end

---------------------------------------------------------------------------
-- matrix products: y = alpha * A @ B (+ bias), with A, B of 1 to 3 dims
-- (a 2-d operand broadcast over the other's batch, or a batch of 1)

-- gradients of the effective operands A and B (as multiplied) from g
local function mm_grads(g, Aop, Bop, alpha, needA, needB)
  if alpha ~= 1 then g = g * alpha end
  local A2, B2, g2 = Aop, Bop, g
  if Aop:dim() == 1 then A2 = Aop:unsqueeze(1); g2 = g2:unsqueeze(-2) end
  if Bop:dim() == 1 then B2 = Bop:unsqueeze(2); g2 = g2:unsqueeze(-1) end
  local dA, dB
  if needA then
    dA = g2:matmul(B2:transpose(-1, -2)) -- 2x2, 3x3 (broadcast), 3x2, 3x3 for 2-d A (summed by accumulate)
    if Aop:dim() == 1 then dA = dA:reshape(Aop.shape) end
  end
  if needB then
    if A2:dim() == 3 and B2:dim() == 2 then -- one GEMM over every row of the batch
      local s = A2.shape
      local rows = s[1] * s[2]
      dB = A2:reshape {rows, s[3]}:t():matmul(g2:reshape {rows, g2:size(-1)})
    else
      dB = A2:transpose(-1, -2):matmul(g2)
    end
    if Bop:dim() == 1 then dB = dB:reshape(Bop.shape) end
  end
  return dA, dB
end

local function bias_grad(g)
  local N = g:size(-1)
  return g:reshape {g:numel() / math.max(N, 1), N}:sum(1)
end

autograd.def_method('matmul', function(g, a)
  return mm_grads(g[1], a[1], a[2], 1, autograd.needs(a[1]), autograd.needs(a[2]))
end)

autograd.def_function('matmul', function(g, a, out)
  local x, y, o = a[1], a[2], a[3] or {}
  local gy = g[1]
  if o.act then -- recompute the pre-activation (the forward kept only gelu's output)
    local pre = gp.matmul(x, y, {bias = o.bias, trans_a = o.trans_a, trans_b = o.trans_b, tf32 = o.tf32})
    local d = empty(pre.shape, pre.dtype, pre.device, 'matmul')
    K.gelu_tanh_bwd(d, pre, like(gy, pre))
    gy = d
  end
  local Aop = o.trans_a and x:transpose(-1, -2) or x
  local Bop = o.trans_b and y:transpose(-1, -2) or y
  local dA, dB = mm_grads(gy, Aop, Bop, o.alpha or 1, autograd.needs(x), autograd.needs(y))
  if dA and o.trans_a then dA = dA:transpose(-1, -2) end
  if dB and o.trans_b then dB = dB:transpose(-1, -2) end
  local db
  if o.bias and autograd.needs(o.bias) then db = bias_grad(gy) end
  if db then return dA, dB, {bias = db} end
  return dA, dB
end, {check = function(_, _, o)
  if type(o) == 'table' and (o.out ~= nil or (o.beta or 0) ~= 0) then
    raise('matmul: out= and beta are not differentiable (call it under gp.no_grad, or without out=)')
  end
end})

-- a cached ones vector (rows) for bias gradients as one GEMV into .grad; none
-- is made while a graph is being captured (it would live in the graph's pool)
local ones_cache = {}
local function ones_col(rows, dt, dev)
  local key = rows .. dt .. dev
  local o = ones_cache[key]
  if not o and not graph.capturing then
    o = gp.ones({rows}, {dtype = dt, device = dev})
    ones_cache[key] = o
  end
  return o
end

-- the gradient of a weight w (out, in) of a product g2 = x2 w^T, g2 (rows,
-- out), x2 (rows, in): alpha g2^T x2 (alpha default 1) accumulated into
-- w.grad by the GEMM (nil returned) where there is one to accumulate into,
-- else returned
local function weight_grad(w, g2, x2, alpha)
  if not autograd.needs(w) then return nil end
  local gw = x2.dtype == g2.dtype and grad_buffer(w, g2.dtype, g2.device)
  if gw then gp.matmul(g2:t(), x2, {out = gw, beta = 1, alpha = alpha}); return nil end
  return gp.matmul(g2:t(), x2, {alpha = alpha})
end

-- the gradient of a bias b (out) from g2 (rows, out), the same way
local function bias_grad_into(b, g2)
  if not (b and autograd.needs(b)) then return nil end
  local gb = grad_buffer(b, g2.dtype, g2.device)
  local ones = gb and ones_col(g2:size(1), g2.dtype, g2.device)
  if ones then -- db += g2^T 1: one GEMV instead of a column sum and an add
    gp.matmul(g2:t(), ones, {out = gb, beta = 1, tf32 = g2.dtype == 'f32' and false or nil})
    return nil
  end
  return g2:sum(1)
end

-- gp.linear(x, w, b): x (..., in) @ w^T + b, w (out, in)
autograd.def_function('linear', function(g, a)
  local x, w, b = a[1], a[2], a[3]
  if not is_tensor(w) then return gp._nf4_linear_backward(g, a) end -- a quantized weight
  local O, I = w:size(1), w:size(2)
  local rows = x:numel() / math.max(I, 1)
  local g2 = g[1]:reshape {rows, O}
  local na = padded_outs(x, O)
  if not na then
    local dx
    if autograd.needs(x) then dx = g2:matmul(w):reshape(x.shape) end
    return dx, weight_grad(w, g2, x:reshape {rows, I}), bias_grad_into(b, g2)
  end
  -- (padded_outs) the gradient into rows padded to a multiple of 8, each product in two parts
  local gq = empty({rows, na + 8}, g2.dtype, g2.device, 'linear'):narrow(2, 1, O)
  K.copy(gq, g2)
  local parts, x2 = common.out_parts(O, na), x:reshape {rows, I}
  local dx, dw
  if autograd.needs(x) then
    dx = empty({rows, I}, x.dtype, x.device, 'linear')
    for k, p in ipairs(parts) do
      gp.matmul(gq:narrow(2, p[1], p[2]), w:narrow(1, p[1], p[2]), {out = dx, beta = k - 1})
    end
    dx = dx:reshape(x.shape)
  end
  if autograd.needs(w) then
    local gw = x2.dtype == gq.dtype and grad_buffer(w, gq.dtype, gq.device)
    if not gw then dw = empty(w.shape, gq.dtype, gq.device, 'linear') end
    for _, p in ipairs(parts) do
      gp.matmul(gq:narrow(2, p[1], p[2]):t(), x2, {out = (gw or dw):narrow(1, p[1], p[2]), beta = gw and 1 or 0})
    end
  end
  return dx, dw, bias_grad_into(b, gq)
end)

-- gp.linear_group's rule (its forward above)
autograd.def_function('linear_group', function(g, a)
  local x, ws, bs = a[1], a[2], a[3]
  local I = x:size(-1)
  local rows = x:numel() / math.max(I, 1)
  local x2 = x:reshape {rows, I}
  local g2, allg = {}, #ws > 1
  for i, w in ipairs(ws) do
    if g[i] then g2[i] = tensor.to_dtype(g[i], x.dtype):reshape {rows, w:size(1)} else allg = false end
  end
  -- the g_i as column blocks of one (rows, sum of outs) tensor, and the w_i as row blocks of one
  local G = allg and tensor.span(g2, 2)
  local W = G and tensor.span(ws, 1)
  local dx
  if autograd.needs(x) then
    if W then
      dx = G:matmul(W)
    else
      for i, w in ipairs(ws) do
        if g2[i] then
          if dx then gp.matmul(g2[i], w, {out = dx, beta = 1}) else dx = g2[i]:matmul(w) end
        end
      end
    end
    if dx then dx = dx:reshape(x.shape) end
  end
  local dws, dbs = {}, {}
  if W and not has_bias(bs) then -- the weights' gradients as one product when their buffers are row blocks of one
    local gws = {}
    local all = x2.dtype == G.dtype
    for i, w in ipairs(ws) do
      gws[i] = all and autograd.needs(w) and grad_buffer(w, G.dtype, G.device)
      all = all and gws[i]
    end
    local GW = all and tensor.span(gws, 1)
    if GW then
      gp.matmul(G:t(), x2, {out = GW, beta = 1})
      return dx, dws, dbs
    end
  end
  for i, w in ipairs(ws) do
    if g2[i] then dws[i], dbs[i] = weight_grad(w, g2[i], x2), bs and bias_grad_into(bs[i], g2[i]) end
  end
  return dx, dws, dbs
end)

-- gp.linear_gelu_linear(x, w1, b1, w2, b2) = gelu_tanh(x w1^T + b1) w2^T + b2.
-- The forward saves h (rows, hidden) and the pre-activation pre (the GEMM's
-- GELU_AUX_BIAS epilogue); backward: dw2 = g^T h, db2, dpre = (g w2) *
-- gelu_tanh'(pre) in one GEMM (DGELU epilogue), dw1 = dpre^T x, db1, dx = dpre w1.
autograd.def_function('linear_gelu_linear', function(g, a, _, saved)
  local x, w1, b1, w2, b2 = a[1], a[2], a[3], a[4], a[5]
  local D, H, D2 = w1:size(2), w1:size(1), w2:size(1)
  local rows = x:numel() / math.max(D, 1)
  local g2 = tensor.to_dtype(g[1], x.dtype):reshape {rows, D2}
  local dw2, db2 = weight_grad(w2, g2, saved.h), bias_grad_into(b2, g2)
  local dx, dw1, db1
  if autograd.needs(x) or autograd.needs(w1) or autograd.needs(b1) then
    local dpre = empty({rows, H}, x.dtype, x.device, 'linear_gelu_linear')
    K.matmul_dgelu(dpre, g2, w2, saved.aux)
    if autograd.needs(x) then dx = dpre:matmul(w1):reshape(x.shape) end
    dw1, db1 = weight_grad(w1, dpre, x:reshape {rows, D}), bias_grad_into(b1, dpre)
  end
  return dx, dw1, db1, dw2, db2
end, {
  forward = function(_, x, w1, b1, w2, b2)
    local y, h, aux = gp._linear_gelu_linear_saved(x, w1, b1, w2, b2)
    return {h = h, aux = aux}, y
  end,
})

autograd.def_function('lora_linear', function(g, a, _, saved)
  local x, w, b, A, B, s = a[1], a[2], a[3], a[4], a[5], a[6]
  local O, I = w.shape[1], w.shape[2]
  local rows = x:numel() / math.max(I, 1)
  local g2 = tensor.to_dtype(g[1], x.dtype):reshape {rows, O}:contiguous()
  local x2 = x:reshape {rows, I}
  local dB = weight_grad(B, g2, saved.h, s)
  local gh
  if autograd.needs(A) or autograd.needs(x) then gh = gp.matmul(g2, B, {alpha = s}) end
  local dA = autograd.needs(A) and weight_grad(A, gh, x2) or nil
  local dx, dw, db
  if gp.is_quantized(w) then
    dx, _, db = gp._nf4_linear_backward({g2}, {x, w, b})
    if dx then dx = dx:reshape {rows, I} end
  else
    if autograd.needs(x) then dx = g2:matmul(w) end
    dw, db = weight_grad(w, g2, x2), bias_grad_into(b, g2)
  end
  if dx then
    dx = dx:contiguous()
    gp.matmul(gh, A, {out = dx, beta = 1})
    dx = dx:reshape(x.shape)
  end
  return dx, dw, db, dA, dB
end, {
  forward = function(_, x, w, b, A, B, s)
    local y, h = lora_linear(x, w, b, A, B, s, true)
    return {h = h}, y
  end,
})

-- gp.lora_linear_group: per adapter dh_i = s g_i B_i (into its column block
-- of dh (rows, sum of ranks)) and dB_i = s g_i^T h_i; then ONE product dA =
-- dh^T x for the concatenated A (added by the GEMM into the A's .grad when
-- those are row blocks of one tensor, as an optimizer's flat buffer holds
-- them when gp.lora.parameters lists them side by side; else returned as
-- row blocks), and dx = g W over the base (one product when the g_i are
-- column blocks of one tensor and the base is one dense tensor, else one per
-- projection, accumulated) plus dh A added by the GEMM. A frozen base gets
-- no gradient; a trainable dense one gets dw_i = g_i^T x and db_i.
autograd.def_function('lora_linear_group', function(g, a, _, saved)
  local x, ws, bs, As, Bs, s = a[1], a[2], a[3], a[4], a[5], a[6]
  local n, I = #ws, x:size(-1)
  local rows = x:numel() / math.max(I, 1)
  local x2 = x:reshape {rows, I}
  local g2, allg = {}, true
  for i = 1, n do
    if g[i] then g2[i] = tensor.to_dtype(g[i], x.dtype):reshape {rows, ws[i].shape[1]} else allg = false end
  end
  local h = saved.h
  local dBs, roff = {}, {}
  local off = 0
  for i = 1, n do
    roff[i] = off
    if g2[i] then dBs[i] = weight_grad(Bs[i], g2[i], h:narrow(2, off + 1, As[i]:size(1)), s) end
    off = off + As[i]:size(1)
  end
  local needA, needx = false, autograd.needs(x)
  for i = 1, n do needA = needA or autograd.needs(As[i]) end
  local dh
  if needA or needx then
    dh = empty({rows, off}, x.dtype, x.device, 'lora_linear_group')
    for i = 1, n do
      local blk = dh:narrow(2, roff[i] + 1, As[i]:size(1))
      if g2[i] then gp.matmul(g2[i], Bs[i], {out = blk, alpha = s}) else blk:zero_() end
    end
  end
  local dAs
  if needA then
    local gs, all = {}, true
    for i = 1, n do
      gs[i] = grad_buffer(As[i], x.dtype, x.device)
      all = all and gs[i] and autograd.needs(As[i])
    end
    local G = all and tensor.span(gs, 1)
    if G then
      gp.matmul(dh:t(), x2, {out = G, beta = 1})
    else
      local dA = dh:t():matmul(x2)
      dAs = {}
      for i = 1, n do
        if autograd.needs(As[i]) then dAs[i] = dA:narrow(1, roff[i] + 1, As[i]:size(1)) end
      end
    end
  end
  local dx
  if needx then
    local G = saved.W and allg and tensor.span(g2, 2)
    if G then
      dx = G:matmul(saved.W)
    else
      dx = empty({rows, I}, x.dtype, x.device, 'lora_linear_group')
      local acc = false
      for i = 1, n do
        if g2[i] then
          if gp.is_quantized(ws[i]) then gp._nf4_dx_into(dx, g2[i], ws[i], acc)
          else gp.matmul(g2[i], ws[i], {out = dx, beta = acc and 1 or 0}) end
          acc = true
        end
      end
      if not acc then dx:zero_() end
    end
    gp.matmul(dh, saved.A, {out = dx, beta = 1})
    dx = dx:reshape(x.shape)
  end
  local dws, dbs = {}, {}
  for i = 1, n do
    if g2[i] then
      if is_tensor(ws[i]) then dws[i] = weight_grad(ws[i], g2[i], x2) end
      if bs and bs[i] ~= nil then dbs[i] = bias_grad_into(bs[i], g2[i]) end
    end
  end
  return dx, dws, dbs, dAs, dBs
end, {
  forward = function(_, x, ws, bs, As, Bs, s)
    local saved, outs = lora_group(x, ws, bs, As, Bs, s, true)
    return saved, unpack(outs)
  end,
})

return gp
