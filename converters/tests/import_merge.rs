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
    bits, config_u64s, fails, fixture_pixels, import_args, lm_fixture, load_lm, load_vit, locate,
    max_diff, merge_args, official_args, ok, read_json, s, values, vit_dir,
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

/// The eval text of the Rust-written GPT-NeoX imports (one window of 64 tokens).
const PROBE: &str = "And the LORD God planted a garden eastward in Eden; and there he put the man whom he had formed.";

/// Sources written by the real libraries and what they compute (scripts/import_fixtures.py).
fn import_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/import")
}

fn peers() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(import_fixtures().join("peers.safetensors"), &Device::Cpu)
        .unwrap()
}

/// Token ids of `text` with the tokenizer of the model folder `dir`.
fn tokenize(dir: &Path, text: &str) -> Vec<u32> {
    let t = tokenformer::loader::load_tokenizer(&locate(dir)).unwrap();
    t.encode(text, false).unwrap().get_ids().to_vec()
}

/// Row-wise log-softmax in f64.
fn log_softmax64(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(DType::F64)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap()
        .into_iter()
        .map(|r| {
            let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + r.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            r.iter().map(|x| x - lse).collect()
        })
        .collect()
}

/// Top-1 agreement, mean KL(source ‖ import) and relative logit error of logits
/// [n, k], computed here in f64, against the report's `end_to_end` (the source
/// logits may come from the peer library, hence the tolerance of one item on top-1).
fn check_agreement(e2e: &Value, src: &Tensor, imp: &Tensor) {
    let (ls, li) = (log_softmax64(src), log_softmax64(imp));
    let n = ls.len();
    let argmax = |r: &Vec<f64>| (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap();
    let agree = ls
        .iter()
        .zip(&li)
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    let kl: f64 = ls
        .iter()
        .zip(&li)
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x.exp() * (x - y)).sum::<f64>())
        .sum::<f64>()
        / n as f64;
    assert_eq!(e2e["items"], n);
    let top1 = e2e["top1_agreement"].as_f64().unwrap();
    assert!(
        (top1 - agree as f64 / n as f64).abs() <= 1.0 / n as f64 + 1e-12,
        "top-1 {top1} vs {agree}/{n}"
    );
    let reported = e2e["mean_kl"].as_f64().unwrap();
    assert!(close(reported, kl, 2e-3), "KL {reported} vs {kl}");
    let reported = e2e["logits_relative_error"].as_f64().unwrap();
    assert!(close(reported, rel(imp, src), 1e-3), "{reported}");
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1e-12)
}

