//! `tokenformer-convert import`: a pre-trained Transformer (Hugging Face
//! GPT-NeoX/Pythia or ViT, safetensors or .bin, with `config.json`) → a
//! TokenFormer of the same width, depth and heads, as the paper's
//! "initialise a TokenFormer from a pre-trained Transformer" suggests
//! (<https://arxiv.org/abs/2410.23168>, Sections 3 and 4).
//!
//! Embeddings, patch embedding, class token, position embedding, final norms
//! and output heads are copied as they are. Every linear layer becomes a
//! Pattention layer by the mapping documented on [`mapping::Mapping`]; the MLP uses the
//! key-value-memory reading of Geva et al. 2021 (<https://arxiv.org/abs/2012.14913>):
//! keys = rows of W_in, values = columns of W_out. The tool runs the source
//! model (a plain candle forward, [`tokenformer::source`]) on calibration data to fit the one
//! constant per layer the mapping cannot copy and, by default, every Pattention's
//! value tokens by least squares, layer by layer ([`fit`]), with `--recover-steps`
//! trains it to match the source by distillation ([`recover`], the library's
//! [`tokenformer::source::recover`]), then runs the source and the
//! import on held-out eval data ([`data`]: the user's, or real samples shipped
//! with the tool, [`tokenformer::source::data`]) and reports per-layer ([`mapping`]: which parts are exact, under
//! what condition) and end-to-end ([`fidelity`]) fidelity. One importer per
//! source family: [`gpt_neox`], [`vit`].

mod args;
mod data;
mod fidelity;
mod fit;
mod gpt_neox;
mod linalg;
mod mapping;
mod recover;
mod vit;

use anyhow::Result;

pub use args::ImportArgs;
use args::SourceFamily;
use tokenformer::source::{locate_input, RawCheckpoint};

use crate::output::check_not_input;

pub fn run(a: ImportArgs) -> Result<()> {
    let dir = locate_input(&a.input, "--input", Some(&crate::progress::download_bars()))?;
    check_not_input(&a.out.out, &dir)?;
    let mut raw = RawCheckpoint::read(&dir)?;
    match a.from {
        SourceFamily::GptNeox => gpt_neox::import(&a, &mut raw),
        SourceFamily::Vit => vit::import(&a, &mut raw),
    }
}
