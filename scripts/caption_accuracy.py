#!/usr/bin/env python3
"""Caption accuracy of a merged model: for every image DIR/<class>/*.png, does
`tokenformer generate --image IMG --prompt "a handwritten"` continue with the
class word? Prints a JSON object (right, total, accuracy, per class).

Usage: scripts/caption_accuracy.py MODEL DIR [--bin target/release/tokenformer]
"""
import argparse
import json
import os
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("dir")
ap.add_argument("--bin", default="target/release/tokenformer")
a = ap.parse_args()
right = total = 0
per = {}
for cls in sorted(os.listdir(a.dir)):
    d = os.path.join(a.dir, cls)
    if not os.path.isdir(d):
        continue
    for f in sorted(os.listdir(d)):
        out = subprocess.run(
            [a.bin, "generate", "--model", a.model, "--image", os.path.join(d, f),
             "--prompt", "a handwritten", "--max-new-tokens", "5"],
            capture_output=True, text=True, check=True).stdout.split()
        ok = len(out) > 2 and out[2] == cls
        right += ok
        total += 1
        r = per.setdefault(cls, [0, 0])
        r[0] += ok
        r[1] += 1
print(json.dumps({"right": right, "total": total, "accuracy": right / total,
                  "per_class": {k: v[0] / v[1] for k, v in per.items()}}))
