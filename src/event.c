/* event.c: timestamps for gp.time: CUDA events queued on the stream when the
 * work is on the GPU, the host monotonic clock otherwise. */
#include <stdlib.h>
#include <time.h>

#include "internal.h"

struct gp_event {
  void *cuda; /* cudaEvent_t, created on first use on the GPU */
  int device; /* device of the last record */
  double host_ms;
};

double gp_wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

int gp_event_create(gp_event **out) {
  if (!out) return gp_error("event: null output");
  *out = calloc(1, sizeof **out);
  return *out ? GP_OK : gp_error_oom("event: out of host memory");
}

void gp_event_destroy(gp_event *e) {
  if (!e) return;
  if (e->cuda) gp_cuda_event_destroy(e->cuda);
  free(e);
}

int gp_event_record(gp_event *e, int device) {
  if (!e) return gp_error("event_record: null event");
  e->device = device;
  if (device == GP_CUDA) {
    if (!e->cuda) GP_TRY(gp_cuda_event_create(&e->cuda));
    return gp_cuda_event_record(e->cuda);
  }
  e->host_ms = gp_wall_ms();
  return GP_OK;
}

int gp_event_elapsed(double *ms, gp_event *a, gp_event *b) {
  if (!ms || !a || !b) return gp_error("event_elapsed: null argument");
  if (a->device != b->device) return gp_error("event_elapsed: the events were recorded on different devices");
  if (a->device == GP_CUDA) {
    float f = 0;
    GP_TRY(gp_cuda_event_elapsed(&f, a->cuda, b->cuda));
    *ms = f;
    return GP_OK;
  }
  *ms = b->host_ms - a->host_ms;
  return GP_OK;
}

/* ---- events between streams (CUDA); on the CPU work runs in order, so they are no-ops ---- */

int gp_event_record_stream(gp_event *e, void *s) {
  if (!e) return gp_error("event:record: null event");
  if (!s && !gp_cuda_available()) return gp_event_record(e, GP_CPU);
  e->device = GP_CUDA;
  if (!e->cuda) GP_TRY(gp_cuda_event_create(&e->cuda));
  return gp_cuda_event_record_on(e->cuda, s);
}

int gp_event_wait(void *s, gp_event *e) {
  if (!e) return gp_error("stream:wait: null event");
  if (e->device != GP_CUDA || !e->cuda) return GP_OK;
  return gp_cuda_event_wait(s, e->cuda);
}

int gp_event_synchronize(gp_event *e) {
  if (!e) return gp_error("event:synchronize: null event");
  if (e->device != GP_CUDA || !e->cuda) return GP_OK;
  int r = gp_cuda_event_sync(e->cuda, 0);
  return r < 0 ? GP_ERR : GP_OK;
}

int gp_event_query(gp_event *e) {
  if (!e) return -1;
  if (e->device != GP_CUDA || !e->cuda) return 1;
  int r = gp_cuda_event_sync(e->cuda, 1);
  return r < 0 ? -1 : r;
}
