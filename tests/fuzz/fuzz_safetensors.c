/* fuzz_safetensors.c: libFuzzer harness of the safetensors reader
 * (src/safetensors.c) and, for the files it accepts, of the writer.
 *
 *   make fuzz; build/fuzz_safetensors -max_total_time=300 build/fuzz-corpus/safetensors tests/fuzz/corpus/safetensors
 *
 * Each input is written to a memfd and opened through /proc/self/fd/N. When
 * it opens, every metadata entry and tensor is looked at and every tensor of
 * at most 1 MiB read; an input that opens is saved again (gp_st_save, the
 * atomic writer) and the copy must open with the same tensors. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

static volatile uint64_t sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int fd = -1;
  static char path[64], copy[64];
  if (fd < 0) {
    fd = memfd_create("st", 0);
    if (fd < 0) abort();
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    snprintf(copy, sizeof copy, "/dev/shm/fuzz_st_copy_%d.st", (int)getpid());
  }
  if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != (ssize_t)size) abort();
  gp_st *st = NULL;
  if (gp_st_open(&st, path) != GP_OK) {
    sink += strlen(gp_last_error());
    return 0;
  }
  int n = gp_st_count(st), nm = gp_st_meta_count(st);
  gp_tensor **ts = calloc((size_t)n + 1, sizeof *ts);
  const char **names = calloc((size_t)n + 1, sizeof *names);
  const char **keys = calloc((size_t)nm + 1, sizeof *keys), **vals = calloc((size_t)nm + 1, sizeof *vals);
  if (!ts || !names || !keys || !vals) abort();
  int all = 1; /* every tensor read: the file can be written again */
  for (int i = 0; i < nm; i++) {
    if (gp_st_meta(st, i, &keys[i], &vals[i]) != GP_OK) abort();
    sink += strlen(keys[i]) + strlen(vals[i]);
  }
  for (int i = 0; i < n; i++) {
    int dtype, ndim;
    int64_t shape[GP_MAX_DIMS];
    if (gp_st_info(st, i, &names[i], &dtype, &ndim, shape) != GP_OK) abort();
    uint64_t bytes = (uint64_t)gp_elsize(dtype);
    for (int d = 0; d < ndim; d++) bytes = shape[d] && bytes > (1u << 20) / (uint64_t)shape[d] ? (1u << 21) : bytes * (uint64_t)shape[d];
    if (bytes > (1u << 20)) {
      all = 0;
      continue;
    }
    if (gp_tensor_empty(&ts[i], dtype, GP_CPU, ndim, shape) != GP_OK) abort();
    if (gp_st_read(st, i, ts[i]) != GP_OK) abort(); /* the header was checked: reading cannot fail */
    const uint8_t *p = gp_ptr(ts[i]);
    for (uint64_t b = 0; p && b < bytes; b += 64) sink += p[b];
  }
  if (all) {
    if (gp_st_save(copy, n, names, (const gp_tensor *const *)ts, nm, keys, vals) == GP_OK) {
      gp_st *st2 = NULL;
      if (gp_st_open(&st2, copy) != GP_OK || gp_st_count(st2) != n || gp_st_meta_count(st2) != nm) abort();
      gp_st_close(st2);
      unlink(copy);
    } else {
      sink += strlen(gp_last_error()); /* e.g. a name cJSON cannot write back */
    }
  }
  for (int i = 0; i < n; i++) gp_tensor_free(ts[i]);
  free(ts);
  free(names);
  free(keys);
  free(vals);
  gp_st_close(st);
  return 0;
}
