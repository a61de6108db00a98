#!/usr/bin/env python3
"""The per-dataset checksum of vitgrid checkpoints, in numpy (the C++ side is src/io/checkpoint.cpp):

    checksum = sum over elements i (global row-major index) of mix64(i * 0x9E3779B97F4A7C15 ^ bits(x_i))
               modulo 2**64, bits = the raw IEEE pattern (uint32 for float32, uint64 for float64),
    mix64 = the splitmix64 finaliser (include/vitgrid/core/rng.h).

Imported by inspect_checkpoint.py and timm_convert.py; as a command,

    checkpoint_hash.py CKPT.h5 [DATASET ...]

prints the checksum of each float dataset (all of them by default) beside its stored one and
exits 1 when any differs. Needs numpy (and h5py for the command)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool_deps  # noqa: E402

# numpy: checked after argument parsing (tool_deps.require), so --help needs none
try:
    import numpy as np

    _GOLDEN = np.uint64(0x9E3779B97F4A7C15)
    _M1 = np.uint64(0xBF58476D1CE4E5B9)
    _M2 = np.uint64(0x94D049BB133111EB)
except ImportError:
    pass


def _mix64(z):
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def checksum(array):
    """uint64 checksum of a float32 or float64 array (any shape), as stored in its attribute."""
    a = np.ascontiguousarray(array)
    if a.dtype == np.float32:
        bits = a.reshape(-1).view(np.uint32).astype(np.uint64)
    elif a.dtype == np.float64:
        bits = a.reshape(-1).view(np.uint64)
    else:
        raise TypeError(f"checksum: float32 or float64 expected, got {a.dtype}")
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for start in range(0, bits.size, 1 << 22):  # bounded temporaries for large tensors
            idx = np.arange(start, min(start + (1 << 22), bits.size), dtype=np.uint64)
            h = _mix64((idx * _GOLDEN) ^ bits[start:start + idx.size])
            total = total + np.add.reduce(h, dtype=np.uint64)
    return int(total)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("datasets", nargs="*", help="dataset paths (default: every float dataset)")
    a = ap.parse_args()
    tool_deps.require("checkpoint_hash", "numpy", "h5py")
    import h5py

    bad = 0
    with h5py.File(a.checkpoint, "r") as f:
        names = a.datasets
        if not names:
            names = []
            f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset)
                         and o.dtype in (np.float32, np.float64) else None)
        for n in sorted(names):
            got = checksum(f[n][()])
            stored = f[n].attrs.get("checksum")
            ok = stored is None or int(stored) == got
            bad += 0 if ok else 1
            print(f"{n}  {got:016x}  {'(none stored)' if stored is None else ('ok' if ok else 'MISMATCH')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
