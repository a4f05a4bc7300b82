/* distill.cu: the fused distillation loss.
 * k_distill: one block per row, streamed over the vocabulary (any row
 * length: nothing of the row is held on chip). Pass 1 reads the student and
 * teacher rows together once: online softmax (max, sum of exponentials) of
 * student/T, teacher/T and, for the cross-entropy term when T != 1, the raw
 * student, plus the weighted sums that give both KL directions (sum q (y - x)
 * and sum p (x - y), rescaled with the running max like the sums of
 * exponentials). The JSD needs the normalized probabilities, so it reads the
 * rows a second time for its sums. The backward pass reads them once more and
 * writes dstudent. k_distill_rows (forward + backward of rows from 32 KB up
 * to what fits in one block's shared memory: bf16 and f16 to about 56K
 * columns, f32 to 28K) computes the same from rows held on chip, read once
 * (see above it). All accumulation in f32; 16-byte loads when the rows allow.
 * Formulas and the CPU reference: kernels/distill.c. A target out of range
 * that is not ignore_index gives a NaN row and is reported at the next
 * synchronization (kernels/bad_index.cuh). */
#include "bad_index.cuh"
#include "onchip.cuh"

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

/* the JSD's sums at log-probabilities aa (student) and bb (teacher): r.x the
 * divergence, r.y sum p (a - m) for its gradient */
__device__ __forceinline__ void jsd_add(float2 &r, float aa, float bb) {
  const float m = log_mix(aa, bb), tp = xlogy(expf(aa), aa, m);
  r.x += 0.5f * (xlogy(expf(bb), bb, m) + tp);
  r.y += tp;
}

/* the same in log2 units, at log2-probabilities a2, b2, on the approximate ex2 and lg2 (the on-chip kernel):
 * the log2 of the mixture and the two x log(x / m) terms; 0 where a probability is 0 */
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float2 jsd_terms2(float a2, float b2) {
  const float p = ex2(a2), q = ex2(b2), m = lg2(p + q) - 1.f;
  return make_float2(p > 0.f ? p * (a2 - m) : 0.f, q > 0.f ? q * (b2 - m) : 0.f);
}

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
    pair_read(x, y, v, vec, [&](int64_t, float sv, float tv) { jsd_add(r, sv * inv_t - ls, tv * inv_t - lt); });
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

/* forward + backward of rows held on chip (kernels/onchip.cuh): the student
 * and teacher rows are read once (the kernel above reads them twice: 5
 * row-sizes moved for 3, 0.49 of the copy bandwidth at SmolLM2's
 * vocabulary); bf16 49,152 takes 192 KB of the H100's 227. The arithmetic is
 * base 2 (ex2.approx). One instance a kind (LEAN): 1 the forward KL without hard targets (alpha 1), 2 with
 * them, 3 the reverse KL, 4 the JSD. */
