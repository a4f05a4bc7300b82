/* titans.cu: the Titans chunk weights, one block per row: the row is loaded
 * into shared memory (coalesced, as float), one thread runs the serial scan of
 * titans.h there, and the block stores the results. Rows are short (a chunk)
 * and there is one per memory and chunk, so all the chunks of a sequence run
 * in one launch. */
#include "../src/cuda_internal.h"
#include "rows.cuh"
#include "titans.h"

GP_TITANS_SCANS(gp_titans_dev, float, __device__)
GP_TITANS_POINTWISE(gp_titans_dev, float, __device__ __forceinline__)

template <typename T> __device__ void load_row(float *dst, const T *src, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = ld(src[i]);
}
template <typename T> __device__ void store_row(T *dst, const float *src, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = st<T>(src[i]);
}

template <typename T>
__global__ void k_titans_coef(T *w, T *c, T *p, const T *eta, const T *alpha, int64_t L) {
  extern __shared__ float sh[];
  float *e = sh, *a = e + L, *ww = a + L, *cc = ww + L, *bb = cc + L, *pp = bb + L;
  const int64_t r = blockIdx.x;
  load_row(e, eta + r * L, L);
  load_row(a, alpha + r * L, L);
  __syncthreads();
  if (threadIdx.x == 0) gp_titans_dev_coef(L, e, a, ww, cc, bb, pp);
  __syncthreads();
  store_row(w + r * L, ww, L);
  store_row(c + r * L, cc, L);
  store_row(p + r * 3, pp, 3);
}

template <typename T>
__global__ void k_titans_coef_bwd(T *deta, T *dalpha, const T *eta, const T *alpha, const T *w, const T *c,
                                  const T *dw, const T *dc, const T *dp, int64_t L) {
  extern __shared__ float sh[];
  float *e = sh, *a = e + L, *ww = a + L, *cc = ww + L, *gw = cc + L, *gc = gw + L, *de = gc + L, *da = de + L,
        *g3 = da + L, *p3 = g3 + 3;
  const int64_t r = blockIdx.x;
  load_row(e, eta + r * L, L);
  load_row(a, alpha + r * L, L);
  load_row(ww, w + r * L, L);
  load_row(cc, c + r * L, L);
  load_row(gw, dw + r * L, L);
  load_row(gc, dc + r * L, L);
  load_row(g3, dp + r * 3, 3);
  __syncthreads();
  if (threadIdx.x == 0) {
    /* b into da (read at s + 1 before da[s + 1] is written); de is scratch for w and c here, the saved ones are used */
    gp_titans_dev_coef(L, e, a, de, de, da, p3);
    gp_titans_dev_coef_backward(L, e, a, ww, cc, da, gw, gc, g3, de, da);
  }
  __syncthreads();
  store_row(deta + r * L, de, L);
  store_row(dalpha + r * L, da, L);
}

static int smem_ok(const char *op, const void *fn, size_t bytes, int64_t L) {
  if (bytes <= 48 * 1024) return GP_OK;
  int dev = 0, max = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if ((size_t)max < bytes)
    return gp_error("%s: rows of %lld tokens need %zu bytes of shared memory; this GPU has %d (use shorter chunks)", op,
                    (long long)L, bytes, max);
  if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) != cudaSuccess)
    return gp_error("%s: cannot set %zu bytes of dynamic shared memory", op, bytes);
  return GP_OK;
}

extern "C" int gp_cuda_titans_coef(gp_tensor *w, gp_tensor *c, gp_tensor *p, const gp_tensor *eta,
                                   const gp_tensor *alpha) {
  const int64_t N = eta->shape[0], L = eta->shape[1];
  const size_t bytes = sizeof(float) * (size_t)(5 * L + 3);
  const int block = L >= 256 ? 256 : (int)((L + 31) / 32 * 32);
  int rc = GP_OK;
  GP_FLOAT_SWITCH(eta->dtype, T, {
    rc = smem_ok("titans_coef", (const void *)k_titans_coef<T>, bytes, L);
    if (rc == GP_OK) {
      GP_NOTE_LAUNCH(k_titans_coef<T>, block, (int)bytes);
      k_titans_coef<T><<<(unsigned)N, block, bytes, gp_cuda_stream()>>>((T *)gp_ptr(w), (T *)gp_ptr(c), (T *)gp_ptr(p),
                                                                         (const T *)gp_ptr(eta), (const T *)gp_ptr(alpha), L);
    }
  });
  if (rc != GP_OK) return rc;
  return gp_cuda_check_launch("titans_coef");
}

extern "C" int gp_cuda_titans_coef_backward(gp_tensor *deta, gp_tensor *dalpha, const gp_tensor *eta,
                                            const gp_tensor *alpha, const gp_tensor *w, const gp_tensor *c,
                                            const gp_tensor *dw, const gp_tensor *dc, const gp_tensor *dp) {
  const int64_t N = eta->shape[0], L = eta->shape[1];
  const size_t bytes = sizeof(float) * (size_t)(8 * L + 6);
  const int block = L >= 256 ? 256 : (int)((L + 31) / 32 * 32);
  int rc = GP_OK;
  GP_FLOAT_SWITCH(eta->dtype, T, {
    rc = smem_ok("titans_coef_backward", (const void *)k_titans_coef_bwd<T>, bytes, L);
    if (rc == GP_OK) {
      GP_NOTE_LAUNCH(k_titans_coef_bwd<T>, block, (int)bytes);
      k_titans_coef_bwd<T><<<(unsigned)N, block, bytes, gp_cuda_stream()>>>(
          (T *)gp_ptr(deta), (T *)gp_ptr(dalpha), (const T *)gp_ptr(eta), (const T *)gp_ptr(alpha),
          (const T *)gp_ptr(w), (const T *)gp_ptr(c), (const T *)gp_ptr(dw), (const T *)gp_ptr(dc),
          (const T *)gp_ptr(dp), L);
    }
  });
  if (rc != GP_OK) return rc;
  return gp_cuda_check_launch("titans_coef_backward");
}

