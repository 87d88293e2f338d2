#!/usr/bin/env bash
# Checks that the emulator (emulate.cpp) notices each barrier of the CUDA kernels:
# removes every `__syncthreads();` in src/kernels/cuda in turn, in a copy of the
# kernels, runs the kernel files that include it in both thread orders, and prints
# how many checks fail each way. Exits 1 if some barrier's removal goes unnoticed.
# With RACES=1 it runs the race check instead (run.sh's ThreadSanitizer build) and
# says whether ThreadSanitizer reports a race (it stops at the first).
# Not run by CI (about 15 minutes on 2 cores either way); run it after adding or
# moving a barrier.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$root/target/cuda-emulate/barriers"
rm -rf "$work"
mkdir -p "$work/scripts/cuda-emulate" "$work/src/kernels"
cp "$here/emulate.cpp" "$work/scripts/cuda-emulate/"
cp -r "$root/src/kernels/cuda" "$work/src/kernels/"
include="$work/include"
. "$here/flags.sh"
# The kernel files (run.sh's names) that compile each source.
users() {
    case "$1" in
        rows.cuh) echo THETA SOFTMAX NORM ;;
        *.cu) basename "$1" .cu | tr '[:lower:]' '[:upper:]' ;;
    esac
}
missed=0
while IFS=: read -r file line text; do
    name="$(basename "$file")"
    src="$work/src/kernels/cuda/$name"
    sed -i "${line}s|__syncthreads();|/* removed */|" "$src"
    result=""
    caught=0
    for k in $(users "$name"); do
        if [ "${RACES:-0}" = 1 ]; then
            (cd "$work/scripts/cuda-emulate" &&
                g++ "${flags[@]}" "${tsan[@]}" -D"$k" -o "$work/run" emulate.cpp)
            # The first report ends the run: the rest would only take time.
            # Without address randomisation, as run.sh runs it.
            races=$(TSAN_OPTIONS=halt_on_error=1 timeout 600 setarch -R "$work/run" 2>&1 |
                grep -c '^WARNING: ThreadSanitizer: data race' || true)
            result+=" $k: $races race(s) reported;"
            if [ "$races" -gt 0 ]; then caught=1; fi
            continue
        fi
        (cd "$work/scripts/cuda-emulate" &&
            g++ "${flags[@]}" -O2 -D"$k" -o "$work/run" emulate.cpp)
        fwd=$(timeout 600 "$work/run" 2>&1 | grep -c '^FAIL' || true)
        rev=$(EMULATE_ORDER=reverse EMULATE_UNWRITTEN=7f timeout 600 "$work/run" 2>&1 | grep -c '^FAIL' || true)
        result+=" $k: $fwd in order, $rev reversed;"
        if [ "$fwd" -gt 0 ] || [ "$rev" -gt 0 ]; then caught=1; fi
    done
    cp "$root/src/kernels/cuda/$name" "$src"
    echo "$name:$line (${text#"${text%%[![:space:]]*}"}):$result"
    [ "$caught" = 1 ] || { missed=1; echo "  NOT NOTICED: $name:$line"; }
done < <(grep -n '__syncthreads();' "$root"/src/kernels/cuda/*.cu "$root"/src/kernels/cuda/*.cuh)
exit $missed
