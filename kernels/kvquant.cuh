/* kvquant.cuh: the compressed KV cache's codes on the GPU (kvquant.h says
 * what they are; these write and read the same bytes). */
#ifndef GP_KVQUANT_CUH
#define GP_KVQUANT_CUH
#include <cuda_fp8.h>

#include "../src/cuda_internal.h"
#include "kvquant.h"

/* the code of y = x * (max / amax): int8 rounded to nearest even, clamped to
 * +-127; e4m3 rounded to nearest even, saturated to +-448 */
template <int FMT> __device__ __forceinline__ uint8_t kvq_encode_d(float y) {
  if constexpr (FMT == GP_KV_FP8) {
    return (uint8_t)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
  } else {
    const int r = __float2int_rn(y);
    return (uint8_t)(int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
  }
}

/* the value of a code (before the scale) */
template <int FMT> __device__ __forceinline__ float kvq_decode_d(uint8_t c) {
  if constexpr (FMT == GP_KV_FP8) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3)));
  } else {
    return (float)(int8_t)c;
  }
}
#endif
