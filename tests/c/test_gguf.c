/* Criterion tests of the GGUF reader's C API (src/gguf.c) on the fixture
 * tests/fixtures/gguf/types.gguf (written by the gguf Python package): the
 * accessors, their error paths, and gp_gguf_read's checks of its output.
 * The values themselves are checked from Lua (tests/lua/test_gguf.lua). */
#include <criterion/criterion.h>
#include <string.h>

#include "../../src/internal.h"

#define FIXTURE "tests/fixtures/gguf/types.gguf"

static gp_gguf *open_fixture(void) {
  gp_gguf *g = NULL;
  cr_assert_eq(gp_gguf_open(&g, FIXTURE), GP_OK, "%s", gp_last_error());
  return g;
}

Test(gguf, header_and_metadata) {
  gp_gguf *g = open_fixture();
  cr_assert_eq(gp_gguf_version(g), 3);
  cr_assert_eq(gp_gguf_alignment(g), 32);
  cr_assert_eq(gp_gguf_data_offset(g) % 32, 0);
  int64_t i = gp_gguf_meta_find(g, "test.arr_string"), n, len;
  int type, et;
  cr_assert_geq(i, 0);
  cr_assert_eq(gp_gguf_meta_type(&type, &et, &n, g, i), GP_OK);
  cr_assert(type == 9 && et == 8 && n == 4);
  const char *s;
  cr_assert_eq(gp_gguf_meta_string(&s, &len, g, i, 2), GP_OK);
  cr_assert(len == 5 && !memcmp(s, "\xc3\xbc" "ber", 5));
  double d;
  cr_assert_eq(gp_gguf_meta_number(&d, g, i, 0), GP_ERR);
  cr_assert(strstr(gp_last_error(), FIXTURE ": metadata 'test.arr_string' (array of string) is not a number"), "%s",
            gp_last_error());
  cr_assert_eq(gp_gguf_meta_string(&s, &len, g, i, 4), GP_ERR);
  cr_assert(strstr(gp_last_error(), "has no element 4"), "%s", gp_last_error());
  int64_t v;
  i = gp_gguf_meta_find(g, "test.i64");
  cr_assert_eq(gp_gguf_meta_int(&v, g, i, 0), GP_OK);
  cr_assert_eq(v, -(INT64_C(1) << 62) - 3);
  i = gp_gguf_meta_find(g, "test.arr_i16");
  double two[2];
  cr_assert_eq(gp_gguf_meta_numbers(two, g, i, 0, 2), GP_OK);
  cr_assert(two[0] == -32768 && two[1] == 32767);
  cr_assert_eq(gp_gguf_meta_numbers(two, g, i, 1, 2), GP_ERR);
  i = gp_gguf_meta_find(g, "test.f32");
  cr_assert_eq(gp_gguf_meta_int(&v, g, i, 0), GP_ERR);
  cr_assert(strstr(gp_last_error(), "not an integer"), "%s", gp_last_error());
  cr_assert_eq(gp_gguf_meta_find(g, "nope"), -1);
  cr_assert_eq(gp_gguf_meta_key(&s, &len, g, gp_gguf_meta_count(g)), GP_ERR);
  gp_gguf_close(g);
}

