// Scoring's reductions over logits rows [n, vocab] in one read of each row:
// log p(target) = (x[target] − max) − log Σ exp(x − max), the row's
// log-sum-exp, and its first argmax (the lowest index holding the maximum, as
// torch's argmax), all in f32 whatever the logits' dtype (f32, bf16, f16).
// No log-softmax tensor is written. One block a row; each thread keeps an
// online (max, Σ exp(x − max), first index of max) over its strided elements,
// then the block merges the triples. Output [n, 3] f32: log p, lse, argmax
// (as a float: exact below 2^24, which the host checks).
// logprob_grad_*: the backward for training's cross-entropy: with per-row
// coefficients (a, b, lse) [n, 3] f32, ∂L/∂x = a · exp(x − lse) − b · one-hot(target)
// (a = ∂L/∂lse − ∂L/∂log p, b = −∂L/∂log p: crate::kernels::logprob), in the
// logits' dtype.
#include "rows.cuh"
#include <limits.h>

struct Acc {
    float m;   // maximum so far (−inf: nothing above −inf seen)
    float s;   // Σ exp(x − m); NaN once a NaN was seen, so it reaches lse
    int idx;   // first index holding m; INT_MAX: none
};

__device__ __forceinline__ Acc merge(Acc a, Acc b) {
    Acc r;
    r.idx = (b.m > a.m || (b.m == a.m && b.idx < a.idx)) ? b.idx : a.idx;
    r.m = fmaxf(a.m, b.m);
    // Both empty: exp(−inf − −inf) would be NaN; their sums are 0.
    r.s = r.m == -INFINITY ? a.s + b.s : a.s * expf(a.m - r.m) + b.s * expf(b.m - r.m);
    return r;
}

__device__ __forceinline__ Acc shfl(Acc a, int o) {
    Acc r;
    r.m = __shfl_xor_sync(0xffffffffu, a.m, o);
    r.s = __shfl_xor_sync(0xffffffffu, a.s, o);
    r.idx = __shfl_xor_sync(0xffffffffu, a.idx, o);
    return r;
}

template <typename T>
__device__ __forceinline__ void logprob_row(const T *logits, const unsigned int *targets, float *out,
                                            int vocab) {
    __shared__ Acc part[32];
    const T *x = logits + (long)blockIdx.x * vocab;
    Acc a = {-INFINITY, 0.0f, INT_MAX};
    // Increasing indices per thread: a strict > keeps the first of tied maxima.
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = load(x, i);
        if (v > a.m) {
            a.s = a.s * expf(a.m - v) + 1.0f;
            a.m = v;
            a.idx = i;
        } else if (v != -INFINITY) {
            a.s += expf(v - a.m); // NaN stays NaN
        }
    }
    for (int o = 16; o > 0; o >>= 1) a = merge(a, shfl(a, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = a;
    __syncthreads();
    if (warp != 0) return;
    const int warps = (blockDim.x + 31) >> 5;
    a = lane < warps ? part[lane] : Acc{-INFINITY, 0.0f, INT_MAX};
    for (int o = 16; o > 0; o >>= 1) a = merge(a, shfl(a, o));
    if (lane != 0) return;
    const float log_s = logf(a.s);
    const unsigned int target = targets[blockIdx.x];
    float *y = out + (long)blockIdx.x * 3;
    // Subtracting the max first keeps the target's log p exact for large logits.
    y[0] = target < (unsigned int)vocab ? (load(x, target) - a.m) - log_s : __int_as_float(0x7fc00000);
    y[1] = a.m + log_s;
    y[2] = a.idx == INT_MAX ? 0.0f : (float)a.idx;
}

extern "C" __global__ void logprob_f32(const float *logits, const unsigned int *targets, float *out, int vocab) {
    logprob_row(logits, targets, out, vocab);
}
extern "C" __global__ void logprob_bf16(const __nv_bfloat16 *logits, const unsigned int *targets, float *out, int vocab) {
    logprob_row(logits, targets, out, vocab);
}
extern "C" __global__ void logprob_f16(const __half *logits, const unsigned int *targets, float *out, int vocab) {
    logprob_row(logits, targets, out, vocab);
}

template <typename T>
__device__ __forceinline__ void logprob_grad_row(const T *logits, const unsigned int *targets, const float *coef,
                                                 T *out, int vocab) {
    const long row = (long)blockIdx.x * vocab;
    const float *c = coef + 3L * blockIdx.x;
    const float a = c[0], b = c[1], lse = c[2];
    const unsigned int target = targets[blockIdx.x];
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float p = expf(load(logits + row, i) - lse);
        store(out + row, i, a * p - ((unsigned int)i == target ? b : 0.0f));
    }
}

extern "C" __global__ void logprob_grad_f32(const float *logits, const unsigned int *targets, const float *coef,
                                            float *out, int vocab) {
    logprob_grad_row(logits, targets, coef, out, vocab);
}
extern "C" __global__ void logprob_grad_bf16(const __nv_bfloat16 *logits, const unsigned int *targets,
                                             const float *coef, __nv_bfloat16 *out, int vocab) {
    logprob_grad_row(logits, targets, coef, out, vocab);
}
extern "C" __global__ void logprob_grad_f16(const __half *logits, const unsigned int *targets, const float *coef,
                                            __half *out, int vocab) {
    logprob_grad_row(logits, targets, coef, out, vocab);
}
