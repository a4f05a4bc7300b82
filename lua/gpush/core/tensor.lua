-- Tensor: a Lua object around a gp_tensor* (field c). Methods return new
-- tensors; methods ending in _ work in place. Dims are 1-based, negative dims
-- count from the end.
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local dtype = require 'gpush.core.dtype'
local suggest = require 'gpush.core.suggest'
local C = rt.C
local DT, DTNAME, DEV, DEVNAME, ELSIZE, FLOAT = dtype.DT, dtype.DTNAME, dtype.DEV, dtype.DEVNAME, dtype.ELSIZE, dtype.FLOAT
local raise, call = rt.raise, rt.call

local Tensor = {}          -- methods
local mt = {__name = 'gp.Tensor'}
local M = {Tensor = Tensor, mt = mt}

local state = {device = nil}   -- default device, set by init
M.state = state

local box = ffi.new('gp_tensor*[1]')
-- the most dims a tensor has (GP_MAX_DIMS: the length of gp_tensor.shape)
local MAX_DIMS = ffi.sizeof(ffi.new('gp_tensor').shape) / ffi.sizeof('int64_t')
M.MAX_DIMS = MAX_DIMS
local shape_buf = ffi.new('int64_t[?]', MAX_DIMS)
local stride_buf = ffi.new('int64_t[?]', MAX_DIMS)
local perm_buf = ffi.new('int[?]', MAX_DIMS)

-- an integer argument, exactly representable (|v| < 2^53): fractions are an
-- error, never truncated, and nothing out of range reaches an int64_t
local function int_arg(op, what, v)
  if type(v) ~= 'number' or v ~= math.floor(v) or v >= 2^53 or v <= -2^53 then
    raise(string.format('%s: %s must be an integer, got %s', op, what, tostring(v)))
  end
  return v
end
M.int_arg = int_arg

