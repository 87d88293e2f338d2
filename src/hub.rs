//! Placeholder until the Hub module lands (same API).
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct HubError(String);

#[derive(Clone, Debug)]
pub struct RepoRef {
    pub owner: String,
    pub name: String,
    pub revision: String,
}

impl RepoRef {
    pub fn parse(s: &str) -> Result<Self, HubError> {
        let (id, rev) = s.split_once('@').unwrap_or((s, "main"));
        let (owner, name) = id.split_once('/').ok_or_else(|| HubError(format!("bad repo id {s}")))?;
        Ok(Self { owner: owner.into(), name: name.into(), revision: rev.into() })
    }
}

pub fn download_files(_repo: &RepoRef, _files: &[&str], _progress: bool) -> Result<Vec<PathBuf>, HubError> {
    Err(HubError("hub not available yet".into()))
}

pub fn list_files(_repo: &RepoRef) -> Result<Vec<String>, HubError> {
    Err(HubError("hub not available yet".into()))
}