/* ---- titans_scan: the linear memory over whole sequences ----
 * Row a of the state (M[a, :], S[a, :]) evolves on its own: y[t, a], l[t, a]
 * and the chunk sums' row a read only row a of M. So a block takes RA rows of
 * one memory (D / RA blocks a memory: RA 8 forward; 16 backward, or 8 when 16
 * leaves SMs idle) and runs every chunk in turn, its rows of M and S in
 * shared memory (padded to 64 columns with zeros, rows 68 floats apart so
 * float4 reads of a few rows fall in distinct banks), the chunk's tokens in
 * tiles of 32 (k and q staged, also zero-padded). Forward, per tile: each
 * thread one (token, row) retrieval and l from float4 reads of its rows of M,
 * k and q; then the chunk sums, each thread one column of the sums for every
 * row of the block over a quarter of the tile's tokens (the quarters added in
 * order at the end of the chunk). The backward runs the chunks in reverse
 * from their saved starts in the same blocked way; its sums over the state's
 * rows (dk, dq, dtheta, dw, dc, dp) leave each block as partials that one
 * more kernel adds in a fixed order (deterministic). f32 math whatever the
 * dtype. */
#define TS_R 32
#define TS_RA_F 8  /* state rows a forward block */
#define TS_RA_B 16 /* state rows a backward block (fewer blocks: fewer partials; 8 when few memories) */
#define TS_THREADS 256
#define TS_MAXD 64
#define TS_DP 68 /* floats between rows of a padded tile */

/* the block's state entries (ai, bb) (ai < RA, bb < 64) a thread owns: i = tid + 256 u, u < TS_ENTRIES(RA) */
#define TS_ENTRIES(RA) ((RA)*TS_MAXD / TS_THREADS)

/* a tile of rows [t0, t0 + R) of x (N, T, D) at row stride D into dst (rows TS_DP apart), columns D..63 zero */
template <typename T> __device__ __forceinline__ void ts_load_tile(float *dst, const T *x, int64_t row0, int R, int D) {
  for (int i = threadIdx.x; i < TS_R * TS_MAXD; i += TS_THREADS) {
    const int r = i / TS_MAXD, bb = i % TS_MAXD;
    dst[r * TS_DP + bb] = (r < R && bb < D) ? ld(x[(row0 + r) * D + bb]) : 0.f;
  }
}

/* the block's rows of two states between global memory (row stride D, from
 * row a0 of memory n: x1, x2 already offset) and shared memory (rows TS_DP
 * apart, columns past D and rows past ra zero) */
template <typename T, int RA>
__device__ __forceinline__ void ts_load_state(float *s1, float *s2, const T *x1, const T *x2, int ra, int D) {
#pragma unroll
  for (int u = 0; u < TS_ENTRIES(RA); u++) {
    const int ai = (threadIdx.x + TS_THREADS * u) / TS_MAXD, bb = threadIdx.x % TS_MAXD;
    const bool ok = ai < ra && bb < D;
    s1[ai * TS_DP + bb] = ok ? ld(x1[ai * D + bb]) : 0.f;
    s2[ai * TS_DP + bb] = ok ? ld(x2[ai * D + bb]) : 0.f;
  }
}
template <typename T, int RA>
__device__ __forceinline__ void ts_store_state(T *x1, T *x2, const float *s1, const float *s2, int ra, int D) {
#pragma unroll
  for (int u = 0; u < TS_ENTRIES(RA); u++) {
    const int ai = (threadIdx.x + TS_THREADS * u) / TS_MAXD, bb = threadIdx.x % TS_MAXD;
    if (ai < ra && bb < D) {
      x1[ai * D + bb] = st<T>(s1[ai * TS_DP + bb]);
      x2[ai * D + bb] = st<T>(s2[ai * TS_DP + bb]);
    }
  }
}

