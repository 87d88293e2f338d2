//! `tokenformer eval pile | tasks | merge`: language-model evaluation with
//! lm-evaluation-harness's methods
//! (<https://github.com/EleutherAI/lm-evaluation-harness>) and Hugging Face's
//! strided perplexity (<https://huggingface.co/docs/transformers/perplexity>).
//! The methods live in `tokenformer::eval`; this is arguments, progress and
//! output.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use indicatif::ProgressBar;
use serde_json::Value;
use tokenformer::eval::data::{
    sha256_file, DEFAULT_MAX_LINE_BYTES, NOTE_MAX_LINE_BYTES, NOTE_SKIP_BAD,
};
use tokenformer::eval::pile::{self, Method, PileOptions, PileReport, RunInfo};
use tokenformer::eval::tasks::{self, Task, TaskOptions, TaskReport};
use tokenformer::eval::{Report, Shard};
use tokenformer::loader;
use tokenformer::scoring::Scorer;

use super::{DeviceArgs, ModelArgs, WeightArgs};
use crate::cli::stdout::outln;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum MethodArg {
    /// lm-evaluation-harness `loglikelihood_rolling`: disjoint windows, every token scored once.
    Rolling,
    /// Hugging Face's fixed-length strided windows (no prefix token).
    Strided,
}

#[derive(Args, Debug)]
#[command(
    after_help = "JSONL lines are {\"text\": ..., \"meta\": {\"pile_set_name\": ...}} (meta optional); \
a .txt (or .txt.zst) file is one document. Perplexities are corpus-level: \
word_perplexity = exp(-Σll/Σwords), words = len(re.split(r\"\\s+\", text)); byte_perplexity and \
bits_per_byte over UTF-8 bytes; token_perplexity over scored tokens."
)]
pub struct PileArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub weights: WeightArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The Pile's val/test.jsonl.zst, or any .jsonl, .jsonl.zst, .parquet or .txt file (streamed), or hf://datasets/OWNER/NAME[@REV]/PATH.
    #[arg(long)]
    pub data: PathBuf,
    /// rolling: every token scored once in non-overlapping windows (the harness's
    /// loglikelihood_rolling); strided: Hugging Face's sliding-window perplexity (see --stride).
    #[arg(long, value_enum, default_value = "rolling")]
    pub method: MethodArg,
    /// Strided: tokens between window starts (default 512, at most the window length).
    #[arg(long)]
    pub stride: Option<usize>,
    /// Window length in tokens (default: the model's maximum positions).
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Windows per forward pass (from many documents; it changes results only in float rounding).
    #[arg(long, default_value_t = 8, value_parser = super::positive::<usize>)]
    pub batch_size: usize,
    /// At most this many (padded) tokens per forward pass (default: the window length).
    #[arg(long, value_parser = super::positive::<usize>)]
    pub max_batch_tokens: Option<usize>,
    /// Only documents with this meta.pile_set_name (e.g. "Pile-CC", "ArXiv").
    #[arg(long)]
    pub subset: Option<String>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// What part of the data to evaluate and where the numbers go (both commands).
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Only the first N documents (of those --subset selects, for `eval pile`).
    #[arg(long, value_parser = super::positive::<usize>)]
    pub limit: Option<usize>,
    /// Evaluate the deterministic I-th of N parts of the documents (I/N, 0-based); combine with `eval merge`.
    #[arg(long)]
    pub shard: Option<Shard>,
    /// Skip and count bad lines (bad JSON, no text, invalid UTF-8, longer than --max-line-bytes) instead of failing.
    #[arg(long)]
    pub skip_bad: bool,
    /// Longest line (a .txt: document) read, in bytes; a longer one is a bad line.
    #[arg(long, env = "TOKENFORMER_MAX_LINE_BYTES", default_value_t = DEFAULT_MAX_LINE_BYTES)]
    pub max_line_bytes: usize,
    /// Write every number to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn tasks_help() -> String {
    let mut s =
        String::from("Expected JSONL fields per task (original release or Hugging Face export):\n");
    for t in Task::ALL {
        s.push_str(&format!("  {:<14} {}\n", t.name(), t.fields()));
    }
    s.push_str(
        "Metrics as lm-evaluation-harness: acc (argmax of summed log-likelihood of \" \" + choice), \
acc_norm (divided by the choice's characters), their standard errors; lambada: acc (greedy target) and perplexity.",
    );
    s
}

