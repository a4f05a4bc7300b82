/* decode_step.cu: a Llama decode step (every layer, one token a row) as one
 * persistent kernel. One block an SM runs the whole stack; a grid barrier
 * separates the step's five phases a layer:
 *   q  rms_norm(h) * ln1 (each block normalizes the B rows itself), then its
 *      rows of qkv = n @ wqkv^T;
 *   a  attention: a block a task of (row, query head, 256 positions), a warp
 *      32 of them; q and the new key turned by RoPE as it reads them, the new
 *      key and value written to the cache by a warp a (row, kv head); the
 *      chunks of a longer cache merged by the block that finishes a head's
 *      last (a counter a head);
 *   o  its rows of o = y @ wo^T, h += o;
 *   g  rms_norm(h) * ln2, its rows of gu = n @ wgu^T;
 *   d  its rows of silu(g) * u @ wdown^T, h += that.
 * Each block's rows of the four weights are contiguous: it copies the next
 * products' rows into shared memory (cp.async) while it computes and waits
 * at the barriers, so the weights stream behind the phases' latency.
 * The products run on tensor cores (mma.sync) past two rows of x or 16 rows
 * of w a block, else a warp a row on the CUDA cores. Measured on an H200
 * (BENCHMARKS.md 2026-11-30): a phase costs 1-4 us, mostly the latency of
 * reading the phase before's output from L2, and a barrier about 1.1 us.
 * The rounding follows the op-by-op step (gp.linear, rope_kv_at,
 * attention_decode, add_rms_norm, swiglu_linear): every phase's output is
 * bf16, sums are f32. Data the kernel itself wrote is read with ld.global.cg
 * (L2): another SM's L1 may hold an older copy. */
#include "bad_index.cuh"
#include "decode_step.h"

