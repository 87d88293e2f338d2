// Training attention's softmax over the last axis of contiguous scores
// [.., queries, n] (f32, bf16 or f16; sums and exponentials in f32), forward and
// backward, one thread block a row (crate::kernels::masked_softmax):
//   softmax_*:      y = softmax(scale · s); with causal != 0, row r is query
//                   q = r mod queries and sees keys 0 ..= q + (n − queries), y = 0
//                   after them (what adding the −∞ causal mask first gives); a row
//                   whose seen scores are all −∞ gives zeros
//   softmax_grad_*: ∂L/∂s = scale · y · (dy − Σ y·dy) from y and dy (0 where y is)
#include "rows.cuh"

template <typename T>
__device__ void softmax_row(const T *in, T *out, int n, float scale, int queries, int causal) {
    const long row = (long)blockIdx.x * n;
    const T *s = in + row;
    T *y = out + row;
    // The last key the row sees (n − queries ≥ 0: the host checks).
    const int last = causal ? (int)(blockIdx.x % (unsigned)queries) + (n - queries) : n - 1;
    float m = -INFINITY;
    for (int i = threadIdx.x; i <= last; i += blockDim.x) m = fmaxf(m, scale * load(s, i));
    m = block_reduce<true>(m);
    if (m == -INFINITY) {  // nothing seen (every score −∞): zeros, as the CPU's rows give
        for (int i = threadIdx.x; i < n; i += blockDim.x) store(y, i, 0.0f);
        return;  // m is the whole block's: every thread returns here
    }
    float z = 0.0f;
    for (int i = threadIdx.x; i <= last; i += blockDim.x) z += expf(scale * load(s, i) - m);
    const float inv = 1.0f / block_reduce<false>(z);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        store(y, i, i <= last ? expf(scale * load(s, i) - m) * inv : 0.0f);
}

template <typename T>
__device__ void softmax_grad_row(const T *probs, const T *grad, T *out, int n, float scale) {
    const long row = (long)blockIdx.x * n;
    const T *y = probs + row, *dy = grad + row;
    T *ds = out + row;
    float dot = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) dot += load(y, i) * load(dy, i);
    dot = block_reduce<false>(dot);
    for (int i = threadIdx.x; i < n; i += blockDim.x) store(ds, i, scale * load(y, i) * (load(dy, i) - dot));
}

extern "C" __global__ void softmax_f32(const float *s, float *y, int n, float scale, int queries, int causal) {
    softmax_row(s, y, n, scale, queries, causal);
}
extern "C" __global__ void softmax_bf16(const __nv_bfloat16 *s, __nv_bfloat16 *y, int n, float scale, int queries,
                                        int causal) {
    softmax_row(s, y, n, scale, queries, causal);
}
extern "C" __global__ void softmax_f16(const __half *s, __half *y, int n, float scale, int queries, int causal) {
    softmax_row(s, y, n, scale, queries, causal);
}
extern "C" __global__ void softmax_grad_f32(const float *y, const float *dy, float *ds, int n, float scale) {
    softmax_grad_row(y, dy, ds, n, scale);
}
extern "C" __global__ void softmax_grad_bf16(const __nv_bfloat16 *y, const __nv_bfloat16 *dy, __nv_bfloat16 *ds,
                                             int n, float scale) {
    softmax_grad_row(y, dy, ds, n, scale);
}
extern "C" __global__ void softmax_grad_f16(const __half *y, const __half *dy, __half *ds, int n, float scale) {
    softmax_grad_row(y, dy, ds, n, scale);
}
