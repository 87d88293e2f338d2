//! `tokenformer-convert publish`: validate a model folder, refresh its model
//! card (front matter with `model-index` results from `eval --json` files) and
//! upload it to the Hugging Face Hub as one commit (hf-hub 1.0).
//!
//! The folder is never modified before the upload succeeds: the new README is
//! uploaded from a temporary file and written back only after the Hub accepted
//! the commit.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::Args;
use serde_json::{json, Map, Value};
use tokenformer::card::{self, ModelCard};
use tokenformer::hub::{self, PublishOptions, RepoRef};
use tokenformer::loader;
use tokenformer::models::{lm, vit, vl, ModelConfig, ARCHITECTURES};

use crate::family::{pipeline_tag, typed};
use crate::probe;
use crate::stdout::outln;

#[derive(Args, Debug)]
pub struct PublishArgs {
    /// The model folder (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// Target repo, `owner/name`.
    #[arg(long)]
    pub repo: String,
    /// Create the repo as private (if it does not exist yet).
    #[arg(long)]
    pub private: bool,
    /// Branch to commit to.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// Commit message.
    #[arg(long)]
    pub message: Option<String>,
    /// `tokenformer eval ... --json` result files to record in the card's model-index.
    #[arg(long, num_args = 1..)]
    pub results: Vec<PathBuf>,
    /// List what would be uploaded (files, sizes, sha256) and stop.
    #[arg(long)]
    pub dry_run: bool,
}

pub fn run(a: PublishArgs) -> Result<()> {
    let dir = &a.model;
    if !dir.is_dir() {
        bail!("{}: not a model folder", dir.display());
    }
    let repo = RepoRef::parse(&format!("{}@{}", a.repo, a.revision))?;
    let (summary, config) = validate(dir)?;
    outln!("validated {}: {summary}", dir.display())?;
    model_files_inside(dir)?;

    let readme = dir.join("README.md");
    let old = std::fs::read_to_string(&readme).unwrap_or_default();
    let results = a
        .results
        .iter()
        .map(|p| loader::read_json(p).map_err(anyhow::Error::from))
        .collect::<Result<Vec<_>>>()?;
    let pipeline = pipeline_tag(config.architecture());
    let new_readme = refresh_card(&old, dir, &repo, pipeline, &results)?;

    // The refreshed README is uploaded from a temporary file; the folder itself is only
    // read (regular files inside it; see `hub::upload_listing` for what is left out).
    let stage = tempfile::tempdir().context("creating a staging folder")?;
    let staged_readme = stage.path().join("README.md");
    std::fs::write(&staged_readme, &new_readme)?;
    let replace = vec![("README.md".to_string(), staged_readme)];

    if a.dry_run {
        let listing = hub::upload_listing(dir, &replace)?;
        for s in &listing.skipped {
            outln!("  not uploaded: {} ({})", s.path, s.reason)?;
        }
        outln!(
            "dry run: would upload to {} (revision {}):",
            repo.repo_id(),
            repo.revision
        )?;
        let total: u64 = listing.files.iter().map(|f| f.size).sum();
        for f in &listing.files {
            outln!(
                "  {:<40} {:>14} bytes  sha256 {}",
                f.path_in_repo,
                f.size,
                f.sha256
            )?;
        }
        outln!("  {} files, {} bytes", listing.files.len(), total)?;
        return Ok(());
    }
    let opts = PublishOptions {
        private: a.private,
        message: a.message.clone(),
        description: None,
        progress: Some(crate::progress::upload_bars()),
        replace,
    };
    let report = hub::publish_folder(dir, &repo, &opts)?;
    for s in &report.skipped {
        eprintln!("not uploaded: {} ({})", s.path, s.reason);
    }
    // Only now does the local folder change: its README becomes what was uploaded.
    let tmp = dir.join(".README.md.partial");
    std::fs::write(&tmp, &new_readme)?;
    std::fs::rename(&tmp, &readme)?;
    outln!(
        "uploaded {} files to {}",
        report.files.len(),
        report.repo_url
    )?;
    outln!("commit: {}", report.commit_url)?;
    Ok(())
}

