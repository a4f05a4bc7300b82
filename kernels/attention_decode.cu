/* attention_decode.cu: decode attention (one query per sequence over its
 * cache) on the GPU: split-K (flash-decoding): blocks over slices of the
 * cache per (b, h), each a partial (max, sum, acc), then a combine kernel;
 * with one slice (short caches) the block writes the output itself.
 * Query head h reads KV head h / G of the cache (grouped-query attention).
 * Two kernels: k_attn_decode_split on CUDA cores (f32 queries, unaligned
 * operands, one query head a KV head, GP_ATTN_DECODE=cores) and
 * k_attn_decode_tc on tensor cores (grouped-query heads of bf16/f16 queries,
 * the G heads of a KV head as the rows of one mma). */
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention_tc.cuh"
#include "kvquant.cuh"

namespace gp_attn {
namespace {

__device__ __forceinline__ int dec_len(const DecP &P, int b) {
  int64_t n = P.lens64 ? ((const int64_t *)P.lens)[b] : ((const int32_t *)P.lens)[b];
  return (int)(n < 0 ? 0 : n > P.C ? P.C : n); /* clamped: never outside the cache */
}
/* a block's rows bh0 .. (b, t, h order: H rows a query position, T positions
 * a sequence) share b and t: its sequence b and the keys its queries see,
 * n = lens[b] - (T - 1 - t) (nothing below 0) */
__device__ __forceinline__ int dec_row_len(const DecP &P, int bh0, int &b) {
  const int bt = bh0 / P.H;
  b = bt / P.T;
  return max(0, dec_len(P, b) - (P.T - 1 - (bt - b * P.T)));
}

/* the R at p (elements E): one load (VEC: p aligned to sizeof(R)) or element by element */
template <typename R, typename E, bool VEC> __device__ __forceinline__ R ld_vec(const E *p) {
  if constexpr (VEC) {
    return *(const R *)p;
  } else {
    R v;
    E *e = (E *)&v;
#pragma unroll
    for (int t = 0; t < (int)(sizeof(R) / sizeof(E)); t++) e[t] = p[t];
    return v;
  }
}
/* the N elements of a vector as floats: T's (FMT 0) or codes (FMT 1 int8, 2 fp8; before the scale).
 * Codes 4 at a time from a word: int8 by the magic-number trick (the code + 128 as
 * the low byte of the float 2^23, one byte permute and one add a code, exact);
 * e4m3 two at a time by moving its bits into two halves (sign, then exponent and
 * mantissa shifted under f16's): that is the code's value over 2^8 (exact,
 * subnormals too: f16's exponent bias is 8 above e4m3's), FP8_UNIT folds the 2^8
 * into the scales (the conversion instruction is far slower on the H100) */
constexpr float FP8_UNIT = 256.f;
template <typename T, int FMT, int N, typename R> __device__ __forceinline__ void vec_f32(float *f, const R &v) {
  if constexpr (FMT == 0) {
    const T *e = (const T *)&v;
#pragma unroll
    for (int t = 0; t < N; t++) f[t] = ld(e[t]);
  } else {
    static_assert(N % 4 == 0, "decode: codes come 4 a word");
    const uint32_t *w = (const uint32_t *)&v;
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
      if constexpr (FMT == GP_KV_INT8) {
        const uint32_t u = w[i] ^ 0x80808080u; /* two's complement -> offset by 128 */
#pragma unroll
        for (int b = 0; b < 4; b++)
          f[4 * i + b] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u + b)) - 8388736.f;
      } else {
#pragma unroll
        for (int b = 0; b < 2; b++) { /* codes 2b, 2b + 1 as the high bytes of two halves */
          const uint32_t t = __byte_perm(w[i], 0u, 0x0404u | (2 * b) << 4 | (2 * b + 1) << 12);
          const uint32_t h = (t & 0x80008000u) | ((t >> 1) & 0x3F803F80u);
          const float2 g = __half22float2(*(const __half2 *)&h);
          f[4 * i + 2 * b] = g.x;
          f[4 * i + 2 * b + 1] = g.y;
        }
      }
    }
  }
}

/* a block's nq heads from the NPART partials (m in log2 units, l, acc) in
 * shared memory: the output itself with one slice, else the slice's partial
 * (acc, max, sum) for the combine kernel; 128 threads */
template <typename T, int D, int NPART, int NQ>
__device__ __forceinline__ void store_partials(const DecP &P, int bh0, int nq, int split, const float (*sm_m)[NQ],
                                               const float (*sm_l)[NQ], const float (*sm_acc)[NQ][D]) {
#pragma unroll 1
  for (int g = 0; g < nq; g++) {
    float M = -INFINITY, L = 0.f;
#pragma unroll
    for (int i = 0; i < NPART; i++) M = fmaxf(M, sm_m[i][g]);
#pragma unroll
    for (int i = 0; i < NPART; i++) L += sm_m[i][g] == -INFINITY ? 0.f : ex2(sm_m[i][g] - M) * sm_l[i][g];
    float *part = P.part + ((int64_t)(bh0 + g) * P.nsplit + split) * (D + 2);
    for (int d = threadIdx.x; d < D; d += 128) {
      float a = 0.f;
#pragma unroll
      for (int i = 0; i < NPART; i++) a += (sm_m[i][g] == -INFINITY ? 0.f : ex2(sm_m[i][g] - M)) * sm_acc[i][g][d];
      if (P.nsplit == 1) ((T *)P.out)[(int64_t)(bh0 + g) * D + d] = st<T>(L > 0.f ? a / L : 0.f); /* no combine */
      else part[d] = a;
    }
    if (threadIdx.x == 0 && P.nsplit > 1) {
      part[D] = M;
      part[D + 1] = L;
    }
  }
}

