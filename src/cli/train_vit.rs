//! `tokenformer train` for the image classifier: class folders in, checkpoints,
//! `metrics.jsonl` (validation loss and top-1), a progress bar with images/s.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::Tensors;
use tokenformer::models::vit::Config;
use tokenformer::train::optim::Moments;
use tokenformer::train::trainer::{self, TrainOptions, TrainerState};
use tokenformer::train::vit::{init_tensors, TrainableVit, VitTrainer};
use tokenformer::train::Split;
use tokenformer::vision::{dataset, EvalTransform};

use super::TrainArgs;

/// Training and validation folders: `--data DIR` (DIR/train and DIR/val when DIR has a
/// `train` folder), `--val-data DIR`.
fn folders(a: &TrainArgs) -> Result<(PathBuf, Option<PathBuf>)> {
    let [dir] = a.data.as_slice() else {
        bail!("a classifier trains on one image folder: give --data once");
    };
    let (train, val) = if dir.join("train").is_dir() {
        let v = dir.join("val");
        (dir.join("train"), v.is_dir().then_some(v))
    } else {
        (dir.clone(), None)
    };
    Ok((train, a.val_data.clone().or(val)))
}

/// Trains a classifier. `tensors` None: fresh weights (`--init`, `--seed`).
pub fn run(
    a: &TrainArgs,
    opts: TrainOptions,
    cfg: Config,
    tensors: Option<Tensors>,
    resume: Option<(TrainerState, BTreeMap<String, Moments>)>,
    source: String,
) -> Result<()> {
    let dev = Device::Cpu;
    let (train_dir, val_dir) = folders(a)?;
    let wnids = cfg.class_wnids.as_deref();
    let mut samples = dataset::list(&train_dir, None, wnids)?.samples;
    let mut val_samples = match &val_dir {
        Some(v) => dataset::list(v, None, wnids)?.samples,
        None => vec![],
    };
    if let Some(f) = a.val_fraction {
        if val_dir.is_some() {
            bail!("--val-fraction holds out training images, but a validation folder is given");
        }
        let every = Split::every_for(f)? as usize;
        let all = std::mem::take(&mut samples);
        for (i, s) in all.into_iter().enumerate() {
            if (i + 1) % every == 0 {
                val_samples.push(s);
            } else {
                samples.push(s);
            }
        }
    }
    if let Some(s) = samples
        .iter()
        .chain(&val_samples)
        .find(|s| s.label >= cfg.num_classes)
    {
        bail!(
            "{}: class {} but the model has {} classes",
            s.path.display(),
            s.label,
            cfg.num_classes
        );
    }
    let eval = EvalTransform::from_config(&cfg);
    let val: Vec<(Vec<f32>, u32)> = val_samples
        .iter()
        .take(a.val_windows)
        .map(|s| Ok((eval.load(&s.path)?, s.label as u32)))
        .collect::<Result<_>>()?;

    let tensors = match tensors {
        Some(t) => t,
        None => init_tensors(&cfg, a.seed, &dev)?,
    };
    let model = TrainableVit::new(&cfg, &tensors, DType::F32, &dev)?;
    drop(tensors);
    let n_train = samples.len();
    let mut t = VitTrainer::new(model, samples, opts.clone(), resume)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let metrics_path = a.out.join("metrics.jsonl");
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .with_context(|| format!("opening {}", metrics_path.display()))?;

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
    let (mut last, mut last_val, mut last_ckpt) = (None, None, None);
    let mut curve = super::Curve::read(&metrics_path);
    while !t.done() {
        let r = t.step()?;
        let secs = started.elapsed().as_secs_f64();
        let images_run = (r.step - start_step) as f64 * (opts.batch_size * opts.grad_accum) as f64;
        let mut line = json!({
            "step": r.step, "lr": r.lr, "loss": r.loss, "grad_norm": r.grad_norm,
            "images": r.tokens,
        });
        let end = t.done();
        if !val.is_empty() && (r.step % a.eval_every.max(1) == 0 || end) {
            let (l, top1) = t.evaluate(&val, opts.batch_size)?;
            line["val_loss"] = json!(l);
            line["val_top1"] = json!(top1);
            last_val = Some((l, top1));
        }
        writeln!(metrics, "{line}").context("writing metrics.jsonl")?;
        curve.push(&line);
        bar.set_message(format!(
            "loss {:.4}{}  {:.1} img/s",
            r.loss,
            last_val.map_or(String::new(), |(l, a)| format!(
                "  val {l:.4} top-1 {:.1}%",
                a * 100.0
            )),
            images_run / secs.max(1e-9)
        ));
        bar.set_position(r.step);
        if r.step % a.save_every.max(1) == 0 || end {
            let card = card(&t, &source, &train_dir, n_train, last_val);
            let dir = t.save(&a.out, &[("README.md", card.into_bytes())])?;
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
                "steps": r.step, "train_loss": r.loss,
                "val_loss": last_val.map(|v| v.0), "val_top1": last_val.map(|v| v.1),
                "images": r.tokens, "seconds": secs, "checkpoint": ckpt,
            })
        );
    } else {
        eprintln!(
            "trained to step {} (loss {:.4}{}) in {secs:.1} s; saved {}",
            r.step,
            r.loss,
            last_val.map_or(String::new(), |(l, a)| format!(
                ", validation {l:.4}, top-1 {:.2}%",
                a * 100.0
            )),
            ckpt.display()
        );
    }
    Ok(())
}

fn card(
    t: &VitTrainer,
    source: &str,
    data: &Path,
    images: usize,
    val: Option<(f64, f64)>,
) -> String {
    let o = t.options();
    let cfg = t.model().config();
    let mut c = ModelCard::new(
        "TokenFormer image classifier (trained with tokenformer)",
        "image-classification",
    );
    let mut body = format!(
        "Started from {source}; {} of {} steps on {} ({images} images, random-resized crop \
         and horizontal flip).\n\n\
         | setting | value |\n|---|---|\n\
         | batch × accumulation | {} × {} |\n\
         | learning rate | {} → {} (warm-up {} steps, cosine) |\n\
         | AdamW | betas {}, {}, eps {}, weight decay {} (matrices only) |\n\
         | gradient clipping | {} |\n| trained tensors | {} |\n\
         | shape | {} layers, d {}, {} heads, tokens {}/{}/{}, {}² images, patch {} |\n",
        t.step_count(),
        o.steps,
        super::name(data),
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
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.qkv_tokens,
        cfg.proj_tokens,
        cfg.ffn_tokens,
        cfg.image_size,
        cfg.patch_size,
    );
    if let Some((l, a)) = val {
        body.push_str(&format!(
            "\nValidation loss {l:.4}, top-1 {:.2}%.\n",
            a * 100.0
        ));
    }
    c.section("Training", body);
    c.render()
}
