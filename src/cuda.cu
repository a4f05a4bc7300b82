/* cuda.cu: the CUDA runtime side of the host: device discovery, the stream,
 * raw allocation and copies, error checks. */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_internal.h"

static int g_state = -1; /* -1 unknown, 0 unusable, 1 ready */
static char g_why[256];
static cudaStream_t g_stream;  /* gpush's own default stream */
static cudaStream_t g_cur;     /* the current stream: g_stream unless gp.with_stream set another */
static int g_sms = 80;
static int g_cc = 0;
static int g_streams_used;     /* a user stream was current since the last device-wide sync */
static int g_dev;              /* the device of this process (one per process under gpush --nproc) */
static int g_capturing;        /* a CUDA graph capture is under way on g_cur (gp.graph) */

/* ---- deferred index checks (kernels/bad_index.cuh) ----
 * One device flag [id, value]; ids name a descriptor (op, kind, size, what)
 * in a host table that only grows (the same descriptor keeps its id, so ids
 * baked into CUDA graphs stay valid). The flag is read at synchronization
 * points, when a launch armed it since the last read. */
#define NBAD 4096
static unsigned long long *g_bad; /* device [2] */
static int g_bad_armed;
static struct bad_desc {
  const char *op, *kind, *what;
  int64_t size;
} g_bad_tab[NBAD];
static int g_nbad;

static int bad_poll(const char *where);

extern "C" int gp_cuda_compiled(void) { return 1; }

/* One GPU per process: $GPUSH_CUDA_DEVICE (must exist), else $LOCAL_RANK
 * (set by gpush --nproc and other launchers; ignored when out of range: gp.dist
 * reports that), else device 0. Not CUDA_VISIBLE_DEVICES: NCCL needs every
 * GPU visible for CUDA IPC between the processes. */
static cudaError_t pick_device(int n) {
  const char *s = getenv("GPUSH_CUDA_DEVICE");
  int strict = s && *s;
  if (!strict) s = getenv("LOCAL_RANK");
  if (!s || !*s) return cudaSuccess;
  int d = atoi(s);
  if (d < 0 || d >= n) {
    if (!strict) return cudaSuccess;
    g_dev = d;
    return cudaErrorInvalidDevice;
  }
  g_dev = d;
  return cudaSetDevice(d);
}

extern "C" int gp_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

extern "C" int gp_cuda_current_device(void) { return g_dev; }

extern "C" int gp_cuda_init(void) {
  if (g_state < 0) {
    int n = 0, drv = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      /* say it plainly: the runtime calls a missing driver an "insufficient driver version" */
      if (cudaDriverGetVersion(&drv) != cudaSuccess || drv == 0)
        snprintf(g_why, sizeof g_why, "no CUDA driver is installed (no GPU can be used on this machine)");
      else if (e == cudaErrorNoDevice || n == 0)
        snprintf(g_why, sizeof g_why, "no CUDA GPU is visible (the driver sees none%s)",
                 getenv("CUDA_VISIBLE_DEVICES") ? "; CUDA_VISIBLE_DEVICES is set" : "");
      else
        snprintf(g_why, sizeof g_why, "no CUDA GPU is usable (%s)", cudaGetErrorString(e));
      cudaGetLastError();
      g_state = 0;
    } else if ((e = pick_device(n)) != cudaSuccess) {
      snprintf(g_why, sizeof g_why, "cannot use CUDA device %d of %d (%s)", g_dev, n, cudaGetErrorString(e));
      cudaGetLastError();
      g_state = 0;
    } else if ((e = cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking)) != cudaSuccess) {
      snprintf(g_why, sizeof g_why, "CUDA stream creation failed (%s)", cudaGetErrorString(e));
      g_state = 0;
    } else {
      cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, g_dev);
      int ma = 0, mi = 0;
      cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, g_dev);
      cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, g_dev);
      g_cc = ma * 10 + mi;
      g_cur = g_stream;
      if ((e = cudaMalloc((void **)&g_bad, 2 * sizeof *g_bad)) != cudaSuccess ||
          (e = cudaMemset(g_bad, 0, 2 * sizeof *g_bad)) != cudaSuccess) {
        snprintf(g_why, sizeof g_why, "CUDA allocation of the index flag failed (%s)", cudaGetErrorString(e));
        g_state = 0;
      } else {
        g_state = 1;
      }
    }
  }
  return g_state == 1 ? GP_OK : gp_error("%s", g_why);
}

