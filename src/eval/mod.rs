//! Evaluation: Pile perplexity, the zero-shot language tasks, and merging
//! the results of sharded runs.

pub mod merge;
pub mod pile;
pub mod tasks;
