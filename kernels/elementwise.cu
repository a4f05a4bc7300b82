/* elementwise.cu: CUDA elementwise kernels: unary ops, activation backward,
 * clamp and where (elementwise.cuh: the split and its conventions). */
#include "elementwise.cuh"
#include "gelu.cuh"

__device__ __forceinline__ float un(int op, float v) {
  switch (op) {
    case U_NEG: return -v;
    case U_ABS: return fabsf(v);
    case U_EXP: return expf(v);
    case U_LOG: return logf(v);
    case U_SQRT: return sqrtf(v);
    case U_RSQRT: return rsqrtf(v);
    case U_TANH: return tanhf(v);
    case U_SIGMOID: return 1.0f / (1.0f + expf(-v));
    case U_RELU: return v > 0.f ? v : (v == v ? 0.f : v);
    case U_SILU: return v / (1.0f + expf(-v));
    case U_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case U_GELU_TANH: return gp_gelu_tanh(v);
    case U_SIN: return sinf(v);
    default: return cosf(v);
  }
}
__device__ __forceinline__ int64_t un(int op, int64_t v) { return gp_int_unary(op, v); }

template <typename T> struct UnaryF {
  int op;
  __device__ T operator()(T x) const { return st<T>(un(op, ld(x))); }
};
template <typename T> struct ActBwdF {
  int op;
  __device__ T operator()(T xs, T gs) const {
    float x = ld(xs), dy = ld(gs), d;
    if (op == G_SILU) {
      float s = 1.0f / (1.0f + expf(-x));
      d = s * (1.0f + x * (1.0f - s));
    } else if (op == G_GELU) {
      d = 0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * expf(-0.5f * x * x) * 0.39894228040143268f;
    } else {
      d = gp_gelu_tanh_d(x);
    }
    return st<T>(dy * d);
  }
};

extern "C" int gp_cuda_act_bwd(int op, gp_tensor *dx, const gp_tensor *x, const gp_tensor *dy) {
  int rc = GP_OK;
  GP_FLOAT_SWITCH(dx->dtype, T, rc = gp_ew_launch<2, T, T, T>("act_bwd", dx, x, dy, ActBwdF<T>{op}));
  return rc;
}

template <typename T> struct ClampF {
  scal lo, hi;
  __device__ T operator()(T x) const {
    auto v = ld(x), l = lo.get(v), h = hi.get(v);
    return st<T>(v < l ? l : v > h ? h : v);
  }
};

/* the op a compile-time constant: 16-bit floats' transcendental functions on dense tensors (with the op
 * chosen per element, the bf16 ones ran at 0.47-0.73 of the copy bandwidth, bound by instructions) */
template <typename T, int OP> struct UnaryOpF {
  __device__ T operator()(T x) const { return st<T>(un(OP, ld(x))); }
};
template <typename T, int OP> void unary_flat_op(T *o, const T *x, int64_t n) {
  constexpr int V = 16 / sizeof(T);
  GP_NOTE_LAUNCH((gp_ew_flat<1, V, false, T, T, T, UnaryOpF<T, OP>>), 256, 0);
  gp_ew_flat<1, V, false>
      <<<gp_grid((n + V - 1) / V, 256), 256, 0, gp_cuda_stream()>>>(o, x, (const T *)nullptr, n, UnaryOpF<T, OP>{});
}
template <typename T> bool unary_flat(int op, gp_tensor *out, const gp_tensor *x) {
  const int64_t n = gp_numel(out);
  T *po = (T *)gp_ptr(out);
  const T *px = (const T *)gp_ptr(x);
  if (gp_numel(x) != n || !gp_is_contiguous(out) || !gp_is_contiguous(x) || !gp_aligned(po, 16) || !gp_aligned(px, 16))
    return false;
  switch (op) {
    case U_EXP: unary_flat_op<T, U_EXP>(po, px, n); return true;
    case U_LOG: unary_flat_op<T, U_LOG>(po, px, n); return true;
    case U_TANH: unary_flat_op<T, U_TANH>(po, px, n); return true;
    case U_SIGMOID: unary_flat_op<T, U_SIGMOID>(po, px, n); return true;
    case U_SILU: unary_flat_op<T, U_SILU>(po, px, n); return true;
    case U_GELU: unary_flat_op<T, U_GELU>(po, px, n); return true;
    case U_GELU_TANH: unary_flat_op<T, U_GELU_TANH>(po, px, n); return true;
    case U_SIN: unary_flat_op<T, U_SIN>(po, px, n); return true;
    case U_COS: unary_flat_op<T, U_COS>(po, px, n); return true;
    default: return false;
  }
}

extern "C" int gp_cuda_unary(int op, gp_tensor *out, const gp_tensor *x) {
  int rc = GP_OK;
  if (gp_numel(out) > 0 && ((out->dtype == GP_BF16 && unary_flat<__nv_bfloat16>(op, out, x)) ||
                            (out->dtype == GP_F16 && unary_flat<__half>(op, out, x))))
    return gp_cuda_check_launch("unary");
  GP_ANY_SWITCH(out->dtype, T, rc = gp_ew_launch<1, T, T, T>("unary", out, x, nullptr, UnaryF<T>{op}));
  return rc;
}

