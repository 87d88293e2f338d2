//! The converters' self-check (Hugging Face's "Looks ok!" habit): run the
//! source and the result on the same probe input and report the largest
//! logit difference.

use crate::stdout::outln;
use anyhow::{bail, Result};
use candle_core::Tensor;
use tokenformer::models::tokenformer::TokenFormerLm;

/// The probe inputs live in the library, so the tests that check the
/// reported shift run on the same ones.
pub use tokenformer::probe::{max_abs_diff, probe_ids, probe_pixels};

/// Logits [t, vocab] of a language model on the probe sequence.
pub fn lm_logits(model: &TokenFormerLm) -> Result<Tensor> {
    let cfg = model.config();
    let ids = probe_ids(cfg.vocab_size, cfg.max_position_embeddings);
    let input = Tensor::new(ids.as_slice(), model.device())?.unsqueeze(0)?;
    Ok(model.forward(&input, None)?.squeeze(0)?)
}

/// Prints the comparison and says whether it is within `tolerance`.
pub fn report(what: &str, diff: f32, tolerance: f32) -> std::io::Result<bool> {
    let ok = diff <= tolerance;
    outln!(
        "probe: max |Δ logit| between {what} = {diff:.3e} (tolerance {tolerance:.0e}){}",
        if ok { ". Looks ok!" } else { ": MISMATCH" }
    )?;
    Ok(ok)
}

/// [`report`], then fails with "`failure` (max |Δ logit| …); nothing was written" if
/// the difference is above `tolerance`.
pub fn require(what: &str, diff: f32, tolerance: f32, failure: &str) -> Result<()> {
    if !report(what, diff, tolerance)? {
        bail!("{failure} (max |Δ logit| {diff:e}); nothing was written");
    }
    Ok(())
}
