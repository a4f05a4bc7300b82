/* attention_tc.cuh: the tile machinery the tensor-core attention kernels
 * share, the mma.sync ones (attention_mma.cu) and the wgmma ones
 * (attention_wg.cu): cp.async tile loads into 128-byte rows XOR-swizzled by
 * 16-byte chunk, the visible key tiles and their masks, the online softmax of
 * an accumulator tile, the output stores, the backward's delta kernel, and
 * the host helpers that launch a forward over query tiles and a backward's
 * kernels. Everything is internal to the including file (an unnamed
 * namespace: each .cu has its own copy of the kernels it instantiates). */
#ifndef GP_ATTENTION_TC_CUH
#define GP_ATTENTION_TC_CUH

#include <cstring>
#include <type_traits>

#include "attention.cuh"

namespace gp_attn {
namespace {

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t u;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &h, 4);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&u, &h, 4);
  }
  return u;
}

__device__ __forceinline__ void ldsm_x4(uint32_t *r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t *r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
template <typename T> __device__ __forceinline__ void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* the key tiles of BN keys that queries at positions [pmin, pmax] see:
 * [0, g) (the global keys) then [w, e); j0(t) is the first key of the t-th */
struct KvTiles {
  int g, w, n, bn;
  __device__ __forceinline__ int j0(int t) const { return (t < g ? t : w + (t - g)) * bn; }
};
__device__ __forceinline__ KvTiles kv_tiles(const AttnP &P, int pmin, int pmax, int BN) {
  const int kv_end = P.causal ? min(P.S, pmax + 1) : P.S;
  const int e = (kv_end + BN - 1) / BN;
  KvTiles r = {0, 0, 0, BN};
  if (P.win > 0) {
    const int lo = pmin - P.win + 1;
    r.w = lo <= 0 ? 0 : min(lo / BN, e);
    r.g = min((P.ng + BN - 1) / BN, r.w);
  }
  r.n = r.g + (e - r.w);
  return r;
}
/* keys [j0, j0 + BN) hold a key that is out of range or invisible to some
 * position in [pmin, pmax] */
__device__ __forceinline__ bool tile_masked(const AttnP &P, int pmin, int pmax, int j0, int BN) {
  return (j0 + BN > P.S) || (P.causal && j0 + BN - 1 > pmin) || (P.win > 0 && j0 + BN > P.ng && pmax - j0 >= P.win);
}

/* the mask a tile of keys [j0, j0 + BN) needs for positions [pmin, pmax]: 0
 * none, 1 the general test (vis, keys past S), 2 the causal diagonal alone
 * (causal, no window, every key below S): one compare an element
 * (causal_hide) in place of vis' tests */
__device__ __forceinline__ int tile_mask(const AttnP &P, int pmin, int pmax, int j0, int BN) {
  if (!tile_masked(P, pmin, pmax, j0, BN)) return 0;
  return P.causal && P.win == 0 && j0 + BN <= P.S ? 2 : 1;
}
/* f(tag) with tag the mask kind mk as a compile-time constant */
template <typename F> __device__ __forceinline__ void with_mask(int mk, F &&f) {
  if (mk == 2) f(std::integral_constant<int, 2>());
  else if (mk == 1) f(std::integral_constant<int, 1>());
  else f(std::integral_constant<int, 0>());
}
/* an accumulator fragment's elements (nt, e) hidden by the causal mask set to
 * v: element (nt, e) is row 8 (e >> 1) by column 8 nt + (e & 1) past the
 * thread's first; QROWS (rows: queries, columns: keys): d = the thread's
 * first key - its first position, hidden where key > position; else (rows:
 * keys, columns: queries) d = the first key - the first position likewise,
 * the offsets the other way round */
template <int NT, bool QROWS> __device__ __forceinline__ void causal_hide(float (*s)[4], int d, float v) {
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int c = QROWS ? 8 * nt + (e & 1) - 8 * (e >> 1) : 8 * (e >> 1) - 8 * nt - (e & 1);
      if (d + c > 0) s[nt][e] = v;
    }
}

