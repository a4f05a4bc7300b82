/* elementwise.h: op codes shared by elementwise.c (CPU) and elementwise.cu. */
#ifndef GP_ELEMENTWISE_H
#define GP_ELEMENTWISE_H
#include "gp_hd.h"

enum { U_NEG, U_ABS, U_EXP, U_LOG, U_SQRT, U_RSQRT, U_TANH, U_SIGMOID, U_RELU, U_SILU, U_GELU, U_GELU_TANH, U_SIN, U_COS };
/* binary ops; the *_R forms swap the operands (s - a, s / a, s ^ a) */
enum { B_ADD, B_SUB, B_MUL, B_DIV, B_POW, B_MAX, B_MIN, B_SUB_R, B_DIV_R, B_POW_R };
enum { C_EQ, C_NE, C_LT, C_LE, C_GT, C_GE };
/* activation backward: dx = dy * f'(x) */
enum { G_SILU, G_GELU, G_GELU_TANH };

/* integer dtypes: the unary (U_NEG, U_ABS) and binary ops in int64, on the
 * CPU and the GPU alike */
GP_HD int64_t gp_int_unary(int op, int64_t v) { return op == U_NEG ? gp_i64_neg(v) : gp_i64_abs(v); }
GP_HD int64_t gp_int_binary(int op, int64_t a, int64_t b) {
  switch (op) {
    case B_ADD: return gp_i64_add(a, b);
    case B_SUB: return gp_i64_sub(a, b);
    case B_MUL: return gp_i64_mul(a, b);
    case B_DIV: return gp_i64_div(a, b);
    case B_POW: return gp_i64_pow(a, b);
    case B_MAX: return a > b ? a : b;
    case B_MIN: return a < b ? a : b;
    case B_SUB_R: return gp_i64_sub(b, a);
    case B_DIV_R: return gp_i64_div(b, a);
    default: return gp_i64_pow(b, a);
  }
}

#ifdef __cplusplus
extern "C" {
#endif
/* CUDA launchers (elementwise.cu); arguments already checked */
int gp_cuda_unary(int op, gp_tensor *out, const gp_tensor *x);
int gp_cuda_binary(int op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double s);
int gp_cuda_compare(int op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double s);
int gp_cuda_where(gp_tensor *out, const gp_tensor *mask, const gp_tensor *a, const gp_tensor *b);
int gp_cuda_clamp(gp_tensor *out, const gp_tensor *x, double lo, double hi);
int gp_cuda_act_bwd(int op, gp_tensor *dx, const gp_tensor *x, const gp_tensor *dy);
#ifdef __cplusplus
}
#endif
#endif