/* every device resource the library holds, back to the driver (gp_shutdown):
 * cuBLAS's handles and workspaces, the index flag, the stream; CUDA is then
 * unusable in this process (a later call says so) */
extern "C" void gp_matmul_release(void); /* kernels/matmul.cu */
extern "C" void gp_cuda_shutdown(void) {
  if (g_state != 1) return;
  cudaDeviceSynchronize();
  gp_alloc_release_pending();
  gp_matmul_release();
  cudaFree(g_bad);
  g_bad = nullptr;
  cudaStreamDestroy(g_stream);
  g_stream = g_cur = nullptr;
  snprintf(g_why, sizeof g_why, "CUDA was shut down in this process (gp_shutdown)");
  g_state = 0;
}

/* Kernels are queued on the current stream. */
cudaStream_t gp_cuda_stream(void) { return g_cur; }
int gp_cuda_sm_count(void) { return g_sms; }
int gp_cuda_cc(void) { return g_cc; }

extern "C" int gp_cuda_malloc(void **p, size_t n) {
  GP_TRY(gp_cuda_init());
  cudaError_t e = cudaMalloc(p, n);
  if (e != cudaSuccess) {
    cudaGetLastError(); /* clear the non-sticky OOM error */
    *p = NULL;
    return GP_ERR_OOM;
  }
  return GP_OK;
}

extern "C" void gp_cuda_free(void *p) { cudaFree(p); }

static int no_sync_in_capture(const char *op) {
  return gp_error("%s: cannot wait for the GPU or copy between host and device while a CUDA graph is being captured "
                  "(gp.graph): host reads (item, totable, print), gp.sync, host-to-device tensors and synchronizing "
                  "calls must stay outside the captured function", op);
}

extern "C" int gp_cuda_memcpy(void *dst, const void *src, size_t n, int kind) {
  GP_TRY(gp_cuda_init());
  if (g_capturing && kind != 3) return no_sync_in_capture(kind == 2 ? "to (device to host)" : "to (host to device)");
  cudaMemcpyKind k = kind == 1 ? cudaMemcpyHostToDevice : kind == 2 ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
  gp_pdl_break();
  cudaError_t e = cudaMemcpyAsync(dst, src, n, k, g_cur);
  if (e == cudaSuccess && kind == 2) e = cudaStreamSynchronize(g_cur);
  if (e != cudaSuccess) return gp_error("to: copy of %zu bytes failed: %s", n, cudaGetErrorString(e));
  return kind == 2 ? bad_poll("to") : GP_OK;
}

extern "C" int gp_cuda_sync(const char *op) {
  if (g_state != 1) return GP_OK;
  if (g_capturing) return no_sync_in_capture(op);
  cudaError_t e = cudaStreamSynchronize(g_cur);
  if (e != cudaSuccess) return gp_error("%s: CUDA error: %s", op, cudaGetErrorString(e));
  return bad_poll(op);
}

/* Wait for every stream; blocks the allocator held back for multi-stream
 * safety become reusable. */
extern "C" int gp_cuda_device_sync(const char *op) {
  if (g_state != 1) return GP_OK;
  if (g_capturing) return no_sync_in_capture(op);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return gp_error("%s: CUDA error: %s", op, cudaGetErrorString(e));
  g_streams_used = g_cur != g_stream;
  gp_alloc_release_pending();
  return bad_poll(op);
}

/* ---- deferred index checks ---- */

