/* loss.c: dispatch and CPU reference of the fused cross-entropy and its
 * reduction. Targets are checked before anything is written. */
#include <math.h>

#include "gp_hd.h"
#include "loss.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_cross_entropy(gp_tensor *loss, gp_tensor *dlogits, const gp_tensor *logits, const gp_tensor *targets,
                          const gp_tensor *count, int64_t ignore, double scale, int64_t classes);
int gp_cuda_loss_reduce(gp_tensor *out, gp_tensor *count, const gp_tensor *loss, const gp_tensor *targets, int64_t ignore,
                        int average);
int gp_cuda_loss_count(gp_tensor *count, const gp_tensor *targets, int64_t ignore, int average);
#ifdef __cplusplus
}
#endif

/* every target in [0, v) or ign (v: the classes; logits' columns when 0) */
static int check_targets(const char *op, const gp_tensor *targets, const gp_tensor *logits, int64_t ign, int64_t v) {
  int64_t n = logits->shape[0];
  const void *pt = gp_ptr(targets);
  for (int64_t i = 0; i < n; i++) {
    int64_t t = gp_load_i64(pt, targets->dtype, i);
    if (t != ign && (t < 0 || t >= v))
      return gp_error("%s: target %lld of row %lld is out of range for %lld classes (logits %s; ignore_index %lld)", op,
                      (long long)t, (long long)i, (long long)v, GP_SHAPE(logits), (long long)ign);
  }
  return GP_OK;
}

int gp_loss_check_targets(const char *op, const gp_tensor *targets, const gp_tensor *logits, int64_t ign) {
  return check_targets(op, targets, logits, ign, logits->shape[1]);
}

static int ce(const char *op, gp_tensor *loss, gp_tensor *dlogits, const gp_tensor *logits, const gp_tensor *targets,
              const gp_tensor *count, double ignore_index, double scale, double classes) {
  if (ignore_index != floor(ignore_index) || fabs(ignore_index) > 9e15)
    return gp_error("%s: ignore_index must be an integer, got %g", op, ignore_index);
  int64_t ign = (int64_t)ignore_index, n = logits->shape[0], v = logits->shape[1];
  if (classes != floor(classes) || classes < 0 || classes > (double)v)
    return gp_error("%s: classes must be an integer in [0, %lld] (logits %s; 0: all), got %g", op, (long long)v,
                    GP_SHAPE(logits), classes);
  const int64_t vt = classes > 0 ? (int64_t)classes : v;
  GP_CUDA_DISPATCH(loss, gp_cuda_cross_entropy(loss, dlogits, logits, targets, count, ign, scale, vt));
  GP_TRY(check_targets(op, targets, logits, ign, vt));
  if (count) scale /= *(const float *)gp_ptr(count);
  const void *pt = gp_ptr(targets);
  const void *px = gp_ptr(logits);
  float *pl = gp_ptr(loss);
  void *pg = dlogits ? gp_ptr(dlogits) : 0;
  int dt = logits->dtype;
  for (int64_t i = 0; i < n; i++) {
    int64_t t = gp_load_i64(pt, targets->dtype, i), r = i * v;
    if (t == ign) {
      pl[i] = 0;
      if (pg)
        for (int64_t j = 0; j < v; j++) gp_store(pg, dlogits->dtype, r + j, 0);
      continue;
    }
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < v; j++) {
      double x = gp_load(px, dt, r + j);
      if (x > m) m = x;
    }
    for (int64_t j = 0; j < v; j++) s += exp(gp_load(px, dt, r + j) - m);
    double lse = m + log(s);
    pl[i] = (float)(lse - gp_load(px, dt, r + t));
    if (pg)
      for (int64_t j = 0; j < v; j++)
        gp_store(pg, dlogits->dtype, r + j, (exp(gp_load(px, dt, r + j) - lse) - (j == t ? 1.0 : 0.0)) * scale);
  }
  return GP_OK;
}

int gp_k_cross_entropy(gp_tensor *loss, const gp_tensor *logits, const gp_tensor *targets, double ignore_index,
                       double classes) {
  GP_CHECK(cross_entropy, loss, logits, targets);
  return ce("cross_entropy", loss, 0, logits, targets, 0, ignore_index, 1.0, classes);
}

int gp_k_cross_entropy_fwd_bwd(gp_tensor *loss, gp_tensor *dlogits, const gp_tensor *logits, const gp_tensor *targets,
                               const gp_tensor *count, double ignore_index, double scale, double classes) {
  GP_CHECK(cross_entropy_fwd_bwd, loss, dlogits, logits, targets, count);
  return ce("cross_entropy_fwd_bwd", loss, dlogits, logits, targets, count, ignore_index, scale, classes);
}

int gp_k_loss_count(gp_tensor *count, const gp_tensor *targets, double ignore_index, double average) {
  GP_CHECK(loss_count, count, targets);
  if (ignore_index != floor(ignore_index) || fabs(ignore_index) > 9e15)
    return gp_error("loss_count: ignore_index must be an integer, got %g", ignore_index);
  int64_t ign = (int64_t)ignore_index, n = targets->shape[0];
  GP_CUDA_DISPATCH(count, gp_cuda_loss_count(count, targets, ign, average != 0));
  const void *pt = gp_ptr(targets);
  int64_t c = 0;
  if (average != 0)
    for (int64_t i = 0; i < n; i++) c += gp_load_i64(pt, targets->dtype, i) != ign;
  ((float *)gp_ptr(count))[0] = average != 0 ? (float)c : 1.0f;
  return GP_OK;
}

int gp_k_loss_reduce(gp_tensor *out, gp_tensor *count, const gp_tensor *loss, const gp_tensor *targets,
                     double ignore_index, double average) {
  GP_CHECK(loss_reduce, out, count, loss, targets);
  if (ignore_index != floor(ignore_index) || fabs(ignore_index) > 9e15)
    return gp_error("loss_reduce: ignore_index must be an integer, got %g", ignore_index);
  int64_t ign = (int64_t)ignore_index, n = loss->shape[0];
  GP_CUDA_DISPATCH(out, gp_cuda_loss_reduce(out, count, loss, targets, ign, average != 0));
  const float *pl = gp_ptr(loss);
  const void *pt = gp_ptr(targets);
  double s = 0, c = 0;
  for (int64_t i = 0; i < n; i++)
    if (gp_load_i64(pt, targets->dtype, i) != ign) {
      s += pl[i];
      c += 1;
    }
  ((float *)gp_ptr(out))[0] = (float)(average != 0 ? s / c : s);
  ((float *)gp_ptr(count))[0] = (float)c;
  return GP_OK;
}
