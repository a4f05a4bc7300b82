/* fused.h: CUDA launchers of fused.cu (arguments already checked). */
#ifndef GP_FUSED_H
#define GP_FUSED_H
#include "../src/internal.h"
#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_swiglu(gp_tensor *out, const gp_tensor *gate, const gp_tensor *up);
int gp_cuda_swiglu_backward(gp_tensor *dgate, gp_tensor *dup, const gp_tensor *gate, const gp_tensor *up,
                            const gp_tensor *dout);
int gp_cuda_add_rms_norm(gp_tensor *out, gp_tensor *res_out, gp_tensor *rstd, const gp_tensor *x, const gp_tensor *res,
                         const gp_tensor *w, double eps);
int gp_cuda_add_layer_norm(gp_tensor *out, gp_tensor *res_out, gp_tensor *mean, gp_tensor *rstd, const gp_tensor *x,
                           const gp_tensor *res, const gp_tensor *w, const gp_tensor *b, double eps);
int gp_cuda_bias_gelu(gp_tensor *out, const gp_tensor *x, const gp_tensor *b);
int gp_cuda_swiglu_linear(gp_tensor *out, const gp_tensor *gu, const gp_tensor *w);
int gp_cuda_rows_linear(gp_tensor *out, const gp_tensor *x, const gp_tensor *w);
int gp_cuda_rows_linear_bias(gp_tensor *out, const gp_tensor *x, const gp_tensor *w, const gp_tensor *b, int act);
#ifdef __cplusplus
}
#endif
#endif
