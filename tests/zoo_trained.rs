//! The models this project trained and ships inside the binary (`zoo/tiny-*`):
//! they load offline with no download, and their recorded metrics are
//! reproduced by the same commands on the held-out examples shipped in
//! `zoo/examples`.

mod common;

use std::path::{Path, PathBuf};

use common::tokenformer;
use serde_json::Value;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("zoo/examples")
}

/// The registry's recorded metrics of `name`.
fn reported(name: &str) -> serde_json::Map<String, Value> {
    tokenformer::zoo::find(name)
        .unwrap_or_else(|| panic!("{name} is in the zoo"))
        .reported
        .clone()
}

/// Runs `args` with `--json FILE` added and returns the file's JSON.
fn json_out(args: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("r.json");
    let mut all = args.to_vec();
    all.extend(["--json", file.to_str().unwrap()]);
    let (out, _, se) = tokenformer(&all);
    assert!(out.status.success(), "{args:?} failed: {se}");
    serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap()
}

#[test]
fn zoo_lists_the_trained_models_with_their_metrics() {
    let (out, so, se) = tokenformer(&["zoo", "list"]);
    assert!(out.status.success(), "{se}");
    for (name, metric) in [
        ("tiny-kjv-lm", "kjv_val_perplexity"),
        ("tiny-digits-vit", "digits_val_top1"),
        ("tiny-digits-vl", "caption_accuracy"),
    ] {
        let line = so
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} listed: {so}"));
        let v = reported(name)[metric].as_f64().unwrap();
        assert!(line.contains(&format!("{v}")), "{line} shows {metric}={v}");
    }
}

#[test]
fn the_language_model_reproduces_its_perplexity_offline() {
    let data = examples().join("kjv-val.jsonl");
    let r = json_out(&[
        "eval",
        "pile",
        "--model",
        "tiny-kjv-lm",
        "--data",
        data.to_str().unwrap(),
    ]);
    let ppl = r["token_perplexity"]
        .as_f64()
        .unwrap_or_else(|| panic!("token_perplexity in {r}"));
    let want = reported("tiny-kjv-lm")["examples_perplexity"]
        .as_f64()
        .unwrap();
    assert!(
        ((ppl - want) / want).abs() < 1e-4,
        "perplexity {ppl} vs recorded {want}"
    );
    // A trained model: far below the 2048-way uniform guess.
    assert!(ppl < 60.0, "{ppl}");
}

#[test]
fn the_classifier_reproduces_its_top1_offline() {
    let data = examples().join("digits");
    let r = json_out(&[
        "eval",
        "imagenet",
        "--model",
        "tiny-digits-vit",
        "--data",
        data.to_str().unwrap(),
        "--quiet",
    ]);
    let top1 = r["top1"].as_f64().unwrap_or_else(|| panic!("top1 in {r}"));
    let want = reported("tiny-digits-vit")["examples_top1"]
        .as_f64()
        .unwrap();
    assert!(
        (top1 - want).abs() < 1e-9,
        "top-1 {top1} vs recorded {want}"
    );
    assert!(top1 >= 80.0, "{top1}");
}

#[test]
fn the_merged_model_names_the_digit_it_sees() {
    let mut right = 0;
    let mut total = 0;
    for class in std::fs::read_dir(examples().join("digits")).unwrap() {
        let class = class.unwrap().path();
        let word = class.file_name().unwrap().to_str().unwrap().to_string();
        for img in std::fs::read_dir(&class).unwrap() {
            let img = img.unwrap().path();
            let (out, so, se) = tokenformer(&[
                "generate",
                "--model",
                "tiny-digits-vl",
                "--image",
                img.to_str().unwrap(),
                "--prompt",
                "a handwritten",
                "--max-new-tokens",
                "5",
            ]);
            assert!(out.status.success(), "{se}");
            total += 1;
            if so.split_whitespace().nth(2) == Some(word.as_str()) {
                right += 1;
            }
        }
    }
    let rate = right as f64 / total as f64;
    let want = reported("tiny-digits-vl")["examples_caption_accuracy"]
        .as_f64()
        .unwrap();
    assert!(
        (rate - want).abs() < 1e-9,
        "caption accuracy {rate} vs recorded {want}"
    );
    assert!(rate >= 0.5, "{rate}");
}

/// The merged model's bridge was trained, yet a text alone or an image alone
/// runs exactly its source: the bridge acts only in mixed sequences.
#[test]
fn the_merged_model_still_runs_each_source_exactly() {
    let text = "And he said, Let me go, for the day breaketh.";
    let score = |model: &str| {
        let (out, so, se) = tokenformer(&["score", "--model", model, "--text", text, "--json"]);
        assert!(out.status.success(), "{se}");
        serde_json::from_str::<Value>(&so).unwrap()["next_token_logprobs"].clone()
    };
    assert_eq!(score("tiny-digits-vl"), score("tiny-kjv-lm"));
    let images: Vec<String> = ["seven", "zero", "four"]
        .iter()
        .map(|c| examples().join("digits").join(c).join("0010.png"))
        .map(|p| p.to_str().unwrap().to_string())
        .collect();
    let classify = |model: &str| {
        let mut args = vec!["classify", "--model", model, "--json"];
        args.extend(images.iter().map(String::as_str));
        let (out, so, se) = tokenformer(&args);
        assert!(out.status.success(), "{se}");
        serde_json::from_str::<Value>(&so).unwrap()
    };
    assert_eq!(classify("tiny-digits-vl"), classify("tiny-digits-vit"));
}
