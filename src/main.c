/* main.c: the gpush command: embeds LuaJIT, preloads the gpush library and
 * runs a script, a string, standard input or the interactive prompt. */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <luajit.h>
#include <execinfo.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

int gp_luaopen_repl(lua_State *L); /* src/repl.c */

static const char g_cdef[] =
#include "cdef.inc"
    ;

static const char *usage =
    "usage: gpush [options] [script.lua [args...]]\n"
    "  script.lua [args]   run a script; its arguments are in the global 'arg'\n"
    "  -                   run the script read from standard input\n"
    "  -e 'code'           run a string of Lua (may be repeated)\n"
    "  -i                  enter the interactive prompt after running the script or -e code\n"
    "  --device cpu|cuda   the default device for new tensors\n"
    "  --nproc N           run N processes (one per GPU) for gp.dist: RANK, WORLD_SIZE, LOCAL_RANK,\n"
    "                      MASTER_ADDR, MASTER_PORT set; output lines prefixed \"[rank] \"\n"
    "  --nnodes M --node-rank I --master-addr HOST --master-port P\n"
    "                      several machines: run the same command on each (I = 0..M-1)\n"
    "  --version           print the gpush, LuaJIT and CUDA versions and the GPU seen\n"
    "  --help              this text\n"
    "With no script, a terminal gets the interactive prompt; otherwise the script is read from stdin.\n"
    "require finds modules in the script's own directory first, then in the gpush library.\n"
    "\n"
    "Environment:\n"
    "  GPUSH_HOME          where the library is: $GPUSH_HOME/lua (default: lua/ beside the binary's directory)\n"
    "  GPUSH_HISTORY       the prompt's history file (default ~/.gpush_history)\n"
    "  GPUSH_CACHE         compiled kernels and fetched models (default ~/.cache/gpush)\n"
    "  GPUSH_CUDA_DEVICE   the GPU this process uses (default $LOCAL_RANK, else 0)\n"
    "  GPUSH_DIST_TIMEOUT  gp.dist: seconds for the rendezvous and each tcp collective (default 300)\n"
    "  RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT\n"
    "                      gp.dist's process group (--nproc sets them; GPUSH_LAUNCHED marks its children)\n"
    "  GP_NCCL_LIB         the NCCL library to load (docs/training.md)\n"
    "  GP_ATTN_IMPL, GP_ATTN_DETERMINISTIC\n"
    "                      the attention kernels to use (docs/attention.md)\n"
    "  GPUSH_MATMUL_TUNE   1: cuBLASLt algorithms chosen by timing, cached per shape (gp.matmul_option('tune'))\n"
    "  GPUSH_JIT           0: LuaJIT's compiler off; 1: on under compute-sanitizer too (off there by default)\n"
    "  GPUSH_GC_PACE       0: the floor of tensor bytes between full collections fixed at 256 MB (not paced\n"
    "                      by what the collections cost; docs/tensors.md)\n"
    "\n";

#if GP_LUA_SYSTEM_ALLOC
/* Lua's objects on malloc instead of LuaJIT's own allocator (the sanitizer
 * build, make asan): LeakSanitizer scans malloc'd blocks for pointers, so the
 * C objects that Lua objects hold (tensors behind ffi.gc) are not reported
 * as leaks, and AddressSanitizer checks accesses to Lua's heap too. LuaJIT
 * allows a custom allocator in its 64-bit (GC64) builds. */
static void *system_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  (void)ud, (void)osize;
  if (nsize == 0) {
    free(ptr);
    return NULL;
  }
  return realloc(ptr, nsize);
}

static int panic(lua_State *L) {
  fprintf(stderr, "gpush: unprotected error in a call to the Lua API (%s)\n", lua_tostring(L, -1));
  return 0;
}
#endif

