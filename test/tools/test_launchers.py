#!/usr/bin/env python3
"""The one-node launcher jobs/mpirun.sh: it trains the tiny deck on 2 CPU ranks through the
real mpirun (exit 0, the run's metrics written), and it splits the node's cores among the
ranks even with OMP_NUM_THREADS=1 in the environment (jobs/env.sh sets it; GNU nproc honours
it, which once bound every rank to a single core): through a stand-in mpirun that records
its arguments, 1 rank gets PE = every core this process may use. The batch scripts' --dry-run
(no SLURM needed): the node shape from SLURM_GPUS_ON_NODE / SLURM_CPUS_ON_NODE, one
--run.out_dir (the override's, else VITGRID_RUN_DIR's), VITGRID_SRUN_MPI.
A SIGTERM to jobs/mpirun.sh reaches the ranks even through an mpirun that forwards no SIGUSR1.
Run by ctest with VITGRID_BIN and VITGRID_SOURCE_DIR set."""
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

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

    # a stand-in mpirun that catches SIGUSR1 and forwards nothing (Open MPI 4.1.6 in an Ubuntu
    # 24.04 container did): a SIGTERM to the launch script still reaches its two ranks, which
    # exit 3, and so does the script
    ready = os.path.join(d, "ready")
    os.mkdir(ready)
    rank = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(3))\n"
            f"open(os.path.join({ready!r}, str(os.getpid())), 'w').close()\n"
            "time.sleep(60)\n")
    with open(os.path.join(fake, "mpirun"), "w") as f:
        f.write(f"#!{sys.executable}\n"
                "import signal, subprocess, sys\n"
                "signal.signal(signal.SIGUSR1, lambda *a: None)\n"
                f"ranks = [subprocess.Popen([sys.executable, '-c', {rank!r}]) for _ in range(2)]\n"
                "sys.exit(max(r.wait() for r in ranks))\n")
    p = subprocess.Popen(["bash", LAUNCHER, DECK, "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=dict(env, PATH=fake + os.pathsep + env["PATH"]),
                         start_new_session=True)
    t0 = time.time()
    while len(os.listdir(ready)) < 2 and time.time() - t0 < 60 and p.poll() is None:
        time.sleep(0.05)
    started = len(os.listdir(ready))
    p.send_signal(signal.SIGTERM)
    try:
        rc = p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the script, the stand-in and its ranks
        p.wait()
        rc = None
    check(started == 2 and rc == 3,
          f"a launcher that forwards no SIGUSR1: the script's SIGTERM reaches both ranks "
          f"(started {started}, exit {rc}, in {time.time() - t0:.1f} s)")


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
