//! Hugging Face Hub access for TokenFormer checkpoints: download files into the standard HF
//! cache, list a repo, resolve a revision to its commit, and publish a model folder.
//!
//! Built on `hf-hub` 1.0 (blocking API). It follows the conventions of Python's
//! `huggingface_hub`, so the cache is shared with it:
//! `$HF_HUB_CACHE` (default `$HF_HOME/hub`) `/models--{owner}--{name}/{blobs/<etag>,
//! snapshots/<commit>/<file> -> ../../blobs/<etag>, refs/<revision>}`, and the same
//! environment variables (`HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN`,
//! `HF_TOKEN_PATH`, `$HF_HOME/token`, `HF_HUB_OFFLINE`, `HF_HUB_DISABLE_IMPLICIT_TOKEN`).
//!
//! Things `hf-hub` 1.0 does not do and this module adds: `HF_HUB_OFFLINE` (mapped to its
//! local-files-only mode), configurable retries, telling "repo missing" from "file missing"
//! (its HEAD path reports every 404 as a missing file), a sha256 check of freshly
//! downloaded LFS blobs (its GET path does not check the HTTP status before writing the
//! blob), and token redaction in every error and `Debug` string.
//!
//! Repos are named `owner/name` or `owner/name@revision` (default revision `main`).

use std::collections::HashSet;
use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use hf_hub::progress::{DownloadEvent, Progress, ProgressEvent, ProgressHandler, UploadEvent};
use hf_hub::repository::{CommitOperation, RepoTreeEntry};
use hf_hub::{HFClientBuilder, HFClientSync, HFError, HFRepositorySync, RepoTypeModel};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};

/// The public Hub, used when `HF_ENDPOINT` is unset.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Revision used when a repo id has no `@revision`.
pub const DEFAULT_REVISION: &str = "main";
/// `hf-hub`'s own default number of retries for transient failures.
pub const DEFAULT_MAX_RETRIES: usize = 5;

/// Errors from Hub access. Messages name the repo, revision and file involved and never
/// contain the token.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    #[error("invalid repo id {input:?}: {reason} (expected owner/name or owner/name@revision)")]
    InvalidRepoId { input: String, reason: String },

    #[error("invalid file name {file:?} for {repo}: {reason}")]
    InvalidFileName {
        repo: String,
        file: String,
        reason: String,
    },

    #[error(
        "repository {repo} not found on {endpoint} (check the name; a private or gated repo \
         needs a token: HF_TOKEN or $HF_HOME/token)"
    )]
    RepoNotFound { repo: String, endpoint: String },

    #[error("revision {revision:?} not found in repository {repo}")]
    RevisionNotFound { repo: String, revision: String },

    #[error("file {file:?} not found in {repo}@{revision}")]
    FileNotFound {
        repo: String,
        revision: String,
        file: String,
    },

    #[error(
        "offline mode (HF_HUB_OFFLINE): {file:?} of {repo}@{revision} is not in the cache {} \
         (download it once while online)",
        cache_dir.display()
    )]
    NotCached {
        repo: String,
        revision: String,
        file: String,
        cache_dir: PathBuf,
    },

    #[error("offline mode (HF_HUB_OFFLINE) does not allow {op}")]
    Offline { op: String },

    #[error("cannot reach the Hub at {endpoint} while {op}: {detail}")]
    Network {
        op: String,
        endpoint: String,
        detail: String,
    },

    #[error("not authorized (HTTP {status}) while {op}: {detail}")]
    Auth {
        op: String,
        status: u16,
        detail: String,
    },

    #[error("Hub server error (HTTP {status}) while {op}: {detail}")]
    Server {
        op: String,
        status: u16,
        detail: String,
    },

    #[error("unexpected HTTP {status} from the Hub while {op}: {detail}")]
    Http {
        op: String,
        status: u16,
        detail: String,
    },

    #[error(
        "downloaded {file:?} of {repo}@{revision} is corrupt (sha256 {actual}, expected \
         {expected}); it was removed from the cache"
    )]
    Integrity {
        repo: String,
        revision: String,
        file: String,
        expected: String,
        actual: String,
    },

    #[error("cannot publish folder {}: {reason}", folder.display())]
    InvalidFolder { folder: PathBuf, reason: String },

    #[error("I/O error while {op}: {source}")]
    Io {
        op: String,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid Hub configuration: {detail}")]
    Config { detail: String },

    #[error("Hub request failed while {op}: {detail}")]
    Other { op: String, detail: String },
}

// ---------------------------------------------------------------------------------------
// Repo references.

/// A model repo on the Hub at a revision (branch, tag or commit sha).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RepoRef {
    pub owner: String,
    pub name: String,
    pub revision: String,
}

