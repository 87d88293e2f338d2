// LayerNorm without weight and bias over the last axis of contiguous rows [rows, n]
// (f32, bf16 or f16; every sum in f32), one thread block a row
// (crate::kernels::nonparam_norm):
//   layer_norm_*:      y = (x − mean) / √(var + eps), var biased (as torch)
//   layer_norm_grad_*: ∂L/∂x = (dy − mean(dy) − y · mean(dy · y)) / √(var + eps),
//                      from x and dy (y recomputed: no third input), for training
//   add_layer_norm_*:  inference's residual and the norm after it, out [2, rows, n]:
//                      s = x + a rounded to the dtype, then y of the rounded s
#include "rows.cuh"

// The row's mean and 1 / √(var + eps), the variance from a second pass over the
// centred values (more accurate than E[x²] − mean²).
template <typename T>
__device__ float2 row_moments(const T *x, int n, float eps) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += load(x, i);
    const float mean = block_reduce<false>(s) / n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float c = load(x, i) - mean;
        ss += c * c;
    }
    const float var = block_reduce<false>(ss) / n;
    return make_float2(mean, 1.0f / sqrtf(var + eps));
}

template <typename T>
__device__ void layer_norm_row(const T *in, T *out, int n, float eps) {
    const long row = (long)blockIdx.x * n;
    const T *x = in + row;
    T *y = out + row;
    const float2 m = row_moments(x, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) store(y, i, (load(x, i) - m.x) * m.y);
}

template <typename T>
__device__ void layer_norm_grad_row(const T *in, const T *grad, T *out, int n, float eps) {
    const long row = (long)blockIdx.x * n;
    const T *x = in + row, *dy = grad + row;
    T *dx = out + row;
    const float2 m = row_moments(x, n, eps);
    float a = 0.0f, b = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float g = load(dy, i);
        a += g;
        b += g * (load(x, i) - m.x) * m.y;
    }
    a = block_reduce<false>(a) / n;
    b = block_reduce<false>(b) / n;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        store(dx, i, m.y * (load(dy, i) - a - (load(x, i) - m.x) * m.y * b));
}

// One block a row, so the rows are gridDim.x. Each thread reads back only the sums it
// wrote itself (row_moments and the last loop stride over the row as the first loop
// does), so no barrier is needed first.
template <typename T>
__device__ void add_layer_norm_row(const T *in, const T *add, T *out, int n, float eps) {
    const long row = (long)blockIdx.x * n;
    T *s = out + row, *y = out + (long)gridDim.x * n + row;
    for (int i = threadIdx.x; i < n; i += blockDim.x) store(s, i, load(in + row, i) + load(add + row, i));
    const float2 m = row_moments(s, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) store(y, i, (load(s, i) - m.x) * m.y);
}

#define ADD_LAYER_NORM(NAME, T)                                                          \
    extern "C" __global__ void NAME(const T *x, const T *a, T *out, int n, float eps) { \
        add_layer_norm_row(x, a, out, n, eps);                                          \
    }
ADD_LAYER_NORM(add_layer_norm_f32, float)
ADD_LAYER_NORM(add_layer_norm_bf16, __nv_bfloat16)
ADD_LAYER_NORM(add_layer_norm_f16, __half)

extern "C" __global__ void layer_norm_f32(const float *x, float *y, int n, float eps) {
    layer_norm_row(x, y, n, eps);
}
extern "C" __global__ void layer_norm_bf16(const __nv_bfloat16 *x, __nv_bfloat16 *y, int n, float eps) {
    layer_norm_row(x, y, n, eps);
}
extern "C" __global__ void layer_norm_f16(const __half *x, __half *y, int n, float eps) {
    layer_norm_row(x, y, n, eps);
}
extern "C" __global__ void layer_norm_grad_f32(const float *x, const float *dy, float *dx, int n, float eps) {
    layer_norm_grad_row(x, dy, dx, n, eps);
}
extern "C" __global__ void layer_norm_grad_bf16(const __nv_bfloat16 *x, const __nv_bfloat16 *dy, __nv_bfloat16 *dx,
                                                int n, float eps) {
    layer_norm_grad_row(x, dy, dx, n, eps);
}
extern "C" __global__ void layer_norm_grad_f16(const __half *x, const __half *dy, __half *dx, int n, float eps) {
    layer_norm_grad_row(x, dy, dx, n, eps);
}
