#!/usr/bin/env bash
# Runs `tokenformer bench` and the PyTorch peer (shared bench/torch_baseline.py,
# same math, random weights) back to back on this machine and prints the ratios,
# then the issue-21 targets with their medians.
# With RUNS=n (default 1) it alternates the two n times and prints every run's
# ratio and their median: on a shared host one run can land in a slow phase.
# ISA=avx2 (or avx512, portable) forces the instruction set of both sides, so an
# AVX-512 machine measures what an AVX2-only one would: ours through
# TOKENFORMER_KERNELS, PyTorch's through ATEN_CPU_CAPABILITY (its own kernels),
# MKL_ENABLE_INSTRUCTIONS (its gemm) and ONEDNN_MAX_CPU_ISA.
#   pip install torch numpy   # once, from PyPI
#   [RUNS=3] [ISA=avx2] benches/compare.sh [150m] [path/to/torch_baseline.py]
#   [RUNS=3] benches/compare.sh train [path/to/torch_train_baseline.py]   # training
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-150m}"
peer="${2:-../shared/bench/torch_baseline.py}"
runs="${RUNS:-1}"
case "${ISA:-}" in
    "") ;;
    avx2) export TOKENFORMER_KERNELS=avx2 ATEN_CPU_CAPABILITY=avx2 \
              MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
    avx512) export TOKENFORMER_KERNELS=avx512 ATEN_CPU_CAPABILITY=avx512 ;;
    portable) export TOKENFORMER_KERNELS=portable ATEN_CPU_CAPABILITY=default \
                  MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 ;;
    *) echo "ISA must be avx2, avx512 or portable" >&2; exit 2 ;;
esac
cargo build --release --quiet
sync  # nothing left for the kernel to write back during the timed runs
if [ "$model" = train ]; then
    # Training: `bench --only train` against the shared training peer (small LM
    # tokens/s, tiny ViT images/s), alternating RUNS times; ratios and their medians.
    peer="${2:-../shared/bench/torch_train_baseline.py}"
    results=()
    for _ in $(seq "$runs"); do
        results+=("$(./target/release/tokenformer bench --only train --json)")
        results+=("$(python3 "$peer" --model small)")
    done
    python3 - "${results[@]}" <<'PY'
import json, statistics, sys
docs = [json.loads(a) for a in sys.argv[1:]]
ours, theirs = docs[0::2], docs[1::2]
print(f"PyTorch {theirs[0].get('torch', '?')} with {theirs[0].get('threads', '?')} threads, "
      f"{len(ours)} alternating run(s)")
for k in ("train_lm_tokens_per_s", "train_vit_images_per_s"):
    a, b = [o[k] for o in ours], [t[k] for t in theirs]
    r = [x / y for x, y in zip(a, b) if y]
    print(f"{k:<26} tokenformer {' / '.join(map(str, a))}  pytorch {' / '.join(map(str, b))}"
          f"  ratio {' / '.join(f'{x:.2f}' for x in r)}  median {statistics.median(r):.2f}"
          f"  (target >= 1.0, goal 1.5)")
for k in ("train_lm_peak_rss_mb", "train_vit_peak_rss_mb"):
    print(f"{k:<26} {' / '.join(str(o.get(k)) for o in ours)}")
PY
    exit 0
fi
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
fmt = lambda xs, f: " / ".join(format(x, f) for x in xs)
cpu = ours[0].get("cpu", {})
print(f"host: {cpu.get('model', '?')}, features {'+'.join(cpu.get('features', []))}, "
      f"kernels {cpu.get('kernels', '?')} (asked: {cpu.get('kernels_requested', '?')}), "
      f"PyTorch {theirs[0].get('torch', '?')} with {theirs[0].get('threads', '?')} threads")
if cpu.get("kernels_warning"):
    print(f"warning: {cpu['kernels_warning']}")
shared = sorted(k for k in set(ours[0]) & set(theirs[0])
                if k != "threads" and num(ours[0][k]) and num(theirs[0][k]))
w = 8 * len(ours) + 6
print(f"{'metric':<34}{'tokenformer':>{w}}{'pytorch':>{w}}  ratio")
ratios = {}
for k in shared:
    a = [o[k] for o in ours]
    b = [t[k] for t in theirs]
    r = [x / y for x, y in zip(a, b) if y]
    ratios[k] = r
    line = f"{k:<34}{fmt(a, 'g'):>{w}}{fmt(b, 'g'):>{w}}  {fmt(r, '.2f')}"
    if len(r) > 1:
        line += f"   median {statistics.median(r):.2f}"
    print(line)
for k in sorted(set(ours[0]) - set(theirs[0]) - {"cpu"}):
    print(f"{k:<34}{' / '.join(str(o.get(k)) for o in ours):>{w}}")

def own(k, base=None):
    """Per run: our metric k, or its ratio to our metric base."""
    v = [o.get(k) for o in ours]
    if base:
        v = [x / o[base] if num(x) and o.get(base) else None for x, o in zip(v, ours)]
    return [x for x in v if num(x)]

print("\ntargets (issue 21), medians of the runs above:")
rows = [(f"{k} vs PyTorch", ratios.get(k, []), ">=", 1.2) for k in
        ("prefill_b1_s2048_tokens_per_s", "prefill_b4_s512_tokens_per_s",
         "decode_tokens_per_s", "vit_b16_images_per_s")]
rows += [
    ("f32 decode, fraction of bandwidth limit", own("decode_fraction_of_limit"), ">=", 0.9),
    ("f16-weight decode vs our f32 decode", own("decode_f16_weights_tokens_per_s", "decode_tokens_per_s"), ">=", 1.7),
    ("q8 decode vs our f32 decode", own("decode_q8_weights_tokens_per_s", "decode_tokens_per_s"), ">=", 2.5),
    ("q8 perplexity change, %", [abs(x) for x in own("q8_perplexity_change_percent")], "<=", 1.0),
    ("f16 weights + f16 KV cache vs our f32 decode", own("decode_f16_weights_f16_kv_tokens_per_s", "decode_tokens_per_s"), ">=", 1.7),
    ("f16 KV cache perplexity change, %", [abs(x) for x in own("kv_f16_perplexity_change_percent")], "<=", 0.1),
]
for name, vals, op, goal in rows:
    if not vals:
        print(f"  {name:<42} not measured")
        continue
    m = statistics.median(vals)
    ok = m >= goal if op == ">=" else m <= goal
    print(f"  {name:<42} {fmt(vals, '.2f'):<22} median {m:.2f} {op} {goal}  {'ok' if ok else 'MISSED'}")
PY
