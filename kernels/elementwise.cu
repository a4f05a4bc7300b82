/* elementwise.cu: CUDA elementwise kernels. Floats compute in f32, integers
 * in int64; the op is a run-time switch (uniform across the grid), which
 * keeps one instantiation per dtype and costs nothing measurable next to the
 * memory traffic. */
#include "elementwise.h"
#include "ew_launch.cuh"
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

__device__ __forceinline__ float bin(int op, float a, float b) {
  switch (op) {
    case B_ADD: return a + b;
    case B_SUB: return a - b;
    case B_MUL: return a * b;
    case B_DIV: return a / b;
    case B_POW: return powf(a, b);
    case B_MAX: return a != a || b != b ? __int_as_float(0x7fc00000) : fmaxf(a, b);
    case B_MIN: return a != a || b != b ? __int_as_float(0x7fc00000) : fminf(a, b);
    case B_SUB_R: return b - a;
    case B_DIV_R: return b / a;
    default: return powf(b, a);
  }
}
__device__ __forceinline__ int64_t bin(int op, int64_t a, int64_t b) { return gp_int_binary(op, a, b); }

template <typename C> __device__ __forceinline__ uint8_t cmp(int op, C a, C b) {
  switch (op) {
    case C_EQ: return a == b;
    case C_NE: return a != b;
    case C_LT: return a < b;
    case C_LE: return a <= b;
    case C_GT: return a > b;
    default: return a >= b;
  }
}

/* the scalar in the compute type of T */
struct scal {
  float f;
  int64_t i;
  double d;
  __device__ __forceinline__ float get(float) const { return f; }
  __device__ __forceinline__ int64_t get(int64_t) const { return i; }
};
static scal make_scal(double s) {
  scal r;
  r.f = (float)s;
  r.i = gp_d2i(s, INT64_MIN, INT64_MAX);
  r.d = s;
  return r;
}

template <typename T> struct UnaryF {
  int op;
  __device__ T operator()(T x) const { return st<T>(un(op, ld(x))); }
};
template <typename T> struct BinaryF {
  int op;
  __device__ T operator()(T x, T y) const { return st<T>(bin(op, ld(x), ld(y))); }
};
template <typename T> struct ScalarF {
  int op;
  scal s;
  __device__ T operator()(T x) const {
    auto v = ld(x);
    return st<T>(bin(op, v, s.get(v)));
  }
};
template <typename T> struct CompareF {
  int op;
  __device__ uint8_t operator()(T x, T y) const { return cmp(op, ld(x), ld(y)); }
};
/* an integer compared with a fractional scalar is compared in double */
template <typename T> struct CompareSF {
  int op;
  scal s;
  __device__ uint8_t operator()(T x) const {
    if constexpr (gp_is_float_t<T>::value) return cmp(op, ld(x), s.f);
    else return cmp(op, (double)ld(x), s.d);
  }
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

extern "C" int gp_cuda_binary(int op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double s) {
  int rc = GP_OK;
  if (b) {
    GP_ANY_SWITCH(out->dtype, T, rc = gp_ew_launch<2, T, T, T>("binary", out, a, b, BinaryF<T>{op}));
  } else {
    GP_ANY_SWITCH(out->dtype, T, rc = gp_ew_launch<1, T, T, T>("binary", out, a, nullptr, ScalarF<T>{op, make_scal(s)}));
  }
  return rc;
}

extern "C" int gp_cuda_compare(int op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double s) {
  int rc = GP_OK;
  if (b) {
    GP_ANY_SWITCH(a->dtype, T, rc = gp_ew_launch<2, uint8_t, T, T>("compare", out, a, b, CompareF<T>{op}));
  } else {
    GP_ANY_SWITCH(a->dtype, T, rc = gp_ew_launch<1, uint8_t, T, T>("compare", out, a, nullptr, CompareSF<T>{op, make_scal(s)}));
  }
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

template <typename T>
__global__ void k_where(gp_loop L, T *o, const uint8_t *m, const T *a, const T *b) {
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
