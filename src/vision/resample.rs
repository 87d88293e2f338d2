//! Pillow's antialiased resampling of 8-bit images, reproduced to the bit, so
//! that eval preprocessing equals timm/torchvision's `Resize` on a PIL image.
//!
//! Follows Pillow's `src/libImaging/Resample.c` (`precompute_coeffs`,
//! `normalize_coeffs_8bpc`, `ImagingResampleHorizontal_8bpc` /
//! `ImagingResampleVertical_8bpc`): the filter support is scaled by the
//! downscale factor, each output pixel's weights are normalised to sum to 1,
//! then turned into 22-bit fixed point; the horizontal pass runs first and its
//! result is rounded and clamped to u8 before the vertical pass.
//!
//! `fast_image_resize` implements the same convolution but with 16-bit
//! coefficients and the vertical pass first for u8 images, so it differs from
//! Pillow by ±1 in places; doing the two passes ourselves costs little (the
//! model dominates) and lets us compute only the pixels the center crop keeps.

use std::ops::Range;

use super::RgbImage;

/// Pillow's fixed-point precision for 8-bit images (32 − 8 − 2).
const PRECISION_BITS: u32 = 22;

/// A resampling filter: its support radius (at scale 1) and kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    /// Keys' cubic convolution with a = −0.5 (Pillow `BICUBIC`).
    Bicubic,
    /// The triangle filter (Pillow `BILINEAR`).
    Bilinear,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Bicubic => 2.0,
            Filter::Bilinear => 1.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Filter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
        }
    }
}

/// Fixed-point weights of the output pixels `out` of a 1-D resize
/// `in_size` → `out_size`: per output pixel the first input index and its taps.
struct Coefficients {
    starts: Vec<usize>,
    taps: Vec<Vec<i32>>,
}

impl Coefficients {
    fn new(in_size: usize, out_size: usize, out: Range<usize>, filter: Filter) -> Self {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = filter.support() * filterscale;
        let inv = 1.0 / filterscale;
        let mut starts = Vec::with_capacity(out.len());
        let mut taps = Vec::with_capacity(out.len());
        for xx in out {
            let center = (xx as f64 + 0.5) * scale;
            // C's (int) cast truncates toward zero; negatives are clamped to 0 anyway.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64)
                .min(in_size as i64)
                .max(xmin as i64) as usize;
            let w: Vec<f64> = (xmin..xmax)
                .map(|x| filter.weight((x as f64 - center + 0.5) * inv))
                .collect();
            let total: f64 = w.iter().sum();
            let fixed = w
                .iter()
                .map(|&k| {
                    let k = if total != 0.0 { k / total } else { k };
                    let v = k * (1u32 << PRECISION_BITS) as f64;
                    // Pillow rounds half away from zero, then truncates.
                    if v < 0.0 {
                        (v - 0.5).trunc() as i32
                    } else {
                        (v + 0.5).trunc() as i32
                    }
                })
                .collect();
            starts.push(xmin);
            taps.push(fixed);
        }
        Self { starts, taps }
    }

    /// The input range the given outputs read.
    fn input_span(&self) -> Range<usize> {
        let lo = self.starts.iter().copied().min().unwrap_or(0);
        let hi = self
            .starts
            .iter()
            .zip(&self.taps)
            .map(|(s, t)| s + t.len())
            .max()
            .unwrap_or(0);
        lo..hi.max(lo)
    }
}

#[inline]
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes `src` to `out_w`×`out_h` as Pillow's `Image.resize` does and
/// returns only the window `cols`×`rows` of the result (the center crop), which
/// is bit-identical to resizing fully and cropping afterwards.
pub(crate) fn resize_window(
    src: &RgbImage,
    out_w: usize,
    out_h: usize,
    cols: Range<usize>,
    rows: Range<usize>,
    filter: Filter,
) -> RgbImage {
    let (in_w, in_h) = (src.width, src.height);
    let crop_w = cols.len();
    let crop_h = rows.len();
    // Horizontal pass (skipped when the width is unchanged, as Pillow does).
    let vert = (out_h != in_h).then(|| Coefficients::new(in_h, out_h, rows.clone(), filter));
    let src_rows = match &vert {
        Some(v) => v.input_span(),
        None => rows.clone(),
    };
    let horizontal: RgbImage = if out_w != in_w {
        let h = Coefficients::new(in_w, out_w, cols.clone(), filter);
        let mut data = vec![0u8; crop_w * src_rows.len() * 3];
        for (yi, y) in src_rows.clone().enumerate() {
            let line = &src.data[y * in_w * 3..(y + 1) * in_w * 3];
            let out = &mut data[yi * crop_w * 3..(yi + 1) * crop_w * 3];
            for (xi, (start, taps)) in h.starts.iter().zip(&h.taps).enumerate() {
                let mut acc = [1i32 << (PRECISION_BITS - 1); 3];
                for (k, &w) in taps.iter().enumerate() {
                    let px = &line[(start + k) * 3..(start + k) * 3 + 3];
                    acc[0] += px[0] as i32 * w;
                    acc[1] += px[1] as i32 * w;
                    acc[2] += px[2] as i32 * w;
                }
                out[xi * 3] = clip8(acc[0]);
                out[xi * 3 + 1] = clip8(acc[1]);
                out[xi * 3 + 2] = clip8(acc[2]);
            }
        }
        RgbImage {
            width: crop_w,
            height: src_rows.len(),
            data,
        }
    } else {
        let mut data = Vec::with_capacity(crop_w * src_rows.len() * 3);
        for y in src_rows.clone() {
            data.extend_from_slice(
                &src.data[(y * in_w + cols.start) * 3..(y * in_w + cols.end) * 3],
            );
        }
        RgbImage {
            width: crop_w,
            height: src_rows.len(),
            data,
        }
    };
    let Some(v) = vert else {
        return horizontal;
    };
    // Vertical pass over the rows the crop keeps; row indices are relative to src_rows.
    let stride = crop_w * 3;
    let mut data = vec![0u8; crop_h * stride];
    let mut acc = vec![0i32; stride];
    for (yi, (start, taps)) in v.starts.iter().zip(&v.taps).enumerate() {
        acc.fill(1i32 << (PRECISION_BITS - 1));
        for (k, &w) in taps.iter().enumerate() {
            let y = start + k - src_rows.start;
            let line = &horizontal.data[y * stride..(y + 1) * stride];
            for (a, &p) in acc.iter_mut().zip(line) {
                *a += p as i32 * w;
            }
        }
        for (o, &a) in data[yi * stride..(yi + 1) * stride].iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    RgbImage {
        width: crop_w,
        height: crop_h,
        data,
    }
}

/// A full Pillow resize (no crop).
pub fn resize(src: &RgbImage, out_w: usize, out_h: usize, filter: Filter) -> RgbImage {
    resize_window(src, out_w, out_h, 0..out_w, 0..out_h, filter)
}