impl RepoRef {
    /// Parse `owner/name` or `owner/name@revision`.
    pub fn parse(input: &str) -> Result<Self, HubError> {
        let s = input.trim();
        let bad = |reason: &str| HubError::InvalidRepoId {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let (id, revision) = match s.split_once('@') {
            Some((id, rev)) => (id, rev),
            None => (s, DEFAULT_REVISION),
        };
        let Some((owner, name)) = id.split_once('/') else {
            return Err(bad("missing owner (no '/')"));
        };
        if name.contains('/') {
            return Err(bad("more than one '/'"));
        }
        check_id_part(owner, "owner").map_err(|r| bad(&r))?;
        check_id_part(name, "name").map_err(|r| bad(&r))?;
        check_revision(revision).map_err(|r| bad(&r))?;
        Ok(RepoRef {
            owner: owner.to_string(),
            name: name.to_string(),
            revision: revision.to_string(),
        })
    }

    /// `owner/name` (without revision).
    pub fn repo_id(&self) -> String {
        format!("{}/{}", self.owner, self.name)
    }

    /// The same repo at another revision.
    pub fn at(&self, revision: &str) -> Result<Self, HubError> {
        Self::parse(&format!("{}@{revision}", self.repo_id()))
    }

    /// `models--owner--name`, the repo's folder in the HF cache.
    pub fn cache_folder_name(&self) -> String {
        format!("models--{}--{}", self.owner, self.name)
    }
}

impl fmt::Display for RepoRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.owner, self.name, self.revision)
    }
}

impl FromStr for RepoRef {
    type Err = HubError;
    fn from_str(s: &str) -> Result<Self, HubError> {
        Self::parse(s)
    }
}

/// The Hub's naming rule for owners and repo names (also keeps `--` out, which the cache
/// folder name uses as a separator).
fn check_id_part(part: &str, what: &str) -> Result<(), String> {
    if part.is_empty() {
        return Err(format!("empty {what}"));
    }
    if part.len() > 96 {
        return Err(format!("{what} longer than 96 characters"));
    }
    if let Some(c) = part
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "{what} contains {c:?} (allowed: letters, digits, '-', '_', '.')"
        ));
    }
    if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
        return Err(format!("{what} starts or ends with '-' or '.'"));
    }
    if part.contains("--") || part.contains("..") {
        return Err(format!("{what} contains '--' or '..'"));
    }
    Ok(())
}

/// Git ref-name rules that matter here (revisions also name folders under `refs/`).
fn check_revision(rev: &str) -> Result<(), String> {
    if rev.is_empty() {
        return Err("empty revision after '@'".into());
    }
    if let Some(c) = rev
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || "~^:?*[\\@".contains(*c))
    {
        return Err(format!("revision contains {c:?}"));
    }
    if rev.contains("..") || rev.contains("//") || rev.starts_with('/') || rev.ends_with('/') {
        return Err("revision has '..', '//' or a leading/trailing '/'".into());
    }
    Ok(())
}

/// A repo-relative file path must stay inside the snapshot folder.
fn check_repo_path(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err("empty path".into());
    }
    if path.starts_with('/') || path.contains('\\') {
        return Err("must be a relative path with '/' separators".into());
    }
    if path
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err("contains an empty, '.' or '..' component".into());
    }
    Ok(())
}

