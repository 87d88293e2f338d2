//! Throughput benchmarks on random weights of the real sizes (no download):
//! prefill, KV-cache decode (f32 weights, and f16 weights with f32 compute),
//! a single Pattention layer, ViT-B/16 images/s, and load time / peak memory.
//! Field names follow the PyTorch peer (`bench/torch_baseline.py` of the
//! shared data) so the two JSON outputs can be compared key by key; like the
//! peer, each figure is the second of two runs.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value};

use crate::checkpoint::{self, Tensors};
use crate::error::Result;
use crate::models::tokenformer::{Cache, Config, TokenFormerLm};
use crate::pattention::{Activation, Pattention};

/// The released language-model shapes by short name.
pub fn lm_config(name: &str) -> Option<Config> {
    let (l, d, h) = match name.to_ascii_lowercase().as_str() {
        "150m" => (12, 768, 12),
        "450m" => (24, 1024, 16),
        "900m" => (32, 1280, 16),
        "1.5b" | "1-5b" => (40, 1536, 16),
        _ => return None,
    };
    Some(Config::released(l, d, h))
}

/// Random weights with the statistics of the peer: keys N(0, 1), values and
/// embeddings N(0, 0.02), final norm identity.
pub fn random_lm_tensors(cfg: &Config, dtype: DType, device: &Device) -> Result<Tensors> {
    let d = cfg.hidden_size;
    let mut t = Tensors::new();
    let r = |shape: (usize, usize), std: f32| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, shape, device)?.to_dtype(dtype)?)
    };
    t.insert(
        "word_embeddings.weight".into(),
        r((cfg.vocab_size, d), 0.02)?,
    );
    for i in 0..cfg.num_layers {
        for (m, n) in cfg.pattentions() {
            t.insert(format!("layers.{i}.{m}.key_param_tokens"), r((n, d), 1.0)?);
            t.insert(
                format!("layers.{i}.{m}.value_param_tokens"),
                r((n, d), 0.02)?,
            );
        }
    }
    t.insert("final_norm.weight".into(), Tensor::ones(d, dtype, device)?);
    t.insert("final_norm.bias".into(), Tensor::zeros(d, dtype, device)?);
    Ok(t)
}

/// Seconds of the second of two runs (the first warms caches and allocators).
fn timed(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// Peak resident memory of this process in MB (VmHWM).
pub fn peak_rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// Resets the peak-RSS counter (Linux `clear_refs` 5), so a later reading
/// measures only what comes after.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn ids(b: usize, s: usize, vocab: usize, device: &Device) -> Result<Tensor> {
    let v: Vec<u32> = (0..b * s)
        .map(|i| ((i as u64 * 2_654_435_761) % vocab as u64) as u32)
        .collect();
    Ok(Tensor::from_vec(v, (b, s), device)?)
}

/// Prefill tokens/s for a b×s batch (full logits, as the peer computes).
pub fn prefill(model: &TokenFormerLm, b: usize, s: usize) -> Result<f64> {
    let x = ids(b, s, 50_277, model.device())?;
    let secs = timed(|| {
        model.forward(&x, None)?;
        Ok(())
    })?;
    Ok((b * s) as f64 / secs)
}

/// Decode tokens/s: `n` greedy tokens after a `prompt`-token prefill.
pub fn decode(model: &TokenFormerLm, prompt: usize, n: usize) -> Result<f64> {
    let x = ids(1, prompt, 50_277, model.device())?;
    let mut cache = Cache::new(model.config());
    let logits = model.forward(&x, Some(&mut cache))?;
    let mut tok = logits
        .get(0)?
        .get(prompt - 1)?
        .argmax(0)?
        .to_scalar::<u32>()?;
    let t = Instant::now();
    for _ in 0..n {
        let x = Tensor::new(&[[tok]], model.device())?;
        let logits = model.forward(&x, Some(&mut cache))?;
        tok = logits.get(0)?.get(0)?.argmax(0)?.to_scalar::<u32>()?;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// GFLOP/s of one Pattention layer (rows × d_in → n tokens → d_out), counting
/// the two matmuls.
pub fn pattention_gflops(rows: usize, d: usize, n: usize, device: &Device) -> Result<f64> {
    let p = Pattention::from_tensors(
        Tensor::randn(0f32, 1.0, (n, d), device)?,
        Tensor::randn(0f32, 0.02, (n, d), device)?,
        Activation::L2NormGelu,
        None,
    );
    let x = Tensor::randn(0f32, 1.0, (rows, d), device)?;
    let secs = timed(|| {
        candle_core::Module::forward(&p, &x)?;
        Ok(())
    })?;
    Ok(4.0 * (rows * d * n) as f64 / secs / 1e9)
}

/// The machine's streaming read bandwidth in GB/s: all threads summing a
/// 256 MiB buffer (over twice the L3 of the development machine), best of
/// five passes. It is the ceiling decode runs against.
pub fn memory_read_gb_per_s() -> f64 {
    use rayon::prelude::*;
    let buf: Vec<f32> = (0..64usize << 20).map(|i| (i % 7) as f32).collect();
    let mut best = f64::INFINITY;
    let mut check = 0f32;
    for _ in 0..5 {
        let t = Instant::now();
        check += buf
            .par_chunks(1 << 20)
            .map(crate::kernels::sum)
            .sum::<f32>();
        best = best.min(t.elapsed().as_secs_f64());
    }
    // The sums are used, so the reads cannot be optimised away.
    std::hint::black_box(check);
    (buf.len() * 4) as f64 / best / 1e9
}

/// Bytes one decode step reads with f32 weights at context `position`: every
/// Pattention key and value matrix, the output matrix, and the cached keys
/// and values of all layers (norms and the one embedding row are noise).
pub fn decode_bytes_per_token(cfg: &Config, position: usize) -> f64 {
    let d = cfg.hidden_size;
    let tokens: usize = cfg.pattentions().iter().map(|(_, n)| n).sum();
    let weights = cfg.num_layers * 2 * tokens * d + cfg.vocab_size * d;
    let kv = cfg.num_layers * 2 * position * d;
    (4 * (weights + kv)) as f64
}

/// f32 matmul GFLOP/s at 2048³: the machine's ceiling for reference.
pub fn matmul_gflops(device: &Device) -> Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (2048, 2048), device)?;
    let b = Tensor::randn(0f32, 1.0, (2048, 2048), device)?;
    let secs = timed(|| {
        a.matmul(&b)?;
        Ok(())
    })?;
    Ok(2.0 * 2048f64.powi(3) / secs / 1e9)
}

