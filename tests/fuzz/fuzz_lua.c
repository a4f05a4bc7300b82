 /* fuzz_lua.c: libFuzzer harness of gpush's Lua parsers of outside input:
 * tokenizer.json (gp.tokenizer.from_json, then encode and decode) and chat
 * templates (gp.tokenizer.template, then render): built once per target
 * (FUZZ_TARGET "tokenizer" or "jinja", make fuzz), the entry being
 * tests/fuzz/fuzz.lua's function of that name.
 *
 *   make fuzz; build/fuzz_jinja -max_total_time=300 build/fuzz-corpus/jinja tests/fuzz/corpus/jinja
 *   tests/fuzz/long.sh jinja 10000000 16     (many workers, the total printed)
 *
 * The gpush library runs in one Lua state, set up as src/main.c does (the
 * FFI declarations, gpush.core.json), its heap on malloc (ASan, LSan). The JIT is
 * off and a line hook feeds libFuzzer coverage of the Lua code: each (function,
 * line, previous line) bumps a counter in libFuzzer's extra-counters section,
 * so inputs that reach new Lua lines are kept. The function is named by a hash
 * of its chunk name and first line, cached by closure for the input (the
 * chunk's name through lua_getinfo "S" on every line was a fifth of the time).
 * A count hook bounds each input's work (FUZZ_BUDGET thousand VM instructions,
 * 2.5 times the costliest seed; inputs that nest loops over the messages
 * render megabytes, and a corpus of them ran at half the speed with a budget
 * of 2 million): past it, the hook raises the table
 * FUZZ_BUDGET, which ends the input like a timeout (fuzz.lua lets it through
 * every pcall). fuzz.lua raises "FINDING: ..." for an error that is not one of
 * gpush's own (an internal "attempt to index a nil value" and the like): that
 * aborts.
 *
 * Leaks: libFuzzer's per-input leak check (-detect_leaks=1) reruns an input
 * and scans the whole heap whenever it made more allocations than it freed,
 * which a garbage-collected heap does nearly every time (the frees come at a
 * later input's collection): 90% of the time went there, 13 times slower.
 * LLVMFuzzerInitialize makes -detect_leaks=0 the default (a -detect_leaks=1
 * given on the command line still wins), and at exit the Lua state is closed,
 * so that LeakSanitizer's exit check reports any C allocation that nothing
 * freed. FUZZ_LUA_STATS=1 prints the inputs run, how many ran out of budget
 * and the most instructions one took. */
#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef FUZZ_TARGET
#define FUZZ_TARGET "jinja"
#endif
#ifndef FUZZ_ROOT
#define FUZZ_ROOT "."
#endif

static const char g_cdef[] =
#include "cdef.inc"
    ;

int luaopen_gpush_json(lua_State *L);

#ifndef FUZZ_BUDGET
#define FUZZ_BUDGET 500 /* thousand VM instructions an input (a seed: at most 200) */
#endif

#define NCOV (1 << 16)
__attribute__((section("__libfuzzer_extra_counters"))) static uint8_t g_cov[NCOV];
static uint64_t g_prev;
static long g_budget;

/* closure -> hash of its function (chunk name, first line), valid for one input
 * (g_gen): a closure collected and another made at its address within an input
 * at worst names one function's lines as another's */
#define NFN 4096
static struct fn_slot {
  const void *fn;
  uint64_t h;
  unsigned gen;
} g_fns[NFN];
static unsigned g_gen;

static struct { unsigned long inputs, over_budget; long most; } g_stats;

/* the hook runs on every Lua line: no coverage instrumentation of its own
 * compares (a tenth of the time), no ASan checks */
#define HOT __attribute__((no_sanitize("coverage", "address", "undefined")))

