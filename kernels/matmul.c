/* matmul.c: matrix products: argument checks, dispatch, options, and the CPU
 * reference, a blocked i-k-j loop that accumulates in double. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gp_hd.h"
#include "matmul.h"

#ifdef __cplusplus
extern "C" {
#endif
int gp_cuda_matmul(const char *op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, const gp_tensor *bias,
                   double alpha, double beta, int act, gp_tensor *aux);
int gp_cuda_bench_cublas_gemm(double *ms, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, int iters);
void gp_cuda_matmul_tune_stats(gp_matmul_tunestats *out);
void gp_cuda_matmul_tune_clear(void);
#ifdef __cplusplus
}
#endif

/* read by matmul.cu */
int gp_matmul_tf32 = 0;
int gp_matmul_gemv = 0;
int gp_matmul_lt = 1;
/* -1 until first read: then GPUSH_MATMUL_TUNE=1 in the environment turns it on */
static int gp_matmul_tune = -1;

int gp_matmul_tune_on(void) {
  if (gp_matmul_tune < 0) {
    const char *e = getenv("GPUSH_MATMUL_TUNE");
    gp_matmul_tune = e && strcmp(e, "1") == 0;
  }
  return gp_matmul_tune;
}

int gp_matmul_option(const char *name, int value, int *old) {
  int *opt;
  if (name && strcmp(name, "tf32") == 0) opt = &gp_matmul_tf32;
  else if (name && strcmp(name, "gemv") == 0) opt = &gp_matmul_gemv;
  else if (name && strcmp(name, "lt") == 0) opt = &gp_matmul_lt;
  else if (name && strcmp(name, "tune") == 0) {
    gp_matmul_tune_on();
    opt = &gp_matmul_tune;
  } else return gp_error("matmul_option: unknown option '%s' (tf32, gemv, lt or tune)", name ? name : "(null)");
  if (value < -1 || value > 1) return gp_error("matmul_option: %s must be 0 or 1 (-1 only reads), got %d", name, value);
  if (old) *old = *opt;
  if (value >= 0) *opt = value;
  return GP_OK;
}

int gp_matmul_tune_stats(gp_matmul_tunestats *out) {
  if (!out) return gp_error("matmul_tune_stats: null argument");
  memset(out, 0, sizeof *out);
#if GP_HAVE_CUDA
  gp_cuda_matmul_tune_stats(out);
#endif
  return GP_OK;
}

int gp_matmul_tune_clear(void) {
#if GP_HAVE_CUDA
  gp_cuda_matmul_tune_clear();
#endif
  return GP_OK;
}

int gp_bench_cublas_gemm(double *ms, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, int iters) {
  if (!ms || !out || !a || !b) return gp_error("bench_cublas_gemm: null argument");
  *ms = 0;
  GP_CHECK(matmul, out, a, b);
  if (out->device != GP_CUDA) return gp_error("bench_cublas_gemm: the tensors must be on cuda");
#if GP_HAVE_CUDA
  return gp_cuda_bench_cublas_gemm(ms, out, a, b, iters);
#else
  (void)iters;
  return gp_error("bench_cublas_gemm: this gpush was built without CUDA");
#endif
}

