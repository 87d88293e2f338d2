//! `import --from gpt-neox`: a transformers GPT-NeoX / Pythia checkpoint (read by
//! [`tokenformer::source::gpt_neox`]) turned into a TokenFormer language model with
//! the same residual structure (parallel for Pythia), calibrated on one text and
//! measured on another.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use candle_core::{Device, Tensor};
use tokenformer::checkpoint::Tensors;
use tokenformer::loader;
use tokenformer::models::tokenformer::{self as lm, ScaleTokens};
use tokenformer::pattention::Activation;
use tokenformer::source::data::{text_ids, DataInfo, Split, Text, Unit};
use tokenformer::source::gpt_neox::{is_buffer, read};
use tokenformer::source::recover::{recover_lm, FitInputs};
use tokenformer::source::RawCheckpoint;

use super::args::{FitMode, ImportArgs};
use super::fidelity::{self, finish, CardText, Comparison, Report};
use super::fit::fit_values;
use super::mapping::{Calibration, Mapping};
use super::recover::{self, RecoveryReport};
use crate::output::ModelFolder;

/// Token ids of a split's text (the user's, the literal `--probe-text`, or the
/// shipped page), or seeded ids when there is no tokenizer to read text with.
fn split_ids(
    tokenizer: Option<&Path>,
    file: Option<&Path>,
    literal: Option<&str>,
    flag: &str,
    split: Split,
    vocab: usize,
) -> Result<(Vec<u32>, DataInfo)> {
    let Some(tok) = tokenizer else {
        if file.is_some() || literal.is_some() {
            bail!(
                "{flag}: the source has no tokenizer.json to read text with; pass --tokenizer FILE"
            );
        }
        let seed = if split == Split::Calibration { 17 } else { 29 };
        let ids = fidelity::seeded_ids(vocab, 512, seed);
        let info = DataInfo {
            source: "seeded random token ids".into(),
            shipped: false,
            items: ids.len(),
            unit: Unit::Tokens,
            note: Some("the source has no tokenizer.json, so no text could be read: pass --tokenizer for real text".into()),
        };
        return Ok((ids, info));
    };
    let text = match literal {
        Some(t) => Text::literal(t),
        None => Text::new(file, flag, split)?,
    };
    let ids = text_ids(tok, &text, flag, vocab)?;
    let info = DataInfo {
        source: text.source,
        shipped: text.shipped,
        items: ids.len(),
        unit: Unit::Tokens,
        note: text.note,
    };
    Ok((ids, info))
}

