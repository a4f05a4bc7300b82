-- Flash attention benchmark: bf16, causal, B 4, H 16, T 4096, D 64 (change
-- with --batch --heads --seq --head-dim): forward, backward and forward +
-- backward in TFLOP/s (causal flops: 4 B H T^2 D / 2 forward, 2.5x that
-- backward, 3.5x forward + backward), timed with gp.time, beside PyTorch's
-- scaled_dot_product_attention (scripts/bench/torch_peer.py attention) when
-- python3 has torch; and decode attention over a long cache in GB/s.
--   gpush scripts/bench/attention.lua [--seq 4096] [--head-dim 64]
--
-- --grid: forward and forward+backward TFLOP/s of gpush and of PyTorch's SDPA
-- (all cells in one python3 process: torch_peer.py attention-grid) over
-- D 64, 128 (H = 2048 / D query heads), T 512 .. 16384 (B = 16384 / T: 16K
-- tokens a batch), causal and not, Hkv = H and H / 4 (GQA 4:1): a markdown
-- table for BENCHMARKS.md, then the geometric mean of gpush/SDPA and how many
-- cells are at >= 1.0x. Each cell is timed --runs times (each run gp.time's
-- median over --iters), the median run reported; --json FILE writes a JSON
-- line a cell. Filters (comma lists; any of them implies --grid):
--   gpush scripts/bench/attention.lua --grid [--grid-d 64,128] [--grid-t 512,4096]
--       [--grid-causal 1,0] [--grid-gqa 1,4] [--runs 3] [--iters 20] [--json grid.jsonl]
local a = gp.args.parse(arg, {
  {'batch', 4, 'batch size'}, {'heads', 16, 'heads'}, {'seq', 4096, 'sequence length T'},
  {'head-dim', 64, 'head dim (64 or 128)'}, {'iters', 20, 'timed iterations'},
  {'decode-len', 32768, 'cache length of the decode benchmark'},
  {'grid', false, 'the grid beside PyTorch SDPA: D 64/128, T 512..16384 (B = 16384 / T), causal or not, GQA 1 or 4'},
  {'grid-d', '', '--grid: head dims, a comma list (default 64,128)'},
  {'grid-t', '', '--grid: sequence lengths dividing 16384, a comma list (default 512,1024,2048,4096,8192,16384)'},
  {'grid-causal', '', '--grid: 1 causal, 0 not, a comma list (default 1,0)'},
  {'grid-gqa', '', '--grid: query heads per KV head, a comma list (default 1,4)'},
  {'runs', 3, '--grid: runs a cell (the median run is reported)'},
  {'json', '', '--grid: also write one JSON line a cell to this file'},
}, {usage = 'gpush scripts/bench/attention.lua [flags]'})

-- the --grid cells, checked before any GPU work ({} when not asked for)
local GRID_TOKENS = 16384
local function die(msg)
  io.stderr:write('attention bench: ', msg, '\n')
  os.exit(2)