template <typename T, int RA>
__global__ void __launch_bounds__(TS_THREADS, 4)
    k_titans_scan(T *y, T *sv, T *Mo, T *So, const T *k, const T *v, const T *q, const T *theta, const T *w, const T *c,
                  const T *p, const T *M0, const T *S0, int64_t Tn, int D, int64_t C, int spl) {
  constexpr int G = TS_THREADS / TS_MAXD; /* token quarters of the chunk sums */
  extern __shared__ __align__(16) float sh[];
  float *Ms = sh, *Ss = Ms + RA * TS_DP, *Ks = Ss + RA * TS_DP, *Qs = Ks + TS_R * TS_DP, *Lw = Qs + TS_R * TS_DP,
        *Lc = Lw + TS_R * RA, *red = Lc + TS_R * RA, *ths = red + 2 * G * RA * TS_MAXD, *ws = ths + TS_R,
        *cs = ws + TS_R;
  const int64_t n = blockIdx.x / spl, DD = (int64_t)D * D, L = Tn / C;
  const int a0 = (int)(blockIdx.x % spl) * RA, ra = min(RA, D - a0), tid = threadIdx.x;
  const int64_t base = n * DD + (int64_t)a0 * D; /* row a0 of memory n's state */
  ts_load_state<T, RA>(Ms, Ss, M0 + base, S0 + base, ra, D);
  const int r1 = tid / RA, a1 = tid % RA;           /* the (token, row) of the retrievals */
  const int g2 = tid / TS_MAXD, b2 = tid % TS_MAXD; /* the quarter and column of the chunk sums */
  for (int64_t j = 0; j < C; j++) {
    const int64_t sj = (n * C + j) * 2 * DD + (int64_t)a0 * D;
    __syncthreads(); /* the last chunk's update is done */
    ts_store_state<T, RA>(sv + sj, sv + sj + DD, Ms, Ss, ra, D);
    float accA[RA], accB[RA];
#pragma unroll
    for (int a = 0; a < RA; a++) accA[a] = accB[a] = 0.f;
    for (int64_t t0 = j * L; t0 < (j + 1) * L; t0 += TS_R) {
      const int R = (int)min((int64_t)TS_R, (j + 1) * L - t0);
      __syncthreads(); /* the last tile's readers are done */
      ts_load_tile(Ks, k, n * Tn + t0, R, D);
      ts_load_tile(Qs, q, n * Tn + t0, R, D);
      if (tid < R) {
        ths[tid] = ld(theta[n * Tn + t0 + tid]);
        ws[tid] = ld(w[n * Tn + t0 + tid]);
        cs[tid] = ld(c[n * Tn + t0 + tid]);
      }
      __syncthreads();
      if (r1 < R) {
        const bool ok = a1 < ra;
        const int64_t o = (n * Tn + t0 + r1) * D + a0 + a1;
        const float vv = ok ? ld(v[o]) : 0.f;
        float yv = 0.f, e = 0.f;
#pragma unroll
        for (int x = 0; x < TS_MAXD; x += 4) {
          const float4 kk = *(const float4 *)(Ks + r1 * TS_DP + x), qq = *(const float4 *)(Qs + r1 * TS_DP + x);
          const float4 mm = *(const float4 *)(Ms + a1 * TS_DP + x);
          e = fmaf(kk.x, mm.x, e);
          e = fmaf(kk.y, mm.y, e);
          e = fmaf(kk.z, mm.z, e);
          e = fmaf(kk.w, mm.w, e);
          yv = fmaf(qq.x, mm.x, yv);
          yv = fmaf(qq.y, mm.y, yv);
          yv = fmaf(qq.z, mm.z, yv);
          yv = fmaf(qq.w, mm.w, yv);
        }
        if (ok) y[o] = st<T>(yv);
        const float l = ok ? -2.f * ths[r1] * (e - vv) : 0.f;
        Lw[r1 * RA + a1] = l * ws[r1];
        Lc[r1 * RA + a1] = l * cs[r1];
      }
      __syncthreads();
      for (int r = g2; r < R; r += G) {
        const float kk = Ks[r * TS_DP + b2];
#pragma unroll
        for (int a = 0; a < RA; a += 4) {
          const float4 lw = *(const float4 *)(Lw + r * RA + a), lc = *(const float4 *)(Lc + r * RA + a);
          accA[a] = fmaf(lw.x, kk, accA[a]);
          accA[a + 1] = fmaf(lw.y, kk, accA[a + 1]);
          accA[a + 2] = fmaf(lw.z, kk, accA[a + 2]);
          accA[a + 3] = fmaf(lw.w, kk, accA[a + 3]);
          accB[a] = fmaf(lc.x, kk, accB[a]);
          accB[a + 1] = fmaf(lc.y, kk, accB[a + 1]);
          accB[a + 2] = fmaf(lc.z, kk, accB[a + 2]);
          accB[a + 3] = fmaf(lc.w, kk, accB[a + 3]);
        }
      }
    }
#pragma unroll
    for (int a = 0; a < RA; a++) {
      red[(g2 * RA + a) * TS_MAXD + b2] = accA[a];
      red[((G + g2) * RA + a) * TS_MAXD + b2] = accB[a];
    }
    const float p1 = ld(p[(n * C + j) * 3]), p2 = ld(p[(n * C + j) * 3 + 1]), p3 = ld(p[(n * C + j) * 3 + 2]);
    __syncthreads(); /* the quarters' sums are in red; every read of Ms in this chunk is done */
#pragma unroll
    for (int u = 0; u < TS_ENTRIES(RA); u++) {
      const int ai = (tid + TS_THREADS * u) / TS_MAXD, bb = tid % TS_MAXD;
      if (ai < ra && bb < D) {
        float sa = 0.f, sb = 0.f;
        for (int g = 0; g < G; g++) {
          sa += red[(g * RA + ai) * TS_MAXD + bb];
          sb += red[((G + g) * RA + ai) * TS_MAXD + bb];
        }
        float *mm = Ms + ai * TS_DP + bb, *s = Ss + ai * TS_DP + bb;
        const float s0 = *s;
        *mm = p2 * *mm + p3 * s0 + sb;
        *s = p1 * s0 + sa;
      }
    }
  }
  __syncthreads();
  ts_store_state<T, RA>(Mo + base, So + base, Ms, Ss, ra, D);
}

/* the sum of v over the block in a fixed order (warps, then warp 0); every thread gets it */
__device__ float ts_block_sum(float v, float *red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < TS_THREADS / 32; i++) s += red[i];
  return s;
}

