//! The cache on disk, laid out like Python `huggingface_hub`'s so both share it:
//! `models--{owner}--{name}/{blobs/<etag>, snapshots/<commit>/<file> -> ../../blobs/<etag>,
//! refs/<revision>}` and download locks in `.locks/models--{owner}--{name}/<etag>.lock`.
//!
//! A blob is trusted only once its content was checked against its name (the ETag: a
//! sha256 or a git blob sha1). The check leaves a marker,
//! `models--{owner}--{name}/.tokenformer/verified/<etag>`, recording the blob's size,
//! mtime and inode at that moment; a blob whose marker is missing or disagrees (written by
//! another tool, or by a process killed before it checked) is hashed again before use and
//! removed if wrong. New blobs are written to `blobs/<etag>.incomplete` under the lock,
//! hashed, and only then renamed into place, so an interrupted download never leaves a
//! file that a later run takes for a blob.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use sha1::Sha1;
use sha2::{Digest, Sha256};

use super::repo::{is_commit_sha, EtagKind, RepoRef};

/// The cache folder of one repo.
pub(crate) struct RepoCache {
    /// `<cache>/models--owner--name`.
    pub dir: PathBuf,
    /// `<cache>/.locks/models--owner--name`.
    locks: PathBuf,
}

/// What is known about a blob on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlobState {
    Missing,
    /// Present, content checked and unchanged since.
    Trusted,
    /// Present but never checked (or changed since): hash before use.
    Unverified,
}

impl RepoCache {
    pub(crate) fn new(cache_dir: &Path, repo: &RepoRef) -> Self {
        let folder = repo.cache_folder_name();
        RepoCache {
            dir: cache_dir.join(&folder),
            locks: cache_dir.join(".locks").join(folder),
        }
    }

    pub(crate) fn blobs(&self) -> PathBuf {
        self.dir.join("blobs")
    }

    /// `etag` must have passed `parse_etag` (hex only).
    pub(crate) fn blob(&self, etag: &str) -> PathBuf {
        self.blobs().join(etag)
    }

    pub(crate) fn incomplete(&self, etag: &str) -> PathBuf {
        self.blobs().join(format!("{etag}.incomplete"))
    }

    fn marker(&self, etag: &str) -> PathBuf {
        self.dir.join(".tokenformer").join("verified").join(etag)
    }

    pub(crate) fn lock_path(&self, etag: &str) -> PathBuf {
        self.locks.join(format!("{etag}.lock"))
    }

    /// `commit` must be a checked sha and `file` a checked repo path.
    pub(crate) fn snapshot(&self, commit: &str, file: &str) -> PathBuf {
        let mut p = self.dir.join("snapshots").join(commit);
        p.extend(file.split('/'));
        p
    }

