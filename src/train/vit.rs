//! Training the TokenFormer image classifier: its forward as plain, differentiable
//! tensor ops over [`Var`]s (the semantics of [`crate::models::vit::VisionTransformer`]),
//! timm's training preprocessing (random-resized crop with scale (0.08, 1) and ratio
//! (3/4, 4/3), then a horizontal flip with probability ½; the model's eval transform
//! for validation), and the training loop over an image folder of class folders.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

use super::lm::{attention, layer_norm, param, pattention, AttentionSpec};
use super::optim::Moments;
use super::parts::{device_of, embed_image, weights_methods, Weights};
use super::trainer::{Augment, Fed, Source, TrainOptions, Trainable, TrainerState};
use crate::checkpoint::Tensors;
use crate::error::{Error, Result};
use crate::grow::{self, GrowInit};
use crate::models::tokenformer::ScaleTokens;
use crate::models::vit::{Config, Pool};
use crate::vision::dataset::Sample;
use crate::vision::resample::{self, Filter};
use crate::vision::{open_rgb, EvalTransform, RgbImage};

/// A classifier whose every tensor is a [`Var`], in f32 or f64, computing in that
/// dtype or in bf16 over casts of the variables (mixed precision, as
/// [`super::TrainableLm::with_compute_dtype`]).
pub struct TrainableVit {
    cfg: Config,
    weights: Weights,
}

/// Canonical tensor names and shapes of a classifier config.
pub fn expected_shapes(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let (d, c, p) = (cfg.hidden_size, cfg.num_channels, cfg.patch_size);
    let mut v = vec![
        ("patch_embed.weight".to_string(), vec![d, c, p, p]),
        ("patch_embed.bias".to_string(), vec![d]),
        ("cls_token".to_string(), vec![1, 1, d]),
        ("pos_embed".to_string(), vec![1, cfg.num_patches() + 1, d]),
    ];
    let counts = [
        ("attention.query", cfg.qkv_tokens),
        ("attention.key", cfg.qkv_tokens),
        ("attention.value", cfg.qkv_tokens),
        ("attention.proj", cfg.proj_tokens),
        ("mlp", cfg.ffn_tokens),
    ];
    for i in 0..cfg.num_layers {
        for (m, n) in counts {
            v.push((format!("layers.{i}.{m}.key_param_tokens"), vec![n, d]));
            v.push((format!("layers.{i}.{m}.value_param_tokens"), vec![n, d]));
        }
    }
    let norm = match cfg.pool {
        Pool::Mean => "fc_norm",
        Pool::Cls => "final_norm",
    };
    v.push((format!("{norm}.weight"), vec![d]));
    v.push((format!("{norm}.bias"), vec![d]));
    v.push(("head.weight".into(), vec![cfg.num_classes, d]));
    v.push(("head.bias".into(), vec![cfg.num_classes]));
    v
}

/// Fresh weights as ViTs initialise them: the patch embedding, class token, position
/// embeddings, parameter tokens and head N(0, 0.02); biases 0, the norm's weight 1.
/// Deterministic for a seed.
pub fn init_tensors(cfg: &Config, seed: u64, device: &Device) -> Result<Tensors> {
    let mut t = Tensors::new();
    for (i, (name, shape)) in expected_shapes(cfg).into_iter().enumerate() {
        let value = if name.ends_with("bias") {
            Tensor::zeros(shape.as_slice(), DType::F32, device)?
        } else if name.ends_with("norm.weight") {
            Tensor::ones(shape.as_slice(), DType::F32, device)?
        } else {
            let n: usize = shape.iter().product();
            let v = crate::init::normal(n, 1, 0.02, seed.wrapping_add(i as u64), &name);
            Tensor::from_vec(v, shape.as_slice(), device)?
        };
        t.insert(name, value);
    }
    Ok(t)
}

impl TrainableVit {
    /// Wraps canonical-name tensors (converted to `dtype`) as variables; every tensor
    /// the config needs must be present with its shape, and none left over.
    pub fn new(cfg: &Config, tensors: &Tensors, dtype: DType, device: &Device) -> Result<Self> {
        cfg.validate()
            .map_err(|e| Error::input(format!("invalid config: {e}")))?;
        Ok(Self {
            weights: Weights::new(expected_shapes(cfg), tensors, dtype, device)?,
            cfg: cfg.clone(),
        })
    }

    weights_methods!();

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn p(&self, name: &str) -> candle_core::Result<Tensor> {
        param(&self.weights.cast(), name)
    }

    fn scales(&self) -> [usize; 3] {
        let c = &self.cfg;
        match c.pattention_scale_tokens {
            Some(s) => [s.qkv, s.proj, s.ffn],
            None => [c.qkv_tokens, c.proj_tokens, c.ffn_tokens],
        }
    }

