/* attention_plain.cu: flash attention in plain tiled kernels, for what the
 * tensor-core kernels do not take: f32, head dim 32, views whose rows are not
 * 16-byte aligned (any float dtype, D 32, 64, 128). K/V tiles in shared
 * memory, one key per lane, FMA in f32. The backward: the same tiling in two
 * kernels, dq by query blocks and dk/dv by key blocks (no atomics). */
#include "attention.cuh"

namespace gp_attn {
namespace {

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}

/* forward: a block of 4 warps owns 4 * RW query rows (RW per warp); K/V tiles
 * of 32 keys in shared memory; lane = key for the scores, lane = dims for the
 * output accumulators */
template <typename T, int D, int RW> __global__ void __launch_bounds__(128) k_attn_fwd_plain(AttnP P) {
  constexpr int GM = 4 * RW, GN = 32, DT = D / 32;
  __shared__ float Qs[GM][D];
  __shared__ float Ks[GN][D + 1];
  __shared__ float Vs[GN][D];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bh = blockIdx.y, i0 = blockIdx.x * GM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H);
  const T *v = (const T *)P.v + head_at(P.sv, bh, P.H);
  for (int e = threadIdx.x; e < GM * D; e += 128) {
    int r = e / D, d = e % D;
    Qs[r][d] = i0 + r < P.T ? ld(q[(int64_t)(i0 + r) * P.sq.r + d]) * P.scale : 0.f;
  }
  float m[RW], l[RW], acc[RW][DT];
#pragma unroll
  for (int r = 0; r < RW; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int t = 0; t < DT; t++) acc[r][t] = 0.f;
  }
  const int pmin = i0 + off, pmax = min(i0 + GM, P.T) - 1 + off;
  const int hi = P.causal ? min(P.S, pmax + 1) : P.S;
  for (int j0 = 0; j0 < hi; j0 += GN) {
    if (P.win > 0 && j0 >= P.ng && pmin - (j0 + GN - 1) >= P.win) continue; /* block-uniform */
    __syncthreads();
    for (int e = threadIdx.x; e < GN * D; e += 128) {
      int r = e / D, d = e % D, j = j0 + r;
      Ks[r][d] = j < P.S ? ld(k[(int64_t)j * P.sk.r + d]) : 0.f;
      Vs[r][d] = j < P.S ? ld(v[(int64_t)j * P.sv.r + d]) : 0.f;
    }
    __syncthreads();
    float s[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) s[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; d++) {
      float kd = Ks[lane][d];
#pragma unroll
      for (int r = 0; r < RW; r++) s[r] += Qs[warp * RW + r][d] * kd;
    }
    const int j = j0 + lane;
#pragma unroll
    for (int r = 0; r < RW; r++) {
      int row = i0 + warp * RW + r;
      bool ok = j < P.S && row < P.T && vis(row + off, j, P.win, P.ng, P.causal);
      float sv = ok ? s[r] : -INFINITY;
      float mn = fmaxf(m[r], warp_max(sv));
      float mu = mn == -INFINITY ? 0.f : mn;
      float alpha = expf(m[r] - mu);
      float pe = ok ? expf(sv - mu) : 0.f;
      l[r] = l[r] * alpha + warp_sum(pe);
      m[r] = mn;
#pragma unroll
      for (int t = 0; t < DT; t++) acc[r][t] *= alpha;
      s[r] = pe;
    }
    for (int jj = 0; jj < GN; jj++) {
      float pr[RW];
#pragma unroll
      for (int r = 0; r < RW; r++) pr[r] = __shfl_sync(FULL, s[r], jj);
#pragma unroll
      for (int t = 0; t < DT; t++) {
        float vv = Vs[jj][lane + 32 * t];
#pragma unroll
        for (int r = 0; r < RW; r++) acc[r][t] += pr[r] * vv;
      }
    }
  }
  T *o = (T *)P.out + head_at(P.so, bh, P.H);
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int row = i0 + warp * RW + r;
    if (row >= P.T) continue;
    float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma unroll
    for (int t = 0; t < DT; t++) o[(int64_t)row * P.so.r + lane + 32 * t] = st<T>(acc[r][t] * inv);
    if (lane == 0) P.lse[(int64_t)bh * P.T + row] = l[r] > 0.f ? m[r] + logf(l[r]) : -INFINITY;
  }
}

