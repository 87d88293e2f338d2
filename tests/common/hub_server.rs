//! A fake Hugging Face Hub HTTP server for tests.
//!
//! It speaks the subset of the Hub's HTTP protocol that `hf-hub` 1.0 (and Python's
//! `huggingface_hub`) use for model repos: `resolve` downloads with `ETag` / `X-Repo-Commit`
//! / `X-Linked-*` headers and a CDN-style redirect for LFS-like files, the `api/models` info,
//! tree and paths-info listings, and the publish flow (`api/repos/create`, `preupload`,
//! NDJSON `commit`, `branch`). It never sends `X-Xet-*` headers and answers `preupload` with
//! `"uploadMode": "regular"`, so clients take the plain-HTTP path (no Xet). Not-found errors
//! carry the Hub's `X-Error-Code` header (`RepoNotFound`, `RevisionNotFound`,
//! `EntryNotFound`).
//!
//! Hostile modes ([`FakeHub::attack`]) make it misbehave the way a compromised or broken
//! server would: path traversal in `X-Repo-Commit`, `ETag` and tree file names, error or
//! HTML bodies with status 200, flipped bytes, short bodies and lying `Content-Length`,
//! stalls, slow bodies, 429 with `Retry-After`, 5xx, and redirects to another host.
//! Each request is answered on its own thread, so a stalled answer blocks nobody else.
//!
//! Self-contained (only `tiny_http`, `serde_json`, `sha1`, `sha2` and std) so any test crate
//! can include it with `#[path = "common/hub_server.rs"] mod hub_server;` or via
//! `mod common;`.
//!
//! ```ignore
//! let hub = FakeHub::start();
//! let sha = hub.add_repo("acme/tiny", &[("config.json", b"{}")]);
//! // point the client at hub.endpoint(); assert on hub.requests(); hub.fail_all(500); ...
//! ```
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};
use sha1::Sha1;
use sha2::{Digest, Sha256};
use tiny_http::{Header, Response, Server, StatusCode};

/// One request as the fake Hub saw it.
#[derive(Clone)]
pub struct RecordedRequest {
    /// `GET`, `HEAD`, `POST`, ...
    pub method: String,
    /// Raw (still percent-encoded) path, without the query string.
    pub path: String,
    /// Raw query string, without `?` (empty if none).
    pub query: String,
    /// Value of the `Authorization` header, if any.
    pub authorization: Option<String>,
    /// Value of the `Range` header, if any.
    pub range: Option<String>,
}

impl RecordedRequest {
    /// Whether an `Authorization` header was sent.
    pub fn has_auth(&self) -> bool {
        self.authorization.is_some()
    }

    /// The bearer token, if the header had the form `Bearer <token>`.
    pub fn bearer(&self) -> Option<&str> {
        self.authorization.as_deref()?.strip_prefix("Bearer ")
    }
}

// Keep tokens out of test logs even though these are test tokens.
impl std::fmt::Debug for RecordedRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordedRequest")
            .field("method", &self.method)
            .field("path", &self.path)
            .field("query", &self.query)
            .field("has_auth", &self.has_auth())
            .field("range", &self.range)
            .finish()
    }
}

/// An injected failure: respond with `status` to matching requests.
#[derive(Clone, Debug)]
struct Failure {
    method: Option<String>,
    path_contains: String,
    status: u16,
}

/// A way to misbehave, for the requests an [`FakeHub::attack`] rule matches.
#[derive(Clone, Debug)]
pub enum Attack {
    /// Set (or add) a response header, e.g. `X-Repo-Commit: ../../x` or a wrong
    /// `X-Linked-Size`.
    Header(String, String),
    /// Set `X-Repo-Commit` (resolve answers).
    Commit(String),
    /// Set `ETag`, and `X-Linked-Etag` where the answer has one.
    Etag(String),
    /// Add a file of this name to tree listings.
    TreeFile(String),
    /// Replace status and body (e.g. 200 with an HTML page); the headers stay.
    Body(u16, Vec<u8>),
    /// Flip every bit of the body byte at this offset.
    FlipByte(usize),
    /// Announce and send only the first `n` bytes of the body (a consistent short answer).
    ShortBody(usize),
    /// Announce the full length but send only `n` bytes, then never finish the answer.
    /// (The server buffers 1 KiB of output: a smaller `n` may never reach the client.)
    CutAfter(usize),
    /// Send `after` bytes of the body, pause, then send the rest.
    Stall { after: usize, pause: Duration },
    /// Send the body `chunk` bytes at a time with a pause before each.
    Throttle { chunk: usize, delay: Duration },
    /// Answer with this status (and `Retry-After` if given) instead.
    Status(u16, Option<String>),
    /// Answer content requests with a 302 to the same `/__cdn/<sha256>` on another server.
    RedirectTo(String),
}

