#!/usr/bin/python3
"""An independent TFRecord writer for the image-source tests (no TensorFlow, no vitgrid code).

    write_tfrecord.py TREE OUT_DIR [--shards 2] [--val-shards 1] [--proto PROTO]
                      [--damage crc|cut] [--damage-shard NAME] [--damage-record K]

Reads an ImageFolder tree (TREE/train/<class>/*, TREE/val/<class>/*; classes = sorted
directory names of train/, files sorted, .jpg/.jpeg/.png case-insensitive, like torchvision)
and writes tf.train.Example records as TensorFlow's build_imagenet_data.py does:
image/encoded, image/format, image/height, image/width, image/class/label (1-based),
image/class/text, into shards train-0000k-of-0000n and validation-0000k-of-0000n, the
samples in folder order split into contiguous runs (no shuffling: the tests compare index by
index). The Example messages come from compiling PROTO (default: the project's
src/data/proto/tf_example.proto) with `protoc --python_out` into a temporary directory;
CRC32C comes from crcmod (or the crc32c / google-crc32c wheels). --damage crc flips a byte in the data of record K (default 1) of a
shard (default: the first train shard); --damage cut drops the last 10 bytes of that shard
(its last record is cut off).
"""
import argparse
import importlib
import os
import struct
import subprocess
import sys
import tempfile

try:  # Debian's python3-crcmod; elsewhere the crc32c or google-crc32c wheels
    import crcmod.predefined
    _crc32c = crcmod.predefined.mkCrcFun("crc-32c")
except ImportError:
    try:
        from crc32c import crc32c as _crc32c
    except ImportError:
        from google_crc32c import value as _crc32c


def masked_crc(data):
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data):
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def load_proto(proto):
    tmp = tempfile.mkdtemp(prefix="vg_tfproto_")
    subprocess.check_call(["protoc", "-I", os.path.dirname(os.path.abspath(proto)),
                           "--python_out", tmp, os.path.abspath(proto)])
    sys.path.insert(0, tmp)
    name = os.path.splitext(os.path.basename(proto))[0] + "_pb2"
    return importlib.import_module(name)


def image_size(data):
    """(height, width, format) from the header, via Pillow when it can open the file."""
    import io
    try:
        from PIL import Image
        im = Image.open(io.BytesIO(data))
        return im.height, im.width, (im.format or "JPEG")
    except Exception:  # a truncated header: build_imagenet_data.py would have failed on it
        return 0, 0, "JPEG"


def list_split(tree, split, classes):
    out = []
    for label, c in enumerate(classes):
        d = os.path.join(tree, split, c)
        if not os.path.isdir(d):
            continue
        found = []
        for root, _, files in sorted(os.walk(d, followlinks=True)):
            for f in sorted(files):
                if os.path.splitext(f)[1].lower() in (".jpg", ".jpeg", ".png"):
                    found.append(os.path.join(root, f))
        out += [(p, label, c) for p in found]
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tree")
    ap.add_argument("out")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--val-shards", type=int, default=1)
    ap.add_argument("--proto", default=os.path.join(here, "..", "..", "src", "data", "proto",
                                                    "tf_example.proto"))
    ap.add_argument("--damage", choices=["crc", "cut"])
    ap.add_argument("--damage-shard")
    ap.add_argument("--damage-record", type=int, default=1)
    a = ap.parse_args()
    pb = load_proto(a.proto)
    classes = sorted(e for e in os.listdir(os.path.join(a.tree, "train"))
                     if os.path.isdir(os.path.join(a.tree, "train", e)))
    os.makedirs(a.out, exist_ok=True)
    written = []
    for split, prefix, nshards in (("train", "train", a.shards), ("val", "validation", a.val_shards)):
        samples = list_split(a.tree, split, classes)
        for s in range(nshards):
            lo, hi = len(samples) * s // nshards, len(samples) * (s + 1) // nshards
            name = "%s-%05d-of-%05d" % (prefix, s, nshards)
            offsets = []
            with open(os.path.join(a.out, name), "wb") as f:
                for path, label, cname in samples[lo:hi]:
                    with open(path, "rb") as g:
                        data = g.read()
                    h, w, fmt = image_size(data)
                    ex = pb.Example()
                    feat = ex.features.feature
                    feat["image/encoded"].bytes_list.value.append(data)
                    feat["image/format"].bytes_list.value.append(fmt.encode())
                    feat["image/height"].int64_list.value.append(h)
                    feat["image/width"].int64_list.value.append(w)
                    feat["image/class/label"].int64_list.value.append(label + 1)
                    feat["image/class/text"].bytes_list.value.append(cname.encode())
                    feat["image/class/synset"].bytes_list.value.append(cname.encode())
                    rec = frame(ex.SerializeToString())
                    offsets.append((f.tell(), len(rec)))
                    f.write(rec)
            written.append((name, offsets))
    if a.damage:
        target = a.damage_shard or written[0][0]
        offsets = dict(written)[target]
        path = os.path.join(a.out, target)
        if a.damage == "crc":
            off, size = offsets[a.damage_record]
            with open(path, "r+b") as f:
                f.seek(off + 12 + (size - 16) // 2)
                b = f.read(1)
                f.seek(off + 12 + (size - 16) // 2)
                f.write(bytes([b[0] ^ 0x5A]))
            print("write_tfrecord: flipped a byte of record at offset %d of %s" % (off, target),
                  file=sys.stderr)
        else:
            size = os.path.getsize(path)
            os.truncate(path, size - 10)
            print("write_tfrecord: cut the record at offset %d of %s" % (offsets[-1][0], target),
                  file=sys.stderr)


if __name__ == "__main__":
    main()
