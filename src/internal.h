/* internal.h: what the C host and the kernels share but Lua never sees. */
#ifndef GP_INTERNAL_H
#define GP_INTERNAL_H

#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "gpush.h"

#ifdef __cplusplus
extern "C" {
#endif

struct gp_storage {
  void *ptr;
  size_t nbytes;       /* bytes asked for */
  size_t alloc_bytes;  /* bytes held (size class) */
  int device;
  int refcount;
};

/* ---- errors: every failure sets a message and returns a status ---- */
int gp_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int gp_error_oom(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* dlopen(path, RTLD_NOW | RTLD_LOCAL); on failure dlerror()'s message is appended
 * to why (n bytes, "; " between messages) and NULL returned */
void *gp_dlopen_noting(const char *path, char *why, size_t n);
/* "(4,7)" into buf; returns buf */
const char *gp_shape_str(const gp_tensor *t, char *buf, size_t n);
const char *gp_dtype_name(int dtype); /* "f32"; "?" for no dtype */
/* the dtype whose name is s[0..n) (the name only, not the aliases); -1 if none */
int gp_dtype_find(const char *s, size_t n);
/* the names of the dtypes for which pred holds (every dtype: pred NULL), "f32, bf16, ..." into buf; returns buf */
const char *gp_dtype_list(char *buf, size_t n, int (*pred)(int dtype));
const char *gp_device_name(int device);
#define GP_SHAPE(t) gp_shape_str((t), (char[96]){0}, 96)
#define GP_TRY(x)                 \
  do {                            \
    int gp_rc_ = (x);             \
    if (gp_rc_ != GP_OK) return gp_rc_; \
  } while (0)

/* ---- Ctrl-C: long CPU kernels poll between blocks of work (gp_interrupt) ---- */
extern volatile sig_atomic_t gp_interrupt_flag;
/* clears the request and sets "op: interrupted"; returns GP_ERR */
int gp_interrupted(const char *op);
/* return "op: interrupted" from the calling function when Ctrl-C was pressed */
#define GP_POLL_INTERRUPT(op)                              \
  do {                                                     \
    if (gp_interrupt_flag) return gp_interrupted(op);      \
  } while (0)

/* ---- memory ---- */
int gp_alloc(void **ptr, size_t *alloc_bytes, size_t nbytes, int device);
void gp_free(void *ptr, size_t alloc_bytes, int device);
/* A scratch tensor owned by the caller (freed with gp_tensor_free). */
int gp_tensor_scratch(gp_tensor **out, int dtype, int device, int ndim, const int64_t *shape);

/* ---- replacing files atomically (atomic.c) ----
 * open: a new file that will replace path (no_tmpfile: always the mkstemp
 * way, for tests); write; commit: fsync, rename over path, fsync the
 * directory; abort: remove it. After commit or abort, a holds nothing; on an
 * error, commit has aborted. op names the caller in messages. */
typedef struct gp_afile {
  int fd, named;
  char *dir, *tmp, *path;
} gp_afile;
int gp_afile_open(gp_afile *a, const char *path, const char *op, int no_tmpfile);
int gp_afile_write(gp_afile *a, const void *buf, size_t n, const char *op);
int gp_afile_commit(gp_afile *a, const char *op);
void gp_afile_abort(gp_afile *a);

/* ---- geometry helpers ---- */
/* the columns of GP_DTYPES (gpush.h); 0 for no dtype */
#define GP_DTYPE_COLUMN_(col)                                                                           \
  switch (dt) {                                                                                         \
    GP_DTYPES(GP_DTYPE_CASE_##col)                                                                      \
    default: return 0;                                                                                  \
  }
#define GP_DTYPE_CASE_is_float(E, v, name, size, is_float, is_int, cpu_only, aliases) case GP_##E: return is_float;
#define GP_DTYPE_CASE_is_int(E, v, name, size, is_float, is_int, cpu_only, aliases) case GP_##E: return is_int;
#define GP_DTYPE_CASE_cpu_only(E, v, name, size, is_float, is_int, cpu_only, aliases) case GP_##E: return cpu_only;
static inline int gp_is_float(int dt) { GP_DTYPE_COLUMN_(is_float) }
static inline int gp_is_int(int dt) { GP_DTYPE_COLUMN_(is_int) }
static inline int gp_dtype_cpu_only(int dt) { GP_DTYPE_COLUMN_(cpu_only) }
#undef GP_DTYPE_COLUMN_
#undef GP_DTYPE_CASE_is_float
#undef GP_DTYPE_CASE_is_int
#undef GP_DTYPE_CASE_cpu_only
/* the address of the first element; NULL for a tensor whose storage holds no
 * bytes (arithmetic on a null pointer is undefined even with offset 0) */
static inline void *gp_ptr(const gp_tensor *t) {
  return t->data ? t->data + t->offset * (int64_t)gp_elsize(t->dtype) : NULL;
}
int gp_same_shape(const gp_tensor *a, const gp_tensor *b);
/* strides that broadcast src to (ndim, shape) (0 on broadcast dims); GP_ERR if impossible */
int gp_broadcast_strides(int64_t *stride, const gp_tensor *src, int ndim, const int64_t *shape);

/* A loop over up to 4 operands sharing one shape (after broadcasting), with
 * adjacent dims merged where every operand allows it. */
typedef struct gp_loop {
  int ndim;
  int nops;
  int64_t numel;
  int64_t shape[GP_MAX_DIMS];
  int64_t stride[4][GP_MAX_DIMS];
} gp_loop;
/* ops[0] is the output and defines the shape; the others broadcast to it. */
int gp_loop_init(gp_loop *L, const char *op, int nops, const gp_tensor *const *ops);
/* all operands dense in the same order (every stride run is the contiguous one) */
int gp_loop_is_flat(const gp_loop *L);

/* an error (naming op) unless a tensor may have this shape: at most
 * GP_MAX_DIMS sizes >= 0 whose non-zero product stays below 2^59 */
int gp_check_shape(const char *op, int ndim, const int64_t *shape);
/* 1 when two indices of t reach one element (a write through t is ambiguous) */
int gp_overlaps_itself(const gp_tensor *t);

/* ---- argument specs (kernels/README.md) ---- */
#define GP_CHECK_MAX 24 /* tensors a kernel spec may name */
int gp_check(const char *op, const char *spec, int n, const gp_tensor *const *ts);
/* kernel ids, in registry order, and the registry itself */
enum {
#define GP_KERNEL(family, name, params, spec, doc) GP_KID_##name,
#include "../kernels/kernels.def"
#undef GP_KERNEL
  GP_NKERNELS
};
extern const gp_kernel_info gp_kernel_table[];
/* check the tensor arguments of kernel NAME against its registry spec */
#define GP_CHECK(name, ...)                                                              \
  do {                                                                                   \
    const gp_tensor *gp_ts_[] = {__VA_ARGS__};                                           \
    GP_TRY(gp_check(#name, gp_kernel_table[GP_KID_##name].spec,                          \
                    (int)(sizeof gp_ts_ / sizeof gp_ts_[0]), gp_ts_));                   \
  } while (0)

/* ---- half precision on the host ---- */
static inline float gp_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t gp_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}
float gp_f16_to_f32(uint16_t h);
uint16_t gp_f32_to_f16(float f);

/* read element i (at an element offset) of a host buffer of any dtype as double, and write */
static inline double gp_load(const void *p, int dt, int64_t i) {
  switch (dt) {
    case GP_F32: return ((const float *)p)[i];
    case GP_BF16: return gp_bf16_to_f32(((const uint16_t *)p)[i]);
    case GP_F16: return gp_f16_to_f32(((const uint16_t *)p)[i]);
    case GP_I32: return ((const int32_t *)p)[i];
    case GP_I64: return (double)((const int64_t *)p)[i];
    case GP_F64: return ((const double *)p)[i];
    default: return ((const uint8_t *)p)[i];
  }
}
static inline int64_t gp_load_i64(const void *p, int dt, int64_t i) {
  switch (dt) {
    case GP_I32: return ((const int32_t *)p)[i];
    case GP_I64: return ((const int64_t *)p)[i];
    case GP_U8: return ((const uint8_t *)p)[i];
    default: return (int64_t)gp_load(p, dt, i);
  }
}
/* double -> integer the way C casts do, but never undefined: NaN -> 0, saturating
 * (the kernels call it too: gp.k.arange stores its values as gp_store does) */
#ifdef __CUDACC__
__host__ __device__
#endif
static inline int64_t gp_d2i(double v, int64_t lo, int64_t hi) {
  if (!(v == v)) return 0;
  if (v <= (double)lo) return lo;
  if (v >= (double)hi) return hi;
  return (int64_t)v;
}
static inline void gp_store(void *p, int dt, int64_t i, double v) {
  switch (dt) {
    case GP_F32: ((float *)p)[i] = (float)v; break;
    case GP_BF16: ((uint16_t *)p)[i] = gp_f32_to_bf16((float)v); break;
    case GP_F16: ((uint16_t *)p)[i] = gp_f32_to_f16((float)v); break;
    case GP_I32: ((int32_t *)p)[i] = (int32_t)gp_d2i(v, INT32_MIN, INT32_MAX); break;
    case GP_I64: ((int64_t *)p)[i] = gp_d2i(v, INT64_MIN, INT64_MAX); break;
    case GP_F64: ((double *)p)[i] = v; break;
    default: ((uint8_t *)p)[i] = (uint8_t)gp_d2i(v, 0, 255); break;
  }
}
static inline void gp_store_i64(void *p, int dt, int64_t i, int64_t v) {
  switch (dt) {
    case GP_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case GP_I64: ((int64_t *)p)[i] = v; break;
    case GP_U8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    default: gp_store(p, dt, i, (double)v); break;
  }
}

/* ---- random ---- */
/* Reserve n counter values of the generator; returns the offset to use. */
uint64_t gp_rng_reserve(uint64_t n);

/* Send a kernel call to its CUDA launcher when the tensor is on the GPU. */
#if GP_HAVE_CUDA
#define GP_CUDA_DISPATCH(t, call) \
  if ((t)->device == GP_CUDA) return (gp_pdl_op(), (call))
#else
#define GP_CUDA_DISPATCH(t, call) (void)0
#endif

/* ---- CUDA backend (src/cuda.cu); only called when gp_cuda_compiled() ---- */
int gp_cuda_init(void);
int gp_cuda_malloc(void **p, size_t n);
void gp_cuda_free(void *p);
int gp_cuda_memcpy(void *dst, const void *src, size_t n, int kind); /* 1 H2D, 2 D2H, 3 D2D */
int gp_cuda_sync(const char *op);
int gp_cuda_check_launch(const char *op);
int gp_cuda_runtime_info(char *buf, int n);
int gp_cuda_event_create(void **ev);
void gp_cuda_event_destroy(void *ev);
int gp_cuda_event_record(void *ev);
int gp_cuda_event_elapsed(float *ms, void *a, void *b);
int gp_cuda_event_record_on(void *ev, void *stream);
int gp_cuda_event_wait(void *stream, void *ev);
int gp_cuda_event_sync(void *ev, int query); /* 1 done, 0 pending (query), -GP_ERR on error */
int gp_cuda_device_sync(const char *op);     /* every stream; releases the allocator's pending blocks */
int gp_cuda_streams_used(void);              /* a user stream was current since the last device sync */
void gp_cuda_shutdown(void);                 /* gp_shutdown's CUDA part */
/* CUDA launchers note the kernel they launch (for gp.profile's registers and
 * occupancy): GP_NOTE_LAUNCH(k_name<T>, block, shared_bytes) before <<<>>>. */
void gp_cuda_note_launch(const void *fn, int block, int smem);
/* chains of programmatic dependent launches (cuda_internal.h): an op begins
 * (GP_CUDA_DISPATCH), other work went onto the stream (a copy, an event, a
 * collective, a graph) */
void gp_pdl_op(void);
void gp_pdl_break(void);
#define GP_NOTE_LAUNCH(fn, block, smem) gp_cuda_note_launch((const void *)(fn), (block), (smem))
/* alloc.c: blocks freed while streams were in use become reusable */
void gp_alloc_release_pending(void);

/* ---- CUDA graphs (src/cuda.cu, gp.graph) ---- */
/* under capture: reserve n draws relative to the graph's base, return 1; else 0 */
int gp_cuda_capture_rng(uint64_t *rel, uint64_t n);
int gp_cuda_capturing(void);
/* alloc.c: a graph-private pool. While a pool is current (during capture),
 * allocations come from it (or from the shared cache, adopted) and every
 * block freed joins it; its blocks are never handed to other allocations
 * until gp_pool_release (the graph is freed). */
typedef struct gp_pool gp_pool;
gp_pool *gp_pool_new(void);
void gp_pool_set_current(gp_pool *p); /* NULL: the shared cache */
void gp_pool_release(gp_pool *p);

#ifdef __cplusplus
}
#endif

#endif
