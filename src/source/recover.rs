//! Recovery: a TokenFormer made from a source Transformer trained to behave like it
//! (distillation, [`crate::train::distill`]), as both `tokenformer-convert import
//! --recover-steps N` and `tokenformer train --distill-from SOURCE` run it: KL(source ‖
//! TokenFormer) of the output distribution plus a weight times each layer's relative
//! hidden-state MSE, the source run by its own forward ([`super`]) on every batch, AdamW
//! on the Pattention value tokens. Text trains on random windows of the calibration
//! text; images on light timm-style views of the calibration photos (random-resized
//! crop of [`AUGMENT`]'s area range, horizontal flip), both from a fixed seed.
//! `metrics.jsonl` and `loss.png` (as `train` writes them) go into a folder; the
//! distillation loss on held-out eval data is their validation curve. Progress goes to
//! a callback: the commands draw the bar.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor};
use rand::{Rng, SeedableRng};
use serde_json::json;

use super::data::Images;
use super::gpt_neox::NeoxSource;
use super::vit::{for_batches, vit_embed, VitSource};
use super::{Block, Stack};
use crate::checkpoint::Tensors;
use crate::error::{Error, Result};
use crate::models::tokenformer::{self as lm, PATTENTIONS};
use crate::models::vit;
use crate::pattention::{theta, Activation, Pattention};
use crate::train::distill::{self, Distill, DistillBatch, Distillable, Targets};
use crate::train::plot::Curve;
use crate::train::vit::{TrainTransform, TrainableVit};
use crate::train::{Augment, TrainOptions, Trainable, TrainableLm};
use crate::vision::EvalTransform;

/// The most steps (about a day on 2 cores at the smallest sizes).
pub const MAX_STEPS: u64 = 1_000_000;

/// The training views of calibration photos: lighter than timm's ImageNet training
/// default (scale 0.08–1), since the target is the source's function on these photos,
/// not invariance to small crops.
pub const AUGMENT: Augment = Augment {
    scale: (0.35, 1.0),
    hflip: 0.5,
};

/// What trains: every Pattention's value tokens, each row's update scaled by 1/RMS of
/// its token's activation ([`value_update_scales`]). The keys stay as they are: an
/// import's differ by ~10⁶ in scale by construction and set the normalisation every
/// score shares, which a step of Adam's size would upset (measured: one step at lr
/// 2.5e-5 on the keys of the random ViT fixture raised the loss ten-million-fold).
pub const TRAINED: &str = "layers.*.value_param_tokens";

/// The seed of the windows, views and their order.
pub const SEED: u64 = 0x0072_6563_6f76_6572;

/// The window text trains on (random offsets into the calibration text).
pub const TEXT_WINDOW: usize = 128;

/// Held-out batches (text windows, or batches of photos) the loss is measured on.
pub const EVAL_BATCHES: usize = 8;

/// The most calibration rows (tokens, or patches and class tokens) a fit keeps:
/// it holds each row's activations in memory (the source's and the import's,
/// and the five targets of a layer), and accumulating AᵀA costs rows·n² (at
/// 16,384 rows and an MLP of n = 4,096 tokens, about half a minute on 2 cores).
/// The output projections' scales still see all the calibration data.
pub const MAX_FIT_ROWS: usize = 16_384;

/// How often (in steps) the held-out loss is measured: ten times a run, and at its end.
fn eval_every(steps: u64) -> u64 {
    steps.div_ceil(10).max(1)
}

/// A recovery's settings.
#[derive(Clone, Debug)]
pub struct Recovery {
    pub steps: u64,
    pub lr: f64,
    pub hidden_weight: f64,
    pub batch_size: usize,
}

/// The command-line flags of [`Recovery`]'s fields, for its messages.
pub struct Flags {
    pub steps: &'static str,
    pub lr: &'static str,
    pub hidden_weight: &'static str,
    pub batch_size: &'static str,
}

