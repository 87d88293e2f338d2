//! ViT image classifiers, in transformers' layout (`hf`) or timm's (`timm`),
//! read into one [`VitSource`] with their own eval preprocessing, and run: patch
//! embedding, the layer stack ([`super::Stack`], every token seeing every token),
//! pooling, final norm and head.

mod hf;
mod timm;

use candle_core::{Device, Tensor};
use serde_json::Value;

use super::data::Images;
use super::{layer_norm, Dense, Mixing, Norm, RawCheckpoint, SourceBody, SourceLayer, Stack};
use crate::checkpoint::Tensors;
use crate::error::Result;
use crate::models::vit::{Interpolation, Pool, ResizeMode};
use crate::train::distill::Targets;
use crate::vision::EvalTransform;

pub use hf::is_unused;

/// Reads a ViT classifier of either layout from `raw`, told apart by its class token.
pub fn read(raw: &mut RawCheckpoint) -> Result<VitSource> {
    if raw.tensors.contains_key("vit.embeddings.cls_token") {
        hf::read(raw)
    } else if raw.tensors.contains_key("cls_token") {
        timm::read(raw)
    } else {
        let example = raw.tensors.keys().next().cloned().unwrap_or_default();
        bail!(
            "{}: unknown ViT layout: neither `vit.embeddings.cls_token` (transformers) nor `cls_token` (timm) is present (found e.g. `{example}`)",
            raw.origin
        )
    }
}

/// What a source's config says about a ViT classifier: everything but the tensors.
pub struct VitMeta {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub eps: f64,
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    pub intermediate_size: usize,
    pub num_classes: usize,
    /// Class token after the final norm, or mean of the patch tokens, then fc_norm.
    pub pool: Pool,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub crop_pct: f64,
    pub interpolation: Interpolation,
    pub resize_mode: ResizeMode,
    /// How the source's own processor was read, for the report.
    pub preprocessing: String,
    pub class_names: Option<Vec<String>>,
    pub layout: &'static str,
}

