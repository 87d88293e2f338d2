//! Pattention: attention from input tokens to learnable key/value *parameter
//! tokens*, the layer that replaces every linear projection in TokenFormer.
//!
//! `Pattention(X; K, V) = Θ(X·Kᵀ)·V`, K ∈ R^{n×d_in}, V ∈ R^{n×d_out}, as in
//! "TokenFormer: Rethinking Transformer Scaling with Tokenized Model Parameters"
//! (Wang et al., ICLR 2025, <https://arxiv.org/abs/2410.23168>) and the official
//! `Pattention` module (Haiyang-W/TokenFormer, `megatron/model/tokenformer.py`).
//! This is the one implementation behind the language model, the image
//! classifier and the merged vision-language model.

use candle_core::{DType, Module, Result, Tensor, TensorId, D};
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

/// How f32/f16/bf16 weights are laid out: the products of prefill (gemm) and of
/// decoding (streaming kernels) prefer different layouts, and by how much
/// depends on the CPU (docs/PERFORMANCE.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Keys transposed [d_in, n] and values [n, d_out]: both products are
    /// plain row-major ones for gemm; decoding takes weighted sums of rows.
    Gemm,
    /// Keys [n, d_in] and values transposed [d_out, n]: every decoding
    /// product is a dot product with whole weight rows (the fastest streaming
    /// kernel); gemm reads the weights through transposed strides.
    Rows,
}

impl Layout {
    /// For weights in `dtype` on this CPU: [`Layout::Rows`] for half
    /// precision, which is kept for decoding (its prefill widens the weights
    /// to f32 anyway) and streams fastest as whole rows everywhere, and for
    /// f32 where the streaming kernels run fastest that way (see
    /// [`kernels::prefers_row_products`]); else [`Layout::Gemm`].
    /// `TOKENFORMER_LAYOUT=gemm|rows` overrides it (so tests can run both).
    pub(crate) fn for_weights(dtype: DType) -> Self {
        match std::env::var("TOKENFORMER_LAYOUT").as_deref() {
            Ok("gemm") => Layout::Gemm,
            Ok("rows") => Layout::Rows,
            _ if matches!(dtype, DType::F16 | DType::BF16) => Layout::Rows,
            _ if kernels::prefers_row_products() => Layout::Rows,
            _ => Layout::Gemm,
        }
    }
}

