#!/usr/bin/env python3
"""Plot a vitgrid run's metrics.h5: training loss, learning rate, eval top-1, throughput, the
slowest rank's step time and the largest rank's device memory.

    tools/plot_metrics.py RUN_DIR/metrics.h5 [more metrics.h5 ...] [-o curves.png]

Several files are overlaid (e.g. a scaling study). A run continued on another layout is one
curve; dotted lines mark where each later segment (layout) began. Needs h5py and matplotlib
(Debian: python3-h5py python3-matplotlib)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool_deps  # noqa: E402
# third-party modules: checked after argument parsing (tool_deps.require), so --help needs none
try:
    import h5py
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    pass


def text(v):
    return v.decode() if isinstance(v, bytes) else str(v)


def layouts(f):
    """(first step, "pP dD tT mode") of each segment; the root attributes for a file without
    /segments."""
    if "segments" in f:
        g = f["segments"]
        return [(int(s), "p{} d{} t{} {}".format(*(int(x) for x in grid), text(mode)))
                for s, grid, mode in zip(g["first_step"][()], g["grid"][()], g["tensor_mode"][()])]
    grid = tuple(int(x) for x in f.attrs.get("grid", (1, 1, 1)))
    return [(1, f"p{grid[0]} d{grid[1]} t{grid[2]} {text(f.attrs.get('tensor_mode', 'none'))}")]


def slowest(table):
    """Per step, the largest value over the ranks; NaN columns (ranks a segment did not have)
    are ignored."""
    t = table[()]
    if t.ndim == 1:
        return t
    out = np.full(t.shape[0], np.nan)
    has = ~np.all(np.isnan(t), axis=1)
    out[has] = np.nanmax(t[has], axis=1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("-o", "--output", default="metrics.png")
    a = ap.parse_args()
    tool_deps.require("plot_metrics", "h5py", "numpy", "matplotlib")
    fig, ax = plt.subplots(2, 3, figsize=(15, 7))
    for path in a.files:
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            sys.exit(f"plot_metrics: cannot read {path}: {e}")
        with f:
            if "train" not in f:
                sys.exit(f"plot_metrics: {path} is not a vitgrid metrics file (no /train)")
            segs = layouts(f)
            run = os.path.basename(os.path.dirname(os.path.abspath(path)))
            lab = f"{run} " + " -> ".join(name for _, name in segs)
            s = f["/train/step"][()]
            lines = [
                ax[0, 0].plot(s, f["/train/loss"][()], label=lab),
                ax[0, 1].plot(s, f["/train/lr"][()], label=lab),
                ax[1, 0].plot(s, f["/train/images_per_s"][()], label=lab),
                ax[1, 1].plot(s, 1e3 * slowest(f["/train/step_time_s"]), label=lab),
                ax[1, 2].plot(s, slowest(f["/train/device_mem_bytes"]) / 2**30, label=lab),
            ]
            if "eval" in f and len(f["/eval/step"]) > 0:
                ax[0, 2].plot(f["/eval/step"][()], 100 * f["/eval/top1"][()], "o-", label=lab)
            colour = lines[0][0].get_color()
            for first, _ in segs[1:]:
                for a_ in ax.flat:
                    a_.axvline(first - 0.5, color=colour, linestyle=":", linewidth=1)
    titles = ["train loss", "learning rate", "eval top-1 (%)", "images / s",
              "step time (ms), slowest rank", "device memory (GiB), largest rank"]
    for a_, t in zip(ax.flat, titles):
        a_.set_title(t)
        a_.set_xlabel("step")
        a_.grid(alpha=0.3)
    ax[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.output, dpi=120)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
