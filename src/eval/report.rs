//! What every kind of evaluation result provides so that `eval merge`
//! ([`super::merge`]) can check and combine the shards of one run the same
//! way, and the checks the kinds share.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

/// What a language-model report records about its run besides the
/// options: the model as resolved, the data and the time taken.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// The model as resolved (`repo@revision` or a path).
    pub model: String,
    /// The Hub commit the model's files come from (none for a local folder).
    pub model_commit: Option<String>,
    /// The weight dtype the model was loaded in (`f32`, `f16`, `q8`).
    pub weight_dtype: Option<String>,
    /// Where it ran (`cpu`, `cuda:0`: [`crate::device::device_name`]).
    pub device: String,
    /// The data file as given.
    pub data: String,
    /// sha256 of the data file.
    pub data_sha256: String,
    /// Window length (tokens per input).
    pub max_length: usize,
    /// Seconds of evaluation.
    pub elapsed_seconds: f64,
}

/// A setting that every shard of one run has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// Its name in errors.
    pub what: &'static str,
    /// What is compared (the value in Rust's debug notation).
    pub value: String,
    /// How errors show the value.
    pub shown: String,
}

impl Setting {
    /// A setting shown as it is compared.
    pub fn new(what: &'static str, value: impl std::fmt::Debug) -> Self {
        let value = format!("{value:?}");
        Self {
            what,
            shown: value.clone(),
            value,
        }
    }

    /// A setting shown as `shown`.
    pub fn shown_as(what: &'static str, value: impl std::fmt::Debug, shown: String) -> Self {
        Self {
            what,
            value: format!("{value:?}"),
            shown,
        }
    }
}

/// A kind of evaluation result that shards of one run can be merged into.
pub trait Report: Clone + Serialize + DeserializeOwned {
    /// The `kind` field of this result.
    const KIND: &'static str;

    /// The `kind` field as read.
    fn kind(&self) -> &str;

    /// The parts (`I/N`) of the run this result covers, or why it is not a
    /// shard result.
    fn shards(&self) -> std::result::Result<Vec<&str>, String>;

    /// The settings every shard of one run has, in the order they are
    /// compared.
    fn settings(&self) -> Vec<Setting>;

    /// Checks that the counts of result `i` (0-based) are possible.
    fn check_counts(&self, i: usize) -> Result<()>;

    /// The whole run's result from the checked results of its `n` shards.
    fn combine(parts: &[Self], n: usize) -> Result<Self>;

    /// The result as written to a file: its fields, plus whatever else the
    /// kind writes next to them (lm-evaluation-harness's or timm's layout).
    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("serialisable")
    }

    /// How errors name result `i` (0-based).
    fn label(i: usize) -> String {
        format!("result #{}", i + 1)
    }

    /// The error for result `i` that does not parse as this kind.
    fn parse_error(i: usize, e: serde_json::Error) -> Error {
        Error::input(format!("result #{} is not a valid result file: {e}", i + 1))
    }

    /// The error for result `i` of another kind.
    fn wrong_kind(_i: usize, _kind: &str) -> Error {
        Error::input(format!("not a {} result", Self::KIND))
    }

    /// The error for a setting of result `i` that differs from result #1's.
    fn differs(i: usize, what: &str, this: &str, first: &str) -> Error {
        Error::input(format!(
            "cannot merge: result #{} differs from result #1 in {what}: {this} vs {first} \
             (shards of different runs)",
            i + 1
        ))
    }
}

/// `shard` of a pile or tasks result: a merged one is not merged again.
pub(crate) fn one_shard(shard: &Option<String>) -> std::result::Result<Vec<&str>, String> {
    match shard {
        Some(s) => Ok(vec![s]),
        None => Err("not from a sharded run (or already merged)".into()),
    }
}

/// The settings of a language-model run that every shard shares first:
/// the model, its commit, the weight dtype and the data.
pub(crate) fn run_settings(
    model: &str,
    commit: &Option<String>,
    dtype: &Option<String>,
    data_sha256: &str,
) -> [Setting; 4] {
    [
        Setting::new("model", model),
        Setting::new("model commit", commit),
        Setting::new("weight dtype", dtype),
        Setting::new("data_sha256", data_sha256),
    ]
}

/// The devices of merged shards: each once, in order, comma-separated (`cuda:0,cuda:1`
/// for a run split over two GPUs); `None` if a shard did not record its own.
pub(crate) fn merged_devices<'a>(devices: impl Iterator<Item = Option<&'a str>>) -> Option<String> {
    let mut seen: Vec<&str> = Vec::new();
    for d in devices {
        let d = d?;
        if !seen.contains(&d) {
            seen.push(d);
        }
    }
    Some(seen.join(","))
}

/// A log-likelihood as a run can produce it: finite and not positive.
pub(crate) fn check_loglikelihood(i: usize, what: &str, ll: f64) -> Result<()> {
    if !(ll.is_finite() && ll <= 0.0) {
        return Err(Error::input(format!(
            "result #{}: impossible {what} log-likelihood {ll} (a sum of log-probabilities is finite and <= 0)",
            i + 1
        )));
    }
    Ok(())
}

pub(crate) fn check_seconds(i: usize, s: f64) -> Result<()> {
    if !(s.is_finite() && s >= 0.0) {
        return Err(Error::input(format!(
            "result #{}: impossible elapsed_seconds {s}",
            i + 1
        )));
    }
    Ok(())
}

/// The error for counts whose sum overflows (counts come from files).
pub(crate) fn overflow() -> Error {
    Error::input("the shards' counts overflow")
}

/// Sums counts, refusing an overflow.
pub(crate) fn add_checked(total: &mut u64, x: u64) -> Result<()> {
    *total = total.checked_add(x).ok_or_else(overflow)?;
    Ok(())
}
