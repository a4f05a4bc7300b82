/* gguf.c: reading GGUF files (the llama.cpp / ggml model format), versions 2 and 3.
 *
 * A file is, little-endian throughout:
 *   "GGUF", u32 version, u64 tensor count, u64 metadata count;
 *   the metadata: key (a string), u32 value type, the value;
 *   the tensor infos: name (a string), u32 n_dims, n_dims u64 sizes (ne0, the
 *     fastest-varying, first), u32 ggml type, u64 offset into the data section;
 *   padding to the alignment (metadata general.alignment, default 32);
 *   the data section.
 * A string is a u64 length and that many bytes (no NUL); an array is a u32
 * element type, a u64 count and the elements. Version 1 used 32-bit counts
 * and lengths and is refused.
 *
 * The file is mapped read-only and the whole header is parsed and checked at
 * open, before anything is handed out: every length against the bytes left,
 * every count against what it needs at least, dims and byte sizes for
 * overflow, types, the alignment, and each tensor's extent (aligned, inside
 * the file, not overlapping another tensor, unique names). Metadata values
 * are not copied: accessors point into the mapping. Tensor data is touched
 * only by gp_gguf_read, so listing a large file reads only its header. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define GG_MAX_DIMS 4

enum {
  GG_UINT8 = 0, GG_INT8, GG_UINT16, GG_INT16, GG_UINT32, GG_INT32, GG_FLOAT32, GG_BOOL, GG_STRING, GG_ARRAY,
  GG_UINT64, GG_INT64, GG_FLOAT64, GG_NVTYPES
};
static const char *const VT_NAME[GG_NVTYPES] = {"u8",  "i8",     "u16",   "i16", "u32", "i32", "f32",
                                                "bool", "string", "array", "u64", "i64", "f64"};
static const int VT_SIZE[GG_NVTYPES] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

/* ggml types: id, name, elements a block, bytes a block (ggml's type traits) */
static const struct {
  int id;
  const char *name;
  int block, bytes;
} GG_TYPES[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},        {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},     {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},    {11, "Q3_K", 256, 110},  {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},  {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},  {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},   {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},        {25, "I16", 1, 2},
    {26, "I32", 1, 4},        {27, "I64", 1, 8},       {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},  {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
    {40, "NVFP4", 64, 36},    {41, "Q1_0", 128, 18},
};
#define GG_NTYPES ((int)(sizeof GG_TYPES / sizeof GG_TYPES[0]))

static int type_index(uint32_t id) {
  for (int i = 0; i < GG_NTYPES; i++)
    if ((uint32_t)GG_TYPES[i].id == id) return i;
  return -1;
}

const char *gp_gguf_type_name(int type) {
  int i = type < 0 ? -1 : type_index((uint32_t)type);
  return i < 0 ? NULL : GG_TYPES[i].name;
}

int gp_gguf_type_size(int *block, int *bytes, int type) {
  int i = type < 0 ? -1 : type_index((uint32_t)type);
  if (i < 0) return gp_error("gguf: unknown ggml type %d", type);
  if (block) *block = GG_TYPES[i].block;
  if (bytes) *bytes = GG_TYPES[i].bytes;
  return GP_OK;
}

typedef struct {
  uint64_t key, klen; /* file offset and length of the key */
  int type, etype;    /* value type; for arrays the element type, else = type */
  uint64_t n;         /* elements (1 for a scalar) */
  uint64_t at;        /* file offset of the value, the first element, or a string's bytes */
  uint64_t slen;      /* a string scalar's length */
  uint64_t *soff;     /* a string array: file offset of each element's length field */
} gg_kv;

typedef struct {
  char *name;
  int type, ndim; /* ggml type id; dims (ne0 first) */
  int64_t ne[GG_MAX_DIMS];
  uint64_t offset, nbytes; /* in the data section */
} gg_tensor;

struct gp_gguf {
  char *path;
  const uint8_t *map;
  uint64_t size;
  uint32_t version;
  uint64_t alignment, data_start;
  int64_t nkv, ntensors;
  gg_kv *kv;
  gg_tensor *t;
  int64_t *by_name; /* tensor indices sorted by name */
};

/* ---- the cursor over the mapped header ---- */

