//! `--recover-steps N`: after mapping and fitting, the import is trained to behave
//! like its source on the calibration data (distillation, the library's
//! [`tokenformer::train::distill`]): KL(source ‖ import) of the output distribution
//! plus `--hidden-weight` times each layer's relative hidden-state MSE, the source run
//! by the importer's own forward ([`super::source`]) on every batch, AdamW on the
//! Pattention value tokens. Text trains on random windows of the calibration text; images on
//! light timm-style views of the calibration photos (random-resized crop of
//! [`AUGMENT`]'s area range, horizontal flip), both from a fixed seed. A progress bar,
//! `metrics.jsonl` and `loss.png` (as `train` writes them) go with the model; the
//! distillation loss on the held-out eval data is their validation curve.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;
use tokenformer::train::distill::{self, Distill, DistillBatch, Distillable, Targets};
use tokenformer::train::plot::Curve;
use tokenformer::train::{Augment, TrainOptions};

use super::args::ImportArgs;
use super::fidelity::{AgreementChange, EndToEnd};

/// The most `--recover-steps` (about a day on 2 cores at the smallest sizes).
pub const MAX_STEPS: u64 = 1_000_000;

/// The training views of calibration photos: lighter than timm's ImageNet training
/// default (scale 0.08–1), since the target is the source's function on these photos,
/// not invariance to small crops.
pub const AUGMENT: Augment = Augment {
    scale: (0.35, 1.0),
    hflip: 0.5,
};

/// What trains: every Pattention's value tokens, each row's update scaled by 1/RMS of
/// its token's activation (`fit::value_update_scales`). The keys stay as mapped: they
/// differ by ~10⁶ in scale by construction and set the normalisation every score
/// shares, which a step of Adam's size would upset (measured: one step at lr 2.5e-5
/// on the keys of the random ViT fixture raised the loss ten-million-fold). Embeddings,
/// norms and heads are copies of the source's.
const TRAINED: &str = "layers.*.value_param_tokens";

/// The seed of the windows, views and their order.
const SEED: u64 = 0x0072_6563_6f76_6572;

/// How often (in steps) the held-out loss is measured: ten times a run, and at its end.
fn eval_every(steps: u64) -> u64 {
    steps.div_ceil(10).max(1)
}

/// `--recover-steps` and its settings, checked.
#[derive(Clone, Debug)]
pub struct Recovery {
    pub steps: u64,
    pub lr: f64,
    pub hidden_weight: f64,
    pub batch_size: usize,
}

impl Recovery {
    /// None without `--recover-steps`; refuses bad values by flag.
    pub fn from_args(a: &ImportArgs) -> Result<Option<Self>> {
        let Some(steps) = a.recover_steps else {
            return Ok(None);
        };
        if steps == 0 {
            bail!("--recover-steps 0: give at least 1 step, or leave the flag out for no recovery");
        }
        if steps > MAX_STEPS {
            bail!("--recover-steps {steps}: at most {MAX_STEPS} steps");
        }
        if !(a.recover_lr.is_finite() && a.recover_lr > 0.0) {
            bail!("--recover-lr {}: must be a positive number", a.recover_lr);
        }
        if !(a.hidden_weight.is_finite() && a.hidden_weight >= 0.0) {
            bail!(
                "--hidden-weight {}: must be a non-negative number",
                a.hidden_weight
            );
        }
        if a.recover_batch_size == 0 {
            bail!("--recover-batch-size 0: must be at least 1");
        }
        Ok(Some(Self {
            steps,
            lr: a.recover_lr,
            hidden_weight: a.hidden_weight,
            batch_size: a.recover_batch_size,
        }))
    }

    /// The training options: AdamW (official betas, no weight decay: it would pull the
    /// fitted tokens towards 0), 10 % linear warm-up, cosine to lr/10, clipping at 1.
    pub fn options(&self, seq_len: usize) -> TrainOptions {
        TrainOptions {
            steps: self.steps,
            batch_size: self.batch_size,
            grad_accum: 1,
            seq_len: seq_len.max(1),
            lr: self.lr,
            min_lr: self.lr / 10.0,
            warmup_steps: self.steps / 10,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            clip_grad: 1.0,
            seed: SEED,
            train: vec![TRAINED.into()],
            grow_at: vec![],
            augment: AUGMENT,
        }
    }
}

