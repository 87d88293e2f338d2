//! The typed `config.json`: [`ModelConfig`], one variant per architecture,
//! told apart by the `architecture` key, and the [`Architecture`] trait that
//! ties each model type to its config and constructor.
//!
//! Each variant's config also reads and writes the `architecture` key on its
//! own (first, as it always was), so a `tokenformer::Config` serialised alone
//! is a loadable `config.json`, and a merged model's config keeps its
//! sources' architectures. Reading one alone checks the key.

use std::path::Path;

use candle_nn::VarBuilder;
use serde::{de::DeserializeOwned, Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::models::lm::{self, TokenFormerLm};
use crate::models::vit::{self, VisionTransformer};
use crate::models::vl::{self, VisionLanguageModel};

/// A model folder's `config.json`, by its `architecture`.
// One config per load: a box would only make the variants awkward to match.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "architecture")]
pub enum ModelConfig {
    /// `tokenformer-lm`: the causal language model.
    #[serde(rename = "tokenformer-lm")]
    Lm(#[serde(deserialize_with = "lm::Config::deserialize")] lm::Config),
    /// `tokenformer-vit`: the image classifier.
    #[serde(rename = "tokenformer-vit")]
    Vit(#[serde(deserialize_with = "vit::Config::deserialize")] vit::Config),
    /// `tokenformer-vl`: the merged vision-language model.
    #[serde(rename = "tokenformer-vl")]
    Vl(#[serde(deserialize_with = "vl::Config::deserialize")] vl::Config),
}

/// Every architecture name, in the order of [`ModelConfig`]'s variants.
pub const ARCHITECTURES: [&str; 3] = [lm::ARCHITECTURE, vit::ARCHITECTURE, vl::ARCHITECTURE];

impl ModelConfig {
    /// The `architecture` value (`tokenformer-lm`, ...).
    pub fn architecture(&self) -> &'static str {
        match self {
            Self::Lm(_) => lm::ARCHITECTURE,
            Self::Vit(_) => vit::ARCHITECTURE,
            Self::Vl(_) => vl::ARCHITECTURE,
        }
    }

    /// Parses and validates a config read from `origin` (named in every
    /// error, with the architecture found when it is missing or unknown).
    pub fn from_value(value: &Value, origin: &Path) -> Result<Self> {
        match value.get("architecture") {
            Some(Value::String(a)) if ARCHITECTURES.contains(&a.as_str()) => {}
            found => {
                let found = match found {
                    None => "no `architecture`".to_string(),
                    Some(Value::String(a)) => format!("architecture `{a}`"),
                    Some(v) => format!("architecture {v}"),
                };
                return Err(Error::config(
                    origin,
                    format!("{found}: expected one of `{}`", ARCHITECTURES.join("`, `")),
                ));
            }
        }
        let cfg = Self::deserialize(value).map_err(|e| Error::config(origin, e))?;
        cfg.validate().map_err(|e| Error::config(origin, e))?;
        Ok(cfg)
    }

    /// The variant's own checks (ranges, divisibility, list lengths).
    pub fn validate(&self) -> std::result::Result<(), String> {
        match self {
            Self::Lm(c) => c.validate(),
            Self::Vit(c) => c.validate(),
            Self::Vl(c) => c.validate(),
        }
    }
}

impl Serialize for ModelConfig {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        // Each config writes its own `architecture` first.
        match self {
            Self::Lm(c) => c.serialize(s),
            Self::Vit(c) => c.serialize(s),
            Self::Vl(c) => c.serialize(s),
        }
    }
}

impl From<lm::Config> for ModelConfig {
    fn from(c: lm::Config) -> Self {
        Self::Lm(c)
    }
}
impl From<vit::Config> for ModelConfig {
    fn from(c: vit::Config) -> Self {
        Self::Vit(c)
    }
}
impl From<vl::Config> for ModelConfig {
    fn from(c: vl::Config) -> Self {
        Self::Vl(c)
    }
}

macro_rules! try_from_model_config {
    ($module:ident, $variant:ident) => {
        impl TryFrom<ModelConfig> for $module::Config {
            /// The config, when it is of another architecture.
            type Error = ModelConfig;
            fn try_from(c: ModelConfig) -> std::result::Result<Self, ModelConfig> {
                match c {
                    ModelConfig::$variant(c) => Ok(c),
                    other => Err(other),
                }
            }
        }
    };
}
try_from_model_config!(lm, Lm);
try_from_model_config!(vit, Vit);
try_from_model_config!(vl, Vl);

/// Serde for one variant's config alone: written tagged, read through
/// [`ModelConfig`] so that a wrong `architecture` is refused by name.
macro_rules! tagged_serde {
    ($module:ident, $variant:ident) => {
        impl Serialize for $module::Config {
            fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                // The derived (remote = "Self") serialiser, which writes the tag first.
                $module::Config::serialize(self, s)
            }
        }
        impl<'de> Deserialize<'de> for $module::Config {
            fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                match ModelConfig::deserialize(d)? {
                    ModelConfig::$variant(c) => Ok(c),
                    other => Err(serde::de::Error::custom(format!(
                        "architecture is `{}`, expected `{}`",
                        other.architecture(),
                        $module::ARCHITECTURE
                    ))),
                }
            }
        }
    };
}
tagged_serde!(lm, Lm);
tagged_serde!(vit, Vit);
tagged_serde!(vl, Vl);

