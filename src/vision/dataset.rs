//! Labelled image lists for evaluation: the ImageNet `val/<wnid>/*.JPEG`
//! layout (torchvision `ImageFolder`), or a flat folder with a label file —
//! the Kaggle `LOC_val_solution.csv` (`ImageId,PredictionString`, the first
//! token of the prediction string is the wnid) or `file label_index` lines.
//!
//! Folders are walked with symbolic links followed, but each folder (by
//! device and inode) is entered once: a link back to an ancestor (a loop) or
//! a second link to a folder already walked is skipped and reported in
//! [`Dataset::skipped`], so no image is counted twice. Entries with an image
//! extension that are not regular files (FIFOs, sockets, devices, dangling
//! links) are listed like any image and are never opened: decoding refuses
//! them (see `crate::fsutil::open_regular`), so an evaluation lists them as
//! unreadable.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Largest label file read (`LOC_val_solution.csv` of ImageNet is 2 MB).
pub(crate) const MAX_LABELS_FILE_BYTES: u64 = 256 << 20;

/// File extensions read as images (case-insensitive).
pub(crate) const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "webp"];

/// One labelled image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub path: PathBuf,
    pub label: usize,
}

/// The images of an evaluation, sorted by path, and how labels were assigned.
#[derive(Clone, Debug)]
pub struct Dataset {
    pub samples: Vec<Sample>,
    /// Where the class indices came from, for reports.
    pub label_source: String,
    /// Folders not walked because they were walked already (a symlink loop
    /// or a second link to the same folder), with why.
    pub skipped: Vec<String>,
}

impl Dataset {
    /// sha256 of the listing: one line `relative path, size in bytes, label`
    /// per sample, in order (size `-` when it cannot be read). Two runs agree
    /// on it when they saw the same files with the same labels.
    pub fn listing_sha256(&self, root: &Path) -> String {
        let mut h = Sha256::new();
        for s in &self.samples {
            let rel = s.path.strip_prefix(root).unwrap_or(&s.path);
            let size = std::fs::metadata(&s.path).map_or("-".to_string(), |m| m.len().to_string());
            h.update(format!("{}\t{size}\t{}\n", rel.display(), s.label).as_bytes());
        }
        hex(&h.finalize())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn is_image(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| x.eq_ignore_ascii_case(e)))
}

fn read_dir_sorted(dir: &Path) -> Result<Vec<std::fs::DirEntry>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        out.push(entry.map_err(|e| Error::io(dir, e))?);
    }
    out.sort_by_cached_key(|e| e.path());
    Ok(out)
}

/// A folder's identity: device and inode.
#[cfg(unix)]
fn folder_id(meta: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}

#[cfg(not(unix))]
fn folder_id(_meta: &std::fs::Metadata) -> (u64, u64) {
    (0, 0)
}

/// A directory entry as the walk sees it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Folder,
    Repeat,
    Other,
}

/// A walk over folders that enters each folder once.
struct Walker {
    seen: HashSet<(u64, u64)>,
    skipped: Vec<String>,
}

impl Walker {
    /// Starts at `root`, which counts as walked.
    fn new(root: &Path) -> Result<Self> {
        let meta = std::fs::metadata(root).map_err(|e| Error::io(root, e))?;
        Ok(Self {
            seen: HashSet::from([folder_id(&meta)]),
            skipped: Vec::new(),
        })
    }

    /// What `entry` is: a folder not walked before (symlinks followed), a
    /// folder walked before (recorded in `skipped`), or anything else.
    fn classify(&mut self, entry: &std::fs::DirEntry) -> Kind {
        let path = entry.path();
        let Ok(ft) = entry.file_type() else {
            return Kind::Other;
        };
        if !ft.is_dir() && !ft.is_symlink() {
            return Kind::Other;
        }
        let meta = if ft.is_symlink() {
            std::fs::metadata(&path)
        } else {
            entry.metadata()
        };
        match meta {
            Ok(m) if m.is_dir() => {
                if cfg!(unix) && !self.seen.insert(folder_id(&m)) {
                    self.skipped.push(format!(
                        "{}: a folder already walked (a symlink loop or a second link to it), skipped",
                        path.display()
                    ));
                    Kind::Repeat
                } else {
                    Kind::Folder
                }
            }
            _ => Kind::Other,
        }
    }

