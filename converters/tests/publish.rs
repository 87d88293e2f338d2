//! `tokenformer-convert publish` against a local imitation of the Hub.

mod common;
#[path = "../../tests/common/hub_server.rs"]
mod hub_server;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use common::{lm_bin, load_lm, merge_args, official_args, run, s, values, vit_dir};
use hub_server::FakeHub;
use sha2::{Digest, Sha256};

const TOKEN: &str = "hf_test_secret_token_123";

/// Runs the converter against the hub at `endpoint` with `home` as its cache;
/// returns (succeeded, stdout, stderr).
fn convert<S: AsRef<OsStr>>(args: &[S], endpoint: &str, home: &Path) -> (bool, String, String) {
    let env = [
        ("HF_ENDPOINT", endpoint),
        ("HF_HOME", s(home)),
        ("HF_TOKEN", TOKEN),
        ("NO_PROXY", "127.0.0.1"),
        ("TOKENFORMER_HUB_RETRIES", "0"),
    ];
    let o = run(args, &env);
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

fn folder_hashes(dir: &Path) -> BTreeMap<String, String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                format!("{:x}", Sha256::digest(std::fs::read(&p).unwrap())),
            )
        })
        .collect()
}

/// `publish --model <model> --repo <repo>` plus `flags`, against the hub at `endpoint`.
fn publish(
    model: &Path,
    repo: &str,
    flags: &[&str],
    endpoint: &str,
    home: &Path,
) -> (bool, String, String) {
    let args = [&["publish", "--model", s(model), "--repo", repo][..], flags].concat();
    convert(&args, endpoint, home)
}

fn converted(tmp: &Path, hub: &str) -> PathBuf {
    let out = tmp.join("model");
    let (ok, _, err) = convert(&official_args(&out, ""), hub, &tmp.join("hf"));
    assert!(ok, "{err}");
    out
}

#[test]
fn publish_then_download_gives_the_same_model() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let model = converted(tmp.path(), &hub.endpoint());
    let results = tmp.path().join("pile.json");
    std::fs::write(
        &results,
        r#"{"kind": "pile", "word_perplexity": 12.5, "bits_per_byte": 0.75, "tokens": 10}"#,
    )
    .unwrap();
    let before = folder_hashes(&model);
    let (endpoint, home) = (hub.endpoint(), tmp.path().join("hf"));

    // Dry run: lists sha256s that match the files, uploads nothing.
    let (ok, out, err) = publish(&model, "me/tiny", &["--dry-run"], &endpoint, &home);
    assert!(ok, "{err}");
    assert!(
        out.contains(&before["model.safetensors"]) && out.contains(&before["config.json"]),
        "{out}"
    );
    assert!(!hub.has_repo("me/tiny"));
    assert_eq!(folder_hashes(&model), before);

    let flags = ["--results", s(&results)];
    let (ok, out, err) = publish(&model, "me/tiny", &flags, &endpoint, &home);
    assert!(ok, "{err}");
    let head = hub.head("me/tiny", "main").unwrap();
    assert!(out.contains(&head), "commit URL in {out}");
    assert!(!out.contains(TOKEN) && !err.contains(TOKEN), "token leaked");
    assert!(hub.requests().iter().any(|r| r.bearer() == Some(TOKEN)));

    // The uploaded files are the folder's, and the card carries the results.
    let files = hub.files_at("me/tiny", "main").unwrap();
    assert_eq!(
        files["model.safetensors"],
        std::fs::read(model.join("model.safetensors")).unwrap()
    );
    let readme = String::from_utf8(files["README.md"].clone()).unwrap();
    let (meta, _) = tokenformer::card::parse(&readme).unwrap();
    assert_eq!(
        meta["model-index"][0]["results"][0]["metrics"][0]["value"],
        12.5
    );
    assert!(
        meta.get("library_name").is_none(),
        "no library the Hub does not list"
    );
    assert_eq!(
        meta["model-index"][0]["results"][0]["metrics"][0]["type"],
        "perplexity"
    );
    assert!(meta["tags"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t == "tokenformer"));
    assert_eq!(
        std::fs::read_to_string(model.join("README.md")).unwrap(),
        readme,
        "local card refreshed after upload"
    );

    // Download through HF_ENDPOINT into a fresh cache: identical tensors, same logits.
    let cfg = tokenformer::hub::HubConfig::from_env()
        .with_endpoint(hub.endpoint())
        .with_cache_dir(tmp.path().join("cache2"))
        .with_retries(0);
    let client = tokenformer::hub::HubClient::new(cfg).unwrap();
    let repo = tokenformer::hub::RepoRef::parse("me/tiny").unwrap();
    let paths = client
        .download_files(&repo, &["config.json", "model.safetensors"], None)
        .unwrap();
    let dev = candle_core::Device::Cpu;
    let a =
        tokenformer::checkpoint::read_safetensors(&[model.join("model.safetensors")], None, &dev)
            .unwrap();
    let b = tokenformer::checkpoint::read_safetensors(&[paths[1].clone()], None, &dev).unwrap();
    assert_eq!(a.len(), b.len());
    for (k, t) in &a {
        assert_eq!(values(t), values(&b[k]), "{k}");
    }
    let dl = paths[0].parent().unwrap();
    let (m1, m2) = (load_lm(&model), load_lm(dl));
    let ids = [5u32, 17, 900, 31_000, 2];
    let s1 = tokenformer::scoring::score_ids(&m1, &ids).unwrap();
    let s2 = tokenformer::scoring::score_ids(&m2, &ids).unwrap();
    assert_eq!(s1.next_token_logprobs, s2.next_token_logprobs);
}

