//! `tokenformer-convert official` on the shipped official-format fixture.

mod common;

use std::path::Path;
use std::process::Output;

use common::{lm_bin, load_lm, official_args, ok, run, s};
use sha2::{Digest, Sha256};

/// `official` on the fixture's .bin with the 150M zoo config, which does not fit it.
fn official_with_zoo_150m(out: &Path) -> Output {
    let bin = lm_bin();
    let args = [
        "official",
        "--input",
        s(&bin),
        "--zoo",
        "tokenformer-150m",
        "--out",
        s(out),
    ];
    run(&args, &[])
}

fn sha(p: &Path) -> String {
    format!("{:x}", Sha256::digest(std::fs::read(p).unwrap()))
}

#[test]
fn converts_checks_itself_and_loads_with_the_same_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny");
    let bin = lm_bin();
    let before = sha(&bin);
    let stdout = ok(&official_args(&out, ""));
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
    let (a, b) = (load_lm(&bin), load_lm(&out));
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
    let o = official_with_zoo_150m(&out);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("refusing to overwrite"));
}

#[test]
fn wrong_config_is_refused_and_nothing_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("bad");
    // The 150M config does not fit the tiny checkpoint.
    let o = official_with_zoo_150m(&out);
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
