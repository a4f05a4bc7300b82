/* tensor.c: storage, tensors, views, transfers, loops and argument specs. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

/* ---- tensors ---- */

int64_t gp_numel(const gp_tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

static void contiguous_strides(int64_t *stride, int ndim, const int64_t *shape) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    stride[i] = s;
    s *= shape[i] > 1 ? shape[i] : 1;
  }
}

int gp_is_contiguous(const gp_tensor *t) {
  int64_t s = 1;
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] == 0) return 1; /* no elements: any strides describe them (as PyTorch says) */
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] == 1) continue;
    if (t->stride[i] != s) return 0;
    s *= t->shape[i];
  }
  return 1;
}

/* the rule every shape follows (tensors, views, and the files' readers) */
static int check_shape(const char *op, int ndim, const int64_t *shape, int allow_neg1);
int gp_check_shape(const char *op, int ndim, const int64_t *shape) { return check_shape(op, ndim, shape, 0); }

static int check_shape(const char *op, int ndim, const int64_t *shape, int allow_neg1) {
  if (ndim < 0 || ndim > GP_MAX_DIMS)
    return gp_error("%s: %d dims asked for; at most %d are supported", op, ndim, GP_MAX_DIMS);
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0 && !(allow_neg1 && shape[i] == -1))
      return gp_error("%s: size %lld at dim %d is negative", op, (long long)shape[i], i + 1);
    if (shape[i] > 0 && n > INT64_MAX / 16 / shape[i])
      return gp_error("%s: shape too large", op);
    if (shape[i] > 0) n *= shape[i];
  }
  return GP_OK;
}

int gp_tensor_empty(gp_tensor **out, int dtype, int device, int ndim, const int64_t *shape) {
  if (!out) return gp_error("empty: null output");
  *out = NULL;
  if (dtype < 0 || dtype >= GP_NDTYPES) return gp_error("empty: unknown dtype %d", dtype);
  if (device != GP_CPU && device != GP_CUDA) return gp_error("empty: unknown device %d", device);
  if (device == GP_CUDA && !gp_cuda_available())
    return gp_error("empty: device cuda asked for but no CUDA GPU is usable");
  if (device == GP_CUDA && gp_dtype_cpu_only(dtype))
    return gp_error("empty: %s tensors live on the CPU only (they are for gradient checks and references)",
                    gp_dtype_name(dtype));
  GP_TRY(check_shape("empty", ndim, shape, 0));
  gp_tensor *t = calloc(1, sizeof *t);
  gp_storage *s = calloc(1, sizeof *s);
  if (!t || !s) {
    free(t);
    free(s);
    return gp_error_oom("empty: out of host memory");
  }
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  contiguous_strides(t->stride, ndim, shape);
  t->dtype = dtype;
  t->device = device;
  s->device = device;
  s->refcount = 1;
  s->nbytes = (size_t)gp_numel(t) * (size_t)gp_elsize(dtype);
  int rc = gp_alloc(&s->ptr, &s->alloc_bytes, s->nbytes, device);
  if (rc != GP_OK) {
    free(t);
    free(s);
    return rc;
  }
  t->storage = s;
  t->data = s->ptr;
  *out = t;
  return GP_OK;
}

int gp_tensor_scratch(gp_tensor **out, int dtype, int device, int ndim, const int64_t *shape) {
  return gp_tensor_empty(out, dtype, device, ndim, shape);
}

int gp_tensor_alias(gp_tensor **out, const gp_tensor *src) {
  if (!out || !src) return gp_error("alias: null argument");
  gp_tensor *t = malloc(sizeof *t);
  if (!t) return gp_error_oom("alias: out of host memory");
  *t = *src;
  t->storage->refcount++;
  *out = t;
  return GP_OK;
}

void gp_tensor_free(gp_tensor *t) {
  if (!t) return;
  gp_storage *s = t->storage;
  if (s && --s->refcount == 0) {
    gp_free(s->ptr, s->alloc_bytes, s->device);
    free(s);
  }
  free(t);
}

int64_t gp_storage_numel(const gp_tensor *t) {
  return (int64_t)(t->storage->nbytes / (size_t)gp_elsize(t->dtype));
}

