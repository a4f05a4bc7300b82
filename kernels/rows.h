/* rows.h: CUDA launchers of rows.cu (arguments already checked; x viewed as rows x D). */
#ifndef GP_ROWS_H
#define GP_ROWS_H
#include "../src/internal.h"
#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_softmax(gp_tensor *out, const gp_tensor *x, int log);
int gp_cuda_softmax_backward(gp_tensor *dx, const gp_tensor *y, const gp_tensor *dy, int log);
int gp_cuda_layer_norm(gp_tensor *out, gp_tensor *mean, gp_tensor *rstd, const gp_tensor *x, const gp_tensor *w,
                       const gp_tensor *b, double eps);
/* dres (or NULL) is added into dx */
int gp_cuda_layer_norm_backward(gp_tensor *dx, gp_tensor *dw, gp_tensor *db, const gp_tensor *x, const gp_tensor *w,
                                const gp_tensor *mean, const gp_tensor *rstd, const gp_tensor *dout,
                                const gp_tensor *dres, int accumulate);
int gp_cuda_rms_norm(gp_tensor *out, gp_tensor *rstd, const gp_tensor *x, const gp_tensor *w, double eps);
/* dres (or NULL) is added into dx */
int gp_cuda_rms_norm_backward(gp_tensor *dx, gp_tensor *dw, const gp_tensor *x, const gp_tensor *w,
                              const gp_tensor *rstd, const gp_tensor *dout, const gp_tensor *dres, int accumulate);
#ifdef __cplusplus
}
#endif
/* rows and D of a [*, D] tensor */
static inline int64_t gp_rows_of(const gp_tensor *x) {
  int64_t n = 1;
  for (int i = 0; i < x->ndim - 1; i++) n *= x->shape[i];
  return n;
}
static inline int64_t gp_cols_of(const gp_tensor *x) { return x->ndim ? x->shape[x->ndim - 1] : 1; }
#endif