#[derive(Clone, Debug)]
struct Rule {
    method: Option<String>,
    path_contains: String,
    attack: Attack,
    /// Requests it still applies to (`None`: all).
    remaining: Option<usize>,
}

#[derive(Clone)]
struct Commit {
    files: BTreeMap<String, Arc<Vec<u8>>>,
}

struct Repo {
    private: bool,
    branches: BTreeMap<String, String>,
    commits: HashMap<String, Commit>,
}

impl Repo {
    fn resolve(&self, rev: &str) -> Option<String> {
        if let Some(sha) = self.branches.get(rev) {
            return Some(sha.clone());
        }
        self.commits.contains_key(rev).then(|| rev.to_string())
    }
}

struct State {
    endpoint: String,
    repos: BTreeMap<String, Repo>,
    requests: Vec<RecordedRequest>,
    failures: Vec<Failure>,
    rules: Vec<Rule>,
    required_token: Option<String>,
    lfs_redirects: bool,
    counter: u64,
}

/// A running fake Hub bound to `127.0.0.1:<random port>`; stopped on drop.
pub struct FakeHub {
    endpoint: String,
    state: Arc<Mutex<State>>,
    server: Arc<Server>,
    thread: Option<JoinHandle<()>>,
}

impl FakeHub {
    /// Start an empty fake Hub on a background thread.
    pub fn start() -> FakeHub {
        let server = Arc::new(Server::http("127.0.0.1:0").expect("bind fake hub"));
        let port = server.server_addr().to_ip().expect("ip listener").port();
        let endpoint = format!("http://127.0.0.1:{port}");
        let state = Arc::new(Mutex::new(State {
            endpoint: endpoint.clone(),
            repos: BTreeMap::new(),
            requests: Vec::new(),
            failures: Vec::new(),
            rules: Vec::new(),
            required_token: None,
            lfs_redirects: true,
            counter: 0,
        }));
        let thread = {
            let server = Arc::clone(&server);
            let state = Arc::clone(&state);
            std::thread::Builder::new()
                .name("fake-hub".into())
                .spawn(move || {
                    for request in server.incoming_requests() {
                        let state = Arc::clone(&state);
                        std::thread::spawn(move || handle(request, &state));
                    }
                })
                .expect("spawn fake hub thread")
        };
        FakeHub {
            endpoint,
            state,
            server,
            thread: Some(thread),
        }
    }

    /// Base URL to use as `HF_ENDPOINT`, e.g. `http://127.0.0.1:41234`.
    pub fn endpoint(&self) -> String {
        self.endpoint.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Create (or replace) a public repo whose `main` holds exactly `files`; returns the commit sha.
    pub fn add_repo(&self, repo_id: &str, files: &[(&str, &[u8])]) -> String {
        self.lock().repos.remove(repo_id);
        self.add_commit(repo_id, "main", files)
    }

    /// Commit `files` (replacing the whole tree) to `branch`, creating the repo/branch if
    /// needed; returns the new commit sha.
    pub fn add_commit(&self, repo_id: &str, branch: &str, files: &[(&str, &[u8])]) -> String {
        let files = files
            .iter()
            .map(|(p, b)| (p.to_string(), Arc::new(b.to_vec())))
            .collect();
        let mut st = self.lock();
        let st = &mut *st;
        let repo = st.repos.entry(repo_id.to_string()).or_insert_with(|| Repo {
            private: false,
            branches: BTreeMap::new(),
            commits: HashMap::new(),
        });
        let parent = repo.branches.get(branch).cloned();
        st.counter += 1;
        let sha = commit_sha(repo_id, parent.as_deref(), st.counter, &files);
        repo.commits.insert(sha.clone(), Commit { files });
        repo.branches.insert(branch.to_string(), sha.clone());
        sha
    }

    /// Commit every file under `dir` (recursively) to `branch`; returns the commit sha.
    pub fn add_folder(&self, repo_id: &str, branch: &str, dir: &Path) -> String {
        fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
            for entry in std::fs::read_dir(dir).expect("read_dir") {
                let path = entry.expect("dir entry").path();
                if path.is_dir() {
                    walk(root, &path, out);
                } else {
                    let rel = path.strip_prefix(root).unwrap();
                    let rel = rel
                        .components()
                        .map(|c| c.as_os_str().to_string_lossy().into_owned())
                        .collect::<Vec<_>>()
                        .join("/");
                    out.push((rel, std::fs::read(&path).expect("read file")));
                }
            }
        }
        let mut owned = Vec::new();
        walk(dir, dir, &mut owned);
        let borrowed: Vec<(&str, &[u8])> = owned
            .iter()
            .map(|(p, b)| (p.as_str(), b.as_slice()))
            .collect();
        self.add_commit(repo_id, branch, &borrowed)
    }

