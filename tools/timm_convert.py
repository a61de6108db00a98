#!/usr/bin/env python3
"""Move ViT weights between timm/PyTorch and vitgrid.

    timm_convert.py import STATE_DICT OUT.h5 [--num-classes K] [--image-size S] [--seed N]
        STATE_DICT: a timm VisionTransformer state_dict as .pth/.pt (torch.save) or .safetensors.
        Writes a complete, checksummed vitgrid checkpoint to fine-tune from
        (`vitgrid train DECK --checkpoint.load=OUT.h5`, the deck describing the same model).
        --num-classes K: a new classifier head (trunc-normal 0.02 weights, zero bias) when K
        differs from the source's; --image-size S: the position embedding resampled (bicubic,
        class token kept) to S/patch patches per side.
    timm_convert.py export CKPT.h5 OUT.(pth|safetensors)
        Writes /model of a vitgrid checkpoint (checksums verified) as a state_dict that timm's
        VisionTransformer loads with strict=True.

Names are identical on both sides (vitgrid stores timm's state_dict keys). Needs numpy and h5py;
.pth needs torch; safetensors is read and written here without the safetensors package."""
import argparse
import json
import os
import struct
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

VERSION = "0.1.0"
# keys of timm's VisionTransformer that vitgrid has no use for (identity or absent layers)
IGNORED = ("fc_norm.", "norm_pre.", "patch_embed.norm.", "head_drop.")


def die(msg):
    print(f"timm_convert: {msg}", file=sys.stderr)
    sys.exit(2)


