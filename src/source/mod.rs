//! Pre-trained Transformers as TokenFormers are made from and distilled towards
//! (`tokenformer-convert import`, `tokenformer train --distill-from`): the source
//! checkpoint found locally or on the Hub, read tensor by tensor by a name map
//! (missing, misshapen and unexpected tensors all reported by name), held in one
//! form shared by every source format, and run forward with plain candle ops so a
//! TokenFormer is measured and trained against the model it came from without
//! PyTorch: pre-norm blocks with affine LayerNorms and biased linear layers, as in
//! the transformers modeling files `modeling_gpt_neox.py` (optionally with the
//! parallel residual) and `modeling_vit.py` / timm's `vision_transformer.py`.
//! Every layer records its activations (the inputs and outputs of each linear),
//! which the importer's per-layer fidelity check replays through the new
//! Pattention layers. One reader per family ([`gpt_neox`], [`vit`]); the data
//! both commands calibrate and measure on ([`data`]); the distillation recipe
//! ([`recover`]).

/// Returns an input error: the readers' messages name the file and tensor themselves.
macro_rules! bail {
    ($($t:tt)*) => {
        return Err($crate::error::Error::input(format!($($t)*)))
    };
}

/// An input error of a formatted message.
macro_rules! input_error {
    ($($t:tt)*) => {
        $crate::error::Error::input(format!($($t)*))
    };
}

