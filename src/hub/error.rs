//! The error type of Hub access. Every message names the repo (and revision and file when
//! there is one) and never contains the token.

use std::path::PathBuf;

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

    /// The server answered something that cannot be right (a commit that is not a sha, an
    /// ETag that is no hash, a file name leaving the repo, a size that disagrees, ...).
    /// Nothing of such an answer is used or cached.
    #[error("refused the Hub's answer while {op}: {detail}")]
    BadResponse { op: String, detail: String },

    #[error(
        "{file:?} of {repo} is corrupt ({algorithm} {actual}, expected {expected}); it was \
         not kept in the cache"
    )]
    Integrity {
        /// `owner/name@revision`.
        repo: String,
        file: String,
        /// `sha256` (LFS files) or `git blob sha1` (regular files).
        algorithm: &'static str,
        expected: String,
        actual: String,
    },

    /// Another process holds the download lock of the same file and made no progress.
    #[error("gave up waiting for another download of {file:?} of {repo}: {detail}")]
    LockTimeout {
        repo: String,
        file: String,
        detail: String,
    },

    #[error("cannot publish folder {}: {reason}", folder.display())]
    InvalidFolder { folder: PathBuf, reason: String },

    /// The I/O error is in the message, not also a `source()` (see [`crate::Error::Io`]).
    #[error("I/O error while {op}: {error}")]
    Io { op: String, error: std::io::Error },

    #[error("invalid Hub configuration: {detail}")]
    Config { detail: String },

    #[error("Hub request failed while {op}: {detail}")]
    Other { op: String, detail: String },
}

impl HubError {
    /// A failure that says nothing about the file itself (network, timeout, 5xx, 429): the
    /// cache may answer instead, as `huggingface_hub` does.
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            HubError::Network { .. } | HubError::Server { .. } => true,
            HubError::Http { status, .. } => *status == 429 || *status == 408,
            _ => false,
        }
    }

    pub(crate) fn io(op: impl Into<String>, error: std::io::Error) -> Self {
        HubError::Io {
            op: op.into(),
            error,
        }
    }
}
