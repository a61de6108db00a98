#!/usr/bin/env python3
"""Scaling-study driver: runs `vitgrid bench` over rank counts and layouts and tabulates
images/s, per-device throughput, efficiency against the first row, MFU and memory.

    tools/scaling_study.py DECK --ranks 1 2 4 8 [--per-rank-batch 256] [--layout dp|tp1d|pipe]
                           [--launcher "mpirun --bind-to none"] [--extra "--precision.mode=bf16"]
                           [-o study.md]

Weak scaling by default: the global batch grows with the data-parallel size so every rank keeps
--per-rank-batch samples. Each row is one `mpirun -np N vitgrid bench` (or the --launcher you
give, e.g. "srun --ntasks"), so the same script serves a laptop, a node and a cluster."""
import argparse
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(args, n, layout):
    extra = []
    data = n
    if layout == "tp1d" and n > 1:
        extra = [f"--parallel.tensor={n}", "--parallel.tensor_mode=1d"]
        data = 1
    elif layout == "pipe" and n > 1:
        extra = [f"--parallel.pipeline={n}", f"--parallel.micro_batches={2 * n}"]
        data = 1
    cmd = (shlex.split(args.launcher) + ["-np", str(n)] if "srun" not in args.launcher
           else shlex.split(args.launcher) + [str(n)])
    cmd += [args.bin, "bench", args.deck, f"--data.global_batch={args.per_rank_batch * data}",
            f"--warmup={args.warmup}", f"--steps={args.steps}"] + extra + shlex.split(args.extra)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               NCCL_NVLS_ENABLE="0")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((l for l in p.stdout.splitlines() if l.startswith("bench |")), None)
    if p.returncode != 0 or line is None:
        sys.exit(f"scaling_study: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    ips = float(re.search(r"\| ([\d.]+) img/s \|", line).group(1))
    mfu = float(re.search(r"MFU ([\d.]+)%", line).group(1))
    mem = float(re.search(r"peak mem ([\d.]+) GiB", line).group(1))
    step = float(re.search(r"step ([\d.]+) ms", line).group(1))
    return ips, step, mfu, mem


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("deck")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--per-rank-batch", type=int, default=256)
    ap.add_argument("--layout", choices=["dp", "tp1d", "pipe"], default="dp")
    ap.add_argument("--launcher", default="mpirun --bind-to none --oversubscribe")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin", "vitgrid"))
    ap.add_argument("--extra", default="")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("-o", "--output", default="")
    a = ap.parse_args()
    rows = ["| ranks | layout | global batch | step ms | img/s | img/s per rank | efficiency | MFU | peak mem GiB |",
            "|---|---|---|---|---|---|---|---|---|"]
    base = None
    for n in a.ranks:
        ips, step, mfu, mem = bench(a, n, a.layout)
        per = ips / n
        base = base or per
        gb = a.per_rank_batch * (n if a.layout == "dp" else 1)
        rows.append(f"| {n} | {a.layout} | {gb} | {step:.1f} | {ips:.1f} | {per:.1f} | {100 * per / base:.1f}% | {mfu:.1f}% | {mem:.2f} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
