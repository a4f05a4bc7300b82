/* rows.c: dispatch and CPU reference of the per-row ops over the last dim
 * (softmax, log_softmax, LayerNorm, RMSNorm and their backward), in double. */
#include <math.h>

#include "gp_hd.h"
#include "rows.h"

static int softmax_cpu(gp_tensor *out, const gp_tensor *x, int lg) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  const char *px = gp_ptr(x);
  char *po = gp_ptr(out);
  int dt = x->dtype;
  for (int64_t r = 0; r < R; r++) {
    if (!(r & 0xff)) GP_POLL_INTERRUPT(lg ? "log_softmax" : "softmax"); /* Ctrl-C */
    int64_t o = r * D;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < D; j++) {
      double v = gp_load(px, dt, o + j);
      m = v > m || v != v ? v : m;
    }
    for (int64_t j = 0; j < D; j++) s += exp(gp_load(px, dt, o + j) - m);
    double ls = log(s);
    for (int64_t j = 0; j < D; j++) {
      double v = gp_load(px, dt, o + j) - m;
      gp_store(po, dt, o + j, lg ? v - ls : exp(v) / s);
    }
  }
  return GP_OK;
}

int gp_k_softmax(gp_tensor *out, const gp_tensor *x) {
  GP_CHECK(softmax, out, x);
  GP_CUDA_DISPATCH(out, gp_cuda_softmax(out, x, 0));
  return softmax_cpu(out, x, 0);
}

int gp_k_log_softmax(gp_tensor *out, const gp_tensor *x) {
  GP_CHECK(log_softmax, out, x);
  GP_CUDA_DISPATCH(out, gp_cuda_softmax(out, x, 1));
  return softmax_cpu(out, x, 1);
}

static int softmax_bwd_cpu(gp_tensor *dx, const gp_tensor *y, const gp_tensor *dy, int lg) {
  int64_t R = gp_rows_of(y), D = gp_cols_of(y);
  const char *py = gp_ptr(y), *pg = gp_ptr(dy);
  char *pd = gp_ptr(dx);
  int dt = y->dtype;
  for (int64_t r = 0; r < R; r++) {
    if (!(r & 0xff)) GP_POLL_INTERRUPT(lg ? "log_softmax_backward" : "softmax_backward"); /* Ctrl-C */
    int64_t o = r * D;
    double s = 0;
    for (int64_t j = 0; j < D; j++) s += lg ? gp_load(pg, dt, o + j) : gp_load(py, dt, o + j) * gp_load(pg, dt, o + j);
    for (int64_t j = 0; j < D; j++) {
      double yv = gp_load(py, dt, o + j), g = gp_load(pg, dt, o + j);
      gp_store(pd, dt, o + j, lg ? g - exp(yv) * s : yv * (g - s));
    }
  }
  return GP_OK;
}

int gp_k_softmax_backward(gp_tensor *dx, const gp_tensor *y, const gp_tensor *dy) {
  GP_CHECK(softmax_backward, dx, y, dy);
  GP_CUDA_DISPATCH(dx, gp_cuda_softmax_backward(dx, y, dy, 0));
  return softmax_bwd_cpu(dx, y, dy, 0);
}

int gp_k_log_softmax_backward(gp_tensor *dx, const gp_tensor *y, const gp_tensor *dy) {
  GP_CHECK(log_softmax_backward, dx, y, dy);
  GP_CUDA_DISPATCH(dx, gp_cuda_softmax_backward(dx, y, dy, 1));
  return softmax_bwd_cpu(dx, y, dy, 1);
}

static int check_eps(const char *op, double eps) {
  if (!(eps >= 0)) return gp_error("%s: eps = %g; it must be >= 0", op, eps);
  return GP_OK;
}

