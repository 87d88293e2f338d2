// GPT-NeoX rotary positions (rotate-half) for inference, queries and keys in one
// launch (crate::kernels::rotary::rotary_heads): x [n, b, h, t, hd], each head's
// features contiguous and the other strides free, into a contiguous y of that shape;
// row t is at position offset + t of the cos/sin tables [positions, dims / 2]; each
// head's first `dims` features are rotated half against half and the rest copied.
// The arithmetic is f32 whatever the dtype, each product and difference rounded on
// its own (no fused multiply-add), as the CPU computes it, so f32 gives its bits.
#include "rows.cuh"

template <typename T>
__device__ void rotary_heads(const T *x, T *y, const float *cos, const float *sin, int b, int h, int t, int hd,
                             int dims, int offset, long s0, long s1, long s2, long s3, long total) {
    const int half = dims / 2;
    const long step = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int j = i % hd;
        long r = i / hd;
        const int tt = r % t;
        r /= t;
        const int hh = r % h;
        r /= h;
        const T *row = x + (r / b) * s0 + (r % b) * s1 + hh * s2 + tt * s3;
        const long pos = (long)(offset + tt) * half;
        float v;
        if (j < half) {
            v = __fsub_rn(__fmul_rn(load(row, j), cos[pos + j]), __fmul_rn(load(row, j + half), sin[pos + j]));
        } else if (j < dims) {
            const int f = j - half;
            v = __fadd_rn(__fmul_rn(load(row, j), cos[pos + f]), __fmul_rn(load(row, f), sin[pos + f]));
        } else {
            v = load(row, j);
        }
        store(y, i, v);
    }
}

#define ROTARY_KERNEL(NAME, T)                                                                                     \
    extern "C" __global__ void NAME(const T *x, T *y, const float *cos, const float *sin, int b, int h, int t, \
                                    int hd, int dims, int offset, long s0, long s1, long s2, long s3,        \
                                    long total) {                                                             \
        rotary_heads(x, y, cos, sin, b, h, t, hd, dims, offset, s0, s1, s2, s3, total);                       \
    }
ROTARY_KERNEL(rotary_heads_f32, float)
ROTARY_KERNEL(rotary_heads_bf16, __nv_bfloat16)
ROTARY_KERNEL(rotary_heads_f16, __half)