#[test]
fn failing_server_leaves_the_folder_untouched() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let model = converted(tmp.path(), &hub.endpoint());
    let before = folder_hashes(&model);
    let (endpoint, home) = (hub.endpoint(), tmp.path().join("hf"));
    hub.fail_all(500);
    let (ok, _, err) = publish(&model, "me/tiny", &[], &endpoint, &home);
    assert!(
        !ok && err.contains("me/tiny") && !err.contains("panicked"),
        "{err}"
    );
    assert!(!err.contains(TOKEN));
    assert_eq!(folder_hashes(&model), before);
    // Refused connection.
    hub.stop();
    let (ok, _, err) = publish(&model, "me/tiny", &[], &endpoint, &home);
    assert!(!ok && !err.contains("panicked"), "{err}");
    assert_eq!(folder_hashes(&model), before);
    // A folder that is not a model is refused before any network use.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (ok, _, err) = publish(&empty, "me/x", &[], &endpoint, &tmp.path().join("hf2"));
    assert!(!ok && err.contains("config.json"), "{err}");
}

/// Copies a model folder (flat) so a test can publish or break it without touching the fixture.
fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

#[test]
fn publish_validates_vision_and_vision_language_folders() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let vit = tmp.path().join("vit");
    copy_folder(&vit_dir(), &vit);
    let before = folder_hashes(&vit);
    let (endpoint, home) = (hub.endpoint(), tmp.path().join("hf"));
    let dry = |dir: &Path| publish(dir, "me/vision", &["--dry-run"], &endpoint, &home);

    // The classifier loads, runs the probe image and is listed with its real hashes.
    let (ok, out, err) = dry(&vit);
    assert!(ok, "{err}");
    assert!(
        out.contains("tokenformer-vit, 2 layers, 10 classes, probe forward ok"),
        "{out}"
    );
    assert!(out.contains(&before["model.safetensors"]), "{out}");
    assert!(!hub.has_repo("me/vision"));
    assert_eq!(folder_hashes(&vit), before, "a dry run changed the folder");

    // A classifier whose config disagrees with its tensors is refused before anything else.
    let broken = tmp.path().join("broken");
    copy_folder(&vit, &broken);
    let cfg = std::fs::read_to_string(broken.join("config.json")).unwrap();
    std::fs::write(
        broken.join("config.json"),
        cfg.replace("\"ffn_tokens\": 48", "\"ffn_tokens\": 50"),
    )
    .unwrap();
    let (ok, out, err) = dry(&broken);
    assert!(
        !ok && err.starts_with("error: ") && !err.contains("panicked"),
        "{err}"
    );
    assert!(!out.contains("would upload"), "{out}");

    // A merged vision-language folder is validated with a mixed forward pass.
    let vlm = tmp.path().join("vl");
    let (ok, _, err) = convert(&merge_args(&vit, &lm_bin(), "4", &vlm), &endpoint, &home);
    assert!(ok, "{err}");
    let (ok, out, err) = dry(&vlm);
    assert!(ok, "{err}");
    assert!(
        out.contains("tokenformer-vl, 2 layers, 4 bridge tokens, mixed probe forward ok"),
        "{out}"
    );
    let readme = out.lines().find(|l| l.contains("README.md")).unwrap_or("");
    assert!(readme.contains("sha256"), "{out}");
}

