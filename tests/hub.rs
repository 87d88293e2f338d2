//! Integration tests of `tokenformer::hub` against the fake Hub in `common/hub_server.rs`.
//!
//! They go through the real `hf-hub` code path over HTTP on 127.0.0.1 and check the
//! `huggingface_hub` cache layout (`models--o--n/{blobs,snapshots/<sha>,refs/<rev>}`), the
//! offline mode, error classification, publishing and token hygiene. Configuration is passed
//! with `HubConfig::from_vars` so no test mutates the process environment.

#[path = "common/hub_server.rs"]
mod hub_server;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hub_server::{git_etag, sha256_hex, FakeHub};
use sha2::{Digest, Sha256};
use tokenformer::hub::{dry_run_listing, HubClient, HubConfig, HubError, PublishOptions, RepoRef};

const TOKEN: &str = "hf_test_SECRET_token_0123456789";

fn config(endpoint: &str, hf_home: &Path, extra: &[(&str, &str)]) -> HubConfig {
    let home = hf_home.to_string_lossy().to_string();
    let endpoint = endpoint.to_string();
    let extra: Vec<(String, String)> = extra
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    HubConfig::from_vars(move |k| match k {
        "HF_ENDPOINT" => Some(endpoint.clone()),
        "HF_HOME" => Some(home.clone()),
        _ => extra.iter().find(|(ek, _)| ek == k).map(|(_, v)| v.clone()),
    })
    .with_retries(0)
}

fn client(endpoint: &str, hf_home: &Path) -> HubClient {
    HubClient::new(config(endpoint, hf_home, &[])).unwrap()
}

fn weights() -> Vec<u8> {
    (0..4096u32).map(|i| (i * 7 % 256) as u8).collect()
}

const CONFIG_JSON: &[u8] = br#"{"hidden_size": 64, "num_layers": 2}"#;
const TOKENIZER_JSON: &[u8] = br#"{"model": {"type": "BPE"}}"#;

fn tiny_repo(hub: &FakeHub) -> String {
    hub.add_repo(
        "acme/tiny",
        &[
            ("config.json", CONFIG_JSON),
            ("model.safetensors", &weights()),
            ("tokenizer.json", TOKENIZER_JSON),
        ],
    )
}

/// A port nothing listens on.
fn refused_endpoint() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    format!("http://127.0.0.1:{port}")
}

fn repo(s: &str) -> RepoRef {
    RepoRef::parse(s).unwrap()
}

#[test]
fn download_two_files_into_the_standard_cache() {
    let hub = FakeHub::start();
    let sha = tiny_repo(&hub);
    let home = tempfile::tempdir().unwrap();
    let c = client(&hub.endpoint(), home.path());
    let r = repo("acme/tiny");

    let paths = c
        .download_files(&r, &["config.json", "model.safetensors"], true)
        .unwrap();

    let repo_dir = home.path().join("hub").join("models--acme--tiny");
    let snap = repo_dir.join("snapshots").join(&sha);
    assert_eq!(
        paths,
        vec![snap.join("config.json"), snap.join("model.safetensors")]
    );
    assert_eq!(std::fs::read(&paths[0]).unwrap(), CONFIG_JSON);
    assert_eq!(std::fs::read(&paths[1]).unwrap(), weights());
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs").join("main")).unwrap(),
        sha
    );
    // Snapshot entries are relative links to blobs named by etag: git-sha-ish for regular
    // files, sha256 for LFS files (served through the CDN redirect with X-Linked-Etag).
    for (path, etag) in [
        (&paths[0], git_etag(CONFIG_JSON)),
        (&paths[1], sha256_hex(&weights())),
    ] {
        let target = std::fs::read_link(path).unwrap();
        assert_eq!(target, PathBuf::from("../../blobs").join(&etag));
        assert!(repo_dir.join("blobs").join(&etag).is_file());
    }
    let blobs: Vec<_> = std::fs::read_dir(repo_dir.join("blobs")).unwrap().collect();
    assert_eq!(blobs.len(), 2);

    assert_eq!(c.resolve_commit(&r).unwrap(), sha);
    let files = c.list_files(&r).unwrap();
    let names: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(
        names,
        ["config.json", "model.safetensors", "tokenizer.json"]
    );
    assert_eq!(files[1].size, 4096);
    assert!(files[1].lfs && !files[0].lfs && !files[2].lfs);

    let reqs = hub.requests();
    assert!(reqs
        .iter()
        .any(|q| q.method == "HEAD" && q.path == "/acme/tiny/resolve/main/model.safetensors"));
    assert!(reqs
        .iter()
        .any(|q| q.method == "GET" && q.path.starts_with("/__cdn/")));
    assert!(
        reqs.iter()
            .any(|q| q.path == "/api/models/acme/tiny/tree/main"
                && q.query.contains("recursive=true"))
    );

    // A second download of cached files re-uses the blobs (no new GET of content).
    hub.clear_requests();
    let again = c
        .download_files(&r, &["config.json", "model.safetensors"], false)
        .unwrap();
    assert_eq!(again, paths);
    assert!(
        hub.requests().iter().all(|q| q.method != "GET"),
        "{:?}",
        hub.requests()
    );

    // A branch with '/' is one URL segment (percent-encoded) and nested folders under refs/.
    let feature_sha = hub.add_commit("acme/tiny", "feature/x", &[("config.json", b"{}")]);
    let feature = repo("acme/tiny@feature/x");
    let p = c.download_files(&feature, &["config.json"], false).unwrap();
    assert_eq!(std::fs::read(&p[0]).unwrap(), b"{}");
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/feature/x")).unwrap(),
        feature_sha
    );
    assert_eq!(c.resolve_commit(&feature).unwrap(), feature_sha);

    // A pinned commit is served from the cache without any request.
    hub.clear_requests();
    let pinned = repo(&format!("acme/tiny@{sha}"));
    assert_eq!(
        c.download_files(&pinned, &["config.json"], false).unwrap()[0],
        paths[0]
    );
    assert!(hub.requests().is_empty());
}

