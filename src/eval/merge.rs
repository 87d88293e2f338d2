//! `tokenformer eval merge`: combines the `--json` results of `--shard I/N`
//! runs into the numbers of one whole run. Every metric is recomputed from
//! summed counts (log-likelihood, documents, tokens, words, bytes; task
//! counts), never averaged, as lm-evaluation-harness aggregates per-document
//! items (<https://github.com/EleutherAI/lm-evaluation-harness>,
//! `lm_eval/api/metrics.py`). Dispatches on the results' `kind`.
//!
//! Nothing in a result file is trusted: shards must come from one run's
//! settings (model and its commit, data and labels sha256, method, window,
//! stride, task, weight dtype, limits), carry possible counts (no correct
//! above total, log-likelihoods finite and not positive; negative or
//! fractional counts do not parse), and be I/N of one N, each once, all
//! present.

use serde_json::Value;

use super::pile::{Counts, PileReport, PileTotals, Shard};
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

/// Parses each result's `shard` and checks the set (see [`check_shard_set`]).
fn check_shards<'a>(shards: impl Iterator<Item = &'a Option<String>>) -> Result<usize> {
    let parsed = shards
        .enumerate()
        .map(|(i, s)| {
            let s = s.as_deref().ok_or_else(|| {
                Error::input(format!(
                    "result #{}: not from a --shard run (or already merged)",
                    i + 1
                ))
            })?;
            s.parse::<Shard>()
                .map_err(|e| Error::input(format!("result #{}: {e}", i + 1)))
        })
        .collect::<Result<Vec<_>>>()?;
    check_shard_set(&parsed)
}

/// Checks that `shards` are I/N of one N, each once, all present; returns N.
pub(crate) fn check_shard_set(shards: &[Shard]) -> Result<usize> {
    let Some(first) = shards.first() else {
        return Err(Error::input("no shard results to merge"));
    };
    let n = first.count;
    let mut seen = std::collections::BTreeSet::new();
    for s in shards {
        if s.count != n {
            return Err(Error::input(format!(
                "shard {s} is of {} parts but shard {first} of {n}: results of different --shard counts",
                s.count
            )));
        }
        if !seen.insert(s.index) {
            return Err(Error::input(format!("shard {s} appears twice")));
        }
    }
    // Every index is below N and none repeats, so N given means all present;
    // N comes from a file, so the missing ones are named without enumerating 0..N.
    if seen.len() != n {
        let mut missing = Vec::new();
        let mut i = 0;
        while missing.len() < 10 && i < n {
            if !seen.contains(&i) {
                missing.push(format!("{i}/{n}"));
            }
            i += 1;
        }
        return Err(Error::input(format!(
            "{} of {n} shards given: all of them are needed for the whole run; missing {}{}",
            seen.len(),
            missing.join(", "),
            if n - seen.len() > missing.len() {
                ", ..."
            } else {
                ""
            }
        )));
    }
    Ok(n)
}

fn same<T: PartialEq + std::fmt::Debug>(what: &str, values: impl Iterator<Item = T>) -> Result<()> {
    let v: Vec<T> = values.collect();
    if let Some(i) = v.iter().position(|x| *x != v[0]) {
        return Err(Error::input(format!(
            "cannot merge: result #{} differs from result #1 in {what}: {:?} vs {:?} \
             (shards of different runs)",
            i + 1,
            v[i],
            v[0]
        )));
    }
    Ok(())
}

/// A log-likelihood as a run can produce it: finite and not positive.
fn check_loglikelihood(i: usize, what: &str, ll: f64) -> Result<()> {
    if !(ll.is_finite() && ll <= 0.0) {
        return Err(Error::input(format!(
            "result #{}: impossible {what} log-likelihood {ll} (a sum of log-probabilities is finite and <= 0)",
            i + 1
        )));
    }
    Ok(())
}

fn check_seconds(i: usize, s: f64) -> Result<()> {
    if !(s.is_finite() && s >= 0.0) {
        return Err(Error::input(format!(
            "result #{}: impossible elapsed_seconds {s}",
            i + 1
        )));
    }
    Ok(())
}

/// One Pile result's counts: each possible, the subsets within the whole.
fn check_pile_counts(i: usize, p: &PileReport) -> Result<()> {
    let t = p.totals();
    let impossible =
        |msg: String| Error::input(format!("result #{}: impossible counts: {msg}", i + 1));
    let one = |name: &str, c: &Counts| -> Result<()> {
        check_loglikelihood(i, name, c.loglikelihood)?;
        if c.words < c.documents {
            return Err(impossible(format!(
                "{name}: {} words in {} documents (every document counts at least one)",
                c.words, c.documents
            )));
        }
        if c.tokens == 0 && c.loglikelihood != 0.0 {
            return Err(impossible(format!(
                "{name}: log-likelihood {} over 0 tokens",
                c.loglikelihood
            )));
        }
        Ok(())
    };
    one("overall", &t.overall)?;
    let mut sum = Counts::default();
    for (name, c) in &t.subsets {
        one(name, c)?;
        sum.documents = sum.documents.saturating_add(c.documents);
        sum.tokens = sum.tokens.saturating_add(c.tokens);
        sum.words = sum.words.saturating_add(c.words);
        sum.bytes = sum.bytes.saturating_add(c.bytes);
    }
    let o = &t.overall;
    if sum.documents > o.documents
        || sum.tokens > o.tokens
        || sum.words > o.words
        || sum.bytes > o.bytes
    {
        return Err(impossible(
            "the subsets hold more documents, tokens, words or bytes than the whole".into(),
        ));
    }
    check_seconds(i, p.elapsed_seconds)
}

