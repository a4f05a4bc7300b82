/* attention_mma.cu: flash attention on mma.sync tensor cores (bf16/f16, head
 * dims 64 and 128; sm_80 and later), FlashAttention-2 style.
 *
 * Forward: a CTA of 4 warps owns BM = 16 * MT * 4 query rows (32 rows a warp
 * at D 64, 16 at D 128) and walks the visible key tiles of BN = 64 keys: K/V
 * tiles are double-buffered in shared memory with cp.async (128-byte rows
 * XOR-swizzled by 16-byte chunk, so ldmatrix is conflict-free), S = Q K^T and
 * O += P V run on tensor cores (mma.sync m16n8k16, f32 accumulators), the
 * softmax is online in registers (base 2, one quad shuffle per row max), P
 * never leaves registers (the S accumulator fragment is the A fragment of
 * P V). Causal tiles above the diagonal and window tiles left of the window
 * are never visited; only the tiles that touch a boundary are masked element
 * by element.
 *
 * Backward: three kernels. delta_i = rowsum(dout_i * out_i) (f32); dk/dv by
 * key tiles (a CTA owns 64 keys, 16 per warp, and walks the query tiles that
 * see them: S^T = K Q^T, dP^T = V dout^T, P^T = exp2(S^T * scale * log2e -
 * lse * log2e), dS^T = P^T (dP^T - delta), dV += P^T dout, dK += dS^T Q *
 * scale); dq by query tiles (64 queries, 16 per warp, walking the visible key
 * tiles as the forward does: S = Q K^T, dP = dout V^T, dQ += dS K * scale).
 * No atomics: every output element is written once by one thread
 * (deterministic). Grouped-query attention: the forward and dq kernels read
 * KV head h / G of query head h; a dk/dv CTA owns a key tile of one KV head
 * and walks the query tiles of its G query heads one after the other,
 * summing in the same registers. The recomputed score tiles stay in registers: an mma
 * accumulator fragment is the A fragment of the next product (P^T, dS^T and
 * dS). Query tiles (dk/dv) and key tiles (dq) are double-buffered with
 * cp.async. */
#include "attention_tc.cuh"

namespace gp_attn {
namespace {

/* two n-tiles: c[0] += a b[0..1], c[1] += a b[2..3] (b from one ldmatrix.x4) */
template <typename T> __device__ __forceinline__ void mma2(float (*c)[4], const uint32_t *a, const uint32_t *b) {
  mma16816<T>(c[0], a, b[0], b[1]);
  mma16816<T>(c[1], a, b[2], b[3]);
}

/* the K/V pipeline step of key tile t (of kt.n): start loading tile t + 1
 * into the other stage, then wait for tile t (stage t & 1) */
template <typename T, int D, int BN, int NTH = 128>
__device__ __forceinline__ void kv_next(T *Ks, T *Vs, const T *k, const T *v, int64_t ks, int64_t vs, const KvTiles &kt,
                                        int t, int S) {
  if (t + 1 < kt.n) {
    const int o = ((t & 1) ^ 1) * BN * D;
    load_tile<T, D, BN, NTH>(Ks + o, k, ks, kt.j0(t + 1), S);
    load_tile<T, D, BN, NTH>(Vs + o, v, vs, kt.j0(t + 1), S);
  }
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
}

/* ldmatrix addresses in a swizzled tile (rows of D elements):
 * a_off: the A fragment (16 rows from row0, 16 columns from chunk kc0) of a
 *   row-major [M][K] tile;
 * bn_off: the B fragments of two n-tiles (rows n0..n0+15) of a [N][K] tile
 *   (K^T-like operand: non-transposed ldmatrix);
 * bk_off: the B fragments of two n-tiles (columns from chunk nc0) of a [K][N]
 *   tile (V-like operand: ldmatrix.trans). */
template <int D> __device__ __forceinline__ int a_off(int row0, int kc0, int lane) {
  return swz<D>(row0 + (lane & 15), kc0 + (lane >> 4));
}
template <int D> __device__ __forceinline__ int bn_off(int n0, int kc0, int lane) {
  return swz<D>(n0 + (lane & 7) + ((lane >> 4) << 3), kc0 + ((lane >> 3) & 1));
}
template <int D> __device__ __forceinline__ int bk_off(int k0, int nc0, int lane) {
  return swz<D>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), nc0 + (lane >> 4));
}