static int traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (!msg) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* run the function on top of the stack with nargs arguments below it */
static int docall(lua_State *L, int nargs) {
  int base = lua_gettop(L) - nargs;
  lua_pushcfunction(L, traceback);
  lua_insert(L, base);
  int rc = lua_pcall(L, nargs, 0, base);
  lua_remove(L, base);
  if (rc != 0) {
    fprintf(stderr, "gpush: %s\n", lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  return rc;
}

/* Code from outside (files, stdin, -e, the prompt) is loaded as text only
 * ("t"): LuaJIT does not verify bytecode, so a damaged or hostile chunk of it
 * could crash the process instead of giving an error. */
static int dostring(lua_State *L, const char *code, const char *name) {
  if (luaL_loadbufferx(L, code, strlen(code), name, "t") != 0) {
    fprintf(stderr, "gpush: %s\n", lua_tostring(L, -1));
    lua_pop(L, 1);
    return 1;
  }
  return docall(L, 0);
}

int luaopen_gpush_json(lua_State *L);

/* os.exit([code [, close]]): close defaults to true (see main) */
static int os_exit(lua_State *L) {
  int code = lua_isboolean(L, 1) ? (lua_toboolean(L, 1) ? EXIT_SUCCESS : EXIT_FAILURE)
                                 : (int)luaL_optinteger(L, 1, EXIT_SUCCESS);
  int close = lua_isnoneornil(L, 2) || lua_toboolean(L, 2);
  fflush(NULL);
  if (close) {
    lua_close(L);
    gp_shutdown();
  }
  exit(code);
}

/* the root of the checkout or install: $GPUSH_HOME, else <dir of the executable>/.. */
static void root_dir(char *root, size_t size) {
  char exe[PATH_MAX] = {0};
  const char *home = getenv("GPUSH_HOME");
  if (home) {
    snprintf(root, size, "%s", home);
  } else {
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) exe[n] = 0;
    snprintf(root, size, "%s/..", dirname(exe));
  }
}

static void print_usage(FILE *f) {
  char root[PATH_MAX + 8];
  root_dir(root, sizeof root);
  fputs(usage, f);
  fprintf(f,
          "Learn more: the examples in %s/examples (gpush examples/01_tensors.lua, ...), the docs in %s/docs\n"
          "(docs/README.md: the map), and help() at the prompt.\n",
          root, root);
}

/* directory of lua/ : $GPUSH_HOME/lua, else <dir of the executable>/../lua;
 * the globals GPUSH_ROOT (that directory) and GPUSH_EXE (this binary: tests
 * run it again, so a sanitizer build tests itself) */
static void set_paths(lua_State *L) {
  char root[PATH_MAX + 8], exe[PATH_MAX] = {0};
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = 0;
    lua_pushstring(L, exe);
    lua_setglobal(L, "GPUSH_EXE");
  }
  root_dir(root, sizeof root);
  lua_getglobal(L, "package");
  lua_pushfstring(L, "%s/lua/?.lua;%s/lua/?/init.lua;", root, root);
  lua_getfield(L, -2, "path");
  lua_concat(L, 2);
  lua_setfield(L, -2, "path");
  lua_pushstring(L, root);
  lua_setglobal(L, "GPUSH_ROOT");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_gpush_json);
  lua_setfield(L, -2, "gpush.core.json");
  lua_pop(L, 1);
  /* the FFI declarations, generated from src/gpush.h */
  lua_getfield(L, -1, "loaded");
  lua_pushstring(L, g_cdef);
  lua_setfield(L, -2, "gpush.core.cdef");
  lua_pop(L, 1);
  /* the C half of the prompt */
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, gp_luaopen_repl);
  lua_setfield(L, -2, "gpush.tools.repl_c");
  lua_pop(L, 2);
}

/* require looks next to the script first: <dir>/?.lua;<dir>/?/init.lua */
static void script_dir_first(lua_State *L, const char *script) {
  char buf[PATH_MAX];
  snprintf(buf, sizeof buf, "%s", script);
  const char *dir = dirname(buf);
  lua_getglobal(L, "package");
  lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;", dir, dir);
  lua_getfield(L, -2, "path");
  lua_concat(L, 2);
  lua_setfield(L, -2, "path");
  lua_pop(L, 1);
}

static void make_arg(lua_State *L, char **argv, int argc, int script) {
  lua_createtable(L, argc, script + 1);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - script);
  }
  lua_setglobal(L, "arg");
}

/* gpush --nproc N [--nnodes M --node-rank I --master-addr H --master-port P] ...:
 * the launcher (src/launch.c) runs the rest of the command line N times */
