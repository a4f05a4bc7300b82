-- gp.rtc: CUDA C compiled at run time with NVRTC for the current GPU.
--   local k = gp.rtc.kernel(src, 'name' [, {args = {'ptr','ptr','int'}, options = {...}, arch = 'sm_90'}])
--   k(out, x, n, {grid = g, block = 256, shared = 0})
-- Compiled code is cached by a hash of (source, name, arch, options) in memory
-- and on disk ($GPUSH_CACHE, else ~/.cache/gpush). gp.rtc.map('y = ...')
-- builds an elementwise f32 kernel over tensors named by the expression.
local ffi = require 'ffi'
local bit = require 'bit'
local rt = require 'gpush.core.runtime'
local dtype = require 'gpush.core.dtype'
local tensor = require 'gpush.core.tensor'
local C, raise = rt.C, rt.raise

local M = {stats = {compiles = 0, memory_hits = 0, disk_hits = 0, disk_writes = 0, loads = 0}}
local code_cache = {}   -- key -> {code = string, lowered = string}
local loaded = {}       -- key -> kernel object

local function need_gpu(op)
  if C.gp_cuda_compiled() ~= 1 then raise(op .. ': this gpush was built without CUDA, so run-time compiled GPU kernels cannot run') end
  if C.gp_cuda_available() ~= 1 then
    raise(op .. ': run-time compiled kernels need a CUDA GPU, and ' .. rt.last_error() .. ' (the CPU backend has no rtc)')
  end
end

-- FNV-1a, 64 bits, as 16 hex digits
local function hash(s)
  local h = 0xcbf29ce484222325ULL
  for i = 1, #s do h = bit.bxor(h, s:byte(i)) * 0x100000001b3ULL end
  return bit.tohex(h, 16)
end
M.hash = hash

M.cache_dir = rt.cache_dir

function M.arch()
  need_gpu('rtc.arch')
  local buf = ffi.new('char[32]')
  rt.call(C.gp_rtc_arch, buf, 32)
  return ffi.string(buf)
end

local MAGIC = 'gpush-rtc-1\n'

local function disk_path(key, arch)
  local d = M.cache_dir()
  return d and string.format('%s/rtc-%s-%s.cubin', d, hash(key), arch), d
end

