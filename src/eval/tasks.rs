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

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::data::{non_finite, DataFile, JsonLines, NOTE_SKIP_BAD};
use super::harness::{self, Metric, RunConfig, TaskEntry};
use super::pytext::{py_isspace, py_strip};
use super::report::RunInfo;
use super::report::{
    add_checked, check_loglikelihood, check_seconds, one_shard, run_settings, Report, Setting,
};
use super::shard::Shard;
use crate::error::{Error, Result};
use crate::scoring::{Request, Scorer};

// Kept here too for callers that found it in this module before the split.
pub use super::pytext::py_capitalize;

/// A zero-shot task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// `lambada_openai`: the last word given the passage.
    Lambada,
    /// HellaSwag: the ending of an activity.
    Hellaswag,
    /// PIQA: the solution of a physical goal.
    Piqa,
    /// ARC-Easy: grade-school science questions.
    ArcEasy,
    /// ARC-Challenge: the harder ARC questions.
    ArcChallenge,
    /// WinoGrande: which option fills the blank.
    Winogrande,
}

impl std::str::FromStr for Task {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "lambada" | "lambada_openai" => Task::Lambada,
            "hellaswag" => Task::Hellaswag,
            "piqa" => Task::Piqa,
            "arc_easy" => Task::ArcEasy,
            "arc_challenge" => Task::ArcChallenge,
            "winogrande" => Task::Winogrande,
            _ => {
                return Err(format!(
                    "unknown task `{s}` (expected lambada, hellaswag, piqa, arc_easy, arc_challenge or winogrande)"
                ))
            }
        })
    }
}

impl Task {
    /// Every task, in the paper's order.
    pub const ALL: [Task; 6] = [
        Task::Lambada,
        Task::Hellaswag,
        Task::Piqa,
        Task::ArcEasy,
        Task::ArcChallenge,
        Task::Winogrande,
    ];

    /// The harness's task name.
    pub fn name(&self) -> &'static str {
        match self {
            Task::Lambada => "lambada_openai",
            Task::Hellaswag => "hellaswag",
            Task::Piqa => "piqa",
            Task::ArcEasy => "arc_easy",
            Task::ArcChallenge => "arc_challenge",
            Task::Winogrande => "winogrande",
        }
    }

    /// The JSONL fields each line must have (for `--help` and errors).
    pub fn fields(&self) -> &'static str {
        match self {
            Task::Lambada => {
                r#"{"text"} (lambada_test.jsonl; the target is the last space-separated word)"#
            }
            Task::Hellaswag => {
                r#"{"activity_label", "ctx_a", "ctx_b", "endings": [4], "label": 0-3 or "0"-"3"}"#
            }
            Task::Piqa => {
                r#"{"goal", "sol1", "sol2", "label": 0|1} or, without "label", --labels valid-labels.lst"#
            }
            Task::ArcEasy | Task::ArcChallenge => {
                r#"{"question": {"stem", "choices": [{"text", "label"}]}, "answerKey"} or HF {"question", "choices": {"text": [], "label": []}, "answerKey"}"#
            }
            Task::Winogrande => {
                r#"{"sentence" (one "_"), "option1", "option2", "answer": "1"|"2"}"#
            }
        }
    }

    /// The Hub dataset the harness loads the task from (its `dataset_path`).
    pub fn dataset_path(&self) -> &'static str {
        match self {
            Task::Lambada => "EleutherAI/lambada_openai",
            Task::Hellaswag => "Rowan/hellaswag",
            Task::Piqa => "ybisk/piqa",
            Task::ArcEasy | Task::ArcChallenge => "allenai/ai2_arc",
            Task::Winogrande => "allenai/winogrande",
        }
    }

    /// The configuration of [`dataset_path`](Self::dataset_path) (the harness's `dataset_name`).
    pub fn dataset_name(&self) -> Option<&'static str> {
        match self {
            Task::Lambada => Some("default"),
            Task::ArcEasy => Some("ARC-Easy"),
            Task::ArcChallenge => Some("ARC-Challenge"),
            Task::Winogrande => Some("winogrande_xl"),
            Task::Hellaswag | Task::Piqa => None,
        }
    }

    /// The split the harness evaluates (the test split where it is labelled).
    pub fn split(&self) -> &'static str {
        match self {
            Task::Lambada | Task::ArcEasy | Task::ArcChallenge => "test",
            Task::Hellaswag | Task::Piqa | Task::Winogrande => "validation",
        }
    }

    /// The harness's request type for the task.
    pub fn output_type(&self) -> &'static str {
        match self {
            Task::Lambada => "loglikelihood",
            _ => "multiple_choice",
        }
    }

    /// Whether the task reports `acc_norm` (winogrande and lambada do not).
    pub fn has_acc_norm(&self) -> bool {
        !matches!(self, Task::Lambada | Task::Winogrande)
    }
}

