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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::{Args, ValueEnum};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::{json, Value};
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::{self, Tensors};
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::tokenformer::ScaleTokens;

use crate::family::Family;
use crate::output::{check_not_input, Staging};
use crate::{probe, DtypeArg};

#[derive(Args, Debug)]
pub struct GrowArgs {
    /// The model to grow: a model folder, an official .bin (with its yml), a zoo name or a Hub repo.
    #[arg(long)]
    pub model: String,
    /// Config to use instead of the one found with the model (official yml or config.json).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The folder to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out.
    #[arg(long)]
    pub force: bool,
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
    /// Store weights in this dtype (default: as in the input).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Hub id recorded as `base_model` in the card (default: the source's, when it came from the Hub).
    #[arg(long)]
    pub base_model: Option<String>,
    /// Largest safetensors shard, e.g. 5GB (default, the Hub's) or 200MB.
    #[arg(long, hide = true, default_value = "5GB", value_parser = parse_size)]
    pub max_shard_size: u64,
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

/// `5GB`, `200MB`, `64KiB` or a byte count.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size such as 5GB or 1000000"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit `{other}` in `{s}` (use B, KB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    match n.checked_mul(mult) {
        Some(0) | None => Err(format!("`{s}` is not a usable shard size")),
        Some(v) => Ok(v),
    }
}

/// The three Pattention kinds of a block, each with its own token count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Qkv,
    Proj,
    Ffn,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Qkv, Kind::Proj, Kind::Ffn];
    fn config_key(self) -> &'static str {
        match self {
            Kind::Qkv => "qkv_tokens",
            Kind::Proj => "proj_tokens",
            Kind::Ffn => "ffn_tokens",
        }
    }
    fn of(c: &ScaleTokens, k: Kind) -> usize {
        match k {
            Kind::Qkv => c.qkv,
            Kind::Proj => c.proj,
            Kind::Ffn => c.ffn,
        }
    }
}

fn set(c: &mut ScaleTokens, k: Kind, v: usize) {
    match k {
        Kind::Qkv => c.qkv = v,
        Kind::Proj => c.proj = v,
        Kind::Ffn => c.ffn = v,
    }
}

/// Which token count governs a Pattention parameter tensor (None: not one).
fn pattention_kind(name: &str) -> Result<Option<Kind>> {
    let Some(module) = name
        .strip_suffix(".key_param_tokens")
        .or_else(|| name.strip_suffix(".value_param_tokens"))
    else {
        return Ok(None);
    };
    let kind = if [".attention.query", ".attention.key", ".attention.value"]
        .iter()
        .any(|m| module.ends_with(m))
    {
        Kind::Qkv
    } else if module.ends_with(".attention.proj") {
        Kind::Proj
    } else if module.ends_with(".mlp") {
        Kind::Ffn
    } else {
        bail!("tensor `{name}` belongs to a Pattention layer that is not q/k/v, proj or mlp of a block: don't know which token count to grow it by")
    };
    Ok(Some(kind))
}

/// Token counts (qkv, proj, ffn) from a config, generically.
fn token_counts(config: &Value, origin: &Path) -> Result<ScaleTokens> {
    let get = |k: &str| {
        config
            .get(k)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .with_context(|| format!("{}: config has no integer `{k}`", origin.display()))
    };
    Ok(ScaleTokens {
        qkv: get("qkv_tokens")?,
        proj: get("proj_tokens")?,
        ffn: get("ffn_tokens")?,
    })
}

