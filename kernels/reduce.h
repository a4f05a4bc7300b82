/* reduce.h: op codes shared by reduce.c (CPU) and reduce.cu. */
#ifndef GP_REDUCE_H
#define GP_REDUCE_H
#include "../src/internal.h"

enum { R_SUM, R_MEAN, R_MAX, R_MIN, R_ARGMAX, R_ARGMIN, R_VAR, R_NORM };
/* norm kinds: p = 2, 1, inf, 0, anything else */
enum { N_P2, N_P1, N_INF, N_P0, N_PG };
static inline int gp_reduce_norm_kind(double p) {
  return p == 2 ? N_P2 : p == 1 ? N_P1 : (p > 1e308) ? N_INF : p == 0 ? N_P0 : N_PG;
}

#ifdef __cplusplus
extern "C" {
#endif
/* CUDA launchers (reduce.cu); x viewed as (A, B, C), both contiguous, arguments checked */
int gp_cuda_reduce(int op, gp_tensor *out, const gp_tensor *x, double param);
int gp_cuda_cumsum(gp_tensor *out, const gp_tensor *x);
#ifdef __cplusplus
}
#endif
#endif
