//! Safe output for every converter: write into a temporary folder next to
//! `--out`, rename it into place at the end, never touch the input, and refuse
//! to replace an existing non-empty `--out` without `--force`. A converter that
//! fails or is killed leaves no half-written `--out` behind.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// A folder being written; becomes `out` on [`Staging::commit`], vanishes on drop.
pub struct Staging {
    tmp: tempfile::TempDir,
    out: PathBuf,
}

impl Staging {
    pub fn new(out: &Path, force: bool) -> Result<Self> {
        check_target(out, force)?;
        let parent = parent_of(out);
        let name = out
            .file_name()
            .map_or("out".into(), |n| n.to_string_lossy().into_owned());
        let tmp = tempfile::Builder::new()
            .prefix(&format!(".{name}.partial-"))
            .tempdir_in(&parent)
            .with_context(|| format!("cannot create a temporary folder in {}", parent.display()))?;
        Ok(Self {
            tmp,
            out: out.to_path_buf(),
        })
    }

    /// Where to write the files.
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    /// Moves the finished folder to `out` (replacing it only if `--force` allowed that).
    pub fn commit(self) -> Result<PathBuf> {
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
