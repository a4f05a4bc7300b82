/* cuda.cu: the CUDA runtime side of the host: device discovery, the stream,
 * raw allocation and copies, error checks. */
#include <stdio.h>

#include "cuda_internal.h"

static int g_state = -1; /* -1 unknown, 0 unusable, 1 ready */
static char g_why[256];
static cudaStream_t g_stream;
static int g_sms = 80;

extern "C" int gp_cuda_compiled(void) { return 1; }

extern "C" int gp_cuda_init(void) {
  if (g_state < 0) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      snprintf(g_why, sizeof g_why, "no CUDA GPU is usable (%s)",
               e != cudaSuccess ? cudaGetErrorString(e) : "no device");
      cudaGetLastError();
      g_state = 0;
    } else if ((e = cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking)) != cudaSuccess) {
      snprintf(g_why, sizeof g_why, "CUDA stream creation failed (%s)", cudaGetErrorString(e));
      g_state = 0;
    } else {
      cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0);
      g_state = 1;
    }
  }
  return g_state == 1 ? GP_OK : gp_error("%s", g_why);
}

cudaStream_t gp_cuda_stream(void) { return g_stream; }
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
  cudaError_t e = cudaMemcpyAsync(dst, src, n, k, g_stream);
  if (e == cudaSuccess && kind == 2) e = cudaStreamSynchronize(g_stream);
  if (e != cudaSuccess) return gp_error("to: copy of %zu bytes failed: %s", n, cudaGetErrorString(e));
  return GP_OK;
}

extern "C" int gp_cuda_sync(const char *op) {
  if (g_state != 1) return GP_OK;
  cudaError_t e = cudaStreamSynchronize(g_stream);
  if (e != cudaSuccess) return gp_error("%s: CUDA error: %s", op, cudaGetErrorString(e));
  return GP_OK;
}

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
  cudaGetDeviceProperties(&p, 0);
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
  cudaError_t e = cudaEventRecord((cudaEvent_t)ev, g_stream);
  return e == cudaSuccess ? GP_OK : gp_error("event_record: %s", cudaGetErrorString(e));
}
extern "C" int gp_cuda_event_elapsed(float *ms, void *a, void *b) {
  cudaError_t e = cudaEventSynchronize((cudaEvent_t)b);
  if (e == cudaSuccess) e = cudaEventElapsedTime(ms, (cudaEvent_t)a, (cudaEvent_t)b);
  return e == cudaSuccess ? GP_OK : gp_error("event_elapsed: %s", cudaGetErrorString(e));
}
