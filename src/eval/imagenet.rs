//! ImageNet-style top-1 / top-5 evaluation of a TokenFormer-ViT, with the
//! timm / MAE eval preprocessing ([`crate::vision::EvalTransform`]), and
//! classification of image files ([`classify_each`]).
//!
//! In both, images are decoded and resized on a separate rayon pool one batch
//! ahead of the model (a bounded channel), so preprocessing overlaps the
//! forward pass.
//! Accuracy is exact: counts over every readable image, as timm's
//! `validate.py` reports it; unreadable files are listed and counted apart
//! (among them images above the pixel limit, and entries that are not
//! regular files, which are never opened). Progress and the unreadable
//! images reach the caller through a callback ([`evaluate_with`]).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use candle_core::Tensor;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::data::sha256_file;
use super::report::{Report, Setting};
use super::shard::Shard;
use crate::error::{Error, Result};
use crate::models::vit::{probabilities, VisionTransformer};
use crate::vision::{dataset, top_k, ClassLabels, DecodeLimits, EvalTransform};

/// The `kind` of an ImageNet result.
pub const KIND: &str = "imagenet";

/// How to run an evaluation.
#[derive(Clone, Debug)]
pub struct Options {
    /// A label file for a flat folder (`LOC_val_solution.csv` or `file label_index`).
    pub labels: Option<PathBuf>,
    /// Images per forward pass.
    pub batch_size: usize,
    /// Only the first N images of the sorted list (before sharding).
    pub limit: Option<usize>,
    /// `(I, N)`: every N-th image of the sorted list starting at I (a [`Shard`]).
    pub shard: Option<Shard>,
    /// Images above this many pixels are unreadable (not decoded).
    pub max_image_pixels: u64,
    /// The commit the model's files come from, recorded in the result.
    pub model_commit: Option<String>,
    /// The model's parameters (timm's `param_count`), if known: see
    /// [`param_count`].
    pub param_count: Option<u64>,
}

/// The parameters of a model with `config` in the checkpoint files `files`:
/// the elements of the tensors the model reads (as timm counts
/// `model.parameters()`), in checked arithmetic.
pub fn param_count(config: &crate::models::vit::Config, files: &[PathBuf]) -> Result<u64> {
    let mut total = 0u64;
    for f in files {
        for t in crate::checkpoint::tensor_infos(f)? {
            if !config.uses_tensor(&t.name) {
                continue;
            }
            let n = t
                .shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
                .and_then(|n| total.checked_add(n));
            total = n.ok_or_else(|| {
                Error::input(format!(
                    "{}: tensor `{}` of shape {:?}: the parameter count overflows",
                    f.display(),
                    t.name,
                    t.shape
                ))
            })?;
        }
    }
    Ok(total)
}

impl Default for Options {
    fn default() -> Self {
        Self {
            labels: None,
            batch_size: 32,
            limit: None,
            shard: None,
            max_image_pixels: crate::vision::decode::DEFAULT_MAX_PIXELS,
            model_commit: None,
            param_count: None,
        }
    }
}

