/* sample.cu: token sampling on the GPU, sort-free. One block per row; the row
 * is re-read from L1/L2 on every pass (it is not copied), 16 bytes a load
 * when the row is aligned to them:
 *   1. max key (order-preserving 32-bit key of the float logit);
 *   2. top-k: the k-th largest key by radix select: 4 passes, each a 256-bin
 *      histogram of the next byte among the keys that share the bytes chosen
 *      so far, then the bin where the count from the top reaches k;
 *   3. min-p: a threshold from the max; top-p: the largest key t whose mass
 *      of {key >= t} reaches top_p of the kept mass, by the same radix select
 *      over masses (4 passes);
 *   4. two passes for the draw: each warp sums the kept mass of its
 *      contiguous segment of the row, a scan over the warps gives the total
 *      and every segment's start; then each warp writes its probs and the
 *      warp whose segment holds u * (kept mass) finds the first element
 *      whose running mass exceeds it.
 * Rows of 4,096 or more on compute capability 9.0, as many as the SMs hold
 * (sample_cluster): a row is split over a cluster of 8, 4 or 2 blocks
 * (Hopper's thread block clusters), each block a contiguous slice: every
 * pass runs over that share of the row, and each block's histogram, maximum, mass, pick is read by its
 * peers through distributed shared memory after a cluster barrier, combined
 * in rank order, so that every block makes the same choices (a batch-1
 * decode step's sampling ran on one SM; GPUSH_SAMPLE_CLUSTER=1, 2, 4 or 8
 * forces one).
 * The histograms add integers (counts; masses in 32-bit fixed point) into
 * histograms private to pairs of warps, so their sums do not depend on the
 * order of the atomics; every other reduction has a fixed order: a rerun
 * gives the same bits. The radix select replaced bisections over the keys (about 32 passes
 * for top-k and 32 for top-p, each element loaded alone: 450 us a row of
 * 49,152 with top-p on the H200). Semantics and the CPU reference
 * (bisection in double): sample.c. */
#include <cooperative_groups.h>
#include <type_traits>

#include "gp_hd.h"
#include "rows.cuh"

/* a cluster barrier (CL > 1; code of compute capability 9.0 and up: the host launches clusters only there) */
template <int CL> __device__ __forceinline__ void cl_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (CL > 1) cooperative_groups::this_cluster().sync();
#else
  if constexpr (CL > 1) __trap();
#endif
}
/* peer block k's copy of the shared variable at p (CL > 1) */
template <int CL, typename V> __device__ __forceinline__ V *cl_peer(V *p, int k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (CL > 1) return cooperative_groups::this_cluster().map_shared_rank(p, k);
#endif
  return p;
}
/* the block-uniform v combined over the cluster's blocks in rank order (every block gets the same);
 * slot: shared memory of this use alone (rewritten only after a later barrier) */
template <int CL, typename V, typename F> __device__ __forceinline__ V cl_all(V v, V *slot, F op) {
  if constexpr (CL == 1) {
    return v;
  } else {
    if (threadIdx.x == 0) *slot = v;
    cl_sync<CL>();
    V r = *cl_peer<CL>(slot, 0);
    for (int k = 1; k < CL; k++) r = op(r, *cl_peer<CL>(slot, k));
    return r;
  }
}

__device__ __forceinline__ uint32_t fkey(float f) {
  uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unkey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* max (MAX) or min over the block of an integer; every thread gets it. sh: 32 entries */
template <bool MAX, typename V> __device__ __forceinline__ V block_ext(V v, V *sh) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    V o = __shfl_xor_sync(0xffffffffu, v, m);
    v = MAX ? (o > v ? o : v) : (o < v ? o : v);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = sh[lane < nw ? lane : 0];
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    V o = __shfl_xor_sync(0xffffffffu, v, m);
    v = MAX ? (o > v ? o : v) : (o < v ? o : v);
  }
  __syncthreads();
  return v;
}

/* a row of logits: its elements visited 16 bytes a load (VEC: the row starts 16-byte aligned and V is a
 * multiple of E), else one at a time; NaN reads as -inf */
