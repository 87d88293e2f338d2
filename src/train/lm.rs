//! The TokenFormer language model as plain, differentiable tensor ops over trainable
//! [`Var`]s, with the semantics of [`crate::models::tokenformer::TokenFormerLm`]: pre-norm
//! blocks (sequential or parallel residual) with a non-parametric LayerNorm, Pattention q/k/v/proj and feed-forward,
//! causal attention with GPT-NeoX partial rotary embeddings, a final LayerNorm and tied
//! (or untied) output logits.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor, Var, D};

use super::parts::{weights_methods, Weights};
use crate::checkpoint::Tensors;
use crate::models::tokenformer::{Config, Rotary};
use crate::pattention::theta;

/// A language model whose every tensor is a [`Var`] (trainable or not: the optimiser
/// decides which it updates), in f32 or f64; its forward computes in that dtype, or in
/// bf16 over casts of the variables ([`TrainableLm::with_compute_dtype`]: mixed
/// precision, the variables and the optimiser staying f32).
pub struct TrainableLm {
    cfg: Config,
    weights: Weights,
    rotary: Rotary,
    /// The same tables as the GPU's training block takes them (with sin negated for
    /// its backward, once), `None` without rotary.
    block_rotary: Option<super::device_block::Rotary>,
}

/// The mean cross-entropy of the logits h·outᵀ at `targets`, a slice of h's rows at a
/// time where the logits would have more than `most` elements (each slice's mean
/// weighted by its share of the rows).
fn head_loss_in_slices(h: &Tensor, out: &Tensor, targets: &[u32], most: usize) -> Result<Tensor> {
    let n = h.dim(0)?;
    let rows = (most / out.dim(0)?).max(1);
    let mut total: Option<Tensor> = None;
    for start in (0..n).step_by(rows) {
        let m = rows.min(n - start);
        let logits = h.narrow(0, start, m)?.matmul(&out.t()?)?;
        let part = super::loss::cross_entropy(&logits, &targets[start..start + m])?;
        let part = if m == n {
            part
        } else {
            (part * (m as f64 / n as f64))?
        };
        total = Some(match total {
            Some(t) => (t + part)?,
            None => part,
        });
    }
    total.ok_or_else(|| candle_core::Error::Msg("no rows to take the loss over".into()))
}

impl TrainableLm {
    /// Wraps canonical-name tensors (converted to `dtype`) as variables. Every tensor the
    /// config needs must be present with its shape, and none may be left over.
    pub fn new(
        cfg: &Config,
        tensors: &Tensors,
        dtype: DType,
        device: &Device,
    ) -> crate::error::Result<Self> {
        cfg.validate()
            .map_err(|e| crate::error::Error::input(format!("invalid config: {e}")))?;
        let weights = Weights::new(expected_shapes(cfg), tensors, dtype, device)?;
        let rotary = Rotary::new(
            cfg.rotary_dims(),
            cfg.rotary_base,
            cfg.max_position_embeddings,
            device,
        )?;
        let block_rotary = match rotary.tables() {
            (0, ..) => None,
            (dims, cos, sin) => Some(super::device_block::Rotary::new(dims, cos, sin)?),
        };
        Ok(Self {
            cfg: cfg.clone(),
            weights,
            rotary,
            block_rotary,
        })
    }

    weights_methods!();

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The current values, by canonical name (for saving).
    pub fn tensors(&self) -> Tensors {
        super::trainer::Trainable::tensors(self)
    }

    fn p(&self, name: &str) -> Result<Tensor> {
        param(&self.weights.cast(), name)
    }

