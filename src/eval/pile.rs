//! Corpus perplexity of documents (the Pile's `val/test.jsonl.zst`, any
//! `.jsonl[.zst]`, or a `.txt` as one document), streamed line by line.
//!
//! Methods follow lm-evaluation-harness exactly
//! (<https://github.com/EleutherAI/lm-evaluation-harness>): `rolling` is
//! `loglikelihood_rolling` = `get_rolling_token_windows(context_len=1)` +
//! `make_disjoint_window`, with the EOS id as prefix token; the metrics are its
//! perplexity-task aggregations (`weighted_perplexity` over words and bytes,
//! `bits_per_byte`; words = `len(re.split(r"\s+", text))`). `strided` is Hugging
//! Face's "Perplexity of fixed-length models"
//! (<https://huggingface.co/docs/transformers/perplexity>), per document.
//!
//! Reading is bounded ([`super::data`]): a line longer than
//! [`PileOptions::max_line_bytes`] is a bad line, an error naming it or, with
//! `skip_bad`, skipped and counted. A non-finite log-likelihood (a model that
//! outputs NaN) is an error naming the document, never a number in the report.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::data::{non_finite, NOTE_SKIP_BAD};
use super::harness::{self, RunConfig, TaskEntry};
use super::report::{
    add_checked, check_loglikelihood, check_seconds, merged_devices, one_shard, run_settings,
    Report, Setting,
};
use crate::error::{Error, Result};
use crate::scoring::{Request, Scorer};

// Kept here too for callers that found them in this module before it was split.
pub use super::data::{
    sha256_file, DataFile, JsonLines, Line, DEFAULT_MAX_LINE_BYTES, MAX_ZSTD_WINDOW_LOG,
};
pub use super::pytext::{count_words, py_isspace};
pub use super::report::RunInfo;
pub use super::shard::Shard;

/// How documents longer than one window are scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Disjoint windows, every token scored once (the harness).
    Rolling,
    /// Windows every `stride` tokens, no prefix token (Hugging Face's guide).
    Strided {
        /// Tokens between window starts (1 ..= the window length).
        stride: usize,
    },
}

impl Method {
    /// The method's name in results (`rolling`, `strided`).
    pub fn name(&self) -> &'static str {
        match self {
            Method::Rolling => "rolling",
            Method::Strided { .. } => "strided",
        }
    }
}

/// The harness's rolling windows as disjoint (context, continuation) pairs:
/// the first `max_len` tokens given `[prefix]`, then each next `max_len` tokens
/// given the one preceding token, the last partial window right-aligned to a
/// full `max_len` input (its extra tokens become context).
pub fn rolling_windows(tokens: &[u32], prefix: u32, max_len: usize) -> Vec<Request> {
    assert!(max_len >= 1, "max_len must be positive");
    let n = tokens.len();
    let mut out = Vec::with_capacity(n.div_ceil(max_len));
    if n == 0 {
        return out;
    }
    let first = max_len.min(n);
    out.push(Request {
        context: vec![prefix],
        continuation: tokens[..first].to_vec(),
    });
    let mut predicted = first;
    while predicted < n {
        let len = (n - predicted).min(max_len);
        let end = predicted + len;
        // Input tokens[end-max_len-1 .. end-1]; disjoint: context ends at end-len.
        out.push(Request {
            context: tokens[end - max_len - 1..end - len].to_vec(),
            continuation: tokens[end - len..end].to_vec(),
        });
        predicted += len;
    }
    out
}

/// Hugging Face's strided windows: inputs `tokens[begin..begin+max_len]` for
/// begin = 0, S, 2S, ... until one reaches the end; each scores its tokens
/// after the previous window's end (never its own first token).
pub fn strided_windows(tokens: &[u32], max_len: usize, stride: usize) -> Vec<Request> {
    assert!(
        max_len >= 1 && (1..=max_len).contains(&stride),
        "1 <= stride <= max_len"
    );
    let n = tokens.len();
    let mut out = Vec::new();
    let mut prev_end = 0;
    let mut begin = 0;
    while begin < n {
        let end = (begin + max_len).min(n);
        let first_scored = prev_end.max(begin + 1);
        if first_scored < end {
            out.push(Request {
                context: tokens[begin..first_scored].to_vec(),
                continuation: tokens[first_scored..end].to_vec(),
            });
        }
        prev_end = end;
        if end == n {
            break;
        }
        begin += stride;
    }
    out
}

