#!/usr/bin/env python3
"""Scaling-study driver: runs `vitgrid bench` over rank counts and layouts and tabulates
images/s, per-device throughput, efficiency against the first row, MFU and memory.

    tools/scaling_study.py DECK --ranks 1 2 4 8 [--per-rank-batch 256] [--layout dp|tp1d|pipe]
                           [--launcher "mpirun --bind-to none"] [--extra "--precision.mode=bf16"]
                           [--each-device] [--together] [--clocks] [-o study.md]

Weak scaling by default: the global batch grows with the data-parallel size so every rank keeps
--per-rank-batch samples. Each row is one `mpirun -np N vitgrid bench` (or the --launcher you
give, e.g. "srun --ntasks"), so the same script serves a laptop, a node and a cluster.

On one GPU node, --each-device first runs the one-rank bench alone on each GPU (GPU i of
`nvidia-smi -L`, through CUDA_VISIBLE_DEVICES) and adds an efficiency against N x the slowest
of them: GPUs of one model running at their power limit differ by a few % in clock, and a
synchronous data-parallel step goes at the slowest one's pace. That column leaves the chips'
differences out; what it still shows is the communication and the GPUs slowing each other down
(with all of them busy they run hotter, and their clocks drop at the same power).
--together separates those two: it runs the one-rank bench on every GPU at the same time, as
independent jobs that never communicate, and adds an efficiency against N x the slowest GPU
while all were busy. What that column still shows is the data-parallel communication (and
what it costs the kernels beside it), nothing else. --clocks samples nvidia-smi every 100 ms
during each run and adds the SM clock and board power of the GPUs it used (per GPU, the median
over the samples at >= 80% of its highest power: the steps, not the start-up; a range when
several GPUs ran)."""
import argparse
import contextlib
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def count_gpus(smi):
    p = subprocess.run([smi, "-L"], capture_output=True, text=True)
    n = sum(1 for l in p.stdout.splitlines() if l.startswith("GPU "))
    if p.returncode != 0 or n == 0:
        sys.exit(f"scaling_study: --each-device / --together: `{smi} -L` lists no GPU")
    return n


def summarize_clocks(text, gpus):
    """nvidia-smi CSV samples (index, SM MHz, W) -> {gpu: (median MHz, median W)} over each
    listed GPU's samples at >= 80% of its highest power."""
    by = {}
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        try:
            by.setdefault(int(f[0]), []).append((float(f[1]), float(f[2])))
        except (ValueError, IndexError):
            continue  # "[N/A]" fields, a line cut short when sampling stopped
    out = {}
    for g in gpus:
        v = by.get(g, [])
        if not v:
            continue
        top = max(w for _, w in v)
        busy = [(c, w) for c, w in v if w >= 0.8 * top]
        out[g] = (statistics.median(c for c, _ in busy), statistics.median(w for _, w in busy))
    return out


class Clocks:
    """nvidia-smi sampling while a run lasts; .summary as summarize_clocks."""

    def __init__(self, smi, gpus):
        self.smi, self.gpus, self.summary = smi, gpus, {}

    def __enter__(self):
        self.f = tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen([self.smi, "--query-gpu=index,clocks.sm,power.draw",
                                   "--format=csv,noheader,nounits", "-lms", "100"],
                                  stdout=self.f, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        self.p.terminate()
        self.p.wait()
        self.f.seek(0)
        self.summary = summarize_clocks(self.f.read(), self.gpus)
        self.f.close()
        return False

    def columns(self, gpu=None):
        """[SM MHz, W]: of one GPU, or the range over every GPU sampled (gpu None)."""
        def span(vals):
            lo, hi = min(vals), max(vals)
            return f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"
        v = list(self.summary.values()) if gpu is None else [self.summary[gpu]] if gpu in self.summary else []
        if not v:
            return ["", ""]
        return [span([c for c, _ in v]), span([w for _, w in v])]


def table_head(cols):
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def launch(args, n, layout, env_extra=None):
    """Starts one `vitgrid bench` of n ranks; result() waits for it."""
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
               NCCL_NVLS_ENABLE="0", **(env_extra or {}))
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    return cmd, subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env), out, err


