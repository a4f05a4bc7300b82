/* titans.c: dispatch and CPU reference of the Titans kernels, in double. */
#include <math.h>
#include <stdlib.h>

#include "titans.h"

GP_TITANS_SCANS(gp_titans_cpu, double, static)
GP_TITANS_POINTWISE(gp_titans_cpu, double, static)

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

/* ---- titans_gates: theta, eta, alpha from the gate projection ---- */

/* the chunk size b of gates over (B, T, 3, H): an integer that divides T */
static int gates_chunk(const char *op, const gp_tensor *g, double b, int64_t *bc) {
  *bc = (int64_t)b;
  if ((double)*bc != b || *bc < 1 || g->shape[1] % *bc != 0)
    return gp_error("%s: the chunk size b = %g must be a positive integer that divides T = %lld (g is (%lld, %lld, 3, %lld))",
                    op, b, (long long)g->shape[1], (long long)g->shape[0], (long long)g->shape[1], (long long)g->shape[3]);
  return GP_OK;
}

/* the chunk means of g[., 1, h] and g[., 2, h] over tokens t0 .. t0 + bc - 1 of row bi */
static void gates_means(const gp_tensor *g, int64_t bi, int64_t h, int64_t t0, int64_t bc, double *m1, double *m2) {
  const int64_t T = g->shape[1], H = g->shape[3];
  double s1 = 0, s2 = 0;
  for (int64_t t = t0; t < t0 + bc; t++) {
    const int64_t at = ((bi * T + t) * 3) * H + h;
    s1 += gp_load(gp_ptr(g), g->dtype, at + H);
    s2 += gp_load(gp_ptr(g), g->dtype, at + 2 * H);
  }
  *m1 = s1 / (double)bc;
  *m2 = s2 / (double)bc;
}

int gp_k_titans_gates(gp_tensor *theta, gp_tensor *eta, gp_tensor *alpha, const gp_tensor *g, double b) {
  GP_CHECK(titans_gates, theta, eta, alpha, g);
  int64_t bc;
  GP_TRY(gates_chunk("titans_gates", g, b, &bc));
  if (gp_numel(g) == 0) return GP_OK;
  GP_CUDA_DISPATCH(theta, gp_cuda_titans_gates(theta, eta, alpha, g, bc));
  const int64_t B = g->shape[0], T = g->shape[1], H = g->shape[3];
  for (int64_t bi = 0; bi < B; bi++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t t0 = 0; t0 < T; t0 += bc) {
        double m1, m2;
        gates_means(g, bi, h, t0, bc, &m1, &m2);
        const double e = gp_titans_cpu_sigmoid(m1), a = gp_titans_cpu_alpha(m2, (double)bc);
        for (int64_t t = t0; t < t0 + bc; t++) {
          const int64_t o = (bi * H + h) * T + t;
          gp_store(gp_ptr(theta), theta->dtype, o,
                   gp_titans_cpu_sigmoid(gp_load(gp_ptr(g), g->dtype, ((bi * T + t) * 3) * H + h)) / (double)bc);
          gp_store(gp_ptr(eta), eta->dtype, o, e);
          gp_store(gp_ptr(alpha), alpha->dtype, o, a);
        }
      }
  return GP_OK;
}

int gp_k_titans_gates_backward(gp_tensor *dg, const gp_tensor *g, const gp_tensor *dtheta, const gp_tensor *deta,
                               const gp_tensor *dalpha, double b) {
  GP_CHECK(titans_gates_backward, dg, g, dtheta, deta, dalpha);
  int64_t bc;
  GP_TRY(gates_chunk("titans_gates_backward", g, b, &bc));
  if (gp_numel(g) == 0) return GP_OK;
  GP_CUDA_DISPATCH(dg, gp_cuda_titans_gates_backward(dg, g, dtheta, deta, dalpha, bc));
  const int64_t B = g->shape[0], T = g->shape[1], H = g->shape[3];
  const double n = (double)bc;
  for (int64_t bi = 0; bi < B; bi++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t t0 = 0; t0 < T; t0 += bc) {
        double m1, m2, s1 = 0, s2 = 0;
        gates_means(g, bi, h, t0, bc, &m1, &m2);
        for (int64_t t = t0; t < t0 + bc; t++) {
          const int64_t o = (bi * H + h) * T + t;
          s1 += gp_load(gp_ptr(deta), deta->dtype, o);
          s2 += gp_load(gp_ptr(dalpha), dalpha->dtype, o);
        }
        /* d eta / d m1 = eta (1 - eta); d alpha / d m2 = (1 - alpha) sigmoid(m2) / b; each token holds 1 / b of m */
        const double e = gp_titans_cpu_sigmoid(m1), a = gp_titans_cpu_alpha(m2, n);
        const double g1 = s1 * e * (1 - e) / n, g2 = s2 * (1 - a) * gp_titans_cpu_sigmoid(m2) / n / n;
        for (int64_t t = t0; t < t0 + bc; t++) {
          const int64_t at = ((bi * T + t) * 3) * H + h;
          const double s = gp_titans_cpu_sigmoid(gp_load(gp_ptr(g), g->dtype, at));
          gp_store(gp_ptr(dg), dg->dtype, at, gp_load(gp_ptr(dtheta), dtheta->dtype, (bi * H + h) * T + t) * s * (1 - s) / n);
          gp_store(gp_ptr(dg), dg->dtype, at + H, g1);
          gp_store(gp_ptr(dg), dg->dtype, at + 2 * H, g2);
        }
      }
  return GP_OK;
}

