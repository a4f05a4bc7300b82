/* select.cu: topk and sort on the GPU, in the order of select.c (NaN above
 * every number, ties to the lower index).
 *  topk: one block per row and k rounds; round r takes the best element that
 *   comes after pick r-1 in the order (a block argmax), so nothing is marked
 *   or moved; the row is cached in shared memory when it fits (32 KiB), else
 *   re-read from global memory (L2) each round.
 *  sort: bitonic sort of (value, index) pairs padded to a power of two P: in
 *   shared memory, one block per row, for P <= 2048; else in a global scratch
 *   with one launch per merge stage over all rows.
 *  Rows of 128 to 2048 (both ops): CUB's block radix sort of (key, index), a
 *   block a row, keys that order as above (NaN one key above +inf, -0 as +0,
 *   descending as the complement) so that the sort's stability gives the
 *   ties' index order (H200, 65536 rows of 1024: topk 14.2 ms and sort 5.9 ms
 *   before). */
#include "../src/cuda_internal.h"

#include <cub/block/block_radix_sort.cuh>

__device__ __forceinline__ bool gtv(float a, float b) {
  bool na = a != a, nb = b != b;
  return na ? !nb : (nb ? false : a > b);
}
__device__ __forceinline__ bool gtv(int64_t a, int64_t b) { return a > b; }

/* (a, ia) before (b, ib): desc or asc by value, ties to the lower index */
template <typename K> __device__ __forceinline__ bool before(K a, int64_t ia, K b, int64_t ib, bool desc) {
  bool x = desc ? gtv(a, b) : gtv(b, a), y = desc ? gtv(b, a) : gtv(a, b);
  return x || (!y && ia < ib);
}

template <typename T>
__global__ void k_topk(T *vals, int64_t *inds, const T *x, int64_t n, int k, bool cache) {
  typedef decltype(ld(T())) K;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ K wv[32];
  __shared__ int64_t wi[32];
  const T *row = x + blockIdx.x * n;
  if (cache) {
    T *s = reinterpret_cast<T *>(smem_raw);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s[j] = row[j];
    __syncthreads();
    row = s;
  }
  K pv = K();
  int64_t pi = -1;
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  for (int r = 0; r < k; r++) {
    K bv = K();
    int64_t bi = -1;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      K v = ld(row[j]);
      if (pi >= 0 && !before(pv, pi, v, j, true)) continue;
      if (bi < 0 || before(v, j, bv, bi, true)) {
        bv = v;
        bi = j;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      K ov = __shfl_xor_sync(0xffffffffu, bv, o);
      int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi >= 0 && (bi < 0 || before(ov, oi, bv, bi, true))) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      wv[w] = bv;
      wi[w] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int q = 1; q < nw; q++)
        if (wi[q] >= 0 && (bi < 0 || before(wv[q], wi[q], bv, bi, true))) {
          bv = wv[q];
          bi = wi[q];
        }
      wv[0] = bv;
      wi[0] = bi;
      vals[blockIdx.x * (int64_t)k + r] = st<T>(bv);
      inds[blockIdx.x * (int64_t)k + r] = bi;
    }
    __syncthreads();
    pv = wv[0];
    pi = wi[0];
    __syncthreads();
  }
}

/* the radix key of a value: unsigned order = the order above, ascending (desc: complemented) */
template <typename T> struct RKey {
  typedef typename std::conditional<std::is_same<T, int64_t>::value, unsigned long long, unsigned>::type K;
  static __device__ __forceinline__ K get(T v, bool desc) {
    K k;
    if constexpr (std::is_same<T, int64_t>::value) {
      k = (unsigned long long)v ^ (1ull << 63);
    } else if constexpr (std::is_same<T, int32_t>::value) {
      k = (unsigned)v ^ 0x80000000u;
    } else if constexpr (std::is_same<T, uint8_t>::value) {
      k = (unsigned)v;
    } else {
      const float f = ld(v);
      const unsigned b = f != f ? 0x7fc00000u : f == 0.f ? 0u : __float_as_uint(f);
      k = (b & 0x80000000u) ? ~b : b | 0x80000000u;
    }
    return desc ? ~k : k;
  }
};

/* the key bits that can differ: bf16's and f16's widened floats end in 16 and 13 zero bits (complemented:
 * ones), u8's keys are 8 bits */
template <typename T> constexpr int rkey_begin() {
  return std::is_same<T, __nv_bfloat16>::value ? 16 : std::is_same<T, __half>::value ? 13 : 0;
}
template <typename T> constexpr int rkey_end() {
  return std::is_same<T, uint8_t>::value ? 8 : std::is_same<T, int64_t>::value ? 64 : 32;
}

constexpr int RS_THREADS = 256; /* RS_ITEMS a thread: rows of up to 1024 (4) or 2048 (8) */

