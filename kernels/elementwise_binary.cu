/* elementwise_binary.cu: CUDA binary ops, with a tensor or a scalar as the
 * second operand (elementwise.cuh: the split and its conventions). */
#include "elementwise.cuh"

__device__ __forceinline__ float bin(int op, float a, float b) {
  switch (op) {
    case B_ADD: return a + b;
    case B_SUB: return a - b;
    case B_MUL: return a * b;
    case B_DIV: return a / b;
    case B_MAX: return a != a || b != b ? __int_as_float(0x7fc00000) : fmaxf(a, b);
    case B_MIN: return a != a || b != b ? __int_as_float(0x7fc00000) : fminf(a, b);
    case B_SUB_R: return b - a;
    case B_DIV_R: return b / a;
    default: { /* B_POW, B_POW_R: one inlined powf, not two (powf is long: half this file's compile time). The
                * exponents 2, 0.5, -1 are one correctly rounded operation, which the CPU's double pow rounded to
                * float equals (a double result of +, *, / or sqrt rounds to the float one; powf bound pow_s at
                * 0.58 of the copy bandwidth in f32, 0.29 in bf16): x * x; sqrt(x) but pow(-0, 0.5) = +0 and
                * pow(-inf, 0.5) = +inf; 1 / x */
      const bool r = op == B_POW_R;
      const float x = r ? b : a, y = r ? a : b;
      if (y == 2.f) return x * x;
      if (y == .5f) return x == -INFINITY ? INFINITY : __fsqrt_rn(x) + 0.f;
      if (y == -1.f) return __frcp_rn(x);
      return powf(x, y);
    }
  }
}
__device__ __forceinline__ int64_t bin(int op, int64_t a, int64_t b) { return gp_int_binary(op, a, b); }

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
extern "C" int gp_cuda_binary(int op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double s) {
  int rc = GP_OK;
  if (b) {
    GP_ANY_SWITCH(out->dtype, T, rc = gp_ew_launch<2, T, T, T>("binary", out, a, b, BinaryF<T>{op}));
  } else {
    GP_ANY_SWITCH(out->dtype, T,
                  rc = gp_ew_launch<1, T, T, T>("binary", out, a, nullptr, ScalarF<T>{op, make_scal(s)}));
  }
  return rc;
}
