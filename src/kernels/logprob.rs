//! Log-softmax-gather as a differentiable op: for logits [n, classes] and u32
//! targets [n], the rows (log p(target), log-sum-exp, first argmax) as [n, 3] f32
//! from one read of the logits, with a backward that writes
//! ∂L/∂x = (g_lse − g_logp) · softmax(x) + g_logp · one-hot(target) in one pass.
//! On a GPU both are `cuda/logprob.cu`'s kernels (scoring's reductions and
//! training's cross-entropy, [`cross_entropy`]); on the CPU they are plain loops
//! in f64, so the op's own logic (its backward's coefficients among it) is
//! tested where there is no GPU.
// Without the `cuda` feature only the tests below use the op.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::row_op;

/// The mean over rows of log-sum-exp − x[target] of `logits` [n, classes], an f32
/// scalar with its backward, for targets already checked to lie below `classes`.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let index = Tensor::new(targets, logits.device())?;
    let rows = logits.contiguous()?.apply_op2(&index, LogprobGather)?;
    rows.narrow(1, 0, 1)?.neg()?.mean_all()
}

/// [n, 3] f32: log p(target), log-sum-exp, first argmax (as f32) of each row.
pub(crate) struct LogprobGather;

/// The first index of the row's maximum and the row's log-sum-exp.
fn row_stats(row: &[f64]) -> (usize, f64) {
    let arg = crate::generate::first_argmax(row);
    // No value above −∞ (NaNs never win): the row's log-sum-exp is −∞, or NaN if
    // it holds a NaN (as the GPU kernel and torch.logsumexp give).
    let Some(max) = row.get(arg).copied().filter(|&m| m > f64::NEG_INFINITY) else {
        let nan = row.iter().any(|x| x.is_nan());
        return (arg, if nan { f64::NAN } else { f64::NEG_INFINITY });
    };
    let sum: f64 = row.iter().map(|&x| (x - max).exp()).sum();
    (arg, max + sum.ln())
}

impl CustomOp2 for LogprobGather {
    fn name(&self) -> &'static str {
        "log-softmax-gather"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, classes) = ll.shape().dims2()?;
        let x = row_op::f64s(logits, ll)?;
        let t = row_op::contiguous::<u32>(targets, lt)?;
        if t.len() != n || t.iter().any(|&t| t as usize >= classes) {
            candle_core::bail!("log-softmax-gather: {n} targets below {classes} wanted")
        }
        let mut out = Vec::with_capacity(3 * n);
        for (row, &t) in x.chunks(classes.max(1)).zip(t) {
            let (arg, lse) = row_stats(row);
            out.extend([(row[t as usize] - lse) as f32, lse as f32, arg as f32]);
        }
        Ok((CpuStorage::F32(out), Shape::from((n, 3))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        targets: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::logprob_cuda::gather(logits, ll, targets, lt)
    }

    /// With g_logp and g_lse the gradients of the first two columns:
    /// ∂L/∂x = (g_lse − g_logp) · softmax(x) + g_logp · one-hot(target).
    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g_logp = grad_res.narrow(1, 0, 1)?;
        let g_lse = grad_res.narrow(1, 1, 1)?;
        let lse = res.narrow(1, 1, 1)?;
        let coef = Tensor::cat(&[&(g_lse - &g_logp)?, &g_logp.neg()?, &lse], 1)?
            .to_dtype(DType::F32)?
            .contiguous()?;
        let dx = logits.apply_op3_no_bwd(targets, &coef, &LogprobGrad)?;
        Ok((Some(dx), None))
    }
}

/// From logits [n, classes], targets [n] and f32 coefficients (a, b, lse) [n, 3]:
/// a · exp(x − lse) − b · one-hot(target), in the logits' dtype.
struct LogprobGrad;