/// One task result's counts: correct ones within the documents.
fn check_task_counts(i: usize, p: &TaskReport) -> Result<()> {
    let c = &p.counts;
    if c.correct > c.documents || c.correct_norm > c.documents {
        return Err(Error::input(format!(
            "result #{}: impossible counts: correct {} / correct_norm {} of {} documents",
            i + 1,
            c.correct,
            c.correct_norm,
            c.documents
        )));
    }
    check_loglikelihood(i, "target", c.loglikelihood)?;
    check_seconds(i, p.elapsed_seconds)
}

/// Sums counts, refusing an overflow (counts come from files).
fn add_checked(total: &mut u64, x: u64) -> Result<()> {
    *total = total
        .checked_add(x)
        .ok_or_else(|| Error::input("the shards' counts overflow"))?;
    Ok(())
}

/// Sums Pile shard results into one run's report.
pub fn merge_pile(parts: &[PileReport]) -> Result<PileReport> {
    if parts.first().is_some_and(|p| p.kind != PileReport::KIND) {
        return Err(Error::input("not a pile result"));
    }
    let n = check_shards(parts.iter().map(|p| &p.shard))?;
    same("model", parts.iter().map(|p| &p.model))?;
    same("model commit", parts.iter().map(|p| &p.model_commit))?;
    same("weight dtype", parts.iter().map(|p| &p.weight_dtype))?;
    same("data_sha256", parts.iter().map(|p| &p.data_sha256))?;
    same(
        "method/max_length/stride/prefix_token",
        parts
            .iter()
            .map(|p| (&p.method, p.max_length, p.stride, p.prefix_token)),
    )?;
    same("subset/limit", parts.iter().map(|p| (&p.subset, p.limit)))?;
    same("max_line_bytes", parts.iter().map(|p| p.max_line_bytes))?;
    for (i, p) in parts.iter().enumerate() {
        check_pile_counts(i, p)?;
    }
    let mut totals = PileTotals::default();
    let mut elapsed = 0.0;
    let add = |into: &mut Counts, c: &Counts| -> Result<()> {
        add_checked(&mut into.documents, c.documents)?;
        add_checked(&mut into.tokens, c.tokens)?;
        add_checked(&mut into.words, c.words)?;
        add_checked(&mut into.bytes, c.bytes)?;
        into.loglikelihood += c.loglikelihood;
        Ok(())
    };
    for p in parts {
        let t = p.totals();
        add(&mut totals.overall, &t.overall)?;
        for (k, c) in &t.subsets {
            add(totals.subsets.entry(k.clone()).or_default(), c)?;
        }
        add_checked(&mut totals.skipped_lines, t.skipped_lines)?;
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
    if parts.first().is_some_and(|p| p.kind != TaskReport::KIND) {
        return Err(Error::input("not a tasks result"));
    }
    let n = check_shards(parts.iter().map(|p| &p.shard))?;
    same("task", parts.iter().map(|p| &p.task))?;
    same("model", parts.iter().map(|p| &p.model))?;
    same("model commit", parts.iter().map(|p| &p.model_commit))?;
    same("weight dtype", parts.iter().map(|p| &p.weight_dtype))?;
    same("data_sha256", parts.iter().map(|p| &p.data_sha256))?;
    same("labels file sha256", parts.iter().map(|p| &p.labels_sha256))?;
    same(
        "max_length/limit",
        parts.iter().map(|p| (p.max_length, p.limit)),
    )?;
    same("max_line_bytes", parts.iter().map(|p| p.max_line_bytes))?;
    let task: Task = parts[0].task.parse().map_err(Error::input)?;
    let mut counts = TaskCounts::default();
    for (i, p) in parts.iter().enumerate() {
        check_task_counts(i, p)?;
        let c = &p.counts;
        add_checked(&mut counts.documents, c.documents)?;
        add_checked(&mut counts.correct, c.correct)?;
        add_checked(&mut counts.correct_norm, c.correct_norm)?;
        add_checked(&mut counts.skipped_lines, c.skipped_lines)?;
        counts.loglikelihood += c.loglikelihood;
    }
    let mut out = parts[0].clone();
    out.shard = None;
    out.merged_shards = Some(n);
    out.elapsed_seconds = parts.iter().map(|p| p.elapsed_seconds).sum();
    out.set_counts(task, counts);
    Ok(out)
}