static int launcher(int argc, char **argv) {
  int nproc = 0, nnodes = 1, node_rank = 0, port = 0;
  const char *addr = NULL;
  const char **rest = calloc((size_t)argc + 1, sizeof *rest);
  int nrest = 0, i = 1;
  if (!rest) return 1;
  rest[nrest++] = argv[0];
  for (; i < argc; i++) {
    const char *a = argv[i];
    const char *names[] = {"--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port"};
    int which = -1;
    const char *val = NULL;
    for (int k = 0; k < 5; k++) {
      size_t n = strlen(names[k]);
      if (!strcmp(a, names[k])) {
        if (i + 1 >= argc) {
          fprintf(stderr, "gpush: %s needs a value\n", names[k]);
          free(rest);
          return 2;
        }
        which = k, val = argv[++i];
      } else if (!strncmp(a, names[k], n) && a[n] == '=') {
        which = k, val = a + n + 1;
      }
    }
    if (which < 0) {
      /* the script and its arguments are the children's, untouched */
      if (!strcmp(a, "-") || a[0] != '-') break;
      rest[nrest++] = a;
      if (!strcmp(a, "-e") || !strcmp(a, "--device")) {
        if (i + 1 < argc) rest[nrest++] = argv[++i];
      }
      continue;
    }
    char *end;
    long v = which == 3 ? 0 : strtol(val, &end, 10);
    if (which != 3 && (*val == 0 || *end != 0)) {
      fprintf(stderr, "gpush: %s needs a number, got '%s'\n", names[which], val);
      free(rest);
      return 2;
    }
    if (which == 0) nproc = (int)v;
    else if (which == 1) nnodes = (int)v;
    else if (which == 2) node_rank = (int)v;
    else if (which == 3) addr = val;
    else port = (int)v;
  }
  for (; i < argc; i++) rest[nrest++] = argv[i];
  int code = 1;
  if (gp_dist_launch(&code, nproc, nnodes, node_rank, addr, port, nrest, rest) != GP_OK) {
    fprintf(stderr, "gpush: %s\n", gp_last_error());
    if (!code) code = 1;
  }
  free(rest);
  return code;
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
/* A fatal signal (a crash in gpush, a library it calls or LuaJIT; an abort)
 * prints its number and the C stack to stderr, then takes the default action
 * (a core file where they are enabled): a process never dies without a word.
 * The frames name gpush's functions (it links with -E) or give offsets for
 * addr2line -e build/gpush. On its own stack, so that a stack overflow is
 * reported too. (Not in the AddressSanitizer build, whose handlers report
 * more.) */
static const char *sig_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    default: return "SIGILL";
  }
}

static void on_fatal(int sig) {
  char msg[96];
  int n = snprintf(msg, sizeof msg, "gpush: fatal signal %d (%s); the C stack:\n", sig, sig_name(sig));
  if (n > 0 && write(2, msg, (size_t)n) < 0) n = 0;
  void *frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

static void fatal_handlers(void) {
  static char stack[1 << 16];
  stack_t ss = {.ss_sp = stack, .ss_size = sizeof stack, .ss_flags = 0};
  void *f[1];
  backtrace(f, 1); /* loads libgcc's unwinder now, not inside the handler */
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_fatal;
  sa.sa_flags = SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  const int sigs[] = {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) sigaction(sigs[i], &sa, NULL);
}
#else
static void fatal_handlers(void) {}
#endif

/* LuaJIT's compiler: off with GPUSH_JIT=0, and by default under
 * compute-sanitizer (which sets NV_SANITIZER_INJECTION_PORT_BASE and loads
 * itself through CUDA_INJECTION64_PATH): the sanitizer records the host's
 * stack at every CUDA call, and libgcc's unwinder aborts the process
 * (SIGABRT, no report) when that stack holds a frame of LuaJIT's compiled
 * code (BENCHMARKS.md, 2026-11-30 (b)) */
static int jit_wanted(void) {
  const char *e = getenv("GPUSH_JIT"), *inj = getenv("CUDA_INJECTION64_PATH");
  if (e && *e) return strcmp(e, "0") != 0;
  return !getenv("NV_SANITIZER_INJECTION_PORT_BASE") && !(inj && strstr(inj, "sanitizer"));
}

int main(int argc, char **argv) {
  fatal_handlers();
  const char *device = NULL;
  /* launcher options come before the script */
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--nproc") || !strncmp(a, "--nproc=", 8)) return launcher(argc, argv);
    if (!strcmp(a, "-e") || !strcmp(a, "--device")) i++;
    else if (!strcmp(a, "-") || a[0] != '-') break;
  }
  /* stdout to a pipe or a file (a rank under the launcher, `make run | tee log`)
   * is line-buffered, as on a terminal: each line is seen as it is printed */
  if (getenv("GPUSH_LAUNCHED") || !isatty(1)) setvbuf(stdout, NULL, _IOLBF, 0);
  int interactive = 0, script = 0, ran_e = 0;
  const char *exprs[64];
  int nexpr = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      print_usage(stdout);
      return 0;
    } else if (!strcmp(a, "--version") || !strcmp(a, "-v")) {
      char info[512];
      gp_runtime_info(info, sizeof info);
      printf("gpush %s (%s)\n%s\n", gp_version(), LUAJIT_VERSION, info);
      return 0;
    } else if (!strcmp(a, "--device")) {
      if (i + 1 >= argc) {
        fprintf(stderr, "gpush: --device needs cpu or cuda\n");
        return 2;
      }
      device = argv[++i];
    } else if (!strncmp(a, "--device=", 9)) {
      device = a + 9;
    } else if (!strcmp(a, "-e")) {
      if (i + 1 >= argc || nexpr == 64) {
        fprintf(stderr, "gpush: -e needs a string of Lua\n");
        return 2;
      }
      exprs[nexpr++] = argv[++i];
    } else if (!strcmp(a, "-i")) {
      interactive = 1;
    } else if (!strcmp(a, "-") || a[0] != '-') {
      script = i;
      break;
    } else {
      fprintf(stderr, "gpush: unknown option %s\n", a);
      print_usage(stderr);
      return 2;
    }
  }
  if (device && strcmp(device, "cpu") && strcmp(device, "cuda") &&
      !(!strncmp(device, "cuda:", 5) && device[5] && strspn(device + 5, "0123456789") == strlen(device + 5))) {
    fprintf(stderr, "gpush: --device must be cpu, cuda or cuda:N, not '%s'\n", device);
    return 2;
  }

