/* Criterion tests of the dtype table (GP_DTYPES in gpush.h): the FFI query
 * the Lua side builds its tables from, and the C helpers derived from it. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "../../src/internal.h"

/* word w appears in the space-separated list s */
static int has_word(const char *s, const char *w) {
  size_t n = strlen(w);
  for (const char *p = s; (p = strstr(p, w)); p += n)
    if ((p == s || p[-1] == ' ') && (p[n] == ' ' || p[n] == 0)) return 1;
  return 0;
}

Test(dtype, table_query) {
  cr_assert_eq(gp_dtype_count(), GP_NDTYPES);
  cr_assert_eq(GP_NDTYPES, 7);
  cr_assert_null(gp_dtype_get(-1));
  cr_assert_null(gp_dtype_get(GP_NDTYPES));
  static const struct {
    int id;
    const char *name;
    int size, is_float, is_int, cpu_only;
    const char *alias;
  } want[] = {
      {GP_F32, "f32", 4, 1, 0, 0, "float32"}, {GP_BF16, "bf16", 2, 1, 0, 0, "bfloat16"},
      {GP_F16, "f16", 2, 1, 0, 0, "half"},    {GP_I32, "i32", 4, 0, 1, 0, "int"},
      {GP_I64, "i64", 8, 0, 1, 0, "long"},    {GP_U8, "u8", 1, 0, 1, 0, "bool"},
      {GP_F64, "f64", 8, 1, 0, 1, "double"},
  };
  for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
    const gp_dtype_info *d = gp_dtype_get(want[k].id);
    cr_assert_not_null(d);
    cr_assert_str_eq(d->name, want[k].name);
    cr_assert_eq(d->size, want[k].size, "%s", d->name);
    cr_assert_eq(d->is_float, want[k].is_float, "%s", d->name);
    cr_assert_eq(d->is_int, want[k].is_int, "%s", d->name);
    cr_assert_eq(d->cpu_only, want[k].cpu_only, "%s", d->name);
    cr_assert(has_word(d->aliases, want[k].alias), "%s: aliases '%s'", d->name, d->aliases);
    /* the helpers read the same table */
    cr_assert_str_eq(gp_dtype_name(want[k].id), d->name);
    cr_assert_eq(gp_elsize(want[k].id), d->size);
    cr_assert_eq(gp_is_float(want[k].id), d->is_float);
    cr_assert_eq(gp_is_int(want[k].id), d->is_int);
    cr_assert_eq(gp_dtype_cpu_only(want[k].id), d->cpu_only);
    cr_assert_eq(gp_dtype_find(d->name, strlen(d->name)), want[k].id);
  }
  cr_assert_str_eq(gp_dtype_get(GP_U8)->aliases, "bool uint8 byte");
  cr_assert_str_eq(gp_dtype_name(GP_NDTYPES), "?");
  cr_assert_eq(gp_elsize(-1), 0);
  cr_assert_eq(gp_dtype_find("f3", 2), -1);
  cr_assert_eq(gp_dtype_find("f32x", 4), -1);
}

Test(dtype, every_spelling_once) {
  /* names and aliases together name each dtype exactly once */
  for (int i = 0; i < gp_dtype_count(); i++) {
    const gp_dtype_info *a = gp_dtype_get(i);
    cr_assert(a->is_float + a->is_int == 1, "%s is neither or both float and int", a->name);
    for (int j = 0; j < gp_dtype_count(); j++) {
      const gp_dtype_info *b = gp_dtype_get(j);
      if (i != j) cr_assert(strcmp(a->name, b->name), "%s twice", a->name);
      cr_assert(!has_word(b->aliases, a->name), "%s is also an alias of %s", a->name, b->name);
      char w[64];
      for (const char *p = a->aliases; *p;) {
        size_t n = strcspn(p, " ");
        snprintf(w, sizeof w, "%.*s", (int)n, p);
        if (i != j) cr_assert(!has_word(b->aliases, w), "alias %s of %s and %s", w, a->name, b->name);
        p += n + (p[n] == ' ');
      }
    }
  }
}

Test(dtype, lists) {
  char buf[64];
  cr_assert_str_eq(gp_dtype_list(buf, sizeof buf, gp_is_float), "f32, bf16, f16, f64");
  cr_assert_str_eq(gp_dtype_list(buf, sizeof buf, gp_is_int), "i32, i64, u8");
  cr_assert_str_eq(gp_dtype_list(buf, sizeof buf, NULL), "f32, bf16, f16, i32, i64, u8, f64");
  char small[6];
  gp_dtype_list(small, sizeof small, NULL); /* truncated, still terminated */
  cr_assert_eq(strlen(small), sizeof small - 1);
}
