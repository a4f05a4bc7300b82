/* nf4.cu: NF4 quantization, dequantization and the fused dequant-GEMV on the
 * GPU (codes and roundings in nf4.h; the CPU reference in nf4.c).
 *
 * quantize: one warp a block of B values (absmax by a warp max; codes by
 * bitsandbytes' float arithmetic, so they equal the CPU's bit for bit).
 * dequantize: one thread per 16 values (8 bytes of q, one absmax: B >= 16),
 * 8-byte loads and 16-byte stores when aligned; the 16 codes in shared memory.
 *
 * gemv: out (M, N) = x (M, K) @ W^T for few rows M, reading the packed weight
 * once. Layout of the work:
 *   - a segment is 256 columns of 4 rows; a warp covers one: lane = 8 r + j
 *     takes row r (0..3) and the 32 columns 32 j .. 32 j + 31 of the segment,
 *     i.e. one 16-byte load of q (8 lanes read a row's 128 contiguous bytes,
 *     a warp 4 full lines); its absmax (one or, for B = 16, two floats);
 *   - a CUDA block (8 warps) takes rows [R bx, R bx + R) (R = 32 rounds: each
 *     warp loops over `rounds` groups of 4 rows) and the segments of split
 *     by: its slice of x (M rows, sps segments) is staged in shared memory
 *     once, as floats, in a swizzled order: float4 i (columns 4i .. 4i + 3)
 *     of chunk j goes to slot 8 j + (i ^ j), so that the 8 chunks a warp reads
 *     at once fall in 8 different bank groups and the 4 rows of a warp share
 *     (broadcast) each read: one shared-memory wavefront per 8 float4s;
 *   - each lane decodes its 32 codes with a 16-float table in shared memory
 *     (16 distinct words in 16 banks: no conflicts), sums code * x over each
 *     half of 16 for every row m of x, and multiplies by the half's absmax
 *     once; the 8 lanes of a row add their sums by shuffles;
 *   - with one split (by = 1) the block writes out; with S splits each writes
 *     f32 partial sums to a scratch (S, M, N) and a second kernel adds them in
 *     order (deterministic) and rounds to out's dtype.
 * Bytes moved: N K / 2 (q) + 4 N K / B (absmax) + M K e (x) + M N e (out), e
 * the size of x's dtype (+ 8 S M N for the partial sums when S > 1).
 * x is processed in tiles of at most 32 rows (one launch each). */
#include "../src/cuda_internal.h"
#include "mma.cuh"
#include "nf4.h"

namespace {

__constant__ float c_nf4[16] = GP_NF4_CODES;

template <typename T, int V> struct alignas(sizeof(T) * V) vec_t { T v[V]; };

/* ---- quantize ---- */

template <typename T>
__global__ void k_nf4_quantize(uint8_t *__restrict__ q, float *__restrict__ absmax, const T *__restrict__ w,
                               int64_t nblocks, int B) {
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t b = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nblocks; b += nwarps) {
    const T *wb = w + b * B;
    float m = 0.0f;
    for (int i = lane; i < B; i += 32) {
      const float a = fabsf(ld(wb[i]));
      if (a > m) m = a;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float u = __shfl_xor_sync(0xffffffffu, m, o);
      if (u > m) m = u;
    }
    float scale;
    int divide;
    gp_nf4_scale(m, &scale, &divide);
    if (lane == 0) absmax[b] = m;
    uint8_t *qb = q + b * (B / 2);
    for (int j = lane; j < B / 2; j += 32) {
      const int hi = gp_nf4_quantize1(ld(wb[2 * j]), m, scale, divide);
      const int lo = gp_nf4_quantize1(ld(wb[2 * j + 1]), m, scale, divide);
      qb[j] = (uint8_t)(hi << 4 | lo);
    }
  }
}

template <typename T> void launch_quantize(gp_tensor *q, gp_tensor *absmax, const gp_tensor *w) {
  const int64_t nb = w->shape[0];
  const int B = (int)w->shape[1];
  const unsigned grid = gp_grid(nb * 32, 256);
  GP_NOTE_LAUNCH(k_nf4_quantize<T>, 256, 0);
  k_nf4_quantize<T>
      <<<grid, 256, 0, gp_cuda_stream()>>>((uint8_t *)gp_ptr(q), (float *)gp_ptr(absmax), (const T *)gp_ptr(w), nb, B);
}

/* ---- dequantize ---- */

