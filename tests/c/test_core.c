/* Criterion tests of the C core: tensors and views, specs, loops, the
 * allocator, half precision, the generator, and CPU kernels; CUDA cases
 * compare the GPU with the CPU and are skipped without a GPU. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../../kernels/gp_hd.h"

static gp_tensor *mk(int dtype, int device, int ndim, const int64_t *shape) {
  gp_tensor *t = NULL;
  cr_assert_eq(gp_tensor_empty(&t, dtype, device, ndim, shape), GP_OK, "%s", gp_last_error());
  return t;
}

static gp_tensor *from(int dtype, int device, int ndim, const int64_t *shape, const double *v) {
  gp_tensor *t = mk(dtype, device, ndim, shape);
  cr_assert_eq(gp_from_doubles(t, v, gp_numel(t)), GP_OK, "%s", gp_last_error());
  return t;
}

static void values(const gp_tensor *t, double *out) {
  gp_tensor *c = NULL;
  const gp_tensor *src = t;
  if (!gp_is_contiguous(t)) {
    c = mk(t->dtype, t->device, t->ndim, t->shape);
    cr_assert_eq(gp_k_copy(c, t), GP_OK, "%s", gp_last_error());
    src = c;
  }
  cr_assert_eq(gp_to_doubles(out, src, gp_numel(src)), GP_OK, "%s", gp_last_error());
  gp_tensor_free(c);
}

Test(tensor, create_and_free) {
  int64_t s[] = {2, 3, 4};
  gp_tensor *t = mk(GP_BF16, GP_CPU, 3, s);
  cr_assert_eq(gp_numel(t), 24);
  cr_assert(gp_is_contiguous(t));
  cr_assert_eq(t->stride[0], 12);
  cr_assert_eq(t->stride[2], 1);
  cr_assert_eq(gp_elsize(t->dtype), 2);
  gp_tensor_free(t);
  gp_tensor *bad = (gp_tensor *)0x1;
  cr_assert_eq(gp_tensor_empty(&bad, 9, GP_CPU, 1, s), GP_ERR);
  cr_assert_null(bad);
  cr_assert(strstr(gp_last_error(), "dtype"));
  int64_t neg[] = {2, -1};
  cr_assert_eq(gp_tensor_empty(&bad, GP_F32, GP_CPU, 2, neg), GP_ERR);
  cr_assert(strstr(gp_last_error(), "negative"));
}

Test(tensor, views) {
  int64_t s[] = {3, 4};
  double v[12];
  for (int i = 0; i < 12; i++) v[i] = i;
  gp_tensor *t = from(GP_F32, GP_CPU, 2, s, v), *a, *b;
  cr_assert_eq(gp_tensor_alias(&a, t), GP_OK);
  cr_assert_eq(gp_transpose(a, t, 0, 1), GP_OK);
  cr_assert_eq(a->shape[0], 4);
  cr_assert_eq(a->stride[0], 1);
  cr_assert(!gp_is_contiguous(a));
  /* a transposed tensor cannot be flattened by a view */
  int64_t flat[] = {12};
  cr_assert_eq(gp_tensor_alias(&b, a), GP_OK);
  cr_assert_eq(gp_view(b, a, 1, flat), GP_ERR);
  cr_assert(strstr(gp_last_error(), "view"));
  /* but splitting a dim of it can */
  int64_t split[] = {2, 2, 3};
  cr_assert_eq(gp_view(b, a, 3, split), GP_OK, "%s", gp_last_error());
  double got[12];
  values(b, got);
  cr_assert_eq(got[1], 4);
  cr_assert_eq(got[3], 1);
  /* narrow keeps the storage and moves the offset */
  cr_assert_eq(gp_narrow(b, t, 1, 1, 2), GP_OK);
  cr_assert_eq(b->offset, 1);
  values(b, got);
  cr_assert_eq(got[0], 1);
  cr_assert_eq(got[2], 5);
  cr_assert_eq(gp_narrow(b, t, 1, 3, 2), GP_ERR);
  cr_assert(strstr(gp_last_error(), "(3,4)"), "%s", gp_last_error());
  /* expand and as_strided bounds */
  int64_t e[] = {2, 3, 4}, st[] = {0, 4, 1};
  cr_assert_eq(gp_expand(b, t, 3, e), GP_OK);
  cr_assert_eq(b->stride[0], 0);
  int64_t big[] = {5, 4};
  cr_assert_eq(gp_as_strided(b, t, 2, big, st + 1, 0), GP_ERR);
  cr_assert(strstr(gp_last_error(), "storage"));
  gp_tensor_free(a);
  gp_tensor_free(b);
  gp_tensor_free(t); /* storage freed with the last reference */
}