    /// Logits [b, t, vocab] of ids [b, t].
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        self.logits(ids)?.reshape((b, t, self.cfg.vocab_size))
    }

    /// Logits [b·t, vocab] of ids [b, t], the rows as the loss takes them: a reshape of
    /// the logits would cost the backward a zeroed logits-sized gradient and an addition.
    fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits_and_hidden(ids, None)
    }

    /// Logits [b·t, vocab] of ids [b, t] and each layer's output (the residual stream
    /// after block i) [b, t, d]: what distillation matches against a teacher's.
    pub fn forward_hidden(&self, ids: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let mut hidden = Vec::with_capacity(self.cfg.num_layers);
        let logits = self.logits_and_hidden(ids, Some(&mut hidden))?;
        Ok((logits, hidden))
    }

    /// [`Self::logits`], pushing each layer's output onto `hidden` when given.
    fn logits_and_hidden(&self, ids: &Tensor, hidden: Option<&mut Vec<Tensor>>) -> Result<Tensor> {
        let (h, out) = self.final_state(ids, hidden)?;
        h.matmul(&out.t()?)
    }

    /// The output layer's input [b·t, d] (after the final norm) and its weights
    /// [vocab, d], pushing each layer's output onto `hidden` when given.
    fn final_state(
        &self,
        ids: &Tensor,
        mut hidden: Option<&mut Vec<Tensor>>,
    ) -> Result<(Tensor, Tensor)> {
        let (b, t) = ids.dims2()?;
        if b == 0 || t == 0 {
            candle_core::bail!("no tokens to run: ids of shape [{b}, {t}]")
        }
        let cfg = &self.cfg;
        if t > cfg.max_position_embeddings {
            candle_core::bail!(
                "sequence of {t} tokens exceeds the model's maximum of {} positions",
                cfg.max_position_embeddings
            )
        }
        let d = cfg.hidden_size;
        let emb = self.p("word_embeddings.weight")?;
        let mut x = emb
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, d))?;
        let (cos, sin) = self.rotary_tables(t)?;
        let spec = super::fused::BlockSpec {
            heads: cfg.num_heads,
            tokens: [0; 3],
            scale_tokens: [self.scale(0), self.scale(3), self.scale(4)],
            causal: true,
            parallel_residual: cfg.parallel_residual,
            eps: cfg.norm_eps,
        };
        let rotary = if super::fused::serves(&x) {
            let table = |x: &Tensor| -> Result<Vec<f64>> {
                x.to_dtype(DType::F64)?.flatten_all()?.to_vec1()
            };
            Some(super::fused::RotaryTables {
                dims: self.rotary.tables().0,
                cos: table(&cos)?,
                sin: table(&sin)?,
            })
        } else {
            None
        };
        // Broadcast over the heads of q and k [b, t, heads, hd].
        let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
        let block_rotary = BlockRotary {
            cpu: rotary.as_ref(),
            device: self.block_rotary.as_ref(),
        };
        let params = self.weights.cast();
        for i in 0..cfg.num_layers {
            let prefix = format!("layers.{i}");
            let act = cfg.pattention_activation;
            if let Some(y) = fused_block(&params, &prefix, &x, act, &spec, block_rotary)? {
                x = y;
                if let Some(hidden) = hidden.as_deref_mut() {
                    hidden.push(x.clone());
                }
                continue;
            }
            let h = layer_norm(&x, cfg.norm_eps)?;
            let attn = self.attention(i, &h, &cos, &sin)?;
            let mlp = format!("layers.{i}.mlp");
            x = if cfg.parallel_residual {
                // x + attn(LN x) + mlp(LN x): both branches read the same LN(x).
                ((x + attn)? + self.pattention(&mlp, &h, self.scale(4))?)?
            } else {
                let x = (x + attn)?;
                let h = layer_norm(&x, cfg.norm_eps)?;
                (&x + self.pattention(&mlp, &h, self.scale(4))?)?
            };
            if let Some(hidden) = hidden.as_deref_mut() {
                hidden.push(x.clone());
            }
        }
        let h = layer_norm(&x, cfg.norm_eps)?
            .broadcast_mul(&self.p("final_norm.weight")?)?
            .broadcast_add(&self.p("final_norm.bias")?)?;
        let out = if cfg.tie_word_embeddings {
            emb
        } else {
            self.p("final_linear.weight")?
        };
        Ok((h.reshape((b * t, d))?, out))
    }

    /// Mean next-token cross-entropy of ids [b, t+1]: positions 0..t predict 1..=t.
    pub fn loss(&self, ids: &Tensor) -> Result<Tensor> {
        let (_, t1) = ids.dims2()?;
        if t1 < 2 {
            candle_core::bail!("a training sequence needs at least 2 tokens, got {t1}")
        }
        let targets = ids.narrow(1, 1, t1 - 1)?.flatten_all()?.to_vec1::<u32>()?;
        let (h, out) = self.final_state(&ids.narrow(1, 0, t1 - 1)?, None)?;
        if super::fused::serves(&h) {
            return super::fused::head_cross_entropy(&h, &out, &targets);
        }
        let most = crate::device::max_op_elements(h.device());
        head_loss_in_slices(&h, &out, &targets, most)
    }

    /// The √n constant of the k-th Pattention of a block (q, k, v, proj, mlp).
    fn scale(&self, k: usize) -> usize {
        let cfg = &self.cfg;
        let (tokens, fixed) = match k {
            0..=2 => (cfg.qkv_tokens, cfg.pattention_scale_tokens.map(|s| s.qkv)),
            3 => (cfg.proj_tokens, cfg.pattention_scale_tokens.map(|s| s.proj)),
            _ => (cfg.ffn_tokens, cfg.pattention_scale_tokens.map(|s| s.ffn)),
        };
        fixed.unwrap_or(tokens)
    }

    /// Θ(x·Kᵀ)·V for the Pattention under `prefix`.
    fn pattention(&self, prefix: &str, x: &Tensor, scale_tokens: usize) -> Result<Tensor> {
        pattention(
            &self.weights.cast(),
            prefix,
            x,
            self.cfg.pattention_activation,
            scale_tokens,
        )
    }

    fn attention(&self, i: usize, h: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let spec = AttentionSpec {
            heads: self.cfg.num_heads,
            activation: self.cfg.pattention_activation,
            scale_qkv: self.scale(0),
            scale_proj: self.scale(3),
        };
        attention(
            &self.weights.cast(),
            &format!("layers.{i}.attention"),
            h,
            &spec,
            true,
            Some(&|x| self.rotate(x, cos, sin)),
        )
    }

    fn rotary_tables(&self, t: usize) -> Result<(Tensor, Tensor)> {
        rotary_tables(&self.rotary, t, self.compute_dtype())
    }

    /// GPT-NeoX rotary on the first rotary_dims features of x [b, t, h, hd].
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        rotate(x, self.rotary.tables().0, cos, sin)
    }
}