/// The repo paths a dry run lists as uploaded.
fn dry_run_files(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.contains(" bytes  sha256 "))
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect()
}

#[test]
fn publish_sends_only_regular_files_inside_the_folder() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let model = converted(tmp.path(), &hub.endpoint());
    let (endpoint, home) = (hub.endpoint(), tmp.path().join("hf"));
    let secret = tmp.path().join("secret.txt");
    std::fs::write(&secret, "outside the folder").unwrap();
    let link =
        |target: &Path, name: &str| std::os::unix::fs::symlink(target, model.join(name)).unwrap();
    link(&secret, "leak.txt");
    link(Path::new("/etc/passwd"), "passwd");
    link(tmp.path(), "home");
    link(Path::new("config.json"), "config-copy.json");
    std::fs::create_dir(model.join("sub")).unwrap();
    std::fs::write(model.join("sub/.env"), "HF_TOKEN=x").unwrap();
    std::fs::write(model.join("sub/notes.txt"), "notes").unwrap();
    std::fs::create_dir(model.join(".git")).unwrap();
    std::fs::write(model.join(".git/config"), "[core]").unwrap();

    let (ok, out, err) = publish(&model, "me/links", &["--dry-run"], &endpoint, &home);
    assert!(ok, "{err}");
    let listed = dry_run_files(&out);
    assert_eq!(
        listed,
        [
            "README.md",
            "config-copy.json",
            "config.json",
            "model.safetensors",
            "sub/notes.txt"
        ],
        "{out}"
    );
    for skipped in ["leak.txt", "passwd", "home", "sub/.env", ".git"] {
        assert!(
            out.contains(&format!("not uploaded: {skipped} (")),
            "{skipped}: {out}"
        );
    }

    let (ok, _, err) = publish(&model, "me/links", &[], &endpoint, &home);
    assert!(ok, "{err}");
    let stored = hub.files_at("me/links", "main").unwrap();
    let mut want = listed.clone();
    want.push(".gitattributes".into());
    want.sort();
    assert_eq!(stored.keys().cloned().collect::<Vec<_>>(), want);
    assert!(stored.values().all(|v| v != b"outside the folder"));

    // The weights themselves linked from outside: refused, since they would be missing.
    let weights = tmp.path().join("weights.safetensors");
    std::fs::rename(model.join("model.safetensors"), &weights).unwrap();
    link(&weights, "model.safetensors");
    let (ok, out, err) = publish(&model, "me/links2", &["--dry-run"], &endpoint, &home);
    assert!(
        !ok && err.contains("model.safetensors") && err.contains("outside"),
        "{err}"
    );
    assert!(!out.contains("would upload"), "{out}");
    assert!(!hub.has_repo("me/links2"));
}
