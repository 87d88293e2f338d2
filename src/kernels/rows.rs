//! Per-row primitives (dot, axpy, sums, maxima, softmax) written as plain
//! loops over fixed-width lane arrays, and [`dispatch!`], which compiles a
//! generic body for AVX2+FMA and for AVX-512 and picks one at run time.

use super::math::exp_f32;

/// The generic loops compiled for AVX2 and AVX-512 (the default x86-64
/// target has only SSE2), picked by [`super::active`] (`name`) or a given path
/// (`name_on`). Rust never fuses `a * b + c`, so all paths give the same bits;
/// a body written as `GENERIC::<fma>` opts into fused multiply-adds on the
/// paths that have them ([`super::math::madd`]) and differs there by rounding.
macro_rules! dispatch {
    ($($(#[$doc:meta])* $vis:vis fn $name:ident / $on:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $generic:ident;)*) => {$(
        $crate::kernels::rows::dispatch!(@one $(#[$doc])* $vis fn $name / $on($($arg: $ty),*) $(-> $ret)? = $generic, $generic);
    )*};
    // `GENERIC::<fma>`: GENERIC::<true> where the path has FMA, ::<false> where not.
    ($(#[$doc:meta])* $vis:vis fn $name:ident / $on:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $generic:ident::<fma>;) => {
        $crate::kernels::rows::dispatch!(@one $(#[$doc])* $vis fn $name / $on($($arg: $ty),*) $(-> $ret)? = $generic::<true>, $generic::<false>);
    };
    (@one $(#[$doc:meta])* $vis:vis fn $name:ident / $on:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $fast:path, $plain:path) => {
        $(#[$doc])*
        #[inline]
        #[allow(dead_code)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            $on($crate::kernels::active(), $($arg),*)
        }

        #[inline]
        #[allow(dead_code)]
        pub(crate) fn $on(path: $crate::kernels::Path, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma,f16c")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? { $fast($($arg),*) }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? { $fast($($arg),*) }
                match path.isa() {
                    // SAFETY: a Path exists only for an ISA the CPU supports.
                    $crate::kernels::Isa::Avx512 => return unsafe { v4($($arg),*) },
                    // SAFETY: as above.
                    $crate::kernels::Isa::Avx2 => return unsafe { v3($($arg),*) },
                    $crate::kernels::Isa::Portable => {}
                }
            }
            let _ = path;
            $plain($($arg),*)
        }
    };
}
pub(super) use dispatch;

/// Σ x² with 8 independent accumulators (vectorises, and is more accurate
/// than one running sum).
#[inline(always)]
pub(super) fn sum_sq(row: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] += c[k] * c[k];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().map(|v| v * v).sum::<f32>()
}

/// The largest value, with 16 running maxima so it vectorises (a fold over
/// `f32::max` is a serial chain of NaN-aware compares).
#[inline(always)]
pub(crate) fn max_of(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..16 {
            acc[k] = if c[k] > acc[k] { c[k] } else { acc[k] };
        }
    }
    tail.iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

#[inline(always)]
fn max_and_exp_sum_generic(row: &[f32]) -> (f32, f64) {
    let max = max_of(row);
    let whole = row.len() / 16 * 16;
    let mut sum = 0f64;
    // f32 lanes, flushed to f64 every 4096 values to keep the sum exact enough
    // for a vocabulary-sized row.
    for block in row[..whole].chunks(4096) {
        let mut acc = [0f32; 16];
        for c in block.chunks_exact(16) {
            for k in 0..16 {
                acc[k] += exp_f32(c[k] - max);
            }
        }
        sum += acc.iter().map(|&v| v as f64).sum::<f64>();
    }
    sum += row[whole..]
        .iter()
        .map(|&v| exp_f32(v - max) as f64)
        .sum::<f64>();
    (max, sum)
}

/// In-place softmax of `row[..valid]`; entries from `valid` on become 0
/// (the causal mask).
#[inline(always)]
pub(super) fn softmax_row_generic(row: &mut [f32], valid: usize) {
    let (live, masked) = row.split_at_mut(valid);
    let max = max_of(live);
    let mut acc = [0f32; 16];
    let mut chunks = live.chunks_exact_mut(16);
    for c in &mut chunks {
        for k in 0..16 {
            c[k] = exp_f32(c[k] - max);
            acc[k] += c[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp_f32(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|v| *v *= inv);
    masked.fill(0.0);
}

#[inline(always)]
fn axpy_generic(a: f32, x: &[f32], y: &mut [f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// The sum of 16 lanes as a halving tree (lane i + lane i+8, then +4, +2,
/// +1): the order in which the SIMD kernels fold their registers, so that
/// every path rounds alike.
#[inline(always)]
pub(super) fn reduce16(mut acc: [f32; 16]) -> f32 {
    for w in [8, 4, 2, 1] {
        for i in 0..w {
            acc[i] += acc[i + w];
        }
    }
    acc[0]
}

/// The sum of 32 lanes: lane i + lane i+16 (the dot kernels' four 8-lane
/// or two 16-lane registers added pairwise), then [`reduce16`].
#[inline(always)]
pub(super) fn reduce32(acc: [f32; 32]) -> f32 {
    let mut half = [0f32; 16];
    for (i, h) in half.iter_mut().enumerate() {
        *h = acc[i] + acc[i + 16];
    }
    reduce16(half)
}

/// `folded` plus Σ x·w of the elements after the last whole 16, summed in
/// order (nothing added when there are none). The tail is a call, not
/// inlined, so that the dot kernels stay small enough to inline into their
/// row loops.
#[inline(always)]
pub(super) fn add_tail<T: Copy>(folded: f32, x: &[f32], w: &[T], widen: impl Fn(T) -> f32) -> f32 {
    #[cold]
    #[inline(never)]
    fn tail<T: Copy>(x: &[f32], w: &[T], widen: impl Fn(T) -> f32) -> f32 {
        x.iter().zip(w).map(|(a, &b)| a * widen(b)).sum::<f32>()
    }
    if x.is_empty() {
        folded
    } else {
        folded + tail(x, w, widen)
    }
}

/// Σ a·b. The contract the f32 and f16 dot kernels follow on every path,
/// so that they give the same bits for the same f32 weights: element i of
/// the whole 16s goes to lane i % 32 as `lane += a·b` (a product, then a
/// sum: no FMA), the lanes fold by [`reduce32`], and the tail's products
/// are summed in order and added last ([`add_tail`]). 32 lanes are four
/// chains of adds in 8-lane registers: with two, the adds' latency held the
/// f16 kernel to about 30 GB/s a core, too close to its share of memory to
/// keep up with it.
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b, |v| v)
}

/// [`dot_portable`]'s contract for b of any type, `widen`ed to f32; a and
/// b of equal length. Whole 32s, then at most one 16 into lanes 0..16, in
/// fixed-size chunks so that the compiler can vectorise the portable path.
#[inline(always)]
pub(super) fn dot_lanes<T: Copy>(a: &[f32], b: &[T], widen: impl Fn(T) -> f32) -> f32 {
    let whole = a.len() / 16 * 16;
    let mut acc = [0f32; 32];
    let (ca, cb) = (a[..whole].chunks_exact(32), b[..whole].chunks_exact(32));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..32 {
            acc[k] += x[k] * widen(y[k]);
        }
    }
    for (k, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[k] += x * widen(*y);
    }
    add_tail(reduce32(acc), &a[whole..], &b[whole..], widen)
}

#[inline(always)]
fn sum_generic(a: &[f32]) -> f32 {
    // Four vectors of partial sums, so the adds' latency never limits the read.
    let mut acc = [0f32; 64];
    let c = a.chunks_exact(64);
    let tail = c.remainder();
    for x in c {
        for k in 0..64 {
            acc[k] += x[k];
        }
    }
    acc.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

/// Σ a·b on `path` ([`dot_portable`]'s contract, written out with
/// intrinsics: the compiler's vectorisation of the generic loop and fold is
/// poor).
pub(crate) fn dot_on(path: super::Path, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports.
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx512 => unsafe { avx512::dot(a, b) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx2 => unsafe { avx2::dot(a, b) },
        _ => dot_portable(a, b),
    }
}

/// out[j] = scale · (a · row j), for the rows of a's width at `rows`,
/// `stride` apart: [`dot_on`] for every row (the same bits), without a call
/// and a dispatch per row (decoding's attention scores).
///
/// # Panics
/// If the last row would end past `rows`.
pub(crate) fn dot_rows_on(
    path: super::Path,
    a: &[f32],
    rows: &[f32],
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    let w = a.len();
    assert!(out.is_empty() || (out.len() - 1) * stride + w <= rows.len());
    let row = |j: usize| &rows[j * stride..j * stride + w];
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports.
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx512 => unsafe { avx512::dot_rows(a, rows, stride, scale, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx2 => unsafe { avx2::dot_rows(a, rows, stride, scale, out) },
        _ => out
            .iter_mut()
            .enumerate()
            .for_each(|(j, o)| *o = scale * dot_portable(a, row(j))),
    }
}

/// out += Σ_j p[j] · row j, for the rows of out's width at `rows`, `stride`
/// apart: [`axpy_on`] for every row in turn (the same bits), with out kept
/// in registers (decoding's attention-weighted values).
///
/// # Panics
/// If the last row would end past `rows`.
pub(crate) fn axpy_rows_on(
    path: super::Path,
    p: &[f32],
    rows: &[f32],
    stride: usize,
    out: &mut [f32],
) {
    let w = out.len();
    assert!(p.is_empty() || (p.len() - 1) * stride + w <= rows.len());
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports; the rows
        // are in bounds (checked above).
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx512 => unsafe { avx512::axpy_rows(p, rows, stride, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        super::Isa::Avx2 => unsafe { avx2::axpy_rows(p, rows, stride, out) },
        _ => {
            for (j, &pj) in p.iter().enumerate() {
                axpy_generic(pj, &rows[j * stride..j * stride + w], out);
            }
        }
    }
}

/// The columns from `from` on, one at a time: out[c] += Σ_j p[j]·row j[c].
#[inline(always)]
fn axpy_rows_tail(p: &[f32], rows: &[f32], stride: usize, out: &mut [f32], from: usize) {
    for (c, o) in out.iter_mut().enumerate().skip(from) {
        for (j, &pj) in p.iter().enumerate() {
            *o += pj * rows[j * stride + c];
        }
    }
}

/// Defines `dot_rows(a, rows, stride, scale, out)` in a SIMD module:
/// out[j] = scale · dot(a, row j) for rows of a's width `stride` apart,
/// with that module's `dot` for weights of type `$t` (a type parameter
/// when `$t: $bound` is given); the caller checks the bounds. A function of
/// each module, compiled with its features, so that `dot` inlines into the
/// loop: a closure or function from outside, compiled without them, keeps
/// it a call.
#[cfg(target_arch = "x86_64")]
macro_rules! dot_rows_with {
    ($features:literal, $t:ty) => {
        $crate::kernels::rows::dot_rows_with!(@fn $features, [], $t);
    };
    ($features:literal, $t:ident: $bound:path) => {
        $crate::kernels::rows::dot_rows_with!(@fn $features, [$t: $bound], $t);
    };
    (@fn $features:literal, [$($g:tt)*], $t:ty) => {
        #[target_feature(enable = $features)]
        pub(in crate::kernels) unsafe fn dot_rows<$($g)*>(
            a: &[f32],
            rows: &[$t],
            stride: usize,
            scale: f32,
            out: &mut [f32],
        ) {
            for (j, o) in out.iter_mut().enumerate() {
                // SAFETY: a Path exists only for a CPU with these features.
                *o = scale * unsafe { dot(a, &rows[j * stride..j * stride + a.len()]) };
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(super) use dot_rows_with;

/// Defines `axpy_rows(p, rows, stride, out)` in an AVX-512 module: out +=
/// Σ_j p[j] · row j for rows of out's width `stride` apart, read as f32 by
/// that module's `load16` (rows of type `$t`, a type parameter when
/// `$t: $bound` is given); the caller checks the bounds. Columns go 128 at a
/// time (eight registers), then in one strip each of 64, 32 and 16 where
/// they remain: a head of 64, 96 or 128 takes one or two passes over its
/// rows, not one per 16 columns (each pass reads a line of every row
/// again). Each column adds its rows in order, the tail by the module's
/// parent's `axpy_rows_tail`.
#[cfg(target_arch = "x86_64")]
macro_rules! axpy_rows_avx512 {
    ($t:ty) => {
        $crate::kernels::rows::axpy_rows_avx512!(@fn [], [], $t);
    };
    ($t:ident: $bound:path) => {
        $crate::kernels::rows::axpy_rows_avx512!(@fn [$t: $bound,], [$t,], $t);
    };
    (@fn [$($g:tt)*], [$($n:tt)*], $t:ty) => {
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        pub(in crate::kernels) unsafe fn axpy_rows<$($g)*>(
            p: &[f32],
            rows: &[$t],
            stride: usize,
            out: &mut [f32],
        ) {
            let whole = out.len() / 16 * 16;
            let (rp, op) = (rows.as_ptr(), out.as_mut_ptr());
            let mut c = 0;
            // SAFETY: columns below `whole` of every row are in bounds.
            unsafe {
                while c + 128 <= whole {
                    axpy_cols::<$($n)* 8>(p, rp.add(c), stride, op.add(c));
                    c += 128;
                }
                if c + 64 <= whole {
                    axpy_cols::<$($n)* 4>(p, rp.add(c), stride, op.add(c));
                    c += 64;
                }
                if c + 32 <= whole {
                    axpy_cols::<$($n)* 2>(p, rp.add(c), stride, op.add(c));
                    c += 32;
                }
                if c < whole {
                    axpy_cols::<$($n)* 1>(p, rp.add(c), stride, op.add(c));
                }
            }
            super::axpy_rows_tail(p, rows, stride, out, whole);
        }

        /// out[..16N] += Σ_j p[j] · row j[..16N], the rows `stride` apart from rp.
        #[inline]
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        unsafe fn axpy_cols<$($g)* const N: usize>(
            p: &[f32],
            rp: *const $t,
            stride: usize,
            out: *mut f32,
        ) {
            // SAFETY: the caller guarantees 16N columns at out and in every row.
            unsafe {
                let mut acc: [__m512; N] =
                    std::array::from_fn(|i| _mm512_loadu_ps(out.add(16 * i)));
                for (j, &pj) in p.iter().enumerate() {
                    let pj = _mm512_set1_ps(pj);
                    let row = rp.add(j * stride);
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(pj, load16(row.add(16 * i))));
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(out.add(16 * i), *a);
                }
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(super) use axpy_rows_avx512;

/// Defines `axpy_rows(p, rows, stride, out)` in an AVX2 module, as
/// [`axpy_rows_avx512`] does with that module's `load8`: columns go 64 at a
/// time (eight registers, one pass over the rows for a head of 64), then 8
/// at a time; each column adds its rows in order.
#[cfg(target_arch = "x86_64")]
macro_rules! axpy_rows_avx2 {
    ($t:ty) => {
        $crate::kernels::rows::axpy_rows_avx2!(@fn [], [], $t);
    };
    ($t:ident: $bound:path) => {
        $crate::kernels::rows::axpy_rows_avx2!(@fn [$t: $bound,], [$t,], $t);
    };
    (@fn [$($g:tt)*], [$($n:tt)*], $t:ty) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::kernels) unsafe fn axpy_rows<$($g)*>(
            p: &[f32],
            rows: &[$t],
            stride: usize,
            out: &mut [f32],
        ) {
            let whole = out.len() / 8 * 8;
            let (rp, op) = (rows.as_ptr(), out.as_mut_ptr());
            let mut c = 0;
            // SAFETY: columns below `whole` of every row are in bounds.
            unsafe {
                while c + 64 <= whole {
                    axpy_cols::<$($n)* 8>(p, rp.add(c), stride, op.add(c));
                    c += 64;
                }
                while c < whole {
                    axpy_cols::<$($n)* 1>(p, rp.add(c), stride, op.add(c));
                    c += 8;
                }
            }
            super::axpy_rows_tail(p, rows, stride, out, whole);
        }

        /// out[..8N] += Σ_j p[j] · row j[..8N], the rows `stride` apart from rp.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn axpy_cols<$($g)* const N: usize>(
            p: &[f32],
            rp: *const $t,
            stride: usize,
            out: *mut f32,
        ) {
            // SAFETY: the caller guarantees 8N columns at out and in every row.
            unsafe {
                let mut acc: [__m256; N] =
                    std::array::from_fn(|i| _mm256_loadu_ps(out.add(8 * i)));
                for (j, &pj) in p.iter().enumerate() {
                    let pj = _mm256_set1_ps(pj);
                    let row = rp.add(j * stride);
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(pj, load8(row.add(8 * i))));
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(8 * i), *a);
                }
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(super) use axpy_rows_avx2;

/// 256-bit registers: the 32 lanes of the dot contract are four registers.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    /// The lanes (0..8, 8..16) folded as [`super::reduce16`] does.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) fn fold16(lo: __m256, hi: __m256) -> f32 {
        let v = _mm256_add_ps(lo, hi);
        let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps::<0b01>(v, v)))
    }

    /// The 32 lanes of [`super::dot_portable`]'s contract over 0..whole (a
    /// multiple of 16), `p(i)` the eight products at i, folded.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) fn fold32(whole: usize, p: impl Fn(usize) -> __m256) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= whole {
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, p(i + 8 * r));
            }
            i += 32;
        }
        if i < whole {
            acc[0] = _mm256_add_ps(acc[0], p(i));
            acc[1] = _mm256_add_ps(acc[1], p(i + 8));
        }
        fold16(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]))
    }

    /// a and b of equal length.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let whole = a.len() / 16 * 16;
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        // SAFETY: every load is within 0..whole of both slices.
        let p = |i: usize| unsafe {
            _mm256_mul_ps(_mm256_loadu_ps(ap.add(i)), _mm256_loadu_ps(bp.add(i)))
        };
        super::add_tail(fold32(whole, p), &a[whole..], &b[whole..], |v| v)
    }

    super::dot_rows_with!("avx2,fma,f16c", f32);

    /// 8 f32 at `p`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable values.
        unsafe { _mm256_loadu_ps(p) }
    }

    super::axpy_rows_avx2!(f32);
}

/// 512-bit registers: the 32 lanes of the dot contract are two registers.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    /// The 16 lanes folded as [`super::reduce16`] does.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(in crate::kernels) fn fold16(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        super::avx2::fold16(lo, hi)
    }

    /// The 32 lanes of [`super::dot_portable`]'s contract over 0..whole (a
    /// multiple of 16), `p(i)` the sixteen products at i, folded.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(in crate::kernels) fn fold32(whole: usize, p: impl Fn(usize) -> __m512) -> f32 {
        let (mut lo, mut hi) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= whole {
            lo = _mm512_add_ps(lo, p(i));
            hi = _mm512_add_ps(hi, p(i + 16));
            i += 32;
        }
        if i < whole {
            lo = _mm512_add_ps(lo, p(i));
        }
        fold16(_mm512_add_ps(lo, hi))
    }

    /// a and b of equal length.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let whole = a.len() / 16 * 16;
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        // SAFETY: every load is within 0..whole of both slices.
        let p = |i: usize| unsafe {
            _mm512_mul_ps(_mm512_loadu_ps(ap.add(i)), _mm512_loadu_ps(bp.add(i)))
        };
        super::add_tail(fold32(whole, p), &a[whole..], &b[whole..], |v| v)
    }

    super::dot_rows_with!("avx512f,avx2,fma,f16c", f32);

    /// 16 f32 at `p`, as [`axpy_rows`] reads rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable values.
        unsafe { _mm512_loadu_ps(p) }
    }

    super::axpy_rows_avx512!(f32);
}

