//! Bad input through the `tokenformer` binary: every case exits 1 with a
//! message naming the file or tensor at fault (2 for a flag's value refused
//! while the command line is read), and never panics.

mod common;

use std::path::Path;

use common::*;

fn tiny_folder(
    dir: &Path,
    edit: impl FnOnce(&mut serde_json::Value, &mut tokenformer::checkpoint::Tensors),
) {
    let cfg = tiny_config(50_304, 16);
    let mut tensors = random_lm_tensors(&cfg, 5);
    let mut json = serde_json::to_value(&cfg).unwrap();
    edit(&mut json, &mut tensors);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    tokenformer::checkpoint::write_safetensors(dir, &tensors, u64::MAX).unwrap();
    std::fs::copy(tokenizer_fixture(), dir.join("tokenizer.json")).unwrap();
}

/// `score --model MODEL --ids 1,2,3`: the probe every loading case uses.
fn score_123(model: &str) -> (std::process::Output, String, String) {
    tokenformer(&["score", "--model", model, "--ids", "1,2,3"])
}

#[test]
fn truncated_official_bin() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(lm_fixture().join("pytorch_model.bin")).unwrap();
    let bin = dir.path().join("pytorch_model.bin");
    std::fs::write(&bin, &bytes[..bytes.len() / 2]).unwrap();
    std::fs::copy(
        lm_fixture().join("config.yml"),
        dir.path().join("config.yml"),
    )
    .unwrap();
    let r = score_123(bin.to_str().unwrap());
    assert_clean_failure(&r, &["pytorch_model.bin"]);
}

#[test]
fn corrupt_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    tiny_folder(dir.path(), |_, _| {});
    let st = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 100]).unwrap();
    let r = score_123(dir.path().to_str().unwrap());
    assert_clean_failure(&r, &["model.safetensors"]);
    std::fs::write(&st, b"not a safetensors file at all").unwrap();
    let r = score_123(dir.path().to_str().unwrap());
    assert_clean_failure(&r, &["model.safetensors"]);
}

#[test]
fn shape_that_does_not_match_the_config() {
    let dir = tempfile::tempdir().unwrap();
    tiny_folder(dir.path(), |cfg, _| cfg["qkv_tokens"] = 30.into());
    let r = score_123(dir.path().to_str().unwrap());
    assert_clean_failure(
        &r,
        &[
            "layers.0.attention.query.key_param_tokens",
            "[30, 32]",
            "[24, 32]",
        ],
    );
}

#[test]
fn missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    tiny_folder(dir.path(), |_, t| {
        t.remove("layers.1.mlp.value_param_tokens");
    });
    let r = score_123(dir.path().to_str().unwrap());
    assert_clean_failure(&r, &["layers.1.mlp.value_param_tokens"]);
}

#[test]
fn extra_tensor_means_the_config_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    tiny_folder(dir.path(), |cfg, _| cfg["num_layers"] = 1.into());
    let r = score_123(dir.path().to_str().unwrap());
    assert_clean_failure(&r, &["layers.1.", "not used by the config"]);
}

#[test]
fn unknown_activation() {
    let dir = tempfile::tempdir().unwrap();
    tiny_folder(dir.path(), |cfg, _| {
        cfg["pattention_activation"] = "relu_l1".into()
    });
    let r = score_123(dir.path().to_str().unwrap());
    assert_clean_failure(&r, &["config.json", "relu_l1"]);
    // The same in an official yml.
    let y = tempfile::tempdir().unwrap();
    let yml = std::fs::read_to_string(lm_fixture().join("config.yml"))
        .unwrap()
        .replace("l2_norm_gelu", "relu_l1");
    std::fs::write(y.path().join("config.yml"), yml).unwrap();
    std::fs::copy(
        lm_fixture().join("pytorch_model.bin"),
        y.path().join("pytorch_model.bin"),
    )
    .unwrap();
    let r = score_123(y.path().to_str().unwrap());
    assert_clean_failure(&r, &["config.yml", "relu_l1"]);
}

#[test]
fn empty_prompt_and_too_long_inputs() {
    let dir = tempfile::tempdir().unwrap();
    tiny_folder(dir.path(), |_, _| {});
    let m = dir.path().to_str().unwrap();
    let r = tokenformer(&["generate", "--model", m, "--prompt", ""]);
    assert_clean_failure(&r, &["empty"]);
    let long = "word ".repeat(40);
    let r = tokenformer(&["generate", "--model", m, "--prompt", &long]);
    assert_clean_failure(&r, &["16 positions"]);
    let r = tokenformer(&["score", "--model", m, "--text", &long]);
    assert_clean_failure(&r, &["16 positions"]);
    let r = tokenformer(&["score", "--model", m, "--ids", "5"]);
    assert_clean_failure(&r, &["at least 2 tokens"]);
}

