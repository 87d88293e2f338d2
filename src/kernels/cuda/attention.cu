// Flash-style attention on a GPU: softmax(q·kᵀ·scale)·v per (batch, head) with an
// online softmax over tiles of keys, so no [queries, keys] score tensor is ever in
// memory, and its backward (FlashAttention-2's scheme: the probabilities recomputed
// tile by tile from each query row's log-sum-exp, which the forward writes).
//
// q [b, h, t, hd], k and v [b, h, keys, hd] are read through their strides (the
// model's head-split views need no copy); only each row's features must be
// contiguous. The output is written straight into [b, t, h·hd], the layout the
// output projection takes. Causal: query i (of the last t) sees keys
// 0..=past+i, past = keys − t (a KV cache or a prefix counts as the past).
// f32, bf16 and f16 inputs; products, softmax and accumulation in f32.
//
// A block of 128 threads takes 32 queries (the backward's ∂k, ∂v kernel: 32 keys);
// each row is shared by 4 adjacent lanes, lane `sub` keeping features sub, sub+4, …
// of the row and of its accumulators in registers. A tile of the other side's rows
// is staged in shared memory as f32; each dot product is 4 partial sums added
// across the 4 lanes by two shuffles, which leaves every lane of the row with the
// whole sum, so nothing per pair goes through shared memory. SIMT only (no tensor
// cores): first kernels whose numbers the GPU session checks before they are made
// fast.
#include "rows.cuh"


#define THREADS 128
#define LANES 4                 // lanes per query
#define ROWS (THREADS / LANES)  // queries per block

// A row's features held by lane `sub` of its 4 (sub, sub+4, …) into registers as f32,
// zero past hd or for a padding row (not `live`); and back, times `mul`.
template <typename T, int PER>
__device__ __forceinline__ void load_row(float *r, const T *row, bool live, int sub, int hd) {
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const int c = sub + e * LANES;
        r[e] = (live && c < hd) ? load(row, c) : 0.0f;
    }
}
template <typename T, int PER>
__device__ __forceinline__ void store_row(T *row, const float *r, float mul, int sub, int hd) {
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const int c = sub + e * LANES;
        if (c < hd) store(row, c, r[e] * mul);
    }
}

// Keys and values j0 .. j0 + BK (zero from kend on, and past hd) into the block's f32
// tiles, between barriers: the previous tile's readers are done before it is written,
// and every thread sees it whole after.
template <typename T, int MAXD, int BK>
__device__ __forceinline__ void kv_tile(float (*kt)[MAXD], float (*vt)[MAXD], const T *kb, const T *vb,
                                        long ks2, long vs2, int j0, int kend, int hd) {
    __syncthreads();
    for (int i = threadIdx.x; i < BK * MAXD; i += THREADS) {
        const int j = i / MAXD, c = i % MAXD;
        const int key = j0 + j;
        const bool in = key < kend && c < hd;
        kt[j][c] = in ? load(kb + key * ks2, c) : 0.0f;
        vt[j][c] = in ? load(vb + key * vs2, c) : 0.0f;
    }
    __syncthreads();
}

