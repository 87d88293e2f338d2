//! The Hub client and its HTTP layer: one blocking `reqwest` client with connect and read
//! timeouts, retries with backoff for transient failures (honouring `Retry-After`),
//! redirects followed by hand so the token only ever goes to the endpoint's own origin,
//! and the translation of HTTP answers into [`HubError`]s. Also the small API calls:
//! listing a repo's files and resolving a revision to its commit.

use std::fmt;
use std::io::Read;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use rand::Rng;
use reqwest::blocking::{Client, Response};
use reqwest::header::{HeaderMap, ACCEPT_ENCODING, AUTHORIZATION, LOCATION, RANGE, RETRY_AFTER};
use reqwest::{Method, StatusCode, Url};
use serde_json::Value;

use super::config::HubConfig;
use super::error::HubError;
use super::repo::{check_repo_path, is_commit_sha, shown, RepoRef};

/// Retries after a timeout in which nothing arrived: a server silent that often is down,
/// and waiting `max_retries` read timeouts for it would look like a hang.
pub(crate) const MAX_TIMEOUT_RETRIES: usize = 2;
/// Most redirects followed for one request.
const MAX_REDIRECTS: usize = 10;
/// Largest JSON answer read from the API (one page of a tree listing, repo info).
const MAX_JSON_BYTES: u64 = 64 << 20;
/// Most pages of one tree listing, and most files in it.
const MAX_TREE_PAGES: usize = 10_000;
const MAX_TREE_FILES: usize = 1_000_000;

/// One file of a repo tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoFile {
    /// Repo-relative path (`/`-separated), checked to stay inside the repo.
    pub path: String,
    pub size: u64,
    /// Stored with Git LFS (weights-like files). Always `false` in listings made from the
    /// cache.
    pub lfs: bool,
}

/// A configured Hub client. Cheap to keep around (one connection pool).
pub struct HubClient {
    pub(crate) config: HubConfig,
    http: Client,
    endpoint: Url,
}

impl fmt::Debug for HubClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubClient")
            .field("config", &self.config)
            .finish()
    }
}

/// How a request follows redirects.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Redirects {
    /// Only to the endpoint's own origin (API calls).
    SameOrigin,
    /// The metadata HEAD of a file: same-origin redirects without `X-Repo-Commit` (a renamed
    /// repo) are followed; a redirect that carries the file's metadata (to the CDN) is the
    /// answer itself.
    Metadata,
    /// Content downloads: anywhere over http(s), never from https down to http; the token
    /// is sent to the endpoint's origin only.
    Content,
}

/// Whether a request retries transient failures.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Tries {
    /// Up to the configured `max_retries`, with backoff.
    Configured,
    /// One try: the cache can answer instead, so an unreachable Hub is not waited for
    /// (huggingface_hub's "fast fallback to the local cache").
    Once,
}

/// What a request is for, to name in errors (and to keep a download lock alive while
/// waiting between retries).
pub(crate) struct Ctx<'a> {
    pub repo: &'a RepoRef,
    pub file: Option<&'a str>,
    pub op: String,
    pub beat: Option<&'a dyn Fn()>,
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(repo: &'a RepoRef, file: Option<&'a str>, op: String) -> Self {
        Ctx {
            repo,
            file,
            op,
            beat: None,
        }
    }
}

impl HubClient {
    /// Client for `HubConfig::from_env()`.
    pub fn from_env() -> Result<Self, HubError> {
        Self::new(HubConfig::from_env())
    }