pub mod data;
pub mod gpt_neox;
pub mod recover;
pub mod vit;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::checkpoint::{self, Tensors};
use crate::error::Result;
use crate::hub::DownloadProgress;
use crate::loader;
use crate::models::tokenformer::Rotary;
use candle_core::{DType, Device, Tensor, D};
use serde_json::Value;

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
            .ok_or_else(|| input_error!("{}: missing tensor `{name}`", self.origin))?;
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

    /// A LayerNorm's `{prefix}.weight` and `{prefix}.bias`, both \[d\].
    pub fn take_norm(&mut self, prefix: &str, d: usize) -> Result<Norm> {
        Ok(Norm {
            weight: self.take(&format!("{prefix}.weight"), &[d])?,
            bias: self.take(&format!("{prefix}.bias"), &[d])?,
        })
    }

    /// A linear layer's `{prefix}.weight` [out, inp] and `{prefix}.bias`
    /// \[out\], which may be absent unless `bias_required`.
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
            .ok_or_else(|| input_error!("{}: no weight_map", index.display()))?
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        return files
            .iter()
            .map(|f| {
                checkpoint::shard_path(dir, f).map_err(|e| input_error!("{}: {e}", index.display()))
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

/// A local folder, or a Hub repo id whose files are downloaded first (`progress`
/// told of the downloads). `flag` names the option in messages.
pub fn locate_input(
    spec: &str,
    flag: &str,
    progress: Option<&DownloadProgress>,
) -> Result<PathBuf> {
    let p = Path::new(spec);
    if p.is_dir() {
        return Ok(p.to_path_buf());
    }
    if p.exists() {
        bail!("{flag} {spec}: must be a folder (config.json and weights), not a file");
    }
    if !spec.contains('/') || spec.starts_with('.') || spec.starts_with('/') {
        bail!("{flag} {spec}: no such folder, and not a Hub repo id owner/name");
    }
    use crate::hub;
    let repo = hub::RepoRef::parse(spec).map_err(|e| input_error!("{flag} {e}"))?;
    let list: Vec<String> = hub::list_files(&repo)
        .map_err(|e| input_error!("{flag} {spec}: {e}"))?
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
    let paths = hub::download_files(&repo, &names, progress)
        .map_err(|e| input_error!("{flag} {spec}: {e}"))?;
    paths
        .first()
        .and_then(|p| p.parent())
        .map(Path::to_path_buf)
        .ok_or_else(|| input_error!("{flag} {spec}: the download returned no file"))
}

/// A positive integer `key` of a source config.json, or `default` when it is absent.
pub fn usize_key(c: &Value, key: &str, origin: &str, default: Option<usize>) -> Result<usize> {
    match (c.get(key).and_then(Value::as_u64), default) {
        (Some(v), _) if v > 0 => Ok(v as usize),
        (None, Some(d)) => Ok(d),
        _ => bail!("{origin}: config.json has no positive integer `{key}`"),
    }
}

/// What one source layer computed on the probe, rows = batch·tokens.
pub struct LayerTrace {
    /// LayerNorm(x) without its affine part: what a TokenFormer block feeds q/k/v.
    pub attn_in: Tensor,
    /// Per-row variance of the attention branch's LayerNorm input \[rows\].
    pub attn_var: Tensor,
    pub query: Tensor,
    pub key: Tensor,
    pub value: Tensor,
    /// The attention output (heads merged), the input of the output projection.
    pub proj_in: Tensor,
    pub proj_out: Tensor,
    /// LayerNorm without affine of the MLP's input.
    pub mlp_in: Tensor,
    /// Per-row variance of the MLP branch's LayerNorm input \[rows\].
    pub mlp_var: Tensor,
    pub mlp_out: Tensor,
}

/// Token-token attention of the source.
#[derive(Clone, Copy)]
pub enum Mixing<'a> {
    /// Causal with rotary positions from 0 (GPT-NeoX).
    Causal(&'a Rotary),
    /// Every token sees every token (ViT).
    Bidirectional,
}

/// LayerNorm without weight and bias, over the last axis, as torch computes it
/// (biased variance, eps inside the square root).
pub fn standardise(x: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    Ok(standardise_var(x, eps)?.0)
}

/// [`standardise`] and the variance [.., 1] it divided by (before eps).
fn standardise_var(x: &Tensor, eps: f64) -> candle_core::Result<(Tensor, Tensor)> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let c = x.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(D::Minus1)?;
    Ok((c.broadcast_div(&(&var + eps)?.sqrt()?)?, var))
}

pub fn layer_norm(x: &Tensor, n: &Norm, eps: f64) -> candle_core::Result<Tensor> {
    standardise(x, eps)?
        .broadcast_mul(&n.weight)?
        .broadcast_add(&n.bias)
}

/// x [.., in] · Wᵀ + b.
pub fn linear(x: &Tensor, l: &Dense) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let rows = x.elem_count() / dims[dims.len() - 1];
    let y = x
        .reshape((rows, dims[dims.len() - 1]))?
        .matmul(&l.weight.t()?)?;
    let y = match &l.bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims;
    *out.last_mut().expect("rank >= 1") = l.weight.dim(0)?;
    y.reshape(out)
}

fn rows(x: &Tensor) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    x.reshape((x.elem_count() / d, d))
}

/// A pre-norm block's three branches, on LayerNorm outputs without affine: the
/// source's linear layers (its norms' affine applied first), or the imported
/// Pattention layers, so that one forward (`run_layer`) traces both.
pub trait Block {
    /// q, k, v [b, t, d] of the standardised input u [b, t, d].
    fn qkv(&self, u: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)>;
    /// The output projection of the attention output o [b, t, d].
    fn proj(&self, o: &Tensor) -> candle_core::Result<Tensor>;
    /// The MLP of the standardised input u [b, t, d].
    fn mlp(&self, u: &Tensor) -> candle_core::Result<Tensor>;
}

impl Block for SourceLayer {
    fn qkv(&self, u: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let h = u
            .broadcast_mul(&self.ln1.weight)?
            .broadcast_add(&self.ln1.bias)?;
        Ok((
            linear(&h, &self.query)?,
            linear(&h, &self.key)?,
            linear(&h, &self.value)?,
        ))
    }

    fn proj(&self, o: &Tensor) -> candle_core::Result<Tensor> {
        linear(o, &self.dense)
    }

