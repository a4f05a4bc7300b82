/* attention_decode.cu: decode attention (one query per sequence over its
 * cache) on the GPU: split-K (flash-decoding): blocks over slices of the
 * cache per (b, h), each a partial (max, sum, acc), then a combine kernel.
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

/* a vector of 16, 8 or 4 bytes */
template <int BYTES> struct RawVec;
template <> struct RawVec<16> {
  using type = uint4;
};
template <> struct RawVec<8> {
  using type = uint2;
};
template <> struct RawVec<4> {
  using type = uint32_t;
};

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
/* the N elements of a vector as floats: T's (FMT 0) or codes (FMT 1 int8, 2 fp8; before the scale) */
template <typename T, int FMT, int N, typename R> __device__ __forceinline__ void vec_f32(float *f, const R &v) {
  if constexpr (FMT == 0) {
    const T *e = (const T *)&v;
#pragma unroll
    for (int t = 0; t < N; t++) f[t] = ld(e[t]);
  } else {
    const uint8_t *e = (const uint8_t *)&v;
#pragma unroll
    for (int t = 0; t < N; t++) f[t] = kvq_decode_d<FMT>(e[t]);
  }
}

/* one (b, h) and one slice of its cache a block: each key's row is read by
 * LPK lanes with 16-byte loads (a warp reads KPW consecutive keys, 512
 * bytes, at a time), U keys a lane group in flight, one online-softmax
 * rescale per U keys (base 2); the 4 KPW lane groups' partials meet in
 * shared memory and go to part (m in log2 units). VEC: q, kc and vc start
 * 16-byte aligned (else the vectors are read element by element). FMT 1, 2:
 * the cache holds one-byte codes (int8, fp8 e4m3) and f32 scales per
 * position (P.ks, P.vs): a lane reads its EPL codes of a row (8 or 4
 * bytes), dequantized in registers (a score is the dot with the codes times
 * the key's scale; a value row's weight takes its scale). */
template <typename T, int D, bool VEC, int FMT> __global__ void __launch_bounds__(128) k_attn_decode_split(DecP P) {
  constexpr int EPL = 16 / (int)sizeof(T), LPK = D / EPL, KPW = 32 / LPK, NPART = 4 * KPW, U = 4;
  using C = typename std::conditional<FMT == 0, T, uint8_t>::type; /* a cache element */
  using R = typename RawVec<EPL * (int)sizeof(C)>::type;            /* a lane's part of a cache row */
  static_assert(LPK <= 32 && 32 % LPK == 0, "decode: a key's row is 16-byte vectors of one warp");
  __shared__ float sm_m[NPART], sm_l[NPART], sm_acc[NPART][D];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane % LPK;
  const int gi = warp * KPW + lane / LPK; /* the lane group */
  const int bh = blockIdx.y, b = bh / P.H, split = blockIdx.x;
  const int n = dec_len(P, b), p = n - 1;
  const int jb = split * P.chunk, je = min(n, jb + P.chunk);
  float qr[EPL], acc[EPL];
  {
    const uint4 qv = ld_vec<uint4, T, VEC>((const T *)P.q + (int64_t)bh * D + sub * EPL);
    vec_f32<T, 0, EPL>(qr, qv);
  }
  const float sl2 = P.scale * LOG2E;
#pragma unroll
  for (int t = 0; t < EPL; t++) {
    qr[t] *= sl2;
    acc[t] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int64_t bkv = P.G == 1 ? bh : (int64_t)b * P.Hkv + (bh % P.H) / P.G; /* the KV head of query head bh */
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
          ksc[u] = ok ? ks[j] : 0.f;
          vsc[u] = ok ? vs[j] : 0.f;
        }
      }
      float sc[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        float kf[EPL];
        vec_f32<T, FMT, EPL>(kf, kv[u]);
        float d = 0.f;
#pragma unroll
        for (int t = 0; t < EPL; t++) d = fmaf(qr[t], kf[t], d);
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(FULL, d, o);
        if constexpr (FMT != 0) d *= ksc[u];
        sc[u] = base + u * NPART + gi < hi ? d : -INFINITY;
      }
      float mn = m;