    /// Mark a repo private: requests without an `Authorization` header get the Hub's
    /// "401 + X-Error-Code: RepoNotFound" answer.
    pub fn set_private(&self, repo_id: &str, private: bool) {
        if let Some(repo) = self.lock().repos.get_mut(repo_id) {
            repo.private = private;
        }
    }

    /// Delete a repo (later requests for it get 404 `RepoNotFound`).
    pub fn remove_repo(&self, repo_id: &str) {
        self.lock().repos.remove(repo_id);
    }

    /// Whether the repo exists.
    pub fn has_repo(&self, repo_id: &str) -> bool {
        self.lock().repos.contains_key(repo_id)
    }

    /// Commit sha a branch (or sha) resolves to.
    pub fn head(&self, repo_id: &str, rev: &str) -> Option<String> {
        self.lock().repos.get(repo_id)?.resolve(rev)
    }

    /// The files (path -> bytes) at a revision.
    pub fn files_at(&self, repo_id: &str, rev: &str) -> Option<BTreeMap<String, Vec<u8>>> {
        let st = self.lock();
        let repo = st.repos.get(repo_id)?;
        let sha = repo.resolve(rev)?;
        Some(
            repo.commits[&sha]
                .files
                .iter()
                .map(|(p, b)| (p.clone(), b.as_ref().clone()))
                .collect(),
        )
    }

    /// Answer every request with `status` (e.g. 500).
    pub fn fail_all(&self, status: u16) {
        self.fail_matching(None, "", status);
    }

    /// Answer requests whose method matches (any if `None`) and whose raw path contains
    /// `path_contains` with `status`.
    pub fn fail_matching(&self, method: Option<&str>, path_contains: &str, status: u16) {
        self.lock().failures.push(Failure {
            method: method.map(str::to_string),
            path_contains: path_contains.to_string(),
            status,
        });
    }

    /// Remove all injected failures and attacks.
    pub fn clear_failures(&self) {
        let mut st = self.lock();
        st.failures.clear();
        st.rules.clear();
    }

    /// Misbehave with `attack` on requests whose method matches (any if `None`) and whose
    /// raw path contains `path_contains`, for the first `times` of them (all if `None`).
    /// The first matching rule with uses left applies.
    pub fn attack(
        &self,
        method: Option<&str>,
        path_contains: &str,
        attack: Attack,
        times: Option<usize>,
    ) {
        self.lock().rules.push(Rule {
            method: method.map(str::to_string),
            path_contains: path_contains.to_string(),
            attack,
            remaining: times,
        });
    }

    /// Require `Authorization: Bearer <token>` on every request (401 otherwise); `None` lifts it.
    pub fn require_token(&self, token: Option<&str>) {
        self.lock().required_token = token.map(str::to_string);
    }

    /// Whether LFS-like files are served through a 302 to `/__cdn/<sha256>` with
    /// `X-Linked-Etag`/`X-Linked-Size` (the real Hub's behaviour; default on) or directly.
    pub fn set_lfs_redirects(&self, on: bool) {
        self.lock().lfs_redirects = on;
    }

    /// Every request seen so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.lock().requests.clone()
    }

    /// Forget recorded requests.
    pub fn clear_requests(&self) {
        self.lock().requests.clear();
    }

    /// Stop serving and free the port (later connections are refused).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.shutdown();
    }
}

// ---------------------------------------------------------------------------------------
// Content addressing helpers (public so tests can predict cache blob names).

/// Lowercase hex sha256 of `bytes` (the Hub's LFS oid and the `X-Linked-Etag` of LFS files).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// The etag of regular files, as the real Hub sends it: the git blob sha1,
/// `sha1("blob <len>\0" + bytes)`.
pub fn git_etag(bytes: &[u8]) -> String {
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    hex(&h.finalize())
}

/// Whether the fake stores a file as LFS (weights-like extension or >= 10 MiB), like the
/// default `.gitattributes` the Hub creates.
pub fn is_lfs(path: &str, size: usize) -> bool {
    const EXT: &[&str] = &[
        "safetensors",
        "bin",
        "pt",
        "pth",
        "ckpt",
        "gguf",
        "onnx",
        "h5",
        "msgpack",
        "npy",
        "npz",
        "model",
        "zst",
        "gz",
        "zip",
        "tar",
    ];
    let ext = path.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
    EXT.contains(&ext) || size >= 10 * 1024 * 1024
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn commit_sha(
    repo_id: &str,
    parent: Option<&str>,
    counter: u64,
    files: &BTreeMap<String, Arc<Vec<u8>>>,
) -> String {
    let mut h = Sha256::new();
    h.update(repo_id.as_bytes());
    h.update(parent.unwrap_or("").as_bytes());
    h.update(counter.to_le_bytes());
    for (p, b) in files {
        h.update(p.as_bytes());
        h.update(Sha256::digest(b.as_slice()));
    }
    hex(&h.finalize())[..40].to_string()
}

// ---------------------------------------------------------------------------------------
// HTTP handling.

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn new(status: u16) -> Self {
        Reply {
            status,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }
    fn json(status: u16, value: Value) -> Self {
        let mut r = Reply::new(status);
        r.body = serde_json::to_vec(&value).unwrap();
        r.header("Content-Type", "application/json")
    }
    fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.to_string(), v.to_string()));
        self
    }
    /// A Hub-style error: JSON `{"error": msg}` plus `X-Error-Code` / `X-Error-Message`.
    fn error(status: u16, code: Option<&str>, msg: &str) -> Self {
        let mut r = Reply::json(status, json!({ "error": msg })).header("X-Error-Message", msg);
        if let Some(code) = code {
            r = r.header("X-Error-Code", code);
        }
        r
    }
}

