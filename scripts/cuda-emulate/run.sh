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
    g++ -std=c++20 -O2 -fno-strict-aliasing -pthread -I"$out/include" -D"$k" -o "$out/${k,,}" emulate.cpp
    "$out/${k,,}" || rc=1
done
exit $rc
