/* random.c: uniform, normal and integer draws from the Philox generator.
 * Element i of a draw uses counter (offset + i / 4), lane i % 4, so a draw is
 * the same on the CPU and the GPU for the same seed (normals up to float
 * rounding of log, sin and cos). */
#include <math.h>

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_random(int kind, gp_tensor *out, uint64_t seed, uint64_t offset, double a, double b);
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
