//! `tokenformer-convert import`: a pre-trained Transformer (Hugging Face
//! GPT-NeoX/Pythia or ViT, safetensors or .bin, with `config.json`) → a
//! TokenFormer of the same width, depth and heads, as the paper's
//! "initialise a TokenFormer from a pre-trained Transformer" suggests
//! (<https://arxiv.org/abs/2410.23168>, Sections 3 and 4).
//!
//! Embeddings, patch embedding, class token, position embedding, final norms
//! and output heads are copied as they are. Every linear layer becomes a
//! Pattention layer by the mapping documented on [`Mapping`]; the MLP uses the
//! key-value-memory reading of Geva et al. 2021 (<https://arxiv.org/abs/2012.14913>):
//! keys = rows of W_in, values = columns of W_out. The tool runs the source
//! model (a plain candle forward, [`reference`]) and the import on a probe
//! input and reports per-layer and end-to-end fidelity. One name map per
//! source format: [`gpt_neox`], [`vit_hf`], [`vit_timm`].

mod gpt_neox;
mod reference;
mod vit_hf;
mod vit_timm;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use clap::{Args, ValueEnum};
use serde::Serialize;
use serde_json::{json, Value};
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::{self, Tensors};
use tokenformer::loader;
use tokenformer::models::tokenformer::{self as lm, Rotary, ScaleTokens, PATTENTIONS};
use tokenformer::pattention::{Activation, Pattention};

use crate::output::{check_not_input, Staging};
use crate::probe;
use reference::{LayerTrace, Mixing};

/// Source architectures `import` understands.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum From {
    /// GPT-NeoX / Pythia causal LMs (transformers layout).
    GptNeox,
    /// ViT image classifiers (transformers `ViTForImageClassification` or timm layout).
    Vit,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// Source architecture.
    #[arg(long, value_enum)]
    pub from: From,
    /// A folder with config.json and model.safetensors / pytorch_model.bin, or a Hub repo id.
    #[arg(long)]
    pub input: String,
    /// The folder to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out.
    #[arg(long)]
    pub force: bool,
    /// Text to measure fidelity on (language models; default: a fixed English paragraph).
    #[arg(long)]
    pub probe_text: Option<String>,
    /// Normalised images to measure fidelity on (classifiers): a .safetensors file with a
    /// tensor `pixels` [n, 3, H, W]; default: seeded synthetic images.
    #[arg(long)]
    pub probe_pixels: Option<PathBuf>,
}

/// A source LayerNorm's affine part.
pub struct Norm {
    pub weight: Tensor,
    pub bias: Tensor,
}

/// A source linear layer, weight [out, in] (torch layout).
pub struct Dense {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

/// One pre-norm Transformer layer of the source, q/k/v already split.
pub struct SourceLayer {
    pub ln1: Norm,
    pub query: Dense,
    pub key: Dense,
    pub value: Dense,
    pub dense: Dense,
    pub ln2: Norm,
    pub fc1: Dense,
    pub fc2: Dense,
}

/// The layer stack shared by every source format.
pub struct SourceBody {
    pub num_heads: usize,
    pub eps: f64,
    pub layers: Vec<SourceLayer>,
}

/// A ViT classifier in the shared source form (filled by [`vit_hf`] or [`vit_timm`]).
pub struct VitSource {
    pub body: SourceBody,
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    pub intermediate_size: usize,
    pub num_classes: usize,
    /// Class-token pooling after the final norm (else mean of patch tokens, then fc_norm).
    pub pool_cls: bool,
    /// Conv weight [d, C, p, p] and bias.
    pub patch_w: Tensor,
    pub patch_b: Tensor,
    pub cls: Tensor,
    pub pos: Tensor,
    pub norm: Norm,
    pub head_w: Tensor,
    pub head_b: Tensor,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub crop_pct: f64,
    pub interpolation: &'static str,
    pub class_names: Option<Vec<String>>,
    /// (source name, TokenFormer name) of every copied tensor.
    pub copied: Vec<(String, String)>,
    pub layout: &'static str,
}

/// The raw tensors of a source checkpoint, taken one by one by a name map so
/// that missing, misshapen and unexpected tensors are all reported by name.
pub struct RawCheckpoint {
    pub dir: PathBuf,
    /// The weight file(s), for messages.
    pub origin: String,
    pub config: Value,
    pub tensors: BTreeMap<String, Tensor>,
}

impl RawCheckpoint {
    /// Reads config.json and every tensor (as f32, a value-exact widening for
    /// f16/bf16 sources) of a folder.
    pub fn read(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join(loader::CONFIG_FILE);
        if !cfg_path.is_file() {
            bail!(
                "{}: missing config.json (the source's hyper-parameters)",
                dir.display()
            );
        }
        let config = loader::read_json(&cfg_path)?;
        let dev = Device::Cpu;
        let st = dir.join(checkpoint::SAFETENSORS_FILE).exists()
            || dir.join(checkpoint::SAFETENSORS_INDEX).exists();
        let (files, tensors) = if st {
            let files = checkpoint::safetensors_files(dir)?;
            let t = checkpoint::read_safetensors(&files, Some(DType::F32), &dev)?;
            (files, t)
        } else {
            let files = bin_files(dir)?;
            let mut out = Tensors::new();
            for f in &files {
                for (n, t) in checkpoint::read_torch_bin(f, Some(DType::F32), &dev)? {
                    if out.insert(n.clone(), t).is_some() {
                        bail!("{}: tensor `{n}` appears in two files", f.display());
                    }
                }
            }
            (files, out)
        };
        if tensors.is_empty() {
            bail!("{}: the checkpoint holds no tensors", dir.display());
        }
        let origin = files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        Ok(Self {
            dir: dir.to_path_buf(),
            origin,
            config,
            tensors,
        })
    }

