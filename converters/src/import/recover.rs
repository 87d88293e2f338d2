//! `--recover-steps N`: after mapping and fitting, the import is trained to behave
//! like its source on the calibration data by the library's recovery
//! ([`tokenformer::source::recover`], which `tokenformer train --distill-from` runs
//! too); here its flags, its progress bar and its part of the report.

use anyhow::Result;
use serde::Serialize;
use tokenformer::source::recover::{self as lib, Flags, Log, Recovery, StepProgress};

use super::args::ImportArgs;
use super::fidelity::{AgreementChange, EndToEnd};

/// The recovery `--recover-steps` and its settings ask for, checked; None without it.
pub fn from_args(a: &ImportArgs) -> Result<Option<Recovery>> {
    let Some(steps) = a.recover_steps else {
        return Ok(None);
    };
    let rec = Recovery {
        steps,
        lr: a.recover_lr,
        hidden_weight: a.hidden_weight,
        batch_size: a.recover_batch_size,
    };
    rec.check(&Flags {
        steps: "--recover-steps",
        lr: "--recover-lr",
        hidden_weight: "--hidden-weight",
        batch_size: "--recover-batch-size",
    })?;
    Ok(Some(rec))
}

/// A progress bar on stderr for `steps` steps, and the callback that moves it.
pub fn bar(steps: u64) -> (indicatif::ProgressBar, impl FnMut(&StepProgress)) {
    let bar = crate::progress::bar(
        steps,
        "recovering {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
    );
    let b = bar.clone();
    (bar, move |p: &StepProgress| {
        b.set_message(p.message());
        b.set_position(p.step);
    })
}

/// Says what the recovery did, on stderr.
pub fn say(rec: &Recovery, log: &Log) {
    eprintln!(
        "recovered in {} steps ({:.1} s): distillation loss {:.4} -> {:.4}, on the eval data {:.4}",
        rec.steps, log.seconds, log.first_loss, log.final_loss, log.final_eval_loss
    );
}

/// What a recovery did, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct RecoveryReport {
    pub method: String,
    pub steps: u64,
    pub lr: f64,
    pub hidden_weight: f64,
    /// Windows (text) or images per step.
    pub batch_size: usize,
    /// Tokens per window (text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<usize>,
    /// The training views of the calibration photos (images).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub augmentation: Option<String>,
    /// The distillation loss of the first and the last step, and on the eval data at
    /// the end (KL + weight · hidden term; `metrics.jsonl` has every step).
    pub first_loss: f64,
    pub final_loss: f64,
    pub final_eval_loss: f64,
    pub seconds: f64,
    /// The import recovery started from (fitted, or mapped with `--fit none`), end to
    /// end on the eval data (`end_to_end` is the recovered, written model's).
    pub before_end_to_end: EndToEnd,
    /// Recovered minus before-recovery agreement on the same items, with its 95 % interval.
    pub top1_change: RecoveryChange,
}

/// How recovery changed top-1 (next-token) agreement on the same eval items.
#[derive(Clone, Debug, Serialize)]
pub struct RecoveryChange {
    pub change: f64,
    /// Newcombe's score interval for paired proportions (see [`AgreementChange`]).
    pub change_95: [f64; 2],
    /// Items where only the recovered import agrees with the source, and only the one before.
    pub recovered_only: usize,
    pub before_only: usize,
}

impl From<AgreementChange> for RecoveryChange {
    /// A paired change measured with the recovered import as the new model.
    fn from(c: AgreementChange) -> Self {
        Self {
            change: c.change,
            change_95: c.change_95,
            recovered_only: c.fitted_only,
            before_only: c.mapped_only,
        }
    }
}

impl RecoveryReport {
    pub fn new(
        rec: &Recovery,
        log: &Log,
        seq_len: Option<usize>,
        before: EndToEnd,
        change: AgreementChange,
    ) -> Self {
        let images = seq_len.is_none();
        Self {
            method: rec.describe(),
            steps: rec.steps,
            lr: rec.lr,
            hidden_weight: rec.hidden_weight,
            batch_size: rec.batch_size,
            seq_len,
            augmentation: images.then(lib::describe_augmentation),
            first_loss: log.first_loss,
            final_loss: log.final_loss,
            final_eval_loss: log.final_eval_loss,
            seconds: log.seconds,
            before_end_to_end: before,
            top1_change: change.into(),
        }
    }
}
