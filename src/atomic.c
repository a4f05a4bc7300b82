/* atomic.c: replacing a file so that a crash, a full disk or a kill -9 at any
 * moment leaves either the old file or the new one, never a mix, and nothing
 * a planted symlink can redirect.
 *
 * The bytes go to a file that has no name yet (O_TMPFILE in the target's
 * directory: a kill leaves nothing behind), which is fsynced, linked under a
 * fresh random name (linkat, which never follows or replaces anything) and
 * renamed over the target; then the directory is fsynced so the rename itself
 * survives a power cut. Where O_TMPFILE or the link is not available (some
 * file systems, no /proc), the file is made by mkstemp (O_CREAT|O_EXCL: it is
 * created new or not at all) with the permissions a plain create would give.
 * Every error path removes the temporary file. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#ifndef O_TMPFILE
#define O_TMPFILE 0
#endif

static int split_dir(gp_afile *a, const char *path, const char *op) {
  size_t n = strlen(path);
  if (n == 0 || path[n - 1] == '/') return gp_error("%s: '%s' is not a file name", op, path);
  const char *slash = strrchr(path, '/');
  const char *base = slash ? slash + 1 : path;
  size_t dn = slash ? (size_t)(slash - path) : 1;
  a->dir = malloc(dn + 2);
  a->tmp = malloc(n + 32);
  a->path = strdup(path);
  if (!a->dir || !a->tmp || !a->path) return gp_error_oom("%s: out of host memory", op);
  if (slash) {
    memcpy(a->dir, path, dn);
    if (dn == 0) a->dir[dn++] = '/'; /* "/name" */
    a->dir[dn] = 0;
  } else {
    strcpy(a->dir, ".");
  }
  /* the temporary name: a hidden file beside the target */
  snprintf(a->tmp, n + 32, "%.*s.%s.XXXXXX", (int)(base - path), path, base);
  return GP_OK;
}

static void afile_free(gp_afile *a) {
  free(a->dir);
  free(a->tmp);
  free(a->path);
  a->dir = a->tmp = a->path = NULL;
}

static int open_mkstemp(gp_afile *a, const char *op) {
  a->fd = mkstemp(a->tmp);
  if (a->fd < 0) return gp_error("%s: cannot create a file in %s: %s", op, a->dir, strerror(errno));
  a->named = 1;
  mode_t mask = umask(0);
  umask(mask);
  if (fchmod(a->fd, 0666 & ~mask) != 0) { /* mkstemp makes 0600; a plain create gives 0666 & ~umask */
    int e = errno;
    gp_afile_abort(a);
    return gp_error("%s: cannot set the permissions of %s: %s", op, a->path, strerror(e));
  }
  return GP_OK;
}

int gp_afile_open(gp_afile *a, const char *path, const char *op, int no_tmpfile) {
  memset(a, 0, sizeof *a);
  a->fd = -1;
  if (!path) return gp_error("%s: no path", op);
  int rc = split_dir(a, path, op);
  if (rc != GP_OK) {
    afile_free(a);
    return rc;
  }
  if (O_TMPFILE && !no_tmpfile) {
    a->fd = open(a->dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0666);
    if (a->fd >= 0) return GP_OK;
    if (errno == ENOENT || errno == EACCES || errno == EROFS || errno == ENOTDIR) {
      int e = errno;
      rc = gp_error("%s: cannot write %s: %s", op, path, strerror(e));
      afile_free(a);
      return rc;
    }
    /* EOPNOTSUPP, EISDIR (old kernels), EINVAL: this file system has no O_TMPFILE */
  }
  rc = open_mkstemp(a, op);
  if (rc != GP_OK) afile_free(a);
  return rc;
}

int gp_afile_write(gp_afile *a, const void *buf, size_t n, const char *op) {
  const char *p = buf;
  while (n > 0) {
    size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
    ssize_t w = write(a->fd, p, chunk);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return gp_error("%s: writing %s failed: %s", op, a->path, w < 0 ? strerror(errno) : "no progress");
    p += w;
    n -= (size_t)w;
  }
  return GP_OK;
}

/* give the anonymous file a fresh random name in its directory */
static int link_tmpfile(gp_afile *a) {
  char proc[64];
  snprintf(proc, sizeof proc, "/proc/self/fd/%d", a->fd);
  size_t n = strlen(a->tmp);
  for (int attempt = 0; attempt < 64; attempt++) {
    static const char al[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t r = ((uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull) ^ (uint64_t)getpid() << 20 ^ (uint64_t)attempt * 7919u;
    for (int i = 0; i < 6; i++, r /= 62) a->tmp[n - 6 + i] = al[r % 62];
    if (linkat(AT_FDCWD, proc, AT_FDCWD, a->tmp, AT_SYMLINK_FOLLOW) == 0) return GP_OK;
    if (errno == EEXIST) continue;
    if (linkat(a->fd, "", AT_FDCWD, a->tmp, AT_EMPTY_PATH) == 0) return GP_OK; /* no /proc */
    if (errno == EEXIST) continue;
    break;
  }
  memcpy(a->tmp + n - 6, "XXXXXX", 6);
  return GP_ERR;
}

/* the anonymous file could not be named: copy it into a mkstemp file */
static int copy_to_named(gp_afile *a, const char *op) {
  int src = a->fd;
  a->fd = -1;
  int rc = open_mkstemp(a, op);
  char *buf = rc == GP_OK ? malloc(1 << 20) : NULL;
  if (rc == GP_OK && !buf) rc = gp_error_oom("%s: out of host memory", op);
  for (off_t off = 0; rc == GP_OK;) {
    ssize_t r = pread(src, buf, 1 << 20, off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) rc = gp_error("%s: %s", op, strerror(errno));
    if (r <= 0) break;
    rc = gp_afile_write(a, buf, (size_t)r, op);
    off += r;
  }
  free(buf);
  close(src);
  return rc;
}

int gp_afile_commit(gp_afile *a, const char *op) {
  int rc = GP_OK;
  if (fsync(a->fd) != 0) rc = gp_error("%s: writing %s failed (fsync): %s", op, a->path, strerror(errno));
  if (rc == GP_OK && !a->named) {
    if (link_tmpfile(a) == GP_OK) a->named = 1;
    else if ((rc = copy_to_named(a, op)) == GP_OK && fsync(a->fd) != 0)
      rc = gp_error("%s: writing %s failed (fsync): %s", op, a->path, strerror(errno));
  }
  if (rc == GP_OK && close(a->fd) != 0) rc = gp_error("%s: writing %s failed (close): %s", op, a->path, strerror(errno));
  a->fd = -1;
  if (rc == GP_OK && rename(a->tmp, a->path) != 0)
    rc = gp_error("%s: cannot replace %s: %s", op, a->path, strerror(errno));
  if (rc != GP_OK) {
    gp_afile_abort(a);
    return rc;
  }
  a->named = 0;
  /* the rename is durable once the directory is */
  int dfd = open(a->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    if (fsync(dfd) != 0 && errno != EINVAL && errno != EROFS)
      rc = gp_error("%s: %s was written but syncing its directory failed: %s", op, a->path, strerror(errno));
    close(dfd);
  }
  afile_free(a);
  return rc;
}

void gp_afile_abort(gp_afile *a) {
  if (a->fd >= 0) close(a->fd);
  a->fd = -1;
  if (a->named && a->tmp) unlink(a->tmp);
  a->named = 0;
  afile_free(a);
}