    /// Removes and returns tensor `name`, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| anyhow!("{}: missing tensor `{name}`", self.origin))?;
        if t.dims() != shape {
            bail!(
                "{}: tensor `{name}` has shape {:?} but config.json implies {:?}",
                self.origin,
                t.dims(),
                shape
            )
        }
        Ok(t)
    }

    /// A LayerNorm's `{prefix}.weight` and `{prefix}.bias`, both [d].
    pub fn take_norm(&mut self, prefix: &str, d: usize) -> Result<Norm> {
        Ok(Norm {
            weight: self.take(&format!("{prefix}.weight"), &[d])?,
            bias: self.take(&format!("{prefix}.bias"), &[d])?,
        })
    }

    /// A linear layer's `{prefix}.weight` [out, inp] and `{prefix}.bias`
    /// [out], which may be absent unless `bias_required`.
    pub fn take_dense(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias_required: bool,
    ) -> Result<Dense> {
        let weight = self.take(&format!("{prefix}.weight"), &[out, inp])?;
        let bias_name = format!("{prefix}.bias");
        let bias = if bias_required || self.tensors.contains_key(&bias_name) {
            Some(self.take(&bias_name, &[out])?)
        } else {
            None
        };
        Ok(Dense { weight, bias })
    }

    /// Fails on tensors no name map took (so nothing is dropped silently);
    /// returns the ignorable buffers that were left.
    pub fn finish(&mut self, is_buffer: impl Fn(&str) -> bool) -> Result<Vec<String>> {
        let left: Vec<String> = std::mem::take(&mut self.tensors).into_keys().collect();
        let (buffers, unknown): (Vec<_>, Vec<_>) = left.into_iter().partition(|n| is_buffer(n));
        if !unknown.is_empty() {
            bail!(
                "{}: {} tensor(s) the {} layout does not have, e.g. `{}`: the checkpoint and config.json disagree or this is another layout",
                self.origin,
                unknown.len(),
                "source",
                unknown[0]
            )
        }
        Ok(buffers)
    }
}

fn bin_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("pytorch_model.bin.index.json");
    if index.exists() {
        let v = loader::read_json(&index)?;
        let mut files: Vec<String> = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| anyhow!("{}: no weight_map", index.display()))?
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        return files
            .iter()
            .map(|f| {
                checkpoint::shard_path(dir, f).map_err(|e| anyhow!("{}: {e}", index.display()))
            })
            .collect();
    }
    let single = dir.join("pytorch_model.bin");
    if single.exists() {
        return Ok(vec![single]);
    }
    bail!(
        "{}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin or its index",
        dir.display()
    )
}

/// A local folder, or a Hub repo id whose files are downloaded first.
fn locate_input(spec: &str) -> Result<PathBuf> {
    let p = Path::new(spec);
    if p.is_dir() {
        return Ok(p.to_path_buf());
    }
    if p.exists() {
        bail!("{spec}: --input must be a folder (config.json and weights), not a file");
    }
    if !spec.contains('/') || spec.starts_with('.') || spec.starts_with('/') {
        bail!("{spec}: no such folder, and not a Hub repo id owner/name");
    }
    use tokenformer::hub;
    let repo = hub::RepoRef::parse(spec).map_err(|e| anyhow!("{e}"))?;
    let list: Vec<String> = hub::list_files(&repo)
        .map_err(|e| anyhow!("{spec}: {e}"))?
        .into_iter()
        .map(|f| f.path)
        .collect();
    let has = |f: &str| list.iter().any(|x| x == f);
    let mut want: Vec<String> = vec![loader::CONFIG_FILE.into()];
    for f in [
        checkpoint::SAFETENSORS_FILE,
        checkpoint::SAFETENSORS_INDEX,
        loader::TOKENIZER_FILE,
        "preprocessor_config.json",
    ] {
        if has(f) {
            want.push(f.into());
        }
    }
    if has(checkpoint::SAFETENSORS_INDEX) {
        want.extend(list.iter().filter(|f| f.ends_with(".safetensors")).cloned());
    } else if !has(checkpoint::SAFETENSORS_FILE) {
        want.extend(
            list.iter()
                .filter(|f| {
                    f.starts_with("pytorch_model") && (f.ends_with(".bin") || f.ends_with(".json"))
                })
                .cloned(),
        );
    }
    want.dedup();
    let names: Vec<&str> = want.iter().map(String::as_str).collect();
    let paths = hub::download_files(&repo, &names, None).map_err(|e| anyhow!("{spec}: {e}"))?;
    Ok(paths[0]
        .parent()
        .expect("a downloaded file is in a folder")
        .to_path_buf())
}

