//! Zero-shot tasks of the TokenFormer paper's Table 1, formatted and scored
//! as lm-evaluation-harness does
//! (<https://github.com/EleutherAI/lm-evaluation-harness>, `lm_eval/tasks/`
//! {lambada/lambada_openai, hellaswag, piqa, arc, winogrande} and
//! `TemplateLM._encode_pair` / `loglikelihood`): the same prompts, the
//! same context/continuation token split, `acc` = argmax of summed
//! log-likelihood, `acc_norm` = argmax of log-likelihood / characters of the
//! choice, the stderr of a mean as the harness's `mean_stderr`.
//!
//! Input is each task's public JSONL, in the original release or the Hugging
//! Face `datasets` export ([`Task::fields`]).

mod format;
mod report;
mod run;

pub use format::*;
pub use report::*;
pub use run::*;

// Kept here too for callers that found it in this module before the split.
pub use super::pytext::py_capitalize;
