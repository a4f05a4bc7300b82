/* attention_decode.cu: decode attention (one query per sequence over its
 * cache) on the GPU: split-K (flash-decoding): blocks over slices of the
 * cache per (b, h), each a partial (max, sum, acc), then a combine kernel;
 * with one slice (short caches) the block writes the output itself.
 * Query head h reads KV head h / G of the cache (grouped-query attention). */
#include <type_traits>

#include "attention.cuh"
#include "kvquant.cuh"

namespace gp_attn {
namespace {

__device__ __forceinline__ int dec_len(const DecP &P, int b) {
  int64_t n = P.lens64 ? ((const int64_t *)P.lens)[b] : ((const int32_t *)P.lens)[b];
  return (int)(n < 0 ? 0 : n > P.C ? P.C : n); /* clamped: never outside the cache */
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
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane % LPK;
  const int gi = warp * KPW + lane / LPK; /* the lane group */
  const int bh0 = blockIdx.y * NQ, b = bh0 / P.H, split = blockIdx.x;
  const int n = dec_len(P, b), p = n - 1;
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
  const int64_t bkv = P.G == 1 ? bh0 : (int64_t)b * P.Hkv + (bh0 % P.H) / P.G; /* the KV head of the block */
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
#pragma unroll
  for (int g = 0; g < NQ; g++) {
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

/* the splits' partials of one (b, h): weights 2^(m_s - M) */
template <typename T, int D> __global__ void __launch_bounds__(D) k_attn_decode_combine(DecP P) {
  const int bh = blockIdx.x, d = threadIdx.x;
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
  GP_NOTE_LAUNCH((k_attn_decode_split<T, D, VEC, FMT, NQ>), 128, 0);
  k_attn_decode_split<T, D, VEC, FMT, NQ><<<grid, 128, 0, gp_cuda_stream()>>>(P);
}

template <typename T, int D, int FMT> void launch_decode(const DecP &P, int64_t BH, bool vec, int nq, int *per_sm) {
  if (!vec) launch_split<T, D, false, FMT, 1>(P, BH, per_sm); /* unaligned: rare, one head a block */
  else if (nq == 4) launch_split<T, D, true, FMT, 4>(P, BH, per_sm);
  else if (nq == 3) launch_split<T, D, true, FMT, 3>(P, BH, per_sm);
  else if (nq == 2) launch_split<T, D, true, FMT, 2>(P, BH, per_sm);
  else launch_split<T, D, true, FMT, 1>(P, BH, per_sm);
  if (!per_sm && P.nsplit > 1) k_attn_decode_combine<T, D><<<(unsigned)BH, D, 0, gp_cuda_stream()>>>(P);
}

template <int FMT> void decode_fmt(const DecP &P, int64_t BH, int dtype, int D, bool vec, int nq, int *per_sm) {
  if (D == 64) {
    GP_FLOAT_SWITCH(dtype, T, (launch_decode<T, 64, FMT>(P, BH, vec, nq, per_sm)));
  } else {
    GP_FLOAT_SWITCH(dtype, T, (launch_decode<T, 128, FMT>(P, BH, vec, nq, per_sm)));
  }
}

} // namespace

/* fmt 0: a cache in q's dtype; 1, 2: int8 or fp8 codes with P.ks, P.vs; nq
 * query heads a block (decode_heads_per_block). per_sm not null: launch
 * nothing, say how many blocks of the split kernel an SM holds at once */
int decode(const DecP &P, int64_t BH, int dtype, int D, bool vec, int fmt, int nq, int *per_sm) {
  if (fmt == GP_KV_INT8) decode_fmt<GP_KV_INT8>(P, BH, dtype, D, vec, nq, per_sm);
  else if (fmt == GP_KV_FP8) decode_fmt<GP_KV_FP8>(P, BH, dtype, D, vec, nq, per_sm);
  else decode_fmt<0>(P, BH, dtype, D, vec, nq, per_sm);
  return GP_OK;
}

/* the query heads a block takes: the most of 4, 3, 2 that divides the group G
 * (1 without grouped-query attention) */
int decode_heads_per_block(int G) {
  for (int nq = 4; nq > 1; nq--)
    if (G % nq == 0) return nq;
  return 1;
}

} // namespace gp_attn