fn handle(mut request: tiny_http::Request, state: &Arc<Mutex<State>>) {
    let method = request.method().as_str().to_ascii_uppercase();
    let url = request.url().to_string();
    let (path, query) = match url.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (url.clone(), String::new()),
    };
    let header = |name: &str| {
        request
            .headers()
            .iter()
            .find(|h| h.field.as_str().as_str().eq_ignore_ascii_case(name))
            .map(|h| h.value.as_str().to_string())
    };
    let authorization = header("Authorization");
    let range = header("Range");
    let mut body = Vec::new();
    let _ = request.as_reader().read_to_end(&mut body);

    let (reply, shape) = {
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        st.requests.push(RecordedRequest {
            method: method.clone(),
            path: path.clone(),
            query: query.clone(),
            authorization: authorization.clone(),
            range: range.clone(),
        });
        let failure = st
            .failures
            .iter()
            .find(|f| {
                f.method
                    .as_deref()
                    .is_none_or(|m| m.eq_ignore_ascii_case(&method))
                    && path.contains(&f.path_contains)
            })
            .cloned();
        let reply = if let Some(f) = failure {
            Reply::error(f.status, None, "injected failure")
        } else if st.required_token.is_some()
            && authorization
                .as_deref()
                .and_then(|a| a.strip_prefix("Bearer "))
                != st.required_token.as_deref()
        {
            Reply::error(401, None, "Invalid credentials in Authorization header")
        } else {
            let req = Req {
                method: &method,
                query: &query,
                authorized: authorization.is_some(),
                range: range.as_deref(),
                body: &body,
            };
            route(&mut st, &path, &req)
        };
        let attack = st
            .rules
            .iter_mut()
            .find(|r| {
                r.remaining != Some(0)
                    && r.method
                        .as_deref()
                        .is_none_or(|m| m.eq_ignore_ascii_case(&method))
                    && path.contains(&r.path_contains)
            })
            .map(|r| {
                if let Some(n) = &mut r.remaining {
                    *n -= 1;
                }
                r.attack.clone()
            });
        match attack {
            Some(a) => apply(a, reply, &path),
            None => (reply, Shape::default()),
        }
    };

    let announced = shape.announce.unwrap_or(reply.body.len());
    let reader = Hostile {
        data: reply.body,
        pos: 0,
        shape,
    };
    let mut response = Response::new(
        StatusCode(reply.status),
        Vec::new(),
        reader,
        Some(announced),
        None,
    )
    // Always send Content-Length (HEAD relies on it), never chunked.
    .with_chunked_threshold(usize::MAX);
    for (k, v) in reply.headers {
        if let Ok(h) = Header::from_bytes(k.as_bytes(), v.as_bytes()) {
            response.add_header(h);
        }
    }
    let _ = request.respond(response);
}

/// How the body of an answer is sent.
#[derive(Default)]
struct Shape {
    /// Content-Length to announce instead of the body's.
    announce: Option<usize>,
    /// Fail (never finish the answer) after this many bytes.
    cut_after: Option<usize>,
    stall: Option<(usize, Duration)>,
    throttle: Option<(usize, Duration)>,
}

/// The body reader: pauses, throttles or breaks off as the shape says.
struct Hostile {
    data: Vec<u8>,
    pos: usize,
    shape: Shape,
}

impl Read for Hostile {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some((after, pause)) = self.shape.stall {
            if self.pos >= after {
                std::thread::sleep(pause);
                self.shape.stall = None;
            }
        }
        if self.shape.cut_after.is_some_and(|c| self.pos >= c) {
            return Err(std::io::Error::other("fake hub: answer cut off"));
        }
        let mut end = self.data.len();
        if let Some((after, _)) = self.shape.stall {
            end = end.min(after.max(self.pos));
        }
        if let Some(c) = self.shape.cut_after {
            end = end.min(c);
        }
        if let Some((chunk, delay)) = self.shape.throttle {
            std::thread::sleep(delay);
            end = end.min(self.pos + chunk.max(1));
        }
        let n = (end - self.pos).min(buf.len());
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

fn set_header(reply: &mut Reply, name: &str, value: &str) {
    reply.headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    reply.headers.push((name.to_string(), value.to_string()));
}

fn has_header(reply: &Reply, name: &str) -> bool {
    reply
        .headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case(name))
}