/// Scored log-likelihood and the sizes it is normalised by.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    /// Σ log-likelihood of the scored tokens (natural log).
    pub loglikelihood: f64,
    /// Documents scored.
    pub documents: u64,
    /// Scored tokens.
    pub tokens: u64,
    /// Words as the harness counts them ([`count_words`]).
    pub words: u64,
    /// UTF-8 bytes.
    pub bytes: u64,
}

impl Counts {
    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &Counts) {
        self.loglikelihood += o.loglikelihood;
        self.documents += o.documents;
        self.tokens += o.tokens;
        self.words += o.words;
        self.bytes += o.bytes;
    }
    /// The metrics; a ratio over a zero count is `None`.
    pub fn metrics(&self) -> Metrics {
        let per = |n: u64| (n > 0).then(|| -self.loglikelihood / n as f64);
        Metrics {
            counts: self.clone(),
            word_perplexity: per(self.words).map(f64::exp),
            byte_perplexity: per(self.bytes).map(f64::exp),
            bits_per_byte: per(self.bytes).map(|x| x / std::f64::consts::LN_2),
            token_perplexity: per(self.tokens).map(f64::exp),
        }
    }
}

/// Counts plus the perplexities derived from them (the JSON fields).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    #[serde(flatten)]
    /// The sums the metrics come from.
    pub counts: Counts,
    /// exp(−Σll / Σwords).
    pub word_perplexity: Option<f64>,
    /// exp(−Σll / Σbytes).
    pub byte_perplexity: Option<f64>,
    /// −Σll / Σbytes / ln 2.
    pub bits_per_byte: Option<f64>,
    /// exp(−Σll / Σtokens).
    pub token_perplexity: Option<f64>,
}

/// What to evaluate and how.
#[derive(Clone, Debug)]
pub struct PileOptions {
    /// How long documents are windowed.
    pub method: Method,
    /// Windows per forward pass.
    pub batch_size: usize,
    /// Only documents whose `meta.pile_set_name` is this.
    pub subset: Option<String>,
    /// Only the first N (selected) documents.
    pub limit: Option<usize>,
    /// The part of the documents this run scores.
    pub shard: Shard,
    /// Skip (and count) bad lines instead of failing.
    pub skip_bad: bool,
    /// The token the first rolling window is conditioned on (EOS for GPT-NeoX).
    pub prefix_token: u32,
    /// Lines (a `.txt`: the document) longer than this many bytes are bad lines.
    pub max_line_bytes: usize,
}

/// Totals of one evaluation (or of merged shards).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PileTotals {
    /// Every document of the run.
    pub overall: Counts,
    /// Per `meta.pile_set_name`.
    pub subsets: BTreeMap<String, Counts>,
    /// Bad lines skipped under `skip_bad` (each counted by one shard only).
    pub skipped_lines: u64,
}

/// Progress after each scored batch.
#[derive(Clone, Copy, Debug)]
pub struct PileProgress {
    /// Tokens scored so far.
    pub tokens: u64,
    /// Documents of this shard scored (interpolated within a pass).
    pub documents: u64,
    /// Bytes of the data file read so far, of `file_size`.
    pub file_position: u64,
    /// The data file's size in bytes.
    pub file_size: u64,
}

/// Windows waiting to be scored in one sorted, batched pass.
const PENDING_BATCHES: usize = 32;

/// Windows read but not yet scored, and the progress reported so far.
struct Pending<'a> {
    scorer: &'a Scorer<'a>,
    batch_size: usize,
    /// Bytes of the data file read, updated by the reader.
    position: Arc<AtomicU64>,
    windows: Vec<Request>,
    /// Per window, the index of its document's subset.
    owners: Vec<usize>,
    /// Per window, its document's line in the data file.
    lines: Vec<usize>,
    path: &'a Path,
    done: PileProgress,
}

