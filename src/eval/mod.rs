//! Evaluations of the models on benchmark data; each returns a serde result
//! that `tokenformer eval merge` can combine across `--shard`s.
pub mod imagenet;
