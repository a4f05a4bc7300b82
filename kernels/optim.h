/* optim.h: what optim.c and optim.cu share. */
#ifndef GP_OPTIM_H
#define GP_OPTIM_H
#include "../src/internal.h"

#define GP_CHUNK 65536
#define GP_TLIST_MAX_GROUPS 6

struct gp_tlist {
  int groups, n, device, nchunks;
  int dtype[GP_TLIST_MAX_GROUPS];
  const gp_tensor **ts; /* groups * n */
  int64_t *numel;       /* n */
  void *dev;            /* device table: ptrs[groups*n], numel[n], chunk tensor[nchunks], chunk start[nchunks] */
  size_t dev_bytes;
  float *partials;      /* nchunks floats on the device (sumsq) */
  size_t partial_bytes;
};

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_tlist_upload(struct gp_tlist *l);
int gp_cuda_adamw(gp_tensor *p, gp_tensor *m, gp_tensor *v, const gp_tensor *g, const gp_tensor *gscale, double lr,
                  double b1, double b2, double eps, double wd, double bc1, double bc2);
int gp_cuda_sgd(gp_tensor *p, gp_tensor *buf, const gp_tensor *g, const gp_tensor *gscale, double lr, double mom,
                double wd, int nesterov);
int gp_cuda_sumsq(gp_tensor *out, const gp_tensor *x);
int gp_cuda_clip_coef(gp_tensor *scale, const gp_tensor *sumsq, double max_norm, double eps);
int gp_cuda_multi_adamw(struct gp_tlist *l, const gp_tensor *gscale, const gp_tensor *hyper, double lr, double b1,
                        double b2, double eps, double wd, double bc1, double bc2);
int gp_cuda_multi_sgd(struct gp_tlist *l, const gp_tensor *gscale, const gp_tensor *hyper, double lr, double mom,
                      double wd, int nesterov);
int gp_cuda_multi_sumsq(gp_tensor *out, struct gp_tlist *l);
#ifdef __cplusplus
}
#endif
#endif
