#!/usr/bin/env bash
# Runs `tokenformer bench` and the PyTorch peer (shared bench/torch_baseline.py,
# same math, random weights) back to back on this machine and prints the ratios.
# With RUNS=n (default 1) it alternates the two n times and prints every run's
# ratio and their median: on a shared host one run can land in a slow phase.
#   pip install torch numpy   # once, from PyPI
#   [RUNS=3] benches/compare.sh [150m] [path/to/torch_baseline.py]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-150m}"
peer="${2:-../shared/bench/torch_baseline.py}"
runs="${RUNS:-1}"
cargo build --release --quiet
sync  # nothing left for the kernel to write back during the timed runs
results=()
for _ in $(seq "$runs"); do
    results+=("$(./target/release/tokenformer bench --config "$model" --json)")
    results+=("$(python3 "$peer" --model "$model")")
done
python3 - "${results[@]}" <<'PY'
import json, statistics, sys
docs = [json.loads(a) for a in sys.argv[1:]]
ours, theirs = docs[0::2], docs[1::2]
num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
shared = sorted(k for k in set(ours[0]) & set(theirs[0])
                if k != "threads" and num(ours[0][k]) and num(theirs[0][k]))
w = 8 * len(ours) + 6
print(f"{'metric':<34}{'tokenformer':>{w}}{'pytorch':>{w}}  ratio")
for k in shared:
    a = [o[k] for o in ours]
    b = [t[k] for t in theirs]
    r = [x / y for x, y in zip(a, b) if y]
    fmt = lambda xs, f: " / ".join(format(x, f) for x in xs)
    line = f"{k:<34}{fmt(a, 'g'):>{w}}{fmt(b, 'g'):>{w}}  {fmt(r, '.2f')}"
    if len(r) > 1:
        line += f"   median {statistics.median(r):.2f}"
    print(line)
for k in sorted(set(ours[0]) - set(theirs[0])):
    print(f"{k:<34}{' / '.join(str(o[k]) for o in ours):>{w}}")
PY
