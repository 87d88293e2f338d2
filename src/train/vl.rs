//! Training the merged vision-language model on (image, caption) pairs: the mixed
//! sequence [image tokens; caption] as plain, differentiable tensor ops with the
//! semantics of [`crate::models::vl::VisionLanguageModel::forward_mixed`] (image rows
//! run the vision route and attend among themselves; caption rows run the language
//! route, attend to every image row and causally to the caption), and next-token
//! cross-entropy on the caption tokens only.
//!
//! Pairs come from a JSONL file of `{"image": path, "text": caption}` (paths relative
//! to the file's folder); images get the model's eval preprocessing, captions are
//! tokenised and ended with EOS, and a batch pads its captions to the longest (the
//! padding is left out of the loss).

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var, D};

use super::lm::{causal_mask, layer_norm, pattention, rotary_tables, rotate, softmax_last};
use super::optim::Moments;
use super::parts::{device_of, embed_image, weights_methods, Weights};
use super::trainer::{Fed, Source, TrainOptions, Trainable, TrainerState};
use super::vit::Order;
use crate::checkpoint::Tensors;
use crate::error::{Error, Result};
use crate::models::tokenformer::{self as lm, Rotary, ScaleTokens};
use crate::models::vit;
use crate::models::vl::Config;
use crate::vision::EvalTransform;

/// A merged model whose every tensor is a [`Var`].
pub struct TrainableVl {
    cfg: Config,
    vision: vit::Config,
    language: lm::Config,
    weights: Weights,
    rotary: Rotary,
}

/// Canonical tensor names and shapes of a merged config.
pub fn expected_shapes(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let mut v: Vec<(String, Vec<usize>)> = super::vit::expected_shapes(&cfg.vision)
        .into_iter()
        .filter(|(n, _)| !n.starts_with("layers."))
        .map(|(n, s)| (format!("vision.{n}"), s))
        .collect();
    v.extend(
        super::lm::expected_shapes(&cfg.language)
            .into_iter()
            .filter(|(n, _)| !n.starts_with("layers."))
            .map(|(n, s)| (format!("language.{n}"), s)),
    );
    let d = cfg.language.hidden_size;
    let g = &cfg.pattention_groups;
    for i in 0..cfg.language.num_layers {
        for (m, n) in [
            ("attention.query", g.qkv.total()),
            ("attention.key", g.qkv.total()),
            ("attention.value", g.qkv.total()),
            ("attention.proj", g.proj.total()),
            ("mlp", g.ffn.total()),
        ] {
            v.push((format!("layers.{i}.{m}.key_param_tokens"), vec![n, d]));
            v.push((format!("layers.{i}.{m}.value_param_tokens"), vec![n, d]));
        }
    }
    v
}

/// Rows before the bridge of each kind (what `--train bridge` leaves frozen).
pub fn bridge_starts(cfg: &Config) -> ScaleTokens {
    let g = &cfg.pattention_groups;
    ScaleTokens {
        qkv: g.qkv.vision + g.qkv.language,
        proj: g.proj.vision + g.proj.language,
        ffn: g.ffn.vision + g.ffn.language,
    }
}

fn scales(s: Option<ScaleTokens>) -> [usize; 3] {
    let s = s.expect("routes carry their √n constants");
    [s.qkv, s.proj, s.ffn]
}

impl TrainableVl {
    /// Wraps the merged checkpoint's tensors as variables (all present, none extra).
    pub fn new(cfg: &Config, tensors: &Tensors, dtype: DType, device: &Device) -> Result<Self> {
        cfg.validate()
            .map_err(|e| Error::input(format!("invalid config: {e}")))?;
        let weights = Weights::new(expected_shapes(cfg), tensors, dtype, device)?;
        let language = cfg.language_route();
        let rotary = Rotary::new(
            language.rotary_dims(),
            language.rotary_base,
            language.max_position_embeddings,
            device,
        )?;
        Ok(Self {
            cfg: cfg.clone(),
            vision: cfg.vision_route(),
            language,
            weights,
            rotary,
        })
    }

    weights_methods!();

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn p(&self, name: &str) -> candle_core::Result<Tensor> {
        super::lm::param(&self.weights.cast(), name)
    }

