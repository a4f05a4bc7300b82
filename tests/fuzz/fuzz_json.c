/* fuzz_json.c: libFuzzer harness of gp.json (src/json.c over cJSON): what
 * reads checkpoint metadata, config.json, tokenizer.json and chat settings.
 *
 *   make fuzz; build/fuzz_json -max_total_time=300 build/fuzz-corpus/json tests/fuzz/corpus/json
 *
 * One Lua state (its heap on malloc, so that ASan checks it and LSan sees
 * into it) with require 'gpush.core.json'. Each input is decoded; what
 * decodes is encoded, and what encodes decodes again. Every failure must be
 * a Lua error with a message, never a crash or a leak (json.c frees its
 * cJSON tree when it raises). */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int luaopen_gpush_json(lua_State *L);

static void *alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  (void)ud, (void)osize;
  if (nsize == 0) {
    free(ptr);
    return NULL;
  }
  return realloc(ptr, nsize);
}

static const char *CHECK =
    "local json, s = ...\n"
    "local ok, v = pcall(json.decode, s)\n"
    "if not ok then assert(type(v) == 'string' and v:find('json.decode'), v) return end\n"
    "local ok2, e = pcall(json.encode, v)\n"
    "if not ok2 then assert(type(e) == 'string' and e:find('json.encode'), e) return end\n"
    "local ok3, v2 = pcall(json.decode, e)\n"
    "assert(ok3, 'the encoding of a decoded value does not decode: ' .. tostring(v2))\n"
    "assert(type(v2) == type(v), 'the type changed in a round trip')\n";

static lua_State *L;
static int check_ref;

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
  static unsigned long n;
  if (!L) {
    L = lua_newstate(alloc, NULL);
    if (!L) abort();
    luaL_openlibs(L);
    lua_pushcfunction(L, luaopen_gpush_json);
    lua_call(L, 0, 1);
    lua_setglobal(L, "json");
    if (luaL_loadstring(L, CHECK) != 0) abort();
    check_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  lua_rawgeti(L, LUA_REGISTRYINDEX, check_ref);
  lua_getglobal(L, "json");
  lua_pushlstring(L, (const char *)data, size);
  if (lua_pcall(L, 2, 0, 0) != 0) {
    fprintf(stderr, "fuzz_json: %s\n", lua_tostring(L, -1));
    abort();
  }
  if (++n % 256 == 0) lua_gc(L, LUA_GCCOLLECT, 0);
  return 0;
}
