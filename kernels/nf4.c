/* nf4.c: dispatch and CPU reference of the NF4 kernels (codes and roundings
 * in nf4.h).
 *
 * The quantizer computes in float exactly as bitsandbytes does (the codes are
 * then equal bit for bit on the CPU and the GPU, and to bitsandbytes'); the
 * dequantizer forms code * absmax, a product of two floats, exactly in double
 * and rounds it once to the output dtype (for f32 the float product; for bf16
 * and f16 the float product rounded again, as bitsandbytes does). The GEMV
 * accumulates x * code * absmax in double, the weights unrounded. */
#include <math.h>

#include "nf4.h"

static const float NF4[16] = GP_NF4_CODES;

/* B = 2H a power of two >= 16 */
static int check_block(const char *op, int64_t B, int64_t H) {
  if (B != 2 * H || B < 16 || (B & (B - 1)) != 0)
    return gp_error("%s: blocks of %lld values and %lld bytes; the block must be a power of two >= 16 values, "
                    "two a byte", op, (long long)B, (long long)H);
  return GP_OK;
}

int gp_k_nf4_quantize(gp_tensor *q, gp_tensor *absmax, const gp_tensor *w) {
  GP_CHECK(nf4_quantize, q, absmax, w);
  int64_t n = w->shape[0], B = w->shape[1];
  GP_TRY(check_block("nf4_quantize", B, q->shape[1]));
  if (n == 0) return GP_OK;
  GP_CUDA_DISPATCH(q, gp_cuda_nf4_quantize(q, absmax, w));
  const char *pw = gp_ptr(w);
  uint8_t *pq = gp_ptr(q);
  float *pa = gp_ptr(absmax);
  for (int64_t b = 0; b < n; b++) {
    float m = 0.0f;
    for (int64_t i = 0; i < B; i++) {
      float a = fabsf((float)gp_load(pw, w->dtype, b * B + i));
      if (a > m) m = a;
    }
    float scale;
    int divide;
    gp_nf4_scale(m, &scale, &divide);
    pa[b] = m;
    for (int64_t j = 0; j < B / 2; j++) {
      int hi = gp_nf4_quantize1((float)gp_load(pw, w->dtype, b * B + 2 * j), m, scale, divide);
      int lo = gp_nf4_quantize1((float)gp_load(pw, w->dtype, b * B + 2 * j + 1), m, scale, divide);
      pq[b * (B / 2) + j] = (uint8_t)(hi << 4 | lo);
    }
  }
  return GP_OK;
}

int gp_k_nf4_dequantize(gp_tensor *w, const gp_tensor *q, const gp_tensor *absmax) {
  GP_CHECK(nf4_dequantize, w, q, absmax);
  int64_t n = w->shape[0], B = w->shape[1];
  GP_TRY(check_block("nf4_dequantize", B, q->shape[1]));
  if (n == 0) return GP_OK;
  GP_CUDA_DISPATCH(w, gp_cuda_nf4_dequantize(w, q, absmax));
  const uint8_t *pq = gp_ptr(q);
  const float *pa = gp_ptr(absmax);
  char *pw = gp_ptr(w);
  for (int64_t b = 0; b < n; b++) {
    double m = pa[b];
    for (int64_t j = 0; j < B / 2; j++) {
      uint8_t v = pq[b * (B / 2) + j];
      gp_store(pw, w->dtype, b * B + 2 * j, (double)NF4[v >> 4] * m);
      gp_store(pw, w->dtype, b * B + 2 * j + 1, (double)NF4[v & 15] * m);
    }
  }
  return GP_OK;
}

int gp_k_nf4_gemv(gp_tensor *out, const gp_tensor *x, const gp_tensor *q, const gp_tensor *absmax) {
  GP_CHECK(nf4_gemv, out, x, q, absmax);
  int64_t M = x->shape[0], K = x->shape[1], N = q->shape[0], G = absmax->shape[1];
  char b1[96], b2[96], b3[96];
  if (K != 2 * q->shape[1] || G < 1 || K % G != 0)
    return gp_error("nf4_gemv: x is %s, q %s and absmax %s; needed: q (N, K/2) and absmax (N, K/B) for x (M, K)",
                    gp_shape_str(x, b1, sizeof b1), gp_shape_str(q, b2, sizeof b2), gp_shape_str(absmax, b3, sizeof b3));
  int64_t B = K / G;
  GP_TRY(check_block("nf4_gemv", B, B / 2));
  if (M == 0 || N == 0) return GP_OK;
  GP_CUDA_DISPATCH(out, gp_cuda_nf4_gemv(out, x, q, absmax));
  const uint8_t *pq = gp_ptr(q);
  const float *pa = gp_ptr(absmax);
  const char *px = gp_ptr(x);
  char *po = gp_ptr(out);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t n = 0; n < N; n++) {
      const uint8_t *row = pq + n * (K / 2);
      double s = 0;
      for (int64_t k = 0; k < K; k++) {
        uint8_t v = row[k / 2];
        int c = k % 2 ? v & 15 : v >> 4;
        s += gp_load(px, x->dtype, m * K + k) * ((double)NF4[c] * pa[n * G + k / B]);
      }
      gp_store(po, out->dtype, m * N + n, s);
    }
  }
  return GP_OK;
}