    /// Image files under `dir`, recursively, sorted (as `ImageFolder` walks a class).
    fn images_under(&mut self, dir: &Path) -> Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for entry in read_dir_sorted(dir)? {
            let p = entry.path();
            match self.classify(&entry) {
                Kind::Folder => out.extend(self.images_under(&p)?),
                Kind::Repeat => {}
                Kind::Other => {
                    if is_image(&p) {
                        out.push(p);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Image files under `dir`, recursively, sorted, each folder walked once
/// (see the module's notes on links).
pub fn images_under(dir: &Path) -> Result<Vec<PathBuf>> {
    Walker::new(dir)?.images_under(dir)
}

/// The images `paths` name, in order: a file as given (whatever its
/// extension: it was asked for), a folder as the images under it
/// ([`images_under`]). A folder with no image in it is an error, so a
/// mistyped path is not a silent empty run.
pub fn image_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::with_capacity(paths.len());
    for p in paths {
        if !p.is_dir() {
            out.push(p.clone());
            continue;
        }
        let found = images_under(p)?;
        if found.is_empty() {
            return Err(Error::input(format!(
                "{}: no image files under this folder (looked for .{})",
                p.display(),
                IMAGE_EXTENSIONS.join(", .")
            )));
        }
        out.extend(found);
    }
    Ok(out)
}

/// Lists `dir`. Without `labels`, `dir` holds one folder per class named by
/// its wnid; a wnid's class index is its position in `class_wnids`, or in the
/// sorted folder names when the model has no list. With `labels`, the images
/// anywhere under `dir` are labelled by that file.
pub fn list(dir: &Path, labels: Option<&Path>, class_wnids: Option<&[String]>) -> Result<Dataset> {
    if !dir.is_dir() {
        return Err(Error::input(format!("{}: not a folder", dir.display())));
    }
    let mut walker = Walker::new(dir)?;
    let mut ds = match labels {
        None => list_class_folders(dir, class_wnids, &mut walker)?,
        Some(l) => list_with_labels(dir, l, class_wnids, &mut walker)?,
    };
    ds.skipped = walker.skipped;
    if ds.samples.is_empty() {
        return Err(Error::input(format!(
            "{}: no images found (looked for {} files{})",
            dir.display(),
            IMAGE_EXTENSIONS.join("/"),
            if labels.is_none() {
                " in its class folders"
            } else {
                ""
            }
        )));
    }
    Ok(ds)
}

fn index_of(class_wnids: &[String]) -> HashMap<&str, usize> {
    class_wnids
        .iter()
        .enumerate()
        .map(|(i, w)| (w.as_str(), i))
        .collect()
}

fn list_class_folders(
    dir: &Path,
    class_wnids: Option<&[String]>,
    walker: &mut Walker,
) -> Result<Dataset> {
    let folders: Vec<PathBuf> = read_dir_sorted(dir)?
        .into_iter()
        .filter_map(|e| (walker.classify(&e) == Kind::Folder).then(|| e.path()))
        .collect();
    let names: Vec<String> = folders
        .iter()
        .map(|p| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    let (index, label_source): (HashMap<&str, usize>, String) = match class_wnids {
        Some(w) => (index_of(w), "the model's class_wnids".into()),
        None => (
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), i))
                .collect(),
            "sorted folder names (the model has no class_wnids)".into(),
        ),
    };
    let mut samples = Vec::new();
    for (folder, name) in folders.iter().zip(&names) {
        let images = walker.images_under(folder)?;
        if images.is_empty() {
            continue;
        }
        let label = *index.get(name.as_str()).ok_or_else(|| {
            Error::input(format!(
                "{}: class folder `{name}` is not among the model's {} class_wnids",
                folder.display(),
                class_wnids.map_or(0, |w| w.len())
            ))
        })?;
        samples.extend(images.into_iter().map(|path| Sample { path, label }));
    }
    Ok(Dataset {
        samples,
        label_source,
        skipped: Vec::new(),
    })
}

fn list_with_labels(
    dir: &Path,
    labels: &Path,
    class_wnids: Option<&[String]>,
    walker: &mut Walker,
) -> Result<Dataset> {
    let text = crate::fsutil::read_to_string_bounded(labels, MAX_LABELS_FILE_BYTES)?;
    let bad = |line: usize, msg: &str| Error::input(format!("{}:{line}: {msg}", labels.display()));
    // Key: file name, or file stem for the CSV (its ImageIds have no extension).
    let mut by_key: HashMap<String, usize> = HashMap::new();
    let is_csv = text
        .lines()
        .next()
        .is_some_and(|l| l.trim_start().starts_with("ImageId"));
    let label_source;
    if is_csv {
        let mut rows = Vec::new();
        for (n, line) in text.lines().enumerate().skip(1) {
            if line.trim().is_empty() {
                continue;
            }
            let (id, pred) = line
                .split_once(',')
                .ok_or_else(|| bad(n + 1, "expected `ImageId,PredictionString`"))?;
            let wnid = pred
                .split_whitespace()
                .next()
                .ok_or_else(|| bad(n + 1, "empty PredictionString"))?;
            rows.push((n + 1, id.trim().to_string(), wnid.to_string()));
        }
        let fallback: Vec<String>;
        let wnids = match class_wnids {
            Some(w) => {
                label_source = format!("{} (wnids → the model's class_wnids)", labels.display());
                w
            }
            None => {
                fallback = rows
                    .iter()
                    .map(|r| r.2.clone())
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect();
                label_source = format!(
                    "{} (sorted wnids of the file; the model has no class_wnids)",
                    labels.display()
                );
                &fallback
            }
        };
        let index = index_of(wnids);
        for (line, id, wnid) in rows {
            let label = *index.get(wnid.as_str()).ok_or_else(|| {
                bad(
                    line,
                    &format!(
                        "wnid `{wnid}` is not among the model's {} class_wnids",
                        wnids.len()
                    ),
                )
            })?;
            by_key.insert(id, label);
        }
    } else {
        label_source = format!("{} (file label_index)", labels.display());
        for (n, line) in text.lines().enumerate() {
            let mut parts = line.split_whitespace();
            let (Some(file), Some(label)) = (parts.next(), parts.next()) else {
                if line.trim().is_empty() {
                    continue;
                }
                return Err(bad(n + 1, "expected `file label_index`"));
            };
            let label: usize = label
                .parse()
                .map_err(|_| bad(n + 1, &format!("label `{label}` is not a class index")))?;
            by_key.insert(file.to_string(), label);
        }
    }
    let mut samples = Vec::new();
    for path in walker.images_under(dir)? {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let stem = path
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let rel = path
            .strip_prefix(dir)
            .map(|r| r.to_string_lossy().into_owned())
            .unwrap_or_default();
        let label = by_key
            .get(&rel)
            .or_else(|| by_key.get(&name))
            .or_else(|| by_key.get(&stem))
            .copied()
            .ok_or_else(|| {
                Error::input(format!(
                    "{}: no label in {}",
                    path.display(),
                    labels.display()
                ))
            })?;
        samples.push(Sample { path, label });
    }
    Ok(Dataset {
        samples,
        label_source,
        skipped: Vec::new(),
    })
}
