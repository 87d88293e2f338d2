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
// whole sum, so nothing per pair goes through shared memory. These first SIMT kernels
// take decoding, head sizes above the faster kernels' and f32's backward; below them
// are a register-tiled f32 forward (`flash_tile_f32_d64`) and the tensor-core forward
// and backward for bf16 and f16 (`flash_tc_*`).
#include <stdint.h>

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

// The f32 forward for head sizes up to 64 and more than one block of queries (prefill
// and training), register-tiled as a SIMT matrix product is: a block of 128 threads
// takes 64 queries over tiles of 32 keys; thread (ty, tx) = (tid / 8, tid % 8) holds
// the scores of queries 4ty .. 4ty + 3 against keys 4tx .. 4tx + 3 of the tile, and
// the output of those queries at features 4tx .. 4tx + 3 and 32 + 4tx .. 32 + 4tx + 3.
// Queries and keys are staged transposed and the weights p go through shared memory
// transposed, so that every operand is read as float4 (a warp's reads of a row are 128
// contiguous bytes or one broadcast): 16 multiply-adds per two loads for the scores, 32
// per three for p·v, where the kernel above does one per load. The transposed rows are
// padded so that the staging's stores collide at most 4 ways. The 8 threads that share a
// row are adjacent lanes, so its maximum and sum take three shuffles.
#define TILE_Q 64
#define TILE_K 32

__device__ __forceinline__ float4 ld4(const float *p) { return *reinterpret_cast<const float4 *>(p); }

// acc[r][c] += a[r]·b[c] for 4 rows and C columns: a thread's share of a tile product.
template <int C>
__device__ __forceinline__ void outer(float (*acc)[C], const float *a, const float *b) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c) acc[r][c] = fmaf(a[r], b[c], acc[r][c]);
}

