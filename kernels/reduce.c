/* reduce.c: dispatch and CPU reference of the reductions over the middle dim
 * of a contiguous (A, B, C) view, and cumsum along it. Computed in double. */
#include <math.h>

#include "gp_hd.h"
#include "reduce.h"

static const char *RNAME[] = {"sum", "mean", "max", "min", "argmax", "argmin", "var", "norm"};

/* a better than b for argmax (sign 1) or argmin (sign -1): NaN wins, then the
 * larger (smaller) value, then the smaller index */
static int better(int sign, double a, int64_t ia, double b, int64_t ib) {
  int na = a != a, nb = b != b;
  if (na || nb) return na && (!nb || ia < ib);
  if (a != b) return sign > 0 ? a > b : a < b;
  return ia < ib;
}

static int reduce(int op, gp_tensor *out, const gp_tensor *x, double param) {
  int64_t A = x->shape[0], B = x->shape[1], Cn = x->shape[2];
  if (B == 0 && A * Cn > 0 && (op == R_MAX || op == R_MIN || op == R_ARGMAX || op == R_ARGMIN))
    return gp_error("%s: cannot reduce a dim of size 0 (x is %s)", RNAME[op], GP_SHAPE(x));
  if (op == R_NORM && param != param) return gp_error("norm: p is NaN");
  if (op == R_NORM && param < 0) return gp_error("norm: p = %g; p must be >= 0", param);
  if (A * Cn == 0) return GP_OK;
  GP_CUDA_DISPATCH(out, gp_cuda_reduce(op, out, x, param));
  const char *px = gp_ptr(x);
  char *po = gp_ptr(out);
  int dt = x->dtype, dto = out->dtype, nk = gp_reduce_norm_kind(param);
  for (int64_t a = 0; a < A; a++)
    for (int64_t c = 0; c < Cn; c++) {
      if (!((a * Cn + c) & 0xff)) GP_POLL_INTERRUPT(RNAME[op]); /* Ctrl-C */
      int64_t base = a * B * Cn + c;
      double r = 0;
      if (op == R_ARGMAX || op == R_ARGMIN) {
        int sign = op == R_ARGMAX ? 1 : -1;
        double bv = gp_load(px, dt, base);
        int64_t bi = 0;
        for (int64_t b = 1; b < B; b++) {
          double v = gp_load(px, dt, base + b * Cn);
          if (better(sign, v, b, bv, bi)) bv = v, bi = b;
        }
        gp_store_i64(po, dto, a * Cn + c, bi);
        continue;
      } else if (op == R_MAX || op == R_MIN) {
        r = gp_load(px, dt, base);
        for (int64_t b = 1; b < B && r == r; b++) {
          double v = gp_load(px, dt, base + b * Cn);
          if (v != v || (op == R_MAX ? v > r : v < r)) r = v;
        }
      } else if (op == R_VAR) {
        double m = 0;
        for (int64_t b = 0; b < B; b++) m += gp_load(px, dt, base + b * Cn);
        m /= (double)B;
        double s = 0;
        for (int64_t b = 0; b < B; b++) {
          double d = gp_load(px, dt, base + b * Cn) - m;
          s += d * d;
        }
        double den = (double)B - param;
        r = den > 0 ? s / den : NAN;
      } else if (op == R_NORM) {
        for (int64_t b = 0; b < B; b++) {
          double v = fabs(gp_load(px, dt, base + b * Cn));
          switch (nk) {
            case N_P2: r += v * v; break;
            case N_P1: r += v; break;
            case N_INF: r = (v != v || v > r) ? v : r; break;
            case N_P0: r += v != 0; break;
            default: r += pow(v, param); break;
          }
          if (r != r) break;
        }
        if (nk == N_P2) r = sqrt(r);
        else if (nk == N_PG) r = pow(r, 1.0 / param);
      } else {
        for (int64_t b = 0; b < B; b++) r += gp_load(px, dt, base + b * Cn);
        if (op == R_MEAN) r /= (double)B;
      }
      gp_store(po, dto, a * Cn + c, r);
    }
  return GP_OK;
}

#define REDUCE(name, OP)                                          \
  int gp_k_##name(gp_tensor *out, const gp_tensor *x) {           \
    GP_CHECK(name, out, x);                                       \
    return reduce(OP, out, x, 0);                                 \
  }
REDUCE(sum, R_SUM)
REDUCE(mean, R_MEAN)
REDUCE(max, R_MAX)
REDUCE(min, R_MIN)
REDUCE(argmax, R_ARGMAX)
REDUCE(argmin, R_ARGMIN)

int gp_k_var(gp_tensor *out, const gp_tensor *x, double correction) {
  GP_CHECK(var, out, x);
  if (correction != correction) return gp_error("var: correction is NaN");
  return reduce(R_VAR, out, x, correction);
}

int gp_k_norm(gp_tensor *out, const gp_tensor *x, double p) {
  GP_CHECK(norm, out, x);
  return reduce(R_NORM, out, x, p);
}

int gp_k_cumsum(gp_tensor *out, const gp_tensor *x) {
  GP_CHECK(cumsum, out, x);
  int64_t A = x->shape[0], B = x->shape[1], Cn = x->shape[2];
  if (A * B * Cn == 0) return GP_OK;
  GP_CUDA_DISPATCH(out, gp_cuda_cumsum(out, x));
  const char *px = gp_ptr(x);
  char *po = gp_ptr(out);
  int dt = x->dtype;
  for (int64_t a = 0; a < A; a++)
    for (int64_t c = 0; c < Cn; c++) {
      if (!((a * Cn + c) & 0xff)) GP_POLL_INTERRUPT("cumsum");
      double s = 0;
      for (int64_t b = 0; b < B; b++) {
        int64_t i = (a * B + b) * Cn + c;
        s += gp_load(px, dt, i);
        gp_store(po, dt, i, s);
      }
    }
  return GP_OK;
}