#[test]
fn import_gpt_neox_copies_maps_and_reports_honest_fidelity() {
    let n = Neox {
        vocab: 320,
        ..TINY_NEOX
    };
    let root = tmp();
    let src = root.path().join("pythia-tiny");
    let w = neox_tensors(&n, 7, true);
    write_model(&src, &neox_config(&n), &w);
    // The fixture's 320-token BPE, so that the probe is real text.
    std::fs::copy(
        import_fixtures().join("pythia/tokenizer.json"),
        src.join("tokenizer.json"),
    )
    .unwrap();
    let out = root.path().join("imported");
    // The mapping alone: its exactness is what is checked here.
    let args = import_args(
        "gpt-neox",
        &src,
        &out,
        &["--probe-text", PROBE, "--fit", "none"],
    );
    let stdout = ok(&args);
    assert!(stdout.contains("Perplexity on the eval text"), "{stdout}");

    // Config: same width, depth, heads, vocabulary, rotary; untied head kept.
    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["architecture"], "tokenformer-lm");
    assert_eq!(
        config_u64s(&cfg, ["hidden_size", "num_layers", "num_heads"]),
        [Some(16), Some(2), Some(2)]
    );
    assert_eq!(cfg["vocab_size"], 320);
    assert_eq!(cfg["parallel_residual"], true);
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
    let ids = tokenize(&out, PROBE);
    assert!(
        ids.len() > 8 && ids.len() <= 64,
        "one window: {}",
        ids.len()
    );
    assert_eq!(report["evaluation"]["items"], ids.len());
    assert_eq!(report["evaluation"]["source"], "--probe-text");
    assert_eq!(report["calibration"]["shipped"], true);
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

    assert_eq!(report["layers"][0]["status"]["mlp"], "approximate");
    assert_eq!(report["layers"][0]["status"]["query"], "exact");

    // End to end: the source (with its parallel residual) and the import.
    let e2e = &report["end_to_end"];
    let src_logits = neox_logits(&n, &w, &ids, true);
    let src_ppl = perplexity(&src_logits, &ids);
    assert!(
        close(e2e["source_perplexity"].as_f64().unwrap(), src_ppl, 1e-4),
        "{e2e} vs {src_ppl}"
    );
    let model = load_lm(&out);
    let imp = tokenformer::scoring::score_ids(&model, &ids)
        .unwrap()
        .perplexity;
    assert!(close(e2e["import_perplexity"].as_f64().unwrap(), imp, 1e-5));
    let imp_logits = model
        .forward(
            &Tensor::new(ids.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap(),
            None,
        )
        .unwrap()
        .squeeze(0)
        .unwrap();
    check_agreement(e2e, &src_logits, &imp_logits);
    assert_eq!(report["parallel_residual"], true);

    // The model card carries the numbers.
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(
        card.contains("parallel residual")
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
    ok(&import_args("gpt-neox", &src, &out, &["--fit", "none"]));
    let report = read_json(&out.join("import_report.json"));
    for l in report["layers"].as_array().unwrap() {
        for k in ["query", "key", "value", "mlp"] {
            assert!(l[k].as_f64().unwrap() < 1e-4, "{k}: {l}");
            assert_eq!(l["status"][k], "exact", "{l}");
        }
        assert_eq!(l["status"]["proj"], "approximate");
        assert_eq!(l["dropped_mlp_bias_norm"], 0.0);
    }
    assert_eq!(report["parallel_residual"], false);
    assert!(read_json(&out.join("config.json"))
        .get("parallel_residual")
        .is_none());
    // No tokenizer: seeded ids, and the report says so.
    assert_eq!(report["evaluation"]["source"], "seeded random token ids");
    assert!(report["evaluation"]["note"]
        .as_str()
        .unwrap()
        .contains("no tokenizer.json"));
}

#[test]
fn import_gpt_neox_without_attention_biases() {
    // transformers' `attention_bias: false`: query_key_value and dense have no bias.
    let n = Neox {
        vocab: 320,
        ..TINY_NEOX
    };
    let root = tmp();
    let src = root.path().join("neox");
    let mut w = neox_tensors(&n, 13, true);
    let mut cfg = neox_config(&n);
    cfg["attention_bias"] = json!(false);
    for i in 0..n.layers {
        for m in ["query_key_value", "dense"] {
            w.remove(&format!("gpt_neox.layers.{i}.attention.{m}.bias"));
        }
    }
    write_model(&src, &cfg, &w);
    std::fs::copy(
        import_fixtures().join("pythia/tokenizer.json"),
        src.join("tokenizer.json"),
    )
    .unwrap();
    let out = root.path().join("imp");
    ok(&import_args(
        "gpt-neox",
        &src,
        &out,
        &["--probe-text", PROBE],
    ));
    // The reference forward, with zero biases in their place.
    for i in 0..n.layers {
        for (m, len) in [("query_key_value", 3 * n.d), ("dense", n.d)] {
            w.insert(
                format!("gpt_neox.layers.{i}.attention.{m}.bias"),
                Tensor::zeros(len, DType::F32, &Device::Cpu).unwrap(),
            );
        }
    }
    let ids = tokenize(&out, PROBE);
    let want = perplexity(&neox_logits(&n, &w, &ids, true), &ids);
    let report = read_json(&out.join("import_report.json"));
    let got = report["end_to_end"]["source_perplexity"].as_f64().unwrap();
    assert!(close(got, want, 1e-4), "{got} vs {want}");
}

#[test]
fn import_gpt_neox_at_the_usual_init_is_eps_limited_and_says_so() {
    // Embeddings N(0, 0.02²): layer 0's LayerNorm sees var ~4e-4 against eps 1e-5, so
    // its output is x̂/√(1 + eps/var), 1.2e-2 off: q/k/v are not exact there.
    let n = Neox {
        vocab: 320,
        ..TINY_NEOX
    };
    let root = tmp();
    let src = root.path().join("neox");
    let mut w = neox_tensors(&n, 17, true);
    let emb = Rng(99).tensor(&[n.vocab, n.d], 0.0, 0.02);
    w.insert("gpt_neox.embed_in.weight".into(), emb.clone());
    write_model(&src, &neox_config(&n), &w);
    std::fs::copy(
        import_fixtures().join("pythia/tokenizer.json"),
        src.join("tokenizer.json"),
    )
    .unwrap();
    let out = root.path().join("imp");
    let text = import_fixtures().join("pythia-eval.txt");
    let extra = ["--eval-text", s(&text), "--fit", "none"];
    let stdout = ok(&import_args("gpt-neox", &src, &out, &extra));
    let report = read_json(&out.join("import_report.json"));
    let l0 = &report["layers"][0];
    for part in ["query", "key", "value"] {
        assert_eq!(l0["status"][part], "eps_limited", "{l0}");
    }
    assert!(
        stdout.contains("layer 0: query, key, value exact by construction, but eps/var reaches")
    );

    // Layer 0 reads the embeddings: the fitted scale is the mean √(var/(var + eps))
    // over the calibration tokens (the shipped page), computed here.
    let calib = tokenize(
        &out,
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/samples/text/calibration.txt"),
        )
        .unwrap(),
    );
    let var_of = |ids: &[u32]| -> Vec<f64> {
        let x = emb
            .index_select(&Tensor::new(ids, &Device::Cpu).unwrap(), 0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let c = x
            .broadcast_sub(&x.mean_keepdim(D::Minus1).unwrap())
            .unwrap();
        c.sqr().unwrap().mean(D::Minus1).unwrap().to_vec1().unwrap()
    };
    let f: Vec<f64> = var_of(&calib)
        .iter()
        .map(|v| (v / (v + 1e-5)).sqrt())
        .collect();
    let c = f.iter().sum::<f64>() / f.len() as f64;
    let reported = l0["qkv_input_scale"].as_f64().unwrap();
    assert!((reported - c).abs() < 1e-6, "{reported} vs {c}");
    assert!(c < 0.995, "{c}");

    // The reported error and eps condition on the eval text, computed here; the fitted
    // scale leaves a fraction of the unfitted error.
    let ids = tokenize(&out, &std::fs::read_to_string(&text).unwrap());
    let var_min = var_of(&ids).into_iter().fold(f64::INFINITY, f64::min);
    let ratio = l0["attn_eps_over_var"].as_f64().unwrap();
    assert!(
        close(ratio, 1e-5 / var_min, 1e-4),
        "{ratio} vs {}",
        1e-5 / var_min
    );
    let x = emb
        .index_select(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap(), 0)
        .unwrap();
    let u = standardise(&x, 1e-5);
    let g = |s: &str| &w[&format!("gpt_neox.layers.0.{s}")];
    let h1 = affine(&u, g("input_layernorm.weight"), g("input_layernorm.bias"));
    let fb = g("attention.query_key_value.bias").unsqueeze(1).unwrap();
    let want = lin(
        &h1,
        &neox_part(g("attention.query_key_value.weight"), 2, 0),
        &neox_part(&fb, 2, 0).squeeze(1).unwrap(),
    );
    let cfg = read_json(&out.join("config.json"));
    let scale = cfg["pattention_scale_tokens"]["qkv"].as_u64().unwrap() as usize;
    let got = pattention(&load(&out), "layers.0.attention.query", scale)
        .forward(&u)
        .unwrap();
    let e = rel(&got, &want);
    assert!(close(l0["query"].as_f64().unwrap(), e, 1e-3), "{l0} vs {e}");
    assert!(e > 1e-4 && e < 0.5 * (1.0 - c), "{e}");
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
    let import_fails = |src: &Path| fails(&import_args("gpt-neox", src, &out, &[]));

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
        ok(&import_args(
            "vit",
            src,
            out,
            &["--probe-pixels", s(&px), "--fit", "none"],
        ));
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
    // timm's fused qkv splits into the same layers: the same import, but for the
    // output projections' fitted scales (each calibrated on photos preprocessed as
    // its own source does).
    let ot = load(&out_timm);
    assert_eq!(o.len(), ot.len());
    for (n, t) in &o {
        if n.contains("attention.proj.value") {
            assert_eq!(t.dims(), ot[n].dims(), "{n}");
        } else {
            assert_eq!(
                bits(t),
                bits(&ot[n]),
                "{n} differs between the transformers and timm imports"
            );
        }
    }
    let timm_cfg = read_json(&out_timm.join("config.json"));
    assert_eq!(timm_cfg["crop_pct"], 0.9);
    assert!(timm_cfg.get("resize_mode").is_none(), "{timm_cfg}");
    // transformers' processor: both sides to image_size, no crop.
    assert_eq!(cfg["resize_mode"], "squash");
    assert_eq!(cfg["crop_pct"], 1.0);

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
    assert_eq!(report["evaluation"]["items"], 6);
    assert!(report["evaluation"]["source"]
        .as_str()
        .unwrap()
        .contains("--probe-pixels"));
    // --probe-pixels only measures: the scales were fitted on the shipped photos.
    assert_eq!(report["calibration"]["shipped"], true);
    assert_eq!(report["calibration"]["items"], 8);

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
    let e = fails(&import_args("vit", &other, &root.path().join("x"), &[]));
    assert!(e.contains("unknown ViT layout"), "{e}");
}

// ---------------------------------------------------------------- peers

/// logits [n, k] of a peer tensor.
fn i64_ids(t: &Tensor) -> Vec<u32> {
    t.to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|i| i as u32)
        .collect()
}

