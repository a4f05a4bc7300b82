/* optim.c: AdamW and SGD steps, sums of squares and the clipping factor,
 * per tensor (registry kernels) and over lists of tensors in one launch. */
#include <math.h>
#include <stdlib.h>

#include "gp_hd.h"
#include "optim.h"

static double gscale_of(const gp_tensor *gs) { return gs ? gp_load(gp_ptr(gs), gs->dtype, 0) : 1.0; }

/* low (may be NULL): a bf16/f16 tensor that gets each new p[i] rounded as
 * gp_k_copy rounds it (gp_store of the f32 value) */
static void adamw_cpu(float *p, float *m, float *v, const void *g, int gdt, void *low, int ldt, int64_t n, double gs,
                      double lr, double b1, double b2, double eps, double wd, double bc1, double bc2) {
  for (int64_t i = 0; i < n; i++) {
    double gi = gp_load(g, gdt, i) * gs;
    double mi = b1 * m[i] + (1 - b1) * gi, vi = b2 * v[i] + (1 - b2) * gi * gi;
    double pi = p[i] * (1 - lr * wd);
    p[i] = (float)(pi - lr * (mi / bc1) / (sqrt(vi / bc2) + eps));
    m[i] = (float)mi;
    v[i] = (float)vi;
    if (low) gp_store(low, ldt, i, p[i]);
  }
}

static void sgd_cpu(float *p, float *buf, const void *g, int gdt, void *low, int ldt, int64_t n, double gs, double lr,
                    double mom, double wd, int nesterov) {
  for (int64_t i = 0; i < n; i++) {
    double gi = gp_load(g, gdt, i) * gs + wd * p[i];
    double b = mom * buf[i] + gi;
    buf[i] = (float)b;
    p[i] = (float)(p[i] - lr * (nesterov ? gi + mom * b : b));
    if (low) gp_store(low, ldt, i, p[i]);
  }
}

static int check_hparams(const char *op, double lr, double b1, double b2, double eps, double step) {
  if (!(lr >= 0) || !(b1 >= 0 && b1 < 1) || !(b2 >= 0 && b2 < 1) || !(eps > 0) || !(step >= 1))
    return gp_error("%s: need lr >= 0, 0 <= beta1, beta2 < 1, eps > 0, step >= 1 (got lr %g, betas %g %g, eps %g, step %g)",
                    op, lr, b1, b2, eps, step);
  return GP_OK;
}

int gp_k_adamw(gp_tensor *p, gp_tensor *m, gp_tensor *v, const gp_tensor *g, const gp_tensor *gscale, double lr,
               double beta1, double beta2, double eps, double weight_decay, double step) {
  GP_CHECK(adamw, p, m, v, g, gscale);
  GP_TRY(check_hparams("adamw", lr, beta1, beta2, eps, step));
  double bc1 = 1 - pow(beta1, step), bc2 = 1 - pow(beta2, step);
  GP_CUDA_DISPATCH(p, gp_cuda_adamw(p, m, v, g, gscale, lr, beta1, beta2, eps, weight_decay, bc1, bc2));
  adamw_cpu(gp_ptr(p), gp_ptr(m), gp_ptr(v), gp_ptr(g), g->dtype, NULL, 0, gp_numel(p), gscale_of(gscale), lr, beta1, beta2, eps,
            weight_decay, bc1, bc2);
  return GP_OK;
}

int gp_k_sgd(gp_tensor *p, gp_tensor *buf, const gp_tensor *g, const gp_tensor *gscale, double lr, double momentum,
             double weight_decay, double nesterov) {
  GP_CHECK(sgd, p, buf, g, gscale);
  GP_CUDA_DISPATCH(p, gp_cuda_sgd(p, buf, g, gscale, lr, momentum, weight_decay, nesterov != 0));
  sgd_cpu(gp_ptr(p), gp_ptr(buf), gp_ptr(g), g->dtype, NULL, 0, gp_numel(p), gscale_of(gscale), lr, momentum, weight_decay,
          nesterov != 0);
  return GP_OK;
}

int gp_k_sumsq(gp_tensor *out, const gp_tensor *x) {
  GP_CHECK(sumsq, out, x);
  GP_CUDA_DISPATCH(out, gp_cuda_sumsq(out, x));
  double s = 0;
  const void *px = gp_ptr(x);
  for (int64_t i = 0, n = gp_numel(x); i < n; i++) {
    double v = gp_load(px, x->dtype, i);
    s += v * v;
  }
  *(float *)gp_ptr(out) = (float)s;
  return GP_OK;
}

