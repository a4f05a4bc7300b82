/* launch.c: `gpush --nproc N script.lua`: N copies of gpush, one per GPU.
 *
 * Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
 * and MASTER_PORT (the rendezvous of gp.dist.init), GPUSH_LAUNCHED=1 (line-
 * buffered output) and NCCL_NVLS_ENABLE=0 unless it is set. The GPU is picked
 * in the child by LOCAL_RANK (cudaSetDevice, src/cuda.cu), not by
 * CUDA_VISIBLE_DEVICES, which would keep NCCL from using CUDA IPC between the
 * processes. Each line a child writes is copied to the same stream of the
 * launcher with its rank in front: "[1] step 10 ...". When a child fails
 * (non-zero exit or a signal), the others are stopped (SIGTERM to their
 * process groups, SIGKILL 5 s later) and the launcher exits with the failed
 * child's status. */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

typedef struct {
  pid_t pid;
  int fd[2];          /* stdout, stderr pipes (-1 when closed) */
  char *buf[2];       /* a partial line */
  size_t len[2], cap[2];
  int done, status;
} child_t;

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { g_stop = sig; }

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* a port nobody listens on now (bind to 0, read it back) */
static int free_port(void) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) return 29500;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 29500;
  if (bind(s, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(s, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  close(s);
  return port;
}

static void write_full(int fd, const char *p, size_t n) {
  while (n) {
    ssize_t k = write(fd, p, n);
    if (k < 0) {
      if (errno == EINTR) continue;
      return;
    }
    p += k;
    n -= (size_t)k;
  }
}

/* emit the complete lines of child c's stream s, each with its rank in front */
static void flush_lines(child_t *c, int s, int rank, int all) {
  char pre[32];
  int np = snprintf(pre, sizeof pre, "[%d] ", rank);
  size_t start = 0;
  for (size_t i = 0; i < c->len[s]; i++) {
    if (c->buf[s][i] == '\n') {
      write_full(s ? 2 : 1, pre, (size_t)np);
      write_full(s ? 2 : 1, c->buf[s] + start, i + 1 - start);
      start = i + 1;
    }
  }
  if (all && start < c->len[s]) {
    write_full(s ? 2 : 1, pre, (size_t)np);
    write_full(s ? 2 : 1, c->buf[s] + start, c->len[s] - start);
    write_full(s ? 2 : 1, "\n", 1);
    start = c->len[s];
  }
  memmove(c->buf[s], c->buf[s] + start, c->len[s] - start);
  c->len[s] -= start;
}

static void kill_all(child_t *ch, int n, int sig) {
  for (int i = 0; i < n; i++)
    if (ch[i].pid > 0 && !ch[i].done) kill(-ch[i].pid, sig);
}

int gp_dist_launch(int *exit_code, int nproc, int nnodes, int node_rank, const char *addr, int port, int argc,
                   const char *const *argv) {
  *exit_code = 1;
  if (nproc < 1 || nproc > 1024) return gp_error("launch: --nproc must be in 1..1024, got %d", nproc);
  if (nnodes < 1) return gp_error("launch: --nnodes must be >= 1, got %d", nnodes);
  if (node_rank < 0 || node_rank >= nnodes)
    return gp_error("launch: --node-rank %d is not in 0..%d", node_rank, nnodes - 1);
  if (argc < 1) return gp_error("launch: nothing to run");
  if (!addr || !*addr) addr = getenv("MASTER_ADDR");
  if (!addr || !*addr) {
    if (nnodes > 1) return gp_error("launch: with --nnodes > 1, give --master-addr (or MASTER_ADDR): node 0's address");
    addr = "127.0.0.1";
  }
  if (port <= 0 && getenv("MASTER_PORT")) port = atoi(getenv("MASTER_PORT"));
  if (port <= 0) {
    if (nnodes > 1) port = 29500;
    else port = free_port();
  }
  char exe[4096];
  ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (k <= 0) return gp_error("launch: cannot find the gpush executable: %s", strerror(errno));
  exe[k] = 0;

  child_t *ch = (child_t *)calloc((size_t)nproc, sizeof *ch);
  const char **av = (const char **)calloc((size_t)argc + 1, sizeof *av);
  if (!ch || !av) {
    free(ch), free(av);
    return gp_error("launch: out of memory");
  }
  for (int i = 0; i < argc; i++) av[i] = argv[i];
  av[argc] = NULL;

  struct sigaction sa, old_int, old_term, old_pipe;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  sa.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &sa, &old_pipe);
  g_stop = 0;
  fflush(stdout);
  fflush(stderr);

  int world = nproc * nnodes, rc = GP_OK, started = 0;
  for (int i = 0; i < nproc; i++) {
    int po[2], pe[2];
    if (pipe(po) != 0 || pipe(pe) != 0) {
      rc = gp_error("launch: pipe: %s", strerror(errno));
      break;
    }
    pid_t pid = fork();
    if (pid < 0) {
      rc = gp_error("launch: fork: %s", strerror(errno));
      close(po[0]), close(po[1]), close(pe[0]), close(pe[1]);
      break;
    }
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGPIPE, SIG_DFL);
      dup2(po[1], 1);
      dup2(pe[1], 2);
      close(po[0]), close(po[1]), close(pe[0]), close(pe[1]);
      for (int j = 0; j < i; j++) close(ch[j].fd[0]), close(ch[j].fd[1]);
      char v[32];
      snprintf(v, sizeof v, "%d", node_rank * nproc + i);
      setenv("RANK", v, 1);
      snprintf(v, sizeof v, "%d", world);
      setenv("WORLD_SIZE", v, 1);
      snprintf(v, sizeof v, "%d", i);
      setenv("LOCAL_RANK", v, 1);
      snprintf(v, sizeof v, "%d", nproc);
      setenv("LOCAL_WORLD_SIZE", v, 1);
      setenv("MASTER_ADDR", addr, 1);
      snprintf(v, sizeof v, "%d", port);
      setenv("MASTER_PORT", v, 1);
      setenv("GPUSH_LAUNCHED", "1", 1);
      setenv("NCCL_NVLS_ENABLE", "0", 0);
      execv(exe, (char *const *)av);
      fprintf(stderr, "gpush: cannot run %s: %s\n", exe, strerror(errno));
      _exit(127);
    }
    setpgid(pid, pid); /* also here: no race with the child's own call */
    close(po[1]), close(pe[1]);
    ch[i].pid = pid;
    ch[i].fd[0] = po[0];
    ch[i].fd[1] = pe[0];
    started++;
  }

  int failed = -1, alive = started, code = 0;
  double kill_at = 0;
  if (rc != GP_OK) {
    kill_all(ch, started, SIGTERM);
    kill_at = now_s() + 5;
    failed = -2;
    code = 1;
  }
  struct pollfd *pf = (struct pollfd *)calloc((size_t)nproc * 2, sizeof *pf);
  int *who = (int *)calloc((size_t)nproc * 2, sizeof *who);
  while (alive > 0) {
    if (g_stop && failed == -1) {
      fprintf(stderr, "gpush: launcher got signal %d; stopping the ranks\n", (int)g_stop);
      kill_all(ch, started, SIGTERM);
      kill_at = now_s() + 5;
      failed = -2;
      code = 128 + (int)g_stop;
    }
    if (kill_at > 0 && now_s() > kill_at) {
      kill_all(ch, started, SIGKILL);
      kill_at = 0;
    }
    int np = 0;
    for (int i = 0; i < started && pf; i++)
      for (int s = 0; s < 2; s++)
        if (ch[i].fd[s] >= 0) {
          pf[np].fd = ch[i].fd[s];
          pf[np].events = POLLIN;
          who[np++] = i * 2 + s;
        }
    if (np > 0) {
      int r = poll(pf, (nfds_t)np, 100);
      for (int j = 0; r > 0 && j < np; j++) {
        if (!pf[j].revents) continue;
        child_t *c = &ch[who[j] / 2];
        int s = who[j] % 2;
        if (c->cap[s] - c->len[s] < 65536) {
          size_t cap = c->cap[s] * 2 + 65536;
          char *nb = (char *)realloc(c->buf[s], cap);
          if (!nb) continue;
          c->buf[s] = nb;
          c->cap[s] = cap;
        }
        ssize_t got = read(c->fd[s], c->buf[s] + c->len[s], c->cap[s] - c->len[s]);
        if (got > 0) {
          c->len[s] += (size_t)got;
          flush_lines(c, s, node_rank * nproc + who[j] / 2, 0);
        } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
          flush_lines(c, s, node_rank * nproc + who[j] / 2, 1);
          close(c->fd[s]);
          c->fd[s] = -1;
        }
      }
    } else {
      usleep(20000);
    }
    /* reap */
    for (int i = 0; i < started; i++) {
      if (ch[i].done) continue;
      int st;
      pid_t p = waitpid(ch[i].pid, &st, WNOHANG);
      if (p != ch[i].pid) continue;
      ch[i].done = 1;
      ch[i].status = st;
      alive--;
      int bad = !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
      if (bad && failed == -1) {
        failed = i;
        code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (WIFEXITED(st))
          fprintf(stderr, "gpush: rank %d exited with status %d; stopping the other ranks\n", node_rank * nproc + i,
                  WEXITSTATUS(st));
        else
          fprintf(stderr, "gpush: rank %d was killed by signal %d; stopping the other ranks\n", node_rank * nproc + i,
                  WTERMSIG(st));
        kill_all(ch, started, SIGTERM);
        kill_at = now_s() + 5;
      }
    }
  }
  /* what is left in the pipes after the last exit */
  for (int i = 0; i < started; i++)
    for (int s = 0; s < 2; s++) {
      if (ch[i].fd[s] < 0) continue;
      for (;;) {
        if (ch[i].cap[s] - ch[i].len[s] < 65536) {
          size_t cap = ch[i].cap[s] * 2 + 65536;
          char *nb = (char *)realloc(ch[i].buf[s], cap);
          if (!nb) break;
          ch[i].buf[s] = nb;
          ch[i].cap[s] = cap;
        }
        struct pollfd p1 = {ch[i].fd[s], POLLIN, 0};
        if (poll(&p1, 1, 200) <= 0) break;
        ssize_t got = read(ch[i].fd[s], ch[i].buf[s] + ch[i].len[s], ch[i].cap[s] - ch[i].len[s]);
        if (got <= 0) break;
        ch[i].len[s] += (size_t)got;
      }
      flush_lines(&ch[i], s, node_rank * nproc + i, 1);
      close(ch[i].fd[s]);
    }
  for (int i = 0; i < nproc; i++) free(ch[i].buf[0]), free(ch[i].buf[1]);
  free(pf), free(who), free(ch), free(av);
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  sigaction(SIGPIPE, &old_pipe, NULL);
  *exit_code = code;
  return rc;
}