    fn mlp(&self, u: &Tensor) -> candle_core::Result<Tensor> {
        let h = u
            .broadcast_mul(&self.ln2.weight)?
            .broadcast_add(&self.ln2.bias)?;
        linear(&linear(&h, &self.fc1)?.gelu_erf()?, &self.fc2)
    }
}

/// How every layer of a stack runs: heads, LayerNorm eps, token mixing and
/// residual (`parallel`: GPT-NeoX's x + attn(ln1 x) + mlp(ln2 x) instead of the
/// sequential pre-norm block).
pub struct Stack<'a> {
    pub num_heads: usize,
    pub eps: f64,
    pub mixing: Mixing<'a>,
    pub parallel: bool,
}

impl Stack<'_> {
    /// Runs `layers` in order on x [b, t, d]: the output and each layer's trace.
    pub fn run<B: Block>(
        &self,
        layers: &[B],
        x: &Tensor,
    ) -> candle_core::Result<(Tensor, Vec<LayerTrace>)> {
        let mut x = x.clone();
        let mut traces = Vec::with_capacity(layers.len());
        for l in layers {
            let (next, trace) = self.run_layer(l, &x)?;
            traces.push(trace);
            x = next;
        }
        Ok((x, traces))
    }

    /// Runs `layers` in order on x [b, t, d]: the output and each layer's output
    /// (what distillation matches; the traces are dropped as they go).
    pub fn run_hidden<B: Block>(
        &self,
        layers: &[B],
        x: &Tensor,
    ) -> candle_core::Result<(Tensor, Vec<Tensor>)> {
        let mut x = x.clone();
        let mut hidden = Vec::with_capacity(layers.len());
        for l in layers {
            x = self.run_layer(l, &x)?.0;
            hidden.push(x.clone());
        }
        Ok((x, hidden))
    }

    /// One layer on x [b, t, d]: its output and trace.
    pub fn run_layer<B: Block>(
        &self,
        l: &B,
        x: &Tensor,
    ) -> candle_core::Result<(Tensor, LayerTrace)> {
        let (b, t, d) = x.dims3()?;
        let (h, hd) = (self.num_heads, d / self.num_heads);
        let (u1, var1) = standardise_var(x, self.eps)?;
        let (q, k, v) = l.qkv(&u1)?;
        let heads = |y: &Tensor| y.reshape((b, t, h, hd))?.transpose(1, 2)?.contiguous();
        let (mut qh, mut kh, vh) = (heads(&q)?, heads(&k)?, heads(&v)?);
        let mut scores_mask = None;
        if let Mixing::Causal(rotary) = &self.mixing {
            // Contiguous again: with more than one sequence the rotated view's strides
            // are not ones matmul takes.
            qh = rotary.apply(&qh, 0)?.contiguous()?;
            kh = rotary.apply(&kh, 0)?.contiguous()?;
            let m: Vec<f32> = (0..t)
                .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            scores_mask = Some(Tensor::from_vec(m, (t, t), x.device())?);
        }
        let mut scores = (qh.matmul(&kh.t()?)? / (hd as f64).sqrt())?;
        if let Some(m) = scores_mask {
            scores = scores.broadcast_add(&m)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let o = probs.matmul(&vh)?.transpose(1, 2)?.reshape((b, t, d))?;
        let a = l.proj(&o)?;
        let mlp_input = if self.parallel { x.clone() } else { (x + &a)? };
        let (u2, var2) = standardise_var(&mlp_input, self.eps)?;
        let m = l.mlp(&u2)?;
        let trace = LayerTrace {
            attn_in: rows(&u1)?,
            attn_var: var1.flatten_all()?,
            query: rows(&q)?,
            key: rows(&k)?,
            value: rows(&v)?,
            proj_in: rows(&o)?,
            proj_out: rows(&a)?,
            mlp_in: rows(&u2)?,
            mlp_var: var2.flatten_all()?,
            mlp_out: rows(&m)?,
        };
        Ok(((x + a)?.add(&m)?, trace))
    }
}
