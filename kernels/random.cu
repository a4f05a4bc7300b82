/* random.cu: Philox draws on the GPU; one thread per counter (4 elements),
 * stored as one vector when the tensor is aligned for it (four scalar stores
 * 16 bytes apart a thread ran at a quarter of the copy bandwidth). */
#include "../src/cuda_internal.h"
#include "gp_hd.h"

enum { R_UNIFORM, R_NORMAL, R_INT };

template <typename T> struct alignas(sizeof(T) * 4) vec4_t { T v[4]; };

/* the 4 elements of counter r (a normal pair shares its radius and angle) */
template <typename T, int KIND>
__device__ __forceinline__ void draw4(const gp_u32x4 &r, float af, float bf, int64_t ai, uint64_t range, T *v) {
  if constexpr (KIND == R_UNIFORM) {
#pragma unroll
    for (int l = 0; l < 4; l++) v[l] = st<T>(af + (bf - af) * gp_u01(r.v[l]));
  } else if constexpr (KIND == R_NORMAL) {
#pragma unroll
    for (int pr = 0; pr < 4; pr += 2) {
      const float rad = sqrtf(-2.0f * logf(gp_u01_open(r.v[pr])));
      const float th = 6.2831853071795865f * gp_u01(r.v[pr + 1]);
      float sn, cs;
      sincosf(th, &sn, &cs);
      v[pr] = st<T>(af + bf * rad * cs);
      v[pr + 1] = st<T>(af + bf * rad * sn);
    }
  } else {
#pragma unroll
    for (int l = 0; l < 4; l++) v[l] = st<T>(ai + (int64_t)(((uint64_t)r.v[l] * range) >> 32));
  }
}

template <typename T, int KIND, bool VEC>
__global__ void k_random(T *o, int64_t n, uint64_t seed, uint64_t offset, float af, float bf, int64_t ai,
                         uint64_t range, const unsigned long long *rng) {
  gp_rng_resolve(rng, seed, offset);
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  const int64_t nc = (n + 3) / 4;
  for (int64_t c = tid; c < nc; c += nth) {
    vec4_t<T> w;
    draw4<T, KIND>(gp_philox(seed, offset + (uint64_t)c), af, bf, ai, range, w.v);
    if (VEC && c * 4 + 4 <= n) {
      reinterpret_cast<vec4_t<T> *>(o)[c] = w;
    } else {
      for (int l = 0; l < 4 && c * 4 + l < n; l++) o[c * 4 + l] = w.v[l];
    }
  }
}

template <typename T, int KIND>
void launch_random(gp_tensor *out, int64_t n, uint64_t seed, uint64_t offset, double a, double b, uint64_t range) {
  T *o = (T *)gp_ptr(out);
  const unsigned g = gp_grid((n + 3) / 4, 256);
  if ((uintptr_t)o % sizeof(vec4_t<T>) == 0) {
    GP_NOTE_LAUNCH((k_random<T, KIND, true>), 256, 0);
    k_random<T, KIND, true><<<g, 256, 0, gp_cuda_stream()>>>(o, n, seed, offset, (float)a, (float)b, (int64_t)a, range,
                                                             gp_cuda_rng_slot());
  } else {
    GP_NOTE_LAUNCH((k_random<T, KIND, false>), 256, 0);
    k_random<T, KIND, false><<<g, 256, 0, gp_cuda_stream()>>>(o, n, seed, offset, (float)a, (float)b, (int64_t)a, range,
                                                              gp_cuda_rng_slot());
  }
}

extern "C" int gp_cuda_random(int kind, gp_tensor *out, uint64_t seed, uint64_t offset, double a, double b) {
  int64_t n = gp_numel(out);
  if (n == 0) return GP_OK;
  uint64_t range = (uint64_t)(int64_t)(b - a);
  GP_ANY_SWITCH(out->dtype, T, if (kind == R_UNIFORM) launch_random<T, R_UNIFORM>(out, n, seed, offset, a, b, range);
                else if (kind == R_NORMAL) launch_random<T, R_NORMAL>(out, n, seed, offset, a, b, range);
                else launch_random<T, R_INT>(out, n, seed, offset, a, b, range));
  return gp_cuda_check_launch("random");
}

/* VEC: out and x 4-element aligned, the mask 4-byte aligned: a counter's elements move as one vector each */
template <typename T, bool VEC>
__global__ void k_dropout(T *o, uint8_t *m, const T *x, int64_t n, uint64_t seed, uint64_t offset, uint32_t thr,
                          float scale, const unsigned long long *rng) {
  gp_rng_resolve(rng, seed, offset);
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t c = tid; c < (n + 3) / 4; c += nth) {
    const gp_u32x4 r = gp_philox(seed, offset + (uint64_t)c);
    if (VEC && c * 4 + 4 <= n) {
      const vec4_t<T> xv = reinterpret_cast<const vec4_t<T> *>(x)[c];
      vec4_t<T> ov;
      uint32_t mk = 0;
#pragma unroll
      for (int l = 0; l < 4; l++) {
        const bool keep = (r.v[l] >> 8) >= thr;
        mk |= (uint32_t)keep << (8 * l);
        ov.v[l] = st<T>(keep ? ld(xv.v[l]) * scale : 0.f);
      }
      reinterpret_cast<uint32_t *>(m)[c] = mk;
      reinterpret_cast<vec4_t<T> *>(o)[c] = ov;
    } else {
      for (int l = 0; l < 4; l++) {
        const int64_t i = c * 4 + l;
        if (i >= n) break;
        const bool keep = (r.v[l] >> 8) >= thr;
        m[i] = keep;
        o[i] = st<T>(keep ? ld(x[i]) * scale : 0.f);
      }
    }
  }
}

extern "C" int gp_cuda_dropout(gp_tensor *out, gp_tensor *mask, const gp_tensor *x, uint64_t seed, uint64_t offset,
                               uint32_t thr, double scale) {
  int64_t n = gp_numel(out);
  if (n == 0) return GP_OK;
  const unsigned g = gp_grid((n + 3) / 4, 256);
  GP_FLOAT_SWITCH(out->dtype, T, {
    T *o = (T *)gp_ptr(out);
    const T *px = (const T *)gp_ptr(x);
    uint8_t *pm = (uint8_t *)gp_ptr(mask);
    if ((uintptr_t)o % sizeof(vec4_t<T>) == 0 && (uintptr_t)px % sizeof(vec4_t<T>) == 0 && (uintptr_t)pm % 4 == 0)
      k_dropout<T, true>
          <<<g, 256, 0, gp_cuda_stream()>>>(o, pm, px, n, seed, offset, thr, (float)scale, gp_cuda_rng_slot());
    else
      k_dropout<T, false>
          <<<g, 256, 0, gp_cuda_stream()>>>(o, pm, px, n, seed, offset, thr, (float)scale, gp_cuda_rng_slot());
  });
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
