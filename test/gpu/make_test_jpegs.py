#!/usr/bin/env python3
"""JPEGs for test_gpu_jpeg.cpp, with Pillow's crop/resize of each as the reference.

  make_test_jpegs.py test DIR      mixed sizes and subsamplings, grayscale, CMYK, progressive,
                                   truncated; DIR/manifest.txt lists one job per line:
                                   file x0 y0 x1 y1 mode flip interp S ref expect
                                   (ref: raw S*S*3 RGB of Pillow's result, '-' when refused;
                                   expect: ok | refuse; mode: data/image_transform.h BoxMode
                                   0 Pillow box, 1 crop then resize, 2 resize then crop);
                                   DIR/resize.txt lists raw random images
                                   with Pillow resizes of them (the kernels alone, exact).
  make_test_jpegs.py bench DIR N   N photo-like JPEGs of about 400x350, q90, 4:2:0 (ImageNet-like)
  make_test_jpegs.py torchvision DIR B   torchvision's batched GPU decode of DIR's JPEGs (img/s)

Photo-like: smooth gradients, a few shapes, mild noise (a JPEG of pure noise is unlike photos
in size and decode cost).
"""
import io
import os
import random
import sys

import numpy as np
from PIL import Image, ImageDraw

R = getattr(Image, "Resampling", Image)
FILTERS = [R.BILINEAR, R.BICUBIC]