local function disk_read(key, arch)
  local path = disk_path(key, arch)
  if not path then return nil end
  local f = io.open(path, 'rb')
  if not f then return nil end
  local data = f:read('*a')
  f:close()
  -- MAGIC, key length, key, lowered name, code
  if data:sub(1, #MAGIC) ~= MAGIC then return nil end
  local klen, p = data:match('^(%d+)\n()', #MAGIC + 1)
  if not klen then return nil end
  klen = tonumber(klen)
  if data:sub(p, p + klen - 1) ~= key then return nil end -- a hash collision or a stale file
  local lowered, q = data:match('^([^\n]*)\n()', p + klen)
  if not lowered then return nil end
  return {code = data:sub(q), lowered = lowered}
end

local function disk_write(key, arch, entry)
  local path, dir = disk_path(key, arch)
  if not path then return end
  os.execute(string.format("mkdir -p '%s' 2>/dev/null", dir:gsub("'", "'\\''")))
  local tmp = path .. '.tmp' .. tostring(os.time()) .. tostring(math.random(1e9))
  local f = io.open(tmp, 'wb')
  if not f then return end
  f:write(MAGIC, #key, '\n', key, entry.lowered, '\n', entry.code)
  f:close()
  os.rename(tmp, path)
  M.stats.disk_writes = M.stats.disk_writes + 1
end

-- compile (or fetch from the caches) to cubin bytes; returns entry, where it came from, cache key
local function compile(src, name, opts)
  if type(src) ~= 'string' or type(name) ~= 'string' then raise('rtc.compile: usage gp.rtc.compile(source, name [, opts])') end
  opts = opts or {}
  local arch = opts.arch or M.arch()
  local options = opts.options or {}
  local key = table.concat({src, name, arch, table.concat(options, ' ')}, '\0')
  local e = code_cache[key]
  if e then
    M.stats.memory_hits = M.stats.memory_hits + 1
    return e, 'memory', key
  end
  if opts.cache ~= false then
    e = disk_read(key, arch)
    if e then
      M.stats.disk_hits = M.stats.disk_hits + 1
      code_cache[key] = e
      return e, 'disk', key
    end
  end
  local code, ncode = ffi.new('char*[1]'), ffi.new('size_t[1]')
  local lowered, log = ffi.new('char*[1]'), ffi.new('char*[1]')
  local copts = ffi.new('const char*[?]', #options + 1)
  for i, o in ipairs(options) do copts[i - 1] = o end
  local rc = C.gp_rtc_compile(code, ncode, lowered, log, src, name, arch, #options, copts)
  local logs = log[0] ~= nil and ffi.string(log[0]) or ''
  M.stats.compiles = M.stats.compiles + 1
  if rc ~= 0 then
    local msg = rt.last_error()
    C.gp_rtc_free(code[0]); C.gp_rtc_free(lowered[0]); C.gp_rtc_free(log[0])
    raise(msg .. (logs ~= '' and ('\n' .. logs:gsub('%s+$', '')) or ''))
  end
  e = {code = ffi.string(code[0], ncode[0]), lowered = ffi.string(lowered[0]), log = logs}
  C.gp_rtc_free(code[0]); C.gp_rtc_free(lowered[0]); C.gp_rtc_free(log[0])
  code_cache[key] = e
  if opts.cache ~= false then disk_write(key, arch, e) end
  return e, 'compiled', key
end

-- gp.rtc.compile: {code, lowered, log}, and 'memory', 'disk' or 'compiled'
function M.compile(src, name, opts)
  local e, from = compile(src, name, opts)
  return e, from
end

function M.clear_memory_cache()
  code_cache, loaded = {}, {}
end

---------------------------------------------------------------------------
-- argument types from the kernel's parameter list

local SCALAR = {
  float = 'float', double = 'double', int = 'int', int32_t = 'int', unsigned = 'u32', ['unsigned int'] = 'u32',
  uint32_t = 'u32', ['long long'] = 'i64', int64_t = 'i64', long = 'i64', size_t = 'u64', uint64_t = 'u64',
  ['unsigned long long'] = 'u64', ['long int'] = 'i64', bool = 'bool', char = 'i8',
}
function M.parse_args(src, name)
  local s = src:gsub('//[^\n]*', ''):gsub('/%*.-%*/', '')
  local params = s:match('__global__[^%(]-[%s%*&]' .. name:gsub('%W', '%%%0') .. '%s*(%b())')
  if not params then return nil end
  params = params:sub(2, -2)
  local types = {}
  if params:match('^%s*$') or params:match('^%s*void%s*$') then return types end
  for p in (params .. ','):gmatch('([^,]*),') do
    if p:find('[%*%[]') then
      types[#types + 1] = 'ptr'
    else
      local t = p:gsub('__restrict__', ''):gsub('const', ''):gsub('volatile', ''):gsub('=.*$', '')
      t = t:gsub('%s+', ' '):gsub('^ ', ''):gsub(' $', '')
      t = t:gsub(' [%w_]+$', '') -- drop the parameter name
      local ty = SCALAR[t]
      if not ty then return nil, string.format("parameter '%s' has a type rtc cannot pass; give opts.args", p) end
      types[#types + 1] = ty
    end
  end
  return types
end

---------------------------------------------------------------------------
-- kernels

local CT = {float = 'float', double = 'double', int = 'int32_t', u32 = 'uint32_t', i64 = 'int64_t', u64 = 'uint64_t',
  bool = 'uint8_t', i8 = 'int8_t', ptr = 'void*'}
local PTR = {}
for k, v in pairs(CT) do PTR[k] = ffi.typeof(v .. '*') end
local Kernel = {}
Kernel.__index = Kernel
M.Kernel = Kernel

local function dim3(v, what, name)
  if type(v) == 'number' then return v, 1, 1 end
  if type(v) == 'table' then return v[1] or v.x or 1, v[2] or v.y or 1, v[3] or v.z or 1 end
  raise(string.format('rtc kernel %s: %s must be a number or {x, y, z}', name, what))
end

local grid_b, block_b = ffi.new('unsigned[3]'), ffi.new('unsigned[3]')

function Kernel:__call(...)
  local n = select('#', ...)
  local launch = select(n, ...)
  if type(launch) ~= 'table' or getmetatable(launch) ~= nil then
    raise(string.format('rtc kernel %s: the last argument must be the launch table {grid=, block=, shared=}', self.name))
  end
  local nargs = n - 1
  if nargs ~= #self.args then
    raise(string.format('rtc kernel %s: %d arguments given, the kernel takes %d (%s)', self.name, nargs, #self.args,
      table.concat(self.args, ', ')))
  end
  for i = 1, nargs do
    local v, ty = select(i, ...), self.args[i]
    local slot = self.slots + (i - 1)
    if ty == 'ptr' then
      if getmetatable(v) ~= tensor.mt then
        raise(string.format('rtc kernel %s: argument %d must be a tensor, got %s', self.name, i, type(v)))
      end
      if v.c.device ~= 1 then raise(string.format('rtc kernel %s: argument %d is on cpu; rtc kernels run on cuda', self.name, i)) end
      ffi.cast(PTR.ptr, slot)[0] = v.c.data + v.c.offset * dtype.ELSIZE[v.c.dtype]
    else
      if type(v) == 'boolean' then v = v and 1 or 0 end
      if type(v) ~= 'number' then
        raise(string.format('rtc kernel %s: argument %d must be a number (%s), got %s', self.name, i, ty, type(v)))
      end
      ffi.cast(PTR[ty], slot)[0] = v
    end
  end
  local block = launch.block or 256
  local bx, by, bz = dim3(block, 'block', self.name)
  local grid = launch.grid
  if not grid and launch.n then grid = math.max(1, math.ceil(launch.n / (bx * by * bz))) end
  if not grid then raise(string.format('rtc kernel %s: the launch table needs grid= (or n= elements)', self.name)) end
  local gx, gy, gz = dim3(grid, 'grid', self.name)
  grid_b[0], grid_b[1], grid_b[2] = gx, gy, gz
  block_b[0], block_b[1], block_b[2] = bx, by, bz
  rt.call(C.gp_rtc_launch, self.k, grid_b, block_b, launch.shared or 0, self.argv)
  return ...
end
Kernel.__tostring = function(k) return string.format('gp.rtc kernel %s(%s)', k.name, table.concat(k.args, ', ')) end

function M.kernel(src, name, opts)
  if type(src) ~= 'string' or type(name) ~= 'string' then raise('rtc.kernel: usage gp.rtc.kernel(source, name [, opts])') end
  opts = opts or {}
  need_gpu('rtc.kernel')
  local args = opts.args
  if not args then
    local err
    args, err = M.parse_args(src, name)
    if not args then raise('rtc.kernel: ' .. (err or ("cannot find the parameter list of __global__ '" .. name .. "'; give opts.args"))) end
  end
  for i, a in ipairs(args) do
    if not CT[a] then raise(string.format("rtc.kernel: argument type %d '%s' is not one of ptr, int, float, double, i64, u32, u64", i, tostring(a))) end
  end
  local e, from, key = compile(src, name, opts)
  local k = loaded[key]
  if k and table.concat(k.args, ',') == table.concat(args, ',') then return k, from end
  local lib, kern = ffi.new('void*[1]'), ffi.new('void*[1]')
  rt.call(C.gp_rtc_load, lib, kern, e.code, #e.code, e.lowered)
  M.stats.loads = M.stats.loads + 1
  k = setmetatable({name = name, args = args, lib = ffi.gc(lib[0], C.gp_rtc_unload), k = kern[0], log = e.log,
    slots = ffi.new('uint64_t[?]', math.max(1, #args)), argv = ffi.new('void*[?]', math.max(1, #args))}, Kernel)
  for i = 0, #args - 1 do k.argv[i] = k.slots + i end
  loaded[key] = k
  return k, from
end

---------------------------------------------------------------------------
-- elementwise maps: gp.rtc.map('y = x > 0.f ? x : 0.f')

local CWORDS = {}
for w in ([[if else return for while do break continue switch case default true false float double int unsigned long
  short char bool const auto sizeof void signed static inline y]]):gmatch('[%w_]+') do CWORDS[w] = true end

-- the free names of the expression, in order of appearance (calls like expf(...) are not names)
function M.free_names(expr)
  local s = expr:gsub('%d*%.?%d+[eE][-+]?%d+[fFlLuU]*', ' '):gsub('%d[%w%.]*', ' '):gsub('%.%d[%w]*', ' ')
  local names, seen = {}, {}
  for pos, w, after in s:gmatch('()([%a_][%w_]*)()') do
    local nxt = s:match('^%s*(.)', after)
    local prev = pos > 1 and s:sub(pos - 1, pos - 1) or ''
    if not CWORDS[w] and nxt ~= '(' and prev ~= '.' and not seen[w] and not w:match('^__') and not w:match('^M_') then
      seen[w] = true
      names[#names + 1] = w
    end
  end
  return names
end

function M.map(expr, opts)
  if type(expr) ~= 'string' or not expr:match('^%s*y%s*=') then
    raise("rtc.map: the expression must assign y, e.g. gp.rtc.map('y = x > 0.f ? x : 0.f')")
  end
  opts = opts or {}
  need_gpu('rtc.map')
  local inputs = M.free_names(expr:gsub('^%s*y%s*=', ''))
  if #inputs == 0 then raise('rtc.map: the expression names no inputs') end
  local name = 'gp_map_' .. hash(expr):sub(1, 12)
  local params, loads = {'float *__restrict__ y_'}, {}
  for _, v in ipairs(inputs) do
    params[#params + 1] = 'const float *__restrict__ ' .. v .. '_'
    loads[#loads + 1] = string.format('    const float %s = %s_[i];', v, v)
  end
  params[#params + 1] = 'long long n'
  local src = string.format([[
extern "C" __global__ void %s(%s) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
%s
    float y;
    %s;
    y_[i] = y;
  }
}
]], name, table.concat(params, ', '), table.concat(loads, '\n'), expr)
  local k = M.kernel(src, name, {options = opts.options, arch = opts.arch})
  local sms
  local function run(...)
    local xs = {...}
    if #xs == 1 and type(xs[1]) == 'table' and getmetatable(xs[1]) == nil then
      local t = xs[1]
      xs = {}
      for i, v in ipairs(inputs) do xs[i] = t[v] end
    end
    if #xs ~= #inputs then
      raise(string.format('rtc.map: %d inputs given, the expression needs %d (%s)', #xs, #inputs, table.concat(inputs, ', ')))
    end
    local first = xs[1]
    for i, x in ipairs(xs) do
      if not tensor.is_tensor(x) then raise(string.format('rtc.map: input %s must be a tensor', inputs[i])) end
      if x.device ~= 'cuda' then raise(string.format('rtc.map: input %s is on %s; rtc kernels run on cuda', inputs[i], x.device)) end
      if x.dtype ~= 'f32' then raise(string.format('rtc.map: input %s is %s; maps work on f32', inputs[i], x.dtype)) end
      if tensor.shape_str(x.shape) ~= tensor.shape_str(first.shape) then
        raise(string.format('rtc.map: input %s is %s but %s is %s', inputs[i], tensor.shape_str(x.shape), inputs[1],
          tensor.shape_str(first.shape)))
      end
      if not x:is_contiguous() then xs[i] = x:contiguous() end
    end
    local y = tensor.empty(first.shape, 'f32', 'cuda', 'rtc.map')
    local n = first:numel()
    if n == 0 then return y end
    sms = sms or 4096
    local grid = math.min(math.ceil(n / 256), sms)
    xs[#xs + 1] = n
    xs[#xs + 1] = {grid = grid, block = 256}
    k(y, unpack(xs))
    return y
  end
  return setmetatable({inputs = inputs, kernel = k, source = src, expr = expr},
    {__call = function(_, ...) return run(...) end, __tostring = function() return 'gp.rtc.map(' .. expr .. ')' end})
end

-- what gp.rtc offers
local doc = require('gpush.core.doc').doc
M.api = {
  kernel = doc(M.kernel, "gp.rtc.kernel(src, name, {args={'ptr','int',...}, options={...}})",
    'compile CUDA C with NVRTC for this GPU (cached in memory and $GPUSH_CACHE or ~/.cache/gpush); call it as k(args..., {grid=, block=, shared=})'),
  map = doc(M.map, "gp.rtc.map('y = x > 0.f ? x : 0.f')", 'an elementwise f32 kernel over tensors named by the free names of the expression; m(x, ...) returns y'),
  compile = doc(M.compile, "gp.rtc.compile(src, name, {arch='sm_90'})", 'compile (or fetch from the caches) to a cubin: returns {code, lowered, log}, and memory|disk|compiled'),
  arch = doc(M.arch, 'gp.rtc.arch()', "the current GPU's architecture, e.g. 'sm_90'"),
  cache_dir = doc(M.cache_dir, 'gp.rtc.cache_dir()', 'where compiled kernels are cached on disk ($GPUSH_CACHE or ~/.cache/gpush)'),
  clear_memory_cache = doc(M.clear_memory_cache, 'gp.rtc.clear_memory_cache()', 'forget the compiled and loaded kernels held in memory'),
  stats = M.stats,
}


return M
