//! `tokenformer-convert import` and `merge` end to end on checkpoints the test
//! writes itself in the Hugging Face transformers / timm layouts (random
//! weights), plus the shared tiny fixtures for `merge`. Layouts follow the
//! transformers modeling files (`modeling_gpt_neox.py`, `modeling_vit.py`) and
//! timm's `vision_transformer.py`; the TokenFormer side is
//! <https://arxiv.org/abs/2410.23168>.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor, D};
use common::{
    bits, config_u64s, fails, fixture_pixels, lm_fixture, load_lm, load_vit, locate, max_diff,
    merge_args, official_args, ok, read_json, s, values, vit_dir,
};
use serde_json::{json, Value};
use tokenformer::pattention::{Activation, Pattention};

/// A small deterministic normal generator (xorshift + Box-Muller).
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    fn tensor(&mut self, shape: &[usize], mean: f32, std: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| mean + std * self.normal()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn write_model(dir: &Path, config: &Value, tensors: &HashMap<String, Tensor>) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    candle_core::safetensors::save(tensors, dir.join("model.safetensors")).unwrap();
}

fn load(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

/// `import --from <from> --input <input> --out <out>`.
fn import_args<'a>(from: &'a str, input: &'a Path, out: &'a Path) -> Vec<&'a str> {
    vec![
        "import",
        "--from",
        from,
        "--input",
        s(input),
        "--out",
        s(out),
    ]
}

/// Relative error ‖a − b‖ / ‖b‖, computed in f64.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let f64s = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
    let norm = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
            .sqrt()
    };
    let (a, b) = (f64s(a), f64s(b));
    norm(&(&a - &b).unwrap()) / norm(&b)
}

// ---------------------------------------------------------------- GPT-NeoX

struct Neox {
    d: usize,
    heads: usize,
    layers: usize,
    m: usize,
    vocab: usize,
    parallel: bool,
}

/// The usual tiny GPT-NeoX; tests change a field or two with `..TINY_NEOX`.
const TINY_NEOX: Neox = Neox {
    d: 16,
    heads: 2,
    layers: 2,
    m: 48,
    vocab: 96,
    parallel: true,
};

fn neox_config(n: &Neox) -> Value {
    json!({
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
        "hidden_size": n.d, "num_hidden_layers": n.layers, "num_attention_heads": n.heads,
        "intermediate_size": n.m, "vocab_size": n.vocab, "rotary_pct": 0.5, "rotary_emb_base": 10000,
        "max_position_embeddings": 64, "layer_norm_eps": 1e-5, "use_parallel_residual": n.parallel,
        "tie_word_embeddings": false, "hidden_act": "gelu", "eos_token_id": 0
    })
}

/// Random weights in the transformers GPT-NeoX layout; `mlp_in_bias` false zeroes
/// the MLP pre-activation bias (the one thing the mapping cannot represent).
fn neox_tensors(n: &Neox, seed: u64, mlp_in_bias: bool) -> HashMap<String, Tensor> {
    let mut r = Rng(seed);
    let (d, m) = (n.d, n.m);
    let mut t = HashMap::new();
    t.insert(
        "gpt_neox.embed_in.weight".into(),
        r.tensor(&[n.vocab, d], 0.0, 1.0),
    );
    for i in 0..n.layers {
        let p = format!("gpt_neox.layers.{i}");
        for ln in ["input_layernorm", "post_attention_layernorm"] {
            t.insert(format!("{p}.{ln}.weight"), r.tensor(&[d], 1.0, 0.2));
            let b = if ln == "post_attention_layernorm" && !mlp_in_bias {
                0.0
            } else {
                0.1
            };
            t.insert(format!("{p}.{ln}.bias"), r.tensor(&[d], 0.0, b));
        }
        let s = 1.0 / (d as f32).sqrt();
        t.insert(
            format!("{p}.attention.query_key_value.weight"),
            r.tensor(&[3 * d, d], 0.0, 2.0 * s),
        );
        t.insert(
            format!("{p}.attention.query_key_value.bias"),
            r.tensor(&[3 * d], 0.0, 0.1),
        );
        t.insert(
            format!("{p}.attention.dense.weight"),
            r.tensor(&[d, d], 0.0, s),
        );
        t.insert(
            format!("{p}.attention.dense.bias"),
            r.tensor(&[d], 0.0, 0.1),
        );
        t.insert(
            format!("{p}.mlp.dense_h_to_4h.weight"),
            r.tensor(&[m, d], 0.0, s),
        );
        t.insert(
            format!("{p}.mlp.dense_h_to_4h.bias"),
            r.tensor(&[m], 0.0, if mlp_in_bias { 0.1 } else { 0.0 }),
        );
        t.insert(
            format!("{p}.mlp.dense_4h_to_h.weight"),
            r.tensor(&[d, m], 0.0, 1.0 / (m as f32).sqrt()),
        );
        t.insert(
            format!("{p}.mlp.dense_4h_to_h.bias"),
            r.tensor(&[d], 0.0, 0.1),
        );
        // A buffer real checkpoints carry; it is not a weight.
        t.insert(
            format!("{p}.attention.rotary_emb.inv_freq"),
            r.tensor(&[2], 0.0, 1.0),
        );
    }
    t.insert(
        "gpt_neox.final_layer_norm.weight".into(),
        r.tensor(&[d], 1.0, 0.2),
    );
    t.insert(
        "gpt_neox.final_layer_norm.bias".into(),
        r.tensor(&[d], 0.0, 0.1),
    );
    t.insert("embed_out.weight".into(), r.tensor(&[n.vocab, d], 0.0, 0.5));
    t
}