Test(spec, messages) {
  int64_t s47[] = {4, 7}, s8[] = {8}, s7[] = {7};
  gp_tensor *x = mk(GP_F32, GP_CPU, 2, s47), *w = mk(GP_F32, GP_CPU, 1, s8), *w7 = mk(GP_F32, GP_CPU, 1, s7);
  gp_tensor *wb = mk(GP_BF16, GP_CPU, 1, s7), *i = mk(GP_I64, GP_CPU, 1, s7);
  const gp_tensor *ok[] = {x, x, w7};
  cr_assert_eq(gp_check("rmsnorm", "&out:F[*,D] x:F[*,D] w:F[D] eps:f", 3, ok), GP_OK, "%s", gp_last_error());
  const gp_tensor *bad[] = {x, x, w};
  cr_assert_eq(gp_check("rmsnorm", "&out:F[*,D] x:F[*,D] w:F[D] eps:f", 3, bad), GP_ERR);
  cr_assert_str_eq(gp_last_error(), "rmsnorm: w is (8) but out is (4,7)");
  const gp_tensor *dt[] = {x, x, wb};
  cr_assert_eq(gp_check("rmsnorm", "&out:F[*,D] x:F[*,D] w:F[D]", 3, dt), GP_ERR);
  cr_assert_str_eq(gp_last_error(), "rmsnorm: w is bf16 but out is f32");
  const gp_tensor *idx[] = {x, i};
  cr_assert_eq(gp_check("gather", "&out:F idx:I", 2, idx), GP_OK);
  cr_assert_eq(gp_check("gather", "&out:F idx:F", 2, idx), GP_ERR);
  const gp_tensor *nul[] = {x, NULL};
  cr_assert_eq(gp_check("add", "&out:T a:T[~]", 2, nul), GP_ERR);
  cr_assert(strstr(gp_last_error(), "a is nil"));
  gp_tensor *v[] = {x, w, w7, wb, i};
  for (int k = 0; k < 5; k++) gp_tensor_free(v[k]);
}

Test(loop, merges_dims) {
  int64_t s[] = {2, 3, 4};
  gp_tensor *t = mk(GP_F32, GP_CPU, 3, s);
  gp_loop L;
  const gp_tensor *ops[] = {t, t};
  cr_assert_eq(gp_loop_init(&L, "t", 2, ops), GP_OK);
  cr_assert_eq(L.ndim, 1);
  cr_assert_eq(L.shape[0], 24);
  cr_assert(gp_loop_is_flat(&L));
  int64_t sb[] = {3, 1};
  gp_tensor *b = mk(GP_F32, GP_CPU, 2, sb);
  const gp_tensor *ops2[] = {t, b};
  cr_assert_eq(gp_loop_init(&L, "t", 2, ops2), GP_OK);
  cr_assert_eq(L.ndim, 3); /* b broadcasts with strides (0,1,0): nothing merges */
  cr_assert_eq(L.stride[1][0], 0);
  cr_assert_eq(L.stride[1][1], 1);
  int64_t sr[] = {1, 4};
  gp_tensor *r = mk(GP_F32, GP_CPU, 2, sr);
  const gp_tensor *ops4[] = {t, r};
  cr_assert_eq(gp_loop_init(&L, "t", 2, ops4), GP_OK);
  cr_assert_eq(L.ndim, 2); /* (6,4): dims 1 and 2 merge, r has strides (0,1) */
  cr_assert_eq(L.shape[0], 6);
  cr_assert_eq(L.stride[1][0], 0);
  gp_tensor_free(r);
  int64_t sc[] = {5};
  gp_tensor *c = mk(GP_F32, GP_CPU, 1, sc);
  const gp_tensor *ops3[] = {t, c};
  cr_assert_eq(gp_loop_init(&L, "mul", 2, ops3), GP_ERR);
  cr_assert(strstr(gp_last_error(), "(5)"));
  gp_tensor_free(t);
  gp_tensor_free(b);
  gp_tensor_free(c);
}

