/* gpush.h: the one C ABI of gpush.
 *
 * Everything the Lua side may call is declared here. The build runs this file
 * through the C preprocessor with GP_CDEF defined and embeds the result in the
 * binary; lua/gpush/ffi.lua hands it to ffi.cdef. So this header is the single
 * source of truth for struct layouts and signatures: keep the part between the
 * FFI markers free of anything LuaJIT's C parser cannot read (no macros that
 * survive preprocessing, no inline functions, no system includes).
 *
 * Conventions: outputs first, then inputs, then scalars. Every entry returns a
 * status (GP_OK, GP_ERR, GP_ERR_OOM); the message is read with gp_last_error().
 * Dims and starts are 0-based here; the Lua layer converts from 1-based.
 */
#ifndef GPUSH_H
#define GPUSH_H

#ifndef GP_CDEF
#include <stddef.h>
#include <stdint.h>
#endif

#define GP_MAX_DIMS 8

#if defined(__cplusplus) && !defined(GP_CDEF)
extern "C" {
#endif

/* ---- FFI begin ---- */

/* Every dtype, once: X(ENUM, value, name, element size, is_float, is_int,
 * cpu_only, the other accepted spellings separated by spaces). The enum below,
 * the table that gp_dtype_get reads (src/dtype.c), gp_elsize, gp_is_float and
 * gp_is_int all come from it; the Lua side builds its tables from
 * gp_dtype_get. Values are the table's order (0, 1, ...). f64 lives on the CPU
 * only: it is for gradient checks and references. bf16 is stored as uint16_t. */
#define GP_DTYPES(X)                                  \
  X(F32, 0, "f32", 4, 1, 0, 0, "float float32")       \
  X(BF16, 1, "bf16", 2, 1, 0, 0, "bfloat16")          \
  X(F16, 2, "f16", 2, 1, 0, 0, "half float16")        \
  X(I32, 3, "i32", 4, 0, 1, 0, "int int32")           \
  X(I64, 4, "i64", 8, 0, 1, 0, "long int64")          \
  X(U8, 5, "u8", 1, 0, 1, 0, "bool uint8 byte")       \
  X(F64, 6, "f64", 8, 1, 0, 1, "double float64")
#define GP_DTYPE_ENUM_(E, value, ...) GP_##E = value,
enum { GP_DTYPES(GP_DTYPE_ENUM_) GP_NDTYPES };
#undef GP_DTYPE_ENUM_
enum { GP_CPU = 0, GP_CUDA = 1 };
enum { GP_OK = 0, GP_ERR = 1, GP_ERR_OOM = 2 };

typedef struct gp_storage gp_storage;

/* A tensor: a strided view of a refcounted storage. Element (i0, i1, ...) is at
 * data + (offset + sum_k i_k * stride[k]) * elsize. Strides are in elements. */
typedef struct gp_tensor {
  gp_storage *storage;
  char *data;            /* base of the storage (host or device pointer) */
  int64_t offset;        /* in elements */
  int32_t dtype;         /* GP_F32 ... */
  int32_t device;        /* GP_CPU or GP_CUDA */
  int32_t ndim;
  int32_t reserved;
  int64_t shape[GP_MAX_DIMS];
  int64_t stride[GP_MAX_DIMS];
} gp_tensor;

typedef struct gp_memstats {
  int64_t in_use;          /* device bytes held by live tensors (rounded to size classes) */
  int64_t reserved;        /* device bytes obtained from cudaMalloc and not yet freed */
  int64_t peak;            /* high-water mark of in_use */
  int64_t allocs;          /* device allocations asked for */
  int64_t cache_hits;      /* ... of which were served from the cache */
  int64_t device_mallocs;  /* cudaMalloc calls */
  int64_t frees;
  int64_t oom;             /* allocations refused */
  int64_t cached_blocks;   /* blocks sitting in the cache */
  int64_t limit;           /* soft limit on reserved bytes (0: none) */
  int64_t host_in_use;     /* the same for host tensors */
  int64_t host_peak;
  int64_t host_allocs;
  int64_t pending_blocks;  /* freed while user streams ran: reused after the next device-wide sync */
  int64_t pending_bytes;
  int64_t largest_cached;  /* the largest block sitting in the cache */
} gp_memstats;

/* ---- errors, versions, devices ---- */
const char *gp_last_error(void);
/* Ctrl-C: gp_interrupt() (async-signal-safe; the prompt's SIGINT handler
 * calls it) asks the running CPU kernel to stop: long kernels poll between
 * blocks of work and fail with "NAME: interrupted", which clears the request.
 * gp_interrupt_clear() drops a request no kernel has seen. */
void gp_interrupt(void);
int gp_interrupt_pending(void);
void gp_interrupt_clear(void);
const char *gp_version(void);
int gp_cuda_available(void);      /* 1 when a CUDA device is usable */
int gp_cuda_compiled(void);       /* 1 when built with the CUDA backend */
int gp_runtime_info(char *buf, int n);  /* CUDA runtime, driver and GPU, one line */
int gp_sync(void);

/* ---- dtypes: the GP_DTYPES table, for the Lua side's dtype tables ---- */
typedef struct gp_dtype_info {
  const char *name;     /* "f32": the name gpush prints */
  const char *aliases;  /* the other accepted spellings, separated by spaces ("float float32"); "" if none */
  int size;             /* bytes an element */
  int is_float;
  int is_int;
  int cpu_only;         /* tensors of this dtype live on the CPU only */
} gp_dtype_info;
int gp_dtype_count(void);                 /* GP_NDTYPES */
const gp_dtype_info *gp_dtype_get(int i); /* dtype i (0 .. count - 1: GP_F32 ...); NULL outside */

/* ---- tensors ---- */
int gp_tensor_empty(gp_tensor **out, int dtype, int device, int ndim, const int64_t *shape);
int gp_tensor_alias(gp_tensor **out, const gp_tensor *src);  /* same storage and geometry */
void gp_tensor_free(gp_tensor *t);
int64_t gp_numel(const gp_tensor *t);
int gp_is_contiguous(const gp_tensor *t);
int gp_elsize(int dtype);
int64_t gp_storage_numel(const gp_tensor *t);
int gp_same_storage(const gp_tensor *a, const gp_tensor *b);

/* Views: out must be an alias of src (gp_tensor_alias); its geometry is set. */
int gp_view(gp_tensor *out, const gp_tensor *src, int ndim, const int64_t *shape);
int gp_transpose(gp_tensor *out, const gp_tensor *src, int d0, int d1);
int gp_permute(gp_tensor *out, const gp_tensor *src, int ndim, const int *perm);
int gp_narrow(gp_tensor *out, const gp_tensor *src, int dim, int64_t start, int64_t length);
int gp_expand(gp_tensor *out, const gp_tensor *src, int ndim, const int64_t *shape);
int gp_as_strided(gp_tensor *out, const gp_tensor *src, int ndim, const int64_t *shape,
                  const int64_t *stride, int64_t offset);

/* Copy between devices: same dtype and shape, both contiguous. */
int gp_transfer(gp_tensor *out, const gp_tensor *src);
/* Host values into a contiguous tensor on any device (n elements, converted from double). */
int gp_from_doubles(gp_tensor *out, const double *src, int64_t n);
/* A contiguous tensor on any device into host doubles. */
int gp_to_doubles(double *out, const gp_tensor *src, int64_t n);

/* ---- random: one counter-based generator (Philox4x32-10) per process ---- */
void gp_manual_seed(uint64_t seed);
uint64_t gp_seed(void);
uint64_t gp_rng_offset(void);
/* the whole state (seed and counter offset), as gp_seed and gp_rng_offset read it:
 * a resumed run draws the numbers the interrupted one would have drawn next */
void gp_set_rng_state(uint64_t seed, uint64_t offset);

/* ---- timing: events on the stream (CUDA events on the GPU, a host clock on the CPU) ---- */
typedef struct gp_event gp_event;
int gp_event_create(gp_event **out);
void gp_event_destroy(gp_event *e);
int gp_event_record(gp_event *e, int device);            /* queue a timestamp */
int gp_event_elapsed(double *ms, gp_event *a, gp_event *b); /* waits for b */
double gp_wall_ms(void);                                  /* host monotonic clock */

/* ---- streams (CUDA; opaque cudaStream_t handles, NULL = gpush's default stream) ---- */
int gp_stream_create(void **out);              /* a non-blocking stream */
int gp_stream_destroy(void *s);
int gp_stream_set_current(void *s);            /* kernels are queued on the current stream */
void *gp_stream_current(void);
int gp_stream_synchronize(void *s);
int gp_stream_query(void *s);                  /* 1 when all its work is done */
int gp_event_record_stream(gp_event *e, void *s);
int gp_event_wait(void *s, gp_event *e);      /* work queued on s after this waits for e */
int gp_event_synchronize(gp_event *e);
int gp_event_query(gp_event *e);               /* 1 done, 0 pending, -1 error */
int gp_device_sync(void);                      /* every stream */

/* ---- CUDA graphs (gp.graph): capture the current stream, replay ----
 * gp_graph_begin starts capturing gpush's current stream (allocations come
 * from a graph-private pool of the caching allocator); gp_graph_end(g, ok)
 * ends it and instantiates the graph (ok = 0, or any failure: the capture is
 * dropped and g freed). gp_graph_replay launches it on the current stream;
 * gp_graph_free releases it and its pool. */
typedef struct gp_graph gp_graph;
int gp_graph_begin(gp_graph **out);
int gp_graph_end(gp_graph *g, int ok);
int gp_graph_replay(gp_graph *g);
void gp_graph_free(gp_graph *g);

/* ---- chains of dependent launches (gp.pdl): the decode step's kernels
 * (add_rms_norm, rows_linear, swiglu_linear, rope_kv_at, attn_decode, the
 * NF4 GEMV on tensor cores) start while the kernel before them finishes
 * (programmatic dependent launch, compute capability 9.0). gp_pdl_option(value, old): 1 on (the default on
 * such GPUs unless GPUSH_PDL=0), 0 off, -1 only reads; old may be NULL.
 * Stats: launches that overlapped the kernel before them (chained) and chain
 * kernels launched the usual way (plain: the first of a chain, or weights a
 * kernel of the chain wrote); clear zeroes them after reading. */
typedef struct gp_pdl_stats {
  int64_t chained, plain;
  int on, supported;
} gp_pdl_stats;
int gp_pdl_option(int value, int *old);
int gp_pdl_get_stats(gp_pdl_stats *out, int clear);

/* ---- profiling: what the last CUDA launch ran (launchers note it) ---- */
typedef struct gp_launch_info {
  const void *fn;       /* NULL when no launch was noted since the last call */
  int block;            /* threads per block */
  int regs;             /* registers per thread */
  int blocks_per_sm;    /* resident blocks per SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor) */
  double occupancy;     /* theoretical: blocks_per_sm * block / max threads per SM */
} gp_launch_info;
int gp_last_launch(gp_launch_info *out);

/* ---- kernel traces (gp.trace): CUPTI's activity records (libcupti, loaded
 * at run time) of every kernel, memset and memcpy the GPU ran between start
 * and stop, with the GPU's timestamps: library kernels and CUDA graph nodes
 * included. gp_trace_stop waits for the device, flushes and gives the count;
 * the records stay readable until the next start. */
typedef struct gp_trace_rec {
  uint64_t start, end; /* ns, the GPU's clock */
  uint64_t bytes;      /* memset / memcpy */
  uint32_t graph;      /* the CUDA graph a node of which it was (0: none) */
  uint32_t stream;
  int32_t kind;        /* 0 kernel, 1 memset, 2 memcpy */
  int32_t grid, block; /* blocks, threads a block */
  int32_t regs;        /* registers a thread */
  const char *name;    /* demangled, without the parameter list; owned by gpush */
} gp_trace_rec;
int gp_trace_start(void);
int gp_trace_stop(int64_t *count);
int gp_trace_get(int64_t i, gp_trace_rec *out);

/* ---- run-time compiled kernels (NVRTC) ---- */
/* Compile CUDA C for arch (e.g. "sm_90"; NULL: the current GPU's) into a cubin;
 * *lowered is the kernel's symbol (mangled unless extern "C"). The compiler's
 * log (errors, warnings) is in *log. Free *code, *lowered, *log with gp_rtc_free. */
int gp_rtc_compile(char **code, size_t *ncode, char **lowered, char **log, const char *src, const char *name,
                   const char *arch, int nopts, const char **opts);
int gp_rtc_load(void **lib, void **kernel, const void *code, size_t ncode, const char *name);
void gp_rtc_unload(void *lib);
int gp_rtc_launch(void *kernel, const unsigned *grid, const unsigned *block, unsigned shared, void **args);
void gp_rtc_free(void *p);
int gp_rtc_arch(char *buf, int n);             /* "sm_90" for the current GPU */
int gp_rtc_version(int *major, int *minor);    /* NVRTC version; GP_ERR without NVRTC */

/* ---- memory ---- */
int gp_memory_stats(gp_memstats *out);
int gp_empty_cache(void);
/* at exit, after the last tensor is freed: every cached block, cuBLAS's handles and
 * workspaces and the stream back to the driver (a leak checker then sees none); the
 * CUDA backend is unusable afterwards */
void gp_shutdown(void);
int gp_set_memory_limit(int64_t bytes);  /* soft cap on reserved device bytes (and host in-use); 0 = none */
void gp_reset_peak_memory(void);         /* peak = in_use and host_peak = host_in_use: high-water marks from now */

/* ---- safetensors files (src/safetensors.c); tensors read and written on the cpu ---- */
typedef struct gp_st gp_st;
int gp_st_open(gp_st **out, const char *path);   /* parses and checks the whole header */
void gp_st_close(gp_st *st);
int gp_st_count(const gp_st *st);
int gp_st_info(const gp_st *st, int i, const char **name, int *dtype, int *ndim, int64_t *shape);
int gp_st_read(gp_st *st, int i, gp_tensor *out);  /* out: contiguous cpu tensor of that dtype and size */
int gp_st_meta_count(const gp_st *st);
int gp_st_meta(const gp_st *st, int i, const char **key, const char **value);
int gp_st_save(const char *path, int n, const char *const *names, const gp_tensor *const *ts, int nmeta,
               const char *const *keys, const char *const *values);

/* ---- GGUF files (src/gguf.c): llama.cpp's format, versions 2 and 3 ----
 * gp_gguf_open maps the file and checks its whole header (every length,
 * count, type, size and tensor extent) before returning; tensor data is read
 * only by gp_gguf_read. Metadata entries and tensors are numbered from 0 in
 * file order. Value types (gp_gguf_meta_type): 0 u8, 1 i8, 2 u16, 3 i16,
 * 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64.
 * Strings point into the mapping, are not NUL-terminated and live until
 * gp_gguf_close. Tensor dims are in ggml order: dims[0] (ne0) varies
 * fastest, so PyTorch's shape is the reverse. */
typedef struct gp_gguf gp_gguf;
int gp_gguf_open(gp_gguf **out, const char *path);
void gp_gguf_close(gp_gguf *g);
int gp_gguf_version(const gp_gguf *g);         /* 2 or 3 */
int64_t gp_gguf_alignment(const gp_gguf *g);   /* general.alignment, default 32 */
int64_t gp_gguf_data_offset(const gp_gguf *g); /* file offset of the data section */
int64_t gp_gguf_file_size(const gp_gguf *g);
int64_t gp_gguf_meta_count(const gp_gguf *g);
int64_t gp_gguf_meta_find(const gp_gguf *g, const char *key);  /* the entry's index, -1 if absent */
int gp_gguf_meta_key(const char **key, int64_t *len, const gp_gguf *g, int64_t i);
/* type; elem_type: an array's element type (else = type); n: an array's length (else 1) */
int gp_gguf_meta_type(int *type, int *elem_type, int64_t *n, const gp_gguf *g, int64_t i);
/* a number or bool (j = 0), or element j of an array of them, as a double (u64, i64 rounded) */
int gp_gguf_meta_number(double *v, const gp_gguf *g, int64_t i, int64_t j);
/* the same for integers and bools, exactly (a u64 as its bits) */
int gp_gguf_meta_int(int64_t *v, const gp_gguf *g, int64_t i, int64_t j);
/* elements start .. start + n - 1 of an array of numbers or bools */
int gp_gguf_meta_numbers(double *out, const gp_gguf *g, int64_t i, int64_t start, int64_t n);
/* a string (j = 0), or element j of an array of strings: *s, *len bytes */
int gp_gguf_meta_string(const char **s, int64_t *len, const gp_gguf *g, int64_t i, int64_t j);
int64_t gp_gguf_tensor_count(const gp_gguf *g);
int64_t gp_gguf_tensor_find(const gp_gguf *g, const char *name);  /* index, -1 if absent */
/* any output may be NULL; dims: 4 entries (1 past ndim); offset: in the file; nbytes of its data */
int gp_gguf_tensor_info(const char **name, int *type, int *ndim, int64_t *dims, int64_t *offset, int64_t *nbytes,
                        const gp_gguf *g, int64_t i);
/* the raw bytes of tensor i into out: contiguous, on the cpu or cuda, either u8 of exactly nbytes
 * elements or (F32, F16, BF16, I32, I64, F64) the matching dtype with the tensor's element count */
int gp_gguf_read(gp_gguf *g, int64_t i, gp_tensor *out);
const char *gp_gguf_type_name(int type);       /* "Q4_1"; NULL for an unknown ggml type */
int gp_gguf_type_size(int *block, int *bytes, int type);  /* elements and bytes a block */

/* ---- multi-tensor lists: one launch over many tensors (optimizers) ----
 * A list holds `groups` groups of n tensors each (group-major: ts[g * n + i]),
 * tensor i of every group having the same number of elements, each group one
 * dtype, all contiguous on one device. The tensors must outlive the list. */
typedef struct gp_tlist gp_tlist;
int gp_tlist_create(gp_tlist **out, int groups, int n, const gp_tensor *const *ts);
void gp_tlist_free(gp_tlist *l);
/* groups p (f32), m, v (f32), g (any float) and optionally a fifth, low:
 * bf16 or f16 tensors into which each updated p is stored rounded to nearest
 * even (what gp_k_copy gives: the low-precision parameters of f32 masters).
 * gscale f32[1] or NULL. hyper:
 * NULL, or an f32[3] tensor on the list's device holding {lr, 1 - beta1^step,
 * 1 - beta2^step} that the kernel reads instead of lr and step (so a captured
 * CUDA graph can replay the step with a new learning rate and count) */
int gp_multi_adamw(gp_tlist *l, const gp_tensor *gscale, const gp_tensor *hyper, double lr, double beta1, double beta2,
                   double eps, double weight_decay, double step);
/* groups p (f32), buf (f32), g and optionally low (bf16 or f16, as for
 * gp_multi_adamw); hyper NULL or f32[1] {lr} on the list's device */
int gp_multi_sgd(gp_tlist *l, const gp_tensor *gscale, const gp_tensor *hyper, double lr, double momentum,
                 double weight_decay, double nesterov);
/* out f32[1] = sum of squares of every tensor of group 0 */
int gp_multi_sumsq(gp_tensor *out, gp_tlist *l);

/* ---- the Llama decode step as one kernel (kernels/decode_step.c, .cu) ----
 * A plan over L layers, each 8 tensors in this order (bf16, contiguous, one
 * device): wqkv (Nq, d) the fused q/k/v projection (Nq = (H + 2 J) hd), wo
 * (d, H hd), wgu (2 I, d) the fused gate/up projection, wdown (d, I), ln1 and
 * ln2 (d) the two RMSNorm weights, kc and vc (B, J, C, hd) the layer's
 * caches; norm (d) the final RMSNorm's weight. Head dim 64 or 128, 1 to 8
 * rows. The tensors must outlive the plan; on the GPU the plan holds its
 * pointers and scratch (one step at a time per plan). run: one token a row,
 * x (B, d) the embeddings, out (B, d) the final norm's output; the new key
 * (turned by RoPE with inv_freq f32 (hd / 2)) and value written at the
 * position pos (i64 or i32 [1], on the device), row b attending over its
 * first lens[b] positions (i64 (B)) with softmax scale `scale`. */
typedef struct gp_decode_plan gp_decode_plan;
int gp_decode_plan_create(gp_decode_plan **out, int L, const gp_tensor *const *ts, const gp_tensor *norm, double eps);
void gp_decode_plan_free(gp_decode_plan *p);
int gp_decode_plan_run(gp_decode_plan *p, gp_tensor *out, const gp_tensor *x, const gp_tensor *pos,
                       const gp_tensor *lens, const gp_tensor *inv_freq, double scale);

/* ---- matrix products (kernels/matmul.c) ---- */
/* Options, each 0 or 1: "tf32" (1: f32 GEMMs may use TF32 tensor cores;
 * default 0), "gemv" (how a product with m == 1 or n == 1 runs: 0 GEMM, the
 * default, 1 cuBLAS gemv), "lt" (1, the default: bias/GELU epilogues through
 * cuBLASLt; 0: a GEMM and an epilogue kernel) and "tune" (1: cuBLASLt
 * algorithms chosen by timing the candidates once per shape and cached
 * process-wide, kernels/matmul.cu; default 0, or 1 when GPUSH_MATMUL_TUNE=1 is
 * in the environment). value -1 only reads; other values are an error. *old
 * (may be NULL) gets the previous. */
int gp_matmul_option(const char *name, int value, int *old);
/* the algorithm cache of option "tune": entries held; products that found
 * their entry (hits) or tuned and stored one (misses); misses during a CUDA
 * graph capture, run untuned and not stored (uncached); host ms spent tuning */
typedef struct gp_matmul_tunestats {
  int64_t entries, hits, misses, uncached;
  double tuned_ms;
} gp_matmul_tunestats;
int gp_matmul_tune_stats(gp_matmul_tunestats *out);
/* empty the cache and zero its counters */
int gp_matmul_tune_clear(void);
/* cuBLAS called directly, without gpush's dispatch: the median ms of `iters`
 * calls of out = a @ b (cublasGemmEx or cublasGemmStridedBatchedEx), each
 * timed with CUDA events. Contiguous 2-D or 3-D tensors on the GPU. */
int gp_bench_cublas_gemm(double *ms, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, int iters);

/* ---- attention: what the kernels take (kernels/attention.c) ----
 * kind "fwd", "bwd" or "decode" (gp_k_attn_fwd, _bwd, _decode): 1 when that
 * kernel takes q of this dtype and head dim (seq_k, the number of keys, does
 * not limit them). kind "flash": 1 when flash attention is the better path
 * for nn.attention at this head dim and key count (head dim 32 has no
 * tensor-core kernel, so its launches pay only up to 512 keys). 0 for an
 * unknown kind or a dtype that is not a float. */
int gp_attention_supported(const char *kind, int dtype, int head_dim, int64_t seq_k);
/* kind's head dims for messages, "32, 64, 128" ("flash": "32 (up to 512 keys), 64, 128"),
 * into buf (n bytes, truncated); returns buf ("" for an unknown kind) */
const char *gp_attention_head_dims(char *buf, int n, const char *kind);

/* ---- several processes (src/dist.c, src/launch.c): gp.dist ----
 * NCCL is loaded at run time (dlopen), never linked. Collectives dispatch on
 * the tensor's device: cuda tensors through NCCL, queued on `stream` (NULL:
 * the current stream); cpu tensors over the TCP links of the rendezvous
 * (blocking). Tensors must be contiguous. The GPU of a process is chosen when
 * CUDA starts: $GPUSH_CUDA_DEVICE, else $LOCAL_RANK (when in range), else 0. */
enum { GP_DIST_TCP = 0, GP_DIST_NCCL = 1 };
enum { GP_RED_SUM = 0, GP_RED_PROD = 1, GP_RED_MAX = 2, GP_RED_MIN = 3, GP_RED_AVG = 4 };
int gp_cuda_device_count(void);       /* CUDA devices visible (0 without CUDA) */
int gp_cuda_current_device(void);     /* the one this process uses */
int gp_dist_nccl_load(int *version, char *path, int n);  /* NCCL's version code and file; GP_ERR says why not */
/* Rendezvous at addr:port (rank 0 listens; the others connect, retrying, and
 * receive a 128-byte id), then ncclCommInitRank for GP_DIST_NCCL. Every wait
 * ends after timeout_s seconds with an error naming the missing rank. */
int gp_dist_init(int backend, int rank, int world, const char *addr, int port, double timeout_s);
int gp_dist_finalize(void);
int gp_dist_info(int *backend, int *rank, int *world);   /* 1 when initialized */
int gp_dist_uid(uint8_t *out);                           /* the 128 bytes rank 0 handed out */
int gp_dist_allreduce(gp_tensor *t, int op, void *stream);              /* in place */
int gp_dist_broadcast(gp_tensor *t, int root, void *stream);            /* in place, from rank root */
int gp_dist_allgather(gp_tensor *out, const gp_tensor *in, void *stream);  /* out: world x in, rank order */
int gp_dist_reduce_scatter(gp_tensor *out, const gp_tensor *in, int op, void *stream); /* in: world x out */
int gp_dist_group(int start);                            /* ncclGroupStart (1) / ncclGroupEnd (0) */
int gp_dist_barrier(void);                               /* host-side: every rank reached it */
/* Run argv (argv[0] ignored: this gpush) as nproc processes with RANK,
 * WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set; output prefixed
 * "[rank] "; one failing stops the others. *exit_code: the launcher's status. */
int gp_dist_launch(int *exit_code, int nproc, int nnodes, int node_rank, const char *addr, int port, int argc,
                   const char *const *argv);

/* ---- kernel registry ---- */
typedef struct gp_kernel_info {
  const char *name;
  const char *family;
  const char *signature;  /* the C parameter list */
  const char *spec;       /* argument spec: see kernels/README.md */
  const char *doc;        /* one line */
} gp_kernel_info;
int gp_kernel_count(void);
const gp_kernel_info *gp_kernel_get(int i);

/* Every kernel: int gp_k_NAME(outputs..., inputs..., scalars...). */
#define GP_KERNEL(family, name, params, spec, doc) int gp_k_##name params;
#include "../kernels/kernels.def"
#undef GP_KERNEL

/* ---- FFI end ---- */

#if defined(__cplusplus) && !defined(GP_CDEF)
}
#endif

#endif