/* the A fragment (16 x 16) made of the accumulators of n-tiles 2 kk and 2 kk + 1 */
template <typename T> __device__ __forceinline__ void acc_to_a(uint32_t *a, const float (*c)[4], int kk) {
  a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

/* element offset of 16-byte chunk c of row r in a swizzled tile of rows of D */
template <int D> __device__ __forceinline__ int swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

/* ROWS rows from global row row0, rows rs elements apart (rows >= nrows are
 * zero-filled); every row start 16-byte aligned; NTH threads (the block).
 * Thread x copies chunk x % (D / 8) of rows x / (D / 8) + NTH / (D / 8) i:
 * a fixed swizzled column, so each copy is one 64-bit address and an add.
 * Layout: rows of D, swz<D> (HALVES false); or (the wgmma kernels, HALVES)
 * D / 64 tiles of [ROWS][64], each in the 128-byte swizzle, column half h
 * at sm + h ROWS 64 (the same as the first for D 64). */
template <typename T, int D, int ROWS, int NTH = 128, bool HALVES = false>
__device__ __forceinline__ void load_tile(T *sm, const T *g, int64_t rs, int row0, int nrows) {
  constexpr int DC = D / 8, RSTEP = NTH / DC, N = ROWS * DC, W = HALVES ? 64 : D; /* W: a row's elements in smem */
  static_assert(NTH % DC == 0 && (RSTEP % 8 == 0 || RSTEP >= ROWS), "load_tile: the swizzle needs rows 8k apart");
  const int c = threadIdx.x % DC, r0 = threadIdx.x / DC;
  const uint32_t dst = smem_u32(HALVES ? sm + (c >> 3) * ROWS * 64 + swz<64>(r0, c & 7) : sm + swz<D>(r0, c));
  if (row0 + ROWS <= nrows) { /* every row there: no checks, the source advanced RSTEP rows a copy */
    const T *src = g + ((int64_t)row0 + r0) * rs + c * 8;
    const int64_t step = (int64_t)RSTEP * rs;
#pragma unroll
    for (int it = 0; it < (N + NTH - 1) / NTH; it++, src += step) {
      if (N % NTH != 0 && r0 + it * RSTEP >= ROWS) break;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + it * RSTEP * W * (int)sizeof(T)),
                   "l"(src));
    }
    return;
  }
  const T *src = g + (int64_t)row0 * rs + c * 8;
#pragma unroll
  for (int it = 0; it < (N + NTH - 1) / NTH; it++) {
    const int r = r0 + it * RSTEP;
    if (N % NTH != 0 && r >= ROWS) break;
    const bool ok = row0 + r < nrows;
    cp_async16(dst + it * RSTEP * W * (int)sizeof(T), ok ? src + (int64_t)r * rs : g, ok ? 16 : 0);
  }
}

/* one m-tile's online softmax (base 2, raw max: scale > 0): rows g and g + 8
 * of the thread's quad, s (NT n-tiles) becomes p = ex2(s sl2 - m sl2), m and
 * l are updated, and alpha is what the output accumulated so far is to be
 * multiplied by; l stays per thread until the end */
template <int NT>
__device__ __forceinline__ void softmax_p(float (*s)[4], float *m, float *l, float *alpha, float sl2) {
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float mx = m[h];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
    const float mus = (mx == -INFINITY ? 0.f : mx) * sl2;
    alpha[h] = ex2(m[h] * sl2 - mus); /* m = -inf: 0 */
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const float p0 = ex2(fmaf(s[nt][2 * h], sl2, -mus)), p1 = ex2(fmaf(s[nt][2 * h + 1], sl2, -mus));
      s[nt][2 * h] = p0;
      s[nt][2 * h + 1] = p1;
      sum += p0 + p1;
    }
    m[h] = mx;
    l[h] = l[h] * alpha[h] + sum;
  }
}
/* o (DT n-tiles) *= alpha by row half */
template <int DT> __device__ __forceinline__ void rescale_rows(float (*o)[4], const float *alpha) {
#pragma unroll
  for (int dt = 0; dt < DT; dt++) {
    o[dt][0] *= alpha[0];
    o[dt][1] *= alpha[0];
    o[dt][2] *= alpha[1];
    o[dt][3] *= alpha[1];
  }
}
/* softmax_p, then o rescaled at once */
template <int NT, int DT>
__device__ __forceinline__ void softmax_rows(float (*s)[4], float *m, float *l, float (*o)[4], float sl2) {
  float alpha[2];
  softmax_p<NT>(s, m, l, alpha, sl2);
  rescale_rows<DT>(o, alpha);
}