    /// Logits [b, classes] of normalised pixels [b, C, H, W].
    pub fn forward(&self, pixels: &Tensor) -> candle_core::Result<Tensor> {
        self.logits_and_hidden(pixels, None)
    }

    /// Logits [b, classes] of pixels and each layer's output (the residual stream after
    /// block i) [b, tokens, d]: what distillation matches against a teacher's.
    pub fn forward_hidden(&self, pixels: &Tensor) -> candle_core::Result<(Tensor, Vec<Tensor>)> {
        let mut hidden = Vec::with_capacity(self.cfg.num_layers);
        let logits = self.logits_and_hidden(pixels, Some(&mut hidden))?;
        Ok((logits, hidden))
    }

    /// [`Self::forward`], pushing each layer's output onto `hidden` when given.
    fn logits_and_hidden(
        &self,
        pixels: &Tensor,
        mut hidden: Option<&mut Vec<Tensor>>,
    ) -> candle_core::Result<Tensor> {
        let cfg = &self.cfg;
        let params = self.weights.cast();
        let mut x = embed_image(&params, "", cfg, pixels, self.compute_dtype())?;
        let [sq, sp, sf] = self.scales();
        let act = cfg.pattention_activation;
        let spec = AttentionSpec {
            heads: cfg.num_heads,
            activation: act,
            scale_qkv: sq,
            scale_proj: sp,
        };
        let block = super::fused::BlockSpec {
            heads: cfg.num_heads,
            tokens: [0; 3],
            scale_tokens: [sq, sp, sf],
            causal: false,
            parallel_residual: false,
            eps: cfg.norm_eps,
        };
        for i in 0..cfg.num_layers {
            let prefix = format!("layers.{i}");
            if let Some(y) =
                super::lm::fused_block(&params, &prefix, &x, act, &block, Default::default())?
            {
                x = y;
                if let Some(hidden) = hidden.as_deref_mut() {
                    hidden.push(x.clone());
                }
                continue;
            }
            let hn = layer_norm(&x, cfg.norm_eps)?;
            let a = attention(
                &params,
                &format!("layers.{i}.attention"),
                &hn,
                &spec,
                false,
                None,
            )?;
            x = (x + a)?;
            let hn = layer_norm(&x, cfg.norm_eps)?;
            x = (&x + pattention(&params, &format!("layers.{i}.mlp"), &hn, act, sf)?)?;
            if let Some(hidden) = hidden.as_deref_mut() {
                hidden.push(x.clone());
            }
        }
        let n = x.dim(1)? - 1;
        let (feature, norm) = match cfg.pool {
            // The mean sums in f32 at least, like every reduction.
            Pool::Mean => (
                crate::kernels::widened(&x)?
                    .narrow(1, 1, n)?
                    .mean(1)?
                    .to_dtype(x.dtype())?,
                "fc_norm",
            ),
            Pool::Cls => (x.narrow(1, 0, 1)?.squeeze(1)?, "final_norm"),
        };
        let feature = layer_norm(&feature, cfg.norm_eps)?
            .broadcast_mul(&self.p(&format!("{norm}.weight"))?)?
            .broadcast_add(&self.p(&format!("{norm}.bias"))?)?;
        feature
            .matmul(&self.p("head.weight")?.t()?)?
            .broadcast_add(&self.p("head.bias")?)
    }

    /// Mean cross-entropy of the logits of `pixels` against `labels` \[b\] (u32).
    pub fn loss(&self, pixels: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
        super::loss::cross_entropy(&self.forward(pixels)?, &labels.to_vec1::<u32>()?)
    }
}

/// timm's training transform for a config: random-resized crop (scale (0.08, 1),
/// ratio (3/4, 4/3), torchvision's `get_params` with ten tries and the centre-crop
/// fallback), resize of the crop with the model's filter, flip with probability ½,
/// then ToTensor and Normalize.
#[derive(Clone, Debug)]
pub struct TrainTransform {
    eval: EvalTransform,
    augment: Augment,
}

impl TrainTransform {
    pub fn from_config(cfg: &Config, augment: Augment) -> Self {
        Self {
            eval: EvalTransform::from_config(cfg),
            augment,
        }
    }

