/* titans.h: the serial scans of titans_coef and its backward over one row,
 * shared by the CPU reference (double) and the CUDA kernels (float in shared
 * memory). R is the real type; QUAL the function qualifiers. Indices are
 * 0-based here: token s of the text is s - 1. */
#ifndef GP_TITANS_H
#define GP_TITANS_H
#include "../src/internal.h"

#define GP_TITANS_SCANS(PREFIX, R, QUAL)                                                                           \
  /* w[s] = prod_{r>s} eta[r]; b[s] = prod_{r>s} (1 - alpha[r]); c[s] = b[s] + eta[s+1] c[s+1]; p = (eta[0] w[0], \
   * (1 - alpha[0]) b[0], eta[0] c[0]) */                                                                       \
  QUAL void PREFIX##_coef(int64_t L, const R *eta, const R *alpha, R *w, R *c, R *b, R *p) {                    \
    R wn = 1, bn = 1, cn = 1;                                                                                   \
    w[L - 1] = 1; b[L - 1] = 1; c[L - 1] = 1;                                                                   \
    for (int64_t s = L - 2; s >= 0; s--) {                                                                      \
      const R e = eta[s + 1];                                                                                   \
      bn = (1 - alpha[s + 1]) * bn;                                                                             \
      cn = bn + e * cn;                                                                                         \
      wn = e * wn;                                                                                              \
      w[s] = wn; b[s] = bn; c[s] = cn;                                                                          \
    }                                                                                                           \
    p[0] = eta[0] * w[0];                                                                                       \
    p[1] = (1 - alpha[0]) * b[0];                                                                               \
    p[2] = eta[0] * c[0];                                                                                       \
  }                                                                                                             \
  /* adjoint of the reverse recurrence, run forward; b (from PREFIX##_coef) is read at index s + 1 before the  \
   * same index of dalpha is written, so b may alias dalpha */                                                  \
  QUAL void PREFIX##_coef_backward(int64_t L, const R *eta, const R *alpha, const R *w, const R *c, const R *b,  \
                                   const R *dw, const R *dc, const R *dp, R *deta, R *dalpha) {                 \
    R gw = dw[0] + dp[0] * eta[0], gc = dc[0] + dp[2] * eta[0], gb = dp[1] * (1 - alpha[0]);                  \
    const R de0 = dp[0] * w[0] + dp[2] * c[0], db0 = dp[1] * b[0];                                            \
    deta[0] = de0;                                                                                              \
    dalpha[0] = -db0;                                                                                           \
    for (int64_t s = 0; s + 1 < L; s++) {                                                                       \
      const R e = eta[s + 1], be = 1 - alpha[s + 1], bn = b[s + 1];                                            \
      gb += gc;                                                    /* c[s] = b[s] + e c[s+1] */                \
      deta[s + 1] = gw * w[s + 1] + gc * c[s + 1];                 /* w[s] = e w[s+1] */                       \
      dalpha[s + 1] = -gb * bn;                                    /* b[s] = be b[s+1] */                      \
      gw = dw[s + 1] + gw * e;                                                                                  \
      gc = dc[s + 1] + gc * e;                                                                                  \
      gb = gb * be;                                                                                             \
    }                                                                                                           \
  }

/* the gates' and the memory inputs' scalar functions, shared the same way */
#define GP_TITANS_POINTWISE(PREFIX, R, QUAL)                                                                       \
  QUAL R PREFIX##_sigmoid(R x) { return (R)1 / ((R)1 + exp(-x)); }                                              \
  /* alpha = 1 - sigmoid(-m)^(1/b) = 1 - exp(-softplus(m) / b) */                                              \
  QUAL R PREFIX##_alpha(R m, R b) {                                                                             \
    const R sp = m > 0 ? m + log1p(exp(-m)) : log1p(exp(m));                                                   \
    return -expm1(-sp / b);                                                                                     \
  }                                                                                                             \
  /* silu(y), and its derivative in *ds */                                                                     \
  QUAL R PREFIX##_silu(R y, R *ds) {                                                                            \
    const R s = PREFIX##_sigmoid(y);                                                                            \
    *ds = s * (1 + y * (1 - s));                                                                                \
    return y * s;                                                                                               \
  }

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_titans_coef(gp_tensor *w, gp_tensor *c, gp_tensor *p, const gp_tensor *eta, const gp_tensor *alpha);
int gp_cuda_titans_coef_backward(gp_tensor *deta, gp_tensor *dalpha, const gp_tensor *eta, const gp_tensor *alpha,
                                 const gp_tensor *w, const gp_tensor *c, const gp_tensor *dw, const gp_tensor *dc,
                                 const gp_tensor *dp);
int gp_cuda_titans_scan(gp_tensor *y, gp_tensor *st, gp_tensor *M, gp_tensor *S, const gp_tensor *k,
                        const gp_tensor *v, const gp_tensor *q, const gp_tensor *theta, const gp_tensor *w,
                        const gp_tensor *c, const gp_tensor *p, const gp_tensor *M0, const gp_tensor *S0);
int gp_cuda_titans_scan_backward(gp_tensor *dk, gp_tensor *dv, gp_tensor *dq, gp_tensor *dtheta, gp_tensor *dw,
                                 gp_tensor *dc, gp_tensor *dp, gp_tensor *dM0, gp_tensor *dS0, const gp_tensor *k,
                                 const gp_tensor *v, const gp_tensor *q, const gp_tensor *theta, const gp_tensor *w,
                                 const gp_tensor *c, const gp_tensor *p, const gp_tensor *st, const gp_tensor *dy,
                                 const gp_tensor *dM, const gp_tensor *dS);
int gp_cuda_titans_gates(gp_tensor *theta, gp_tensor *eta, gp_tensor *alpha, const gp_tensor *g, int64_t b);
int gp_cuda_titans_gates_backward(gp_tensor *dg, const gp_tensor *g, const gp_tensor *dtheta, const gp_tensor *deta,
                                  const gp_tensor *dalpha, int64_t b);
int gp_cuda_titans_prep(gp_tensor *out, const gp_tensor *y, int norm, double eps);
int gp_cuda_titans_prep_backward(gp_tensor *dy, const gp_tensor *y, const gp_tensor *dout, int norm, double eps);
#ifdef __cplusplus
}
#endif
#endif