    /// The Pattention tensors of one route: its own group's rows and the bridge's.
    fn route(&self, vision: bool) -> candle_core::Result<BTreeMap<String, Tensor>> {
        let g = &self.cfg.pattention_groups;
        let mut out = BTreeMap::new();
        for (name, var) in self.params() {
            if !name.starts_with("layers.") {
                continue;
            }
            let grp = if name.contains(".mlp.") {
                g.ffn
            } else if name.contains(".attention.proj.") {
                g.proj
            } else {
                g.qkv
            };
            let t = var.as_tensor();
            let own = if vision {
                t.narrow(0, 0, grp.vision)?
            } else {
                t.narrow(0, grp.vision, grp.language)?
            };
            let rows = if grp.bridge == 0 {
                own
            } else {
                let bridge = t.narrow(0, grp.vision + grp.language, grp.bridge)?;
                Tensor::cat(&[&own, &bridge], 0)?
            };
            out.insert(name.clone(), rows.to_dtype(self.compute_dtype())?);
        }
        Ok(out)
    }

    /// Caption logits [b, t, vocab] of the mixed sequence [image(pixels); ids].
    pub fn forward(&self, pixels: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let l = &self.language;
        if t > l.max_position_embeddings {
            candle_core::bail!(
                "caption of {t} tokens exceeds the model's {} positions",
                l.max_position_embeddings
            )
        }
        let (d, heads) = (l.hidden_size, l.num_heads);
        let hd = d / heads;
        let vroute = self.route(true)?;
        let lroute = self.route(false)?;
        let [vq, vp, vf] = scales(self.vision.pattention_scale_tokens);
        let [lq, lp, lf] = scales(l.pattention_scale_tokens);
        let (vact, lact) = (self.vision.pattention_activation, l.pattention_activation);
        let (params, compute) = (self.weights.cast(), self.compute_dtype());
        let mut img = embed_image(&params, "vision.", &self.vision, pixels, compute)?;
        let n_img = img.dim(1)?;
        let emb = self.p("language.word_embeddings.weight")?;
        let mut txt = emb
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, d))?;
        // Text rows see every image row and the caption up to themselves.
        let mask = Tensor::cat(
            &[
                &Tensor::zeros((t, n_img), compute, ids.device())?,
                &causal_mask(t, compute, ids.device())?,
            ],
            1,
        )?;
        let (cos, sin) = rotary_tables(&self.rotary, t, compute)?;
        let rdims = self.rotary.tables().0;
        let heads_of = |x: Tensor, s: usize| -> candle_core::Result<Tensor> {
            x.reshape((b, s, heads, hd))?.transpose(1, 2)
        };
        for i in 0..l.num_layers {
            let a = format!("layers.{i}.attention");
            // Image rows: the classifier's block over the vision route.
            let hi = layer_norm(&img, self.vision.norm_eps)?;
            let pv = |m: &str, x: &Tensor, s: usize| {
                pattention(&vroute, &format!("{a}.{m}"), x, vact, s)
            };
            let qi = heads_of(pv("query", &hi, vq)?, n_img)?;
            let ki = heads_of(pv("key", &hi, vq)?, n_img)?;
            let vi = heads_of(pv("value", &hi, vq)?, n_img)?.contiguous()?;
            let si = (qi.contiguous()?.matmul(&ki.t()?.contiguous()?)? / (hd as f64).sqrt())?;
            let oi = softmax_last(&si)?
                .matmul(&vi)?
                .transpose(1, 2)?
                .reshape((b, n_img, d))?;
            let new_img = (&img + pv("proj", &oi, vp)?)?;
            let hi = layer_norm(&new_img, self.vision.norm_eps)?;
            let new_img =
                (&new_img + pattention(&vroute, &format!("layers.{i}.mlp"), &hi, vact, vf)?)?;
            // Caption rows: the language route, keys and values [image; caption].
            let ht = layer_norm(&txt, l.norm_eps)?;
            let pl = |m: &str, x: &Tensor, s: usize| {
                pattention(&lroute, &format!("{a}.{m}"), x, lact, s)
            };
            let qt = rotate(&heads_of(pl("query", &ht, lq)?, t)?, rdims, &cos, &sin)?;
            let kt = rotate(&heads_of(pl("key", &ht, lq)?, t)?, rdims, &cos, &sin)?;
            let vt = heads_of(pl("value", &ht, lq)?, t)?;
            let k = Tensor::cat(&[&ki, &kt], 2)?;
            let v = Tensor::cat(&[&vi, &vt], 2)?.contiguous()?;
            let st = (qt.contiguous()?.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?
                .broadcast_add(&mask)?;
            let ot = softmax_last(&st)?
                .matmul(&v)?
                .transpose(1, 2)?
                .reshape((b, t, d))?;
            let new_txt = (&txt + pl("proj", &ot, lp)?)?;
            // A parallel residual's MLP reads LN of the block's input, as its attention.
            let ht = if l.parallel_residual {
                ht
            } else {
                layer_norm(&new_txt, l.norm_eps)?
            };
            txt = (&new_txt + pattention(&lroute, &format!("layers.{i}.mlp"), &ht, lact, lf)?)?;
            img = new_img;
        }
        let h = layer_norm(&txt, l.norm_eps)?
            .broadcast_mul(&self.p("language.final_norm.weight")?)?
            .broadcast_add(&self.p("language.final_norm.bias")?)?;
        let out = if l.tie_word_embeddings {
            emb
        } else {
            self.p("language.final_linear.weight")?
        };
        h.reshape((b * t, d))?
            .matmul(&out.t()?)?
            .reshape((b, t, l.vocab_size))
    }

    /// Mean next-token cross-entropy over the caption tokens: ids [b, t+1], `mask`
    /// [b, t] 1 where position j+1 is a real caption token (0: padding).
    pub fn loss(
        &self,
        pixels: &Tensor,
        ids: &Tensor,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (b, t1) = ids.dims2()?;
        if t1 < 2 {
            candle_core::bail!("a caption needs at least 2 tokens, got {t1}")
        }
        let logits = self.forward(pixels, &ids.narrow(1, 0, t1 - 1)?)?;
        // The log-softmax sums in f32 at least.
        let logits = crate::kernels::widened(&logits)?;
        let v = logits.dim(D::Minus1)?;
        let logp = candle_nn::ops::log_softmax(&logits.reshape((b * (t1 - 1), v))?, D::Minus1)?;
        let targets = ids.narrow(1, 1, t1 - 1)?.flatten_all()?.unsqueeze(1)?;
        let picked = logp.gather(&targets, 1)?.squeeze(1)?;
        let mask = mask.flatten_all()?.to_dtype(logp.dtype())?;
        let count = mask.sum_all()?;
        (picked * &mask)?.sum_all()?.neg()?.broadcast_div(&count)
    }
}

