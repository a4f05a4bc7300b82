/* attention.cu: flash attention on the GPU, the dispatch. attention.c has
 * checked the arguments (gp_attention_supported: the head dims); this file
 * checks what the GPU kernels need beyond that, fills the launch parameters
 * and chooses the implementation by capability and shape (attention.cuh
 * lists them, one .cu each):
 *
 *   forward and backward, bf16/f16 at head dim 64 or 128 with every row
 *   16-byte aligned (rows16): the tensor cores. On a compute capability 9.0
 *   GPU of a build with sm_90a code the wgmma kernels (the forward when
 *   scale > 0, the backward at head dim 64), else the mma.sync kernels;
 *   everything else (f32, head dim 32, unaligned views): the plain kernels.
 *   decode: the split-K kernels; a prefill chunk over a compressed cache
 *   (attn_chunk_q): the many-row kernel when its rows fill the GPU, else
 *   the decode kernels with a position's heads as the rows.
 *
 * k and v may have fewer heads than q (grouped-query attention, P.G query
 * heads to a KV head): every implementation reads KV head h / G for query
 * head h, and each backward's dk/dv kernel sums over the G query heads.
 *
 * Settings (environment, read once a process):
 *   GP_ATTN_DETERMINISTIC=1  the Hopper backward keeps dq in a kernel of its
 *                            own (no atomics: bitwise repeatable; slower)
 *   GP_ATTN_IMPL=mma         (or new, its earlier name) a Hopper GPU takes the
 *                            mma.sync kernels that other GPUs run, so one H100
 *                            tests both paths
 *   GP_ATTN_CHUNK=rows|heads a prefill chunk over a compressed cache
 *                            (attn_chunk_q) takes the many-row kernel
 *                            whenever it can (rows) or never (heads: the
 *                            decode kernels, rows = heads of a position);
 *                            unset: rows when its blocks fill the GPU */
#include <cstdlib>
#include <cstring>

#include "attention.cuh"

using namespace gp_attn;

namespace {

int fill_params(AttnP &P, const char *op, const gp_tensor *q, const gp_tensor *k, double scale, int64_t win, int64_t ng,
                int causal) {
  char bq[96], bk[96];
  if (q->shape[2] >= INT32_MAX / 2 || k->shape[2] >= INT32_MAX / 2)
    return gp_error("%s: sequence lengths must be below 2^30 on the GPU; q is %s, k is %s", op, gp_shape_str(q, bq, 96),
                    gp_shape_str(k, bk, 96));
  if (q->shape[0] * q->shape[1] > 65535)
    return gp_error("%s: B * H must be at most 65535 on the GPU; q is %s", op, gp_shape_str(q, bq, 96));
  P.H = (int)q->shape[1];
  P.Hkv = (int)k->shape[1]; /* divides H (the spec's H/G) */
  P.G = P.Hkv > 0 ? P.H / P.Hkv : 1;
  P.T = (int)q->shape[2];
  P.S = (int)k->shape[2];
  P.scale = (float)scale;
  P.win = (int)(win > INT32_MAX / 2 ? INT32_MAX / 2 : win);
  P.ng = (int)(ng > P.S ? P.S : ng);
  P.causal = causal;
  /* GP_ATTN_L2_MB: head_tile's budget (the wgmma kernels; 0: tile-major over all heads, as before) */
  static const int l2mb = getenv("GP_ATTN_L2_MB") ? atoi(getenv("GP_ATTN_L2_MB")) : 16;
  P.l2 = l2mb > 0 && l2mb < 2048 ? l2mb << 20 : 0;
  return GP_OK;
}

/* the tensor-core paths' layout rule: a 16-byte aligned base and every B, H, T
 * stride (of a dim longer than 1) a multiple of 16 bytes, so that every row
 * starts 16-byte aligned (cp.async, ldmatrix, the 4-byte stores) */
bool rows16(const gp_tensor *t) {
  if (((uintptr_t)gp_ptr(t) & 15) != 0) return false;
  const int64_t es = gp_elsize(t->dtype);
  for (int d = 0; d < 3; d++)
    if (t->shape[d] > 1 && (t->stride[d] * es) % 16 != 0) return false;
  return true;
}

/* the wgmma kernels run: a compute capability 9.0 GPU, a build with sm_90a
 * code, and no GP_ATTN_IMPL=mma */
bool use_wg() {
  static int wg = -1;
  if (wg < 0) {
#ifdef GP_SM90A
    const char *e = getenv("GP_ATTN_IMPL");
    wg = gp_cuda_cc() == 90 && !(e && (!strcmp(e, "mma") || !strcmp(e, "new")));
#else
    wg = 0;
#endif
  }
  return wg;
}

bool deterministic() {
  static int det = -1;
  if (det < 0) {
    const char *e = getenv("GP_ATTN_DETERMINISTIC");
    det = e && strcmp(e, "") && strcmp(e, "0");
  }
  return det;
}

} // namespace