extern "C" int gp_cuda_clamp(gp_tensor *out, const gp_tensor *x, double lo, double hi) {
  int rc = GP_OK;
  scal l = make_scal(lo), h = make_scal(hi);
  l.i = gp_d2i(ceil(lo), INT64_MIN, INT64_MAX);
  h.i = gp_d2i(floor(hi), INT64_MIN, INT64_MAX);
  GP_ANY_SWITCH(out->dtype, T, rc = gp_ew_launch<1, T, T, T>("clamp", out, x, nullptr, ClampF<T>{l, h}));
  return rc;
}

template <typename T> __global__ void k_where(gp_loop L, T *o, const uint8_t *m, const T *a, const T *b) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = tid; i < L.numel; i += nth) {
    int64_t off[4];
    gp_loop_offsets(&L, i, off);
    o[off[0]] = m[off[1]] ? a[off[2]] : b[off[3]];
  }
}

/* where over dense operands of one shape: V elements a thread and step (16 bytes of out, a, b; V bytes of the
 * mask), the tail one at a time; SA / SB: a / b is one value broadcast (where(mask, x, -inf)) */
template <typename T, int V, bool SA, bool SB>
__global__ void k_where_flat(T *o, const uint8_t *m, const T *a, const T *b, int64_t n) {
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  const int64_t nv = n / V;
  const T a0 = SA ? a[0] : T{}, b0 = SB ? b[0] : T{};
  for (int64_t i = tid; i < nv; i += nth) {
    const gp_vec<uint8_t, V> mv = reinterpret_cast<const gp_vec<uint8_t, V> *>(m)[i];
    gp_vec<T, V> av, bv, ov;
    if constexpr (!SA) av = reinterpret_cast<const gp_vec<T, V> *>(a)[i];
    if constexpr (!SB) bv = reinterpret_cast<const gp_vec<T, V> *>(b)[i];
#pragma unroll
    for (int j = 0; j < V; j++) ov.v[j] = mv.v[j] ? (SA ? a0 : av.v[j]) : (SB ? b0 : bv.v[j]);
    reinterpret_cast<gp_vec<T, V> *>(o)[i] = ov;
  }
  for (int64_t i = nv * V + tid; i < n; i += nth) o[i] = m[i] ? (SA ? a0 : a[i]) : (SB ? b0 : b[i]);
}
template <typename T, int V, bool SA, bool SB>
static void launch_where_flat(T *o, const uint8_t *m, const T *a, const T *b, int64_t n) {
  GP_NOTE_LAUNCH((k_where_flat<T, V, SA, SB>), 256, 0);
  k_where_flat<T, V, SA, SB><<<gp_grid((n + V - 1) / V, 256), 256, 0, gp_cuda_stream()>>>(o, m, a, b, n);
}

extern "C" int gp_cuda_where(gp_tensor *out, const gp_tensor *mask, const gp_tensor *a, const gp_tensor *b) {
  gp_loop L;
  const gp_tensor *ops[] = {out, mask, a, b};
  GP_TRY(gp_loop_init(&L, "where", 4, ops));
  if (L.numel == 0) return GP_OK;
  /* flat: out and mask dense, a and b each dense or one broadcast value (nn's causal mask: where(j > i, -inf, 0)) */
  bool flat = L.ndim == 1 && L.numel > 1;
  for (int k = 0; k < 2; k++) flat = flat && L.stride[k][0] == 1;
  const bool sa = flat && L.stride[2][0] == 0, sb = flat && L.stride[3][0] == 0;
  flat = flat && (L.stride[2][0] == 1 || sa) && (L.stride[3][0] == 1 || sb);
  GP_ANY_SWITCH(out->dtype, T, {
    constexpr int V = 16 / sizeof(T);
    T *po = (T *)gp_ptr(out);
    const T *pa = (const T *)gp_ptr(a), *pb = (const T *)gp_ptr(b);
    const uint8_t *pm = (const uint8_t *)gp_ptr(mask);
    if (flat && gp_aligned(po, 16) && (sa || gp_aligned(pa, 16)) && (sb || gp_aligned(pb, 16)) && gp_aligned(pm, V)) {
      if (sa && sb) launch_where_flat<T, V, true, true>(po, pm, pa, pb, L.numel);
      else if (sa) launch_where_flat<T, V, true, false>(po, pm, pa, pb, L.numel);
      else if (sb) launch_where_flat<T, V, false, true>(po, pm, pa, pb, L.numel);
      else launch_where_flat<T, V, false, false>(po, pm, pa, pb, L.numel);
    } else {
      GP_NOTE_LAUNCH(k_where<T>, 256, 0);
      k_where<T><<<gp_grid(L.numel, 256), 256, 0, gp_cuda_stream()>>>(L, po, pm, pa, pb);
    }
  });
  return gp_cuda_check_launch("where");
}
