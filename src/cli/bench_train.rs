//! `tokenformer bench --only train`: training throughput as the PyTorch peer
//! (`../shared/bench/torch_train_baseline.py`) defines it: the `small` language model
//! (4 layers, d 256, 4 heads, 256/256/1024 parameter tokens, vocabulary 50304, sequence
//! 256, batch 8) in tokens/s and the tiny ViT (4 layers, d 192, 3 heads, 192/192/768
//! tokens, 32² images, patch 4, 10 classes, mean pooling, batch 64) in images/s; each
//! step is forward + backward + global-norm clipping at 1.0 + AdamW (lr 1e-3, betas
//! 0.9/0.95, eps 1e-8, weight decay 0.01), f32, random weights (N(0, 0.02)) and random
//! batches; the median of 5 timed steps after 2 warm-ups. Peak resident memory is
//! measured over each part. On a GPU also the GPU anchor's figures: the `base` LM (6
//! layers, d 512, 8 heads, 512/512/2048 tokens, sequence 512, batch 4) beside the small
//! one, each in f32 and bf16-mixed, and the ViT in bf16-mixed.

use std::time::Instant;

use super::bench::{part, peak_rss_mb, reset_peak_rss};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};
use tokenformer::models::tokenformer::Config;
use tokenformer::models::vit;
use tokenformer::train::{clip_grad_norm, AdamW, AdamWConfig, TrainableLm};

const STEPS: usize = 7;
const WARMUP: usize = 2;

fn adamw() -> AdamWConfig {
    AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

/// Median seconds of the timed steps of `step`, its first loss, and the peak RSS.
fn measure(mut step: impl FnMut(usize) -> Result<f64>) -> Result<(f64, f64, Option<f64>)> {
    // Give the heap's freed pages (kept for reuse) back first, so the peak is this part's.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the malloc heap.
    unsafe {
        libc::malloc_trim(0);
    }
    let reset = reset_peak_rss();
    let (mut times, mut first) = (vec![], None);
    for i in 0..STEPS {
        let t = Instant::now();
        let loss = step(i)?;
        if i >= WARMUP {
            times.push(t.elapsed().as_secs_f64());
        }
        first.get_or_insert(loss);
    }
    times.sort_by(f64::total_cmp);
    let peak = if reset { peak_rss_mb() } else { None };
    Ok((times[times.len() / 2], first.unwrap_or(f64::NAN), peak))
}

fn round(x: f64, d: i32) -> f64 {
    let m = 10f64.powi(d);
    (x * m).round() / m
}

/// The peer's language-model shapes: `small` (the CPU figure) and `base`.
#[derive(Clone, Copy)]
enum LmShape {
    Small,
    Base,
}

impl LmShape {
    fn name(self) -> &'static str {
        match self {
            LmShape::Small => "small",
            LmShape::Base => "base",
        }
    }
}

/// Tokens/s, first loss and peak RSS of training the peer's `shape` LM, computing in
/// `compute` (bf16: bf16-mixed, f32 master weights and optimizer state, as
/// `train --precision bf16-mixed`).
fn lm(dev: &Device, shape: LmShape, compute: DType) -> Result<(f64, f64, Option<f64>)> {
    // (layers, d, heads, feed-forward tokens, sequence, batch), as torch_train_baseline.py.
    let (layers, d, heads, ffn, s, b) = match shape {
        LmShape::Small => (4, 256, 4, 1024, 256, 8),
        LmShape::Base => (6, 512, 8, 2048, 512, 4),
    };
    let mut cfg = Config::released(layers, d, heads);
    cfg.ffn_tokens = ffn;
    cfg.max_position_embeddings = s;
    let tensors = tokenformer::train::lm::init_tensors(&cfg, 0, dev)?;
    let model = TrainableLm::new(&cfg, &tensors, DType::F32, dev)?.with_compute_dtype(compute);
    drop(tensors);
    let mut opt = AdamW::new(model.params().clone(), adamw())?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let (secs, first, peak) = measure(|_| {
        let ids: Vec<u32> = (0..b * (s + 1))
            .map(|_| rng.random_range(0..50_277))
            .collect();
        let ids = Tensor::from_vec(ids, (b, s + 1), dev)?;
        let loss = model.loss(&ids)?;
        let mut grads = loss.backward()?;
        clip_grad_norm(&mut grads, model.params().values(), 1.0)?;
        opt.step(&grads, 1e-3)?;
        Ok(loss.to_scalar::<f32>()? as f64)
    })?;
    Ok(((b * s) as f64 / secs, first, peak))
}