/// Publish sends only files inside the folder (symlinks leading out are skipped), so a
/// model file the validation read through such a link would be missing from the repo.
fn model_files_inside(dir: &Path) -> Result<()> {
    let root = dir.canonicalize()?;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let model_file = matches!(name.as_ref(), "config.json" | "tokenizer.json")
            || name.ends_with(".safetensors")
            || name.ends_with(".safetensors.index.json");
        if model_file && path.is_symlink() {
            let target = path.canonicalize()?;
            if !target.starts_with(&root) {
                bail!(
                    "{name} is a symlink to {}, outside {}: publish uploads only files inside                      the folder; copy the file into it",
                    target.display(),
                    dir.display()
                );
            }
        }
    }
    Ok(())
}

/// Loads the folder the way users will and runs a probe forward pass; returns what
/// it found and the typed config.
fn validate(dir: &Path) -> Result<(String, ModelConfig)> {
    let files = loader::locate(&dir.display().to_string(), &Default::default())?;
    let config = match &files.config {
        loader::ConfigSource::Json { value, .. } => value.clone(),
        loader::ConfigSource::OfficialYml(_) => bail!(
            "{} is in the official format: convert it first (`tokenformer-convert official`)",
            dir.display()
        ),
    };
    let dev = Device::Cpu;
    let origin = match &files.config {
        loader::ConfigSource::Json { path: Some(p), .. } => p.clone(),
        _ => dir.join(loader::CONFIG_FILE),
    };
    let named = loader::architecture(&config);
    let typed = match typed(&config, &origin, &ARCHITECTURES)? {
        Some(c) => c,
        None if named.is_empty() => bail!("{}: config.json has no `architecture`", dir.display()),
        None => bail!(
            "{}: cannot validate architecture `{named}` (expected {}, {} or {})",
            dir.display(),
            lm::ARCHITECTURE,
            vit::ARCHITECTURE,
            vl::ARCHITECTURE
        ),
    };
    let summary = match &typed {
        ModelConfig::Lm(_) => {
            let model = loader::load_lm(&files, &dev)?;
            check_finite(&probe::lm_logits(&model)?, "")?;
            warn_no_tokenizer(&files, dir);
            format!(
                "{}, {} layers, probe forward ok",
                lm::ARCHITECTURE,
                model.config().num_layers
            )
        }
        ModelConfig::Vit(_) => {
            let model = loader::load_vit(&files, &dev)?;
            let cfg = model.config();
            let pixels = probe::probe_pixels(1, cfg.num_channels, cfg.image_size, &dev)?;
            check_finite(&model.forward(&pixels)?, "")?;
            format!(
                "{}, {} layers, {} classes, probe forward ok",
                vit::ARCHITECTURE,
                cfg.num_layers,
                cfg.num_classes
            )
        }
        ModelConfig::Vl(_) => {
            // The mixed sequence exercises both routes and the shared attention at once.
            let model = loader::load_vl(&files, &dev)?;
            let (v, l) = (model.vision().config(), model.language().config());
            let pixels = probe::probe_pixels(1, v.num_channels, v.image_size, &dev)?;
            let ids = probe::probe_ids(l.vocab_size, l.max_position_embeddings);
            let ids = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
            let (image, text) = model.forward_mixed(Some(&pixels), &ids, None)?;
            if let Some(image) = image {
                check_finite(&image, " (image)")?;
            }
            check_finite(&text, " (text)")?;
            warn_no_tokenizer(&files, dir);
            format!(
                "{}, {} layers, {} bridge tokens, mixed probe forward ok",
                vl::ARCHITECTURE,
                l.num_layers,
                model.config().bridge_tokens
            )
        }
    };
    Ok((summary, typed))
}

/// A model that publishes NaN logits is broken however well its files load.
fn check_finite(logits: &Tensor, what: &str) -> Result<()> {
    let finite = logits
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|v| v.is_finite());
    if !finite {
        bail!("the probe forward pass gives non-finite logits{what}");
    }
    Ok(())
}

fn warn_no_tokenizer(files: &loader::ModelFiles, dir: &Path) {
    if files.tokenizer.is_none() {
        eprintln!(
            "warning: no tokenizer.json in {}: users will need --tokenizer",
            dir.display()
        );
    }
}

