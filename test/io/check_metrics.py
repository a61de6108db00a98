#!/usr/bin/env python3
"""Checks a metrics.h5 with h5py, as a plotting tool would read it (called by test_metrics.cpp
while the writer still has the file open). Row values follow train_row()/eval_row() there.

usage: check_metrics.py FILE --steps 1,2,3 --eval 2 --world P
Exit 0 when everything matches, 1 with a message otherwise."""
import argparse
import sys

import h5py
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--steps", required=True)
    ap.add_argument("--eval", default="")
    ap.add_argument("--world", type=int, required=True)
    a = ap.parse_args()
    steps = np.array([int(s) for s in a.steps.split(",") if s], dtype=np.int64)
    evals = np.array([int(s) for s in a.eval.split(",") if s], dtype=np.int64)
    n, p = len(steps), a.world
    ranks = np.arange(p, dtype=np.float64)

    with h5py.File(a.file, "r") as f:
        assert f.attrs["world_size"] == p, f.attrs["world_size"]
        assert list(f.attrs["grid"]) == [1, p, 1], f.attrs["grid"]
        assert f.attrs["version"] == "0.1.0", f.attrs["version"]
        assert f.attrs["tensor_mode"] == "1d" and f.attrs["backend"] == "cpu"
        assert "[run]" in f.attrs["deck"]
        t = f["train"]
        assert t["step"].dtype == np.int64 and t["loss"].dtype == np.float64
        assert np.array_equal(t["step"][:], steps), t["step"][:]
        assert t["step_time_s"].shape == (n, p), t["step_time_s"].shape
        assert t["device_mem_bytes"].shape == (n, p)
        s = steps.astype(np.float64)
        assert np.array_equal(t["loss"][:], 10.0 - 0.5 * s)
        assert np.array_equal(t["lr"][:], 1e-4 * s)
        assert np.array_equal(t["grad_norm"][:], s + 0.5)
        assert np.array_equal(t["images_per_s"][:], 100.0 * s)
        assert np.array_equal(t["loss_scale"][:], np.full(n, 1024.0))
        assert np.array_equal(t["step_time_s"][:], ranks[None, :] + s[:, None])
        assert np.array_equal(t["device_mem_bytes"][:], 1e9 + 1000.0 * ranks[None, :] + s[:, None])
        # one run wrote it: one segment, from step 1, on p ranks, 1d
        g = f["segments"]
        assert np.array_equal(g["first_step"][:], [1]), g["first_step"][:]
        assert np.array_equal(g["world_size"][:], [p]), g["world_size"][:]
        assert np.array_equal(g["grid"][:], [[1, p, 1]]), g["grid"][:]
        assert list(g["tensor_mode"][:].astype(str)) == ["1d"], g["tensor_mode"][:]
        e = f["eval"]
        assert np.array_equal(e["step"][:], evals), e["step"][:]
        assert np.array_equal(e["loss"][:], 2.0 / evals)
        assert np.array_equal(e["top1"][:], 0.1 * evals)
        assert np.array_equal(e["top5"][:], 0.2 * evals)
    print("metrics ok:", a.file)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as err:
        import traceback
        traceback.print_exc()
        print("metrics check failed:", err, file=sys.stderr)
        sys.exit(1)
