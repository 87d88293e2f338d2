//! Model families, one module each, in the style of candle-transformers.
pub mod tokenformer;
pub mod vit;
pub mod vl;
