/* json.c: JSON for Lua through cJSON (require 'gpush.json'): decode(s) and
 * encode(v). Called through the classic Lua C API (not a hot path), so it
 * may raise Lua errors. JSON null decodes to json.null.
 *
 * A Lua error unwinds past C without running C cleanup, so every cJSON tree
 * is owned by a Lua userdata (a box whose __gc deletes it) from the moment it
 * exists, every node joins its tree before anything that may raise, and the
 * work that may raise (too deep, NaN, a cycle, a function, out of memory)
 * runs in a protected call, after which the tree is deleted at once, error
 * or not; the box's __gc is the last resort. */
#include <cjson/cJSON.h>
#include <lauxlib.h>
#include <lua.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 128

static int null_ref = LUA_NOREF;
#define BOX_MT "gpush.json.box"

typedef struct {
  cJSON *j;
} jbox;

static int box_gc(lua_State *L) {
  jbox *b = lua_touserdata(L, 1);
  if (b && b->j) cJSON_Delete(b->j);
  if (b) b->j = NULL;
  return 0;
}

/* a new empty box on the stack */
static jbox *box_new(lua_State *L) {
  jbox *b = lua_newuserdata(L, sizeof *b);
  b->j = NULL;
  luaL_getmetatable(L, BOX_MT);
  lua_setmetatable(L, -2);
  return b;
}

static void box_free(jbox *b) {
  cJSON_Delete(b->j);
  b->j = NULL;
}

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

/* decode(s) runs in a protected call: on an error the tree is freed at once
 * (not when the collector gets to its box), then the error goes on */
static int decode_worker(lua_State *L) {
  jbox *box = lua_touserdata(L, 1);
  push_json(L, box->j, 0);
  return 1;
}

static int l_decode(lua_State *L) {
  size_t n;
  const char *s = luaL_checklstring(L, 1, &n);
  const char *end = NULL;
  jbox *box = box_new(L);
  box->j = cJSON_ParseWithLengthOpts(s, n, &end, 0);
  if (!box->j) {
    size_t at = end ? (size_t)(end - s) : 0;
    return luaL_error(L, "json.decode: invalid JSON at byte %d", (int)at + 1);
  }
  lua_pushcfunction(L, decode_worker);
  lua_pushlightuserdata(L, box);
  int rc = lua_pcall(L, 1, 1, 0);
  box_free(box);
  if (rc != 0) return lua_error(L);
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

static const char *checked_string(lua_State *L, int idx, const char *what) {
  size_t n;
  const char *s = lua_tolstring(L, idx, &n);
  if (strlen(s) != n) luaL_error(L, "json.encode: %s with a NUL byte cannot be written (cJSON strings end at NUL)", what);
  return s;
}

static int key_order(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* attach item to parent (under key for an object; as the root when parent is NULL) */
static cJSON *attach(lua_State *L, jbox *box, cJSON *parent, const char *key, cJSON *item) {
  if (!item) luaL_error(L, "json.encode: out of memory");
  if (!parent) box->j = item;
  else if (key ? !cJSON_AddItemToObject(parent, key, item) : !cJSON_AddItemToArray(parent, item)) {
    cJSON_Delete(item);
    luaL_error(L, "json.encode: out of memory");
  }
  return item;
}

/* the value at idx as a new node of parent (every node is in box's tree before anything can raise) */
static void to_json(lua_State *L, int idx, int depth, jbox *box, cJSON *parent, const char *key) {
  if (depth > MAX_DEPTH) luaL_error(L, "json.encode: nested too deeply (a cycle?)");
  if (idx < 0) idx = lua_gettop(L) + idx + 1;
  switch (lua_type(L, idx)) {
    case LUA_TNIL: attach(L, box, parent, key, cJSON_CreateNull()); return;
    case LUA_TBOOLEAN: attach(L, box, parent, key, cJSON_CreateBool(lua_toboolean(L, idx))); return;
    case LUA_TNUMBER: {
      double v = lua_tonumber(L, idx);
      if (v != v || isinf(v)) luaL_error(L, "json.encode: %f cannot be written as JSON", v);
      attach(L, box, parent, key, cJSON_CreateNumber(v));
      return;
    }
    case LUA_TSTRING:
      attach(L, box, parent, key, cJSON_CreateString(checked_string(L, idx, "a string")));
      return;
    case LUA_TTABLE: {
      lua_rawgeti(L, LUA_REGISTRYINDEX, null_ref);
      int is_null = lua_rawequal(L, -1, idx);
      lua_pop(L, 1);
      if (is_null) {
        attach(L, box, parent, key, cJSON_CreateNull());
        return;
      }
      luaL_checkstack(L, 6, "json.encode");
      int n = seq_len(L, idx);
      if (n > 0) {
        cJSON *out = attach(L, box, parent, key, cJSON_CreateArray());
        for (int i = 1; i <= n; i++) {
          lua_rawgeti(L, idx, i);
          to_json(L, -1, depth + 1, box, out, NULL);
          lua_pop(L, 1);
        }
      } else {
        /* the members in the byte order of their keys: a table's own order
         * follows string hashes that differ from process to process */
        cJSON *out = attach(L, box, parent, key, cJSON_CreateObject());
        size_t nk = 0, i = 0;
        lua_pushnil(L);
        while (lua_next(L, idx)) {
          lua_pop(L, 1);
          if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "json.encode: object keys must be strings");
          nk++;
        }
        /* the table holds the keys: nothing changes it while it is written */
        const char **keys = lua_newuserdata(L, nk ? nk * sizeof *keys : 1);
        lua_pushnil(L);
        while (lua_next(L, idx)) {
          lua_pop(L, 1);
          keys[i++] = checked_string(L, -1, "a key");
        }
        qsort(keys, i, sizeof *keys, key_order);
        for (size_t k = 0; k < i; k++) {
          lua_pushstring(L, keys[k]);
          lua_rawget(L, idx);
          to_json(L, -1, depth + 1, box, out, keys[k]);
          lua_pop(L, 1);
        }
        lua_pop(L, 1); /* the keys */
      }
      return;
    }
    default: luaL_error(L, "json.encode: cannot encode a %s", luaL_typename(L, idx));
  }
}

static int encode_worker(lua_State *L) {
  jbox *box = lua_touserdata(L, 2);
  to_json(L, 1, 0, box, NULL, NULL);
  return 0;
}

static int l_encode(lua_State *L) {
  luaL_checkany(L, 1);
  lua_settop(L, 1);
  jbox *box = box_new(L);
  lua_pushcfunction(L, encode_worker);
  lua_pushvalue(L, 1);
  lua_pushlightuserdata(L, box);
  int rc = lua_pcall(L, 2, 0, 0);
  if (rc != 0) { /* free the partial tree now, then raise the error */
    box_free(box);
    return lua_error(L);
  }
  char *s = cJSON_PrintUnformatted(box->j);
  box_free(box);
  if (!s) return luaL_error(L, "json.encode: out of memory");
  lua_pushstring(L, s);
  cJSON_free(s);
  return 1;
}

int luaopen_gpush_json(lua_State *L) {
  if (luaL_newmetatable(L, BOX_MT)) {
    lua_pushcfunction(L, box_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
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
