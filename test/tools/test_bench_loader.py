#!/usr/bin/env python3
"""tools/bench_loader on CPU ranks, on a small tree of photo-like JPEGs
(test/data/make_jpeg_tree.py): one rank prints its loader's rate; two ranks under mpirun each
print theirs (a batch of the deck's global batch each) and rank 0 their sum; a bad path ends
both ranks with exit 2 and one message naming it.
Run by ctest with VITGRID_BIN and VITGRID_SOURCE_DIR set."""
import os
import re
import subprocess
import sys
import tempfile

from tool_check import ROOT, check, finish

VITGRID = os.environ.get("VITGRID_BIN", os.path.join(ROOT, "build", "bin", "vitgrid"))
TOOL = os.path.join(os.path.dirname(VITGRID), "bench_loader")
DECK = os.path.join(ROOT, "test", "app", "tiny.ini")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
RATE = r"([\d.]+) img/s"


def run(np_, args):
    cmd = (["mpirun", "-np", str(np_), "--oversubscribe"] if np_ else []) + [TOOL, DECK] + args
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)


with tempfile.TemporaryDirectory() as tmp:
    tree = os.path.join(tmp, "tree")
    py = os.environ.get("VG_PYTHON3", sys.executable)
    subprocess.run([py, os.path.join(ROOT, "test", "data", "make_jpeg_tree.py"), tree,
                    "--classes", "3", "--train", "12", "--val", "2"], check=True,
                   capture_output=True)
    args = ["--data.dataset=folder", f"--data.path={tree}", "--model.num_classes=3",
            "--model.image_size=32", "--model.patch_size=8", "--data.crop_padding=0",
            "--data.global_batch=8", "--data.workers=1", "--batches=4"]

    one = run(0, args)
    lines = [ln for ln in one.stdout.splitlines() if ln.startswith("input |")]
    check(one.returncode == 0 and len(lines) == 1 and "rank" not in lines[0]
          and "batch 8" in lines[0] and re.search(RATE, lines[0]) is not None,
          f"one rank: exit {one.returncode}, one rate line: {lines}")

    two = run(2, args)
    ranks = {}
    for ln in two.stdout.splitlines():
        m = re.match(r"input \| rank (\d) of 2 \|.*batch (\d+) \|.*\| " + RATE, ln)
        if m:
            ranks[int(m.group(1))] = (int(m.group(2)), float(m.group(3)))
    total = re.search(r"input \| all 2 ranks at once \| " + RATE + r" \(([\d.]+) per rank\)",
                      two.stdout)
    check(two.returncode == 0 and sorted(ranks) == [0, 1], f"two ranks: exit {two.returncode}, "
          f"a line from each: {sorted(ranks)}")
    check(all(b == 8 for b, _ in ranks.values()), "each rank a batch of the deck's 8")
    if total and len(ranks) == 2:
        s = sum(r for _, r in ranks.values())
        check(abs(float(total.group(1)) - s) <= 2, f"rank 0's total {total.group(1)} img/s is the "
              f"sum of the ranks' ({s:.0f})")
    else:
        check(False, f"rank 0's total line: {two.stdout[-400:]}")

    bad = run(2, [a if not a.startswith("--data.path=") else
                  f"--data.path={os.path.join(tmp, 'none')}" for a in args])
    msgs = [ln for ln in (bad.stdout + bad.stderr).splitlines() if ln.startswith("bench_loader:")]
    check(bad.returncode == 2 and len(msgs) == 1 and "none" in msgs[0],
          f"a bad path: exit {bad.returncode}, {len(msgs)} message(s): {msgs}")
finish()
