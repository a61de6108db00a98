#!/usr/bin/python3
"""Golden check: vitgrid (fp32, CPU backend) against a float64 PyTorch ViT with timm semantics.

Usage: check_golden.py GOLDEN.h5     (written by golden_dump)

For every case in the file (hard labels + smoothing 0.1, soft targets, tanh GELU, drop path with
the masks vitgrid drew) the reference model (reference_vit.py) loads vitgrid's parameters with
load_state_dict(strict=True) in float64, recomputes logits, loss and loss.backward(), and every
tensor is compared with vitgrid's.

Tolerances (vitgrid computes in fp32 with fp32 accumulation; the reference is float64, so the
difference is vitgrid's own round-off, ~1e-7 relative per op, grown by depth and reductions):
  logits     relative L2  ||z_vg - z_ref|| / ||z_ref||  <= 1e-5
  loss       absolute     |l_vg - l_ref|                <= 1e-5   (loss is O(1))
  gradients  relative L2, for EVERY parameter           <= 1e-4
A layout or semantics bug (wrong head split, missing bias, GELU form, LayerNorm eps, smoothing
formula) gives errors of 1e-3 .. 1, far above these.
Also checked: the dumped parameter names equal the reference state_dict keys exactly (the
checkpoint naming contract with timm) with the same shapes, and every reference gradient is
non-zero (otherwise that tensor's comparison would prove nothing).
Exit status 0 when everything passes, 1 otherwise (failures listed).
"""
import math
import os
import sys

TOL_LOGITS_REL_L2 = 1e-5
TOL_LOSS_ABS = 1e-5
TOL_GRAD_REL_L2 = 1e-4
CASES = ("hard", "soft", "tanh", "drop_path")
LN_EPS = 1e-6

try:
    import h5py
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:  # a failure, not a skip: the golden test must not pass vacuously
    print(f"check_golden: FAIL: cannot import {e.name!r} with {sys.executable}: the golden test "
          "needs torch, numpy and h5py (Debian: apt-get install python3-torch python3-h5py "
          "python3-numpy, or `make deps`)", file=sys.stderr)
    sys.exit(1)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_vit  # noqa: E402


def rel_l2(a, ref):
    d = float(np.linalg.norm((a - ref).ravel()))
    n = float(np.linalg.norm(ref.ravel()))
    return d / n if n > 0 else (0.0 if d == 0 else math.inf)


def max_abs(a, ref):
    return float(np.max(np.abs(a - ref))) if a.size else 0.0


def run_case(f, name, group, params_group, failures, rows):
    attrs = dict(f.attrs)
    gelu = group.attrs["gelu"]
    gelu = gelu.decode() if isinstance(gelu, bytes) else str(gelu)
    smoothing = float(group.attrs["smoothing"])

    model = reference_vit.from_config(attrs, gelu).double()
    ref_keys = list(model.state_dict().keys())
    dumped = sorted(params_group.keys())
    missing = sorted(set(ref_keys) - set(dumped))
    extra = sorted(set(dumped) - set(ref_keys))
    if missing or extra:
        failures.append(f"{name}: parameter names differ from timm's state_dict keys: "
                        f"missing {missing}, unexpected {extra}")
        return
    grad_keys = sorted(group["grads"].keys())
    if grad_keys != sorted(ref_keys):
        failures.append(f"{name}: gradient names differ from the parameter names: "
                        f"{sorted(set(ref_keys) ^ set(grad_keys))}")
        return
    state = {k: torch.from_numpy(np.asarray(params_group[k], dtype=np.float64)) for k in ref_keys}
    try:
        model.load_state_dict(state, strict=True)  # also checks every shape
    except RuntimeError as e:
        failures.append(f"{name}: load_state_dict(strict=True) failed: {e}")
        return

    if "drop_path_masks" in group:
        # timm's linspace(0, drop_path_rate, depth) per block; vitgrid's draw of which samples
        # each branch keeps, applied as DropPath does: mask / (1 - rate)
        masks = np.asarray(group["drop_path_masks"], dtype=np.float64)
        rate, depth = float(group.attrs["drop_path"]), len(model.blocks)
        for l, blk in enumerate(model.blocks):
            keep = 1.0 - (rate * l / (depth - 1) if depth > 1 else 0.0)
            blk.path_scale = [torch.from_numpy(masks[l, br] / keep) for br in (0, 1)]
        if not all(0 < masks[l, br].sum() < masks.shape[2]
                   for l in range(1, depth) for br in (0, 1)):
            failures.append(f"{name}: the drop-path masks do not both keep and drop samples")
    images = torch.from_numpy(np.asarray(f["images"], dtype=np.float64))
    labels = torch.from_numpy(np.asarray(f["labels"], dtype=np.int64))
    model.zero_grad(set_to_none=True)
    logits = model(images)
    if "targets" in group:
        # soft (Mixup) targets: mean over the batch of -sum_k t_k log softmax(z)_k, smoothing
        # applied to the targets as vitgrid documents: (1-eps) t + eps/K
        t = torch.from_numpy(np.asarray(group["targets"], dtype=np.float64))
        K = logits.shape[1]
        t = (1.0 - smoothing) * t + smoothing / K
        loss = torch.mean(-torch.sum(t * F.log_softmax(logits, dim=1), dim=1))
    else:
        loss = F.cross_entropy(logits, labels, label_smoothing=smoothing)
    loss.backward()

    z_ref = logits.detach().numpy()
    z_vg = np.asarray(group["logits"], dtype=np.float64)
    if z_vg.shape != z_ref.shape:
        failures.append(f"{name}: logits shape {z_vg.shape} != {z_ref.shape}")
        return
    e = rel_l2(z_vg, z_ref)
    rows.append((name, "logits", e, max_abs(z_vg, z_ref), TOL_LOGITS_REL_L2, "rel L2"))
    if not e <= TOL_LOGITS_REL_L2:
        failures.append(f"{name}: logits rel L2 {e:.3e} > {TOL_LOGITS_REL_L2:.0e}")

    l_vg = float(np.asarray(group["loss"]))
    l_ref = float(loss.item())
    e = abs(l_vg - l_ref)
    rows.append((name, "loss", e, e, TOL_LOSS_ABS, "abs"))
    if not e <= TOL_LOSS_ABS:
        failures.append(f"{name}: loss {l_vg:.9g} vs reference {l_ref:.9g} (abs err {e:.3e} > "
                        f"{TOL_LOSS_ABS:.0e})")

    params = dict(model.named_parameters())
    for k in ref_keys:
        g_ref = params[k].grad
        if g_ref is None:
            failures.append(f"{name}: reference has no gradient for {k}")
            continue
        g_ref = g_ref.numpy()
        g_vg = np.asarray(group["grads"][k], dtype=np.float64)
        if g_vg.shape != g_ref.shape:
            failures.append(f"{name}: grad {k} shape {g_vg.shape} != {g_ref.shape}")
            continue
        if not np.linalg.norm(g_ref) > 0:
            failures.append(f"{name}: reference gradient of {k} is zero: this test cannot judge it")
            continue
        e = rel_l2(g_vg, g_ref)
        rows.append((name, "grad " + k, e, max_abs(g_vg, g_ref), TOL_GRAD_REL_L2, "rel L2"))
        if not e <= TOL_GRAD_REL_L2:
            failures.append(f"{name}: grad {k} rel L2 {e:.3e} > {TOL_GRAD_REL_L2:.0e} "
                            f"(max abs {max_abs(g_vg, g_ref):.3e}, |g_ref| "
                            f"{np.linalg.norm(g_ref):.3e})")


