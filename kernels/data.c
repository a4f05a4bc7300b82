/* data.c: dispatch and CPU reference of windows (training batches from a
 * token stream). The CPU checks every start; the GPU wraps it into [0, N) so
 * that no flag has to be read back (a training step never waits for it). */
#include <string.h>

#include "gp_hd.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_windows(gp_tensor *out, const gp_tensor *src, const gp_tensor *start);
int gp_cuda_write_at(gp_tensor *out, const gp_tensor *src, const gp_tensor *pos);
#ifdef __cplusplus
}
#endif

int gp_k_windows(gp_tensor *out, const gp_tensor *src, const gp_tensor *start) {
  GP_CHECK(windows, out, src, start);
  int64_t B = out->shape[0], S = out->shape[1], N = src->shape[0];
  if (N == 0 && B * S > 0) return gp_error("windows: src is empty but out is %s", GP_SHAPE(out));
  GP_CUDA_DISPATCH(out, gp_cuda_windows(out, src, start));
  const void *ps = gp_ptr(start);
  for (int64_t b = 0; b < B; b++) {
    int64_t s0 = gp_load_i64(ps, start->dtype, b);
    if (s0 < 0 || s0 >= N)
      return gp_error("windows: start[%lld] = %lld is outside [0, %lld) (src %s)", (long long)b, (long long)s0,
                      (long long)N, GP_SHAPE(src));
  }
  size_t es = (size_t)gp_elsize(out->dtype);
  const char *px = gp_ptr(src);
  char *po = gp_ptr(out);
  for (int64_t b = 0; b < B; b++) {
    int64_t s0 = gp_load_i64(ps, start->dtype, b);
    for (int64_t s = 0; s < S; s++) memcpy(po + (b * S + s) * (int64_t)es, px + ((s0 + s) % N) * (int64_t)es, es);
  }
  return GP_OK;
}

/* write_at: the position is read where it lives (device memory on the GPU),
 * so a CUDA graph can append to a KV cache at a position it advances itself. */
int gp_k_write_at(gp_tensor *out, const gp_tensor *src, const gp_tensor *pos) {
  GP_CHECK(write_at, out, src, pos);
  int64_t B = src->shape[0], H = src->shape[1], K = src->shape[2], D = src->shape[3], C = out->shape[2];
  GP_CUDA_DISPATCH(out, gp_cuda_write_at(out, src, pos));
  int64_t p = gp_load_i64(gp_ptr(pos), pos->dtype, 0);
  if (p < 0 || p + K > C)
    return gp_error("write_at: position %lld + %lld new entries is outside out's dim 3 of size %lld (out %s, src %s)",
                    (long long)p, (long long)K, (long long)C, GP_SHAPE(out), GP_SHAPE(src));
  size_t es = (size_t)gp_elsize(out->dtype);
  const char *ps = gp_ptr(src);
  char *po = gp_ptr(out);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t k = 0; k < K; k++)
        for (int64_t d = 0; d < D; d++) {
          int64_t si = b * src->stride[0] + h * src->stride[1] + k * src->stride[2] + d * src->stride[3];
          int64_t oi = ((b * H + h) * C + p + k) * D + d;
          memcpy(po + oi * (int64_t)es, ps + si * (int64_t)es, es);
        }
  return GP_OK;
}
