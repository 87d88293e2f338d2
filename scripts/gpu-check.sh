#!/usr/bin/env bash
# The GPU checks of the `--device cuda` and GPU-speed issues, in two halves.
#
# Here (no GPU, no system CUDA; 14 minutes on a fresh checkout on 2 cores):
#   bash scripts/gpu-check.sh [TOOLCHAIN_DIR]
# builds the `cuda` feature with the wheel toolchain (scripts/setup-cuda-toolchain.sh,
# installed into TOOLCHAIN_DIR, default ~/.cache/cuda-toolchain, if missing) in
# target/cuda, and lays out target/gpu-check/ (under 64 MiB, the device tool's carry
# limit): the `tokenformer` binary and GPU test binary (tests/gpu.rs) without debug info, xz-packed;
# the PyTorch anchors of ../shared/gpu and ../shared/bench; run.sh.
#
# On the GPU machine (device tool: carry ["target/gpu-check"]), from the checkout's root:
#   DEADLINE=400 bash target/gpu-check/run.sh [--compile]
# prints the GPU, runs the GPU tests with the project's CUDA kernels
# (TOKENFORMER_CUDA_KERNELS=1) and without, then `tokenformer bench --device cuda` with
# them and eager PyTorch's anchor on the same card (and its pieces beside `ops`,
# scripts/torch_ops_anchor.py), then the bench without them and the
# A/B runs (--compile: also torch.compile's anchor, ~2 more minutes), each test and bench
# part in a process of its own; past DEADLINE seconds nothing new starts. The device
# returns at most 8 files: everything is packed into $OUT/results.tgz after each step
# (a temporary folder without $OUT), so a call cut short still returns what it did.
set -euo pipefail
cd "$(dirname "$0")/.."
toolchain="${1:-$HOME/.cache/cuda-toolchain}"
shared="${SHARED:-../shared}"
# The toolchain's driver stub is generated from cudarc's source: it must be fetched first.
cargo fetch --quiet
[ -f "$toolchain/env.sh" ] || bash scripts/setup-cuda-toolchain.sh "$toolchain"
# shellcheck disable=SC1091
. "$toolchain/env.sh"
export CARGO_TARGET_DIR=target/cuda
cargo build --release --features cuda --bin tokenformer
log="$(mktemp)"
if ! cargo test --release --features cuda --test gpu --no-run >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
tests="$(sed -n 's/.*Executable tests\/gpu.rs (\(.*\))/\1/p' "$log")"
[ -x "$tests" ] || { cat "$log" >&2; echo "error: no GPU test binary was built" >&2; exit 1; }

out=target/gpu-check
rm -rf "$out" && mkdir -p "$out/bin" "$out/gpu" "$out/bench"
# Debug info goes, the symbols stay (1.4 MB packed): a failing test's backtrace then
# names its functions.
strip --strip-debug -o "$out/bin/tokenformer" target/cuda/release/tokenformer
strip --strip-debug -o "$out/bin/gpu-tests" "$tests"
xz -T0 -6 "$out/bin/tokenformer" "$out/bin/gpu-tests"
if [ -d "$shared/gpu" ]; then
    cp "$shared/gpu/run-on-gpu.sh" "$shared/gpu/torch_gpu_anchor.py" \
        "$shared/gpu/torch_compile_anchor.py" "$out/gpu/"
    cp "$shared/bench/torch_baseline.py" "$shared/bench/torch_train_baseline.py" "$out/bench/"
    cp scripts/torch_ops_anchor.py "$out/gpu/"
else
    echo "warning: $shared/gpu not found: no PyTorch anchors in the carry folder" >&2
fi

cat >"$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# Runs on the GPU machine from the checkout's root (see scripts/gpu-check.sh).
# Env: KERNEL_RUNS ("1 0": with the project's CUDA kernels, then without), AB (1: the
# A/B runs), ANCHOR (1: eager PyTorch's anchor), TEST_TIMEOUT / PART_TIMEOUT (seconds
# for one test / one bench part), DEADLINE (seconds after which nothing new starts),
# RERUNS (3: the first failing tests of each run, time-outs aside, again with
# CUDA_LAUNCH_BLOCKING=1 and backtraces, each into rerun-TAG-NAME.txt), SANITIZE (a
# test-name filter, e.g. `attention`: those GPU tests again under compute-sanitizer's
# memcheck, racecheck and synccheck, first of all; unset: none).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# The device tool returns at most 8 files from $OUT: everything is written to $res and
# packed into $OUT/results.tgz after each step, so a run cut short returns what it did.
out="${OUT:-$(mktemp -d)}"
res="$(mktemp -d)"
bin="$(mktemp -d)"
mkdir -p "$out"
echo "results in $out/results.tgz"
pack() { tar czf "$out/.results.tgz" -C "$res" . && mv "$out/.results.tgz" "$out/results.tgz"; }
for b in tokenformer gpu-tests; do
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$here/bin/$b.xz" "$bin/$b"
    chmod +x "$bin/$b"
