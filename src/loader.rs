//! From a model name to a loaded model. A name may be a zoo name
//! (`tokenformer-150m`), a Hub repo id (`owner/name[@revision]`) or a local
//! path (a canonical folder, a `.safetensors` file, or an official
//! `pytorch_model.bin` with its yml), as `from_pretrained` accepts in
//! Hugging Face transformers.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use serde_json::Value;

use crate::checkpoint::{self, official, Tensors};
use crate::error::{Error, Result};
use crate::hub::{self, DownloadProgress, HubClient, RepoRef};
use crate::models::tokenformer::{self, TokenFormerLm};
use crate::models::vit::{self, VisionTransformer};
use crate::models::vl::VisionLanguageModel;
use crate::models::{Architecture, ModelConfig};
use crate::zoo::{self, ZooEntry};

pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Where the config comes from.
#[derive(Clone, Debug)]
pub enum ConfigSource {
    /// A canonical `config.json` (already read).
    Json { path: Option<PathBuf>, value: Value },
    /// An official eval yml; `vocab_size` is read from the checkpoint.
    OfficialYml(PathBuf),
}

/// Where the weights are.
#[derive(Clone, Debug)]
pub enum Weights {
    Safetensors(Vec<PathBuf>),
    OfficialBin(PathBuf),
}

/// Everything needed to load a model, found on disk or downloaded.
#[derive(Clone, Debug)]
pub struct ModelFiles {
    /// How the user named it, resolved (`repo@revision`, or a path), for reports.
    pub source: String,
    pub config: ConfigSource,
    pub weights: Weights,
    pub tokenizer: Option<PathBuf>,
}

/// User overrides for finding a model's files.
#[derive(Clone, Debug, Default)]
pub struct LocateOptions {
    /// An official yml or a canonical config.json to use instead of the found one.
    pub config: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    /// Receives the progress of downloads (the library draws nothing itself).
    pub progress: Option<DownloadProgress>,
}

/// Resolves a model name to files on disk, downloading from the Hub if
/// needed (with a client configured from the environment, built only then).
pub fn locate(spec: &str, opts: &LocateOptions) -> Result<ModelFiles> {
    let bundled_or_unknown = zoo::find(spec).is_none_or(|e| e.bundled);
    if Path::new(spec).exists() || (bundled_or_unknown && !is_repo_id(spec)) {
        return locate_with(spec, opts, None);
    }
    locate_with(spec, opts, Some(&HubClient::from_env()?))
}

fn is_repo_id(spec: &str) -> bool {
    spec.contains('/') && !spec.starts_with('.') && !spec.starts_with('/')
}

/// [`locate`] with a Hub client the caller keeps (`None`: local paths only).
pub(crate) fn locate_with(
    spec: &str,
    opts: &LocateOptions,
    hub: Option<&HubClient>,
) -> Result<ModelFiles> {
    let path = Path::new(spec);
    let need_hub = || {
        hub.ok_or_else(|| {
            Error::input(format!(
                "`{spec}` is not a local path and no Hub client was given"
            ))
        })
    };
    let mut files = if path.exists() {
        locate_local(path)?
    } else if let Some(entry) = zoo::find(spec).filter(|e| e.bundled) {
        locate_local(&zoo::bundled_folder(entry)?)?
    } else if let Some(entry) = zoo::find(spec) {
        locate_zoo(need_hub()?, entry, spec, opts.progress.as_ref())?
    } else if is_repo_id(spec) {
        locate_hub(need_hub()?, &RepoRef::parse(spec)?, opts.progress.as_ref())?
    } else {
        return Err(Error::UnknownModel(spec.to_string()));
    };
    if let Some(c) = &opts.config {
        files.config = config_source_from_path(c)?;
    }
    if let Some(t) = &opts.tokenizer {
        files.tokenizer = Some(t.clone());
    }
    Ok(files)
}

