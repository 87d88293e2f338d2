//! Θ = GELU(s / ‖s‖₂ · √n) (the `l2_norm_gelu` activation every released model uses)
//! as one operation with its own backward, for training. Composed from candle ops the
//! same function keeps six score-sized intermediates alive until the backward pass
//! and walks the scores a dozen times; this keeps only the scores and makes one pass
//! each way. Its values are the definition's ([`crate::pattention::theta`]) up to
//! rounding: f32 scores go through the inference kernels' branch-free erf and exp
//! (erf within 3e-7) and 32-lane sums so that the loops vectorise; f64 scores through
//! libm and running f64 sums. On a GPU (a `cuda` build, `TOKENFORMER_CUDA_KERNELS=1`)
//! both passes are `kernels/cuda/theta.cu`'s, for f32, bf16 and f16 scores with f32 sums.
//!
//! Backward, with f = √n / ‖s‖, u = f·s and g = ∂L/∂Θ · GELU′(u):
//! ∂L/∂s = f·g − f · s · (s·g) / ‖s‖² (the normalisation's projection), and f·g for a
//! row whose norm is clamped at the floor (an all-zero row).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// The smallest norm divided by, as in the inference Θ.
const MIN_NORM: f64 = 1e-30;

/// Whether [`l2_norm_gelu`] takes `scores`: f32 or f64 on the CPU with the fused
/// kernels on, or (in a `cuda` build) f32, bf16 or f16 on a GPU with the CUDA
/// kernels on (`TOKENFORMER_CUDA_KERNELS`). Elsewhere training differentiates the
/// definition's ops.
pub(crate) fn serves(scores: &Tensor) -> bool {
    let cpu = matches!(scores.dtype(), DType::F32 | DType::F64) && crate::kernels::fused_on(scores);
    #[cfg(feature = "cuda")]
    let gpu = crate::kernels::theta_cuda::serves(scores);
    #[cfg(not(feature = "cuda"))]
    let gpu = false;
    cpu || gpu
}

/// Θ over the last axis of contiguous scores (f32 or f64 on the CPU; f32, bf16 or
/// f16 on a GPU, every sum in f32) with the √n constant of `scale_tokens`.
pub(crate) fn l2_norm_gelu(scores: &Tensor, scale_tokens: usize) -> Result<Tensor> {
    scores.contiguous()?.apply_op1(L2NormGelu {
        c: (scale_tokens as f64).sqrt(),
    })
}

struct L2NormGelu {
    c: f64,
}

pub(super) trait Float: Copy + Send + Sync + Into<f64> {
    fn from_f64(x: f64) -> Self;
    fn erf(self) -> f64;
}

impl Float for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn erf(self) -> f64 {
        libm::erff(self) as f64
    }
}

impl Float for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn erf(self) -> f64 {
        libm::erf(self)
    }
}

fn norm<T: Float>(row: &[T]) -> f64 {
    row.iter().map(|&x| x.into() * x.into()).sum::<f64>().sqrt()
}

fn forward_row<T: Float>(row: &[T], out: &mut [T], c: f64) {
    let f = c / norm(row).max(MIN_NORM);
    for (o, &v) in out.iter_mut().zip(row) {
        let u = T::from_f64(v.into() * f);
        let e = T::from_f64(u.into() * std::f64::consts::FRAC_1_SQRT_2).erf();
        *o = T::from_f64(0.5 * u.into() * (1.0 + e));
    }
}

/// `row` (the scores) becomes ∂L/∂s.
fn backward_row<T: Float>(row: &mut [T], dy: &[T], c: f64) {
    let r = norm(row);
    let f = c / r.max(MIN_NORM);
    let inv_sqrt_2pi = 0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2;
    // g = dy · GELU′(u), kept in `row` (as f64 would need a buffer per row).
    let mut dot = 0.0;
    let g: Vec<f64> = row
        .iter()
        .zip(dy)
        .map(|(&x, &d)| {
            let u = x.into() * f;
            let e = T::from_f64(u * std::f64::consts::FRAC_1_SQRT_2).erf();
            let dgelu = 0.5 * (1.0 + e) + u * (-0.5 * u * u).exp() * inv_sqrt_2pi;
            let g = d.into() * dgelu;
            dot += x.into() * g;
            g
        })
        .collect();
    let proj = if r > MIN_NORM { dot / (r * r) } else { 0.0 };
    for (v, g) in row.iter_mut().zip(g) {
        *v = T::from_f64(f * (g - (*v).into() * proj));
    }
}

