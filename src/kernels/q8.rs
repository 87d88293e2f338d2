//! 8-bit weights for decoding (`--weight-dtype q8`): rows [out, in] of
//! symmetric int8 in blocks of [`BLOCK`] along the input dimension, one f32
//! scale (largest magnitude / 127) per block. The activations a product
//! takes are quantised alike (`quantize_row`), so a block's dot product is
//! an exact integer sum (`vpmaddubsw`/`vpmaddwd` on AVX2, as llama.cpp's
//! Q8_0), scaled and accumulated in f32. Widening the weights instead left
//! the AVX2 kernel bound by instructions, not memory (docs/PERFORMANCE.md).
//! Every path gives the same bits.

use std::sync::Arc;

use candle_core::{CpuStorage, Device, Result, Storage, Tensor};
use rayon::prelude::*;

use super::rows::reduce16;
use super::{Isa, Path};

/// Values per scale.
pub const BLOCK: usize = 32;

/// A weight matrix quantised to int8 blocks with f32 scales.
#[derive(Clone)]
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    /// rows × cols, row-major.
    q: Arc<[i8]>,
    /// rows × cols.div_ceil(BLOCK), row-major.
    scales: Arc<[f32]>,
}

impl std::fmt::Debug for Q8Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q8Matrix[{}, {}]", self.rows, self.cols)
    }
}

/// One block's scale (largest magnitude / 127) and int8 values: each value
/// times 127 / largest magnitude, rounded to the nearest integer (ties to
/// even). A block holding a NaN or an infinity gets a NaN scale (and zeros);
/// one whose largest magnitude is below ~4·10⁻³⁷ counts as zeros.
/// Weights and activations are quantised by this one function.
#[inline(always)]
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    // v + 1.5 · 2²³ rounds any |v| < 2²² to an integer n (ties to even), and
    // its bits are then those of 1.5 · 2²³ plus n: integer arithmetic from
    // there on, which vectorises (the baseline x86-64 target has no rounding
    // instruction, `round` is a libm call per value, and a float-to-int
    // cast is per lane).
    const ROUND: f32 = 12_582_912.0;
    // |v|'s bits order like |v| for finite values, and NaN and infinity
    // lie above them all: one integer maximum (which vectorises, unlike
    // f32::max) finds the largest magnitude and whether any is not finite.
    let top = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .max()
        .unwrap_or(0);
    if top >= f32::INFINITY.to_bits() {
        q.fill(0);
        return f32::NAN;
    }
    let amax = f32::from_bits(top);
    let inv = 127.0 / amax;
    if !inv.is_finite() {
        // All zeros, or a largest magnitude below 127 / f32::MAX (~4e-37).
        q.fill(0);
        return 0.0;
    }
    for (o, &v) in q.iter_mut().zip(x) {
        let n = (v * inv + ROUND).to_bits() as i32 - ROUND.to_bits() as i32;
        *o = n.clamp(-127, 127) as i8;
    }
    amax / 127.0
}