impl Pending<'_> {
    /// Scores the pending windows into `per_subset`; `read_documents` is how
    /// many documents the windows so far come from.
    fn flush(
        &mut self,
        read_documents: u64,
        per_subset: &mut [Counts],
        progress: &mut impl FnMut(PileProgress),
    ) -> Result<()> {
        let (pos0, docs0) = (self.done.file_position, self.done.documents);
        let (pos1, docs1) = (self.position.load(Ordering::Relaxed), read_documents);
        if !self.windows.is_empty() {
            // Progress between reads is interpolated by scored tokens.
            let total: usize = self.windows.iter().map(|r| r.continuation.len()).sum();
            let mut scored_here = 0usize;
            let done = &mut self.done;
            let scored = self.scorer.score_all(&self.windows, self.batch_size, |n| {
                scored_here += n;
                let f = scored_here as f64 / total.max(1) as f64;
                done.tokens += n as u64;
                done.file_position = pos0 + (pos1.saturating_sub(pos0) as f64 * f) as u64;
                done.documents = docs0 + ((docs1 - docs0) as f64 * f) as u64;
                progress(*done);
            })?;
            for (((s, r), &o), &line) in scored
                .iter()
                .zip(&self.windows)
                .zip(&self.owners)
                .zip(&self.lines)
            {
                if !s.logprob.is_finite() {
                    return Err(non_finite(self.path, line, s.logprob));
                }
                per_subset[o].loglikelihood += s.logprob;
                per_subset[o].tokens += r.continuation.len() as u64;
            }
            self.windows.clear();
            self.owners.clear();
            self.lines.clear();
        }
        self.done.file_position = pos1;
        self.done.documents = docs1;
        progress(self.done);
        Ok(())
    }
}

/// A document line: its number and (text, pile_set_name), or why it is bad.
type DocLine = (usize, std::result::Result<(String, Option<String>), String>);

/// Evaluates the documents of `path` (streamed) with `scorer`.
pub fn evaluate(
    scorer: &Scorer,
    tokenizer: &tokenizers::Tokenizer,
    path: &Path,
    opts: &PileOptions,
    mut progress: impl FnMut(PileProgress),
) -> Result<PileTotals> {
    let max_len = scorer.max_length();
    if let Method::Strided { stride } = opts.method {
        if stride == 0 || stride > max_len {
            return Err(Error::input(format!(
                "stride {stride} must be between 1 and the window length {max_len}"
            )));
        }
    }
    let mut file = DataFile::open_with(path, opts.max_line_bytes)?;
    let position = file.position.clone();
    let size = file.size;
    let where_ = |line: usize| format!("{} line {line}", path.display());
    let mut docs: Box<dyn Iterator<Item = Result<DocLine>>> = if file.is_text {
        let raw = file.read_document()?;
        if raw.is_empty() {
            return Err(Error::input(format!(
                "{}: the file is empty",
                path.display()
            )));
        }
        let doc = String::from_utf8(raw)
            .map(|t| (t, None))
            .map_err(|e| format!("invalid UTF-8 at byte {}", e.utf8_error().valid_up_to()));
        if let Err(e) = &doc {
            return Err(Error::input(format!("{}: {e}", path.display())));
        }
        Box::new(std::iter::once(Ok((1, doc))))
    } else {
        Box::new(JsonLines::new(file).map(|r| r.map(|(line, v)| (line, v.and_then(pile_document)))))
    };

    let mut totals = PileTotals::default();
    let mut subset_ids: Vec<Option<String>> = Vec::new();
    let mut per_subset: Vec<Counts> = Vec::new();
    let mut pending = Pending {
        scorer,
        batch_size: opts.batch_size,
        position,
        windows: Vec::new(),
        owners: Vec::new(),
        lines: Vec::new(),
        path,
        done: PileProgress {
            tokens: 0,
            documents: 0,
            file_position: 0,
            file_size: size,
        },
    };
    let mut selected = 0usize;
    let mut lines_seen = 0usize;
    let mut bad_lines = 0usize;
    let mut read_documents = 0u64;

    for item in docs.by_ref() {
        let (line, doc) = item?;
        lines_seen += 1;
        let (text, subset) = match doc {
            Ok(d) => d,
            Err(reason) => {
                if !opts.skip_bad {
                    return Err(Error::input(format!(
                        "{}: {reason} {NOTE_SKIP_BAD}",
                        where_(line)
                    )));
                }
                bad_lines += 1;
                if opts.shard.owns(line) {
                    totals.skipped_lines += 1;
                }
                continue;
            }
        };
        if opts.subset.is_some() && opts.subset != subset {
            continue;
        }
        if opts.limit.is_some_and(|l| selected >= l) {
            break;
        }
        let k = selected;
        selected += 1;
        if !opts.shard.owns(k) {
            continue;
        }
        let owner = match subset_ids.iter().position(|s| *s == subset) {
            Some(i) => i,
            None => {
                subset_ids.push(subset);
                per_subset.push(Counts::default());
                subset_ids.len() - 1
            }
        };
        let c = &mut per_subset[owner];
        c.documents += 1;
        c.words += count_words(&text);
        c.bytes += text.len() as u64;
        read_documents += 1;
        let ids = tokenizer
            .encode_fast(text.as_str(), false)
            .map_err(|e| Error::input(format!("{}: cannot tokenize: {e}", where_(line))))?
            .get_ids()
            .to_vec();
        drop(text);
        let windows = match opts.method {
            Method::Rolling => rolling_windows(&ids, opts.prefix_token, max_len),
            Method::Strided { stride } => strided_windows(&ids, max_len, stride),
        };
        pending
            .owners
            .extend(std::iter::repeat_n(owner, windows.len()));
        pending
            .lines
            .extend(std::iter::repeat_n(line, windows.len()));
        pending.windows.extend(windows);
        if pending.windows.len() >= opts.batch_size.max(1) * PENDING_BATCHES {
            pending.flush(read_documents, &mut per_subset, &mut progress)?;
        }
    }
    pending.flush(read_documents, &mut per_subset, &mut progress)?;

    if lines_seen == 0 {
        return Err(Error::input(format!(
            "{}: the file is empty (no JSON lines)",
            path.display()
        )));
    }
    if selected == 0 {
        // A file whose lines were all skipped as bad has nothing to measure: a
        // report of zero documents would read as a result.
        let skipped = match bad_lines {
            0 => String::new(),
            n => format!(" ({n} of its {lines_seen} lines skipped as bad)"),
        };
        return Err(Error::input(match &opts.subset {
            Some(s) => format!(
                "{}: no document has pile_set_name `{s}`{skipped}",
                path.display()
            ),
            None => format!("{}: no documents{skipped}", path.display()),
        }));
    }
    for (name, c) in subset_ids.into_iter().zip(per_subset) {
        totals.overall.add(&c);
        if let Some(name) = name {
            totals.subsets.entry(name).or_default().add(&c);
        }
    }
    Ok(totals)
}