    pub fn new(config: HubConfig) -> Result<Self, HubError> {
        if !config.invalid.is_empty() {
            return Err(HubError::Config {
                detail: config.invalid.join("; "),
            });
        }
        let endpoint = parse_endpoint(&config.endpoint).map_err(|detail| HubError::Config {
            detail: config.scrub(format!("HF_ENDPOINT {:?}: {detail}", config.endpoint)),
        })?;
        for (what, d) in [
            ("connect timeout", config.connect_timeout),
            ("read timeout", config.read_timeout),
        ] {
            if d.is_zero() {
                return Err(HubError::Config {
                    detail: format!("the {what} must be above zero"),
                });
            }
        }
        let http = Client::builder()
            .user_agent(concat!("tokenformer/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(config.connect_timeout)
            // Blocking reqwest applies this to the wait for the response headers and to
            // every read of the body: a stalled server fails the request.
            .timeout(config.read_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| HubError::Config {
                detail: format!("cannot build the HTTP client: {}", error_chain(&e)),
            })?;
        Ok(HubClient {
            config,
            http,
            endpoint,
        })
    }

    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    /// `<cache>/models--owner--name` (`datasets--owner--name`).
    pub fn repo_cache_dir(&self, repo: &RepoRef) -> PathBuf {
        self.config.cache_dir.join(repo.cache_folder_name())
    }

    /// The endpoint with `segments` appended, each percent-encoded as one path segment.
    pub(crate) fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.endpoint.clone();
        if let Ok(mut s) = url.path_segments_mut() {
            s.pop_if_empty();
            for seg in segments {
                s.push(seg);
            }
        }
        url
    }

    /// `{endpoint}/{owner}/{name}/resolve/{revision}/{file...}` (a dataset:
    /// `{endpoint}/datasets/{owner}/…`).
    pub(crate) fn resolve_url(&self, repo: &RepoRef, revision: &str, file: &str) -> Url {
        let mut segs: Vec<&str> = repo.url_prefix().into_iter().collect();
        segs.extend([repo.owner.as_str(), repo.name.as_str(), "resolve", revision]);
        segs.extend(file.split('/'));
        self.url(&segs)
    }

    fn api_url(&self, repo: &RepoRef, tail: &[&str]) -> Url {
        let kind = match repo.kind {
            super::repo::RepoKind::Model => "models",
            super::repo::RepoKind::Dataset => "datasets",
        };
        let mut segs = vec!["api", kind, repo.owner.as_str(), repo.name.as_str()];
        segs.extend_from_slice(tail);
        self.url(&segs)
    }

    pub(crate) fn same_origin(&self, url: &Url) -> bool {
        url.scheme() == self.endpoint.scheme()
            && url.host_str() == self.endpoint.host_str()
            && url.port_or_known_default() == self.endpoint.port_or_known_default()
    }

    /// One request, redirects followed per `policy`, no retries.
    fn send_once(
        &self,
        method: &Method,
        start: &Url,
        policy: Redirects,
        range_from: Option<u64>,
    ) -> Result<Response, SendError> {
        let mut url = start.clone();
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self
                .http
                .request(method.clone(), url.clone())
                .header(ACCEPT_ENCODING, "identity");
            if let Some(from) = range_from.filter(|&f| f > 0) {
                req = req.header(RANGE, format!("bytes={from}-"));
            }
            // The token goes to the configured endpoint only, never to a host a server
            // redirects to.
            if let (Some(token), true) = (self.config.token(), self.same_origin(&url)) {
                req = req.header(AUTHORIZATION, format!("Bearer {token}"));
            }
            let resp = req.send().map_err(SendError::Http)?;
            if !resp.status().is_redirection() || resp.status() == StatusCode::NOT_MODIFIED {
                return Ok(resp);
            }
            let Some(loc) = resp.headers().get(LOCATION) else {
                return Ok(resp);
            };
            let loc = loc.to_str().unwrap_or("");
            let next = url
                .join(loc)
                .map_err(|_| SendError::Refused(format!("redirect to {}", shown(loc))))?;
            if !matches!(next.scheme(), "http" | "https") {
                return Err(SendError::Refused(format!(
                    "redirect to a non-HTTP URL {}",
                    shown(loc)
                )));
            }
            if url.scheme() == "https" && next.scheme() == "http" {
                return Err(SendError::Refused(format!(
                    "redirect from https down to http ({})",
                    shown(loc)
                )));
            }
            let follow = match policy {
                Redirects::SameOrigin => self.same_origin(&next),
                Redirects::Metadata => {
                    self.same_origin(&next) && !resp.headers().contains_key("x-repo-commit")
                }
                Redirects::Content => true,
            };
            if !follow {
                return Ok(resp);
            }
            url = next;
        }
        Err(SendError::Refused(format!(
            "more than {MAX_REDIRECTS} redirects"
        )))
    }

    /// A request with retries: connection failures, timeouts, 408, 429 and 5xx are
    /// retried up to `max_retries` times with exponential backoff, or after the server's
    /// `Retry-After` (capped). The final response is returned whatever its status.
    pub(crate) fn send(
        &self,
        method: Method,
        url: &Url,
        policy: Redirects,
        ctx: &Ctx,
    ) -> Result<Response, HubError> {
        self.send_range(method, url, policy, None, ctx)
    }