dispatch! {
    pub(super) fn axpy / axpy_on(a: f32, x: &[f32], y: &mut [f32]) = axpy_generic;
    pub(super) fn softmax_row / softmax_row_on(row: &mut [f32], valid: usize) = softmax_row_generic;
    /// The row's maximum and Σ exp(v − max): a log-softmax's two reductions,
    /// vectorised (the output layer's rows are vocabulary-sized).
    pub fn max_and_exp_sum / max_and_exp_sum_on(row: &[f32]) -> (f32, f64) = max_and_exp_sum_generic;
    /// Σ a, vectorised: the streaming read the benchmark measures bandwidth with.
    pub fn sum / sum_on(a: &[f32]) -> f32 = sum_generic;
}

#[cfg(test)]
mod tests {
    use super::super::Path;
    use super::*;

    #[test]
    fn strided_row_batches_give_the_bits_of_row_by_row_dots() {
        // Widths around the 16- and 32-lane steps and row counts around the 4-row pass.
        for (n, stride) in [
            (1, 3),
            (15, 15),
            (16, 20),
            (17, 17),
            (48, 50),
            (64, 70),
            (100, 100),
        ] {
            for rows in [0, 1, 3, 4, 5, 8, 11] {
                let w = wild(stride * rows.max(1), 7);
                let x = wild(n, 11);
                for path in Path::all() {
                    let mut got = vec![0f32; rows];
                    dot_rows_on(path, &x, &w, stride, 0.125, &mut got);
                    for (j, g) in got.iter().enumerate() {
                        let want = 0.125 * dot_on(path, &x, &w[j * stride..j * stride + n]);
                        let at = format!("n={n} rows={rows} row {j} {:?}", path.isa());
                        assert_eq!(g.to_bits(), want.to_bits(), "{at}");
                    }
                }
            }
        }
    }