/// `text` and `meta.pile_set_name` of a Pile line, or why it is not one.
fn pile_document(v: Value) -> std::result::Result<(String, Option<String>), String> {
    let Value::Object(mut m) = v else {
        return Err("not a JSON object".into());
    };
    let subset = m
        .get("meta")
        .and_then(|meta| meta.get("pile_set_name"))
        .and_then(Value::as_str)
        .map(str::to_string);
    match m.remove("text") {
        Some(Value::String(t)) => Ok((t, subset)),
        Some(_) => Err("field `text` is not a string".into()),
        None => Err("no `text` field".into()),
    }
}

/// `--json` of `eval pile` (and of `eval merge` over its shards).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PileReport {
    /// Always `"pile"`; `eval merge` dispatches on it.
    pub kind: String,
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
    /// The line limit of the run (`--max-line-bytes`).
    #[serde(default)]
    pub max_line_bytes: Option<usize>,
    /// `rolling` or `strided`.
    pub method: String,
    /// Window length in tokens.
    pub max_length: usize,
    /// Strided only.
    pub stride: Option<usize>,
    /// Rolling only: the token the first window is conditioned on.
    pub prefix_token: Option<u32>,
    /// Only documents of this `meta.pile_set_name`.
    pub subset: Option<String>,
    /// Only the first N (selected) documents.
    pub limit: Option<usize>,
    /// `I/N` of a shard; `None` for a whole run or a merge.
    pub shard: Option<String>,
    /// How many shard results a merge combined (absent for a run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_shards: Option<usize>,
    /// Windows per forward pass.
    pub batch_size: usize,
    /// Bad lines skipped (each counted by one shard only).
    pub skipped_lines: u64,
    #[serde(flatten)]
    /// Every document of the run.
    pub metrics: Metrics,
    /// Per `meta.pile_set_name`.
    pub subsets: BTreeMap<String, Metrics>,
    /// Seconds of evaluation (a merge: the sum over shards).
    pub elapsed_seconds: f64,
    /// Scored tokens per second of `elapsed_seconds`.
    pub tokens_per_second: f64,
}