typedef struct {
  const uint8_t *p;
  uint64_t size, pos;
  const char *path;
  char what[192]; /* the field being read, for messages: "metadata entry 3 ('general.name')" */
} rd;

static uint64_t le(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static int need(rd *r, uint64_t n, const char *field) {
  if (n > r->size - r->pos)
    return gp_error("gguf: %s: truncated: %s%s%s needs %llu bytes at offset %llu but the file ends at %llu", r->path,
                    r->what, *r->what ? ": " : "", field, (unsigned long long)n, (unsigned long long)r->pos,
                    (unsigned long long)r->size);
  return GP_OK;
}

static int rd_u32(rd *r, uint32_t *v, const char *field) {
  GP_TRY(need(r, 4, field));
  *v = (uint32_t)le(r->p + r->pos, 4);
  r->pos += 4;
  return GP_OK;
}

static int rd_u64(rd *r, uint64_t *v, const char *field) {
  GP_TRY(need(r, 8, field));
  *v = le(r->p + r->pos, 8);
  r->pos += 8;
  return GP_OK;
}

/* a string: *at = offset of its bytes, *len its length */
static int rd_str(rd *r, uint64_t *at, uint64_t *len, const char *field) {
  uint64_t n;
  GP_TRY(rd_u64(r, &n, field));
  if (n > r->size - r->pos)
    return gp_error("gguf: %s: %s%s%s has length %llu at offset %llu, past the end of the file (%llu bytes)", r->path,
                    r->what, *r->what ? ": " : "", field, (unsigned long long)n, (unsigned long long)(r->pos - 8),
                    (unsigned long long)r->size);
  *at = r->pos;
  *len = n;
  r->pos += n;
  return GP_OK;
}

/* "'name'" of a string in the file, shortened and with control bytes as '?', for messages */
static const char *quoted(char *buf, size_t n, const uint8_t *s, uint64_t len) {
  size_t k = 0, max = n - 6;
  buf[k++] = '\'';
  for (uint64_t i = 0; i < len && k < max; i++) buf[k++] = (s[i] < 32 || s[i] == 127) ? '?' : (char)s[i];
  if (len > max - 1) {
    buf[k++] = '.';
    buf[k++] = '.';
    buf[k++] = '.';
  }
  buf[k++] = '\'';
  buf[k] = 0;
  return buf;
}

/* ---- metadata ---- */

static int parse_value(rd *r, gg_kv *kv) {
  uint32_t type;
  GP_TRY(rd_u32(r, &type, "the value type"));
  if (type >= GG_NVTYPES)
    return gp_error("gguf: %s: %s has an unknown value type %u (0 to %d are defined)", r->path, r->what, type,
                    GG_NVTYPES - 1);
  kv->type = kv->etype = (int)type;
  kv->n = 1;
  if (type == GG_STRING) return rd_str(r, &kv->at, &kv->slen, "the string");
  if (type != GG_ARRAY) {
    GP_TRY(need(r, (uint64_t)VT_SIZE[type], "the value"));
    kv->at = r->pos;
    r->pos += (uint64_t)VT_SIZE[type];
    return GP_OK;
  }
  uint32_t et;
  uint64_t n;
  GP_TRY(rd_u32(r, &et, "the array element type"));
  if (et >= GG_NVTYPES)
    return gp_error("gguf: %s: %s is an array of an unknown value type %u", r->path, r->what, et);
  if (et == GG_ARRAY) return gp_error("gguf: %s: %s is an array of arrays (not supported)", r->path, r->what);
  GP_TRY(rd_u64(r, &n, "the array length"));
  kv->etype = (int)et;
  kv->n = n;
  uint64_t left = r->size - r->pos;
  if (et != GG_STRING) {
    uint64_t es = (uint64_t)VT_SIZE[et];
    if (n > left / es)
      return gp_error("gguf: %s: %s is an array of %llu %s values (%llu bytes each) but only %llu bytes are left in the file",
                      r->path, r->what, (unsigned long long)n, VT_NAME[et], (unsigned long long)es,
                      (unsigned long long)left);
    kv->at = r->pos;
    r->pos += n * es;
    return GP_OK;
  }
  /* strings: each one at least its 8-byte length */
  if (n > left / 8)
    return gp_error("gguf: %s: %s is an array of %llu strings but only %llu bytes are left in the file (8 a string at least)",
                    r->path, r->what, (unsigned long long)n, (unsigned long long)left);
  kv->soff = malloc(sizeof *kv->soff * (n ? n : 1));
  if (!kv->soff) return gp_error_oom("gguf: %s: out of host memory for an array of %llu strings", r->path, (unsigned long long)n);
  kv->at = r->pos;
  char field[48];
  for (uint64_t j = 0; j < n; j++) {
    kv->soff[j] = r->pos;
    uint64_t at, len;
    snprintf(field, sizeof field, "string %llu of the array", (unsigned long long)j);
    GP_TRY(rd_str(r, &at, &len, field));
  }
  return GP_OK;
}

static const gg_kv *find_kv(const gp_gguf *g, const char *key) {
  size_t n = strlen(key);
  for (int64_t i = 0; i < g->nkv; i++)
    if (g->kv[i].klen == n && !memcmp(g->map + g->kv[i].key, key, n)) return &g->kv[i];
  return NULL;
}

static int kv_int(const gp_gguf *g, const gg_kv *kv, uint64_t j, int64_t *v) {
  const uint8_t *p = g->map + kv->at + j * (uint64_t)VT_SIZE[kv->etype];
  switch (kv->etype) {
    case GG_UINT8: case GG_BOOL: *v = p[0]; break;
    case GG_INT8: *v = (int8_t)p[0]; break;
    case GG_UINT16: *v = (int64_t)le(p, 2); break;
    case GG_INT16: *v = (int16_t)le(p, 2); break;
    case GG_UINT32: *v = (int64_t)le(p, 4); break;
    case GG_INT32: *v = (int32_t)le(p, 4); break;
    case GG_UINT64: case GG_INT64: *v = (int64_t)le(p, 8); break;
    default: return GP_ERR;
  }
  return GP_OK;
}

static double kv_num(const gp_gguf *g, const gg_kv *kv, uint64_t j) {
  const uint8_t *p = g->map + kv->at + j * (uint64_t)VT_SIZE[kv->etype];
  int64_t v = 0;
  switch (kv->etype) {
    case GG_FLOAT32: {
      uint32_t u = (uint32_t)le(p, 4);
      float f;
      memcpy(&f, &u, 4);
      return f;
    }
    case GG_FLOAT64: {
      uint64_t u = le(p, 8);
      double d;
      memcpy(&d, &u, 8);
      return d;
    }
    case GG_UINT64: return (double)le(p, 8);
    default: kv_int(g, kv, j, &v); return (double)v;
  }
}

/* ---- tensor infos ---- */

static int parse_tensor(rd *r, gg_tensor *t, int64_t idx) {
  uint64_t at, len;
  snprintf(r->what, sizeof r->what, "tensor info %lld", (long long)idx);
  GP_TRY(rd_str(r, &at, &len, "the name"));
  if (memchr(r->p + at, 0, len)) return gp_error("gguf: %s: tensor %lld has a name with a NUL byte", r->path, (long long)idx);
  t->name = malloc(len + 1);
  if (!t->name) return gp_error_oom("gguf: %s: out of host memory", r->path);
  memcpy(t->name, r->p + at, len);
  t->name[len] = 0;
  char qn[96];
  snprintf(r->what, sizeof r->what, "tensor %s", quoted(qn, sizeof qn, r->p + at, len));
  uint32_t nd, type;
  GP_TRY(rd_u32(r, &nd, "n_dims"));
  if (nd > GG_MAX_DIMS)
    return gp_error("gguf: %s: %s has %u dims (at most %d)", r->path, r->what, nd, GG_MAX_DIMS);
  t->ndim = (int)nd;
  uint64_t numel = 1;
  int overflow = 0;
  for (int d = 0; d < GG_MAX_DIMS; d++) t->ne[d] = 1;
  for (uint32_t d = 0; d < nd; d++) {
    uint64_t v;
    GP_TRY(rd_u64(r, &v, "a size"));
    if (v > (uint64_t)INT64_MAX)
      return gp_error("gguf: %s: %s has size %llu at dim %u (more than 2^63 - 1)", r->path, r->what,
                      (unsigned long long)v, d + 1);
    t->ne[d] = (int64_t)v;
    if (v && numel > (uint64_t)INT64_MAX / v) overflow = 1;
    else numel *= v;
  }
  if (overflow) {
    int64_t *e = t->ne;
    return gp_error("gguf: %s: %s has sizes (%lld, %lld, %lld, %lld) whose product overflows", r->path, r->what,
                    (long long)e[0], (long long)e[1], (long long)e[2], (long long)e[3]);
  }
  GP_TRY(rd_u32(r, &type, "the ggml type"));
  int ti = type_index(type);
  if (ti < 0) return gp_error("gguf: %s: %s has an unknown ggml type %u", r->path, r->what, type);
  t->type = (int)type;
  uint64_t blk = (uint64_t)GG_TYPES[ti].block, bs = (uint64_t)GG_TYPES[ti].bytes;
  if ((uint64_t)t->ne[0] % blk != 0)
    return gp_error("gguf: %s: %s of type %s has rows of %lld elements (ne0), not a multiple of the block size %llu",
                    r->path, r->what, GG_TYPES[ti].name, (long long)t->ne[0], (unsigned long long)blk);
  uint64_t nblocks = numel / blk;
  if (nblocks > (uint64_t)INT64_MAX / bs)
    return gp_error("gguf: %s: %s is too large (%llu blocks of %llu bytes)", r->path, r->what,
                    (unsigned long long)nblocks, (unsigned long long)bs);
  t->nbytes = nblocks * bs;
  GP_TRY(rd_u64(r, &t->offset, "the data offset"));
  return GP_OK;
}

/* ---- open, close ---- */

void gp_gguf_close(gp_gguf *g) {
  if (!g) return;
  if (g->map) munmap((void *)g->map, g->size);
  if (g->kv)
    for (int64_t i = 0; i < g->nkv; i++) free(g->kv[i].soff);
  if (g->t)
    for (int64_t i = 0; i < g->ntensors; i++) free(g->t[i].name);
  free(g->kv);
  free(g->t);
  free(g->by_name);
  free(g->path);
  free(g);
}

/* comparators for qsort_r over tensor or metadata indices */
static int cmp_name(const void *a, const void *b, void *arg) {
  const gp_gguf *g = arg;
  return strcmp(g->t[*(const int64_t *)a].name, g->t[*(const int64_t *)b].name);
}
static int cmp_offset(const void *a, const void *b, void *arg) {
  const gp_gguf *g = arg;
  const gg_tensor *x = &g->t[*(const int64_t *)a], *y = &g->t[*(const int64_t *)b];
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}
static int cmp_key(const void *a, const void *b, void *arg) {
  const gp_gguf *g = arg;
  const gg_kv *x = &g->kv[*(const int64_t *)a], *y = &g->kv[*(const int64_t *)b];
  uint64_t n = x->klen < y->klen ? x->klen : y->klen;
  int c = memcmp(g->map + x->key, g->map + y->key, n);
  return c ? c : (x->klen < y->klen ? -1 : x->klen > y->klen);
}

static int check_layout(gp_gguf *g) {
  const char *path = g->path;
  char qn[96];
  /* the alignment */
  g->alignment = 32;
  const gg_kv *al = find_kv(g, "general.alignment");
  if (al) {
    int64_t v;
    if (al->type == GG_ARRAY || kv_int(g, al, 0, &v) != GP_OK || al->type == GG_BOOL)
      return gp_error("gguf: %s: general.alignment (%s) is not an integer", path,
                      al->type == GG_ARRAY ? "array" : VT_NAME[al->type]);
    if (v <= 0 || v > (1 << 30) || (v & (v - 1)))
      return gp_error("gguf: %s: general.alignment is %lld, not a power of two up to 2^30", path, (long long)v);
    g->alignment = (uint64_t)v;
  }
  uint64_t a = g->alignment;
  g->data_start = (g->data_start + a - 1) / a * a;
  int64_t n = g->ntensors;
  g->by_name = malloc(sizeof *g->by_name * (size_t)(n ? n : 1));
  int64_t m = n > g->nkv ? n : g->nkv;
  int64_t *ord = malloc(sizeof *ord * (size_t)(m ? m : 1));
  if (!g->by_name || !ord) {
    free(ord);
    return gp_error_oom("gguf: %s: out of host memory", path);
  }
  int rc = GP_OK;
  /* unique keys */
  for (int64_t i = 0; i < g->nkv; i++) ord[i] = i;
  qsort_r(ord, (size_t)g->nkv, sizeof *ord, cmp_key, g);
  for (int64_t i = 1; i < g->nkv && rc == GP_OK; i++)
    if (!cmp_key(&ord[i - 1], &ord[i], g)) {
      const gg_kv *kv = &g->kv[ord[i]];
      rc = gp_error("gguf: %s: the metadata key %s appears twice", path, quoted(qn, sizeof qn, g->map + kv->key, kv->klen));
    }
  /* each tensor aligned and inside the file */
  for (int64_t i = 0; i < n && rc == GP_OK; i++) {
    const gg_tensor *t = &g->t[i];
    if (t->offset % a)
      rc = gp_error("gguf: %s: tensor '%s' has offset %llu, not a multiple of the alignment %llu", path, t->name,
                    (unsigned long long)t->offset, (unsigned long long)a);
    else if (g->data_start > g->size || t->offset > g->size - g->data_start ||
             t->nbytes > g->size - g->data_start - t->offset)
      rc = gp_error("gguf: %s: tensor '%s' extends past the end of the file (offset %llu + %llu bytes > %llu)", path,
                    t->name,
                    (unsigned long long)(t->offset > UINT64_MAX - g->data_start ? UINT64_MAX : g->data_start + t->offset),
                    (unsigned long long)t->nbytes, (unsigned long long)g->size);
  }
  /* unique names */
  for (int64_t i = 0; i < n; i++) g->by_name[i] = i;
  qsort_r(g->by_name, (size_t)n, sizeof *g->by_name, cmp_name, g);
  for (int64_t i = 1; i < n && rc == GP_OK; i++)
    if (!strcmp(g->t[g->by_name[i - 1]].name, g->t[g->by_name[i]].name))
      rc = gp_error("gguf: %s: the tensor name '%s' appears twice", path, g->t[g->by_name[i]].name);
  /* no two tensors share bytes */
  for (int64_t i = 0; i < n; i++) ord[i] = i;
  qsort_r(ord, (size_t)n, sizeof *ord, cmp_offset, g);
  uint64_t end = 0;
  int64_t last = -1;
  for (int64_t i = 0; i < n && rc == GP_OK; i++) {
    const gg_tensor *t = &g->t[ord[i]];
    if (t->nbytes == 0) continue;
    if (last >= 0 && t->offset < end)
      rc = gp_error("gguf: %s: tensor '%s' (bytes %llu to %llu of the data) overlaps tensor '%s' (to %llu)", path,
                    t->name, (unsigned long long)t->offset, (unsigned long long)(t->offset + t->nbytes),
                    g->t[last].name, (unsigned long long)end);
    end = t->offset + t->nbytes;
    last = ord[i];
  }
  free(ord);
  return rc;
}

static int parse(gp_gguf *g) {
  rd r = {g->map, g->size, 0, g->path, ""};
  const char *path = g->path;
  if (g->size < 4 || memcmp(g->map, "GGUF", 4) != 0) {
    char got[16] = "";
    for (uint64_t i = 0; i < 4 && i < g->size; i++)
      snprintf(got + strlen(got), sizeof got - strlen(got), "%02x", g->map[i]);
    return gp_error("gguf: %s: not a GGUF file (the magic is %s%s, not 47475546 \"GGUF\")", path, g->size ? "" : "missing",
                    got);
  }
  r.pos = 4;
  GP_TRY(rd_u32(&r, &g->version, "the version"));
  if (g->version == 1)
    return gp_error("gguf: %s: GGUF version 1 is not supported (only 2 and 3; convert the file again)", path);
  if (g->version != 2 && g->version != 3) {
    if ((g->version & 0xffff) == 0 && g->version != 0)
      return gp_error("gguf: %s: a big-endian GGUF file (version %u byte-swapped) is not supported", path,
                      (unsigned)__builtin_bswap32(g->version));
    return gp_error("gguf: %s: unknown GGUF version %u (2 and 3 are supported)", path, g->version);
  }
  uint64_t nt, nkv;
  GP_TRY(rd_u64(&r, &nt, "the tensor count"));
  GP_TRY(rd_u64(&r, &nkv, "the metadata count"));
  uint64_t left = g->size - r.pos;
  /* at least 8 + 4 + 1 bytes a metadata entry, 8 + 4 + 4 + 8 a tensor info */
  if (nkv > left / 13)
    return gp_error("gguf: %s: the header claims %llu metadata entries but only %llu bytes follow", path,
                    (unsigned long long)nkv, (unsigned long long)left);
  if (nt > left / 24)
    return gp_error("gguf: %s: the header claims %llu tensors but only %llu bytes follow", path, (unsigned long long)nt,
                    (unsigned long long)left);
  if (nkv * 13 + nt * 24 > left) /* no overflow: each term is at most left */
    return gp_error("gguf: %s: the header claims %llu metadata entries and %llu tensors but only %llu bytes follow",
                    path, (unsigned long long)nkv, (unsigned long long)nt, (unsigned long long)left);
  g->kv = calloc(nkv ? nkv : 1, sizeof *g->kv);
  g->t = calloc(nt ? nt : 1, sizeof *g->t);
  if (!g->kv || !g->t) return gp_error_oom("gguf: %s: out of host memory", path);
  char qk[96];
  for (uint64_t i = 0; i < nkv; i++) {
    gg_kv *kv = &g->kv[i];
    g->nkv = (int64_t)i + 1;
    snprintf(r.what, sizeof r.what, "metadata entry %llu", (unsigned long long)i);
    GP_TRY(rd_str(&r, &kv->key, &kv->klen, "the key"));
    snprintf(r.what, sizeof r.what, "metadata entry %llu (%s)", (unsigned long long)i,
             quoted(qk, sizeof qk, g->map + kv->key, kv->klen));
    GP_TRY(parse_value(&r, kv));
  }
  for (uint64_t i = 0; i < nt; i++) {
    g->ntensors = (int64_t)i + 1;
    GP_TRY(parse_tensor(&r, &g->t[i], (int64_t)i));
  }
  g->data_start = r.pos;
  return check_layout(g);
}

int gp_gguf_open(gp_gguf **out, const char *path) {
  if (!out || !path) return gp_error("gguf: null argument");
  *out = NULL;
  gp_gguf *g = calloc(1, sizeof *g);
  if (!g || !(g->path = strdup(path))) {
    free(g);
    return gp_error_oom("gguf: out of host memory");
  }
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int rc = gp_error("gguf: cannot open %s: %s", path, strerror(errno));
    gp_gguf_close(g);
    return rc;
  }
  struct stat st;
  int rc = GP_OK;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    rc = gp_error("gguf: %s is not a regular file", path);
  } else if (st.st_size < 24) {
    rc = gp_error("gguf: %s: truncated: %lld bytes, less than the 24 of a GGUF header", path, (long long)st.st_size);
    /* still report a bad magic first when there are 4 bytes to read */
    unsigned char m[4];
    if (st.st_size >= 4 && pread(fd, m, 4, 0) == 4 && memcmp(m, "GGUF", 4) != 0)
      rc = gp_error("gguf: %s: not a GGUF file (the magic is %02x%02x%02x%02x, not 47475546 \"GGUF\")", path, m[0], m[1],
                    m[2], m[3]);
  } else {
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) rc = gp_error("gguf: cannot map %s: %s", path, strerror(errno));
    else {
      g->map = p;
      g->size = (uint64_t)st.st_size;
    }
  }
  close(fd);
  if (rc == GP_OK) rc = parse(g);
  if (rc != GP_OK) {
    gp_gguf_close(g);
    return rc;
  }
  *out = g;
  return GP_OK;
}