template <typename T, bool VEC> struct SampleRow {
  static constexpr int E = 16 / (int)sizeof(T);
  const T *x;
  int64_t V;
  float m, inv_t;
  int64_t lo, hi; /* this block's slice of the row (multiples of E with VEC) */
  __device__ __forceinline__ float val(int64_t j) const {
    float v = ld(x[j]);
    return v == v ? v : -INFINITY;
  }
  /* f(j, v) for every element, thread by thread (strided: a warp's loads are contiguous) */
  template <typename F> __device__ __forceinline__ void each(F f) const {
    if constexpr (VEC) {
      const uint4 *p = reinterpret_cast<const uint4 *>(x);
#pragma unroll 4
      for (int64_t i = lo / E + threadIdx.x; i < hi / E; i += blockDim.x) {
        const uint4 u = p[i];
        const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
        for (int k = 0; k < E; k++) {
          const float v = ld(e[k]);
          f(i * E + k, v == v ? v : -INFINITY);
        }
      }
    } else {
      for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) f(j, val(j));
    }
  }
  /* the kept weight of v (key >= tau): exp((v - m) / T), else 0 */
  __device__ __forceinline__ float weight(float v, uint32_t tau) const {
    return fkey(v) >= tau ? expf((v - m) * inv_t) : 0.f;
  }
};

/* radix select over the row's keys >= lo: the largest key t such that the
 * weight of {key >= t} reaches need, weights being counts (MASS false) or
 * masses (MASS: need = frac of the total, set by the first pass). Masses are
 * fixed point (2^-32 units, 2^-(32 - fs) past 2^18 elements; the total is at
 * least 1, the max's own weight) in two 16-bit halves, so that HN private
 * histograms (warps w, w + HN, ... share one) add plain 32-bit integers
 * without overflow (a histogram sees about V / HN <= 2^15 elements, or
 * each weight is shifted right by fs). hist: HN x 2 x 256 words; sel: 4.
 * A pass also finds the bytes in which all its keys agree (the AND and OR
 * of the keys, in xb's last two words): a later pass over such a byte has
 * one bin and is skipped (keys of bf16 or f16 logits of one sign share
 * their two low bytes: a select of 4 passes takes 2). xb's halves alternate
 * by the passes run (xpar, kept across calls), so that a half is rewritten
 * only after the peers passed the barrier of the pass between. */