    pub(crate) fn send_range(
        &self,
        method: Method,
        url: &Url,
        policy: Redirects,
        range_from: Option<u64>,
        ctx: &Ctx,
    ) -> Result<Response, HubError> {
        self.send_tries(method, url, policy, range_from, Tries::Configured, ctx)
    }

    /// [`send_range`](Self::send_range) with `tries` deciding whether to retry.
    pub(crate) fn send_tries(
        &self,
        method: Method,
        url: &Url,
        policy: Redirects,
        range_from: Option<u64>,
        tries: Tries,
        ctx: &Ctx,
    ) -> Result<Response, HubError> {
        let max_retries = match tries {
            Tries::Configured => self.config.max_retries,
            Tries::Once => 0,
        };
        let mut attempt = 0u32;
        let mut timeouts = 0usize;
        loop {
            let result = self.send_once(&method, url, policy, range_from);
            let last = attempt as usize >= max_retries;
            match result {
                Ok(resp) if is_retryable(resp.status()) && !last => {
                    let wait = self.retry_delay(attempt, resp.headers());
                    drop(resp);
                    self.pause(wait, ctx);
                }
                Ok(resp) => return Ok(resp),
                Err(SendError::Http(e))
                    if !last && (!e.is_timeout() || timeouts < MAX_TIMEOUT_RETRIES) =>
                {
                    timeouts += e.is_timeout() as usize;
                    self.pause(self.retry_delay(attempt, &HeaderMap::new()), ctx);
                }
                Err(SendError::Http(e)) => return Err(self.network_error(&e, ctx)),
                Err(SendError::Refused(detail)) => {
                    return Err(HubError::BadResponse {
                        op: ctx.op.clone(),
                        detail: self.config.scrub(detail),
                    })
                }
            }
            attempt += 1;
        }
    }