Test(alloc, host_stats_and_limit) {
  gp_memstats a, b;
  gp_memory_stats(&a);
  int64_t s[] = {1 << 20};
  gp_tensor *t = mk(GP_F32, GP_CPU, 1, s);
  gp_memory_stats(&b);
  cr_assert_eq(b.host_in_use - a.host_in_use, 4 << 20);
  cr_assert_eq(b.host_allocs - a.host_allocs, 1);
  cr_assert_eq(gp_set_memory_limit(b.host_in_use + 1024), GP_OK);
  gp_tensor *u = NULL;
  cr_assert_eq(gp_tensor_empty(&u, GP_F32, GP_CPU, 1, s), GP_ERR_OOM);
  cr_assert(strstr(gp_last_error(), "out of memory"));
  gp_set_memory_limit(0);
  gp_tensor_free(t);
  gp_memory_stats(&b);
  cr_assert_eq(b.host_in_use, a.host_in_use);
  cr_assert_geq(b.host_peak, a.host_in_use + (4 << 20));
  gp_reset_peak_memory();
  gp_memory_stats(&b);
  cr_assert_eq(b.host_peak, b.host_in_use);
  cr_assert_eq(b.peak, b.in_use);
}

Test(half, conversions) {
  float vals[] = {0.f, 1.f, -2.5f, 65504.f, 1e-7f, 6.1035156e-05f, 3.14159f, 1e10f};
  for (unsigned i = 0; i < sizeof vals / sizeof *vals; i++) {
    float f = vals[i];
    float h = gp_f16_to_f32(gp_f32_to_f16(f));
    if (fabsf(f) > 65504.f) cr_assert(isinf(h));
    else if (fabsf(f) >= 6.1035156e-05f) cr_assert(fabsf(h - f) <= fabsf(f) * 4.9e-4f, "%g -> %g", f, h);
    else cr_assert(fabsf(h - f) <= 6e-8f, "%g -> %g", f, h);
    float b = gp_bf16_to_f32(gp_f32_to_bf16(f));
    cr_assert(fabsf(b - f) <= fabsf(f) * 3.9e-3f, "%g -> %g", f, b);
  }
  cr_assert_eq(gp_f32_to_bf16(1.00390625f), 0x3f80); /* ties to even */
  cr_assert(isnan(gp_bf16_to_f32(gp_f32_to_bf16(NAN))));
  cr_assert(isnan(gp_f16_to_f32(gp_f32_to_f16(NAN))));
  for (uint32_t h = 0; h < 0x7c00; h++) /* every finite positive half round-trips */
    cr_assert_eq(gp_f32_to_f16(gp_f16_to_f32((uint16_t)h)), h);
}

Test(random, philox_known_answer) {
  /* Random123 kat_vectors: philox4x32 10, counter 0, key 0 */
  gp_u32x4 r = gp_philox(0, 0);
  cr_assert_eq(r.v[0], 0x6627e8d5u);
  cr_assert_eq(r.v[1], 0xe169c58du);
  cr_assert_eq(r.v[2], 0xbc57ac4cu);
  cr_assert_eq(r.v[3], 0x9b00dbd8u);
  cr_assert_eq(gp_u01(0xffffffffu) < 1.0f, 1);
  cr_assert_eq(gp_u01_open(0) > 0.0f, 1);
}

Test(kernels, cpu_values) {
  int64_t s23[] = {2, 3}, s3[] = {3};
  double av[] = {1, 2, 3, 4, 5, 6}, bv[] = {10, 20, 30}, got[6];
  gp_tensor *a = from(GP_F32, GP_CPU, 2, s23, av), *b = from(GP_F32, GP_CPU, 1, s3, bv);
  gp_tensor *o = mk(GP_F32, GP_CPU, 2, s23);
  cr_assert_eq(gp_k_add(o, a, b), GP_OK, "%s", gp_last_error());
  values(o, got);
  cr_assert_eq(got[0], 11);
  cr_assert_eq(got[5], 36);
  cr_assert_eq(gp_k_rsub_s(o, a, 1), GP_OK);
  values(o, got);
  cr_assert_eq(got[2], -2);
  /* integer division by zero is 0, never a trap */
  double iv[] = {7, -7, 3}, zv[] = {0, 2, -1};
  gp_tensor *x = from(GP_I32, GP_CPU, 1, s3, iv), *z = from(GP_I32, GP_CPU, 1, s3, zv), *q = mk(GP_I32, GP_CPU, 1, s3);
  cr_assert_eq(gp_k_div(q, x, z), GP_OK);
  values(q, got);
  cr_assert_eq(got[0], 0);
  cr_assert_eq(got[1], -3);
  cr_assert_eq(got[2], -3);
  /* casts saturate and NaN becomes 0 */
  double fv[] = {300.7, -5, NAN};
  gp_tensor *f = from(GP_F32, GP_CPU, 1, s3, fv), *u = mk(GP_U8, GP_CPU, 1, s3);
  cr_assert_eq(gp_k_copy(u, f), GP_OK);
  values(u, got);
  cr_assert_eq(got[0], 255);
  cr_assert_eq(got[1], 0);
  cr_assert_eq(got[2], 0);
  gp_tensor *v[] = {a, b, o, x, z, q, f, u};
  for (int k = 0; k < 8; k++) gp_tensor_free(v[k]);
}

