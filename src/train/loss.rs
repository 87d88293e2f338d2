//! Mean cross-entropy of logits [n, classes] against class ids as one operation with
//! its own backward pass: the forward keeps nothing but the scalar, the backward writes
//! (softmax − one-hot) · grad / n in one sweep. Composed from candle ops (log-softmax,
//! gather, mean) the same loss keeps several logits-sized tensors alive and walks them
//! repeatedly, which dominates a language model's training step at a 50k vocabulary.
//!
//! Row sums are accumulated in f64, so the f32 result is at least as close to the exact
//! value as PyTorch's.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// The mean over rows of logsumexp(x) − x[target].
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    if targets.len() != n {
        candle_core::bail!("{} targets for {n} rows of logits", targets.len())
    }
    if let Some(t) = targets.iter().find(|&&t| t as usize >= v) {
        candle_core::bail!("target {t} outside {v} classes")
    }
    logits.contiguous()?.apply_op1(CrossEntropy {
        targets: targets.to_vec(),
    })
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

fn grad<T: Copy + Into<f64> + Send + Sync>(
    x: &[T],
    v: usize,
    targets: &[u32],
    scale: f64,
    from: impl Fn(f64) -> T + Sync,
) -> Vec<T> {
    let mut out: Vec<T> = x.to_vec();
    out.par_chunks_mut(v)
        .zip(x.par_chunks(v).zip(targets.par_iter()))
        .for_each(|(o, (row, &t))| {
            let (max, lse) = row_lse(row);
            let shift = max + lse;
            for (j, (o, &x)) in o.iter_mut().zip(row).enumerate() {
                let p = (x.into() - shift).exp() - f64::from(u8::from(j == t as usize));
                *o = from(p * scale);
            }
        });
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
                CpuStorage::F32(vec![loss(contiguous(s, layout)?, v, &self.targets) as f32])
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
            CpuStorage::F32(s) => CpuStorage::F32(grad(
                contiguous(s, layout)?,
                v,
                &self.targets,
                self.scale,
                |x| x as f32,
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