namespace {
typedef __nv_bfloat16 bf;
constexpr int DS_WARPS = 8, DS_THREADS = 32 * DS_WARPS;

struct DArgs {
  const gp_dlayer *layers;
  const bf *x, *lnf;
  bf *out, *h, *qkv, *y, *gu;
  float *part;
  unsigned *cnt, *bar;
  const void *pos;
  const int64_t *lens;
  const float *inv_freq;
  int pos64, L, B, d, H, J, hd, I;
  int64_t C;
  float eps, scale;
  unsigned buf1_off, ln_off, xs_off, att_off, red_off, hown_off, cst_off, own;
  gp_bad_ref bad;
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ void unpack8(const uint4 &u, float *f) {
  const __nv_bfloat162 *p = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 t = __bfloat1622float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
/* the launch's constants in shared memory (copied once): the layer table, lens, cos and sin of p * inv_freq */
__device__ __forceinline__ const gp_dlayer &layer(const DArgs &a, const unsigned char *sm, int l) {
  return reinterpret_cast<const gp_dlayer *>(sm + a.cst_off)[l];
}
__device__ __forceinline__ const int64_t *lens_s(const DArgs &a, const unsigned char *sm) {
  return reinterpret_cast<const int64_t *>(sm + a.cst_off + a.L * sizeof(gp_dlayer));
}
__device__ __forceinline__ const float *rope_s(const DArgs &a, const unsigned char *sm) { /* cos [E], then sin [E] */
  return reinterpret_cast<const float *>(sm + a.cst_off + a.L * sizeof(gp_dlayer) + GP_DPLAN_MAX_B * 8);
}
/* 16-byte shared-memory accesses (the compiler cannot prove the alignment of the offsets into the dynamic
 * shared memory and would split them into 4-byte accesses, four lanes to a bank) */
__device__ __forceinline__ uint4 lds128(const void *p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"((unsigned)__cvta_generic_to_shared(p)));
  return v;
}
__device__ __forceinline__ void sts128(void *p, const uint4 &v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"((unsigned)__cvta_generic_to_shared(p)), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

/* rows [r0, r1) of a product of N rows split evenly over the grid */
__device__ __forceinline__ void rows_of(int N, int &r0, int &r1) {
  r0 = (int)(blockIdx.x * (unsigned)N / gridDim.x); /* N * grid < 2^32 (create checks) */
  r1 = (int)((blockIdx.x + 1) * (unsigned)N / gridDim.x);
}
/* product s (layer s / 4; 0 qkv, 1 o, 2 gate/up, 3 down): weight, rows, K */
__device__ __forceinline__ const bf *product(const DArgs &a, const unsigned char *sm, int s, int &N, int &K) {
  const gp_dlayer &ly = layer(a, sm, s >> 2);
  const int Nq = (a.H + 2 * a.J) * a.hd;
  switch (s & 3) {
    case 0: N = Nq, K = a.d; return (const bf *)ly.wqkv;
    case 1: N = a.d, K = a.H * a.hd; return (const bf *)ly.wo;
    case 2: N = 2 * a.I, K = a.d; return (const bf *)ly.wgu;
    default: N = a.d, K = a.I; return (const bf *)ly.wdown;
  }
}
/* this block's rows of product s into its buffer (s & 1), one cp.async group (empty past the last product) */
__device__ void prefetch(const DArgs &a, unsigned char *sm, int s) {
  if (s < 4 * a.L) {
    int N, K, r0, r1;
    const bf *w = product(a, sm, s, N, K);
    rows_of(N, r0, r1);
    const char *src = (const char *)(w + (int64_t)r0 * K);
    const int per = K / 8, n = (r1 - r0) * per; /* 16-byte pieces: a row's, the slice's */
    const unsigned dst = (unsigned)__cvta_generic_to_shared(sm + ((s & 1) ? a.buf1_off : 0));
    /* rows K + 8 elements apart in shared memory (ldmatrix's eight rows fall in distinct banks) */
    for (int c = threadIdx.x; c < n; c += DS_THREADS) {
      const int r = c / per, q = c - r * per;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + (unsigned)(r * (K + 8) + q * 8) * 2),
                   "l"(src + (size_t)c * 16)
                   : "memory");
    }
    if (!(s & 1)) { /* the q and gate/up products' norm weight (ln1, ln2) after their rows */
      const gp_dlayer &ly = layer(a, sm, s >> 2);
      const char *ln = (const char *)((s & 2) ? ly.ln2 : ly.ln1);
      const unsigned lnd = (unsigned)__cvta_generic_to_shared(sm + a.ln_off);
      for (int o = threadIdx.x * 16; o < a.d * 2; o += DS_THREADS * 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(lnd + o), "l"(ln + o) : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

/* the k-th barrier of the launch: every block adds one to bar[0] (zeroed before the launch) after its
 * writes, then waits for k * grid. Before arriving, the block issues the copy of product `next` (its
 * buffer is free: the block's products are done) */
__device__ void grid_sync(const DArgs &a, unsigned char *sm, int next, unsigned &k) {
  __syncthreads();
  k++;
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(a.bar, 1u);
  }
  if (next >= 0) prefetch(a, sm, next);
  if (threadIdx.x == 0) {
    const unsigned target = k * gridDim.x;
    unsigned v;
    do asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(v) : "l"(a.bar) : "memory");
    while (v < target);
    asm volatile("fence.acq_rel.gpu;" ::: "memory"); /* one acquire (an acquiring poll invalidates L1 each time) */
  }
  __syncthreads();
}

/* xs (B, d) = bf16(rms_norm(src rows) * w), a warp a row (B <= 8 warps); w in shared memory (wsm) or global */
__device__ __noinline__ void norm_rows(const bf *src, const bf *w, bool wsm, bf *xs, int B, int d, float eps) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, d8 = d / 8;
  if (warp >= B) return;
  const uint4 *r = reinterpret_cast<const uint4 *>(src + (int64_t)warp * d);
  uint4 *o = reinterpret_cast<uint4 *>(xs + warp * (d + 8)); /* shared, rows d + 8 apart */
  float s = 0.f;
  for (int v0 = lane; v0 < d8; v0 += 128) { /* four loads in flight a lane */
    uint4 u[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
      if (v0 + 32 * j < d8) u[j] = __ldcg(r + v0 + 32 * j);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      if (v0 + 32 * j < d8) {
        sts128(o + v0 + 32 * j, u[j]);
        float f[8];
        unpack8(u[j], f);
#pragma unroll
        for (int i = 0; i < 8; i++) s += f[i] * f[i];
      }
    }
  }
  const float rs = rsqrtf(warp_sum(s) / (float)d + eps);
  for (int v = lane; v < d8; v += 32) {
    float f[8], g[8];
    unpack8(lds128(o + v), f);
    unpack8(wsm ? lds128(reinterpret_cast<const uint4 *>(w) + v) : __ldg(reinterpret_cast<const uint4 *>(w) + v), g);
    uint4 y;
    __nv_bfloat162 *yp = reinterpret_cast<__nv_bfloat162 *>(&y);
#pragma unroll
    for (int i = 0; i < 4; i++)
      yp[i] = __floats2bfloat162_rn(f[2 * i] * rs * g[2 * i], f[2 * i + 1] * rs * g[2 * i + 1]);
    sts128(o + v, y);
  }
}

/* the block's nr rows of a product (ws, from row r0): out[b * ld + row] = bf16(sum_k ws[r][k] xs[b][k])
 * (out non-null) or the residual add into h (hown: the block's columns of h as floats, from column c0).
 * ws and xs rows are K + 8 elements apart. Past two rows of x or 16 rows of w, on tensor cores: mma
 * m16n8k16, 16 rows of w the A operand, the B rows of x (up to 8; rows past B repeat the last) the B
 * operand; the block's 16-row tiles times splits of K make the warps' tasks, their sums added in shared
 * memory (red) in split order */
__device__ __noinline__ void gemv_run(const bf *ws, const bf *xs, int nr, int K, int B, int r0, bf *out, int ld,
                                      float *hown, int own, int c0, bf *h, int d, float *red) {
  const int KP = K + 8;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto put = [&](int b, int row, float v) {
    if (out) {
      out[(int64_t)b * ld + row] = __float2bfloat16_rn(v);
    } else {
      float *ho = hown + b * own + (row - c0);
      const bf nv = __float2bfloat16_rn(*ho + __bfloat162float(__float2bfloat16_rn(v)));
      *ho = __bfloat162float(nv);
      h[(int64_t)b * d + row] = nv;
    }
  };
  if (B <= 2 && nr <= 2 * DS_WARPS) { /* few rows: a warp a row of w on the CUDA cores (no shared-memory sums) */
    for (int r = warp; r < nr; r += DS_WARPS) {
      const bf *wr = ws + r * KP;
      for (int b = 0; b < B; b++) {
        const bf *xr = xs + b * KP;
        float acc = 0.f;
        for (int k = lane * 8; k < K; k += 256) {
          float wf[8], xf[8];
          unpack8(lds128(wr + k), wf);
          unpack8(lds128(xr + k), xf);
#pragma unroll
          for (int e = 0; e < 8; e++) acc = fmaf(wf[e], xf[e], acc);
        }
        const float v = warp_sum(acc);
        if (lane == 0) put(b, r0 + r, v);
      }
    }
    return;
  }
  const int nmt = (nr + 15) >> 4, nks = nmt >= DS_WARPS ? 1 : DS_WARPS / nmt, ntask = nmt * nks, steps = K >> 4;
  for (int t = warp; t < ntask; t += DS_WARPS) {
    const int mt = t % nmt, ks = t / nmt, k0 = ks * steps / nks, k1 = (ks + 1) * steps / nks;
    const int ar = min(mt * 16 + (lane & 15), nr - 1), br = min(lane & 7, B - 1);
    const unsigned pa = (unsigned)__cvta_generic_to_shared(ws + ar * KP + (lane >> 4) * 8);
    const unsigned pb = (unsigned)__cvta_generic_to_shared(xs + br * KP + ((lane >> 3) & 1) * 8);
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int kk = k0; kk < k1; kk++) {
      unsigned x0, x1, x2, x3, y0, y1;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
                   : "r"(pa + kk * 32));
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(y0), "=r"(y1) : "r"(pb + kk * 32));
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
          "{%8, %9}, {%0, %1, %2, %3};"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(x0), "r"(x1), "r"(x2), "r"(x3), "r"(y0), "r"(y1));
    }
    float *rt = red + t * 128; /* (row 16, b 8) */
    const int g = lane >> 2, q = (lane & 3) * 2;
    rt[g * 8 + q] = c[0], rt[g * 8 + q + 1] = c[1], rt[(g + 8) * 8 + q] = c[2], rt[(g + 8) * 8 + q + 1] = c[3];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < nr * B; e += DS_THREADS) {
    const int r = e / B, b = e - r * B, mt = r >> 4, row = r0 + r;
    float v = 0.f;
    for (int ks = 0; ks < nks; ks++) v += red[(ks * nmt + mt) * 128 + (r & 15) * 8 + b];
    put(b, row, v);
  }
}

