//! `tokenformer eval imagenet`, `tokenformer classify` and `tokenformer
//! embed`: the image classifier's commands (preprocessing as timm / MAE eval, see
//! `tokenformer::vision`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Args;
use indicatif::ProgressBar;
use tokenformer::eval::{imagenet, Shard};
use tokenformer::loader;
use tokenformer::models::vit::VisionTransformer;
use tokenformer::vision::decode::DEFAULT_MAX_PIXELS;
use tokenformer::vision::DecodeLimits;

use super::{DeviceArgs, DtypeArg, ModelArgs};
use crate::cli::stdout::outln;

#[derive(Args, Debug)]
pub struct ImagenetArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Compute in f32 (exact; the default), bf16 or f16 (GPUs: several times faster).
    /// Norms and softmaxes sum in f32 in every dtype.
    #[arg(long, value_enum, default_value_t)]
    pub dtype: DtypeArg,
    /// `val/` with one folder per wnid (`val/<wnid>/*.JPEG`), or a flat folder with --labels;
    /// or such a folder in a Hub dataset, hf://datasets/OWNER/NAME[@REV]/DIR (downloaded into the cache).
    #[arg(long)]
    pub data: PathBuf,
    /// Labels of a flat folder: `LOC_val_solution.csv` or lines `file label_index` (or hf://datasets/…).
    #[arg(long)]
    pub labels: Option<PathBuf>,
    /// Write the result as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Evaluate only the first N images of the sorted list.
    #[arg(long, value_parser = super::positive::<usize>)]
    pub limit: Option<usize>,
    /// Images per forward pass (it changes results only in float rounding, about 1e-6 relative).
    #[arg(long, default_value_t = 32, value_parser = super::positive::<usize>)]
    pub batch_size: usize,
    /// Evaluate shard I of N (images whose sorted index ≡ I mod N); combine with `eval merge`.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<Shard>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Images above this many pixels (width × height, read from the header) are listed as unreadable, not decoded.
    #[arg(long, env = "TOKENFORMER_MAX_IMAGE_PIXELS", default_value_t = DEFAULT_MAX_PIXELS)]
    pub max_image_pixels: u64,
    /// Append the result as a row of timm validate.py's results CSV (the header is written once, to a new file).
    #[arg(long, value_name = "X.csv")]
    pub results_file: Option<PathBuf>,
}

