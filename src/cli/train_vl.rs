//! `tokenformer train` for the merged vision-language model: (image, caption) pairs
//! from JSONL, the loss on caption tokens, checkpoints, `metrics.jsonl`, a progress bar.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::Tensors;
use tokenformer::models::vl::Config;
use tokenformer::train::optim::Moments;
use tokenformer::train::trainer::{self, TrainOptions, TrainerState};
use tokenformer::train::vl::{read_pairs, TrainableVl, VlTrainer};
use tokenformer::train::Split;

use super::TrainArgs;

/// Trains a merged model (its weights are required: a merge has no fresh init).
pub fn run(
    a: &TrainArgs,
    opts: TrainOptions,
    cfg: Config,
    tensors: Option<Tensors>,
    tokenizer_path: Option<PathBuf>,
    resume: Option<(TrainerState, BTreeMap<String, Moments>)>,
    source: String,
) -> Result<()> {
    let dev = Device::Cpu;
    let Some(tensors) = tensors else {
        bail!(
            "a merged model starts from `tokenformer-convert merge`'s folder (--model), not --init"
        );
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
        let every = Split::every_for(f)? as usize;
        let all = std::mem::take(&mut pairs);
        for (i, p) in all.into_iter().enumerate() {
            if (i + 1) % every == 0 {
                val.push(p);
            } else {
                pairs.push(p);
            }
        }
    }
    val.truncate(a.val_windows);
    let model = TrainableVl::new(&cfg, &tensors, DType::F32, &dev)?;
    drop(tensors);
    let mut t = VlTrainer::new(model, pairs, tokenizer, opts.clone(), resume)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let tokenizer_bytes = std::fs::read(&tokenizer_path)
        .with_context(|| format!("reading {}", tokenizer_path.display()))?;
    let metrics_path = a.out.join("metrics.jsonl");
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .with_context(|| format!("opening {}", metrics_path.display()))?;
    let mut curve = super::Curve::read(&metrics_path);
    let start_step = t.step_count();
    let bar = ProgressBar::new(opts.steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .expect("valid template"),
    );
    bar.set_position(start_step);
    let started = Instant::now();
    let start_tokens = t.state().tokens;
    let (mut last, mut last_val, mut last_ckpt) = (None, None, None);
    while !t.done() {
        let r = t.step()?;
        let secs = started.elapsed().as_secs_f64();
        let mut line = json!({
            "step": r.step, "lr": r.lr, "loss": r.loss, "grad_norm": r.grad_norm,
            "tokens": r.tokens,
        });
        let end = t.done();
        if !val.is_empty() && (r.step % a.eval_every.max(1) == 0 || end) {
            let v = t.evaluate(&val, opts.batch_size)?;
            line["val_loss"] = json!(v);
            line["val_perplexity"] = json!(v.exp());
            last_val = Some(v);
        }
        writeln!(metrics, "{line}").context("writing metrics.jsonl")?;
        curve.push(&line);
        let images = (r.step - start_step) as f64 * (opts.batch_size * opts.grad_accum) as f64;
        bar.set_message(format!(
            "loss {:.4}{}  {:.0} tok/s  {:.1} img/s",
            r.loss,
            last_val.map_or(String::new(), |v| format!("  val {v:.4}")),
            (r.tokens - start_tokens) as f64 / secs.max(1e-9),
            images / secs.max(1e-9)
        ));
        bar.set_position(r.step);
        if r.step % a.save_every.max(1) == 0 || end {
            let card = card(&t, &source, data, last_val);
            let dir = t.save(
                &a.out,
                &[
                    ("tokenizer.json", tokenizer_bytes.clone()),
                    ("README.md", card.into_bytes()),
                ],
            )?;
            curve.draw(&a.out)?;
            if a.keep_last > 0 {
                trainer::prune(&a.out, a.keep_last)?;
            }
            last_ckpt = Some(dir);
        }
        last = Some(r);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let Some(r) = last else {
        bail!(
            "nothing to do: the run already has its {} steps (raise --steps)",
            opts.steps
        );
    };
    let ckpt = last_ckpt.expect("saved at the end");
    if a.json {
        println!(
            "{}",
            json!({
                "steps": r.step, "train_loss": r.loss, "val_loss": last_val,
                "val_perplexity": last_val.map(f64::exp), "tokens": r.tokens,
                "seconds": secs, "checkpoint": ckpt,
            })
        );
    } else {
        eprintln!(
            "trained to step {} (caption loss {:.4}{}) in {secs:.1} s; saved {}",
            r.step,
            r.loss,
            last_val.map_or(String::new(), |v| format!(", validation {v:.4}")),
            ckpt.display()
        );
    }
    Ok(())
}

fn card(t: &VlTrainer, source: &str, data: &std::path::Path, val: Option<f64>) -> String {
    let o = t.options();
    let mut c = ModelCard::new(
        "TokenFormer vision-language model (trained with tokenformer)",
        "image-text-to-text",
    );
    let mut body = format!(
        "Started from {source}; {} of {} steps on the (image, caption) pairs of {} \
         (loss on caption tokens).\n\n\
         | setting | value |\n|---|---|\n\
         | caption tokens × batch × accumulation | ≤ {} × {} × {} |\n\
         | learning rate | {} → {} (warm-up {} steps, cosine) |\n\
         | AdamW | betas {}, {}, eps {}, weight decay {} (matrices only) |\n\
         | gradient clipping | {} |\n| trained tensors | {} |\n",
        t.step_count(),
        o.steps,
        super::name(data),
        o.seq_len,
        o.batch_size,
        o.grad_accum,
        o.lr,
        o.min_lr,
        o.warmup_steps,
        o.beta1,
        o.beta2,
        o.eps,
        o.weight_decay,
        o.clip_grad,
        o.train.join(", "),
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
