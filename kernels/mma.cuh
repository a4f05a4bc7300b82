/* mma.cuh: the warp-level tensor-core product m16n8k16 (mma.sync) with f32
 * accumulators, for bf16 or f16 operands, shared by the few-rows products
 * (kernels/fused.cu) and the NF4 GEMV (kernels/nf4.cu). Fragments, lane (g, t)
 * = (lane / 4, lane % 4): a = A's (row g, cols 2t, 2t + 1), (row g + 8, the
 * same), (row g, cols 2t + 8, 2t + 9), (row g + 8, the same); b = B's (rows
 * 2t, 2t + 1, col g), (rows 2t + 8, 2t + 9, col g); c = C's (row g, cols 2t,
 * 2t + 1), (row g + 8, the same). */
#ifndef GP_MMA_CUH
#define GP_MMA_CUH
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

template <typename T> __device__ __forceinline__ void mma_16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