int gp_k_clip_coef(gp_tensor *scale, const gp_tensor *sumsq, double max_norm, double eps) {
  GP_CHECK(clip_coef, scale, sumsq);
  if (!(max_norm > 0)) return gp_error("clip_coef: max_norm must be > 0, got %g", max_norm);
  GP_CUDA_DISPATCH(scale, gp_cuda_clip_coef(scale, sumsq, max_norm, eps));
  double c = max_norm / (sqrt(*(const float *)gp_ptr(sumsq)) + eps);
  *(float *)gp_ptr(scale) = (float)(c < 1 ? c : 1);
  return GP_OK;
}

/* ---- tensor lists ---- */

void gp_tlist_free(gp_tlist *l) {
  if (!l) return;
  gp_free(l->dev, l->dev_bytes, l->device);
  gp_free(l->partials, l->partial_bytes, l->device);
  free(l->ts);
  free(l->numel);
  free(l);
}

int gp_tlist_create(gp_tlist **out, int groups, int n, const gp_tensor *const *ts) {
  if (!out || !ts || groups < 1 || groups > GP_TLIST_MAX_GROUPS || n < 1)
    return gp_error("tlist: need 1..%d groups of n >= 1 tensors", GP_TLIST_MAX_GROUPS);
  *out = NULL;
  gp_tlist *l = calloc(1, sizeof *l);
  if (!l) return gp_error_oom("tlist: out of host memory");
  l->groups = groups;
  l->n = n;
  l->ts = calloc((size_t)(groups * n), sizeof *l->ts);
  l->numel = calloc((size_t)n, sizeof *l->numel);
  int rc = GP_OK;
  if (!l->ts || !l->numel) {
    rc = gp_error_oom("tlist: out of host memory");
    goto fail;
  }
  l->device = ts[0] ? ts[0]->device : GP_CPU;
  for (int g = 0; g < groups; g++) {
    for (int i = 0; i < n; i++) {
      const gp_tensor *t = ts[g * n + i];
      if (!t) { rc = gp_error("tlist: tensor %d of group %d is nil", i + 1, g + 1); goto fail; }
      if (t->device != l->device) { rc = gp_error("tlist: tensor %d of group %d is on another device", i + 1, g + 1); goto fail; }
      if (!gp_is_contiguous(t)) { rc = gp_error("tlist: tensor %d of group %d is not contiguous", i + 1, g + 1); goto fail; }
      if (i == 0) l->dtype[g] = t->dtype;
      if (t->dtype != l->dtype[g]) { rc = gp_error("tlist: group %d mixes %s and %s", g + 1, gp_dtype_name(l->dtype[g]), gp_dtype_name(t->dtype)); goto fail; }
      if (!gp_is_float(t->dtype) || gp_dtype_cpu_only(t->dtype)) { rc = gp_error("tlist: group %d is %s; f32, bf16 or f16 is needed", g + 1, gp_dtype_name(t->dtype)); goto fail; }
      if (g == 0) l->numel[i] = gp_numel(t);
      else if (gp_numel(t) != l->numel[i]) {
        char b1[96], b2[96];
        rc = gp_error("tlist: tensor %d is %s in group %d but %s in group 1", i + 1, gp_shape_str(t, b1, sizeof b1), g + 1,
                      gp_shape_str(ts[i], b2, sizeof b2));
        goto fail;
      }
      l->ts[g * n + i] = t;
    }
  }
  for (int i = 0; i < n; i++) l->nchunks += (int)((l->numel[i] + GP_CHUNK - 1) / GP_CHUNK);
#if GP_HAVE_CUDA
  if (l->device == GP_CUDA && (rc = gp_cuda_tlist_upload(l)) != GP_OK) goto fail;
#endif
  *out = l;
  return GP_OK;
fail:
  gp_tlist_free(l);
  return rc;
}

/* the list has `groups` groups, or groups + 1 where the last is low (bf16/f16) */
static int check_group(const char *op, const gp_tlist *l, int groups, int g, int dtype) {
  if (!l) return gp_error("%s: null list", op);
  if (l->groups != groups && l->groups != groups + 1)
    return gp_error("%s: the list has %d groups, %d (or %d with low-precision copies) are needed", op, l->groups, groups,
                    groups + 1);
  if (l->groups == groups + 1 && l->dtype[groups] != GP_BF16 && l->dtype[groups] != GP_F16)
    return gp_error("%s: group %d (the low-precision copies) is %s but bf16 or f16 is needed", op, groups + 1,
                    gp_dtype_name(l->dtype[groups]));
  if (g >= 0 && l->dtype[g] != dtype)
    return gp_error("%s: group %d is %s but %s is needed", op, g + 1, gp_dtype_name(l->dtype[g]), gp_dtype_name(dtype));
  return GP_OK;
}

