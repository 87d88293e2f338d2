//! `tokenformer bench --device cuda`: the figures the GPU issues compare with eager
//! PyTorch and `torch.compile` on the same card (`../shared/gpu/torch_gpu_anchor.py`,
//! `torch_compile_anchor.py`): prefill of the 150M (f32, bf16) and the 1.5B (bf16) at
//! 16×2048, batch-1 decode of the same three (64 tokens after 512), ViT-B/16 at batch
//! 256 (f32, bf16), and training of the peer's small and base LMs (f32 and bf16-mixed)
//! and tiny ViT. Random weights of the official shapes, the median of three timed runs
//! after one warm-up, each ended by a device synchronisation. Each figure comes with the
//! GPU memory in use after it and, for the products, the model FLOPs utilisation against
//! this card's dense peak as measured here (an 8192³ cuBLAS product in f32 and bf16; no
//! TF32). `cuda_kernels` says whether the project's own kernels ran
//! (`TOKENFORMER_CUDA_KERNELS=1`). The `ops` part times the pieces of a 150M layer and
//! its head one by one at the prefill's shape (f32 and bf16), so that one run also says
//! where the prefill's time goes.

use std::time::Instant;

use super::bench::part;
use anyhow::Result;
use candle_core::Module;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value};
use tokenformer::checkpoint::{self, Tensors};
use tokenformer::kernels;
use tokenformer::models::tokenformer::{Config, Logits, Norm, TokenFormerLm};
use tokenformer::models::vit::{self, VisionTransformer};
use tokenformer::pattention::{Activation, Pattention};

/// Median seconds of three runs of `f` after a warm-up, each synchronised.
fn timed(dev: &Device, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut t = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[1])
}

fn round(x: f64, d: i32) -> f64 {
    let m = 10f64.powi(d);
    (x * m).round() / m
}

/// GiB of GPU memory in use now (the whole card, as nvidia-smi counts it).
fn used_gib(dev: &Device) -> Value {
    match tokenformer::device::gpu_memory(dev) {
        Some((free, total)) => json!(round((total - free) as f64 / (1u64 << 30) as f64, 2)),
        None => Value::Null,
    }
}

/// TFLOP/s of an n³ product in `dtype`.
fn peak_tflops(dev: &Device, dtype: DType, n: usize) -> Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(dtype)?;
    let secs = timed(dev, || {
        a.matmul(&b)?;
        Ok(())
    })?;
    Ok(2.0 * (n as f64).powi(3) / secs / 1e12)
}

/// Random weights of `cfg` on `dev` in `dtype` (keys N(0, 1), values and embeddings
/// N(0, 0.02), as the peer draws them), drawn on the GPU.
fn random_lm(cfg: &Config, dtype: DType, dev: &Device) -> Result<TokenFormerLm> {
    let d = cfg.hidden_size;
    let mut t = Tensors::new();
    let mut draw = |name: String, rows: usize, std: f32| -> Result<()> {
        t.insert(
            name,
            Tensor::randn(0f32, std, (rows, d), dev)?.to_dtype(dtype)?,
        );
        Ok(())
    };
    draw("word_embeddings.weight".into(), cfg.vocab_size, 0.02)?;
    for i in 0..cfg.num_layers {
        for (m, n) in cfg.pattentions() {
            draw(format!("layers.{i}.{m}.key_param_tokens"), n, 1.0)?;
            draw(format!("layers.{i}.{m}.value_param_tokens"), n, 0.02)?;
        }
    }
    t.insert("final_norm.weight".into(), Tensor::ones(d, dtype, dev)?);
    t.insert("final_norm.bias".into(), Tensor::zeros(d, dtype, dev)?);
    let model = TokenFormerLm::new(cfg, checkpoint::var_builder(t, dev))?;
    Ok(model.with_compute_dtype(dtype)?)
}

