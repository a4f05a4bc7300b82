/* alloc.c: host allocation and the caching device allocator.
 *
 * Device blocks are rounded up to size classes (512 B, then four classes per
 * power of two) and, when freed, kept on the free list of their class for
 * reuse. Kernels are queued on one stream, so a block freed and handed out
 * again is only touched after the work queued before it. gp_empty_cache()
 * returns the cached blocks to the driver.
 *
 * Streams: while user streams are in use (gp.with_stream), a freed block may
 * still be read or written by work queued on another stream, so it is held
 * on a pending list instead of the cache until the next device-wide sync
 * (gp.sync(), or one forced here when memory runs short or the pending bytes
 * pile up). Entering a stream also makes it wait for the enclosing stream, so
 * blocks cached before are safe on it (src/cuda.cu).
 *
 * CUDA graphs: while a graph is captured (gp.graph), a graph-private pool is
 * current: allocations come from its free lists (else from the shared cache,
 * adopted into the pool, else cudaMalloc) and every block freed during the
 * capture joins the pool, so the addresses the graph's kernels use are never
 * handed to anything else. After the capture, blocks of a live pool that are
 * freed go back to that pool only. gp_pool_release (the graph is freed)
 * returns the pool's cached blocks to the shared cache; blocks still held by
 * tensors follow when they are freed. A hash map from pointer to pool tells
 * gp_free which blocks belong to a pool. */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

/* classes: 512 B, then four a power of two from 2^9 up to 2^(CLASS_MAX_P + 1)
 * bytes (256 TiB); larger requests are refused before any class arithmetic */
#define CLASS_MAX_P 47
#define NCLASS (1 + (CLASS_MAX_P - 9 + 1) * 4)

typedef struct block {
  void *ptr;
  struct block *next;
  int cls;
} block;

static gp_memstats S;
static block *free_list[NCLASS];
static block *spare_nodes;
static block *pending;           /* freed while streams were in use */
#define PENDING_MAX ((int64_t)256 << 20)

/* the bytes of class c (0 <= c < NCLASS) */
static size_t class_bytes(int c) {
  if (c <= 0) return 512;
  int p = (c - 1) / 4 + 9, k = (c - 1) % 4 + 5;
  return (size_t)k << (p - 2);
}

/* the class of an n-byte request and its bytes; *cls = NCLASS when n is too large for any */
static size_t size_class(size_t n, int *cls) {
  if (n <= 512) {
    *cls = 0;
    return 512;
  }
  if (n - 1 >= (size_t)1 << (CLASS_MAX_P + 1)) {
    *cls = NCLASS;
    return 0;
  }
  int p = 63 - __builtin_clzll((unsigned long long)(n - 1));
  size_t step = (size_t)1 << (p - 2);
  size_t k = (n + step - 1) / step; /* 5..8 */
  *cls = 1 + (p - 9) * 4 + (int)(k - 5);
  return k * step;
}

/* ---- graph pools ---- */
struct gp_pool {
  block *free_list[NCLASS];
  int64_t live; /* blocks of the pool held by tensors */
  int dead;     /* released (its graph is gone): blocks go back to the shared cache when freed */
};
static gp_pool *cur_pool;

/* pointer -> pool, open addressing with linear probing (deletion by backward shift) */
static struct pm_entry {
  void *ptr;
  gp_pool *pool;
} *pm;
static size_t pm_cap, pm_n;

static size_t pm_hash(void *p) { return (size_t)(((uintptr_t)p >> 9) * 0x9E3779B97F4A7C15ull); }

static gp_pool *pm_get(void *p) {
  if (!pm_n) return NULL;
  for (size_t i = pm_hash(p) & (pm_cap - 1);; i = (i + 1) & (pm_cap - 1)) {
    if (!pm[i].ptr) return NULL;
    if (pm[i].ptr == p) return pm[i].pool;
  }
}

static int pm_put(void *p, gp_pool *pool) {
  if ((pm_n + 1) * 2 > pm_cap) {
    size_t nc = pm_cap ? pm_cap * 2 : 256;
    struct pm_entry *n = calloc(nc, sizeof *n);
    if (!n) return GP_ERR_OOM;
    for (size_t i = 0; i < pm_cap; i++)
      if (pm[i].ptr) {
        size_t j = pm_hash(pm[i].ptr) & (nc - 1);
        while (n[j].ptr) j = (j + 1) & (nc - 1);
        n[j] = pm[i];
      }
    free(pm);
    pm = n;
    pm_cap = nc;
  }
  size_t i = pm_hash(p) & (pm_cap - 1);
  while (pm[i].ptr && pm[i].ptr != p) i = (i + 1) & (pm_cap - 1);
  if (!pm[i].ptr) pm_n++;
  pm[i].ptr = p;
  pm[i].pool = pool;
  return GP_OK;
}

