// AdamW's two in-place passes on a GPU (`train/optim.rs`), f32: the moments, then the
// variable, one launch each per tensor instead of a dozen element-wise candle ops. The
// arithmetic is the CPU's, operation for operation, in IEEE round-to-nearest intrinsics
// (no fused multiply-adds), so a step on the GPU gives the CPU's bits.
//   moment: m ← β·m + (1 − β)·g, or v ← β·v + (1 − β)·g·g (`square`)
//   apply:  θ ← θ·(1 − lr·decay) − m / (√v / √bc2 + eps) · lr/bc1
// Grid-stride loops over n elements (the caller offsets the pointers past frozen rows).

extern "C" __global__ void adamw_moment(float *m, const float *g, long n, float b, float c, int square) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float gi = square ? __fmul_rn(g[i], g[i]) : g[i];
        m[i] = __fadd_rn(__fmul_rn(m[i], b), __fmul_rn(gi, c));
    }
}

extern "C" __global__ void adamw_apply(float *theta, const float *m, const float *v, long n, float keep,
                                       float sbc2, float eps, float step) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v[i]), sbc2), eps);
        theta[i] = __fsub_rn(__fmul_rn(theta[i], keep), __fmul_rn(__fdiv_rn(m[i], denom), step));
    }
}