fn standardise(x: &Tensor, eps: f64) -> Tensor {
    let mean = x.mean_keepdim(D::Minus1).unwrap();
    let c = x.broadcast_sub(&mean).unwrap();
    let var = c.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    c.broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
        .unwrap()
}

fn affine(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    x.broadcast_mul(w).unwrap().broadcast_add(b).unwrap()
}

fn lin(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    x.matmul(&w.t().unwrap()).unwrap().broadcast_add(b).unwrap()
}

/// Rows of head h's part j (0 q, 1 k, 2 v) of the fused per-head [q|k|v] tensor.
fn neox_part(fused: &Tensor, heads: usize, j: usize) -> Tensor {
    let hd = fused.dim(0).unwrap() / 3 / heads;
    let rows: Vec<Tensor> = (0..heads)
        .map(|h| fused.narrow(0, h * 3 * hd + j * hd, hd).unwrap())
        .collect();
    Tensor::cat(&rows, 0).unwrap()
}

/// rotate-half rotary on the first `r` dims of x [t, hd], positions 0..t.
fn rotary(x: &Tensor, r: usize) -> Tensor {
    let (t, hd) = x.dims2().unwrap();
    let v = x.to_vec2::<f32>().unwrap();
    let mut out = v.clone();
    for (p, row) in v.iter().enumerate() {
        for i in 0..r / 2 {
            let theta = p as f32 * 10000f32.powf(-((2 * i) as f32) / r as f32);
            let (c, s) = (theta.cos(), theta.sin());
            let (a, b) = (row[i], row[i + r / 2]);
            out[p][i] = a * c - b * s;
            out[p][i + r / 2] = b * c + a * s;
        }
    }
    Tensor::new(out, &Device::Cpu)
        .unwrap()
        .reshape((t, hd))
        .unwrap()
}

