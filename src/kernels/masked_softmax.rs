//! softmax(scale · s) over the last axis of attention scores [.., queries, keys],
//! optionally causal (query q sees keys 0 ..= q + keys − queries, as adding the
//! −∞ mask first does), as one differentiable op: the backward needs only the
//! probabilities, ∂L/∂s = scale · y · (dy − Σ y·dy). On a GPU both passes are
//! `cuda/softmax.cu`'s kernels (training attention there: no [t, t] mask tensor,
//! no widened copy, sums and exponentials in f32 for f32, bf16 and f16 scores;
//! taken under `TOKENFORMER_CUDA_KERNELS=1`, see `serves`); on the CPU they are
//! plain f64 loops, so the op's logic is tested where there is no GPU.
// Without the `cuda` feature only the tests below use the op.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use candle_core::{Result, Tensor};

use super::row_op::{self, RowOp};

/// softmax(scale · scores) over the last axis, differentiable, with the causal
/// mask if `causal`.
pub fn softmax_scaled(scores: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    let dims = scores.dims();
    let (queries, keys) = match dims {
        [.., q, k] => (*q, *k),
        _ => candle_core::bail!("masked softmax: scores of rank ≥ 2, not {dims:?}"),
    };
    if causal && queries > keys {
        candle_core::bail!("masked softmax: {queries} causal queries over {keys} keys")
    }
    let Ok(queries) = i32::try_from(queries) else {
        candle_core::bail!("masked softmax: {queries} queries")
    };
    let op = Softmax {
        scale: scale as f32,
        queries,
        causal,
    };
    row_op::apply(scores, op)
}

#[derive(Clone)]
struct Softmax {
    scale: f32,
    queries: i32,
    causal: bool,
}

impl RowOp for Softmax {
    const NAME: &'static str = "masked-softmax";
    const GRAD_NAME: &'static str = "masked-softmax-grad";
    const GRAD_FROM_OUTPUT: bool = true;

    fn forward_row(&self, index: usize, x: &[f64], y: &mut [f64]) {
        let keys = x.len();
        let queries = self.queries.max(1) as usize;
        let seen = if self.causal {
            index % queries + keys - queries + 1
        } else {
            keys
        };
        let scale = f64::from(self.scale);
        let max = x[..seen]
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(scale * v));
        if max == f64::NEG_INFINITY {
            // Every seen score −∞ (a fully masked row): zeros, as the f32 rows and the
            // GPU kernel give, not 0/0.
            return;
        }
        let z: f64 = x[..seen].iter().map(|&v| (scale * v - max).exp()).sum();
        for (o, &v) in y[..seen].iter_mut().zip(x) {
            *o = (scale * v - max).exp() / z;
        }
    }

    fn grad_row(&self, y: &[f64], dy: &[f64], ds: &mut [f64]) {
        let dot: f64 = y.iter().zip(dy).map(|(a, b)| a * b).sum();
        let scale = f64::from(self.scale);
        for ((d, &y), &g) in ds.iter_mut().zip(y).zip(dy) {
            *d = scale * y * (g - dot);
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        x: (&candle_core::CudaStorage, &candle_core::Layout),
    ) -> Result<candle_core::CudaStorage> {
        cuda::forward(x, self.scale, self.queries, self.causal)
    }

    #[cfg(feature = "cuda")]
    fn cuda_grad(
        &self,
        y: (&candle_core::CudaStorage, &candle_core::Layout),
        dy: (&candle_core::CudaStorage, &candle_core::Layout),
    ) -> Result<candle_core::CudaStorage> {
        cuda::grad(y, dy, self.scale)
    }
}

