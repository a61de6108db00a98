#!/usr/bin/env python3
"""A run's training rate from its metrics.h5: the median of /train/images_per_s after the first
steps (start-up, first batches, graph capture), the replaced images, and optionally the wall
time that rate projects for a number of epochs of a dataset.

    tools/run_rate.py RUN_DIR/metrics.h5 [--skip N] [--label TEXT] [--epochs E --images N]

Prints one line: "train | LABEL | median R img/s over steps A-B | replaced K | input wait W ms[ |
E epochs of N images: H h]" (W: the median over the steps of the longest wait of a rank's
training thread for its input). Needs h5py and numpy (Debian: python3-h5py python3-numpy)."""
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("metrics", help="a run's metrics.h5")
    ap.add_argument("--skip", type=int, default=10, help="leading steps left out (default 10)")
    ap.add_argument("--label", default="", help="the line's label (default: the file name)")
    ap.add_argument("--epochs", type=float, default=0, help="project the wall time of E epochs")
    ap.add_argument("--images", type=int, default=0, help="... of a dataset of N images")
    a = ap.parse_args()
    tool_deps.require("run_rate", "h5py", "numpy")
    if (a.epochs > 0) != (a.images > 0):
        sys.exit("run_rate.py: --epochs and --images go together")
    try:
        with h5py.File(a.metrics, "r") as f:
            ips = np.asarray(f["/train/images_per_s"], dtype=np.float64)
            bad = np.asarray(f["/train/bad_images"]) if "/train/bad_images" in f else np.zeros((1, 1))
            wait = np.asarray(f["/train/input_wait_s"]) if "/train/input_wait_s" in f else None
    except (OSError, KeyError) as e:
        sys.exit(f"run_rate.py: {a.metrics}: {e}")
    if len(ips) <= a.skip:
        sys.exit(f"run_rate.py: {a.metrics}: {len(ips)} steps, none after the first {a.skip}")
    rate = float(np.median(ips[a.skip:]))
    line = (f"train | {a.label or a.metrics} | median {rate:.0f} img/s over steps "
            f"{a.skip + 1}-{len(ips)} | replaced {int(np.nansum(bad[-1]))}")
    if wait is not None:  # the slowest rank's wait, per step: its median
        line += f" | input wait {1e3 * float(np.median(np.nanmax(wait[a.skip:], axis=1))):.1f} ms"
    if a.epochs > 0:
        line += f" | {a.epochs:g} epochs of {a.images} images: {a.epochs * a.images / rate / 3600:.2f} h"
    print(line)


if __name__ == "__main__":
    main()
