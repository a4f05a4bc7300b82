/* rope.cu: the rotary embedding, one thread per (row, frequency) pair; the
 * angle in f32 as Hugging Face computes it (pos * inv_freq), sincos in full
 * precision. x may be a strided view (the q or k heads of a qkv buffer). */
#include "../src/cuda_internal.h"
#include "bad_index.cuh"
#include "rope.h"

namespace {
struct RopeGeom {
  int nd;                       /* dims of x but the last */
  int64_t shape[GP_MAX_DIMS];   /* of x, all but the last dim */
  int64_t stride[GP_MAX_DIMS];
  int64_t T, H, E, pos_stride;
};

template <typename T, typename P>
__global__ void k_rope(T *__restrict__ out, const T *__restrict__ x, const P *__restrict__ pos,
                       const float *__restrict__ inv_freq, RopeGeom g, float sign, int64_t n) {
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n; idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / g.E, i = idx - r * g.E;
    int64_t rem = r, off = 0;
    for (int d = g.nd - 1; d >= 0; d--) {
      off += (rem % g.shape[d]) * g.stride[d];
      rem /= g.shape[d];
    }
    const int64_t t = (r / g.H) % g.T;
    const float th = (float)pos[t * g.pos_stride] * inv_freq[i];
    float s, c;
    sincosf(th, &s, &c);
    s *= sign;
    const float a = ld(x[off + i]), b = ld(x[off + i + g.E]);
    out[r * 2 * g.E + i] = st<T>(a * c - b * s);
    out[r * 2 * g.E + i + g.E] = st<T>(b * c + a * s);
  }
}
/* rope_kv_at: one thread per (row, head, frequency): q and k heads turn the
 * pair (i, i + E), v heads copy it; pos out of range: reported, nothing written */
template <typename T, typename P>
__global__ void k_rope_kv_at(T *__restrict__ q, T *__restrict__ kc, T *__restrict__ vc, const T *__restrict__ x,
                             const P *__restrict__ pos, const float *__restrict__ inv_freq, int64_t xs, int H, int J,
                             int E, int64_t C, int64_t n, gp_bad_ref bad) {
  const int64_t p = (int64_t)pos[0];
  if (p < 0 || p >= C) {
    if (blockIdx.x == 0 && threadIdx.x == 0) gp_report_bad(bad, p);
    return;
  }
  const int D = 2 * E, NH = H + 2 * J;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n; idx += (int64_t)gridDim.x * blockDim.x) {
    const int i = (int)(idx % E);
    const int64_t r = idx / E, b = r / NH;
    const int h = (int)(r - b * NH);
    const T *src = x + b * xs + (int64_t)h * D;
    T *dst = h < H ? q + (b * H + h) * D : (h < H + J ? kc : vc) + ((b * J + (h - H) % J) * C + p) * D;
    if (h >= H + J) { /* v */
      dst[i] = src[i];
      dst[i + E] = src[i + E];
      continue;
    }
    float s, c;
    sincosf((float)p * inv_freq[i], &s, &c);
    const float a = ld(src[i]), bb = ld(src[i + E]);
    dst[i] = st<T>(a * c - bb * s);
    dst[i + E] = st<T>(bb * c + a * s);
  }
}
}  // namespace

extern "C" int gp_cuda_rope_kv_at(gp_tensor *q, gp_tensor *kc, gp_tensor *vc, const gp_tensor *qkv,
                                  const gp_tensor *pos, const gp_tensor *inv_freq) {
  const int64_t B = q->shape[0], C = kc->shape[2];
  const int H = (int)q->shape[1], J = (int)kc->shape[1], E = (int)gp_numel(inv_freq);
  const int64_t n = B * (H + 2 * J) * (int64_t)E;
  if (n == 0) return GP_OK;
  gp_bad_ref bad;
  GP_TRY(gp_bad_begin(&bad, "rope_kv_at", C, "the caches' dim 3 (positions)"));
  cudaStream_t s = gp_cuda_stream();
  const float *f = (const float *)gp_ptr(inv_freq);
  GP_FLOAT_SWITCH(q->dtype, T, {
    T *pq = (T *)gp_ptr(q), *pk = (T *)gp_ptr(kc), *pv = (T *)gp_ptr(vc);
    const T *px = (const T *)gp_ptr(qkv);
    if (pos->dtype == GP_I64) {
      GP_NOTE_LAUNCH((k_rope_kv_at<T, int64_t>), 256, 0);
      k_rope_kv_at<T, int64_t><<<gp_grid(n, 256), 256, 0, s>>>(pq, pk, pv, px, (const int64_t *)gp_ptr(pos), f,
                                                               qkv->stride[0], H, J, E, C, n, bad);
    } else {
      GP_NOTE_LAUNCH((k_rope_kv_at<T, int32_t>), 256, 0);
      k_rope_kv_at<T, int32_t><<<gp_grid(n, 256), 256, 0, s>>>(pq, pk, pv, px, (const int32_t *)gp_ptr(pos), f,
                                                               qkv->stride[0], H, J, E, C, n, bad);
    }
  });
  return gp_bad_end("rope_kv_at");
}

extern "C" int gp_cuda_rope(gp_tensor *out, const gp_tensor *x, const gp_tensor *pos, const gp_tensor *inv_freq,
                            double sign) {
  const int nd = x->ndim;
  RopeGeom g;
  g.nd = nd - 1;
  for (int d = 0; d < nd - 1; d++) {
    g.shape[d] = x->shape[d];
    g.stride[d] = x->stride[d];
  }
  g.T = x->shape[nd - 3];
  g.H = x->shape[nd - 2];
  g.E = gp_numel(inv_freq);
  g.pos_stride = pos->stride[0];
  const int64_t n = gp_numel(x) / 2;
  if (n == 0) return GP_OK;
  cudaStream_t s = gp_cuda_stream();
  const float *f = (const float *)gp_ptr(inv_freq);
  GP_FLOAT_SWITCH(x->dtype, T, {
    T *o = (T *)gp_ptr(out);
    const T *xi = (const T *)gp_ptr(x);
    if (pos->dtype == GP_I64) {
      GP_NOTE_LAUNCH((k_rope<T, int64_t>), 256, 0);
      k_rope<T, int64_t><<<gp_grid(n, 256), 256, 0, s>>>(o, xi, (const int64_t *)gp_ptr(pos), f, g, (float)sign, n);
    } else {
      GP_NOTE_LAUNCH((k_rope<T, int32_t>), 256, 0);
      k_rope<T, int32_t><<<gp_grid(n, 256), 256, 0, s>>>(o, xi, (const int32_t *)gp_ptr(pos), f, g, (float)sign, n);
    }
  });
  return gp_cuda_check_launch("rope");
}
