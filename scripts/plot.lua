-- plot.lua: draw any JSONL log (a training script's --log) with gnuplot:
-- one panel per y field against x, one curve per value of --by (the field
-- 'run' when the records have it). PNG or SVG by the extension of --out.
--
--   gpush scripts/plot.lua train.jsonl --out train.png
--   gpush scripts/plot.lua train.jsonl --out train.svg --x step --y loss,val_loss
--   gpush scripts/plot.lua a.jsonl b.jsonl --out both.png --y val_loss   -- several logs: one curve each
local gp = rawget(_G, 'gp') or require 'gpush'

local o = gp.args.parse(arg, {
  {'out', '', 'the picture: FILE.png or FILE.svg (default: the first log with .png)'},
  {'x', 'step', 'the field along the x axis'},
  {'y', '', 'the fields to draw, comma-separated (default: every numeric field that two records hold)'},
  {'by', '', 'one curve per value of this field (default: run when the records have it; the file name with several logs)'},
  {'title', '', 'a title above the panels'},
  {'cols', 2, 'panels per row'},
}, {usage = 'gpush scripts/plot.lua LOG.jsonl [LOG2.jsonl ...] --out FILE.png|FILE.svg [--x step --y loss,val_loss]',
    description = 'Draw a JSONL log with gnuplot.'})

local logs = o._rest
if #logs == 0 then
  io.stderr:write('plot.lua: give a JSONL log (see --help)\n')
  os.exit(2)
end
if not gp.plot.available() then
  io.stderr:write('plot.lua: ' .. gp.plot.INSTALL .. '\n')
  os.exit(1)
end
local out = o.out ~= '' and o.out or (logs[1]:gsub('%.[%w]+$', '') .. '.png')
local by = o.by ~= '' and o.by or nil
local src = logs[1]
if #logs > 1 then
  -- several logs: their records together, each tagged with its file's name
  src, by = {}, by or 'log'
  for _, path in ipairs(logs) do
    local name = path:match('([^/]*)$'):gsub('%.jsonl$', '')
    for _, r in ipairs(gp.plot.read_jsonl(path)) do
      if type(r) == 'table' and r.log == nil then r.log = name end
      src[#src + 1] = r
    end
  end
end
gp.plot.log(src, {out = out, x = o.x, y = o.y ~= '' and o.y or nil, by = by, cols = o.cols,
                  title = o.title ~= '' and o.title or nil})
print('plot: ' .. out)
