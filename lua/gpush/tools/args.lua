-- gp.args: command-line flags for scripts.
--
--   local o = gp.args.parse(arg, {
--     {'iters', 1000, 'training steps'},            -- --iters 500 (a number: the default's type)
--     {'data', '', 'a text file'},                  -- --data FILE (a string)
--     {'bf16', false, 'train in bf16'},             -- --bf16 / --no-bf16 (a flag)
--     {'out', nil, 'checkpoint path', type = 'string'},  -- no default: give the type
--   }, {usage = 'gpush scripts/x.lua [flags]'})
--   o.iters, o.bf16, o.out      -- '-' in names becomes '_' in keys; o._rest: positional arguments;
--                               -- o._given[key]: the flag was on the command line
--   gp.args.preset(o, {iters = 50, batch = 4})   -- a preset (--tiny): sets what the command line did not give
--
-- `--name value` and `--name=value`; `--help` (or -h) prints every flag with
-- its default and exits (opts.exit = false returns nil, the help text instead).
-- An unknown flag, a missing value or a non-number for a number flag is an
-- error that names the flag.
local rt = require 'gpush.core.runtime'
local raise = rt.raise

local doc = require('gpush.core.doc').doc
local M = {}

local function key_of(name) return (name:gsub('-', '_')) end

local function normalize(spec)
  local flags, byname = {}, {}
  for i, s in ipairs(spec) do
    if type(s) ~= 'table' or type(s[1]) ~= 'string' then raise(string.format('args: spec entry %d must be {name, default, help}', i)) end
    local f = {name = s[1], default = s[2], help = s[3] or '', type = s.type}
    if not f.type then
      local t = type(f.default)
      f.type = t == 'boolean' and 'flag' or t
    end
    if f.type == 'boolean' then f.type = 'flag' end
    if f.type ~= 'number' and f.type ~= 'string' and f.type ~= 'flag' then
      raise(string.format("args: flag --%s needs a default or type = 'number'|'string'|'flag'", f.name))
    end
    flags[#flags + 1] = f
    byname[f.name] = f
    byname[key_of(f.name)] = f
  end
  return flags, byname
end

function M.help(spec, opts)
  opts = opts or {}
  local flags = normalize(spec)
  local lines = {}
  if opts.usage then lines[#lines + 1] = 'usage: ' .. opts.usage end
  if opts.description then lines[#lines + 1] = opts.description end
  if #lines > 0 then lines[#lines + 1] = '' end
  lines[#lines + 1] = 'flags:'
  local width = 0
  local heads = {}
  for i, f in ipairs(flags) do
    local h = '--' .. f.name .. (f.type == 'flag' and '' or (f.type == 'number' and ' N' or ' S'))
    heads[i] = h
    if #h > width then width = #h end
  end
  for i, f in ipairs(flags) do
    local d = ''
    if f.default ~= nil and f.default ~= '' and f.default ~= false then d = ' (default ' .. tostring(f.default) .. ')' end
    lines[#lines + 1] = string.format('  %-' .. width .. 's  %s%s', heads[i], f.help, d)
  end
  lines[#lines + 1] = string.format('  %-' .. width .. 's  %s', '--help', 'print this and exit')
  return table.concat(lines, '\n')
end

-- argv: a list of strings (a script's `arg`); returns the options table
function M.parse(argv, spec, opts)
  opts = opts or {}
  argv = argv or {}
  local flags, byname = normalize(spec)
  local o = {_rest = {}, _given = {}} -- _given: the keys set on the command line (not defaults)
  for _, f in ipairs(flags) do o[key_of(f.name)] = f.default end
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == '--help' or a == '-h' then
      local text = M.help(spec, opts)
      if opts.exit == false then return nil, text end
      print(text)
      os.exit(0)
    end
    local name, val = a:match('^%-%-([^=]+)=(.*)$')
    if not name then name = a:match('^%-%-(.+)$') end
    if name then
      local neg = false
      local f = byname[name]
      if not f and name:match('^no%-') then
        f = byname[name:sub(4)]
        if f and f.type ~= 'flag' then raise(string.format('args: --%s is not a flag (no --no-%s)', f.name, f.name)) end
        neg = f ~= nil
      end
      if not f then raise(string.format('args: unknown flag --%s (see --help)', name)) end
      o._given[key_of(f.name)] = true
      if f.type == 'flag' then
        if val ~= nil then
          if val == 'true' or val == '1' or val == 'yes' then o[key_of(f.name)] = not neg
          elseif val == 'false' or val == '0' or val == 'no' then o[key_of(f.name)] = neg
          else raise(string.format("args: --%s is a flag; '%s' is not true or false", f.name, val)) end
        else
          o[key_of(f.name)] = not neg
        end
      else
        if val == nil then
          i = i + 1
          val = argv[i]
          if val == nil then raise(string.format('args: --%s needs a value', f.name)) end
        end
        if f.type == 'number' then
          local v = tonumber(val)
          if not v then raise(string.format("args: --%s needs a number, got '%s'", f.name, val)) end
          o[key_of(f.name)] = v
        else
          o[key_of(f.name)] = val
        end
      end
    else
      o._rest[#o._rest + 1] = a
    end
    i = i + 1
  end
  return o
end

-- set the values of a preset (a table of keys as parse returns them) except
-- those the command line gave; returns o
function M.preset(o, values)
  if type(o) ~= 'table' or type(values) ~= 'table' then raise('args.preset: usage gp.args.preset(o, {key = value, ...})') end
  local given = o._given or {}
  for k, v in pairs(values) do
    if not given[k] then o[k] = v end
  end
  return o
end

doc(M.parse, "gp.args.parse(arg, {{'iters', 1000, 'help'}, ...}, {usage=})", 'script flags: --name value, --name=value, --flag, --no-flag, --help')
doc(M.preset, 'gp.args.preset(o, {iters = 50, ...})', 'apply a preset to parsed flags: each value unless the command line gave that flag (o._given)')
doc(M.help, 'gp.args.help(spec, {usage=, description=})', 'the --help text of a flag spec')

return M
