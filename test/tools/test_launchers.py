#!/usr/bin/env python3
"""The one-node launcher jobs/mpirun.sh: it trains the tiny deck on 2 CPU ranks through the
real mpirun (exit 0, the run's metrics written), and it splits the node's cores among the
ranks even with OMP_NUM_THREADS=1 in the environment (jobs/env.sh sets it; GNU nproc honours
it, which once bound every rank to a single core): through a stand-in mpirun that records
its arguments, 1 rank gets PE = every core this process may use. The batch scripts' --dry-run
(no SLURM needed): the node shape from SLURM_GPUS_ON_NODE / SLURM_CPUS_ON_NODE, one
--run.out_dir (the override's, else VITGRID_RUN_DIR's), VITGRID_SRUN_MPI.
Run by ctest with VITGRID_BIN and VITGRID_SOURCE_DIR set."""
import os
import stat
import subprocess
import tempfile

import h5py

from tool_check import ROOT, check, finish

LAUNCHER = os.path.join(ROOT, "jobs", "mpirun.sh")
DECK = os.path.join(ROOT, "test", "app", "tiny.ini")
env = dict(os.environ, OMP_NUM_THREADS="1")

with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "run")
    p = subprocess.run(["bash", LAUNCHER, DECK, "2", f"--run.out_dir={out}", "--run.steps=4",
                        "--checkpoint.every_steps=0"], capture_output=True, text=True, env=env,
                       timeout=240)
    steps = []
    if os.path.exists(os.path.join(out, "metrics.h5")):
        with h5py.File(os.path.join(out, "metrics.h5"), "r") as f:
            steps = list(f["/train/step"][()])
    check(p.returncode == 0 and steps and steps[-1] == 4,
          f"jobs/mpirun.sh DECK 2: trains to step 4 (exit {p.returncode}, logged steps {steps}"
          f"{'' if p.returncode == 0 else ': ' + p.stderr.strip()[-300:]})")

    # a stand-in mpirun first on PATH: it records the binding it was given
    fake = os.path.join(d, "bin")
    os.mkdir(fake)
    with open(os.path.join(fake, "mpirun"), "w") as f:
        f.write('#!/bin/sh\necho "$@" > "$VG_ARGS"\n')
    os.chmod(os.path.join(fake, "mpirun"), 0o755 | stat.S_IEXEC)
    args = os.path.join(d, "args")
    p = subprocess.run(["bash", LAUNCHER, DECK, "1"], capture_output=True, text=True,
                       env=dict(env, PATH=fake + os.pathsep + env["PATH"], VG_ARGS=args))
    got = open(args).read().split() if os.path.exists(args) else []
    cores = len(os.sched_getaffinity(0))
    want = f"slot:PE={cores}"
    check(p.returncode == 0 and want in got and "core" in got,
          f"1 rank with OMP_NUM_THREADS=1 set: bound to all {cores} cores ({want} in {got})")


def dry(script, *args, **extra):
    e = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    e.update(extra)
    p = subprocess.run(["bash", os.path.join(ROOT, "jobs", script), "--dry-run", *args],
                       capture_output=True, text=True, env=e, timeout=60)
    line = [l for l in p.stdout.splitlines() if l.startswith("vitgrid: command:")]
    return p.returncode, (line[0].split()[2:] if line else []), p.stdout + p.stderr


rc, cmd, out = dry("slurm_1node.sbatch", DECK, "--run.out_dir=/x/run", "--run.steps=3",
                   SLURM_GPUS_ON_NODE="4", SLURM_CPUS_ON_NODE="64", SLURM_JOB_ID="7",
                   VITGRID_SRUN_MPI="pmi2")
outs = [a for a in cmd if a.startswith("--run.out_dir=")]
check(rc == 0 and outs == ["--run.out_dir=/x/run"] and "--ntasks-per-node=4" in cmd
      and "--cpus-per-task=16" in cmd and "--mpi=pmi2" in cmd and "--checkpoint.resume=auto" in cmd,
      f"slurm_1node.sbatch --dry-run, 4 GPUs, 64 CPUs, --run.out_dir given: exit {rc}, {cmd}")
rc, cmd, out = dry("slurm_multinode.sbatch", DECK, PATH="/usr/bin:/bin", SLURM_CPUS_ON_NODE="8",
                   SLURM_JOB_ID="8", SLURM_JOB_NAME="vg", SLURM_NNODES="2", VITGRID_RUN_DIR="/y/run")
outs = [a for a in cmd if a.startswith("--run.out_dir=")]
check(rc == 0 and outs == ["--run.out_dir=/y/run"] and "--ntasks-per-node=8" in cmd
      and "--cpus-per-task=1" in cmd and "--nodes=2" in cmd and "CPU only" in out,
      f"slurm_multinode.sbatch --dry-run, CPU-only 8-CPU nodes, VITGRID_RUN_DIR: exit {rc}, {cmd}")
rc, cmd, out = dry("mpirun.sh", DECK, "2", "--run.steps=3")
check(rc == 0 and cmd[:3] == ["mpirun", "-np", "2"] and cmd[-1] == "--run.steps=3",
      f"mpirun.sh --dry-run: exit {rc}, {cmd}")

finish()