#[derive(Args, Debug)]
#[command(after_help = tasks_help())]
pub struct TasksArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub weights: WeightArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Tasks, comma-separated, run with one model load: lambada_openai (lambada), hellaswag, piqa, arc_easy, arc_challenge, winogrande.
    #[arg(long, visible_alias = "task", value_delimiter = ',', required = true)]
    pub tasks: Vec<Task>,
    /// Each task's data, in the order of --tasks (repeat the flag): .jsonl, .jsonl.zst or .parquet, or hf://datasets/OWNER/NAME[@REV]/PATH.
    #[arg(long, required = true)]
    pub data: Vec<PathBuf>,
    /// PIQA: the answers file (valid-labels.lst, one 0/1 per line) when lines have no "label".
    #[arg(long)]
    pub labels: Option<PathBuf>,
    /// Maximum tokens per input (default: the model's maximum positions); longer inputs lose their left side.
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Requests per forward pass.
    #[arg(long, default_value_t = 16, value_parser = super::positive::<usize>)]
    pub batch_size: usize,
    /// At most this many (padded) tokens per forward pass (default: 2048 on the CPU,
    /// 32768 on a GPU).
    #[arg(long, value_parser = super::positive::<usize>)]
    pub max_batch_tokens: Option<usize>,
    /// Write every scored document to DIR/samples_<task>_<time>.jsonl, as lm-evaluation-harness's --log_samples.
    #[arg(long, value_name = "DIR")]
    pub log_samples: Option<PathBuf>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// `--json` results of `eval pile`/`eval tasks` (or ImageNet) shard runs.
    #[arg(required = true, num_args = 1..)]
    pub results: Vec<PathBuf>,
    /// Write the merged result to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A `--data` as a local file: `hf://datasets/OWNER/NAME[@REV]/PATH` is
/// fetched into the Hugging Face cache (or found there offline) first.
pub fn resolve_data(given: &Path) -> Result<PathBuf> {
    match given.to_str().filter(|s| s.starts_with(HF_SCHEME)) {
        Some(spec) => {
            Ok(tokenformer::hub::dataset::fetch(spec).with_context(|| format!("--data {spec}"))?)
        }
        None => Ok(given.to_path_buf()),
    }
}

/// The prefix of a `--data` on the Hub.
const HF_SCHEME: &str = "hf://";

/// The data file's sha256, hashed on another thread while the model runs.
fn spawn_sha256(path: &Path) -> std::thread::JoinHandle<tokenformer::Result<String>> {
    let p = path.to_path_buf();
    std::thread::spawn(move || sha256_file(&p))
}

fn progress_bar(len: u64, unit: &str) -> ProgressBar {
    let pb = super::progress::bar(
        len,
        &format!("{{elapsed_precise}} [{{bar:30}}] {{percent:>3}}% {unit} {{msg}} ETA {{eta}}"),
    );
    pb.enable_steady_tick(Duration::from_millis(500));
    pb
}

/// `f32` or `f16`, as the result files record it.
fn dtype_name(w: &WeightArgs) -> Option<String> {
    Some(w.name())
}

/// Largest result file `eval merge` reads (an ImageNet shard lists its
/// unreadable files; 50,000 paths are a few MB).
const MAX_RESULT_FILE_BYTES: u64 = 256 << 20;

/// Largest `--labels` file read (PIQA's is 4 KB).
const MAX_LABELS_FILE_BYTES: u64 = 256 << 20;

/// A library error with its notes on options put in this command's flags.
fn in_flag_words(e: tokenformer::Error) -> anyhow::Error {
    match e {
        tokenformer::Error::Input(m) => anyhow::Error::msg(
            m.replace(NOTE_MAX_LINE_BYTES, "(--max-line-bytes)")
                .replace(
                    NOTE_SKIP_BAD,
                    "(pass --skip-bad to skip and count bad lines)",
                )
                .replace(
                    tokenformer::eval::tasks::NOTE_LABELS,
                    "--labels valid-labels.lst",
                ),
        ),
        e => e.into(),
    }
}