constexpr int HN = 8;
constexpr int XB = 258; /* 256 bins, the keys' AND and OR */
template <bool MASS, int CL, typename R>
__device__ uint32_t radix_select(const R &row, uint32_t lo, double frac, unsigned long long need, uint32_t *hist,
                                 unsigned long long *sel, unsigned long long (*xb)[XB], unsigned long long *xt,
                                 uint32_t (*wao)[32], int &xpar) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  uint32_t *mine = hist + (warp % HN) * 512; /* [0, 256): low halves (or counts), [256, 512): high */
  int fs = 0; /* the masses' shift: a histogram's (about V / HN) 16-bit halves, with room, fit 32 bits */
  while ((row.V >> fs) > (int64_t)HN << 15) fs++;
  uint32_t prefix = 0, same = 0; /* same: the bytes every key of an earlier pass had alike */
  unsigned long long above = 0;
  for (int d = 3; d >= 0; d--) {
    if ((same >> (8 * d)) & 255u) { /* one bin: its byte, the weights above and needed unchanged */
      prefix |= (uint32_t)sel[3] & (255u << (8 * d)); /* sel[3]: the keys' AND of the last pass run */
      continue;
    }
    const uint32_t hmask = d == 3 ? 0u : 0xFFFFFFFFu << (8 * (d + 1));
    for (int i = threadIdx.x; i < HN * 512; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    uint32_t kand = 0xFFFFFFFFu, kor = 0u;
    row.each([&](int64_t, float v) {
      const uint32_t key = fkey(v);
      if (key < lo || (key & hmask) != prefix) return;
      kand &= key;
      kor |= key;
      const uint32_t bin = (key >> (8 * d)) & 255u;
      if constexpr (MASS) {
        const uint32_t f = (uint32_t)fminf(expf((v - row.m) * row.inv_t) * 4294967296.f, 4294967295.f) >> fs;
        atomicAdd(mine + bin, f & 0xFFFFu);
        atomicAdd(mine + 256 + bin, f >> 16);
      } else {
        atomicAdd(mine + bin, 1u);
      }
    });
    kand = __reduce_and_sync(0xffffffffu, kand);
    kor = __reduce_or_sync(0xffffffffu, kor);
    if (lane == 0) wao[0][warp] = kand, wao[1][warp] = kor;
    __syncthreads();
    /* the block's bins, a thread a bin over the HN histograms, and the keys' AND and OR, into xb[xpar & 1] */
    unsigned long long *bn = xb[xpar & 1];
    xpar++;
    for (int b = threadIdx.x; b < XB; b += blockDim.x) {
      unsigned long long w = 0;
      if (b < 256) {
#pragma unroll
        for (int h = 0; h < HN; h++) w += hist[h * 512 + b] + ((unsigned long long)hist[h * 512 + 256 + b] << 16);
      } else {
        uint32_t a = b == 256 ? 0xFFFFFFFFu : 0u;
        for (int k = 0; k < nw; k++) a = b == 256 ? a & wao[0][k] : a | wao[1][k];
        w = a;
      }
      bn[b] = w;
    }
    if constexpr (CL > 1) { /* the cluster's bins: every block's, in rank order */
      cl_sync<CL>();
      for (int b = threadIdx.x; b < XB; b += blockDim.x) {
        unsigned long long w = b == 256 ? 0xFFFFFFFFull : 0ull;
#pragma unroll
        for (int k = 0; k < CL; k++) {
          const unsigned long long o = cl_peer<CL>(bn, k)[b];
          w = b < 256 ? w + o : b == 256 ? (w & o) : (w | o);
        }
        xt[b] = w;
      }
      bn = xt;
    }
    __syncthreads();
    unsigned long long bins[8]; /* warp 0: lane l holds bins 8 l .. 8 l + 7 */
    if (threadIdx.x < 32) { /* warp 0: the bin where the weight from the top reaches need */
      unsigned long long part = 0;
#pragma unroll
      for (int i = 0; i < 8; i++) {
        bins[i] = bn[8 * lane + i];
        part += bins[i];
      }
      if (MASS && d == 3) {
        unsigned long long total = part;
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) total += __shfl_xor_sync(0xffffffffu, total, m);
        need = (unsigned long long)(frac * (double)total);
        if (need == 0) need = 1;
      }
      unsigned long long suf = part; /* this lane's bins and every higher lane's */
#pragma unroll
      for (int m = 1; m < 32; m <<= 1) {
        const unsigned long long o = __shfl_down_sync(0xffffffffu, suf, m);
        if (lane + m < 32) suf += o;
      }
      const unsigned ok = __ballot_sync(0xffffffffu, above + suf >= need);
      if (lane == (ok ? 31 - __clz(ok) : 0)) { /* the highest lane whose bins reach it */
        unsigned long long cum = above + suf - part;
        int i = 7;
        for (; i > 0 && cum + bins[i] < need; i--) cum += bins[i];
        sel[0] = (unsigned long long)(8 * lane + i);
        sel[1] = cum;
        sel[2] = need;
      }
      if (lane == 0) sel[3] = bn[256];
    }
    __syncthreads();
    prefix |= (uint32_t)sel[0] << (8 * d);
    above = sel[1];
    need = sel[2];
    const uint32_t ka = (uint32_t)bn[256], ko = (uint32_t)bn[257];
    if (ka <= ko) /* some key: the lower bytes where all agree */
      for (int e = d - 1; e >= 0; e--)
        if ((((ka ^ ko) >> (8 * e)) & 255u) == 0) same |= 255u << (8 * e);
    __syncthreads();
  }
  return prefix;
}