/// One (image, caption) pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    pub image: PathBuf,
    pub text: String,
}

/// The longest JSONL line read.
const MAX_LINE_BYTES: usize = 1 << 20;

/// Reads `{"image", "text"}` lines; image paths are relative to the file's folder.
pub fn read_pairs(path: &Path) -> Result<Vec<Pair>> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| Error::io(path, e))?;
        let at = || format!("{}:{}", path.display(), i + 1);
        if line.len() > MAX_LINE_BYTES {
            return Err(Error::input(format!("{}: line longer than 1 MiB", at())));
        }
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| Error::input(format!("{}: not JSON: {e}", at())))?;
        let (Some(image), Some(text)) = (v["image"].as_str(), v["text"].as_str()) else {
            return Err(Error::input(format!(
                "{}: expected string fields \"image\" and \"text\"",
                at()
            )));
        };
        out.push(Pair {
            image: dir.join(image),
            text: text.to_string(),
        });
    }
    if out.is_empty() {
        return Err(Error::input(format!("{}: no pairs", path.display())));
    }
    Ok(out)
}

/// A batch of pairs: pixels [b, 3, s, s], ids [b, t+1] padded with EOS, loss mask [b, t].
/// Token ids must be below `vocab`.
pub fn batch(
    pairs: &[Pair],
    tokenizer: &tokenizers::Tokenizer,
    (eos, vocab): (u32, usize),
    max_len: usize,
    eval: &EvalTransform,
    device: &Device,
) -> Result<(Tensor, Tensor, Tensor)> {
    let mut images = Vec::with_capacity(pairs.len());
    let mut seqs = Vec::with_capacity(pairs.len());
    for p in pairs {
        images.push(eval.load(&p.image)?);
        let enc = tokenizer.encode(p.text.as_str(), false).map_err(|e| {
            Error::input(format!(
                "tokenising a caption of {}: {e}",
                p.image.display()
            ))
        })?;
        let mut ids = enc.get_ids().to_vec();
        ids.push(eos);
        super::trainer::check_ids(&ids, vocab)
            .map_err(|e| Error::input(format!("a caption of {}: {e}", p.image.display())))?;
        ids.truncate(max_len + 1);
        if ids.len() < 2 {
            return Err(Error::input(format!(
                "{}: the caption is empty",
                p.image.display()
            )));
        }
        seqs.push(ids);
    }
    let t1 = seqs.iter().map(Vec::len).max().unwrap_or(2);
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for s in &seqs {
        ids.extend(s.iter().copied().chain(std::iter::repeat(eos)).take(t1));
        mask.extend((1..t1).map(|j| f32::from(u8::from(j < s.len()))));
    }
    let b = pairs.len();
    Ok((
        eval.batch(images, device)?,
        Tensor::from_vec(ids, (b, t1), device)?,
        Tensor::from_vec(mask, (b, t1 - 1), device)?,
    ))
}