/// Forward FLOPs per token of a causal LM at context `t`: two per weight of the
/// Pattention products and the head, and the scores and mixing over (on average)
/// half the context.
fn lm_flops_per_token(cfg: &Config, t: usize) -> f64 {
    let d = cfg.hidden_size as f64;
    let tokens: usize = cfg.pattentions().iter().map(|(_, n)| n).sum();
    let weights = (cfg.num_layers * 2 * tokens) as f64 * d + cfg.vocab_size as f64 * d;
    2.0 * weights + 2.0 * cfg.num_layers as f64 * t as f64 * d
}

fn prefill(
    out: &mut Map<String, Value>,
    name: &str,
    cfg: &Config,
    dtype: DType,
    dev: &Device,
    peak: f64,
) -> Result<()> {
    let (b, s) = (16, 2048);
    let model = random_lm(cfg, dtype, dev)?;
    let v: Vec<u32> = (0..b * s).map(|i| ((i * 7919) % 50_277) as u32).collect();
    let ids = Tensor::from_vec(v, (b, s), dev)?;
    // Logits in the model's dtype, as the anchor's: bf16 at bf16.
    let secs = timed(dev, || {
        model.forward_in_compute_dtype(&ids, None, Logits::All)?;
        Ok(())
    })?;
    let rate = (b * s) as f64 / secs;
    let key = format!("prefill_{name}_{}_16x2048", dtype.as_str());
    out.insert(format!("{key}_tokens_per_s"), json!(round(rate, 0)));
    let mfu = rate * lm_flops_per_token(cfg, s) / 1e12 / peak;
    out.insert(format!("{key}_mfu"), json!(round(mfu, 3)));
    out.insert(format!("{key}_gpu_used_gib"), used_gib(dev));
    Ok(())
}

/// Batch-1 greedy decoding as the anchor times it: 64 tokens after a 512-token
/// prompt, the KV cache in the model's own dtype (the default cache).
fn decode(
    out: &mut Map<String, Value>,
    name: &str,
    cfg: &Config,
    dtype: DType,
    dev: &Device,
) -> Result<()> {
    let model = random_lm(cfg, dtype, dev)?;
    let d = &super::bench::decode(&[(&model, tokenformer::KvDtype::F32)], 512, 64, 1)?[0];
    let key = format!("decode_{name}_{}_batch1", dtype.as_str());
    out.insert(
        format!("{key}_tokens_per_s"),
        json!(round(d.tokens_per_s, 1)),
    );
    out.insert(format!("{key}_gpu_used_gib"), used_gib(dev));
    // Batched generation (`generate --prompts`): 32 sequences, each over its
    // own 512-token cache, decoded together.
    let rows = 32;
    let tps = super::bench::decode_rows(&model, rows, 512, 16)?;
    let key = format!("decode_{name}_{}_batch{rows}", dtype.as_str());
    out.insert(format!("{key}_tokens_per_s"), json!(round(tps, 1)));
    out.insert(format!("{key}_gpu_used_gib"), used_gib(dev));
    Ok(())
}

fn vit_b16(out: &mut Map<String, Value>, dtype: DType, dev: &Device, peak: f64) -> Result<()> {
    let cfg = vit::Config::imagenet(12, 768, 12, 768, 3072);
    let tensors = tokenformer::train::vit::init_tensors(&cfg, 0, dev)?;
    let tensors: Tensors = tensors
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
        .collect::<Result<_>>()?;
    let model = VisionTransformer::new(&cfg, checkpoint::var_builder(tensors, dev))?
        .with_compute_dtype(dtype)?;
    let b = 256;
    let px = Tensor::randn(0f32, 1.0, (b, 3, 224, 224), dev)?;
    let secs = timed(dev, || {
        model.forward(&px)?;
        Ok(())
    })?;
    let rate = b as f64 / secs;
    // Per image: the patch embedding and 197 tokens through every Pattention
    // (two products each) and the bidirectional scores and mixing.
    let (n, d, l) = (197.0, 768.0, 12.0);
    let per_token = 2.0 * l * 2.0 * (3.0 * 768.0 + 768.0 + 3072.0) * d + 4.0 * l * n * d;
    let flops = n * per_token + 2.0 * 196.0 * 768.0 * d;
    let key = format!("vit_b16_{}_batch256", dtype.as_str());
    out.insert(format!("{key}_images_per_s"), json!(round(rate, 1)));
    out.insert(
        format!("{key}_mfu"),
        json!(round(rate * flops / 1e12 / peak, 3)),
    );
    out.insert(format!("{key}_gpu_used_gib"), used_gib(dev));
    Ok(())
}

