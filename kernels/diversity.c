/* diversity.c: dispatch and CPU reference of the set-diversity kernels, in
 * double. The reference is the plain pairwise definition (every pair i < j),
 * independent of the CUDA version's identity
 *   sum_{i<j} u_i . u_j = (|sum_i u_i|^2 - sum_i |u_i|^2) / 2,  u_i = x_i / max(|x_i|, eps),
 * so that comparing the two checks that identity too. */
#include <math.h>
#include <stdlib.h>

#include "gp_hd.h"
#include "diversity.h"

/* u (N x D, doubles) = rows of x over max(norm, eps); nrm[i] = the norm */
static int unit_rows(double **u, double **nrm, const char *px, int dt, int64_t N, int64_t D, double eps) {
  *u = malloc(sizeof(double) * (size_t)(N * D + 1));
  *nrm = malloc(sizeof(double) * (size_t)(N + 1));
  if (!*u || !*nrm) {
    free(*u);
    free(*nrm);
    return gp_error_oom("set_diversity: out of host memory for a %lld x %lld set", (long long)N, (long long)D);
  }
  for (int64_t i = 0; i < N; i++) {
    double q = 0;
    for (int64_t j = 0; j < D; j++) {
      double v = gp_load(px, dt, i * D + j);
      q += v * v;
    }
    double n = sqrt(q), r = 1.0 / (n > eps ? n : eps);
    (*nrm)[i] = n;
    for (int64_t j = 0; j < D; j++) (*u)[i * D + j] = gp_load(px, dt, i * D + j) * r;
  }
  return GP_OK;
}

static int check_eps(const char *op, double eps) {
  if (!(eps > 0)) return gp_error("%s: eps = %g; it must be > 0", op, eps);
  return GP_OK;
}

int gp_k_set_diversity(gp_tensor *out, const gp_tensor *x, double eps) {
  GP_CHECK(set_diversity, out, x);
  GP_TRY(check_eps("set_diversity", eps));
  GP_CUDA_DISPATCH(out, gp_cuda_set_diversity(out, x, eps));
  const int64_t S = x->shape[0], N = x->shape[1], D = x->shape[2];
  const int dt = x->dtype;
  const char *px = gp_ptr(x);
  char *po = gp_ptr(out);
  for (int64_t s = 0; s < S; s++) {
    if (N < 2) {
      gp_store(po, dt, s, 0.0);
      continue;
    }
    double *u, *nrm;
    GP_TRY(unit_rows(&u, &nrm, px + s * N * D * (int64_t)gp_elsize(dt), dt, N, D, eps));
    double acc = 0;
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = i + 1; j < N; j++) {
        double c = 0;
        for (int64_t k = 0; k < D; k++) c += u[i * D + k] * u[j * D + k];
        acc += 1.0 - c;
      }
    gp_store(po, dt, s, acc / ((double)N * (double)(N - 1) / 2.0));
    free(u);
    free(nrm);
  }
  return GP_OK;
}

/* d/dx_i of 1 - c sum_{i<j} u_i.u_j with c = 2 / (N (N - 1)): with v = sum_{j != i} u_j,
 *   |x_i| > eps: -c (v - u_i (u_i . v)) / |x_i|   (the projection of v off u_i)
 *   else:        -c v / eps                       (u_i = x_i / eps is linear) */
