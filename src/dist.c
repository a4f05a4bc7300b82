/* dist.c: collectives between processes (gp.dist).
 *
 * Two paths, picked by the tensor's device:
 *  - cuda tensors go through NCCL, loaded at run time with dlopen (gpush is
 *    never linked with -lnccl, so it starts where NCCL is absent and only
 *    gp.dist.init{backend='nccl'} reports the problem). The few types and
 *    functions used are declared below from NCCL's public API (nccl.h).
 *  - cpu tensors go through the TCP connections of the rendezvous, star
 *    shaped around rank 0 (which reduces in double, or int64 for integers):
 *    slow, but it makes every collective and the data-parallel helper
 *    runnable and testable on a machine without a GPU.
 *
 * Rendezvous: rank 0 listens on addr:port; every other rank connects (retrying
 * until the deadline, since rank 0 may start later), says hello (rank, world),
 * and receives a 128-byte id (NCCL's unique id, or random bytes with the tcp
 * backend). The connections stay open for barriers and cpu collectives. Every
 * wait has a deadline: a rank that never shows up is an error naming it,
 * never a hang. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

int gp_cuda_current_device(void);
int gp_cuda_device_count(void);

/* ---- NCCL, declared from its API ---- */
typedef struct { char internal[128]; } nccl_uid; /* ncclUniqueId */
typedef struct nccl_comm_s *nccl_comm;          /* ncclComm_t */
/* ncclResult_t, ncclDataType_t and ncclRedOp_t are C enums: int in the ABI */

static struct {
  void *lib;
  char path[512];
  char why[768];
  int version;
  int (*GetVersion)(int *);
  int (*GetUniqueId)(nccl_uid *);
  int (*CommInitRank)(nccl_comm *, int, nccl_uid, int);
  int (*CommDestroy)(nccl_comm);
  int (*CommAbort)(nccl_comm);
  const char *(*GetErrorString)(int);
  const char *(*GetLastError)(nccl_comm); /* 2.13+; may be NULL */
  int (*AllReduce)(const void *, void *, size_t, int, int, nccl_comm, void *);
  int (*Broadcast)(const void *, void *, size_t, int, int, nccl_comm, void *);
  int (*AllGather)(const void *, void *, size_t, int, nccl_comm, void *);
  int (*ReduceScatter)(const void *, void *, size_t, int, int, nccl_comm, void *);
  int (*GroupStart)(void);
  int (*GroupEnd)(void);
} N;

static const int nccl_dtype[GP_NDTYPES] = {
    [GP_F32] = 7, [GP_BF16] = 9, [GP_F16] = 6, [GP_I32] = 2, [GP_I64] = 4, [GP_U8] = 1, [GP_F64] = 8,
};

static int try_open(const char *path) {
  void *h = gp_dlopen_noting(path, N.why, sizeof N.why);
  if (!h) return 0;
  N.lib = h;
  snprintf(N.path, sizeof N.path, "%s", path);
  return 1;
}

/* a python wheel's copy (pip install nvidia-nccl-cu12, or PyTorch's) */
static int try_wheels(void) {
  static const char *pats[] = {
      "/usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
      "/usr/local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
      "/usr/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
      "/usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2",
      "/opt/conda/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
  };
  char buf[600];
  const char *envs[] = {"VIRTUAL_ENV", "CONDA_PREFIX", "HOME"};
  for (int e = 0; e < 3; e++) {
    const char *root = getenv(envs[e]);
    if (!root || !*root) continue;
    snprintf(buf, sizeof buf, "%s/%slib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2", root,
             e == 2 ? ".local/" : "");
    glob_t g;
    if (glob(buf, 0, NULL, &g) == 0 && g.gl_pathc > 0) {
      int ok = try_open(g.gl_pathv[0]);
      globfree(&g);
      if (ok) return 1;
    } else {
      globfree(&g);
    }
    if (e == 1) {
      snprintf(buf, sizeof buf, "%s/lib/libnccl.so.2", root);
      if (access(buf, R_OK) == 0 && try_open(buf)) return 1;
    }
  }
  /* the python3 on PATH knows where its packages are (a venv, PyTorch's image) */
  FILE *py = popen("python3 -c \"import sys, glob; print('\\n'.join(f for p in sys.path for f in "
                   "glob.glob(p + '/nvidia/nccl/lib/libnccl.so.2')))\" 2>/dev/null",
                   "r");
  if (py) {
    char line[600];
    int ok = 0;
    while (!ok && fgets(line, sizeof line, py)) {
      line[strcspn(line, "\n")] = 0;
      if (line[0]) ok = try_open(line);
    }
    pclose(py);
    if (ok) return 1;
  }
  for (size_t i = 0; i < sizeof pats / sizeof pats[0]; i++) {
    glob_t g;
    if (glob(pats[i], 0, NULL, &g) == 0 && g.gl_pathc > 0) {
      int ok = try_open(g.gl_pathv[0]);
      globfree(&g);
      if (ok) return 1;
    } else {
      globfree(&g);
    }
  }
  return 0;
}