/// How a linear layer or an MLP becomes a Pattention layer.
///
/// Θ(s) = GELU(s/‖s‖·√S) only sees the direction of the scores, so a
/// Pattention is invariant to the scale of its input; it can represent
/// functions of x̂ = x·√d/‖x‖ (for LayerNorm outputs, x̂ = x up to eps). Each
/// imported layer has these token groups (d = input width):
/// - anchors, 2·d tokens, keys ±e_i: they dominate ‖s‖ so that ‖s‖ = √2·‖x‖
///   is known, which makes Θ elementwise: anchor i scores GELU(±κ_A·x̂_i).
///   By GELU(a) − GELU(−a) = a, values ±(c/κ_A)·W_iᵀ give c·x̂·Wᵀ exactly.
/// - bias tokens, 2·d tokens, keys ±(κ_b/κ_A)·e_i with κ_b small: by
///   GELU(a) + GELU(−a) = a·erf(a/√2) ≈ √(2/π)·a², their sum over i is
///   √(2/π)·κ_b²·‖x̂‖² = √(2/π)·κ_b²·d, a constant, so equal values
///   b/(√(2/π)·κ_b²·d) reproduce a bias b (relative error ≈ κ_b²·x̂_i²/6).
/// - MLP only, the memories: keys (1/κ_A)·W_in (with the norm's weight
///   folded in), values W_outᵀ, scored GELU(x̂·W_inᵀ) up to the relative
///   error ‖x̂·W_inᵀ‖²/(4·d·κ_A²) their own share of ‖s‖ causes; anchor values are 0.
///
/// S, the √n constant, is 2·d·κ_A²·(1 + (κ_b/κ_A)²) rounded (config
/// `pattention_scale_tokens`). Not representable: the MLP's pre-activation
/// bias (it would need a constant score, but LayerNorm outputs have zero
/// mean), reported per layer; and the scale of un-normalised inputs (the
/// attention output feeding the output projection): c is fitted per layer by
/// least squares on a calibration input that is not the probe.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Mapping {
    pub width: usize,
    pub kappa_anchor: f64,
    pub kappa_bias: f64,
    pub bias_key_scale: f64,
    pub scale_tokens: usize,
}

/// κ_A: large so that the MLP memories barely perturb ‖s‖.
pub const KAPPA_ANCHOR: f64 = 1000.0;
/// κ_b: small so that GELU(a) + GELU(−a) is quadratic, not so small that f32 loses it.
pub const KAPPA_BIAS: f64 = 5e-3;

impl Mapping {
    pub fn new(width: usize) -> Self {
        let lambda = KAPPA_BIAS / KAPPA_ANCHOR;
        let s = (2.0 * width as f64 * KAPPA_ANCHOR * KAPPA_ANCHOR * (1.0 + lambda * lambda)).round()
            as usize;
        let kappa_anchor = (s as f64 / (2.0 * width as f64 * (1.0 + lambda * lambda))).sqrt();
        Self {
            width,
            kappa_anchor,
            kappa_bias: lambda * kappa_anchor,
            bias_key_scale: lambda,
            scale_tokens: s,
        }
    }

    /// Anchor and bias keys [4d, d]: [I; −I; λI; −λI].
    fn fixed_keys(&self, dev: &Device) -> Result<Tensor> {
        let eye = Tensor::eye(self.width, DType::F32, dev)?;
        let small = (&eye * self.bias_key_scale)?;
        Ok(Tensor::cat(&[&eye, &eye.neg()?, &small, &small.neg()?], 0)?)
    }

    /// Values of the 2d bias tokens reproducing bias b [out].
    fn bias_values(&self, bias: Option<&Tensor>, out: usize, dev: &Device) -> Result<Tensor> {
        let rows = 2 * self.width;
        match bias {
            None => Ok(Tensor::zeros((rows, out), DType::F32, dev)?),
            Some(b) => {
                let per = (2.0 / std::f64::consts::PI).sqrt()
                    * self.kappa_bias
                    * self.kappa_bias
                    * self.width as f64;
                Ok((b / per)?
                    .unsqueeze(0)?
                    .broadcast_as((rows, out))?
                    .contiguous()?)
            }
        }
    }

    /// y = c·x̂·Wᵀ + b as (keys [4d, d], values [4d, out]); w [out, d].
    pub fn linear(&self, w: &Tensor, bias: Option<&Tensor>, c: f64) -> Result<(Tensor, Tensor)> {
        let dev = w.device();
        let out = w.dim(0)?;
        let wt = (w.t()?.contiguous()? * (c / self.kappa_anchor))?;
        let values = Tensor::cat(&[&wt, &wt.neg()?, &self.bias_values(bias, out, dev)?], 0)?;
        Ok((self.fixed_keys(dev)?, values))
    }

    /// y = GELU(x̂·W_inᵀ)·W_outᵀ + b as (keys [m+4d, d], values [m+4d, out]).
    pub fn mlp(
        &self,
        w_in: &Tensor,
        w_out: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let dev = w_in.device();
        let out = w_out.dim(0)?;
        let mem_keys = (w_in / self.kappa_anchor)?;
        let keys = Tensor::cat(&[&mem_keys, &self.fixed_keys(dev)?], 0)?;
        let zeros = Tensor::zeros((2 * self.width, out), DType::F32, dev)?;
        let values = Tensor::cat(
            &[
                &w_out.t()?.contiguous()?,
                &zeros,
                &self.bias_values(bias, out, dev)?,
            ],
            0,
        )?;
        Ok((keys, values))
    }

    pub fn pattention(&self, kv: &(Tensor, Tensor)) -> candle_core::Result<Pattention> {
        Pattention::from_tensors(
            kv.0.clone(),
            kv.1.clone(),
            Activation::L2NormGelu,
            Some(self.scale_tokens),
        )
    }
}

/// W·diag(g) and W·b + bias: a LayerNorm's affine part folded into the linear after it.
fn fold_norm(l: &Dense, n: &Norm) -> Result<(Tensor, Tensor)> {
    let w = l.weight.broadcast_mul(&n.weight.unsqueeze(0)?)?;
    let mut b = l.weight.matmul(&n.bias.unsqueeze(1)?)?.squeeze(1)?;
    if let Some(lb) = &l.bias {
        b = (b + lb)?;
    }
    Ok((w, b))
}

/// ‖a − b‖ / ‖b‖ over all elements, in f64.
pub fn relative_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.flatten_all()?.to_dtype(DType::F64)?;
    let b = b.flatten_all()?.to_dtype(DType::F64)?;
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let den = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if den == 0.0 { num } else { num / den })
}