    /// The crop box (x, y, w, h) torchvision's `RandomResizedCrop.get_params` draws.
    pub fn crop_box(
        width: usize,
        height: usize,
        scale: (f64, f64),
        rng: &mut impl Rng,
    ) -> (usize, usize, usize, usize) {
        let area = (width * height) as f64;
        let (lr0, lr1) = ((3.0f64 / 4.0).ln(), (4.0f64 / 3.0).ln());
        for _ in 0..10 {
            let target = area * rng.random_range(scale.0..=scale.1);
            let ratio = rng.random_range(lr0..lr1).exp();
            let w = (target * ratio).sqrt().round() as usize;
            let h = (target / ratio).sqrt().round() as usize;
            if 0 < w && w <= width && 0 < h && h <= height {
                let y = rng.random_range(0..=height - h);
                let x = rng.random_range(0..=width - w);
                return (x, y, w, h);
            }
        }
        // Fallback: the whole image, its aspect clamped to the ratio range, centred.
        let in_ratio = width as f64 / height as f64;
        let (w, h) = if in_ratio < 3.0 / 4.0 {
            (width, ((width as f64) / (3.0 / 4.0)).round() as usize)
        } else if in_ratio > 4.0 / 3.0 {
            (((height as f64) * (4.0 / 3.0)).round() as usize, height)
        } else {
            (width, height)
        };
        let (w, h) = (w.min(width), h.min(height));
        ((width - w) / 2, (height - h) / 2, w, h)
    }

    /// The normalised [3, size, size] values of one training view of `img`.
    pub fn apply(&self, img: &RgbImage, rng: &mut impl Rng) -> Result<Vec<f32>> {
        if img.width == 0 || img.height == 0 {
            return Err(Error::input("empty image"));
        }
        let (x0, y0, w, h) = Self::crop_box(img.width, img.height, self.augment.scale, rng);
        let mut crop = Vec::with_capacity(w * h * 3);
        for y in y0..y0 + h {
            let row = (y * img.width + x0) * 3;
            crop.extend_from_slice(&img.data[row..row + w * 3]);
        }
        let crop = RgbImage {
            width: w,
            height: h,
            data: crop,
        };
        let size = self.eval.crop;
        let filter: Filter = self.eval.filter;
        let mut view = resample::resize(&crop, size, size, filter);
        if rng.random_bool(self.augment.hflip) {
            for row in view.data.chunks_exact_mut(size * 3) {
                for x in 0..size / 2 {
                    for c in 0..3 {
                        row.swap(x * 3 + c, (size - 1 - x) * 3 + c);
                    }
                }
            }
        }
        let mut out = vec![0f32; 3 * size * size];
        self.eval.normalise_into(&view, &mut out);
        Ok(out)
    }
}

/// A seeded walk over `n` items: a fresh shuffle each epoch (position / n), and an RNG
/// per position (for augmentation), so a run resumed at a position draws the same.
pub(crate) struct Order {
    n: usize,
    seed: u64,
    position: u64,
    epoch: Option<(u64, Vec<usize>)>,
}

impl Order {
    pub(crate) fn new(n: usize, seed: u64, position: u64) -> Self {
        Self {
            n,
            seed,
            position,
            epoch: None,
        }
    }

    pub(crate) fn position(&self) -> u64 {
        self.position
    }

    /// The next item and the RNG of its augmentation.
    pub(crate) fn next(&mut self) -> (usize, rand::rngs::StdRng) {
        let n = self.n as u64;
        let epoch = self.position / n;
        if self.epoch.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut idx: Vec<usize> = (0..self.n).collect();
            let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed ^ epoch.rotate_left(32));
            for i in (1..idx.len()).rev() {
                let j = rng.random_range(0..=i);
                idx.swap(i, j);
            }
            self.epoch = Some((epoch, idx));
        }
        let i = self.epoch.as_ref().expect("set above").1[(self.position % n) as usize];
        let rng = rand::rngs::StdRng::seed_from_u64(
            self.seed.rotate_left(17) ^ self.position.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        );
        self.position += 1;
        (i, rng)
    }
}

/// One optimiser step's numbers (images instead of tokens).
pub use super::trainer::StepReport;

/// The classifier config after growing to `target` with the √n constants kept (the
/// function-preserving rule), recording the old counts in `grown_from_tokens`.
pub fn grown_config(cfg: &Config, target: &ScaleTokens) -> Result<Config> {
    let old = counts(cfg);
    let mut c = cfg.clone();
    c.pattention_scale_tokens = Some(cfg.pattention_scale_tokens.unwrap_or(old));
    if c.pattention_scale_tokens == Some(*target) {
        c.pattention_scale_tokens = None;
    }
    (c.qkv_tokens, c.proj_tokens, c.ffn_tokens) = (target.qkv, target.proj, target.ffn);
    c.grown_from_tokens = (old != *target).then_some(old);
    c.validate()
        .map_err(|e| Error::input(format!("the grown config is invalid: {e}")))?;
    Ok(c)
}

