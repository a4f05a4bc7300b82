/* dequant.cu: GGUF dequantization on the GPU. One thread per 8 consecutive
 * outputs (a group: 4 per 32-element block, 32 per 256-element super-block),
 * grid-stride; consecutive threads write consecutive groups, so the stores of
 * a warp are coalesced, and when out is 16-byte aligned each thread stores
 * its 8 values as 16-byte vectors (two for f32). The block bytes are read
 * one by one: blocks of 18, 22 or 34 bytes are only 2-byte aligned, and a
 * warp's reads of neighbouring blocks fall in the same cache lines anyway.
 * Each group's decode follows ggml's dequantize_row_* (see dequant.c for
 * the layouts) and computes in float with the same roundings as ggml: every
 * scale product is exact, so each value is rounded once. */
#include "../src/cuda_internal.h"

namespace {

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

__device__ __forceinline__ float h16(const uint8_t *p) {
  return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}
__device__ __forceinline__ uint32_t u32le(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ggml's get_scale_min_k4 */
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t *q, int &sc, int &m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <int QT> struct Traits;
template <> struct Traits<Q4_0> { static constexpr int BLOCK = 32, BYTES = 18; };
template <> struct Traits<Q4_1> { static constexpr int BLOCK = 32, BYTES = 20; };
template <> struct Traits<Q5_0> { static constexpr int BLOCK = 32, BYTES = 22; };
template <> struct Traits<Q5_1> { static constexpr int BLOCK = 32, BYTES = 24; };
template <> struct Traits<Q8_0> { static constexpr int BLOCK = 32, BYTES = 34; };
template <> struct Traits<Q4_K> { static constexpr int BLOCK = 256, BYTES = 144; };
template <> struct Traits<Q5_K> { static constexpr int BLOCK = 256, BYTES = 176; };
template <> struct Traits<Q6_K> { static constexpr int BLOCK = 256, BYTES = 210; };

/* elements 8g .. 8g + 7 of block b into v */
template <int QT> __device__ __forceinline__ void decode8(const uint8_t *b, int g, float v[8]) {
  if constexpr (QT == Q4_0 || QT == Q4_1) {
    /* elements 0-15 are the low nibbles of qs[0..15], 16-31 the high ones */
    constexpr int QS = QT == Q4_1 ? 4 : 2;
    const float d = h16(b);
    const uint8_t *q = b + QS + (g & 1) * 8;
    const int sh = (g >> 1) * 4;
    if constexpr (QT == Q4_1) {
      const float m = h16(b + 2);
#pragma unroll
      for (int j = 0; j < 8; j++) v[j] = d * (float)((q[j] >> sh) & 0xF) + m;
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) v[j] = d * (float)(((q[j] >> sh) & 0xF) - 8);
    }
  } else if constexpr (QT == Q5_0 || QT == Q5_1) {
    constexpr int QH = QT == Q5_1 ? 4 : 2;
    const float d = h16(b);
    const uint32_t qh = u32le(b + QH) >> (8 * g); /* element e's fifth bit is bit e */
    const uint8_t *q = b + QH + 4 + (g & 1) * 8;
    const int sh = (g >> 1) * 4;
    if constexpr (QT == Q5_1) {
      const float m = h16(b + 2);
#pragma unroll
      for (int j = 0; j < 8; j++) v[j] = d * (float)(((q[j] >> sh) & 0xF) | (int)((qh >> j) & 1) << 4) + m;
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) v[j] = d * (float)((((q[j] >> sh) & 0xF) | (int)((qh >> j) & 1) << 4) - 16);
    }
  } else if constexpr (QT == Q8_0) {
    const float d = h16(b);
    const int8_t *q = (const int8_t *)(b + 2 + 8 * g);
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = d * (float)q[j];
  } else if constexpr (QT == Q4_K || QT == Q5_K) {
    /* sub-block is = g / 4 of 32: chunk c = is / 2 of 64, nibble h = is % 2; l0 its first byte */
    const int is = g >> 2, c = is >> 1, h = is & 1, l0 = (g & 3) * 8;
    int s, m;
    scale_min_k4(is, b + 4, s, m);
    const float d1 = h16(b) * (float)s, m1 = h16(b + 2) * (float)m;
    constexpr int QS = QT == Q5_K ? 48 : 16;
    const uint8_t *q = b + QS + 32 * c + l0;
    if constexpr (QT == Q5_K) {
      const uint8_t *qh = b + 16 + l0;
#pragma unroll
      for (int j = 0; j < 8; j++)
        v[j] = d1 * (float)(((q[j] >> (4 * h)) & 0xF) | ((qh[j] >> is) & 1) << 4) - m1;
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) v[j] = d1 * (float)((q[j] >> (4 * h)) & 0xF) - m1;
    }
  } else { /* Q6_K */
    /* half n of 128, quarter k of 32, l0 the first of 8 in the quarter */
    const int n = g >> 4, k = (g >> 2) & 3, l0 = (g & 3) * 8;
    const uint8_t *ql = b + 64 * n + 32 * (k & 1) + l0, *qh = b + 128 + 32 * n + l0;
    const int shl = 4 * (k >> 1), shh = 2 * k;
    const float ds = h16(b + 208) * (float)(int8_t)b[192 + 8 * n + l0 / 16 + 2 * k];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = ds * (float)((((ql[j] >> shl) & 0xF) | ((qh[j] >> shh) & 3) << 4) - 32);
  }
}