/* partials (f32, [n][spl][...]): pk, pq (T, D), pth, pw, pc (T), pp (C, 3) */
template <typename T, int RA>
__global__ void __launch_bounds__(TS_THREADS, 2) /* two blocks an SM: at most 128 registers */
    k_titans_scan_bwd(float *pk, float *pq, float *pth, float *pw, float *pc, float *pp, T *dv, T *dM0, T *dS0,
                      const T *k, const T *v, const T *q, const T *theta, const T *w, const T *c, const T *p,
                      const T *sv, const T *dy, const T *dM, const T *dS, int64_t Tn, int D, int64_t C, int spl) {
  constexpr int G = TS_THREADS / TS_MAXD, LP = RA + 1;
  extern __shared__ __align__(16) float sh[];
  float *Ms = sh, *Ss = Ms + RA * TS_DP, *gMs = Ss + RA * TS_DP, *gSs = gMs + RA * TS_DP, *Ks = gSs + RA * TS_DP,
        *Qs = Ks + TS_R * TS_DP, *Lw = Qs + TS_R * TS_DP, *Lc = Lw + TS_R * RA, *Es = Lc + TS_R * RA,
        *Ys = Es + TS_R * RA, *red = Ys + TS_R * RA, *Pw = red + G * RA * TS_MAXD, *Pc = Pw + TS_R * LP,
        *Pt = Pc + TS_R * LP, *ths = Pt + TS_R * LP, *ws = ths + TS_R, *cs = ws + TS_R, *rs = cs + TS_R;
  const int64_t n = blockIdx.x / spl, DD = (int64_t)D * D, L = Tn / C, ns = blockIdx.x; /* ns = n * spl + s */
  const int a0 = (int)(blockIdx.x % spl) * RA, ra = min(RA, D - a0), tid = threadIdx.x, tx = tid & 31, ty = tid >> 5;
  const int64_t base = n * DD + (int64_t)a0 * D;
  ts_load_state<T, RA>(gMs, gSs, dM + base, dS + base, ra, D);
  const int g2 = tid / TS_MAXD, b2 = tid % TS_MAXD; /* the quarter and column of dM's chunk sums */
  for (int64_t j = C - 1; j >= 0; j--) {
    const int64_t sj = (n * C + j) * 2 * DD + (int64_t)a0 * D;
    float g1 = 0.f, gq2 = 0.f, g3 = 0.f;
    __syncthreads(); /* the last chunk's readers of Ms, Ss are done */
#pragma unroll
    for (int u = 0; u < TS_ENTRIES(RA); u++) {
      const int ai = (tid + TS_THREADS * u) / TS_MAXD, bb = tid % TS_MAXD;
      const bool ok = ai < ra && bb < D;
      const int x = ai * TS_DP + bb;
      const float mm = ok ? ld(sv[sj + ai * D + bb]) : 0.f, s = ok ? ld(sv[sj + DD + ai * D + bb]) : 0.f;
      Ms[x] = mm;
      Ss[x] = s;
      g1 = fmaf(gSs[x], s, g1);
      gq2 = fmaf(gMs[x], mm, gq2);
      g3 = fmaf(gMs[x], s, g3);
    }
    g1 = ts_block_sum(g1, rs);
    gq2 = ts_block_sum(gq2, rs + 8);
    g3 = ts_block_sum(g3, rs + 16);
    if (tid == 0) {
      pp[(ns * C + j) * 3] = g1;
      pp[(ns * C + j) * 3 + 1] = gq2;
      pp[(ns * C + j) * 3 + 2] = g3;
    }
    float dm[RA]; /* dM's chunk sum, column b2, tokens of quarter g2 */
#pragma unroll
    for (int a = 0; a < RA; a++) dm[a] = 0.f;
    for (int64_t t0 = j * L; t0 < (j + 1) * L; t0 += TS_R) {
      const int R = (int)min((int64_t)TS_R, (j + 1) * L - t0);
      __syncthreads();
      ts_load_tile(Ks, k, n * Tn + t0, R, D);
      ts_load_tile(Qs, q, n * Tn + t0, R, D);
      for (int i = tid; i < TS_R * RA; i += TS_THREADS) {
        const int r = i / RA, a = i % RA;
        Ys[i] = (r < R && a < ra) ? ld(dy[(n * Tn + t0 + r) * D + a0 + a]) : 0.f;
      }
      if (tid < R) {
        ths[tid] = ld(theta[n * Tn + t0 + tid]);
        ws[tid] = ld(w[n * Tn + t0 + tid]);
        cs[tid] = ld(c[n * Tn + t0 + tid]);
      }
      __syncthreads();
      /* per (token, row): e = M k - v, the adjoints' projections gs = gS k, gm = gM k, then l, dl, dE */
      for (int i = tid; i < TS_R * RA; i += TS_THREADS) {
        const int r = i / RA, a = i % RA;
        float l = 0.f, dE = 0.f, pw_ = 0.f, pc_ = 0.f, pt_ = 0.f;
        if (r < R && a < ra) {
          const int64_t o = (n * Tn + t0 + r) * D + a0 + a;
          float e = -ld(v[o]), gs = 0.f, gm = 0.f;
#pragma unroll
          for (int x = 0; x < TS_MAXD; x += 4) {
            const float4 kk = *(const float4 *)(Ks + r * TS_DP + x), mm = *(const float4 *)(Ms + a * TS_DP + x);
            const float4 ss = *(const float4 *)(gSs + a * TS_DP + x), gg = *(const float4 *)(gMs + a * TS_DP + x);
            e = fmaf(kk.x, mm.x, e);
            e = fmaf(kk.y, mm.y, e);
            e = fmaf(kk.z, mm.z, e);
            e = fmaf(kk.w, mm.w, e);
            gs = fmaf(kk.x, ss.x, gs);
            gs = fmaf(kk.y, ss.y, gs);
            gs = fmaf(kk.z, ss.z, gs);
            gs = fmaf(kk.w, ss.w, gs);
            gm = fmaf(kk.x, gg.x, gm);
            gm = fmaf(kk.y, gg.y, gm);
            gm = fmaf(kk.z, gg.z, gm);
            gm = fmaf(kk.w, gg.w, gm);
          }
          const float th = ths[r], dl = ws[r] * gs + cs[r] * gm;
          l = -2.f * th * e;
          dE = -2.f * th * dl;
          pw_ = l * gs;
          pc_ = l * gm;
          pt_ = -2.f * e * dl;
          dv[o] = st<T>(-dE);
        }
        Lw[i] = l * (r < R ? ws[r] : 0.f);
        Lc[i] = l * (r < R ? cs[r] : 0.f);
        Es[i] = dE;
        Pw[r * LP + a] = pw_;
        Pc[r * LP + a] = pc_;
        Pt[r * LP + a] = pt_;
      }
      __syncthreads();
      if (tid < R) {
        float sw = 0.f, sc = 0.f, s3 = 0.f;
        for (int a = 0; a < ra; a++) {
          sw += Pw[tid * LP + a];
          sc += Pc[tid * LP + a];
          s3 += Pt[tid * LP + a];
        }
        const int64_t o = ns * Tn + t0 + tid;
        pw[o] = sw;
        pc[o] = sc;
        pth[o] = s3;
      }
      /* dk and dq partials: rows ty + 8 u (u < 4), columns tx and tx + 32; four rows at a time of the block's */
      {
        float sk[4][2], sq[4][2];
#pragma unroll
        for (int u = 0; u < 4; u++) sk[u][0] = sk[u][1] = sq[u][0] = sq[u][1] = 0.f;
#pragma unroll
        for (int a = 0; a < RA; a += 4) {
          float cS[4][2], cM[4][2], cX[4][2];
#pragma unroll
          for (int z = 0; z < 4; z++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
              cS[z][h] = gSs[(a + z) * TS_DP + tx + 32 * h];
              cM[z][h] = gMs[(a + z) * TS_DP + tx + 32 * h];
              cX[z][h] = Ms[(a + z) * TS_DP + tx + 32 * h];
            }
#pragma unroll
          for (int u = 0; u < 4; u++) {
            const int r = ty + 8 * u;
            const float4 lw = *(const float4 *)(Lw + r * RA + a), lc = *(const float4 *)(Lc + r * RA + a);
            const float4 de = *(const float4 *)(Es + r * RA + a), yy = *(const float4 *)(Ys + r * RA + a);
            const float LW[4] = {lw.x, lw.y, lw.z, lw.w}, LC[4] = {lc.x, lc.y, lc.z, lc.w};
            const float DE[4] = {de.x, de.y, de.z, de.w}, YY[4] = {yy.x, yy.y, yy.z, yy.w};
#pragma unroll
            for (int z = 0; z < 4; z++)
#pragma unroll
              for (int h = 0; h < 2; h++) {
                sk[u][h] = fmaf(LW[z], cS[z][h], sk[u][h]);
                sk[u][h] = fmaf(LC[z], cM[z][h], sk[u][h]);
                sk[u][h] = fmaf(DE[z], cX[z][h], sk[u][h]);
                sq[u][h] = fmaf(YY[z], cX[z][h], sq[u][h]);
              }
          }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
          const int r = ty + 8 * u;
          if (r < R)
#pragma unroll
            for (int h = 0; h < 2; h++)
              if (tx + 32 * h < D) {
                const int64_t o = (ns * Tn + t0 + r) * D + tx + 32 * h;
                pk[o] = sk[u][h];
                pq[o] = sq[u][h];
              }
        }
      }
      /* dM's sum: column b2, every row of the block, tokens of quarter g2 */
      for (int r = g2; r < R; r += G) {
        const float kk = Ks[r * TS_DP + b2], qq = Qs[r * TS_DP + b2];
#pragma unroll
        for (int a = 0; a < RA; a += 4) {
          const float4 de = *(const float4 *)(Es + r * RA + a), yy = *(const float4 *)(Ys + r * RA + a);
          dm[a] = fmaf(de.x, kk, fmaf(yy.x, qq, dm[a]));
          dm[a + 1] = fmaf(de.y, kk, fmaf(yy.y, qq, dm[a + 1]));
          dm[a + 2] = fmaf(de.z, kk, fmaf(yy.z, qq, dm[a + 2]));
          dm[a + 3] = fmaf(de.w, kk, fmaf(yy.w, qq, dm[a + 3]));
        }
      }
    }
#pragma unroll
    for (int a = 0; a < RA; a++) red[(g2 * RA + a) * TS_MAXD + b2] = dm[a];
    const float p1 = ld(p[(n * C + j) * 3]), p2 = ld(p[(n * C + j) * 3 + 1]), p3 = ld(p[(n * C + j) * 3 + 2]);
    __syncthreads(); /* the quarters' sums are in red; every read of gMs, gSs in this chunk is done */
#pragma unroll
    for (int u = 0; u < TS_ENTRIES(RA); u++) {
      const int ai = (tid + TS_THREADS * u) / TS_MAXD, bb = tid % TS_MAXD;
      if (ai < ra && bb < D) {
        float s = 0.f;
        for (int g = 0; g < G; g++) s += red[(g * RA + ai) * TS_MAXD + bb];
        const int x = ai * TS_DP + bb;
        const float mm = gMs[x];
        gMs[x] = p2 * mm + s;
        gSs[x] = p1 * gSs[x] + p3 * mm;
      }
    }
  }
  __syncthreads();
  ts_store_state<T, RA>(dM0 + base, dS0 + base, gMs, gSs, ra, D);
}