/* tile(mk, t) for a tile loop body specialized on its masking: SPEC, the
 * unmasked body (mk 0) or the masked one (mk 1) by the block-uniform masked;
 * else one body that tests its own need_mask (mk 2: the forward at scale <= 0) */
template <bool SPEC, typename F> __device__ __forceinline__ void run_tile(F &tile, int t, bool masked) {
  if constexpr (SPEC) {
    if (masked) tile(std::integral_constant<int, 1>(), t);
    else tile(std::integral_constant<int, 0>(), t);
  } else {
    tile(std::integral_constant<int, 2>(), t);
  }
}

/* 4 warps, MT m-tiles of 16 query rows each: BM = 16 * MT * 4 rows a CTA.
 * RAWMAX (the host's choice for scale > 0): the row max is taken on the raw
 * scores, p = ex2(s * scale log2e - m * scale log2e) is one FFMA and one MUFU
 * op, and the masked and unmasked tiles are two specialized loop bodies (no
 * per-element mask code on the tiles away from the boundaries). Else (scale
 * <= 0) the scores are scaled first (base 2), exp2f, and one loop body that
 * tests each tile's need for the mask. */
template <typename T, int D, int MT, bool RAWMAX>
__global__ void __launch_bounds__(128, 1) k_attn_fwd_mma(AttnP P, int BH) {
  constexpr int NW = 4, NTH = NW * 32, BM = 16 * MT * NW, BN = 64, KD = D / 16, NT = BN / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Qs = (T *)attn_smem;
  T *Ks = Qs + BM * D; /* 2 stages */
  T *Vs = Ks + 2 * BN * D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  /* block b: query tile n_m - 1 - b / BH of head b % BH (the longest causal rows of every head first) */
  const int n_m = gridDim.x / BH;
  const int bh = blockIdx.x % BH, i0 = (n_m - 1 - (int)(blockIdx.x / BH)) * BM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H);
  const T *k = (const T *)P.k + kv_at(P.sk, bh, P);
  const T *v = (const T *)P.v + kv_at(P.sv, bh, P);

  const int pmin = i0 + off, pmax = min(i0 + BM, P.T) - 1 + off;
  const KvTiles kt = kv_tiles(P, pmin, pmax, BN);
  const int n_tiles = kt.n;

  load_tile<T, D, BM, NTH>(Qs, q, P.sq.r, i0, P.T);
  if (n_tiles > 0) {
    load_tile<T, D, BN, NTH>(Ks, k, P.sk.r, kt.j0(0), P.S);
    load_tile<T, D, BN, NTH>(Vs, v, P.sv.r, kt.j0(0), P.S);
  }
  cp_async_commit();

  /* the Q fragments stay in registers */
  float o[MT][DT][4], m[MT][2], l[MT][2];
  uint32_t qf[MT][KD][4];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
  }
  const float sl2 = P.scale * 1.4426950408889634f;
  const int wrow = warp * 16 * MT; /* the warp's first row in the tile */

  /* one key tile; MK: 0 no mask, 1 mask, 2 mask when need_mask (RAWMAX = false) */
  auto tile = [&](auto mk_tag, int t) {
    constexpr int MK = decltype(mk_tag)::value;
    const int st = t & 1;
    const int j0 = kt.j0(t);
    kv_next<T, D, BN, NTH>(Ks, Vs, k, v, P.sk.r, P.sv.r, kt, t, P.S);
    if (t == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int kk = 0; kk < KD; kk++)
          ldsm_x4(qf[mt][kk], smem_u32(Qs + swz<D>(wrow + mt * 16 + (lane & 15), kk * 2 + (lane >> 4))));
    }
    const T *Kst = Ks + st * BN * D, *Vst = Vs + st * BN * D;

    /* S = Q K^T */
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < NT; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
#pragma unroll
      for (int np = 0; np < NT / 2; np++) {
        uint32_t b[4];
        ldsm_x4(b, smem_u32(Kst + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1))));
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma2<T>(s[mt] + 2 * np, qf[mt][kk], b);
        }
      }
    }

    /* masks, only on tiles that touch a boundary */
    const bool need_mask = MK == 1 || (MK == 2 && tile_masked(P, pmin, pmax, j0, BN));
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float x = RAWMAX ? s[mt][nt][e] : s[mt][nt][e] * sl2;
          if (MK != 0 && need_mask) {
            int p = i0 + wrow + mt * 16 + (lane >> 2) + ((e >> 1) << 3) + off;
            int j = j0 + nt * 8 + ((lane & 3) << 1) + (e & 1);
            if (j >= P.S || !vis(p, j, P.win, P.ng, P.causal)) x = -INFINITY;
          }
          s[mt][nt][e] = x;
        }

    /* online softmax (base 2); l stays per thread until the end. RAWMAX: m
     * is the raw max (scale > 0), p = ex2(s sl2 - m sl2); else m and s are
     * already scaled by sl2 */
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      if constexpr (RAWMAX) {
        softmax_rows<NT, DT>(s[mt], m[mt], l[mt], o[mt], sl2);
      } else {
#pragma unroll
        for (int h = 0; h < 2; h++) {
          float mx = m[mt][h];
#pragma unroll
          for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
          const float mu = mx == -INFINITY ? 0.f : mx;
          const float alpha = exp2f(m[mt][h] - mu);
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < NT; nt++) {
            float p0 = exp2f(s[mt][nt][2 * h] - mu), p1 = exp2f(s[mt][nt][2 * h + 1] - mu);
            s[mt][nt][2 * h] = p0;
            s[mt][nt][2 * h + 1] = p1;
            sum += p0 + p1;
          }
          m[mt][h] = mx;
          l[mt][h] = l[mt][h] * alpha + sum;
#pragma unroll
          for (int dt = 0; dt < DT; dt++) {
            o[mt][dt][2 * h] *= alpha;
            o[mt][dt][2 * h + 1] *= alpha;
          }
        }
      }
    }

    /* O += P V: the S accumulators are P's A fragments */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        acc_to_a<T>(pa[mt], s[mt], kk);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; dp++) {
        uint32_t b[4];
        ldsm_x4_t(b, smem_u32(Vst + swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dp * 2 + (lane >> 4))));
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma2<T>(o[mt] + 2 * dp, pa[mt], b);
        }
      }
    }
    __syncthreads(); /* the next iteration loads into this stage */
  };
  for (int t = 0; t < n_tiles; t++) run_tile<RAWMAX>(tile, t, RAWMAX && (tile_masked(P, pmin, pmax, kt.j0(t), BN)));
  cp_async_wait<0>();

  /* m: raw max (RAWMAX), else the base-2 scaled max */
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
    store_out_rows<T, DT>(P, bh, i0 + wrow + mt * 16, o[mt], m[mt], l[mt], RAWMAX ? P.scale : 0.6931471805599453f,
                          lane);
}

