#!/usr/bin/python3
"""Pillow's side of vitgrid_dataset pack --short-side: a copy of an image tree in which every
image whose shorter side exceeds N is what torchvision's Resize(N) (bicubic) on the PIL image
then Image.save(quality=Q) makes of it; the others, and files Pillow cannot decode, copied.

    short_side_reference.py SRC DST N Q

Prints one line per file: "resized W H PATH", "kept PATH" or "bad PATH"."""
import io
import os
import shutil
import sys

from PIL import Image


def main():
    src, dst, n, q = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    for root, _, files in sorted(os.walk(src)):
        for name in sorted(files):
            p = os.path.join(root, name)
            out = os.path.join(dst, os.path.relpath(p, src))
            os.makedirs(os.path.dirname(out), exist_ok=True)
            try:
                im = Image.open(p)
                im.load()
                im = im.convert("RGB")
            except Exception:  # noqa: BLE001 (any failure: the file is copied)
                shutil.copyfile(p, out)
                print("bad", p)
                continue
            w, h = im.size
            s, l = min(w, h), max(w, h)
            if s <= n:
                shutil.copyfile(p, out)
                print("kept", p)
                continue
            nl = int(n * l / s)  # torchvision's Resize(n): the longer side truncated
            size = (n, nl) if w <= h else (nl, n)
            buf = io.BytesIO()
            im.resize(size, Image.BICUBIC).save(buf, "JPEG", quality=q)
            with open(out, "wb") as f:
                f.write(buf.getvalue())
            print("resized", size[0], size[1], p)


if __name__ == "__main__":
    main()
