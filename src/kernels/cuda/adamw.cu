// AdamW's in-place passes on a GPU (`train/optim/in_place/cuda.rs`), f32: the moments,
// then the variable, one launch each per tensor instead of a dozen element-wise candle
// ops (and below, all of a step's tensors in one launch, with gradient clipping's two).
// The arithmetic is the CPU's, operation for operation, in IEEE round-to-nearest
// intrinsics (no fused multiply-adds), so a step on the GPU gives the CPU's bits.
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

// The multi-tensor forms, one launch for all of a step's tensors instead of one or three
// each (`step_all`, `sum_sq_all` and `scaled_all` in train/optim/in_place/cuda.rs):
// `table` lists pieces of up to 65,536 elements, one block a piece, each as device
// addresses and a count in 64-bit words. The arithmetic per element is that of the
// passes above and of the CPU.

// AdamW, both moments and the variable in one pass: piece p = (θ, m, v, g, n, keep's
// bits); the constants as `adamw_moment` and `adamw_apply` take them.
extern "C" __global__ void adamw_step_multi(const unsigned long long *table, float b1, float c1, float b2,
                                            float c2, float sbc2, float eps, float step) {
    const unsigned long long *p = table + 6L * blockIdx.x;
    float *theta = (float *)p[0], *m = (float *)p[1], *v = (float *)p[2];
    const float *g = (const float *)p[3];
    const long n = (long)p[4];
    const float keep = __int_as_float((int)p[5]);
    for (long i = threadIdx.x; i < n; i += blockDim.x) {
        const float gi = g[i];
        const float mi = __fadd_rn(__fmul_rn(m[i], b1), __fmul_rn(gi, c1));
        const float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(gi, gi), c2));
        m[i] = mi;
        v[i] = vi;
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), sbc2), eps);
        theta[i] = __fsub_rn(__fmul_rn(theta[i], keep), __fmul_rn(__fdiv_rn(mi, denom), step));
    }
}

// Σ x² of each piece (x, n), widened to f64, into partial[p]: the caller adds the pieces'
// sums in order. The order within a piece is fixed (by thread, then a tree), so the sum is
// the same on every run.
extern "C" __global__ void sum_sq_multi(const unsigned long long *table, double *partial) {
    const unsigned long long *p = table + 2L * blockIdx.x;
    const float *x = (const float *)p[0];
    const long n = (long)p[1];
    double s = 0.0;
    for (long i = threadIdx.x; i < n; i += blockDim.x) {
        const double xi = x[i];
        s += xi * xi;
    }
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < (int)(blockDim.x + 31) >> 5; ++w) t += part[w];
        partial[blockIdx.x] = t;
    }
}

// dst = src · k in f32 (gradient clipping's scale): piece p = (src, dst, n).
extern "C" __global__ void scale_multi(const unsigned long long *table, float k) {
    const unsigned long long *p = table + 3L * blockIdx.x;
    const float *src = (const float *)p[0];
    float *dst = (float *)p[1];
    const long n = (long)p[2];
    for (long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = __fmul_rn(src[i], k);
}
