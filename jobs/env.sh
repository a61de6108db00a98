# Environment shared by the launch scripts. Edit for your machine (modules, paths).
# Sourced, not executed.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
# NVLink multicast (NVLS) stays off: see the README.
export NCCL_NVLS_ENABLE=0
# Open MPI refuses root unless told (containers).
if [ "$(id -u)" = "0" ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# The checkout (or installed prefix): VITGRID_HOME, else the folder above this file.
# (VITGRID_ROOT, its former name, is still read.)
VITGRID_HOME=${VITGRID_HOME:-${VITGRID_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
VITGRID_ROOT=$VITGRID_HOME
export VITGRID_HOME
VITGRID_BIN=${VITGRID_BIN:-$VITGRID_HOME/build/bin/vitgrid}
# Exit code vitgrid uses after a preemption checkpoint: the batch scripts requeue on it.
VITGRID_EXIT_REQUEUE=3
# A SIGTERM that reaches mpirun itself (kill, a scheduler signalling every process): Open MPI
# waits odls_base_sigkill_timeout seconds, sends SIGTERM to the ranks, which finish their step
# and write a checkpoint, and kills them the same time later. Its default, 1 s, may cut that
# checkpoint short (the previous one stays). VITGRID_KILL_GRACE=N gives N seconds; but mpirun
# then also waits 2N seconds after any rank exits non-zero (an error, a preemption), so it is
# not set by default. jobs/mpirun.sh turns a SIGTERM of its own into an immediate SIGUSR1.
if [ -n "${VITGRID_KILL_GRACE:-}" ]; then
  export OMPI_MCA_odls_base_sigkill_timeout=$VITGRID_KILL_GRACE
fi

# The launch scripts' own arguments: vg_launcher_args USAGE "$@" sets DRY (1 with --dry-run,
# --print or VITGRID_DRY_RUN=1), OUT_DIR (the value of a --run.out_dir=DIR override, kept in
# the arguments) and ARGS (everything but the script's flags); -h / --help prints USAGE.
vg_launcher_args() {
  local usage=$1 a
  shift
  DRY=${VITGRID_DRY_RUN:-0}
  ARGS=()
  OUT_DIR=
  for a in "$@"; do
    case $a in
      --dry-run|--print) DRY=1 ;;
      -h|--help) echo "$usage"; exit 0 ;;
      --run.out_dir=*) OUT_DIR=${a#--run.out_dir=}; ARGS+=("$a") ;;
      *) ARGS+=("$a") ;;
    esac
  done
}

# Runs the launcher command "$@" (mpirun or srun) in the background and waits for it; a
# SIGUSR1, SIGTERM or SIGINT to the calling script goes on to it as SIGUSR1, which it forwards
# to every rank (they finish the step, write a checkpoint and exit 3). Sets RC to its exit code.
vg_run_forwarding_signals() {
  "$@" &
  local pid=$!
  # and to the launcher's children, the ranks on this node: some mpirun builds catch SIGUSR1
  # and forward nothing (Open MPI 4.1.6 in an Ubuntu 24.04 container); a rank that gets it
  # twice stops once
  trap "kill -USR1 $pid 2>/dev/null; pkill -USR1 -P $pid 2>/dev/null || true" USR1 TERM INT
  RC=0
  wait "$pid" || RC=$?
  # a trapped signal ends `wait` early: wait for the launcher itself
  while kill -0 "$pid" 2>/dev/null; do RC=0; wait "$pid" || RC=$?; done
}
