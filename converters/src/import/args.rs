//! `tokenformer-convert import`'s command line.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::args::FolderOut;

/// Source architectures `import` understands.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum SourceFamily {
    /// GPT-NeoX / Pythia causal LMs (transformers layout).
    GptNeox,
    /// ViT image classifiers (transformers `ViTForImageClassification` or timm layout).
    Vit,
}

/// What `import` fits on the calibration data beyond the mapping's scales.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum FitMode {
    /// The analytic mapping only (keys and values from the source's weights).
    None,
    /// Keep the mapped keys, solve every Pattention's value tokens by ridge least
    /// squares on the calibration data, layer by layer.
    Values,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// Source architecture.
    #[arg(long, value_enum)]
    pub from: SourceFamily,
    /// A folder with config.json and model.safetensors / pytorch_model.bin, or a Hub repo id.
    #[arg(long)]
    pub input: String,
    #[command(flatten)]
    pub out: FolderOut,
    /// Text the fitted constants are calibrated on (language models): a UTF-8 file;
    /// default: a page of the King James Bible shipped with the tool.
    #[arg(long, value_name = "FILE")]
    pub calibration_text: Option<PathBuf>,
    /// Held-out text the report measures on (perplexity of source and import,
    /// agreement); default: another shipped page.
    #[arg(long, value_name = "FILE", conflicts_with = "probe_text")]
    pub eval_text: Option<PathBuf>,
    /// The eval text given literally instead of as a file.
    #[arg(long, value_name = "TEXT")]
    pub probe_text: Option<String>,
    /// A tokenizer.json for the text (default: the source folder's).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Photos the fitted constants are calibrated on (classifiers): a folder, searched
    /// recursively; default: photos shipped with the tool.
    #[arg(long, value_name = "DIR")]
    pub calibration_images: Option<PathBuf>,
    /// Held-out photos the report measures on (top-1 agreement, KL, logit error);
    /// default: other shipped photos. Each is preprocessed as the source's own
    /// processor does (and as `classify` will).
    #[arg(long, value_name = "DIR", conflicts_with = "probe_pixels")]
    pub eval_images: Option<PathBuf>,
    /// Eval images already preprocessed: a .safetensors file with a tensor
    /// `pixels` [n, 3, H, W] (never used for calibration).
    #[arg(long, value_name = "FILE")]
    pub probe_pixels: Option<PathBuf>,
    /// `values`: solve each Pattention's value tokens by ridge least squares on the
    /// calibration data, layer by layer on the import's own activations (its keys
    /// stay as mapped); `none`: the analytic mapping only.
    #[arg(long, value_enum, default_value = "values")]
    pub fit: FitMode,
    /// After mapping and fitting, train the import N AdamW steps to match the source on
    /// the calibration data (distillation: KL of the outputs plus --hidden-weight × the
    /// per-layer hidden-state MSE; photos as light random-resized crops and flips).
    /// Writes metrics.jsonl and loss.png with the model.
    #[arg(long, value_name = "N")]
    pub recover_steps: Option<u64>,
    /// Peak learning rate of --recover-steps (10% warm-up, cosine to a tenth).
    #[arg(
        long,
        value_name = "LR",
        default_value_t = 1e-3,
        requires = "recover_steps"
    )]
    pub recover_lr: f64,
    /// Weight of the hidden-state term of --recover-steps: each layer's MSE relative to
    /// the source's mean square there, averaged over layers (0: logits only).
    #[arg(
        long,
        value_name = "W",
        default_value_t = 1.0,
        requires = "recover_steps"
    )]
    pub hidden_weight: f64,
    /// Text windows or photos per --recover-steps step.
    #[arg(
        long,
        value_name = "B",
        default_value_t = 8,
        requires = "recover_steps"
    )]
    pub recover_batch_size: usize,
}
