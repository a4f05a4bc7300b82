/* kvquant.h: the 8-bit codes of a compressed KV cache (kvcache.def), shared
 * by the CPU references (kvcache.c, attention.c) and, as device functions,
 * by the CUDA kernels (kvquant.cuh mirrors them). A row of D values (one
 * position of one KV head) is stored as D one-byte codes in a u8 tensor and
 * an f32 scale:
 *   fmt 1 (int8): scale = amax / 127, code = round-to-even(x * (127 / amax))
 *                 clamped to [-127, 127], two's complement; x ~ code * scale
 *   fmt 2 (fp8 e4m3): scale = amax / 448, code = e4m3(x * (448 / amax)),
 *                 round to nearest even, saturated to +-448; x ~ e4m3 * scale
 * amax = max |x| over the row (0: every code 0, scale 0). A key row is
 * quantized less its head's center c (x - c per element; an int8
 * gp.KVCache sets c to the mean of the first keys it holds, fp8 to 0):
 * attention scores q . (k - c) of one query differ from q . k by q . c for
 * every key, which softmax drops, so the attention kernels read the codes
 * as they are, and a key is code * scale + c. The differences, products
 * and quotients are single-precision IEEE operations on both devices, so
 * the GPU writes the same bytes as the CPU. */
#ifndef GP_KVQUANT_H
#define GP_KVQUANT_H
#include <math.h>
#include <stdint.h>

enum { GP_KV_INT8 = 1, GP_KV_FP8 = 2 };

#ifdef __CUDACC__
#define GP_KVQ_HD __host__ __device__
#else
#define GP_KVQ_HD
#endif

/* the largest code magnitude of fmt (127 or 448): scale = amax / kvq_max(fmt) */
static inline GP_KVQ_HD float kvq_max(int fmt) { return fmt == GP_KV_FP8 ? 448.f : 127.f; }

/* e4m3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities,
 * 0x7f NaN) of x, rounded to nearest even and saturated to +-448 */
static inline uint8_t kvq_f32_to_e4m3(float x) {
  uint8_t sign = signbit(x) ? 0x80 : 0;
  float a = fabsf(x);
  if (a != a) return 0x7f;
  if (a >= 448.f) return sign | 0x7e; /* the largest finite value (saturated) */
  if (a < 0.015625f) {                /* below 2^-6: subnormals, steps of 2^-9 */
    int m = (int)nearbyintf(a * 512.f); /* 0 .. 8 (8: the smallest normal, code 0x08) */
    return sign | (uint8_t)m;
  }
  int e;
  frexpf(a, &e); /* a = f * 2^e, f in [0.5, 1): a's exponent is e - 1 */
  e -= 1;
  int m = (int)nearbyintf((ldexpf(a, -e) - 1.f) * 8.f); /* 0 .. 8 */
  if (m == 8) {
    m = 0;
    e += 1;
  }
  int code = ((e + 7) << 3) | m;
  if (code > 0x7e) code = 0x7e;
  return sign | (uint8_t)code;
}

static inline float kvq_e4m3_to_f32(uint8_t c) {
  int e = (c >> 3) & 15, m = c & 7;
  float v;
  if (e == 15 && m == 7) v = NAN;
  else if (e == 0) v = ldexpf((float)m, -9);
  else v = ldexpf(1.f + (float)m / 8.f, e - 7);
  return (c & 0x80) ? -v : v;
}

/* the code of y = x * (max / amax) */
static inline uint8_t kvq_encode(float y, int fmt) {
  if (fmt == GP_KV_FP8) return kvq_f32_to_e4m3(y);
  float r = nearbyintf(y);
  if (r > 127.f) r = 127.f;
  if (r < -127.f) r = -127.f;
  return (uint8_t)(int8_t)r;
}

/* the value of a code (before the scale) */
static inline float kvq_decode(uint8_t c, int fmt) {
  return fmt == GP_KV_FP8 ? kvq_e4m3_to_f32(c) : (float)(int8_t)c;
}

#ifndef __CUDACC__
/* the CPU's quantization of one row of D values of dtype at src + si less
 * center[0..D) (NULL: none) (kvcache.c): its codes at codes[0..D), its scale
 * at *scale */
void gp_kvq_quant_row(uint8_t *codes, float *scale, const void *src, int64_t si, int dtype, int64_t D,
                      const float *center, int fmt);
#endif
#endif
