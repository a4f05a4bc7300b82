/* Criterion tests of the attention support query (kernels/attention.c): the
 * head dims each kernel takes, as the Lua side asks them. */
#include <criterion/criterion.h>
#include <string.h>

#include "../../src/internal.h"

Test(attention, supported) {
  for (int dt = 0; dt < GP_NDTYPES; dt++) {
    const int f = gp_is_float(dt);
    for (int D = 0; D <= 256; D++) {
      const int fb = f && (D == 32 || D == 64 || D == 128), dec = f && (D == 64 || D == 128);
      cr_assert_eq(gp_attention_supported("fwd", dt, D, 4096), fb, "fwd %s %d", gp_dtype_name(dt), D);
      cr_assert_eq(gp_attention_supported("bwd", dt, D, 1), fb, "bwd %s %d", gp_dtype_name(dt), D);
      cr_assert_eq(gp_attention_supported("decode", dt, D, 1 << 20), dec, "decode %s %d", gp_dtype_name(dt), D);
      /* nn.attention's rule: 64 and 128 at any length, 32 up to 512 keys */
      cr_assert_eq(gp_attention_supported("flash", dt, D, 512), fb, "flash %s %d", gp_dtype_name(dt), D);
      cr_assert_eq(gp_attention_supported("flash", dt, D, 513), dec, "flash %s %d 513", gp_dtype_name(dt), D);
    }
  }
  cr_assert_eq(gp_attention_supported("nope", GP_F32, 64, 1), 0);
  cr_assert_eq(gp_attention_supported(NULL, GP_F32, 64, 1), 0);
  cr_assert_eq(gp_attention_supported("fwd", -1, 64, 1), 0);
}

Test(attention, head_dim_lists) {
  char b[64];
  cr_assert_str_eq(gp_attention_head_dims(b, sizeof b, "fwd"), "32, 64, 128");
  cr_assert_str_eq(gp_attention_head_dims(b, sizeof b, "bwd"), "32, 64, 128");
  cr_assert_str_eq(gp_attention_head_dims(b, sizeof b, "decode"), "64, 128");
  cr_assert_str_eq(gp_attention_head_dims(b, sizeof b, "flash"), "32 (up to 512 keys), 64, 128");
  cr_assert_str_eq(gp_attention_head_dims(b, sizeof b, "nope"), "");
  char s[5];
  cr_assert_str_eq(gp_attention_head_dims(s, sizeof s, "fwd"), "32, ");
}

Test(attention, messages_name_the_dims) {
  int64_t s4[] = {1, 1, 4, 48}, s3[] = {1, 1, 48}, sl[] = {1, 1, 4}, sc[] = {1, 1, 4, 48}, sn[] = {1};
  gp_tensor *q, *o, *l, *q3, *o3, *kc, *n;
  cr_assert_eq(gp_tensor_empty(&q, GP_F32, GP_CPU, 4, s4), GP_OK);
  cr_assert_eq(gp_tensor_empty(&o, GP_F32, GP_CPU, 4, s4), GP_OK);
  cr_assert_eq(gp_tensor_empty(&l, GP_F32, GP_CPU, 3, sl), GP_OK);
  cr_assert_eq(gp_k_attn_fwd(o, l, q, q, q, 0, 0, 0, 1), GP_ERR);
  cr_assert_str_eq(gp_last_error(), "attn_fwd: head dim 48 is not supported (supported: 32, 64, 128); q is (1,1,4,48)");
  cr_assert_eq(gp_tensor_empty(&q3, GP_F32, GP_CPU, 3, s3), GP_OK);
  cr_assert_eq(gp_tensor_empty(&o3, GP_F32, GP_CPU, 3, s3), GP_OK);
  cr_assert_eq(gp_tensor_empty(&kc, GP_F32, GP_CPU, 4, sc), GP_OK);
  cr_assert_eq(gp_tensor_empty(&n, GP_I32, GP_CPU, 1, sn), GP_OK);
  cr_assert_eq(gp_k_attn_decode(o3, q3, kc, kc, n, 0, 0, 0), GP_ERR);
  cr_assert_str_eq(gp_last_error(), "attn_decode: head dim 48 is not supported (supported: 64, 128); q is (1,1,48)");
  gp_tensor *all[] = {q, o, l, q3, o3, kc, n};
  for (int i = 0; i < 7; i++) gp_tensor_free(all[i]);
}
