-- A rank of the gp.dist tests (run by tests/lua/test_dist.lua under gpush --nproc N):
--   gpush --nproc 2 tests/lua/dist_worker.lua cpu|cuda [sizes...]
-- Every collective on tensors whose values each rank can compute for every
-- other rank, checked against the result computed on the host in double.
-- Prints 'ok <what>' lines and 'done'; any mismatch is an error (non-zero exit).
local device = arg[1] or 'cpu'
local sizes = {}
for i = 2, #arg do sizes[#sizes + 1] = tonumber(arg[i]) end
if #sizes == 0 then sizes = {1, 7, 1000} end

local dist = gp.dist
dist.init {backend = device == 'cuda' and 'nccl' or 'tcp', timeout = 60}
local rank, world = dist.rank(), dist.world_size()

-- the same 128 bytes everywhere
local uid = dist.uid()
local hex = uid:sub(1, 16):gsub('.', function(c) return string.format('%02x', c:byte()) end)
print('uid ' .. hex)

-- value i (0-based) of rank r: exact in bf16 for small integers, distinct per rank
local function val(r, i, dt)
  local v = ((i * 7 + r * 3) % 13) - 6 + r * 0.5
  if dt == 'i32' or dt == 'i64' then v = math.floor(v * 2) end
  return v
end

local function make(r, n, dt)
  local vals = {}
  for i = 0, n - 1 do vals[i + 1] = val(r, i, dt) end
  return gp.tensor(vals, {dtype = dt, device = device})
end

local function check(what, got, want, tol)
  local g = got:to {dtype = 'f64', device = 'cpu'}:totable()
  assert(#g == #want, string.format('%s: %d values, expected %d', what, #g, #want))
  local num, den = 0, 0
  for i = 1, #want do
    local d = g[i] - want[i]
    if d ~= d then error(what .. ': NaN at ' .. i) end
    num, den = num + d * d, den + want[i] * want[i]
  end
  local rel = math.sqrt(num) / math.max(math.sqrt(den), 1e-30)
  if rel > tol then error(string.format('%s: relative error %.3g > %.3g', what, rel, tol)) end
end

local dtypes = device == 'cuda' and {'f32', 'bf16'} or {'f32', 'bf16', 'f64', 'i64'}
for _, dt in ipairs(dtypes) do
  local tol = dt == 'bf16' and 1e-2 or 1e-6
  for _, n in ipairs(sizes) do
    -- allreduce: sum, avg, max
    for _, op in ipairs {'sum', 'avg', 'max'} do
      if not (dt == 'i64' and op == 'avg') then
        local t = make(rank, n, dt)
        dist.allreduce(t, op)
        local want = {}
        for i = 0, n - 1 do
          local acc = op == 'max' and -math.huge or 0
          for r = 0, world - 1 do
            local v = val(r, i, dt)
            if op == 'max' then acc = math.max(acc, v) else acc = acc + v end
          end
          want[i + 1] = op == 'avg' and acc / world or acc
        end
        check(string.format('allreduce %s %s n=%d', op, dt, n), t, want, tol)
      end
    end
    -- broadcast from the last rank
    local root = world - 1
    local t = make(rank, n, dt)
    dist.broadcast(t, root)
    local want = {}
    for i = 0, n - 1 do want[i + 1] = val(root, i, dt) end
    check(string.format('broadcast %s n=%d', dt, n), t, want, tol)
    -- allgather
    local g = dist.allgather(make(rank, n, dt))
    want = {}
    for r = 0, world - 1 do for i = 0, n - 1 do want[#want + 1] = val(r, i, dt) end end
    check(string.format('allgather %s n=%d', dt, n), g, want, tol)
    -- reduce_scatter of world * n values
    local rs = dist.reduce_scatter(make(rank, world * n, dt), 'sum')
    want = {}
    for i = rank * n, rank * n + n - 1 do
      local acc = 0
      for r = 0, world - 1 do acc = acc + val(r, i, dt) end
      want[#want + 1] = acc
    end
    check(string.format('reduce_scatter %s n=%d', dt, n), rs, want, tol)
  end
  print('ok ' .. dt)
end
dist.barrier()

-- ranks that disagree get an error, not a hang (tcp only: NCCL cannot tell)
if device == 'cpu' then
  local ok, err = pcall(dist.allreduce, make(rank, rank == 0 and 3 or 4, 'f32'), 'sum')
  assert(not ok and tostring(err):find('ranks disagree', 1, true), tostring(err))
  print('ok mismatch')
end
dist.barrier()
dist.destroy()
print('done')
