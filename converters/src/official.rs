//! `tokenformer-convert official`: a released `pytorch_model.bin` (GPT-NeoX
//! pipeline names, fp16) plus its eval yml or zoo config → a canonical model
//! folder (`config.json`, `model.safetensors`, `tokenizer.json`, `README.md`).
//! The name map is `tokenformer::checkpoint::official`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Args;
use serde_json::json;
use tokenformer::card::ModelCard;
use tokenformer::loader::{self, ConfigSource, ModelFiles, Weights};

use crate::args::{FolderOut, Shards, Storage};
use crate::output::{check_not_input, ModelFolder};
use crate::probe;
use crate::stdout::outln;

#[derive(Args, Debug)]
pub struct OfficialArgs {
    /// The official `pytorch_model.bin`.
    #[arg(long)]
    pub input: PathBuf,
    /// Its official eval config (`configs/tokenformer/*_eval.yml`).
    #[arg(long, conflicts_with = "zoo", required_unless_present = "zoo")]
    pub config: Option<PathBuf>,
    /// Or the zoo name whose config it is (e.g. tokenformer-150m).
    #[arg(long)]
    pub zoo: Option<String>,
    /// tokenizer.json to put in the folder (default: the one beside the input, if any).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub out: FolderOut,
    #[command(flatten)]
    pub storage: Storage,
    #[command(flatten)]
    pub shards: Shards,
}

pub fn run(a: OfficialArgs) -> Result<()> {
    if !a.input.is_file() {
        bail!("{}: no such checkpoint file", a.input.display());
    }
    check_not_input(&a.out.out, &a.input)?;
    let (config, base_model) = match (&a.config, &a.zoo) {
        (Some(y), _) => (ConfigSource::OfficialYml(y.clone()), None),
        (None, Some(z)) => {
            let e =
                tokenformer::zoo::find(z).with_context(|| format!("`{z}` is not in the zoo"))?;
            let base = e.weights.as_ref().map(|w| w.repo.clone());
            (
                ConfigSource::Json {
                    path: None,
                    value: e.config.clone(),
                },
                base,
            )
        }
        (None, None) => unreachable!("clap requires one"),
    };
    let tokenizer = a.tokenizer.clone().or_else(|| {
        a.input
            .with_file_name(loader::TOKENIZER_FILE)
            .exists()
            .then(|| a.input.with_file_name(loader::TOKENIZER_FILE))
    });
    let source = ModelFiles {
        source: a.input.display().to_string(),
        config,
        weights: Weights::OfficialBin(a.input.clone()),
        tokenizer: tokenizer.clone(),
    };
    let dev = Device::Cpu;
    let w = loader::read_weights(&source, a.storage.dtype(), &dev)?;
    // Validate against the architecture before writing anything.
    let cfg = loader::lm_config(&w.config, &w.path)?;
    if !w.ignored.is_empty() {
        outln!(
            "note: {} tensor(s) of the input have no place in the model and are not copied: {}",
            w.ignored.len(),
            w.ignored.join(", ")
        )?;
    }

    let folder = ModelFolder::new(&a.out.out, a.out.force)?;
    folder.write_config(&w.config)?;
    let n_tensors = w.tensors.len();
    folder.write_weights(&w.tensors, a.shards.max_shard_size)?;
    drop(w);
    folder.copy_tokenizer(tokenizer.as_deref())?;

    let original = loader::load_lm(&source, &dev)?;
    let converted = loader::load_lm(&folder.files()?, &dev)?;
    let diff = probe::max_abs_diff(
        &probe::lm_logits(&original)?,
        &probe::lm_logits(&converted)?,
    )?;
    // Same dtype: the tensors are copied bit for bit, so the logits must agree exactly.
    let tolerance = a.storage.tolerance(0.0);
    probe::require(
        "the official checkpoint and the converted folder",
        diff,
        tolerance,
        "the converted model does not reproduce the original",
    )?;

    let mut card = ModelCard::new(
        format!(
            "TokenFormer LM ({} layers, d {})",
            cfg.num_layers, cfg.hidden_size
        ),
        "text-generation",
    );
    card.set("datasets", json!(["EleutherAI/pile"]));
    if let Some(b) = &base_model {
        card.set("base_model", json!(b));
    }
    card.section(
        "Model",
        format!(
            "A TokenFormer language model (Pattention layers: {} qkv / {} proj / {} ffn parameter tokens, {} heads, context {}), converted from the official release format by `tokenformer-convert official`. Paper: https://arxiv.org/abs/2410.23168",
            cfg.qkv_tokens, cfg.proj_tokens, cfg.ffn_tokens, cfg.num_heads, cfg.max_position_embeddings
        ),
    );
    card.section(
        "Conversion check",
        format!("{n_tensors} tensors; max |Δ logit| against the official checkpoint on a probe input: {diff:.3e}."),
    );
    card.section(
        "Usage",
        "```\ntokenformer generate --model PATH_OR_REPO --prompt \"Hello\"\n```",
    );
    folder.finish_and_say(&card)
}
