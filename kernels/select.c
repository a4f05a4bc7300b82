/* select.c: dispatch and CPU reference of topk and sort. The order is total:
 * values compare with NaN above every number (two NaNs are equal) and ties go
 * to the lower index, so any correct algorithm gives the same answer. */
#include <math.h>
#include <stdlib.h>

#include "gp_hd.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_topk(gp_tensor *values, gp_tensor *indices, const gp_tensor *x, int64_t rows, int64_t n, int64_t k);
int gp_cuda_sort(gp_tensor *values, gp_tensor *indices, const gp_tensor *x, int64_t rows, int64_t n, int desc);
#ifdef __cplusplus
}
#endif

typedef struct {
  const void *p;
  int dt, desc;
} row_ctx;

/* a > b with NaN greatest */
static int gt(const row_ctx *c, int64_t i, int64_t j) {
  if (gp_is_int(c->dt)) return gp_load_i64(c->p, c->dt, i) > gp_load_i64(c->p, c->dt, j);
  double a = gp_load(c->p, c->dt, i), b = gp_load(c->p, c->dt, j);
  if (a != a) return b == b;
  if (b != b) return 0;
  return a > b;
}

/* element i comes before element j in the output order */
static int before(const row_ctx *c, int64_t i, int64_t j) {
  int a = c->desc ? gt(c, i, j) : gt(c, j, i), b = c->desc ? gt(c, j, i) : gt(c, i, j);
  return a || (!b && i < j);
}

static void msort(const row_ctx *c, int64_t *a, int64_t *tmp, int64_t n) {
  if (n < 2) return;
  int64_t h = n / 2;
  msort(c, a, tmp, h);
  msort(c, a + h, tmp, n - h);
  int64_t i = 0, j = h, k = 0;
  while (i < h && j < n) tmp[k++] = before(c, a[j], a[i]) ? a[j++] : a[i++];
  while (i < h) tmp[k++] = a[i++];
  while (j < n) tmp[k++] = a[j++];
  memcpy(a, tmp, (size_t)n * sizeof *a);
}

/* sort every row of x (rows x n) and write the first m of each */
static int sort_rows(const char *op, gp_tensor *values, gp_tensor *indices, const gp_tensor *x, int64_t rows, int64_t n,
                     int64_t m, int desc) {
  int64_t *ord = malloc((size_t)(2 * n + 1) * sizeof(int64_t));
  if (!ord) return gp_error_oom("%s: out of host memory for a row of %lld", op, (long long)n);
  size_t es = (size_t)gp_elsize(x->dtype);
  const char *px = gp_ptr(x);
  char *pv = gp_ptr(values);
  int64_t *pi = gp_ptr(indices);
  for (int64_t r = 0; r < rows; r++) {
    row_ctx c = {px + (size_t)(r * n) * es, x->dtype, desc};
    for (int64_t i = 0; i < n; i++) ord[i] = i;
    msort(&c, ord, ord + n, n);
    for (int64_t i = 0; i < m; i++) {
      memcpy(pv + (size_t)(r * m + i) * es, (const char *)c.p + (size_t)ord[i] * es, es);
      pi[r * m + i] = ord[i];
    }
  }
  free(ord);
  return GP_OK;
}

int gp_k_topk(gp_tensor *values, gp_tensor *indices, const gp_tensor *x) {
  GP_CHECK(topk, values, indices, x);
  int nd = x->ndim;
  int64_t n = x->shape[nd - 1], k = values->shape[nd - 1], rows = n ? gp_numel(x) / n : 0;
  if (k > n)
    return gp_error("topk: k = %lld is larger than the row (x is %s, %lld elements per row)", (long long)k, GP_SHAPE(x),
                    (long long)n);
  if (k > 64) return gp_error("topk: k = %lld but at most 64 is supported (use sort for more)", (long long)k);
  if (n == 0) rows = gp_numel(values) / (k ? k : 1);
  GP_CUDA_DISPATCH(x, gp_cuda_topk(values, indices, x, rows, n, k));
  return sort_rows("topk", values, indices, x, rows, n, k, 1);
}

int gp_k_sort(gp_tensor *values, gp_tensor *indices, const gp_tensor *x, double descending) {
  GP_CHECK(sort, values, indices, x);
  int nd = x->ndim;
  int64_t n = x->shape[nd - 1], rows = n ? gp_numel(x) / n : 0;
  if (n > 2147483647) return gp_error("sort: rows of %lld elements are too long", (long long)n);
  GP_CUDA_DISPATCH(x, gp_cuda_sort(values, indices, x, rows, n, descending != 0));
  return sort_rows("sort", values, indices, x, rows, n, n, descending != 0);
}
