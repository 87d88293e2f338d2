//! What a TokenFormer calibrates on and is measured on against its source
//! (`tokenformer-convert import`, `tokenformer train --distill-from`): the user's
//! photos and text, or else the real samples shipped in `assets/samples`
//! (compiled in, so the tools need no files of their own at run time).
//!
//! Text is a `.txt` file read whole, or the `text` field of the documents of a
//! `.jsonl`, `.jsonl.zst` or `.parquet` file streamed by eval's readers
//! ([`crate::eval::data`]), up to [`MAX_TEXT_BYTES`]; photos are a folder's image
//! files, the first [`MAX_IMAGES`] by path. Either may be on the Hub as
//! `hf://datasets/OWNER/NAME[@REVISION]/PATH` (a file; for photos a folder, or the
//! whole repo without a PATH), fetched into the Hugging Face cache as `eval` fetches
//! its data: for photos, only the files taken.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::eval::data::{DataFile, JsonLines, DEFAULT_MAX_LINE_BYTES};
use crate::hub::dataset as hub_data;
use crate::vision::{self, RgbImage};

/// Which half of the data: the fitted constants' or the report's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Calibration,
    Eval,
}

macro_rules! photos {
    ($dir:literal: $($name:literal),* $(,)?) => {
        &[$(($name, include_bytes!(concat!("../../assets/samples/photos/", $dir, "/", $name)) as &[u8])),*]
    };
}

const CALIBRATION_PHOTOS: &[(&str, &[u8])] = photos!("calibration":
    "astronaut-face.jpg", "astronaut-suit.jpg", "astronaut.jpg", "hubble.jpg",
    "ihc-strip.jpg", "ihc.jpg", "rocket-tower.jpg", "rocket.jpg");
const EVAL_PHOTOS: &[(&str, &[u8])] = photos!("eval":
    "chelsea-face.jpg", "chelsea.jpg", "coffee-cup.jpg", "coffee.jpg",
    "grace-hopper-face.jpg", "grace-hopper.jpg", "retina-detail.jpg", "retina.jpg");
const CALIBRATION_TEXT: &str = include_str!("../../assets/samples/text/calibration.txt");
const EVAL_TEXT: &str = include_str!("../../assets/samples/text/eval.txt");

/// What a split counts: images, or tokens of text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    Images,
    Tokens,
}

impl std::fmt::Display for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unit::Images => "images",
            Unit::Tokens => "tokens",
        })
    }
}

/// Where a split's data came from, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct DataInfo {
    /// A path the user gave, or `shipped samples (assets/samples/...)`.
    pub source: String,
    /// True when the user gave no data of their own.
    pub shipped: bool,
    /// Images, or tokens of text.
    pub items: usize,
    pub unit: Unit,
    /// Anything the reader must know (no tokenizer, truncated, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// One image: shipped bytes or a file, decoded when its batch is run.
#[derive(Clone)]
enum ImageRef {
    Shipped(&'static str, &'static [u8]),
    File(PathBuf),
}

/// A split's images, listed but not yet decoded.
#[derive(Clone)]
pub struct Images {
    refs: Vec<ImageRef>,
    pub info: DataInfo,
}

/// The most images a split takes (the first by path): every one runs through the
/// source and the TokenFormer, so a dataset of a million photos is not read whole.
pub const MAX_IMAGES: usize = 2048;

/// A `hf://datasets/…` reference, if `p` is one.
fn hub_spec(p: &Path) -> Option<&str> {
    // Any hf:// scheme, so that hf://models/… is refused by the parser, not read as a path.
    p.to_str().filter(|s| s.starts_with("hf://"))
}

/// `flag`'s error for a Hub reference that failed.
fn hub_error(flag: &str, spec: &str, e: impl std::fmt::Display) -> Error {
    Error::input(format!("{flag} {spec}: {e}"))
}