/// An independent GPT-NeoX forward (one sequence): logits [t, vocab].
fn neox_logits(n: &Neox, w: &HashMap<String, Tensor>, ids: &[u32], parallel: bool) -> Tensor {
    let dev = Device::Cpu;
    let (d, hd) = (n.d, n.d / n.heads);
    let mut x = w["gpt_neox.embed_in.weight"]
        .index_select(&Tensor::new(ids, &dev).unwrap(), 0)
        .unwrap();
    let t = ids.len();
    for i in 0..n.layers {
        let g = |s: &str| &w[&format!("gpt_neox.layers.{i}.{s}")];
        let h1 = affine(
            &standardise(&x, 1e-5),
            g("input_layernorm.weight"),
            g("input_layernorm.bias"),
        );
        let fw = g("attention.query_key_value.weight");
        let fb = g("attention.query_key_value.bias").unsqueeze(1).unwrap();
        let proj = |j: usize| {
            lin(
                &h1,
                &neox_part(fw, n.heads, j),
                &neox_part(&fb, n.heads, j).squeeze(1).unwrap(),
            )
        };
        let (q, k, v) = (proj(0), proj(1), proj(2));
        let mut heads = vec![];
        for h in 0..n.heads {
            let q = rotary(&q.narrow(1, h * hd, hd).unwrap(), hd / 2);
            let k = rotary(&k.narrow(1, h * hd, hd).unwrap(), hd / 2);
            let s = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
            let mask: Vec<f32> = (0..t * t)
                .map(|e| {
                    if e % t > e / t {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
                .collect();
            let s = s
                .broadcast_add(&Tensor::from_vec(mask, (t, t), &dev).unwrap())
                .unwrap();
            let p = candle_nn::ops::softmax_last_dim(&s).unwrap();
            heads.push(p.matmul(&v.narrow(1, h * hd, hd).unwrap()).unwrap());
        }
        let a = lin(
            &Tensor::cat(&heads, 1).unwrap(),
            g("attention.dense.weight"),
            g("attention.dense.bias"),
        );
        let mid = if parallel {
            x.clone()
        } else {
            (&x + &a).unwrap()
        };
        let h2 = affine(
            &standardise(&mid, 1e-5),
            g("post_attention_layernorm.weight"),
            g("post_attention_layernorm.bias"),
        );
        let f = lin(
            &h2,
            g("mlp.dense_h_to_4h.weight"),
            g("mlp.dense_h_to_4h.bias"),
        )
        .gelu_erf()
        .unwrap();
        let f = lin(
            &f,
            g("mlp.dense_4h_to_h.weight"),
            g("mlp.dense_4h_to_h.bias"),
        );
        x = ((x + a).unwrap() + f).unwrap();
    }
    let _ = d;
    let h = affine(
        &standardise(&x, 1e-5),
        &w["gpt_neox.final_layer_norm.weight"],
        &w["gpt_neox.final_layer_norm.bias"],
    );
    h.matmul(&w["embed_out.weight"].t().unwrap()).unwrap()
}

fn perplexity(logits: &Tensor, ids: &[u32]) -> f64 {
    let lp = candle_nn::ops::log_softmax(logits, D::Minus1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let nll: f64 = (0..ids.len() - 1)
        .map(|t| -(lp[t][ids[t + 1] as usize] as f64))
        .sum();
    (nll / (ids.len() - 1) as f64).exp()
}

fn pattention(w: &HashMap<String, Tensor>, prefix: &str, scale: usize) -> Pattention {
    Pattention::from_tensors(
        w[&format!("{prefix}.key_param_tokens")].clone(),
        w[&format!("{prefix}.value_param_tokens")].clone(),
        Activation::L2NormGelu,
        Some(scale),
    )
    .unwrap()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1e-12)
}

#[test]
fn import_gpt_neox_copies_maps_and_reports_honest_fidelity() {
    let n = TINY_NEOX;
    let root = tmp();
    let src = root.path().join("pythia-tiny");
    let w = neox_tensors(&n, 7, true);
    write_model(&src, &neox_config(&n), &w);
    let out = root.path().join("imported");
    let stdout = ok(&import_args("gpt-neox", &src, &out));
    assert!(stdout.contains("perplexity on the probe"), "{stdout}");

    // Config: same width, depth, heads, vocabulary, rotary; untied head kept.
    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["architecture"], "tokenformer-lm");
    assert_eq!(
        config_u64s(&cfg, ["hidden_size", "num_layers", "num_heads"]),
        [Some(16), Some(2), Some(2)]
    );
    assert_eq!(cfg["vocab_size"], 96);
    assert_eq!(cfg["rotary_pct"], 0.5);
    assert_eq!(cfg["tie_word_embeddings"], false);
    assert_eq!(
        config_u64s(&cfg, ["qkv_tokens", "proj_tokens", "ffn_tokens"]),
        [Some(64), Some(64), Some(48 + 64)]
    );
    let scale = cfg["pattention_scale_tokens"]["qkv"].as_u64().unwrap() as usize;

    // Copied tensors are bit-identical.
    let o = load(&out);
    for (from, to) in [
        ("gpt_neox.embed_in.weight", "word_embeddings.weight"),
        ("gpt_neox.final_layer_norm.weight", "final_norm.weight"),
        ("gpt_neox.final_layer_norm.bias", "final_norm.bias"),
        ("embed_out.weight", "final_linear.weight"),
    ] {
        assert_eq!(bits(&w[from]), bits(&o[to]), "{to} differs from {from}");
    }
    assert_eq!(o["layers.1.mlp.key_param_tokens"].dims(), &[112, 16]);
    assert_eq!(
        o["layers.0.attention.query.value_param_tokens"].dims(),
        &[64, 16]
    );

    // The reported numbers are what a direct computation gives.
    let report = read_json(&out.join("import_report.json"));
    let ids: Vec<u32> = serde_json::from_value(report["probe_ids"].clone()).unwrap();
    let x = w["gpt_neox.embed_in.weight"]
        .index_select(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap(), 0)
        .unwrap();
    let u = standardise(&x, 1e-5);
    let g = |s: &str| &w[&format!("gpt_neox.layers.0.{s}")];
    let h1 = affine(&u, g("input_layernorm.weight"), g("input_layernorm.bias"));
    let fb = g("attention.query_key_value.bias").unsqueeze(1).unwrap();
    for (j, name) in [(0, "query"), (1, "key"), (2, "value")] {
        let want = lin(
            &h1,
            &neox_part(g("attention.query_key_value.weight"), 2, j),
            &neox_part(&fb, 2, j).squeeze(1).unwrap(),
        );
        let got = pattention(&o, &format!("layers.0.attention.{name}"), scale)
            .forward(&u)
            .unwrap();
        let e = rel(&got, &want);
        let reported = report["layers"][0][name].as_f64().unwrap();
        assert!(
            close(reported, e, 1e-3),
            "{name}: reported {reported}, computed {e}"
        );
        // The anchor/bias mapping of a linear layer on LayerNorm outputs is exact up to f32 and κ_b².
        assert!(e < 1e-4, "{name} relative error {e}");
    }
    // Layer 0's MLP sees LN(x) of the embeddings too (parallel residual).
    let h2 = affine(
        &u,
        g("post_attention_layernorm.weight"),
        g("post_attention_layernorm.bias"),
    );
    let want = lin(
        &lin(
            &h2,
            g("mlp.dense_h_to_4h.weight"),
            g("mlp.dense_h_to_4h.bias"),
        )
        .gelu_erf()
        .unwrap(),
        g("mlp.dense_4h_to_h.weight"),
        g("mlp.dense_4h_to_h.bias"),
    );
    let e = rel(
        &pattention(&o, "layers.0.mlp", scale).forward(&u).unwrap(),
        &want,
    );
    let reported = report["layers"][0]["mlp"].as_f64().unwrap();
    assert!(
        close(reported, e, 1e-3),
        "mlp: reported {reported}, computed {e}"
    );
    assert!(
        e > 1e-3,
        "the dropped pre-activation bias must show in the MLP error, got {e}"
    );

    // End to end: the source (parallel and sequential) and the import.
    let e2e = &report["end_to_end"];
    let src_ppl = perplexity(&neox_logits(&n, &w, &ids, true), &ids);
    let seq_ppl = perplexity(&neox_logits(&n, &w, &ids, false), &ids);
    assert!(
        close(e2e["source_perplexity"].as_f64().unwrap(), src_ppl, 1e-4),
        "{e2e} vs {src_ppl}"
    );
    assert!(
        close(
            e2e["source_sequential_perplexity"].as_f64().unwrap(),
            seq_ppl,
            1e-4
        ),
        "{e2e} vs {seq_ppl}"
    );
    let imp = tokenformer::scoring::score_ids(&load_lm(&out), &ids)
        .unwrap()
        .perplexity;
    assert!(close(e2e["import_perplexity"].as_f64().unwrap(), imp, 1e-5));
    assert_eq!(report["parallel_residual_made_sequential"], true);

    // The model card carries the numbers.
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(
        card.contains("use_parallel_residual")
            && card.contains(&format!(
                "{:.4}",
                e2e["import_perplexity"].as_f64().unwrap()
            ))
    );
}

#[test]
fn import_gpt_neox_without_mlp_input_bias_is_near_exact() {
    // Sequential residual and no pre-activation bias: only the output projection's
    // input scale is approximate, so the import tracks the source closely.
    let n = Neox {
        parallel: false,
        ..TINY_NEOX
    };
    let root = tmp();
    let src = root.path().join("neox");
    write_model(&src, &neox_config(&n), &neox_tensors(&n, 11, false));
    let out = root.path().join("imp");
    ok(&import_args("gpt-neox", &src, &out));
    let report = read_json(&out.join("import_report.json"));
    for l in report["layers"].as_array().unwrap() {
        for k in ["query", "key", "value", "mlp"] {
            assert!(l[k].as_f64().unwrap() < 1e-4, "{k}: {l}");
        }
        assert_eq!(l["dropped_mlp_bias_norm"], 0.0);
    }
    assert!(report["end_to_end"]
        .get("source_sequential_perplexity")
        .is_none());
}

#[test]
fn import_bad_inputs_fail_clearly_and_write_nothing() {
    let n = Neox {
        layers: 1,
        m: 32,
        vocab: 64,
        ..TINY_NEOX
    };
    let root = tmp();
    let out = root.path().join("out");
    let import_fails = |src: &Path| fails(&import_args("gpt-neox", src, &out));

    let mut w = neox_tensors(&n, 3, true);
    w.remove("gpt_neox.layers.0.mlp.dense_4h_to_h.weight");
    let missing = root.path().join("missing");
    write_model(&missing, &neox_config(&n), &w);
    let e = import_fails(&missing);
    assert!(
        e.contains("gpt_neox.layers.0.mlp.dense_4h_to_h.weight"),
        "{e}"
    );

    let mut cfg = neox_config(&n);
    cfg["hidden_size"] = json!(32);
    let wide = root.path().join("wide");
    write_model(&wide, &cfg, &neox_tensors(&n, 3, true));
    let e = import_fails(&wide);
    assert!(
        e.contains("gpt_neox.embed_in.weight") && e.contains("shape"),
        "{e}"
    );

    let other = root.path().join("other");
    let mut t = HashMap::new();
    t.insert(
        "transformer.wte.weight".to_string(),
        Tensor::zeros((4, 16), DType::F32, &Device::Cpu).unwrap(),
    );
    write_model(&other, &neox_config(&n), &t);
    let e = import_fails(&other);
    assert!(e.contains("not a transformers GPT-NeoX checkpoint"), "{e}");

    let mut cfg = neox_config(&n);
    cfg["model_type"] = json!("llama");
    let llama = root.path().join("llama");
    write_model(&llama, &cfg, &neox_tensors(&n, 3, true));
    assert!(import_fails(&llama).contains("llama"));

    let empty = root.path().join("nothing");
    std::fs::create_dir_all(&empty).unwrap();
    assert!(import_fails(&empty).contains("config.json"));
    assert!(!out.exists(), "no output may be written on failure");
    let leftovers: Vec<PathBuf> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

// ---------------------------------------------------------------- ViT

/// Random weights in the transformers ViT layout (d 16, 2 heads, 2 layers, 16² images, patch 8).
fn vit_hf_tensors(seed: u64) -> HashMap<String, Tensor> {
    let mut r = Rng(seed);
    let (d, m, p, classes) = (16, 32, 8, 5);
    let s = 1.0 / (d as f32).sqrt();
    let mut t = HashMap::new();
    t.insert(
        "vit.embeddings.cls_token".into(),
        r.tensor(&[1, 1, d], 0.0, 1.0),
    );
    t.insert(
        "vit.embeddings.position_embeddings".into(),
        r.tensor(&[1, 5, d], 0.0, 0.5),
    );
    t.insert(
        "vit.embeddings.patch_embeddings.projection.weight".into(),
        r.tensor(&[d, 3, p, p], 0.0, 0.1),
    );
    t.insert(
        "vit.embeddings.patch_embeddings.projection.bias".into(),
        r.tensor(&[d], 0.0, 0.1),
    );
    for i in 0..2 {
        let q = format!("vit.encoder.layer.{i}");
        for ln in ["layernorm_before", "layernorm_after"] {
            t.insert(format!("{q}.{ln}.weight"), r.tensor(&[d], 1.0, 0.2));
            t.insert(format!("{q}.{ln}.bias"), r.tensor(&[d], 0.0, 0.1));
        }
        for (n, o, inp) in [
            ("attention.attention.query", d, d),
            ("attention.attention.key", d, d),
            ("attention.attention.value", d, d),
            ("attention.output.dense", d, d),
            ("intermediate.dense", m, d),
            ("output.dense", d, m),
        ] {
            t.insert(format!("{q}.{n}.weight"), r.tensor(&[o, inp], 0.0, 1.5 * s));
            t.insert(format!("{q}.{n}.bias"), r.tensor(&[o], 0.0, 0.1));
        }
    }
    t.insert("vit.layernorm.weight".into(), r.tensor(&[d], 1.0, 0.2));
    t.insert("vit.layernorm.bias".into(), r.tensor(&[d], 0.0, 0.1));
    t.insert(
        "classifier.weight".into(),
        r.tensor(&[classes, d], 0.0, 1.0),
    );
    t.insert("classifier.bias".into(), r.tensor(&[classes], 0.0, 0.1));
    t
}

fn vit_hf_config() -> Value {
    json!({"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32, "hidden_act": "gelu",
           "layer_norm_eps": 1e-12, "image_size": 16, "patch_size": 8, "num_channels": 3, "qkv_bias": true,
           "id2label": {"0": "a", "1": "b", "2": "c", "3": "d", "4": "e"}})
}

/// The same weights in timm's layout (fused qkv rows [q | k | v], class-token pooling).
fn vit_timm_from_hf(hf: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let mut t = HashMap::new();
    let mut put = |to: &str, from: &str| {
        t.insert(to.to_string(), hf[from].clone());
    };
    put("cls_token", "vit.embeddings.cls_token");
    put("pos_embed", "vit.embeddings.position_embeddings");
    put(
        "patch_embed.proj.weight",
        "vit.embeddings.patch_embeddings.projection.weight",
    );
    put(
        "patch_embed.proj.bias",
        "vit.embeddings.patch_embeddings.projection.bias",
    );
    put("norm.weight", "vit.layernorm.weight");
    put("norm.bias", "vit.layernorm.bias");
    put("head.weight", "classifier.weight");
    put("head.bias", "classifier.bias");
    for i in 0..2 {
        let q = format!("vit.encoder.layer.{i}");
        for (to, from) in [
            ("norm1", "layernorm_before"),
            ("norm2", "layernorm_after"),
            ("attn.proj", "attention.output.dense"),
            ("mlp.fc1", "intermediate.dense"),
            ("mlp.fc2", "output.dense"),
        ] {
            for s in ["weight", "bias"] {
                put(&format!("blocks.{i}.{to}.{s}"), &format!("{q}.{from}.{s}"));
            }
        }
    }
    for i in 0..2 {
        let q = format!("vit.encoder.layer.{i}");
        for s in ["weight", "bias"] {
            let parts: Vec<Tensor> = ["query", "key", "value"]
                .iter()
                .map(|n| hf[&format!("{q}.attention.attention.{n}.{s}")].clone())
                .collect();
            t.insert(
                format!("blocks.{i}.attn.qkv.{s}"),
                Tensor::cat(&parts, 0).unwrap(),
            );
        }
    }
    t
}

/// The transformers ViT embeddings (patches, class token, positions): [b, 5, 16].
fn vit_hf_embed(w: &HashMap<String, Tensor>, pixels: &Tensor) -> Tensor {
    let x = pixels
        .conv2d(
            &w["vit.embeddings.patch_embeddings.projection.weight"],
            0,
            8,
            1,
            1,
        )
        .unwrap();
    let x = x
        .flatten_from(2)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .broadcast_add(&w["vit.embeddings.patch_embeddings.projection.bias"])
        .unwrap();
    let cls = w["vit.embeddings.cls_token"]
        .broadcast_as((pixels.dim(0).unwrap(), 1, 16))
        .unwrap();
    Tensor::cat(&[&cls, &x], 1)
        .unwrap()
        .broadcast_add(&w["vit.embeddings.position_embeddings"])
        .unwrap()
}

/// An independent ViT classifier forward (class-token pooling): logits [b, classes].
fn vit_hf_logits(w: &HashMap<String, Tensor>, pixels: &Tensor, eps: f64) -> Tensor {
    let (b, d, heads) = (pixels.dim(0).unwrap(), 16, 2);
    let hd = d / heads;
    let mut x = vit_hf_embed(w, pixels);
    for i in 0..2 {
        let g = |s: &str| &w[&format!("vit.encoder.layer.{i}.{s}")];
        let l = |x: &Tensor, n: &str| {
            x.broadcast_matmul(&g(&format!("{n}.weight")).t().unwrap())
                .unwrap()
                .broadcast_add(g(&format!("{n}.bias")))
                .unwrap()
        };
        let h = affine(
            &standardise(&x, eps),
            g("layernorm_before.weight"),
            g("layernorm_before.bias"),
        );
        let split = |y: Tensor| {
            y.reshape((b, 5, heads, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (
            split(l(&h, "attention.attention.query")),
            split(l(&h, "attention.attention.key")),
            split(l(&h, "attention.attention.value")),
        );
        let p = candle_nn::ops::softmax_last_dim(
            &(q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap(),
        )
        .unwrap();
        let o = p
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, 5, d))
            .unwrap();
        x = (&x + l(&o, "attention.output.dense")).unwrap();
        let h = affine(
            &standardise(&x, eps),
            g("layernorm_after.weight"),
            g("layernorm_after.bias"),
        );
        x = (&x
            + l(
                &l(&h, "intermediate.dense").gelu_erf().unwrap(),
                "output.dense",
            ))
        .unwrap();
    }
    let c = affine(
        &standardise(&x.narrow(1, 0, 1).unwrap().squeeze(1).unwrap(), eps),
        &w["vit.layernorm.weight"],
        &w["vit.layernorm.bias"],
    );
    lin(&c, &w["classifier.weight"], &w["classifier.bias"])
}

#[test]
fn import_vit_transformers_and_timm_layouts() {
    let root = tmp();
    let hf = root.path().join("vit-hf");
    let w = vit_hf_tensors(5);
    write_model(&hf, &vit_hf_config(), &w);
    let timm = root.path().join("vit-timm");
    let cfg = json!({"architecture": "vit_tiny_patch8_16", "num_classes": 5, "global_pool": "token", "model_args": {"num_heads": 2},
                     "pretrained_cfg": {"input_size": [3, 16, 16], "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "crop_pct": 0.9, "interpolation": "bicubic"}});
    write_model(&timm, &cfg, &vit_timm_from_hf(&w));
    let pixels = Rng(99).tensor(&[6, 3, 16, 16], 0.0, 1.0);
    let px = root.path().join("pixels.safetensors");
    candle_core::safetensors::save(
        &HashMap::from([("pixels".to_string(), pixels.clone())]),
        &px,
    )
    .unwrap();

    let (out_hf, out_timm) = (root.path().join("tf-hf"), root.path().join("tf-timm"));
    for (src, out) in [(&hf, &out_hf), (&timm, &out_timm)] {
        let mut args = import_args("vit", src, out);
        args.extend(["--probe-pixels", s(&px)]);
        ok(&args);
    }
    let cfg = read_json(&out_hf.join("config.json"));
    assert_eq!(cfg["architecture"], "tokenformer-vit");
    assert_eq!(
        config_u64s(&cfg, ["hidden_size", "num_layers", "num_heads"]),
        [Some(16), Some(2), Some(2)]
    );
    assert_eq!(
        config_u64s(&cfg, ["image_size", "patch_size", "num_classes"]),
        [Some(16), Some(8), Some(5)]
    );
    assert_eq!(cfg["pool"], "cls");
    assert_eq!(cfg["class_names"], json!(["a", "b", "c", "d", "e"]));
    let o = load(&out_hf);
    for (from, to) in [
        ("vit.embeddings.cls_token", "cls_token"),
        ("vit.embeddings.position_embeddings", "pos_embed"),
        (
            "vit.embeddings.patch_embeddings.projection.weight",
            "patch_embed.weight",
        ),
        (
            "vit.embeddings.patch_embeddings.projection.bias",
            "patch_embed.bias",
        ),
        ("vit.layernorm.weight", "final_norm.weight"),
        ("vit.layernorm.bias", "final_norm.bias"),
        ("classifier.weight", "head.weight"),
        ("classifier.bias", "head.bias"),
    ] {
        assert_eq!(bits(&w[from]), bits(&o[to]), "{to} differs from {from}");
    }
    // timm's fused qkv splits into the same layers: the same import (the fitted
    // output-projection scale may differ in the last bits: matmul blocking).
    let ot = load(&out_timm);
    assert_eq!(o.len(), ot.len());
    for (n, t) in &o {
        if n.contains("attention.proj.value") {
            assert!(rel(t, &ot[n]) < 1e-6, "{n}");
        } else {
            assert_eq!(
                bits(t),
                bits(&ot[n]),
                "{n} differs between the transformers and timm imports"
            );
        }
    }
    assert_eq!(read_json(&out_timm.join("config.json"))["crop_pct"], 0.9);

    // Reported numbers = direct computation.
    let report = read_json(&out_hf.join("import_report.json"));
    let scale = cfg["pattention_scale_tokens"]["qkv"].as_u64().unwrap() as usize;
    let u = standardise(&vit_hf_embed(&w, &pixels), 1e-12)
        .reshape((30, 16))
        .unwrap();
    let g = |s: &str| &w[&format!("vit.encoder.layer.0.{s}")];
    let h = affine(&u, g("layernorm_before.weight"), g("layernorm_before.bias"));
    let want = lin(
        &h,
        g("attention.attention.value.weight"),
        g("attention.attention.value.bias"),
    );
    let e = rel(
        &pattention(&o, "layers.0.attention.value", scale)
            .forward(&u)
            .unwrap(),
        &want,
    );
    assert!(
        close(report["layers"][0]["value"].as_f64().unwrap(), e, 1e-3),
        "{report} vs {e}"
    );
    assert!(e < 1e-4);
    let src = vit_hf_logits(&w, &pixels, 1e-12);
    let imp = load_vit(&out_hf).forward(&pixels).unwrap();
    let (a, b) = (
        src.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap(),
        imp.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap(),
    );
    let agree = a.iter().zip(&b).filter(|(x, y)| x == y).count() as f64 / 6.0;
    assert_eq!(
        report["end_to_end"]["top1_agreement"].as_f64().unwrap(),
        agree
    );
    assert!(close(
        report["end_to_end"]["logits_relative_error"]
            .as_f64()
            .unwrap(),
        rel(&imp, &src),
        1e-3
    ));
    assert_eq!(report["probe_images"], 6);

    // An unknown layout is refused by name.
    let other = root.path().join("other");
    write_model(
        &other,
        &vit_hf_config(),
        &HashMap::from([(
            "encoder.weight".to_string(),
            Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap(),
        )]),
    );
    let e = fails(&import_args("vit", &other, &root.path().join("x")));
    assert!(e.contains("unknown ViT layout"), "{e}");
}

// ---------------------------------------------------------------- merge

#[test]
fn merge_shared_fixtures_reproduces_each_source() {
    let root = tmp();
    let lm = root.path().join("lm");
    ok(&official_args(&lm, ""));
    let vit = vit_dir();
    let out = root.path().join("vl");
    let stdout = ok(&merge_args(&vit, &lm, "8", &out));
    assert!(stdout.matches("Looks ok!").count() == 3, "{stdout}");

    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["architecture"], "tokenformer-vl");
    assert_eq!(
        cfg["pattention_groups"]["ffn"],
        json!({"vision": 48, "language": 48, "bridge": 8})
    );
    let t = load(&out);
    let v = load(&vit);
    let l = load(&lm);
    assert_eq!(
        bits(&t["vision.patch_embed.weight"]),
        bits(&v["patch_embed.weight"])
    );
    assert_eq!(
        bits(&t["language.word_embeddings.weight"]),
        bits(&l["word_embeddings.weight"])
    );
    let q = &t["layers.1.attention.query.key_param_tokens"];
    assert_eq!(q.dims(), &[24 + 24 + 8, 32]);
    assert_eq!(
        bits(&q.narrow(0, 0, 24).unwrap()),
        bits(&v["layers.1.attention.query.key_param_tokens"])
    );
    assert_eq!(
        bits(&q.narrow(0, 24, 24).unwrap()),
        bits(&l["layers.1.attention.query.key_param_tokens"])
    );
    assert!(values(&q.narrow(0, 48, 8).unwrap())
        .iter()
        .all(|&x| x == 0.0));
    let bv = values(
        &t["layers.1.mlp.value_param_tokens"]
            .narrow(0, 96, 8)
            .unwrap(),
    );
    assert!(
        bv.iter().filter(|&&x| x != 0.0).count() > 200,
        "bridge values must be random"
    );

    // score on text = the LM's, classify on images = the classifier's.
    let dev = Device::Cpu;
    let ids: Vec<u32> =
        serde_json::from_value(read_json(&lm_fixture().join("expected.json"))["ids"].clone())
            .unwrap();
    let a = tokenformer::scoring::score_ids(&load_lm(&out), &ids).unwrap();
    let b = tokenformer::scoring::score_ids(&load_lm(&lm), &ids).unwrap();
    for (x, y) in a.next_token_logprobs.iter().zip(&b.next_token_logprobs) {
        assert!((x - y).abs() <= 1e-5);
    }
    let pixels = fixture_pixels();
    let li = load_vit(&out).forward(&pixels).unwrap();
    let lv = load_vit(&vit).forward(&pixels).unwrap();
    assert!(rel(&li, &lv) < 1e-6);
    let vl = tokenformer::loader::load_vl(&locate(&out), &dev).unwrap();
    let (mixed, _) = vl
        .forward_mixed(
            Some(&pixels.narrow(0, 2, 1).unwrap()),
            &Tensor::new(&ids[..12], &dev).unwrap().unsqueeze(0).unwrap(),
            None,
        )
        .unwrap();
    let d = max_diff(&mixed.unwrap(), &lv.narrow(0, 2, 1).unwrap());
    assert!(d <= 1e-5, "mixed-mode image logits moved by {d}");
}

#[test]
fn merge_refuses_mismatched_or_wrong_models() {
    let root = tmp();
    let n = Neox {
        m: 32,
        vocab: 64,
        parallel: false,
        ..TINY_NEOX
    };
    let src = root.path().join("neox");
    write_model(&src, &neox_config(&n), &neox_tensors(&n, 2, true));
    let lm16 = root.path().join("lm16");
    ok(&import_args("gpt-neox", &src, &lm16));
    let vit = vit_dir();
    let out = root.path().join("vl");
    let e = fails(&merge_args(&vit, &lm16, "4", &out));
    assert!(e.contains("hidden_size 32") && e.contains("16"), "{e}");
    // Swapped roles: a language model given as --vision.
    let e = fails(&merge_args(&lm16, &vit, "4", &out));
    assert!(
        e.contains("--vision") && e.contains("tokenformer-lm"),
        "{e}"
    );
    assert!(!out.exists());
}
