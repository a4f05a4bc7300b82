/* fused.c: dispatch and CPU reference of the fused ops, in double. */
#include <math.h>
#include <stdlib.h>

#include "gp_hd.h"
#include "fused.h"
#include "rows.h"

static double sigm(double v) { return 1.0 / (1.0 + exp(-v)); }

/* the element offset of row r (an index over every dim but the last) of a strided t */
static int64_t row_offset(const gp_tensor *t, int64_t r) {
  int64_t off = 0;
  for (int d = t->ndim - 2; d >= 0; d--) {
    off += (r % t->shape[d]) * t->stride[d];
    r /= t->shape[d];
  }
  return off;
}

int gp_k_swiglu(gp_tensor *out, const gp_tensor *gate, const gp_tensor *up) {
  GP_CHECK(swiglu, out, gate, up);
  GP_CUDA_DISPATCH(out, gp_cuda_swiglu(out, gate, up));
  gp_loop L;
  const gp_tensor *ops[] = {out, gate, up};
  GP_TRY(gp_loop_init(&L, "swiglu", 3, ops));
  char *po = gp_ptr(out);
  const char *pg = gp_ptr(gate), *pu = gp_ptr(up);
  int dt = out->dtype;
  int64_t off[4];
  for (int64_t i = 0; i < L.numel; i++) {
    gp_loop_offsets(&L, i, off);
    double g = gp_load(pg, dt, off[1]);
    gp_store(po, dt, off[0], g * sigm(g) * gp_load(pu, dt, off[2]));
  }
  return GP_OK;
}

int gp_k_swiglu_backward(gp_tensor *dgate, gp_tensor *dup, const gp_tensor *gate, const gp_tensor *up,
                         const gp_tensor *dout) {
  GP_CHECK(swiglu_backward, dgate, dup, gate, up, dout);
  GP_CUDA_DISPATCH(dgate, gp_cuda_swiglu_backward(dgate, dup, gate, up, dout));
  const int64_t R = gp_rows_of(gate), D = gp_cols_of(gate);
  char *pdg = gp_ptr(dgate), *pdu = gp_ptr(dup);
  const char *pg = gp_ptr(gate), *pu = gp_ptr(up), *pd = gp_ptr(dout);
  int dt = gate->dtype;
  for (int64_t r = 0; r < R; r++) {
    /* each operand's row r at its own strides (stride 1 along the row, the spec's '/') */
    const int64_t odg = row_offset(dgate, r), odu = row_offset(dup, r), og = row_offset(gate, r), ou = row_offset(up, r),
                  od = row_offset(dout, r);
    for (int64_t j = 0; j < D; j++) {
      double g = gp_load(pg, dt, og + j), u = gp_load(pu, dt, ou + j), d = gp_load(pd, dt, od + j), s = sigm(g);
      gp_store(pdg, dt, odg + j, d * u * s * (1.0 + g * (1.0 - s)));
      gp_store(pdu, dt, odu + j, d * g * s);
    }
  }
  return GP_OK;
}

int gp_k_add_rms_norm(gp_tensor *out, gp_tensor *res_out, gp_tensor *rstd, const gp_tensor *x, const gp_tensor *res,
                      const gp_tensor *w, double eps) {
  GP_CHECK(add_rms_norm, out, res_out, rstd, x, res, w);
  if (!(eps >= 0)) return gp_error("add_rms_norm: eps = %g; it must be >= 0", eps);
  GP_CUDA_DISPATCH(out, gp_cuda_add_rms_norm(out, res_out, rstd, x, res, w, eps));
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  const char *px = gp_ptr(x), *pr = gp_ptr(res), *pw = gp_ptr(w);
  char *po = gp_ptr(out), *pq = gp_ptr(res_out);
  float *ps = gp_ptr(rstd);
  int dt = x->dtype;
  for (int64_t r = 0; r < R; r++) {
    int64_t o = r * D;
    double s = 0;
    for (int64_t j = 0; j < D; j++) {
      gp_store(pq, dt, o + j, gp_load(px, dt, o + j) + gp_load(pr, dt, o + j));
      double v = gp_load(pq, dt, o + j); /* the norm sees res_out as stored */
      s += v * v;
    }
    double rs = 1.0 / sqrt(s / (double)D + eps);
    for (int64_t j = 0; j < D; j++) gp_store(po, dt, o + j, gp_load(pq, dt, o + j) * rs * gp_load(pw, dt, j));
    ps[r] = (float)rs;
  }
  return GP_OK;
}