fn apply(attack: Attack, mut reply: Reply, path: &str) -> (Reply, Shape) {
    let mut shape = Shape::default();
    match attack {
        Attack::Header(k, v) => set_header(&mut reply, &k, &v),
        Attack::Commit(v) => set_header(&mut reply, "X-Repo-Commit", &v),
        Attack::Etag(v) => {
            if has_header(&reply, "X-Linked-Etag") {
                set_header(&mut reply, "X-Linked-Etag", &v);
            }
            set_header(&mut reply, "ETag", &v);
        }
        Attack::TreeFile(name) => {
            if let Ok(Value::Array(mut entries)) = serde_json::from_slice::<Value>(&reply.body) {
                entries.push(json!({
                    "type": "file", "oid": git_etag(b"x"), "size": 1, "path": name,
                }));
                reply.body = serde_json::to_vec(&Value::Array(entries)).unwrap();
            }
        }
        Attack::Body(status, body) => {
            reply.status = status;
            reply.body = body;
        }
        Attack::FlipByte(i) => {
            if let Some(b) = reply.body.get_mut(i) {
                *b ^= 0xff;
            }
        }
        Attack::ShortBody(n) => reply.body.truncate(n),
        Attack::CutAfter(n) => shape.cut_after = Some(n),
        Attack::Stall { after, pause } => shape.stall = Some((after, pause)),
        Attack::Throttle { chunk, delay } => shape.throttle = Some((chunk, delay)),
        Attack::Status(status, retry_after) => {
            reply = Reply::error(status, None, "injected by an attack");
            if let Some(ra) = retry_after {
                reply = reply.header("Retry-After", &ra);
            }
        }
        Attack::RedirectTo(other) => {
            let oid = match reply
                .headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case("Location"))
            {
                Some((_, loc)) if loc.contains("/__cdn/") => {
                    loc.rsplit('/').next().unwrap_or("").to_string()
                }
                _ if path.starts_with("/__cdn/") => path["/__cdn/".len()..].to_string(),
                _ => sha256_hex(&reply.body),
            };
            let headers = reply.headers.clone();
            reply = Reply::new(302);
            for (k, v) in headers {
                if k.eq_ignore_ascii_case("X-Repo-Commit")
                    || k.to_ascii_lowercase().starts_with("x-linked")
                    || k.eq_ignore_ascii_case("ETag")
                {
                    reply.headers.push((k, v));
                }
            }
            set_header(
                &mut reply,
                "Location",
                &format!("{}/__cdn/{oid}", other.trim_end_matches('/')),
            );
        }
    }
    (reply, shape)
}

struct Req<'a> {
    method: &'a str,
    query: &'a str,
    authorized: bool,
    range: Option<&'a str>,
    body: &'a [u8],
}

fn route(st: &mut State, path: &str, req: &Req) -> Reply {
    let segs: Vec<String> = path
        .split('/')
        .filter(|s| !s.is_empty())
        .map(percent_decode)
        .collect();
    let s: Vec<&str> = segs.iter().map(String::as_str).collect();
    match (req.method, s.as_slice()) {
        ("POST", ["api", "repos", "create"]) => create_repo(st, req),
        ("GET", ["api", "models", o, n]) => model_info(st, &format!("{o}/{n}"), "main", req),
        ("GET", ["api", "models", o, n, "revision", rev]) => {
            model_info(st, &format!("{o}/{n}"), rev, req)
        }
        ("GET", ["api", "models", o, n, "tree", rev, rest @ ..]) => {
            tree(st, &format!("{o}/{n}"), rev, &rest.join("/"), req)
        }
        ("POST", ["api", "models", o, n, "paths-info", rev]) => {
            paths_info(st, &format!("{o}/{n}"), rev, req)
        }
        ("POST", ["api", "models", o, n, "preupload", rev]) => {
            preupload(st, &format!("{o}/{n}"), rev, req)
        }
        ("POST", ["api", "models", o, n, "commit", rev]) => {
            commit(st, &format!("{o}/{n}"), rev, req)
        }
        ("POST", ["api", "models", o, n, "branch", branch]) => {
            create_branch(st, &format!("{o}/{n}"), branch, req)
        }
        // Dataset repos live in the same map under `datasets/owner/name`
        // (add them with `add_repo("datasets/owner/name", …)`).
        ("GET", ["api", "datasets", o, n]) => {
            model_info(st, &format!("datasets/{o}/{n}"), "main", req)
        }
        ("GET", ["api", "datasets", o, n, "revision", rev]) => {
            model_info(st, &format!("datasets/{o}/{n}"), rev, req)
        }
        ("GET", ["api", "datasets", o, n, "tree", rev, rest @ ..]) => {
            tree(st, &format!("datasets/{o}/{n}"), rev, &rest.join("/"), req)
        }
        ("GET" | "HEAD", ["datasets", o, n, "resolve", rev, file @ ..]) if !file.is_empty() => {
            resolve(st, &format!("datasets/{o}/{n}"), rev, &file.join("/"), req)
        }
        ("GET" | "HEAD", ["__cdn", oid]) => cdn(st, oid, req),
        ("GET" | "HEAD", [o, n, "resolve", rev, file @ ..]) if !file.is_empty() => {
            resolve(st, &format!("{o}/{n}"), rev, &file.join("/"), req)
        }
        _ => Reply::error(
            404,
            None,
            &format!("fake hub: no route for {} {path}", req.method),
        ),
    }
}