/* ---- accessors ---- */

int gp_gguf_version(const gp_gguf *g) { return g ? (int)g->version : 0; }
int64_t gp_gguf_alignment(const gp_gguf *g) { return g ? (int64_t)g->alignment : 0; }
int64_t gp_gguf_data_offset(const gp_gguf *g) { return g ? (int64_t)g->data_start : 0; }
int64_t gp_gguf_file_size(const gp_gguf *g) { return g ? (int64_t)g->size : 0; }
int64_t gp_gguf_meta_count(const gp_gguf *g) { return g ? g->nkv : 0; }
int64_t gp_gguf_tensor_count(const gp_gguf *g) { return g ? g->ntensors : 0; }

static int get_kv(const gg_kv **kv, const gp_gguf *g, int64_t i) {
  if (!g || i < 0 || i >= g->nkv) return gp_error("gguf: no metadata entry %lld", (long long)i);
  *kv = &g->kv[i];
  return GP_OK;
}

/* "metadata 'key'" for messages */
static const char *kv_name(char *buf, size_t n, const gp_gguf *g, const gg_kv *kv) {
  char q[80];
  snprintf(buf, n, "%s: metadata %s", g->path, quoted(q, sizeof q, g->map + kv->key, kv->klen));
  return buf;
}

int gp_gguf_meta_key(const char **key, int64_t *len, const gp_gguf *g, int64_t i) {
  const gg_kv *kv = NULL;
  GP_TRY(get_kv(&kv, g, i));
  *key = (const char *)g->map + kv->key;
  *len = (int64_t)kv->klen;
  return GP_OK;
}