/* (gemv_run is out of line with its arguments by value: one copy of its code, no reads of the kernel's
 * arguments through local memory) */
__device__ __forceinline__ void gemv(const DArgs &a, const unsigned char *sm, int s, const bf *xs, bf *out, int ld,
                                     float *hown, int c0, float *red) {
  int N, K, r0, r1;
  product(a, sm, s, N, K);
  rows_of(N, r0, r1);
  if (r1 > r0) /* the same for the whole block */
    gemv_run((const bf *)(sm + ((s & 1) ? a.buf1_off : 0)), xs, r1 - r0, K, a.B, r0, out, ld, hown, a.own, c0, a.h, a.d,
             red);
}

/* the attention phase: a block a task of (row b, query head h, 256 positions), a warp 32 of them, a lane
 * one; the warps' sums merged in shared memory, the chunks of a longer cache by the block that finishes a
 * head's last (a counter a head). In the merges a lane's element e of the head (e < HD / 32) is dimension
 * (e / 2) * 64 + 2 lane + e % 2 */
constexpr int DS_CHUNK = 32 * DS_WARPS;
template <int HD>
__device__ __forceinline__ void attention(const DArgs &a, unsigned char *sm, int l, int64_t p, bool pok) {
  constexpr int E = HD / 2, NE = HD / 32;
  const gp_dlayer &ly = layer(a, sm, l);
  const float *rc = rope_s(a, sm), *rsn = rc + HD / 2;
  const int64_t *lens = lens_s(a, sm);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, H = a.H, J = a.J;
  const int Nq = (H + 2 * J) * HD, grp = H / J;
  const int64_t C = a.C;
  /* the new key (turned) and value into the cache at p: a warp a (row, kv head) */
  /* (from the last block backwards: the first blocks take the attention tasks) */
  for (int t = (gridDim.x - 1 - blockIdx.x) * DS_WARPS + warp; pok && t < a.B * J; t += gridDim.x * DS_WARPS) {
    const int b = t / J, j = t - b * J;
    const bf *src = a.qkv + (int64_t)b * Nq + (H + j) * HD, *vs = a.qkv + (int64_t)b * Nq + (H + J + j) * HD;
    const int64_t o = (((int64_t)b * J + j) * C + p) * HD;
    for (int i = lane; i < E; i += 32) {
      const float cs = rc[i], sn = rsn[i];
      const float x0 = __bfloat162float(__ldcg(src + i)), x1 = __bfloat162float(__ldcg(src + i + E));
      ((bf *)ly.kc)[o + i] = __float2bfloat16_rn(x0 * cs - x1 * sn);
      ((bf *)ly.kc)[o + i + E] = __float2bfloat16_rn(x1 * cs + x0 * sn);
      ((bf *)ly.vc)[o + i] = __ldcg(vs + i);
      ((bf *)ly.vc)[o + i + E] = __ldcg(vs + i + E);
    }
  }
  float *qs = (float *)(sm + a.att_off) + warp * 2 * HD, *ks = qs + HD;
  float *wo = (float *)(sm + a.att_off) + DS_WARPS * 2 * HD, *wm = wo + DS_WARPS * HD, *wl = wm + DS_WARPS;
  const int nchunk = (int)((C + DS_CHUNK - 1) / DS_CHUNK), ntask = a.B * H * nchunk;
  for (int t = blockIdx.x; t < ntask; t += gridDim.x) {
    const int c = t % nchunk, bh = t / nchunk, b = bh / H, h = bh - b * H, j = h / grp;
    int64_t len = lens[b];
    len = len < 0 ? 0 : len > C ? C : len;
    const int64_t s0 = (int64_t)c * DS_CHUNK, w0 = s0 + 32 * warp;
    if (s0 >= len) continue; /* the same for the whole block */
    const int nch = (int)((len + DS_CHUNK - 1) / DS_CHUNK);
    const bool has_p = pok && p >= w0 && p < w0 + 32;
    const bf *qsrc = a.qkv + (int64_t)b * Nq + h * HD, *ksrc = a.qkv + (int64_t)b * Nq + (H + j) * HD;
    const uint4 *vnew = reinterpret_cast<const uint4 *>(a.qkv + (int64_t)b * Nq + (H + J + j) * HD);
    /* q's (and the new key's) pairs first: the rotation waits only for them */
    float q0[E / 32], q1[E / 32], k0v[E / 32], k1v[E / 32];
#pragma unroll
    for (int u = 0; u < E / 32; u++) {
      const int i = lane + 32 * u;
      q0[u] = __bfloat162float(__ldcg(qsrc + i)), q1[u] = __bfloat162float(__ldcg(qsrc + i + E));
      if (has_p) k0v[u] = __bfloat162float(__ldcg(ksrc + i)), k1v[u] = __bfloat162float(__ldcg(ksrc + i + E));
    }
    /* the keys and values, coalesced: a row is LPR lanes' 16 bytes, an instruction PPI rows; lane l holds the
     * 8 dimensions c8 * 8 .. of positions w0 + it * PPI + l / LPR */
    constexpr int LPR = HD / 8, PPI = 32 / LPR, IT = 32 / PPI;
    const int c8 = lane % LPR, pl = lane / LPR;
    const uint4 *kbase = reinterpret_cast<const uint4 *>((const bf *)ly.kc + ((int64_t)b * J + j) * C * HD) + c8;
    const uint4 *vbase = reinterpret_cast<const uint4 *>((const bf *)ly.vc + ((int64_t)b * J + j) * C * HD) + c8;
    uint4 kv[IT], vv[IT];
    auto load_v = [&]() {
#pragma unroll
      for (int it = 0; it < IT; it++) {
        const int64_t pos = w0 + it * PPI + pl;
        vv[it] = pos >= len ? make_uint4(0, 0, 0, 0) : has_p && pos == p ? __ldcg(vnew + c8) : __ldg(vbase + pos * LPR);
      }
    };
#pragma unroll
    for (int it = 0; it < IT; it++) {
      const int64_t pos = w0 + it * PPI + pl;
      kv[it] = pos < len && !(has_p && pos == p) ? __ldg(kbase + pos * LPR) : make_uint4(0, 0, 0, 0);
    }
    if constexpr (HD == 64) load_v(); /* with the keys; at head dim 128 after the scores (registers) */
#pragma unroll
    for (int u = 0; u < E / 32; u++) {
      const int i = lane + 32 * u;
      const float cs = rc[i], sn = rsn[i];
      qs[i] = __bfloat162float(__float2bfloat16_rn(q0[u] * cs - q1[u] * sn));
      qs[i + E] = __bfloat162float(__float2bfloat16_rn(q1[u] * cs + q0[u] * sn));
      if (has_p) {
        ks[i] = __bfloat162float(__float2bfloat16_rn(k0v[u] * cs - k1v[u] * sn));
        ks[i + E] = __bfloat162float(__float2bfloat16_rn(k1v[u] * cs + k0v[u] * sn));
      }
    }
    __syncwarp();
    float qf[8];
#pragma unroll
    for (int e = 0; e < 8; e++) qf[e] = qs[c8 * 8 + e];
    float sc[IT], mx = -INFINITY;
#pragma unroll
    for (int it = 0; it < IT; it++) {
      const int64_t pos = w0 + it * PPI + pl;
      float f[8], dot = 0.f;
      if (has_p && pos == p) {
#pragma unroll
        for (int e = 0; e < 8; e++) f[e] = ks[c8 * 8 + e];
      } else {
        unpack8(kv[it], f);
      }
#pragma unroll
      for (int e = 0; e < 8; e++) dot = fmaf(qf[e], f[e], dot);
#pragma unroll
      for (int o = 1; o < LPR; o <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      sc[it] = pos < len ? dot * a.scale : -INFINITY;
      mx = fmaxf(mx, sc[it]);
    }
#pragma unroll
    for (int o = LPR; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if constexpr (HD != 64) load_v();
    float lsum = 0.f, of[8];
#pragma unroll
    for (int e = 0; e < 8; e++) of[e] = 0.f;
#pragma unroll
    for (int it = 0; it < IT; it++) {
      const float pr = sc[it] == -INFINITY ? 0.f : __expf(sc[it] - mx);
      lsum += pr;
      float f[8];
      unpack8(vv[it], f);
#pragma unroll
      for (int e = 0; e < 8; e++) of[e] = fmaf(pr, f[e], of[e]);
    }
#pragma unroll
    for (int o = LPR; o < 32; o <<= 1) {
      lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
#pragma unroll
      for (int e = 0; e < 8; e++) of[e] += __shfl_xor_sync(0xffffffffu, of[e], o);
    }
    if (pl == 0) {
#pragma unroll
      for (int e = 0; e < 8; e++) wo[warp * HD + c8 * 8 + e] = of[e];
    }
    auto dim = [&](int e) { return (e >> 1) * 64 + 2 * lane + (e & 1); };
    if (lane == 0) wm[warp] = mx, wl[warp] = lsum; /* a warp past len: -inf and 0 */
    __syncthreads();
    if (warp == 0) { /* the block's warps merged */
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < DS_WARPS; w++) M = fmaxf(M, wm[w]);
      float den = 0.f, acc[NE];
#pragma unroll
      for (int e = 0; e < NE; e++) acc[e] = 0.f;
#pragma unroll
      for (int w = 0; w < DS_WARPS; w++) {
        const float wgt = wm[w] == -INFINITY ? 0.f : __expf(wm[w] - M);
        den += wgt * wl[w];
#pragma unroll
        for (int e = 0; e < NE; e++) acc[e] = fmaf(wgt, wo[w * HD + dim(e)], acc[e]);
      }
      bf *yo = a.y + (int64_t)b * H * HD + h * HD;
      if (nch == 1) {
#pragma unroll
        for (int e = 0; e < NE; e++) yo[dim(e)] = __float2bfloat16_rn(acc[e] / den);
      } else {
        float *pp = a.part + ((int64_t)bh * nchunk + c) * (HD + 2);
#pragma unroll
        for (int e = 0; e < NE; e++) __stcg(pp + dim(e), acc[e]);
        if (lane == 0) __stcg(pp + HD, M), __stcg(pp + HD + 1, den);
        __threadfence();
        __syncwarp();
        unsigned old = 0;
        if (lane == 0) old = atomicAdd(a.cnt + bh, 1u);
        old = __shfl_sync(0xffffffffu, old, 0);
        if (old == (unsigned)nch - 1) { /* the last chunk of the head to finish merges them */
          __threadfence();
          const float *p0 = a.part + (int64_t)bh * nchunk * (HD + 2);
          float M2 = -INFINITY;
          for (int cc = lane; cc < nch; cc += 32) M2 = fmaxf(M2, __ldcg(p0 + cc * (HD + 2) + HD));
          M2 = warp_max(M2);
          float den2 = 0.f, acc2[NE];
#pragma unroll
          for (int e = 0; e < NE; e++) acc2[e] = 0.f;
          for (int cc = 0; cc < nch; cc++) {
            const float *pc = p0 + cc * (HD + 2);
            const float wgt = __expf(__ldcg(pc + HD) - M2);
            den2 += wgt * __ldcg(pc + HD + 1);
#pragma unroll
            for (int e = 0; e < NE; e++) acc2[e] = fmaf(wgt, __ldcg(pc + dim(e)), acc2[e]);
          }
#pragma unroll
          for (int e = 0; e < NE; e++) yo[dim(e)] = __float2bfloat16_rn(acc2[e] / den2);
          if (lane == 0) atomicExch(a.cnt + bh, 0u);
        }
      }
    }
    __syncthreads(); /* qs, ks, wo read: the next task may write them */
  }
}

__global__ void __launch_bounds__(DS_THREADS, 1) k_decode_step(const DArgs a) {
  extern __shared__ __align__(16) unsigned char ds_smem[];
  unsigned char *sm = ds_smem;
  bf *xs = (bf *)(sm + a.xs_off);
  float *hown = (float *)(sm + a.hown_off), *red = (float *)(sm + a.red_off);
  const bf *lnw = (const bf *)(sm + a.ln_off);
  const int d = a.d, B = a.B, Nq = (a.H + 2 * a.J) * a.hd, HD = a.H * a.hd, I = a.I;
  unsigned k = 0; /* barriers passed */
  const int64_t p = a.pos64 ? ((const int64_t *)a.pos)[0] : (int64_t)((const int *)a.pos)[0];
  {
    uint4 *ct = reinterpret_cast<uint4 *>(sm + a.cst_off);
    for (int e = threadIdx.x; e < a.L * (int)(sizeof(gp_dlayer) / 16); e += DS_THREADS)
      ct[e] = reinterpret_cast<const uint4 *>(a.layers)[e];
    int64_t *ls = reinterpret_cast<int64_t *>(sm + a.cst_off + a.L * sizeof(gp_dlayer));
    if (threadIdx.x < B) ls[threadIdx.x] = a.lens[threadIdx.x];
    float *rc = reinterpret_cast<float *>(ls + GP_DPLAN_MAX_B);
    for (int i = threadIdx.x; i < a.hd / 2; i += DS_THREADS)
      sincosf((float)p * a.inv_freq[i], rc + a.hd / 2 + i, rc + i);
    __syncthreads();
  }
  prefetch(a, sm, 0);
  prefetch(a, sm, 1);
  const bool pok = p >= 0 && p < a.C;
  if (!pok && blockIdx.x == 0 && threadIdx.x == 0) gp_report_bad(a.bad, p);
  /* h's columns of this block (the o and down products' rows: the block alone updates them), in shared
   * memory as floats (bf16 values); h in global memory is what the other blocks read */
  int c0, c1;
  rows_of(d, c0, c1);
  for (int e = threadIdx.x; e < B * (c1 - c0); e += DS_THREADS) {
    const int b = e / (c1 - c0), c = e - b * (c1 - c0);
    hown[b * a.own + c] = __bfloat162float(a.x[(int64_t)b * d + c0 + c]);
  }
  auto ready = [&]() { /* this phase's weights landed, the prologue's xs written */
                       asm volatile("cp.async.wait_group 1;" ::: "memory");
                       __syncthreads();
  };
  for (int l = 0; l < a.L; l++) {
    const int s = 4 * l;
    ready(); /* the norm weight too */
    norm_rows(l == 0 ? a.x : a.h, lnw, true, xs, B, d, a.eps);
    __syncthreads();
    gemv(a, sm, s, xs, a.qkv, Nq, nullptr, 0, red);
    grid_sync(a, sm, -1, k); /* the gate/up rows' copy is issued after the attention (measured the same) */

    if (a.hd == 64) attention<64>(a, sm, l, p, pok);
    else attention<128>(a, sm, l, p, pok);
    grid_sync(a, sm, s + 2, k);

    for (int e0 = threadIdx.x; e0 < B * HD / 8; e0 += 4 * DS_THREADS) { /* four loads in flight a thread */
      uint4 v[4];
#pragma unroll
      for (int j = 0; j < 4; j++)
        if (e0 + j * DS_THREADS < B * HD / 8) v[j] = __ldcg(reinterpret_cast<const uint4 *>(a.y) + e0 + j * DS_THREADS);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const int e = e0 + j * DS_THREADS;
        if (e < B * HD / 8) sts128(xs + (e / (HD / 8)) * (HD + 8) + (e % (HD / 8)) * 8, v[j]);
      }
    }
    ready();
    gemv(a, sm, s + 1, xs, nullptr, 0, hown, c0, red);
    grid_sync(a, sm, s + 3, k);

    ready();
    norm_rows(a.h, lnw, true, xs, B, d, a.eps);
    __syncthreads();
    gemv(a, sm, s + 2, xs, a.gu, 2 * I, nullptr, 0, red);
    grid_sync(a, sm, s + 4, k);

    for (int e0 = threadIdx.x; e0 < B * I / 8; e0 += 4 * DS_THREADS) { /* four pairs of loads in flight */
      uint4 g[4], u[4];
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const int e = e0 + j * DS_THREADS, b = e / (I / 8), i = e - b * (I / 8);
        if (e < B * I / 8) {
          const uint4 *row = reinterpret_cast<const uint4 *>(a.gu + (int64_t)b * 2 * I);
          g[j] = __ldcg(row + i), u[j] = __ldcg(row + I / 8 + i);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const int e = e0 + j * DS_THREADS, b = e / (I / 8), i = e - b * (I / 8);
        if (e < B * I / 8) {
          float gf[8], uf[8];
          unpack8(g[j], gf);
          unpack8(u[j], uf);
          uint4 o;
          bf *oe = reinterpret_cast<bf *>(&o);
#pragma unroll
          for (int q = 0; q < 8; q++) oe[q] = __float2bfloat16_rn(silu(gf[q]) * uf[q]);
          sts128(xs + b * (I + 8) + i * 8, o);
        }
      }
    }
    ready();
    gemv(a, sm, s + 3, xs, nullptr, 0, hown, c0, red);
    grid_sync(a, sm, s + 5, k);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if (blockIdx.x == 0) {
    norm_rows(a.h, a.lnf, false, xs, B, d, a.eps);
    __syncthreads();
    for (int e = threadIdx.x; e < B * d / 8; e += DS_THREADS)
      reinterpret_cast<uint4 *>(a.out)[e] = lds128(xs + (e / (d / 8)) * (d + 8) + (e % (d / 8)) * 8);
  }
}

size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }
} // namespace

