//! Download through a local imitation of the Hub (HF_ENDPOINT on 127.0.0.1)
//! into a temporary HF_HOME, load and score; then the same offline from the
//! cache; and clear errors for a missing repo or file.

mod common;

use std::path::Path;
use std::process::Command;

use common::hub_server::FakeHub;
use common::*;

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

/// Runs `tokenformer` against the fake Hub with its own cache.
fn cli(
    hub: &str,
    home: &Path,
    offline: bool,
    args: &[&str],
) -> (std::process::Output, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenformer"))
        .args(args)
        .env("HF_ENDPOINT", hub)
        .env("HF_HOME", home)
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HF_TOKEN")
        .env("HF_HUB_OFFLINE", if offline { "1" } else { "0" })
        .env("TOKENFORMER_HUB_RETRIES", "0")
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout).into_owned();
    let se = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, so, se)
}

fn canonical_folder(dir: &Path) {
    let (tensors, _) = tokenformer::checkpoint::read_official_bin(
        &lm_fixture().join("pytorch_model.bin"),
        2,
        None,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let cfg = tokenformer::checkpoint::official::config_from_yml(
        &lm_fixture().join("config.yml"),
        50_304,
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    tokenformer::checkpoint::write_safetensors(dir, &tensors, u64::MAX).unwrap();
}

#[test]
fn download_load_score_then_offline() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join("folder");
    std::fs::create_dir(&folder).unwrap();
    canonical_folder(&folder);
    let tok = read(&tokenizer_fixture());
    hub.add_repo(
        "someone/tiny-tokenformer",
        &[
            ("config.json", &read(&folder.join("config.json"))),
            (
                "model.safetensors",
                &read(&folder.join("model.safetensors")),
            ),
            ("tokenizer.json", &tok),
        ],
    );
    hub.add_repo(
        "someone/tiny-official",
        &[
            (
                "pytorch_model.bin",
                &read(&lm_fixture().join("pytorch_model.bin")),
            ),
            ("config.yml", &read(&lm_fixture().join("config.yml"))),
            ("tokenizer.json", &tok),
        ],
    );
    let home = tmp.path().join("hf");
    let endpoint = hub.endpoint();
    let text = expected_lm()["text"].as_str().unwrap().to_string();
    let want: Vec<f64> =
        serde_json::from_value(expected_lm()["next_token_logprobs"].clone()).unwrap();
    let score_with = |model: &str, offline: bool, extra: &[&str]| {
        let mut args = vec!["score", "--model", model, "--text", &text, "--json"];
        args.extend_from_slice(extra);
        let (out, stdout, err) = cli(&endpoint, &home, offline, &args);
        assert!(out.status.success(), "{model} offline={offline}: {err}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let got: Vec<f64> = serde_json::from_value(v["next_token_logprobs"].clone()).unwrap();
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4, "{model}: {a} vs {b}");
        }
    };
    let score = |model: &str, offline: bool| score_with(model, offline, &[]);
    score("someone/tiny-tokenformer", false);
    score("someone/tiny-official@main", false);
    // The standard huggingface_hub cache layout.
    let repo_dir = home.join("hub/models--someone--tiny-tokenformer");
    let sha = std::fs::read_to_string(repo_dir.join("refs/main")).unwrap();
    assert_eq!(
        sha.trim(),
        hub.head("someone/tiny-tokenformer", "main").unwrap()
    );
    assert_eq!(
        read(
            &repo_dir
                .join("snapshots")
                .join(sha.trim())
                .join("tokenizer.json")
        ),
        tok
    );

    // Offline, from the cache only: the server answers nothing useful any more.
    hub.fail_all(500);
    hub.clear_requests();
    score("someone/tiny-tokenformer", true);
    score("someone/tiny-official", true);
    // f16 weight matrices, f32 compute: the same PyTorch numbers.
    score_with("someone/tiny-official", true, &["--weight-dtype", "f16"]);
    assert!(
        hub.requests().is_empty(),
        "offline mode made requests: {:?}",
        hub.requests()
    );
    // Offline and never downloaded: a clear error.
    let r = cli(
        &endpoint,
        &home,
        true,
        &["score", "--model", "someone/never-seen", "--ids", "1,2"],
    );
    assert_clean_failure(&r, &["someone/never-seen"]);
}

#[test]
fn missing_repo_or_file_is_a_clear_error() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    // A folder repo whose weights are missing.
    hub.add_repo("someone/no-weights", &[("config.json", b"{}")]);
    let home = tmp.path().join("hf");
    let r = cli(
        &hub.endpoint(),
        &home,
        false,
        &["score", "--model", "someone/does-not-exist", "--ids", "1,2"],
    );
    assert_clean_failure(&r, &["someone/does-not-exist"]);
    let r = cli(
        &hub.endpoint(),
        &home,
        false,
        &["score", "--model", "someone/no-weights", "--ids", "1,2"],
    );
    assert_clean_failure(&r, &["someone/no-weights", "model.safetensors"]);
    // Nothing listens on the port any more.
    let endpoint = hub.endpoint();
    hub.stop();
    let r = cli(
        &endpoint,
        &home,
        false,
        &["score", "--model", "someone/other", "--ids", "1,2"],
    );
    assert_clean_failure(&r, &["someone/other"]);
}

#[test]
fn readme_command_downloads_a_full_size_150m_and_generates() {
    // The README's main command against a local Hub that serves a full-size
    // TokenFormer-150M in the official format (random fp16 weights) and the
    // GPT-NeoX-20B tokenizer.
    let cfg = tokenformer::bench::lm_config("150m").unwrap();
    let tensors = tokenformer::bench::random_lm_tensors(
        &cfg,
        candle_core::DType::F16,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let official: Vec<(String, candle_core::Tensor)> = tensors
        .iter()
        .map(|(k, t)| {
            (
                tokenformer::checkpoint::official::to_official(k, cfg.num_layers).unwrap(),
                t.clone(),
            )
        })
        .collect();
    drop(tensors);
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("pytorch_model.bin");
    tokenformer::checkpoint::torch_zip::write_state_dict(&bin, &official, Default::default())
        .unwrap();
    drop(official);
    let hub = FakeHub::start();
    hub.add_repo(
        "Haiyang-W/TokenFormer-150M",
        &[("pytorch_model.bin", &read(&bin))],
    );
    std::fs::remove_file(&bin).unwrap();
    hub.add_repo(
        "EleutherAI/gpt-neox-20b",
        &[("tokenizer.json", &read(&tokenizer_fixture()))],
    );
    let home = tmp.path().join("hf");
    let args = [
        "generate",
        "--model",
        "tokenformer-150m",
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "4",
    ];
    let (out, online, err) = cli(&hub.endpoint(), &home, false, &args);
    assert!(out.status.success(), "{err}");
    assert!(
        online.starts_with("The capital of France is")
            && online.trim_end().len() > "The capital of France is".len(),
        "{online}"
    );
    // Offline from the cache, greedy: the same continuation.
    let (out, offline, err) = cli(&hub.endpoint(), &home, true, &args);
    assert!(out.status.success(), "{err}");
    assert_eq!(offline, online);
}
