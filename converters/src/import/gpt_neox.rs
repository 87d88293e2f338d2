//! Name map of Hugging Face transformers' GPT-NeoX / Pythia checkpoints
//! (`modeling_gpt_neox.py`, `GPTNeoXForCausalLM`): `gpt_neox.embed_in`,
//! `gpt_neox.layers.{i}.{input_layernorm, attention.query_key_value,
//! attention.dense, post_attention_layernorm, mlp.dense_h_to_4h,
//! mlp.dense_4h_to_h}`, `gpt_neox.final_layer_norm`, `embed_out`.
//! The fused `query_key_value` rows are grouped per head as [q | k | v]
//! (the module views its output as [.., heads, 3·head_dim]). [`import`] turns
//! it into a TokenFormer language model with the same residual structure
//! (parallel for Pythia), calibrated on one text and measured on another.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use tokenformer::checkpoint::Tensors;
use tokenformer::loader;
use tokenformer::models::tokenformer::{self as lm, Rotary, ScaleTokens};
use tokenformer::pattention::Activation;
use tokenformer::train::distill::{DistillBatch, Targets};
use tokenformer::train::TrainableLm;

use super::args::{FitMode, ImportArgs};
use super::data::{DataInfo, Split, Text, Unit};
use super::fidelity::{
    self, finish, Agreement, CardText, PairedAgreement, Report, FITTED_CARD_NOTE,
    RECOVERED_CARD_NOTE,
};
use super::fit::{fit_values, value_update_scales, FitCheck, FitInputs, ImportBlock};
use super::mapping::{Calibration, LayerCheck, Mapping};
use super::recover::{self, Recovery, RecoveryReport, TextWindows};
use super::source::{
    layer_norm, usize_key, Dense, Mixing, Norm, RawCheckpoint, SourceBody, SourceLayer, Stack,
};
use crate::output::ModelFolder;

/// The hyper-parameters a TokenFormer needs, from `config.json`.
#[derive(Clone, Debug)]
pub struct NeoxConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rotary_pct: f64,
    pub rotary_base: f64,
    pub max_position_embeddings: usize,
    pub eps: f64,
    pub parallel_residual: bool,
    /// Biases on query_key_value and dense (transformers' `attention_bias`, default true).
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    pub eos_token_id: u32,
}

/// A GPT-NeoX checkpoint in the shared source form.
pub struct NeoxSource {
    pub cfg: NeoxConfig,
    pub body: SourceBody,
    pub embed_in: Tensor,
    pub final_norm: Norm,
    /// `embed_out.weight` (None when the source ties it to the embeddings).
    pub embed_out: Option<Tensor>,
}

pub fn config(c: &Value, origin: &str) -> Result<NeoxConfig> {
    if let Some(mt) = c.get("model_type").and_then(Value::as_str) {
        if mt != "gpt_neox" {
            bail!("{origin}: config.json says model_type `{mt}`, not a GPT-NeoX checkpoint (`gpt_neox`); use --from vit for ViT classifiers")
        }
    }
    if let Some(act) = c.get("hidden_act").and_then(Value::as_str) {
        if act != "gelu" {
            bail!("{origin}: hidden_act `{act}` is not supported: Pattention's Θ uses the exact (erf) GELU, so only `gelu` sources map onto it")
        }
    }
    let hidden_size = usize_key(c, "hidden_size", origin, None)?;
    let num_heads = usize_key(c, "num_attention_heads", origin, None)?;
    if hidden_size % num_heads != 0 {
        bail!("{origin}: hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}")
    }
    let f = |k: &str, d: f64| c.get(k).and_then(Value::as_f64).unwrap_or(d);
    // Newer transformers versions move the rotary settings into `rope_parameters`.
    let rope = c.get("rope_parameters");
    let rope_f = |k: &str| rope.and_then(|r| r.get(k)).and_then(Value::as_f64);
    Ok(NeoxConfig {
        hidden_size,
        num_layers: usize_key(c, "num_hidden_layers", origin, None)?,
        num_heads,
        intermediate_size: c
            .get("intermediate_size")
            .and_then(Value::as_u64)
            .map_or(4 * hidden_size, |v| v as usize),
        vocab_size: usize_key(c, "vocab_size", origin, None)?,
        rotary_pct: rope_f("partial_rotary_factor").unwrap_or(f("rotary_pct", 0.25)),
        rotary_base: rope_f("rope_theta")
            .unwrap_or(f("rotary_emb_base", f("rope_theta", 10_000.0))),
        max_position_embeddings: c
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            .map_or(2048, |v| v as usize),
        eps: f("layer_norm_eps", 1e-5),
        parallel_residual: c
            .get("use_parallel_residual")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        attention_bias: c
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        tie_word_embeddings: c
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        eos_token_id: c.get("eos_token_id").and_then(Value::as_u64).unwrap_or(0) as u32,
    })
}

