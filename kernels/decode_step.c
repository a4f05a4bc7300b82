/* decode_step.c: the decode plan (src/gpush.h): its checks, and the CPU
 * reference of the step the CUDA kernel (decode_step.cu) runs: the same
 * arithmetic in the same order of roundings (every phase's output rounded to
 * bf16), sums in double. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "decode_step.h"

static const char *const KIND[GP_DPLAN_PER_LAYER] = {"wqkv", "wo", "wgu", "wdown", "ln1", "ln2", "kc", "vc"};

void gp_decode_plan_free(gp_decode_plan *p) {
  if (!p) return;
  gp_free(p->dev, p->dev_bytes, p->device);
  gp_free(p->scratch, p->scratch_bytes, p->device);
  free(p->ts);
  free(p);
}

/* t has ndim dims equal to want (-1: any, then stored into want) */
static int check_shape(const char *what, int l, const gp_tensor *t, int ndim, int64_t *want) {
  int ok = t->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++) {
    if (want[i] < 0) want[i] = t->shape[i];
    ok = t->shape[i] == want[i];
  }
  if (ok) return GP_OK;
  char b[96], w[96];
  int n = 0;
  w[0] = 0;
  for (int i = 0; i < ndim && n < (int)sizeof w - 24; i++)
    n += snprintf(w + n, sizeof w - (size_t)n, i ? ", %lld" : "(%lld", (long long)want[i]);
  snprintf(w + n, sizeof w - (size_t)n, ")");
  return gp_error("decode_plan: layer %d's %s is %s, %s is needed", l + 1, what, gp_shape_str(t, b, sizeof b), w);
}