done
# The CUDA libraries of the torch venv and the driver's libcuda, as run-on-gpu.sh finds
# them, found once rather than by running it for every process.
venv="${TORCH_VENV:-/opt/torch/.venv}"
LD_LIBRARY_PATH="$(bash "$here/gpu/run-on-gpu.sh" /usr/bin/printenv LD_LIBRARY_PATH)"
export LD_LIBRARY_PATH
ldd "$bin/tokenformer" | grep 'not found' && echo "error: unresolved libraries above"
run() { timeout -k 5 "$@"; }
# The driver compiles the PTX for this GPU once and keeps it here for every later process.
export CUDA_CACHE_PATH="$bin/nv-cache" CUDA_CACHE_MAXSIZE=4294967296
export TOKENFORMER_TEST_ROOT="$root" TOKENFORMER_BIN="$bin/tokenformer"
test_timeout="${TEST_TIMEOUT:-150}" part_timeout="${PART_TIMEOUT:-240}"
left() { [ "$SECONDS" -lt "${DEADLINE:-1000000}" ]; }
# Every GPU test and every bench part runs in a process of its own: a faulting kernel
# leaves its CUDA context unusable, and must not take the checks after it down with it.
tests() {  # tests TAG [FILTER]: the GPU tests (matching FILTER), one process each
    local log="$res/gpu-tests-$1.txt" pass=0 fail=0 name t0 rc
    : >"$log"
    while read -r name; do
        left || { echo "skipped (DEADLINE): $name"; continue; }
        echo "== $name" >>"$log"
        t0=$SECONDS
        if run "$test_timeout" "$bin/gpu-tests" --exact "$name" --nocapture >>"$log" 2>&1; then
            pass=$((pass + 1)); echo "ok ($((SECONDS - t0)) s): $name"
        else
            rc=$?
            fail=$((fail + 1)); echo "FAILED ($((SECONDS - t0)) s): $name"
            # The failure's own lines, so that the call's output shows them.
            awk -v n="== $name" '$0 == n {p = 1; next} /^== / {p = 0} p' "$log" |
                grep -v '^running\|^test result\|^$' | tail -15
            # The first failures once more with every launch synchronous and backtraces on,
            # so that an asynchronous CUDA error is reported at the launch that caused it
            # (not after a time-out: a hang would only spend the time again).
            if [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && [ "$fail" -le "${RERUNS:-3}" ] && left; then
                CUDA_LAUNCH_BLOCKING=1 RUST_BACKTRACE=1 TOKENFORMER_BACKTRACE=1 \
                    run "$test_timeout" "$bin/gpu-tests" --exact "$name" --nocapture \
                    >"$res/rerun-$1-$name.txt" 2>&1
                echo "  rerun, launches synchronous: rc=$? (rerun-$1-$name.txt)"
            fi
        fi
        pack
    done < <("$bin/gpu-tests" --list --format terse ${2:+"$2"} | sed -n 's/: test$//p')
    # A test that finds no GPU says so and passes: count those apart.
    echo "GPU tests ($1): $pass passed ($(grep -c '^skipped' "$log") lines say skipped), $fail failed" |
        tee -a "$log"
}
# The parts of `bench --device cuda` (bench_gpu::PARTS), merged into bench-TAG.json.
bench() {  # bench TAG PART...
    local tag=$1 part t0; shift
    for part in "$@"; do
        left || { echo "skipped (DEADLINE): bench $tag $part"; continue; }
        t0=$SECONDS
        run "$part_timeout" "$bin/tokenformer" bench --device cuda --only "$part" --json \
            >"$res/bench-$tag-$part.json" 2>"$res/bench-$tag-$part.err"
        echo "bench $tag $part: rc=$? ($((SECONDS - t0)) s)"; tail -3 "$res/bench-$tag-$part.err"
        pack
    done
    python3 - "$res" "$tag" "$@" <<'PY'
import json, sys
res, tag, parts = sys.argv[1], sys.argv[2], sys.argv[3:]
merged = {}
for p in parts:
    try:
        merged.update(json.load(open(f"{res}/bench-{tag}-{p}.json")))
    except (OSError, ValueError) as e:
        merged[f"{p}_error"] = f"no JSON from the {p} part: {e}"
json.dump(merged, open(f"{res}/bench-{tag}.json", "w"), indent=1)
print(json.dumps(merged))
PY
    pack
}
all_parts="prefill ops decode vit train"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$res/gpu.txt"
# The GPU tests first, with the project's own CUDA kernels (TOKENFORMER_CUDA_KERNELS=1:
# Θ, flash attention, on tensor cores in bf16/f16 forward and backward,
# log-softmax-gather, the norms, decoding's fused q/k/v and rotary, the training kernels;
# the kernel tests call them directly either way) and with plain candle ops (the
# default); then the bench with the kernels and eager PyTorch's anchor on the same card,
# so that the figures the issues compare come next; then the bench with plain ops and
# the A/B runs. Past DEADLINE seconds no new test or part starts.
runs="${KERNEL_RUNS:-1 0}"
py="$venv/bin/python"
if [ -n "${SANITIZE:-}" ]; then
    # After a kernel test fails: out-of-bounds accesses, shared-memory races and
    # barrier misuse, as the GPU itself sees them.
    cs="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)"
    for tool in memcheck racecheck synccheck; do
        [ -n "$cs" ] || { echo "no compute-sanitizer on this machine"; break; }
        echo "== compute-sanitizer --tool $tool, tests matching $SANITIZE"
        log="$res/sanitize-$tool.txt"
        while read -r name; do
            left || break
            TOKENFORMER_CUDA_KERNELS=1 run "$test_timeout" "$cs" --tool "$tool" --error-exitcode 1 \
                "$bin/gpu-tests" --exact "$name" --nocapture >>"$log" 2>&1
            echo "$tool rc=$?: $name"
            pack
        done < <("$bin/gpu-tests" --list --format terse "$SANITIZE" | sed -n 's/: test$//p')
        grep -m5 'ERROR SUMMARY: [1-9]\|Invalid\|Race reported\|Barrier error' "$log"
    done
fi
for kernels in $runs; do
    echo "== GPU tests, TOKENFORMER_CUDA_KERNELS=$kernels"
    TOKENFORMER_CUDA_KERNELS=$kernels tests "kernels$kernels"
done
anchor_done=0
[ "${ANCHOR:-1}" = 1 ] || anchor_done=1
for kernels in $runs; do
    echo "== bench --device cuda, TOKENFORMER_CUDA_KERNELS=$kernels"
    # shellcheck disable=SC2086
    TOKENFORMER_CUDA_KERNELS=$kernels bench "kernels$kernels" $all_parts
    if [ "$anchor_done" = 0 ] && left; then
        echo "== eager PyTorch anchor"
        run 300 "$py" "$here/gpu/torch_gpu_anchor.py" >"$res/torch.json" 2>"$res/torch.err"
        cat "$res/torch.json"; tail -3 "$res/torch.err"
        pack
        # The same pieces as `bench --only ops`, in PyTorch, with each SDPA backend
        # (FlashAttention-2 among them) timed alone.
        if left; then
            echo "== eager PyTorch, piece by piece"
            run 200 "$py" "$here/gpu/torch_ops_anchor.py" >"$res/torch-ops.json" 2>"$res/torch-ops.err"
            cat "$res/torch-ops.json"; tail -3 "$res/torch-ops.err"
            pack
        fi
        anchor_done=1
    fi
done
if [[ " $runs " == *" 1 "* ]] && [ "${AB:-1}" = 1 ]; then
    # Decoding with one block a head instead of the split over keys, to compare with the
    # first bench's decode figures.
    echo "== bench --only decode, TOKENFORMER_FLASH_SPLIT=0"
    TOKENFORMER_FLASH_SPLIT=0 TOKENFORMER_CUDA_KERNELS=1 bench no-split decode
    # The SIMT attention instead of the tensor-core one (bf16/f16, forward and backward):
    # its tests, and the prefill and training figures to compare with the first bench.
    echo "== attention tests and bench --only prefill,train, TOKENFORMER_FLASH_TC=0"
    TOKENFORMER_FLASH_TC=0 TOKENFORMER_CUDA_KERNELS=1 tests simt-attention attention
    TOKENFORMER_FLASH_TC=0 TOKENFORMER_CUDA_KERNELS=1 bench simt-attention prefill train
    # Training with each block composed from the ops instead of one node with its
    # backward written out (`train/device_block.rs`), to compare with the first bench.
    echo "== bench --only train, TOKENFORMER_DEVICE_BLOCK=0"
    TOKENFORMER_DEVICE_BLOCK=0 TOKENFORMER_CUDA_KERNELS=1 bench composed-blocks train
fi
if [ "${1:-}" = "--compile" ] && left; then
    echo "== torch.compile anchor"
    run 400 "$py" "$here/gpu/torch_compile_anchor.py" >"$res/torch-compile.json" 2>"$res/torch-compile.err"
    cat "$res/torch-compile.json"
    pack
fi
EOF
chmod +x "$out/run.sh"
du -sh "$out"
size=$(du -sb "$out" | cut -f1)
[ "$size" -lt $((64 << 20)) ] || { echo "error: $out is over the 64 MiB carry limit" >&2; exit 1; }
echo "carry $out, then on the GPU machine: bash $out/run.sh"
