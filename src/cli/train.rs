//! `tokenformer train`: train a language model on text, from a checkpoint or from a
//! fresh initialisation, with checkpoints, resume, held-out evaluation, `metrics.jsonl`
//! and a progress bar.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::cli::stdout::outln;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use serde_json::Value;
use tokenformer::card::ModelCard;
use tokenformer::loader::{self, LocateOptions};
use tokenformer::train::plot::Curve;
use tokenformer::train::trainer::{self, Augment, TrainOptions};
use tokenformer::train::trainer::{Fed, LmSource, Source, Trainable};
use tokenformer::train::{
    lm::init_tensors, LmTrainer, Split, StepReport, TokenWindows, TrainableLm,
};
use tokenformer::DeviceSpec;

/// What a training step computes in.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Precision {
    #[default]
    F32,
    Bf16Mixed,
}

impl Precision {
    fn compute(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16Mixed => DType::BF16,
        }
    }
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Model to start from: zoo name, Hub repo or local folder/file (or --init). With
    /// --resume: the weights to continue with, e.g. the checkpoint grown by
    /// `tokenformer-convert grow` (old tokens keep their optimiser moments, new ones
    /// start at zero).
    #[arg(long, short, conflicts_with = "init")]
    pub model: Option<String>,
    /// Start from fresh weights for this config.json (official init, --seed).
    #[arg(long, conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Continue the run of this checkpoint (or of the newest checkpoint in this folder)
    /// with its recorded settings; --steps may extend it.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Training data. Language models: .txt (one document), .jsonl or .jsonl.zst (`text`
    /// field), repeatable. Classifiers: a folder of class folders, or one holding `train/`
    /// (and `val/`, used for validation unless --val-data names another). Vision-language
    /// models: a .jsonl of `{"image", "text"}` pairs, image paths relative to the file.
    /// With --distill-from: the calibration data, one text file (.txt, or the `text` of
    /// .jsonl/.jsonl.zst/.parquet documents) or a folder of photos, local or
    /// hf://datasets/OWNER/NAME[@REV]/PATH (default: the samples shipped with the tool).
    #[arg(long, required_unless_present = "distill_from")]
    pub data: Vec<PathBuf>,
    /// Held-out text for validation (same formats; with --distill-from also a folder of
    /// photos or hf://datasets/…, default: the shipped eval samples).
    #[arg(long, conflicts_with = "val_fraction")]
    pub val_data: Option<PathBuf>,
    /// Hold out this fraction of the training documents for validation instead.
    #[arg(long)]
    pub val_fraction: Option<f64>,
    /// Validation windows (classifiers: images) evaluated at most (the first ones).
    #[arg(long, default_value_t = 64, value_parser = super::positive::<usize>)]
    pub val_windows: usize,
    /// Output folder: checkpoint-NNNNNN/ folders and metrics.jsonl.
    #[arg(long)]
    pub out: PathBuf,
    /// tokenizer.json (needed with --init; default: the model's).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Optimiser steps in all (default 1000; with --resume, the run's own count unless
    /// this extends it).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Peak learning rate (default 6e-4; with --distill-from 1e-3).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Learning rate at the end of the cosine decay.
    #[arg(long, default_value_t = 6e-5)]
    pub min_lr: f64,
    /// Steps of linear warm-up.
    #[arg(long, default_value_t = 10)]
    pub warmup_steps: u64,
    /// AdamW betas, `B1,B2`.
    #[arg(long, default_value = "0.9,0.95")]
    pub betas: String,
    /// AdamW epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// Decoupled weight decay (matrices only; norms are not decayed).
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Global gradient-norm bound (0 = no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad: f64,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Micro-batches per optimiser step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Seed of the fresh initialisation (--init).
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// What trains: `all` (default), `new` (the parameter tokens appended by the last
    /// growth), `bridge` (a merged model's bridge tokens), or comma-separated
    /// tensor-name globs (`layers.*.mlp.*`). With --resume: the run's own unless given.
    #[arg(long)]
    pub train: Option<String>,
    /// Grow every Pattention layer after step STEP to SPEC tokens (`ffn=1024` or
    /// `qkv=256,proj=256,ffn=1024`; zero keys, √n kept: the function is unchanged).
    /// Repeatable.
    #[arg(long, value_name = "STEP:SPEC")]
    pub grow_at: Vec<String>,
    /// Classifiers: the random-resized crop's area range, `MIN,MAX` (timm's --scale).
    #[arg(long, default_value = "0.08,1")]
    pub scale: String,
    /// Classifiers: probability of a horizontal flip (timm's --hflip).
    #[arg(long, default_value_t = 0.5)]
    pub hflip: f64,
    /// Save a checkpoint every N steps (and always at the end).
    #[arg(long, default_value_t = 500, value_parser = super::positive::<u64>)]
    pub save_every: u64,
    /// Evaluate on the held-out text every N steps (and at the end).
    #[arg(long, default_value_t = 100, value_parser = super::positive::<u64>)]
    pub eval_every: u64,
    /// Keep only the newest K checkpoints (0 = keep all).
    #[arg(long, default_value_t = 0)]
    pub keep_last: usize,
    /// Print a JSON summary on stdout at the end.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub device: super::DeviceArgs,
    /// f32, or bf16-mixed: f32 weights and AdamW state, the forward and backward in bf16
    /// with norms, softmaxes and the loss in f32 (for GPUs; on the CPU several times
    /// slower than f32).
    #[arg(long, value_enum, default_value_t)]
    pub precision: Precision,
    /// Train --model to behave like SOURCE, the Transformer it was imported from (a
    /// GPT-NeoX/Pythia or ViT folder in transformers or timm layout, or a Hub repo id):
    /// `tokenformer-convert import --recover-steps`'s distillation (KL of the outputs plus
    /// --hidden-weight × each layer's hidden-state MSE) for --steps steps on --data, the
    /// held-out loss on --val-data. Writes checkpoint-NNNNNN/ (no optimiser state),
    /// metrics.jsonl and loss.png into --out.
    #[arg(
        long,
        value_name = "SOURCE",
        requires = "model",
        conflicts_with_all = [
            "resume", "init", "val_fraction", "train", "grow_at", "scale", "hflip",
            "precision", "min_lr", "warmup_steps", "weight_decay", "betas", "eps",
            "grad_accum", "seq_len", "seed", "save_every", "eval_every", "keep_last",
        ]
    )]
    pub distill_from: Option<String>,
    /// Weight of --distill-from's hidden-state term: each layer's MSE relative to the
    /// source's mean square there, averaged over layers (0: logits only).
    #[arg(
        long,
        value_name = "W",
        default_value_t = 1.0,
        requires = "distill_from"
    )]
    pub hidden_weight: f64,
}

