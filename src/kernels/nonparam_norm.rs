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

/// ∂L/∂x of [`layer_norm`] at `x` from ∂L/∂y, outside the graph.
pub(crate) fn layer_norm_grad(x: &Tensor, dy: &Tensor, eps: f64) -> Result<Tensor> {
    row_op::grad(x, dy, Norm { eps: eps as f32 })
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

/// Inference's residual and the norm after it: x + a and its normalised
/// rows, `[2, ...x's shape]` as one tensor (the sum first), from one kernel pass
/// on a GPU (`cuda/norm.cu`'s `add_layer_norm`) instead of an addition and a
/// norm. The sum is rounded to x's dtype before it is normalised, as the two
/// ops do it. On the CPU (f32, f64) the same definition in plain loops, so the
/// op's logic is tested where there is no GPU. No backward.
pub fn add_layer_norm(x: &Tensor, a: &Tensor, eps: f64) -> Result<Tensor> {
    if x.shape() != a.shape() || x.dtype() != a.dtype() {
        candle_core::bail!(
            "add-layer-norm: {:?} {:?} and {:?} {:?}",
            x.dims(),
            x.dtype(),
            a.dims(),
            a.dtype()
        )
    }
    let (x, a) = (x.contiguous()?, a.contiguous()?);
    let mut shape = vec![2];
    shape.extend_from_slice(x.dims());
    x.apply_op2_no_bwd(&a, &AddNorm(Norm { eps: eps as f32 }))?
        .reshape(shape)
}

/// [`add_layer_norm`]'s op: its output is flat, [2 · elements].
struct AddNorm(Norm);

impl candle_core::CustomOp2 for AddNorm {
    fn name(&self) -> &'static str {
        "add-layer-norm-nonparam"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (x, a) = (row_op::f64s(s1, l1)?, row_op::f64s(s2, l2)?);
        let f32s = matches!(s1, candle_core::CpuStorage::F32(_));
        // The sum rounded to the inputs' dtype, as an addition op would leave it.
        let sum: Vec<f64> = x
            .iter()
            .zip(&a)
            .map(|(x, a)| {
                if f32s {
                    f64::from((x + a) as f32)
                } else {
                    x + a
                }
            })
            .collect();
        let n = l1.dims().last().copied().unwrap_or(1).max(1);
        let mut y = vec![0.0; sum.len()];
        for (s, y) in sum.chunks(n).zip(y.chunks_mut(n)) {
            self.0.forward_row(0, s, y);
        }
        let out = [sum, y].concat();
        Ok((row_op::like(s1, out), candle_core::Shape::from(2 * x.len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CudaStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let elements = l1.shape().elem_count();
        let out = cuda::add_forward((s1, l1), (s2, l2), self.0.eps)?;
        Ok((out, candle_core::Shape::from(2 * elements)))
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
    use super::super::rows_cuda::{launch_rows, launch_rows_n, Module};
    use candle_core::{CudaStorage, Layout, Result};

    const NORM: Module = Module {
        name: "tokenformer_norm",
        ptx: include_str!(concat!(env!("OUT_DIR"), "/norm.ptx")),
    };

    pub(super) fn forward(x: (&CudaStorage, &Layout), eps: f32) -> Result<CudaStorage> {
        launch_rows(NORM, "layer_norm", &[x], eps, &[])
    }

    pub(super) fn add_forward(
        x: (&CudaStorage, &Layout),
        a: (&CudaStorage, &Layout),
        eps: f32,
    ) -> Result<CudaStorage> {
        launch_rows_n(NORM, "add_layer_norm", &[x, a], 2, eps, &[])
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

    /// The residual and the norm in one op: the sum x + a bit for bit, and the
    /// normalised sum as the standalone op gives it; mismatched inputs are an error.
    #[test]
    fn add_layer_norm_is_the_sum_and_its_norm() {
        let dev = Device::Cpu;
        let x = (Tensor::randn(0f32, 3.0, (2, 3, 40), &dev).unwrap() + 2.0).unwrap();
        let a = Tensor::randn(0f32, 1.0, (2, 3, 40), &dev).unwrap();
        let out = add_layer_norm(&x, &a, 1e-5).unwrap();
        assert_eq!(out.dims(), &[2, 2, 3, 40]);
        let sum = (&x + &a).unwrap();
        let bits = crate::kernels::test_util::bits;
        assert_eq!(bits(&out.get(0).unwrap()), bits(&sum));
        assert_eq!(
            bits(&out.get(1).unwrap()),
            bits(&layer_norm(&sum, 1e-5).unwrap())
        );
        let d = crate::kernels::test_util::max_abs_diff(&out.get(1).unwrap(), &sum);
        assert!(d > 0.5, "nothing normalised: {d}");
        let e = add_layer_norm(&x, &a.narrow(2, 0, 39).unwrap(), 1e-5).unwrap_err();
        assert!(e.to_string().contains("add-layer-norm"), "{e}");
    }
}