template <typename T, typename I, int NT, int LEAN>
__global__ void __launch_bounds__(NT, 1)
    k_distill_rows(float *loss, T *ds, const T *s, const T *t, const I *targets, const float *count, int64_t n,
                   int64_t v, int nk, int64_t ign, float temp, float alpha, float scale, gp_bad_ref bad) {
  static_assert(LEAN >= 1 && LEAN <= 4, "a kind's instance");
  constexpr int W = 16 / sizeof(T);
  constexpr float L2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  extern __shared__ uint4 sm_rows[];
  const RowSlots<T, true> sl{sm_rows, sm_rows + (size_t)nk * NT, NT, nk, v / W};
  const float inv_t = 1.f / temp, c2 = inv_t * L2E;
  const bool ce = alpha != 1.f, sep = ce && temp != 1.f;
  if (count) scale /= *count;
  const float ca = alpha * temp * scale, cc = (1.f - alpha) * scale;
  int64_t row = blockIdx.x;
  if (row < n)
    for (int k = 0; k < nk; k++) sl.load(s + row * v, t + row * v, k);
  for (; row < n; row += gridDim.x) {
    const T *x = s + row * v;
    T *g = ds + row * v;
    const int64_t next = row + gridDim.x;
    const bool more = next < n;
    const T *nx = s + next * v, *ny = t + next * v;
    const int64_t tg = (int64_t)targets[row];
    const bool skip = tg == ign, badr = !skip && (tg < 0 || tg >= v);
    /* pass 1, log2 units: 0: student/T, w = sum p (x - y); 1: teacher/T, w = sum q (y - x); 2: raw student (CE) */
    Acc a[3] = {{-INFINITY, 0.f, 0.f}, {-INFINITY, 0.f, 0.f}, {-INFINITY, 0.f, 0.f}};
    auto acc_vec = [&](int64_t j) {
      const uint4 us = sl.sx[j], ut = sl.sy[j]; /* (slot k of this thread) */
      const T *es = reinterpret_cast<const T *>(&us), *et = reinterpret_cast<const T *>(&ut);
      float xa[W], yb[W], dx[W], dy[W];
#pragma unroll
      for (int e = 0; e < W; e++) {
        xa[e] = ld(es[e]) * c2;
        yb[e] = ld(et[e]) * c2;
        dx[e] = xa[e] - yb[e];
        dy[e] = yb[e] - xa[e];
      }
      acc_add2<W, true>(a[0], xa, dx);
      acc_add2<W, true>(a[1], yb, dy);
      if (sep) {
#pragma unroll
        for (int e = 0; e < W; e++) xa[e] = ld(es[e]) * L2E;
        acc_add2<W, false>(a[2], xa, nullptr);
      }
    };
    {
      /* sums of 2^(x c2 - rs), 2^(y c2 - rt), q (y - x) (the forward KL; the reverse: p (x - y); the JSD
       * neither: its own pass follows) and (with hard targets, T != 1) 2^(x log2(e) - rc) against each
       * thread's first vector's maxes (no max a vector: the instructions bound these rows); a sum past 2^64 is
       * summed again exactly from the slots, which stay in shared memory until backward */
      float rs = -INFINITY, rt = -INFINITY, rc = -INFINITY, zs = 0.f, zt = 0.f, zc = 0.f, wt = 0.f;
      for (int k = 0; k < nk; k++) {
        cp_wait(nk - 1 - k);
        const int64_t j = (int64_t)k * NT + threadIdx.x;
        if (skip || badr || j >= sl.nvec) continue;
        const uint4 us = sl.sx[j], ut = sl.sy[j];
        const T *es = reinterpret_cast<const T *>(&us), *et = reinterpret_cast<const T *>(&ut);
        float xs[W], yt[W];
#pragma unroll
        for (int e = 0; e < W; e++) {
          xs[e] = ld(es[e]);
          yt[e] = ld(et[e]);
        }
        if constexpr (LEAN == 3) { /* w = sum p (x - y) */
          ref_add(rs, zs, xs, c2, [&](int e, float p) { wt = fmaf(p, fmaxf(xs[e] - yt[e], -3.4e38f), wt); });
          ref_add(rt, zt, yt, c2, [](int, float) {});
        } else if constexpr (LEAN == 4) { /* the JSD: its own pass below */
          ref_add(rs, zs, xs, c2, [](int, float) {});
          ref_add(rt, zt, yt, c2, [](int, float) {});
        } else {
          ref_add(rs, zs, xs, c2, [](int, float) {});
          ref_add(rt, zt, yt, c2, [&](int e, float q) {
            wt = fmaf(q, fmaxf(yt[e] - xs[e], -3.4e38f), wt); /* a zero probability adds 0, not 0 * -inf */
          });
        }
        if (LEAN != 1 && sep) ref_add(rc, zc, xs, L2E, [](int, float) {});
      }
      if (zs <= 0x1p64f && zt <= 0x1p64f && zc <= 0x1p64f && fabsf(wt) <= 3.4e38f) {
        a[0] = Acc{rs, zs, LEAN == 3 ? wt * c2 : 0.f};
        a[1] = Acc{rt, zt, LEAN == 3 ? 0.f : wt * c2};
        a[2] = Acc{rc, zc, 0.f};
      } else if (!skip && !badr) {
        for (int64_t j = threadIdx.x; j < sl.nvec; j += NT) acc_vec(j);
      }
    }
    if (skip || badr) {
      if (threadIdx.x == 0) {
        loss[row] = skip ? 0.f : __int_as_float(0x7fc00000);
        if (badr) gp_report_bad(bad, tg);
      }
      const float f = skip ? 0.f : __int_as_float(0x7fc00000);
      sl.backward(g, nx, ny, more, [f](int, float, float) { return f; });
      continue;
    }
    /* the target's logit before the reduction's barrier (dstudent may be the student) */
    const float xt = threadIdx.x == 0 && ce ? ld(x[tg]) : 0.f;
#pragma unroll
    for (int q = 0; q < 3; q++) a[q].m *= LN2; /* natural units: block_acc rescales with expf */
    block_acc(a);
    /* log-sums of student/T, teacher/T and the CE's softmax, natural and log2 */
    const float ls = a[0].m + logf(a[0].z), lt = a[1].m + logf(a[1].z), lc = sep ? a[2].m + logf(a[2].z) : ls;
    const float ls2 = ls * L2E, lt2 = lt * L2E, lc2 = lc * L2E;
    float d, kk = 0.f;
    if constexpr (LEAN <= 2) d = a[1].w / a[1].z * LN2 - lt + ls;
    else if constexpr (LEAN == 3) d = a[0].w / a[0].z * LN2 - ls + lt;
    else { /* the JSD, log2 units: d = ln 2 sum (p (a - m) + q (b - m)) / 2, kk = sum p (a - m) */
      float2 r = make_float2(0.f, 0.f);
      for (int k = 0; k < nk; k++) {
        const int64_t j = (int64_t)k * NT + threadIdx.x;
        if (j >= sl.nvec) break;
        const uint4 us = sl.sx[k * NT + threadIdx.x], ut = sl.sy[k * NT + threadIdx.x];
        const T *es = reinterpret_cast<const T *>(&us), *et = reinterpret_cast<const T *>(&ut);
#pragma unroll
        for (int e = 0; e < W; e++) {
          const float2 u = jsd_terms2(fmaf(ld(es[e]), c2, -ls2), fmaf(ld(et[e]), c2, -lt2));
          r.x += u.x + u.y;
          r.y += u.x;
        }
      }
      r = block_sum2(r);
      d = 0.5f * LN2 * r.x;
      kk = r.y;
    }
    if (threadIdx.x == 0) loss[row] = alpha * temp * temp * d + (ce ? (1.f - alpha) * (lc - xt) : 0.f);
    __syncthreads(); /* every thread has read the reductions' shared results before the next row's */
    /* the backward pass: the KL term's gradient, then the CE's where alpha < 1 */
    const int tgi = (int)tg;
    auto with_ce = [&](auto gd) {
      if (!ce) sl.backward(g, nx, ny, more, [=](int, float sv, float tv) { return ca * gd(sv, tv); });
      else
        sl.backward(g, nx, ny, more, [=](int j, float sv, float tv) {
          return ca * gd(sv, tv) + cc * (ex2(sv * L2E - lc2) - (j == tgi ? 1.f : 0.f));
        });
    };
    if constexpr (LEAN == 1) { /* ca (p - q) = +-(2^(x c2 + log2 |ca| - ls2) - 2^(y c2 + log2 |ca| - lt2)) */
      const float l2a = log2f(fabsf(ca)), cs = l2a - ls2, ct = l2a - lt2;
      const bool neg = ca < 0.f;
      sl.template backward_v<false>(
          g, nx, ny, more ? sl.nvec : 0, 0, 0, [=](int64_t, const uint4 &us, const uint4 &ut) {
            const T *es = reinterpret_cast<const T *>(&us), *et = reinterpret_cast<const T *>(&ut);
            float q[W];
#pragma unroll
            for (int e = 0; e < W; e++) q[e] = ex2(fmaf(ld(es[e]), c2, cs)) - ex2(fmaf(ld(et[e]), c2, ct));
            if (neg)
#pragma unroll
              for (int e = 0; e < W; e++) q[e] = -q[e];
            return st_vec<T>(q);
          });
    } else if constexpr (LEAN == 2) {
      /* ca (p - q) + cc (c - onehot) = +-(2^(x c2 + log2 |ca| - ls2) - 2^(y c2 + log2 |ca| - lt2)
       * + 2^(x log2(e) + log2 |cc| - lc2) - |cc| at the target); at T = 1 c is p: one exponential for both,
       * with |ca| + |cc| */
      const float aa = fabsf(ca), ac = fabsf(cc), ct = log2f(aa) - lt2;
      const float cs = log2f(sep ? aa : aa + ac) - ls2, cx = log2f(ac) - lc2;
      const bool neg = scale < 0.f;
      auto bw = [&](auto three) {
        sl.template backward_v<false>(
            g, nx, ny, more ? sl.nvec : 0, 0, 0, [=](int64_t j, const uint4 &us, const uint4 &ut) {
              const T *es = reinterpret_cast<const T *>(&us), *et = reinterpret_cast<const T *>(&ut);
              float q[W];
#pragma unroll
              for (int e = 0; e < W; e++) {
                const float xv = ld(es[e]);
                q[e] = ex2(fmaf(xv, c2, cs)) - ex2(fmaf(ld(et[e]), c2, ct));
                if (decltype(three)::value) q[e] += ex2(fmaf(xv, L2E, cx));
              }
              if ((unsigned)(tgi - (int)(j * W)) < (unsigned)W)
#pragma unroll
                for (int e = 0; e < W; e++)
                  if ((int)(j * W) + e == tgi) q[e] -= ac;
              if (neg)
#pragma unroll
                for (int e = 0; e < W; e++) q[e] = -q[e];
              return st_vec<T>(q);
            });
      };
      if (sep) bw(std::true_type{});
      else bw(std::false_type{});
    } else if constexpr (LEAN == 3)
      with_ce([=](float sv, float tv) {
        const float aa = fmaf(sv, inv_t, -ls);
        return xlogy(ex2(aa * L2E), aa, tv * inv_t - lt + d);
      });
    else /* the JSD (4): ln 2 / 2 p (a - m - kk), log2 units */
      with_ce([=](float sv, float tv) {
        const float a2 = fmaf(sv, c2, -ls2), b2 = fmaf(tv, c2, -lt2), p = ex2(a2);
        return p > 0.f ? 0.5f * LN2 * p * (a2 - (lg2(p + ex2(b2)) - 1.f) - kk) : 0.f;
      });
  }
}

