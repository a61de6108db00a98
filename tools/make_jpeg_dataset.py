#!/usr/bin/env python3
"""An ImageNet-like set of photo-like JPEGs for measuring input pipelines where ImageNet itself
cannot be fetched: an ImageFolder tree ROOT/train/<class>/*.JPEG and ROOT/val/<class>/*.JPEG.

    python3 tools/make_jpeg_dataset.py ROOT [--train 20000] [--val 2000] [--classes 100]
                                            [--quality 90] [--workers N] [--seed 0]

Sizes follow ImageNet's distribution (short side mostly 333-375 px, aspect 4:3 or 3:4, some
squares, a tail of larger and smaller images; mean near 400 x 350 px). Each image is built
from a real photograph when scikit-image is installed (skimage.data's photographs, cropped,
rescaled, recoloured and mirrored at random, plus sensor-like noise), otherwise from smooth
gradients, shapes and noise; both compress like photos at quality 90 (~30-60 KiB). 4:2:0
baseline JPEGs, as most of ImageNet. Same arguments, same bytes. Needs Pillow and numpy."""
import argparse
import io
import multiprocessing as mp
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool_deps  # noqa: E402
# third-party modules: checked after argument parsing (tool_deps.require), so --help needs none
try:
    import numpy as np
    from PIL import Image, ImageDraw
except ImportError:
    pass

_PHOTOS = None


def photos():
    global _PHOTOS
    if _PHOTOS is None:
        _PHOTOS = []
        try:
            from skimage import data as sk
            for name in ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry",
                         "colorwheel", "hubble_deep_field", "retina", "motorcycle_left"):
                try:
                    im = getattr(sk, name)()
                    if im.ndim == 3 and im.shape[2] >= 3:
                        _PHOTOS.append(Image.fromarray(np.ascontiguousarray(im[..., :3])))
                except Exception:  # a photograph missing from this skimage install
                    pass
        except ImportError:
            pass
    return _PHOTOS


def size(rng):
    r = rng.random()
    if r < 0.80:  # the typical ImageNet photograph: 500 x 375 or 375 x 500 and nearby
        short = rng.randint(300, 375)
        long_ = int(short * rng.choice([4 / 3, 4 / 3, 4 / 3, 1.5, 1.25]))
    elif r < 0.92:
        short = long_ = rng.randint(250, 500)
    elif r < 0.97:
        short, long_ = rng.randint(400, 800), rng.randint(600, 1200)
    else:
        short, long_ = rng.randint(80, 200), rng.randint(100, 300)
    return (long_, short) if rng.random() < 0.7 else (short, long_)


def synth(rng, w, h):
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    c = [rng.uniform(0, 255) for _ in range(9)]
    img = np.stack([c[0] + (c[1] - c[0]) * x / w + 30 * np.sin(y / (7 + c[2] / 20)),
                    c[3] + (c[4] - c[3]) * y / h + 30 * np.cos(x / (9 + c[5] / 20)),
                    c[6] + (c[7] - c[6]) * (x + y) / (w + h)], axis=-1)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(im)
    for _ in range(rng.randint(4, 12)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        box = [x0, y0, x0 + rng.randint(5, w // 2), y0 + rng.randint(5, h // 2)]
        fill = tuple(rng.randrange(256) for _ in range(3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)(box, fill=fill)
    return im


def one(args):
    path, seed, quality = args
    rng = random.Random(seed)
    w, h = size(rng)
    ph = photos()
    if ph:
        src = ph[rng.randrange(len(ph))]
        cw = rng.randint(src.width // 3, src.width)
        ch = max(16, min(src.height, int(cw * h / w)))
        x0, y0 = rng.randint(0, src.width - cw), rng.randint(0, src.height - ch)
        im = src.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.BICUBIC)
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        a = np.asarray(im, dtype=np.float32)
        a = a * np.array([rng.uniform(0.7, 1.3) for _ in range(3)], np.float32)
    else:
        a = np.asarray(synth(rng, w, h), dtype=np.float32)
    a += np.random.default_rng(seed).normal(0, 4, a.shape)
    im = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return len(buf.getvalue()), w, h


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root")
    ap.add_argument("--train", type=int, default=20000)
    ap.add_argument("--val", type=int, default=2000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    tool_deps.require("make_jpeg_dataset", "numpy", "PIL")
    jobs = []
    for split, n in (("train", a.train), ("val", a.val)):
        for i in range(n):
            c = i % a.classes
            d = os.path.join(a.root, split, "n%08d" % (1440764 + 1000 * c))
            os.makedirs(d, exist_ok=True)
            jobs.append((os.path.join(d, "%s_%07d.JPEG" % (split, i)),
                         a.seed * 100003 + i + (0 if split == "train" else 10 ** 7), a.quality))
    with mp.Pool(a.workers) as pool:
        stats = pool.map(one, jobs, chunksize=64)
    b = np.array([s[0] for s in stats], np.float64)
    w = np.array([s[1] for s in stats], np.float64)
    h = np.array([s[2] for s in stats], np.float64)
    print(f"make_jpeg_dataset: {len(stats)} JPEGs in {a.root}: mean {w.mean():.0f} x {h.mean():.0f} px, "
          f"mean {b.mean() / 1024:.1f} KiB, quality {a.quality}"
          + ("" if photos() else " (no scikit-image: synthetic photographs)"), file=sys.stderr)


if __name__ == "__main__":
    main()