/// Appends `r` to timm's results CSV `path`: a new or empty file gets the
/// header first; an existing one must have that header.
fn append_timm_csv(path: &std::path::Path, r: &imagenet::ImagenetResult) -> Result<()> {
    use std::io::Write;
    let header = imagenet::TIMM_CSV_COLUMNS.join(",");
    let existing = match std::fs::metadata(path) {
        Ok(m) if m.len() > 0 => {
            let text = tokenformer::fsutil::read_to_string_bounded(path, 256 << 20)?;
            let first = text.lines().next().unwrap_or("").trim_end_matches('\r');
            if first != header {
                bail!(
                    "{}: not a timm results CSV (its header is {first:?}, expected {header:?}); give a new file",
                    path.display()
                );
            }
            Some(text)
        }
        _ => None,
    };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut out = String::new();
    match &existing {
        None => out.push_str(&format!("{header}\r\n")),
        // A file whose last line has no line break gets one first.
        Some(t) if !t.ends_with('\n') => out.push_str("\r\n"),
        Some(_) => {}
    }
    out.push_str(&r.timm_csv_row());
    out.push_str("\r\n");
    f.write_all(out.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

pub fn imagenet_cmd(a: ImagenetArgs) -> Result<()> {
    let dev = a.device.open()?;
    let files = a.model.locate()?;
    let dtype = tokenformer::ComputeDtype::from(a.dtype).dtype();
    let model = loader::load_vit_in(&files, &dev, dtype)?;
    let weights = match &files.weights {
        loader::Weights::Safetensors(p) => p.clone(),
        loader::Weights::OfficialBin(p) => vec![p.clone()],
    };
    let param_count = imagenet::param_count(model.config(), &weights)?;
    let data = match a.data.to_str().filter(|s| s.starts_with("hf://")) {
        Some(spec) => {
            let client = tokenformer::HubClient::from_env()?;
            tokenformer::hub::dataset::fetch_folder_with(&client, spec)
                .with_context(|| format!("--data {spec}"))?
        }
        None => a.data.clone(),
    };
    let labels = a
        .labels
        .as_deref()
        .map(super::eval_lm::resolve_data)
        .transpose()?;
    let opts = imagenet::Options {
        param_count: Some(param_count),
        labels,
        batch_size: a.batch_size,
        limit: a.limit,
        shard: a.shard,
        max_image_pixels: a.max_image_pixels,
        model_commit: tokenformer::eval::model_commit(&files),
    };
    let bar = if a.quiet {
        ProgressBar::hidden()
    } else {
        super::progress::bar(
            0,
            "{bar:40} {pos}/{len} images  {per_sec}  ETA {eta}  {msg}",
        )
    };
    let r = imagenet::evaluate_with(&model, &files.source, &data, &opts, |p| {
        for e in &p.unreadable {
            bar.suspend(|| eprintln!("warning: unreadable image, counted and skipped: {e}"));
        }
        bar.set_length(p.total);
        bar.set_position(p.done);
        bar.set_message(format!("top-1 {:.2}%", p.top1()));
    });
    bar.finish_and_clear();
    let what = format!("{} on batches of {} images", files.source, a.batch_size);
    let r = r.map_err(|e| super::gpu_memory_error(e.into(), &dev, &what))?;
    let shard_note = r
        .shard
        .as_ref()
        .map_or(String::new(), |s| format!(" (shard {s})"));
    match &r.model_commit {
        Some(c) => outln!("model:  {} (commit {c})", r.model)?,
        None => outln!("model:  {}", r.model)?,
    }
    outln!(
        "data:   {}{shard_note}, labels from {}",
        r.data,
        r.label_source
    )?;
    outln!(
        "images: {}  ({:.1} images/s, {:.1} s)",
        r.images,
        r.images_per_second,
        r.seconds
    )?;
    outln!("top-1:  {:.3}%  ({}/{})", r.top1, r.correct_top1, r.images)?;
    outln!("top-5:  {:.3}%  ({}/{})", r.top5, r.correct_top5, r.images)?;
    if r.unreadable > 0 {
        outln!(
            "unreadable: {} image(s), not counted in the accuracy:",
            r.unreadable
        )?;
        for f in &r.unreadable_files {
            outln!("  {f}")?;
        }
    }
    for s in &r.skipped_folders {
        eprintln!("warning: {s}");
    }
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&r)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.results_file {
        append_timm_csv(path, &r)?;
    }
    Ok(())
}

/// What `classify` and `embed` share: the model, the images and how they run.
#[derive(Args, Debug)]
pub struct ImagesArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Compute in f32 (exact; the default), bf16 or f16 (GPUs: several times faster).
    /// Norms and softmaxes sum in f32 in every dtype.
    #[arg(long, value_enum, default_value_t)]
    pub dtype: DtypeArg,
    /// Image files (JPEG, PNG, WebP), or folders: the images under them, recursively, sorted.
    #[arg(required = true, value_name = "IMAGE|FOLDER")]
    pub images: Vec<PathBuf>,
    /// Images per forward pass (it changes results only in float rounding, about 1e-6 relative).
    #[arg(long, default_value_t = 32, value_parser = super::positive::<usize>)]
    pub batch_size: usize,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Images above this many pixels (width × height, read from the header) are refused, not decoded.
    #[arg(long, env = "TOKENFORMER_MAX_IMAGE_PIXELS", default_value_t = DEFAULT_MAX_PIXELS)]
    pub max_image_pixels: u64,
}

/// The images of an [`ImagesArgs`], the model that runs them and a bar to
/// count them on.
struct ImageRun {
    images: Vec<PathBuf>,
    batch_size: usize,
    model: VisionTransformer,
    source: String,
    device: Device,
    limits: DecodeLimits,
    bar: ProgressBar,
}