def result(run):
    """(img/s, step ms, MFU % or None, peak memory GiB) of a launch(); exits with its output if
    it failed."""
    cmd, p, out, err = run
    p.wait()
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    out.close()
    err.close()
    line = next((l for l in stdout.splitlines() if l.startswith("bench |")), None)
    if p.returncode != 0 or line is None:
        sys.exit(f"scaling_study: {' '.join(cmd)} failed:\n{stdout[-2000:]}{stderr[-2000:]}")
    ips = float(re.search(r"\| ([\d.]+) img/s \|", line).group(1))
    m = re.search(r"MFU ([\d.]+)%", line)  # none on the CPU backend without --peak-tflops
    mfu = float(m.group(1)) if m else None
    mem = float(re.search(r"peak mem ([\d.]+) GiB", line).group(1))
    step = float(re.search(r"step ([\d.]+) ms", line).group(1))
    return ips, step, mfu, mem


def bench(args, n, layout, env_extra=None):
    return result(launch(args, n, layout, env_extra))


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
    ap.add_argument("--each-device", action="store_true",
                    help="first the one-rank bench alone on each GPU of this node")
    ap.add_argument("--together", action="store_true",
                    help="the one-rank bench on every GPU of this node at once, no communication")
    ap.add_argument("--clocks", action="store_true",
                    help="SM clock and power of the GPUs each run used (nvidia-smi)")
    ap.add_argument("--nvidia-smi", default="nvidia-smi", help=argparse.SUPPRESS)
    ap.add_argument("-o", "--output", default="")
    a = ap.parse_args()
    smi = shutil.which(a.nvidia_smi)
    if (a.each_device or a.together or a.clocks) and not smi:
        sys.exit("scaling_study: --each-device, --together and --clocks need nvidia-smi (a GPU node)")

    def sampled(gpus):
        return Clocks(smi, gpus) if a.clocks else contextlib.nullcontext()

    def clock_cols(c, gpu=None):
        return c.columns(gpu) if c else []

    hc = ["SM MHz", "W"] if a.clocks else []
    text = ""
    slowest = busy = None
    if a.each_device or a.together:
        ngpu = count_gpus(smi)
        alone, together = {}, {}
        if a.each_device:
            for g in range(ngpu):
                with sampled([g]) as c:
                    r = bench(a, 1, "dp", {"CUDA_VISIBLE_DEVICES": str(g)})
                alone[g] = r, clock_cols(c)  # the clocks are summarised as the sampling stops
            slowest = min(r[0][0] for r in alone.values())
        if a.together:
            with sampled(list(range(ngpu))) as c:
                runs = {g: launch(a, 1, "dp", {"CUDA_VISIBLE_DEVICES": str(g)}) for g in range(ngpu)}
                results = {g: result(r) for g, r in runs.items()}
            together = {g: (r, clock_cols(c, g)) for g, r in results.items()}
            busy = min(r[0][0] for r in together.values())
        cols = ["GPU"]
        if a.each_device:
            cols += ["alone: step ms", "img/s"] + hc
        if a.together:
            cols += ["all at once: step ms", "img/s"] + hc
        rows = table_head(cols)
        for g in range(ngpu):
            cols = [str(g)]
            if a.each_device:
                (ips, step, _, _), cc = alone[g]
                cols += [f"{step:.2f}", f"{ips:.1f}"] + cc
            if a.together:
                (ips, step, _, _), cc = together[g]
                cols += [f"{step:.2f}", f"{ips:.1f}"] + cc
            rows.append("| " + " | ".join(cols) + " |")
            print(rows[-1], flush=True)
        text += "\n".join(rows) + "\n\n"
    hs = (["vs slowest GPU"] if slowest else []) + (["vs all busy"] if busy else [])
    rows = table_head(["ranks", "layout", "global batch", "step ms", "img/s", "img/s per rank",
                       "efficiency"] + hs + ["MFU", "peak mem GiB"] + hc)
    base = None
    for n in a.ranks:
        with sampled(list(range(n))) as c:
            ips, step, mfu, mem = bench(a, n, a.layout)
        per = ips / n
        base = base or per
        gb = a.per_rank_batch * (n if a.layout == "dp" else 1)
        cols = [str(n), a.layout, str(gb), f"{step:.1f}", f"{ips:.1f}", f"{per:.1f}", f"{100 * per / base:.1f}%"]
        for ref in (slowest, busy):
            if ref:
                cols.append(f"{100 * per / ref:.1f}%" if a.layout == "dp" else "")
        cols += [f"{mfu:.1f}%" if mfu is not None else "n/a", f"{mem:.2f}"] + clock_cols(c)
        rows.append("| " + " | ".join(cols) + " |")
        print(rows[-1], flush=True)
    text += "\n".join(rows) + "\n"
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
