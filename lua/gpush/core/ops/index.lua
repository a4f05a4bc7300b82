-- index ops: embedding, gather, index_select, scatter_add. Dims are 1-based
-- (negative from the end); index values are 0-based. An out-of-range index is
-- an error naming the op, the index and the size (on the GPU it is read back
-- after the kernel: one small device-to-host copy, which waits for the GPU).
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local gp = require 'gpush.core.ns'
local autograd = require 'gpush.core.autograd'
local raise = rt.raise
local common = require 'gpush.core.ops.common'
local like = common.like
local Tensor, is_tensor, empty, shape_str, dim0 = tensor.Tensor, tensor.is_tensor, tensor.empty, tensor.shape_str, tensor.dim0
local doc = gp.doc

local function need(op, t, what)
  if not is_tensor(t) then raise(string.format('%s: %s must be a tensor, got %s', op, what, type(t))) end
end
local function need_index(op, idx, x)
  need(op, idx, 'idx')
  if idx.dtype ~= 'i32' and idx.dtype ~= 'i64' then
    raise(string.format('%s: idx is %s but i32 or i64 indices are needed', op, idx.dtype))
  end
  if idx.device ~= x.device then
    raise(string.format('%s: idx is on %s but the tensor is on %s (move one with :to())', op, idx.device, x.device))
  end
end

-- t viewed as [A, B, C] around dim d0 (0-based): B = size of d0
local function as3(t, d0)
  local s, A, C = t.shape, 1, 1
  for i = 1, d0 do A = A * s[i] end
  for i = d0 + 2, #s do C = C * s[i] end
  return t:reshape {A, s[d0 + 1], C}
end

