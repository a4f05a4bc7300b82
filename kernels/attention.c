/* attention.c: checks, dispatch and the CPU references of flash attention
 * (plain attention accumulated in double; q, k, v, out, dout, dq, dk, dv at any
 * strides on B, H and T) and of decode attention. k and v have H / G heads
 * (the spec checks that their count divides H): query head h reads KV head
 * h / G, and the backward sums dk, dv over the G query heads of a KV head. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gp_hd.h"
#include "kvquant.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_attn_fwd(gp_tensor *out, gp_tensor *lse, const gp_tensor *q, const gp_tensor *k, const gp_tensor *v,
                     double scale, int64_t window, int64_t n_global, int causal);
int gp_cuda_attn_bwd(gp_tensor *dq, gp_tensor *dk, gp_tensor *dv, const gp_tensor *q, const gp_tensor *k,
                     const gp_tensor *v, const gp_tensor *out, const gp_tensor *lse, const gp_tensor *dout, double scale,
                     int64_t window, int64_t n_global, int causal);
int gp_cuda_attn_decode(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcache, const gp_tensor *vcache,
                        const gp_tensor *lens, double scale, int64_t window, int64_t n_global);
int gp_cuda_attn_decode_q(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcodes, const gp_tensor *vcodes,
                          const gp_tensor *kscales, const gp_tensor *vscales, const gp_tensor *lens, double scale,
                          int64_t window, int64_t n_global, int fmt);
int gp_cuda_attn_chunk_q(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcodes, const gp_tensor *vcodes,
                         const gp_tensor *kscales, const gp_tensor *vscales, const gp_tensor *lens, double scale,
                         int64_t window, int64_t n_global, int fmt);
#ifdef __cplusplus
}
#endif

/* The head dims each kind takes, the one place they are written (the CUDA
 * dispatch in attention.cu has an implementation for each; the CPU
 * references hold rows of at most ATTN_MAX_D). max_s: the most keys (0: no
 * limit). */
enum { ATTN_MAX_D = 128 };
typedef struct {
  int dim;
  int64_t max_s;
} attn_dim;
static const struct {
  const char *kind;
  attn_dim dims[4]; /* ends at dim 0 */
} ATTN_DIMS[] = {
    {"fwd", {{32, 0}, {64, 0}, {128, 0}}},
    {"bwd", {{32, 0}, {64, 0}, {128, 0}}},
    {"decode", {{64, 0}, {128, 0}}},
    {"flash", {{32, 512}, {64, 0}, {128, 0}}},
};

static const attn_dim *attn_dims(const char *kind) {
  for (size_t i = 0; kind && i < sizeof ATTN_DIMS / sizeof ATTN_DIMS[0]; i++)
    if (!strcmp(kind, ATTN_DIMS[i].kind)) return ATTN_DIMS[i].dims;
  return NULL;
}

int gp_attention_supported(const char *kind, int dtype, int head_dim, int64_t seq_k) {
  const attn_dim *d = attn_dims(kind);
  if (!d || !gp_is_float(dtype)) return 0;
  for (; d->dim; d++)
    if (d->dim == head_dim) return d->max_s == 0 || seq_k <= d->max_s;
  return 0;
}

const char *gp_attention_head_dims(char *buf, int n, const char *kind) {
  const attn_dim *d = attn_dims(kind);
  if (!buf || n <= 0) return buf;
  buf[0] = 0;
  for (int k = 0; d && d->dim && k < n; d++) {
    k += snprintf(buf + k, (size_t)(n - k), "%s%d", k ? ", " : "", d->dim);
    if (d->max_s && k < n) k += snprintf(buf + k, (size_t)(n - k), " (up to %lld keys)", (long long)d->max_s);
  }
  return buf;
}

/* head dim, scale and mask scalars: the checks every attention kernel shares
 * (kind: "fwd", "bwd" or "decode") */
