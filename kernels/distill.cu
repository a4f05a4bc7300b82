/* distill.cu: the fused distillation loss, one block per row, streamed over
 * the vocabulary (any row length: nothing of the row is held on chip).
 * Pass 1 reads the student and teacher rows together once: online softmax
 * (max, sum of exponentials) of student/T, teacher/T and, for the
 * cross-entropy term when T != 1, the raw student, plus the weighted sums
 * that give both KL directions (sum q (y - x) and sum p (x - y), rescaled
 * with the running max like the sums of exponentials). The JSD needs the
 * normalized probabilities, so it reads the rows a second time for its
 * sums. The backward pass reads them once more and writes dstudent. All
 * accumulation in f32; 16-byte loads when the rows allow. Formulas and the
 * CPU reference: kernels/distill.c. A target out of range that is not
 * ignore_index gives a NaN row and is reported at the next synchronization
 * (kernels/bad_index.cuh). */
#include "bad_index.cuh"

#include <math.h>

/* f(j, s[j], t[j]) over a pair of rows */
template <typename T, typename F>
__device__ __forceinline__ void pair_read(const T *s, const T *t, int64_t v, bool vec, F f) {
  constexpr int W = 16 / sizeof(T);
  if (vec) {
    const uint4 *qs = reinterpret_cast<const uint4 *>(s), *qt = reinterpret_cast<const uint4 *>(t);
    for (int64_t j = threadIdx.x; j < v / W; j += blockDim.x) {
      uint4 us = qs[j], ut = qt[j];
      const T *es = reinterpret_cast<const T *>(&us), *et = reinterpret_cast<const T *>(&ut);
#pragma unroll
      for (int l = 0; l < W; l++) f(j * W + l, ld(es[l]), ld(et[l]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) f(j, ld(s[j]), ld(t[j]));
  }
}

/* o[j] = g(j, s[j], t[j]) over a pair of rows (hint: the last read of s and t
 * and a write not read back soon: evict-first loads and streaming stores) */
template <typename T, typename G>
__device__ __forceinline__ void pair_map(T *o, const T *s, const T *t, int64_t v, bool vec, G g, bool hint = false) {
  constexpr int W = 16 / sizeof(T);
  if (vec) {
    const uint4 *qs = reinterpret_cast<const uint4 *>(s), *qt = reinterpret_cast<const uint4 *>(t);
    uint4 *w = reinterpret_cast<uint4 *>(o);
    for (int64_t j = threadIdx.x; j < v / W; j += blockDim.x) {
      uint4 us = hint ? __ldcs(qs + j) : qs[j], ut = hint ? __ldcs(qt + j) : qt[j], r;
      const T *es = reinterpret_cast<const T *>(&us), *et = reinterpret_cast<const T *>(&ut);
      T *d = reinterpret_cast<T *>(&r);
#pragma unroll
      for (int l = 0; l < W; l++) d[l] = st<T>(g(j * W + l, ld(es[l]), ld(et[l])));
      if (hint) __stcs(w + j, r);
      else w[j] = r;
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) o[j] = st<T>(g(j, ld(s[j]), ld(t[j])));
  }
}

/* running max m, sum of exp(x - m) z, and sum of exp(x - m) * d w */
struct Acc {
  float m, z, w;
};

__device__ __forceinline__ void acc_add(Acc &a, float x, float d) {
  if (x == -INFINITY) return; /* a zero probability adds nothing (p log p -> 0) */
  if (x > a.m) {
    float r = expf(a.m - x);
    a.z = a.z * r + 1.f;
    a.w = a.w * r + d;
    a.m = x;
  } else {
    float e = expf(x - a.m);
    a.z += e;
    a.w += e * d;
  }
}

__device__ __forceinline__ Acc acc_combine(Acc a, Acc b) {
  float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return Acc{m, a.z + b.z, a.w + b.w};
  float ra = expf(a.m - m), rb = expf(b.m - m);
  return Acc{m, a.z * ra + b.z * rb, a.w * ra + b.w * rb};
}

/* the block's combined accumulators, returned to every thread */
template <int K> __device__ __forceinline__ void block_acc(Acc (&a)[K]) {
  __shared__ Acc sh[K][32];
#pragma unroll
  for (int k = 0; k < K; k++)
    for (int o = 16; o > 0; o >>= 1) {
      Acc b{__shfl_xor_sync(0xffffffffu, a[k].m, o), __shfl_xor_sync(0xffffffffu, a[k].z, o),
            __shfl_xor_sync(0xffffffffu, a[k].w, o)};
      a[k] = acc_combine(a[k], b);
    }
  int w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  if ((threadIdx.x & 31) == 0)
    for (int k = 0; k < K; k++) sh[k][w] = a[k];
  __syncthreads();
  if (w == 0) {
#pragma unroll
    for (int k = 0; k < K; k++) {
      a[k] = threadIdx.x < nw ? sh[k][threadIdx.x] : Acc{-INFINITY, 0.f, 0.f};
      for (int o = 16; o > 0; o >>= 1) {
        Acc b{__shfl_xor_sync(0xffffffffu, a[k].m, o), __shfl_xor_sync(0xffffffffu, a[k].z, o),
              __shfl_xor_sync(0xffffffffu, a[k].w, o)};
        a[k] = acc_combine(a[k], b);
      }
    }
    if (threadIdx.x == 0)
      for (int k = 0; k < K; k++) sh[k][0] = a[k];
  }
  __syncthreads();
  for (int k = 0; k < K; k++) a[k] = sh[k][0];
}

/* the block's sums of two floats, returned to every thread */
__device__ __forceinline__ float2 block_sum2(float2 s) {
  __shared__ float2 sh[32];
  for (int o = 16; o > 0; o >>= 1) {
    s.x += __shfl_xor_sync(0xffffffffu, s.x, o);
    s.y += __shfl_xor_sync(0xffffffffu, s.y, o);
  }
  int w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  if ((threadIdx.x & 31) == 0) sh[w] = s;
  __syncthreads();
  if (w == 0) {
    s = threadIdx.x < nw ? sh[threadIdx.x] : make_float2(0.f, 0.f);
    for (int o = 16; o > 0; o >>= 1) {
      s.x += __shfl_xor_sync(0xffffffffu, s.x, o);
      s.y += __shfl_xor_sync(0xffffffffu, s.y, o);
    }
    if (threadIdx.x == 0) sh[0] = s;
  }
  __syncthreads();
  return sh[0];
}

/* log((e^a + e^b) / 2) */
__device__ __forceinline__ float log_mix(float a, float b) {
  float hi = fmaxf(a, b), lo = fminf(a, b);
  if (hi == -INFINITY) return hi;
  return hi + log1pf(expf(lo - hi)) - 0.69314718056f;
}

/* p * (u - w), 0 where p is 0 */
__device__ __forceinline__ float xlogy(float p, float u, float w) { return p > 0.f ? p * (u - w) : 0.f; }

template <typename T, typename I>
__global__ void __launch_bounds__(1024)
    k_distill(float *loss, T *ds, const T *s, const T *t, const I *targets, const float *count, int64_t v,
              int64_t ign, float temp, float alpha, int kind, float scale, bool vec, gp_bad_ref bad, bool hint) {
  int64_t row = blockIdx.x;
  const T *x = s + row * v, *y = t + row * v;
  T *g = ds ? ds + row * v : nullptr;
  int64_t tg = (int64_t)targets[row];
  if (tg == ign) {
    if (threadIdx.x == 0) loss[row] = 0.f;
    if (g) pair_map(g, x, y, v, vec, [](int64_t, float, float) { return 0.f; });
    return;
  }
  if (tg < 0 || tg >= v) {
    float nan = __int_as_float(0x7fc00000);
    if (threadIdx.x == 0) {
      loss[row] = nan;
      gp_report_bad(bad, tg);
    }
    if (g) pair_map(g, x, y, v, vec, [nan](int64_t, float, float) { return nan; });
    return;
  }
  const float inv_t = 1.f / temp;
  const bool ce = alpha != 1.f, sep = ce && temp != 1.f; /* sep: the CE softmax differs from student/T's */
  /* 0: student/T, w = sum p (x - y); 1: teacher/T, w = sum q (y - x); 2: raw student (CE) */
  Acc a[3] = {{-INFINITY, 0.f, 0.f}, {-INFINITY, 0.f, 0.f}, {-INFINITY, 0.f, 0.f}};
  pair_read(x, y, v, vec, [&](int64_t, float sv, float tv) {
    float xs = sv * inv_t, yt = tv * inv_t;
    acc_add(a[0], xs, xs - yt);
    acc_add(a[1], yt, yt - xs);
    if (sep) acc_add(a[2], sv, 0.f);
  });
  /* the target's logit, read before the block's reduction (its barrier orders
   * the read before the backward pass's writes: dstudent may be student itself) */
  const float xt = threadIdx.x == 0 && ce ? ld(x[tg]) : 0.f;
  block_acc(a);
  const float ls = a[0].m + logf(a[0].z), lt = a[1].m + logf(a[1].z);
  const float lc = sep ? a[2].m + logf(a[2].z) : ls;
  float d, kk = 0.f;
  if (kind == 0) d = a[1].w / a[1].z - lt + ls;
  else if (kind == 1) d = a[0].w / a[0].z - ls + lt;
  else {
    float2 r = make_float2(0.f, 0.f);
    pair_read(x, y, v, vec, [&](int64_t, float sv, float tv) {
      float aa = sv * inv_t - ls, bb = tv * inv_t - lt, m = log_mix(aa, bb);
      float tp = xlogy(expf(aa), aa, m);
      r.x += 0.5f * (xlogy(expf(bb), bb, m) + tp);
      r.y += tp;
    });
    r = block_sum2(r);
    d = r.x;
    kk = r.y;
  }
  if (threadIdx.x == 0) loss[row] = alpha * temp * temp * d + (ce ? (1.f - alpha) * (lc - xt) : 0.f);
  if (!g) return;
  if (count) scale /= *count;
  const float ca = alpha * temp * scale, cc = (1.f - alpha) * scale;
  pair_map(g, x, y, v, vec, [=](int64_t j, float sv, float tv) {
    float aa = sv * inv_t - ls, p = expf(aa), gd;
    if (kind == 0) gd = p - expf(tv * inv_t - lt);
    else if (kind == 1) gd = xlogy(p, aa, tv * inv_t - lt + d);
    else gd = 0.5f * xlogy(p, aa, log_mix(aa, tv * inv_t - lt) + kk);
    float r = ca * gd;
    if (ce) r += cc * ((sep ? expf(sv - lc) : p) - (j == tg ? 1.f : 0.f));
    return r;
  }, hint);
}

extern "C" int gp_cuda_distill(gp_tensor *loss, gp_tensor *ds, const gp_tensor *s, const gp_tensor *t,
                               const gp_tensor *targets, const gp_tensor *count, double temperature, double alpha,
                               int kind, int64_t ignore, double scale) {
  int64_t n = s->shape[0], v = s->shape[1];
  if (n == 0) return GP_OK;
  const char *op = ds ? "distill_fwd_bwd" : "distill_loss";
  if (n > 2147483647) return gp_error("%s: %lld rows is more than one launch handles", op, (long long)n);
  int es = gp_elsize(s->dtype);
  uintptr_t al = (uintptr_t)gp_ptr(s) | (uintptr_t)gp_ptr(t) | (ds ? (uintptr_t)gp_ptr(ds) : 0);
  bool vec = (v * es) % 16 == 0 && al % 16 == 0;
  /* 512 threads for wide rows (38 registers: three blocks an SM, so one block's
   * reductions overlap the others' streaming; 1024 would leave one) */
  int bs = v >= 2048 ? 512 : v >= 256 ? 256 : 64;
  /* wide rows: the backward pass's reads are the last of the rows and its
   * writes are not read back here: evict-first loads and streaming stores
   * (H100, bf16 8192 x 49152: 2.21 ms against 2.31; fewer blocks an SM so
   * that the second read hits the L2 was slower: 2.54-3.30 ms) */
  const bool hint = v >= 2048;
  const float *cnt = count ? (const float *)gp_ptr(count) : nullptr;
  gp_bad_ref bad;
  GP_TRY(gp_cuda_bad_ref(&bad, op, "target", v, "the classes (a target that is not ignore_index)"));
  GP_FLOAT_SWITCH(s->dtype, T,
                  if (targets->dtype == GP_I32) {
                    GP_NOTE_LAUNCH((k_distill<T, int32_t>), bs, 0);
                    k_distill<T, int32_t><<<(unsigned)n, bs, 0, gp_cuda_stream()>>>(
                        (float *)gp_ptr(loss), ds ? (T *)gp_ptr(ds) : nullptr, (const T *)gp_ptr(s),
                        (const T *)gp_ptr(t), (const int32_t *)gp_ptr(targets), cnt, v, ignore, (float)temperature,
                        (float)alpha, kind, (float)scale, vec, bad, hint);
                  } else {
                    GP_NOTE_LAUNCH((k_distill<T, int64_t>), bs, 0);
                    k_distill<T, int64_t><<<(unsigned)n, bs, 0, gp_cuda_stream()>>>(
                        (float *)gp_ptr(loss), ds ? (T *)gp_ptr(ds) : nullptr, (const T *)gp_ptr(s),
                        (const T *)gp_ptr(t), (const int64_t *)gp_ptr(targets), cnt, v, ignore, (float)temperature,
                        (float)alpha, kind, (float)scale, vec, bad, hint);
                  });
  return gp_cuda_check_launch(op);
}