/// Where a layout keeps each tensor (source names; the TokenFormer names are the same
/// for every layout). Prefixes name a module's `.weight` and `.bias`.
struct Names {
    cls: &'static str,
    pos: &'static str,
    patch: &'static str,
    /// Block i is `{block}.{i}`; the rest of a block's names are relative to it.
    block: &'static str,
    norms: [&'static str; 2],
    qkv: Qkv,
    proj: &'static str,
    mlp: [&'static str; 2],
    final_norm: &'static str,
    head: &'static str,
}

/// The attention's input projections: three linears, or one fused [q | k | v] (each
/// over all heads).
enum Qkv {
    Separate([&'static str; 3]),
    Fused(&'static str),
}

/// A ViT classifier in the shared source form (filled by `hf` or `timm`).
pub struct VitSource {
    pub meta: VitMeta,
    pub body: SourceBody,
    /// Conv weight [d, C, p, p] and bias.
    pub patch_w: Tensor,
    pub patch_b: Tensor,
    pub cls: Tensor,
    pub pos: Tensor,
    pub norm: Norm,
    pub head_w: Tensor,
    pub head_b: Tensor,
    /// (source name, TokenFormer name) of every copied tensor.
    pub copied: Vec<(String, String)>,
    /// The copied tensors under their TokenFormer names.
    pub copies: Tensors,
}

impl VitSource {
    /// Takes every tensor `meta` implies from `raw`, by the layout's `names`.
    fn take(raw: &mut RawCheckpoint, names: &Names, meta: VitMeta) -> Result<Self> {
        let (d, m, p) = (meta.hidden_size, meta.intermediate_size, meta.patch_size);
        let tokens = (meta.image_size / p) * (meta.image_size / p) + 1;
        let (mut copied, mut copies) = (vec![], Tensors::new());
        let mut copy = |raw: &mut RawCheckpoint, from: String, shape: &[usize], to: String| {
            let t = raw.take(&from, shape)?;
            copies.insert(to.clone(), t.clone());
            copied.push((from, to));
            Ok::<_, crate::error::Error>(t)
        };
        let cls = copy(raw, names.cls.into(), &[1, 1, d], "cls_token".into())?;
        let pos = copy(raw, names.pos.into(), &[1, tokens, d], "pos_embed".into())?;
        // A module's `.weight` and `.bias`, copied under the TokenFormer name `to`.
        let mut module =
            |raw: &mut RawCheckpoint, from: &str, to: &str, w: &[usize], b: &[usize]| {
                let weight = copy(raw, format!("{from}.weight"), w, format!("{to}.weight"))?;
                Ok::<_, crate::error::Error>((
                    weight,
                    copy(raw, format!("{from}.bias"), b, format!("{to}.bias"))?,
                ))
            };
        let patch_shape = [d, meta.num_channels, p, p];
        let (patch_w, patch_b) = module(raw, names.patch, "patch_embed", &patch_shape, &[d])?;
        let mut layers = Vec::with_capacity(meta.num_layers);
        for i in 0..meta.num_layers {
            let b = format!("{}.{i}", names.block);
            let ln1 = raw.take_norm(&format!("{b}.{}", names.norms[0]), d)?;
            let ln2 = raw.take_norm(&format!("{b}.{}", names.norms[1]), d)?;
            let dense = |raw: &mut RawCheckpoint, n: &str, out: usize, inp: usize| {
                raw.take_dense(&format!("{b}.{n}"), out, inp, false)
            };
            let [query, key, value] = match names.qkv {
                Qkv::Separate([q, k, v]) => [
                    dense(raw, q, d, d)?,
                    dense(raw, k, d, d)?,
                    dense(raw, v, d, d)?,
                ],
                Qkv::Fused(n) => {
                    let qkv = dense(raw, n, 3 * d, d)?;
                    let part = |j: usize| -> Result<Dense> {
                        Ok(Dense {
                            weight: qkv.weight.narrow(0, j * d, d)?.contiguous()?,
                            bias: qkv
                                .bias
                                .as_ref()
                                .map(|b| b.narrow(0, j * d, d))
                                .transpose()?,
                        })
                    };
                    [part(0)?, part(1)?, part(2)?]
                }
            };
            layers.push(SourceLayer {
                ln1,
                query,
                key,
                value,
                dense: dense(raw, names.proj, d, d)?,
                ln2,
                fc1: dense(raw, names.mlp[0], m, d)?,
                fc2: dense(raw, names.mlp[1], d, m)?,
            });
        }
        let to = if meta.pool == Pool::Cls {
            "final_norm"
        } else {
            "fc_norm"
        };
        let (weight, bias) = module(raw, names.final_norm, to, &[d], &[d])?;
        let norm = Norm { weight, bias };
        let k = meta.num_classes;
        let (head_w, head_b) = module(raw, names.head, "head", &[k, d], &[k])?;
        Ok(Self {
            body: SourceBody {
                num_heads: meta.num_heads,
                eps: meta.eps,
                layers,
            },
            meta,
            patch_w,
            patch_b,
            cls,
            pos,
            norm,
            head_w,
            head_b,
            copied,
            copies,
        })
    }
}

/// Images per forward pass of the source.
pub const BATCH: usize = 8;

/// Runs `f` on `images` preprocessed by `t`, [`BATCH`] at a time.
pub fn for_batches<E: From<crate::error::Error> + From<candle_core::Error>>(
    images: &Images,
    t: &EvalTransform,
    dev: &Device,
    mut f: impl FnMut(&Tensor) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let mut start = 0;
    while start < images.len() {
        let end = (start + BATCH).min(images.len());
        let batch = (start..end)
            .map(|i| {
                let img = images.decode(i)?;
                t.apply(&img)
                    .map_err(|e| input_error!("{}: {e}", images.name(i)))
            })
            .collect::<Result<Vec<_>>>()?;
        f(&t.batch(batch, dev)?)?;
        start = end;
    }
    Ok(())
}

impl VitSource {
    /// How the layers run: every token sees every token, sequential residual.
    pub fn stack(&self) -> Stack<'static> {
        Stack {
            num_heads: self.body.num_heads,
            eps: self.body.eps,
            mixing: Mixing::Bidirectional,
            parallel: false,
        }
    }

    /// What distillation matches on pixels [b, C, H, W]: the logits and each layer's output.
    pub fn targets(&self, pixels: &Tensor) -> Result<Targets> {
        let (h, hidden) = self
            .stack()
            .run_hidden(&self.body.layers, &vit_embed(self, pixels)?)?;
        Ok(Targets {
            logits: vit_head(self, &h)?,
            hidden,
        })
    }
}

/// A per-channel triple (mean, std) of a preprocessing config, `default` if absent.
fn triple(pre: &Value, key: &str, default: [f32; 3]) -> [f32; 3] {
    pre.get(key)
        .and_then(Value::as_array)
        .filter(|a| a.len() == 3)
        .map(|a| [0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.5) as f32))
        .unwrap_or(default)
}

/// The source ViT's layer input x [b, tokens, d] of normalised pixels [b, C, H, W]:
/// the stride-p convolution the patch embedding is in both layouts, the class
/// token and the position embedding.
pub fn vit_embed(src: &VitSource, pixels: &Tensor) -> candle_core::Result<Tensor> {
    let p = src.meta.patch_size;
    let x = pixels.conv2d(&src.patch_w, 0, p, 1, 1)?; // [b, d, g, g]
    let (b, d, gh, gw) = x.dims4()?;
    let x = x
        .reshape((b, d, gh * gw))?
        .transpose(1, 2)?
        .broadcast_add(&src.patch_b)?;
    let cls = src.cls.broadcast_as((b, 1, d))?;
    Tensor::cat(&[&cls, &x], 1)?.broadcast_add(&src.pos)
}

/// Logits [b, classes] of the last layer's output h [b, tokens, d]: class token or
/// mean of the patch tokens, the final norm and the head (copied, so the same for
/// the source and the import).
pub fn vit_head(src: &VitSource, h: &Tensor) -> candle_core::Result<Tensor> {
    let feat = if src.meta.pool == Pool::Cls {
        layer_norm(&h.narrow(1, 0, 1)?.squeeze(1)?, &src.norm, src.body.eps)?
    } else {
        let n = h.dim(1)? - 1;
        layer_norm(&h.narrow(1, 1, n)?.mean(1)?, &src.norm, src.body.eps)?
    };
    feat.matmul(&src.head_w.t()?)?.broadcast_add(&src.head_b)
}