// The online softmax of a block's query rows over keys jbeg .. jend (jend clipped to
// what the block's last query sees): each row's running max m, Σ exp l and
// unnormalised output o (lane `sub`'s features) carried on from earlier keys.
template <typename T, int MAXD, int BK>
__device__ __forceinline__ void attend_keys(float (*kt)[MAXD], float (*vt)[MAXD], const T *kb, const T *vb,
                                            long ks2, long vs2, const float *qr, float *o, float &m, float &l,
                                            int jbeg, int jend, int hd, int causal, int past, int qi,
                                            float scale, int sub) {
    constexpr int PER = MAXD / LANES;
    for (int j0 = jbeg; j0 < jend; j0 += BK) {
        kv_tile<T, MAXD, BK>(kt, vt, kb, vb, ks2, vs2, j0, jend, hd);

        float s[BK];
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < BK; ++j) {
            float part = 0.0f;
#pragma unroll
            for (int e = 0; e < PER; ++e) part = fmaf(qr[e], kt[j][sub + e * LANES], part);
            // The 4 lanes of a row are adjacent: xor 1 and 2 stay inside the group,
            // and every lane ends with the same (commutative) sum.
            part += __shfl_xor_sync(0xffffffffu, part, 1);
            part += __shfl_xor_sync(0xffffffffu, part, 2);
            const int key = j0 + j;
            const bool seen = key < jend && (!causal || key <= past + qi);
            s[j] = seen ? part * scale : -INFINITY;
            tile_max = fmaxf(tile_max, s[j]);
        }
        const float m_new = fmaxf(m, tile_max);
        // Nothing seen yet (only padding rows): exp(−inf − −inf) would be NaN.
        if (m_new == -INFINITY) continue;
        const float alpha = expf(m - m_new); // 0 on the first seen tile (m = −inf)
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < BK; ++j) {
            s[j] = expf(s[j] - m_new); // masked: exp(−inf) = 0
            sum += s[j];
        }
        l = l * alpha + sum;
        m = m_new;
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            float acc = o[e] * alpha;
#pragma unroll
            for (int j = 0; j < BK; ++j) acc = fmaf(s[j], vt[j][sub + e * LANES], acc);
            o[e] = acc;
        }
    }
}

// MAXD: the largest head size the instance takes; BK: keys per tile, chosen so
// that the K and V tiles are 32 KiB of static shared memory together. lse, when not
// null, receives each query row's log Σ exp(scaled scores), [b, t, h] in f32.
//
// With `po` not null, decoding's split over keys (FlashDecoding) instead: with one
// block of queries a head (t ≤ ROWS) there are too few blocks to fill the GPU, so
// block (c, head, batch) takes keys c·chunk .. (c + 1)·chunk and writes each row's
// unnormalised output, max and Σ exp as f32 partials, po [chunks, b, t, h, hd] and
// pml [chunks, b, t, h, 2], which flash_combine_* merges. A row that sees no key of a
// chunk (causal) leaves o = 0, m = −inf, l = 0 there, which the merge weighs by 0.
// One kernel for both, so the tile loop's unrolled code is not in the PTX twice.
template <typename T, int MAXD, int BK>
__device__ __forceinline__ void flash_rows(
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ out,
    float *__restrict__ lse, float *__restrict__ po, float *__restrict__ pml, int chunk, int heads, int t,
    int keys, int hd, int causal, float scale, long qs0, long qs1, long qs2, long ks0, long ks1, long ks2,
    long vs0, long vs1, long vs2) {
    constexpr int PER = MAXD / LANES;
    __shared__ float kt[BK][MAXD];
    __shared__ float vt[BK][MAXD];
    const int bi = blockIdx.z, hi = blockIdx.y;
    const bool split = po != nullptr;
    const int q0 = split ? 0 : blockIdx.x * ROWS;
    const int row = threadIdx.x / LANES, sub = threadIdx.x % LANES;
    const int qi = q0 + row;
    // Rows past t (the last block's padding) compute on zeros and store nothing;
    // they still take part in every shuffle and barrier.
    const bool live = qi < t;
    const int past = keys - t;

    float qr[PER], o[PER] = {};
    load_row<T, PER>(qr, q + bi * qs0 + hi * qs1 + (long)(live ? qi : 0) * qs2, live, sub, hd);
    float m = -INFINITY, l = 0.0f;
    // Causal: no query of this block sees a key after its last query's position.
    const int kend = causal ? min(keys, past + min(t, q0 + ROWS)) : keys;
    const int jbeg = split ? blockIdx.x * chunk : 0;
    const int jend = split ? min(kend, jbeg + chunk) : kend;
    const T *kb = k + bi * ks0 + hi * ks1;
    const T *vb = v + bi * vs0 + hi * vs1;

    attend_keys<T, MAXD, BK>(kt, vt, kb, vb, ks2, vs2, qr, o, m, l, jbeg, jend, hd, causal, past, qi, scale,
                             sub);
    if (!live) return;
    if (split) {
        const long r = (((long)blockIdx.x * gridDim.z + bi) * t + qi) * heads + hi;
        store_row<float, PER>(po + r * hd, o, 1.0f, sub, hd);
        if (sub == 0) {
            pml[2 * r] = m;
            pml[2 * r + 1] = l;
        }
        return;
    }
    // Every live row saw key 0 (causal: past + qi ≥ 0), so l ≥ 1.
    if (lse != nullptr && sub == 0) lse[((long)bi * t + qi) * heads + hi] = m + logf(l);
    store_row<T, PER>(out + (((long)bi * t + qi) * heads + hi) * hd, o, 1.0f / l, sub, hd);
}