template <typename T, bool VEC, int CL>
__global__ void __launch_bounds__(1024) k_sample(int64_t *out, T *probs, const T *logits, int64_t V, uint64_t seed,
                                                uint64_t offset, float inv_t, int greedy, int64_t top_k, float top_p,
                                                double lmin, const unsigned long long *rng) {
  gp_rng_resolve(rng, seed, offset);
  __shared__ float shf[32];
  __shared__ uint32_t shu[32];
  __shared__ long long shi[32];
  __shared__ uint32_t hist[HN * 512];
  __shared__ unsigned long long sel[4];
  __shared__ uint32_t wao[2][32]; /* the warps' AND and OR of a select pass's keys */
  int xpar = 0;                   /* select passes run: the half of xb the next one writes */
  /* the merged histograms by the parity of the select passes run (xpar; the cluster's blocks read them: CL > 1),
   * their sum over the cluster,
   * then a slot a use for what else the blocks exchange */
  __shared__ unsigned long long xb[2][XB], xt[CL > 1 ? XB : 1];
  __shared__ uint32_t x_hi;
  __shared__ long long x_am, x_pick, x_last;
  __shared__ float x_mass;
  const int64_t r = blockIdx.x / CL;
  const int q = (int)(blockIdx.x % CL); /* the rank in the cluster: clusters are CL consecutive blocks */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  constexpr int E = VEC ? SampleRow<T, VEC>::E : 1;
  const int64_t units = V / E, per = (units + CL - 1) / CL; /* the slice: whole 16-byte units (VEC) */
  const int64_t lo = (q * per < units ? q * per : units) * E, hi_j = ((q + 1) * per < units ? (q + 1) * per : units) * E;
  SampleRow<T, VEC> row{logits + r * V, V, 0.f, inv_t, lo, hi_j};
  T *p = probs + r * V;
  uint32_t hi = 0;
  row.each([&](int64_t, float v) { hi = max(hi, fkey(v)); });
  hi = block_ext<true>(hi, shu);
  hi = cl_all<CL>(hi, &x_hi, [](uint32_t a, uint32_t b) { return a > b ? a : b; });
  row.m = unkey(hi);
  if (greedy || !(row.m > -INFINITY && row.m < INFINITY)) {
    long long am = V;
    row.each([&](int64_t j, float v) {
      if (fkey(v) == hi && j < am) am = j;
    });
    am = block_ext<false>(am, shi);
    am = cl_all<CL>(am, &x_am, [](long long a, long long b) { return a < b ? a : b; });
    for (int64_t j = lo + threadIdx.x; j < hi_j; j += blockDim.x) p[j] = st<T>(j == am ? 1.f : 0.f);
    if (q == 0 && threadIdx.x == 0) out[r] = am < V ? am : 0;
    cl_sync<CL>(); /* no block leaves while a peer may read it */
    return;
  }
  uint32_t tau = 0;
  if (top_k > 0 && top_k < V) tau = radix_select<false, CL>(row, 0u, -1.0, (unsigned long long)top_k, hist, sel, xb, xt, wao, xpar);
  if (lmin > -INFINITY) {
    uint32_t t = fkey((float)((double)row.m + lmin));
    if (t > hi) t = hi;
    if (t > tau) tau = t;
  }
  if (top_p < 1.f) tau = radix_select<true, CL>(row, tau, (double)top_p, 0ull, hist, sel, xb, xt, wao, xpar);
  /* the draw: warp w owns elements [lo + w seg, lo + (w + 1) seg) of the slice (seg a multiple of 32 E), read 16
   * bytes a lane */
  const int64_t tiles = (hi_j - lo + 32 * E - 1) / (32 * E), seg = (tiles + nw - 1) / nw * (32 * E);
  const int64_t s0 = lo + warp * seg, s1 = s0 + seg < hi_j ? s0 + seg : hi_j;
  auto lane_w = [&](int64_t base, float *w) { /* the lane's E weights of the tile at base; 0 past V */
    const int64_t j0 = base + (int64_t)lane * E;
    if constexpr (VEC) {
      if (j0 < s1) {
        const uint4 u = reinterpret_cast<const uint4 *>(row.x)[j0 / E];
        const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
        for (int k = 0; k < E; k++) {
          const float v = ld(e[k]);
          w[k] = row.weight(v == v ? v : -INFINITY, tau);
        }
      } else {
#pragma unroll
        for (int k = 0; k < E; k++) w[k] = 0.f;
      }
    } else {
      w[0] = j0 < s1 ? row.weight(row.val(j0), tau) : 0.f;
    }
  };
  float mine = 0.f; /* the warp's segment: its kept mass */
  for (int64_t base = s0; base < s1; base += 32 * E) {
    float w[E];
    lane_w(base, w);
#pragma unroll
    for (int k = 0; k < E; k++) mine += w[k];
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, m);
  if (lane == 0) shf[warp] = mine;
  __syncthreads();
  float before = 0.f, s = 0.f; /* the mass of the segments before this warp's; the kept mass */
  for (int i = 0; i < nw; i++) {
    if (i == warp) before = s;
    s += shf[i];
  }
  if constexpr (CL > 1) { /* the blocks' masses in rank order: the lower ranks' before this block's */
    if (threadIdx.x == 0) x_mass = s;
    cl_sync<CL>();
    float all = 0.f, pre = 0.f;
    for (int k = 0; k < CL; k++) {
      if (k == q) pre = all;
      all += *cl_peer<CL>(&x_mass, k);
    }
    before += pre;
    s = all;
  }
  const float rs = 1.f / s;
  const float thr = gp_u01(gp_philox(seed, offset + (uint64_t)r / 4).v[r % 4]) * s;
  long long pick = V, last = -1;
  const bool mine_has = before <= thr && thr < before + mine; /* warp-uniform; rounding: the last kept below */
  float acc = before;
  for (int64_t base = s0; base < s1; base += 32 * E) {
    float w[E];
    lane_w(base, w);
    const int64_t j0 = base + (int64_t)lane * E;
    float ls = 0.f;
#pragma unroll
    for (int k = 0; k < E; k++) {
      if (w[k] > 0.f) last = j0 + k;
      ls += w[k];
    }
    if constexpr (VEC) {
      if (j0 < s1) {
        uint4 u;
        T *e = reinterpret_cast<T *>(&u);
#pragma unroll
        for (int k = 0; k < E; k++) e[k] = st<T>(w[k] * rs);
        reinterpret_cast<uint4 *>(p)[j0 / E] = u;
      }
    } else {
      if (j0 < s1) p[j0] = st<T>(w[0] * rs);
    }
    if (mine_has && pick == V) {
      float incl = ls; /* inclusive scan of the lanes' sums */
#pragma unroll
      for (int m = 1; m < 32; m <<= 1) {
        const float o = __shfl_up_sync(0xffffffffu, incl, m);
        if (lane >= m) incl += o;
      }
      const float tile = __shfl_sync(0xffffffffu, incl, 31);
      if (acc + tile > thr) { /* the crossing is in this tile: the first lane, then its element */
        float run = acc + incl - ls;
        long long c = V;
        for (int k = 0; k < E && c == V; k++) {
          run += w[k];
          if (w[k] > 0.f && run > thr) c = j0 + k;
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) {
          const long long o = __shfl_xor_sync(0xffffffffu, c, m);
          c = o < c ? o : c;
        }
        pick = c;
      }
      acc += tile;
    }
  }
  pick = block_ext<false>(pick, shi);
  last = block_ext<true>(last, shi);
  pick = cl_all<CL>(pick, &x_pick, [](long long a, long long b) { return a < b ? a : b; });
  last = cl_all<CL>(last, &x_last, [](long long a, long long b) { return a > b ? a : b; });
  if (q == 0 && threadIdx.x == 0) out[r] = pick < V ? pick : (last >= 0 ? last : 0);
  cl_sync<CL>(); /* no block leaves while a peer may read it */
}

