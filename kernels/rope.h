/* rope.h: the CUDA launcher of rope.cu (arguments already checked). */
#ifndef GP_ROPE_H
#define GP_ROPE_H
#include "../src/internal.h"
#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_rope(gp_tensor *out, const gp_tensor *x, const gp_tensor *pos, const gp_tensor *inv_freq, double sign);
int gp_cuda_rope_kv_at(gp_tensor *q, gp_tensor *kc, gp_tensor *vc, const gp_tensor *qkv, const gp_tensor *pos,
                       const gp_tensor *inv_freq);
int gp_cuda_rope_kv_quant_at(gp_tensor *q, gp_tensor *kc, gp_tensor *vc, gp_tensor *ks, gp_tensor *vs,
                             const gp_tensor *kcen, const gp_tensor *qkv, const gp_tensor *pos,
                             const gp_tensor *inv_freq, int fmt);
#ifdef __cplusplus
}
#endif
#endif