#pragma unroll
      for (int u = 0; u < U; u++) mn = fmaxf(mn, sc[u]);
      if (mn == -INFINITY) continue;   /* none of this group's keys */
      const float alpha = ex2(m - mn); /* m = -inf: 0 */
      l *= alpha;
#pragma unroll
      for (int t = 0; t < EPL; t++) acc[t] *= alpha;
#pragma unroll
      for (int u = 0; u < U; u++) {
        const float e = ex2(sc[u] - mn);
        float vf[EPL];
        vec_f32<T, FMT, EPL>(vf, vv[u]);
        l += e;
        const float ev = FMT ? e * vsc[u] : e;
#pragma unroll
        for (int t = 0; t < EPL; t++) acc[t] = fmaf(ev, vf[t], acc[t]);
      }
      m = mn;
    }
  };
  if (P.win > 0) { /* the leading visible keys, then the window */
    run(jb, min(je, P.ng));
    run(max(jb, max(P.ng, p - P.win + 1)), je);
  } else {
    run(jb, je);
  }
  if (sub == 0) {
    sm_m[gi] = m;
    sm_l[gi] = l;
  }
#pragma unroll
  for (int t = 0; t < EPL; t++) sm_acc[gi][sub * EPL + t] = acc[t];
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int i = 0; i < NPART; i++) M = fmaxf(M, sm_m[i]);
  float *part = P.part + ((int64_t)bh * P.nsplit + split) * (D + 2);
  for (int d = threadIdx.x; d < D; d += 128) {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < NPART; i++) a += (sm_m[i] == -INFINITY ? 0.f : ex2(sm_m[i] - M)) * sm_acc[i][d];
    part[d] = a;
  }
  if (threadIdx.x == 0) {
    float L = 0.f;
#pragma unroll
    for (int i = 0; i < NPART; i++) L += sm_m[i] == -INFINITY ? 0.f : ex2(sm_m[i] - M) * sm_l[i];
    part[D] = M;
    part[D + 1] = L;
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

template <typename T, int D, int FMT> void launch_decode(const DecP &P, int64_t BH, bool vec) {
  dim3 grid((unsigned)P.nsplit, (unsigned)BH);
  if (vec) {
    GP_NOTE_LAUNCH((k_attn_decode_split<T, D, true, FMT>), 128, 0);
    k_attn_decode_split<T, D, true, FMT><<<grid, 128, 0, gp_cuda_stream()>>>(P);
  } else {
    GP_NOTE_LAUNCH((k_attn_decode_split<T, D, false, FMT>), 128, 0);
    k_attn_decode_split<T, D, false, FMT><<<grid, 128, 0, gp_cuda_stream()>>>(P);
  }
  k_attn_decode_combine<T, D><<<(unsigned)BH, D, 0, gp_cuda_stream()>>>(P);
}

template <int FMT> void decode_fmt(const DecP &P, int64_t BH, int dtype, int D, bool vec) {
  if (D == 64) {
    GP_FLOAT_SWITCH(dtype, T, (launch_decode<T, 64, FMT>(P, BH, vec)));
  } else {
    GP_FLOAT_SWITCH(dtype, T, (launch_decode<T, 128, FMT>(P, BH, vec)));
  }
}

} // namespace

/* fmt 0: a cache in q's dtype; 1, 2: int8 or fp8 codes with P.ks, P.vs */
int decode(const DecP &P, int64_t BH, int dtype, int D, bool vec, int fmt) {
  if (fmt == GP_KV_INT8) decode_fmt<GP_KV_INT8>(P, BH, dtype, D, vec);
  else if (fmt == GP_KV_FP8) decode_fmt<GP_KV_FP8>(P, BH, dtype, D, vec);
  else decode_fmt<0>(P, BH, dtype, D, vec);
  return GP_OK;
}

} // namespace gp_attn