static int attn_args(const char *op, const char *kind, const gp_tensor *q, int64_t D, double *scale, double window,
                     double n_global, int64_t *win, int64_t *ng) {
  if (D > INT32_MAX || !gp_attention_supported(kind, q->dtype, (int)D, 0)) {
    char dims[64];
    return gp_error("%s: head dim %lld is not supported (supported: %s); q is %s", op, (long long)D,
                    gp_attention_head_dims(dims, sizeof dims, kind), GP_SHAPE(q));
  }
  if (!(*scale == *scale) || isinf(*scale)) return gp_error("%s: scale must be finite, got %g", op, *scale);
  if (*scale == 0) *scale = 1.0 / sqrt((double)D);
  if (window != floor(window) || window < 0 || window > 9e15)
    return gp_error("%s: window must be an integer >= 0 (0: none), got %g", op, window);
  if (n_global != floor(n_global) || n_global < 0 || n_global > 9e15)
    return gp_error("%s: n_global must be an integer >= 0, got %g", op, n_global);
  *win = (int64_t)window;
  *ng = (int64_t)n_global;
  return GP_OK;
}

static int attn_seq(const char *op, const gp_tensor *q, const gp_tensor *k, int64_t win, int causal) {
  int64_t T = q->shape[2], S = k->shape[2];
  if ((causal || win > 0) && T > S)
    return gp_error("%s: causal or windowed attention needs S >= T (queries are the last T of S positions); q is %s, "
                    "k is %s",
                    op, GP_SHAPE(q), GP_SHAPE(k));
  return GP_OK;
}

/* G: the query heads that share one KV head (H / Hkv; 1 when there are no heads) */
static inline int64_t attn_group(const gp_tensor *q, const gp_tensor *k) {
  return k->shape[1] > 0 ? q->shape[1] / k->shape[1] : 1;
}

/* key j visible to the query at position p */
static inline int attn_visible(int64_t p, int64_t j, int64_t win, int64_t ng, int causal) {
  if (causal && j > p) return 0;
  if (win > 0 && p - j >= win && j >= ng) return 0;
  return 1;
}

static double dot_d(const void *a, int64_t ia, const void *b, int64_t ib, int dt, int64_t D) {
  double s = 0;
  for (int64_t d = 0; d < D; d++) s += gp_load(a, dt, ia + d) * gp_load(b, dt, ib + d);
  return s;
}

/* element offset of row i of head (b, h) in a (B, H, R, D) tensor with any
 * strides on B, H and R (stride 1 on D, checked by the spec) */
static inline int64_t row_at(const gp_tensor *t, int64_t b, int64_t h, int64_t i) {
  return b * t->stride[0] + h * t->stride[1] + i * t->stride[2];
}

int gp_k_attn_fwd(gp_tensor *out, gp_tensor *lse, const gp_tensor *q, const gp_tensor *k, const gp_tensor *v,
                  double scale, double window, double n_global, double causal) {
  GP_CHECK(attn_fwd, out, lse, q, k, v);
  int64_t D = q->shape[3], win, ng;
  GP_TRY(attn_args("attn_fwd", "fwd", q, D, &scale, window, n_global, &win, &ng));
  int cz = causal != 0;
  GP_TRY(attn_seq("attn_fwd", q, k, win, cz));
  GP_CUDA_DISPATCH(out, gp_cuda_attn_fwd(out, lse, q, k, v, scale, win, ng, cz));
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], S = k->shape[2], G = attn_group(q, k);
  int dt = q->dtype;
  const void *pq = gp_ptr(q), *pk = gp_ptr(k), *pv = gp_ptr(v);
  void *po = gp_ptr(out);
  float *pl = gp_ptr(lse);
  double acc[ATTN_MAX_D];
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < T; i++) {
        GP_POLL_INTERRUPT("attn_fwd");
        int64_t p = i + S - T, qi = row_at(q, b, h, i), bh = b * H + h, hk = h / G;
        double m = -INFINITY, l = 0;
        for (int64_t d = 0; d < D; d++) acc[d] = 0;
        for (int64_t j = 0; j < S; j++)
          if (attn_visible(p, j, win, ng, cz)) {
            double s = dot_d(pq, qi, pk, row_at(k, b, hk, j), dt, D) * scale;
            if (s > m) m = s;
          }
        for (int64_t j = 0; j < S; j++)
          if (attn_visible(p, j, win, ng, cz)) {
            int64_t kj = row_at(k, b, hk, j), vj = row_at(v, b, hk, j);
            double e = exp(dot_d(pq, qi, pk, kj, dt, D) * scale - m);
            l += e;
            for (int64_t d = 0; d < D; d++) acc[d] += e * gp_load(pv, dt, vj + d);
          }
        int64_t oi = row_at(out, b, h, i);
        for (int64_t d = 0; d < D; d++) gp_store(po, out->dtype, oi + d, l > 0 ? acc[d] / l : 0.0);
        pl[bh * T + i] = l > 0 ? (float)(m + log(l)) : -INFINITY;
      }
  return GP_OK;
}