def main():
    if len(sys.argv) != 2:
        print("usage: check_golden.py GOLDEN.h5", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    failures, rows = [], []
    with h5py.File(sys.argv[1], "r") as f:
        eps = float(f.attrs["ln_eps"])
        if abs(eps - LN_EPS) > 1e-12:  # fp32 1e-6 read back as double differs by ~3e-14
            failures.append(f"vitgrid LayerNorm eps {eps:.9g} != timm's {LN_EPS}")
        cases = [("hard", f, f["params"])]
        if "soft" in f:
            cases.append(("soft", f["soft"], f["params"]))
        if "tanh" in f:
            cases.append(("tanh", f["tanh"], f["tanh"]["params"]))
        if "drop_path" in f:
            cases.append(("drop_path", f["drop_path"], f["drop_path"]["params"]))
        for name, group, params_group in cases:
            run_case(f, name, group, params_group, failures, rows)
        if {c[0] for c in cases} != set(CASES):
            lacking = sorted(set(CASES) - {c[0] for c in cases})
            failures.append(f"golden file lacks cases: {lacking}")

    n_grads = sum(1 for r in rows if r[1].startswith("grad "))
    print(f"check_golden: {len(rows)} comparisons ({n_grads} gradients) over "
          f"{len({r[0] for r in rows})} cases; tolerances: logits rel L2 {TOL_LOGITS_REL_L2:.0e}, "
          f"loss abs {TOL_LOSS_ABS:.0e}, grads rel L2 {TOL_GRAD_REL_L2:.0e}")
    print(f"{'case':9s} {'tensor':40s} {'metric':7s} {'error':>10s} {'max abs':>10s} "
          f"{'tol':>7s} {'err/tol':>8s}")
    for case in CASES:
        mine = [r for r in rows if r[0] == case]
        # logits and loss always, then the worst gradients by error/tolerance
        shown = [r for r in mine if not r[1].startswith("grad ")]
        grads = sorted((r for r in mine if r[1].startswith("grad ")), key=lambda r: -r[2] / r[4])
        for r in shown + grads[:6]:
            print(f"{r[0]:9s} {r[1]:40s} {r[5]:7s} {r[2]:10.3e} {r[3]:10.3e} {r[4]:7.0e} "
                  f"{r[2] / r[4]:8.3f}")
    if failures:
        print(f"check_golden: FAIL ({len(failures)}):")
        for msg in failures:
            print("  " + msg)
        return 1
    worst = max(rows, key=lambda r: r[2] / r[4])
    print(f"check_golden: PASS (worst: {worst[0]} {worst[1]} {worst[2]:.3e}, "
          f"{worst[2] / worst[4]:.3f} of its tolerance)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
