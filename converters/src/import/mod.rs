//! `tokenformer-convert import`: a pre-trained Transformer (Hugging Face
//! GPT-NeoX/Pythia or ViT, safetensors or .bin, with `config.json`) → a
//! TokenFormer of the same width, depth and heads, as the paper's
//! "initialise a TokenFormer from a pre-trained Transformer" suggests
//! (<https://arxiv.org/abs/2410.23168>, Sections 3 and 4).
//!
//! Embeddings, patch embedding, class token, position embedding, final norms
//! and output heads are copied as they are. Every linear layer becomes a
//! Pattention layer by the mapping documented on [`mapping::Mapping`]; the MLP uses the
//! key-value-memory reading of Geva et al. 2021 (<https://arxiv.org/abs/2012.14913>):
//! keys = rows of W_in, values = columns of W_out. The tool runs the source
//! model (a plain candle forward, [`source`]) and the import on a probe
//! input and reports per-layer and end-to-end fidelity ([`fidelity`]). One
//! importer per source family: [`gpt_neox`], [`vit`].

mod args;
mod fidelity;
mod gpt_neox;
mod mapping;
mod source;
mod vit;

use std::path::Path;

use anyhow::Result;
use candle_core::{Module, Tensor};
use serde_json::json;
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::Tensors;
use tokenformer::models::tokenformer::PATTENTIONS;

pub use args::ImportArgs;
use args::SourceFamily;
use fidelity::{relative_error, LayerFidelity, Report, REPORT_FILE};
use mapping::{fit_input_scale, fold_norm, Mapping};
use source::{locate_input, LayerTrace, RawCheckpoint, SourceBody, SourceLayer};

use crate::output::{check_not_input, ModelFolder};

pub fn run(a: ImportArgs) -> Result<()> {
    let dir = locate_input(&a.input)?;
    check_not_input(&a.out.out, &dir)?;
    let mut raw = RawCheckpoint::read(&dir)?;
    match a.from {
        SourceFamily::GptNeox => gpt_neox::import(&a, &mut raw),
        SourceFamily::Vit => vit::import(&a, &mut raw),
    }
}

/// Source layer `i` as its five Pattention layers (q, k, v, proj, mlp) into
/// `tensors` under their canonical names; returns their fidelity on the probe's
/// activations (`calib` only fits the output projection's input scale).
fn import_layer(
    i: usize,
    l: &SourceLayer,
    map: &Mapping,
    calib: &LayerTrace,
    probe: &LayerTrace,
    tensors: &mut Tensors,
) -> Result<LayerFidelity> {
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
        relative_error(&map.pattention(kv).forward(x)?, y)
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
    for (name, (keys, values)) in PATTENTIONS.into_iter().zip([q, k, v, o, f]) {
        tensors.insert(format!("{p}.{name}.key_param_tokens"), keys);
        tensors.insert(format!("{p}.{name}.value_param_tokens"), values);
    }
    Ok(fidelity)
}

/// Every layer of `body` through [`import_layer`].
fn import_layers(
    body: &SourceBody,
    map: &Mapping,
    calib: &[LayerTrace],
    probe: &[LayerTrace],
    tensors: &mut Tensors,
) -> Result<Vec<LayerFidelity>> {
    let layers = body.layers.iter().zip(calib.iter().zip(probe));
    layers
        .enumerate()
        .map(|(i, (l, (c, p)))| import_layer(i, l, map, c, p, tensors))
        .collect()
}

/// An importer's own words in the model card.
struct CardText {
    title: String,
    pipeline: &'static str,
    /// The "Model" section.
    model: String,
    /// Appended to the fidelity table.
    fidelity_note: &'static str,
}

/// What both imports end with: the report printed and written, the card (model,
/// mapping, fidelity, what is not representable) written, and the folder moved into
/// place.
fn finish(a: &ImportArgs, folder: ModelFolder, report: &Report, text: CardText) -> Result<()> {
    report.print();
    folder.write_json(REPORT_FILE, report)?;
    let mut card = ModelCard::new(text.title, text.pipeline);
    if !Path::new(&a.input).exists() {
        card.set("base_model", json!(a.input));
    }
    card.section("Model", text.model);
    card.section("Mapping", report.mapping.describe());
    card.section("Fidelity", report.markdown() + text.fidelity_note);
    let items: Vec<String> = report
        .not_representable
        .iter()
        .map(|s| format!("- {s}"))
        .collect();
    card.section("Not representable", items.join("\n"));
    folder.finish_and_say(&card)
}