fn write_json(path: &Path, v: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(v)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

pub fn pile_cmd(a: PileArgs) -> Result<()> {
    let dev = a.device.open()?;
    let given = a.data.clone();
    let path = resolve_data(&a.data)?;
    tokenformer::fsutil::regular_metadata(&path)?;
    let sha = spawn_sha256(&path);
    let files = a.model.locate()?;
    let tokenizer = loader::load_tokenizer(&files)?;
    let model = a
        .weights
        .load_lm(&files, &dev)
        .map_err(|e| super::gpu_memory_error(e, &dev, &format!("loading {}", files.source)))?;
    let scorer = Scorer::new(&model, a.max_length)?;
    let max_len = scorer.max_length();
    // One window per pass fills a CPU's products; a GPU needs the whole batch.
    let default_tokens = if dev.is_cpu() {
        max_len
    } else {
        max_len * a.batch_size.max(1)
    };
    let batch_tokens = a.max_batch_tokens.unwrap_or(default_tokens);
    let scorer = scorer.with_batch_tokens(batch_tokens);
    let method = match a.method {
        MethodArg::Rolling => Method::Rolling,
        MethodArg::Strided => Method::Strided {
            stride: a.stride.unwrap_or(512.min(max_len)),
        },
    };
    let opts = PileOptions {
        method,
        batch_size: a.batch_size.max(1),
        subset: a.subset.clone(),
        limit: a.run.limit,
        shard: a.run.shard.unwrap_or(Shard::WHOLE),
        skip_bad: a.run.skip_bad,
        prefix_token: model.config().eos_token_id,
        max_line_bytes: a.run.max_line_bytes,
    };
    let by_docs = a.run.limit.map(|l| l.div_ceil(opts.shard.count) as u64);
    let pb = progress_bar(
        by_docs.unwrap_or(std::fs::metadata(&path)?.len()),
        if by_docs.is_some() { "docs" } else { "of file" },
    );
    let start = Instant::now();
    let totals = pile::evaluate(&scorer, &tokenizer, &path, &opts, |p| {
        pb.set_position(if by_docs.is_some() {
            p.documents
        } else {
            p.file_position
        });
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        pb.set_message(format!(
            "{} docs, {} tokens, {:.0} tok/s",
            p.documents,
            p.tokens,
            p.tokens as f64 / secs
        ));
    })
    .map_err(in_flag_words)
    .map_err(|e| {
        let what = format!(
            "{} on batches of up to {} windows ({batch_tokens} tokens)",
            files.source, a.batch_size
        );
        super::gpu_memory_error(e, &dev, &what)
    })?;
    let elapsed = start.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let info = RunInfo {
        model: files.source.clone(),
        model_commit: tokenformer::eval::model_commit(&files),
        weight_dtype: dtype_name(&a.weights),
        device: tokenformer::device::device_name(&dev),
        data: given.display().to_string(),
        data_sha256: sha.join().expect("sha256 thread")?,
        max_length: max_len,
        elapsed_seconds: elapsed,
    };
    let report = PileReport::new(info, &opts, &totals);
    print_pile(&report)?;
    if let Some(p) = &a.run.json {
        write_json(p, &report.to_json())?;
    }
    Ok(())
}

/// Four decimals, or scientific notation for the huge perplexities of untrained models.
fn fmt_opt(x: Option<f64>) -> String {
    x.map_or_else(
        || "-".into(),
        |v| {
            if v.abs() < 1e6 {
                format!("{v:.4}")
            } else {
                format!("{v:.3e}")
            }
        },
    )
}

/// ` (commit X)` when the model came from the Hub cache.
fn commit_note(c: &Option<String>) -> String {
    c.as_ref()
        .map(|c| format!(" (commit {c})"))
        .unwrap_or_default()
}

fn print_pile(r: &PileReport) -> std::io::Result<()> {
    outln!(
        "{}{} on {} (method {}, max_length {}{}{})",
        r.model,
        commit_note(&r.model_commit),
        r.data,
        r.method,
        r.max_length,
        r.stride
            .map(|s| format!(", stride {s}"))
            .unwrap_or_default(),
        r.shard
            .as_ref()
            .map(|s| format!(", shard {s}"))
            .unwrap_or_default(),
    )?;
    outln!(
        "{:<22} {:>8} {:>12} {:>11} {:>12} {:>11} {:>11} {:>9} {:>10}",
        "subset",
        "docs",
        "tokens",
        "words",
        "bytes",
        "word_ppl",
        "byte_ppl",
        "bpb",
        "token_ppl"
    )?;
    let row = |name: &str, m: &pile::Metrics| {
        outln!(
            "{:<22} {:>8} {:>12} {:>11} {:>12} {:>11} {:>11} {:>9} {:>10}",
            name,
            m.counts.documents,
            m.counts.tokens,
            m.counts.words,
            m.counts.bytes,
            fmt_opt(m.word_perplexity),
            fmt_opt(m.byte_perplexity),
            fmt_opt(m.bits_per_byte),
            fmt_opt(m.token_perplexity)
        )
    };
    for (k, m) in &r.subsets {
        row(k, m)?;
    }
    row("overall", &r.metrics)?;
    if r.skipped_lines > 0 {
        outln!("skipped {} bad line(s)", r.skipped_lines)?;
    }
    outln!(
        "loglikelihood {:.4}  elapsed {:.1}s  {:.1} tokens/s",
        r.metrics.counts.loglikelihood,
        r.elapsed_seconds,
        r.tokens_per_second
    )?;
    Ok(())
}

pub fn tasks_cmd(a: TasksArgs) -> Result<()> {
    let dev = a.device.open()?;
    let mut seen = Vec::new();
    for t in &a.tasks {
        if seen.contains(t) {
            anyhow::bail!("--tasks: {} is given twice", t.name());
        }
        seen.push(*t);
    }
    if a.data.len() != a.tasks.len() {
        anyhow::bail!(
            "--tasks names {} task(s) but --data gives {} file(s): give one --data per task, in the order of --tasks",
            a.tasks.len(),
            a.data.len()
        );
    }
    if a.labels.is_some() && !a.tasks.contains(&Task::Piqa) {
        anyhow::bail!("--labels is PIQA's answers file, but --tasks has no piqa");
    }
    let data = a
        .data
        .iter()
        .map(|d| resolve_data(d))
        .collect::<Result<Vec<_>>>()?;
    for d in &data {
        tokenformer::fsutil::regular_metadata(d)?;
    }
    let (labels, labels_sha256) = match &a.labels {
        Some(p) => {
            let text = tokenformer::fsutil::read_to_string_bounded(p, MAX_LABELS_FILE_BYTES)?;
            let lines = text
                .lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>();
            (Some(lines), Some(sha256_file(p)?))
        }
        None => (None, None),
    };
    if let Some(dir) = &a.log_samples {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let files = a.model.locate()?;
    let tokenizer = loader::load_tokenizer(&files)?;
    let model = a
        .weights
        .load_lm(&files, &dev)
        .map_err(|e| super::gpu_memory_error(e, &dev, &format!("loading {}", files.source)))?;
    let opts = TaskOptions {
        batch_size: a.batch_size.max(1),
        limit: a.run.limit,
        shard: a.run.shard.unwrap_or(Shard::WHOLE),
        skip_bad: a.run.skip_bad,
        prefix_token: model.config().eos_token_id,
        max_line_bytes: a.run.max_line_bytes,
    };
    let batch_tokens = a
        .max_batch_tokens
        .unwrap_or(if dev.is_cpu() { 2048 } else { 32768 });
    let mut reports = Vec::new();
    for ((&task, given), path) in a.tasks.iter().zip(&a.data).zip(&data) {
        let sha = spawn_sha256(path);
        let scorer = Scorer::new(&model, a.max_length)?
            .with_greedy(task == Task::Lambada)
            .with_batch_tokens(batch_tokens);
        let task_labels = if task == Task::Piqa {
            labels.as_deref()
        } else {
            None
        };
        let pb = progress_bar(0, "tokens");
        pb.set_prefix(task.name());
        let start = Instant::now();
        let run = tasks::evaluate_full(
            &scorer,
            &tokenizer,
            task,
            path,
            task_labels,
            &opts,
            a.log_samples.is_some(),
            |done, total| {
                pb.set_length(total);
                pb.set_position(done);
                let secs = start.elapsed().as_secs_f64().max(1e-9);
                pb.set_message(format!("{} {:.0} tok/s", task.name(), done as f64 / secs));
            },
        )
        .map_err(in_flag_words)
        .map_err(|e| {
            let what = format!(
                "{} on {} at up to {} requests ({} tokens) a batch",
                files.source,
                task.name(),
                a.batch_size,
                batch_tokens
            );
            super::gpu_memory_error(e, &dev, &what)
        })?;
        pb.finish_and_clear();
        let info = RunInfo {
            model: files.source.clone(),
            model_commit: tokenformer::eval::model_commit(&files),
            weight_dtype: dtype_name(&a.weights),
            device: tokenformer::device::device_name(&dev),
            data: given.display().to_string(),
            data_sha256: sha.join().expect("sha256 thread")?,
            max_length: scorer.max_length(),
            elapsed_seconds: start.elapsed().as_secs_f64(),
        };
        let mut report = TaskReport::new(info, task, &opts, run.counts);
        report.documents_in_data = Some(run.documents_in_data);
        // An explicit `--shard 0/1` is recorded as given.
        report.shard = a.run.shard.map(|s| s.to_string());
        if let (Some(p), Some(sha), Task::Piqa) = (&a.labels, &labels_sha256, task) {
            report = report.with_labels(p.display().to_string(), sha.clone());
        }
        if let Some(dir) = &a.log_samples {
            write_samples(dir, task, &run.samples)?;
        }
        print_task(&report)?;
        reports.push(report);
    }
    if let Some(p) = &a.run.json {
        let v = match reports.as_slice() {
            [one] => one.to_json(),
            many => tasks::multi_task_json(many),
        };
        write_json(p, &v)?;
    }
    Ok(())
}

/// `DIR/samples_<task>_<time>.jsonl`, one harness sample record per line.
fn write_samples(dir: &Path, task: Task, samples: &[tasks::Sample]) -> Result<()> {
    use std::io::Write;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let path = dir.join(format!(
        "samples_{}_{}.jsonl",
        task.name(),
        tokenformer::eval::harness::date_id(now)
    ));
    let f = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    for s in samples {
        serde_json::to_writer(&mut w, &s.to_harness(task))?;
        w.write_all(b"\n")?;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))
}

fn print_task(r: &TaskReport) -> std::io::Result<()> {
    let pm = |v: Option<f64>, e: Option<f64>| match (v, e) {
        (Some(v), Some(e)) => format!("{v:.4} ± {e:.4}"),
        (Some(v), None) => format!("{v:.4}"),
        _ => "-".into(),
    };
    outln!(
        "{} on {}{} ({} documents{})",
        r.task,
        r.model,
        commit_note(&r.model_commit),
        r.counts.documents,
        r.shard
            .as_ref()
            .map(|s| format!(", shard {s}"))
            .unwrap_or_default()
    )?;
    outln!("  acc        {}", pm(r.acc, r.acc_stderr))?;
    if r.acc_norm.is_some() {
        outln!("  acc_norm   {}", pm(r.acc_norm, r.acc_norm_stderr))?;
    }
    if let Some(p) = r.perplexity {
        outln!("  perplexity {p:.4}")?;
    }
    if r.counts.skipped_lines > 0 {
        outln!("  skipped {} bad line(s)", r.counts.skipped_lines)?;
    }
    Ok(())
}

pub fn merge_cmd(a: MergeArgs) -> Result<()> {
    let parts = a
        .results
        .iter()
        .map(|p| {
            let text = tokenformer::fsutil::read_to_string_bounded(p, MAX_RESULT_FILE_BYTES)?;
            serde_json::from_str::<Value>(&text)
                .with_context(|| format!("{}: not JSON", p.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let merged = tokenformer::eval::merge::merge_results(&parts).with_context(|| {
        let names: Vec<String> = a
            .results
            .iter()
            .enumerate()
            .map(|(i, p)| format!("#{} {}", i + 1, p.display()))
            .collect();
        format!("merging {}", names.join(", "))
    })?;
    match merged.get("kind").and_then(Value::as_str) {
        Some(PileReport::KIND) => print_pile(&serde_json::from_value(merged.clone())?)?,
        Some(TaskReport::KIND) => match merged.get("tasks") {
            Some(list) => {
                for r in serde_json::from_value::<Vec<TaskReport>>(list.clone())? {
                    print_task(&r)?;
                }
            }
            None => print_task(&serde_json::from_value(merged.clone())?)?,
        },
        _ => outln!("{}", serde_json::to_string_pretty(&merged)?)?,
    }
    if let Some(p) = &a.json {
        write_json(p, &merged)?;
    }
    Ok(())
}
