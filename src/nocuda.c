/* nocuda.c: the CUDA entry points of a build without nvcc. Each says why it
 * cannot run; the CPU backend does all the work. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int gp_cuda_compiled(void) { return 0; }
int gp_cuda_device_count(void) { return 0; }
int gp_cuda_current_device(void) { return 0; }
int gp_cuda_init(void) { return gp_error("cuda: this gpush was built without CUDA (nvcc was not found)"); }
int gp_cuda_malloc(void **p, size_t n) {
  (void)n;
  *p = 0;
  return gp_cuda_init();
}
void gp_cuda_free(void *p) { (void)p; }
void gp_cuda_shutdown(void) {}
int gp_cuda_memcpy(void *dst, const void *src, size_t n, int kind) {
  (void)dst, (void)src, (void)n, (void)kind;
  return gp_cuda_init();
}
int gp_cuda_sync(const char *op) {
  (void)op;
  return GP_OK;
}
int gp_cuda_check_launch(const char *op) {
  (void)op;
  return GP_OK;
}
int gp_cuda_runtime_info(char *buf, int n) {
  (void)buf, (void)n;
  return gp_cuda_init();
}
int gp_cuda_event_create(void **ev) {
  *ev = 0;
  return gp_cuda_init();
}
void gp_cuda_event_destroy(void *ev) { (void)ev; }
int gp_cuda_event_record(void *ev) {
  (void)ev;
  return gp_cuda_init();
}
int gp_cuda_event_elapsed(float *ms, void *a, void *b) {
  (void)a, (void)b;
  *ms = 0;
  return gp_cuda_init();
}
int gp_cuda_event_record_on(void *ev, void *s) {
  (void)ev, (void)s;
  return gp_cuda_init();
}
int gp_cuda_event_wait(void *s, void *ev) {
  (void)ev, (void)s;
  return GP_OK;
}
int gp_cuda_event_sync(void *ev, int query) {
  (void)ev, (void)query;
  return 1;
}
int gp_cuda_device_sync(const char *op) {
  (void)op;
  return GP_OK;
}
int gp_cuda_streams_used(void) { return 0; }
void gp_cuda_note_launch(const void *fn, int block, int smem) { (void)fn, (void)block, (void)smem; }
void gp_pdl_op(void) {}
void gp_pdl_break(void) {}
/* the setting is kept (and read from GPUSH_PDL) as in a CUDA build; no chain ever runs */
int gp_pdl_option(int value, int *old) {
  static int on = -1;
  if (value < -1 || value > 1) return gp_error("pdl: the option must be 0 or 1 (-1 only reads), got %d", value);
  if (on < 0) {
    const char *e = getenv("GPUSH_PDL");
    on = !(e && !strcmp(e, "0"));
  }
  if (old) *old = on;
  if (value >= 0) on = value;
  return GP_OK;
}
int gp_pdl_get_stats(gp_pdl_stats *out, int clear) {
  (void)clear;
  if (!out) return gp_error("pdl_stats: null argument");
  memset(out, 0, sizeof *out);
  return GP_OK;
}

/* streams: the CPU backend runs everything in order */
int gp_stream_create(void **out) {
  *out = 0;
  return gp_cuda_init();
}
int gp_stream_destroy(void *s) {
  (void)s;
  return GP_OK;
}
int gp_stream_set_current(void *s) { return s ? gp_cuda_init() : GP_OK; }
void *gp_stream_current(void) { return 0; }
int gp_stream_synchronize(void *s) {
  (void)s;
  return GP_OK;
}
int gp_stream_query(void *s) {
  (void)s;
  return 1;
}
int gp_last_launch(gp_launch_info *out) {
  memset(out, 0, sizeof *out);
  return GP_OK;
}

/* NVRTC is part of the CUDA toolkit */
static int no_rtc(void) { return gp_error("rtc: this gpush was built without CUDA (NVRTC is not available)"); }
int gp_rtc_compile(char **code, size_t *ncode, char **lowered, char **log, const char *src, const char *name,
                   const char *arch, int nopts, const char **opts) {
  (void)src, (void)name, (void)arch, (void)nopts, (void)opts;
  *code = 0, *ncode = 0, *lowered = 0, *log = 0;
  return no_rtc();
}
int gp_rtc_load(void **lib, void **kernel, const void *code, size_t ncode, const char *name) {
  (void)code, (void)ncode, (void)name;
  *lib = 0, *kernel = 0;
  return no_rtc();
}
void gp_rtc_unload(void *lib) { (void)lib; }
int gp_rtc_launch(void *kernel, const unsigned *grid, const unsigned *block, unsigned shared, void **args) {
  (void)kernel, (void)grid, (void)block, (void)shared, (void)args;
  return no_rtc();
}
void gp_rtc_free(void *p) { (void)p; }
int gp_rtc_arch(char *buf, int n) {
  (void)buf, (void)n;
  return no_rtc();
}
int gp_rtc_version(int *major, int *minor) {
  *major = *minor = 0;
  return no_rtc();
}

/* CUDA graphs and the capture hooks of the random generator */
int gp_cuda_capturing(void) { return 0; }
int gp_cuda_capture_rng(uint64_t *rel, uint64_t n) {
  (void)rel, (void)n;
  return 0;
}
int gp_graph_begin(gp_graph **out) {
  *out = 0;
  return gp_cuda_init();
}
int gp_graph_end(gp_graph *g, int ok) {
  (void)g, (void)ok;
  return gp_cuda_init();
}
int gp_graph_replay(gp_graph *g) {
  (void)g;
  return gp_cuda_init();
}
void gp_graph_free(gp_graph *g) { (void)g; }
int gp_trace_start(void) { return gp_error("trace: this gpush was built without CUDA (nvcc was not found)"); }
int gp_trace_stop(int64_t *count) {
  *count = 0;
  return gp_error("trace: not tracing");
}
int gp_trace_get(int64_t i, gp_trace_rec *out) {
  (void)i, (void)out;
  return gp_error("trace: no records");
}
