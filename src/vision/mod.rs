//! Image input for the vision models: decoding to RGB as Pillow's
//! `Image.open(f).convert("RGB")` does, the timm / MAE eval transform
//! (`timm.data.transforms_factory.transforms_imagenet_eval`: Resize of the
//! shorter side to floor(image_size / crop_pct) with Pillow resampling,
//! CenterCrop, ToTensor, Normalize; or its `squash` crop mode, which with
//! crop_pct 1 is transformers' `ViTImageProcessor`: Pillow resize straight to
//! image_size², rescale, normalise), dataset listing and top-k.
//!
//! References: timm `transforms_factory.py`, torchvision
//! `transforms/functional.py` (`_compute_resized_output_size`, `center_crop`),
//! Pillow `Resample.c` and `Convert.c`.

pub mod dataset;
pub mod decode;
pub mod resample;

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::models::vit::{Config, Interpolation, ResizeMode};
pub use decode::{decode_bytes, decode_bytes_with, open_rgb, open_rgb_with, DecodeLimits};
use resample::Filter;

/// An 8-bit RGB image, rows of interleaved R, G, B.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

/// The eval preprocessing of one model: sizes, filter and normalisation.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalTransform {
    /// Target of the shorter side before cropping.
    pub resize: usize,
    /// Side of the square center crop (the model's image_size).
    pub crop: usize,
    pub filter: Filter,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    /// The shorter side to `resize`, or both sides (`Squash`, aspect ratio not
    /// kept: timm's `squash`, and with resize = crop transformers' `ViTImageProcessor`).
    pub resize_mode: ResizeMode,
}

impl EvalTransform {
    /// timm's eval transform for a config: `scale_size = floor(img_size / crop_pct)`.
    pub fn from_config(cfg: &Config) -> Self {
        Self {
            resize: (cfg.image_size as f64 / cfg.crop_pct).floor() as usize,
            crop: cfg.image_size,
            filter: match cfg.interpolation {
                Interpolation::Bicubic => Filter::Bicubic,
                Interpolation::Bilinear => Filter::Bilinear,
            },
            mean: cfg.mean,
            std: cfg.std,
            resize_mode: cfg.resize_mode,
        }
    }

    /// torchvision's `Resize(int)` output size: the shorter side becomes
    /// `resize`, the longer `int(resize * long / short)` (float division, truncated).
    pub fn resized_size(&self, width: usize, height: usize) -> (usize, usize) {
        let (short, long) = if width <= height {
            (width, height)
        } else {
            (height, width)
        };
        let new_long = ((self.resize * long) as f64 / short as f64) as usize;
        if width <= height {
            (self.resize, new_long)
        } else {
            (new_long, self.resize)
        }
    }

    /// Resize (shorter side, or squash) + center crop as u8 RGB (crop × crop). A resized image smaller
    /// than the crop (crop_pct > 1) is zero-padded first, as torchvision's
    /// `center_crop` does.
    pub fn resize_crop(&self, img: &RgbImage) -> Result<RgbImage> {
        if img.width == 0 || img.height == 0 {
            return Err(Error::input(format!(
                "image of size {}x{} is empty",
                img.width, img.height
            )));
        }
        let (w, h) = match self.resize_mode {
            ResizeMode::Squash => (self.resize, self.resize),
            ResizeMode::ShorterSide => self.resized_size(img.width, img.height),
        };
        let c = self.crop;
        // torchvision: offsets int(round((H - h) / 2)), Python's round (ties to even).
        let offset = |size: usize| -> (usize, usize) {
            if size >= c {
                (round_half_even((size - c) as f64 / 2.0), 0)
            } else {
                // torchvision pads left/top by (c - size) // 2 with zeros.
                (0, (c - size) / 2)
            }
        };
        let ((x0, pad_x), (y0, pad_y)) = (offset(w), offset(h));
        let (cw, ch) = (w.min(c), h.min(c));
        let window = resample::resize_window(img, w, h, x0..x0 + cw, y0..y0 + ch, self.filter);
        if cw == c && ch == c {
            return Ok(window);
        }
        let mut data = vec![0u8; c * c * 3];
        for y in 0..ch {
            let dst = ((y + pad_y) * c + pad_x) * 3;
            data[dst..dst + cw * 3].copy_from_slice(&window.data[y * cw * 3..(y + 1) * cw * 3]);
        }
        Ok(RgbImage {
            width: c,
            height: c,
            data,
        })
    }

