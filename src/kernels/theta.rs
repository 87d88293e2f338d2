//! Θ, the normalised non-linearity Pattention applies to its token-parameter
//! scores: the definition on tensors (any device or dtype) and the fused
//! in-place row kernel the CPU runs for f32.

use candle_core::{CpuStorage, DType, Layout, Result, Tensor, D};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::math::gelu_erf_f32_with;
use super::rows::{dispatch, softmax_row_generic, sum_sq};

/// Θ, the normalised non-linearity applied to the token-parameter scores
/// (config key `pattention_activation`, official `norm_activation_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// s / ‖s‖₂ · √n, then exact (erf) GELU. Every released model uses this.
    #[default]
    L2NormGelu,
    /// GELU first, then the same L2 normalisation · √n.
    GeluL2Norm,
    /// exp, then L1 normalisation · n (= n · softmax).
    Softmax,
}

impl std::str::FromStr for Activation {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "l2_norm_gelu" => Ok(Self::L2NormGelu),
            "gelu_l2_norm" => Ok(Self::GeluL2Norm),
            "softmax" => Ok(Self::Softmax),
            other => Err(format!(
                "unknown Pattention activation `{other}` (expected l2_norm_gelu, gelu_l2_norm or softmax)"
            )),
        }
    }
}

impl Activation {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::L2NormGelu => "l2_norm_gelu",
            Self::GeluL2Norm => "gelu_l2_norm",
            Self::Softmax => "softmax",
        }
    }
}

/// The smallest norm we divide by. The official code divides by a zero norm
/// and returns NaN for an all-zero score row; we return the row's limit (zeros
/// after L2 normalisation) instead.
const MIN_NORM: f64 = 1e-30;

/// Applies Θ along the last (parameter-token) axis. `scale_tokens` is the n of
/// √n (or of n for softmax): by default the layer's token count, but held
/// fixed by the growth converter so that appended zero-key tokens keep the
/// function unchanged.
///
/// Half-precision scores are normalised in f32 and the result rounded back:
/// a 768-term sum of squares in bf16 was measured 10× less accurate.
pub fn theta(scores: &Tensor, activation: Activation, scale_tokens: usize) -> Result<Tensor> {
    let wide = super::widened(scores)?;
    theta_exact(&wide, activation, scale_tokens)?.to_dtype(scores.dtype())
}

fn theta_exact(scores: &Tensor, activation: Activation, scale_tokens: usize) -> Result<Tensor> {
    let n = scale_tokens as f64;
    match activation {
        Activation::L2NormGelu => l2_normalise(scores, n.sqrt())?.gelu_erf(),
        Activation::GeluL2Norm => l2_normalise(&scores.gelu_erf()?, n.sqrt()),
        Activation::Softmax => {
            // exp(s)/Σexp(s)·n; subtracting the row max first changes nothing
            // mathematically but avoids the official code's overflow to inf/inf.
            let max = scores.max_keepdim(D::Minus1)?;
            let e = scores.broadcast_sub(&max)?.exp()?;
            let sum = e.sum_keepdim(D::Minus1)?;
            e.broadcast_div(&sum)? * n
        }
    }
}

fn l2_normalise(s: &Tensor, factor: f64) -> Result<Tensor> {
    let norm = s
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(MIN_NORM, f64::INFINITY)?;
    s.broadcast_div(&(norm / factor)?)
}

/// Θ of one score row, in place (GELU's erf in fused multiply-adds where `FMA`).
#[inline(always)]
fn theta_row_generic<const FMA: bool>(row: &mut [f32], activation: Activation, n: f32) {
    const MIN_NORM: f32 = 1e-30;
    match activation {
        Activation::L2NormGelu => {
            let f = n.sqrt() / sum_sq(row).sqrt().max(MIN_NORM);
            row.iter_mut()
                .for_each(|v| *v = gelu_erf_f32_with::<FMA>(*v * f));
        }
        Activation::GeluL2Norm => {
            row.iter_mut()
                .for_each(|v| *v = gelu_erf_f32_with::<FMA>(*v));
            let f = n.sqrt() / sum_sq(row).sqrt().max(MIN_NORM);
            row.iter_mut().for_each(|v| *v *= f);
        }
        Activation::Softmax => {
            softmax_row_generic(row, row.len());
            row.iter_mut().for_each(|v| *v *= n);
        }
    }
}

dispatch! {
    fn theta_row / theta_row_on(row: &mut [f32], activation: Activation, n: f32) = theta_row_generic::<fma>;
}

struct ThetaOp {
    activation: Activation,
    scale_tokens: usize,
}

impl ThetaOp {
    fn apply(&self, rows: &mut [f32], n: usize) {
        let scale = self.scale_tokens as f32;
        rows.par_chunks_mut(n)
            .for_each(|r| theta_row(r, self.activation, scale));
    }
}

