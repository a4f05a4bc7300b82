-- luacheck (Debian's lua-check), run by `make lint` and `make test`
std = 'luajit'
-- set by the gpush binary: gp (the facade, preloaded), help, arg, GPUSH_ROOT
read_globals = {'gp', 'help', 'GPUSH_ROOT', 'jit'}
files['tests/lua'] = {globals = {'gp'}}
files['scripts'] = {globals = {'gp'}}
max_line_length = false -- a doc string is one line, however long
unused_args = false            -- callbacks and rules take the full argument list
ignore = {'581'}               -- not (a >= b) is how NaN-safe checks are written here
