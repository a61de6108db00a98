#!/usr/bin/python3
"""Writes a small ImageFolder tree of photo-like JPEGs for the image-source tests.

    make_jpeg_tree.py ROOT [--classes 3] [--train 6] [--val 2] [--seed 0] [--flat] [--bad|--no-bad]

ROOT/train/<class>/*.JPEG and ROOT/val/<class>/*.JPEG (or, with --flat, ROOT/<class>/*.JPEG
holding train + val images per class: the hold-out case). Images are smooth gradients plus
shapes plus noise (they compress like photos), of mixed sizes and aspect ratios (60..500 px
sides), quality ~90. The first train images (in class order) are: grayscale (L),
CMYK, progressive, 4:4:4 / 4:2:2 / 4:2:0 subsampling, a PNG named .JPEG, and (with --bad, the
default) a JPEG cut in half. Same arguments, same bytes.
"""
import argparse
import io
import os
import random
import sys

from PIL import Image, ImageDraw


def photo(rng, w, h):
    """A smooth gradient with shapes and a little noise, RGB."""
    import numpy as np
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    c = [rng.uniform(0, 255) for _ in range(9)]
    r = c[0] + (c[1] - c[0]) * x / max(w - 1, 1) + 30 * np.sin(y / (7 + c[2] / 20))
    g = c[3] + (c[4] - c[3]) * y / max(h - 1, 1) + 30 * np.cos(x / (9 + c[5] / 20))
    b = c[6] + (c[7] - c[6]) * (x + y) / max(w + h - 2, 1)
    img = np.stack([r, g, b], axis=-1)
    nrng = np.random.default_rng(rng.randrange(1 << 30))
    img += nrng.normal(0, 6, img.shape)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(im)
    for _ in range(rng.randint(2, 6)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        x1, y1 = x0 + rng.randint(5, max(6, w // 2)), y0 + rng.randint(5, max(6, h // 2))
        fill = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            d.ellipse([x0, y0, x1, y1], fill=fill)
        else:
            d.rectangle([x0, y0, x1, y1], fill=fill)
    return im


def encode(im, kind):
    """Encodes im as `kind`; returns bytes."""
    buf = io.BytesIO()
    if kind == "gray":
        im.convert("L").save(buf, "JPEG", quality=90)
    elif kind == "cmyk":
        im.convert("CMYK").save(buf, "JPEG", quality=90)
    elif kind == "progressive":
        im.save(buf, "JPEG", quality=90, progressive=True)
    elif kind == "444":
        im.save(buf, "JPEG", quality=90, subsampling=0)
    elif kind == "422":
        im.save(buf, "JPEG", quality=90, subsampling=1)
    elif kind == "png":
        im.save(buf, "PNG")
    else:  # "420" (Pillow's default), also the truncated file before the cut
        im.save(buf, "JPEG", quality=90, subsampling=2)
    data = buf.getvalue()
    if kind == "truncated":
        data = data[: len(data) // 2]
    return data


SPECIAL = ["gray", "cmyk", "progressive", "444", "422", "png", "truncated"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root")
    ap.add_argument("--classes", type=int, default=3)
    ap.add_argument("--train", type=int, default=6, help="train images per class")
    ap.add_argument("--val", type=int, default=2, help="val images per class")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flat", action="store_true", help="ROOT/<class>/ without train/ and val/")
    ap.add_argument("--bad", dest="bad", action="store_true", default=True,
                    help="include a truncated JPEG (default)")
    ap.add_argument("--no-bad", dest="bad", action="store_false")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    specials = [s for s in SPECIAL if a.bad or s != "truncated"]
    n = 0
    for split, count in (("train", a.train), ("val", a.val)):
        for c in range(a.classes):
            cname = "n%08d" % (1000 + 37 * c)  # WordNet-id-like names, sorted = creation order
            d = os.path.join(a.root, cname) if a.flat else os.path.join(a.root, split, cname)
            os.makedirs(d, exist_ok=True)
            for i in range(count):
                w, h = rng.randint(60, 500), rng.randint(60, 500)
                kind = "420"
                k = c * count + i  # the specials are the first train images
                if split == "train" and k < len(specials):
                    kind = specials[k]
                elif split == "val" and c == 1 and i == 0:
                    kind = "progressive"
                data = encode(photo(rng, w, h), kind)
                name = "%s_%s_%05d.JPEG" % (cname, split, i)
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
                n += 1
    print("make_jpeg_tree: %d files under %s" % (n, a.root), file=sys.stderr)


if __name__ == "__main__":
    main()