/// The least-squares c for c·x̂·Wᵀ ≈ x·Wᵀ over the rows of x [rows, d].
fn fit_input_scale(x: &Tensor, w: &Tensor) -> Result<f64> {
    let d = x.dim(D::Minus1)? as f64;
    let norm = x
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(1e-30, f64::INFINITY)?;
    let xhat = (x.broadcast_div(&norm)? * d.sqrt())?;
    let y = x.matmul(&w.t()?)?.to_dtype(DType::F64)?;
    let yh = xhat.matmul(&w.t()?)?.to_dtype(DType::F64)?;
    let num = (&y * &yh)?.sum_all()?.to_scalar::<f64>()?;
    let den = yh.sqr()?.sum_all()?.to_scalar::<f64>()?;
    Ok(if den > 0.0 { num / den } else { 1.0 })
}

/// Per-layer fidelity of the new Pattention layers on the source's activations.
#[derive(Clone, Debug, Serialize)]
pub struct LayerFidelity {
    pub layer: usize,
    pub query: f64,
    pub key: f64,
    pub value: f64,
    pub proj: f64,
    pub mlp: f64,
    /// The fitted c of the output projection (its input is not normalised).
    pub proj_input_scale: f64,
    /// ‖pre-activation bias‖₂ of the MLP (incl. the folded norm bias): not representable, dropped.
    pub dropped_mlp_bias_norm: f64,
}

/// The Pattention tensors of one layer, under their canonical names.
struct LayerImport {
    tensors: Vec<(String, Tensor)>,
    fidelity: LayerFidelity,
}

fn import_layer(
    i: usize,
    l: &SourceLayer,
    map: &Mapping,
    calib: &LayerTrace,
    probe: &LayerTrace,
) -> Result<LayerImport> {
    let (wq, bq) = fold_norm(&l.query, &l.ln1)?;
    let (wk, bk) = fold_norm(&l.key, &l.ln1)?;
    let (wv, bv) = fold_norm(&l.value, &l.ln1)?;
    let (w1, b1) = fold_norm(&l.fc1, &l.ln2)?;
    let c = fit_input_scale(&calib.proj_in, &l.dense.weight)?;
    let q = map.linear(&wq, Some(&bq), 1.0)?;
    let k = map.linear(&wk, Some(&bk), 1.0)?;
    let v = map.linear(&wv, Some(&bv), 1.0)?;
    let o = map.linear(&l.dense.weight, l.dense.bias.as_ref(), c)?;
    let f = map.mlp(&w1, &l.fc2.weight, l.fc2.bias.as_ref())?;
    let err = |kv: &(Tensor, Tensor), x: &Tensor, y: &Tensor| -> Result<f64> {
        relative_error(&map.pattention(kv)?.forward(x)?, y)
    };
    let fidelity = LayerFidelity {
        layer: i,
        query: err(&q, &probe.attn_in, &probe.query)?,
        key: err(&k, &probe.attn_in, &probe.key)?,
        value: err(&v, &probe.attn_in, &probe.value)?,
        proj: err(&o, &probe.proj_in, &probe.proj_out)?,
        mlp: err(&f, &probe.mlp_in, &probe.mlp_out)?,
        proj_input_scale: c,
        dropped_mlp_bias_norm: b1.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt() as f64,
    };
    let p = format!("layers.{i}");
    let mut tensors = vec![];
    for (name, kv) in PATTENTIONS.into_iter().zip([q, k, v, o, f]) {
        tensors.push((format!("{p}.{name}.key_param_tokens"), kv.0));
        tensors.push((format!("{p}.{name}.value_param_tokens"), kv.1));
    }
    Ok(LayerImport { tensors, fidelity })
}

const DEFAULT_PROBE_TEXT: &str = "The museum opened its new wing on a rainy Tuesday morning. Visitors queued outside \
for an hour to see the collection of maps, letters and instruments that sailors had carried across the Atlantic \
two centuries ago, and the curator explained how each object had been found.";
const CALIBRATION_TEXT: &str = "In mathematics, a prime number is a natural number greater than one that is not \
a product of two smaller natural numbers. Farmers in the valley grow wheat, barley and grapes, and sell them at the \
market every Saturday.";

/// End-to-end comparison on the probe.
#[derive(Clone, Debug, Serialize)]
pub struct EndToEnd {
    /// Perplexity (text) of the source on the probe.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_perplexity: Option<f64>,
    /// The source with its parallel residual run sequentially (what a TokenFormer block can express).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_sequential_perplexity: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub import_perplexity: Option<f64>,
    /// Share of probe images where the import's top-1 class is the source's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top1_agreement: Option<f64>,
    /// ‖logits_import − logits_source‖ / ‖logits_source‖ on the probe.
    pub logits_relative_error: f64,
}

/// `import_report.json`: everything the tool measured, for scripts and tests.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub source: String,
    pub from: String,
    pub mapping: Mapping,
    /// Token ids of the text probe (or the number of probe images).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_images: Option<usize>,
    pub parallel_residual_made_sequential: bool,
    pub layers: Vec<LayerFidelity>,
    pub end_to_end: EndToEnd,
    /// Source tensors copied unchanged: (source name, TokenFormer name).
    pub copied: Vec<(String, String)>,
    /// Source buffers that are not weights (ignored).
    pub ignored_buffers: Vec<String>,
    /// What has no home in a TokenFormer and how it was handled.
    pub not_representable: Vec<String>,
}

pub const REPORT_FILE: &str = "import_report.json";

