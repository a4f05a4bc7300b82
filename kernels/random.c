/* random.c: uniform, normal and integer draws from the Philox generator.
 * Element i of a draw uses counter (offset + i / 4), lane i % 4, so a draw is
 * the same on the CPU and the GPU for the same seed (normals up to float
 * rounding of log, sin and cos). */
#include <math.h>
#include <stdlib.h>

#include "gp_hd.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_random(int kind, gp_tensor *out, uint64_t seed, uint64_t offset, double a, double b);
int gp_cuda_dropout(gp_tensor *out, gp_tensor *mask, const gp_tensor *x, uint64_t seed, uint64_t offset, uint32_t thr,
                    double scale);
int gp_cuda_multinomial(gp_tensor *out, const gp_tensor *probs, uint64_t seed, uint64_t offset, int64_t chunk);
#ifdef __cplusplus
}
#endif

enum { R_UNIFORM, R_NORMAL, R_INT };

static int draw(int kind, gp_tensor *out, double a, double b) {
  int64_t n = gp_numel(out);
  uint64_t seed = gp_seed(), offset = gp_rng_reserve((uint64_t)n);
  GP_CUDA_DISPATCH(out, gp_cuda_random(kind, out, seed, offset, a, b));
  char *p = gp_ptr(out);
  uint64_t range = (uint64_t)(int64_t)(b - a);
  for (int64_t i = 0; i < n; i += 4) {
    gp_u32x4 r = gp_philox(seed, offset + (uint64_t)i / 4);
    for (int l = 0; l < 4 && i + l < n; l++) {
      double v;
      if (kind == R_UNIFORM) {
        v = a + (b - a) * (double)gp_u01(r.v[l]);
      } else if (kind == R_NORMAL) {
        int pr = l & ~1;
        double rad = sqrt(-2.0 * log((double)gp_u01_open(r.v[pr])));
        double th = 6.283185307179586 * (double)gp_u01(r.v[pr + 1]);
        v = a + b * rad * (l & 1 ? sin(th) : cos(th));
      } else {
        gp_store_i64(p, out->dtype, i + l, (int64_t)a + (int64_t)(((uint64_t)r.v[l] * range) >> 32));
        continue;
      }
      gp_store(p, out->dtype, i + l, v);
    }
  }
  return GP_OK;
}

int gp_k_rand_uniform(gp_tensor *out, double lo, double hi) {
  GP_CHECK(rand_uniform, out);
  if (!(lo <= hi)) return gp_error("rand_uniform: lo %g must not exceed hi %g", lo, hi);
  return draw(R_UNIFORM, out, lo, hi);
}

int gp_k_rand_normal(gp_tensor *out, double mean, double std) {
  GP_CHECK(rand_normal, out);
  if (!(std >= 0)) return gp_error("rand_normal: std %g must be >= 0", std);
  return draw(R_NORMAL, out, mean, std);
}

int gp_k_randint(gp_tensor *out, double lo, double hi) {
  GP_CHECK(randint, out);
  if (lo != floor(lo) || hi != floor(hi) || !(lo < hi) || hi - lo > 4294967296.0)
    return gp_error("randint: need integers lo < hi with hi - lo <= 2^32, got [%g, %g)", lo, hi);
  double top = out->dtype == GP_U8 ? 256 : out->dtype == GP_I32 ? 2147483648.0 : out->dtype == GP_I64 ? 9.2e18 : 16777217.0;
  double bot = out->dtype == GP_U8 ? 0 : -top;
  if (lo < bot || hi > top + 1)
    return gp_error("randint: [%g, %g) does not fit in %s", lo, hi, gp_dtype_name(out->dtype));
  return draw(R_INT, out, lo, hi);
}

/* dropout: element i keeps iff its uniform (the one rand_uniform would draw
 * for element i) is >= p; in integers: (bits >> 8) >= ceil(p * 2^24), exact on
 * both devices. */
