/* data.cu: windows on the GPU. One thread per output element (grid-stride),
 * raw element bits moved (dtype-agnostic); starts are wrapped into [0, N), so
 * every read is inside src and nothing is read back to the host. */
#include "bad_index.cuh"

template <typename U, typename I>
__global__ void k_windows(U *o, const U *x, const I *start, int64_t B, int64_t S, int64_t N) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = tid; e < B * S; e += nth) {
    int64_t b = e / S, s = e - b * S;
    int64_t r = ((int64_t)start[b] % N + N) % N;
    int64_t i = r + s % N;
    if (i >= N) i -= N;
    o[e] = x[i];
  }
}

template <typename U> static void launch_windows(gp_tensor *out, const gp_tensor *src, const gp_tensor *start) {
  int64_t B = out->shape[0], S = out->shape[1], N = src->shape[0];
  unsigned g = gp_grid(B * S, 256);
  if (start->dtype == GP_I32) {
    GP_NOTE_LAUNCH((k_windows<U, int32_t>), 256, 0);
    k_windows<U, int32_t><<<g, 256, 0, gp_cuda_stream()>>>((U *)gp_ptr(out), (const U *)gp_ptr(src),
                                                             (const int32_t *)gp_ptr(start), B, S, N);
  } else {
    GP_NOTE_LAUNCH((k_windows<U, int64_t>), 256, 0);
    k_windows<U, int64_t><<<g, 256, 0, gp_cuda_stream()>>>((U *)gp_ptr(out), (const U *)gp_ptr(src),
                                                             (const int64_t *)gp_ptr(start), B, S, N);
  }
}

extern "C" int gp_cuda_windows(gp_tensor *out, const gp_tensor *src, const gp_tensor *start) {
  if (out->shape[0] * out->shape[1] == 0) return GP_OK;
  switch (gp_elsize(out->dtype)) {
    case 1: launch_windows<uint8_t>(out, src, start); break;
    case 2: launch_windows<uint16_t>(out, src, start); break;
    case 4: launch_windows<uint32_t>(out, src, start); break;
    default: launch_windows<unsigned long long>(out, src, start); break;
  }
  return gp_cuda_check_launch("windows");
}

/* write_at: one thread per source element (grid-stride); pos is read on the
 * device; a position out of range is recorded (deferred error) and nothing is
 * written. */
struct wa_geo {
  int64_t B, H, K, D, C, s0, s1, s2, s3;
};

template <typename U, typename I>
__global__ void k_write_at(U *o, const U *x, const I *pos, wa_geo g, gp_bad_ref bad) {
  const int64_t p = (int64_t)pos[0];
  if (p < 0 || p + g.K > g.C) {
    if (blockIdx.x == 0 && threadIdx.x == 0) gp_report_bad(bad, p);
    return;
  }
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  const int64_t n = g.B * g.H * g.K * g.D;
  for (int64_t e = tid; e < n; e += nth) {
    int64_t d = e % g.D, r = e / g.D, k = r % g.K, bh = r / g.K, h = bh % g.H, b = bh / g.H;
    o[(bh * g.C + p + k) * g.D + d] = x[b * g.s0 + h * g.s1 + k * g.s2 + d * g.s3];
  }
}

template <typename U> static void launch_write_at(gp_tensor *out, const gp_tensor *src, const gp_tensor *pos, wa_geo g,
                                                  gp_bad_ref bad) {
  unsigned gr = gp_grid(g.B * g.H * g.K * g.D, 256);
  if (pos->dtype == GP_I32)
    k_write_at<U, int32_t><<<gr, 256, 0, gp_cuda_stream()>>>((U *)gp_ptr(out), (const U *)gp_ptr(src),
                                                               (const int32_t *)gp_ptr(pos), g, bad);
  else
    k_write_at<U, int64_t><<<gr, 256, 0, gp_cuda_stream()>>>((U *)gp_ptr(out), (const U *)gp_ptr(src),
                                                               (const int64_t *)gp_ptr(pos), g, bad);
}

extern "C" int gp_cuda_write_at(gp_tensor *out, const gp_tensor *src, const gp_tensor *pos) {
  wa_geo g = {src->shape[0], src->shape[1], src->shape[2], src->shape[3], out->shape[2],
              src->stride[0], src->stride[1], src->stride[2], src->stride[3]};
  if (g.B * g.H * g.K * g.D == 0) return GP_OK;
  gp_bad_ref bad;
  GP_TRY(gp_cuda_bad_ref(&bad, "write_at", "position", g.C - g.K + 1, "out's dim 3 (the capacity left for the new entries)"));
  switch (gp_elsize(out->dtype)) {
    case 1: launch_write_at<uint8_t>(out, src, pos, g, bad); break;
    case 2: launch_write_at<uint16_t>(out, src, pos, g, bad); break;
    case 4: launch_write_at<uint32_t>(out, src, pos, g, bad); break;
    default: launch_write_at<unsigned long long>(out, src, pos, g, bad); break;
  }
  return gp_cuda_check_launch("write_at");
}