/// The weights in the layout their products want.
#[derive(Clone, Debug)]
enum Params {
    /// f32 or f16 in [`Layout::Gemm`].
    Dense { key_t: Tensor, value: Tensor },
    /// f32 or f16 in [`Layout::Rows`].
    Rows { key: Tensor, value_t: Tensor },
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
        Self::from_tensors(key, value, activation, scale_tokens)
    }

    /// The layer from its key and value tokens, in this CPU's [`Layout`].
    pub fn from_tensors(
        key: Tensor,
        value: Tensor,
        activation: Activation,
        scale_tokens: Option<usize>,
    ) -> Result<Self> {
        let layout = Layout::for_weights(key.dtype());
        Self::from_tensors_in(key, value, activation, scale_tokens, layout)
    }

    /// [`Self::from_tensors`] in a given layout.
    pub(crate) fn from_tensors_in(
        key: Tensor,
        value: Tensor,
        activation: Activation,
        scale_tokens: Option<usize>,
        layout: Layout,
    ) -> Result<Self> {
        let n = match (key.dims(), value.dims()) {
            (&[n, _], &[m, _]) if n == m => n,
            (k, v) => candle_core::bail!(
                "Pattention: key_param_tokens {k:?} and value_param_tokens {v:?} must be \
                 [n, d_in] and [n, d_out] with the same number of tokens n"
            ),
        };
        // A copy in the new layout; the caller's tensor is freed when dropped
        // (the loader hands each tensor over, so only one is ever doubled).
        let transposed = |t: Tensor| t.t()?.contiguous();
        let params = match layout {
            Layout::Gemm => Params::Dense {
                key_t: transposed(key)?,
                value,
            },
            Layout::Rows => Params::Rows {
                key,
                value_t: transposed(value)?,
            },
        };
        Ok(Self {
            params,
            activation,
            scale_tokens: scale_tokens.unwrap_or(n),
        })
    }

    /// The same layer with 8-bit weights ([`kernels::q8`]). `name` names the
    /// layer in errors (a weight that is not finite cannot be quantised).
    pub fn quantize_q8(&self, name: &str) -> Result<Self> {
        let params = match &self.params {
            Params::Dense { key_t, value } => Params::Q8 {
                key: Q8Matrix::quantize(&key_t.t()?, &format!("{name}.key_param_tokens"))?,
                value_t: Q8Matrix::quantize(&value.t()?, &format!("{name}.value_param_tokens"))?,
            },
            Params::Rows { key, value_t } => Params::Q8 {
                key: Q8Matrix::quantize(key, &format!("{name}.key_param_tokens"))?,
                value_t: Q8Matrix::quantize(value_t, &format!("{name}.value_param_tokens"))?,
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
            Params::Rows { key, .. } => key.clone(),
            Params::Q8 { key, .. } => key.dequantize().expect("a CPU tensor of its own size"),
        }
    }
    /// `value_param_tokens` [n, d_out], as [`Self::key`].
    pub fn value(&self) -> Tensor {
        match &self.params {
            Params::Dense { value, .. } => value.clone(),
            Params::Rows { value_t, .. } => value_t.t().expect("values are rank 2"),
            Params::Q8 { value_t, .. } => value_t
                .dequantize()
                .and_then(|v| v.t())
                .expect("a CPU tensor of its own size"),
        }
    }
    pub fn tokens(&self) -> usize {
        match &self.params {
            Params::Dense { key_t, .. } => key_t.dims()[1],
            Params::Rows { key, .. } => key.dims()[0],
            Params::Q8 { key, .. } => key.dims().0,
        }
    }
    fn d_out(&self) -> Result<usize> {
        match &self.params {
            Params::Dense { value, .. } => value.dim(1),
            Params::Rows { value_t, .. } => value_t.dim(0),
            Params::Q8 { value_t, .. } => Ok(value_t.dims().0),
        }
    }
    /// The layout of f32/f16 weights (None for 8-bit ones, always as [out, in]).
    pub fn layout(&self) -> Option<Layout> {
        match self.params {
            Params::Dense { .. } => Some(Layout::Gemm),
            Params::Rows { .. } => Some(Layout::Rows),
            Params::Q8 { .. } => None,
        }
    }
    /// Whether the weights are kept in 8 bits.
    pub fn is_q8(&self) -> bool {
        matches!(self.params, Params::Q8 { .. })
    }
    /// Bytes the weight matrices hold.
    pub fn weight_bytes(&self) -> usize {
        match &self.params {
            Params::Dense { key_t: a, value: b } | Params::Rows { key: a, value_t: b } => [a, b]
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
    pub(crate) fn scores(&self, x: &Tensor) -> Result<Tensor> {
        let d_in = x.dim(D::Minus1)?;
        let rows = x.elem_count() / d_in.max(1);
        let x = x.reshape((rows, d_in))?;
        match &self.params {
            Params::Dense { key_t, .. } => kernels::matmul_nn(&x, key_t),
            Params::Rows { key, .. } => kernels::matmul_nt(&x, key),
            Params::Q8 { key, .. } => kernels::matmul_nt_q8(&x, key),
        }
    }
}

/// Pattention layers that read the same input, fused: their keys [parts, d_in, n]
/// and values [parts, n, d_out] kept as one tensor each, so that all parts take
/// one product, one Θ and one batched product (a GPU's decoding step: three
/// launches for q, k and v instead of nine). The parts' own weights become views
/// of these tensors (no second copy), and a part replaced since (quantised, say)
/// takes the fused path no more (see [`Self::serves`]).
#[derive(Clone, Debug)]
pub(crate) struct Fused {
    keys_t: Tensor,
    values: Tensor,
    activation: Activation,
    scale_tokens: usize,
    /// The parts' weight tensors the fused ones were made from: which parts it serves.
    ids: Vec<[TensorId; 2]>,
}

impl Fused {
    /// Fuses `parts`, or `None` when they differ in shape, Θ or dtype, or keep
    /// 8-bit weights. Their weights are left in [`Layout::Gemm`] as views.
    pub(crate) fn new(parts: &mut [&mut Pattention]) -> Result<Option<Self>> {
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts.iter().any(|p| p.is_q8()) {
            return Ok(None);
        }
        let (activation, scale_tokens) = (first.activation, first.scale_tokens);
        let kind = |p: &Pattention| {
            (
                p.key().shape().clone(),
                p.value().shape().clone(),
                p.key().dtype(),
            )
        };
        let first_kind = kind(first);
        let same = |p: &Pattention| {
            (p.activation, p.scale_tokens) == (activation, scale_tokens) && kind(p) == first_kind
        };
        if !parts.iter().all(|p| same(p)) {
            return Ok(None);
        }
        let keys: Vec<Tensor> = parts.iter().map(|p| p.key().t()).collect::<Result<_>>()?;
        let values: Vec<Tensor> = parts.iter().map(|p| p.value()).collect();
        let (keys_t, values) = (Tensor::stack(&keys, 0)?, Tensor::stack(&values, 0)?);
        let mut ids = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter_mut().enumerate() {
            let (key_t, value) = (keys_t.get(i)?, values.get(i)?);
            ids.push([key_t.id(), value.id()]);
            p.params = Params::Dense { key_t, value };
        }
        Ok(Some(Self {
            keys_t,
            values,
            activation,
            scale_tokens,
            ids,
        }))
    }

    /// Whether `parts` are still the layers this was made from.
    pub(crate) fn serves(&self, parts: &[&Pattention]) -> bool {
        parts.len() == self.ids.len()
            && parts.iter().zip(&self.ids).all(|(p, ids)| match &p.params {
                Params::Dense { key_t, value } => [key_t.id(), value.id()] == *ids,
                _ => false,
            })
    }

    /// x [..., d_in] → every part's output, [parts, rows, d_out].
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d_in = x.dim(D::Minus1)?;
        let rows = x.elem_count() / d_in.max(1);
        let scores = x.reshape((rows, d_in))?.broadcast_matmul(&self.keys_t)?;
        let w = kernels::theta_owned(scores, self.activation, self.scale_tokens)?;
        w.matmul(&self.values)
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
            Params::Rows { value_t, .. } => kernels::matmul_nt(&w, value_t)?.reshape(out_shape),
            Params::Q8 { value_t, .. } => kernels::matmul_nt_q8(&w, value_t)?.reshape(out_shape),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::max_abs_diff;
    use candle_core::{DType, Device};

    fn spread(shape: (usize, usize), salt: f32) -> Tensor {
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|i| ((i as f32 * 0.754_877_7 + salt).fract() - 0.5) * 2.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Both layouts (and f16 weights in each) compute the layer's definition,
    /// Θ(X·Kᵀ)·V in plain tensor ops, for decoding-sized and prefill-sized inputs.
    #[test]
    fn both_layouts_compute_the_definition() {
        let (n, d_in, d_out) = (96, 40, 24);
        let (key, value) = (spread((n, d_in), 0.1), spread((n, d_out), 0.3));
        for rows in [1, 5, 33] {
            let x = spread((rows, d_in), 0.7);
            let scores = x.matmul(&key.t().unwrap()).unwrap();
            let want = theta(&scores, Activation::L2NormGelu, n)
                .unwrap()
                .matmul(&value)
                .unwrap();
            for layout in [Layout::Gemm, Layout::Rows] {
                for dtype in [DType::F32, DType::F16] {
                    let (k, v) = (key.to_dtype(dtype).unwrap(), value.to_dtype(dtype).unwrap());
                    let p = Pattention::from_tensors_in(k, v, Activation::L2NormGelu, None, layout)
                        .unwrap();
                    assert_eq!(p.layout(), Some(layout));
                    assert_eq!(
                        (p.tokens(), p.key().dims(), p.value().dims()),
                        (n, &[n, d_in][..], &[n, d_out][..])
                    );
                    let got = p.forward(&x).unwrap();
                    let tol = if dtype == DType::F16 { 2e-2 } else { 1e-5 };
                    let d = max_abs_diff(&got, &want);
                    assert!(d < tol, "{layout:?} {dtype:?} rows={rows}: {d}");
                }
            }
        }
    }

    /// Half-precision weights are kept as rows on every CPU; f32 ones as
    /// this CPU's streaming kernels prefer.
    #[test]
    fn half_precision_weights_are_kept_as_rows() {
        if std::env::var_os("TOKENFORMER_LAYOUT").is_some() {
            eprintln!("skipped: TOKENFORMER_LAYOUT forces the layout");
            return;
        }
        let f32_layout = if kernels::prefers_row_products() {
            Layout::Rows
        } else {
            Layout::Gemm
        };
        for (dtype, want) in [
            (DType::F32, f32_layout),
            (DType::F16, Layout::Rows),
            (DType::BF16, Layout::Rows),
        ] {
            let (k, v) = (spread((6, 4), 0.1), spread((6, 3), 0.2));
            let (k, v) = (k.to_dtype(dtype).unwrap(), v.to_dtype(dtype).unwrap());
            let p = Pattention::from_tensors(k, v, Activation::L2NormGelu, None).unwrap();
            assert_eq!(p.layout(), Some(want), "{dtype:?}");
        }
    }

    /// Mismatched or non-matrix tokens are an error naming both tensors and
    /// their shapes (they used to be accepted and fail later in a forward).
    #[test]
    fn from_tensors_rejects_bad_shapes() {
        let ok = |k: (usize, usize), v: (usize, usize)| {
            Pattention::from_tensors(spread(k, 0.1), spread(v, 0.2), Activation::L2NormGelu, None)
        };
        assert_eq!(ok((6, 4), (6, 3)).unwrap().tokens(), 6);
        let e = ok((6, 4), (5, 3)).unwrap_err().to_string();
        assert!(
            e.contains("key_param_tokens [6, 4]") && e.contains("value_param_tokens [5, 3]"),
            "{e}"
        );
        let rank1 = Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap();
        for layout in [Layout::Gemm, Layout::Rows] {
            let e = Pattention::from_tensors_in(
                rank1.clone(),
                spread((6, 3), 0.2),
                Activation::L2NormGelu,
                None,
                layout,
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("key_param_tokens [6]"), "{e}");
        }
    }
}
