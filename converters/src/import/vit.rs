//! ViT image classifiers, in transformers' layout ([`hf`]) or timm's ([`timm`]),
//! read into one [`VitSource`] with their own eval preprocessing, and imported as a
//! TokenFormer-ViT: the output projections' input scales fitted on calibration
//! photos, the import measured against the source on other (eval) photos, each
//! preprocessed as the source's processor does.

mod hf;
mod timm;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use tokenformer::checkpoint::Tensors;
use tokenformer::error::Error;
use tokenformer::loader;
use tokenformer::models::tokenformer::ScaleTokens;
use tokenformer::models::vit::{self, Interpolation, Pool, ResizeMode};
use tokenformer::pattention::Activation;
use tokenformer::train::distill::{DistillBatch, Targets};
use tokenformer::train::vit::{TrainTransform, TrainableVit};
use tokenformer::train::Trainable;
use tokenformer::vision::EvalTransform;

use super::args::{FitMode, ImportArgs};
use super::data::{Images, Split, Unit};
use super::fidelity::{
    finish, Agreement, CardText, PairedAgreement, Report, FITTED_CARD_NOTE, RECOVERED_CARD_NOTE,
};
use super::fit::{fit_values, value_update_scales, FitCheck, FitInputs, ImportBlock};
use super::mapping::{Calibration, LayerCheck, Mapping};
use super::recover::{self, Recovery, RecoveryReport, Shuffled, AUGMENT};
use super::source::{
    layer_norm, Dense, Mixing, Norm, RawCheckpoint, SourceBody, SourceLayer, Stack,
};
use crate::output::ModelFolder;

/// What a source's config says about a ViT classifier: everything but the tensors.
pub struct VitMeta {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub eps: f64,
    pub image_size: usize,
    pub patch_size: usize,
    pub num_channels: usize,
    pub intermediate_size: usize,
    pub num_classes: usize,
    /// Class token after the final norm, or mean of the patch tokens, then fc_norm.
    pub pool: Pool,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub crop_pct: f64,
    pub interpolation: Interpolation,
    pub resize_mode: ResizeMode,
    /// How the source's own processor was read, for the report.
    pub preprocessing: String,
    pub class_names: Option<Vec<String>>,
    pub layout: &'static str,
}