impl candle_core::InplaceOp1 for ThetaOp {
    fn name(&self) -> &'static str {
        "pattention-theta-in-place"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let n = layout.dims().last().copied().unwrap_or(1).max(1);
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("theta kernel: contiguous scores only")
        };
        match storage {
            CpuStorage::F32(d) => self.apply(&mut d[a..b], n),
            CpuStorage::BF16(d) => self.apply_half(&mut d[a..b], n),
            CpuStorage::F16(d) => self.apply_half(&mut d[a..b], n),
            _ => candle_core::bail!("theta kernel: f32, bf16 or f16 only"),
        }
        Ok(())
    }
}

impl ThetaOp {
    /// Half-precision rows (a model computing in bf16 or f16): each widened
    /// into an f32 row, Θ'd there by the f32 kernel and rounded back, so the
    /// sums are f32 as in the plain ops.
    fn apply_half<E: Send>(&self, rows: &mut [E], n: usize)
    where
        [E]: ::half::slice::HalfFloatSliceExt,
    {
        let scale = self.scale_tokens as f32;
        super::half::widened_rows(rows, n, |row| theta_row(row, self.activation, scale));
    }
}

fn fused_ok(scores: &Tensor) -> bool {
    super::fused_on(scores)
        && matches!(scores.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && scores.is_contiguous()
}

/// Θ over the last axis of scores nobody else holds (a fresh matmul
/// output): the fused kernel works in the scores' own buffer for contiguous
/// f32 CPU tensors, saving a scores-sized allocation.
pub fn theta_owned(scores: Tensor, activation: Activation, scale_tokens: usize) -> Result<Tensor> {
    if fused_ok(&scores) {
        scores.inplace_op1(&ThetaOp {
            activation,
            scale_tokens,
        })?;
        return Ok(scores);
    }
    #[cfg(feature = "cuda")]
    if super::theta_cuda::serves(&scores) {
        return super::theta_cuda::theta(&scores, activation, scale_tokens);
    }
    theta(&scores, activation, scale_tokens)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, half_ulp, max_abs_diff, spread};
    use super::*;
    use candle_core::Device;

    /// Half-precision scores (a model computing in bf16 or f16 on the CPU)
    /// take the f32 kernel row by row: the plain ops' values (both sum in
    /// f32) to within one rounding of the half type.
    #[test]
    fn half_scores_give_the_plain_ops_values() {
        let s = (spread((37, 53)) * 3.0).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let h = s.to_dtype(dtype).unwrap();
            for act in [
                Activation::L2NormGelu,
                Activation::GeluL2Norm,
                Activation::Softmax,
            ] {
                let got = theta_owned(h.copy().unwrap(), act, 40).unwrap();
                assert_eq!(got.dtype(), dtype);
                let want = theta(&h, act, 40).unwrap();
                let ulp = half_ulp(dtype);
                let what = format!("{dtype:?} {act:?}");
                assert_close(&got, &want, |b| ulp * b.abs().max(1e-3), &what);
                // Not the scores themselves: Θ was applied.
                assert!(max_abs_diff(&got, &h) > 0.1);
            }
        }
    }

    #[test]
    fn fused_theta_equals_tensor_ops() {
        let s = (spread((37, 53)) * 3.0).unwrap();
        for act in [
            Activation::L2NormGelu,
            Activation::GeluL2Norm,
            Activation::Softmax,
        ] {
            let a = theta_owned(s.copy().unwrap(), act, 40).unwrap();
            let b = theta(&s, act, 40).unwrap();
            let d = max_abs_diff(&a, &b);
            assert!(d < 1e-5, "{act:?}: {d}");
        }
        // The paths with FMA give each other's bits, and the portable path's
        // values up to the fused roundings.
        let rows: Vec<f32> = s.flatten_all().unwrap().to_vec1().unwrap();
        let portable = super::super::Path::new(super::super::Isa::Portable).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for act in [
            Activation::L2NormGelu,
            Activation::GeluL2Norm,
            Activation::Softmax,
        ] {
            for r in rows.chunks(53) {
                let mut first_fused: Option<Vec<f32>> = None;
                let mut plain = r.to_vec();
                theta_row_on(portable, &mut plain, act, 40.0);
                for path in super::super::Path::all() {
                    let mut got = r.to_vec();
                    theta_row_on(path, &mut got, act, 40.0);
                    for (g, p) in got.iter().zip(&plain) {
                        assert!((g - p).abs() <= 4e-7 * p.abs().max(1.0), "{act:?} {path:?}");
                    }
                    if path.isa() != super::super::Isa::Portable {
                        let want = first_fused.get_or_insert_with(|| got.clone());
                        assert_eq!(bits(&got), bits(want), "{act:?} {:?}", path.isa());
                    }
                }
            }
        }
        // An all-zero row gives zeros, not NaN.
        let z = theta_owned(
            Tensor::zeros((2, 8), DType::F32, &Device::Cpu).unwrap(),
            Activation::L2NormGelu,
            8,
        )
        .unwrap();
        assert_eq!(
            z.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0.0; 16]
        );
    }
}