int gp_gguf_meta_type(int *type, int *elem_type, int64_t *n, const gp_gguf *g, int64_t i) {
  const gg_kv *kv = NULL;
  GP_TRY(get_kv(&kv, g, i));
  *type = kv->type;
  *elem_type = kv->etype;
  *n = (int64_t)kv->n;
  return GP_OK;
}

int64_t gp_gguf_meta_find(const gp_gguf *g, const char *key) {
  if (!g || !key) return -1;
  const gg_kv *kv = find_kv(g, key);
  return kv ? kv - g->kv : -1;
}

/* element j of entry i (j = 0 for a scalar) */
static int get_elem(const gg_kv **kv, const gp_gguf *g, int64_t i, int64_t j) {
  GP_TRY(get_kv(kv, g, i));
  if (j < 0 || (uint64_t)j >= (*kv)->n || ((*kv)->type != GG_ARRAY && j != 0)) {
    char b[160];
    return gp_error("gguf: %s has no element %lld (%llu)", kv_name(b, sizeof b, g, *kv), (long long)j,
                    (unsigned long long)(*kv)->n);
  }
  return GP_OK;
}

static int not_number(const gp_gguf *g, const gg_kv *kv) {
  char b[160];
  return gp_error("gguf: %s (%s%s) is not a number", kv_name(b, sizeof b, g, kv),
                  kv->type == GG_ARRAY ? "array of " : "", VT_NAME[kv->etype]);
}