/* the partials of the spl blocks of each memory added in block order */
template <typename T>
__global__ void k_titans_scan_sum(T *dk, T *dq, T *dth, T *dw, T *dc, T *dp, const float *pk, const float *pq,
                                  const float *pth, const float *pw, const float *pc, const float *pp, int64_t N,
                                  int64_t Tn, int D, int64_t C, int spl) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N * Tn * D) {
    const int64_t n = i / (Tn * D), r = i % (Tn * D);
    float sk = 0.f, sq = 0.f;
    for (int s = 0; s < spl; s++) {
      sk += pk[(n * spl + s) * Tn * D + r];
      sq += pq[(n * spl + s) * Tn * D + r];
    }
    dk[i] = st<T>(sk);
    dq[i] = st<T>(sq);
  }
  if (i < N * Tn) {
    const int64_t n = i / Tn, r = i % Tn;
    float a = 0.f, b = 0.f, e = 0.f;
    for (int s = 0; s < spl; s++) {
      a += pth[(n * spl + s) * Tn + r];
      b += pw[(n * spl + s) * Tn + r];
      e += pc[(n * spl + s) * Tn + r];
    }
    dth[i] = st<T>(a);
    dw[i] = st<T>(b);
    dc[i] = st<T>(e);
  }
  if (i < N * C * 3) {
    const int64_t n = i / (C * 3), r = i % (C * 3);
    float a = 0.f;
    for (int s = 0; s < spl; s++) a += pp[(n * spl + s) * C * 3 + r];
    dp[i] = st<T>(a);
  }
}

