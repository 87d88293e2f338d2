#!/usr/bin/env python3
"""Prepares the two small real data sets the zoo's trained models learn from,
from packages a fresh machine can install without the internet at large:

  kjv     The King James Bible (public domain), from Debian's bible-kjv packages:
          one document per chapter (1,189), every 20th chapter held out.
          -> OUT/kjv/{train,val}.jsonl   ({"text": ...} per line), and
             OUT/kjv/tokenizer.json: a byte-level BPE of 2,048 tokens learnt on the
             training chapters (needs the `tokenizers` package from PyPI; the
             training is deterministic, so the file is the same on every run)
  digits  The UCI optical-recognition handwritten digits (8x8, 1,797 images,
          CC BY 4.0), as scikit-learn's wheel ships them: every 5th image of a
          class held out, written as 8x8 RGB PNGs, plus captions for the
          vision-language model.
          -> OUT/digits/{train,val}/<class>/NNNN.png, OUT/digits/{train,val}.jsonl
             ({"image": relative path, "text": caption} per line)

Only the standard library is used; the sources are checked against sha256s.
Usage: scripts/prepare_data.py [--out data] [kjv] [digits]
"""

import argparse
import csv
import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib

# sha256 of the text the Debian 'bible' program prints for Gen1:1-Rev22:21.
KJV_TEXT_SHA256 = "82fa5f3788c6a9a010fb128a0f0bf588984b5888a82058520620eded59b033ea"
SKLEARN = "scikit-learn==1.9.1"
DIGITS_CSV_SHA256 = "6ebb3d2fee246a4e99363262ddf8a00a3c41bee6014c373ed9d9216ba7f651b8"
DIGITS_ROWS = 1797
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def run(cmd, **kw):
    print("+", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, check=True, **kw)


def kjv_text(tmp):
    """The whole Bible as the 'bible' program prints it (installed or unpacked)."""
    bible = shutil.which("bible")
    data_path = None
    if bible is None:
        run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=tmp)
        root = os.path.join(tmp, "root")
        for deb in sorted(os.listdir(tmp)):
            if deb.endswith(".deb"):
                run(["dpkg-deb", "-x", os.path.join(tmp, deb), root])
        bible = os.path.join(root, "usr", "bin", "bible")
        data_path = os.path.join(root, "usr", "lib")
    cmd = [bible] + (["-p", data_path] if data_path else []) + ["Gen1:1-Rev22:21"]
    text = run(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL).stdout
    if sha256(text) != KJV_TEXT_SHA256:
        sys.exit(f"kjv: the text's sha256 is {sha256(text)}, expected {KJV_TEXT_SHA256}")
    return text.decode("utf-8")


def kjv_chapters(text):
    """Splits the printed Bible into chapters of unwrapped verses, numbers dropped.
    A chapter title ("Genesis 1") follows a blank line, unindented; verses start with
    their number, indented; other lines continue the verse before them."""
    chapters, title, verses, after_blank = [], None, [], True
    for line in text.split("\n"):
        if not line.strip():
            after_blank = True
            continue
        if after_blank and not line.startswith(" "):
            if title is not None:
                chapters.append(title + "\n\n" + "\n".join(verses))
            title, verses = line.strip(), []
        elif line.startswith(" ") and line.split()[0].isdigit():
            verses.append(line.split(None, 1)[1].strip())
        else:
            verses[-1] += " " + line.strip()
        after_blank = False
    chapters.append(title + "\n\n" + "\n".join(verses))
    return chapters


def prepare_kjv(out):
    with tempfile.TemporaryDirectory() as tmp:
        chapters = kjv_chapters(kjv_text(tmp))
    if len(chapters) != 1189:
        sys.exit(f"kjv: found {len(chapters)} chapters, expected 1189")
    d = os.path.join(out, "kjv")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "train.jsonl"), "w") as tr, open(
        os.path.join(d, "val.jsonl"), "w"
    ) as va:
        for i, c in enumerate(chapters):
            (va if i % 20 == 19 else tr).write(json.dumps({"text": c}) + "\n")
    train_tokenizer(
        [c for i, c in enumerate(chapters) if i % 20 != 19], os.path.join(d, "tokenizer.json")
    )
    print(f"kjv: {len(chapters)} chapters -> {d}", file=sys.stderr)


def train_tokenizer(texts, path, vocab=2048):
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        sys.exit("kjv: the tokenizer needs the `tokenizers` package: pip install tokenizers")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(path)


def png(pixels, width, height):
    """An 8-bit RGB PNG of grey values, written with zlib only."""
    raw = b"".join(
        b"\0" + bytes(v for p in pixels[r * width : (r + 1) * width] for v in (p, p, p))
        for r in range(height)
    )

    def chunk(kind, body):
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def digits_rows(tmp):
    run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "-d", tmp, SKLEARN],
        stdout=subprocess.DEVNULL,
    )
    wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
    with zipfile.ZipFile(wheel) as z:
        data = gzip.decompress(z.read("sklearn/datasets/data/digits.csv.gz"))
    if sha256(data) != DIGITS_CSV_SHA256:
        sys.exit(f"digits: the csv's sha256 is {sha256(data)}, expected {DIGITS_CSV_SHA256}")
    rows = [list(map(float, r)) for r in csv.reader(io.StringIO(data.decode()))]
    if len(rows) != DIGITS_ROWS or any(len(r) != 65 for r in rows):
        sys.exit(f"digits: {len(rows)} rows, expected {DIGITS_ROWS} of 65 values")
    return rows, sha256(data)


def prepare_digits(out):
    with tempfile.TemporaryDirectory() as tmp:
        rows, digest = digits_rows(tmp)
    d = os.path.join(out, "digits")
    seen = [0] * 10
    lines = {"train": [], "val": []}
    for r in rows:
        label = int(r[64])
        split = "val" if seen[label] % 5 == 4 else "train"
        seen[label] += 1
        rel = os.path.join(split, NAMES[label], f"{seen[label]:04d}.png")
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        grey = [round(v * 255 / 16) for v in r[:64]]
        with open(os.path.join(d, rel), "wb") as f:
            f.write(png(grey, 8, 8))
        lines[split].append({"image": rel, "text": f"a handwritten {NAMES[label]}"})
    for split, items in lines.items():
        with open(os.path.join(d, f"{split}.jsonl"), "w") as f:
            for item in items:
                f.write(json.dumps(item) + "\n")
    print(f"digits: {len(rows)} images (csv sha256 {digest}) -> {d}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data")
    p.add_argument("sets", nargs="*", metavar="{kjv,digits}", help="default: both")
    a = p.parse_args()
    steps = {"kjv": prepare_kjv, "digits": prepare_digits}
    for s in a.sets or list(steps):
        if s not in steps:
            p.error(f"unknown data set {s!r} (kjv or digits)")
        steps[s](a.out)


if __name__ == "__main__":
    main()
