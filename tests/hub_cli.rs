//! Download through a local imitation of the Hub (HF_ENDPOINT on 127.0.0.1)
//! into a temporary HF_HOME, load and score; then the same offline from the
//! cache; clear errors for a missing repo or file; sharded repos whose index is
//! checked; and the cache under attack: a hostile server, three processes
//! downloading one model together, a download killed midway.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::hub_server::{sha256_hex, Attack, FakeHub};
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
    let out = command(hub, home, offline, args).output().unwrap();
    let so = String::from_utf8_lossy(&out.stdout).into_owned();
    let se = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, so, se)
}

fn command(hub: &str, home: &Path, offline: bool, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tokenformer"));
    c.args(args)
        .env("HF_ENDPOINT", hub)
        .env("HF_HOME", home)
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HF_TOKEN")
        .env("HF_HUB_OFFLINE", if offline { "1" } else { "0" })
        .env("TOKENFORMER_HUB_RETRIES", "0")
        .env("TOKENFORMER_HUB_TIMEOUT", "5");
    c
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

    // Not offline, the Hub failing and retries on: the cache answers after one try of
    // each request, none repeated.
    for model in ["someone/tiny-tokenformer", "someone/tiny-official"] {
        let args = ["score", "--model", model, "--text", &text, "--json"];
        let out = command(&endpoint, &home, false, &args)
            .env("TOKENFORMER_HUB_RETRIES", "5")
            .env("TOKENFORMER_HUB_RETRY_DELAY", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{model}: {err}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let got: Vec<f64> = serde_json::from_value(v["next_token_logprobs"].clone()).unwrap();
        assert_eq!(got.len(), want.len(), "{model}");
        let seen: Vec<String> = hub
            .requests()
            .iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect();
        hub.clear_requests();
        let mut once = seen.clone();
        once.sort();
        once.dedup();
        assert_eq!(once.len(), seen.len(), "{model}: retried: {seen:?}");
        assert!(seen[0].contains("/tree/"), "{model}: {seen:?}");
    }
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
    let cfg = tokenformer::synthetic::lm_config("150m").unwrap();
    let tensors = tokenformer::synthetic::random_lm_tensors(
        &cfg,
        candle_core::DType::F16,
        0,
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

fn lm_tensors() -> (tokenformer::checkpoint::Tensors, String) {
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
    (tensors, serde_json::to_string(&cfg).unwrap())
}

/// `score --json` of the fixture text; the log-probs must be PyTorch's.
fn assert_scores_fixture(hub: &str, home: &Path, model: &str) {
    let text = expected_lm()["text"].as_str().unwrap().to_string();
    let want: Vec<f64> =
        serde_json::from_value(expected_lm()["next_token_logprobs"].clone()).unwrap();
    let (out, stdout, err) = cli(
        hub,
        home,
        false,
        &["score", "--model", model, "--text", &text, "--json"],
    );
    assert!(out.status.success(), "{model}: {err}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let got: Vec<f64> = serde_json::from_value(v["next_token_logprobs"].clone()).unwrap();
    assert_eq!(got.len(), want.len());
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-4, "{model}: {a} vs {b}");
    }
}

#[test]
fn sharded_repo_shards_are_read_from_where_they_were_downloaded() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let (tensors, config) = lm_tensors();
    let shards_dir = tmp.path().join("shards");
    std::fs::create_dir(&shards_dir).unwrap();
    let shards: Vec<PathBuf> =
        tokenformer::checkpoint::write_safetensors(&shards_dir, &tensors, 512 * 1024)
            .unwrap()
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
    assert!(shards.len() > 1);
    // Decoys under the shards' base names at the repo root: other weights, which a loader
    // downloading by base name would take.
    let halved: tokenformer::checkpoint::Tensors = tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.affine(0.5, 0.0).unwrap()))
        .collect();
    let decoy_dir = tmp.path().join("decoys");
    std::fs::create_dir(&decoy_dir).unwrap();
    tokenformer::checkpoint::write_safetensors(&decoy_dir, &halved, 512 * 1024).unwrap();
    let index: serde_json::Value =
        serde_json::from_slice(&read(&shards_dir.join("model.safetensors.index.json"))).unwrap();
    let mut moved = index.clone();
    for v in moved["weight_map"].as_object_mut().unwrap().values_mut() {
        *v = format!("shards/{}", v.as_str().unwrap()).into();
    }
    let tok = read(&tokenizer_fixture());
    let moved_json = serde_json::to_vec(&moved).unwrap();
    let shard_bytes: Vec<(String, Vec<u8>)> = shards
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, read(p))
        })
        .collect();
    let decoys: Vec<(String, Vec<u8>)> = shard_bytes
        .iter()
        .map(|(n, _)| (n.clone(), read(&decoy_dir.join(n))))
        .collect();
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("config.json".into(), config.clone().into_bytes()),
        ("tokenizer.json".into(), tok.clone()),
        ("model.safetensors.index.json".into(), moved_json),
    ];
    files.extend(
        shard_bytes
            .iter()
            .map(|(n, b)| (format!("shards/{n}"), b.clone())),
    );
    files.extend(decoys);
    let borrowed: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), &b[..])).collect();
    hub.add_repo("someone/sharded", &borrowed);
    let home = tmp.path().join("hf");
    assert_scores_fixture(&hub.endpoint(), &home, "someone/sharded");

    // An index naming shards outside the repo folder: a clear error naming the shard.
    for bad in [
        "../../x.safetensors",
        "/etc/passwd",
        "shards/../../../x.safetensors",
    ] {
        let mut evil = index.clone();
        let first = evil["weight_map"]
            .as_object()
            .unwrap()
            .keys()
            .next()
            .unwrap()
            .clone();
        evil["weight_map"][&first] = bad.into();
        let evil_json = serde_json::to_vec(&evil).unwrap();
        let mut files: Vec<(&str, &[u8])> = vec![
            ("config.json", config.as_bytes()),
            ("model.safetensors.index.json", &evil_json),
        ];
        files.extend(shard_bytes.iter().map(|(n, b)| (n.as_str(), &b[..])));
        hub.add_repo("someone/evil-index", &files);
        let r = cli(
            &hub.endpoint(),
            &home,
            false,
            &["score", "--model", "someone/evil-index", "--ids", "1,2"],
        );
        assert_clean_failure(&r, &["someone/evil-index", &format!("{bad:?}")]);
    }
}