/// Tensors by canonical name: variables, or views of them (a merged model's routes).
pub(crate) trait Params {
    fn tensor(&self, name: &str) -> Result<Option<Tensor>>;

    /// The named matrices stacked by rows, with each one's rows; `None` where their
    /// widths differ. [`Cast`] casts the stack once, not each matrix.
    fn stacked(&self, names: &[String]) -> Result<Option<(Tensor, Vec<usize>)>> {
        let parts = names
            .iter()
            .map(|name| param(self, name))
            .collect::<Result<Vec<_>>>()?;
        let mut rows = Vec::with_capacity(parts.len());
        for part in &parts {
            match part.dims() {
                &[r, width] if width == parts[0].dim(D::Minus1)? => rows.push(r),
                _ => return Ok(None),
            }
        }
        Ok(Some((Tensor::cat(&parts, 0)?, rows)))
    }
}

impl Params for BTreeMap<String, Var> {
    fn tensor(&self, name: &str) -> Result<Option<Tensor>> {
        Ok(self.get(name).map(|v| v.as_tensor().clone()))
    }
}

impl Params for BTreeMap<String, Tensor> {
    fn tensor(&self, name: &str) -> Result<Option<Tensor>> {
        Ok(self.get(name).cloned())
    }
}

/// Tensors read in another dtype: mixed precision's differentiable casts of the
/// f32 variables (a no-op in their own dtype).
pub(crate) struct Cast<'a, P: ?Sized> {
    pub params: &'a P,
    pub dtype: DType,
}

impl<P: Params + ?Sized> Params for Cast<'_, P> {
    fn tensor(&self, name: &str) -> Result<Option<Tensor>> {
        self.params
            .tensor(name)?
            .map(|t| t.to_dtype(self.dtype))
            .transpose()
    }

    fn stacked(&self, names: &[String]) -> Result<Option<(Tensor, Vec<usize>)>> {
        let Some((stack, rows)) = self.params.stacked(names)? else {
            return Ok(None);
        };
        Ok(Some((stack.to_dtype(self.dtype)?, rows)))
    }
}

