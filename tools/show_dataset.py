#!/usr/bin/env python3
"""Show a packed HDF5 image file (what tools/vitgrid_dataset writes and data.dataset = hdf5
reads): prints its shape, class counts and attributes, and writes a contact sheet with one row
per class (PNG with Pillow, otherwise binary PPM).

    show_dataset.py FILE.h5 [--out sheet.png] [--per-class 8] [--classes 10] [--scale 2]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool_deps  # noqa: E402
# third-party modules: checked after argument parsing (tool_deps.require), so --help needs none
try:
    import h5py
    import numpy as np
except ImportError:
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--out", default=None, help="contact sheet path (.png or .ppm)")
    ap.add_argument("--per-class", type=int, default=8)
    ap.add_argument("--classes", type=int, default=10, help="rows: the first N classes")
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--scan", type=int, default=4096, help="samples scanned to fill the sheet")
    a = ap.parse_args()
    tool_deps.require("show_dataset", "h5py", "numpy")

    with h5py.File(a.file, "r") as f:
        if "images" not in f or "labels" not in f:
            sys.exit(f"{a.file}: not a packed image file (needs /images and /labels)")
        images, labels = f["images"], f["labels"][:]
        n, s = images.shape[0], images.shape[1]
        k = int(f.attrs.get("num_classes", labels.max() + 1))
        counts = np.bincount(labels, minlength=k)
        print(f"{a.file}: {n} images {s}x{s}x{images.shape[3]} {images.dtype}, {k} classes, "
              f"chunks {images.chunks}")
        for key, v in f.attrs.items():
            print(f"  attr {key} = {v.decode() if isinstance(v, bytes) else v}")
        print(f"  class counts: min {counts.min()} max {counts.max()} "
              f"(first: {' '.join(map(str, counts[:10]))})")
        if not a.out:
            return
        m = min(n, a.scan)
        x, y = images[:m], labels[:m]

    pad = lambda im: np.pad(im, ((1, 1), (1, 1), (0, 0)))
    blank = np.zeros((s + 2, s + 2, 3), np.uint8)
    rows = []
    for c in range(min(a.classes, k)):
        ims = [pad(im) for im in x[y == c][: a.per_class]]
        ims += [blank] * (a.per_class - len(ims))
        rows.append(np.concatenate(ims, 1))
    sheet = np.kron(np.concatenate(rows, 0), np.ones((a.scale, a.scale, 1), np.uint8))
    try:
        from PIL import Image

        Image.fromarray(sheet).save(a.out)
    except ImportError:
        with open(a.out, "wb") as o:
            o.write(b"P6 %d %d 255\n" % (sheet.shape[1], sheet.shape[0]))
            o.write(sheet.tobytes())
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
