//! `tokenformer bench`: throughput on random weights of the real sizes (no
//! download): prefill, KV-cache decode (f32 weights, and f16 or 8-bit weights,
//! with the 8-bit weights' accuracy cost; f16 weights with an f16 cache, with
//! the f16 cache's accuracy cost), a single
//! Pattention layer, ViT-B/16 images/s, load time / peak memory, and the CPU
//! and kernel path the figures come from.
//! Field names follow the PyTorch peer (`bench/torch_baseline.py` of the
//! shared data) so the two JSON outputs can be compared key by key; like the
//! peer, each figure is the second of two runs.

use std::time::Instant;

use anyhow::{anyhow, bail};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use serde_json::{json, Map, Value};

use crate::cli::stdout::outln;
use tokenformer::checkpoint::{self, Tensors};
use tokenformer::error::Result;
use tokenformer::models::tokenformer::{Cache, Config, KvDtype, Logits, TokenFormerLm};
use tokenformer::pattention::{Activation, Pattention};
use tokenformer::synthetic::{lm_config, logit_agreement, random_lm_tensors, LogitAgreement};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Shape to benchmark: 150m, 450m, 900m or 1.5b (random weights).
    #[arg(long, default_value = "150m")]
    pub config: String,
    /// Skip the ViT-B/16 image benchmark.
    #[arg(long)]
    pub skip_vit: bool,
    /// Run only these parts (comma-separated): prefill, decode, decode_f16, decode_q8,
    /// decode_f16_kv (f16 weights and KV cache), decode_batch (8 sequences decoded together,
    /// as `generate --prompts` does), pattention, matmul, vit, train (training
    /// throughput; not run unless named). `TOKENFORMER_KERNELS=portable|avx2|avx512` forces a
    /// kernel path.
    /// On a GPU (`--device cuda`): prefill, ops (where a prefill's time goes, piece by
    /// piece), decode (batch 1, and 32 sequences together), vit, train (all by default).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// The KV cache of the decode, decode_f16 and decode_q8 parts (decode_f16_kv's is f16).
    #[arg(long, value_enum, default_value_t)]
    pub kv_dtype: super::KvDtypeArg,
    /// Tokens prefilled before the timed decode steps (the cache they read grows from there).
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub decode_context: usize,
    /// Print one JSON object (the peer's field names).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub device: super::DeviceArgs,
}

/// The parts `--only` names on the CPU.
const CPU_PARTS: [&str; 11] = [
    "load",
    "prefill",
    "decode",
    "decode_f16",
    "decode_q8",
    "decode_f16_kv",
    "decode_batch",
    "pattention",
    "matmul",
    "vit",
    "train",
];

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let dev = a.device.open()?;
    let parts: &[&str] = if dev.is_cpu() {
        &CPU_PARTS
    } else {
        &super::bench_gpu::PARTS
    };
    if let Some(bad) = a.only.iter().find(|o| !parts.contains(&o.as_str())) {
        bail!(
            "--only {bad}: not a part of `bench` on this device ({})",
            parts.join(", ")
        );
    }
    if !dev.is_cpu() {
        let out = super::bench_gpu::run(&dev, &a.only)?;
        if a.json {
            outln!("{}", serde_json::to_string(&out)?)?;
        } else {
            for (k, v) in &out {
                outln!("{k:<44} {v}")?;
            }
        }
        return Ok(());
    }
    let cfg = lm_config(&a.config)
        .ok_or_else(|| anyhow!("unknown --config `{}` (150m, 450m, 900m, 1.5b)", a.config))?;
    let mut only = a.only.clone();
    if a.skip_vit {
        if only.is_empty() {
            // Everything that runs by default (`train` only when named).
            only = CPU_PARTS
                .iter()
                .filter(|&&p| p != "train")
                .map(|&p| p.into())
                .collect();
        }
        only.retain(|o| o != "vit");
    }
    // `train` (only when asked for): training throughput, see bench_train.
    let train = only.iter().any(|o| o == "train");
    only.retain(|o| o != "train");
    let mut out = if train && only.is_empty() {
        serde_json::Map::new()
    } else {
        let decode = DecodeSetup {
            kv: a.kv_dtype.into(),
            context: a.decode_context,
        };
        run_lm(&a.config, &cfg, &dev, &only, decode)?
    };
    if train {
        out.extend(super::bench_train::run(&dev)?);
    }
    if a.json {
        outln!("{}", serde_json::to_string(&out)?)?;
    } else {
        for (k, v) in &out {
            outln!("{k:<32} {v}")?;
        }
    }
    Ok(())
}