impl ImagesArgs {
    /// Lists the images and loads the model; `check` sees the list first, so
    /// a mistyped folder or a list the command cannot take fails before the
    /// model loads.
    fn open(&self, check: impl FnOnce(&[PathBuf]) -> Result<()>) -> Result<ImageRun> {
        let images = tokenformer::vision::dataset::image_files(&self.images)?;
        check(&images)?;
        let device = self.device.open()?;
        let files = self.model.locate()?;
        let dtype = tokenformer::ComputeDtype::from(self.dtype).dtype();
        let model = loader::load_vit_in(&files, &device, dtype)?;
        // A bar only when there is more than one batch to wait for.
        let bar = if self.quiet || images.len() <= self.batch_size {
            ProgressBar::hidden()
        } else {
            super::progress::bar(
                images.len() as u64,
                "{bar:40} {pos}/{len} images  {per_sec}  ETA {eta}",
            )
        };
        Ok(ImageRun {
            images,
            batch_size: self.batch_size,
            model,
            source: files.source,
            device,
            limits: DecodeLimits::new(self.max_image_pixels),
            bar,
        })
    }
}

impl ImageRun {
    /// A library error of the run, with what ran out of GPU memory if that is why.
    fn error(&self, e: tokenformer::Error) -> anyhow::Error {
        let what = format!("{} on batches of {} images", self.source, self.batch_size);
        super::gpu_memory_error(e.into(), &self.device, &what)
    }
}

/// Fails, naming the first ten, when some of `total` images could not be
/// read (their reasons again on stderr, for when stdout goes to a file).
fn unreadable<'a>(
    total: usize,
    errors: impl IntoIterator<Item = &'a tokenformer::Error>,
) -> Result<()> {
    let errors: Vec<&tokenformer::Error> = errors.into_iter().collect();
    if !errors.is_empty() {
        let reasons: Vec<String> = errors.iter().take(10).map(|e| format!("  {e}")).collect();
        bail!(
            "{} of {total} image(s) could not be read:\n{}",
            errors.len(),
            reasons.join("\n")
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct ClassifyArgs {
    #[command(flatten)]
    pub input: ImagesArgs,
    /// The K most likely classes of each image (at most the model's classes, as timm's inference.py).
    #[arg(long, visible_alias = "topk", value_name = "K", default_value_t = 5, value_parser = super::positive::<usize>)]
    pub top_k: usize,
    /// Print JSON: `[{"file", "top5": [{"index", "wnid", "name", "prob"}]}]` (`topK` for --top-k K),
    /// or `{"file", "error"}` for an image that could not be read.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub input: ImagesArgs,
    /// The safetensors file to write: `embeddings` [images, hidden_size] f32, a row per readable
    /// image in the order of the metadata's `files` (a JSON list).
    #[arg(long, value_name = "FILE.safetensors")]
    pub out: PathBuf,
    /// Replace an existing --out.
    #[arg(long)]
    pub force: bool,
}

/// One image of `classify --json`: `file`, then `top{k}` or `error` (a key
/// that names k, so the default output keeps its `top5`).
struct JsonImage<'a> {
    k: usize,
    image: &'a imagenet::Classified,
}

impl serde::Serialize for JsonImage<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let (file, result) = self.image;
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("file", file)?;
        match result {
            Ok(top) => m.serialize_entry(&format!("top{}", self.k), top)?,
            Err(e) => m.serialize_entry("error", &e.to_string())?,
        }
        m.end()
    }
}

fn print_text(images: &[imagenet::Classified]) -> std::io::Result<()> {
    for (file, r) in images {
        outln!("{}", file.display())?;
        match r {
            Ok(top) => {
                for p in top {
                    let label = match (&p.name, &p.wnid) {
                        (Some(n), Some(w)) => format!("{n} ({w})"),
                        (None, Some(w)) => w.clone(),
                        (Some(n), None) => n.clone(),
                        (None, None) => format!("class {}", p.index),
                    };
                    outln!("  {:>6.2}%  {:>4}  {label}", 100.0 * p.prob, p.index)?;
                }
            }
            Err(e) => outln!("  error: {e}")?,
        }
    }
    Ok(())
}