/* backward, dq: query blocks as in the forward; per key tile, lane = key:
 * P = exp(s - lse), dP = dout . v, dS = P (dP - Di); dq += dS k */
template <typename T, int D, int RW> __global__ void __launch_bounds__(128) k_attn_bwd_dq(AttnP P) {
  constexpr int GM = 4 * RW, GN = 32, DT = D / 32;
  __shared__ float Qs[GM][D];
  __shared__ float Gs[GM][D];
  __shared__ float Ks[GN][D + 1];
  __shared__ float Vs[GN][D + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bh = blockIdx.y, i0 = blockIdx.x * GM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H), *g = (const T *)P.dout + head_at(P.sg, bh, P.H);
  const T *o = (const T *)P.o + head_at(P.so, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H), *v = (const T *)P.v + head_at(P.sv, bh, P.H);
  for (int e = threadIdx.x; e < GM * D; e += 128) {
    int r = e / D, d = e % D;
    bool in = i0 + r < P.T;
    Qs[r][d] = in ? ld(q[(int64_t)(i0 + r) * P.sq.r + d]) * P.scale : 0.f;
    Gs[r][d] = in ? ld(g[(int64_t)(i0 + r) * P.sg.r + d]) : 0.f;
  }
  float Di[RW], L[RW], acc[RW][DT];
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int row = i0 + warp * RW + r;
    float s = 0.f;
    if (row < P.T)
#pragma unroll
      for (int t = 0; t < DT; t++)
        s += ld(g[(int64_t)row * P.sg.r + lane + 32 * t]) * ld(o[(int64_t)row * P.so.r + lane + 32 * t]);
    Di[r] = warp_sum(s);
    L[r] = row < P.T ? P.lse_in[(int64_t)bh * P.T + row] : 0.f;
#pragma unroll
    for (int t = 0; t < DT; t++) acc[r][t] = 0.f;
  }
  const int pmin = i0 + off, pmax = min(i0 + GM, P.T) - 1 + off;
  const int hi = P.causal ? min(P.S, pmax + 1) : P.S;
  for (int j0 = 0; j0 < hi; j0 += GN) {
    if (P.win > 0 && j0 >= P.ng && pmin - (j0 + GN - 1) >= P.win) continue;
    __syncthreads();
    for (int e = threadIdx.x; e < GN * D; e += 128) {
      int r = e / D, d = e % D, j = j0 + r;
      Ks[r][d] = j < P.S ? ld(k[(int64_t)j * P.sk.r + d]) : 0.f;
      Vs[r][d] = j < P.S ? ld(v[(int64_t)j * P.sv.r + d]) : 0.f;
    }
    __syncthreads();
    float s[RW], dp[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) s[r] = dp[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; d++) {
      float kd = Ks[lane][d], vd = Vs[lane][d];
#pragma unroll
      for (int r = 0; r < RW; r++) {
        s[r] += Qs[warp * RW + r][d] * kd;
        dp[r] += Gs[warp * RW + r][d] * vd;
      }
    }
    const int j = j0 + lane;
#pragma unroll
    for (int r = 0; r < RW; r++) {
      int row = i0 + warp * RW + r;
      bool ok = j < P.S && row < P.T && vis(row + off, j, P.win, P.ng, P.causal);
      s[r] = ok ? expf(s[r] - L[r]) * (dp[r] - Di[r]) : 0.f; /* dS */
    }
    for (int jj = 0; jj < GN; jj++) {
      float ds[RW];
#pragma unroll
      for (int r = 0; r < RW; r++) ds[r] = __shfl_sync(FULL, s[r], jj);
#pragma unroll
      for (int t = 0; t < DT; t++) {
        float kv = Ks[jj][lane + 32 * t];
#pragma unroll
        for (int r = 0; r < RW; r++) acc[r][t] += ds[r] * kv;
      }
    }
  }
  T *dq = (T *)P.dq + head_at(P.sdq, bh, P.H);
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int row = i0 + warp * RW + r;
    if (row >= P.T) continue;
#pragma unroll
    for (int t = 0; t < DT; t++) dq[(int64_t)row * P.sdq.r + lane + 32 * t] = st<T>(acc[r][t] * P.scale);
  }
}

