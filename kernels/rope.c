/* rope.c: checks and the CPU reference of the rotary embedding, in double.
 * Element i < E of a head and element i + E (E = D / 2) turn together by
 * theta = pos[t] * inv_freq[i]: (a, b) -> (a cos - b sin, b cos + a sin);
 * sign -1 turns by -theta, the transpose, which is the gradient. */
#include <math.h>
#include <stdlib.h>

#include "gp_hd.h"
#include "kvquant.h"
#include "rope.h"

/* one head: elements i and i + E of the E-pair head at src (stride 1) turned by
 * p * inv_freq[i] (sign -1: back), written at dst */
static void rotate_head(char *po, int64_t dst, const char *px, int64_t src, int dt, int64_t E, double p,
                        const float *pf, double sign) {
  for (int64_t i = 0; i < E; i++) {
    const double th = p * (double)pf[i], c = cos(th), s = sign * sin(th);
    const double a = gp_load(px, dt, src + i), b = gp_load(px, dt, src + i + E);
    gp_store(po, dt, dst + i, a * c - b * s);
    gp_store(po, dt, dst + i + E, b * c + a * s);
  }
}

int gp_k_rope(gp_tensor *out, const gp_tensor *x, const gp_tensor *pos, const gp_tensor *inv_freq, double sign) {
  GP_CHECK(rope, out, x, pos, inv_freq);
  const int nd = x->ndim;
  if (nd < 3) return gp_error("rope: x is %s; it must be (..., T, H, D)", GP_SHAPE(x));
  const int64_t D = x->shape[nd - 1], H = x->shape[nd - 2], T = x->shape[nd - 3], E = gp_numel(inv_freq);
  if (D != 2 * E)
    return gp_error("rope: x is %s and inv_freq %s; the head dim must be twice the number of frequencies", GP_SHAPE(x),
                    GP_SHAPE(inv_freq));
  if (sign != 1 && sign != -1) return gp_error("rope: sign = %g; it must be 1 or -1", sign);
  GP_CUDA_DISPATCH(out, gp_cuda_rope(out, x, pos, inv_freq, sign));
  const int64_t rows = gp_numel(x) / (D > 0 ? D : 1);
  const char *px = gp_ptr(x), *pp = gp_ptr(pos);
  const float *pf = gp_ptr(inv_freq);
  char *po = gp_ptr(out);
  const int dt = x->dtype;
  for (int64_t r = 0; r < rows; r++) {
    /* the element offset of row r (all dims but the last) in the strided x */
    int64_t rem = r, off = 0;
    for (int d = nd - 2; d >= 0; d--) {
      off += (rem % x->shape[d]) * x->stride[d];
      rem /= x->shape[d];
    }
    const int64_t t = (r / H) % T;
    rotate_head(po, r * D, px, off, dt, E, (double)gp_load_i64(pp, pos->dtype, t * pos->stride[0]), pf, sign);
  }
  return GP_OK;
}

/* the shapes rope_kv_at and rope_kv_quant_at (op) share: q (B, H, D), caches
 * of J heads, qkv rows of (H + 2 J) D, D = 2 E */
static int kv_row_shapes(const char *op, const gp_tensor *q, const gp_tensor *kc, const gp_tensor *qkv,
                         const gp_tensor *inv_freq) {
  const int64_t H = q->shape[1], D = q->shape[2], J = kc->shape[1], E = gp_numel(inv_freq), W = qkv->shape[1];
  if (D != 2 * E)
    return gp_error("%s: q is %s and inv_freq %s; the head dim must be twice the number of frequencies", op,
                    GP_SHAPE(q), GP_SHAPE(inv_freq));
  if (W != (H + 2 * J) * D)
    return gp_error("%s: qkv is %s; with q %s and kc %s its rows must hold (H + 2 J) D = %lld values", op,
                    GP_SHAPE(qkv), GP_SHAPE(q), GP_SHAPE(kc), (long long)((H + 2 * J) * D));
  return GP_OK;
}

/* the position pos[0] of a decode row, in [0, C) of the caches kc (op names the error) */
static int kv_row_pos(const char *op, const gp_tensor *pos, const gp_tensor *kc, int64_t *p) {
  *p = gp_load_i64(gp_ptr(pos), pos->dtype, 0);
  if (*p < 0 || *p >= kc->shape[2])
    return gp_error("%s: position %lld is outside the caches' dim 3 of size %lld (kc %s)", op, (long long)*p,
                    (long long)kc->shape[2], GP_SHAPE(kc));
  return GP_OK;
}

