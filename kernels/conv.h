/* conv.h: the CUDA side of the causal depthwise convolution (kernels/conv.def). */
#ifndef GP_CONV_H
#define GP_CONV_H
#include "../src/internal.h"
#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_causal_conv1d(gp_tensor *y, const gp_tensor *x, const gp_tensor *w);
int gp_cuda_causal_conv1d_backward(gp_tensor *dx, gp_tensor *dw, const gp_tensor *x, const gp_tensor *w,
                                   const gp_tensor *dy);
#ifdef __cplusplus
}
#endif
#endif
