//! One block of a prefill's attention on AVX-512, without packing keys or
//! values and without a normalising pass over the scores.
//!
//! The block's queries are the lanes: their transposed, pre-scaled copy
//! (`qt`, [hd, BLOCK]) is the only packed operand. Scores are computed
//! transposed (`st`, [keys, BLOCK]): each key row of k is broadcast one
//! element at a time against 32 queries, so k is read where it lies. The
//! softmax then runs down the columns, one query per lane (no horizontal
//! reductions, the causal mask a lane mask), and the value product
//! broadcasts each probability against rows of v, again where they lie. The
//! 1/Σ of each query scales its output row once, instead of every score.
//! Exponentials use fused multiply-adds and `vscalefps`.

use super::math::{EXP_POLY, LN2_HI, LN2_LO};
use std::arch::x86_64::*;

/// Queries per block: 6 vectors of 16 lanes, a multiple of every value
/// tile's row count below. Scores for 2,048 keys are 768 KiB (in L2).
pub(super) const BLOCK: usize = 96;

/// Rows ahead of the value product's that are prefetched into L1: v's rows
/// are strided (the heads interleave), and the hardware prefetchers follow
/// them too late.
const AHEAD: usize = 6;
/// Keys per score tile: 2 × 12 accumulators.
const KEYS: usize = 12;

/// Head sizes the kernel takes: whole vectors, at most 8 of them.
pub(super) fn serves(hd: usize) -> bool {
    hd.is_multiple_of(16) && (16..=128).contains(&hd)
}

/// A block: `rows` (≤ BLOCK) queries over keys `0..seen` of one head.
/// Operands are row pointers and row strides in elements.
#[derive(Clone, Copy)]
pub(super) struct Block {
    pub q: *const f32,
    pub q_stride: usize,
    pub k: *const f32,
    pub k_stride: usize,
    pub v: *const f32,
    pub v_stride: usize,
    pub out: *mut f32,
    pub out_stride: usize,
    pub rows: usize,
    pub hd: usize,
    pub seen: usize,
    /// Causal: keys the block's first query sees (it sees `0..first`, query
    /// r `0..first + r`). `None`: every query sees all `seen` keys.
    pub first: Option<usize>,
    pub scale: f32,
}

/// A worker's buffers, reused across blocks.
#[derive(Default)]
pub(super) struct Scratch {
    qt: Vec<Line>,
    st: Vec<Line>,
    inv: Vec<Line>,
}

/// A cache line of f32s: the buffers' rows then start on lines, so no
/// vector load or store splits across two.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// The first `floats` of `buf` as f32s, grown as needed.
fn floats(buf: &mut Vec<Line>, floats: usize) -> &mut [f32] {
    let lines = floats.div_ceil(16);
    if buf.len() < lines {
        buf.resize(lines, Line::default());
    }
    // SAFETY: a Line is 16 f32s without padding, and `buf` holds `lines` of them.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<f32>(), floats) }
}

impl Block {
    /// Keys that some query among the first `hi` sees.
    fn keys_for(&self, hi: usize) -> usize {
        match self.first {
            Some(first) => self.seen.min(first + hi - 1),
            None => self.seen,
        }
    }

    /// Lanes of group `g` (queries 16g..16g+16) that see key j.
    fn lanes(&self, j: usize, g: usize) -> __mmask16 {
        match self.first {
            // Query r sees j when j < first + r, i.e. r ≥ j + 1 − first.
            Some(first) => {
                let lo = (j + 1).saturating_sub(first) as isize - (16 * g) as isize;
                if lo <= 0 {
                    0xffff
                } else if lo >= 16 {
                    0
                } else {
                    0xffffu16 << lo
                }
            }
            None => 0xffff,
        }
    }
}

/// Runs one block.
///
/// # Safety
/// The CPU has AVX-512F. `b.rows` query rows of `b.hd` elements, `b.seen`
/// key and value rows, and `b.rows` output rows must be valid at the given
/// strides; the output rows must not overlap the inputs.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn block(b: &Block, s: &mut Scratch) {
    debug_assert!(b.rows <= BLOCK && serves(b.hd) && b.seen > 0);
    let qt = floats(&mut s.qt, b.hd * BLOCK);
    qt.fill(0.0);
    for r in 0..b.rows {
        // SAFETY: the caller's rows.
        let row = unsafe { std::slice::from_raw_parts(b.q.add(r * b.q_stride), b.hd) };
        for (d, &x) in row.iter().enumerate() {
            qt[d * BLOCK + r] = x * b.scale;
        }
    }
    let st = floats(&mut s.st, b.seen * BLOCK);
    let inv = floats(&mut s.inv, BLOCK);
    // SAFETY: qt holds hd × BLOCK, st seen × BLOCK, inv BLOCK; the caller's operands.
    unsafe {
        scores(b, qt, st);
        softmax(b, st, inv);
        match b.hd / 16 {
            1 => values::<1, 24>(b, st, inv),
            2 => values::<2, 12>(b, st, inv),
            3 => values::<3, 8>(b, st, inv),
            4 => values::<4, 6>(b, st, inv),
            5 => values::<5, 4>(b, st, inv),
            6 => values::<6, 4>(b, st, inv),
            7 => values::<7, 3>(b, st, inv),
            _ => values::<8, 3>(b, st, inv),
        }
    }
}

