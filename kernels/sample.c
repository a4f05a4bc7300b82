/* sample.c: dispatch and CPU reference of token sampling.
 *
 * sample: per row, w_j = exp((x_j - max) / temperature) (NaN logits count as
 * -inf). Every filter keeps the tokens whose logit is at or above a threshold,
 * so the kept set is {j : key(x_j) >= tau} with key() the order-preserving map
 * of a float to 32 bits, and tau is found by bisection over keys (32 steps at
 * most, no sort; the CUDA version does the same passes, a row per block):
 *   top-k  (0 < k < V): tau_k = the k-th largest logit (ties at it are kept);
 *   min-p  (> 0):       tau_m = the smallest logit with w >= min_p (w_max = 1);
 *   top-p  (< 1):       tau = the largest key t >= max(tau_k, tau_m) such that
 *                       the mass of {key >= t} is >= top_p times the mass kept
 *                       by top-k and min-p (ties at the cut are all kept).
 * probs = w / (kept mass) on the kept set, 0 elsewhere. The draw: u, the
 * Philox uniform of row n (counter offset + n / 4, lane n % 4, as multinomial
 * and rand_uniform), picks the first kept j (in index order) whose running
 * mass exceeds u times the kept mass. temperature 0: the argmax (lowest index
 * among ties), probs one-hot. */
#include <math.h>
#include <stdlib.h>

#include "gp_hd.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_sample(gp_tensor *out, gp_tensor *probs, const gp_tensor *logits, uint64_t seed, uint64_t offset,
                   double temperature, int64_t top_k, double top_p, double min_p, double lmin);
int gp_cuda_repetition_penalty(gp_tensor *out, const gp_tensor *logits, const gp_tensor *history,
                               const gp_tensor *lens, double penalty);
#ifdef __cplusplus
}
#endif