/// Writes random fp16 weights as a model folder (like a converted release).
pub fn write_random(cfg: &Config, device: &Device) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir().map_err(|e| crate::Error::io(std::env::temp_dir(), e))?;
    let t = random_lm_tensors(cfg, DType::F16, device)?;
    let cfg_path = dir.path().join(crate::loader::CONFIG_FILE);
    std::fs::write(&cfg_path, serde_json::to_string(cfg).expect("serialisable"))
        .map_err(|e| crate::Error::io(&cfg_path, e))?;
    checkpoint::write_safetensors(dir.path(), &t, checkpoint::DEFAULT_SHARD_BYTES)?;
    Ok(dir)
}

/// Times loading a model folder with weight matrices kept in `weights`
/// precision; returns (model, seconds, peak MB during the load).
pub fn load_timed(
    dir: &std::path::Path,
    weights: DType,
    device: &Device,
) -> Result<(TokenFormerLm, f64, Option<f64>)> {
    // Give freed heap memory (earlier benchmarks' activations, which glibc
    // keeps for reuse) back to the system, so the peak is the load's own.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the malloc heap.
    unsafe {
        libc::malloc_trim(0);
    }
    let base = peak_rss_mb();
    let reset = reset_peak_rss();
    let start = Instant::now();
    let files = crate::loader::locate(&dir.display().to_string(), &Default::default())?;
    let model = crate::loader::load_lm_as(&files, device, weights)?;
    let secs = start.elapsed().as_secs_f64();
    let peak = if reset {
        peak_rss_mb()
    } else {
        base.and(peak_rss_mb())
    };
    Ok((model, secs, peak))
}

/// Runs the language-model benchmarks of `bench`; `only` (if non-empty)
/// restricts them to these names: load, prefill, decode, decode_f16,
/// pattention, matmul.
pub fn run_lm(
    name: &str,
    cfg: &Config,
    device: &Device,
    only: &[String],
) -> Result<Map<String, Value>> {
    let want = |k: &str| only.is_empty() || only.iter().any(|o| o == k);
    let mut out = Map::new();
    out.insert("peer".into(), json!("tokenformer-candle"));
    out.insert("model".into(), json!(name));
    out.insert(
        "threads".into(),
        json!(candle_core::utils::get_num_threads()),
    );
    // Measured first, while nothing else is resident, so its buffer does not
    // raise the peak memory reported at the end.
    let read_bw = want("decode").then(memory_read_gb_per_s);
    let dir = write_random(cfg, device)?;
    let (model, load_s, peak) = load_timed(dir.path(), DType::F32, device)?;
    out.insert("load_seconds".into(), json!(round(load_s, 3)));
    out.insert("load_peak_rss_mb".into(), json!(peak.map(|p| round(p, 1))));
    if want("prefill") {
        for (b, s) in [(1, 2048), (4, 512)] {
            let s = s.min(cfg.max_position_embeddings);
            let tps = prefill(&model, b, s)?;
            out.insert(
                format!("prefill_b{b}_s{s}_tokens_per_s"),
                json!(round(tps, 1)),
            );
        }
    }
    if let Some(bw) = read_bw {
        let (prompt, steps) = (512, 64);
        let tps = decode(&model, prompt, steps)?;
        // The average context over the timed steps.
        let bytes = decode_bytes_per_token(cfg, prompt + steps / 2);
        let limit = bw * 1e9 / bytes;
        out.insert("decode_tokens_per_s".into(), json!(round(tps, 2)));
        out.insert("memory_read_gb_per_s".into(), json!(round(bw, 1)));
        out.insert("decode_mb_per_token".into(), json!(round(bytes / 1e6, 1)));
        out.insert(
            "decode_bandwidth_limit_tokens_per_s".into(),
            json!(round(limit, 2)),
        );
        out.insert(
            "decode_fraction_of_limit".into(),
            json!(round(tps / limit, 2)),
        );
    }
    if want("decode_f16") {
        // Beyond the peer: the same checkpoint with f16 weight matrices (f32 compute).
        drop(model);
        let (half, load_s, peak) = load_timed(dir.path(), DType::F16, device)?;
        out.insert("load_f16_weights_seconds".into(), json!(round(load_s, 3)));
        out.insert(
            "load_f16_weights_peak_rss_mb".into(),
            json!(peak.map(|p| round(p, 1))),
        );
        out.insert(
            "decode_f16_weights_tokens_per_s".into(),
            json!(round(decode(&half, 512, 64)?, 2)),
        );
    }
    if want("pattention") {
        let g = pattention_gflops(2048, cfg.hidden_size, cfg.ffn_tokens, device)?;
        out.insert("pattention_gflops".into(), json!(round(g, 1)));
    }
    if want("vit") {
        out.insert(
            "vit_b16_images_per_s".into(),
            json!(round(vit_b16_images_per_s(device)?, 2)),
        );
    }
    if want("matmul") {
        out.insert(
            "matmul_f32_gflops".into(),
            json!(round(matmul_gflops(device)?, 1)),
        );
    }
    out.insert(
        "peak_rss_mb".into(),
        json!(peak_rss_mb().map(|p| round(p, 1))),
    );
    Ok(out)
}

