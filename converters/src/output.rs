//! Safe output for every converter: write into a temporary folder next to
//! `--out`, rename it into place at the end, never touch the input, and refuse
//! to replace an existing non-empty `--out` without `--force`. A converter that
//! fails or is killed leaves no half-written `--out` behind. [`ModelFolder`] is
//! the one writer of a model folder (config.json, safetensors, tokenizer.json,
//! model card).

use std::path::{Path, PathBuf};

use crate::stdout::outln;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use tokenformer::card::ModelCard;
use tokenformer::checkpoint::{self, Tensors};
use tokenformer::loader::{self, ModelFiles};

/// A hidden temporary folder beside `out` (same filesystem, so a rename moves its
/// contents into place); removed on drop.
pub fn staging_dir(out: &Path) -> Result<tempfile::TempDir> {
    let parent = parent_of(out);
    let name = out
        .file_name()
        .map_or("out".into(), |n| n.to_string_lossy().into_owned());
    tempfile::Builder::new()
        .prefix(&format!(".{name}.partial-"))
        .tempdir_in(&parent)
        .with_context(|| format!("cannot create a temporary folder in {}", parent.display()))
}

/// Test hook: with `TOKENFORMER_CONVERT_ABORT_BEFORE_COMMIT` set, die like a killed
/// process would, without any cleanup, just before the output is moved into place.
pub fn abort_hook() {
    if std::env::var_os("TOKENFORMER_CONVERT_ABORT_BEFORE_COMMIT").is_some() {
        std::process::exit(137);
    }
}

/// A model folder being written; becomes `out` on [`ModelFolder::commit`], vanishes on
/// drop.
pub struct ModelFolder {
    tmp: tempfile::TempDir,
    out: PathBuf,
}

impl ModelFolder {
    /// Checks `out` (see [`check_target`]) and creates the folder to write into.
    pub fn new(out: &Path, force: bool) -> Result<Self> {
        check_target(out, force)?;
        Ok(Self {
            tmp: staging_dir(out)?,
            out: out.to_path_buf(),
        })
    }

    /// Where the files are written.
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    /// `name` as pretty-printed JSON with a final newline.
    pub fn write_json<T: Serialize + ?Sized>(&self, name: &str, value: &T) -> Result<()> {
        let path = self.path().join(name);
        std::fs::write(&path, serde_json::to_string_pretty(value)? + "\n")
            .with_context(|| format!("writing {}", path.display()))
    }

    /// `config.json`.
    pub fn write_config<T: Serialize + ?Sized>(&self, config: &T) -> Result<()> {
        self.write_json(loader::CONFIG_FILE, config)
    }

    /// The weights as safetensors (sharded above `max_shard_bytes`); the files written.
    pub fn write_weights(&self, tensors: &Tensors, max_shard_bytes: u64) -> Result<Vec<PathBuf>> {
        Ok(checkpoint::write_safetensors(
            self.path(),
            tensors,
            max_shard_bytes,
        )?)
    }

    /// A copy of `tokenizer` as `tokenizer.json`, if there is one.
    pub fn copy_tokenizer(&self, tokenizer: Option<&Path>) -> Result<()> {
        if let Some(t) = tokenizer {
            std::fs::copy(t, self.path().join(loader::TOKENIZER_FILE))
                .with_context(|| format!("copying {}", t.display()))?;
        }
        Ok(())
    }

    /// The folder as written so far, found the way users will find it.
    pub fn files(&self) -> Result<ModelFiles> {
        Ok(loader::locate(
            &self.path().display().to_string(),
            &Default::default(),
        )?)
    }

    /// Writes the model card and moves the folder into place.
    pub fn finish(self, card: &ModelCard) -> Result<PathBuf> {
        card.write(self.path())?;
        self.commit()
    }

    /// [`ModelFolder::finish`], then says where the folder is.
    pub fn finish_and_say(self, card: &ModelCard) -> Result<()> {
        let out = self.finish(card)?;
        outln!("wrote {}", out.display())?;
        Ok(())
    }

