/* safetensors.c: reading and writing the safetensors format.
 *
 * A file is: an 8-byte little-endian header length N, N bytes of JSON
 * ({"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
 * "__metadata__": {"key": "value"}}), then the data. The header is parsed
 * with cJSON and every entry is checked (dtype, shape, offsets inside the
 * data and consistent with the shape, no overlaps) before any tensor is
 * read, so a truncated or hostile file gives an error, never a bad read. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

#define ST_MAX_HEADER (100u << 20)

typedef struct {
  char *name;
  int dtype, ndim;
  int64_t shape[GP_MAX_DIMS];
  uint64_t begin, end;
} st_entry;

struct gp_st {
  FILE *f;
  uint64_t data_start, data_size;
  int n, nmeta;
  st_entry *e;
  char **meta_k, **meta_v;
};

static const struct {
  const char *name;
  int dtype;
} ST_DT[] = {{"F32", GP_F32}, {"BF16", GP_BF16}, {"F16", GP_F16}, {"I32", GP_I32},
             {"I64", GP_I64}, {"U8", GP_U8},     {"BOOL", GP_U8}, {"F64", GP_F64}};

static int st_dtype(const char *s) {
  for (size_t i = 0; i < sizeof ST_DT / sizeof *ST_DT; i++)
    if (!strcmp(ST_DT[i].name, s)) return ST_DT[i].dtype;
  return -1;
}

static const char *st_dtype_name(int dt) {
  for (size_t i = 0; i < sizeof ST_DT / sizeof *ST_DT; i++)
    if (ST_DT[i].dtype == dt) return ST_DT[i].name;
  return "?";
}

void gp_st_close(gp_st *st) {
  if (!st) return;
  if (st->f) fclose(st->f);
  for (int i = 0; i < st->n; i++) free(st->e[i].name);
  for (int i = 0; i < st->nmeta; i++) {
    free(st->meta_k[i]);
    free(st->meta_v[i]);
  }
  free(st->e);
  free(st->meta_k);
  free(st->meta_v);
  free(st);
}

static int cmp_begin(const void *a, const void *b) {
  const st_entry *x = a, *y = b;
  return x->begin < y->begin ? -1 : x->begin > y->begin;
}

static int parse_entry(st_entry *e, const cJSON *item, uint64_t data_size, const char *path) {
  const char *nm = item->string;
  if (!cJSON_IsObject(item)) return gp_error("load: %s: entry '%s' is not an object", path, nm);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(item, "shape");
  const cJSON *off = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
  if (!cJSON_IsString(dt) || (e->dtype = st_dtype(dt->valuestring)) < 0)
    return gp_error("load: %s: tensor '%s' has an unsupported dtype %s", path, nm,
                    cJSON_IsString(dt) ? dt->valuestring : "(missing)");
  if (!cJSON_IsArray(sh) || cJSON_GetArraySize(sh) > GP_MAX_DIMS)
    return gp_error("load: %s: tensor '%s' has a bad shape (an array of at most %d sizes is needed)", path, nm,
                    GP_MAX_DIMS);
  e->ndim = cJSON_GetArraySize(sh);
  uint64_t numel = 1;
  for (int d = 0; d < e->ndim; d++) {
    const cJSON *v = cJSON_GetArrayItem(sh, d);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 9e15 || v->valuedouble != (double)(int64_t)v->valuedouble)
      return gp_error("load: %s: tensor '%s' has a bad size at dim %d", path, nm, d + 1);
    e->shape[d] = (int64_t)v->valuedouble;
  }
  /* the shape a tensor may have (the one rule, src/tensor.c): gp.load makes one of it */
  if (gp_check_shape("load", e->ndim, e->shape) != GP_OK) {
    char why[256];
    snprintf(why, sizeof why, "%s", gp_last_error()); /* not the buffer gp_error writes */
    return gp_error("load: %s: tensor '%s' has a shape no tensor can have (%s)", path, nm, why);
  }
  for (int d = 0; d < e->ndim; d++) numel *= (uint64_t)e->shape[d];
  if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2)
    return gp_error("load: %s: tensor '%s' has bad data_offsets", path, nm);
  double b = cJSON_GetArrayItem(off, 0)->valuedouble, en = cJSON_GetArrayItem(off, 1)->valuedouble;
  if (!cJSON_IsNumber(cJSON_GetArrayItem(off, 0)) || !cJSON_IsNumber(cJSON_GetArrayItem(off, 1)) || b < 0 ||
      en < b || en > (double)data_size || b != (double)(uint64_t)b || en != (double)(uint64_t)en)
    return gp_error("load: %s: tensor '%s' has data_offsets [%.0f, %.0f] outside the %llu bytes of data", path, nm, b,
                    en, (unsigned long long)data_size);
  e->begin = (uint64_t)b;
  e->end = (uint64_t)en;
  if (e->end - e->begin != numel * (uint64_t)gp_elsize(e->dtype))
    return gp_error("load: %s: tensor '%s' has %llu bytes of data but its shape and dtype need %llu", path, nm,
                    (unsigned long long)(e->end - e->begin), (unsigned long long)(numel * (uint64_t)gp_elsize(e->dtype)));
  return GP_OK;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* an error when two of the n strings are equal */