int gp_k_attn_bwd(gp_tensor *dq, gp_tensor *dk, gp_tensor *dv, const gp_tensor *q, const gp_tensor *k,
                  const gp_tensor *v, const gp_tensor *out, const gp_tensor *lse, const gp_tensor *dout, double scale,
                  double window, double n_global, double causal) {
  GP_CHECK(attn_bwd, dq, dk, dv, q, k, v, out, lse, dout);
  int64_t D = q->shape[3], win, ng;
  GP_TRY(attn_args("attn_bwd", "bwd", q, D, &scale, window, n_global, &win, &ng));
  int cz = causal != 0;
  GP_TRY(attn_seq("attn_bwd", q, k, win, cz));
  GP_CUDA_DISPATCH(dq, gp_cuda_attn_bwd(dq, dk, dv, q, k, v, out, lse, dout, scale, win, ng, cz));
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], S = k->shape[2], G = attn_group(q, k);
  int dt = q->dtype;
  const void *pq = gp_ptr(q), *pk = gp_ptr(k), *pv = gp_ptr(v), *po = gp_ptr(out), *pg = gp_ptr(dout);
  const float *pl = gp_ptr(lse);
  double a[ATTN_MAX_D], c[ATTN_MAX_D];
  /* P = exp(s - lse), dP = dout . v, dS = P (dP - sum(dout * out)) */
  for (int64_t b = 0; b < B; b++) {
    /* dq: row by row, over the query head's KV head */
    for (int64_t h = 0; h < H; h++) {
      int64_t bh = b * H + h, hk = h / G;
      for (int64_t i = 0; i < T; i++) {
        GP_POLL_INTERRUPT("attn_bwd");
        int64_t p = i + S - T, qi = row_at(q, b, h, i), gi = row_at(dout, b, h, i);
        double Di = dot_d(pg, gi, po, row_at(out, b, h, i), dt, D), L = pl[bh * T + i];
        for (int64_t d = 0; d < D; d++) a[d] = 0;
        for (int64_t j = 0; j < S; j++)
          if (attn_visible(p, j, win, ng, cz)) {
            int64_t kj = row_at(k, b, hk, j);
            double P = exp(dot_d(pq, qi, pk, kj, dt, D) * scale - L);
            double dS = P * (dot_d(pg, gi, pv, row_at(v, b, hk, j), dt, D) - Di);
            for (int64_t d = 0; d < D; d++) a[d] += dS * gp_load(pk, dt, kj + d);
          }
        int64_t di = row_at(dq, b, h, i);
        for (int64_t d = 0; d < D; d++) gp_store(gp_ptr(dq), dq->dtype, di + d, a[d] * scale);
      }
    }
    /* dk and dv: key by key, summed over the G query heads of the KV head */
    for (int64_t hk = 0; hk < H / G; hk++)
      for (int64_t j = 0; j < S; j++) {
        GP_POLL_INTERRUPT("attn_bwd");
        int64_t kj = row_at(k, b, hk, j), vj = row_at(v, b, hk, j);
        for (int64_t d = 0; d < D; d++) a[d] = c[d] = 0;
        for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
          int64_t bh = b * H + h;
          for (int64_t i = 0; i < T; i++) {
            int64_t p = i + S - T, qi = row_at(q, b, h, i), gi = row_at(dout, b, h, i);
            if (!attn_visible(p, j, win, ng, cz)) continue;
            double P = exp(dot_d(pq, qi, pk, kj, dt, D) * scale - (double)pl[bh * T + i]);
            double dS = P * (dot_d(pg, gi, pv, vj, dt, D) - dot_d(pg, gi, po, row_at(out, b, h, i), dt, D));
            for (int64_t d = 0; d < D; d++) {
              a[d] += dS * gp_load(pq, dt, qi + d);
              c[d] += P * gp_load(pg, dt, gi + d);
            }
          }
        }
        int64_t dki = row_at(dk, b, hk, j), dvi = row_at(dv, b, hk, j);
        for (int64_t d = 0; d < D; d++) {
          gp_store(gp_ptr(dk), dk->dtype, dki + d, a[d] * scale);
          gp_store(gp_ptr(dv), dv->dtype, dvi + d, c[d]);
        }
      }
  }
  return GP_OK;
}

