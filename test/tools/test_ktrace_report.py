#!/usr/bin/env python3
"""tools/ktrace_report.py on synthetic kernel timelines whose answers follow from how they are
built: steps delimited by the optimizer kernel, busy time as the union of overlapping kernels,
idle gaps, NCCL time alone and overlapped, per-class time, the spread of step ends across
processes, the comparison of two runs, the data-parallel step's split into slower kernels,
waiting for the slowest rank and the rest, and one clear error for a file that is not a trace."""
import os
import shutil
import subprocess
import sys
import tempfile

from tool_check import ROOT, check, finish, load_tool

TOOL = os.path.join(ROOT, "tools", "ktrace_report.py")
kr = load_tool("ktrace_report")


MS = 1_000_000  # ns


def write_trace(path, steps, offset_ns, gemm_ms, nccl=True, copy=False):
    """One process: per 10 ms step a GEMM [0, gemm_ms), (optionally) an NCCL kernel
    [gemm_ms - 1, gemm_ms + 2) on another stream, then the optimizer [gemm_ms + 2.5, + 3.5);
    (optionally) a 2 MB copy [gemm_ms + 1.5, gemm_ms + 3) beside them."""
    with open(path, "w") as f:
        f.write("start\tend\tdevice\tstream\tgraph\tname\n")
        for s in range(steps):
            b = s * 10 * MS + offset_ns
            g = int(gemm_ms * MS)
            f.write(f"{b}\t{b + g}\t0\t7\t1\tnvjet_sm90_tst_128x128_gemm\n")
            if copy:
                f.write(f"{b + g + 3 * MS // 2}\t{b + g + 3 * MS}\t0\t11\t1\tmemcpy:PtoP 2000000\n")
            if nccl:
                f.write(f"{b + g - MS}\t{b + g + 2 * MS}\t0\t9\t1\tncclDevKernel_AllReduce_Sum_f32\n")
            f.write(f"{b + g + 5 * MS // 2}\t{b + g + 7 * MS // 2}\t0\t7\t1\t_ZN7vitgrid4cuda12adamw_kernelEv\n")


