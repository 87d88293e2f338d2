//! 8-bit weights for decoding (`--weight-dtype q8`): rows [out, in] of
//! symmetric int8 in blocks of [`BLOCK`] along the input dimension, one f32
//! scale (largest magnitude / 127) per block. The dot kernels widen to f32 and
//! follow the lane contract of `super::rows`, so they give the bits of the
//! f32 kernel on dequantized weights (`Q8Matrix::dequantize`), on every path.

use std::sync::Arc;

use candle_core::{CpuStorage, Device, Result, Storage, Tensor};
use rayon::prelude::*;

use super::rows::{reduce16, tail_dot};
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

/// One block's scale and int8 values.
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let scale = amax / 127.0;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v / scale).round().clamp(-127.0, 127.0) as i8;
    }
    scale
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
            for (o, &q) in o.iter_mut().zip(q) {
                *o = q as f32 * s;
            }
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

/// `x` rearranged into `out` (same length, a row of the matrix's width) for
/// [`dot_on`]: within each pair of whole blocks (64 values), value
/// 32h + 4k + j (block h of the pair, k < 8, j < 4) moves to 16j + 8h + k; a
/// last unpaired whole block's value 4k + j moves to 8j + k; a partial block
/// at the end stays in place. The kernels then find, for the four bytes of
/// each 32-bit word of a block, their x values side by side.
pub(crate) fn arrange(x: &[f32], out: &mut [f32]) {
    let n = x.len().min(out.len());
    let blocks = n / BLOCK;
    let mut b = 0;
    while b < blocks {
        let base = b * BLOCK;
        let paired = b + 2 <= blocks;
        let (stride, halves) = if paired { (16, 2) } else { (8, 1) };
        for h in 0..halves {
            for k in 0..8 {
                for j in 0..4 {
                    out[base + stride * j + 8 * h + k] = x[base + BLOCK * h + 4 * k + j];
                }
            }
        }
        b += halves;
    }
    out[blocks * BLOCK..n].copy_from_slice(&x[blocks * BLOCK..n]);
}

/// Σ x[i]·q[i]·(scale of i's block) on `path`, for `xa` = x [`arrange`]d
/// and one row's int8 values and scales. Every path computes alike, so
/// they give the same bits: per block and lane (8 lanes a block, the four
/// values of a 32-bit word each) t = x·q, then three fused multiply-adds
/// t += x·q; the lane's accumulator (even blocks in lanes 0..8, odd ones in
/// 8..16) += scale·t, fused; the 16 lanes fold by [`reduce16`]; a partial
/// last block adds x·(q·scale) in order.
///
/// # Panics
/// If the lengths do not match (xa and q one row long, a scale per block).
pub(crate) fn dot_on(path: Path, xa: &[f32], q: &[i8], scales: &[f32]) -> f32 {
    let n = q.len();
    assert!(
        xa.len() == n && scales.len() == n.div_ceil(BLOCK),
        "q8 dot: {} values, {} scales, {} x",
        n,
        scales.len(),
        xa.len()
    );
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports; the
        // lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot(xa, q, scales) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot(xa, q, scales) },
        _ => dot_portable(xa, q, scales),
    }
}

/// out[j] = [`dot_on`] with row j of the rows of xa's width packed in `q`
/// and `scales` (the same bits), without a call and a dispatch per row.
///
/// # Panics
/// If q or scales hold fewer than out.len() rows.
pub(crate) fn dot_rows_on(path: Path, xa: &[f32], q: &[i8], scales: &[f32], out: &mut [f32]) {
    let (w, b) = (xa.len(), xa.len().div_ceil(BLOCK));
    assert!(q.len() >= out.len() * w && scales.len() >= out.len() * b);
    let row = |j: usize| (&q[j * w..(j + 1) * w], &scales[j * b..(j + 1) * b]);
    match path.isa() {
        // SAFETY: a Path exists only for an ISA the CPU supports; every row
        // has the lengths dot_on checks.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe {
            super::rows::avx512::for_each_row(out, |j, o| {
                let (q, s) = row(j);
                *o = avx512::dot(xa, q, s)
            })
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe {
            super::rows::avx2::for_each_row(out, |j, o| {
                let (q, s) = row(j);
                *o = avx2::dot(xa, q, s)
            })
        },
        _ => out.iter_mut().enumerate().for_each(|(j, o)| {
            let (q, s) = row(j);
            *o = dot_portable(xa, q, s)
        }),
    }
}