pub fn run(a: ImportArgs) -> Result<()> {
    let dir = locate_input(&a.input)?;
    check_not_input(&a.out, &dir)?;
    let mut raw = RawCheckpoint::read(&dir)?;
    match a.from {
        From::GptNeox => import_gpt_neox(&a, &mut raw),
        From::Vit => import_vit(&a, &mut raw),
    }
}

/// Token ids of `text` with the tokenizer.json at `path`, if it loads.
fn tokenize(path: &Path, text: &str) -> Option<Vec<u32>> {
    if !path.exists() {
        return None;
    }
    let files = loader::ModelFiles {
        source: path.display().to_string(),
        config: loader::ConfigSource::Json {
            path: None,
            value: Value::Null,
        },
        weights: loader::Weights::Safetensors(vec![]),
        tokenizer: Some(path.to_path_buf()),
    };
    let t = loader::load_tokenizer(&files).ok()?;
    let ids = t.encode(text, false).ok()?.get_ids().to_vec();
    (ids.len() >= 2).then_some(ids)
}

fn perplexity(logits: &Tensor, ids: &[u32]) -> Result<f64> {
    let n = ids.len() - 1;
    let logits = logits.narrow(0, 0, n)?;
    let lse = tokenformer::scoring::logsumexp(&logits)?;
    let targets = Tensor::new(&ids[1..], logits.device())?.unsqueeze(1)?;
    let picked = logits.gather(&targets, 1)?.squeeze(1)?;
    let nll: f64 = (lse - picked)?
        .to_vec1::<f32>()?
        .iter()
        .map(|&x| x as f64)
        .sum();
    Ok((nll / n as f64).exp())
}