/* a row of x (n <= RS_THREADS RS_ITEMS) sorted by CUB's block radix sort; its first m go out (sort: m = n;
 * topk: k) */
template <typename T, int RS_ITEMS>
__global__ void __launch_bounds__(RS_THREADS)
    k_sort_radix(T *vals, int64_t *inds, const T *x, int n, int m, bool desc) {
  typedef typename RKey<T>::K K;
  typedef cub::BlockRadixSort<K, RS_THREADS, RS_ITEMS, int> Sort;
  __shared__ typename Sort::TempStorage tmp;
  const T *row = x + blockIdx.x * (int64_t)n;
  K key[RS_ITEMS];
  int ix[RS_ITEMS];
#pragma unroll
  for (int i = 0; i < RS_ITEMS; i++) {
    const int j = threadIdx.x * RS_ITEMS + i;
    ix[i] = j;
    key[i] = j < n ? RKey<T>::get(row[j], desc) : ~(K)0; /* padding last (stable: after any real key) */
  }
  Sort(tmp).Sort(key, ix, rkey_begin<T>(), rkey_end<T>());
#pragma unroll
  for (int i = 0; i < RS_ITEMS; i++) {
    const int r = threadIdx.x * RS_ITEMS + i;
    if (r < m) {
      vals[blockIdx.x * (int64_t)m + r] = row[ix[i]];
      inds[blockIdx.x * (int64_t)m + r] = ix[i];
    }
  }
}

/* the radix kernel for rows of 128 to 2048 (true: launched) */
static bool sort_radix(gp_tensor *values, gp_tensor *indices, const gp_tensor *x, int64_t rows, int64_t n, int64_t m,
                       bool desc) {
  if (n < 128 || n > RS_THREADS * 8 || rows > 2147483647) return false;
  GP_ANY_SWITCH(x->dtype, T, {
    T *pv = (T *)gp_ptr(values);
    int64_t *pi = (int64_t *)gp_ptr(indices);
    const T *px = (const T *)gp_ptr(x);
    if (n <= RS_THREADS * 4) {
      GP_NOTE_LAUNCH((k_sort_radix<T, 4>), RS_THREADS, 0);
      k_sort_radix<T, 4><<<(unsigned)rows, RS_THREADS, 0, gp_cuda_stream()>>>(pv, pi, px, (int)n, (int)m, desc);
    } else {
      GP_NOTE_LAUNCH((k_sort_radix<T, 8>), RS_THREADS, 0);
      k_sort_radix<T, 8><<<(unsigned)rows, RS_THREADS, 0, gp_cuda_stream()>>>(pv, pi, px, (int)n, (int)m, desc);
    }
  });
  return true;
}

extern "C" int gp_cuda_topk(gp_tensor *values, gp_tensor *indices, const gp_tensor *x, int64_t rows, int64_t n,
                            int64_t k) {
  if (rows == 0 || k == 0) return GP_OK;
  if (rows > 2147483647) return gp_error("topk: %lld rows is more than one launch handles", (long long)rows);
  if (sort_radix(values, indices, x, rows, n, k, true)) return gp_cuda_check_launch("topk");
  int bs = n >= 4096 ? 512 : n >= 512 ? 256 : n >= 64 ? 128 : 32;
  size_t bytes = (size_t)n * (size_t)gp_elsize(x->dtype);
  bool cache = bytes <= 32768;
  GP_ANY_SWITCH(x->dtype, T,
                k_topk<T><<<(unsigned)rows, bs, cache ? bytes : 0, gp_cuda_stream()>>>(
                    (T *)gp_ptr(values), (int64_t *)gp_ptr(indices), (const T *)gp_ptr(x), n, (int)k, cache));
  return gp_cuda_check_launch("topk");
}

/* one compare-exchange of the bitonic network on pair p of stage (kk, j);
 * indices >= n are padding and go last */
template <typename K> __device__ __forceinline__ bool pad_before(K a, int ia, K b, int ib, int n, bool desc) {
  if (ia >= n) return ib >= n && ia < ib;
  if (ib >= n) return true;
  return before(a, (int64_t)ia, b, (int64_t)ib, desc);
}

template <typename T> __device__ __forceinline__ void cmpx(T *v, int *ix, int p, int kk, int j, int n, bool desc) {
  typedef decltype(ld(T())) K;
  int i = 2 * j * (p / j) + (p % j), l = i + j;
  bool up = (i & kk) == 0;
  K a = ld(v[i]), b = ld(v[l]);
  bool sw = up ? pad_before(b, ix[l], a, ix[i], n, desc) : pad_before(a, ix[i], b, ix[l], n, desc);
  if (sw) {
    T t = v[i];
    v[i] = v[l];
    v[l] = t;
    int q = ix[i];
    ix[i] = ix[l];
    ix[l] = q;
  }
}