Test(cuda, round_trip_every_dtype) {
  if (!gp_cuda_available()) cr_skip_test("no CUDA GPU");
  int64_t s[] = {1000003};
  double *v = malloc(sizeof(double) * (size_t)s[0]), *got = malloc(sizeof(double) * (size_t)s[0]);
  for (int64_t i = 0; i < s[0]; i++) v[i] = (double)((i * 7919) % 200) - (i % 3 ? 0 : 50);
  for (int dt = 0; dt < GP_NDTYPES; dt++) {
    if (dt == GP_F64) continue; /* cpu only */
    gp_tensor *h = from(dt, GP_CPU, 1, s, v), *d = mk(dt, GP_CUDA, 1, s), *h2 = mk(dt, GP_CPU, 1, s);
    cr_assert_eq(gp_transfer(d, h), GP_OK, "%s", gp_last_error());
    cr_assert_eq(gp_transfer(h2, d), GP_OK, "%s", gp_last_error());
    cr_assert_eq(memcmp(gp_ptr(h), gp_ptr(h2), (size_t)s[0] * (size_t)gp_elsize(dt)), 0, "dtype %s", gp_dtype_name(dt));
    gp_tensor_free(h);
    gp_tensor_free(d);
    gp_tensor_free(h2);
  }
  free(v);
  free(got);
}

Test(cuda, add_matches_cpu) {
  if (!gp_cuda_available()) cr_skip_test("no CUDA GPU");
  int64_t s[] = {513, 129}, sb[] = {129};
  gp_tensor *a = mk(GP_F32, GP_CPU, 2, s), *b = mk(GP_F32, GP_CPU, 1, sb), *o = mk(GP_F32, GP_CPU, 2, s);
  gp_manual_seed(3);
  cr_assert_eq(gp_k_rand_normal(a, 0, 1), GP_OK);
  cr_assert_eq(gp_k_rand_normal(b, 0, 1), GP_OK);
  cr_assert_eq(gp_k_add(o, a, b), GP_OK);
  gp_tensor *da = mk(GP_F32, GP_CUDA, 2, s), *db = mk(GP_F32, GP_CUDA, 1, sb), *dout = mk(GP_F32, GP_CUDA, 2, s);
  cr_assert_eq(gp_transfer(da, a), GP_OK);
  cr_assert_eq(gp_transfer(db, b), GP_OK);
  cr_assert_eq(gp_k_fill(dout, NAN), GP_OK);
  cr_assert_eq(gp_k_add(dout, da, db), GP_OK, "%s", gp_last_error());
  gp_tensor *back = mk(GP_F32, GP_CPU, 2, s);
  cr_assert_eq(gp_transfer(back, dout), GP_OK);
  cr_assert_eq(memcmp(gp_ptr(back), gp_ptr(o), (size_t)gp_numel(o) * 4), 0);
  gp_tensor *v[] = {a, b, o, da, db, dout, back};
  for (int k = 0; k < 7; k++) gp_tensor_free(v[k]);
}

Test(cuda, allocator_caches) {
  if (!gp_cuda_available()) cr_skip_test("no CUDA GPU");
  int64_t s[] = {1 << 18};
  gp_memstats a, b;
  gp_tensor *t = mk(GP_F32, GP_CUDA, 1, s);
  gp_tensor_free(t);
  gp_memory_stats(&a);
  for (int i = 0; i < 1000; i++) {
    t = mk(GP_F32, GP_CUDA, 1, s);
    gp_tensor_free(t);
  }
  gp_memory_stats(&b);
  cr_assert_eq(b.cache_hits - a.cache_hits, 1000);
  cr_assert_eq(b.reserved, a.reserved);
  cr_assert_eq(gp_empty_cache(), GP_OK);
  gp_memory_stats(&b);
  cr_assert_eq(b.cached_blocks, 0);
}

