-- The gpush command line: scripts and their arguments, -e, -, -i, --device,
-- --version, --help, a script error's traceback and exit status, the C stack
-- printed on a fatal signal, and GPUSH_JIT (the compiler off under compute-sanitizer).
local T = require 'lib'

local exe = T.exe
local tmp = os.tmpname()

-- run a shell command; returns its output and exit status
local sh = T.sh

local function write(path, text)
  local f = assert(io.open(path, 'w'))
  f:write(text)
  f:close()
end

T.test('a script gets its arguments in arg', function()
  write(tmp, 'print(arg[0], arg[1], arg[2], #arg, ...)\n')
  local out, rc = sh(exe .. ' ' .. tmp .. ' a b')
  T.eq(rc, 0)
  T.eq(out, tmp .. '\ta\tb\t2\ta\tb\n')
end)

T.test('-e, stdin and -', function()
  local out, rc = sh(exe .. " -e 'print(1 + 1)' -e 'print(gp.zeros{2}:numel())'")
  T.eq(rc, 0)
  T.eq(out, '2\n2\n')
  out, rc = sh("echo 'print(gp.arange(3):totable()[3])' | " .. exe .. ' -')
  T.eq(out, '2\n'); T.eq(rc, 0)
  out, rc = sh("echo 'print(42)' | " .. exe)
  T.eq(out, '42\n'); T.eq(rc, 0)
end)

T.test('-i runs the script, then reads the prompt', function()
  write(tmp, 'x = 41\n')
  local out, rc = sh("echo 'print(x + 1)' | " .. exe .. ' -i ' .. tmp)
  T.eq(rc, 0)
  T.ok(out:find('42', 1, true), out)
end)

T.test('a script error prints a traceback and exits 1', function()
  write(tmp, 'local function f() return gp.zeros{2,3} + gp.zeros{4} end\nf()\n')
  local out, rc = sh(exe .. ' ' .. tmp)
  T.eq(rc, 1)
  T.ok(out:find('add: shapes (2,3) and (4) do not broadcast', 1, true), out)
  T.ok(out:find('stack traceback', 1, true), out)
  T.ok(out:find(':1:', 1, true), 'the error points at the script line: ' .. out)
  out, rc = sh(exe .. ' /nonexistent/script.lua')
  T.eq(rc, 1)
  T.ok(out:find('cannot open', 1, true), out)
  out, rc = sh(exe .. " -e 'error(\"boom\")'")
  T.eq(rc, 1)
  T.ok(out:find('boom', 1, true))
end)

T.test('--device, --version, --help and bad options', function()
  local out, rc = sh(exe .. " --device cpu -e 'print(gp.device(), gp.zeros{1}.device)'")
  T.eq(rc, 0); T.eq(out, 'cpu\tcpu\n')
  out, rc = sh(exe .. ' --version')
  T.eq(rc, 0)
  T.ok(out:find('^gpush %d'), out)
  T.ok(out:find('CUDA', 1, true) or out:find('without CUDA', 1, true), out)
  out, rc = sh(exe .. ' --help')
  T.eq(rc, 0); T.ok(out:find('usage', 1, true))
  out, rc = sh(exe .. ' --device tpu -e 1')
  T.eq(rc, 2); T.ok(out:find('cpu, cuda or cuda:N', 1, true), out)
  out, rc = sh(exe .. " --device cuda:x -e 1")
  T.eq(rc, 2); T.ok(out:find('cuda:N', 1, true), out)
  out, rc = sh(exe .. ' --bogus')
  T.eq(rc, 2); T.ok(out:find('unknown option', 1, true))
  if not gp.cuda_available() then
    out, rc = sh(exe .. " --device cuda -e 'print(1)'")
    T.eq(rc, 1); T.ok(out:find('cuda', 1, true), out)
  end
end)

T.test('stdout to a pipe is line-buffered: each line arrives as it is printed', function()
  write(tmp, "print('first')\nos.execute('sleep 4')\nprint('last')\n")
  local f = io.popen(exe .. ' ' .. tmp)
  local first = f:read('*l')
  local t1 = gp.train.now()
  local rest = f:read('*a')
  local gap = gp.train.now() - t1
  f:close()
  T.eq(first, 'first')
  T.eq(rest, 'last\n')
  -- measured from the first line, not from the start (a slow start, under a sanitizer, says nothing of buffering)
  T.ok(gap > 3, string.format('the last line came %.1f s after the first, with the script sleeping 4 s between', gap))
end)

