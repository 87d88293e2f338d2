#!/usr/bin/env bash
# Checks the CUDA kernels' logic on the CPU (no GPU, no CUDA toolkit; g++ 12+):
# builds scripts/cuda-emulate/emulate.cpp once per kernel into target/cuda-emulate
# and runs it. See emulate.cpp for what this does and does not show.
set -euo pipefail
cd "$(dirname "$0")"
out=../../target/cuda-emulate
mkdir -p "$out/include"
# The CUDA headers' types, conversions and mma.sync are emulate.cpp's own; the kernels
# read 16-bit pairs as 32-bit words, as CUDA code does (hence no strict aliasing).
touch "$out/include/cuda_bf16.h" "$out/include/cuda_fp16.h"
rc=0
for k in ATTENTION LOGPROB THETA SOFTMAX NORM ADAMW ROTARY; do
    g++ -std=c++20 -O2 -fno-strict-aliasing -I"$out/include" -D"$k" -o "$out/${k,,}" emulate.cpp
    # Each block's threads in order and, on the other core, in reverse order (see
    # emulate.cpp's fibers); the second prints only what fails.
    EMULATE_ORDER=reverse "$out/${k,,}" >"$out/${k,,}-reverse.txt" 2>&1 &
    reverse=$!
    "$out/${k,,}" || rc=1
    wait "$reverse" || {
        rc=1
        echo "FAILED in reverse order: $k (log: $out/${k,,}-reverse.txt)"
        grep -E '^FAIL' "$out/${k,,}-reverse.txt" | sed 's/^/(reverse order) /'
    }
done
exit $rc