end
local function int_list(name, text, default, ok)
  if text == '' then return default end
  local out = {}
  for item in text:gmatch('[^,]+') do
    local v = tonumber((item:gsub('%s', '')))
    if not v or v ~= math.floor(v) or not ok(v) then
      die(string.format("--%s: bad value '%s'", name, item))
    end
    out[#out + 1] = v
  end
  if #out == 0 then die(string.format('--%s: an empty list', name)) end
  return out
end
local grid_on = a.grid or a._given.grid_d or a._given.grid_t or a._given.grid_causal or a._given.grid_gqa
local cells = {}
if grid_on then
  if a.runs < 1 or a.runs ~= math.floor(a.runs) then die('--runs needs a whole number >= 1') end
  local ds = int_list('grid-d', a.grid_d, {64, 128}, function(v) return v == 64 or v == 128 end)
  local ts = int_list('grid-t', a.grid_t, {512, 1024, 2048, 4096, 8192, 16384},
    function(v) return v >= 1 and v <= GRID_TOKENS and GRID_TOKENS % v == 0 end)
  local cs = int_list('grid-causal', a.grid_causal, {1, 0}, function(v) return v == 0 or v == 1 end)
  local gs = int_list('grid-gqa', a.grid_gqa, {1, 4}, function(v)
    for _, d in ipairs(ds) do if v < 1 or (2048 / d) % v ~= 0 then return false end end
    return true
  end)
  for _, d in ipairs(ds) do
    for _, c in ipairs(cs) do
      for _, g in ipairs(gs) do
        for _, t in ipairs(ts) do
          local h = 2048 / d
          cells[#cells + 1] = {d = d, t = t, b = GRID_TOKENS / t, h = h, hkv = h / g, causal = c,
            key = string.format('d%d t%d h%d hkv%d c%d', d, t, h, h / g, c)}
        end
      end
    end
  end
end

if not gp.cuda_available() then
  print('attention bench: no CUDA GPU, nothing to measure' ..
    (grid_on and string.format(' (--grid: %d cells)', #cells) or ''))
  return
end

-- --grid ------------------------------------------------------------------
local function median(xs)
  local t = {}
  for i, x in ipairs(xs) do t[i] = x end
  table.sort(t)
  local n = #t
  return n % 2 == 1 and t[(n + 1) / 2] or (t[n / 2] + t[n / 2 + 1]) / 2
end

local function release()
  collectgarbage('collect')
  collectgarbage('collect')
  gp.empty_cache()
end

-- forward flops of a cell (halved when causal); forward+backward is 3.5x
local function fwd_flops(c)
  return 4 * c.b * c.h * c.t * c.t * c.d / (c.causal == 1 and 2 or 1)
end

-- gpush: {fwd_ms, fb_ms} (medians over runs) of one cell; its tensors are garbage when it returns
local function gpush_cell(c)
  local CU = {dtype = 'bf16', device = 'cuda'}
  local qs, kvs = {c.b, c.h, c.t, c.d}, {c.b, c.hkv, c.t, c.d}
  local q, k, v, dout = gp.randn(qs, CU), gp.randn(kvs, CU), gp.randn(kvs, CU), gp.randn(qs, CU)
  local out, lse = gp.empty(qs, CU), gp.empty({c.b, c.h, c.t}, {dtype = 'f32', device = 'cuda'})
  local dq, dk, dv = gp.empty(qs, CU), gp.empty(kvs, CU), gp.empty(kvs, CU)
  local scale, opts = 1 / math.sqrt(c.d), {warmup = 3, iters = a.iters}
  local function fwd() gp.k.attn_fwd(out, lse, q, k, v, scale, 0, 0, c.causal) end
  local function fb()
    gp.k.attn_fwd(out, lse, q, k, v, scale, 0, 0, c.causal)
    gp.k.attn_bwd(dq, dk, dv, q, k, v, out, lse, dout, scale, 0, 0, c.causal)
  end
  local f, b = {}, {}
  for r = 1, a.runs do
    f[r] = gp.time(fwd, opts)
    b[r] = gp.time(fb, opts)
  end
  return {fwd_ms = median(f), fb_ms = median(b), fwd_runs = f, fb_runs = b}
end

-- PyTorch SDPA over every cell in one python3 process: {[key] = result line}, header line (or nil, why)
local function torch_cells(list)
  local cf = os.tmpname()
  local f = assert(io.open(cf, 'w'))
  local plain = {}
  for i, c in ipairs(list) do plain[i] = {key = c.key, b = c.b, h = c.h, hkv = c.hkv, t = c.t, d = c.d, causal = c.causal} end
  f:write(gp.json.encode(plain))
  f:close()
  local p = io.popen(string.format("python3 scripts/bench/torch_peer.py attention-grid --cells '%s' --runs %d --iters %d 2>/dev/null",
    cf, a.runs, a.iters))
  local res, head = {}, nil
  if p then
    for line in p:lines() do
      if line:sub(1, 1) == '{' then
        local ok, val = pcall(gp.json.decode, line)
        if ok and type(val) == 'table' then
          if val.key then
            res[val.key] = val
            local function ms(x) return type(x) == 'number' and string.format('%.3f', x) or '-' end
            io.stderr:write(string.format('  torch %-28s fwd %s ms  f+b %s ms%s\n', val.key, ms(val.fwd_ms),
              ms(val.fb_ms), val.error and ('  ' .. tostring(val.error)) or ''))
          elseif val.torch then
            head = val
          end
        end
      end
    end
    p:close()
  end
  os.remove(cf)
  if next(res) == nil then return nil, nil end
  return res, head
end

local function run_grid()
  local impl = os.getenv('GP_ATTN_IMPL') or 'default'
  local det = os.getenv('GP_ATTN_DETERMINISTIC')
  io.stderr:write(string.format('attention grid: %d cells, %d runs x %d iters a cell\n', #cells, a.runs, a.iters))
  local res = {}
  for i, c in ipairs(cells) do
    res[i] = gpush_cell(c)
    release()
    io.stderr:write(string.format('  gpush [%d/%d] %-28s fwd %.3f ms  f+b %.3f ms\n', i, #cells, c.key,
      res[i].fwd_ms, res[i].fb_ms))
  end
  local peer, head = torch_cells(cells)

  local function tf(flops, ms) return ms and ms > 0 and flops / ms / 1e9 or nil end
  local function num(x, fmt) return x and string.format(fmt, x) or '-' end
  print(string.format('attention grid: bf16, 16K tokens a batch (B = 16384 / T, H = 2048 / D), gpush GP_ATTN_IMPL=%s%s; %d runs x %d iters, median',
    impl, det and (' GP_ATTN_DETERMINISTIC=' .. det) or '', a.runs, a.iters))
  if head then
    print(string.format('PyTorch %s (CUDA %s) on %s: F.scaled_dot_product_attention(is_causal, enable_gqa), one process',
      tostring(head.torch), tostring(head.cuda), tostring(head.device)))
  else
    print('(no PyTorch peer: python3 with torch and a GPU not found; gpush alone)')
  end
  print('')
  print('| shape | gpush fwd TFLOP/s | SDPA fwd | ratio | gpush f+b TFLOP/s | SDPA f+b | ratio |')
  print('|---|---:|---:|---:|---:|---:|---:|')
  local jf = a.json ~= '' and assert(io.open(a.json, 'w')) or nil
  local logs = {fwd = 0, fb = 0}
  local counts = {fwd = 0, fb = 0}
  local wins = {fwd = 0, fb = 0}
  local backends, failed = {}, {}
  for i, c in ipairs(cells) do
    local g, t = res[i], peer and peer[c.key] or {}
    local fl = fwd_flops(c)
    local gf, gfb = tf(fl, g.fwd_ms), tf(3.5 * fl, g.fb_ms)
    local tms, tfbms = tonumber(t.fwd_ms), tonumber(t.fb_ms)
    local sf, sfb = tf(fl, tms), tf(3.5 * fl, tfbms)
    local rf, rfb = sf and gf / sf or nil, sfb and gfb / sfb or nil
    for kind, r in pairs({fwd = rf, fb = rfb}) do
      logs[kind] = logs[kind] + math.log(r)
      counts[kind] = counts[kind] + 1
      if r >= 1 then wins[kind] = wins[kind] + 1 end
    end
    if t.error then failed[#failed + 1] = c.key .. ': ' .. tostring(t.error) end
    if t.backend_fwd or t.backend_fb then
      local bk = tostring(t.backend_fwd) .. ' / ' .. tostring(t.backend_fb)
      backends[bk] = (backends[bk] or 0) + 1
    end
    local shape = string.format('D%d T%d B%d H%d Hkv%d %s', c.d, c.t, c.b, c.h, c.hkv, c.causal == 1 and 'causal' or 'non-causal')
    print(string.format('| %s | %s | %s | %s | %s | %s | %s |', shape, num(gf, '%.1f'), num(sf, '%.1f'), num(rf, '%.2fx'),
      num(gfb, '%.1f'), num(sfb, '%.1f'), num(rfb, '%.2fx')))
    if jf then
      jf:write(gp.json.encode({
        d = c.d, t = c.t, b = c.b, h = c.h, hkv = c.hkv, causal = c.causal, attn_impl = impl,
        runs = a.runs, iters = a.iters,
        gpush_fwd_ms = g.fwd_ms, gpush_fb_ms = g.fb_ms, gpush_fwd_tflops = gf, gpush_fb_tflops = gfb,
        gpush_fwd_runs = g.fwd_runs, gpush_fb_runs = g.fb_runs,
        torch_fwd_ms = tms, torch_fb_ms = tfbms, torch_fwd_tflops = sf, torch_fb_tflops = sfb,
        torch_fwd_runs = t.fwd_runs, torch_fb_runs = t.fb_runs,
        torch_backend_fwd = t.backend_fwd, torch_backend_fb = t.backend_fb, torch_error = t.error,
        torch = head and head.torch, device = head and head.device,
        ratio_fwd = rf, ratio_fb = rfb,
      }), '\n')
    end
  end
  if jf then jf:close() end
  print('')
  if counts.fwd + counts.fb > 0 then
    local function gm(kind) return counts[kind] > 0 and math.exp(logs[kind] / counts[kind]) or nil end
    print(string.format('geometric mean gpush/SDPA: fwd %s (%d of %d cells >= 1.0x), fwd+bwd %s (%d of %d cells >= 1.0x)',
      num(gm('fwd'), '%.2fx'), wins.fwd, counts.fwd, num(gm('fb'), '%.2fx'), wins.fb, counts.fb))
    local bl = {}
    for bk, n in pairs(backends) do bl[#bl + 1] = string.format('%s (%d)', bk, n) end
    table.sort(bl)
    if #bl > 0 then print('SDPA backend fwd / fwd+bwd: ' .. table.concat(bl, ', ')) end
  end
  for _, f in ipairs(failed) do print('SDPA failed: ' .. f) end
  if a.json ~= '' then print('JSON lines: ' .. a.json) end
end

if grid_on then
  run_grid()
  return
end

local B, H, Tn, D = a.batch, a.heads, a.seq, a.head_dim
local CU = {dtype = 'bf16', device = 'cuda'}
local q, k, v = gp.randn({B, H, Tn, D}, CU), gp.randn({B, H, Tn, D}, CU), gp.randn({B, H, Tn, D}, CU)
local dout = gp.randn({B, H, Tn, D}, CU)
local out = gp.empty({B, H, Tn, D}, CU)
local lse = gp.empty({B, H, Tn}, {dtype = 'f32', device = 'cuda'})
local dq, dk, dv = gp.empty({B, H, Tn, D}, CU), gp.empty({B, H, Tn, D}, CU), gp.empty({B, H, Tn, D}, CU)
local scale = 1 / math.sqrt(D)
local flops = 4 * B * H * Tn * Tn * D / 2
local opts = {warmup = 3, iters = a.iters}

local fwd_ms = gp.time(function() gp.k.attn_fwd(out, lse, q, k, v, scale, 0, 0, 1) end, opts)
local bwd_ms = gp.time(function() gp.k.attn_bwd(dq, dk, dv, q, k, v, out, lse, dout, scale, 0, 0, 1) end, opts)
local fb_ms = fwd_ms + bwd_ms
print(string.format('attention bf16 causal B=%d H=%d T=%d D=%d (GP_ATTN_IMPL=%s%s)', B, H, Tn, D,
  os.getenv('GP_ATTN_IMPL') or 'default: wg on compute capability 9.0, else new',
  os.getenv('GP_ATTN_DETERMINISTIC') and (' GP_ATTN_DETERMINISTIC=' .. os.getenv('GP_ATTN_DETERMINISTIC')) or ''))
print(string.format('  forward          %8.3f ms  %7.1f TFLOP/s', fwd_ms, flops / fwd_ms / 1e9))
print(string.format('  backward         %8.3f ms  %7.1f TFLOP/s', bwd_ms, 2.5 * flops / bwd_ms / 1e9))
print(string.format('  forward+backward %8.3f ms  %7.1f TFLOP/s', fb_ms, 3.5 * flops / fb_ms / 1e9))

-- PyTorch SDPA on the same sizes (same process time base: CUDA events, median)
local cmd = string.format('python3 scripts/bench/torch_peer.py attention --batch %d --heads %d --seq %d --head-dim %d 2>/dev/null',
  B, H, Tn, D)
local p = io.popen(cmd)
local txt = p and p:read('*a') or ''
if p then p:close() end
local tf = tonumber(txt:match('attention fwd ([%d%.]+)'))
local tfb = tonumber(txt:match('attention fwd_bwd ([%d%.]+)'))
if tf and tfb then
  print(string.format('  torch SDPA fwd   %8.3f ms  %7.1f TFLOP/s   gpush/torch %.2fx', tf, flops / tf / 1e9, tf / fwd_ms))
  print(string.format('  torch SDPA f+b   %8.3f ms  %7.1f TFLOP/s   gpush/torch %.2fx', tfb, 3.5 * flops / tfb / 1e9,
    tfb / fb_ms))
else
  print('  (no PyTorch peer: python3 with torch and a GPU not found)')
end

-- decode: one query per sequence over a long cache (bytes: the keys and values read once)
local C = a.decode_len
local kc, vc = gp.randn({B, H, C, D}, CU), gp.randn({B, H, C, D}, CU)
local q1, o1 = gp.randn({B, H, D}, CU), gp.empty({B, H, D}, CU)
local lens = gp.full({B}, C, {dtype = 'i32', device = 'cuda'})
local dms = gp.time(function() gp.k.attn_decode(o1, q1, kc, vc, lens, scale, 0, 0) end, opts)
print(string.format('  decode C=%d      %8.3f ms  %7.1f GB/s', C, dms, 2 * B * H * C * D * 2 / dms / 1e6))
