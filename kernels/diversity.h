/* diversity.h: the CUDA launchers of the diversity family (kernels/diversity.cu). */
#ifndef GP_KERNELS_DIVERSITY_H
#define GP_KERNELS_DIVERSITY_H

#include "../src/internal.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_set_diversity(gp_tensor *out, const gp_tensor *x, double eps);
int gp_cuda_set_diversity_backward(gp_tensor *dx, const gp_tensor *x, const gp_tensor *dout, double eps);
int gp_cuda_distinct_n(gp_tensor *out, const gp_tensor *tokens, const gp_tensor *lens, int64_t n);
#ifdef __cplusplus
}
#endif

#endif
