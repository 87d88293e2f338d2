//! `tokenformer train --model M --distill-from SOURCE`: the TokenFormer `M` (typically
//! one `tokenformer-convert import` wrote) trained to behave like the Transformer it
//! came from, by the same recovery as `import --recover-steps`
//! ([`tokenformer::source::recover`]): the source read and run by the importer's own
//! readers and forward ([`tokenformer::source`]), the data `--data` / `--val-data` (a
//! text file or a folder of photos, local or `hf://datasets/…`; the shipped samples
//! without them). Writes `checkpoint-NNNNNN/` (the model, no optimiser state),
//! `metrics.jsonl` and `loss.png` into `--out`.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::Tensors;
use tokenformer::loader;
use tokenformer::source::data::{text_ids, DataInfo, Images, Split, Text, Unit};
use tokenformer::source::recover::{
    self, check_lm_fits, check_vit_fits, eval_pixels, recover_lm, recover_vit, FitInputs, Flags,
    Log, Recovery, StepProgress,
};
use tokenformer::source::{gpt_neox, locate_input, vit, RawCheckpoint};
use tokenformer::vision::EvalTransform;

use super::TrainArgs;
use crate::cli::stdout::outln;

/// The peak learning rate of a distillation without `--lr` (as `import --recover-lr`).
pub const DEFAULT_LR: f64 = 1e-3;

/// Held-out items below which the held-out loss is too small a sample to mean much
/// (as the import report judges its agreement).
const FEW_TOKENS: usize = 1000;
const FEW_IMAGES: usize = 50;

/// Runs the distillation of the model read from `config_path` (`value`, `tensors`).
pub fn run(
    a: &TrainArgs,
    spec: &str,
    value: Value,
    config_path: &Path,
    tensors: Tensors,
    tokenizer: Option<std::path::PathBuf>,
    model_source: String,
) -> Result<()> {
    let Some(steps) = a.steps else {
        bail!("--distill-from needs --steps N (the import's --recover-steps)");
    };
    let rec = Recovery {
        steps,
        lr: a.lr.unwrap_or(DEFAULT_LR),
        hidden_weight: a.hidden_weight,
        batch_size: a.batch_size,
    };
    rec.check(&Flags {
        steps: "--steps",
        lr: "--lr",
        hidden_weight: "--hidden-weight",
        batch_size: "--batch-size",
    })?;
    if a.data.len() > 1 {
        bail!("--distill-from calibrates on one --data (a text file, or a folder of photos)");
    }
    let calib_flag = "--data";
    let data = a.data.first().map(|p| p.as_path());
    let val = a.val_data.as_deref();
    // Checked before anything runs: a distillation is not resumed over an older one.
    let target = tokenformer::train::trainer::checkpoint_path(&a.out, steps);
    if target.exists() {
        bail!(
            "{}: already exists; remove it or choose another --out",
            target.display()
        );
    }
    let dir = locate_input(
        spec,
        "--distill-from",
        Some(&crate::cli::progress::download_bars()),
    )?;
    let mut raw = RawCheckpoint::read(&dir).with_context(|| format!("--distill-from {spec}"))?;
    let what = config_path.display().to_string();
    // Created once the source and the data are checked, just before training.
    let make_out =
        || std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()));
    let bar = crate::cli::progress::bar(
        steps,
        "distilling {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
    );
    let b = bar.clone();
    let progress = move |p: &StepProgress| {
        b.set_message(p.message());
        b.set_position(p.step);
    };
    let arch = loader::architecture(&value);
    let (trained, log, calib, eval, extra) = match arch {
        tokenformer::models::tokenformer::ARCHITECTURE => {
            let cfg = loader::lm_config(&value, config_path)?;
            let src = gpt_neox::read(&mut raw).with_context(|| {
                format!("--distill-from {spec}: a language model distills from a GPT-NeoX/Pythia source")
            })?;
            raw.finish(gpt_neox::is_buffer)
                .with_context(|| format!("--distill-from {spec}"))?;
            check_lm_fits(&src, &cfg, &what)?;
            let tok = tokenizer.context(
                "no tokenizer.json for this model, to read the calibration text with: pass --tokenizer PATH",
            )?;
            let read = |file: Option<&Path>, flag: &str, split| -> Result<(Vec<u32>, DataInfo)> {
                let text = Text::new(file, flag, split)?;
                let ids = text_ids(&tok, &text, flag, cfg.vocab_size)?;
                let info = DataInfo {
                    items: ids.len(),
                    source: text.source,
                    shipped: text.shipped,
                    unit: Unit::Tokens,
                    note: text.note,
                };
                Ok((ids, info))
            };
            let (calib_ids, calib) = read(data, calib_flag, Split::Calibration)?;
            let (eval_ids, mut eval) = read(val, "--val-data", Split::Eval)?;
            let inputs = FitInputs::of_text(&src, &calib_ids)?;
            make_out()?;
            let (trained, log, seq_len) = recover_lm(
                &src, &cfg, &tensors, &calib_ids, &inputs, &eval_ids, &rec, &a.out, progress,
            )?;
            // The held-out loss is measured on the first windows only.
            eval.items = eval.items.min(seq_len * recover::EVAL_BATCHES);
            let tok_bytes =
                std::fs::read(&tok).with_context(|| format!("reading {}", tok.display()))?;
            (trained, log, calib, eval, Some(tok_bytes))
        }
        tokenformer::models::vit::ARCHITECTURE => {
            let cfg = loader::vit_config(&value, config_path)?;
            let src = vit::read(&mut raw).with_context(|| {
                format!("--distill-from {spec}: a classifier distills from a ViT source")
            })?;
            raw.finish(vit::is_unused)
                .with_context(|| format!("--distill-from {spec}"))?;
            check_vit_fits(&src, &cfg, &what)?;
            let transform = EvalTransform::from_config(&cfg);
            let calib_images = Images::new(data, calib_flag, Split::Calibration)?;
            let eval_images = Images::new(val, "--val-data", Split::Eval)?;
            let inputs = FitInputs::of_images(&src, &calib_images, &transform)?;
            let eval_px = eval_pixels(&eval_images, &transform)?;
            make_out()?;
            let (trained, log) = recover_vit(
                &src,
                &cfg,
                &tensors,
                &calib_images,
                &inputs,
                &eval_px,
                &rec,
                &a.out,
                progress,
            )?;
            let mut eval = eval_images.info;
            eval.items = eval_px.iter().map(|p| p.dim(0).unwrap_or(0)).sum();
            (trained, log, calib_images.info, eval, None)
        }
        other => bail!(
            "{what}: --distill-from distills `tokenformer-lm` and `tokenformer-vit` models; this is `{other}`"
        ),
    };
    bar.finish_and_clear();
    finish(
        a,
        &rec,
        spec,
        &model_source,
        &value,
        &trained,
        &log,
        &calib,
        &eval,
        extra,
    )
}