pub(crate) fn param<P: Params + ?Sized>(params: &P, name: &str) -> Result<Tensor> {
    match params.tensor(name)? {
        Some(t) => Ok(t),
        None => candle_core::bail!("missing tensor `{name}`"),
    }
}

/// Θ(x·Kᵀ)·V for the Pattention under `prefix`.
pub(crate) fn pattention<P: Params + ?Sized>(
    params: &P,
    prefix: &str,
    x: &Tensor,
    activation: crate::pattention::Activation,
    scale_tokens: usize,
) -> Result<Tensor> {
    let k = param(params, &format!("{prefix}.key_param_tokens"))?;
    let v = param(params, &format!("{prefix}.value_param_tokens"))?;
    // As one [rows, d] product: a batched `broadcast_matmul` would copy K once per
    // batch item, multiply in small pieces, and sum those copies' gradients again.
    let l2_norm_gelu = activation == crate::pattention::Activation::L2NormGelu;
    if l2_norm_gelu && super::fused::serves(x) {
        return super::fused::pattention(x, &k, &v, scale_tokens);
    }
    let mut dims = x.dims().to_vec();
    let d = x.dim(D::Minus1)?;
    let x2 = x.reshape(((), d))?;
    *dims.last_mut().expect("a rank of at least 1") = v.dim(1)?;
    let scores = x2.matmul(&k.t()?)?;
    let weights = if l2_norm_gelu && super::theta::serves(&scores) {
        super::theta::l2_norm_gelu(&scores, scale_tokens)?
    } else {
        theta(&scores, activation, scale_tokens)?
    };
    weights.matmul(&v)?.reshape(dims)
}

/// A whole block (`{prefix}.attention.*` and `{prefix}.mlp`) as one fused node on x
/// [b, t, d], when the fused ops serve x and the block's value tokens are all d wide
/// (`None` otherwise: the caller composes the block from its parts).
pub(crate) fn fused_block<P: Params + ?Sized>(
    params: &P,
    prefix: &str,
    x: &Tensor,
    activation: crate::pattention::Activation,
    spec: &super::fused::BlockSpec,
    rotary: BlockRotary<'_>,
) -> Result<Option<Tensor>> {
    let cpu = super::fused::serves(x);
    let device = !cpu && super::device_block::serves(x, spec.heads, spec.causal);
    if activation != crate::pattention::Activation::L2NormGelu || !(cpu || device) {
        return Ok(None);
    }
    let parts = [
        "attention.query",
        "attention.key",
        "attention.value",
        "attention.proj",
        "mlp",
    ];
    let stack = |kind: &str| {
        let names = parts.map(|p| format!("{prefix}.{p}.{kind}_param_tokens"));
        params.stacked(&names)
    };
    let (Some((keys, rows)), Some((values, _))) = (stack("key")?, stack("value")?) else {
        return Ok(None);
    };
    let d = x.dim(2)?;
    let (nq, no, nf) = (rows[0], rows[3], rows[4]);
    if keys.dim(1)? != d || values.dim(1)? != d || rows[1..3] != [nq, nq] {
        return Ok(None);
    }
    let spec = super::fused::BlockSpec {
        tokens: [nq, no, nf],
        ..spec.clone()
    };
    if device {
        return super::device_block::block(x, &keys, &values, &spec, rotary.device).map(Some);
    }
    super::fused::block(x, &keys, &values, &spec, rotary.cpu.cloned()).map(Some)
}

/// A block's rotary positions as each of its fused forms takes them (none for a
/// vision block): the CPU's f64 tables, the device block's f32 tables.
#[derive(Clone, Copy, Default)]
pub(crate) struct BlockRotary<'a> {
    pub cpu: Option<&'a super::fused::RotaryTables>,
    pub device: Option<&'a super::device_block::Rotary>,
}

/// A rotation of q or k [b, t, heads, hd] (the language model's rotary embedding).
pub(crate) type Rotation<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;

/// What a block's token-token attention needs besides its tensors.
pub(crate) struct AttentionSpec {
    pub heads: usize,
    pub activation: crate::pattention::Activation,
    pub scale_qkv: usize,
    pub scale_proj: usize,
}