/* NQ query heads of one KV head (consecutive heads of a group: NQ divides G)
 * and one slice of the cache a block, so that a key and a value are read and
 * dequantized once for the NQ heads: each key's row is read by LPK lanes
 * with 16-byte loads (a warp reads KPW consecutive keys, 512 bytes, at a
 * time), U keys a lane group in flight, one online-softmax rescale per U
 * keys (base 2); the 4 KPW lane groups' partials meet in shared memory and
 * go to part (m in log2 units). VEC: q, kc and vc start 16-byte aligned
 * (else the vectors are read element by element). FMT 1, 2: the cache holds
 * one-byte codes (int8, fp8 e4m3) and f32 scales per position (P.ks, P.vs):
 * a lane reads 16 codes of a row, dequantized in registers (a score is the
 * dot with the codes times the key's scale; a value row's weight takes its
 * scale), so a warp covers twice the keys of a 2-byte cache with the same
 * loads. */
template <typename T, int D, bool VEC, int FMT, int NQ>
__global__ void __launch_bounds__(128) k_attn_decode_split(DecP P) {
  using C = typename std::conditional<FMT == 0, T, uint8_t>::type; /* a cache element */
  constexpr int EPL = 16 / (int)sizeof(C), LPK = D / EPL, KPW = 32 / LPK, NPART = 4 * KPW;
  constexpr int U = EPL * NQ >= 48 ? 2 : 4; /* keys in flight: fewer when the heads' registers are many */
  constexpr int QV = 16 / (int)sizeof(T);   /* q's elements a 16-byte vector */
  using R = uint4;                          /* a lane's part of a cache row */
  static_assert(LPK <= 32 && 32 % LPK == 0 && EPL % QV == 0, "decode: a key's row is 16-byte vectors of one warp");
  __shared__ float sm_m[NPART][NQ], sm_l[NPART][NQ], sm_acc[NPART][NQ][D];
  gp_pdl_trigger(); /* chain kernels (cuda_internal.h): nothing read before the wait */
  gp_pdl_wait();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane % LPK;
  const int gi = warp * KPW + lane / LPK; /* the lane group */
  const int bh0 = P.row0 + blockIdx.y * NQ, split = blockIdx.x;
  int b;
  const int n = dec_row_len(P, bh0, b), p = n - 1;
  const int jb = split * P.chunk, je = min(n, jb + P.chunk);
  const float sl2 = P.scale * LOG2E;
  float qr[NQ][EPL], acc[NQ][EPL], m[NQ], l[NQ];
#pragma unroll
  for (int g = 0; g < NQ; g++) {
#pragma unroll
    for (int i = 0; i < EPL / QV; i++) {
      const uint4 qv = ld_vec<uint4, T, VEC>((const T *)P.q + (int64_t)(bh0 + g) * D + sub * EPL + i * QV);
      vec_f32<T, 0, QV>(qr[g] + i * QV, qv);
    }
#pragma unroll
    for (int t = 0; t < EPL; t++) {
      qr[g][t] *= sl2;
      acc[g][t] = 0.f;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  const int64_t bkv = (int64_t)b * P.Hkv + (bh0 % P.H) / P.G; /* the KV head of the block */
  const C *kc = (const C *)P.kc + bkv * P.C * D + sub * EPL;
  const C *vc = (const C *)P.vc + bkv * P.C * D + sub * EPL;
  const float *ks = FMT ? P.ks + bkv * P.C : nullptr, *vs = FMT ? P.vs + bkv * P.C : nullptr;
  /* keys [lo, hi): the block walks NPART U of them at a time (a uniform
   * trip count: every lane takes part in the shuffles) */
  auto run = [&](int lo, int hi) {
    for (int base = lo; base < hi; base += NPART * U) {
      R kv[U], vv[U];
      float ksc[U], vsc[U]; /* FMT: the keys' and values' scales */
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int j = base + u * NPART + gi;
        const bool ok = j < hi;
        kv[u] = ok ? ld_vec<R, C, VEC>(kc + (int64_t)j * D) : R{};
        vv[u] = ok ? ld_vec<R, C, VEC>(vc + (int64_t)j * D) : R{};
        if constexpr (FMT != 0) {
          constexpr float unit = FMT == GP_KV_FP8 ? FP8_UNIT : 1.f;
          ksc[u] = ok ? ks[j] * unit : 0.f;
          vsc[u] = ok ? vs[j] * unit : 0.f;
        }
      }
      float sc[NQ][U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        float kf[EPL];
        vec_f32<T, FMT, EPL>(kf, kv[u]);
        const bool ok = base + u * NPART + gi < hi;
#pragma unroll
        for (int g = 0; g < NQ; g++) {
          float d = 0.f;
#pragma unroll
          for (int t = 0; t < EPL; t++) d = fmaf(qr[g][t], kf[t], d);
#pragma unroll
          for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(FULL, d, o);
          if constexpr (FMT != 0) d *= ksc[u];
          sc[g][u] = ok ? d : -INFINITY;
        }
      }
      if (base + gi >= hi) continue; /* none of this group's keys (the same for every head) */
      float mn[NQ];
#pragma unroll
      for (int g = 0; g < NQ; g++) {
        mn[g] = m[g];
#pragma unroll
        for (int u = 0; u < U; u++) mn[g] = fmaxf(mn[g], sc[g][u]);
        const float alpha = ex2(m[g] - mn[g]); /* m = -inf: 0 */
        l[g] *= alpha;
#pragma unroll
        for (int t = 0; t < EPL; t++) acc[g][t] *= alpha;
        m[g] = mn[g];
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        float vf[EPL];
        vec_f32<T, FMT, EPL>(vf, vv[u]);
#pragma unroll
        for (int g = 0; g < NQ; g++) {
          const float e = ex2(sc[g][u] - mn[g]);
          l[g] += e;
          const float ev = FMT ? e * vsc[u] : e;
#pragma unroll
          for (int t = 0; t < EPL; t++) acc[g][t] = fmaf(ev, vf[t], acc[g][t]);
        }
      }
    }
  };
  if (P.win > 0) { /* the leading visible keys, then the window */
    run(jb, min(je, P.ng));
    run(max(jb, max(P.ng, p - P.win + 1)), je);
  } else {
    run(jb, je);
  }
#pragma unroll
  for (int g = 0; g < NQ; g++) {
    if (sub == 0) {
      sm_m[gi][g] = m[g];
      sm_l[gi][g] = l[g];
    }
#pragma unroll
    for (int t = 0; t < EPL; t++) sm_acc[gi][g][sub * EPL + t] = acc[g][t];
  }
  __syncthreads();
  store_partials<T, D, NPART, NQ>(P, bh0, NQ, split, sm_m, sm_l, sm_acc);
}

/* the splits' partials of one (b, h): weights 2^(m_s - M) */
template <typename T, int D> __global__ void __launch_bounds__(D) k_attn_decode_combine(DecP P) {
  gp_pdl_trigger();
  gp_pdl_wait();
  const int bh = P.row0 + blockIdx.x, d = threadIdx.x;
  const float *part = P.part + (int64_t)bh * P.nsplit * (D + 2);
  float M = -INFINITY;
  for (int s = 0; s < P.nsplit; s++) M = fmaxf(M, part[s * (D + 2) + D]);
  float a = 0.f, L = 0.f;
  if (M != -INFINITY)
    for (int s = 0; s < P.nsplit; s++) {
      float ms = part[s * (D + 2) + D];
      if (ms == -INFINITY) continue;
      float w = exp2f(ms - M);
      a += w * part[s * (D + 2) + d];
      L += w * part[s * (D + 2) + D + 1];
    }
  ((T *)P.out)[(int64_t)bh * D + d] = st<T>(L > 0.f ? a / L : 0.f);
}

/* ---- grouped-query heads on tensor cores (mma.sync m16n8k16) ----
 * With G >= 2 query heads on a KV head, the CUDA-core kernel above does a
 * head's dot products, shuffles and rescales for every key it reads: at 4
 * heads it issues about 220 instructions per 1 KB of int8 cache a warp, so
 * instructions, not bytes, bound it. Here a warp's NQ (<= 8) heads are the
 * rows of the A operand (rows NQ..15 zero) and each key is read once into a
 * B fragment straight from global memory, with the reduction dimension
 * permuted so that every lane's loads are 16-byte vectors of one row:
 *   S = Q K^T: n-tile c holds keys 8c..8c+7 of the warp's range (column =
 *     lane / 4 = the key a lane reads); lane t = lane % 4 reads dims
 *     [t D/4, (t+1) D/4) of it; k-step s takes its 4 dims t D/4 + 4s + 0..3
 *     (slots 2t, 2t+1, 2t+8, 2t+9), and q's A fragment uses the same map.
 *   O += P V: P's A fragment is S's accumulators (FlashAttention-2's reuse:
 *     slot 2t + j of k-step kk is key 16kk + 2t + j, slot 2t + 8 + j is
 *     16kk + 8 + 2t + j); n-slot lane / 4 of n-tile i is dim (D/8)(lane/4) + i,
 *     so a lane reads D/8 consecutive values of each of its 4 keys' rows.
 * Codes (FMT 1 int8, 2 fp8) become f16 pairs in registers (int8 by the
 * magic number 1024 + code + 128, exact; e4m3 by moving its bits under
 * f16's, value / 256 exact); q then runs in f16, a key's scale multiplies
 * its scores and a value's scale its f16 values. FMT 0: T's own mma. */
template <int NW> __device__ __forceinline__ void ld_words(uint32_t *w, const void *p, bool ok) {
  static_assert(NW % 2 == 0, "decode: 8-byte pieces at least");
  if constexpr (NW % 4 == 0) {
#pragma unroll
    for (int i = 0; i < NW / 4; i++) {
      const uint4 v = ok ? ((const uint4 *)p)[i] : uint4{0, 0, 0, 0};
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < NW / 2; i++) {
      const uint2 v = ok ? ((const uint2 *)p)[i] : uint2{0, 0};
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  }
}
/* codes c0..c3 of word w as f16 pairs {c0, c1}, {c2, c3} (before the scale) */
template <int FMT> __device__ __forceinline__ void codes_h2(uint32_t w, uint32_t &h01, uint32_t &h23) {
  if constexpr (FMT == GP_KV_INT8) {
    const uint32_t u = w ^ 0x80808080u;
    const __half2 off = __half2half2(__ushort_as_half((unsigned short)0x6480)); /* 1152 = 1024 + 128 */
    uint32_t a = __byte_perm(u, 0x64646464u, 0x5140u), b = __byte_perm(u, 0x64646464u, 0x5342u);
    __half2 ha = __hsub2(*(__half2 *)&a, off), hb = __hsub2(*(__half2 *)&b, off);
    h01 = *(uint32_t *)&ha;
    h23 = *(uint32_t *)&hb;
  } else {
    const uint32_t a = __byte_perm(w, 0u, 0x1404u), b = __byte_perm(w, 0u, 0x3424u);
    h01 = (a & 0x80008000u) | ((a >> 1) & 0x3F803F80u);
    h23 = (b & 0x80008000u) | ((b >> 1) & 0x3F803F80u);
  }
}
/* mma16816 with rows 8..15 of A zero: a holds rows 0..7 (a[0], a[1]) */
template <typename M> __device__ __forceinline__ void mma_dec(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
  const uint32_t a4[4] = {a[0], 0u, a[1], 0u};
  mma16816<M>(c, a4, b0, b1);
}

template <typename T, int D, int FMT> __global__ void __launch_bounds__(128) k_attn_decode_tc(DecP P, int nq) {
  using C = typename std::conditional<FMT == 0, T, uint8_t>::type; /* a cache element */
  using M = typename std::conditional<FMT == 0, T, __half>::type;  /* the products' type */
  constexpr int KS = D / 16;                      /* k-steps of S = Q K^T */
  constexpr int NTK = FMT == 0 ? 2 : 4;           /* key n-tiles (8 keys) a warp's step: 8 KB of K and V */
  constexpr int KEYS = 8 * NTK, NT = D / 8;       /* keys a warp's step; n-tiles of O (dims) */
  constexpr int KW = D / 4 * (int)sizeof(C) / 4;  /* words of a key row a lane reads */
  constexpr int VW = D / 8 * (int)sizeof(C) / 4;  /* words of a value row a lane reads */
  __shared__ float sm_m[4][8], sm_l[4][8], sm_acc[4][8][D];
  gp_pdl_trigger(); /* chain kernels (cuda_internal.h): nothing read before the wait */
  gp_pdl_wait();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3, r = lane >> 2;
  const int bh0 = P.row0 + blockIdx.y * nq, split = blockIdx.x;
  int b;
  const int n = dec_row_len(P, bh0, b), p = n - 1;
  const int jb = split * P.chunk, je = min(n, jb + P.chunk);
  const float sl2 = P.scale * LOG2E;
  /* q's A fragments: row r = head bh0 + r (zero past nq), slots as above */
  uint32_t qa[KS][2];
  {
    const T *q = (const T *)P.q + (int64_t)(bh0 + min(r, nq - 1)) * D + t * (D / 4);
#pragma unroll
    for (int s = 0; s < KS; s++) {
      float f[4];
#pragma unroll
      for (int i = 0; i < 4; i++) f[i] = r < nq ? ld(q[4 * s + i]) : 0.f;
      qa[s][0] = pack2<M>(f[0], f[1]);
      qa[s][1] = pack2<M>(f[2], f[3]);
    }
  }
  float o[NT][4], m = -INFINITY, l = 0.f;
#pragma unroll
  for (int i = 0; i < NT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  const int64_t bkv = (int64_t)b * P.Hkv + (bh0 % P.H) / P.G; /* the KV head of the block */
  const C *kc = (const C *)P.kc + bkv * P.C * D, *vc = (const C *)P.vc + bkv * P.C * D;
  const float *ks = FMT ? P.ks + bkv * P.C : nullptr, *vs = FMT ? P.vs + bkv * P.C : nullptr;
  constexpr float unit = FMT == GP_KV_FP8 ? FP8_UNIT : 1.f;
  /* a warp's step: K's and V's loads of the next step are issued as soon as
   * this step's registers are consumed (K after S = Q K^T, V after O += P V),
   * so each load overlaps a phase of products; the scales with them */
  uint32_t kw[NTK][KW], vw[NTK / 2][4][VW];
  float kscl[NTK][2], vscl[NTK / 2][4];
  auto load_k = [&](int w0, int hi) {
#pragma unroll
    for (int c = 0; c < NTK; c++) {
      const int j = w0 + 8 * c + r;
      ld_words<KW>(kw[c], kc + (int64_t)j * D + t * (D / 4), j < hi);
      if constexpr (FMT != 0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
          const int jj = w0 + 8 * c + 2 * t + i;
          kscl[c][i] = jj < hi ? ks[jj] : 0.f;
        }
      }
    }
  };
  auto load_v = [&](int w0, int hi) {
#pragma unroll
    for (int kk = 0; kk < NTK / 2; kk++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int j = w0 + 16 * kk + 2 * t + (e & 1) + 8 * (e >> 1);
        ld_words<VW>(vw[kk][e], vc + (int64_t)j * D + r * (D / 8), j < hi);
        if constexpr (FMT != 0) vscl[kk][e] = j < hi ? vs[j] * unit : 0.f;
      }
  };
  auto run = [&](int lo, int hi) {
    int w0 = lo + warp * KEYS;
    if (w0 >= hi) return; /* warp-uniform */
    load_k(w0, hi);
    load_v(w0, hi);
    for (; w0 < hi; w0 += 4 * KEYS) {
      const int w1 = w0 + 4 * KEYS; /* the next step (loads nothing past hi) */
      float sc[NTK][4];
#pragma unroll
      for (int c = 0; c < NTK; c++) {
        sc[c][0] = sc[c][1] = sc[c][2] = sc[c][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; s++) {
          uint32_t b0, b1;
          if constexpr (FMT == 0) b0 = kw[c][2 * s], b1 = kw[c][2 * s + 1];
          else codes_h2<FMT>(kw[c][s], b0, b1);
          mma_dec<M>(sc[c], qa[s], b0, b1);
        }
      }
      /* scores of row r (log2 units), -inf past hi; the row's new max over the quad */
      float mx = m;
#pragma unroll
      for (int c = 0; c < NTK; c++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
          const int j = w0 + 8 * c + 2 * t + i;
          const float mul = FMT ? sl2 * unit * kscl[c][i] : sl2;
          sc[c][i] = j < hi ? sc[c][i] * mul : -INFINITY;
          mx = fmaxf(mx, sc[c][i]);
        }
      load_k(w1, hi);
      mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
      const float ms = mx == -INFINITY ? 0.f : mx; /* nothing visible yet: every p is 0 */
      const float alpha = ex2(m - ms);
      m = mx;
      l *= alpha;
#pragma unroll
      for (int i = 0; i < NT; i++) o[i][0] *= alpha, o[i][1] *= alpha;
      uint32_t pa[NTK / 2][2];
#pragma unroll
      for (int c = 0; c < NTK; c++) {
        const float p0 = ex2(sc[c][0] - ms), p1 = ex2(sc[c][1] - ms);
        l += p0 + p1;
        pa[c / 2][c & 1] = pack2<M>(p0, p1);
      }
#pragma unroll
      for (int kk = 0; kk < NTK / 2; kk++) {
        uint32_t sv[2] = {0u, 0u}; /* FMT: the 4 keys' value scales as f16 pairs {e0, e1}, {e2, e3} */
        if constexpr (FMT != 0) {
          sv[0] = pack2<__half>(vscl[kk][0], vscl[kk][1]);
          sv[1] = pack2<__half>(vscl[kk][2], vscl[kk][3]);
        }
#pragma unroll
        for (int g = 0; g < VW; g++) { /* word g of each row: dims (D/8) r + g * (4 / sizeof(C)) + ... */
          if constexpr (FMT == 0) {
            /* two dims a word: n-tiles 2g, 2g + 1 */
#pragma unroll
            for (int h = 0; h < 2; h++) {
              const uint32_t sel = h ? 0x7632u : 0x5410u;
              const uint32_t b0 = __byte_perm(vw[kk][0][g], vw[kk][1][g], sel);
              const uint32_t b1 = __byte_perm(vw[kk][2][g], vw[kk][3][g], sel);
              mma_dec<M>(o[2 * g + h], pa[kk], b0, b1);
            }
          } else {
            /* four dims a word: n-tiles 4g .. 4g + 3; pairs of keys (e 0, 1) and (2, 3) */
            uint32_t hp[2][4];
#pragma unroll
            for (int pr = 0; pr < 2; pr++) {
              const uint32_t x = vw[kk][2 * pr][g], y = vw[kk][2 * pr + 1][g];
              if constexpr (FMT == GP_KV_INT8) {
                const uint32_t i0 = __byte_perm(x, y, 0x5140u), i1 = __byte_perm(x, y, 0x7362u); /* x0 y0 x1 y1, x2 y2 x3 y3 */
                codes_h2<FMT>(i0, hp[pr][0], hp[pr][1]);
                codes_h2<FMT>(i1, hp[pr][2], hp[pr][3]);
              } else {
                /* e4m3: bytes x_d x_d y_d y_d, the high byte of each half the code (the low
                 * byte falls outside the masks), so one permute a pair */
#pragma unroll
                for (int d = 0; d < 4; d++) {
                  const uint32_t a = __byte_perm(x, y, 0x4400u + 0x1111u * d);
                  hp[pr][d] = (a & 0x80008000u) | ((a >> 1) & 0x3F803F80u);
                }
              }
#pragma unroll
              for (int d = 0; d < 4; d++) {
                __half2 hv = __hmul2(*(__half2 *)&hp[pr][d], *(const __half2 *)&sv[pr]);
                hp[pr][d] = *(uint32_t *)&hv;
              }
            }
#pragma unroll
            for (int d = 0; d < 4; d++) mma_dec<M>(o[4 * g + d], pa[kk], hp[0][d], hp[1][d]);
          }
        }
      }
      load_v(w1, hi);
    }
  };
  if (P.win > 0) {
    run(jb, min(je, P.ng));
    run(max(jb, max(P.ng, p - P.win + 1)), je);
  } else {
    run(jb, je);
  }
  l += __shfl_xor_sync(FULL, l, 1);
  l += __shfl_xor_sync(FULL, l, 2);
  if (r < nq) {
    if (t == 0) {
      sm_m[warp][r] = m;
      sm_l[warp][r] = l;
    }
#pragma unroll
    for (int i = 0; i < NT; i++) {
      sm_acc[warp][r][(D / 8) * (2 * t) + i] = o[i][0];
      sm_acc[warp][r][(D / 8) * (2 * t + 1) + i] = o[i][1];
    }
  }
  __syncthreads();
  store_partials<T, D, 4, 8>(P, bh0, nq, split, sm_m, sm_l, sm_acc);
}

/* ---- a prefill chunk over a compressed cache on tensor cores (many query rows) ----
 * The decode kernels serve a few rows (the <= 8 heads of one query position)
 * per read of the cache; a chunk of T queries has T G rows a KV head, and
 * reading the cache once per 8 of them costs T G / 8 reads. Here a block of 4
 * warps takes 64 rows of one KV head in (t, g) order (row i = query t = i /
 * G of head g = i % G; a warp 16 of them, all of the mma's A rows): the block
 * copies a tile of 64 keys' codes and scales into shared memory with
 * cp.async (the next tile's copies in flight during this tile's products),
 * converts it once into f16 tiles (K as its codes, V times its scale), and
 * the warps read their B fragments with ldmatrix (V transposed):
 * FlashAttention-2's loop with the dequantization in the load. Each row
 * keeps its own last visible key (query t sees keys < lens[b] - (T - 1 - t),
 * and the window); masks run only on tiles that reach past the warp's first
 * row's last key or below its last row's window. Rows of 8 dims (16 bytes)
 * are XOR-swizzled by key & 7 so that ldmatrix's 8 rows fall in different
 * banks. Q's A fragments, S's accumulators reused as P's A fragments and the
 * output are the standard m16n8k16 layouts. No slices along the cache:
 * run_decode takes this kernel when the chunk's blocks fill the GPU. Grid
 * (row blocks of a KV head, B Hkv); q, out (B, T, H, D). */
constexpr int CH_BK = 64; /* keys a tile */
/* shared memory: K and V tiles in f16 (2 x CH_BK D halves), the codes' staging (2 x CH_BK D bytes), the
 * staged scales (2 x CH_BK) and the keys' scales of the converted tile (CH_BK) */
constexpr int chunk_smem(int D) { return CH_BK * D * 2 * 2 + CH_BK * D * 2 + CH_BK * 4 * 3; }

template <typename T, int D, int FMT> __global__ void __launch_bounds__(128, D == 64 ? 3 : 1) k_attn_chunk_sm(DecP P) {
  static_assert(FMT != 0, "chunk: codes only");
  constexpr int KS = D / 16, NT = D / 8; /* k-steps of S; n-tiles of O */
  constexpr int PIECES = CH_BK * D / 16 / 128; /* 16-byte pieces of codes a thread copies a tile, K and V each */
  extern __shared__ __align__(16) char ch_smem[];
  __half *sk = (__half *)ch_smem, *sv = sk + CH_BK * D;
  uint8_t *stk = (uint8_t *)(sv + CH_BK * D), *stv = stk + CH_BK * D;
  float *sts = (float *)(stv + CH_BK * D), *sks = sts + 2 * CH_BK; /* sts: ks then vs of the staged tile */
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3, g = lane >> 2;
  const int bkv = blockIdx.y, b = bkv / P.Hkv, hk = bkv % P.Hkv, GT = P.G * P.T;
  const int ib = blockIdx.x * 64, i0 = ib + warp * 16; /* the block's and the warp's first rows */
  const int len = dec_len(P, b);
  auto nv_of = [&](int i) { return max(0, len - (P.T - 1 - i / P.G)); }; /* keys row i sees */
  int qrow[2], nv[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int i = min(i0 + g + 8 * h, GT - 1), tq = i / P.G;
    qrow[h] = (b * P.T + tq) * P.H + hk * P.G + (i - tq * P.G);
    nv[h] = nv_of(i);
  }
  const float sl2 = P.scale * LOG2E;
  constexpr float unit = FMT == GP_KV_FP8 ? FP8_UNIT : 1.f;
  uint32_t qa[KS][4];
  {
    const T *q0 = (const T *)P.q + (int64_t)qrow[0] * D, *q1 = (const T *)P.q + (int64_t)qrow[1] * D;
#pragma unroll
    for (int s = 0; s < KS; s++) {
      const int c = 16 * s + 2 * t;
      qa[s][0] = pack2<__half>(ld(q0[c]), ld(q0[c + 1]));
      qa[s][1] = pack2<__half>(ld(q1[c]), ld(q1[c + 1]));
      qa[s][2] = pack2<__half>(ld(q0[c + 8]), ld(q0[c + 9]));
      qa[s][3] = pack2<__half>(ld(q1[c + 8]), ld(q1[c + 9]));
    }
  }
  float o[NT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < NT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  const uint8_t *kc = (const uint8_t *)P.kc + (int64_t)bkv * P.C * D, *vc = (const uint8_t *)P.vc + (int64_t)bkv * P.C * D;
  const float *ks = P.ks + (int64_t)bkv * P.C, *vs = P.vs + (int64_t)bkv * P.C;
  const uint32_t stk_u = smem_u32(stk), stv_u = smem_u32(stv);
  const uint32_t sts_u = smem_u32(sts);
  /* a tile's codes and scales into the staging (piece p: key p / (D/16), 16 codes at (p % (D/16)) 16), zeros past hi */
  auto stage = [&](int w0, int hi) {
#pragma unroll
    for (int e = 0; e < PIECES; e++) {
      const int p = tid + 128 * e, j = w0 + p / (D / 16), c = p % (D / 16);
      const bool ok = j < hi;
      const int64_t off = (int64_t)(ok ? j : 0) * D + c * 16;
      cp_async16(stk_u + p * 16, kc + off, ok ? 16 : 0);
      cp_async16(stv_u + p * 16, vc + off, ok ? 16 : 0);
    }
    {
      const int j = w0 + (tid & (CH_BK - 1));
      const bool ok = j < hi;
      cp_async4(sts_u + tid * 4, (tid < CH_BK ? ks : vs) + (ok ? j : 0), ok ? 4 : 0);
    }
    cp_async_commit();
  };
  /* the staged codes to f16 (V times its scale) in the swizzled tiles: piece (key, c) -> f16 pieces 2c, 2c + 1 */
  auto convert = [&]() {
#pragma unroll
    for (int e = 0; e < PIECES; e++) {
      const int p = tid + 128 * e, key = p / (D / 16), c = p % (D / 16);
      const uint4 kq = *(const uint4 *)(stk + p * 16), vq = *(const uint4 *)(stv + p * 16);
      const uint32_t *kw = (const uint32_t *)&kq, *vw = (const uint32_t *)&vq;
      uint32_t hk8[8], hv8[8];
      const __half2 s2 = __float2half2_rn(sts[CH_BK + key] * unit);
#pragma unroll
      for (int w = 0; w < 4; w++) {
        codes_h2<FMT>(kw[w], hk8[2 * w], hk8[2 * w + 1]);
        codes_h2<FMT>(vw[w], hv8[2 * w], hv8[2 * w + 1]);
#pragma unroll
        for (int u = 0; u < 2; u++) {
          __half2 h = __hmul2(*(__half2 *)&hv8[2 * w + u], s2);
          hv8[2 * w + u] = *(uint32_t *)&h;
        }
      }
#pragma unroll
      for (int u = 0; u < 2; u++) {
        const int off = key * D + (((2 * c + u) ^ (key & 7)) << 3);
        *(uint4 *)(sk + off) = make_uint4(hk8[4 * u], hk8[4 * u + 1], hk8[4 * u + 2], hk8[4 * u + 3]);
        *(uint4 *)(sv + off) = make_uint4(hv8[4 * u], hv8[4 * u + 1], hv8[4 * u + 2], hv8[4 * u + 3]);
      }
    }
    if (tid < CH_BK) sks[tid] = sts[tid] * (sl2 * unit);
  };
  const uint32_t skb = smem_u32(sk), svb = smem_u32(sv);
  const bool active = i0 < GT; /* a warp past the rows still copies and converts (the barriers) */
  const int whi = nv_of(min(i0 + 15, GT - 1)), wnf = nv_of(min(i0, GT - 1));
  /* the block's keys [lo, hi): the union of its rows' */
  auto run = [&](int lo, int hi) {
    if (lo >= hi) return; /* block-uniform */
    stage(lo, hi);
    for (int w0 = lo; w0 < hi; w0 += CH_BK) {
      cp_async_wait<0>();
      __syncthreads(); /* the tile is staged; the last tile's products are done */
      convert();
      __syncthreads();
      if (w0 + CH_BK < hi) stage(w0 + CH_BK, hi); /* in flight during the products */
      if (!active) continue;
      /* S = Q K^T: 8 n-tiles of 8 keys */
      float sc[CH_BK / 8][4];
#pragma unroll
      for (int c = 0; c < CH_BK / 8; c++) {
        sc[c][0] = sc[c][1] = sc[c][2] = sc[c][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; s += 2) {
          uint32_t r[4];
          const int key = 8 * c + (lane & 7), pc = 2 * s + (lane >> 3);
          ldsm_x4(r, skb + 2 * (key * D + ((pc ^ (key & 7)) << 3)));
          mma16816<__half>(sc[c], qa[s], r[0], r[1]);
          mma16816<__half>(sc[c], qa[s + 1], r[2], r[3]);
        }
      }
      const int w1 = w0 + CH_BK;
      const bool whole = w1 <= min(hi, wnf) && (P.win <= 0 || w0 > whi - 1 - P.win || w1 <= P.ng);
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int c = 0; c < CH_BK / 8; c++) {
        const float2 kk = *(const float2 *)&sks[8 * c + 2 * t];
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int h = e >> 1, j = w0 + 8 * c + 2 * t + (e & 1);
          const bool ok = whole || (j < hi && vis(nv[h] - 1, j, P.win, P.ng, 1));
          sc[c][e] = ok ? sc[c][e] * ((e & 1) ? kk.y : kk.x) : -INFINITY;
          mx[h] = fmaxf(mx[h], sc[c][e]);
        }
      }
      float ms[2];
#pragma unroll
      for (int h = 0; h < 2; h++) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL, mx[h], 2));
        ms[h] = mx[h] == -INFINITY ? 0.f : mx[h];
        const float alpha = ex2(m[h] - ms[h]);
        m[h] = mx[h];
        l[h] *= alpha;
#pragma unroll
        for (int i = 0; i < NT; i++) o[i][2 * h] *= alpha, o[i][2 * h + 1] *= alpha;
      }
      /* O += P V: 4 k-steps of 16 keys, P's A fragment from S's accumulators */
#pragma unroll
      for (int kk = 0; kk < CH_BK / 16; kk++) {
        uint32_t pa[4];
#pragma unroll
        for (int u = 0; u < 2; u++)
#pragma unroll
          for (int h = 0; h < 2; h++) {
            const float p0 = ex2(sc[2 * kk + u][2 * h] - ms[h]), p1 = ex2(sc[2 * kk + u][2 * h + 1] - ms[h]);
            l[h] += p0 + p1;
            pa[2 * u + h] = pack2<__half>(p0, p1);
          }
#pragma unroll
        for (int i = 0; i < NT; i += 2) {
          uint32_t r[4];
          const int key = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1), pc = i + (lane >> 4);
          ldsm_x4_t(r, svb + 2 * (key * D + ((pc ^ (key & 7)) << 3)));
          mma16816<__half>(o[i], pa, r[0], r[1]);
          mma16816<__half>(o[i + 1], pa, r[2], r[3]);
        }
      }
    }
  };
  const int bhi = nv_of(min(ib + 63, GT - 1)), bnf = nv_of(ib);
  if (P.win > 0) {
    run(0, min(bhi, P.ng));
    run(max(P.ng, bnf - P.win), bhi);
  } else {
    run(0, bhi);
  }
  if (!active) return;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    l[h] += __shfl_xor_sync(FULL, l[h], 1);
    l[h] += __shfl_xor_sync(FULL, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    if (i0 + g + 8 * h >= GT) continue;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    T *orow = (T *)P.out + (int64_t)qrow[h] * D;
#pragma unroll
    for (int i = 0; i < NT; i++) {
      orow[8 * i + 2 * t] = st<T>(o[i][2 * h] * inv);
      orow[8 * i + 2 * t + 1] = st<T>(o[i][2 * h + 1] * inv);
    }
  }
}

