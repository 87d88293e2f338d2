//! Data files in Hub dataset repos, named as `huggingface_hub`'s file system
//! names them: `hf://datasets/OWNER/NAME[@REVISION]/PATH` (a revision with
//! `/`, such as `refs/convert/parquet`, written `%2F`-encoded, as there).
//! They are fetched by the same download loop as model files (verified
//! against their ETag, into the standard cache under
//! `datasets--OWNER--NAME`), and found in the cache when `HF_HUB_OFFLINE=1`.

use std::path::PathBuf;

use super::error::HubError;
use super::repo::RepoRef;
use super::HubClient;

/// The prefix of a dataset file on the Hub.
pub const PREFIX: &str = "hf://datasets/";

/// A dataset file: its repo (at a revision) and its path in the repo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetFile {
    /// The dataset repo.
    pub repo: RepoRef,
    /// The file's path in the repo (`/`-separated, relative).
    pub path: String,
}

fn invalid(input: &str, reason: &str) -> HubError {
    HubError::InvalidRepoId {
        input: input.to_string(),
        reason: reason.to_string(),
    }
}

impl DatasetFile {
    /// Parses `hf://datasets/OWNER/NAME[@REVISION]/PATH`.
    pub fn parse(input: &str) -> Result<Self, HubError> {
        let rest = input
            .strip_prefix(PREFIX)
            .ok_or_else(|| invalid(input, "expected hf://datasets/OWNER/NAME[@REVISION]/PATH"))?;
        let mut parts = rest.splitn(3, '/');
        let (owner, name_rev, path) = match (parts.next(), parts.next(), parts.next()) {
            (Some(o), Some(n), Some(p)) if !p.is_empty() => (o, n, p),
            _ => return Err(invalid(
                input,
                "no file path after OWNER/NAME (expected hf://datasets/OWNER/NAME[@REVISION]/PATH)",
            )),
        };
        let name_rev = decode_revision(name_rev).map_err(|r| invalid(input, &r))?;
        let repo = RepoRef::dataset(&format!("{owner}/{name_rev}"))?;
        check_path(path).map_err(|r| invalid(input, &r))?;
        Ok(Self {
            repo,
            path: path.to_string(),
        })
    }
}

/// `%2F` (and `%2f`) in the revision part back to `/`; any other `%` is refused.
fn decode_revision(s: &str) -> Result<String, String> {
    let decoded = s.replace("%2F", "/").replace("%2f", "/");
    if decoded.contains('%') {
        return Err("only %2F may be percent-encoded (a '/' in the revision)".into());
    }
    if decoded.contains('/') && !s.contains('@') {
        return Err("%2F outside the revision".into());
    }
    Ok(decoded)
}

/// A repo file path that can only name a file inside the snapshot folder.
fn check_path(path: &str) -> Result<(), String> {
    if path.len() > 1024 {
        return Err("file path longer than 1024 characters".into());
    }
    if path.starts_with('/') || path.contains('\\') || path.contains('\0') {
        return Err("the file path must be relative, with '/' separators".into());
    }
    if path
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err("the file path has an empty, '.' or '..' component".into());
    }
    Ok(())
}

/// Fetches `hf://datasets/…` into the cache (or finds it there offline) and
/// returns the local file, with the environment's configuration.
pub fn fetch(spec: &str) -> Result<PathBuf, HubError> {
    fetch_with(&HubClient::from_env()?, spec)
}

/// [`fetch`] with a given client.
pub fn fetch_with(client: &HubClient, spec: &str) -> Result<PathBuf, HubError> {
    let f = DatasetFile::parse(spec)?;
    let mut paths = client.download_files(&f.repo, &[f.path.as_str()], None)?;
    paths.pop().ok_or_else(|| HubError::InvalidRepoId {
        input: spec.to_string(),
        reason: "the download returned no file".into(),
    })
}

