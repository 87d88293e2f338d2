#!/usr/bin/env bash
# Runs `tokenformer bench` and the PyTorch peer (shared bench/torch_baseline.py,
# same math, random weights) back to back on this machine and prints the ratios.
#   pip install torch numpy   # once, from PyPI
#   benches/compare.sh [150m] [path/to/torch_baseline.py]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-150m}"
peer="${2:-../shared/bench/torch_baseline.py}"
cargo build --release --quiet
ours=$(./target/release/tokenformer bench --config "$model" --json)
theirs=$(python3 "$peer" --model "$model")
python3 - "$ours" "$theirs" <<'PY'
import json, sys
ours, theirs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"{'metric':<34}{'tokenformer':>14}{'pytorch':>12}{'ratio':>8}")
for k in sorted(set(ours) & set(theirs)):
    a, b = ours[k], theirs[k]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b and k != "threads":
        print(f"{k:<34}{a:>14}{b:>12}{a / b:>8.2f}")
for k in sorted(set(ours) - set(theirs)):
    print(f"{k:<34}{ours[k]!s:>14}")
PY