/// Multi-head attention with Pattention q/k/v/proj under `prefix` on h [b, t, d],
/// causal or bidirectional, `rotate` (if any) applied to q and k [b, t, heads, hd].
pub(crate) fn attention<P: Params + ?Sized>(
    params: &P,
    prefix: &str,
    h: &Tensor,
    spec: &AttentionSpec,
    causal: bool,
    rotate: Option<&Rotation<'_>>,
) -> Result<Tensor> {
    let (b, t, d) = h.dims3()?;
    let heads = spec.heads;
    let hd = d / heads;
    let project = |name: &str| -> Result<Tensor> {
        pattention(
            params,
            &format!("{prefix}.{name}"),
            h,
            spec.activation,
            spec.scale_qkv,
        )
    };
    let rotated = |x: Tensor| -> Result<Tensor> {
        match rotate {
            Some(rotate) => rotate(&x.reshape((b, t, heads, hd))?)?.reshape((b, t, d)),
            None => Ok(x),
        }
    };
    // [b, t, d], heads side by side along d.
    let q = rotated(project("query")?)?;
    let k = rotated(project("key")?)?;
    let v = project("value")?;
    let scale = 1.0 / (hd as f64).sqrt();
    let out = if super::fused::serves(h) {
        super::fused::attention(&q, &k, &v, heads, scale, causal)?
    } else if let Some(out) = flash_attention(&q, &k, &v, heads, causal)? {
        out
    } else {
        let heads_first = |x: Tensor| x.reshape((b, t, heads, hd))?.transpose(1, 2)?.contiguous();
        let (q, k, v) = (heads_first(q)?, heads_first(k)?, heads_first(v)?);
        let scores = q.matmul(&k.t()?.contiguous()?)?;
        masked_softmax(&scores, scale, causal)?
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, d))?
    };
    pattention(
        params,
        &format!("{prefix}.proj"),
        &out,
        spec.activation,
        spec.scale_proj,
    )
}

/// Attention of q, k, v [b, t, d] by the GPU's flash kernels, forward and backward,
/// when they serve (`TOKENFORMER_CUDA_KERNELS=1`): the heads read as views, no
/// [b, h, t, t] scores or probabilities kept for the backward. None elsewhere.
fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    causal: bool,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        let (b, t, d) = q.dims3()?;
        let split = |x: &Tensor| x.reshape((b, t, heads, d / heads))?.transpose(1, 2);
        let (q, k, v) = (split(q)?, split(k)?, split(v)?);
        if crate::kernels::attention_cuda::serves(&q, &k, &v, causal) {
            return crate::kernels::flash::attention(&q, &k, &v, causal).map(Some);
        }
    }
    let _ = (q, k, v, heads, causal);
    Ok(None)
}

