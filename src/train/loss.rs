//! Mean cross-entropy of logits [n, classes] against class ids as one operation with
//! its own backward pass: the forward keeps nothing but the scalar, the backward writes
//! (softmax − one-hot) · grad / n in one sweep. Composed from candle ops (log-softmax,
//! gather, mean) the same loss keeps several logits-sized tensors alive and walks them
//! repeatedly, which dominates a language model's training step at a 50k vocabulary.
//!
//! Row sums are accumulated in f64 (f32 lanes flushed to f64 every 4096 values for f32
//! logits, whose exponentials are the inference kernels' vectorised ones, ≈1 ulp).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// The mean over rows of logsumexp(x) − x\[target\].
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    check_targets(n, v, targets)?;
    #[cfg(feature = "cuda")]
    if crate::kernels::logprob_cuda_serves(logits) {
        return crate::kernels::cuda::cross_entropy(logits, targets);
    }
    if !crate::kernels::fused_on(logits) || !matches!(logits.dtype(), DType::F32 | DType::F64) {
        return composite(logits, targets);
    }
    logits.contiguous()?.apply_op1(CrossEntropy {
        targets: targets.to_vec(),
    })
}

/// The same loss in differentiable candle ops, in f32 at least (a GPU's path
/// without the CUDA kernels).
fn composite(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let x = crate::kernels::widened(logits)?;
    let max = x.max_keepdim(1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(1)?.log()?;
    let index = Tensor::new(targets, x.device())?.unsqueeze(1)?;
    let picked = shifted.gather(&index, 1)?;
    (lse - picked)?.mean_all()
}

struct CrossEntropy {
    targets: Vec<u32>,
}

/// Row maximum and log Σ exp(x − max), in f64.
fn row_lse<T: Copy + Into<f64>>(row: &[T]) -> (f64, f64) {
    let max = row
        .iter()
        .map(|&x| x.into())
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row.iter().map(|&x| (x.into() - max).exp()).sum();
    (max, sum.ln())
}

fn loss<T: Copy + Into<f64> + Sync>(x: &[T], v: usize, targets: &[u32]) -> f64 {
    let total: f64 = x
        .par_chunks(v)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let (max, lse) = row_lse(row);
            max + lse - row[t as usize].into()
        })
        .sum();
    total / targets.len().max(1) as f64
}

/// Each row of logits [rows, v] becomes (softmax − one-hot) · scale in place, in f64
/// arithmetic; returns the rows' summed loss, logsumexp − x[target].
fn grad_rows_in_place<T: Copy + Into<f64> + Send + Sync>(
    x: &mut [T],
    v: usize,
    targets: &[u32],
    scale: f64,
    from: impl Fn(f64) -> T + Sync,
) -> f64 {
    x.par_chunks_mut(v)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let (max, lse) = row_lse(row);
            let shift = max + lse;
            let loss = shift - row[t as usize].into();
            for (j, x) in row.iter_mut().enumerate() {
                let p = ((*x).into() - shift).exp() - f64::from(u8::from(j == t as usize));
                *x = from(p * scale);
            }
            loss
        })
        .sum()
}

fn grad<T: Copy + Into<f64> + Send + Sync>(
    x: &[T],
    v: usize,
    targets: &[u32],
    scale: f64,
    from: impl Fn(f64) -> T + Sync,
) -> Vec<T> {
    let mut out = x.to_vec();
    grad_rows_in_place(&mut out, v, targets, scale, from);
    out
}

/// f32 logits: the row's max and Σ exp by the vectorised kernel.
fn loss_f32(x: &[f32], v: usize, targets: &[u32]) -> f64 {
    let total: f64 = x
        .par_chunks(v)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let (max, sum) = crate::kernels::max_and_exp_sum(row);
            f64::from(max) + sum.ln() - f64::from(row[t as usize])
        })
        .sum();
    total / targets.len().max(1) as f64
}

/// One row of softmax · scale in place, in f32, with `shift` = logsumexp.
#[inline(always)]
fn grad_row_in_place_generic(row: &mut [f32], shift: f32, scale: f32) {
    for x in row.iter_mut() {
        *x = crate::kernels::math::exp_f32(*x - shift) * scale;
    }
}

super::parts::by_isa!(grad_row_in_place(row: &mut [f32], shift: f32, scale: f32) = grad_row_in_place_generic);

/// [`grad_rows_in_place`] for f32 logits: the row's max and Σ exp by the vectorised
/// kernel, exp(x − shift) by the f32 one.
fn grad_rows_in_place_f32(x: &mut [f32], v: usize, targets: &[u32], scale: f64) -> f64 {
    x.par_chunks_mut(v)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let (max, sum) = crate::kernels::max_and_exp_sum(row);
            // The shift in f64, rounded once: exp(x − shift) is then p to f32 precision.
            let lse = f64::from(max) + sum.ln();
            let loss = lse - f64::from(row[t as usize]);
            grad_row_in_place(row, lse as f32, scale as f32);
            row[t as usize] -= scale as f32;
            loss
        })
        .sum()
}

