/* rope.c: checks and the CPU reference of the rotary embedding, in double.
 * Element i < E of a head and element i + E (E = D / 2) turn together by
 * theta = pos[t] * inv_freq[i]: (a, b) -> (a cos - b sin, b cos + a sin);
 * sign -1 turns by -theta, the transpose, which is the gradient. */
#include <math.h>

#include "gp_hd.h"
#include "rope.h"

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
    const double p = (double)gp_load_i64(pp, pos->dtype, t * pos->stride[0]);
    for (int64_t i = 0; i < E; i++) {
      const double th = p * (double)pf[i], c = cos(th), s = sign * sin(th);
      const double a = gp_load(px, dt, off + i), b = gp_load(px, dt, off + i + E);
      gp_store(po, dt, r * D + i, a * c - b * s);
      gp_store(po, dt, r * D + i + E, b * c + a * s);
    }
  }
  return GP_OK;
}
