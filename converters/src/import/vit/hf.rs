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
use tokenformer::models::vit::{Interpolation, Pool};

use super::{triple, Names, Qkv, VitMeta, VitSource};
use crate::import::source::{usize_key, RawCheckpoint};

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

    // Eval preprocessing of the processor (defaults: google/vit-base-patch16-224's).
    let pre = std::fs::read_to_string(raw.dir.join("preprocessor_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .unwrap_or(Value::Null);
    let interpolation = match pre.get("resample").and_then(Value::as_u64) {
        Some(3) => Interpolation::Bicubic,
        _ => Interpolation::Bilinear,
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
    let meta = VitMeta {
        hidden_size: d,
        num_layers: layers_n,
        num_heads: heads,
        eps,
        image_size: image,
        patch_size: patch,
        num_channels: channels,
        intermediate_size: m,
        num_classes: classes,
        pool: Pool::Cls,
        mean: triple(&pre, "image_mean", [0.5; 3]),
        std: triple(&pre, "image_std", [0.5; 3]),
        // The processor resizes straight to image_size: no centre crop.
        crop_pct: 1.0,
        interpolation,
        class_names,
        layout: "transformers ViTForImageClassification",
    };
    let names = Names {
        cls: "vit.embeddings.cls_token",
        pos: "vit.embeddings.position_embeddings",
        patch: "vit.embeddings.patch_embeddings.projection",
        block: "vit.encoder.layer",
        norms: ["layernorm_before", "layernorm_after"],
        qkv: Qkv::Separate([
            "attention.attention.query",
            "attention.attention.key",
            "attention.attention.value",
        ]),
        proj: "attention.output.dense",
        mlp: ["intermediate.dense", "output.dense"],
        final_norm: "vit.layernorm",
        head: "classifier",
    };
    VitSource::take(raw, &names, meta)
}
