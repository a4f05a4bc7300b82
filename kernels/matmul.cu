/* matmul.cu: matrix products on the GPU through cuBLAS.
 *
 * gpush tensors are row-major; cuBLAS is column-major. A row-major C[M,N] is a
 * column-major C^T[N,M], so C = A B is computed as C^T = B^T A^T: cuBLAS's
 * first operand is our b, its second our a, and m = N, n = M.
 *
 * Each operand's last two dims are read from its strides: rows contiguous
 * (row-major, op N) or columns contiguous (a transposed view, op T), with the
 * leading dim as ld; its batch dims must collapse to one stride (0 broadcasts
 * a 2-D operand over the batch). Anything else is copied to a contiguous
 * scratch tensor first. The output must be row-major, non-overlapping and not
 * share storage with an input; otherwise the product goes to scratch and is
 * copied back.
 *
 * Plain products: cublasGemmEx / cublasGemmStridedBatchedEx (f32 compute; TF32
 * only with gp_matmul_option("tf32", 1)); with option "gemv" 1, m == 1 or
 * n == 1 runs cublas<S|TST|HSH>gemvStridedBatched instead. Bias, GELU-bias,
 * GELU-aux-bias (the pre-activation written to aux too) and DGELU (the product
 * times gelu_tanh'(aux)) epilogues: cublasLtMatmul; where cuBLASLt offers no
 * algorithm (or aux's leading dim is not a multiple of 8), or with option
 * "lt" 0, a plain GEMM and a small epilogue kernel. The handles are created on first
 * use and bound to the current stream (gp_cuda_stream()), with a 32 MiB
 * workspace per stream.
 *
 * Option "tune" (gp_matmul_option("tune", 1), or GPUSH_MATMUL_TUNE=1 in the
 * environment; off by default): every product cuBLASLt can run, plain ones
 * too (the DEFAULT epilogue), looks its algorithm up in a process-wide cache
 * keyed by what decides the choice: dtype, compute type (TF32 or not),
 * transposes, M, N, K, batch, leading dims, batch strides, epilogue, bias,
 * aux's leading dim and batch stride, the alignments al_a/al_b/al_c, beta == 0
 * or not, and the workspace size. On a miss the heuristic's first 8 results
 * (and cublasGemmEx, for a plain product) are each run once, then take turns
 * for 3 rounds, each turn about 1 ms of runs back to back (2 to 16) between
 * two CUDA events on the current stream (the fastest turn's mean counts),
 * writing a scratch output laid out like C (zeroed when beta != 0: the real
 * output is never written by the timing). The untuned
 * path's candidate (cublasGemmEx; the heuristic's first for an epilogue)
 * stays unless another is faster by more than 2%; the choice is stored and
 * the product runs once with it. A hit runs cublasLtMatmul with the stored
 * algorithm (or the untuned path, when that won). During a CUDA graph
 * capture nothing can be timed: a miss runs the untuned path and stores
 * nothing; a hit is captured with the stored algorithm (so a warm-up step
 * before gp.graph captures tuned products). Tuned half-precision products
 * allow split-K reductions in f32 only (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE),
 * as cublasGemmEx does here. gp_matmul_tune_stats and _clear read and empty
 * the cache. Options "gemv" and "lt" 0 keep their paths (untuned).
 *
 * With GPUSH_SANITIZER=initcheck in the environment (tests/sanitize/compute.sh
 * sets it) each output is zeroed with cudaMemset before cuBLAS writes it:
 * cuBLAS's kernels store their tiles with TMA, which compute-sanitizer's
 * initcheck does not track, so without it every later read of a product is
 * reported as uninitialized (tests/sanitize/initcheck_cublas.lua shows it).
 * Marking the outputs through NVTX's memory API instead made processes with
 * LuaJIT's compiler on crash under the sanitizer. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <limits.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <vector>

#include "../src/cuda_internal.h"
#include "gelu.cuh"
#include "matmul.h"

extern "C" int gp_matmul_tf32; /* matmul.c */
extern "C" int gp_matmul_gemv;
extern "C" int gp_matmul_lt;
extern "C" int gp_matmul_tune_on(void);

static cublasHandle_t g_blas;
static cublasLtHandle_t g_lt;
static const size_t WS_BYTES = (size_t)32 << 20;
/* one workspace per stream: GEMMs on two streams at once must not share one.
 * Past MM_WS_SLOTS streams, cuBLAS runs without a workspace. */
#define MM_WS_SLOTS 8
static struct {
  cudaStream_t stream;
  void *ws;
} g_ws[MM_WS_SLOTS];
static int g_nws;
static cudaStream_t g_bound; /* the stream the handle is bound to, and its workspace */
static int g_bound_set;
static void *g_cur_ws;
static size_t g_cur_ws_bytes;

static int mm_workspace(const char *op, cudaStream_t st, void **ws, size_t *bytes) {
  for (int i = 0; i < g_nws; i++) {
    if (g_ws[i].stream == st) {
      *ws = g_ws[i].ws;
      *bytes = WS_BYTES;
      return GP_OK;
    }
  }
  *ws = nullptr;
  *bytes = 0;
  if (g_nws == MM_WS_SLOTS) return GP_OK;
  void *p = nullptr;
  if (gp_cuda_malloc(&p, WS_BYTES) != GP_OK) {
    gp_empty_cache();
    if (gp_cuda_malloc(&p, WS_BYTES) != GP_OK)
      return gp_error_oom("%s: out of memory for the %zu MiB cuBLAS workspace", op, WS_BYTES >> 20);
  }
  g_ws[g_nws].stream = st;
  g_ws[g_nws].ws = p;
  g_nws++;
  *ws = p;
  *bytes = WS_BYTES;
  return GP_OK;
}

/* the handles and workspaces back to the driver (gp_shutdown, at exit: a leak
 * check then sees no block still held) */