/// Paths of the files in a Hub repo.
fn hub_listing(hub: &HubClient, repo: &RepoRef) -> Result<Vec<String>> {
    Ok(hub.list_files(repo)?.into_iter().map(|f| f.path).collect())
}

fn config_source_from_path(p: &Path) -> Result<ConfigSource> {
    match p.extension().and_then(|e| e.to_str()) {
        Some("yml" | "yaml") => Ok(ConfigSource::OfficialYml(p.to_path_buf())),
        _ => Ok(ConfigSource::Json {
            path: Some(p.to_path_buf()),
            value: read_json(p)?,
        }),
    }
}

/// The largest config.json read (with 1000 class names one is about 60 KB).
pub(crate) const MAX_CONFIG_BYTES: u64 = 16 << 20;

pub fn read_json(p: &Path) -> Result<Value> {
    let text = checkpoint::read_text(p, MAX_CONFIG_BYTES)?;
    serde_json::from_str(&text).map_err(|e| Error::config(p, format!("not valid JSON: {e}")))
}

fn existing(p: PathBuf) -> Option<PathBuf> {
    p.exists().then_some(p)
}

/// The one yml beside an official checkpoint, if unambiguous.
fn sibling_yml(dir: &Path) -> Option<PathBuf> {
    let ymls: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yml" | "yaml")))
        .collect();
    (ymls.len() == 1).then(|| ymls[0].clone())
}

fn locate_local(path: &Path) -> Result<ModelFiles> {
    let source = path.display().to_string();
    let dir = if path.is_dir() {
        path
    } else {
        path.parent().unwrap_or(Path::new("."))
    };
    let tokenizer = existing(dir.join(TOKENIZER_FILE));
    let ext = path.extension().and_then(|e| e.to_str());
    let bin = if path.is_dir() {
        existing(path.join("pytorch_model.bin")).filter(|_| !path.join(CONFIG_FILE).exists())
    } else if matches!(ext, Some("bin" | "pt" | "pth")) {
        Some(path.to_path_buf())
    } else {
        None
    };
    if let Some(bin) = bin {
        let config = match sibling_yml(dir) {
            Some(y) => ConfigSource::OfficialYml(y),
            None => match zoo_config_for_dir(dir) {
                Some(value) => ConfigSource::Json { path: None, value },
                None => {
                    return Err(Error::NoOfficialConfig {
                        dir: dir.to_path_buf(),
                    })
                }
            },
        };
        return Ok(ModelFiles {
            source,
            config,
            weights: Weights::OfficialBin(bin),
            tokenizer,
        });
    }
    let config_path = dir.join(CONFIG_FILE);
    if !config_path.exists() {
        return Err(Error::config(
            &config_path,
            "missing: a model folder needs config.json (or an official pytorch_model.bin with its yml)",
        ));
    }
    let weights = if path.is_dir() {
        checkpoint::safetensors_files(path)?
    } else {
        vec![path.to_path_buf()]
    };
    Ok(ModelFiles {
        source,
        config: ConfigSource::Json {
            value: read_json(&config_path)?,
            path: Some(config_path),
        },
        weights: Weights::Safetensors(weights),
        tokenizer,
    })
}

/// A folder named like a released model (`TokenFormer-150M`) gets its zoo config.
fn zoo_config_for_dir(dir: &Path) -> Option<Value> {
    let name = dir.file_name()?.to_str()?;
    zoo::find(name).map(|e| e.config.clone())
}

fn locate_zoo(
    hub: &HubClient,
    entry: &ZooEntry,
    spec: &str,
    progress: Option<&DownloadProgress>,
) -> Result<ModelFiles> {
    let Some(w) = &entry.weights else {
        return Err(Error::NoReleasedWeights(entry.name.clone()));
    };
    // `Haiyang-W/TokenFormer-150M@rev` may override the zoo revision.
    let revision = spec.split_once('@').map_or(w.revision.as_str(), |(_, r)| r);
    let repo = RepoRef::parse(&format!("{}@{revision}", w.repo))?;
    if w.format != "official" {
        return locate_hub(hub, &repo, progress);
    }
    let names: Vec<&str> = w.files.iter().map(String::as_str).collect();
    let paths = hub.download_files(&repo, &names, progress)?;
    let tokenizer = match &entry.tokenizer {
        Some(t) => Some(hub_tokenizer(hub, &repo, t, progress)?),
        None => None,
    };
    Ok(ModelFiles {
        source: format!("{}@{}", w.repo, revision),
        config: ConfigSource::Json {
            path: None,
            value: entry.config.clone(),
        },
        weights: Weights::OfficialBin(paths[0].clone()),
        tokenizer,
    })
}