int gp_cuda_bad_ref(gp_bad_ref *out, const char *op, const char *kind, int64_t size, const char *what) {
  out->flag = g_bad;
  out->id = NBAD + 1; /* the table is full: reported without the details */
  g_bad_armed = 1;
  unsigned h = (unsigned)((((uintptr_t)op >> 3) * 31u + ((uintptr_t)what >> 3) * 7u + (uint64_t)size * 2654435761u) % NBAD);
  for (int probe = 0; probe < NBAD; probe++, h = (h + 1) % NBAD) {
    bad_desc &d = g_bad_tab[h];
    if (!d.op) {
      d.op = op;
      d.kind = kind;
      d.what = what;
      d.size = size;
      g_nbad++;
      out->id = h + 1;
      break;
    }
    if (d.op == op && d.kind == kind && d.what == what && d.size == size) {
      out->id = h + 1;
      break;
    }
  }
  return g_bad ? GP_OK : gp_error("%s: the CUDA backend is not initialized", op);
}

/* after a synchronization: the first bad index recorded since the last read */
static int bad_poll(const char *where) {
  (void)where;
  if (!g_bad_armed || g_capturing || !g_bad) return GP_OK;
  g_bad_armed = 0;
  unsigned long long h[2] = {0, 0};
  /* the legacy stream does not wait for gpush's non-blocking streams */
  cudaError_t e = cudaMemcpy(h, g_bad, sizeof h, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return gp_error("%s: CUDA error reading the index flag: %s", where, cudaGetErrorString(e));
  if (!h[0]) return GP_OK;
  cudaMemset(g_bad, 0, sizeof h);
  if (h[0] >= 1 && h[0] <= NBAD && g_bad_tab[h[0] - 1].op) {
    const bad_desc &d = g_bad_tab[h[0] - 1];
    return gp_error("%s: %s %lld is out of range for %s of size %lld (on the GPU; nothing outside the tensors was "
                    "touched; reported at the next synchronization)",
                    d.op, d.kind, (long long)(int64_t)h[1], d.what, (long long)d.size);
  }
  return gp_error("an index op on the GPU: index %lld is out of range (reported at the next synchronization)",
                  (long long)(int64_t)h[1]);
}

extern "C" int gp_cuda_streams_used(void) { return g_streams_used || g_cur != g_stream; }

extern "C" int gp_cuda_check_launch(const char *op) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return gp_error("%s: CUDA launch failed: %s", op, cudaGetErrorString(e));
  return GP_OK;
}

extern "C" int gp_cuda_runtime_info(char *buf, int n) {
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  if (gp_cuda_init() != GP_OK) {
    if (drv == 0)
      snprintf(buf, (size_t)n, "CUDA runtime %d.%d, %s", rt / 1000, rt % 1000 / 10, g_why);
    else
      snprintf(buf, (size_t)n, "CUDA runtime %d.%d, driver %d.%d, %s", rt / 1000, rt % 1000 / 10, drv / 1000,
               drv % 1000 / 10, g_why);
    return GP_OK;
  }
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, g_dev);
  snprintf(buf, (size_t)n, "CUDA runtime %d.%d, driver %d.%d, GPU %s (sm_%d%d, %d SMs, %.1f GiB)", rt / 1000,
           rt % 1000 / 10, drv / 1000, drv % 1000 / 10, p.name, p.major, p.minor, p.multiProcessorCount,
           (double)p.totalGlobalMem / (1 << 30));
  return GP_OK;
}