/// One document as the harness builds its requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    /// (context, continuation) strings: one per choice, or lambada's one.
    pub requests: Vec<(String, String)>,
    /// Index of the right choice (0 for lambada).
    pub gold: usize,
    /// The choices without the target delimiter: their character counts
    /// normalise `acc_norm`.
    pub choices: Vec<String>,
}

fn field<'a>(doc: &'a Value, name: &str) -> std::result::Result<&'a Value, String> {
    doc.get(name).ok_or_else(|| format!("no `{name}` field"))
}

fn string<'a>(doc: &'a Value, name: &str) -> std::result::Result<&'a str, String> {
    field(doc, name)?
        .as_str()
        .ok_or_else(|| format!("field `{name}` is not a string"))
}

/// A label that may be a number or a numeric string (HF exports differ).
fn index(v: &Value, name: &str) -> std::result::Result<usize, String> {
    match v {
        Value::Number(n) => n.as_u64().map(|x| x as usize),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
    .ok_or_else(|| format!("field `{name}` is not a label index: {v}"))
}

/// HellaSwag's cleaning (harness `hellaswag/utils.py::preprocess`): strip,
/// " \[title\]" → ". ", drop `[...]` (WikiHow artefacts), "  " → " ".
pub fn hellaswag_preprocess(text: &str) -> String {
    static BRACKETS: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = BRACKETS.get_or_init(|| regex::Regex::new(r"\[.*?\]").expect("valid regex"));
    let t = py_strip(text).replace(" [title]", ". ");
    re.replace_all(&t, "").replace("  ", " ")
}

/// The harness's requests for one JSONL document. `label` is PIQA's answer
/// from a separate labels file.
pub fn build_example(
    task: Task,
    doc: &Value,
    label: Option<&str>,
) -> std::result::Result<Example, String> {
    let mc = |context: String, choices: Vec<String>, gold: usize| {
        if gold >= choices.len() {
            return Err(format!(
                "label {gold} is out of range for {} choices",
                choices.len()
            ));
        }
        Ok(Example {
            requests: choices
                .iter()
                .map(|c| (context.clone(), format!(" {c}")))
                .collect(),
            gold,
            choices,
        })
    };
    match task {
        Task::Lambada => {
            let text = string(doc, "text")?;
            let (context, last) = match text.rsplit_once(' ') {
                Some((c, l)) => (c, l),
                None => ("", text),
            };
            Ok(Example {
                requests: vec![(context.to_string(), format!(" {last}"))],
                gold: 0,
                choices: vec![],
            })
        }
        Task::Hellaswag => {
            let ctx = format!(
                "{} {}",
                string(doc, "ctx_a")?,
                py_capitalize(string(doc, "ctx_b")?)
            );
            let query = hellaswag_preprocess(&format!("{}: {ctx}", string(doc, "activity_label")?));
            let endings = field(doc, "endings")?
                .as_array()
                .ok_or("field `endings` is not a list")?
                .iter()
                .map(|e| {
                    e.as_str()
                        .map(hellaswag_preprocess)
                        .ok_or("an ending is not a string")
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            mc(query, endings, index(field(doc, "label")?, "label")?)
        }
        Task::Piqa => {
            let context = format!("Question: {}\nAnswer:", string(doc, "goal")?);
            let choices = vec![
                string(doc, "sol1")?.to_string(),
                string(doc, "sol2")?.to_string(),
            ];
            let gold = match (doc.get("label"), label) {
                (_, Some(l)) => index(&Value::String(l.into()), "label (labels file)")?,
                (Some(v), None) => index(v, "label")?,
                (None, None) => {
                    return Err("no `label` field: pass --labels valid-labels.lst".into())
                }
            };
            mc(context, choices, gold)
        }
        Task::ArcEasy | Task::ArcChallenge => {
            let q = field(doc, "question")?;
            let (stem, texts, labels) = match q {
                Value::String(s) => {
                    let ch = field(doc, "choices")?;
                    let list = |k: &str| -> std::result::Result<Vec<String>, String> {
                        field(ch, k)?
                            .as_array()
                            .ok_or(format!("`choices.{k}` is not a list"))?
                            .iter()
                            .map(|v| {
                                v.as_str()
                                    .map(str::to_string)
                                    .ok_or(format!("a `choices.{k}` is not a string"))
                            })
                            .collect()
                    };
                    (s.as_str(), list("text")?, list("label")?)
                }
                Value::Object(_) => {
                    let stem = string(q, "stem")?;
                    let ch = field(q, "choices")?
                        .as_array()
                        .ok_or("`question.choices` is not a list")?;
                    let mut texts = Vec::new();
                    let mut labels = Vec::new();
                    for c in ch {
                        texts.push(string(c, "text")?.to_string());
                        labels.push(string(c, "label")?.to_string());
                    }
                    (stem, texts, labels)
                }
                _ => return Err("field `question` is neither a string nor an object".into()),
            };
            let key = string(doc, "answerKey")?;
            let gold = labels
                .iter()
                .position(|l| l == key)
                .ok_or_else(|| format!("answerKey `{key}` is not among the labels {labels:?}"))?;
            mc(format!("Question: {stem}\nAnswer:"), texts, gold)
        }
        Task::Winogrande => {
            let sentence = string(doc, "sentence")?;
            let blank = sentence.find('_').ok_or("`sentence` has no `_` blank")?;
            let rest = py_strip(&sentence[blank + 1..]);
            let options = [string(doc, "option1")?, string(doc, "option2")?];
            let gold = match field(doc, "answer")? {
                Value::String(s) if s == "1" => 0,
                Value::String(s) if s == "2" => 1,
                Value::Number(n) if n.as_u64() == Some(1) => 0,
                Value::Number(n) if n.as_u64() == Some(2) => 1,
                v => return Err(format!("field `answer` is not \"1\" or \"2\": {v}")),
            };
            Ok(Example {
                requests: options
                    .iter()
                    .map(|o| (format!("{}{o}", &sentence[..blank]), format!(" {rest}")))
                    .collect(),
                gold,
                choices: vec![],
            })
        }
    }
}

fn encode(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok
        .encode_fast(text, false)
        .map_err(|e| Error::input(format!("cannot tokenize {text:?}: {e}")))?
        .get_ids()
        .to_vec())
}

/// Context/continuation tokens as the harness: trailing whitespace of the
/// context moves into the continuation; the continuation is the tokens of
/// context+continuation after those of the context; an empty context becomes
/// the prefix token (or the continuation's first token if it is that token).
pub fn encode_pair(
    tok: &tokenizers::Tokenizer,
    prefix: u32,
    context: &str,
    continuation: &str,
) -> Result<Request> {
    // A whitespace-only context has no tokens: treated as empty (the
    // harness would score from no context at all, which a causal LM cannot).
    if context.trim_end_matches(py_isspace).is_empty() {
        let cont = encode(tok, &format!("{context}{continuation}"))?;
        return Ok(if cont.first() == Some(&prefix) {
            Request {
                context: cont[..1].to_vec(),
                continuation: cont[1..].to_vec(),
            }
        } else {
            Request {
                context: vec![prefix],
                continuation: cont,
            }
        });
    }
    let trimmed = context.trim_end_matches(py_isspace);
    let moved = format!("{}{continuation}", &context[trimmed.len()..]);
    let whole = encode(tok, &format!("{trimmed}{moved}"))?;
    let ctx = encode(tok, trimmed)?;
    let split = ctx.len().min(whole.len());
    Ok(Request {
        context: ctx,
        continuation: whole[split..].to_vec(),
    })
}

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
        out.set_counts(task, counts);
        Ok(out)
    }
}
