/* rope.cu: the rotary embedding, one thread per (row, frequency) pair; the
 * angle in f32 as Hugging Face computes it (pos * inv_freq), sincos in full
 * precision. x may be a strided view (the q or k heads of a qkv buffer). */
#include "../src/cuda_internal.h"
#include "bad_index.cuh"
#include "kvquant.cuh"
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
  gp_pdl_trigger(); /* a chain kernel (cuda_internal.h) */
  gp_pdl_wait();
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
/* rope_kv_quant_at: one warp per (row, head): q heads turn as above; a k
 * head turns (rounded to T, as gp.rope's output), less its center, and, like
 * a v head, is quantized as k_kv_quant_append does (the row's max |x| by shuffles, then
 * the codes): the lanes go over the row twice (the max, then the codes) */
template <typename T, typename P, int FMT>
__global__ void __launch_bounds__(256)
    k_rope_kv_quant_at(T *__restrict__ q, uint8_t *__restrict__ kc, uint8_t *__restrict__ vc, float *__restrict__ ks,
                       float *__restrict__ vs, const float *__restrict__ kcen, const T *__restrict__ x,
                       const P *__restrict__ pos, const float *__restrict__ inv_freq, int64_t xs, int H, int J, int E,
                       int64_t C, int64_t rows, gp_bad_ref bad) {
  const int64_t p = (int64_t)pos[0];
  if (p < 0 || p >= C) {
    if (blockIdx.x == 0 && threadIdx.x == 0) gp_report_bad(bad, p);
    return;
  }
  const int D = 2 * E, NH = H + 2 * J, lane = threadIdx.x & 31;
  const int64_t nw = (int64_t)gridDim.x * (blockDim.x >> 5);
  const float mx = kvq_max(FMT);
  for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += nw) {
    const int64_t b = r / NH;
    const int h = (int)(r - b * NH);
    const T *src = x + b * xs + (int64_t)h * D;
    /* element i and i + E of the head: turned (q, k) or as they are (v) */
    auto val = [&](int i, float &lo, float &hi) {
      const float a = ld(src[i]), bb = ld(src[i + E]);
      if (h >= H + J) {
        lo = a, hi = bb;
        return;
      }
      float sn, cs;
      sincosf((float)p * inv_freq[i], &sn, &cs);
      lo = a * cs - bb * sn;
      hi = bb * cs + a * sn;
    };
    if (h < H) {
      T *dst = q + (b * H + h) * D;
      for (int i = lane; i < E; i += 32) {
        float lo, hi;
        val(i, lo, hi);
        dst[i] = st<T>(lo);
        dst[i + E] = st<T>(hi);
      }
      continue;
    }
    const bool isk = h < H + J;
    const int64_t row = (b * J + (h - H) % J) * C + p;
    const float *cen = kcen + (b * J + (h - H) % J) * D;
    /* a k head: rounded to T, less its center */
    auto kval = [&](int i, float &lo, float &hi) {
      val(i, lo, hi);
      if (isk) lo = __fsub_rn(ld(st<T>(lo)), cen[i]), hi = __fsub_rn(ld(st<T>(hi)), cen[i + E]);
    };
    float amax = 0.f;
    for (int i = lane; i < E; i += 32) {
      float lo, hi;
      kval(i, lo, hi);
      amax = fmaxf(amax, fmaxf(fabsf(lo), fabsf(hi)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.f ? __fdiv_rn(mx, amax) : 0.f;
    uint8_t *codes = (isk ? kc : vc) + row * D;
    if (lane == 0) (isk ? ks : vs)[row] = __fdiv_rn(amax, mx);
    for (int i = lane; i < E; i += 32) {
      float lo, hi;
      kval(i, lo, hi);
      codes[i] = kvq_encode_d<FMT>(__fmul_rn(lo, inv));
      codes[i + E] = kvq_encode_d<FMT>(__fmul_rn(hi, inv));
    }
  }
}
template <typename T, typename P, int FMT>
void launch_rkq(gp_tensor *q, uint8_t *pk, uint8_t *pv, float *pks, float *pvs, const float *pc, const gp_tensor *qkv,
                const gp_tensor *pos, const float *f, int H, int J, int E, int64_t C, int64_t rows, gp_bad_ref bad) {
  GP_NOTE_LAUNCH((k_rope_kv_quant_at<T, P, FMT>), 256, 0);
  k_rope_kv_quant_at<T, P, FMT><<<gp_grid(rows * 32, 256), 256, 0, gp_cuda_stream()>>>(
      (T *)gp_ptr(q), pk, pv, pks, pvs, pc, (const T *)gp_ptr(qkv), (const P *)gp_ptr(pos), f, qkv->stride[0], H, J, E,
      C, rows, bad);
}
}  // namespace

extern "C" int gp_cuda_rope_kv_quant_at(gp_tensor *q, gp_tensor *kc, gp_tensor *vc, gp_tensor *ks, gp_tensor *vs,
                                        const gp_tensor *kcen, const gp_tensor *qkv, const gp_tensor *pos,
                                        const gp_tensor *inv_freq, int fmt) {
  const int64_t B = q->shape[0], C = kc->shape[2];
  const int H = (int)q->shape[1], J = (int)kc->shape[1], E = (int)gp_numel(inv_freq);
  const int64_t rows = B * (H + 2 * J);
  if (rows == 0) return GP_OK;
  gp_bad_ref bad;
  GP_TRY(gp_bad_begin(&bad, "rope_kv_quant_at", C, "the caches' dim 3 (positions)"));
  const float *f = (const float *)gp_ptr(inv_freq);
  uint8_t *pk = (uint8_t *)gp_ptr(kc), *pv = (uint8_t *)gp_ptr(vc);
  float *pks = (float *)gp_ptr(ks), *pvs = (float *)gp_ptr(vs);
  const float *pc = (const float *)gp_ptr(kcen);
  GP_FLOAT_SWITCH(q->dtype, T, {
    if (pos->dtype == GP_I64) {
      if (fmt == GP_KV_FP8)
        launch_rkq<T, int64_t, GP_KV_FP8>(q, pk, pv, pks, pvs, pc, qkv, pos, f, H, J, E, C, rows, bad);
      else launch_rkq<T, int64_t, GP_KV_INT8>(q, pk, pv, pks, pvs, pc, qkv, pos, f, H, J, E, C, rows, bad);
    } else {
      if (fmt == GP_KV_FP8)
        launch_rkq<T, int32_t, GP_KV_FP8>(q, pk, pv, pks, pvs, pc, qkv, pos, f, H, J, E, C, rows, bad);
      else launch_rkq<T, int32_t, GP_KV_INT8>(q, pk, pv, pks, pvs, pc, qkv, pos, f, H, J, E, C, rows, bad);
    }
  });
  return gp_bad_end("rope_kv_quant_at");
}

extern "C" int gp_cuda_rope_kv_at(gp_tensor *q, gp_tensor *kc, gp_tensor *vc, const gp_tensor *qkv,
                                  const gp_tensor *pos, const gp_tensor *inv_freq) {
  const int64_t B = q->shape[0], C = kc->shape[2];
  const int H = (int)q->shape[1], J = (int)kc->shape[1], E = (int)gp_numel(inv_freq);
  const int64_t n = B * (H + 2 * J) * (int64_t)E;
  if (n == 0) return GP_OK;
  gp_bad_ref bad;
  GP_TRY(gp_bad_begin(&bad, "rope_kv_at", C, "the caches' dim 3 (positions)"));
  const float *f = (const float *)gp_ptr(inv_freq);
  GP_FLOAT_SWITCH(q->dtype, T, {
    T *pq = (T *)gp_ptr(q), *pk = (T *)gp_ptr(kc), *pv = (T *)gp_ptr(vc);
    const T *px = (const T *)gp_ptr(qkv);
    const dim3 grid(gp_grid(n, 256));
    const gp_spans wr = {gp_span_of(q), gp_span_of(kc), gp_span_of(vc)};
    if (pos->dtype == GP_I64)
      gp_launch_chain(k_rope_kv_at<T, int64_t>, grid, dim3(256), 0, {}, wr, pq, pk, pv, px,
                      (const int64_t *)gp_ptr(pos), f, qkv->stride[0], H, J, E, C, n, bad);
    else
      gp_launch_chain(k_rope_kv_at<T, int32_t>, grid, dim3(256), 0, {}, wr, pq, pk, pv, px,
                      (const int32_t *)gp_ptr(pos), f, qkv->stride[0], H, J, E, C, n, bad);
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
