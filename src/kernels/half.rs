//! Dot and axpy against f16 or bf16 weight rows, widened in registers right
//! after the load (half the memory traffic of f32, no conversion buffer).
//! They follow the lane contract of [`super::rows`], so they give the bits of
//! the f32 kernels on the widened weights, on every path.

use ::half::{bf16, f16};

/// A half-precision element: f16 (widened by F16C's `vcvtph2ps`) or bf16
/// (the top half of an f32: widened by a 16-bit shift).
pub(crate) trait Half: Copy + Send + Sync + 'static {
    const BF16: bool;
    fn widen(self) -> f32;
}

impl Half for f16 {
    const BF16: bool = false;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Half for bf16 {
    const BF16: bool = true;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

use super::rows::{add_tail, dot_lanes};
use super::{Isa, Path};
use rayon::prelude::*;

/// `f` on each row of n half-precision values widened into an f32 row, the
/// result rounded back in place; rows in parallel. The row operations of a
/// model computing in bf16 or f16 (Θ, LayerNorm) sum in f32 this way.
pub(crate) fn widened_rows<E: Send>(rows: &mut [E], n: usize, f: impl Fn(&mut [f32]) + Sync)
where
    [E]: ::half::slice::HalfFloatSliceExt,
{
    use ::half::slice::HalfFloatSliceExt;
    rows.par_chunks_mut(n.max(1)).for_each_init(
        || vec![0f32; n],
        |wide, row| {
            row.convert_to_f32_slice(wide);
            f(wide);
            row.convert_from_f32_slice(wide);
        },
    );
}

/// Σ x[i]·w[i] on `path`.
pub(crate) fn dot_on<H: Half>(path: Path, x: &[f32], w: &[H]) -> f32 {
    let n = x.len().min(w.len());
    let (x, w) = (&x[..n], &w[..n]);
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot(x, w) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot(x, w) },
        _ => dot_portable(x, w),
    }
}

/// out[j] = x · row j for the rows of x's width packed in `rows`: [`dot_on`]
/// for each (the same bits) without a call and a dispatch per row.
///
/// # Panics
/// If `rows` holds fewer than out.len() rows.
pub(crate) fn dot_rows_on<H: Half>(path: Path, x: &[f32], rows: &[H], out: &mut [f32]) {
    assert!(rows.len() >= out.len() * x.len());
    dot_rows_strided_on(path, x, rows, x.len(), 1.0, out);
}

/// out[j] = scale · (x · row j) for the f16 rows of x's width at `rows`,
/// `stride` apart: [`super::rows::dot_rows_on`] on the widened rows (the
/// same bits); an f16 KV cache's attention scores.
///
/// # Panics
/// If the last row would end past `rows`.
pub(crate) fn dot_rows_strided_on<H: Half>(
    path: Path,
    x: &[f32],
    rows: &[H],
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    let w = x.len();
    assert!(out.is_empty() || (out.len() - 1) * stride + w <= rows.len());
    let row = |j: usize| &rows[j * stride..j * stride + w];
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports; the rows
        // are in bounds (checked above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot_rows(x, rows, stride, scale, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_rows(x, rows, stride, scale, out) },
        _ => out
            .iter_mut()
            .enumerate()
            .for_each(|(j, o)| *o = scale * dot_portable(x, row(j))),
    }
}

/// out += Σ_j p[j] · row j for the f16 rows of out's width at `rows`,
/// `stride` apart: [`super::rows::axpy_rows_on`] on the widened rows (the
/// same bits); an f16 KV cache's attention-weighted values.
///
/// # Panics
/// If the last row would end past `rows`.
pub(crate) fn axpy_rows_on<H: Half>(
    path: Path,
    p: &[f32],
    rows: &[H],
    stride: usize,
    out: &mut [f32],
) {
    let w = out.len();
    assert!(p.is_empty() || (p.len() - 1) * stride + w <= rows.len());
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports; the rows
        // are in bounds (checked above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::axpy_rows(p, rows, stride, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::axpy_rows(p, rows, stride, out) },
        _ => axpy_rows_tail(p, rows, stride, out, 0),
    }
}

/// The columns from `from` on, one at a time, each adding its rows in order.
#[inline(always)]
fn axpy_rows_tail<H: Half>(p: &[f32], rows: &[H], stride: usize, out: &mut [f32], from: usize) {
    for (c, o) in out.iter_mut().enumerate().skip(from) {
        for (j, &pj) in p.iter().enumerate() {
            *o += pj * rows[j * stride + c].widen();
        }
    }
}