#if GP_LUA_SYSTEM_ALLOC
  lua_State *L = lua_newstate(system_alloc, NULL);
  if (L) lua_atpanic(L, panic);
#else
  lua_State *L = luaL_newstate();
#endif
  if (!L) {
    fprintf(stderr, "gpush: cannot create the Lua state\n");
    return 1;
  }
  luaL_openlibs(L);
  if (!jit_wanted()) luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
  /* os.exit closes the state first (unless os.exit(code, false)): finalizers
   * run and free what Lua objects hold (tensors, files), then the allocator's
   * cached device blocks go back to CUDA, so nothing is left behind and a
   * leak checker (LeakSanitizer, compute-sanitizer --leak-check) sees none */
  lua_getglobal(L, "os");
  lua_pushcfunction(L, os_exit);
  lua_setfield(L, -2, "exit");
  lua_pop(L, 1);
  set_paths(L);
  make_arg(L, argv, argc, script ? script : argc - 1);

  /* gp preloaded as a global; the default device as asked */
  char boot[256];
  snprintf(boot, sizeof boot, "gp = require 'gpush'; help = gp.help; %s%s%s", device ? "gp.set_device('" : "",
           device ? device : "", device ? "')" : "");
  if (dostring(L, boot, "=(gpush)") != 0) {
    lua_close(L);
    return 1;
  }

  int rc = 0;
  for (int i = 0; i < nexpr && rc == 0; i++, ran_e = 1) rc = dostring(L, exprs[i], "=(command line)");
  if (rc == 0 && script) {
    const char *path = strcmp(argv[script], "-") ? argv[script] : NULL;
    if (path) script_dir_first(L, path);
    if (luaL_loadfilex(L, path, "t") != 0) {
      fprintf(stderr, "gpush: %s\n", lua_tostring(L, -1));
      rc = 1;
    } else {
      int n = 0;
      for (int i = script + 1; i < argc; i++, n++) lua_pushstring(L, argv[i]);
      rc = docall(L, n);
    }
  } else if (rc == 0 && !ran_e && !interactive) {
    if (isatty(0)) interactive = 1;
    else if (luaL_loadfilex(L, NULL, "t") != 0) {
      fprintf(stderr, "gpush: %s\n", lua_tostring(L, -1));
      rc = 1;
    } else {
      rc = docall(L, 0);
    }
  }
  /* the prompt also follows a failed script, so its state can be inspected */
  if (interactive && dostring(L, "require('gpush.tools.repl').run()", "=(repl)") != 0 && !rc) rc = 1;
  lua_close(L);
  gp_shutdown();
  return rc ? 1 : 0;
}