#[test]
fn generation_stops_at_the_context_and_reports_unknown_models() {
    let dir = tempfile::tempdir().unwrap();
    tiny_folder(dir.path(), |_, _| {});
    let m = dir.path().to_str().unwrap();
    // Asking for more than fits is capped at the context, not an error or garbage.
    let (out, stdout, err) = tokenformer(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "one two",
        "--max-new-tokens",
        "100",
    ]);
    assert!(out.status.success(), "{err}");
    assert!(stdout.starts_with("one two"));
    let r = tokenformer(&["score", "--model", "no-such-model", "--ids", "1,2"]);
    assert_clean_failure(&r, &["no-such-model"]);
}

#[test]
fn counts_of_zero_are_refused_by_flag() {
    // Before: `--batch-size 0` ran with 1, `--limit 0` reported 0 % top-1 of 0 images and
    // `--save-every 0` saved a checkpoint every step.
    let digits = root().join("zoo/examples/digits");
    let digits = digits.to_str().unwrap();
    let image = root().join("zoo/examples/digits/seven/0005.png");
    let lm = ["--model", "tiny-kjv-lm", "--data", "x.txt"];
    let vit = ["--model", "tiny-digits-vit"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            [&["eval", "pile"][..], &lm, &["--batch-size", "0"]].concat(),
            "--batch-size",
        ),
        (
            [&["eval", "pile"][..], &lm, &["--limit", "0"]].concat(),
            "--limit",
        ),
        (
            [&["eval", "pile"][..], &lm, &["--max-batch-tokens", "0"]].concat(),
            "--max-batch-tokens",
        ),
        (
            [
                &["eval", "tasks", "--tasks", "piqa"][..],
                &lm,
                &["--batch-size", "0"],
            ]
            .concat(),
            "--batch-size",
        ),
        (
            [
                &["eval", "imagenet", "--data", digits][..],
                &vit,
                &["--limit", "0"],
            ]
            .concat(),
            "--limit",
        ),
        (
            [
                &["eval", "imagenet", "--data", digits][..],
                &vit,
                &["--batch-size", "0"],
            ]
            .concat(),
            "--batch-size",
        ),
        (
            [
                &["classify"][..],
                &vit,
                &["--batch-size", "0", image.to_str().unwrap()],
            ]
            .concat(),
            "--batch-size",
        ),
    ];
    let train = [
        "train",
        "--model",
        "tiny-kjv-lm",
        "--data",
        "x.txt",
        "--out",
        "y",
    ];
    let mut cases = cases;
    for flag in ["--save-every", "--eval-every", "--val-windows"] {
        cases.push(([&train[..], &[flag, "0"]].concat(), flag));
    }
    for (args, flag) in cases {
        let (out, _, se) = tokenformer(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {se}");
        assert!(
            se.contains(flag) && se.contains("must be at least 1"),
            "{args:?}: {se}"
        );
    }
    // The trainer's own checks name the flag too, before the data is read.
    let (out, _, se) = tokenformer(&[&train[..], &["--seq-len", "0"]].concat());
    assert_eq!(out.status.code(), Some(1), "{se}");
    assert!(se.contains("--seq-len must be positive"), "{se}");
}

#[test]
fn a_classifier_given_to_a_text_command_is_named_as_such() {
    // Not "has no tokenizer.json: pass --tokenizer", which would not have helped.
    let text = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(text.path(), "some text").unwrap();
    let data = text.path().to_str().unwrap();
    for args in [
        vec!["score", "--model", "tiny-digits-vit", "--text", "a b c"],
        vec!["generate", "--model", "tiny-digits-vit", "--prompt", "a"],
        vec!["eval", "pile", "--model", "tiny-digits-vit", "--data", data],
    ] {
        let r = tokenformer(&args);
        assert_clean_failure(&r, &["`tokenformer-vit` is not a language model"]);
    }
}

#[test]
fn a_missing_file_is_named_once_with_its_cause_once() {
    let (out, _, se) = tokenformer(&[
        "eval",
        "pile",
        "--model",
        "tiny-kjv-lm",
        "--data",
        "no-such.txt",
    ]);
    assert_eq!(out.status.code(), Some(1), "{se}");
    // It read "no-such.txt: No such file or directory (os error 2): No such file or …".
    assert_eq!(se.matches("(os error 2)").count(), 1, "{se}");
    assert!(se.contains("no-such.txt"), "{se}");
}
