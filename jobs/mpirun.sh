#!/usr/bin/env bash
# One node, one rank per GPU (or NP CPU ranks), explicit binding.
#   jobs/mpirun.sh [--dry-run] DECK [NP] [--section.key=value ...]
# NP defaults to the number of GPUs (nvidia-smi -L), else 2. Output goes to --run.out_dir=...
# when given, else VITGRID_RUN_DIR when set, else the deck's run.out_dir. --dry-run (or
# VITGRID_DRY_RUN=1) prints the resolved mpirun command and exits 0.
set -euo pipefail
source "$(dirname "$0")/env.sh"
vg_launcher_args "usage: jobs/mpirun.sh [--dry-run] DECK [NP] [--section.key=value ...]" "$@"
set -- "${ARGS[@]}"
DECK=${1:?usage: jobs/mpirun.sh [--dry-run] DECK [NP] [--section.key=value ...]}
shift
if [ -z "$OUT_DIR" ] && [ -n "${VITGRID_RUN_DIR:-}" ]; then set -- "$@" --run.out_dir="$VITGRID_RUN_DIR"; fi
if [[ ${1:-} =~ ^[0-9]+$ ]]; then NP=$1; shift; else
  NP=$(nvidia-smi -L 2>/dev/null | wc -l || true); [ "${NP:-0}" -gt 0 ] || NP=2
fi
# Each rank picks GPU = its local rank inside vitgrid, so no CUDA_VISIBLE_DEVICES juggling;
# bind each rank to its own share of cores (map-by slot with PE=cores/NP).
# (GNU nproc honours OMP_NUM_THREADS, which env.sh sets to 1: count the cores without it)
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
PE=$(( CORES / NP )); [ "$PE" -ge 1 ] || PE=1
BIND="--map-by slot:PE=$PE --bind-to core"
[ $(( NP * PE )) -le "$CORES" ] || BIND="--oversubscribe --bind-to none"
# SIGTERM or SIGINT to this script (kill, a scheduler) becomes SIGUSR1 to mpirun, which sends
# it on to every rank at once: they finish the step, write a checkpoint and exit 3, and so does
# this script. (A SIGTERM to mpirun itself: see VITGRID_KILL_GRACE in env.sh.)
CMD=(mpirun -np "$NP" $BIND -x OMP_NUM_THREADS -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH
     "$VITGRID_BIN" train "$DECK" "$@")
if [ "$DRY" = "1" ]; then echo "vitgrid: command:$(printf ' %q' "${CMD[@]}")"; exit 0; fi
vg_run_forwarding_signals "${CMD[@]}"
exit "$RC"