#define FLASH(NAME, T, MAXD, BK)                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                   \
        const T *q, const T *k, const T *v, T *out, float *lse, float *po, float *pml, int chunk, \
        int heads, int t, int keys, int hd, int causal, float scale, long qs0, long qs1,          \
        long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {                   \
        flash_rows<T, MAXD, BK>(q, k, v, out, lse, po, pml, chunk, heads, t, keys, hd, causal,    \
                                scale, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2);              \
    }

FLASH(flash_attention_f32_d64, float, 64, 64)
FLASH(flash_attention_f32_d128, float, 128, 32)
FLASH(flash_attention_f32_d256, float, 256, 16)
FLASH(flash_attention_bf16_d64, __nv_bfloat16, 64, 64)
FLASH(flash_attention_bf16_d128, __nv_bfloat16, 128, 32)
FLASH(flash_attention_bf16_d256, __nv_bfloat16, 256, 16)
FLASH(flash_attention_f16_d64, __half, 64, 64)
FLASH(flash_attention_f16_d128, __half, 128, 32)
FLASH(flash_attention_f16_d256, __half, 256, 16)

// out [b, t, h·hd] and lse [b, t, h] (rows = b·t·h) from `chunks` partials:
// M = max m_c, L = Σ l_c·e^(m_c − M), o = Σ o_c·e^(m_c − M) / L; a thread a feature.
template <typename T>
__device__ __forceinline__ void flash_combine(const float *po, const float *pml, T *out, float *lse, int chunks,
                                              long rows, int hd) {
    const long step = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * hd; i += step) {
        const long r = i / hd;
        float mx = -INFINITY;
        for (int c = 0; c < chunks; ++c) mx = fmaxf(mx, pml[2 * (c * rows + r)]);
        float sum = 0.0f, acc = 0.0f;
        for (int c = 0; c < chunks; ++c) {
            const long p = c * rows + r;
            const float w = expf(pml[2 * p] - mx); // 0 for a chunk the row saw nothing of
            sum += pml[2 * p + 1] * w;
            acc += po[p * hd + i % hd] * w;
        }
        store(out, i, acc / sum);
        if (i % hd == 0) lse[r] = mx + logf(sum);
    }
}

#define FLASH_COMBINE(NAME, T)                                                                   \
    extern "C" __global__ void flash_combine_##NAME(const float *po, const float *pml, T *out,  \
                                                    float *lse, int chunks, long rows, int hd) { \
        flash_combine(po, pml, out, lse, chunks, rows, hd);                                      \
    }
FLASH_COMBINE(f32, float)
FLASH_COMBINE(bf16, __nv_bfloat16)
FLASH_COMBINE(f16, __half)

