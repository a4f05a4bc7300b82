/* dequant.c: dispatch and CPU reference of the GGUF dequantization kernels.
 *
 * x holds N blocks of one ggml quantized type exactly as the file stores
 * them (row-major u8 (N, bytes a block)); out gets N * block floats in file
 * order. The reference decodes one block at a time the way ggml's
 * dequantize_row_* (ggml-quants.c) do, in double, and stores each value
 * rounded once to the output dtype. Each scale product (fp16 d times a small
 * integer) is exact in float, so the f32 results equal ggml's and the gguf
 * Python package's bit for bit.
 *
 * Block layouts (fp16 and u32 fields little-endian):
 *   Q4_0 (32, 18 bytes): d, qs[16]           x[j] = d (lo(qs[j]) - 8), x[j+16] = d (hi(qs[j]) - 8)
 *   Q4_1 (32, 20): d, m, qs[16]              x = d q + m
 *   Q5_0 (32, 22): d, qh (u32), qs[16]       q = nibble | bit e of qh << 4, x = d (q - 16)
 *   Q5_1 (32, 24): d, m, qh, qs[16]          x = d q + m
 *   Q8_0 (32, 34): d, qs[32] (int8)          x = d q
 *   Q4_K (256, 144): d, dmin, scales[12], qs[128]; 8 sub-blocks of 32 with 6-bit scale sc and min m
 *       packed in scales (get_scale_min_k4); chunk c of 64: lo nibbles of qs[32c..] are sub-block
 *       2c, hi nibbles 2c+1; x = d sc q - dmin m
 *   Q5_K (256, 176): d, dmin, scales[12], qh[32], qs[128]; as Q4_K, bit (2c + h) of qh[l] is q's fifth bit
 *   Q6_K (256, 210): ql[128], qh[64], scales[16] (int8), d; halves of 128: ql[64], qh[32], 8 scales;
 *       quarter k of 32 takes ql[l + 32 (k & 1)] nibble k >> 1 and bits 2k of qh[l], scale
 *       scales[l / 16 + 2k]; x = d sc (q - 32) */
#include "gp_hd.h"

#ifdef __cplusplus
extern "C" {
#endif
/* type: the ggml type id (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K) */
int gp_cuda_dequant(gp_tensor *out, const gp_tensor *x, int type);
#ifdef __cplusplus
}
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static double h16(const uint8_t *p) { return gp_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }
static uint32_t u32le(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) */
static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

/* one block of `type` into y[0 .. block) */
static void block_ref(double *y, const uint8_t *b, int type) {
  switch (type) {
    case Q4_0: {
      double d = h16(b);
      for (int j = 0; j < 16; j++) {
        y[j] = d * ((b[2 + j] & 0xF) - 8);
        y[j + 16] = d * ((b[2 + j] >> 4) - 8);
      }
      break;
    }
    case Q4_1: {
      double d = h16(b), m = h16(b + 2);
      for (int j = 0; j < 16; j++) {
        y[j] = d * (b[4 + j] & 0xF) + m;
        y[j + 16] = d * (b[4 + j] >> 4) + m;
      }
      break;
    }
    case Q5_0: case Q5_1: {
      int has_m = type == Q5_1;
      double d = h16(b), m = has_m ? h16(b + 2) : 0;
      uint32_t qh = u32le(b + 2 + 2 * has_m);
      const uint8_t *qs = b + 6 + 2 * has_m;
      for (int j = 0; j < 16; j++) {
        int q0 = (qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
        int q1 = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = has_m ? d * q0 + m : d * (q0 - 16);
        y[j + 16] = has_m ? d * q1 + m : d * (q1 - 16);
      }
      break;
    }
    case Q8_0: {
      double d = h16(b);
      for (int j = 0; j < 32; j++) y[j] = d * (int8_t)b[2 + j];
      break;
    }
    case Q4_K: case Q5_K: {
      double d = h16(b), dmin = h16(b + 2);
      const uint8_t *sc = b + 4, *qh = b + 16, *qs = type == Q5_K ? b + 48 : b + 16;
      for (int c = 0; c < 4; c++) {
        for (int h = 0; h < 2; h++) {
          int s, m;
          scale_min_k4(2 * c + h, sc, &s, &m);
          for (int l = 0; l < 32; l++) {
            int q = (qs[32 * c + l] >> (4 * h)) & 0xF;
            if (type == Q5_K) q += ((qh[l] >> (2 * c + h)) & 1) << 4;
            y[64 * c + 32 * h + l] = d * s * q - dmin * m;
          }
        }
      }
      break;
    }
    case Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t *sc = (const int8_t *)(b + 192);
      double d = h16(b + 208);
      for (int n = 0; n < 2; n++) {
        for (int l = 0; l < 32; l++) {
          int is = l / 16;
          int q1 = ((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32;
          int q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
          int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
          int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
          y[128 * n + l] = d * sc[is] * q1;
          y[128 * n + l + 32] = d * sc[is + 2] * q2;
          y[128 * n + l + 64] = d * sc[is + 4] * q3;
          y[128 * n + l + 96] = d * sc[is + 6] * q4;
        }
        ql += 64;
        qh += 32;
        sc += 8;
      }
      break;
    }
    default: break;
  }
}

static int dequant(gp_tensor *out, const gp_tensor *x, int type) {
  GP_CUDA_DISPATCH(out, gp_cuda_dequant(out, x, type));
  int64_t n = out->shape[0], block = out->shape[1], bytes = x->shape[1];
  if (n == 0) return GP_OK;
  const uint8_t *px = gp_ptr(x);
  char *po = gp_ptr(out);
  double y[256];
  for (int64_t i = 0; i < n; i++) {
    block_ref(y, px + i * bytes, type);
    for (int64_t j = 0; j < block; j++) gp_store(po, out->dtype, i * block + j, y[j]);
  }
  return GP_OK;
}

#define GP_DEQUANT(name, type)                                \
  int gp_k_##name(gp_tensor *out, const gp_tensor *x) {       \
    GP_CHECK(name, out, x);                                   \
    return dequant(out, x, type);                             \
  }
GP_DEQUANT(dequant_q4_0, Q4_0)
GP_DEQUANT(dequant_q4_1, Q4_1)
GP_DEQUANT(dequant_q5_0, Q5_0)
GP_DEQUANT(dequant_q5_1, Q5_1)
GP_DEQUANT(dequant_q8_0, Q8_0)
GP_DEQUANT(dequant_q4_k, Q4_K)
GP_DEQUANT(dequant_q5_k, Q5_K)
GP_DEQUANT(dequant_q6_k, Q6_K)
