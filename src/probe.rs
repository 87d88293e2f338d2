//! The fixed inputs the converters run a source model and its conversion on
//! to report how far apart they are (Hugging Face's "Looks ok!" check in
//! their conversion scripts): a token sequence and an image, both from one
//! seeded linear congruential generator so they are the same on every machine,
//! and the one measure of "how far apart" that the converters and tests share.

use candle_core::{Device, Result, Tensor, D};

/// Knuth's MMIX LCG from `seed`: a deterministic stream of 64-bit states.
fn lcg(seed: u64) -> impl Iterator<Item = u64> {
    std::iter::successors(Some(seed), |x| {
        Some(
            x.wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407),
        )
    })
    .skip(1)
}

/// A token sequence spread over the vocabulary (24 tokens, fewer if the
/// model has fewer positions).
pub fn probe_ids(vocab: usize, max_positions: usize) -> Vec<u32> {
    let n = 24.min(max_positions).max(1);
    lcg(0x9E37_79B9_7F4A_7C15)
        .take(n)
        .map(|x| ((x >> 33) % vocab as u64) as u32)
        .collect()
}

/// `images` random-looking images [images, C, S, S] of normalised pixels,
/// uniform in [-2, 2) (about the range of ImageNet-normalised values), so a
/// vision model's probe exercises every patch and channel differently. The
/// first image is the same whatever `images` is.
pub fn probe_pixels(
    images: usize,
    channels: usize,
    size: usize,
    device: &Device,
) -> Result<Tensor> {
    let n = images * channels * size * size;
    let v: Vec<f32> = lcg(0x2545_F491_4F6C_DD1D)
        .take(n)
        // The top 24 bits as a uniform in [0, 1), exactly representable in f32.
        .map(|x| ((x >> 40) as f32 / (1u32 << 24) as f32) * 4.0 - 2.0)
        .collect();
    Tensor::from_vec(v, (images, channels, size, size), device)
}

/// max |a − b| over all elements (both f32, same shape).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?
        .abs()?
        .flatten_all()?
        .max(D::Minus1)?
        .to_scalar::<f32>()
}
