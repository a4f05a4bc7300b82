/* nocuda.c: the CUDA entry points of a build without nvcc. Each says why it
 * cannot run; the CPU backend does all the work. */
#include "internal.h"

int gp_cuda_compiled(void) { return 0; }
int gp_cuda_init(void) { return gp_error("cuda: this gpush was built without CUDA (nvcc was not found)"); }
int gp_cuda_malloc(void **p, size_t n) {
  (void)n;
  *p = 0;
  return gp_cuda_init();
}
void gp_cuda_free(void *p) { (void)p; }
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
