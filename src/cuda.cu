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
static int g_streams_used;     /* a user stream was current since the last device-wide sync */
static int g_dev;              /* the device of this process (one per process under gpush --nproc) */

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
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      snprintf(g_why, sizeof g_why, "no CUDA GPU is usable (%s)",
               e != cudaSuccess ? cudaGetErrorString(e) : "no device");
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
      g_cur = g_stream;
      g_state = 1;
    }
  }
  return g_state == 1 ? GP_OK : gp_error("%s", g_why);
}

/* Kernels are queued on the current stream. */
cudaStream_t gp_cuda_stream(void) { return g_cur; }
int gp_cuda_sm_count(void) { return g_sms; }

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

extern "C" int gp_cuda_memcpy(void *dst, const void *src, size_t n, int kind) {
  GP_TRY(gp_cuda_init());
  cudaMemcpyKind k = kind == 1 ? cudaMemcpyHostToDevice : kind == 2 ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
  cudaError_t e = cudaMemcpyAsync(dst, src, n, k, g_cur);
  if (e == cudaSuccess && kind == 2) e = cudaStreamSynchronize(g_cur);
  if (e != cudaSuccess) return gp_error("to: copy of %zu bytes failed: %s", n, cudaGetErrorString(e));
  return GP_OK;
}

extern "C" int gp_cuda_sync(const char *op) {
  if (g_state != 1) return GP_OK;
  cudaError_t e = cudaStreamSynchronize(g_cur);
  if (e != cudaSuccess) return gp_error("%s: CUDA error: %s", op, cudaGetErrorString(e));
  return GP_OK;
}

/* Wait for every stream; blocks the allocator held back for multi-stream
 * safety become reusable. */
extern "C" int gp_cuda_device_sync(const char *op) {
  if (g_state != 1) return GP_OK;
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return gp_error("%s: CUDA error: %s", op, cudaGetErrorString(e));
  g_streams_used = g_cur != g_stream;
  gp_alloc_release_pending();
  return GP_OK;
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
  cudaError_t e = cudaEventRecord((cudaEvent_t)ev, g_cur);
  return e == cudaSuccess ? GP_OK : gp_error("event_record: %s", cudaGetErrorString(e));
}
extern "C" int gp_cuda_event_elapsed(float *ms, void *a, void *b) {
  cudaError_t e = cudaEventSynchronize((cudaEvent_t)b);
  if (e == cudaSuccess) e = cudaEventElapsedTime(ms, (cudaEvent_t)a, (cudaEvent_t)b);
  return e == cudaSuccess ? GP_OK : gp_error("event_elapsed: %s", cudaGetErrorString(e));
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
  cudaError_t e = cudaStreamSynchronize(s ? (cudaStream_t)s : g_stream);
  return e == cudaSuccess ? GP_OK : gp_error("stream:synchronize: %s", cudaGetErrorString(e));
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
  cudaError_t e = cudaEventRecord((cudaEvent_t)ev, s ? (cudaStream_t)s : g_stream);
  return e == cudaSuccess ? GP_OK : gp_error("event:record: %s", cudaGetErrorString(e));
}

extern "C" int gp_cuda_event_wait(void *s, void *ev) {
  cudaError_t e = cudaStreamWaitEvent(s ? (cudaStream_t)s : g_stream, (cudaEvent_t)ev, 0);
  return e == cudaSuccess ? GP_OK : gp_error("stream:wait: %s", cudaGetErrorString(e));
}

extern "C" int gp_cuda_event_sync(void *ev, int query) {
  cudaError_t e = query ? cudaEventQuery((cudaEvent_t)ev) : cudaEventSynchronize((cudaEvent_t)ev);
  if (e == cudaErrorNotReady) {
    cudaGetLastError();
    return 0;
  }
  return e == cudaSuccess ? 1 : -gp_error("event: %s", cudaGetErrorString(e));
}

/* ---- launch notes for gp.profile: registers and occupancy ---- */

static const void *g_last_fn;
static int g_last_block;
static int g_last_smem;

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