impl Q8Matrix {
    /// Quantises a rank-2 float tensor on the CPU (f32, f16, bf16 or f64),
    /// widening one block at a time (no f32 copy of the matrix is made).
    /// `name` names the tensor in errors: a value that is not finite cannot
    /// be quantised (its block's scale would not be either) and is refused.
    pub(crate) fn quantize(t: &Tensor, name: &str) -> Result<Self> {
        let (rows, cols) = t.dims2()?;
        if !t.device().is_cpu() {
            candle_core::bail!("tensor `{name}`: 8-bit weights are for the CPU only")
        }
        let t = t.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) else {
            candle_core::bail!("tensor `{name}`: expected a contiguous CPU tensor")
        };
        let quantized = match cpu {
            CpuStorage::F32(d) => Self::from_slice(&d[a..b], rows, cols, |v| v),
            CpuStorage::F16(d) => Self::from_slice(&d[a..b], rows, cols, |v| v.to_f32()),
            CpuStorage::BF16(d) => Self::from_slice(&d[a..b], rows, cols, |v| v.to_f32()),
            CpuStorage::F64(d) => Self::from_slice(&d[a..b], rows, cols, |v| v as f32),
            _ => candle_core::bail!(
                "tensor `{name}`: {:?} weights cannot be quantised",
                t.dtype()
            ),
        };
        quantized.map_err(|(i, v)| {
            candle_core::Error::Msg(format!(
                "tensor `{name}`: element ({}, {}) is {v}, which cannot be quantised to 8 bits",
                i / cols.max(1),
                i % cols.max(1),
            ))
        })
    }

    /// Quantises `rows` × `cols` finite f32 values, row-major.
    pub fn from_rows(data: &[f32], rows: usize, cols: usize) -> Self {
        Self::from_slice(data, rows, cols, |v| v).expect("finite values")
    }

    /// Quantises rows × cols values widened by `widen`; on a value that is
    /// not finite (or does not fit f32), its index and value.
    fn from_slice<T: Copy + Sync>(
        data: &[T],
        rows: usize,
        cols: usize,
        widen: impl Fn(T) -> f32 + Sync,
    ) -> std::result::Result<Self, (usize, f32)> {
        assert_eq!(data.len(), rows * cols, "Q8Matrix: length");
        let blocks = cols.div_ceil(BLOCK);
        let mut q = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows * blocks];
        if cols > 0 {
            q.par_chunks_mut(cols)
                .zip(scales.par_chunks_mut(blocks))
                .zip(data.par_chunks(cols))
                .enumerate()
                .try_for_each(|(r, ((q, s), x))| {
                    let mut wide = [0f32; BLOCK];
                    for (b, ((q, s), x)) in
                        q.chunks_mut(BLOCK).zip(s).zip(x.chunks(BLOCK)).enumerate()
                    {
                        for (j, (o, &v)) in wide.iter_mut().zip(x).enumerate() {
                            *o = widen(v);
                            if !o.is_finite() {
                                return Err((r * cols + b * BLOCK + j, *o));
                            }
                        }
                        *s = quantize_block(&wide[..x.len()], q);
                    }
                    Ok(())
                })?;
        }
        Ok(Self {
            rows,
            cols,
            q: q.into(),
            scales: scales.into(),
        })
    }

    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Scales per row.
    pub(crate) fn blocks(&self) -> usize {
        self.cols.div_ceil(BLOCK)
    }

    /// Bytes held (values and scales).
    pub(crate) fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scales.len()
    }

    /// Row r's int8 values and scales.
    pub(super) fn row(&self, r: usize) -> (&[i8], &[f32]) {
        let b = self.blocks();
        (
            &self.q[r * self.cols..(r + 1) * self.cols],
            &self.scales[r * b..(r + 1) * b],
        )
    }

    pub(super) fn data(&self) -> (&[i8], &[f32]) {
        (&self.q, &self.scales)
    }

    /// Row r as f32 values `q · scale` into `out` (cols long).
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (q, s) = self.row(r);
        for ((o, q), s) in out.chunks_mut(BLOCK).zip(q.chunks(BLOCK)).zip(s) {
            o.iter_mut().zip(q).for_each(|(o, &q)| *o = q as f32 * s);
        }
    }

    /// The f32 matrix [rows, cols] the kernels compute with (for the
    /// compute-bound products, which run gemm on it).
    pub(crate) fn dequantize(&self) -> Result<Tensor> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols > 0 {
            out.par_chunks_mut(self.cols)
                .enumerate()
                .for_each(|(r, o)| self.dequantize_row(r, o));
        }
        Tensor::from_vec(out, (self.rows, self.cols), &Device::Cpu)
    }

    /// Rows `ids` as f32 [ids.len(), cols] (an embedding lookup).
    pub(crate) fn select_rows(&self, ids: &[u32]) -> Result<Tensor> {
        let mut out = vec![0f32; ids.len() * self.cols];
        for (&id, o) in ids.iter().zip(out.chunks_mut(self.cols.max(1))) {
            let r = id as usize;
            if r >= self.rows {
                candle_core::bail!("row {r} is outside a matrix of {} rows", self.rows)
            }
            self.dequantize_row(r, o);
        }
        Tensor::from_vec(out, (ids.len(), self.cols), &Device::Cpu)
    }
}

