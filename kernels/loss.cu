/* loss.cu: fused cross-entropy, one block per row (rows of up to 16 KB: a
 * group of 4 to 32 lanes a row, several rows a block). Pass 1 reads the row
 * once for its max and sum of exponentials (online softmax, f32), pass 2
 * reads it again and writes dlogits. Rows load in 16-byte vectors from their
 * first 16-byte boundary (the elements before it and after the last vector
 * one a thread) when logits and dlogits lie the same distance from one. A target
 * outside [0, classes) that is not ignore_index gives a NaN loss and NaN
 * gradient row and is reported as an error at the next synchronization point
 * (kernels/bad_index.cuh: no host sync here; the CPU reference raises the
 * error at once). dlogits may be logits itself (in place:
 * gp.linear_cross_entropy's chunks, whose rows may be padded past the classes
 * with -inf). */
#include "bad_index.cuh"
#include "onchip.cuh"

#include <cooperative_groups.h>

#include <math.h>

/* a row's elements before its first 16-byte boundary (rows of a length that is
 * not a multiple of the vector, GPT-2's 50257: each row has its own) */
template <typename T> __device__ __forceinline__ int64_t row_head(const T *p, int64_t v) {
  const int64_t h = (int64_t)(((16 - ((uintptr_t)p & 15)) & 15) / sizeof(T));
  return h < v ? h : v;
}

/* thread tid's (of nt on the row) (max, sum of 2^(x - max)) of a row in log2 units (onchip.cuh's Acc,
 * without branches a value): 16-byte vectors from the row's first boundary, four loads in flight a thread,
 * the elements before it and after the last whole vector one a thread (vec: the vectors; else one element a
 * thread) */
template <typename T> __device__ __forceinline__ Acc row_acc2(const T *p, int64_t v, bool vec, int tid, int nt) {
  constexpr int W = 16 / sizeof(T);
  constexpr float L2E = 1.4426950408889634f;
  Acc a{-INFINITY, 0.f, 0.f};
  auto one = [&](int64_t j) {
    const float x = ld(p[j]) * L2E;
    acc_add2<1, false>(a, &x, nullptr);
  };
  int64_t h = 0, nv = 0;
  if (vec) {
    h = row_head(p, v), nv = (v - h) / W;
    const uint4 *q = reinterpret_cast<const uint4 *>(p + h);
    for (int64_t j0 = tid; j0 < nv; j0 += 4 * nt) {
      uint4 u[4];
#pragma unroll
      for (int i = 0; i < 4; i++)
        if (j0 + i * nt < nv) u[i] = q[j0 + i * nt];
#pragma unroll
      for (int i = 0; i < 4; i++) {
        if (j0 + i * nt < nv) {
          const T *e = reinterpret_cast<const T *>(&u[i]);
          float x[W];
#pragma unroll
          for (int l = 0; l < W; l++) x[l] = ld(e[l]) * L2E;
          acc_add2<W, false>(a, x, nullptr);
        }
      }
    }
    for (int64_t j = tid; j < h; j += nt) one(j);
  }
  for (int64_t j = h + nv * W + tid; j < v; j += nt) one(j);
  return a;
}

/* o[j] = g(j, x[j]) over a row by thread tid of nt (vec: o and p the same distance from a 16-byte boundary) */
template <typename T, typename G>
__device__ __forceinline__ void row_map(T *o, const T *p, int64_t v, bool vec, int tid, int nt, G g) {
  constexpr int W = 16 / sizeof(T);
  if (vec) {
    const int64_t h = row_head(p, v), nv = (v - h) / W;
    const uint4 *q = reinterpret_cast<const uint4 *>(p + h);
    uint4 *w = reinterpret_cast<uint4 *>(o + h);
    for (int64_t j = tid; j < nv; j += nt) {
      uint4 u = q[j], r;
      const T *e = reinterpret_cast<const T *>(&u);
      T *d = reinterpret_cast<T *>(&r);
#pragma unroll
      for (int l = 0; l < W; l++) d[l] = st<T>(g(h + j * W + l, ld(e[l])));
      w[j] = r;
    }
    for (int64_t j = tid; j < h; j += nt) o[j] = st<T>(g(j, ld(p[j])));
    for (int64_t j = h + nv * W + tid; j < v; j += nt) o[j] = st<T>(g(j, ld(p[j])));
  } else {
    for (int64_t j = tid; j < v; j += nt) o[j] = st<T>(g(j, ld(p[j])));
  }
}