    /// Moves the finished folder to `out` (replacing it only if `--force` allowed that).
    pub fn commit(self) -> Result<PathBuf> {
        abort_hook();
        default_permissions(self.tmp.path())?;
        let tmp = self.tmp.keep();
        if self.out.exists() {
            let old = tmp.with_extension("old");
            std::fs::rename(&self.out, &old)
                .with_context(|| format!("cannot move the old {} aside", self.out.display()))?;
            std::fs::rename(&tmp, &self.out)
                .with_context(|| format!("cannot create {}", self.out.display()))?;
            let _ = if old.is_dir() {
                std::fs::remove_dir_all(&old)
            } else {
                std::fs::remove_file(&old)
            };
        } else {
            std::fs::rename(&tmp, &self.out)
                .with_context(|| format!("cannot create {}", self.out.display()))?;
        }
        Ok(self.out)
    }
}

fn parent_of(out: &Path) -> PathBuf {
    match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Refuses an existing non-empty target without `--force`, and a missing parent.
pub fn check_target(out: &Path, force: bool) -> Result<()> {
    let parent = parent_of(out);
    if !parent.is_dir() {
        bail!(
            "cannot write {}: the folder {} does not exist",
            out.display(),
            parent.display()
        );
    }
    let non_empty = if out.is_dir() {
        std::fs::read_dir(out)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    } else {
        out.exists()
    };
    if non_empty && !force {
        bail!(
            "refusing to overwrite {}: it exists and is not empty (pass --force to replace it)",
            out.display()
        );
    }
    Ok(())
}

/// [`check_not_input`] for every file a model was read from, and its folder unless it
/// was named as one file.
pub fn check_not_inputs(out: &Path, files: &ModelFiles) -> Result<()> {
    for p in input_paths(files) {
        check_not_input(out, &p)?;
    }
    Ok(())
}

/// The files a model was read from, and its folder unless it was named as one file: none
/// of them may be written into.
fn input_paths(files: &ModelFiles) -> Vec<PathBuf> {
    let mut v = match &files.weights {
        loader::Weights::Safetensors(p) => p.clone(),
        loader::Weights::OfficialBin(p) => vec![p.clone()],
    };
    // A model named as a folder (or found in the Hub cache) owns its whole folder; one
    // named as a single weights file owns only its files.
    if !Path::new(&files.source).is_file() {
        let folders: Vec<PathBuf> = v
            .iter()
            .filter_map(|p| p.parent().map(Path::to_path_buf))
            .collect();
        v.extend(folders);
    }
    if let loader::ConfigSource::OfficialYml(y) = &files.config {
        v.push(y.clone());
    }
    v.extend(files.tokenizer.clone());
    v
}

/// Fails if `out` is, holds or lies inside `input`, so the input is never modified (nor
/// gains files). Paths are compared after resolving links, also for an `out` that does not
/// exist yet.
pub fn check_not_input(out: &Path, input: &Path) -> Result<()> {
    let (o, i) = (resolve(out)?, resolve(input)?);
    if o.starts_with(&i) || i.starts_with(&o) {
        bail!(
            "--out {} would overwrite the input {} (converters never write into their input; choose a path outside it)",
            out.display(),
            input.display()
        );
    }
    Ok(())
}

/// The absolute path `p` names: its deepest existing ancestor canonicalised, the rest
/// appended (refusing `..` there, which could climb out again after a link).
fn resolve(p: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(p).with_context(|| format!("cannot resolve {}", p.display()))?;
    let mut rest = Vec::new();
    let mut base = abs.as_path();
    loop {
        if let Ok(c) = std::fs::canonicalize(base) {
            let mut out = c;
            for part in rest.iter().rev() {
                out.push(part);
            }
            return Ok(out);
        }
        match (base.parent(), base.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                base = parent;
            }
            _ => bail!(
                "cannot resolve {} (it has a '..' after a missing folder)",
                p.display()
            ),
        }
    }
}

/// Every file and folder under `root` (and `root`) gets the mode a plain create would
/// give it: the staging folder and safetensors' temporary files are private.
fn default_permissions(root: &Path) -> Result<()> {
    tokenformer::checkpoint::set_default_permissions(root)?;
    for entry in std::fs::read_dir(root).with_context(|| format!("listing {}", root.display()))? {
        let entry = entry?;
        let ty = entry.file_type()?;
        if ty.is_dir() {
            default_permissions(&entry.path())?;
        } else if ty.is_file() {
            tokenformer::checkpoint::set_default_permissions(&entry.path())?;
        }
    }
    Ok(())
}
