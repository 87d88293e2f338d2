//! Publishing a model folder: the listing of what is sent (regular files inside the folder
//! only; symlinks followed only while they stay inside; dotfiles and `.git` skipped at any
//! depth; FIFOs, sockets and devices never opened) and the upload itself as one commit,
//! through `hf-hub` (kept for this: repo creation, preupload and commit).

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use hf_hub::progress::Progress;
use hf_hub::repository::CommitOperation;
use hf_hub::{HFClientBuilder, HFClientSync, HFError, HFRepositorySync, RepoTypeModel};
use sha2::{Digest, Sha256};

use super::client::{error_chain, file_not_found, revision_not_found, HubClient};
use super::error::HubError;
use super::progress::{UploadEvent, UploadHandler, UploadProgress};
use super::repo::{check_repo_path, is_commit_sha, RepoRef, DEFAULT_REVISION};

/// Deepest folder nesting a listing descends into, and most entries it looks at.
const MAX_DEPTH: usize = 64;
const MAX_ENTRIES: usize = 1_000_000;

/// One file that a publish uploads (also the dry-run listing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalFile {
    /// Path in the repo (`/`-separated, relative to the folder).
    pub path_in_repo: String,
    /// Where the content is read from: inside the folder (a followed symlink's target,
    /// itself inside), or a replacement given in [`PublishOptions::replace`].
    pub local_path: PathBuf,
    pub size: u64,
    /// Lowercase hex sha256 of the content.
    pub sha256: String,
}

/// An entry of the folder that is not uploaded, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedEntry {
    /// Path relative to the folder (`/`-separated).
    pub path: String,
    pub reason: String,
}

/// Exactly what a publish of a folder sends, and what it leaves out.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UploadListing {
    /// Sorted by repo path.
    pub files: Vec<LocalFile>,
    pub skipped: Vec<SkippedEntry>,
}

/// Options for [`publish_folder`](HubClient::publish_folder).
#[derive(Debug, Clone, Default)]
pub struct PublishOptions {
    /// Create the repo private (ignored if it already exists).
    pub private: bool,
    /// Commit summary; default "Upload model folder with tokenformer".
    pub message: Option<String>,
    /// Commit description.
    pub description: Option<String>,
    /// Receives the upload's progress.
    pub progress: Option<UploadProgress>,
    /// Files uploaded from elsewhere under the given repo path, replacing the folder's
    /// file of that path if any (e.g. a refreshed model card not yet written back).
    pub replace: Vec<(String, PathBuf)>,
}

/// What a publish did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishReport {
    pub repo_url: String,
    pub commit_url: String,
    pub commit_sha: Option<String>,
    /// The branch committed to.
    pub revision: String,
    /// The files of the commit, as listed by [`upload_listing`].
    pub files: Vec<LocalFile>,
    /// What the folder held that was not sent.
    pub skipped: Vec<SkippedEntry>,
}

/// The files a publish of `folder` would upload, sorted by repo path, with sizes and
/// sha256, without touching the network. See [`upload_listing`].
pub fn dry_run_listing(folder: &Path) -> Result<Vec<LocalFile>, HubError> {
    Ok(upload_listing(folder, &[])?.files)
}

