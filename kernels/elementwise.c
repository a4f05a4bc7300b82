/* elementwise.c: dispatch and CPU reference of the elementwise kernels.
 * Floats are computed in double, integers in int64 (wrapping, x / 0 = 0). */
#include <math.h>

#include "elementwise.h"

static double un_d(int op, double v) {
  switch (op) {
    case U_NEG: return -v;
    case U_ABS: return fabs(v);
    case U_EXP: return exp(v);
    case U_LOG: return log(v);
    case U_SQRT: return sqrt(v);
    case U_RSQRT: return 1.0 / sqrt(v);
    case U_TANH: return tanh(v);
    case U_SIGMOID: return 1.0 / (1.0 + exp(-v));
    case U_RELU: return v > 0 ? v : (v == v ? 0.0 : v);
    case U_SILU: return v / (1.0 + exp(-v));
    case U_GELU: return 0.5 * v * (1.0 + erf(v * 0.70710678118654752440));
    case U_GELU_TANH: return 0.5 * v * (1.0 + tanh(0.79788456080286535588 * (v + 0.044715 * v * v * v)));
    case U_SIN: return sin(v);
    default: return cos(v);
  }
}

static double bin_d(int op, double a, double b) {
  switch (op) {
    case B_ADD: return a + b;
    case B_SUB: return a - b;
    case B_MUL: return a * b;
    case B_DIV: return a / b;
    case B_POW: return pow(a, b);
    case B_MAX: return a != a || b != b ? NAN : a > b ? a : b;
    case B_MIN: return a != a || b != b ? NAN : a < b ? a : b;
    case B_SUB_R: return b - a;
    case B_DIV_R: return b / a;
    default: return pow(b, a);
  }
}

static int cmp_d(int op, double a, double b) {
  switch (op) {
    case C_EQ: return a == b;
    case C_NE: return a != b;
    case C_LT: return a < b;
    case C_LE: return a <= b;
    case C_GT: return a > b;
    default: return a >= b;
  }
}

/* every element of the loop L, with Ctrl-C checked every 2^16 of them (the
 * calling function's `name` is the op in the error) */
#define FOR_LOOP(L, off, ...)                                                   \
  do {                                                                          \
    int64_t off[4];                                                             \
    for (int64_t i_ = 0; i_ < (L).numel; i_++) {                                \
      if (!(i_ & 0xffff) && gp_interrupt_flag) return gp_interrupted(name);     \
      gp_loop_offsets(&(L), i_, off);                                           \
      __VA_ARGS__;                                                              \
    }                                                                           \
  } while (0)
/* for (i = 0; i < n; i++) body, the same way */
#define FOR_FLAT(i, n, ...)                                                     \
  for (int64_t i = 0; i < (n); i++) {                                           \
    if (!(i & 0xffff) && gp_interrupt_flag) return gp_interrupted(name);        \
    __VA_ARGS__;                                                                \
  }

/* ---- unary ---- */

static int unary(const char *name, int op, gp_tensor *out, const gp_tensor *x) {
  GP_CUDA_DISPATCH(out, gp_cuda_unary(op, out, x));
  gp_loop L;
  const gp_tensor *ops[] = {out, x};
  GP_TRY(gp_loop_init(&L, name, 2, ops));
  char *po = gp_ptr(out);
  const char *px = gp_ptr(x);
  int dt = out->dtype;
  if (dt == GP_F32 && gp_loop_is_flat(&L)) { /* the common case, without per-element dispatch */
    float *o = (float *)po;
    const float *a = (const float *)px;
    FOR_FLAT(i, L.numel, o[i] = (float)un_d(op, a[i]))
    return GP_OK;
  }
  if (gp_is_int(dt)) {
    FOR_LOOP(L, off, {
      int64_t v = gp_load_i64(px, dt, off[1]);
      gp_store_i64(po, dt, off[0], gp_int_unary(op, v));
    });
  } else {
    FOR_LOOP(L, off, gp_store(po, dt, off[0], un_d(op, gp_load(px, dt, off[1]))));
  }
  return GP_OK;
}

#define UNARY(name, OP)                                        \
  int gp_k_##name(gp_tensor *out, const gp_tensor *x) {        \
    GP_CHECK(name, out, x);                                    \
    return unary(#name, OP, out, x);                           \
  }
UNARY(neg, U_NEG)
UNARY(abs, U_ABS)
UNARY(exp, U_EXP)
UNARY(log, U_LOG)
UNARY(sqrt, U_SQRT)
UNARY(rsqrt, U_RSQRT)
UNARY(tanh, U_TANH)
UNARY(sigmoid, U_SIGMOID)
UNARY(relu, U_RELU)
UNARY(silu, U_SILU)
UNARY(gelu, U_GELU)
UNARY(gelu_tanh, U_GELU_TANH)
UNARY(sin, U_SIN)
UNARY(cos, U_COS)