impl Images {
    /// The images under `dir` (recursively, sorted; a Hub dataset's folder), the first
    /// [`MAX_IMAGES`], or the shipped samples of `split`.
    pub fn new(dir: Option<&Path>, flag: &str, split: Split) -> Result<Self> {
        let Some(dir) = dir else {
            let (sub, list) = match split {
                Split::Calibration => ("calibration", CALIBRATION_PHOTOS),
                Split::Eval => ("eval", EVAL_PHOTOS),
            };
            return Ok(Self {
                refs: list.iter().map(|(n, b)| ImageRef::Shipped(n, b)).collect(),
                info: DataInfo {
                    source: format!("shipped samples (assets/samples/photos/{sub})"),
                    shipped: true,
                    items: list.len(),
                    unit: Unit::Images,
                    note: None,
                },
            });
        };
        let (files, found, source) = match hub_spec(dir) {
            Some(spec) => {
                let client = crate::HubClient::from_env().map_err(|e| hub_error(flag, spec, e))?;
                let (files, found) = hub_data::fetch_some_under_with(
                    &client,
                    spec,
                    |f| vision::dataset::is_image(Path::new(f)),
                    MAX_IMAGES,
                )
                .map_err(|e| hub_error(flag, spec, e))?;
                (files, found, spec.to_string())
            }
            None => {
                if !dir.is_dir() {
                    bail!("{flag} {}: not a folder", dir.display());
                }
                let mut files = vision::dataset::images_under(dir)
                    .map_err(|e| Error::input(format!("{flag}: {e}")))?;
                let found = files.len();
                files.truncate(MAX_IMAGES);
                (files, found, dir.display().to_string())
            }
        };
        if files.is_empty() {
            bail!("{flag} {source}: no images found (looked for .jpg/.jpeg/.png/.webp files)");
        }
        let note = (found > files.len()).then(|| {
            format!(
                "the first {} of {found} images (sorted by path): at most {MAX_IMAGES} are taken",
                files.len()
            )
        });
        Ok(Self {
            info: DataInfo {
                source,
                shipped: false,
                items: files.len(),
                unit: Unit::Images,
                note,
            },
            refs: files.into_iter().map(ImageRef::File).collect(),
        })
    }

    pub fn len(&self) -> usize {
        self.refs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.refs.is_empty()
    }

    /// The first `n` images only.
    pub fn first(mut self, n: usize) -> Self {
        self.refs.truncate(n);
        self.info.items = self.refs.len();
        self
    }

    /// The file name (shipped) or path of image `i`.
    pub fn name(&self, i: usize) -> String {
        match &self.refs[i] {
            ImageRef::Shipped(n, _) => n.to_string(),
            ImageRef::File(p) => p.display().to_string(),
        }
    }

    /// Decodes image `i` as Pillow's `convert("RGB")` does.
    pub fn decode(&self, i: usize) -> Result<RgbImage> {
        match &self.refs[i] {
            ImageRef::Shipped(n, b) => vision::decode_bytes(b)
                .map_err(|e| Error::input(format!("shipped sample {n}: {e}"))),
            ImageRef::File(p) => Ok(vision::open_rgb(p)?),
        }
    }
}

/// The most text a split takes: far more than an import's windows score, and still
/// bounded. A `.txt` file past it is refused; documents of a `.jsonl` or `.parquet`
/// file are taken whole until the next would pass it.
pub const MAX_TEXT_BYTES: u64 = 64 << 20;

/// A split's text: the user's file or the shipped page.
pub struct Text {
    pub text: String,
    pub source: String,
    pub shipped: bool,
    /// What was left out (documents past [`MAX_TEXT_BYTES`]), for the report.
    pub note: Option<String>,
}

impl Text {
    /// The text of `file` (local, or `hf://datasets/…`), or the shipped page of `split`.
    pub fn new(file: Option<&Path>, flag: &str, split: Split) -> Result<Self> {
        let Some(p) = file else {
            let (text, name) = match split {
                Split::Calibration => (CALIBRATION_TEXT, "calibration.txt"),
                Split::Eval => (EVAL_TEXT, "eval.txt"),
            };
            return Ok(Self {
                text: text.to_string(),
                source: format!("shipped samples (assets/samples/text/{name})"),
                shipped: true,
                note: None,
            });
        };
        let (local, source) = match hub_spec(p) {
            Some(spec) => (
                hub_data::fetch(spec).map_err(|e| hub_error(flag, spec, e))?,
                spec.to_string(),
            ),
            None => (p.to_path_buf(), p.display().to_string()),
        };
        let (text, note) = read_text(&local, flag, &source)?;
        if text.trim().is_empty() {
            bail!("{flag} {source}: the file is empty");
        }
        Ok(Self {
            text,
            source,
            shipped: false,
            note,
        })
    }

    /// Literal text given on the command line (`--probe-text`).
    pub fn literal(text: &str) -> Self {
        Self {
            text: text.to_string(),
            source: "--probe-text".into(),
            shipped: false,
            note: None,
        }
    }
}