/// The √n constants a config runs with: its `pattention_scale_tokens`, or the counts.
pub fn scale_constants(config: &Value, origin: &Path) -> Result<ScaleTokens> {
    match config.get("pattention_scale_tokens") {
        None | Some(Value::Null) => token_counts(config, origin),
        Some(v) => serde_json::from_value(v.clone())
            .with_context(|| format!("{}: bad `pattention_scale_tokens` {v}", origin.display())),
    }
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

fn targets_from_preset(name: &str, config: &Value) -> Result<ScaleTokens> {
    let e = preset(name)?;
    // A preset is the paper's model shape; its token counts mean nothing for another width or depth.
    for k in ["hidden_size", "num_layers", "num_heads"] {
        let (want, have) = (e.config.get(k), config.get(k));
        if want.is_some() && want != have {
            bail!(
                "preset `{}` is for {k} {}, but the model has {k} {}: give --qkv-tokens/--proj-tokens/--ffn-tokens instead",
                e.name,
                want.unwrap_or(&Value::Null),
                have.unwrap_or(&Value::Null)
            );
        }
    }
    token_counts(&e.config, Path::new(&e.name))
}

/// Draws `rows × cols` normal samples with standard deviation `std` from a
/// stream seeded by (seed, tensor name), so a tensor's new rows do not depend
/// on which other tensors were grown.
fn normal(rows: usize, cols: usize, std: f64, seed: u64, name: &str) -> Vec<f32> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut rng = StdRng::seed_from_u64(seed ^ h);
    let n = rows * cols;
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // Box–Muller: two independent N(0, 1) from two uniforms; 1 − u ∈ (0, 1].
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        out.push((std * r * a.cos()) as f32);
        out.push((std * r * a.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// Appends `extra` rows to a [n, d] parameter-token tensor, keeping its dtype.
fn append_rows(t: &Tensor, extra: usize, init: Option<(f64, u64)>, name: &str) -> Result<Tensor> {
    let (_, d) = t
        .dims2()
        .with_context(|| format!("tensor `{name}` is not a matrix"))?;
    let new = match init {
        None => Tensor::zeros((extra, d), t.dtype(), t.device())?,
        Some((std, seed)) => {
            Tensor::from_vec(normal(extra, d, std, seed, name), (extra, d), t.device())?
                .to_dtype(t.dtype())?
        }
    };
    Ok(Tensor::cat(&[t, &new], 0)?)
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
        progress: None,
    };
    let files = loader::locate(&a.model, &opts)?;
    for p in input_paths(&files) {
        check_not_input(&a.out, &p)?;
    }
    let dev = Device::Cpu;
    let w = loader::read_weights(&files, a.dtype.map(Into::into), &dev)?;
    let family = Family::of(&w.config, &files.source)?;
    family.validate(&w.config, &w.path)?;
    let old = token_counts(&w.config, &w.path)?;
    let w_activation = w
        .config
        .get("pattention_activation")
        .and_then(Value::as_str)
        .unwrap_or("l2_norm_gelu")
        .to_string();
    let old_scale = scale_constants(&w.config, &w.path)?;
    let target = match &a.preset {
        Some(p) => targets_from_preset(p, &w.config)?,
        None => ScaleTokens {
            qkv: a.qkv_tokens.unwrap_or(old.qkv),
            proj: a.proj_tokens.unwrap_or(old.proj),
            ffn: a.ffn_tokens.unwrap_or(old.ffn),
        },
    };
    for k in Kind::ALL {
        let (from, to) = (Kind::of(&old, k), Kind::of(&target, k));
        if to < from {
            bail!("cannot grow {} from {from} to {to}: growing only adds tokens (the target must be at least {from})", k.config_key());
        }
    }
    if target == old {
        println!("note: the targets equal the current token counts; the model is copied unchanged");
    }

    // New √n constants: kept at the old ones, or the new counts for the grown kinds.
    let mut new_scale = old_scale;
    if a.scale == Scale::Grow {
        for k in Kind::ALL
            .into_iter()
            .filter(|&k| Kind::of(&target, k) > Kind::of(&old, k))
        {
            set(&mut new_scale, k, Kind::of(&target, k));
        }
    }
    let mut config = w.config.clone();
    let obj = config
        .as_object_mut()
        .context("config.json is not a JSON object")?;
    for k in Kind::ALL {
        obj.insert(k.config_key().into(), json!(Kind::of(&target, k)));
    }
    if new_scale == target {
        obj.remove("pattention_scale_tokens");
    } else {
        obj.insert(
            "pattention_scale_tokens".into(),
            serde_json::to_value(new_scale)?,
        );
    }

    let key_init = (a.key_init == KeyInit::Normal).then_some((a.key_std, a.seed));
    let value_init = Some((a.value_std, a.seed));
    let source_path = w.path.clone();
    let mut tensors = Tensors::new();
    let mut grown = BTreeMap::<&str, usize>::new();
    let dtypes: std::collections::BTreeSet<String> = w
        .tensors
        .values()
        .map(|t| format!("{:?}", t.dtype()).to_lowercase())
        .collect();
    for (name, t) in w.tensors {
        let Some(kind) = pattention_kind(&name)? else {
            tensors.insert(name, t);
            continue;
        };
        let (from, to) = (Kind::of(&old, kind), Kind::of(&target, kind));
        let rows = t.dims().first().copied().unwrap_or(0);
        if rows != from {
            bail!(
                "{}: tensor `{name}` has {rows} parameter tokens but the config says {} = {from}",
                source_path.display(),
                kind.config_key()
            );
        }
        let t = if to > from {
            *grown.entry(kind.config_key()).or_default() += 1;
            let init = if name.ends_with(".key_param_tokens") {
                key_init
            } else {
                value_init
            };
            append_rows(&t, to - from, init, &name)?
        } else {
            t
        };
        tensors.insert(name, t);
    }
    let n_tensors = tensors.len();

    let staging = Staging::new(&a.out, a.force)?;
    let dir = staging.path().to_path_buf();
    std::fs::write(
        dir.join(loader::CONFIG_FILE),
        serde_json::to_string_pretty(&config)? + "\n",
    )
    .with_context(|| format!("writing {}", dir.join(loader::CONFIG_FILE).display()))?;
    let written = checkpoint::write_safetensors(&dir, &tensors, a.max_shard_size)?;
    drop(tensors);
    if let Some(t) = &files.tokenizer {
        std::fs::copy(t, dir.join(loader::TOKENIZER_FILE))
            .with_context(|| format!("copying {}", t.display()))?;
    }

    let before = family.probe_logits(&files, &dev)?;
    let grown_files = loader::locate(&dir.display().to_string(), &LocateOptions::default())?;
    let after = family.probe_logits(&grown_files, &dev)?;
    let diff = probe::max_abs_diff(&before, &after)?;
    // With softmax Θ a zero key still scores exp(0) and takes weight from
    // the old tokens, so no initialisation is neutral there.
    let softmax = w_activation == "softmax";
    let exact = a.scale == Scale::Keep && a.key_init == KeyInit::Zeros && !softmax;
    if softmax && a.key_init == KeyInit::Zeros && a.scale == Scale::Keep {
        println!("note: this model's Pattention uses softmax, where new tokens always receive weight: growth cannot keep its function exactly");
    }
    let what = "the original and the grown model";
    if exact {
        // Zero keys add zero scores: only float summation order can differ.
        let tolerance = if a.dtype.is_some() { 1e-1 } else { 1e-4 };
        if !probe::report(what, diff, tolerance) {
            bail!("the grown model does not reproduce the original (max |Δ logit| {diff:e}); nothing was written");
        }
    } else {
        println!(
            "probe: max |Δ logit| between {what} = {diff:.6e} (the function changes: {})",
            if a.scale == Scale::Grow {
                "√n constants follow the new counts"
            } else if softmax {
                "softmax gives the new tokens weight"
            } else {
                "new keys are not zero"
            }
        );
    }

    let base_model = a
        .base_model
        .clone()
        .or_else(|| hub_id(&a.model, &files.source));
    let card = growth_card(
        &a,
        family,
        &config,
        &old,
        &old_scale,
        &target,
        &new_scale,
        diff,
        base_model.as_deref(),
        &files.source,
    )?;
    card.write(&dir)?;
    if std::env::var_os("TOKENFORMER_CONVERT_ABORT_BEFORE_COMMIT").is_some() {
        // Test hook: die like a killed process would, without any cleanup.
        std::process::exit(137);
    }
    let out = staging.commit()?;
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
    println!(
        "grew {} ({}); {n_tensors} tensors ({}) in {} file(s); wrote {}",
        family.describe(),
        summary.join(", "),
        dtypes.into_iter().collect::<Vec<_>>().join("/"),
        written
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .count(),
        out.display()
    );
    Ok(())
}

/// The files a model was read from, and its folder unless it was named as one file: none
/// of them may be written into.
pub fn input_paths(files: &loader::ModelFiles) -> Vec<PathBuf> {
    let mut v = match &files.weights {
        loader::Weights::Safetensors(p) => p.clone(),
        loader::Weights::OfficialBin(p) => vec![p.clone()],
    };
    // A model named as a folder (or found in the Hub cache) owns its whole folder; one
    // named as a single weights file owns only its files.
    if !Path::new(&files.source).is_file() {
        let folders: Vec<PathBuf> = v
            .iter()
            .filter_map(|p| p.parent().map(Path::to_path_buf))
            .collect();
        v.extend(folders);
    }
    if let loader::ConfigSource::OfficialYml(y) = &files.config {
        v.push(y.clone());
    }
    v.extend(files.tokenizer.clone());
    v
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
    family: Family,
    config: &Value,
    old: &ScaleTokens,
    old_scale: &ScaleTokens,
    target: &ScaleTokens,
    new_scale: &ScaleTokens,
    diff: f32,
    base_model: Option<&str>,
    source: &str,
) -> Result<ModelCard> {
    let d = config.get("hidden_size").cloned().unwrap_or(Value::Null);
    let layers = config.get("num_layers").cloned().unwrap_or(Value::Null);
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
    fn sizes_parse() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("64KiB"), Ok(65_536));
        assert_eq!(parse_size("1234"), Ok(1234));
        assert!(parse_size("0").is_err());
        assert!(parse_size("5XB").is_err());
    }

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
        let t = token_counts(&e.config, Path::new("zoo")).unwrap();
        assert_eq!((t.qkv, t.proj, t.ffn), (2140, 2140, 8560));
    }

    #[test]
    fn kinds_from_names() {
        let k = |n: &str| pattention_kind(n).unwrap();
        assert_eq!(
            k("layers.3.attention.key.value_param_tokens"),
            Some(Kind::Qkv)
        );
        assert_eq!(
            k("layers.0.attention.proj.key_param_tokens"),
            Some(Kind::Proj)
        );
        assert_eq!(k("layers.11.mlp.value_param_tokens"), Some(Kind::Ffn));
        assert_eq!(k("word_embeddings.weight"), None);
        assert!(pattention_kind("merger.key_param_tokens").is_err());
    }

    #[test]
    fn normal_draws_have_the_requested_spread_and_are_seeded() {
        let v = normal(200, 50, 0.5, 7, "x");
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.02, "std {}", var.sqrt());
        assert_eq!(v, normal(200, 50, 0.5, 7, "x"));
        assert_ne!(v, normal(200, 50, 0.5, 8, "x"));
        assert_ne!(v, normal(200, 50, 0.5, 7, "y"));
    }
}
