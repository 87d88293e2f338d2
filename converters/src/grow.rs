//! `tokenformer-convert grow`: progressive scaling by parameter tokens
//! (TokenFormer paper, arXiv 2410.23168, §3.5). New key/value parameter
//! tokens are appended after the old ones in every Pattention layer of every
//! block; with zero keys and each layer's √n constant held at its old n
//! (`--scale keep`, stored as `pattention_scale_tokens` in `config.json`), the
//! grown model computes exactly the old function. `--scale grow` uses the new
//! counts, as the official code does, which rescales every grown layer's
//! activations by √(new/old).
//!
//! Works on canonical tensor names and the JSON config only, so language and
//! vision models grow the same way.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use clap::{Args, ValueEnum};
use serde_json::json;
use tokenformer::card::ModelCard;
use tokenformer::grow::{check_target, grow_tensors, GrowInit, Kind};
use tokenformer::loader::{self, LocateOptions, CONFIG_FILE};
use tokenformer::models::block::ScaleTokens;
use tokenformer::models::ModelConfig;
use tokenformer::pattention::Activation;

use crate::args::{FolderOut, Shards, Storage};
use crate::family::Family;
use crate::output::{check_not_inputs, ModelFolder};
use crate::probe;
use crate::stdout::outln;

#[derive(Args, Debug)]
pub struct GrowArgs {
    /// The model to grow: a model folder, an official .bin (with its yml), a zoo name or a Hub repo.
    #[arg(long)]
    pub model: String,
    /// Config to use instead of the one found with the model (official yml or config.json).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub out: FolderOut,
    /// Target number of q/k/v parameter tokens (at least the current count).
    #[arg(long, value_name = "N")]
    pub qkv_tokens: Option<usize>,
    /// Target number of output-projection parameter tokens.
    #[arg(long, value_name = "N")]
    pub proj_tokens: Option<usize>,
    /// Target number of feed-forward parameter tokens.
    #[arg(long, value_name = "N")]
    pub ffn_tokens: Option<usize>,
    /// Take the three targets from a ladder preset: a zoo name
    /// (tokenformer-ladder-354m) or the paper's size (124M, 354M, 757M, 1.4B).
    #[arg(long, conflicts_with_all = ["qkv_tokens", "proj_tokens", "ffn_tokens"])]
    pub preset: Option<String>,
    /// Initial keys of the new tokens: zeros keep the function, normal does not.
    #[arg(long, value_enum, default_value_t = KeyInit::Zeros)]
    pub key_init: KeyInit,
    /// Standard deviation of normal keys.
    #[arg(long, default_value_t = 0.02)]
    pub key_std: f64,
    /// Initial values of the new tokens.
    #[arg(long, value_enum, default_value_t = ValueInit::Normal)]
    pub value_init: ValueInit,
    /// Standard deviation of the new values.
    #[arg(long, default_value_t = 0.02)]
    pub value_std: f64,
    /// Seed of the random initialisation (each tensor draws from its own stream).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// keep: each layer's √n constant stays at the old n (exact function with zero keys);
    /// grow: it becomes the new count, as in the official code.
    #[arg(long, value_enum, default_value_t = Scale::Keep)]
    pub scale: Scale,
    #[command(flatten)]
    pub storage: Storage,
    /// Hub id recorded as `base_model` in the card (default: the source's, when it came from the Hub).
    #[arg(long)]
    pub base_model: Option<String>,
    #[command(flatten)]
    pub shards: Shards,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KeyInit {
    Zeros,
    Normal,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ValueInit {
    Normal,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scale {
    Keep,
    Grow,
}

/// Resolves `--preset` to a zoo ladder entry: an exact zoo name or a size like 354M / 1.4B.
fn preset(name: &str) -> Result<&'static tokenformer::zoo::ZooEntry> {
    let norm = name.trim().to_ascii_lowercase().replace('.', "-");
    let candidates = [
        norm.clone(),
        format!("tokenformer-ladder-{norm}"),
        format!("tokenformer-{norm}"),
    ];
    let entry = candidates.iter().find_map(|c| tokenformer::zoo::find(c));
    let Some(e) = entry.filter(|e| e.config.get("qkv_tokens").is_some()) else {
        let ladder: Vec<&str> = tokenformer::zoo::entries()
            .iter()
            .filter(|e| e.name.starts_with("tokenformer-ladder-"))
            .map(|e| e.name.as_str())
            .collect();
        bail!(
            "unknown preset `{name}`: use a size (124M, 354M, 757M, 1.4B) or a zoo name ({})",
            ladder.join(", ")
        );
    };
    Ok(e)
}

fn targets_from_preset(name: &str, family: &Family) -> Result<ScaleTokens> {
    let e = preset(name)?;
    let preset = Family::Language(loader::lm_config(&e.config, Path::new(&e.name))?);
    // A preset is the paper's model shape; its token counts mean nothing for another width or depth.
    let (want, have) = (preset.shape(), family.shape());
    for (k, want, have) in [
        ("hidden_size", want.0, have.0),
        ("num_layers", want.1, have.1),
        ("num_heads", want.2, have.2),
    ] {
        if want != have {
            bail!(
                "preset `{}` is for {k} {want}, but the model has {k} {have}: give --qkv-tokens/--proj-tokens/--ffn-tokens instead",
                e.name,
            );
        }
    }
    Ok(preset.token_counts())
}

pub fn run(a: GrowArgs) -> Result<()> {
    for (what, std) in [("--key-std", a.key_std), ("--value-std", a.value_std)] {
        if !std.is_finite() || std < 0.0 {
            bail!("{what} must be a non-negative number, got {std}");
        }
    }
    let opts = LocateOptions {
        config: a.config.clone(),
        tokenizer: None,
        progress: Some(crate::progress::download_bars()),
    };
    let files = loader::locate(&a.model, &opts)?;
    check_not_inputs(&a.out.out, &files)?;
    let dev = Device::Cpu;
    let w = loader::read_weights(&files, a.storage.dtype(), &dev)?;
    let family = Family::of(&w.config, &files.source, &w.path)?;
    let old = family.token_counts();
    let old_scale = family.scale_constants();
    let target = match &a.preset {
        Some(p) => targets_from_preset(p, &family)?,
        None => ScaleTokens {
            qkv: a.qkv_tokens.unwrap_or(old.qkv),
            proj: a.proj_tokens.unwrap_or(old.proj),
            ffn: a.ffn_tokens.unwrap_or(old.ffn),
        },
    };
    check_target(&old, &target)?;
    if target == old {
        outln!("note: the targets equal the current token counts; the model is copied unchanged")?;
    }

    // New √n constants: kept at the old ones, or the new counts for the grown kinds.
    let mut new_scale = old_scale;
    if a.scale == Scale::Grow {
        for k in Kind::ALL
            .into_iter()
            .filter(|&k| Kind::of(&target, k) > Kind::of(&old, k))
        {
            Kind::set(&mut new_scale, k, Kind::of(&target, k));
        }
    }
    let mut config = w.config.clone();
    let obj = config
        .as_object_mut()
        .context("config.json is not a JSON object")?;
    for k in Kind::ALL {
        obj.insert(k.config_key().into(), json!(Kind::of(&target, k)));
    }
    // What `train --train new` needs to tell the appended tokens from the old ones.
    if target != old {
        obj.insert("grown_from_tokens".into(), serde_json::to_value(old)?);
    } else {
        obj.remove("grown_from_tokens");
    }
    if new_scale == target {
        obj.remove("pattention_scale_tokens");
    } else {
        obj.insert(
            "pattention_scale_tokens".into(),
            serde_json::to_value(new_scale)?,
        );
    }

    // Checked before any tensor grows: a target past the config's limits is refused
    // here, not by the allocator.
    ModelConfig::from_value(&config, &a.out.out.join(CONFIG_FILE))
        .map_err(|e| anyhow!("the grown config is invalid: {e}"))?;
    let dtypes: std::collections::BTreeSet<String> = w
        .tensors
        .values()
        .map(|t| format!("{:?}", t.dtype()).to_lowercase())
        .collect();
    let init = GrowInit {
        key_std: (a.key_init == KeyInit::Normal).then_some(a.key_std),
        value_std: a.value_std,
        seed: a.seed,
    };
    let (tensors, _) = grow_tensors(w.tensors, &old, &target, &init)
        .map_err(|e| anyhow!("{}: {e}", w.path.display()))?;
    let n_tensors = tensors.len();

    let folder = ModelFolder::new(&a.out.out, a.out.force)?;
    folder.write_config(&config)?;
    let written = folder.write_weights(&tensors, a.shards.max_shard_size)?;
    drop(tensors);
    folder.copy_tokenizer(files.tokenizer.as_deref())?;

    let before = family.probe_logits(&files, &dev)?;
    let after = family.probe_logits(&folder.files()?, &dev)?;
    let diff = probe::max_abs_diff(&before, &after)?;
    // With softmax Θ a zero key still scores exp(0) and takes weight from
    // the old tokens, so no initialisation is neutral there.
    let softmax = family.activation() == Activation::Softmax;
    let exact = a.scale == Scale::Keep && a.key_init == KeyInit::Zeros && !softmax;
    if softmax && a.key_init == KeyInit::Zeros && a.scale == Scale::Keep {
        outln!("note: this model's Pattention uses softmax, where new tokens always receive weight: growth cannot keep its function exactly")?;
    }
    let what = "the original and the grown model";
    if exact {
        // Zero keys add zero scores: only float summation order can differ.
        let tolerance = a.storage.tolerance(1e-4);
        probe::require(
            what,
            diff,
            tolerance,
            "the grown model does not reproduce the original",
        )?;
    } else {
        outln!(
            "probe: max |Δ logit| between {what} = {diff:.6e} (the function changes: {})",
            if a.scale == Scale::Grow {
                "√n constants follow the new counts"
            } else if softmax {
                "softmax gives the new tokens weight"
            } else {
                "new keys are not zero"
            }
        )?;
    }

    let base_model = a
        .base_model
        .clone()
        .or_else(|| hub_id(&a.model, &files.source));
    let card = growth_card(
        &a,
        &family,
        &old,
        &old_scale,
        &target,
        &new_scale,
        diff,
        base_model.as_deref(),
        &files.source,
    )?;
    let out = folder.finish(&card)?;
    let summary: Vec<String> = Kind::ALL
        .iter()
        .map(|&k| {
            format!(
                "{} {}→{}",
                k.config_key(),
                Kind::of(&old, k),
                Kind::of(&target, k)
            )
        })
        .collect();
    outln!(
        "grew {} ({}); {n_tensors} tensors ({}) in {} file(s); wrote {}",
        family.describe(),
        summary.join(", "),
        dtypes.into_iter().collect::<Vec<_>>().join("/"),
        written
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .count(),
        out.display()
    )?;
    Ok(())
}

/// `owner/name` when the model came from the Hub or the zoo, not a local path.
pub fn hub_id(spec: &str, source: &str) -> Option<String> {
    if Path::new(spec).exists() {
        return None;
    }
    let id = source.split('@').next()?;
    (id.split('/').count() == 2).then(|| id.to_string())
}

#[allow(clippy::too_many_arguments)]
fn growth_card(
    a: &GrowArgs,
    family: &Family,
    old: &ScaleTokens,
    old_scale: &ScaleTokens,
    target: &ScaleTokens,
    new_scale: &ScaleTokens,
    diff: f32,
    base_model: Option<&str>,
    source: &str,
) -> Result<ModelCard> {
    let (d, layers, _) = family.shape();
    let mut card = ModelCard::new(
        format!(
            "TokenFormer {} grown to {}/{}/{} parameter tokens",
            family.describe(),
            target.qkv,
            target.proj,
            target.ffn
        ),
        family.pipeline_tag(),
    );
    if let Some(b) = base_model {
        card.set("base_model", json!(b));
        card.set("base_model_relation", json!("finetune"));
    }
    let per_kind = |c: &ScaleTokens| json!({"qkv": c.qkv, "proj": c.proj, "ffn": c.ffn});
    card.set(
        "tokenformer_growth",
        json!({
            "from_tokens": per_kind(old),
            "to_tokens": per_kind(target),
            "scale": format!("{:?}", a.scale).to_lowercase(),
            "scale_tokens_before": per_kind(old_scale),
            "scale_tokens_after": per_kind(new_scale),
            "key_init": format!("{:?}", a.key_init).to_lowercase(),
            "value_std": a.value_std,
            "seed": a.seed,
            "probe_max_abs_logit_diff": diff,
        }),
    );
    let keys = match a.key_init {
        KeyInit::Zeros => "zero keys".to_string(),
        KeyInit::Normal => format!("normal keys (std {})", a.key_std),
    };
    card.section(
        "Model",
        format!(
            "A TokenFormer {} ({layers} layers, d {d}) grown by `tokenformer-convert grow` from `{source}` by appending parameter tokens to every Pattention layer (progressive scaling, https://arxiv.org/abs/2410.23168 §3.5).",
            family.describe()
        ),
    );
    card.section(
        "Growth",
        format!(
            "| | qkv | proj | ffn |\n|---|---|---|---|\n| tokens before | {} | {} | {} |\n| tokens after | {} | {} | {} |\n| √n constant before | {} | {} | {} |\n| √n constant after | {} | {} | {} |\n\nNew tokens: {keys}, normal values (std {}), seed {}; `--scale {}`.",
            old.qkv, old.proj, old.ffn,
            target.qkv, target.proj, target.ffn,
            old_scale.qkv, old_scale.proj, old_scale.ffn,
            new_scale.qkv, new_scale.proj, new_scale.ffn,
            a.value_std, a.seed, format!("{:?}", a.scale).to_lowercase(),
        ),
    );
    let note = if *new_scale != *target {
        " The √n constants differ from the token counts and are stored as `pattention_scale_tokens` in config.json; the official code cannot represent that (see `tokenformer-convert export`)."
    } else {
        ""
    };
    card.section(
        "Function check",
        format!("max |Δ logit| between the original and the grown model on a probe input: {diff:.3e}.{note}"),
    );
    Ok(card)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_resolve_to_the_ladder() {
        let e = preset("354M").unwrap();
        assert_eq!(e.name, "tokenformer-ladder-354m");
        assert_eq!(preset("1.4B").unwrap().name, "tokenformer-ladder-1-4b");
        assert_eq!(
            preset("tokenformer-ladder-757m").unwrap().name,
            "tokenformer-ladder-757m"
        );
        assert!(preset("9000M").is_err());
        let t = Family::Language(loader::lm_config(&e.config, Path::new("zoo")).unwrap());
        let t = t.token_counts();
        assert_eq!((t.qkv, t.proj, t.ffn), (2140, 2140, 8560));
    }
}