int gp_decode_plan_create(gp_decode_plan **out, int L, const gp_tensor *const *ts, const gp_tensor *norm, double eps) {
  if (!out || !ts || !norm || L < 1) return gp_error("decode_plan: need L >= 1 layers of 8 tensors and a norm weight");
  *out = NULL;
  /* shapes from layer 1: wqkv (Nq, d), wo (d, H hd), wgu (2I, d), wdown (d, I), ln (d), caches (B, J, C, hd) */
  int64_t sq[2] = {-1, -1}, so[2] = {-1, -1}, sg[2] = {-1, -1}, sd[2] = {-1, -1}, sn[1] = {-1},
          sc[4] = {-1, -1, -1, -1};
  const gp_tensor *t0 = ts[0];
  for (int l = 0; l < L; l++) {
    const gp_tensor *const *t = ts + (size_t)l * GP_DPLAN_PER_LAYER;
    for (int k = 0; k < GP_DPLAN_PER_LAYER; k++) {
      if (!t[k]) return gp_error("decode_plan: layer %d's %s is nil", l + 1, KIND[k]);
      if (t[k]->dtype != GP_BF16)
        return gp_error("decode_plan: layer %d's %s is %s; the step is bf16", l + 1, KIND[k],
                        gp_dtype_name(t[k]->dtype));
      if (t[k]->device != t0->device)
        return gp_error("decode_plan: layer %d's %s is on another device", l + 1, KIND[k]);
      if (!gp_is_contiguous(t[k]) || ((uintptr_t)gp_ptr(t[k]) & 15))
        return gp_error("decode_plan: layer %d's %s is not contiguous and 16-byte aligned", l + 1, KIND[k]);
    }
    GP_TRY(check_shape("wqkv", l, t[0], 2, sq));
    GP_TRY(check_shape("wo", l, t[1], 2, so));
    GP_TRY(check_shape("wgu", l, t[2], 2, sg));
    GP_TRY(check_shape("wdown", l, t[3], 2, sd));
    GP_TRY(check_shape("ln1", l, t[4], 1, sn));
    GP_TRY(check_shape("ln2", l, t[5], 1, sn));
    GP_TRY(check_shape("kc", l, t[6], 4, sc));
    GP_TRY(check_shape("vc", l, t[7], 4, sc));
  }
  const int64_t d = sn[0], B = sc[0], J = sc[1], C = sc[2], hd = sc[3], I = sd[1];
  const int64_t H = hd > 0 ? so[1] / hd : 0;
  if (!(hd == 64 || hd == 128) || B < 1 || B > GP_DPLAN_MAX_B || J < 1 || H < J || H % J || so[1] != H * hd ||
      so[0] != d || sq[1] != d || sq[0] != (H + 2 * J) * hd || sg[1] != d || sg[0] != 2 * I || sd[0] != d || d % 16 ||
      I % 16 || C < 1 || d > 65536 || I > 65536)
    return gp_error(
        "decode_plan: the shapes do not make a Llama layer the step takes: wqkv (%lld, %lld), wo (%lld, "
        "%lld), wgu (%lld, %lld), wdown (%lld, %lld), ln (%lld), caches (%lld, %lld, %lld, %lld); it needs "
        "head dim 64 or 128, 1 to %d rows, the query heads a multiple of the kv heads, d and I multiples "
        "of 16 (at most 65536)",
        (long long)sq[0], (long long)sq[1], (long long)so[0], (long long)so[1], (long long)sg[0], (long long)sg[1],
        (long long)sd[0], (long long)sd[1], (long long)d, (long long)B, (long long)J, (long long)C, (long long)hd,
        GP_DPLAN_MAX_B);
  if (norm->dtype != GP_BF16 || norm->ndim != 1 || norm->shape[0] != d || norm->device != t0->device ||
      !gp_is_contiguous(norm))
    return gp_error("decode_plan: the final norm's weight must be a contiguous bf16 (%lld) on the layers' device",
                    (long long)d);
  if (!(eps > 0)) return gp_error("decode_plan: eps must be > 0, got %g", eps);
  gp_decode_plan *p = calloc(1, sizeof *p);
  if (!p) return gp_error_oom("decode_plan: out of host memory");
  p->L = L, p->B = (int)B, p->d = (int)d, p->H = (int)H, p->J = (int)J, p->hd = (int)hd, p->I = (int)I;
  p->C = C, p->eps = (float)eps, p->device = t0->device;
  size_t n = (size_t)L * GP_DPLAN_PER_LAYER + 1;
  p->ts = calloc(n, sizeof *p->ts);
  if (!p->ts) {
    gp_decode_plan_free(p);
    return gp_error_oom("decode_plan: out of host memory");
  }
  for (size_t i = 0; i + 1 < n; i++) p->ts[i] = ts[i];
  p->ts[n - 1] = norm;
  int rc = GP_OK;
#if GP_HAVE_CUDA
  if (p->device == GP_CUDA) {
    rc = gp_cuda_decode_plan_geometry(p);
    if (rc == GP_OK) rc = gp_cuda_decode_plan_upload(p);
  }
#endif
  if (rc != GP_OK) {
    gp_decode_plan_free(p);
    return rc;
  }
  *out = p;
  return GP_OK;
}

static float rbf(double v) {
  uint16_t t;
  gp_store(&t, GP_BF16, 0, v);
  return (float)gp_load(&t, GP_BF16, 0);
}
static float bfat(const gp_tensor *t, int64_t i) { return (float)gp_load(gp_ptr(t), GP_BF16, i); }

/* o (d) = bf16(rms_norm(h) * w) */
static void norm_ref(float *o, const float *h, const gp_tensor *w, int d, float eps) {
  float s = 0.f; /* a float sum of squares, as the kernels' */
  for (int i = 0; i < d; i++) s += h[i] * h[i];
  const float rs = 1.f / sqrtf(s / (float)d + eps);
  for (int i = 0; i < d; i++) o[i] = rbf(h[i] * rs * bfat(w, i));
}
/* o (N) = bf16(w (N, K) @ x (K)) */
static void gemv_ref(float *o, const gp_tensor *w, const float *x, int N, int K) {
  const uint16_t *pw = gp_ptr(w);
  for (int r = 0; r < N; r++) {
    double s = 0;
    for (int k = 0; k < K; k++) s += (double)gp_load(pw, GP_BF16, (int64_t)r * K + k) * x[k];
    o[r] = rbf(s);
  }
}