/// The README with refreshed front matter; the body is kept if there was one.
fn refresh_card(
    old: &str,
    dir: &Path,
    repo: &RepoRef,
    pipeline: &str,
    results: &[Value],
) -> Result<String> {
    let (mut meta, body) = card::parse(old)
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.join("README.md").display()))?;
    let fresh = ModelCard::new(repo.name.clone(), pipeline);
    for (k, v) in fresh.metadata {
        match (k.as_str(), meta.get_mut(&k)) {
            ("tags", Some(Value::Array(tags))) => {
                for t in v.as_array().into_iter().flatten() {
                    if !tags.contains(t) {
                        tags.push(t.clone());
                    }
                }
            }
            (_, Some(_)) => {}
            (_, None) => {
                meta.insert(k, v);
            }
        }
    }
    // Cards written before: a library the Hub does not know.
    if meta.get("library_name") == Some(&json!("tokenformer")) {
        meta.remove("library_name");
    }
    if pipeline == "text-generation" && !meta.contains_key("datasets") {
        meta.insert("datasets".into(), json!(["EleutherAI/pile"]));
    }
    if !results.is_empty() {
        meta.insert("model-index".into(), model_index(&repo.name, results)?);
    }
    let body = if body.trim().is_empty() {
        format!(
            "# {}\n\nA TokenFormer model (https://arxiv.org/abs/2410.23168) for the `tokenformer` toolkit.\n",
            repo.name
        )
    } else {
        body
    };
    let card = ModelCard {
        metadata: meta,
        title: String::new(),
        sections: vec![],
    };
    let front = card.render();
    // render() adds an empty title line; keep only the front matter.
    let front = &front[..front.find("---\n\n").map_or(front.len(), |i| i + 4)];
    Ok(format!("{front}\n{body}"))
}

/// `model-index` entries (Hub evaluation results) from `eval --json` outputs,
/// per the Hub's spec (<https://huggingface.co/docs/hub/model-cards#evaluation-results>):
/// the dataset `type` a Hub dataset id with its `config` and `split`, the metric
/// `type` a metric id (`accuracy`, `perplexity`) and its `name` the harness's
/// (or timm's) metric name. Harness-layout files give one entry per task.
fn model_index(name: &str, results: &[Value]) -> Result<Value> {
    let mut entries = Vec::new();
    for r in results {
        let kind = r.get("kind").and_then(Value::as_str).unwrap_or("");
        if let Some(tasks) = r.get("results").and_then(Value::as_object) {
            for (task, res) in tasks {
                let config = &r["configs"][task];
                let mut dataset = Map::new();
                dataset.insert("name".into(), json!(task));
                let id = config["dataset_path"].as_str().filter(|p| !p.is_empty());
                dataset.insert("type".into(), json!(id.unwrap_or(task)));
                if let Some(c) = config["dataset_name"].as_str() {
                    dataset.insert("config".into(), json!(c));
                }
                let split = config["test_split"].as_str();
                if let Some(s) = split.or(config["validation_split"].as_str()) {
                    dataset.insert("split".into(), json!(s));
                }
                let metrics: Vec<Value> = res
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter_map(|(k, v)| {
                        let metric = k.strip_suffix(",none")?;
                        let value = v.as_f64()?;
                        (!metric.ends_with("_stderr")).then(|| metric_entry(metric, value))
                    })
                    .collect();
                if !metrics.is_empty() {
                    entries.push(result_entry("text-generation", dataset, metrics));
                }
            }
            continue;
        }
        let (task, dataset, keys): (&str, Value, &[&str]) = match kind {
            "imagenet" => (
                "image-classification",
                json!({"name": "ImageNet-1k", "type": "ILSVRC/imagenet-1k", "split": "validation"}),
                &["top1", "top5"],
            ),
            // Files written before the harness layout: the flat fields.
            "pile" => (
                "text-generation",
                json!({"name": "pile", "type": "EleutherAI/pile"}),
                &[
                    "word_perplexity",
                    "byte_perplexity",
                    "bits_per_byte",
                    "token_perplexity",
                ],
            ),
            "tasks" => {
                let t = r.get("task").and_then(Value::as_str).unwrap_or("task");
                (
                    "text-generation",
                    json!({"name": t, "type": t}),
                    &["acc", "acc_norm", "perplexity"],
                )
            }
            other => {
                bail!("results file has unknown kind `{other}` (expected pile, tasks or imagenet)")
            }
        };
        let metrics: Vec<Value> = keys
            .iter()
            .filter_map(|k| {
                r.get(*k)
                    .and_then(Value::as_f64)
                    .map(|v| metric_entry(k, v))
            })
            .collect();
        if metrics.is_empty() {
            bail!("results file of kind `{kind}` has none of the metrics {keys:?}");
        }
        let dataset = dataset.as_object().cloned().unwrap_or_default();
        entries.push(result_entry(task, dataset, metrics));
    }
    if entries.is_empty() {
        bail!("the results files hold no metric values");
    }
    Ok(json!([{"name": name, "results": entries}]))
}

