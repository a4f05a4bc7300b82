/* moe.c: dispatch and CPU reference of the Mixture-of-Experts kernels, in
 * double. The CPU checks every index and raises on one out of range; the CUDA
 * versions guard every index (never touching memory outside a tensor) and
 * treat a bad one like -1 (no host synchronization on the hot path). */
#include <math.h>
#include <stdlib.h>

#include "gp_hd.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_moe_router(gp_tensor *w, gp_tensor *ids, gp_tensor *probs, const gp_tensor *logits, int64_t n, int e, int k,
                       int renorm);
int gp_cuda_moe_router_backward(gp_tensor *dlogits, const gp_tensor *probs, const gp_tensor *ids, const gp_tensor *dw,
                                const gp_tensor *dprobs, int64_t n, int e, int k, int renorm);
int gp_cuda_moe_histogram(gp_tensor *counts, const gp_tensor *ids, int64_t a, int e);
int gp_cuda_moe_permute(gp_tensor *dest, gp_tensor *src, gp_tensor *counts, const gp_tensor *ids, int64_t a, int e,
                        int64_t cap);
int gp_cuda_moe_gather(gp_tensor *out, const gp_tensor *x, const gp_tensor *src, const gp_tensor *w, int64_t s,
                       int64_t c, int64_t n, int64_t k);
int gp_cuda_moe_combine(gp_tensor *out, const gp_tensor *ys, const gp_tensor *dest, const gp_tensor *w, int64_t n,
                        int64_t c, int64_t s, int64_t k);
int gp_cuda_moe_combine_dw(gp_tensor *dw, const gp_tensor *dout, const gp_tensor *ys, const gp_tensor *dest,
                           int64_t n, int64_t c, int64_t s, int64_t k);
#ifdef __cplusplus
}
#endif

#define MOE_MAX_E 256
#define MOE_MAX_K 8

/* the values of an i32 index tensor in [lo, hi) */
static int check_ids(const char *op, const char *name, const gp_tensor *t, int64_t lo, int64_t hi, const char *what) {
  const int32_t *p = gp_ptr(t);
  int64_t n = gp_numel(t);
  for (int64_t i = 0; i < n; i++)
    if (p[i] < lo || p[i] >= hi)
      return gp_error("%s: %s holds %d (at flat position %lld of %s %s), outside [%lld, %lld) (%s)", op, name, (int)p[i],
                      (long long)i, name, GP_SHAPE(t), (long long)lo, (long long)hi, what);
  return GP_OK;
}

static int router_sizes(const char *op, const gp_tensor *logits, const gp_tensor *ids, int64_t *n, int *e, int *k) {
  *n = logits->shape[0];
  int64_t E = logits->shape[1], K = ids->shape[1];
  if (E < 1 || E > MOE_MAX_E)
    return gp_error("%s: logits is %s: the number of experts must be in [1, %d]", op, GP_SHAPE(logits), MOE_MAX_E);
  if (K < 1 || K > MOE_MAX_K || K > E)
    return gp_error("%s: k = %lld (ids is %s) must be in [1, min(%d, E = %lld)]", op, (long long)K, GP_SHAPE(ids),
                    MOE_MAX_K, (long long)E);
  *e = (int)E;
  *k = (int)K;
  return GP_OK;
}

int gp_k_moe_router(gp_tensor *w, gp_tensor *ids, gp_tensor *probs, const gp_tensor *logits, double renorm) {
  GP_CHECK(moe_router, w, ids, probs, logits);
  int64_t N;
  int E, K;
  GP_TRY(router_sizes("moe_router", logits, ids, &N, &E, &K));
  int rn = renorm != 0;
  GP_CUDA_DISPATCH(logits, gp_cuda_moe_router(w, ids, probs, logits, N, E, K, rn));
  int dt = logits->dtype;
  const char *pl = gp_ptr(logits);
  char *pw = gp_ptr(w), *pp = gp_ptr(probs);
  int32_t *pi = gp_ptr(ids);
  double v[MOE_MAX_E], p[MOE_MAX_E];
  int taken[MOE_MAX_E];
  for (int64_t r = 0; r < N; r++) {
    double m = -INFINITY;
    for (int e = 0; e < E; e++) {
      v[e] = gp_load(pl, dt, r * E + e);
      if (v[e] > m) m = v[e];
    }
    double s = 0;
    for (int e = 0; e < E; e++) s += (p[e] = exp(v[e] - m));
    for (int e = 0; e < E; e++) {
      p[e] /= s;
      gp_store(pp, dt, r * E + e, p[e]);
      taken[e] = 0;
    }
    /* top-k by logit; NaN ranks as -inf; ties to the lower index */
    int sel[MOE_MAX_K];
    double tot = 0;
    for (int j = 0; j < K; j++) {
      int b = -1;
      double bv = 0;
      for (int e = 0; e < E; e++) {
        if (taken[e]) continue;
        double x = v[e] != v[e] ? -INFINITY : v[e];
        if (b < 0 || x > bv) { b = e; bv = x; }
      }
      taken[b] = 1;
      sel[j] = b;
      tot += p[b];
    }
    for (int j = 0; j < K; j++) {
      pi[r * K + j] = sel[j];
      gp_store(pw, dt, r * K + j, rn ? p[sel[j]] / tot : p[sel[j]]);
    }
  }
  return GP_OK;
}