#define SYM(field, name, required)                                                                 \
  do {                                                                                            \
    *(void **)(&N.field) = dlsym(N.lib, name);                                                    \
    if (!N.field && (required)) {                                                                  \
      snprintf(N.why, sizeof N.why, "%s has no symbol %s (NCCL too old?)", N.path, name);         \
      goto bad;                                                                                   \
    }                                                                                             \
  } while (0)

/* Load NCCL once: $GP_NCCL_LIB, else the standard sonames (through the
 * loader's path and gpush's RUNPATH, i.e. the CUDA toolkit's lib64), else a
 * python wheel's copy. */
int gp_dist_nccl_load(int *version, char *path, int n) {
  static int tried;
  if (version) *version = 0;
  if (path && n > 0) path[0] = 0;
  if (!tried) {
    tried = 1;
    const char *env = getenv("GP_NCCL_LIB");
    if (env && *env) {
      try_open(env);
    } else if (!try_open("libnccl.so.2") && !try_open("libnccl.so")) {
      try_wheels();
    }
    if (N.lib) {
      SYM(GetVersion, "ncclGetVersion", 1);
      SYM(GetUniqueId, "ncclGetUniqueId", 1);
      SYM(CommInitRank, "ncclCommInitRank", 1);
      SYM(CommDestroy, "ncclCommDestroy", 1);
      SYM(CommAbort, "ncclCommAbort", 0);
      SYM(GetErrorString, "ncclGetErrorString", 1);
      SYM(GetLastError, "ncclGetLastError", 0);
      SYM(AllReduce, "ncclAllReduce", 1);
      SYM(Broadcast, "ncclBroadcast", 1);
      SYM(AllGather, "ncclAllGather", 1);
      SYM(ReduceScatter, "ncclReduceScatter", 1);
      SYM(GroupStart, "ncclGroupStart", 1);
      SYM(GroupEnd, "ncclGroupEnd", 1);
      if (N.GetVersion(&N.version) != 0) N.version = 0;
      if (N.version < 21000) {
        snprintf(N.why, sizeof N.why, "%s is NCCL version code %d; gpush needs NCCL 2.10 or newer", N.path,
                 N.version);
        goto bad;
      }
      N.why[0] = 0;
    }
    goto done;
  bad:
    dlclose(N.lib);
    N.lib = NULL;
  }
done:
  if (!N.lib)
    return gp_error("dist: NCCL is not available (%s); set GP_NCCL_LIB to the path of libnccl.so.2",
                    N.why[0] ? N.why : "not found");
  if (version) *version = N.version;
  if (path && n > 0) snprintf(path, (size_t)n, "%s", N.path);
  return GP_OK;
}

static int nccl_fail(const char *op, int r, nccl_comm comm) {
  const char *s = N.GetErrorString ? N.GetErrorString(r) : "?";
  const char *last = (N.GetLastError) ? N.GetLastError(comm) : NULL;
  return gp_error("dist.%s: NCCL error %d: %s%s%s", op, r, s, last && *last ? ": " : "", last ? last : "");
}

/* ---- the process group ---- */

enum { BK_TCP = 0, BK_NCCL = 1 };