__device__ __forceinline__ void ms_combine(float &m, float &s, float m2, float s2) {
  float M = fmaxf(m, m2);
  if (M == -INFINITY) {
    s += s2;
    return;
  }
  s = s * expf(m - M) + s2 * expf(m2 - M);
  m = M;
}

/* (m, s) of the whole block, returned to every thread */
__device__ __forceinline__ void block_ms(float &m, float &s) {
  __shared__ float sm[32], ss[32];
  for (int o = 16; o > 0; o >>= 1) ms_combine(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  int w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  if ((threadIdx.x & 31) == 0) {
    sm[w] = m;
    ss[w] = s;
  }
  __syncthreads();
  if (w == 0) {
    m = threadIdx.x < nw ? sm[threadIdx.x] : -INFINITY;
    s = threadIdx.x < nw ? ss[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1)
      ms_combine(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (threadIdx.x == 0) {
      sm[0] = m;
      ss[0] = s;
    }
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
}

/* LPR 0: a block a row; else LPR lanes a row (4 to 32), 256 / LPR rows a block: short rows (a block a row of a
 * few KB is bound by its start and its reduction, not by bytes). A group's shuffles name its own lanes only,
 * so groups of a warp may part at an ignored or bad row */
template <typename T, typename I, int LPR>
__global__ void k_cross_entropy(float *loss, T *dlogits, const T *logits, const I *targets, const float *count,
                                int64_t n, int64_t v, int64_t vt, int64_t ign, float scale, bool vec, gp_bad_ref bad) {
  const int64_t row = LPR == 0 ? (int64_t)blockIdx.x : ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / LPR;
  if (LPR > 0 && row >= n) return;
  const int tid = LPR == 0 ? threadIdx.x : threadIdx.x % LPR, nt = LPR == 0 ? blockDim.x : LPR;
  const unsigned gmask = LPR == 0 || LPR == 32 ? 0xffffffffu : ((1u << LPR) - 1) << ((threadIdx.x & 31) & ~(LPR - 1));
  const T *x = logits + row * v;
  T *g = dlogits ? dlogits + row * v : nullptr;
  int64_t t = (int64_t)targets[row];
  if (t == ign) {
    if (tid == 0) loss[row] = 0.f;
    if (g) row_map(g, x, v, vec, tid, nt, [](int64_t, float) { return 0.f; });
    return;
  }
  if (t < 0 || t >= vt) {
    float nan = __int_as_float(0x7fc00000);
    if (tid == 0) {
      loss[row] = nan;
      gp_report_bad(bad, t);
    }
    if (g) row_map(g, x, v, vec, tid, nt, [nan](int64_t, float) { return nan; });
    return;
  }
  const Acc a = row_acc2(x, v, vec, tid, nt);
  float m = a.m * 0.6931471805599453f, s = a.z;
  /* the target's logit, read before the reduction (whose barrier orders the read before pass 2's writes:
   * dlogits may be logits itself) */
  float xt = tid == 0 ? ld(x[t]) : 0.f;
  if (LPR == 0) block_ms(m, s);
  else {
    for (int o = LPR / 2; o > 0; o >>= 1) ms_combine(m, s, __shfl_xor_sync(gmask, m, o), __shfl_xor_sync(gmask, s, o));
    __syncwarp(gmask);
  }
  float lse = m + logf(s);
  if (tid == 0) loss[row] = lse - xt;
  if (count) scale /= *count;
  if (g)
    row_map(g, x, v, vec, tid, nt, [=](int64_t j, float a) { return (expf(a - lse) - (j == t ? 1.f : 0.f)) * scale; });
}

/* forward + backward of rows held on chip (kernels/onchip.cuh): the logits
 * read once, dlogits written once (the kernel above reads each row twice).
 * Two blocks an SM where their rows fit (bf16 50,304: 104 KB each), so one
 * block's reduction overlaps the other's streaming. A row too wide for one
 * block (Llama 3's 128,256 in bf16: 251 KB) is split over a cluster of C
 * blocks (Hopper), each holding V / C columns; their (max, sum) meet through
 * distributed shared memory. */
/* (U in 16 bits: registers for 48 warps an SM; 56 a thread unbounded, against 38 for aligned rows. Clusters of 4
 * and more: three blocks an SM, whose shared memory holds them at Llama 3's 128,256 columns) */
template <typename T, typename I, int NT, int C, bool U>
__global__ void __launch_bounds__(NT, U && sizeof(T) == 2 ? 1536 / NT
                                      : C >= 4            ? 3
                                                          : 2)
    k_cross_entropy_rows(float *loss, T *dlogits, const T *logits, const I *targets, const float *count, int64_t n,
                         int64_t v, int64_t vt, int nk, int64_t ign, float scale, gp_bad_ref bad) {
  constexpr int W = 16 / sizeof(T);
  constexpr float L2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  extern __shared__ uint4 sm_rows[];
  const int64_t vc = v / C;  /* this block's columns: [rank vc, (rank + 1) vc) */
  const int rank = (int)(blockIdx.x % C);
  /* U (C 1): rows that start off a 16-byte boundary, each held as the 16-byte vectors that cover it (a row's
   * first element at offset off of its first vector; the allocator's blocks are whole 16-byte vectors) */
  auto off_of = [=](int64_t r) { return U ? (int)(((uintptr_t)(logits + r * v) & 15) / sizeof(T)) : 0; };
  auto nvec_of = [=](int o) { return U ? (o + v + W - 1) / W : vc / W; };
  if (count) scale /= *count;
  const int64_t step = gridDim.x / C, c0 = (int64_t)rank * vc;
  int64_t row = blockIdx.x / C;
  [[maybe_unused]] int par = 0; /* the row's parity (clusters) */
  int off = off_of(row);
  if (row < n)
    for (int k = 0; k < nk; k++)
      RowSlots<T, false>{sm_rows, nullptr, NT, nk, nvec_of(off)}.load(logits + row * v + c0 - off, nullptr, k);
  for (; row < n; row += step) {
    const RowSlots<T, false> sl{sm_rows, nullptr, NT, nk, nvec_of(off)};
    const T *x = logits + row * v;
    T *g = dlogits + row * v + c0 - off;
    const int64_t next = row + step;
    const bool more = next < n;
    const int noff = more ? off_of(next) : 0;
    const int64_t nn = more ? nvec_of(noff) : 0;
    const T *nx = logits + next * v + c0 - noff;
    const int64_t tg = (int64_t)targets[row];
    const bool skip = tg == ign, badr = !skip && (tg < 0 || tg >= vt);
    /* this thread's (r, sum of 2^(x L2E - r)) in log2 units against its first max (ref_add: the instructions, not
     * the bytes, bound these rows, ncu on the H200); a sum past 2^64 (a logit 44 nats above r) is summed again
     * against the true max from the slots, which stay in shared memory until backward */
    auto vec_x = [&](int64_t j, float(&xa)[W]) {
      const uint4 u = sl.sx[j]; /* (slot k of this thread) */
      const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
      for (int l = 0; l < W; l++) xa[l] = ld(e[l]);
      if (U && (j == 0 || j == sl.nvec - 1))
#pragma unroll
        for (int l = 0; l < W; l++)
          if (j * W + l < off || j * W + l >= off + v) xa[l] = -INFINITY; /* a neighbour's */
    };
    float r = -INFINITY, z = 0.f;
    for (int k = 0; k < nk; k++) {
      cp_wait(nk - 1 - k);
      const int64_t j = (int64_t)k * NT + threadIdx.x;
      if (skip || badr || j >= sl.nvec) continue;
      float xa[W];
      vec_x(j, xa);
      ref_add(r, z, xa, L2E, [](int, float) {});
    }
    if (!(z <= 0x1p64f)) { /* (NaN too) */
      Acc a{-INFINITY, 0.f, 0.f};
      for (int k = 0; k < nk; k++) {
        const int64_t j = (int64_t)k * NT + threadIdx.x;
        if (j >= sl.nvec) continue;
        float xa[W];
        vec_x(j, xa);
#pragma unroll
        for (int l = 0; l < W; l++) xa[l] *= L2E;
        acc_add2<W, false>(a, xa, nullptr);
      }
      r = a.m;
      z = a.z;
    }
    if (skip || badr) { /* (every block of a cluster takes the same branch: one row) */
      const float f = skip ? 0.f : __int_as_float(0x7fc00000);
      if (threadIdx.x == 0 && rank == 0) {
        loss[row] = f;
        if (badr) gp_report_bad(bad, tg);
      }
      sl.template backward<U>(g, nx, nullptr, nn, off, off + (int)v, [f](int, float, float) { return f; });
      off = noff;
      continue;
    }
    /* the target's logit before the reduction's barrier (dlogits may be the logits) */
    const float xt = threadIdx.x == 0 && rank == 0 ? ld(x[tg]) : 0.f;
    float m = r * LN2;
    block_ms(m, z);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (C > 1) { /* the cluster's (max, sum); peer[par] is rewritten two rows on, after the next sync */
      namespace cg = cooperative_groups;
      __shared__ float2 peer[2]; /* this block's (max, sum) for the cluster, by row parity */
      cg::cluster_group cl = cg::this_cluster();
      if (threadIdx.x == 0) peer[par] = make_float2(m, z);
      cl.sync();
      m = -INFINITY;
      z = 0.f;
#pragma unroll
      for (int r = 0; r < C; r++) {
        const float2 q = *cl.map_shared_rank(peer + par, r);
        ms_combine(m, z, q.x, q.y);
      }
      par ^= 1;
    }
#else
    if constexpr (C > 1) __trap(); /* not reached: the host launches clusters only for code of 9.0 and up */
#endif
    const float lse = m + logf(z), lse2 = lse * L2E;
    if (threadIdx.x == 0 && rank == 0) loss[row] = lse - xt;
    __syncthreads(); /* every thread has read block_ms's results before the next row's */
    /* dlogits = (p - [j == t]) scale = +-2^(x L2E + log2 |scale| - lse2), less scale at the target (its vector's
     * lane tl of vector tv) */
    const int tgi = (int)(tg - c0) + off, tv = tgi >= 0 ? tgi / W : -1, tl = tgi - tv * W;
    const float c = log2f(fabsf(scale)) - lse2;
    const bool neg = scale < 0.f;
    sl.template backward_v<U>(g, nx, nullptr, nn, off, off + (int)v, [=](int64_t j, const uint4 &u, const uint4 &) {
      const T *e = reinterpret_cast<const T *>(&u);
      float q[W];
#pragma unroll
      for (int l = 0; l < W; l++) q[l] = ex2(fmaf(ld(e[l]), L2E, c));
      if (neg)
#pragma unroll
        for (int l = 0; l < W; l++) q[l] = -q[l];
      if (j == tv)
#pragma unroll
        for (int l = 0; l < W; l++)
          if (l == tl) q[l] -= scale;
      return st_vec<T>(q);
    });
    off = noff;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (C > 1) cooperative_groups::this_cluster().sync(); /* no block leaves while a peer may read it */
#endif
}

/* the 16-byte vectors (of w elements) that hold a row of v elements: the most that cover it when it may start off
 * a boundary */
static int64_t ce_row_vectors(int64_t v, int64_t w, bool aligned) { return aligned ? v / w : (v + 2 * w - 2) / w; }

/* the on-chip kernel when the row fits in C blocks (C > 1: Hopper's clusters)
 * and at least two blocks an SM when two (so that one row's
 * reductions, and a cluster's exchange, overlap another's streaming); false:
 * the streaming kernel. U: rows that start off a 16-byte boundary (a block a row) */
template <typename T, typename I, int NT, int C, bool U>
static bool cross_entropy_rows(int *rc, gp_tensor *loss, gp_tensor *dlogits, const gp_tensor *logits,
                               const gp_tensor *targets, const float *cnt, int64_t n, int64_t v, int64_t vt,
                               int64_t ign, float scale, const gp_bad_ref &bad, bool two) {
  constexpr int W = 16 / sizeof(T);
  static_assert(!U || C == 1, "rows off a boundary take one block");
  if (!U && v % (C * W) != 0) return false;
  const int64_t nvec = ce_row_vectors(v / C, W, !U), nk = (nvec + NT - 1) / NT;
  const size_t smem = (size_t)nk * NT * 16;
  auto fn = k_cross_entropy_rows<T, I, NT, C, U>;
  static int ptx90[8];
  if (C > 1 && !gp_cuda_ptx90((const void *)fn, ptx90)) return false; /* PTX of 8.0: the streaming kernel */
  static OnchipCache cache;
  const int64_t slots = nk > 32 ? 0 : onchip_slots(fn, NT, smem, C, cache);
  if (slots == 0 || (two && slots < 2 * (int64_t)gp_cuda_sm_count() * 15 / 16)) return false;
  cudaLaunchAttribute at[1];
  const int64_t want = n * C;
  cudaLaunchConfig_t cfg = gp_cluster_cfg(dim3((unsigned)(want < slots ? want : slots)), dim3(NT), smem, C, at);
  GP_NOTE_LAUNCH(fn, NT, smem);
  cudaLaunchKernelEx(&cfg, fn, (float *)gp_ptr(loss), (T *)gp_ptr(dlogits), (const T *)gp_ptr(logits),
                     (const I *)gp_ptr(targets), cnt, n, v, vt, (int)nk, ign, scale, bad);
  *rc = gp_cuda_check_launch("cross_entropy_fwd_bwd");
  return true;
}

extern "C" int gp_cuda_cross_entropy(gp_tensor *loss, gp_tensor *dlogits, const gp_tensor *logits,
                                     const gp_tensor *targets, const gp_tensor *count, int64_t ignore,
                                     double scale, int64_t vt) {
  int64_t n = logits->shape[0], v = logits->shape[1];
  if (n == 0) return GP_OK;
  if (n > 2147483647) return gp_error("cross_entropy: %lld rows is more than one launch handles", (long long)n);
  int es = gp_elsize(logits->dtype);
  const uintptr_t pl = (uintptr_t)gp_ptr(logits), pd = dlogits ? (uintptr_t)gp_ptr(dlogits) : pl;
  /* vectors from each row's first 16-byte boundary where logits and dlogits lie the same distance from one (the
   * on-chip kernel: rows that start on one). H200, bf16 8192 x 50257: 1421 us one element a thread */
  const bool vec = ((pl ^ pd) & 15) == 0 && pl % (uintptr_t)es == 0;
  const bool aligned = (v * es) % 16 == 0 && ((pl | pd) & 15) == 0;
  const char *op = dlogits ? "cross_entropy_fwd_bwd" : "cross_entropy";
  gp_bad_ref bad;
  GP_TRY(gp_cuda_bad_ref(&bad, op, "target", vt, "the classes (a target that is not ignore_index)"));
  const float *cnt = count ? (const float *)gp_ptr(count) : nullptr;
  static const bool stream_only = getenv("GPUSH_CE_STREAM") != 0; /* for comparisons */
  /* rows off a 16-byte boundary (GPT-2's 50257 columns in 16 bits) are held as the vectors that cover them, from
   * 16 KB up (H200, BENCHMARKS.md 2026-12-01 (b): bf16 8192 x 50257 636.7 -> 555.7 us, f32 8192 x 4097 148.3 ->
   * 86.5; bf16 16384 x 4099 122.0 against 110.0 with a group of lanes a row) */
  /* rows off a boundary held on chip read the 16-byte vectors that cover them: the last row's last one runs past
   * the logits when their end is off a boundary (inside the allocation, whose blocks are whole vectors, but bytes
   * that compute-sanitizer's initcheck sees unwritten): that row takes the streaming kernel below */
  const int64_t nr = !aligned && ((pl + (uintptr_t)(n * v * es)) & 15) ? n - 1 : n;
  int64_t r0 = 0; /* the first row of the streaming kernel */
  if (dlogits && (aligned || (vec && v * es > 16384)) && !stream_only && v * es >= 8192 && nr > 0) {
    int rc = GP_OK;
    bool done = false;
#define GP_CR(NT, C, TWO)                                                                                            \
  ((force == 0 || force == C) &&                                                                                     \
   (!aligned                                                                                                         \
        ? C == 1 && (targets->dtype == GP_I32                                                                        \
                         ? cross_entropy_rows<T, int32_t, NT, 1, true>(&rc, loss, dlogits, logits, targets, cnt, nr, \
                                                                       v, vt, ignore, (float)scale, bad, TWO)        \
                         : cross_entropy_rows<T, int64_t, NT, 1, true>(&rc, loss, dlogits, logits, targets, cnt, nr, \
                                                                       v, vt, ignore, (float)scale, bad, TWO))       \
    : targets->dtype == GP_I32                                                                                       \
        ? cross_entropy_rows<T, int32_t, NT, C, false>(&rc, loss, dlogits, logits, targets, cnt, nr, v, vt, ignore,  \
                                                       (float)scale, bad, TWO)                                       \
        : cross_entropy_rows<T, int64_t, NT, C, false>(&rc, loss, dlogits, logits, targets, cnt, nr, v, vt, ignore,  \
                                                       (float)scale, bad, TWO)))
    /* rows of up to 48 KB: a block of the fewest threads (64 to 256) that hold the row in 12 slots each, so that
     * more rows an SM are in flight (H200, BENCHMARKS.md 2026-12-01: bf16 8192 x 8192 119.4 -> 84.3 us, 0.57 ->
     * 0.81 of copy; 65536 x 4096 385.4 -> 318.8; 4096 x 16384 95.9 -> 86.5; f32 8192 x 6144 160.8 -> 112.5;
     * 64 threads at 16 KB: 93.5, 512 at 62 KB: 87.7 against 89.8 with 256). Wider rows: blocks of 512, the
     * fewest blocks a row that still leave two blocks an SM, else the fewest that fit (H100, bf16 4096 x 128,256
     * through autograd: clusters of 4, three blocks an SM, 919.5 us against 968.8 with clusters of 2, one block
     * an SM); GPUSH_CE_CLUSTER=C asks for clusters of C */
    static const int force = getenv("GPUSH_CE_CLUSTER") ? atoi(getenv("GPUSH_CE_CLUSTER")) : 0;
    const int64_t nvec = ce_row_vectors(v, 16 / es, aligned);
    if (nvec <= 12 * 256)
      GP_FLOAT_SWITCH(logits->dtype, T,
                      done = nvec <= 12 * 64    ? GP_CR(64, 1, true)
                             : nvec <= 12 * 128 ? GP_CR(128, 1, true)
                                                : GP_CR(256, 1, true););
    if (!done && v * es >= 32768)
      GP_FLOAT_SWITCH(logits->dtype, T,
                      done = GP_CR(512, 1, force == 0) || GP_CR(512, 2, force == 0) || GP_CR(512, 4, force == 0) ||
                             GP_CR(512, 8, force == 0) || GP_CR(512, 1, false) || GP_CR(512, 2, false) ||
                             GP_CR(512, 4, false) || GP_CR(512, 8, false););
#undef GP_CR
    if (done && (nr == n || rc != GP_OK)) return rc;
    if (done) r0 = nr;
  }
  /* the forward alone, and unaligned forward + backward rows, of up to 16 KB (aligned ones of 8 KB and more are
   * on chip above): LPR lanes a row, about four 16-byte vectors a lane (eight for the forward alone). H200
   * (BENCHMARKS.md 2026-11-30 (n)), against a block a row: 32768 x 1000 bf16 forward 140.5 -> 28.2 us, forward +
   * backward 179.5 -> 56.3; 65536 x 65 f32 97.2 -> 13.9, 130.2 -> 25.6; 16384 x 4096 bf16 88.5 -> 42.6, 259.7 ->
   * 106.2. Four vectors a lane in the forward: 65536 x 512 bf16 31.5 us against 27.1; all 32 lanes: 46.2 */
  int lpr = 0, bs = 256;
  if (v * es <= 16384) {
    const int64_t per = dlogits ? 64 : 128, quads = (v * es + per - 1) / per;
    lpr = quads <= 4 ? 4 : quads <= 8 ? 8 : quads <= 16 ? 16 : 32;
  } else if (dlogits) {
    /* else a block a row. The forward alone reads each row once: blocks of 256 keep 8 rows an SM in flight, so
     * one row's reduction and start overlap the others' loads (H200, 2048 x 50,304: bf16 0.52 -> 0.85 of copy,
     * f32 0.78 -> 1.00, against blocks of 1024); the two passes of the streaming forward + backward, 16-bit: 512
     * (bf16 0.49 -> 0.60; f32 keeps 1024 from 16384 columns: 0.70 against 0.64) */
    bs = v >= 16384 && es >= 4 ? 1024 : 512;
  }
  const unsigned grid = lpr ? (unsigned)(((n - r0) * lpr + 255) / 256) : (unsigned)(n - r0);
#define GP_CE(I, L)                                                                                                  \
  k_cross_entropy<T, I, L><<<grid, bs, 0, gp_cuda_stream()>>>(                                                       \
      (float *)gp_ptr(loss) + r0, dlogits ? (T *)gp_ptr(dlogits) + r0 * v : nullptr,                                 \
      (const T *)gp_ptr(logits) + r0 * v, (const I *)gp_ptr(targets) + r0, cnt, n - r0, v, vt, ignore, (float)scale, \
      vec, bad)
#define GP_CE_L(I)                \
  switch (lpr) {                  \
    case 4: GP_CE(I, 4); break;   \
    case 8: GP_CE(I, 8); break;   \
    case 16: GP_CE(I, 16); break; \
    case 32: GP_CE(I, 32); break; \
    default: GP_CE(I, 0);         \
  }
  GP_FLOAT_SWITCH(
      logits->dtype, T, if (targets->dtype == GP_I32) { GP_CE_L(int32_t) } else {GP_CE_L(int64_t)});
#undef GP_CE_L
#undef GP_CE
  return gp_cuda_check_launch(op);
}

/* one block: out = sum (or mean) of loss over non-ignored rows, in a fixed order. A thread's 4 rows a
 * round are loaded before they are added (one memory latency a round, not two a row); an ignored row's
 * loss is read but not added (every loss kernel writes it, 0). */
constexpr int LR_U = 4;
template <typename I>
__global__ void k_loss_reduce(float *out, float *count, const float *loss, const I *targets, int64_t n, int64_t ign,
                              bool average) {
  __shared__ float ssum[32], scnt[32];
  float s = 0.f, c = 0.f;
  const int64_t step = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + (LR_U - 1) * step < n; i += LR_U * step) {
    I t[LR_U];
    float l[LR_U];
#pragma unroll
    for (int u = 0; u < LR_U; u++) {
      t[u] = targets[i + u * step];
      l[u] = loss[i + u * step];
    }
#pragma unroll
    for (int u = 0; u < LR_U; u++)
      if ((int64_t)t[u] != ign) {
        s += l[u];
        c += 1.f;
      }
  }
  for (; i < n; i += step)
    if ((int64_t)targets[i] != ign) {
      s += loss[i];
      c += 1.f;
    }
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    c += __shfl_xor_sync(0xffffffffu, c, o);
  }
  int w = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    ssum[w] = s;
    scnt[w] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s = 0.f;
    c = 0.f;
    for (int k = 0; k < (int)(blockDim.x >> 5); k++) {
      s += ssum[k];
      c += scnt[k];
    }
    out[0] = average ? s / c : s;
    count[0] = c;
  }
}

/* one block: count = the targets that are not ign (average), else 1 */
template <typename I>
__global__ void k_loss_count(float *count, const I *targets, int64_t n, int64_t ign, bool average) {
  __shared__ int scnt[32];
  if (!average) {
    if (threadIdx.x == 0) count[0] = 1.f;
    return;
  }
  int c = 0;
  const int64_t step = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + (LR_U - 1) * step < n; i += LR_U * step) {
    I t[LR_U];
#pragma unroll
    for (int u = 0; u < LR_U; u++) t[u] = targets[i + u * step];
#pragma unroll
    for (int u = 0; u < LR_U; u++) c += (int64_t)t[u] != ign;
  }
  for (; i < n; i += step) c += (int64_t)targets[i] != ign;
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if ((threadIdx.x & 31) == 0) scnt[threadIdx.x >> 5] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t t = 0;
    for (int k = 0; k < (int)(blockDim.x >> 5); k++) t += scnt[k];
    count[0] = (float)t;
  }
}