static int scan_d_ok(const char *op, int64_t D) {
  if (D > TS_MAXD)
    return gp_error(
        "%s: a state of %lld x %lld; the GPU kernel takes head dims up to %d (use more memory heads, or "
        "gp.titans.memory_scan{fused = false})",
        op, (long long)D, (long long)D, TS_MAXD);
  return GP_OK;
}

extern "C" int gp_cuda_titans_scan(gp_tensor *y, gp_tensor *st, gp_tensor *M, gp_tensor *S, const gp_tensor *k,
                                   const gp_tensor *v, const gp_tensor *q, const gp_tensor *theta, const gp_tensor *w,
                                   const gp_tensor *c, const gp_tensor *p, const gp_tensor *M0, const gp_tensor *S0) {
  const int64_t N = k->shape[0], Tn = k->shape[1], D = k->shape[2], C = p->shape[1];
  GP_TRY(scan_d_ok("titans_scan", D));
  const int spl = (int)((D + TS_RA_F - 1) / TS_RA_F);
  const size_t bytes = sizeof(float) * (size_t)(2 * TS_RA_F * TS_DP + 2 * TS_R * TS_DP + 2 * TS_R * TS_RA_F +
                                                2 * (TS_THREADS / TS_MAXD) * TS_RA_F * TS_MAXD + 3 * TS_R);
  int rc = GP_OK;
  GP_FLOAT_SWITCH(k->dtype, T, {
    rc = smem_ok("titans_scan", (const void *)k_titans_scan<T, TS_RA_F>, bytes, Tn);
    if (rc == GP_OK) {
      GP_NOTE_LAUNCH((k_titans_scan<T, TS_RA_F>), TS_THREADS, (int)bytes);
      k_titans_scan<T, TS_RA_F><<<(unsigned)(N * spl), TS_THREADS, bytes, gp_cuda_stream()>>>(
          (T *)gp_ptr(y), (T *)gp_ptr(st), (T *)gp_ptr(M), (T *)gp_ptr(S), (const T *)gp_ptr(k), (const T *)gp_ptr(v),
          (const T *)gp_ptr(q), (const T *)gp_ptr(theta), (const T *)gp_ptr(w), (const T *)gp_ptr(c),
          (const T *)gp_ptr(p), (const T *)gp_ptr(M0), (const T *)gp_ptr(S0), Tn, (int)D, C, spl);
    }
  });
  GP_TRY(rc);
  return gp_cuda_check_launch("titans_scan");
}

extern "C" int gp_cuda_titans_scan_backward(gp_tensor *dk, gp_tensor *dv, gp_tensor *dq, gp_tensor *dtheta,
                                            gp_tensor *dw, gp_tensor *dc, gp_tensor *dp, gp_tensor *dM0, gp_tensor *dS0,
                                            const gp_tensor *k, const gp_tensor *v, const gp_tensor *q,
                                            const gp_tensor *theta, const gp_tensor *w, const gp_tensor *c,
                                            const gp_tensor *p, const gp_tensor *st, const gp_tensor *dy,
                                            const gp_tensor *dM, const gp_tensor *dS) {
  const int64_t N = k->shape[0], Tn = k->shape[1], D = k->shape[2], C = p->shape[1];
  GP_TRY(scan_d_ok("titans_scan_backward", D));
  /* 16 rows a block, or 8 when that leaves SMs idle (more partials to add, but every SM busy) */
  const int RA = N * ((D + TS_RA_B - 1) / TS_RA_B) < gp_cuda_sm_count() ? 8 : TS_RA_B;
  const int spl = (int)((D + RA - 1) / RA);
  const size_t bytes =
      sizeof(float) * (size_t)(4 * RA * TS_DP + 2 * TS_R * TS_DP + 4 * TS_R * RA +
                               (TS_THREADS / TS_MAXD) * RA * TS_MAXD + 3 * TS_R * (RA + 1) + 3 * TS_R + 3 * 8);
  /* partials: k and q (T D each), theta, w, c (T each) per memory and block, p (C 3) */
  const int64_t per = 2 * Tn * D + 3 * Tn + 3 * C, pn = N * spl * per;
  gp_tensor *part = 0;
  GP_TRY(gp_tensor_scratch(&part, GP_F32, GP_CUDA, 1, &pn));
  float *pk = (float *)gp_ptr(part), *pq = pk + N * spl * Tn * D, *pth = pq + N * spl * Tn * D,
        *pw = pth + N * spl * Tn, *pc = pw + N * spl * Tn, *pp = pc + N * spl * Tn;
  int rc = GP_OK;
  GP_FLOAT_SWITCH(k->dtype, T, {
    auto kern = RA == 8 ? k_titans_scan_bwd<T, 8> : k_titans_scan_bwd<T, TS_RA_B>;
    rc = smem_ok("titans_scan_backward", (const void *)kern, bytes, Tn);
    if (rc == GP_OK) {
      GP_NOTE_LAUNCH(kern, TS_THREADS, (int)bytes);
      kern<<<(unsigned)(N * spl), TS_THREADS, bytes, gp_cuda_stream()>>>(
          pk, pq, pth, pw, pc, pp, (T *)gp_ptr(dv), (T *)gp_ptr(dM0), (T *)gp_ptr(dS0), (const T *)gp_ptr(k),
          (const T *)gp_ptr(v), (const T *)gp_ptr(q), (const T *)gp_ptr(theta), (const T *)gp_ptr(w),
          (const T *)gp_ptr(c), (const T *)gp_ptr(p), (const T *)gp_ptr(st), (const T *)gp_ptr(dy),
          (const T *)gp_ptr(dM), (const T *)gp_ptr(dS), Tn, (int)D, C, spl);
      const int64_t tot = N * Tn * D > N * C * 3 ? N * Tn * D : N * C * 3;
      GP_NOTE_LAUNCH(k_titans_scan_sum<T>, 256, 0);
      k_titans_scan_sum<T><<<(unsigned)((tot + 255) / 256), 256, 0, gp_cuda_stream()>>>(
          (T *)gp_ptr(dk), (T *)gp_ptr(dq), (T *)gp_ptr(dtheta), (T *)gp_ptr(dw), (T *)gp_ptr(dc), (T *)gp_ptr(dp), pk,
          pq, pth, pw, pc, pp, N, Tn, (int)D, C, spl);
    }
  });
  gp_tensor_free(part); /* stream-ordered */
  GP_TRY(rc);
  return gp_cuda_check_launch("titans_scan_backward");
}