extern "C" int gp_cuda_attn_fwd(gp_tensor *out, gp_tensor *lse, const gp_tensor *q, const gp_tensor *k,
                                const gp_tensor *v, double scale, int64_t window, int64_t n_global, int causal) {
  AttnP P = {};
  GP_TRY(fill_params(P, "attn_fwd", q, k, scale, window, n_global, causal));
  int64_t BH = q->shape[0] * q->shape[1], D = q->shape[3];
  if (BH == 0 || P.T == 0) return GP_OK;
  P.q = gp_ptr(q);
  P.k = gp_ptr(k);
  P.v = gp_ptr(v);
  P.out = gp_ptr(out);
  P.lse = (float *)gp_ptr(lse);
  P.sq = strides(q);
  P.sk = strides(k);
  P.sv = strides(v);
  P.so = strides(out);
  /* head dim 32 has the plain kernels only; wgmma's forward takes the row
   * max on the raw scores (scale > 0) */
  const bool tc = q->dtype != GP_F32 && D != 32 && P.S > 0 && rows16(q) && rows16(k) && rows16(v) && rows16(out);
  int rc;
  if (tc && P.scale > 0.f && use_wg()) rc = fwd_wg(P, BH, q->dtype, (int)D);
  else if (tc) rc = fwd_mma(P, BH, q->dtype, (int)D);
  else rc = fwd_plain(P, BH, q->dtype, (int)D);
  GP_TRY(rc);
  return gp_cuda_check_launch("attn_fwd");
}

extern "C" int gp_cuda_attn_bwd(gp_tensor *dq, gp_tensor *dk, gp_tensor *dv, const gp_tensor *q, const gp_tensor *k,
                                const gp_tensor *v, const gp_tensor *out, const gp_tensor *lse, const gp_tensor *dout,
                                double scale, int64_t window, int64_t n_global, int causal) {
  AttnP P = {};
  GP_TRY(fill_params(P, "attn_bwd", q, k, scale, window, n_global, causal));
  int64_t BH = q->shape[0] * q->shape[1], D = q->shape[3];
  if (BH == 0 || (P.T == 0 && P.S == 0)) return GP_OK;
  P.q = gp_ptr(q);
  P.k = gp_ptr(k);
  P.v = gp_ptr(v);
  P.o = gp_ptr(out);
  P.dout = gp_ptr(dout);
  P.lse_in = (const float *)gp_ptr(lse);
  P.dq = gp_ptr(dq);
  P.dk = gp_ptr(dk);
  P.dv = gp_ptr(dv);
  P.sq = strides(q);
  P.sk = strides(k);
  P.sv = strides(v);
  P.so = strides(out);
  P.sg = strides(dout);
  P.sdq = strides(dq);
  P.sdk = strides(dk);
  P.sdv = strides(dv);
  /* a grid of 0 blocks is a launch error: T = 0 or S = 0 runs one side only
   * (the other gradients are zeros, written at their strides) */
  int rc = GP_OK;
  if (P.T == 0 || P.S == 0) {
    GP_TRY(zero_rows(P.T == 0 ? dk : dq));
    if (P.T == 0) GP_TRY(zero_rows(dv));
    return gp_cuda_check_launch("attn_bwd");
  }
  /* wgmma's backward: at head dim 128 in two kernels (dQ's accumulator does
   * not fit a warpgroup's registers beside dK, dV, S and dP) */
  const bool tc = q->dtype != GP_F32 && D != 32 && rows16(q) && rows16(k) && rows16(v) && rows16(dout) && rows16(dq) &&
                  rows16(dk) && rows16(dv);
  if (tc && (D == 64 || D == 128) && use_wg()) rc = bwd_wg(P, BH, q->dtype, (int)D, deterministic());
  else if (tc) rc = bwd_mma(P, BH, q->dtype, (int)D);
  else rc = bwd_plain(P, BH, q->dtype, (int)D);
  GP_TRY(rc);
  return gp_cuda_check_launch("attn_bwd");
}

