//! `tokenformer inspect MODEL`: what a checkpoint holds, without running it.

use std::path::{Path, PathBuf};

use crate::cli::stdout::outln;
use anyhow::{bail, Result};
use clap::Args;
use tokenformer::checkpoint::{self, TensorInfo};
use tokenformer::loader::{self, ConfigSource, LocateOptions, Weights};

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A model folder, a .safetensors file or an official .bin (its yml not needed), or a
    /// zoo name or Hub repo id as the other commands take (downloaded if not cached).
    pub model: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: InspectArgs) -> Result<()> {
    let p = Path::new(&a.model);
    let (source, files, config) = if p.exists() {
        let (files, config) = local(p)?;
        (p.display().to_string(), files, config)
    } else {
        let opts = LocateOptions {
            progress: Some(super::progress::download_bars()),
            ..Default::default()
        };
        let m = loader::locate(&a.model, &opts)?;
        let files = match m.weights {
            Weights::Safetensors(f) => f,
            Weights::OfficialBin(f) => vec![f],
        };
        let config = match m.config {
            ConfigSource::Json { value, .. } => Some(value),
            ConfigSource::OfficialYml(_) => None,
        };
        (m.source, files, config)
    };
    let mut tensors: Vec<TensorInfo> = Vec::new();
    for f in &files {
        tensors.extend(checkpoint::tensor_infos(f)?);
    }
    let params = parameter_count(&tensors)?;
    let architecture = detect(&tensors, config.as_ref(), &files);
    if a.json {
        let out = serde_json::json!({
            "path": source, "architecture": architecture, "parameters": params,
            "config": config, "tensors": tensors,
        });
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
        return Ok(());
    }
    outln!("{:<60} {:>6}  shape", "tensor", "dtype")?;
    for t in &tensors {
        outln!("{:<60} {:>6}  {:?}", t.name, t.dtype, t.shape)?;
    }
    outln!("\narchitecture: {architecture}")?;
    outln!(
        "tensors: {}  parameters: {} ({:.1}M)",
        tensors.len(),
        params,
        params as f64 / 1e6
    )?;
    Ok(())
}

/// The checkpoint files of a path and the config.json beside them, if any.
fn local(p: &Path) -> Result<(Vec<PathBuf>, Option<serde_json::Value>)> {
    if p.is_dir() {
        let files = match checkpoint::safetensors_files(p) {
            Ok(f) => f,
            Err(_) if p.join("pytorch_model.bin").exists() => vec![p.join("pytorch_model.bin")],
            Err(e) => return Err(e.into()),
        };
        let cfg = p.join(loader::CONFIG_FILE);
        let config = cfg.exists().then(|| loader::read_json(&cfg)).transpose()?;
        return Ok((files, config));
    }
    let cfg = p.with_file_name(loader::CONFIG_FILE);
    let is_st = p.extension().is_some_and(|e| e == "safetensors");
    let config = (is_st && cfg.exists())
        .then(|| loader::read_json(&cfg))
        .transpose()?;
    Ok((vec![p.to_path_buf()], config))
}

/// Elements of all tensors, in checked arithmetic: the shapes come from the
/// file (checked against its size when read, but never trusted for a sum).
fn parameter_count(tensors: &[TensorInfo]) -> Result<u64> {
    let mut total: u64 = 0;
    for t in tensors {
        let n = t
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        total = match n.and_then(|n| total.checked_add(n)) {
            Some(v) => v,
            None => bail!(
                "tensor `{}` of shape {:?}: the parameter count does not fit in 64 bits; the file is not a real checkpoint",
                t.name,
                t.shape
            ),
        };
    }
    Ok(total)
}

/// The architecture from the config, or guessed from tensor names.
fn detect(tensors: &[TensorInfo], config: Option<&serde_json::Value>, files: &[PathBuf]) -> String {
    if let Some(c) = config {
        let arch = loader::architecture(c);
        if !arch.is_empty() {
            return arch.to_string();
        }
    }
    let has = |n: &str| tensors.iter().any(|t| t.name == n);
    if has("sequential.0.word_embeddings.weight") {
        let layers = checkpoint::official_num_layers(tensors.iter().map(|t| t.name.as_str()));
        return format!("tokenformer-lm (official GPT-NeoX format, {layers} layers)");
    }
    if has("word_embeddings.weight") {
        return "tokenformer-lm (no config.json)".into();
    }
    if has("patch_embed.weight") {
        return "tokenformer-vit (no config.json)".into();
    }
    format!(
        "unknown ({})",
        files
            .first()
            .map_or("".into(), |f| Path::new(f).display().to_string())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, shape: &[usize]) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: "f16".into(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn parameter_count_is_exact_or_an_error_naming_the_tensor() {
        let ok = [
            info("a", &[50_304, 768]),
            info("b", &[3, 0, 7]),
            info("c", &[]),
        ];
        assert_eq!(parameter_count(&ok).unwrap(), 50_304 * 768 + 1);
        // 2^32 · 2^32 overflows a product; 2^63 + 2^63 overflows the sum.
        let e = parameter_count(&[info("big", &[1 << 32, 1 << 32])]).unwrap_err();
        assert!(e.to_string().contains("`big`"), "{e}");
        let e = parameter_count(&[info("x", &[1 << 63]), info("y", &[1 << 63])]).unwrap_err();
        assert!(e.to_string().contains("`y`"), "{e}");
    }
}