/* VEC: q 8-byte aligned and w 16-byte aligned */
template <typename T, bool VEC>
__global__ void k_nf4_dequantize(T *__restrict__ w, const uint8_t *__restrict__ q, const float *__restrict__ absmax,
                                 int64_t ngroups, int gshift) {
  __shared__ float lut[16];
  if (threadIdx.x < 16) lut[threadIdx.x] = c_nf4[threadIdx.x];
  __syncthreads();
  const int64_t nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < ngroups; t += nth) {
    const float m = absmax[t >> gshift];
    uint32_t wd[2];
    if constexpr (VEC) {
      const uint2 v = __ldg(reinterpret_cast<const uint2 *>(q) + t);
      wd[0] = v.x;
      wd[1] = v.y;
    } else {
      const uint8_t *p = q + t * 8;
      wd[0] = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
      wd[1] = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
    }
    float o[16];
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const uint32_t b = wd[k >> 2] >> (8 * (k & 3));
      o[2 * k] = lut[(b >> 4) & 15] * m;
      o[2 * k + 1] = lut[b & 15] * m;
    }
    T *dst = w + t * 16;
    if constexpr (VEC) {
      constexpr int V = 16 / (int)sizeof(T);
#pragma unroll
      for (int h = 0; h < 16 / V; h++) {
        vec_t<T, V> v;
#pragma unroll
        for (int e = 0; e < V; e++) v.v[e] = st<T>(o[h * V + e]);
        reinterpret_cast<vec_t<T, V> *>(dst)[h] = v;
      }
    } else {
#pragma unroll
      for (int e = 0; e < 16; e++) dst[e] = st<T>(o[e]);
    }
  }
}

template <typename T> void launch_dequantize(gp_tensor *w, const gp_tensor *q, const gp_tensor *absmax) {
  const int64_t B = w->shape[1], ngroups = w->shape[0] * (B / 16);
  int gshift = 0;
  while ((16LL << gshift) < B) gshift++;
  T *pw = (T *)gp_ptr(w);
  const uint8_t *pq = (const uint8_t *)gp_ptr(q);
  const float *pa = (const float *)gp_ptr(absmax);
  const unsigned grid = gp_grid(ngroups, 256);
  if ((((uintptr_t)pw & 15) | ((uintptr_t)pq & 7)) == 0) {
    GP_NOTE_LAUNCH((k_nf4_dequantize<T, true>), 256, 0);
    k_nf4_dequantize<T, true><<<grid, 256, 0, gp_cuda_stream()>>>(pw, pq, pa, ngroups, gshift);
  } else {
    GP_NOTE_LAUNCH((k_nf4_dequantize<T, false>), 256, 0);
    k_nf4_dequantize<T, false><<<grid, 256, 0, gp_cuda_stream()>>>(pw, pq, pa, ngroups, gshift);
  }
}

/* ---- gemv ---- */

constexpr int GV_WARPS = 8, GV_THREADS = 32 * GV_WARPS;
constexpr int GV_SMEM = 47 * 1024; /* the x tile's budget: under 48 KB with the static lut (no opt-in needed) */

struct GemvP {
  void *out;        /* (M, N) of this tile, or NULL when ws is used */
  float *ws;        /* (S, M, N) partial sums when there are S > 1 splits */
  const void *x;    /* (M, K) of this tile */
  const uint8_t *q; /* (N, K / 2) */
  const float *am;  /* (N, G) */
  int64_t N, K, G;
  int M, bshift, sps, nseg, rounds;
};

/* the 32 codes of 16 bytes (4 words; element 2j high nibble of byte j) */
__device__ __forceinline__ void decode32(const float *lut, const uint32_t wd[4], float c[32]) {
#pragma unroll
  for (int w = 0; w < 4; w++) {
#pragma unroll
    for (int b = 0; b < 4; b++) {
      c[8 * w + 2 * b] = lut[(wd[w] >> (8 * b + 4)) & 15];
      c[8 * w + 2 * b + 1] = lut[(wd[w] >> (8 * b)) & 15];
    }
  }
}

/* MT: rows of x handled (a power of two >= p.M); VEC: K % 32 == 0 and q
 * 16-byte aligned (every chunk of 32 columns is whole, one 16-byte load) */