int gp_k_set_diversity_backward(gp_tensor *dx, const gp_tensor *x, const gp_tensor *dout, double eps) {
  GP_CHECK(set_diversity_backward, dx, x, dout);
  GP_TRY(check_eps("set_diversity_backward", eps));
  GP_CUDA_DISPATCH(dx, gp_cuda_set_diversity_backward(dx, x, dout, eps));
  const int64_t S = x->shape[0], N = x->shape[1], D = x->shape[2];
  const int dt = x->dtype;
  const size_t es = gp_elsize(dt);
  const char *px = gp_ptr(x), *pd = gp_ptr(dout);
  char *pg = gp_ptr(dx);
  double *v = malloc(sizeof(double) * (size_t)(D + 1));
  if (!v) return gp_error_oom("set_diversity_backward: out of host memory");
  for (int64_t s = 0; s < S; s++) {
    char *g = pg + s * N * D * (int64_t)es;
    if (N < 2) {
      for (int64_t k = 0; k < N * D; k++) gp_store(g, dt, k, 0.0);
      continue;
    }
    double *u, *nrm;
    int rc = unit_rows(&u, &nrm, px + s * N * D * (int64_t)es, dt, N, D, eps);
    if (rc != GP_OK) {
      free(v);
      return rc;
    }
    const double c = 2.0 / ((double)N * (double)(N - 1)), go = gp_load(pd, dt, s);
    for (int64_t i = 0; i < N; i++) {
      for (int64_t k = 0; k < D; k++) v[k] = 0;
      for (int64_t j = 0; j < N; j++)
        if (j != i)
          for (int64_t k = 0; k < D; k++) v[k] += u[j * D + k];
      const double *ui = u + i * D;
      if (nrm[i] > eps) {
        double uv = 0;
        for (int64_t k = 0; k < D; k++) uv += ui[k] * v[k];
        for (int64_t k = 0; k < D; k++) gp_store(g, dt, i * D + k, -go * c * (v[k] - ui[k] * uv) / nrm[i]);
      } else {
        for (int64_t k = 0; k < D; k++) gp_store(g, dt, i * D + k, -go * c * v[k] / eps);
      }
    }
    free(u);
    free(nrm);
  }
  free(v);
  return GP_OK;
}

/* distinct-n: an n-gram at position p of sequence i counts when p + n <= lens[i];
 * it is distinct when no earlier counted n-gram of the set (in sequence, then
 * position order) has the same ids */
int gp_k_distinct_n(gp_tensor *out, const gp_tensor *tokens, const gp_tensor *lens, double n) {
  GP_CHECK(distinct_n, out, tokens, lens);
  if (!(n >= 1) || n != floor(n) || n > 1e6) return gp_error("distinct_n: n = %g; it must be a positive integer", n);
  GP_CUDA_DISPATCH(out, gp_cuda_distinct_n(out, tokens, lens, (int64_t)n));
  const int64_t S = tokens->shape[0], N = tokens->shape[1], L = tokens->shape[2], g = (int64_t)n;
  const int tdt = tokens->dtype, ldt = lens->dtype;
  const char *pt = gp_ptr(tokens), *pl = gp_ptr(lens);
  for (int64_t k = 0; k < S * N; k++) {
    int64_t v = gp_load_i64(pl, ldt, k);
    if (v < 0 || v > L)
      return gp_error("distinct_n: lens[%lld] = %lld is outside [0, %lld] (tokens are %s)", (long long)(k + 1),
                      (long long)v, (long long)L, GP_SHAPE(tokens));
  }
  float *po = gp_ptr(out);
  for (int64_t s = 0; s < S; s++) {
    int64_t total = 0, distinct = 0;
    for (int64_t i = 0; i < N; i++) {
      const int64_t li = gp_load_i64(pl, ldt, s * N + i);
      for (int64_t p = 0; p + g <= li; p++) {
        total++;
        const int64_t a = (s * N + i) * L + p;
        int seen = 0;
        for (int64_t i2 = 0; i2 <= i && !seen; i2++) {
          const int64_t l2 = gp_load_i64(pl, ldt, s * N + i2);
          for (int64_t p2 = 0; p2 + g <= l2 && !seen; p2++) {
            if (i2 == i && p2 >= p) break;
            const int64_t b = (s * N + i2) * L + p2;
            int same = 1;
            for (int64_t q = 0; q < g && same; q++) same = gp_load_i64(pt, tdt, a + q) == gp_load_i64(pt, tdt, b + q);
            seen = same;
          }
        }
        if (!seen) distinct++;
      }
    }
    po[s] = total > 0 ? (float)((double)distinct / (double)total) : 0.f;
  }
  return GP_OK;
}
