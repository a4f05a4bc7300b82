/* random.cu: Philox draws on the GPU; one thread per counter (4 elements). */
#include "../src/cuda_internal.h"

enum { R_UNIFORM, R_NORMAL, R_INT };

template <typename T>
__global__ void k_random(T *o, int64_t n, int kind, uint64_t seed, uint64_t offset, double a, double b, uint64_t range) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  int64_t nc = (n + 3) / 4;
  float af = (float)a, bf = (float)b;
  for (int64_t c = tid; c < nc; c += nth) {
    gp_u32x4 r = gp_philox(seed, offset + (uint64_t)c);
#pragma unroll
    for (int l = 0; l < 4; l++) {
      int64_t i = c * 4 + l;
      if (i >= n) break;
      if (kind == R_UNIFORM) {
        o[i] = st<T>(af + (bf - af) * gp_u01(r.v[l]));
      } else if (kind == R_NORMAL) {
        int pr = l & ~1;
        float rad = sqrtf(-2.0f * logf(gp_u01_open(r.v[pr])));
        float th = 6.2831853071795865f * gp_u01(r.v[pr + 1]);
        o[i] = st<T>(af + bf * rad * ((l & 1) ? sinf(th) : cosf(th)));
      } else {
        o[i] = st<T>((int64_t)a + (int64_t)(((uint64_t)r.v[l] * range) >> 32));
      }
    }
  }
}

extern "C" int gp_cuda_random(int kind, gp_tensor *out, uint64_t seed, uint64_t offset, double a, double b) {
  int64_t n = gp_numel(out);
  if (n == 0) return GP_OK;
  uint64_t range = (uint64_t)(int64_t)(b - a);
  GP_ANY_SWITCH(out->dtype, T, GP_NOTE_LAUNCH(k_random<T>, 256, 0);
                k_random<T><<<gp_grid((n + 3) / 4, 256), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(out), n, kind, seed,
                                                                                      offset, a, b, range));
  return gp_cuda_check_launch("random");
}
