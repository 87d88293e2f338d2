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

pub use crate::kernels::theta::{theta, Activation};

/// One Pattention layer: `key_param_tokens` [n, d_in], `value_param_tokens` [n, d_out].
#[derive(Clone, Debug)]
pub struct Pattention {
    /// The keys stored transposed, [d_in, n]: X·Kᵀ is then a plain
    /// row-major product, which gemm runs faster than the transposed one
    /// (docs/PERFORMANCE.md).
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