static struct {
  int inited, backend, rank, world;
  double timeout;
  int *fds; /* rank 0: fds[r] for ranks 1..world-1; other ranks: fds[0], the link to rank 0 */
  unsigned char uid[128];
  nccl_comm comm;
  int group_depth;
} D;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int io_wait(int fd, short ev, double deadline, const char *what, int peer) {
  for (;;) {
    double left = deadline - now_s();
    if (left <= 0)
      return gp_error("dist.%s: timed out after %.0f s waiting for rank %d (did it fail, or not call %s?)", what,
                      D.timeout, peer, what);
    struct pollfd p = {fd, ev, 0};
    int ms = left > 3600 ? 3600000 : (int)(left * 1000) + 1;
    int r = poll(&p, 1, ms);
    if (r > 0) return GP_OK; /* ready, or an error the next send/recv reports */
    if (r < 0 && errno != EINTR) return gp_error("dist.%s: poll: %s", what, strerror(errno));
  }
}

/* move n bytes to (out = 1) or from a peer, waiting at most until the deadline */
static int xfer(int out, int fd, void *buf, size_t n, double deadline, const char *what, int peer) {
  char *p = (char *)buf;
  while (n) {
    GP_TRY(io_wait(fd, out ? POLLOUT : POLLIN, deadline, what, peer));
    ssize_t k = out ? send(fd, p, n > (1u << 22) ? (1u << 22) : n, MSG_NOSIGNAL | MSG_DONTWAIT)
                    : recv(fd, p, n, MSG_DONTWAIT);
    if (k == 0 && !out) return gp_error("dist.%s: rank %d closed the connection (did it fail or exit?)", what, peer);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return gp_error("dist.%s: %s rank %d failed: %s (did it exit?)", what, out ? "sending to" : "receiving from", peer,
                      strerror(errno));
    }
    p += k;
    n -= (size_t)k;
  }
  return GP_OK;
}
static int send_all(int fd, const void *buf, size_t n, double deadline, const char *what, int peer) {
  return xfer(1, fd, (void *)buf, n, deadline, what, peer);
}
static int recv_all(int fd, void *buf, size_t n, double deadline, const char *what, int peer) {
  return xfer(0, fd, buf, n, deadline, what, peer);
}

static void close_all(void) {
  if (D.fds) {
    for (int r = 0; r < D.world; r++)
      if (D.fds[r] >= 0) close(D.fds[r]);
    free(D.fds);
    D.fds = NULL;
  }
}

#define MAGIC 0x53445047u /* "GPDS" */
typedef struct {
  uint32_t magic;
  int32_t rank, world, pad;
} hello_t;
typedef struct {
  uint32_t magic;
  int32_t world;
  unsigned char uid[128];
} welcome_t;

static void nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int rdv_serve(int port, double deadline) {
  int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (ls < 0) return gp_error("dist.init: socket: %s", strerror(errno));
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons((uint16_t)port);
  if (bind(ls, (struct sockaddr *)&a, sizeof a) != 0 || listen(ls, D.world) != 0) {
    int e = errno;
    close(ls);
    return gp_error("dist.init: rank 0 cannot listen on port %d: %s (choose another MASTER_PORT)", port, strerror(e));
  }
  int need = D.world - 1, rc = GP_OK;
  while (need > 0) {
    struct pollfd p = {ls, POLLIN, 0};
    double left = deadline - now_s();
    if (left <= 0) {
      int missing = -1;
      for (int r = 1; r < D.world && missing < 0; r++)
        if (D.fds[r] < 0) missing = r;
      rc = gp_error("dist.init: timed out after %.0f s: rank 0 listens on port %d but %d of %d ranks did not connect "
                    "(rank %d is missing; check MASTER_ADDR, MASTER_PORT and WORLD_SIZE on every node)",
                    D.timeout, port, need, D.world - 1, missing);
      break;
    }
    int r = poll(&p, 1, left > 3600 ? 3600000 : (int)(left * 1000) + 1);
    if (r <= 0) continue;
    int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    nodelay(fd);
    hello_t h;
    /* a stranger (a port scan, a stale run) is dropped: a short deadline of its own */
    double dl = now_s() + 10 < deadline ? now_s() + 10 : deadline;
    if (recv_all(fd, &h, sizeof h, dl, "init", -1) != GP_OK || h.magic != MAGIC) {
      close(fd);
      continue;
    }
    if (h.world != D.world) {
      close(fd);
      rc = gp_error("dist.init: rank %d says WORLD_SIZE is %d but rank 0 has %d", h.rank, h.world, D.world);
      break;
    }
    if (h.rank < 1 || h.rank >= D.world || D.fds[h.rank] >= 0) {
      close(fd);
      rc = gp_error("dist.init: a second process connected as rank %d (each RANK must be unique, 1..%d)", h.rank,
                    D.world - 1);
      break;
    }
    D.fds[h.rank] = fd;
    need--;
  }
  close(ls);
  if (rc != GP_OK) return rc;
  welcome_t w;
  w.magic = MAGIC;
  w.world = D.world;
  memcpy(w.uid, D.uid, 128);
  for (int r = 1; r < D.world; r++) GP_TRY(send_all(D.fds[r], &w, sizeof w, deadline, "init", r));
  return GP_OK;
}

