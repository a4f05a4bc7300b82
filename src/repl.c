/* repl.c: the C half of the interactive prompt (lua/gpush/repl.lua):
 * readline with our own getc (so Ctrl-C at the prompt drops the line), tab completion that asks Lua for the candidates, persistent history,
 * and Ctrl-C while Lua code runs: a SIGINT handler sets a count/line hook that
 * raises "interrupted" in the running code, as lua.c does.
 *
 * Exposed to Lua as package.preload['gpush.tools.repl_c'] (classic C API: none of
 * this is on a hot path). */
#include <errno.h>
#include <lauxlib.h>
#include <lua.h>
#include <readline/history.h>
#include <readline/readline.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpush.h"

static lua_State *g_L;               /* the state the prompt runs in */
static volatile sig_atomic_t g_at_prompt, g_sigint, g_installed;
static int g_complete_ref = LUA_NOREF; /* Lua function(text) -> {candidates} */

/* Ctrl-C reaches running code two ways: a hook raises "interrupted" at the
 * next Lua instruction the interpreter runs, and gp_interrupt() makes the
 * running CPU kernel stop within its current block of work ("matmul:
 * interrupted"). Whichever comes first consumes the request; the hook then
 * only removes itself. */
static void interrupt_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  if (!gp_interrupt_pending()) return; /* a kernel has already turned it into an error */
  gp_interrupt_clear();
  luaL_error(L, "interrupted");
}

static void on_sigint(int sig) {
  (void)sig;
  if (g_at_prompt) {
    g_sigint = 1; /* read() returns EINTR; prompt_getc ends the line */
    return;
  }
  gp_interrupt();
  if (g_L) lua_sethook(g_L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT, 1);
}

static void install_handler(void) {
  if (g_installed) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0; /* no SA_RESTART: select() must return */
  sigaction(SIGINT, &sa, NULL);
  g_installed = 1;
}

/* ---- completion: Lua gives the candidates for the word before the cursor ---- */

static char **g_cands;
static int g_ncands, g_next;

static void free_cands(void) {
  for (int i = g_next; i < g_ncands; i++) free(g_cands[i]);
  free(g_cands);
  g_cands = NULL;
  g_ncands = g_next = 0;
}

static char *generator(const char *text, int state) {
  (void)text;
  if (state == 0) g_next = 0;
  if (g_next < g_ncands) return g_cands[g_next++]; /* readline frees it */
  return NULL;
}

static char **complete(const char *text, int start, int end) {
  (void)start, (void)end;
  rl_attempted_completion_over = 1; /* never fall back to file names */
  rl_completion_append_character = '\0';
  free_cands();
  lua_State *L = g_L;
  if (!L || g_complete_ref == LUA_NOREF) return NULL;
  int top = lua_gettop(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, g_complete_ref);
  lua_pushstring(L, text);
  lua_pushlstring(L, rl_line_buffer, (size_t)start);
  if (lua_pcall(L, 2, 1, 0) == 0 && lua_istable(L, -1)) {
    int n = (int)lua_objlen(L, -1);
    g_cands = calloc((size_t)n + 1, sizeof *g_cands);
    for (int i = 1; g_cands && i <= n; i++) {
      lua_rawgeti(L, -1, i);
      const char *s = lua_tostring(L, -1);
      if (s) g_cands[g_ncands++] = strdup(s);
      lua_pop(L, 1);
    }
  }
  lua_settop(L, top);
  if (g_ncands == 0) return NULL;
  return rl_completion_matches(text, generator);
}

/* ---- readline; Ctrl-C is seen by our getc ---- */

static volatile sig_atomic_t g_cancel;

/* Read a key; a Ctrl-C (read() interrupted by SIGINT) ends the line, which is
 * then discarded. */
static int prompt_getc(FILE *f) {
  for (;;) {
    unsigned char c;
    if (g_sigint) {
      g_sigint = 0;
      g_cancel = 1;
      rl_point = rl_end;
      rl_redisplay();
      fputs("^C", rl_outstream ? rl_outstream : stdout);
      fflush(rl_outstream ? rl_outstream : stdout);
      return '\n';
    }
    ssize_t r = read(fileno(f), &c, 1);
    if (r == 1) return c;
    if (r == 0) return EOF;
    if (errno != EINTR) return EOF;
  }
}

/* readline(prompt) -> line | nil at end of input | false after Ctrl-C */
static int l_readline(lua_State *L) {
  const char *prompt = luaL_optstring(L, 1, "> ");
  install_handler();
  g_L = L;
  g_sigint = 0;
  g_cancel = 0;
  lua_sethook(L, NULL, 0, 0);
  gp_interrupt_clear();
  rl_catch_signals = 0;
  rl_getc_function = prompt_getc;
  g_at_prompt = 1;
  char *line = readline(prompt);
  g_at_prompt = 0;
  if (g_cancel) {
    free(line);
    lua_pushboolean(L, 0);
    return 1;
  }
  if (!line) {
    lua_pushnil(L);
    return 1;
  }
  lua_pushstring(L, line);
  free(line);
  return 1;
}

/* set_completer(fn): fn(word, line_before_word) returns a list of full candidates */
static int l_set_completer(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  if (g_complete_ref != LUA_NOREF) luaL_unref(L, LUA_REGISTRYINDEX, g_complete_ref);
  lua_pushvalue(L, 1);
  g_complete_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  g_L = L;
  rl_attempted_completion_function = complete;
  rl_completer_word_break_characters = (char *)" \t\n\"'`@$><=;|&{(,+-*/%^~#[]";
  rl_basic_word_break_characters = rl_completer_word_break_characters;
  return 0;
}

static int l_add_history(lua_State *L) {
  add_history(luaL_checkstring(L, 1));
  return 0;
}

/* load_history(path): read the file if there is one */
static int l_load_history(lua_State *L) {
  read_history(luaL_checkstring(L, 1));
  return 0;
}

/* append_history(path): append the newest entry, keeping at most 1000 */
static int l_append_history(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  if (access(path, F_OK) != 0) {
    FILE *f = fopen(path, "a");
    if (f) fclose(f);
  }
  int rc = append_history(1, path);
  history_truncate_file(path, 1000);
  lua_pushboolean(L, rc == 0);
  return 1;
}

/* run_begin(): Lua code is about to run; Ctrl-C raises "interrupted" in it */
static int l_run_begin(lua_State *L) {
  install_handler();
  g_L = L;
  g_at_prompt = 0;
  gp_interrupt_clear();
  return 0;
}

/* run_end(): drop a hook (and a kernel's stop request) set by a Ctrl-C that came after the code finished */
static int l_run_end(lua_State *L) {
  lua_sethook(L, NULL, 0, 0);
  gp_interrupt_clear();
  return 0;
}

static int l_isatty(lua_State *L) {
  lua_pushboolean(L, isatty(luaL_optint(L, 1, 0)));
  return 1;
}

int gp_luaopen_repl(lua_State *L) {
  static const luaL_Reg fns[] = {
      {"readline", l_readline},         {"set_completer", l_set_completer}, {"add_history", l_add_history},
      {"load_history", l_load_history}, {"append_history", l_append_history}, {"run_begin", l_run_begin},
      {"run_end", l_run_end},           {"isatty", l_isatty},               {NULL, NULL},
  };
  lua_newtable(L);
  luaL_register(L, NULL, fns);
  return 1;
}
