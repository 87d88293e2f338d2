//! Name map of Hugging Face transformers' ViT classifiers
//! (`modeling_vit.py`, `ViTForImageClassification`, e.g.
//! `google/vit-base-patch16-224`): `vit.embeddings.{cls_token,
//! position_embeddings, patch_embeddings.projection}`,
//! `vit.encoder.layer.{i}.{layernorm_before, attention.attention.{query,key,value},
//! attention.output.dense, layernorm_after, intermediate.dense, output.dense}`,
//! `vit.layernorm`, `classifier`. The classifier reads the class token after
//! the final LayerNorm; eval preprocessing comes from `preprocessor_config.json`.

use anyhow::{bail, Result};
use serde_json::Value;

use super::{triple, VitSource};
use crate::import::source::{usize_key, Norm, RawCheckpoint, SourceBody, SourceLayer};

/// Tensors a ViT state dict may hold that the classifier does not use.
pub fn is_unused(name: &str) -> bool {
    name.starts_with("vit.pooler.") || name == "vit.embeddings.mask_token"
}

pub fn read(raw: &mut RawCheckpoint) -> Result<VitSource> {
    let c = raw.config.clone();
    let origin = raw.origin.clone();
    if let Some(mt) = c.get("model_type").and_then(Value::as_str) {
        if mt != "vit" {
            bail!("{origin}: config.json says model_type `{mt}`, not a ViT classifier (`vit`)")
        }
    }
    if let Some(act) = c.get("hidden_act").and_then(Value::as_str) {
        if act != "gelu" {
            bail!(
                "{origin}: hidden_act `{act}` is not supported (Pattention's Θ is the exact GELU)"
            )
        }
    }
    if !raw.tensors.contains_key("vit.embeddings.cls_token") {
        let example = raw.tensors.keys().next().cloned().unwrap_or_default();
        bail!("{origin}: not a transformers ViT classifier: tensor `vit.embeddings.cls_token` is missing (found e.g. `{example}`)")
    }
    let d = usize_key(&c, "hidden_size", &origin, None)?;
    let layers_n = usize_key(&c, "num_hidden_layers", &origin, None)?;
    let heads = usize_key(&c, "num_attention_heads", &origin, None)?;
    if d % heads != 0 {
        bail!("{origin}: hidden_size {d} is not divisible by num_attention_heads {heads}")
    }
    let m = usize_key(&c, "intermediate_size", &origin, Some(4 * d))?;
    let image = usize_key(&c, "image_size", &origin, Some(224))?;
    let patch = usize_key(&c, "patch_size", &origin, Some(16))?;
    let channels = usize_key(&c, "num_channels", &origin, Some(3))?;
    if image % patch != 0 {
        bail!("{origin}: image_size {image} is not divisible by patch_size {patch}")
    }
    let tokens = (image / patch) * (image / patch) + 1;
    let eps = c
        .get("layer_norm_eps")
        .and_then(Value::as_f64)
        .unwrap_or(1e-12);
    let classes = raw
        .tensors
        .get("classifier.weight")
        .map(|t| t.dims()[0])
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{origin}: missing tensor `classifier.weight` (a ViTForImageClassification has it)"
            )
        })?;

    let mut copied = vec![];
    let mut take = |raw: &mut RawCheckpoint, from: &str, shape: &[usize], to: Option<&str>| {
        if let Some(to) = to {
            copied.push((from.to_string(), to.to_string()));
        }
        raw.take(from, shape)
    };
    let cls = take(
        raw,
        "vit.embeddings.cls_token",
        &[1, 1, d],
        Some("cls_token"),
    )?;
    let pos = take(
        raw,
        "vit.embeddings.position_embeddings",
        &[1, tokens, d],
        Some("pos_embed"),
    )?;
    let patch_w = take(
        raw,
        "vit.embeddings.patch_embeddings.projection.weight",
        &[d, channels, patch, patch],
        Some("patch_embed.weight"),
    )?;
    let patch_b = take(
        raw,
        "vit.embeddings.patch_embeddings.projection.bias",
        &[d],
        Some("patch_embed.bias"),
    )?;
    let mut layers = Vec::with_capacity(layers_n);
    for i in 0..layers_n {
        let p = format!("vit.encoder.layer.{i}");
        let norm = |raw: &mut RawCheckpoint, n: &str| raw.take_norm(&format!("{p}.{n}"), d);
        let ln1 = norm(raw, "layernorm_before")?;
        let ln2 = norm(raw, "layernorm_after")?;
        let dense = |raw: &mut RawCheckpoint, n: &str, out: usize, inp: usize| {
            raw.take_dense(&format!("{p}.{n}"), out, inp, false)
        };
        layers.push(SourceLayer {
            ln1,
            query: dense(raw, "attention.attention.query", d, d)?,
            key: dense(raw, "attention.attention.key", d, d)?,
            value: dense(raw, "attention.attention.value", d, d)?,
            dense: dense(raw, "attention.output.dense", d, d)?,
            ln2,
            fc1: dense(raw, "intermediate.dense", m, d)?,
            fc2: dense(raw, "output.dense", d, m)?,
        });
    }
    let norm = Norm {
        weight: take(raw, "vit.layernorm.weight", &[d], Some("final_norm.weight"))?,
        bias: take(raw, "vit.layernorm.bias", &[d], Some("final_norm.bias"))?,
    };
    let head_w = take(raw, "classifier.weight", &[classes, d], Some("head.weight"))?;
    let head_b = take(raw, "classifier.bias", &[classes], Some("head.bias"))?;

    // Eval preprocessing of the processor (defaults: google/vit-base-patch16-224's).
    let pre = std::fs::read_to_string(raw.dir.join("preprocessor_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .unwrap_or(Value::Null);
    let interpolation = match pre.get("resample").and_then(Value::as_u64) {
        Some(3) => "bicubic",
        _ => "bilinear",
    };
    let class_names = c.get("id2label").and_then(Value::as_object).and_then(|m| {
        let names: Option<Vec<String>> = (0..classes)
            .map(|i| {
                m.get(&i.to_string())
                    .and_then(Value::as_str)
                    .map(String::from)
            })
            .collect();
        names.filter(|n| n.iter().any(|s| !s.starts_with("LABEL_")))
    });
    Ok(VitSource {
        body: SourceBody {
            num_heads: heads,
            eps,
            layers,
        },
        image_size: image,
        patch_size: patch,
        num_channels: channels,
        intermediate_size: m,
        num_classes: classes,
        pool_cls: true,
        patch_w,
        patch_b,
        cls,
        pos,
        norm,
        head_w,
        head_b,
        mean: triple(&pre, "image_mean", [0.5; 3]),
        std: triple(&pre, "image_std", [0.5; 3]),
        // The processor resizes straight to image_size: no centre crop.
        crop_pct: 1.0,
        interpolation,
        class_names,
        copied,
        layout: "transformers ViTForImageClassification",
    })
}
