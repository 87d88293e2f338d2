//! The converters' self-check (Hugging Face's "Looks ok!" habit): run the
//! source and the result on the same probe input and report the largest
//! logit difference.

use anyhow::Result;
use candle_core::{Device, Tensor, D};
use tokenformer::models::tokenformer::TokenFormerLm;

/// A deterministic token sequence spread over the vocabulary.
pub fn probe_ids(vocab: usize, max_positions: usize) -> Vec<u32> {
    let n = 24.min(max_positions).max(1);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// A random-looking but fixed image [1, C, S, S] of normalised pixels,
/// uniform in [-2, 2) (about the range of ImageNet-normalised values), so a
/// vision model's probe exercises every patch and channel differently.
pub fn probe_pixels(channels: usize, size: usize, device: &Device) -> Result<Tensor> {
    let n = channels * size * size;
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // The top 24 bits as a uniform in [0, 1), exactly representable in f32.
            ((x >> 40) as f32 / (1u32 << 24) as f32) * 4.0 - 2.0
        })
        .collect();
    Ok(Tensor::from_vec(v, (1, channels, size, size), device)?)
}

/// Logits [t, vocab] of a language model on the probe sequence.
pub fn lm_logits(model: &TokenFormerLm) -> Result<Tensor> {
    let cfg = model.config();
    let ids = probe_ids(cfg.vocab_size, cfg.max_position_embeddings);
    let input = Tensor::new(ids.as_slice(), model.device())?.unsqueeze(0)?;
    Ok(model.forward(&input, None)?.squeeze(0)?)
}

/// max |a − b| over all elements.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?
        .abs()?
        .flatten_all()?
        .max(D::Minus1)?
        .to_scalar::<f32>()?)
}

/// Prints the comparison and says whether it is within `tolerance`.
pub fn report(what: &str, diff: f32, tolerance: f32) -> bool {
    let ok = diff <= tolerance;
    println!(
        "probe: max |Δ logit| between {what} = {diff:.3e} (tolerance {tolerance:.0e}){}",
        if ok { ". Looks ok!" } else { ": MISMATCH" }
    );
    ok
}
