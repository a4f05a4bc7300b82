/* fuzz_gguf.c: libFuzzer harness for the GGUF reader (src/gguf.c) and the
 * dequantization kernels' CPU references (kernels/dequant.c).
 *
 *   make fuzz                                  # builds build/fuzz_gguf (clang, ASan + UBSan)
 *   build/fuzz_gguf -max_total_time=300 build/fuzz-corpus tests/fixtures/gguf
 *
 * Each input is written to a memfd and opened through /proc/self/fd/N (the
 * reader maps files). When it opens, every accessor is called on every
 * metadata entry and tensor, every tensor of at most 1 MiB is read, and
 * those of a decoded type are dequantized on the CPU. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

static int dequant(gp_tensor *out, const gp_tensor *x, int type) {
  switch (type) {
    case 2: return gp_k_dequant_q4_0(out, x);
    case 3: return gp_k_dequant_q4_1(out, x);
    case 6: return gp_k_dequant_q5_0(out, x);
    case 7: return gp_k_dequant_q5_1(out, x);
    case 8: return gp_k_dequant_q8_0(out, x);
    case 12: return gp_k_dequant_q4_k(out, x);
    case 13: return gp_k_dequant_q5_k(out, x);
    case 14: return gp_k_dequant_q6_k(out, x);
    default: return -1;
  }
}

static volatile uint64_t sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int fd = -1;
  static char path[64];
  if (fd < 0) {
    fd = memfd_create("gguf", 0);
    if (fd < 0) abort();
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  }
  if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != (ssize_t)size) abort();
  gp_gguf *g = NULL;
  if (gp_gguf_open(&g, path) != GP_OK) {
    sink += strlen(gp_last_error());
    return 0;
  }
  for (int64_t i = 0; i < gp_gguf_meta_count(g); i++) {
    const char *k;
    int64_t len, n;
    int type, et;
    if (gp_gguf_meta_key(&k, &len, g, i) != GP_OK || gp_gguf_meta_type(&type, &et, &n, g, i) != GP_OK) abort();
    for (int64_t j = 0; j < len; j++) sink += (uint8_t)k[j];
    int64_t m = n < 64 ? n : 64; /* the first elements, and the last */
    for (int64_t jj = 0; jj < m + 1 && n > 0; jj++) {
      int64_t j = jj < m ? jj : n - 1;
      double d;
      int64_t v;
      const char *s;
      if (gp_gguf_meta_number(&d, g, i, j) == GP_OK) sink += (uint64_t)(d == d);
      if (gp_gguf_meta_int(&v, g, i, j) == GP_OK) sink += (uint64_t)v;
      if (gp_gguf_meta_string(&s, &len, g, i, j) == GP_OK && len > 0) sink += (uint8_t)s[0] + (uint8_t)s[len - 1];
    }
    double buf[8];
    gp_gguf_meta_numbers(buf, g, i, n > 8 ? n - 8 : 0, n > 8 ? 8 : n);
    gp_gguf_meta_number(buf, g, i, n); /* one past the end: an error */
  }
  for (int64_t i = 0; i < gp_gguf_tensor_count(g); i++) {
    const char *name;
    int type, ndim, block, bytes;
    int64_t dims[4], off, nb;
    if (gp_gguf_tensor_info(&name, &type, &ndim, dims, &off, &nb, g, i) != GP_OK) abort();
    if (gp_gguf_tensor_find(g, name) != i) abort();
    if (!gp_gguf_type_name(type) || gp_gguf_type_size(&block, &bytes, type) != GP_OK) abort();
    if (nb > (1 << 20)) continue;
    gp_tensor *raw = NULL;
    int64_t shape[2] = {nb / bytes, bytes};
    if (gp_tensor_empty(&raw, GP_U8, GP_CPU, 2, shape) != GP_OK) abort();
    if (gp_gguf_read(g, i, raw) != GP_OK) abort();
    gp_tensor *out = NULL;
    int64_t oshape[2] = {nb / bytes, block};
    if (gp_tensor_empty(&out, GP_F32, GP_CPU, 2, oshape) != GP_OK) abort();
    int rc = dequant(out, raw, type);
    if (rc > 0) abort(); /* a decoded type's blocks always decode */
    gp_tensor_free(out);
    gp_tensor_free(raw);
  }
  gp_gguf_close(g);
  return 0;
}