// The forward on tensor cores, for bf16 and f16 (head sizes up to 64 or 128; the SIMT
// kernel above takes the rest): q·kᵀ and p·v as 16×16×16 WMMA products with f32
// accumulators. A WMMA accumulator's layout is opaque, so it cannot be rescaled row by
// row as the one-pass online softmax needs; instead the keys are read twice. The first
// pass finds each query row's max m and l = Σ exp(s − m) of its scaled scores, the
// second adds exp(s − m)/l · v, whose weights are final, into the accumulators. That
// computes q·kᵀ twice (1.5× the products of one pass), on units ~16× faster than
// SIMT FMAs. The weights p are rounded to T for the tensor cores, as FlashAttention does.
// A block of 4 warps takes 64 queries (16 a warp); tiles of TK keys. Each warp's
// scores go through its own shared-memory slab, where two lanes a row apply the
// scale, the causal mask and the softmax.
#include <mma.h>

#define TC_WARPS 4
#define TC_ROWS (16 * TC_WARPS)
#define TK 32

template <typename T, int HD>
__device__ __forceinline__ void flash_tc_rows(
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ out,
    float *__restrict__ lse, int heads, int t, int keys, int hd, int causal, float scale, long qs0,
    long qs1, long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {
    using namespace nvcuda;
    constexpr int NF = HD / 16; // 16-wide slices of the features
    __shared__ __align__(32) T qt[TC_ROWS][HD];
    __shared__ __align__(32) T kt[TK][HD];
    __shared__ __align__(32) T vt[TK][HD];
    __shared__ __align__(32) float st[TC_WARPS][16][TK];
    __shared__ __align__(32) T pt[TC_WARPS][16][TK];
    const int bi = blockIdx.z, hi = blockIdx.y;
    const int q0 = blockIdx.x * TC_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int past = keys - t;

    // The block's queries, zero past t and past hd (zeros add nothing to a product).
    const T *qb = q + bi * qs0 + hi * qs1;
    for (int i = threadIdx.x; i < TC_ROWS * HD; i += THREADS) {
        const int r = i / HD, c = i % HD, qi = q0 + r;
        store(&qt[r][0], c, (qi < t && c < hd) ? load(qb + qi * qs2, c) : 0.0f);
    }
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) wmma::load_matrix_sync(qf[f], &qt[warp * 16][f * 16], HD);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> of[NF];
#pragma unroll
    for (int f = 0; f < NF; ++f) wmma::fill_fragment(of[f], 0.0f);

    // Lane `lane` takes columns half·TK/2 .. of the warp's row lane/2.
    const int row = lane / 2, half = lane % 2;
    const int qi = q0 + warp * 16 + row;
    const bool live = qi < t;
    const int kend = causal ? min(keys, past + min(t, q0 + TC_ROWS)) : keys;
    const T *kb = k + bi * ks0 + hi * ks1;
    const T *vb = v + bi * vs0 + hi * vs1;
    float m = -INFINITY, l = 0.0f, inv = 0.0f;

    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) {
            // The two lanes of a row merge their maxima and sums.
            const float m2 = __shfl_xor_sync(0xffffffffu, m, 1);
            const float l2 = __shfl_xor_sync(0xffffffffu, l, 1);
            const float mm = fmaxf(m, m2);
            l = (m == -INFINITY ? 0.0f : l * expf(m - mm)) + (m2 == -INFINITY ? 0.0f : l2 * expf(m2 - mm));
            m = mm;
            inv = l > 0.0f ? 1.0f / l : 0.0f; // 0 only on padding rows
        }
        for (int j0 = 0; j0 < kend; j0 += TK) {
            __syncthreads(); // the previous tile's readers are done
            for (int i = threadIdx.x; i < TK * HD; i += THREADS) {
                const int j = i / HD, c = i % HD, key = j0 + j;
                const bool in = key < kend && c < hd;
                store(&kt[j][0], c, in ? load(kb + key * ks2, c) : 0.0f);
                if (pass == 1) store(&vt[j][0], c, in ? load(vb + key * vs2, c) : 0.0f);
            }
            __syncthreads();
#pragma unroll
            for (int n = 0; n < TK / 16; ++n) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> sf;
                wmma::fill_fragment(sf, 0.0f);
#pragma unroll
                for (int f = 0; f < NF; ++f) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
                    wmma::load_matrix_sync(kf, &kt[n * 16][f * 16], HD);
                    wmma::mma_sync(sf, qf[f], kf, sf);
                }
                wmma::store_matrix_sync(&st[warp][0][n * 16], sf, TK, wmma::mem_row_major);
            }
            __syncwarp();
            for (int c = half * (TK / 2); c < (half + 1) * (TK / 2); ++c) {
                const int key = j0 + c;
                const bool seen = live && key < kend && (!causal || key <= past + qi);
                const float s = st[warp][row][c] * scale;
                if (pass == 0) {
                    if (seen) {
                        if (s > m) {
                            l = l * expf(m - s) + 1.0f; // exp(−inf) = 0 on the first
                            m = s;
                        } else {
                            l += expf(s - m);
                        }
                    }
                } else {
                    store(&pt[warp][row][0], c, seen ? expf(s - m) * inv : 0.0f);
                }
            }
            if (pass == 1) {
                __syncwarp();
#pragma unroll
                for (int kk = 0; kk < TK / 16; ++kk) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf;
                    wmma::load_matrix_sync(pf, &pt[warp][0][kk * 16], TK);
#pragma unroll
                    for (int f = 0; f < NF; ++f) {
                        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
                        wmma::load_matrix_sync(vf, &vt[kk * 16][f * 16], HD);
                        wmma::mma_sync(of[f], pf, vf, of[f]);
                    }
                }
            }
            __syncwarp(); // st and pt are written again by the next tile
        }
    }
    if (live && half == 0 && lse != nullptr) lse[((long)bi * t + qi) * heads + hi] = m + logf(l);
    // The output, a 16×16 slice at a time through the warp's slab.