/* ---- titans_gates: a warp per (batch row, head, chunk); g's tokens are 3 H apart ---- */
struct GatesIdx {
  int64_t bh, o, at; /* the memory (b H + h), its first output of the chunk, g's element (t0, gate 0, h) */
  __device__ bool at_warp(int64_t B, int64_t Tn, int64_t H, int64_t bc) {
    const int64_t nc = Tn / bc, w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= B * H * nc) return false;
    const int64_t j = w % nc;
    bh = w / nc;
    const int64_t h = bh % H, bi = bh / H;
    o = bh * Tn + j * bc;
    at = ((bi * Tn + j * bc) * 3) * H + h;
    return true;
  }
};

/* the chunk's means of gates 1 and 2 (m1, m2), in every lane */
template <typename T> __device__ void gates_means(const T *g, int64_t H, int64_t bc, float &m1, float &m2) {
  float s1 = 0, s2 = 0;
  for (int64_t t = threadIdx.x & 31; t < bc; t += 32) {
    s1 += ld(g[t * 3 * H + H]);
    s2 += ld(g[t * 3 * H + 2 * H]);
  }
  m1 = warp_sum(s1) / (float)bc;
  m2 = warp_sum(s2) / (float)bc;
}

template <typename T>
__global__ void k_titans_gates(T *theta, T *eta, T *alpha, const T *g, int64_t B, int64_t Tn, int64_t H, int64_t bc) {
  GatesIdx x;
  if (!x.at_warp(B, Tn, H, bc)) return;
  g += x.at;
  float m1, m2;
  gates_means(g, H, bc, m1, m2);
  const float n = (float)bc, e = gp_titans_dev_sigmoid(m1), a = gp_titans_dev_alpha(m2, n);
  for (int64_t t = threadIdx.x & 31; t < bc; t += 32) {
    theta[x.o + t] = st<T>(gp_titans_dev_sigmoid(ld(g[t * 3 * H])) / n);
    eta[x.o + t] = st<T>(e);
    alpha[x.o + t] = st<T>(a);
  }
}

template <typename T>
__global__ void k_titans_gates_bwd(T *dg, const T *g, const T *dtheta, const T *deta, const T *dalpha, int64_t B,
                                   int64_t Tn, int64_t H, int64_t bc) {
  GatesIdx x;
  if (!x.at_warp(B, Tn, H, bc)) return;
  g += x.at;
  dg += x.at;
  float m1, m2, s1 = 0, s2 = 0;
  gates_means(g, H, bc, m1, m2);
  for (int64_t t = threadIdx.x & 31; t < bc; t += 32) {
    s1 += ld(deta[x.o + t]);
    s2 += ld(dalpha[x.o + t]);
  }
  /* as the CPU reference: d eta / d m1 = eta (1 - eta), d alpha / d m2 = (1 - alpha) sigmoid(m2) / b, 1 / b a token */
  const float n = (float)bc, e = gp_titans_dev_sigmoid(m1), a = gp_titans_dev_alpha(m2, n);
  const float g1 = warp_sum(s1) * e * (1 - e) / n, g2 = warp_sum(s2) * (1 - a) * gp_titans_dev_sigmoid(m2) / n / n;
  for (int64_t t = threadIdx.x & 31; t < bc; t += 32) {
    const float s = gp_titans_dev_sigmoid(ld(g[t * 3 * H]));
    dg[t * 3 * H] = st<T>(ld(dtheta[x.o + t]) * s * (1 - s) / n);
    dg[t * 3 * H + H] = st<T>(g1);
    dg[t * 3 * H + 2 * H] = st<T>(g2);
  }
}

static unsigned warp_blocks(int64_t warps) { return (unsigned)((warps + 7) / 8); } /* 8 warps a 256-thread block */