/// The partial last block: Σ x·(q·scale) in order.
#[inline(always)]
fn tail(xa: &[f32], q: &[i8], scales: &[f32]) -> f32 {
    let start = q.len() / BLOCK * BLOCK;
    let w = (start..q.len()).map(|i| q[i] as f32 * scales[i / BLOCK]);
    tail_dot(&xa[start..], w)
}

fn dot_portable(xa: &[f32], q: &[i8], scales: &[f32]) -> f32 {
    let blocks = q.len() / BLOCK;
    let mut acc = [0f32; 16];
    let mut b = 0;
    while b < blocks {
        let base = b * BLOCK;
        let (stride, halves) = if b + 2 <= blocks { (16, 2) } else { (8, 1) };
        for h in 0..halves {
            for k in 0..8 {
                let x = |j: usize| xa[base + stride * j + 8 * h + k];
                let w = |j: usize| q[base + BLOCK * h + 4 * k + j] as f32;
                let mut t = x(0) * w(0);
                for j in 1..4 {
                    t = x(j).mul_add(w(j), t);
                }
                acc[8 * h + k] = scales[b + h].mul_add(t, acc[8 * h + k]);
            }
        }
        b += halves;
    }
    reduce16(acc) + tail(xa, q, scales)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::rows::avx2::fold16;
    use super::*;
    use std::arch::x86_64::*;

    /// The four lanes' products of the 32 int8 at `q` (one block, whose x
    /// values are at `x`, `stride` apart per byte of a word), scaled by `s`
    /// and added to `acc`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block(
        x: *const f32,
        stride: usize,
        q: *const i8,
        s: f32,
        acc: __m256,
    ) -> __m256 {
        // SAFETY: the caller guarantees 32 readable bytes at q and 4
        // strided runs of 8 floats at x.
        unsafe {
            let v = _mm256_loadu_si256(q as *const __m256i);
            // Byte j of every 32-bit word, sign-extended by two shifts: no
            // shuffles, which AVX2 issues one a cycle.
            let e0 = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(v));
            let e1 = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<16>(v));
            let e2 = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<8>(v));
            let e3 = _mm256_srai_epi32::<24>(v);
            let f = _mm256_cvtepi32_ps;
            let t = _mm256_mul_ps(_mm256_loadu_ps(x), f(e0));
            let t = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(stride)), f(e1), t);
            let t = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(2 * stride)), f(e2), t);
            let t = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(3 * stride)), f(e3), t);
            _mm256_fmadd_ps(_mm256_set1_ps(s), t, acc)
        }
    }

    /// Lengths as [`dot_on`] checks them.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot(xa: &[f32], q: &[i8], scales: &[f32]) -> f32 {
        let blocks = q.len() / BLOCK;
        let (xp, qp) = (xa.as_ptr(), q.as_ptr());
        let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut b = 0;
        // SAFETY: blocks b and b + 1 are whole, so every access is inside the row.
        unsafe {
            while b + 2 <= blocks {
                let base = b * BLOCK;
                even = block(xp.add(base), 16, qp.add(base), scales[b], even);
                odd = block(
                    xp.add(base + 8),
                    16,
                    qp.add(base + BLOCK),
                    scales[b + 1],
                    odd,
                );
                b += 2;
            }
            if b < blocks {
                let base = b * BLOCK;
                even = block(xp.add(base), 8, qp.add(base), scales[b], even);
            }
        }
        fold16(even, odd) + tail(xa, q, scales)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::rows::avx512::fold16;
    use super::*;
    use std::arch::x86_64::*;

    /// Lengths as [`dot_on`] checks them.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) unsafe fn dot(xa: &[f32], q: &[i8], scales: &[f32]) -> f32 {
        let blocks = q.len() / BLOCK;
        let (xp, qp) = (xa.as_ptr(), q.as_ptr());
        // Lanes 0..8 hold the even blocks, 8..16 the odd ones (AVX2's two registers).
        let mut acc = _mm512_setzero_ps();
        let mut b = 0;
        // SAFETY: blocks b and b + 1 are whole, so every access is inside the row.
        unsafe {
            while b + 2 <= blocks {
                let base = b * BLOCK;
                let v = _mm512_loadu_si512(qp.add(base) as *const __m512i);
                let e0 = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(v));
                let e1 = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<16>(v));
                let e2 = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<8>(v));
                let e3 = _mm512_srai_epi32::<24>(v);
                let f = _mm512_cvtepi32_ps;
                let x = |j: usize| _mm512_loadu_ps(xp.add(base + 16 * j));
                let t = _mm512_mul_ps(x(0), f(e0));
                let t = _mm512_fmadd_ps(x(1), f(e1), t);
                let t = _mm512_fmadd_ps(x(2), f(e2), t);
                let t = _mm512_fmadd_ps(x(3), f(e3), t);
                let s_even = _mm512_castps256_ps512(_mm256_set1_ps(scales[b]));
                let s = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                    _mm512_castps_pd(s_even),
                    _mm256_castps_pd(_mm256_set1_ps(scales[b + 1])),
                ));
                acc = _mm512_fmadd_ps(s, t, acc);
                b += 2;
            }
            if b < blocks {
                let base = b * BLOCK;
                let even = _mm512_castps512_ps256(acc);
                let even = avx2::block(xp.add(base), 8, qp.add(base), scales[b], even);
                acc = _mm512_castpd_ps(_mm512_insertf64x4::<0>(
                    _mm512_castps_pd(acc),
                    _mm256_castps_pd(even),
                ));
            }
        }
        fold16(acc) + tail(xa, q, scales)
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

    #[test]
    fn every_path_gives_the_portable_bits_and_the_f64_dot() {
        let portable = Path::new(Isa::Portable).unwrap();
        // Widths with 0-3 whole blocks, paired or not, and partial ones.
        for cols in [1, 15, 31, 32, 33, 48, 64, 77, 96, 100, 128, 768, 3072] {
            let m = Q8Matrix::from_rows(&values(3 * cols), 3, cols);
            let deq = flat(&m);
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.23).cos()).collect();
            let mut xa = vec![0f32; cols];
            arrange(&x, &mut xa);
            for r in 0..3 {
                let (q, s) = m.row(r);
                let want = dot_on(portable, &xa, q, s);
                for path in Path::all() {
                    let got = dot_on(path, &xa, q, s);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "cols={cols} row {r} {:?}",
                        path.isa()
                    );
                }
                // The arrangement loses no value: it is x · the dequantised row.
                let w = &deq[r * cols..(r + 1) * cols];
                let exact: f64 = x.iter().zip(w).map(|(a, b)| *a as f64 * *b as f64).sum();
                let size: f64 = x
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
    fn row_batches_give_the_bits_of_row_by_row_dots() {
        for cols in [33, 96, 100] {
            let m = Q8Matrix::from_rows(&values(4 * cols), 4, cols);
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.41).sin()).collect();
            let mut xa = vec![0f32; cols];
            arrange(&x, &mut xa);
            let (q, s) = m.data();
            for path in Path::all() {
                let mut got = vec![0f32; 4];
                dot_rows_on(path, &xa, q, s, &mut got);
                for (r, g) in got.iter().enumerate() {
                    let (qr, sr) = m.row(r);
                    let want = dot_on(path, &xa, qr, sr);
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
    fn arrange_is_a_permutation_within_blocks() {
        for cols in [31, 32, 64, 96, 100] {
            let x: Vec<f32> = (0..cols).map(|i| i as f32).collect();
            let mut xa = vec![-1f32; cols];
            arrange(&x, &mut xa);
            let mut sorted = xa.clone();
            sorted.sort_by(f32::total_cmp);
            assert_eq!(sorted, x, "cols={cols}");
            // Each value stays in its pair of blocks (or its block, or the tail).
            for (i, v) in xa.iter().enumerate() {
                let j = *v as usize;
                let blocks = cols / BLOCK;
                let unit = |i: usize| {
                    if i >= blocks * BLOCK {
                        usize::MAX
                    } else {
                        i / (2 * BLOCK)
                    }
                };
                assert_eq!(unit(i), unit(j), "cols={cols}: {j} at {i}");
            }
        }
        // The documented moves: pair 0, block 1, word 2, byte 3 -> 16·3 + 8 + 2.
        let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let mut xa = vec![0f32; 64];
        arrange(&x, &mut xa);
        assert_eq!(xa[16 * 3 + 8 + 2], (32 + 4 * 2 + 3) as f32);
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
