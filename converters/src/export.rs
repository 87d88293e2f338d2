//! `tokenformer-convert export --format official`: a canonical language model
//! → the official release format, i.e. a `pytorch_model.bin` with GPT-NeoX
//! pipeline names (`tokenformer::checkpoint::official`) in PyTorch's zip
//! serialization format (`tokenformer::checkpoint::torch_zip`), plus the
//! official eval yml beside it, so the official trainer can resume from it.
//!
//! The official Pattention always scales by √n with n the layer's token count
//! (arXiv 2410.23168, §3.5 growth then changes the function); a model grown
//! with `--scale keep` has other constants and is refused unless the user
//! accepts the function change, whose size is then measured and printed.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::{Args, ValueEnum};
use tokenformer::checkpoint::{official, torch_zip};
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::tokenformer::PATTENTIONS;

use crate::args::Storage;
use crate::family::Family;
use crate::output::{abort_hook, check_not_inputs, check_target, staging_dir};
use crate::probe;
use crate::stdout::outln;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The model to export: a model folder, an official .bin (with its yml), a zoo name or a Hub repo.
    #[arg(long)]
    pub model: String,
    /// Config to use instead of the one found with the model.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Target format.
    #[arg(long, value_enum, default_value_t = Format::Official)]
    pub format: Format,
    /// The checkpoint file to write (`.bin`); the yml is written beside it with the same stem.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace existing output files.
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub storage: Storage,
    /// Export a model whose √n constants differ from its token counts anyway
    /// (the official code will compute a different function; the shift is printed).
    #[arg(long)]
    pub allow_function_change: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The official TokenFormer release: pytorch_model.bin (torch zip) + eval yml.
    Official,
}

/// Position of an official tensor in the state dict the official model
/// produces (pipeline index, then module order within a block).
fn official_order(name: &str) -> (usize, usize) {
    let mut parts = name.splitn(3, '.');
    let idx = parts
        .nth(1)
        .and_then(|i| i.parse().ok())
        .unwrap_or(usize::MAX);
    let tail = parts.next().unwrap_or("");
    let rank = match tail.rsplit_once('.') {
        Some((module, param)) => {
            let m = PATTENTIONS.iter().position(|b| *b == module).unwrap_or(0);
            2 * m + usize::from(param == "value_param_tokens" || param == "bias")
        }
        None => 0,
    };
    (idx, rank)
}

