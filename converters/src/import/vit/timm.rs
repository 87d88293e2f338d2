//! Name map of timm's VisionTransformer (`timm/models/vision_transformer.py`,
//! e.g. `vit_base_patch16_224`): `cls_token`, `pos_embed`,
//! `patch_embed.proj`, `blocks.{i}.{norm1, attn.qkv, attn.proj, norm2,
//! mlp.fc1, mlp.fc2}`, `norm` (class-token pooling) or `fc_norm` (average
//! pooling), `head`. The fused `attn.qkv` rows are [q (all heads) | k | v].
//! The head count is not in the weights: `model_args.num_heads` of the Hub
//! `config.json`, else the size in the architecture name.

use anyhow::{bail, Result};
use serde_json::Value;

use super::{triple, VitSource};
use crate::import::source::{Dense, Norm, RawCheckpoint, SourceBody, SourceLayer};

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
        .ok_or_else(|| anyhow::anyhow!("{origin}: cannot tell the number of heads: config.json has no model_args.num_heads and architecture `{arch}` is not a known vit_<size> name"))?;
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
    let tokens = (image / patch) * (image / patch) + 1;
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
        anyhow::anyhow!("{origin}: missing tensor `head.weight` (a classifier has it)")
    })?;
    let eps = 1e-6;

    let mut copied = vec![];
    let mut take = |raw: &mut RawCheckpoint, from: &str, shape: &[usize], to: Option<&str>| {
        if let Some(to) = to {
            copied.push((from.to_string(), to.to_string()));
        }
        raw.take(from, shape)
    };
    let cls = take(raw, "cls_token", &[1, 1, d], Some("cls_token"))?;
    let pos = take(raw, "pos_embed", &[1, tokens, d], Some("pos_embed"))?;
    let patch_w = take(
        raw,
        "patch_embed.proj.weight",
        &[d, channels, patch, patch],
        Some("patch_embed.weight"),
    )?;
    let patch_b = take(raw, "patch_embed.proj.bias", &[d], Some("patch_embed.bias"))?;
    let mut layers = Vec::with_capacity(layers_n);
    for i in 0..layers_n {
        let p = format!("blocks.{i}");
        let norm = |raw: &mut RawCheckpoint, n: &str| raw.take_norm(&format!("{p}.{n}"), d);
        let ln1 = norm(raw, "norm1")?;
        let ln2 = norm(raw, "norm2")?;
        let dense = |raw: &mut RawCheckpoint, n: &str, out: usize, inp: usize| {
            raw.take_dense(&format!("{p}.{n}"), out, inp, false)
        };
        let qkv = dense(raw, "attn.qkv", 3 * d, d)?;
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
        layers.push(SourceLayer {
            ln1,
            query: part(0)?,
            key: part(1)?,
            value: part(2)?,
            dense: dense(raw, "attn.proj", d, d)?,
            ln2,
            fc1: dense(raw, "mlp.fc1", m, d)?,
            fc2: dense(raw, "mlp.fc2", d, m)?,
        });
    }
    let (nw, nb, to_w, to_b) = if avg {
        (
            "fc_norm.weight",
            "fc_norm.bias",
            "fc_norm.weight",
            "fc_norm.bias",
        )
    } else {
        (
            "norm.weight",
            "norm.bias",
            "final_norm.weight",
            "final_norm.bias",
        )
    };
    let norm = Norm {
        weight: take(raw, nw, &[d], Some(to_w))?,
        bias: take(raw, nb, &[d], Some(to_b))?,
    };
    let head_w = take(raw, "head.weight", &[classes, d], Some("head.weight"))?;
    let head_b = take(raw, "head.bias", &[classes], Some("head.bias"))?;
    let interpolation = match pre.get("interpolation").and_then(Value::as_str) {
        Some("bilinear") => "bilinear",
        _ => "bicubic",
    };
    let class_names = pre
        .get("label_names")
        .and_then(Value::as_array)
        .and_then(|a| {
            let v: Option<Vec<String>> = a.iter().map(|s| s.as_str().map(String::from)).collect();
            v.filter(|v| v.len() == classes)
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
        pool_cls: !avg,
        patch_w,
        patch_b,
        cls,
        pos,
        norm,
        head_w,
        head_b,
        mean: triple(&pre, "mean", [0.5; 3]),
        std: triple(&pre, "std", [0.5; 3]),
        crop_pct: pre.get("crop_pct").and_then(Value::as_f64).unwrap_or(0.9),
        interpolation,
        class_names,
        copied,
        layout: "timm VisionTransformer",
    })
}