/// Images/s, first loss and peak RSS of training the peer's tiny ViT, computing in
/// `compute` (as `lm`).
fn vit(dev: &Device, compute: DType) -> Result<(f64, f64, Option<f64>)> {
    let mut cfg = vit::Config::imagenet(4, 192, 3, 192, 768);
    cfg.image_size = 32;
    cfg.patch_size = 4;
    cfg.num_classes = 10;
    cfg.norm_eps = 1e-5;
    let b = 64;
    let tensors = tokenformer::train::vit::init_tensors(&cfg, 1, dev)?;
    let model = tokenformer::train::vit::TrainableVit::new(&cfg, &tensors, DType::F32, dev)?
        .with_compute_dtype(compute);
    let mut opt = AdamW::new(model.params().clone(), adamw())?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let (secs, first, peak) = measure(|_| {
        let px = Tensor::randn(0f32, 1.0, (b, 3, 32, 32), dev)?;
        let labels: Vec<u32> = (0..b).map(|_| rng.random_range(0..10)).collect();
        let labels = Tensor::from_vec(labels, b, dev)?;
        let loss = model.loss(&px, &labels)?;
        let mut grads = loss.backward()?;
        clip_grad_norm(&mut grads, model.params().values(), 1.0)?;
        opt.step(&grads, 1e-3)?;
        Ok(loss.to_scalar::<f32>()? as f64)
    })?;
    Ok((b as f64 / secs, first, peak))
}

/// The training metrics, under the peer's keys (plus peak memory).
pub fn run(dev: &Device) -> Result<Map<String, Value>> {
    let mut out = Map::new();
    let small = lm(dev, LmShape::Small, DType::F32)?;
    let (rate, first, peak) = small;
    out.insert("train_lm_tokens_per_s".into(), json!(round(rate, 1)));
    out.insert("train_lm_first_loss".into(), json!(round(first, 4)));
    out.insert(
        "train_lm_peak_rss_mb".into(),
        json!(peak.map(|p| round(p, 1))),
    );
    let (rate, first, peak) = vit(dev, DType::F32)?;
    out.insert("train_vit_images_per_s".into(), json!(round(rate, 1)));
    out.insert("train_vit_first_loss".into(), json!(round(first, 4)));
    out.insert(
        "train_vit_peak_rss_mb".into(),
        json!(peak.map(|p| round(p, 1))),
    );
    if dev.is_cuda() {
        // The GPU anchor's figures (`../shared/gpu/torch_gpu_anchor.py`, its keys): both
        // LM shapes in f32 and bf16-mixed (its bf16 autocast), and the ViT in bf16-mixed.
        // One that fails is reported as `{key}_error` and the others still run.
        let mut record = |key: &str, unit: &str, r: Result<(f64, f64, Option<f64>)>| {
            part(&mut out, key, |o| {
                let (rate, first, _) = r?;
                o.insert(format!("{key}_{unit}_per_s"), json!(round(rate, 1)));
                o.insert(format!("{key}_first_loss"), json!(round(first, 4)));
                Ok(())
            })
        };
        // The small LM in f32 is the figure above.
        record("train_lm_small_f32", "tokens", Ok(small));
        for (shape, dtype, tag) in [
            (LmShape::Small, DType::BF16, "bf16amp"),
            (LmShape::Base, DType::F32, "f32"),
            (LmShape::Base, DType::BF16, "bf16amp"),
        ] {
            let key = format!("train_lm_{}_{tag}", shape.name());
            record(&key, "tokens", lm(dev, shape, dtype));
        }
        record("train_vit_bf16amp", "images", vit(dev, DType::BF16));
    }
    Ok(out)
}