/* every test of the cuda suite ends with the library's exit path: no device
 * block is left for compute-sanitizer's leak check (make sanitize) */
static void cuda_fini(void) { gp_shutdown(); }
TestSuite(cuda, .fini = cuda_fini);

Test(cuda, shutdown_returns_everything) {
  if (!gp_cuda_available()) cr_skip_test("no CUDA GPU");
  int64_t s[] = {1 << 20};
  gp_tensor *t = mk(GP_F32, GP_CUDA, 1, s);
  gp_tensor_free(t); /* cached, still reserved */
  gp_memstats m;
  gp_memory_stats(&m);
  cr_assert_gt(m.reserved, 0);
  gp_shutdown();
  gp_memory_stats(&m);
  cr_assert_eq(m.reserved, 0);
  cr_assert_eq(m.cached_blocks, 0);
  cr_assert_eq(gp_cuda_available(), 0);
  gp_tensor *u = NULL;
  cr_assert_neq(gp_tensor_empty(&u, GP_F32, GP_CUDA, 1, s), GP_OK);
  cr_assert(strstr(gp_last_error(), "no CUDA GPU is usable"), "%s", gp_last_error());
  gp_shutdown(); /* twice is harmless */
}

/* ---- atomic file replacement (src/atomic.c), both ways: O_TMPFILE and mkstemp ---- */

static int count_entries(const char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "ls -A %s | wc -l", dir);
  FILE *p = popen(cmd, "r");
  int n = -1;
  if (p && fscanf(p, "%d", &n) != 1) n = -1;
  if (p) pclose(p);
  return n;
}

Test(atomic, replace_commit_abort_and_errors) {
  char dir[] = "/tmp/gp_atomic_XXXXXX";
  cr_assert(mkdtemp(dir));
  char path[600], bad[600];
  snprintf(path, sizeof path, "%s/f.bin", dir);
  snprintf(bad, sizeof bad, "%s/missing/f.bin", dir);
  for (int way = 0; way < 2; way++) {
    gp_afile a;
    cr_assert_eq(gp_afile_open(&a, path, "t", way), GP_OK, "%s", gp_last_error());
    cr_assert_eq(gp_afile_write(&a, "hello ", 6, "t"), GP_OK);
    cr_assert_eq(gp_afile_write(&a, way ? "mkstemp" : "tmpfile", 7, "t"), GP_OK);
    /* nothing at the target until the commit */
    cr_assert_eq(count_entries(dir), way == 0 ? 0 : 2, "way %d", way); /* mkstemp: the temporary file has a name */
    cr_assert_eq(gp_afile_commit(&a, "t"), GP_OK, "%s", gp_last_error());
    FILE *f = fopen(path, "rb");
    char buf[32] = {0};
    cr_assert(f);
    cr_assert_eq(fread(buf, 1, sizeof buf - 1, f), 13);
    fclose(f);
    cr_assert_str_eq(buf, way ? "hello mkstemp" : "hello tmpfile");
    cr_assert_eq(count_entries(dir), 1, "only the target is left");
    /* abort leaves the old file and nothing else */
    cr_assert_eq(gp_afile_open(&a, path, "t", way), GP_OK);
    cr_assert_eq(gp_afile_write(&a, "x", 1, "t"), GP_OK);
    gp_afile_abort(&a);
    cr_assert_eq(count_entries(dir), 1);
    /* a missing directory, a name that ends in / */
    cr_assert_neq(gp_afile_open(&a, bad, "t", way), GP_OK);
    cr_assert(strstr(gp_last_error(), "missing"), "%s", gp_last_error());
    cr_assert_neq(gp_afile_open(&a, "/tmp/", "t", way), GP_OK);
  }
  /* a directory as the target: the rename fails, the temporary file goes */
  char sub[600];
  snprintf(sub, sizeof sub, "%s/sub", dir);
  cr_assert_eq(mkdir(sub, 0755), 0);
  gp_afile a;
  cr_assert_eq(gp_afile_open(&a, sub, "t", 1), GP_OK);
  cr_assert_eq(gp_afile_write(&a, "x", 1, "t"), GP_OK);
  cr_assert_neq(gp_afile_commit(&a, "t"), GP_OK);
  cr_assert_eq(count_entries(dir), 2, "f.bin and sub only");
  rmdir(sub);
  unlink(path);
  rmdir(dir);
}
