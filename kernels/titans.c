/* titans.c: dispatch and CPU reference of the Titans chunk weights, in double. */
#include <stdlib.h>

#include "titans.h"

GP_TITANS_SCANS(gp_titans_cpu, double, static)

/* row `row` of a contiguous tensor seen as rows of L, as doubles */
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

/* ---- titans_scan: the linear memory over whole sequences ---- */

/* N, T, D and C of a scan's tensors; C chunks of at least one token each */
static int scan_dims(const char *op, const gp_tensor *k, const gp_tensor *p, int64_t *N, int64_t *T, int64_t *D,
                     int64_t *C) {
  *N = k->shape[0];
  *T = k->shape[1];
  *D = k->shape[2];
  *C = p->shape[1];
  if (*C < 1 || *T < *C || *T % *C != 0)
    return gp_error(
        "%s: %lld tokens (k is (%lld, %lld, %lld)) do not split into %lld chunks of at least one token "
        "(p is (%lld, %lld, 3))",
        op, (long long)*T, (long long)*N, (long long)*T, (long long)*D, (long long)*C, (long long)*N, (long long)*C);
  return GP_OK;
}

int gp_k_titans_scan(gp_tensor *y, gp_tensor *st, gp_tensor *M, gp_tensor *S, const gp_tensor *k, const gp_tensor *v,
                     const gp_tensor *q, const gp_tensor *theta, const gp_tensor *w, const gp_tensor *c,
                     const gp_tensor *p, const gp_tensor *M0, const gp_tensor *S0) {
  GP_CHECK(titans_scan, y, st, M, S, k, v, q, theta, w, c, p, M0, S0);
  int64_t N, T, D, C;
  GP_TRY(scan_dims("titans_scan", k, p, &N, &T, &D, &C));
  if (N == 0 || D == 0) return GP_OK;
  GP_CUDA_DISPATCH(y, gp_cuda_titans_scan(y, st, M, S, k, v, q, theta, w, c, p, M0, S0));
  const int64_t DD = D * D, L = T / C;
  double *buf = malloc(sizeof(double) * (size_t)(4 * DD + 3 * D + 3));
  if (!buf) return gp_error("titans_scan: out of host memory (a state of %lld x %lld)", (long long)D, (long long)D);
  double *Mm = buf, *Sm = Mm + DD, *A = Sm + DD, *Bm = A + DD, *kt = Bm + DD, *qt = kt + D, *l = qt + D, *pj = l + D;
  for (int64_t n = 0; n < N; n++) {
    load_row(Mm, M0, n, DD);
    load_row(Sm, S0, n, DD);
    for (int64_t j = 0; j < C; j++) {
      store_row(st, (n * C + j) * 2, DD, Mm);
      store_row(st, (n * C + j) * 2 + 1, DD, Sm);
      for (int64_t i = 0; i < DD; i++) A[i] = Bm[i] = 0;
      for (int64_t t = j * L; t < (j + 1) * L; t++) {
        const int64_t row = (n * T + t) * D;
        load_row(kt, k, n * T + t, D);
        load_row(qt, q, n * T + t, D);
        const double th = gp_load(gp_ptr(theta), theta->dtype, n * T + t);
        const double wt = gp_load(gp_ptr(w), w->dtype, n * T + t), ct = gp_load(gp_ptr(c), c->dtype, n * T + t);
        for (int64_t a = 0; a < D; a++) {
          double yv = 0, e = 0;
          for (int64_t b = 0; b < D; b++) {
            yv += qt[b] * Mm[a * D + b];
            e += kt[b] * Mm[a * D + b];
          }
          gp_store(gp_ptr(y), y->dtype, row + a, yv);
          l[a] = -2 * th * (e - gp_load(gp_ptr(v), v->dtype, row + a));
        }
        for (int64_t a = 0; a < D; a++)
          for (int64_t b = 0; b < D; b++) {
            A[a * D + b] += wt * l[a] * kt[b];
            Bm[a * D + b] += ct * l[a] * kt[b];
          }
      }
      load_row(pj, p, n * C + j, 3);
      for (int64_t i = 0; i < DD; i++) {
        const double s = Sm[i];
        Mm[i] = pj[1] * Mm[i] + pj[2] * s + Bm[i];
        Sm[i] = pj[0] * s + A[i];
      }
    }
    store_row(M, n, DD, Mm);
    store_row(S, n, DD, Sm);
  }
  free(buf);
  return GP_OK;
}