    /// The wait before retry number `attempt + 1`.
    pub(crate) fn retry_delay(&self, attempt: u32, headers: &HeaderMap) -> Duration {
        let cap = self.config.max_retry_wait;
        if let Some(d) = headers
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after)
        {
            return d.min(cap);
        }
        let exp = self
            .config
            .retry_base_delay
            .saturating_mul(1u32 << attempt.min(16));
        // Up to a quarter more, so processes that failed together do not retry together.
        let jitter = exp.mul_f64(rand::rng().random_range(0.0..0.25));
        (exp + jitter).min(cap)
    }

    /// Sleep, keeping a held download lock visibly alive.
    pub(crate) fn pause(&self, d: Duration, ctx: &Ctx) {
        let end = Instant::now() + d;
        loop {
            if let Some(beat) = ctx.beat {
                beat();
            }
            let now = Instant::now();
            if now >= end {
                return;
            }
            std::thread::sleep((end - now).min(Duration::from_millis(500)));
        }
    }

    pub(crate) fn network_error(&self, e: &reqwest::Error, ctx: &Ctx) -> HubError {
        let mut detail = error_chain(e);
        if e.is_timeout() {
            detail = format!(
                "no answer within {:?} (TOKENFORMER_HUB_TIMEOUT): {detail}",
                self.config.read_timeout
            );
        }
        self.network_detail(detail, ctx)
    }

    pub(crate) fn network_detail(&self, detail: String, ctx: &Ctx) -> HubError {
        HubError::Network {
            op: ctx.op.clone(),
            endpoint: self.config.endpoint.clone(),
            detail: self.config.scrub(format!(
                "{detail} (set HF_HUB_OFFLINE=1 to use cached files only)"
            )),
        }
    }

    /// The error for a final non-success answer, preferring the Hub's `X-Error-Code`.
    /// A 404 without one is examined further (which of repo, revision, file is missing).
    pub(crate) fn status_error(&self, resp: Response, ctx: &Ctx) -> HubError {
        let status = resp.status().as_u16();
        let header = |k: &str| {
            resp.headers()
                .get(k)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let code = header("x-error-code");
        let message = header("x-error-message");
        let body = read_capped(resp, 4096);
        let server = message
            .or_else(|| {
                serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v["error"].as_str().map(str::to_string))
            })
            .map(|m| shown(&m))
            .unwrap_or_else(|| "no message".into());
        let repo = ctx.repo;
        match code.as_deref() {
            Some("RepoNotFound") => return self.repo_not_found(repo),
            Some("RevisionNotFound") => return revision_not_found(repo),
            Some("EntryNotFound") => {
                if let Some(f) = ctx.file {
                    return file_not_found(repo, f);
                }
            }
            _ => {}
        }
        let op = ctx.op.clone();
        if status == 404 {
            return self.why_not_found(repo, ctx.file);
        }
        if status == 401 || status == 403 {
            let hint = if code.as_deref() == Some("GatedRepo") {
                "gated repo: accept its terms on the Hub first"
            } else if self.config.has_token() {
                "the token was rejected or lacks access"
            } else {
                "no token given (set HF_TOKEN or write $HF_HOME/token)"
            };
            return HubError::Auth {
                op,
                status,
                detail: self.config.scrub(format!("{hint}; {server}")),
            };
        }
        let detail = self.config.scrub(server);
        if status >= 500 {
            HubError::Server { op, status, detail }
        } else if status == 429 {
            HubError::Http {
                op,
                status,
                detail: format!("rate limited, retries exhausted; {detail}"),
            }
        } else {
            HubError::Http { op, status, detail }
        }
    }

    pub(crate) fn repo_not_found(&self, repo: &RepoRef) -> HubError {
        HubError::RepoNotFound {
            repo: repo.repo_id(),
            endpoint: self.config.endpoint.clone(),
        }
    }

    /// After a 404 without an error code, ask the API whether the repo, then the revision,
    /// exist.
    fn why_not_found(&self, repo: &RepoRef, file: Option<&str>) -> HubError {
        let ctx = Ctx::new(repo, file, format!("checking whether {repo} exists"));
        let exists = |url: Url| -> Result<bool, HubError> {
            let resp = self.send(Method::GET, &url, Redirects::SameOrigin, &ctx)?;
            let st = resp.status();
            if st.is_success() {
                Ok(true)
            } else if st == StatusCode::NOT_FOUND || st == StatusCode::UNAUTHORIZED {
                Ok(false)
            } else {
                Err(self.status_error_plain(resp, &ctx))
            }
        };
        match exists(self.api_url(repo, &[])) {
            Ok(false) => return self.repo_not_found(repo),
            Err(e) => return e,
            Ok(true) => {}
        }
        match exists(self.api_url(repo, &["revision", &repo.revision])) {
            Ok(false) => revision_not_found(repo),
            Err(e) => e,
            Ok(true) => match file {
                Some(f) => file_not_found(repo, f),
                None => HubError::Other {
                    op: ctx.op,
                    detail: "the Hub answered 404 for an existing repo and revision".into(),
                },
            },
        }
    }

    /// Like [`status_error`](Self::status_error) without the 404 investigation (used by it).
    fn status_error_plain(&self, resp: Response, ctx: &Ctx) -> HubError {
        let status = resp.status().as_u16();
        let detail = format!("HTTP {status}");
        if status >= 500 {
            HubError::Server {
                op: ctx.op.clone(),
                status,
                detail,
            }
        } else {
            HubError::Http {
                op: ctx.op.clone(),
                status,
                detail,
            }
        }
    }

    /// GET a JSON document from the API (same-origin redirects only, size-capped).
    fn get_json(&self, url: &Url, tries: Tries, ctx: &Ctx) -> Result<(Value, HeaderMap), HubError> {
        let resp = self.send_tries(Method::GET, url, Redirects::SameOrigin, None, tries, ctx)?;
        if !resp.status().is_success() {
            return Err(self.status_error(resp, ctx));
        }
        let headers = resp.headers().clone();
        let mut body = Vec::new();
        resp.take(MAX_JSON_BYTES + 1)
            .read_to_end(&mut body)
            .map_err(|e| self.network_detail(io_error_detail(&e, &self.config), ctx))?;
        if body.len() as u64 > MAX_JSON_BYTES {
            return Err(HubError::BadResponse {
                op: ctx.op.clone(),
                detail: format!("the answer is larger than {MAX_JSON_BYTES} bytes"),
            });
        }
        let value = serde_json::from_slice(&body).map_err(|e| HubError::BadResponse {
            op: ctx.op.clone(),
            detail: format!("the answer is not valid JSON: {e}"),
        })?;
        Ok((value, headers))
    }

    /// The repo's files at its revision (recursive). Offline, the files cached for that
    /// revision. Every name is checked to stay inside the repo; one that does not is an
    /// error naming it.
    pub fn list_files(&self, repo: &RepoRef) -> Result<Vec<RepoFile>, HubError> {
        if self.config.offline {
            return self.list_cached(repo);
        }
        // A revision the cache holds is listed from there when the Hub cannot be reached.
        let cached = self.cached_commit(repo);
        let ctx = Ctx::new(repo, None, format!("listing files of {repo}"));
        let mut url = self.api_url(repo, &["tree", &repo.revision]);
        url.query_pairs_mut().append_pair("recursive", "true");
        let mut files = Vec::new();
        for n in 0..MAX_TREE_PAGES {
            let first_with_cache = n == 0 && cached.is_some();
            let tries = if first_with_cache {
                Tries::Once
            } else {
                Tries::Configured
            };
            let (page, headers) = match (self.get_json(&url, tries, &ctx), &cached) {
                (Ok(page), _) => page,
                (Err(e), Some(commit)) if first_with_cache && e.is_transient() => {
                    return self.list_snapshot(repo, commit)
                }
                (Err(e), _) => return Err(e),
            };
            let Some(entries) = page.as_array() else {
                return Err(HubError::BadResponse {
                    op: ctx.op,
                    detail: "the tree listing is not a JSON array".into(),
                });
            };
            for e in entries {
                if e["type"].as_str() != Some("file") {
                    continue;
                }
                let path = e["path"].as_str().unwrap_or("");
                check_repo_path(path).map_err(|reason| HubError::BadResponse {
                    op: ctx.op.clone(),
                    detail: format!("the listing names the file {}: {reason}", shown(path)),
                })?;
                files.push(RepoFile {
                    path: path.to_string(),
                    size: e["size"].as_u64().unwrap_or(0),
                    lfs: e["lfs"].is_object(),
                });
                if files.len() > MAX_TREE_FILES {
                    return Err(HubError::BadResponse {
                        op: ctx.op,
                        detail: format!("more than {MAX_TREE_FILES} files"),
                    });
                }
            }
            match next_link(&headers, &url) {
                None => {
                    files.sort_by(|a, b| a.path.cmp(&b.path));
                    files.dedup_by(|a, b| a.path == b.path);
                    return Ok(files);
                }
                Some(next) if self.same_origin(&next) => url = next,
                Some(next) => {
                    return Err(HubError::BadResponse {
                        op: ctx.op,
                        detail: format!(
                            "the next page of the listing is on another host ({})",
                            shown(next.as_str())
                        ),
                    })
                }
            }
        }
        Err(HubError::BadResponse {
            op: ctx.op,
            detail: format!("more than {MAX_TREE_PAGES} pages"),
        })
    }

    /// The commit sha the repo's revision points to (offline, or when the Hub cannot be
    /// reached: from `refs/<revision>`).
    pub fn resolve_commit(&self, repo: &RepoRef) -> Result<String, HubError> {
        if is_commit_sha(&repo.revision) {
            return Ok(repo.revision.to_ascii_lowercase());
        }
        if self.config.offline {
            return self.cached_ref(repo)?.ok_or_else(|| HubError::NotCached {
                repo: repo.repo_id(),
                revision: repo.revision.clone(),
                file: format!("refs/{}", repo.revision),
                cache_dir: self.config.cache_dir.clone(),
            });
        }
        let ctx = Ctx::new(repo, None, format!("resolving the commit of {repo}"));
        let cached = self.cached_ref(repo)?;
        let tries = match cached {
            Some(_) => Tries::Once,
            None => Tries::Configured,
        };
        let url = self.api_url(repo, &["revision", &repo.revision]);
        let (info, _) = match (self.get_json(&url, tries, &ctx), cached) {
            (Ok(answer), _) => answer,
            (Err(e), Some(commit)) if e.is_transient() => return Ok(commit),
            (Err(e), _) => return Err(e),
        };
        match info["sha"].as_str() {
            Some(sha) if is_commit_sha(sha) => Ok(sha.to_ascii_lowercase()),
            Some(sha) => Err(HubError::BadResponse {
                op: ctx.op,
                detail: format!("commit {} is not a 40-hex sha", shown(sha)),
            }),
            None => Err(HubError::BadResponse {
                op: ctx.op,
                detail: "the Hub returned no commit sha".into(),
            }),
        }
    }
}

