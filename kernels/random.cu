/* random.cu: Philox draws on the GPU; one thread per counter (4 elements). */
#include "../src/cuda_internal.h"
#include "gp_hd.h"

enum { R_UNIFORM, R_NORMAL, R_INT };

template <typename T>
__global__ void k_random(T *o, int64_t n, int kind, uint64_t seed, uint64_t offset, double a, double b, uint64_t range,
                         const unsigned long long *rng) {
  gp_rng_resolve(rng, seed, offset);
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
                                                                                      offset, a, b, range,
                                                                                      gp_cuda_rng_slot()));
  return gp_cuda_check_launch("random");
}

template <typename T>
__global__ void k_dropout(T *o, uint8_t *m, const T *x, int64_t n, uint64_t seed, uint64_t offset, uint32_t thr, float scale,
                          const unsigned long long *rng) {
  gp_rng_resolve(rng, seed, offset);
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t c = tid; c < (n + 3) / 4; c += nth) {
    gp_u32x4 r = gp_philox(seed, offset + (uint64_t)c);
#pragma unroll
    for (int l = 0; l < 4; l++) {
      int64_t i = c * 4 + l;
      if (i >= n) break;
      bool keep = (r.v[l] >> 8) >= thr;
      m[i] = keep;
      o[i] = st<T>(keep ? ld(x[i]) * scale : 0.f);
    }
  }
}

extern "C" int gp_cuda_dropout(gp_tensor *out, gp_tensor *mask, const gp_tensor *x, uint64_t seed, uint64_t offset,
                               uint32_t thr, double scale) {
  int64_t n = gp_numel(out);
  if (n == 0) return GP_OK;
  GP_FLOAT_SWITCH(out->dtype, T,
                  k_dropout<T><<<gp_grid((n + 3) / 4, 256), 256, 0, gp_cuda_stream()>>>(
                      (T *)gp_ptr(out), (uint8_t *)gp_ptr(mask), (const T *)gp_ptr(x), n, seed, offset, thr, (float)scale,
                      gp_cuda_rng_slot()));
  return gp_cuda_check_launch("dropout");
}

/* one block per row: chunk sums in parallel (each sequential, as on the CPU),
 * then thread 0 walks the chunk sums and the chosen chunk in order. Explicit
 * _rn operations keep the compiler from contracting them. */
template <typename T>
__global__ void k_multinomial(int64_t *out, const T *w, int64_t v, int64_t ch, uint64_t seed, uint64_t offset,
                              const unsigned long long *rng) {
  gp_rng_resolve(rng, seed, offset);
  extern __shared__ float cs[];
  int64_t r = blockIdx.x, nc = (v + ch - 1) / ch;
  const T *row = w + r * v;
  for (int64_t c = threadIdx.x; c < nc; c += blockDim.x) {
    float s = 0.f;
    for (int64_t j = c * ch; j < v && j < (c + 1) * ch; j++) s = __fadd_rn(s, ld(row[j]));
    cs[c] = s;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  float total = 0.f;
  for (int64_t c = 0; c < nc; c++) total = __fadd_rn(total, cs[c]);
  float u = gp_u01(gp_philox(seed, offset + (uint64_t)r / 4).v[r % 4]);
  float thr = __fmul_rn(u, total), acc = 0.f;
  int64_t pick = -1, last = -1;
  for (int64_t c = 0; c < nc && pick < 0; c++) {
    if (__fadd_rn(acc, cs[c]) > thr) {
      float a = acc;
      for (int64_t j = c * ch; j < v && j < (c + 1) * ch; j++) {
        a = __fadd_rn(a, ld(row[j]));
        if (a > thr) {
          pick = j;
          break;
        }
      }
    }
    acc = __fadd_rn(acc, cs[c]);
  }
  if (pick < 0)
    for (int64_t j = 0; j < v; j++)
      if (ld(row[j]) > 0.f) last = j;
  out[r] = pick >= 0 ? pick : last;
}

extern "C" int gp_cuda_multinomial(gp_tensor *out, const gp_tensor *probs, uint64_t seed, uint64_t offset, int64_t ch) {
  int64_t n = probs->shape[0], v = probs->shape[1];
  if (n == 0) return GP_OK;
  if (n > 2147483647) return gp_error("multinomial: %lld rows is more than one launch handles", (long long)n);
  size_t bytes = (size_t)((v + ch - 1) / ch) * sizeof(float);
  GP_FLOAT_SWITCH(probs->dtype, T,
                  k_multinomial<T><<<(unsigned)n, 128, bytes, gp_cuda_stream()>>>((int64_t *)gp_ptr(out),
                                                                                 (const T *)gp_ptr(probs), v, ch, seed,
                                                                                 offset, gp_cuda_rng_slot()));
  return gp_cuda_check_launch("multinomial");
}
