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

extern "C" int gp_cuda_unary(int op, gp_tensor *out, const gp_tensor *x) {
  int rc = GP_OK;
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

extern "C" int gp_cuda_where(gp_tensor *out, const gp_tensor *mask, const gp_tensor *a, const gp_tensor *b) {
  gp_loop L;
  const gp_tensor *ops[] = {out, mask, a, b};
  GP_TRY(gp_loop_init(&L, "where", 4, ops));
  if (L.numel == 0) return GP_OK;
  GP_ANY_SWITCH(out->dtype, T, GP_NOTE_LAUNCH(k_where<T>, 256, 0);
                k_where<T><<<gp_grid(L.numel, 256), 256, 0, gp_cuda_stream()>>>(
                    L, (T *)gp_ptr(out), (const uint8_t *)gp_ptr(mask), (const T *)gp_ptr(a), (const T *)gp_ptr(b)));
  return gp_cuda_check_launch("where");
}