__device__ __forceinline__ void flash_tile_rows(
    const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v, float *__restrict__ out,
    float *__restrict__ lse, int heads, int t, int keys, int hd, int causal, float scale, long qs0, long qs1,
    long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {
    __shared__ __align__(16) float qs[64][TILE_Q + 4];  // q transposed: [feature][query]
    __shared__ __align__(16) float kts[64][TILE_K + 4]; // the keys transposed
    __shared__ __align__(16) float vts[TILE_K][64];     // the values as rows
    __shared__ __align__(16) float ps[TILE_K][TILE_Q + 8]; // the weights transposed: [key][query]
    const int bi = blockIdx.z, hi = blockIdx.y;
    const int tid = threadIdx.x, ty = tid / 8, tx = tid % 8;
    const int q0 = blockIdx.x * TILE_Q, past = keys - t;
    const float *qb = q + bi * qs0 + hi * qs1;
    for (int i = tid; i < TILE_Q * 64; i += THREADS) {
        const int r = i / 64, c = i % 64;
        qs[c][r] = (q0 + r < t && c < hd) ? qb[(q0 + r) * qs2 + c] : 0.0f;
    }
    const int kend = causal ? min(keys, past + min(t, q0 + TILE_Q)) : keys;
    const float *kb = k + bi * ks0 + hi * ks1;
    const float *vb = v + bi * vs0 + hi * vs1;
    float o[4][8] = {}, m[4], l[4] = {};
#pragma unroll
    for (int r = 0; r < 4; ++r) m[r] = -INFINITY;

    for (int j0 = 0; j0 < kend; j0 += TILE_K) {
        __syncthreads(); // the previous tile's readers are done (and q is staged)
        for (int i = tid; i < TILE_K * 64; i += THREADS) {
            const int j = i / 64, c = i % 64, key = j0 + j;
            const bool in = key < kend && c < hd;
            kts[c][j] = in ? kb[key * ks2 + c] : 0.0f;
            vts[j][c] = in ? vb[key * vs2 + c] : 0.0f;
        }
        __syncthreads();
        float s[4][4] = {};
#pragma unroll 8
        for (int c = 0; c < 64; ++c) {
            const float4 a = ld4(&qs[c][4 * ty]), b = ld4(&kts[c][4 * tx]);
            const float ar[4] = {a.x, a.y, a.z, a.w}, br[4] = {b.x, b.y, b.z, b.w};
            outer<4>(s, ar, br);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int qi = q0 + 4 * ty + r;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int key = j0 + 4 * tx + j;
                const bool seen = qi < t && key < kend && (!causal || key <= past + qi);
                s[r][j] = seen ? s[r][j] * scale : -INFINITY;
                mx = fmaxf(mx, s[r][j]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            const float mn = fmaxf(m[r], mx);
            // A row that has seen nothing yet stays at zero (exp(−inf − −inf) is NaN).
            const float base = mn == -INFINITY ? 0.0f : mn;
            const float alpha = expf(m[r] - base); // 0 while m = −inf
            m[r] = mn;
            l[r] *= alpha;
#pragma unroll
            for (int e = 0; e < 8; ++e) o[r][e] *= alpha;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s[r][j] = expf(s[r][j] - base); // masked: exp(−inf) = 0
                l[r] += s[r][j];
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
            *reinterpret_cast<float4 *>(&ps[4 * tx + j][4 * ty]) = make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);
        __syncthreads();
#pragma unroll 4
        for (int j = 0; j < TILE_K; ++j) {
            const float4 a = ld4(&ps[j][4 * ty]), b0 = ld4(&vts[j][4 * tx]), b1 = ld4(&vts[j][32 + 4 * tx]);
            const float ar[4] = {a.x, a.y, a.z, a.w}, br[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            outer<8>(o, ar, br);
        }
    }
    // Each thread summed its own keys: the row's Σ exp across its 8 lanes. Every live
    // row saw key 0 (causal: past + qi ≥ 0), so l ≥ 1 there.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 4);
        const int qi = q0 + 4 * ty + r;
        if (qi >= t) continue;
        if (tx == 0 && lse != nullptr) lse[((long)bi * t + qi) * heads + hi] = m[r] + logf(l[r]);
        float *orow = out + (((long)bi * t + qi) * heads + hi) * hd;
        const float inv = 1.0f / l[r];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int c = (e < 4 ? 0 : 28) + 4 * tx + e; // 4tx + e, then 32 + 4tx + e − 4
            if (c < hd) orow[c] = o[r][e] * inv;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) flash_tile_f32_d64(
    const float *q, const float *k, const float *v, float *out, float *lse, int heads, int t, int keys, int hd,
    int causal, float scale, long qs0, long qs1, long qs2, long ks0, long ks1, long ks2, long vs0, long vs1,
    long vs2) {
    flash_tile_rows(q, k, v, out, lse, heads, t, keys, hd, causal, scale, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1,
                    vs2);
}

// The forward on tensor cores, for bf16 and f16 (instances for head sizes 64, 96 and
// 128; the SIMT kernel above takes larger ones): FlashAttention-2's loop on PTX
// `mma.sync` m16n8k16 products with f32 accumulators. Their register layout is
// documented (PTX ISA, "Matrix Fragments for mma.m16n8k16"), so the scores stay in
// registers: the row maxima, the rescaling of the output and the weights p are computed
// where the product leaves them, and the scores of 16 keys are, element for element,
// the left operand of p·v. One pass over the keys. A block of 4 warps takes 64 queries
// (16 a warp); tiles of TC_KEYS keys pass through shared memory, keys as rows and
// values transposed, so that both products read their right operand as pairs of
// adjacent elements, each row padded by TC_PAD elements so that a warp's 32 reads fall
// in 32 different banks. The weights p are rounded to T for the tensor cores, as
// FlashAttention does; their sums stay f32. Scores are held in base-2 units
// (scale·log₂e folded in) for exp2f.
//
// Lane (g, c) = (lane / 4, lane % 4) holds: of a 16×8 accumulator, rows g and g + 8 at
// columns 2c and 2c + 1 (registers 0, 1 and 2, 3); of a 16×16 left operand, those rows
// at columns 2c, 2c + 1 (registers 0 and 1) and 2c + 8, 2c + 9 (2 and 3); of a 16×8
// right operand, rows 2c, 2c + 1 and 2c + 8, 2c + 9 of column g. Two 16-bit elements
// share a register, the lower column (or row) in the low half.
#define TC_WARPS 4
#define TC_ROWS (16 * TC_WARPS)
#define TC_KEYS 64
#define TC_PAD 8

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#ifndef TOKENFORMER_EMULATE
// d += a·b on the warp's tensor cores (compute capability 8.0 and later); the type of
// the last argument picks bf16 or f16. The emulator (scripts/cuda-emulate) brings its
// own, which exchanges the fragments between the lanes.
__device__ __forceinline__ void mma16816(float *d, const uint32_t *a, const uint32_t *b, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma16816(float *d, const uint32_t *a, const uint32_t *b, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

__device__ __forceinline__ uint32_t bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t bits(__half x) { return __half_as_ushort(x); }
// lo and hi rounded to T, as one register (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    T a, b;
    store(&a, 0, lo);
    store(&b, 0, hi);
    return bits(a) | bits(b) << 16;
}
// p[0] and p[1] as one register (p 4-byte aligned).
template <typename T>
__device__ __forceinline__ uint32_t pair(const T *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

// Rows r0 .. r0 + TR of a [rows, hd] matrix (row stride `stride`, features contiguous;
// zero from rend on, and past hd) into shared memory as T: as rows into `rt` and/or
// transposed into `tt` (either may be null). Where hd, the stride and the pointer
// allow it, 8 features (16 bytes) a load, consecutive threads on consecutive rows (so
// that the transposed stores do not collide in banks); else one element a load. The
// caller puts the barriers around it.
template <typename T, int HD, int TR>
__device__ __forceinline__ void stage(T (*rt)[HD + TC_PAD], T (*tt)[TR + TC_PAD], const T *src, long stride,
                                      int r0, int rend, int hd) {
    const bool vec = hd % 8 == 0 && stride % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
    if (vec) {
        for (int i = threadIdx.x; i < TR * HD / 8; i += THREADS) {
            const int j = i % TR, c = i / TR * 8, r = r0 + j;
            uint4 x = {0u, 0u, 0u, 0u};
            if (r < rend && c < hd) x = *reinterpret_cast<const uint4 *>(src + r * stride + c);
            if (rt != nullptr) *reinterpret_cast<uint4 *>(&rt[j][c]) = x;
            if (tt != nullptr) {
                const T *xe = reinterpret_cast<const T *>(&x);
#pragma unroll
                for (int e = 0; e < 8; ++e) tt[c + e][j] = xe[e];
            }
        }
    } else {
        for (int i = threadIdx.x; i < TR * HD; i += THREADS) {
            const int j = i / HD, c = i % HD, r = r0 + j;
            const float x = r < rend && c < hd ? load(src + r * stride, c) : 0.0f;
            if (rt != nullptr) store(&rt[j][0], c, x);
            if (tt != nullptr) store(&tt[c][0], j, x);
        }
    }
}

// Element (r, c) of a [rows, hd] matrix as f32, zero from rend on and past hd.
template <typename T>
__device__ __forceinline__ float elem(const T *src, long stride, int r, int c, int rend, int hd) {
    return (r < rend && c < hd) ? load(src + r * stride, c) : 0.0f;
}

// Rows r0 .. r0 + 15 of a [rows, hd] matrix (zero from rend on and past hd) as left
// operands, one per 16 features, straight from global memory (once per block).
template <typename T, int NK>
__device__ __forceinline__ void left_rows(uint32_t (*f)[4], const T *src, long stride, int r0, int rend, int hd,
                                          int g, int c2) {
#pragma unroll
    for (int k = 0; k < NK; ++k)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = r0 + g + r % 2 * 8, col = k * 16 + r / 2 * 8 + c2;
            f[k][r] = pack<T>(elem(src, stride, row, col, rend, hd), elem(src, stride, row, col + 1, rend, hd));
        }
}

// s = a·btᵀ for the warp's 16 rows against NS·8 rows of bt (features contiguous): the
// scores of q against keys, or of keys against queries.
template <typename T, int HD, int NS>
__device__ __forceinline__ void products_nt(float (*s)[4], const uint32_t (*a)[4], const T (*bt)[HD + TC_PAD],
                                            int g, int c2) {
#pragma unroll
    for (int n = 0; n < NS; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
        for (int k = 0; k < HD / 16; ++k) {
            const uint32_t b[2] = {pair(&bt[n * 8 + g][k * 16 + c2]), pair(&bt[n * 8 + g][k * 16 + 8 + c2])};
            mma16816(s[n], a[k], b, T());
        }
    }
}

// o += p·b, p the warp's weights over TR rows of b as the score products left them
// (rounded to T here), b given transposed (tt [HD][TR]): 16 of p's columns, two 8-wide
// accumulators, are one left operand as they lie.
template <typename T, int HD, int TR>
__device__ __forceinline__ void accumulate(float (*o)[4], const float (*p)[4], const T (*tt)[TR + TC_PAD], int g,
                                           int c2) {
#pragma unroll
    for (int kk = 0; kk < TR / 16; ++kk) {
        const float *p0 = p[2 * kk], *p1 = p[2 * kk + 1];
        const uint32_t a[4] = {pack<T>(p0[0], p0[1]), pack<T>(p0[2], p0[3]), pack<T>(p1[0], p1[1]),
                               pack<T>(p1[2], p1[3])};
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt) {
            const uint32_t b[2] = {pair(&tt[nt * 8 + g][kk * 16 + c2]), pair(&tt[nt * 8 + g][kk * 16 + 8 + c2])};
            mma16816(o[nt], a, b, T());
        }
    }
}

// The lane's accumulator rows of a 16×HD result, rows r0 + g and r0 + g + 8 of a
// matrix whose rows are `stride` apart (features contiguous), times mul[0] and mul[1]
// respectively, for rows below rend and features below hd.
template <typename T, int HD>
__device__ __forceinline__ void store_rows(T *dst, long stride, const float (*o)[4], const float *mul, int r0,
                                           int rend, int hd, int g, int c2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r0 + g + 8 * r;
        if (row >= rend) continue;
        T *d = dst + row * stride;
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt) {
            const int col = nt * 8 + c2;
            if (col < hd) store(d, col, o[nt][2 * r] * mul[r]);
            if (col + 1 < hd) store(d, col + 1, o[nt][2 * r + 1] * mul[r]);
        }
    }
}

#define LOG2E 1.4426950408889634f

// The keys (0 .. kend) that the block's queries q0 .. q0 + TC_ROWS see, and those
// (0 .. wend) that the warp's r0 .. r0 + 15 see. Causal: none after the last query's
// position; none for a warp wholly past t.
__device__ __forceinline__ void key_ends(int causal, int keys, int t, int q0, int r0, int &kend, int &wend) {
    const int past = keys - t;
    kend = causal ? min(keys, past + min(t, q0 + TC_ROWS)) : keys;
    wend = r0 >= t ? 0 : causal ? min(kend, past + min(t, r0 + 16)) : kend;
}

template <typename T, int HD>
__device__ __forceinline__ void flash_tc_rows(
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ out,
    float *__restrict__ lse, int heads, int t, int keys, int hd, int causal, float scale, long qs0,
    long qs1, long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {
    constexpr int NS = TC_KEYS / 8; // 8-key slices of a tile's scores
    __shared__ __align__(16) T kt[TC_KEYS][HD + TC_PAD];
    __shared__ __align__(16) T vt[HD][TC_KEYS + TC_PAD];
    const int bi = blockIdx.z, hi = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c2 = lane % 4 * 2;
    const int past = keys - t;
    const int q0 = blockIdx.x * TC_ROWS, r0 = q0 + warp * 16;
    const int rows[2] = {r0 + g, r0 + g + 8}; // this lane's two query rows

    uint32_t qf[HD / 16][4];
    left_rows<T, HD / 16>(qf, q + bi * qs0 + hi * qs1, qs2, r0, t, hd, g, c2);
    float o[HD / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float sl2 = scale * LOG2E;
    int kend, wend;
    key_ends(causal, keys, t, q0, r0, kend, wend);
    const T *kb = k + bi * ks0 + hi * ks1;
    const T *vb = v + bi * vs0 + hi * vs1;

    for (int j0 = 0; j0 < kend; j0 += TC_KEYS) {
        __syncthreads(); // the previous tile's readers are done
        stage<T, HD, TC_KEYS>(kt, nullptr, kb, ks2, j0, kend, hd);
        stage<T, HD, TC_KEYS>(nullptr, vt, vb, vs2, j0, kend, hd);
        __syncthreads();
        if (j0 >= wend) continue; // warp-uniform: the tile is past every row of the warp

        float s[NS][4];
        products_nt<T, HD, NS>(s, qf, kt, g, c2);
        // Scale and mask (−inf for what a row does not see), then each row's maximum
        // over the tile, across the 4 lanes that share the row.
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = j0 + n * 8 + c2 + e % 2, qi = rows[e / 2];
                const bool seen = qi < t && key < kend && (!causal || key <= past + qi);
                s[n][e] = seen ? s[n][e] * sl2 : -INFINITY;
                mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
            }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float mn = fmaxf(m[r], mx[r]);
            // A row that has seen nothing yet stays at zero (exp2(−inf − −inf) is NaN).
            base[r] = mn == -INFINITY ? 0.0f : mn;
            const float alpha = exp2f(m[r] - base[r]); // 0 while m = −inf
            m[r] = mn;
            l[r] *= alpha;
#pragma unroll
            for (int nt = 0; nt < HD / 8; ++nt) {
                o[nt][2 * r] *= alpha;
                o[nt][2 * r + 1] *= alpha;
            }
        }
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2f(s[n][e] - base[e / 2]); // masked: exp2(−inf) = 0
                l[e / 2] += s[n][e];
            }
        accumulate<T, HD, TC_KEYS>(o, s, vt, g, c2);
    }
    // Each lane summed its own columns: the row's Σ exp across its 4 lanes. Every live
    // row saw key 0 (causal: past + qi ≥ 0), so l ≥ 1 there.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (rows[r] < t && c2 == 0 && lse != nullptr)
            lse[((long)bi * t + rows[r]) * heads + hi] = (m[r] + log2f(l[r])) / LOG2E;
    }
    // out is [b, t, h, hd]: a head's rows are h·hd apart. (A padding row's 1/0 is not
    // stored.)
    const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
    store_rows<T, HD>(out + ((long)bi * t * heads + hi) * hd, (long)heads * hd, o, inv, r0, t, hd, g, c2);
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
FLASH_TC(bf16_d96, __nv_bfloat16, 96)
FLASH_TC(bf16_d128, __nv_bfloat16, 128)
FLASH_TC(f16_d64, __half, 64)
FLASH_TC(f16_d96, __half, 96)
FLASH_TC(f16_d128, __half, 128)