/// y[i] += a·w[i] on `path`.
pub(crate) fn axpy_on<H: Half>(path: Path, a: f32, w: &[H], y: &mut [f32]) {
    let n = y.len().min(w.len());
    let (w, y) = (&w[..n], &mut y[..n]);
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::axpy(a, w, y) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::axpy(a, w, y) },
        _ => axpy_portable(a, w, y),
    }
}

fn dot_portable<H: Half>(x: &[f32], w: &[H]) -> f32 {
    dot_lanes(x, w, H::widen)
}

fn axpy_portable<H: Half>(a: f32, w: &[H], y: &mut [f32]) {
    for (o, v) in y.iter_mut().zip(w) {
        *o += a * v.widen();
    }
}

/// 256-bit registers: the 32 lanes of the contract are four registers.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::rows::avx2::fold32;
    use super::*;
    use std::arch::x86_64::*;

    /// 8 halves at `w` widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<H: Half>(w: *const H) -> __m256 {
        // SAFETY: the caller guarantees 8 readable halves (each a u16).
        let bits = unsafe { _mm_loadu_si128(w as *const __m128i) };
        if H::BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
        } else {
            _mm256_cvtph_ps(bits)
        }
    }

    /// x and w of equal length.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot<H: Half>(x: &[f32], w: &[H]) -> f32 {
        let whole = x.len() / 16 * 16;
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        // SAFETY: every load is within 0..whole of both slices.
        let p = |i: usize| unsafe { _mm256_mul_ps(_mm256_loadu_ps(xp.add(i)), load8(wp.add(i))) };
        add_tail(fold32(whole, p), &x[whole..], &w[whole..], H::widen)
    }

    super::super::rows::dot_rows_with!("avx2,fma,f16c", H: Half);

    /// w and y of equal length.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn axpy<H: Half>(a: f32, w: &[H], y: &mut [f32]) {
        let whole = y.len() / 8 * 8;
        let (wp, yp) = (w.as_ptr(), y.as_mut_ptr());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        // SAFETY: every access is within 0..whole of both slices.
        unsafe {
            while i < whole {
                let v = _mm256_add_ps(
                    _mm256_loadu_ps(yp.add(i)),
                    _mm256_mul_ps(av, load8(wp.add(i))),
                );
                _mm256_storeu_ps(yp.add(i), v);
                i += 8;
            }
        }
        axpy_portable(a, &w[whole..], &mut y[whole..]);
    }

    super::super::rows::axpy_rows_avx2!(H: Half);
}

/// 512-bit registers: the 32 lanes of the contract are two registers.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::rows::avx512::fold32;
    use super::*;
    use std::arch::x86_64::*;

    /// 16 halves at `w` widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16<H: Half>(w: *const H) -> __m512 {
        // SAFETY: the caller guarantees 16 readable halves (each a u16).
        let bits = unsafe { _mm256_loadu_si256(w as *const __m256i) };
        if H::BF16 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
        } else {
            _mm512_cvtph_ps(bits)
        }
    }

    /// x and w of equal length.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) unsafe fn dot<H: Half>(x: &[f32], w: &[H]) -> f32 {
        let whole = x.len() / 16 * 16;
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        // SAFETY: every load is within 0..whole of both slices.
        let p = |i: usize| unsafe { _mm512_mul_ps(_mm512_loadu_ps(xp.add(i)), load16(wp.add(i))) };
        add_tail(fold32(whole, p), &x[whole..], &w[whole..], H::widen)
    }

    super::super::rows::dot_rows_with!("avx512f,avx2,fma,f16c", H: Half);

    /// w and y of equal length.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) unsafe fn axpy<H: Half>(a: f32, w: &[H], y: &mut [f32]) {
        let whole = y.len() / 16 * 16;
        let (wp, yp) = (w.as_ptr(), y.as_mut_ptr());
        let av = _mm512_set1_ps(a);
        let mut i = 0;
        // SAFETY: every access is within 0..whole of both slices.
        unsafe {
            while i < whole {
                let v = _mm512_add_ps(
                    _mm512_loadu_ps(yp.add(i)),
                    _mm512_mul_ps(av, load16(wp.add(i))),
                );
                _mm512_storeu_ps(yp.add(i), v);
                i += 16;
            }
        }
        axpy_portable(a, &w[whole..], &mut y[whole..]);
    }

    super::super::rows::axpy_rows_avx512!(H: Half);
}

#[cfg(test)]
mod tests {
    use super::super::rows;
    use super::*;

    #[test]
    fn every_path_gives_the_bits_of_the_f32_kernels_on_widened_weights() {
        bits_of_the_f32_kernels(f16::from_f32);
        bits_of_the_f32_kernels(bf16::from_f32);
    }