/// Seeded random windows of `len` tokens of the calibration ids.
pub struct TextWindows {
    ids: Vec<u32>,
    len: usize,
    rng: rand::rngs::StdRng,
}

impl TextWindows {
    /// Windows of `min(len, ids.len())` tokens at random offsets.
    pub fn new(ids: Vec<u32>, len: usize) -> Self {
        Self {
            len: len.min(ids.len()).max(1),
            ids,
            rng: rand::rngs::StdRng::seed_from_u64(SEED),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// `b` windows as ids [b, len], with the tokens they count.
    pub fn next(&mut self, b: usize) -> Result<(Tensor, u64)> {
        let mut v = Vec::with_capacity(b * self.len);
        for _ in 0..b {
            let start = self.rng.random_range(0..=self.ids.len() - self.len);
            v.extend_from_slice(&self.ids[start..start + self.len]);
        }
        let t = Tensor::from_vec(v, (b, self.len), &candle_core::Device::Cpu)?;
        Ok((t, (b * self.len) as u64))
    }
}

/// A seeded order over `n` items: a fresh shuffle each pass, and an RNG per draw.
pub struct Shuffled {
    n: usize,
    order: Vec<usize>,
    at: usize,
    rng: rand::rngs::StdRng,
}

impl Shuffled {
    pub fn new(n: usize) -> Self {
        Self {
            n,
            order: vec![],
            at: 0,
            rng: rand::rngs::StdRng::seed_from_u64(SEED),
        }
    }

    /// The next item and the RNG its view draws from.
    pub fn next(&mut self) -> (usize, &mut rand::rngs::StdRng) {
        if self.at == self.order.len() {
            self.order = (0..self.n).collect();
            for i in (1..self.n).rev() {
                let j = self.rng.random_range(0..=i);
                self.order.swap(i, j);
            }
            self.at = 0;
        }
        self.at += 1;
        (self.order[self.at - 1], &mut self.rng)
    }
}

/// What a recovery did, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct RecoveryReport {
    pub method: String,
    pub steps: u64,
    pub lr: f64,
    pub hidden_weight: f64,
    /// Windows (text) or images per step.
    pub batch_size: usize,
    /// Tokens per window (text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<usize>,
    /// The training views of the calibration photos (images).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub augmentation: Option<String>,
    /// The distillation loss of the first and the last step, and on the eval data at
    /// the end (KL + weight · hidden term; `metrics.jsonl` has every step).
    pub first_loss: f64,
    pub final_loss: f64,
    pub final_eval_loss: f64,
    pub seconds: f64,
    /// The import recovery started from (fitted, or mapped with `--fit none`), end to
    /// end on the eval data (`end_to_end` is the recovered, written model's).
    pub before_end_to_end: EndToEnd,
    /// Recovered minus before-recovery agreement on the same items, with its 95 % interval.
    pub top1_change: RecoveryChange,
}

/// How recovery changed top-1 (next-token) agreement on the same eval items.
#[derive(Clone, Debug, Serialize)]
pub struct RecoveryChange {
    pub change: f64,
    /// Newcombe's score interval for paired proportions (see [`AgreementChange`]).
    pub change_95: [f64; 2],
    /// Items where only the recovered import agrees with the source, and only the one before.
    pub recovered_only: usize,
    pub before_only: usize,
}

impl From<AgreementChange> for RecoveryChange {
    /// A paired change measured with the recovered import as the new model.
    fn from(c: AgreementChange) -> Self {
        Self {
            change: c.change,
            change_95: c.change_95,
            recovered_only: c.fitted_only,
            before_only: c.mapped_only,
        }
    }
}

/// What [`run`] measured while training.
pub struct Log {
    pub first_loss: f64,
    pub final_loss: f64,
    pub final_eval_loss: f64,
    pub seconds: f64,
}

/// Distills `student` towards the source (`teacher`) on batches from `next`, the
/// held-out `eval` batches measured ten times a run; the bar on stderr,
/// `metrics.jsonl` and `loss.png` into `dir`. `counts`: what a step's items are.
#[allow(clippy::too_many_arguments)]
pub fn run<M: Distillable>(
    rec: &Recovery,
    seq_len: usize,
    student: M,
    update_scales: std::collections::BTreeMap<String, Tensor>,
    dir: &Path,
    counts: &str,
    next: impl FnMut() -> Result<(M::Input, u64), tokenformer::Error>,
    teacher: impl FnMut(&M::Input) -> Result<Targets, tokenformer::Error>,
    eval: &[DistillBatch<M::Input>],
) -> Result<(M, Log)> {
    let metrics_path = dir.join("metrics.jsonl");
    let mut metrics = std::fs::File::create(&metrics_path)
        .with_context(|| format!("creating {}", metrics_path.display()))?;
    let mut curve = Curve::default();
    let bar = crate::progress::bar(
        rec.steps,
        "recovering {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
    );
    let started = Instant::now();
    let every = eval_every(rec.steps);
    let (mut first, mut last, mut last_eval) = (None, 0.0, f64::NAN);
    let mut io_error = None;
    let eval_loss = |d: &Distill<M>| -> Result<(f64, f64, f64), tokenformer::Error> {
        let (mut sum, mut kl, mut hid) = (0.0, 0.0, 0.0);
        for b in eval {
            let (l, p) = d.evaluate(b)?;
            (sum, kl, hid) = (sum + l, kl + p.kl, hid + p.hidden);
        }
        let n = eval.len().max(1) as f64;
        Ok((sum / n, kl / n, hid / n))
    };
    let model = distill::distill(
        student,
        rec.options(seq_len),
        rec.hidden_weight,
        update_scales,
        next,
        teacher,
        |d, r| {
            let parts = d.last_parts();
            let mut line = json!({
                "step": r.step, "lr": r.lr, "loss": r.loss, "kl": parts.kl,
                "hidden_mse": parts.hidden, "grad_norm": r.grad_norm,
            });
            line[counts] = json!(r.tokens);
            if r.step % every == 0 || r.step == rec.steps {
                let (v, kl, hid) = eval_loss(d)?;
                line["val_loss"] = json!(v);
                line["val_kl"] = json!(kl);
                line["val_hidden_mse"] = json!(hid);
                last_eval = v;
            }
            if let Err(e) = writeln!(metrics, "{line}") {
                io_error.get_or_insert(e);
            }
            curve.push(&line);
            first.get_or_insert(r.loss);
            last = r.loss;
            let rate = r.tokens as f64 / started.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!(
                "loss {:.4} (KL {:.4}){}  {rate:.1} {counts}/s",
                r.loss,
                parts.kl,
                if last_eval.is_finite() {
                    format!("  eval {last_eval:.4}")
                } else {
                    String::new()
                }
            ));
            bar.set_position(r.step);
            Ok(())
        },
    )?;
    bar.finish_and_clear();
    if let Some(e) = io_error {
        return Err(e).with_context(|| format!("writing {}", metrics_path.display()));
    }
    curve.draw(dir)?;
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "recovered in {} steps ({seconds:.1} s): distillation loss {:.4} -> {last:.4}, on the eval data {last_eval:.4}",
        rec.steps,
        first.unwrap_or(f64::NAN),
    );
    Ok((
        model,
        Log {
            first_loss: first.unwrap_or(f64::NAN),
            final_loss: last,
            final_eval_loss: last_eval,
            seconds,
        },
    ))
}

