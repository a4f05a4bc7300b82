/* decode_step.h: what decode_step.c and decode_step.cu share (the Llama
 * decode step as one persistent kernel, gp_decode_plan in src/gpush.h). */
#ifndef GP_DECODE_STEP_H
#define GP_DECODE_STEP_H
#include "../src/internal.h"

#define GP_DPLAN_PER_LAYER 8 /* wqkv, wo, wgu, wdown, ln1, ln2, kc, vc */
#define GP_DPLAN_MAX_B 8

/* one layer's device pointers (bf16 everywhere), as the kernel reads them */
typedef struct gp_dlayer {
  const void *wqkv, *wo, *wgu, *wdown, *ln1, *ln2;
  void *kc, *vc;
} gp_dlayer;

struct gp_decode_plan {
  int L, B, d, H, J, hd, I, device;
  int64_t C; /* the caches' capacity (positions) */
  float eps;
  int grid;    /* blocks: one an SM */
  int own;     /* columns of h a block updates (at most) */
  size_t smem; /* dynamic shared memory a block, and its regions' offsets (decode_step.cu) */
  size_t ln_off, buf1_off, xs_off, att_off, red_off, hown_off, cst_off;
  const gp_tensor **ts; /* L * 8, then the final norm's weight */
  void *dev;            /* gp_dlayer[L] */
  size_t dev_bytes;
  void *scratch; /* h, qkv, y, gu (bf16), partials (f32), counters (u32) */
  size_t scratch_bytes;
};

#ifdef __cplusplus
extern "C" {
#endif
/* fills grid, own, smem and its offsets; an error when the device cannot hold the kernel's blocks */
int gp_cuda_decode_plan_geometry(struct gp_decode_plan *p);
int gp_cuda_decode_plan_upload(struct gp_decode_plan *p);
int gp_cuda_decode_plan_run(struct gp_decode_plan *p, gp_tensor *out, const gp_tensor *x, const gp_tensor *pos,
                            const gp_tensor *lens, const gp_tensor *inv_freq, double scale);
#ifdef __cplusplus
}
#endif
#endif
