//! Evaluations: Pile perplexity, the zero-shot language tasks, ImageNet
//! top-1/top-5, and merging the results of `--shard` runs. Each returns a
//! serde result with a `kind` that `tokenformer eval merge` dispatches on.

pub mod imagenet;
pub mod merge;
pub mod pile;
pub mod tasks;
