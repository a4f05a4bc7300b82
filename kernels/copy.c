/* copy.c: strided copy with broadcast and cast, and fill. */
#include "gp_hd.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_copy(gp_tensor *out, const gp_tensor *src);
int gp_cuda_fill(gp_tensor *out, double value);
int gp_cuda_arange(gp_tensor *out, double start, double step);
#ifdef __cplusplus
}
#endif

int gp_k_copy(gp_tensor *out, const gp_tensor *src) {
  GP_CHECK(copy, out, src);
  GP_CUDA_DISPATCH(out, gp_cuda_copy(out, src));
  gp_loop L;
  const gp_tensor *ops[] = {out, src};
  GP_TRY(gp_loop_init(&L, "copy", 2, ops));
  char *po = gp_ptr(out);
  const char *ps = gp_ptr(src);
  int dto = out->dtype, dts = src->dtype;
  int64_t off[2];
  if (dto == dts) {
    size_t es = (size_t)gp_elsize(dto);
    if (gp_loop_is_flat(&L) && L.stride[0][0] == 1 && L.stride[1][0] == 1) {
      memmove(po, ps, (size_t)L.numel * es);
      return GP_OK;
    }
    for (int64_t i = 0; i < L.numel; i++) {
      if (!(i & 0xffff)) GP_POLL_INTERRUPT("copy");
      gp_loop_offsets(&L, i, off);
      memcpy(po + off[0] * (int64_t)es, ps + off[1] * (int64_t)es, es);
    }
  } else if (gp_is_int(dto) && gp_is_int(dts)) { /* wraps, as C casts do */
    for (int64_t i = 0; i < L.numel; i++) {
      if (!(i & 0xffff)) GP_POLL_INTERRUPT("copy");
      gp_loop_offsets(&L, i, off);
      gp_store_i64(po, dto, off[0], gp_load_i64(ps, dts, off[1]));
    }
  } else {
    for (int64_t i = 0; i < L.numel; i++) {
      if (!(i & 0xffff)) GP_POLL_INTERRUPT("copy");
      gp_loop_offsets(&L, i, off);
      gp_store(po, dto, off[0], gp_load(ps, dts, off[1]));
    }
  }
  return GP_OK;
}

int gp_k_fill(gp_tensor *out, double value) {
  GP_CHECK(fill, out);
  GP_CUDA_DISPATCH(out, gp_cuda_fill(out, value));
  gp_loop L;
  const gp_tensor *ops[] = {out};
  GP_TRY(gp_loop_init(&L, "fill", 1, ops));
  char *po = gp_ptr(out);
  int64_t off[1];
  for (int64_t i = 0; i < L.numel; i++) {
    if (!(i & 0xffff)) GP_POLL_INTERRUPT("fill");
    gp_loop_offsets(&L, i, off);
    gp_store(po, out->dtype, off[0], value);
  }
  return GP_OK;
}

int gp_k_arange(gp_tensor *out, double start, double step) {
  GP_CHECK(arange, out);
  GP_CUDA_DISPATCH(out, gp_cuda_arange(out, start, step));
  char *po = gp_ptr(out);
  int64_t n = out->shape[0];
  for (int64_t i = 0; i < n; i++) {
    if (!(i & 0xffff)) GP_POLL_INTERRUPT("arange");
    gp_store(po, out->dtype, i, start + (double)i * step);
  }
  return GP_OK;
}