T.test('require finds a module next to the script, from any directory', function()
  local dir = sh('mktemp -d'):gsub('%s+$', '')
  write(dir .. '/mymod.lua', 'return {x = 7}\n')
  write(dir .. '/main.lua', "print(require('mymod').x)\n")
  local out, rc = sh('cd / && ' .. exe .. ' ' .. dir .. '/main.lua')
  T.eq(rc, 0, out); T.eq(out, '7\n')
  os.execute('rm -rf ' .. dir)
end)

T.test('--help lists the environment variables and points to examples/ and docs/', function()
  local out, rc = sh(exe .. ' --help')
  T.eq(rc, 0)
  -- every variable gpush reads (grep getenv in src/ and os.getenv in lua/)
  for _, v in ipairs {'GPUSH_HOME', 'GPUSH_HISTORY', 'GPUSH_CACHE', 'GPUSH_CUDA_DEVICE', 'GPUSH_DIST_TIMEOUT', 'LOCAL_RANK',
                      'MASTER_ADDR', 'GP_NCCL_LIB', 'GP_ATTN_IMPL', 'GPUSH_MATMUL_TUNE', 'GPUSH_JIT', 'GPUSH_GC_PACE', '/examples', '/docs',
                      'help()'} do
    T.ok(out:find(v, 1, true), v .. ' in ' .. out)
  end
end)

T.test('without a GPU, the reason is said plainly (no "insufficient driver version")', function()
  if gp.cuda_available() then T.skip('a GPU is present') end
  for _, cmd in ipairs {' --version', " -e 'gp.zeros{2}:cuda()'", " -e \"gp.zeros{2}:to('cuda:0')\"", ' --device cuda:0 -e 1'} do
    local out = sh(exe .. cmd)
    T.ok(not out:find('insufficient', 1, true), cmd .. ': ' .. out)
    T.ok(out:find('no CUDA driver is installed', 1, true) or out:find('no CUDA GPU is visible', 1, true)
      or out:find('without CUDA', 1, true), cmd .. ': ' .. out)
  end
end)

T.test('a crash or an abort prints the signal and the C stack, then ends as the signal does', function()
  local asan = exe:find('asan', 1, true) -- the AddressSanitizer build leaves the signals to its own handlers
  local out, rc = sh(exe .. [[ -e 'local ffi = require "ffi"; ffi.cdef "int raise(int)"; ffi.C.raise(6)']])
  T.eq(rc, 134, 'the default action of SIGABRT still ends the process: ' .. out)
  if not asan then
    T.ok(out:find('gpush: fatal signal 6 (SIGABRT); the C stack:', 1, true), out)
    T.ok(out:find('(main+', 1, true), 'the frames name gpush\'s functions: ' .. out)
  end
  out, rc = sh(exe .. [[ -e 'local ffi = require "ffi"; print(ffi.cast("int *", 0)[0])']])
  T.ok(rc ~= 0, out)
  if not asan then
    T.eq(rc, 139, out)
    T.ok(out:find('gpush: fatal signal 11 (SIGSEGV); the C stack:', 1, true), out)
  end
end)

T.test('LuaJIT\'s compiler is off under compute-sanitizer and with GPUSH_JIT=0, on otherwise', function()
  local under = os.getenv('NV_SANITIZER_INJECTION_PORT_BASE') ~= nil or
    (os.getenv('CUDA_INJECTION64_PATH') or ''):find('sanitizer', 1, true) ~= nil
  local function jit_on(env) return (sh(env .. ' ' .. exe .. [[ -e 'print(jit.status())']])):match('^(%a+)') end
  T.eq(jit_on('GPUSH_JIT='), under and 'false' or 'true') -- (empty: as if unset)
  T.eq(jit_on('NV_SANITIZER_INJECTION_PORT_BASE=49152'), 'false')
  T.eq(jit_on('NV_SANITIZER_INJECTION_PORT_BASE=49152 GPUSH_JIT=1'), 'true')
  T.eq(jit_on('GPUSH_JIT=0'), 'false')
end)