/* forward + backward with the rows held on chip, when they fit in one block's
 * shared memory and load in 16-byte slots; false: the streaming kernel */
template <typename T, typename I, int NT, int LEAN>
static bool distill_rows(int *rc, gp_tensor *loss, gp_tensor *ds, const gp_tensor *s, const gp_tensor *t,
                         const gp_tensor *targets, const float *cnt, int64_t n, int64_t v, int64_t ign, float temp,
                         float alpha, float scale, const gp_bad_ref &bad) {
  const int64_t nvec = v * (int64_t)sizeof(T) / 16, nk = (nvec + NT - 1) / NT;
  const size_t smem = 2 * (size_t)nk * NT * 16;
  static OnchipCache cache;
  auto fn = k_distill_rows<T, I, NT, LEAN>;
  const int64_t slots = nk > 32 ? 0 : onchip_slots(fn, NT, smem, 1, cache);
  if (slots == 0) return false;
  const unsigned grid = (unsigned)(n < slots ? n : slots);
  GP_NOTE_LAUNCH(fn, NT, smem);
  fn<<<grid, NT, smem, gp_cuda_stream()>>>((float *)gp_ptr(loss), (T *)gp_ptr(ds), (const T *)gp_ptr(s),
                                           (const T *)gp_ptr(t), (const I *)gp_ptr(targets), cnt, n, v, (int)nk, ign,
                                           temp, alpha, scale, bad);
  *rc = gp_cuda_check_launch("distill_fwd_bwd");
  return true;
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
  static const bool stream_only = getenv("GPUSH_DISTILL_STREAM") != 0; /* for comparisons */
  /* rows of 32 KB and more (narrower ones are re-read from the L2 anyway) */
  if (ds && vec && !stream_only && v * es >= 32768) {
    int rc = GP_OK;
    bool done = false;
#define GP_DR2(NT, LEAN)                                                                                              \
  (targets->dtype == GP_I32 ? distill_rows<T, int32_t, NT, LEAN>(&rc, loss, ds, s, t, targets, cnt, n, v, ignore,     \
                                                                 (float)temperature, (float)alpha, (float)scale, bad) \
                            : distill_rows<T, int64_t, NT, LEAN>(&rc, loss, ds, s, t, targets, cnt, n, v, ignore,     \
                                                                 (float)temperature, (float)alpha, (float)scale, bad))
    /* an instance a kind (and for the forward KL, with hard targets or without) */
#define GP_DR(NT) (kind == 2 ? GP_DR2(NT, 4) : kind == 1 ? GP_DR2(NT, 3) : alpha == 1.0 ? GP_DR2(NT, 1) : GP_DR2(NT, 2))
    /* 1024 threads where the row's slots fit (H100, bf16 8192 x 49152: 1.04-1.12 ms
     * against 1.08-1.13 at 512), else 512 (less rounding of the row to the block). A row pair split over a
     * cluster of 2 blocks of 512 (two an SM, sums exchanged through distributed shared memory) or 4 of 256
     * was slower (H200, same shape, alpha 1: 0.94 and 1.07 ms against 0.83) */
    GP_FLOAT_SWITCH(s->dtype, T, done = GP_DR(1024) || GP_DR(512););
#undef GP_DR
#undef GP_DR2
    if (done) return rc;
  }
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