    pub(crate) fn snapshot_root(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    /// `revision` must have passed the revision check (no `.`-led or empty components).
    fn ref_path(&self, revision: &str) -> PathBuf {
        let mut p = self.dir.join("refs");
        p.extend(revision.split('/'));
        p
    }

    /// The commit `refs/<revision>` holds, if it holds a valid one.
    pub(crate) fn read_ref(&self, revision: &str) -> Option<String> {
        let mut text = String::new();
        File::open(self.ref_path(revision))
            .ok()?
            .take(128)
            .read_to_string(&mut text)
            .ok()?;
        let sha = text.trim();
        is_commit_sha(sha).then(|| sha.to_ascii_lowercase())
    }

    pub(crate) fn write_ref(&self, revision: &str, commit: &str) -> io::Result<()> {
        if self.read_ref(revision).as_deref() == Some(commit) {
            return Ok(());
        }
        write_atomically(&self.ref_path(revision), commit.as_bytes())
    }

    pub(crate) fn blob_state(&self, etag: &str) -> BlobState {
        let Ok(meta) = std::fs::symlink_metadata(self.blob(etag)) else {
            return BlobState::Missing;
        };
        if !meta.file_type().is_file() {
            return BlobState::Unverified;
        }
        let mut text = String::new();
        let marked = File::open(self.marker(etag))
            .and_then(|f| f.take(256).read_to_string(&mut text))
            .is_ok();
        if marked && text.trim() == stamp(&meta) {
            BlobState::Trusted
        } else {
            BlobState::Unverified
        }
    }

    /// Record that `blobs/<etag>` was checked as it is now.
    pub(crate) fn mark_verified(&self, etag: &str) -> io::Result<()> {
        let meta = std::fs::symlink_metadata(self.blob(etag))?;
        write_atomically(&self.marker(etag), stamp(&meta).as_bytes())
    }

    /// Remove a blob that failed its check (and its marker).
    pub(crate) fn remove_blob(&self, etag: &str) {
        let _ = std::fs::remove_file(self.marker(etag));
        let _ = std::fs::remove_file(self.blob(etag));
    }

    /// Hash `blobs/<etag>` and say whether it matches its name.
    pub(crate) fn check_blob(
        &self,
        etag: &str,
        kind: EtagKind,
        beat: &dyn Fn(),
    ) -> io::Result<bool> {
        let path = self.blob(etag);
        let meta = std::fs::symlink_metadata(&path)?;
        if !meta.file_type().is_file() {
            return Ok(false);
        }
        Ok(hash_file(&path, kind, beat)? == etag)
    }

    /// The ETag a snapshot entry points to, if it is a link into this repo's `blobs/`
    /// named by a valid ETag.
    pub(crate) fn snapshot_etag(&self, commit: &str, file: &str) -> Option<(String, EtagKind)> {
        let entry = self.snapshot(commit, file);
        let target = std::fs::read_link(&entry).ok()?;
        let etag = target.file_name()?.to_str()?.to_string();
        let kind = EtagKind::of(&etag)?;
        // The link must lead into this repo's blobs folder, wherever it is written from.
        let parent = entry.parent()?.join(target.parent()?);
        let same = match (parent.canonicalize(), self.blobs().canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        same.then_some((etag, kind))
    }

    /// Whether `snapshots/<commit>/<file>` leads to a blob that is there (not yet
    /// whether it is the right one: that is checked before it is used).
    pub(crate) fn has_snapshot(&self, commit: &str, file: &str) -> bool {
        self.snapshot_etag(commit, file)
            .is_some_and(|(etag, _)| self.blob_state(&etag) != BlobState::Missing)
    }

    /// Point `snapshots/<commit>/<file>` at `blobs/<etag>` (relative link, replaced
    /// atomically if present).
    pub(crate) fn link_snapshot(
        &self,
        commit: &str,
        file: &str,
        etag: &str,
    ) -> io::Result<PathBuf> {
        let entry = self.snapshot(commit, file);
        let parent = entry.parent().expect("snapshot entries have a parent");
        std::fs::create_dir_all(parent)?;
        let depth = file.split('/').count() + 1;
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        if std::fs::read_link(&entry).ok().as_deref() == Some(target.as_path()) {
            return Ok(entry);
        }
        let tmp = temp_sibling(&entry);
        std::os::unix::fs::symlink(&target, &tmp)?;
        std::fs::rename(&tmp, &entry).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        Ok(entry)
    }
}

/// Size, mtime and identity of a file: what a marker records.
fn stamp(meta: &std::fs::Metadata) -> String {
    format!(
        "v1 {} {}.{:09} {} {}",
        meta.len(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.dev(),
        meta.ino()
    )
}

/// A name beside `path` no other process uses.
fn temp_sibling(path: &Path) -> PathBuf {
    let n: u64 = rand::random();
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.{n:016x}.tmp", std::process::id()))
}

/// Write `bytes` to `path` through a temporary file and a rename.
fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = temp_sibling(path);
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The content hash of the kind an ETag names, streaming the file.
pub(crate) fn hash_file(path: &Path, kind: EtagKind, beat: &dyn Fn()) -> io::Result<String> {
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let len = f.metadata()?.len();
    let mut h = ContentHasher::new(kind, len);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        beat();
    }
    Ok(h.finish())
}

/// sha256 of the content, or the git blob sha1 (`"blob <len>\0"` + content).
pub(crate) enum ContentHasher {
    Sha256(Sha256),
    GitSha1(Sha1),
}

impl ContentHasher {
    /// `len` is the full content length (the git blob header needs it up front).
    pub(crate) fn new(kind: EtagKind, len: u64) -> Self {
        match kind {
            EtagKind::Sha256 => ContentHasher::Sha256(Sha256::new()),
            EtagKind::GitSha1 => {
                let mut h = Sha1::new();
                h.update(format!("blob {len}\0").as_bytes());
                ContentHasher::GitSha1(h)
            }
        }
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        match self {
            ContentHasher::Sha256(h) => h.update(bytes),
            ContentHasher::GitSha1(h) => h.update(bytes),
        }
    }

    pub(crate) fn finish(self) -> String {
        let bytes: Vec<u8> = match self {
            ContentHasher::Sha256(h) => h.finalize().to_vec(),
            ContentHasher::GitSha1(h) => h.finalize().to_vec(),
        };
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The download lock of one blob, shared with other processes (and with Python's
/// `huggingface_hub`, which locks the same file). Released on drop or process exit.
pub(crate) struct BlobLock {
    file: Option<File>,
    last_beat: std::cell::Cell<Instant>,
}

/// Why waiting for the lock ended without it.
pub(crate) enum LockWaitError {
    Io(io::Error),
    /// The holder showed no sign of life for this long.
    Stalled(Duration),
    /// The overall bound passed although the holder kept progressing.
    TooLong(Duration),
}

impl BlobLock {
    /// Take the lock, waiting while another holder makes progress: its
    /// `blobs/<etag>.incomplete` grows or it touches the lock file. File systems without
    /// locks get no lock (downloads then use private temporary names).
    pub(crate) fn acquire(
        lock_path: &Path,
        watch: &Path,
        stall_limit: Duration,
        max_wait: Duration,
        mut on_wait: impl FnMut(),
    ) -> Result<BlobLock, LockWaitError> {
        if let Some(parent) = lock_path.parent() {
            std::fs::create_dir_all(parent).map_err(LockWaitError::Io)?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW)
            .open(lock_path)
            .map_err(LockWaitError::Io)?;
        let start = Instant::now();
        let mut last_progress = start;
        let mut seen = (None, None);
        let mut waited = false;
        loop {
            match file.try_lock() {
                Ok(()) => {
                    return Ok(BlobLock {
                        file: Some(file),
                        last_beat: std::cell::Cell::new(Instant::now()),
                    })
                }
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => {
                    return Ok(BlobLock {
                        file: None,
                        last_beat: std::cell::Cell::new(Instant::now()),
                    })
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(LockWaitError::Io(e)),
            }
            if !waited {
                waited = true;
                on_wait();
            }
            let now_seen = (
                std::fs::metadata(watch).ok().map(|m| m.len()),
                file.metadata().ok().and_then(|m| m.modified().ok()),
            );
            let now = Instant::now();
            if now_seen != seen {
                seen = now_seen;
                last_progress = now;
            }
            if now - last_progress > stall_limit {
                return Err(LockWaitError::Stalled(now - last_progress));
            }
            if now - start > max_wait {
                return Err(LockWaitError::TooLong(now - start));
            }
            std::thread::sleep(Duration::from_millis(50 + rand::random::<u64>() % 150));
        }
    }

    /// Whether this process really holds an exclusive lock.
    pub(crate) fn exclusive(&self) -> bool {
        self.file.is_some()
    }

    /// Show waiters this holder is alive (at most once a second).
    pub(crate) fn beat(&self) {
        if self.last_beat.get().elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_beat.set(Instant::now());
        if let Some(f) = &self.file {
            let _ = f.set_modified(SystemTime::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_blob_sha1_matches_git() {
        // `git hash-object` of "hello\n" and of the empty file.
        let mut h = ContentHasher::new(EtagKind::GitSha1, 6);
        h.update(b"hello\n");
        assert_eq!(h.finish(), "ce013625030ba8dba906f756967f9e9ca394464a");
        let h = ContentHasher::new(EtagKind::GitSha1, 0);
        assert_eq!(h.finish(), "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
    }

    #[test]
    fn markers_follow_the_blob() {
        let dir = tempfile::tempdir().unwrap();
        let repo = RepoRef::parse("a/b").unwrap();
        let c = RepoCache::new(dir.path(), &repo);
        let etag = "ce013625030ba8dba906f756967f9e9ca394464a";
        assert_eq!(c.blob_state(etag), BlobState::Missing);
        std::fs::create_dir_all(c.blobs()).unwrap();
        std::fs::write(c.blob(etag), b"hello\n").unwrap();
        assert_eq!(c.blob_state(etag), BlobState::Unverified);
        assert!(c.check_blob(etag, EtagKind::GitSha1, &|| {}).unwrap());
        c.mark_verified(etag).unwrap();
        assert_eq!(c.blob_state(etag), BlobState::Trusted);
        // Rewritten in place (another tool, a partial copy): no longer trusted.
        std::thread::sleep(Duration::from_millis(10));
        std::fs::write(c.blob(etag), b"hellO\n").unwrap();
        assert_eq!(c.blob_state(etag), BlobState::Unverified);
        assert!(!c.check_blob(etag, EtagKind::GitSha1, &|| {}).unwrap());
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let p = c.link_snapshot(commit, "sub/x.json", etag).unwrap();
        assert_eq!(
            std::fs::read_link(&p).unwrap(),
            PathBuf::from("../../../blobs").join(etag)
        );
        assert_eq!(
            c.snapshot_etag(commit, "sub/x.json"),
            Some((etag.to_string(), EtagKind::GitSha1))
        );
        c.write_ref("feature/x", commit).unwrap();
        assert_eq!(c.read_ref("feature/x").as_deref(), Some(commit));
    }
}
