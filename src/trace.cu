/* trace.cu: gp.trace's recorder. CUPTI's activity API (libcupti, loaded at
 * run time with dlopen: gpush starts without it) reports every kernel, memset
 * and memcpy the GPU ran, with the GPU's own start and end timestamps:
 * cuBLAS's and NCCL's kernels and the nodes of CUDA graph replays included,
 * which gp.profile (events around gp.k calls) cannot see, and without the
 * cost of an event pair a call. Host code only. */
#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <glob.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "internal.h"
}

typedef CUptiResult (*reg_fn)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
typedef CUptiResult (*kind_fn)(CUpti_ActivityKind);
typedef CUptiResult (*next_fn)(uint8_t *, size_t, CUpti_Activity **);
typedef CUptiResult (*flush_fn)(uint32_t);
typedef CUptiResult (*errstr_fn)(CUptiResult, const char **);

static struct {
  void *lib;
  reg_fn reg;
  kind_fn enable, disable;
  next_fn next;
  flush_fn flush;
  errstr_fn errstr;
  int registered, on;
  char why[1024];
} X;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static gp_trace_rec *recs;
static int64_t nrec, caprec;

/* names: CUPTI's mangled name -> a demangled copy without the parameter
 * list, kept for the process's life (looked up by content: CUPTI does not
 * promise one pointer a kernel) */
#define NAMES 4096
static struct { char *raw, *name; } names[NAMES];

static const char *short_name(const char *raw) {
  if (!raw) return "?";
  uint64_t hv = 1469598103934665603ull; /* FNV-1a */
  for (const char *c = raw; *c; c++) hv = (hv ^ (unsigned char)*c) * 1099511628211ull;
  size_t h = hv % NAMES;
  for (size_t i = 0; i < NAMES; i++, h = (h + 1) % NAMES) {
    if (names[h].raw && !strcmp(names[h].raw, raw)) return names[h].name;
    if (names[h].raw) continue;
    int st = -1;
    char *d = raw[0] == '_' && raw[1] == 'Z' ? abi::__cxa_demangle(raw, NULL, NULL, &st) : NULL;
    const char *s = st == 0 && d ? d : raw;
    if (!strncmp(s, "void ", 5)) s += 5;
    /* the parameter list: the last '(' at template depth 0 */
    size_t n = strlen(s), cut = n;
    int depth = 0;
    for (size_t k = 0; k < n; k++) {
      if (s[k] == '<') depth++;
      else if (s[k] == '>') depth--;
      else if (s[k] == '(' && depth == 0 && k > 0) cut = k;
    }
    char *c = strndup(s, cut), *r = strdup(raw);
    free(d);
    if (!c || !r) {
      free(c), free(r);
      return "?";
    }
    names[h].raw = r;
    names[h].name = c;
    return c;
  }
  return "?"; /* more than NAMES distinct kernels */
}

static void push(const gp_trace_rec *r) {
  if (nrec == caprec) {
    int64_t cap = caprec ? 2 * caprec : 65536;
    gp_trace_rec *p = (gp_trace_rec *)realloc(recs, (size_t)cap * sizeof *p);
    if (!p) return; /* the record is dropped; gp_trace_stop reports the count it has */
    recs = p;
    caprec = cap;
  }
  recs[nrec++] = *r;
}

static void CUPTIAPI buf_request(uint8_t **buf, size_t *size, size_t *max_records) {
  *size = (size_t)4 << 20;
  *buf = (uint8_t *)aligned_alloc(8, *size);
  *max_records = 0;
}

static void CUPTIAPI buf_complete(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *a = NULL;
  pthread_mutex_lock(&mu);
  while (buf && X.next(buf, valid, &a) == CUPTI_SUCCESS) {
    gp_trace_rec r;
    memset(&r, 0, sizeof r);
    if (a->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || a->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)a;
      r.start = k->start, r.end = k->end, r.graph = k->graphId, r.kind = 0;
      r.grid = k->gridX * k->gridY * k->gridZ, r.block = k->blockX * k->blockY * k->blockZ;
      r.regs = k->registersPerThread, r.stream = k->streamId;
      r.name = short_name(k->name);
    } else if (a->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)a;
      r.start = m->start, r.end = m->end, r.graph = m->graphId, r.kind = 1, r.bytes = m->bytes, r.stream = m->streamId;
      r.name = "memset";
    } else if (a->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)a;
      r.start = m->start, r.end = m->end, r.graph = m->graphId, r.kind = 2, r.bytes = m->bytes, r.stream = m->streamId;
      r.name = m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "memcpy HtoD"
               : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "memcpy DtoH"
                                                                : "memcpy DtoD";
    } else {
      continue;
    }
    if (X.on) push(&r);
  }
  pthread_mutex_unlock(&mu);
  free(buf);
}