/// Token ids of `text` by the tokenizer.json at `tokenizer`, checked to be at least
/// 2 and inside a vocabulary of `vocab` (`flag` names the text in messages).
pub fn text_ids(tokenizer: &Path, text: &Text, flag: &str, vocab: usize) -> Result<Vec<u32>> {
    let files = crate::loader::ModelFiles {
        source: tokenizer.display().to_string(),
        config: crate::loader::ConfigSource::Json {
            path: None,
            value: serde_json::Value::Null,
        },
        weights: crate::loader::Weights::Safetensors(vec![]),
        tokenizer: Some(tokenizer.to_path_buf()),
    };
    let t = crate::loader::load_tokenizer(&files)?;
    let ids = t
        .encode(text.text.as_str(), false)
        .map_err(|e| Error::Tokenizer {
            path: tokenizer.to_path_buf(),
            msg: format!("cannot tokenize {flag} {}: {e}", text.source),
        })?
        .get_ids()
        .to_vec();
    if ids.len() < 2 {
        bail!("{flag} {}: fewer than 2 tokens", text.source);
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!(
            "{flag} {}: token id {bad} is outside the source's vocabulary ({vocab}): does {} belong to this model?",
            text.source,
            tokenizer.display()
        );
    }
    Ok(ids)
}

/// The text of a local file: a `.txt` whole (refused past [`MAX_TEXT_BYTES`]), or
/// the `text` fields of a `.jsonl`, `.jsonl.zst` or `.parquet` file's documents,
/// joined by blank lines, streamed until the next would pass [`MAX_TEXT_BYTES`]
/// (with a note saying so).
fn read_text(path: &Path, flag: &str, source: &str) -> Result<(String, Option<String>)> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let documents = [".jsonl", ".jsonl.zst", ".parquet"];
    if !documents.iter().any(|e| name.ends_with(e)) {
        let text = crate::fsutil::read_to_string_bounded(path, MAX_TEXT_BYTES)
            .map_err(|e| Error::input(format!("{flag} {source}: cannot read it as text: {e}")))?;
        return Ok((text, None));
    }
    let bad = |e: Error| Error::input(format!("{flag} {source}: {e}"));
    let lines = JsonLines::new(DataFile::open_with(path, DEFAULT_MAX_LINE_BYTES).map_err(bad)?);
    let (mut text, mut taken) = (String::new(), 0usize);
    for line in lines {
        let (n, value) = line.map_err(bad)?;
        let doc = value.map_err(|why| Error::input(format!("{flag} {source} line {n}: {why}")))?;
        let Some(doc) = doc.get("text").and_then(|t| t.as_str()) else {
            bail!("{flag} {source} line {n}: no string field `text` (each document's text is read from it)");
        };
        let sep = if text.is_empty() { "" } else { "\n\n" };
        if (text.len() + sep.len() + doc.len()) as u64 > MAX_TEXT_BYTES {
            let note = format!(
                "the first {taken} documents ({} bytes): the next would pass the limit of {MAX_TEXT_BYTES} bytes",
                text.len()
            );
            return Ok((text, Some(note)));
        }
        text.push_str(sep);
        text.push_str(doc);
        taken += 1;
    }
    Ok((text, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_files_past_the_limit_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let refusal = |name: &str, flag: &str, split: Split| {
            let err = Text::new(Some(&dir.path().join(name)), flag, split).err();
            format!("{:#}", err.expect("refused"))
        };
        // Sparse: the size is checked before anything is read.
        std::fs::File::create(dir.path().join("huge.txt"))
            .unwrap()
            .set_len(MAX_TEXT_BYTES + 1)
            .unwrap();
        let err = refusal("huge.txt", "--eval-text", Split::Eval);
        assert!(
            err.contains("--eval-text") && err.contains("huge.txt"),
            "{err}"
        );
        let limit = format!("limit of {MAX_TEXT_BYTES} bytes");
        assert!(err.contains(&limit), "{err}");
        std::fs::write(dir.path().join("bad.txt"), b"ok \xff").unwrap();
        let err = refusal("bad.txt", "--calibration-text", Split::Calibration);
        assert!(
            err.contains("--calibration-text") && err.contains("not UTF-8"),
            "{err}"
        );
    }

    #[test]
    fn shipped_samples_decode() {
        for split in [Split::Calibration, Split::Eval] {
            let im = Images::new(None, "--x", split).unwrap();
            assert_eq!(im.len(), 8);
            for i in 0..im.len() {
                let d = im.decode(i).unwrap();
                assert!(d.width.max(d.height) == 160, "{}", im.name(i));
            }
        }
        assert!(Text::new(None, "--x", Split::Eval)
            .unwrap()
            .text
            .contains("Naomi"));
    }
}