    /// Values of both signs and many magnitudes, so rounding differs with
    /// the order of additions (a reordering would show in the bits).
    fn wild(n: usize, salt: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i.wrapping_mul(2_654_435_761) ^ salt).wrapping_mul(40_503);
                let m = (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                m * [1e-3f32, 0.1, 1.0, 30.0][(h & 3) as usize]
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn every_path_gives_the_portable_bits() {
        let portable = Path::new(crate::kernels::Isa::Portable).unwrap();
        for path in Path::all() {
            // Lengths around the 16-, 32- and 64-wide chunks, and vocabulary-sized.
            for n in [
                0, 1, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 768, 4099, 50_304,
            ] {
                let (a, b) = (wild(n, 1), wild(n, 2));
                let at = |p| (n, path.isa(), p);
                let want = dot_on(portable, &a, &b);
                assert_eq!(
                    dot_on(path, &a, &b).to_bits(),
                    want.to_bits(),
                    "{:?}",
                    at("dot")
                );
                let (mut y, mut z) = (b.clone(), b.clone());
                axpy_on(portable, 0.37, &a, &mut y);
                axpy_on(path, 0.37, &a, &mut z);
                assert_eq!(bits(&z), bits(&y), "{:?}", at("axpy"));
                assert_eq!(sum_on(path, &a).to_bits(), sum_on(portable, &a).to_bits());
                let (m, e) = max_and_exp_sum_on(path, &a);
                let (pm, pe) = max_and_exp_sum_on(portable, &a);
                assert_eq!(
                    (m.to_bits(), e.to_bits()),
                    (pm.to_bits(), pe.to_bits()),
                    "{:?}",
                    at("lse")
                );
                let valid = n * 2 / 3;
                let (mut s, mut t) = (a.clone(), a.clone());
                softmax_row_on(portable, &mut s, valid);
                softmax_row_on(path, &mut t, valid);
                assert_eq!(bits(&t), bits(&s), "{:?}", at("softmax"));
            }
        }
    }

    #[test]
    fn row_batches_give_the_bits_of_row_by_row_kernels() {
        for path in Path::all() {
            // Widths of 64-column groups, 8-column ones and a tail, and none;
            // 240 takes AVX-512's strips of 128, 64, 32 and 16 columns.
            let shapes = [
                (64, 64, 37),
                (240, 250, 6),
                (48, 48, 3),
                (24, 40, 5),
                (17, 17, 1),
                (64, 256, 0),
                (141, 150, 9),
            ];
            for (w, stride, n) in shapes {
                let a = wild(w, 5);
                let rows = wild(n.max(1) * stride, 6);
                let mut got = vec![0f32; n];
                dot_rows_on(path, &a, &rows, stride, 0.125, &mut got);
                let want: Vec<f32> = (0..n)
                    .map(|j| 0.125 * dot_on(path, &a, &rows[j * stride..j * stride + w]))
                    .collect();
                assert_eq!(bits(&got), bits(&want), "dots w={w} n={n} {:?}", path.isa());
                let p = wild(n, 7);
                let (mut y, mut z) = (wild(w, 8), wild(w, 8));
                axpy_rows_on(path, &p, &rows, stride, &mut z);
                for (j, &pj) in p.iter().enumerate() {
                    axpy_on(path, pj, &rows[j * stride..j * stride + w], &mut y);
                }
                assert_eq!(bits(&z), bits(&y), "axpys w={w} n={n} {:?}", path.isa());
            }
        }
    }

    #[test]
    fn dot_is_accurate() {
        // Against an f64 sum: the lane order is a fixed, not a careless, one.
        for n in [1, 16, 33, 768, 3072] {
            let (a, b) = (wild(n, 3), wild(n, 4));
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let scale: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64 * *y as f64).abs())
                .sum();
            let got = dot_on(super::super::active(), &a, &b) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * scale.max(1e-30),
                "n={n}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn sum_matches_f64_sum() {
        // Lengths around the 64-wide chunks, so the tail is exercised too.
        for n in [0, 1, 63, 64, 65, 1000, 4099] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 8.0)
                .collect();
            let want: f64 = v.iter().map(|&x| x as f64).sum();
            assert!((sum(&v) as f64 - want).abs() < 1e-3, "n={n}");
        }
    }
}
