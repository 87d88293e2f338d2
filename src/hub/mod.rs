//! Hugging Face Hub access for TokenFormer checkpoints: download files into the standard HF
//! cache, list a repo, resolve a revision to its commit, and publish a model folder.
//!
//! The cache is shared with Python's `huggingface_hub`:
//! `$HF_HUB_CACHE` (default `$HF_HOME/hub`) `/models--{owner}--{name}/{blobs/<etag>,
//! snapshots/<commit>/<file> -> ../../blobs/<etag>, refs/<revision>}`, with the same
//! environment variables (`HF_ENDPOINT`, `HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN`,
//! `HF_TOKEN_PATH`, `$HF_HOME/token`, `HF_HUB_OFFLINE`, `HF_HUB_DISABLE_IMPLICIT_TOKEN`).
//!
//! Downloads run on this module's own loop (`download`): nothing a server sends becomes a
//! path before it is checked (commit = 40 hex, ETag = git blob sha1 or sha256, file names
//! relative without `..`), every file is verified against its ETag before it appears in
//! the cache, connect/read timeouts and bounded retries apply, processes downloading the
//! same file wait for each other, and the token is only sent to the endpoint's own host.
//! `hf-hub` is used for publishing only (`upload`). Repos are named `owner/name` or
//! `owner/name@revision` (default revision `main`).
//!
//! - `repo`: repo ids and the name checks; `config`: environment and knobs;
//! - `client`: the HTTP layer, error mapping, listing and commit resolution;
//! - `cache`: the on-disk layout, verification markers and download locks;
//! - `download`: the download loop; `upload`: publish and its file listing;
//! - `progress`: download and upload events, and the callbacks that receive them;
//! - `dataset`: `hf://datasets/owner/name[@revision]/path` data files, fetched the same way.

mod cache;
mod client;
mod config;
pub mod dataset;
mod download;
mod error;
mod progress;
mod repo;
mod upload;

use std::path::{Path, PathBuf};

pub use client::{HubClient, RepoFile};
pub use config::{
    env_flag, HubConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_ENDPOINT, DEFAULT_LOCK_WAIT,
    DEFAULT_MAX_RETRIES, DEFAULT_MAX_RETRY_WAIT, DEFAULT_READ_TIMEOUT, DEFAULT_RETRY_BASE_DELAY,
};
pub use download::safetensors_index_shards;
pub use error::HubError;
pub use progress::{DownloadEvent, DownloadProgress, UploadEvent, UploadProgress};
pub use repo::{RepoKind, RepoRef, DEFAULT_REVISION};
pub use upload::{
    dry_run_listing, upload_listing, LocalFile, PublishOptions, PublishReport, SkippedEntry,
    UploadListing,
};

/// [`HubClient::download_files`] with the environment's configuration.
pub fn download_files(
    repo: &RepoRef,
    files: &[&str],
    progress: Option<&DownloadProgress>,
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