extern "C" int gp_cuda_decode_plan_geometry(struct gp_decode_plan *p) {
  const int G = gp_cuda_sm_count();
  const int Nq = (p->H + 2 * p->J) * p->hd, HD = p->H * p->hd;
  auto slice = [&](int N, int K) { return (size_t)((N + G - 1) / G) * (size_t)(K + 8) * 2; };
  size_t b0 = slice(Nq, p->d), b1 = slice(p->d, HD);
  if (slice(2 * p->I, p->d) > b0) b0 = slice(2 * p->I, p->d);
  if (slice(p->d, p->I) > b1) b1 = slice(p->d, p->I);
  int kmax = p->d > HD ? p->d : HD;
  if (p->I > kmax) kmax = p->I;
  /* shared memory: buffer 0 (q or gate/up rows, then the norm weight), buffer 1 (o or down rows), the
   * activations (B rows), attention (per warp q and the new key, the warps' sums), the products' partial
   * sums, h's columns of the block, the launch's constants */
  p->own = (p->d + G - 1) / G;
  p->ln_off = align256(b0);
  p->buf1_off = p->ln_off + align256((size_t)p->d * 2);
  p->xs_off = p->buf1_off + align256(b1);
  p->att_off = p->xs_off + align256((size_t)p->B * (kmax + 8) * 2);
  p->red_off = p->att_off + align256((size_t)DS_WARPS * (3 * p->hd + 2) * 4);
  int rmax = 0; /* the most rows a block takes of a product: its 16-row tiles */
  for (int n : {Nq, p->d, 2 * p->I})
    if ((n + G - 1) / G > rmax) rmax = (n + G - 1) / G;
  const int tasks = (rmax + 15) / 16 > DS_WARPS ? (rmax + 15) / 16 : DS_WARPS;
  p->hown_off = p->red_off + align256((size_t)tasks * 128 * 4);
  p->cst_off = p->hown_off + align256((size_t)p->B * p->own * 4);
  p->smem = p->cst_off + align256((size_t)p->L * sizeof(gp_dlayer) + GP_DPLAN_MAX_B * 8 + (size_t)p->hd * 4);
  int dev = 0, optin = 0, coop = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
  if (!coop) return gp_error("decode_plan: the device cannot launch cooperative kernels");
  if (p->smem > (size_t)optin)
    return gp_error(
        "decode_plan: a block needs %zu bytes of shared memory (the rows of the largest products an SM "
        "and %d rows of activations), the device has %d",
        p->smem, p->B, optin);
  if (cudaFuncSetAttribute(k_decode_step, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p->smem) != cudaSuccess)
    return gp_cuda_check_launch("decode_plan");
  int nb = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_decode_step, DS_THREADS, p->smem) != cudaSuccess || nb < 1) {
    cudaGetLastError();
    return gp_error("decode_plan: a block of %d threads with %zu bytes of shared memory does not fit on an SM",
                    DS_THREADS, p->smem);
  }
  p->grid = G;
  return GP_OK;
}

