/* conv.c: checks, dispatch and the CPU reference (double) of the causal
 * depthwise convolution. x (B, T, C), w (K, C): y[b,t,c] = sum_j w[j,c] x[b,t-K+1+j,c]. */
#include "conv.h"

int gp_k_causal_conv1d(gp_tensor *y, const gp_tensor *x, const gp_tensor *w) {
  GP_CHECK(causal_conv1d, y, x, w);
  if (gp_numel(y) == 0) return GP_OK;
  GP_CUDA_DISPATCH(y, gp_cuda_causal_conv1d(y, x, w));
  const int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[0];
  const char *px = gp_ptr(x), *pw = gp_ptr(w);
  char *py = gp_ptr(y);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t c = 0; c < C; c++) {
        double s = 0;
        for (int64_t j = 0; j < K; j++) {
          const int64_t u = t - K + 1 + j;
          if (u >= 0) s += gp_load(pw, w->dtype, j * C + c) * gp_load(px, x->dtype, (b * T + u) * C + c);
        }
        gp_store(py, y->dtype, (b * T + t) * C + c, s);
      }
  return GP_OK;
}

int gp_k_causal_conv1d_backward(gp_tensor *dx, gp_tensor *dw, const gp_tensor *x, const gp_tensor *w,
                                const gp_tensor *dy) {
  GP_CHECK(causal_conv1d_backward, dx, dw, x, w, dy);
  GP_CUDA_DISPATCH(dx, gp_cuda_causal_conv1d_backward(dx, dw, x, w, dy));
  const int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[0];
  const char *px = gp_ptr(x), *pw = gp_ptr(w), *pg = gp_ptr(dy);
  char *pdx = gp_ptr(dx), *pdw = gp_ptr(dw);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t c = 0; c < C; c++) {
        double s = 0;
        for (int64_t j = 0; j < K; j++) {
          const int64_t u = t + K - 1 - j; /* the output that read x[t] through w[j] */
          if (u < T) s += gp_load(pw, w->dtype, j * C + c) * gp_load(pg, dy->dtype, (b * T + u) * C + c);
        }
        gp_store(pdx, dx->dtype, (b * T + t) * C + c, s);
      }
  for (int64_t j = 0; j < K; j++)
    for (int64_t c = 0; c < C; c++) {
      double s = 0;
      for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
          const int64_t u = t - K + 1 + j;
          if (u >= 0) s += gp_load(pg, dy->dtype, (b * T + t) * C + c) * gp_load(px, x->dtype, (b * T + u) * C + c);
        }
      gp_store(pdw, dw->dtype, j * C + c, s);
    }
  return GP_OK;
}
