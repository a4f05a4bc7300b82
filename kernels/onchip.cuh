/* onchip.cuh: rows held in shared memory, read from global memory once.
 * A persistent block keeps its row (or a pair of rows: the distillation
 * loss's student and teacher) in shared memory as 16-byte slots, [k][thread]:
 * thread i loads (cp.async), reduces and differentiates the same slots, so
 * nothing but the reductions needs a barrier. The kernel reduces the slots
 * as they arrive (cp_wait), writes the gradient from shared memory, and
 * refills each slot with the next row's once its gradient is written, so the
 * next row streams in while this one is finished: 3 row-sizes moved for a
 * forward + backward pass (x and y read, dx written) instead of 5 when the
 * rows are read twice. Used by kernels/distill.cu and kernels/loss.cu. */
#ifndef GP_ONCHIP_CUH
#define GP_ONCHIP_CUH
#include <stdint.h>

#include "../src/cuda_internal.h"

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void cp16(void *dst, const void *src) {
  unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* wait until at most n of this thread's groups are pending (n < 32) */
__device__ __forceinline__ void cp_wait(int n) {
#define GP_W(k)                                                                                                     \
  case k: asm volatile("cp.async.wait_group " #k ";\n" ::: "memory"); break;
  switch (n) {
    GP_W(1) GP_W(2) GP_W(3) GP_W(4) GP_W(5) GP_W(6) GP_W(7) GP_W(8) GP_W(9) GP_W(10) GP_W(11) GP_W(12) GP_W(13)
    GP_W(14) GP_W(15) GP_W(16) GP_W(17) GP_W(18) GP_W(19) GP_W(20) GP_W(21) GP_W(22) GP_W(23) GP_W(24) GP_W(25)
    GP_W(26) GP_W(27) GP_W(28) GP_W(29) GP_W(30) GP_W(31)
  default: asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
#undef GP_W
}

/* running max m, sum of exp(x - m) z, and sum of exp(x - m) * d w */
struct Acc {
  float m, z, w;
};

/* acc (m, z, w) += 2^(x[e] - m) and 2^(x[e] - m) d[e] over W values (log2
 * units; d[e] clamped below so that a zero probability adds 0, not 0 * -inf) */
template <int W, bool D> __device__ __forceinline__ void acc_add2(Acc &a, const float *x, const float *d) {
  float mx = x[0];
#pragma unroll
  for (int e = 1; e < W; e++) mx = fmaxf(mx, x[e]);
  const float mn = fmaxf(a.m, mx);
  if (mn == -INFINITY) return; /* zero probabilities add nothing */
  const float r = ex2(a.m - mn);
  float z = a.z * r, w = a.w * r;
#pragma unroll
  for (int e = 0; e < W; e++) {
    const float p = ex2(x[e] - mn);
    z += p;
    if (D) w = fmaf(p, fmaxf(d[e], -3.4e38f), w);
  }
  a = Acc{mn, z, w};
}

/* z += 2^(x[e] k - r) over W values (log2 units), r this thread's first max (-inf until a vector has a value
 * above -inf), f(e, term) for each term: no max and no rescale a vector, for kernels bound by their instructions.
 * The terms stay below 2^64 while no value is 64 / k above r; past that the caller sums again against the true
 * max (acc_add2) */
template <int W, typename F>
__device__ __forceinline__ void ref_add(float &r, float &z, const float (&x)[W], float k, F f) {
  if (r == -INFINITY) {
    float mx = x[0];
#pragma unroll
    for (int e = 1; e < W; e++) mx = fmaxf(mx, x[e]);
    r = mx * k;
    if (r == -INFINITY) return; /* zero probabilities add nothing */
  }
#pragma unroll
  for (int e = 0; e < W; e++) {
    const float p = ex2(fmaf(x[e], k, -r));
    z += p;
    f(e, p);
  }
}

/* a 16-byte vector of T from W = 16 / sizeof(T) floats (pairs rounded by one instruction in 16 bits) */
template <typename T, int W> __device__ __forceinline__ uint4 st_vec(const float (&q)[W]) {
  static_assert(W * sizeof(T) == 16, "a 16-byte vector");
  uint4 r;
  uint32_t *w = reinterpret_cast<uint32_t *>(&r);
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int l = 0; l < 4; l++) w[l] = __float_as_uint(q[l]);
  } else {
#pragma unroll
    for (int l = 0; l < 4; l++) {
      if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(q[2 * l], q[2 * l + 1]);
        w[l] = *reinterpret_cast<const uint32_t *>(&h);
      } else {
        const __half2 h = __floats2half2_rn(q[2 * l], q[2 * l + 1]);
        w[l] = *reinterpret_cast<const uint32_t *>(&h);
      }
    }
  }
  return r;
}

/* a row's 16-byte slots in shared memory, [k][thread] (TWO: two rows read
 * together, the second's slots after the first's: the student's and the
 * teacher's) */
