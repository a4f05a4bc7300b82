-- gp.plot (gnuplot from Lua) and every training script's --tiny --plot: a
-- valid PNG (its signature, a nonzero size) from a CPU run of under two
-- minutes. The drawing tests skip, saying why, where gnuplot is not
-- installed (`make deps` installs gnuplot-nox).
local T = require 'lib'
local plot = gp.plot

local PNG_SIG = '\137PNG\r\n\26\n'

local function need_gnuplot()
  if not plot.available() then T.skip('gnuplot is not installed (make deps installs gnuplot-nox)') end
end

-- the first bytes and the size of a file
local function head_size(path)
  local f = io.open(path, 'rb')
  if not f then return nil, 0 end
  local head = f:read(8) or ''
  local size = f:seek('end')
  f:close()
  return head, size
end
local function is_png(path)
  local head, size = head_size(path)
  return head == PNG_SIG and size > 1000, string.format('%s: %d bytes, head %q', path, size, tostring(head))
end

local function tmp(ext)
  local p = os.tmpname()
  os.remove(p)
  return p .. ext
end

local function write_log(path, recs)
  local f = assert(io.open(path, 'w'))
  for _, r in ipairs(recs) do f:write(gp.json.encode(r), '\n') end
  f:close()
end

local LOG = {}
for s = 10, 100, 10 do
  LOG[#LOG + 1] = {step = s, loss = 3 / math.sqrt(s), lr = 1e-3 * (1 - s / 200), tokens_per_s = 1000 + s, time = s / 10}
  if s % 50 == 0 then LOG[#LOG + 1] = {step = s, val_loss = 3.2 / math.sqrt(s), train_loss = 3 / math.sqrt(s)} end
end

T.test('series, values and read_jsonl: the points with numbers in both fields, a bad line named', function()
  local s = plot.series(LOG, 'step', 'val_loss', {title = 'held-out'})
  T.same(s.x, {50, 100}); T.eq(s.title, 'held-out')
  T.eq(#plot.series(LOG, 'step', 'loss').x, 10)
  local recs = {{run = 'a', step = 1, y = 1}, {run = 'b', step = 1, y = 2}, {run = 'a', step = 2, y = 3}}
  local vals = plot.values(recs, 'run')
  T.eq(#vals, 2); T.eq(vals[1], 'a'); T.eq(vals[2], 'b')
  T.same(plot.series(recs, 'step', 'y', {where = {run = 'a'}}).y, {1, 3})
  local p = tmp('.jsonl')
  write_log(p, LOG)
  T.eq(#plot.read_jsonl(p), #LOG)
  local f = assert(io.open(p, 'a')); f:write('{bad\n'); f:close()
  T.raises(function() plot.read_jsonl(p) end, ':' .. (#LOG + 1) .. ':')
  os.remove(p)
  T.eq(plot.log_path('runs/out.png'), 'runs/out.jsonl')
end)

T.test('draw: PNG and SVG by the extension, curves, reference lines and bars', function()
  need_gnuplot()
  local png, svg = tmp('.png'), tmp('.svg')
  local spec = {title = "a test's picture", panels = {
    {title = 'loss', xlabel = 'step', lines = {plot.series(LOG, 'step', 'loss'), plot.series(LOG, 'step', 'val_loss', {style = 'linespoints'})},
     hlines = {{y = 0.5, title = 'baseline'}}},
    {title = 'load', bars = {labels = {'1', '2', '3'}, groups = {{title = 'layer 1', values = {0.9, 1.1, 1}}, {title = 'layer 2', values = {1, 1, 1}}}}},
  }}
  spec.out = png
  T.eq(plot.draw(spec), png)
  T.ok(is_png(png))
  spec.out = svg
  plot.draw(spec)
  local f = assert(io.open(svg)); local s = f:read('*a'); f:close()
  T.ok(s:find('<svg', 1, true) and s:find('baseline', 1, true), 'an SVG with the legend')
  os.remove(png); os.remove(svg)
  T.raises(function() plot.draw {out = tmp('.jpg'), panels = spec.panels} end, '.png or a .svg')
  T.raises(function() plot.draw {out = png, panels = {{title = 'empty', lines = {plot.series({}, 'step', 'loss')}}}} end, 'nothing to draw')
  T.raises(function() plot.draw {} end, 'usage')
end)

T.test('from_log and scripts/plot.lua draw any log; several logs, one curve each', function()
  need_gnuplot()
  local log, out = tmp('.jsonl'), tmp('.png')
  write_log(log, LOG)
  T.eq(plot.from_log(log, out, {y = 'loss,val_loss'}), out)
  T.ok(is_png(out))
  os.remove(out)
  T.raises(function() plot.from_log(log, out, {y = 'nosuch'}) end, 'nothing to draw')
  local cli = T.exe .. ' ' .. T.root .. '/scripts/plot.lua '
  local o, rc = T.sh(cli .. log .. ' --out ' .. out .. ' --x step --y loss,lr')
  T.eq(rc, 0, o); T.ok(is_png(out))
  local log2 = tmp('.jsonl')
  write_log(log2, LOG)
  local svg = tmp('.svg')
  o, rc = T.sh(cli .. log .. ' ' .. log2 .. ' --out ' .. svg .. ' --y loss')
  T.eq(rc, 0, o)
  local _, size = head_size(svg)
  T.ok(size > 0, o)
  o, rc = T.sh(cli)
  T.ok(rc ~= 0 and o:find('give a JSONL log', 1, true), o)
  for _, p in ipairs {log, log2, out, svg} do os.remove(p) end
end)

T.test('without gnuplot: a clear error from draw, a line (not a failure) from a script\'s --plot', function()
  local saved = plot.gnuplot
  plot.gnuplot = '/nonexistent/gnuplot'
  local ok, err = pcall(plot.draw, {out = tmp('.png'), panels = {{title = 'l', lines = {plot.series(LOG, 'step', 'loss')}}}})
  local avail = plot.available()
  local tried = plot.try(function() error('not reached') end)
  plot.gnuplot = saved
  T.ok(not avail, 'available() is false')
  T.ok(not ok and tostring(err):find('gnuplot is not installed', 1, true) and tostring(err):find('make deps', 1, true), tostring(err))
  T.eq(tried, nil)
  local out = tmp('.png')
  local o, rc = T.sh('GPUSH_GNUPLOT=/nonexistent/gnuplot ' .. T.exe .. ' --device cpu ' .. T.root ..
    '/scripts/train_gpt.lua --tiny --data corpus --iters 4 --eval-every 0 --eval-iters 1 --quiet --plot ' .. out)
  T.eq(rc, 0, o)
  T.ok(o:find('gnuplot is not installed', 1, true), o)
  T.ok(o:find('gpush scripts/plot.lua ' .. plot.log_path(out) .. ' draws them', 1, true), 'names the log to draw later: ' .. o)
  o, rc = T.sh('GPUSH_GNUPLOT=/nonexistent/gnuplot ' .. T.exe .. ' ' .. T.root .. '/scripts/plot.lua x.jsonl')
  T.eq(rc, 1); T.ok(o:find('gnuplot is not installed', 1, true), o)
  os.remove(out); os.remove(plot.log_path(out))
end)

-- every training script's --tiny --plot: under two minutes on the CPU (default
-- data: Shakespeare when fetched, else data/corpus.txt), a valid PNG
local SCRIPTS = {
  {'train_gpt', '', 'held%-out loss'},
  {'moe', '', 'moe %- dense'},
  {'titans', '--task recall', 'recall accuracy: mac'},
  {'titans', '--task lm', 'final: held%-out loss'},
}
for _, s in ipairs(SCRIPTS) do
  T.test(string.format('scripts/%s.lua %s --tiny --plot out.png: a PNG in under two minutes (cpu)', s[1], s[2]), function()
    need_gnuplot()
    local out = tmp('.png')
    local t0 = gp.train.now()
    local o, rc = T.sh(string.format('%s --device cpu %s/scripts/%s.lua %s --tiny --quiet --plot %s', T.exe, T.root, s[1], s[2], out))
    local dt = gp.train.now() - t0
    T.eq(rc, 0, o)
    T.ok(o:find(s[3]), o)
    T.ok(o:find('plot: ' .. out, 1, true), o)
    T.ok(is_png(out))
    T.ok(dt < 120, string.format('%.1f s', dt))
    print(string.format('    %s %s --tiny --plot: %.1f s', s[1], s[2], dt))
    local recs = plot.read_jsonl(plot.log_path(out))
    T.ok(#recs > 2, 'the log beside the picture')
    os.remove(out); os.remove(plot.log_path(out))
  end)
end
