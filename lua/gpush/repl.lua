-- The interactive prompt: readline editing and history, multi-line chunks,
-- expressions print their values, errors never leave the prompt.
local ffi = require 'ffi'
pcall(ffi.cdef, [[
char *readline(const char *prompt);
void add_history(const char *line);
void free(void *p);
int isatty(int fd);
]])
local C = ffi.C

local M = {}

local function read_line(prompt, tty)
  if tty then
    local p = C.readline(prompt)
    if p == nil then return nil end
    local s = ffi.string(p)
    C.free(p)
    return s
  end
  io.write(prompt)
  io.flush()
  return io.read('*l')
end

local function show(...)
  local n = select('#', ...)
  if n == 0 then return end
  local parts = {}
  for i = 1, n do parts[i] = tostring((select(i, ...))) end
  print(table.concat(parts, '\t'))
end

-- compile a chunk: as an expression first, then as statements; 'more' when incomplete
local function compile(src)
  local f = loadstring('return ' .. src, '=stdin')
  if f then return f end
  local err
  f, err = loadstring(src, '=stdin')
  if f then return f end
  if err:find('<eof>', 1, true) then return nil, 'more' end
  return nil, err
end

function M.run()
  local tty = C.isatty(0) == 1
  if tty then print('gpush ' .. (gp and gp.version() or '') .. '  (help() for help, Ctrl-D to leave)') end
  while true do
    local line = read_line('gp> ', tty)
    if line == nil then if tty then io.write('\n') end break end
    local src = line
    local f, err = compile(src)
    while not f and err == 'more' do
      local more = read_line('>> ', tty)
      if more == nil then break end
      src = src .. '\n' .. more
      f, err = compile(src)
    end
    if tty and src:find('%S') then C.add_history(src) end
    if f then
      local res = {xpcall(f, debug.traceback)}
      if res[1] then show(unpack(res, 2, table.maxn(res))) else print(res[2]) end
    elseif err ~= 'more' and src:find('%S') then
      print(err)
    end
  end
end

return M