static int try_open(const char *path) {
  X.lib = gp_dlopen_noting(path, X.why, sizeof X.why);
  return X.lib != NULL;
}

static int load(void) {
  if (X.lib) return GP_OK;
  X.why[0] = 0;
  const char *env = getenv("GPUSH_CUPTI");
  int ok = env && *env ? try_open(env) : 0;
  if (!ok) ok = try_open("libcupti.so.13") || try_open("libcupti.so");
  if (!ok) {
    /* the toolkit's copies, then a python wheel's (nvidia-cuda-cupti, PyTorch's) */
    const char *cuda = getenv("CUDA_HOME");
    char pat[3][512];
    snprintf(pat[0], sizeof pat[0], "%s/lib64/libcupti.so*", cuda && *cuda ? cuda : "/usr/local/cuda");
    snprintf(pat[1], sizeof pat[1], "%s/extras/CUPTI/lib64/libcupti.so*", cuda && *cuda ? cuda : "/usr/local/cuda");
    snprintf(pat[2], sizeof pat[2], "/usr/local/lib/python3*/*-packages/nvidia/cu*/lib/libcupti.so*");
    for (int i = 0; i < 3 && !ok; i++) {
      glob_t g;
      if (glob(pat[i], 0, NULL, &g) == 0)
        for (size_t j = 0; j < g.gl_pathc && !ok; j++) ok = try_open(g.gl_pathv[j]);
      globfree(&g);
    }
  }
  if (!ok)
    return gp_error("trace: CUPTI (libcupti) could not be loaded: %s; GPUSH_CUPTI=/path/libcupti.so names it", X.why);
  X.reg = (reg_fn)dlsym(X.lib, "cuptiActivityRegisterCallbacks");
  X.enable = (kind_fn)dlsym(X.lib, "cuptiActivityEnable");
  X.disable = (kind_fn)dlsym(X.lib, "cuptiActivityDisable");
  X.next = (next_fn)dlsym(X.lib, "cuptiActivityGetNextRecord");
  X.flush = (flush_fn)dlsym(X.lib, "cuptiActivityFlushAll");
  X.errstr = (errstr_fn)dlsym(X.lib, "cuptiGetResultString");
  if (!X.reg || !X.enable || !X.disable || !X.next || !X.flush) {
    dlclose(X.lib);
    X.lib = NULL;
    return gp_error("trace: the CUPTI library found lacks the activity API");
  }
  return GP_OK;
}

static int cupti_err(const char *what, CUptiResult r) {
  const char *s = "?";
  if (X.errstr) X.errstr(r, &s);
  return gp_error("trace: %s: %s", what, s);
}

static const CUpti_ActivityKind KINDS[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMSET,
                                           CUPTI_ACTIVITY_KIND_MEMCPY};

extern "C" int gp_trace_start(void) {
  if (X.on) return gp_error("trace: already tracing (traces do not nest)");
  GP_TRY(gp_cuda_init());
  GP_TRY(load());
  CUptiResult r;
  if (!X.registered) {
    if ((r = X.reg(buf_request, buf_complete)) != CUPTI_SUCCESS) return cupti_err("registering buffers", r);
    X.registered = 1;
  }
  pthread_mutex_lock(&mu);
  nrec = 0;
  X.on = 1;
  pthread_mutex_unlock(&mu);
  for (size_t i = 0; i < sizeof KINDS / sizeof *KINDS; i++)
    if ((r = X.enable(KINDS[i])) != CUPTI_SUCCESS) {
      for (size_t j = 0; j < i; j++) X.disable(KINDS[j]);
      X.on = 0;
      return cupti_err("enabling activity records", r);
    }
  return GP_OK;
}

extern "C" int gp_trace_stop(int64_t *count) {
  if (!X.on) return gp_error("trace: not tracing");
  int rc = gp_device_sync(); /* a failed kernel still ends the trace */
  X.flush(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  for (size_t i = 0; i < sizeof KINDS / sizeof *KINDS; i++) X.disable(KINDS[i]);
  pthread_mutex_lock(&mu);
  X.on = 0;
  *count = nrec;
  pthread_mutex_unlock(&mu);
  return rc;
}

extern "C" int gp_trace_get(int64_t i, gp_trace_rec *out) {
  pthread_mutex_lock(&mu);
  int ok = i >= 0 && i < nrec;
  if (ok) *out = recs[i];
  pthread_mutex_unlock(&mu);
  return ok ? GP_OK : gp_error("trace: record %lld of %lld", (long long)i, (long long)nrec);
}
