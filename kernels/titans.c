/* titans.c: dispatch and CPU reference of the Titans chunk weights, in double. */
#include <stdlib.h>

#include "titans.h"

GP_TITANS_SCANS(gp_titans_cpu, double, static)

/* rows of a contiguous [N, L] tensor as doubles */
static void load_row(double *dst, const gp_tensor *t, int64_t row, int64_t L) {
  const char *p = gp_ptr(t);
  for (int64_t i = 0; i < L; i++) dst[i] = gp_load(p, t->dtype, row * L + i);
}
static void store_row(gp_tensor *t, int64_t row, int64_t L, const double *src) {
  char *p = gp_ptr(t);
  for (int64_t i = 0; i < L; i++) gp_store(p, t->dtype, row * L + i, src[i]);
}

static int rows_of(const gp_tensor *t, const char *op, int64_t *N, int64_t *L) {
  *N = t->shape[0];
  *L = t->shape[1];
  if (*L < 1) return gp_error("%s: rows of length 0 (eta is (%lld, 0)); a chunk has at least one token", op, (long long)*N);
  return GP_OK;
}

int gp_k_titans_coef(gp_tensor *w, gp_tensor *c, gp_tensor *p, const gp_tensor *eta, const gp_tensor *alpha) {
  GP_CHECK(titans_coef, w, c, p, eta, alpha);
  int64_t N, L;
  if (gp_numel(eta) == 0 && eta->shape[1] > 0) return GP_OK;
  GP_TRY(rows_of(eta, "titans_coef", &N, &L));
  if (N == 0) return GP_OK;
  GP_CUDA_DISPATCH(w, gp_cuda_titans_coef(w, c, p, eta, alpha));
  double *buf = malloc(sizeof(double) * (size_t)(5 * L + 3));
  if (!buf) return gp_error("titans_coef: out of host memory (rows of %lld)", (long long)L);
  double *e = buf, *a = e + L, *ww = a + L, *cc = ww + L, *bb = cc + L, *pp = bb + L;
  for (int64_t n = 0; n < N; n++) {
    load_row(e, eta, n, L);
    load_row(a, alpha, n, L);
    gp_titans_cpu_coef(L, e, a, ww, cc, bb, pp);
    store_row(w, n, L, ww);
    store_row(c, n, L, cc);
    store_row(p, n, 3, pp);
  }
  free(buf);
  return GP_OK;
}

int gp_k_titans_coef_backward(gp_tensor *deta, gp_tensor *dalpha, const gp_tensor *eta, const gp_tensor *alpha,
                              const gp_tensor *w, const gp_tensor *c, const gp_tensor *dw, const gp_tensor *dc,
                              const gp_tensor *dp) {
  GP_CHECK(titans_coef_backward, deta, dalpha, eta, alpha, w, c, dw, dc, dp);
  int64_t N, L;
  if (gp_numel(eta) == 0 && eta->shape[1] > 0) return GP_OK;
  GP_TRY(rows_of(eta, "titans_coef_backward", &N, &L));
  if (N == 0) return GP_OK;
  GP_CUDA_DISPATCH(deta, gp_cuda_titans_coef_backward(deta, dalpha, eta, alpha, w, c, dw, dc, dp));
  double *buf = malloc(sizeof(double) * (size_t)(10 * L + 6));
  if (!buf) return gp_error("titans_coef_backward: out of host memory (rows of %lld)", (long long)L);
  double *e = buf, *a = e + L, *ww = a + L, *cc = ww + L, *gw = cc + L, *gc = gw + L, *bb = gc + L, *de = bb + L,
         *da = de + L, *w2 = da + L, *gp3 = w2 + L, *p3 = gp3 + 3;
  for (int64_t n = 0; n < N; n++) {
    load_row(e, eta, n, L);
    load_row(a, alpha, n, L);
    load_row(ww, w, n, L);
    load_row(cc, c, n, L);
    load_row(gw, dw, n, L);
    load_row(gc, dc, n, L);
    load_row(gp3, dp, n, 3);
    gp_titans_cpu_coef(L, e, a, w2, de, bb, p3); /* b (w2 and de are scratch here) */
    gp_titans_cpu_coef_backward(L, e, a, ww, cc, bb, gw, gc, gp3, de, da);
    store_row(deta, n, L, de);
    store_row(dalpha, n, L, da);
  }
  free(buf);
  return GP_OK;
}