/// Splits the per-head fused [q | k | v] rows into three [d, d] (or [d]) tensors.
fn split_fused(t: &Tensor, heads: usize, d: usize) -> Result<[Tensor; 3]> {
    let hd = d / heads;
    let grouped = match t.rank() {
        2 => t.reshape((heads, 3, hd, d))?,
        _ => t.reshape((heads, 3, hd))?,
    };
    let part = |i: usize| -> Result<Tensor> {
        let p = grouped.narrow(1, i, 1)?.contiguous()?;
        Ok(match t.rank() {
            2 => p.reshape((d, d))?,
            _ => p.reshape(d)?,
        })
    };
    Ok([part(0)?, part(1)?, part(2)?])
}

/// Buffers a GPT-NeoX state dict may carry that are not weights.
pub fn is_buffer(name: &str) -> bool {
    name.ends_with(".attention.bias")
        || name.ends_with(".attention.masked_bias")
        || name.ends_with("rotary_emb.inv_freq")
}

pub fn read(raw: &mut RawCheckpoint) -> Result<NeoxSource> {
    let cfg = config(&raw.config, &raw.origin)?;
    if !raw.tensors.contains_key("gpt_neox.embed_in.weight") {
        let example = raw.tensors.keys().next().cloned().unwrap_or_default();
        bail!(
            "{}: not a transformers GPT-NeoX checkpoint: tensor `gpt_neox.embed_in.weight` is missing (found e.g. `{example}`)",
            raw.origin
        )
    }
    let (d, m, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let embed_in = raw.take("gpt_neox.embed_in.weight", &[v, d])?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("gpt_neox.layers.{i}");
        let ln1 = raw.take_norm(&format!("{p}.input_layernorm"), d)?;
        let ln2 = raw.take_norm(&format!("{p}.post_attention_layernorm"), d)?;
        let qkv_w = raw.take(
            &format!("{p}.attention.query_key_value.weight"),
            &[3 * d, d],
        )?;
        // transformers' `attention_bias: false` leaves out the attention's biases.
        let attn_bias = cfg.attention_bias;
        let qkv_b = if attn_bias {
            Some(raw.take(&format!("{p}.attention.query_key_value.bias"), &[3 * d])?)
        } else {
            None
        };
        let [qw, kw, vw] = split_fused(&qkv_w, cfg.num_heads, d)?;
        let [qb, kb, vb] = match &qkv_b {
            Some(b) => split_fused(b, cfg.num_heads, d)?.map(Some),
            None => [None, None, None],
        };
        let mut dense = |n: &str, out: usize, inp: usize, bias: bool| {
            raw.take_dense(&format!("{p}.{n}"), out, inp, bias)
        };
        layers.push(SourceLayer {
            ln1,
            query: Dense {
                weight: qw,
                bias: qb,
            },
            key: Dense {
                weight: kw,
                bias: kb,
            },
            value: Dense {
                weight: vw,
                bias: vb,
            },
            dense: dense("attention.dense", d, d, attn_bias)?,
            ln2,
            fc1: dense("mlp.dense_h_to_4h", m, d, true)?,
            fc2: dense("mlp.dense_4h_to_h", d, m, true)?,
        });
    }
    let final_norm = Norm {
        weight: raw.take("gpt_neox.final_layer_norm.weight", &[d])?,
        bias: raw.take("gpt_neox.final_layer_norm.bias", &[d])?,
    };
    let embed_out = if raw.tensors.contains_key("embed_out.weight") || !cfg.tie_word_embeddings {
        Some(raw.take("embed_out.weight", &[v, d])?)
    } else {
        None
    };
    Ok(NeoxSource {
        body: SourceBody {
            num_heads: cfg.num_heads,
            eps: cfg.eps,
            layers,
        },
        cfg,
        embed_in,
        final_norm,
        embed_out,
    })
}

/// The longest window the source and the import are run on at once.
const MAX_WINDOW: usize = 2048;

/// The window `--recover-steps` trains on (random offsets into the calibration text).
const RECOVER_WINDOW: usize = 128;