/// `import --from gpt-neox`: the TokenFormer language model, calibrated on one text
/// and measured on another against the source.
pub fn import(a: &ImportArgs, raw: &mut RawCheckpoint) -> Result<()> {
    for (flag, given) in [
        ("--calibration-images", a.calibration_images.is_some()),
        ("--eval-images", a.eval_images.is_some()),
        ("--probe-pixels", a.probe_pixels.is_some()),
    ] {
        if given {
            bail!("{flag} is for classifiers (--from vit); a language model takes --calibration-text and --eval-text");
        }
    }
    let recovery = recover::from_args(a)?;
    let src = read(raw)?;
    let buffers = raw.finish(is_buffer)?;
    let cfg = &src.cfg;
    let d = cfg.hidden_size;
    let dev = Device::Cpu;
    let map = Mapping::new(d);

    let tok_path = match &a.tokenizer {
        Some(t) if !t.is_file() => bail!("--tokenizer {}: no such file", t.display()),
        Some(t) => t.clone(),
        None => raw.dir.join(loader::TOKENIZER_FILE),
    };
    let tok = tok_path.is_file().then_some(tok_path.as_path());
    let max = cfg.max_position_embeddings;
    let (calib_ids, calib_info) = split_ids(
        tok,
        a.calibration_text.as_deref(),
        None,
        "--calibration-text",
        Split::Calibration,
        cfg.vocab_size,
    )?;
    let (eval_ids, eval_info) = split_ids(
        tok,
        a.eval_text.as_deref(),
        a.probe_text.as_deref(),
        if a.probe_text.is_some() {
            "--probe-text"
        } else {
            "--eval-text"
        },
        Split::Eval,
        cfg.vocab_size,
    )?;
    if recovery.is_some() && tok.is_none() {
        bail!("--recover-steps trains on the calibration text, but the source has no tokenizer.json to read text with: pass --tokenizer FILE");
    }

    let rotary = src
        .rotary(&dev)
        .map_err(|e| anyhow!("{}: {e}", raw.origin))?;
    let embed =
        |ids: &[u32]| -> Result<Tensor> { Ok(src.embed(&Tensor::new(ids, &dev)?.unsqueeze(0)?)?) };
    let source_logits = |h: &Tensor| -> Result<Tensor> { Ok(src.logits(h)?) };
    let stack = src.stack(&rotary);
    // Texts longer than the context run as consecutive windows, each from position 0.
    let window = src.window();

    // The output projections' (and eps-limited inputs') scales, fitted on the calibration text.
    let mut calibration = Calibration::new(&src.body);
    let mut fit_inputs = FitInputs::default();
    for w in calib_ids.chunks(window) {
        let x = embed(w)?;
        let (_, traces) = stack.run(&src.body.layers, &x)?;
        calibration.add(&src.body, &traces)?;
        fit_inputs.push(&x)?;
    }
    let mapped = calibration.import(&src.body, &map)?;
    // --fit values: the value tokens solved on the same calibration windows.
    let fitted = match a.fit {
        FitMode::Values => Some(fit_values(&stack, &src.body, &fit_inputs, &mapped, &map)?),
        FitMode::None => None,
    };
    let imported = fitted.as_ref().map_or(&mapped, |f| &f.layers);

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
    for (i, l) in imported.iter().enumerate() {
        l.insert_into(i, &mut tensors);
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
        grown_from_tokens: None,
        parallel_residual: cfg.parallel_residual,
    };
    config
        .validate()
        .map_err(|e| anyhow!("the imported config is invalid: {e}"))?;

    let folder = ModelFolder::new(&a.out.out, a.out.force)?;
    // --recover-steps: the import (fitted or mapped) distilled towards the source.
    let recovered = match &recovery {
        Some(rec) => {
            let (bar, progress) = recover::bar(rec.steps);
            let (trained, log, seq_len) = recover_lm(
                &src,
                &config,
                &tensors,
                &calib_ids,
                &fit_inputs,
                &eval_ids,
                rec,
                folder.path(),
                progress,
            )?;
            bar.finish_and_clear();
            recover::say(rec, &log);
            tensors = trained;
            Some((rec, log, seq_len))
        }
        None => None,
    };
    folder.write_config(&config)?;
    folder.write_weights(&tensors, tokenformer::checkpoint::DEFAULT_SHARD_BYTES)?;
    folder.copy_tokenizer(tok)?;

    // The written folder, loaded as any user would, against the source on the eval text.
    let model = loader::load_lm(&folder.files()?, &dev)?;
    let mut compare = Comparison::new(&mapped, fitted.as_ref(), recovered.is_some(), &map)?;
    for w in eval_ids.chunks(window) {
        let x = embed(w)?;
        let imp_logits = model
            .forward(&Tensor::new(w, &dev)?.unsqueeze(0)?, None)?
            .squeeze(0)?;
        compare.add(
            &stack,
            &src.body.layers,
            &x,
            &imp_logits,
            source_logits,
            Some(&w[1..]),
        )?;
    }
    let compared = compare.finish(imported, cfg.eps, Unit::Tokens);
    let recovery =
        recovered
            .zip(compared.before_recovery)
            .map(|((rec, log, seq_len), (before, change))| {
                RecoveryReport::new(rec, &log, Some(seq_len), before, change)
            });
    let not_rep = vec![
        "MLP pre-activation biases (dense_h_to_4h.bias + W·post_attention_layernorm.bias): no constant score exists for LayerNorm outputs; dropped, norms per layer in `dropped_mlp_bias_norm`".to_string(),
        "input/post-attention LayerNorm weights and biases: folded into the following Pattention keys and bias tokens (exact)".to_string(),
        "attention.dense input scale: a Pattention is scale-invariant in its input; a per-layer constant is fitted on the calibration text (`proj_input_scale`)".to_string(),
    ];
    let report = Report {
        source: a.input.clone(),
        from: "gpt-neox".into(),
        mapping: map,
        calibration: calib_info,
        evaluation: eval_info,
        eval_images: None,
        parallel_residual: Some(cfg.parallel_residual),
        layers: compared.layers,
        end_to_end: compared.end_to_end,
        copied,
        ignored_buffers: buffers,
        not_representable: not_rep,
        fit: compared.fit,
        recovery,
    };
    let residual = if cfg.parallel_residual {
        "The parallel residual (x + attn(LN x) + mlp(LN x)) is kept: config `parallel_residual`."
    } else {
        "The sequential residual is kept."
    };
    let card = CardText {
        title: format!(
            "TokenFormer LM imported from GPT-NeoX ({} layers, d {})",
            cfg.num_layers, d
        ),
        pipeline: "text-generation",
        model: format!(
            "A TokenFormer language model initialised from the GPT-NeoX checkpoint `{}` by `tokenformer-convert import --from gpt-neox` (paper: https://arxiv.org/abs/2410.23168). Pattention tokens: {} qkv / {} proj / {} ffn, √n constant {}. Embeddings, final norm and the untied output matrix are copied unchanged. {residual}",
            a.input, config.qkv_tokens, config.proj_tokens, config.ffn_tokens, map.scale_tokens
        ),
    };
    finish(&a.input, folder, &report, card)
}