#[test]
fn import_pythia_keeps_its_parallel_residual_and_is_exact_where_it_says() {
    let p = peers();
    let root = tmp();
    let out = root.path().join("imp");
    let pythia = import_fixtures().join("pythia");
    let text = import_fixtures().join("pythia-eval.txt");
    let extra = ["--eval-text", s(&text), "--fit", "none"];
    let stdout = ok(&import_args("gpt-neox", &pythia, &out, &extra));
    let report = read_json(&out.join("import_report.json"));
    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["parallel_residual"], true);
    assert_eq!(report["parallel_residual"], true);
    assert_eq!(report["calibration"]["shipped"], true);
    assert_eq!(report["evaluation"]["source"], s(&text));

    // The same token ids as the peer's tokenizer, then the source's perplexity
    // over 128-token windows equals transformers'.
    let ids = i64_ids(&p["pythia.excerpt.ids"]);
    assert_eq!(
        tokenize(&out, &std::fs::read_to_string(&text).unwrap()),
        ids
    );
    let peer_logits = &p["pythia.excerpt.logits"];
    let lp = log_softmax64(peer_logits);
    let mut nll = 0.0;
    let mut predicted = 0;
    for start in (0..ids.len()).step_by(128) {
        let end = (start + 128).min(ids.len());
        for t in start..end - 1 {
            nll -= lp[t][ids[t + 1] as usize];
            predicted += 1;
        }
    }
    let e2e = &report["end_to_end"];
    assert_eq!(e2e["predicted_tokens"], predicted);
    let src_ppl = (nll / predicted as f64).exp();
    assert!(
        close(e2e["source_perplexity"].as_f64().unwrap(), src_ppl, 1e-4),
        "{e2e} vs transformers {src_ppl}"
    );

    // The import, loaded as a user would, window by window.
    let model = load_lm(&out);
    let imp_logits = Tensor::cat(
        &ids.chunks(128)
            .map(|w| {
                let x = Tensor::new(w, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                model.forward(&x, None).unwrap().squeeze(0).unwrap()
            })
            .collect::<Vec<_>>(),
        0,
    )
    .unwrap();
    check_agreement(e2e, peer_logits, &imp_logits);
    let li = log_softmax64(&imp_logits);
    let mut imp_nll = 0.0;
    for start in (0..ids.len()).step_by(128) {
        let end = (start + 128).min(ids.len());
        for t in start..end - 1 {
            imp_nll -= li[t][ids[t + 1] as usize];
        }
    }
    let imp_ppl = (imp_nll / predicted as f64).exp();
    assert!(close(
        e2e["import_perplexity"].as_f64().unwrap(),
        imp_ppl,
        1e-4
    ));

    // Every part the report calls exact reproduces transformers' layer on its own
    // activations of the real text to 1e-4; layer 1 has no MLP bias, so its MLP is exact.
    let o = load(&out);
    let scale = cfg["pattention_scale_tokens"]["qkv"].as_u64().unwrap() as usize;
    let mut exact_parts = 0;
    for (i, l) in report["layers"].as_array().unwrap().iter().enumerate() {
        let u = standardise(&p[&format!("pythia.l{i}.layer.in")], 1e-5);
        let qkv = &p[&format!("pythia.l{i}.qkv.out")]; // [t, heads·3·hd]
        let part = |j: usize| neox_part(&qkv.t().unwrap(), 4, j).t().unwrap();
        let want = [
            ("query", "attention.query", part(0), &u),
            ("key", "attention.key", part(1), &u),
            ("value", "attention.value", part(2), &u),
            ("mlp", "mlp", p[&format!("pythia.l{i}.mlp.out")].clone(), &u),
        ];
        for (name, module, y, x) in want {
            let got = pattention(&o, &format!("layers.{i}.{module}"), scale)
                .forward(x)
                .unwrap();
            let e = rel(&got, &y);
            if l["status"][name] == "exact" {
                assert!(e <= 1e-4, "layer {i} {name}: called exact, error {e}");
                exact_parts += 1;
            }
        }
        // The proj is fitted: on the peer's attention output it is far from exact
        // (these random heads' outputs vary in norm from token to token).
        let got = pattention(&o, &format!("layers.{i}.attention.proj"), scale)
            .forward(&p[&format!("pythia.l{i}.dense.in")])
            .unwrap();
        assert_eq!(l["status"]["proj"], "approximate");
        let e = rel(&got, &p[&format!("pythia.l{i}.dense.out")]);
        assert!(e > 1e-2 && e < 0.6, "layer {i} proj {e}");
        // The eps condition: the report's max eps/var is over the whole text, at
        // least that of the first window.
        let x = &p[&format!("pythia.l{i}.layer.in")];
        let c = x
            .broadcast_sub(&x.mean_keepdim(D::Minus1).unwrap())
            .unwrap();
        let var_min = c
            .sqr()
            .unwrap()
            .mean(D::Minus1)
            .unwrap()
            .min(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let ratio = l["attn_eps_over_var"].as_f64().unwrap();
        assert!(
            ratio >= 1e-5 / var_min * (1.0 - 1e-3),
            "{ratio} vs {}",
            1e-5 / var_min
        );
        assert!(ratio < 1e-3, "{ratio}");
    }
    assert_eq!(report["layers"][0]["status"]["mlp"], "approximate");
    assert_eq!(report["layers"][1]["status"]["mlp"], "exact");
    assert_eq!(exact_parts, 7, "{report}");
    assert!(stdout.contains("query key value mlp"), "{stdout}");

    // The whole text shipped with the tool: the same perplexity as transformers.
    let out2 = root.path().join("imp2");
    ok(&import_args(
        "gpt-neox",
        &import_fixtures().join("pythia"),
        &out2,
        &[],
    ));
    let r2 = read_json(&out2.join("import_report.json"));
    assert_eq!(r2["evaluation"]["shipped"], true);
    assert_eq!(
        r2["evaluation"]["items"],
        p["pythia.shipped.ids"].dim(0).unwrap()
    );
    let peer_nll: Vec<f64> = p["pythia.shipped.nll"].to_vec1().unwrap();
    let peer_ppl = (peer_nll.iter().sum::<f64>() / peer_nll.len() as f64).exp();
    let e2 = &r2["end_to_end"];
    assert_eq!(e2["predicted_tokens"], peer_nll.len());
    assert!(close(
        e2["source_perplexity"].as_f64().unwrap(),
        peer_ppl,
        1e-4
    ));
    assert!(e2.get("sample_note").is_none(), "{e2}");
}

/// The shipped eval photos, sorted as the fixture script's glob.
fn shipped_eval_photos() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/samples/photos/eval");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

#[test]
fn import_vit_uses_each_sources_preprocessing_and_reports_what_the_peers_compute() {
    let p = peers();
    let root = tmp();
    for (layout, key) in [("vit-hf", "hf"), ("vit-timm", "timm")] {
        let out = root.path().join(layout);
        let src = import_fixtures().join(layout);
        let stdout = ok(&import_args("vit", &src, &out, &["--fit", "none"]));
        let report = read_json(&out.join("import_report.json"));
        let cfg: tokenformer::models::vit::Config =
            serde_json::from_value(read_json(&out.join("config.json"))).unwrap();

        // Preprocessing of every shipped (real, mostly non-square) photo equals the
        // peer processor's: ViTImageProcessor (Pillow backend) / timm's eval transform.
        let t = tokenformer::vision::EvalTransform::from_config(&cfg);
        let photos = shipped_eval_photos();
        let ours: Vec<Vec<f32>> = photos.iter().map(|f| t.load(f).unwrap()).collect();
        let ours = t.batch(ours, &Device::Cpu).unwrap();
        let want = &p[&format!("{key}.eval.pixels")];
        let d = max_diff(&ours, want);
        assert!(d < 1e-5, "{layout}: pixels differ from the peer's by {d}");
        let names: Vec<String> = photos
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(report["eval_images"], json!(names));
        assert_eq!(report["evaluation"]["shipped"], true);

        // The report's numbers are what the peer's logits and the import give.
        let peer_logits = &p[&format!("{key}.eval.logits")];
        let e2e = &report["end_to_end"];
        let peer_top1: Vec<u32> = peer_logits.argmax(D::Minus1).unwrap().to_vec1().unwrap();
        assert_eq!(e2e["source_top1"], json!(peer_top1), "{layout}");
        let imp_logits = load_vit(&out).forward(want).unwrap();
        check_agreement(e2e, peer_logits, &imp_logits);
        let imp_top1: Vec<u32> = imp_logits.argmax(D::Minus1).unwrap().to_vec1().unwrap();
        assert_eq!(e2e["import_top1"], json!(imp_top1), "{layout}");
        // Eight photos: the report says the sample is too small to mean much.
        assert!(e2e["sample_note"]
            .as_str()
            .unwrap()
            .contains("only 8 eval images"));
        assert!(stdout.contains("too small a sample"), "{stdout}");
        // eps 1e-12 (transformers) and 1e-6 (timm) against variances ~1: exact q/k/v.
        for l in report["layers"].as_array().unwrap() {
            for part in ["query", "key", "value"] {
                assert_eq!(l["status"][part], "exact", "{layout}: {l}");
            }
        }
    }
    let hf = read_json(&root.path().join("vit-hf/config.json"));
    assert_eq!(
        (
            hf["resize_mode"].as_str(),
            hf["interpolation"].as_str(),
            hf["crop_pct"].as_f64()
        ),
        (Some("squash"), Some("bilinear"), Some(1.0))
    );
    let timm = read_json(&root.path().join("vit-timm/config.json"));
    assert!(timm.get("resize_mode").is_none());
    assert_eq!(
        (
            timm["interpolation"].as_str(),
            timm["crop_pct"].as_f64(),
            timm["pool"].as_str()
        ),
        (Some("bicubic"), Some(0.875), Some("mean"))
    );
}

#[test]
fn timm_squash_crop_mode_matches_timm() {
    // timm's crop_mode squash with crop_pct 0.875: both sides to 36, centre crop 32.
    let mut cfg = tokenformer::models::vit::Config::imagenet(1, 32, 2, 8, 16);
    cfg.image_size = 32;
    cfg.patch_size = 8;
    cfg.crop_pct = 0.875;
    cfg.interpolation = tokenformer::models::vit::Interpolation::Bilinear;
    cfg.resize_mode = tokenformer::models::vit::ResizeMode::Squash;
    let t = tokenformer::vision::EvalTransform::from_config(&cfg);
    assert_eq!(
        (t.resize, t.crop, t.resize_mode),
        (36, 32, tokenformer::models::vit::ResizeMode::Squash)
    );
    let ours: Vec<Vec<f32>> = shipped_eval_photos()
        .iter()
        .map(|f| t.load(f).unwrap())
        .collect();
    let ours = t.batch(ours, &Device::Cpu).unwrap();
    let d = max_diff(&ours, &peers()["timm.eval.pixels_squash"]);
    assert!(d < 1e-5, "differs from timm by {d}");
}

#[test]
fn import_vit_calibrates_on_the_given_photos_only() {
    let root = tmp();
    let src = import_fixtures().join("vit-hf");
    let photos = root.path().join("photos");
    std::fs::create_dir_all(photos.join("sub")).unwrap();
    let all = shipped_eval_photos();
    std::fs::copy(&all[0], photos.join("a.jpg")).unwrap();
    std::fs::copy(&all[5], photos.join("sub/b.jpg")).unwrap();
    let scales = |extra: &[&str], out: &Path| -> Value {
        ok(&import_args("vit", &src, out, extra));
        read_json(&out.join("import_report.json"))
    };
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    let default = scales(&[], &a);
    let mine = scales(
        &[
            "--calibration-images",
            s(&photos),
            "--eval-images",
            s(&photos),
        ],
        &b,
    );
    assert_eq!(mine["calibration"]["items"], 2);
    assert_eq!(mine["calibration"]["shipped"], false);
    // Two photos are two folds of the fit's cross-validation; one photo is split
    // into the halves of its tokens.
    assert_eq!(mine["fit"]["calibration_rows"], 2 * 17);
    let one = root.path().join("one");
    std::fs::create_dir_all(&one).unwrap();
    std::fs::copy(&all[0], one.join("a.jpg")).unwrap();
    let single = scales(&["--calibration-images", s(&one)], &root.path().join("c"));
    assert_eq!(single["fit"]["calibration_rows"], 17);
    assert_eq!(single["layers"].as_array().unwrap().len(), 2);
    assert_eq!(mine["evaluation"]["items"], 2);
    let c = |r: &Value| r["layers"][0]["proj_input_scale"].as_f64().unwrap();
    assert!(
        (c(&default) - c(&mine)).abs() > 1e-6 * c(&default).abs(),
        "{} {}",
        c(&default),
        c(&mine)
    );
    // Flags of the other family, and empty folders, are refused by name.
    let x = root.path().join("x");
    let e = fails(&import_args("vit", &src, &x, &["--eval-text", "f.txt"]));
    assert!(e.contains("--eval-text") && e.contains("gpt-neox"), "{e}");
    let empty = root.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = fails(&import_args(
        "vit",
        &src,
        &x,
        &["--calibration-images", s(&empty)],
    ));
    assert!(
        e.contains("--calibration-images") && e.contains("no images"),
        "{e}"
    );
    assert!(!root.path().join("x").exists());
}

/// Top-1 agreement, mean KL(source ‖ import) and relative logit error of import
/// logits against source logits [n, k], in f64.
fn agreement(src: &Tensor, imp: &Tensor) -> (f64, f64, f64) {
    let (ls, li) = (log_softmax64(src), log_softmax64(imp));
    let n = ls.len() as f64;
    let argmax = |r: &Vec<f64>| (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap();
    let agree = ls.iter().zip(&li).filter(|(a, b)| argmax(a) == argmax(b));
    let kl: f64 = ls
        .iter()
        .zip(&li)
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x.exp() * (x - y)).sum::<f64>())
        .sum();
    (agree.count() as f64 / n, kl / n, rel(imp, src))
}