/// Look up a repo + revision, producing the Hub's error replies when missing or hidden.
fn lookup<'s>(
    st: &'s State,
    repo_id: &str,
    rev: &str,
    req: &Req,
) -> Result<(&'s Repo, String), Reply> {
    let repo = match st.repos.get(repo_id) {
        Some(r) if !r.private || req.authorized => r,
        Some(_) => {
            // The Hub hides private repos from anonymous callers behind a 401.
            return Err(Reply::error(
                401,
                Some("RepoNotFound"),
                "Repository not found",
            ));
        }
        None => {
            return Err(Reply::error(
                404,
                Some("RepoNotFound"),
                "Repository not found",
            ))
        }
    };
    match repo.resolve(rev) {
        Some(sha) => Ok((repo, sha)),
        None => Err(Reply::error(
            404,
            Some("RevisionNotFound"),
            &format!("Invalid rev id: {rev}"),
        )),
    }
}

fn resolve(st: &State, repo_id: &str, rev: &str, file: &str, req: &Req) -> Reply {
    let (repo, sha) = match lookup(st, repo_id, rev, req) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let Some(bytes) = repo.commits[&sha].files.get(file) else {
        return Reply::error(404, Some("EntryNotFound"), "Entry not found")
            .header("X-Repo-Commit", &sha);
    };
    if is_lfs(file, bytes.len()) && st.lfs_redirects {
        let oid = sha256_hex(bytes);
        return Reply::new(302)
            .header("Location", &format!("{}/__cdn/{oid}", st.endpoint))
            .header("X-Repo-Commit", &sha)
            .header("ETag", &format!("\"{}\"", git_etag(bytes)))
            .header("X-Linked-Etag", &format!("\"{oid}\""))
            .header("X-Linked-Size", &bytes.len().to_string());
    }
    let etag = if is_lfs(file, bytes.len()) {
        sha256_hex(bytes)
    } else {
        git_etag(bytes)
    };
    serve_bytes(bytes, req)
        .header("ETag", &format!("\"{etag}\""))
        .header("X-Repo-Commit", &sha)
}

fn cdn(st: &State, oid: &str, _req: &Req) -> Reply {
    let found = st
        .repos
        .values()
        .flat_map(|r| r.commits.values())
        .flat_map(|c| c.files.values())
        .find(|b| sha256_hex(b) == oid);
    match found {
        Some(bytes) => serve_bytes(bytes, _req).header("ETag", &format!("\"{oid}\"")),
        None => Reply::error(404, None, "blob not found"),
    }
}

/// 200 with the whole body, or 206 for a single `Range: bytes=a-b` / `bytes=a-`.
fn serve_bytes(bytes: &[u8], req: &Req) -> Reply {
    let total = bytes.len();
    if let Some(spec) = req.range.and_then(|r| r.strip_prefix("bytes=")) {
        let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
        let start: usize = a.trim().parse().unwrap_or(0);
        let end: usize = b
            .trim()
            .parse()
            .map(|e: usize| e.min(total.saturating_sub(1)))
            .unwrap_or(total.saturating_sub(1));
        if start >= total || start > end {
            return Reply::new(416).header("Content-Range", &format!("bytes */{total}"));
        }
        let mut r = Reply::new(206)
            .header("Content-Range", &format!("bytes {start}-{end}/{total}"))
            .header("Accept-Ranges", "bytes");
        r.body = bytes[start..=end].to_vec();
        return r;
    }
    let mut r = Reply::new(200).header("Accept-Ranges", "bytes");
    r.body = bytes.to_vec();
    r
}