static void pm_del(void *p) {
  if (!pm_n) return;
  size_t i = pm_hash(p) & (pm_cap - 1);
  while (pm[i].ptr && pm[i].ptr != p) i = (i + 1) & (pm_cap - 1);
  if (!pm[i].ptr) return;
  pm[i].ptr = NULL;
  pm_n--;
  for (size_t j = (i + 1) & (pm_cap - 1); pm[j].ptr; j = (j + 1) & (pm_cap - 1)) {
    size_t h = pm_hash(pm[j].ptr) & (pm_cap - 1);
    /* move j back to i when its home is not in (i, j] (cyclically) */
    if ((i <= j) ? (h <= i || h > j) : (h <= i && h > j)) {
      pm[i] = pm[j];
      pm[j].ptr = NULL;
      i = j;
    }
  }
}

gp_pool *gp_pool_new(void) { return calloc(1, sizeof(gp_pool)); }
void gp_pool_set_current(gp_pool *p) { cur_pool = p; }

static block *node_for(void *ptr, int cls) {
  block *b = spare_nodes;
  if (b) spare_nodes = b->next;
  else if (!(b = malloc(sizeof *b))) return NULL;
  b->ptr = ptr;
  b->cls = cls;
  return b;
}

void gp_pool_release(gp_pool *p) {
  if (!p) return;
  if (cur_pool == p) cur_pool = NULL;
  for (int c = 0; c < NCLASS; c++)
    while (p->free_list[c]) {
      block *b = p->free_list[c];
      p->free_list[c] = b->next;
      pm_del(b->ptr);
      b->next = free_list[c];
      free_list[c] = b;
      S.cached_blocks++;
    }
  if (p->live == 0) {
    free(p);
    return;
  }
  p->dead = 1; /* the blocks tensors still hold leave the pool in gp_free */
}

static double mib(int64_t b) { return (double)b / (1024.0 * 1024.0); }

int gp_alloc(void **ptr, size_t *alloc_bytes, size_t nbytes, int device) {
  *ptr = NULL;
  *alloc_bytes = 0;
  if (nbytes == 0) return GP_OK;
  if (device == GP_CPU) {
    if (cur_pool)
      return gp_error("graph: a cpu tensor cannot be made while a CUDA graph is being captured (host work is not "
                      "captured: make host tensors before gp.graph)");
    if (S.limit && S.host_in_use + (int64_t)nbytes > S.limit)
      return gp_error_oom("out of memory: %.1f MiB asked for on cpu, %.1f MiB in use, limit %.1f MiB",
                          mib((int64_t)nbytes), mib(S.host_in_use), mib(S.limit));
    void *p = NULL;
    size_t rounded = (nbytes + 63) & ~(size_t)63;
    if (posix_memalign(&p, 64, rounded) != 0 || !p)
      return gp_error_oom("out of memory: %.1f MiB asked for on cpu", mib((int64_t)nbytes));
    *ptr = p;
    *alloc_bytes = nbytes;
    S.host_in_use += (int64_t)nbytes;
    S.host_allocs++;
    if (S.host_in_use > S.host_peak) S.host_peak = S.host_in_use;
    return GP_OK;
  }
  if (!gp_cuda_compiled()) return gp_error("cuda: this gpush was built without CUDA");
  int cls;
  size_t r = size_class(nbytes, &cls);
  if (cls >= NCLASS) return gp_error_oom("out of memory: %.1f MiB asked for on cuda", mib((int64_t)nbytes));
  S.allocs++;
  if (cur_pool) { /* capturing a graph: the pool's own blocks first */
    block *pb = cur_pool->free_list[cls];
    if (pb) {
      cur_pool->free_list[cls] = pb->next;
      *ptr = pb->ptr;
      pb->next = spare_nodes;
      spare_nodes = pb;
      S.cache_hits++;
      cur_pool->live++;
      goto done;
    }
  }
  block *b = free_list[cls];
  if (!b && pending && S.pending_bytes >= PENDING_MAX && gp_cuda_device_sync("alloc") == GP_OK) b = free_list[cls];
  if (b) {
    free_list[cls] = b->next;
    *ptr = b->ptr;
    b->next = spare_nodes;
    spare_nodes = b;
    S.cache_hits++;
    S.cached_blocks--;
  } else {
    if (S.limit && S.reserved + (int64_t)r > S.limit) {
      S.oom++;
      return gp_error_oom("out of memory: %.1f MiB asked for on cuda, %.1f MiB reserved, limit %.1f MiB",
                          mib((int64_t)r), mib(S.reserved), mib(S.limit));
    }
    int rc = gp_cuda_malloc(ptr, r);
    if (rc != GP_OK && pending && gp_cuda_device_sync("alloc") == GP_OK) { /* reuse what streams held back */
      if ((b = free_list[cls])) {
        free_list[cls] = b->next;
        *ptr = b->ptr;
        b->next = spare_nodes;
        spare_nodes = b;
        S.cache_hits++;
        S.cached_blocks--;
        goto adopt;
      }
      gp_empty_cache();
      rc = gp_cuda_malloc(ptr, r);
    }
    if (rc != GP_OK) {
      S.oom++;
      return gp_error_oom("out of memory: %.1f MiB asked for on cuda, %.1f MiB in use, %.1f MiB reserved",
                          mib((int64_t)r), mib(S.in_use), mib(S.reserved));
    }
    S.device_mallocs++;
    S.reserved += (int64_t)r;
  }
adopt:
  if (cur_pool) { /* the block joins the pool */
    if (pm_put(*ptr, cur_pool) != GP_OK) {
      block *nb = node_for(*ptr, cls);
      if (nb) {
        nb->next = free_list[cls];
        free_list[cls] = nb;
        S.cached_blocks++;
      } else {
        gp_cuda_free(*ptr);
        S.reserved -= (int64_t)r;
      }
      *ptr = NULL;
      return gp_error_oom("out of host memory for the graph pool's table");
    }
    cur_pool->live++;
  }
done:
  *alloc_bytes = r;
  S.in_use += (int64_t)r;
  if (S.in_use > S.peak) S.peak = S.in_use;
  return GP_OK;
}

