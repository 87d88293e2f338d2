//! Downloading repo files into the cache.
//!
//! Per file: a HEAD of `resolve/<revision>/<file>` gives the commit (`X-Repo-Commit`), the
//! content hash (`X-Linked-Etag` or `ETag`) and the size; each is checked before it names
//! anything on disk. A blob already in the cache is used if it was verified (see `cache`);
//! otherwise, under a per-blob lock shared with other processes, the content is fetched
//! from `resolve/<commit>/<file>` (so a branch moving meanwhile cannot mix versions),
//! streamed into `blobs/<etag>.incomplete`, checked against the ETag, and renamed into
//! place; only then does the snapshot link appear. Interrupted transfers resume with a
//! `Range` request. The files of one call all come from the same commit. When the Hub
//! cannot be reached, a file the cache holds for the revision is used after one try.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use reqwest::header::{HeaderMap, CONTENT_LENGTH, CONTENT_RANGE};
use reqwest::{Method, StatusCode};

use super::cache::{hash_file, BlobLock, BlobState, LockWaitError, RepoCache};
use super::client::{
    io_error_detail, io_timed_out, Ctx, HubClient, Redirects, RepoFile, Tries, MAX_TIMEOUT_RETRIES,
};
use super::error::HubError;
use super::progress::{DownloadEvent, DownloadProgress};
use super::repo::{check_repo_path, is_commit_sha, parse_etag, shown, EtagKind, RepoRef};

/// What the HEAD of a file says, checked.
struct FileMeta {
    commit: String,
    etag: String,
    kind: EtagKind,
    size: Option<u64>,
}

impl HubClient {
    /// Download `files` of `repo` into the cache (or find them there when offline) and
    /// return their paths inside `snapshots/<commit>/`, in the order given, all from one
    /// commit, reporting progress to `progress` if given.
    pub fn download_files(
        &self,
        repo: &RepoRef,
        files: &[&str],
        progress: Option<&DownloadProgress>,
    ) -> Result<Vec<PathBuf>, HubError> {
        self.download_files_with(repo, files, &mut |e| {
            if let Some(p) = progress {
                p.report(e)
            }
        })
    }