/* element d of cache row `row` (of D): the cache's dtype, or (fmt 1, 2) a
 * code times the row's scale */
static inline double kv_elem(const gp_tensor *c, const float *sc, int fmt, int64_t row, int64_t D, int64_t d) {
  if (!fmt) return gp_load(gp_ptr(c), c->dtype, row * D + d);
  return (double)kvq_decode(((const uint8_t *)gp_ptr(c))[row * D + d], fmt) * sc[row];
}

/* decode attention's checks after the dispatch and its CPU reference, over a
 * cache in q's dtype (fmt 0; ks, vs unused) or of codes and scales. chunk 0:
 * q, out (B, H, D), one query a row at position lens[b] - 1; chunk 1: q, out
 * (B, T, H, D), query t of row b at position lens[b] - T + t (causal over
 * the cache, nothing visible before position 0) */
static int decode_ref(const char *op, gp_tensor *out, const gp_tensor *q, const gp_tensor *kcache,
                      const gp_tensor *vcache, const gp_tensor *ks, const gp_tensor *vs, const gp_tensor *lens,
                      double scale, int64_t win, int64_t ng, int fmt, int chunk) {
  int64_t B = q->shape[0], T = chunk ? q->shape[1] : 1, H = q->shape[chunk ? 2 : 1], D = q->shape[chunk ? 3 : 2],
          C = kcache->shape[2], Hkv = kcache->shape[1], G = Hkv > 0 ? H / Hkv : 1;
  int dt = q->dtype;
  const void *pq = gp_ptr(q), *pn = gp_ptr(lens);
  const float *pks = fmt ? gp_ptr(ks) : 0, *pvs = fmt ? gp_ptr(vs) : 0;
  for (int64_t b = 0; b < B; b++) {
    int64_t n = gp_load_i64(pn, lens->dtype, b);
    if (n < 0 || n > C)
      return gp_error("%s: lens[%lld] = %lld is outside [0, %lld] (kcache %s)", op, (long long)b, (long long)n,
                      (long long)C, GP_SHAPE(kcache));
  }
  double acc[ATTN_MAX_D], qd[ATTN_MAX_D];
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t h = 0; h < H; h++) {
        int64_t p = gp_load_i64(pn, lens->dtype, b) - T + t, qi = ((b * T + t) * H + h) * D,
                base = (b * Hkv + h / G) * C;
        double m = -INFINITY, l = 0;
        for (int64_t d = 0; d < D; d++) {
          acc[d] = 0;
          qd[d] = gp_load(pq, dt, qi + d);
        }
        for (int pass = 0; pass < 2; pass++) /* the max, then the sums */
          for (int64_t j = 0; j <= p; j++)
            if (attn_visible(p, j, win, ng, 1)) {
              double s = 0;
              for (int64_t d = 0; d < D; d++) s += qd[d] * kv_elem(kcache, pks, fmt, base + j, D, d);
              s *= scale;
              if (pass == 0) {
                if (s > m) m = s;
                continue;
              }
              double e = exp(s - m);
              l += e;
              for (int64_t d = 0; d < D; d++) acc[d] += e * kv_elem(vcache, pvs, fmt, base + j, D, d);
            }
        for (int64_t d = 0; d < D; d++) gp_store(gp_ptr(out), out->dtype, qi + d, l > 0 ? acc[d] / l : 0.0);
      }
  return GP_OK;
}

