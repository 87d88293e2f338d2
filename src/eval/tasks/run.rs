//! Scoring a task's documents: requests through the scorer, `acc`,
//! `acc_norm` and their stderr, and the per-document samples.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::eval::data::{non_finite, DataFile, JsonLines, NOTE_SKIP_BAD};
use crate::eval::harness;
use crate::eval::shard::Shard;
use crate::scoring::Scorer;

use super::*;

/// What to evaluate and how.
#[derive(Clone, Debug)]
pub struct TaskOptions {
    /// Requests per forward pass.
    pub batch_size: usize,
    /// Only the first N documents.
    pub limit: Option<usize>,
    /// The part of the documents this run scores.
    pub shard: Shard,
    /// Skip (and count) bad lines instead of failing.
    pub skip_bad: bool,
    /// The token an empty context becomes (EOS for GPT-NeoX).
    pub prefix_token: u32,
    /// Lines longer than this many bytes are bad lines.
    pub max_line_bytes: usize,
}

/// Sums from which every metric is recomputed (and merged across shards).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskCounts {
    /// Documents scored.
    pub documents: u64,
    /// Documents whose argmax log-likelihood choice (lambada: greedy target) is right.
    pub correct: u64,
    /// Documents right under length-normalised log-likelihood.
    pub correct_norm: u64,
    /// Σ target log-likelihood (lambada's perplexity).
    pub loglikelihood: f64,
    /// Bad lines skipped (each counted by one shard only).
    pub skipped_lines: u64,
}

impl TaskCounts {
    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &TaskCounts) {
        self.documents += o.documents;
        self.correct += o.correct;
        self.correct_norm += o.correct_norm;
        self.loglikelihood += o.loglikelihood;
        self.skipped_lines += o.skipped_lines;
    }
}

/// The harness's `mean_stderr` of a 0/1 metric: sample std / √n =
/// √(p(1−p)/(n−1)); undefined for n < 2.
pub fn acc_stderr(correct: u64, n: u64) -> Option<f64> {
    (n >= 2).then(|| {
        let p = correct as f64 / n as f64;
        (p * (1.0 - p) / (n - 1) as f64).sqrt()
    })
}

/// numpy's argmax: the first maximum, NaN counting as the maximum (scores
/// are checked to be finite before, so this is only numpy's tie rule).
fn argmax(xs: &[f64]) -> usize {
    if let Some(i) = xs.iter().position(|x| x.is_nan()) {
        return i;
    }
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best
}

/// Reads the task's documents (this shard's), scores them, and counts.
/// `labels` are PIQA's separate answers, one per document line.
pub fn evaluate(
    scorer: &Scorer,
    tokenizer: &tokenizers::Tokenizer,
    task: Task,
    path: &Path,
    labels: Option<&[String]>,
    opts: &TaskOptions,
    progress: impl FnMut(u64, u64),
) -> Result<TaskCounts> {
    let run = evaluate_full(scorer, tokenizer, task, path, labels, opts, false, progress)?;
    Ok(run.counts)
}

/// One scored document, as the harness logs it (`--log-samples`).
#[derive(Clone, Debug)]
pub struct Sample {
    /// The document's index among the data's documents (0-based).
    pub doc_id: usize,
    /// The document as read.
    pub doc: Value,
    /// (context, continuation) of each request.
    pub requests: Vec<(String, String)>,
    /// (log-likelihood, is greedy) of each request.
    pub results: Vec<(f64, bool)>,
    /// The right choice (lambada: 0).
    pub gold: usize,
    /// `acc` of this document (0 or 1).
    pub acc: f64,
    /// `acc_norm` of this document, where the task has it.
    pub acc_norm: Option<f64>,
}

