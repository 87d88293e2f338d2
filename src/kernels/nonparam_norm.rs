//! LayerNorm without weight and bias over the last axis (the official
//! `layernorm_nonparam`; biased variance, as torch) as one differentiable op:
//! y = (x − mean) / √(var + eps), and ∂L/∂x = (dy − mean(dy) − y · mean(dy · y)) /
//! √(var + eps) from x and dy. On a GPU both passes are `cuda/norm.cu`'s kernels
//! (training there: one read and one write each way instead of candle's dozen
//! element-wise and reduction launches, sums in f32 for f32, bf16 and f16 rows;
//! taken under `TOKENFORMER_CUDA_KERNELS=1`, see [`serves`]); on the CPU they
//! are plain f64 loops, so the op's logic is tested where there is no GPU.
// Without the `cuda` feature only the tests below use the op.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// The normalised `x` over its last axis, differentiable.
pub fn layer_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Norm { eps: eps as f32 })
}

struct Norm {
    eps: f32,
}

/// A CPU storage's contiguous f32 or f64 elements in f64.
fn cpu_f64(s: &CpuStorage, layout: &Layout) -> Result<Vec<f64>> {
    let Some((a, b)) = layout.contiguous_offsets() else {
        candle_core::bail!("layer norm: contiguous inputs only")
    };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].iter().map(|&x| f64::from(x)).collect(),
        CpuStorage::F64(v) => v[a..b].to_vec(),
        _ => candle_core::bail!("layer norm on the CPU: f32 or f64, not {:?}", s.dtype()),
    })
}

/// `v` in the dtype of `like`.
fn cpu_like(like: &CpuStorage, v: Vec<f64>) -> CpuStorage {
    match like.dtype() {
        DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
        _ => CpuStorage::F64(v),
    }
}

/// The row's mean and 1 / √(var + eps).
fn moments(row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len().max(1) as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

fn last_dim(layout: &Layout) -> usize {
    layout.dims().last().copied().unwrap_or(1).max(1)
}

impl CustomOp1 for Norm {
    fn name(&self) -> &'static str {
        "layer-norm-nonparam"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = cpu_f64(storage, layout)?;
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks(last_dim(layout)) {
            let (mean, rstd) = moments(row, f64::from(self.eps));
            y.extend(row.iter().map(|v| (v - mean) * rstd));
        }
        Ok((cpu_like(storage, y), layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::forward((storage, layout), self.eps)?;
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        Ok(Some(arg.apply_op2_no_bwd(&g, &Grad { eps: self.eps })?))
    }
}

/// ∂L/∂x from x and dy.
struct Grad {
    eps: f32,
}

impl CustomOp2 for Grad {
    fn name(&self) -> &'static str {
        "layer-norm-nonparam-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, dy) = (cpu_f64(s1, l1)?, cpu_f64(s2, l2)?);
        let n = last_dim(l1);
        let mut dx = Vec::with_capacity(x.len());
        for (row, g) in x.chunks(n).zip(dy.chunks(n)) {
            let (mean, rstd) = moments(row, f64::from(self.eps));
            let a = g.iter().sum::<f64>() / n as f64;
            let b = g
                .iter()
                .zip(row)
                .map(|(g, x)| g * (x - mean) * rstd)
                .sum::<f64>()
                / n as f64;
            dx.extend(
                g.iter()
                    .zip(row)
                    .map(|(g, x)| rstd * (g - a - (x - mean) * rstd * b)),
            );
        }
        Ok((cpu_like(s1, dx), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::grad((s1, l1), (s2, l2), self.eps)?;
        Ok((out, l1.shape().clone()))
    }
}

/// Whether training's LayerNorm takes the kernels for `x`: the CUDA kernels
/// turned on, f32/bf16/f16 on a GPU.
#[cfg(feature = "cuda")]
pub(crate) fn serves(x: &Tensor) -> bool {
    super::cuda_kernels_enabled()
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && x.rank() >= 1
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::super::rows_cuda::{launch_rows, Module};
    use candle_core::{CudaStorage, Layout, Result};

    const NORM: Module = Module {
        name: "tokenformer_norm",
        ptx: include_str!(concat!(env!("OUT_DIR"), "/norm.ptx")),
    };

    pub(super) fn forward(x: (&CudaStorage, &Layout), eps: f32) -> Result<CudaStorage> {
        launch_rows(NORM, "layer_norm", &[x], eps, &[])
    }

    pub(super) fn grad(
        x: (&CudaStorage, &Layout),
        dy: (&CudaStorage, &Layout),
        eps: f32,
    ) -> Result<CudaStorage> {
        launch_rows(NORM, "layer_norm_grad", &[x, dy], eps, &[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    /// Values and the gradient of Σ LN(x)·w equal the definition's under candle's
    /// autograd (f64), a constant row (variance 0) included.
    #[test]
    fn equals_the_definition_and_its_autograd() {
        let dev = Device::Cpu;
        let (rows, n) = (4, 13);
        let mut v: Vec<f64> = (0..rows * n)
            .map(|i| ((i * 37 % 19) as f64 - 9.0) * 0.7 + 3.0)
            .collect();
        v[3 * n..].iter_mut().for_each(|x| *x = 0.5);
        let x = Var::from_tensor(&Tensor::from_vec(v, (rows, n), &dev).unwrap()).unwrap();
        let w = Tensor::arange(0f64, (rows * n) as f64, &dev)
            .unwrap()
            .reshape((rows, n))
            .unwrap()
            .cos()
            .unwrap();
        let eps = 1e-5;
        let y = layer_norm(x.as_tensor(), eps).unwrap();
        let z = x.as_tensor();
        let centred = z
            .broadcast_sub(&z.mean_keepdim(D::Minus1).unwrap())
            .unwrap();
        let var = centred.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let want = centred
            .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
            .unwrap();
        let flat = |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_vec1().unwrap() };
        for (a, b) in flat(&y).iter().zip(flat(&want)) {
            assert!((a - b).abs() < 1e-9, "{a} vs {b}");
        }
        let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let d = (&want * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let (g, d) = (
            flat(g.get(x.as_tensor()).unwrap()),
            flat(d.get(x.as_tensor()).unwrap()),
        );
        for (i, (a, b)) in g.iter().zip(&d).enumerate() {
            assert!((a - b).abs() < 1e-7 * b.abs().max(1.0), "{i}: {a} vs {b}");
        }
    }
}