static int rdv_connect(const char *addr, int port, double deadline) {
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  int fd = -1;
  const char *last = "no attempt";
  char lastbuf[256];
  while (fd < 0) {
    if (now_s() > deadline)
      return gp_error("dist.init: rank %d timed out after %.0f s connecting to rank 0 at %s:%d (%s)", D.rank, D.timeout,
                      addr, port, last);
    int g = getaddrinfo(addr, ps, &hints, &res);
    if (g != 0) {
      snprintf(lastbuf, sizeof lastbuf, "cannot resolve %s: %s", addr, gai_strerror(g));
      last = lastbuf;
    } else {
      for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        int s = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (s < 0) continue;
        int c = connect(s, ai->ai_addr, ai->ai_addrlen);
        if (c != 0 && errno == EINPROGRESS) {
          struct pollfd p = {s, POLLOUT, 0};
          double left = deadline - now_s();
          if (left > 5) left = 5;
          if (left > 0 && poll(&p, 1, (int)(left * 1000) + 1) > 0) {
            int err = 0;
            socklen_t len = sizeof err;
            getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len);
            c = err ? -1 : 0;
            errno = err ? err : ETIMEDOUT;
          } else {
            errno = ETIMEDOUT;
          }
        }
        if (c == 0) {
          fd = s;
        } else {
          snprintf(lastbuf, sizeof lastbuf, "%s", strerror(errno));
          last = lastbuf;
          close(s);
        }
      }
      freeaddrinfo(res);
      res = NULL;
    }
    if (fd < 0) usleep(100000); /* rank 0 may not listen yet */
  }
  int fl = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  nodelay(fd);
  D.fds[0] = fd;
  hello_t h = {MAGIC, D.rank, D.world, 0};
  GP_TRY(send_all(fd, &h, sizeof h, deadline, "init", 0));
  welcome_t w;
  GP_TRY(recv_all(fd, &w, sizeof w, deadline, "init", 0));
  if (w.magic != MAGIC) return gp_error("dist.init: %s:%d is not a gpush rank 0", addr, port);
  if (w.world != D.world)
    return gp_error("dist.init: rank 0 says WORLD_SIZE is %d but rank %d has %d", w.world, D.rank, D.world);
  memcpy(D.uid, w.uid, 128);
  return GP_OK;
}

static void random_bytes(unsigned char *p, int n) {
  FILE *f = fopen("/dev/urandom", "rb");
  size_t got = f ? fread(p, 1, (size_t)n, f) : 0;
  if (f) fclose(f);
  if ((int)got < n) {
    uint64_t x = (uint64_t)now_s() * 1000003u ^ (uint64_t)getpid() * 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < n; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      p[i] = (unsigned char)x;
    }
  }
}