/// The zoo's TokenFormer-B/16 config with random weights of the peer's
/// statistics (mean pooling, 1000 classes).
pub fn random_vit_b16(device: &Device) -> Result<(crate::models::vit::Config, Tensors)> {
    use crate::models::vit;
    let entry = crate::zoo::find("tokenformer-b-16").expect("zoo entry tokenformer-b-16");
    let cfg: vit::Config = serde_json::from_value(entry.config.clone())
        .map_err(|e| crate::Error::config("zoo/models.json", e))?;
    let d = cfg.hidden_size;
    let p = cfg.patch_size;
    let lm_like = Config {
        num_layers: cfg.num_layers,
        qkv_tokens: cfg.qkv_tokens,
        proj_tokens: cfg.proj_tokens,
        ffn_tokens: cfg.ffn_tokens,
        vocab_size: 1,
        ..Config::released(cfg.num_layers, d, cfg.num_heads)
    };
    let mut t = random_lm_tensors(&lm_like, DType::F32, device)?;
    t.retain(|k, _| k.starts_with("layers."));
    let r = |shape: &[usize], std: f32| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, shape, device)?)
    };
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, device);
    let ones = |n: usize| Tensor::ones(n, DType::F32, device);
    t.insert(
        "patch_embed.weight".into(),
        r(&[d, cfg.num_channels, p, p], 0.02)?,
    );
    t.insert("patch_embed.bias".into(), zeros(d)?);
    t.insert("cls_token".into(), r(&[1, 1, d], 0.02)?);
    t.insert("pos_embed".into(), r(&[1, cfg.num_patches() + 1, d], 0.02)?);
    // The head's norm: `fc_norm` after mean pooling, `final_norm` before the class token.
    let norm = match cfg.pool {
        vit::Pool::Mean => "fc_norm",
        vit::Pool::Cls => "final_norm",
    };
    t.insert(format!("{norm}.weight"), ones(d)?);
    t.insert(format!("{norm}.bias"), zeros(d)?);
    t.insert("head.weight".into(), r(&[cfg.num_classes, d], 0.02)?);
    t.insert("head.bias".into(), zeros(cfg.num_classes)?);
    Ok((cfg, t))
}

/// ViT-B/16 images/s at batch 32, 224² on [`random_vit_b16`] weights.
pub fn vit_b16_images_per_s(device: &Device) -> Result<f64> {
    let (cfg, t) = random_vit_b16(device)?;
    let model =
        crate::models::vit::VisionTransformer::new(&cfg, checkpoint::var_builder(t, device))?;
    let x = Tensor::randn(
        0f32,
        1.0,
        (32, cfg.num_channels, cfg.image_size, cfg.image_size),
        device,
    )?;
    let secs = timed(|| {
        model.forward(&x)?;
        Ok(())
    })?;
    Ok(32.0 / secs)
}

pub fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_reads_every_weight_matrix_and_the_cache() {
        // TokenFormer-150M: 12 layers, d 768, 3×768 qkv + 768 proj + 3072 ffn
        // parameter tokens with a key and a value matrix each, a 50304×768
        // output matrix, and at context 544 a 12×2×544×768 KV cache; f32.
        let cfg = lm_config("150m").unwrap();
        let floats = 12 * 2 * (3 * 768 + 768 + 3072) * 768 + 50_304 * 768 + 12 * 2 * 544 * 768;
        assert_eq!(decode_bytes_per_token(&cfg, 544), (4 * floats) as f64);
    }
}