/* backward, dk and dv: a block owns 4 * RW keys (RW per warp) and walks the
 * query tiles that see them (32 queries, lane = query):
 * dv += P dout, dk += dS q * scale */
template <typename T, int D, int RW> __global__ void __launch_bounds__(128) k_attn_bwd_dkdv(AttnP P) {
  constexpr int GK = 4 * RW, GQ = 32, DT = D / 32;
  __shared__ float Ks[GK][D];
  __shared__ float Vs[GK][D];
  __shared__ float Qs[GQ][D + 1];
  __shared__ float Gs[GQ][D + 1];
  __shared__ float Ls[GQ], Ds[GQ];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bh = blockIdx.y, j0 = blockIdx.x * GK, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H), *g = (const T *)P.dout + head_at(P.sg, bh, P.H);
  const T *o = (const T *)P.o + head_at(P.so, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H), *v = (const T *)P.v + head_at(P.sv, bh, P.H);
  for (int e = threadIdx.x; e < GK * D; e += 128) {
    int r = e / D, d = e % D;
    bool in = j0 + r < P.S;
    Ks[r][d] = in ? ld(k[(int64_t)(j0 + r) * P.sk.r + d]) : 0.f;
    Vs[r][d] = in ? ld(v[(int64_t)(j0 + r) * P.sv.r + d]) : 0.f;
  }
  float dk[RW][DT], dv[RW][DT];
#pragma unroll
  for (int r = 0; r < RW; r++)
#pragma unroll
    for (int t = 0; t < DT; t++) dk[r][t] = dv[r][t] = 0.f;
  const int jmax = min(j0 + GK, P.S) - 1;
  /* queries that may see a key of the block: i >= j0 - off (causal), and
   * p - jmax < win unless the block holds global keys */
  int ilo = P.causal ? max(0, j0 - off) : 0;
  int ihi = P.T;
  if (P.win > 0 && j0 >= P.ng) ihi = (int)min((int64_t)P.T, (int64_t)jmax + P.win - off);
  for (int ib = ilo; ib < ihi; ib += GQ) {
    __syncthreads();
    for (int e = threadIdx.x; e < GQ * D; e += 128) {
      int r = e / D, d = e % D, i = ib + r;
      Qs[r][d] = i < P.T ? ld(q[(int64_t)i * P.sq.r + d]) * P.scale : 0.f;
      Gs[r][d] = i < P.T ? ld(g[(int64_t)i * P.sg.r + d]) : 0.f;
    }
    for (int r = warp; r < GQ; r += 4) {
      int i = ib + r;
      float s = 0.f;
      if (i < P.T)
#pragma unroll
        for (int t = 0; t < DT; t++)
          s += ld(g[(int64_t)i * P.sg.r + lane + 32 * t]) * ld(o[(int64_t)i * P.so.r + lane + 32 * t]);
      s = warp_sum(s);
      if (lane == 0) {
        Ds[r] = s;
        Ls[r] = i < P.T ? P.lse_in[(int64_t)bh * P.T + i] : 0.f;
      }
    }
    __syncthreads();
    float pr[RW], ds[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) pr[r] = ds[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; d++) {
      float qd = Qs[lane][d], gd = Gs[lane][d];
#pragma unroll
      for (int r = 0; r < RW; r++) {
        pr[r] += qd * Ks[warp * RW + r][d];
        ds[r] += gd * Vs[warp * RW + r][d];
      }
    }
    const int i = ib + lane;
#pragma unroll
    for (int r = 0; r < RW; r++) {
      int j = j0 + warp * RW + r;
      bool ok = i < P.T && j < P.S && vis(i + off, j, P.win, P.ng, P.causal);
      float p = ok ? expf(pr[r] - Ls[lane]) : 0.f;
      ds[r] = p * (ds[r] - Ds[lane]);
      pr[r] = p;
    }
    for (int ii = 0; ii < GQ; ii++) {
      float pb[RW], db[RW];
#pragma unroll
      for (int r = 0; r < RW; r++) {
        pb[r] = __shfl_sync(FULL, pr[r], ii);
        db[r] = __shfl_sync(FULL, ds[r], ii);
      }
#pragma unroll
      for (int t = 0; t < DT; t++) {
        float gq = Gs[ii][lane + 32 * t], qq = Qs[ii][lane + 32 * t];
#pragma unroll
        for (int r = 0; r < RW; r++) {
          dv[r][t] += pb[r] * gq;
          dk[r][t] += db[r] * qq;
        }
      }
    }
  }
  T *pdk = (T *)P.dk + head_at(P.sdk, bh, P.H), *pdv = (T *)P.dv + head_at(P.sdv, bh, P.H);
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int j = j0 + warp * RW + r;
    if (j >= P.S) continue;