extern "C" int gp_cuda_event_create(void **ev) {
  GP_TRY(gp_cuda_init());
  cudaError_t e = cudaEventCreate((cudaEvent_t *)ev);
  return e == cudaSuccess ? GP_OK : gp_error("event: %s", cudaGetErrorString(e));
}
extern "C" void gp_cuda_event_destroy(void *ev) { cudaEventDestroy((cudaEvent_t)ev); }
extern "C" int gp_cuda_event_record(void *ev) {
  gp_pdl_break();
  cudaError_t e = cudaEventRecord((cudaEvent_t)ev, g_cur);
  return e == cudaSuccess ? GP_OK : gp_error("event_record: %s", cudaGetErrorString(e));
}
extern "C" int gp_cuda_event_elapsed(float *ms, void *a, void *b) {
  if (g_capturing) return no_sync_in_capture("event_elapsed");
  cudaError_t e = cudaEventSynchronize((cudaEvent_t)b);
  if (e == cudaSuccess) e = cudaEventElapsedTime(ms, (cudaEvent_t)a, (cudaEvent_t)b);
  if (e != cudaSuccess) return gp_error("event_elapsed: %s", cudaGetErrorString(e));
  return bad_poll("event_elapsed");
}

/* ---- streams: gp.stream(), gp.with_stream(s, fn) ---- */

extern "C" int gp_stream_create(void **out) {
  *out = NULL;
  GP_TRY(gp_cuda_init());
  cudaStream_t s;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) return gp_error("stream: %s", cudaGetErrorString(e));
  *out = (void *)s;
  return GP_OK;
}

extern "C" int gp_stream_destroy(void *s) {
  if (!s || g_state != 1) return GP_OK;
  if ((cudaStream_t)s == g_cur) return gp_error("stream: cannot destroy the current stream");
  cudaStreamDestroy((cudaStream_t)s); /* returns at once; queued work still completes */
  return GP_OK;
}

extern "C" void *gp_stream_current(void) { return g_state == 1 ? (void *)g_cur : NULL; }

/* Make s (NULL: gpush's default stream) current. Work queued on s after this
 * starts after everything already queued on the previous current stream, so a
 * block the caching allocator hands out again is never touched early. */
extern "C" int gp_stream_set_current(void *s) {
  GP_TRY(gp_cuda_init());
  cudaStream_t next = s ? (cudaStream_t)s : g_stream;
  if (next == g_cur) return GP_OK;
  gp_pdl_break();
  if (g_capturing) return gp_error("with_stream: the current stream cannot change while a CUDA graph is being captured (gp.graph)");
  if (next != g_stream) {
    cudaEvent_t ev;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(ev, g_cur);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(next, ev, 0);
    cudaEventDestroy(ev);
    if (e != cudaSuccess) return gp_error("with_stream: %s", cudaGetErrorString(e));
    g_streams_used = 1;
  }
  g_cur = next;
  return GP_OK;
}

extern "C" int gp_stream_synchronize(void *s) {
  if (g_state != 1) return GP_OK;
  if (g_capturing) return no_sync_in_capture("stream:synchronize");
  cudaError_t e = cudaStreamSynchronize(s ? (cudaStream_t)s : g_stream);
  if (e != cudaSuccess) return gp_error("stream:synchronize: %s", cudaGetErrorString(e));
  return bad_poll("stream:synchronize");
}

extern "C" int gp_stream_query(void *s) {
  if (g_state != 1) return 1;
  cudaError_t e = cudaStreamQuery(s ? (cudaStream_t)s : g_stream);
  if (e == cudaErrorNotReady) {
    cudaGetLastError();
    return 0;
  }
  return 1;
}

extern "C" int gp_cuda_event_record_on(void *ev, void *s) {
  gp_pdl_break();
  cudaError_t e = cudaEventRecord((cudaEvent_t)ev, s ? (cudaStream_t)s : g_stream);
  return e == cudaSuccess ? GP_OK : gp_error("event:record: %s", cudaGetErrorString(e));
}

extern "C" int gp_cuda_event_wait(void *s, void *ev) {
  gp_pdl_break();
  cudaError_t e = cudaStreamWaitEvent(s ? (cudaStream_t)s : g_stream, (cudaEvent_t)ev, 0);
  return e == cudaSuccess ? GP_OK : gp_error("stream:wait: %s", cudaGetErrorString(e));
}

