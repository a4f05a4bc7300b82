/* attention_decode.cu: decode attention (one query per sequence over its
 * cache) on the GPU: split-K (flash-decoding): blocks over slices of the
 * cache per (b, h), each a partial (max, sum, acc), then a combine kernel. */
#include "attention.cuh"

namespace gp_attn {
namespace {

__device__ __forceinline__ int dec_len(const DecP &P, int b) {
  int64_t n = P.lens64 ? ((const int64_t *)P.lens)[b] : ((const int32_t *)P.lens)[b];
  return (int)(n < 0 ? 0 : n > P.C ? P.C : n); /* clamped: never outside the cache */
}

/* 16 bytes at p: one load (VEC: p 16-byte aligned) or element by element */
template <typename T, bool VEC> __device__ __forceinline__ uint4 ld16(const T *p) {
  if constexpr (VEC) {
    return *(const uint4 *)p;
  } else {
    uint4 v;
    T *e = (T *)&v;
#pragma unroll
    for (int t = 0; t < 16 / (int)sizeof(T); t++) e[t] = p[t];
    return v;
  }
}
/* one 16-byte vector of a row as floats */
template <typename T, int N> __device__ __forceinline__ void vec_f32(float *f, const uint4 &v) {
  const T *e = (const T *)&v;
#pragma unroll
  for (int t = 0; t < N; t++) f[t] = ld(e[t]);
}

/* one (b, h) and one slice of its cache a block: each key's row is read by
 * LPK lanes with 16-byte loads (a warp reads KPW consecutive keys, 512
 * bytes, at a time), U keys a lane group in flight, one online-softmax
 * rescale per U keys (base 2); the 4 KPW lane groups' partials meet in
 * shared memory and go to part (m in log2 units). VEC: q, kc and vc start
 * 16-byte aligned (else the vectors are read element by element). */
template <typename T, int D, bool VEC> __global__ void __launch_bounds__(128) k_attn_decode_split(DecP P) {
  constexpr int EPL = 16 / (int)sizeof(T), LPK = D / EPL, KPW = 32 / LPK, NPART = 4 * KPW, U = 4;
  static_assert(LPK <= 32 && 32 % LPK == 0, "decode: a key's row is 16-byte vectors of one warp");
  __shared__ float sm_m[NPART], sm_l[NPART], sm_acc[NPART][D];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane % LPK;
  const int gi = warp * KPW + lane / LPK; /* the lane group */
  const int bh = blockIdx.y, b = bh / P.H, split = blockIdx.x;
  const int n = dec_len(P, b), p = n - 1;
  const int jb = split * P.chunk, je = min(n, jb + P.chunk);
  float qr[EPL], acc[EPL];
  {
    const uint4 qv = ld16<T, VEC>((const T *)P.q + (int64_t)bh * D + sub * EPL);
    vec_f32<T, EPL>(qr, qv);
  }
  const float sl2 = P.scale * LOG2E;
#pragma unroll
  for (int t = 0; t < EPL; t++) {
    qr[t] *= sl2;
    acc[t] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const T *kc = (const T *)P.kc + (int64_t)bh * P.C * D + sub * EPL;
  const T *vc = (const T *)P.vc + (int64_t)bh * P.C * D + sub * EPL;
  /* keys [lo, hi): the block walks NPART U of them at a time (a uniform
   * trip count: every lane takes part in the shuffles) */
  auto run = [&](int lo, int hi) {
    for (int base = lo; base < hi; base += NPART * U) {
      uint4 kv[U], vv[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int j = base + u * NPART + gi;
        const bool ok = j < hi;
        kv[u] = ok ? ld16<T, VEC>(kc + (int64_t)j * D) : make_uint4(0, 0, 0, 0);
        vv[u] = ok ? ld16<T, VEC>(vc + (int64_t)j * D) : make_uint4(0, 0, 0, 0);
      }
      float sc[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        float kf[EPL];
        vec_f32<T, EPL>(kf, kv[u]);
        float d = 0.f;
#pragma unroll
        for (int t = 0; t < EPL; t++) d = fmaf(qr[t], kf[t], d);
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(FULL, d, o);
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
        vec_f32<T, EPL>(vf, vv[u]);
        l += e;
#pragma unroll
        for (int t = 0; t < EPL; t++) acc[t] = fmaf(e, vf[t], acc[t]);
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

template <typename T, int D> void launch_decode(const DecP &P, int64_t BH, bool vec) {
  dim3 grid((unsigned)P.nsplit, (unsigned)BH);
  if (vec) {
    GP_NOTE_LAUNCH((k_attn_decode_split<T, D, true>), 128, 0);
    k_attn_decode_split<T, D, true><<<grid, 128, 0, gp_cuda_stream()>>>(P);
  } else {
    GP_NOTE_LAUNCH((k_attn_decode_split<T, D, false>), 128, 0);
    k_attn_decode_split<T, D, false><<<grid, 128, 0, gp_cuda_stream()>>>(P);
  }
  k_attn_decode_combine<T, D><<<(unsigned)BH, D, 0, gp_cuda_stream()>>>(P);
}

} // namespace

int decode(const DecP &P, int64_t BH, int dtype, int D, bool vec) {
  if (D == 64) {
    GP_FLOAT_SWITCH(dtype, T, launch_decode<T, 64>(P, BH, vec));
  } else {
    GP_FLOAT_SWITCH(dtype, T, launch_decode<T, 128>(P, BH, vec));
  }
  return GP_OK;
}

} // namespace gp_attn
