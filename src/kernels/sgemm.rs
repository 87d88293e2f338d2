//! The f32 matrix product of the AVX2 path: both operands packed into
//! contiguous panels and multiplied by a 6×16 register tile (twelve
//! accumulators, two FMAs per broadcast), blocked for the caches as BLIS
//! does. On Zen 3 it runs well ahead of the gemm crate's AVX2 kernels
//! (docs/PERFORMANCE.md); the AVX-512 and portable paths keep the crate.

use std::cell::RefCell;

use rayon::prelude::*;

/// Rows of the register tile.
const MR: usize = 6;
/// Columns of the register tile: two 8-lane registers.
const NR: usize = 16;
/// Depth of one packed block at most: a 16-column panel of B (24 KiB)
/// stays in L1 beside one of A. Deeper blocks mean fewer passes over dst;
/// 384 measured best on Zen 3 among 256, 320, 384 and 512.
const KC: usize = 384;
/// Rows of A packed per block at most (216 KiB, in L2).
const MC: usize = 144;
/// Columns of B packed per block at most (4 MiB, in L3).
const NC: usize = 4080;

/// An operand: element (i, j) at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(super) struct Operand<T> {
    pub ptr: T,
    pub rs: isize,
    pub cs: isize,
}

// SAFETY: the pointers are only dereferenced inside `sgemm`, whose contract
// makes them valid for its whole run; tasks write disjoint parts of dst.
unsafe impl<T> Send for Operand<T> {}
unsafe impl<T> Sync for Operand<T> {}

macro_rules! at {
    ($ptr:ty) => {
        impl Operand<$ptr> {
            /// The operand from element (i, j) on.
            ///
            /// # Safety
            /// (i, j) must be inside the operand.
            unsafe fn at(self, i: usize, j: usize) -> Self {
                // SAFETY: the caller's contract.
                let ptr = unsafe { self.ptr.offset(i as isize * self.rs + j as isize * self.cs) };
                Operand { ptr, ..self }
            }
        }
    };
}
at!(*const f32);
at!(*mut f32);

thread_local! {
    /// Each thread's packed blocks, reused across calls.
    static PACKED_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static PACKED_B: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's buffer `cell` grown to `len` elements (or on a
/// fresh one if the buffer is in use further up this thread's stack, as when
/// a rayon worker that is packing steals another product's task).
fn with_buffer<R>(
    cell: &'static std::thread::LocalKey<RefCell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    cell.with(|c| match c.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0.0);
            }
            f(&mut v[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// dst = scale · lhs · rhs for [m, k] · [k, n], over `threads` rayon tasks
/// at most (1: on the calling thread). dst is written, never read.
///
/// # Safety
/// The operands must address m×k, k×n and m×n valid elements, dst must not
/// overlap the inputs, and the CPU must have AVX2 and FMA.
pub(super) unsafe fn sgemm(
    (m, n, k): (usize, usize, usize),
    dst: Operand<*mut f32>,
    lhs: Operand<*const f32>,
    rhs: Operand<*const f32>,
    scale: f32,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                // SAFETY: (i, j) is inside dst.
                unsafe { *dst.at(i, j).ptr = 0.0 };
            }
        }
        return;
    }
    let threads = threads.max(1);
    // Blocks of equal depth: 768 as 2 × 384, not 384 + 384 + 0 or 256 × 3.
    let kc_max = k.div_ceil(k.div_ceil(KC));
    // Row blocks: a multiple of the thread count, so every thread gets as
    // many; with too few rows for that, the columns are split instead.
    let per_thread = m.div_ceil(threads * MC);
    let mc = m
        .div_ceil(per_thread * threads)
        .next_multiple_of(MR)
        .min(MC);
    let row_blocks = m.div_ceil(mc);
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        let panels = nc.div_ceil(NR);
        let col_groups = if row_blocks < threads {
            threads.min(panels)
        } else {
            1
        };
        for pc in (0..k).step_by(kc_max) {
            let kc = kc_max.min(k - pc);
            with_buffer(&PACKED_B, panels * kc * NR, |bp| {
                // SAFETY: (pc, jc) is inside rhs.
                let b = unsafe { rhs.at(pc, jc) };
                let pack = |(p, panel): (usize, &mut [f32])| {
                    // SAFETY: rows pc.., columns jc + p·NR.. are inside rhs.
                    unsafe { pack_b(panel, b, kc, p * NR, nc) }
                };
                if threads > 1 && panels > 1 {
                    bp.par_chunks_mut(kc * NR).enumerate().for_each(pack);
                } else {
                    bp.chunks_mut(kc * NR).enumerate().for_each(pack);
                }
                let bp: &[f32] = bp;
                let task = |t: usize| {
                    let (ib, g) = (t / col_groups, t % col_groups);
                    let (ic, mb) = (ib * mc, mc.min(m - ib * mc));
                    let first = g * panels / col_groups;
                    let last = (g + 1) * panels / col_groups;
                    with_buffer(&PACKED_A, mb.div_ceil(MR) * MR * kc, |ap| {
                        // SAFETY: (ic, pc) is inside lhs.
                        let a = unsafe { lhs.at(ic, pc) };
                        // SAFETY: rows ic..ic + mb, columns pc..pc + kc are
                        // inside lhs; this task owns rows ic.. of panels
                        // first..last of dst.
                        unsafe {
                            pack_a(ap, a, mb, kc);
                            block(
                                (mb, nc, kc),
                                (first, last),
                                ap,
                                bp,
                                dst.at(ic, jc),
                                scale,
                                pc > 0,
                            )
                        }
                    })
                };
                let tasks = row_blocks * col_groups;
                if threads > 1 && tasks > 1 {
                    (0..tasks).into_par_iter().for_each(task);
                } else {
                    (0..tasks).for_each(task);
                }
            });
        }
    }
}