template <typename T, bool TWO> struct RowSlots {
  uint4 *sx, *sy;
  int nt, nk;
  int64_t nvec;
  /* this thread's slot k of a row of n vectors: one commit group a slot index, empty or not, so that the counts
   * agree */
  __device__ __forceinline__ void load(const T *x, const T *y, int k, int64_t n) const {
    const int64_t j = (int64_t)k * nt + threadIdx.x;
    if (j < n) {
      cp16(sx + k * nt + threadIdx.x, reinterpret_cast<const uint4 *>(x) + j);
      if (TWO) cp16(sy + k * nt + threadIdx.x, reinterpret_cast<const uint4 *>(y) + j);
    }
    cp_commit();
  }
  __device__ __forceinline__ void load(const T *x, const T *y, int k) const { load(x, y, k, nvec); }
  /* o[j] = g(j, x[j], y[j]) from shared memory over this thread's slots (streaming stores; y[j] is x[j] for one
   * row), each slot then refilled with the next row's nn vectors (none when 0). PART: only elements [lo, hi) of
   * the vectors are the row's (a row that starts off a 16-byte boundary: the vectors at its ends are written an
   * element at a time, the neighbours' elements left as they are) */
  template <bool PART, typename G>
  __device__ __forceinline__ void backward(T *o, const T *nx, const T *ny, int64_t nn, int lo, int hi, G g) const {
    backward_v<PART>(o, nx, ny, nn, lo, hi, [&](int64_t j, const uint4 &us, const uint4 &ut) {
      constexpr int W = 16 / sizeof(T);
      const T *es = reinterpret_cast<const T *>(&us), *et = reinterpret_cast<const T *>(&ut);
      uint4 r;
      T *d = reinterpret_cast<T *>(&r);
#pragma unroll
      for (int e = 0; e < W; e++) d[e] = st<T>(g((int)(j * W) + e, ld(es[e]), ld(et[e])));
      return r;
    });
  }
  /* the same with gv(j, x's vector j, y's) giving o's vector j */
  template <bool PART, typename GV>
  __device__ __forceinline__ void backward_v(T *o, const T *nx, const T *ny, int64_t nn, int lo, int hi, GV gv) const {
    constexpr int W = 16 / sizeof(T);
    for (int k = 0; k < nk; k++) {
      const int64_t j = (int64_t)k * nt + threadIdx.x;
      if (j < nvec) {
        const uint4 us = sx[k * nt + threadIdx.x], ut = TWO ? sy[k * nt + threadIdx.x] : us;
        uint4 r = gv(j, us, ut);
        const T *d = reinterpret_cast<const T *>(&r);
        const int c0 = (int)(j * W);
        if (!PART || (c0 >= lo && c0 + W <= hi)) __stcs(reinterpret_cast<uint4 *>(o) + j, r);
        else
#pragma unroll
          for (int e = 0; e < W; e++)
            if (c0 + e >= lo && c0 + e < hi) o[c0 + e] = d[e];
      }
      if (nn) load(nx, ny, k, nn);
    }
  }
  template <typename G> __device__ __forceinline__ void backward(T *o, const T *nx, const T *ny, bool more, G g) const {
    backward<false>(o, nx, ny, more ? nvec : 0, 0, 0, g);
  }
};


/* the blocks of the on-chip kernel fn (nt threads, smem bytes of dynamic
 * shared memory, clusters of C blocks) resident on the whole GPU at once: a
 * multiple of C; 0 when they do not fit (the caller falls back to a streaming
 * kernel). The answers are kept by device and smem in the caller's cache (one
 * a kernel instance: the occupancy queries cost more than a small launch). */
struct OnchipCache {
  int lim[8]; /* by device: 0 unknown, -1 refused, else the opt-in limit set on fn, less room for static arrays */
  struct {
    size_t smem;
    int64_t slots;
  } e[8][4];      /* by device: the last 4 sizes asked */
  int ne[8], nx[8]; /* by device: entries filled, the next to replace */
};
template <typename F> static int64_t onchip_slots(F fn, int nt, size_t smem, int C, OnchipCache &c) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 8) dev = 0;
  for (int i = 0; i < c.ne[dev]; i++)
    if (c.e[dev][i].smem == smem) return c.e[dev][i].slots;
  int &l = c.lim[dev];
  if (l == 0) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) optin = 0;
    l = optin > 4096 && cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - 4096) ==
                            cudaSuccess
            ? optin - 4096
            : -1;
    cudaGetLastError();
  }
  int nb = 0;
  int64_t slots = 0;
  if (l >= 0 && smem <= (size_t)l && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, nt, smem) == cudaSuccess)
    slots = (gp_cuda_sm_count() > 0 ? gp_cuda_sm_count() : 1) * (int64_t)nb;
  if (slots > 0 && C > 1) { /* how many clusters fit at once (not every SM of a GPC may hold one) */
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = C;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(nt);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3((unsigned)(slots / C * C));
    int ncl = 0;
    slots = cudaOccupancyMaxActiveClusters(&ncl, fn, &cfg) == cudaSuccess ? (int64_t)ncl * C : 0;
  }
  cudaGetLastError();
  c.e[dev][c.nx[dev]] = {smem, slots};
  c.nx[dev] = (c.nx[dev] + 1) % 4;
  if (c.ne[dev] < 4) c.ne[dev]++;
  return slots;
}
#endif