/// GPT-NeoX rotary on the first `dims` features of x [.., t, .., hd] with cos/sin
/// broadcastable to it ([t, dims] for [b, h, t, hd], [t, 1, dims] for [b, t, h, hd];
/// rotate-half layout).
pub(crate) fn rotate(x: &Tensor, dims: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if dims == 0 {
        return Ok(x.clone());
    }
    let hd = x.dim(D::Minus1)?;
    let half = dims / 2;
    let rot = x.narrow(D::Minus1, 0, dims)?;
    let (x1, x2) = (
        rot.narrow(D::Minus1, 0, half)?,
        rot.narrow(D::Minus1, half, half)?,
    );
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    let rot = (rot.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?;
    if dims == hd {
        return Ok(rot);
    }
    Tensor::cat(&[&rot, &x.narrow(D::Minus1, dims, hd - dims)?], D::Minus1)
}

/// cos/sin [t, rotary_dims] for positions 0..t, both halves (rotate-half layout).
pub(crate) fn rotary_tables(rotary: &Rotary, t: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
    let (_, cos, sin) = rotary.tables();
    Ok((full_table(cos, t, dtype)?, full_table(sin, t, dtype)?))
}

/// A rotary table [positions, dims/2] as [t, dims] in `dtype` for positions 0..t:
/// both halves of the rotated features turn by the same angles.
pub(crate) fn full_table(table: &Tensor, t: usize, dtype: DType) -> Result<Tensor> {
    if table.dim(1)? == 0 {
        // No rotated features: candle's CUDA cast of an empty tensor launches an empty
        // grid, which the driver refuses.
        return Tensor::zeros((t, 0), dtype, table.device());
    }
    let x = table.narrow(0, 0, t)?.to_dtype(dtype)?;
    Tensor::cat(&[&x, &x], D::Minus1)
}

/// Canonical tensor names and shapes of a language-model config.
pub fn expected_shapes(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let d = cfg.hidden_size;
    let mut v = vec![(
        "word_embeddings.weight".to_string(),
        vec![cfg.vocab_size, d],
    )];
    for i in 0..cfg.num_layers {
        for (m, n) in cfg.pattentions() {
            v.push((format!("layers.{i}.{m}.key_param_tokens"), vec![n, d]));
            v.push((format!("layers.{i}.{m}.value_param_tokens"), vec![n, d]));
        }
    }
    v.push(("final_norm.weight".into(), vec![d]));
    v.push(("final_norm.bias".into(), vec![d]));
    if !cfg.tie_word_embeddings {
        v.push(("final_linear.weight".into(), vec![cfg.vocab_size, d]));
    }
    v
}

/// Softmax over the last axis, the row maximum subtracted first.
pub(crate) fn softmax_last(x: &Tensor) -> Result<Tensor> {
    softmax_scaled(x, 1.0)
}

/// softmax(scale · scores) over the last axis of [.., t, t] attention scores, with
/// the causal mask if `causal`.
pub(crate) fn masked_softmax(scores: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::kernels::masked_softmax::serves(scores) {
        return crate::kernels::masked_softmax::softmax_scaled(scores, scale, causal);
    }
    if !causal {
        return softmax_scaled(scores, scale);
    }
    let t = scores.dim(D::Minus1)?;
    // Entries 0 or −∞, so adding them before the scaling equals adding after.
    let mask = causal_mask(t, scores.dtype(), scores.device())?;
    softmax_scaled(&scores.broadcast_add(&mask)?, scale)
}

/// softmax(scale · x) over the last axis.
pub(crate) fn softmax_scaled(x: &Tensor, scale: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::kernels::masked_softmax::serves(x) {
        return crate::kernels::masked_softmax::softmax_scaled(x, scale, false);
    }
    if super::fused::serves(x) {
        return super::fused::softmax_scaled(x, scale);
    }
    if let Some(wide) = widened(x)? {
        return softmax_scaled(&wide, scale)?.to_dtype(x.dtype());
    }
    let x = if scale == 1.0 {
        x.clone()
    } else {
        (x * scale)?
    };
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Half-precision x in f32, where its reductions run (`None` for f32 and f64).
fn widened(x: &Tensor) -> Result<Option<Tensor>> {
    if crate::kernels::reduction_dtype(x.dtype()) == x.dtype() {
        return Ok(None);
    }
    crate::kernels::widened(x).map(Some)
}

/// LayerNorm without weight and bias over the last axis (biased variance, as torch).
pub(crate) fn layer_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::kernels::nonparam_norm::serves(x) {
        return crate::kernels::nonparam_norm::layer_norm(x, eps);
    }
    if super::fused::serves(x) {
        return super::fused::layer_norm(x, eps);
    }
    if let Some(wide) = widened(x)? {
        return layer_norm(&wide, eps)?.to_dtype(x.dtype());
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    centred.broadcast_div(&(var + eps)?.sqrt()?)
}

/// 0 on and below the diagonal, -inf above: [t, t].
pub(crate) fn causal_mask(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(v, (t, t), device)?.to_dtype(dtype)
}

/// Fresh weights for `cfg` as the official code initialises them: embeddings, keys and
/// values N(0, 0.02) (and the untied output matrix likewise), the final norm's weight 1
/// and bias 0. Deterministic for a seed: each tensor draws from its own stream of
/// [`crate::init`].
pub fn init_tensors(cfg: &Config, seed: u64, device: &Device) -> Result<Tensors> {
    let mut t = Tensors::new();
    for (name, shape) in expected_shapes(cfg) {
        let value = match name.as_str() {
            "final_norm.weight" => Tensor::ones(shape.as_slice(), DType::F32, device)?,
            "final_norm.bias" => Tensor::zeros(shape.as_slice(), DType::F32, device)?,
            _ => crate::init::normal_tensor(shape.as_slice(), 0.02, seed, &name, device)?,
        };
        t.insert(name, value);
    }
    Ok(t)
}

/// Training FLOPs per token: 6 per weight of every matrix product (Pattention keys and
/// values, the output projection), plus the attention scores and mixing over a causal
/// window (fwd + bwd).
pub fn flops_per_token(cfg: &Config, seq_len: usize) -> f64 {
    let d = cfg.hidden_size as f64;
    let pattention: f64 = cfg
        .pattentions()
        .iter()
        .map(|(_, n)| 2.0 * *n as f64 * d)
        .sum::<f64>()
        * cfg.num_layers as f64;
    let head = cfg.vocab_size as f64 * d;
    let attention = 6.0 * cfg.num_layers as f64 * seq_len as f64 * d;
    6.0 * (pattention + head) + attention
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The head's loss in slices of rows (4, 4 and 2 of 10) equals it whole, and so do
    /// the gradients of both operands.
    #[test]
    fn the_head_loss_in_slices_equals_it_whole() {
        let dev = Device::Cpu;
        let vals = |n: usize, k: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * k)
                .collect()
        };
        let h = Var::from_vec(vals(60, 3.0), (10, 6), &dev).unwrap();
        let out = Var::from_vec(vals(42, 2.0), (7, 6), &dev).unwrap();
        let targets = [0u32, 6, 3, 3, 1, 5, 2, 0, 4, 6];
        let run = |most: usize| {
            let loss = head_loss_in_slices(&h, &out, &targets, most).unwrap();
            let g = loss.backward().unwrap();
            let flat = |v: &Var| -> Vec<f32> {
                g.get(v).unwrap().flatten_all().unwrap().to_vec1().unwrap()
            };
            (loss.to_scalar::<f32>().unwrap(), flat(&h), flat(&out))
        };
        let (whole, gh, go) = run(usize::MAX);
        let (sliced, sh, so) = run(4 * 7);
        assert!(
            (whole - sliced).abs() <= 1e-6 * whole.abs(),
            "{whole} vs {sliced}"
        );
        for (a, b) in gh.iter().chain(&go).zip(sh.iter().chain(&so)) {
            assert!((a - b).abs() <= 1e-6, "gradient {a} vs {b}");
        }
        assert!(
            gh.iter().chain(&go).any(|g| g.abs() > 1e-3),
            "no gradient to compare"
        );
    }

    /// A cast stack is the stack of the casts, bit for bit, and gives each variable
    /// the gradient the separate casts give it; matrices of other widths give `None`.
    #[test]
    fn a_cast_stack_is_the_stack_of_the_casts() {
        let vars: BTreeMap<String, Var> = [("a", 2, 3), ("b", 4, 3), ("c", 1, 5)]
            .into_iter()
            .map(|(name, rows, width)| {
                let n = rows * width;
                let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1.01).collect();
                let t = Tensor::from_vec(v, (rows, width), &Device::Cpu).unwrap();
                (name.to_string(), Var::from_tensor(&t).unwrap())
            })
            .collect();
        let cast = Cast {
            params: &vars,
            dtype: DType::BF16,
        };
        let names = ["a".to_string(), "b".to_string()];
        let (stack, rows) = cast.stacked(&names).unwrap().unwrap();
        assert_eq!(rows, [2, 4]);
        assert_eq!(stack.dtype(), DType::BF16);
        let one_by_one =
            Tensor::cat(&[param(&cast, "a").unwrap(), param(&cast, "b").unwrap()], 0).unwrap();
        let bits = |t: &Tensor| {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(bits(&stack), bits(&one_by_one));
        let weight = Tensor::arange(0f32, 18.0, &Device::Cpu)
            .unwrap()
            .reshape((6, 3))
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let grads = |t: &Tensor| {
            let g = (t * &weight)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            names
                .clone()
                .map(|n| bits(g.get(vars[&n].as_tensor()).unwrap()))
        };
        assert_eq!(grads(&stack), grads(&one_by_one));
        assert_eq!(
            grads(&stack)[1][0],
            6.0,
            "b's first gradient is weight[2][0]"
        );
        let other_width = ["a".to_string(), "c".to_string()];
        assert!(cast.stacked(&other_width).unwrap().is_none());
        assert!(vars.stacked(&other_width).unwrap().is_none());
    }
}