#pragma unroll
    for (int f = 0; f < NF; ++f) {
        wmma::store_matrix_sync(&st[warp][0][0], of[f], TK, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            const int r = e / 16, c = f * 16 + e % 16, qr = q0 + warp * 16 + r;
            if (qr < t && c < hd) store(out + (((long)bi * t + qr) * heads + hi) * hd, c, st[warp][r][e % 16]);
        }
        __syncwarp();
    }
}

#define FLASH_TC(NAME, T, HD)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_tc_##NAME(                       \
        const T *q, const T *k, const T *v, T *out, float *lse, int heads, int t, int keys,      \
        int hd, int causal, float scale, long qs0, long qs1, long qs2, long ks0, long ks1,       \
        long ks2, long vs0, long vs1, long vs2) {                                                \
        flash_tc_rows<T, HD>(q, k, v, out, lse, heads, t, keys, hd, causal, scale, qs0, qs1,    \
                             qs2, ks0, ks1, ks2, vs0, vs1, vs2);                                 \
    }

FLASH_TC(bf16_d64, __nv_bfloat16, 64)
FLASH_TC(bf16_d128, __nv_bfloat16, 128)
FLASH_TC(f16_d64, __half, 64)
FLASH_TC(f16_d128, __half, 128)

// The backward. With p_ij = exp(s_ij − lse_i) (s the scaled scores), dp_ij = ∂o_i·v_j and
// D_i = ∂o_i·o_i (`delta`, computed beforehand):
//   ∂q_i = scale · Σ_j p_ij (dp_ij − D_i) k_j,  ∂k_j = scale · Σ_i p_ij (dp_ij − D_i) q_i,
//   ∂v_j = Σ_i p_ij ∂o_i.
// ∂o (`dout`) is [b, t, h, hd] contiguous, the output's layout; lse and delta [b, t, h] f32.
// One kernel over query rows writes ∂q [b, h, t, hd]; one over key rows writes ∂k and ∂v
// as [2, b, h, keys, hd] (`plane` = b·h·keys·hd apart). Each row's sums stay in one
// block's registers, so neither needs atomics and both give the same bits every run.

