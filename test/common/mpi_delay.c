/* Test-only MPI stress injector (the MPI profiling interface), preloaded into the ranks of a
 * stress test: mpirun -x LD_PRELOAD=libvg_mpi_delay.so.
 *
 * Races between asynchronous messages and the buffers they read or fill hide on an idle
 * machine, where every message goes out at the same moment on every run. Two perturbations:
 * - Delays. Before each point-to-point call, wait and test, and each collective, sleep with
 *   probability VG_MPI_DELAY_P (default 0.3) for a random time up to VG_MPI_DELAY_US
 *   microseconds (default 2000), drawn from a stream seeded by VG_MPI_DELAY_SEED (default 1)
 *   and the world rank: each seed is one reproducible schedule of delays.
 * - Lazy sends (VG_MPI_LAZY_SENDS, default 1). MPI may read an MPI_Isend's buffer at any time
 *   until the request completes; a transport that copies small messages at once hides a
 *   buffer rewritten too early. Here an MPI_Isend only creates a persistent request
 *   (MPI_Send_init, which reads nothing) and starts it as late as MPI allows without
 *   deadlock: a wait for anything else first tests its own requests for up to
 *   VG_MPI_LAZY_US microseconds (default 2000) and starts the pending sends only if they
 *   have not completed by then (the peer may need them first); a wait or test of the send
 *   itself, a blocking call or a collective starts them at once. So a receive that completes
 *   into a buffer whose send has not read it yet (the receive's data had already arrived)
 *   overwrites the outgoing data, on every transport.
 * Neither changes what a correct program computes; only when its messages move. Never linked
 * into vitgrid itself. */
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static uint64_t g_state;
static int g_ready;
static double g_p = 0.3;
static long g_max_us = 2000;

