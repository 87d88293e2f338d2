//! LayerNorm of rows on the CPU with f32 sums, the mean first and then the
//! variance about it (two passes over a row in cache, as PyTorch's CPU kernel
//! does; candle's f32 LayerNorm takes E[x²] − mean² in one pass, which on a
//! constant row of, say, 3.3 comes out below −eps and gives NaN). bf16 and f16
//! rows are widened into an f32 buffer and rounded back once: one parallel pass
//! instead of candle's conversions to f32 and back around its own kernel (each
//! a single-threaded pass over the activations).

use ::half::slice::HalfFloatSliceExt;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

struct RowNorm {
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    eps: f64,
}

impl RowNorm {
    fn rows<E: Send + Copy>(&self, x: &[E], n: usize) -> Vec<E>
    where
        [E]: HalfFloatSliceExt,
    {
        let mut out = x.to_vec();
        super::half::widened_rows(&mut out, n, |row| self.normalise(row));
        out
    }

    fn rows_f32(&self, x: &[f32], n: usize) -> Vec<f32> {
        use rayon::prelude::*;
        let n = n.max(1);
        let mut out = vec![0f32; x.len()];
        // A row at a time, copied and normalised while it is in cache.
        out.par_chunks_mut(n)
            .zip(x.par_chunks(n))
            .for_each(|(row, src)| {
                row.copy_from_slice(src);
                self.normalise(row)
            });
        out
    }

    /// One f32 row normalised in place: the training LayerNorm's row (the mean,
    /// then the variance about it, each summed over 32 lanes added in f64), then
    /// the weight and bias.
    fn normalise(&self, row: &mut [f32]) {
        crate::train::layer_norm_row_f32(row, self.eps);
        match &self.bias {
            Some(b) => {
                for ((v, w), b) in row.iter_mut().zip(&self.weight).zip(b) {
                    *v = *v * w + b;
                }
            }
            None => {
                for (v, w) in row.iter_mut().zip(&self.weight) {
                    *v *= w;
                }
            }
        }
    }
}

impl candle_core::CustomOp1 for RowNorm {
    fn name(&self) -> &'static str {
        "layer-norm-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = self.weight.len();
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("layer-norm-rows: contiguous input only")
        };
        if l.dims().last() != Some(&n) {
            candle_core::bail!("layer-norm-rows: rows of {:?}, weights of {n}", l.dims())
        }
        let out = match s {
            CpuStorage::BF16(d) => CpuStorage::BF16(self.rows(&d[a..b], n)),
            CpuStorage::F16(d) => CpuStorage::F16(self.rows(&d[a..b], n)),
            CpuStorage::F32(d) => CpuStorage::F32(self.rows_f32(&d[a..b], n)),
            _ => candle_core::bail!("layer-norm-rows: f32, bf16 or f16 only"),
        };
        Ok((out, l.shape().clone()))
    }
}

/// LayerNorm over the last axis of f32, bf16 or f16 `x` on the CPU with f32
/// `weight` and `bias`, or None where the fused kernels do not take it
/// (other devices, dtypes, layouts, or the kernels turned off).
pub(crate) fn layer_norm_rows(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Option<Tensor>> {
    let float = matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16);
    if !(super::fused_on(x) && float && x.is_contiguous()) || x.rank() == 0 {
        return Ok(None);
    }
    let op = RowNorm {
        weight: weight.to_dtype(DType::F32)?.to_vec1()?,
        bias: bias
            .map(|b| b.to_dtype(DType::F32)?.to_vec1())
            .transpose()?,
        eps,
    };
    x.apply_op1_no_bwd(&op).map(Some)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, half_ulp, spread};
    use super::*;
    use candle_core::Module;

    /// f32 rows: candle's f32 LayerNorm to rounding on ordinary rows, and on
    /// constant rows (variance 0) about the bias, where E[x²] − mean² in f32 comes
    /// out below −eps and candle's gives NaN for some values (3.3 among them).
    #[test]
    fn f32_rows_normalise_as_the_layer_norm_and_constant_rows_to_the_bias() {
        let n = 768;
        let w = (spread(n) + 1.0).unwrap();
        let b = (spread(n) * 0.1).unwrap();
        let x = ((spread((5, n)) * 2.0).unwrap() + 0.3).unwrap();
        let got = layer_norm_rows(&x, &w, Some(&b), 1e-5)
            .unwrap()
            .expect("the fused path");
        let ln = candle_nn::LayerNorm::new(w.clone(), b.clone(), 1e-5);
        let want = ln.forward(&x).unwrap();
        assert_close(&got, &want, |v| 1e-5 * v.abs().max(1.0), "ordinary rows");
        for c in [3.3f32, 0.7, 10.1, -5.9] {
            let x = Tensor::full(c, (2, n), &candle_core::Device::Cpu).unwrap();
            let got = layer_norm_rows(&x, &w, Some(&b), 1e-5).unwrap().unwrap();
            let want = b.unsqueeze(0).unwrap().broadcast_as((2, n)).unwrap();
            // Finite, and the bias to within the f32 mean's rounding times 1/√eps.
            assert_close(&got, &want, |_| 1e-2, &format!("constant rows of {c}"));
        }
    }

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
                let got = layer_norm_rows(&h, &w, bias, 1e-5)
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