/* rows split over clusters of 8, 4 or 2 blocks (1: one block a row): rows of 4,096 or more on compute capability
 * 9.0 whose kernel is PTX 9.0 or later, the largest cluster that leaves the rows' blocks within one block an SM
 * (8 up to SMs / 8 rows; a batch of 32 rows takes 4: H200, top-k 50 + top-p 0.9 over 49,152 bf16 logits, 52 us
 * a step with one block a row); GPUSH_SAMPLE_CLUSTER=1|2|4|8 forces the choice (all but 1 still need the
 * hardware) */
template <typename T> static int sample_cluster(int64_t n, int64_t v) {
  static const int forced = [] { /* read once a process */
    const char *e = getenv("GPUSH_SAMPLE_CLUSTER");
    const int c = e && *e ? atoi(e) : 0;
    return c == 1 || c == 2 || c == 4 || c == 8 ? c : 0;
  }();
  int want = forced;
  if (!want) {
    want = 1;
    for (int c = 8; c > 1 && want == 1 && v >= 4096; c /= 2)
      if (n * c <= gp_cuda_sm_count()) want = c;
  }
  static int ptx90[8];
  return want > 1 && gp_cuda_cc() >= 90 && gp_cuda_ptx90((const void *)k_sample<T, true, 8>, ptx90) ? want : 1;
}

template <typename T, bool VEC, int CL>
static void sample_launch(int64_t n, int64_t v, int64_t *po, T *pp, const T *px, uint64_t seed, uint64_t offset,
                          float inv_t, int greedy, int64_t top_k, float top_p, double lmin) {
  const int64_t vs = (v + CL - 1) / CL; /* a block's slice */
  const int block = vs >= 32768 ? 1024 : vs >= 4096 ? 512 : vs >= 1024 ? 256 : 128;
  cudaLaunchAttribute at[1];
  cudaLaunchConfig_t cfg = gp_cluster_cfg(dim3((unsigned)(n * CL)), dim3(block), 0, CL, at);
  GP_NOTE_LAUNCH((k_sample<T, VEC, CL>), block, 0);
  cudaLaunchKernelEx(&cfg, k_sample<T, VEC, CL>, po, pp, px, v, seed, offset, inv_t, greedy, top_k, top_p, lmin,
                     gp_cuda_rng_slot());
}

