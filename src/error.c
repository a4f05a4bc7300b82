/* error.c: the last error message, names, and host half-precision conversion. */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#ifndef GP_VERSION
#define GP_VERSION "0.1.0"
#endif

static _Thread_local char g_err[1024];

static int vset(int code, const char *fmt, va_list ap) {
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  return code;
}

int gp_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = vset(GP_ERR, fmt, ap);
  va_end(ap);
  return rc;
}

int gp_error_oom(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = vset(GP_ERR_OOM, fmt, ap);
  va_end(ap);
  return rc;
}

const char *gp_last_error(void) { return g_err; }

volatile sig_atomic_t gp_interrupt_flag;
void gp_interrupt(void) { gp_interrupt_flag = 1; }
int gp_interrupt_pending(void) { return gp_interrupt_flag != 0; }
void gp_interrupt_clear(void) { gp_interrupt_flag = 0; }
int gp_interrupted(const char *op) {
  gp_interrupt_flag = 0;
  return gp_error("%s: interrupted", op);
}
const char *gp_version(void) { return GP_VERSION; }

const char *gp_device_name(int d) { return d == GP_CUDA ? "cuda" : d == GP_CPU ? "cpu" : "?"; }

const char *gp_shape_str(const gp_tensor *t, char *buf, size_t n) {
  size_t k = 0;
  k += (size_t)snprintf(buf + k, n - k, "(");
  for (int i = 0; t && i < t->ndim && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, i ? ",%lld" : "%lld", (long long)t->shape[i]);
  if (k < n) snprintf(buf + k, n - k, ")");
  return buf;
}

float gp_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: renormalize */
      int e = -1;
      do { e++; man <<= 1; } while (!(man & 0x400));
      u = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t gp_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;          /* NaN */
  if (a >= 0x477ff000u) return sign | 0x7c00;         /* overflow (incl. inf) */
  if (a < 0x33000001u) return sign;                   /* underflow to zero */
  int e = (int)(a >> 23) - 127;
  uint32_t man = (a & 0x7fffff) | 0x800000;
  if (e < -14) { /* subnormal half */
    int shift = -14 - e + 13;
    uint32_t r = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) r++;
    return sign | (uint16_t)r;
  }
  uint32_t r = man >> 13, rem = man & 0x1fff;
  uint32_t h = (uint32_t)(e + 15) << 10 | (r & 0x3ff);
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return sign | (uint16_t)h;
}

void *gp_dlopen_noting(const char *path, char *why, size_t n) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    size_t k = strlen(why);
    snprintf(why + k, n - k, "%s%s", k ? "; " : "", dlerror());
  }
  return h;
}
