#!/usr/bin/env python3
"""The peers' numbers for the input pipeline alone, on the same ImageFolder tree as
`bench_loader --decode=host|device`: train images per second delivered ready for the model
(RandomResizedCrop(224) + horizontal flip + normalise).

    python3 tools/bench_input_peers.py ROOT/train [--batch 256] [--workers 16] [--batches 40]

  dataloader   torchvision's ImageFolder + DataLoader, Pillow decoding, `workers` processes
               (the usual PyTorch recipe), pinned, to the GPU
  gpu_decode   torchvision.io.decode_jpeg(device='cuda') on batches of file bytes (read by
               `workers` threads), then a per-image RandomResizedCrop + flip on the GPU and
               normalise (torchvision's tensor transforms, antialiased)
Prints one line per path: path, batch, workers, img/s."""
import argparse
import os
import time
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool_deps  # noqa: E402
# third-party modules: checked after argument parsing (tool_deps.require), so --help needs none
try:
    import torch
    import torchvision
    from torchvision import transforms as T
    from torchvision.transforms import v2
except ImportError:
    pass

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def bench_dataloader(root, a):
    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(root, tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                     pin_memory=True, drop_last=True, persistent_workers=True,
                                     prefetch_factor=4)
    it = iter(dl)
    for _ in range(3):
        x, _ = next(it)
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    for _ in range(a.batches):
        try:
            x, _ = next(it)
        except StopIteration:
            it = iter(dl)
            x, _ = next(it)
        x = x.cuda(non_blocking=True)
        n += x.shape[0]
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def bench_gpu_decode(root, a):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    pool = ThreadPoolExecutor(a.workers)
    read = lambda p: torchvision.io.read_file(p)
    rrc = v2.RandomResizedCrop(224, antialias=True)
    flip = v2.RandomHorizontalFlip()
    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1) * 255
    g = torch.Generator().manual_seed(0)

    def batch(k):
        idx = torch.randint(len(files), (a.batch,), generator=g).tolist()
        data = list(pool.map(read, [files[i] for i in idx]))
        imgs = torchvision.io.decode_jpeg(data, device="cuda", mode=torchvision.io.ImageReadMode.RGB)
        out = torch.stack([flip(rrc(im)) for im in imgs]).float()
        return (out - mean) / std

    for k in range(3):
        batch(k)
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    for k in range(a.batches):
        n += batch(k).shape[0]
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--paths", default="dataloader,gpu_decode")
    a = ap.parse_args()
    tool_deps.require("bench_input_peers", "torch", "torchvision", "PIL")
    for path in a.paths.split(","):
        ips = {"dataloader": bench_dataloader, "gpu_decode": bench_gpu_decode}[path](a.root, a)
        print(f"peer | {path} | batch {a.batch} | workers {a.workers} | {ips:.0f} img/s", flush=True)


if __name__ == "__main__":
    main()