/* the spans the decode kernels write: out and the partials */
inline gp_spans dec_writes(const DecP &P) {
  return {gp_span{P.out, P.out_n}, gp_span{P.part, P.part ? P.part_n : 0}};
}

/* the split kernel for P, or (per_sm not null) only the blocks of it an SM holds at once */
template <typename T, int D, bool VEC, int FMT, int NQ> void launch_split(const DecP &P, int64_t BH, int *per_sm) {
  if (per_sm) {
    static int cached; /* per kernel: the query costs microseconds, decode runs every layer of every step */
    if (!cached && (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&cached, k_attn_decode_split<T, D, VEC, FMT, NQ>,
                                                                  128, 0) != cudaSuccess || cached < 1)) {
      cudaGetLastError();
      cached = 1;
    }
    *per_sm = cached;
    return;
  }
  const dim3 grid((unsigned)P.nsplit, (unsigned)(BH / NQ));
  gp_launch_chain(k_attn_decode_split<T, D, VEC, FMT, NQ>, grid, dim3(128), 0, {}, dec_writes(P), P);
}

/* the tensor-core kernel for P (nq query heads a block), or (per_sm) its blocks an SM holds */
template <typename T, int D, int FMT> void launch_tc(const DecP &P, int64_t BH, int nq, int *per_sm) {
  if (per_sm) {
    static int cached;
    if (!cached && (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&cached, k_attn_decode_tc<T, D, FMT>, 128, 0) !=
                        cudaSuccess ||
                    cached < 1)) {
      cudaGetLastError();
      cached = 1;
    }
    *per_sm = cached;
    return;
  }
  const dim3 grid((unsigned)P.nsplit, (unsigned)(BH / nq));
  gp_launch_chain(k_attn_decode_tc<T, D, FMT>, grid, dim3(128), 0, {}, dec_writes(P), P, nq);
}

