//! Name map of Hugging Face transformers' ViT classifiers
//! (`modeling_vit.py`, `ViTForImageClassification`, e.g.
//! `google/vit-base-patch16-224`): `vit.embeddings.{cls_token,
//! position_embeddings, patch_embeddings.projection}`,
//! `vit.encoder.layer.{i}.{layernorm_before, attention.attention.{query,key,value},
//! attention.output.dense, layernorm_after, intermediate.dense, output.dense}`,
//! `vit.layernorm`, `classifier`. The classifier reads the class token after
//! the final LayerNorm; eval preprocessing comes from `preprocessor_config.json`
//! (`ViTImageProcessor`: Pillow resize of both sides to `size` with `resample`, no
//! crop, rescale by 1/255, normalise).

use std::path::Path;

use crate::error::Result;
use crate::models::vit::{Interpolation, Pool, ResizeMode};
use serde_json::Value;

use super::{triple, Names, Qkv, VitMeta, VitSource};
use crate::source::{usize_key, RawCheckpoint};

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
            input_error!(
                "{origin}: missing tensor `classifier.weight` (a ViTForImageClassification has it)"
            )
        })?;

    let pre = Preprocessing::read(&raw.dir, image)?;
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
        mean: pre.mean,
        std: pre.std,
        // The processor resizes both sides straight to image_size: no centre crop.
        crop_pct: 1.0,
        interpolation: pre.interpolation,
        resize_mode: ResizeMode::Squash,
        preprocessing: pre.describe,
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

/// What `ViTImageProcessor` does, from `preprocessor_config.json` (its defaults, as
/// `google/vit-base-patch16-224`'s, when the file is absent).
struct Preprocessing {
    interpolation: Interpolation,
    mean: [f32; 3],
    std: [f32; 3],
    describe: String,
}

impl Preprocessing {
    fn read(dir: &Path, image: usize) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        let pre = match std::fs::read_to_string(&path) {
            Ok(t) => serde_json::from_str::<Value>(&t)
                .map_err(|e| input_error!("{}: {e}", path.display()))?,
            Err(_) => Value::Null,
        };
        let origin = path.display();
        let flag = |k: &str| pre.get(k).and_then(Value::as_bool);
        let kind = pre
            .get("image_processor_type")
            .and_then(Value::as_str)
            .unwrap_or("ViTImageProcessor");
        if flag("do_center_crop") == Some(true) {
            bail!("{origin}: {kind} asks for a centre crop after the resize; only ViTImageProcessor's resize without a crop is supported")
        }
        if flag("do_resize") == Some(false) || flag("do_rescale") == Some(false) {
            bail!("{origin}: do_resize and do_rescale must be true (images are resized to image_size and scaled to [0, 1])")
        }
        if let Some(f) = pre.get("rescale_factor").and_then(Value::as_f64) {
            if (f * 255.0 - 1.0).abs() > 1e-6 {
                bail!("{origin}: rescale_factor {f} is not supported (only 1/255)")
            }
        }
        if let Some(size) = pre.get("size").filter(|v| !v.is_null()) {
            let side = |k: &str| size.get(k).and_then(Value::as_u64);
            let (h, w) = match (side("height"), side("width"), size.as_u64()) {
                (Some(h), Some(w), _) => (h, w),
                (_, _, Some(s)) => (s, s),
                _ => bail!("{origin}: size {size} is not supported: expected {{\"height\": {image}, \"width\": {image}}}"),
            };
            if (h, w) != (image as u64, image as u64) {
                bail!("{origin}: size {h}×{w} differs from the model's image_size {image}")
            }
        }
        let interpolation = match pre.get("resample").and_then(Value::as_u64) {
            None | Some(2) => Interpolation::Bilinear,
            Some(3) => Interpolation::Bicubic,
            Some(r) => bail!("{origin}: resample {r} (a Pillow filter) is not supported: bilinear (2) or bicubic (3)"),
        };
        let (mean, std) = if flag("do_normalize") == Some(false) {
            ([0.0; 3], [1.0; 3])
        } else {
            (
                triple(&pre, "image_mean", [0.5; 3]),
                triple(&pre, "image_std", [0.5; 3]),
            )
        };
        let filter = match interpolation {
            Interpolation::Bilinear => "bilinear",
            Interpolation::Bicubic => "bicubic",
        };
        let mut describe = format!(
            "transformers {kind}: resize to {image}×{image} ({filter}), no crop, mean {mean:?}, std {std:?}"
        );
        if pre.is_null() {
            describe += " (no preprocessor_config.json: the processor's defaults)";
        }
        Ok(Self {
            interpolation,
            mean,
            std,
            describe,
        })
    }
}
