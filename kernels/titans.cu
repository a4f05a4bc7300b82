/* titans.cu: the Titans chunk weights, one block per row: the row is loaded
 * into shared memory (coalesced, as float), one thread runs the serial scan of
 * titans.h there, and the block stores the results. Rows are short (a chunk)
 * and there is one per memory and chunk, so all the chunks of a sequence run
 * in one launch. */
#include "../src/cuda_internal.h"
#include "titans.h"

GP_TITANS_SCANS(gp_titans_dev, float, __device__)

template <typename T> __device__ void load_row(float *dst, const T *src, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = ld(src[i]);
}
template <typename T> __device__ void store_row(T *dst, const float *src, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = st<T>(src[i]);
}

template <typename T>
__global__ void k_titans_coef(T *w, T *c, T *p, const T *eta, const T *alpha, int64_t L) {
  extern __shared__ float sh[];
  float *e = sh, *a = e + L, *ww = a + L, *cc = ww + L, *bb = cc + L, *pp = bb + L;
  const int64_t r = blockIdx.x;
  load_row(e, eta + r * L, L);
  load_row(a, alpha + r * L, L);
  __syncthreads();
  if (threadIdx.x == 0) gp_titans_dev_coef(L, e, a, ww, cc, bb, pp);
  __syncthreads();
  store_row(w + r * L, ww, L);
  store_row(c + r * L, cc, L);
  store_row(p + r * 3, pp, 3);
}

template <typename T>
__global__ void k_titans_coef_bwd(T *deta, T *dalpha, const T *eta, const T *alpha, const T *w, const T *c,
                                  const T *dw, const T *dc, const T *dp, int64_t L) {
  extern __shared__ float sh[];
  float *e = sh, *a = e + L, *ww = a + L, *cc = ww + L, *gw = cc + L, *gc = gw + L, *de = gc + L, *da = de + L,
        *g3 = da + L, *p3 = g3 + 3;
  const int64_t r = blockIdx.x;
  load_row(e, eta + r * L, L);
  load_row(a, alpha + r * L, L);
  load_row(ww, w + r * L, L);
  load_row(cc, c + r * L, L);
  load_row(gw, dw + r * L, L);
  load_row(gc, dc + r * L, L);
  load_row(g3, dp + r * 3, 3);
  __syncthreads();
  if (threadIdx.x == 0) {
    /* b into da (read at s + 1 before da[s + 1] is written); de is scratch for w and c here, the saved ones are used */
    gp_titans_dev_coef(L, e, a, de, de, da, p3);
    gp_titans_dev_coef_backward(L, e, a, ww, cc, da, gw, gc, g3, de, da);
  }
  __syncthreads();
  store_row(deta + r * L, de, L);
  store_row(dalpha + r * L, da, L);
}

static int smem_ok(const char *op, const void *fn, size_t bytes, int64_t L) {
  if (bytes <= 48 * 1024) return GP_OK;
  int dev = 0, max = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if ((size_t)max < bytes)
    return gp_error("%s: rows of %lld tokens need %zu bytes of shared memory; this GPU has %d (use shorter chunks)", op,
                    (long long)L, bytes, max);
  if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) != cudaSuccess)
    return gp_error("%s: cannot set %zu bytes of dynamic shared memory", op, bytes);
  return GP_OK;
}

extern "C" int gp_cuda_titans_coef(gp_tensor *w, gp_tensor *c, gp_tensor *p, const gp_tensor *eta,
                                   const gp_tensor *alpha) {
  const int64_t N = eta->shape[0], L = eta->shape[1];
  const size_t bytes = sizeof(float) * (size_t)(5 * L + 3);
  const int block = L >= 256 ? 256 : (int)((L + 31) / 32 * 32);
  int rc = GP_OK;
  GP_FLOAT_SWITCH(eta->dtype, T, {
    rc = smem_ok("titans_coef", (const void *)k_titans_coef<T>, bytes, L);
    if (rc == GP_OK) {
      GP_NOTE_LAUNCH(k_titans_coef<T>, block, (int)bytes);
      k_titans_coef<T><<<(unsigned)N, block, bytes, gp_cuda_stream()>>>((T *)gp_ptr(w), (T *)gp_ptr(c), (T *)gp_ptr(p),
                                                                         (const T *)gp_ptr(eta), (const T *)gp_ptr(alpha), L);
    }
  });
  if (rc != GP_OK) return rc;
  return gp_cuda_check_launch("titans_coef");
}

extern "C" int gp_cuda_titans_coef_backward(gp_tensor *deta, gp_tensor *dalpha, const gp_tensor *eta,
                                            const gp_tensor *alpha, const gp_tensor *w, const gp_tensor *c,
                                            const gp_tensor *dw, const gp_tensor *dc, const gp_tensor *dp) {
  const int64_t N = eta->shape[0], L = eta->shape[1];
  const size_t bytes = sizeof(float) * (size_t)(8 * L + 6);
  const int block = L >= 256 ? 256 : (int)((L + 31) / 32 * 32);
  int rc = GP_OK;
  GP_FLOAT_SWITCH(eta->dtype, T, {
    rc = smem_ok("titans_coef_backward", (const void *)k_titans_coef_bwd<T>, bytes, L);
    if (rc == GP_OK) {
      GP_NOTE_LAUNCH(k_titans_coef_bwd<T>, block, (int)bytes);
      k_titans_coef_bwd<T><<<(unsigned)N, block, bytes, gp_cuda_stream()>>>(
          (T *)gp_ptr(deta), (T *)gp_ptr(dalpha), (const T *)gp_ptr(eta), (const T *)gp_ptr(alpha),
          (const T *)gp_ptr(w), (const T *)gp_ptr(c), (const T *)gp_ptr(dw), (const T *)gp_ptr(dc),
          (const T *)gp_ptr(dp), L);
    }
  });
  if (rc != GP_OK) return rc;
  return gp_cuda_check_launch("titans_coef_backward");
}