    /// ToTensor + Normalize into `out` (3 × crop × crop, channel-major), in f32
    /// exactly as torchvision computes it: v / 255, then (x − mean) / std.
    pub(crate) fn normalise_into(&self, img: &RgbImage, out: &mut [f32]) {
        let plane = img.width * img.height;
        for (i, px) in img.data.chunks_exact(3).enumerate() {
            for ch in 0..3 {
                out[ch * plane + i] = (px[ch] as f32 / 255.0 - self.mean[ch]) / self.std[ch];
            }
        }
    }

    /// Decoded image → normalised [3, crop, crop] values.
    pub fn apply(&self, img: &RgbImage) -> Result<Vec<f32>> {
        let cropped = self.resize_crop(img)?;
        let mut out = vec![0f32; 3 * self.crop * self.crop];
        self.normalise_into(&cropped, &mut out);
        Ok(out)
    }

    /// Reads, decodes and preprocesses one file (default decode limits).
    pub fn load(&self, path: &Path) -> Result<Vec<f32>> {
        self.load_with(path, &DecodeLimits::default())
    }

    /// Reads, decodes (within `limits`) and preprocesses one file.
    pub fn load_with(&self, path: &Path, limits: &DecodeLimits) -> Result<Vec<f32>> {
        let img = open_rgb_with(path, limits)?;
        self.apply(&img)
            .map_err(|e| Error::input(format!("{}: {e}", path.display())))
    }

    /// Stacks preprocessed images into a [b, 3, crop, crop] tensor.
    pub fn batch(&self, images: Vec<Vec<f32>>, device: &Device) -> Result<Tensor> {
        let b = images.len();
        let flat: Vec<f32> = images.into_iter().flatten().collect();
        Ok(Tensor::from_vec(
            flat,
            (b, 3, self.crop, self.crop),
            device,
        )?)
    }
}

/// Python 3's `round` for non-negative halves: ties go to the even integer.
pub fn round_half_even(x: f64) -> usize {
    let f = x.floor();
    let diff = x - f;
    let r = if diff > 0.5 || (diff == 0.5 && (f as i64) % 2 == 1) {
        f + 1.0
    } else {
        f
    };
    r as usize
}

/// Indices of the k largest values, largest first; ties keep the lower index
/// first (so the result is deterministic).
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

const IMAGENET_CLASSES: &str = include_str!("../../zoo/imagenet_classes.json");

/// The 1000 ImageNet-1k classes: sorted wnids and their WordNet lemmas.
pub fn imagenet_classes() -> &'static (Vec<String>, Vec<String>) {
    static CLASSES: std::sync::OnceLock<(Vec<String>, Vec<String>)> = std::sync::OnceLock::new();
    CLASSES.get_or_init(|| {
        #[derive(serde::Deserialize)]
        struct File {
            wnids: Vec<String>,
            names: Vec<String>,
        }
        let f: File = serde_json::from_str(IMAGENET_CLASSES)
            .expect("zoo/imagenet_classes.json is checked by the tests");
        (f.wnids, f.names)
    })
}

/// What a model's class indices mean: wnids and names when known. A model
/// without `class_wnids` but with 1000 classes is taken to use the standard
/// ImageNet-1k order; names missing from the config are looked up by wnid.
#[derive(Clone, Debug, Default)]
pub(crate) struct ClassLabels {
    pub wnids: Option<Vec<String>>,
    pub names: Option<Vec<String>>,
}

impl ClassLabels {
    pub(crate) fn for_config(cfg: &Config) -> Self {
        let (in_wnids, in_names) = imagenet_classes();
        let wnids = cfg
            .class_wnids
            .clone()
            .or_else(|| (cfg.num_classes == in_wnids.len()).then(|| in_wnids.clone()));
        let names = cfg.class_names.clone().or_else(|| {
            let w = wnids.as_ref()?;
            let lookup: std::collections::HashMap<&str, &str> = in_wnids
                .iter()
                .map(String::as_str)
                .zip(in_names.iter().map(String::as_str))
                .collect();
            let found: Vec<String> = w
                .iter()
                .filter_map(|x| lookup.get(x.as_str()).map(|s| s.to_string()))
                .collect();
            (found.len() == w.len()).then_some(found)
        });
        Self { wnids, names }
    }

    pub(crate) fn wnid(&self, i: usize) -> Option<&str> {
        self.wnids.as_ref()?.get(i).map(String::as_str)
    }

    pub(crate) fn name(&self, i: usize) -> Option<&str> {
        self.names.as_ref()?.get(i).map(String::as_str)
    }
}
