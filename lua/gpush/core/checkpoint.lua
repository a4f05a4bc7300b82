-- gp.save / gp.load: tensors in the safetensors format (src/safetensors.c),
-- with metadata. String metadata is stored as is; other values (numbers,
-- booleans, tables such as a model config) are stored as JSON and come back
-- decoded (their keys are listed under 'gpush.json_keys').
local ffi = require 'ffi'
local rt = require 'gpush.core.runtime'
local tensor = require 'gpush.core.tensor'
local DTNAME = require('gpush.core.dtype').DTNAME
local json = require 'gpush.core.json'
local C, raise, is_tensor = rt.C, rt.raise, tensor.is_tensor

local M = {}
local JSON_KEYS = 'gpush.json_keys'

-- C strings end at the first NUL: a name or value with one would be cut short
local function no_nul(s, what)
  if s:find('\0', 1, true) then raise(string.format('save: %s %q contains a NUL byte', what, s)) end
  return s
end

function M.save(path, tensors, meta)
  if type(path) ~= 'string' then raise('save: the path must be a string') end
  no_nul(path, 'the path')
  if type(tensors) ~= 'table' then raise('save: needs a table of name = tensor') end
  if meta ~= nil and type(meta) ~= 'table' then raise('save: metadata must be a table of key = value') end
  local names = {}
  for k, v in pairs(tensors) do
    if type(k) ~= 'string' then raise('save: tensor names must be strings, got a ' .. type(k)) end
    no_nul(k, 'the tensor name')
    if k == '__metadata__' then
      raise("save: a tensor cannot be named '__metadata__' (the format keeps that name for the metadata: pass " ..
        'metadata as the third argument)')
    end
    if not is_tensor(v) then raise(string.format("save: '%s' is a %s, not a tensor", k, type(v))) end
    names[#names + 1] = k
  end
  table.sort(names)
  local n = #names
  local cnames = ffi.new('const char *[?]', n + 1)
  local cts = ffi.new('const gp_tensor *[?]', n + 1)
  local keep = {} -- luacheck: ignore 241 (the cpu copies stay alive until gp_st_save has written them)
  for i, k in ipairs(names) do
    local t = tensors[k]:cpu():contiguous()
    keep[i] = t
    cnames[i - 1] = k
    cts[i - 1] = t.c
  end
  local keys, vals, jk = {}, {}, {}
  for k, v in pairs(meta or {}) do
    if type(k) ~= 'string' then raise('save: metadata keys must be strings') end
    no_nul(k, 'the metadata key')
    if k == JSON_KEYS then
      raise(string.format("save: the metadata key '%s' is gpush's own (it lists the keys stored as JSON)", JSON_KEYS))
    end
    keys[#keys + 1] = k
    if type(v) == 'string' then vals[#vals + 1] = no_nul(v, 'the metadata value of ' .. k)
    else vals[#vals + 1] = json.encode(v); jk[#jk + 1] = k end
  end
  table.sort(jk)
  if #jk > 0 then keys[#keys + 1] = JSON_KEYS; vals[#vals + 1] = json.encode(jk) end
  local ck = ffi.new('const char *[?]', #keys + 1)
  local cv = ffi.new('const char *[?]', #keys + 1)
  for i = 1, #keys do ck[i - 1] = keys[i]; cv[i - 1] = vals[i] end
  rt.call(C.gp_st_save, path, n, cnames, cts, #keys, ck, cv)
  return path
end

-- returns {name = tensor}, metadata; opts.device moves the tensors there;
-- opts.meta_only: the metadata only ({} for the tensors, none read)
function M.load(path, opts)
  if type(path) ~= 'string' then raise('load: the path must be a string') end
  opts = opts or {}
  local box = ffi.new('gp_st *[1]')
  rt.call(C.gp_st_open, box, path)
  local st = ffi.gc(box[0], C.gp_st_close)
  local name, dtype, ndim = ffi.new('const char *[1]'), ffi.new('int[1]'), ffi.new('int[1]')
  local shape = ffi.new('int64_t[?]', tensor.MAX_DIMS)
  local out = {}
  for i = 0, opts.meta_only and -1 or C.gp_st_count(st) - 1 do
    rt.call(C.gp_st_info, st, i, name, dtype, ndim, shape)
    local s = {}
    for d = 0, ndim[0] - 1 do s[d + 1] = tonumber(shape[d]) end
    local t = tensor.empty(s, DTNAME[dtype[0]], 'cpu', 'load')
    rt.call(C.gp_st_read, st, i, t.c)
    out[ffi.string(name[0])] = opts.device and t:to(opts.device) or t
  end
  local meta, k, v = {}, ffi.new('const char *[1]'), ffi.new('const char *[1]')
  for i = 0, C.gp_st_meta_count(st) - 1 do
    rt.call(C.gp_st_meta, st, i, k, v)
    meta[ffi.string(k[0])] = ffi.string(v[0])
  end
  if meta[JSON_KEYS] then
    local ok, jk = pcall(json.decode, meta[JSON_KEYS])
    if ok and type(jk) == 'table' then
      for _, key in ipairs(jk) do
        if type(key) == 'string' and meta[key] then
          local ok2, val = pcall(json.decode, meta[key])
          if ok2 then meta[key] = val end
        end
      end
    end
    meta[JSON_KEYS] = nil
  end
  C.gp_st_close(ffi.gc(st, nil))
  return out, meta
end

return M
