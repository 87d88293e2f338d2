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
    /// Text to measure fidelity on (language models; default: a fixed English paragraph).
    #[arg(long)]
    pub probe_text: Option<String>,
    /// Normalised images to measure fidelity on (classifiers): a .safetensors file with a
    /// tensor `pixels` [n, 3, H, W]; default: seeded synthetic images.
    #[arg(long)]
    pub probe_pixels: Option<PathBuf>,
}
