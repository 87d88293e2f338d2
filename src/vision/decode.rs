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
//!
//! Every decode is bounded: the dimensions are read from the header first and
//! an image above [`DecodeLimits::max_pixels`] is refused before any pixel
//! buffer exists (libjpeg would otherwise allocate whatever a 9 KB file's
//! header claims), the `image` crate gets matching [`image::Limits`], and a
//! file is read only if it is a regular file no larger than the largest image
//! allowed could be.

use std::io::Cursor;
use std::path::Path;

use image::{DynamicImage, ImageReader};

use super::RgbImage;
use crate::error::{Error, Result};

/// The default pixel limit: 50 megapixels (an 8660×5773 photo; ImageNet's
/// largest validation image has under 20).
pub const DEFAULT_MAX_PIXELS: u64 = 50_000_000;

/// Bounds on what one image may make the decoder allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Width × height above which an image is refused unread.
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }
}

impl DecodeLimits {
    pub fn new(max_pixels: u64) -> Self {
        Self { max_pixels }
    }

    /// The largest file read: 8 bytes per allowed pixel (16-bit RGBA stored
    /// uncompressed) plus 1 MiB of headers and metadata.
    pub(crate) fn max_file_bytes(&self) -> u64 {
        self.max_pixels.saturating_mul(8).saturating_add(1 << 20)
    }

    /// The decoder's allocation budget: the largest decoded layout (16-bit
    /// RGBA) of an allowed image, plus 64 MiB of working memory.
    fn max_alloc(&self) -> u64 {
        self.max_pixels.saturating_mul(8).saturating_add(64 << 20)
    }

    /// Refuses a header's dimensions above the limit (or empty ones).
    pub(crate) fn check(&self, width: u64, height: u64) -> std::result::Result<(), String> {
        if width == 0 || height == 0 {
            return Err(format!(
                "the header says {width}x{height} pixels: an empty image"
            ));
        }
        let pixels = width.saturating_mul(height);
        if pixels > self.max_pixels {
            return Err(format!(
                "the header says {width}x{height} = {pixels} pixels, above the limit of {} pixels \
                 (--max-image-pixels or TOKENFORMER_MAX_IMAGE_PIXELS raise it); not decoded",
                self.max_pixels
            ));
        }
        Ok(())
    }

    fn image_limits(&self) -> image::Limits {
        let side = u32::try_from(self.max_pixels).unwrap_or(u32::MAX);
        let mut l = image::Limits::default();
        l.max_image_width = Some(side);
        l.max_image_height = Some(side);
        l.max_alloc = Some(self.max_alloc());
        l
    }
}

/// Reads and decodes an image file with the default limits; errors name the path.
pub fn open_rgb(path: &Path) -> Result<RgbImage> {
    open_rgb_with(path, &DecodeLimits::default())
}

/// Reads (regular files only, at most `DecodeLimits::max_file_bytes`) and
/// decodes an image file; errors name the path.
pub fn open_rgb_with(path: &Path, limits: &DecodeLimits) -> Result<RgbImage> {
    let bytes = crate::fsutil::read_bounded(path, limits.max_file_bytes())?;
    decode_bytes_with(&bytes, limits)
        .map_err(|msg| Error::input(format!("{}: {msg}", path.display())))
}

/// Decodes JPEG / PNG / WebP bytes to RGB with the default limits.
pub fn decode_bytes(bytes: &[u8]) -> std::result::Result<RgbImage, String> {
    decode_bytes_with(bytes, &DecodeLimits::default())
}

/// Decodes JPEG / PNG / WebP bytes to RGB; the message says what went wrong.
pub fn decode_bytes_with(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> std::result::Result<RgbImage, String> {
    if bytes.is_empty() {
        return Err("empty file (0 bytes), not an image".into());
    }
    if bytes.starts_with(&[0xFF, 0xD8]) {
        return decode_jpeg(bytes, limits);
    }
    let reader = || -> std::result::Result<ImageReader<Cursor<&[u8]>>, String> {
        let mut r = ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| format!("cannot read image: {e}"))?;
        if r.format().is_none() {
            return Err("not a JPEG, PNG or WebP image (unrecognised contents)".into());
        }
        r.limits(limits.image_limits());
        Ok(r)
    };
    // The header alone first, so the message can say what the limit refused.
    let (w, h) = reader()?.into_dimensions().map_err(|e| match e {
        image::ImageError::Limits(_) => format!("cannot read image: {e} (above the pixel limit)"),
        e => format!("cannot read image: {e}"),
    })?;
    limits.check(w.into(), h.into())?;
    let img = reader()?
        .decode()
        .map_err(|e| format!("cannot decode image: {e}"))?;
    Ok(to_rgb_like_pillow(img))
}

/// Pillow's `convert("RGB")` for each decoded layout.
pub(crate) fn to_rgb_like_pillow(img: DynamicImage) -> RgbImage {
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
fn decode_jpeg(bytes: &[u8], limits: &DecodeLimits) -> std::result::Result<RgbImage, String> {
    use mozjpeg::ColorSpace;
    if !ends_after_scan(bytes) {
        // libjpeg would pad a truncated scan with grey and only warn; Pillow
        // raises "image file is truncated", so timm never sees such a file.
        return Err("truncated JPEG (no end-of-image marker after the image data)".into());
    }
    // libjpeg's fatal errors unwind out of the C callback; catch them here.
    let run = || -> std::result::Result<RgbImage, String> {
        let io = |e: std::io::Error| format!("cannot decode JPEG: {e}");
        // Reads the header only; the pixel buffers come with `to_colorspace`.
        let d = mozjpeg::Decompress::new_mem(bytes).map_err(io)?;
        let components = d.components().len();
        let (width, height) = (d.width(), d.height());
        limits.check(width as u64, height as u64)?;
        let (out_space, n) = match components {
            1 => (ColorSpace::JCS_GRAYSCALE, 1),
            3 => (ColorSpace::JCS_RGB, 3),
            4 => (ColorSpace::JCS_CMYK, 4),
            c => return Err(format!("cannot decode JPEG: JPEG with {c} components")),
        };
        let mut started = d.to_colorspace(out_space).map_err(io)?;
        let raw: Vec<u8> = started.read_scanlines().map_err(io)?;
        started.finish().map_err(io)?;
        if raw.len() != width * height * n {
            return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
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
        Ok(r) => r,
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
