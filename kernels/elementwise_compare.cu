/* elementwise_compare.cu: CUDA comparisons into u8, with a tensor or a
 * scalar as the second operand (elementwise.cuh: the split and its
 * conventions). */
#include "elementwise.cuh"

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
extern "C" int gp_cuda_compare(int op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double s) {
  int rc = GP_OK;
  if (b) {
    GP_ANY_SWITCH(a->dtype, T, rc = gp_ew_launch<2, uint8_t, T, T>("compare", out, a, b, CompareF<T>{op}));
  } else {
    GP_ANY_SWITCH(a->dtype, T,
                  rc = gp_ew_launch<1, uint8_t, T, T>("compare", out, a, nullptr, CompareSF<T>{op, make_scal(s)}));
  }
  return rc;
}