/* the forward's output rows row0 + g and row0 + g + 8 (those below T) of one
 * m-tile: o / l, and lse = m mnat + log l (mnat: the units of m) */
template <typename T, int DT>
__device__ __forceinline__ void store_out_rows(const AttnP &P, int bh, int row0, const float (*o)[4], const float *m,
                                               const float *l, float mnat, int lane) {
  T *out = (T *)P.out + head_at(P.so, bh, P.H);
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float lt = l[h];
    lt += __shfl_xor_sync(FULL, lt, 1);
    lt += __shfl_xor_sync(FULL, lt, 2);
    const int row = row0 + (lane >> 2) + h * 8;
    if (row >= P.T) continue;
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
      *(uint32_t *)(out + (int64_t)row * P.so.r + dt * 8 + ((lane & 3) << 1)) =
          pack2<T>(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
    if ((lane & 3) == 0) P.lse[(int64_t)bh * P.T + row] = lt > 0.f ? m[h] * mnat + logf(lt) : -INFINITY;
  }
}

/* rows row0 + g and row0 + g + 8 (those below nrows) of an accumulator
 * tile a (DT n-tiles) times scale into dst (rows rs elements apart) */
template <typename T, int DT>
__device__ __forceinline__ void store_acc_rows(T *dst, int64_t rs, int row0, int nrows, const float (*a)[4],
                                               float scale, int lane) {
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int row = row0 + (lane >> 2) + h * 8;
    if (row >= nrows) continue;
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
      *(uint32_t *)(dst + (int64_t)row * rs + dt * 8 + ((lane & 3) << 1)) =
          pack2<T>(a[dt][2 * h] * scale, a[dt][2 * h + 1] * scale);
  }
}

/* delta[r] = sum_d dout[r, d] * out[r, d] for r = bh * T + i: D / 8 threads a
 * row, 16 bytes each (the tensor-core path: rows 16-byte aligned). With the
 * fused backward's accumulator (P.dqa, nacc4 float4s) each block also clears
 * its share of it: no memset launch, and the writes overlap the reads */
