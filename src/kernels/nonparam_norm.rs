//! LayerNorm without weight and bias over the last axis (the official
//! `layernorm_nonparam`; biased variance, as torch) as one differentiable op:
//! y = (x − mean) / √(var + eps), and ∂L/∂x = (dy − mean(dy) − y · mean(dy · y)) /
//! √(var + eps) from x and dy. On a GPU both passes are `cuda/norm.cu`'s kernels
//! (training there: one read and one write each way instead of candle's dozen
//! element-wise and reduction launches, sums in f32 for f32, bf16 and f16 rows;
//! taken under `TOKENFORMER_CUDA_KERNELS=1`, see `serves`); on the CPU they
//! are plain f64 loops, so the op's logic is tested where there is no GPU.
// Without the `cuda` feature only the tests below use the op.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use candle_core::{Result, Tensor};

use super::row_op::{self, RowOp};

/// The normalised `x` over its last axis, differentiable.
pub fn layer_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    row_op::apply(x, Norm { eps: eps as f32 })
}

#[derive(Clone)]
struct Norm {
    eps: f32,
}

impl Norm {
    /// The row's mean and 1 / √(var + eps).
    fn moments(&self, row: &[f64]) -> (f64, f64) {
        let n = row.len().max(1) as f64;
        let mean = row.iter().sum::<f64>() / n;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        (mean, 1.0 / (var + f64::from(self.eps)).sqrt())
    }
}

impl RowOp for Norm {
    const NAME: &'static str = "layer-norm-nonparam";
    const GRAD_NAME: &'static str = "layer-norm-nonparam-grad";
    const GRAD_FROM_OUTPUT: bool = false;

    fn forward_row(&self, _: usize, x: &[f64], y: &mut [f64]) {
        let (mean, rstd) = self.moments(x);
        for (y, x) in y.iter_mut().zip(x) {
            *y = (x - mean) * rstd;
        }
    }

    fn grad_row(&self, x: &[f64], dy: &[f64], dx: &mut [f64]) {
        let (mean, rstd) = self.moments(x);
        let n = x.len().max(1) as f64;
        let a = dy.iter().sum::<f64>() / n;
        let b = dy
            .iter()
            .zip(x)
            .map(|(g, x)| g * (x - mean) * rstd)
            .sum::<f64>()
            / n;
        for ((d, g), x) in dx.iter_mut().zip(dy).zip(x) {
            *d = rstd * (g - a - (x - mean) * rstd * b);
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        x: (&candle_core::CudaStorage, &candle_core::Layout),
    ) -> Result<candle_core::CudaStorage> {
        cuda::forward(x, self.eps)
    }

    #[cfg(feature = "cuda")]
    fn cuda_grad(
        &self,
        x: (&candle_core::CudaStorage, &candle_core::Layout),
        dy: (&candle_core::CudaStorage, &candle_core::Layout),
    ) -> Result<candle_core::CudaStorage> {
        cuda::grad(x, dy, self.eps)
    }
}

/// Whether training's LayerNorm takes the kernels for `x` (see
/// [`super::rows_cuda::serves`]).
#[cfg(feature = "cuda")]
pub(crate) fn serves(x: &Tensor) -> bool {
    super::rows_cuda::serves(x) && x.rank() >= 1
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