/// One row of activations quantised for [`dot_on`] as the weights are, per
/// block of [`BLOCK`] (see `quantize_block`): a block holding a NaN or an
/// infinity gets a NaN scale, so every dot product with it is NaN (the f32
/// product would not be finite either). One generic body for every path
/// ([`quantize_row_on`]): the same bits everywhere.
///
/// # Panics
/// If q is not as long as x or scales not one per block.
#[inline(always)]
pub(crate) fn quantize_row(x: &[f32], q: &mut [i8], scales: &mut [f32]) {
    assert!(q.len() == x.len() && scales.len() == x.len().div_ceil(BLOCK));
    for ((x, q), s) in x.chunks(BLOCK).zip(q.chunks_mut(BLOCK)).zip(scales) {
        *s = quantize_block(x, q);
    }
}

super::rows::dispatch! {
    /// [`quantize_row`] compiled for each path (the same bits: it is one
    /// generic body, and Rust never fuses its multiply and add).
    fn quantize_row_active / quantize_row_on(x: &[f32], q: &mut [i8], scales: &mut [f32]) = quantize_row;
}

/// The m rows of x [m, k] quantised by [`quantize_row`] on `path`: values
/// [m, k] and scales [m, blocks of k].
pub(crate) fn quantize_rows(path: Path, x: &[f32], m: usize, k: usize) -> (Vec<i8>, Vec<f32>) {
    let b = k.div_ceil(BLOCK);
    let (mut q, mut s) = (vec![0i8; m * k], vec![0f32; m * b]);
    if k > 0 {
        for ((x, q), s) in x.chunks(k).zip(q.chunks_mut(k)).zip(s.chunks_mut(b)) {
            quantize_row_on(path, x, q, s);
        }
    }
    (q, s)
}

/// x [m, k] as the 8-bit kernels see it: each row quantised by
/// [`quantize_row`] and widened back (value · scale) as a CPU tensor, for
/// the products that run gemm on dequantised weights, so that they compute
/// what the kernels do.
pub(crate) fn requantized(path: Path, x: &[f32], m: usize, k: usize) -> Result<Tensor> {
    let (q, scales) = quantize_rows(path, x, m, k);
    let rows = Q8Matrix {
        rows: m,
        cols: k,
        q: q.into(),
        scales: scales.into(),
    };
    rows.dequantize()
}

/// Σ over blocks of (weight scale · x scale) · Σ xq·wq on `path`, for one
/// row of activations quantised by [`quantize_row`] and one weight row
/// (values and scales). Every path computes alike, so they give the same
/// bits: each block b gives eight exact integer sums, lane l holding the
/// four products of values 4l..4l + 4 (a partial last block counts its
/// missing values as zero); lane l of the accumulators (even blocks in
/// lanes 0..8, odd ones in 8..16) += (scale_w · scale_x) · sum, fused; the
/// 16 lanes fold by [`reduce16`].
///
/// # Panics
/// If the lengths do not match (xq and q one row long, a scale per block).
pub(crate) fn dot_on(path: Path, xq: &[i8], xs: &[f32], q: &[i8], scales: &[f32]) -> f32 {
    let n = q.len();
    let blocks = n.div_ceil(BLOCK);
    assert!(
        xq.len() == n && xs.len() == blocks && scales.len() == blocks,
        "q8 dot: {} values, {} scales; x {} values, {} scales",
        n,
        scales.len(),
        xq.len(),
        xs.len()
    );
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports (AVX-512
        // implies AVX2); the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::dot(xq, xs, q, scales) },
        _ => dot_portable(xq, xs, q, scales),
    }
}