/// Seconds of the second of two runs (the first warms caches and allocators).
fn timed(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// Runs one part of a bench into `out`; a part that fails (out of memory, say) is
/// reported under `{name}_error` and the others still run, so that one call on a lent
/// GPU returns every figure it can.
pub fn part(
    out: &mut Map<String, Value>,
    name: &str,
    f: impl FnOnce(&mut Map<String, Value>) -> anyhow::Result<()>,
) {
    if let Err(e) = f(out) {
        eprintln!("warning: bench part {name} failed: {e:#}");
        out.insert(format!("{name}_error"), json!(format!("{e:#}")));
    }
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

/// One model's decode in [`decode`]: its rate and the tokens it chose.
pub struct Decoded {
    pub tokens_per_s: f64,
    pub ids: Vec<u32>,
}

/// Decodes `n` greedy tokens (rounded down to a multiple of `rounds`) after
/// a `prompt`-token prefill with each model and its cache precision, timed in `rounds` turns of
/// n / rounds tokens, one model after the other, each continuing its own
/// cache. A shared host's speed drifts by ±20 % within a minute, so decodes
/// timed one after another would compare different moments; in turns,
/// every model meets the same moments and their ratios hold.
pub fn decode(
    models: &[(&TokenFormerLm, KvDtype)],
    prompt: usize,
    n: usize,
    rounds: usize,
) -> Result<Vec<Decoded>> {
    let rounds = rounds.max(1);
    let per = n / rounds;
    let mut state = Vec::with_capacity(models.len());
    for &(model, kv) in models {
        let vocab = model.config().vocab_size.min(50_277);
        let x = ids(1, prompt, vocab, model.device())?;
        let mut cache = Cache::with_dtype(model.config(), kv);
        // As generation prefills: the last position's logits only.
        let logits = model.forward_with(&x, Some(&mut cache), Logits::Last)?;
        let tok = logits.get(0)?.get(0)?.argmax(0)?.to_scalar::<u32>()?;
        state.push((cache, vec![tok], 0f64));
    }
    for _ in 0..rounds {
        for ((model, _), (cache, chosen, secs)) in models.iter().zip(&mut state) {
            let t = Instant::now();
            for _ in 0..per {
                let last = *chosen.last().expect("the prefill's token");
                let x = Tensor::new(&[[last]], model.device())?;
                let logits = model.forward(&x, Some(cache))?;
                chosen.push(logits.get(0)?.get(0)?.argmax(0)?.to_scalar::<u32>()?);
            }
            *secs += t.elapsed().as_secs_f64();
        }
    }
    Ok(state
        .into_iter()
        .map(|(_, mut chosen, secs)| Decoded {
            tokens_per_s: (per * rounds) as f64 / secs,
            ids: chosen.split_off(1),
        })
        .collect())
}

/// Tokens per second of `rows` sequences decoded together (batched
/// generation, [`TokenFormerLm::forward_rows`]): each prefilled alone with
/// its own `prompt` tokens, then `steps` greedy steps of all rows, timed.
pub fn decode_rows(model: &TokenFormerLm, rows: usize, prompt: usize, steps: usize) -> Result<f64> {
    let vocab = model.config().vocab_size.min(50_277);
    let mut caches = Vec::with_capacity(rows);
    let mut last = Vec::with_capacity(rows);
    for r in 0..rows {
        // Each row its own prompt, so the rows attend over different caches.
        let v: Vec<u32> = (0..prompt as u64)
            .map(|i| ((i * 2_654_435_761 + r as u64 * 7_919) % vocab as u64) as u32)
            .collect();
        let x = Tensor::from_vec(v, (1, prompt), model.device())?;
        let mut cache = Cache::with_dtype(model.config(), KvDtype::F32);
        let logits = model.forward_with(&x, Some(&mut cache), Logits::Last)?;
        last.push(logits.get(0)?.get(0)?.argmax(0)?.to_scalar::<u32>()?);
        caches.push(cache);
    }
    let t = Instant::now();
    for _ in 0..steps {
        let x = Tensor::new(&last[..], model.device())?.unsqueeze(1)?;
        let mut refs: Vec<&mut Cache> = caches.iter_mut().collect();
        let logits = model.forward_rows(&x, &mut refs)?;
        last = logits.squeeze(1)?.argmax(1)?.to_vec1::<u32>()?;
    }
    Ok((rows * steps) as f64 / t.elapsed().as_secs_f64())
}

/// GFLOP/s of one Pattention layer (rows × d_in → n tokens → d_out), counting
/// the two matmuls.
pub fn pattention_gflops(rows: usize, d: usize, n: usize, device: &Device) -> Result<f64> {
    let p = Pattention::from_tensors(
        Tensor::randn(0f32, 1.0, (n, d), device)?,
        Tensor::randn(0f32, 0.02, (n, d), device)?,
        Activation::L2NormGelu,
        None,
    )?;
    let x = Tensor::randn(0f32, 1.0, (rows, d), device)?;
    let secs = timed(|| {
        candle_core::Module::forward(&p, &x)?;
        Ok(())
    })?;
    Ok(4.0 * (rows * d * n) as f64 / secs / 1e9)
}

/// The machine's streaming read bandwidth, the ceiling decode runs against:
/// all threads summing a 256 MiB buffer (several times the L3 of the
/// development machines), kept for repeated passes.
pub struct ReadProbe(Vec<f32>);

impl ReadProbe {
    pub fn new() -> Self {
        Self((0..64usize << 20).map(|i| (i % 7) as f32).collect())
    }

    /// GB/s of each of `n` passes, all threads summing the buffer.
    pub fn passes(&self, n: usize) -> Vec<f64> {
        use rayon::prelude::*;
        let mut check = 0f32;
        let gbs = (0..n)
            .map(|_| {
                let t = Instant::now();
                check += self
                    .0
                    .par_chunks(1 << 20)
                    .map(tokenformer::kernels::sum)
                    .sum::<f32>();
                (self.0.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
            })
            .collect();
        // The sums are used, so the reads cannot be optimised away.
        std::hint::black_box(check);
        gbs
    }

    /// Runs `f` between five passes before and five after: (its result,
    /// the best pass, the worst pass). The host drifts by ±15 % within
    /// minutes, so the ceiling of a measurement is the bandwidth of the
    /// moments around it, not of the start of the run.
    pub fn around<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, f64, f64)> {
        let mut gbs = self.passes(5);
        let r = f()?;
        gbs.extend(self.passes(5));
        let best = gbs.iter().cloned().fold(0.0, f64::max);
        let worst = gbs.iter().cloned().fold(f64::INFINITY, f64::min);
        Ok((r, best, worst))
    }
}

impl Default for ReadProbe {
    fn default() -> Self {
        Self::new()
    }
}

/// Bytes one decode step reads with f32 weights at context `position`: every
/// Pattention key and value matrix, the output matrix, and the cached keys
/// and values of all layers (norms and the one embedding row are noise).
#[cfg(test)]
fn decode_bytes_per_token(cfg: &Config, position: usize) -> f64 {
    decode_bytes_per_token_as(cfg, position, WeightFormat::F32, KvDtype::F32)
}

/// [`decode_bytes_per_token`] with weights in `weights` precision and the
/// KV cache in `kv`.
pub fn decode_bytes_per_token_as(
    cfg: &Config,
    position: usize,
    weights: WeightFormat,
    kv: KvDtype,
) -> f64 {
    let d = cfg.hidden_size;
    let tokens: usize = cfg.pattentions().iter().map(|(_, n)| n).sum();
    let matrices = cfg.num_layers * 2 * tokens * d + cfg.vocab_size * d;
    let cached = cfg.num_layers * 2 * position * d;
    matrices as f64 * weights.bytes_per_weight() + (cached * kv.dtype().size_in_bytes()) as f64
}

/// What the decode parts run with: the KV cache of decode, decode_f16 and
/// decode_q8, and the prompt before the timed steps.
#[derive(Clone, Copy, Debug)]
pub struct DecodeSetup {
    pub kv: KvDtype,
    pub context: usize,
}

/// A reduced-precision variant's accuracy against the f32 model, under
/// `prefix`: both perplexities, their change, the mean KL divergence and the
/// fraction of positions whose most likely next token is f32's.
fn agreement_metrics(out: &mut Map<String, Value>, prefix: &str, a: &LogitAgreement) {
    let (ppl, other) = (a.reference_perplexity, a.perplexity);
    out.insert(format!("{prefix}_perplexity_f32"), json!(round(ppl, 3)));
    out.insert(format!("{prefix}_perplexity"), json!(round(other, 3)));
    out.insert(
        format!("{prefix}_perplexity_change_percent"),
        json!(round(100.0 * (other / ppl - 1.0), 4)),
    );
    out.insert(format!("{prefix}_mean_kl_divergence"), json!(a.mean_kl));
    out.insert(
        format!("{prefix}_top1_agreement"),
        json!(round(a.top1_agreement, 4)),
    );
}

/// The CPU the figures come from: its model name, the features the kernels
/// use (those it has), and the kernel path taken (`TOKENFORMER_KERNELS`).
pub fn cpu_info() -> Value {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let mut features: Vec<&str> = Vec::new();
    for isa in tokenformer::kernels::Isa::ALL {
        if isa.is_supported() {
            for f in isa.features() {
                if !features.contains(f) {
                    features.push(f);
                }
            }
        }
    }
    let sel = tokenformer::kernels::selection();
    json!({
        "model": model,
        "features": features,
        "kernels": sel.path.isa().as_str(),
        "kernels_requested": sel.requested,
        "kernels_warning": sel.warning,
    })
}

/// f32 matmul GFLOP/s at 2048³: the machine's ceiling for reference, by the
/// gemm the model's products use (on the kernel path chosen).
pub fn matmul_gflops(device: &Device) -> Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (2048, 2048), device)?;
    let b = Tensor::randn(0f32, 1.0, (2048, 2048), device)?;
    let secs = timed(|| {
        tokenformer::kernels::matmul_nn(&a, &b)?;
        Ok(())
    })?;
    Ok(2.0 * 2048f64.powi(3) / secs / 1e9)
}

