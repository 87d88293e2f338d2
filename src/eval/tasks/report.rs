//! A task's report: our JSON beside the harness's results layout, and
//! `eval merge` of shards.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::eval::harness::{self, Metric, RunConfig, TaskEntry};
use crate::eval::report::RunInfo;
use crate::eval::report::{
    add_checked, check_loglikelihood, check_seconds, merged_devices, one_shard, run_settings,
    Report, Setting,
};
use crate::eval::shard::Shard;

use super::*;

/// The harness's layout for several tasks of one run in one file: our
/// reports under `tasks`, `kind` `"tasks"`, and the harness's blocks over
/// all of them (`eval merge` merges such files task by task).
pub fn multi_task_json(reports: &[TaskReport]) -> Value {
    let entries: Vec<TaskEntry> = reports.iter().map(TaskReport::harness_entry).collect();
    let mut run = reports[0].run_config();
    let total: f64 = reports.iter().map(|r| r.elapsed_seconds).sum();
    run.elapsed_seconds = total;
    let base = json!({
        "kind": TaskReport::KIND,
        "tasks": reports,
    });
    harness::with_blocks(base, harness::blocks(&entries, &run))
}

/// `--json` of `eval tasks` (and of `eval merge` over its shards).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskReport {
    /// Always `"tasks"`; `eval merge` dispatches on it.
    pub kind: String,
    /// The harness's task name.
    pub task: String,
    /// The model as resolved (`repo@revision` or a path).
    pub model: String,
    /// The Hub commit the model's files come from (none for a local folder).
    #[serde(default)]
    pub model_commit: Option<String>,
    /// `f32` or `f16` (`--weight-dtype`).
    #[serde(default)]
    pub weight_dtype: Option<String>,
    /// Where it ran (`cpu`, `cuda:0`; a merge: each shard's, comma-separated). Absent
    /// from results written before it was recorded.
    #[serde(default)]
    pub device: Option<String>,
    /// The data file as given.
    pub data: String,
    /// sha256 of the data file.
    pub data_sha256: String,
    /// The labels file as given (PIQA).
    pub labels: Option<String>,
    /// sha256 of the `--labels` file.
    #[serde(default)]
    pub labels_sha256: Option<String>,
    /// The line limit of the run (`--max-line-bytes`).
    #[serde(default)]
    pub max_line_bytes: Option<usize>,
    /// Maximum tokens per input.
    pub max_length: usize,
    /// Only the first N documents.
    pub limit: Option<usize>,
    /// `I/N` of a shard; `None` for a whole run or a merge.
    pub shard: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// How many shard results a merge combined (absent for a run).
    pub merged_shards: Option<usize>,
    /// Requests per forward pass.
    pub batch_size: usize,
    /// Documents the data file holds (every shard reads them all; before
    /// `limit`): the harness's `n-samples.original`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub documents_in_data: Option<u64>,
    #[serde(flatten)]
    /// The sums the metrics come from.
    pub counts: TaskCounts,
    /// Accuracy (summed log-likelihood).
    pub acc: Option<f64>,
    /// Its standard error.
    pub acc_stderr: Option<f64>,
    /// Accuracy normalised by the choices' characters.
    pub acc_norm: Option<f64>,
    /// Its standard error.
    pub acc_norm_stderr: Option<f64>,
    /// Lambada: exp(−mean target log-likelihood).
    pub perplexity: Option<f64>,
    /// Seconds of evaluation (a merge: the sum over shards).
    pub elapsed_seconds: f64,
}

impl TaskReport {
    /// The report of a run of `task` with `opts` that counted `counts`
    /// (no labels file: see [`TaskReport::with_labels`]).
    pub fn new(info: RunInfo, task: Task, opts: &TaskOptions, counts: TaskCounts) -> Self {
        let mut r = Self {
            kind: Self::KIND.into(),
            task: task.name().into(),
            model: info.model,
            model_commit: info.model_commit,
            weight_dtype: info.weight_dtype,
            device: Some(info.device),
            data: info.data,
            data_sha256: info.data_sha256,
            labels: None,
            labels_sha256: None,
            max_line_bytes: Some(opts.max_line_bytes),
            max_length: info.max_length,
            limit: opts.limit,
            shard: (opts.shard != Shard::WHOLE).then(|| opts.shard.to_string()),
            merged_shards: None,
            batch_size: opts.batch_size,
            documents_in_data: None,
            counts: TaskCounts::default(),
            acc: None,
            acc_stderr: None,
            acc_norm: None,
            acc_norm_stderr: None,
            perplexity: None,
            elapsed_seconds: info.elapsed_seconds,
        };
        r.set_counts(task, counts);
        r
    }