with tempfile.TemporaryDirectory() as tmp:
    dp, one = os.path.join(tmp, "dp"), os.path.join(tmp, "one")
    os.makedirs(dp)
    os.makedirs(one)
    write_trace(os.path.join(dp, "ktrace.1.tsv"), 12, 0, 5.0)
    write_trace(os.path.join(dp, "ktrace.2.tsv"), 12, 250_000, 5.0)
    write_trace(os.path.join(one, "ktrace.3.tsv"), 12, 0, 4.0, nccl=False)

    rx = kr.re.compile("adamw", kr.re.I)
    s = kr.summarise(kr.analyse(os.path.join(dp, "ktrace.1.tsv"), rx, 2))
    # per step: GEMM 5 ms, NCCL 3 ms of which 1 overlaps the GEMM, optimizer 1 ms; busy is
    # [0, 7) + [7.5, 8.5) = 8 ms of the 10 ms step
    check(abs(s["wall"] - 10.0) < 1e-9, f"step wall time 10 ms ({s['wall']})")
    check(abs(s["busy"] - 8.0) < 1e-9, f"busy time is the union of the kernels: 8 ms ({s['busy']})")
    check(abs(s["nccl"] - 3.0) < 1e-9 and abs(s["nccl_alone"] - 2.0) < 1e-9,
          f"NCCL 3 ms, 2 ms of it alone ({s['nccl']}, {s['nccl_alone']})")
    check(abs(s["comp"] - 6.0) < 1e-9, f"non-NCCL kernels busy 6 ms ({s['comp']})")
    check(abs(s["per_class"]["gemm"] - 5.0) < 1e-9 and abs(s["per_class"]["optimizer"] - 1.0) < 1e-9,
          f"per-class times ({s['per_class']})")
    check(abs(s["all_gaps"] - 2.0) < 1e-9, f"idle gaps 2 ms per step ({s['all_gaps']})")

    # the idle time before each kernel: 0.5 ms before the optimizer (after the NCCL kernel),
    # 1.5 ms after it, before the next step's GEMM
    check(abs(s["gap_before"]["_ZN7vitgrid4cuda12adamw_kernelEv"] - 0.5) < 1e-9
          and abs(s["gap_before"]["nvjet_sm90_tst_128x128_gemm"] - 1.5) < 1e-9,
          f"idle before the optimizer 0.5 ms, before the GEMM 1.5 ms ({s['gap_before']})")
    # copies are not kernels: the busy time stays, the copy's 1.5 ms and 2 MB are counted, and
    # 0.5 ms of it runs while no kernel does ([gemm + 2, gemm + 2.5))
    cpd = os.path.join(tmp, "copy")
    os.makedirs(cpd)
    write_trace(os.path.join(cpd, "ktrace.6.tsv"), 12, 0, 5.0, copy=True)
    c = kr.summarise(kr.analyse(os.path.join(cpd, "ktrace.6.tsv"), rx, 2))
    check(abs(c["busy"] - 8.0) < 1e-9 and abs(c["copy"] - 1.5) < 1e-9
          and c["copy_bytes"] == 2_000_000 and abs(c["idle_copying"] - 0.5) < 1e-9,
          f"copy 1.5 ms, 2 MB, 0.5 ms of idle while it runs, busy 8 ms "
          f"({c['copy']}, {c['copy_bytes']}, {c['idle_copying']}, {c['busy']})")
    p = subprocess.run([sys.executable, TOOL, cpd, "--skip", "2"], capture_output=True, text=True)
    check(p.returncode == 0 and "copies (copy engines): 1 per step, 1.50 ms, 0.002 GB" in p.stdout,
          f"the report prints the copies (exit {p.returncode}) {p.stdout[-400:]}")
    if shutil.which("c++filt"):  # kernel names demangled where the tool is there
        check("0.50 vitgrid::cuda::adamw_kernel" in p.stdout,
              "the idle time before the optimizer, under its demangled name")

    p = subprocess.run([sys.executable, TOOL, dp, "--compare", one, "--skip", "2"],
                       capture_output=True, text=True)
    out = p.stdout
    check(p.returncode == 0, f"the report runs (exit {p.returncode}) {p.stderr[-300:]}")
    check("median spread 250 us" in out, "step ends across the 2 processes: 250 us apart")
    check("gemm                   5.00 vs     4.00 (+1.00)" in out,
          "the comparison shows the GEMM class 1 ms slower per step")

    # the data-parallel split: ranks of 5 and 6 ms GEMMs (non-NCCL busy 6 and 7 ms per 10 ms
    # step) against the 4 ms GEMM of one GPU (busy 5 ms): kernels slower +1.5, waiting for the
    # slowest +0.5, the rest (3 ms NCCL alone or idle against 5 ms idle) -2.0; sum 0
    skew = os.path.join(tmp, "skew")
    os.makedirs(skew)
    write_trace(os.path.join(skew, "ktrace.4.tsv"), 12, 0, 5.0)
    write_trace(os.path.join(skew, "ktrace.5.tsv"), 12, 0, 6.0)
    A = [kr.analyse(os.path.join(skew, f), rx, 2) for f in ("ktrace.4.tsv", "ktrace.5.tsv")]
    d = kr.dp_split(A, kr.analyse(os.path.join(one, "ktrace.3.tsv"), rx, 2))
    check(abs(d["slower"] - 1.5) < 1e-9 and abs(d["wait"] - 0.5) < 1e-9
          and abs(d["rest"] + 2.0) < 1e-9 and abs(d["wall"] - d["wall1"]) < 1e-9,
          f"data-parallel split: slower +1.5, wait +0.5, rest -2.0 ms ({d})")
    e = kr.expected_max([1.0, 2.0, 3.0, 4.0], 2)
    check(abs(e - 3.125) < 1e-12, f"the mean of the larger of 2 draws from 1, 2, 3, 4: 3.125 ({e})")
    p = subprocess.run([sys.executable, TOOL, skew, "--compare", one, "--skip", "2"],
                       capture_output=True, text=True)
    check(p.returncode == 0 and "compute kernels slower +1.50 + waiting for the slowest rank's "
          "compute +0.50 + NCCL alone and idle -2.00" in p.stdout,
          f"the report prints the split (exit {p.returncode})")

    # API records (VITGRID_KTRACE_API=1) beside the kernels: the timeline ignores them, --api
    # sums them per host thread
    api = os.path.join(tmp, "api")
    os.makedirs(api)
    with open(os.path.join(dp, "ktrace.1.tsv")) as f:
        text = f.read()
    # in every step's idle gap [8.5, 10) ms: counted, they would add busy time
    for st in range(12):
        b = st * 10 * MS
        text += f"{b + 8_600_000}\t{b + 9_600_000}\t0\t4242\t0\tapi:driver cuMemFree_v2\n"
    text += f"{27_100_000}\t{27_100_500}\t0\t17\t0\tapi:runtime cudaLaunchKernel_v7000\n"
    with open(os.path.join(api, "ktrace.1.tsv"), "w") as f:
        f.write(text)
    sa = kr.summarise(kr.analyse(os.path.join(api, "ktrace.1.tsv"), rx, 2))
    check(abs(sa["wall"] - s["wall"]) < 1e-9 and abs(sa["busy"] - s["busy"]) < 1e-9,
          f"API records stay out of the GPU timeline (busy {sa['busy']} vs {s['busy']})")
    p = subprocess.run([sys.executable, TOOL, api, "--api"], capture_output=True, text=True)
    lines = [l for l in p.stdout.splitlines() if "cuMemFree_v2" in l]
    check(p.returncode == 0 and "thread 4242: 12.0 ms" in p.stdout and len(lines) == 1
          and " 12 calls " in lines[0] and "12.00 ms" in lines[0] and "longest    1.000 ms" in lines[0],
          f"--api: 12 cuMemFree calls of thread 4242, 12 ms, longest 1 ms ({p.stdout.strip()!r})")

    bad = os.path.join(tmp, "bad")
    os.makedirs(bad)
    with open(os.path.join(bad, "ktrace.9.tsv"), "w") as f:
        f.write("time,kernel\n1,2\n")
    p = subprocess.run([sys.executable, TOOL, bad], capture_output=True, text=True)
    msg = p.stdout + p.stderr
    check(p.returncode != 0 and "ktrace.9.tsv" in msg and "not a vitgrid_ktrace file" in msg
          and "Traceback" not in msg, f"a file that is not a trace: one message, exit {p.returncode}")

finish()