int gp_k_layer_norm(gp_tensor *out, gp_tensor *mean, gp_tensor *rstd, const gp_tensor *x, const gp_tensor *w,
                    const gp_tensor *b, double eps) {
  GP_CHECK(layer_norm, out, mean, rstd, x, w, b);
  GP_TRY(check_eps("layer_norm", eps));
  GP_CUDA_DISPATCH(out, gp_cuda_layer_norm(out, mean, rstd, x, w, b, eps));
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  const char *px = gp_ptr(x), *pw = gp_ptr(w), *pb = gp_ptr(b);
  char *po = gp_ptr(out);
  float *pm = gp_ptr(mean), *pr = gp_ptr(rstd);
  int dt = x->dtype;
  for (int64_t r = 0; r < R; r++) {
    if (!(r & 0xff)) GP_POLL_INTERRUPT("layer_norm"); /* Ctrl-C */
    int64_t o = r * D;
    double m = 0, v = 0;
    for (int64_t j = 0; j < D; j++) m += gp_load(px, dt, o + j);
    m /= (double)D;
    for (int64_t j = 0; j < D; j++) {
      double d = gp_load(px, dt, o + j) - m;
      v += d * d;
    }
    double rs = 1.0 / sqrt(v / (double)D + eps);
    for (int64_t j = 0; j < D; j++)
      gp_store(po, dt, o + j, (gp_load(px, dt, o + j) - m) * rs * gp_load(pw, dt, j) + gp_load(pb, dt, j));
    pm[r] = (float)m;
    pr[r] = (float)rs;
  }
  return GP_OK;
}

/* dw[j] (and db[j]) summed over rows, for either norm; mean == NULL: RMSNorm;
 * acc: the sums are added to the existing dw, db */
static void norm_dw_cpu(gp_tensor *dw, gp_tensor *db, const gp_tensor *x, const gp_tensor *mean, const gp_tensor *rstd,
                        const gp_tensor *dout, int acc) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  const char *px = gp_ptr(x), *pg = gp_ptr(dout);
  const float *pm = mean ? gp_ptr(mean) : NULL, *pr = gp_ptr(rstd);
  int dt = x->dtype;
  for (int64_t j = 0; j < D; j++) {
    double sw = 0, sb = 0;
    for (int64_t r = 0; r < R; r++) {
      double g = gp_load(pg, dt, r * D + j);
      sw += g * (gp_load(px, dt, r * D + j) - (pm ? pm[r] : 0.0)) * pr[r];
      sb += g;
    }
    if (acc) sw += gp_load(gp_ptr(dw), dw->dtype, j);
    gp_store(gp_ptr(dw), dw->dtype, j, sw);
    if (db) gp_store(gp_ptr(db), db->dtype, j, acc ? gp_load(gp_ptr(db), db->dtype, j) + sb : sb);
  }
}

/* dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * w (RMSNorm: no mean(g) term, xhat = x * rstd) */
/* dx of a norm; dres (or NULL) is added to it */
static void norm_dx_cpu(gp_tensor *dx, const gp_tensor *x, const gp_tensor *w, const gp_tensor *mean,
                        const gp_tensor *rstd, const gp_tensor *dout, const gp_tensor *dres) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  const char *px = gp_ptr(x), *pg = gp_ptr(dout), *pw = gp_ptr(w), *pres = dres ? gp_ptr(dres) : NULL;
  const float *pm = mean ? gp_ptr(mean) : NULL, *pr = gp_ptr(rstd);
  char *pd = gp_ptr(dx);
  int dt = x->dtype;
  for (int64_t r = 0; r < R; r++) {
    int64_t o = r * D;
    double mu = pm ? pm[r] : 0.0, rs = pr[r], a = 0, c = 0;
    for (int64_t j = 0; j < D; j++) {
      double g = gp_load(pg, dt, o + j) * gp_load(pw, dt, j), xh = (gp_load(px, dt, o + j) - mu) * rs;
      a += g;
      c += g * xh;
    }
    a /= (double)D;
    c /= (double)D;
    if (!pm) a = 0;
    for (int64_t j = 0; j < D; j++) {
      double g = gp_load(pg, dt, o + j) * gp_load(pw, dt, j), xh = (gp_load(px, dt, o + j) - mu) * rs;
      gp_store(pd, dt, o + j, rs * (g - a - xh * c) + (pres ? gp_load(pres, dt, o + j) : 0.0));
    }
  }
}

static int check_accumulate(const char *op, double acc) {
  if (acc != 0 && acc != 1) return gp_error("%s: accumulate = %g; it must be 0 or 1", op, acc);
  return GP_OK;
}