pub(super) fn forward<T: Float + candle_core::WithDType>(s: &[T], n: usize, c: f64) -> Vec<T> {
    rows_into(s, n, |row, o| forward_row(row, o, c))
}

/// A new vector of s's length written row by row (rows of n) from s's rows in parallel
/// (a copy first would be a pass that every element then overwrites).
fn rows_into<T: candle_core::WithDType>(
    s: &[T],
    n: usize,
    write: impl Fn(&[T], &mut [T]) + Sync,
) -> Vec<T> {
    let mut out = Vec::with_capacity(s.len());
    out.spare_capacity_mut()
        .par_chunks_mut(n)
        .zip(s.par_chunks(n))
        .for_each(|(o, row)| write(row, uninit_as(o)));
    // SAFETY: `write` wrote all s.len() elements above.
    unsafe { out.set_len(s.len()) };
    out
}

pub(super) fn backward<T: Float>(s: &[T], dy: &[T], n: usize, c: f64) -> Vec<T> {
    let mut out = s.to_vec();
    out.par_chunks_mut(n)
        .zip(dy.par_chunks(n))
        .for_each(|(row, dy)| backward_row(row, dy, c));
    out
}

/// [`forward`] on the calling thread, into `out` (for passes already in parallel).
pub(super) fn forward_serial<T: Float>(s: &[T], out: &mut [T], n: usize, c: f64) {
    out.chunks_mut(n)
        .zip(s.chunks(n))
        .for_each(|(o, row)| forward_row(row, o, c));
}

/// [`backward`] on the calling thread, the scores turned into ∂L/∂s in place.
pub(super) fn backward_serial<T: Float>(s: &mut [T], dy: &[T], n: usize, c: f64) {
    s.chunks_mut(n)
        .zip(dy.chunks(n))
        .for_each(|(row, dy)| backward_row(row, dy, c));
}

/// The f32 passes, with the branch-free erf and exp of [`crate::kernels::math`] (erf to
/// 3e-7, exp to about an ulp) so that the element loops vectorise; norms and the
/// projection's dot product over 32 f32 lanes, the lanes added in f64.
mod fast {
    use super::super::parts::{by_isa, lanes};
    use crate::kernels::math::{erf_f32_with, exp_f32_with, madd};

    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

    #[inline(always)]
    fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
        lanes(a, b, |x, y| x * y)
    }

    #[inline(always)]
    fn sum_sq(row: &[f32]) -> f64 {
        dot_f64(row, row)
    }

    #[inline(always)]
    fn forward_row_generic<const FMA: bool>(row: &[f32], out: &mut [f32], c: f64) {
        let f = (c / sum_sq(row).sqrt().max(super::MIN_NORM)) as f32;
        for (o, &v) in out.iter_mut().zip(row) {
            *o = crate::kernels::math::gelu_erf_f32_with::<FMA>(v * f);
        }
    }

    /// `row` (the scores) becomes ∂L/∂s; `g` is scratch of the row's length.
    #[inline(always)]
    fn backward_row_generic<const FMA: bool>(row: &mut [f32], dy: &[f32], g: &mut [f32], c: f64) {
        let r = sum_sq(row).sqrt();
        let f64_f = c / r.max(super::MIN_NORM);
        let f = f64_f as f32;
        for ((gi, &x), &d) in g.iter_mut().zip(row.iter()).zip(dy) {
            let u = x * f;
            let e = erf_f32_with::<FMA>(u * std::f32::consts::FRAC_1_SQRT_2);
            let density = exp_f32_with::<FMA>(-0.5 * u * u) * FRAC_1_SQRT_2PI;
            let dgelu = madd::<FMA>(u, density, 0.5 * (1.0 + e));
            *gi = d * dgelu;
        }
        let dot = dot_f64(row, g);
        let proj = if r > super::MIN_NORM {
            dot / (r * r)
        } else {
            0.0
        } as f32;
        for (v, &gi) in row.iter_mut().zip(g.iter()) {
            *v = f * (gi - *v * proj);
        }
    }

    by_isa!(forward_row(row: &[f32], out: &mut [f32], c: f64) = forward_row_generic::<fma>);
    by_isa!(backward_row(row: &mut [f32], dy: &[f32], g: &mut [f32], c: f64) = backward_row_generic::<fma>);
}

