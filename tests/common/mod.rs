//! Helpers shared by the integration tests: paths to the shipped fixtures,
//! random model folders, and running the CLI binaries.
#![allow(dead_code)]

pub mod hub_server;
pub mod steps;
pub mod train;

use std::path::{Path, PathBuf};
use std::process::Output;

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokenformer::checkpoint::{self, Tensors};
use tokenformer::models::tokenformer::Config;

/// The checkout the tests read from: where they were built, unless
/// `TOKENFORMER_TEST_ROOT` names a copy (test binaries carried to a GPU
/// machine run in another folder; `scripts/gpu-check.sh`).
pub fn root() -> PathBuf {
    std::env::var_os("TOKENFORMER_TEST_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The `tokenformer` binary: the one built with the tests, unless
/// `TOKENFORMER_BIN` names another (as for the Python tests).
pub fn bin() -> PathBuf {
    std::env::var_os("TOKENFORMER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tokenformer")))
}

pub fn fixtures() -> PathBuf {
    root().join("tests/fixtures")
}

/// A shipped model or example under `zoo/`.
pub fn zoo(name: &str) -> PathBuf {
    root().join("zoo").join(name)
}

/// The shipped digit images (`zoo/examples/digits/<class>/*.png`), sorted.
pub fn digit_images() -> Vec<PathBuf> {
    let mut images: Vec<PathBuf> = std::fs::read_dir(zoo("examples").join("digits"))
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
        .map(|f| f.unwrap().path())
        .collect();
    images.sort();
    images
}

/// The shipped merged model's greedy continuations of "a handwritten" (up to
/// `n` tokens) after each of [`digit_images`], decoded together on `device`
/// as `generate --prompts` does.
pub fn digit_captions(
    model: &tokenformer::VisionLanguageModel,
    tokenizer: &tokenizers::Tokenizer,
    device: &Device,
    n: usize,
) -> Vec<Vec<u32>> {
    let transform = tokenformer::vision::EvalTransform::from_config(model.vision().config());
    let images: Vec<Tensor> = digit_images()
        .iter()
        .map(|p| {
            let px = transform.load(p).unwrap();
            transform.batch(vec![px], device).unwrap()
        })
        .collect();
    let prompt = tokenizer.encode("a handwritten", false).unwrap();
    let prompts = vec![prompt.get_ids().to_vec(); images.len()];
    let params = tokenformer::SamplingParams::default();
    let kv = tokenformer::KvDtype::F32;
    tokenformer::generate::generate_batch_with_images(
        model,
        kv,
        &images,
        &prompts,
        n,
        params,
        8,
        |_, _| Ok(std::ops::ControlFlow::Continue(())),
    )
    .unwrap()
}

/// max |a − b| / max(1, |b|): relative for large values, absolute for small.
pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, f32::max)
}

pub fn lm_fixture() -> PathBuf {
    fixtures().join("official-lm-tiny")
}

pub fn tokenizer_fixture() -> PathBuf {
    fixtures().join("gpt-neox-20b-tokenizer.json")
}

pub fn expected_lm() -> serde_json::Value {
    let text = std::fs::read_to_string(lm_fixture().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Normal(0, std) tensor of `shape` from a seeded generator.
pub fn randn(rng: &mut StdRng, shape: &[usize], std: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            // Box-Muller: rand has no normal distribution without rand_distr.
            let (u1, u2): (f32, f32) = (rng.random::<f32>().max(1e-12), rng.random());
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos() * std
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Random weights for a language-model config, with canonical names.
pub fn random_lm_tensors(cfg: &Config, seed: u64) -> Tensors {
    let mut rng = StdRng::seed_from_u64(seed);
    let d = cfg.hidden_size;
    let mut t = Tensors::new();
    t.insert(
        "word_embeddings.weight".into(),
        randn(&mut rng, &[cfg.vocab_size, d], 1.0),
    );
    for i in 0..cfg.num_layers {
        for (m, n) in cfg.pattentions() {
            // Key std 1/√d keeps the scores O(1), as in trained models.
            let key_std = 1.0 / (d as f32).sqrt();
            t.insert(
                format!("layers.{i}.{m}.key_param_tokens"),
                randn(&mut rng, &[n, d], key_std),
            );
            t.insert(
                format!("layers.{i}.{m}.value_param_tokens"),
                randn(&mut rng, &[n, d], 0.2),
            );
        }
    }
    t.insert(
        "final_norm.weight".into(),
        (randn(&mut rng, &[d], 0.1) + 1.0).unwrap(),
    );
    t.insert("final_norm.bias".into(), randn(&mut rng, &[d], 0.1));
    if !cfg.tie_word_embeddings {
        t.insert(
            "final_linear.weight".into(),
            randn(&mut rng, &[cfg.vocab_size, d], 0.5),
        );
    }
    t
}

/// Writes a canonical model folder (config.json + model.safetensors) into `dir`.
pub fn write_lm_folder(dir: &Path, cfg: &Config, tensors: &Tensors) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(cfg).unwrap(),
    )
    .unwrap();
    checkpoint::write_safetensors(dir, tensors, checkpoint::DEFAULT_SHARD_BYTES).unwrap();
}

/// A small config for tests.
pub fn tiny_config(vocab: usize, max_pos: usize) -> Config {
    let mut c = Config::released(2, 32, 2);
    c.qkv_tokens = 24;
    c.proj_tokens = 20;
    c.ffn_tokens = 48;
    c.vocab_size = vocab;
    c.max_position_embeddings = max_pos;
    c
}

pub fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Runs the `tokenformer` binary; returns (output, stdout, stderr).
pub fn tokenformer(args: &[&str]) -> (Output, String, String) {
    run(bin(), args)
}

pub fn run(bin: impl AsRef<Path>, args: &[&str]) -> (Output, String, String) {
    let bin = bin.as_ref();
    let out = std::process::Command::new(bin)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env(
            "HF_HOME",
            std::env::temp_dir().join("tokenformer-tests-no-hub"),
        )
        .output()
        .expect("binary runs");
    let so = String::from_utf8_lossy(&out.stdout).into_owned();
    let se = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, so, se)
}

/// A failed run: non-zero exit, no panic, and stderr mentions every `needle`.
pub fn assert_clean_failure(res: &(Output, String, String), needles: &[&str]) {
    let (out, _, err) = res;
    assert!(!out.status.success(), "expected failure, stderr: {err}");
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention {n:?}: {err}");
    }
}

/// The largest |a − b| over two slices of one length.
pub fn max_abs_diff_of(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// The largest |a − b| over two tensors of one shape (as f32).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
