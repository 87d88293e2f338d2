//! The model families a converter may meet (language model, image
//! classifier), each held as its typed config (`config.json`, told apart by
//! `architecture`), and the probe logits of each, so that grow and export
//! check any model the same way.

use std::path::Path;

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use serde_json::Value;
use tokenformer::loader::{self, ModelFiles};
use tokenformer::models::block::ScaleTokens;
use tokenformer::models::vit::{self, VisionTransformer};
use tokenformer::models::{lm, vl, ModelConfig};
use tokenformer::pattention::Activation;

use crate::probe;

#[derive(Clone, Debug)]
pub enum Family {
    Language(lm::Config),
    Vision(vit::Config),
}

impl Family {
    /// The config of the model named `source`, read from `path`: a language model or an
    /// image classifier, validated (before anything is written).
    pub fn of(config: &Value, source: &str, path: &Path) -> Result<Self> {
        let named = loader::architecture(config);
        if named.is_empty() {
            bail!("{source}: config has no `architecture`");
        }
        match typed(config, path, &[lm::ARCHITECTURE, vit::ARCHITECTURE])? {
            Some(ModelConfig::Lm(c)) => Ok(Self::Language(c)),
            Some(ModelConfig::Vit(c)) => Ok(Self::Vision(c)),
            _ => bail!(
                "{source}: architecture `{named}` is not supported here (expected `{}` or `{}`)",
                lm::ARCHITECTURE,
                vit::ARCHITECTURE
            ),
        }
    }

    /// The Hub's pipeline tag for a model card.
    pub fn pipeline_tag(&self) -> &'static str {
        match self {
            Self::Language(_) => pipeline_tag(lm::ARCHITECTURE),
            Self::Vision(_) => pipeline_tag(vit::ARCHITECTURE),
        }
    }

    pub fn describe(&self) -> &'static str {
        match self {
            Self::Language(_) => "language model",
            Self::Vision(_) => "image classifier",
        }
    }

    /// Parameter tokens per Pattention kind (qkv, proj, ffn).
    pub fn token_counts(&self) -> ScaleTokens {
        let (qkv, proj, ffn) = match self {
            Self::Language(c) => (c.qkv_tokens, c.proj_tokens, c.ffn_tokens),
            Self::Vision(c) => (c.qkv_tokens, c.proj_tokens, c.ffn_tokens),
        };
        ScaleTokens { qkv, proj, ffn }
    }

    /// The √n constants the model runs with: `pattention_scale_tokens`, or the counts.
    pub fn scale_constants(&self) -> ScaleTokens {
        let stored = match self {
            Self::Language(c) => c.pattention_scale_tokens,
            Self::Vision(c) => c.pattention_scale_tokens,
        };
        stored.unwrap_or_else(|| self.token_counts())
    }

    pub fn activation(&self) -> Activation {
        match self {
            Self::Language(c) => c.pattention_activation,
            Self::Vision(c) => c.pattention_activation,
        }
    }

    /// (hidden_size, num_layers, num_heads).
    pub fn shape(&self) -> (usize, usize, usize) {
        match self {
            Self::Language(c) => (c.hidden_size, c.num_layers, c.num_heads),
            Self::Vision(c) => (c.hidden_size, c.num_layers, c.num_heads),
        }
    }

    /// Loads the model (f32 compute) and returns its logits on the probe input.
    pub fn probe_logits(&self, files: &ModelFiles, device: &Device) -> Result<Tensor> {
        match self {
            Self::Language(_) => probe::lm_logits(&loader::load_lm(files, device)?),
            Self::Vision(_) => vit_logits(&loader::load_vit(files, device)?),
        }
    }
}

/// `config` (read from `path`) parsed and validated when it names one of the
/// `expected` architectures; None when it names another (or none), so the caller words
/// the refusal. A config of an expected architecture that does not validate is an
/// error naming `path`.
pub fn typed(config: &Value, path: &Path, expected: &[&str]) -> Result<Option<ModelConfig>> {
    match ModelConfig::from_value(config, path) {
        Ok(c) if expected.contains(&c.architecture()) => Ok(Some(c)),
        Err(e) if expected.contains(&loader::architecture(config)) => Err(e.into()),
        _ => Ok(None),
    }
}

/// The Hub's pipeline tag of an architecture (a language model's for any other).
pub fn pipeline_tag(architecture: &str) -> &'static str {
    match architecture {
        vit::ARCHITECTURE => "image-classification",
        vl::ARCHITECTURE => "image-text-to-text",
        _ => "text-generation",
    }
}

/// Class logits \[num_classes\] of an image classifier on the probe image.
fn vit_logits(model: &VisionTransformer) -> Result<Tensor> {
    let cfg = model.config();
    let pixels = probe::probe_pixels(1, cfg.num_channels, cfg.image_size, model.device())?;
    Ok(model.forward(&pixels)?.squeeze(0)?)
}