/// Exactly what a publish of `folder` sends: every regular file inside it, except entries
/// whose name starts with `.` (dotfiles, `.git`, `.cache`) at any depth. A symlink is
/// followed only if its target is inside the folder; one leading out, a broken one, and
/// anything that is not a regular file or folder (FIFO, socket, device) is listed as
/// skipped, never opened. `replace` adds or replaces files by repo path.
pub fn upload_listing(
    folder: &Path,
    replace: &[(String, PathBuf)],
) -> Result<UploadListing, HubError> {
    let bad = |reason: String| HubError::InvalidFolder {
        folder: folder.to_path_buf(),
        reason,
    };
    let meta = std::fs::metadata(folder).map_err(|e| bad(format!("cannot read it: {e}")))?;
    if !meta.is_dir() {
        return Err(bad("not a directory".into()));
    }
    let root = folder
        .canonicalize()
        .map_err(|e| bad(format!("cannot resolve it: {e}")))?;
    let mut listing = UploadListing::default();
    let skip = |listing: &mut UploadListing, path: &str, reason: String| {
        listing.skipped.push(SkippedEntry {
            path: path.to_string(),
            reason,
        })
    };
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    let mut seen = 0usize;
    // (real folder, its path relative to the root, real folders above it) — the chain
    // detects a link back to an enclosing folder.
    let mut stack = vec![(root.clone(), String::new(), vec![root.clone()])];
    while let Some((dir, prefix, chain)) = stack.pop() {
        let rd =
            std::fs::read_dir(&dir).map_err(|e| bad(format!("cannot list {prefix:?}: {e}")))?;
        let mut entries = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| bad(format!("cannot list {prefix:?}: {e}")))?;
            seen += 1;
            if seen > MAX_ENTRIES {
                return Err(bad(format!("more than {MAX_ENTRIES} entries")));
            }
            entries.push(entry);
        }
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry
                .file_name()
                .into_string()
                .map_err(|n| bad(format!("a file name in {prefix:?} is not UTF-8: {n:?}")))?;
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            if name.starts_with('.') {
                skip(&mut listing, &rel, "hidden (name starts with '.')".into());
                continue;
            }
            if name.contains('\\') || name.chars().any(char::is_control) {
                skip(
                    &mut listing,
                    &rel,
                    "name has a backslash or control character".into(),
                );
                continue;
            }
            let path = entry.path();
            let lmeta = std::fs::symlink_metadata(&path)
                .map_err(|e| bad(format!("cannot read {rel:?}: {e}")))?;
            let (real, meta) = if lmeta.file_type().is_symlink() {
                let Ok(target) = path.canonicalize() else {
                    skip(&mut listing, &rel, "broken symlink".into());
                    continue;
                };
                if !target.starts_with(&root) {
                    skip(
                        &mut listing,
                        &rel,
                        format!("symlink to {} outside the folder", target.display()),
                    );
                    continue;
                }
                // The target may itself sit under a dot-folder of the root.
                if target
                    .strip_prefix(&root)
                    .map(|r| {
                        r.components()
                            .any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
                    })
                    .unwrap_or(true)
                {
                    skip(&mut listing, &rel, "symlink to a hidden entry".into());
                    continue;
                }
                match std::fs::metadata(&target) {
                    Ok(m) => (target, m),
                    Err(e) => {
                        skip(
                            &mut listing,
                            &rel,
                            format!("cannot read the link target: {e}"),
                        );
                        continue;
                    }
                }
            } else {
                (path, lmeta)
            };
            if meta.is_dir() {
                if chain.contains(&real) {
                    skip(&mut listing, &rel, "symlink loop".into());
                } else if chain.len() >= MAX_DEPTH {
                    return Err(bad(format!("{rel:?} is nested more than {MAX_DEPTH} deep")));
                } else {
                    let mut chain = chain.clone();
                    chain.push(real.clone());
                    stack.push((real, rel, chain));
                }
            } else if meta.is_file() {
                files.push((rel, real));
            } else {
                skip(
                    &mut listing,
                    &rel,
                    "not a regular file (FIFO, socket or device)".into(),
                );
            }
        }
    }
    for (path_in_repo, local) in replace {
        check_repo_path(path_in_repo)
            .map_err(|r| bad(format!("replacement path {path_in_repo:?}: {r}")))?;
        files.retain(|(p, _)| p != path_in_repo);
        listing.skipped.retain(|s| s.path != *path_in_repo);
        files.push((path_in_repo.clone(), local.clone()));
    }
    for (path_in_repo, local) in files {
        let (size, sha256) = hash_regular_file(&local)
            .map_err(|e| bad(format!("cannot read {path_in_repo:?}: {e}")))?;
        listing.files.push(LocalFile {
            path_in_repo,
            local_path: local,
            size,
            sha256,
        });
    }
    listing
        .files
        .sort_by(|a, b| a.path_in_repo.cmp(&b.path_in_repo));
    listing.skipped.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(listing)
}

/// Size and sha256 of a regular file, checked on the opened handle (a FIFO or device
/// put in its place since the listing is refused, never read).
fn hash_regular_file(path: &Path) -> std::io::Result<(u64, String)> {
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        size += n as u64;
        hasher.update(&buf[..n]);
    }
    Ok((
        size,
        hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    ))
}

