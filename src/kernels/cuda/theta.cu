// Θ, Pattention's normalised non-linearity, over the last axis of contiguous
// scores [rows, n]: one thread block a row, every sum in f32 whatever the
// scores' dtype (f32, bf16 or f16), the result written in the scores' dtype.
//   act 0, l2_norm_gelu:  GELU(s / max(‖s‖₂, 1e-30) · scale)          scale = √n
//   act 1, gelu_l2_norm:  GELU(s) / max(‖GELU(s)‖₂, 1e-30) · scale     scale = √n
//   act 2, softmax:       exp(s − max s) / Σ exp(s − max s) · scale     scale = n
// The same definitions as crate::kernels::theta::theta (the tests compare them).
// theta_grad_*: act 0's backward for training (crate::train::theta's, on the GPU).
#include "rows.cuh"

// Exact (erf) GELU, as torch's default.
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
}

template <typename T>
__device__ void theta_row(const T *in, T *out, int n, float scale, int act) {
    const long row = (long)blockIdx.x * n;
    const T *x = in + row;
    T *y = out + row;
    if (act == 2) {
        float m = -INFINITY;
        for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, load(x, i));
        m = block_reduce<true>(m);
        float s = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += expf(load(x, i) - m);
        const float f = scale / block_reduce<false>(s);
        for (int i = threadIdx.x; i < n; i += blockDim.x) store(y, i, expf(load(x, i) - m) * f);
        return;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = act == 0 ? load(x, i) : gelu(load(x, i));
        ss += v * v;
    }
    const float f = scale / fmaxf(sqrtf(block_reduce<false>(ss)), 1e-30f);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = load(x, i);
        store(y, i, act == 0 ? gelu(v * f) : gelu(v) * f);
    }
}

// GELU′(u) = Φ(u) + u·φ(u).
__device__ __forceinline__ float gelu_grad(float u) {
    return 0.5f * (1.0f + erff(u * 0.70710678118654752440f)) + u * expf(-0.5f * u * u) * 0.39894228040143267794f;
}

// ∂L/∂s of act 0 for one row, from the scores s and ∂L/∂Θ dy. With r = ‖s‖,
// f = scale / max(r, 1e-30), u = f·s and g = dy·GELU′(u):
//   ∂L/∂s = f·(g − s·(s·g)/r²)   (f·g where r ≤ 1e-30: the clamped norm is a constant).
// g is computed twice (for s·g, then for the output) rather than kept, so rows of
// any length need no shared memory.
template <typename T>
__device__ void theta_grad_row(const T *in, const T *grad, T *out, int n, float scale) {
    const long row = (long)blockIdx.x * n;
    const T *s = in + row, *dy = grad + row;
    T *ds = out + row;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = load(s, i);
        ss += v * v;
    }
    const float r = sqrtf(block_reduce<false>(ss));
    const float f = scale / fmaxf(r, 1e-30f);
    float dot = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = load(s, i);
        dot += v * load(dy, i) * gelu_grad(v * f);
    }
    dot = block_reduce<false>(dot);
    // dot / r / r, not dot / (r·r): r² underflows for rows of tiny scores.
    const float proj = r > 1e-30f ? dot / r / r : 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = load(s, i);
        store(ds, i, f * (load(dy, i) * gelu_grad(v * f) - v * proj));
    }
}

extern "C" __global__ void theta_f32(const float *in, float *out, int n, float scale, int act) {
    theta_row(in, out, n, scale, act);
}
extern "C" __global__ void theta_bf16(const __nv_bfloat16 *in, __nv_bfloat16 *out, int n, float scale, int act) {
    theta_row(in, out, n, scale, act);
}
extern "C" __global__ void theta_f16(const __half *in, __half *out, int n, float scale, int act) {
    theta_row(in, out, n, scale, act);
}
extern "C" __global__ void theta_grad_f32(const float *s, const float *dy, float *ds, int n, float scale) {
    theta_grad_row(s, dy, ds, n, scale);
}
extern "C" __global__ void theta_grad_bf16(const __nv_bfloat16 *s, const __nv_bfloat16 *dy, __nv_bfloat16 *ds, int n,
                                           float scale) {
    theta_grad_row(s, dy, ds, n, scale);
}
extern "C" __global__ void theta_grad_f16(const __half *s, const __half *dy, __half *ds, int n, float scale) {
    theta_grad_row(s, dy, ds, n, scale);
}