/* rope_kv_at: the decode token's q, k and v from its fused projection: q and
 * k turned as above at the position pos[0] (read where it lives), k and v
 * written into the caches at that position. */
int gp_k_rope_kv_at(gp_tensor *q, gp_tensor *kc, gp_tensor *vc, const gp_tensor *qkv, const gp_tensor *pos,
                    const gp_tensor *inv_freq) {
  GP_CHECK(rope_kv_at, q, kc, vc, qkv, pos, inv_freq);
  const int64_t B = q->shape[0], H = q->shape[1], D = q->shape[2], J = kc->shape[1], C = kc->shape[2];
  const int64_t E = gp_numel(inv_freq);
  GP_TRY(kv_row_shapes("rope_kv_at", q, kc, qkv, inv_freq));
  GP_CUDA_DISPATCH(q, gp_cuda_rope_kv_at(q, kc, vc, qkv, pos, inv_freq));
  int64_t p;
  GP_TRY(kv_row_pos("rope_kv_at", pos, kc, &p));
  const char *px = gp_ptr(qkv);
  const float *pf = gp_ptr(inv_freq);
  const int dt = q->dtype;
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H + 2 * J; h++) {
      const int64_t src = b * qkv->stride[0] + h * D; /* the head's first value in qkv */
      char *po = h < H ? gp_ptr(q) : h < H + J ? gp_ptr(kc) : gp_ptr(vc);
      const int64_t dst = h < H ? (b * H + h) * D : ((b * J + (h - H) % J) * C + p) * D;
      if (h < H + J) rotate_head(po, dst, px, src, dt, E, (double)p, pf, 1);
      else /* v: as it is */
        for (int64_t d = 0; d < D; d++) gp_store(po, dt, dst + d, gp_load(px, dt, src + d));
    }
  return GP_OK;
}

/* rope_kv_quant_at: rope_kv_at into a compressed cache; each k head turned
 * into a row of q's dtype first (as gp.rope then kv_quant_append would see
 * it), then quantized less its center, the v heads as they are */
int gp_k_rope_kv_quant_at(gp_tensor *q, gp_tensor *kc, gp_tensor *vc, gp_tensor *ks, gp_tensor *vs,
                          const gp_tensor *kcen, const gp_tensor *qkv, const gp_tensor *pos, const gp_tensor *inv_freq,
                          double fmt) {
  GP_CHECK(rope_kv_quant_at, q, kc, vc, ks, vs, kcen, qkv, pos, inv_freq);
  if (fmt != GP_KV_INT8 && fmt != GP_KV_FP8)
    return gp_error("rope_kv_quant_at: fmt must be 1 (int8) or 2 (fp8 e4m3), got %g", fmt);
  const int64_t B = q->shape[0], H = q->shape[1], D = q->shape[2], J = kc->shape[1], C = kc->shape[2];
  const int64_t E = gp_numel(inv_freq);
  GP_TRY(kv_row_shapes("rope_kv_quant_at", q, kc, qkv, inv_freq));
  GP_CUDA_DISPATCH(q, gp_cuda_rope_kv_quant_at(q, kc, vc, ks, vs, kcen, qkv, pos, inv_freq, (int)fmt));
  int64_t p;
  GP_TRY(kv_row_pos("rope_kv_quant_at", pos, kc, &p));
  const char *px = gp_ptr(qkv);
  const float *pf = gp_ptr(inv_freq);
  const int dt = q->dtype;
  char *tmp = malloc((size_t)(D > 0 ? D : 1) * gp_elsize(dt));
  if (!tmp) return gp_error("rope_kv_quant_at: out of host memory");
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H + 2 * J; h++) {
      const int64_t src = b * qkv->stride[0] + h * D, row = (b * J + (h - H) % J) * C + p;
      if (h < H) rotate_head(gp_ptr(q), (b * H + h) * D, px, src, dt, E, (double)p, pf, 1);
      else if (h < H + J) {
        rotate_head(tmp, 0, px, src, dt, E, (double)p, pf, 1);
        const float *cen = (const float *)gp_ptr(kcen) + (b * J + h - H) * D;
        gp_kvq_quant_row((uint8_t *)gp_ptr(kc) + row * D, (float *)gp_ptr(ks) + row, tmp, 0, dt, D, cen, (int)fmt);
      } else {
        gp_kvq_quant_row((uint8_t *)gp_ptr(vc) + row * D, (float *)gp_ptr(vs) + row, px, src, dt, D, NULL, (int)fmt);
      }
    }
  free(tmp);
  return GP_OK;
}