extern "C" int gp_cuda_sample(gp_tensor *out, gp_tensor *probs, const gp_tensor *logits, uint64_t seed, uint64_t offset,
                              double temperature, int64_t top_k, double top_p, double min_p, double lmin) {
  (void)min_p;
  int64_t n = logits->shape[0], v = logits->shape[1];
  if (n == 0) return GP_OK;
  if (n > 2147483647) return gp_error("sample: %lld rows is more than one launch handles", (long long)n);
  const int greedy = temperature == 0;
  const float inv_t = greedy ? 1.f : (float)(1.0 / temperature);
  const int es = gp_elsize(logits->dtype);
  const bool vec = v % (16 / es) == 0 && (((uintptr_t)gp_ptr(logits) | (uintptr_t)gp_ptr(probs)) & 15) == 0;
  int64_t *po = (int64_t *)gp_ptr(out);
  GP_FLOAT_SWITCH(logits->dtype, T, {
    const T *px = (const T *)gp_ptr(logits);
    T *pp = (T *)gp_ptr(probs);
    auto go = [&](auto vec_c, auto cl_c) {
      sample_launch<T, decltype(vec_c)::value, decltype(cl_c)::value>(n, v, po, pp, px, seed, offset, inv_t, greedy,
                                                                      top_k, (float)top_p, lmin);
    };
    auto by_cluster = [&](auto vec_c) {
      switch (sample_cluster<T>(n, v)) {
      case 8: go(vec_c, std::integral_constant<int, 8>()); break;
      case 4: go(vec_c, std::integral_constant<int, 4>()); break;
      case 2: go(vec_c, std::integral_constant<int, 2>()); break;
      default: go(vec_c, std::integral_constant<int, 1>());
      }
    };
    if (vec) by_cluster(std::true_type());
    else by_cluster(std::false_type());
  });
  return gp_cuda_check_launch("sample");
}

/* the penalty: a device-to-device copy of the logits, then one block per row
 * rewrites the ids of its history (duplicates write the same value; ids
 * outside [0, V) are skipped, lens is clamped to [0, L]) */
template <typename T>
__global__ void k_rep_penalty(T *o, const T *x, const int64_t *h, const int64_t *lens, int64_t V, int64_t L, float pen) {
  const int64_t r = blockIdx.x;
  int64_t n = lens[r];
  n = n < 0 ? 0 : n > L ? L : n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t id = h[r * L + i];
    if (id < 0 || id >= V) continue;
    const float v = ld(x[r * V + id]);
    o[r * V + id] = st<T>(v > 0.f ? v / pen : v * pen);
  }
}

extern "C" int gp_cuda_repetition_penalty(gp_tensor *out, const gp_tensor *logits, const gp_tensor *history,
                                          const gp_tensor *lens, double penalty) {
  int64_t n = logits->shape[0], v = logits->shape[1], l = history->shape[1];
  if (n * v == 0) return GP_OK;
  if (n > 2147483647) return gp_error("repetition_penalty: %lld rows is more than one launch handles", (long long)n);
  if (cudaMemcpyAsync(gp_ptr(out), gp_ptr(logits), (size_t)(n * v) * (size_t)gp_elsize(out->dtype),
                      cudaMemcpyDeviceToDevice, gp_cuda_stream()) != cudaSuccess)
    return gp_cuda_check_launch("repetition_penalty (copy)");
  if (l == 0) return GP_OK;
  GP_FLOAT_SWITCH(logits->dtype, T, GP_NOTE_LAUNCH(k_rep_penalty<T>, 128, 0);
                  k_rep_penalty<T><<<(unsigned)n, 128, 0, gp_cuda_stream()>>>(
                      (T *)gp_ptr(out), (const T *)gp_ptr(logits), (const int64_t *)gp_ptr(history),
                      (const int64_t *)gp_ptr(lens), v, l, (float)penalty));
  return gp_cuda_check_launch("repetition_penalty");
}
