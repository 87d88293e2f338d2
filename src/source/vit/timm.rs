//! Name map of timm's VisionTransformer (`timm/models/vision_transformer.py`,
//! e.g. `vit_base_patch16_224`): `cls_token`, `pos_embed`,
//! `patch_embed.proj`, `blocks.{i}.{norm1, attn.qkv, attn.proj, norm2,
//! mlp.fc1, mlp.fc2}`, `norm` (class-token pooling) or `fc_norm` (average
//! pooling), `head`. The fused `attn.qkv` rows are [q (all heads) | k | v].
//! The head count is not in the weights: `model_args.num_heads` of the Hub
//! `config.json`, else the size in the architecture name. Eval preprocessing is
//! the `pretrained_cfg`'s (`crop_pct`, `crop_mode`, `interpolation`, `mean`, `std`),
//! as `timm.data.create_transform` builds it.

use crate::error::Result;
use crate::models::vit::{Interpolation, Pool, ResizeMode};
use serde_json::Value;

use super::{triple, Names, Qkv, VitMeta, VitSource};
use crate::source::RawCheckpoint;

/// timm's ViT sizes by name (`vit_tiny` … `vit_giant`): heads.
fn heads_from_name(arch: &str) -> Option<usize> {
    let size = arch.strip_prefix("vit_")?.split('_').next()?;
    Some(match size {
        "tiny" => 3,
        "small" => 6,
        "base" => 12,
        "medium" => 8,
        "large" | "huge" | "giant" => 16,
        _ => return None,
    })
}

pub fn read(raw: &mut RawCheckpoint) -> Result<VitSource> {
    let c = raw.config.clone();
    let origin = raw.origin.clone();
    let dims = |raw: &RawCheckpoint, n: &str| raw.tensors.get(n).map(|t| t.dims().to_vec());
    let Some(cls_dims) = dims(raw, "cls_token") else {
        let example = raw.tensors.keys().next().cloned().unwrap_or_default();
        bail!("{origin}: not a timm ViT: tensor `cls_token` is missing (found e.g. `{example}`)")
    };
    let d = cls_dims[cls_dims.len() - 1];
    let arch = c.get("architecture").and_then(Value::as_str).unwrap_or("");
    let args = c.get("model_args");
    let heads = args
        .and_then(|a| a.get("num_heads"))
        .and_then(Value::as_u64)
        .map(|h| h as usize)
        .or_else(|| heads_from_name(arch))
        .ok_or_else(|| input_error!("{origin}: cannot tell the number of heads: config.json has no model_args.num_heads and architecture `{arch}` is not a known vit_<size> name"))?;
    if heads == 0 || d % heads != 0 {
        bail!("{origin}: width {d} is not divisible by {heads} heads")
    }
    let layers_n = (0..)
        .take_while(|i| {
            raw.tensors
                .contains_key(&format!("blocks.{i}.norm1.weight"))
        })
        .count();
    if layers_n == 0 {
        bail!("{origin}: no `blocks.0.norm1.weight`: not a timm ViT")
    }
    let Some(pw) = dims(raw, "patch_embed.proj.weight") else {
        bail!("{origin}: missing tensor `patch_embed.proj.weight`")
    };
    let (channels, patch) = (pw[1], pw[2]);
    let m = dims(raw, "blocks.0.mlp.fc1.weight").map_or(4 * d, |s| s[0]);
    let pre = c.get("pretrained_cfg").cloned().unwrap_or(Value::Null);
    let image = pre
        .get("input_size")
        .and_then(Value::as_array)
        .and_then(|a| a.get(1))
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .or_else(|| dims(raw, "pos_embed").map(|p| (((p[1] - 1) as f64).sqrt() as usize) * patch))
        .unwrap_or(224);
    let avg = match c.get("global_pool").and_then(Value::as_str).or(args
        .and_then(|a| a.get("global_pool"))
        .and_then(Value::as_str))
    {
        Some("avg") => true,
        Some("token") | None => {
            raw.tensors.contains_key("fc_norm.weight") && !raw.tensors.contains_key("norm.weight")
        }
        Some(other) => bail!("{origin}: global_pool `{other}` is not supported (token or avg)"),
    };
    let classes = dims(raw, "head.weight").map(|s| s[0]).ok_or_else(|| {
        input_error!("{origin}: missing tensor `head.weight` (a classifier has it)")
    })?;

    let interpolation = match pre.get("interpolation").and_then(Value::as_str) {
        Some("bilinear") => Interpolation::Bilinear,
        Some("bicubic") | None => Interpolation::Bicubic,
        Some(other) => bail!("{origin}: pretrained_cfg.interpolation `{other}` is not supported (bilinear or bicubic)"),
    };
    let resize_mode = match pre.get("crop_mode").and_then(Value::as_str) {
        Some("center") | None => ResizeMode::ShorterSide,
        Some("squash") => ResizeMode::Squash,
        Some(other) => bail!(
            "{origin}: pretrained_cfg.crop_mode `{other}` is not supported (center or squash)"
        ),
    };
    let crop_pct = pre.get("crop_pct").and_then(Value::as_f64).unwrap_or(0.9);
    let mean = triple(&pre, "mean", [0.5; 3]);
    let std = triple(&pre, "std", [0.5; 3]);
    let scale = (image as f64 / crop_pct).floor() as usize;
    let preprocessing = format!(
        "timm eval transform: resize {} to {scale} ({}), centre crop {image}, mean {mean:?}, std {std:?}{}",
        if resize_mode == ResizeMode::Squash { "both sides" } else { "the shorter side" },
        if interpolation == Interpolation::Bilinear { "bilinear" } else { "bicubic" },
        if pre.is_null() { " (no pretrained_cfg: timm's defaults)" } else { "" }
    );
    let class_names = pre
        .get("label_names")
        .and_then(Value::as_array)
        .and_then(|a| {
            let v: Option<Vec<String>> = a.iter().map(|s| s.as_str().map(String::from)).collect();
            v.filter(|v| v.len() == classes)
        });
    let meta = VitMeta {
        hidden_size: d,
        num_layers: layers_n,
        num_heads: heads,
        eps: 1e-6,
        image_size: image,
        patch_size: patch,
        num_channels: channels,
        intermediate_size: m,
        num_classes: classes,
        pool: if avg { Pool::Mean } else { Pool::Cls },
        mean,
        std,
        crop_pct,
        interpolation,
        resize_mode,
        preprocessing,
        class_names,
        layout: "timm VisionTransformer",
    };
    let names = Names {
        cls: "cls_token",
        pos: "pos_embed",
        patch: "patch_embed.proj",
        block: "blocks",
        norms: ["norm1", "norm2"],
        qkv: Qkv::Fused("attn.qkv"),
        proj: "attn.proj",
        mlp: ["mlp.fc1", "mlp.fc2"],
        final_norm: if avg { "fc_norm" } else { "norm" },
        head: "head",
    };
    VitSource::take(raw, &names, meta)
}