/// The result of `eval imagenet`; its counts make shards mergeable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImagenetResult {
    /// Always `"imagenet"`.
    pub kind: String,
    /// The model as resolved (`repo@revision` or a path).
    pub model: String,
    /// The Hub commit the model's files come from (none for a local folder).
    #[serde(default)]
    pub model_commit: Option<String>,
    /// The image folder.
    pub data: String,
    /// sha256 of the listing of every image (relative path, size, label)
    /// before `--limit` and `--shard`: see [`dataset::Dataset::listing_sha256`].
    #[serde(default)]
    pub data_sha256: Option<String>,
    /// Where the labels came from (folder names or a labels file).
    pub label_source: String,
    /// sha256 of the `--labels` file, if one was given.
    #[serde(default)]
    pub labels_sha256: Option<String>,
    /// The pixel limit above which images were counted unreadable.
    #[serde(default)]
    pub max_image_pixels: Option<u64>,
    /// Images classified (readable ones).
    pub images: usize,
    /// Classified images whose label is the top class.
    pub correct_top1: usize,
    /// Classified images whose label is among the top five.
    pub correct_top5: usize,
    /// Top-1 / top-5 accuracy in percent over `images`.
    pub top1: f64,
    /// Top-5 accuracy in percent over `images`.
    pub top5: f64,
    /// Images that could not be read (not in the accuracy).
    pub unreadable: usize,
    /// Their paths.
    pub unreadable_files: Vec<String>,
    /// Folders not walked twice (symlink loops, second links), with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped_folders: Vec<String>,
    /// Seconds of evaluation (a merge: the sum over shards).
    pub seconds: f64,
    /// Images classified per second of `seconds`.
    pub images_per_second: f64,
    /// Images per forward pass.
    pub batch_size: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Only the first N images of the sorted list were evaluated.
    pub limit: Option<usize>,
    /// `I/N` of a sharded run; absent for a whole run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<String>,
    /// The shards a merged result was made from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged_shards: Vec<String>,
    /// timm `validate.py`'s fields (`top1_err`, `param_count`, …; its
    /// `top1`/`top5` are ours, unrounded).
    #[serde(flatten)]
    pub timm: TimmFields,
}

/// The fields timm's `validate.py` reports besides `model`, `top1` and
/// `top5` (<https://github.com/huggingface/pytorch-image-models>).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimmFields {
    /// 100 − top-1, rounded to 4 decimals as timm does.
    #[serde(default)]
    pub top1_err: Option<f64>,
    /// 100 − top-5, rounded to 4 decimals.
    #[serde(default)]
    pub top5_err: Option<f64>,
    /// Parameters in millions, rounded to 2 decimals as timm does.
    #[serde(default)]
    pub param_count: Option<f64>,
    /// The crop side (the model's image size).
    #[serde(default)]
    pub img_size: Option<usize>,
    /// The eval resize's crop fraction.
    #[serde(default)]
    pub crop_pct: Option<f64>,
    /// The eval resize's filter (`bicubic`, `bilinear`).
    #[serde(default)]
    pub interpolation: Option<String>,
}

/// Python's `round(x, digits)` for the values timm rounds (half to even
/// on the decimal digit, as the shortest repr of the binary value decides).
pub fn py_round(x: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    let y = x * p;
    let r = y.round();
    // Exact halves go to even, as Python's round does.
    let r = if (y - y.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - y.signum()
    } else {
        r
    };
    r / p
}

impl TimmFields {
    /// The fields of a run of a model with `config` and `params` parameters.
    pub fn new(config: &crate::models::vit::Config, params: Option<u64>) -> Self {
        let interpolation = serde_json::to_value(config.interpolation)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string));
        Self {
            top1_err: None,
            top5_err: None,
            param_count: params.map(|p| py_round(p as f64 / 1e6, 2)),
            img_size: Some(config.image_size),
            crop_pct: Some(config.crop_pct),
            interpolation,
        }
    }

    /// These fields with the error rates of `top1`/`top5` (percent).
    pub fn with_accuracy(mut self, top1: f64, top5: f64) -> Self {
        self.top1_err = Some(py_round(100.0 - top1, 4));
        self.top5_err = Some(py_round(100.0 - top5, 4));
        self
    }
}

/// The columns of timm's results CSV (`validate.py --results-file`), in its order.
pub const TIMM_CSV_COLUMNS: [&str; 9] = [
    "model",
    "top1",
    "top1_err",
    "top5",
    "top5_err",
    "param_count",
    "img_size",
    "crop_pct",
    "interpolation",
];

impl ImagenetResult {
    /// The result's row of timm's results CSV ([`TIMM_CSV_COLUMNS`]), its
    /// accuracies rounded to 4 decimals as timm writes them; a field that
    /// needs it is quoted as Python's `csv` module does.
    pub fn timm_csv_row(&self) -> String {
        let t = &self.timm;
        let num = |x: Option<f64>| x.map_or(String::new(), py_repr);
        let cells = [
            csv_cell(&self.model),
            py_repr(py_round(self.top1, 4)),
            num(t.top1_err),
            py_repr(py_round(self.top5, 4)),
            num(t.top5_err),
            num(t.param_count),
            t.img_size.map_or(String::new(), |s| s.to_string()),
            num(t.crop_pct),
            csv_cell(t.interpolation.as_deref().unwrap_or("")),
        ];
        cells.join(",")
    }
}

