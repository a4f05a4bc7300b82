/* data.cu: windows on the GPU. One thread per output element (grid-stride),
 * raw element bits moved (dtype-agnostic); starts are wrapped into [0, N), so
 * every read is inside src and nothing is read back to the host. */
#include "../src/cuda_internal.h"

template <typename U, typename I>
__global__ void k_windows(U *o, const U *x, const I *start, int64_t B, int64_t S, int64_t N) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = tid; e < B * S; e += nth) {
    int64_t b = e / S, s = e - b * S;
    int64_t r = ((int64_t)start[b] % N + N) % N;
    int64_t i = r + s % N;
    if (i >= N) i -= N;
    o[e] = x[i];
  }
}

template <typename U> static void launch_windows(gp_tensor *out, const gp_tensor *src, const gp_tensor *start) {
  int64_t B = out->shape[0], S = out->shape[1], N = src->shape[0];
  unsigned g = gp_grid(B * S, 256);
  if (start->dtype == GP_I32) {
    GP_NOTE_LAUNCH((k_windows<U, int32_t>), 256, 0);
    k_windows<U, int32_t><<<g, 256, 0, gp_cuda_stream()>>>((U *)gp_ptr(out), (const U *)gp_ptr(src),
                                                             (const int32_t *)gp_ptr(start), B, S, N);
  } else {
    GP_NOTE_LAUNCH((k_windows<U, int64_t>), 256, 0);
    k_windows<U, int64_t><<<g, 256, 0, gp_cuda_stream()>>>((U *)gp_ptr(out), (const U *)gp_ptr(src),
                                                             (const int64_t *)gp_ptr(start), B, S, N);
  }
}

extern "C" int gp_cuda_windows(gp_tensor *out, const gp_tensor *src, const gp_tensor *start) {
  if (out->shape[0] * out->shape[1] == 0) return GP_OK;
  switch (gp_elsize(out->dtype)) {
    case 1: launch_windows<uint8_t>(out, src, start); break;
    case 2: launch_windows<uint16_t>(out, src, start); break;
    case 4: launch_windows<uint32_t>(out, src, start); break;
    default: launch_windows<unsigned long long>(out, src, start); break;
  }
  return gp_cuda_check_launch("windows");
}
