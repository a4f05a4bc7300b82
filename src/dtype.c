/* dtype.c: the dtype table (GP_DTYPES in gpush.h) and what is read from it. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static const gp_dtype_info g_dtypes[] = {
#define GP_DTYPE_ROW_(E, value, name, size, is_float, is_int, cpu_only, aliases) \
  [GP_##E] = {name, aliases, size, is_float, is_int, cpu_only},
    GP_DTYPES(GP_DTYPE_ROW_)
#undef GP_DTYPE_ROW_
};
#define GP_DTYPE_ONE_(E, ...) +1
_Static_assert(0 GP_DTYPES(GP_DTYPE_ONE_) == GP_NDTYPES && sizeof g_dtypes / sizeof g_dtypes[0] == GP_NDTYPES,
               "GP_DTYPES: the values must be 0, 1, ..., one a dtype");
#undef GP_DTYPE_ONE_

int gp_dtype_count(void) { return GP_NDTYPES; }

const gp_dtype_info *gp_dtype_get(int i) { return i >= 0 && i < GP_NDTYPES ? &g_dtypes[i] : NULL; }

const char *gp_dtype_name(int dt) { return dt >= 0 && dt < GP_NDTYPES ? g_dtypes[dt].name : "?"; }

int gp_elsize(int dt) { return dt >= 0 && dt < GP_NDTYPES ? g_dtypes[dt].size : 0; }

int gp_dtype_find(const char *s, size_t n) {
  for (int i = 0; i < GP_NDTYPES; i++)
    if (strlen(g_dtypes[i].name) == n && !strncmp(s, g_dtypes[i].name, n)) return i;
  return -1;
}

const char *gp_dtype_list(char *buf, size_t n, int (*pred)(int dtype)) {
  size_t k = 0;
  if (n) buf[0] = 0;
  for (int i = 0; i < GP_NDTYPES && k < n; i++)
    if (!pred || pred(i)) k += (size_t)snprintf(buf + k, n - k, "%s%s", k ? ", " : "", g_dtypes[i].name);
  return buf;
}
