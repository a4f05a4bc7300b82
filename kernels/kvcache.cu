/* kvcache.cu: the compressed KV cache kernels on the GPU. kv_quant_append:
 * one warp per row (b, h, k): the row's max |x - center| by shuffles, then
 * each lane writes its codes; the position is read on the device (a bad one is
 * recorded, nothing written: the error comes at the next synchronization).
 * kv_dequant: one thread per element. */
#include "bad_index.cuh"
#include "kvquant.cuh"

namespace {

struct kq_geo {
  int64_t B, H, K, D, C, s0, s1, s2;
};

template <typename T, typename I, int FMT>
__global__ void __launch_bounds__(256) k_kv_quant_append(uint8_t *codes, float *scales, const T *x, const float *center,
                                                         const I *pos, kq_geo g, gp_bad_ref bad) {
  const int64_t p = (int64_t)pos[0];
  if (p < 0 || p + g.K > g.C) {
    if (blockIdx.x == 0 && threadIdx.x == 0) gp_report_bad(bad, p);
    return;
  }
  const int lane = threadIdx.x & 31;
  const int64_t rows = g.B * g.H * g.K, nw = (int64_t)gridDim.x * (blockDim.x >> 5);
  const float mx = kvq_max(FMT);
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nw) {
    const int64_t k = r % g.K, bh = r / g.K, h = bh % g.H, b = bh / g.H;
    const T *xr = x + b * g.s0 + h * g.s1 + k * g.s2;
    const float *cr = center + bh * g.D;
    float amax = 0.f;
    for (int64_t d = lane; d < g.D; d += 32) amax = fmaxf(amax, fabsf(__fsub_rn(ld(xr[d]), cr[d])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.f ? __fdiv_rn(mx, amax) : 0.f;
    const int64_t row = bh * g.C + p + k;
    if (lane == 0) scales[row] = __fdiv_rn(amax, mx);
    for (int64_t d = lane; d < g.D; d += 32)
      codes[row * g.D + d] = kvq_encode_d<FMT>(__fmul_rn(__fsub_rn(ld(xr[d]), cr[d]), inv));
  }
}

template <typename T, typename I>
void launch_quant(gp_tensor *codes, gp_tensor *scales, const gp_tensor *src, const gp_tensor *center,
                  const gp_tensor *pos, kq_geo g, gp_bad_ref bad, int fmt) {
  const int64_t rows = g.B * g.H * g.K;
  const unsigned grid = gp_grid(rows * 32, 256);
  uint8_t *pc = (uint8_t *)gp_ptr(codes);
  float *ps = (float *)gp_ptr(scales);
  const T *x = (const T *)gp_ptr(src);
  const float *pcen = (const float *)gp_ptr(center);
  const I *pp = (const I *)gp_ptr(pos);
  if (fmt == GP_KV_FP8) {
    GP_NOTE_LAUNCH((k_kv_quant_append<T, I, GP_KV_FP8>), 256, 0);
    k_kv_quant_append<T, I, GP_KV_FP8><<<grid, 256, 0, gp_cuda_stream()>>>(pc, ps, x, pcen, pp, g, bad);
  } else {
    GP_NOTE_LAUNCH((k_kv_quant_append<T, I, GP_KV_INT8>), 256, 0);
    k_kv_quant_append<T, I, GP_KV_INT8><<<grid, 256, 0, gp_cuda_stream()>>>(pc, ps, x, pcen, pp, g, bad);
  }
}

template <typename T, int FMT>
__global__ void k_kv_dequant(T *out, const uint8_t *codes, const float *scales, const float *center, int64_t H,
                             int64_t N, int64_t D, int64_t C, int64_t s0, int64_t s1, int64_t s2, int64_t n) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = tid; e < n; e += nth) {
    const int64_t d = e % D, r = e / D, i = r % N, bh = r / N, h = bh % H, b = bh / H;
    const int64_t row = bh * C + i;
    /* the CPU's product then sum (no fused multiply-add) */
    out[b * s0 + h * s1 + i * s2 + d] =
        st<T>(__fadd_rn(__fmul_rn(kvq_decode_d<FMT>(codes[row * D + d]), scales[row]), center[bh * D + d]));
  }
}

} // namespace

extern "C" int gp_cuda_kv_quant_append(gp_tensor *codes, gp_tensor *scales, const gp_tensor *src,
                                       const gp_tensor *center, const gp_tensor *pos, int fmt) {
  kq_geo g = {src->shape[0], src->shape[1],  src->shape[2],  src->shape[3],
              codes->shape[2], src->stride[0], src->stride[1], src->stride[2]};
  if (g.B * g.H * g.K == 0) return GP_OK;
  gp_bad_ref bad;
  GP_TRY(gp_cuda_bad_ref(&bad, "kv_quant_append", "position", g.C - g.K + 1,
                         "the cache's positions (the capacity left for the new entries)"));
  if (pos->dtype == GP_I32) {
    GP_FLOAT_SWITCH(src->dtype, T, launch_quant<T, int32_t>(codes, scales, src, center, pos, g, bad, fmt));
  } else {
    GP_FLOAT_SWITCH(src->dtype, T, launch_quant<T, int64_t>(codes, scales, src, center, pos, g, bad, fmt));
  }
  return gp_cuda_check_launch("kv_quant_append");
}

extern "C" int gp_cuda_kv_dequant(gp_tensor *out, const gp_tensor *codes, const gp_tensor *scales,
                                  const gp_tensor *center, int fmt) {
  const int64_t B = out->shape[0], H = out->shape[1], N = out->shape[2], D = out->shape[3], C = codes->shape[2];
  const int64_t n = B * H * N * D;
  if (n == 0) return GP_OK;
  const unsigned grid = gp_grid(n, 256);
  const uint8_t *pc = (const uint8_t *)gp_ptr(codes);
  const float *ps = (const float *)gp_ptr(scales), *pcen = (const float *)gp_ptr(center);
  if (fmt == GP_KV_FP8) {
    GP_FLOAT_SWITCH(
        out->dtype, T,
        (k_kv_dequant<T, GP_KV_FP8><<<grid, 256, 0, gp_cuda_stream()>>>(
            (T *)gp_ptr(out), pc, ps, pcen, H, N, D, C, out->stride[0], out->stride[1], out->stride[2], n)));
  } else {
    GP_FLOAT_SWITCH(
        out->dtype, T,
        (k_kv_dequant<T, GP_KV_INT8><<<grid, 256, 0, gp_cuda_stream()>>>(
            (T *)gp_ptr(out), pc, ps, pcen, H, N, D, C, out->stride[0], out->stride[1], out->stride[2], n)));
  }
  return gp_cuda_check_launch("kv_dequant");
}
