//! softmax(scale · s) over the last axis of attention scores [.., queries, keys],
//! optionally causal (query q sees keys 0 ..= q + keys − queries, as adding the
//! −∞ mask first does), as one differentiable op: the backward needs only the
//! probabilities, ∂L/∂s = scale · y · (dy − Σ y·dy). On a GPU both passes are
//! `cuda/softmax.cu`'s kernels (training attention there: no [t, t] mask tensor,
//! no widened copy, sums and exponentials in f32 for f32, bf16 and f16 scores;
//! taken under `TOKENFORMER_CUDA_KERNELS=1`, see [`serves`]); on the CPU they are
//! plain f64 loops, so the op's logic is tested where there is no GPU.
// Without the `cuda` feature only the tests below use the op.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

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
    scores.contiguous()?.apply_op1(Softmax {
        scale: scale as f32,
        queries,
        causal,
    })
}

struct Softmax {
    scale: f32,
    queries: i32,
    causal: bool,
}

/// A CPU storage's contiguous f32 or f64 elements in f64.
fn cpu_f64(s: &CpuStorage, layout: &Layout) -> Result<Vec<f64>> {
    let Some((a, b)) = layout.contiguous_offsets() else {
        candle_core::bail!("masked softmax: contiguous inputs only")
    };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].iter().map(|&x| f64::from(x)).collect(),
        CpuStorage::F64(v) => v[a..b].to_vec(),
        _ => candle_core::bail!("masked softmax on the CPU: f32 or f64, not {:?}", s.dtype()),
    })
}

/// `v` in the dtype of `like`.
fn cpu_like(like: &CpuStorage, v: Vec<f64>) -> CpuStorage {
    match like.dtype() {
        DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
        _ => CpuStorage::F64(v),
    }
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let s = cpu_f64(storage, layout)?;
        let keys = layout.dims().last().copied().unwrap_or(1).max(1);
        let queries = self.queries.max(1) as usize;
        let scale = f64::from(self.scale);
        let mut y = vec![0.0; s.len()];
        for (r, (row, out)) in s.chunks(keys).zip(y.chunks_mut(keys)).enumerate() {
            let seen = if self.causal {
                r % queries + keys - queries + 1
            } else {
                keys
            };
            let max = row[..seen]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(scale * x));
            let z: f64 = row[..seen].iter().map(|&x| (scale * x - max).exp()).sum();
            for (o, &x) in out[..seen].iter_mut().zip(row) {
                *o = (scale * x - max).exp() / z;
            }
        }
        Ok((cpu_like(storage, y), layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::forward((storage, layout), self.scale, self.queries, self.causal)?;
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        Ok(Some(res.apply_op2_no_bwd(&g, &Grad { scale: self.scale })?))
    }
}

/// ∂L/∂s = scale · y · (dy − Σ y·dy) from the probabilities y and dy.
struct Grad {
    scale: f32,
}

impl CustomOp2 for Grad {
    fn name(&self) -> &'static str {
        "masked-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, dy) = (cpu_f64(s1, l1)?, cpu_f64(s2, l2)?);
        let keys = l1.dims().last().copied().unwrap_or(1).max(1);
        let scale = f64::from(self.scale);
        let mut ds = Vec::with_capacity(y.len());
        for (y, dy) in y.chunks(keys).zip(dy.chunks(keys)) {
            let dot: f64 = y.iter().zip(dy).map(|(a, b)| a * b).sum();
            ds.extend(y.iter().zip(dy).map(|(&y, &g)| scale * y * (g - dot)));
        }
        Ok((cpu_like(s1, ds), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::grad((s1, l1), (s2, l2), self.scale)?;
        Ok((out, l1.shape().clone()))
    }
}

/// Whether training's softmax takes the kernels for `scores`: the CUDA kernels
/// turned on, f32/bf16/f16 scores of rank ≥ 2 on a GPU.
#[cfg(feature = "cuda")]
pub(crate) fn serves(scores: &Tensor) -> bool {
    super::cuda_kernels_enabled()
        && scores.device().is_cuda()
        && matches!(scores.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && scores.rank() >= 2
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
}