fn is_commit_sha(rev: &str) -> bool {
    rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

// ---------------------------------------------------------------------------------------
// Configuration.

/// Where and how to reach the Hub. Build it with [`HubConfig::from_env`] (or
/// [`HubConfig::from_vars`], which tests use instead of mutating the process environment)
/// and adjust with the `with_*` overrides.
#[derive(Clone)]
pub struct HubConfig {
    /// Hub base URL, no trailing slash (`HF_ENDPOINT`).
    pub endpoint: String,
    /// `HF_HOME` (holds the `token` file).
    pub hf_home: PathBuf,
    /// The hub cache (`HF_HUB_CACHE`, default `$HF_HOME/hub`).
    pub cache_dir: PathBuf,
    /// Use only the cache, never the network (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// Retries for transient failures (5xx, 429, connection errors); 0 = fail fast.
    pub max_retries: usize,
    /// Base delay of the exponential backoff between retries.
    pub retry_base_delay: Duration,
    token: Option<String>,
}

impl HubConfig {
    /// Read the standard `huggingface_hub` environment variables.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Same as [`from_env`](Self::from_env) with variables looked up through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let get = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let home = get("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let expand = |p: String| match p.strip_prefix("~/") {
            Some(rest) => home.join(rest),
            None => PathBuf::from(p),
        };
        let hf_home = get("HF_HOME").map(expand).unwrap_or_else(|| {
            get("XDG_CACHE_HOME")
                .map(|x| expand(x).join("huggingface"))
                .unwrap_or_else(|| home.join(".cache").join("huggingface"))
        });
        let cache_dir = get("HF_HUB_CACHE")
            .or_else(|| get("HUGGINGFACE_HUB_CACHE"))
            .map(expand)
            .unwrap_or_else(|| hf_home.join("hub"));
        let offline = get("HF_HUB_OFFLINE")
            .or_else(|| get("TRANSFORMERS_OFFLINE"))
            .is_some_and(|v| is_truthy(&v));
        let token = if get("HF_HUB_DISABLE_IMPLICIT_TOKEN").is_some_and(|v| is_truthy(&v)) {
            None
        } else {
            get("HF_TOKEN")
                .or_else(|| get("HUGGING_FACE_HUB_TOKEN"))
                .map(|t| t.trim().to_string())
                .or_else(|| {
                    let file = get("HF_TOKEN_PATH")
                        .map(expand)
                        .unwrap_or_else(|| hf_home.join("token"));
                    std::fs::read_to_string(file)
                        .ok()
                        .map(|t| t.trim().to_string())
                        .filter(|t| !t.is_empty())
                })
        };
        HubConfig {
            endpoint: get("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
                .trim_end_matches('/')
                .to_string(),
            hf_home,
            cache_dir,
            offline,
            // Not a huggingface_hub variable: lets scripts and tests fail fast.
            max_retries: get("TOKENFORMER_HUB_RETRIES")
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_MAX_RETRIES),
            retry_base_delay: Duration::from_millis(100),
            token,
        }
    }

    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = endpoint.into().trim_end_matches('/').to_string();
        self
    }

    pub fn with_cache_dir(mut self, cache_dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = cache_dir.into();
        self
    }

    /// Send this token (`Authorization: Bearer ...`).
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into()).filter(|t| !t.is_empty());
        self
    }

    /// Send no token of ours. `hf-hub` itself may still pick up an ambient `HF_TOKEN` /
    /// token file of the process (it has no "anonymous" switch).
    pub fn without_token(mut self) -> Self {
        self.token = None;
        self
    }

    pub fn with_offline(mut self, offline: bool) -> Self {
        self.offline = offline;
        self
    }

    pub fn with_retries(mut self, max_retries: usize) -> Self {
        self.max_retries = max_retries;
        self
    }

    pub fn with_retry_base_delay(mut self, delay: Duration) -> Self {
        self.retry_base_delay = delay;
        self
    }

    /// Whether a token will be sent.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Replace every occurrence of the token in `text` (defence in depth for messages that
    /// echo server responses or URLs).
    fn scrub(&self, text: String) -> String {
        match &self.token {
            Some(t) if t.len() >= 4 && text.contains(t.as_str()) => {
                text.replace(t.as_str(), "<redacted>")
            }
            _ => text,
        }
    }
}

impl fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubConfig")
            .field("endpoint", &self.endpoint)
            .field("hf_home", &self.hf_home)
            .field("cache_dir", &self.cache_dir)
            .field("offline", &self.offline)
            .field("max_retries", &self.max_retries)
            .field("retry_base_delay", &self.retry_base_delay)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// `huggingface_hub`'s notion of a true environment flag.
fn is_truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

// ---------------------------------------------------------------------------------------
// Results.

/// One file of a repo tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoFile {
    /// Repo-relative path (`/`-separated).
    pub path: String,
    pub size: u64,
    /// Stored with Git LFS (weights-like files). Always `false` in listings made from the
    /// cache. (The LFS sha256 is not offered: `hf-hub` 1.0 expects a `sha256` key where the
    /// Hub sends `oid`, so it never gets it.)
    pub lfs: bool,
}

/// One file that a publish uploads (also the dry-run listing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFile {
    /// Path in the repo (`/`-separated, relative to the folder).
    pub path_in_repo: String,
    pub local_path: PathBuf,
    pub size: u64,
    /// Lowercase hex sha256 of the content.
    pub sha256: String,
}

/// Options for [`publish_folder`].
#[derive(Debug, Clone, Default)]
pub struct PublishOptions {
    /// Create the repo private (ignored if it already exists).
    pub private: bool,
    /// Commit summary; default "Upload model folder with tokenformer".
    pub message: Option<String>,
    /// Commit description.
    pub description: Option<String>,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

/// What a publish did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishReport {
    pub repo_url: String,
    pub commit_url: String,
    pub commit_sha: Option<String>,
    /// The branch committed to.
    pub revision: String,
    /// The files of the commit, as listed by [`dry_run_listing`].
    pub files: Vec<LocalFile>,
}

// ---------------------------------------------------------------------------------------
// Client.

/// A configured Hub client. Cheap to keep around; holds `hf-hub`'s runtime thread.
pub struct HubClient {
    config: HubConfig,
    client: HFClientSync,
}

impl fmt::Debug for HubClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubClient")
            .field("config", &self.config)
            .finish()
    }
}

impl HubClient {
    /// Client for `HubConfig::from_env()`.
    pub fn from_env() -> Result<Self, HubError> {
        Self::new(HubConfig::from_env())
    }