/* order-preserving 32-bit key of a float (NaN must be replaced first) */
static uint32_t fkey(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* the largest t in [lo, hi] with f(t) >= target, f non-increasing; f(lo) >= target assumed */
typedef double (*gp_keyfn)(const void *ctx, uint32_t t);
static uint32_t bisect(gp_keyfn f, const void *ctx, uint32_t lo, uint32_t hi, double target) {
  while (lo < hi) {
    uint32_t mid = lo + (uint32_t)(((uint64_t)hi - lo + 1) / 2);
    if (f(ctx, mid) >= target) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

typedef struct {
  const float *x;
  const uint32_t *k;
  int64_t v;
  double m, inv_t;
} row_t;

static double count_ge(const void *c, uint32_t t) {
  const row_t *r = c;
  double n = 0;
  for (int64_t j = 0; j < r->v; j++) n += r->k[j] >= t;
  return n;
}
static double mass_ge(const void *c, uint32_t t) {
  const row_t *r = c;
  double s = 0;
  for (int64_t j = 0; j < r->v; j++)
    if (r->k[j] >= t) s += exp(((double)r->x[j] - r->m) * r->inv_t);
  return s;
}

int gp_k_sample(gp_tensor *out, gp_tensor *probs, const gp_tensor *logits, double temperature, double top_k,
                double top_p, double min_p) {
  GP_CHECK(sample, out, probs, logits);
  int64_t n = logits->shape[0], v = logits->shape[1];
  if (!(temperature >= 0 && temperature < INFINITY))
    return gp_error("sample: temperature must be >= 0 (0: greedy), got %g", temperature);
  if (!(top_k >= 0 && top_k == floor(top_k) && top_k <= (double)v))
    return gp_error("sample: top_k must be an integer in [0, V = %lld] (0: off) for logits %s, got %g", (long long)v,
                    GP_SHAPE(logits), top_k);
  if (!(top_p > 0 && top_p <= 1)) return gp_error("sample: top_p must be in (0, 1], got %g", top_p);
  if (!(min_p >= 0 && min_p <= 1)) return gp_error("sample: min_p must be in [0, 1], got %g", min_p);
  if (v == 0 && n > 0) return gp_error("sample: logits %s has no tokens", GP_SHAPE(logits));
  if (v > 16777216) return gp_error("sample: logits %s: at most 2^24 tokens per row", GP_SHAPE(logits));
  uint64_t seed = gp_seed(), offset = gp_rng_reserve((uint64_t)n);
  /* min-p keeps x >= max + temperature * log(min_p): the offset computed once, in double, for both devices */
  double lmin = min_p > 0 ? temperature * log(min_p) : -INFINITY;
  GP_CUDA_DISPATCH(out, gp_cuda_sample(out, probs, logits, seed, offset, temperature, (int64_t)top_k, top_p, min_p, lmin));
  const void *pl = gp_ptr(logits);
  void *pp = gp_ptr(probs);
  int64_t *po = gp_ptr(out);
  float *x = malloc((size_t)(v > 0 ? v : 1) * sizeof(float));
  uint32_t *k = malloc((size_t)(v > 0 ? v : 1) * sizeof(uint32_t));
  if (!x || !k) {
    free(x);
    free(k);
    return gp_error_oom("sample: out of host memory for a row of %lld", (long long)v);
  }
  int rc = GP_OK;
  for (int64_t r = 0; r < n && rc == GP_OK; r++) {
    float m = -INFINITY;
    int64_t am = 0;
    for (int64_t j = 0; j < v; j++) {
      double d = gp_load(pl, logits->dtype, r * v + j);
      x[j] = d == d ? (float)d : -INFINITY;
      k[j] = fkey(x[j]);
      if (x[j] > m) m = x[j], am = j;
    }
    if (!(m > -INFINITY && m < INFINITY)) {
      rc = gp_error("sample: row %lld of logits %s has no finite maximum (%g)", (long long)r, GP_SHAPE(logits), m);
      break;
    }
    if (temperature == 0) {
      for (int64_t j = 0; j < v; j++) gp_store(pp, probs->dtype, r * v + j, j == am ? 1.0 : 0.0);
      po[r] = am;
      continue;
    }
    row_t row = {x, k, v, m, 1.0 / temperature};
    uint32_t hi = fkey(m), tau = 0;
    if (top_k > 0 && top_k < v) tau = bisect(count_ge, &row, 0, hi, top_k);
    if (min_p > 0) {
      uint32_t t = fkey((float)((double)m + lmin));
      if (t > hi) t = hi;
      if (t > tau) tau = t;
    }
    if (top_p < 1) tau = bisect(mass_ge, &row, tau, hi, top_p * mass_ge(&row, tau));
    double s = mass_ge(&row, tau);
    double u = gp_u01(gp_philox(seed, offset + (uint64_t)r / 4).v[r % 4]), thr = u * s, acc = 0;
    int64_t pick = -1, last = -1;
    for (int64_t j = 0; j < v; j++) {
      double w = k[j] >= tau ? exp(((double)x[j] - m) * row.inv_t) : 0;
      gp_store(pp, probs->dtype, r * v + j, w / s);
      if (w > 0) {
        last = j;
        acc += w;
        if (pick < 0 && acc > thr) pick = j;
      }
    }
    po[r] = pick >= 0 ? pick : last >= 0 ? last : am;
  }
  free(x);
  free(k);
  return rc;
}

int gp_k_repetition_penalty(gp_tensor *out, const gp_tensor *logits, const gp_tensor *history, const gp_tensor *lens,
                            double penalty) {
  GP_CHECK(repetition_penalty, out, logits, history, lens);
  int64_t n = logits->shape[0], v = logits->shape[1], l = history->shape[1];
  if (!(penalty > 0 && penalty < INFINITY)) return gp_error("repetition_penalty: penalty must be > 0, got %g", penalty);
  if (out->device == GP_CPU) {
    const int64_t *ph = gp_ptr(history), *pn = gp_ptr(lens);
    for (int64_t r = 0; r < n; r++) {
      if (pn[r] < 0 || pn[r] > l)
        return gp_error("repetition_penalty: lens[%lld] = %lld is outside [0, %lld] (history %s)", (long long)r,
                        (long long)pn[r], (long long)l, GP_SHAPE(history));
      for (int64_t i = 0; i < pn[r]; i++)
        if (ph[r * l + i] < 0 || ph[r * l + i] >= v)
          return gp_error("repetition_penalty: history[%lld, %lld] = %lld is not a token id of logits %s", (long long)r,
                          (long long)i, (long long)ph[r * l + i], GP_SHAPE(logits));
    }
  }
  /* CUDA: ids outside [0, V) are skipped and lens clamped to [0, L] */
  GP_CUDA_DISPATCH(out, gp_cuda_repetition_penalty(out, logits, history, lens, penalty));
  const void *pl = gp_ptr(logits);
  void *po = gp_ptr(out);
  const int64_t *ph = gp_ptr(history), *pn = gp_ptr(lens);
  for (int64_t i = 0; i < n * v; i++) gp_store(po, out->dtype, i, gp_load(pl, logits->dtype, i));
  for (int64_t r = 0; r < n; r++)
    for (int64_t i = 0; i < pn[r]; i++) {
      int64_t id = ph[r * l + i];
      double x = gp_load(pl, logits->dtype, r * v + id);
      gp_store(po, out->dtype, r * v + id, x > 0 ? x / penalty : x * penalty);
    }
  return GP_OK;
}