template <typename T, int MT, bool VEC> __global__ void __launch_bounds__(GV_THREADS) k_nf4_gemv(const GemvP p) {
  /* segments whose loads are issued together: 4 while memory-bound (few rows), 2 beyond (registers) */
  constexpr int GV_UNROLL = MT <= 4 ? 4 : 2;
  extern __shared__ float4 xs[];
  __shared__ float lut[16];
  const int64_t N = p.N, K = p.K;
  const int M = p.M;
  const int seg0 = blockIdx.y * p.sps;
  const int nsh = min(p.sps, p.nseg - seg0); /* segments of this block */
  const int64_t k0 = (int64_t)seg0 * 256;
  if (threadIdx.x < 16) lut[threadIdx.x] = c_nf4[threadIdx.x];
  /* stage x[:, k0 .. k0 + 256 nsh) as floats, float4 i of chunk j at slot 8 j + (i ^ j) */
  const T *x = (const T *)p.x;
  const int nf4s = M * nsh * 64;
  for (int f = threadIdx.x; f < nf4s; f += GV_THREADS) {
    const int m = f / (nsh * 64), rest = f - m * nsh * 64, sl = rest >> 6, jj = (rest >> 3) & 7, ii = rest & 7;
    const int64_t c = k0 + (int64_t)sl * 256 + 32 * jj + 4 * ii;
    const T *xr = x + (int64_t)m * K;
    float4 v;
    v.x = c < K ? ld(xr[c]) : 0.0f;
    v.y = c + 1 < K ? ld(xr[c + 1]) : 0.0f;
    v.z = c + 2 < K ? ld(xr[c + 2]) : 0.0f;
    v.w = c + 3 < K ? ld(xr[c + 3]) : 0.0f;
    xs[(m * nsh + sl) * 64 + 8 * jj + (ii ^ jj)] = v;
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 3, j = lane & 7;
  const int64_t R = 32LL * p.rounds;
  for (int rd = 0; rd < p.rounds; rd++) {
    const int64_t g0 = (int64_t)blockIdx.x * R + (int64_t)(rd * GV_WARPS + warp) * 4; /* the warp's first row */
    if (g0 >= N) break;                                                               /* warp-uniform */
    const int64_t n = g0 + r;
    const bool rowok = n < N;
    const uint8_t *qrow = p.q + (rowok ? n : 0) * (K / 2);
    const float *arow = p.am + (rowok ? n : 0) * p.G;
    float acc[MT];
#pragma unroll
    for (int m = 0; m < MT; m++) acc[m] = 0.0f;
    for (int s0 = 0; s0 < nsh; s0 += GV_UNROLL) {
      uint32_t wv[GV_UNROLL][4];
      float a0[GV_UNROLL], a1[GV_UNROLL];
      /* issue the loads of GV_UNROLL segments first */
#pragma unroll
      for (int u = 0; u < GV_UNROLL; u++) {
        const int64_t col = k0 + (int64_t)(s0 + u) * 256 + 32 * j;
        wv[u][0] = wv[u][1] = wv[u][2] = wv[u][3] = 0x77777777u; /* code 7 is 0.0 */
        a0[u] = a1[u] = 0.0f;
        if (rowok && s0 + u < nsh && col < K) {
          if constexpr (VEC) {
            const uint4 v = __ldg(reinterpret_cast<const uint4 *>(qrow + col / 2));
            wv[u][0] = v.x;
            wv[u][1] = v.y;
            wv[u][2] = v.z;
            wv[u][3] = v.w;
          } else {
            /* K % 32 == 16: the row's last chunk has only 16 columns */
            const int64_t nb = min((int64_t)16, (K - col) / 2);
#pragma unroll
            for (int b = 0; b < 16; b++) {
              const uint32_t byte = b < nb ? (uint32_t)qrow[col / 2 + b] : 0x77u;
              wv[u][b >> 2] = (wv[u][b >> 2] & ~(0xFFu << (8 * (b & 3)))) | byte << (8 * (b & 3));
            }
          }
          a0[u] = arow[col >> p.bshift];
          a1[u] = p.bshift >= 5 ? a0[u] : (col + 16 < K ? arow[(col + 16) >> p.bshift] : 0.0f);
        }
      }
#pragma unroll
      for (int u = 0; u < GV_UNROLL; u++) {
        const int sl = s0 + u;
        if (sl < nsh) { /* warp-uniform */
          float c[32];
          decode32(lut, wv[u], c);
          const float4 *xb = xs + sl * 64 + 8 * j;
#pragma unroll
          for (int m = 0; m < MT; m++) {
            if (m < M) {
              const float4 *xm = xb + m * nsh * 64;
              float ps[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
              for (int i = 0; i < 8; i++) {
                const float4 v = xm[i ^ j];
                float &s = ps[i >> 1];
                s = fmaf(c[4 * i], v.x, s);
                s = fmaf(c[4 * i + 1], v.y, s);
                s = fmaf(c[4 * i + 2], v.z, s);
                s = fmaf(c[4 * i + 3], v.w, s);
              }
              acc[m] = fmaf(a0[u], ps[0] + ps[1], fmaf(a1[u], ps[2] + ps[3], acc[m]));
            }
          }
        }
      }
    }
    /* the 8 lanes of a row */
#pragma unroll
    for (int m = 0; m < MT; m++) {
      acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], 1);
      acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], 2);
      acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], 4);
    }
    if (j == 0 && rowok) {
      if (p.ws) {
        float *o = p.ws + (int64_t)blockIdx.y * M * N;
#pragma unroll
        for (int m = 0; m < MT; m++)
          if (m < M) o[(int64_t)m * N + n] = acc[m];
      } else {
        T *o = (T *)p.out;
#pragma unroll
        for (int m = 0; m < MT; m++)
          if (m < M) o[(int64_t)m * N + n] = st<T>(acc[m]);
      }
    }
  }
}

/* out = sum over the S splits of ws (S, MN), in order */
template <typename T>
__global__ void k_nf4_gemv_sum(T *__restrict__ out, const float *__restrict__ ws, int64_t mn, int S) {
  const int64_t nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < mn; i += nth) {
    float s = 0.0f;
    for (int k = 0; k < S; k++) s += ws[k * mn + i];
    out[i] = st<T>(s);
  }
}