impl RecoveryReport {
    pub fn new(
        rec: &Recovery,
        log: &Log,
        seq_len: Option<usize>,
        before: EndToEnd,
        change: AgreementChange,
    ) -> Self {
        let images = seq_len.is_none();
        Self {
            method: format!(
                "distillation on the calibration data: KL(source ‖ import) of the output distribution (temperature 1) plus {} × the mean over layers of each layer's hidden-state MSE relative to the source's mean square there; AdamW (betas 0.9, 0.95, no weight decay) on every Pattention's value tokens (keys as mapped), each token's update scaled by 1/RMS of its activation on the calibration data, 10% warm-up then cosine to lr/10, gradients clipped at 1; the source run by the importer's own forward on every batch",
                rec.hidden_weight
            ),
            steps: rec.steps,
            lr: rec.lr,
            hidden_weight: rec.hidden_weight,
            batch_size: rec.batch_size,
            seq_len,
            augmentation: images.then(|| {
                format!(
                    "random-resized crop (area {}–{}, aspect 3/4–4/3) and horizontal flip (p {}), seeded",
                    AUGMENT.scale.0, AUGMENT.scale.1, AUGMENT.hflip
                )
            }),
            first_loss: log.first_loss,
            final_loss: log.final_loss,
            final_eval_loss: log.final_eval_loss,
            seconds: log.seconds,
            before_end_to_end: before,
            top1_change: change.into(),
        }
    }
}