template <typename T, int D, int FMT> void launch_decode(const DecP &P, int64_t BH, bool vec, int nq, int *per_sm) {
  if constexpr (!std::is_same<T, float>::value) {
    if (vec && nq >= 2 && decode_tc()) {
      launch_tc<T, D, FMT>(P, BH, nq, per_sm);
      if (!per_sm && P.nsplit > 1) gp_launch_chain(k_attn_decode_combine<T, D>, dim3((unsigned)BH), dim3(D), 0, {}, dec_writes(P), P);
      return;
    }
  }
  if (!vec) launch_split<T, D, false, FMT, 1>(P, BH, per_sm); /* unaligned: rare, one head a block */
  else if (nq == 4) launch_split<T, D, true, FMT, 4>(P, BH, per_sm);
  else if (nq == 3) launch_split<T, D, true, FMT, 3>(P, BH, per_sm);
  else if (nq == 2) launch_split<T, D, true, FMT, 2>(P, BH, per_sm);
  else launch_split<T, D, true, FMT, 1>(P, BH, per_sm);
  if (!per_sm && P.nsplit > 1) gp_launch_chain(k_attn_decode_combine<T, D>, dim3((unsigned)BH), dim3(D), 0, {}, dec_writes(P), P);
}

template <int FMT> void decode_fmt(const DecP &P, int64_t BH, int dtype, int D, bool vec, int nq, int *per_sm) {
  if (D == 64) {
    GP_FLOAT_SWITCH(dtype, T, (launch_decode<T, 64, FMT>(P, BH, vec, nq, per_sm)));
  } else {
    GP_FLOAT_SWITCH(dtype, T, (launch_decode<T, 128, FMT>(P, BH, vec, nq, per_sm)));
  }
}