int gp_dist_init(int backend, int rank, int world, const char *addr, int port, double timeout_s) {
  if (D.inited) return gp_error("dist.init: already initialized (rank %d of %d)", D.rank, D.world);
  if (world < 1) return gp_error("dist.init: WORLD_SIZE must be >= 1, got %d", world);
  if (rank < 0 || rank >= world) return gp_error("dist.init: RANK %d is not in 0..%d", rank, world - 1);
  if (world > 1 && (port <= 0 || port > 65535)) return gp_error("dist.init: MASTER_PORT %d is not a TCP port", port);
  if (backend != BK_TCP && backend != BK_NCCL) return gp_error("dist.init: unknown backend %d", backend);
  if (!addr || !*addr) addr = "127.0.0.1";
  if (!(timeout_s > 0)) timeout_s = 300;
  if (backend == BK_NCCL) {
    GP_TRY(gp_dist_nccl_load(NULL, NULL, 0));
    if (!gp_cuda_compiled() || gp_cuda_init() != GP_OK)
      return gp_error("dist.init: the nccl backend needs a CUDA GPU, and %s",
                      gp_cuda_compiled() ? gp_last_error() : "this gpush was built without CUDA");
  }
  memset(&D, 0, sizeof D);
  D.backend = backend, D.rank = rank, D.world = world, D.timeout = timeout_s;
  D.fds = (int *)malloc(sizeof(int) * (size_t)world);
  if (!D.fds) return gp_error("dist.init: out of host memory");
  for (int r = 0; r < world; r++) D.fds[r] = -1;
  double deadline = now_s() + timeout_s;
  int rc = GP_OK;
  if (rank == 0) {
    if (backend == BK_NCCL) {
      nccl_uid id;
      int r = N.GetUniqueId(&id);
      if (r != 0) rc = nccl_fail("init (ncclGetUniqueId)", r, NULL);
      else memcpy(D.uid, id.internal, 128);
    } else {
      random_bytes(D.uid, 128);
    }
    if (rc == GP_OK && world > 1) rc = rdv_serve(port, deadline);
  } else {
    rc = rdv_connect(addr, port, deadline);
  }
  if (rc == GP_OK && backend == BK_NCCL) {
    nccl_uid id;
    memcpy(id.internal, D.uid, 128);
    int r = N.CommInitRank(&D.comm, world, id, rank);
    if (r != 0) {
      rc = nccl_fail("init (ncclCommInitRank)", r, NULL);
      D.comm = NULL;
    }
  }
  if (rc != GP_OK) {
    close_all();
    memset(&D, 0, sizeof D);
    return rc;
  }
  D.inited = 1;
  return GP_OK;
}

int gp_dist_finalize(void) {
  if (!D.inited) return GP_OK;
  int rc = GP_OK;
  if (D.comm) {
    int r = N.CommDestroy(D.comm);
    if (r != 0) rc = nccl_fail("destroy", r, NULL);
  }
  close_all();
  memset(&D, 0, sizeof D);
  return rc;
}

int gp_dist_info(int *backend, int *rank, int *world) {
  *backend = D.backend, *rank = D.rank, *world = D.world;
  return D.inited;
}

int gp_dist_uid(uint8_t *out) {
  if (!D.inited) return gp_error("dist: not initialized (call gp.dist.init() first)");
  memcpy(out, D.uid, 128);
  return GP_OK;
}

/* ---- collectives on the TCP star (cpu tensors, barriers) ---- */

enum { K_BARRIER = 1, K_ALLREDUCE, K_BROADCAST, K_ALLGATHER };
static const char *kname[] = {"?", "barrier", "allreduce", "broadcast", "allgather"};

typedef struct {
  uint32_t magic;
  int32_t kind, dtype, arg;
  int64_t nbytes;
} chdr_t;
typedef struct {
  uint32_t magic;
  int32_t status;
  char msg[248];
} ack_t;

/* Every rank names the collective it entered; rank 0 checks they agree and
 * answers each (an error reaches every rank instead of a hang). */
