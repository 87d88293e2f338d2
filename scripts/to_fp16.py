#!/usr/bin/env python3
"""Copy a model folder's config, tokenizer and card, with model.safetensors cast to fp16.

Usage: scripts/to_fp16.py SRC_DIR DST_DIR   (standard library + numpy; DST_DIR must not exist)
"""
import json
import os
import shutil
import struct
import sys

import numpy as np


def cast(src, dst):
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    out, blobs, offset = {}, [], 0
    for name in sorted(header):
        t = header[name]
        a, b = t["data_offsets"]
        raw = data[a:b]
        if t["dtype"] == "F32":
            raw = np.frombuffer(raw, dtype="<f4").astype("<f2").tobytes()
            dtype = "F16"
        else:
            dtype = t["dtype"]
        out[name] = {"dtype": dtype, "shape": t["shape"], "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if meta is not None:
        out["__metadata__"] = meta
    head = json.dumps(out, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    if os.path.exists(dst):
        sys.exit(f"{dst} exists")
    tmp = dst + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for f in ("config.json", "tokenizer.json", "README.md"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(tmp, f))
    cast(os.path.join(src, "model.safetensors"), os.path.join(tmp, "model.safetensors"))
    os.rename(tmp, dst)


if __name__ == "__main__":
    main()