/// Fetches the first `max` files (by path) that `keep` accepts under the folder
/// `hf://datasets/OWNER/NAME[@REV][/DIR]` (the whole repo without a DIR), or finds
/// them in the cache offline: their local paths, and how many the folder has in all.
/// Only the files taken are downloaded (calibration photos from a large dataset).
pub fn fetch_some_under_with(
    client: &HubClient,
    spec: &str,
    keep: impl Fn(&str) -> bool,
    max: usize,
) -> Result<(Vec<PathBuf>, usize), HubError> {
    let spec = spec.trim_end_matches('/');
    let rest = spec.strip_prefix(PREFIX).unwrap_or("");
    // OWNER/NAME alone: the repo's root (a placeholder path, for the parser).
    let root = rest.split('/').count() == 2;
    let f = if root {
        let mut f = DatasetFile::parse(&format!("{spec}/_"))?;
        f.path.clear();
        f
    } else {
        DatasetFile::parse(spec)?
    };
    let prefix = if root {
        String::new()
    } else {
        format!("{}/", f.path)
    };
    let mut files: Vec<String> = client
        .list_files(&f.repo)?
        .into_iter()
        .filter_map(|e| (e.path.starts_with(&prefix) && keep(&e.path)).then_some(e.path))
        .collect();
    files.sort();
    let found = files.len();
    files.truncate(max);
    if files.is_empty() {
        return Ok((vec![], found));
    }
    let names: Vec<&str> = files.iter().map(String::as_str).collect();
    Ok((client.download_files(&f.repo, &names, None)?, found))
}

/// The most files [`fetch_folder_with`] downloads for one folder (ImageNet's
/// validation set has 50,000 images plus a few label files).
pub const MAX_FOLDER_FILES: usize = 200_000;

/// Fetches every file under the folder `hf://datasets/OWNER/NAME[@REV]/DIR`
/// (an image folder for `eval imagenet`) into the cache, or finds it there
/// offline, and returns the local folder: the snapshot's `DIR`.
pub fn fetch_folder_with(client: &HubClient, spec: &str) -> Result<PathBuf, HubError> {
    let f = DatasetFile::parse(spec.trim_end_matches('/'))?;
    let prefix = format!("{}/", f.path);
    let files: Vec<String> = client
        .list_files(&f.repo)?
        .into_iter()
        .filter_map(|e| e.path.starts_with(&prefix).then_some(e.path))
        .collect();
    let invalid = |reason: String| HubError::InvalidRepoId {
        input: spec.to_string(),
        reason,
    };
    if files.is_empty() {
        return Err(invalid(format!("no files under {prefix} in {}", f.repo)));
    }
    if files.len() > MAX_FOLDER_FILES {
        return Err(invalid(format!(
            "{} files under {prefix}, more than the limit of {MAX_FOLDER_FILES}",
            files.len()
        )));
    }
    let names: Vec<&str> = files.iter().map(String::as_str).collect();
    let local = client.download_files(&f.repo, &names, None)?;
    // The first file's local path minus its part below the folder.
    let below = files[0][prefix.len()..].split('/').count();
    let mut dir = local
        .first()
        .cloned()
        .ok_or_else(|| invalid("the download returned no file".into()))?;
    for _ in 0..below {
        dir.pop();
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::RepoKind;

    #[test]
    fn specs_parse_into_a_dataset_repo_and_a_checked_path() {
        let f = DatasetFile::parse("hf://datasets/allenai/ai2_arc/ARC-Easy/test.parquet").unwrap();
        assert_eq!(f.repo.repo_id(), "allenai/ai2_arc");
        assert_eq!(f.repo.revision, "main");
        assert_eq!(f.repo.kind, RepoKind::Dataset);
        assert_eq!(f.repo.cache_folder_name(), "datasets--allenai--ai2_arc");
        assert_eq!(f.path, "ARC-Easy/test.parquet");
        let f = DatasetFile::parse(
            "hf://datasets/Rowan/hellaswag@refs%2Fconvert%2Fparquet/default/validation/0000.parquet",
        )
        .unwrap();
        assert_eq!(f.repo.revision, "refs/convert/parquet");
        assert_eq!(f.path, "default/validation/0000.parquet");
        for bad in [
            "hf://models/a/b/x",
            "hf://datasets/a/b",
            "hf://datasets/a/b/",
            "hf://datasets/a/b/../x",
            "hf://datasets/a/b/x//y",
            "hf://datasets/a/b/./x",
            "hf://datasets/a/b//etc/passwd",
            "hf://datasets/a/b@..%2F..%2Fx/f",
            "hf://datasets/a/b@v%41/f",
            "hf://datasets/a%2Fb/c/f",
            "hf://datasets/a--x/b/f",
            "hf://datasets/a/b/x\\y",
        ] {
            assert!(DatasetFile::parse(bad).is_err(), "{bad} accepted");
        }
    }
}
