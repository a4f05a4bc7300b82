/* common.h: code shared by the CPU references (.c) and the CUDA kernels (.cu):
 * strided loop offsets and the Philox4x32-10 counter-based generator. */
#ifndef GP_KERNELS_COMMON_H
#define GP_KERNELS_COMMON_H

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
typedef struct { uint32_t v[4]; } gp_u32x4;

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

#endif