int gp_k_add_layer_norm(gp_tensor *out, gp_tensor *res_out, gp_tensor *mean, gp_tensor *rstd, const gp_tensor *x,
                        const gp_tensor *res, const gp_tensor *w, const gp_tensor *b, double eps) {
  GP_CHECK(add_layer_norm, out, res_out, mean, rstd, x, res, w, b);
  if (!(eps >= 0)) return gp_error("add_layer_norm: eps = %g; it must be >= 0", eps);
  GP_CUDA_DISPATCH(out, gp_cuda_add_layer_norm(out, res_out, mean, rstd, x, res, w, b, eps));
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  const char *px = gp_ptr(x), *pr = gp_ptr(res), *pw = gp_ptr(w), *pb = gp_ptr(b);
  char *po = gp_ptr(out), *pq = gp_ptr(res_out);
  float *pm = gp_ptr(mean), *ps = gp_ptr(rstd);
  int dt = x->dtype;
  for (int64_t r = 0; r < R; r++) {
    int64_t o = r * D;
    double s = 0, q = 0;
    for (int64_t j = 0; j < D; j++) {
      gp_store(pq, dt, o + j, gp_load(px, dt, o + j) + gp_load(pr, dt, o + j));
      s += gp_load(pq, dt, o + j); /* the norm sees res_out as stored */
    }
    const double mu = D > 0 ? s / (double)D : 0;
    for (int64_t j = 0; j < D; j++) {
      const double d = gp_load(pq, dt, o + j) - mu;
      q += d * d;
    }
    const double rs = 1.0 / sqrt((D > 0 ? q / (double)D : 0) + eps);
    for (int64_t j = 0; j < D; j++)
      gp_store(po, dt, o + j, (gp_load(pq, dt, o + j) - mu) * rs * gp_load(pw, dt, j) + gp_load(pb, dt, j));
    pm[r] = (float)mu;
    ps[r] = (float)rs;
  }
  return GP_OK;
}

int gp_k_bias_gelu(gp_tensor *out, const gp_tensor *x, const gp_tensor *b) {
  GP_CHECK(bias_gelu, out, x, b);
  GP_CUDA_DISPATCH(out, gp_cuda_bias_gelu(out, x, b));
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  const char *px = gp_ptr(x), *pb = gp_ptr(b);
  char *po = gp_ptr(out);
  int dt = x->dtype;
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < D; j++) {
      double v = gp_load(px, dt, r * D + j) + gp_load(pb, dt, j);
      gp_store(po, dt, r * D + j, 0.5 * v * (1.0 + erf(v * 0.70710678118654752440)));
    }
  return GP_OK;
}

/* v rounded to dtype dt (through a store and a load) */
static double round_to(int dt, double v) {
  double buf;
  gp_store(&buf, dt, 0, v);
  return gp_load(&buf, dt, 0);
}

/* the few-rows kernels (rows_linear, rows_linear_bias, swiglu_linear): up to 16 rows of bf16 / f16 with K a
 * multiple of 32 on tensor cores; otherwise 4 rows of K staged in 48 KB of shared memory */
static int rows_fit(const char *op, int64_t M, int64_t K, int dt, const char *name, const gp_tensor *x,
                    const char *instead) {
  const int tc = (dt == GP_BF16 || dt == GP_F16) && K % 32 == 0;
  if (M > 16 || (!tc && (M > 4 || M * K * (int64_t)gp_elsize(dt) > 48 * 1024)))
    return gp_error("%s: %lld rows of %lld (%s %s) are more than the kernel holds (16 rows of bf16 / f16 with K a "
                    "multiple of 32; else 4 rows in 48 KB); use %s", op, (long long)M, (long long)K, name, GP_SHAPE(x),
                    instead);
  return GP_OK;
}

/* row m of out (N columns) = x (K doubles) times w^T, summed in double */
static void row_times_wt(char *po, int dt, int64_t m, int64_t N, const double *x, const char *pw, int64_t K) {
  for (int64_t n = 0; n < N; n++) {
    double s = 0;
    for (int64_t k = 0; k < K; k++) s += x[k] * gp_load(pw, dt, n * K + k);
    gp_store(po, dt, m * N + n, s);
  }
}