#[test]
fn import_fit_values_beats_the_mapping_on_held_out_data() {
    // Each random fixture source imported twice, mapped only (`--fit none`) and
    // fitted (the default), and both measured here against what transformers /
    // timm compute on held-out data the fit never saw (a text excerpt; the shipped
    // eval photos, while the fit used the shipped calibration photos).
    let p = peers();
    let root = tmp();
    let text = import_fixtures().join("pythia-eval.txt");
    let ids = i64_ids(&p["pythia.excerpt.ids"]);
    let lm_logits = |dir: &Path| {
        let model = load_lm(dir);
        let windows: Vec<Tensor> = ids
            .chunks(128)
            .map(|w| {
                let x = Tensor::new(w, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
                model.forward(&x, None).unwrap().squeeze(0).unwrap()
            })
            .collect();
        Tensor::cat(&windows, 0).unwrap()
    };
    let cases: [(&str, &str, &str); 3] = [
        ("pythia", "gpt-neox", "pythia.excerpt"),
        ("vit-hf", "vit", "hf.eval"),
        ("vit-timm", "vit", "timm.eval"),
    ];
    for (fixture, from, key) in cases {
        let peer = &p[&format!("{key}.logits")];
        let mut measured = vec![];
        let mut reports = vec![];
        for fit in ["none", "values"] {
            let out = root.path().join(format!("{fixture}-{fit}"));
            let src = import_fixtures().join(fixture);
            let mut args = import_args(from, &src, &out, &["--fit", fit]);
            if from == "gpt-neox" {
                args.extend(["--eval-text", s(&text)].map(String::from));
            }
            let stdout = ok(&args);
            let report = read_json(&out.join("import_report.json"));
            let logits = if from == "vit" {
                load_vit(&out)
                    .forward(&p[&format!("{key}.pixels")])
                    .unwrap()
            } else {
                lm_logits(&out)
            };
            // The report's end-to-end numbers are the written model's.
            check_agreement(&report["end_to_end"], peer, &logits);
            measured.push(agreement(peer, &logits));
            if fit == "values" {
                assert!(stdout.contains("mapped only -> fitted"), "{stdout}");
                assert!(stdout.contains("Fitted (the written model)"), "{stdout}");
            } else {
                assert!(report.get("fit").is_none(), "{fixture}");
            }
            reports.push(report);
        }
        let (none, fitted) = (&reports[0], &reports[1]);
        // The fitted report's "before" is the mapped-only import, run there.
        let before = &fitted["fit"]["mapped_end_to_end"];
        for k in ["top1_agreement", "mean_kl", "logits_relative_error"] {
            let (a, b) = (
                before[k].as_f64().unwrap(),
                none["end_to_end"][k].as_f64().unwrap(),
            );
            assert!(close(a, b, 1e-4), "{fixture} {k}: {a} vs {b}");
        }
        for (l, l0) in fitted["layers"]
            .as_array()
            .unwrap()
            .iter()
            .zip(none["layers"].as_array().unwrap())
        {
            for part in ["query", "key", "value", "proj", "mlp"] {
                let status = l["status"][part].as_str().unwrap();
                assert!(status == "exact" || status == "fitted", "{fixture} {l}");
                let f = &l["fit"][part];
                assert!(f["mapped"].as_f64().unwrap().is_finite(), "{fixture} {l}");
                // Layer 0's q/k/v read the source's own embeddings: their running
                // error before the fit is the mapped import's error on the
                // source's activations.
                if l["layer"] == 0 && ["query", "key", "value"].contains(&part) {
                    let (a, b) = (f["mapped"].as_f64().unwrap(), l0[part].as_f64().unwrap());
                    assert!(
                        close(a, b, 1e-3) || (a - b).abs() < 1e-6,
                        "{fixture} {part}: {a} vs {b}"
                    );
                }
            }
        }
        // 8 photos of 17 tokens are fewer rows than the ViTs' MLPs have tokens (64 +
        // 4·32): the report says the fit leans on its ridge; the text is enough.
        let note = fitted["fit"]["calibration_note"].as_str();
        if from == "vit" {
            assert!(
                note.unwrap().contains("only 136 calibration rows"),
                "{fixture}"
            );
        } else {
            assert!(note.is_none(), "{fixture}: {note:?}");
        }
        // The paired change in agreement and its interval.
        let change = &fitted["fit"]["top1_change"];
        let diff = fitted["end_to_end"]["top1_agreement"].as_f64().unwrap()
            - before["top1_agreement"].as_f64().unwrap();
        let c = change["change"].as_f64().unwrap();
        assert!((c - diff).abs() < 1e-12, "{fixture}: {change} vs {diff}");
        let ci = [0, 1].map(|k| change["change_95"][k].as_f64().unwrap());
        assert!(
            ci[0] <= c && c <= ci[1] && ci[0] < ci[1],
            "{fixture}: {change}"
        );
        if from == "vit" {
            let top1 = |dir: &str| -> Vec<u32> {
                let r = read_json(&root.path().join(dir).join("import_report.json"));
                serde_json::from_value(r["end_to_end"]["import_top1"].clone()).unwrap()
            };
            let peer_top1: Vec<u32> = peer.argmax(D::Minus1).unwrap().to_vec1().unwrap();
            let (m, f) = (
                top1(&format!("{fixture}-none")),
                top1(&format!("{fixture}-values")),
            );
            let only = |a: &[u32], b: &[u32]| {
                (0..peer_top1.len())
                    .filter(|&i| a[i] == peer_top1[i] && b[i] != peer_top1[i])
                    .count()
            };
            assert_eq!(change["fitted_only"], only(&f, &m), "{fixture}");
            assert_eq!(change["mapped_only"], only(&m, &f), "{fixture}");
        }
        // Held out, the fit is no worse anywhere, and better where it matters.
        let ((t0, kl0, e0), (t1, kl1, e1)) = (measured[0], measured[1]);
        eprintln!("{fixture}: top-1 {t0:.4} -> {t1:.4}, KL {kl0:.4e} -> {kl1:.4e}, logit error {e0:.4e} -> {e1:.4e}");
        assert!(t1 >= t0, "{fixture}: top-1 {t0} -> {t1}");
        assert!(
            kl1 < kl0 && e1 < e0,
            "{fixture}: KL {kl0} -> {kl1}, logits {e0} -> {e1}"
        );
        if from == "vit" {
            // Measured: KL and logit error at least 10% lower on the eval photos.
            assert!(
                kl1 < 0.9 * kl0 && e1 < 0.95 * e0,
                "{fixture}: KL {kl0} -> {kl1}, logits {e0} -> {e1}"
            );
        }
    }
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
    ok(&import_args("gpt-neox", &src, &lm16, &[]));
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