int gp_same_storage(const gp_tensor *a, const gp_tensor *b) { return a && b && a->storage == b->storage; }

int gp_same_shape(const gp_tensor *a, const gp_tensor *b) {
  if (a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

/* ---- views ---- */

static int check_alias(const char *op, gp_tensor *out, const gp_tensor *src) {
  if (!out || !src) return gp_error("%s: null argument", op);
  if (out->storage != src->storage) return gp_error("%s: out must be an alias of src", op);
  return GP_OK;
}

static void set_geometry(gp_tensor *out, const gp_tensor *src, int ndim, const int64_t *shape,
                         const int64_t *stride, int64_t offset) {
  out->dtype = src->dtype;
  out->device = src->device;
  out->data = src->data;
  out->ndim = ndim;
  out->offset = offset;
  for (int i = 0; i < ndim; i++) {
    out->shape[i] = shape[i];
    out->stride[i] = stride[i];
  }
}

int gp_view(gp_tensor *out, const gp_tensor *src, int ndim, const int64_t *shape_in) {
  GP_TRY(check_alias("view", out, src));
  GP_TRY(check_shape("view", ndim, shape_in, 1));
  int64_t shape[GP_MAX_DIMS], stride[GP_MAX_DIMS], n = gp_numel(src), known = 1;
  int infer = -1;
  for (int i = 0; i < ndim; i++) {
    shape[i] = shape_in[i];
    if (shape[i] == -1) {
      if (infer >= 0) return gp_error("view: only one size may be -1");
      infer = i;
    } else {
      known *= shape[i];
    }
  }
  char sbuf[96];
  if (infer >= 0) {
    if (known == 0 || n % known != 0)
      return gp_error("view: shape %s of %lld elements cannot be viewed with a -1 size",
                      gp_shape_str(src, sbuf, sizeof sbuf), (long long)n);
    shape[infer] = n / known;
    known *= shape[infer];
  }
  if (known != n) {
    gp_tensor tmp = {0};
    tmp.ndim = ndim;
    for (int i = 0; i < ndim; i++) tmp.shape[i] = shape[i];
    char b2[96];
    return gp_error("view: %s (%lld elements) cannot be viewed as %s (%lld elements)",
                    gp_shape_str(src, sbuf, sizeof sbuf), (long long)n,
                    gp_shape_str(&tmp, b2, sizeof b2), (long long)known);
  }
  /* The stride rule of PyTorch's computeStride: each run of dims of src that is
   * contiguous within itself must map onto whole dims of the new shape. */
  if (n == 0 || src->ndim == 0 || ndim == 0) {
    contiguous_strides(stride, ndim, shape);
  } else {
    int view_d = ndim - 1;
    int64_t chunk_base = src->stride[src->ndim - 1], tensor_numel = 1, view_numel = 1;
    for (int td = src->ndim - 1; td >= 0; td--) {
      tensor_numel *= src->shape[td];
      if (td == 0 || (src->shape[td - 1] != 1 && src->stride[td - 1] != tensor_numel * chunk_base)) {
        while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
          stride[view_d] = view_numel * chunk_base;
          view_numel *= shape[view_d];
          view_d--;
        }
        if (view_numel != tensor_numel)
          return gp_error("view: the strides of %s do not allow viewing it as that shape; "
                          "use reshape (it copies) or contiguous() first",
                          gp_shape_str(src, sbuf, sizeof sbuf));
        if (td > 0) {
          chunk_base = src->stride[td - 1];
          tensor_numel = 1;
          view_numel = 1;
        }
      }
    }
    if (view_d != -1)
      return gp_error("view: the strides of %s do not allow viewing it as that shape",
                      gp_shape_str(src, sbuf, sizeof sbuf));
  }
  set_geometry(out, src, ndim, shape, stride, src->offset);
  return GP_OK;
}

static int check_dim(const char *op, const gp_tensor *t, int d) {
  if (d < 0 || d >= t->ndim) {
    char b[96];
    return gp_error("%s: dim %d out of range for a tensor of shape %s (dims 1..%d)", op, d + 1,
                    gp_shape_str(t, b, sizeof b), t->ndim);
  }
  return GP_OK;
}

int gp_transpose(gp_tensor *out, const gp_tensor *src, int d0, int d1) {
  GP_TRY(check_alias("transpose", out, src));
  GP_TRY(check_dim("transpose", src, d0));
  GP_TRY(check_dim("transpose", src, d1));
  int64_t shape[GP_MAX_DIMS], stride[GP_MAX_DIMS];
  for (int i = 0; i < src->ndim; i++) {
    shape[i] = src->shape[i];
    stride[i] = src->stride[i];
  }
  shape[d0] = src->shape[d1];
  stride[d0] = src->stride[d1];
  shape[d1] = src->shape[d0];
  stride[d1] = src->stride[d0];
  set_geometry(out, src, src->ndim, shape, stride, src->offset);
  return GP_OK;
}

int gp_permute(gp_tensor *out, const gp_tensor *src, int ndim, const int *perm) {
  GP_TRY(check_alias("permute", out, src));
  char b[96];
  if (ndim != src->ndim)
    return gp_error("permute: %d dims given for a tensor of shape %s", ndim, gp_shape_str(src, b, sizeof b));
  int seen[GP_MAX_DIMS] = {0};
  int64_t shape[GP_MAX_DIMS], stride[GP_MAX_DIMS];
  for (int i = 0; i < ndim; i++) {
    GP_TRY(check_dim("permute", src, perm[i]));
    if (seen[perm[i]]++) return gp_error("permute: dim %d appears twice", perm[i] + 1);
    shape[i] = src->shape[perm[i]];
    stride[i] = src->stride[perm[i]];
  }
  set_geometry(out, src, ndim, shape, stride, src->offset);
  return GP_OK;
}

int gp_narrow(gp_tensor *out, const gp_tensor *src, int dim, int64_t start, int64_t length) {
  GP_TRY(check_alias("narrow", out, src));
  GP_TRY(check_dim("narrow", src, dim));
  char b[96];
  if (start < 0 || length < 0 || start > src->shape[dim] || length > src->shape[dim] - start) /* no overflow */
    return gp_error("narrow: start %lld, length %lld out of range for dim %d of size %lld (shape %s)",
                    (long long)start + 1, (long long)length, dim + 1, (long long)src->shape[dim],
                    gp_shape_str(src, b, sizeof b));
  int64_t shape[GP_MAX_DIMS];
  for (int i = 0; i < src->ndim; i++) shape[i] = src->shape[i];
  shape[dim] = length;
  set_geometry(out, src, src->ndim, shape, src->stride, src->offset + start * src->stride[dim]);
  return GP_OK;
}

int gp_broadcast_strides(int64_t *stride, const gp_tensor *src, int ndim, const int64_t *shape) {
  if (src->ndim > ndim) return GP_ERR;
  int lead = ndim - src->ndim;
  for (int i = 0; i < ndim; i++) {
    if (i < lead) {
      stride[i] = 0;
      continue;
    }
    int64_t s = src->shape[i - lead];
    if (s == shape[i]) stride[i] = s == 1 ? 0 : src->stride[i - lead];
    else if (s == 1) stride[i] = 0;
    else return GP_ERR;
  }
  return GP_OK;
}

int gp_expand(gp_tensor *out, const gp_tensor *src, int ndim, const int64_t *shape_in) {
  GP_TRY(check_alias("expand", out, src));
  GP_TRY(check_shape("expand", ndim, shape_in, 1));
  int64_t shape[GP_MAX_DIMS], stride[GP_MAX_DIMS];
  int lead = ndim - src->ndim;
  for (int i = 0; i < ndim; i++)
    shape[i] = shape_in[i] == -1 && i >= lead ? src->shape[i - lead] : shape_in[i];
  gp_tensor tmp = {0};
  tmp.ndim = ndim;
  for (int i = 0; i < ndim; i++) tmp.shape[i] = shape[i];
  char b1[96], b2[96];
  if (check_shape("expand", ndim, shape, 0) != GP_OK || gp_broadcast_strides(stride, src, ndim, shape) != GP_OK)
    return gp_error("expand: %s cannot be expanded to %s", gp_shape_str(src, b1, sizeof b1),
                    gp_shape_str(&tmp, b2, sizeof b2));
  set_geometry(out, src, ndim, shape, stride, src->offset);
  return GP_OK;
}

int gp_as_strided(gp_tensor *out, const gp_tensor *src, int ndim, const int64_t *shape,
                  const int64_t *stride, int64_t offset) {
  GP_TRY(check_alias("as_strided", out, src));
  GP_TRY(check_shape("as_strided", ndim, shape, 0));
  int64_t lo = offset, hi = offset, n = 1, ext;
  int over = 0;
  for (int i = 0; i < ndim; i++) {
    n *= shape[i];
    if (shape[i] == 0) continue;
    over |= __builtin_mul_overflow(shape[i] - 1, stride[i], &ext);
    over |= ext >= 0 ? __builtin_add_overflow(hi, ext, &hi) : __builtin_add_overflow(lo, ext, &lo);
  }
  if (offset < 0 || offset > gp_storage_numel(src))
    return gp_error("as_strided: offset %lld is outside a storage of %lld elements", (long long)offset,
                    (long long)gp_storage_numel(src));
  if (n > 0 && over)
    return gp_error("as_strided: the strides reach past the range of 64-bit offsets");
  if (n > 0 && (lo < 0 || hi >= gp_storage_numel(src)))
    return gp_error("as_strided: the view reaches elements %lld..%lld of a storage of %lld",
                    (long long)lo, (long long)hi, (long long)gp_storage_numel(src));
  set_geometry(out, src, ndim, shape, stride, offset);
  return GP_OK;
}

/* ---- transfers ---- */

int gp_transfer(gp_tensor *out, const gp_tensor *src) {
  if (!out || !src) return gp_error("to: null argument");
  char b1[96], b2[96];
  if (out->dtype != src->dtype || !gp_same_shape(out, src))
    return gp_error("to: out is %s %s but src is %s %s", gp_dtype_name(out->dtype),
                    gp_shape_str(out, b1, sizeof b1), gp_dtype_name(src->dtype), gp_shape_str(src, b2, sizeof b2));
  if (!gp_is_contiguous(out) || !gp_is_contiguous(src)) return gp_error("to: both tensors must be contiguous");
  size_t n = (size_t)gp_numel(src) * (size_t)gp_elsize(src->dtype);
  if (n == 0) return GP_OK;
  if (out->device == GP_CPU && src->device == GP_CPU) {
    memmove(gp_ptr(out), gp_ptr(src), n);
    return GP_OK;
  }
  int kind = out->device == GP_CUDA ? (src->device == GP_CUDA ? 3 : 1) : 2;
  return gp_cuda_memcpy(gp_ptr(out), gp_ptr(src), n, kind);
}

int gp_from_doubles(gp_tensor *out, const double *src, int64_t n) {
  if (!out || (!src && n)) return gp_error("from_doubles: null argument");
  if (n != gp_numel(out) || !gp_is_contiguous(out))
    return gp_error("from_doubles: %lld values for a tensor of %lld elements", (long long)n,
                    (long long)gp_numel(out));
  if (out->device == GP_CPU) {
    void *p = gp_ptr(out);
    for (int64_t i = 0; i < n; i++) gp_store(p, out->dtype, i, src[i]);
    return GP_OK;
  }
  if (gp_cuda_capturing())
    return gp_error("tensor: a tensor from host values (host to device copy) cannot be made while a CUDA graph is "
                    "being captured (gp.graph): make it before the capture and update it in place");
  gp_tensor *h;
  GP_TRY(gp_tensor_empty(&h, out->dtype, GP_CPU, out->ndim, out->shape));
  int rc = gp_from_doubles(h, src, n);
  if (rc == GP_OK) rc = gp_transfer(out, h);
  if (rc == GP_OK) rc = gp_cuda_sync("from_doubles"); /* h is freed right after */
  gp_tensor_free(h);
  return rc;
}

int gp_to_doubles(double *out, const gp_tensor *src, int64_t n) {
  if (!src || (!out && n)) return gp_error("to_doubles: null argument");
  if (n != gp_numel(src) || !gp_is_contiguous(src))
    return gp_error("to_doubles: %lld values from a tensor of %lld elements", (long long)n,
                    (long long)gp_numel(src));
  if (src->device == GP_CPU) {
    const void *p = gp_ptr(src);
    for (int64_t i = 0; i < n; i++) out[i] = gp_load(p, src->dtype, i);
    return GP_OK;
  }
  if (gp_cuda_capturing())
    return gp_error("item/totable/print: cannot wait for the GPU to read values while a CUDA graph is being captured "
                    "(gp.graph): read them after a replay");
  gp_tensor *h;
  GP_TRY(gp_tensor_empty(&h, src->dtype, GP_CPU, src->ndim, src->shape));
  int rc = gp_transfer(h, src);
  if (rc == GP_OK) rc = gp_to_doubles(out, h, n);
  gp_tensor_free(h);
  return rc;
}

/* ---- loops ---- */

int gp_loop_init(gp_loop *L, const char *op, int nops, const gp_tensor *const *ops) {
  const gp_tensor *o = ops[0];
  int nd = o->ndim;
  int64_t st[4][GP_MAX_DIMS];
  for (int k = 0; k < nops; k++) {
    if (k == 0) {
      for (int d = 0; d < nd; d++) st[0][d] = o->stride[d];
    } else if (gp_broadcast_strides(st[k], ops[k], nd, o->shape) != GP_OK) {
      char b1[96], b2[96];
      return gp_error("%s: an input of shape %s does not broadcast to the output shape %s", op,
                      gp_shape_str(ops[k], b1, sizeof b1), gp_shape_str(o, b2, sizeof b2));
    }
  }
  L->nops = nops;
  L->numel = gp_numel(o);
  /* drop size-1 dims, then merge dim d into d+1 where every operand allows it */
  int n = 0;
  for (int d = 0; d < nd; d++) {
    if (o->shape[d] == 1) continue;
    L->shape[n] = o->shape[d];
    for (int k = 0; k < nops; k++) L->stride[k][n] = st[k][d];
    n++;
  }
  if (n == 0) {
    L->shape[0] = 1;
    for (int k = 0; k < nops; k++) L->stride[k][0] = 0;
    n = 1;
  }
  int m = 0;
  for (int d = 1; d < n; d++) {
    int ok = 1;
    for (int k = 0; k < nops; k++)
      if (L->stride[k][m] != L->stride[k][d] * L->shape[d]) ok = 0;
    if (ok) {
      L->shape[m] *= L->shape[d];
      for (int k = 0; k < nops; k++) L->stride[k][m] = L->stride[k][d];
    } else {
      m++;
      L->shape[m] = L->shape[d];
      for (int k = 0; k < nops; k++) L->stride[k][m] = L->stride[k][d];
    }
  }
  L->ndim = m + 1;
  return GP_OK;
}

int gp_loop_is_flat(const gp_loop *L) {
  if (L->ndim != 1) return 0;
  for (int k = 0; k < L->nops; k++)
    if (L->stride[k][0] != 1 && L->shape[0] != 1) return 0;
  return 1;
}

/* ---- argument specs ----
 * A spec lists the arguments in order, separated by spaces:
 *   [&^]name:TYPE[DIMS][!][constraint]
 * & marks an output, ^ an argument read and written (optimizer state); TYPE is F (a float dtype shared by all F arguments),
 * T (any dtype shared by all T arguments), N (any dtype), I (i32 or i64),
 * B (u8), a dtype name (f32, i64, ...), or f / i for a float or int scalar
 * (not checked here). DIMS is ~ (broadcasts to the first argument), = (same
 * shape as the first argument) or a comma list of sizes: an upper-case
 * symbol, a number, or * (any number of leading dims, the same in every
 * argument that uses it), or H/G: a size that divides the size of H (bound
 * by an earlier argument), G being the quotient (k, v of grouped-query
 * attention: H / G heads). ! requires a contiguous tensor; / requires stride 1
 * on the last dim only (rows at any strides: the kernel reads t->stride). What follows
 * (<SYM: values below SYM; +: positive) only guides the generated tests. */

typedef struct {
  int64_t val[26];
  int by[26]; /* tensor index that bound the symbol, -1 if unbound */
  int star_n, star_by;
  int64_t star[GP_MAX_DIMS];
} bindings;

/* 1 when two different indices of t reach the same element, so that a write
 * through t would be ambiguous (an expanded view, stride 0 on a dim of size
 * > 1, or an as_strided view whose rows interleave). Dims sorted by |stride|:
 * each must step past everything the smaller ones reach. This never misses an
 * overlap; a few exotic as_strided views that do not overlap are reported too. */
int gp_overlaps_itself(const gp_tensor *t) {
  int64_t sz[GP_MAX_DIMS], st[GP_MAX_DIMS];
  int n = 0;
  for (int d = 0; d < t->ndim; d++) {
    if (t->shape[d] == 0) return 0;
    if (t->shape[d] == 1) continue;
    int64_t a = t->stride[d] >= 0 ? t->stride[d] : t->stride[d] == INT64_MIN ? INT64_MAX : -t->stride[d];
    int i = n++;
    for (; i > 0 && st[i - 1] > a; i--) {
      st[i] = st[i - 1];
      sz[i] = sz[i - 1];
    }
    st[i] = a;
    sz[i] = t->shape[d];
  }
  int64_t reach = 0; /* the largest offset the dims so far reach */
  for (int i = 0; i < n; i++) {
    if (st[i] <= reach) return 1;
    int64_t e;
    if (__builtin_mul_overflow(sz[i] - 1, st[i], &e) || __builtin_add_overflow(reach, e, &reach)) return 1;
  }
  return 0;
}

int gp_check(const char *op, const char *spec, int nt, const gp_tensor *const *ts) {
  bindings B;
  for (int i = 0; i < 26; i++) B.by[i] = -1;
  B.star_by = -1;
  B.star_n = 0;
  int dt_F = -1, dt_T = -1, by_F = -1, by_T = -1, k = 0;
  char names[GP_CHECK_MAX][24];
  const char *p = spec;
  char b1[96], b2[96];
  while (*p) {
    while (*p == ' ') p++;
    if (!*p) break;
    int is_out = *p == '&' || *p == '^';
    if (is_out) p++;
    const char *name = p;
    while (*p && *p != ':') p++;
    int nlen = (int)(p - name);
    if (*p != ':') return gp_error("%s: bad spec '%s'", op, spec);
    p++;
    const char *ty = p;
    while (*p && isalnum((unsigned char)*p)) p++;
    int tlen = (int)(p - ty);
    if (tlen == 1 && (*ty == 'f' || *ty == 'i')) { /* scalar */
      while (*p && *p != ' ') p++;
      continue;
    }
    if (k >= nt || k >= GP_CHECK_MAX) return gp_error("%s: spec '%s' has more tensors than given", op, spec);
    snprintf(names[k], sizeof names[k], "%.*s", nlen < 23 ? nlen : 23, name);
    const gp_tensor *t = ts[k];
    if (!t) return gp_error("%s: argument %s is nil (a tensor is needed)", op, names[k]);
    if (t->ndim < 0 || t->ndim > GP_MAX_DIMS || t->dtype < 0 || t->dtype >= GP_NDTYPES || !t->storage)
      return gp_error("%s: argument %s is not a valid tensor", op, names[k]);
    if (t->device != ts[0]->device)
      return gp_error("%s: %s is on %s but %s is on %s (move one with :to())", op, names[k],
                      gp_device_name(t->device), names[0], gp_device_name(ts[0]->device));
    /* dtype */
    int dt = t->dtype, ok = 1;
    if (tlen == 1 && *ty == 'F') {
      if (!gp_is_float(dt))
        return gp_error("%s: %s is %s but a float dtype (%s) is needed", op, names[k], gp_dtype_name(dt),
                        gp_dtype_list(b1, sizeof b1, gp_is_float));
      if (dt_F < 0) { dt_F = dt; by_F = k; }
      else if (dt != dt_F)
        return gp_error("%s: %s is %s but %s is %s", op, names[k], gp_dtype_name(dt), names[by_F], gp_dtype_name(dt_F));
    } else if (tlen == 1 && *ty == 'T') {
      if (dt_T < 0) { dt_T = dt; by_T = k; }
      else if (dt != dt_T)
        return gp_error("%s: %s is %s but %s is %s", op, names[k], gp_dtype_name(dt), names[by_T], gp_dtype_name(dt_T));
    } else if (tlen == 1 && *ty == 'I') {
      ok = dt == GP_I32 || dt == GP_I64;
      if (!ok)
        return gp_error("%s: %s is %s but an index dtype (%s or %s) is needed", op, names[k], gp_dtype_name(dt),
                        gp_dtype_name(GP_I32), gp_dtype_name(GP_I64));
    } else if (tlen == 1 && *ty == 'B') {
      if (dt != GP_U8)
        return gp_error("%s: %s is %s but %s is needed", op, names[k], gp_dtype_name(dt), gp_dtype_name(GP_U8));
    } else if (!(tlen == 1 && *ty == 'N')) {
      int want = gp_dtype_find(ty, (size_t)tlen);
      if (want < 0) return gp_error("%s: bad dtype in spec '%s'", op, spec);
      if (dt != want) return gp_error("%s: %s is %s but %s is needed", op, names[k], gp_dtype_name(dt), gp_dtype_name(want));
    }
    /* shape */
    if (*p == '[') {
      p++;
      if (*p == '~' || *p == '=') {
        int64_t st[GP_MAX_DIMS];
        if (*p == '=' ? !gp_same_shape(t, ts[0]) : gp_broadcast_strides(st, t, ts[0]->ndim, ts[0]->shape) != GP_OK)
          return gp_error("%s: %s is %s but %s is %s", op, names[k], gp_shape_str(t, b1, sizeof b1), names[0],
                          gp_shape_str(ts[0], b2, sizeof b2));
        p++;
      } else {
        /* count the explicit dims to size the * run */
        int nexp = 0, has_star = 0;
        for (const char *q = p; *q && *q != ']'; q++) {
          if (*q == '*') has_star = 1;
          else if (isalnum((unsigned char)*q) && (q == p || q[-1] == ',')) nexp++;
        }
        if (has_star ? t->ndim < nexp : t->ndim != nexp)
          return gp_error("%s: %s has shape %s but %s%d dims are needed", op, names[k], gp_shape_str(t, b1, sizeof b1),
                          has_star ? "at least " : "", nexp);
        int d = 0;
        while (*p && *p != ']') {
          if (*p == ',') { p++; continue; }
          if (*p == '*') {
            int ns = t->ndim - nexp;
            if (B.star_by < 0) {
              B.star_by = k;
              B.star_n = ns;
              for (int i = 0; i < ns; i++) B.star[i] = t->shape[d + i];
            } else {
              int same = B.star_n == ns;
              for (int i = 0; same && i < ns; i++) same = B.star[i] == t->shape[d + i];
              if (!same)
                return gp_error("%s: %s is %s but %s is %s", op, names[k], gp_shape_str(t, b1, sizeof b1),
                                names[B.star_by], gp_shape_str(ts[B.star_by], b2, sizeof b2));
            }
            d += ns;
            p++;
          } else if (isdigit((unsigned char)*p)) {
            int64_t v = strtoll(p, (char **)&p, 10);
            if (t->shape[d] != v)
              return gp_error("%s: %s has shape %s but size %lld is needed at dim %d", op, names[k],
                              gp_shape_str(t, b1, sizeof b1), (long long)v, d + 1);
            d++;
          } else if (isupper((unsigned char)*p) && p[1] == '/') {
            /* H/G: a size that divides H (bound by an earlier argument); the
             * quotient G = H / size is bound like a symbol */
            int s = *p - 'A', g = p[2] - 'A';
            if (!isupper((unsigned char)p[2]) || B.by[s] < 0) return gp_error("%s: bad spec '%s'", op, spec);
            int64_t n = B.val[s], v = t->shape[d];
            if (n == 0 ? v != 0 : (v < 1 || n % v != 0))
              return gp_error("%s: %s has shape %s but its size %lld at dim %d must divide %c = %lld (%s is %s)", op,
                              names[k], gp_shape_str(t, b1, sizeof b1), (long long)v, d + 1, p[0], (long long)n,
                              names[B.by[s]], gp_shape_str(ts[B.by[s]], b2, sizeof b2));
            if (n > 0) {
              if (B.by[g] < 0) {
                B.by[g] = k;
                B.val[g] = n / v;
              } else if (B.val[g] != n / v) {
                return gp_error("%s: %s is %s but %s is %s", op, names[k], gp_shape_str(t, b1, sizeof b1),
                                names[B.by[g]], gp_shape_str(ts[B.by[g]], b2, sizeof b2));
              }
            }
            d++;
            p += 3;
          } else if (isupper((unsigned char)*p)) {
            int s = *p - 'A';
            if (B.by[s] < 0) {
              B.by[s] = k;
              B.val[s] = t->shape[d];
            } else if (B.val[s] != t->shape[d]) {
              return gp_error("%s: %s is %s but %s is %s", op, names[k], gp_shape_str(t, b1, sizeof b1), names[B.by[s]],
                              gp_shape_str(ts[B.by[s]], b2, sizeof b2));
            }
            d++;
            p++;
          } else {
            return gp_error("%s: bad spec '%s'", op, spec);
          }
        }
      }
      if (*p != ']') return gp_error("%s: bad spec '%s'", op, spec);
      p++;
    }
    if (*p == '!' && !gp_is_contiguous(t))
      return gp_error("%s: %s must be contiguous (call :contiguous() first)", op, names[k]);
    if (*p == '/' && t->ndim > 0 && t->shape[t->ndim - 1] > 1 && t->stride[t->ndim - 1] != 1)
      return gp_error("%s: %s %s must have stride 1 on its last dim (call :contiguous() first)", op, names[k],
                      gp_shape_str(t, b1, sizeof b1));
    if (is_out && gp_overlaps_itself(t))
      return gp_error("%s: %s %s is a view whose elements overlap in memory (expanded: stride 0 on a dim of size > 1); "
                      "results written through it would be ambiguous: write into a tensor of its own (clone() it)",
                      op, names[k], gp_shape_str(t, b1, sizeof b1));
    while (*p && *p != ' ') p++;
    k++;
  }
  if (k != nt) return gp_error("%s: %d tensors given, spec '%s' has %d", op, nt, spec, k);
  return GP_OK;
}

/* ---- random ---- */

static uint64_t g_seed = 0x2545F4914F6CDD1Dull, g_offset = 0;

void gp_manual_seed(uint64_t seed) {
  g_seed = seed;
  g_offset = 0;
}
void gp_set_rng_state(uint64_t seed, uint64_t offset) {
  g_seed = seed;
  g_offset = offset;
}
uint64_t gp_seed(void) { return g_seed; }
uint64_t gp_rng_offset(void) { return g_offset; }
uint64_t gp_rng_reserve(uint64_t n) {
  uint64_t rel;
  if (gp_cuda_compiled() && gp_cuda_capture_rng(&rel, n)) return rel; /* relative to the replay's base */
  uint64_t o = g_offset;
  g_offset += (n + 3) / 4;
  return o;
}

/* ---- devices ---- */

/* 1 when CUDA is usable; else 0 with the reason as the last error */
int gp_cuda_available(void) {
  if (!gp_cuda_compiled()) {
    gp_error("cuda: this gpush was built without CUDA (CPU backend only)");
    return 0;
  }
  return gp_cuda_init() == GP_OK;
}

int gp_sync(void) { return gp_cuda_available() ? gp_cuda_device_sync("sync") : GP_OK; }
int gp_device_sync(void) { return gp_sync(); }

int gp_runtime_info(char *buf, int n) {
  if (!buf || n <= 0) return gp_error("runtime_info: no buffer");
  if (!gp_cuda_compiled()) {
    snprintf(buf, (size_t)n, "built without CUDA (CPU backend only)");
    return GP_OK;
  }
  return gp_cuda_runtime_info(buf, n);
}
