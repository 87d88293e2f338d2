#!/usr/bin/env bash
# The unit tests and the model, precision and training tests under AddressSanitizer,
# on each CPU kernel path this host has (avx512, avx2, portable): an out-of-bounds
# read or write in the `unsafe` SIMD kernels fails the run, where it could otherwise
# read a neighbour's bytes and pass. Needs a nightly toolchain (`-Zsanitizer`);
# builds into target/asan (about 17 minutes on 2 cores, then about 6 to run). Not run
# by CI, which has no nightly; run it after changing a kernel's indexing.
set -euo pipefail
cd "$(dirname "$0")/.."
target=x86_64-unknown-linux-gnu
tests=(lm precision train train_vit vision vl)
export CARGO_TARGET_DIR=target/asan RUSTFLAGS="-Zsanitizer=address"
# --target keeps the sanitizer off build scripts and proc macros.
cargo +nightly test --release --target "$target" --lib "${tests[@]/#/--test=}" --no-run
# Leaks are not what this is for (models are kept for the process's life).
export ASAN_OPTIONS=detect_leaks=0
rc=0
for isa in $(grep -q avx512f /proc/cpuinfo && echo avx512) $(grep -q avx2 /proc/cpuinfo && echo avx2) portable; do
    export TOKENFORMER_KERNELS=$isa
    # The allocator test counts page faults, which AddressSanitizer's quarantine changes.
    cargo +nightly test --release --target "$target" --lib -- --skip freed_blocks_are_reused || rc=1
    for t in "${tests[@]}"; do
        cargo +nightly test --release --target "$target" --test "$t" || rc=1
    done
done
exit $rc
