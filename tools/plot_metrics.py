#!/usr/bin/env python3
"""Plot a vitgrid run's metrics.h5: training loss, learning rate, throughput and eval top-1.

    tools/plot_metrics.py RUN_DIR/metrics.h5 [more metrics.h5 ...] [-o curves.png]

Several files are overlaid (e.g. a scaling study). Needs h5py and matplotlib
(Debian: python3-h5py python3-matplotlib)."""
import argparse
import os
import sys

import h5py
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label_of(path, f):
    grid = tuple(int(x) for x in f.attrs.get("grid", (1, 1, 1)))
    mode = f.attrs.get("tensor_mode", "none")
    if isinstance(mode, bytes):
        mode = mode.decode()
    run = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return f"{run} p{grid[0]} d{grid[1]} t{grid[2]} {mode}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("-o", "--output", default="metrics.png")
    a = ap.parse_args()
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    for path in a.files:
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            sys.exit(f"plot_metrics: cannot read {path}: {e}")
        with f:
            if "train" not in f:
                sys.exit(f"plot_metrics: {path} is not a vitgrid metrics file (no /train)")
            lab = label_of(path, f)
            s = f["/train/step"][()]
            ax[0, 0].plot(s, f["/train/loss"][()], label=lab)
            ax[0, 1].plot(s, f["/train/lr"][()], label=lab)
            ax[1, 0].plot(s, f["/train/images_per_s"][()], label=lab)
            if "eval" in f and len(f["/eval/step"]) > 0:
                ax[1, 1].plot(f["/eval/step"][()], 100 * f["/eval/top1"][()], "o-", label=lab)
    for a_, t in zip(ax.flat, ["train loss", "learning rate", "images / s", "eval top-1 (%)"]):
        a_.set_title(t)
        a_.set_xlabel("step")
        a_.grid(alpha=0.3)
    ax[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.output, dpi=120)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