Test(gguf, tensors_and_read) {
  gp_gguf *g = open_fixture();
  cr_assert_eq(gp_gguf_tensor_count(g), 14);
  int64_t i = gp_gguf_tensor_find(g, "q4_1"), dims[4], off, nb;
  cr_assert_geq(i, 0);
  const char *name;
  int type, ndim, block, bytes;
  cr_assert_eq(gp_gguf_tensor_info(&name, &type, &ndim, dims, &off, &nb, g, i), GP_OK);
  cr_assert_str_eq(name, "q4_1");
  cr_assert_str_eq(gp_gguf_type_name(type), "Q4_1");
  cr_assert(ndim == 2 && dims[0] == 96 && dims[1] == 2 && dims[2] == 1 && nb == 120);
  cr_assert_eq(gp_gguf_type_size(&block, &bytes, type), GP_OK);
  cr_assert(block == 32 && bytes == 20);
  cr_assert_null(gp_gguf_type_name(4));
  cr_assert_eq(gp_gguf_type_size(&block, &bytes, 99), GP_ERR);
  cr_assert_eq(gp_gguf_tensor_find(g, "q4_"), -1);
  /* u8 of exactly nbytes, any shape */
  gp_tensor *raw = NULL, *bad = NULL;
  int64_t s2[2] = {6, 20};
  cr_assert_eq(gp_tensor_empty(&raw, GP_U8, GP_CPU, 2, s2), GP_OK);
  cr_assert_eq(gp_gguf_read(g, i, raw), GP_OK, "%s", gp_last_error());
  int64_t s1[1] = {119};
  cr_assert_eq(gp_tensor_empty(&bad, GP_U8, GP_CPU, 1, s1), GP_OK);
  cr_assert_eq(gp_gguf_read(g, i, bad), GP_ERR);
  cr_assert(strstr(gp_last_error(), "tensor 'q4_1' (Q4_1, 120 bytes) is read into a contiguous u8 tensor of 120"),
            "%s", gp_last_error());
  gp_tensor_free(bad);
  /* F32: f32 of numel, or u8 of nbytes; not f16 */
  i = gp_gguf_tensor_find(g, "f32.1d");
  int64_t s7[1] = {7}, s28[1] = {28};
  gp_tensor *f = NULL, *h = NULL, *b = NULL;
  cr_assert_eq(gp_tensor_empty(&f, GP_F32, GP_CPU, 1, s7), GP_OK);
  cr_assert_eq(gp_tensor_empty(&h, GP_F16, GP_CPU, 1, s28), GP_OK);
  cr_assert_eq(gp_tensor_empty(&b, GP_U8, GP_CPU, 1, s28), GP_OK);
  cr_assert_eq(gp_gguf_read(g, i, f), GP_OK, "%s", gp_last_error());
  cr_assert_eq(gp_gguf_read(g, i, b), GP_OK, "%s", gp_last_error());
  cr_assert_eq(memcmp(gp_ptr(f), gp_ptr(b), 28), 0);
  cr_assert_eq(gp_gguf_read(g, i, h), GP_ERR);
  cr_assert_eq(gp_gguf_read(g, 14, b), GP_ERR);
  cr_assert(strstr(gp_last_error(), "no tensor 14"), "%s", gp_last_error());
  /* dequantize the Q4_1 blocks on the CPU */
  gp_tensor *out = NULL;
  int64_t so[2] = {6, 32};
  cr_assert_eq(gp_tensor_empty(&out, GP_F32, GP_CPU, 2, so), GP_OK);
  cr_assert_eq(gp_k_dequant_q4_1(out, raw), GP_OK, "%s", gp_last_error());
  cr_assert_eq(gp_k_dequant_q4_0(out, raw), GP_ERR); /* Q4_0 blocks are 18 bytes */
  cr_assert(strstr(gp_last_error(), "dequant_q4_0"), "%s", gp_last_error());
  gp_tensor_free(out);
  gp_tensor_free(f);
  gp_tensor_free(h);
  gp_tensor_free(b);
  gp_tensor_free(raw);
  gp_gguf_close(g);
}

Test(gguf, open_errors) {
  gp_gguf *g = (gp_gguf *)1;
  cr_assert_eq(gp_gguf_open(&g, "tests/fixtures/gguf/nope.gguf"), GP_ERR);
  cr_assert_null(g);
  cr_assert(strstr(gp_last_error(), "gguf: cannot open tests/fixtures/gguf/nope.gguf"), "%s", gp_last_error());
  cr_assert_eq(gp_gguf_open(&g, "tests/fixtures/gguf/make.py"), GP_ERR);
  cr_assert(strstr(gp_last_error(), "not a GGUF file"), "%s", gp_last_error());
  cr_assert_eq(gp_gguf_open(&g, NULL), GP_ERR);
  gp_gguf_close(NULL);
  cr_assert_eq(gp_gguf_tensor_count(NULL), 0);
}