// The backward on tensor cores (bf16 and f16, head sizes up to 64; the SIMT kernels
// below take the rest), the same two kernels as the SIMT backward with the same
// arguments and outputs, each product an mma.sync over tiles of 64 rows:
// - ∂q, a block of 4 warps per 64 queries (16 a warp) over tiles of keys: s = q·kᵀ and
//   dp = ∂o·vᵀ, then ∂s = p·(dp − D) in the registers they came out in, which are the
//   left operand of ∂q += ∂s·k (keys staged as rows and transposed);
// - ∂k and ∂v, a block per 64 keys over tiles of queries: sᵀ = k·qᵀ and dpᵀ = v·∂oᵀ,
//   then ∂v += pᵀ·∂o and ∂k += ∂sᵀ·q (queries and ∂o staged as rows and transposed).
// p and ∂s are rounded to T for the products, as FlashAttention does; every sum is f32.
template <typename T, int HD>
__device__ __forceinline__ void flash_tc_dq_rows(
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, const T *__restrict__ dout,
    const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dq, int heads, int t,
    int keys, int hd, int causal, float scale, long qs0, long qs1, long qs2, long ks0, long ks1, long ks2,
    long vs0, long vs1, long vs2) {
    constexpr int NS = TC_KEYS / 8;
    __shared__ __align__(16) T kt[TC_KEYS][HD + TC_PAD];  // keys as rows: q·kᵀ
    __shared__ __align__(16) T vt[TC_KEYS][HD + TC_PAD];  // values as rows: ∂o·vᵀ
    __shared__ __align__(16) T ktt[HD][TC_KEYS + TC_PAD]; // keys transposed: ∂s·k
    const int bi = blockIdx.z, hi = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c2 = lane % 4 * 2;
    const int past = keys - t;
    const int q0 = blockIdx.x * TC_ROWS, r0 = q0 + warp * 16;
    const int rows[2] = {r0 + g, r0 + g + 8};
    const long dstride = (long)heads * hd; // ∂o is [b, t, h, hd]
    const T *db = dout + ((long)bi * t * heads + hi) * hd;

    uint32_t qf[HD / 16][4], df[HD / 16][4];
    left_rows<T, HD / 16>(qf, q + bi * qs0 + hi * qs1, qs2, r0, t, hd, g, c2);
    left_rows<T, HD / 16>(df, db, dstride, r0, t, hd, g, c2);
    float lse2[2], dl[2]; // each row's log-sum-exp in base 2, and D
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long i = ((long)bi * t + rows[r]) * heads + hi;
        lse2[r] = rows[r] < t ? lse[i] * LOG2E : 0.0f;
        dl[r] = rows[r] < t ? delta[i] : 0.0f;
    }
    float acc[HD / 8][4] = {};
    const float sl2 = scale * LOG2E;
    int kend, wend;
    key_ends(causal, keys, t, q0, r0, kend, wend);
    const T *kb = k + bi * ks0 + hi * ks1;
    const T *vb = v + bi * vs0 + hi * vs1;

    for (int j0 = 0; j0 < kend; j0 += TC_KEYS) {
        __syncthreads();
        stage<T, HD, TC_KEYS>(kt, ktt, kb, ks2, j0, kend, hd);
        stage<T, HD, TC_KEYS>(vt, nullptr, vb, vs2, j0, kend, hd);
        __syncthreads();
        if (j0 >= wend) continue;
        float s[NS][4], dp[NS][4];
        products_nt<T, HD, NS>(s, qf, kt, g, c2);
        products_nt<T, HD, NS>(dp, df, vt, g, c2);
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = j0 + n * 8 + c2 + e % 2, qi = rows[e / 2];
                const bool seen = qi < t && key < kend && (!causal || key <= past + qi);
                const float p = seen ? exp2f(s[n][e] * sl2 - lse2[e / 2]) : 0.0f;
                s[n][e] = p * (dp[n][e] - dl[e / 2]); // ∂s
            }
        accumulate<T, HD, TC_KEYS>(acc, s, ktt, g, c2);
    }
    const float mul[2] = {scale, scale};
    store_rows<T, HD>(dq + ((long)bi * heads + hi) * t * hd, hd, acc, mul, r0, t, hd, g, c2);
}