/// A float as Python's `repr` writes it (`76.0`, `0.875`, `86.57`).
fn py_repr(x: f64) -> String {
    let s = format!("{x:?}");
    if s.contains(['.', 'e', 'i', 'N']) {
        s
    } else {
        format!("{s}.0")
    }
}

/// A CSV cell quoted when it holds a comma, quote or line break (Python's
/// `csv.QUOTE_MINIMAL`).
fn csv_cell(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Images per second, 0 for no time.
fn rate(images: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        images as f64 / seconds
    } else {
        0.0
    }
}

/// Percent, 0 for an empty count (JSON has no NaN).
fn percent(correct: usize, total: usize) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * correct as f64 / total as f64
    }
}

/// The preprocessing of a run: images decoded and resized in parallel, one
/// batch ahead of the model.
struct Preprocess<'a> {
    transform: &'a EvalTransform,
    limits: &'a DecodeLimits,
}

impl Preprocess<'_> {
    /// Each image's pixels, or why it could not be read.
    fn load<T: Sync>(
        &self,
        chunk: &[T],
        path: &(impl Fn(&T) -> &Path + Sync),
    ) -> Vec<Result<Vec<f32>>> {
        chunk
            .par_iter()
            .map(|item| self.transform.load_with(path(item), self.limits))
            .collect()
    }

    /// Calls `model` on each batch of `items` in order, with each image's
    /// pixels or why it could not be read, while the next batch is being
    /// preprocessed on a pool of its own. Stops at `model`'s first error.
    fn run<T: Sync>(
        &self,
        items: &[T],
        path: impl Fn(&T) -> &Path + Sync,
        batch_size: usize,
        mut model: impl FnMut(&[T], Vec<Result<Vec<f32>>>) -> Result<()>,
    ) -> Result<()> {
        let batch_size = batch_size.max(1);
        if items.len() <= batch_size {
            // At most one batch (one image from the library's `classify`): nothing
            // to overlap, so no pool or thread of its own.
            return match items {
                [] => Ok(()),
                _ => model(items, self.load(items, &path)),
            };
        }
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("preprocess-{i}"))
            .build()
            .map_err(|e| Error::input(format!("cannot start the preprocessing threads: {e}")))?;
        std::thread::scope(|scope| {
            // Two batches in flight: one being preprocessed while the model runs the other.
            let (tx, rx) = mpsc::sync_channel::<Vec<Result<Vec<f32>>>>(1);
            let (path, pool) = (&path, &pool);
            scope.spawn(move || {
                for chunk in items.chunks(batch_size) {
                    if tx.send(pool.install(|| self.load(chunk, path))).is_err() {
                        break; // the model side stopped on an error
                    }
                }
            });
            // `rx` is dropped on an error, which stops the preprocessing thread.
            for (chunk, loaded) in items.chunks(batch_size).zip(rx) {
                model(chunk, loaded)?;
            }
            Ok(())
        })
    }
}

/// Progress after each batch, with the images of that batch that could not
/// be read (counted as unreadable and skipped: warnings for the caller).
#[derive(Clone, Debug)]
pub struct ImagenetProgress {
    /// Images handled so far (classified or unreadable), of `total`.
    pub done: u64,
    /// Images to handle in all.
    pub total: u64,
    /// Images classified so far, and of them right at top-1.
    pub images: usize,
    /// Of `images`, those whose label is the top class.
    pub correct_top1: usize,
    /// Why each image of this batch that could not be read was not.
    pub unreadable: Vec<String>,
}

impl ImagenetProgress {
    /// Top-1 accuracy so far, in percent.
    pub fn top1(&self) -> f64 {
        percent(self.correct_top1, self.images)
    }
}