template <typename T, int MT, bool VEC> void launch_gemv_tile(const GemvP &p, dim3 grid, int smem) {
  GP_NOTE_LAUNCH((k_nf4_gemv<T, MT, VEC>), GV_THREADS, smem);
  k_nf4_gemv<T, MT, VEC><<<grid, GV_THREADS, smem, gp_cuda_stream()>>>(p);
}

template <typename T, bool VEC> void launch_gemv_mt(const GemvP &p, dim3 grid, int smem) {
  if (p.M <= 1) launch_gemv_tile<T, 1, VEC>(p, grid, smem);
  else if (p.M <= 2) launch_gemv_tile<T, 2, VEC>(p, grid, smem);
  else if (p.M <= 4) launch_gemv_tile<T, 4, VEC>(p, grid, smem);
  else if (p.M <= 8) launch_gemv_tile<T, 8, VEC>(p, grid, smem);
  else if (p.M <= 16) launch_gemv_tile<T, 16, VEC>(p, grid, smem);
  else launch_gemv_tile<T, 32, VEC>(p, grid, smem);
}

/* ---- gemv on tensor cores (bf16 / f16 x, blocks a multiple of 64, K % 64 == 0) ----
 *
 * out (M, N) = x (M, K) @ W^T with mma.sync m16n8k16: 16 rows of W are the A
 * operand, 8 rows of x the B operand (an n-tile; NT of them for up to 8 NT
 * rows of x), f32 accumulators. The CUDA cores only decode: a byte of q (two
 * codes) becomes an A register holding both values through one shared-memory
 * load from a 256-entry table of code pairs in x's dtype, kept once for every
 * lane (entry b of lane l at byte (b << 8) | (l << 2): one PRMT makes the
 * address from the byte and the lane, and the 32 lanes of a load hit 32
 * different banks whatever their bytes).
 *
 * The weight streams through shared memory: each warp has a ring of 4, 3 or 2
 * stages (by NT; 16 rows x 4 blocks of 64 columns = 16 x 128 bytes, 16-byte pieces
 * XOR-swizzled by row, and the stage's absmax) filled by cp.async, whole
 * 128-byte lines a row, so the loads in flight are not bounded by registers.
 * ldmatrix.x4 gives lane (g, t) (g = lane / 4, t = lane % 4) the bytes 4t ..
 * 4t + 3 and 16 + 4t .. 16 + 4t + 3 of a block's rows g and g + 8. The order
 * of K inside a product is free as long as A and B agree: step s (0..3) of a
 * block's 4 products takes byte pair s of those 8 bytes, i.e. W's columns 8t
 * + 4s' .. + 3 (s' = s & 1, plus 32 for s >= 2), and the B registers hold x's
 * same columns of row g of the n-tile (an aligned register pair of a 16-byte
 * load from L1). Rows of x past M load the last row: their sums land in
 * columns of C that are not written. A block lies in one absmax group: its 4
 * products go to a zeroed accumulator that is scaled by the absmax of rows g
 * and g + 8 in f32 and added. A whole stage is straight-line code, so that
 * the 4 blocks' chains of products interleave.
 *
 * Work: a warp takes 16 rows of W and one of S slices of the blocks; the CTA
 * (16 warps, one an SM: the table and the rings fill the shared memory)
 * takes 16 / S row tiles at a time (an item) and, with S > 1, adds the
 * slices' sums in shared memory in slice order (deterministic: one barrier an
 * item, two buffers). CTAs are persistent over the items, and a warp's ring
 * runs on from item to item; S is chosen on the host so that the items split
 * evenly over the SMs. */

constexpr int TC_WARPS = 16, TC_THREADS = 32 * TC_WARPS, TC_U = 4; /* TC_U: blocks a stage */
constexpr int TC_LUT_BYTES = 256 * 256;
constexpr int TC_STAGE_BYTES = 16 * 128 + 16 * TC_U * 4; /* the stage's bytes, then its absmax (row, block) */
template <int NT> constexpr int tc_stages() { return NT == 1 ? 4 : NT == 2 ? 3 : 2; }
template <int NT> constexpr int tc_red_floats() { return TC_WARPS * NT * 4 * 32; }
template <int NT> constexpr int tc_smem(int S) {
  return TC_LUT_BYTES + TC_WARPS * tc_stages<NT>() * TC_STAGE_BYTES + (S > 1 ? 2 * tc_red_floats<NT>() * 4 : 0);
}

struct TcP {
  void *out;
  const void *x;
  const uint8_t *q;
  const float *am;
  int64_t K, hk, G; /* hk = K / 2: the bytes of a row of q */
  int N, M, gshift; /* gshift: log2 of the 64-column blocks an absmax group */
  int nblk, S, bps; /* 64-column blocks of a row; slices; blocks a slice */
  int items, am16;  /* items (16 / S row tiles each); absmax by 16-byte copies (gshift 0, 4 | G, 4 | bps) */
  float codes[16];  /* the NF4 codes (kernel parameters: no constant-cache miss at the start) */
};

