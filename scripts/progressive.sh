#!/usr/bin/env bash
# Progressive scaling at toy scale (the paper's Figure 1 shape): a small
# TokenFormer LM trained from scratch on the KJV data, grown twice (parameter
# tokens doubled each time) and trained on after each growth, with the √n
# constants kept (`--scale keep`) or grown (`--scale grow`); the largest size
# trained from scratch for as many steps is the baseline. A constant learning
# rate after warm-up, so a resumed run's schedule does not depend on its length.
# Writes $RUNS/progressive/{*.jsonl,summary.json} and docs/progressive.png.
# Needs a release build, the data of scripts/prepare_data.py, and matplotlib.
set -euo pipefail
cd "$(dirname "$0")/.."
TF=./target/release/tokenformer
TC=./target/release/tokenformer-convert
OUT=${RUNS:-runs}/progressive
PHASE=${PHASE:-300}          # steps per phase; three phases
mkdir -p "$OUT"
[ -f data/kjv/train.jsonl ] || python3 scripts/prepare_data.py --out data kjv

python3 - "$OUT" <<'PY'
import json, sys
base = {"architecture": "tokenformer-lm", "hidden_size": 128, "num_layers": 4, "num_heads": 4,
        "vocab_size": 2048, "max_position_embeddings": 256, "rotary_pct": 0.25,
        "rotary_base": 10000.0, "norm_eps": 1e-05, "pattention_activation": "l2_norm_gelu",
        "eos_token_id": 0, "tie_word_embeddings": True}
for name, (qkv, ffn) in {"small": (32, 128), "large": (128, 512)}.items():
    json.dump({**base, "qkv_tokens": qkv, "proj_tokens": qkv, "ffn_tokens": ffn},
              open(f"{sys.argv[1]}/{name}.json", "w"), indent=1)
PY

COMMON=(--data data/kjv/train.jsonl --val-data data/kjv/val.jsonl --val-windows 32 --batch-size 8
        --seq-len 128 --lr 1e-3 --min-lr 1e-3 --warmup-steps 20 --eval-every 100 --seed 7)
ckpt() { printf '%s/checkpoint-%06d' "$1" "$2"; }

# Baseline: the large model from scratch, 3 phases' worth of steps.
[ -f "$OUT/scratch.summary.json" ] && [ -s "$OUT/scratch.summary.json" ] || $TF train --init "$OUT/large.json" --tokenizer data/kjv/tokenizer.json "${COMMON[@]}" \
    --steps $((3 * PHASE)) --save-every $((3 * PHASE)) --out "$OUT/scratch" --json > "$OUT/scratch.summary.json"

# Small from scratch, shared by both growth rules.
[ -f "$OUT/small.summary.json" ] && [ -s "$OUT/small.summary.json" ] || $TF train --init "$OUT/small.json" --tokenizer data/kjv/tokenizer.json "${COMMON[@]}" \
    --steps "$PHASE" --save-every "$PHASE" --out "$OUT/small" --json > "$OUT/small.summary.json"

for scale in keep grow; do
    prev=$(ckpt "$OUT/small" "$PHASE")
    for i in 1 2; do
        qkv=$((32 << i)); ffn=$((128 << i)); steps=$(((i + 1) * PHASE))
        $TC grow --model "$prev" --out "$OUT/$scale-g$i" --qkv-tokens $qkv --proj-tokens $qkv \
            --ffn-tokens $ffn --scale $scale --force
        $TF train --resume "$prev" --model "$OUT/$scale-g$i" --data data/kjv/train.jsonl \
            --val-data data/kjv/val.jsonl --val-windows 32 --eval-every 100 --steps $steps --save-every $PHASE \
            --out "$OUT/$scale-run$i" --json > "$OUT/$scale-run$i.summary.json"
        prev=$(ckpt "$OUT/$scale-run$i" $steps)
    done
done

python3 - "$OUT" <<'PY'
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
out = sys.argv[1]
def rows(*names):
    r = []
    for n in names:
        r += [json.loads(l) for l in open(f"{out}/{n}/metrics.jsonl")]
    return [x for x in r if "val_loss" in x]
runs = {
    "large from scratch": rows("scratch"),
    "grown, scale keep": rows("small", "keep-run1", "keep-run2"),
    "grown, scale grow": rows("small", "grow-run1", "grow-run2"),
}
summary = {}
plt.figure(figsize=(7, 4.2))
for label, r in runs.items():
    plt.plot([x["flops"] for x in r], [x["val_loss"] for x in r], marker="o", ms=3, label=label)
    summary[label] = {"final_val_loss": r[-1]["val_loss"], "flops": r[-1]["flops"], "steps": r[-1]["step"]}
plt.xlabel("training FLOPs")
plt.ylabel("validation loss (KJV, held-out chapters)")
plt.title("Progressive scaling at toy scale")
plt.grid(alpha=0.3)
plt.legend()
plt.tight_layout()
plt.savefig("docs/progressive.png", dpi=110)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
