/* copy.cu: strided copy with broadcast and cast, fill and arange, on the GPU. */
#include "ew_launch.cuh"

template <typename To, typename Ts> struct CastF {
  __device__ To operator()(Ts x) const { return st<To>(ld(x)); }
};
template <typename T> struct FillF {
  T v;
  __device__ T operator()() const { return v; }
};

extern "C" int gp_cuda_copy(gp_tensor *out, const gp_tensor *src) {
  int rc = GP_OK;
  GP_ANY_SWITCH(out->dtype, To,
                GP_ANY_SWITCH(src->dtype, Ts, rc = gp_ew_launch<1, To, Ts, Ts>("copy", out, src, nullptr, CastF<To, Ts>{})));
  return rc;
}

/* the fill value, converted on the host exactly as the CPU reference does */
extern "C" int gp_cuda_fill(gp_tensor *out, double value) {
  union {
    float f;
    uint16_t h;
    int32_t i;
    int64_t l;
    uint8_t b;
  } u;
  gp_store(&u, out->dtype, 0, value);
  int rc = GP_OK;
  GP_ANY_SWITCH(out->dtype, T, {
    T v;
    memcpy((void *)&v, &u, sizeof v);
    rc = gp_ew_launch<0, T, T, T>("fill", out, nullptr, nullptr, FillF<T>{v});
  });
  return rc;
}

/* arange: each value computed in double and stored as the CPU's gp_store does it (floats through float,
 * integers by gp_d2i: truncated and saturated in double, so large i64 ramps stay exact) */
template <typename T> __device__ __forceinline__ T arange_store(double v) {
  if constexpr (gp_is_float_t<T>::value) return st<T>((float)v);
  else if constexpr (std::is_same<T, int32_t>::value) return (T)gp_d2i(v, INT32_MIN, INT32_MAX);
  else if constexpr (std::is_same<T, int64_t>::value) return gp_d2i(v, INT64_MIN, INT64_MAX);
  else return (T)gp_d2i(v, 0, 255);
}
template <typename T> __global__ void k_arange(T *o, int64_t n, double start, double step) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = tid; i < n; i += nth) o[i] = arange_store<T>(start + (double)i * step);
}

extern "C" int gp_cuda_arange(gp_tensor *out, double start, double step) {
  int64_t n = out->shape[0];
  if (n == 0) return GP_OK;
  GP_ANY_SWITCH(out->dtype, T, {
    GP_NOTE_LAUNCH(k_arange<T>, 256, 0);
    k_arange<T><<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(out), n, start, step);
  });
  return gp_cuda_check_launch("arange");
}