extern "C" int gp_cuda_titans_gates(gp_tensor *theta, gp_tensor *eta, gp_tensor *alpha, const gp_tensor *g,
                                    int64_t bc) {
  const int64_t B = g->shape[0], Tn = g->shape[1], H = g->shape[3];
  GP_FLOAT_SWITCH(g->dtype, T, {
    GP_NOTE_LAUNCH(k_titans_gates<T>, 256, 0);
    k_titans_gates<T><<<warp_blocks(B * H * (Tn / bc)), 256, 0, gp_cuda_stream()>>>(
        (T *)gp_ptr(theta), (T *)gp_ptr(eta), (T *)gp_ptr(alpha), (const T *)gp_ptr(g), B, Tn, H, bc);
  });
  return gp_cuda_check_launch("titans_gates");
}

extern "C" int gp_cuda_titans_gates_backward(gp_tensor *dg, const gp_tensor *g, const gp_tensor *dtheta,
                                             const gp_tensor *deta, const gp_tensor *dalpha, int64_t bc) {
  const int64_t B = g->shape[0], Tn = g->shape[1], H = g->shape[3];
  GP_FLOAT_SWITCH(g->dtype, T, {
    GP_NOTE_LAUNCH(k_titans_gates_bwd<T>, 256, 0);
    k_titans_gates_bwd<T><<<warp_blocks(B * H * (Tn / bc)), 256, 0, gp_cuda_stream()>>>(
        (T *)gp_ptr(dg), (const T *)gp_ptr(g), (const T *)gp_ptr(dtheta), (const T *)gp_ptr(deta),
        (const T *)gp_ptr(dalpha), B, Tn, H, bc);
  });
  return gp_cuda_check_launch("titans_gates_backward");
}

/* ---- titans_prep: a warp per row (b, t, h) of D; two passes over the row (the second from L1) ---- */

/* the warp's row: y's row index (b, t, h) and out's (b, h, t); false past the last */
__device__ bool prep_row(int64_t B, int64_t Tn, int64_t H, int64_t &yr, int64_t &orow) {
  yr = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (yr >= B * Tn * H) return false;
  const int64_t h = yr % H, t = (yr / H) % Tn, bi = yr / (H * Tn);
  orow = (bi * H + h) * Tn + t;
  return true;
}

template <typename T>
__global__ void k_titans_prep(T *out, const T *y, int64_t B, int64_t Tn, int64_t H, int64_t D, int norm, float eps) {
  int64_t yr, orow;
  if (!prep_row(B, Tn, H, yr, orow)) return;
  y += yr * D;
  out += orow * D;
  const int lane = threadIdx.x & 31;
  float r = 1, ds;
  if (norm) {
    float ss = 0;
    for (int64_t i = lane; i < D; i += 32) {
      const float s = gp_titans_dev_silu(ld(y[i]), &ds);
      ss += s * s;
    }
    r = rsqrtf(warp_sum(ss) + eps);
  }
  for (int64_t i = lane; i < D; i += 32) out[i] = st<T>(gp_titans_dev_silu(ld(y[i]), &ds) * r);
}

template <typename T>
__global__ void k_titans_prep_bwd(T *dy, const T *y, const T *dout, int64_t B, int64_t Tn, int64_t H, int64_t D,
                                  int norm, float eps) {
  int64_t yr, orow;
  if (!prep_row(B, Tn, H, yr, orow)) return;
  y += yr * D;
  dy += yr * D;
  dout += orow * D;
  const int lane = threadIdx.x & 31;
  float r = 1, dot = 0, ds;
  if (norm) {
    float ss = 0, sg = 0;
    for (int64_t i = lane; i < D; i += 32) {
      const float s = gp_titans_dev_silu(ld(y[i]), &ds);
      ss += s * s;
      sg += s * ld(dout[i]);
    }
    r = rsqrtf(warp_sum(ss) + eps);
    dot = warp_sum(sg) * r; /* sum out_j dout_j */
  }
  for (int64_t i = lane; i < D; i += 32) {
    const float s = gp_titans_dev_silu(ld(y[i]), &ds);
    dy[i] = st<T>(r * (ld(dout[i]) - s * r * dot) * ds);
  }
}

extern "C" int gp_cuda_titans_prep(gp_tensor *out, const gp_tensor *y, int norm, double eps) {
  const int64_t B = y->shape[0], Tn = y->shape[1], H = y->shape[2], D = y->shape[3];
  GP_FLOAT_SWITCH(y->dtype, T, {
    GP_NOTE_LAUNCH(k_titans_prep<T>, 256, 0);
    k_titans_prep<T><<<warp_blocks(B * Tn * H), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(out), (const T *)gp_ptr(y), B,
                                                                              Tn, H, D, norm, (float)eps);
  });
  return gp_cuda_check_launch("titans_prep");
}

extern "C" int gp_cuda_titans_prep_backward(gp_tensor *dy, const gp_tensor *y, const gp_tensor *dout, int norm,
                                            double eps) {
  const int64_t B = y->shape[0], Tn = y->shape[1], H = y->shape[2], D = y->shape[3];
  GP_FLOAT_SWITCH(y->dtype, T, {
    GP_NOTE_LAUNCH(k_titans_prep_bwd<T>, 256, 0);
    k_titans_prep_bwd<T><<<warp_blocks(B * Tn * H), 256, 0, gp_cuda_stream()>>>(
        (T *)gp_ptr(dy), (const T *)gp_ptr(y), (const T *)gp_ptr(dout), B, Tn, H, D, norm, (float)eps);
  });
  return gp_cuda_check_launch("titans_prep_backward");
}
