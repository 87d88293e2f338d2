//! Image files → 8-bit RGB, matching Pillow's `Image.open(f).convert("RGB")`
//! (what timm's dataset loader does) for the modes ImageNet-style data holds.
//!
//! Pillow's rules (`Convert.c`, `PngImagePlugin.py`, `JpegImagePlugin.py`):
//! grey is replicated to R = G = B; alpha is dropped, not composited; 16-bit
//! RGB(A) PNGs are read through their high byte; a 16-bit grey PNG (mode
//! `I;16`) is clamped to 255, not scaled; CMYK JPEGs are taken as Adobe
//! (inverted) CMYK and converted multiplicatively, R = (255 − C)(255 − K)/255,
//! which the `image` crate's JPEG decoder (zune-jpeg) also does, up to ±1 of
//! rounding. The format comes from the file's bytes, not its extension.

use std::io::Cursor;
use std::path::Path;

use image::{DynamicImage, ImageReader};

use super::RgbImage;
use crate::error::{Error, Result};

/// Reads and decodes an image file; errors name the path.
pub fn open_rgb(path: &Path) -> Result<RgbImage> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    decode_bytes(&bytes).map_err(|msg| Error::input(format!("{}: {msg}", path.display())))
}

/// Decodes JPEG / PNG / WebP bytes to RGB; the message says what went wrong.
pub fn decode_bytes(bytes: &[u8]) -> std::result::Result<RgbImage, String> {
    if bytes.is_empty() {
        return Err("empty file (0 bytes), not an image".into());
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| format!("cannot read image: {e}"))?;
    if reader.format().is_none() {
        return Err("not a JPEG, PNG or WebP image (unrecognised contents)".into());
    }
    let img = reader
        .decode()
        .map_err(|e| format!("cannot decode image: {e}"))?;
    Ok(to_rgb_like_pillow(img))
}

/// Pillow's `convert("RGB")` for each decoded layout.
pub fn to_rgb_like_pillow(img: DynamicImage) -> RgbImage {
    let (width, height) = (img.width() as usize, img.height() as usize);
    let data: Vec<u8> = match img {
        DynamicImage::ImageRgb8(b) => b.into_raw(),
        DynamicImage::ImageRgba8(b) => rgb_from(b.as_raw(), 4, |p| [p[0], p[1], p[2]]),
        DynamicImage::ImageLuma8(b) => rgb_from(b.as_raw(), 1, |p| [p[0]; 3]),
        DynamicImage::ImageLumaA8(b) => rgb_from(b.as_raw(), 2, |p| [p[0]; 3]),
        // Pillow unpacks 16-bit PNG samples through their high byte ...
        DynamicImage::ImageRgb16(b) => rgb_from(b.as_raw(), 3, |p| [hi(p[0]), hi(p[1]), hi(p[2])]),
        DynamicImage::ImageRgba16(b) => rgb_from(b.as_raw(), 4, |p| [hi(p[0]), hi(p[1]), hi(p[2])]),
        DynamicImage::ImageLumaA16(b) => rgb_from(b.as_raw(), 2, |p| [hi(p[0]); 3]),
        // ... except 16-bit grey, which it keeps as I;16 and clamps when converting.
        DynamicImage::ImageLuma16(b) => rgb_from(b.as_raw(), 1, |p| [p[0].min(255) as u8; 3]),
        other => other.to_rgb8().into_raw(),
    };
    RgbImage {
        width,
        height,
        data,
    }
}

fn hi(v: u16) -> u8 {
    (v >> 8) as u8
}

fn rgb_from<T: Copy>(raw: &[T], channels: usize, f: impl Fn(&[T]) -> [u8; 3]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len() / channels * 3);
    for p in raw.chunks_exact(channels) {
        out.extend_from_slice(&f(p));
    }
    out
}