static int handshake(const char *op, int kind, int dtype, int arg, int64_t nbytes, double deadline) {
  chdr_t me = {MAGIC, kind, dtype, arg, nbytes};
  if (D.rank != 0) {
    GP_TRY(send_all(D.fds[0], &me, sizeof me, deadline, op, 0));
    ack_t a;
    GP_TRY(recv_all(D.fds[0], &a, sizeof a, deadline, op, 0));
    if (a.magic != MAGIC) return gp_error("dist.%s: garbled answer from rank 0", op);
    if (a.status != 0) {
      a.msg[sizeof a.msg - 1] = 0;
      return gp_error("dist.%s: %s", op, a.msg);
    }
    return GP_OK;
  }
  ack_t a;
  memset(&a, 0, sizeof a);
  a.magic = MAGIC;
  for (int r = 1; r < D.world; r++) {
    chdr_t h;
    GP_TRY(recv_all(D.fds[r], &h, sizeof h, deadline, op, r));
    if (a.status == 0 && (h.magic != MAGIC || h.kind != kind || h.dtype != dtype || h.arg != arg || h.nbytes != nbytes)) {
      a.status = 1;
      snprintf(a.msg, sizeof a.msg,
               "ranks disagree: rank %d called %s of %lld bytes (%s, arg %d) but rank 0 called %s of %lld bytes (%s, arg %d)",
               r, h.kind >= 1 && h.kind <= 4 ? kname[h.kind] : "?", (long long)h.nbytes, gp_dtype_name(h.dtype), h.arg,
               kname[kind], (long long)nbytes, gp_dtype_name(dtype), arg);
    }
  }
  for (int r = 1; r < D.world; r++) GP_TRY(send_all(D.fds[r], &a, sizeof a, deadline, op, r));
  if (a.status != 0) return gp_error("dist.%s: %s", op, a.msg);
  return GP_OK;
}

/* acc op= x, element-wise over n (double for floats, int64 for integers) */
static void reduce_into(double *acc, int64_t *iacc, const void *x, int dt, int op, int64_t n) {
  if (iacc) {
    for (int64_t i = 0; i < n; i++) {
      int64_t v = gp_load_i64(x, dt, i), *a = &iacc[i];
      *a = op == GP_RED_PROD ? *a * v : op == GP_RED_MAX ? (v > *a ? v : *a) : op == GP_RED_MIN ? (v < *a ? v : *a) : *a + v;
    }
  } else {
    for (int64_t i = 0; i < n; i++) {
      double v = gp_load(x, dt, i), *a = &acc[i];
      *a = op == GP_RED_PROD ? *a * v : op == GP_RED_MAX ? (v > *a || v != v ? v : *a)
         : op == GP_RED_MIN ? (v < *a || v != v ? v : *a) : *a + v;
    }
  }
}

static int tcp_allreduce(void *buf, int dt, int64_t n, int op, const char *opname) {
  int64_t nbytes = n * gp_elsize(dt);
  double deadline = now_s() + D.timeout;
  GP_TRY(handshake(opname, K_ALLREDUCE, dt, op, nbytes, deadline));
  if (D.rank != 0) {
    GP_TRY(send_all(D.fds[0], buf, (size_t)nbytes, deadline, opname, 0));
    return recv_all(D.fds[0], buf, (size_t)nbytes, deadline, opname, 0);
  }
  int isint = gp_is_int(dt);
  double *acc = isint ? NULL : (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  int64_t *iacc = isint ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(n ? n : 1)) : NULL;
  void *tmp = malloc((size_t)(nbytes ? nbytes : 1));
  int rc = GP_OK;
  if ((!acc && !iacc) || !tmp) {
    rc = gp_error("dist.%s: out of host memory for %lld bytes", opname, (long long)nbytes);
  } else {
    for (int64_t i = 0; i < n; i++) {
      if (isint) iacc[i] = gp_load_i64(buf, dt, i);
      else acc[i] = gp_load(buf, dt, i);
    }
    for (int r = 1; r < D.world && rc == GP_OK; r++) {
      rc = recv_all(D.fds[r], tmp, (size_t)nbytes, deadline, opname, r);
      if (rc == GP_OK) reduce_into(acc, iacc, tmp, dt, op, n);
    }
    if (rc == GP_OK) {
      for (int64_t i = 0; i < n; i++) {
        if (isint) gp_store_i64(buf, dt, i, op == GP_RED_AVG ? iacc[i] / D.world : iacc[i]);
        else gp_store(buf, dt, i, op == GP_RED_AVG ? acc[i] / D.world : acc[i]);
      }
      for (int r = 1; r < D.world && rc == GP_OK; r++) rc = send_all(D.fds[r], buf, (size_t)nbytes, deadline, opname, r);
    }
  }
  free(acc), free(iacc), free(tmp);
  return rc;
}