/// The model repo's own tokenizer.json if it has one, else the zoo's source.
fn hub_tokenizer(
    hub: &HubClient,
    repo: &RepoRef,
    fallback: &zoo::HubFile,
    progress: Option<&DownloadProgress>,
) -> Result<PathBuf> {
    if let Ok(list) = hub_listing(hub, repo) {
        if list.iter().any(|f| f == TOKENIZER_FILE) {
            return Ok(hub.download_files(repo, &[TOKENIZER_FILE], progress)?[0].clone());
        }
    }
    let t = RepoRef::parse(&format!("{}@{}", fallback.repo, fallback.revision))?;
    Ok(hub.download_files(&t, &[fallback.file.as_str()], progress)?[0].clone())
}

fn locate_hub(
    hub: &HubClient,
    repo: &RepoRef,
    progress: Option<&DownloadProgress>,
) -> Result<ModelFiles> {
    let list = hub_listing(hub, repo)?;
    let has = |f: &str| list.iter().any(|x| x == f);
    let source = format!("{}/{}@{}", repo.owner, repo.name, repo.revision);
    if has(CONFIG_FILE) {
        // Shard names come from the repo's index, checked as repo paths, and are read from
        // exactly where they were downloaded; everything from the index's commit.
        let (repo, shards) = if has(checkpoint::SAFETENSORS_INDEX) {
            let idx = hub.download_files(repo, &[checkpoint::SAFETENSORS_INDEX], progress)?;
            let shards = hub::safetensors_index_shards(repo, &idx[0])?;
            let commit = idx[0]
                .parent()
                .and_then(|d| d.file_name())
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_else(|| repo.revision.clone());
            (repo.at(&commit)?, shards)
        } else {
            (repo.clone(), vec![checkpoint::SAFETENSORS_FILE.to_string()])
        };
        let mut want = vec![CONFIG_FILE.to_string()];
        want.extend(shards.iter().cloned());
        if has(TOKENIZER_FILE) {
            want.push(TOKENIZER_FILE.into());
        }
        let names: Vec<&str> = want.iter().map(String::as_str).collect();
        let paths = hub.download_files(&repo, &names, progress)?;
        let config_path = paths[0].clone();
        return Ok(ModelFiles {
            source,
            config: ConfigSource::Json {
                value: read_json(&config_path)?,
                path: Some(config_path),
            },
            weights: Weights::Safetensors(paths[1..=shards.len()].to_vec()),
            tokenizer: has(TOKENIZER_FILE).then(|| paths[shards.len() + 1].clone()),
        });
    }
    if has("pytorch_model.bin") {
        let entry = zoo::find(&format!("{}/{}", repo.owner, repo.name));
        let yml = list
            .iter()
            .find(|f| f.ends_with(".yml") || f.ends_with(".yaml"));
        let config = match (yml, entry) {
            (Some(y), _) => {
                ConfigSource::OfficialYml(hub.download_files(repo, &[y], progress)?[0].clone())
            }
            (None, Some(e)) => ConfigSource::Json {
                path: None,
                value: e.config.clone(),
            },
            (None, None) => return Err(Error::NoHubConfig { repo: source }),
        };
        let bin = hub.download_files(repo, &["pytorch_model.bin"], progress)?[0].clone();
        let tokenizer = if has(TOKENIZER_FILE) {
            Some(hub.download_files(repo, &[TOKENIZER_FILE], progress)?[0].clone())
        } else {
            match entry.and_then(|e| e.tokenizer.as_ref()) {
                Some(t) => Some(hub_tokenizer(hub, repo, t, progress)?),
                None => None,
            }
        };
        return Ok(ModelFiles {
            source,
            config,
            weights: Weights::OfficialBin(bin),
            tokenizer,
        });
    }
    Err(Error::input(format!(
        "{source} has neither config.json (a model folder) nor pytorch_model.bin (official format)"
    )))
}