/* the many-row kernel for P (B sequences); false when it cannot run (f32 queries, its shared memory refused) */
template <typename T, int D, int FMT> bool launch_chunk(const DecP &P, int64_t B) {
  if constexpr (std::is_same<T, float>::value || FMT == 0) {
    return false;
  } else {
    static int ready_by_dev[8]; /* the shared memory attribute by device: 1 set, -1 refused */
    constexpr int smem = chunk_smem(D);
    int dev = 0;
    cudaGetDevice(&dev);
    int &ready = ready_by_dev[dev >= 0 && dev < 8 ? dev : 0];
    if (!ready)
      ready = cudaFuncSetAttribute(k_attn_chunk_sm<T, D, FMT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) ==
                      cudaSuccess
                  ? 1
                  : (cudaGetLastError(), -1);
    if (ready < 0) return false;
    const dim3 grid((unsigned)((P.G * P.T + 63) / 64), (unsigned)(B * P.Hkv));
    GP_NOTE_LAUNCH((k_attn_chunk_sm<T, D, FMT>), 128, smem);
    k_attn_chunk_sm<T, D, FMT><<<grid, 128, smem, gp_cuda_stream()>>>(P);
    return true;
  }
}
template <int FMT> bool chunk_fmt(const DecP &P, int64_t B, int dtype, int D) {
  bool ok = false;
  if (D == 64) {
    GP_FLOAT_SWITCH(dtype, T, ok = (launch_chunk<T, 64, FMT>(P, B)));
  } else {
    GP_FLOAT_SWITCH(dtype, T, ok = (launch_chunk<T, 128, FMT>(P, B)));
  }
  return ok;
}

} // namespace