fn model_info(st: &State, repo_id: &str, rev: &str, req: &Req) -> Reply {
    let (repo, sha) = match lookup(st, repo_id, rev, req) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let siblings: Vec<Value> = repo.commits[&sha]
        .files
        .keys()
        .map(|p| json!({ "rfilename": p }))
        .collect();
    let author = repo_id.split('/').next().unwrap_or("");
    Reply::json(
        200,
        json!({
            "_id": format!("fake{}", &sha[..20]),
            "id": repo_id,
            "modelId": repo_id,
            "author": author,
            "sha": sha,
            "private": repo.private,
            "disabled": false,
            "gated": false,
            "lastModified": "2024-01-01T00:00:00.000Z",
            "tags": [],
            "siblings": siblings,
        }),
    )
}

fn file_entry(path: &str, bytes: &[u8]) -> Value {
    let mut v = json!({
        "type": "file",
        "oid": git_etag(bytes),
        "size": bytes.len(),
        "path": path,
    });
    if is_lfs(path, bytes.len()) {
        v["lfs"] = json!({ "oid": sha256_hex(bytes), "size": bytes.len(), "pointerSize": 134 });
    }
    v
}

fn dir_entry(path: &str) -> Value {
    json!({ "type": "directory", "oid": git_etag(path.as_bytes()), "size": 0, "path": path })
}

fn query_flag(query: &str, key: &str) -> bool {
    query.split('&').any(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        k == key && matches!(v.to_ascii_lowercase().as_str(), "1" | "true")
    })
}

fn tree(st: &State, repo_id: &str, rev: &str, base: &str, req: &Req) -> Reply {
    let (repo, sha) = match lookup(st, repo_id, rev, req) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let files = &repo.commits[&sha].files;
    let recursive = query_flag(req.query, "recursive");
    let prefix = if base.is_empty() {
        String::new()
    } else {
        format!("{}/", base.trim_end_matches('/'))
    };
    if !prefix.is_empty() && !files.keys().any(|p| p.starts_with(&prefix)) {
        return Reply::error(
            404,
            Some("EntryNotFound"),
            &format!("{base} does not exist"),
        );
    }
    let mut dirs = BTreeSet::new();
    let mut entries = Vec::new();
    for (path, bytes) in files.iter().filter(|(p, _)| p.starts_with(&prefix)) {
        let rest = &path[prefix.len()..];
        let parts: Vec<&str> = rest.split('/').collect();
        // Every ancestor directory below `base` (recursive) or only the first (flat).
        let depth = if recursive {
            parts.len() - 1
        } else {
            parts.len().min(2) - 1
        };
        for i in 1..=depth {
            dirs.insert(format!("{prefix}{}", parts[..i].join("/")));
        }
        if recursive || parts.len() == 1 {
            entries.push(file_entry(path, bytes));
        }
    }
    let mut out: Vec<Value> = dirs.iter().map(|d| dir_entry(d)).collect();
    out.extend(entries);
    Reply::json(200, Value::Array(out))
}

fn paths_info(st: &State, repo_id: &str, rev: &str, req: &Req) -> Reply {
    let (repo, sha) = match lookup(st, repo_id, rev, req) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let Ok(body) = serde_json::from_slice::<Value>(req.body) else {
        return Reply::error(400, None, "invalid JSON body");
    };
    let files = &repo.commits[&sha].files;
    let mut out = Vec::new();
    for p in body["paths"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if let Some(bytes) = files.get(p) {
            out.push(file_entry(p, bytes));
        } else if files.keys().any(|f| f.starts_with(&format!("{p}/"))) {
            out.push(dir_entry(p));
        }
    }
    Reply::json(200, Value::Array(out))
}

fn create_repo(st: &mut State, req: &Req) -> Reply {
    let Ok(body) = serde_json::from_slice::<Value>(req.body) else {
        return Reply::error(400, None, "invalid JSON body");
    };
    let kind = body["type"].as_str().unwrap_or("model");
    if kind != "model" {
        return Reply::error(
            400,
            None,
            &format!("fake hub only serves model repos, not {kind}"),
        );
    }
    let (Some(org), Some(name)) = (body["organization"].as_str(), body["name"].as_str()) else {
        return Reply::error(400, None, "fake hub needs both organization and name");
    };
    let repo_id = format!("{org}/{name}");
    let url = format!("{}/{repo_id}", st.endpoint);
    if st.repos.contains_key(&repo_id) {
        return Reply::json(
            409,
            json!({ "error": "You already created this model repo", "url": url }),
        );
    }
    // Like the Hub, a new repo starts with one commit holding a `.gitattributes`.
    let attrs = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n";
    let files: BTreeMap<String, Arc<Vec<u8>>> =
        [(".gitattributes".to_string(), Arc::new(attrs.to_vec()))].into();
    st.counter += 1;
    let sha = commit_sha(&repo_id, None, st.counter, &files);
    st.repos.insert(
        repo_id.clone(),
        Repo {
            private: body["private"].as_bool().unwrap_or(false),
            branches: [("main".to_string(), sha.clone())].into(),
            commits: [(sha, Commit { files })].into(),
        },
    );
    Reply::json(200, json!({ "url": url, "name": repo_id }))
}