/// Weights read into memory with canonical names, and the config.
pub struct LoadedWeights {
    pub config: Value,
    pub tensors: Tensors,
    /// Official tensor names that have no canonical home (reported, not used).
    pub ignored: Vec<String>,
    /// The file the weights came from (for error messages).
    pub path: PathBuf,
    /// Where the config came from (for error messages).
    pub config_path: PathBuf,
}

/// The `architecture` string of a raw config (empty when there is none), for
/// code that edits untyped JSON; typed code matches on [`ModelConfig`].
pub fn architecture(config: &Value) -> &str {
    config
        .get("architecture")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// Reads the weights (converted to `dtype` if given) and the canonical config.
pub fn read_weights(
    files: &ModelFiles,
    dtype: Option<DType>,
    device: &Device,
) -> Result<LoadedWeights> {
    match &files.weights {
        Weights::OfficialBin(bin) => {
            // The config is checked before the weights are read: its layer
            // count maps the official names.
            let (num_layers, settings) = match &files.config {
                ConfigSource::Json { value, path } => {
                    let origin = path.clone().unwrap_or_else(|| PathBuf::from(&files.source));
                    match ModelConfig::from_value(value, &origin)? {
                        ModelConfig::Lm(cfg) => (cfg.num_layers, None),
                        // Refused as "not a language model" once read.
                        _ => (0, None),
                    }
                }
                ConfigSource::OfficialYml(y) => {
                    let m = official::read_yml(y)?;
                    // vocab_size comes from the checkpoint; 1 stands in for it.
                    let cfg = official::config_from_settings(&m, y, 1)?;
                    (cfg.num_layers, Some((m, y)))
                }
            };
            let (tensors, ignored) = checkpoint::read_official_bin(bin, num_layers, dtype, device)?;
            let config = match (settings, &files.config) {
                (Some((m, y)), _) => {
                    let vocab = tensors
                        .get("word_embeddings.weight")
                        .ok_or_else(|| {
                            Error::checkpoint(
                                bin,
                                "missing tensor `sequential.0.word_embeddings.weight`",
                            )
                        })?
                        .dim(0)?;
                    serde_json::to_value(official::config_from_settings(&m, y, vocab)?)
                        .map_err(|e| Error::config(y, e))?
                }
                (None, ConfigSource::Json { value, .. }) => value.clone(),
                (None, ConfigSource::OfficialYml(y)) => {
                    return Err(Error::config(y, "the official config was not read"))
                }
            };
            let config_path = match &files.config {
                ConfigSource::Json { path: Some(p), .. } => p.clone(),
                ConfigSource::Json { path: None, .. } => {
                    PathBuf::from(format!("{} (built-in config)", files.source))
                }
                ConfigSource::OfficialYml(y) => y.clone(),
            };
            Ok(LoadedWeights {
                config,
                tensors,
                ignored,
                path: bin.clone(),
                config_path,
            })
        }
        Weights::Safetensors(paths) => {
            let ConfigSource::Json { value, path } = &files.config else {
                return Err(Error::config(
                    paths.first().map_or(Path::new("."), |p| p.as_path()),
                    "safetensors weights need a canonical config.json, not an official yml",
                ));
            };
            Ok(LoadedWeights {
                config: value.clone(),
                tensors: checkpoint::read_safetensors(paths, dtype, device)?,
                ignored: vec![],
                path: paths.first().cloned().unwrap_or_default(),
                config_path: path.clone().unwrap_or_else(|| PathBuf::from(&files.source)),
            })
        }
    }
}

/// Parses `value` (read from `origin`) as the config of architecture `A`;
/// errors name the file and the architecture found.
pub fn config<A: Architecture>(value: &Value, origin: &Path) -> Result<A::Config> {
    let cfg = ModelConfig::from_value(value, origin)?;
    A::Config::try_from(cfg).map_err(|other| not_a::<A>(&other, origin))
}

fn not_a<A: Architecture>(found: &ModelConfig, origin: &Path) -> Error {
    Error::config(
        origin,
        format!(
            "architecture `{}` is not {} (`{}`)",
            found.architecture(),
            A::WHAT,
            A::ARCHITECTURE
        ),
    )
}

/// Builds a model of architecture `A` from loaded weights: from a checkpoint
/// of its own architecture or of one it is part of (a merged model's route).
/// Every tensor must be used: one left over means the config and the
/// checkpoint disagree. Errors name the config or the checkpoint.
pub(crate) fn build<A: Architecture>(w: LoadedWeights, device: &Device) -> Result<A> {
    let cfg = ModelConfig::from_value(&w.config, &w.config_path)?;
    build_from::<A>(&cfg, w, device)
}

fn build_from<A: Architecture>(cfg: &ModelConfig, w: LoadedWeights, device: &Device) -> Result<A> {
    let (vb, untaken) = checkpoint::hand_over(w.tensors, device);
    let model = A::from_model_config(cfg, vb)
        .ok_or_else(|| not_a::<A>(cfg, &w.config_path))?
        .map_err(|e| Error::checkpoint(&w.path, e))?;
    let skip = A::unused_prefix(cfg);
    let unused: Vec<String> = untaken
        .names()
        .into_iter()
        .filter(|n| !skip.is_some_and(|p| n.starts_with(p)))
        .collect();
    if let Some(first) = unused.first() {
        return Err(Error::checkpoint(
            &w.path,
            format!(
                "{} tensor(s) not used by the config, e.g. `{first}`: the config does not match the checkpoint",
                unused.len()
            ),
        ));
    }
    Ok(model)
}

/// Loads a model of architecture `A` (f32 weights and compute on `device`).
pub fn load<A: Architecture>(files: &ModelFiles, device: &Device) -> Result<A> {
    build(read_weights(files, Some(DType::F32), device)?, device)
}

/// [`config`] for the language model.
pub fn lm_config(value: &Value, origin: &Path) -> Result<tokenformer::Config> {
    config::<TokenFormerLm>(value, origin)
}

/// [`config`] for the image classifier.
pub fn vit_config(value: &Value, origin: &Path) -> Result<vit::Config> {
    config::<VisionTransformer>(value, origin)
}

/// `build` for the language model.
pub fn build_lm(w: LoadedWeights, device: &Device) -> Result<TokenFormerLm> {
    build(w, device)
}

/// `build` for the image classifier.
pub fn build_vit(w: LoadedWeights, device: &Device) -> Result<VisionTransformer> {
    build(w, device)
}

/// `build` for the merged vision-language model.
pub fn build_vl(w: LoadedWeights, device: &Device) -> Result<VisionLanguageModel> {
    build(w, device)
}

/// Loads a language model by name, f32 weights and compute on `device`.
pub fn load_lm(files: &ModelFiles, device: &Device) -> Result<TokenFormerLm> {
    load_lm_as(files, device, DType::F32)
}

/// Loads a language model keeping its weight matrices in `weights` precision:
/// f32, or f16 for half the memory and half the bytes read per decoded
/// token. Compute is f32 either way, so an fp16 checkpoint (every released
/// one) gives the same results in both.
pub fn load_lm_as(files: &ModelFiles, device: &Device, weights: DType) -> Result<TokenFormerLm> {
    lm_from_weights(read_weights(files, Some(weights), device)?, device)
}

/// Loads a language model computing in `dtype` on `device` (f32; bf16 or
/// f16 on a GPU; f64 for numerical checks), its weights read in that dtype.
/// Reductions stay in f32 ([`TokenFormerLm::with_compute_dtype`]).
pub fn load_lm_in(files: &ModelFiles, device: &Device, dtype: DType) -> Result<TokenFormerLm> {
    lm_from_weights(read_weights(files, Some(dtype), device)?, device)?.with_compute_dtype(dtype)
}

/// Loads a language model with its weight matrices quantised to 8 bits
/// (see [`TokenFormerLm::quantize_q8`]; the products quantise their
/// activations alike, [`crate::kernels::q8`]).
/// The checkpoint is read in its own precision when that is f16 or f32
/// throughout (f16 widens to f32 exactly, and an fp16 release then peaks at
/// half its f32 size while quantising), otherwise as f32.
pub fn load_lm_q8(files: &ModelFiles, device: &Device) -> Result<TokenFormerLm> {
    let mut w = read_weights(files, None, device)?;
    let first = w.tensors.values().next().map(|t| t.dtype());
    let uniform = first.is_some_and(|d| {
        matches!(d, DType::F16 | DType::F32) && w.tensors.values().all(|t| t.dtype() == d)
    });
    if !uniform {
        for t in w.tensors.values_mut() {
            *t = t.to_dtype(DType::F32)?;
        }
    }
    let path = w.path.clone();
    lm_from_weights(w, device)?
        .quantize_q8()
        .map_err(|e| Error::checkpoint(&path, e))
}

fn lm_from_weights(w: LoadedWeights, device: &Device) -> Result<TokenFormerLm> {
    let cfg = ModelConfig::from_value(&w.config, &w.config_path)?;
    build_from(&cfg, w, device)
}

/// The tokenizer of a model, with a clear error when there is none.
pub fn load_tokenizer(files: &ModelFiles) -> Result<tokenizers::Tokenizer> {
    let Some(path) = &files.tokenizer else {
        // A classifier has no tokenizer to pass: what is wrong is the model.
        if let ConfigSource::Json { value, path } = &files.config {
            if architecture(value) == vit::ARCHITECTURE {
                let origin = path.clone().unwrap_or_else(|| PathBuf::from(&files.source));
                let found = ModelConfig::from_value(value, &origin)?;
                return Err(not_a::<TokenFormerLm>(&found, &origin));
            }
        }
        return Err(Error::NoTokenizer {
            model: files.source.clone(),
        });
    };
    tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer {
        path: path.clone(),
        msg: e.to_string(),
    })
}