# ---- safetensors (https://github.com/huggingface/safetensors: u64 header size, JSON header, data)
_ST_DTYPES = {"F32": "float32", "F16": "float16", "F64": "float64"}  # numpy dtype names


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        die(f"'{path}' is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError:
        die(f"'{path}' is not a safetensors file (bad header)")
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = data[a:b]
        if info["dtype"] == "BF16":  # bfloat16: the top half of a float32
            arr = (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in _ST_DTYPES:
            arr = np.frombuffer(buf, dtype=_ST_DTYPES[info["dtype"]])
        else:
            die(f"'{path}': tensor '{name}' has unsupported dtype {info['dtype']}")
        out[name] = arr.reshape(info["shape"]).astype(np.float32)
    return out


def write_safetensors(path, tensors):
    header, offset, chunks = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        chunks.append(a.tobytes())
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)
    os.replace(path + ".tmp", path)


def load_state_dict(path):
    if path.endswith(".safetensors"):
        return read_safetensors(path)
    try:
        import torch
    except ImportError:
        die("reading .pth needs torch (Debian: python3-torch)")
    try:
        sd = torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input error
        die(f"cannot read '{path}' as a torch checkpoint: {e}")
    for k in ("state_dict", "model", "module"):
        if isinstance(sd, dict) and k in sd and isinstance(sd[k], dict):
            sd = sd[k]
    if not isinstance(sd, dict):
        die(f"'{path}' holds no state_dict")
    return {k.removeprefix("module."): v.detach().float().numpy() for k, v in sd.items()
            if hasattr(v, "detach")}


def trunc_normal(rng, shape, std=0.02):
    x = rng.standard_normal(size=shape)
    bad = np.abs(x) > 2
    while bad.any():
        x[bad] = rng.standard_normal(size=int(bad.sum()))
        bad = np.abs(x) > 2
    return (x * std).astype(np.float32)


def resample_pos_embed(pos, new_grid):
    """[1, 1 + g*g, C] -> [1, 1 + n*n, C], bicubic on the patch grid, class token kept."""
    import torch
    import torch.nn.functional as F
    cls, grid = pos[:, :1], pos[:, 1:]
    g = int(round(np.sqrt(grid.shape[1])))
    if g * g != grid.shape[1]:
        die(f"pos_embed has {grid.shape[1]} patch positions: not a square grid")
    t = torch.from_numpy(grid).reshape(1, g, g, -1).permute(0, 3, 1, 2)
    t = F.interpolate(t, size=(new_grid, new_grid), mode="bicubic", align_corners=False)
    t = t.permute(0, 2, 3, 1).reshape(1, new_grid * new_grid, -1).numpy()
    return np.concatenate([cls, t], axis=1).astype(np.float32)


def check_vit(sd, path):
    need = ["patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "pos_embed", "norm.weight",
            "norm.bias", "head.weight", "head.bias"]
    missing = [k for k in need if k not in sd]
    if missing:
        die(f"'{path}' is not a timm VisionTransformer state_dict: missing {', '.join(missing)}")
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for name in list(sd):
        if name.startswith(IGNORED):
            if np.any(sd[name] != (1 if name.endswith("weight") else 0)):
                die(f"'{path}': '{name}' is not an identity layer; vitgrid's ViT has no such layer")
            del sd[name]
        elif any(x in name for x in (".ls1.", ".ls2.", "reg_token", "attn_pool", ".q_norm.", ".k_norm.")):
            die(f"'{path}': '{name}' belongs to a ViT variant vitgrid does not implement")
    return depth


def cmd_import(a):
    sd = load_state_dict(a.state_dict)
    depth = check_vit(sd, a.state_dict)
    rng = np.random.default_rng(a.seed)
    C = sd["cls_token"].shape[-1]
    K0 = sd["head.weight"].shape[0]
    if a.num_classes and a.num_classes != K0:
        sd["head.weight"] = trunc_normal(rng, (a.num_classes, C))
        sd["head.bias"] = np.zeros(a.num_classes, np.float32)
        print(f"head: {K0} -> {a.num_classes} classes (re-initialised)")
    P = sd["patch_embed.proj.weight"].shape[-1]
    if a.image_size:
        if a.image_size % P:
            die(f"--image-size {a.image_size} is not a multiple of the patch size {P}")
        n = a.image_size // P
        if sd["pos_embed"].shape[1] != 1 + n * n:
            sd["pos_embed"] = resample_pos_embed(sd["pos_embed"], n)
            print(f"pos_embed resampled to {n}x{n} patches")
    T = sd["pos_embed"].shape[1]
    image = int(round(np.sqrt(T - 1))) * P
    heads = a.heads
    deck = (f"# imported by tools/timm_convert.py from {os.path.basename(a.state_dict)}\n[model]\npreset = custom\n"
            f"image_size = {image}\npatch_size = {P}\nhidden = {C}\ndepth = {depth}\n"
            f"mlp_ratio = {sd['blocks.0.mlp.fc1.weight'].shape[0] / C:g}\nnum_classes = {sd['head.weight'].shape[0]}\n"
            + (f"heads = {heads}\n" if heads else ""))
    tmp = a.out + ".tmp"
    with h5py.File(tmp, "w") as f:
        for name in sorted(sd):
            arr = np.ascontiguousarray(sd[name], dtype=np.float32)
            d = f.create_dataset(f"model/{name}", data=arr)
            d.attrs.create("checksum", checksum(arr), dtype=np.uint64)
        for k, v in {"step": 0.0, "applied_steps": 0.0}.items():
            d = f.create_dataset(f"state/{k}", data=np.array([v]))
            d.attrs.create("checksum", checksum(np.array([v])), dtype=np.uint64)
        f.attrs["deck"] = deck
        f.attrs["grid"] = np.array([1, 1, 1], dtype=np.int32)
        f.attrs["world_size"] = np.int32(1)
        f.attrs["tensor_mode"] = "none"
        f.attrs["backend"] = "timm-import"
        f.attrs["version"] = VERSION
        f.attrs["complete"] = np.int32(1)  # last
    os.replace(tmp, a.out)
    n = sum(v.size for v in sd.values())
    print(f"wrote {a.out}: {len(sd)} tensors, {n} parameters (image {image}, patch {P}, hidden {C}, depth {depth})")


def cmd_export(a):
    try:
        f = h5py.File(a.checkpoint, "r")
    except OSError as e:
        die(f"cannot read '{a.checkpoint}': {e}")
    with f:
        if int(np.asarray(f.attrs.get("complete", 0)).reshape(-1)[0]) != 1 or "model" not in f:
            die(f"'{a.checkpoint}' is not a complete vitgrid checkpoint")
        sd = {}
        for name, d in f["model"].items():
            arr = d[()]
            if "checksum" not in d.attrs or checksum(arr) != int(d.attrs["checksum"]):
                die(f"'{a.checkpoint}': dataset '/model/{name}' fails its checksum")
            sd[name] = arr
    if a.out.endswith(".safetensors"):
        write_safetensors(a.out, sd)
    else:
        import torch
        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, a.out + ".tmp")
        os.replace(a.out + ".tmp", a.out)
    print(f"wrote {a.out}: {len(sd)} tensors")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("import")
    i.add_argument("state_dict")
    i.add_argument("out")
    i.add_argument("--num-classes", type=int, default=0)
    i.add_argument("--image-size", type=int, default=0)
    i.add_argument("--heads", type=int, default=0, help="recorded in the stored deck (not in a state_dict)")
    i.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("export")
    e.add_argument("checkpoint")
    e.add_argument("out")
    a = ap.parse_args()
    # torch only for .pth/.pt files (safetensors is read and written here)
    torch_file = any(str(p).endswith((".pth", ".pt")) for p in vars(a).values())
    tool_deps.require("timm_convert", "h5py", "numpy", *(["torch"] if torch_file else []))
    (cmd_import if a.cmd == "import" else cmd_export)(a)


if __name__ == "__main__":
    main()