/// out[j] = [`dot_on`] with row j of the rows of xq's width packed in `q`
/// and `scales` (the same bits), without a call and a dispatch per row.
///
/// # Panics
/// If q or scales hold fewer than out.len() rows, or xs is not one scale
/// per block of xq.
pub(crate) fn dot_rows_on(
    path: Path,
    xq: &[i8],
    xs: &[f32],
    q: &[i8],
    scales: &[f32],
    out: &mut [f32],
) {
    let (w, b) = (xq.len(), xq.len().div_ceil(BLOCK));
    assert!(xs.len() == b && q.len() >= out.len() * w && scales.len() >= out.len() * b);
    let row = |j: usize| (&q[j * w..(j + 1) * w], &scales[j * b..(j + 1) * b]);
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports (AVX-512
        // implies AVX2); every row has the lengths dot_on checks.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::dot_rows(xq, xs, q, scales, out) },
        _ => out.iter_mut().enumerate().for_each(|(j, o)| {
            let (q, s) = row(j);
            *o = dot_portable(xq, xs, q, s)
        }),
    }
}

fn dot_portable(xq: &[i8], xs: &[f32], q: &[i8], scales: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let blocks = xq.chunks(BLOCK).zip(q.chunks(BLOCK));
    for (b, ((x, w), (sx, sw))) in blocks.zip(xs.iter().zip(scales)).enumerate() {
        let d = sw * sx;
        let lanes = &mut acc[8 * (b % 2)..8 * (b % 2) + 8];
        // Every lane, also those past a partial block's end (sum 0), as
        // the SIMD kernels add them.
        for (l, lane) in lanes.iter_mut().enumerate() {
            let t: i32 = (4 * l..4 * l + 4)
                .filter(|&i| i < x.len())
                .map(|i| x[i] as i32 * w[i] as i32)
                .sum();
            *lane = d.mul_add(t as f32, *lane);
        }
    }
    reduce16(acc)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::rows::avx2::fold16;
    use super::*;
    use std::arch::x86_64::*;

    /// acc + d · (the eight 4-product integer sums of the 32 int8 at x and
    /// w), d in every lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block(x: *const i8, w: *const i8, d: __m256, acc: __m256) -> __m256 {
        // SAFETY: the caller guarantees 32 readable bytes at x and at w.
        let (x, w) = unsafe {
            (
                _mm256_loadu_si256(x as *const __m256i),
                _mm256_loadu_si256(w as *const __m256i),
            )
        };
        // maddubs multiplies unsigned by signed bytes: |x| times w with x's
        // sign. Values are within ±127, so a pair sums to at most 32258 and
        // the 16-bit sums never saturate.
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
        let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(quads), acc)
    }

    /// See [`super::dot_rows_on`]; the caller checks the bounds. Compiled
    /// with the module's features like the f32 and f16 row loops
    /// ([`super::super::rows::dot_rows_with`]), but this `dot` is too large
    /// for the compiler to inline: it stays a call per row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows(
        xq: &[i8],
        xs: &[f32],
        q: &[i8],
        scales: &[f32],
        out: &mut [f32],
    ) {
        let (w, b) = (xq.len(), xs.len());
        for (j, o) in out.iter_mut().enumerate() {
            let (q, s) = (&q[j * w..(j + 1) * w], &scales[j * b..(j + 1) * b]);
            // SAFETY: a Path exists only for a CPU with these features.
            *o = unsafe { dot(xq, xs, q, s) };
        }
    }

    /// Lengths as [`dot_on`] checks them.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(xq: &[i8], xs: &[f32], q: &[i8], scales: &[f32]) -> f32 {
        let whole = q.len() / BLOCK;
        let (xp, qp) = (xq.as_ptr(), q.as_ptr());
        let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let d = |b: usize| _mm256_set1_ps(scales[b] * xs[b]);
        let mut b = 0;
        // SAFETY: blocks below `whole` lie inside both rows.
        unsafe {
            // Eight blocks at a time: their scale products in one multiply,
            // each moved to all lanes by one permute.
            while b + 8 <= whole {
                let d8 = _mm256_mul_ps(
                    _mm256_loadu_ps(scales.as_ptr().add(b)),
                    _mm256_loadu_ps(xs.as_ptr().add(b)),
                );
                let lane = |i: usize| _mm256_permutevar8x32_ps(d8, _mm256_set1_epi32(i as i32));
                for i in (0..8).step_by(2) {
                    let at = (b + i) * BLOCK;
                    even = block(xp.add(at), qp.add(at), lane(i), even);
                    odd = block(xp.add(at + BLOCK), qp.add(at + BLOCK), lane(i + 1), odd);
                }
                b += 8;
            }
            while b + 2 <= whole {
                let at = b * BLOCK;
                even = block(xp.add(at), qp.add(at), d(b), even);
                odd = block(xp.add(at + BLOCK), qp.add(at + BLOCK), d(b + 1), odd);
                b += 2;
            }
            if b < whole {
                even = block(xp.add(b * BLOCK), qp.add(b * BLOCK), d(b), even);
                b += 1;
            }
        }
        let rest = b * BLOCK..q.len();
        if !rest.is_empty() {
            let (mut x, mut w) = ([0i8; BLOCK], [0i8; BLOCK]);
            x[..rest.len()].copy_from_slice(&xq[rest.clone()]);
            w[..rest.len()].copy_from_slice(&q[rest]);
            // SAFETY: both buffers are one block long.
            unsafe {
                let (x, w) = (x.as_ptr(), w.as_ptr());
                if b % 2 == 0 {
                    even = block(x, w, d(b), even);
                } else {
                    odd = block(x, w, d(b), odd);
                }
            }
        }
        fold16(even, odd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dequantised matrix, row-major.
    fn flat(m: &Q8Matrix) -> Vec<f32> {
        m.dequantize()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.61).sin() * [0.02, 1.0, 7.0][i / 40 % 3])
            .collect()
    }

    #[test]
    fn quantisation_error_is_at_most_half_a_step_per_block() {
        // 77 columns: two whole blocks and a partial one of 13.
        let (rows, cols) = (5, 77);
        let x = values(rows * cols);
        let m = Q8Matrix::from_rows(&x, rows, cols);
        let back = flat(&m);
        for r in 0..rows {
            for (b, block) in x[r * cols..(r + 1) * cols].chunks(BLOCK).enumerate() {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let step = amax / 127.0;
                for (j, v) in block.iter().enumerate() {
                    let got = back[r * cols + b * BLOCK + j];
                    assert!(
                        (got - v).abs() <= 0.5 * step * 1.0001,
                        "({r}, {b}, {j}): {got} vs {v}"
                    );
                }
                // The largest magnitude is kept exactly (up to the scale's rounding).
                let i = block.iter().position(|v| v.abs() == amax).unwrap();
                let got = back[r * cols + b * BLOCK + i];
                assert!((got.abs() - amax).abs() <= amax * 1e-6, "{got} vs {amax}");
            }
        }
        assert_eq!(m.bytes(), rows * cols + 4 * rows * 3);
        // An all-zero block has scale 0 and gives zeros, not NaN.
        let z = Q8Matrix::from_rows(&[0.0; 40], 1, 40);
        assert_eq!(
            z.dequantize().unwrap().to_vec2::<f32>().unwrap(),
            vec![vec![0f32; 40]]
        );
    }

    #[test]
    fn non_finite_weights_are_refused_with_their_name() {
        let t = Tensor::from_vec(vec![1f32, 0.5, 2.0, f32::NAN], (2, 2), &Device::Cpu).unwrap();
        let e = Q8Matrix::quantize(&t, "layers.0.mlp.key_param_tokens").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("layers.0.mlp.key_param_tokens") && msg.contains("(1, 1)"),
            "{msg}"
        );
        // f16 infinity, in a transposed view (element (1, 0) of the view).
        let t = Tensor::from_vec(vec![1f32, f32::INFINITY, 0.5, 2.0], (2, 2), &Device::Cpu)
            .unwrap()
            .to_dtype(candle_core::DType::F16)
            .unwrap();
        let msg = Q8Matrix::quantize(&t.t().unwrap(), "v")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("(1, 0)") && msg.contains("inf"), "{msg}");
    }

    #[test]
    fn every_float_dtype_and_layout_quantises_alike() {
        let x = Tensor::from_vec(values(6 * 70), (6, 70), &Device::Cpu).unwrap();
        let want = Q8Matrix::quantize(&x, "x").unwrap();
        let f64s = Q8Matrix::quantize(&x.to_dtype(candle_core::DType::F64).unwrap(), "x").unwrap();
        assert_eq!(f64s.data(), want.data());
        // A transposed view is quantised by its own rows.
        let t = x.t().unwrap();
        let got = Q8Matrix::quantize(&t, "x").unwrap();
        assert_eq!(got.dims(), (70, 6));
        assert_eq!(
            got.data(),
            Q8Matrix::quantize(&t.contiguous().unwrap(), "x")
                .unwrap()
                .data()
        );
        // f16 widens exactly: the f16 tensor quantises as its f32 widening.
        let h = x.to_dtype(candle_core::DType::F16).unwrap();
        let wide = h.to_dtype(candle_core::DType::F32).unwrap();
        assert_eq!(
            Q8Matrix::quantize(&h, "x").unwrap().data(),
            Q8Matrix::quantize(&wide, "x").unwrap().data()
        );
        let ints = Tensor::new(&[[1u32, 2]], &Device::Cpu).unwrap();
        assert!(Q8Matrix::quantize(&ints, "ids").is_err());
    }

    /// x quantised as the kernels take it, and widened back.
    fn quantized(x: &[f32]) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
        let portable = Path::new(Isa::Portable).unwrap();
        let (q, s) = quantize_rows(portable, x, 1, x.len());
        // Every path quantises to the same bits.
        for path in Path::all() {
            let (pq, ps) = quantize_rows(path, x, 1, x.len());
            assert_eq!(pq, q, "{:?}", path.isa());
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ps), bits(&s), "{:?}", path.isa());
        }
        let wide = requantized(portable, x, 1, x.len()).unwrap();
        (q, s, wide.flatten_all().unwrap().to_vec1().unwrap())
    }

    #[test]
    fn every_path_gives_the_portable_bits_and_the_f64_dot() {
        let portable = Path::new(Isa::Portable).unwrap();
        // Widths with 0-3 whole blocks, paired or not, and partial ones.
        for cols in [1, 4, 15, 31, 32, 33, 48, 64, 77, 96, 100, 128, 768, 3072] {
            let m = Q8Matrix::from_rows(&values(3 * cols), 3, cols);
            let deq = flat(&m);
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.23).cos()).collect();
            let (xq, xs, wide) = quantized(&x);
            for r in 0..3 {
                let (q, s) = m.row(r);
                let want = dot_on(portable, &xq, &xs, q, s);
                for path in Path::all() {
                    let got = dot_on(path, &xq, &xs, q, s);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "cols={cols} row {r} {:?}",
                        path.isa()
                    );
                }
                // It is the dot product of the dequantised x and row.
                let w = &deq[r * cols..(r + 1) * cols];
                let exact: f64 = wide.iter().zip(w).map(|(a, b)| *a as f64 * *b as f64).sum();
                let size: f64 = wide
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    (want as f64 - exact).abs() <= 1e-6 * size,
                    "cols={cols}: {want} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn extreme_values_neither_saturate_nor_round() {
        // Every value ±127 with x's signs matching w's: each 16-bit pair sum
        // is 2 · 127², the largest there is, and the sums stay exact.
        let signs: Vec<f32> = (0..64).map(|i| [1.0, -1.0][i * 7 % 3 % 2]).collect();
        let m = Q8Matrix::from_rows(&signs, 1, 64);
        let (xq, xs, _) = quantized(&signs.iter().map(|v| 2.0 * v).collect::<Vec<_>>());
        assert!(xq.iter().chain(m.data().0).all(|v| v.abs() == 127));
        let (q, s) = m.row(0);
        let want = 64.0 * 2.0;
        for path in Path::all() {
            let got = dot_on(path, &xq, &xs, q, s);
            assert!((got - want).abs() <= want * 1e-6, "{:?}: {got}", path.isa());
            // Opposite signs: the most negative sums.
            let neg: Vec<i8> = xq.iter().map(|v| -v).collect();
            let got = dot_on(path, &neg, &xs, q, s);
            assert!((got + want).abs() <= want * 1e-6, "{:?}: {got}", path.isa());
        }
    }

    #[test]
    fn activations_quantise_within_half_a_step_and_non_finite_ones_give_nan() {
        let x = values(77);
        let (q, s, wide) = quantized(&x);
        assert_eq!((q.len(), s.len()), (77, 3));
        for (b, block) in x.chunks(BLOCK).enumerate() {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(s[b], amax / 127.0);
            for (j, v) in block.iter().enumerate() {
                let got = wide[b * BLOCK + j];
                assert!(
                    (got - v).abs() <= 0.5 * s[b] * 1.0001,
                    "{b} {j}: {got} vs {v}"
                );
            }
        }
        // Ties round to even: 0.5 and 1.5 steps of a block whose largest value is 127.
        let mut x = vec![0f32; 32];
        x[..3].copy_from_slice(&[127.0, 0.5, 1.5]);
        assert_eq!(&quantized(&x).0[..3], &[127, 0, 2]);
        // A zero block has scale 0; a NaN or an infinity makes its block's scale
        // NaN, and so the product, on every path (the other block is unharmed).
        let w = Q8Matrix::from_rows(&values(64), 1, 64);
        let (q, s) = w.row(0);
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = vec![1f32; 64];
            x[40] = bad;
            let (xq, xs, _) = quantized(&x);
            assert!(xs[0] == 1.0 / 127.0 && xs[1].is_nan(), "{xs:?}");
            for path in Path::all() {
                assert!(
                    dot_on(path, &xq, &xs, q, s).is_nan(),
                    "{bad} {:?}",
                    path.isa()
                );
            }
        }
        assert_eq!(quantized(&[0.0; 40]).1, vec![0.0, 0.0]);
        // Magnitudes so small that 127 / largest overflows count as zeros;
        // just above that, they quantise as any other block.
        let (q, s, _) = quantized(&[1e-38, -2e-38, 0.0]);
        assert_eq!((q, s), (vec![0, 0, 0], vec![0.0]));
        let (a, b) = (2f32.powi(-120), 2f32.powi(-119));
        let (q, s, _) = quantized(&[a, -b, 0.0]);
        assert_eq!((q, s), (vec![64, -127, 0], vec![b / 127.0]));
    }

    #[test]
    fn row_batches_give_the_bits_of_row_by_row_dots() {
        for cols in [33, 96, 100] {
            let m = Q8Matrix::from_rows(&values(4 * cols), 4, cols);
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.41).sin()).collect();
            let (xq, xs, _) = quantized(&x);
            let (q, s) = m.data();
            for path in Path::all() {
                let mut got = vec![0f32; 4];
                dot_rows_on(path, &xq, &xs, q, s, &mut got);
                for (r, g) in got.iter().enumerate() {
                    let (qr, sr) = m.row(r);
                    let want = dot_on(path, &xq, &xs, qr, sr);
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "cols={cols} row {r} {:?}",
                        path.isa()
                    );
                }
            }
        }
    }

    #[test]
    fn selected_rows_are_dequantized_rows() {
        let m = Q8Matrix::from_rows(&values(4 * 40), 4, 40);
        let all = m.dequantize().unwrap();
        let got = m.select_rows(&[3, 0, 3]).unwrap();
        let want = all
            .index_select(&Tensor::new(&[3u32, 0, 3], &Device::Cpu).unwrap(), 0)
            .unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap()
        );
        assert!(m.select_rows(&[4]).is_err());
    }
}