/// A model type with its config type and constructor, so that one generic
/// loader builds them all.
pub trait Architecture: Sized {
    /// The config this model is built from.
    type Config: Clone
        + std::fmt::Debug
        + Serialize
        + DeserializeOwned
        + Into<ModelConfig>
        + TryFrom<ModelConfig, Error = ModelConfig>;
    /// The `architecture` value of its `config.json`.
    const ARCHITECTURE: &'static str;
    /// What it is, for errors: "a language model".
    const WHAT: &'static str;

    /// Builds the model from its config and weights (validating the config first).
    fn new(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self>;

    /// The config it was built from.
    fn config(&self) -> &Self::Config;

    /// Builds the model from a checkpoint whose config is `cfg`: one of this
    /// architecture, or (overridden) one this model is a part of. `None` when
    /// `cfg` holds no such model.
    fn from_model_config(cfg: &ModelConfig, vb: VarBuilder) -> Option<candle_core::Result<Self>>;

    /// Tensor names (by prefix) that [`Self::from_model_config`] leaves
    /// unused on purpose: the other half of a merged checkpoint.
    fn unused_prefix(_cfg: &ModelConfig) -> Option<&'static str> {
        None
    }
}

impl Architecture for TokenFormerLm {
    type Config = lm::Config;
    const ARCHITECTURE: &'static str = lm::ARCHITECTURE;
    const WHAT: &'static str = "a language model";
    fn new(cfg: &lm::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        TokenFormerLm::new(cfg, vb)
    }
    fn config(&self) -> &lm::Config {
        TokenFormerLm::config(self)
    }
    /// Text-only input to a merged model is its language route.
    fn from_model_config(cfg: &ModelConfig, vb: VarBuilder) -> Option<candle_core::Result<Self>> {
        match cfg {
            ModelConfig::Lm(c) => Some(Self::new(c, vb)),
            ModelConfig::Vl(c) => Some(vl::language_route(c, vb)),
            ModelConfig::Vit(_) => None,
        }
    }
    fn unused_prefix(cfg: &ModelConfig) -> Option<&'static str> {
        matches!(cfg, ModelConfig::Vl(_)).then_some("vision.")
    }
}

impl Architecture for VisionTransformer {
    type Config = vit::Config;
    const ARCHITECTURE: &'static str = vit::ARCHITECTURE;
    const WHAT: &'static str = "an image classifier";
    fn new(cfg: &vit::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        VisionTransformer::new(cfg, vb)
    }
    fn config(&self) -> &vit::Config {
        VisionTransformer::config(self)
    }
    /// Image-only input to a merged model is its vision route.
    fn from_model_config(cfg: &ModelConfig, vb: VarBuilder) -> Option<candle_core::Result<Self>> {
        match cfg {
            ModelConfig::Vit(c) => Some(Self::new(c, vb)),
            ModelConfig::Vl(c) => Some(vl::vision_route(c, vb)),
            ModelConfig::Lm(_) => None,
        }
    }
    fn unused_prefix(cfg: &ModelConfig) -> Option<&'static str> {
        matches!(cfg, ModelConfig::Vl(_)).then_some("language.")
    }
}

