/* attention.cuh: what the attention dispatch (attention.cu) and its
 * implementations share: the launch parameters, and one entry point per
 * implementation (each in its own .cu, compiled on its own):
 *
 *   attention_wg.cu      Hopper wgmma kernels (sm_90a): forward at D 64 and
 *                        128, backward at D 64; bf16/f16
 *   attention_mma.cu     mma.sync tensor-core kernels (sm_80 and later):
 *                        forward and backward at D 64 and 128; bf16/f16
 *   attention_plain.cu   plain tiled kernels: any float dtype, any alignment,
 *                        D 32, 64, 128
 *   attention_decode.cu  decode: split-K over the cache, then a combine
 *
 * The tensor-core paths need rows 16-byte aligned (attention.cu: rows16).
 * Which head dims exist at all is kernels/attention.c's table
 * (gp_attention_supported); each entry point takes what that allows. */
#ifndef GP_ATTENTION_CUH
#define GP_ATTENTION_CUH

#include <stdint.h>

#include "../src/cuda_internal.h"

namespace gp_attn {

/* element strides of a (B, H, R, D) operand on B, H and R (stride 1 on D) */
struct Str {
  int64_t b, h, r;
};

struct AttnP {
  const void *q, *k, *v, *o, *dout;
  void *out, *dq, *dk, *dv;
  float *lse; /* contiguous (B, H, T) */
  const float *lse_in;
  float *dqa; /* the fused wgmma backward's f32 dQ accumulator (tiles of 64 rows, fragment order) */
  /* so: out (forward) or o (backward) */
  Str sq, sk, sv, so, sg, sdq, sdk, sdv;
  /* H query heads, Hkv = H / G heads in k, v, dk, dv (query head h reads KV head h / G) */
  int H, Hkv, G, T, S;
  float scale;
  int win, ng, causal;
  int l2; /* the bytes of a group of heads' tiles kept in the L2 at once (head_tile; 0: one group) */
};

/* block b of a grid of nh heads x nt tiles -> (head, tile): heads in groups
 * whose working set (bytes_head each) fits in l2 bytes, the tiles of a group
 * before the next group's, tile 0 first, the heads of a group side by side.
 * So the blocks resident at once share a few heads' K and V (forward) or Q,
 * dO and dQ (backward), read once from memory and then from the L2, where
 * tile-major order over all heads streamed every head's at once (H100, B4
 * H32 T4096 D64: more than the L2 holds). l2 = 0: one group (tile-major). */
__device__ __forceinline__ void head_tile(int b, int nh, int nt, int64_t bytes_head, int l2, int &head, int &tile) {
  const int hg = l2 > 0 ? (int)max((int64_t)1, min((int64_t)nh, (int64_t)l2 / max(bytes_head, (int64_t)1))) : nh;
  const int per = hg * nt, g = b / per, r = b - g * per, h0 = g * hg, hn = min(hg, nh - h0);
  tile = r / hn;
  head = h0 + (r - tile * hn);
}

struct DecP {
  const void *q, *kc, *vc, *lens;
  const float *ks, *vs; /* compressed caches: the scales (B, Hkv, C) of kc's and vc's codes */
  void *out;
  float *part;                             /* [BH, nsplit, D + 2]: acc (unnormalized), max (log2 units), sum */
  int lens64, H, Hkv, G, C, chunk, nsplit; /* kc, vc: (B, Hkv, C, D), Hkv = H / G */
  int T, row0; /* T queries a sequence (rows b, t, h; the last at lens[b] - 1); the launch's first row */
  float scale;
  int win, ng;
  size_t out_n, part_n; /* the bytes of out and part (the host's launch records them) */
};

/* element offset of head bh = b * H + h */
__device__ __forceinline__ int64_t head_at(const Str &s, int bh, int H) {
  return (int64_t)(bh / H) * s.b + (int64_t)(bh % H) * s.h;
}
/* element offset in k or v (strides s) of the KV head that query head bh = b * H + h reads: (b, h / G) */
__device__ __forceinline__ int64_t kv_at(const Str &s, int bh, const AttnP &P) {
  const int b = bh / P.H, h = bh % P.H;
  return (int64_t)b * s.b + (int64_t)(P.G == 1 ? h : h / P.G) * s.h;
}
/* the first query head (b * H + hk * G) of KV head bkv = b * Hkv + hk */
__device__ __forceinline__ int group_q0(int bkv, const AttnP &P) { return (bkv / P.Hkv) * P.H + (bkv % P.Hkv) * P.G; }
inline Str strides(const gp_tensor *t) { return Str{t->stride[0], t->stride[1], t->stride[2]}; }

/* key j visible to the query at position p */
__device__ __forceinline__ bool vis(int p, int j, int win, int ng, int causal) {
  if (causal && j > p) return false;
  if (win > 0 && p - j >= win && j >= ng) return false;
  return true;
}

constexpr unsigned FULL = 0xffffffffu; /* every lane of a warp */
constexpr float LOG2E = 1.4426950408889634f;

/* ex2.approx.ftz: one MUFU op (exp2f adds a range fix-up around it) */
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* Entry points: BH = B * H query heads (B * Hkv = BH / P.G KV heads),
 * dtype the operands' (GP_F32 ...), D the head dim; each launches on the
 * current stream and returns a status (the caller checks the launch). The
 * forward and dq kernels run per query head and read its KV head; the dk/dv
 * kernels run per KV head and walk the query tiles of its G query heads in
 * turn, accumulating in registers, and write each element once. */

/* attention_wg.cu: bf16/f16, D 64 or 128, P.scale > 0 (the row max is taken
 * on the raw scores) */
int fwd_wg(const AttnP &P, int64_t BH, int dtype, int D);
/* bf16/f16, D 64 or 128; deterministic or D 128: dk/dv and dq in two kernels
 * (every element written once), else dQ by f32 atomics inside the dk/dv kernel */
int bwd_wg(const AttnP &P, int64_t BH, int dtype, int D, bool deterministic);

/* attention_mma.cu: bf16/f16, D 64 or 128, any scale (P.scale > 0: the row
 * max on the raw scores; else on the scaled scores) */
int fwd_mma(const AttnP &P, int64_t BH, int dtype, int D);
int bwd_mma(const AttnP &P, int64_t BH, int dtype, int D);

/* attention_plain.cu: f32/bf16/f16, D 32, 64 or 128, any alignment */
int fwd_plain(const AttnP &P, int64_t BH, int dtype, int D);
int bwd_plain(const AttnP &P, int64_t BH, int dtype, int D);
/* zeros into a (B, H, R, D) operand at its strides (a backward with T = 0 or S = 0) */
int zero_rows(const gp_tensor *t);

/* attention_decode.cu: f32/bf16/f16, D 64 or 128; vec: q, kc and vc start
 * 16-byte aligned; fmt 0: kc, vc in q's dtype, 1 / 2: int8 / fp8 e4m3
 * codes with the scales P.ks, P.vs (kvquant.h) */
int decode(const DecP &P, int64_t BH, int dtype, int D, bool vec, int fmt, int nq, int *per_sm);
int decode_heads_per_block(int G, bool tc);
bool chunk_tc(const DecP &P, int64_t B, int dtype, int D, int fmt);
bool decode_tc();

} // namespace gp_attn

#endif