    pub fn new(config: HubConfig) -> Result<Self, HubError> {
        let mut builder = HFClientBuilder::new()
            .endpoint(config.endpoint.clone())
            .cache_dir(config.cache_dir.clone())
            .retry_max_attempts(config.max_retries)
            .retry_base_delay(config.retry_base_delay);
        if let Some(token) = &config.token {
            builder = builder.token(token.clone());
        }
        let client = builder.build_sync().map_err(|e| HubError::Config {
            detail: config.scrub(format!("endpoint {:?}: {e}", config.endpoint)),
        })?;
        Ok(HubClient { config, client })
    }

    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    fn handle(&self, repo: &RepoRef) -> HFRepositorySync<RepoTypeModel> {
        self.client.model(repo.owner.clone(), repo.name.clone())
    }

    /// `<cache>/models--owner--name`.
    pub fn repo_cache_dir(&self, repo: &RepoRef) -> PathBuf {
        self.config.cache_dir.join(repo.cache_folder_name())
    }

    /// Download `files` of `repo` into the cache (or find them there when offline) and
    /// return their paths inside `snapshots/<commit>/`, in the order given.
    pub fn download_files(
        &self,
        repo: &RepoRef,
        files: &[&str],
        progress: bool,
    ) -> Result<Vec<PathBuf>, HubError> {
        files
            .iter()
            .map(|f| self.download_file(repo, f, progress))
            .collect()
    }

    /// Download one file; see [`download_files`](Self::download_files).
    pub fn download_file(
        &self,
        repo: &RepoRef,
        file: &str,
        progress: bool,
    ) -> Result<PathBuf, HubError> {
        check_repo_path(file).map_err(|reason| HubError::InvalidFileName {
            repo: repo.to_string(),
            file: file.to_string(),
            reason,
        })?;
        let blobs = self.repo_cache_dir(repo).join("blobs");
        let blobs_before: HashSet<OsString> = std::fs::read_dir(&blobs)
            .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        let bar = progress.then(|| new_bar(file));
        let result = self
            .handle(repo)
            .download_file()
            .filename(file.to_string())
            .revision(repo.revision.clone())
            .local_files_only(self.config.offline)
            .maybe_progress(bar.clone().map(|b| Progress::new(BarHandler(b))))
            .send();
        match result {
            Ok(path) => {
                if let Some(b) = &bar {
                    b.finish();
                }
                self.verify_new_blob(repo, file, &path, &blobs, &blobs_before)?;
                Ok(path)
            }
            Err(e) => {
                if let Some(b) = &bar {
                    b.abandon();
                }
                Err(match e {
                    HFError::EntryNotFound { .. } if !self.config.offline => {
                        self.why_not_found(repo, Some(file))
                    }
                    e => self.map_err(
                        e,
                        repo,
                        Some(file),
                        &format!("downloading {file:?} from {repo}"),
                    ),
                })
            }
        }
    }

    /// `hf-hub` writes the GET body to the blob without checking the status, so a blob
    /// named by a sha256 (LFS etag) that appeared during this call is hashed; a mismatch
    /// removes it (and its snapshot link) so the cache is never poisoned.
    fn verify_new_blob(
        &self,
        repo: &RepoRef,
        file: &str,
        path: &Path,
        blobs: &Path,
        before: &HashSet<OsString>,
    ) -> Result<(), HubError> {
        let Ok(target) = std::fs::read_link(path) else {
            return Ok(()); // not a symlink (e.g. copies on Windows): nothing to check
        };
        let Some(etag) = target.file_name() else {
            return Ok(());
        };
        let etag_str = etag.to_string_lossy().to_string();
        if before.contains(etag) || !is_sha256_hex(&etag_str) {
            return Ok(());
        }
        let actual = sha256_file(path).map_err(|source| HubError::Io {
            op: format!("verifying {file:?} of {repo}"),
            source,
        })?;
        if actual.eq_ignore_ascii_case(&etag_str) {
            return Ok(());
        }
        let _ = std::fs::remove_file(blobs.join(etag));
        let _ = std::fs::remove_file(path);
        Err(HubError::Integrity {
            repo: repo.repo_id(),
            revision: repo.revision.clone(),
            file: file.to_string(),
            expected: etag_str,
            actual,
        })
    }

    /// The repo's files at its revision (recursive). Offline, the files cached for that
    /// revision.
    pub fn list_files(&self, repo: &RepoRef) -> Result<Vec<RepoFile>, HubError> {
        if self.config.offline {
            return self.list_cached(repo);
        }
        let entries = self
            .handle(repo)
            .list_tree()
            .revision(repo.revision.clone())
            .recursive(true)
            .send()
            .map_err(|e| match &e {
                HFError::Http { context }
                    if context.status.as_u16() == 404 && context.error_code.is_none() =>
                {
                    self.why_not_found(repo, None)
                }
                _ => self.map_err(e, repo, None, &format!("listing files of {repo}")),
            })?;
        let mut files: Vec<RepoFile> = entries
            .into_iter()
            .filter_map(|e| match e {
                RepoTreeEntry::File {
                    path, size, lfs, ..
                } => Some(RepoFile {
                    path,
                    size,
                    lfs: lfs.is_some(),
                }),
                RepoTreeEntry::Directory { .. } => None,
            })
            .collect();
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(files)
    }

