//! ImageNet-style top-1 / top-5 evaluation of a TokenFormer-ViT, with the
//! timm / MAE eval preprocessing ([`crate::vision::EvalTransform`]), and
//! single-image classification.
//!
//! Images are decoded and resized on a separate rayon pool one batch ahead of
//! the model (a bounded channel), so preprocessing overlaps the forward pass.
//! Accuracy is exact: counts over every readable image, as timm's
//! `validate.py` reports it; unreadable files are listed and counted apart.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::models::vit::{probabilities, VisionTransformer};
use crate::vision::{dataset, top_k, ClassLabels, EvalTransform};

pub const KIND: &str = "imagenet";

/// How to run an evaluation.
#[derive(Clone, Debug)]
pub struct Options {
    /// A label file for a flat folder (`LOC_val_solution.csv` or `file label_index`).
    pub labels: Option<PathBuf>,
    pub batch_size: usize,
    /// Only the first N images of the sorted list (before sharding).
    pub limit: Option<usize>,
    /// `(I, N)`: every N-th image of the sorted list starting at I.
    pub shard: Option<(usize, usize)>,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            labels: None,
            batch_size: 32,
            limit: None,
            shard: None,
            progress: false,
        }
    }
}

/// The result of `eval imagenet`; its counts make shards mergeable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImagenetResult {
    /// Always `"imagenet"`.
    pub kind: String,
    pub model: String,
    pub data: String,
    pub label_source: String,
    /// Images classified (readable ones).
    pub images: usize,
    pub correct_top1: usize,
    pub correct_top5: usize,
    /// Top-1 / top-5 accuracy in percent over `images`.
    pub top1: f64,
    pub top5: f64,
    pub unreadable: usize,
    pub unreadable_files: Vec<String>,
    pub seconds: f64,
    pub images_per_second: f64,
    pub batch_size: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// `I/N` of a sharded run; absent for a whole run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<String>,
    /// The shards a merged result was made from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged_shards: Vec<String>,
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

/// A batch as the preprocessing thread hands it over: per image, its pixels or why not.
type Prepared = Vec<(dataset::Sample, Result<Vec<f32>>)>;

