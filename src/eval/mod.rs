//! Evaluations: Pile perplexity ([`pile`]), the zero-shot language tasks
//! ([`tasks`]), ImageNet top-1/top-5 ([`imagenet`]), and merging the results
//! of sharded runs ([`merge`]). Each run returns a serde result with a `kind`
//! that `tokenformer eval merge` dispatches on ([`merge::Report`]).
//!
//! Shared pieces: [`data`] (bounded reading of `.txt`/`.jsonl[.zst]`, file
//! hashes), [`shard`] (one part of a run), `pytext` (Python's string rules
//! the harness relies on). Progress and warnings reach the caller through
//! callbacks and returned values; nothing here prints.

#![warn(missing_docs)]

pub mod data;
pub mod harness;
pub mod imagenet;
pub mod merge;
pub mod pile;
pub(crate) mod pytext;
pub mod report;
pub mod shard;
pub mod tasks;

pub use merge::merge_results;
pub use report::Report;
pub use shard::Shard;

use std::path::Path;

use crate::loader::{ModelFiles, Weights};

/// The Hub commit a model's files were resolved to, for results: the
/// `<commit>` of the Hugging Face cache path
/// `models--<owner>--<name>/snapshots/<commit>/…` its weights sit in (what a
/// branch such as `main` pointed to when they were fetched). A model outside
/// the cache (a local folder) has none.
pub fn model_commit(files: &ModelFiles) -> Option<String> {
    let path = match &files.weights {
        Weights::Safetensors(p) => p.first()?,
        Weights::OfficialBin(p) => p,
    };
    commit_of_path(path)
}

/// The snapshot commit in a Hugging Face cache path, if `path` is one.
pub(crate) fn commit_of_path(path: &Path) -> Option<String> {
    let parts: Vec<&str> = path.iter().filter_map(|c| c.to_str()).collect();
    parts.windows(3).find_map(|w| {
        let is_commit = w[2].len() == 40 && w[2].bytes().all(|b| b.is_ascii_hexdigit());
        (w[0].starts_with("models--") && w[1] == "snapshots" && is_commit)
            .then(|| w[2].to_ascii_lowercase())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_comes_from_the_snapshot_folder_only() {
        let c = "0123456789abcdef0123456789abcdef01234567";
        let p = format!("/h/hub/models--o--n/snapshots/{c}/model.safetensors");
        assert_eq!(commit_of_path(Path::new(&p)).as_deref(), Some(c));
        let nested = format!("/h/hub/models--o--n/snapshots/{c}/sub/x.bin");
        assert_eq!(commit_of_path(Path::new(&nested)).as_deref(), Some(c));
        for p in [
            "/data/my-model/model.safetensors".to_string(),
            format!("/data/snapshots/{c}/model.safetensors"),
            "/h/hub/models--o--n/snapshots/main/model.safetensors".into(),
            format!("/h/hub/models--o--n/snapshots/{}/m", &c[..39]),
        ] {
            assert_eq!(commit_of_path(Path::new(&p)), None, "{p}");
        }
    }
}