static uint64_t next_u64(void) {
  /* splitmix64 */
  uint64_t z = (g_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void delay(void) {
  if (!g_ready) {
    int inited = 0, rank = 0;
    PMPI_Initialized(&inited);
    if (!inited) return;
    PMPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const char* s = getenv("VG_MPI_DELAY_SEED");
    const char* p = getenv("VG_MPI_DELAY_P");
    const char* us = getenv("VG_MPI_DELAY_US");
    g_state = (s ? strtoull(s, NULL, 10) : 1ull) * 1000003ull + (uint64_t)rank;
    if (p) g_p = atof(p);
    if (us) g_max_us = atol(us);
    g_ready = 1;
  }
  if ((double)(next_u64() >> 11) * 0x1.0p-53 >= g_p) return;
  long t = g_max_us > 0 ? (long)(next_u64() % (uint64_t)(g_max_us + 1)) : 0;
  struct timespec ts = {t / 1000000, (t % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* Lazy sends: the persistent requests standing for this rank's MPI_Isends, in posting order;
 * `started` once MPI_Start ran. Few are open at once (a pipeline step's messages). */
#define VG_MAX_LAZY 4096
static MPI_Request g_lazy[VG_MAX_LAZY];
static int g_started[VG_MAX_LAZY];
static int g_nlazy;
static int g_lazy_on = -1;

static int lazy_on(void) {
  if (g_lazy_on < 0) {
    const char* v = getenv("VG_MPI_LAZY_SENDS");
    g_lazy_on = v ? atoi(v) != 0 : 1;
  }
  return g_lazy_on;
}

/* Starts every lazy send not started yet, oldest first (MPI's order between a pair). */
static void start_lazy(void) {
  for (int i = 0; i < g_nlazy; ++i)
    if (!g_started[i]) {
      PMPI_Start(&g_lazy[i]);
      g_started[i] = 1;
    }
}

static int any_unstarted(void) {
  for (int i = 0; i < g_nlazy; ++i)
    if (!g_started[i]) return 1;
  return 0;
}

static int lazy_index(MPI_Request r) {
  if (r == MPI_REQUEST_NULL) return -1;
  for (int i = 0; i < g_nlazy; ++i)
    if (g_lazy[i] == r) return i;
  return -1;
}

/* A completed lazy send: free its persistent request and hand the caller MPI_REQUEST_NULL, as
 * for a completed MPI_Isend. */
static void retire(MPI_Request* r) {
  int i = lazy_index(*r);
  if (i < 0) return;
  PMPI_Request_free(r);
  *r = MPI_REQUEST_NULL;
  /* keep posting order: start_lazy starts them in it */
  for (int k = i; k + 1 < g_nlazy; ++k) {
    g_lazy[k] = g_lazy[k + 1];
    g_started[k] = g_started[k + 1];
  }
  --g_nlazy;
}

int MPI_Isend(const void* buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm,
              MPI_Request* req) {
  delay();
  if (!lazy_on() || g_nlazy == VG_MAX_LAZY)
    return PMPI_Isend(buf, count, type, dest, tag, comm, req);
  int rc = PMPI_Send_init(buf, count, type, dest, tag, comm, req);
  if (rc != MPI_SUCCESS) return rc;
  g_lazy[g_nlazy] = *req;
  g_started[g_nlazy] = 0;
  ++g_nlazy;
  return rc;
}
int MPI_Irecv(void* buf, int count, MPI_Datatype type, int source, int tag, MPI_Comm comm,
              MPI_Request* req) {
  delay();
  return PMPI_Irecv(buf, count, type, source, tag, comm, req);
}
int MPI_Send(const void* buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
  delay();
  start_lazy();
  return PMPI_Send(buf, count, type, dest, tag, comm);
}
int MPI_Recv(void* buf, int count, MPI_Datatype type, int source, int tag, MPI_Comm comm,
             MPI_Status* st) {
  delay();
  start_lazy();
  return PMPI_Recv(buf, count, type, source, tag, comm, st);
}
/* Before a wait that does not involve an unstarted lazy send: test for up to
 * VG_MPI_LAZY_US microseconds with the sends held back; 1 if the requests completed. */
static long lazy_us(void) {
  const char* v = getenv("VG_MPI_LAZY_US");
  return v ? atol(v) : 2000;
}
static int holds_unstarted(int n, const MPI_Request reqs[]) {
  for (int i = 0; i < n; ++i) {
    int k = lazy_index(reqs[i]);
    if (k >= 0 && !g_started[k]) return 1;
  }
  return 0;
}
static int complete_without_sends(int n, MPI_Request reqs[], MPI_Status sts[]) {
  if (!any_unstarted() || holds_unstarted(n, reqs)) return 0;
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    int flag = 0;
    PMPI_Testall(n, reqs, &flag, sts);
    if (flag) return 1;
    clock_gettime(CLOCK_MONOTONIC, &t);
    if ((t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000 > lazy_us()) return 0;
  }
}

int MPI_Wait(MPI_Request* req, MPI_Status* st) {
  delay();
  int rc = MPI_SUCCESS;
  if (!complete_without_sends(1, req, st == MPI_STATUS_IGNORE ? MPI_STATUSES_IGNORE : st)) {
    start_lazy();
    rc = PMPI_Wait(req, st);
  }
  retire(req);
  return rc;
}
int MPI_Waitall(int n, MPI_Request reqs[], MPI_Status sts[]) {
  delay();
  int rc = MPI_SUCCESS;
  if (!complete_without_sends(n, reqs, sts)) {
    start_lazy();
    rc = PMPI_Waitall(n, reqs, sts);
  }
  for (int i = 0; i < n; ++i) retire(&reqs[i]);
  return rc;
}
int MPI_Test(MPI_Request* req, int* flag, MPI_Status* st) {
  delay();
  start_lazy();
  int rc = PMPI_Test(req, flag, st);
  if (*flag) retire(req);
  return rc;
}
int MPI_Testall(int n, MPI_Request reqs[], int* flag, MPI_Status sts[]) {
  delay();
  start_lazy();
  int rc = PMPI_Testall(n, reqs, flag, sts);
  if (*flag)
    for (int i = 0; i < n; ++i) retire(&reqs[i]);
  return rc;
}
int MPI_Iallreduce(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op,
                   MPI_Comm comm, MPI_Request* req) {
  delay();
  start_lazy();
  return PMPI_Iallreduce(in, out, count, type, op, comm, req);
}
int MPI_Iallgather(const void* in, int scount, MPI_Datatype stype, void* out, int rcount,
                   MPI_Datatype rtype, MPI_Comm comm, MPI_Request* req) {
  delay();
  start_lazy();
  return PMPI_Iallgather(in, scount, stype, out, rcount, rtype, comm, req);
}
int MPI_Ireduce_scatter_block(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op,
                              MPI_Comm comm, MPI_Request* req) {
  delay();
  start_lazy();
  return PMPI_Ireduce_scatter_block(in, out, count, type, op, comm, req);
}
int MPI_Allreduce(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op,
                  MPI_Comm comm) {
  delay();
  start_lazy();
  return PMPI_Allreduce(in, out, count, type, op, comm);
}
int MPI_Allgather(const void* in, int scount, MPI_Datatype stype, void* out, int rcount,
                  MPI_Datatype rtype, MPI_Comm comm) {
  delay();
  start_lazy();
  return PMPI_Allgather(in, scount, stype, out, rcount, rtype, comm);
}
int MPI_Reduce_scatter_block(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op,
                             MPI_Comm comm) {
  delay();
  start_lazy();
  return PMPI_Reduce_scatter_block(in, out, count, type, op, comm);
}
int MPI_Bcast(void* buf, int count, MPI_Datatype type, int root, MPI_Comm comm) {
  delay();
  start_lazy();
  return PMPI_Bcast(buf, count, type, root, comm);
}
