//! `tokenformer train` for the merged vision-language model: (image, caption) pairs
//! from JSONL, the loss on caption tokens, checkpoints, `metrics.jsonl`, a progress bar.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::DType;
use serde_json::Value;
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::Tensors;
use tokenformer::models::vl::Config;
use tokenformer::train::optim::Moments;
use tokenformer::train::trainer::{TrainOptions, TrainerState};
use tokenformer::train::vl::{init_tensors, read_pairs, Pair, PairSource, TrainableVl, VlTrainer};
use tokenformer::train::StepReport;

use super::{Perplexity, TrainArgs};

/// Trains a merged model. `tensors` None: fresh weights (`--init`, `--seed`).
pub fn run(
    a: &TrainArgs,
    opts: TrainOptions,
    cfg: Config,
    tensors: Option<Tensors>,
    tokenizer_path: Option<PathBuf>,
    resume: Option<(TrainerState, BTreeMap<String, Moments>)>,
    source: String,
) -> Result<()> {
    let dev = a.device.open()?;
    let tensors = match tensors {
        Some(t) => t,
        None => init_tensors(&cfg, a.seed, &dev)?,
    };
    let tokenizer_path =
        tokenizer_path.context("no tokenizer.json for this model: pass --tokenizer PATH")?;
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| anyhow::anyhow!("tokenizer {}: {e}", tokenizer_path.display()))?;
    let [data] = a.data.as_slice() else {
        bail!(
            "a merged model trains on one JSONL of {{\"image\", \"text\"}} pairs: give --data once"
        );
    };
    let mut pairs = read_pairs(data)?;
    let mut val = match &a.val_data {
        Some(v) => read_pairs(v)?,
        None => vec![],
    };
    if let Some(f) = a.val_fraction {
        super::hold_out(&mut pairs, &mut val, f)?;
    }
    val.truncate(a.val_windows);
    let model = TrainableVl::new(&cfg, &tensors, DType::F32, &dev)?
        .with_compute_dtype(a.precision.compute());
    drop(tensors);
    let t = VlTrainer::new(model, pairs, tokenizer, opts, resume)?;
    let tokenizer = std::fs::read(&tokenizer_path)
        .with_context(|| format!("reading {}", tokenizer_path.display()))?;
    let run = VlRun {
        start_tokens: t.state().tokens,
        val: Perplexity::new(val),
        tokenizer,
        source,
        data: data.clone(),
    };
    super::drive(a, t, run)
}

/// A merged model's run.
struct VlRun {
    val: Perplexity<Pair>,
    /// Caption tokens seen before this run (a resumed one).
    start_tokens: u64,
    tokenizer: Vec<u8>,
    source: String,
    data: PathBuf,
}

impl super::Run<TrainableVl, PairSource> for VlRun {
    fn has_validation(&self) -> bool {
        !self.val.is_empty()
    }

    fn validate(&mut self, t: &VlTrainer, line: &mut Value) -> Result<()> {
        let b = t.options().batch_size;
        self.val.record(line, |v| t.evaluate(v, b))
    }

    fn progress(&self, t: &VlTrainer, r: &StepReport, steps: u64, secs: f64) -> String {
        let o = t.options();
        let images = steps as f64 * (o.batch_size * o.grad_accum) as f64;
        let tokens = (r.tokens - self.start_tokens) as f64;
        format!(
            "loss {:.4}{}  {:.0} tok/s  {:.1} img/s",
            r.loss,
            self.val.bar(),
            tokens / secs,
            images / secs
        )
    }

    fn save(&self, t: &VlTrainer, out: &Path) -> Result<PathBuf> {
        let card = card(t, &self.source, &self.data, self.val.get());
        super::save_with(t, out, Some(&self.tokenizer), card)
    }

    fn summary(&self, r: &StepReport, secs: f64, ckpt: &Path) -> Value {
        self.val.summary(r, secs, ckpt)
    }

    fn outcome(&self, r: &StepReport) -> String {
        self.val.outcome("caption loss", r)
    }
}

fn card(t: &VlTrainer, source: &str, data: &Path, val: Option<f64>) -> String {
    let o = t.options();
    let mut c = ModelCard::new(
        "TokenFormer vision-language model (trained with tokenformer)",
        "image-text-to-text",
    );
    let mut body = format!(
        "Started from {source}; {} of {} steps on the (image, caption) pairs of {} \
         (loss on caption tokens).\n\n\
         | setting | value |\n|---|---|\n\
         | caption tokens × batch × accumulation | ≤ {} × {} × {} |\n{}",
        t.step_count(),
        o.steps,
        super::name(data),
        o.seq_len,
        o.batch_size,
        o.grad_accum,
        super::optimiser_rows(o),
    );
    if let Some(v) = val {
        body.push_str(&format!(
            "\nValidation caption loss {v:.4} (perplexity {:.2}).\n",
            v.exp()
        ));
    }
    c.section("Training", body);
    c.render()
}