fn import_gpt_neox(a: &ImportArgs, raw: &mut RawCheckpoint) -> Result<()> {
    let src = gpt_neox::read(raw)?;
    let buffers = raw.finish(gpt_neox::is_buffer)?;
    let cfg = &src.cfg;
    let d = cfg.hidden_size;
    let dev = Device::Cpu;
    let map = Mapping::new(d);

    // Probe and calibration inputs: real text when the source has a tokenizer.
    let tok_path = raw.dir.join(loader::TOKENIZER_FILE);
    let max = cfg.max_position_embeddings;
    let clip = |mut v: Vec<u32>| {
        v.truncate(max);
        v
    };
    let probe_ids = clip(
        tokenize(
            &tok_path,
            a.probe_text.as_deref().unwrap_or(DEFAULT_PROBE_TEXT),
        )
        .unwrap_or_else(|| probe::probe_ids(cfg.vocab_size, max)),
    );
    if probe_ids.len() < 2 {
        bail!("the probe text must have at least 2 tokens");
    }
    let calib_ids = clip(
        tokenize(&tok_path, CALIBRATION_TEXT)
            .unwrap_or_else(|| seeded_ids(cfg.vocab_size, 32.min(max), 17)),
    );
    if let Some(&bad) = probe_ids
        .iter()
        .chain(&calib_ids)
        .find(|&&i| i as usize >= cfg.vocab_size)
    {
        bail!(
            "token id {bad} of the probe is outside the source's vocabulary ({})",
            cfg.vocab_size
        );
    }

    // The source on both inputs.
    let rotary_dims = ((d / cfg.num_heads) as f64 * cfg.rotary_pct) as usize;
    if !rotary_dims.is_multiple_of(2) {
        bail!(
            "{}: rotary_pct {} gives an odd number of rotary dims ({rotary_dims})",
            raw.origin,
            cfg.rotary_pct
        );
    }
    let rotary = Rotary::new(rotary_dims, cfg.rotary_base, max, &dev)?;
    let embed = |ids: &[u32]| -> Result<Tensor> {
        Ok(src
            .embed_in
            .index_select(&Tensor::new(ids, &dev)?, 0)?
            .unsqueeze(0)?)
    };
    let source_logits = |h: &Tensor| -> Result<Tensor> {
        let h = reference::layer_norm(h, &src.final_norm, cfg.eps)?.squeeze(0)?;
        Ok(h.matmul(&src.embed_out.as_ref().unwrap_or(&src.embed_in).t()?)?)
    };
    let mix = Mixing::Causal(&rotary);
    let (_, calib) =
        reference::run_layers(&src.body, &embed(&calib_ids)?, &mix, cfg.parallel_residual)?;
    let (h, probe_trace) =
        reference::run_layers(&src.body, &embed(&probe_ids)?, &mix, cfg.parallel_residual)?;
    let src_logits = source_logits(&h)?;
    let src_ppl = perplexity(&src_logits, &probe_ids)?;
    let seq_ppl = if cfg.parallel_residual {
        let (h, _) = reference::run_layers(&src.body, &embed(&probe_ids)?, &mix, false)?;
        Some(perplexity(&source_logits(&h)?, &probe_ids)?)
    } else {
        None
    };

    // The TokenFormer tensors.
    let mut tensors = Tensors::new();
    let mut copied = vec![];
    let mut copy = |from: &str, to: &str, t: &Tensor| {
        tensors.insert(to.to_string(), t.clone());
        copied.push((from.to_string(), to.to_string()));
    };
    copy(
        "gpt_neox.embed_in.weight",
        "word_embeddings.weight",
        &src.embed_in,
    );
    copy(
        "gpt_neox.final_layer_norm.weight",
        "final_norm.weight",
        &src.final_norm.weight,
    );
    copy(
        "gpt_neox.final_layer_norm.bias",
        "final_norm.bias",
        &src.final_norm.bias,
    );
    if let Some(e) = &src.embed_out {
        copy("embed_out.weight", "final_linear.weight", e);
    }
    let mut layers = vec![];
    for (i, l) in src.body.layers.iter().enumerate() {
        let li = import_layer(i, l, &map, &calib[i], &probe_trace[i])?;
        tensors.extend(li.tensors);
        layers.push(li.fidelity);
    }
    let m = cfg.intermediate_size;
    let config = lm::Config {
        hidden_size: d,
        num_layers: cfg.num_layers,
        num_heads: cfg.num_heads,
        qkv_tokens: 4 * d,
        proj_tokens: 4 * d,
        ffn_tokens: m + 4 * d,
        vocab_size: cfg.vocab_size,
        max_position_embeddings: max,
        rotary_pct: cfg.rotary_pct,
        rotary_base: cfg.rotary_base,
        norm_eps: cfg.eps,
        pattention_activation: Activation::L2NormGelu,
        eos_token_id: cfg.eos_token_id,
        tie_word_embeddings: src.embed_out.is_none(),
        pattention_scale_tokens: Some(ScaleTokens {
            qkv: map.scale_tokens,
            proj: map.scale_tokens,
            ffn: map.scale_tokens,
        }),
    };
    config
        .validate()
        .map_err(|e| anyhow!("the imported config is invalid: {e}"))?;

    let staging = Staging::new(&a.out, a.force)?;
    let out = staging.path();
    std::fs::write(
        out.join(loader::CONFIG_FILE),
        serde_json::to_string_pretty(&config)? + "\n",
    )?;
    checkpoint::write_safetensors(out, &tensors, checkpoint::DEFAULT_SHARD_BYTES)?;
    if tok_path.exists() {
        std::fs::copy(&tok_path, out.join(loader::TOKENIZER_FILE))
            .with_context(|| format!("copying {}", tok_path.display()))?;
    }

    // The written folder, loaded as any user would, on the same probe.
    let model = loader::load_lm(
        &loader::locate(&out.display().to_string(), &Default::default())?,
        &dev,
    )?;
    let imp_logits = model
        .forward(
            &Tensor::new(probe_ids.as_slice(), &dev)?.unsqueeze(0)?,
            None,
        )?
        .squeeze(0)?;
    let imp_ppl = perplexity(&imp_logits, &probe_ids)?;
    let end = EndToEnd {
        source_perplexity: Some(src_ppl),
        source_sequential_perplexity: seq_ppl,
        import_perplexity: Some(imp_ppl),
        top1_agreement: None,
        logits_relative_error: relative_error(&imp_logits, &src_logits)?,
    };
    let mut not_rep = vec![
        "MLP pre-activation biases (dense_h_to_4h.bias + W·post_attention_layernorm.bias): no constant score exists for LayerNorm outputs; dropped, norms per layer in `dropped_mlp_bias_norm`".to_string(),
        "input/post-attention LayerNorm weights and biases: folded into the following Pattention keys and bias tokens (exact)".to_string(),
        "attention.dense input scale: a Pattention is scale-invariant in its input; a per-layer constant is fitted on a calibration text (`proj_input_scale`)".to_string(),
    ];
    if cfg.parallel_residual {
        not_rep.push("use_parallel_residual: true — a TokenFormer block is sequential (x + attn, then + mlp); the MLP now sees the attention output. Compare source_perplexity with source_sequential_perplexity".into());
    }
    let report = Report {
        source: a.input.clone(),
        from: "gpt-neox".into(),
        mapping: map,
        probe_ids: Some(probe_ids.clone()),
        calibration_ids: Some(calib_ids),
        probe_images: None,
        parallel_residual_made_sequential: cfg.parallel_residual,
        layers,
        end_to_end: end,
        copied,
        ignored_buffers: buffers,
        not_representable: not_rep,
    };
    print_report(&report);
    std::fs::write(
        out.join(REPORT_FILE),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;

    let mut card = ModelCard::new(
        format!(
            "TokenFormer LM imported from GPT-NeoX ({} layers, d {})",
            cfg.num_layers, d
        ),
        "text-generation",
    );
    if !Path::new(&a.input).exists() {
        card.set("base_model", json!(a.input));
    }
    card.section(
        "Model",
        format!(
            "A TokenFormer language model initialised from the GPT-NeoX checkpoint `{}` by `tokenformer-convert import --from gpt-neox` (paper: https://arxiv.org/abs/2410.23168). Pattention tokens: {} qkv / {} proj / {} ffn, √n constant {}. Embeddings, final norm and the untied output matrix are copied unchanged.",
            a.input, config.qkv_tokens, config.proj_tokens, config.ffn_tokens, map.scale_tokens
        ),
    );
    card.section("Mapping", mapping_text(&map));
    card.section("Fidelity", fidelity_markdown(&report));
    finish(card, &report, staging)
}

fn import_vit(a: &ImportArgs, raw: &mut RawCheckpoint) -> Result<()> {
    let src = if raw.tensors.contains_key("vit.embeddings.cls_token") {
        vit_hf::read(raw)?
    } else if raw.tensors.contains_key("cls_token") {
        vit_timm::read(raw)?
    } else {
        let example = raw.tensors.keys().next().cloned().unwrap_or_default();
        bail!(
            "{}: unknown ViT layout: neither `vit.embeddings.cls_token` (transformers) nor `cls_token` (timm) is present (found e.g. `{example}`)",
            raw.origin
        )
    };
    let buffers = raw.finish(vit_hf::is_unused)?;
    let d = src.cls.dim(2)?;
    let dev = Device::Cpu;
    let map = Mapping::new(d);
    let (c, size) = (src.num_channels, src.image_size);
    let probe_pixels = match &a.probe_pixels {
        Some(p) => {
            let mut t = candle_core::safetensors::load(p, &dev)
                .with_context(|| format!("reading {}", p.display()))?;
            let px = t
                .remove("pixels")
                .ok_or_else(|| anyhow!("{}: no tensor `pixels`", p.display()))?
                .to_dtype(DType::F32)?;
            if px.rank() != 4 || px.dims()[1..] != [c, size, size] {
                bail!(
                    "{}: `pixels` has shape {:?}, expected [n, {c}, {size}, {size}]",
                    p.display(),
                    px.dims()
                );
            }
            px
        }
        None => synthetic_pixels(8, c, size, 0xC0FFEE, &dev)?,
    };
    let calib_pixels = synthetic_pixels(4, c, size, 0xBEEF, &dev)?;
    let (_, calib) = reference::vit_forward(&src, &calib_pixels)?;
    let (src_logits, probe_trace) = reference::vit_forward(&src, &probe_pixels)?;

    let mut tensors = Tensors::new();
    let named = |to: &str| -> Result<Tensor> {
        Ok(match to {
            "cls_token" => src.cls.clone(),
            "pos_embed" => src.pos.clone(),
            "patch_embed.weight" => src.patch_w.clone(),
            "patch_embed.bias" => src.patch_b.clone(),
            "head.weight" => src.head_w.clone(),
            "head.bias" => src.head_b.clone(),
            n if n.ends_with("norm.weight") => src.norm.weight.clone(),
            n if n.ends_with("norm.bias") => src.norm.bias.clone(),
            other => bail!("internal: no copy rule for `{other}`"),
        })
    };
    for (_, to) in &src.copied {
        tensors.insert(to.clone(), named(to)?);
    }
    let mut layers = vec![];
    for (i, l) in src.body.layers.iter().enumerate() {
        let li = import_layer(i, l, &map, &calib[i], &probe_trace[i])?;
        tensors.extend(li.tensors);
        layers.push(li.fidelity);
    }
    let mut config = json!({
        "architecture": "tokenformer-vit",
        "image_size": size,
        "patch_size": src.patch_size,
        "num_channels": c,
        "hidden_size": d,
        "num_layers": src.body.layers.len(),
        "num_heads": src.body.num_heads,
        "qkv_tokens": 4 * d,
        "proj_tokens": 4 * d,
        "ffn_tokens": src.intermediate_size + 4 * d,
        "num_classes": src.num_classes,
        "pool": if src.pool_cls { "cls" } else { "mean" },
        "norm_eps": src.body.eps,
        "pattention_activation": "l2_norm_gelu",
        "pattention_scale_tokens": {"qkv": map.scale_tokens, "proj": map.scale_tokens, "ffn": map.scale_tokens},
        "crop_pct": src.crop_pct,
        "interpolation": src.interpolation,
        "mean": src.mean,
        "std": src.std,
    });
    if let Some(n) = &src.class_names {
        config["class_names"] = json!(n);
    }
    // Validate with the library before anything is written.
    let vcfg = loader::vit_config(&config, &raw.dir.join(loader::CONFIG_FILE))?;

    let staging = Staging::new(&a.out, a.force)?;
    let out = staging.path();
    std::fs::write(
        out.join(loader::CONFIG_FILE),
        serde_json::to_string_pretty(&config)? + "\n",
    )?;
    checkpoint::write_safetensors(out, &tensors, checkpoint::DEFAULT_SHARD_BYTES)?;
    let model = loader::load_vit(
        &loader::locate(&out.display().to_string(), &Default::default())?,
        &dev,
    )?;
    let imp_logits = model.forward(&probe_pixels)?;
    let agree = {
        let s = src_logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let i = imp_logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        s.iter().zip(&i).filter(|(a, b)| a == b).count() as f64 / s.len() as f64
    };
    let end = EndToEnd {
        source_perplexity: None,
        source_sequential_perplexity: None,
        import_perplexity: None,
        top1_agreement: Some(agree),
        logits_relative_error: relative_error(&imp_logits, &src_logits)?,
    };
    let report = Report {
        source: a.input.clone(),
        from: format!("vit ({})", src.layout),
        mapping: map,
        probe_ids: None,
        calibration_ids: None,
        probe_images: Some(probe_pixels.dim(0)?),
        parallel_residual_made_sequential: false,
        layers,
        end_to_end: end,
        copied: src.copied.clone(),
        ignored_buffers: buffers,
        not_representable: vec![
            "MLP pre-activation biases (fc1 bias + W·norm2 bias): no constant score exists for LayerNorm outputs; dropped, norms per layer in `dropped_mlp_bias_norm`".into(),
            "norm1/norm2 weights and biases: folded into the following Pattention keys and bias tokens (exact)".into(),
            "attention output projection input scale: a Pattention is scale-invariant in its input; a per-layer constant is fitted on calibration images (`proj_input_scale`)".into(),
        ],
    };
    print_report(&report);
    std::fs::write(
        out.join(REPORT_FILE),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    let mut card = ModelCard::new(
        format!(
            "TokenFormer-ViT imported from {} ({} layers, d {})",
            src.layout, vcfg.num_layers, d
        ),
        "image-classification",
    );
    if !Path::new(&a.input).exists() {
        card.set("base_model", json!(a.input));
    }
    card.section(
        "Model",
        format!(
            "A TokenFormer image classifier initialised from the {} checkpoint `{}` by `tokenformer-convert import --from vit` (paper: https://arxiv.org/abs/2410.23168). Pattention tokens: {} qkv / {} proj / {} ffn, √n constant {}. Patch embedding, class token, position embedding, final norm and head are copied unchanged.",
            src.layout, a.input, 4 * d, 4 * d, src.intermediate_size + 4 * d, map.scale_tokens
        ),
    );
    card.section("Mapping", mapping_text(&map));
    card.section("Fidelity", fidelity_markdown(&report) + if a.probe_pixels.is_none() { " The probe images are seeded synthetic patterns, not photographs: pass --probe-pixels for a real-image probe." } else { "" });
    finish(card, &report, staging)
}

/// Seeded smooth images in normalised units: a few random plane waves per
/// channel plus noise, so that patches differ the way photographs' do.
fn synthetic_pixels(n: usize, c: usize, size: usize, seed: u64, dev: &Device) -> Result<Tensor> {
    let mut x = seed | 1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 / (1u64 << 53) as f64) as f32
    };
    let mut v = Vec::with_capacity(n * c * size * size);
    for _ in 0..n * c {
        let waves: Vec<[f32; 4]> = (0..3)
            .map(|_| [rnd() * 0.5, rnd() * 0.5, rnd() * 6.3, rnd() * 1.5])
            .collect();
        for i in 0..size {
            for j in 0..size {
                let mut p = 0.0;
                for w in &waves {
                    p += w[3] * (w[0] * i as f32 + w[1] * j as f32 + w[2]).sin();
                }
                v.push(p + 0.3 * (rnd() - 0.5));
            }
        }
    }
    Ok(Tensor::from_vec(v, (n, c, size, size), dev)?)
}