int gp_gguf_meta_number(double *v, const gp_gguf *g, int64_t i, int64_t j) {
  const gg_kv *kv = NULL;
  GP_TRY(get_elem(&kv, g, i, j));
  if (kv->etype == GG_STRING) return not_number(g, kv);
  *v = kv_num(g, kv, (uint64_t)j);
  return GP_OK;
}

int gp_gguf_meta_int(int64_t *v, const gp_gguf *g, int64_t i, int64_t j) {
  const gg_kv *kv = NULL;
  GP_TRY(get_elem(&kv, g, i, j));
  if (kv_int(g, kv, (uint64_t)j, v) != GP_OK) {
    char b[160];
    return gp_error("gguf: %s (%s%s) is not an integer", kv_name(b, sizeof b, g, kv),
                    kv->type == GG_ARRAY ? "array of " : "", VT_NAME[kv->etype]);
  }
  return GP_OK;
}

int gp_gguf_meta_numbers(double *out, const gp_gguf *g, int64_t i, int64_t start, int64_t n) {
  const gg_kv *kv = NULL;
  GP_TRY(get_kv(&kv, g, i));
  if (kv->etype == GG_STRING) return not_number(g, kv);
  if (start < 0 || n < 0 || (uint64_t)start > kv->n || (uint64_t)n > kv->n - (uint64_t)start) {
    char b[160];
    return gp_error("gguf: %s: elements %lld to %lld are outside its %llu", kv_name(b, sizeof b, g, kv),
                    (long long)start, (long long)(start + n), (unsigned long long)kv->n);
  }
  for (int64_t k = 0; k < n; k++) out[k] = kv_num(g, kv, (uint64_t)(start + k));
  return GP_OK;
}