/// Everything under `dir` except `skip`, with contents.
fn tree_outside(dir: &Path, skip: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.starts_with(skip) {
                continue;
            }
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p.clone());
                out.push((p, Vec::new()));
            } else if m.file_type().is_symlink() {
                let t = std::fs::read_link(&p).unwrap();
                out.push((p, t.to_string_lossy().as_bytes().to_vec()));
            } else {
                let b = read(&p);
                out.push((p, b));
            }
        }
    }
    out.sort();
    out
}

fn tiny_hub_repo(hub: &FakeHub, tmp: &Path) -> Vec<u8> {
    let folder = tmp.join("folder");
    std::fs::create_dir(&folder).unwrap();
    canonical_folder(&folder);
    let weights = read(&folder.join("model.safetensors"));
    hub.add_repo(
        "someone/tiny-tokenformer",
        &[
            ("config.json", &read(&folder.join("config.json"))),
            ("model.safetensors", &weights),
            ("tokenizer.json", &read(&tokenizer_fixture())),
        ],
    );
    weights
}

#[test]
fn a_hostile_server_gets_a_clean_error_and_changes_nothing_outside() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    tiny_hub_repo(&hub, tmp.path());
    let home = tmp.path().join("hf");
    std::fs::create_dir(&home).unwrap();
    std::fs::write(tmp.path().join("victim"), "keep").unwrap();
    let before = tree_outside(tmp.path(), &home);
    for (attack, file) in [
        (Attack::Commit("../../../../victim".into()), "config.json"),
        (Attack::Etag("\"../../../victim\"".into()), "config.json"),
        (
            Attack::Body(200, b"<html>oops</html>".to_vec()),
            "config.json",
        ),
    ] {
        hub.clear_failures();
        let method = if matches!(attack, Attack::Body(..)) {
            "GET"
        } else {
            "HEAD"
        };
        hub.attack(Some(method), "/resolve/", attack, None);
        let r = cli(
            &hub.endpoint(),
            &home,
            false,
            &[
                "score",
                "--model",
                "someone/tiny-tokenformer",
                "--ids",
                "1,2",
            ],
        );
        assert_clean_failure(&r, &["someone/tiny-tokenformer", file]);
        assert_eq!(tree_outside(tmp.path(), &home), before);
    }
    // A server that stalls: the read timeout (TOKENFORMER_HUB_TIMEOUT) ends it.
    hub.clear_failures();
    hub.attack(
        Some("GET"),
        "/resolve/",
        Attack::Stall {
            after: 0,
            pause: Duration::from_secs(5),
        },
        None,
    );
    let t = Instant::now();
    let out = command(
        &hub.endpoint(),
        &home,
        false,
        &[
            "score",
            "--model",
            "someone/tiny-tokenformer",
            "--ids",
            "1,2",
        ],
    )
    .env("TOKENFORMER_HUB_TIMEOUT", "0.3")
    .output()
    .unwrap();
    let r = (
        out.clone(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert_clean_failure(
        &r,
        &[
            "someone/tiny-tokenformer",
            "config.json",
            "TOKENFORMER_HUB_TIMEOUT",
        ],
    );
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert_eq!(tree_outside(tmp.path(), &home), before);
    // The same cache still works once the server behaves.
    hub.clear_failures();
    let r = cli(
        &hub.endpoint(),
        &home,
        false,
        &[
            "score",
            "--model",
            "someone/tiny-tokenformer",
            "--ids",
            "1,2",
        ],
    );
    assert!(r.0.status.success(), "{}", r.2);
}

#[test]
fn three_processes_download_one_model_together() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let weights = tiny_hub_repo(&hub, tmp.path());
    // About a second per transfer, so the three downloads overlap.
    hub.attack(
        Some("GET"),
        "/__cdn/",
        Attack::Throttle {
            chunk: 64 * 1024,
            delay: Duration::from_millis(20),
        },
        None,
    );
    let home = tmp.path().join("hf");
    let args = [
        "score",
        "--model",
        "someone/tiny-tokenformer",
        "--ids",
        "1,2,3",
        "--json",
    ];
    let children: Vec<_> = (0..3)
        .map(|_| {
            command(&hub.endpoint(), &home, false, &args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for o in &outs {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.stdout, outs[0].stdout);
    }
    let oid = sha256_hex(&weights);
    let gets = hub
        .requests()
        .iter()
        .filter(|q| q.method == "GET" && q.path == format!("/__cdn/{oid}"))
        .count();
    assert_eq!(gets, 1, "the weights were fetched {gets} times");
}

#[test]
fn a_download_killed_midway_leaves_nothing_a_later_run_trusts() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let weights = tiny_hub_repo(&hub, tmp.path());
    hub.attack(
        Some("GET"),
        "/__cdn/",
        Attack::Throttle {
            chunk: 16 * 1024,
            delay: Duration::from_millis(50),
        },
        Some(1),
    );
    let home = tmp.path().join("hf");
    let args = [
        "score",
        "--model",
        "someone/tiny-tokenformer",
        "--ids",
        "1,2",
    ];
    let mut child = command(&hub.endpoint(), &home, false, &args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let blobs = home.join("hub/models--someone--tiny-tokenformer/blobs");
    let oid = sha256_hex(&weights);
    let partial = blobs.join(format!("{oid}.incomplete"));
    let t = Instant::now();
    while std::fs::metadata(&partial).map_or(0, |m| m.len()) < 64 * 1024 {
        assert!(t.elapsed() < Duration::from_secs(20), "no partial download");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!blobs.join(&oid).exists());
    // Offline, the partial file is not a cached model.
    let r = cli(&hub.endpoint(), &home, true, &args);
    assert_clean_failure(&r, &["someone/tiny-tokenformer"]);
    // Online, a later run downloads it whole.
    let r = cli(&hub.endpoint(), &home, false, &args);
    assert!(r.0.status.success(), "{}", r.2);
    assert_eq!(read(&blobs.join(&oid)), weights);
    let left: Vec<_> = std::fs::read_dir(&blobs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".incomplete"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn eval_imagenet_reads_an_image_folder_from_a_hub_dataset() {
    let hub = FakeHub::start();
    let home = tempfile::tempdir().unwrap();
    let fixture = fixtures().join("vit-tiny-imagenet");
    // The repo holds the images under val/ and other files beside them.
    hub.add_folder("datasets/me/tiny-val", "main", &fixture);
    let model = fixture.join("vit-tiny");
    let endpoint = hub.endpoint();
    let run = |data: &str, offline: bool, json: &Path| {
        let args = [
            "eval",
            "imagenet",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data,
            "--json",
            json.to_str().unwrap(),
            "--quiet",
        ];
        let (out, _, se) = cli(&endpoint, home.path(), offline, &args);
        assert!(out.status.success(), "{data}: {se}");
        let v: serde_json::Value = serde_json::from_slice(&read(json)).unwrap();
        v
    };
    let dir = tempfile::tempdir().unwrap();
    let local = run(
        fixture.join("val").to_str().unwrap(),
        false,
        &dir.path().join("a.json"),
    );
    let spec = "hf://datasets/me/tiny-val/val";
    let remote = run(spec, false, &dir.path().join("b.json"));
    for k in ["images", "top1", "top5", "correct_top1", "correct_top5"] {
        assert_eq!(remote[k], local[k], "{k}");
    }
    assert!(local["images"].as_u64().unwrap() >= 3);
    assert!(hub
        .requests()
        .iter()
        .any(|r| r.path.starts_with("/api/datasets/me/tiny-val/tree/")));
    // Cached: offline with the server gone, the same result.
    hub.stop();
    let offline = run(spec, true, &dir.path().join("c.json"));
    assert_eq!(offline["top1"], local["top1"]);
    // A folder the repo does not have is named.
    let (out, _, se) = cli(
        "http://127.0.0.1:9",
        home.path(),
        true,
        &[
            "eval",
            "imagenet",
            "--model",
            model.to_str().unwrap(),
            "--data",
            "hf://datasets/me/tiny-val/nope",
        ],
    );
    assert!(!out.status.success() && se.contains("nope/"), "{se}");
}
