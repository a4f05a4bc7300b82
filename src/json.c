/* json.c: JSON for Lua through cJSON (require 'gpush.json'): decode(s) and
 * encode(v). Called through the classic Lua C API (not a hot path), so it
 * may raise Lua errors. JSON null decodes to json.null. */
#include <cjson/cJSON.h>
#include <lauxlib.h>
#include <lua.h>
#include <math.h>

#define MAX_DEPTH 128

static int null_ref = LUA_NOREF;

static void push_json(lua_State *L, const cJSON *j, int depth) {
  if (depth > MAX_DEPTH) luaL_error(L, "json.decode: nested too deeply");
  luaL_checkstack(L, 4, "json.decode");
  if (cJSON_IsObject(j)) {
    lua_createtable(L, 0, cJSON_GetArraySize(j));
    for (const cJSON *c = j->child; c; c = c->next) {
      push_json(L, c, depth + 1);
      lua_setfield(L, -2, c->string ? c->string : "");
    }
  } else if (cJSON_IsArray(j)) {
    lua_createtable(L, cJSON_GetArraySize(j), 0);
    int i = 1;
    for (const cJSON *c = j->child; c; c = c->next) {
      push_json(L, c, depth + 1);
      lua_rawseti(L, -2, i++);
    }
  } else if (cJSON_IsString(j)) {
    lua_pushstring(L, j->valuestring);
  } else if (cJSON_IsNumber(j)) {
    lua_pushnumber(L, j->valuedouble);
  } else if (cJSON_IsBool(j)) {
    lua_pushboolean(L, cJSON_IsTrue(j));
  } else {
    lua_rawgeti(L, LUA_REGISTRYINDEX, null_ref);
  }
}

static int l_decode(lua_State *L) {
  size_t n;
  const char *s = luaL_checklstring(L, 1, &n);
  const char *end = NULL;
  cJSON *j = cJSON_ParseWithLengthOpts(s, n, &end, 0);
  if (!j) {
    size_t at = end ? (size_t)(end - s) : 0;
    return luaL_error(L, "json.decode: invalid JSON at byte %d", (int)at + 1);
  }
  push_json(L, j, 0);
  cJSON_Delete(j);
  return 1;
}

/* is the table at idx a sequence 1..n (n >= 1), or empty? returns n, or -1 for an object */
static int seq_len(lua_State *L, int idx) {
  int n = 0, max = 0;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    lua_pop(L, 1);
    if (lua_type(L, -1) != LUA_TNUMBER) { lua_pop(L, 1); return -1; }
    double k = lua_tonumber(L, -1);
    if (k < 1 || k != floor(k)) { lua_pop(L, 1); return -1; }
    if (k > max) max = (int)k;
    n++;
  }
  return n == max ? n : -1;
}

static cJSON *to_json(lua_State *L, int idx, int depth) {
  if (depth > MAX_DEPTH) luaL_error(L, "json.encode: nested too deeply (a cycle?)");
  if (idx < 0) idx = lua_gettop(L) + idx + 1;
  switch (lua_type(L, idx)) {
    case LUA_TNIL: return cJSON_CreateNull();
    case LUA_TBOOLEAN: return cJSON_CreateBool(lua_toboolean(L, idx));
    case LUA_TNUMBER: {
      double v = lua_tonumber(L, idx);
      if (v != v || isinf(v)) luaL_error(L, "json.encode: %f cannot be written as JSON", v);
      return cJSON_CreateNumber(v);
    }
    case LUA_TSTRING: return cJSON_CreateString(lua_tostring(L, idx));
    case LUA_TTABLE: {
      lua_rawgeti(L, LUA_REGISTRYINDEX, null_ref);
      int is_null = lua_rawequal(L, -1, idx);
      lua_pop(L, 1);
      if (is_null) return cJSON_CreateNull();
      luaL_checkstack(L, 4, "json.encode");
      int n = seq_len(L, idx);
      cJSON *out;
      if (n > 0) {
        out = cJSON_CreateArray();
        for (int i = 1; i <= n; i++) {
          lua_rawgeti(L, idx, i);
          cJSON_AddItemToArray(out, to_json(L, -1, depth + 1));
          lua_pop(L, 1);
        }
      } else {
        out = cJSON_CreateObject();
        lua_pushnil(L);
        while (lua_next(L, idx)) {
          if (lua_type(L, -2) != LUA_TSTRING) {
            cJSON_Delete(out);
            luaL_error(L, "json.encode: object keys must be strings");
          }
          cJSON_AddItemToObject(out, lua_tostring(L, -2), to_json(L, -1, depth + 1));
          lua_pop(L, 1);
        }
      }
      return out;
    }
    default: luaL_error(L, "json.encode: cannot encode a %s", luaL_typename(L, idx)); return NULL;
  }
}

static int l_encode(lua_State *L) {
  luaL_checkany(L, 1);
  cJSON *j = to_json(L, 1, 0);
  char *s = cJSON_PrintUnformatted(j);
  cJSON_Delete(j);
  if (!s) return luaL_error(L, "json.encode: out of memory");
  lua_pushstring(L, s);
  cJSON_free(s);
  return 1;
}

int luaopen_gpush_json(lua_State *L) {
  lua_newtable(L);
  lua_newtable(L); /* json.null */
  lua_pushvalue(L, -1);
  null_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_setfield(L, -2, "null");
  lua_pushcfunction(L, l_decode);
  lua_setfield(L, -2, "decode");
  lua_pushcfunction(L, l_encode);
  lua_setfield(L, -2, "encode");
  return 1;
}
