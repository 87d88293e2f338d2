//! `tokenformer train` for the image classifier: class folders in, checkpoints,
//! `metrics.jsonl` (validation loss and top-1), a progress bar with images/s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use candle_core::DType;
use serde_json::{json, Value};
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::Tensors;
use tokenformer::models::vit::Config;
use tokenformer::train::optim::Moments;
use tokenformer::train::trainer::{TrainOptions, TrainerState};
use tokenformer::train::vit::{init_tensors, ImageSource, TrainableVit, VitTrainer};
use tokenformer::train::StepReport;
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
    let dev = a.device.open()?;
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
        super::hold_out(&mut samples, &mut val_samples, f)?;
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
    let model = TrainableVit::new(&cfg, &tensors, DType::F32, &dev)?
        .with_compute_dtype(a.precision.compute());
    drop(tensors);
    let n_train = samples.len();
    let t = VitTrainer::new(model, samples, opts, resume)?;
    let run = VitRun {
        val,
        last_val: None,
        source,
        train_dir,
        n_train,
    };
    super::drive(a, t, run)
}

/// A classifier's run.
struct VitRun {
    val: Vec<(Vec<f32>, u32)>,
    /// Validation loss and top-1.
    last_val: Option<(f64, f64)>,
    source: String,
    train_dir: PathBuf,
    n_train: usize,
}

impl super::Run<TrainableVit, ImageSource> for VitRun {
    const COUNTS: &'static str = "images";

    fn has_validation(&self) -> bool {
        !self.val.is_empty()
    }

    fn validate(&mut self, t: &VitTrainer, line: &mut Value) -> Result<()> {
        let (l, top1) = t.evaluate(&self.val, t.options().batch_size)?;
        line["val_loss"] = json!(l);
        line["val_top1"] = json!(top1);
        self.last_val = Some((l, top1));
        Ok(())
    }

    fn progress(&self, t: &VitTrainer, r: &StepReport, steps: u64, secs: f64) -> String {
        let o = t.options();
        let images = steps as f64 * (o.batch_size * o.grad_accum) as f64;
        let val = self.last_val.map_or(String::new(), |(l, a)| {
            format!("  val {l:.4} top-1 {:.1}%", a * 100.0)
        });
        format!("loss {:.4}{val}  {:.1} img/s", r.loss, images / secs)
    }

    fn save(&self, t: &VitTrainer, out: &Path) -> Result<PathBuf> {
        let card = card(
            t,
            &self.source,
            &self.train_dir,
            self.n_train,
            self.last_val,
        );
        super::save_with(t, out, None, card)
    }

    fn summary(&self, r: &StepReport, secs: f64, ckpt: &Path) -> Value {
        let v = self.last_val;
        json!({
            "steps": r.step, "train_loss": r.loss,
            "val_loss": v.map(|v| v.0), "val_top1": v.map(|v| v.1),
            "images": r.tokens, "seconds": secs, "checkpoint": ckpt,
        })
    }

    fn outcome(&self, r: &StepReport) -> String {
        let val = self.last_val.map_or(String::new(), |(l, a)| {
            format!(", validation {l:.4}, top-1 {:.2}%", a * 100.0)
        });
        format!("loss {:.4}{val}", r.loss)
    }
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
         | batch × accumulation | {} × {} |\n{}\
         | shape | {}, {}² images, patch {} |\n",
        t.step_count(),
        o.steps,
        super::name(data),
        o.batch_size,
        o.grad_accum,
        super::optimiser_rows(o),
        super::shape(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            [cfg.qkv_tokens, cfg.proj_tokens, cfg.ffn_tokens]
        ),
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
