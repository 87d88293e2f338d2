//! The model registry: `zoo/models.json`, compiled into the binary so that
//! `tokenformer zoo list` and zoo names work offline. Entries carry the Hub
//! location, the architecture config and the paper's reported metrics
//! (<https://arxiv.org/abs/2410.23168>, Tables 1, 2 and 7).

use std::sync::OnceLock;

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
    }
}