impl Sample {
    /// The harness's sample record (`samples_<task>_*.jsonl`): `doc_id`,
    /// `doc`, `target`, `arguments` (`gen_args_<i>`: `arg_0` context,
    /// `arg_1` continuation), `resps`/`filtered_resps` (log-likelihood and
    /// is-greedy as the harness writes them, strings), `filter`, `metrics`,
    /// the sha256 `doc_hash`/`prompt_hash`/`target_hash`, and the per-document
    /// metric values.
    pub fn to_harness(&self, task: Task) -> Value {
        let target = match task {
            Task::Lambada => Value::String(self.requests[0].1.clone()),
            _ => Value::from(self.gold),
        };
        let target_text = match &target {
            Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        let arguments: serde_json::Map<String, Value> = self
            .requests
            .iter()
            .enumerate()
            .map(|(i, (c, x))| (format!("gen_args_{i}"), json!({"arg_0": c, "arg_1": x})))
            .collect();
        let resp = |&(ll, greedy): &(f64, bool)| {
            json!([format!("{ll:?}"), if greedy { "True" } else { "False" }])
        };
        let mut metrics = vec!["acc"];
        let mut v = json!({
            "doc_id": self.doc_id,
            "doc": self.doc,
            "target": target,
            "arguments": arguments,
            "resps": self.results.iter().map(|r| json!([resp(r)])).collect::<Vec<_>>(),
            "filtered_resps": self.results.iter().map(resp).collect::<Vec<_>>(),
            "filter": harness::FILTER,
            "doc_hash": harness::hash_string(
                &serde_json::to_string_pretty(&self.doc).expect("serialisable")
            ),
            "prompt_hash": harness::hash_string(&self.requests[0].0),
            "target_hash": harness::hash_string(&target_text),
            "acc": self.acc,
        });
        if task == Task::Lambada {
            metrics.insert(0, "perplexity");
            v["perplexity"] = json!(self.results[0].0);
        }
        if let Some(n) = self.acc_norm {
            metrics.push("acc_norm");
            v["acc_norm"] = json!(n);
        }
        v["metrics"] = json!(metrics);
        v
    }
}

/// What one task run found: the counts, the documents in the data, and
/// (if asked for) every scored document.
#[derive(Clone, Debug)]
pub struct TaskRun {
    /// The sums the metrics come from.
    pub counts: TaskCounts,
    /// Documents the data holds (all of the file, before `limit`).
    pub documents_in_data: u64,
    /// Every document this run scored, when `log_samples` was set.
    pub samples: Vec<Sample>,
}

/// [`evaluate`], also counting the data's documents and, with
/// `log_samples`, keeping each scored document's requests and results.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_full(
    scorer: &Scorer,
    tokenizer: &tokenizers::Tokenizer,
    task: Task,
    path: &Path,
    labels: Option<&[String]>,
    opts: &TaskOptions,
    log_samples: bool,
    mut progress: impl FnMut(u64, u64),
) -> Result<TaskRun> {
    let mut counts = TaskCounts::default();
    let mut examples = Vec::new();
    let mut k = 0usize;
    let mut lines = 0usize;
    let mut in_data = 0u64;
    let mut past_limit = false;
    for item in JsonLines::new(DataFile::open_with(path, opts.max_line_bytes)?) {
        let (line, value) = item?;
        lines += 1;
        if past_limit {
            // Only counted (n-samples.original): a line past the limit is
            // never an error, as before the count was kept.
            let label = labels.and_then(|l| l.get(lines - 1)).map(String::as_str);
            let ok = value.is_ok_and(|v| build_example(task, &v, label).is_ok());
            in_data += u64::from(ok);
            continue;
        }
        let label = match labels {
            Some(l) => Some(l.get(lines - 1).map(String::as_str).ok_or_else(|| {
                Error::input(format!(
                    "{} line {line}: the labels file has only {} lines",
                    path.display(),
                    l.len()
                ))
            })?),
            None => None,
        };
        let doc = if log_samples {
            value.as_ref().ok().cloned()
        } else {
            None
        };
        match value.and_then(|v| build_example(task, &v, label)) {
            Ok(ex) => {
                in_data += 1;
                if opts.limit.is_some_and(|l| k >= l) {
                    past_limit = true;
                    continue;
                }
                if opts.shard.owns(k) {
                    examples.push((line, k, doc, ex));
                }
                k += 1;
            }
            Err(reason) if opts.skip_bad => {
                if opts.shard.owns(line) {
                    counts.skipped_lines += 1;
                }
                let _ = reason;
            }
            Err(reason) => {
                return Err(Error::input(format!(
                    "{} line {line}: {reason}; {} expects {} {NOTE_SKIP_BAD}",
                    path.display(),
                    task.name(),
                    task.fields()
                )))
            }
        }
    }
    if lines == 0 {
        return Err(Error::input(format!(
            "{}: the file is empty (no JSON lines)",
            path.display()
        )));
    }
    if in_data == 0 {
        // Every line was skipped as bad: zero documents would read as a result.
        return Err(Error::input(format!(
            "{}: no {} documents (all {lines} lines skipped as bad)",
            path.display(),
            task.name()
        )));
    }
    if let Some(l) = labels {
        if opts.limit.is_none() && l.len() != lines {
            return Err(Error::input(format!(
                "{} has {lines} documents but the labels file has {} lines",
                path.display(),
                l.len()
            )));
        }
    }
    let mut requests = Vec::new();
    for (_, _, _, ex) in &examples {
        for (c, x) in &ex.requests {
            requests.push(encode_pair(tokenizer, opts.prefix_token, c, x)?);
        }
    }
    let total: u64 = requests.iter().map(|r| r.continuation.len() as u64).sum();
    let mut done = 0u64;
    let scored = scorer.score_all(&requests, opts.batch_size, |n| {
        done += n as u64;
        progress(done, total);
    })?;
    let mut samples = Vec::new();
    let mut at = 0;
    for (line, doc_id, doc, ex) in examples {
        let res = &scored[at..at + ex.requests.len()];
        at += ex.requests.len();
        if let Some(bad) = res.iter().find(|r| !r.logprob.is_finite()) {
            return Err(non_finite(path, line, bad.logprob));
        }
        counts.documents += 1;
        let (acc, acc_norm) = if task == Task::Lambada {
            counts.loglikelihood += res[0].logprob;
            (res[0].is_greedy, None)
        } else {
            let lls: Vec<f64> = res.iter().map(|r| r.logprob).collect();
            let right = argmax(&lls) == ex.gold;
            let norm = task.has_acc_norm().then(|| {
                let norm: Vec<f64> = lls
                    .iter()
                    .zip(&ex.choices)
                    .map(|(ll, c)| ll / c.chars().count() as f64)
                    .collect();
                argmax(&norm) == ex.gold
            });
            (right, norm)
        };
        counts.correct += u64::from(acc);
        counts.correct_norm += u64::from(acc_norm == Some(true));
        if let Some(doc) = doc {
            samples.push(Sample {
                doc_id,
                doc,
                results: res.iter().map(|r| (r.logprob, r.is_greedy)).collect(),
                requests: ex.requests,
                gold: ex.gold,
                acc: f64::from(u8::from(acc)),
                acc_norm: acc_norm.map(|n| f64::from(u8::from(n))),
            });
        }
    }
    Ok(TaskRun {
        counts,
        documents_in_data: in_data,
        samples,
    })
}
