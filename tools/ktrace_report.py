#!/usr/bin/env python3
"""Reads the kernel timelines of tools/ktrace (one ktrace.<pid>.tsv per process) and prints,
per process (GPU), the steady-state step: its wall time, the time some kernel ran (busy), the
idle gaps, the NCCL kernels' time and how much of it overlapped other kernels, and the time
per kernel class, the idle time before each kernel (what the GPU waited for; names demangled
with c++filt where it is installed), and the copies
(the copy engines' transfers: time, bytes, and the idle time while one runs); then, over the
processes of a data-parallel run, how far apart their steps end. With --compare DIR2 (e.g. a 1-GPU trace), the kernel classes and the kernels whose time
per step changed most between the two, and for a data-parallel run the extra time per step
split into parts that add up: compute kernels slower beside the communication, waiting for the
slowest rank's compute, and NCCL kernels alone or idle.

  python3 tools/ktrace_report.py TRACE_DIR [--compare OTHER_DIR] [--step-kernel REGEX]
  python3 tools/ktrace_report.py TRACE_DIR --api     # a trace taken with VITGRID_KTRACE_API=1

--api: per process and host thread, the CUDA driver and runtime calls by the time spent in them
(count, total, longest): which thread waits in which call (a library's own calls included).

Steps are delimited by the optimizer's kernels (--step-kernel, default: adamw|adam|lamb|sgd,
case-insensitive): a step ends where such a run of kernels ends. The first --skip steps
(warm-up, tuning, graph capture) are left out; the rest are summarised by their median."""
import argparse
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict

CLASSES = [
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"fmha|flash|sdpa|cudnn|attention|softmax", re.I)),
    ("gemm", re.compile(r"gemm|xmma|cutlass|nvjet|cublas|sm90_|matmul|wgmma", re.I)),
    ("layernorm", re.compile(r"layer_?norm|\bln_|LayerNorm", re.I)),
    ("optimizer", re.compile(r"adam|lamb|sgd|multi_tensor", re.I)),
    ("elementwise/other", re.compile(r".")),
]


def kclass(name):
    for c, rx in CLASSES:
        if rx.search(name):
            return c
    return "elementwise/other"


def is_copy(name):
    return name.startswith("memcpy:")