pub(super) fn forward_f32(s: &[f32], n: usize, c: f64) -> Vec<f32> {
    rows_into(s, n, |row, o| fast::forward_row(row, o, c))
}

/// Spare capacity of a vector as elements to be written, never read, before the
/// vector's `set_len` (so that a pass that writes every element needs no zeroing pass
/// first).
pub(super) fn uninit_as<T: candle_core::WithDType>(o: &mut [std::mem::MaybeUninit<T>]) -> &mut [T] {
    // SAFETY: MaybeUninit<T> has T's layout and no element type of a tensor has
    // invalid bit patterns; the callers write every element before reading any.
    unsafe { &mut *(o as *mut [std::mem::MaybeUninit<T>] as *mut [T]) }
}

/// [`forward_f32`] on the calling thread, into `out`.
pub(super) fn forward_f32_serial(s: &[f32], out: &mut [f32], n: usize, c: f64) {
    out.chunks_mut(n)
        .zip(s.chunks(n))
        .for_each(|(o, row)| fast::forward_row(row, o, c));
}

pub(super) fn backward_f32(s: &[f32], dy: &[f32], n: usize, c: f64) -> Vec<f32> {
    let mut out = s.to_vec();
    backward_f32_in_place(&mut out, dy, n, c);
    out
}

/// [`backward_f32`] with the scores `s` turned into ∂L/∂s where they are.
pub(super) fn backward_f32_in_place(s: &mut [f32], dy: &[f32], n: usize, c: f64) {
    s.par_chunks_mut(n).zip(dy.par_chunks(n)).for_each_init(
        || vec![0f32; n],
        |g, (row, dy)| fast::backward_row(row, dy, g, c),
    );
}

/// [`backward_f32_in_place`] on the calling thread.
pub(super) fn backward_f32_serial(s: &mut [f32], dy: &[f32], n: usize, c: f64) {
    let mut g = vec![0f32; n];
    s.chunks_mut(n)
        .zip(dy.chunks(n))
        .for_each(|(row, dy)| fast::backward_row(row, dy, &mut g, c));
}

fn slice<'a, T>(s: &'a [T], l: &Layout) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("Θ needs contiguous scores"),
    }
}

impl CustomOp1 for L2NormGelu {
    fn name(&self) -> &'static str {
        "l2-norm-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = layout.dims().last().copied().unwrap_or(1).max(1);
        let out = match storage {
            CpuStorage::F32(s) => CpuStorage::F32(forward_f32(slice(s, layout)?, n, self.c)),
            CpuStorage::F64(s) => CpuStorage::F64(forward(slice(s, layout)?, n, self.c)),
            _ => candle_core::bail!("Θ needs f32 or f64 scores"),
        };
        Ok((out, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::kernels::theta_cuda::theta_storage;
        let activation = crate::pattention::Activation::L2NormGelu;
        let out = theta_storage(storage, layout, activation, self.c as f32)?;
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad(arg, grad_res, self.c)?))
    }
}

/// ∂L/∂scores of [`l2_norm_gelu`] from ∂L/∂Θ, outside the graph.
pub(crate) fn l2_norm_gelu_grad(
    scores: &Tensor,
    dy: &Tensor,
    scale_tokens: usize,
) -> Result<Tensor> {
    grad(&scores.contiguous()?, dy, (scale_tokens as f64).sqrt())
}

fn grad(scores: &Tensor, dy: &Tensor, c: f64) -> Result<Tensor> {
    scores.apply_op2_no_bwd(&dy.contiguous()?, &Grad { c })
}

struct Grad {
    c: f64,
}