/// The loss over logits [rows, v] (as [`cross_entropy`] computes it), turning the
/// logits into the loss's gradient (softmax − one-hot) / rows where they are: the
/// fused head's forward, which has the gradient ready for its backward.
pub(crate) fn loss_and_grad_in_place_f32(x: &mut [f32], v: usize, targets: &[u32]) -> f64 {
    let scale = 1.0 / targets.len().max(1) as f64;
    grad_rows_in_place_f32(x, v, targets, scale) * scale
}

/// [`loss_and_grad_in_place_f32`] in f64 arithmetic for any element type.
pub(crate) fn loss_and_grad_in_place<T: Copy + Into<f64> + Send + Sync>(
    x: &mut [T],
    v: usize,
    targets: &[u32],
    from: impl Fn(f64) -> T + Sync,
) -> f64 {
    let scale = 1.0 / targets.len().max(1) as f64;
    grad_rows_in_place(x, v, targets, scale, from) * scale
}

/// Checks that `targets` has one class id below `v` per row of `n`.
pub(crate) fn check_targets(n: usize, v: usize, targets: &[u32]) -> Result<()> {
    if targets.len() != n {
        candle_core::bail!("{} targets for {n} rows of logits", targets.len())
    }
    if let Some(t) = targets.iter().find(|&&t| t as usize >= v) {
        candle_core::bail!("target {t} outside {v} classes")
    }
    Ok(())
}

fn grad_f32(x: &[f32], v: usize, targets: &[u32], scale: f64) -> Vec<f32> {
    let mut out = x.to_vec();
    grad_rows_in_place_f32(&mut out, v, targets, scale);
    out
}

fn contiguous<'a, T>(s: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("cross-entropy needs contiguous logits"),
    }
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = layout.dims()[1];
        let out = match storage {
            CpuStorage::F32(s) => {
                CpuStorage::F32(vec![
                    loss_f32(contiguous(s, layout)?, v, &self.targets) as f32
                ])
            }
            CpuStorage::F64(s) => {
                CpuStorage::F64(vec![loss(contiguous(s, layout)?, v, &self.targets)])
            }
            _ => candle_core::bail!("cross-entropy needs f32 or f64 logits"),
        };
        Ok((out, Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let op = CrossEntropyGrad {
            targets: self.targets.clone(),
            scale: g / self.targets.len().max(1) as f64,
        };
        Ok(Some(arg.apply_op1_no_bwd(&op)?))
    }
}

struct CrossEntropyGrad {
    targets: Vec<u32>,
    scale: f64,
}

impl CustomOp1 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "cross-entropy-grad"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = layout.dims()[1];
        let out = match storage {
            CpuStorage::F32(s) => CpuStorage::F32(grad_f32(
                contiguous(s, layout)?,
                v,
                &self.targets,
                self.scale,
            )),
            CpuStorage::F64(s) => CpuStorage::F64(grad(
                contiguous(s, layout)?,
                v,
                &self.targets,
                self.scale,
                |x| x,
            )),
            _ => candle_core::bail!("cross-entropy needs f32 or f64 logits"),
        };
        Ok((out, layout.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised f32 passes agree with the f64 ones on vocabulary-sized rows of
    /// wide-ranging logits: the loss to 1e-6 relative, each gradient to 1e-7 of the
    /// largest (the one-hot entries of probability near 1 included).
    #[test]
    fn the_f32_passes_agree_with_f64() {
        let (rows, v) = (4, 5003);
        let mut x: Vec<f32> = (0..rows * v)
            .map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 0.02)
            .collect();
        x[2 * v + 17] = 40.0; // a row whose softmax is almost one-hot
        let targets = [3u32, 5002, 17, 0];
        let wide: Vec<f64> = x.iter().map(|&a| f64::from(a)).collect();
        let (l32, l64) = (loss_f32(&x, v, &targets), loss(&wide, v, &targets));
        assert!((l32 - l64).abs() <= 1e-6 * l64.abs(), "{l32} vs {l64}");
        let scale = 1.0 / rows as f64;
        let g32 = grad_f32(&x, v, &targets, scale);
        let g64 = grad(&wide, v, &targets, scale, |a| a);
        for (i, (a, b)) in g32.iter().zip(&g64).enumerate() {
            assert!((f64::from(*a) - b).abs() <= 1e-7 * scale, "{i}: {a} vs {b}");
        }
    }
}