/// Fresh weights for a merged config as the official code initialises them: embeddings,
/// class token, position embeddings, patch embedding, keys, values and heads N(0, 0.02)
/// (each tensor from its own stream of [`crate::init`] for `seed`), biases 0 and norm
/// weights 1. Deterministic for a seed.
pub fn init_tensors(cfg: &Config, seed: u64, device: &Device) -> Result<Tensors> {
    let mut t = Tensors::new();
    for (name, shape) in expected_shapes(cfg) {
        let value = if name.ends_with("bias") {
            Tensor::zeros(shape.as_slice(), DType::F32, device)?
        } else if name.ends_with("norm.weight") {
            Tensor::ones(shape.as_slice(), DType::F32, device)?
        } else {
            crate::init::normal_tensor(shape.as_slice(), 0.02, seed, &name, device)?
        };
        t.insert(name, value);
    }
    Ok(t)
}

impl Trainable for TrainableVl {
    /// Pixels [b, 3, s, s], caption ids [b, t+1], loss mask [b, t].
    type Batch = (Tensor, Tensor, Tensor);

    fn params(&self) -> &BTreeMap<String, Var> {
        &self.weights.params
    }

    fn loss_of(&self, (pixels, ids, mask): &Self::Batch) -> candle_core::Result<Tensor> {
        self.loss(pixels, ids, mask)
    }

    fn config_json(&self) -> String {
        serde_json::to_string_pretty(&self.cfg).expect("serialisable")
    }

    fn bridge_from(&self) -> Option<ScaleTokens> {
        Some(bridge_starts(&self.cfg))
    }
}

/// (image, caption) pairs in a seeded order: eval-preprocessed images, tokenised
/// captions ended with EOS and capped at `max_len` tokens.
pub struct PairSource {
    pairs: Vec<Pair>,
    tokenizer: tokenizers::Tokenizer,
    eos: u32,
    vocab: usize,
    max_len: usize,
    order: Order,
    eval: EvalTransform,
    device: Device,
}

impl PairSource {
    fn batch(&self, pairs: &[Pair]) -> Result<(Tensor, Tensor, Tensor)> {
        batch(
            pairs,
            &self.tokenizer,
            (self.eos, self.vocab),
            self.max_len,
            &self.eval,
            &self.device,
        )
    }
}

impl Source<TrainableVl> for PairSource {
    fn next_batch(&mut self, b: usize) -> Result<((Tensor, Tensor, Tensor), u64)> {
        let picked: Vec<Pair> = (0..b)
            .map(|_| self.pairs[self.order.next().0].clone())
            .collect();
        let (px, ids, mask) = self.batch(&picked)?;
        let tokens = mask.sum_all()?.to_scalar::<f32>()? as u64;
        Ok(((px, ids, mask), tokens))
    }

    fn position(&self) -> u64 {
        self.order.position()
    }
}

/// A merged model being trained on captions.
pub type VlTrainer = Fed<TrainableVl, PairSource>;

impl VlTrainer {
    /// Starts (or, with `resume`, continues) training on `pairs`; `--seq-len` caps a
    /// caption's tokens.
    pub fn new(
        model: TrainableVl,
        pairs: Vec<Pair>,
        tokenizer: tokenizers::Tokenizer,
        opts: TrainOptions,
        resume: Option<(TrainerState, BTreeMap<String, Moments>)>,
    ) -> Result<Self> {
        if pairs.is_empty() {
            return Err(Error::input("no (image, caption) pairs"));
        }
        let position = resume.as_ref().map_or(0, |(s, _)| s.data_position);
        let source = PairSource {
            order: Order::new(pairs.len(), opts.seed, position),
            pairs,
            tokenizer,
            eos: model.config().language.eos_token_id,
            vocab: model.config().language.vocab_size,
            max_len: opts.seq_len,
            eval: EvalTransform::from_config(&model.config().vision),
            device: device_of(model.params()),
        };
        Self::with(model, source, opts, resume)
    }

    /// Mean caption loss over `pairs`, `batch` at a time.
    pub fn evaluate(&self, pairs: &[Pair], batch_size: usize) -> Result<f64> {
        let (mut sum, mut n) = (0.0, 0.0);
        for chunk in pairs.chunks(batch_size.max(1)) {
            let (px, ids, mask) = self.source().batch(chunk)?;
            let count = mask.sum_all()?.to_scalar::<f32>()? as f64;
            let l = self
                .model()
                .loss(&px, &ids, &mask)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            sum += l * count;
            n += count;
        }
        Ok(sum / n.max(1.0))
    }
}
