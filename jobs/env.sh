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
VITGRID_ROOT=${VITGRID_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
VITGRID_BIN=${VITGRID_BIN:-$VITGRID_ROOT/build/bin/vitgrid}
# Exit code vitgrid uses after a preemption checkpoint: the batch scripts requeue on it.
VITGRID_EXIT_REQUEUE=3