static int tcp_broadcast(void *buf, int dt, int64_t nbytes, int root) {
  const char *op = "broadcast";
  double deadline = now_s() + D.timeout;
  GP_TRY(handshake(op, K_BROADCAST, dt, root, nbytes, deadline));
  if (D.rank != 0) {
    if (D.rank == root) return send_all(D.fds[0], buf, (size_t)nbytes, deadline, op, 0);
    return recv_all(D.fds[0], buf, (size_t)nbytes, deadline, op, 0);
  }
  if (root != 0) GP_TRY(recv_all(D.fds[root], buf, (size_t)nbytes, deadline, op, root));
  for (int r = 1; r < D.world; r++)
    if (r != root) GP_TRY(send_all(D.fds[r], buf, (size_t)nbytes, deadline, op, r));
  return GP_OK;
}

/* out holds world parts of nbytes each; this rank's part is already in place */
static int tcp_allgather(void *out, int dt, int64_t nbytes) {
  const char *op = "allgather";
  double deadline = now_s() + D.timeout;
  GP_TRY(handshake(op, K_ALLGATHER, dt, 0, nbytes, deadline));
  char *o = (char *)out;
  size_t total = (size_t)nbytes * (size_t)D.world;
  if (D.rank != 0) {
    GP_TRY(send_all(D.fds[0], o + (size_t)nbytes * D.rank, (size_t)nbytes, deadline, op, 0));
    return recv_all(D.fds[0], o, total, deadline, op, 0);
  }
  for (int r = 1; r < D.world; r++) GP_TRY(recv_all(D.fds[r], o + (size_t)nbytes * r, (size_t)nbytes, deadline, op, r));
  for (int r = 1; r < D.world; r++) GP_TRY(send_all(D.fds[r], o, total, deadline, op, r));
  return GP_OK;
}

int gp_dist_barrier(void) {
  if (!D.inited) return gp_error("dist.barrier: not initialized (call gp.dist.init() first)");
  if (D.world == 1) return GP_OK;
  return handshake("barrier", K_BARRIER, 0, 0, 0, now_s() + D.timeout);
}

/* ---- the collectives: cuda tensors through NCCL, cpu tensors over TCP ---- */

static int check(const char *op, const gp_tensor *t, const char *name) {
  if (!D.inited) return gp_error("dist.%s: not initialized (call gp.dist.init() first)", op);
  if (!gp_is_contiguous(t)) return gp_error("dist.%s: %s %s must be contiguous", op, name, GP_SHAPE(t));
  if (t->device == GP_CUDA && !D.comm && D.world > 1)
    return gp_error("dist.%s: %s is a cuda tensor but this process group has the tcp backend (cpu tensors only); "
                    "use gp.dist.init{backend='nccl'}", op, name);
  return GP_OK;
}

/* a collective's stream (a chain of dependent launches ends before it) */
static void *stream_of(void *s) {
  gp_pdl_break();
  return s ? s : gp_stream_current();
}

static int nccl_rc(const char *op, int r) { return r == 0 ? GP_OK : nccl_fail(op, r, D.comm); }

int gp_dist_allreduce(gp_tensor *t, int op, void *stream) {
  GP_TRY(check("allreduce", t, "the tensor"));
  if (op < GP_RED_SUM || op > GP_RED_AVG) return gp_error("dist.allreduce: unknown reduction %d", op);
  int64_t n = gp_numel(t);
  if (D.world == 1 || (n == 0 && t->device == GP_CUDA)) return GP_OK;
  if (t->device == GP_CUDA)
    return nccl_rc("allreduce", N.AllReduce(gp_ptr(t), gp_ptr(t), (size_t)n, nccl_dtype[t->dtype], op, D.comm,
                                            stream_of(stream)));
  return tcp_allreduce(gp_ptr(t), t->dtype, n, op, "allreduce");
}

int gp_dist_broadcast(gp_tensor *t, int root, void *stream) {
  GP_TRY(check("broadcast", t, "the tensor"));
  if (root < 0 || root >= D.world) return gp_error("dist.broadcast: root %d is not a rank (0..%d)", root, D.world - 1);
  int64_t n = gp_numel(t);
  if (D.world == 1) return GP_OK;
  if (t->device == GP_CUDA) {
    if (n == 0) return GP_OK;
    return nccl_rc("broadcast", N.Broadcast(gp_ptr(t), gp_ptr(t), (size_t)n, nccl_dtype[t->dtype], root, D.comm,
                                            stream_of(stream)));
  }
  return tcp_broadcast(gp_ptr(t), t->dtype, n * gp_elsize(t->dtype), root);
}

