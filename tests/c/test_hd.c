/* Criterion tests of the host/device helpers (kernels/gp_hd.h): the integer
 * semantics the CPU references and the CUDA kernels share. */
#include <criterion/criterion.h>

#include "../../kernels/elementwise.h"

Test(hd, integer_semantics) {
  cr_assert_eq(gp_i64_div(7, 2), 3);
  cr_assert_eq(gp_i64_div(-7, 2), -3); /* truncated */
  cr_assert_eq(gp_i64_div(7, 0), 0);
  cr_assert_eq(gp_i64_div(INT64_MIN, -1), INT64_MIN); /* wraps, never traps */
  cr_assert_eq(gp_i64_add(INT64_MAX, 1), INT64_MIN);
  cr_assert_eq(gp_i64_mul(INT64_MAX, 2), -2);
  cr_assert_eq(gp_i64_neg(INT64_MIN), INT64_MIN);
  cr_assert_eq(gp_i64_abs(-5), 5);
  cr_assert_eq(gp_i64_pow(3, 4), 81);
  cr_assert_eq(gp_i64_pow(2, 64), 0);
  cr_assert_eq(gp_i64_pow(2, -1), 0);
  cr_assert_eq(gp_i64_pow(1, -9), 1);
  cr_assert_eq(gp_i64_pow(-1, -3), -1);
  cr_assert_eq(gp_i64_pow(-1, -4), 1);
  cr_assert_eq(gp_int_unary(U_NEG, 5), -5);
  cr_assert_eq(gp_int_unary(U_ABS, -5), 5);
  cr_assert_eq(gp_int_binary(B_DIV_R, 2, 9), 4);
  cr_assert_eq(gp_int_binary(B_SUB_R, 2, 9), 7);
  cr_assert_eq(gp_int_binary(B_POW_R, 3, 2), 8);
  cr_assert_eq(gp_int_binary(B_MAX, -3, 2), 2);
  cr_assert_eq(gp_int_binary(B_MIN, -3, 2), -3);
}