    /// Records the labels file (its name and sha256) the run read.
    pub fn with_labels(mut self, labels: String, sha256: String) -> Self {
        self.labels = Some(labels);
        self.labels_sha256 = Some(sha256);
        self
    }

    /// The task's entry in lm-evaluation-harness's results layout.
    pub fn harness_entry(&self) -> TaskEntry {
        let lambada = self.task == Task::Lambada.name();
        let mut metrics = Vec::new();
        if lambada {
            metrics.push(Metric {
                name: "perplexity",
                value: self.perplexity,
                stderr: None,
                higher_is_better: false,
            });
        }
        metrics.push(Metric {
            name: "acc",
            value: self.acc,
            stderr: self.acc_stderr,
            higher_is_better: true,
        });
        if self.acc_norm.is_some() {
            metrics.push(Metric {
                name: "acc_norm",
                value: self.acc_norm,
                stderr: self.acc_norm_stderr,
                higher_is_better: true,
            });
        }
        let task = self.task.parse::<Task>().ok();
        TaskEntry {
            name: self.task.clone(),
            version: 1.0,
            dataset_path: task.map_or("", |t| t.dataset_path()),
            dataset_name: task.and_then(|t| t.dataset_name()),
            split: task.map(|t| t.split()),
            output_type: task.map_or("multiple_choice", |t| t.output_type()),
            metrics,
            original: self.documents_in_data,
            effective: self.counts.documents,
        }
    }

    /// The harness `config` block's settings of this run.
    fn run_config(&self) -> RunConfig<'_> {
        RunConfig {
            model: &self.model,
            commit: self.model_commit.as_deref(),
            dtype: self.weight_dtype.as_deref(),
            device: self.device.as_deref(),
            batch_size: self.batch_size,
            limit: self.limit,
            elapsed_seconds: self.elapsed_seconds,
        }
    }

    /// Recomputes every metric from `counts`.
    pub fn set_counts(&mut self, task: Task, counts: TaskCounts) {
        let n = counts.documents;
        let rate = |c: u64| (n > 0).then(|| c as f64 / n as f64);
        self.acc = rate(counts.correct);
        self.acc_stderr = acc_stderr(counts.correct, n);
        (self.acc_norm, self.acc_norm_stderr) = if task.has_acc_norm() {
            (
                rate(counts.correct_norm),
                acc_stderr(counts.correct_norm, n),
            )
        } else {
            (None, None)
        };
        self.perplexity =
            (task == Task::Lambada && n > 0).then(|| (-counts.loglikelihood / n as f64).exp());
        self.counts = counts;
    }
}

impl Report for TaskReport {
    const KIND: &'static str = "tasks";

    fn kind(&self) -> &str {
        &self.kind
    }

    fn shards(&self) -> std::result::Result<Vec<&str>, String> {
        one_shard(&self.shard)
    }

    fn settings(&self) -> Vec<Setting> {
        let run = run_settings(
            &self.model,
            &self.model_commit,
            &self.weight_dtype,
            &self.data_sha256,
        );
        let mut s = vec![Setting::new("task", &self.task)];
        s.extend(run);
        s.extend([
            Setting::new("labels file sha256", &self.labels_sha256),
            Setting::new("max_length/limit", (self.max_length, self.limit)),
            Setting::new("max_line_bytes", self.max_line_bytes),
            Setting::new("documents_in_data", self.documents_in_data),
        ]);
        s
    }

    fn to_json(&self) -> Value {
        let flat = serde_json::to_value(self).expect("serialisable");
        harness::with_blocks(
            flat,
            harness::blocks(&[self.harness_entry()], &self.run_config()),
        )
    }

    /// Correct ones within the documents.
    fn check_counts(&self, i: usize) -> Result<()> {
        let c = &self.counts;
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
        check_seconds(i, self.elapsed_seconds)
    }

    fn combine(parts: &[Self], n: usize) -> Result<Self> {
        let task: Task = parts[0].task.parse().map_err(Error::input)?;
        let mut counts = TaskCounts::default();
        for p in parts {
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
        out.device = merged_devices(parts.iter().map(|p| p.device.as_deref()));
        out.set_counts(task, counts);
        Ok(out)
    }
}
