/* copy.cu: strided copy with broadcast and cast, and fill, on the GPU. */
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
