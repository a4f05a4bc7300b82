-- help(x): the usage line and doc of a gpush function, kernel or tensor method
-- (x itself, or its name: help('zeros'), help('rms_norm')), from the records
-- that gp.doc keeps (gpush.core.doc).
local gp = require 'gpush.core'
local docs = require('gpush.core.doc').docs
local Tensor = gp.Tensor
local shape_str = require('gpush.core.tensor').shape_str

local M = {}

-- the documented gp.NAME function, by its usage line
local function by_name(name)
  local pat = '^gp%.' .. name:gsub('%.', '%%.') .. '[^%w_]'
  for f, d in pairs(docs) do
    if (d.usage .. ' '):find(pat) then return f end
  end
end

-- the tensor methods by group; methods in no group are listed under 'other'
M.groups = {
  {'size and layout', 'size dim numel stride element_size is_contiguous is_floating_point type'},
  {'devices and dtypes', 'to cuda cpu float bf16 half double int long bool'},
  {'values', 'item totable clone contiguous copy_ fill_ zero_'},
  {'views', 'view reshape flatten transpose t permute narrow select expand expand_as unsqueeze squeeze'},
  {'arithmetic', 'add sub mul div pow neg abs maximum minimum clamp'},
  {'math', 'exp log sqrt rsqrt tanh sigmoid relu silu gelu gelu_tanh sin cos'},
  {'comparisons (u8 results)', 'eq ne lt le gt ge'},
  {'reductions', 'sum mean max min argmax argmin var std norm cumsum softmax log_softmax'},
  {'matrix products', 'matmul mm bmm'},
  {'indexing', 'gather index_select scatter_add scatter_add_ topk sort multinomial'},
  {'autograd', 'requires_grad requires_grad_ backward detach zero_grad needs_grad is_leaf register_post_accumulate_hook'},
}

local function wrap_names(names, width)
  local lines, line = {}, ''
  for _, n in ipairs(names) do
    if #line > 0 and #line + 1 + #n > width then lines[#lines + 1] = line; line = '' end
    line = #line > 0 and line .. ' ' .. n or n
  end
  if #line > 0 then lines[#lines + 1] = line end
  return lines
end

-- help(t) of a tensor: what it is, then its methods by group
function M.tensor_methods(t)
  local out = {string.format('a tensor of shape %s, dtype %s, on %s; t[i] is the i-th slice along dim 1 (1-based)',
    shape_str(t.shape), t.dtype, t.device),
    'fields: t.shape t.dtype t.device t.grad; methods (t:name(...); help(t.name) for one, _ works in place):'}
  local listed = {}
  for _, g in ipairs(M.groups) do
    local names = {}
    for n in g[2]:gmatch('%S+') do
      if type(Tensor[n]) == 'function' and not listed[n] then names[#names + 1] = n; listed[n] = true end
    end
    -- the in-place forms (add_, exp_) beside the others
    for i = 1, #names do
      local n = names[i] .. '_'
      if type(Tensor[n]) == 'function' and not listed[n] then names[#names + 1] = n; listed[n] = true end
    end
    if #names > 0 then
      for i, l in ipairs(wrap_names(names, 76)) do
        out[#out + 1] = i == 1 and string.format('  %-26s %s', g[1], l) or string.rep(' ', 29) .. l
      end
    end
  end
  local rest = {}
  for n, f in pairs(Tensor) do
    if type(f) == 'function' and not listed[n] and type(n) == 'string' and not n:match('^_') then rest[#rest + 1] = n end
  end
  table.sort(rest)
  for i, l in ipairs(wrap_names(rest, 76)) do
    out[#out + 1] = i == 1 and string.format('  %-26s %s', 'other', l) or string.rep(' ', 29) .. l
  end
  return table.concat(out, '\n')
end

function M.help(x)
  if x == nil then
    return print('gpush ' .. gp.version() .. [[

  help(f)            the doc of a gpush function, e.g. help(gp.k.add) or help(gp.zeros); help(t) a tensor's methods
  print(gp.kernels()) every kernel: gp.k.NAME(outputs..., inputs..., scalars...)
  gp.tensor, gp.zeros, gp.ones, gp.full, gp.rand, gp.randn, gp.randint, gp.arange: creation
  t:to('cuda'), t:view{...}, t:transpose(1,2), a + b, a:exp(), ...: see README.md and docs/]])
  end
  if gp.is_tensor(x) then return print(M.tensor_methods(x)) end
  if type(x) == 'string' then x = by_name(x) or rawget(gp.k, x) or Tensor[x] end
  local d = docs[x]
  if not d then
    for name, f in pairs(Tensor) do if f == x then d = docs[f] or {usage = 't:' .. name .. '(...)', doc = 'a tensor method (docs/tensors.md)'} end end
  end
  if not d then return print('no gpush doc for ' .. tostring(x)) end
  local s = d.usage .. '\n  ' .. d.doc
  if d.kernel then s = s .. '\n  C: int gp_k_' .. d.kernel.name .. d.kernel.signature end
  print(s)
end
gp.doc(M.help, 'help(x) / gp.help(x)', "print the usage and doc of a gpush function, kernel or tensor method (x may be a name: help('zeros')); help(t) of a tensor lists its methods by group")

return M
