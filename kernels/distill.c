/* distill.c: dispatch and CPU reference of the fused distillation loss.
 * Per row n (x = student / T, y = teacher / T, a = log_softmax(x),
 * b = log_softmax(y), p = exp(a), q = exp(b)):
 *   kind 0 (forward KL)  D = sum q (b - a)            dD/dx = p - q
 *   kind 1 (reverse KL)  D = sum p (a - b)            dD/dx = p (a - b - D)
 *   kind 2 (JSD)         D = (sum q (b - m) + sum p (a - m)) / 2, m = log((p + q) / 2)
 *                                                      dD/dx = p (a - m - K) / 2, K = sum p (a - m)
 *   loss = alpha T^2 D + (1 - alpha) CE(student, target)
 *   dloss/dstudent = alpha T dD/dx + (1 - alpha) (softmax(student) - onehot(target))
 * Terms with a zero probability count as 0 (p log p -> 0). Targets, the
 * temperature, alpha and kind are checked before anything is written. */
#include <math.h>

#include "gp_hd.h"
#include "loss.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_distill(gp_tensor *loss, gp_tensor *ds, const gp_tensor *s, const gp_tensor *t, const gp_tensor *targets,
                    const gp_tensor *count, double temperature, double alpha, int kind, int64_t ignore, double scale);
#ifdef __cplusplus
}
#endif

static double lse_row(const void *p, int dt, int64_t r, int64_t v, double inv_t) {
  double m = -INFINITY, s = 0;
  for (int64_t j = 0; j < v; j++) {
    double x = gp_load(p, dt, r + j) * inv_t;
    if (x > m) m = x;
  }
  if (m == -INFINITY) return m;
  for (int64_t j = 0; j < v; j++) s += exp(gp_load(p, dt, r + j) * inv_t - m);
  return m + log(s);
}

/* p * (u - w), 0 where p is 0 */
static double xlogy(double p, double u, double w) { return p > 0 ? p * (u - w) : 0.0; }

/* log((e^a + e^b) / 2) */
static double log_mix(double a, double b) {
  double hi = a > b ? a : b, lo = a > b ? b : a;
  if (hi == -INFINITY) return hi;
  return hi + log1p(exp(lo - hi)) - M_LN2;
}

static int distill(const char *op, gp_tensor *loss, gp_tensor *ds, const gp_tensor *s, const gp_tensor *t,
                   const gp_tensor *targets, const gp_tensor *count, double temperature, double alpha, double kind,
                   double ignore_index, double scale) {
  if (!(temperature > 0) || !isfinite(temperature))
    return gp_error("%s: temperature must be a positive number, got %g (student %s)", op, temperature, GP_SHAPE(s));
  if (!(alpha >= 0 && alpha <= 1))
    return gp_error("%s: alpha must be in [0, 1] (the weight of the distillation term), got %g", op, alpha);
  if (kind != 0 && kind != 1 && kind != 2)
    return gp_error("%s: kind must be 0 (forward KL), 1 (reverse KL) or 2 (JSD), got %g", op, kind);
  if (ignore_index != floor(ignore_index) || fabs(ignore_index) > 9e15)
    return gp_error("%s: ignore_index must be an integer, got %g", op, ignore_index);
  int64_t ign = (int64_t)ignore_index, n = s->shape[0], v = s->shape[1];
  int k = (int)kind;
  GP_CUDA_DISPATCH(loss, gp_cuda_distill(loss, ds, s, t, targets, count, temperature, alpha, k, ign, scale));
  if (count) scale /= ((const float *)gp_ptr(count))[0];
  GP_TRY(gp_loss_check_targets(op, targets, s, ign));
  const void *pt = gp_ptr(targets);
  const void *px = gp_ptr(s), *py = gp_ptr(t);
  float *pl = gp_ptr(loss);
  void *pg = ds ? gp_ptr(ds) : 0;
  int dx = s->dtype, dy = t->dtype;
  double inv_t = 1.0 / temperature;
  for (int64_t i = 0; i < n; i++) {
    int64_t tg = gp_load_i64(pt, targets->dtype, i), r = i * v;
    if (tg == ign) {
      pl[i] = 0;
      if (pg)
        for (int64_t j = 0; j < v; j++) gp_store(pg, ds->dtype, r + j, 0);
      continue;
    }
    double ls = lse_row(px, dx, r, v, inv_t), lt = lse_row(py, dy, r, v, inv_t), lc = lse_row(px, dx, r, v, 1.0);
    double d = 0, kk = 0;
    for (int64_t j = 0; j < v; j++) {
      double a = gp_load(px, dx, r + j) * inv_t - ls, b = gp_load(py, dy, r + j) * inv_t - lt;
      double p = exp(a), q = exp(b);
      if (k == 0) d += xlogy(q, b, a);
      else if (k == 1) d += xlogy(p, a, b);
      else {
        double m = log_mix(a, b);
        d += 0.5 * (xlogy(q, b, m) + xlogy(p, a, m));
        kk += xlogy(p, a, m);
      }
    }
    double ce = lc - gp_load(px, dx, r + tg);
    pl[i] = (float)(alpha * temperature * temperature * d + (1 - alpha) * ce);
    if (!pg) continue;
    for (int64_t j = 0; j < v; j++) {
      double sv = gp_load(px, dx, r + j);
      double a = sv * inv_t - ls, b = gp_load(py, dy, r + j) * inv_t - lt, p = exp(a), gd;
      if (k == 0) gd = p - exp(b);
      else if (k == 1) gd = p > 0 ? p * (a - b - d) : 0.0;
      else gd = p > 0 ? 0.5 * p * (a - log_mix(a, b) - kk) : 0.0;
      double gc = exp(sv - lc) - (j == tg ? 1.0 : 0.0);
      gp_store(pg, ds->dtype, r + j, (alpha * temperature * gd + (1 - alpha) * gc) * scale);
    }
  }
  return GP_OK;
}

int gp_k_distill_loss(gp_tensor *loss, const gp_tensor *student, const gp_tensor *teacher, const gp_tensor *targets,
                      double temperature, double alpha, double kind, double ignore_index) {
  GP_CHECK(distill_loss, loss, student, teacher, targets);
  return distill("distill_loss", loss, 0, student, teacher, targets, 0, temperature, alpha, kind, ignore_index, 1.0);
}

int gp_k_distill_fwd_bwd(gp_tensor *loss, gp_tensor *dstudent, const gp_tensor *student, const gp_tensor *teacher,
                         const gp_tensor *targets, const gp_tensor *count, double temperature, double alpha,
                         double kind, double ignore_index, double scale) {
  GP_CHECK(distill_fwd_bwd, loss, dstudent, student, teacher, targets, count);
  return distill("distill_fwd_bwd", loss, dstudent, student, teacher, targets, count, temperature, alpha, kind,
                 ignore_index, scale);
}