impl Architecture for VisionLanguageModel {
    type Config = vl::Config;
    const ARCHITECTURE: &'static str = vl::ARCHITECTURE;
    const WHAT: &'static str = "a vision-language model";
    fn new(cfg: &vl::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        VisionLanguageModel::new(cfg, vb)
    }
    fn config(&self) -> &vl::Config {
        VisionLanguageModel::config(self)
    }
    fn from_model_config(cfg: &ModelConfig, vb: VarBuilder) -> Option<candle_core::Result<Self>> {
        match cfg {
            ModelConfig::Vl(c) => Some(Self::new(c, vb)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_round_trip_with_the_tag_first() {
        let c = lm::Config::released(2, 32, 2);
        let text = serde_json::to_string(&c).unwrap();
        assert!(text.starts_with(r#"{"architecture":"tokenformer-lm","hidden_size":32,"#));
        assert_eq!(serde_json::from_str::<lm::Config>(&text).unwrap(), c);
        let m: ModelConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(m, ModelConfig::Lm(c.clone()));
        assert_eq!(serde_json::to_string(&m).unwrap(), text);
        let v = vit::Config::imagenet(2, 32, 2, 8, 16);
        let merged = vl::Config::merged(&v, &c, 4).unwrap();
        let text = serde_json::to_string(&merged).unwrap();
        assert!(text.starts_with(
            r#"{"architecture":"tokenformer-vl","vision":{"architecture":"tokenformer-vit","#
        ));
        assert!(text.contains(r#""language":{"architecture":"tokenformer-lm","#));
        assert_eq!(serde_json::from_str::<vl::Config>(&text).unwrap(), merged);
    }

    #[test]
    fn block_and_preprocessing_options_are_written_only_when_set() {
        let mut c = lm::Config::released(2, 32, 2);
        assert!(!serde_json::to_string(&c)
            .unwrap()
            .contains("parallel_residual"));
        c.parallel_residual = true;
        let text = serde_json::to_string(&c).unwrap();
        assert!(text.ends_with(r#","parallel_residual":true}"#), "{text}");
        assert_eq!(serde_json::from_str::<lm::Config>(&text).unwrap(), c);
        let mut v = vit::Config::imagenet(2, 32, 2, 8, 16);
        assert!(!serde_json::to_string(&v).unwrap().contains("resize_mode"));
        v.resize_mode = vit::ResizeMode::Squash;
        let text = serde_json::to_string(&v).unwrap();
        assert!(text.contains(r#""resize_mode":"squash""#), "{text}");
        assert_eq!(serde_json::from_str::<vit::Config>(&text).unwrap(), v);
    }

    #[test]
    fn a_wrong_or_missing_architecture_is_named() {
        let mut v = serde_json::to_value(lm::Config::released(2, 32, 2)).unwrap();
        let e = serde_json::from_value::<vit::Config>(v.clone()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "architecture is `tokenformer-lm`, expected `tokenformer-vit`"
        );
        v["architecture"] = "tokenformer-xl".into();
        let e = ModelConfig::from_value(&v, Path::new("m/config.json")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("config m/config.json: architecture `tokenformer-xl`"),
            "{e}"
        );
        v.as_object_mut().unwrap().remove("architecture");
        let e = ModelConfig::from_value(&v, Path::new("m/config.json")).unwrap_err();
        assert!(e.to_string().contains("no `architecture`"), "{e}");
        v["architecture"] = "tokenformer-lm".into();
        v["num_heads"] = 5.into();
        let e = ModelConfig::from_value(&v, Path::new("m/config.json")).unwrap_err();
        assert!(e.to_string().contains("not divisible"), "{e}");
    }
}