int gp_k_attn_decode(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcache, const gp_tensor *vcache,
                     const gp_tensor *lens, double scale, double window, double n_global) {
  GP_CHECK(attn_decode, out, q, kcache, vcache, lens);
  int64_t D = q->shape[2], win, ng;
  GP_TRY(attn_args("attn_decode", "decode", q, D, &scale, window, n_global, &win, &ng));
  GP_CUDA_DISPATCH(out, gp_cuda_attn_decode(out, q, kcache, vcache, lens, scale, win, ng));
  return decode_ref("attn_decode", out, q, kcache, vcache, 0, 0, lens, scale, win, ng, 0, 0);
}

/* attn_decode_q (chunk 0: q (B, H, D)) and attn_chunk_q (chunk 1: q (B, T, H, D)) after their spec checks */
static int decode_codes(const char *op, int chunk, gp_tensor *out, const gp_tensor *q, const gp_tensor *kcodes,
                        const gp_tensor *vcodes, const gp_tensor *kscales, const gp_tensor *vscales,
                        const gp_tensor *lens, double scale, double window, double n_global, double fmt) {
  int64_t D = q->shape[chunk ? 3 : 2], win, ng;
  GP_TRY(attn_args(op, "decode", q, D, &scale, window, n_global, &win, &ng));
  if (fmt != GP_KV_INT8 && fmt != GP_KV_FP8) return gp_error("%s: fmt must be 1 (int8) or 2 (fp8 e4m3), got %g", op, fmt);
  GP_CUDA_DISPATCH(out, (chunk ? gp_cuda_attn_chunk_q : gp_cuda_attn_decode_q)(out, q, kcodes, vcodes, kscales, vscales,
                                                                                lens, scale, win, ng, (int)fmt));
  return decode_ref(op, out, q, kcodes, vcodes, kscales, vscales, lens, scale, win, ng, (int)fmt, chunk);
}

int gp_k_attn_decode_q(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcodes, const gp_tensor *vcodes,
                       const gp_tensor *kscales, const gp_tensor *vscales, const gp_tensor *lens, double scale,
                       double window, double n_global, double fmt) {
  GP_CHECK(attn_decode_q, out, q, kcodes, vcodes, kscales, vscales, lens);
  return decode_codes("attn_decode_q", 0, out, q, kcodes, vcodes, kscales, vscales, lens, scale, window, n_global, fmt);
}

int gp_k_attn_chunk_q(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcodes, const gp_tensor *vcodes,
                      const gp_tensor *kscales, const gp_tensor *vscales, const gp_tensor *lens, double scale,
                      double window, double n_global, double fmt) {
  GP_CHECK(attn_chunk_q, out, q, kcodes, vcodes, kscales, vscales, lens);
  return decode_codes("attn_chunk_q", 1, out, q, kcodes, vcodes, kscales, vscales, lens, scale, window, n_global, fmt);
}