template <typename T, int D>
__global__ void __launch_bounds__(128)
    k_attn_bwd_delta(AttnP P, float *__restrict__ delta, int64_t rows, int64_t nacc4) {
  if (P.dqa) {
    const int64_t per = (nacc4 + gridDim.x - 1) / gridDim.x, lo = (int64_t)blockIdx.x * per;
    const int64_t hi = lo + per < nacc4 ? lo + per : nacc4;
    for (int64_t i = lo + threadIdx.x; i < hi; i += 128) ((float4 *)P.dqa)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  constexpr int TPR = D / 8; /* threads a row, 16 bytes each */
  const int64_t row = (int64_t)blockIdx.x * (128 / TPR) + threadIdx.x / TPR;
  const int c = (threadIdx.x % TPR) * 8;
  float s = 0.f;
  if (row < rows) {
    const int bh = (int)(row / P.T), i = (int)(row % P.T);
    const uint4 o = *(const uint4 *)((const T *)P.o + head_at(P.so, bh, P.H) + (int64_t)i * P.so.r + c);
    const uint4 g = *(const uint4 *)((const T *)P.dout + head_at(P.sg, bh, P.H) + (int64_t)i * P.sg.r + c);
    const T *oe = (const T *)&o, *ge = (const T *)&g;
#pragma unroll
    for (int e = 0; e < 8; e++) s += ld(ge[e]) * ld(oe[e]);
  }
#pragma unroll
  for (int w = TPR / 2; w > 0; w >>= 1) s += __shfl_xor_sync(FULL, s, w);
  if (row < rows && c == 0) delta[row] = s;
}

/* shared memory beyond 48 KB needs the attribute, once per kernel */
/* the query tiles a dk/dv CTA of KV head bkv walks: n_qt tiles of bq rows
 * from ilo for each of its G query heads in turn (GQA; else the n_qt tiles
 * of query head bkv). Tile t of n: query head head(t), rows from row0(t). */
template <bool GQA> struct QTiles {
  int bh0, ilo, n_qt, n, bq;
  float inv;      /* GQA: 1 / n_qt */
  int64_t oq, og; /* the group's first query head in q and dout (elements) */
  __device__ QTiles(const AttnP &P, int bkv, int ilo_, int n_qt_, int bq_)
      : bh0(GQA ? group_q0(bkv, P) : bkv),
        ilo(ilo_),
        n_qt(n_qt_),
        n(GQA ? n_qt_ * P.G : n_qt_),
        bq(bq_),
        inv(GQA && n_qt_ > 0 ? 1.f / n_qt_ : 0.f),
        oq(head_at(P.sq, bh0, P.H)),
        og(head_at(P.sg, bh0, P.H)) {}
  /* tile t's query head in the group, t / n_qt without an integer division
   * (a float estimate, then corrected: it is off by at most one) */
  __device__ int grp(int t) const {
    if (!GQA) return 0;
    int g = (int)((float)t * inv);
    if ((g + 1) * n_qt <= t) g++;
    else if (g * n_qt > t) g--;
    return g;
  }
  __device__ int head(int t) const { return bh0 + grp(t); }
  __device__ int row0(int t) const { return ilo + (t - grp(t) * n_qt) * bq; }
};

/* a dk/dv kernel's stage of query tile t (cp.async, NTH threads): its ROWS
 * rows of q and dout into Qs and Gs, of lse and delta into Ls and Dl */
template <typename T, int D, int ROWS, int NTH, bool GQA, bool HALVES = false>
__device__ __forceinline__ void load_q_tile(const AttnP &P, const float *delta, const QTiles<GQA> &qt, int t, T *Qs,
                                            T *Gs, float *Ls, float *Dl) {
  const int g = qt.grp(t), bh = qt.bh0 + g, i0 = qt.ilo + (t - g * qt.n_qt) * qt.bq;
  load_tile<T, D, ROWS, NTH, HALVES>(Qs, (const T *)P.q + qt.oq + g * P.sq.h, P.sq.r, i0, P.T);
  load_tile<T, D, ROWS, NTH, HALVES>(Gs, (const T *)P.dout + qt.og + g * P.sg.h, P.sg.r, i0, P.T);
  const float *lse = P.lse_in + (int64_t)bh * P.T, *dlt = delta + (int64_t)bh * P.T;
  for (int e = threadIdx.x; e < ROWS; e += NTH) {
    const int i = i0 + e;
    const bool ok = i < P.T;
    cp_async4(smem_u32(Ls + e), lse + (ok ? i : 0), ok ? 4 : 0);
    cp_async4(smem_u32(Dl + e), dlt + (ok ? i : 0), ok ? 4 : 0);
  }
}

template <typename K> int smem_attr(K *kern, int smem, bool &done, const char *op) {
  if (done) return GP_OK;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return gp_error("%s: cannot give the kernel %d bytes of shared memory", op, smem);
  done = true;
  return GP_OK;
}

/* a forward kernel over query tiles of BM rows: grid BH x ceil(T / BM) */
template <typename K> int launch_fwd_tiles(K *kern, const AttnP &P, int64_t BH, int BM, int nth, int smem, bool &attr) {
  GP_TRY(smem_attr(kern, smem, attr, "attn_fwd"));
  const int64_t blocks = BH * ((P.T + BM - 1) / BM);
  if (blocks > INT32_MAX)
    return gp_error("attn_fwd: too many blocks for one launch (B * H = %lld, T = %d)", (long long)BH, P.T);
  GP_NOTE_LAUNCH(kern, nth, smem);
  kern<<<(unsigned)blocks, nth, smem, gp_cuda_stream()>>>(P, (int)BH);
  return GP_OK;
}

/* a tensor-core backward: delta (f32 scratch), then the dk/dv kernel over
 * n_kt key tiles of every KV head (BH / P.G of them: the kernel's last
 * argument) and the dq kernel over n_mt query tiles of every query head;
 * FUSED: the dk/dv kernel adds dQ into an f32 accumulator (P.dqa, tiles of
 * 64 rows) and dq is the kernel that converts it (dq(P, n64), one CTA of 128
 * threads a tile of 64 rows; nth2, smem2, n_mt and a2 unused) */
template <typename T, int D, bool FUSED, typename K1, typename K2>
int launch_bwd_kernels(AttnP P, int64_t BH, K1 *dkdv, int nth1, int smem1, int64_t n_kt, bool &a1, K2 *dq, int nth2,
                       int smem2, int64_t n_mt, bool &a2) {
  constexpr bool SPLIT = !FUSED; /* a dq kernel */
  const int64_t rows = BH * P.T, NKV = BH / P.G;
  if (BH * n_kt > INT32_MAX || BH * n_mt > INT32_MAX || (rows + 7) / 8 > INT32_MAX)
    return gp_error("attn_bwd: too many blocks for one launch (B * H = %lld, T = %d, S = %d)", (long long)BH, P.T, P.S);
  gp_tensor *dl = 0, *acc = 0;
  GP_TRY(gp_tensor_scratch(&dl, GP_F32, GP_CUDA, 1, &rows));
  const int64_t nacc = BH * ((P.T + 63) / 64) * 64 * D; /* the fused kernel's dQ tiles of 64 rows */
  int rc = SPLIT ? GP_OK : gp_tensor_scratch(&acc, GP_F32, GP_CUDA, 1, &nacc);
  if (rc == GP_OK && acc) P.dqa = (float *)gp_ptr(acc); /* cleared by the delta kernel */
  float *delta = (float *)gp_ptr(dl);
  if (rc == GP_OK) {
    GP_NOTE_LAUNCH((k_attn_bwd_delta<T, D>), 128, 0);
    k_attn_bwd_delta<T, D><<<(unsigned)((rows + 128 / (D / 8) - 1) / (128 / (D / 8))), 128, 0, gp_cuda_stream()>>>(
        P, delta, rows, nacc / 4);
    rc = smem_attr(dkdv, smem1, a1, "attn_bwd");
  }
  if constexpr (SPLIT)
    if (rc == GP_OK) rc = smem_attr(dq, smem2, a2, "attn_bwd");
  if (rc == GP_OK) {
    GP_NOTE_LAUNCH(dkdv, nth1, smem1);
    dkdv<<<(unsigned)(NKV * n_kt), nth1, smem1, gp_cuda_stream()>>>(P, delta, (int)NKV);
    if constexpr (SPLIT) {
      GP_NOTE_LAUNCH(dq, nth2, smem2);
      dq<<<(unsigned)(BH * n_mt), nth2, smem2, gp_cuda_stream()>>>(P, delta, (int)BH);
    } else {
      const int n64 = (P.T + 63) / 64;
      GP_NOTE_LAUNCH(dq, 128, 0);
      dq<<<(unsigned)(BH * n64), 128, 0, gp_cuda_stream()>>>(P, n64);
    }
  }
  gp_tensor_free(acc);
  gp_tensor_free(dl); /* (stream-ordered, as the decode's partials) */
  return rc;
}

} // namespace
} // namespace gp_attn

#endif
