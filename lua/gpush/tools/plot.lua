-- gp.plot: pictures of training runs, drawn by gnuplot (Debian gnuplot-nox,
-- installed by `make deps`) from Lua tables or JSONL logs.
--
--   local recs = gp.plot.read_jsonl('train.jsonl')
--   gp.plot.draw{out = 'run.png', title = 'train_gpt', panels = {
--     {title = 'loss', xlabel = 'step', ylabel = 'nats', lines = {
--        gp.plot.series(recs, 'step', 'loss', {title = 'train'}),
--        gp.plot.series(recs, 'step', 'val_loss', {title = 'held-out', style = 'linespoints'})},
--      hlines = {{y = 1.47, title = 'reference'}}},
--     {title = 'expert load', bars = {labels = {'1', '2'}, groups = {{title = 'layer 1', values = {0.9, 1.1}}}},
--      hlines = {{y = 1}}},
--   }}
--   gp.plot.log('train.jsonl', {out = 'log.svg', x = 'step', y = {'loss', 'val_loss'}})   -- any log
--
-- The picture's format follows the extension of out: .png (cairo's PNG
-- terminal, or libgd's when gnuplot has no cairo) or .svg. Panels are laid
-- out in a grid (cols, default 2 when there are several). A panel holds lines
-- (series {x = {...}, y = {...}, title =, style = 'lines'|'linespoints'|'points'})
-- and horizontal reference lines, or clustered bars (a histogram: labels and
-- groups of values). Each series' numbers go to a data file of their own in a
-- temporary directory, and gnuplot runs once on a script that reads them.
-- Without gnuplot, draw raises an error that says how to install it
-- (gp.plot.available() tells beforehand).
local rt = require 'gpush.core.runtime'
local json = require 'gpush.core.json'
local raise = rt.raise

local doc = require('gpush.core.doc').doc
local M = {}