/// Eval windows the recovery's held-out loss is measured on (the report uses them all).
const RECOVER_EVAL_WINDOWS: usize = 8;

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
    let ids = fidelity::tokenize(tok, &text.text)?;
    if ids.len() < 2 {
        bail!("{flag} {}: fewer than 2 tokens", text.source);
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!(
            "{flag} {}: token id {bad} is outside the source's vocabulary ({vocab}): does {} belong to this model?",
            text.source,
            tok.display()
        );
    }
    let info = DataInfo {
        source: text.source,
        shipped: text.shipped,
        items: ids.len(),
        unit: Unit::Tokens,
        note: None,
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
    let recovery = Recovery::from_args(a)?;
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
        let h = layer_norm(h, &src.final_norm, cfg.eps)?.squeeze(0)?;
        Ok(h.matmul(&src.embed_out.as_ref().unwrap_or(&src.embed_in).t()?)?)
    };
    let stack = Stack {
        num_heads: cfg.num_heads,
        eps: cfg.eps,
        mixing: Mixing::Causal(&rotary),
        parallel: cfg.parallel_residual,
    };
    // Texts longer than the context run as consecutive windows, each from position 0.
    let window = max.min(MAX_WINDOW);

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
            let out_w = src.embed_out.as_ref().unwrap_or(&src.embed_in);
            let teacher = |ids: &Tensor| -> tokenformer::Result<Targets> {
                let (b, t) = ids.dims2()?;
                let x = src
                    .embed_in
                    .index_select(&ids.flatten_all()?, 0)?
                    .reshape((b, t, d))?;
                let (h, hidden) = stack.run_hidden(&src.body.layers, &x)?;
                let h = layer_norm(&h, &src.final_norm, cfg.eps)?.reshape((b * t, d))?;
                Ok(Targets {
                    logits: h.matmul(&out_w.t()?)?,
                    hidden,
                })
            };
            let seq_len = RECOVER_WINDOW.min(window);
            let mut windows = TextWindows::new(calib_ids.clone(), seq_len);
            let eval = eval_ids
                .chunks(windows.len())
                .filter(|w| w.len() >= 2)
                .take(RECOVER_EVAL_WINDOWS)
                .map(|w| {
                    let input = Tensor::new(w, &dev)?.unsqueeze(0)?;
                    Ok(DistillBatch {
                        targets: teacher(&input)?,
                        input,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let student = TrainableLm::new(&config, &tensors, DType::F32, &dev)?;
            let b = rec.batch_size;
            let seq_len = windows.len();
            let (model, log) = recover::run(
                rec,
                seq_len,
                student,
                value_update_scales(&stack, imported, &map, &fit_inputs)?,
                folder.path(),
                "tokens",
                || {
                    windows
                        .next(b)
                        .map_err(|e| tokenformer::Error::input(format!("{e:#}")))
                },
                teacher,
                &eval,
            )?;
            tensors = model.tensors();
            Some((rec, log, seq_len))
        }
        None => None,
    };
    folder.write_config(&config)?;
    folder.write_weights(&tensors, tokenformer::checkpoint::DEFAULT_SHARD_BYTES)?;
    folder.copy_tokenizer(tok)?;

    // The written folder, loaded as any user would, against the source on the eval text.
    let model = loader::load_lm(&folder.files()?, &dev)?;
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
    for w in eval_ids.chunks(window) {
        let x = embed(w)?;
        let (h, traces) = stack.run(&src.body.layers, &x)?;
        check.add(&traces)?;
        let src_logits = source_logits(&h)?;
        let imp_logits = model
            .forward(&Tensor::new(w, &dev)?.unsqueeze(0)?, None)?
            .squeeze(0)?;
        agreement.add(&src_logits, &imp_logits, Some(&w[1..]))?;
        let next = Some(&w[1..]);
        let before = match &before_blocks {
            Some(blocks) => {
                let before = source_logits(&stack.run(blocks, &x)?.0)?;
                before_agreement.add(&src_logits, &before, next)?;
                before_paired.add(&src_logits, &before, &imp_logits)?;
                Some(before)
            }
            None => None,
        };
        if let Some(fc) = &mut fit_check {
            let fitted_logits = before.as_ref().unwrap_or(&imp_logits);
            fc.add(
                &stack,
                &x,
                &traces,
                &src_logits,
                fitted_logits,
                source_logits,
                next,
            )?;
        }
    }
    let recovery = recovered.map(|(rec, log, seq_len)| {
        RecoveryReport::new(
            rec,
            &log,
            Some(seq_len),
            before_agreement.finish(Unit::Tokens),
            before_paired.finish(),
        )
    });
    let (layer_fit, fit) = fit_check.map(|fc| fc.finish(Unit::Tokens)).unzip();
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
        layers: check.finish(imported, cfg.eps, layer_fit.as_deref()),
        end_to_end: agreement.finish(Unit::Tokens),
        copied,
        ignored_buffers: buffers,
        not_representable: not_rep,
        fit,
        recovery,
    };
    let residual = if cfg.parallel_residual {
        "The parallel residual (x + attn(LN x) + mlp(LN x)) is kept: config `parallel_residual`."
    } else {
        "The sequential residual is kept."
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
            "TokenFormer LM imported from GPT-NeoX ({} layers, d {})",
            cfg.num_layers, d
        ),
        pipeline: "text-generation",
        model: format!(
            "A TokenFormer language model initialised from the GPT-NeoX checkpoint `{}` by `tokenformer-convert import --from gpt-neox` (paper: https://arxiv.org/abs/2410.23168). Pattention tokens: {} qkv / {} proj / {} ffn, √n constant {}. Embeddings, final norm and the untied output matrix are copied unchanged. {residual}",
            a.input, config.qkv_tokens, config.proj_tokens, config.ffn_tokens, map.scale_tokens
        ) + &fitted_note,
    };
    finish(&a.input, folder, &report, card)
}
