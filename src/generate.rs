//! Text generation with a KV cache: the prompt is run once, then one token per
//! step. Sampling follows Hugging Face transformers' conventions: temperature,
//! then top-k, then top-p (nucleus), greedy when temperature is 0. A merged
//! vision-language model generates the same way after an image.

use candle_core::{DType, Tensor, D};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::models::tokenformer::{Cache, TokenFormerLm};
use crate::models::vl::VisionLanguageModel;

#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 299_792_458,
        }
    }
}

/// Picks the next token from one row of logits.
pub(crate) struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self { params, rng }
    }

    pub(crate) fn sample(&mut self, logits: &[f32]) -> u32 {
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                    if v > best.1 {
                        (i, v)
                    } else {
                        best
                    }
                })
                .0 as u32
        };
        if self.params.temperature <= 0.0 {
            return argmax();
        }
        let t = self.params.temperature as f32;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / t))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if let Some(k) = self.params.top_k.filter(|&k| k > 0) {
            cand.truncate(k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if let Some(p) = self.params.top_p.filter(|&p| p < 1.0) {
            // Keep the smallest prefix whose mass reaches p (at least one token).
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&q| {
                    acc += q;
                    acc >= p as f32
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            cand.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, p) in probs.iter().enumerate() {
            r -= p;
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
    }
}

/// Generates up to `max_new_tokens` after `prompt`, calling `on_token` for each
/// new token as soon as it is chosen; stops after the EOS token.
pub fn generate(
    model: &TokenFormerLm,
    prompt: &[u32],
    max_new_tokens: usize,
    params: SamplingParams,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    let mut cache = Cache::new(model.config());
    decode(model, prompt, max_new_tokens, params, on_token, |ids| {
        let input = Tensor::new(ids, model.device())?.unsqueeze(0)?;
        model.forward(&input, Some(&mut cache))
    })
}

/// [`generate`] after an image: the mixed sequence [image tokens; prompt] of a
/// merged vision-language model, then text tokens one by one from its cache.
/// `pixels` is one preprocessed image [1, C, H, W].
pub fn generate_with_image(
    model: &VisionLanguageModel,
    pixels: &Tensor,
    prompt: &[u32],
    max_new_tokens: usize,
    params: SamplingParams,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    if pixels.dim(0)? != 1 {
        return Err(Error::input(format!(
            "generation takes one image, got a batch of {}",
            pixels.dim(0)?
        )));
    }
    let text = model.language();
    let mut cache = model.new_cache();
    let mut image = Some(pixels);
    decode(text, prompt, max_new_tokens, params, on_token, |ids| {
        let input = Tensor::new(ids, text.device())?.unsqueeze(0)?;
        // The image enters with the prompt, once; later steps read it from the cache.
        let (_, logits) = model.forward_mixed(image.take(), &input, Some(&mut cache))?;
        Ok(logits)
    })
}

/// The decode loop every model shares: `step` runs the model on the new ids
/// (the whole prompt first, then one token at a time, keeping its own cache)
/// and returns their logits [1, t, vocab]; `text` gives the vocabulary,
/// context length and EOS.
fn decode(
    text: &TokenFormerLm,
    prompt: &[u32],
    max_new_tokens: usize,
    params: SamplingParams,
    mut on_token: impl FnMut(u32) -> Result<()>,
    mut step: impl FnMut(&[u32]) -> candle_core::Result<Tensor>,
) -> Result<Vec<u32>> {
    let cfg = text.config();
    if prompt.is_empty() {
        return Err(Error::input("the prompt is empty: give at least one token"));
    }
    let max = cfg.max_position_embeddings;
    if prompt.len() >= max {
        return Err(Error::input(format!(
            "the prompt has {} tokens but the model's context is {max} positions: nothing can be generated",
            prompt.len()
        )));
    }
    text.check_ids(prompt)?;
    let budget = token_budget(max, prompt.len(), max_new_tokens);
    let mut sampler = Sampler::new(params);
    let mut out = Vec::with_capacity(budget);
    let mut input = prompt.to_vec();
    for _ in 0..budget {
        let logits = step(&input)?;
        let last = logits.squeeze(0)?.get(logits.dim(1)? - 1)?;
        let next = sampler.sample(&last.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        out.push(next);
        on_token(next)?;
        if next == cfg.eos_token_id {
            break;
        }
        input = vec![next];
    }
    Ok(out)
}

/// The most tokens generation produces: `max_new_tokens`, or fewer when the
/// prompt and they would pass the model's `max_positions` — it stops at the
/// context rather than run on positions the model was never trained on (a
/// caller may want to say so; see [`generate`]).
pub fn token_budget(max_positions: usize, prompt_len: usize, max_new_tokens: usize) -> usize {
    max_new_tokens.min(max_positions.saturating_sub(prompt_len))
}

/// Log-softmax over the vocabulary of logits [.., vocab].
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(logits, D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_filters() {
        let logits = [0.0f32, 3.0, 1.0, 2.9];
        assert_eq!(Sampler::new(SamplingParams::default()).sample(&logits), 1);
        // top-k 1 is greedy whatever the temperature.
        let p = SamplingParams {
            temperature: 5.0,
            top_k: Some(1),
            ..Default::default()
        };
        assert_eq!(Sampler::new(p).sample(&logits), 1);
        // top-p keeps only tokens 1 and 3 (the two large logits).
        let p = SamplingParams {
            temperature: 1.0,
            top_p: Some(0.8),
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits)).collect();
        assert!(picks.iter().all(|&t| t == 1 || t == 3));
        assert!(picks.contains(&1) && picks.contains(&3));
    }
}