/// What a piece of [`ops`] does, for its rate.
#[derive(Clone, Copy)]
enum Work {
    /// Floating-point operations: TFLOP/s.
    Flops(f64),
    /// Bytes read and written: GB/s.
    Bytes(f64),
}

impl Work {
    /// The rate's key suffix and value for a piece that took `secs`.
    fn rate(self, secs: f64) -> (&'static str, f64) {
        match self {
            Work::Flops(f) => ("tflops", f / secs / 1e12),
            Work::Bytes(b) => ("gb_per_s", b / secs / 1e9),
        }
    }
}

/// The shapes of [`ops`]: a layer of `cfg` on `b` sequences of `s` tokens.
#[derive(Clone, Copy)]
struct OpsShape<'a> {
    cfg: &'a Config,
    b: usize,
    s: usize,
}

/// Where a prefill's time goes: each piece of one layer of the model (the norm,
/// a q/k/v/proj-sized Pattention whole and as its scores product and Θ, the
/// feed-forward Pattention, the attention) and the head, timed alone on random
/// inputs in `dtype` (synchronised, the median of three), with its rate: TFLOP/s
/// for products, GB/s read and written for the passes over memory. `sum_ms` adds
/// them up as a pass of the whole model takes them (every layer's pieces and the
/// head, its logits in `dtype`; the final norm aside): what a measured prefill spends
/// beyond it is launch gaps, copies, rotary and the residual additions. What runs
/// is what the model takes (the project's kernels under
/// `TOKENFORMER_CUDA_KERNELS=1`, candle's ops otherwise).
fn ops(out: &mut Map<String, Value>, dtype: DType, dev: &Device, shape: OpsShape) -> Result<()> {
    let OpsShape { cfg, b, s } = shape;
    let (rows, d) = (b * s, cfg.hidden_size);
    let heads = cfg.num_heads;
    let size = dtype.size_in_bytes() as f64;
    let key = |name: &str| format!("ops_{}_{name}", dtype.as_str());
    let randn = |shape: &[usize], std: f32| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, shape, dev)?.to_dtype(dtype)?)
    };
    let mut sum = 0.0;
    // Times `f`, records its milliseconds and rate, and adds it `times` times to the sum.
    let mut record = |name: &str, work: Work, times: f64, f: &mut dyn FnMut() -> Result<()>| {
        let secs = timed(dev, &mut *f)?;
        sum += times * secs;
        let (unit, rate) = work.rate(secs);
        out.insert(key(&format!("{name}_ms")), json!(round(secs * 1e3, 3)));
        out.insert(key(&format!("{name}_{unit}")), json!(round(rate, 2)));
        anyhow::Ok(())
    };
    let layers = cfg.num_layers as f64;
    let x = randn(&[b, s, d], 1.0)?;
    let flat = x.reshape((rows, d))?;
    let norm = Norm::nonparam(d, cfg.norm_eps, dev)?;
    record(
        "norm",
        Work::Bytes(2.0 * (rows * d) as f64 * size),
        2.0 * layers,
        &mut || {
            norm.forward(&x)?;
            Ok(())
        },
    )?;
    let [(_, nq), _, _, (_, no), (_, nf)] = cfg.pattentions();
    // The output projection has q's size in every released shape: one timing serves both.
    let mut sizes = vec![("pattention_qkv", nq, 3.0 * layers)];
    if no == nq {
        sizes[0].2 += layers;
    } else {
        sizes.push(("pattention_proj", no, layers));
    }
    sizes.push(("pattention_ffn", nf, layers));
    for (name, n, times) in sizes {
        let layer = Pattention::from_tensors(
            randn(&[n, d], 1.0)?,
            randn(&[n, d], 0.02)?,
            Activation::L2NormGelu,
            None,
        )?;
        let flops = 4.0 * (rows * n * d) as f64;
        record(name, Work::Flops(flops), times, &mut || {
            layer.forward(&x)?;
            Ok(())
        })?;
        // Its two halves, not added to the sum (the whole is).
        let keys = randn(&[n, d], 1.0)?;
        record(
            &format!("{name}_scores"),
            Work::Flops(flops / 2.0),
            0.0,
            &mut || {
                kernels::matmul_nt(&flat, &keys)?;
                Ok(())
            },
        )?;
        let scores = kernels::matmul_nt(&flat, &keys)?;
        let bytes = 2.0 * (rows * n) as f64 * size;
        record(
            &format!("{name}_theta"),
            Work::Bytes(bytes),
            0.0,
            // On the CPU this rewrites `scores` in place (a CPU test's pass only).
            &mut || {
                kernels::theta_owned(scores.clone(), Activation::L2NormGelu, n)?;
                Ok(())
            },
        )?;
    }
    let hd = d / heads;
    let [q, k, v] = [(); 3].map(|_| randn(&[b, heads, s, hd], 1.0));
    let (q, k, v) = (q?, k?, v?);
    // Causal: half the scores and half the mixing.
    let flops = 2.0 * (b * heads * s * s * hd) as f64;
    record("attention", Work::Flops(flops), layers, &mut || {
        kernels::attention(&q, &k, &v, true)?;
        Ok(())
    })?;
    let out_matrix = randn(&[cfg.vocab_size, d], 0.02)?;
    let flops = 2.0 * (rows * d * cfg.vocab_size) as f64;
    record("head", Work::Flops(flops), 1.0, &mut || {
        kernels::matmul_nt(&flat, &out_matrix)?;
        Ok(())
    })?;
    out.insert(key("sum_ms"), json!(round(sum * 1e3, 2)));
    Ok(())
}

