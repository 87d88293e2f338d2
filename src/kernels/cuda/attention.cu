// Flash-style attention for inference on a GPU: softmax(q·kᵀ·scale)·v per
// (batch, head) with an online softmax over tiles of keys, so no
// [queries, keys] score tensor is ever in memory.
//
// q [b, h, t, hd], k and v [b, h, keys, hd] are read through their strides (the
// model's head-split views need no copy); only each row's features must be
// contiguous. The output is written straight into [b, t, h·hd], the layout the
// output projection takes. Causal: query i (of the last t) sees keys
// 0..=past+i, past = keys − t (a KV cache or a prefix counts as the past).
// f32, bf16 and f16 inputs; products, softmax and accumulation in f32.
//
// A block of 128 threads takes 32 queries; each query is shared by 4 adjacent
// lanes, lane `sub` keeping features sub, sub+4, … of the query and of its
// output in registers. A tile of BK keys and values is staged in shared memory
// as f32; each score is 4 partial dot products summed across the 4 lanes by
// two shuffles, which leaves every lane of the row with all BK scores, so the
// softmax update and P·V need no shared memory for P. SIMT only (no tensor
// cores): a first kernel whose numbers the GPU session checks before it is
// made fast.
#include "rows.cuh"


#define THREADS 128
#define LANES 4                 // lanes per query
#define ROWS (THREADS / LANES)  // queries per block

// MAXD: the largest head size the instance takes; BK: keys per tile, chosen so
// that the K and V tiles are 32 KiB of static shared memory together.
template <typename T, int MAXD, int BK>
__device__ __forceinline__ void flash_rows(
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ out,
    int heads, int t, int keys, int hd, int causal, float scale,
    long qs0, long qs1, long qs2, long ks0, long ks1, long ks2, long vs0, long vs1, long vs2) {
    constexpr int PER = MAXD / LANES;
    __shared__ float kt[BK][MAXD];
    __shared__ float vt[BK][MAXD];
    const int bi = blockIdx.z, hi = blockIdx.y;
    const int q0 = blockIdx.x * ROWS;
    const int row = threadIdx.x / LANES, sub = threadIdx.x % LANES;
    const int qi = q0 + row;
    // Rows past t (the last block's padding) compute on zeros and store nothing;
    // they still take part in every shuffle and barrier.
    const bool live = qi < t;
    const int past = keys - t;

    float qr[PER], o[PER];
    const T *qrow = q + bi * qs0 + hi * qs1 + (long)(live ? qi : 0) * qs2;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const int c = sub + e * LANES;
        qr[e] = (live && c < hd) ? load(qrow, c) : 0.0f;
        o[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    // Causal: no query of this block sees a key after its last query's position.
    const int kend = causal ? min(keys, past + min(t, q0 + ROWS)) : keys;
    const T *kb = k + bi * ks0 + hi * ks1;
    const T *vb = v + bi * vs0 + hi * vs1;

    for (int j0 = 0; j0 < kend; j0 += BK) {
        __syncthreads(); // the previous tile's readers are done
        for (int i = threadIdx.x; i < BK * MAXD; i += THREADS) {
            const int j = i / MAXD, c = i % MAXD;
            const int key = j0 + j;
            const bool in = key < kend && c < hd;
            kt[j][c] = in ? load(kb + key * ks2, c) : 0.0f;
            vt[j][c] = in ? load(vb + key * vs2, c) : 0.0f;
        }
        __syncthreads();

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
            const bool seen = key < kend && (!causal || key <= past + qi);
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
    if (!live) return;
    // Every live row saw key 0 (causal: past + qi ≥ 0), so l ≥ 1.
    const float inv = 1.0f / l;
    T *orow = out + (((long)bi * t + qi) * heads + hi) * hd;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const int c = sub + e * LANES;
        if (c < hd) store(orow, c, o[e] * inv);
    }
}

#define FLASH(NAME, T, MAXD, BK)                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                   \
        const T *q, const T *k, const T *v, T *out, int heads, int t, int keys, int hd,          \
        int causal, float scale, long qs0, long qs1, long qs2, long ks0, long ks1, long ks2,     \
        long vs0, long vs1, long vs2) {                                                          \
        flash_rows<T, MAXD, BK>(q, k, v, out, heads, t, keys, hd, causal, scale, qs0, qs1, qs2, \
                                ks0, ks1, ks2, vs0, vs1, vs2);                                   \
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
