/* rtc.cu: kernels compiled at run time with NVRTC (gp.rtc.kernel).
 *
 * The cubin is loaded through the CUDA runtime's library API
 * (cudaLibraryLoadData / cudaLibraryGetKernel / cudaLaunchKernel, CUDA 12+),
 * so the binary never links libcuda: it starts on a machine with the toolkit
 * and no driver, where NVRTC still compiles (for an explicit arch). */
#include <nvrtc.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_internal.h"

static char *dup_str(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = (char *)malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

extern "C" void gp_rtc_free(void *p) { free(p); }

extern "C" int gp_rtc_version(int *major, int *minor) {
  nvrtcResult r = nvrtcVersion(major, minor);
  return r == NVRTC_SUCCESS ? GP_OK : gp_error("rtc: %s", nvrtcGetErrorString(r));
}

extern "C" int gp_rtc_arch(char *buf, int n) {
  GP_TRY(gp_cuda_init());
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, gp_cuda_current_device());
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, gp_cuda_current_device());
  snprintf(buf, (size_t)n, "sm_%d%d", major, minor);
  return GP_OK;
}

extern "C" int gp_rtc_compile(char **code, size_t *ncode, char **lowered, char **log, const char *src,
                              const char *name, const char *arch, int nopts, const char **opts) {
  *code = NULL, *ncode = 0, *lowered = NULL, *log = NULL;
  if (!src || !name) return gp_error("rtc: source and kernel name are needed");
  char archbuf[32], archopt[64];
  if (!arch || !*arch) {
    GP_TRY(gp_rtc_arch(archbuf, sizeof archbuf));
    arch = archbuf;
  }
  snprintf(archopt, sizeof archopt, "--gpu-architecture=%s", arch);
  if (nopts < 0 || nopts > 60) return gp_error("rtc: too many compiler options (%d)", nopts);
  const char *all[64];
  int n = 0;
  all[n++] = archopt;
  all[n++] = "--std=c++17";
  all[n++] = "-lineinfo";
  for (int i = 0; i < nopts; i++) all[n++] = opts[i];

  nvrtcProgram prog;
  nvrtcResult r = nvrtcCreateProgram(&prog, src, "rtc.cu", 0, NULL, NULL);
  if (r != NVRTC_SUCCESS) return gp_error("rtc: %s", nvrtcGetErrorString(r));
  nvrtcAddNameExpression(prog, name); /* for templates and C++ names; extern "C" names map to themselves */
  nvrtcResult rc = nvrtcCompileProgram(prog, n, all);
  size_t nlog = 0;
  if (nvrtcGetProgramLogSize(prog, &nlog) == NVRTC_SUCCESS && nlog > 1) {
    *log = (char *)malloc(nlog);
    if (*log && nvrtcGetProgramLog(prog, *log) != NVRTC_SUCCESS) (*log)[0] = 0;
  }
  int ret = GP_OK;
  if (rc != NVRTC_SUCCESS) {
    ret = gp_error("rtc: compiling '%s' for %s failed (%s)", name, arch, nvrtcGetErrorString(rc));
  } else {
    const char *low = NULL;
    if (nvrtcGetLoweredName(prog, name, &low) != NVRTC_SUCCESS || !low) low = name;
    *lowered = dup_str(low);
    size_t sz = 0;
    r = nvrtcGetCUBINSize(prog, &sz);
    if (r == NVRTC_SUCCESS && sz > 0 && (*code = (char *)malloc(sz)) != NULL) r = nvrtcGetCUBIN(prog, *code);
    if (r != NVRTC_SUCCESS || !*code || !*lowered) {
      free(*code), free(*lowered);
      *code = *lowered = NULL;
      ret = gp_error("rtc: no cubin for '%s' (%s); is --gpu-architecture a real sm_XY?", name,
                     r != NVRTC_SUCCESS ? nvrtcGetErrorString(r) : "out of memory");
    } else {
      *ncode = sz;
    }
  }
  nvrtcDestroyProgram(&prog);
  return ret;
}

extern "C" int gp_rtc_load(void **lib, void **kernel, const void *code, size_t ncode, const char *name) {
  *lib = NULL, *kernel = NULL;
  (void)ncode;
  GP_TRY(gp_cuda_init());
  cudaLibrary_t l;
  cudaError_t e = cudaLibraryLoadData(&l, code, NULL, NULL, 0, NULL, NULL, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return gp_error("rtc: loading the module of '%s' failed: %s", name, cudaGetErrorString(e));
  }
  cudaKernel_t k;
  e = cudaLibraryGetKernel(&k, l, name);
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaLibraryUnload(l);
    return gp_error("rtc: no kernel '%s' in the module: %s", name, cudaGetErrorString(e));
  }
  *lib = (void *)l;
  *kernel = (void *)k;
  return GP_OK;
}

extern "C" void gp_rtc_unload(void *lib) {
  if (lib) cudaLibraryUnload((cudaLibrary_t)lib);
}

extern "C" int gp_rtc_launch(void *kernel, const unsigned *grid, const unsigned *block, unsigned shared,
                             void **args) {
  if (!kernel) return gp_error("rtc: launch of a null kernel");
  dim3 g(grid[0], grid[1], grid[2]), b(block[0], block[1], block[2]);
  if (!g.x || !g.y || !g.z || !b.x || !b.y || !b.z) return GP_OK; /* an empty launch */
  if ((uint64_t)b.x * b.y * b.z > 1024 || b.z > 64 || g.y > 65535 || g.z > 65535)
    return gp_error("rtc: block %u,%u,%u (at most 1024 threads, z <= 64) or grid %u,%u,%u (y, z <= 65535) is too large",
                    b.x, b.y, b.z, g.x, g.y, g.z);
  GP_NOTE_LAUNCH(kernel, (int)(b.x * b.y * b.z), (int)shared);
  if (shared >= 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute((const void *)kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return gp_error("rtc: %u bytes of shared memory: %s", shared, cudaGetErrorString(e));
    }
  }
  gp_pdl_break();
  cudaError_t e = cudaLaunchKernel((const void *)kernel, g, b, args, shared, gp_cuda_stream());
  if (e != cudaSuccess) {
    cudaGetLastError();
    return gp_error("rtc: launch failed (grid %u,%u,%u block %u,%u,%u shared %u): %s", g.x, g.y, g.z, b.x, b.y, b.z,
                    shared, cudaGetErrorString(e));
  }
  return GP_OK;
}
