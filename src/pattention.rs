//! Pattention: attention from input tokens to learnable key/value *parameter
//! tokens*, the layer that replaces every linear projection in TokenFormer.
//!
//! `Pattention(X; K, V) = Θ(X·Kᵀ)·V`, K ∈ R^{n×d_in}, V ∈ R^{n×d_out}, as in
//! "TokenFormer: Rethinking Transformer Scaling with Tokenized Model Parameters"
//! (Wang et al., ICLR 2025, <https://arxiv.org/abs/2410.23168>) and the official
//! `Pattention` module (Haiyang-W/TokenFormer, `megatron/model/tokenformer.py`).
//! This is the one implementation behind the language model, the image
//! classifier and the merged vision-language model.

use candle_core::{Module, Result, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

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
pub fn theta(scores: &Tensor, activation: Activation, scale_tokens: usize) -> Result<Tensor> {
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

/// One Pattention layer: `key_param_tokens` [n, d_in], `value_param_tokens` [n, d_out].
#[derive(Clone, Debug)]
pub struct Pattention {
    /// The keys stored transposed, [d_in, n]: X·Kᵀ is then a plain
    /// row-major product, which gemm runs about 13 % faster than the
    /// transposed one (measured at 2048×768×768 and ×3072).
    key_t: Tensor,
    value: Tensor,
    activation: Activation,
    scale_tokens: usize,
}

impl Pattention {
    /// Loads `key_param_tokens` and `value_param_tokens` under `vb`.
    /// `scale_tokens` defaults to `tokens` (the official behaviour).
    pub fn new(
        d_in: usize,
        d_out: usize,
        tokens: usize,
        scale_tokens: Option<usize>,
        activation: Activation,
        vb: VarBuilder,
    ) -> Result<Self> {
        let key = vb.get((tokens, d_in), "key_param_tokens")?;
        let value = vb.get((tokens, d_out), "value_param_tokens")?;
        Ok(Self::from_tensors(key, value, activation, scale_tokens))
    }

    pub fn from_tensors(
        key: Tensor,
        value: Tensor,
        activation: Activation,
        scale_tokens: Option<usize>,
    ) -> Self {
        let n = key.dim(0).unwrap_or(0);
        // A copy in the new layout; the caller's `key` is freed when dropped
        // (the loader hands each tensor over, so only one is ever doubled).
        let key_t = key.t().and_then(|k| k.contiguous()).unwrap_or(key);
        Self {
            key_t,
            value,
            activation,
            scale_tokens: scale_tokens.unwrap_or(n),
        }
    }

    /// `key_param_tokens` [n, d_in] (a transposed view of the stored keys).
    pub fn key(&self) -> Tensor {
        self.key_t.t().expect("keys are rank 2")
    }
    pub fn value(&self) -> &Tensor {
        &self.value
    }
    pub fn tokens(&self) -> usize {
        self.key_t.dims()[1]
    }
    pub fn scale_tokens(&self) -> usize {
        self.scale_tokens
    }
    pub fn activation(&self) -> Activation {
        self.activation
    }

    /// The raw token-parameter scores X·Kᵀ, flattened to [rows, n].
    pub fn scores(&self, x: &Tensor) -> Result<Tensor> {
        let d_in = x.dim(D::Minus1)?;
        let rows = x.elem_count() / d_in.max(1);
        crate::kernels::matmul_nn(&x.reshape((rows, d_in))?, &self.key_t)
    }
}

impl Module for Pattention {
    /// x [..., d_in] → [..., d_out].
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut out_shape = x.dims().to_vec();
        *out_shape.last_mut().expect("rank >= 1") = self.value.dim(1)?;
        let w = crate::kernels::theta_owned(self.scores(x)?, self.activation, self.scale_tokens)?;
        crate::kernels::matmul_nn(&w, &self.value)?.reshape(out_shape)
    }
}