static double gelu_tanh(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
/* its derivative, the formula of gelu_tanh_bwd (elementwise.c) */
static double gelu_tanh_d(double x) {
  double k = 0.79788456080286535588, t = tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

/* rows of out computed together, and columns: acc holds MM_IB x MM_JB doubles */
#define MM_IB 8
#define MM_JB 256

/* out = act(alpha * a @ b + beta * out + bias) for every batch index. a and b
 * are converted to double once per batch (b once when it is broadcast), then
 * each block of MM_IB rows streams the rows of b once. act (GP_MM_*): none,
 * gelu_tanh, gelu_tanh writing its input to aux, or the product times
 * gelu_tanh'(aux) (aux read element by element just before out is written). */
static int mm_cpu(gp_tensor *out, const gp_tensor *a, const gp_tensor *b, const gp_tensor *bias, double alpha,
                  double beta, int act, gp_tensor *aux) {
  int nd = out->ndim, nb = nd - 2, dt = out->dtype;
  int64_t M = out->shape[nd - 2], N = out->shape[nd - 1], K = a->shape[nd - 1];
  int64_t batch = 1;
  for (int d = 0; d < nb; d++) batch *= out->shape[d];
  if (batch == 0 || M == 0 || N == 0) return GP_OK;
  size_t na = (size_t)(M * K), nbk = (size_t)(K * N), nacc = (size_t)MM_IB * MM_JB;
  void *buf;
  size_t held;
  GP_TRY(gp_alloc(&buf, &held, (na + nbk + nacc + (size_t)N) * sizeof(double), GP_CPU));
  double *Ad = (double *)buf, *Bd = Ad + na, *acc = Bd + nbk, *bv = acc + nacc;
  const char *pa = (const char *)gp_ptr(a), *pb = (const char *)gp_ptr(b);
  char *po = (char *)gp_ptr(out), *px = aux ? (char *)gp_ptr(aux) : NULL;
  int64_t sam = a->stride[nd - 2], sak = a->stride[nd - 1], sbk = b->stride[nd - 2], sbn = b->stride[nd - 1];
  int64_t som = out->stride[nd - 2], son = out->stride[nd - 1];
  int64_t sxm = aux ? aux->stride[nd - 2] : 0, sxn = aux ? aux->stride[nd - 1] : 0;
  for (int64_t j = 0; j < N; j++) bv[j] = bias ? gp_load(gp_ptr(bias), bias->dtype, j * bias->stride[0]) : 0.0;
  int64_t prev_ob = 0;
  int have_b = 0;
  for (int64_t bi = 0; bi < batch; bi++) {
    int64_t oa = 0, ob = 0, oo = 0, ox = 0, r = bi;
    for (int d = nb - 1; d >= 0; d--) {
      int64_t n = out->shape[d], q = r / n, i = r - q * n;
      oa += i * a->stride[d];
      ob += i * b->stride[d];
      oo += i * out->stride[d];
      if (aux) ox += i * aux->stride[d];
      r = q;
    }
    if (gp_interrupt_flag) break;
    for (int64_t i = 0; i < M; i++)
      for (int64_t k = 0; k < K; k++) Ad[i * K + k] = gp_load(pa, dt, oa + i * sam + k * sak);
    if (!have_b || ob != prev_ob) {
      for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < N; j++) Bd[k * N + j] = gp_load(pb, dt, ob + k * sbk + j * sbn);
      prev_ob = ob;
      have_b = 1;
    }
    for (int64_t i0 = 0; i0 < M && !gp_interrupt_flag; i0 += MM_IB) { /* Ctrl-C: checked every block of rows */
      int64_t ib = M - i0 < MM_IB ? M - i0 : MM_IB;
      for (int64_t j0 = 0; j0 < N && !gp_interrupt_flag; j0 += MM_JB) {
        int64_t jb = N - j0 < MM_JB ? N - j0 : MM_JB;
        memset(acc, 0, nacc * sizeof(double));
        for (int64_t k = 0; k < K; k++) {
          const double *brow = Bd + k * N + j0;
          for (int64_t ii = 0; ii < ib; ii++) {
            double av = Ad[(i0 + ii) * K + k];
            double *ac = acc + ii * MM_JB;
            for (int64_t jj = 0; jj < jb; jj++) ac[jj] += av * brow[jj];
          }
        }
        for (int64_t ii = 0; ii < ib; ii++) {
          int64_t orow = oo + (i0 + ii) * som, xrow = ox + (i0 + ii) * sxm;
          for (int64_t jj = 0; jj < jb; jj++) {
            int64_t j = j0 + jj, o = orow + j * son, x = xrow + j * sxn;
            double v = alpha * acc[ii * MM_JB + jj];
            if (beta != 0) v += beta * gp_load(po, dt, o); /* out is not read when beta = 0 */
            v += bv[j];
            if (act == GP_MM_GELU_AUX) gp_store(px, dt, x, v);
            if (act == GP_MM_GELU || act == GP_MM_GELU_AUX) v = gelu_tanh(v);
            else if (act == GP_MM_DGELU) v *= gelu_tanh_d(gp_load(px, dt, x));
            gp_store(po, dt, o, v);
          }
        }
      }
    }
  }
  gp_free(buf, held, GP_CPU);
  if (gp_interrupt_flag) return gp_interrupted("matmul");
  return GP_OK;
}

int gp_k_matmul(gp_tensor *out, const gp_tensor *a, const gp_tensor *b, double alpha, double beta) {
  GP_CHECK(matmul, out, a, b);
  GP_CUDA_DISPATCH(out, gp_cuda_matmul("matmul", out, a, b, NULL, alpha, beta, GP_MM_NONE, NULL));
  return mm_cpu(out, a, b, NULL, alpha, beta, GP_MM_NONE, NULL);
}

int gp_k_matmul_bias(gp_tensor *out, const gp_tensor *a, const gp_tensor *b, const gp_tensor *bias, double alpha,
                     double beta) {
  GP_CHECK(matmul_bias, out, a, b, bias);
  GP_CUDA_DISPATCH(out, gp_cuda_matmul("matmul_bias", out, a, b, bias, alpha, beta, GP_MM_NONE, NULL));
  return mm_cpu(out, a, b, bias, alpha, beta, GP_MM_NONE, NULL);
}

int gp_k_matmul_bias_gelu_tanh(gp_tensor *out, const gp_tensor *a, const gp_tensor *b, const gp_tensor *bias) {
  GP_CHECK(matmul_bias_gelu_tanh, out, a, b, bias);
  GP_CUDA_DISPATCH(out, gp_cuda_matmul("matmul_bias_gelu_tanh", out, a, b, bias, 1.0, 0.0, GP_MM_GELU, NULL));
  return mm_cpu(out, a, b, bias, 1.0, 0.0, GP_MM_GELU, NULL);
}

/* an error when aux shares storage with one of the others (the results would
 * depend on the order of the writes) */
static int mm_aux_apart(const char *op, const gp_tensor *aux, const gp_tensor *const *ts, const char *const *names,
                        int n) {
  for (int i = 0; i < n; i++) {
    if (ts[i] && gp_same_storage(aux, ts[i])) {
      char b1[96], b2[96];
      return gp_error("%s: aux %s shares storage with %s %s (give it a buffer of its own)", op,
                      gp_shape_str(aux, b1, sizeof b1), names[i], gp_shape_str(ts[i], b2, sizeof b2));
    }
  }
  return GP_OK;
}

int gp_k_matmul_bias_gelu_aux(gp_tensor *out, gp_tensor *aux, const gp_tensor *a, const gp_tensor *b,
                              const gp_tensor *bias) {
  GP_CHECK(matmul_bias_gelu_aux, out, aux, a, b, bias);
  const gp_tensor *ts[] = {out, a, b, bias};
  const char *names[] = {"out", "a", "b", "bias"};
  GP_TRY(mm_aux_apart("matmul_bias_gelu_aux", aux, ts, names, 4));
  GP_CUDA_DISPATCH(out, gp_cuda_matmul("matmul_bias_gelu_aux", out, a, b, bias, 1.0, 0.0, GP_MM_GELU_AUX, aux));
  return mm_cpu(out, a, b, bias, 1.0, 0.0, GP_MM_GELU_AUX, aux);
}

int gp_k_matmul_dgelu(gp_tensor *out, const gp_tensor *a, const gp_tensor *b, const gp_tensor *aux) {
  GP_CHECK(matmul_dgelu, out, a, b, aux);
  /* out may be aux itself (each element is read before it is written), not another view of its storage */
  int same = gp_ptr(out) == gp_ptr(aux) && gp_is_contiguous(out);
  const gp_tensor *ts[] = {same ? NULL : out};
  const char *names[] = {"out"};
  GP_TRY(mm_aux_apart("matmul_dgelu", aux, ts, names, 1));
  GP_CUDA_DISPATCH(out, gp_cuda_matmul("matmul_dgelu", out, a, b, NULL, 1.0, 0.0, GP_MM_DGELU, (gp_tensor *)aux));
  return mm_cpu(out, a, b, NULL, 1.0, 0.0, GP_MM_DGELU, (gp_tensor *)aux);
}