/// The seed of the benchmarks' random models: every run measures the same
/// weights, so the 8-bit accuracy figures (and the greedy tokens) of two runs
/// or two hosts are of one model.
const SEED: u64 = 0;

/// Writes random fp16 weights as a model folder (like a converted release).
pub fn write_random(cfg: &Config, device: &Device) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir().map_err(|e| tokenformer::Error::io(std::env::temp_dir(), e))?;
    let t = random_lm_tensors(cfg, DType::F16, SEED, device)?;
    let cfg_path = dir.path().join(tokenformer::loader::CONFIG_FILE);
    std::fs::write(&cfg_path, serde_json::to_string(cfg).expect("serialisable"))
        .map_err(|e| tokenformer::Error::io(&cfg_path, e))?;
    checkpoint::write_safetensors(dir.path(), &t, checkpoint::DEFAULT_SHARD_BYTES)?;
    Ok(dir)
}

/// The precision a benchmarked model keeps its weight matrices in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    F16,
    /// 8-bit blocks quantised at load ([`TokenFormerLm::quantize_q8`]).
    Q8,
}

impl WeightFormat {
    /// Bytes a decode step reads per weight.
    pub fn bytes_per_weight(self) -> f64 {
        match self {
            WeightFormat::F32 => 4.0,
            WeightFormat::F16 => 2.0,
            WeightFormat::Q8 => 1.0 + 4.0 / tokenformer::kernels::q8::BLOCK as f64,
        }
    }
}