/// `--train`: `all`, `new`, `bridge` or comma-separated globs.
fn parse_train(s: &str) -> Vec<String> {
    match s.trim() {
        "all" => vec!["*".into()],
        _ => s
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect(),
    }
}

fn parse_betas(s: &str) -> Result<(f64, f64)> {
    parse_pair("--betas", "`B1,B2`", s)
}

fn parse_scale(s: &str) -> Result<(f64, f64)> {
    parse_pair("--scale", "`MIN,MAX`", s)
}

fn parse_pair(flag: &str, form: &str, s: &str) -> Result<(f64, f64)> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let [a, b] = parts.as_slice() else {
        bail!("{flag} takes two numbers, {form}, got {s:?}")
    };
    Ok((
        a.parse().with_context(|| format!("{flag} {s:?}"))?,
        b.parse().with_context(|| format!("{flag} {s:?}"))?,
    ))
}

#[path = "train_distill.rs"]
mod train_distill;
#[path = "train_vit.rs"]
mod train_vit;
#[path = "train_vl.rs"]
mod train_vl;

pub fn run(a: TrainArgs) -> Result<()> {
    // Distillation runs the importer's recovery, which is CPU code: `auto` means the CPU
    // there, and a GPU asked for is refused rather than ignored.
    let dev = match (&a.distill_from, a.device.device) {
        (Some(_), DeviceSpec::Cuda(_)) => bail!(
            "--distill-from runs on the CPU only (the importer's recovery), not on --device {} \
             (from the flag or TOKENFORMER_DEVICE); drop it or pass --device cpu",
            a.device.device
        ),
        (Some(_), _) => candle_core::Device::Cpu,
        (None, _) => a.device.open()?,
    };
    if dev.is_cpu() && a.precision == Precision::Bf16Mixed {
        // candle's bf16 products on the CPU: 7× slower than f32 for the bench's small LM,
        // 10× for its ViT (docs/PERFORMANCE.md).
        eprintln!(
            "warning: --precision bf16-mixed on the CPU is several times slower than f32 \
             (it is meant for GPUs); f32 trains faster here"
        );
    }
    let (betas_1, betas_2) = parse_betas(&a.betas)?;
    let train_globs = a.train.as_deref().map(parse_train);
    let grow_at = a
        .grow_at
        .iter()
        .map(|g| {
            let (step, spec) = g.split_once(':').with_context(|| {
                format!("--grow-at {g:?}: expected STEP:SPEC, e.g. 100:ffn=1024")
            })?;
            let step: u64 = step
                .trim()
                .parse()
                .with_context(|| format!("--grow-at {g:?}: STEP is not a step number"))?;
            Ok((step, spec.trim().to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut opts = TrainOptions {
        steps: a.steps.unwrap_or(1000),
        batch_size: a.batch_size,
        grad_accum: a.grad_accum,
        seq_len: a.seq_len,
        lr: a.lr.unwrap_or(6e-4),
        min_lr: a.min_lr,
        warmup_steps: a.warmup_steps,
        beta1: betas_1,
        beta2: betas_2,
        eps: a.eps,
        weight_decay: a.weight_decay,
        clip_grad: a.clip_grad,
        seed: a.seed,
        train: train_globs.clone().unwrap_or_else(|| vec!["*".into()]),
        grow_at: grow_at.clone(),
        augment: Augment {
            scale: parse_scale(&a.scale)?,
            hflip: a.hflip,
        },
    };

    // Where the weights, config and tokenizer come from (no weights: a fresh init).
    let (value, config_path, tensors, tokenizer_path, resume, source) = if let Some(dir) = &a.resume
    {
        let ckpt = trainer::resume_dir(dir)?;
        let (state, moments) = trainer::read_resume_state(&ckpt)?;
        // The weights: the checkpoint's own, or --model's (the checkpoint grown since).
        let weights = a
            .model
            .clone()
            .unwrap_or_else(|| ckpt.display().to_string());
        let files = loader::locate(&weights, &LocateOptions::default())?;
        let w = loader::read_weights(&files, Some(DType::F32), &dev)?;
        let steps = a.steps.unwrap_or(0).max(state.options.steps);
        opts = TrainOptions {
            steps,
            ..state.options.clone()
        };
        if let Some(t) = train_globs {
            opts.train = t;
        }
        if !grow_at.is_empty() {
            opts.grow_at = grow_at;
        }
        let tok = a.tokenizer.clone().or(files.tokenizer.clone());
        (
            w.config,
            w.config_path,
            Some(w.tensors),
            tok,
            Some((state, moments)),
            ckpt.display().to_string(),
        )
    } else if let Some(init) = &a.init {
        (
            loader::read_json(init)?,
            init.clone(),
            None,
            a.tokenizer.clone(),
            None,
            format!("fresh weights for {}", init.display()),
        )
    } else if let Some(m) = &a.model {
        let files = loader::locate(
            m,
            &LocateOptions {
                tokenizer: a.tokenizer.clone(),
                progress: Some(super::progress::download_bars()),
                ..Default::default()
            },
        )?;
        let w = loader::read_weights(&files, Some(DType::F32), &dev)?;
        (
            w.config,
            w.config_path,
            Some(w.tensors),
            files.tokenizer.clone(),
            None,
            files.source.clone(),
        )
    } else {
        bail!("name what to train: --model M, --init config.json or --resume DIR");
    };
    if let Some(spec) = &a.distill_from {
        let tensors = tensors.context("--distill-from trains the weights of --model")?;
        return train_distill::run(
            &a,
            spec,
            value,
            &config_path,
            tensors,
            tokenizer_path,
            source,
        );
    }
    // Named by flag before any data is read (the trainer checks them again).
    opts.validate()?;
    match loader::architecture(&value) {
        tokenformer::models::tokenformer::ARCHITECTURE => {}
        tokenformer::models::vit::ARCHITECTURE => {
            let cfg = loader::vit_config(&value, &config_path)?;
            return train_vit::run(&a, opts, cfg, tensors, resume, source);
        }
        tokenformer::models::vl::ARCHITECTURE => {
            let cfg: tokenformer::models::vl::Config = serde_json::from_value(value)
                .with_context(|| format!("config {}", config_path.display()))?;
            if let Err(e) = cfg.validate() {
                bail!("config {}: {e}", config_path.display());
            }
            return train_vl::run(&a, opts, cfg, tensors, tokenizer_path, resume, source);
        }
        other => bail!(
            "{}: `train` trains `tokenformer-lm`, `tokenformer-vit` and `tokenformer-vl` models; this is `{other}`",
            config_path.display()
        ),
    }
    let cfg = loader::lm_config(&value, &config_path)?;
    let tensors = match tensors {
        Some(t) => t,
        None => init_tensors(&cfg, a.seed, &dev)?,
    };
    let tokenizer_path =
        tokenizer_path.context("no tokenizer.json for this model: pass --tokenizer PATH")?;
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| anyhow::anyhow!("tokenizer {}: {e}", tokenizer_path.display()))?;
    let eos = cfg.eos_token_id;

    let split = match a.val_fraction {
        Some(f) => Split::Train {
            every: Split::every_for(f)?,
        },
        None => Split::All,
    };
    let data = TokenWindows::new(a.data.clone(), tokenizer.clone(), eos, opts.seq_len, split)?;
    let mut val = Vec::new();
    let val_source = match (&a.val_data, a.val_fraction) {
        (Some(p), _) => Some((vec![p.clone()], Split::All)),
        (None, Some(f)) => Some((
            a.data.clone(),
            Split::Validation {
                every: Split::every_for(f)?,
            },
        )),
        _ => None,
    };
    if let Some((files, split)) = val_source {
        let mut s = TokenWindows::new(files, tokenizer.clone(), eos, opts.seq_len, split)?;
        while val.len() < a.val_windows && s.epoch() == 0 {
            let w = s.next_window()?;
            if s.epoch() == 0 {
                val.push(w);
            }
        }
    }

    let model = TrainableLm::new(&cfg, &tensors, DType::F32, &dev)?
        .with_compute_dtype(a.precision.compute());
    drop(tensors);
    let trainer = LmTrainer::new(model, data, opts.clone(), resume)?;
    let tokenizer_bytes = std::fs::read(&tokenizer_path)
        .with_context(|| format!("reading {}", tokenizer_path.display()))?;
    let run = LmRun {
        val: Perplexity::new(val),
        tokenizer: tokenizer_bytes,
        source,
        data: a.data.clone(),
    };
    drive(&a, trainer, run)
}

/// What the shared loop ([`drive`]) asks of an architecture's run besides its trainer.
pub(crate) trait Run<M: Trainable, S: Source<M>> {
    /// What [`StepReport::tokens`] counts, as `metrics.jsonl` names it.
    const COUNTS: &'static str = "tokens";
    /// Adds the fields of this architecture to a step's `metrics.jsonl` line.
    fn add_fields(&self, r: &StepReport, line: &mut Value) {
        let _ = (r, line);
    }
    /// Whether there is held-out data.
    fn has_validation(&self) -> bool;
    /// Evaluates on the held-out data and adds the results to `line`.
    fn validate(&mut self, t: &Fed<M, S>, line: &mut Value) -> Result<()>;
    /// The progress bar's message after step `r`, `steps` steps and `secs` into this run.
    fn progress(&self, t: &Fed<M, S>, r: &StepReport, steps: u64, secs: f64) -> String;
    /// Writes a checkpoint (with its model card) into `out`.
    fn save(&self, t: &Fed<M, S>, out: &Path) -> Result<PathBuf>;
    /// The `--json` summary.
    fn summary(&self, r: &StepReport, secs: f64, ckpt: &Path) -> Value;
    /// The end of run message's loss part, e.g. `loss 2.1, validation 2.3`.
    fn outcome(&self, r: &StepReport) -> String;
}

/// The loop every architecture runs: steps, `metrics.jsonl`, validation every
/// `--eval-every` steps, checkpoints (and `loss.png`) every `--save-every` steps and at
/// the end, `--keep-last`, a progress bar and the closing summary.
pub(crate) fn drive<M: Trainable, S: Source<M>, R: Run<M, S>>(
    a: &TrainArgs,
    mut t: Fed<M, S>,
    mut run: R,
) -> Result<()> {
    let metrics_path = a.out.join("metrics.jsonl");
    // Opened (and --out made) at the first step's line: a run that fails before
    // it leaves no empty folder or log behind.
    let mut metrics: Option<std::fs::File> = None;
    let open_metrics = || -> Result<std::fs::File> {
        std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics_path)
            .with_context(|| format!("opening {}", metrics_path.display()))
    };
    let mut curve = Curve::read(&metrics_path);
    let start_step = t.step_count();
    let bar = ProgressBar::new(t.options().steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .expect("valid template"),
    );
    bar.set_position(start_step);
    let started = Instant::now();
    let (mut last, mut last_ckpt) = (None, None);
    while !t.done() {
        let r = t.step()?;
        let mut line = json!({
            "step": r.step, "lr": r.lr, "loss": r.loss, "grad_norm": r.grad_norm,
        });
        line[R::COUNTS] = json!(r.tokens);
        run.add_fields(&r, &mut line);
        let end = t.done();
        if run.has_validation() && (r.step % a.eval_every == 0 || end) {
            run.validate(&t, &mut line)?;
        }
        let file = match &mut metrics {
            Some(f) => f,
            None => metrics.insert(open_metrics()?),
        };
        writeln!(file, "{line}").context("writing metrics.jsonl")?;
        curve.push(&line);
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(run.progress(&t, &r, r.step - start_step, secs));
        bar.set_position(r.step);
        if r.step % a.save_every == 0 || end {
            last_ckpt = Some(run.save(&t, &a.out)?);
            curve.draw(&a.out)?;
            if a.keep_last > 0 {
                trainer::prune(&a.out, a.keep_last)?;
            }
            if std::env::var("TOKENFORMER_TRAIN_ABORT_AFTER_STEP")
                .is_ok_and(|v| v == r.step.to_string())
            {
                // Test hook: a run killed right after this checkpoint.
                std::process::exit(137);
            }
        }
        last = Some(r);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let Some(r) = last else {
        bail!(
            "nothing to do: the run already has its {} steps (raise --steps)",
            t.options().steps
        );
    };
    let ckpt = last_ckpt.expect("saved at the end");
    if a.json {
        outln!("{}", run.summary(&r, secs, &ckpt))?;
    } else {
        eprintln!(
            "trained to step {} ({}) in {secs:.1} s; saved {}",
            r.step,
            run.outcome(&r),
            ckpt.display()
        );
    }
    Ok(())
}

/// A checkpoint with its model card and, for text models, the tokenizer.
pub(crate) fn save_with<M: Trainable, S: Source<M>>(
    t: &Fed<M, S>,
    out: &Path,
    tokenizer: Option<&[u8]>,
    card: String,
) -> Result<PathBuf> {
    let mut files = vec![];
    if let Some(tok) = tokenizer {
        files.push(("tokenizer.json", tok.to_vec()));
    }
    files.push(("README.md", card.into_bytes()));
    Ok(t.save(out, &files)?)
}

/// A text model's held-out data (windows, captions) and its latest validation loss,
/// reported with its perplexity.
pub(crate) struct Perplexity<V> {
    data: Vec<V>,
    last: Option<f64>,
}

impl<V> Perplexity<V> {
    pub(crate) fn new(data: Vec<V>) -> Self {
        Self { data, last: None }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Evaluates the mean loss over the held-out data with `eval` and adds it to `line`.
    pub(crate) fn record(
        &mut self,
        line: &mut Value,
        eval: impl FnOnce(&[V]) -> tokenformer::Result<f64>,
    ) -> Result<()> {
        let v = eval(&self.data)?;
        line["val_loss"] = json!(v);
        line["val_perplexity"] = json!(v.exp());
        self.last = Some(v);
        Ok(())
    }

    pub(crate) fn get(&self) -> Option<f64> {
        self.last
    }

    /// `  val 2.3456` for the progress bar (empty before the first validation).
    pub(crate) fn bar(&self) -> String {
        self.last.map_or(String::new(), |v| format!("  val {v:.4}"))
    }

    pub(crate) fn summary(&self, r: &StepReport, secs: f64, ckpt: &Path) -> Value {
        json!({
            "steps": r.step, "train_loss": r.loss, "val_loss": self.last,
            "val_perplexity": self.last.map(f64::exp), "tokens": r.tokens,
            "seconds": secs, "checkpoint": ckpt,
        })
    }

    /// `{what} 2.1234, validation 2.3456`.
    pub(crate) fn outcome(&self, what: &str, r: &StepReport) -> String {
        let v = self
            .last
            .map_or(String::new(), |v| format!(", validation {v:.4}"));
        format!("{what} {:.4}{v}", r.loss)
    }
}

/// A language model's run.
struct LmRun {
    val: Perplexity<Vec<u32>>,
    tokenizer: Vec<u8>,
    source: String,
    data: Vec<PathBuf>,
}

impl Run<TrainableLm, LmSource> for LmRun {
    fn add_fields(&self, r: &StepReport, line: &mut Value) {
        line["flops"] = json!(r.flops);
    }

    fn has_validation(&self) -> bool {
        !self.val.is_empty()
    }

    fn validate(&mut self, t: &LmTrainer, line: &mut Value) -> Result<()> {
        let b = t.options().batch_size;
        self.val.record(line, |v| t.evaluate(v, b))
    }

    fn progress(&self, t: &LmTrainer, r: &StepReport, steps: u64, secs: f64) -> String {
        let o = t.options();
        let tokens = steps as f64 * (o.batch_size * o.grad_accum * o.seq_len) as f64;
        let rate = tokens / secs;
        format!("loss {:.4}{}  {rate:.0} tok/s", r.loss, self.val.bar())
    }

    fn save(&self, t: &LmTrainer, out: &Path) -> Result<PathBuf> {
        let card = card(t, &self.source, &self.data, self.val.get());
        save_with(t, out, Some(&self.tokenizer), card)
    }

    fn summary(&self, r: &StepReport, secs: f64, ckpt: &Path) -> Value {
        self.val.summary(r, secs, ckpt)
    }

    fn outcome(&self, r: &StepReport) -> String {
        self.val.outcome("loss", r)
    }
}

/// The model card of a checkpoint: how it was trained.
fn card(t: &LmTrainer, source: &str, data: &[PathBuf], val: Option<f64>) -> String {
    let (o, cfg) = (t.options(), t.model().config());
    let mut c = ModelCard::new(
        "TokenFormer language model (trained with tokenformer)",
        "text-generation",
    );
    let files: Vec<String> = data.iter().map(|p| name(p)).collect();
    let mut body = format!(
        "Started from {source}; {} of {} steps on {}.\n\n\
         | setting | value |\n|---|---|\n\
         | sequence length × batch × accumulation | {} × {} × {} |\n{}\
         | shape | {} |\n",
        t.step_count(),
        o.steps,
        files.join(", "),
        o.seq_len,
        o.batch_size,
        o.grad_accum,
        optimiser_rows(o),
        shape(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            [cfg.qkv_tokens, cfg.proj_tokens, cfg.ffn_tokens]
        ),
    );
    if let Some(v) = val {
        body.push_str(&format!(
            "\nValidation loss {v:.4} (perplexity {:.2}).\n",
            v.exp()
        ));
    }
    c.section("Training", body);
    c.render()
}

/// The model card's rows of the optimiser, the schedule and what trains.
pub(crate) fn optimiser_rows(o: &TrainOptions) -> String {
    format!(
        "| learning rate | {} → {} (warm-up {} steps, cosine) |\n\
         | AdamW | betas {}, {}, eps {}, weight decay {} (matrices only) |\n\
         | gradient clipping | {} |\n| trained tensors | {} |\n",
        o.lr,
        o.min_lr,
        o.warmup_steps,
        o.beta1,
        o.beta2,
        o.eps,
        o.weight_decay,
        o.clip_grad,
        o.train.join(", "),
    )
}

/// The model card's shape: `4 layers, d 256, 4 heads, tokens 256/256/1024`.
pub(crate) fn shape(layers: usize, d: usize, heads: usize, [q, p, f]: [usize; 3]) -> String {
    format!("{layers} layers, d {d}, {heads} heads, tokens {q}/{p}/{f}")
}

/// `--val-fraction`: moves every round(1/f)-th item of `items` to `val`.
pub(crate) fn hold_out<T>(items: &mut Vec<T>, val: &mut Vec<T>, fraction: f64) -> Result<()> {
    let every = Split::every_for(fraction)? as usize;
    for (i, x) in std::mem::take(items).into_iter().enumerate() {
        if (i + 1) % every == 0 {
            val.push(x);
        } else {
            items.push(x);
        }
    }
    Ok(())
}

fn name(p: &Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}