impl CustomOp3 for LogprobGrad {
    fn name(&self) -> &'static str {
        "log-softmax-gather-grad"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        ll: &Layout,
        targets: &CpuStorage,
        lt: &Layout,
        coef: &CpuStorage,
        lc: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, classes) = ll.shape().dims2()?;
        let x = row_op::f64s(logits, ll)?;
        let t = row_op::contiguous::<u32>(targets, lt)?;
        let c = row_op::contiguous::<f32>(coef, lc)?;
        if t.len() != n || c.len() != 3 * n {
            candle_core::bail!("log-softmax-gather gradient: inputs for {n} rows wanted")
        }
        let mut dx = Vec::with_capacity(n * classes);
        for ((row, &t), c) in x.chunks(classes.max(1)).zip(t).zip(c.chunks(3)) {
            let (a, b, lse) = (f64::from(c[0]), f64::from(c[1]), f64::from(c[2]));
            dx.extend(
                row.iter()
                    .enumerate()
                    .map(|(j, &x)| a * (x - lse).exp() - if j == t as usize { b } else { 0.0 }),
            );
        }
        Ok((row_op::like(logits, dx), ll.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        ll: &Layout,
        targets: &candle_core::CudaStorage,
        lt: &Layout,
        coef: &candle_core::CudaStorage,
        lc: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::logprob_cuda::grad((logits, ll), (targets, lt), (coef, lc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Rows a broken model gives (a NaN among finite logits, a +∞, only NaNs, NaNs
    /// and −∞) come out with a non-finite log p and log-sum-exp, which scoring
    /// refuses, never a finite number; a row of only −∞ has log-sum-exp −∞.
    #[test]
    fn rows_of_nan_or_infinite_logits_give_non_finite_results() {
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let rows: [[f32; 4]; 5] = [
            [0.5, nan, 1.0, 2.0],
            [0.5, inf, 1.0, 2.0],
            [nan; 4],
            [-inf, nan, -inf, -inf],
            [-inf; 4],
        ];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let x = Tensor::from_vec(flat, (5, 4), &Device::Cpu).unwrap();
        let index = Tensor::new(&[0u32, 0, 0, 0, 0], &Device::Cpu).unwrap();
        let out = x
            .apply_op2(&index, LogprobGather)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (r, o) in out.iter().enumerate().take(4) {
            assert!(!o[0].is_finite() && !o[1].is_finite(), "row {r}: {o:?}");
        }
        assert!(out[2][1].is_nan() && out[3][1].is_nan(), "{out:?}");
        assert_eq!(out[4][1], f32::NEG_INFINITY);
    }

    /// The op's loss and gradients equal the composite definition's under candle's
    /// autograd (f64 logits), also when a loss uses the log-sum-exp column too.
    #[test]
    fn cross_entropy_and_its_gradient_equal_the_definition() {
        let dev = Device::Cpu;
        let (n, classes) = (6, 11);
        let v: Vec<f64> = (0..n * classes)
            .map(|i| ((i * 37 % 23) as f64 - 11.0) * 0.4)
            .collect();
        let targets: Vec<u32> = (0..n).map(|i| (i * 5 % classes) as u32).collect();
        let x = Var::from_tensor(&Tensor::from_vec(v, (n, classes), &dev).unwrap()).unwrap();
        let index = Tensor::new(targets.as_slice(), &dev).unwrap();
        // A loss reading both columns with different weights per row: 2·mean(−log p)
        // + Σ_i w_i·lse_i.
        let w = Tensor::arange(1f32, 1.0 + n as f32, &dev)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let fused = {
            let rows = x.as_tensor().apply_op2(&index, LogprobGather).unwrap();
            let ce = cross_entropy(x.as_tensor(), &targets).unwrap();
            let lse = rows.narrow(1, 1, 1).unwrap();
            ((ce * 2.0).unwrap() + (lse * &w).unwrap().sum_all().unwrap()).unwrap()
        };
        let def = {
            let z = x.as_tensor();
            let lse = z
                .broadcast_sub(&z.max_keepdim(1).unwrap().detach())
                .unwrap()
                .exp()
                .unwrap()
                .sum_keepdim(1)
                .unwrap()
                .log()
                .unwrap()
                .broadcast_add(&z.max_keepdim(1).unwrap().detach())
                .unwrap();
            let picked = z.gather(&index.unsqueeze(1).unwrap(), 1).unwrap();
            let ce = (&lse - picked).unwrap().mean_all().unwrap();
            let w = w.to_dtype(DType::F64).unwrap();
            ((ce * 2.0).unwrap() + (lse * &w).unwrap().sum_all().unwrap()).unwrap()
        };
        let got = fused
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        let want = def.to_scalar::<f64>().unwrap();
        assert!((got - want).abs() < 1e-5 * want.abs(), "{got} vs {want}");
        let g = fused.backward().unwrap();
        let d = def.backward().unwrap();
        let (g, d) = (g.get(x.as_tensor()).unwrap(), d.get(x.as_tensor()).unwrap());
        let (g, d): (Vec<f64>, Vec<f64>) = (
            g.flatten_all().unwrap().to_vec1().unwrap(),
            d.flatten_all().unwrap().to_vec1().unwrap(),
        );
        for (i, (a, b)) in g.iter().zip(&d).enumerate() {
            assert!((a - b).abs() < 1e-6 * b.abs().max(1.0), "{i}: {a} vs {b}");
        }
        // The argmax column: the first index of each row's maximum.
        let rows = x.as_tensor().apply_op2(&index, LogprobGather).unwrap();
        let arg: Vec<f32> = rows
            .narrow(1, 2, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let x: Vec<Vec<f64>> = x.as_tensor().to_vec2().unwrap();
        for (row, a) in x.iter().zip(arg) {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(a as usize, row.iter().position(|&v| v == max).unwrap());
        }
    }
}
