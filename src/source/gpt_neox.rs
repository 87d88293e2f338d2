//! Name map of Hugging Face transformers' GPT-NeoX / Pythia checkpoints
//! (`modeling_gpt_neox.py`, `GPTNeoXForCausalLM`): `gpt_neox.embed_in`,
//! `gpt_neox.layers.{i}.{input_layernorm, attention.query_key_value,
//! attention.dense, post_attention_layernorm, mlp.dense_h_to_4h,
//! mlp.dense_4h_to_h}`, `gpt_neox.final_layer_norm`, `embed_out`.
//! The fused `query_key_value` rows are grouped per head as [q | k | v]
//! (the module views its output as [.., heads, 3·head_dim]). [`NeoxSource`]
//! runs it: embeddings, the layer stack ([`super::Stack`], causal with rotary
//! positions, parallel residual for Pythia) and the logits.

use candle_core::{Device, Tensor};
use serde_json::Value;

use super::{
    layer_norm, usize_key, Dense, Mixing, Norm, RawCheckpoint, SourceBody, SourceLayer, Stack,
};
use crate::error::Result;
use crate::models::tokenformer::Rotary;
use crate::train::distill::Targets;

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

/// The longest window the source is run on at once.
pub const MAX_WINDOW: usize = 2048;

impl NeoxSource {
    /// The rotary embedding of the attention (as many positions as the source has).
    pub fn rotary(&self, dev: &Device) -> Result<Rotary> {
        let c = &self.cfg;
        let rotary_dims = ((c.hidden_size / c.num_heads) as f64 * c.rotary_pct) as usize;
        if !rotary_dims.is_multiple_of(2) {
            bail!(
                "rotary_pct {} gives an odd number of rotary dims ({rotary_dims})",
                c.rotary_pct
            );
        }
        Ok(Rotary::new(
            rotary_dims,
            c.rotary_base,
            c.max_position_embeddings,
            dev,
        )?)
    }

    /// How the layers run: causal with `rotary`, the source's residual.
    pub fn stack<'a>(&self, rotary: &'a Rotary) -> Stack<'a> {
        Stack {
            num_heads: self.cfg.num_heads,
            eps: self.cfg.eps,
            mixing: Mixing::Causal(rotary),
            parallel: self.cfg.parallel_residual,
        }
    }

    /// The window texts run in: the context, at most [`MAX_WINDOW`].
    pub fn window(&self) -> usize {
        self.cfg.max_position_embeddings.min(MAX_WINDOW)
    }

    /// The embedded ids [b, t] → [b, t, d].
    pub fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        self.embed_in
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.hidden_size))
    }

    /// Logits [b·t, vocab] of the last layer's output h [b, t, d].
    pub fn logits(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = h.dims3()?;
        let h = layer_norm(h, &self.final_norm, self.cfg.eps)?.reshape((b * t, d))?;
        h.matmul(&self.embed_out.as_ref().unwrap_or(&self.embed_in).t()?)
    }

    /// What distillation matches on ids [b, t]: the logits and each layer's output.
    pub fn targets(&self, stack: &Stack, ids: &Tensor) -> Result<Targets> {
        let (h, hidden) = stack.run_hidden(&self.body.layers, &self.embed(ids)?)?;
        Ok(Targets {
            logits: self.logits(&h)?,
            hidden,
        })
    }
}
