//! The model registry: `zoo/models.json`, compiled into the binary so that
//! `tokenformer zoo list` and zoo names work offline. Entries carry the Hub
//! location, the architecture config and the paper's reported metrics
//! (<https://arxiv.org/abs/2410.23168>, Tables 1, 2 and 7). The small models
//! this project trained itself are compiled in whole (`zoo/<name>/`) and run
//! with no download.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::hub::HubConfig;

use serde::{Deserialize, Serialize};

const REGISTRY: &str = include_str!("../zoo/models.json");

/// Where a zoo model's weights live on the Hub.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HubWeights {
    pub repo: String,
    pub revision: String,
    pub files: Vec<String>,
    /// `official` (pytorch_model.bin + our config) or `canonical` (a model folder).
    pub format: String,
}

/// A tokenizer file on the Hub.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HubFile {
    pub repo: String,
    pub revision: String,
    pub file: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ZooEntry {
    pub name: String,
    pub task: String,
    pub params: String,
    pub description: String,
    /// None for configurations without released weights.
    pub weights: Option<HubWeights>,
    pub tokenizer: Option<HubFile>,
    /// The canonical `config.json` of the architecture.
    pub config: serde_json::Value,
    /// The paper's numbers, by metric name, plus a `source`.
    #[serde(default)]
    pub reported: serde_json::Map<String, serde_json::Value>,
    /// True for the models compiled into the binary (no download).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bundled: bool,
}

type BundledFiles = &'static [(&'static str, &'static [u8])];

macro_rules! bundled {
    ($name:literal: $($file:literal),+) => {
        ($name, &[$(($file, include_bytes!(concat!("../zoo/", $name, "/", $file)))),+])
    };
}

/// The files of every bundled model, by zoo name.
const BUNDLED: &[(&str, BundledFiles)] = &[
    bundled!("tiny-kjv-lm": "config.json", "model.safetensors", "tokenizer.json", "README.md"),
    bundled!("tiny-digits-vit": "config.json", "model.safetensors", "README.md"),
    bundled!("tiny-digits-vl": "config.json", "model.safetensors", "tokenizer.json", "README.md"),
];

/// The model folder of a bundled entry, written on first use under
/// `<hub cache>/../tokenformer/bundled/` (into a temporary folder, renamed into
/// place) and rewritten if a file there differs from the compiled-in bytes.
pub fn bundled_folder(entry: &ZooEntry) -> Result<PathBuf> {
    let files = BUNDLED
        .iter()
        .find(|(n, _)| *n == entry.name)
        .map(|(_, f)| *f)
        .ok_or_else(|| Error::UnknownModel(entry.name.clone()))?;
    let cache = HubConfig::from_env().cache_dir;
    let root = cache
        .parent()
        .unwrap_or(&cache)
        .join("tokenformer")
        .join("bundled");
    let dir = root.join(format!("{}-{}", entry.name, env!("CARGO_PKG_VERSION")));
    if files
        .iter()
        .all(|(f, bytes)| same_bytes(&dir.join(f), bytes))
    {
        return Ok(dir);
    }
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    let tmp = tempfile::Builder::new()
        .prefix(".partial-")
        .tempdir_in(&root)
        .map_err(|e| Error::io(&root, e))?;
    for (f, bytes) in files {
        let p = tmp.path().join(f);
        std::fs::write(&p, bytes).map_err(|e| Error::io(&p, e))?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    }
    match std::fs::rename(tmp.path(), &dir) {
        Ok(()) => Ok(dir),
        // Another process put the same files in place first.
        Err(_) if files.iter().all(|(f, b)| same_bytes(&dir.join(f), b)) => Ok(dir),
        Err(e) => Err(Error::io(&dir, e)),
    }
}

fn same_bytes(p: &Path, bytes: &[u8]) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.len() == bytes.len() as u64)
        && std::fs::read(p).is_ok_and(|b| b == bytes)
}

#[derive(Deserialize)]
struct Registry {
    models: Vec<ZooEntry>,
}

/// All registry entries, in file order.
pub fn entries() -> &'static [ZooEntry] {
    static ZOO: OnceLock<Vec<ZooEntry>> = OnceLock::new();
    ZOO.get_or_init(|| {
        serde_json::from_str::<Registry>(REGISTRY)
            .expect("zoo/models.json is checked by the test suite")
            .models
    })
}

/// Finds an entry by name (case-insensitive) or by its Hub repo id.
pub fn find(name: &str) -> Option<&'static ZooEntry> {
    let lower = name.to_ascii_lowercase();
    entries().iter().find(|e| {
        e.name == lower
            || e.weights.as_ref().is_some_and(|w| {
                w.repo
                    .eq_ignore_ascii_case(name.split('@').next().unwrap_or(""))
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_parses_and_configs_are_valid() {
        assert!(entries().len() >= 8);
        for e in entries() {
            let origin = std::path::Path::new(&e.name);
            crate::models::ModelConfig::from_value(&e.config, origin).expect(&e.name);
        }
        let e = find("TokenFormer-150M").expect("by name");
        assert_eq!(e.reported["pile_perplexity"], 10.45);
        assert_eq!(
            find("Haiyang-W/TokenFormer-1-5B@main").unwrap().name,
            "tokenformer-1-5b"
        );
        assert!(find("nope").is_none());
        for (name, _) in BUNDLED {
            assert!(find(name).expect(name).bundled, "{name} is marked bundled");
        }
        for e in entries().iter().filter(|e| e.bundled) {
            assert!(
                BUNDLED.iter().any(|(n, _)| *n == e.name),
                "{} has files",
                e.name
            );
        }
    }
}
