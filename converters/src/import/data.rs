//! What an import calibrates on and is measured on: the user's photos and text
//! (`--calibration-images`/`--eval-images` folders, `--calibration-text`/
//! `--eval-text` files), or else the real samples shipped in `assets/samples`
//! (compiled in, so the tool needs no files of its own at run time).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use tokenformer::vision::{self, RgbImage};

/// Which half of the data: the fitted constants' or the report's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Calibration,
    Eval,
}

macro_rules! photos {
    ($dir:literal: $($name:literal),* $(,)?) => {
        &[$(($name, include_bytes!(concat!("../../../assets/samples/photos/", $dir, "/", $name)) as &[u8])),*]
    };
}

const CALIBRATION_PHOTOS: &[(&str, &[u8])] = photos!("calibration":
    "astronaut-face.jpg", "astronaut-suit.jpg", "astronaut.jpg", "hubble.jpg",
    "ihc-strip.jpg", "ihc.jpg", "rocket-tower.jpg", "rocket.jpg");
const EVAL_PHOTOS: &[(&str, &[u8])] = photos!("eval":
    "chelsea-face.jpg", "chelsea.jpg", "coffee-cup.jpg", "coffee.jpg",
    "grace-hopper-face.jpg", "grace-hopper.jpg", "retina-detail.jpg", "retina.jpg");
const CALIBRATION_TEXT: &str = include_str!("../../../assets/samples/text/calibration.txt");
const EVAL_TEXT: &str = include_str!("../../../assets/samples/text/eval.txt");

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
enum ImageRef {
    Shipped(&'static str, &'static [u8]),
    File(PathBuf),
}

/// A split's images, listed but not yet decoded.
pub struct Images {
    refs: Vec<ImageRef>,
    pub info: DataInfo,
}

impl Images {
    /// The images under `dir` (recursively, sorted), or the shipped samples of `split`.
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
        if !dir.is_dir() {
            bail!("{flag} {}: not a folder", dir.display());
        }
        let files = vision::dataset::images_under(dir).with_context(|| flag.to_string())?;
        if files.is_empty() {
            bail!(
                "{flag} {}: no images found (looked for .jpg/.jpeg/.png/.webp files)",
                dir.display()
            );
        }
        Ok(Self {
            info: DataInfo {
                source: dir.display().to_string(),
                shipped: false,
                items: files.len(),
                unit: Unit::Images,
                note: None,
            },
            refs: files.into_iter().map(ImageRef::File).collect(),
        })
    }

    pub fn len(&self) -> usize {
        self.refs.len()
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
            ImageRef::Shipped(n, b) => {
                vision::decode_bytes(b).map_err(|e| anyhow!("shipped sample {n}: {e}"))
            }
            ImageRef::File(p) => Ok(vision::open_rgb(p)?),
        }
    }
}

/// The largest `--calibration-text` / `--eval-text` file: far more text than
/// an import's windows score, and still bounded.
pub const MAX_TEXT_BYTES: u64 = 64 << 20;

/// A split's text: the user's file or the shipped page.
pub struct Text {
    pub text: String,
    pub source: String,
    pub shipped: bool,
}

impl Text {
    pub fn new(file: Option<&Path>, flag: &str, split: Split) -> Result<Self> {
        match file {
            None => {
                let (text, name) = match split {
                    Split::Calibration => (CALIBRATION_TEXT, "calibration.txt"),
                    Split::Eval => (EVAL_TEXT, "eval.txt"),
                };
                Ok(Self {
                    text: text.to_string(),
                    source: format!("shipped samples (assets/samples/text/{name})"),
                    shipped: true,
                })
            }
            Some(p) => {
                let text = tokenformer::fsutil::read_to_string_bounded(p, MAX_TEXT_BYTES)
                    .with_context(|| format!("{flag} {}: cannot read it as text", p.display()))?;
                if text.trim().is_empty() {
                    bail!("{flag} {}: the file is empty", p.display());
                }
                Ok(Self {
                    text,
                    source: p.display().to_string(),
                    shipped: false,
                })
            }
        }
    }

    /// Literal text given on the command line (`--probe-text`).
    pub fn literal(text: &str) -> Self {
        Self {
            text: text.to_string(),
            source: "--probe-text".into(),
            shipped: false,
        }
    }
}