/// Packs kc rows of B's columns j0..j0 + NR (of nc) as kc rows of NR
/// contiguous values, zeros past column nc.
///
/// # Safety
/// `b` must address kc × nc valid elements; the CPU must have AVX2.
unsafe fn pack_b(panel: &mut [f32], b: Operand<*const f32>, kc: usize, j0: usize, nc: usize) {
    // Column j of B is line j of its transpose.
    let bt = Operand {
        rs: b.cs,
        cs: b.rs,
        ..b
    };
    // SAFETY: columns j0.. < nc of kc rows are inside b.
    unsafe { pack::<NR>(panel, bt.at(j0, 0), NR.min(nc - j0), kc) }
}

/// Packs an mb × kc block of A as panels of MR rows: kc columns of MR
/// contiguous values each, zeros past row mb.
///
/// # Safety
/// `a` must address mb × kc valid elements; the CPU must have AVX2.
unsafe fn pack_a(ap: &mut [f32], a: Operand<*const f32>, mb: usize, kc: usize) {
    if a.rs == 1 {
        // A transposed (a weight gradient's activations): step p of every
        // panel lies in one contiguous line of mb values. A few steps at a
        // time for all panels, so that each line is read from L1 by the
        // panels that share it instead of from L2 once per panel.
        const STEPS: usize = 16;
        let full = mb / MR;
        for p0 in (0..kc).step_by(STEPS) {
            for (r, panel) in ap.chunks_mut(MR * kc).take(full).enumerate() {
                for p in p0..(p0 + STEPS).min(kc) {
                    // SAFETY: rows r·MR..(r + 1)·MR ≤ mb at step p < kc are
                    // inside a, MR values side by side; the panel holds step p.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            a.at(r * MR, p).ptr,
                            panel.as_mut_ptr().add(p * MR),
                            MR,
                        )
                    };
                }
            }
        }
        if full * MR < mb {
            let panel = &mut ap[full * MR * kc..(full + 1) * MR * kc];
            // SAFETY: rows full·MR.. < mb of kc columns are inside a.
            unsafe { pack::<MR>(panel, a.at(full * MR, 0), mb - full * MR, kc) }
        }
        return;
    }
    for (r, panel) in ap.chunks_mut(MR * kc).enumerate() {
        // SAFETY: rows r·MR.. < mb of kc columns are inside a.
        unsafe { pack::<MR>(panel, a.at(r * MR, 0), MR.min(mb - r * MR), kc) }
    }
}

