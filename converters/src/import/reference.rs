//! The *source* Transformer's forward pass with plain candle ops, so that the
//! import can be measured against the model it came from without PyTorch:
//! pre-norm blocks with affine LayerNorms and biased linear layers, as in the
//! transformers modeling files `modeling_gpt_neox.py` (optionally with the
//! parallel residual) and `modeling_vit.py` / timm's `vision_transformer.py`.
//! Every layer can record its activations (the inputs and outputs of each
//! linear), which the per-layer fidelity check replays through the new
//! Pattention layers.

use candle_core::{Result, Tensor, D};
use tokenformer::models::tokenformer::Rotary;

use super::{Dense, Norm, SourceBody};

/// What one source layer computed on the probe, rows = batch·tokens.
pub struct LayerTrace {
    /// LayerNorm(x) without its affine part: what a TokenFormer block feeds q/k/v.
    pub attn_in: Tensor,
    pub query: Tensor,
    pub key: Tensor,
    pub value: Tensor,
    /// The attention output (heads merged), the input of the output projection.
    pub proj_in: Tensor,
    pub proj_out: Tensor,
    /// LayerNorm without affine of the MLP's input.
    pub mlp_in: Tensor,
    pub mlp_out: Tensor,
}

/// Token-token attention of the source.
pub enum Mixing<'a> {
    /// Causal with rotary positions from 0 (GPT-NeoX).
    Causal(&'a Rotary),
    /// Every token sees every token (ViT).
    Bidirectional,
}

/// LayerNorm without weight and bias, over the last axis, as torch computes it
/// (biased variance, eps inside the square root).
pub fn standardise(x: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let c = x.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(D::Minus1)?;
    c.broadcast_div(&(var + eps)?.sqrt()?)
}

pub fn layer_norm(x: &Tensor, n: &Norm, eps: f64) -> Result<Tensor> {
    standardise(x, eps)?
        .broadcast_mul(&n.weight)?
        .broadcast_add(&n.bias)
}

/// x [.., in] · Wᵀ + b.
pub fn linear(x: &Tensor, l: &Dense) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let rows = x.elem_count() / dims[dims.len() - 1];
    let y = x
        .reshape((rows, dims[dims.len() - 1]))?
        .matmul(&l.weight.t()?)?;
    let y = match &l.bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims;
    *out.last_mut().expect("rank >= 1") = l.weight.dim(0)?;
    y.reshape(out)
}

fn rows(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    x.reshape((x.elem_count() / d, d))
}

/// Runs all layers on x [b, t, d]; `parallel` is GPT-NeoX's parallel residual
/// (x + attn(ln1 x) + mlp(ln2 x)) instead of the sequential pre-norm block.
pub fn run_layers(
    body: &SourceBody,
    x: &Tensor,
    mixing: &Mixing,
    parallel: bool,
) -> Result<(Tensor, Vec<LayerTrace>)> {
    let (b, t, d) = x.dims3()?;
    let (h, hd) = (body.num_heads, d / body.num_heads);
    let mut x = x.clone();
    let mut traces = Vec::with_capacity(body.layers.len());
    for l in &body.layers {
        let u1 = standardise(&x, body.eps)?;
        let h1 = u1
            .broadcast_mul(&l.ln1.weight)?
            .broadcast_add(&l.ln1.bias)?;
        let (q, k, v) = (
            linear(&h1, &l.query)?,
            linear(&h1, &l.key)?,
            linear(&h1, &l.value)?,
        );
        let heads = |y: &Tensor| y.reshape((b, t, h, hd))?.transpose(1, 2)?.contiguous();
        let (mut qh, mut kh, vh) = (heads(&q)?, heads(&k)?, heads(&v)?);
        let mut scores_mask = None;
        if let Mixing::Causal(rotary) = mixing {
            qh = rotary.apply(&qh, 0)?;
            kh = rotary.apply(&kh, 0)?;
            let m: Vec<f32> = (0..t)
                .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            scores_mask = Some(Tensor::from_vec(m, (t, t), x.device())?);
        }
        let mut scores = (qh.matmul(&kh.t()?)? / (hd as f64).sqrt())?;
        if let Some(m) = scores_mask {
            scores = scores.broadcast_add(&m)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let o = probs.matmul(&vh)?.transpose(1, 2)?.reshape((b, t, d))?;
        let a = linear(&o, &l.dense)?;
        let mlp_input = if parallel { x.clone() } else { (&x + &a)? };
        let u2 = standardise(&mlp_input, body.eps)?;
        let h2 = u2
            .broadcast_mul(&l.ln2.weight)?
            .broadcast_add(&l.ln2.bias)?;
        let m = linear(&linear(&h2, &l.fc1)?.gelu_erf()?, &l.fc2)?;
        traces.push(LayerTrace {
            attn_in: rows(&u1)?,
            query: rows(&q)?,
            key: rows(&k)?,
            value: rows(&v)?,
            proj_in: rows(&o)?,
            proj_out: rows(&a)?,
            mlp_in: rows(&u2)?,
            mlp_out: rows(&m)?,
        });
        x = ((x + a)? + m)?;
    }
    Ok((x, traces))
}

/// The source ViT classifier: logits [b, classes] of normalised pixels
/// [b, C, H, W], with the per-layer traces. The patch embedding is the
/// stride-p convolution it is in both layouts.
pub fn vit_forward(src: &super::VitSource, pixels: &Tensor) -> Result<(Tensor, Vec<LayerTrace>)> {
    let p = src.patch_size;
    let x = pixels.conv2d(&src.patch_w, 0, p, 1, 1)?; // [b, d, g, g]
    let (b, d, gh, gw) = x.dims4()?;
    let x = x
        .reshape((b, d, gh * gw))?
        .transpose(1, 2)?
        .broadcast_add(&src.patch_b)?;
    let cls = src.cls.broadcast_as((b, 1, d))?;
    let x = Tensor::cat(&[&cls, &x], 1)?.broadcast_add(&src.pos)?;
    let (h, traces) = run_layers(&src.body, &x, &Mixing::Bidirectional, false)?;
    let feat = if src.pool_cls {
        layer_norm(&h.narrow(1, 0, 1)?.squeeze(1)?, &src.norm, src.body.eps)?
    } else {
        let n = h.dim(1)? - 1;
        layer_norm(&h.narrow(1, 1, n)?.mean(1)?, &src.norm, src.body.eps)?
    };
    let logits = feat.matmul(&src.head_w.t()?)?.broadcast_add(&src.head_b)?;
    Ok((logits, traces))
}