template <typename T, int HD>
__device__ __forceinline__ void flash_tc_dkv_rows(
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, const T *__restrict__ dout,
    const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dkv, long plane, int heads,
    int t, int keys, int hd, int causal, float scale, long qs0, long qs1, long qs2, long ks0, long ks1,
    long ks2, long vs0, long vs1, long vs2) {
    constexpr int TQ = TC_KEYS, NS = TQ / 8; // queries a tile
    __shared__ __align__(16) T qt[TQ][HD + TC_PAD];  // queries as rows: k·qᵀ
    __shared__ __align__(16) T dt[TQ][HD + TC_PAD];  // ∂o as rows: v·∂oᵀ
    __shared__ __align__(16) T qtt[HD][TQ + TC_PAD]; // queries transposed: ∂sᵀ·q
    __shared__ __align__(16) T dtt[HD][TQ + TC_PAD]; // ∂o transposed: pᵀ·∂o
    __shared__ float lt[TQ], dlt[TQ];                // log-sum-exp (base 2) and D
    const int bi = blockIdx.z, hi = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c2 = lane % 4 * 2;
    const int past = keys - t;
    const int k0 = blockIdx.x * TC_ROWS, kw = k0 + warp * 16; // the block's and the warp's first key
    const int krows[2] = {kw + g, kw + g + 8};
    const long dstride = (long)heads * hd;
    const T *db = dout + ((long)bi * t * heads + hi) * hd;
    const T *qb = q + bi * qs0 + hi * qs1;

    uint32_t kf[HD / 16][4], vf[HD / 16][4];
    left_rows<T, HD / 16>(kf, k + bi * ks0 + hi * ks1, ks2, kw, keys, hd, g, c2);
    left_rows<T, HD / 16>(vf, v + bi * vs0 + hi * vs1, vs2, kw, keys, hd, g, c2);
    float dk[HD / 8][4] = {}, dv[HD / 8][4] = {};
    const float sl2 = scale * LOG2E;
    // Causal: query i sees key j when j ≤ past + i, so no query before k0 − past sees a
    // key of the block, nor one before kw − past a key of the warp.
    const int istart = causal && k0 > past ? k0 - past : 0;
    const int wstart = causal && kw > past ? kw - past : 0;

    for (int i0 = istart; i0 < t; i0 += TQ) {
        __syncthreads();
        stage<T, HD, TQ>(qt, qtt, qb, qs2, i0, t, hd);
        stage<T, HD, TQ>(dt, dtt, db, dstride, i0, t, hd);
        for (int i = threadIdx.x; i < TQ; i += THREADS) {
            const int qi = i0 + i;
            const long r = ((long)bi * t + qi) * heads + hi;
            lt[i] = qi < t ? lse[r] * LOG2E : 0.0f;
            dlt[i] = qi < t ? delta[r] : 0.0f;
        }
        __syncthreads();
        if (kw >= keys || i0 + TQ <= wstart) continue; // warp-uniform
        float s[NS][4], dp[NS][4];
        products_nt<T, HD, NS>(s, kf, qt, g, c2);  // sᵀ: the warp's keys against the tile's queries
        products_nt<T, HD, NS>(dp, vf, dt, g, c2); // dpᵀ
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + c2 + e % 2, qi = i0 + col, kj = krows[e / 2];
                const bool seen = kj < keys && qi < t && (!causal || kj <= past + qi);
                const float p = seen ? exp2f(s[n][e] * sl2 - lt[col]) : 0.0f;
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - dlt[col]); // ∂sᵀ
            }
        accumulate<T, HD, TQ>(dv, s, dtt, g, c2);
        accumulate<T, HD, TQ>(dk, dp, qtt, g, c2);
    }
    T *out = dkv + ((long)bi * heads + hi) * keys * hd;
    const float mul_k[2] = {scale, scale}, mul_v[2] = {1.0f, 1.0f};
    store_rows<T, HD>(out, hd, dk, mul_k, kw, keys, hd, g, c2);
    store_rows<T, HD>(out + plane, hd, dv, mul_v, kw, keys, hd, g, c2);
}

#define FLASH_TC_GRAD(NAME, T, HD)                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_tc_dq_##NAME(                    \
        const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta, \
        T *dq, int heads, int t, int keys, int hd, int causal, float scale, long qs0, long qs1,  \
        long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {                  \
        flash_tc_dq_rows<T, HD>(q, k, v, dout, lse, delta, dq, heads, t, keys, hd, causal, scale, \
                                qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2);                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_tc_dkv_##NAME(                   \
        const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta, \
        T *dkv, long plane, int heads, int t, int keys, int hd, int causal, float scale,         \
        long qs0, long qs1, long qs2, long ks0, long ks1, long ks2, long vs0, long vs1,          \
        long vs2) {                                                                              \
        flash_tc_dkv_rows<T, HD>(q, k, v, dout, lse, delta, dkv, plane, heads, t, keys, hd,      \
                                 causal, scale, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2);    \
    }

FLASH_TC_GRAD(bf16_d64, __nv_bfloat16, 64)
FLASH_TC_GRAD(f16_d64, __half, 64)
#endif

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