static void mm_tune_release(void);
extern "C" void gp_matmul_release(void) {
  mm_tune_release();
  if (g_blas) cublasDestroy(g_blas);
  if (g_lt) cublasLtDestroy(g_lt);
  g_blas = nullptr;
  g_lt = nullptr;
  for (int i = 0; i < g_nws; i++) gp_cuda_free(g_ws[i].ws);
  g_nws = 0;
  g_bound_set = 0;
  g_cur_ws = nullptr;
  g_cur_ws_bytes = 0;
}

static int mm_init(const char *op) {
  GP_TRY(gp_cuda_init());
  cublasStatus_t s;
  if (!g_blas) {
    cublasHandle_t h;
    if ((s = cublasCreate(&h)) != CUBLAS_STATUS_SUCCESS)
      return gp_error("%s: cublasCreate failed: %s", op, cublasGetStatusString(s));
    /* split-K reductions in f32 too, not in the output precision */
    if ((s = cublasSetMathMode(h, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)) != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(h);
      return gp_error("%s: cublasSetMathMode failed: %s", op, cublasGetStatusString(s));
    }
    g_blas = h;
  }
  if (!g_lt) {
    cublasLtHandle_t h;
    if ((s = cublasLtCreate(&h)) != CUBLAS_STATUS_SUCCESS)
      return gp_error("%s: cublasLtCreate failed: %s", op, cublasGetStatusString(s));
    g_lt = h;
  }
  cudaStream_t st = gp_cuda_stream(); /* the current stream (gp.with_stream may change it) */
  if (!g_bound_set || st != g_bound) {
    void *ws;
    size_t bytes;
    GP_TRY(mm_workspace(op, st, &ws, &bytes));
    if ((s = cublasSetStream(g_blas, st)) != CUBLAS_STATUS_SUCCESS)
      return gp_error("%s: cublasSetStream failed: %s", op, cublasGetStatusString(s));
    /* cublasSetStream resets the workspace: set it after */
    if ((s = cublasSetWorkspace(g_blas, ws, bytes)) != CUBLAS_STATUS_SUCCESS)
      return gp_error("%s: cublasSetWorkspace failed: %s", op, cublasGetStatusString(s));
    g_bound = st;
    g_bound_set = 1;
    g_cur_ws = ws;
    g_cur_ws_bytes = bytes;
  }
  return GP_OK;
}

/* a failed cuBLAS call as an error naming the op, the call and the shapes */
static int mm_fail(const char *op, const char *call, cublasStatus_t s, const gp_tensor *out, const gp_tensor *a,
                   const gp_tensor *b) {
  char b1[96], b2[96], b3[96];
  return gp_error("%s: %s failed (%s) for a %s, b %s, out %s, %s", op, call, cublasGetStatusString(s),
                  gp_shape_str(a, b1, sizeof b1), gp_shape_str(b, b2, sizeof b2), gp_shape_str(out, b3, sizeof b3),
                  gp_dtype_name(out->dtype));
}

/* an operand as cuBLAS sees it */
struct mm_mat {
  const char *p; /* element (0, 0) of batch 0 */
  int col;       /* 0: rows contiguous (row-major), 1: columns contiguous (a transposed view) */
  int64_t ld;    /* leading dimension, elements */
  int64_t bs;    /* batch stride, elements (0: the same matrix for every batch) */
};

static bool mm_layout(const gp_tensor *t, mm_mat *m) {
  int nd = t->ndim;
  int64_t R = t->shape[nd - 2], C = t->shape[nd - 1], sr = t->stride[nd - 2], sc = t->stride[nd - 1];
  int64_t C1 = std::max<int64_t>(C, 1), R1 = std::max<int64_t>(R, 1);
  if ((C == 1 || sc == 1) && (R == 1 || sr >= C1)) {
    m->col = 0;
    m->ld = R == 1 ? C1 : sr;
  } else if ((R == 1 || sr == 1) && (C == 1 || sc >= R1)) {
    m->col = 1;
    m->ld = C == 1 ? R1 : sc;
  } else {
    return false;
  }
  if (m->ld > INT_MAX) return false;
  /* the batch dims as one stride: each non-1 dim must step over the next */
  int64_t bs = 0, span = 0;
  bool first = true;
  for (int d = nd - 3; d >= 0; d--) {
    if (t->shape[d] == 1) continue;
    if (first) {
      bs = t->stride[d];
      first = false;
    } else if (t->stride[d] != span) {
      return false;
    }
    span = t->stride[d] * t->shape[d];
  }
  m->bs = bs;
  m->p = (const char *)gp_ptr(t);
  return true;
}

/* a contiguous scratch copy of x */
static int mm_contig(gp_tensor **t, const gp_tensor *x) {
  GP_TRY(gp_tensor_scratch(t, x->dtype, GP_CUDA, x->ndim, x->shape));
  return gp_k_copy(*t, x);
}

/* the largest power of two (up to 256) dividing every given byte address or stride */
static uint32_t mm_align(uintptr_t x) {
  uint32_t a = 256;
  while (a > 1 && (x % a) != 0) a >>= 1;
  return a;
}

/* o = act(scale * o + bias) over a row-major [batch, M, N] (o read only when
 * read is set); the GEMM fallback of the epilogues, and k = 0. act GP_MM_GELU_AUX
 * also writes the pre-activation to x; GP_MM_DGELU multiplies by gelu_tanh'(x).
 * x (aux) has o's shape, leading dim ldx and batch stride xbs. */
