/* gp_hd.h: code the CPU references (.c) and the CUDA kernels (.cu) share,
 * written once for both: GP_HD functions are __host__ __device__ under nvcc
 * and static inline in C. Strided loop offsets, the Philox4x32-10
 * counter-based generator, and the semantics of integer arithmetic. Kernels
 * include it; the host (src/) does not. */
#ifndef GP_HD_H
#define GP_HD_H

#include <stdint.h>

#include "../src/internal.h"

#ifdef __CUDACC__
#define GP_HD __host__ __device__ __forceinline__
#else
#define GP_HD static inline
#endif

/* Element offsets of linear index i for every operand of a loop. */
GP_HD void gp_loop_offsets(const gp_loop *L, int64_t i, int64_t *off) {
  if (L->ndim == 1) {
    for (int k = 0; k < L->nops; k++) off[k] = i * L->stride[k][0];
    return;
  }
  for (int k = 0; k < L->nops; k++) off[k] = 0;
  for (int d = L->ndim - 1; d >= 0; d--) {
    int64_t n = L->shape[d], q = i / n, r = i - q * n;
    for (int k = 0; k < L->nops; k++) off[k] += r * L->stride[k][d];
    i = q;
  }
}

/* Philox4x32-10 (Salmon et al., SC'11). */
typedef struct {
  uint32_t v[4];
} gp_u32x4;

GP_HD gp_u32x4 gp_philox(uint64_t seed, uint64_t counter) {
  uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  gp_u32x4 out = {{c0, c1, c2, c3}};
  return out;
}

/* 32 random bits -> float in [0, 1) with 24 bits (exact in float and double). */
GP_HD float gp_u01(uint32_t x) { return (float)(x >> 8) * 5.9604644775390625e-08f; }
/* ... in (0, 1], for logarithms. */
GP_HD float gp_u01_open(uint32_t x) { return (float)((x >> 8) + 1) * 5.9604644775390625e-08f; }

/* Integer arithmetic in int64, the same on the CPU and the GPU: wrapping
 * (two's complement, through uint64 so never undefined), truncated division
 * with x / 0 = 0, and powers by squaring. */
GP_HD int64_t gp_i64_neg(int64_t a) { return (int64_t)(0 - (uint64_t)a); }
GP_HD int64_t gp_i64_abs(int64_t a) { return a < 0 ? gp_i64_neg(a) : a; }
GP_HD int64_t gp_i64_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
GP_HD int64_t gp_i64_sub(int64_t a, int64_t b) { return (int64_t)((uint64_t)a - (uint64_t)b); }
GP_HD int64_t gp_i64_mul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }
/* a / b truncated; x / 0 = 0; INT64_MIN / -1 wraps to INT64_MIN */
GP_HD int64_t gp_i64_div(int64_t a, int64_t b) { return b == 0 ? 0 : b == -1 ? gp_i64_neg(a) : a / b; }
/* a ^ e, wrapping; e < 0: 1 ^ e = 1, (-1) ^ e = +-1, anything else 0 */
GP_HD int64_t gp_i64_pow(int64_t a, int64_t e) {
  if (e < 0) return a == 1 ? 1 : a == -1 ? ((e & 1) ? -1 : 1) : 0;
  uint64_t r = 1, x = (uint64_t)a;
  while (e) {
    if (e & 1) r *= x;
    x *= x;
    e >>= 1;
  }
  return (int64_t)r;
}

#endif