function gp.embedding(weight, idx)
  need('embedding', weight, 'weight')
  if weight:dim() ~= 2 then raise('embedding: weight must be 2-d (rows, dim), got ' .. shape_str(weight.shape)) end
  need_index('embedding', idx, weight)
  local s = idx.shape
  s[#s + 1] = weight:size(2)
  local out = empty(s, weight.dtype, weight.device, 'embedding')
  gp.k.embedding(out, weight:contiguous(), idx:contiguous())
  return out
end
doc(gp.embedding, 'gp.embedding(weight, idx)', 'rows of weight (V, D) picked by idx (any shape, 0-based): shape idx.shape..(D)')

function gp.embedding_backward(dout, idx, num_rows)
  need('embedding_backward', dout, 'dout')
  need_index('embedding_backward', idx, dout)
  if type(num_rows) ~= 'number' then raise('embedding_backward: num_rows (the weight rows, V) must be a number') end
  local out = empty({num_rows, dout:size(-1)}, dout.dtype, dout.device, 'embedding_backward')
  gp.k.embedding_backward(out, dout:contiguous(), idx:contiguous())
  return out
end
doc(gp.embedding_backward, 'gp.embedding_backward(dout, idx, V)',
  'the weight gradient (V, D) of gp.embedding: dout rows summed into the rows idx names')

-- torch.gather: out[i][j][k] = x[i][idx[i][j][k]][k] for dim 2, and so on;
-- idx has x's dims and sizes except along dim
function Tensor:gather(dim, idx)
  need_index('gather', idx, self)
  local d0 = dim0(self, dim, 'gather')
  local xs, is = self.shape, idx.shape
  local ok = #xs == #is
  for i = 1, #xs do if ok and i ~= d0 + 1 and xs[i] ~= is[i] then ok = false end end
  if not ok then
    raise(string.format('gather: idx is %s but x is %s (they must agree except along dim %d)', shape_str(is),
      shape_str(xs), d0 + 1))
  end
  local out = empty(is, self.dtype, self.device, 'gather')
  gp.k.gather(as3(out, d0), as3(self, d0), as3(idx:contiguous(), d0))
  return out
end
doc(Tensor.gather, 'x:gather(dim, idx)', 'torch.gather: out[..i..] = x[..idx[..i..]..] along dim (0-based index values)')

function Tensor:index_select(dim, idx)
  need_index('index_select', idx, self)
  if idx:dim() > 1 then raise('index_select: idx must be 1-d, got ' .. shape_str(idx.shape)) end
  local d0 = dim0(self, dim, 'index_select')
  local s = self.shape
  s[d0 + 1] = idx:numel()
  local out = empty(s, self.dtype, self.device, 'index_select')
  gp.k.index_select(as3(out, d0), as3(self, d0), idx:contiguous():reshape {idx:numel()})
  return out
end
doc(Tensor.index_select, 'x:index_select(dim, idx)', 'the slices of x along dim named by the 1-d idx (0-based)')

local function scatter_args(op, x, dim, idx, src)
  need_index(op, idx, x)
  need(op, src, 'src')
  local d0 = dim0(x, dim, op)
  local xs, is, ss = x.shape, idx.shape, src.shape
  local ok = #xs == #is and shape_str(is) == shape_str(ss)
  for i = 1, #xs do if ok and i ~= d0 + 1 and xs[i] ~= is[i] then ok = false end end
  if not ok then
    raise(string.format('%s: x is %s, idx %s, src %s (idx and src must be equal, and agree with x except along dim %d)',
      op, shape_str(xs), shape_str(is), shape_str(ss), d0 + 1))
  end
  return d0
end

-- x:scatter_add(dim, idx, src): a copy of x with src[..i..] added at x[..idx[..i..]..] (gather's adjoint)
function Tensor:scatter_add(dim, idx, src)
  local d0 = scatter_args('scatter_add', self, dim, idx, src)
  local out = empty(self.shape, self.dtype, self.device, 'scatter_add')
  gp.k.scatter_add(as3(out, d0), as3(self, d0), as3(idx:contiguous(), d0), as3(src, d0))
  return out
end
doc(Tensor.scatter_add, 'x:scatter_add(dim, idx, src)',
  "a copy of x with src added at the positions idx names along dim (torch's scatter_add; the adjoint of gather)")

function Tensor:scatter_add_(dim, idx, src)
  local d0 = scatter_args('scatter_add_', self, dim, idx, src)
  if not self:is_contiguous() then return self:copy_(self:scatter_add(dim, idx, src)) end
  local x3 = as3(self, d0)
  gp.k.scatter_add(x3, x3, as3(idx:contiguous(), d0), as3(src, d0))
  return self
end
doc(Tensor.scatter_add_, 'x:scatter_add_(dim, idx, src)', 'scatter_add in place')

---------------------------------------------------------------------------
-- index ops

-- the weight's gradient is added into its kept .grad where it has one (a GPT's
-- tied head has put its own there): no (V, D) tensor and add
autograd.def_function('embedding', function(g, a)
  local w, idx = a[1], a[2]
  local gw = common.grad_buffer(w, w.dtype, w.device)
  if gw and is_tensor(idx) then
    need_index('embedding_backward', idx, w)
    gp.k.embedding_backward(gw, like(g[1], w), idx:contiguous(), 1)
    return nil
  end
  return gp.embedding_backward(like(g[1], w), idx, w:size(1))
end)

autograd.def_method('gather', function(g, a)
  local x, d, idx = a[1], a[2], a[3]
  return gp.zeros_like(x):scatter_add(d, idx, g[1])
end)

autograd.def_method('index_select', function(g, a)
  local x, d, idx = a[1], a[2], a[3]
  local d0 = tensor.dim0(x, d, 'index_select') + 1
  local vs = {}
  for i = 1, x:dim() do vs[i] = 1 end
  vs[d0] = idx:numel()
  local gi = g[1]
  return gp.zeros_like(x):scatter_add(d, idx:reshape(vs):expand(gi.shape), gi)
end)

autograd.def_method('scatter_add', function(g, a)
  local d, idx, src = a[2], a[3], a[4]
  return g[1], nil, nil, is_tensor(src) and autograd.needs(src) and g[1]:gather(d, idx) or nil
end)

return gp
