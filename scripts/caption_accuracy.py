#!/usr/bin/env python3
"""Caption accuracy of a merged model: for every image DIR/<class>/*.png, does
the model continue "a handwritten" after the image with the class word? One
`tokenformer generate --prompts` run decodes them all together (each line what
`generate --image IMG --prompt "a handwritten"` gives it). Prints a JSON object
(right, total, accuracy, per class).

With --likelihood, the zero-shot reading instead: of the captions "a handwritten
<class>" for every class (the folder names), is the image's own the most likely
after it? One `tokenformer score --file` run scores every (image, caption) line;
the captions share their first tokens, so the total log-likelihood ranks the
class words.

Usage: scripts/caption_accuracy.py MODEL DIR [--likelihood] [--bin target/release/tokenformer]
"""
import argparse
import json
import os
import subprocess
import tempfile

PROMPT = "a handwritten"

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("dir")
ap.add_argument("--likelihood", action="store_true")
ap.add_argument("--bin", default="target/release/tokenformer")
a = ap.parse_args()
classes = sorted(c for c in os.listdir(a.dir) if os.path.isdir(os.path.join(a.dir, c)))
items = [
    (cls, os.path.abspath(os.path.join(a.dir, cls, f)))
    for cls in classes
    for f in sorted(os.listdir(os.path.join(a.dir, cls)))
]


def run(lines, command):
    """The stdout lines of the binary run on `lines` written as a JSON-lines file."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    try:
        return subprocess.run([a.bin, *command(f.name)], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    finally:
        os.unlink(f.name)


if a.likelihood:
    lines = [{"text": f"{PROMPT} {c}", "image": image} for _, image in items for c in classes]
    out = run(lines, lambda f: ["score", "--model", a.model, "--file", f])
    nll = [json.loads(line)["nll"] for line in out]
    assert len(nll) == len(lines)
    k = len(classes)
    picked = [classes[min(range(k), key=lambda j: nll[i * k + j])] for i in range(len(items))]
else:
    lines = [{"prompt": PROMPT, "image": image} for _, image in items]
    out = run(lines, lambda f: ["generate", "--model", a.model, "--prompts", f, "--quiet", "--max-new-tokens", "5"])
    picked = []
    for line in out:
        words = json.loads(line)["generated_text"].split()
        picked.append(words[0] if words else "")
right = 0
per = {}
for (cls, _), p in zip(items, picked, strict=True):
    ok = p == cls
    right += ok
    r = per.setdefault(cls, [0, 0])
    r[0] += ok
    r[1] += 1
total = len(items)
print(json.dumps({"right": right, "total": total, "accuracy": right / total,
                  "per_class": {k: v[0] / v[1] for k, v in per.items()}}))