/// panel[p·W + i] = src(i, p) for the first `lines` of W lines (zeros for
/// the rest) and p < kc: W lines interleaved, as the tile reads them.
/// Lines that are contiguous (the usual row-major A, and weights [n, k]
/// for B) go through 8×8 transposes in registers; values of a line that lie
/// side by side (B [k, n]) are copied W at a time.
///
/// # Safety
/// `src` must address lines × kc valid elements; the CPU must have AVX2.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack<const W: usize>(
    panel: &mut [f32],
    src: Operand<*const f32>,
    lines: usize,
    kc: usize,
) {
    use std::arch::x86_64::*;
    assert!(panel.len() >= W * kc && lines <= W);
    if lines < W {
        panel.fill(0.0);
    }
    let out = panel.as_mut_ptr();
    let mut done = 0;
    if src.cs == 1 && lines == W {
        // Eight steps at a time: per group of eight lines, an 8×8 block
        // transposed so each register holds one step's values of the group.
        while done + 8 <= kc {
            for g in (0..W).step_by(8) {
                let load = |i: usize| {
                    if g + i < W {
                        // SAFETY: line g + i < lines, steps done..done + 8 < kc.
                        unsafe { _mm256_loadu_ps(src.at(g + i, done).ptr) }
                    } else {
                        _mm256_setzero_ps()
                    }
                };
                let cols = transpose8(std::array::from_fn(load));
                for (c, v) in cols.iter().enumerate() {
                    // SAFETY: step done + c < kc, lines g.. < W: inside the panel.
                    unsafe {
                        let at = out.add((done + c) * W + g);
                        if W - g >= 8 || c < 7 {
                            // For W = 6, the two values past the step's six
                            // land on the next step's first two, which the
                            // next store writes.
                            _mm256_storeu_ps(at, *v);
                        } else {
                            // The group's last step: exactly six values
                            // (a masked store is microcoded on Zen).
                            debug_assert_eq!(W - g, 6);
                            _mm_storeu_ps(at, _mm256_castps256_ps128(*v));
                            let high = _mm256_extractf128_ps::<1>(*v);
                            _mm_storel_epi64(at.add(4).cast(), _mm_castps_si128(high));
                        }
                    }
                }
            }
            done += 8;
        }
    }
    if src.rs == 1 && lines == W {
        for p in done..kc {
            // SAFETY: W values side by side at step p < kc; the panel holds them.
            unsafe { std::ptr::copy_nonoverlapping(src.at(0, p).ptr, out.add(p * W), W) };
        }
        return;
    }
    for i in 0..lines {
        for p in done..kc {
            // SAFETY: line i < lines, step p < kc.
            panel[p * W + i] = unsafe { *src.at(i, p).ptr };
        }
    }
}

/// The transpose of the 8×8 block whose rows are `r`: register c holds
/// every row's value c.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn transpose8(r: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    // Values 0, 1 (then 2, 3) of rows 0..4 and of rows 4..8, per 128-bit half.
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// One packed block: the register tiles of rows 0..mb and B panels
/// first..last, B's panel outermost so it stays in L1 while A's panels
/// stream from L2. `accumulate`: add to dst instead of overwriting it.
///
/// # Safety
/// dst must address mb × nc valid elements; the packed blocks must hold
/// mb (rounded up to MR) × kc and nc (rounded up to NR) × kc values.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    (mb, nc, kc): (usize, usize, usize),
    (first, last): (usize, usize),
    ap: &[f32],
    bp: &[f32],
    dst: Operand<*mut f32>,
    scale: f32,
    accumulate: bool,
) {
    let mut edge = [0f32; MR * NR];
    for jp in first..last {
        let (j, cols) = (jp * NR, NR.min(nc - jp * NR));
        let b = &bp[jp * kc * NR..(jp + 1) * kc * NR];
        for (ip, a) in ap.chunks(MR * kc).enumerate() {
            let (i, rows) = (ip * MR, MR.min(mb - ip * MR));
            // SAFETY: (i, j) is inside dst.
            let c = unsafe { dst.at(i, j) }.ptr;
            if rows == MR && cols == NR && dst.cs == 1 {
                // SAFETY: a full tile of dst, rows dst.rs apart; AVX2+FMA by
                // the caller's contract.
                unsafe { tile(kc, a, b, c, dst.rs, scale, accumulate) };
            } else {
                // SAFETY: the tile lands in `edge` (rows NR apart), of which
                // the part inside dst is copied.
                unsafe {
                    tile(kc, a, b, edge.as_mut_ptr(), NR as isize, scale, false);
                    for r in 0..rows {
                        for s in 0..cols {
                            let d = c.offset(r as isize * dst.rs + s as isize * dst.cs);
                            let v = edge[r * NR + s];
                            *d = if accumulate { *d + v } else { v };
                        }
                    }
                }
            }
        }
    }
}