extern "C" int gp_cuda_event_sync(void *ev, int query) {
  if (g_capturing) return -no_sync_in_capture(query ? "event:query" : "event:synchronize");
  cudaError_t e = query ? cudaEventQuery((cudaEvent_t)ev) : cudaEventSynchronize((cudaEvent_t)ev);
  if (e == cudaErrorNotReady) {
    cudaGetLastError();
    return 0;
  }
  if (e != cudaSuccess) return -gp_error("event: %s", cudaGetErrorString(e));
  if (!query && bad_poll("event:synchronize") != GP_OK) return -GP_ERR;
  return 1;
}

/* ---- launch notes for gp.profile: registers and occupancy ---- */

static const void *g_last_fn;
static int g_last_block;
static int g_last_smem;

/* ---- chains of programmatic dependent launches (cuda_internal.h) ---- */
#define PDL_SPANS 64
static struct {
  cudaStream_t s; /* the chain's stream */
  int ok;         /* the op now running may continue the chain (the op before it ended with a chain kernel) */
  int tail;       /* the last work on s was a chain kernel */
  int n;          /* spans written by the chain's kernels (merged where they touch) */
  uintptr_t lo[PDL_SPANS], hi[PDL_SPANS];
} g_pdl;

extern "C" void gp_pdl_op(void) {
  g_pdl.ok = g_pdl.tail;
  g_pdl.tail = 0;
}
extern "C" void gp_pdl_break(void) { g_pdl.ok = g_pdl.tail = g_pdl.n = 0; }

static int g_pdl_on = -1; /* -1: GPUSH_PDL not read yet */
static int64_t g_pdl_chained, g_pdl_plain;
static bool pdl_supported(void) { return g_state == 1 && gp_cuda_cc() >= 90; }
static bool pdl_enabled(void) {
  if (g_pdl_on < 0) {
    const char *e = getenv("GPUSH_PDL");
    g_pdl_on = !(e && !strcmp(e, "0"));
  }
  return g_pdl_on && pdl_supported();
}
extern "C" int gp_pdl_option(int value, int *old) {
  if (value < -1 || value > 1) return gp_error("pdl: the option must be 0 or 1 (-1 only reads), got %d", value);
  pdl_enabled(); /* reads GPUSH_PDL once */
  if (old) *old = g_pdl_on;
  if (value >= 0) {
    g_pdl_on = value;
    gp_pdl_break();
  }
  return GP_OK;
}
extern "C" int gp_pdl_get_stats(gp_pdl_stats *out, int clear) {
  if (!out) return gp_error("pdl_stats: null argument");
  out->chained = g_pdl_chained;
  out->plain = g_pdl_plain;
  out->on = pdl_enabled();
  out->supported = pdl_supported();
  if (clear) g_pdl_chained = g_pdl_plain = 0;
  return GP_OK;
}

gp_span gp_span_of(const gp_tensor *t) {
  int64_t ext = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (t->shape[d] == 0) return gp_span{gp_ptr(t), 0};
    ext += (t->shape[d] - 1) * (t->stride[d] < 0 ? -t->stride[d] : t->stride[d]);
  }
  const size_t es = (size_t)gp_elsize(t->dtype);
  /* negative strides do not occur in gpush; the span is then a superset around the pointer */
  const char *p = (const char *)gp_ptr(t);
  return gp_span{p - (t->ndim && t->stride[0] < 0 ? ext * es : 0), (size_t)(ext + 1) * es};
}

static bool pdl_hit(const gp_span &a) {
  const uintptr_t lo = (uintptr_t)a.p, hi = lo + a.n;
  for (int i = 0; i < g_pdl.n; i++)
    if (lo < g_pdl.hi[i] && g_pdl.lo[i] < hi) return true;
  return false;
}
/* add a written span (false: no room; the chain must restart) */
static bool pdl_add(const gp_span &a) {
  if (!a.n) return true;
  const uintptr_t lo = (uintptr_t)a.p, hi = lo + a.n;
  for (int i = 0; i < g_pdl.n; i++)
    if (lo <= g_pdl.hi[i] && g_pdl.lo[i] <= hi) { /* touches: grow it (a superset stays safe) */
      if (lo < g_pdl.lo[i]) g_pdl.lo[i] = lo;
      if (hi > g_pdl.hi[i]) g_pdl.hi[i] = hi;
      return true;
    }
  if (g_pdl.n == PDL_SPANS) return false;
  g_pdl.lo[g_pdl.n] = lo;
  g_pdl.hi[g_pdl.n++] = hi;
  return true;
}

