#!/usr/bin/env python3
"""Fixture for tests/vision.rs: the image embeddings (pooled, normalised features the head
reads, timm's pre-logits) of tests/fixtures/vit-tiny-imagenet's five images, computed in
float64 PyTorch with the official semantics (scripts/vit_train_step.py's forward) from the
fixture's weights and its Pillow-preprocessed pixels.

Writes tests/fixtures/vit-tiny-imagenet/pre_logits.json, after checking that the head of
these features gives the fixture's own expected logits.

  pip install torch numpy
  python3 scripts/vit_pre_logits.py tests/fixtures/vit-tiny-imagenet
"""
import json, os, struct, sys
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vit_train_step import features  # noqa: E402


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        assert v["dtype"] == "F32", (k, v["dtype"])
        a, b = v["data_offsets"]
        out[k] = torch.from_numpy(np.frombuffer(data[a:b], "<f4").reshape(v["shape"]).copy())
    return out


def main():
    root = sys.argv[1]
    cfg = json.load(open(os.path.join(root, "vit-tiny", "config.json")))
    assert cfg["pool"] == "mean"
    w = {k: t.double() for k, t in read_safetensors(os.path.join(root, "vit-tiny", "model.safetensors")).items()}
    expected = json.load(open(os.path.join(root, "expected.json")))
    pixels = read_safetensors(os.path.join(root, expected["pixels_file"]))["pixels"].double()
    with torch.no_grad():
        f = features(w, cfg, pixels)
        logits = f @ w["head.weight"].T + w["head.bias"]
    by_file = {im["file"]: im["logits"] for im in expected["images"]}
    want = torch.tensor([by_file["val/" + p] for p in expected["pixels_order"]], dtype=torch.float64)
    err = (logits - want).abs().max().item()
    assert err < 1e-4, f"the reference's logits differ from expected.json's by {err}"
    out = {
        "what": "pre-logits (mean of patch tokens, fc_norm) of pixels.safetensors, float64 PyTorch",
        "pixels_order": expected["pixels_order"],
        "pre_logits": f.tolist(),
    }
    with open(os.path.join(root, "pre_logits.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {len(f)} embeddings; head vs expected logits max |diff| {err:.2e}")


if __name__ == "__main__":
    main()
