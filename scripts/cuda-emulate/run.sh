#!/usr/bin/env bash
# Checks the CUDA kernels' logic on the CPU (no GPU, no CUDA toolkit; g++ 12+):
# builds scripts/cuda-emulate/emulate.cpp once per kernel into target/cuda-emulate
# and runs it four times: in thread order, in reverse (the two with different bytes
# in what no thread wrote), built with ThreadSanitizer for races, and built with
# AddressSanitizer and UndefinedBehaviorSanitizer for accesses out of bounds and
# overflowing index arithmetic. See emulate.cpp for what this does and does not show.
set -euo pipefail
cd "$(dirname "$0")"
out=../../target/cuda-emulate
include="$out/include"
. ./flags.sh
export TSAN_OPTIONS="halt_on_error=1 exitcode=66"
export ASAN_OPTIONS="exitcode=67 detect_leaks=0" UBSAN_OPTIONS="print_stacktrace=1"
# Without address randomisation where it can be turned off: GCC 12's ThreadSanitizer
# does not expect the mappings of kernels that randomise with more than 28 bits.
races() { if setarch -R true 2>/dev/null; then setarch -R "$@"; else "$@"; fi; }
rc=0
# canary WHAT RUNNER BINARY CODE MODE...: each mode but `barrier` must be reported
# (exit CODE), `barrier` must pass (exit 0); RUNNER runs the binary (`races` or `env`).
canary() {
    local what=$1 runner=$2 bin=$3 reported=$4 mode code
    shift 4
    for mode in "$@"; do
        code=0
        "$runner" "$bin" "$mode" >"$bin-$mode.txt" 2>&1 || code=$?
        if [ "$code" != "$([ "$mode" = barrier ] && echo 0 || echo "$reported")" ]; then
            echo "FAILED: the $what check's canary, $mode (exit $code; log: $bin-$mode.txt)"
            rc=1
        fi
    done
}
# First, that the race check notices races (shared memory ordered by a shuffle only;
# two blocks writing one element) and passes what is ordered by a barrier.
g++ "${flags[@]}" "${tsan[@]}" -DCANARY -o "$out/canary" emulate.cpp
canary race races "$out/canary" 66 shuffle blocks barrier
# And that the out-of-bounds check notices a write one element past the output.
g++ "${flags[@]}" "${asan[@]}" -DCANARY -o "$out/canary-asan" emulate.cpp
canary out-of-bounds env "$out/canary-asan" 67 past barrier
# And that the value checks notice shared memory read unwritten and an output left so.
g++ "${flags[@]}" -O2 -DCANARY -o "$out/canary-plain" emulate.cpp
canary unwritten-memory env "$out/canary-plain" 1 unwritten unset barrier
for k in ATTENTION LOGPROB THETA SOFTMAX NORM ADAMW ROTARY; do
    bin="$out/${k,,}"
    # The race check's build, on the other core while the first binary is built.
    g++ "${flags[@]}" "${tsan[@]}" -D"$k" -o "$bin-races" emulate.cpp &
    races_built=$!
    g++ "${flags[@]}" -O2 -D"$k" -o "$bin" emulate.cpp
    # Each block's threads in order and, on the other core, in reverse order (see
    # emulate.cpp's fibers), with NaNs and with huge numbers where nothing was written
    # (its unwritten_byte); the second prints only what fails.
    EMULATE_ORDER=reverse EMULATE_UNWRITTEN=7f "$bin" >"$bin-reverse.txt" 2>&1 &
    reverse=$!
    "$bin" || rc=1
    wait "$reverse" || {
        rc=1
        echo "FAILED in reverse order: $k (log: $bin-reverse.txt)"
        grep -E '^FAIL' "$bin-reverse.txt" | sed 's/^/(reverse order) /'
    }
    wait "$races_built"
    g++ "${flags[@]}" "${asan[@]}" -D"$k" -o "$bin-asan" emulate.cpp &
    asan_built=$!
    # Every access ordered by block barriers alone: the first race is reported and
    # ends the run (the run's own checks pass or fail as above).
    if races "$bin-races" >"$bin-races.txt" 2>&1; then
        echo "$k: no races"
    else
        rc=1
        echo "FAILED under ThreadSanitizer: $k (log: $bin-races.txt)"
        grep -E -A12 '^WARNING: ThreadSanitizer' "$bin-races.txt" || tail -5 "$bin-races.txt"
    fi
    wait "$asan_built"
    # The first access out of bounds or overflow ends the run.
    if "$bin-asan" >"$bin-asan.txt" 2>&1; then
        echo "$k: no access out of bounds"
    else
        rc=1
        echo "FAILED under AddressSanitizer: $k (log: $bin-asan.txt)"
        grep -E -A12 '^==[0-9]+==ERROR|runtime error' "$bin-asan.txt" || tail -5 "$bin-asan.txt"
    fi
done
exit $rc