impl PileReport {
    /// The report of a run with `opts` whose totals are `totals`.
    pub fn new(info: RunInfo, opts: &PileOptions, totals: &PileTotals) -> Self {
        let mut r = Self {
            kind: Self::KIND.into(),
            model: info.model,
            model_commit: info.model_commit,
            weight_dtype: info.weight_dtype,
            device: Some(info.device),
            data: info.data,
            data_sha256: info.data_sha256,
            max_line_bytes: Some(opts.max_line_bytes),
            method: opts.method.name().into(),
            max_length: info.max_length,
            stride: match opts.method {
                Method::Strided { stride } => Some(stride),
                Method::Rolling => None,
            },
            prefix_token: (opts.method == Method::Rolling).then_some(opts.prefix_token),
            subset: opts.subset.clone(),
            limit: opts.limit,
            shard: (opts.shard != Shard::WHOLE).then(|| opts.shard.to_string()),
            merged_shards: None,
            batch_size: opts.batch_size,
            skipped_lines: 0,
            metrics: Counts::default().metrics(),
            subsets: BTreeMap::new(),
            elapsed_seconds: info.elapsed_seconds,
            tokens_per_second: 0.0,
        };
        r.set_totals(totals);
        r
    }

    /// Replaces every number derived from the totals.
    pub fn set_totals(&mut self, t: &PileTotals) {
        self.skipped_lines = t.skipped_lines;
        self.metrics = t.overall.metrics();
        self.subsets = t
            .subsets
            .iter()
            .map(|(k, c)| (k.clone(), c.metrics()))
            .collect();
        self.tokens_per_second = if self.elapsed_seconds > 0.0 {
            t.overall.tokens as f64 / self.elapsed_seconds
        } else {
            0.0
        };
    }

    /// The run's entries in lm-evaluation-harness's results layout: `pile`
    /// for every document, and each subset as the harness's `pile_*` task
    /// ([`harness::pile_task_name`]). `n-samples.original` is known when
    /// every document was scored (no `limit`, not one shard).
    pub fn harness_entries(&self) -> Vec<TaskEntry> {
        let whole = self.limit.is_none() && self.shard.is_none();
        let entry = |name: String, m: &Metrics| {
            let metric = |name, value| harness::Metric {
                name,
                value,
                stderr: None,
                higher_is_better: false,
            };
            TaskEntry {
                name,
                version: 2.0,
                dataset_path: "EleutherAI/pile",
                dataset_name: None,
                split: None,
                output_type: "loglikelihood_rolling",
                metrics: vec![
                    metric("word_perplexity", m.word_perplexity),
                    metric("byte_perplexity", m.byte_perplexity),
                    metric("bits_per_byte", m.bits_per_byte),
                ],
                original: whole.then_some(m.counts.documents),
                effective: m.counts.documents,
            }
        };
        let mut out = vec![entry("pile".into(), &self.metrics)];
        for (k, m) in &self.subsets {
            let name = harness::pile_task_name(k);
            // Two subset names that the harness names alike keep their own names.
            let name = if out.iter().any(|e| e.name == name) {
                format!("pile_{k}")
            } else {
                name
            };
            out.push(entry(name, m));
        }
        out
    }

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

    /// The totals this report was made from.
    pub fn totals(&self) -> PileTotals {
        PileTotals {
            overall: self.metrics.counts.clone(),
            subsets: self
                .subsets
                .iter()
                .map(|(k, m)| (k.clone(), m.counts.clone()))
                .collect(),
            skipped_lines: self.skipped_lines,
        }
    }
}

impl Report for PileReport {
    const KIND: &'static str = "pile";

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
        let mut s = run.to_vec();
        s.extend([
            Setting::new(
                "method/max_length/stride/prefix_token",
                (
                    &self.method,
                    self.max_length,
                    self.stride,
                    self.prefix_token,
                ),
            ),
            Setting::new("subset/limit", (&self.subset, self.limit)),
            Setting::new("max_line_bytes", self.max_line_bytes),
        ]);
        s
    }

    fn to_json(&self) -> Value {
        let flat = serde_json::to_value(self).expect("serialisable");
        harness::with_blocks(
            flat,
            harness::blocks(&self.harness_entries(), &self.run_config()),
        )
    }

    /// Each count possible, the subsets within the whole.
    fn check_counts(&self, i: usize) -> Result<()> {
        let t = self.totals();
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
        check_seconds(i, self.elapsed_seconds)
    }

    fn combine(parts: &[Self], n: usize) -> Result<Self> {
        let mut totals = PileTotals::default();
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
        }
        let mut out = parts[0].clone();
        out.shard = None;
        out.merged_shards = Some(n);
        out.elapsed_seconds = parts.iter().map(|p| p.elapsed_seconds).sum();
        out.device = merged_devices(parts.iter().map(|p| p.device.as_deref()));
        out.set_totals(&totals);
        Ok(out)
    }
}