__device__ __forceinline__ uint32_t mma_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mma_cp16(uint32_t dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void mma_cp4(uint32_t dst, const void *src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void mma_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void mma_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
  }
}

/* the code pair of byte i (0..3) of w, from lane l's copy of the table */
__device__ __forceinline__ uint32_t mma_code2(const char *lut, uint32_t w, uint32_t lane4, int i) {
  const uint32_t off = __byte_perm(w, lane4, 0x5504 | (i << 4));
  return *reinterpret_cast<const uint32_t *>(lut + off);
}


template <typename T, int NT> __global__ void __launch_bounds__(TC_THREADS, 1) k_nf4_gemv_tc(const TcP p) {
  constexpr int ST = tc_stages<NT>();
  extern __shared__ __align__(16) char tc_smem_[];
  const char *lut = tc_smem_;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  char *ring = tc_smem_ + TC_LUT_BYTES + warp * ST * TC_STAGE_BYTES;
  const uint32_t ring_u = mma_smem_u32(ring);
  float *red0 = reinterpret_cast<float *>(tc_smem_ + TC_LUT_BYTES + TC_WARPS * ST * TC_STAGE_BYTES);
  const uint32_t lane4 = (uint32_t)lane << 2;
  const int S = p.S, rpi = TC_WARPS / S, sl = warp % S;

  /* an item's rows and blocks for this warp: W rows r0 .. r0 + 15, blocks [bb0, bb1) (none past the last row: the
   * item's barrier still counts the warp) */
  auto span = [&](int item, int &r0, int &bb0, int &bb1) {
    r0 = (item * rpi + warp / S) * 16;
    bb0 = sl * p.bps;
    bb1 = r0 < p.N ? min(p.nblk, bb0 + p.bps) : bb0;
  };
  /* the load cursor (ST - 1 stages ahead of the products, across items): item li, its next block lb, its end lb1;
   * the lane's rows of q (lane / 8 + 4i: piece lane % 8 of each) and of absmax */
  const uint8_t *qr[4];
  const float *ar[2], *a16;
  int li = blockIdx.x, lb = 0, lb1 = 0;
  auto lsetup = [&]() {
    int r0;
    span(li, r0, lb, lb1);
#pragma unroll
    for (int i = 0; i < 4; i++)
      qr[i] = p.q + (int64_t)min(r0 + 4 * i + (lane >> 3), p.N - 1) * p.hk + (lane & 7) * 16;
#pragma unroll
    for (int j = 0; j < 2; j++) ar[j] = p.am + (int64_t)min(r0 + ((lane + 32 * j) >> 2), p.N - 1) * p.G;
    a16 = p.am + (int64_t)min(r0 + (lane & 15), p.N - 1) * p.G;
  };
  /* one commit group a stage, empty past the last item (the counts stay in step) */
  auto issue = [&](int slot) {
    while (li < p.items && lb >= lb1) { /* on to the next item with blocks */
      li += gridDim.x;
      if (li < p.items) lsetup();
    }
    if (li < p.items) {
      const uint32_t st = ring_u + slot * TC_STAGE_BYTES;
      const int nb = min(TC_U, lb1 - lb), c = lane & 7;
      if ((c >> 1) < nb) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int r = 4 * i + (lane >> 3);
          mma_cp16(st + r * 128 + ((c ^ (r & 7)) << 4), qr[i] + (int64_t)lb * 32);
        }
      }
      if (p.am16) { /* 4 | lb: a row's 4 absmax are 16 aligned bytes (kept out of L1, where x is) */
        if (lane < 16) mma_cp16(st + 16 * 128 + lane * 16, a16 + lb);
      } else { /* entry e = 4 row + u */
#pragma unroll
        for (int j = 0; j < 2; j++) {
          const int u = lane & 3;
          if (u < nb) mma_cp4(st + 16 * 128 + (lane + 32 * j) * 4, ar[j] + ((lb + u) >> p.gshift));
        }
      }
      lb += TC_U;
    }
    mma_commit();
  };
  gp_pdl_trigger(); /* a chain kernel (cuda_internal.h): the codes and scales are loaded before the wait, x after */
  if (li < p.items) lsetup();
