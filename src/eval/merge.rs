//! `tokenformer eval merge`: combines the `--json` results of `--shard I/N`
//! runs into the numbers of one whole run. Every metric is recomputed from
//! summed counts (log-likelihood, documents, tokens, words, bytes; task
//! counts; images), never averaged, as lm-evaluation-harness aggregates
//! per-document items (<https://github.com/EleutherAI/lm-evaluation-harness>,
//! `lm_eval/api/metrics.py`). Dispatches on the results' `kind`; each kind is
//! a [`Report`], and [`merge`] does the checks once for all of them.
//!
//! Nothing in a result file is trusted: shards must come from one run's
//! settings ([`Report::settings`]), carry possible counts
//! ([`Report::check_counts`]; negative or fractional counts do not parse),
//! and be I/N of one N, each once, all present.

use serde_json::Value;

use super::imagenet::ImagenetResult;
use super::pile::PileReport;
use super::shard::{check_shard_set, Shard};
use super::tasks::TaskReport;
use crate::error::{Error, Result};

pub use super::report::Report;

/// Merges result files (JSON) of one kind (`pile`, `tasks`, `imagenet`).
pub fn merge_results(parts: &[Value]) -> Result<Value> {
    let kind = common_kind(parts)?;
    match kind.as_str() {
        PileReport::KIND => merge_values::<PileReport>(parts),
        TaskReport::KIND if parts.iter().any(|p| p.get("tasks").is_some()) => {
            merge_task_lists(parts)
        }
        TaskReport::KIND => merge_values::<TaskReport>(parts),
        ImagenetResult::KIND => merge_values::<ImagenetResult>(parts),
        other => Err(Error::input(format!(
            "unknown result kind `{other}` (expected pile, tasks or imagenet)"
        ))),
    }
}

/// Merges results of `--tasks a,b,…` runs (our reports under `tasks`) task
/// by task; every result must hold the same tasks.
fn merge_task_lists(parts: &[Value]) -> Result<Value> {
    let lists = parts
        .iter()
        .enumerate()
        .map(|(i, p)| match p.get("tasks") {
            Some(Value::Array(a)) if !a.is_empty() => Ok(a.clone()),
            Some(_) => Err(Error::input(format!(
                "result #{}: `tasks` is not a list of task results",
                i + 1
            ))),
            None => Ok(vec![p.clone()]),
        })
        .collect::<Result<Vec<_>>>()?;
    let names = |l: &[Value]| -> Vec<String> {
        l.iter()
            .map(|t| {
                t.get("task")
                    .and_then(Value::as_str)
                    .unwrap_or("(none)")
                    .to_string()
            })
            .collect()
    };
    let first = names(&lists[0]);
    for (i, l) in lists.iter().enumerate().skip(1) {
        if names(l) != first {
            return Err(Error::input(format!(
                "cannot merge: result #{} holds the tasks {:?}, result #1 {:?} (shards of different runs)",
                i + 1,
                names(l),
                first
            )));
        }
    }
    let mut reports = Vec::new();
    for (t, name) in first.iter().enumerate() {
        let of_task: Vec<TaskReport> = lists
            .iter()
            .enumerate()
            .map(|(i, l)| {
                serde_json::from_value(l[t].clone()).map_err(|e| {
                    Error::input(format!(
                        "result #{}, task {name}: not a valid result: {e}",
                        i + 1
                    ))
                })
            })
            .collect::<Result<_>>()?;
        reports.push(merge(&of_task).map_err(|e| Error::input(format!("task {name}: {e}")))?);
    }
    Ok(super::tasks::multi_task_json(&reports))
}

/// Parses `parts` as `R` and merges them.
pub(crate) fn merge_values<R: Report>(parts: &[Value]) -> Result<Value> {
    let parsed = parts
        .iter()
        .enumerate()
        .map(|(i, p)| serde_json::from_value::<R>(p.clone()).map_err(|e| R::parse_error(i, e)))
        .collect::<Result<Vec<_>>>()?;
    Ok(merge(&parsed)?.to_json())
}

/// Merges shard results of one run into the whole run's result, after
/// checking their kind, shard ids, settings and counts.
pub fn merge<R: Report>(parts: &[R]) -> Result<R> {
    if parts.is_empty() {
        return Err(Error::input(format!("no {} results to merge", R::KIND)));
    }
    if let Some((i, p)) = parts.iter().enumerate().find(|(_, p)| p.kind() != R::KIND) {
        return Err(R::wrong_kind(i, p.kind()));
    }
    let mut shards = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        let bad = |e: String| Error::input(format!("{}: {e}", R::label(i)));
        for s in p.shards().map_err(bad)? {
            shards.push(s.parse::<Shard>().map_err(bad)?);
        }
    }
    let n = check_shard_set(&shards)?;
    let first = parts[0].settings();
    for (i, p) in parts.iter().enumerate().skip(1) {
        for (this, want) in p.settings().iter().zip(&first) {
            if this.value != want.value {
                return Err(R::differs(i, this.what, &this.shown, &want.shown));
            }
        }
    }
    for (i, p) in parts.iter().enumerate() {
        p.check_counts(i)?;
    }
    R::combine(parts, n)
}

fn common_kind(parts: &[Value]) -> Result<String> {
    if parts.is_empty() {
        return Err(Error::input(
            "nothing to merge: give two or more result files",
        ));
    }
    let kinds: Vec<&str> = parts
        .iter()
        .map(|p| p.get("kind").and_then(Value::as_str).unwrap_or("(none)"))
        .collect();
    if kinds.iter().any(|k| *k != kinds[0]) {
        return Err(Error::input(format!(
            "cannot merge results of different kinds: {kinds:?}"
        )));
    }
    Ok(kinds[0].to_string())
}

/// Sums Pile shard results into one run's report.
pub fn merge_pile(parts: &[PileReport]) -> Result<PileReport> {
    merge(parts)
}

/// Sums task shard results into one run's report.
pub fn merge_tasks(parts: &[TaskReport]) -> Result<TaskReport> {
    merge(parts)
}