// a·ta and b·tb over one row's features, each summed across the row's 4 lanes (lane
// `sub` holds features sub, sub+4, … of a and b; ta and tb are whole rows of a tile).
template <int PER>
__device__ __forceinline__ void row_dots(const float *a, const float *ta, const float *b, const float *tb,
                                         int sub, float &x, float &y) {
    x = 0.0f;
    y = 0.0f;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        x = fmaf(a[e], ta[sub + e * LANES], x);
        y = fmaf(b[e], tb[sub + e * LANES], y);
    }
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    y += __shfl_xor_sync(0xffffffffu, y, 1);
    y += __shfl_xor_sync(0xffffffffu, y, 2);
}

// ∂q: the forward's loop, with ∂o's row beside q's and ∂v's tile beside k's.
template <typename T, int MAXD, int BK>
__device__ __forceinline__ void flash_dq_rows(
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
    const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ delta,
    T *__restrict__ dq, int heads, int t, int keys, int hd, int causal, float scale, long qs0,
    long qs1, long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {
    constexpr int PER = MAXD / LANES;
    __shared__ float kt[BK][MAXD];
    __shared__ float vt[BK][MAXD];
    const int bi = blockIdx.z, hi = blockIdx.y;
    const int q0 = blockIdx.x * ROWS;
    const int row = threadIdx.x / LANES, sub = threadIdx.x % LANES;
    const int qi = q0 + row;
    const bool live = qi < t;
    const int past = keys - t;

    float qr[PER], dr[PER], acc[PER] = {};
    const long r = ((long)bi * t + (live ? qi : 0)) * heads + hi; // [b, t, h] index
    load_row<T, PER>(qr, q + bi * qs0 + hi * qs1 + (long)(live ? qi : 0) * qs2, live, sub, hd);
    load_row<T, PER>(dr, dout + r * hd, live, sub, hd);
    const float lse_i = lse[r], d_i = delta[r];
    const int kend = causal ? min(keys, past + min(t, q0 + ROWS)) : keys;
    const T *kb = k + bi * ks0 + hi * ks1;
    const T *vb = v + bi * vs0 + hi * vs1;

    for (int j0 = 0; j0 < kend; j0 += BK) {
        kv_tile<T, MAXD, BK>(kt, vt, kb, vb, ks2, vs2, j0, kend, hd);
#pragma unroll 4
        for (int j = 0; j < BK; ++j) {
            float s, dp;
            row_dots<PER>(qr, kt[j], dr, vt[j], sub, s, dp);
            const int key = j0 + j;
            const bool seen = live && key < kend && (!causal || key <= past + qi);
            const float p = seen ? expf(s * scale - lse_i) : 0.0f;
            const float ds = p * (dp - d_i);
#pragma unroll
            for (int e = 0; e < PER; ++e) acc[e] = fmaf(ds, kt[j][sub + e * LANES], acc[e]);
        }
    }
    if (!live) return;
    store_row<T, PER>(dq + (((long)bi * heads + hi) * t + qi) * hd, acc, scale, sub, hd);
}

// ∂k and ∂v: rows are keys; tiles of BQ queries (q, ∂o, lse, delta) in shared memory.
template <typename T, int MAXD, int BQ>
__device__ __forceinline__ void flash_dkv_rows(
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
    const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ delta,
    T *__restrict__ dkv, long plane, int heads, int t, int keys, int hd, int causal, float scale,
    long qs0, long qs1, long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {
    constexpr int PER = MAXD / LANES;
    __shared__ float qt[BQ][MAXD];
    __shared__ float dt[BQ][MAXD];
    __shared__ float lt[BQ], dl[BQ];
    const int bi = blockIdx.z, hi = blockIdx.y;
    const int k0 = blockIdx.x * ROWS;
    const int row = threadIdx.x / LANES, sub = threadIdx.x % LANES;
    const int kj = k0 + row;
    const bool live = kj < keys;
    const int past = keys - t;

    float kr[PER], vr[PER], dk[PER] = {}, dv[PER] = {};
    load_row<T, PER>(kr, k + bi * ks0 + hi * ks1 + (long)(live ? kj : 0) * ks2, live, sub, hd);
    load_row<T, PER>(vr, v + bi * vs0 + hi * vs1 + (long)(live ? kj : 0) * vs2, live, sub, hd);
    // Causal: query i sees key j when j ≤ past + i, so no query before k0 − past sees
    // any key of this block.
    const int istart = causal && k0 > past ? k0 - past : 0;
    const T *qb = q + bi * qs0 + hi * qs1;

    for (int i0 = istart; i0 < t; i0 += BQ) {
        __syncthreads();
        for (int x = threadIdx.x; x < BQ * MAXD; x += THREADS) {
            const int i = x / MAXD, c = x % MAXD;
            const int qi = i0 + i;
            const bool in = qi < t && c < hd;
            qt[i][c] = in ? load(qb + qi * qs2, c) : 0.0f;
            dt[i][c] = in ? load(dout + (((long)bi * t + qi) * heads + hi) * hd, c) : 0.0f;
        }
        for (int i = threadIdx.x; i < BQ; i += THREADS) {
            const int qi = i0 + i;
            const long r = ((long)bi * t + qi) * heads + hi;
            lt[i] = qi < t ? lse[r] : 0.0f;
            dl[i] = qi < t ? delta[r] : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int i = 0; i < BQ; ++i) {
            float s, dp;
            row_dots<PER>(kr, qt[i], vr, dt[i], sub, s, dp);
            const int qi = i0 + i;
            const bool seen = live && qi < t && (!causal || kj <= past + qi);
            const float p = seen ? expf(s * scale - lt[i]) : 0.0f;
            const float ds = p * (dp - dl[i]);
#pragma unroll
            for (int e = 0; e < PER; ++e) {
                dv[e] = fmaf(p, dt[i][sub + e * LANES], dv[e]);
                dk[e] = fmaf(ds, qt[i][sub + e * LANES], dk[e]);
            }
        }
    }
    if (!live) return;
    T *out = dkv + (((long)bi * heads + hi) * keys + kj) * hd;
    store_row<T, PER>(out, dk, scale, sub, hd);
    store_row<T, PER>(out + plane, dv, 1.0f, sub, hd);
}

#define FLASH_GRAD(NAME, T, MAXD, BK)                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_dq_##NAME(                       \
        const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta, \
        T *dq, int heads, int t, int keys, int hd, int causal, float scale, long qs0, long qs1,  \
        long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {                  \
        flash_dq_rows<T, MAXD, BK>(q, k, v, dout, lse, delta, dq, heads, t, keys, hd, causal,   \
                                   scale, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2);          \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_dkv_##NAME(                      \
        const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta, \
        T *dkv, long plane, int heads, int t, int keys, int hd, int causal, float scale,         \
        long qs0, long qs1, long qs2, long ks0, long ks1, long ks2, long vs0, long vs1,          \
        long vs2) {                                                                              \
        flash_dkv_rows<T, MAXD, BK>(q, k, v, dout, lse, delta, dkv, plane, heads, t, keys, hd,  \
                                    causal, scale, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2); \
    }

FLASH_GRAD(f32_d64, float, 64, 64)
FLASH_GRAD(f32_d128, float, 128, 32)
FLASH_GRAD(f32_d256, float, 256, 16)
FLASH_GRAD(bf16_d64, __nv_bfloat16, 64, 64)
FLASH_GRAD(bf16_d128, __nv_bfloat16, 128, 32)
FLASH_GRAD(bf16_d256, __nv_bfloat16, 256, 16)
FLASH_GRAD(f16_d64, __half, 64, 64)
FLASH_GRAD(f16_d128, __half, 128, 32)
FLASH_GRAD(f16_d256, __half, 256, 16)