fn counts(cfg: &Config) -> ScaleTokens {
    ScaleTokens {
        qkv: cfg.qkv_tokens,
        proj: cfg.proj_tokens,
        ffn: cfg.ffn_tokens,
    }
}

impl Trainable for TrainableVit {
    /// Pixels [b, 3, s, s] and labels \[b\] (u32).
    type Batch = (Tensor, Tensor);
    const GROWS: bool = true;

    fn params(&self) -> &BTreeMap<String, Var> {
        &self.weights.params
    }

    fn loss_of(&self, (pixels, labels): &Self::Batch) -> candle_core::Result<Tensor> {
        self.loss(pixels, labels)
    }

    fn config_json(&self) -> String {
        serde_json::to_string_pretty(&self.cfg).expect("serialisable")
    }

    fn grown_from(&self) -> Option<ScaleTokens> {
        self.cfg.grown_from_tokens
    }

    fn grown(&self, spec: &str, init: &GrowInit) -> Result<Self> {
        let target = grow::parse_target(spec, &counts(&self.cfg))?;
        let cfg = grown_config(&self.cfg, &target)?;
        let (tensors, _) = grow::grow_tensors(self.tensors(), &counts(&self.cfg), &target, init)?;
        Ok(
            Self::new(&cfg, &tensors, self.dtype(), &device_of(self.params()))?
                .with_compute_dtype(self.compute_dtype()),
        )
    }
}

/// Labelled images in a seeded order, each with timm's training preprocessing.
pub struct ImageSource {
    samples: Vec<Sample>,
    order: Order,
    transform: TrainTransform,
    size: usize,
    device: Device,
}

impl Source<TrainableVit> for ImageSource {
    fn next_batch(&mut self, b: usize) -> Result<((Tensor, Tensor), u64)> {
        let size = self.size;
        let mut pixels = Vec::with_capacity(b * 3 * size * size);
        let mut labels = Vec::with_capacity(b);
        for _ in 0..b {
            let (i, mut rng) = self.order.next();
            let s = &self.samples[i];
            let img = open_rgb(&s.path)?;
            let v = self
                .transform
                .apply(&img, &mut rng)
                .map_err(|e| Error::input(format!("{}: {e}", s.path.display())))?;
            pixels.extend(v);
            labels.push(s.label as u32);
        }
        let batch = (
            Tensor::from_vec(pixels, (b, 3, size, size), &self.device)?,
            Tensor::from_vec(labels, b, &self.device)?,
        );
        Ok((batch, b as u64))
    }

    fn position(&self) -> u64 {
        self.order.position()
    }
}

/// A classifier being trained on labelled images.
pub type VitTrainer = Fed<TrainableVit, ImageSource>;

impl VitTrainer {
    /// Starts (or, with `resume`, continues) training on `samples`.
    pub fn new(
        model: TrainableVit,
        samples: Vec<Sample>,
        opts: TrainOptions,
        resume: Option<(TrainerState, BTreeMap<String, Moments>)>,
    ) -> Result<Self> {
        if samples.is_empty() {
            return Err(Error::input("no training images"));
        }
        let position = resume.as_ref().map_or(0, |(s, _)| s.data_position);
        let source = ImageSource {
            order: Order::new(samples.len(), opts.seed, position),
            samples,
            transform: TrainTransform::from_config(model.config(), opts.augment),
            size: model.config().image_size,
            device: device_of(model.params()),
        };
        Self::with(model, source, opts, resume)
    }

    /// Mean loss and top-1 accuracy over preprocessed (eval transform) images.
    pub fn evaluate(&self, images: &[(Vec<f32>, u32)], batch: usize) -> Result<(f64, f64)> {
        let size = self.model().config().image_size;
        let (mut loss, mut correct) = (0.0, 0usize);
        for chunk in images.chunks(batch.max(1)) {
            let flat: Vec<f32> = chunk.iter().flat_map(|(p, _)| p.iter().copied()).collect();
            let labels: Vec<u32> = chunk.iter().map(|(_, l)| *l).collect();
            let x = Tensor::from_vec(flat, (chunk.len(), 3, size, size), &self.source().device)?;
            let y = Tensor::from_vec(labels.clone(), chunk.len(), &self.source().device)?;
            let logits = self.model().forward(&x)?;
            let l = candle_nn::loss::cross_entropy(&logits, &y)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            loss += l * chunk.len() as f64;
            let pred: Vec<u32> = logits.argmax(1)?.to_vec1()?;
            correct += pred.iter().zip(&labels).filter(|(a, b)| a == b).count();
        }
        let n = images.len().max(1) as f64;
        Ok((loss / n, correct as f64 / n))
    }
}