/* ---- titans_prep: silu (and the L2 norm) of a memory input, per memory ---- */

static int prep_flag(const char *op, double norm, double eps) {
  if (norm != 0 && norm != 1) return gp_error("%s: norm must be 0 or 1, got %g", op, norm);
  if (!(eps >= 0)) return gp_error("%s: eps must be >= 0, got %g", op, eps);
  return GP_OK;
}

/* row (bi, t, h) of y: s = silu(y), ds = silu'(y); returns the norm's factor r (1 without the norm) */
static double prep_row(const gp_tensor *y, int64_t row, int64_t D, int norm, double eps, double *s, double *ds) {
  double ss = 0;
  for (int64_t i = 0; i < D; i++) {
    s[i] = gp_titans_cpu_silu(gp_load(gp_ptr(y), y->dtype, row * D + i), &ds[i]);
    ss += s[i] * s[i];
  }
  return norm ? 1 / sqrt(ss + eps) : 1;
}

int gp_k_titans_prep(gp_tensor *out, const gp_tensor *y, double norm, double eps) {
  GP_CHECK(titans_prep, out, y);
  GP_TRY(prep_flag("titans_prep", norm, eps));
  if (gp_numel(y) == 0) return GP_OK;
  GP_CUDA_DISPATCH(out, gp_cuda_titans_prep(out, y, norm != 0, eps));
  const int64_t B = y->shape[0], T = y->shape[1], H = y->shape[2], D = y->shape[3];
  double *buf = malloc(sizeof(double) * (size_t)(2 * D));
  if (!buf) return gp_error("titans_prep: out of host memory (rows of %lld)", (long long)D);
  for (int64_t bi = 0; bi < B; bi++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t h = 0; h < H; h++) {
        const double r = prep_row(y, (bi * T + t) * H + h, D, norm != 0, eps, buf, buf + D);
        for (int64_t i = 0; i < D; i++) gp_store(gp_ptr(out), out->dtype, ((bi * H + h) * T + t) * D + i, buf[i] * r);
      }
  free(buf);
  return GP_OK;
}

int gp_k_titans_prep_backward(gp_tensor *dy, const gp_tensor *y, const gp_tensor *dout, double norm, double eps) {
  GP_CHECK(titans_prep_backward, dy, y, dout);
  GP_TRY(prep_flag("titans_prep_backward", norm, eps));
  if (gp_numel(y) == 0) return GP_OK;
  GP_CUDA_DISPATCH(dy, gp_cuda_titans_prep_backward(dy, y, dout, norm != 0, eps));
  const int64_t B = y->shape[0], T = y->shape[1], H = y->shape[2], D = y->shape[3];
  double *buf = malloc(sizeof(double) * (size_t)(3 * D));
  if (!buf) return gp_error("titans_prep_backward: out of host memory (rows of %lld)", (long long)D);
  double *s = buf, *ds = s + D, *go = ds + D;
  for (int64_t bi = 0; bi < B; bi++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t h = 0; h < H; h++) {
        const int64_t row = (bi * T + t) * H + h;
        const double r = prep_row(y, row, D, norm != 0, eps, s, ds);
        load_row(go, dout, (bi * H + h) * T + t, D);
        /* out = s r with r = (sum s^2 + eps)^(-1/2): ds_i = r (go_i - out_i sum_j out_j go_j) */
        double dot = 0;
        if (norm != 0)
          for (int64_t i = 0; i < D; i++) dot += s[i] * r * go[i];
        for (int64_t i = 0; i < D; i++) gp_store(gp_ptr(dy), dy->dtype, row * D + i, r * (go[i] - s[i] * r * dot) * ds[i]);
      }
  free(buf);
  return GP_OK;
}