/* the block of the one-block reductions: 256 threads for short lists, else 1024 */
static unsigned lr_threads(int64_t n) { return n > 4096 ? 1024u : 256u; }

extern "C" int gp_cuda_loss_reduce(gp_tensor *out, gp_tensor *count, const gp_tensor *loss, const gp_tensor *targets,
                                   int64_t ignore, int average) {
  int64_t n = loss->shape[0];
  const unsigned nt = lr_threads(n);
  if (targets->dtype == GP_I32)
    k_loss_reduce<int32_t><<<1, nt, 0, gp_cuda_stream()>>>((float *)gp_ptr(out), (float *)gp_ptr(count),
                                                           (const float *)gp_ptr(loss),
                                                           (const int32_t *)gp_ptr(targets), n, ignore, average != 0);
  else
    k_loss_reduce<int64_t><<<1, nt, 0, gp_cuda_stream()>>>((float *)gp_ptr(out), (float *)gp_ptr(count),
                                                           (const float *)gp_ptr(loss),
                                                           (const int64_t *)gp_ptr(targets), n, ignore, average != 0);
  return gp_cuda_check_launch("loss_reduce");
}

extern "C" int gp_cuda_loss_count(gp_tensor *count, const gp_tensor *targets, int64_t ignore, int average) {
  int64_t n = targets->shape[0];
  const unsigned nt = average ? lr_threads(n) : 32u;
  if (targets->dtype == GP_I32)
    k_loss_count<int32_t><<<1, nt, 0, gp_cuda_stream()>>>((float *)gp_ptr(count), (const int32_t *)gp_ptr(targets), n,
                                                          ignore, average != 0);
  else
    k_loss_count<int64_t><<<1, nt, 0, gp_cuda_stream()>>>((float *)gp_ptr(count), (const int64_t *)gp_ptr(targets), n,
                                                          ignore, average != 0);
  return gp_cuda_check_launch("loss_count");
}