int gp_k_moe_router_backward(gp_tensor *dlogits, const gp_tensor *probs, const gp_tensor *ids, const gp_tensor *dw,
                             const gp_tensor *dprobs, double renorm) {
  GP_CHECK(moe_router_backward, dlogits, probs, ids, dw, dprobs);
  int64_t N;
  int E, K;
  GP_TRY(router_sizes("moe_router_backward", probs, ids, &N, &E, &K));
  int rn = renorm != 0;
  GP_CUDA_DISPATCH(probs, gp_cuda_moe_router_backward(dlogits, probs, ids, dw, dprobs, N, E, K, rn));
  GP_TRY(check_ids("moe_router_backward", "ids", ids, 0, E, "expert ids"));
  int dt = probs->dtype;
  const char *pp = gp_ptr(probs), *pdw = gp_ptr(dw), *pdp = gp_ptr(dprobs);
  const int32_t *pi = gp_ptr(ids);
  char *pd = gp_ptr(dlogits);
  double p[MOE_MAX_E], dp[MOE_MAX_E];
  for (int64_t r = 0; r < N; r++) {
    for (int e = 0; e < E; e++) {
      p[e] = gp_load(pp, dt, r * E + e);
      dp[e] = gp_load(pdp, dt, r * E + e);
    }
    const int32_t *id = pi + r * K;
    if (rn) { /* w_j = p_j / s: dp_j += (dw_j - sum_i dw_i w_i) / s */
      double s = 0, c = 0;
      for (int j = 0; j < K; j++) s += p[id[j]];
      for (int j = 0; j < K; j++) c += gp_load(pdw, dt, r * K + j) * p[id[j]] / s;
      for (int j = 0; j < K; j++) dp[id[j]] += (gp_load(pdw, dt, r * K + j) - c) / s;
    } else {
      for (int j = 0; j < K; j++) dp[id[j]] += gp_load(pdw, dt, r * K + j);
    }
    double dot = 0;
    for (int e = 0; e < E; e++) dot += p[e] * dp[e];
    for (int e = 0; e < E; e++) gp_store(pd, dt, r * E + e, p[e] * (dp[e] - dot));
  }
  return GP_OK;
}

int gp_k_moe_histogram(gp_tensor *counts, const gp_tensor *ids) {
  GP_CHECK(moe_histogram, counts, ids);
  int64_t A = gp_numel(ids), E = counts->shape[0];
  if (E > MOE_MAX_E) return gp_error("moe_histogram: counts is %s; at most %d experts", GP_SHAPE(counts), MOE_MAX_E);
  GP_CUDA_DISPATCH(ids, gp_cuda_moe_histogram(counts, ids, A, (int)E));
  GP_TRY(check_ids("moe_histogram", "ids", ids, 0, E, "expert ids"));
  int32_t *pc = gp_ptr(counts);
  const int32_t *pi = gp_ptr(ids);
  for (int64_t e = 0; e < E; e++) pc[e] = 0;
  for (int64_t a = 0; a < A; a++) pc[pi[a]]++;
  return GP_OK;
}

