-- A small test library for the Lua suite: test(name, fn), skip(reason) and
-- assertions. tests/lua/run.lua collects and runs the cases.
local gp = require 'gpush'
local M = {cases = {}}

-- the gpush binary running the tests (a sanitizer build runs itself in the
-- tests that start gpush again), else build/gpush of the checkout
M.root = rawget(_G, 'GPUSH_ROOT') or '.'
M.exe = rawget(_G, 'GPUSH_EXE') or (M.root .. '/build/gpush')

function M.test(name, fn) M.cases[#M.cases + 1] = {name = name, fn = fn, file = M.current_file} end
function M.skip(reason) error({skip = reason}, 0) end
function M.cuda() if not gp.cuda_available() then M.skip('no CUDA GPU') end end

local function fail(msg, level) error(msg, (level or 1) + 2) end

function M.eq(a, b, msg)
  if a ~= b then fail(string.format('%sexpected %s, got %s', msg and msg .. ': ' or '', tostring(b), tostring(a))) end
end
function M.ok(v, msg) if not v then fail(msg or 'expected a true value') end end
function M.near(a, b, tol, msg)
  tol = tol or 1e-6
  if not (math.abs(a - b) <= tol * math.max(1, math.abs(b))) then
    fail(string.format('%sexpected %.9g, got %.9g (tol %g)', msg and msg .. ': ' or '', b, a, tol))
  end
end
-- deep comparison of nested tables of numbers
function M.same(a, b, tol, path)
  path = path or ''
  if type(a) == 'table' and type(b) == 'table' then
    if #a ~= #b then fail(string.format('length %d ~= %d at %s', #a, #b, path)) end
    for i = 1, #a do M.same(a[i], b[i], tol, path .. '[' .. i .. ']') end
  elseif type(a) == 'number' and type(b) == 'number' then
    if not (math.abs(a - b) <= (tol or 0) * math.max(1, math.abs(b))) then
      fail(string.format('%s: expected %.9g, got %.9g', path, b, a))
    end
  else
    fail(string.format('%s: %s vs %s', path, type(a), type(b)))
  end
end
-- fn must raise an error whose message contains every given substring
function M.raises(fn, ...)
  local ok, err = pcall(fn)
  if ok then fail('expected an error, none raised') end
  err = tostring(err)
  for _, s in ipairs {...} do
    if not err:find(s, 1, true) then fail(string.format('error %q does not mention %q', err, s)) end
  end
  return err
end

-- f()'s result and the calls it made of the named functions: `fns` maps a
-- count's name to {table, key} (the entry is wrapped while f runs, restored
-- after, also on error); 'products' counts the matrix-product kernels (every
-- matmul kernel and the NF4 GEMV, through gp.k and the tensor methods' table)
local PRODUCTS = {'matmul', 'matmul_bias', 'matmul_bias_gelu_tanh', 'matmul_bias_gelu_aux', 'matmul_dgelu', 'nf4_gemv'}
function M.counted(f, fns)
  local n, saved = {products = 0}, {}
  local function wrap(tbl, key, name)
    local orig = tbl[key]
    saved[#saved + 1] = {tbl, key, orig}
    n[name] = n[name] or 0
    tbl[key] = function(...) n[name] = n[name] + 1; return orig(...) end
  end
  for _, tbl in ipairs {require('gpush.core.kernels').k, require('gpush.core.tensor').K} do
    for _, k in ipairs(PRODUCTS) do wrap(tbl, k, 'products') end
  end
  for name, e in pairs(fns or {}) do wrap(e[1], e[2], name) end
  local r = {pcall(f)}
  for i = #saved, 1, -1 do saved[i][1][saved[i][2]] = saved[i][3] end
  if not r[1] then error(r[2], 0) end
  return r[2], n
end

-- f()'s result and its kernel launches by name ({copy = 3, fill = 1, ...}):
-- every gp.k function and the tensor methods' kernel table wrapped while f
-- runs (as gp.profile does), restored after, also on error
function M.launches(f)
  local n, saved = {}, {}
  local k, K = require('gpush.core.kernels').k, require('gpush.core.tensor').K
  for _, tbl in ipairs {k, K} do
    local names = {}
    for name in pairs(tbl) do names[#names + 1] = name end
    for _, name in ipairs(names) do
      local orig = tbl[name]
      saved[#saved + 1] = {tbl, name, orig}
      tbl[name] = function(...) n[name] = (n[name] or 0) + 1; return orig(...) end
    end
  end
  local r = {pcall(f)}
  for i = #saved, 1, -1 do saved[i][1][saved[i][2]] = saved[i][3] end
  if not r[1] then error(r[2], 0) end
  return r[2], setmetatable(n, {__index = function() return 0 end})
end

-- y = f(x, device) from the same x0 on the CPU and on the GPU (x requiring
-- grad), then y:backward(g) with one random g: the GPU's y and x.grad must be
-- within tol of the CPU's (relative norm); what names the case
function M.cuda_matches_cpu(f, x0, tol, what)
  local g
  local function run(dev)
    local x = x0:to(dev)
    if x == x0 then x = x0:clone() end -- a leaf of each run's own
    x:requires_grad()
    local y = f(x, dev)
    g = g or gp.randn(y.shape, {device = 'cpu'}):to(y.dtype)
    y:backward(g:to(dev))
    return y:cpu():float(), x.grad:cpu():float()
  end
  local yc, gc = run('cpu')
  local yg, gg = run('cuda')
  M.ok(M.relnorm(yg, yc) < tol, what .. ': forward ' .. M.relnorm(yg, yc))
  M.ok(M.relnorm(gg, gc) < tol, what .. ': gradient ' .. M.relnorm(gg, gc))
end

-- run a shell command; returns its output (stdout and stderr) and exit status
function M.sh(cmd)
  local f = io.popen(cmd .. ' 2>&1; echo "<rc=$?>"')
  local out = f:read('*a')
  f:close()
  local rc = tonumber(out:match('<rc=(%d+)>%s*$'))
  return out:gsub('<rc=%d+>%s*$', ''), rc
end

-- A training script's --ckpt/--resume (issue 26, M): `cmd` (gpush, the
-- script and its flags) runs in one go with --log; then, for each K of
-- `stops`, again with --ckpt and --stop-after K, and once more with --resume
-- alone. Every loss the resumed run logs (keyed by its record's model and
-- step) must equal the uninterrupted run's bit for bit, and together the two
-- parts must log every step. Returns the number of losses compared.
function M.check_resume(cmd, stops)
  local d = os.tmpname()
  os.remove(d)
  assert(os.execute('mkdir -p ' .. d) == 0)
  local function losses(path)
    local r = {}
    local f = io.open(path)
    if not f then return r end
    for line in f:lines() do
      local rec = gp.json.decode(line)
      if rec.loss and rec.step then r[tostring(rec.model or '') .. ':' .. rec.step] = rec.loss end
    end
    f:close()
    return r
  end
  local out, rc = M.sh(string.format('%s --log %s/a.jsonl', cmd, d))
  M.eq(rc, 0, out)
  local full, compared = losses(d .. '/a.jsonl'), 0
  for _, k in ipairs(stops) do
    out, rc = M.sh(string.format('%s --log %s/b.jsonl --ckpt %s/b.ckpt --stop-after %d', cmd, d, d, k))
    M.eq(rc, 0, out)
    M.ok(out:find('stopped after step ' .. k, 1, true), out)
    out, rc = M.sh(string.format('%s %s --resume %s/b.ckpt --log %s/c.jsonl', M.exe, cmd:match('^%S+%s+(.-%.lua)'), d, d))
    M.eq(rc, 0, out)
    local b, c = losses(d .. '/b.jsonl'), losses(d .. '/c.jsonl')
    for key, l in pairs(full) do
      local got = c[key] or b[key]
      M.ok(got ~= nil, string.format('stop after %d: %s was not logged', k, key))
      M.ok(got == l, string.format('stop after %d: %s: %.17g in one go, %.17g stopped and resumed', k, key, l, got or 0 / 0))
      if c[key] then compared = compared + 1 end
    end
    os.execute(string.format('rm -f %s/b.jsonl %s/c.jsonl %s/b.ckpt', d, d, d))
  end
  os.execute('rm -rf ' .. d)
  M.ok(compared > 0, 'nothing was resumed')
  return compared
end

-- the elements of a tensor as a flat Lua list (row-major)
function M.flat(t)
  local b, n = require('gpush.core.tensor').to_doubles(t)
  local r = {}
  for i = 0, n - 1 do r[i + 1] = b[i] end
  return r
end

-- relative norm ||a - b|| / ||b|| of two tensors, in double on the host
function M.relnorm(a, b)
  local tensor = require 'gpush.core.tensor'
  local x, n = tensor.to_doubles(a)
  local y, m = tensor.to_doubles(b)
  assert(n == m, 'relnorm: sizes differ')
  local num, den = 0, 0
  for i = 0, n - 1 do
    local u, v = x[i], y[i]
    if u ~= v then
      local d = u - v
      if d ~= d or d == math.huge or d == -math.huge then return math.huge end -- NaN or inf on one side only
      num = num + d * d
    end
    if v == v and v ~= math.huge and v ~= -math.huge then den = den + v * v end
  end
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end

return M
