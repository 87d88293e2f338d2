//! The language model against independent truths: the PyTorch fixture
//! (official semantics), a plain f64 reference written from the paper's
//! equations for other configurations, and full-forward vs KV-cache decoding.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use tokenformer::checkpoint::Tensors;
use tokenformer::loader::{self, LocateOptions};
use tokenformer::models::tokenformer::{Cache, Config, Logits, ScaleTokens, TokenFormerLm};
use tokenformer::pattention::Activation;
use tokenformer::scoring::score_ids;

fn fixture_model() -> (
    loader::ModelFiles,
    tokenformer::models::tokenformer::TokenFormerLm,
) {
    let opts = LocateOptions {
        tokenizer: Some(tokenizer_fixture()),
        ..Default::default()
    };
    let files = loader::locate(
        lm_fixture().join("pytorch_model.bin").to_str().unwrap(),
        &opts,
    )
    .unwrap();
    let model = loader::load_lm(&files, &Device::Cpu).unwrap();
    (files, model)
}

#[test]
fn official_fixture_matches_pytorch() {
    let exp = expected_lm();
    let (files, model) = fixture_model();
    let tok = loader::load_tokenizer(&files).unwrap();
    let ids = tok
        .encode(exp["text"].as_str().unwrap(), false)
        .unwrap()
        .get_ids()
        .to_vec();
    let want_ids: Vec<u32> = serde_json::from_value(exp["ids"].clone()).unwrap();
    assert_eq!(ids, want_ids, "tokenizer ids");

    let s = score_ids(&model, &ids).unwrap();
    let lp: Vec<f32> = serde_json::from_value(exp["next_token_logprobs"].clone()).unwrap();
    let lse: Vec<f32> = serde_json::from_value(exp["logsumexp"].clone()).unwrap();
    let am: Vec<u32> = serde_json::from_value(exp["argmax"].clone()).unwrap();
    assert_eq!(s.next_token_logprobs.len(), lp.len());
    for t in 0..lp.len() {
        assert!(
            (s.next_token_logprobs[t] - lp[t]).abs() < 1e-4,
            "logprob at {t}: {} vs {}",
            s.next_token_logprobs[t],
            lp[t]
        );
        assert!((s.logsumexp[t] - lse[t]).abs() < 1e-4, "logsumexp at {t}");
    }
    // argmax is compared over all positions (the last one has no next token).
    assert_eq!(&s.argmax[..], &am[..s.argmax.len()]);

    // logits of vocabulary ids 0..8 at every position (the library's `logits`,
    // which Python's `LanguageModel.logits` returns)
    let logits = tokenformer::scoring::logits(&model, &ids).unwrap();
    assert_eq!(logits.dims(), &[ids.len(), model.config().vocab_size]);
    let none = tokenformer::scoring::logits(&model, &[]).unwrap_err();
    assert!(none.to_string().contains("no tokens"), "{none}");
    let first8: Vec<Vec<f32>> = serde_json::from_value(exp["logits_first8"].clone()).unwrap();
    for (t, row) in first8.iter().enumerate() {
        let got = f32s(&logits.get(t).unwrap().narrow(0, 0, 8).unwrap());
        for (a, b) in got.iter().zip(row) {
            assert!((a - b).abs() < 1e-4, "logit at {t}: {a} vs {b}");
        }
    }
}

