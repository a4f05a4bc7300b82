/* fuzz_lua.c: libFuzzer harness of gpush's Lua parsers of outside input:
 * tokenizer.json (gp.tokenizer.from_json, then encode and decode) and chat
 * templates (gp.tokenizer.template, then render): built once per target
 * (FUZZ_TARGET "tokenizer" or "jinja", make fuzz), the entry being
 * tests/fuzz/fuzz.lua's function of that name.
 *
 *   make fuzz; build/fuzz_jinja -max_total_time=300 build/fuzz-corpus/jinja tests/fuzz/corpus/jinja
 *
 * The gpush library runs in one Lua state, set up as src/main.c does (the
 * FFI declarations, gpush.core.json), its heap on malloc (ASan, LSan). The
 * JIT is off and a line hook feeds libFuzzer coverage of the Lua code: each
 * (chunk, line, previous line) bumps a counter in libFuzzer's extra-counters
 * section, so inputs that reach new Lua lines are kept. A count hook bounds
 * each input's work: past it, the hook raises the table FUZZ_BUDGET, which
 * ends the input like a timeout (fuzz.lua lets it through every pcall).
 * fuzz.lua raises "FINDING: ..." for an error that is not one of gpush's own
 * (an internal "attempt to index a nil value" and the like): that aborts. */
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

#define NCOV (1 << 16)
__attribute__((section("__libfuzzer_extra_counters"))) static uint8_t g_cov[NCOV];
static uintptr_t g_prev;
static long g_budget;

static void hook(lua_State *L, lua_Debug *ar) {
  if (ar->event == LUA_HOOKCOUNT) {
    if (--g_budget <= 0) { /* the budget's table (fuzz.lua: M.BUDGET), not a message no handler may eat */
      lua_getglobal(L, "FUZZ_BUDGET");
      lua_error(L);
    }
    return;
  }
  if (!lua_getinfo(L, "S", ar)) return;
  uintptr_t h = ((uintptr_t)ar->source * 0x9E3779B97F4A7C15ull) ^ ((uintptr_t)ar->currentline * 0x85EBCA6Bu);
  size_t i = (size_t)((h ^ (g_prev >> 1)) % NCOV);
  g_cov[i]++;
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
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static unsigned long n;
  if (!L) setup();
  g_prev = 0;
  g_budget = 20000; /* x 1000 instructions */
  lua_rawgeti(L, LUA_REGISTRYINDEX, entry_ref);
  lua_pushlstring(L, (const char *)data, size);
  lua_sethook(L, hook, LUA_MASKLINE | LUA_MASKCOUNT, 1000);
  int rc = lua_pcall(L, 1, 0, 0);
  lua_sethook(L, NULL, 0, 0);
  if (rc != 0) {
    const char *msg = lua_tostring(L, -1);
    if (msg && strstr(msg, "FINDING")) { /* else: the budget ran out */
      fprintf(stderr, "fuzz_lua (%s): %s\n", FUZZ_TARGET, msg);
      abort();
    }
    lua_pop(L, 1);
  }
  if (++n % 64 == 0) lua_gc(L, LUA_GCCOLLECT, 0);
  return 0;
}