template <typename T>
__global__ void k_sort_smem(T *vals, int64_t *inds, const T *x, int n, int P, bool desc) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T *v = reinterpret_cast<T *>(smem_raw);
  int *ix = reinterpret_cast<int *>(smem_raw + ((size_t)P * sizeof(T) + 15) / 16 * 16);
  const T *row = x + blockIdx.x * (int64_t)n;
  for (int j = threadIdx.x; j < P; j += blockDim.x) {
    ix[j] = j;
    v[j] = j < n ? row[j] : row[0];
  }
  __syncthreads();
  for (int kk = 2; kk <= P; kk <<= 1)
    for (int j = kk >> 1; j > 0; j >>= 1) {
      for (int p = threadIdx.x; p < P / 2; p += blockDim.x) cmpx(v, ix, p, kk, j, n, desc);
      __syncthreads();
    }
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    vals[blockIdx.x * (int64_t)n + j] = v[j];
    inds[blockIdx.x * (int64_t)n + j] = ix[j];
  }
}

template <typename T> __global__ void k_sort_init(T *v, int *ix, const T *x, int64_t rows, int n, int P) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = tid; e < rows * P; e += nth) {
    int64_t r = e / P;
    int j = (int)(e - r * P);
    ix[e] = j;
    v[e] = x[r * n + (j < n ? j : 0)];
  }
}

template <typename T> __global__ void k_sort_stage(T *v, int *ix, int64_t rows, int n, int P, int kk, int j, bool desc) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  int64_t half = P / 2;
  for (int64_t e = tid; e < rows * half; e += nth) {
    int64_t r = e / half;
    cmpx(v + r * P, ix + r * P, (int)(e - r * half), kk, j, n, desc);
  }
}

template <typename T> __global__ void k_sort_out(T *vals, int64_t *inds, const T *v, const int *ix, int64_t rows, int n, int P) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = tid; e < rows * n; e += nth) {
    int64_t r = e / n, j = e - r * n;
    vals[e] = v[r * P + j];
    inds[e] = ix[r * P + j];
  }
}

extern "C" int gp_cuda_sort(gp_tensor *values, gp_tensor *indices, const gp_tensor *x, int64_t rows, int64_t n, int desc) {
  if (rows == 0 || n == 0) return GP_OK;
  int P = 1;
  while (P < n) P <<= 1;
  size_t es = (size_t)gp_elsize(x->dtype);
  if (sort_radix(values, indices, x, rows, n, n, desc != 0)) return gp_cuda_check_launch("sort");
  if (P <= 2048) {
    if (rows > 2147483647) return gp_error("sort: %lld rows is more than one launch handles", (long long)rows);
    int bs = P / 2 < 32 ? 32 : P / 2;
    size_t bytes = ((size_t)P * es + 15) / 16 * 16 + (size_t)P * sizeof(int);
    GP_ANY_SWITCH(x->dtype, T,
                  k_sort_smem<T><<<(unsigned)rows, bs, bytes, gp_cuda_stream()>>>(
                      (T *)gp_ptr(values), (int64_t *)gp_ptr(indices), (const T *)gp_ptr(x), (int)n, P, desc != 0));
    return gp_cuda_check_launch("sort");
  }
  int64_t shape[2] = {rows, P};
  gp_tensor *sv = 0, *si = 0;
  int rc = gp_tensor_scratch(&sv, x->dtype, GP_CUDA, 2, shape);
  if (rc == GP_OK) rc = gp_tensor_scratch(&si, GP_I32, GP_CUDA, 2, shape);
  if (rc == GP_OK) {
    int *ix = (int *)gp_ptr(si);
    GP_ANY_SWITCH(
        x->dtype, T, T *v = (T *)gp_ptr(sv);
        k_sort_init<T><<<gp_grid(rows * P, 256), 256, 0, gp_cuda_stream()>>>(v, ix, (const T *)gp_ptr(x), rows, (int)n, P);
        for (int kk = 2; kk <= P; kk <<= 1) for (int j = kk >> 1; j > 0; j >>= 1)
            k_sort_stage<T><<<gp_grid(rows * (P / 2), 256), 256, 0, gp_cuda_stream()>>>(v, ix, rows, (int)n, P, kk, j,
                                                                                         desc != 0);
        k_sort_out<T><<<gp_grid(rows * n, 256), 256, 0, gp_cuda_stream()>>>(
            (T *)gp_ptr(values), (int64_t *)gp_ptr(indices), v, ix, rows, (int)n, P));
    rc = gp_cuda_check_launch("sort");
  }
  gp_tensor_free(sv);
  gp_tensor_free(si);
  return rc;
}