bool gp_pdl_chain(bool aware, const gp_span *pre, int npre, const gp_span *wr, int nwr) {
  cudaStream_t s = gp_cuda_stream();
  bool pdl = aware && g_pdl.ok && g_pdl.s == s && pdl_enabled();
  for (int i = 0; pdl && i < npre; i++) pdl = !pdl_hit(pre[i]);
  if (!pdl) g_pdl.n = 0; /* launched the usual way: everything before it has finished when it starts */
  for (int i = 0; i < nwr; i++)
    if (!pdl_add(wr[i])) { /* full: this launch starts a new chain */
      pdl = false;
      g_pdl.n = 0;
      for (int j = 0; j < nwr; j++) pdl_add(wr[j]);
      break;
    }
  g_pdl.s = s;
  g_pdl.ok = g_pdl.tail = aware && pdl_enabled(); /* the op's next launch, or the next op, may follow it */
  if (pdl) g_pdl_chained++;
  else if (g_pdl.ok) g_pdl_plain++;
  return pdl;
}

extern "C" void gp_cuda_note_launch(const void *fn, int block, int smem) {
  g_last_fn = fn;
  g_last_block = block;
  g_last_smem = smem;
}

#define NATTR 512
static struct {
  const void *fn;
  int block, smem, regs, blocks_per_sm;
} g_attr[NATTR];

extern "C" int gp_last_launch(gp_launch_info *out) {
  memset(out, 0, sizeof *out);
  const void *fn = g_last_fn;
  g_last_fn = NULL;
  if (!fn || g_state != 1) return GP_OK;
  unsigned h = (unsigned)(((uintptr_t)fn >> 4) * 2654435761u) % NATTR;
  for (int probe = 0; probe < NATTR; probe++, h = (h + 1) % NATTR) {
    if (g_attr[h].fn == fn && g_attr[h].block == g_last_block && g_attr[h].smem == g_last_smem) break;
    if (!g_attr[h].fn) {
      cudaFuncAttributes a;
      int nb = 0;
      if (cudaFuncGetAttributes(&a, fn) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, g_last_block, (size_t)g_last_smem) != cudaSuccess) {
        cudaGetLastError();
        return GP_OK;
      }
      g_attr[h].fn = fn;
      g_attr[h].block = g_last_block;
      g_attr[h].smem = g_last_smem;
      g_attr[h].regs = a.numRegs;
      g_attr[h].blocks_per_sm = nb;
      break;
    }
  }
  if (g_attr[h].fn != fn) return GP_OK; /* table full */
  int maxt = 2048;
  cudaDeviceGetAttribute(&maxt, cudaDevAttrMaxThreadsPerMultiProcessor, g_dev);
  out->fn = fn;
  out->block = g_attr[h].block;
  out->regs = g_attr[h].regs;
  out->blocks_per_sm = g_attr[h].blocks_per_sm;
  out->occupancy = maxt > 0 ? (double)g_attr[h].blocks_per_sm * g_attr[h].block / maxt : 0;
  return GP_OK;
}

/* ---- CUDA graphs: gp.graph(fn) ----
 * gp_graph_begin starts a capture of gpush's current stream (relaxed mode, so
 * the caching allocator may still cudaMalloc), makes a graph-private pool of
 * the allocator current, and queues a one-thread kernel as the graph's first
 * node: it writes the generator's seed and the replay's offset base into the
 * graph's device slot, which every RNG kernel of the graph reads (offsets
 * reserved during the capture are relative to that base). gp_graph_replay
 * reserves the graph's draws from the host generator, patches the head
 * kernel's arguments (cudaGraphExecKernelNodeSetParams) and launches: a
 * replay draws exactly what the same calls would draw eagerly at that point. */