static int same_kind(const char *op, const gp_tensor *out, const gp_tensor *in, int64_t big, int64_t small,
                     const char *bigname) {
  if (out->dtype != in->dtype || out->device != in->device)
    return gp_error("dist.%s: out is %s on %s but the input is %s on %s", op, gp_dtype_name(out->dtype),
                    gp_device_name(out->device), gp_dtype_name(in->dtype), gp_device_name(in->device));
  if (big != small * D.world)
    return gp_error("dist.%s: %s must have world size (%d) times the elements of the other: out %s, input %s", op,
                    bigname, D.world, GP_SHAPE(out), GP_SHAPE(in));
  return GP_OK;
}

static int local_copy(gp_tensor *dst, const void *src, size_t nbytes) {
  if (nbytes == 0 || gp_ptr(dst) == src) return GP_OK;
  if (dst->device == GP_CUDA) return gp_cuda_memcpy(gp_ptr(dst), src, nbytes, 3);
  memmove(gp_ptr(dst), src, nbytes);
  return GP_OK;
}

int gp_dist_allgather(gp_tensor *out, const gp_tensor *in, void *stream) {
  GP_TRY(check("allgather", out, "out"));
  GP_TRY(check("allgather", in, "the input"));
  int64_t n = gp_numel(in);
  GP_TRY(same_kind("allgather", out, in, gp_numel(out), n, "out"));
  size_t nb = (size_t)n * (size_t)gp_elsize(in->dtype);
  if (D.world == 1) return local_copy(out, gp_ptr(in), nb);
  if (in->device == GP_CUDA) {
    if (n == 0) return GP_OK;
    return nccl_rc("allgather", N.AllGather(gp_ptr(in), gp_ptr(out), (size_t)n, nccl_dtype[in->dtype], D.comm,
                                            stream_of(stream)));
  }
  memmove((char *)gp_ptr(out) + nb * (size_t)D.rank, gp_ptr(in), nb);
  return tcp_allgather(gp_ptr(out), in->dtype, (int64_t)nb);
}

int gp_dist_reduce_scatter(gp_tensor *out, const gp_tensor *in, int op, void *stream) {
  GP_TRY(check("reduce_scatter", out, "out"));
  GP_TRY(check("reduce_scatter", in, "the input"));
  if (op < GP_RED_SUM || op > GP_RED_AVG) return gp_error("dist.reduce_scatter: unknown reduction %d", op);
  int64_t n = gp_numel(out);
  GP_TRY(same_kind("reduce_scatter", out, in, gp_numel(in), n, "the input"));
  size_t nb = (size_t)n * (size_t)gp_elsize(in->dtype);
  if (D.world == 1) return local_copy(out, gp_ptr(in), nb);
  if (in->device == GP_CUDA) {
    if (n == 0) return GP_OK;
    return nccl_rc("reduce_scatter", N.ReduceScatter(gp_ptr(in), gp_ptr(out), (size_t)n, nccl_dtype[in->dtype], op,
                                                     D.comm, stream_of(stream)));
  }
  /* the whole input reduced in a scratch copy, then this rank's part */
  void *tmp = malloc(nb * (size_t)D.world + 1);
  if (!tmp) return gp_error("dist.reduce_scatter: out of host memory");
  memcpy(tmp, gp_ptr(in), nb * (size_t)D.world);
  int rc = tcp_allreduce(tmp, in->dtype, n * D.world, op, "reduce_scatter");
  if (rc == GP_OK) memcpy(gp_ptr(out), (char *)tmp + nb * (size_t)D.rank, nb);
  free(tmp);
  return rc;
}

/* ncclGroupStart/End around several cuda collectives (one launch) */
int gp_dist_group(int start) {
  if (!D.inited) return gp_error("dist.group: not initialized (call gp.dist.init() first)");
  if (!D.comm) return GP_OK;
  if (start) {
    D.group_depth++;
    return nccl_rc("group", N.GroupStart());
  }
  if (D.group_depth == 0) return gp_error("dist.group: end without a start");
  D.group_depth--;
  return nccl_rc("group", N.GroupEnd());
}