template <typename T, int V> struct alignas(sizeof(T) * V) vec_t { T v[V]; };

/* VEC: out is 16-byte aligned; 8 outputs are then 16 bytes (bf16, f16) or 32 (f32) */
template <int QT, typename T, bool VEC>
__global__ void k_dequant(T *__restrict__ out, const uint8_t *__restrict__ x, int64_t ngroups) {
  constexpr int GPB = Traits<QT>::BLOCK / 8;
  const int64_t nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < ngroups; t += nth) {
    const int64_t blk = t / GPB;
    const int g = (int)(t - blk * GPB);
    float v[8];
    decode8<QT>(x + blk * Traits<QT>::BYTES, g, v);
    T *o = out + t * 8;
    if constexpr (VEC) {
      constexpr int V = 16 / (int)sizeof(T);
#pragma unroll
      for (int h = 0; h < 8 / V; h++) {
        vec_t<T, V> w;
#pragma unroll
        for (int j = 0; j < V; j++) w.v[j] = st<T>(v[h * V + j]);
        reinterpret_cast<vec_t<T, V> *>(o)[h] = w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) o[j] = st<T>(v[j]);
    }
  }
}

template <int QT, typename T> void launch(gp_tensor *out, const gp_tensor *x) {
  const int64_t ngroups = out->shape[0] * (Traits<QT>::BLOCK / 8);
  T *po = (T *)gp_ptr(out);
  const uint8_t *px = (const uint8_t *)gp_ptr(x);
  const unsigned grid = gp_grid(ngroups, 256);
  if (((uintptr_t)po & 15) == 0) {
    GP_NOTE_LAUNCH((k_dequant<QT, T, true>), 256, 0);
    k_dequant<QT, T, true><<<grid, 256, 0, gp_cuda_stream()>>>(po, px, ngroups);
  } else {
    GP_NOTE_LAUNCH((k_dequant<QT, T, false>), 256, 0);
    k_dequant<QT, T, false><<<grid, 256, 0, gp_cuda_stream()>>>(po, px, ngroups);
  }
}

template <int QT> int launch_type(gp_tensor *out, const gp_tensor *x) {
  GP_FLOAT_SWITCH(out->dtype, T, launch<QT, T>(out, x));
  return GP_OK;
}

} // namespace

extern "C" int gp_cuda_dequant(gp_tensor *out, const gp_tensor *x, int type) {
  if (out->shape[0] == 0) return GP_OK;
  if (!gp_is_float(out->dtype) || out->dtype == GP_F64)
    return gp_error("dequant: out is %s; on the GPU it must be f32, bf16 or f16", gp_dtype_name(out->dtype));
  switch (type) {
    case Q4_0: launch_type<Q4_0>(out, x); break;
    case Q4_1: launch_type<Q4_1>(out, x); break;
    case Q5_0: launch_type<Q5_0>(out, x); break;
    case Q5_1: launch_type<Q5_1>(out, x); break;
    case Q8_0: launch_type<Q8_0>(out, x); break;
    case Q4_K: launch_type<Q4_K>(out, x); break;
    case Q5_K: launch_type<Q5_K>(out, x); break;
    case Q6_K: launch_type<Q6_K>(out, x); break;
    default: return gp_error("dequant: unknown ggml type %d", type);
  }
  return gp_cuda_check_launch("dequant");
}
