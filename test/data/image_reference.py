#!/usr/bin/python3
"""Reference outputs for test_image_decode.cpp, from Pillow (9.4) and torchvision (0.14).

usage: image_reference.py DIR

Writes small images of every kind the CPU decoder handles into DIR, Pillow's and torchvision's
results as raw uint8 HWC RGB files, and DIR/manifest.txt, one case per line:
  image NAME FILE W H COMPONENTS PROGRESSIVE SUB_H SUB_V     the file and its header facts
  decode NAME REF W H                       Image.open(FILE).convert('RGB')
  bad FILE                                  must be refused (truncated / not an image)
  resize NAME INTERP W H X0 Y0 X1 Y1 FLIP REF   img.resize((W, H), INTERP, box=...) (+ mirror)
  crop NAME INTERP S TOP LEFT H W FLIP REF  F.resized_crop(img, TOP, LEFT, H, W, [S, S], INTERP)
  eval NAME INTERP S CROP_PCT REF           Resize(floor(S / CROP_PCT)) + CenterCrop(S)
  rrc W H N FILE                            N RandomResizedCrop.get_params (i, j, h, w) int32
  bench FILE                                a ~400x350 q90 photo-like JPEG for the timing
INTERP is 0 bilinear, 1 bicubic (vitgrid::Interp).
"""
import math
import os
import sys

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F
from PIL import Image, ImageOps

PIL_INTERP = {0: Image.BILINEAR, 1: Image.BICUBIC}
TV_INTERP = {0: T.InterpolationMode.BILINEAR, 1: T.InterpolationMode.BICUBIC}


