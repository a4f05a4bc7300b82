/* conv.cu: the causal depthwise convolution. The forward and dx are one
 * thread an element (K loads of x or dy down the time axis, coalesced over
 * channels; 32-bit index math below 2^30 elements); dw (up to 8 taps) sums
 * each tap over batch x time in row splits of about two blocks an SM, whose
 * partials one more kernel adds in a fixed order (deterministic). */
#include "../src/cuda_internal.h"
#include "conv.h"

/* I: the index type, int below 2^30 elements (its divisions are much cheaper than int64_t's) */
template <typename T, typename I> __global__ void k_causal_conv1d(T *y, const T *x, const T *w, I n, I T_, I C, int K) {
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
    const I c = i % C, t = (i / C) % T_;
    float s = 0.f;
    for (int j = K - 1 - t > 0 ? (int)(K - 1 - t) : 0; j < K; j++)
      s = fmaf(ld(w[j * C + c]), ld(x[i - (K - 1 - j) * C]), s);
    y[i] = st<T>(s);
  }
}

template <typename T, typename I>
__global__ void k_causal_conv1d_dx(T *dx, const T *w, const T *dy, I n, I T_, I C, int K) {
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
    const I c = i % C, t = (i / C) % T_;
    float s = 0.f;
    for (int j = K - 1 - (T_ - 1 - t) > 0 ? (int)(K - 1 - (T_ - 1 - t)) : 0; j < K; j++)
      s = fmaf(ld(w[j * C + c]), ld(dy[i + (K - 1 - j) * C]), s);
    dx[i] = st<T>(s);
  }
}

/* dw partials: block (x, z) takes 32 channels and the rows z, z + RS, z + 2 RS,
 * ... of batch x time (its 8 rows of threads striding by 8 RS), every tap at
 * once; part[z][j][c] is its sum, added in a fixed order */
template <typename T>
__global__ void __launch_bounds__(256)
    k_causal_conv1d_dw(float *part, const T *x, const T *dy, int64_t rows, int64_t T_, int64_t C, int K) {
  __shared__ float red[8][8][33];
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x, RS = gridDim.y, step = 8 * RS;
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t r = (int64_t)blockIdx.y + RS * threadIdx.y, t = r % T_;
  const int64_t tstep = step % T_;
  if (c < C)
#pragma unroll 4
    for (; r < rows; r += step) {
      const float g = ld(dy[r * C + c]);
#pragma unroll
      for (int j = 0; j < 8; j++) /* tap j reads x at lag K - 1 - j, inside the sequence when t >= lag */
        if (j < K && t >= K - 1 - j) s[j] = fmaf(g, ld(x[(r - (K - 1 - j)) * C + c]), s[j]);
      t += tstep;
      if (t >= T_) t -= T_;
    }
#pragma unroll
  for (int j = 0; j < 8; j++) red[j][threadIdx.y][threadIdx.x] = s[j];
  __syncthreads();
  if (threadIdx.y < K && c < C) {
    float a = 0.f;
    for (int k = 0; k < 8; k++) a += red[threadIdx.y][k][threadIdx.x];
    part[((int64_t)blockIdx.y * K + threadIdx.y) * C + c] = a;
  }
}

template <typename T> __global__ void k_causal_conv1d_dw_sum(T *dw, const float *part, int64_t n, int RS) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float a = 0.f;
    for (int z = 0; z < RS; z++) a += part[z * n + i];
    dw[i] = st<T>(a);
  }
}

/* dw with wider kernels (K > 8): one block per 32 channels and tap over all rows */
template <typename T>
__global__ void __launch_bounds__(1024)
    k_causal_conv1d_dw_wide(T *dw, const T *x, const T *dy, int64_t rows, int64_t T_, int64_t C, int64_t K) {
  __shared__ float red[32][33];
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x, j = blockIdx.y, lag = K - 1 - j;
  float s = 0.f;
  if (c < C)
    for (int64_t b0 = 0; b0 < rows; b0 += T_)
      for (int64_t t = lag + threadIdx.y; t < T_; t += 32)
        s = fmaf(ld(dy[(b0 + t) * C + c]), ld(x[(b0 + t - lag) * C + c]), s);
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float a = 0.f;
    for (int k = 0; k < 32; k++) a += red[k][threadIdx.x];
    dw[j * C + c] = st<T>(a);
  }
}