M.gnuplot = os.getenv('GPUSH_GNUPLOT') or 'gnuplot'
M.INSTALL = 'gnuplot is not installed: `make deps` installs it (Debian: apt-get install gnuplot-nox)'

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
-- a gnuplot string literal (single quotes: no escapes but '' for ')
local function gq(s) return "'" .. tostring(s or ''):gsub("'", "''") .. "'" end
local function ok_status(st) return st == 0 or st == true end

local terminals, probed -- the terminals of the gnuplot probed (M.gnuplot may be changed)
local function gnuplot_terminals()
  if probed ~= M.gnuplot then
    probed = M.gnuplot
    terminals = false
    local f = io.popen(sh_quote(M.gnuplot) .. " -e 'set terminal' 2>&1 </dev/null")
    if f then
      local s = f:read('*a') or ''
      f:close()
      if s:find('Available terminal types', 1, true) then
        terminals = {}
        for name in s:gmatch('\n%s*([%w_]+)%s') do terminals[name] = true end
      end
    end
  end
  return terminals
end

-- true when gnuplot runs here
function M.available() return gnuplot_terminals() ~= false end

-- every JSON value of a JSONL file (blank lines skipped; a bad line is an error naming it)
function M.read_jsonl(path)
  local f, err = io.open(path, 'rb')
  if not f then raise('plot: cannot open ' .. tostring(err)) end
  local out, n = {}, 0
  for line in f:lines() do
    n = n + 1
    if line:find('%S') then
      local ok, v = pcall(json.decode, line)
      if not ok then
        f:close()
        raise(string.format('plot: %s:%d: %s', path, n, (tostring(v):gsub('^.-:%d+: ', ''))))
      end
      out[#out + 1] = v
    end
  end
  f:close()
  return out
end

local function finite(v) return type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge end

-- the points (x, y) of the records that have numbers in both fields (and
-- match opts.where = {field = value, ...}), in record order: a series
-- {x =, y =, title = opts.title or y, style = opts.style}
function M.series(records, x, y, opts)
  opts = opts or {}
  local xs, ys = {}, {}
  for _, r in ipairs(records) do
    local keep = type(r) == 'table' and finite(r[x]) and finite(r[y])
    if keep and opts.where then
      for k, v in pairs(opts.where) do if r[k] ~= v then keep = false end end
    end
    if keep then xs[#xs + 1] = r[x]; ys[#ys + 1] = r[y] end
  end
  return {x = xs, y = ys, title = opts.title or y, style = opts.style}
end

-- the distinct values of a field over the records, in first-seen order
function M.values(records, field)
  local seen, out = {}, {}
  for _, r in ipairs(records) do
    local v = type(r) == 'table' and r[field]
    if v ~= nil and v ~= false and not seen[v] then seen[v] = true; out[#out + 1] = v end
  end
  return out
end

local function terminal_for(out, width, height)
  local ext = out:match('%.([%w]+)$')
  ext = ext and ext:lower()
  local t = gnuplot_terminals()
  if not t then raise('plot: ' .. M.INSTALL) end
  if ext == 'svg' then
    return string.format('svg size %d,%d noenhanced dynamic background rgb "white" font "sans,11"', width, height)
  elseif ext == 'png' then
    if t.pngcairo then return string.format('pngcairo size %d,%d noenhanced font "sans,10"', width, height) end
    return string.format('png size %d,%d noenhanced', width, height)
  end
  raise(string.format('plot: %s: the picture must be a .png or a .svg file', out))
end

local function has_data(p)
  if p.bars then return p.bars.labels and #p.bars.labels > 0 end
  for _, s in ipairs(p.lines or {}) do if #s.x > 0 then return true end end
  return false
end

-- draw the panels into spec.out; returns spec.out. spec: out, title, panels,
-- cols (2 when there are several panels), width and height of a panel in pixels (560 x 380)
function M.draw(spec)
  if type(spec) ~= 'table' or type(spec.out) ~= 'string' or type(spec.panels) ~= 'table' then
    raise('plot: usage gp.plot.draw{out = FILE.png|FILE.svg, panels = {{title =, lines = {...}}, ...}}')
  end
  local panels = {}
  for _, p in ipairs(spec.panels) do if has_data(p) then panels[#panels + 1] = p end end
  if #panels == 0 then raise('plot: nothing to draw for ' .. spec.out .. ' (no panel has data)') end
  local cols = math.min(spec.cols or (#panels > 1 and 2 or 1), #panels)
  local rows = math.ceil(#panels / cols)
  local pw, ph = spec.width or 560, spec.height or 380
  local term = terminal_for(spec.out, pw * cols, ph * rows + (spec.title and 30 or 0))
  local base = os.tmpname()
  local files = {base}
  local function datafile(lines)
    local name = string.format('%s.%d.dat', base, #files)
    files[#files + 1] = name
    local f = assert(io.open(name, 'w'))
    f:write(table.concat(lines, '\n'), '\n')
    f:close()
    return name
  end
  local g = {'set terminal ' .. term, 'set output ' .. gq(spec.out)}
  g[#g + 1] = string.format('set multiplot layout %d,%d%s', rows, cols, spec.title and (' title ' .. gq(spec.title)) or '')
  for _, p in ipairs(panels) do
    g[#g + 1] = 'reset'
    g[#g + 1] = 'set grid'
    g[#g + 1] = 'set key top right'
    g[#g + 1] = 'set title ' .. gq(p.title)
    if p.xlabel then g[#g + 1] = 'set xlabel ' .. gq(p.xlabel) end
    if p.ylabel then g[#g + 1] = 'set ylabel ' .. gq(p.ylabel) end
    if p.logy then g[#g + 1] = 'set logscale y' end
    if p.logx then g[#g + 1] = 'set logscale x' end
    if p.yrange then g[#g + 1] = string.format('set yrange [%s:%s]', p.yrange[1] or '', p.yrange[2] or '') end
    if p.key == false then g[#g + 1] = 'unset key' elseif p.key then g[#g + 1] = 'set key ' .. p.key end
    local parts = {}
    if p.bars then
      local b = p.bars
      local every = b.label_every or math.max(1, math.ceil(#b.labels / 16))
      local lines = {}
      for i, label in ipairs(b.labels) do
        -- a data file's string column: double quotes (gnuplot reads no single-quoted ones there)
        local row = {'"' .. tostring((i - 1) % every == 0 and label or ''):gsub('"', "'") .. '"'}
        for _, grp in ipairs(b.groups) do row[#row + 1] = string.format('%.10g', grp.values[i] or 0) end
        lines[i] = table.concat(row, ' ')
      end
      local file = datafile(lines)
      g[#g + 1] = 'set style data histograms'
      g[#g + 1] = 'set style histogram clustered gap 1'
      g[#g + 1] = 'set style fill solid 0.85 noborder'
      g[#g + 1] = 'set boxwidth 0.9'
      g[#g + 1] = 'set yrange [0:*]'
      g[#g + 1] = 'set xtics nomirror'
      for j, grp in ipairs(b.groups) do
        parts[#parts + 1] = string.format('%s using %d%s title %s', j == 1 and gq(file) or "''", j + 1,
          j == 1 and ':xtic(1)' or '', gq(grp.title or ''))
      end
    else
      for _, s in ipairs(p.lines or {}) do
        if #s.x > 0 then
          local lines = {}
          for i = 1, #s.x do lines[i] = string.format('%.10g %.10g', s.x[i], s.y[i]) end
          local style = s.style or (#s.x == 1 and 'points' or 'lines')
          local extra = style == 'lines' and ' lw 1.5' or (style == 'linespoints' and ' lw 1.5 pt 7 ps 0.6' or ' pt 7 ps 0.8')
          parts[#parts + 1] = string.format('%s using 1:2 with %s%s title %s', gq(datafile(lines)), style, extra, gq(s.title))
        end
      end
    end
    for _, h in ipairs(p.hlines or {}) do
      parts[#parts + 1] = string.format('%.10g with lines dt 2 lw 1.5 lc rgb %s title %s', h.y, gq(h.color or '#555555'),
        gq(h.title or ''))
    end
    g[#g + 1] = 'plot ' .. table.concat(parts, ', \\\n  ')
  end
  g[#g + 1] = 'unset multiplot'
  g[#g + 1] = 'set output'
  local script = base .. '.gp'
  files[#files + 1] = script
  local f = assert(io.open(script, 'w'))
  f:write(table.concat(g, '\n'), '\n')
  f:close()
  local errfile = base .. '.err'
  files[#files + 1] = errfile
  os.remove(spec.out)
  local st = os.execute(string.format('%s %s >%s 2>&1 </dev/null', sh_quote(M.gnuplot), sh_quote(script), sh_quote(errfile)))
  local ef = io.open(errfile, 'rb')
  local err = ef and ef:read('*a') or ''
  if ef then ef:close() end
  local of = io.open(spec.out, 'rb')
  local size = of and of:seek('end') or 0
  if of then of:close() end
  for _, name in ipairs(files) do os.remove(name) end
  if not ok_status(st) or size == 0 then
    raise(string.format('plot: gnuplot failed to draw %s: %s', spec.out, err ~= '' and err or 'no output'))
  end
  return spec.out
end

local SKIP = {step = true, time = true, final = true}

-- draw a log (a JSONL path or a list of records): one panel per y field
-- (opts.y: a list or 'a,b'; default every numeric field but x, time and final
-- that at least two records hold), x = opts.x ('step'), one series per value
-- of opts.by ('run' when the records have it); out = opts.out
function M.log(src, opts)
  opts = opts or {}
  local recs = type(src) == 'string' and M.read_jsonl(src) or src
  if type(recs) ~= 'table' then raise('plot.log: needs a JSONL path or a list of records') end
  local x = opts.x or 'step'
  local ys = opts.y
  if type(ys) == 'string' then
    local t = {}
    for name in ys:gmatch('[^,%s]+') do t[#t + 1] = name end
    ys = t
  end
  if not ys or #ys == 0 then
    local count, order = {}, {}
    for _, r in ipairs(recs) do
      if type(r) == 'table' and finite(r[x]) then
        for k, v in pairs(r) do
          if finite(v) and k ~= x and not SKIP[k] then
            if not count[k] then count[k] = 0; order[#order + 1] = k end
            count[k] = count[k] + 1
          end
        end
      end
    end
    ys = {}
    for _, k in ipairs(order) do if count[k] >= 2 then ys[#ys + 1] = k end end
    table.sort(ys)
  end
  local by = opts.by
  if by == nil and #M.values(recs, 'run') > 0 then by = 'run' end
  local groups = by and M.values(recs, by) or {}
  local panels = {}
  for _, y in ipairs(ys) do
    local lines = {}
    if #groups > 0 then
      for _, gv in ipairs(groups) do
        lines[#lines + 1] = M.series(recs, x, y, {where = {[by] = gv}, title = tostring(gv)})
      end
    else
      lines[1] = M.series(recs, x, y)
    end
    panels[#panels + 1] = {title = y, xlabel = x, lines = lines, key = #lines > 1 and 'top right' or false}
  end
  if #panels == 0 then raise('plot.log: the records have no numeric field to plot against ' .. x) end
  return M.draw {out = opts.out or raise('plot.log: needs out = FILE.png or FILE.svg'), title = opts.title, panels = panels,
                 cols = opts.cols}
end

-- draw a log into a picture: plot.from_log(log_path, out_path, spec), spec
-- = {x = 'step', y = {'loss', 'val_loss'} or 'loss,val_loss', by =, title =,
-- cols =} (gp.plot.log's options; default: every numeric field). For scripts
-- that keep a JSONL log and want its picture in one call.
function M.from_log(log_path, out_path, spec)
  if type(log_path) ~= 'string' or type(out_path) ~= 'string' then
    raise('plot.from_log: usage gp.plot.from_log(log.jsonl, out.png|out.svg, {x=, y=, by=, title=})')
  end
  local o = {}
  for k, v in pairs(spec or {}) do o[k] = v end
  o.out = out_path
  return M.log(log_path, o)
end

-- the file a script's --plot writes its log to when --log is not given: FILE.png -> FILE.jsonl
function M.log_path(out) return (out:gsub('%.[%w]+$', '')) .. '.jsonl' end

-- draw, or say why not: for scripts' --plot (a missing gnuplot prints a line instead of failing the run);
-- fn(out) draws into out; log, the run's JSONL log, is named in that line so that it can be drawn elsewhere
function M.try(fn, out, log)
  if not M.available() then
    print('plot: ' .. M.INSTALL .. '; no picture drawn' .. (type(log) == 'string' and
      string.format(' (the numbers are in %s: gpush scripts/plot.lua %s draws them where gnuplot runs)', log, log) or ''))
    return nil
  end
  out = fn(out)
  print('plot: ' .. out)
  return out
end

doc(M.available, 'gp.plot.available()', 'true when gnuplot runs here (`make deps` installs gnuplot-nox)')
doc(M.read_jsonl, 'gp.plot.read_jsonl(path)', 'the records of a JSONL log as a list')
doc(M.series, "gp.plot.series(records, 'step', 'loss', {title=, style='lines', where={run='moe'}})",
  'a series {x, y, title} of the records with numbers in both fields (and the where fields equal)')
doc(M.values, "gp.plot.values(records, 'run')", 'the distinct values of a field over the records, in first-seen order')
doc(M.draw, "gp.plot.draw{out='f.png'|'f.svg', title=, cols=2, panels={{title=, xlabel=, ylabel=, logy=, lines={series...}, hlines={{y=, title=}}, bars={labels=, groups={{title=, values=}}}}}}",
  'draw panels of curves, reference lines or clustered bars with gnuplot (PNG or SVG by the extension); returns out')
doc(M.log, "gp.plot.log('log.jsonl' or records, {out=, x='step', y={'loss', 'val_loss'}, by='run', title=})",
  'draw any log: one panel per y field (default: every numeric field), one curve per value of by')
doc(M.from_log, "gp.plot.from_log('log.jsonl', 'out.png', {x='step', y='loss,val_loss', by=, title=})",
  'draw a JSONL log into a PNG or SVG (gp.plot.log with out = out_path); returns out_path')
doc(M.log_path, "gp.plot.log_path('out.png')", "where a script's --plot keeps its log when --log is not given: out.jsonl")
doc(M.try, 'gp.plot.try(fn, out, log)', "fn(out) when gnuplot is installed (prints 'plot: FILE'), else a line saying how to install it and, given the run's JSONL log, how to draw it elsewhere")

return M
