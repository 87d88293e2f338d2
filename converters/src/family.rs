//! The model families a converter may meet (language model, image
//! classifier), told apart by `config.json`'s `architecture`, and the probe
//! logits of each, so that grow and export check any model the same way.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use serde_json::Value;
use tokenformer::loader::{self, ModelFiles};
use tokenformer::models::tokenformer as lm;
use tokenformer::models::vit::{self, VisionTransformer};

use crate::probe;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Language,
    Vision,
}

impl Family {
    pub fn of(config: &Value, origin: &str) -> Result<Self> {
        match loader::architecture(config) {
            lm::ARCHITECTURE => Ok(Self::Language),
            vit::ARCHITECTURE => Ok(Self::Vision),
            "" => bail!("{origin}: config has no `architecture`"),
            other => bail!(
                "{origin}: architecture `{other}` is not supported here (expected `{}` or `{}`)",
                lm::ARCHITECTURE,
                vit::ARCHITECTURE
            ),
        }
    }

    /// The Hub's pipeline tag for a model card.
    pub fn pipeline_tag(self) -> &'static str {
        match self {
            Self::Language => "text-generation",
            Self::Vision => "image-classification",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Language => "language model",
            Self::Vision => "image classifier",
        }
    }

    /// Checks the config against the architecture (before anything is written).
    pub fn validate(self, config: &Value, origin: &std::path::Path) -> Result<()> {
        match self {
            Self::Language => {
                loader::lm_config(config, origin)?;
            }
            Self::Vision => {
                loader::vit_config(config, origin)?;
            }
        }
        Ok(())
    }

    /// Loads the model (f32 compute) and returns its logits on the probe input.
    pub fn probe_logits(self, files: &ModelFiles, device: &Device) -> Result<Tensor> {
        match self {
            Self::Language => probe::lm_logits(&loader::load_lm(files, device)?),
            Self::Vision => vit_logits(&loader::load_vit(files, device)?),
        }
    }
}

/// Class logits [num_classes] of an image classifier on the probe image.
fn vit_logits(model: &VisionTransformer) -> Result<Tensor> {
    let cfg = model.config();
    let pixels = probe::probe_pixels(1, cfg.num_channels, cfg.image_size, model.device())?;
    Ok(model.forward(&pixels)?.squeeze(0)?)
}