int gp_gguf_meta_string(const char **s, int64_t *len, const gp_gguf *g, int64_t i, int64_t j) {
  const gg_kv *kv = NULL;
  GP_TRY(get_elem(&kv, g, i, j));
  if (kv->etype != GG_STRING) {
    char b[160];
    return gp_error("gguf: %s (%s%s) is not a string", kv_name(b, sizeof b, g, kv),
                    kv->type == GG_ARRAY ? "array of " : "", VT_NAME[kv->etype]);
  }
  if (kv->type == GG_STRING) {
    *s = (const char *)g->map + kv->at;
    *len = (int64_t)kv->slen;
  } else {
    uint64_t o = kv->soff[j];
    *s = (const char *)g->map + o + 8;
    *len = (int64_t)le(g->map + o, 8);
  }
  return GP_OK;
}

int gp_gguf_tensor_info(const char **name, int *type, int *ndim, int64_t *dims, int64_t *offset, int64_t *nbytes,
                        const gp_gguf *g, int64_t i) {
  if (!g || i < 0 || i >= g->ntensors) return gp_error("gguf: no tensor %lld", (long long)i);
  const gg_tensor *t = &g->t[i];
  if (name) *name = t->name;
  if (type) *type = t->type;
  if (ndim) *ndim = t->ndim;
  if (dims)
    for (int d = 0; d < GG_MAX_DIMS; d++) dims[d] = t->ne[d];
  if (offset) *offset = (int64_t)(g->data_start + t->offset);
  if (nbytes) *nbytes = (int64_t)t->nbytes;
  return GP_OK;
}

