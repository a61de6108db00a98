/* Test-only fault injection, preloaded into the ranks of an end-to-end test:
 *   mpirun -x LD_PRELOAD=libvg_test_hooks.so -x VITGRID_TEST_FAIL_AT=1:3 ... vitgrid ...
 * Its constructor finds the product's hook struct (vitgrid/core/test_hooks.h, exported by the
 * vitgrid executable) and fills it from this library's environment variables:
 *   VITGRID_TEST_FAIL_AT=stage:step     pipeline stage's first rank fails at that step
 *   VITGRID_TEST_NCCL_SKIP=rank:n       that world rank silently skips its n-th NCCL collective
 *   VITGRID_TEST_METRICS_NO_RESERVE=1   MetricsWriter does not reserve room before a write
 *   VITGRID_TEST_CKPT_DELAY_MS=n        write_checkpoint sleeps n ms before each tensor
 *   VITGRID_TEST_LOADER_DELAY_MS=n      the data loader sleeps n ms before each training batch
 *   VITGRID_TEST_ABORT_HANGS=1          MPI_Abort never returns and ends nothing (an MPI whose
 *                                       abort waits for good on a stopped peer)
 * In a process without the struct (mpirun, a shell) it does nothing. The product itself never
 * reads these variables. Never linked into vitgrid. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "vitgrid/core/test_hooks.h"

/* "a:b" -> 1 with both parsed, else 0 */
static int pair(const char* name, long long* a, long long* b) {
  const char* v = getenv(name);
  char* end = NULL;
  if (!v || !*v) return 0;
  *a = strtoll(v, &end, 10);
  if (end == v || *end != ':') goto bad;
  v = end + 1;
  *b = strtoll(v, &end, 10);
  if (end == v || *end != '\0') goto bad;
  return 1;
bad:
  fprintf(stderr, "vg_test_hooks: %s=%s is not a:b\n", name, getenv(name));
  exit(2);
}

__attribute__((constructor)) static void vg_test_hooks_init(void) {
  struct vitgrid_test_hooks_t* h =
      (struct vitgrid_test_hooks_t*)dlsym(RTLD_DEFAULT, "vitgrid_test_hooks");
  long long a = 0, b = 0;
  const char* v = NULL;
  if (!h) return;
  if (pair("VITGRID_TEST_FAIL_AT", &a, &b)) {
    h->fail_stage = (int)a;
    h->fail_step = b;
  }
  if (pair("VITGRID_TEST_NCCL_SKIP", &a, &b)) {
    h->nccl_skip_rank = (int)a;
    h->nccl_skip_call = b;
  }
  v = getenv("VITGRID_TEST_METRICS_NO_RESERVE");
  if (v && *v == '1') h->metrics_no_reserve = 1;
  v = getenv("VITGRID_TEST_CKPT_DELAY_MS");
  if (v && *v) h->checkpoint_tensor_delay_ms = atoi(v);
  v = getenv("VITGRID_TEST_LOADER_DELAY_MS");
  if (v && *v) h->loader_batch_delay_ms = atoi(v);
}

/* Interposes the MPI's own MPI_Abort (this library is preloaded, so the executable's calls
 * reach it first); without VITGRID_TEST_ABORT_HANGS it is the MPI's. */
int MPI_Abort(MPI_Comm comm, int code) {
  const char* v = getenv("VITGRID_TEST_ABORT_HANGS");
  if (v && *v == '1')
    for (;;) sleep(1000);
  int (*next)(MPI_Comm, int) = (int (*)(MPI_Comm, int))dlsym(RTLD_NEXT, "MPI_Abort");
  return next(comm, code);
}
