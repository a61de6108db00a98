#!/usr/bin/env python3
"""The one-node launcher jobs/mpirun.sh: it trains the tiny deck on 2 CPU ranks through the
real mpirun (exit 0, the run's metrics written), and it splits the node's cores among the
ranks even with OMP_NUM_THREADS=1 in the environment (jobs/env.sh sets it; GNU nproc honours
it, which once bound every rank to a single core): through a stand-in mpirun that records
its arguments, 1 rank gets PE = every core this process may use.
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

finish()
