/* elementwise.cuh: what the CUDA elementwise files share (elementwise.cu:
 * unary, activation backward, clamp, where; elementwise_binary.cu: binary and
 * scalar ops; elementwise_compare.cu: comparisons; three files so that make -j
 * compiles them side by side). Floats compute in f32, integers in int64; the
 * op is a run-time switch (uniform across the grid), which keeps one
 * instantiation per dtype and costs nothing measurable next to the memory
 * traffic. */
#ifndef GP_ELEMENTWISE_CUH
#define GP_ELEMENTWISE_CUH

#include <math.h>

#include "elementwise.h"
#include "ew_launch.cuh"

/* the scalar in the compute type of T */
struct scal {
  float f;
  int64_t i;
  double d;
  __device__ __forceinline__ float get(float) const { return f; }
  __device__ __forceinline__ int64_t get(int64_t) const { return i; }
};
static inline scal make_scal(double s) {
  scal r;
  r.f = (float)s;
  r.i = gp_d2i(s, INT64_MIN, INT64_MAX);
  r.d = s;
  return r;
}

#endif