/// Evaluates `model` on the images under `data`. `model_name` is only reported.
pub fn evaluate(
    model: &VisionTransformer,
    model_name: &str,
    data: &Path,
    opts: &Options,
) -> Result<ImagenetResult> {
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
    let mut samples = ds.samples;
    if let Some(l) = opts.limit {
        samples.truncate(l);
    }
    if let Some((i, n)) = opts.shard {
        samples = dataset::shard(&samples, i, n);
    }
    let transform = EvalTransform::from_config(cfg);
    let batch_size = opts.batch_size.max(1);
    let bar = if opts.progress {
        let b = ProgressBar::new(samples.len() as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{bar:40} {pos}/{len} images  {per_sec}  ETA {eta}  {msg}",
            )
            .expect("valid template"),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("preprocess-{i}"))
        .build()
        .map_err(|e| Error::input(format!("cannot start the preprocessing threads: {e}")))?;

    let (mut correct1, mut correct5, mut images) = (0usize, 0usize, 0usize);
    let mut unreadable_files = Vec::new();
    let start = Instant::now();
    std::thread::scope(|scope| -> Result<()> {
        // Two batches in flight: one being preprocessed while the model runs the other.
        let (tx, rx) = mpsc::sync_channel::<Prepared>(1);
        let chunks: Vec<&[dataset::Sample]> = samples.chunks(batch_size).collect();
        let transform = &transform;
        let pool = &pool;
        scope.spawn(move || {
            for chunk in chunks {
                let prepared: Prepared = pool.install(|| {
                    chunk
                        .par_iter()
                        .map(|s| (s.clone(), transform.load(&s.path)))
                        .collect()
                });
                if tx.send(prepared).is_err() {
                    break; // the model side stopped on an error
                }
            }
        });
        for prepared in rx {
            let mut pixels = Vec::with_capacity(prepared.len());
            let mut labels = Vec::with_capacity(prepared.len());
            for (sample, res) in prepared {
                match res {
                    Ok(p) => {
                        pixels.push(p);
                        labels.push(sample.label);
                    }
                    Err(e) => {
                        bar.suspend(|| {
                            eprintln!("warning: unreadable image, counted and skipped: {e}")
                        });
                        unreadable_files.push(sample.path.display().to_string());
                        bar.inc(1);
                    }
                }
            }
            if pixels.is_empty() {
                continue;
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
            bar.inc(n as u64);
            bar.set_message(format!("top-1 {:.2}%", percent(correct1, images)));
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    Ok(ImagenetResult {
        kind: KIND.into(),
        model: model_name.into(),
        data: data.display().to_string(),
        label_source: ds.label_source,
        images,
        correct_top1: correct1,
        correct_top5: correct5,
        top1: percent(correct1, images),
        top5: percent(correct5, images),
        unreadable: unreadable_files.len(),
        unreadable_files,
        seconds,
        images_per_second: rate(images, seconds),
        batch_size,
        limit: opts.limit,
        shard: opts.shard.map(|(i, n)| format!("{i}/{n}")),
        merged_shards: vec![],
    })
}

/// Combines the results of `--shard I/N` runs into what one whole run reports:
/// counts are summed and the accuracies recomputed from them. `seconds` is the
/// summed compute time and `images_per_second` the rate per process.
pub fn merge_results(parts: &[Value]) -> Result<Value> {
    let parts: Vec<ImagenetResult> = parts
        .iter()
        .enumerate()
        .map(|(i, v)| {
            serde_json::from_value(v.clone()).map_err(|e| {
                Error::input(format!(
                    "imagenet result #{}: not a `tokenformer eval imagenet` result: {e}",
                    i + 1
                ))
            })
        })
        .collect::<Result<_>>()?;
    let first = parts
        .first()
        .ok_or_else(|| Error::input("no imagenet results to merge"))?;
    let mut shards: Vec<String> = Vec::new();
    let mut shard_count = None;
    for (i, p) in parts.iter().enumerate() {
        if p.kind != KIND {
            return Err(Error::input(format!(
                "result #{}: kind `{}`, expected `{KIND}`",
                i + 1,
                p.kind
            )));
        }
        for (what, a, b) in [
            ("model", &p.model, &first.model),
            ("data", &p.data, &first.data),
        ] {
            if a != b {
                return Err(Error::input(format!(
                    "result #{}: {what} `{a}` differs from `{b}`",
                    i + 1
                )));
            }
        }
        if p.limit != first.limit {
            return Err(Error::input(format!(
                "result #{}: --limit differs between the shards",
                i + 1
            )));
        }
        let own: Vec<String> = match (&p.shard, p.merged_shards.is_empty()) {
            (Some(s), _) => vec![s.clone()],
            (None, false) => p.merged_shards.clone(),
            (None, true) => {
                return Err(Error::input(format!(
                    "result #{}: not a --shard run, nothing to merge it with",
                    i + 1
                )))
            }
        };
        for s in own {
            let n = s.split_once('/').map(|(_, n)| n.to_string());
            if shard_count.get_or_insert_with(|| n.clone()) != &n {
                return Err(Error::input(format!(
                    "result #{}: shard {s} has a different N",
                    i + 1
                )));
            }
            if shards.contains(&s) {
                return Err(Error::input(format!("shard {s} appears twice")));
            }
            shards.push(s);
        }
    }
    // Like the Pile merge: the result must be that of one whole run.
    if let Some(Some(n)) = &shard_count {
        let expected: usize = n.parse().unwrap_or(0);
        if shards.len() != expected {
            return Err(Error::input(format!(
                "{} of {n} shards given ({}): all of them are needed for the whole run",
                shards.len(),
                shards.join(", ")
            )));
        }
    }
    let sum = |f: fn(&ImagenetResult) -> usize| parts.iter().map(f).sum::<usize>();
    let images = sum(|p| p.images);
    let (c1, c5) = (sum(|p| p.correct_top1), sum(|p| p.correct_top5));
    let seconds: f64 = parts.iter().map(|p| p.seconds).sum();
    let mut unreadable_files: Vec<String> = parts
        .iter()
        .flat_map(|p| p.unreadable_files.clone())
        .collect();
    unreadable_files.sort();
    shards.sort_by_key(|s| s.split('/').next().and_then(|i| i.parse::<usize>().ok()));
    let merged = ImagenetResult {
        kind: KIND.into(),
        model: first.model.clone(),
        data: first.data.clone(),
        label_source: first.label_source.clone(),
        images,
        correct_top1: c1,
        correct_top5: c5,
        top1: percent(c1, images),
        top5: percent(c5, images),
        unreadable: sum(|p| p.unreadable),
        unreadable_files,
        seconds,
        images_per_second: rate(images, seconds),
        batch_size: first.batch_size,
        limit: first.limit,
        shard: None,
        merged_shards: shards,
    };
    Ok(serde_json::to_value(merged).expect("serialisable"))
}

/// One of an image's top classes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wnid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub prob: f32,
}

/// The top-`k` classes of each image, or why it could not be read. Images
/// are preprocessed in parallel and run in batches of `batch_size`.
pub fn classify_files(
    model: &VisionTransformer,
    files: &[PathBuf],
    k: usize,
    batch_size: usize,
) -> Result<Vec<(PathBuf, Result<Vec<Prediction>>)>> {
    let cfg = model.config();
    let transform = EvalTransform::from_config(cfg);
    let classes = ClassLabels::for_config(cfg);
    let mut out = Vec::with_capacity(files.len());
    for chunk in files.chunks(batch_size.max(1)) {
        let loaded: Vec<Result<Vec<f32>>> = chunk.par_iter().map(|p| transform.load(p)).collect();
        let ok: Vec<Vec<f32>> = loaded
            .iter()
            .filter_map(|r| r.as_ref().ok().cloned())
            .collect();
        let probs = if ok.is_empty() {
            vec![]
        } else {
            probabilities(&model.forward(&transform.batch(ok, model.device())?)?)?
                .to_vec2::<f32>()?
        };
        let mut rows = probs.into_iter();
        for (path, r) in chunk.iter().zip(loaded) {
            let res = r.map(|_| {
                let row = rows.next().expect("one row per readable image");
                top_k(&row, k)
                    .into_iter()
                    .map(|i| Prediction {
                        index: i,
                        wnid: classes.wnid(i).map(str::to_string),
                        name: classes.name(i).map(str::to_string),
                        prob: row[i],
                    })
                    .collect()
            });
            out.push((path.clone(), res));
        }
    }
    Ok(out)
}