impl HubClient {
    /// `hf-hub`'s client for the upload calls, with this client's endpoint, token,
    /// retries and timeouts.
    fn uploader(&self) -> Result<HFClientSync, HubError> {
        let config = &self.config;
        let http = reqwest::Client::builder()
            .user_agent(concat!("tokenformer/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(config.connect_timeout)
            .read_timeout(config.read_timeout)
            .build()
            .map_err(|e| HubError::Config {
                detail: format!("cannot build the HTTP client: {}", error_chain(&e)),
            })?;
        let mut builder = HFClientBuilder::new()
            .endpoint(config.endpoint.clone())
            .cache_dir(config.cache_dir.clone())
            .retry_max_attempts(config.max_retries)
            .retry_base_delay(config.retry_base_delay)
            .client(http);
        if let Some(token) = config.token() {
            builder = builder.token(token.to_string());
        }
        builder.build_sync().map_err(|e| HubError::Config {
            detail: config.scrub(format!("endpoint {:?}: {e}", config.endpoint)),
        })
    }

    /// Create `repo` if needed (exist-ok), then upload the files of `folder` that
    /// [`upload_listing`] lists as one commit to `repo.revision` (a branch, created from
    /// `main` if missing). The folder is only read.
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
        let listing = upload_listing(folder, &opts.replace)?;
        if listing.files.is_empty() {
            return Err(HubError::InvalidFolder {
                folder: folder.to_path_buf(),
                reason: "it contains no files to upload".into(),
            });
        }
        let client = self.uploader()?;
        let repo_id = repo.repo_id();
        let repo_url = client
            .create_repository()
            .repo_id(&repo_id)
            .repo_type(RepoTypeModel)
            .private(opts.private)
            .exist_ok(true)
            .send()
            .map_err(|e| self.map_hf_err(e, repo, &format!("creating repository {repo_id}")))?
            .url;
        let handle = client.model(repo.owner.clone(), repo.name.clone());
        if repo.revision != DEFAULT_REVISION {
            self.ensure_branch(&handle, repo)?;
        }
        let operations = listing
            .files
            .iter()
            .map(|f| CommitOperation::add_file(f.path_in_repo.clone(), f.local_path.clone()))
            .collect();
        let repo_shown = repo.to_string();
        if let Some(p) = &opts.progress {
            p.report(&UploadEvent::Started { repo: &repo_shown });
        }
        let op = format!(
            "committing {} file(s) from {} to {repo}",
            listing.files.len(),
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
            .maybe_progress(
                opts.progress
                    .clone()
                    .map(|p| Progress::new(UploadHandler(p))),
            )
            .send();
        if let Some(p) = &opts.progress {
            p.report(&UploadEvent::Finished { ok: result.is_ok() });
        }
        let info = result.map_err(|e| self.map_hf_err(e, repo, &op))?;
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
            files: listing.files,
            skipped: listing.skipped,
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
            .map_err(|e| self.map_hf_err(e, repo, &op))?;
        if exists {
            return Ok(());
        }
        match handle.create_branch().branch(&repo.revision).send() {
            Ok(()) | Err(HFError::Conflict { .. }) => Ok(()),
            Err(e) => Err(self.map_hf_err(e, repo, &op)),
        }
    }

    /// Translate an `hf-hub` error, preferring the Hub's `X-Error-Code` when present.
    fn map_hf_err(&self, e: HFError, repo: &RepoRef, op: &str) -> HubError {
        let op = self.config.scrub(op.to_string());
        let by_code = |code: Option<&str>| -> Option<HubError> {
            match code? {
                "RepoNotFound" => Some(self.repo_not_found(repo)),
                "RevisionNotFound" => Some(revision_not_found(repo)),
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
            HFError::RevisionNotFound { .. } => revision_not_found(repo),
            HFError::EntryNotFound { path, .. } => file_not_found(repo, &path),
            HFError::AuthRequired { context } | HFError::Forbidden { context } => {
                by_code(context.error_code.as_deref()).unwrap_or_else(|| {
                    let server = context.server_message.clone().unwrap_or_default();
                    HubError::Auth {
                        op,
                        status: context.status.as_u16(),
                        detail: self.config.scrub(format!("{auth_hint}; {server}")),
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
            HFError::Request { source, .. } => HubError::Network {
                op,
                endpoint: self.config.endpoint.clone(),
                detail: self.config.scrub(error_chain(&source)),
            },
            HFError::Io(error) => HubError::Io { op, error },
            other => HubError::Other {
                op,
                detail: self.config.scrub(other.to_string()),
            },
        }
    }
}
