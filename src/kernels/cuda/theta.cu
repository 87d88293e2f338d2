// Θ, Pattention's normalised non-linearity, over the last axis of contiguous
// scores [rows, n]: one thread block a row, every sum in f32 whatever the
// scores' dtype (f32, bf16 or f16), the result written in the scores' dtype.
//   act 0, l2_norm_gelu:  GELU(s / max(‖s‖₂, 1e-30) · scale)          scale = √n
//   act 1, gelu_l2_norm:  GELU(s) / max(‖GELU(s)‖₂, 1e-30) · scale     scale = √n
//   act 2, softmax:       exp(s − max s) / Σ exp(s − max s) · scale     scale = n
// The same definitions as crate::kernels::theta::theta (the tests compare them).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float load(const float *p, long i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load(const __half *p, long i) { return __half2float(p[i]); }
__device__ __forceinline__ void store(float *p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, long i, float v) { p[i] = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half *p, long i, float v) { p[i] = __float2half(v); }

// Exact (erf) GELU, as torch's default.
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
}

// The sum (max: the maximum) of v over the block, returned to every thread.
template <bool MAX>
__device__ float block_reduce(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads(); // an earlier call's readers are done with part[]
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        v = lane < warps ? part[lane] : (MAX ? -INFINITY : 0.0f);
        for (int o = 16; o > 0; o >>= 1) {
            float w = __shfl_xor_sync(0xffffffffu, v, o);
            v = MAX ? fmaxf(v, w) : v + w;
        }
        if (lane == 0) part[0] = v;
    }
    __syncthreads();
    return part[0];
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

extern "C" __global__ void theta_f32(const float *in, float *out, int n, float scale, int act) {
    theta_row(in, out, n, scale, act);
}
extern "C" __global__ void theta_bf16(const __nv_bfloat16 *in, __nv_bfloat16 *out, int n, float scale, int act) {
    theta_row(in, out, n, scale, act);
}
extern "C" __global__ void theta_f16(const __half *in, __half *out, int n, float scale, int act) {
    theta_row(in, out, n, scale, act);
}