/// c[0..MR, 0..NR] (rows `rs` apart) = scale · a·b (+ c if `accumulate`),
/// a and b packed panels of depth kc.
///
/// # Safety
/// c must address MR rows of NR valid elements; the CPU must have AVX2 and
/// FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile(
    kc: usize,
    a: &[f32],
    b: &[f32],
    c: *mut f32,
    rs: isize,
    scale: f32,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    debug_assert!(a.len() >= kc * MR && b.len() >= kc * NR);
    // The tile of dst is needed only after the kc steps: fetch it now, so
    // its misses overlap the arithmetic.
    for i in 0..MR as isize {
        let row = c.wrapping_offset(i * rs);
        _mm_prefetch::<_MM_HINT_T0>(row as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(NR - 1) as *const i8);
    }
    let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
    let z = _mm256_setzero_ps();
    let mut acc = [[z; 2]; MR];
    // One step: a row of B's panel (two registers) times a column of A's,
    // broadcast value by value.
    macro_rules! step {
        () => {{
            let b0 = _mm256_loadu_ps(pb);
            let b1 = _mm256_loadu_ps(pb.add(8));
            for (i, row) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*pa.add(i));
                row[0] = _mm256_fmadd_ps(x, b0, row[0]);
                row[1] = _mm256_fmadd_ps(x, b1, row[1]);
            }
            pa = pa.add(MR);
            pb = pb.add(NR);
        }};
    }
    for _ in 0..kc / 4 {
        // SAFETY: kc steps of MR and NR values are inside the panels; a
        // prefetch (of A's panel, 16 steps ahead) past their end is harmless.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(16 * MR) as *const i8);
            step!();
            step!();
            step!();
            step!();
        }
    }
    for _ in 0..kc % 4 {
        // SAFETY: as above.
        unsafe { step!() };
    }
    let s = _mm256_set1_ps(scale);
    for (i, row) in acc.iter().enumerate() {
        // SAFETY: row i of the tile, NR values.
        unsafe {
            let p = c.offset(i as isize * rs);
            for (h, v) in row.iter().enumerate() {
                let q = p.add(8 * h);
                let out = if accumulate {
                    _mm256_fmadd_ps(s, *v, _mm256_loadu_ps(q))
                } else {
                    _mm256_mul_ps(s, *v)
                };
                _mm256_storeu_ps(q, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::spread;
    use super::*;

    /// A `rows × cols` matrix stored row by row, or as its transpose.
    fn operand(
        data: &[f32],
        (rows, cols): (usize, usize),
        transposed: bool,
    ) -> Operand<*const f32> {
        let (rs, cs) = if transposed { (1, rows) } else { (cols, 1) };
        Operand {
            ptr: data.as_ptr(),
            rs: rs as isize,
            cs: cs as isize,
        }
    }

    /// Element (i, j) of `data` seen through `op`.
    fn at(data: &[f32], op: Operand<*const f32>, i: usize, j: usize) -> f32 {
        data[i * op.rs as usize + j * op.cs as usize]
    }

    #[test]
    fn products_match_f64_on_every_edge_layout_and_split() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        // Sizes around the tile (6×16) and block (KC, MC) edges; both
        // layouts of A (rows, and transposed as a weight gradient's
        // activations) and of B (wᵀ for the weights, plain for the values),
        // a dst with a wider row stride, a scale, and the split over threads.
        let shapes = [
            (1, 1, 1),
            (5, 15, 3),
            (6, 16, 256),
            (7, 17, 257),
            (13, 33, 600),
            (150, 40, 70),
            (300, 130, 77),
            (11, 200, 513),
        ];
        for (m, n, k) in shapes {
            for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
                for threads in [1, 2, 3] {
                    // One run of the shared deterministic values, split, so a
                    // and b differ.
                    let ab: Vec<f32> = spread(m * k + k * n).to_vec1().unwrap();
                    let (a, b) = ab.split_at(m * k);
                    let scale = 0.75f32;
                    let ld = n + 3;
                    let mut c = vec![f32::NAN; m * ld];
                    // A [m, k] and B [k, n], each stored as itself or as its
                    // transpose (wᵀ for the weights: w [n, k]).
                    let (lhs, rhs) = (operand(a, (m, k), a_t), operand(b, (k, n), b_t));
                    // SAFETY: the operands cover m×k, k×n and m×ld elements.
                    unsafe {
                        sgemm(
                            (m, n, k),
                            Operand {
                                ptr: c.as_mut_ptr(),
                                rs: ld as isize,
                                cs: 1,
                            },
                            lhs,
                            rhs,
                            scale,
                            threads,
                        )
                    };
                    for i in 0..m {
                        for j in 0..n {
                            let (mut want, mut size) = (0f64, 0f64);
                            for p in 0..k {
                                let (av, bv) = (at(a, lhs, i, p), at(b, rhs, p, j));
                                want += av as f64 * bv as f64;
                                size += (av as f64 * bv as f64).abs();
                            }
                            let got = c[i * ld + j] as f64;
                            let want = want * scale as f64;
                            let tol = 1e-6 * size.max(1.0) * (k as f64).sqrt();
                            assert!(
                                (got - want).abs() <= tol,
                                "{m}×{n}×{k} a_t={a_t} b_t={b_t} threads={threads} ({i}, {j}): {got} vs {want}"
                            );
                        }
                        // Past the row's n columns dst is left alone.
                        assert!(c[i * ld + n..(i + 1) * ld].iter().all(|v| v.is_nan()));
                    }
                }
            }
        }
    }
}