fn result_entry(task: &str, dataset: Map<String, Value>, metrics: Vec<Value>) -> Value {
    json!({"task": {"type": task}, "dataset": dataset, "metrics": metrics})
}

/// A model-index metric: the Hub metric id for `name`, which stays as the `name`.
fn metric_entry(name: &str, value: f64) -> Value {
    let id = match name {
        "acc" | "acc_norm" | "top1" | "top5" => "accuracy",
        n if n.ends_with("perplexity") => "perplexity",
        n => n,
    };
    json!({"type": id, "name": name, "value": value})
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenformer::eval::harness::{blocks, with_blocks, Metric, RunConfig, TaskEntry};
    use tokenformer::eval::tasks::Task;

    fn metric(name: &'static str, value: f64) -> Metric {
        Metric {
            name,
            value: Some(value),
            stderr: Some(0.01),
            higher_is_better: true,
        }
    }

    #[test]
    fn model_index_follows_the_hub_spec() {
        let arc = Task::ArcEasy;
        let tasks = [
            TaskEntry {
                name: arc.name().into(),
                version: 1.0,
                dataset_path: arc.dataset_path(),
                dataset_name: arc.dataset_name(),
                split: Some(arc.split()),
                output_type: arc.output_type(),
                metrics: vec![metric("acc", 0.5), metric("acc_norm", 0.25)],
                original: Some(4),
                effective: 4,
            },
            TaskEntry {
                name: "pile_arxiv".into(),
                version: 2.0,
                dataset_path: "EleutherAI/pile",
                dataset_name: None,
                split: None,
                output_type: "loglikelihood_rolling",
                metrics: vec![metric("word_perplexity", 31.5)],
                original: None,
                effective: 2,
            },
        ];
        let run = RunConfig {
            model: "me/m@abc",
            commit: None,
            dtype: Some("float32"),
            batch_size: 1,
            device: Some("cpu"),
            limit: None,
            elapsed_seconds: 1.0,
        };
        let harness = with_blocks(json!({"kind": "tasks"}), blocks(&tasks, &run));
        let imagenet = json!({"kind": "imagenet", "top1": 81.5, "top5": 95.0});
        let index = model_index("m", &[harness, imagenet]).unwrap();
        let results = index[0]["results"].as_array().unwrap();
        assert_eq!(index[0]["name"], "m");
        assert_eq!(results.len(), 3);
        assert_eq!(
            results[0],
            json!({
                "task": {"type": "text-generation"},
                "dataset": {"name": "arc_easy", "type": "allenai/ai2_arc", "config": "ARC-Easy", "split": "test"},
                "metrics": [
                    {"type": "accuracy", "name": "acc", "value": 0.5},
                    {"type": "accuracy", "name": "acc_norm", "value": 0.25},
                ],
            })
        );
        assert_eq!(
            results[1]["dataset"],
            json!({"name": "pile_arxiv", "type": "EleutherAI/pile"})
        );
        assert_eq!(
            results[1]["metrics"],
            json!([{"type": "perplexity", "name": "word_perplexity", "value": 31.5}])
        );
        assert_eq!(results[2]["dataset"]["type"], "ILSVRC/imagenet-1k");
        assert_eq!(
            results[2]["metrics"][0],
            json!({"type": "accuracy", "name": "top1", "value": 81.5})
        );
        assert!(model_index("m", &[json!({"kind": "other"})]).is_err());
    }
}
