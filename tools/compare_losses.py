#!/usr/bin/env python3
"""Two runs' training-loss curves side by side (e.g. precision.mode = fp8 against bf16 on the
same deck and seed): the relative difference of run B's loss from run A's at every step both
recorded, its maximum and mean, and the difference of the means of the last K steps.

    tools/compare_losses.py RUN_A RUN_B [--last K]     (RUN_*: run directories or metrics.h5)

Prints one line: "losses | A -> B | N steps | first a0 b0 | last a1 b1 | relative difference max
X (step S) mean Y | last K steps' means differ by Z". Needs h5py and numpy (Debian:
python3-h5py python3-numpy)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool_deps  # noqa: E402
try:
    import h5py
    import numpy as np
except ImportError:
    pass


def curve(path):
    f = os.path.join(path, "metrics.h5") if os.path.isdir(path) else path
    try:
        with h5py.File(f, "r") as h:
            return np.asarray(h["/train/step"]), np.asarray(h["/train/loss"], dtype=np.float64)
    except (OSError, KeyError) as e:
        sys.exit(f"compare_losses.py: {f}: no training losses ({e})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("a", help="the reference run (directory or metrics.h5)")
    ap.add_argument("b", help="the run compared with it")
    ap.add_argument("--last", type=int, default=50, help="steps whose mean losses are compared (50)")
    a = ap.parse_args()
    tool_deps.require("compare_losses", "h5py", "numpy")
    sa, la = curve(a.a)
    sb, lb = curve(a.b)
    common, ia, ib = np.intersect1d(sa, sb, return_indices=True)
    if len(common) == 0:
        sys.exit("compare_losses.py: the runs share no step")
    x, y = la[ia], lb[ib]
    d = np.abs(y - x) / np.maximum(np.abs(x), 1e-12)
    k = min(a.last, len(common))
    tail = abs(float(np.mean(y[-k:]) - np.mean(x[-k:]))) / max(abs(float(np.mean(x[-k:]))), 1e-12)
    print(f"losses | {a.a} -> {a.b} | {len(common)} steps | first {x[0]:.4f} {y[0]:.4f} | "
          f"last {x[-1]:.4f} {y[-1]:.4f} | relative difference max {d.max():.3e} "
          f"(step {int(common[int(np.argmax(d))])}) mean {d.mean():.3e} | last {k} steps' means "
          f"differ by {tail:.3e}", flush=True)


if __name__ == "__main__":
    main()