/* the layer table and the scratch (h, qkv, y, gu, partials, counters); counters zeroed */
static size_t scratch_layout(const struct gp_decode_plan *p, size_t off[6]) {
  const size_t B = (size_t)p->B, Nq = (size_t)(p->H + 2 * p->J) * p->hd;
  const size_t sz[6] = {B * p->d * 2,
                        B * Nq * 2,
                        B * p->H * p->hd * 2,
                        B * 2 * p->I * 2,
                        B * p->H * (size_t)((p->C + DS_CHUNK - 1) / DS_CHUNK) * (p->hd + 2) * 4,
                        (B * p->H + 2) * 4};
  size_t t = 0;
  for (int i = 0; i < 6; i++) off[i] = t, t += align256(sz[i]);
  return t;
}

extern "C" int gp_cuda_decode_plan_upload(struct gp_decode_plan *p) {
  const size_t tb = sizeof(gp_dlayer) * (size_t)p->L;
  gp_dlayer *h = (gp_dlayer *)calloc((size_t)p->L, sizeof(gp_dlayer));
  if (!h) return gp_error_oom("decode_plan: out of host memory");
  for (int l = 0; l < p->L; l++) {
    const gp_tensor *const *t = p->ts + (size_t)l * GP_DPLAN_PER_LAYER;
    h[l] = gp_dlayer{gp_ptr(t[0]), gp_ptr(t[1]), gp_ptr(t[2]), gp_ptr(t[3]),
                     gp_ptr(t[4]), gp_ptr(t[5]), gp_ptr(t[6]), gp_ptr(t[7])};
  }
  size_t off[6];
  const size_t sb = scratch_layout(p, off);
  int rc = gp_alloc(&p->dev, &p->dev_bytes, tb, GP_CUDA);
  if (rc == GP_OK) rc = gp_cuda_memcpy(p->dev, h, tb, 1);
  free(h);
  if (rc == GP_OK) rc = gp_alloc(&p->scratch, &p->scratch_bytes, sb, GP_CUDA);
  if (rc == GP_OK && cudaMemsetAsync((char *)p->scratch + off[5], 0, sb - off[5], gp_cuda_stream()) != cudaSuccess)
    rc = gp_cuda_check_launch("decode_plan");
  if (rc == GP_OK) rc = gp_cuda_sync("decode_plan");
  return rc;
}

