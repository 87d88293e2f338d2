//! TokenFormer on candle: the Pattention layer, the TokenFormer language model
//! and image classifier, checkpoint IO, Hub download, the model zoo and
//! evaluation. Paper: <https://arxiv.org/abs/2410.23168>; official code:
//! <https://github.com/Haiyang-W/TokenFormer>.
//!
//! Start with [`LanguageModel`], [`ImageClassifier`] and [`ImageTextModel`]: a
//! model and its tokenizer or preprocessing, loaded by name as `from_pretrained` does in
//! Hugging Face transformers (the README's "Library" section has a runnable
//! example):
//!
//! ```
//! use tokenformer::{LanguageModel, PretrainedOptions};
//!
//! let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
//! let opts = PretrainedOptions {
//!     tokenizer: Some(format!("{fixtures}/gpt-neox-20b-tokenizer.json").into()),
//!     ..Default::default()
//! };
//! let lm = LanguageModel::from_pretrained(&format!("{fixtures}/official-lm-tiny"), &opts)?;
//! let score = lm.score("Hello, world")?;
//! println!("perplexity {:.2}", score.perplexity);
//! # Ok::<(), tokenformer::Error>(())
//! ```
//!
//! [`loader`] loads any architecture by its [`ModelConfig`]; [`hub`],
//! [`eval`], [`vision`] and [`checkpoint`] are the pieces the command line
//! is made of; [`source`] reads and runs the pre-trained Transformers that
//! `tokenformer-convert import` maps and `train --distill-from` distills towards.

pub mod alloc;
pub mod card;
pub mod checkpoint;
pub mod device;
pub mod error;
pub mod eval;
pub mod fsutil;
pub mod generate;
pub mod grow;
pub mod hub;
pub mod init;
pub mod kernels;
pub mod loader;
pub mod models;
pub mod pattention;
pub mod pretrained;
pub mod probe;
pub mod scoring;
pub mod source;
pub mod synthetic;
pub mod train;
pub mod vision;
pub mod zoo;

pub use device::{ComputeDtype, DeviceError, DeviceSpec};
pub use error::{Error, Result};
pub use eval::imagenet::Prediction;
pub use generate::{FinishReason, Generation, SamplingParams};
pub use hub::HubClient;
pub use models::lm::{KvDtype, TokenFormerLm};
pub use models::vit::VisionTransformer;
pub use models::vl::VisionLanguageModel;
pub use models::{Architecture, ModelConfig};
pub use pretrained::{
    ImageClassifier, ImageTextModel, LanguageModel, PretrainedOptions, WeightPrecision,
};
pub use scoring::SequenceScore;

/// The README's examples, run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