#[test]
fn offline_mode_and_failing_server_use_the_cache() {
    let hub = FakeHub::start();
    let sha = tiny_repo(&hub);
    let home = tempfile::tempdir().unwrap();
    let r = repo("acme/tiny");
    let online = client(&hub.endpoint(), home.path());
    let paths = online
        .download_files(&r, &["config.json", "model.safetensors"], false)
        .unwrap();

    // Server answering 500: cached files still resolve (like huggingface_hub), an uncached
    // one is a server error naming it.
    hub.fail_all(500);
    assert_eq!(
        online.download_files(&r, &["config.json"], false).unwrap()[0],
        paths[0]
    );
    let e = online
        .download_files(&r, &["tokenizer.json"], false)
        .unwrap_err();
    assert!(matches!(e, HubError::Server { status: 500, .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("tokenizer.json") && msg.contains("acme/tiny@main"),
        "{msg}"
    );

    // HF_HUB_OFFLINE=1: no request at all.
    hub.clear_failures();
    hub.clear_requests();
    for flag in ["1", "true", "YES"] {
        let cfg = config(&hub.endpoint(), home.path(), &[("HF_HUB_OFFLINE", flag)]);
        assert!(cfg.offline, "{flag}");
        let offline = HubClient::new(cfg).unwrap();
        let got = offline
            .download_files(&r, &["config.json", "model.safetensors"], false)
            .unwrap();
        assert_eq!(got, paths);
        assert_eq!(offline.resolve_commit(&r).unwrap(), sha);
        let cached: Vec<String> = offline
            .list_files(&r)
            .unwrap()
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(cached, ["config.json", "model.safetensors"]);
        let e = offline
            .download_files(&r, &["tokenizer.json"], false)
            .unwrap_err();
        assert!(matches!(e, HubError::NotCached { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("tokenizer.json")
                && msg.contains("acme/tiny@main")
                && msg.contains("HF_HUB_OFFLINE"),
            "{msg}"
        );
    }
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());

    // Server gone: offline still works, byte for byte.
    let endpoint = hub.endpoint();
    hub.stop();
    let offline =
        HubClient::new(config(&endpoint, home.path(), &[("HF_HUB_OFFLINE", "1")])).unwrap();
    let got = offline
        .download_files(&r, &["config.json", "model.safetensors"], false)
        .unwrap();
    assert_eq!(std::fs::read(&got[0]).unwrap(), CONFIG_JSON);
    assert_eq!(std::fs::read(&got[1]).unwrap(), weights());
    let e = offline
        .publish_folder(home.path(), &r, &PublishOptions::default())
        .unwrap_err();
    assert!(matches!(e, HubError::Offline { .. }), "{e}");
}

#[test]
fn errors_are_classified_name_repo_and_file_and_fail_fast() {
    let start = Instant::now();
    let hub = FakeHub::start();
    tiny_repo(&hub);
    hub.add_repo("acme/secret", &[("config.json", CONFIG_JSON)]);
    hub.set_private("acme/secret", true);
    let home = tempfile::tempdir().unwrap();
    let c = HubClient::new(config(&hub.endpoint(), home.path(), &[]).without_token()).unwrap();

    let e = c
        .download_files(&repo("acme/nope"), &["config.json"], false)
        .unwrap_err();
    assert!(matches!(e, HubError::RepoNotFound { .. }), "{e}");
    assert!(e.to_string().contains("acme/nope"), "{e}");

    let e = c
        .download_files(&repo("acme/tiny"), &["missing.bin"], false)
        .unwrap_err();
    assert!(matches!(e, HubError::FileNotFound { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("missing.bin") && msg.contains("acme/tiny@main"),
        "{msg}"
    );

    let e = c
        .download_files(&repo("acme/tiny@v9"), &["config.json"], false)
        .unwrap_err();
    assert!(matches!(e, HubError::RevisionNotFound { .. }), "{e}");
    assert!(
        e.to_string().contains("v9") && e.to_string().contains("acme/tiny"),
        "{e}"
    );

    let e = c.list_files(&repo("acme/nope")).unwrap_err();
    assert!(matches!(e, HubError::RepoNotFound { .. }), "{e}");
    let e = c.resolve_commit(&repo("acme/nope")).unwrap_err();
    assert!(matches!(e, HubError::RepoNotFound { .. }), "{e}");
    let e = c.list_files(&repo("acme/tiny@v9")).unwrap_err();
    assert!(matches!(e, HubError::RevisionNotFound { .. }), "{e}");

    if !HubConfig::from_env().has_token() {
        // Anonymous access to a private repo looks like a missing repo (401 + RepoNotFound).
        let e = c
            .download_files(&repo("acme/secret"), &["config.json"], false)
            .unwrap_err();
        assert!(matches!(e, HubError::RepoNotFound { .. }), "{e}");
        assert!(e.to_string().contains("token"), "{e}");
    }

    let e = c
        .download_files(&repo("acme/tiny"), &["../escape"], false)
        .unwrap_err();
    assert!(matches!(e, HubError::InvalidFileName { .. }), "{e}");

    // 500 from a fresh cache.
    hub.fail_all(500);
    let e = c
        .download_files(&repo("acme/tiny"), &["config.json"], false)
        .unwrap_err();
    assert!(matches!(e, HubError::Server { status: 500, .. }), "{e}");
    assert!(
        e.to_string().contains("config.json") && e.to_string().contains("acme/tiny"),
        "{e}"
    );
    let e = c.list_files(&repo("acme/tiny")).unwrap_err();
    assert!(matches!(e, HubError::Server { status: 500, .. }), "{e}");
    let n = hub.requests().len();

    // Connection refused.
    let dead = HubClient::new(config(&refused_endpoint(), home.path(), &[])).unwrap();
    let e = dead
        .download_files(&repo("acme/tiny"), &["config.json"], false)
        .unwrap_err();
    assert!(matches!(e, HubError::Network { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("config.json") && msg.contains("acme/tiny@main"),
        "{msg}"
    );
    assert!(msg.to_lowercase().contains("refused"), "{msg}");
    let e = dead.resolve_commit(&repo("acme/tiny")).unwrap_err();
    assert!(matches!(e, HubError::Network { .. }), "{e}");

    // Retries 0: one request per failing call, and the whole test is quick.
    assert!(n <= 30, "{n} requests");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_corrupt_lfs_download_is_rejected_and_not_cached() {
    let hub = FakeHub::start();
    tiny_repo(&hub);
    let home = tempfile::tempdir().unwrap();
    let c = client(&hub.endpoint(), home.path());
    let r = repo("acme/tiny");
    // HEAD succeeds, the content GET (after the CDN redirect) fails: hf-hub writes the body
    // of the failed response; the sha256 check must catch it.
    hub.fail_matching(Some("GET"), "/__cdn/", 500);
    let e = c
        .download_files(&r, &["model.safetensors"], false)
        .unwrap_err();
    assert!(matches!(e, HubError::Integrity { .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    let oid = sha256_hex(&weights());
    let blob = home.path().join("hub/models--acme--tiny/blobs").join(&oid);
    assert!(!blob.exists());

    hub.clear_failures();
    let p = c.download_files(&r, &["model.safetensors"], false).unwrap();
    assert_eq!(std::fs::read(&p[0]).unwrap(), weights());
    assert!(blob.is_file());
}

/// Every file under `dir` (hidden ones too) with its bytes.
fn snapshot_tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn model_folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("config.json"), CONFIG_JSON).unwrap();
    let mut all_bytes: Vec<u8> = (0..=255u8).collect();
    all_bytes.extend(weights());
    std::fs::write(d.join("model.safetensors"), &all_bytes).unwrap();
    std::fs::create_dir_all(d.join("extra")).unwrap();
    std::fs::write(d.join("extra").join("notes.txt"), "trained for 1 step\n").unwrap();
    std::fs::create_dir_all(d.join(".git")).unwrap();
    std::fs::write(d.join(".git").join("HEAD"), "ref: refs/heads/main\n").unwrap();
    dir
}

#[test]
fn dry_run_lists_sizes_and_sha256_without_network() {
    let folder = model_folder();
    let before = snapshot_tree(folder.path());
    let listing = dry_run_listing(folder.path()).unwrap();
    let names: Vec<&str> = listing.iter().map(|f| f.path_in_repo.as_str()).collect();
    assert_eq!(
        names,
        ["config.json", "extra/notes.txt", "model.safetensors"]
    );
    for f in &listing {
        let bytes = std::fs::read(folder.path().join(&f.path_in_repo)).unwrap();
        let expected: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(f.sha256, expected, "{}", f.path_in_repo);
        assert_eq!(f.size, bytes.len() as u64);
    }
    assert_eq!(snapshot_tree(folder.path()), before);
    let e = dry_run_listing(&folder.path().join("nope")).unwrap_err();
    assert!(matches!(e, HubError::InvalidFolder { .. }), "{e}");
}

#[test]
fn publish_then_download_back() {
    let hub = FakeHub::start();
    let home = tempfile::tempdir().unwrap();
    let folder = model_folder();
    let before = snapshot_tree(folder.path());
    let c = HubClient::new(config(&hub.endpoint(), home.path(), &[]).with_token(TOKEN)).unwrap();
    let r = repo("acme/new-model");

    let opts = PublishOptions {
        message: Some("first upload".into()),
        ..Default::default()
    };
    let report = c.publish_folder(folder.path(), &r, &opts).unwrap();
    let head = hub.head("acme/new-model", "main").unwrap();
    assert_eq!(
        report.commit_url,
        format!("{}/acme/new-model/commit/{head}", hub.endpoint())
    );
    assert_eq!(report.commit_sha.as_deref(), Some(head.as_str()));
    assert_eq!(
        report.repo_url,
        format!("{}/acme/new-model", hub.endpoint())
    );
    assert_eq!(report.files, dry_run_listing(folder.path()).unwrap());
    assert_eq!(snapshot_tree(folder.path()), before);

    let stored = hub.files_at("acme/new-model", "main").unwrap();
    let stored_names: Vec<&str> = stored.keys().map(String::as_str).collect();
    assert_eq!(
        stored_names,
        [
            ".gitattributes",
            "config.json",
            "extra/notes.txt",
            "model.safetensors"
        ]
    );

    // Every publish request carried the token as a bearer.
    let posts: Vec<_> = hub
        .requests()
        .into_iter()
        .filter(|q| q.method == "POST")
        .collect();
    let paths: Vec<&str> = posts.iter().map(|q| q.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/api/repos/create",
            "/api/models/acme/new-model/preupload/main",
            "/api/models/acme/new-model/commit/main"
        ]
    );
    assert!(posts.iter().all(|q| q.bearer() == Some(TOKEN)));

    // Download back into a fresh cache: identical bytes, at the published commit.
    let home2 = tempfile::tempdir().unwrap();
    let c2 = client(&hub.endpoint(), home2.path());
    let files = ["config.json", "extra/notes.txt", "model.safetensors"];
    let got = c2.download_files(&r, &files, false).unwrap();
    for (p, name) in got.iter().zip(files) {
        assert_eq!(
            std::fs::read(p).unwrap(),
            before[&folder.path().join(name)],
            "{name}"
        );
        assert!(p.starts_with(
            home2
                .path()
                .join("hub/models--acme--new-model/snapshots")
                .join(&head)
        ));
    }

    // Re-publish (repo exists: exist_ok) to a new branch; main is unchanged.
    std::fs::write(folder.path().join("config.json"), b"{\"v\": 2}").unwrap();
    let dev = repo("acme/new-model@dev");
    let report2 = c
        .publish_folder(folder.path(), &dev, &PublishOptions::default())
        .unwrap();
    assert_eq!(report2.revision, "dev");
    assert_eq!(hub.head("acme/new-model", "main").unwrap(), head);
    let dev_head = hub.head("acme/new-model", "dev").unwrap();
    assert!(report2.commit_url.ends_with(&dev_head));
    let p = c2.download_files(&dev, &["config.json"], false).unwrap();
    assert_eq!(std::fs::read(&p[0]).unwrap(), b"{\"v\": 2}");
    assert_eq!(
        std::fs::read_to_string(home2.path().join("hub/models--acme--new-model/refs/dev")).unwrap(),
        dev_head
    );
}

#[test]
fn tokens_are_sent_but_never_shown() {
    let hub = FakeHub::start();
    tiny_repo(&hub);
    hub.require_token(Some(TOKEN));
    let home = tempfile::tempdir().unwrap();
    // Token from $HF_HOME/token.
    std::fs::write(home.path().join("token"), format!("{TOKEN}\n")).unwrap();
    let cfg = config(&hub.endpoint(), home.path(), &[]);
    assert!(cfg.has_token());
    let c = HubClient::new(cfg.clone()).unwrap();
    c.download_files(&repo("acme/tiny"), &["config.json"], false)
        .unwrap();
    assert!(hub.requests().iter().all(|q| q.bearer() == Some(TOKEN)));
    assert!(!format!("{cfg:?} {c:?}").contains(TOKEN));

    // A rejected token: auth error, no token in Display or Debug.
    let wrong = "hf_wrong_SECRET_token_987654321";
    let bad = HubClient::new(config(&hub.endpoint(), home.path(), &[("HF_TOKEN", wrong)])).unwrap();
    let folder = model_folder();
    let mut errors = vec![
        bad.download_files(&repo("acme/tiny"), &["tokenizer.json"], false)
            .unwrap_err(),
        bad.list_files(&repo("acme/tiny")).unwrap_err(),
        bad.publish_folder(
            folder.path(),
            &repo("acme/other"),
            &PublishOptions::default(),
        )
        .unwrap_err(),
    ];
    hub.fail_all(500);
    errors.push(
        c.publish_folder(
            folder.path(),
            &repo("acme/other"),
            &PublishOptions::default(),
        )
        .unwrap_err(),
    );
    for e in &errors[..3] {
        assert!(matches!(e, HubError::Auth { status: 401, .. }), "{e}");
    }
    for e in &errors {
        let shown = format!("{e} {e:?} {bad:?}");
        assert!(!shown.contains(wrong) && !shown.contains(TOKEN), "{shown}");
    }
}

#[test]
fn a_failing_publish_leaves_the_folder_untouched() {
    let hub = FakeHub::start();
    let home = tempfile::tempdir().unwrap();
    let folder = model_folder();
    let before = snapshot_tree(folder.path());
    let c = HubClient::new(config(&hub.endpoint(), home.path(), &[]).with_token(TOKEN)).unwrap();
    let r = repo("acme/broken");

    hub.fail_all(500);
    let e = c
        .publish_folder(folder.path(), &r, &PublishOptions::default())
        .unwrap_err();
    assert!(matches!(e, HubError::Server { status: 500, .. }), "{e}");
    assert!(e.to_string().contains("acme/broken"), "{e}");
    assert_eq!(snapshot_tree(folder.path()), before);
    assert!(!hub.has_repo("acme/broken"));

    // The commit itself fails after the repo was created: nothing committed.
    hub.clear_failures();
    hub.fail_matching(Some("POST"), "/commit/", 500);
    let e = c
        .publish_folder(folder.path(), &r, &PublishOptions::default())
        .unwrap_err();
    assert!(matches!(e, HubError::Server { status: 500, .. }), "{e}");
    let stored = hub.files_at("acme/broken", "main").unwrap();
    assert_eq!(stored.keys().collect::<Vec<_>>(), [".gitattributes"]);
    assert_eq!(snapshot_tree(folder.path()), before);

    // Nobody listening.
    let dead =
        HubClient::new(config(&refused_endpoint(), home.path(), &[]).with_token(TOKEN)).unwrap();
    let e = dead
        .publish_folder(folder.path(), &r, &PublishOptions::default())
        .unwrap_err();
    assert!(matches!(e, HubError::Network { .. }), "{e}");
    assert!(e.to_string().contains("acme/broken"), "{e}");
    assert_eq!(snapshot_tree(folder.path()), before);
}