HOT static uint64_t fn_hash(lua_State *L, lua_Debug *ar) {
  lua_getinfo(L, "f", ar); /* pushes the running function */
  const void *fn = lua_topointer(L, -1);
  struct fn_slot *e = &g_fns[((uintptr_t)fn >> 4) % NFN];
  if (e->fn == fn && e->gen == g_gen) {
    lua_pop(L, 1);
    return e->h;
  }
  lua_getinfo(L, ">S", ar); /* pops it */
  uint64_t h = 1469598103934665603ull; /* FNV-1a of the chunk's name: the same in every process */
  for (const char *c = ar->source; c && *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
  h = (h ^ (uint64_t)ar->linedefined) * 1099511628211ull;
  e->fn = fn, e->h = h, e->gen = g_gen;
  return h;
}

HOT static void hook(lua_State *L, lua_Debug *ar) {
  if (ar->event == LUA_HOOKCOUNT) {
    if (--g_budget <= 0) { /* the budget's table (fuzz.lua: M.BUDGET), not a message no handler may eat */
      lua_getglobal(L, "FUZZ_BUDGET");
      lua_error(L);
    }
    return;
  }
  uint64_t h = fn_hash(L, ar) ^ ((uint64_t)ar->currentline * 0x9E3779B97F4A7C15ull);
  g_cov[(h ^ (g_prev >> 1)) % NCOV]++;
  g_prev = h;
}

static void *alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  (void)ud, (void)osize;
  if (nsize == 0) {
    free(ptr);
    return NULL;
  }
  return realloc(ptr, nsize);
}

static lua_State *L;
static int entry_ref;

static void setup(void) {
  L = lua_newstate(alloc, NULL);
  if (!L) abort();
  luaL_openlibs(L);
  luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
  lua_getglobal(L, "package");
  lua_pushstring(L, FUZZ_ROOT "/lua/?.lua;" FUZZ_ROOT "/lua/?/init.lua;" FUZZ_ROOT "/tests/fuzz/?.lua");
  lua_setfield(L, -2, "path");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_gpush_json);
  lua_setfield(L, -2, "gpush.core.json");
  lua_pop(L, 1);
  lua_getfield(L, -1, "loaded");
  lua_pushstring(L, g_cdef);
  lua_setfield(L, -2, "gpush.core.cdef");
  lua_pop(L, 2);
  lua_pushstring(L, FUZZ_ROOT);
  lua_setglobal(L, "GPUSH_ROOT");
  lua_newtable(L);
  lua_setglobal(L, "FUZZ_BUDGET");
  if (luaL_dostring(L, "gp = require 'gpush'; return require('fuzz')." FUZZ_TARGET) != 0 || !lua_isfunction(L, -1)) {
    fprintf(stderr, "fuzz_lua: cannot load the entry: %s\n", lua_tostring(L, -1));
    abort();
  }
  entry_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_gc(L, LUA_GCSETPAUSE, 1000); /* a cycle when the heap has grown 10 times, not 2: each marks the whole library (4% faster) */
}

/* at exit (after libFuzzer's last input, in every worker): the state closed,
 * so that LeakSanitizer's exit check sees what C code never freed */
static void finish(void) {
  if (getenv("FUZZ_LUA_STATS"))
    fprintf(stderr, "fuzz_lua (%s): %lu inputs, %lu over the budget of %d thousand instructions, the most %ld thousand;"
            " Lua heap %d KB\n", FUZZ_TARGET, g_stats.inputs, g_stats.over_budget, FUZZ_BUDGET, g_stats.most,
            L ? lua_gc(L, LUA_GCCOUNT, 0) : 0);
  if (L) lua_close(L);
  L = NULL;
}

/* -detect_leaks=0 unless the command line says otherwise (see the top) */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
  static char flag[] = "-detect_leaks=0";
  char **v = malloc(sizeof(char *) * ((size_t)*argc + 2));
  if (!v) abort();
  v[0] = (*argv)[0], v[1] = flag;
  memcpy(v + 2, *argv + 1, sizeof(char *) * (size_t)*argc); /* the rest and argv's NULL */
  *argv = v, *argc += 1;
  atexit(finish);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!L) setup();
  g_prev = 0;
  g_gen++;
  g_budget = FUZZ_BUDGET;
  lua_rawgeti(L, LUA_REGISTRYINDEX, entry_ref);
  lua_pushlstring(L, (const char *)data, size);
  lua_sethook(L, hook, LUA_MASKLINE | LUA_MASKCOUNT, 1000);
  int rc = lua_pcall(L, 1, 0, 0);
  lua_sethook(L, NULL, 0, 0);
  g_stats.inputs++;
  if (FUZZ_BUDGET - g_budget > g_stats.most) g_stats.most = FUZZ_BUDGET - g_budget;
  if (rc != 0) {
    const char *msg = lua_tostring(L, -1);
    if (msg && strstr(msg, "FINDING")) { /* else: the budget ran out */
      fprintf(stderr, "fuzz_lua (%s): %s\n", FUZZ_TARGET, msg);
      abort();
    }
    if (g_budget <= 0) g_stats.over_budget++;
    lua_pop(L, 1);
  }
  return 0;
}