template <typename T>
__global__ void mm_epilogue_k(T *o, const T *bias, T *x, int64_t rows, int64_t M, int64_t N, int64_t ldo, int64_t bs,
                              int64_t ldx, int64_t xbs, float scale, int read, int act) {
  int64_t n = rows * N, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += nth) {
    int64_t r = i / N, j = i - r * N, bi = r / M, m = r - bi * M;
    T *p = o + bi * bs + m * ldo + j;
    T *px = x ? x + bi * xbs + m * ldx + j : nullptr;
    float v = read ? scale * ld(*p) : 0.0f;
    if (bias) v += ld(bias[j]);
    if (act == GP_MM_GELU_AUX) *px = st<T>(v);
    if (act == GP_MM_GELU || act == GP_MM_GELU_AUX) v = gp_gelu_tanh(v);
    else if (act == GP_MM_DGELU) v *= gp_gelu_tanh_d(ld(*px));
    *p = st<T>(v);
  }
}

static int mm_epilogue(const char *op, int dt, const mm_mat &C, const gp_tensor *bias, const mm_mat *X,
                       int64_t batch, int64_t M, int64_t N, double scale, int read, int act) {
  int64_t rows = batch * M;
  GP_FLOAT_SWITCH(dt, T, GP_NOTE_LAUNCH(mm_epilogue_k<T>, 256, 0);
                  mm_epilogue_k<T><<<gp_grid(rows * N, 256), 256, 0, gp_cuda_stream()>>>(
                      (T *)C.p, bias ? (const T *)gp_ptr(bias) : nullptr, X ? (T *)X->p : nullptr, rows, M, N, C.ld,
                      C.bs, X ? X->ld : 0, X ? X->bs : 0, (float)scale, read, act));
  return gp_cuda_check_launch(op);
}

/* everything a product needs, resolved */
struct mm_job {
  const char *op;
  gp_tensor *out;               /* as given */
  const gp_tensor *a, *b;
  const gp_tensor *ta, *tb;     /* a and b as used (maybe scratch copies) */
  gp_tensor *to;                /* the output as written (maybe scratch) */
  const gp_tensor *aux;         /* GELU_AUX: written; DGELU: read (contiguous, out's shape) */
  int act;                      /* GP_MM_* */
  mm_mat A, B, C, X = {};       /* X: aux */
  int64_t M, N, K, batch;
  cudaDataType_t ty = CUDA_R_32F;
  cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
  float alpha, beta;
};

/* the plain GEMM into j.C; *call names the cuBLAS function */
static cublasStatus_t mm_gemm_call(const mm_job &j, const char **call) {
  cublasOperation_t opa = j.B.col ? CUBLAS_OP_T : CUBLAS_OP_N; /* cuBLAS's first operand is our b */
  cublasOperation_t opb = j.A.col ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (j.batch == 1) {
    *call = "cublasGemmEx";
    return cublasGemmEx(g_blas, opa, opb, (int)j.N, (int)j.M, (int)j.K, &j.alpha, j.B.p, j.ty, (int)j.B.ld, j.A.p,
                        j.ty, (int)j.A.ld, &j.beta, (void *)j.C.p, j.ty, (int)j.C.ld, j.ct, CUBLAS_GEMM_DEFAULT);
  }
  *call = "cublasGemmStridedBatchedEx";
  return cublasGemmStridedBatchedEx(g_blas, opa, opb, (int)j.N, (int)j.M, (int)j.K, &j.alpha, j.B.p, j.ty,
                                    (int)j.B.ld, (long long)j.B.bs, j.A.p, j.ty, (int)j.A.ld, (long long)j.A.bs,
                                    &j.beta, (void *)j.C.p, j.ty, (int)j.C.ld, (long long)j.C.bs, (int)j.batch, j.ct,
                                    CUBLAS_GEMM_DEFAULT);
}

static int mm_gemm(const mm_job &j) {
  const char *call;
  cublasStatus_t s = mm_gemm_call(j, &call);
  if (s != CUBLAS_STATUS_SUCCESS) return mm_fail(j.op, call, s, j.out, j.a, j.b);
  return GP_OK;
}

/* m == 1 or n == 1 through cuBLAS gemv; *done = false when the strides do not fit */
static int mm_gemv(const mm_job &j, bool *done) {
  *done = false;
  int nd = j.to->ndim;
  const mm_mat *mat;
  const char *x, *y = j.C.p;
  int64_t incx, incy, sx, sy = j.C.bs, m, n;
  cublasOperation_t tr;
  if (j.M == 1) { /* out[1,N] = a[1,K] @ b[K,N]: y = b^T-ish x with b as the matrix */
    mat = &j.B;
    x = j.A.p;
    sx = j.A.bs;
    incx = j.K == 1 ? 1 : j.ta->stride[nd - 1];
    incy = j.N == 1 ? 1 : j.to->stride[nd - 1];
    if (j.B.col == 0) { tr = CUBLAS_OP_N; m = j.N; n = j.K; } /* memory: column-major [N x K] */
    else { tr = CUBLAS_OP_T; m = j.K; n = j.N; }              /* memory: column-major [K x N] */
  } else { /* N == 1: out[M,1] = a[M,K] @ b[K,1] with a as the matrix */
    mat = &j.A;
    x = j.B.p;
    sx = j.B.bs;
    incx = j.K == 1 ? 1 : j.tb->stride[nd - 2];
    incy = j.C.ld;
    if (j.A.col == 0) { tr = CUBLAS_OP_T; m = j.K; n = j.M; } /* memory: column-major [K x M] */
    else { tr = CUBLAS_OP_N; m = j.M; n = j.K; }              /* memory: column-major [M x K] */
  }
  if (incx <= 0 || incx > INT_MAX || incy <= 0 || incy > INT_MAX) return GP_OK;
  cublasStatus_t s;
  const char *call;
  int bc = (int)j.batch;
  if (j.ty == CUDA_R_32F) {
    call = "cublasSgemvStridedBatched";
    s = cublasSgemvStridedBatched(g_blas, tr, (int)m, (int)n, &j.alpha, (const float *)mat->p, (int)mat->ld, mat->bs,
                                  (const float *)x, (int)incx, sx, &j.beta, (float *)y, (int)incy, sy, bc);
  } else if (j.ty == CUDA_R_16BF) {
    call = "cublasTSTgemvStridedBatched";
    s = cublasTSTgemvStridedBatched(g_blas, tr, (int)m, (int)n, &j.alpha, (const __nv_bfloat16 *)mat->p, (int)mat->ld,
                                    mat->bs, (const __nv_bfloat16 *)x, (int)incx, sx, &j.beta, (__nv_bfloat16 *)y,
                                    (int)incy, sy, bc);
  } else {
    call = "cublasHSHgemvStridedBatched";
    s = cublasHSHgemvStridedBatched(g_blas, tr, (int)m, (int)n, &j.alpha, (const __half *)mat->p, (int)mat->ld,
                                    mat->bs, (const __half *)x, (int)incx, sx, &j.beta, (__half *)y, (int)incy, sy,
                                    bc);
  }
  if (s != CUBLAS_STATUS_SUCCESS) return mm_fail(j.op, call, s, j.out, j.a, j.b);
  *done = true;
  return GP_OK;
}