int gp_k_dropout(gp_tensor *out, gp_tensor *mask, const gp_tensor *x, double p) {
  GP_CHECK(dropout, out, mask, x);
  if (!(p >= 0 && p <= 1)) return gp_error("dropout: p must be in [0, 1], got %g", p);
  int64_t n = gp_numel(out);
  uint64_t seed = gp_seed(), offset = gp_rng_reserve((uint64_t)n);
  uint32_t thr = (uint32_t)ceil(p * 16777216.0);
  double scale = p < 1 ? 1.0 / (1.0 - p) : 0.0;
  GP_CUDA_DISPATCH(out, gp_cuda_dropout(out, mask, x, seed, offset, thr, scale));
  const void *px = gp_ptr(x);
  void *po = gp_ptr(out);
  uint8_t *pm = gp_ptr(mask);
  for (int64_t i = 0; i < n; i += 4) {
    gp_u32x4 r = gp_philox(seed, offset + (uint64_t)i / 4);
    for (int l = 0; l < 4 && i + l < n; l++) {
      int keep = (r.v[l] >> 8) >= thr;
      pm[i + l] = (uint8_t)keep;
      gp_store(po, out->dtype, i + l, keep ? gp_load(px, x->dtype, i + l) * scale : 0.0);
    }
  }
  return GP_OK;
}

/* multinomial: row n draws u, the n-th uniform of the draw. Both devices sum
 * the weights in f32 in the same order (sequential sums of chunks of `chunk`
 * elements, then of the chunk sums), so they agree bit for bit: the pick is
 * the first j whose running sum exceeds u * total. */
static int64_t gp_multinomial_chunk(int64_t v) {
  int64_t c = (v + 4095) / 4096;
  return c < 32 ? 32 : c;
}

int gp_k_multinomial(gp_tensor *out, const gp_tensor *probs) {
  GP_CHECK(multinomial, out, probs);
  int64_t n = probs->shape[0], v = probs->shape[1], ch = gp_multinomial_chunk(v), nc = (v + ch - 1) / ch;
  if (v == 0 && n > 0) return gp_error("multinomial: probs %s has no categories", GP_SHAPE(probs));
  uint64_t seed = gp_seed(), offset = gp_rng_reserve((uint64_t)n);
  GP_CUDA_DISPATCH(out, gp_cuda_multinomial(out, probs, seed, offset, ch));
  const void *pw = gp_ptr(probs);
  int dt = probs->dtype;
  for (int64_t r = 0; r < n; r++) {
    double tot = 0;
    for (int64_t j = 0; j < v; j++) {
      double w = gp_load(pw, dt, r * v + j);
      if (!(w >= 0 && w < INFINITY))
        return gp_error("multinomial: weight %g at row %lld, column %lld of probs %s is not finite and >= 0", w,
                        (long long)r, (long long)j, GP_SHAPE(probs));
      tot += w;
    }
    if (!(tot > 0)) return gp_error("multinomial: row %lld of probs %s has no positive weight", (long long)r, GP_SHAPE(probs));
  }
  float *cs = malloc((size_t)(nc > 0 ? nc : 1) * sizeof(float));
  if (!cs) return gp_error_oom("multinomial: out of host memory");
  int64_t *po = gp_ptr(out);
  for (int64_t r = 0; r < n; r++) {
    const int64_t base = r * v;
    float total = 0;
    for (int64_t c = 0; c < nc; c++) {
      float s = 0;
      for (int64_t j = c * ch; j < v && j < (c + 1) * ch; j++) s += (float)gp_load(pw, dt, base + j);
      cs[c] = s;
      total += s;
    }
    float u = gp_u01(gp_philox(seed, offset + (uint64_t)r / 4).v[r % 4]);
    float thr = u * total, acc = 0;
    int64_t pick = -1, last = -1;
    for (int64_t c = 0; c < nc && pick < 0; c++) {
      if (acc + cs[c] > thr) {
        float a = acc;
        for (int64_t j = c * ch; j < v && j < (c + 1) * ch; j++) {
          a += (float)gp_load(pw, dt, base + j);
          if (a > thr) {
            pick = j;
            break;
          }
        }
      }
      acc += cs[c];
    }
    if (pick < 0)
      for (int64_t j = 0; j < v; j++)
        if (gp_load(pw, dt, base + j) > 0) last = j;
    po[r] = pick >= 0 ? pick : last;
  }
  free(cs);
  return GP_OK;
}