void gp_free(void *ptr, size_t alloc_bytes, int device) {
  if (!ptr) return;
  if (device == GP_CPU) {
    free(ptr);
    S.host_in_use -= (int64_t)alloc_bytes;
    return;
  }
  int cls;
  size_class(alloc_bytes, &cls);
  gp_pool *pool = pm_get(ptr);
  if (pool) {
    pool->live--;
    if (pool->dead) {
      pm_del(ptr);
      if (pool->live == 0) free(pool);
    } else { /* back to its graph's pool only */
      block *pb = node_for(ptr, cls);
      if (pb) {
        pb->next = pool->free_list[cls];
        pool->free_list[cls] = pb;
        S.in_use -= (int64_t)alloc_bytes;
        S.frees++;
        return;
      }
      pm_del(ptr); /* no node: leak it to the shared path below */
    }
  } else if (cur_pool) { /* freed during a capture: the graph may use it, so it joins the pool */
    block *pb = node_for(ptr, cls);
    if (pb && pm_put(ptr, cur_pool) == GP_OK) {
      pb->next = cur_pool->free_list[cls];
      cur_pool->free_list[cls] = pb;
      S.in_use -= (int64_t)alloc_bytes;
      S.frees++;
      return;
    }
    if (pb) {
      pb->next = spare_nodes;
      spare_nodes = pb;
    }
  }
  block *b = spare_nodes;
  if (b) {
    spare_nodes = b->next;
  } else if (!(b = malloc(sizeof *b))) { /* cannot cache it: give it back */
    gp_cuda_free(ptr);
    S.reserved -= (int64_t)alloc_bytes;
    S.in_use -= (int64_t)alloc_bytes;
    S.frees++;
    return;
  }
  b->ptr = ptr;
  b->cls = cls;
  if (gp_cuda_streams_used()) {
    b->next = pending;
    pending = b;
    S.pending_blocks++;
    S.pending_bytes += (int64_t)alloc_bytes;
  } else {
    b->next = free_list[cls];
    free_list[cls] = b;
    S.cached_blocks++;
  }
  S.in_use -= (int64_t)alloc_bytes;
  S.frees++;
}

void gp_alloc_release_pending(void) {
  while (pending) {
    block *b = pending;
    pending = b->next;
    b->next = free_list[b->cls];
    free_list[b->cls] = b;
    S.cached_blocks++;
  }
  S.pending_blocks = 0;
  S.pending_bytes = 0;
}

int gp_empty_cache(void) {
  if (pending) GP_TRY(gp_cuda_device_sync("empty_cache"));
  for (int c = 0; c < NCLASS; c++) {
    size_t sz = class_bytes(c);
    while (free_list[c]) {
      block *b = free_list[c];
      free_list[c] = b->next;
      gp_cuda_free(b->ptr);
      S.reserved -= (int64_t)sz;
      S.cached_blocks--;
      b->next = spare_nodes;
      spare_nodes = b;
    }
  }
  return GP_OK;
}

void gp_shutdown(void) {
  gp_empty_cache();
  gp_cuda_shutdown();
}

int gp_memory_stats(gp_memstats *out) {
  if (!out) return gp_error("memory_stats: null output");
  *out = S;
  out->largest_cached = 0;
  for (int c = NCLASS - 1; c >= 0 && !out->largest_cached; c--)
    if (free_list[c]) out->largest_cached = (int64_t)class_bytes(c);
  return GP_OK;
}

void gp_reset_peak_memory(void) {
  S.peak = S.in_use;
  S.host_peak = S.host_in_use;
}

int gp_set_memory_limit(int64_t bytes) {
  if (bytes < 0) return gp_error("set_memory_limit: negative limit %lld", (long long)bytes);
  S.limit = bytes;
  return GP_OK;
}
