#!/usr/bin/env bash
# Trains the three small models the zoo ships (tiny-kjv-lm, tiny-digits-vit,
# tiny-digits-vl) from the data of scripts/prepare_data.py, and writes their fp16
# folders to zoo/. Seeds are fixed; on one machine a rerun gives the same weights.
# Needs: a release build, python3 with numpy, and `pip install tokenizers` for the data.
set -euo pipefail
cd "$(dirname "$0")/.."
TF=./target/release/tokenformer
TC=./target/release/tokenformer-convert
RUNS=${RUNS:-runs}
ZOO=${ZOO:-zoo}     # where the fp16 model folders go
mkdir -p "$RUNS" "$ZOO"
[ -f data/kjv/train.jsonl ] || python3 scripts/prepare_data.py --out data kjv digits

# The two sources share width, depth and heads, so `merge` can join them.
python3 - "$RUNS" <<'PY'
import json, random, sys
runs = sys.argv[1]
words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
block = {"hidden_size": 128, "num_layers": 4, "num_heads": 4,
         "qkv_tokens": 128, "proj_tokens": 128, "ffn_tokens": 512,
         "pattention_activation": "l2_norm_gelu"}
lm = {"architecture": "tokenformer-lm", **block, "vocab_size": 2048,
      "max_position_embeddings": 256, "rotary_pct": 0.25, "rotary_base": 10000.0,
      "norm_eps": 1e-05, "eos_token_id": 0, "tie_word_embeddings": True}
vit = {"architecture": "tokenformer-vit", "image_size": 8, "patch_size": 2, "num_channels": 3,
       **block, "num_classes": 10, "pool": "mean", "norm_eps": 1e-06, "crop_pct": 1.0,
       "mean": [0.5] * 3, "std": [0.5] * 3, "class_wnids": words, "class_names": words}
json.dump(lm, open(f"{runs}/lm.json", "w"), indent=1)
json.dump(vit, open(f"{runs}/vit.json", "w"), indent=1)
# The language model reads the Bible plus the training captions as plain text
# (no images), so that the merged model's bridge only has to carry the class.
kjv = open("data/kjv/train.jsonl").readlines()
caps = [json.dumps({"text": json.loads(l)["text"]}) + "\n" for l in open("data/digits/train.jsonl")]
docs = kjv + caps
random.Random(0).shuffle(docs)
open(f"{runs}/lm_train.jsonl", "w").writelines(docs)
PY

$TF train --init "$RUNS/lm.json" --tokenizer data/kjv/tokenizer.json --data "$RUNS/lm_train.jsonl" \
    --val-data data/kjv/val.jsonl --val-windows 32 --out "$RUNS/lm" --steps 1500 --batch-size 16 \
    --seq-len 128 --lr 1e-3 --min-lr 1e-4 --warmup-steps 50 --save-every 500 --eval-every 250 \
    --keep-last 1 --seed 1 --json > "$RUNS/lm.summary.json"
# Digits are not mirror-symmetric and an 8x8 crop of 8 % is a few pixels: milder augmentation.
$TF train --init "$RUNS/vit.json" --data data/digits --out "$RUNS/vit" --steps 800 --batch-size 64 \
    --lr 1e-3 --min-lr 1e-5 --warmup-steps 40 --weight-decay 0.05 --scale 0.6,1 --hflip 0 \
    --save-every 400 --eval-every 100 --val-windows 400 --keep-last 1 --seed 1 --json > "$RUNS/vit.summary.json"

$TC merge --vision "$RUNS/vit/checkpoint-000800" --language "$RUNS/lm/checkpoint-001500" \
    --bridge-tokens 32 --out "$RUNS/vl0" --force
$TF train --model "$RUNS/vl0" --train bridge --data data/digits/train.jsonl --val-data data/digits/val.jsonl \
    --out "$RUNS/vl" --steps 600 --batch-size 32 --lr 3e-3 --min-lr 3e-5 --warmup-steps 30 \
    --weight-decay 0 --save-every 600 --eval-every 100 --keep-last 1 --seed 1 --json > "$RUNS/vl.summary.json"

for pair in "lm/checkpoint-001500 tiny-kjv-lm" "vit/checkpoint-000800 tiny-digits-vit" \
    "vl/checkpoint-000600 tiny-digits-vl"; do
    set -- $pair
    rm -rf "${ZOO:?}/$2"
    python3 scripts/to_fp16.py "$RUNS/$1" "$ZOO/$2"
done
echo "models written to $ZOO/ (caption accuracy: scripts/caption_accuracy.py $ZOO/tiny-digits-vl data/digits/val)"