/// Whether training's softmax takes the kernels for `scores` (see
/// [`super::rows_cuda::serves`]; rank ≥ 2).
#[cfg(feature = "cuda")]
pub(crate) fn serves(scores: &Tensor) -> bool {
    super::rows_cuda::serves(scores) && scores.rank() >= 2
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::super::rows_cuda::{launch_rows, Module};
    use candle_core::{CudaStorage, Layout, Result};

    const SOFTMAX: Module = Module {
        name: "tokenformer_softmax",
        ptx: include_str!(concat!(env!("OUT_DIR"), "/softmax.ptx")),
    };

    /// The softmax of contiguous scores whose second-to-last axis holds `queries`.
    pub(super) fn forward(
        scores: (&CudaStorage, &Layout),
        scale: f32,
        queries: i32,
        causal: bool,
    ) -> Result<CudaStorage> {
        let ints = [queries.max(1), i32::from(causal)];
        launch_rows(SOFTMAX, "softmax", &[scores], scale, &ints)
    }

    /// ∂L/∂s from the probabilities y and dy.
    pub(super) fn grad(
        y: (&CudaStorage, &Layout),
        dy: (&CudaStorage, &Layout),
        scale: f32,
    ) -> Result<CudaStorage> {
        launch_rows(SOFTMAX, "softmax_grad", &[y, dy], scale, &[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    /// Values and the gradient of Σ softmax·w equal the definition's under candle's
    /// autograd (mask added, then scaled softmax; f64), causal or not, with as many
    /// keys as queries and with a longer past.
    #[test]
    fn equals_the_definition_and_its_autograd() {
        let dev = Device::Cpu;
        let scale = 0.3;
        for (queries, keys) in [(5, 5), (3, 8)] {
            let n = 2 * queries * keys;
            let v: Vec<f64> = (0..n).map(|i| ((i * 37 % 19) as f64 - 9.0) * 0.7).collect();
            let x =
                Var::from_tensor(&Tensor::from_vec(v, (2, queries, keys), &dev).unwrap()).unwrap();
            let w = Tensor::arange(0f64, n as f64, &dev)
                .unwrap()
                .reshape((2, queries, keys))
                .unwrap()
                .sin()
                .unwrap();
            for causal in [false, true] {
                let mask: Vec<f64> = (0..queries)
                    .flat_map(|q| {
                        (0..keys).map(move |j| {
                            if !causal || j <= q + keys - queries {
                                0.0
                            } else {
                                f64::NEG_INFINITY
                            }
                        })
                    })
                    .collect();
                let mask = Tensor::from_vec(mask, (queries, keys), &dev).unwrap();
                let y = softmax_scaled(x.as_tensor(), scale, causal).unwrap();
                let z = (x.as_tensor().broadcast_add(&mask).unwrap() * scale).unwrap();
                let e = z
                    .broadcast_sub(&z.max_keepdim(D::Minus1).unwrap())
                    .unwrap()
                    .exp()
                    .unwrap();
                let want = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
                let flat = |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_vec1().unwrap() };
                for (a, b) in flat(&y).iter().zip(flat(&want)) {
                    assert!(
                        (a - b).abs() < 1e-6,
                        "{queries}x{keys} causal {causal}: {a} vs {b}"
                    );
                }
                let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let d = (&want * &w).unwrap().sum_all().unwrap().backward().unwrap();
                let (g, d) = (
                    flat(g.get(x.as_tensor()).unwrap()),
                    flat(d.get(x.as_tensor()).unwrap()),
                );
                for (a, b) in g.iter().zip(&d) {
                    assert!(
                        (a - b).abs() < 1e-6,
                        "{queries}x{keys} causal {causal} gradient: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// A row whose scores are all −∞ (fully masked) gives zeros and a zero gradient, as
    /// the f32 rows and the GPU kernel do, not 0/0; the other rows are untouched.
    #[test]
    fn a_fully_masked_row_gives_zeros() {
        let dev = Device::Cpu;
        let inf = f64::NEG_INFINITY;
        let x = Tensor::new(&[[inf, inf, inf], [0.5, inf, -1.0]], &dev).unwrap();
        let x = Var::from_tensor(&x).unwrap();
        let y = softmax_scaled(x.as_tensor(), 0.5, false).unwrap();
        let rows: Vec<Vec<f64>> = y.to_vec2().unwrap();
        assert_eq!(rows[0], [0.0, 0.0, 0.0]);
        let want = [(0.25f64).exp(), 0.0, (-0.5f64).exp()];
        let sum: f64 = want.iter().sum();
        for (a, b) in rows[1].iter().zip(want) {
            assert!((a - b / sum).abs() < 1e-12, "{a} vs {}", b / sum);
        }
        let w = Tensor::new(&[[1.0f64, 2.0, 3.0], [1.0, 2.0, 3.0]], &dev).unwrap();
        let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let g: Vec<Vec<f64>> = g.get(x.as_tensor()).unwrap().to_vec2().unwrap();
        assert_eq!(g[0], [0.0, 0.0, 0.0]);
        assert!(g[1].iter().all(|v| v.is_finite()));
    }
}
