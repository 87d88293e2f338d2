//! Integration tests of `tokenformer::hub` against the fake Hub in `common/hub_server.rs`.
//!
//! They go through the real HTTP code path on 127.0.0.1 and check the `huggingface_hub`
//! cache layout (`models--o--n/{blobs,snapshots/<sha>,refs/<rev>}`), the offline mode,
//! error classification, publishing and token hygiene, and then a hostile server: every
//! attack of `hub_server::Attack` ends in a clean error naming repo and file (or a correct
//! download after a retry), changes nothing outside `HF_HOME` (a sentinel tree is compared
//! before and after) and leaves no unverified blob in the cache. Configuration is passed
//! with `HubConfig::from_vars` so no test mutates the process environment.

#[path = "common/hub_server.rs"]
mod hub_server;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hub_server::{git_etag, sha256_hex, Attack, FakeHub};
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
    .with_timeouts(Duration::from_secs(2), Duration::from_secs(5))
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
        .download_files(&r, &["config.json", "model.safetensors"], None)
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

    // The first file names the revision, the next ones the commit it resolved to (one
    // call never mixes two commits).
    let reqs = hub.requests();
    assert!(reqs
        .iter()
        .any(|q| q.method == "HEAD" && q.path == "/acme/tiny/resolve/main/config.json"));
    assert!(reqs
        .iter()
        .any(|q| q.method == "HEAD"
            && q.path == format!("/acme/tiny/resolve/{sha}/model.safetensors")));
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
        .download_files(&r, &["config.json", "model.safetensors"], None)
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
    let p = c.download_files(&feature, &["config.json"], None).unwrap();
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
        c.download_files(&pinned, &["config.json"], None).unwrap()[0],
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
        .download_files(&r, &["config.json", "model.safetensors"], None)
        .unwrap();

    // Server answering 500: cached files still resolve (like huggingface_hub), an uncached
    // one is a server error naming it.
    hub.fail_all(500);
    assert_eq!(
        online.download_files(&r, &["config.json"], None).unwrap()[0],
        paths[0]
    );
    let e = online
        .download_files(&r, &["tokenizer.json"], None)
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
            .download_files(&r, &["config.json", "model.safetensors"], None)
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
            .download_files(&r, &["tokenizer.json"], None)
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
        .download_files(&r, &["config.json", "model.safetensors"], None)
        .unwrap();
    assert_eq!(std::fs::read(&got[0]).unwrap(), CONFIG_JSON);
    assert_eq!(std::fs::read(&got[1]).unwrap(), weights());
    let e = offline
        .publish_folder(home.path(), &r, &PublishOptions::default())
        .unwrap_err();
    assert!(matches!(e, HubError::Offline { .. }), "{e}");
}

/// The methods and paths of the requests the hub saw, then forgotten.
fn taken(hub: &FakeHub) -> Vec<String> {
    let seen = hub
        .requests()
        .iter()
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    hub.clear_requests();
    seen
}