pub fn classify_cmd(a: ClassifyArgs) -> Result<()> {
    let run = a.input.open(|_| Ok(()))?;
    let k = a.top_k.min(run.model.config().num_classes);
    let mut results = Vec::with_capacity(run.images.len());
    let mut printed = Ok(());
    imagenet::classify_each(
        &run.model,
        &run.images,
        k,
        run.batch_size,
        &run.limits,
        |batch| {
            if !a.json && printed.is_ok() {
                // Printed as each batch ends, so a long run shows its results as it goes.
                printed = run.bar.suspend(|| print_text(&batch));
            }
            run.bar.inc(batch.len() as u64);
            results.extend(batch);
        },
    )
    .map_err(|e| run.error(e))?;
    printed?;
    run.bar.finish_and_clear();
    if a.json {
        let out: Vec<JsonImage> = results.iter().map(|image| JsonImage { k, image }).collect();
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
    }
    unreadable(
        results.len(),
        results.iter().filter_map(|(_, r)| r.as_ref().err()),
    )
}

/// Above this, the `files` list would not fit a safetensors header (100 MB,
/// which readers also enforce), with room for the rest.
const MAX_FILES_METADATA_BYTES: usize = 90_000_000;

/// Refuses, before any image runs, an `--out` that could not be written at
/// the end: a folder, an existing file without `force`, a folder that is not
/// there or not writable.
fn check_out(out: &Path, force: bool) -> Result<()> {
    if out.is_dir() {
        bail!(
            "--out {} is a folder: name the .safetensors file to write",
            out.display()
        );
    }
    if out.symlink_metadata().is_ok() && !force {
        bail!("{} exists: pass --force to replace it", out.display());
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // The file is written beside `out` and renamed over it, as this probe is.
    tempfile::NamedTempFile::new_in(parent)
        .with_context(|| format!("cannot write into {}", parent.display()))?;
    Ok(())
}

pub fn embed_cmd(a: EmbedArgs) -> Result<()> {
    let out = &a.out;
    check_out(out, a.force)?;
    // The `files` metadata is JSON text: a path that is not UTF-8, or a list
    // too long for a header, is refused before the work, not after.
    let run = a.input.open(|images| {
        if let Some(p) = images.iter().find(|p| p.to_str().is_none()) {
            bail!(
                "{}: not a UTF-8 path, which the `files` list cannot hold",
                p.display()
            );
        }
        let bytes: usize = images.iter().map(|p| p.as_os_str().len() + 3).sum();
        if bytes > MAX_FILES_METADATA_BYTES {
            bail!(
                "the paths of {} images take {} MB, more than a safetensors header holds: embed them in several runs",
                images.len(),
                bytes >> 20
            );
        }
        Ok(())
    })?;
    // Rows go straight into the matrix the file holds, so a large run keeps
    // one copy of its embeddings.
    let d = run.model.config().hidden_size;
    let (mut flat, mut files, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    imagenet::embed_each(
        &run.model,
        &run.images,
        run.batch_size,
        &run.limits,
        |batch| {
            run.bar.inc(batch.len() as u64);
            for (file, r) in batch {
                match r {
                    Ok(row) => {
                        flat.extend(row);
                        files.push(file);
                    }
                    Err(e) => errors.push(e),
                }
            }
        },
    )
    .map_err(|e| run.error(e))?;
    run.bar.finish_and_clear();
    let total = run.images.len();
    if files.is_empty() {
        unreadable(total, &errors)?;
        bail!("no images to embed");
    }
    let names = serde_json::to_string(&files)?;
    let embeddings = candle_core::Tensor::from_vec(flat, (files.len(), d), &Device::Cpu)?;
    let metadata: HashMap<String, String> = [
        ("format", "pt".to_string()),
        ("files", names),
        ("model", run.source.clone()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // Written to a temporary file beside `out` and renamed over it.
    safetensors::serialize_to_file([("embeddings", &embeddings)], Some(metadata), out)
        .with_context(|| format!("writing {}", out.display()))?;
    tokenformer::checkpoint::set_default_permissions(out)?;
    unreadable(total, &errors).map_err(|e| {
        anyhow::anyhow!(
            "{e:#}\n{} holds the other {} image(s)",
            out.display(),
            files.len()
        )
    })
}
