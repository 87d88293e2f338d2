//! Helpers shared by the converter integration tests: the shipped fixtures,
//! running the `tokenformer-convert` binary, and loading what it wrote.

// Each test file is its own crate and uses only some of these.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use tokenformer::loader::{self, ModelFiles};
use tokenformer::models::tokenformer::TokenFormerLm;
use tokenformer::models::vit::VisionTransformer;

/// The workspace's shared test fixtures (`tests/fixtures`).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// The tiny checkpoint in the released (official) format, with its `config.yml`.
pub fn lm_fixture() -> PathBuf {
    fixtures().join("official-lm-tiny")
}

pub fn lm_bin() -> PathBuf {
    lm_fixture().join("pytorch_model.bin")
}

/// The tiny ViT classifier folder.
pub fn vit_dir() -> PathBuf {
    fixtures().join("vit-tiny-imagenet/vit-tiny")
}

/// The fixture images the tiny ViT is tested on.
pub fn fixture_pixels() -> Tensor {
    candle_core::safetensors::load(
        fixtures().join("vit-tiny-imagenet/pixels.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
    .remove("pixels")
    .unwrap()
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A command line: the `fixed` arguments, then the whitespace-separated `flags`
/// (so option lists read as they would be typed).
pub fn cmd(fixed: &[&str], flags: &str) -> Vec<String> {
    fixed
        .iter()
        .copied()
        .chain(flags.split_whitespace())
        .map(String::from)
        .collect()
}

/// `official` on the tiny released-format fixture with its `config.yml`, into `out`.
pub fn official_args(out: &Path, flags: &str) -> Vec<String> {
    let config = lm_fixture().join("config.yml");
    cmd(
        &[
            "official",
            "--input",
            s(&lm_bin()),
            "--config",
            s(&config),
            "--out",
            s(out),
        ],
        flags,
    )
}

/// `merge --vision <vision> --language <language> --bridge-tokens <bridge> --out <out>`.
pub fn merge_args<'a>(
    vision: &'a Path,
    language: &'a Path,
    bridge: &'a str,
    out: &'a Path,
) -> Vec<&'a str> {
    vec![
        "merge",
        "--vision",
        s(vision),
        "--language",
        s(language),
        "--bridge-tokens",
        bridge,
        "--out",
        s(out),
    ]
}

/// Runs `tokenformer-convert` with `args` and extra environment variables.
pub fn run<S: AsRef<OsStr>>(args: &[S], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tokenformer-convert"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run tokenformer-convert")
}

/// Runs a command that must succeed; returns its stdout.
pub fn ok<S: AsRef<OsStr> + Debug>(args: &[S]) -> String {
    let o = run(args, &[]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{args:?} failed:\n{out}\n{err}");
    out.into_owned()
}

/// Asserts that `o` is a failure and not a panic; returns its stderr.
fn failed<S: Debug>(args: &[S], o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        !o.status.success(),
        "{args:?} should have failed: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!err.contains("panicked"), "panicked: {err}");
    err
}

/// Runs a command that must fail without panicking; returns its stderr.
pub fn fails<S: AsRef<OsStr> + Debug>(args: &[S]) -> String {
    failed(args, &run(args, &[]))
}

/// Like [`fails`], and the failure must be a clean one: exit code 1 and a
/// message starting with `error: `.
pub fn fails_cleanly<S: AsRef<OsStr> + Debug>(args: &[S]) -> String {
    let o = run(args, &[]);
    let err = failed(args, &o);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert!(
        err.starts_with("error: "),
        "{args:?}: not a clean error: {err}"
    );
    err
}

pub fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Several integer config fields at once, so one assert can check them together.
pub fn config_u64s<const N: usize>(cfg: &Value, keys: [&str; N]) -> [Option<u64>; N] {
    keys.map(|k| cfg[k].as_u64())
}

/// A tensor's values as f32 (f16/bf16 widen exactly).
pub fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// The f32 bit patterns: equal bits mean equal stored values, whatever the dtype.
pub fn bits(t: &Tensor) -> Vec<u32> {
    values(t).iter().map(|v| v.to_bits()).collect()
}

/// The largest absolute elementwise difference.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    tokenformer::probe::max_abs_diff(a, b).unwrap()
}

/// The model files at a local path, found the way the CLI finds them.
pub fn locate(model: &Path) -> ModelFiles {
    loader::locate(s(model), &Default::default()).expect("locate")
}

pub fn load_lm(model: &Path) -> TokenFormerLm {
    loader::load_lm(&locate(model), &Device::Cpu).expect("load")
}

pub fn load_vit(model: &Path) -> VisionTransformer {
    loader::load_vit(&locate(model), &Device::Cpu).expect("load")
}

/// The `tokenformer` binary (for `train --distill-from`, compared with `import`):
/// `TOKENFORMER_BIN` if set, else the workspace's, built here first by cargo (a no-op
/// when it is up to date) so that it is never stale against the library this test
/// binary was built with. Cargo builds only the package under test's binaries.
///
/// `--workspace` resolves features as `cargo test --workspace` does (the Python
/// crate's dependencies turn on features of gemm's), so after that command the
/// binary is fresh; without it cargo built the library a second time (~3.5 minutes).
pub fn tokenformer_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TOKENFORMER_BIN") {
        return PathBuf::from(p);
    }
    let mut c = Command::new(env!("CARGO"));
    c.args(["build", "--quiet", "--workspace", "--bin", "tokenformer"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if !cfg!(debug_assertions) {
        c.arg("--release");
    }
    let o = c.output().expect("running cargo");
    assert!(
        o.status.success(),
        "building tokenformer: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Path::new(env!("CARGO_BIN_EXE_tokenformer-convert")).with_file_name("tokenformer")
}

/// `import --from <from> --input <input> --out <out>` and `extra`.
#[allow(dead_code)]
pub fn import_args(from: &str, input: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let fixed = [
        "import",
        "--from",
        from,
        "--input",
        s(input),
        "--out",
        s(out),
    ];
    fixed.iter().chain(extra).map(|x| x.to_string()).collect()
}
