/* Test-only fault injection: the seam between the product and its fault tests.
 *
 * The product never sets these and never reads the environment for them: each stays at its
 * "no fault" value unless a test sets it, either directly (an in-process unit test) or
 * through the test-only preloaded library test/common/test_hooks.c (libvg_test_hooks.so,
 * `mpirun -x LD_PRELOAD=...` into the ranks of an end-to-end test), whose constructor finds
 * this struct in the executable (exported by name) and fills it from its own environment
 * variables (VITGRID_TEST_FAIL_AT, VITGRID_TEST_NCCL_SKIP, VITGRID_TEST_METRICS_NO_RESERVE,
 * VITGRID_TEST_CKPT_DELAY_MS).
 * Plain C, constant-initialised: set before main() starts, read afterwards. */
#ifndef VITGRID_CORE_TEST_HOOKS_H
#define VITGRID_CORE_TEST_HOOKS_H

#ifdef __cplusplus
extern "C" {
#endif

struct vitgrid_test_hooks_t {
  /* Pipeline stage fail_stage's first rank fails at the start of step fail_step, as a
   * crashing kernel would (PipelineRunner; -1: never). */
  int fail_stage;
  long long fail_step;
  /* World rank nccl_skip_rank silently skips its nccl_skip_call-th NCCL collective (1-based),
   * as a rank taking a different code path would (the NCCL watchdog's test; 0: never). */
  int nccl_skip_rank;
  long long nccl_skip_call;
  /* Nonzero: MetricsWriter does not reserve room before a write, so the write itself meets
   * a full disk (what a file system that cannot reserve may still do). */
  int metrics_no_reserve;
  /* Milliseconds write_checkpoint sleeps before each tensor's collective write (0: none), so
   * that a test can signal or kill the ranks while a checkpoint is being written. */
  int checkpoint_tensor_delay_ms;
  /* Milliseconds the data loader's thread sleeps before each training batch (0: none): a run
   * whose steps wait for their input, as on a node whose CPUs decode too slowly. */
  int loader_batch_delay_ms;
};

/* The one instance, in vitgrid_core; the vitgrid executable exports it by name. */
extern struct vitgrid_test_hooks_t vitgrid_test_hooks;

#ifdef __cplusplus
}
#endif

#endif