/// [`evaluate_with`] without progress.
pub fn evaluate(
    model: &VisionTransformer,
    model_name: &str,
    data: &Path,
    opts: &Options,
) -> Result<ImagenetResult> {
    evaluate_with(model, model_name, data, opts, |_| {})
}

/// Evaluates `model` on the images under `data`, calling `progress` after
/// each batch. `model_name` is only reported.
pub fn evaluate_with(
    model: &VisionTransformer,
    model_name: &str,
    data: &Path,
    opts: &Options,
    mut progress: impl FnMut(&ImagenetProgress),
) -> Result<ImagenetResult> {
    let shard = opts.shard;
    let cfg = model.config();
    let classes = ClassLabels::for_config(cfg);
    let ds = dataset::list(data, opts.labels.as_deref(), classes.wnids.as_deref())?;
    if let Some(s) = ds.samples.iter().find(|s| s.label >= cfg.num_classes) {
        return Err(Error::input(format!(
            "{}: label {} is out of range for a model with {} classes",
            s.path.display(),
            s.label,
            cfg.num_classes
        )));
    }
    let data_sha256 = ds.listing_sha256(data);
    let labels_sha256 = opts.labels.as_deref().map(sha256_file).transpose()?;
    let limits = DecodeLimits::new(opts.max_image_pixels);
    let mut samples = ds.samples;
    if let Some(l) = opts.limit {
        samples.truncate(l);
    }
    if let Some(shard) = shard {
        samples = shard.select(&samples);
    }
    let transform = EvalTransform::from_config(cfg);
    let batch_size = opts.batch_size.max(1);
    let mut state = ImagenetProgress {
        done: 0,
        total: samples.len() as u64,
        images: 0,
        correct_top1: 0,
        unreadable: Vec::new(),
    };
    let (mut correct1, mut correct5, mut images) = (0usize, 0usize, 0usize);
    let mut unreadable_files = Vec::new();
    let start = Instant::now();
    let preprocess = Preprocess {
        transform: &transform,
        limits: &limits,
    };
    preprocess.run(
        &samples,
        |s| &s.path,
        batch_size,
        |chunk, loaded| {
            let mut pixels = Vec::with_capacity(chunk.len());
            let mut labels = Vec::with_capacity(chunk.len());
            for (sample, res) in chunk.iter().zip(loaded) {
                match res {
                    Ok(p) => {
                        pixels.push(p);
                        labels.push(sample.label);
                    }
                    Err(e) => {
                        state.unreadable.push(e.to_string());
                        unreadable_files.push(sample.path.display().to_string());
                        state.done += 1;
                    }
                }
            }
            if pixels.is_empty() {
                progress(&state);
                state.unreadable.clear();
                return Ok(());
            }
            let n = pixels.len();
            let batch = transform.batch(pixels, model.device())?;
            let logits = model.forward(&batch)?.to_vec2::<f32>()?;
            for (row, label) in logits.iter().zip(&labels) {
                let top = top_k(row, 5);
                correct1 += usize::from(top[0] == *label);
                correct5 += usize::from(top.contains(label));
            }
            images += n;
            state.done += n as u64;
            (state.images, state.correct_top1) = (images, correct1);
            progress(&state);
            state.unreadable.clear();
            Ok(())
        },
    )?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(ImagenetResult {
        kind: KIND.into(),
        model: model_name.into(),
        model_commit: opts.model_commit.clone(),
        data: data.display().to_string(),
        data_sha256: Some(data_sha256),
        label_source: ds.label_source,
        labels_sha256,
        max_image_pixels: Some(opts.max_image_pixels),
        images,
        correct_top1: correct1,
        correct_top5: correct5,
        top1: percent(correct1, images),
        top5: percent(correct5, images),
        unreadable: unreadable_files.len(),
        unreadable_files,
        skipped_folders: ds.skipped,
        seconds,
        images_per_second: rate(images, seconds),
        batch_size,
        limit: opts.limit,
        shard: shard.map(|s| s.to_string()),
        merged_shards: vec![],
        timm: TimmFields::new(cfg, opts.param_count)
            .with_accuracy(percent(correct1, images), percent(correct5, images)),
    })
}