    /// [`download_files`](Self::download_files) reporting progress to `on_progress`.
    pub fn download_files_with(
        &self,
        repo: &RepoRef,
        files: &[&str],
        on_progress: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<Vec<PathBuf>, HubError> {
        for f in files {
            check_repo_path(f).map_err(|reason| HubError::InvalidFileName {
                repo: repo.to_string(),
                file: f.to_string(),
                reason,
            })?;
        }
        let mut pinned = None;
        files
            .iter()
            .map(|f| self.fetch(repo, f, &mut pinned, on_progress))
            .collect()
    }

    /// Download one file; see [`download_files`](Self::download_files).
    pub fn download_file(
        &self,
        repo: &RepoRef,
        file: &str,
        progress: Option<&DownloadProgress>,
    ) -> Result<PathBuf, HubError> {
        Ok(self.download_files(repo, &[file], progress)?.remove(0))
    }

    fn fetch(
        &self,
        repo: &RepoRef,
        file: &str,
        pinned: &mut Option<String>,
        on: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<PathBuf, HubError> {
        let cache = RepoCache::new(&self.config.cache_dir, repo);
        let fixed = pinned
            .clone()
            .or_else(|| is_commit_sha(&repo.revision).then(|| repo.revision.to_ascii_lowercase()));
        // A commit never changes: a checked copy needs no request.
        if let Some(commit) = &fixed {
            if let Some(p) = self.cached_snapshot(&cache, repo, commit, file)? {
                return Ok(p);
            }
        }
        if self.config.offline {
            let not_cached = || HubError::NotCached {
                repo: repo.repo_id(),
                revision: repo.revision.clone(),
                file: file.to_string(),
                cache_dir: self.config.cache_dir.clone(),
            };
            let commit = fixed
                .or_else(|| cache.read_ref(&repo.revision))
                .ok_or_else(not_cached)?;
            return self
                .cached_snapshot(&cache, repo, &commit, file)?
                .ok_or_else(not_cached);
        }
        let revision = fixed.as_deref().unwrap_or(&repo.revision);
        // Like huggingface_hub: when the Hub cannot be reached, the cache answers, at once
        // (one try) when it holds the file, after the retries otherwise.
        let cached = fixed
            .clone()
            .or_else(|| cache.read_ref(&repo.revision))
            .filter(|c| cache.has_snapshot(c, file));
        let tries = match cached {
            Some(_) => Tries::Once,
            None => Tries::Configured,
        };
        let meta = match self.file_metadata(repo, revision, file, tries) {
            Ok(m) => m,
            Err(e) if e.is_transient() => {
                let Some(commit) = cached else {
                    return Err(e);
                };
                match self.cached_snapshot(&cache, repo, &commit, file)? {
                    // The other files of this call then come from the same commit.
                    Some(p) => {
                        *pinned = Some(commit);
                        return Ok(p);
                    }
                    // The cached copy was bad (and is gone): the Hub is the only source.
                    None => self.file_metadata(repo, revision, file, Tries::Configured)?,
                }
            }
            Err(e) => return Err(e),
        };
        let op = || format!("downloading {file:?} from {repo}");
        if let Some(commit) = &fixed {
            if *commit != meta.commit {
                return Err(HubError::BadResponse {
                    op: op(),
                    detail: format!(
                        "asked for commit {commit}, the server answered for {}",
                        meta.commit
                    ),
                });
            }
        }
        *pinned = Some(meta.commit.clone());
        self.ensure_blob(&cache, repo, file, &meta, on)?;
        let io = |e| HubError::io(format!("adding {file:?} of {repo} to the cache"), e);
        let path = cache
            .link_snapshot(&meta.commit, file, &meta.etag)
            .map_err(io)?;
        if !is_commit_sha(&repo.revision) {
            cache.write_ref(&repo.revision, &meta.commit).map_err(io)?;
        }
        Ok(path)
    }

    /// HEAD the file and check every value that will name something on disk.
    fn file_metadata(
        &self,
        repo: &RepoRef,
        revision: &str,
        file: &str,
        tries: Tries,
    ) -> Result<FileMeta, HubError> {
        let ctx = Ctx::new(
            repo,
            Some(file),
            format!("downloading {file:?} from {repo}"),
        );
        let url = self.resolve_url(repo, revision, file);
        let resp = self.send_tries(Method::HEAD, &url, Redirects::Metadata, None, tries, &ctx)?;
        let status = resp.status();
        if !(status.is_success() || status.is_redirection()) {
            return Err(self.status_error(resp, &ctx));
        }
        let h = resp.headers();
        let bad = |detail: String| HubError::BadResponse {
            op: ctx.op.clone(),
            detail,
        };
        let commit = match header(h, "x-repo-commit") {
            Some(c) if is_commit_sha(&c) => c.to_ascii_lowercase(),
            Some(c) => {
                return Err(bad(format!(
                    "X-Repo-Commit {} is not a 40-hex commit sha",
                    shown(&c)
                )))
            }
            None if status.is_redirection() => {
                return Err(bad(format!(
                    "HTTP {status} redirect without the file's metadata (to another host?)"
                )))
            }
            None => return Err(bad("no X-Repo-Commit header".into())),
        };
        let raw_etag = header(h, "x-linked-etag")
            .or_else(|| header(h, "etag"))
            .ok_or_else(|| bad("no ETag header".into()))?;
        let (etag, kind) = parse_etag(&raw_etag).map_err(bad)?;
        let size_header = header(h, "x-linked-size").or_else(|| {
            status
                .is_success()
                .then(|| header(h, CONTENT_LENGTH.as_str()))
                .flatten()
        });
        let size = match size_header {
            Some(s) => Some(
                s.trim()
                    .parse::<u64>()
                    .map_err(|_| bad(format!("file size {} is not a number", shown(&s))))?,
            ),
            None => None,
        };
        Ok(FileMeta {
            commit,
            etag,
            kind,
            size,
        })
    }

    /// The snapshot entry of `file` at `commit` if it leads to a checked blob. A blob
    /// never checked is hashed now; a wrong one is removed (and reported when offline,
    /// since it cannot be fetched again).
    fn cached_snapshot(
        &self,
        cache: &RepoCache,
        repo: &RepoRef,
        commit: &str,
        file: &str,
    ) -> Result<Option<PathBuf>, HubError> {
        let Some((etag, kind)) = cache.snapshot_etag(commit, file) else {
            return Ok(None);
        };
        let path = cache.snapshot(commit, file);
        match cache.blob_state(&etag) {
            BlobState::Trusted => return Ok(Some(path)),
            BlobState::Missing => return Ok(None),
            BlobState::Unverified => {}
        }
        let lock = self.lock_blob(cache, repo, file, &etag, &mut |_| {})?;
        match self.verify_existing(cache, repo, file, &etag, kind, &lock)? {
            true => Ok(Some(path)),
            false if self.config.offline => Err(HubError::Integrity {
                repo: repo.to_string(),
                file: file.to_string(),
                algorithm: kind.algorithm(),
                expected: etag,
                actual: "a different content (the cached blob was removed)".into(),
            }),
            false => Ok(None),
        }
    }

    /// With the lock held: whether `blobs/<etag>` is (now) a checked blob. A wrong one is
    /// removed.
    fn verify_existing(
        &self,
        cache: &RepoCache,
        repo: &RepoRef,
        file: &str,
        etag: &str,
        kind: EtagKind,
        lock: &BlobLock,
    ) -> Result<bool, HubError> {
        match cache.blob_state(etag) {
            BlobState::Trusted => return Ok(true),
            BlobState::Missing => return Ok(false),
            BlobState::Unverified => {}
        }
        let io = |e| HubError::io(format!("checking the cached {file:?} of {repo}"), e);
        if cache.check_blob(etag, kind, &|| lock.beat()).map_err(io)? {
            cache.mark_verified(etag).map_err(io)?;
            Ok(true)
        } else {
            cache.remove_blob(etag);
            Ok(false)
        }
    }

    fn lock_blob(
        &self,
        cache: &RepoCache,
        repo: &RepoRef,
        file: &str,
        etag: &str,
        on: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<BlobLock, HubError> {
        let stall = self.config.lock_stall_limit();
        BlobLock::acquire(
            &cache.lock_path(etag),
            &cache.incomplete(etag),
            stall,
            self.config.lock_wait,
            || on(&DownloadEvent::Waiting { file }),
        )
        .map_err(|e| match e {
            LockWaitError::Io(e) => HubError::io(
                format!(
                    "locking {} for {file:?} of {repo}",
                    cache.lock_path(etag).display()
                ),
                e,
            ),
            LockWaitError::Stalled(d) => HubError::LockTimeout {
                repo: repo.to_string(),
                file: file.to_string(),
                detail: format!(
                    "the process holding {} showed no progress for {:.0?}",
                    cache.lock_path(etag).display(),
                    d
                ),
            },
            LockWaitError::TooLong(d) => HubError::LockTimeout {
                repo: repo.to_string(),
                file: file.to_string(),
                detail: format!(
                    "waited {d:.0?} (TOKENFORMER_HUB_LOCK_WAIT) for the process holding {}",
                    cache.lock_path(etag).display()
                ),
            },
        })
    }

    /// Make `blobs/<etag>` a checked copy of the file, downloading it if needed.
    fn ensure_blob(
        &self,
        cache: &RepoCache,
        repo: &RepoRef,
        file: &str,
        meta: &FileMeta,
        on: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<(), HubError> {
        if cache.blob_state(&meta.etag) == BlobState::Trusted {
            return Ok(());
        }
        let lock = self.lock_blob(cache, repo, file, &meta.etag, on)?;
        // Another process may have finished it while this one waited.
        if self.verify_existing(cache, repo, file, &meta.etag, meta.kind, &lock)? {
            on(&DownloadEvent::Finished { file });
            return Ok(());
        }
        let io = |e| HubError::io(format!("writing {file:?} of {repo} into the cache"), e);
        std::fs::create_dir_all(cache.blobs()).map_err(io)?;
        let temp = if lock.exclusive() {
            cache.incomplete(&meta.etag)
        } else {
            cache.blobs().join(format!(
                "{}.{}.{:016x}.incomplete",
                meta.etag,
                std::process::id(),
                rand::random::<u64>()
            ))
        };
        let result = self.download_to(repo, file, meta, &temp, &lock, on);
        let result = result.and_then(|()| {
            std::fs::rename(&temp, cache.blob(&meta.etag)).map_err(io)?;
            cache.mark_verified(&meta.etag).map_err(io)
        });
        if result.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        result?;
        on(&DownloadEvent::Finished { file });
        Ok(())
    }

    /// Fetch the content into `temp` and check it against the ETag. One restart from zero
    /// if a resumed transfer does not check out.
    fn download_to(
        &self,
        repo: &RepoRef,
        file: &str,
        meta: &FileMeta,
        temp: &Path,
        lock: &BlobLock,
        on: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<(), HubError> {
        let beat = || lock.beat();
        let ctx = Ctx {
            beat: Some(&beat),
            ..Ctx::new(
                repo,
                Some(file),
                format!("downloading {file:?} from {repo}"),
            )
        };
        let io = |e| HubError::io(format!("writing {file:?} of {repo} into the cache"), e);
        let mut out = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(temp)
            .map_err(io)?;
        on(&DownloadEvent::Started {
            file,
            total_bytes: meta.size,
        });
        let mut restarted = false;
        loop {
            let resumed = self.transfer(&ctx, meta, &mut out, on)?;
            out.sync_all().map_err(io)?;
            let actual = hash_file(temp, meta.kind, &beat).map_err(io)?;
            if actual == meta.etag {
                return Ok(());
            }
            if resumed && !restarted {
                restarted = true;
                out.set_len(0).map_err(io)?;
                out.seek(SeekFrom::Start(0)).map_err(io)?;
                continue;
            }
            return Err(HubError::Integrity {
                repo: repo.to_string(),
                file: file.to_string(),
                algorithm: meta.kind.algorithm(),
                expected: meta.etag.clone(),
                actual,
            });
        }
    }

    /// GET the content of `meta.commit` into `out` (from its current length), retrying
    /// transient failures and resuming where the last attempt stopped. Returns whether any
    /// part came from a resumed (`206`) answer.
    fn transfer(
        &self,
        ctx: &Ctx,
        meta: &FileMeta,
        out: &mut File,
        on: &mut dyn FnMut(&DownloadEvent),
    ) -> Result<bool, HubError> {
        let file = ctx.file.unwrap_or_default();
        let url = self.resolve_url(ctx.repo, &meta.commit, file);
        let io = |e| {
            HubError::io(
                format!("writing {file:?} of {} into the cache", ctx.repo),
                e,
            )
        };
        let bad = |detail: String| HubError::BadResponse {
            op: ctx.op.clone(),
            detail,
        };
        let mut resumed = false;
        let mut attempt = 0u32;
        // Consecutive attempts that timed out without receiving a byte.
        let mut silent = 0usize;
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let have = out.metadata().map_err(io)?.len();
            if meta.size == Some(have) && have > 0 {
                return Ok(resumed);
            }
            let resp = self.send_range(Method::GET, &url, Redirects::Content, Some(have), ctx)?;
            let status = resp.status();
            let from = match status {
                StatusCode::OK => 0,
                StatusCode::PARTIAL_CONTENT if have > 0 => {
                    let (start, total) = content_range(resp.headers())
                        .ok_or_else(|| bad("HTTP 206 without a valid Content-Range".into()))?;
                    if start != have || meta.size.is_some_and(|s| Some(s) != total) {
                        return Err(bad(format!(
                            "asked for bytes from {have}, got a range from {start} of {total:?}"
                        )));
                    }
                    resumed = true;
                    have
                }
                StatusCode::RANGE_NOT_SATISFIABLE if have > 0 => {
                    // What we have is more than the server has: start over.
                    out.set_len(0).map_err(io)?;
                    attempt += 1;
                    if attempt as usize > self.config.max_retries {
                        return Err(bad("the server refused every range".into()));
                    }
                    continue;
                }
                s if s.is_success() => return Err(bad(format!("unexpected HTTP {s}"))),
                _ => return Err(self.status_error(resp, ctx)),
            };
            let body_len = header(resp.headers(), CONTENT_LENGTH.as_str())
                .map(|v| v.trim().parse::<u64>())
                .transpose()
                .map_err(|_| bad("Content-Length is not a number".into()))?;
            if let (Some(size), Some(len)) = (meta.size, body_len) {
                if from + len != size {
                    return Err(bad(format!(
                        "the body is {len} bytes from offset {from}, the file is {size} bytes"
                    )));
                }
            }
            out.set_len(from).map_err(io)?;
            out.seek(SeekFrom::Start(from)).map_err(io)?;
            let limit = meta.size.or(body_len.map(|l| from + l));
            let mut done = from;
            let mut body = resp;
            let failure = loop {
                // Read at most one byte past the announced size, to notice a longer body.
                let want = match limit {
                    Some(l) => (l.saturating_sub(done) + 1).min(buf.len() as u64) as usize,
                    None => buf.len(),
                };
                match body.read(&mut buf[..want]) {
                    Ok(0) => break None,
                    Ok(n) => {
                        done += n as u64;
                        if limit.is_some_and(|l| done > l) {
                            return Err(bad(format!(
                                "the server sent more than the announced {} bytes",
                                limit.unwrap_or(0)
                            )));
                        }
                        out.write_all(&buf[..n]).map_err(io)?;
                        if let Some(beat) = ctx.beat {
                            beat();
                        }
                        on(&DownloadEvent::Progress {
                            file,
                            bytes: done,
                            total_bytes: meta.size,
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => break Some((io_error_detail(&e, &self.config), io_timed_out(&e))),
                }
            };
            let short = match (&failure, limit) {
                (None, Some(l)) if done < l => Some((
                    format!("the connection ended after {done} of {l} bytes"),
                    false,
                )),
                _ => None,
            };
            let Some((detail, timed_out)) = failure.or(short) else {
                return Ok(resumed);
            };
            silent = if timed_out && done == from {
                silent + 1
            } else {
                0
            };
            if attempt as usize >= self.config.max_retries || silent > MAX_TIMEOUT_RETRIES {
                return Err(self.network_detail(detail, ctx));
            }
            self.pause(self.retry_delay(attempt, &HeaderMap::new()), ctx);
            attempt += 1;
        }
    }

    /// Offline listing: the files cached for the revision's commit.
    pub(crate) fn list_cached(&self, repo: &RepoRef) -> Result<Vec<RepoFile>, HubError> {
        let commit = self.resolve_commit(repo)?;
        self.list_snapshot(repo, &commit)
    }

    /// The commit the cache holds a snapshot of for the revision (the revision itself
    /// when it is a commit sha), if any.
    pub(crate) fn cached_commit(&self, repo: &RepoRef) -> Option<String> {
        let cache = RepoCache::new(&self.config.cache_dir, repo);
        let commit = if is_commit_sha(&repo.revision) {
            repo.revision.to_ascii_lowercase()
        } else {
            cache.read_ref(&repo.revision)?
        };
        cache.snapshot_root(&commit).is_dir().then_some(commit)
    }

    /// The files cached in the snapshot of `commit`.
    pub(crate) fn list_snapshot(
        &self,
        repo: &RepoRef,
        commit: &str,
    ) -> Result<Vec<RepoFile>, HubError> {
        let cache = RepoCache::new(&self.config.cache_dir, repo);
        let root = cache.snapshot_root(commit);
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
            let rd = std::fs::read_dir(&dir)
                .map_err(|e| HubError::io(format!("listing cached files of {repo}"), e))?;
            for entry in rd.flatten() {
                let path = entry.path();
                let Ok(ft) = entry.file_type() else { continue };
                if ft.is_dir() {
                    stack.push(path);
                    continue;
                }
                // Dangling links (blob removed) are not files of the cache.
                let Ok(meta) = std::fs::metadata(&path) else {
                    continue;
                };
                let Ok(rel) = path.strip_prefix(&root) else {
                    continue;
                };
                let rel: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                out.push(RepoFile {
                    path: rel.join("/"),
                    size: meta.len(),
                    lfs: false,
                });
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// `refs/<revision>` from the cache, if it holds a valid commit.
    pub(crate) fn cached_ref(&self, repo: &RepoRef) -> Result<Option<String>, HubError> {
        Ok(RepoCache::new(&self.config.cache_dir, repo).read_ref(&repo.revision))
    }
}

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// `Content-Range: bytes <start>-<end>/<total|*>` as (start, total).
fn content_range(h: &HeaderMap) -> Option<(u64, Option<u64>)> {
    let v = h.get(CONTENT_RANGE)?.to_str().ok()?;
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, _) = range.split_once('-')?;
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    Some((start.trim().parse().ok()?, total))
}

/// The shard files a downloaded `model.safetensors.index.json` names, sorted and
/// deduplicated, each checked as a repo path (they are downloaded by exactly this name and
/// read from exactly where the download puts them).
pub fn safetensors_index_shards(repo: &RepoRef, index: &Path) -> Result<Vec<String>, HubError> {
    const MAX_INDEX_BYTES: u64 = 64 << 20;
    let op = format!("reading {} of {repo}", index.display());
    let mut text = Vec::new();
    File::open(index)
        .and_then(|f| f.take(MAX_INDEX_BYTES + 1).read_to_end(&mut text))
        .map_err(|e| HubError::io(op.clone(), e))?;
    let bad = |detail: String| HubError::BadResponse {
        op: op.clone(),
        detail,
    };
    if text.len() as u64 > MAX_INDEX_BYTES {
        return Err(bad(format!("larger than {MAX_INDEX_BYTES} bytes")));
    }
    let value: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = value["weight_map"]
        .as_object()
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let mut shards = Vec::new();
    for (tensor, v) in map {
        let name = v
            .as_str()
            .ok_or_else(|| bad(format!("the shard of tensor {tensor:?} is not a string")))?;
        check_repo_path(name).map_err(|reason| {
            bad(format!(
                "tensor {tensor:?} names the shard file {}: {reason}",
                shown(name)
            ))
        })?;
        shards.push(name.to_string());
    }
    shards.sort();
    shards.dedup();
    if shards.is_empty() {
        return Err(bad("the weight map is empty".into()));
    }
    Ok(shards)
}