/// Where a layout keeps each tensor (source names; the TokenFormer names are the same
/// for every layout). Prefixes name a module's `.weight` and `.bias`.
struct Names {
    cls: &'static str,
    pos: &'static str,
    patch: &'static str,
    /// Block i is `{block}.{i}`; the rest of a block's names are relative to it.
    block: &'static str,
    norms: [&'static str; 2],
    qkv: Qkv,
    proj: &'static str,
    mlp: [&'static str; 2],
    final_norm: &'static str,
    head: &'static str,
}

/// The attention's input projections: three linears, or one fused [q | k | v] (each
/// over all heads).
enum Qkv {
    Separate([&'static str; 3]),
    Fused(&'static str),
}

/// A ViT classifier in the shared source form (filled by [`hf`] or [`timm`]).
pub struct VitSource {
    pub meta: VitMeta,
    pub body: SourceBody,
    /// Conv weight [d, C, p, p] and bias.
    pub patch_w: Tensor,
    pub patch_b: Tensor,
    pub cls: Tensor,
    pub pos: Tensor,
    pub norm: Norm,
    pub head_w: Tensor,
    pub head_b: Tensor,
    /// (source name, TokenFormer name) of every copied tensor.
    pub copied: Vec<(String, String)>,
    /// The copied tensors under their TokenFormer names.
    pub copies: Tensors,
}

impl VitSource {
    /// Takes every tensor `meta` implies from `raw`, by the layout's `names`.
    fn take(raw: &mut RawCheckpoint, names: &Names, meta: VitMeta) -> Result<Self> {
        let (d, m, p) = (meta.hidden_size, meta.intermediate_size, meta.patch_size);
        let tokens = (meta.image_size / p) * (meta.image_size / p) + 1;
        let (mut copied, mut copies) = (vec![], Tensors::new());
        let mut copy = |raw: &mut RawCheckpoint, from: String, shape: &[usize], to: String| {
            let t = raw.take(&from, shape)?;
            copies.insert(to.clone(), t.clone());
            copied.push((from, to));
            Ok::<_, anyhow::Error>(t)
        };
        let cls = copy(raw, names.cls.into(), &[1, 1, d], "cls_token".into())?;
        let pos = copy(raw, names.pos.into(), &[1, tokens, d], "pos_embed".into())?;
        // A module's `.weight` and `.bias`, copied under the TokenFormer name `to`.
        let mut module =
            |raw: &mut RawCheckpoint, from: &str, to: &str, w: &[usize], b: &[usize]| {
                let weight = copy(raw, format!("{from}.weight"), w, format!("{to}.weight"))?;
                Ok::<_, anyhow::Error>((
                    weight,
                    copy(raw, format!("{from}.bias"), b, format!("{to}.bias"))?,
                ))
            };
        let patch_shape = [d, meta.num_channels, p, p];
        let (patch_w, patch_b) = module(raw, names.patch, "patch_embed", &patch_shape, &[d])?;
        let mut layers = Vec::with_capacity(meta.num_layers);
        for i in 0..meta.num_layers {
            let b = format!("{}.{i}", names.block);
            let ln1 = raw.take_norm(&format!("{b}.{}", names.norms[0]), d)?;
            let ln2 = raw.take_norm(&format!("{b}.{}", names.norms[1]), d)?;
            let dense = |raw: &mut RawCheckpoint, n: &str, out: usize, inp: usize| {
                raw.take_dense(&format!("{b}.{n}"), out, inp, false)
            };
            let [query, key, value] = match names.qkv {
                Qkv::Separate([q, k, v]) => [
                    dense(raw, q, d, d)?,
                    dense(raw, k, d, d)?,
                    dense(raw, v, d, d)?,
                ],
                Qkv::Fused(n) => {
                    let qkv = dense(raw, n, 3 * d, d)?;
                    let part = |j: usize| -> Result<Dense> {
                        Ok(Dense {
                            weight: qkv.weight.narrow(0, j * d, d)?.contiguous()?,
                            bias: qkv
                                .bias
                                .as_ref()
                                .map(|b| b.narrow(0, j * d, d))
                                .transpose()?,
                        })
                    };
                    [part(0)?, part(1)?, part(2)?]
                }
            };
            layers.push(SourceLayer {
                ln1,
                query,
                key,
                value,
                dense: dense(raw, names.proj, d, d)?,
                ln2,
                fc1: dense(raw, names.mlp[0], m, d)?,
                fc2: dense(raw, names.mlp[1], d, m)?,
            });
        }
        let to = if meta.pool == Pool::Cls {
            "final_norm"
        } else {
            "fc_norm"
        };
        let (weight, bias) = module(raw, names.final_norm, to, &[d], &[d])?;
        let norm = Norm { weight, bias };
        let k = meta.num_classes;
        let (head_w, head_b) = module(raw, names.head, "head", &[k, d], &[k])?;
        Ok(Self {
            body: SourceBody {
                num_heads: meta.num_heads,
                eps: meta.eps,
                layers,
            },
            meta,
            patch_w,
            patch_b,
            cls,
            pos,
            norm,
            head_w,
            head_b,
            copied,
            copies,
        })
    }
}

/// Images per forward pass of the source.
const BATCH: usize = 8;

/// Eval batches the recovery's held-out loss is measured on (the report uses them all).
const RECOVER_EVAL_BATCHES: usize = 8;

/// Runs `f` on `images` preprocessed by `t`, [`BATCH`] at a time.
fn for_batches(
    images: &Images,
    t: &EvalTransform,
    dev: &Device,
    mut f: impl FnMut(&Tensor) -> Result<()>,
) -> Result<()> {
    let mut start = 0;
    while start < images.len() {
        let end = (start + BATCH).min(images.len());
        let batch = (start..end)
            .map(|i| {
                let img = images.decode(i)?;
                t.apply(&img)
                    .map_err(|e| anyhow!("{}: {e}", images.name(i)))
            })
            .collect::<Result<Vec<_>>>()?;
        f(&t.batch(batch, dev)?)?;
        start = end;
    }
    Ok(())
}

/// `--probe-pixels`: normalised images [n, C, size, size].
fn probe_pixels(p: &std::path::Path, c: usize, size: usize, dev: &Device) -> Result<Tensor> {
    let mut t = candle_core::safetensors::load(p, dev)
        .with_context(|| format!("--probe-pixels {}", p.display()))?;
    let px = t
        .remove("pixels")
        .ok_or_else(|| anyhow!("--probe-pixels {}: no tensor `pixels`", p.display()))?
        .to_dtype(DType::F32)?;
    if px.rank() != 4 || px.dims()[1..] != [c, size, size] || px.dim(0)? == 0 {
        bail!(
            "--probe-pixels {}: `pixels` has shape {:?}, expected [n ≥ 1, {c}, {size}, {size}]",
            p.display(),
            px.dims()
        );
    }
    Ok(px)
}

/// `import --from vit`: the TokenFormer-ViT, calibrated on photos and measured on
/// other photos against the source.
pub fn import(a: &ImportArgs, raw: &mut RawCheckpoint) -> Result<()> {
    for (flag, given) in [
        ("--calibration-text", a.calibration_text.is_some()),
        ("--eval-text", a.eval_text.is_some()),
        ("--probe-text", a.probe_text.is_some()),
        ("--tokenizer", a.tokenizer.is_some()),
    ] {
        if given {
            bail!("{flag} is for language models (--from gpt-neox); a classifier takes --calibration-images and --eval-images");
        }
    }
    let recovery = Recovery::from_args(a)?;
    let src = if raw.tensors.contains_key("vit.embeddings.cls_token") {
        hf::read(raw)?
    } else if raw.tensors.contains_key("cls_token") {
        timm::read(raw)?
    } else {
        let example = raw.tensors.keys().next().cloned().unwrap_or_default();
        bail!(
            "{}: unknown ViT layout: neither `vit.embeddings.cls_token` (transformers) nor `cls_token` (timm) is present (found e.g. `{example}`)",
            raw.origin
        )
    };
    let buffers = raw.finish(hf::is_unused)?;
    let d = src.cls.dim(2)?;
    let dev = Device::Cpu;
    let map = Mapping::new(d);
    let (c, size) = (src.meta.num_channels, src.meta.image_size);
    let config = vit::Config {
        image_size: size,
        patch_size: src.meta.patch_size,
        num_channels: c,
        hidden_size: d,
        num_layers: src.body.layers.len(),
        num_heads: src.body.num_heads,
        qkv_tokens: 4 * d,
        proj_tokens: 4 * d,
        ffn_tokens: src.meta.intermediate_size + 4 * d,
        num_classes: src.meta.num_classes,
        pool: src.meta.pool,
        norm_eps: src.body.eps,
        pattention_activation: Activation::L2NormGelu,
        pattention_scale_tokens: Some(ScaleTokens {
            qkv: map.scale_tokens,
            proj: map.scale_tokens,
            ffn: map.scale_tokens,
        }),
        crop_pct: src.meta.crop_pct,
        interpolation: src.meta.interpolation,
        resize_mode: src.meta.resize_mode,
        mean: src.meta.mean,
        std: src.meta.std,
        class_wnids: None,
        class_names: src.meta.class_names.clone(),
        grown_from_tokens: None,
    };
    // Checked before anything is written.
    config
        .validate()
        .map_err(|e| Error::config(raw.dir.join(loader::CONFIG_FILE), e))?;
    let transform = EvalTransform::from_config(&config);

    // The output projections' (and eps-limited inputs') scales, fitted on the calibration photos.
    let calib = Images::new(
        a.calibration_images.as_deref(),
        "--calibration-images",
        Split::Calibration,
    )?;
    let stack = Stack {
        num_heads: src.body.num_heads,
        eps: src.body.eps,
        mixing: Mixing::Bidirectional,
        parallel: false,
    };
    let mut calibration = Calibration::new(&src.body);
    let mut fit_inputs = FitInputs::default();
    for_batches(&calib, &transform, &dev, |px| {
        let x = vit_embed(&src, px)?;
        calibration.add(&src.body, &stack.run(&src.body.layers, &x)?.1)?;
        fit_inputs.push(&x)?;
        Ok(())
    })?;
    let mapped = calibration.import(&src.body, &map)?;
    // --fit values: the value tokens solved on the same calibration photos.
    let fitted = match a.fit {
        FitMode::Values => Some(fit_values(&stack, &src.body, &fit_inputs, &mapped, &map)?),
        FitMode::None => None,
    };
    let imported = fitted.as_ref().map_or(&mapped, |f| &f.layers);
    let mut tensors = src.copies.clone();
    for (i, l) in imported.iter().enumerate() {
        l.insert_into(i, &mut tensors);
    }

    let folder = ModelFolder::new(&a.out.out, a.out.force)?;
    // --recover-steps: the import (fitted or mapped) distilled towards the source.
    let recovered = match &recovery {
        Some(rec) => {
            let teacher = |px: &Tensor| -> tokenformer::Result<Targets> {
                let x = vit_embed(&src, px)?;
                let (h, hidden) = stack.run_hidden(&src.body.layers, &x)?;
                Ok(Targets {
                    logits: vit_head(&src, &h)?,
                    hidden,
                })
            };
            let mut eval = vec![];
            let mut add_eval = |px: &Tensor| -> Result<()> {
                if eval.len() < RECOVER_EVAL_BATCHES {
                    eval.push(DistillBatch {
                        targets: teacher(px)?,
                        input: px.clone(),
                    });
                }
                Ok(())
            };
            match &a.probe_pixels {
                Some(p) => {
                    let px = probe_pixels(p, c, size, &dev)?;
                    let n = px.dim(0)?;
                    for start in (0..n).step_by(BATCH) {
                        add_eval(&px.narrow(0, start, BATCH.min(n - start))?)?;
                    }
                }
                None => {
                    let eval = Images::new(a.eval_images.as_deref(), "--eval-images", Split::Eval)?;
                    let first = Images::first(eval, BATCH * RECOVER_EVAL_BATCHES);
                    for_batches(&first, &transform, &dev, &mut add_eval)?;
                }
            }
            let views = TrainTransform::from_config(&config, AUGMENT);
            let mut order = Shuffled::new(calib.len());
            let b = rec.batch_size;
            let mut next = || -> tokenformer::Result<(Tensor, u64)> {
                let mut pixels = Vec::with_capacity(b * c * size * size);
                for _ in 0..b {
                    let (i, rng) = order.next();
                    let img = calib
                        .decode(i)
                        .map_err(|e| tokenformer::Error::input(format!("{e:#}")))?;
                    let v = views.apply(&img, rng).map_err(|e| {
                        tokenformer::Error::input(format!("{}: {e}", calib.name(i)))
                    })?;
                    pixels.extend(v);
                }
                Ok((
                    Tensor::from_vec(pixels, (b, c, size, size), &dev)?,
                    b as u64,
                ))
            };
            let student = TrainableVit::new(&config, &tensors, DType::F32, &dev)?;
            let (model, log) = recover::run(
                rec,
                1,
                student,
                value_update_scales(&stack, imported, &map, &fit_inputs)?,
                folder.path(),
                "images",
                &mut next,
                teacher,
                &eval,
            )?;
            tensors = model.tensors();
            Some((rec, log))
        }
        None => None,
    };
    // As a JSON value: its keys sorted, as imported ViT configs have always been written.
    folder.write_config(&serde_json::to_value(&config)?)?;
    folder.write_weights(&tensors, tokenformer::checkpoint::DEFAULT_SHARD_BYTES)?;
    let model = loader::load_vit(&folder.files()?, &dev)?;

    // Source and import on the held-out photos.
    let mut check = LayerCheck::new(imported, &map)?;
    let mut agreement = Agreement::default();
    let mut fit_check = fitted
        .as_ref()
        .map(|f| FitCheck::new(&mapped, f, &map))
        .transpose()?;
    // With recovery: the import before it, run here, against the written one.
    let before_blocks = match recovered {
        Some(_) => Some(
            imported
                .iter()
                .map(|l| ImportBlock::new(l, &map))
                .collect::<Result<Vec<_>>>()?,
        ),
        None => None,
    };
    let (mut before_agreement, mut before_paired) =
        (Agreement::default(), PairedAgreement::default());
    let mut measure = |px: &Tensor| -> Result<()> {
        let x = vit_embed(&src, px)?;
        let (h, traces) = stack.run(&src.body.layers, &x)?;
        check.add(&traces)?;
        let src_logits = vit_head(&src, &h)?;
        let imp_logits = model.forward(px)?;
        agreement.add(&src_logits, &imp_logits, None)?;
        let before = match &before_blocks {
            Some(blocks) => {
                let before = vit_head(&src, &stack.run(blocks, &x)?.0)?;
                before_agreement.add(&src_logits, &before, None)?;
                before_paired.add(&src_logits, &before, &imp_logits)?;
                Some(before)
            }
            None => None,
        };
        if let Some(fc) = &mut fit_check {
            let head = |h: &Tensor| Ok(vit_head(&src, h)?);
            let fitted_logits = before.as_ref().unwrap_or(&imp_logits);
            fc.add(&stack, &x, &traces, &src_logits, fitted_logits, head, None)?;
        }
        Ok(())
    };
    let (evaluation, eval_images) = match &a.probe_pixels {
        Some(p) => {
            let px = probe_pixels(p, c, size, &dev)?;
            let n = px.dim(0)?;
            for start in (0..n).step_by(BATCH) {
                measure(&px.narrow(0, start, BATCH.min(n - start))?)?;
            }
            let info = super::data::DataInfo {
                source: format!("{} (--probe-pixels, preprocessed by the user)", p.display()),
                shipped: false,
                items: n,
                unit: Unit::Images,
                note: None,
            };
            (info, None)
        }
        None => {
            let eval = Images::new(a.eval_images.as_deref(), "--eval-images", Split::Eval)?;
            for_batches(&eval, &transform, &dev, &mut measure)?;
            let names = (0..eval.len()).map(|i| eval.name(i)).collect();
            (eval.info, Some(names))
        }
    };
    let (layer_fit, fit) = fit_check.map(|fc| fc.finish(Unit::Images)).unzip();
    let layers = check.finish(imported, src.body.eps, layer_fit.as_deref());
    let recovery = recovered.map(|(rec, log)| {
        RecoveryReport::new(
            rec,
            &log,
            None,
            before_agreement.finish(Unit::Images),
            before_paired.finish(),
        )
    });
    let report = Report {
        source: a.input.clone(),
        from: format!("vit ({})", src.meta.layout),
        mapping: map,
        calibration: calib.info,
        evaluation,
        eval_images,
        parallel_residual: None,
        layers,
        end_to_end: agreement.finish(Unit::Images),
        copied: src.copied.clone(),
        ignored_buffers: buffers,
        not_representable: vec![
            format!("preprocessing: {}", src.meta.preprocessing),
            "MLP pre-activation biases (fc1 bias + W·norm2 bias): no constant score exists for LayerNorm outputs; dropped, norms per layer in `dropped_mlp_bias_norm`".into(),
            "norm1/norm2 weights and biases: folded into the following Pattention keys and bias tokens (exact)".into(),
            "attention output projection input scale: a Pattention is scale-invariant in its input; a per-layer constant is fitted on the calibration images (`proj_input_scale`)".into(),
        ],
        fit,
        recovery,
    };
    let mut fitted_note = if report.fit.is_some() {
        FITTED_CARD_NOTE
    } else {
        ""
    }
    .to_string();
    if report.recovery.is_some() {
        fitted_note += RECOVERED_CARD_NOTE;
    }
    let card = CardText {
        title: format!(
            "TokenFormer-ViT imported from {} ({} layers, d {})",
            src.meta.layout, config.num_layers, d
        ),
        pipeline: "image-classification",
        model: format!(
            "A TokenFormer image classifier initialised from the {} checkpoint `{}` by `tokenformer-convert import --from vit` (paper: https://arxiv.org/abs/2410.23168). Pattention tokens: {} qkv / {} proj / {} ffn, √n constant {}. Patch embedding, class token, position embedding, final norm and head are copied unchanged. Preprocessing: {}.",
            src.meta.layout, a.input, 4 * d, 4 * d, src.meta.intermediate_size + 4 * d, map.scale_tokens, src.meta.preprocessing
        ) + &fitted_note,
    };
    finish(&a.input, folder, &report, card)
}

/// A per-channel triple (mean, std) of a preprocessing config, `default` if absent.
fn triple(pre: &Value, key: &str, default: [f32; 3]) -> [f32; 3] {
    pre.get(key)
        .and_then(Value::as_array)
        .filter(|a| a.len() == 3)
        .map(|a| [0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.5) as f32))
        .unwrap_or(default)
}

/// The source ViT's layer input x [b, tokens, d] of normalised pixels [b, C, H, W]:
/// the stride-p convolution the patch embedding is in both layouts, the class
/// token and the position embedding.
pub fn vit_embed(src: &VitSource, pixels: &Tensor) -> candle_core::Result<Tensor> {
    let p = src.meta.patch_size;
    let x = pixels.conv2d(&src.patch_w, 0, p, 1, 1)?; // [b, d, g, g]
    let (b, d, gh, gw) = x.dims4()?;
    let x = x
        .reshape((b, d, gh * gw))?
        .transpose(1, 2)?
        .broadcast_add(&src.patch_b)?;
    let cls = src.cls.broadcast_as((b, 1, d))?;
    Tensor::cat(&[&cls, &x], 1)?.broadcast_add(&src.pos)
}

/// Logits [b, classes] of the last layer's output h [b, tokens, d]: class token or
/// mean of the patch tokens, the final norm and the head (copied, so the same for
/// the source and the import).
pub fn vit_head(src: &VitSource, h: &Tensor) -> candle_core::Result<Tensor> {
    let feat = if src.meta.pool == Pool::Cls {
        layer_norm(&h.narrow(1, 0, 1)?.squeeze(1)?, &src.norm, src.body.eps)?
    } else {
        let n = h.dim(1)? - 1;
        layer_norm(&h.narrow(1, 1, n)?.mean(1)?, &src.norm, src.body.eps)?
    };
    feat.matmul(&src.head_w.t()?)?.broadcast_add(&src.head_b)
}