/// Combines the results of `--shard I/N` runs into what one whole run reports
/// (see [`super::merge::merge`]): counts are summed and the accuracies
/// recomputed from them. `seconds` is the summed compute time and
/// `images_per_second` the rate per process. Shards must agree on the model
/// (and its commit), the data listing, the labels file, `--limit` and the
/// pixel limit, have consistent counts, and be I/N of one N, each once, all
/// present; a merged result can be merged again with the other shards.
pub fn merge_results(parts: &[Value]) -> Result<Value> {
    super::merge::merge_values::<ImagenetResult>(parts)
}

impl Report for ImagenetResult {
    const KIND: &'static str = KIND;

    fn kind(&self) -> &str {
        &self.kind
    }

    fn label(i: usize) -> String {
        format!("imagenet result #{}", i + 1)
    }

    fn parse_error(i: usize, e: serde_json::Error) -> Error {
        Error::input(format!(
            "{}: not a `tokenformer eval imagenet` result: {e}",
            Self::label(i)
        ))
    }

    fn wrong_kind(i: usize, kind: &str) -> Error {
        Error::input(format!(
            "{}: kind `{kind}`, expected `{KIND}`",
            Self::label(i)
        ))
    }

    fn differs(i: usize, what: &str, this: &str, first: &str) -> Error {
        Error::input(format!(
            "{}: {what} {this} differs from {first} of result #1: shards of different runs cannot be merged",
            Self::label(i)
        ))
    }

    fn shards(&self) -> std::result::Result<Vec<&str>, String> {
        match (&self.shard, self.merged_shards.is_empty()) {
            (Some(s), true) => Ok(vec![s]),
            (None, false) => Ok(self.merged_shards.iter().map(String::as_str).collect()),
            (Some(_), false) => {
                Err("both `shard` and `merged_shards`: not a result of this tool".into())
            }
            (None, true) => Err("not a sharded run, nothing to merge it with".into()),
        }
    }

    fn settings(&self) -> Vec<Setting> {
        let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "(none)".into());
        // The folder's name counts only where no listing hash was recorded.
        let data = self.data_sha256.is_none().then_some(&self.data);
        vec![
            Setting::shown_as("model", &self.model, self.model.clone()),
            Setting::shown_as("model commit", &self.model_commit, opt(&self.model_commit)),
            Setting::shown_as(
                "data listing sha256",
                &self.data_sha256,
                opt(&self.data_sha256),
            ),
            Setting::shown_as("data", data, self.data.clone()),
            Setting::shown_as(
                "labels file sha256",
                &self.labels_sha256,
                opt(&self.labels_sha256),
            ),
            Setting::new("limit", self.limit),
            Setting::new("pixel limit", self.max_image_pixels),
        ]
    }

    fn check_counts(&self, i: usize) -> Result<()> {
        let bad = |msg: String| Error::input(format!("{}: {msg}", Self::label(i)));
        if self.correct_top1 > self.correct_top5 || self.correct_top5 > self.images {
            return Err(bad(format!(
                "impossible counts: correct_top1 {} <= correct_top5 {} <= images {} does not hold",
                self.correct_top1, self.correct_top5, self.images
            )));
        }
        if self.unreadable != self.unreadable_files.len() {
            return Err(bad(format!(
                "impossible counts: unreadable {} but {} unreadable files listed",
                self.unreadable,
                self.unreadable_files.len()
            )));
        }
        if !(self.seconds.is_finite() && self.seconds >= 0.0) {
            return Err(bad(format!("impossible time: seconds {}", self.seconds)));
        }
        Ok(())
    }

    fn combine(parts: &[Self], n: usize) -> Result<Self> {
        let first = &parts[0];
        let sum = |f: fn(&ImagenetResult) -> usize| -> Result<usize> {
            parts
                .iter()
                .try_fold(0usize, |acc, p| acc.checked_add(f(p)))
                .ok_or_else(super::report::overflow)
        };
        let images = sum(|p| p.images)?;
        let (c1, c5) = (sum(|p| p.correct_top1)?, sum(|p| p.correct_top5)?);
        let seconds: f64 = parts.iter().map(|p| p.seconds).sum();
        let mut unreadable_files: Vec<String> = parts
            .iter()
            .flat_map(|p| p.unreadable_files.clone())
            .collect();
        unreadable_files.sort();
        Ok(ImagenetResult {
            kind: KIND.into(),
            model: first.model.clone(),
            model_commit: first.model_commit.clone(),
            data: first.data.clone(),
            data_sha256: first.data_sha256.clone(),
            label_source: first.label_source.clone(),
            labels_sha256: first.labels_sha256.clone(),
            max_image_pixels: first.max_image_pixels,
            images,
            correct_top1: c1,
            correct_top5: c5,
            top1: percent(c1, images),
            top5: percent(c5, images),
            unreadable: unreadable_files.len(),
            unreadable_files,
            skipped_folders: first.skipped_folders.clone(),
            seconds,
            images_per_second: rate(images, seconds),
            batch_size: first.batch_size,
            limit: first.limit,
            shard: None,
            merged_shards: (0..n).map(|i| format!("{i}/{n}")).collect(),
            timm: first
                .timm
                .clone()
                .with_accuracy(percent(c1, images), percent(c5, images)),
        })
    }
}