/* ---- option "tune": cuBLASLt algorithms chosen by measurement ----
 * A product's key holds everything the choice depends on; its entry, the
 * fastest candidate timed once, serves every later product of that key. */
struct mm_key {
  int32_t ty, ct, opa, opb, epi, has_bias, beta0, dt;
  uint32_t al_a, al_b, al_c, pad;
  int64_t M, N, K, batch, lda, ldb, ldc, bsa, bsb, bsc, ldx, bsx;
  uint64_t ws;
};
struct mm_key_less {
  bool operator()(const mm_key &x, const mm_key &y) const { return memcmp(&x, &y, sizeof x) < 0; }
};
/* MM_USE_LT: cublasLtMatmul with algo; MM_USE_FALLBACK: the untuned path
 * (cublasGemmEx won for a plain product, or cuBLASLt offered no algorithm) */
enum { MM_USE_LT, MM_USE_FALLBACK };
struct mm_choice {
  int use;
  cublasLtMatmulAlgo_t algo;
  float ms;
};
static std::map<mm_key, mm_choice, mm_key_less> g_tune;
static gp_matmul_tunestats g_tstats;
#define MM_TUNE_ALGOS 8      /* heuristic results timed */
#define MM_TUNE_CANDS (MM_TUNE_ALGOS + 1) /* and cublasGemmEx */
#define MM_TUNE_ROUNDS 3     /* the candidates take turns, this many rounds */
#define MM_TUNE_MS 1.0f      /* each candidate's turn: run back to back for about this long (2 to 16 runs) */
#define MM_TUNE_MARGIN 0.98f /* another candidate replaces the default only when this much faster */
static cudaEvent_t g_tev[2 * MM_TUNE_CANDS];
static int g_tev_made;

static void mm_tune_release(void) {
  g_tune.clear();
  memset(&g_tstats, 0, sizeof g_tstats);
  if (g_tev_made)
    for (cudaEvent_t &e : g_tev) cudaEventDestroy(e);
  g_tev_made = 0;
}

extern "C" void gp_cuda_matmul_tune_stats(gp_matmul_tunestats *out) {
  *out = g_tstats;
  out->entries = (int64_t)g_tune.size();
}

extern "C" void gp_cuda_matmul_tune_clear(void) {
  g_tune.clear();
  memset(&g_tstats, 0, sizeof g_tstats);
}

/* true when the current stream is being captured into a CUDA graph (or its
 * state cannot be read): nothing may be timed then */
static bool mm_capturing(void) {
  if (gp_cuda_capturing()) return true;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(gp_cuda_stream(), &cs) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return cs != cudaStreamCaptureStatusNone;
}

/* ms[c]: candidate c's time, call(c) for c < nc: each runs once (a warm-up;
 * ok[c] false, and not timed, when it refuses), then in each of
 * MM_TUNE_ROUNDS rounds the candidates take turns, each run n times back to
 * back between two CUDA events (n from one probe run: about MM_TUNE_MS a
 * turn); a turn's mean, the fastest of the rounds, counts. Turns, not one
 * candidate after another, so that clocks drifting while they run favour
 * none. GP_ERR on a CUDA error. */
template <typename F> static int mm_time(const char *op, int nc, F call, float *ms, bool *ok) {
  cudaStream_t st = gp_cuda_stream();
  cudaError_t e = cudaSuccess;
  float probe = 0;
  int n, first = -1, last = -1;
  if (!g_tev_made) {
    int k = 0;
    for (; k < 2 * MM_TUNE_CANDS && e == cudaSuccess; k++) e = cudaEventCreate(&g_tev[k]);
    if (e != cudaSuccess) {
      for (int i = 0; i < k - 1; i++) cudaEventDestroy(g_tev[i]);
      return gp_error("%s: cudaEventCreate (matmul tune): %s", op, cudaGetErrorString(e));
    }
    g_tev_made = 1;
  }
  for (int c = 0; c < nc; c++) {
    ms[c] = INFINITY;
    ok[c] = call(c) == CUBLAS_STATUS_SUCCESS;
    if (ok[c] && first < 0) first = c;
  }
  if (first < 0) return GP_OK;
  if ((e = cudaEventRecord(g_tev[0], st)) != cudaSuccess) goto cuda_fail;
  call(first);
  if ((e = cudaEventRecord(g_tev[1], st)) != cudaSuccess) goto cuda_fail;
  if ((e = cudaEventSynchronize(g_tev[1])) != cudaSuccess) goto cuda_fail;
  if ((e = cudaEventElapsedTime(&probe, g_tev[0], g_tev[1])) != cudaSuccess) goto cuda_fail;
  n = probe > 0 ? (int)std::min(16.0f, MM_TUNE_MS / probe) : 16;
  n = std::max(n, 2); /* steady state: a run after one of its own */
  for (int round = 0; round < MM_TUNE_ROUNDS; round++) {
    for (int c = 0; c < nc; c++) {
      if (!ok[c]) continue;
      if ((e = cudaEventRecord(g_tev[2 * c], st)) != cudaSuccess) goto cuda_fail;
      for (int r = 0; r < n && ok[c]; r++) ok[c] = call(c) == CUBLAS_STATUS_SUCCESS;
      if ((e = cudaEventRecord(g_tev[2 * c + 1], st)) != cudaSuccess) goto cuda_fail;
      last = c;
    }
    if (last < 0) break;
    if ((e = cudaEventSynchronize(g_tev[2 * last + 1])) != cudaSuccess) goto cuda_fail;
    for (int c = 0; c < nc; c++) {
      float t = 0;
      if (!ok[c]) continue;
      if ((e = cudaEventElapsedTime(&t, g_tev[2 * c], g_tev[2 * c + 1])) != cudaSuccess) goto cuda_fail;
      ms[c] = std::min(ms[c], t / n);
    }
  }
  return GP_OK;
cuda_fail:
  return gp_error("%s: timing a matmul candidate (option tune): %s", op, cudaGetErrorString(e));
}