/// The held-out sample's size in words, with a warning when it is too small.
fn sample_note(eval: &DataInfo) -> Option<String> {
    let few = match eval.unit {
        Unit::Tokens => FEW_TOKENS,
        Unit::Images => FEW_IMAGES,
    };
    (eval.items < few).then(|| {
        format!(
            "the held-out loss is measured on only {} eval {}, too small a sample to mean much; pass --val-data with more",
            eval.items, eval.unit
        )
    })
}

/// Writes the checkpoint with its card, and says what the run did.
#[allow(clippy::too_many_arguments)]
fn finish(
    a: &TrainArgs,
    rec: &Recovery,
    spec: &str,
    model_source: &str,
    config: &Value,
    tensors: &Tensors,
    log: &Log,
    calib: &DataInfo,
    eval: &DataInfo,
    tokenizer: Option<Vec<u8>>,
) -> Result<()> {
    let note = sample_note(eval);
    let mut card = ModelCard::new(
        "TokenFormer distilled towards its source (tokenformer train --distill-from)",
        if tokenizer.is_some() {
            "text-generation"
        } else {
            "image-classification"
        },
    );
    let data_row = |d: &DataInfo| {
        let mut s = format!("{} ({} {})", d.source, d.items, d.unit);
        if let Some(n) = &d.note {
            s += &format!("; {n}");
        }
        s
    };
    let mut body = format!(
        "Started from {model_source}; {} steps of {} towards `{spec}`.\n\n\
         | setting | value |\n|---|---|\n\
         | learning rate | {} (10% warm-up, cosine to a tenth) |\n\
         | batch | {} |\n| hidden-state weight | {} |\n\
         | calibration data | {} |\n| eval data | {} |\n\
         | distillation loss | {:.4} → {:.4} (eval {:.4}) |\n",
        rec.steps,
        rec.describe(),
        rec.lr,
        rec.batch_size,
        rec.hidden_weight,
        data_row(calib),
        data_row(eval),
        log.first_loss,
        log.final_loss,
        log.final_eval_loss,
    );
    if let Some(n) = &note {
        body += &format!("\nNote: {n}.\n");
    }
    card.section("Training", body);
    let mut extra = vec![];
    if let Some(t) = tokenizer {
        extra.push(("tokenizer.json", t));
    }
    extra.push(("README.md", card.render().into_bytes()));
    let config_text = serde_json::to_string_pretty(config)? + "\n";
    let ckpt =
        tokenformer::train::trainer::write_model(&a.out, rec.steps, &config_text, tensors, &extra)?;
    if a.json {
        outln!(
            "{}",
            json!({
                "steps": rec.steps, "first_loss": log.first_loss, "final_loss": log.final_loss,
                "val_loss": log.final_eval_loss, "seconds": log.seconds, "checkpoint": ckpt,
                "calibration": calib, "evaluation": eval, "sample_note": note,
            })
        )?;
    } else {
        eprintln!(
            "distilled in {} steps ({:.1} s): loss {:.4} -> {:.4}, on the eval data {:.4}; saved {}",
            rec.steps,
            log.seconds,
            log.first_loss,
            log.final_loss,
            log.final_eval_loss,
            ckpt.display()
        );
        if let Some(n) = note {
            eprintln!("note: {n}");
        }
    }
    Ok(())
}