/// An image and its top classes, or why it could not be read.
pub type Classified = (PathBuf, Result<Vec<Prediction>>);

/// One of an image's top classes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// The class index.
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// The class's WordNet id, if the model has a class list.
    pub wnid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// The class's name, if the model has a class list.
    pub name: Option<String>,
    /// Its softmax probability.
    pub prob: f32,
}

/// [`classify_files_with`] with the default decode limits.
pub fn classify_files(
    model: &VisionTransformer,
    files: &[PathBuf],
    k: usize,
    batch_size: usize,
) -> Result<Vec<Classified>> {
    classify_files_with(model, files, k, batch_size, &DecodeLimits::default())
}

/// The top-`k` classes of each image, or why it could not be read (an image
/// above `limits` is not decoded), in the order of `files`. Images are
/// preprocessed in parallel and run in batches of `batch_size`.
pub fn classify_files_with(
    model: &VisionTransformer,
    files: &[PathBuf],
    k: usize,
    batch_size: usize,
    limits: &DecodeLimits,
) -> Result<Vec<Classified>> {
    let mut out = Vec::with_capacity(files.len());
    classify_each(model, files, k, batch_size, limits, |batch| {
        out.extend(batch)
    })?;
    Ok(out)
}

/// [`classify_files_with`], handing each batch's results to `on_batch` as
/// soon as it is done, in order; the next batch is preprocessed while the
/// model runs this one.
pub fn classify_each(
    model: &VisionTransformer,
    files: &[PathBuf],
    k: usize,
    batch_size: usize,
    limits: &DecodeLimits,
    on_batch: impl FnMut(Vec<Classified>),
) -> Result<()> {
    let classes = ClassLabels::for_config(model.config());
    each_image(
        model,
        files,
        batch_size,
        limits,
        |pixels| probabilities(&model.forward(pixels)?),
        |row| {
            top_k(&row, k)
                .into_iter()
                .map(|i| Prediction {
                    index: i,
                    wnid: classes.wnid(i).map(str::to_string),
                    name: classes.name(i).map(str::to_string),
                    prob: row[i],
                })
                .collect()
        },
        on_batch,
    )
}

/// An image and its embedding ([`VisionTransformer::pre_logits`]), or why
/// it could not be read.
pub type Embedded = (PathBuf, Result<Vec<f32>>);

/// The embedding of each image, or why it could not be read (an image above
/// `limits` is not decoded), in the order of `files`.
pub fn embed_files(
    model: &VisionTransformer,
    files: &[PathBuf],
    batch_size: usize,
    limits: &DecodeLimits,
) -> Result<Vec<Embedded>> {
    let mut out = Vec::with_capacity(files.len());
    embed_each(model, files, batch_size, limits, |batch| out.extend(batch))?;
    Ok(out)
}