static int check_unique(char *const *strs, int n, const char *what, const char *path) {
  char **s = malloc(sizeof *s * ((size_t)n + 1));
  if (!s) return gp_error_oom("load: out of host memory");
  memcpy(s, strs, sizeof *s * (size_t)n);
  qsort(s, (size_t)n, sizeof *s, cmp_str);
  int rc = GP_OK;
  for (int i = 1; i < n && rc == GP_OK; i++)
    if (!strcmp(s[i - 1], s[i]))
      rc = gp_error("load: %s: %s '%s' appears more than once in the header", path, what, s[i]);
  free(s);
  return rc;
}

int gp_st_open(gp_st **out, const char *path) {
  if (!out || !path) return gp_error("load: null argument");
  *out = NULL;
  gp_st *st = calloc(1, sizeof *st);
  if (!st) return gp_error_oom("load: out of host memory");
  cJSON *root = NULL;
  char *hdr = NULL;
  int rc = GP_OK;
  st->f = fopen(path, "rb");
  if (!st->f) {
    rc = gp_error("load: cannot open %s: %s", path, strerror(errno));
    goto done;
  }
  unsigned char lenb[8];
  if (fseeko(st->f, 0, SEEK_END) != 0) {
    rc = gp_error("load: %s is not a regular file", path);
    goto done;
  }
  int64_t fsize = (int64_t)ftello(st->f);
  rewind(st->f);
  if (fsize < 8 || fread(lenb, 1, 8, st->f) != 8) {
    rc = gp_error("load: %s is truncated (%lld bytes; a safetensors file starts with an 8-byte header length)", path,
                  (long long)fsize);
    goto done;
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | lenb[i];
  if (n == 0 || n > ST_MAX_HEADER || n > (uint64_t)fsize - 8) {
    rc = gp_error("load: %s has a header length of %llu bytes but the file has %lld (limit %u MiB)", path,
                  (unsigned long long)n, (long long)fsize, ST_MAX_HEADER >> 20);
    goto done;
  }
  hdr = malloc(n + 1);
  if (!hdr) {
    rc = gp_error_oom("load: out of host memory for a %llu-byte header", (unsigned long long)n);
    goto done;
  }
  if (fread(hdr, 1, n, st->f) != n) {
    rc = gp_error("load: %s: cannot read the header", path);
    goto done;
  }
  hdr[n] = 0;
  st->data_start = 8 + n;
  st->data_size = (uint64_t)fsize - st->data_start;
  root = cJSON_ParseWithLength(hdr, n);
  if (!cJSON_IsObject(root)) {
    rc = gp_error("load: %s: the header is not a JSON object", path);
    goto done;
  }
  int cnt = cJSON_GetArraySize(root), seen_meta = 0;
  st->e = calloc((size_t)cnt + 1, sizeof *st->e);
  if (!st->e) {
    rc = gp_error_oom("load: out of host memory");
    goto done;
  }
  for (const cJSON *it = root->child; it; it = it->next) {
    if (!it->string) continue;
    if (!strcmp(it->string, "__metadata__")) {
      if (seen_meta++) { /* JSON allows it, but which one would count? */
        rc = gp_error("load: %s: the header has more than one __metadata__ object", path);
        goto done;
      }
      if (!cJSON_IsObject(it)) {
        rc = gp_error("load: %s: __metadata__ is not an object", path);
        goto done;
      }
      int m = cJSON_GetArraySize(it);
      st->meta_k = calloc((size_t)m + 1, sizeof(char *));
      st->meta_v = calloc((size_t)m + 1, sizeof(char *));
      if (!st->meta_k || !st->meta_v) {
        rc = gp_error_oom("load: out of host memory");
        goto done;
      }
      for (const cJSON *kv = it->child; kv && st->nmeta < m; kv = kv->next) {
        if (!kv->string || !cJSON_IsString(kv)) {
          rc = gp_error("load: %s: metadata values must be strings", path);
          goto done;
        }
        st->meta_k[st->nmeta] = strdup(kv->string);
        st->meta_v[st->nmeta] = strdup(kv->valuestring);
        st->nmeta++;
        if (!st->meta_k[st->nmeta - 1] || !st->meta_v[st->nmeta - 1]) {
          rc = gp_error_oom("load: out of host memory");
          goto done;
        }
      }
      if ((rc = check_unique(st->meta_k, st->nmeta, "metadata key", path)) != GP_OK) goto done;
      continue;
    }
    if (st->n >= cnt) break;
    st_entry *e = &st->e[st->n];
    if ((rc = parse_entry(e, it, st->data_size, path)) != GP_OK) goto done;
    if (!(e->name = strdup(it->string))) {
      rc = gp_error_oom("load: out of host memory");
      goto done;
    }
    st->n++;
  }
  /* every name once (JSON allows repeated keys; the last one would silently win) */
  {
    char **names = malloc(sizeof *names * ((size_t)st->n + 1));
    if (!names) {
      rc = gp_error_oom("load: out of host memory");
      goto done;
    }
    for (int i = 0; i < st->n; i++) names[i] = st->e[i].name;
    rc = check_unique(names, st->n, "tensor", path);
    free(names);
    if (rc != GP_OK) goto done;
  }
  /* no two tensors may share bytes */
  st_entry *sorted = malloc(sizeof *sorted * ((size_t)st->n + 1));
  if (!sorted) {
    rc = gp_error_oom("load: out of host memory");
    goto done;
  }
  memcpy(sorted, st->e, sizeof *sorted * (size_t)st->n);
  qsort(sorted, (size_t)st->n, sizeof *sorted, cmp_begin);
  uint64_t max_end = 0;
  for (int i = 0; i < st->n; i++) {
    if (sorted[i].end == sorted[i].begin) continue;
    if (sorted[i].begin < max_end) {
      rc = gp_error("load: %s: tensor '%s' overlaps another tensor's data", path, sorted[i].name);
      break;
    }
    max_end = sorted[i].end;
  }
  free(sorted);
done:
  cJSON_Delete(root);
  free(hdr);
  if (rc != GP_OK) {
    gp_st_close(st);
    return rc;
  }
  *out = st;
  return GP_OK;
}

int gp_st_count(const gp_st *st) { return st ? st->n : 0; }
int gp_st_meta_count(const gp_st *st) { return st ? st->nmeta : 0; }

int gp_st_meta(const gp_st *st, int i, const char **key, const char **value) {
  if (!st || i < 0 || i >= st->nmeta) return gp_error("load: no metadata entry %d", i);
  *key = st->meta_k[i];
  *value = st->meta_v[i];
  return GP_OK;
}

int gp_st_info(const gp_st *st, int i, const char **name, int *dtype, int *ndim, int64_t *shape) {
  if (!st || i < 0 || i >= st->n) return gp_error("load: no tensor %d", i);
  const st_entry *e = &st->e[i];
  *name = e->name;
  *dtype = e->dtype;
  *ndim = e->ndim;
  for (int d = 0; d < e->ndim; d++) shape[d] = e->shape[d];
  return GP_OK;
}

int gp_st_read(gp_st *st, int i, gp_tensor *out) {
  if (!st || i < 0 || i >= st->n || !out) return gp_error("load: bad read of tensor %d", i);
  const st_entry *e = &st->e[i];
  uint64_t nb = e->end - e->begin;
  if (out->device != GP_CPU || !gp_is_contiguous(out) || out->dtype != e->dtype ||
      (uint64_t)gp_numel(out) * (uint64_t)gp_elsize(out->dtype) != nb)
    return gp_error("load: the tensor for '%s' must be a contiguous %s cpu tensor of %llu bytes", e->name,
                    gp_dtype_name(e->dtype), (unsigned long long)nb);
  if (nb == 0) return GP_OK;
  if (fseeko(st->f, (off_t)(st->data_start + e->begin), SEEK_SET) != 0 || fread(gp_ptr(out), 1, nb, st->f) != nb)
    return gp_error("load: cannot read the %llu bytes of '%s'", (unsigned long long)nb, e->name);
  return GP_OK;
}

int gp_st_save(const char *path, int n, const char *const *names, const gp_tensor *const *ts, int nmeta,
               const char *const *keys, const char *const *values) {
  if (!path || n < 0 || (n && (!names || !ts)) || nmeta < 0 || (nmeta && (!keys || !values)))
    return gp_error("save: bad arguments");
  cJSON *root = cJSON_CreateObject();
  char *json = NULL;
  int rc = GP_OK;
  if (!root) return gp_error_oom("save: out of host memory");
  if (nmeta > 0) {
    cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
    for (int i = 0; i < nmeta; i++) {
      if (!keys[i] || !values[i]) {
        rc = gp_error("save: metadata entry %d is null", i + 1);
        goto done;
      }
      if (m && cJSON_GetObjectItemCaseSensitive(m, keys[i])) {
        rc = gp_error("save: the metadata key '%s' appears twice", keys[i]);
        goto done;
      }
      if (!m || !cJSON_AddStringToObject(m, keys[i], values[i])) {
        rc = gp_error_oom("save: out of host memory");
        goto done;
      }
    }
  }
  uint64_t off = 0;
  for (int i = 0; i < n; i++) {
    const gp_tensor *t = ts[i];
    if (!t || !names[i] || t->device != GP_CPU || !gp_is_contiguous(t)) {
      rc = gp_error("save: tensor '%s' must be a contiguous cpu tensor", names[i] ? names[i] : "?");
      goto done;
    }
    if (!strcmp(names[i], "__metadata__")) {
      rc = gp_error("save: a tensor cannot be named '__metadata__' (the format keeps that name for the metadata)");
      goto done;
    }
    if (cJSON_GetObjectItemCaseSensitive(root, names[i])) {
      rc = gp_error("save: the name '%s' appears twice", names[i]);
      goto done;
    }
    cJSON *e = cJSON_AddObjectToObject(root, names[i]);
    cJSON *sh = e ? cJSON_AddArrayToObject(e, "shape") : NULL;
    cJSON *o = e ? cJSON_AddArrayToObject(e, "data_offsets") : NULL;
    if (!sh || !o || !cJSON_AddStringToObject(e, "dtype", st_dtype_name(t->dtype))) {
      rc = gp_error_oom("save: out of host memory");
      goto done;
    }
    for (int d = 0; d < t->ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[d]));
    uint64_t nb = (uint64_t)gp_numel(t) * (uint64_t)gp_elsize(t->dtype);
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)off));
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(off + nb)));
    off += nb;
  }
  json = cJSON_PrintUnformatted(root);
  if (!json) {
    rc = gp_error_oom("save: out of host memory");
    goto done;
  }
  /* a new file that replaces path only once it is complete and on disk (atomic.c) */
  size_t hl = strlen(json), pad = (8 - hl % 8) % 8;
  uint64_t total = hl + pad;
  unsigned char lenb[8];
  for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)(total >> (8 * i));
  gp_afile af;
  if ((rc = gp_afile_open(&af, path, "save", 0)) != GP_OK) goto done;
  rc = gp_afile_write(&af, lenb, 8, "save");
  if (rc == GP_OK) rc = gp_afile_write(&af, json, hl, "save");
  if (rc == GP_OK && pad) rc = gp_afile_write(&af, "        ", pad, "save");
  for (int i = 0; rc == GP_OK && i < n; i++) {
    size_t nb = (size_t)gp_numel(ts[i]) * (size_t)gp_elsize(ts[i]->dtype);
    if (nb) rc = gp_afile_write(&af, gp_ptr(ts[i]), nb, "save");
  }
  if (rc == GP_OK) rc = gp_afile_commit(&af, "save");
  else gp_afile_abort(&af);
done:
  cJSON_free(json);
  cJSON_Delete(root);
  return rc;
}
