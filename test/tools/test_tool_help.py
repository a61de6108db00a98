#!/usr/bin/env python3
"""Every Python tool of tools/ answers --help with its usage and exit 0 under each python3 this
machine has (the one first on PATH, e.g. pyenv's without h5py or torch, and Debian's
/usr/bin/python3): third-party modules are imported only after argument parsing. And the
binaries: `vitgrid --help`, `vitgrid train --help`, `vitgrid_dataset --help` and
`bench_loader --help` print their usage on stdout and exit 0.
Run by ctest with VITGRID_BIN and VITGRID_SOURCE_DIR set."""
import glob
import os
import shutil
import subprocess

from tool_check import ROOT, check, finish

pythons = []
for p in (shutil.which("python3"), "/usr/bin/python3"):
    if p and os.access(p, os.X_OK) and os.path.realpath(p) not in [os.path.realpath(q) for q in pythons]:
        pythons.append(p)
tools = sorted(t for t in glob.glob(os.path.join(ROOT, "tools", "*.py"))
               if os.path.basename(t) != "tool_deps.py")
check(len(tools) >= 11, f"{len(tools)} tools found in {os.path.join(ROOT, 'tools')}")
env = dict(os.environ, VITGRID_TOOLS_NO_REEXEC="1")  # --help must not need the re-run
for py in pythons:
    for t in tools:
        name = os.path.basename(t)
        p = subprocess.run([py, t, "--help"], capture_output=True, text=True, env=env, timeout=120)
        ok = p.returncode == 0 and p.stdout.startswith("usage:") and name in p.stdout.splitlines()[0]
        check(ok, f"{py} {name} --help: exit {p.returncode}, "
                  f"{(p.stdout.splitlines() or [''])[0][:60]!r}{'' if ok else ' ' + p.stderr[-300:]}")

vitgrid = os.environ.get("VITGRID_BIN", os.path.join(ROOT, "build", "bin", "vitgrid"))
dataset = os.path.join(os.path.dirname(vitgrid), "vitgrid_dataset")
loader = os.path.join(os.path.dirname(vitgrid), "bench_loader")
for cmd in ([vitgrid, "--help"], [vitgrid, "train", "--help"], [dataset, "--help"],
            [loader, "--help"]):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    ok = p.returncode == 0 and p.stdout.startswith("usage")
    check(ok, f"{os.path.basename(cmd[0])} {' '.join(cmd[1:])}: exit {p.returncode}, usage on stdout"
              f"{'' if ok else ': ' + (p.stdout + p.stderr)[-300:]}")
finish()
