# The emulator's compiler flags, for run.sh and barriers.sh (sourced; $include: a
# folder with empty cuda_bf16.h and cuda_fp16.h, whose types, conversions and
# mma.sync are emulate.cpp's own).
emulate_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$include"
touch "$include/cuda_bf16.h" "$include/cuda_fp16.h"
# The kernels read 16-bit pairs as 32-bit words, as CUDA code does (hence no strict
# aliasing). A section per static, and shared.ld to gather the kernels' shared arrays
# (see emulate.cpp's "Kernels in an unnamed namespace").
flags=(-std=c++20 -fno-strict-aliasing -I"$include" -fdata-sections -Wl,-T,"$emulate_dir/shared.ld")
tsan=(-O1 -g -fsanitize=thread -DEMULATE_RACES)
# (AddressSanitizer leaves a variable with a section attribute out unless told.)
asan=(-O1 -g -fsanitize=address,undefined -fsanitize-sections=.bss.emu_shared -fno-sanitize-recover=undefined
    -DEMULATE_ASAN)