/* dk, dv: block b holds key tile b / NKV (the first key tiles, which most
 * causal queries see, start first) of KV head b % NKV (NKV = B * Hkv) and
 * walks the query tiles of its G query heads in turn (one double-buffered
 * sequence of G * n_qt tiles) */
template <typename T, int D, int BQ, bool GQA>
__global__ void __launch_bounds__(128) k_attn_bwd_dkdv_mma(AttnP P, const float *__restrict__ delta, int NKV) {
  constexpr int BN = 64, KD = D / 16, NQ = BQ / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Ks = (T *)attn_smem;
  T *Vs = Ks + BN * D;
  T *Qs = Vs + BN * D;                    /* 2 stages */
  T *Gs = Qs + 2 * BQ * D;                /* 2 stages */
  float *Ls = (float *)(Gs + 2 * BQ * D); /* 2 stages of BQ */
  float *Dl = Ls + 2 * BQ;                /* 2 stages of BQ */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bkv = blockIdx.x % NKV, j0 = (blockIdx.x / NKV) * BN, off = P.S - P.T;
  const int Hkv = GQA ? P.Hkv : P.H;
  const T *k = (const T *)P.k + head_at(P.sk, bkv, Hkv), *v = (const T *)P.v + head_at(P.sv, bkv, Hkv);

  /* the queries that may see a key of the tile: p >= j0 (causal), and
   * p - jmax < win unless the tile holds a global key */
  const int jmax = min(j0 + BN, P.S) - 1;
  const int ilo = P.causal ? max(0, j0 - off) : 0;
  int ihi = P.T;
  if (P.win > 0 && j0 >= P.ng) ihi = (int)min((int64_t)P.T, (int64_t)jmax + P.win - off);
  const int n_qt = ihi > ilo ? (ihi - ilo + BQ - 1) / BQ : 0;
  const QTiles<GQA> qt(P, bkv, ilo, n_qt, BQ);
  auto load_q = [&](int stage, int t) {
    load_q_tile<T, D, BQ, 128>(P, delta, qt, t, Qs + stage * BQ * D, Gs + stage * BQ * D, Ls + stage * BQ, Dl + stage * BQ);
  };
  load_tile<T, D, BN>(Ks, k, P.sk.r, j0, P.S);
  load_tile<T, D, BN>(Vs, v, P.sv.r, j0, P.S);
  if (qt.n > 0) load_q(0, 0);
  cp_async_commit();

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; dt++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk[dt][e] = dv[dt][e] = 0.f;
  const float sl2 = P.scale * LOG2E;
  /* the query tile from i0 holds a row past T or a (query, key) pair to mask */
  auto q_masked = [&](int i0) {
    return i0 + BQ > P.T || tile_masked(P, i0 + off, min(i0 + BQ, P.T) - 1 + off, j0, BN);
  };
  const int wrow = warp * 16, g8 = lane >> 2, t2 = (lane & 3) << 1;

  /* one query tile; MK: 0 no mask, 1 mask */
  auto tile = [&](auto mk_tag, int t) {
    constexpr int MK = decltype(mk_tag)::value;
    const int st = t & 1, i0 = qt.row0(t);
    if (t + 1 < qt.n) load_q(st ^ 1, t + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T *Qst = Qs + st * BQ * D, *Gst = Gs + st * BQ * D;
    const float *Lst = Ls + st * BQ, *Dst = Dl + st * BQ;

    /* S^T = K Q^T and dP^T = V dout^T (rows: the warp's 16 keys; columns: BQ queries) */
    float s[NQ][4], dp[NQ][4];
#pragma unroll
    for (int nt = 0; nt < NQ; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
      uint32_t ka[4], va[4];
      ldsm_x4(ka, smem_u32(Ks + a_off<D>(wrow, kk * 2, lane)));
      ldsm_x4(va, smem_u32(Vs + a_off<D>(wrow, kk * 2, lane)));
#pragma unroll
      for (int np = 0; np < NQ / 2; np++) {
        uint32_t b[4];
        ldsm_x4(b, smem_u32(Qst + bn_off<D>(np * 16, kk * 2, lane)));
        mma2<T>(s + 2 * np, ka, b);
        ldsm_x4(b, smem_u32(Gst + bn_off<D>(np * 16, kk * 2, lane)));
        mma2<T>(dp + 2 * np, va, b);
      }
    }

    /* P^T and dS^T; masks only on tiles that touch a boundary */
#pragma unroll
    for (int nt = 0; nt < NQ; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int ic = nt * 8 + t2 + (e & 1);
        float pv = ex2(fmaf(s[nt][e], sl2, -Lst[ic] * LOG2E));
        if constexpr (MK == 1) {
          const int i = i0 + ic, j = j0 + wrow + g8 + ((e >> 1) << 3);
          if (i >= P.T || j >= P.S || !vis(i + off, j, P.win, P.ng, P.causal)) pv = 0.f;
        }
        dp[nt][e] = pv * (dp[nt][e] - Dst[ic]);
        s[nt][e] = pv;
      }

    /* dV += P^T dout, dK += dS^T Q (the accumulators are the A fragments) */
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++) {
      uint32_t pa[4], da[4];
      acc_to_a<T>(pa, s, kk);
      acc_to_a<T>(da, dp, kk);
#pragma unroll
      for (int dq2 = 0; dq2 < DT / 2; dq2++) {
        uint32_t b[4];
        ldsm_x4_t(b, smem_u32(Gst + bk_off<D>(kk * 16, dq2 * 2, lane)));
        mma2<T>(dv + 2 * dq2, pa, b);
        ldsm_x4_t(b, smem_u32(Qst + bk_off<D>(kk * 16, dq2 * 2, lane)));
        mma2<T>(dk + 2 * dq2, da, b);
      }
    }
    __syncthreads(); /* the next iteration loads into this stage */
  };
  for (int t = 0; t < qt.n; t++) run_tile<true>(tile, t, q_masked(qt.row0(t)));
  cp_async_wait<0>();

  store_acc_rows<T, DT>((T *)P.dk + head_at(P.sdk, bkv, Hkv), P.sdk.r, j0 + wrow, P.S, dk, P.scale,
                        lane); /* q was not scaled */
  store_acc_rows<T, DT>((T *)P.dv + head_at(P.sdv, bkv, Hkv), P.sdv.r, j0 + wrow, P.S, dv, 1.f, lane);
}