/// The parts `--only` names on a GPU, all run by default.
pub const PARTS: [&str; 5] = ["prefill", "ops", "decode", "vit", "train"];

/// The parts asked for (`only` empty: all of [`PARTS`]) as one JSON object.
pub fn run(dev: &Device, only: &[String]) -> Result<Map<String, Value>> {
    let want = |p: &str| only.is_empty() || only.iter().any(|o| o == p);
    let mut out = Map::new();
    out.insert(
        "device".into(),
        json!(tokenformer::device::gpu_name(dev).unwrap_or_else(|| format!("{dev:?}"))),
    );
    // Whether the project's own CUDA kernels ran (TOKENFORMER_CUDA_KERNELS=1), so
    // the two runs of scripts/gpu-check.sh's run.sh can be told apart.
    out.insert(
        "cuda_kernels".into(),
        json!(tokenformer::kernels::cuda_kernels_enabled()),
    );
    let f32_peak = peak_tflops(dev, DType::F32, 8192)?;
    let bf16_peak = peak_tflops(dev, DType::BF16, 8192)?;
    out.insert("matmul_8192_f32_tflops".into(), json!(round(f32_peak, 1)));
    out.insert("matmul_8192_bf16_tflops".into(), json!(round(bf16_peak, 1)));
    let small = tokenformer::synthetic::lm_config("150m").expect("a released shape");
    let large = tokenformer::synthetic::lm_config("1.5b").expect("a released shape");
    if want("prefill") {
        part(&mut out, "prefill_150m_f32", |o| {
            prefill(o, "150m", &small, DType::F32, dev, f32_peak)
        });
        part(&mut out, "prefill_150m_bf16", |o| {
            prefill(o, "150m", &small, DType::BF16, dev, bf16_peak)
        });
        part(&mut out, "prefill_1.5b_bf16", |o| {
            prefill(o, "1.5b", &large, DType::BF16, dev, bf16_peak)
        });
    }
    if want("ops") {
        for dtype in [DType::F32, DType::BF16] {
            part(&mut out, &format!("ops_{}", dtype.as_str()), |o| {
                let shape = OpsShape {
                    cfg: &small,
                    b: 16,
                    s: 2048,
                };
                ops(o, dtype, dev, shape)
            });
        }
    }
    if want("decode") {
        part(&mut out, "decode_150m_f32", |o| {
            decode(o, "150m", &small, DType::F32, dev)
        });
        part(&mut out, "decode_150m_bf16", |o| {
            decode(o, "150m", &small, DType::BF16, dev)
        });
        part(&mut out, "decode_1.5b_bf16", |o| {
            decode(o, "1.5b", &large, DType::BF16, dev)
        });
    }
    if want("vit") {
        part(&mut out, "vit_f32", |o| {
            vit_b16(o, DType::F32, dev, f32_peak)
        });
        part(&mut out, "vit_bf16", |o| {
            vit_b16(o, DType::BF16, dev, bf16_peak)
        });
    }
    if want("train") {
        part(&mut out, "train", |o| {
            o.extend(super::bench_train::run(dev)?);
            Ok(())
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// scripts/gpu-check.sh runs every part in a process of its own, from a list of its own.
    #[test]
    fn the_gpu_check_script_runs_every_part() {
        let script = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-check.sh"),
        )
        .unwrap();
        let want = format!("all_parts=\"{}\"", PARTS.join(" "));
        assert!(
            script.contains(&want),
            "scripts/gpu-check.sh lacks `{want}`"
        );
    }

    /// On the CPU at a small shape: every piece has its time and rate, and the sum
    /// counts each as often as a pass of the model runs it.
    #[test]
    fn ops_times_every_piece_and_counts_it_as_a_pass_does() {
        let mut cfg = Config::released(3, 128, 4);
        cfg.vocab_size = 1000;
        for (dtype, proj) in [(DType::F32, 128), (DType::F32, 256), (DType::BF16, 128)] {
            cfg.proj_tokens = proj;
            let mut out = Map::new();
            let shape = OpsShape {
                cfg: &cfg,
                b: 2,
                s: 512,
            };
            ops(&mut out, dtype, &Device::Cpu, shape).unwrap();
            let get = |k: &str| {
                out[&format!("ops_{}_{k}", dtype.as_str())]
                    .as_f64()
                    .unwrap()
            };
            let mut pieces = vec![
                ("norm", "gb_per_s", 6.0),
                ("pattention_qkv", "tflops", 9.0),
                ("pattention_qkv_scores", "tflops", 0.0),
                ("pattention_qkv_theta", "gb_per_s", 0.0),
                ("pattention_ffn", "tflops", 3.0),
                ("pattention_ffn_scores", "tflops", 0.0),
                ("pattention_ffn_theta", "gb_per_s", 0.0),
                ("attention", "tflops", 3.0),
                ("head", "tflops", 1.0),
            ];
            if proj == 128 {
                pieces[1].2 = 12.0;
            } else {
                pieces.extend([
                    ("pattention_proj", "tflops", 3.0),
                    ("pattention_proj_scores", "tflops", 0.0),
                    ("pattention_proj_theta", "gb_per_s", 0.0),
                ]);
            }
            let mut want = 0.0;
            for (piece, unit, times) in pieces {
                let ms = get(&format!("{piece}_ms"));
                assert!(ms > 0.0, "{piece}: {ms} ms");
                assert!(get(&format!("{piece}_{unit}")) > 0.0, "{piece}");
                want += times * ms;
            }
            // Each time is rounded to 1 µs (26 of them in the sum) and the sum to 10 µs.
            let sum = get("sum_ms");
            assert!((sum - want).abs() < 0.02, "sum {sum} ms, pieces {want} ms");
        }
    }
}