    fn list_cached(&self, repo: &RepoRef) -> Result<Vec<RepoFile>, HubError> {
        let commit = self.resolve_commit(repo)?;
        let root = self.repo_cache_dir(repo).join("snapshots").join(&commit);
        if !root.is_dir() {
            return Err(HubError::NotCached {
                repo: repo.repo_id(),
                revision: repo.revision.clone(),
                file: "(any file)".into(),
                cache_dir: self.config.cache_dir.clone(),
            });
        }
        let mut out = Vec::new();
        let mut stack = vec![root.clone()];
        while let Some(dir) = stack.pop() {
            let rd = std::fs::read_dir(&dir).map_err(|source| HubError::Io {
                op: format!("listing cached files of {repo}"),
                source,
            })?;
            for entry in rd.flatten() {
                let path = entry.path();
                let Ok(meta) = std::fs::metadata(&path) else {
                    continue; // dangling link: blob removed
                };
                if meta.is_dir() {
                    stack.push(path);
                } else if let Ok(rel) = path.strip_prefix(&root) {
                    out.push(RepoFile {
                        path: rel_to_slash(rel),
                        size: meta.len(),
                        lfs: false,
                    });
                }
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// The commit sha the repo's revision points to (offline: from `refs/<revision>`).
    pub fn resolve_commit(&self, repo: &RepoRef) -> Result<String, HubError> {
        if is_commit_sha(&repo.revision) {
            return Ok(repo.revision.to_ascii_lowercase());
        }
        if self.config.offline {
            let r = self.repo_cache_dir(repo).join("refs").join(&repo.revision);
            return std::fs::read_to_string(&r)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| is_commit_sha(s))
                .ok_or_else(|| HubError::NotCached {
                    repo: repo.repo_id(),
                    revision: repo.revision.clone(),
                    file: format!("refs/{}", repo.revision),
                    cache_dir: self.config.cache_dir.clone(),
                });
        }
        let op = format!("resolving the commit of {repo}");
        let info = self
            .handle(repo)
            .info()
            .revision(repo.revision.clone())
            .send()
            .map_err(|e| self.map_err(e, repo, None, &op))?;
        info.sha.ok_or_else(|| HubError::Other {
            op,
            detail: "the Hub returned no commit sha".into(),
        })
    }

    /// Create `repo` if needed (exist-ok), then upload every file of `folder` as one commit
    /// to `repo.revision` (a branch, created from `main` if missing). The folder is only read.
    pub fn publish_folder(
        &self,
        folder: &Path,
        repo: &RepoRef,
        opts: &PublishOptions,
    ) -> Result<PublishReport, HubError> {
        if self.config.offline {
            return Err(HubError::Offline {
                op: format!("publishing {} to {repo}", folder.display()),
            });
        }
        if is_commit_sha(&repo.revision) {
            return Err(HubError::InvalidRepoId {
                input: repo.to_string(),
                reason: "publishing needs a branch, not a commit sha".into(),
            });
        }
        let files = dry_run_listing(folder)?;
        if files.is_empty() {
            return Err(HubError::InvalidFolder {
                folder: folder.to_path_buf(),
                reason: "it contains no files".into(),
            });
        }
        let repo_id = repo.repo_id();
        let repo_url = self
            .client
            .create_repository()
            .repo_id(&repo_id)
            .repo_type(RepoTypeModel)
            .private(opts.private)
            .exist_ok(true)
            .send()
            .map_err(|e| self.map_err(e, repo, None, &format!("creating repository {repo_id}")))?
            .url;
        let handle = self.handle(repo);
        if repo.revision != DEFAULT_REVISION {
            self.ensure_branch(&handle, repo)?;
        }
        let operations = files
            .iter()
            .map(|f| CommitOperation::add_file(f.path_in_repo.clone(), f.local_path.clone()))
            .collect();
        let bar = opts.progress.then(|| new_bar(&format!("upload {repo}")));
        let op = format!(
            "committing {} file(s) from {} to {repo}",
            files.len(),
            folder.display()
        );
        let result = handle
            .create_commit()
            .operations(operations)
            .commit_message(
                opts.message
                    .clone()
                    .unwrap_or_else(|| "Upload model folder with tokenformer".into()),
            )
            .maybe_commit_description(opts.description.clone())
            .revision(repo.revision.clone())
            .maybe_progress(bar.clone().map(|b| Progress::new(BarHandler(b))))
            .send();
        if let Some(b) = &bar {
            if result.is_ok() {
                b.finish();
            } else {
                b.abandon();
            }
        }
        let info = result.map_err(|e| self.map_err(e, repo, None, &op))?;
        let commit_url = info
            .commit_url
            .clone()
            .or_else(|| {
                info.commit_oid
                    .as_ref()
                    .map(|oid| format!("{}/{repo_id}/commit/{oid}", self.config.endpoint))
            })
            .ok_or_else(|| HubError::Other {
                op,
                detail: "the Hub answered without a commit URL or sha".into(),
            })?;
        Ok(PublishReport {
            repo_url,
            commit_url,
            commit_sha: info.commit_oid,
            revision: repo.revision.clone(),
            files,
        })
    }

    fn ensure_branch(
        &self,
        handle: &HFRepositorySync<RepoTypeModel>,
        repo: &RepoRef,
    ) -> Result<(), HubError> {
        let op = format!("creating branch {:?} of {}", repo.revision, repo.repo_id());
        let exists = handle
            .revision_exists()
            .revision(&repo.revision)
            .send()
            .map_err(|e| self.map_err(e, repo, None, &op))?;
        if exists {
            return Ok(());
        }
        match handle.create_branch().branch(&repo.revision).send() {
            Ok(()) | Err(HFError::Conflict { .. }) => Ok(()),
            Err(e) => Err(self.map_err(e, repo, None, &op)),
        }
    }

    /// After a 404 whose cause is unknown (hf-hub reports any 404 of a file HEAD as a
    /// missing file), ask the API whether the repo, then the revision, exist.
    fn why_not_found(&self, repo: &RepoRef, file: Option<&str>) -> HubError {
        let op = format!("checking whether {repo} exists");
        let handle = self.handle(repo);
        match handle.exists().send() {
            Ok(false) => return self.repo_not_found(repo),
            Err(e) => return self.map_err(e, repo, file, &op),
            Ok(true) => {}
        }
        match handle.revision_exists().revision(&repo.revision).send() {
            Ok(false) => HubError::RevisionNotFound {
                repo: repo.repo_id(),
                revision: repo.revision.clone(),
            },
            Err(e) => self.map_err(e, repo, file, &op),
            Ok(true) => match file {
                Some(f) => self.file_not_found(repo, f),
                None => HubError::Other {
                    op,
                    detail: "the Hub answered 404 for an existing repo and revision".into(),
                },
            },
        }
    }

    fn repo_not_found(&self, repo: &RepoRef) -> HubError {
        HubError::RepoNotFound {
            repo: repo.repo_id(),
            endpoint: self.config.endpoint.clone(),
        }
    }

    fn file_not_found(&self, repo: &RepoRef, file: &str) -> HubError {
        HubError::FileNotFound {
            repo: repo.repo_id(),
            revision: repo.revision.clone(),
            file: file.to_string(),
        }
    }

    /// Translate an `hf-hub` error, preferring the Hub's `X-Error-Code` when present.
    fn map_err(&self, e: HFError, repo: &RepoRef, file: Option<&str>, op: &str) -> HubError {
        let op = self.config.scrub(op.to_string());
        let by_code = |code: Option<&str>| -> Option<HubError> {
            match code? {
                "RepoNotFound" => Some(self.repo_not_found(repo)),
                "RevisionNotFound" => Some(HubError::RevisionNotFound {
                    repo: repo.repo_id(),
                    revision: repo.revision.clone(),
                }),
                "EntryNotFound" => file.map(|f| self.file_not_found(repo, f)),
                _ => None,
            }
        };
        let auth_hint = if self.config.has_token() {
            "the token was rejected or lacks access"
        } else {
            "no token given (set HF_TOKEN or write $HF_HOME/token)"
        };
        match e {
            HFError::RepoNotFound { context, .. } => {
                by_code(context.as_ref().and_then(|c| c.error_code.as_deref()))
                    .unwrap_or_else(|| self.repo_not_found(repo))
            }
            HFError::RevisionNotFound { context, .. } => by_code(
                context.as_ref().and_then(|c| c.error_code.as_deref()),
            )
            .unwrap_or(HubError::RevisionNotFound {
                repo: repo.repo_id(),
                revision: repo.revision.clone(),
            }),
            HFError::EntryNotFound { context, path, .. } => {
                by_code(context.as_ref().and_then(|c| c.error_code.as_deref()))
                    .unwrap_or_else(|| self.file_not_found(repo, file.unwrap_or(&path)))
            }
            HFError::LocalEntryNotFound { .. } => HubError::NotCached {
                repo: repo.repo_id(),
                revision: repo.revision.clone(),
                file: file.unwrap_or("(repository snapshot)").to_string(),
                cache_dir: self.config.cache_dir.clone(),
            },
            HFError::AuthRequired { context } | HFError::Forbidden { context } => {
                by_code(context.error_code.as_deref()).unwrap_or_else(|| {
                    let gated = context.error_code.as_deref() == Some("GatedRepo");
                    let server = context.server_message.clone().unwrap_or_default();
                    HubError::Auth {
                        op,
                        status: context.status.as_u16(),
                        detail: self.config.scrub(if gated {
                            format!("gated repo: accept its terms on the Hub first; {server}")
                        } else {
                            format!("{auth_hint}; {server}")
                        }),
                    }
                })
            }
            HFError::Http { context }
            | HFError::Conflict { context }
            | HFError::RateLimited { context, .. } => by_code(context.error_code.as_deref())
                .unwrap_or_else(|| {
                    let status = context.status.as_u16();
                    let detail = self.config.scrub(format!(
                        "{} ({})",
                        context
                            .server_message
                            .clone()
                            .unwrap_or_else(|| "no message".into()),
                        context.url
                    ));
                    if status == 401 || status == 403 {
                        HubError::Auth {
                            op,
                            status,
                            detail: format!("{auth_hint}; {detail}"),
                        }
                    } else if status >= 500 {
                        HubError::Server { op, status, detail }
                    } else {
                        HubError::Http { op, status, detail }
                    }
                }),
            HFError::Request { source, .. } => {
                let mut detail = source.to_string();
                let mut cur: Option<&dyn std::error::Error> = std::error::Error::source(&source);
                while let Some(s) = cur {
                    detail.push_str(": ");
                    detail.push_str(&s.to_string());
                    cur = s.source();
                }
                HubError::Network {
                    op,
                    endpoint: self.config.endpoint.clone(),
                    detail: self.config.scrub(format!(
                        "{detail} (set HF_HUB_OFFLINE=1 to use cached files only)"
                    )),
                }
            }
            HFError::Io(source) => HubError::Io { op, source },
            other => HubError::Other {
                op,
                detail: self.config.scrub(other.to_string()),
            },
        }
    }
}

// ---------------------------------------------------------------------------------------
// Free functions over `HubConfig::from_env()`.

/// [`HubClient::download_files`] with the environment's configuration.
pub fn download_files(
    repo: &RepoRef,
    files: &[&str],
    progress: bool,
) -> Result<Vec<PathBuf>, HubError> {
    HubClient::from_env()?.download_files(repo, files, progress)
}

/// [`HubClient::list_files`] with the environment's configuration.
pub fn list_files(repo: &RepoRef) -> Result<Vec<RepoFile>, HubError> {
    HubClient::from_env()?.list_files(repo)
}

/// [`HubClient::resolve_commit`] with the environment's configuration.
pub fn resolve_commit(repo: &RepoRef) -> Result<String, HubError> {
    HubClient::from_env()?.resolve_commit(repo)
}

/// [`HubClient::publish_folder`] with the environment's configuration.
pub fn publish_folder(
    folder: &Path,
    repo: &RepoRef,
    opts: &PublishOptions,
) -> Result<PublishReport, HubError> {
    HubClient::from_env()?.publish_folder(folder, repo, opts)
}

/// The files a publish of `folder` would upload, sorted by repo path, with sizes and
/// sha256, without touching the network. Skips `.git/` and `.cache/huggingface/` (as
/// `huggingface_hub` does) and follows symlinks (a folder of links into the HF cache
/// publishes the linked content).
pub fn dry_run_listing(folder: &Path) -> Result<Vec<LocalFile>, HubError> {
    let bad = |reason: String| HubError::InvalidFolder {
        folder: folder.to_path_buf(),
        reason,
    };
    let meta = std::fs::metadata(folder).map_err(|e| bad(format!("cannot read it: {e}")))?;
    if !meta.is_dir() {
        return Err(bad("not a directory".into()));
    }
    let mut out = Vec::new();
    let mut seen_dirs = HashSet::new();
    if let Ok(c) = folder.canonicalize() {
        seen_dirs.insert(c);
    }
    let mut stack = vec![(folder.to_path_buf(), String::new())];
    while let Some((dir, prefix)) = stack.pop() {
        let rd = std::fs::read_dir(&dir)
            .map_err(|e| bad(format!("cannot list {}: {e}", dir.display())))?;
        for entry in rd {
            let entry = entry.map_err(|e| bad(format!("cannot list {}: {e}", dir.display())))?;
            let name = entry
                .file_name()
                .into_string()
                .map_err(|n| bad(format!("file name {n:?} is not UTF-8")))?;
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            if is_ignored_for_upload(&rel) {
                continue;
            }
            let path = entry.path();
            let meta = std::fs::metadata(&path)
                .map_err(|e| bad(format!("{rel}: {e} (broken symlink?)")))?;
            if meta.is_dir() {
                // Follow linked directories once; a link cycle would otherwise never end.
                if path
                    .canonicalize()
                    .map(|c| seen_dirs.insert(c))
                    .unwrap_or(false)
                {
                    stack.push((path, rel));
                }
            } else if meta.is_file() {
                if name.contains('\\') {
                    return Err(bad(format!("file name {rel:?} contains a backslash")));
                }
                let sha256 =
                    sha256_file(&path).map_err(|e| bad(format!("cannot read {rel}: {e}")))?;
                out.push(LocalFile {
                    path_in_repo: rel,
                    local_path: path,
                    size: meta.len(),
                    sha256,
                });
            }
        }
    }
    out.sort_by(|a, b| a.path_in_repo.cmp(&b.path_in_repo));
    Ok(out)
}

fn is_ignored_for_upload(rel: &str) -> bool {
    let parts: Vec<&str> = rel.split('/').collect();
    parts.contains(&".git") || parts.windows(2).any(|w| w == [".cache", "huggingface"])
}

fn rel_to_slash(rel: &Path) -> String {
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// Lowercase hex sha256 of a file, streamed.
fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

// ---------------------------------------------------------------------------------------
// Progress bar.

fn new_bar(label: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{msg:24!} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(label.to_string());
    bar
}

/// Feeds `hf-hub` progress events into an indicatif bar.
struct BarHandler(ProgressBar);

impl ProgressHandler for BarHandler {
    fn on_progress(&self, event: &ProgressEvent) {
        let bar = &self.0;
        match event {
            ProgressEvent::Download(DownloadEvent::Start { total_bytes, .. })
            | ProgressEvent::Upload(UploadEvent::Start { total_bytes, .. }) => {
                bar.set_length(*total_bytes)
            }
            ProgressEvent::Download(DownloadEvent::Progress { files }) => {
                bar.set_position(files.iter().map(|f| f.bytes_completed).sum());
            }
            ProgressEvent::Download(DownloadEvent::AggregateProgress {
                bytes_completed,
                total_bytes,
                ..
            })
            | ProgressEvent::Upload(UploadEvent::Progress {
                bytes_completed,
                total_bytes,
                ..
            }) => {
                bar.set_length(*total_bytes);
                bar.set_position(*bytes_completed);
            }
            ProgressEvent::Upload(UploadEvent::Committing) => bar.set_message("committing"),
            ProgressEvent::Download(DownloadEvent::Complete)
            | ProgressEvent::Upload(UploadEvent::Complete) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repo_ids() {
        let r = RepoRef::parse("acme/tiny-model").unwrap();
        assert_eq!(
            (r.owner.as_str(), r.name.as_str(), r.revision.as_str()),
            ("acme", "tiny-model", "main")
        );
        let r = RepoRef::parse("acme/tiny@refs/pr/1").unwrap();
        assert_eq!(r.revision, "refs/pr/1");
        assert_eq!(r.to_string(), "acme/tiny@refs/pr/1");
        for bad in [
            "tiny", "a/b/c", "a/", "/b", "a/b@", "a/b@x y", "a--x/b", "a/b@..", "a/b c", "a/-b",
        ] {
            let e = RepoRef::parse(bad).unwrap_err();
            assert!(matches!(e, HubError::InvalidRepoId { .. }), "{bad}: {e}");
            assert!(e.to_string().contains(bad.trim()), "{e}");
        }
    }

    #[test]
    fn config_from_vars_follows_huggingface_hub() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "hf_file_token\n").unwrap();
        let home = dir.path().to_string_lossy().to_string();
        let c = HubConfig::from_vars(|k| match k {
            "HF_HOME" => Some(home.clone()),
            "HF_HUB_OFFLINE" => Some("yes".into()),
            "HF_ENDPOINT" => Some("http://x:1/".into()),
            _ => None,
        });
        assert_eq!(c.cache_dir, dir.path().join("hub"));
        assert!(c.offline);
        assert_eq!(c.endpoint, "http://x:1");
        assert_eq!(c.token.as_deref(), Some("hf_file_token"));
        assert!(!format!("{c:?}").contains("hf_file_token"));
        let c = HubConfig::from_vars(|k| match k {
            "HF_HOME" => Some(home.clone()),
            "HF_TOKEN" => Some("hf_env".into()),
            "HF_HUB_OFFLINE" => Some("0".into()),
            _ => None,
        });
        assert_eq!(c.token.as_deref(), Some("hf_env"));
        assert!(!c.offline);
        let c = HubConfig::from_vars(|k| match k {
            "HF_HOME" => Some(home.clone()),
            "HF_HUB_DISABLE_IMPLICIT_TOKEN" => Some("1".into()),
            _ => None,
        });
        assert!(!c.has_token());
    }

    #[test]
    fn rejects_escaping_file_names() {
        for bad in ["../x", "/etc/passwd", "a//b", "a/./b", "a\\b", ""] {
            assert!(check_repo_path(bad).is_err(), "{bad}");
        }
        assert!(check_repo_path("sub/dir/model.safetensors").is_ok());
    }
}