impl CustomOp2 for Grad {
    fn name(&self) -> &'static str {
        "l2-norm-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = l1.dims().last().copied().unwrap_or(1).max(1);
        let out = match (s1, s2) {
            (CpuStorage::F32(s), CpuStorage::F32(d)) => {
                CpuStorage::F32(backward_f32(slice(s, l1)?, slice(d, l2)?, n, self.c))
            }
            (CpuStorage::F64(s), CpuStorage::F64(d)) => {
                CpuStorage::F64(backward(slice(s, l1)?, slice(d, l2)?, n, self.c))
            }
            _ => candle_core::bail!("Θ's gradient needs f32 or f64"),
        };
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::kernels::theta_cuda::l2_norm_gelu_grad_storage;
        let out = l2_norm_gelu_grad_storage((s1, l1), (s2, l2), self.c as f32)?;
        Ok((out, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// Values and gradients equal the composite definition's (f64), also for a zero row.
    #[test]
    fn matches_the_definition_and_its_autograd() {
        let dev = Device::Cpu;
        let mut v: Vec<f64> = (0..3 * 7)
            .map(|i| ((i * 37 % 11) as f64 - 5.0) * 0.3)
            .collect();
        v[14..21].iter_mut().for_each(|x| *x = 0.0);
        let s = Var::from_tensor(&Tensor::from_vec(v, (3, 7), &dev).unwrap()).unwrap();
        let w = Tensor::arange(0f64, 21.0, &dev)
            .unwrap()
            .reshape((3, 7))
            .unwrap();
        let fused = l2_norm_gelu(s.as_tensor(), 5).unwrap();
        let def =
            crate::pattention::theta(s.as_tensor(), crate::pattention::Activation::L2NormGelu, 5)
                .unwrap();
        let diff = crate::kernels::test_util::max_abs_diff;
        assert!(diff(&fused, &def) < 1e-12);
        let gf = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let a = gf.get(s.as_tensor()).unwrap();
        // Central differences of Σ Θ(s)·w on the non-zero rows (candle's own gelu_erf
        // gradient is off by ~2e-5 relative; PyTorch agrees with these).
        let base: Vec<f64> = s.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let got: Vec<f64> = a.flatten_all().unwrap().to_vec1().unwrap();
        let f = |v: &[f64]| -> f64 {
            let t = Tensor::from_vec(v.to_vec(), (3, 7), &dev).unwrap();
            (l2_norm_gelu(&t, 5).unwrap() * &w)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        for i in 0..14 {
            let (mut p, mut m) = (base.clone(), base.clone());
            p[i] += 1e-6;
            m[i] -= 1e-6;
            let fd = (f(&p) - f(&m)) / 2e-6;
            assert!(
                (got[i] - fd).abs() < 1e-7 * fd.abs().max(1.0),
                "{i}: {} vs {fd}",
                got[i]
            );
        }
        // The zero row: the definition's autograd gives NaN (√ at 0); here the clamped
        // norm's gradient, √n / 1e-30 · GELU′(0) · upstream.
        let zero: Vec<f64> = a.get(2).unwrap().to_vec1().unwrap();
        for (j, g) in zero.iter().enumerate() {
            let want = 5f64.sqrt() / 1e-30 * 0.5 * (14 + j) as f64;
            assert!((g - want).abs() <= 1e-12 * want, "{g} vs {want}");
        }
        assert_eq!(a.dtype(), DType::F64);
    }

    /// The vectorised f32 passes agree with the f64 ones to f32 precision, on rows of
    /// wide-ranging scores (the branch-free erf and exp included) and a zero row.
    #[test]
    fn the_f32_passes_agree_with_f64() {
        let (rows, n) = (5, 67);
        let mut s: Vec<f32> = (0..rows * n)
            .map(|i| ((i * 7919 % 201) as f32 - 100.0) * 0.05 * (1 + i % 3) as f32)
            .collect();
        s[4 * n..].iter_mut().for_each(|x| *x = 0.0);
        let dy: Vec<f32> = (0..rows * n)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.1)
            .collect();
        let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let c = 40f64.sqrt();
        let pairs = [
            (wide(&forward_f32(&s, n, c)), forward(&wide(&s), n, c)),
            (
                wide(&backward_f32(&s, &dy, n, c)[..4 * n]),
                backward(&wide(&s), &wide(&dy), n, c)[..4 * n].to_vec(),
            ),
        ];
        for (got, want) in pairs {
            let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 2e-6 * scale, "{i}: {g} vs {w}");
            }
        }
    }
}
