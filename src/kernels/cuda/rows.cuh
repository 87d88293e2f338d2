// What the kernels share: loads widening f32, bf16 and f16 to f32 and stores
// rounding back; and, for the row kernels (theta.cu, softmax.cu, norm.cu: one
// thread block a row), a block-wide sum or max.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float load(const float *p, long i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load(const __half *p, long i) { return __half2float(p[i]); }
__device__ __forceinline__ void store(float *p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, long i, float v) { p[i] = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half *p, long i, float v) { p[i] = __float2half(v); }

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

