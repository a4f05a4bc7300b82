/* index.c: dispatch and CPU reference of embedding, gather, index_select and
 * scatter_add. Every index is checked before any output is written. */
#include <stdlib.h>

#include "gp_hd.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_embedding(gp_tensor *out, const gp_tensor *weight, const gp_tensor *idx, int64_t n, int64_t v, int64_t d);
int gp_cuda_embedding_backward(gp_tensor *dweight, const gp_tensor *dout, const gp_tensor *idx, int64_t n, int64_t v,
                               int64_t d, int accumulate);
int gp_cuda_gather(int mode, gp_tensor *out, const gp_tensor *x, const gp_tensor *idx);
int gp_cuda_scatter_add(gp_tensor *out, const gp_tensor *x, const gp_tensor *idx, const gp_tensor *src);
#ifdef __cplusplus
}
#endif

/* every index of a contiguous index tensor in [0, size) */
static int check_range(const char *op, const gp_tensor *idx, int64_t size, const char *what) {
  const void *p = gp_ptr(idx);
  int64_t n = gp_numel(idx);
  for (int64_t i = 0; i < n; i++) {
    int64_t v = gp_load_i64(p, idx->dtype, i);
    if (v < 0 || v >= size)
      return gp_error("%s: index %lld (at flat position %lld of idx %s) is out of range for %s of size %lld", op,
                      (long long)v, (long long)i, GP_SHAPE(idx), what, (long long)size);
  }
  return GP_OK;
}

int gp_k_embedding(gp_tensor *out, const gp_tensor *weight, const gp_tensor *idx) {
  GP_CHECK(embedding, out, weight, idx);
  int64_t v = weight->shape[0], d = weight->shape[1], n = gp_numel(idx);
  GP_CUDA_DISPATCH(out, gp_cuda_embedding(out, weight, idx, n, v, d));
  GP_TRY(check_range("embedding", idx, v, "weight's rows"));
  size_t row = (size_t)d * (size_t)gp_elsize(out->dtype);
  const char *pw = gp_ptr(weight);
  char *po = gp_ptr(out);
  const void *pi = gp_ptr(idx);
  for (int64_t i = 0; i < n; i++) memcpy(po + (size_t)i * row, pw + (size_t)gp_load_i64(pi, idx->dtype, i) * row, row);
  return GP_OK;
}

int gp_k_embedding_backward(gp_tensor *dweight, const gp_tensor *dout, const gp_tensor *idx, double accumulate) {
  GP_CHECK(embedding_backward, dweight, dout, idx);
  if (accumulate != 0 && accumulate != 1)
    return gp_error("embedding_backward: accumulate = %g; it must be 0 or 1", accumulate);
  int64_t v = dweight->shape[0], d = dweight->shape[1], n = gp_numel(idx);
  GP_CUDA_DISPATCH(dweight, gp_cuda_embedding_backward(dweight, dout, idx, n, v, d, (int)accumulate));
  GP_TRY(check_range("embedding_backward", idx, v, "dweight's rows"));
  int64_t vd = v * d;
  double *acc = calloc((size_t)(vd > 0 ? vd : 1), sizeof(double));
  if (!acc) return gp_error_oom("embedding_backward: out of host memory for a (%lld,%lld) accumulator", (long long)v,
                                (long long)d);
  void *pw = gp_ptr(dweight);
  if (accumulate)
    for (int64_t i = 0; i < vd; i++) acc[i] = gp_load(pw, dweight->dtype, i);
  const void *pg = gp_ptr(dout), *pi = gp_ptr(idx);
  for (int64_t i = 0; i < n; i++) {
    int64_t r = gp_load_i64(pi, idx->dtype, i);
    for (int64_t j = 0; j < d; j++) acc[r * d + j] += gp_load(pg, dout->dtype, i * d + j);
  }
  for (int64_t i = 0; i < vd; i++) gp_store(pw, dweight->dtype, i, acc[i]);
  free(acc);
  return GP_OK;
}

/* mode 0: gather (idx [A,K,C]); mode 1: index_select (idx [K]) */
static int gather_cpu(int mode, const char *op, gp_tensor *out, const gp_tensor *x, const gp_tensor *idx) {
  GP_CUDA_DISPATCH(out, gp_cuda_gather(mode, out, x, idx));
  int64_t A = out->shape[0], K = out->shape[1], Cn = out->shape[2], B = x->shape[1];
  GP_TRY(check_range(op, idx, B, "x's dim 2 (the gathered dim)"));
  size_t es = (size_t)gp_elsize(out->dtype);
  const char *px = gp_ptr(x);
  char *po = gp_ptr(out);
  const void *pi = gp_ptr(idx);
  for (int64_t a = 0; a < A; a++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t c = 0; c < Cn; c++) {
        int64_t o = (a * K + k) * Cn + c;
        int64_t b = gp_load_i64(pi, idx->dtype, mode == 0 ? o : k);
        int64_t s = x->stride[0] * a + x->stride[1] * b + x->stride[2] * c;
        memcpy(po + o * (int64_t)es, px + s * (int64_t)es, es);
      }
  return GP_OK;
}

int gp_k_gather(gp_tensor *out, const gp_tensor *x, const gp_tensor *idx) {
  GP_CHECK(gather, out, x, idx);
  return gather_cpu(0, "gather", out, x, idx);
}

int gp_k_index_select(gp_tensor *out, const gp_tensor *x, const gp_tensor *idx) {
  GP_CHECK(index_select, out, x, idx);
  return gather_cpu(1, "index_select", out, x, idx);
}

int gp_k_scatter_add(gp_tensor *out, const gp_tensor *x, const gp_tensor *idx, const gp_tensor *src) {
  GP_CHECK(scatter_add, out, x, idx, src);
  GP_CUDA_DISPATCH(out, gp_cuda_scatter_add(out, x, idx, src));
  int64_t A = out->shape[0], B = out->shape[1], Cn = out->shape[2], K = idx->shape[1];
  GP_TRY(check_range("scatter_add", idx, B, "out's dim 2 (the scattered dim)"));
  int64_t n = A * B * Cn;
  double *acc = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  if (!acc) return gp_error_oom("scatter_add: out of host memory");
  const char *px = gp_ptr(x), *ps = gp_ptr(src);
  const void *pi = gp_ptr(idx);
  for (int64_t a = 0; a < A; a++)
    for (int64_t b = 0; b < B; b++)
      for (int64_t c = 0; c < Cn; c++)
        acc[(a * B + b) * Cn + c] = gp_load(px, x->dtype, x->stride[0] * a + x->stride[1] * b + x->stride[2] * c);
  for (int64_t a = 0; a < A; a++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t c = 0; c < Cn; c++) {
        int64_t b = gp_load_i64(pi, idx->dtype, (a * K + k) * Cn + c);
        acc[(a * B + b) * Cn + c] += gp_load(ps, src->dtype, src->stride[0] * a + src->stride[1] * k + src->stride[2] * c);
      }
  char *po = gp_ptr(out);
  for (int64_t i = 0; i < n; i++) gp_store(po, out->dtype, i, acc[i]);
  free(acc);
  return GP_OK;
}