/* dq: block b holds query tile (n_mt - 1 - b / BH) (the longest causal rows
 * first) of head b % BH; the key tiles are the forward's */
template <typename T, int D, int BN>
__global__ void __launch_bounds__(128) k_attn_bwd_dq_mma(AttnP P, const float *__restrict__ delta, int BH) {
  constexpr int BM = 64, KD = D / 16, NT = BN / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Qs = (T *)attn_smem;
  T *Gs = Qs + BM * D;
  T *Ks = Gs + BM * D;     /* 2 stages */
  T *Vs = Ks + 2 * BN * D; /* 2 stages */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_mt = gridDim.x / BH;
  const int bh = blockIdx.x % BH, i0 = (n_mt - 1 - (int)(blockIdx.x / BH)) * BM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H), *g = (const T *)P.dout + head_at(P.sg, bh, P.H);
  const T *k = (const T *)P.k + kv_at(P.sk, bh, P), *v = (const T *)P.v + kv_at(P.sv, bh, P);

  const int pmin = i0 + off, pmax = min(i0 + BM, P.T) - 1 + off;
  const KvTiles kt = kv_tiles(P, pmin, pmax, BN);
  const int n_tiles = kt.n;

  load_tile<T, D, BM>(Qs, q, P.sq.r, i0, P.T);
  load_tile<T, D, BM>(Gs, g, P.sg.r, i0, P.T);
  if (n_tiles > 0) {
    load_tile<T, D, BN>(Ks, k, P.sk.r, kt.j0(0), P.S);
    load_tile<T, D, BN>(Vs, v, P.sv.r, kt.j0(0), P.S);
  }
  cp_async_commit();

  const int wrow = warp * 16, g8 = lane >> 2, t2 = (lane & 3) << 1;
  float L2[2], Dd[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int row = i0 + wrow + g8 + h * 8;
    const bool ok = row < P.T;
    L2[h] = ok ? P.lse_in[(int64_t)bh * P.T + row] * LOG2E : 0.f;
    Dd[h] = ok ? delta[(int64_t)bh * P.T + row] : 0.f;
  }
  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; dt++) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
  uint32_t qf[KD][4], gf[KD][4];
  const float sl2 = P.scale * LOG2E;

  /* one key tile; MK: 0 no mask, 1 mask */
  auto tile = [&](auto mk_tag, int t) {
    constexpr int MK = decltype(mk_tag)::value;
    const int st = t & 1;
    const int j0 = kt.j0(t);
    kv_next<T, D, BN>(Ks, Vs, k, v, P.sk.r, P.sv.r, kt, t, P.S);
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < KD; kk++) {
        ldsm_x4(qf[kk], smem_u32(Qs + a_off<D>(wrow, kk * 2, lane)));
        ldsm_x4(gf[kk], smem_u32(Gs + a_off<D>(wrow, kk * 2, lane)));
      }
    }
    const T *Kst = Ks + st * BN * D, *Vst = Vs + st * BN * D;

    /* S = Q K^T, dP = dout V^T */
    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; kk++)
