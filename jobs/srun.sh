#!/usr/bin/env bash
# vitgrid under SLURM: one srun step over the allocation, its shape taken from the allocation.
# Run by jobs/slurm_1node.sbatch and jobs/slurm_multinode.sbatch, or directly inside salloc:
#   salloc -N 2 --exclusive jobs/srun.sh DECK [--section.key=value ...]
#   jobs/srun.sh --dry-run DECK ...      (or VITGRID_DRY_RUN=1): print the resolved command, exit 0
# Ranks per node: VITGRID_RANKS_PER_NODE, else sbatch's --ntasks-per-node, else the node's GPUs
# (SLURM_GPUS_ON_NODE, else nvidia-smi -L), else one per allocated CPU (CPU-only node). CPUs per rank:
# --cpus-per-task if given, else the node's CPUs split evenly. srun's --mpi: VITGRID_SRUN_MPI,
# else detected from `srun --mpi=list` and the MPI library vitgrid links (Open MPI: pmix, MPICH:
# pmi2). Run directory: --run.out_dir=DIR among the overrides, else VITGRID_RUN_DIR, else
# RUN_DIR, else runs/<job name>-<job id> under the job's working directory (sbatch --chdir).
# Exit 3 (preempted after a checkpoint) requeues the job when VITGRID_REQUEUE=1 (the batch
# scripts set it); a requeued job resumes (--checkpoint.resume=auto) into the same directory.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export VITGRID_HOME=${VITGRID_HOME:-$(dirname "$HERE")}
source "$VITGRID_HOME/jobs/env.sh"

usage="usage: jobs/srun.sh [--dry-run] DECK [--section.key=value ...]"
vg_launcher_args "$usage" "$@"
[ "${#ARGS[@]}" -ge 1 ] || { echo "$usage" >&2; exit 2; }
DECK=${ARGS[0]}
OVERRIDES=("${ARGS[@]:1}")
# a relative deck is looked for in the working directory, then in the checkout
if [ ! -f "$DECK" ] && [ -f "$VITGRID_HOME/$DECK" ]; then DECK=$VITGRID_HOME/$DECK; fi
[ -f "$DECK" ] || echo "vitgrid: warning: deck '$DECK' not found" >&2
[ -x "$VITGRID_BIN" ] || echo "vitgrid: warning: no executable at VITGRID_BIN=$VITGRID_BIN" >&2

# ---- the node shape
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
GPUS=${SLURM_GPUS_ON_NODE:-}
if [ -z "$GPUS" ]; then GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
GPUS=${GPUS:-0}
NODE_CPUS=${SLURM_CPUS_ON_NODE:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
if [ -n "${VITGRID_RANKS_PER_NODE:-}" ]; then RPN=$VITGRID_RANKS_PER_NODE
elif [ -n "${SLURM_NTASKS_PER_NODE:-}" ]; then RPN=$SLURM_NTASKS_PER_NODE
elif [ "$GPUS" -gt 0 ]; then RPN=$GPUS
else RPN=$NODE_CPUS; fi
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then CPT=$SLURM_CPUS_PER_TASK
else CPT=$(( NODE_CPUS / RPN )); [ "$CPT" -ge 1 ] || CPT=1; fi
KIND=$([ "$GPUS" -gt 0 ] && echo "$GPUS GPUs per node" || echo "CPU only")

# ---- srun's MPI plugin
if [ -n "${VITGRID_SRUN_MPI+set}" ]; then MPI=$VITGRID_SRUN_MPI; MPI_WHY="VITGRID_SRUN_MPI"
else
  PLUGINS=$(srun --mpi=list 2>&1 | tr -s ' \t:,' '\n\n\n\n' || true)  # fails outside SLURM
  has() { grep -qx "$1" <<<"$PLUGINS"; }
  if ldd "$VITGRID_BIN" 2>/dev/null | grep -q 'libmpich\|libmpi\.so\.12'; then PREF="pmi2 pmix"
  else PREF="pmix pmi2"; fi   # Open MPI (libmpi.so.40) or unknown
  MPI=; MPI_WHY="srun --mpi=list has neither pmix nor pmi2: srun's MpiDefault"
  for p in $PREF; do if has "$p"; then MPI=$p; MPI_WHY="detected (srun --mpi=list)"; break; fi; done
fi

RUN_DIR=${OUT_DIR:-${VITGRID_RUN_DIR:-${RUN_DIR:-$PWD/runs/${SLURM_JOB_NAME:-vitgrid}-${SLURM_JOB_ID:-local}}}}
CMD=(srun --nodes="$NNODES" --ntasks-per-node="$RPN" --cpus-per-task="$CPT"
     --distribution=block:block --cpu-bind=cores --gpu-bind=none)
[ -n "$MPI" ] && CMD+=(--mpi="$MPI")
CMD+=("$VITGRID_BIN" train "$DECK")
[ -n "$OUT_DIR" ] || CMD+=(--run.out_dir="$RUN_DIR")
# checkpoint.resume=auto: a requeued job continues from its newest complete checkpoint
CMD+=(--checkpoint.resume=auto "${OVERRIDES[@]}")

echo "vitgrid: job ${SLURM_JOB_ID:-(none)} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}:" \
     "$NNODES node(s) x $RPN ranks, $CPT CPUs per rank, $KIND; srun --mpi=${MPI:-(default)} ($MPI_WHY)"
echo "vitgrid: run dir $RUN_DIR"
echo "vitgrid: command:$(printf ' %q' "${CMD[@]}")"
if [ "$DRY" = "1" ]; then exit 0; fi
[ -n "${SLURM_JOB_ID:-}" ] || { echo "vitgrid: not inside a SLURM allocation (use sbatch or salloc, or jobs/mpirun.sh)" >&2; exit 2; }

# SIGUSR1/SIGTERM to this script (scancel --signal=USR1 --batch, the end of the time limit)
# goes on to srun, which forwards it to every rank: they finish the step, write a checkpoint
# and exit 3. (--signal=USR1@120 and plain scancel --signal=USR1 reach the ranks directly.)
vg_run_forwarding_signals "${CMD[@]}"
rc=$RC
if [ "$rc" = "$VITGRID_EXIT_REQUEUE" ] && [ "${VITGRID_REQUEUE:-0}" = "1" ]; then
  echo "vitgrid: preempted after a checkpoint (exit $rc); requeueing job ${SLURM_JOB_ID}"
  scontrol requeue "$SLURM_JOB_ID"
fi
echo "vitgrid: srun exited $rc"
exit "$rc"