/* ---- binary and scalar (b == NULL: the scalar s) ---- */

static int binary(const char *name, int op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double s) {
  GP_CUDA_DISPATCH(out, gp_cuda_binary(op, out, a, b, s));
  gp_loop L;
  const gp_tensor *ops[] = {out, a, b};
  GP_TRY(gp_loop_init(&L, name, b ? 3 : 2, ops));
  char *po = gp_ptr(out);
  const char *pa = gp_ptr(a), *pb = b ? gp_ptr(b) : NULL;
  int dt = out->dtype;
  int64_t si = gp_d2i(s, INT64_MIN, INT64_MAX);
  if (dt == GP_F32 && gp_loop_is_flat(&L)) {
    float *o = (float *)po;
    const float *a = (const float *)pa, *b = (const float *)pb;
    if (b)
      FOR_FLAT(i, L.numel, o[i] = (float)bin_d(op, a[i], b[i]))
    else
      FOR_FLAT(i, L.numel, o[i] = (float)bin_d(op, a[i], s))
    return GP_OK;
  }
  if (gp_is_int(dt)) {
    FOR_LOOP(L, off, gp_store_i64(po, dt, off[0], gp_int_binary(op, gp_load_i64(pa, dt, off[1]), pb ? gp_load_i64(pb, dt, off[2]) : si)));
  } else {
    FOR_LOOP(L, off, gp_store(po, dt, off[0], bin_d(op, gp_load(pa, dt, off[1]), pb ? gp_load(pb, dt, off[2]) : s)));
  }
  return GP_OK;
}

#define BINARY(name, OP)                                                        \
  int gp_k_##name(gp_tensor *out, const gp_tensor *a, const gp_tensor *b) {     \
    GP_CHECK(name, out, a, b);                                                  \
    return binary(#name, OP, out, a, b, 0);                                     \
  }
BINARY(add, B_ADD)
BINARY(sub, B_SUB)
BINARY(mul, B_MUL)
BINARY(div, B_DIV)
BINARY(pow, B_POW)
BINARY(maximum, B_MAX)
BINARY(minimum, B_MIN)

#define SCALAR(name, OP)                                                  \
  int gp_k_##name(gp_tensor *out, const gp_tensor *a, double s) {         \
    GP_CHECK(name, out, a);                                               \
    return binary(#name, OP, out, a, NULL, s);                            \
  }
SCALAR(add_s, B_ADD)
SCALAR(sub_s, B_SUB)
SCALAR(rsub_s, B_SUB_R)
SCALAR(mul_s, B_MUL)
SCALAR(div_s, B_DIV)
SCALAR(rdiv_s, B_DIV_R)
SCALAR(pow_s, B_POW)
SCALAR(rpow_s, B_POW_R)
SCALAR(maximum_s, B_MAX)
SCALAR(minimum_s, B_MIN)

/* ---- comparisons ---- */

static int compare(const char *name, int op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double s) {
  GP_CUDA_DISPATCH(out, gp_cuda_compare(op, out, a, b, s));
  gp_loop L;
  const gp_tensor *ops[] = {out, a, b};
  GP_TRY(gp_loop_init(&L, name, b ? 3 : 2, ops));
  uint8_t *po = gp_ptr(out);
  const char *pa = gp_ptr(a), *pb = b ? gp_ptr(b) : NULL;
  int dt = a->dtype;
  if (gp_is_int(dt) && b) {
    FOR_LOOP(L, off, {
      int64_t x = gp_load_i64(pa, dt, off[1]), y = gp_load_i64(pb, dt, off[2]);
      po[off[0]] = (uint8_t)cmp_d(op, x < y ? -1.0 : x > y ? 1.0 : 0.0, 0.0);
    });
  } else {
    FOR_LOOP(L, off, po[off[0]] = (uint8_t)cmp_d(op, gp_load(pa, dt, off[1]), pb ? gp_load(pb, dt, off[2]) : s));
  }
  return GP_OK;
}

#define COMPARE(name, OP)                                                       \
  int gp_k_##name(gp_tensor *out, const gp_tensor *a, const gp_tensor *b) {     \
    GP_CHECK(name, out, a, b);                                                  \
    return compare(#name, OP, out, a, b, 0);                                    \
  }