#pragma unroll
      for (int np = 0; np < NT / 2; np++) {
        uint32_t b[4];
        ldsm_x4(b, smem_u32(Kst + bn_off<D>(np * 16, kk * 2, lane)));
        mma2<T>(s + 2 * np, qf[kk], b);
        ldsm_x4(b, smem_u32(Vst + bn_off<D>(np * 16, kk * 2, lane)));
        mma2<T>(dp + 2 * np, gf[kk], b);
      }

    /* dS = P (dP - delta); masks only on tiles that touch a boundary (rows
     * past T are never stored) */
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int h = e >> 1;
        float pv = ex2(fmaf(s[nt][e], sl2, -L2[h]));
        if constexpr (MK == 1) {
          const int p = i0 + wrow + g8 + h * 8 + off, j = j0 + nt * 8 + t2 + (e & 1);
          if (j >= P.S || !vis(p, j, P.win, P.ng, P.causal)) pv = 0.f;
        }
        s[nt][e] = pv * (dp[nt][e] - Dd[h]);
      }

    /* dQ += dS K */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      uint32_t da[4];
      acc_to_a<T>(da, s, kk);
#pragma unroll
      for (int dq2 = 0; dq2 < DT / 2; dq2++) {
        uint32_t b[4];
        ldsm_x4_t(b, smem_u32(Kst + bk_off<D>(kk * 16, dq2 * 2, lane)));
        mma2<T>(acc + 2 * dq2, da, b);
      }
    }
    __syncthreads(); /* the next iteration loads into this stage */
  };
  for (int t = 0; t < n_tiles; t++) run_tile<true>(tile, t, tile_masked(P, pmin, pmax, kt.j0(t), BN));
  cp_async_wait<0>();

  store_acc_rows<T, DT>((T *)P.dq + head_at(P.sdq, bh, P.H), P.sdq.r, i0 + wrow, P.T, acc, P.scale, lane);
}

