/* gelu.cuh: GELU's tanh form and its derivative, shared by the elementwise
 * kernels (gelu_tanh, gelu_tanh_bwd) and the matmul epilogues. */
#ifndef GP_GELU_CUH
#define GP_GELU_CUH

__device__ __forceinline__ float gp_gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}

/* d/dx gelu_tanh(x) */
__device__ __forceinline__ float gp_gelu_tanh_d(float x) {
  const float k = 0.79788456080286536f;
  float t = tanhf(k * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}
#endif
