//! Model families, one module each, in the style of candle-transformers, and
//! the typed config that tells them apart.
pub mod config;
pub mod tokenformer;
pub mod vit;
pub mod vl;

pub use config::{Architecture, ModelConfig, ARCHITECTURES};