#[test]
fn an_unreachable_hub_is_tried_once_when_the_cache_holds_the_answer() {
    // As huggingface_hub: what the cache holds is not retried for (a cluster node without
    // network would wait through every backoff for every file); what it lacks is.
    let hub = FakeHub::start();
    let sha = tiny_repo(&hub);
    let home = tempfile::tempdir().unwrap();
    let r = repo("acme/tiny");
    let retrying = |endpoint: &str| {
        let cfg = config(endpoint, home.path(), &[])
            .with_retries(3)
            .with_retry_base_delay(Duration::from_millis(5));
        HubClient::new(cfg).unwrap()
    };
    let c = retrying(&hub.endpoint());
    let paths = c
        .download_files(&r, &["config.json", "model.safetensors"], None)
        .unwrap();

    hub.fail_all(503);
    hub.clear_requests();
    // One HEAD for the first file; the second comes from the same cached commit unasked.
    let got = c
        .download_files(&r, &["config.json", "model.safetensors"], None)
        .unwrap();
    assert_eq!(got, paths);
    assert_eq!(
        taken(&hub),
        ["HEAD /acme/tiny/resolve/main/config.json"],
        "one try, then the cache"
    );
    let listed: Vec<String> = c
        .list_files(&r)
        .unwrap()
        .into_iter()
        .map(|f| f.path)
        .collect();
    assert_eq!(listed, ["config.json", "model.safetensors"]);
    assert_eq!(taken(&hub), ["GET /api/models/acme/tiny/tree/main"]);
    assert_eq!(c.resolve_commit(&r).unwrap(), sha);
    assert_eq!(taken(&hub), ["GET /api/models/acme/tiny/revision/main"]);

    // Not cached: the configured retries, then the server's error.
    let e = c.download_files(&r, &["tokenizer.json"], None).unwrap_err();
    assert!(matches!(e, HubError::Server { status: 503, .. }), "{e}");
    assert_eq!(taken(&hub).len(), 4, "one try and three retries");
    let other = repo("acme/other");
    assert!(c.list_files(&other).is_err());
    assert_eq!(taken(&hub).len(), 4);

    // A cached copy that turns out wrong is removed, not used: then the Hub is retried.
    let blob = std::fs::canonicalize(&paths[0]).unwrap();
    std::fs::write(&blob, b"{}").unwrap();
    let e = c.download_files(&r, &["config.json"], None).unwrap_err();
    assert!(matches!(e, HubError::Server { status: 503, .. }), "{e}");
    assert_eq!(taken(&hub).len(), 5, "one try, the check, then four tries");
    assert!(!blob.exists());
    hub.clear_failures();
    let fresh = c.download_files(&r, &["config.json"], None).unwrap();
    assert_eq!(std::fs::read(&fresh[0]).unwrap(), CONFIG_JSON);

    // No server at all (connection refused): the same, without HF_HUB_OFFLINE.
    let endpoint = hub.endpoint();
    hub.stop();
    let c = retrying(&endpoint);
    let got = c
        .download_files(&r, &["config.json", "model.safetensors"], None)
        .unwrap();
    assert_eq!(std::fs::read(&got[1]).unwrap(), weights());
    assert_eq!(c.list_files(&r).unwrap().len(), 2);
    let e = c.download_files(&r, &["tokenizer.json"], None).unwrap_err();
    assert!(matches!(e, HubError::Network { .. }), "{e}");
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
        .download_files(&repo("acme/nope"), &["config.json"], None)
        .unwrap_err();
    assert!(matches!(e, HubError::RepoNotFound { .. }), "{e}");
    assert!(e.to_string().contains("acme/nope"), "{e}");

    let e = c
        .download_files(&repo("acme/tiny"), &["missing.bin"], None)
        .unwrap_err();
    assert!(matches!(e, HubError::FileNotFound { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("missing.bin") && msg.contains("acme/tiny@main"),
        "{msg}"
    );

    let e = c
        .download_files(&repo("acme/tiny@v9"), &["config.json"], None)
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
            .download_files(&repo("acme/secret"), &["config.json"], None)
            .unwrap_err();
        assert!(matches!(e, HubError::RepoNotFound { .. }), "{e}");
        assert!(e.to_string().contains("token"), "{e}");
    }

    let e = c
        .download_files(&repo("acme/tiny"), &["../escape"], None)
        .unwrap_err();
    assert!(matches!(e, HubError::InvalidFileName { .. }), "{e}");

    // 500 from a fresh cache.
    hub.fail_all(500);
    let e = c
        .download_files(&repo("acme/tiny"), &["config.json"], None)
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
        .download_files(&repo("acme/tiny"), &["config.json"], None)
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
fn a_failed_lfs_download_is_not_cached() {
    let hub = FakeHub::start();
    tiny_repo(&hub);
    let home = tempfile::tempdir().unwrap();
    let c = client(&hub.endpoint(), home.path());
    let r = repo("acme/tiny");
    // HEAD succeeds, the content GET (after the CDN redirect) fails: hf-hub 1.0 wrote the
    // body of the failed response as the blob; here it is an error and nothing is kept.
    hub.fail_matching(Some("GET"), "/__cdn/", 500);
    let e = c
        .download_files(&r, &["model.safetensors"], None)
        .unwrap_err();
    assert!(matches!(e, HubError::Server { status: 500, .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    assert_cache_clean(home.path());
    let oid = sha256_hex(&weights());
    let blob = home.path().join("hub/models--acme--tiny/blobs").join(&oid);
    assert!(!blob.exists());

    hub.clear_failures();
    let p = c.download_files(&r, &["model.safetensors"], None).unwrap();
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
    let got = c2.download_files(&r, &files, None).unwrap();
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
    let p = c2.download_files(&dev, &["config.json"], None).unwrap();
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
    c.download_files(&repo("acme/tiny"), &["config.json"], None)
        .unwrap();
    assert!(hub.requests().iter().all(|q| q.bearer() == Some(TOKEN)));
    assert!(!format!("{cfg:?} {c:?}").contains(TOKEN));

    // A rejected token: auth error, no token in Display or Debug.
    let wrong = "hf_wrong_SECRET_token_987654321";
    let bad = HubClient::new(config(&hub.endpoint(), home.path(), &[("HF_TOKEN", wrong)])).unwrap();
    let folder = model_folder();
    let mut errors = vec![
        bad.download_files(&repo("acme/tiny"), &["tokenizer.json"], None)
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

// ---------------------------------------------------------------------------------------
// A hostile server.

/// What every entry under `dir` is (links not followed): file content hash, link target,
/// or folder.
fn tree_state(dir: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            let what = if meta.file_type().is_symlink() {
                format!("link {}", std::fs::read_link(&p).unwrap().display())
            } else if meta.is_dir() {
                stack.push(p.clone());
                "dir".to_string()
            } else {
                format!("file {}", sha256_hex(&std::fs::read(&p).unwrap()))
            };
            out.insert(p, what);
        }
    }
    out
}

/// A temporary root holding `hf/` (HF_HOME) and a sentinel tree around it that no
/// download may create, change or remove anything in.
struct Sandbox {
    root: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Self {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("hf/hub")).unwrap();
        std::fs::create_dir_all(r.join("sentinel/sub")).unwrap();
        std::fs::write(r.join("sentinel/victim"), "keep me").unwrap();
        std::fs::write(r.join("sentinel/sub/b.bin"), [1u8, 2, 3]).unwrap();
        std::fs::write(r.join("x"), "root file").unwrap();
        std::os::unix::fs::symlink("sentinel/victim", r.join("link")).unwrap();
        Sandbox { root }
    }

    fn hf(&self) -> PathBuf {
        self.root.path().join("hf")
    }

    /// Everything outside `hf/`.
    fn outside(&self) -> BTreeMap<PathBuf, String> {
        let hf = self.hf();
        tree_state(self.root.path())
            .into_iter()
            .filter(|(p, _)| !p.starts_with(&hf))
            .collect()
    }
}

/// Every blob in the cache is named by a valid ETag and holds exactly that content; no
/// temporary file is left; every snapshot entry is a link to an existing blob.
fn assert_cache_clean(hf_home: &Path) {
    let hub_dir = hf_home.join("hub");
    let Ok(repos) = std::fs::read_dir(&hub_dir) else {
        return;
    };
    for repo_dir in repos {
        let repo_dir = repo_dir.unwrap().path();
        if !repo_dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("models--")
        {
            continue;
        }
        if let Ok(blobs) = std::fs::read_dir(repo_dir.join("blobs")) {
            for b in blobs {
                let p = b.unwrap().path();
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                let meta = std::fs::symlink_metadata(&p).unwrap();
                assert!(meta.is_file(), "{} is not a regular file", p.display());
                let bytes = std::fs::read(&p).unwrap();
                let ok = match name.len() {
                    40 => git_etag(&bytes) == name,
                    64 => sha256_hex(&bytes) == name,
                    _ => false,
                };
                assert!(ok, "unverified blob {} in the cache", p.display());
            }
        }
        for (p, what) in tree_state(&repo_dir.join("snapshots")) {
            if what == "dir" {
                continue;
            }
            assert!(what.starts_with("link "), "{}: {what}", p.display());
            let target = std::fs::canonicalize(&p)
                .unwrap_or_else(|e| panic!("dangling snapshot link {}: {e}", p.display()));
            assert!(
                target.starts_with(repo_dir.join("blobs").canonicalize().unwrap()),
                "{} leads out of blobs/",
                p.display()
            );
        }
    }
}

fn hostile_config(endpoint: &str, hf_home: &Path) -> HubConfig {
    config(endpoint, hf_home, &[])
        .with_token(TOKEN)
        .with_retries(2)
        .with_retry_base_delay(Duration::from_millis(10))
        .with_max_retry_wait(Duration::from_millis(200))
        .with_timeouts(Duration::from_secs(1), Duration::from_millis(300))
}

/// What a hostile case must end in.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// An error of this `HubError` variant (its `Debug` name).
    Err(&'static str),
    /// The right content, after retries.
    Ok,
}

struct Case {
    name: &'static str,
    method: Option<&'static str>,
    path: &'static str,
    attack: Attack,
    times: Option<usize>,
    file: &'static str,
    expect: Expect,
}

const OUTSIDE_ABS: &str = "/tmp/tokenformer-hostile-abs";
const HTML: &[u8] = b"<!DOCTYPE html><html><body>502 Bad Gateway</body></html>";

fn hostile_cases() -> Vec<Case> {
    use Expect::*;
    let c = "config.json";
    let w = "model.safetensors";
    let secs = Duration::from_secs_f64;
    let case = |name, method, path, attack, times, file, expect| Case {
        name,
        method,
        path,
        attack,
        times,
        file,
        expect,
    };
    vec![
        case(
            "commit ../",
            Some("HEAD"),
            "/resolve/",
            Attack::Commit("../../../../sentinel/victim".into()),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "commit 40 chars of ../",
            Some("HEAD"),
            "/resolve/",
            Attack::Commit(format!("{}x", "../".repeat(13))),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "commit absolute",
            Some("HEAD"),
            "/resolve/",
            Attack::Commit(OUTSIDE_ABS.into()),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "commit on an LFS redirect",
            Some("HEAD"),
            "/resolve/",
            Attack::Commit("../../../../x".into()),
            None,
            w,
            Err("BadResponse"),
        ),
        case(
            "commit empty",
            Some("HEAD"),
            "/resolve/",
            Attack::Commit(String::new()),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "etag ../",
            Some("HEAD"),
            "/resolve/",
            Attack::Etag("\"../../../../sentinel/victim\"".into()),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "linked etag ../",
            Some("HEAD"),
            "/resolve/",
            Attack::Etag("\"../../../../../tmp/tokenformer-hostile-etag\"".into()),
            None,
            w,
            Err("BadResponse"),
        ),
        case(
            "etag absolute",
            Some("HEAD"),
            "/resolve/",
            Attack::Etag(OUTSIDE_ABS.into()),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "etag of other content",
            Some("HEAD"),
            "/resolve/",
            Attack::Etag(format!("\"{}\"", sha256_hex(b"other"))),
            None,
            w,
            Err("Integrity"),
        ),
        case(
            "git etag of other content",
            Some("HEAD"),
            "/resolve/",
            Attack::Etag(format!("\"{}\"", git_etag(b"other"))),
            None,
            c,
            Err("Integrity"),
        ),
        case(
            "HTML with 200",
            Some("GET"),
            "/resolve/",
            Attack::Body(200, HTML.to_vec()),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "HTML of the right size with 200",
            Some("GET"),
            "/resolve/",
            Attack::Body(200, HTML[..CONFIG_JSON.len()].to_vec()),
            None,
            c,
            Err("Integrity"),
        ),
        case(
            "error JSON with 200",
            Some("GET"),
            "/resolve/",
            Attack::Body(200, br#"{"error":"Internal Error"}"#.to_vec()),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "HTML with 200 from the CDN",
            Some("GET"),
            "/__cdn/",
            Attack::Body(200, HTML.to_vec()),
            None,
            w,
            Err("BadResponse"),
        ),
        case(
            "error status on GET",
            Some("GET"),
            "/resolve/",
            Attack::Status(500, None),
            None,
            c,
            Err("Server"),
        ),
        case(
            "flipped byte",
            Some("GET"),
            "/resolve/",
            Attack::FlipByte(5),
            None,
            c,
            Err("Integrity"),
        ),
        case(
            "flipped byte from the CDN",
            Some("GET"),
            "/__cdn/",
            Attack::FlipByte(4000),
            None,
            w,
            Err("Integrity"),
        ),
        case(
            "short body",
            Some("GET"),
            "/resolve/",
            Attack::ShortBody(10),
            None,
            c,
            Err("BadResponse"),
        ),
        case(
            "short body from the CDN",
            Some("GET"),
            "/__cdn/",
            Attack::ShortBody(1000),
            None,
            w,
            Err("BadResponse"),
        ),
        case(
            "lying size on HEAD",
            Some("HEAD"),
            "/resolve/",
            Attack::Header("X-Linked-Size".into(), "999999999".into()),
            None,
            w,
            Err("BadResponse"),
        ),
        case(
            "size not a number",
            Some("HEAD"),
            "/resolve/",
            Attack::Header("X-Linked-Size".into(), "-1".into()),
            None,
            w,
            Err("BadResponse"),
        ),
        case(
            "lying Content-Length on every answer, resumed",
            Some("GET"),
            "/__cdn/",
            Attack::CutAfter(3000),
            None,
            w,
            Ok,
        ),
        case(
            "lying Content-Length, once",
            Some("GET"),
            "/__cdn/",
            Attack::CutAfter(3000),
            Some(1),
            w,
            Ok,
        ),
        case(
            "stall, once",
            Some("GET"),
            "/__cdn/",
            Attack::Stall {
                after: 1500,
                pause: secs(1.5),
            },
            Some(1),
            w,
            Ok,
        ),
        case(
            "stall mid-body on every answer, resumed",
            Some("GET"),
            "/__cdn/",
            Attack::Stall {
                after: 1500,
                pause: secs(3.0),
            },
            None,
            w,
            Ok,
        ),
        case(
            "stall at the start of every answer",
            Some("GET"),
            "/__cdn/",
            Attack::Stall {
                after: 0,
                pause: secs(3.0),
            },
            None,
            w,
            Err("Network"),
        ),
        case(
            "stall before the body",
            Some("GET"),
            "/resolve/",
            Attack::Stall {
                after: 0,
                pause: secs(3.0),
            },
            None,
            c,
            Err("Network"),
        ),
        case(
            "429 with Retry-After, twice",
            Some("HEAD"),
            "/resolve/",
            Attack::Status(429, Some("0".into())),
            Some(2),
            c,
            Ok,
        ),
        case(
            "429 asking for an hour",
            None,
            "/resolve/",
            Attack::Status(429, Some("3600".into())),
            None,
            c,
            Err("Http"),
        ),
        case(
            "503 then success",
            Some("GET"),
            "/__cdn/",
            Attack::Status(503, None),
            Some(2),
            w,
            Ok,
        ),
        case(
            "503 always",
            Some("HEAD"),
            "/resolve/",
            Attack::Status(503, None),
            None,
            w,
            Err("Server"),
        ),
    ]
}

#[test]
fn a_hostile_server_cannot_escape_the_cache_or_poison_it() {
    let start = Instant::now();
    for case in hostile_cases() {
        let hub = FakeHub::start();
        tiny_repo(&hub);
        let sandbox = Sandbox::new();
        let before = sandbox.outside();
        let c = HubClient::new(hostile_config(&hub.endpoint(), &sandbox.hf())).unwrap();
        hub.attack(case.method, case.path, case.attack.clone(), case.times);
        let t = Instant::now();
        let got = c.download_files(&repo("acme/tiny"), &[case.file], None);
        let took = t.elapsed();
        let name = case.name;
        match (case.expect, got) {
            (Expect::Ok, Ok(paths)) => {
                let want = if case.file == "config.json" {
                    CONFIG_JSON.to_vec()
                } else {
                    weights()
                };
                assert_eq!(std::fs::read(&paths[0]).unwrap(), want, "{name}");
            }
            (Expect::Err(variant), Err(e)) => {
                let dbg = format!("{e:?}");
                assert!(
                    dbg.starts_with(variant),
                    "{name}: expected {variant}, got {e}"
                );
                let msg = e.to_string();
                assert!(
                    msg.contains("acme/tiny") && msg.contains(case.file),
                    "{name}: the error names neither repo nor file: {msg}"
                );
                assert!(
                    !msg.contains(TOKEN) && !dbg.contains(TOKEN),
                    "{name}: {msg}"
                );
            }
            (want, got) => panic!("{name}: expected {want:?}, got {got:?}"),
        }
        assert!(took < Duration::from_secs(8), "{name} took {took:?}");
        assert_eq!(
            sandbox.outside(),
            before,
            "{name}: files outside HF_HOME changed"
        );
        for p in [OUTSIDE_ABS, "/tmp/tokenformer-hostile-etag"] {
            assert!(!Path::new(p).exists(), "{name}: created {p}");
        }
        assert_cache_clean(&sandbox.hf());
        // Only files that downloaded correctly are in the snapshot.
        let snapshots = sandbox.hf().join("hub/models--acme--tiny/snapshots");
        let linked = tree_state(&snapshots)
            .values()
            .filter(|w| w.starts_with("link"))
            .count();
        assert_eq!(linked, matches!(case.expect, Expect::Ok) as usize, "{name}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(45),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_resumed_download_asks_for_the_rest_only() {
    let hub = FakeHub::start();
    tiny_repo(&hub);
    let sandbox = Sandbox::new();
    let c = HubClient::new(hostile_config(&hub.endpoint(), &sandbox.hf())).unwrap();
    hub.attack(Some("GET"), "/__cdn/", Attack::CutAfter(3000), Some(1));
    let p = c
        .download_files(&repo("acme/tiny"), &["model.safetensors"], None)
        .unwrap();
    assert_eq!(std::fs::read(&p[0]).unwrap(), weights());
    let ranges: Vec<Option<String>> = hub
        .requests()
        .into_iter()
        .filter(|q| q.method == "GET" && q.path.starts_with("/__cdn/"))
        .map(|q| q.range)
        .collect();
    assert_eq!(ranges, [None, Some("bytes=3000-".to_string())]);
    assert_cache_clean(&sandbox.hf());
}

#[test]
fn retry_after_is_honoured_and_bounded() {
    let hub = FakeHub::start();
    tiny_repo(&hub);
    let sandbox = Sandbox::new();
    let c = HubClient::new(
        hostile_config(&hub.endpoint(), &sandbox.hf()).with_max_retry_wait(Duration::from_secs(5)),
    )
    .unwrap();
    hub.attack(
        Some("HEAD"),
        "/resolve/",
        Attack::Status(429, Some("1".into())),
        Some(1),
    );
    let t = Instant::now();
    c.download_files(&repo("acme/tiny"), &["config.json"], None)
        .unwrap();
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(950), "did not wait: {took:?}");
    assert!(took < Duration::from_secs(4), "{took:?}");
    // An HTTP date in the past means "now".
    hub.attack(
        Some("HEAD"),
        "/resolve/",
        Attack::Status(503, Some("Wed, 21 Oct 2015 07:28:00 GMT".into())),
        Some(1),
    );
    let t = Instant::now();
    c.download_files(&repo("acme/tiny"), &["tokenizer.json"], None)
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn the_token_never_follows_a_redirect_to_another_host() {
    let hub = FakeHub::start();
    tiny_repo(&hub);
    let cdn = FakeHub::start();
    tiny_repo(&cdn);
    let sandbox = Sandbox::new();
    let c = HubClient::new(hostile_config(&hub.endpoint(), &sandbox.hf())).unwrap();
    hub.attack(
        Some("GET"),
        "/resolve/",
        Attack::RedirectTo(cdn.endpoint()),
        None,
    );
    let paths = c
        .download_files(
            &repo("acme/tiny"),
            &["config.json", "model.safetensors"],
            None,
        )
        .unwrap();
    assert_eq!(std::fs::read(&paths[0]).unwrap(), CONFIG_JSON);
    assert_eq!(std::fs::read(&paths[1]).unwrap(), weights());
    let other = cdn.requests();
    assert_eq!(other.len(), 2, "{other:?}");
    assert!(other.iter().all(|q| !q.has_auth()), "{other:?}");
    // The endpoint itself did get the token.
    assert!(hub.requests().iter().all(|q| q.bearer() == Some(TOKEN)));
    assert_cache_clean(&sandbox.hf());

    // An API answer redirected elsewhere is not followed at all.
    hub.attack(
        Some("GET"),
        "/api/models/acme/tiny/tree",
        Attack::RedirectTo(cdn.endpoint()),
        None,
    );
    cdn.clear_requests();
    let e = c.list_files(&repo("acme/tiny")).unwrap_err();
    assert!(e.to_string().contains("acme/tiny"), "{e}");
    assert!(cdn.requests().is_empty());
}

#[test]
fn tree_listings_with_escaping_names_are_refused() {
    for bad in [
        "../../x.safetensors",
        "/etc/passwd",
        "a\\..\\b",
        "sub//x",
        "sub/./x",
    ] {
        let hub = FakeHub::start();
        tiny_repo(&hub);
        let sandbox = Sandbox::new();
        let c = HubClient::new(hostile_config(&hub.endpoint(), &sandbox.hf())).unwrap();
        hub.attack(Some("GET"), "/tree/", Attack::TreeFile(bad.into()), None);
        let e = c.list_files(&repo("acme/tiny")).unwrap_err();
        assert!(matches!(e, HubError::BadResponse { .. }), "{bad}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("acme/tiny") && msg.contains(&format!("{bad:?}")),
            "{bad}: {msg}"
        );
    }
}

#[test]
fn index_shard_names_must_stay_inside_the_repo() {
    let dir = tempfile::tempdir().unwrap();
    let r = repo("acme/sharded");
    let index = dir.path().join("model.safetensors.index.json");
    for bad in ["../../x.safetensors", "/etc/passwd", "a\\b.safetensors", ""] {
        let json = serde_json::json!({"weight_map": {"w": "model-1.safetensors", "v": bad}});
        std::fs::write(&index, json.to_string()).unwrap();
        let e = tokenformer::hub::safetensors_index_shards(&r, &index).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("acme/sharded") && msg.contains(&format!("{bad:?}")),
            "{msg}"
        );
    }
    let json = serde_json::json!({"weight_map": {
        "a": "shards/model-2.safetensors", "b": "model-1.safetensors", "c": "model-1.safetensors"
    }});
    std::fs::write(&index, json.to_string()).unwrap();
    assert_eq!(
        tokenformer::hub::safetensors_index_shards(&r, &index).unwrap(),
        ["model-1.safetensors", "shards/model-2.safetensors"]
    );
}

fn blob_path(hf_home: &Path, bytes: &[u8], lfs: bool) -> PathBuf {
    let etag = if lfs {
        sha256_hex(bytes)
    } else {
        git_etag(bytes)
    };
    hf_home.join("hub/models--acme--tiny/blobs").join(etag)
}

#[test]
fn a_blob_left_unverified_by_a_killed_process_is_never_trusted() {
    let hub = FakeHub::start();
    let sha = tiny_repo(&hub);
    let sandbox = Sandbox::new();
    let hf = sandbox.hf();
    let r = repo("acme/tiny");
    let c = HubClient::new(hostile_config(&hub.endpoint(), &hf)).unwrap();
    let files = ["config.json", "model.safetensors"];
    c.download_files(&r, &files, None).unwrap();
    let blobs = [
        blob_path(&hf, CONFIG_JSON, false),
        blob_path(&hf, &weights(), true),
    ];

    // What a process killed after writing the blob and before checking it leaves (or
    // hf-hub 1.0, which never checked): wrong bytes under the right name, linked from the
    // snapshot, and no verification marker; plus a stale partial download.
    let plant = || {
        for (b, wrong) in blobs
            .iter()
            .zip([&b"{\"hidden_size\": 1}"[..], &[0u8; 4096][..]])
        {
            let _ = std::fs::remove_file(b);
            std::fs::write(b, wrong).unwrap();
            std::fs::write(b.with_extension("incomplete"), b"garbage").unwrap();
        }
        let _ = std::fs::remove_dir_all(hf.join("hub/models--acme--tiny/.tokenformer"));
    };
    plant();
    // Offline: reported as corrupt, naming the file, and removed (never used).
    let offline = HubClient::new(hostile_config(&hub.endpoint(), &hf).with_offline(true)).unwrap();
    let e = offline.download_files(&r, &files, None).unwrap_err();
    assert!(matches!(e, HubError::Integrity { .. }), "{e}");
    assert!(e.to_string().contains("config.json") && e.to_string().contains("acme/tiny"));
    assert!(!blobs[0].exists());
    // A pinned commit (no request needed if it were trusted): checked, downloaded again.
    plant();
    hub.clear_requests();
    let pinned = repo(&format!("acme/tiny@{sha}"));
    let p = c.download_files(&pinned, &files, None).unwrap();
    assert_eq!(std::fs::read(&p[0]).unwrap(), CONFIG_JSON);
    assert_eq!(std::fs::read(&p[1]).unwrap(), weights());
    assert!(hub.requests().iter().any(|q| q.method == "GET"));
    // Online by branch: the same.
    plant();
    let p = c.download_files(&r, &files, None).unwrap();
    assert_eq!(std::fs::read(&p[1]).unwrap(), weights());
    // The stale partial files were taken over (truncated, then renamed when checked).
    assert_cache_clean(&hf);

    // A correct blob without a marker (e.g. written by Python's huggingface_hub) is
    // checked once and used without downloading it again.
    std::fs::remove_dir_all(hf.join("hub/models--acme--tiny/.tokenformer")).unwrap();
    hub.clear_requests();
    c.download_files(&r, &files, None).unwrap();
    assert!(
        hub.requests().iter().all(|q| q.method == "HEAD"),
        "{:?}",
        hub.requests()
    );
    hub.clear_requests();
    offline.download_files(&pinned, &files, None).unwrap();
    assert!(hub.requests().is_empty());
}

#[test]
fn concurrent_downloads_of_one_file_wait_for_each_other() {
    let hub = FakeHub::start();
    let big: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 31 % 251) as u8).collect();
    hub.add_repo("acme/tiny", &[("model.safetensors", &big)]);
    // 16 chunks of 16 KiB, 40 ms apart: about 0.7 s per transfer, so the three overlap.
    hub.attack(
        Some("GET"),
        "/__cdn/",
        Attack::Throttle {
            chunk: 16 * 1024,
            delay: Duration::from_millis(40),
        },
        None,
    );
    let sandbox = Sandbox::new();
    let endpoint = hub.endpoint();
    let results: Vec<Result<Vec<u8>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let (endpoint, hf) = (endpoint.clone(), sandbox.hf());
                s.spawn(move || {
                    // Separate clients, as separate processes would have.
                    let c = HubClient::new(hostile_config(&endpoint, &hf)).unwrap();
                    c.download_files(&repo("acme/tiny"), &["model.safetensors"], None)
                        .map(|p| std::fs::read(&p[0]).unwrap())
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        assert_eq!(r.unwrap(), big);
    }
    let gets = hub
        .requests()
        .iter()
        .filter(|q| q.method == "GET" && q.path.starts_with("/__cdn/"))
        .count();
    assert_eq!(gets, 1, "the blob was fetched {gets} times");
    assert_cache_clean(&sandbox.hf());
}

#[test]
fn a_lock_holder_without_progress_is_given_up_on() {
    let hub = FakeHub::start();
    tiny_repo(&hub);
    let sandbox = Sandbox::new();
    let hf = sandbox.hf();
    let lock = hf.join(format!(
        "hub/.locks/models--acme--tiny/{}.lock",
        git_etag(CONFIG_JSON)
    ));
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let held = std::fs::File::create(&lock).unwrap();
    held.lock().unwrap();
    let c = HubClient::new(
        hostile_config(&hub.endpoint(), &hf)
            .with_timeouts(Duration::from_millis(100), Duration::from_millis(100))
            .with_max_retry_wait(Duration::from_millis(100)),
    )
    .unwrap();
    let t = Instant::now();
    let e = c
        .download_files(&repo("acme/tiny"), &["config.json"], None)
        .unwrap_err();
    assert!(matches!(e, HubError::LockTimeout { .. }), "{e}");
    assert!(e.to_string().contains("config.json") && e.to_string().contains("acme/tiny"));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // Released (the holder exits): the download goes through.
    drop(held);
    c.download_files(&repo("acme/tiny"), &["config.json"], None)
        .unwrap();
    assert_cache_clean(&hf);
}

#[test]
fn publish_sends_regular_files_inside_the_folder_only() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "outside content").unwrap();
    std::fs::create_dir(outside.path().join("home")).unwrap();
    std::fs::write(outside.path().join("home/big"), vec![7u8; 1000]).unwrap();
    let folder = model_folder();
    let d = folder.path();
    let link =
        |target: &Path, name: &str| std::os::unix::fs::symlink(target, d.join(name)).unwrap();
    link(&outside.path().join("secret"), "leak.txt");
    link(Path::new("/etc/passwd"), "passwd");
    link(&outside.path().join("home"), "home");
    link(Path::new("config.json"), "config-link.json");
    link(Path::new("extra"), "extra-link");
    link(Path::new("missing"), "broken");
    link(Path::new(".git/HEAD"), "git-head");
    std::os::unix::fs::symlink("..", d.join("extra/up")).unwrap();
    std::fs::write(d.join(".env"), "TOKEN=x").unwrap();
    std::fs::write(d.join("extra/.env"), "TOKEN=y").unwrap();
    std::fs::create_dir_all(d.join("extra/.git")).unwrap();
    std::fs::write(d.join("extra/.git/config"), "x").unwrap();
    let fifo = std::ffi::CString::new(d.join("pipe").to_string_lossy().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);

    let listing = tokenformer::hub::upload_listing(d, &[]).unwrap();
    let names: Vec<&str> = listing
        .files
        .iter()
        .map(|f| f.path_in_repo.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "config-link.json",
            "config.json",
            "extra-link/notes.txt",
            "extra/notes.txt",
            "model.safetensors"
        ]
    );
    let skipped: Vec<&str> = listing.skipped.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        skipped,
        [
            ".env",
            ".git",
            "broken",
            "extra-link/.env",
            "extra-link/.git",
            "extra-link/up",
            "extra/.env",
            "extra/.git",
            "extra/up",
            "git-head",
            "home",
            "leak.txt",
            "passwd",
            "pipe"
        ]
    );
    for f in &listing.files {
        assert!(f.local_path.starts_with(d.canonicalize().unwrap()), "{f:?}");
    }
    assert_eq!(dry_run_listing(d).unwrap(), listing.files);

    // The upload sends exactly the listing (plus a replacement given by path).
    let hub = FakeHub::start();
    let home = tempfile::tempdir().unwrap();
    let c = HubClient::new(config(&hub.endpoint(), home.path(), &[]).with_token(TOKEN)).unwrap();
    let card = outside.path().join("card.md");
    std::fs::write(&card, "# card").unwrap();
    let opts = PublishOptions {
        replace: vec![("README.md".into(), card)],
        ..Default::default()
    };
    let report = c.publish_folder(d, &repo("acme/links"), &opts).unwrap();
    assert_eq!(report.skipped, listing.skipped);
    let stored = hub.files_at("acme/links", "main").unwrap();
    let mut want: Vec<&str> = names.clone();
    want.extend([".gitattributes", "README.md"]);
    want.sort();
    assert_eq!(stored.keys().map(String::as_str).collect::<Vec<_>>(), want);
    assert_eq!(stored["README.md"], b"# card");
    assert!(stored.values().all(|v| v != b"outside content"));
}

#[test]
fn a_silent_server_is_given_up_on_after_three_timeouts() {
    let hub = FakeHub::start();
    tiny_repo(&hub);
    let sandbox = Sandbox::new();
    // Many retries allowed, yet a server that never sends a byte is not waited for
    // `max_retries` times over.
    let c =
        HubClient::new(hostile_config(&hub.endpoint(), &sandbox.hf()).with_retries(20)).unwrap();
    hub.attack(
        Some("GET"),
        "/__cdn/",
        Attack::Stall {
            after: 0,
            pause: Duration::from_secs(3),
        },
        None,
    );
    let t = Instant::now();
    let e = c
        .download_files(&repo("acme/tiny"), &["model.safetensors"], None)
        .unwrap_err();
    assert!(matches!(e, HubError::Network { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("TOKENFORMER_HUB_TIMEOUT"),
        "{msg}"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let gets = hub
        .requests()
        .iter()
        .filter(|q| q.method == "GET" && q.path.starts_with("/__cdn/"))
        .count();
    assert_eq!(gets, 3);
    assert_cache_clean(&sandbox.hf());
}