int gp_k_layer_norm_backward(gp_tensor *dx, gp_tensor *dw, gp_tensor *db, const gp_tensor *x, const gp_tensor *w,
                             const gp_tensor *mean, const gp_tensor *rstd, const gp_tensor *dout, double accumulate) {
  GP_CHECK(layer_norm_backward, dx, dw, db, x, w, mean, rstd, dout);
  GP_TRY(check_accumulate("layer_norm_backward", accumulate));
  GP_CUDA_DISPATCH(dx, gp_cuda_layer_norm_backward(dx, dw, db, x, w, mean, rstd, dout, NULL, (int)accumulate));
  norm_dx_cpu(dx, x, w, mean, rstd, dout, NULL);
  norm_dw_cpu(dw, db, x, mean, rstd, dout, (int)accumulate);
  return GP_OK;
}

int gp_k_layer_norm_backward_add(gp_tensor *dx, gp_tensor *dw, gp_tensor *db, const gp_tensor *x, const gp_tensor *w,
                                 const gp_tensor *mean, const gp_tensor *rstd, const gp_tensor *dout,
                                 const gp_tensor *dres, double accumulate) {
  GP_CHECK(layer_norm_backward_add, dx, dw, db, x, w, mean, rstd, dout, dres);
  GP_TRY(check_accumulate("layer_norm_backward_add", accumulate));
  GP_CUDA_DISPATCH(dx, gp_cuda_layer_norm_backward(dx, dw, db, x, w, mean, rstd, dout, dres, (int)accumulate));
  norm_dx_cpu(dx, x, w, mean, rstd, dout, dres);
  norm_dw_cpu(dw, db, x, mean, rstd, dout, (int)accumulate);
  return GP_OK;
}

int gp_k_rms_norm(gp_tensor *out, gp_tensor *rstd, const gp_tensor *x, const gp_tensor *w, double eps) {
  GP_CHECK(rms_norm, out, rstd, x, w);
  GP_TRY(check_eps("rms_norm", eps));
  GP_CUDA_DISPATCH(out, gp_cuda_rms_norm(out, rstd, x, w, eps));
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  const char *px = gp_ptr(x), *pw = gp_ptr(w);
  char *po = gp_ptr(out);
  float *pr = gp_ptr(rstd);
  int dt = x->dtype;
  for (int64_t r = 0; r < R; r++) {
    if (!(r & 0xff)) GP_POLL_INTERRUPT("rms_norm"); /* Ctrl-C */
    int64_t o = r * D;
    double s = 0;
    for (int64_t j = 0; j < D; j++) {
      double v = gp_load(px, dt, o + j);
      s += v * v;
    }
    double rs = 1.0 / sqrt(s / (double)D + eps);
    for (int64_t j = 0; j < D; j++) gp_store(po, dt, o + j, gp_load(px, dt, o + j) * rs * gp_load(pw, dt, j));
    pr[r] = (float)rs;
  }
  return GP_OK;
}

int gp_k_rms_norm_backward(gp_tensor *dx, gp_tensor *dw, const gp_tensor *x, const gp_tensor *w, const gp_tensor *rstd,
                           const gp_tensor *dout, double accumulate) {
  GP_CHECK(rms_norm_backward, dx, dw, x, w, rstd, dout);
  GP_TRY(check_accumulate("rms_norm_backward", accumulate));
  GP_CUDA_DISPATCH(dx, gp_cuda_rms_norm_backward(dx, dw, x, w, rstd, dout, NULL, (int)accumulate));
  norm_dx_cpu(dx, x, w, NULL, rstd, dout, NULL);
  norm_dw_cpu(dw, NULL, x, NULL, rstd, dout, (int)accumulate);
  return GP_OK;
}

int gp_k_rms_norm_backward_add(gp_tensor *dx, gp_tensor *dw, const gp_tensor *x, const gp_tensor *w,
                               const gp_tensor *rstd, const gp_tensor *dout, const gp_tensor *dres, double accumulate) {
  GP_CHECK(rms_norm_backward_add, dx, dw, x, w, rstd, dout, dres);
  GP_TRY(check_accumulate("rms_norm_backward_add", accumulate));
  GP_CUDA_DISPATCH(dx, gp_cuda_rms_norm_backward(dx, dw, x, w, rstd, dout, dres, (int)accumulate));
  norm_dx_cpu(dx, x, w, NULL, rstd, dout, dres);
  norm_dw_cpu(dw, NULL, x, NULL, rstd, dout, (int)accumulate);
  return GP_OK;
}