#pragma unroll
    for (int t = 0; t < DT; t++) {
      pdk[(int64_t)j * P.sdk.r + lane + 32 * t] = st<T>(dk[r][t]); /* q was scaled */
      pdv[(int64_t)j * P.sdv.r + lane + 32 * t] = st<T>(dv[r][t]);
    }
  }
}

/* zeros into a (B, H, R, D) operand at its strides */
template <typename T> __global__ void k_attn_zero(T *p, Str s, int64_t H, int64_t R, int64_t D, int64_t n) {
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t d = e % D, r = (e / D) % R, bh = e / (D * R);
    p[(bh / H) * s.b + (bh % H) * s.h + r * s.r + d] = st<T>(0.f);
  }
}

template <typename T, int D> int launch_fwd(const AttnP &P, int64_t BH) {
  constexpr int RW = D <= 64 ? 4 : 2;
  dim3 grid((unsigned)((P.T + 4 * RW - 1) / (4 * RW)), (unsigned)BH);
  GP_NOTE_LAUNCH((k_attn_fwd_plain<T, D, RW>), 128, 0);
  k_attn_fwd_plain<T, D, RW><<<grid, 128, 0, gp_cuda_stream()>>>(P);
  return GP_OK;
}

template <typename T, int D> int launch_bwd(const AttnP &P, int64_t BH) {
  constexpr int RW = D <= 64 ? 4 : 2;
  dim3 g1((unsigned)((P.T + 4 * RW - 1) / (4 * RW)), (unsigned)BH);
  GP_NOTE_LAUNCH((k_attn_bwd_dq<T, D, RW>), 128, 0);
  k_attn_bwd_dq<T, D, RW><<<g1, 128, 0, gp_cuda_stream()>>>(P);
  dim3 g2((unsigned)((P.S + 4 * RW - 1) / (4 * RW)), (unsigned)BH);
  GP_NOTE_LAUNCH((k_attn_bwd_dkdv<T, D, RW>), 128, 0);
  k_attn_bwd_dkdv<T, D, RW><<<g2, 128, 0, gp_cuda_stream()>>>(P);
  return GP_OK;
}

} // namespace

int fwd_plain(const AttnP &P, int64_t BH, int dtype, int D) {
  int rc = GP_OK;
  if (D == 32) {
    GP_FLOAT_SWITCH(dtype, T, rc = launch_fwd<T, 32>(P, BH));
  } else if (D == 64) {
    GP_FLOAT_SWITCH(dtype, T, rc = launch_fwd<T, 64>(P, BH));
  } else {
    GP_FLOAT_SWITCH(dtype, T, rc = launch_fwd<T, 128>(P, BH));
  }
  return rc;
}

int bwd_plain(const AttnP &P, int64_t BH, int dtype, int D) {
  int rc = GP_OK;
  if (D == 32) {
    GP_FLOAT_SWITCH(dtype, T, rc = launch_bwd<T, 32>(P, BH));
  } else if (D == 64) {
    GP_FLOAT_SWITCH(dtype, T, rc = launch_bwd<T, 64>(P, BH));
  } else {
    GP_FLOAT_SWITCH(dtype, T, rc = launch_bwd<T, 128>(P, BH));
  }
  return rc;
}

int zero_rows(const gp_tensor *t) {
  const int64_t n = gp_numel(t);
  if (n == 0) return GP_OK;
  const int64_t blocks = (n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096;
  GP_FLOAT_SWITCH(t->dtype, T,
                  k_attn_zero<T><<<(unsigned)blocks, 256, 0, gp_cuda_stream()>>>(
                      (T *)gp_ptr(t), strides(t), t->shape[1], t->shape[2], t->shape[3], n));
  return GP_OK;
}

} // namespace gp_attn