    fn bits_of_the_f32_kernels<H: Half + std::fmt::Debug>(from: fn(f32) -> H) {
        let portable = Path::new(Isa::Portable).unwrap();
        for path in Path::all() {
            // Whole 16s, 8s and tails of every kind.
            for n in [0, 1, 7, 8, 9, 15, 16, 17, 147, 768, 3075] {
                let w: Vec<H> = (0..n)
                    .map(|i| from((i as f32 * 0.37).sin() * [0.01, 1.0, 50.0][i % 3]))
                    .collect();
                let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
                let wide: Vec<f32> = w.iter().map(|v| v.widen()).collect();
                // The widening is exact: bf16 and f16 values are f32 values.
                assert!(w
                    .iter()
                    .zip(&wide)
                    .all(|(h, f)| from(*f).widen() == h.widen()));
                let want = rows::dot_on(portable, &x, &wide);
                let got = dot_on(path, &x, &w);
                assert_eq!(got.to_bits(), want.to_bits(), "dot n={n} {:?}", path.isa());
                let (mut y, mut z) = (x.clone(), x.clone());
                rows::axpy_on(portable, 0.5, &wide, &mut y);
                axpy_on(path, 0.5, &w, &mut z);
                let b = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(b(&z), b(&y), "axpy n={n} {:?}", path.isa());
            }
        }
    }

    #[test]
    fn row_batches_give_the_bits_of_row_by_row_dots() {
        let (n, rows) = (77, 5);
        let w: Vec<f16> = (0..n * rows)
            .map(|i| f16::from_f32((i as f32 * 0.29).sin()))
            .collect();
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.13).cos()).collect();
        for path in Path::all() {
            let mut got = vec![0f32; rows];
            dot_rows_on(path, &x, &w, &mut got);
            for (j, g) in got.iter().enumerate() {
                let want = dot_on(path, &x, &w[j * n..(j + 1) * n]);
                assert_eq!(g.to_bits(), want.to_bits(), "row {j} {:?}", path.isa());
            }
        }
    }

    #[test]
    fn strided_row_batches_give_the_bits_of_the_f32_kernels_on_widened_rows() {
        strided_rows(f16::from_f32);
        strided_rows(bf16::from_f32);
    }

    fn strided_rows<H: Half>(from: fn(f32) -> H) {
        let portable = Path::new(Isa::Portable).unwrap();
        // Head widths with and without whole 64s, 16s and 8s; rows 3 wider
        // than the head (a strided cache view).
        for w in [1, 8, 16, 24, 64, 72, 100, 128, 240] {
            let (n, stride) = (37, w + 3);
            let rows: Vec<H> = (0..n * stride)
                .map(|i| from((i as f32 * 0.29).sin() * [0.01, 1.0, 50.0][i % 3]))
                .collect();
            let wide: Vec<f32> = rows.iter().map(|v| v.widen()).collect();
            let x: Vec<f32> = (0..w).map(|i| (i as f32 * 0.13).cos()).collect();
            let p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin().abs()).collect();
            let mut want_dots = vec![0f32; n];
            rows::dot_rows_on(portable, &x, &wide, stride, 0.125, &mut want_dots);
            let mut want_sum: Vec<f32> = (0..w).map(|i| i as f32 * 0.01).collect();
            let start = want_sum.clone();
            rows::axpy_rows_on(portable, &p, &wide, stride, &mut want_sum);
            let b = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for path in Path::all() {
                let mut dots = vec![0f32; n];
                dot_rows_strided_on(path, &x, &rows, stride, 0.125, &mut dots);
                assert_eq!(b(&dots), b(&want_dots), "dots w={w} {:?}", path.isa());
                let mut sum = start.clone();
                axpy_rows_on(path, &p, &rows, stride, &mut sum);
                assert_eq!(b(&sum), b(&want_sum), "sums w={w} {:?}", path.isa());
            }
        }
    }

    #[test]
    fn half_dot_is_the_f64_dot() {
        let w: Vec<f16> = (0..147)
            .map(|i| f16::from_f32((i as f32 * 0.37).sin()))
            .collect();
        let x: Vec<f32> = (0..147).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f64 = x
            .iter()
            .zip(&w)
            .map(|(a, b)| (*a as f64) * (b.to_f32() as f64))
            .sum();
        for path in Path::all() {
            let got = dot_on(path, &x, &w) as f64;
            assert!(
                (got - want).abs() < 1e-4,
                "{:?}: {got} vs {want}",
                path.isa()
            );
        }
    }
}
