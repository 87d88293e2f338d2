//! LayerNorm of bf16 or f16 rows on the CPU (a model computing in half
//! precision): each row widened into an f32 buffer, normalised there with f32
//! sums, as candle's f32 LayerNorm would, and rounded back once; one parallel
//! pass instead of candle's conversions to f32 and back around its own kernel
//! (each a single-threaded pass over the activations).

use ::half::slice::HalfFloatSliceExt;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

struct HalfNorm {
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    eps: f32,
}

impl HalfNorm {
    fn rows<E: Send + Copy>(&self, x: &[E], n: usize) -> Vec<E>
    where
        [E]: HalfFloatSliceExt,
    {
        let mut out = x.to_vec();
        super::half::widened_rows(&mut out, n, |row| self.normalise(row));
        out
    }

    /// One f32 row normalised in place.
    fn normalise(&self, row: &mut [f32]) {
        let n = row.len() as f32;
        let mean = row.iter().sum::<f32>() / n;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
        let inv = 1.0 / (var + self.eps).sqrt();
        match &self.bias {
            Some(b) => {
                for ((v, w), b) in row.iter_mut().zip(&self.weight).zip(b) {
                    *v = (*v - mean) * inv * w + b;
                }
            }
            None => {
                for (v, w) in row.iter_mut().zip(&self.weight) {
                    *v = (*v - mean) * inv * w;
                }
            }
        }
    }
}

impl candle_core::CustomOp1 for HalfNorm {
    fn name(&self) -> &'static str {
        "layer-norm-half"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = self.weight.len();
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("layer-norm-half: contiguous input only")
        };
        if l.dims().last() != Some(&n) {
            candle_core::bail!("layer-norm-half: rows of {:?}, weights of {n}", l.dims())
        }
        let out = match s {
            CpuStorage::BF16(d) => CpuStorage::BF16(self.rows(&d[a..b], n)),
            CpuStorage::F16(d) => CpuStorage::F16(self.rows(&d[a..b], n)),
            _ => candle_core::bail!("layer-norm-half: bf16 or f16 only"),
        };
        Ok((out, l.shape().clone()))
    }
}

/// LayerNorm over the last axis of bf16/f16 `x` on the CPU with f32
/// `weight` and `bias`, or None where the fused kernels do not take it
/// (other devices, dtypes, layouts, or the kernels turned off).
pub(crate) fn layer_norm_half(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Option<Tensor>> {
    if !(super::fused_on(x) && matches!(x.dtype(), DType::BF16 | DType::F16) && x.is_contiguous())
        || x.rank() == 0
    {
        return Ok(None);
    }
    let op = HalfNorm {
        weight: weight.to_dtype(DType::F32)?.to_vec1()?,
        bias: bias
            .map(|b| b.to_dtype(DType::F32)?.to_vec1())
            .transpose()?,
        eps: eps as f32,
    };
    x.apply_op1_no_bwd(&op).map(Some)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, half_ulp, spread};
    use super::*;
    use candle_core::Module;

    /// candle's f32 LayerNorm on the widened rows, rounded once: equal to
    /// within one rounding of the half type, with and without a bias.
    #[test]
    fn half_rows_normalise_as_the_f32_layer_norm() {
        let x = ((spread((7, 40)) * 2.0).unwrap() + 0.3).unwrap();
        let w = (spread(40) + 1.0).unwrap();
        let b = (spread(40) * 0.1).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let h = x.to_dtype(dtype).unwrap();
            for bias in [Some(&b), None] {
                let got = layer_norm_half(&h, &w, bias, 1e-5)
                    .unwrap()
                    .expect("the fused path");
                assert_eq!(got.dtype(), dtype);
                let zeros = Tensor::zeros(40, DType::F32, h.device()).unwrap();
                let ln = candle_nn::LayerNorm::new(w.clone(), bias.cloned().unwrap_or(zeros), 1e-5);
                let want = ln.forward(&h.to_dtype(DType::F32).unwrap()).unwrap();
                let ulp = half_ulp(dtype);
                assert_close(
                    &got,
                    &want,
                    |b| ulp * b.abs().max(1e-2),
                    &format!("{dtype:?}"),
                );
            }
        }
    }
}