#[test]
fn kv_cache_decoding_equals_full_forward() {
    let (_, model) = fixture_model();
    let ids: Vec<u32> = (0..40).map(|i| (i * 997 + 13) % 50_000).collect();
    let full = full_logits(&model, &ids);
    let mut cache = Cache::new(model.config());
    // A 7-token prefill chunk, then a 3-token chunk, then one token at a time.
    let mut pos = 0;
    for chunk in [7usize, 3].into_iter().chain(std::iter::repeat(1)) {
        if pos >= ids.len() {
            break;
        }
        let part = &ids[pos..(pos + chunk).min(ids.len())];
        let x = Tensor::new(part, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let got = model
            .forward(&x, Some(&mut cache))
            .unwrap()
            .squeeze(0)
            .unwrap();
        let want = full.narrow(0, pos, part.len()).unwrap();
        let diff: f32 = f32s(&(got - want).unwrap().abs().unwrap())
            .into_iter()
            .fold(0.0, f32::max);
        assert!(diff < 1e-4, "position {pos}: max diff {diff}");
        pos += part.len();
    }
    assert_eq!(cache.len(), ids.len());
}

/// Generation's forward: the last position's logits only, for a batch of two
/// (rows that are not contiguous in the hidden states) and through a cache,
/// equal to the last rows of the full forward; the cache it leaves decodes
/// on as the full forward's does.
#[test]
fn last_position_logits_equal_the_full_forwards_last_row() {
    let (_, model) = fixture_model();
    let ids: Vec<u32> = (0..26).map(|i| (i * 991 + 7) % 50_000).collect();
    let batch = Tensor::new(&ids[..], &Device::Cpu)
        .unwrap()
        .reshape((2, 13))
        .unwrap();
    let full = model.forward(&batch, None).unwrap();
    let last = model.forward_with(&batch, None, Logits::Last).unwrap();
    assert_eq!(last.dims(), &[2, 1, full.dim(2).unwrap()]);
    let diff = |a: &Tensor, b: &Tensor| -> f32 {
        f32s(&(a - b).unwrap().abs().unwrap())
            .into_iter()
            .fold(0.0, f32::max)
    };
    assert!(diff(&last, &full.narrow(1, 12, 1).unwrap()) < 1e-4);
    // Rows 0 and 1 differ, so the comparison above cannot pass on one row twice.
    assert!(diff(&last.get(0).unwrap(), &last.get(1).unwrap()) > 1e-3);

    let whole = full_logits(&model, &ids);
    let mut cache = Cache::new(model.config());
    let input = |part: &[u32]| {
        Tensor::new(part, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap()
    };
    let first = model
        .forward_with(&input(&ids[..20]), Some(&mut cache), Logits::Last)
        .unwrap();
    assert!(diff(&first.squeeze(0).unwrap(), &whole.narrow(0, 19, 1).unwrap()) < 1e-4);
    for j in 20..ids.len() {
        let step = model
            .forward_with(&input(&ids[j..j + 1]), Some(&mut cache), Logits::Last)
            .unwrap();
        assert!(
            diff(&step.squeeze(0).unwrap(), &whole.narrow(0, j, 1).unwrap()) < 1e-4,
            "position {j}"
        );
    }
}

/// Ids with no tokens, or no sequences, are an error naming their shape (on a GPU
/// the embedding's gather would otherwise launch an empty grid and fail bare).
#[test]
fn a_forward_of_no_tokens_is_an_error_naming_the_shape() {
    let (_, model) = fixture_model();
    for shape in [(1, 0), (0, 5)] {
        let ids = Tensor::zeros(shape, candle_core::DType::U32, &Device::Cpu).unwrap();
        let e = model.forward(&ids, None).unwrap_err().to_string();
        let want = format!("no tokens to run: ids of shape [{}, {}]", shape.0, shape.1);
        assert!(e.contains(&want), "{e}");
    }
}

#[test]
fn f16_weights_give_the_f32_results_for_an_fp16_checkpoint() {
    // The fixture is fp16, so keeping the weights in f16 loses nothing: the
    // prefill (gemm on widened weights) and one-token decoding (the f16
    // streaming kernels) must reproduce the f32-weight model.
    let (files, wide) = fixture_model();
    let half = loader::load_lm_as(&files, &Device::Cpu, candle_core::DType::F16).unwrap();
    assert_eq!(half.layers()[0].mlp.key().dtype(), candle_core::DType::F16);
    let ids: Vec<u32> = (0..24).map(|i| (i * 7919 + 3) % 50_000).collect();
    let input = |s: &[u32]| Tensor::new(s, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let max_diff = |a: Tensor, b: Tensor| {
        f32s(&(a - b).unwrap().abs().unwrap())
            .into_iter()
            .fold(0.0, f32::max)
    };
    let full = wide.forward(&input(&ids), None).unwrap();
    let d = max_diff(half.forward(&input(&ids), None).unwrap(), full.clone());
    assert!(d < 1e-5, "prefill: {d}");
    let (mut c16, mut c32) = (Cache::new(half.config()), Cache::new(wide.config()));
    for (i, &id) in ids.iter().enumerate() {
        let a = half.forward(&input(&[id]), Some(&mut c16)).unwrap();
        let b = wide.forward(&input(&[id]), Some(&mut c32)).unwrap();
        let d = max_diff(a.clone(), b);
        assert!(d < 1e-5, "decode step {i}: {d}");
        let want = full.narrow(1, i, 1).unwrap();
        assert!(max_diff(a, want) < 1e-4, "decode step {i} vs prefill");
    }
}

#[test]
fn official_bin_and_converted_weights_load_identically() {
    // The .bin read with the official name map, written as safetensors, read back: bit-identical.
    let (tensors, ignored) = tokenformer::checkpoint::read_official_bin(
        &lm_fixture().join("pytorch_model.bin"),
        2,
        None,
        &Device::Cpu,
    )
    .unwrap();
    assert!(ignored.is_empty());
    assert_eq!(tensors.len(), 1 + 2 * 10 + 2);
    assert_eq!(tensors["word_embeddings.weight"].dims(), &[50_304, 32]);
    assert_eq!(
        tensors["layers.1.attention.proj.key_param_tokens"].dims(),
        &[20, 32]
    );
    assert_eq!(
        tensors["word_embeddings.weight"].dtype(),
        candle_core::DType::F16
    );
    let dir = tempfile::tempdir().unwrap();
    // Small shards to exercise the index too.
    tokenformer::checkpoint::write_safetensors(dir.path(), &tensors, 1_000_000).unwrap();
    let files = tokenformer::checkpoint::safetensors_files(dir.path()).unwrap();
    assert!(files.len() >= 2, "expected shards, got {files:?}");
    let back = tokenformer::checkpoint::read_safetensors(&files, None, &Device::Cpu).unwrap();
    assert_eq!(back.len(), tensors.len());
    for (k, v) in &tensors {
        let w = &back[k];
        assert_eq!(v.dtype(), w.dtype(), "{k}");
        assert_eq!(f32s(v), f32s(w), "{k}");
    }
}

// ---------------------------------------------------------------------------
// An independent f64 reference, written from the paper's equations.

fn mat(t: &Tensor) -> Vec<Vec<f64>> {
    let (r, c) = t.dims2().unwrap();
    let v = f32s(t);
    (0..r)
        .map(|i| (0..c).map(|j| v[i * c + j] as f64).collect())
        .collect()
}

fn erf(x: f64) -> f64 {
    // Abramowitz-Stegun 7.1.26 is too coarse; use the series/continued fraction via libm-free Taylor for |x|<3 and asymptotics.
    // A high-accuracy erf from the complementary error function's continued fraction (Numerical Recipes erfc).
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.26551223
            + t * (1.00002368
                + t * (0.37409196
                    + t * (0.09678418
                        + t * (-0.18628806
                            + t * (0.27886807
                                + t * (-1.13520398
                                    + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
            .exp();
    if x >= 0.0 {
        1.0 - r
    } else {
        r - 1.0
    }
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

fn pattention_ref(
    x: &[f64],
    k: &[Vec<f64>],
    v: &[Vec<f64>],
    act: Activation,
    n_scale: usize,
) -> Vec<f64> {
    let s: Vec<f64> = k
        .iter()
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect();
    let n = n_scale as f64;
    let l2 = |s: &[f64]| -> Vec<f64> {
        let norm = s.iter().map(|a| a * a).sum::<f64>().sqrt();
        s.iter().map(|a| a / norm * n.sqrt()).collect()
    };
    let w: Vec<f64> = match act {
        Activation::L2NormGelu => l2(&s).into_iter().map(gelu).collect(),
        Activation::GeluL2Norm => l2(&s.iter().map(|&a| gelu(a)).collect::<Vec<_>>()),
        Activation::Softmax => {
            let e: Vec<f64> = s.iter().map(|a| a.exp()).collect();
            let sum: f64 = e.iter().sum();
            e.iter().map(|a| a / sum * n).collect()
        }
    };
    (0..v[0].len())
        .map(|j| w.iter().zip(v).map(|(wi, vi)| wi * vi[j]).sum())
        .collect()
}

fn ln(x: &[f64], eps: f64) -> Vec<f64> {
    let m = x.iter().sum::<f64>() / x.len() as f64;
    let var = x.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / x.len() as f64;
    x.iter().map(|a| (a - m) / (var + eps).sqrt()).collect()
}

/// Logits [t][vocab] of the reference model.
fn reference_logits(cfg: &Config, t: &Tensors, ids: &[u32]) -> Vec<Vec<f64>> {
    let d = cfg.hidden_size;
    let (h, hd) = (cfg.num_heads, cfg.head_dim());
    let rot = cfg.rotary_dims();
    let emb = mat(&t["word_embeddings.weight"]);
    let mut x: Vec<Vec<f64>> = ids.iter().map(|&i| emb[i as usize].clone()).collect();
    let n = ids.len();
    let scale = cfg.pattention_scale_tokens;
    let rope = |v: &mut [f64], pos: usize| {
        for head in 0..h {
            let base = head * hd;
            let half = rot / 2;
            let orig: Vec<f64> = v[base..base + rot].to_vec();
            for i in 0..half {
                let inv = 1.0 / cfg.rotary_base.powf((2 * i) as f64 / rot as f64);
                let (s, c) = (pos as f64 * inv).sin_cos();
                v[base + i] = orig[i] * c - orig[i + half] * s;
                v[base + i + half] = orig[i + half] * c + orig[i] * s;
            }
        }
    };
    for l in 0..cfg.num_layers {
        let p = |name: &str| {
            (
                mat(&t[&format!("layers.{l}.{name}.key_param_tokens")]),
                mat(&t[&format!("layers.{l}.{name}.value_param_tokens")]),
            )
        };
        let (qk, qv) = p("attention.query");
        let (kk, kv) = p("attention.key");
        let (vk, vv) = p("attention.value");
        let (ok, ov) = p("attention.proj");
        let (fk, fv) = p("mlp");
        let nq = scale.map_or(cfg.qkv_tokens, |s| s.qkv);
        let np = scale.map_or(cfg.proj_tokens, |s| s.proj);
        let nf = scale.map_or(cfg.ffn_tokens, |s| s.ffn);
        let act = cfg.pattention_activation;
        let hs: Vec<Vec<f64>> = x.iter().map(|r| ln(r, cfg.norm_eps)).collect();
        let mut q: Vec<Vec<f64>> = hs
            .iter()
            .map(|r| pattention_ref(r, &qk, &qv, act, nq))
            .collect();
        let mut k: Vec<Vec<f64>> = hs
            .iter()
            .map(|r| pattention_ref(r, &kk, &kv, act, nq))
            .collect();
        let v: Vec<Vec<f64>> = hs
            .iter()
            .map(|r| pattention_ref(r, &vk, &vv, act, nq))
            .collect();
        for i in 0..n {
            rope(&mut q[i], i);
            rope(&mut k[i], i);
        }
        let mut att = vec![vec![0.0; d]; n];
        for head in 0..h {
            let r = head * hd..(head + 1) * hd;
            for i in 0..n {
                let sc: Vec<f64> = (0..=i)
                    .map(|j| {
                        q[i][r.clone()]
                            .iter()
                            .zip(&k[j][r.clone()])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for c in r.clone() {
                        att[i][c] += ej / z * v[j][c];
                    }
                }
            }
        }
        for i in 0..n {
            let o = pattention_ref(&att[i], &ok, &ov, act, np);
            for c in 0..d {
                x[i][c] += o[c];
            }
            let f = pattention_ref(&ln(&x[i], cfg.norm_eps), &fk, &fv, act, nf);
            for c in 0..d {
                x[i][c] += f[c];
            }
        }
    }
    let w = f32s(&t["final_norm.weight"]);
    let b = f32s(&t["final_norm.bias"]);
    let out = if cfg.tie_word_embeddings {
        emb
    } else {
        mat(&t["final_linear.weight"])
    };
    x.iter()
        .map(|r| {
            let hn: Vec<f64> = ln(r, cfg.norm_eps)
                .iter()
                .enumerate()
                .map(|(c, a)| a * w[c] as f64 + b[c] as f64)
                .collect();
            out.iter()
                .map(|e| e.iter().zip(&hn).map(|(a, b)| a * b).sum())
                .collect()
        })
        .collect()
}

fn check_against_reference(cfg: Config, n_tokens: usize, seed: u64) {
    let tensors = random_lm_tensors(&cfg, seed);
    let dir = tempfile::tempdir().unwrap();
    write_lm_folder(dir.path(), &cfg, &tensors);
    let files = loader::locate(dir.path().to_str().unwrap(), &Default::default()).unwrap();
    let model = loader::load_lm(&files, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..n_tokens as u32)
        .map(|i| (i * 31 + 7) % cfg.vocab_size as u32)
        .collect();
    let got = mat(&full_logits(&model, &ids));
    let want = reference_logits(&cfg, &tensors, &ids);
    let mut worst = 0.0f64;
    for (g, w) in got.iter().zip(&want) {
        for (a, b) in g.iter().zip(w) {
            worst = worst.max((a - b).abs() / (1.0 + b.abs()));
        }
    }
    assert!(
        worst < 2e-5,
        "{:?}: worst relative diff {worst}",
        cfg.pattention_activation
    );
}

#[test]
fn other_configurations_match_the_reference() {
    // Θ variants, a 4-head layout with head size 16 and full rotary, an untied output,
    // and grown-style √n constants.
    let mut a = tiny_config(97, 64);
    a.pattention_activation = Activation::GeluL2Norm;
    check_against_reference(a, 20, 1);

    let mut b = tiny_config(97, 64);
    b.pattention_activation = Activation::Softmax;
    b.num_heads = 4;
    b.rotary_pct = 1.0;
    check_against_reference(b, 20, 2);

    let mut c = tiny_config(97, 64);
    c.tie_word_embeddings = false;
    c.pattention_scale_tokens = Some(ScaleTokens {
        qkv: 10,
        proj: 7,
        ffn: 30,
    });
    c.hidden_size = 64;
    c.rotary_pct = 0.5;
    check_against_reference(c, 33, 3);
}

#[test]
fn long_prefill_in_query_blocks_equals_short_chunks() {
    // 700 tokens span several 128-query blocks of the fused attention;
    // chunks of 200 through the KV cache attend with cached keys first.
    let cfg = tiny_config(97, 1024);
    let tensors = random_lm_tensors(&cfg, 11);
    let dir = tempfile::tempdir().unwrap();
    write_lm_folder(dir.path(), &cfg, &tensors);
    let files = loader::locate(dir.path().to_str().unwrap(), &Default::default()).unwrap();
    let model = loader::load_lm(&files, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..700u32).map(|i| (i * 37 + 5) % 97).collect();
    let input = |s: &[u32]| Tensor::new(s, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let full = model
        .forward(&input(&ids), None)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let mut cache = Cache::new(&cfg);
    for start in (0..ids.len()).step_by(200) {
        let part = &ids[start..(start + 200).min(ids.len())];
        let got = model
            .forward(&input(part), Some(&mut cache))
            .unwrap()
            .squeeze(0)
            .unwrap();
        let want = full.narrow(0, start, part.len()).unwrap();
        let diff = f32s(&(got - want).unwrap().abs().unwrap())
            .into_iter()
            .fold(0.0, f32::max);
        assert!(diff < 1e-3, "chunk at {start}: {diff}");
    }
}

/// Logits [t, vocab] of one sequence, without a cache.
fn full_logits(model: &TokenFormerLm, ids: &[u32]) -> Tensor {
    let input = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model.forward(&input, None).unwrap().squeeze(0).unwrap()
}

#[test]
fn q8_weights_decode_like_their_own_prefill_and_stay_close_to_f32() {
    // 8-bit weights quantised at load from the fp16 official fixture: under a
    // third of the f32 bytes; one-token decoding (the 8-bit kernels) gives
    // the prefill's logits (gemm on the dequantised weights); and the
    // distributions stay close to the f32 model's (mean KL, perplexity
    // within 1 %, the argmax moved only between near ties).
    let (files, wide) = fixture_model();
    let q8 = loader::load_lm_q8(&files, &Device::Cpu).unwrap();
    assert!(q8.layers()[0].mlp.is_q8());
    let ratio = q8.weight_bytes() as f64 / wide.weight_bytes() as f64;
    assert!((ratio - 1.125 / 4.0).abs() < 0.01, "bytes ratio {ratio}");
    let ids: Vec<u32> = (0..24).map(|i| (i * 7919 + 3) % 50_000).collect();
    let input = |s: &[u32]| Tensor::new(s, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let full = q8.forward(&input(&ids), None).unwrap();
    let mut cache = Cache::new(q8.config());
    for (i, &id) in ids.iter().enumerate() {
        let step = q8.forward(&input(&[id]), Some(&mut cache)).unwrap();
        let want = full.narrow(1, i, 1).unwrap();
        let d = f32s(&(step - want).unwrap().abs().unwrap())
            .into_iter()
            .fold(0.0, f32::max);
        assert!(d < 1e-4, "decode step {i} vs prefill: {d}");
    }
    let reference = wide
        .forward(&input(&ids), None)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let agreement =
        tokenformer::synthetic::logit_agreement(&reference, &full.squeeze(0).unwrap(), &ids)
            .unwrap();
    let (ppl, ppl_q8, kl) = (
        agreement.reference_perplexity,
        agreement.perplexity,
        agreement.mean_kl,
    );
    assert!(kl > 0.0 && kl < 1e-3, "mean KL {kl}");
    assert!(
        (ppl_q8 / ppl - 1.0).abs() < 0.01,
        "perplexity {ppl} -> {ppl_q8}"
    );
    let argmax =
        |t: &Tensor| -> Vec<u32> { t.argmax(candle_core::D::Minus1).unwrap().to_vec1().unwrap() };
    let (a, b) = (argmax(&reference), argmax(&full.squeeze(0).unwrap()));
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    // The report's top-1 agreement counts the positions that have a next token.
    let last_same = usize::from(a.last() == b.last());
    let want = (same - last_same) as f64 / (a.len() - 1) as f64;
    assert!(
        (agreement.top1_agreement - want).abs() < 1e-12,
        "top-1 agreement {} against {want}",
        agreement.top1_agreement
    );
    // The argmax may only move where the f32 model nearly ties: q8's choice
    // is within 0.1 of the best f32 logit (logits here span ~±6).
    let r = reference.to_vec2::<f32>().unwrap();
    for (t, (x, y)) in a.iter().zip(&b).enumerate() {
        let margin = r[t][*x as usize] - r[t][*y as usize];
        assert!(
            margin < 0.1,
            "position {t}: q8 picks a token {margin} below the f32 argmax"
        );
    }
    assert!(
        same * 4 >= a.len() * 3,
        "argmax agrees at {same} of {}",
        a.len()
    );
}

/// Batched decoding: sequences of different lengths, each with its own cache,
/// take one step together and get what each gets alone (positions, rotary
/// and attention per row; the products shared), step after step.
#[test]
fn rows_decode_each_sequence_as_it_would_alone() {
    let (_, model) = fixture_model();
    let input = |part: &[u32]| {
        Tensor::new(part, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap()
    };
    let prompts: Vec<Vec<u32>> = [5u32, 11, 2]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 977 + n * 31) % 50_000).collect())
        .collect();
    let (mut together, mut alone): (Vec<Cache>, Vec<Cache>) = prompts
        .iter()
        .map(|p| {
            let mut a = Cache::new(model.config());
            let mut b = Cache::new(model.config());
            model.forward(&input(p), Some(&mut a)).unwrap();
            model.forward(&input(p), Some(&mut b)).unwrap();
            (a, b)
        })
        .unzip();
    let diff = |a: &Tensor, b: &Tensor| -> f32 {
        f32s(&(a - b).unwrap().abs().unwrap())
            .into_iter()
            .fold(0.0, f32::max)
    };
    for step in 0..4u32 {
        let next: Vec<u32> = (0..3).map(|r| 100 + 1000 * r + 7 * step).collect();
        let ids = Tensor::new(&next[..], &Device::Cpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let mut caches: Vec<&mut Cache> = together.iter_mut().collect();
        let got = model.forward_rows(&ids, &mut caches).unwrap();
        assert_eq!(got.dims(), &[3, 1, model.config().vocab_size]);
        for (r, cache) in alone.iter_mut().enumerate() {
            let want = model
                .forward_with(&input(&next[r..r + 1]), Some(cache), Logits::Last)
                .unwrap();
            let d = diff(&got.get(r).unwrap(), &want.squeeze(0).unwrap());
            assert!(d < 1e-4, "step {step}, row {r}: max diff {d}");
            assert_eq!(together[r].len(), prompts[r].len() + step as usize + 1);
        }
        // The rows differ, so no row can pass by matching another's.
        assert!(diff(&got.get(0).unwrap(), &got.get(2).unwrap()) > 1e-3);
    }
    let ids = Tensor::new(&[[1u32], [2]], &Device::Cpu).unwrap();
    let mut one: Vec<&mut Cache> = together.iter_mut().take(1).collect();
    let e = model.forward_rows(&ids, &mut one).unwrap_err().to_string();
    assert!(e.contains("a cache and a position per row"), "{e}");
}

/// `generate_batch` gives every prompt what `generate` gives it alone, greedy
/// and sampled, whatever the batch size (1, fewer than the prompts so that
/// finished sequences hand their place on, more than the prompts), with a
/// prompt whose budget the context cuts and one with no budget at all.
#[test]
fn batched_generation_gives_each_prompt_its_own_generation() {
    use tokenformer::generate::{generate_batch, generate_with_kv, SamplingParams};
    use tokenformer::KvDtype;
    let (_, model) = fixture_model();
    let max = model.config().max_position_embeddings as u32;
    let mut prompts: Vec<Vec<u32>> = [3u32, 9, 1, 6]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 613 + n * 97) % 50_000).collect())
        .collect();
    // Three positions left: its budget is 3, not 8.
    prompts.push((0..max - 3).map(|i| (i * 31 + 5) % 50_000).collect());
    let sampled = SamplingParams {
        temperature: 0.9,
        top_k: Some(40),
        seed: 11,
        ..Default::default()
    };
    for params in [SamplingParams::default(), sampled] {
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                generate_with_kv(&model, KvDtype::F32, p, 8, params.clone(), |_| {
                    Ok(std::ops::ControlFlow::Continue(()))
                })
                .unwrap()
            })
            .collect();
        assert_eq!(alone[4].len(), 3);
        for batch in [1, 2, 8] {
            let mut seen = vec![Vec::new(); prompts.len()];
            let got = generate_batch(
                &model,
                KvDtype::F32,
                &prompts,
                8,
                params.clone(),
                batch,
                |i, t| {
                    seen[i].push(t);
                    Ok(std::ops::ControlFlow::Continue(()))
                },
            )
            .unwrap();
            assert_eq!(got, alone, "batch size {batch}, {params:?}");
            assert_eq!(seen, alone, "tokens seen as they came");
        }
        let none = generate_batch(&model, KvDtype::F32, &prompts, 0, params, 2, |_, _| {
            unreachable!("no tokens")
        });
        assert!(none.unwrap().iter().all(Vec::is_empty));
    }
    // A callback's Break ends that sequence only, after the token it saw.
    let got = generate_batch(
        &model,
        KvDtype::F32,
        &prompts[..3],
        8,
        SamplingParams::default(),
        3,
        |i, _| {
            Ok(if i == 1 {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            })
        },
    )
    .unwrap();
    assert_eq!(got.iter().map(Vec::len).collect::<Vec<_>>(), [8, 1, 8]);
    // A bad prompt is named by its place, before anything runs.
    let bad = [vec![1u32, 2], vec![]];
    let e = generate_batch(
        &model,
        KvDtype::F32,
        &bad,
        4,
        SamplingParams::default(),
        2,
        |_, _| Ok(std::ops::ControlFlow::Continue(())),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("prompt #2") && e.contains("empty"), "{e}");
}

/// The library's batched generation on the shipped trained model: the text of
/// each prompt equals `generate_until`'s, with stop strings, and each of the
/// three finish reasons is the one that happened.
#[test]
fn batched_generation_ends_each_text_for_its_own_reason() {
    use tokenformer::{FinishReason, LanguageModel, SamplingParams};
    let lm =
        LanguageModel::from_pretrained(zoo("tiny-kjv-lm").to_str().unwrap(), &Default::default())
            .unwrap();
    let prompts = [
        "a handwritten",
        "And God said",
        "In the beginning God created",
    ];
    let stop = ["Behold"];
    let got = lm
        .generate_batch(&prompts, 12, SamplingParams::default(), &stop, 2)
        .unwrap();
    for (p, g) in prompts.iter().zip(&got) {
        let alone = lm
            .generate_until(p, 12, SamplingParams::default(), &stop)
            .unwrap();
        assert_eq!(g.generated_text, alone, "{p}");
        assert_eq!(g.prompt_tokens, lm.encode(p).unwrap().len());
        assert!(g.generated_tokens >= 1 && g.generated_tokens <= 12);
    }
    let reasons: Vec<FinishReason> = got.iter().map(|g| g.finish_reason).collect();
    assert_eq!(
        reasons,
        [
            FinishReason::EosToken,
            FinishReason::StopSequence,
            FinishReason::Length
        ],
        "{got:?}"
    );
    assert_eq!(got[2].generated_tokens, 12);
    assert_eq!(got[1].generated_text, " unto him, ");
}
