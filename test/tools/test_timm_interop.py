#!/usr/bin/env python3
"""timm <-> vitgrid interop (tools/timm_convert.py), end to end:
 1. a timm-layout PyTorch ViT (test/golden/reference_vit.py, key for key timm's state_dict) is
    saved as .pth and .safetensors and imported into vitgrid checkpoints;
 2. `vitgrid predict` on the imported weights reproduces the PyTorch model's logits on the same
    (synthetic) eval images, normalised the same way (rel. L2 <= 1e-5);
 3. export back to .pth/.safetensors loads with strict=True and equals the original tensors;
 4. --num-classes re-initialises the head; the inspect tool verifies every checksum.
Run by ctest with VITGRID_BIN set; needs /usr/bin/python3 with torch, numpy and h5py."""
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "test", "golden"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import reference_vit  # noqa: E402
import timm_convert  # noqa: E402

VITGRID = os.environ.get("VITGRID_BIN", os.path.join(ROOT, "build", "bin", "vitgrid"))
DATASET_TOOL = os.path.join(os.path.dirname(VITGRID), "vitgrid_dataset")
DECK = os.path.join(ROOT, "test", "app", "tiny.ini")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HDF5_USE_FILE_LOCKING="FALSE")
PY = sys.executable
FAIL = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAIL.append(what)


def sh(cmd, **kw):
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, **kw)
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:])
        raise SystemExit(f"command failed ({p.returncode}): {' '.join(cmd)}")
    return p


def main():
    tmp = tempfile.mkdtemp(prefix="vg_timm_")
    try:
        torch.manual_seed(3)
        # the tiny deck's model: image 8, patch 4, hidden 16, depth 2, heads 2, mlp 32, classes 4
        m = reference_vit.VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=4,
                                            embed_dim=16, depth=2, num_heads=2, mlp_hidden=32)
        with torch.no_grad():  # non-trivial weights: every parameter random, O(1) activations
            for name, p in m.named_parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
        m.eval()
        sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
        pth = os.path.join(tmp, "vit.pth")
        torch.save(sd, pth)
        st = os.path.join(tmp, "vit.safetensors")
        timm_convert.write_safetensors(st, {k: v.numpy() for k, v in sd.items()})

        # 1. import both formats
        a, b = os.path.join(tmp, "a.h5"), os.path.join(tmp, "b.h5")
        sh([PY, os.path.join(ROOT, "tools", "timm_convert.py"), "import", pth, a, "--heads", "2"])
        sh([PY, os.path.join(ROOT, "tools", "timm_convert.py"), "import", st, b])
        with h5py.File(a) as fa, h5py.File(b) as fb:
            check(sorted(fa["model"]) == sorted(sd), "imported names are the state_dict keys")
            check(all(np.array_equal(fa["model"][k][()], fb["model"][k][()]) for k in fa["model"]),
                  ".pth and .safetensors imports are identical")
            check(all(np.array_equal(fa["model"][k][()], sd[k].numpy()) for k in sd), "tensors copied exactly")
        p = sh([PY, os.path.join(ROOT, "tools", "inspect_checkpoint.py"), a])
        check("checksums: all verified" in p.stdout, "inspect tool verifies the imported checksums")

        # 2. vitgrid predicts with the imported weights what PyTorch computes
        out = os.path.join(tmp, "pred")
        sh(["mpirun", "-np", "2", "--oversubscribe", VITGRID, "predict", DECK, f"--checkpoint.load={a}",
            f"--run.out_dir={out}"])
        with h5py.File(os.path.join(out, "predictions.h5")) as f:
            logits_vg, labels_vg = f["/logits"][()], f["/labels"][()]
        prefix = os.path.join(tmp, "syn")
        # the deck's synthetic split: seed 7, 64 eval images of 8x8, 4 classes
        sh([DATASET_TOOL, "synthetic", prefix, "--train", "512", "--eval", "64", "--size", "8",
            "--classes", "4", "--seed", "7"])
        with h5py.File(prefix + "_eval.h5") as f:
            imgs, labels = f["/images"][()], f["/labels"][()]
        check(np.array_equal(labels.astype(np.int32), labels_vg), "same eval labels in the same order")
        mean = np.array([0.4914, 0.4822, 0.4465], np.float32)
        std = np.array([0.2470, 0.2435, 0.2616], np.float32)
        x = ((imgs.astype(np.float32) / 255.0 - mean) / std).transpose(0, 3, 1, 2)
        with torch.no_grad():
            ref = m.double()(torch.from_numpy(x).double()).numpy()
        err = np.linalg.norm(logits_vg - ref) / np.linalg.norm(ref)
        check(err <= 1e-5, f"vitgrid logits on imported weights match PyTorch (rel. L2 {err:.2e} <= 1e-5)")

        # 3. export back: strict load, equal tensors, both formats
        for ext in ("pth", "safetensors"):
            o = os.path.join(tmp, f"back.{ext}")
            sh([PY, os.path.join(ROOT, "tools", "timm_convert.py"), "export", a, o])
            back = (torch.load(o) if ext == "pth"
                    else {k: torch.from_numpy(v.copy()) for k, v in timm_convert.read_safetensors(o).items()})
            m2 = reference_vit.VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=4,
                                                 embed_dim=16, depth=2, num_heads=2, mlp_hidden=32)
            m2.load_state_dict(back, strict=True)
            check(all(torch.equal(back[k], sd[k]) for k in sd), f"export .{ext}: strict load, tensors equal")

        # a checkpoint vitgrid trained itself exports too
        run = os.path.join(tmp, "run")
        sh(["mpirun", "-np", "1", VITGRID, "train", DECK, f"--run.out_dir={run}", "--run.steps=2",
            "--checkpoint.every_steps=0"])
        o = os.path.join(tmp, "trained.pth")
        sh([PY, os.path.join(ROOT, "tools", "timm_convert.py"), "export",
            os.path.join(run, "checkpoints", "step_00000002.h5"), o])
        m2.load_state_dict(torch.load(o), strict=True)
        check(True, "a vitgrid-trained checkpoint loads into the timm-layout model with strict=True")

        # 4. new head
        c = os.path.join(tmp, "c.h5")
        sh([PY, os.path.join(ROOT, "tools", "timm_convert.py"), "import", pth, c, "--num-classes", "7"])
        with h5py.File(c) as f:
            check(f["model/head.weight"].shape == (7, 16) and f["model/head.bias"].shape == (7,)
                  and not np.any(f["model/head.bias"][()]), "--num-classes 7 gives a fresh 7-way head")
        # a damaged state_dict is refused clearly
        bad = os.path.join(tmp, "bad.pth")
        torch.save({k: v for k, v in sd.items() if k != "head.weight"}, bad)
        p = subprocess.run([PY, os.path.join(ROOT, "tools", "timm_convert.py"), "import", bad, c],
                           capture_output=True, text=True)
        check(p.returncode == 2 and "head.weight" in p.stderr, "a state_dict missing head.weight is refused")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if FAIL:
        print(f"{len(FAIL)} check(s) failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