/// What a sample of `n` items with `agree` top-1 agreements can tell: the 95 %
/// Wilson interval of the agreement.
pub fn agreement_interval(agree: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, nf) = (1.959_963_984_540_054_f64, n as f64);
    let p = agree as f64 / nf;
    let denom = 1.0 + z * z / nf;
    let centre = (p + z * z / (2.0 * nf)) / denom;
    let half = z * (p * (1.0 - p) / nf + z * z / (4.0 * nf * nf)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// The 95 % interval of the change in agreement between two models measured on
/// the same `n` items (paired outcomes): `both` items where both agree with the
/// source, `new_only` where only the new one does, `old_only` where only the old
/// one does, the rest neither. Newcombe's hybrid score interval for a difference
/// of paired proportions (Statistics in Medicine 17, 1998, method 10): it combines
/// the two Wilson intervals with the correlation φ of the paired outcomes, and
/// unlike the Wald interval stays sensible with few items or few discordant pairs.
pub fn change_interval(both: usize, new_only: usize, old_only: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (-1.0, 1.0);
    }
    let neither = n - both - new_only - old_only;
    let (p1, p2) = (
        (both + new_only) as f64 / n as f64,
        (both + old_only) as f64 / n as f64,
    );
    let ((l1, u1), (l2, u2)) = (
        agreement_interval(both + new_only, n),
        agreement_interval(both + old_only, n),
    );
    let (a, b, c, d) = (
        both as f64,
        new_only as f64,
        old_only as f64,
        neither as f64,
    );
    let denom = ((a + b) * (c + d) * (a + c) * (b + d)).sqrt();
    let phi = if denom > 0.0 {
        (a * d - b * c) / denom
    } else {
        0.0
    };
    let theta = p1 - p2;
    let delta = ((p1 - l1).powi(2) - 2.0 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2).powi(2))
        .max(0.0)
        .sqrt();
    let eps = ((u1 - p1).powi(2) - 2.0 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2).powi(2))
        .max(0.0)
        .sqrt();
    ((theta - delta).max(-1.0), (theta + eps).min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paired_change_interval() {
        // Agresti's approval ratings (Categorical Data Analysis, 10.1): 794 both,
        // 150 and 86 discordant, 1600 in all; a change of 0.04 whose Wald interval,
        // 0.04 ± 1.96·√((150 + 86) − 64²/1600)/1600, the score interval must be
        // close to at this size.
        let (lo, hi) = change_interval(794, 150, 86, 1600);
        let half = 1.959_964 * (236.0f64 - 64.0 * 64.0 / 1600.0).sqrt() / 1600.0;
        assert!(lo < 0.04 && hi > 0.04);
        assert!(
            (lo - (0.04 - half)).abs() < 2e-3 && (hi - (0.04 + half)).abs() < 2e-3,
            "{lo} {hi}"
        );
        // No discordant pair: no change, an interval around 0 that shrinks with n.
        let (lo, hi) = change_interval(6, 0, 0, 8);
        assert!(lo < 0.0 && hi > 0.0 && hi - lo < 0.7, "{lo} {hi}");
        let (lo2, hi2) = change_interval(600, 0, 0, 800);
        assert!(
            lo2 < 0.0 && hi2 > 0.0 && hi2 - lo2 < (hi - lo) / 5.0,
            "{lo2} {hi2}"
        );
        // All discordant one way: a large change, within [−1, 1].
        let (lo, hi) = change_interval(0, 20, 0, 20);
        assert!(lo > 0.5 && hi == 1.0, "{lo} {hi}");
        assert_eq!(change_interval(0, 0, 0, 0), (-1.0, 1.0));
    }

    #[test]
    fn wilson_interval_matches_the_formula() {
        // 8 of 16: centre 0.5, half-width 1.96·sqrt(0.25/16 + 1.96²/(4·256)) / (1 + 1.96²/16).
        let (lo, hi) = agreement_interval(8, 16);
        assert!(
            (lo - 0.2800).abs() < 1e-3 && (hi - 0.7200).abs() < 1e-3,
            "{lo} {hi}"
        );
        let (lo, hi) = agreement_interval(16, 16);
        assert!(
            (lo - 0.8064).abs() < 1e-3 && (hi - 1.0).abs() < 1e-12,
            "{lo} {hi}"
        );
    }

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
