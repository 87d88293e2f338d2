#!/usr/bin/env python3
"""Builds assets/samples/: the real photographs and text `tokenformer-convert import`
calibrates and measures on when the user gives none.

Photos (public domain or CC0, see assets/samples/README.md) come from the sample data
that PyPI packages bundle: scikit-image (`skimage/data`) and matplotlib
(`mpl-data/sample_data/grace_hopper.jpg`). Each is cropped (some), shrunk so its
longer side is 160 px and saved as JPEG; non-square ones are included on purpose.
Calibration and evaluation photos come from different source pictures.

Text: two pages of the King James Bible (public domain) as Debian's `bible-kjv`
prints them (as scripts/prepare_data.py): Genesis 1 to calibrate, Ruth 1-2 to evaluate.

Usage: scripts/make_samples.py [--out assets/samples]
Needs: pip install pillow scikit-image matplotlib; apt-get (for bible-kjv).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from PIL import Image

LONG_SIDE = 160

# (output name, package, file inside it, crop box in source pixels or None)
CALIBRATION = [
    ("astronaut.jpg", "skimage", "data/astronaut.png", None),
    ("astronaut-face.jpg", "skimage", "data/astronaut.png", (150, 20, 350, 260)),
    ("astronaut-suit.jpg", "skimage", "data/astronaut.png", (0, 256, 512, 512)),
    ("rocket.jpg", "skimage", "data/rocket.jpg", None),
    ("rocket-tower.jpg", "skimage", "data/rocket.jpg", (200, 0, 440, 427)),
    ("hubble.jpg", "skimage", "data/hubble_deep_field.jpg", None),
    ("ihc.jpg", "skimage", "data/ihc.png", None),
    ("ihc-strip.jpg", "skimage", "data/ihc.png", (0, 0, 512, 300)),
]
EVAL = [
    ("grace-hopper.jpg", "matplotlib", "mpl-data/sample_data/grace_hopper.jpg", None),
    ("grace-hopper-face.jpg", "matplotlib", "mpl-data/sample_data/grace_hopper.jpg", (130, 60, 390, 360)),
    ("coffee.jpg", "skimage", "data/coffee.png", None),
    ("coffee-cup.jpg", "skimage", "data/coffee.png", (100, 40, 460, 340)),
    ("chelsea.jpg", "skimage", "data/chelsea.png", None),
    ("chelsea-face.jpg", "skimage", "data/chelsea.png", (140, 20, 360, 230)),
    ("retina.jpg", "skimage", "data/retina.jpg", None),
    ("retina-detail.jpg", "skimage", "data/retina.jpg", (400, 400, 1000, 800)),
]

TEXT = {"calibration.txt": "Gen1:1-Gen1:31", "eval.txt": "Ruth1:1-Ruth2:23"}


def package_dir(name):
    mod = __import__(name)
    return os.path.dirname(mod.__file__)


def photo(package, path, box, out):
    img = Image.open(os.path.join(package_dir(package), path)).convert("RGB")
    if box is not None:
        img = img.crop(box)
    w, h = img.size
    s = LONG_SIDE / max(w, h)
    img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.LANCZOS)
    img.save(out, quality=90)
    return img.size


def bible(passage, tmp):
    exe = shutil.which("bible")
    args = []
    if exe is None:
        subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=tmp, check=True)
        root = os.path.join(tmp, "root")
        for deb in sorted(os.listdir(tmp)):
            if deb.endswith(".deb"):
                subprocess.run(["dpkg-deb", "-x", os.path.join(tmp, deb), root], check=True)
        exe = os.path.join(root, "usr", "bin", "bible")
        args = ["-p", os.path.join(root, "usr", "lib")]
    text = subprocess.run([exe] + args + [passage], stdout=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, check=True).stdout.decode()
    # Verses unwrapped into one paragraph each chapter, numbers and titles dropped.
    chapters, verses, after_blank = [], [], True
    for line in text.split("\n"):
        if not line.strip():
            after_blank = True
            continue
        if after_blank and not line.startswith(" "):
            if verses:
                chapters.append(" ".join(verses))
            verses = []
        elif line.startswith(" ") and line.split()[0].isdigit():
            verses.append(line.split(None, 1)[1].strip())
        else:
            verses[-1] += " " + line.strip()
        after_blank = False
    chapters.append(" ".join(verses))
    return "\n\n".join(chapters) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="assets/samples")
    a = p.parse_args()
    for split, items in [("calibration", CALIBRATION), ("eval", EVAL)]:
        d = os.path.join(a.out, "photos", split)
        os.makedirs(d, exist_ok=True)
        for name, pkg, path, box in items:
            size = photo(pkg, path, box, os.path.join(d, name))
            print(f"{split}/{name}: {size[0]}x{size[1]}", file=sys.stderr)
    d = os.path.join(a.out, "text")
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, passage in TEXT.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(bible(passage, tmp))


if __name__ == "__main__":
    main()