def photo(rng, w, h):
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        a, b, p = rng.uniform(-1, 1), rng.uniform(-1, 1), rng.uniform(0, 6.28)
        img[..., c] = 128 + 90 * np.sin(a * x / 40 + b * y / 55 + p)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(im)
    for _ in range(rng.integers(3, 9)):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(5, max(6, w // 2))), y0 + int(rng.integers(5, max(6, h // 2)))
        col = tuple(int(v) for v in rng.integers(0, 256, 3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)([x0, y0, x1, y1], fill=col)
    a = np.asarray(im).astype(np.float32) + rng.normal(0, 6, (h, w, 3))
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def jpeg_bytes(im, **kw):
    b = io.BytesIO()
    im.save(b, "JPEG", **kw)
    return b.getvalue()


def rrc_box(rnd, W, H):
    import math
    for _ in range(10):
        area = W * H * rnd.uniform(0.08, 1.0)
        ar = math.exp(rnd.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = int(round(math.sqrt(area * ar))), int(round(math.sqrt(area / ar)))
        if 0 < w <= W and 0 < h <= H:
            i, j = rnd.randint(0, H - h), rnd.randint(0, W - w)
            return (j, i, j + w, i + h)
    return (0, 0, W, H)


def eval_box(W, H, S, crop_pct=0.875):
    """timm's Resize(floor(S / crop_pct)) + CenterCrop(S) as a ResizeThenCrop box."""
    import math
    size = int(math.floor(S / crop_pct))
    if W <= H:
        rw, rh = size, int(size * H / W)
    else:
        rh, rw = size, int(size * W / H)
    left, top = int(round((rw - S) / 2.0)), int(round((rh - S) / 2.0))
    return (left * W / rw, top * H / rh, (left + S) * W / rw, (top + S) * H / rh), (rw, rh, left, top)


def transform(im, box, mode, flip, interp, S, eval_geom=None):
    if mode == 1:
        out = im.crop(tuple(int(round(v)) for v in box)).resize((S, S), FILTERS[interp])
    elif mode == 2:
        rw, rh, left, top = eval_geom
        out = im.resize((rw, rh), FILTERS[interp]).crop((left, top, left + S, top + S))
    else:
        out = im.resize((S, S), FILTERS[interp], box=box)
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return out.tobytes()


def reference(data, box, mode, flip, interp, S, eval_geom=None):
    return transform(Image.open(io.BytesIO(data)).convert("RGB"), box, mode, flip, interp, S, eval_geom)


def make_test(d):
    rng = np.random.default_rng(7)
    rnd = random.Random(7)
    os.makedirs(d, exist_ok=True)
    files = []  # (name, bytes, expect)
    sizes = [(400, 350), (500, 375), (333, 500), (401, 299), (64, 48), (1200, 900), (17, 233)]
    for k, (w, h) in enumerate(sizes):
        for sub, tag in [(2, "420"), (1, "422"), (0, "444")]:
            files.append((f"c{k}_{tag}.jpg", jpeg_bytes(photo(rng, w, h), quality=90, subsampling=sub), "ok"))
    files.append(("gray.jpg", jpeg_bytes(photo(rng, 320, 240).convert("L"), quality=90), "ok"))
    files.append(("gray_odd.jpg", jpeg_bytes(photo(rng, 211, 157).convert("L"), quality=75), "ok"))
    files.append(("cmyk.jpg", jpeg_bytes(photo(rng, 300, 200).convert("CMYK"), quality=90), "refuse"))
    files.append(("progressive.jpg", jpeg_bytes(photo(rng, 400, 300), quality=90, progressive=True), "refuse"))
    whole = jpeg_bytes(photo(rng, 400, 300), quality=90)
    files.append(("truncated.jpg", whole[: len(whole) * 6 // 10], "refuse"))
    lines = []
    for name, data, expect in files:
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
        W, H = Image.open(io.BytesIO(data)).size
        for v in range(4):
            S = 224 if v < 2 else 96
            interp = v % 2
            flip = rnd.randint(0, 1)
            geom = None
            if v == 1:  # Pillow's resize(box=...), fractional box
                x0, y0 = rnd.uniform(0, W * 0.2), rnd.uniform(0, H * 0.2)
                box, mode = (x0, y0, rnd.uniform(max(x0 + 1, W * 0.7), W), rnd.uniform(max(y0 + 1, H * 0.7), H)), 0
            elif v == 3 and min(W, H) >= 110:  # timm's eval transform
                (box, geom), mode, flip = eval_box(W, H, S), 2, 0
            else:
                box, mode = rrc_box(rnd, W, H), 1
            ref = "-"
            if expect == "ok":
                ref = f"{name}.{v}.rgb"
                with open(os.path.join(d, ref), "wb") as f:
                    f.write(reference(data, box, mode, flip, interp, S, geom))
            lines.append(f"{name} {box[0]!r} {box[1]!r} {box[2]!r} {box[3]!r} {mode} {flip} {interp} {S} {ref} {expect}")
    with open(os.path.join(d, "manifest.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    # the resize kernels alone: raw random images, Pillow's resize of each (must match exactly)
    lines = []
    for k in range(24):
        W, H = rnd.randint(1, 640), rnd.randint(1, 480)
        img = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        S, interp, flip = rnd.choice([224, 31, 96]), rnd.randint(0, 1), rnd.randint(0, 1)
        geom = None
        if k % 3 == 1:
            box, mode = rrc_box(rnd, W, H), 1
        elif k % 3 == 2 and min(W, H) >= S // 0.875 + 1:
            (box, geom), mode = eval_box(W, H, S), 2
        else:
            x0, y0 = rnd.uniform(0, W - 0.5), rnd.uniform(0, H - 0.5)
            box, mode = (x0, y0, rnd.uniform(x0 + 0.25, W), rnd.uniform(y0 + 0.25, H)), 0
        out = transform(Image.fromarray(img), box, mode, flip, interp, S, geom)
        with open(os.path.join(d, f"raw{k}.rgb"), "wb") as f:
            f.write(img.tobytes())
        with open(os.path.join(d, f"raw{k}.ref"), "wb") as f:
            f.write(out)
        lines.append(f"raw{k}.rgb {W} {H} {box[0]!r} {box[1]!r} {box[2]!r} {box[3]!r} {mode} {flip} {interp} {S} raw{k}.ref")
    with open(os.path.join(d, "resize.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def bench_one(args):
    d, k = args
    rng = np.random.default_rng(11 + k)
    w, h = int(rng.integers(350, 501)), int(rng.integers(300, 401))
    if rng.random() < 0.5:
        w, h = max(w, h), min(w, h)
    with open(os.path.join(d, f"b{k:05d}.jpg"), "wb") as f:
        f.write(jpeg_bytes(photo(rng, w, h), quality=90))


def make_bench(d, n):
    import multiprocessing
    os.makedirs(d, exist_ok=True)
    with multiprocessing.Pool() as p:
        p.map(bench_one, [(d, k) for k in range(n)], chunksize=16)


def bench_torchvision(d, batch):
    """torchvision.io.decode_jpeg(list, device='cuda') on the same files: the comparison for
    GpuJpeg.Throughput (decode only, no crop/resize)."""
    import time
    import torch
    import torchvision
    from torchvision.io import decode_jpeg
    files = sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".jpg"))
    data = [torchvision.io.read_file(f) for f in files]
    batches = [data[i:i + batch] for i in range(0, len(data) - batch + 1, batch)]
    for b in batches[:2]:
        decode_jpeg(b, device="cuda")
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    for rep in range(3):
        for b in batches:
            decode_jpeg(b, device="cuda")
            n += len(b)
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    print(f"torchvision {torchvision.__version__} decode_jpeg(device='cuda'), batch {batch}: "
          f"{n / s:.0f} img/s ({len(files)} files)")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "test":
        make_test(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "torchvision":
        bench_torchvision(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "bench":
        make_bench(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)
