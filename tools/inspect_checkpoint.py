#!/usr/bin/env python3
"""Summarise a vitgrid checkpoint (checkpoints/step_XXXXXXXX.h5), h5ls-style.

    inspect_checkpoint.py CKPT.h5           file, complete flag, step, grid, world size,
                                            tensor mode, every tensor with shape and element
                                            count, total parameter count (/model only)
    inspect_checkpoint.py --deck CKPT.h5    the resolved deck stored in the checkpoint

Exit status: 0 on success, 2 when the file is missing, not HDF5, not a vitgrid checkpoint, or
incomplete (no complete = 1 root attribute: vitgrid never loads such a file either).
Needs python3 with h5py and numpy (Debian: python3-h5py).
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
from checkpoint_hash import checksum  # noqa: E402


def fail(msg):
    print(f"inspect_checkpoint: {msg}", file=sys.stderr)
    sys.exit(2)


def text(v):
    """Attribute as str whether stored variable-length (str) or fixed-length (bytes)."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray) and v.shape == ():
        return text(v[()])
    return str(v)


def tensors(f):
    """(name, dataset) of every dataset under /model and /optim, in name order."""
    out = []
    for top in ("model", "optim"):
        if top in f:
            f[top].visititems(lambda n, o, top=top: out.append((f"{top}/{n}", o))
                              if isinstance(o, h5py.Dataset) else None)
    return sorted(out, key=lambda t: t[0])


def main():
    ap = argparse.ArgumentParser(description="Summarise a vitgrid checkpoint")
    ap.add_argument("checkpoint")
    ap.add_argument("--deck", action="store_true", help="print the stored deck and exit")
    a = ap.parse_args()
    tool_deps.require("inspect_checkpoint", "h5py", "numpy")
    path = a.checkpoint

    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        fail(f"checkpoint '{path}': no such file")
    except OSError as err:
        fail(f"checkpoint '{path}' is not a readable HDF5 file ({err})")

    with f:
        if "model" not in f:
            fail(f"'{path}' is not a vitgrid checkpoint (no /model group)")
        complete = int(np.asarray(f.attrs.get("complete", 0)).reshape(-1)[0]) == 1
        if not complete:
            fail(f"checkpoint '{path}' is incomplete (no 'complete' attribute); "
                 "it was not finished and is never loaded")
        if a.deck:
            sys.stdout.write(text(f.attrs.get("deck", "")))
            if not text(f.attrs.get("deck", "")).endswith("\n"):
                sys.stdout.write("\n")
            return 0

        step = "?"
        if "state/step" in f:
            step = str(int(np.asarray(f["state/step"][()]).reshape(-1)[0]))
        grid = f.attrs.get("grid")
        grid_s = "x".join(str(int(g)) for g in grid) if grid is not None else "?"
        print(f"file: {path}")
        print(f"complete: yes")
        print(f"step: {step}")
        print(f"grid (pipeline x data x tensor): {grid_s}")
        print(f"world_size: {int(f.attrs['world_size']) if 'world_size' in f.attrs else '?'}")
        print(f"tensor_mode: {text(f.attrs.get('tensor_mode', '?'))}")
        print(f"backend: {text(f.attrs.get('backend', '?'))}")
        print(f"version: {text(f.attrs.get('version', '?'))}")

        items = tensors(f)
        width = max([len(n) for n, _ in items] + [4])
        print(f"\n{'name':<{width}}  {'shape':<20} {'elements':>12}  dtype    checksum")
        params = 0
        bad = []
        for name, d in items:
            stored = d.attrs.get("checksum")
            if stored is None:
                verdict = "missing"
                bad.append(name)
            elif checksum(d[()]) == int(stored):
                verdict = "ok"
            else:
                verdict = "MISMATCH"
                bad.append(name)
            print(f"{name:<{width}}  {str(tuple(d.shape)):<20} {d.size:>12}  {str(d.dtype):<8} {verdict}")
            if name.startswith("model/"):
                params += d.size
        n_model = sum(1 for n, _ in items if n.startswith("model/"))
        print(f"\ntensors: {len(items)} ({n_model} in /model)")
        print(f"parameters: {params}")
        print(f"checksums: {'all verified' if not bad else f'{len(bad)} FAILED'}")
        if "state" in f:
            state = []
            f["state"].visititems(lambda n, o: state.append(n) if isinstance(o, h5py.Dataset) else None)
            for n in sorted(state):
                v = np.asarray(f["state"][n][()]).reshape(-1)
                shown = ", ".join(f"{x:g}" for x in v[:8]) + (", ..." if v.size > 8 else "")
                print(f"state/{n}: [{shown}]")
        if bad:
            fail(f"checkpoint '{path}': {len(bad)} dataset(s) fail verification: {', '.join(bad[:5])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