int64_t gp_gguf_tensor_find(const gp_gguf *g, const char *name) {
  if (!g || !name) return -1;
  int64_t lo = 0, hi = g->ntensors - 1;
  while (lo <= hi) {
    int64_t mid = lo + (hi - lo) / 2;
    int c = strcmp(g->t[g->by_name[mid]].name, name);
    if (c == 0) return g->by_name[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

/* the gpush dtype that holds a ggml type's elements as they are (-1: none) */
static int native_dtype(int type) {
  switch (type) {
    case 0: return GP_F32;
    case 1: return GP_F16;
    case 30: return GP_BF16;
    case 26: return GP_I32;
    case 27: return GP_I64;
    case 28: return GP_F64;
    default: return -1;
  }
}

int gp_gguf_read(gp_gguf *g, int64_t i, gp_tensor *out) {
  if (!g || !out) return gp_error("gguf: null argument");
  if (i < 0 || i >= g->ntensors) return gp_error("gguf: %s: no tensor %lld (the file has %lld)", g->path, (long long)i,
                                                  (long long)g->ntensors);
  const gg_tensor *t = &g->t[i];
  int nd = native_dtype(t->type);
  uint64_t nb = t->nbytes;
  if ((out->dtype != GP_U8 && out->dtype != nd) || (uint64_t)gp_numel(out) * (uint64_t)gp_elsize(out->dtype) != nb ||
      (nb > 0 && !gp_is_contiguous(out))) {
    char b[96];
    if (nd >= 0)
      return gp_error("gguf: %s: tensor '%s' (%s, %llu bytes) is read into a contiguous u8 tensor of %llu elements or "
                      "a %s tensor of %llu, not a %s %s", g->path, t->name, gp_gguf_type_name(t->type),
                      (unsigned long long)nb, (unsigned long long)nb, gp_dtype_name(nd),
                      (unsigned long long)(nb / (uint64_t)gp_elsize(nd)), gp_dtype_name(out->dtype),
                      gp_shape_str(out, b, sizeof b));
    return gp_error("gguf: %s: tensor '%s' (%s, %llu bytes) is read into a contiguous u8 tensor of %llu elements, "
                    "not a %s %s", g->path, t->name, gp_gguf_type_name(t->type), (unsigned long long)nb,
                    (unsigned long long)nb, gp_dtype_name(out->dtype), gp_shape_str(out, b, sizeof b));
  }
  if (nb == 0) return GP_OK;
  const uint8_t *src = g->map + g->data_start + t->offset;
  if (out->device == GP_CPU) {
    memcpy(gp_ptr(out), src, nb);
    return GP_OK;
  }
  return gp_cuda_memcpy(gp_ptr(out), src, nb, 1);
}