/// Loads a TokenFormer-ViT image classifier (or a merged model's vision
/// route), f32 compute on `device`.
pub fn load_vit(files: &ModelFiles, device: &Device) -> Result<VisionTransformer> {
    load(files, device)
}

/// [`load_vit`] computing in `dtype`, as [`load_lm_in`].
pub fn load_vit_in(files: &ModelFiles, device: &Device, dtype: DType) -> Result<VisionTransformer> {
    build::<VisionTransformer>(read_weights(files, Some(dtype), device)?, device)?
        .with_compute_dtype(dtype)
}

/// Loads a merged vision-language model (`tokenformer-vl`), f32 compute on `device`.
pub fn load_vl(files: &ModelFiles, device: &Device) -> Result<VisionLanguageModel> {
    load(files, device)
}

/// [`load_vl`] with the weights kept in `weights` (f32 compute), as [`load_lm_as`].
pub fn load_vl_as(
    files: &ModelFiles,
    device: &Device,
    weights: DType,
) -> Result<VisionLanguageModel> {
    build(read_weights(files, Some(weights), device)?, device)
}

/// [`load_vl`] computing in `dtype`, as [`load_lm_in`].
pub fn load_vl_in(
    files: &ModelFiles,
    device: &Device,
    dtype: DType,
) -> Result<VisionLanguageModel> {
    build::<VisionLanguageModel>(read_weights(files, Some(dtype), device)?, device)?
        .with_compute_dtype(dtype)
}