-- the sizes (and strides) of a new geometry into the C buffers: at most
-- MAX_DIMS of them, every one an integer
local function fill_dims(op, s, st)
  if #s > MAX_DIMS then
    raise(string.format('%s: the result would have %d dims; at most %d are supported', op, #s, MAX_DIMS))
  end
  for i = 1, #s do
    shape_buf[i - 1] = int_arg(op, 'size ' .. i, s[i])
    if st then stride_buf[i - 1] = int_arg(op, 'stride ' .. i, st[i]) end
  end
  return #s
end

local function is_tensor(x) return getmetatable(x) == mt end
M.is_tensor = is_tensor

local function wrap(c) return setmetatable({c = c}, mt) end
M.wrap = wrap

local function shape_str(s)
  local parts = {}
  for i = 1, #s do parts[i] = tostring(s[i]) end
  return '(' .. table.concat(parts, ',') .. ')'
end
M.shape_str = shape_str

local function shape_of(t)
  local c, s = t.c, {}
  for i = 0, c.ndim - 1 do s[i + 1] = tonumber(c.shape[i]) end
  return s
end

-- shapes given as a table {2,3} or as numbers (2, 3); returns shape, rest
local function parse_shape(op, ...)
  local a = ...
  local s, rest
  if type(a) == 'table' and not is_tensor(a) then
    s, rest = a, select(2, ...)
  else
    s = {}
    local n = select('#', ...)
    local i = 1
    while i <= n do
      local v = select(i, ...)
      if type(v) ~= 'number' then break end
      s[#s + 1] = v
      i = i + 1
    end
    rest = select(i, ...)
  end
  if #s > MAX_DIMS then raise(string.format('%s: %d dims given; at most %d are supported', op, #s, MAX_DIMS)) end
  for i = 1, #s do
    local v = s[i]
    if type(v) == 'string' then
      raise(string.format("%s: size '%s' at dim %d is a string, not a number (write %s, or convert with tonumber)", op, v, i,
        tonumber(v) and v or 'an integer'))
    elseif type(v) ~= 'number' then
      raise(string.format('%s: size at dim %d is a %s, not a number', op, i, type(v)))
    elseif v ~= math.floor(v) or v >= 2^53 or v <= -2^53 then
      raise(string.format('%s: size %s at dim %d is not an integer', op, tostring(v), i))
    end
  end
  return s, rest
end
M.parse_shape = parse_shape

-- a device spelling -> 'cpu' or 'cuda'. 'cuda:N' names the GPU this process
-- uses (one per process: GPUSH_CUDA_DEVICE or LOCAL_RANK picks it); another N
-- is an error. Without a usable GPU, 'cuda:N' is 'cuda' (which then says why).
local function device_name(name, op)
  if DEV[name] then return name end
  local n = type(name) == 'string' and name:match('^cuda:(%d+)$')
  if n then
    n = tonumber(n)
    if C.gp_cuda_available() == 1 then
      local cur = C.gp_cuda_current_device()
      if n ~= cur then
        raise(string.format('%s: %s asked for, but this process uses cuda:%d (gpush uses one GPU per process: pick GPU %d with GPUSH_CUDA_DEVICE=%d or CUDA_VISIBLE_DEVICES=%d)',
          op, name, cur, n, n, n))
      end
    end
    return 'cuda'
  end
  raise(string.format("%s: unknown device '%s' (cpu, cuda or cuda:N)", op, tostring(name)))
end
M.device_name = device_name
local function is_device(x) return DEV[x] ~= nil or (type(x) == 'string' and x:match('^cuda:%d+$') ~= nil) end

local function device_of(name, op)
  return DEV[device_name(name, op)]
end

local function numel_of(s)
  local n = 1
  for i = 1, #s do n = n * s[i] end
  return n
end

-- a new uninitialized tensor
local function empty(shape, dt_name, device, op)
  op = op or 'empty'
  local dt = DT[rt.dtype(dt_name, op)]
  local dev = device_of(device, op)
  if dev == 1 and C.gp_cuda_available() ~= 1 then raise(op .. ': device cuda asked for but ' .. rt.last_error()) end
  local n = fill_dims(op, shape)
  local rc = C.gp_tensor_empty(box, dt, dev, n, shape_buf)
  if rc ~= 0 then rt.fail(rc, C.gp_tensor_empty, box, dt, dev, n, shape_buf) end
  local c = ffi.gc(box[0], C.gp_tensor_free)
  rt.gc_account(numel_of(shape) * ELSIZE[dt])
  return wrap(c)
end
M.empty = empty

local function alias(t)
  call(C.gp_tensor_alias, box, t.c)
  return wrap(ffi.gc(box[0], C.gp_tensor_free))
end

-- normalize a 1-based (or negative) dim to 0-based
local function dim0(t, d, op, extra)
  local n = t.c.ndim + (extra or 0)
  if type(d) ~= 'number' or d ~= math.floor(d) then raise(string.format('%s: dim must be an integer, got %s', op, tostring(d))) end
  local r = d < 0 and n + d or d - 1
  if r < 0 or r >= n then
    raise(string.format('%s: dim %d out of range for a tensor of shape %s (dims 1..%d or -%d..-1)', op, d,
      shape_str(shape_of(t)), n, n))
  end
  return r
end
M.dim0 = dim0

---------------------------------------------------------------------------
-- fields

-- the fields besides the methods: computed ones, then raw ones that may be
-- absent (nil when so); any other name is an error with a suggestion
M.fields = {'shape', 'dtype', 'device', 'ndim', 'c', 'grad'}
local index_get, index_set -- t[i] and t[i] = v, below

local function no_such(t, k)
  local names = {}
  for n in pairs(Tensor) do names[#names + 1] = n end
  for _, n in ipairs(M.fields) do names[#names + 1] = n end
  raise(string.format("tensor: no method or field '%s'%s (help(t) lists the methods)", tostring(k),
    suggest.hint(k, names)))
end

mt.__index = function(t, k)
  local m = Tensor[k]
  if m ~= nil then return m end
  if k == 'shape' then return shape_of(t)
  elseif k == 'dtype' then return DTNAME[t.c.dtype]
  elseif k == 'device' then return DEVNAME[t.c.device]
  elseif k == 'ndim' then return t.c.ndim
  end
  local ty = type(k)
  if ty == 'number' then return index_get(t, k) end
  -- .grad before backward, and internal fields (_rg, _node, ...) not set
  if k == 'grad' or (ty == 'string' and k:byte(1) == 95) then return nil end
  no_such(t, k)
end

local READONLY = {shape = 'view or reshape', dtype = 'to', device = 'to', ndim = 'view or reshape'}
mt.__newindex = function(t, k, v)
  if type(k) == 'number' then return index_set(t, k, v) end
  local how = READONLY[k]
  if how then raise(string.format('tensor: t.%s cannot be assigned (make a new tensor with t:%s)', k, how)) end
  rawset(t, k, v)
end

function Tensor:size(d)
  if d == nil then return shape_of(self) end
  return tonumber(self.c.shape[dim0(self, d, 'size')])
end
function Tensor:dim() return self.c.ndim end
function Tensor:numel() return tonumber(C.gp_numel(self.c)) end
function Tensor:is_contiguous() return C.gp_is_contiguous(self.c) == 1 end
function Tensor:stride(d)
  local c = self.c
  if d then return tonumber(c.stride[dim0(self, d, 'stride')]) end
  local s = {}
  for i = 0, c.ndim - 1 do s[i + 1] = tonumber(c.stride[i]) end
  return s
end
function Tensor:element_size() return ELSIZE[self.c.dtype] end
function Tensor:is_floating_point() return FLOAT[DTNAME[self.c.dtype]] == true end

---------------------------------------------------------------------------
-- kernels used below (gpush.core.kernels fills this table from the registry)
local K = {}
M.K = K

---------------------------------------------------------------------------
-- copies, devices and dtypes

function Tensor:clone()
  local out = empty(shape_of(self), DTNAME[self.c.dtype], DEVNAME[self.c.device], 'clone')
  K.copy(out, self)
  return out
end

function Tensor:contiguous()
  if C.gp_is_contiguous(self.c) == 1 then return self end
  return self:clone()
end

local function to_device(t, dev)
  dev = device_name(dev, 'to')
  if DEVNAME[t.c.device] == dev then return t end
  local src = t:contiguous()
  local out = empty(shape_of(t), DTNAME[t.c.dtype], dev, 'to')
  call(C.gp_transfer, out.c, src.c)
  return out
end

local function to_dtype(t, dt)
  dt = rt.dtype(dt, 'to')
  if DTNAME[t.c.dtype] == dt then return t end
  local out = empty(shape_of(t), dt, DEVNAME[t.c.device], 'to')
  K.copy(out, t)
  return out
end
M.to_dtype = to_dtype

-- t:to('cuda'), t:to('bf16'), t:to{device='cpu', dtype='f32'}
function Tensor:to(a, b)
  if type(a) == 'table' and not is_tensor(a) then
    local r = self
    local dev = a.device and device_name(a.device, 'to')
    -- to the cpu: move first, then cast (f64 exists on the cpu only)
    if dev == 'cpu' then r = to_device(r, dev) end
    if a.dtype then r = to_dtype(r, a.dtype) end
    if dev and dev ~= 'cpu' then r = to_device(r, dev) end
    return r
  end
  local r = self
  for _, x in ipairs {a, b} do
    if is_tensor(x) then
      r = to_device(to_dtype(r, x.dtype), x.device)
    elseif is_device(x) or (type(x) == 'string' and x:match('^cuda')) then
      r = to_device(r, x)
    elseif x ~= nil then
      r = to_dtype(r, x)
    end
  end
  return r
end
function Tensor:cuda() return to_device(self, 'cuda') end
function Tensor:cpu() return to_device(self, 'cpu') end
function Tensor:float() return to_dtype(self, 'f32') end
function Tensor:bf16() return to_dtype(self, 'bf16') end
function Tensor:half() return to_dtype(self, 'f16') end
function Tensor:int() return to_dtype(self, 'i32') end
function Tensor:long() return to_dtype(self, 'i64') end
function Tensor:bool() return to_dtype(self, 'u8') end
function Tensor:double() return to_dtype(self, 'f64') end
function Tensor:type(dt)
  if dt == nil then return DTNAME[self.c.dtype] end
  return to_dtype(self, dt)
end

-- copy src into self (broadcast, cast; a tensor on another device is moved first)
function Tensor:copy_(src)
  if not is_tensor(src) then raise('copy_: src must be a tensor') end
  if src.c.device ~= self.c.device then src = to_device(src, DEVNAME[self.c.device]) end
  K.copy(self, src)
  return self
end
function Tensor:fill_(v)
  K.fill(self, v)
  return self
end
function Tensor:zero_() return self:fill_(0) end

-- host values, row-major
local function to_doubles(t)
  local src = t:contiguous()
  local n = src:numel()
  local buf = ffi.new('double[?]', n > 0 and n or 1)
  call(C.gp_to_doubles, buf, src.c, n)
  return buf, n
end
M.to_doubles = to_doubles

function Tensor:item()
  local n = self:numel()
  if n ~= 1 then raise(string.format('item: the tensor has %d elements (shape %s), not 1', n, shape_str(shape_of(self)))) end
  local buf = to_doubles(self)
  return buf[0]
end

function Tensor:totable()
  local buf = to_doubles(self)
  local s = shape_of(self)
  if #s == 0 then return buf[0] end
  local pos = 0
  local function build(d)
    local r = {}
    if d == #s then
      for i = 1, s[d] do r[i] = buf[pos]; pos = pos + 1 end
    else
      for i = 1, s[d] do r[i] = build(d + 1) end
    end
    return r
  end
  return build(1)
end

---------------------------------------------------------------------------
-- views

function Tensor:view(...)
  local s = parse_shape('view', ...)
  local a = alias(self)
  call(C.gp_view, a.c, self.c, fill_dims('view', s), shape_buf)
  return a
end

function Tensor:reshape(...)
  local s = parse_shape('reshape', ...)
  local a = alias(self)
  if C.gp_view(a.c, self.c, fill_dims('reshape', s), shape_buf) == 0 then return a end
  return self:clone():view(s)
end

function Tensor:flatten(d0, d1)
  local s = shape_of(self)
  if #s == 0 then return self:reshape {1} end
  d0 = d0 and dim0(self, d0, 'flatten') + 1 or 1
  d1 = d1 and dim0(self, d1, 'flatten') + 1 or #s
  local r, n = {}, 1
  for i = 1, d0 - 1 do r[#r + 1] = s[i] end
  for i = d0, d1 do n = n * s[i] end
  r[#r + 1] = n
  for i = d1 + 1, #s do r[#r + 1] = s[i] end
  return self:reshape(r)
end

function Tensor:transpose(d0, d1)
  local a = alias(self)
  call(C.gp_transpose, a.c, self.c, dim0(self, d0, 'transpose'), dim0(self, d1, 'transpose'))
  return a
end

function Tensor:t()
  if self.c.ndim ~= 2 then raise(string.format('t: needs a 2-d tensor, got shape %s', shape_str(shape_of(self)))) end
  return self:transpose(1, 2)
end

function Tensor:permute(...)
  local p = type((...)) == 'table' and (...) or {...}
  if #p ~= self.c.ndim then
    raise(string.format('permute: %d dims given for a tensor of shape %s', #p, shape_str(shape_of(self))))
  end
  for i = 1, #p do perm_buf[i - 1] = dim0(self, p[i], 'permute') end
  local a = alias(self)
  call(C.gp_permute, a.c, self.c, #p, perm_buf)
  return a
end

-- narrow(dim, start, length): start is 1-based (negative counts from the end)
function Tensor:narrow(d, start, length)
  local d0 = dim0(self, d, 'narrow')
  local size = tonumber(self.c.shape[d0])
  if type(start) ~= 'number' or type(length) ~= 'number' then raise('narrow: start and length must be numbers') end
  int_arg('narrow', 'start', start)
  int_arg('narrow', 'length', length)
  local s0 = start < 0 and size + start or start - 1
  local a = alias(self)
  call(C.gp_narrow, a.c, self.c, d0, s0, length)
  return a
end

-- a 1-based position along a dim of `size` entries (negative counts from the
-- end), checked; `what` names the call in errors
local function position(what, i, size, d, t)
  if type(i) ~= 'number' or i ~= math.floor(i) then
    raise(string.format('%s: the position must be an integer, got %s%s', what, type(i) == 'number' and '' or (type(i) .. ' '),
      tostring(i)))
  end
  local p = i < 0 and size + i + 1 or i
  if i == 0 or p < 1 or p > size then
    raise(string.format('%s: position %d is out of range for dim %d of size %d (1..%d, or -%d..-1 from the end; positions are 1-based) of a tensor of shape %s',
      what, i, d, size, size, size, shape_str(shape_of(t))))
  end
  return p
end

-- select(dim, i): the i-th slice along dim (1-based, negative from the end), one dim fewer
function Tensor:select(d, i)
  local d0 = dim0(self, d, 'select')
  local p = position('select', i, tonumber(self.c.shape[d0]), d0 + 1, self)
  return self:narrow(d0 + 1, p, 1):squeeze(d0 + 1)
end

-- t[i]: the i-th slice along dim 1 (a view), or the i-th number of a 1-d
-- tensor, as in Torch7; t[i] = v fills that slice with a number or copies a
-- tensor into it (broadcasting)
local function slice1(t, i)
  local what = 't[' .. tostring(i) .. ']'
  if t.c.ndim == 0 then raise(what .. ': a 0-dim tensor has no positions to index (t:item() reads its value)') end
  local p = position(what, i, tonumber(t.c.shape[0]), 1, t)
  return Tensor.select(t, 1, p), what
end
function index_get(t, i)
  local s = slice1(t, i)
  if t.c.ndim == 1 then return s:item() end
  return s
end
function index_set(t, i, v)
  local s, what = slice1(t, i)
  if type(v) == 'number' then s:fill_(v)
  elseif type(v) == 'boolean' then s:fill_(v and 1 or 0)
  elseif is_tensor(v) then s:copy_(v)
  else raise(string.format('%s = v: v must be a number or a tensor, got %s', what, type(v))) end
end

function Tensor:expand(...)
  local s = parse_shape('expand', ...)
  local a = alias(self)
  call(C.gp_expand, a.c, self.c, fill_dims('expand', s), shape_buf)
  return a
end
function Tensor:expand_as(o) return self:expand(shape_of(o)) end

local function restride(t, s, st, op)
  local n = fill_dims(op, s, st) -- before the alias: a 9th dim is an error, not a write past the buffers
  local a = alias(t)
  call(C.gp_as_strided, a.c, t.c, n, shape_buf, stride_buf, t.c.offset)
  return a
end

function Tensor:unsqueeze(d)
  local d0 = dim0(self, d, 'unsqueeze', 1)
  local s, st = shape_of(self), self:stride()
  local inner = d0 < #s and st[d0 + 1] * s[d0 + 1] or 1
  table.insert(s, d0 + 1, 1)
  table.insert(st, d0 + 1, inner)
  return restride(self, s, st, 'unsqueeze')
end

function Tensor:squeeze(d)
  local s, st = shape_of(self), self:stride()
  local rs, rst = {}, {}
  local only = d and dim0(self, d, 'squeeze') + 1
  for i = 1, #s do
    if not (s[i] == 1 and (only == nil or only == i)) then
      rs[#rs + 1] = s[i]; rst[#rst + 1] = st[i]
    end
  end
  return restride(self, rs, rst, 'squeeze')
end

-- span(list, d): when the tensors of list are consecutive blocks along dim d
-- (1-based) of one contiguous tensor (the row blocks of a fused weight, the
-- column blocks of a fused output), that tensor as a view of their storage;
-- else nil. Lets one product serve where the blocks would take one each.
local function span(list, d)
  local n, c1 = #list, is_tensor(list[1]) and list[1].c
  if n == 0 or not c1 or d < 1 or d > c1.ndim then return nil end
  local nd, d0, total = c1.ndim, d - 1, 0
  for i = 1, n do
    local t = list[i]
    if not is_tensor(t) then return nil end
    local c = t.c
    if c.storage ~= c1.storage or c.dtype ~= c1.dtype or c.device ~= c1.device or c.ndim ~= nd then return nil end
    for k = 0, nd - 1 do if k ~= d0 and c.shape[k] ~= c1.shape[k] then return nil end end
    total = total + c.shape[d0]
  end
  -- the whole's shape and contiguous strides; each block must have them and start where the one before ends
  local s, st = shape_of(list[1]), {}
  s[d] = tonumber(total)
  local acc = 1
  for k = nd, 1, -1 do st[k] = acc; acc = acc * s[k] end
  local off = c1.offset
  for i = 1, n do
    local c = list[i].c
    if c.offset ~= off then return nil end
    for k = 0, nd - 1 do if c.shape[k] > 1 and c.stride[k] ~= st[k + 1] then return nil end end
    off = off + c.shape[d0] * st[d]
  end
  if n == 1 then return list[1] end
  return restride(list[1], s, st, 'span')
end
M.span = span

-- conv(t) for tensors that are row blocks of one: the tensors of list that
-- share a storage and, in offset order, are consecutive row blocks (span
-- along dim 1) are converted as one tensor, conv(their span), and each
-- becomes its block of the result. Returns {[t] = new block}; tensors alone,
-- or whose conv gives the span back unchanged, are not in it. Module:to and
-- gp.optim.mixed_precision keep a fused weight's blocks fused this way.
function M.convert_blocks(list, conv)
  local by, out = {}, {}
  for _, t in ipairs(list) do
    if is_tensor(t) and t.c.ndim >= 1 then
      local key = tostring(t.c.storage)
      by[key] = by[key] or {}
      table.insert(by[key], t)
    end
  end
  for _, g in pairs(by) do
    if #g > 1 then
      table.sort(g, function(a, b) return a.c.offset < b.c.offset end)
      local whole = span(g, 1)
      local nw = whole and conv(whole)
      if nw and nw ~= whole then
        local off = 0
        for _, t in ipairs(g) do
          local n = tonumber(t.c.shape[0])
          out[t] = nw:narrow(1, off + 1, n)
          off = off + n
        end
      end
    end
  end
  return out
end

---------------------------------------------------------------------------
-- arithmetic

local promote = dtype.promote
M.promote = promote

local function broadcast_shapes(op, sa, sb)
  local n = math.max(#sa, #sb)
  local r = {}
  for i = 1, n do
    local x = sa[#sa - n + i] or 1
    local y = sb[#sb - n + i] or 1
    if x == y or y == 1 then r[i] = x
    elseif x == 1 then r[i] = y
    else raise(string.format('%s: shapes %s and %s do not broadcast', op, shape_str(sa), shape_str(sb))) end
  end
  return r
end
M.broadcast_shapes = broadcast_shapes

local function check_devices(op, a, b)
  if a.c.device ~= b.c.device then
    raise(string.format('%s: a is on %s but b is on %s (move one with :to())', op, DEVNAME[a.c.device],
      DEVNAME[b.c.device]))
  end
end

local function is_int_number(x) return x == math.floor(x) and x > -2^53 and x < 2^53 end

-- tensor-tensor or tensor-scalar op with broadcasting and type promotion.
-- kt: kernel for two tensors; ks: with a scalar on the right; kr: scalar on the left
local function arith(op, kt, ks, kr, a, b, float_only, out)
  if type(a) == 'number' then
    if not is_tensor(b) then raise(op .. ': needs a tensor operand') end
    local dt = b.dtype
    if not FLOAT[dt] and (float_only or not is_int_number(a)) then dt = 'f32' end
    local x = to_dtype(b, dt)
    out = out or empty(shape_of(b), dt, b.device, op)
    kr(out, x, a)
    return out
  end
  if not is_tensor(a) then raise(op .. ': needs a tensor operand, got ' .. type(a)) end
  if type(b) == 'number' then
    local dt = a.dtype
    if not FLOAT[dt] and (float_only or not is_int_number(b)) then dt = 'f32' end
    local x = to_dtype(a, dt)
    out = out or empty(shape_of(a), dt, a.device, op)
    ks(out, x, b)
    return out
  end
  if not is_tensor(b) then raise(op .. ': operand must be a tensor or a number, got ' .. type(b)) end
  check_devices(op, a, b)
  local dt = promote(a.dtype, b.dtype)
  if float_only and not FLOAT[dt] then dt = 'f32' end
  local s = broadcast_shapes(op, shape_of(a), shape_of(b))
  out = out or empty(s, dt, a.device, op)
  kt(out, to_dtype(a, dt), to_dtype(b, dt))
  return out
end
M.arith = arith

local function def_arith(name, float_only, rname, reflect_same)
  local kt, ks = name, name .. '_s'
  local kr = rname or (name .. '_s')
  Tensor[name] = function(a, b) return arith(name, K[kt], K[ks], K[kr], a, b, float_only) end
  Tensor[name .. '_'] = function(a, b)
    if is_tensor(b) then check_devices(name .. '_', a, b); b = to_dtype(b, a.dtype) end
    if type(b) == 'number' then K[ks](a, a, b) else K[kt](a, a, b) end
    return a
  end
end
def_arith('add', false)
def_arith('sub', false, 'rsub_s')
def_arith('mul', false)
def_arith('div', true, 'rdiv_s')
def_arith('pow', false, 'rpow_s')
def_arith('maximum', false)
def_arith('minimum', false)

mt.__add = function(a, b) return Tensor.add(a, b) end
mt.__sub = function(a, b) return Tensor.sub(a, b) end
mt.__mul = function(a, b) return Tensor.mul(a, b) end
mt.__div = function(a, b) return Tensor.div(a, b) end
mt.__pow = function(a, b) return Tensor.pow(a, b) end
mt.__unm = function(a) return a:neg() end

-- comparisons give u8 tensors (Lua's == and < must return booleans)
local CMP_R = {eq = 'eq_s', ne = 'ne_s', lt = 'gt_s', le = 'ge_s', gt = 'lt_s', ge = 'le_s'}
for name, rname in pairs(CMP_R) do
  Tensor[name] = function(a, b)
    if type(a) == 'number' then
      local out = empty(shape_of(b), 'u8', b.device, name)
      K[rname](out, b, a)
      return out
    end
    if type(b) == 'number' then
      local out = empty(shape_of(a), 'u8', a.device, name)
      K[name .. '_s'](out, a, b)
      return out
    end
    check_devices(name, a, b)
    local dt = promote(a.dtype, b.dtype)
    local out = empty(broadcast_shapes(name, shape_of(a), shape_of(b)), 'u8', a.device, name)
    K[name](out, to_dtype(a, dt), to_dtype(b, dt))
    return out
  end
end

-- unary math: integers become f32 (neg and abs keep their dtype)
for _, name in ipairs {'neg', 'abs', 'exp', 'log', 'sqrt', 'rsqrt', 'tanh', 'sigmoid', 'relu', 'silu', 'gelu',
                       'gelu_tanh', 'sin', 'cos'} do
  local keep = name == 'neg' or name == 'abs'
  Tensor[name] = function(x)
    if not is_tensor(x) then raise(name .. ': needs a tensor') end
    local src = (keep or FLOAT[x.dtype]) and x or to_dtype(x, 'f32')
    local out = empty(shape_of(src), src.dtype, src.device, name)
    K[name](out, src)
    return out
  end
  Tensor[name .. '_'] = function(x)
    K[name](x, x)
    return x
  end
end

function Tensor:clamp(lo, hi)
  local out = empty(shape_of(self), self.dtype, self.device, 'clamp')
  K.clamp(out, self, lo or -math.huge, hi or math.huge)
  return out
end
function Tensor:clamp_(lo, hi)
  K.clamp(self, self, lo or -math.huge, hi or math.huge)
  return self
end

mt.__concat = function(a, b) return tostring(a) .. tostring(b) end

return M