extern "C" int gp_cuda_causal_conv1d(gp_tensor *y, const gp_tensor *x, const gp_tensor *w) {
  const int64_t n = gp_numel(y), T_ = x->shape[1], C = x->shape[2];
  const int K = (int)w->shape[0];
  GP_FLOAT_SWITCH(x->dtype, T, {
    const T *px = (const T *)gp_ptr(x), *pw = (const T *)gp_ptr(w);
    if (n < ((int64_t)1 << 30)) {
      GP_NOTE_LAUNCH((k_causal_conv1d<T, int>), 256, 0);
      k_causal_conv1d<T, int>
          <<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(y), px, pw, (int)n, (int)T_, (int)C, K);
    } else {
      GP_NOTE_LAUNCH((k_causal_conv1d<T, int64_t>), 256, 0);
      k_causal_conv1d<T, int64_t><<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(y), px, pw, n, T_, C, K);
    }
  });
  return gp_cuda_check_launch("causal_conv1d");
}

extern "C" int gp_cuda_causal_conv1d_backward(gp_tensor *dx, gp_tensor *dw, const gp_tensor *x, const gp_tensor *w,
                                              const gp_tensor *dy) {
  const int64_t n = gp_numel(dx), T_ = x->shape[1], C = x->shape[2], K = w->shape[0];
  GP_FLOAT_SWITCH(x->dtype, T, {
    const T *pw = (const T *)gp_ptr(w), *pg = (const T *)gp_ptr(dy);
    if (n > 0 && n < ((int64_t)1 << 30)) {
      GP_NOTE_LAUNCH((k_causal_conv1d_dx<T, int>), 256, 0);
      k_causal_conv1d_dx<T, int>
          <<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(dx), pw, pg, (int)n, (int)T_, (int)C, (int)K);
    } else if (n > 0) {
      GP_NOTE_LAUNCH((k_causal_conv1d_dx<T, int64_t>), 256, 0);
      k_causal_conv1d_dx<T, int64_t>
          <<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(dx), pw, pg, n, T_, C, (int)K);
    }
    if (gp_numel(dw) > 0 && K > 8) {
      GP_NOTE_LAUNCH(k_causal_conv1d_dw_wide<T>, 1024, 0);
      k_causal_conv1d_dw_wide<T><<<dim3((unsigned)((C + 31) / 32), (unsigned)K), dim3(32, 32), 0, gp_cuda_stream()>>>(
          (T *)gp_ptr(dw), (const T *)gp_ptr(x), (const T *)gp_ptr(dy), x->shape[0] * T_, T_, C, K);
    } else if (gp_numel(dw) > 0) {
      /* row splits: about two blocks an SM, each at least 64 rows */
      const int64_t rows = x->shape[0] * T_, cb = (C + 31) / 32;
      int64_t RS = 2 * (int64_t)gp_cuda_sm_count() / cb;
      if (RS > rows / 64) RS = rows / 64;
      if (RS < 1) RS = 1;
      if (RS > 65535) RS = 65535;
      gp_tensor *part = 0;
      const int64_t pn = RS * K * C;
      GP_TRY(gp_tensor_scratch(&part, GP_F32, GP_CUDA, 1, &pn));
      GP_NOTE_LAUNCH(k_causal_conv1d_dw<T>, 256, 0);
      k_causal_conv1d_dw<T><<<dim3((unsigned)cb, (unsigned)RS), dim3(32, 8), 0, gp_cuda_stream()>>>(
          (float *)gp_ptr(part), (const T *)gp_ptr(x), (const T *)gp_ptr(dy), rows, T_, C, (int)K);
      GP_NOTE_LAUNCH(k_causal_conv1d_dw_sum<T>, 256, 0);
      k_causal_conv1d_dw_sum<T><<<gp_grid(K * C, 256), 256, 0, gp_cuda_stream()>>>(
          (T *)gp_ptr(dw), (const float *)gp_ptr(part), K * C, (int)RS);
      gp_tensor_free(part);
    }
  });
  return gp_cuda_check_launch("causal_conv1d_backward");
}
