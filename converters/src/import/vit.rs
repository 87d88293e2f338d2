//! `import --from vit`: a ViT classifier in transformers' or timm's layout (read by
//! [`tokenformer::source::vit`] with its own eval preprocessing) imported as a
//! TokenFormer-ViT: the output projections' input scales fitted on calibration
//! photos, the import measured against the source on other (eval) photos, each
//! preprocessed as the source's processor does.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use tokenformer::error::Error;
use tokenformer::loader;
use tokenformer::models::tokenformer::ScaleTokens;
use tokenformer::models::vit;
use tokenformer::pattention::Activation;
use tokenformer::source::data::{Images, Split, Unit};
use tokenformer::source::recover::{eval_pixels, recover_vit, FitInputs, EVAL_BATCHES};
use tokenformer::source::vit::{for_batches, is_unused, read, vit_embed, vit_head, BATCH};
use tokenformer::source::RawCheckpoint;
use tokenformer::vision::EvalTransform;

use super::args::{FitMode, ImportArgs};
use super::fidelity::{finish, CardText, Comparison, Report};
use super::fit::fit_values;
use super::mapping::{Calibration, Mapping};
use super::recover::{self, RecoveryReport};
use crate::output::ModelFolder;

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
    let recovery = recover::from_args(a)?;
    let src = read(raw)?;
    let buffers = raw.finish(is_unused)?;
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
    let stack = src.stack();
    let mut calibration = Calibration::new(&src.body);
    let mut fit_inputs = FitInputs::default();
    for_batches(&calib, &transform, &dev, |px| {
        let x = vit_embed(&src, px)?;
        calibration.add(&src.body, &stack.run(&src.body.layers, &x)?.1)?;
        fit_inputs.push(&x)?;
        Ok::<_, anyhow::Error>(())
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
            let eval = match &a.probe_pixels {
                Some(p) => {
                    let px = probe_pixels(p, c, size, &dev)?;
                    let n = px.dim(0)?.min(BATCH * EVAL_BATCHES);
                    (0..n)
                        .step_by(BATCH)
                        .map(|start| px.narrow(0, start, BATCH.min(n - start)))
                        .collect::<candle_core::Result<Vec<_>>>()?
                }
                None => {
                    let eval = Images::new(a.eval_images.as_deref(), "--eval-images", Split::Eval)?;
                    eval_pixels(&eval, &transform)?
                }
            };
            let (bar, progress) = recover::bar(rec.steps);
            let (trained, log) = recover_vit(
                &src,
                &config,
                &tensors,
                &calib,
                &fit_inputs,
                &eval,
                rec,
                folder.path(),
                progress,
            )?;
            bar.finish_and_clear();
            recover::say(rec, &log);
            tensors = trained;
            Some((rec, log))
        }
        None => None,
    };
    // As a JSON value: its keys sorted, as imported ViT configs have always been written.
    folder.write_config(&serde_json::to_value(&config)?)?;
    folder.write_weights(&tensors, tokenformer::checkpoint::DEFAULT_SHARD_BYTES)?;
    let model = loader::load_vit(&folder.files()?, &dev)?;

    // Source and import on the held-out photos.
    let mut compare = Comparison::new(&mapped, fitted.as_ref(), recovered.is_some(), &map)?;
    let head = |h: &Tensor| Ok(vit_head(&src, h)?);
    let mut measure = |px: &Tensor| -> Result<()> {
        let x = vit_embed(&src, px)?;
        compare.add(
            &stack,
            &src.body.layers,
            &x,
            &model.forward(px)?,
            head,
            None,
        )
    };
    let (evaluation, eval_images) = match &a.probe_pixels {
        Some(p) => {
            let px = probe_pixels(p, c, size, &dev)?;
            let n = px.dim(0)?;
            for start in (0..n).step_by(BATCH) {
                measure(&px.narrow(0, start, BATCH.min(n - start))?)?;
            }
            let info = tokenformer::source::data::DataInfo {
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
    let compared = compare.finish(imported, src.body.eps, Unit::Images);
    let recovery = recovered
        .zip(compared.before_recovery)
        .map(|((rec, log), (before, change))| RecoveryReport::new(rec, &log, None, before, change));
    let report = Report {
        source: a.input.clone(),
        from: format!("vit ({})", src.meta.layout),
        mapping: map,
        calibration: calib.info,
        evaluation,
        eval_images,
        parallel_residual: None,
        layers: compared.layers,
        end_to_end: compared.end_to_end,
        copied: src.copied.clone(),
        ignored_buffers: buffers,
        not_representable: vec![
            format!("preprocessing: {}", src.meta.preprocessing),
            "MLP pre-activation biases (fc1 bias + W·norm2 bias): no constant score exists for LayerNorm outputs; dropped, norms per layer in `dropped_mlp_bias_norm`".into(),
            "norm1/norm2 weights and biases: folded into the following Pattention keys and bias tokens (exact)".into(),
            "attention output projection input scale: a Pattention is scale-invariant in its input; a per-layer constant is fitted on the calibration images (`proj_input_scale`)".into(),
        ],
        fit: compared.fit,
        recovery,
    };
    let card = CardText {
        title: format!(
            "TokenFormer-ViT imported from {} ({} layers, d {})",
            src.meta.layout, config.num_layers, d
        ),
        pipeline: "image-classification",
        model: format!(
            "A TokenFormer image classifier initialised from the {} checkpoint `{}` by `tokenformer-convert import --from vit` (paper: https://arxiv.org/abs/2410.23168). Pattention tokens: {} qkv / {} proj / {} ffn, √n constant {}. Patch embedding, class token, position embedding, final norm and head are copied unchanged. Preprocessing: {}.",
            src.meta.layout, a.input, 4 * d, 4 * d, src.meta.intermediate_size + 4 * d, map.scale_tokens, src.meta.preprocessing
        ),
    };
    finish(&a.input, folder, &report, card)
}