/* a prefill chunk of P.T queries a sequence (B sequences) over codes (fmt 1, 2) with the many-row kernel:
 * bf16/f16 queries, 16-byte aligned operands; false: launched nothing (take the decode kernels) */
bool chunk_tc(const DecP &P, int64_t B, int dtype, int D, int fmt) {
  if (fmt == GP_KV_INT8) return chunk_fmt<GP_KV_INT8>(P, B, dtype, D);
  if (fmt == GP_KV_FP8) return chunk_fmt<GP_KV_FP8>(P, B, dtype, D);
  return false;
}

/* fmt 0: a cache in q's dtype; 1, 2: int8 or fp8 codes with P.ks, P.vs; nq
 * query heads a block (decode_heads_per_block). per_sm not null: launch
 * nothing, say how many blocks of the split kernel an SM holds at once */
int decode(const DecP &P, int64_t BH, int dtype, int D, bool vec, int fmt, int nq, int *per_sm) {
  if (fmt == GP_KV_INT8) decode_fmt<GP_KV_INT8>(P, BH, dtype, D, vec, nq, per_sm);
  else if (fmt == GP_KV_FP8) decode_fmt<GP_KV_FP8>(P, BH, dtype, D, vec, nq, per_sm);
  else decode_fmt<0>(P, BH, dtype, D, vec, nq, per_sm);
  return GP_OK;
}

/* the tensor-core kernel serves grouped-query heads of bf16/f16 queries
 * unless GP_ATTN_DECODE=cores (read once a process) */
bool decode_tc() {
  static int tc = -1;
  if (tc < 0) {
    const char *e = getenv("GP_ATTN_DECODE");
    tc = !(e && !strcmp(e, "cores"));
  }
  return tc;
}

/* the query heads a block takes: with tensor cores (tc: bf16/f16 queries,
 * G >= 2) the most of 8..2 that divides the group G, else the most of 4, 3,
 * 2 (1 without grouped-query attention) */
int decode_heads_per_block(int G, bool tc) {
  for (int nq = tc && G > 1 && decode_tc() ? 8 : 4; nq > 1; nq--)
    if (G % nq == 0) return nq;
  return 1;
}

} // namespace gp_attn
