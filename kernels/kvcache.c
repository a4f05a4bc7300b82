/* kvcache.c: checks, dispatch and the CPU references of the compressed KV
 * cache kernels (kvquant.h has the codes). */
#include <math.h>

#include "gp_hd.h"
#include "kvquant.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_kv_quant_append(gp_tensor *codes, gp_tensor *scales, const gp_tensor *src, const gp_tensor *center,
                            const gp_tensor *pos, int fmt);
int gp_cuda_kv_dequant(gp_tensor *out, const gp_tensor *codes, const gp_tensor *scales, const gp_tensor *center,
                       int fmt);
#ifdef __cplusplus
}
#endif

/* fmt: 1 (int8) or 2 (fp8 e4m3) */
static int kv_fmt(const char *op, double fmt) {
  if (fmt != GP_KV_INT8 && fmt != GP_KV_FP8)
    return gp_error("%s: fmt must be 1 (int8) or 2 (fp8 e4m3), got %g", op, fmt);
  return GP_OK;
}

/* element d of the row less its center */
static float centered(const void *src, int64_t si, int dtype, const float *center, int64_t d) {
  const float x = (float)gp_load(src, dtype, si + d);
  return center ? x - center[d] : x;
}

void gp_kvq_quant_row(uint8_t *codes, float *scale, const void *src, int64_t si, int dtype, int64_t D,
                      const float *center, int fmt) {
  const float mx = kvq_max(fmt);
  float amax = 0.f;
  for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(centered(src, si, dtype, center, d)));
  const float inv = amax > 0.f ? mx / amax : 0.f;
  *scale = amax / mx;
  for (int64_t d = 0; d < D; d++) codes[d] = kvq_encode(centered(src, si, dtype, center, d) * inv, fmt);
}

int gp_k_kv_quant_append(gp_tensor *codes, gp_tensor *scales, const gp_tensor *src, const gp_tensor *center,
                         const gp_tensor *pos, double fmt) {
  GP_CHECK(kv_quant_append, codes, scales, src, center, pos);
  GP_TRY(kv_fmt("kv_quant_append", fmt));
  int f = (int)fmt;
  int64_t B = src->shape[0], H = src->shape[1], K = src->shape[2], D = src->shape[3], C = codes->shape[2];
  GP_CUDA_DISPATCH(codes, gp_cuda_kv_quant_append(codes, scales, src, center, pos, f));
  int64_t p = gp_load_i64(gp_ptr(pos), pos->dtype, 0);
  if (p < 0 || p + K > C)
    return gp_error("kv_quant_append: position %lld + %lld new entries is outside the cache's %lld positions (codes %s, "
                    "src %s)",
                    (long long)p, (long long)K, (long long)C, GP_SHAPE(codes), GP_SHAPE(src));
  const void *ps = gp_ptr(src);
  uint8_t *pc = gp_ptr(codes);
  float *pscale = gp_ptr(scales);
  const float *pcen = gp_ptr(center);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t k = 0; k < K; k++) {
        int64_t si = b * src->stride[0] + h * src->stride[1] + k * src->stride[2], row = (b * H + h) * C + p + k;
        gp_kvq_quant_row(pc + row * D, pscale + row, ps, si, src->dtype, D, pcen + (b * H + h) * D, f);
      }
  return GP_OK;
}

int gp_k_kv_dequant(gp_tensor *out, const gp_tensor *codes, const gp_tensor *scales, const gp_tensor *center,
                    double fmt) {
  GP_CHECK(kv_dequant, out, codes, scales, center);
  GP_TRY(kv_fmt("kv_dequant", fmt));
  int f = (int)fmt;
  int64_t B = out->shape[0], H = out->shape[1], N = out->shape[2], D = out->shape[3], C = codes->shape[2];
  if (N > C)
    return gp_error("kv_dequant: out %s asks for %lld positions of a cache of %lld (codes %s)", GP_SHAPE(out),
                    (long long)N, (long long)C, GP_SHAPE(codes));
  GP_CUDA_DISPATCH(out, gp_cuda_kv_dequant(out, codes, scales, center, f));
  const uint8_t *pc = gp_ptr(codes);
  const float *pscale = gp_ptr(scales), *pcen = gp_ptr(center);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < N; i++) {
        int64_t row = (b * H + h) * C + i, oi = b * out->stride[0] + h * out->stride[1] + i * out->stride[2];
        for (int64_t d = 0; d < D; d++)
          gp_store(gp_ptr(out), out->dtype, oi + d,
                   (double)(kvq_decode(pc[row * D + d], f) * pscale[row] + pcen[(b * H + h) * D + d]));
      }
  return GP_OK;
}
