//! Image files → 8-bit RGB, matching Pillow's `Image.open(f).convert("RGB")`
//! (what timm's dataset loader does) for the modes ImageNet-style data holds.
//!
//! Pillow's rules (`Convert.c`, `PngImagePlugin.py`, `JpegImagePlugin.py`):
//! grey is replicated to R = G = B; alpha is dropped, not composited; 16-bit
//! RGB(A) PNGs are read through their high byte; a 16-bit grey PNG (mode
//! `I;16`) is clamped to 255, not scaled; CMYK JPEGs are taken as Adobe
//! (inverted) CMYK and converted multiplicatively, R = (255 − K) − C(255 − K)/255
//! with Pillow's rounding. The format comes from the file's bytes, not its
//! extension.
//!
//! JPEGs are decoded by libjpeg-turbo's decoder (through the `mozjpeg` crate,
//! whose decoder is libjpeg-turbo's), the library inside Pillow, with its
//! defaults (integer "slow" IDCT, fancy upsampling), so decoded pixels equal
//! Pillow's. The `image` crate's pure-Rust JPEG decoder differs from it by up
//! to ±18 on 4:2:0 photos (0.35 on average): more than the eval tolerance.
//! PNG and WebP are lossless and go through the `image` crate.

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
    if bytes.starts_with(&[0xFF, 0xD8]) {
        return decode_jpeg(bytes);
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

/// libjpeg-turbo decoding in the colour space Pillow asks for: 1 component →
/// grey, 3 → RGB (libjpeg converts YCbCr), 4 → raw CMYK (libjpeg converts YCCK),
/// then Pillow's conversions to RGB.
fn decode_jpeg(bytes: &[u8]) -> std::result::Result<RgbImage, String> {
    use mozjpeg::ColorSpace;
    if !ends_after_scan(bytes) {
        // libjpeg would pad a truncated scan with grey and only warn; Pillow
        // raises "image file is truncated", so timm never sees such a file.
        return Err("truncated JPEG (no end-of-image marker after the image data)".into());
    }
    // libjpeg's fatal errors unwind out of the C callback; catch them here.
    let run = || -> std::io::Result<RgbImage> {
        let d = mozjpeg::Decompress::new_mem(bytes)?;
        let components = d.components().len();
        let (width, height) = (d.width(), d.height());
        let (out_space, n) = match components {
            1 => (ColorSpace::JCS_GRAYSCALE, 1),
            3 => (ColorSpace::JCS_RGB, 3),
            4 => (ColorSpace::JCS_CMYK, 4),
            c => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("JPEG with {c} components"),
                ))
            }
        };
        let mut started = d.to_colorspace(out_space)?;
        let raw: Vec<u8> = started.read_scanlines()?;
        started.finish()?;
        if raw.len() != width * height * n {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let data = match n {
            1 => rgb_from(&raw, 1, |p| [p[0]; 3]),
            3 => raw,
            _ => rgb_from(&raw, 4, |p| {
                // Pillow's "CMYK;I" unpacking (Adobe polarity), then cmyk2rgb.
                let (c, m, y, k) = (255 - p[0], 255 - p[1], 255 - p[2], 255 - p[3]);
                let nk = 255 - k as u32;
                let f = |v: u8| (nk - muldiv255(v as u32, nk)) as u8;
                [f(c), f(m), f(y)]
            }),
        };
        Ok(RgbImage {
            width,
            height,
            data,
        })
    };
    match std::panic::catch_unwind(run) {
        Ok(Ok(img)) => Ok(img),
        Ok(Err(e)) => Err(format!("cannot decode JPEG: {e}")),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "libjpeg error".into());
            Err(format!("cannot decode JPEG: {msg}"))
        }
    }
}

/// Whether an end-of-image marker follows the first start-of-scan. Markers
/// cannot occur inside entropy-coded data, and an EOI before the first scan
/// belongs to an embedded thumbnail.
fn ends_after_scan(bytes: &[u8]) -> bool {
    let Some(sos) = bytes.windows(2).position(|w| w == [0xFF, 0xDA]) else {
        return false;
    };
    bytes[sos..].windows(2).any(|w| w == [0xFF, 0xD9])
}

/// Pillow's `MULDIV255`: a·b/255 rounded, in integers.
fn muldiv255(a: u32, b: u32) -> u32 {
    let t = a * b + 128;
    ((t >> 8) + t) >> 8
}