static int run_cpu(gp_decode_plan *p, gp_tensor *out, const gp_tensor *x, int64_t pos, const gp_tensor *lens,
                   const gp_tensor *inv_freq, double scale) {
  const int B = p->B, d = p->d, H = p->H, J = p->J, hd = p->hd, I = p->I, E = hd / 2, Nq = (H + 2 * J) * hd;
  const int64_t C = p->C;
  const size_t nf = (size_t)B * d * 3 + (size_t)Nq + (size_t)H * hd + 3 * (size_t)I + (size_t)C + 2 * (size_t)hd;
  float *buf = calloc(nf, sizeof(float));
  if (!buf) return gp_error_oom("decode_step: out of host memory");
  float *h = buf, *n = h + (size_t)B * d, *o = n + (size_t)B * d, *qkv = o + (size_t)B * d, *y = qkv + Nq;
  float *gu = y + (size_t)H * hd, *act = gu + 2 * (size_t)I, *pr = act + I, *q = pr + C, *cs = q + hd, *sn = cs + E;
  for (int64_t i = 0; i < (int64_t)B * d; i++) h[i] = bfat(x, i);
  for (int i = 0; i < E; i++) { /* the angles of pos, once */
    const float f = (float)pos * (float)gp_load(gp_ptr(inv_freq), GP_F32, i);
    cs[i] = cosf(f), sn[i] = sinf(f);
  }
  for (int l = 0; l < p->L; l++) {
    const gp_tensor *const *t = p->ts + (size_t)l * GP_DPLAN_PER_LAYER;
    uint16_t *kc = gp_ptr(t[6]), *vc = gp_ptr(t[7]);
    for (int b = 0; b < B; b++) {
      float *hb = h + (size_t)b * d;
      norm_ref(n, hb, t[4], d, p->eps);
      gemv_ref(qkv, t[0], n, Nq, d);
      int64_t len = gp_load_i64(gp_ptr(lens), lens->dtype, b);
      len = len < 0 ? 0 : len > C ? C : len;
      for (int j = 0; j < J; j++) { /* the new key, turned, and value at pos */
        const int64_t c0 = (((int64_t)b * J + j) * C + pos) * hd;
        const float *k = qkv + (H + j) * hd, *v = qkv + (H + J + j) * hd;
        for (int i = 0; i < E; i++) {
          gp_store(kc, GP_BF16, c0 + i, k[i] * cs[i] - k[i + E] * sn[i]);
          gp_store(kc, GP_BF16, c0 + i + E, k[i + E] * cs[i] + k[i] * sn[i]);
          gp_store(vc, GP_BF16, c0 + i, v[i]);
          gp_store(vc, GP_BF16, c0 + i + E, v[i + E]);
        }
      }
      for (int hh = 0; hh < H; hh++) {
        const int j = hh / (H / J);
        const float *qs = qkv + hh * hd;
        for (int i = 0; i < E; i++) {
          q[i] = rbf(qs[i] * cs[i] - qs[i + E] * sn[i]);
          q[i + E] = rbf(qs[i + E] * cs[i] + qs[i] * sn[i]);
        }
        const int64_t base = ((int64_t)b * J + j) * C * hd;
        double mx = -INFINITY, den = 0;
        for (int64_t tp = 0; tp < len; tp++) { /* pr: the scores, then their exponentials */
          double s = 0;
          for (int i = 0; i < hd; i++) s += (double)q[i] * gp_load(kc, GP_BF16, base + tp * hd + i);
          pr[tp] = (float)(s * scale);
          if (pr[tp] > mx) mx = pr[tp];
        }
        for (int64_t tp = 0; tp < len; tp++) {
          pr[tp] = (float)exp(pr[tp] - mx);
          den += pr[tp];
        }
        for (int i = 0; i < hd; i++) {
          double s = 0;
          for (int64_t tp = 0; tp < len; tp++) s += (double)pr[tp] * gp_load(vc, GP_BF16, base + tp * hd + i);
          y[hh * hd + i] = len ? rbf(s / den) : 0.f;
        }
      }
      gemv_ref(o, t[1], y, d, H * hd);
      for (int i = 0; i < d; i++) hb[i] = rbf(hb[i] + o[i]);
      norm_ref(n, hb, t[5], d, p->eps);
      gemv_ref(gu, t[2], n, 2 * I, d);
      for (int i = 0; i < I; i++) act[i] = rbf(gu[i] / (1.0 + exp(-(double)gu[i])) * gu[I + i]);
      gemv_ref(o, t[3], act, d, I);
      for (int i = 0; i < d; i++) hb[i] = rbf(hb[i] + o[i]);
    }
  }
  for (int b = 0; b < B; b++) {
    norm_ref(n, h + (size_t)b * d, p->ts[(size_t)p->L * GP_DPLAN_PER_LAYER], d, p->eps);
    for (int i = 0; i < d; i++) gp_store(gp_ptr(out), GP_BF16, (int64_t)b * d + i, n[i]);
  }
  free(buf);
  return GP_OK;
}