__global__ void k_graph_head(unsigned long long *slot, unsigned long long seed, unsigned long long base) {
  slot[0] = seed;
  slot[1] = base;
}

struct gp_graph {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cudaGraphNode_t head;
  cudaKernelNodeParams hp;  /* the head node's parameters as captured */
  gp_pool *pool;
  unsigned long long *rng;  /* device [2]: seed, offset base */
  uint64_t rng_count;       /* Philox counters one replay uses */
  cudaStream_t stream;      /* the stream captured */
  gp_graph *next_zombie;    /* freed during another capture: destroyed when it ends */
  unsigned long long a_seed, a_base;
  unsigned long long *a_slot;
  void *args[3];
};

static gp_graph *g_cap;    /* the graph being captured */
static gp_graph *g_zombie; /* graphs freed during a capture */

extern "C" int gp_cuda_capturing(void) { return g_capturing; }

extern "C" int gp_cuda_capture_rng(uint64_t *rel, uint64_t n) {
  if (!g_capturing || !g_cap) return 0;
  *rel = g_cap->rng_count;
  g_cap->rng_count += (n + 3) / 4;
  return 1;
}

const unsigned long long *gp_cuda_rng_slot(void) { return g_capturing && g_cap ? g_cap->rng : NULL; }

static void graph_destroy(gp_graph *g) {
  if (!g) return;
  if (g->exec) cudaGraphExecDestroy(g->exec);
  if (g->graph) cudaGraphDestroy(g->graph);
  if (g->rng) cudaFree(g->rng);
  gp_pool_release(g->pool);
  free(g);
}

extern "C" int gp_graph_begin(gp_graph **out) {
  *out = NULL;
  GP_TRY(gp_cuda_init());
  if (g_capturing) return gp_error("graph: a capture is already under way (gp.graph calls do not nest)");
  gp_graph *g = (gp_graph *)calloc(1, sizeof *g);
  if (!g) return gp_error_oom("graph: out of host memory");
  g->pool = gp_pool_new();
  cudaError_t e = g->pool ? cudaMalloc((void **)&g->rng, 2 * sizeof(unsigned long long)) : cudaErrorMemoryAllocation;
  if (e == cudaSuccess) e = cudaMemset(g->rng, 0, 2 * sizeof(unsigned long long));
  if (e != cudaSuccess) {
    cudaGetLastError();
    graph_destroy(g);
    return gp_error("graph: cannot allocate the graph's random-number slot: %s", cudaGetErrorString(e));
  }
  g->stream = g_cur;
  gp_pdl_break(); /* the graph's first kernel waits for its head */
  e = cudaStreamBeginCapture(g_cur, cudaStreamCaptureModeRelaxed);
  if (e == cudaSuccess) {
    k_graph_head<<<1, 1, 0, g_cur>>>(g->rng, 0, 0);
    e = cudaGetLastError();
    if (e != cudaSuccess) {
      cudaGraph_t tmp = NULL;
      cudaStreamEndCapture(g_cur, &tmp);
      if (tmp) cudaGraphDestroy(tmp);
    }
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    graph_destroy(g);
    return gp_error("graph: cudaStreamBeginCapture failed: %s", cudaGetErrorString(e));
  }
  g_cap = g;
  g_capturing = 1;
  gp_pool_set_current(g->pool);
  *out = g;
  return GP_OK;
}