/* rows_linear: out = x w^T for few rows (rows_fit), in double */
int gp_k_rows_linear(gp_tensor *out, const gp_tensor *x, const gp_tensor *w) {
  GP_CHECK(rows_linear, out, x, w);
  const int64_t M = out->shape[0], N = out->shape[1], K = w->shape[1];
  GP_TRY(rows_fit("rows_linear", M, K, out->dtype, "x", x, "gp.linear"));
  GP_CUDA_DISPATCH(out, gp_cuda_rows_linear(out, x, w));
  const int dt = out->dtype;
  const char *px = gp_ptr(x), *pw = gp_ptr(w);
  double *xr = malloc((size_t)(K > 0 ? K : 1) * sizeof *xr);
  if (!xr) return gp_error("rows_linear: out of host memory");
  for (int64_t m = 0; m < M; m++) {
    for (int64_t k = 0; k < K; k++) xr[k] = gp_load(px, dt, m * K + k);
    row_times_wt(gp_ptr(out), dt, m, N, xr, pw, K);
  }
  free(xr);
  return GP_OK;
}

/* rows_linear_bias: act(x w^T + b) for few rows (rows_fit), in double (act 1: GELU's tanh form) */
int gp_k_rows_linear_bias(gp_tensor *out, const gp_tensor *x, const gp_tensor *w, const gp_tensor *b, double act) {
  GP_CHECK(rows_linear_bias, out, x, w, b);
  const int64_t M = out->shape[0], N = out->shape[1], K = w->shape[1];
  if (act != 0 && act != 1) return gp_error("rows_linear_bias: act = %g; 0 (none) or 1 (GELU, tanh form)", act);
  GP_TRY(rows_fit("rows_linear_bias", M, K, out->dtype, "x", x, "gp.linear"));
  GP_CUDA_DISPATCH(out, gp_cuda_rows_linear_bias(out, x, w, b, (int)act));
  const int dt = out->dtype;
  const char *px = gp_ptr(x), *pw = gp_ptr(w), *pb = gp_ptr(b);
  char *po = gp_ptr(out);
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double s = gp_load(pb, dt, n);
      for (int64_t k = 0; k < K; k++) s += gp_load(px, dt, m * K + k) * gp_load(pw, dt, n * K + k);
      if (act == 1) s = 0.5 * s * (1.0 + tanh(0.79788456080286535588 * (s + 0.044715 * s * s * s)));
      gp_store(po, dt, m * N + n, s);
    }
  return GP_OK;
}

/* swiglu_linear: the rows' SwiGLU (rounded to the dtype, as gp.swiglu
 * writes it) times w^T, summed in double */
int gp_k_swiglu_linear(gp_tensor *out, const gp_tensor *gu, const gp_tensor *w) {
  GP_CHECK(swiglu_linear, out, gu, w);
  const int64_t M = out->shape[0], N = out->shape[1], I = w->shape[1];
  if (gu->shape[1] != 2 * I)
    return gp_error("swiglu_linear: gu is %s and w %s; gu's rows must be [gate | up], twice w's %lld columns", GP_SHAPE(gu),
                    GP_SHAPE(w), (long long)I);
  GP_TRY(rows_fit("swiglu_linear", M, I, out->dtype, "gu", gu, "gp.swiglu and a product"));
  GP_CUDA_DISPATCH(out, gp_cuda_swiglu_linear(out, gu, w));
  const int dt = out->dtype;
  const char *pg = gp_ptr(gu), *pw = gp_ptr(w);
  double *x = malloc((size_t)(I > 0 ? I : 1) * sizeof *x);
  if (!x) return gp_error("swiglu_linear: out of host memory");
  for (int64_t m = 0; m < M; m++) {
    for (int64_t i = 0; i < I; i++) {
      const double g = gp_load(pg, dt, m * 2 * I + i);
      x[i] = round_to(dt, g * sigm(g) * gp_load(pg, dt, m * 2 * I + I + i));
    }
    row_times_wt(gp_ptr(out), dt, m, N, x, pw, I);
  }
  free(x);
  return GP_OK;
}