int gp_decode_plan_run(gp_decode_plan *p, gp_tensor *out, const gp_tensor *x, const gp_tensor *pos,
                       const gp_tensor *lens, const gp_tensor *inv_freq, double scale) {
  if (!p || !out || !x || !pos || !lens || !inv_freq) return gp_error("decode_step: null argument");
  const int64_t Bd = (int64_t)p->B * p->d;
  char b1[96], b2[96];
  const gp_tensor *dev[5] = {out, x, pos, lens, inv_freq};
  for (int i = 0; i < 5; i++)
    if (dev[i]->device != p->device || !gp_is_contiguous(dev[i]))
      return gp_error("decode_step: out, x, pos, lens and inv_freq must be contiguous and on the plan's device");
  if (out->dtype != GP_BF16 || x->dtype != GP_BF16 || gp_numel(out) != Bd || gp_numel(x) != Bd)
    return gp_error(
        "decode_step: x and out must be bf16 with %d rows of %d (the plan's batch and width), got x %s %s "
        "and out %s %s",
        p->B, p->d, gp_dtype_name(x->dtype), gp_shape_str(x, b1, sizeof b1), gp_dtype_name(out->dtype),
        gp_shape_str(out, b2, sizeof b2));
  if ((pos->dtype != GP_I64 && pos->dtype != GP_I32) || gp_numel(pos) != 1)
    return gp_error("decode_step: pos must be one i64 or i32 position, got %s %s", gp_dtype_name(pos->dtype),
                    gp_shape_str(pos, b1, sizeof b1));
  if (lens->dtype != GP_I64 || gp_numel(lens) != p->B)
    return gp_error("decode_step: lens must be i64 (%d), got %s %s", p->B, gp_dtype_name(lens->dtype),
                    gp_shape_str(lens, b1, sizeof b1));
  if (inv_freq->dtype != GP_F32 || gp_numel(inv_freq) != p->hd / 2)
    return gp_error("decode_step: inv_freq must be f32 (%d), got %s %s", p->hd / 2, gp_dtype_name(inv_freq->dtype),
                    gp_shape_str(inv_freq, b1, sizeof b1));
  if (!(scale > 0)) return gp_error("decode_step: scale must be > 0, got %g", scale);
  GP_CUDA_DISPATCH(out, gp_cuda_decode_plan_run(p, out, x, pos, lens, inv_freq, scale));
  const int64_t ps = gp_load_i64(gp_ptr(pos), pos->dtype, 0);
  if (ps < 0 || ps >= p->C)
    return gp_error("decode_step: position %lld is outside the caches' %lld", (long long)ps, (long long)p->C);
  return run_cpu(p, out, x, ps, lens, inv_freq, scale);
}