/// [`embed_files`], handing each batch's results to `on_batch` as soon as it
/// is done, in order, as [`classify_each`] does.
pub fn embed_each(
    model: &VisionTransformer,
    files: &[PathBuf],
    batch_size: usize,
    limits: &DecodeLimits,
    on_batch: impl FnMut(Vec<Embedded>),
) -> Result<()> {
    each_image(
        model,
        files,
        batch_size,
        limits,
        |pixels| model.pre_logits(pixels),
        |row| row,
        on_batch,
    )
}

/// Runs `forward` ([b, pixels] → [b, n] f32) on the readable images of
/// `files` in batches, preprocessing the next batch meanwhile, and hands
/// `on_batch` each image's `per_row` of its output row, or why it could not be
/// read, in order.
fn each_image<T>(
    model: &VisionTransformer,
    files: &[PathBuf],
    batch_size: usize,
    limits: &DecodeLimits,
    forward: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    per_row: impl Fn(Vec<f32>) -> T,
    mut on_batch: impl FnMut(Vec<(PathBuf, Result<T>)>),
) -> Result<()> {
    let transform = EvalTransform::from_config(model.config());
    let preprocess = Preprocess {
        transform: &transform,
        limits,
    };
    preprocess.run(files, PathBuf::as_path, batch_size, |chunk, loaded| {
        let ok: Vec<Vec<f32>> = loaded
            .iter()
            .filter_map(|r| r.as_ref().ok().cloned())
            .collect();
        let rows = if ok.is_empty() {
            vec![]
        } else {
            forward(&transform.batch(ok, model.device())?)?.to_vec2::<f32>()?
        };
        let mut rows = rows.into_iter();
        let batch = chunk
            .iter()
            .zip(loaded)
            .map(|(path, r)| {
                let res = r.map(|_| per_row(rows.next().expect("one row per readable image")));
                (path.clone(), res)
            })
            .collect();
        on_batch(batch);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches reach the model in order, each with one result per image,
    /// and the model's error ends the run at once (the preprocessing thread
    /// is not left waiting to hand over the next batch).
    #[test]
    fn preprocess_hands_over_batches_in_order_and_stops_at_an_error() {
        let cfg = crate::models::vit::Config::imagenet(2, 32, 2, 8, 16);
        let transform = EvalTransform::from_config(&cfg);
        let limits = DecodeLimits::default();
        let pre = Preprocess {
            transform: &transform,
            limits: &limits,
        };
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<PathBuf> = (0..10)
            .map(|i| dir.path().join(format!("{i}.png")))
            .collect();
        let mut seen = Vec::new();
        pre.run(&files, PathBuf::as_path, 4, |chunk, loaded| {
            assert_eq!(chunk.len(), loaded.len());
            // No such files: each result is an error naming its own file.
            for (p, r) in chunk.iter().zip(&loaded) {
                let e = r.as_ref().unwrap_err().to_string();
                assert!(e.contains(&p.display().to_string()), "{e}");
            }
            seen.extend(chunk.iter().cloned());
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, files);
        // One batch runs on the calling side; no items, no call.
        let mut calls = 0;
        pre.run(&files, PathBuf::as_path, 16, |chunk, loaded| {
            calls += 1;
            assert_eq!((chunk, loaded.len()), (&files[..], files.len()));
            Ok(())
        })
        .unwrap();
        pre.run(&files[..0], PathBuf::as_path, 16, |_, _| panic!("no batch"))
            .unwrap();
        assert_eq!(calls, 1);
        let mut calls = 0;
        let r = pre.run(&files, PathBuf::as_path, 1, |_, _| {
            calls += 1;
            match calls {
                3 => Err(Error::input("stop here")),
                _ => Ok(()),
            }
        });
        assert_eq!(r.unwrap_err().to_string(), "stop here");
        assert_eq!(calls, 3);
    }
}
