#!/usr/bin/env python3
"""Caption accuracy of a merged model: for every image DIR/<class>/*.png, does
the model continue "a handwritten" after the image with the class word? One
`tokenformer generate --prompts` run decodes them all together (each line what
`generate --image IMG --prompt "a handwritten"` gives it). Prints a JSON object
(right, total, accuracy, per class).

Usage: scripts/caption_accuracy.py MODEL DIR [--bin target/release/tokenformer]
"""
import argparse
import json
import os
import subprocess
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("dir")
ap.add_argument("--bin", default="target/release/tokenformer")
a = ap.parse_args()
items = [
    (cls, os.path.abspath(os.path.join(a.dir, cls, f)))
    for cls in sorted(os.listdir(a.dir))
    if os.path.isdir(os.path.join(a.dir, cls))
    for f in sorted(os.listdir(os.path.join(a.dir, cls)))
]
with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
    for _, image in items:
        f.write(json.dumps({"prompt": "a handwritten", "image": image}) + "\n")
try:
    out = subprocess.run(
        [a.bin, "generate", "--model", a.model, "--prompts", f.name, "--quiet", "--max-new-tokens", "5"],
        capture_output=True, text=True, check=True).stdout.splitlines()
finally:
    os.unlink(f.name)
right = 0
per = {}
for (cls, _), line in zip(items, out, strict=True):
    words = json.loads(line)["generated_text"].split()
    ok = len(words) > 0 and words[0] == cls
    right += ok
    r = per.setdefault(cls, [0, 0])
    r[0] += ok
    r[1] += 1
total = len(items)
print(json.dumps({"right": right, "total": total, "accuracy": right / total,
                  "per_class": {k: v[0] / v[1] for k, v in per.items()}}))