int gp_k_titans_scan_backward(gp_tensor *dk, gp_tensor *dv, gp_tensor *dq, gp_tensor *dtheta, gp_tensor *dw,
                              gp_tensor *dc, gp_tensor *dp, gp_tensor *dM0, gp_tensor *dS0, const gp_tensor *k,
                              const gp_tensor *v, const gp_tensor *q, const gp_tensor *theta, const gp_tensor *w,
                              const gp_tensor *c, const gp_tensor *p, const gp_tensor *st, const gp_tensor *dy,
                              const gp_tensor *dM, const gp_tensor *dS) {
  GP_CHECK(titans_scan_backward, dk, dv, dq, dtheta, dw, dc, dp, dM0, dS0, k, v, q, theta, w, c, p, st, dy, dM, dS);
  int64_t N, T, D, C;
  GP_TRY(scan_dims("titans_scan_backward", k, p, &N, &T, &D, &C));
  if (N == 0) return GP_OK;
  GP_CUDA_DISPATCH(dk, gp_cuda_titans_scan_backward(dk, dv, dq, dtheta, dw, dc, dp, dM0, dS0, k, v, q, theta, w, c, p,
                                                    st, dy, dM, dS));
  const int64_t DD = D * D, L = T / C;
  double *buf = malloc(sizeof(double) * (size_t)(5 * DD + 8 * D + 3 + 1));
  if (!buf)
    return gp_error("titans_scan_backward: out of host memory (a state of %lld x %lld)", (long long)D, (long long)D);
  double *gM = buf, *gS = gM + DD, *Mj = gS + DD, *Sj = Mj + DD, *dMl = Sj + DD, *kt = dMl + DD, *qt = kt + D,
         *vt = qt + D, *yt = vt + D, *l = yt + D, *dE = l + D, *dkt = dE + D, *dqt = dkt + D, *pj = dqt + D;
  for (int64_t n = 0; n < N; n++) {
    load_row(gM, dM, n, DD);
    load_row(gS, dS, n, DD);
    for (int64_t j = C - 1; j >= 0; j--) {
      load_row(Mj, st, (n * C + j) * 2, DD);
      load_row(Sj, st, (n * C + j) * 2 + 1, DD);
      double g[3] = {0, 0, 0};
      for (int64_t i = 0; i < DD; i++) {
        g[0] += gS[i] * Sj[i];
        g[1] += gM[i] * Mj[i];
        g[2] += gM[i] * Sj[i];
      }
      store_row(dp, n * C + j, 3, g);
      for (int64_t i = 0; i < DD; i++) dMl[i] = 0;
      for (int64_t t = j * L; t < (j + 1) * L; t++) {
        const int64_t row = (n * T + t) * D;
        load_row(kt, k, n * T + t, D);
        load_row(qt, q, n * T + t, D);
        load_row(vt, v, n * T + t, D);
        load_row(yt, dy, n * T + t, D);
        const double th = gp_load(gp_ptr(theta), theta->dtype, n * T + t);
        const double wt = gp_load(gp_ptr(w), w->dtype, n * T + t), ct = gp_load(gp_ptr(c), c->dtype, n * T + t);
        double sw = 0, sc = 0, sth = 0;
        for (int64_t a = 0; a < D; a++) {
          double e = -vt[a], gs = 0, gm = 0;
          for (int64_t b = 0; b < D; b++) {
            e += kt[b] * Mj[a * D + b];
            gs += kt[b] * gS[a * D + b];
            gm += kt[b] * gM[a * D + b];
          }
          l[a] = -2 * th * e;
          const double dl = wt * gs + ct * gm;
          dE[a] = -2 * th * dl;
          sw += l[a] * gs;
          sc += l[a] * gm;
          sth += -2 * e * dl;
          gp_store(gp_ptr(dv), dv->dtype, row + a, -dE[a]);
        }
        gp_store(gp_ptr(dw), dw->dtype, n * T + t, sw);
        gp_store(gp_ptr(dc), dc->dtype, n * T + t, sc);
        gp_store(gp_ptr(dtheta), dtheta->dtype, n * T + t, sth);
        for (int64_t b = 0; b < D; b++) dkt[b] = dqt[b] = 0;
        for (int64_t a = 0; a < D; a++)
          for (int64_t b = 0; b < D; b++) {
            dkt[b] += l[a] * (wt * gS[a * D + b] + ct * gM[a * D + b]) + dE[a] * Mj[a * D + b];
            dqt[b] += yt[a] * Mj[a * D + b];
            dMl[a * D + b] += dE[a] * kt[b] + yt[a] * qt[b];
          }
        store_row(dk, n * T + t, D, dkt);
        store_row(dq, n * T + t, D, dqt);
      }
      load_row(pj, p, n * C + j, 3);
      for (int64_t i = 0; i < DD; i++) {
        const double m = gM[i];
        gM[i] = pj[1] * m + dMl[i];
        gS[i] = pj[0] * gS[i] + pj[2] * m;
      }
    }
    store_row(dM0, n, DD, gM);
    store_row(dS0, n, DD, gS);
  }
  free(buf);
  return GP_OK;
}