/// Times loading a model folder with weight matrices kept in `weights`
/// precision; returns (model, seconds, peak MB during the load).
pub fn load_timed(
    dir: &std::path::Path,
    weights: WeightFormat,
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
    let files = tokenformer::loader::locate(&dir.display().to_string(), &Default::default())?;
    let model = match weights {
        WeightFormat::F32 => tokenformer::loader::load_lm_as(&files, device, DType::F32)?,
        WeightFormat::F16 => tokenformer::loader::load_lm_as(&files, device, DType::F16)?,
        WeightFormat::Q8 => tokenformer::loader::load_lm_q8(&files, device)?,
    };
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
/// decode_q8, decode_f16_kv, decode_batch, pattention, matmul, vit.
pub fn run_lm(
    name: &str,
    cfg: &Config,
    device: &Device,
    only: &[String],
    setup: DecodeSetup,
) -> Result<Map<String, Value>> {
    let prompt = setup.context;
    if prompt == 0 || prompt + 64 > cfg.max_position_embeddings {
        return Err(tokenformer::Error::input(format!(
            "--decode-context {prompt}: between 1 and {} (the 64 decoded tokens must fit the model's {} positions)",
            cfg.max_position_embeddings.saturating_sub(64),
            cfg.max_position_embeddings
        )));
    }
    let want = |k: &str| only.is_empty() || only.iter().any(|o| o == k);
    let mut out = Map::new();
    out.insert("peer".into(), json!("tokenformer-candle"));
    out.insert("model".into(), json!(name));
    out.insert("model_seed".into(), json!(SEED));
    out.insert(
        "threads".into(),
        json!(candle_core::utils::get_num_threads()),
    );
    out.insert("cpu".into(), cpu_info());
    let dir = write_random(cfg, device)?;
    let (model, load_s, peak) = load_timed(dir.path(), WeightFormat::F32, device)?;
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
    if want("decode_q8") {
        // The 8-bit weights' accuracy cost: this model's next-token
        // distributions on a fixed token sequence against those of its
        // weights quantised as `--weight-dtype q8` loads them. Done here, so
        // the logits are not resident while loads are measured below.
        let text = ids(1, 512.min(cfg.max_position_embeddings), 50_277, device)?;
        let reference = model.forward(&text, None)?.squeeze(0)?;
        let logits = model
            .clone()
            .quantize_q8()?
            .forward(&text, None)?
            .squeeze(0)?;
        let ids: Vec<u32> = text.flatten_all()?.to_vec1()?;
        agreement_metrics(&mut out, "q8", &logit_agreement(&reference, &logits, &ids)?);
    }
    if want("decode_f16_kv") {
        // The f16 KV cache's accuracy cost, measured as the 8-bit weights'
        // is: the same sequence through a cache that keeps its keys and
        // values in f16 (every position attends to rounded ones).
        let text = ids(1, 512.min(cfg.max_position_embeddings), 50_277, device)?;
        let reference = model.forward(&text, None)?.squeeze(0)?;
        let mut cache = Cache::with_dtype(cfg, KvDtype::F16);
        let logits = model.forward(&text, Some(&mut cache))?.squeeze(0)?;
        let ids: Vec<u32> = text.flatten_all()?.to_vec1()?;
        agreement_metrics(
            &mut out,
            "kv_f16",
            &logit_agreement(&reference, &logits, &ids)?,
        );
    }
    if want("decode_batch") {
        let rows = tokenformer::kernels::SMALL_ROWS;
        let tps = decode_rows(&model, rows, prompt, 32)?;
        out.insert(
            format!("decode_batch{rows}_tokens_per_s"),
            json!(round(tps, 2)),
        );
    }
    drop(model);
    // Each load alone in memory, so its peak is its own.
    if want("decode_f16") {
        // Beyond the peer: the same checkpoint with f16 weight matrices (f32 compute).
        let (_, load_s, peak) = load_timed(dir.path(), WeightFormat::F16, device)?;
        out.insert("load_f16_weights_seconds".into(), json!(round(load_s, 3)));
        out.insert(
            "load_f16_weights_peak_rss_mb".into(),
            json!(peak.map(|p| round(p, 1))),
        );
    }
    if want("decode_q8") {
        // And with 8-bit weights quantised at load.
        let (q8, load_s, peak) = load_timed(dir.path(), WeightFormat::Q8, device)?;
        out.insert("load_q8_weights_seconds".into(), json!(round(load_s, 3)));
        out.insert(
            "load_q8_weights_peak_rss_mb".into(),
            json!(peak.map(|p| round(p, 1))),
        );
        out.insert(
            "q8_weights_mb".into(),
            json!(round(q8.weight_bytes() as f64 / 1e6, 1)),
        );
    }
    let formats: Vec<(&str, WeightFormat, KvDtype)> = [
        ("decode", WeightFormat::F32, setup.kv),
        ("decode_f16", WeightFormat::F16, setup.kv),
        ("decode_q8", WeightFormat::Q8, setup.kv),
        ("decode_f16_kv", WeightFormat::F16, KvDtype::F16),
    ]
    .into_iter()
    .filter(|(k, _, _)| want(k))
    .collect();
    if !formats.is_empty() {
        out.insert(
            "decode_kv_dtype".into(),
            json!(match setup.kv {
                KvDtype::F32 => "f32",
                KvDtype::F16 => "f16",
            }),
        );
        out.insert("decode_context".into(), json!(prompt));
        // Decode is bound by reading memory: the decodes are timed between
        // passes of a streaming read, whose best is their ceiling (limit)
        // and whose worst shows how much the host drifted meanwhile. The
        // probe's buffer is allocated after the models are loaded.
        let models = formats
            .iter()
            .map(|&(_, w, _)| Ok(load_timed(dir.path(), w, device)?.0))
            .collect::<Result<Vec<_>>>()?;
        let (steps, rounds) = (64, 8);
        // The average context over the timed steps.
        let position = prompt + steps / 2;
        let runs: Vec<_> = models.iter().zip(&formats).map(|(m, f)| (m, f.2)).collect();
        let (decoded, best, worst) =
            ReadProbe::new().around(|| decode(&runs, prompt, steps, rounds))?;
        for (&(prefix, weights, kv), decoded) in formats.iter().zip(&decoded) {
            let tps = decoded.tokens_per_s;
            let bytes = decode_bytes_per_token_as(cfg, position, weights, kv);
            let limit = best * 1e9 / bytes;
            let key = match prefix {
                "decode" => "decode_tokens_per_s",
                "decode_f16" => "decode_f16_weights_tokens_per_s",
                "decode_q8" => "decode_q8_weights_tokens_per_s",
                _ => "decode_f16_weights_f16_kv_tokens_per_s",
            };
            out.insert(key.into(), json!(round(tps, 2)));
            out.insert(
                format!("{prefix}_fraction_of_limit"),
                json!(round(tps / limit, 2)),
            );
            if prefix == "decode" {
                out.insert("decode_mb_per_token".into(), json!(round(bytes / 1e6, 1)));
                out.insert(
                    "decode_bandwidth_limit_tokens_per_s".into(),
                    json!(round(limit, 2)),
                );
            }
        }
        out.insert("memory_read_gb_per_s".into(), json!(round(best, 1)));
        out.insert("memory_read_gb_per_s_worst".into(), json!(round(worst, 1)));
        // The 8-bit path of decoding (the integer kernel, which the
        // perplexity above does not take), and the f16 cache's (its
        // decoding kernels): how many of the greedy tokens each picks
        // before it first departs from f32's.
        let ids = |part| {
            formats
                .iter()
                .position(|f| f.0 == part)
                .map(|i| &decoded[i].ids)
        };
        if let Some(f32_ids) = ids("decode") {
            for part in ["decode_q8", "decode_f16_kv"] {
                if let Some(other) = ids(part) {
                    let same = f32_ids
                        .iter()
                        .zip(other)
                        .take_while(|(a, b)| a == b)
                        .count();
                    out.insert(format!("{part}_tokens_matching_f32"), json!(same));
                }
            }
        }
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
pub fn random_vit_b16(device: &Device) -> Result<(tokenformer::models::vit::Config, Tensors)> {
    use tokenformer::models::vit;
    let entry = tokenformer::zoo::find("tokenformer-b-16").expect("zoo entry tokenformer-b-16");
    let cfg: vit::Config = serde_json::from_value(entry.config.clone())
        .map_err(|e| tokenformer::Error::config("zoo/models.json", e))?;
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
    let mut t = random_lm_tensors(&lm_like, DType::F32, SEED, device)?;
    t.retain(|k, _| k.starts_with("layers."));
    let r = |shape: &[usize], name: &str| -> Result<Tensor> {
        Ok(tokenformer::init::normal_tensor(
            shape, 0.02, SEED, name, device,
        )?)
    };
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, device);
    let ones = |n: usize| Tensor::ones(n, DType::F32, device);
    t.insert(
        "patch_embed.weight".into(),
        r(&[d, cfg.num_channels, p, p], "patch_embed.weight")?,
    );
    t.insert("patch_embed.bias".into(), zeros(d)?);
    t.insert("cls_token".into(), r(&[1, 1, d], "cls_token")?);
    t.insert(
        "pos_embed".into(),
        r(&[1, cfg.num_patches() + 1, d], "pos_embed")?,
    );
    // The head's norm: `fc_norm` after mean pooling, `final_norm` before the class token.
    let norm = match cfg.pool {
        vit::Pool::Mean => "fc_norm",
        vit::Pool::Cls => "final_norm",
    };
    t.insert(format!("{norm}.weight"), ones(d)?);
    t.insert(format!("{norm}.bias"), zeros(d)?);
    t.insert(
        "head.weight".into(),
        r(&[cfg.num_classes, d], "head.weight")?,
    );
    t.insert("head.bias".into(), zeros(cfg.num_classes)?);
    Ok((cfg, t))
}

/// ViT-B/16 images/s at batch 32, 224² on [`random_vit_b16`] weights.
pub fn vit_b16_images_per_s(device: &Device) -> Result<f64> {
    let (cfg, t) = random_vit_b16(device)?;
    let model =
        tokenformer::models::vit::VisionTransformer::new(&cfg, checkpoint::var_builder(t, device))?;
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
        // 8-bit weights: 1 byte and a 4-byte scale per 32 weights; the cache stays f32.
        let weights = 12 * 2 * (3 * 768 + 768 + 3072) * 768 + 50_304 * 768;
        let q8 = decode_bytes_per_token_as(&cfg, 544, WeightFormat::Q8, KvDtype::F32);
        assert_eq!(q8, weights as f64 * 1.125 + (4 * 12 * 2 * 544 * 768) as f64);
        // f16 weights and an f16 cache: two bytes each.
        let half = decode_bytes_per_token_as(&cfg, 544, WeightFormat::F16, KvDtype::F16);
        assert_eq!(half, (2 * floats) as f64);
    }

    #[test]
    fn decoding_in_turns_keeps_each_models_own_sequence() {
        let device = Device::Cpu;
        let cfg = Config {
            vocab_size: 300,
            qkv_tokens: 24,
            proj_tokens: 16,
            ffn_tokens: 40,
            max_position_embeddings: 64,
            ..Config::released(2, 32, 4)
        };
        let model = |seed: u64| {
            let t = random_lm_tensors(&cfg, DType::F32, seed, &device).unwrap();
            TokenFormerLm::new(&cfg, checkpoint::var_builder(t, &device)).unwrap()
        };
        let (a, b) = (model(1), model(2));
        let alone = |m: &TokenFormerLm| {
            decode(&[(m, KvDtype::F32)], 16, 12, 1)
                .unwrap()
                .remove(0)
                .ids
        };
        let (want_a, want_b) = (alone(&a), alone(&b));
        assert_eq!(want_a.len(), 12);
        // Two different models, or the test could not tell their caches apart.
        assert_ne!(want_a, want_b);
        let runs = [(&a, KvDtype::F32), (&b, KvDtype::F32), (&a, KvDtype::F16)];
        let turns = decode(&runs, 16, 12, 4).unwrap();
        assert_eq!(turns[0].ids, want_a);
        assert_eq!(turns[1].ids, want_b);
        // The f16 cache's greedy tokens on this model are f32's.
        assert_eq!(turns[2].ids, want_a);
        assert!(turns
            .iter()
            .all(|d| d.tokens_per_s.is_finite() && d.tokens_per_s > 0.0));
    }
}
