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
use crate::kernels::{self, Q8Matrix};

/// One Pattention layer: `key_param_tokens` [n, d_in], `value_param_tokens` [n, d_out].
#[derive(Clone, Debug)]
pub struct Pattention {
    params: Params,
    activation: Activation,
    scale_tokens: usize,
}

/// The weights in the layout their products want.
#[derive(Clone, Debug)]
enum Params {
    /// f32 or f16. The keys are stored transposed, [d_in, n]: X·Kᵀ is then a
    /// plain row-major product, which gemm runs faster than the transposed
    /// one (docs/PERFORMANCE.md); values as they are, [n, d_out].
    Dense { key_t: Tensor, value: Tensor },
    /// 8 bits, both as [out, in] so the quantisation blocks run along the
    /// input dimension: keys [n, d_in], values transposed [d_out, n].
    Q8 { key: Q8Matrix, value_t: Q8Matrix },
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
            params: Params::Dense { key_t, value },
            activation,
            scale_tokens: scale_tokens.unwrap_or(n),
        }
    }

    /// The same layer with 8-bit weights (f32 compute). `name` names the
    /// layer in errors (a weight that is not finite cannot be quantised).
    pub fn quantize_q8(&self, name: &str) -> Result<Self> {
        let params = match &self.params {
            Params::Dense { key_t, value } => Params::Q8 {
                key: Q8Matrix::quantize(&key_t.t()?, &format!("{name}.key_param_tokens"))?,
                value_t: Q8Matrix::quantize(&value.t()?, &format!("{name}.value_param_tokens"))?,
            },
            q8 @ Params::Q8 { .. } => q8.clone(),
        };
        Ok(Self {
            params,
            activation: self.activation,
            scale_tokens: self.scale_tokens,
        })
    }

    /// `key_param_tokens` [n, d_in] in the stored precision (f32 for 8-bit
    /// weights, dequantised).
    pub fn key(&self) -> Tensor {
        match &self.params {
            Params::Dense { key_t, .. } => key_t.t().expect("keys are rank 2"),
            Params::Q8 { key, .. } => key.dequantize().expect("a CPU tensor of its own size"),
        }
    }
    /// `value_param_tokens` [n, d_out], as [`Self::key`].
    pub fn value(&self) -> Tensor {
        match &self.params {
            Params::Dense { value, .. } => value.clone(),
            Params::Q8 { value_t, .. } => value_t
                .dequantize()
                .and_then(|v| v.t())
                .expect("a CPU tensor of its own size"),
        }
    }
    pub fn tokens(&self) -> usize {
        match &self.params {
            Params::Dense { key_t, .. } => key_t.dims()[1],
            Params::Q8 { key, .. } => key.dims().0,
        }
    }
    fn d_out(&self) -> Result<usize> {
        match &self.params {
            Params::Dense { value, .. } => value.dim(1),
            Params::Q8 { value_t, .. } => Ok(value_t.dims().0),
        }
    }
    /// Whether the weights are kept in 8 bits.
    pub fn is_q8(&self) -> bool {
        matches!(self.params, Params::Q8 { .. })
    }
    /// Bytes the weight matrices hold.
    pub fn weight_bytes(&self) -> usize {
        match &self.params {
            Params::Dense { key_t, value } => [key_t, value]
                .iter()
                .map(|t| t.elem_count() * t.dtype().size_in_bytes())
                .sum(),
            Params::Q8 { key, value_t } => key.bytes() + value_t.bytes(),
        }
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
        let x = x.reshape((rows, d_in))?;
        match &self.params {
            Params::Dense { key_t, .. } => kernels::matmul_nn(&x, key_t),
            Params::Q8 { key, .. } => kernels::matmul_nt_q8(&x, key),
        }
    }
}

impl Module for Pattention {
    /// x [..., d_in] → [..., d_out].
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut out_shape = x.dims().to_vec();
        *out_shape.last_mut().expect("rank >= 1") = self.d_out()?;
        let w = kernels::theta_owned(self.scores(x)?, self.activation, self.scale_tokens)?;
        match &self.params {
            Params::Dense { value, .. } => kernels::matmul_nn(&w, value)?.reshape(out_shape),
            Params::Q8 { value_t, .. } => kernels::matmul_nt_q8(&w, value_t)?.reshape(out_shape),
        }
    }
}