/* cuBLASLt descriptors, destroyed on every return */
struct lt_guard {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~lt_guard() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

/* Products through cuBLASLt: the bias, GELU and aux epilogues (bias may be
 * null for DGELU only), and with option "tune" plain products too (act
 * GP_MM_NONE, no bias: the DEFAULT epilogue). *done = false when the caller
 * should take its own path: cuBLASLt has no algorithm for it, aux's leading
 * dim, batch stride or address do not meet its rules (multiples of 8
 * elements; 16-byte aligned), a plain product without tune (or tuned to
 * cublasGemmEx, or missed during a capture). */
static int mm_lt(const mm_job &j, const gp_tensor *bias, bool *done) {
  *done = false;
  bool plain = !bias && j.act == GP_MM_NONE, tune = gp_matmul_tune_on() != 0;
  if (plain && !tune) return GP_OK;
  const void *bp = bias ? gp_ptr(bias) : nullptr;
  if ((uintptr_t)bp % 16 != 0) return GP_OK;
  bool has_aux = j.act == GP_MM_GELU_AUX || j.act == GP_MM_DGELU;
  if (has_aux && ((uintptr_t)j.X.p % 16 != 0 || j.X.col != 0 || j.X.ld % 8 != 0 || j.X.ld < j.N ||
                  (j.batch > 1 && j.X.bs % 8 != 0)))
    return GP_OK;
  lt_guard g;
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  const char *call = "cublasLtMatmulDescCreate";
  gp_tensor *scratch = nullptr;
  int rc = GP_OK;
#define LT(x)                                                            \
  do {                                                                   \
    call = #x;                                                           \
    if ((s = (x)) != CUBLAS_STATUS_SUCCESS) goto fail;                   \
  } while (0)
  {
    cublasOperation_t opa = j.B.col ? CUBLAS_OP_T : CUBLAS_OP_N, opb = j.A.col ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtEpilogue_t epi = j.act == GP_MM_GELU       ? CUBLASLT_EPILOGUE_GELU_BIAS
                             : j.act == GP_MM_GELU_AUX ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                             : j.act == GP_MM_DGELU    ? CUBLASLT_EPILOGUE_DGELU
                             : bias                    ? CUBLASLT_EPILOGUE_BIAS
                                                       : CUBLASLT_EPILOGUE_DEFAULT;
    const void *xp = j.X.p;
    int64_t x_ld = j.X.ld, x_bs = j.X.bs;
    int32_t bias_ty = (int32_t)j.ty;
    int64_t bias_bs = 0;
    int es = gp_elsize(j.to->dtype);
    uint64_t ws = g_cur_ws_bytes;
    uint32_t al_a = mm_align((uintptr_t)j.B.p | (uintptr_t)(j.B.bs * es));
    uint32_t al_b = mm_align((uintptr_t)j.A.p | (uintptr_t)(j.A.bs * es));
    uint32_t al_c = mm_align((uintptr_t)j.C.p | (uintptr_t)(j.C.bs * es));
    cublasLtMatmulHeuristicResult_t res[MM_TUNE_ALGOS];
    int nres = 0;
    mm_key key;
    mm_choice best;
    double t0 = 0;
    bool capture_miss = false;
    LT(cublasLtMatmulDescCreate(&g.desc, j.ct, CUDA_R_32F));
    LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (bias) {
      LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp));
      LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_ty, sizeof bias_ty));
    }
    if (has_aux) { /* aux: out's dtype (the default aux type), row-major like D: column-major [N x M], ld x_ld */
      LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &xp, sizeof xp));
      LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &x_ld, sizeof x_ld));
    }
    /* the memory of each operand, column-major: our b is [N x K] (or [K x N] when transposed) */
    LT(cublasLtMatrixLayoutCreate(&g.la, j.ty, (uint64_t)(j.B.col ? j.K : j.N), (uint64_t)(j.B.col ? j.N : j.K),
                                  j.B.ld));
    LT(cublasLtMatrixLayoutCreate(&g.lb, j.ty, (uint64_t)(j.A.col ? j.M : j.K), (uint64_t)(j.A.col ? j.K : j.M),
                                  j.A.ld));
    LT(cublasLtMatrixLayoutCreate(&g.lc, j.ty, (uint64_t)j.N, (uint64_t)j.M, j.C.ld));
    if (j.batch > 1) {
      int32_t bc = (int32_t)j.batch;
      if (bias)
        LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &bias_bs, sizeof bias_bs));
      if (has_aux)
        LT(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &x_bs, sizeof x_bs));
      LT(cublasLtMatrixLayoutSetAttribute(g.la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
      LT(cublasLtMatrixLayoutSetAttribute(g.la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &j.B.bs, sizeof j.B.bs));
      LT(cublasLtMatrixLayoutSetAttribute(g.lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
      LT(cublasLtMatrixLayoutSetAttribute(g.lb, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &j.A.bs, sizeof j.A.bs));
      LT(cublasLtMatrixLayoutSetAttribute(g.lc, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
      LT(cublasLtMatrixLayoutSetAttribute(g.lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &j.C.bs, sizeof j.C.bs));
    }
    if (tune) { /* the cache first: a hit needs no heuristic */
      memset(&key, 0, sizeof key);
      key.ty = (int32_t)j.ty;
      key.ct = (int32_t)j.ct;
      key.opa = (int32_t)opa;
      key.opb = (int32_t)opb;
      key.epi = (int32_t)epi;
      key.has_bias = bias != nullptr;
      key.beta0 = j.beta == 0;
      key.dt = j.to->dtype;
      key.al_a = al_a;
      key.al_b = al_b;
      key.al_c = al_c;
      key.M = j.M;
      key.N = j.N;
      key.K = j.K;
      key.batch = j.batch;
      key.lda = j.B.ld;
      key.ldb = j.A.ld;
      key.ldc = j.C.ld;
      if (j.batch > 1) {
        key.bsa = j.B.bs;
        key.bsb = j.A.bs;
        key.bsc = j.C.bs;
      }
      if (has_aux) {
        key.ldx = x_ld;
        key.bsx = j.batch > 1 ? x_bs : 0;
      }
      key.ws = ws;
      auto it = g_tune.find(key);
      if (it != g_tune.end()) {
        g_tstats.hits++;
        if (it->second.use != MM_USE_LT) return GP_OK; /* the caller's path */
        LT(cublasLtMatmul(g_lt, g.desc, &j.alpha, j.B.p, g.la, j.A.p, g.lb, &j.beta, j.C.p, g.lc, (void *)j.C.p, g.lc,
                          &it->second.algo, g_cur_ws, g_cur_ws_bytes, g_bound));
        *done = true;
        return GP_OK;
      }
      capture_miss = mm_capturing();
      if (capture_miss) { /* nothing can be timed during a capture: the untuned path, not stored */
        g_tstats.uncached++;
        if (plain) return GP_OK;
        tune = false;
      }
    }
    LT(cublasLtMatmulPreferenceCreate(&g.pref));
    LT(cublasLtMatmulPreferenceSetAttribute(g.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    LT(cublasLtMatmulPreferenceSetAttribute(g.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
    LT(cublasLtMatmulPreferenceSetAttribute(g.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
    LT(cublasLtMatmulPreferenceSetAttribute(g.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c));
    LT(cublasLtMatmulPreferenceSetAttribute(g.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c));
    if (tune && es < 4) {
      /* split-K partial sums in f32 (compute type) only, never in bf16/f16 (in place in the output or in its type):
       * what CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION asks of cublasGemmEx */
      uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      LT(cublasLtMatmulPreferenceSetAttribute(g.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof mask));
    }
    if (!tune) {
      s = cublasLtMatmulAlgoGetHeuristic(g_lt, g.desc, g.la, g.lb, g.lc, g.lc, g.pref, 1, res, &nres);
      if (s != CUBLAS_STATUS_SUCCESS || nres < 1) return GP_OK; /* not supported: the caller falls back */
      LT(cublasLtMatmul(g_lt, g.desc, &j.alpha, j.B.p, g.la, j.A.p, g.lb, &j.beta, j.C.p, g.lc, (void *)j.C.p, g.lc,
                        &res[0].algo, g_cur_ws, g_cur_ws_bytes, g_bound));
      *done = true;
      return GP_OK;
    }
    /* a miss: time the candidates into a scratch output shaped like C (the real
     * output, read when beta != 0, stays untouched), pick the fastest, store it */
    g_tstats.misses++;
    t0 = gp_wall_ms();
    best.use = MM_USE_FALLBACK;
    best.ms = INFINITY;
    memset(&best.algo, 0, sizeof best.algo);
    s = cublasLtMatmulAlgoGetHeuristic(g_lt, g.desc, g.la, g.lb, g.lc, g.lc, g.pref, MM_TUNE_ALGOS, res, &nres);
    if (s != CUBLAS_STATUS_SUCCESS) nres = 0;
    if (nres > 0 || plain) {
      /* the default (the untuned path: cublasGemmEx for a plain product, the
       * heuristic's first for an epilogue) stays unless another candidate is
       * faster by more than the noise (MM_TUNE_MARGIN) */
      int64_t span = (j.batch - 1) * j.C.bs + (j.M - 1) * j.C.ld + j.N;
      mm_job jt = j;
      const cublasLtMatmulAlgo_t *cand[MM_TUNE_CANDS]; /* nullptr: cublasGemmEx */
      float ms[MM_TUNE_CANDS];
      bool ok[MM_TUNE_CANDS];
      int nc = 0, other = -1;
      rc = gp_tensor_scratch(&scratch, j.to->dtype, GP_CUDA, 1, &span);
      if (rc == GP_OK && j.beta != 0) { /* finite values to accumulate into */
        cudaError_t e = cudaMemsetAsync(gp_ptr(scratch), 0, (size_t)span * es, gp_cuda_stream());
        if (e != cudaSuccess) rc = gp_error("%s: cudaMemsetAsync (matmul tune): %s", j.op, cudaGetErrorString(e));
      }
      if (rc != GP_OK) goto out;
      jt.C.p = (const char *)gp_ptr(scratch);
      if (plain) cand[nc++] = nullptr;
      for (int i = 0; i < nres; i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS) cand[nc++] = &res[i].algo;
      {
        void *sp = gp_ptr(scratch);
        const char *gcall;
        rc = mm_time(j.op, nc, [&](int c) {
          if (!cand[c]) return mm_gemm_call(jt, &gcall);
          return cublasLtMatmul(g_lt, g.desc, &j.alpha, j.B.p, g.la, j.A.p, g.lb, &j.beta, sp, g.lc, sp, g.lc,
                                cand[c], g_cur_ws, g_cur_ws_bytes, g_bound);
        }, ms, ok);
      }
      if (rc != GP_OK) goto out;
      /* candidate 0 is the default; another replaces it when faster by more than the noise */
      for (int c = 1; c < nc; c++)
        if (ok[c] && (other < 0 || ms[c] < ms[other])) other = c;
      if (nc > 0 && ok[0] && (other < 0 || !(ms[other] < MM_TUNE_MARGIN * ms[0]))) other = 0;
      if (other >= 0) {
        best.use = cand[other] ? MM_USE_LT : MM_USE_FALLBACK;
        if (cand[other]) best.algo = *cand[other];
        best.ms = ms[other];
      }
      gp_tensor_free(scratch);
      scratch = nullptr;
    }
    g_tune[key] = best;
    g_tstats.tuned_ms += gp_wall_ms() - t0;
    if (best.use != MM_USE_LT) return GP_OK;
    LT(cublasLtMatmul(g_lt, g.desc, &j.alpha, j.B.p, g.la, j.A.p, g.lb, &j.beta, j.C.p, g.lc, (void *)j.C.p, g.lc,
                      &best.algo, g_cur_ws, g_cur_ws_bytes, g_bound));
  }
#undef LT
  *done = true;
  return GP_OK;
out:
  gp_tensor_free(scratch);
  return rc;
fail:
  gp_tensor_free(scratch);
  return mm_fail(j.op, call, s, j.out, j.a, j.b);
}

/* GPUSH_SANITIZER=initcheck: zero the rows of m (rows x cols of each batch) before cuBLAS writes them */
static int g_fill = -1;
static int mm_fill(const char *op, const mm_mat &m, int64_t batch, int64_t rows, int64_t cols, int es) {
  if (g_fill < 0) {
    const char *e = getenv("GPUSH_SANITIZER");
    g_fill = e && !strcmp(e, "initcheck");
  }
  if (!g_fill) return GP_OK;
  if (m.col) std::swap(rows, cols);
  for (int64_t b = 0; b < batch; b++) {
    cudaError_t e = cudaMemset2DAsync((void *)(m.p + b * m.bs * es), (size_t)(m.ld * es), 0, (size_t)(cols * es),
                                      (size_t)rows, gp_cuda_stream());
    if (e != cudaSuccess) return gp_error("%s: cudaMemset2DAsync: %s", op, cudaGetErrorString(e));
  }
  return GP_OK;
}

static int mm_run(mm_job &j, const gp_tensor *bias, gp_tensor **tmp) {
  gp_tensor *out = j.out;
  const gp_tensor *a = j.a, *b = j.b;
  int dt = out->dtype;
  /* the output: row-major, batches apart, sharing no storage with an input */
  bool out_ok = mm_layout(out, &j.C) && j.C.col == 0 && (j.batch == 1 || j.C.bs >= (j.M - 1) * j.C.ld + j.N) &&
                !gp_same_storage(out, a) && !gp_same_storage(out, b) && !(bias && gp_same_storage(out, bias)) &&
                !(j.aux && gp_same_storage(out, j.aux));
  j.to = out;
  if (!out_ok) {
    GP_TRY(gp_tensor_scratch(&tmp[2], dt, GP_CUDA, out->ndim, out->shape));
    if (j.beta != 0) GP_TRY(gp_k_copy(tmp[2], out));
    j.to = tmp[2];
    mm_layout(j.to, &j.C);
  }
  const mm_mat *X = nullptr;
  if (j.aux) { /* contiguous (its spec says so): always a row-major layout */
    mm_layout(j.aux, &j.X);
    X = &j.X;
  }
  if (j.K == 0) { /* no products: out = act(beta * out + bias) */
    GP_TRY(mm_epilogue(j.op, dt, j.C, bias, X, j.batch, j.M, j.N, j.beta, j.beta != 0, j.act));
  } else {
    j.ta = a;
    if (!mm_layout(a, &j.A)) {
      GP_TRY(mm_contig(&tmp[0], a));
      j.ta = tmp[0];
      mm_layout(j.ta, &j.A);
    }
    j.tb = b;
    if (!mm_layout(b, &j.B)) {
      GP_TRY(mm_contig(&tmp[1], b));
      j.tb = tmp[1];
      mm_layout(j.tb, &j.B);
    }
    int es = gp_elsize(j.to->dtype);
    if (j.beta == 0) GP_TRY(mm_fill(j.op, j.C, j.batch, j.M, j.N, es));
    if (X && j.act == GP_MM_GELU_AUX) GP_TRY(mm_fill(j.op, *X, j.batch, j.M, j.N, es));
    bool done = false;
    if (bias || j.act != GP_MM_NONE) {
      if (gp_matmul_lt) GP_TRY(mm_lt(j, bias, &done));
      if (!done) {
        GP_TRY(mm_gemm(j));
        GP_TRY(mm_epilogue(j.op, dt, j.C, bias, X, j.batch, j.M, j.N, 1.0, 1, j.act));
      }
    } else {
      if (gp_matmul_gemv && (j.M == 1 || j.N == 1)) GP_TRY(mm_gemv(j, &done));
      if (!done) GP_TRY(mm_lt(j, nullptr, &done)); /* option "tune" only */
      if (!done) GP_TRY(mm_gemm(j));
    }
  }
  if (j.to != out) GP_TRY(gp_k_copy(out, j.to));
  return GP_OK;
}

static int mm_types(const char *op, int dt, cudaDataType_t *ty, cublasComputeType_t *ct) {
  switch (dt) {
    case GP_F32: *ty = CUDA_R_32F; break;
    case GP_BF16: *ty = CUDA_R_16BF; break;
    case GP_F16: *ty = CUDA_R_16F; break;
    default: return gp_error("%s: %s is not supported on cuda (f32, bf16, f16)", op, gp_dtype_name(dt));
  }
  *ct = dt == GP_F32 && gp_matmul_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  return GP_OK;
}

/* the sizes of out = a @ b: batch, M, N, K; GP_ERR when cuBLAS's int sizes cannot hold them */
static int mm_sizes(const char *op, const gp_tensor *out, const gp_tensor *a, const gp_tensor *b, int64_t *batch,
                    int64_t *M, int64_t *N, int64_t *K) {
  int nd = out->ndim;
  *M = out->shape[nd - 2];
  *N = out->shape[nd - 1];
  *K = a->shape[nd - 1];
  *batch = 1;
  for (int d = 0; d < nd - 2; d++) *batch *= out->shape[d];
  if (*M > INT_MAX || *N > INT_MAX || *K > INT_MAX || *batch > INT_MAX) {
    char b1[96], b2[96];
    return gp_error("%s: a %s, b %s: sizes above 2^31-1 are not supported", op, gp_shape_str(a, b1, sizeof b1),
                    gp_shape_str(b, b2, sizeof b2));
  }
  return GP_OK;
}

extern "C" int gp_cuda_matmul(const char *op, gp_tensor *out, const gp_tensor *a, const gp_tensor *b,
                              const gp_tensor *bias, double alpha, double beta, int act, gp_tensor *aux) {
  mm_job j;
  j.op = op;
  j.act = act;
  j.aux = aux;
  j.out = out;
  j.a = j.ta = a;
  j.b = j.tb = b;
  j.alpha = (float)alpha;
  j.beta = (float)beta;
  GP_TRY(mm_types(op, out->dtype, &j.ty, &j.ct));
  GP_TRY(mm_sizes(op, out, a, b, &j.batch, &j.M, &j.N, &j.K));
  if (j.batch == 0 || j.M == 0 || j.N == 0) return GP_OK;
  GP_TRY(mm_init(op));
  gp_tensor *tmp[3] = {nullptr, nullptr, nullptr};
  int rc = mm_run(j, bias, tmp);
  for (gp_tensor *t : tmp) gp_tensor_free(t);
  return rc;
}

/* cuBLAS called directly: no layout logic, no gpush dispatch */
extern "C" int gp_cuda_bench_cublas_gemm(double *ms, gp_tensor *out, const gp_tensor *a, const gp_tensor *b,
                                         int iters) {
  const char *op = "bench_cublas_gemm";
  if (out->ndim > 3 || !gp_is_contiguous(out) || !gp_is_contiguous(a) || !gp_is_contiguous(b))
    return gp_error("%s: needs contiguous 2-d or 3-d tensors", op);
  cudaDataType_t ty = CUDA_R_32F;
  cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
  int64_t batch, M, N, K;
  GP_TRY(mm_types(op, out->dtype, &ty, &ct));
  GP_TRY(mm_sizes(op, out, a, b, &batch, &M, &N, &K));
  if (batch * M * N * K == 0) return gp_error("%s: empty product", op);
  GP_TRY(mm_init(op));
  if (iters < 1) iters = 1;
  float alpha = 1, beta = 0;
  auto call = [&]() {
    if (batch == 1)
      return cublasGemmEx(g_blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, gp_ptr(b), ty, (int)N,
                          gp_ptr(a), ty, (int)K, &beta, gp_ptr(out), ty, (int)N, ct, CUBLAS_GEMM_DEFAULT);
    return cublasGemmStridedBatchedEx(g_blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, gp_ptr(b), ty,
                                      (int)N, (long long)(K * N), gp_ptr(a), ty, (int)K, (long long)(M * K), &beta,
                                      gp_ptr(out), ty, (int)N, (long long)(M * N), (int)batch, ct,
                                      CUBLAS_GEMM_DEFAULT);
  };
  cudaEvent_t e0, e1;
  if (cudaEventCreate(&e0) != cudaSuccess) return gp_error("%s: cudaEventCreate failed", op);
  if (cudaEventCreate(&e1) != cudaSuccess) {
    cudaEventDestroy(e0);
    return gp_error("%s: cudaEventCreate failed", op);
  }
  std::vector<float> t;
  int rc = GP_OK;
  cudaStream_t st = gp_cuda_stream();
  for (int i = 0; i < iters + 3 && rc == GP_OK; i++) { /* 3 warm-up calls */
    cudaEventRecord(e0, st);
    cublasStatus_t s = call();
    cudaEventRecord(e1, st);
    float x = 0;
    cudaError_t e = cudaEventSynchronize(e1);
    if (e == cudaSuccess) e = cudaEventElapsedTime(&x, e0, e1);
    if (s != CUBLAS_STATUS_SUCCESS) rc = mm_fail(op, batch == 1 ? "cublasGemmEx" : "cublasGemmStridedBatchedEx", s, out, a, b);
    else if (e != cudaSuccess) rc = gp_error("%s: %s", op, cudaGetErrorString(e));
    else if (i >= 3) t.push_back(x);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (rc != GP_OK) return rc;
  std::sort(t.begin(), t.end());
  size_t n = t.size();
  *ms = n % 2 ? t[n / 2] : 0.5 * ((double)t[n / 2 - 1] + t[n / 2]);
  return GP_OK;
}