#pragma unroll
  for (int s = 0; s < ST - 1; s++) issue(s);
  gp_pdl_wait();

  /* the table: entry b of lane l is (code[b >> 4], code[b & 15]) in T (low half: element 2j, the high
   * nibble); warp w writes the whole entries 16k + w */
  {
    const float lo = p.codes[warp];
#pragma unroll
    for (int k = 0; k < 16; k++)
      reinterpret_cast<uint32_t *>(tc_smem_ + ((16 * k + warp) << 8))[lane] = pack2<T>(p.codes[k], lo);
  }
  __syncthreads();

  /* ldmatrix addresses within a stage: lane i reads row (i & 7) + 8 ((i >> 3) & 1) of piece 2u + (i >> 4) */
  const int lr = (lane & 7) + 8 * ((lane >> 3) & 1), lh = lane >> 4;
  int slot = 0, par = 0;
  for (int item = blockIdx.x; item < p.items; item += gridDim.x, par ^= 1) {
    int r0, cb, cb1;
    span(item, r0, cb, cb1);
    const T *xp[NT]; /* x rows 8n + g (the last row past M) at block cb, the lane's columns 8t .. */
#pragma unroll
    for (int n = 0; n < NT; n++)
      xp[n] = (const T *)p.x + (int64_t)min(8 * n + g, p.M - 1) * p.K + (int64_t)cb * 64 + 8 * t;
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    for (; cb < cb1; cb += TC_U) {
      issue(slot == 0 ? ST - 1 : slot - 1);
      mma_wait<ST - 1>();
      __syncwarp();
      const uint32_t st = ring_u + slot * TC_STAGE_BYTES;
      const float *am = reinterpret_cast<const float *>(ring + slot * TC_STAGE_BYTES + 16 * 128);
      const int nb = min(TC_U, cb1 - cb);
      /* the stage's absmax of rows g and g + 8 (two 16-byte loads) */
      float amg[TC_U], amg8[TC_U];
      *reinterpret_cast<float4 *>(amg) = reinterpret_cast<const float4 *>(am)[g];
      *reinterpret_cast<float4 *>(amg8) = reinterpret_cast<const float4 *>(am)[g + 8];
      /* a block's 4 products for every n-tile */
      auto block = [&](int u) {
        uint32_t r[4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(st + lr * 128 + (((2 * u + lh) ^ (lr & 7)) << 4)));
        uint32_t a[4][4];
#pragma unroll
        for (int s = 0; s < 4; s++) {
          const uint32_t wa = r[s < 2 ? 0 : 2], wb = r[s < 2 ? 1 : 3];
          const int i0 = 2 * (s & 1);
          a[s][0] = mma_code2(lut, wa, lane4, i0);
          a[s][1] = mma_code2(lut, wb, lane4, i0);
          a[s][2] = mma_code2(lut, wa, lane4, i0 + 1);
          a[s][3] = mma_code2(lut, wb, lane4, i0 + 1);
        }
        const float sa = amg[u], sb = amg8[u];
#pragma unroll
        for (int n = 0; n < NT; n++) {
          const uint4 x0 = __ldg(reinterpret_cast<const uint4 *>(xp[n] + 64 * u));
          const uint4 x1 = __ldg(reinterpret_cast<const uint4 *>(xp[n] + 64 * u + 32));
          float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_16816<T>(c, a[0], x0.x, x0.y);
          mma_16816<T>(c, a[1], x0.z, x0.w);
          mma_16816<T>(c, a[2], x1.x, x1.y);
          mma_16816<T>(c, a[3], x1.z, x1.w);
          acc[n][0] = fmaf(sa, c[0], acc[n][0]);
          acc[n][1] = fmaf(sa, c[1], acc[n][1]);
          acc[n][2] = fmaf(sb, c[2], acc[n][2]);
          acc[n][3] = fmaf(sb, c[3], acc[n][3]);
        }
      };
      if (nb == TC_U) { /* straight-line: the blocks' chains interleave */
#pragma unroll
        for (int u = 0; u < TC_U; u++) block(u);
      } else {
        for (int u = 0; u < nb; u++) block(u);
      }
#pragma unroll
      for (int n = 0; n < NT; n++) xp[n] += 64 * TC_U;
      __syncwarp(); /* the stage is read: a later issue may refill it */
      slot = slot + 1 == ST ? 0 : slot + 1;
    }
    if (S > 1) { /* the slices' sums, added in slice order */
      float *red = red0 + par * tc_red_floats<NT>();
#pragma unroll
      for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) red[((warp * NT + n) * 4 + e) * 32 + lane] = acc[n][e];
      __syncthreads();
      if (sl == 0) {
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            float sum = 0.0f;
            for (int k = 0; k < S; k++) sum += red[(((warp + k) * NT + n) * 4 + e) * 32 + lane];
            acc[n][e] = sum;
          }
      }
    }
    if (sl == 0) { /* C[m = W row g (+ 8)][n = x row 2t (+ 1)] */
      T *out = (T *)p.out;
#pragma unroll
      for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int m = 8 * n + 2 * t + (e & 1), row = r0 + g + 8 * (e >> 1);
          if (m < p.M && row < p.N) out[(int64_t)m * p.N + row] = st<T>(acc[n][e]);
        }
    }
  }
  mma_wait<0>();
}

/* the tensor-core kernel for tiles of 8, 16 or 32 rows of x (ti 0, 1, 2): its
 * function, its shared memory with S slices and its launch, in one table */
