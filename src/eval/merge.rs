//! `tokenformer eval merge`: combines the `--json` results of `--shard I/N`
//! runs into the numbers of one whole run. Every metric is recomputed from
//! summed counts (log-likelihood, documents, tokens, words, bytes; task
//! counts), never averaged, as lm-evaluation-harness aggregates per-document
//! items (<https://github.com/EleutherAI/lm-evaluation-harness>,
//! `lm_eval/api/metrics.py`). Dispatches on the results' `kind`.

use std::collections::BTreeSet;

use serde_json::Value;

use super::pile::{PileReport, PileTotals, Shard};
use super::tasks::{Task, TaskCounts, TaskReport};
use crate::error::{Error, Result};

/// Merges results of one kind (`pile`, `tasks`, `imagenet`).
pub fn merge_results(parts: &[Value]) -> Result<Value> {
    let kind = common_kind(parts)?;
    match kind.as_str() {
        PileReport::KIND => {
            Ok(serde_json::to_value(merge_pile(&parse(parts)?)?).expect("serialisable"))
        }
        TaskReport::KIND => {
            Ok(serde_json::to_value(merge_tasks(&parse(parts)?)?).expect("serialisable"))
        }
        "imagenet" => crate::eval::imagenet::merge_results(parts),
        other => Err(Error::input(format!(
            "unknown result kind `{other}` (expected pile, tasks or imagenet)"
        ))),
    }
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

fn parse<T: serde::de::DeserializeOwned>(parts: &[Value]) -> Result<Vec<T>> {
    parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            serde_json::from_value(p.clone()).map_err(|e| {
                Error::input(format!("result #{} is not a valid result file: {e}", i + 1))
            })
        })
        .collect()
}

/// Checks that the shards are I/N of one N, each once, all present.
fn check_shards<'a>(shards: impl Iterator<Item = &'a Option<String>>) -> Result<usize> {
    let mut count = None;
    let mut seen = BTreeSet::new();
    for s in shards {
        let s = s.as_deref().ok_or_else(|| {
            Error::input("a result is not from a --shard run (or is already merged)")
        })?;
        let sh: Shard = s.parse().map_err(Error::input)?;
        if *count.get_or_insert(sh.count) != sh.count {
            return Err(Error::input("results come from different shard counts"));
        }
        if !seen.insert(sh.index) {
            return Err(Error::input(format!("shard {sh} appears twice")));
        }
    }
    let n = count.unwrap_or(0);
    let missing: Vec<String> = (0..n)
        .filter(|i| !seen.contains(i))
        .map(|i| format!("{i}/{n}"))
        .collect();
    if !missing.is_empty() {
        return Err(Error::input(format!(
            "missing shard(s) {}",
            missing.join(", ")
        )));
    }
    Ok(n)
}

fn same<T: PartialEq + std::fmt::Debug>(what: &str, values: impl Iterator<Item = T>) -> Result<()> {
    let v: Vec<T> = values.collect();
    if v.iter().any(|x| *x != v[0]) {
        return Err(Error::input(format!(
            "cannot merge: the results differ in {what}: {v:?}"
        )));
    }
    Ok(())
}

/// Sums Pile shard results into one run's report.
pub fn merge_pile(parts: &[PileReport]) -> Result<PileReport> {
    let n = check_shards(parts.iter().map(|p| &p.shard))?;
    same("model", parts.iter().map(|p| &p.model))?;
    same("data_sha256", parts.iter().map(|p| &p.data_sha256))?;
    same(
        "method",
        parts
            .iter()
            .map(|p| (&p.method, p.max_length, p.stride, p.prefix_token)),
    )?;
    same("subset/limit", parts.iter().map(|p| (&p.subset, p.limit)))?;
    let mut totals = PileTotals::default();
    let mut elapsed = 0.0;
    for p in parts {
        let t = p.totals();
        totals.overall.add(&t.overall);
        for (k, c) in &t.subsets {
            totals.subsets.entry(k.clone()).or_default().add(c);
        }
        totals.skipped_lines += t.skipped_lines;
        elapsed += p.elapsed_seconds;
    }
    let mut out = parts[0].clone();
    out.shard = None;
    out.merged_shards = Some(n);
    out.elapsed_seconds = elapsed;
    out.set_totals(&totals);
    Ok(out)
}

/// Sums task shard results into one run's report.
pub fn merge_tasks(parts: &[TaskReport]) -> Result<TaskReport> {
    let n = check_shards(parts.iter().map(|p| &p.shard))?;
    same("task", parts.iter().map(|p| &p.task))?;
    same("model", parts.iter().map(|p| &p.model))?;
    same("data_sha256", parts.iter().map(|p| &p.data_sha256))?;
    same(
        "max_length/limit",
        parts.iter().map(|p| (p.max_length, p.limit)),
    )?;
    let task: Task = parts[0].task.parse().map_err(Error::input)?;
    let mut counts = TaskCounts::default();
    for p in parts {
        counts.add(&p.counts);
    }
    let mut out = parts[0].clone();
    out.shard = None;
    out.merged_shards = Some(n);
    out.elapsed_seconds = parts.iter().map(|p| p.elapsed_seconds).sum();
    out.set_counts(task, counts);
    Ok(out)
}
