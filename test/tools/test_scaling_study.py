#!/usr/bin/env python3
"""tools/scaling_study.py against the CPU executable and a stand-in nvidia-smi whose samples
are known: the per-GPU table of --each-device and --together (the latter's runs overlapping in
time, seen through a launcher that logs when each run starts and ends), the efficiencies
against the slowest GPU alone and while all were busy, the clocks and power of --clocks taken
from the steps' samples only (the stand-in alternates idle and busy samples), and one clear
error where nvidia-smi is missing.
Run by ctest with VITGRID_BIN and VITGRID_SOURCE_DIR set."""
import os
import re
import stat
import subprocess
import sys
import tempfile

from tool_check import ROOT, check, finish, load_tool

TOOL = os.path.join(ROOT, "tools", "scaling_study.py")
VITGRID = os.environ.get("VITGRID_BIN", os.path.join(ROOT, "build", "bin", "vitgrid"))
DECK = os.path.join(ROOT, "inputs", "quickstart.ini")
ss = load_tool("scaling_study")


# the busy filter: samples at >= 80% of each GPU's highest power; "[N/A]" lines skipped
s = ss.summarize_clocks("0, 1980, 80\n0, 1650, 690\n0, 1600, 600\n1, [N/A], [N/A]\n"
                        "1, 1500, 700\n2, 1900, 500\n0, 1700, 650\n", [0, 1])
check(s == {0: (1650.0, 650.0), 1: (1500.0, 700.0)},
      f"summarize_clocks keeps the listed GPUs' busy samples: {s}")

FAKE_SMI = """#!/bin/sh
if [ "$1" = "-L" ]; then
  echo "GPU 0: Stand-in (UUID: GPU-0)"; echo "GPU 1: Stand-in (UUID: GPU-1)"; exit 0
fi
while true; do
  echo "0, 1980, 80.5"; echo "1, 1980, 75.0"
  echo "0, 1650, 690.0"; echo "1, 1620, 688.0"
  sleep 0.05
done
"""

COMMON = [DECK, "--bin", VITGRID, "--per-rank-batch", "16", "--warmup", "1", "--steps", "2",
          "--extra=--model.depth=1"]

with tempfile.TemporaryDirectory() as d:
    smi = os.path.join(d, "nvidia-smi")
    with open(smi, "w") as f:
        f.write(FAKE_SMI)
    os.chmod(smi, os.stat(smi).st_mode | stat.S_IEXEC)

    p = subprocess.run([sys.executable, TOOL] + COMMON + ["--ranks", "1", "--clocks",
                                                          "--nvidia-smi", os.path.join(d, "none")],
                       capture_output=True, text=True)
    check(p.returncode != 0 and "need nvidia-smi" in p.stderr,
          f"--clocks without nvidia-smi: one clear error (rc {p.returncode}: {p.stderr.strip()})")

    # the launcher: mpirun, with the start and end of each run logged (and the GPU it was given)
    log = os.path.join(d, "launches.log")
    launcher = os.path.join(d, "launcher")
    with open(launcher, "w") as f:
        f.write(f"""#!/bin/sh
echo "start ${{CUDA_VISIBLE_DEVICES:-all}}" >> {log}
mpirun --bind-to none --oversubscribe "$@"
rc=$?
echo "end ${{CUDA_VISIBLE_DEVICES:-all}}" >> {log}
exit $rc
""")
    os.chmod(launcher, os.stat(launcher).st_mode | stat.S_IEXEC)

    out = os.path.join(d, "study.md")
    p = subprocess.run([sys.executable, TOOL] + COMMON + ["--ranks", "1", "2", "--each-device",
                                                          "--together", "--clocks", "--nvidia-smi",
                                                          smi, "--launcher", launcher, "-o", out],
                       capture_output=True, text=True)
    check(p.returncode == 0, f"study with --each-device --together --clocks runs (rc {p.returncode}) "
          f"{p.stderr[-500:]}")
    text = open(out).read() if os.path.exists(out) else ""
    print(text)
    rows = [[c.strip() for c in l.strip().strip("|").split("|")] for l in text.splitlines()
            if re.match(r"\| \d", l)]
    gpus = [r for r in rows if len(r) == 9]
    ranks = [r for r in rows if len(r) == 13]
    check(len(gpus) == 2 and [r[0] for r in gpus] == ["0", "1"], f"a row per GPU: {gpus}")
    check(len(gpus) == 2 and gpus[0][3:5] == ["1650", "690"] and gpus[1][3:5] == ["1620", "688"],
          "each GPU's clock and power alone from its busy samples only")
    check(len(gpus) == 2 and gpus[0][7:] == ["1650", "690"] and gpus[1][7:] == ["1620", "688"],
          "each GPU's clock and power with all at once, per GPU")
    check(len(ranks) == 2 and ranks[0][11:] == ["1650", "690"] and ranks[1][11:] == ["1620-1650", "688-690"],
          "the ranks rows: the clocks of the GPUs they used (a range for two)")
    if len(gpus) == 2 and len(ranks) == 2:
        slowest = min(float(r[2]) for r in gpus)
        busy = min(float(r[6]) for r in gpus)
        for r in ranks:
            per, vs, vb = float(r[5]), float(r[7].rstrip("%")), float(r[8].rstrip("%"))
            check(abs(vs - 100 * per / slowest) < 0.06,
                  f"{r[0]} rank(s): {vs}% = per-rank {per} / slowest GPU alone {slowest}")
            check(abs(vb - 100 * per / busy) < 0.06,
                  f"{r[0]} rank(s): {vb}% = per-rank {per} / slowest GPU with all busy {busy}")
        check(ranks[0][6] == "100.0%", "efficiency against the first row: 100% there")
        check(all(r[9] == "n/a" for r in ranks),
              f"no MFU on CPU ranks (no known peak): {[r[9] for r in ranks]}")
    events = open(log).read().split() if os.path.exists(log) else []
    events = list(zip(events[::2], events[1::2]))
    # alone: start 0, end 0, start 1, end 1; at once: both start before either ends; then the
    # ranks rows
    check(events[:4] == [("start", "0"), ("end", "0"), ("start", "1"), ("end", "1")] and
          sorted(events[4:6]) == [("start", "0"), ("start", "1")] and
          sorted(events[6:8]) == [("end", "0"), ("end", "1")] and len(events) == 12,
          f"alone one after the other, --together's runs overlapping: {events}")

finish()