def copy_size(name):
    """Bytes of a copy record ("memcpy:KIND BYTES")."""
    try:
        return int(name.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return 0


_DEMANGLED = {}


def demangle(names):
    """Readable names (c++filt -p: without the parameter lists) for the mangled kernel names
    among `names`, remembered for short(); nothing where c++filt is missing."""
    todo = sorted({n for n in names if n.startswith("_Z") and n not in _DEMANGLED})
    tool = shutil.which("c++filt")
    if not todo or not tool:
        return
    try:
        out = subprocess.run([tool, "-p"], input="\n".join(todo) + "\n", capture_output=True,
                             text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return
    if len(out) == len(todo):
        _DEMANGLED.update(zip(todo, out))


def short(name, n=90):
    name = _DEMANGLED.get(name, name)
    return name if len(name) <= n else name[: n - 3] + "..."


def records(path, api):
    """The records of one trace file as (start, end, device, stream, graph, name): the GPU's
    (kernels, copies) or, with api, the API calls (VITGRID_KTRACE_API=1; stream: host thread)."""
    with open(path) as f:
        head = f.readline()
        if not head.startswith("start\t"):
            sys.exit(f"{path}: not a vitgrid_ktrace file (header {head.strip()!r})")
        for line in f:
            p = line.rstrip("\n").split("\t", 5)
            if len(p) == 6 and p[5].startswith("api:") == api:
                yield (int(p[0]), int(p[1]), int(p[2]), int(p[3]), int(p[4]), p[5])


def load(path):
    return sorted(records(path, api=False))


def union(intervals):
    """Total length covered by [s, e) intervals (sorted by start)."""
    tot, cs, ce = 0, None, None
    for s, e in intervals:
        if ce is None or s > ce:
            if ce is not None:
                tot += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    if ce is not None:
        tot += ce - cs
    return tot


def step_ends(ks, rx, min_gap_ns=2_000_000):
    """End times of the optimizer-kernel runs (runs separated by > min_gap_ns)."""
    ends, last = [], None
    for s, e, *_rest, name in ks:
        if not rx.search(name):
            continue
        if last is not None and s - last > min_gap_ns:
            ends.append(last)
        last = e if last is None else max(last, e)
    if last is not None:
        ends.append(last)
    return ends


def analyse(path, rx, skip):
    ks = load(path)
    ends = step_ends(ks, rx)
    if len(ends) < skip + 3:
        sys.exit(f"{path}: {len(ends)} steps found by --step-kernel, need more than {skip + 2}")
    steps = []
    i = 0
    for a, b in zip(ends[skip:], ends[skip + 1:]):
        while i < len(ks) and ks[i][0] < a:
            i += 1
        j = i
        sk, cp = [], []
        while j < len(ks) and ks[j][0] < b:
            s, e = ks[j][0], min(ks[j][1], b)
            (cp if is_copy(ks[j][5]) else sk).append((s, e, ks[j][5]))
            j += 1
        wall = b - a
        busy = union([(s, e) for s, e, _ in sk])
        nccl = union([(s, e) for s, e, n in sk if kclass(n) == "nccl"])
        comp = union([(s, e) for s, e, n in sk if kclass(n) != "nccl"])
        per_class, per_name = defaultdict(int), defaultdict(int)
        for s, e, n in sk:
            per_class[kclass(n)] += e - s
            per_name[n] += e - s
        gaps = []
        gap_before = defaultdict(int)  # idle time before each kernel (name)
        last = a
        for s, e, n in sorted(sk):
            if s > last:
                gaps.append((s - last, last, n))
                gap_before[n] += s - last
            last = max(last, e)
        if b > last:
            gaps.append((b - last, last, "(step end)"))
        # copies (copy engines): their time, bytes, and the idle time while one runs
        copy = union([(s, e) for s, e, _ in cp])
        copy_bytes = sum(copy_size(n) for _, _, n in cp)
        idle_copying = union(sorted([(s, e) for s, e, _ in sk] + [(s, e) for s, e, _ in cp])) - busy
        steps.append(dict(wall=wall, busy=busy, nccl=nccl, comp=comp, per_class=per_class,
                          per_name=per_name, gaps=gaps, end=b, kernels=len(sk),
                          gap_before=gap_before, copy=copy, copy_bytes=copy_bytes,
                          copies=len(cp), idle_copying=idle_copying))
    return steps


def med(xs):
    return statistics.median(xs) if xs else 0.0


def expected_max(xs, n):
    """E[max of n independent draws from the samples xs] (their empirical distribution): what a
    synchronous step of n ranks would take if each rank's step varied as xs, independently."""
    v = sorted(xs)
    m = len(v)
    return sum(x * ((k / m) ** n - ((k - 1) / m) ** n) for k, x in enumerate(v, 1))


def dp_split(runs, one):
    """The data-parallel step against the 1-GPU step, split into parts that add up (means over
    steps, ms): the compute kernels slower beside the communication (the ranks' mean non-NCCL
    busy time against the 1-GPU's), the wait for the slowest rank's compute (the max over
    ranks against their mean, step by step), and the rest (NCCL kernels running alone, idle)
    against the 1-GPU's idle. runs: per process, its steps; one: the 1-GPU run's steps."""
    n = min(len(st) for st in runs)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    wall = mean([runs[0][i]["wall"] for i in range(n)]) / 1e6
    cbar = mean([mean([st[i]["comp"] for st in runs]) for i in range(n)]) / 1e6
    cmax = mean([max(st[i]["comp"] for st in runs) for i in range(n)]) / 1e6
    w1 = mean([s["wall"] for s in one]) / 1e6
    c1 = mean([s["comp"] for s in one]) / 1e6
    return dict(wall=wall, wall1=w1, slower=cbar - c1, wait=cmax - cbar,
                rest=(wall - cmax) - (w1 - c1),
                skew_indep=expected_max([s["wall"] for s in one], len(runs)) / 1e6 - w1)


def summarise(steps):
    keys, before = set(), set()
    for st in steps:
        keys |= set(st["per_name"])
        before |= set(st["gap_before"])
    classes = set()
    for st in steps:
        classes |= set(st["per_class"])
    return dict(
        wall=med([s["wall"] for s in steps]) / 1e6,
        busy=med([s["busy"] for s in steps]) / 1e6,
        comp=med([s["comp"] for s in steps]) / 1e6,
        nccl=med([s["nccl"] for s in steps]) / 1e6,
        nccl_alone=med([s["busy"] - s["comp"] for s in steps]) / 1e6,
        kernels=med([s["kernels"] for s in steps]),
        per_class={c: med([s["per_class"].get(c, 0) for s in steps]) / 1e6 for c in classes},
        per_name={k: med([s["per_name"].get(k, 0) for s in steps]) / 1e6 for k in keys},
        big_gaps=med([sum(g for g, _, _ in s["gaps"] if g > 20_000) for s in steps]) / 1e6,
        all_gaps=med([sum(g for g, _, _ in s["gaps"]) for s in steps]) / 1e6,
        worst_gaps=sorted((g for s in steps[-1:] for g in s["gaps"]), reverse=True)[:6],
        gap_before={k: med([s["gap_before"].get(k, 0) for s in steps]) / 1e6 for k in before},
        copy=med([s["copy"] for s in steps]) / 1e6,
        copy_bytes=med([s["copy_bytes"] for s in steps]),
        copies=med([s["copies"] for s in steps]),
        idle_copying=med([s["idle_copying"] for s in steps]) / 1e6,
    )


def report(d, rx, skip):
    files = sorted(glob.glob(os.path.join(d, "ktrace.*.tsv")))
    if not files:
        sys.exit(f"{d}: no ktrace.*.tsv files")
    out = []
    for f in files:
        steps = analyse(f, rx, skip)
        s = summarise(steps)
        demangle(list(s["per_name"]) + list(s["gap_before"]) + [n for _, _, n in s["worst_gaps"]])
        out.append((f, steps, s))
        print(f"{os.path.basename(f)}: {len(steps)} steps, median per step: wall {s['wall']:.2f} ms"
              f" | kernels busy {s['busy']:.2f} ({s['kernels']:.0f} kernels) | idle"
              f" {s['wall'] - s['busy']:.2f} (gaps > 20 us: {s['big_gaps']:.2f})"
              f" | non-NCCL kernels {s['comp']:.2f} | NCCL {s['nccl']:.2f}, of it alone"
              f" {s['nccl_alone']:.2f}")
        print("   per class (kernel time, ms/step): " + ", ".join(
            f"{c} {v:.2f}" for c, v in sorted(s["per_class"].items(), key=lambda x: -x[1])))
        print("   largest gaps of the last step (us, after -> before kernel): " + "; ".join(
            f"{g / 1e3:.0f} -> {short(n, 50)}" for g, _, n in s["worst_gaps"]))
        waits = sorted(s["gap_before"].items(), key=lambda x: -x[1])[:5]
        if waits:
            print("   idle time before each kernel (ms/step): " + "; ".join(
                f"{v:.2f} {short(k, 50)}" for k, v in waits))
        if s["copies"]:
            gb = s["copy_bytes"] / 1e9
            rate = gb / (s["copy"] / 1e3) if s["copy"] else 0.0
            print(f"   copies (copy engines): {s['copies']:.0f} per step, {s['copy']:.2f} ms, "
                  f"{gb:.3f} GB ({rate:.0f} GB/s while any runs); the GPU idle while one runs: "
                  f"{s['idle_copying']:.2f} ms")
    if len(out) > 1:  # the processes of one run: how far apart their steps end
        n = min(len(st) for _, st, _ in out)
        spread = [max(st[i]["end"] for _, st, _ in out) - min(st[i]["end"] for _, st, _ in out)
                  for i in range(n)]
        print(f"step ends across {len(out)} processes: median spread {med(spread) / 1e3:.0f} us, "
              f"max {max(spread) / 1e3:.0f} us")
    return out


def api_report(d, top):
    """The API records (VITGRID_KTRACE_API=1) of each process: per host thread, the calls by
    total time."""
    for path in sorted(glob.glob(os.path.join(d, "ktrace.*.tsv"))):
        calls = defaultdict(lambda: defaultdict(lambda: [0, 0.0, 0.0]))
        for start, end, _, thread, _, name in records(path, api=True):
            ms = (end - start) / 1e6
            c = calls[thread][name[4:]]
            c[0] += 1
            c[1] += ms
            c[2] = max(c[2], ms)
        if not calls:
            print(f"{path}: no API records (trace with VITGRID_KTRACE_API=1)")
            continue
        print(f"== {path}")
        for thread, cs in sorted(calls.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
            print(f"   thread {thread}: {sum(v[1] for v in cs.values()):.1f} ms in API calls")
            for name, (n, tot, mx) in sorted(cs.items(), key=lambda kv: -kv[1][1])[:top]:
                print(f"      {name:50s} {n:8d} calls {tot:10.2f} ms, longest {mx:8.3f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--compare", help="a second trace directory (e.g. the 1-GPU run)")
    ap.add_argument("--step-kernel", default=r"adamw|adam|lamb|sgd")
    ap.add_argument("--skip", type=int, default=6, help="steps left out at the start")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--api", action="store_true", help="the API calls per host thread instead")
    a = ap.parse_args()
    if a.api:
        api_report(a.dir, a.top)
        return
    rx = re.compile(a.step_kernel, re.I)
    print(f"== {a.dir}")
    A = report(a.dir, rx, a.skip)
    if not a.compare:
        return
    print(f"== {a.compare}")
    B = report(a.compare, rx, a.skip)
    sa, sb = A[0][2], B[0][2]
    print(f"== {a.dir} (first process) against {a.compare} (first process), ms per step")
    print(f"   wall {sa['wall']:.2f} vs {sb['wall']:.2f} ({sa['wall'] - sb['wall']:+.2f}); "
          f"non-NCCL kernels busy {sa['comp']:.2f} vs {sb['comp']:.2f} ({sa['comp'] - sb['comp']:+.2f}); "
          f"idle {sa['wall'] - sa['busy']:.2f} vs {sb['wall'] - sb['busy']:.2f}")
    for c in sorted(set(sa["per_class"]) | set(sb["per_class"])):
        x, y = sa["per_class"].get(c, 0.0), sb["per_class"].get(c, 0.0)
        print(f"   {c:18s} {x:8.2f} vs {y:8.2f} ({x - y:+.2f})")
    diffs = []
    for k in set(sa["per_name"]) | set(sb["per_name"]):
        x, y = sa["per_name"].get(k, 0.0), sb["per_name"].get(k, 0.0)
        diffs.append((x - y, x, y, k))
    diffs.sort(key=lambda t: -abs(t[0]))
    if len(A) > 1:
        d = dp_split([st for _, st, _ in A], B[0][1])
        print(f"== the {len(A)}-process step against the 1-GPU step (means over steps, ms): "
              f"{d['wall']:.2f} vs {d['wall1']:.2f} ({d['wall'] - d['wall1']:+.2f}) = compute "
              f"kernels slower {d['slower']:+.2f} + waiting for the slowest rank's compute "
              f"{d['wait']:+.2f} + NCCL alone and idle {d['rest']:+.2f}")
        print(f"   (the 1-GPU steps' own variation alone would cost {d['skew_indep']:+.2f} per "
              f"step with {len(A)} independent ranks: the mean of the slowest of {len(A)} draws)")
    print(f"   kernels whose time per step changed most:")
    for d, x, y, k in diffs[: a.top]:
        print(f"   {d:+7.3f} ({x:7.3f} vs {y:7.3f}) {short(k)}")


if __name__ == "__main__":
    main()