def photo(w, h, rng):
    """Smooth colour fields at several scales, a few hard edges and sensor-like noise."""
    img = np.zeros((h, w, 3))
    for scale, weight in ((3, 0.25), (12, 0.35), (48, 0.4)):
        g = (rng.random((h // scale + 2, w // scale + 2, 3)) * 255).astype(np.uint8)
        img += weight * np.asarray(Image.fromarray(g).resize((w, h), Image.BICUBIC), float)
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(4):
        cx, cy, r = rng.random() * w, rng.random() * h, rng.random() * min(w, h) / 3
        mask = (xx - cx) ** 2 + (yy - cy) ** 2 < r * r
        img[mask] = img[mask] * 0.4 + rng.random(3) * 255 * 0.6
    img += rng.normal(0, 6, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def main():
    out = sys.argv[1]
    rng = np.random.default_rng(2024)
    lines = []

    def raw(name, im):
        path = os.path.join(out, name)
        arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
        arr.tofile(path)
        return path, arr.shape[1], arr.shape[0]

    # --- the images: (name, file, Pillow image as the decoder should see it, comps, prog, sub)
    images = {}

    def add(name, filename, save, comps, prog, sub):
        path = os.path.join(out, filename)
        save(path)
        with Image.open(path) as im:
            im.load()
            rgb = im.convert("RGB")
        images[name] = (path, rgb)
        lines.append(f"image {name} {path} {rgb.width} {rgb.height} {comps} {int(prog)} "
                     f"{sub[0]} {sub[1]}")
        ref, w, h = raw(name + ".ref", rgb)
        lines.append(f"decode {name} {ref} {w} {h}")

    p = photo(237, 181, rng)
    add("j444", "j444.jpg", lambda f: p.save(f, quality=90, subsampling=0), 3, False, (1, 1))
    p = photo(300, 203, rng)
    add("j422", "j422.jpg", lambda f: p.save(f, quality=85, subsampling=1), 3, False, (2, 1))
    p = photo(413, 347, rng)
    add("j420", "j420.jpg", lambda f: p.save(f, quality=90, subsampling=2), 3, False, (2, 2))
    p = photo(251, 199, rng).convert("L")
    add("gray", "gray.jpg", lambda f: p.save(f, quality=90), 1, False, (0, 0))
    p = photo(160, 121, rng).convert("CMYK")
    add("cmyk", "cmyk.jpg", lambda f: p.save(f, quality=90), 4, False, (0, 0))
    p = photo(333, 250, rng)
    add("prog", "prog.jpg", lambda f: p.save(f, quality=88, subsampling=2, progressive=True),
        3, True, (2, 2))
    p = photo(1400, 1100, rng)
    add("large", "large.jpg", lambda f: p.save(f, quality=90, subsampling=2), 3, False, (2, 2))
    p = photo(123, 97, rng).convert("RGBA")
    a = np.asarray(p).copy()
    a[..., 3] = (np.arange(123)[None, :] * 2) % 256
    p = Image.fromarray(a, "RGBA")
    add("png_rgba", "rgba.png", lambda f: p.save(f), 4, False, (0, 0))
    p = photo(90, 70, rng).convert("P", palette=Image.ADAPTIVE, colors=64)
    add("png_pal", "pal.png", lambda f: p.save(f, transparency=3), 3, False, (0, 0))
    p = photo(77, 64, rng).convert("LA")
    add("png_la", "la.png", lambda f: p.save(f), 2, False, (0, 0))

    # --- refused files
    data = open(images["j420"][0], "rb").read()
    for frac in (0.3, 0.6, 0.97):
        path = os.path.join(out, f"trunc{int(frac * 100)}.jpg")
        open(path, "wb").write(data[: int(len(data) * frac)])
        lines.append(f"bad {path}")
    data = open(images["prog"][0], "rb").read()
    path = os.path.join(out, "trunc_prog.jpg")
    open(path, "wb").write(data[: int(len(data) * 0.7)])
    lines.append(f"bad {path}")
    data = open(images["png_rgba"][0], "rb").read()
    path = os.path.join(out, "trunc.png")
    open(path, "wb").write(data[: int(len(data) * 0.6)])
    lines.append(f"bad {path}")
    path = os.path.join(out, "garbage.bin")
    open(path, "wb").write(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    lines.append(f"bad {path}")
    path = os.path.join(out, "garbage.jpg")  # a JPEG signature, then noise
    open(path, "wb").write(b"\xff\xd8\xff\xe0" + rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    lines.append(f"bad {path}")

    # --- resize with a box (Pillow), on the reference RGB of three images
    n = 0
    for name in ("j420", "j444", "gray"):
        img = images[name][1]
        W, H = img.size
        for k in range(16):
            interp = k % 2
            flip = (k // 2) % 2
            ow, oh = int(rng.integers(5, 300)), int(rng.integers(5, 300))
            if k % 4 == 3:  # integer boxes
                x0, y0 = int(rng.integers(0, W // 2)), int(rng.integers(0, H // 2))
                x1, y1 = int(rng.integers(x0 + 1, W + 1)), int(rng.integers(y0 + 1, H + 1))
            else:
                x0, y0 = rng.random() * W * 0.5, rng.random() * H * 0.5
                x1, y1 = x0 + 1 + rng.random() * (W - x0 - 1), y0 + 1 + rng.random() * (H - y0 - 1)
            if k == 0:
                x0, y0, x1, y1, ow = 0, 0, W, H, W  # no horizontal pass
            if k == 5:
                x0, y0, x1, y1, oh = 0, 0, W, H, H  # no vertical pass
            r = img.resize((ow, oh), PIL_INTERP[interp], box=(x0, y0, x1, y1))
            if flip:
                r = ImageOps.mirror(r)
            ref, _, _ = raw(f"resize{n}.ref", r)
            lines.append(f"resize {name} {interp} {ow} {oh} {x0!r} {y0!r} {x1!r} {y1!r} {flip} {ref}")
            n += 1

    # --- torchvision's resized_crop (RandomResizedCrop's PIL path)
    n = 0
    for name in ("j420", "j444", "j422", "gray", "cmyk", "prog", "png_rgba", "png_pal", "large"):
        img = images[name][1]
        W, H = img.size
        for k in range(6):
            interp = k % 2
            flip = (k // 2) % 2
            S = int((224, 96, 160)[k % 3])
            h = int(rng.integers(8, H + 1))
            w = int(rng.integers(8, W + 1))
            if k == 5:
                h, w = H, W
            top, left = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
            r = F.resized_crop(img, top, left, h, w, [S, S], TV_INTERP[interp])
            if flip:
                r = F.hflip(r)
            ref, _, _ = raw(f"crop{n}.ref", r)
            lines.append(f"crop {name} {interp} {S} {top} {left} {h} {w} {flip} {ref}")
            n += 1

    # --- timm's eval transform
    n = 0
    for name in ("j420", "j444", "j422", "gray", "prog", "large", "cmyk"):
        img = images[name][1]
        for S, crop_pct, interp in ((224, 0.875, 1), (96, 0.9, 0), (160, 0.95, 1), (64, 1.0, 1)):
            t = T.Compose([T.Resize(math.floor(S / crop_pct), interpolation=TV_INTERP[interp]),
                           T.CenterCrop(S)])
            ref, _, _ = raw(f"eval{n}.ref", t(img))
            lines.append(f"eval {name} {interp} {S} {crop_pct!r} {ref}")
            n += 1

    # --- RandomResizedCrop.get_params samples
    torch.manual_seed(1234)
    for W, H in ((500, 500), (600, 200), (300, 420)):
        dummy = Image.new("RGB", (W, H))
        N = 20000
        s = np.array([T.RandomResizedCrop.get_params(dummy, [0.08, 1.0], [3 / 4, 4 / 3])
                      for _ in range(N)], dtype=np.int32)
        path = os.path.join(out, f"rrc_{W}x{H}.i32")
        s.tofile(path)
        lines.append(f"rrc {W} {H} {N} {path}")

    # --- timing inputs
    for k in range(8):
        w, h = 400 + int(rng.integers(-40, 41)), 350 + int(rng.integers(-40, 41))
        path = os.path.join(out, f"bench{k}.jpg")
        photo(w, h, rng).save(path, quality=90)
        lines.append(f"bench {path}")

    with open(os.path.join(out, "manifest.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