pub(crate) fn revision_not_found(repo: &RepoRef) -> HubError {
    HubError::RevisionNotFound {
        repo: repo.repo_id(),
        revision: repo.revision.clone(),
    }
}

pub(crate) fn file_not_found(repo: &RepoRef, file: &str) -> HubError {
    HubError::FileNotFound {
        repo: repo.repo_id(),
        revision: repo.revision.clone(),
        file: file.to_string(),
    }
}

pub(crate) enum SendError {
    Http(reqwest::Error),
    Refused(String),
}

fn is_retryable(s: StatusCode) -> bool {
    s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS || s == StatusCode::REQUEST_TIMEOUT
}

fn parse_endpoint(s: &str) -> Result<Url, String> {
    let url = Url::parse(s).map_err(|e| e.to_string())?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("must be an http(s) URL".into());
    }
    if url.cannot_be_a_base() || url.host_str().is_none() {
        return Err("has no host".into());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("must not have a query or fragment".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not carry credentials (use HF_TOKEN)".into());
    }
    Ok(url)
}

/// `Retry-After` as seconds or an HTTP date.
fn parse_retry_after(v: &str) -> Option<Duration> {
    let v = v.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(v).ok()?;
    Some(
        when.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// The `rel="next"` target of a `Link` header (the Hub's pagination), resolved.
fn next_link(headers: &HeaderMap, base: &Url) -> Option<Url> {
    let link = headers.get("link")?.to_str().ok()?;
    link.split(',').find_map(|part| {
        let (target, params) = part.split_once(';')?;
        params
            .split(';')
            .any(|p| {
                let p = p.trim().replace(' ', "");
                p == "rel=\"next\"" || p == "rel=next"
            })
            .then(|| {
                let t = target.trim().strip_prefix('<')?.strip_suffix('>')?;
                base.join(t).ok()
            })
            .flatten()
    })
}

/// Up to `max` bytes of a body (for error messages).
fn read_capped(resp: Response, max: u64) -> Vec<u8> {
    let mut body = Vec::new();
    let _ = resp.take(max).read_to_end(&mut body);
    body
}

/// An error and its sources, `: `-joined.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// Whether a body read failed by the read timeout.
pub(crate) fn io_timed_out(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::TimedOut
        || e.get_ref()
            .and_then(|i| i.downcast_ref::<reqwest::Error>())
            .is_some_and(|r| r.is_timeout())
}

/// A body read error, saying so when it was the read timeout.
pub(crate) fn io_error_detail(e: &std::io::Error, config: &HubConfig) -> String {
    let chain = error_chain(e);
    if io_timed_out(e) {
        format!(
            "the server stalled: no data within {:?} (TOKENFORMER_HUB_TIMEOUT): {chain}",
            config.read_timeout
        )
    } else {
        chain
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_and_links() {
        assert_eq!(parse_retry_after(" 3 "), Some(Duration::from_secs(3)));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
        let base = Url::parse("https://hub.example/api/models/a/b/tree/main").unwrap();
        let mut h = HeaderMap::new();
        h.insert(
            "link",
            "<https://hub.example/api/models/a/b/tree/main?cursor=xyz>; rel=\"next\""
                .parse()
                .unwrap(),
        );
        assert_eq!(
            next_link(&h, &base).unwrap().as_str(),
            "https://hub.example/api/models/a/b/tree/main?cursor=xyz"
        );
        h.insert("link", "</p2>; rel=\"prev\"".parse().unwrap());
        assert_eq!(next_link(&h, &base), None);
    }

    #[test]
    fn endpoints_are_checked() {
        assert!(parse_endpoint("http://127.0.0.1:1").is_ok());
        assert!(parse_endpoint("https://hub.example/mirror").is_ok());
        for bad in ["ftp://x", "not a url", "https://u:p@x", "https://x/?a=1"] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
        let c = HubClient::new(
            HubConfig::from_vars(|_| None).with_endpoint("https://hub.example/mirror/"),
        )
        .unwrap();
        let r = RepoRef::parse("a/b@refs/pr/1").unwrap();
        assert_eq!(
            c.resolve_url(&r, &r.revision, "sub/x y.json").as_str(),
            "https://hub.example/mirror/a/b/resolve/refs%2Fpr%2F1/sub/x%20y.json"
        );
    }
}