extern "C" int gp_cuda_decode_plan_run(struct gp_decode_plan *p, gp_tensor *out, const gp_tensor *x,
                                       const gp_tensor *pos, const gp_tensor *lens, const gp_tensor *inv_freq,
                                       double scale) {
  size_t off[6];
  scratch_layout(p, off);
  char *s = (char *)p->scratch;
  DArgs a;
  a.layers = (const gp_dlayer *)p->dev;
  a.x = (const bf *)gp_ptr(x);
  a.lnf = (const bf *)gp_ptr(p->ts[(size_t)p->L * GP_DPLAN_PER_LAYER]);
  a.out = (bf *)gp_ptr(out);
  a.h = (bf *)(s + off[0]);
  a.qkv = (bf *)(s + off[1]);
  a.y = (bf *)(s + off[2]);
  a.gu = (bf *)(s + off[3]);
  a.part = (float *)(s + off[4]);
  a.cnt = (unsigned *)(s + off[5]);
  a.bar = a.cnt + (size_t)p->B * p->H;
  a.pos = gp_ptr(pos);
  a.pos64 = pos->dtype == GP_I64;
  a.lens = (const int64_t *)gp_ptr(lens);
  a.inv_freq = (const float *)gp_ptr(inv_freq);
  a.L = p->L, a.B = p->B, a.d = p->d, a.H = p->H, a.J = p->J, a.hd = p->hd, a.I = p->I;
  a.C = p->C, a.eps = p->eps, a.scale = (float)scale;
  a.buf1_off = (unsigned)p->buf1_off, a.ln_off = (unsigned)p->ln_off, a.xs_off = (unsigned)p->xs_off;
  a.att_off = (unsigned)p->att_off, a.red_off = (unsigned)p->red_off, a.hown_off = (unsigned)p->hown_off;
  a.own = (unsigned)p->own, a.cst_off = (unsigned)p->cst_off;
  GP_TRY(gp_bad_begin(&a.bad, "decode_step", p->C, "the caches' positions"));
  if (cudaMemsetAsync(a.bar, 0, sizeof(unsigned), gp_cuda_stream()) != cudaSuccess)
    return gp_cuda_check_launch("decode_step");
  gp_pdl_break(); /* a cooperative launch: not a chain kernel */
  gp_cuda_note_launch((const void *)k_decode_step, DS_THREADS, (int)p->smem);
  cudaLaunchAttribute at[1];
  cudaLaunchConfig_t cfg = gp_cluster_cfg(dim3(p->grid), dim3(DS_THREADS), p->smem, 1, at);
  at[0].id = cudaLaunchAttributeCooperative;
  at[0].val.cooperative = 1;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, k_decode_step, a);
  gp_pdl_break();
  return gp_bad_end("decode_step");
}