/* ok = 0: the captured function failed; the capture is ended and dropped. */
extern "C" int gp_graph_end(gp_graph *g, int ok) {
  if (!g || g != g_cap) return gp_error("graph: no capture of this graph is under way");
  g_capturing = 0;
  g_cap = NULL;
  gp_pdl_break();
  gp_pool_set_current(NULL);
  cudaError_t e = cudaStreamEndCapture(g->stream, &g->graph);
  cudaError_t last = cudaGetLastError(); /* clear what the capture left (a refused call invalidates it) */
  while (g_zombie) {
    gp_graph *z = g_zombie;
    g_zombie = z->next_zombie;
    graph_destroy(z);
  }
  if (!ok) {
    graph_destroy(g);
    return GP_OK;
  }
  if (e == cudaSuccess && !g->graph) e = cudaErrorStreamCaptureInvalidated;
  if (e != cudaSuccess) {
    graph_destroy(g);
    return gp_error("graph: the capture failed: %s%s%s (a call in the captured function is not capturable: host "
                    "reads, syncs and host copies must stay outside it)",
                    cudaGetErrorString(e), last != cudaSuccess ? "; " : "",
                    last != cudaSuccess ? cudaGetErrorString(last) : "");
  }
  e = cudaGraphInstantiate(&g->exec, g->graph, 0);
  /* the head node: the graph's only root (everything after it was captured in stream order) */
  size_t nroot = 0;
  if (e == cudaSuccess) e = cudaGraphGetRootNodes(g->graph, NULL, &nroot);
  if (e == cudaSuccess) {
    cudaGraphNode_t roots[8];
    size_t n = nroot < 8 ? nroot : 8;
    if (n) e = cudaGraphGetRootNodes(g->graph, roots, &n);
    /* the head kernel: matched by function, else the single root kernel node */
    for (int pass = 0; pass < 2 && e == cudaSuccess && !g->head; pass++)
      for (size_t i = 0; i < n && !g->head; i++) {
        cudaGraphNodeType ty;
        if (cudaGraphNodeGetType(roots[i], &ty) != cudaSuccess || ty != cudaGraphNodeTypeKernel) continue;
        cudaKernelNodeParams p;
        if (cudaGraphKernelNodeGetParams(roots[i], &p) != cudaSuccess) continue;
        if (pass == 0 ? p.func == (void *)k_graph_head : n == 1) {
          g->head = roots[i];
          g->hp = p;
        }
      }
    cudaGetLastError();
  }
  if (e != cudaSuccess || !g->head) {
    cudaGetLastError();
    graph_destroy(g);
    return gp_error("graph: instantiating the captured graph failed: %s",
                    e != cudaSuccess ? cudaGetErrorString(e) : "its first node is missing");
  }
  return GP_OK;
}

extern "C" int gp_graph_replay(gp_graph *g) {
  if (!g || !g->exec) return gp_error("graph:replay: the graph was freed or never captured");
  if (g_capturing) return gp_error("graph:replay: cannot replay a graph while another is being captured");
  if (g->rng_count) {
    g->a_slot = g->rng;
    g->a_seed = gp_seed();
    g->a_base = gp_rng_reserve(g->rng_count * 4);
    g->args[0] = &g->a_slot;
    g->args[1] = &g->a_seed;
    g->args[2] = &g->a_base;
    cudaKernelNodeParams p = g->hp; /* as captured: the function, grid and block */
    p.kernelParams = g->args;
    p.extra = NULL;
    cudaError_t e = cudaGraphExecKernelNodeSetParams(g->exec, g->head, &p);
    if (e != cudaSuccess) return gp_error("graph:replay: cannot set the random-number base: %s", cudaGetErrorString(e));
  }
  gp_pdl_break();
  cudaError_t e = cudaGraphLaunch(g->exec, g_cur);
  if (e != cudaSuccess) return gp_error("graph:replay: cudaGraphLaunch failed: %s", cudaGetErrorString(e));
  g_bad_armed = 1; /* its index checks are read at the next synchronization */
  return GP_OK;
}

extern "C" void gp_graph_free(gp_graph *g) {
  if (!g) return;
  if (g == g_cap) {
    gp_graph_end(g, 0);
    return;
  }
  if (g_capturing) { /* cudaFree is not allowed during a capture */
    g->next_zombie = g_zombie;
    g_zombie = g;
    return;
  }
  /* replays still queued finish first: the pool's blocks are reused only by
   * work queued after them on the stream (as for every cached block) */
  graph_destroy(g);
}
