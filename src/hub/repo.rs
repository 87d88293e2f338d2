//! Repo references (`owner/name[@revision]`) and the checks every name that becomes a path
//! passes: repo ids, revisions (folders under `refs/`), repo file names, commit shas and
//! ETags (folder and file names in the cache).

use std::fmt;
use std::str::FromStr;

use super::error::HubError;

/// Revision used when a repo id has no `@revision`.
pub const DEFAULT_REVISION: &str = "main";

/// What a repo holds: the Hub keeps models and datasets apart (URLs
/// `/datasets/owner/name/…`, API `/api/datasets/…`, cache `datasets--owner--name`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum RepoKind {
    #[default]
    Model,
    Dataset,
}

/// A repo on the Hub at a revision (branch, tag or commit sha): a model
/// unless made with [`RepoRef::dataset`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RepoRef {
    pub owner: String,
    pub name: String,
    pub revision: String,
    pub kind: RepoKind,
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
            kind: RepoKind::Model,
        })
    }

    /// Parse a dataset repo `owner/name` or `owner/name@revision`.
    pub fn dataset(input: &str) -> Result<Self, HubError> {
        Ok(RepoRef {
            kind: RepoKind::Dataset,
            ..Self::parse(input)?
        })
    }

    /// The URL path segment before `owner/name` (none for a model).
    pub(crate) fn url_prefix(&self) -> Option<&'static str> {
        match self.kind {
            RepoKind::Model => None,
            RepoKind::Dataset => Some("datasets"),
        }
    }

    /// `owner/name` (without revision).
    pub fn repo_id(&self) -> String {
        format!("{}/{}", self.owner, self.name)
    }

    /// The same repo at another revision.
    pub fn at(&self, revision: &str) -> Result<Self, HubError> {
        Ok(RepoRef {
            kind: self.kind,
            ..Self::parse(&format!("{}@{revision}", self.repo_id()))?
        })
    }

    /// `models--owner--name` (`datasets--owner--name`), the repo's folder in the HF cache.
    pub fn cache_folder_name(&self) -> String {
        let kind = match self.kind {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        };
        format!("{kind}--{}--{}", self.owner, self.name)
    }
}

impl fmt::Display for RepoRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(p) = self.url_prefix() {
            write!(f, "{p}/")?;
        }
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

/// Git ref-name rules that matter here: a revision also names a file under `refs/`, so no
/// component may be empty, start with '.', or climb out.
fn check_revision(rev: &str) -> Result<(), String> {
    if rev.is_empty() {
        return Err("empty revision after '@'".into());
    }
    if rev.len() > 255 {
        return Err("revision longer than 255 characters".into());
    }
    if let Some(c) = rev
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || "~^:?*[\\@".contains(*c))
    {
        return Err(format!("revision contains {c:?}"));
    }
    if rev
        .split('/')
        .any(|c| c.is_empty() || c.starts_with('.') || c.ends_with(".lock"))
    {
        return Err(
            "revision has an empty component, a component starting with '.', or one ending \
             in '.lock'"
                .into(),
        );
    }
    Ok(())
}

/// A repo file name is relative, `/`-separated, and stays inside the snapshot folder: no
/// absolute path, backslash, NUL, empty, `.` or `..` component.
pub(crate) fn check_repo_path(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err("empty path".into());
    }
    if path.len() > 4096 {
        return Err("path longer than 4096 bytes".into());
    }
    if path.starts_with('/') || path.contains('\\') {
        return Err("must be a relative path with '/' separators".into());
    }
    if path.chars().any(|c| c.is_control()) {
        return Err("contains a control character".into());
    }
    if path
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err("contains an empty, '.' or '..' component".into());
    }
    Ok(())
}

pub(crate) fn is_commit_sha(rev: &str) -> bool {
    rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What a blob's name (its ETag) promises about its content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EtagKind {
    /// 40 hex: the git blob sha1, `sha1("blob <len>\0" + content)` (regular files).
    GitSha1,
    /// 64 hex: the sha256 of the content (LFS files).
    Sha256,
}

impl EtagKind {
    pub(crate) fn of(etag: &str) -> Option<Self> {
        if !etag.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        match etag.len() {
            40 => Some(EtagKind::GitSha1),
            64 => Some(EtagKind::Sha256),
            _ => None,
        }
    }

    pub(crate) fn algorithm(self) -> &'static str {
        match self {
            EtagKind::GitSha1 => "git blob sha1",
            EtagKind::Sha256 => "sha256",
        }
    }
}

/// The content hash an ETag header names, lowercase, or why it is refused. Accepts the
/// quoted and weak (`W/"..."`) forms.
pub(crate) fn parse_etag(raw: &str) -> Result<(String, EtagKind), String> {
    let v = raw.trim();
    let v = v.strip_prefix("W/").unwrap_or(v);
    let v = v
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(v);
    match EtagKind::of(v) {
        Some(kind) => Ok((v.to_ascii_lowercase(), kind)),
        None => Err(format!(
            "ETag {} is neither a 40-hex git blob sha1 nor a 64-hex sha256",
            shown(raw)
        )),
    }
}

/// A server-sent value for an error message: quoted, control characters escaped, and cut
/// to a readable length.
pub(crate) fn shown(raw: &str) -> String {
    const MAX: usize = 120;
    let cut: String = raw.chars().take(MAX).collect();
    if raw.chars().count() > MAX {
        format!("{cut:?}...")
    } else {
        format!("{cut:?}")
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
            "tiny",
            "a/b/c",
            "a/",
            "/b",
            "a/b@",
            "a/b@x y",
            "a--x/b",
            "a/b@..",
            "a/b c",
            "a/-b",
            "a/b@.",
            "a/b@x/./y",
            "a/b@x//y",
            "a/b@/x",
            "a/b@x/",
            "a/b@.hidden",
        ] {
            let e = RepoRef::parse(bad).unwrap_err();
            assert!(matches!(e, HubError::InvalidRepoId { .. }), "{bad}: {e}");
            assert!(e.to_string().contains(bad.trim()), "{e}");
        }
    }

    #[test]
    fn rejects_escaping_file_names() {
        for bad in [
            "../x",
            "/etc/passwd",
            "a//b",
            "a/./b",
            "a\\b",
            "",
            "a/..",
            "x\0y",
            "a/\n",
        ] {
            assert!(check_repo_path(bad).is_err(), "{bad:?}");
        }
        assert!(check_repo_path("sub/dir/model.safetensors").is_ok());
        assert!(check_repo_path(".gitattributes").is_ok());
    }

    #[test]
    fn etags_must_be_hashes() {
        let sha1 = "0123456789abcdef0123456789abcdef01234567";
        let sha256 = "A".repeat(64);
        assert_eq!(
            parse_etag(&format!("\"{sha1}\"")).unwrap(),
            (sha1.to_string(), EtagKind::GitSha1)
        );
        assert_eq!(
            parse_etag(&format!("W/\"{sha256}\"")).unwrap(),
            ("a".repeat(64), EtagKind::Sha256)
        );
        for bad in [
            "\"../../../tmp/x\"",
            "",
            "\"\"",
            &"a".repeat(63),
            &format!("{sha1}0"),
            &format!("\"{}/..\"", &sha256[..61]),
        ] {
            let e = parse_etag(bad).unwrap_err();
            assert!(e.contains("ETag"), "{e}");
        }
    }
}
