//! `tokenformer-convert official` on the shipped official-format fixture.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/official-lm-tiny")
}

fn convert(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tokenformer-convert"))
        .args(args)
        .output()
        .unwrap()
}

fn sha(p: &Path) -> String {
    format!("{:x}", Sha256::digest(std::fs::read(p).unwrap()))
}

#[test]
fn converts_checks_itself_and_loads_with_the_same_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny");
    let bin = fixture().join("pytorch_model.bin");
    let before = sha(&bin);
    let o = convert(&[
        "official",
        "--input",
        bin.to_str().unwrap(),
        "--config",
        fixture().join("config.yml").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        stdout.contains("= 0.000e0") && stdout.contains("Looks ok!"),
        "{stdout}"
    );
    assert_eq!(sha(&bin), before, "input modified");
    for f in ["config.json", "model.safetensors", "README.md"] {
        assert!(out.join(f).exists(), "{f}");
    }
    // Only the final folder is left: no temporary siblings.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);

    // The folder scores exactly like the official checkpoint.
    let dev = candle_core::Device::Cpu;
    let a = tokenformer::loader::load_lm(
        &tokenformer::loader::locate(bin.to_str().unwrap(), &Default::default()).unwrap(),
        &dev,
    )
    .unwrap();
    let b = tokenformer::loader::load_lm(
        &tokenformer::loader::locate(out.to_str().unwrap(), &Default::default()).unwrap(),
        &dev,
    )
    .unwrap();
    let ids: Vec<u32> = (0..30).map(|i| i * 1601 % 50_000).collect();
    let (sa, sb) = (
        tokenformer::scoring::score_ids(&a, &ids).unwrap(),
        tokenformer::scoring::score_ids(&b, &ids).unwrap(),
    );
    assert_eq!(sa.next_token_logprobs, sb.next_token_logprobs);
    // fp16 in, fp16 stored.
    let infos = tokenformer::checkpoint::tensor_infos(&out.join("model.safetensors")).unwrap();
    assert!(infos.iter().all(|t| t.dtype == "f16"), "{infos:?}");

    // A second run refuses to overwrite; --force replaces.
    let o = convert(&[
        "official",
        "--input",
        bin.to_str().unwrap(),
        "--zoo",
        "tokenformer-150m",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("refusing to overwrite"));
}

#[test]
fn wrong_config_is_refused_and_nothing_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("bad");
    // The 150M config does not fit the tiny checkpoint.
    let o = convert(&[
        "official",
        "--input",
        fixture().join("pytorch_model.bin").to_str().unwrap(),
        "--zoo",
        "tokenformer-150m",
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("pytorch_model.bin") && !err.contains("panicked"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "left output behind"
    );
}