/* 4 warps, 16 * MT query rows a warp (MT 2 at D 64, 1 at D 128) */
template <typename T, int D, bool RAWMAX> int launch_fwd(const AttnP &P, int64_t BH) {
  constexpr int MT = D == 64 ? 2 : 1, BM = 16 * MT * 4;
  static bool attr = false; /* per instantiation */
  return launch_fwd_tiles(k_attn_fwd_mma<T, D, MT, RAWMAX>, P, BH, BM, 128, (BM + 4 * 64) * D * (int)sizeof(T), attr);
}

/* 4 warps a CTA, 64 keys (dk/dv) or 64 queries (dq); GQA: G > 1 */
template <typename T, int D, bool GQA> int launch_bwd(const AttnP &P, int64_t BH) {
  constexpr int BQ = D == 64 ? 64 : 32; /* query tile of the dk/dv kernel */
  constexpr int BN = 64;                /* key tile of the dq kernel */
  static bool a1 = false, a2 = false;   /* per instantiation */
  return launch_bwd_kernels<T, D, false>(P, BH, k_attn_bwd_dkdv_mma<T, D, BQ, GQA>, 128,
                                         (2 * 64 + 4 * BQ) * D * (int)sizeof(T) + 4 * BQ * (int)sizeof(float),
                                         (P.S + 63) / 64, a1, k_attn_bwd_dq_mma<T, D, BN>, 128,
                                         (2 * 64 + 4 * BN) * D * (int)sizeof(T), (P.T + 63) / 64, a2);
}

template <bool GQA> int bwd_mma_g(const AttnP &P, int64_t BH, int dtype, int D) {
  if (dtype == GP_BF16)
    return D == 64 ? launch_bwd<__nv_bfloat16, 64, GQA>(P, BH) : launch_bwd<__nv_bfloat16, 128, GQA>(P, BH);
  return D == 64 ? launch_bwd<__half, 64, GQA>(P, BH) : launch_bwd<__half, 128, GQA>(P, BH);
}

} // namespace

int fwd_mma(const AttnP &P, int64_t BH, int dtype, int D) {
  int rc = GP_OK;
  /* the row max on the raw scores needs scale > 0 */
  const bool raw = P.scale > 0.f;
#define GP_FWD_MMA(T, DD) rc = raw ? launch_fwd<T, DD, true>(P, BH) : launch_fwd<T, DD, false>(P, BH)
  if (dtype == GP_BF16) {
    if (D == 64) GP_FWD_MMA(__nv_bfloat16, 64);
    else GP_FWD_MMA(__nv_bfloat16, 128);
  } else {
    if (D == 64) GP_FWD_MMA(__half, 64);
    else GP_FWD_MMA(__half, 128);
  }
#undef GP_FWD_MMA
  return rc;
}

/* G = 1 runs the dk/dv kernel without the loop over a group's query heads */
int bwd_mma(const AttnP &P, int64_t BH, int dtype, int D) {
  return P.G > 1 ? bwd_mma_g<true>(P, BH, dtype, D) : bwd_mma_g<false>(P, BH, dtype, D);
}

} // namespace gp_attn