int gp_k_moe_permute(gp_tensor *dest, gp_tensor *src, gp_tensor *counts, const gp_tensor *ids) {
  GP_CHECK(moe_permute, dest, src, counts, ids);
  int64_t A = gp_numel(ids), E = counts->shape[0], S = src->shape[0];
  if (E < 1 || E > MOE_MAX_E)
    return gp_error("moe_permute: counts is %s: the number of experts must be in [1, %d]", GP_SHAPE(counts), MOE_MAX_E);
  if (S % E != 0)
    return gp_error("moe_permute: src is %s but counts is %s: the slots must be E * cap", GP_SHAPE(src), GP_SHAPE(counts));
  if (A > 2147483647 || S > 2147483647)
    return gp_error("moe_permute: ids %s or src %s is too large for i32 slots", GP_SHAPE(ids), GP_SHAPE(src));
  int64_t cap = S / E;
  GP_CUDA_DISPATCH(ids, gp_cuda_moe_permute(dest, src, counts, ids, A, (int)E, cap));
  GP_TRY(check_ids("moe_permute", "ids", ids, 0, E, "expert ids"));
  int32_t *pd = gp_ptr(dest), *ps = gp_ptr(src), *pc = gp_ptr(counts);
  const int32_t *pi = gp_ptr(ids);
  for (int64_t e = 0; e < E; e++) pc[e] = 0;
  for (int64_t s = 0; s < S; s++) ps[s] = -1;
  for (int64_t a = 0; a < A; a++) {
    int e = pi[a];
    int64_t r = pc[e]++;
    if (r < cap) {
      pd[a] = (int32_t)(e * cap + r);
      ps[e * cap + r] = (int32_t)a;
    } else {
      pd[a] = -1;
    }
  }
  return GP_OK;
}

int gp_k_moe_gather(gp_tensor *out, const gp_tensor *x, const gp_tensor *src, const gp_tensor *w) {
  GP_CHECK(moe_gather, out, x, src, w);
  int64_t S = out->shape[0], C = out->shape[1], N = x->shape[0], K = w->shape[1];
  if (w->shape[0] != N)
    return gp_error("moe_gather: x is %s but w is %s (w must be (N, K) with N = x's rows)", GP_SHAPE(x), GP_SHAPE(w));
  GP_CUDA_DISPATCH(out, gp_cuda_moe_gather(out, x, src, w, S, C, N, K));
  GP_TRY(check_ids("moe_gather", "src", src, -1, N * K, "-1 or a flat index of w"));
  int dt = out->dtype;
  const char *px = gp_ptr(x), *pw = gp_ptr(w);
  const int32_t *ps = gp_ptr(src);
  char *po = gp_ptr(out);
  for (int64_t s = 0; s < S; s++) {
    int64_t a = ps[s];
    double sc = a >= 0 ? gp_load(pw, dt, a) : 0;
    for (int64_t c = 0; c < C; c++) gp_store(po, dt, s * C + c, a >= 0 ? sc * gp_load(px, dt, (a / K) * C + c) : 0.0);
  }
  return GP_OK;
}

int gp_k_moe_combine(gp_tensor *out, const gp_tensor *ys, const gp_tensor *dest, const gp_tensor *w) {
  GP_CHECK(moe_combine, out, ys, dest, w);
  int64_t N = out->shape[0], C = out->shape[1], S = ys->shape[0], K = dest->shape[1];
  GP_CUDA_DISPATCH(out, gp_cuda_moe_combine(out, ys, dest, w, N, C, S, K));
  GP_TRY(check_ids("moe_combine", "dest", dest, -1, S, "-1 or a row of ys"));
  int dt = out->dtype;
  const char *py = gp_ptr(ys), *pw = gp_ptr(w);
  const int32_t *pd = gp_ptr(dest);
  char *po = gp_ptr(out);
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++) {
      double acc = 0;
      for (int64_t j = 0; j < K; j++) {
        int64_t s = pd[n * K + j];
        if (s >= 0) acc += gp_load(pw, dt, n * K + j) * gp_load(py, dt, s * C + c);
      }
      gp_store(po, dt, n * C + c, acc);
    }
  return GP_OK;
}

int gp_k_moe_combine_dw(gp_tensor *dw, const gp_tensor *dout, const gp_tensor *ys, const gp_tensor *dest) {
  GP_CHECK(moe_combine_dw, dw, dout, ys, dest);
  int64_t N = dout->shape[0], C = dout->shape[1], S = ys->shape[0], K = dest->shape[1];
  GP_CUDA_DISPATCH(dw, gp_cuda_moe_combine_dw(dw, dout, ys, dest, N, C, S, K));
  GP_TRY(check_ids("moe_combine_dw", "dest", dest, -1, S, "-1 or a row of ys"));
  int dt = dout->dtype;
  const char *pg = gp_ptr(dout), *py = gp_ptr(ys);
  const int32_t *pd = gp_ptr(dest);
  char *pw = gp_ptr(dw);
  for (int64_t n = 0; n < N; n++)
    for (int64_t j = 0; j < K; j++) {
      int64_t s = pd[n * K + j];
      double acc = 0;
      if (s >= 0)
        for (int64_t c = 0; c < C; c++) acc += gp_load(pg, dt, n * C + c) * gp_load(py, dt, s * C + c);
      gp_store(pw, dt, n * K + j, acc);
    }
  return GP_OK;
}