pub fn run(a: ExportArgs) -> Result<()> {
    let Format::Official = a.format;
    if !matches!(
        a.out.extension().and_then(|e| e.to_str()),
        Some("bin" | "pt" | "pth")
    ) {
        bail!("--out {} must name a checkpoint file ending in .bin (like the released pytorch_model.bin)", a.out.display());
    }
    if a.out.is_dir() {
        bail!(
            "--out {} is a folder; give the path of the .bin file to write",
            a.out.display()
        );
    }
    let yml_out = a.out.with_extension("yml");
    let files = loader::locate(
        &a.model,
        &LocateOptions {
            config: a.config.clone(),
            tokenizer: None,
            progress: Some(crate::progress::download_bars()),
        },
    )?;
    check_not_inputs(&a.out, &files)?;
    check_not_inputs(&yml_out, &files)?;
    check_target(&a.out, a.force)?;
    check_target(&yml_out, a.force)?;

    let dev = Device::Cpu;
    let w = loader::read_weights(&files, a.storage.dtype(), &dev)?;
    let family = Family::of(&w.config, &files.source, &w.path)?;
    let Family::Language(cfg) = &family else {
        bail!(
            "{}: a TokenFormer {} has no official checkpoint format (the official release and trainer cover language models only); keep it as a safetensors folder",
            files.source,
            family.describe()
        );
    };
    let counts = (cfg.qkv_tokens, cfg.proj_tokens, cfg.ffn_tokens);
    let changes_function = cfg
        .pattention_scale_tokens
        .is_some_and(|s| (s.qkv, s.proj, s.ffn) != counts);
    if changes_function {
        let s = cfg.pattention_scale_tokens.expect("checked");
        let msg = format!(
            "{} keeps √n constants (qkv {}, proj {}, ffn {}) that differ from its token counts (qkv {}, proj {}, ffn {}), as a model grown with `--scale keep` does. \
             The official format has no place for them: the official code scales by √(token count), so the exported model computes a different function",
            files.source, s.qkv, s.proj, s.ffn, counts.0, counts.1, counts.2
        );
        if !a.allow_function_change {
            bail!("{msg}. Pass --allow-function-change to export it anyway (the logit shift is measured and printed).");
        }
        outln!("warning: {msg}.")?;
    }

    let mut entries: Vec<(String, Tensor)> = Vec::with_capacity(w.tensors.len());
    for (name, t) in w.tensors {
        let off = official::to_official(&name, cfg.num_layers).with_context(|| {
            format!(
                "{}: tensor `{name}` has no place in the official state dict",
                w.path.display()
            )
        })?;
        entries.push((off, t));
    }
    entries.sort_by_key(|(n, _)| official_order(n));

    // Stage both files in a hidden folder beside --out; rename them at the end.
    let file_name = a
        .out
        .file_name()
        .context("--out has no file name")?
        .to_string_lossy()
        .into_owned();
    let tmp = staging_dir(&a.out)?;
    let staged_bin = tmp.path().join(&file_name);
    let staged_yml = staged_bin.with_extension("yml");
    torch_zip::write_state_dict(&staged_bin, &entries, torch_zip::WriteOptions::default())?;
    let n_tensors = entries.len();
    drop(entries);
    std::fs::write(&staged_yml, official::config_to_yml(cfg))
        .with_context(|| format!("writing {}", staged_yml.display()))?;

    // Read the export back as the official format and compare logits.
    let exported = loader::locate(&staged_bin.display().to_string(), &LocateOptions::default())?;
    let before = family.probe_logits(&files, &dev)?;
    let after = family.probe_logits(&exported, &dev)?;
    let diff = probe::max_abs_diff(&before, &after)?;
    if changes_function {
        outln!("probe: max |Δ logit| between the model and its official export = {diff:.6e} (the function change you allowed)")?;
    } else {
        let tolerance = a.storage.tolerance(0.0);
        probe::require(
            "the model and its official export",
            diff,
            tolerance,
            "the export does not reproduce the model",
        )?;
    }
    abort_hook();
    place(&staged_bin, &a.out)?;
    if let Err(e) = place(&staged_yml, &yml_out) {
        let _ = std::fs::remove_file(&a.out);
        return Err(e);
    }
    outln!(
        "wrote {} ({n_tensors} tensors) and {}",
        a.out.display(),
        yml_out.display()
    )?;
    Ok(())
}

/// Moves a finished file into place (the staging folder is on the same filesystem).
fn place(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).with_context(|| format!("cannot create {}", to.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn official_order_follows_the_module_order() {
        let mut names = vec![
            "sequential.11.norm.bias",
            "sequential.3.mlp.key_param_tokens",
            "sequential.10.attention.query.key_param_tokens",
            "sequential.2.attention.proj.value_param_tokens",
            "sequential.2.attention.query.value_param_tokens",
            "sequential.2.attention.query.key_param_tokens",
            "sequential.0.word_embeddings.weight",
            "sequential.11.norm.weight",
        ];
        names.sort_by_key(|n| official_order(n));
        assert_eq!(
            names,
            [
                "sequential.0.word_embeddings.weight",
                "sequential.2.attention.query.key_param_tokens",
                "sequential.2.attention.query.value_param_tokens",
                "sequential.2.attention.proj.value_param_tokens",
                "sequential.3.mlp.key_param_tokens",
                "sequential.10.attention.query.key_param_tokens",
                "sequential.11.norm.weight",
                "sequential.11.norm.bias",
            ]
        );
    }
}