fn create_branch(st: &mut State, repo_id: &str, branch: &str, req: &Req) -> Reply {
    let body: Value = serde_json::from_slice(req.body).unwrap_or(Value::Null);
    let start = body["startingPoint"].as_str().unwrap_or("main").to_string();
    let sha = match lookup(st, repo_id, &start, req) {
        Ok((repo, _)) if repo.branches.contains_key(branch) => {
            return Reply::error(409, None, &format!("Reference already exists: {branch}"))
        }
        Ok((_, sha)) => sha,
        Err(r) => return r,
    };
    if let Some(repo) = st.repos.get_mut(repo_id) {
        repo.branches.insert(branch.to_string(), sha);
    }
    Reply::json(200, json!({}))
}

fn preupload(st: &State, repo_id: &str, rev: &str, req: &Req) -> Reply {
    let (_, sha) = match lookup(st, repo_id, rev, req) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let Ok(body) = serde_json::from_slice::<Value>(req.body) else {
        return Reply::error(400, None, "invalid JSON body");
    };
    let files: Vec<Value> = body["files"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| json!({ "path": f["path"], "uploadMode": "regular", "shouldIgnore": false }))
        .collect();
    Reply::json(200, json!({ "files": files, "commitOid": sha }))
}

fn commit(st: &mut State, repo_id: &str, rev: &str, req: &Req) -> Reply {
    if query_flag(req.query, "create_pr") {
        return Reply::error(400, None, "fake hub does not support pull requests");
    }
    let parent = match lookup(st, repo_id, rev, req) {
        Ok((repo, _)) if !repo.branches.contains_key(rev) => {
            return Reply::error(400, None, &format!("{rev} is not a branch"))
        }
        Ok((_, sha)) => sha,
        Err(r) => return r,
    };
    let mut files = st.repos[repo_id].commits[&parent].files.clone();
    let mut summary = String::new();
    for (i, line) in req.body.split(|b| *b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let Ok(entry) = serde_json::from_slice::<Value>(line) else {
            return Reply::error(400, None, &format!("commit line {i} is not JSON"));
        };
        let value = &entry["value"];
        match entry["key"].as_str().unwrap_or("") {
            "header" => {
                summary = value["summary"].as_str().unwrap_or("").to_string();
                if let Some(p) = value["parentCommit"].as_str() {
                    if p != parent {
                        return Reply::error(412, None, "parent commit is not the branch head");
                    }
                }
            }
            "file" => {
                let Some(path) = value["path"].as_str() else {
                    return Reply::error(400, None, "file entry without path");
                };
                let content = value["content"].as_str().unwrap_or("");
                let bytes = match value["encoding"].as_str() {
                    Some("base64") => match base64_decode(content) {
                        Some(b) => b,
                        None => return Reply::error(400, None, &format!("bad base64 for {path}")),
                    },
                    _ => content.as_bytes().to_vec(),
                };
                files.insert(path.to_string(), Arc::new(bytes));
            }
            "deletedFile" => {
                files.remove(value["path"].as_str().unwrap_or(""));
            }
            "deletedFolder" => {
                let p = format!(
                    "{}/",
                    value["path"].as_str().unwrap_or("").trim_end_matches('/')
                );
                files.retain(|k, _| !k.starts_with(&p));
            }
            other => {
                return Reply::error(
                    400,
                    None,
                    &format!("fake hub does not support {other} entries"),
                )
            }
        }
    }
    if summary.is_empty() {
        return Reply::error(400, None, "commit header with a summary is required");
    }
    st.counter += 1;
    let sha = commit_sha(repo_id, Some(&parent), st.counter, &files);
    let repo = st.repos.get_mut(repo_id).expect("repo checked above");
    repo.commits.insert(sha.clone(), Commit { files });
    repo.branches.insert(rev.to_string(), sha.clone());
    Reply::json(
        200,
        json!({
            "success": true,
            "commitOid": sha,
            "commitUrl": format!("{}/{repo_id}/commit/{sha}", st.endpoint),
            "commitMessage": summary,
            "hookOutput": "",
            "pullRequestUrl": null,
        }),
    )
}

// ---------------------------------------------------------------------------------------
// Small codecs (std only).

fn percent_decode(s: &str) -> String {
    fn hexval(c: u8) -> Option<u8> {
        (c as char).to_digit(16).map(|d| d as u8)
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hexval(b[i + 1]), hexval(b[i + 2])) {
                out.push(h * 16 + l);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    fn val(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let s: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for chunk in s.chunks(4) {
        let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 {
            return None;
        }
        let mut n = 0u32;
        for &c in &chunk[..4 - pad] {
            n = (n << 6) | val(c)?;
        }
        n <<= 6 * pad as u32;
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    Some(out)
}