template <typename T, int NT> void tc_launch(unsigned grid, int smem, const TcP &p) {
  gp_launch_chain(k_nf4_gemv_tc<T, NT>, dim3(grid), dim3(TC_THREADS), smem,
                  {gp_span{p.q, (size_t)p.N * p.hk}, gp_span{p.am, (size_t)p.N * p.G * sizeof(float)}},
                  {gp_span{p.out, (size_t)p.M * p.N * sizeof(T)}}, p);
}
template <typename T> struct TcKernel {
  const void *fn;
  int (*smem)(int S);
  void (*launch)(unsigned grid, int smem, const TcP &p);
};
template <typename T> const TcKernel<T> &tc_kernel(int ti) {
  static const TcKernel<T> ks[3] = {{(const void *)k_nf4_gemv_tc<T, 1>, tc_smem<1>, tc_launch<T, 1>},
                                    {(const void *)k_nf4_gemv_tc<T, 2>, tc_smem<2>, tc_launch<T, 2>},
                                    {(const void *)k_nf4_gemv_tc<T, 4>, tc_smem<4>, tc_launch<T, 4>}};
  return ks[ti];
}

/* the tensor-core GEMV for x (M, K) of bf16 / f16 when the layout allows; false: use the other */
template <typename T>
bool tc_gemv(gp_tensor *out, const gp_tensor *x, const gp_tensor *q, const gp_tensor *absmax, int *rc) {
  if constexpr (!std::is_same<T, __nv_bfloat16>::value && !std::is_same<T, __half>::value) return false;
  else {
    const int64_t M = x->shape[0], K = x->shape[1], N = q->shape[0], G = absmax->shape[1];
    static const int off = getenv("GPUSH_NF4_GEMV_CUDA_CORES") != 0; /* for comparisons: the other kernel always */
    if (off || K % 64 != 0 || (K / G) % 64 != 0 || N == 0 || M == 0 || N >= (1LL << 30) || K >= (1LL << 30))
      return false;
    const uint8_t *pq = (const uint8_t *)gp_ptr(q);
    const T *px = (const T *)gp_ptr(x);
    if (((uintptr_t)pq | (uintptr_t)px) & 15) return false;
    static int ready[8][2][3]; /* by device, dtype and n-tiles: 1 once the shared memory attribute is set, -1 refused */
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 0 || dev >= 8) dev = 0;
    int gshift = 0;
    while ((64LL << gshift) < K / G) gshift++;
    const int nblk = (int)(K / 64), sms = gp_cuda_sm_count() > 0 ? gp_cuda_sm_count() : 1;
    const int64_t rt = (N + 15) / 16; /* row tiles */
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int Mt = (int)(M - m0 < 32 ? M - m0 : 32);
      const int ti = Mt <= 8 ? 0 : Mt <= 16 ? 1 : 2;
      const TcKernel<T> &kern = tc_kernel<T>(ti);
      const int smax = kern.smem(2);
      int &rd = ready[dev][std::is_same<T, __half>::value][ti];
      if (rd == 0)
        rd = cudaFuncSetAttribute(kern.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smax) == cudaSuccess ? 1 : -1;
      if (rd < 0) {
        cudaGetLastError();
        if (m0 == 0) return false;
        *rc = gp_error("nf4_gemv: %d bytes of shared memory refused", smax);
        return true;
      }
      /* slices: the fewest that reach the least (rounds of items over the SMs) x (stages a slice + the item's end) */
      int S = 1;
      int64_t best = 0;
      for (int s = 1; s <= TC_WARPS && s <= nblk; s *= 2) {
        const int64_t items = (rt + TC_WARPS / s - 1) / (TC_WARPS / s);
        const int64_t cost = (items + sms - 1) / sms * (((nblk + s - 1) / s + TC_U - 1) / TC_U + 1);
        if (s == 1 || cost < best) best = cost, S = s;
      }
      TcP p;
      p.out = (T *)gp_ptr(out) + m0 * N;
      p.x = px + m0 * K;
      p.q = pq;
      p.am = (const float *)gp_ptr(absmax);
      p.K = K;
      p.hk = K / 2;
      p.G = G;
      p.N = (int)N;
      p.M = Mt;
      p.gshift = gshift;
      p.nblk = nblk;
      p.S = S;
      p.bps = (nblk + S - 1) / S;
      p.items = (int)((rt + TC_WARPS / S - 1) / (TC_WARPS / S));
      p.am16 = gshift == 0 && G % 4 == 0 && p.bps % 4 == 0 && ((uintptr_t)gp_ptr(absmax) & 15) == 0;
      {
        const float codes[16] = GP_NF4_CODES;
        for (int i = 0; i < 16; i++) p.codes[i] = codes[i];
      }
      const unsigned grid = (unsigned)(p.items < sms ? p.items : sms);
      kern.launch(grid, kern.smem(S), p);
    }
    *rc = GP_OK;
    return true;
  }
}