impl Recovery {
    /// Refuses bad values, naming them by `flags`.
    pub fn check(&self, flags: &Flags) -> Result<()> {
        let steps = self.steps;
        if steps == 0 {
            bail!(
                "{} 0: give at least 1 step, or leave the flag out for no recovery",
                flags.steps
            );
        }
        if steps > MAX_STEPS {
            bail!("{} {steps}: at most {MAX_STEPS} steps", flags.steps);
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bail!("{} {}: must be a positive number", flags.lr, self.lr);
        }
        if !(self.hidden_weight.is_finite() && self.hidden_weight >= 0.0) {
            bail!(
                "{} {}: must be a non-negative number",
                flags.hidden_weight,
                self.hidden_weight
            );
        }
        if self.batch_size == 0 {
            bail!("{} 0: must be at least 1", flags.batch_size);
        }
        Ok(())
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

    /// The method, in words, for reports and model cards.
    pub fn describe(&self) -> String {
        format!(
            "distillation on the calibration data: KL(source ‖ TokenFormer) of the output distribution (temperature 1) plus {} × the mean over layers of each layer's hidden-state MSE relative to the source's mean square there; AdamW (betas 0.9, 0.95, no weight decay) on every Pattention's value tokens (keys kept), each token's update scaled by 1/RMS of its activation on the calibration data, 10% warm-up then cosine to lr/10, gradients clipped at 1; the source run by its own forward on every batch",
            self.hidden_weight
        )
    }
}

/// The training views of photos, in words.
pub fn describe_augmentation() -> String {
    format!(
        "random-resized crop (area {}–{}, aspect 3/4–4/3) and horizontal flip (p {}), seeded",
        AUGMENT.scale.0, AUGMENT.scale.1, AUGMENT.hflip
    )
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

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// `b` windows as ids [b, len], with the tokens they count.
    pub fn next(&mut self, b: usize) -> Result<(Tensor, u64)> {
        if self.ids.is_empty() {
            bail!("no calibration tokens to train on");
        }
        let mut v = Vec::with_capacity(b * self.len);
        for _ in 0..b {
            let start = self.rng.random_range(0..=self.ids.len() - self.len);
            v.extend_from_slice(&self.ids[start..start + self.len]);
        }
        let t = Tensor::from_vec(v, (b, self.len), &Device::Cpu)?;
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
    pub fn draw(&mut self) -> (usize, &mut rand::rngs::StdRng) {
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

/// The calibration data as the first layer sees it: the source's embedded inputs
/// [b, t, d] of each batch, whole samples in order up to [`MAX_FIT_ROWS`] rows.
#[derive(Default)]
pub struct FitInputs {
    pub batches: Vec<Tensor>,
    pub rows: usize,
    /// Rows of the calibration data beyond [`MAX_FIT_ROWS`], left out.
    pub left_out: usize,
}

impl FitInputs {
    /// Keeps the samples of a batch x [b, t, d] that fit within [`MAX_FIT_ROWS`].
    pub fn push(&mut self, x: &Tensor) -> Result<()> {
        let (b, t) = (x.dim(0)?, x.dim(1)?);
        let keep = (MAX_FIT_ROWS.saturating_sub(self.rows) / t.max(1)).min(b);
        if keep > 0 {
            self.batches.push(x.narrow(0, 0, keep)?);
            self.rows += keep * t;
        }
        self.left_out += (b - keep) * t;
        Ok(())
    }

    /// The calibration ids in windows of the source's context, embedded by the source.
    pub fn of_text(src: &NeoxSource, ids: &[u32]) -> Result<Self> {
        let mut f = Self::default();
        for w in ids.chunks(src.window()) {
            f.push(&src.embed(&Tensor::new(w, &Device::Cpu)?.unsqueeze(0)?)?)?;
        }
        Ok(f)
    }

    /// The calibration photos preprocessed by `t`, embedded by the source.
    pub fn of_images(src: &VitSource, images: &Images, t: &EvalTransform) -> Result<Self> {
        let mut f = Self::default();
        for_batches(images, t, &Device::Cpu, |px| {
            f.push(&vit_embed(src, px)?)?;
            Ok::<_, Error>(())
        })?;
        Ok(f)
    }
}

/// A TokenFormer layer as a [`Block`]: its five Pattention layers in [`PATTENTIONS`]
/// order (its LayerNorms have no parameters, as the [`Stack`] runs them).
pub struct PattentionBlock(pub [Pattention; 5]);

impl Block for PattentionBlock {
    fn qkv(&self, u: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        Ok((
            self.0[0].forward(u)?,
            self.0[1].forward(u)?,
            self.0[2].forward(u)?,
        ))
    }
    fn proj(&self, o: &Tensor) -> candle_core::Result<Tensor> {
        self.0[3].forward(o)
    }
    fn mlp(&self, u: &Tensor) -> candle_core::Result<Tensor> {
        self.0[4].forward(u)
    }
}

/// The keys and values of each Pattention of layer `i` in `tensors`.
fn layer_kv(tensors: &Tensors, i: usize) -> Result<[(Tensor, Tensor); 5]> {
    let get = |name: String| {
        tensors.get(&name).cloned().ok_or_else(|| Error::Tensor {
            name,
            msg: "missing from the TokenFormer being trained".into(),
        })
    };
    let kv = |j: usize| -> Result<(Tensor, Tensor)> {
        let p = format!("layers.{i}.{}", PATTENTIONS[j]);
        Ok((
            get(format!("{p}.key_param_tokens"))?,
            get(format!("{p}.value_param_tokens"))?,
        ))
    };
    Ok([kv(0)?, kv(1)?, kv(2)?, kv(3)?, kv(4)?])
}

/// How a TokenFormer's Pattentions normalise: the activation and each part's √n
/// constant (None: the token count).
#[derive(Clone, Copy)]
pub struct Theta {
    pub activation: Activation,
    pub scale_tokens: Option<lm::ScaleTokens>,
}

impl Theta {
    fn scale(&self, j: usize) -> Option<usize> {
        self.scale_tokens.map(|s| match j {
            0..=2 => s.qkv,
            3 => s.proj,
            _ => s.ffn,
        })
    }
}

/// The Pattention layers of `layers` layers of `tensors` as [`Block`]s.
pub fn blocks(tensors: &Tensors, layers: usize, th: Theta) -> Result<Vec<PattentionBlock>> {
    (0..layers)
        .map(|i| {
            let kv = layer_kv(tensors, i)?;
            let p = |j: usize| {
                Pattention::from_tensors(
                    kv[j].0.clone(),
                    kv[j].1.clone(),
                    th.activation,
                    th.scale(j),
                )
            };
            Ok(PattentionBlock([p(0)?, p(1)?, p(2)?, p(3)?, p(4)?]))
        })
        .collect()
}

/// Each Pattention's value-token update scales, 1/RMS of its tokens' activations on
/// the calibration `inputs` run through the TokenFormer of `tensors` by `stack`: one
/// scale per token group of an import (memory anchors, bias tokens), not per
/// token, so that a token the calibration rows barely activate does not get a huge
/// scale (Adam takes a full step on however small a gradient). Anchors, bias tokens
/// and MLP memories score ~10¹⁰ apart by construction, so Adam's equal-size step on
/// every value would move the output by amounts as far apart.
pub fn value_update_scales(
    stack: &Stack,
    tensors: &Tensors,
    layers: usize,
    th: Theta,
    inputs: &FitInputs,
) -> Result<BTreeMap<String, Tensor>> {
    let blocks = blocks(tensors, layers, th)?;
    let keys: Vec<[(Tensor, Tensor); 5]> = (0..layers)
        .map(|i| layer_kv(tensors, i))
        .collect::<Result<_>>()?;
    // Per layer and part: Σ activation² per token, and the rows summed over.
    let mut sums: Vec<[Option<Tensor>; 5]> = vec![Default::default(); layers];
    let mut rows = 0usize;
    for x in &inputs.batches {
        let (_, traces) = stack.run(&blocks, x)?;
        rows += traces.first().map_or(0, |t| t.attn_in.dim(0).unwrap_or(0));
        for ((kv, t), acc) in keys.iter().zip(&traces).zip(sums.iter_mut()) {
            let ins = [&t.attn_in, &t.attn_in, &t.attn_in, &t.proj_in, &t.mlp_in];
            for (j, input) in ins.into_iter().enumerate() {
                let scores = input.matmul(&kv[j].0.t()?)?;
                let n = kv[j].0.dim(0)?;
                let a = theta(&scores, th.activation, th.scale(j).unwrap_or(n))?
                    .to_dtype(DType::F64)?
                    .sqr()?
                    .sum(0)?;
                acc[j] = Some(match acc[j].take() {
                    Some(s) => (s + a)?,
                    None => a,
                });
            }
        }
    }
    let mut out = BTreeMap::new();
    for (i, parts) in sums.into_iter().enumerate() {
        for (j, sum) in parts.into_iter().enumerate() {
            let Some(sum) = sum else { continue };
            let ms: Vec<f64> = (sum / rows.max(1) as f64)?.to_vec1()?;
            let (n, d) = keys[i][j].0.dims2()?;
            let fixed = (4 * d).min(n);
            let groups = [
                (0, n - fixed),
                (n - fixed, fixed / 2),
                (n - fixed / 2, fixed / 2),
            ];
            let mut scale = vec![1f32; n];
            for (start, len) in groups {
                if len == 0 {
                    continue;
                }
                let mean = ms[start..start + len].iter().sum::<f64>() / len as f64;
                let s = 1.0 / mean.sqrt().max(f64::MIN_POSITIVE.sqrt());
                scale[start..start + len].fill(s as f32);
            }
            let scale = Tensor::from_vec(scale, (n, 1), &Device::Cpu)?;
            out.insert(
                format!("layers.{i}.{}.value_param_tokens", PATTENTIONS[j]),
                scale,
            );
        }
    }
    Ok(out)
}

/// What a recovery measured while training.
#[derive(Clone, Debug)]
pub struct Log {
    /// The distillation loss of the first and the last step, and on the eval data at
    /// the end (KL + weight · hidden term; `metrics.jsonl` has every step).
    pub first_loss: f64,
    pub final_loss: f64,
    pub final_eval_loss: f64,
    pub seconds: f64,
}

/// One step, for a progress bar.
#[derive(Clone, Debug)]
pub struct StepProgress {
    pub step: u64,
    pub steps: u64,
    pub loss: f64,
    pub kl: f64,
    /// The latest held-out loss, once measured.
    pub eval_loss: Option<f64>,
    /// Items (tokens, images) per second so far.
    pub rate: f64,
    /// What the items are.
    pub counts: &'static str,
}

impl StepProgress {
    /// `loss 0.1234 (KL 0.0123)  eval 0.1300  1234.5 tokens/s`.
    pub fn message(&self) -> String {
        let eval = self
            .eval_loss
            .map_or(String::new(), |v| format!("  eval {v:.4}"));
        format!(
            "loss {:.4} (KL {:.4}){eval}  {:.1} {}/s",
            self.loss, self.kl, self.rate, self.counts
        )
    }
}

/// Distills `student` towards the source (`teacher`) on batches from `next`, the
/// held-out `eval` batches measured ten times a run; `metrics.jsonl` and `loss.png`
/// into `dir`, each step told to `progress`. `counts`: what a step's items are.
#[allow(clippy::too_many_arguments)]
pub fn run<M: Distillable>(
    rec: &Recovery,
    seq_len: usize,
    student: M,
    update_scales: BTreeMap<String, Tensor>,
    dir: &Path,
    counts: &'static str,
    next: impl FnMut() -> Result<(M::Input, u64)>,
    teacher: impl FnMut(&M::Input) -> Result<Targets>,
    eval: &[DistillBatch<M::Input>],
    mut progress: impl FnMut(&StepProgress),
) -> Result<(M, Log)> {
    let metrics_path = dir.join("metrics.jsonl");
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .map_err(|e| Error::io(&metrics_path, e))?;
    let mut curve = Curve::default();
    let started = Instant::now();
    let every = eval_every(rec.steps);
    let (mut first, mut last, mut last_eval) = (None, 0.0, f64::NAN);
    let mut io_error = None;
    let eval_loss = |d: &Distill<M>| -> Result<(f64, f64, f64)> {
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
            progress(&StepProgress {
                step: r.step,
                steps: rec.steps,
                loss: r.loss,
                kl: parts.kl,
                eval_loss: last_eval.is_finite().then_some(last_eval),
                rate: r.tokens as f64 / started.elapsed().as_secs_f64().max(1e-9),
                counts,
            });
            Ok(())
        },
    )?;
    if let Some(e) = io_error {
        return Err(Error::io(&metrics_path, e));
    }
    curve.draw(dir)?;
    Ok((
        model,
        Log {
            first_loss: first.unwrap_or(f64::NAN),
            final_loss: last,
            final_eval_loss: last_eval,
            seconds: started.elapsed().as_secs_f64(),
        },
    ))
}

/// Checks that a TokenFormer language model has the source's shape: what the
/// distillation compares (logits, one hidden state per layer) must line up.
pub fn check_lm_fits(src: &NeoxSource, cfg: &lm::Config, what: &str) -> Result<()> {
    let s = &src.cfg;
    for (key, theirs, ours) in [
        ("hidden_size", s.hidden_size, cfg.hidden_size),
        ("num_layers", s.num_layers, cfg.num_layers),
        ("vocab_size", s.vocab_size, cfg.vocab_size),
    ] {
        if theirs != ours {
            bail!("{what}: `{key}` is {ours} but the source's is {theirs}: the TokenFormer does not fit this source (distillation matches logits and each layer's output)");
        }
    }
    Ok(())
}

/// Checks that a TokenFormer-ViT has the source's shape and input.
pub fn check_vit_fits(src: &VitSource, cfg: &vit::Config, what: &str) -> Result<()> {
    let m = &src.meta;
    for (key, theirs, ours) in [
        ("hidden_size", m.hidden_size, cfg.hidden_size),
        ("num_layers", m.num_layers, cfg.num_layers),
        ("num_classes", m.num_classes, cfg.num_classes),
        ("image_size", m.image_size, cfg.image_size),
        ("patch_size", m.patch_size, cfg.patch_size),
        ("num_channels", m.num_channels, cfg.num_channels),
    ] {
        if theirs != ours {
            bail!("{what}: `{key}` is {ours} but the source's is {theirs}: the TokenFormer does not fit this source (distillation matches logits and each layer's output)");
        }
    }
    Ok(())
}

/// Recovers the language model `tensors` (config `cfg`) towards `src` on windows of the
/// calibration ids `calib` (embedded: `inputs`), measured on windows of `eval`: the
/// trained tensors, the log and the window length.
#[allow(clippy::too_many_arguments)]
pub fn recover_lm(
    src: &NeoxSource,
    cfg: &lm::Config,
    tensors: &Tensors,
    calib: &[u32],
    inputs: &FitInputs,
    eval: &[u32],
    rec: &Recovery,
    dir: &Path,
    progress: impl FnMut(&StepProgress),
) -> Result<(Tensors, Log, usize)> {
    let dev = Device::Cpu;
    let rotary = src.rotary(&dev)?;
    let stack = src.stack(&rotary);
    let teacher = |ids: &Tensor| src.targets(&stack, ids);
    let mut windows = TextWindows::new(calib.to_vec(), TEXT_WINDOW.min(src.window()));
    let seq_len = windows.len();
    let eval = eval
        .chunks(seq_len)
        .filter(|w| w.len() >= 2)
        .take(EVAL_BATCHES)
        .map(|w| {
            let input = Tensor::new(w, &dev)?.unsqueeze(0)?;
            Ok(DistillBatch {
                targets: teacher(&input)?,
                input,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let th = Theta {
        activation: cfg.pattention_activation,
        scale_tokens: cfg.pattention_scale_tokens,
    };
    let scales = value_update_scales(&stack, tensors, cfg.num_layers, th, inputs)?;
    let student = TrainableLm::new(cfg, tensors, DType::F32, &dev)?;
    let b = rec.batch_size;
    let (model, log) = run(
        rec,
        seq_len,
        student,
        scales,
        dir,
        "tokens",
        || windows.next(b),
        teacher,
        &eval,
        progress,
    )?;
    Ok((model.tensors(), log, seq_len))
}

/// The eval photos' pixel batches the held-out loss is measured on (the first
/// [`EVAL_BATCHES`] batches).
pub fn eval_pixels(images: &Images, t: &EvalTransform) -> Result<Vec<Tensor>> {
    let mut out = vec![];
    let first = images.clone().first(super::vit::BATCH * EVAL_BATCHES);
    for_batches(&first, t, &Device::Cpu, |px| {
        out.push(px.clone());
        Ok::<_, Error>(())
    })?;
    Ok(out)
}

/// Recovers the classifier `tensors` (config `cfg`) towards `src` on views of the
/// calibration photos `calib` (embedded: `inputs`), measured on the `eval` pixel
/// batches: the trained tensors and the log.
#[allow(clippy::too_many_arguments)]
pub fn recover_vit(
    src: &VitSource,
    cfg: &vit::Config,
    tensors: &Tensors,
    calib: &Images,
    inputs: &FitInputs,
    eval: &[Tensor],
    rec: &Recovery,
    dir: &Path,
    progress: impl FnMut(&StepProgress),
) -> Result<(Tensors, Log)> {
    let dev = Device::Cpu;
    let teacher = |px: &Tensor| src.targets(px);
    let eval = eval
        .iter()
        .map(|px| {
            Ok(DistillBatch {
                targets: teacher(px)?,
                input: px.clone(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let (c, size) = (cfg.num_channels, cfg.image_size);
    let views = TrainTransform::from_config(cfg, AUGMENT);
    let mut order = Shuffled::new(calib.len());
    let b = rec.batch_size;
    let next = || -> Result<(Tensor, u64)> {
        let mut pixels = Vec::with_capacity(b * c * size * size);
        for _ in 0..b {
            let (i, rng) = order.draw();
            let img = calib.decode(i)?;
            let v = views
                .apply(&img, rng)
                .map_err(|e| input_error!("{}: {e}", calib.name(i)))?;
            pixels.extend(v);
        }
        Ok((
            Tensor::from_vec(pixels, (b, c, size, size), &dev)?,
            b as u64,
        ))
    };
    let th = Theta {
        activation: cfg.pattention_activation,
        scale_tokens: cfg.pattention_scale_tokens,
    };
    let scales = value_update_scales(&src.stack(), tensors, cfg.num_layers, th, inputs)?;
    let student = TrainableVit::new(cfg, tensors, DType::F32, &dev)?;
    let (model, log) = run(
        rec, 1, student, scales, dir, "images", next, teacher, &eval, progress,
    )?;
    Ok((model.tensors(), log))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_keeps_whole_samples_up_to_its_bound() {
        let batch = |b: usize, t: usize| Tensor::zeros((b, t, 2), DType::F32, &Device::Cpu);
        let mut f = FitInputs::default();
        f.push(&batch(3, 5000).unwrap()).unwrap();
        f.push(&batch(2, 700).unwrap()).unwrap();
        f.push(&batch(4, 5000).unwrap()).unwrap();
        // 15,000 + 700 rows kept; the second batch's second sample and the
        // third batch would pass MAX_FIT_ROWS.
        assert_eq!((f.rows, f.left_out), (15_700, 700 + 20_000));
        let kept: Vec<usize> = f.batches.iter().map(|x| x.dim(0).unwrap()).collect();
        assert_eq!(kept, [3, 1]);
    }
}