/// st[j, r] = qt[·, r] · k[j] for the keys each pair of lane groups needs.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn scores(b: &Block, qt: &[f32], st: &mut [f32]) {
    for lane0 in (0..b.rows).step_by(32) {
        let keys = b.keys_for((lane0 + 32).min(b.rows));
        let (qt, st) = (
            qt.as_ptr().wrapping_add(lane0),
            st.as_mut_ptr().wrapping_add(lane0),
        );
        let mut j = 0;
        // SAFETY: key rows j < keys ≤ seen; lanes lane0..lane0 + 32 ≤ BLOCK of qt and st.
        unsafe {
            while j + KEYS <= keys {
                score_tile::<KEYS>(b, qt, st, j);
                j += KEYS;
            }
            for j in j..keys {
                score_tile::<1>(b, qt, st, j);
            }
        }
    }
}

/// Keys j..j+N against 32 lanes.
#[inline(always)]
unsafe fn score_tile<const N: usize>(b: &Block, qt: *const f32, st: *mut f32, j: usize) {
    // SAFETY (whole body): the caller's bounds.
    unsafe {
        // One key's two lane groups per entry.
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        let k = b.k.add(j * b.k_stride);
        for d in 0..b.hd {
            let a0 = _mm512_loadu_ps(qt.add(d * BLOCK));
            let a1 = _mm512_loadu_ps(qt.add(d * BLOCK + 16));
            for (n, [c0, c1]) in acc.iter_mut().enumerate() {
                let kv = _mm512_set1_ps(*k.add(n * b.k_stride + d));
                *c0 = _mm512_fmadd_ps(a0, kv, *c0);
                *c1 = _mm512_fmadd_ps(a1, kv, *c1);
            }
        }
        for (n, [c0, c1]) in acc.into_iter().enumerate() {
            let row = st.add((j + n) * BLOCK);
            _mm512_storeu_ps(row, c0);
            _mm512_storeu_ps(row.add(16), c1);
        }
    }
}

/// Each lane's column of st becomes exp(s − max) (0 where masked or below
/// e⁻⁸⁷), and inv[r] = 1 / Σ.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn softmax(b: &Block, st: &mut [f32], inv: &mut [f32]) {
    const G: usize = BLOCK / 16;
    let groups = b.rows.div_ceil(16);
    let mut max = [_mm512_set1_ps(f32::NEG_INFINITY); G];
    let mut sum = [_mm512_setzero_ps(); G];
    // SAFETY (whole body): rows j < seen of st, lanes < BLOCK.
    unsafe {
        for j in 0..b.seen {
            let row = st.as_ptr().add(j * BLOCK);
            for (g, mx) in max.iter_mut().enumerate().take(groups) {
                let x = _mm512_loadu_ps(row.add(16 * g));
                *mx = _mm512_mask_max_ps(*mx, b.lanes(j, g), *mx, x);
            }
        }
        for j in 0..b.seen {
            let row = st.as_mut_ptr().add(j * BLOCK);
            for (g, (mx, sm)) in max.iter().zip(&mut sum).enumerate().take(groups) {
                let x = _mm512_sub_ps(_mm512_loadu_ps(row.add(16 * g)), *mx);
                // Masked lanes, and weights below e⁻⁸⁷ (no subnormal products), are 0.
                let keep =
                    _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(b.lanes(j, g), x, _mm512_set1_ps(-87.0));
                let e = _mm512_maskz_mov_ps(keep, exp(x));
                _mm512_storeu_ps(row.add(16 * g), e);
                *sm = _mm512_add_ps(*sm, e);
            }
        }
        for (g, sm) in sum.iter().enumerate().take(groups) {
            let one = _mm512_set1_ps(1.0);
            _mm512_storeu_ps(inv.as_mut_ptr().add(16 * g), _mm512_div_ps(one, *sm));
        }
    }
}

/// eˣ for x ≤ 0 (Cephes' reduction and polynomial, as `math::exp_f32`, with
/// fused multiply-adds; ≈1 ulp) for x ≥ −87; the caller zeroes what is below.
#[inline(always)]
unsafe fn exp(x: __m512) -> __m512 {
    // SAFETY: register arithmetic; the caller enabled AVX-512F.
    unsafe {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let e = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
        _mm512_scalef_ps(_mm512_add_ps(e, _mm512_set1_ps(1.0)), n)
    }
}

/// out[r] = inv[r] · Σ_j st[j, r] · v[j], R rows of HV vectors at a time.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn values<const HV: usize, const R: usize>(b: &Block, st: &[f32], inv: &[f32]) {
    for r0 in (0..b.rows).step_by(R) {
        let keys = b.keys_for((r0 + R).min(b.rows));
        // SAFETY (whole body): rows j < seen of v and st; output rows r0 + r < rows.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); HV]; R];
            for j in 0..keys {
                let v = b.v.add(j * b.v_stride);
                let ahead = b.v.wrapping_add((j + AHEAD) * b.v_stride);
                for h in 0..HV {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * h).cast());
                }
                let ahead = st.as_ptr().wrapping_add((j + AHEAD) * BLOCK + r0);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                let mut vv = [_mm512_setzero_ps(); HV];
                for (h, x) in vv.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(v.add(16 * h));
                }
                let p = st.as_ptr().add(j * BLOCK + r0);
                for (r, row) in acc.iter_mut().enumerate() {
                    let pr = _mm512_set1_ps(*p.add(r));
                    for h in 0..HV {
                        row[h] = _mm512_fmadd_ps(pr, vv[h], row[h]);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate().take(b.rows - r0) {
                let o = b.out.add((r0 + r) * b.out_stride);
                let scale = _mm512_set1_ps(inv[r0 + r]);
                for (h, x) in row.iter().enumerate() {
                    _mm512_storeu_ps(o.add(16 * h), _mm512_mul_ps(*x, scale));
                }
            }
        }
    }
}