/* decode attention over kcache, vcache in q's dtype (fmt 0) or over codes
 * with scales ks, vs (fmt 1 int8, 2 fp8); chunk: q, out (B, T, H, D), T
 * queries a sequence (rows b, t, h), else (B, H, D) */
static int run_decode(const char *op, gp_tensor *out, const gp_tensor *q, const gp_tensor *kcache,
                      const gp_tensor *vcache, const gp_tensor *ks, const gp_tensor *vs, const gp_tensor *lens,
                      double scale, int64_t window, int64_t n_global, int fmt, bool chunk) {
  const int hd = chunk ? 2 : 1; /* q's head dim */
  int64_t B = q->shape[0], T = chunk ? q->shape[1] : 1, H = q->shape[hd], D = q->shape[hd + 1],
          C = kcache->shape[2], BH = B * T * H;
  if (BH == 0) return GP_OK;
  if (C >= INT32_MAX / 2 || BH >= INT32_MAX / 2) {
    char bk[96], bq[96];
    return gp_error("%s: kcache %s or q %s is too large for the GPU kernel (C < 2^30, rows < 2^30)", op,
                    gp_shape_str(kcache, bk, 96), gp_shape_str(q, bq, 96));
  }
  DecP P = {};
  P.q = gp_ptr(q);
  P.kc = gp_ptr(kcache);
  P.vc = gp_ptr(vcache);
  P.ks = fmt ? (const float *)gp_ptr(ks) : nullptr;
  P.vs = fmt ? (const float *)gp_ptr(vs) : nullptr;
  P.lens = gp_ptr(lens);
  P.out = gp_ptr(out);
  P.out_n = gp_span_of(out).n;
  P.lens64 = lens->dtype == GP_I64;
  P.H = (int)H;
  P.T = (int)T;
  P.Hkv = (int)kcache->shape[1]; /* divides H */
  P.G = P.Hkv > 0 ? P.H / P.Hkv : 1;
  P.C = (int)C;
  P.scale = (float)scale;
  P.win = (int)(window > INT32_MAX / 2 ? INT32_MAX / 2 : window);
  P.ng = (int)(n_global > C ? C : n_global);
  const bool vec = (((uintptr_t)P.q | (uintptr_t)P.kc | (uintptr_t)P.vc) & 15) == 0;
  /* a chunk of many rows (bf16/f16 queries): the many-row kernel, which reads the cache once per 64 rows of a
   * KV head instead of once per <= 8, when its blocks fill a quarter of the SMs (H200, B4 Hkv8 D128 over 32K
   * int8 positions: 64 queries 1.34 ms against 3.05 with the decode kernels; 16 queries, 32 blocks, 1.42
   * against 0.76). GP_ATTN_DECODE=cores: never; GP_ATTN_CHUNK=rows: whenever it can, =heads: never */
  static const int chunk_rule = [] {
    const char *e = getenv("GP_ATTN_CHUNK");
    return e && !strcmp(e, "rows") ? 1 : e && !strcmp(e, "heads") ? -1 : 0;
  }();
  if (chunk && vec && q->dtype != GP_F32 && decode_tc() && P.Hkv > 0 && B * P.Hkv <= 65535 && chunk_rule >= 0 &&
      (chunk_rule > 0 || 4 * B * P.Hkv * ((P.G * T + 63) / 64) >= gp_cuda_sm_count()) &&
      chunk_tc(P, B, q->dtype, (int)D, fmt))
    return gp_cuda_check_launch(op);
  const int nq = vec ? decode_heads_per_block(P.G, q->dtype != GP_F32) : 1; /* query heads a block (a KV head's read serves them) */
  /* slices of the cache: as many as fill the GPU's block slots once (equal
   * slices: a second, partial wave would cost a whole slice's time), of at
   * least 128 keys; one for caches of at most 512 positions */
  int per_sm = 1;
  decode(P, BH, q->dtype, (int)D, vec, fmt, nq, &per_sm);
  const int64_t rows = BH / nq, slots = (int64_t)gp_cuda_sm_count() * per_sm;
  int64_t want = rows >= slots ? 1 : slots / rows, most = (C + 127) / 128;
  if (C <= 512) want = 1; /* short: one block a row reads it sooner than a second kernel could combine slices */
  int64_t nsplit = want < most ? want : most;
  if (nsplit < 1) nsplit = 1;
  int64_t chunk_len = (C + nsplit - 1) / nsplit;
  if (chunk_len < 1) chunk_len = 1;
  nsplit = (C + chunk_len - 1) / chunk_len;
  if (nsplit < 1) nsplit = 1;
  P.chunk = (int)chunk_len;
  P.nsplit = (int)nsplit;
  gp_tensor *part = 0; /* the slices' partials (none with one slice) */
  int64_t pn = BH * nsplit * (D + 2);
  if (nsplit > 1) GP_TRY(gp_tensor_scratch(&part, GP_F32, GP_CUDA, 1, &pn));
  P.part = part ? (float *)gp_ptr(part) : nullptr;
  P.part_n = (size_t)pn * sizeof(float);
  /* launches of at most 65535 blocks of rows (the grid's y) */
  int rc = GP_OK;
  for (int64_t r0 = 0; r0 < BH && rc == GP_OK; r0 += 65535LL * nq) {
    P.row0 = (int)r0;
    rc = decode(P, BH - r0 < 65535LL * nq ? BH - r0 : 65535LL * nq, q->dtype, (int)D, vec, fmt, nq, nullptr);
  }
  gp_tensor_free(part); /* stream-ordered: the allocator reuses it after the kernels */
  GP_TRY(rc);
  return gp_cuda_check_launch(op);
}

extern "C" int gp_cuda_attn_decode(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcache, const gp_tensor *vcache,
                                   const gp_tensor *lens, double scale, int64_t window, int64_t n_global) {
  return run_decode("attn_decode", out, q, kcache, vcache, nullptr, nullptr, lens, scale, window, n_global, 0, false);
}

extern "C" int gp_cuda_attn_decode_q(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcodes,
                                     const gp_tensor *vcodes, const gp_tensor *kscales, const gp_tensor *vscales,
                                     const gp_tensor *lens, double scale, int64_t window, int64_t n_global, int fmt) {
  return run_decode("attn_decode_q", out, q, kcodes, vcodes, kscales, vscales, lens, scale, window, n_global, fmt,
                    false);
}

extern "C" int gp_cuda_attn_chunk_q(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcodes,
                                    const gp_tensor *vcodes, const gp_tensor *kscales, const gp_tensor *vscales,
                                    const gp_tensor *lens, double scale, int64_t window, int64_t n_global, int fmt) {
  return run_decode("attn_chunk_q", out, q, kcodes, vcodes, kscales, vscales, lens, scale, window, n_global, fmt, true);
}