fn seeded_ids(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

fn mapping_text(m: &Mapping) -> String {
    format!(
        "Every linear layer y = x·Wᵀ + b (LayerNorm affine folded in) becomes 4·d parameter tokens: 2·d anchors with keys ±e_i and values ±(c/κ_A)·Wᵀ, exact by GELU(a) − GELU(−a) = a once the anchors fix ‖s‖; and 2·d bias tokens with keys ±(κ_b/κ_A)·e_i whose GELU(a)+GELU(−a) ≈ √(2/π)a² sums to a constant, values b/(√(2/π)·κ_b²·d). The MLP keeps its hidden units as key-value memories (keys W_in/κ_A, values W_outᵀ; Geva et al. 2021) plus the same 4·d anchor/bias tokens. κ_A = {:.3}, κ_b = {:.2e}, √n constant S = {} for d = {}.",
        m.kappa_anchor, m.kappa_bias, m.scale_tokens, m.width
    )
}

fn fidelity_markdown(r: &Report) -> String {
    let mut s = String::from("Relative error ‖P(x) − f(x)‖/‖f(x)‖ of each new Pattention against the source layer, on the source's own activations of the probe:\n\n| layer | query | key | value | proj | mlp | proj c | dropped ‖b_in‖ |\n|---|---|---|---|---|---|---|---|\n");
    for l in &r.layers {
        s.push_str(&format!(
            "| {} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.2e} | {:.4} | {:.3} |\n",
            l.layer,
            l.query,
            l.key,
            l.value,
            l.proj,
            l.mlp,
            l.proj_input_scale,
            l.dropped_mlp_bias_norm
        ));
    }
    let e = &r.end_to_end;
    s.push('\n');
    if let Some(p) = e.source_perplexity {
        s.push_str(&format!(
            "End to end on the probe: source perplexity {p:.4}"
        ));
        if let Some(q) = e.source_sequential_perplexity {
            s.push_str(&format!(", source run sequentially {q:.4}"));
        }
        if let Some(q) = e.import_perplexity {
            s.push_str(&format!(", import {q:.4}"));
        }
        s.push_str(". ");
    }
    if let Some(t) = e.top1_agreement {
        s.push_str(&format!(
            "End to end on {} probe images: top-1 agreement {:.1}%. ",
            r.probe_images.unwrap_or(0),
            100.0 * t
        ));
    }
    s.push_str(&format!(
        "Relative logit error {:.3e}.",
        e.logits_relative_error
    ));
    s
}

fn print_report(r: &Report) {
    println!(
        "per-layer relative error of each Pattention against the source layer (probe activations):"
    );
    println!(
        "{:>5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>14}",
        "layer", "query", "key", "value", "proj", "mlp", "proj c", "dropped |b_in|"
    );
    for l in &r.layers {
        println!(
            "{:>5} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e} {:>9.4} {:>14.4}",
            l.layer,
            l.query,
            l.key,
            l.value,
            l.proj,
            l.mlp,
            l.proj_input_scale,
            l.dropped_mlp_bias_norm
        );
    }
    let e = &r.end_to_end;
    if let (Some(s), Some(i)) = (e.source_perplexity, e.import_perplexity) {
        match e.source_sequential_perplexity {
            Some(q) => println!(
                "perplexity on the probe: source {s:.4} (run sequentially {q:.4}), import {i:.4}"
            ),
            None => println!("perplexity on the probe: source {s:.4}, import {i:.4}"),
        }
    }
    if let Some(t) = e.top1_agreement {
        println!(
            "top-1 agreement on {} probe images: {:.1}%",
            r.probe_images.unwrap_or(0),
            100.0 * t
        );
    }
    println!("relative logit error: {:.3e}", e.logits_relative_error);
    for n in &r.not_representable {
        println!("note: {n}");
    }
}

/// What both imports end with: the unrepresentable parts listed in the card,
/// the card written, and the staged folder moved into place.
fn finish(mut card: ModelCard, report: &Report, staging: Staging) -> Result<()> {
    let items: Vec<String> = report
        .not_representable
        .iter()
        .map(|s| format!("- {s}"))
        .collect();
    card.section("Not representable", items.join("\n"));
    card.write(staging.path())?;
    let out = staging.commit()?;
    println!("wrote {}", out.display());
    Ok(())
}