template <typename T> int launch_gemv(gp_tensor *out, const gp_tensor *x, const gp_tensor *q, const gp_tensor *absmax) {
  const int64_t M = x->shape[0], K = x->shape[1], N = q->shape[0], G = absmax->shape[1], B = K / G;
  int bshift = 0;
  while ((1LL << bshift) < B) bshift++;
  const uint8_t *pq = (const uint8_t *)gp_ptr(q);
  const bool vec = K % 32 == 0 && ((uintptr_t)pq & 15) == 0;
  {
    int rc = GP_OK;
    if (tc_gemv<T>(out, x, q, absmax, &rc)) return rc;
  }
  const int64_t nseg = (K + 255) / 256;
  const int64_t sms = gp_cuda_sm_count() > 0 ? gp_cuda_sm_count() : 1;
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int Mt = (int)(M - m0 < 32 ? M - m0 : 32);
    int MT = 1;
    while (MT < Mt) MT *= 2;
    GemvP p;
    p.N = N;
    p.K = K;
    p.G = G;
    p.M = Mt;
    p.bshift = bshift;
    p.nseg = (int)nseg;
    p.q = pq;
    p.am = (const float *)gp_ptr(absmax);
    p.x = (const T *)gp_ptr(x) + m0 * K;
    p.out = (T *)gp_ptr(out) + m0 * N;
    p.ws = 0;
    /* more rows a block for more rows of x, so that staging x stays small beside the weight it meets */
    p.rounds = MT >= 8 ? MT / 4 : 1;
    const int64_t rb = (N + 32LL * p.rounds - 1) / (32LL * p.rounds);
    /* segments a split: as many as the x tile's budget allows, fewer while there are under 2 blocks an SM */
    int64_t sps = GV_SMEM / ((int64_t)Mt * 1024);
    if (sps < 1) sps = 1;
    if (sps > nseg) sps = nseg;
    int64_t S = (nseg + sps - 1) / sps;
    while (rb * S < 2 * sms && sps > 1) {
      sps = (sps + 1) / 2;
      S = (nseg + sps - 1) / sps;
    }
    if (S > 65535) return gp_error("nf4_gemv: K = %lld is too long", (long long)K);
    p.sps = (int)sps;
    const int smem = (int)(Mt * sps * 1024);
    gp_tensor *ws = 0;
    if (S > 1) {
      int64_t wn = S * Mt * N;
      GP_TRY(gp_tensor_scratch(&ws, GP_F32, GP_CUDA, 1, &wn));
      p.ws = (float *)gp_ptr(ws);
    }
    const dim3 grid((unsigned)rb, (unsigned)S);
    if (vec) launch_gemv_mt<T, true>(p, grid, smem);
    else launch_gemv_mt<T, false>(p, grid, smem);
    if (S > 1) {
      const int64_t mn = (int64_t)Mt * N;
      GP_NOTE_LAUNCH(k_nf4_gemv_sum<T>, 256, 0);
      k_nf4_gemv_sum<T><<<gp_grid(mn, 256), 256, 0, gp_cuda_stream()>>>((T *)p.out, p.ws, mn, (int)S);
      gp_tensor_free(ws);
    }
  }
  return GP_OK;
}

bool gpu_float(int dt) { return dt == GP_F32 || dt == GP_BF16 || dt == GP_F16; }

} // namespace

extern "C" int gp_cuda_nf4_quantize(gp_tensor *q, gp_tensor *absmax, const gp_tensor *w) {
  if (!gpu_float(w->dtype))
    return gp_error("nf4_quantize: w is %s; on the GPU it must be f32, bf16 or f16", gp_dtype_name(w->dtype));
  GP_FLOAT_SWITCH(w->dtype, T, launch_quantize<T>(q, absmax, w));
  return gp_cuda_check_launch("nf4_quantize");
}

extern "C" int gp_cuda_nf4_dequantize(gp_tensor *w, const gp_tensor *q, const gp_tensor *absmax) {
  if (!gpu_float(w->dtype))
    return gp_error("nf4_dequantize: w is %s; on the GPU it must be f32, bf16 or f16", gp_dtype_name(w->dtype));
  GP_FLOAT_SWITCH(w->dtype, T, launch_dequantize<T>(w, q, absmax));
  return gp_cuda_check_launch("nf4_dequantize");
}

extern "C" int gp_cuda_nf4_gemv(gp_tensor *out, const gp_tensor *x, const gp_tensor *q, const gp_tensor *absmax) {
  if (!gpu_float(x->dtype))
    return gp_error("nf4_gemv: x is %s; on the GPU it must be f32, bf16 or f16", gp_dtype_name(x->dtype));
  int rc = GP_OK;
  GP_FLOAT_SWITCH(x->dtype, T, rc = launch_gemv<T>(out, x, q, absmax));
  GP_TRY(rc);
  return gp_cuda_check_launch("nf4_gemv");
}