static int check_gscale(const char *op, const gp_tensor *gs, int device) {
  if (gs && (gs->dtype != GP_F32 || gp_numel(gs) != 1 || gs->device != device))
    return gp_error("%s: gscale must be an f32 tensor of one element on the list's device", op);
  return GP_OK;
}

static int check_hyper(const char *op, const gp_tensor *h, int64_t n, int device) {
  if (h && (h->dtype != GP_F32 || gp_numel(h) != n || h->device != device || !gp_is_contiguous(h)))
    return gp_error("%s: hyper must be a contiguous f32 tensor of %lld elements on the list's device", op, (long long)n);
  return GP_OK;
}

int gp_multi_adamw(gp_tlist *l, const gp_tensor *gscale, const gp_tensor *hyper, double lr, double beta1, double beta2,
                   double eps, double weight_decay, double step) {
  GP_TRY(check_group("multi_adamw", l, 4, 0, GP_F32));
  GP_TRY(check_group("multi_adamw", l, 4, 1, GP_F32));
  GP_TRY(check_group("multi_adamw", l, 4, 2, GP_F32));
  GP_TRY(check_gscale("multi_adamw", gscale, l->device));
  GP_TRY(check_hyper("multi_adamw", hyper, 3, l->device));
  GP_TRY(check_hparams("multi_adamw", lr, beta1, beta2, eps, step));
  double bc1 = 1 - pow(beta1, step), bc2 = 1 - pow(beta2, step);
  GP_CUDA_DISPATCH(l, gp_cuda_multi_adamw(l, gscale, hyper, lr, beta1, beta2, eps, weight_decay, bc1, bc2));
  if (hyper) {
    const float *h = (const float *)gp_ptr(hyper);
    lr = h[0], bc1 = h[1], bc2 = h[2];
  }
  double gs = gscale_of(gscale);
  int n = l->n, low = l->groups == 5;
  for (int i = 0; i < n; i++)
    adamw_cpu(gp_ptr(l->ts[i]), gp_ptr(l->ts[n + i]), gp_ptr(l->ts[2 * n + i]), gp_ptr(l->ts[3 * n + i]), l->dtype[3],
              low ? gp_ptr(l->ts[4 * n + i]) : NULL, l->dtype[4], l->numel[i], gs, lr, beta1, beta2, eps, weight_decay,
              bc1, bc2);
  return GP_OK;
}

int gp_multi_sgd(gp_tlist *l, const gp_tensor *gscale, const gp_tensor *hyper, double lr, double momentum,
                 double weight_decay, double nesterov) {
  GP_TRY(check_group("multi_sgd", l, 3, 0, GP_F32));
  GP_TRY(check_group("multi_sgd", l, 3, 1, GP_F32));
  GP_TRY(check_gscale("multi_sgd", gscale, l->device));
  GP_TRY(check_hyper("multi_sgd", hyper, 1, l->device));
  GP_CUDA_DISPATCH(l, gp_cuda_multi_sgd(l, gscale, hyper, lr, momentum, weight_decay, nesterov != 0));
  if (hyper) lr = *(const float *)gp_ptr(hyper);
  double gs = gscale_of(gscale);
  int n = l->n, low = l->groups == 4;
  for (int i = 0; i < n; i++)
    sgd_cpu(gp_ptr(l->ts[i]), gp_ptr(l->ts[n + i]), gp_ptr(l->ts[2 * n + i]), l->dtype[2],
            low ? gp_ptr(l->ts[3 * n + i]) : NULL, l->dtype[3], l->numel[i], gs, lr, momentum, weight_decay, nesterov != 0);
  return GP_OK;
}

int gp_multi_sumsq(gp_tensor *out, gp_tlist *l) {
  if (!l || !out) return gp_error("multi_sumsq: null argument");
  if (out->dtype != GP_F32 || gp_numel(out) != 1 || out->device != l->device)
    return gp_error("multi_sumsq: out must be an f32 tensor of one element on the list's device");
  GP_CUDA_DISPATCH(out, gp_cuda_multi_sumsq(out, l));
  double s = 0;
  for (int i = 0; i < l->n; i++) {
    const void *p = gp_ptr(l->ts[i]);
    for (int64_t k = 0; k < l->numel[i]; k++) {
      double v = gp_load(p, l->dtype[0], k);
      s += v * v;
    }
  }
  *(float *)gp_ptr(out) = (float)s;
  return GP_OK;
}
