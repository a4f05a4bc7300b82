/* nf4.h: 4-bit NormalFloat (NF4) as bitsandbytes defines it (QLoRA, Dettmers
 * et al. 2023), shared by the CPU reference (nf4.c) and the CUDA kernels
 * (nf4.cu).
 *
 * A weight is cut into blocks of B consecutive values (B a power of two >= 16
 * that divides the row length, 64 by default). absmax = max |w| over the
 * block (f32); each value is scaled to [-1, 1] and mapped to the nearest of
 * the 16 codes below; two codes a byte, element 2j in the high nibble of byte
 * j and 2j + 1 in the low one (bitsandbytes' kQuantizeBlockwise). The value
 * of code c in a block is code[c] * absmax, computed in float
 * (kDequantizeBlockwise), then rounded to the output dtype.
 *
 * Roundings are bitsandbytes' exactly: the scale is the float reciprocal
 * 1.0f / absmax and the scaled value the float product (float)w * scale; the
 * nearest code is found by bitsandbytes' decision tree (dQuantizeNF4), whose
 * thresholds are the midpoints of neighbouring codes rounded to float, a
 * value equal to a threshold going to the lower code. Two cases differ from
 * bitsandbytes, where it produces NaN: an all-zero block (absmax 0) gets the
 * code of 0.0 (bitsandbytes stores code 0, -1.0; both decode to zeros), and a
 * block whose absmax is so small that 1 / absmax overflows (below ~2.9e-39)
 * scales by the float quotient w / absmax instead. */
#ifndef GP_NF4_H
#define GP_NF4_H

#include "gp_hd.h"

/* bitsandbytes' nf4_dequantization_lut: codes 0 .. 15 */
#define GP_NF4_CODES                                                                                           \
  {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,           \
   -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,              \
   0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, \
   1.0f}

/* bitsandbytes' dQuantizeNF4: the code of x (x scaled to [-1, 1]); the
 * number of thresholds x is above, by a binary search. NaN gets code 0 (no
 * comparison holds), as there. The thresholds are bitsandbytes' decimal
 * literals (the midpoints of neighbouring codes, printed to 16-17 digits)
 * rounded to float as C compilers (gcc, nvcc) round them, written in hex so
 * that every compiler reads the same floats: four of them (0.8614784181118011,
 * 0.5016634166240692, 0.1202552504837513, -0.8480964004993439) are nearly
 * halfway between two floats, and going through double first would pick the
 * other one. The rule is then: the nearest code, except that a value equal to
 * a threshold (a midpoint rounded to float, within half an ulp of it) takes
 * the lower code.
 *   0.03979014977812767   0x1.45f5fep-5    -0.045525018125772476 -0x1.74f0e2p-5
 *   0.1202552504837513    0x1.ec90c6p-4    -0.13791173323988914  -0x1.1a7178p-3
 *   0.2035212516784668    0x1.a0cfcp-3     -0.23460740596055984  -0x1.e079d8p-3
 *   0.2920137718319893    0x1.2b05a8p-2    -0.33967943489551544  -0x1.5bd4ecp-2
 *   0.3893125355243683    0x1.8ea7f2p-2    -0.4599952697753906   -0x1.d709p-2
 *   0.5016634166240692    0x1.00da06p-1    -0.6106329262256622   -0x1.38a4ep-1
 *   0.6427869200706482    0x1.491b5ep-1    -0.8480964004993439   -0x1.b239b2p-1
 *   0.8614784181118011    0x1.b913b2p-1 */
GP_HD int gp_nf4_code(float x) {
  if (x > 0x1.45f5fep-5f) {
    if (x > 0x1.8ea7f2p-2f) {
      if (x > 0x1.491b5ep-1f) return x > 0x1.b913b2p-1f ? 15 : 14;
      return x > 0x1.00da06p-1f ? 13 : 12;
    }
    if (x > 0x1.a0cfcp-3f) return x > 0x1.2b05a8p-2f ? 11 : 10;
    return x > 0x1.ec90c6p-4f ? 9 : 8;
  }
  if (x > -0x1.5bd4ecp-2f) {
    if (x > -0x1.1a7178p-3f) return x > -0x1.74f0e2p-5f ? 7 : 6;
    return x > -0x1.e079d8p-3f ? 5 : 4;
  }
  if (x > -0x1.38a4ep-1f) return x > -0x1.d709p-2f ? 3 : 2;
  return x > -0x1.b239b2p-1f ? 1 : 0;
}

/* the scale of a block from its absmax m: *scale multiplies (bitsandbytes'
 * 1.0f / m), or, when that overflows, *divide is set and values are divided
 * by m; m = 0 gives scale 0 (every value maps to the code of 0.0) */
GP_HD void gp_nf4_scale(float m, float *scale, int *divide) {
  *divide = 0;
  if (m == 0.0f) {
    *scale = 0.0f;
    return;
  }
  float s = 1.0f / m;
  if (s - s != 0.0f) *divide = 1; /* inf */
  *scale = s;
}

GP_HD int gp_nf4_quantize1(float w, float m, float scale, int divide) {
  return gp_nf4_code(divide ? w / m : w * scale);
}

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_nf4_quantize(gp_tensor *q, gp_tensor *absmax, const gp_tensor *w);
int gp_cuda_nf4_dequantize(gp_tensor *w, const gp_tensor *q, const gp_tensor *absmax);
int gp_cuda_nf4_gemv(gp_tensor *out, const gp_tensor *x, const gp_tensor *q, const gp_tensor *absmax);
#ifdef __cplusplus
}
#endif

#endif