COMPARE(eq, C_EQ)
COMPARE(ne, C_NE)
COMPARE(lt, C_LT)
COMPARE(le, C_LE)
COMPARE(gt, C_GT)
COMPARE(ge, C_GE)

#define COMPARE_S(name, OP)                                             \
  int gp_k_##name(gp_tensor *out, const gp_tensor *a, double s) {       \
    GP_CHECK(name, out, a);                                             \
    return compare(#name, OP, out, a, NULL, s);                         \
  }
COMPARE_S(eq_s, C_EQ)
COMPARE_S(ne_s, C_NE)
COMPARE_S(lt_s, C_LT)
COMPARE_S(le_s, C_LE)
COMPARE_S(gt_s, C_GT)
COMPARE_S(ge_s, C_GE)

/* ---- activation backward ---- */

static double act_bwd_d(int op, double x, double dy) {
  if (op == G_SILU) {
    double s = 1.0 / (1.0 + exp(-x));
    return dy * s * (1.0 + x * (1.0 - s));
  }
  if (op == G_GELU) return dy * (0.5 * (1.0 + erf(x * 0.70710678118654752440)) + x * exp(-0.5 * x * x) * 0.39894228040143267794);
  double k = 0.79788456080286535588, t = tanh(k * (x + 0.044715 * x * x * x));
  return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x));
}

static int act_bwd(const char *name, int op, gp_tensor *dx, const gp_tensor *x, const gp_tensor *dy) {
  GP_CUDA_DISPATCH(dx, gp_cuda_act_bwd(op, dx, x, dy));
  gp_loop L;
  const gp_tensor *ops[] = {dx, x, dy};
  GP_TRY(gp_loop_init(&L, name, 3, ops));
  char *po = gp_ptr(dx);
  const char *px = gp_ptr(x), *pg = gp_ptr(dy);
  int dt = dx->dtype;
  FOR_LOOP(L, off, gp_store(po, dt, off[0], act_bwd_d(op, gp_load(px, dt, off[1]), gp_load(pg, dt, off[2]))));
  return GP_OK;
}

#define ACT_BWD(name, OP)                                                         \
  int gp_k_##name(gp_tensor *dx, const gp_tensor *x, const gp_tensor *dy) {       \
    GP_CHECK(name, dx, x, dy);                                                    \
    return act_bwd(#name, OP, dx, x, dy);                                         \
  }
ACT_BWD(silu_bwd, G_SILU)
ACT_BWD(gelu_bwd, G_GELU)
ACT_BWD(gelu_tanh_bwd, G_GELU_TANH)

/* ---- where, clamp ---- */

int gp_k_where(gp_tensor *out, const gp_tensor *mask, const gp_tensor *a, const gp_tensor *b) {
  GP_CHECK(where, out, mask, a, b);
  GP_CUDA_DISPATCH(out, gp_cuda_where(out, mask, a, b));
  const char *name = "where";
  gp_loop L;
  const gp_tensor *ops[] = {out, mask, a, b};
  GP_TRY(gp_loop_init(&L, "where", 4, ops));
  char *po = gp_ptr(out);
  const uint8_t *pm = gp_ptr(mask);
  const char *pa = gp_ptr(a), *pb = gp_ptr(b);
  size_t es = (size_t)gp_elsize(out->dtype);
  FOR_LOOP(L, off, memcpy(po + off[0] * (int64_t)es, pm[off[1]] ? pa + off[2] * (int64_t)es : pb + off[3] * (int64_t)es, es));
  return GP_OK;
}

int gp_k_clamp(gp_tensor *out, const gp_tensor *x, double lo, double hi) {
  GP_CHECK(clamp, out, x);
  GP_CUDA_DISPATCH(out, gp_cuda_clamp(out, x, lo, hi));
  const char *name = "clamp";
  gp_loop L;
  const gp_tensor *ops[] = {out, x};
  GP_TRY(gp_loop_init(&L, "clamp", 2, ops));
  char *po = gp_ptr(out);
  const char *px = gp_ptr(x);
  int dt = out->dtype;
  if (gp_is_int(dt)) {
    int64_t l = gp_d2i(ceil(lo), INT64_MIN, INT64_MAX), h = gp_d2i(floor(hi), INT64_MIN, INT64_MAX);
    FOR_LOOP(L, off, {
      int64_t v = gp_load_i64(px, dt, off[1]);
      gp_store_i64(po, dt, off[0], v < l ? l : v > h ? h : v);
    });
  } else {
    FOR_LOOP(L, off, {
      double v = gp_load(px, dt, off[1]);
      gp_store(po, dt, off[0], v < lo ? lo : v > hi ? hi : v);
    });
  }
  return GP_OK;
}
