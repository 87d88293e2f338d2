//! Batched generation, as continuous batching does it: each prompt runs
//! alone once (its prefill), then the sequences in flight take one decode
//! step together, reading the weights once for all of them, and a finished
//! sequence's place goes to the next prompt. A language model's prompts are
//! text; a vision-language model's may each come with an image.

use std::ops::ControlFlow;

use candle_core::Tensor;

use super::{
    check_prompt, one_image, FinishReason, Generation, SamplingParams, Sequence, TextStream,
};
use crate::error::{Error, Result};
use crate::models::tokenformer::{Cache, KvDtype, Logits, TokenFormerLm};
use crate::models::vl::{VisionLanguageModel, VlCache};

/// Sequences [`generate_batch`] decodes together unless told otherwise: on 2
/// CPU cores, 8 made about 3× one sequence's tokens per second
/// (docs/PERFORMANCE.md); more mostly adds cache memory there.
pub const DEFAULT_BATCH_SIZE: usize = 8;

/// What batched decoding asks of a model.
pub(crate) trait Decoder {
    type Cache;
    /// The language model (vocabulary, context, EOS, prompt checks).
    fn text(&self) -> &TokenFormerLm;
    /// Prompt `i` run alone into a new cache sized for `positions` text
    /// tokens; the logits [t, vocab] of the positions `which` asks for.
    fn prefill(
        &self,
        i: usize,
        prompt: &[u32],
        positions: usize,
        which: Logits,
    ) -> Result<(Tensor, Self::Cache)>;
    /// One token for each sequence in flight (ids [n, 1]) → logits [n, 1, vocab].
    fn step(&self, ids: &Tensor, caches: &mut [&mut Self::Cache]) -> Result<Tensor>;
}

pub(crate) struct Text<'a> {
    pub model: &'a TokenFormerLm,
    pub kv: KvDtype,
}

impl Decoder for Text<'_> {
    type Cache = Cache;
    fn text(&self) -> &TokenFormerLm {
        self.model
    }
    fn prefill(
        &self,
        _: usize,
        prompt: &[u32],
        positions: usize,
        which: Logits,
    ) -> Result<(Tensor, Cache)> {
        let mut cache = Cache::for_positions(self.model.config(), self.kv, positions);
        let input = Tensor::new(prompt, self.model.device())?.unsqueeze(0)?;
        let logits = self.model.forward_with(&input, Some(&mut cache), which)?;
        Ok((logits.squeeze(0)?, cache))
    }
    fn step(&self, ids: &Tensor, caches: &mut [&mut Cache]) -> Result<Tensor> {
        Ok(self.model.forward_rows(ids, caches)?)
    }
}

struct WithImages<'a> {
    model: &'a VisionLanguageModel,
    kv: KvDtype,
    images: &'a [Tensor],
}

impl Decoder for WithImages<'_> {
    type Cache = VlCache;
    fn text(&self) -> &TokenFormerLm {
        self.model.language()
    }
    fn prefill(
        &self,
        i: usize,
        prompt: &[u32],
        positions: usize,
        which: Logits,
    ) -> Result<(Tensor, VlCache)> {
        let mut cache = self.model.new_cache_for(self.kv, positions);
        let input = Tensor::new(prompt, self.text().device())?.unsqueeze(0)?;
        let image = Some(&self.images[i]);
        let (_, logits) = self
            .model
            .forward_mixed_with(image, &input, Some(&mut cache), which)?;
        Ok((logits.squeeze(0)?, cache))
    }
    fn step(&self, ids: &Tensor, caches: &mut [&mut VlCache]) -> Result<Tensor> {
        Ok(self.model.forward_rows(ids, caches)?)
    }
}

/// [`super::generate_with_kv`] for many prompts, up to `batch_size` at a
/// time (see the module's header; [`TokenFormerLm::forward_rows`] takes the
/// steps). `on_token(i, token)` sees each token of prompt `i` as it is
/// chosen; `Break` ends that sequence. Each sequence samples with its own
/// generator seeded with `params.seed`, so prompt `i` gets what
/// [`super::generate_with_kv`] gives it alone, up to the float rounding of
/// the batched products. Returns each prompt's tokens, in the prompts' order.
pub fn generate_batch(
    model: &TokenFormerLm,
    kv: KvDtype,
    prompts: &[impl AsRef<[u32]>],
    max_new_tokens: usize,
    params: SamplingParams,
    batch_size: usize,
    on_token: impl FnMut(usize, u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<Vec<u32>>> {
    let text = Text { model, kv };
    decode_batch(&text, prompts, max_new_tokens, params, batch_size, on_token)
}

/// [`generate_batch`] for a vision-language model: prompt `i` after
/// `images[i]` ([1, C, H, W] pixels), as [`super::generate_with_image_kv`]
/// gives it alone, up to float rounding. (Text alone runs the merged
/// model's language route, [`crate::loader::load_lm`], with [`generate_batch`].)
#[allow(clippy::too_many_arguments)]
pub fn generate_batch_with_images(
    model: &VisionLanguageModel,
    kv: KvDtype,
    images: &[Tensor],
    prompts: &[impl AsRef<[u32]>],
    max_new_tokens: usize,
    params: SamplingParams,
    batch_size: usize,
    on_token: impl FnMut(usize, u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<Vec<u32>>> {
    let d = with_images(model, kv, images, prompts.len())?;
    decode_batch(&d, prompts, max_new_tokens, params, batch_size, on_token)
}

fn with_images<'a>(
    model: &'a VisionLanguageModel,
    kv: KvDtype,
    images: &'a [Tensor],
    prompts: usize,
) -> Result<WithImages<'a>> {
    if images.len() != prompts {
        return Err(Error::input(format!(
            "{prompts} prompts but {} images: one image each",
            images.len()
        )));
    }
    for (i, image) in images.iter().enumerate() {
        one_image(image).map_err(|e| Error::input(format!("prompt #{}: {e}", i + 1)))?;
    }
    Ok(WithImages { model, kv, images })
}

/// The continuous-batching loop over a fixed list of prompts.
fn decode_batch<D: Decoder>(
    d: &D,
    prompts: &[impl AsRef<[u32]>],
    max_new_tokens: usize,
    params: SamplingParams,
    batch_size: usize,
    mut on_token: impl FnMut(usize, u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<Vec<u32>>> {
    params.validate()?;
    let text = d.text();
    let budgets = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            check_prompt(text, p.as_ref(), max_new_tokens)
                .map_err(|e| Error::input(format!("prompt #{}: {e}", i + 1)))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut results = vec![Vec::new(); prompts.len()];
    let mut waiting = prompts.iter().zip(budgets).enumerate();
    run_batches(
        d,
        batch_size,
        |_| {
            waiting.next().map(|(key, (prompt, budget))| Start {
                key,
                prompt: prompt.as_ref().to_vec(),
                budget,
                params: params.clone(),
                prompt_logits: false,
            })
        },
        |_, _, _| Ok(()),
        |i, token, _| on_token(i, token),
        |i, out| results[i] = out,
    )?;
    Ok(results)
}

/// A sequence for [`run_batches`] to start: its prompt (checked with
/// [`check_prompt`]), token budget and sampling, under a caller's key, and
/// whether the caller wants the logits of every prompt position.
pub(crate) struct Start {
    pub key: usize,
    pub prompt: Vec<u32>,
    pub budget: usize,
    pub params: SamplingParams,
    pub prompt_logits: bool,
}

/// The continuous-batching loop over any [`Decoder`]: `next(idle)` gives the
/// next sequence to start (`idle`: none is in flight, so it may wait for
/// one; `None` then ends the loop), `on_prompt(key, prompt, logits)` sees the logits
/// [t, vocab] of every prompt position, from the prefill, of the sequences
/// that ask for them, `on_token(key, token, logits)` sees each
/// token with the logits [vocab] it was chosen from (`Break` ends that
/// sequence), and `on_end(key, tokens)` each finished sequence.
pub(crate) fn run_batches<D: Decoder>(
    d: &D,
    batch_size: usize,
    mut next: impl FnMut(bool) -> Option<Start>,
    mut on_prompt: impl FnMut(usize, &[u32], &Tensor) -> Result<()>,
    mut on_token: impl FnMut(usize, u32, &Tensor) -> Result<ControlFlow<()>>,
    mut on_end: impl FnMut(usize, Vec<u32>),
) -> Result<()> {
    if batch_size == 0 {
        return Err(Error::option("batch_size", "must be at least 1"));
    }
    let text = d.text();
    let eos = text.config().eos_token_id;
    // The sequences in flight, each with its own cache.
    let mut flight: Vec<(Sequence, D::Cache)> = Vec::with_capacity(batch_size);
    loop {
        while flight.len() < batch_size {
            let Some(start) = next(flight.is_empty()) else {
                break;
            };
            if start.budget == 0 && !start.prompt_logits {
                on_end(start.key, Vec::new());
                continue;
            }
            let prompt = &start.prompt;
            let which = if start.prompt_logits {
                Logits::All
            } else {
                Logits::Last
            };
            let positions = prompt.len() + start.budget;
            let (logits, cache) = d.prefill(start.key, prompt, positions, which)?;
            if start.prompt_logits {
                on_prompt(start.key, prompt, &logits)?;
            }
            if start.budget == 0 {
                on_end(start.key, Vec::new());
                continue;
            }
            let mut seq = Sequence::new(start.key, prompt, start.budget, &start.params);
            let last = logits.get(logits.dim(0)? - 1)?;
            if seq.take(&last, eos, &mut on_token)? {
                on_end(seq.index, seq.out);
            } else {
                flight.push((seq, cache));
            }
        }
        if flight.is_empty() {
            return Ok(());
        }
        let last: Vec<u32> = flight.iter().map(|(seq, _)| seq.last()).collect();
        let ids = Tensor::new(last, text.device())?.unsqueeze(1)?;
        let logits = {
            let mut caches: Vec<&mut D::Cache> = flight.iter_mut().map(|(_, c)| c).collect();
            d.step(&ids, &mut caches)?
        };
        let mut still = Vec::with_capacity(batch_size);
        for (r, (mut seq, cache)) in flight.drain(..).enumerate() {
            let row = logits.get(r)?.squeeze(0)?;
            if seq.take(&row, eos, &mut on_token)? {
                on_end(seq.index, seq.out);
            } else {
                still.push((seq, cache));
            }
        }
        flight = still;
    }
}

/// [`generate_batch`] as text: each prompt's continuation decoded by
/// `tokenizer`, ended at the first of the `stop` strings (before it), with
/// its finish reason and token counts. `on_token(i)` is called for each
/// token of prompt `i` (for progress).
#[allow(clippy::too_many_arguments)]
pub fn generate_texts(
    model: &TokenFormerLm,
    tokenizer: &tokenizers::Tokenizer,
    kv: KvDtype,
    prompts: &[impl AsRef<[u32]>],
    max_new_tokens: usize,
    params: SamplingParams,
    stop: &[impl AsRef<str>],
    batch_size: usize,
    on_token: impl FnMut(usize),
) -> Result<Vec<Generation>> {
    let d = Text { model, kv };
    texts(
        &d,
        tokenizer,
        prompts,
        max_new_tokens,
        params,
        stop,
        batch_size,
        on_token,
    )
}

/// [`generate_texts`] for a vision-language model, prompt `i` after
/// `images[i]` (see [`generate_batch_with_images`]).
#[allow(clippy::too_many_arguments)]
pub fn generate_texts_with_images(
    model: &VisionLanguageModel,
    tokenizer: &tokenizers::Tokenizer,
    kv: KvDtype,
    images: &[Tensor],
    prompts: &[impl AsRef<[u32]>],
    max_new_tokens: usize,
    params: SamplingParams,
    stop: &[impl AsRef<str>],
    batch_size: usize,
    on_token: impl FnMut(usize),
) -> Result<Vec<Generation>> {
    let d = with_images(model, kv, images, prompts.len())?;
    texts(
        &d,
        tokenizer,
        prompts,
        max_new_tokens,
        params,
        stop,
        batch_size,
        on_token,
    )
}

/// The text loop of [`generate_texts`] over any [`Decoder`].
#[allow(clippy::too_many_arguments)]
fn texts<D: Decoder>(
    d: &D,
    tokenizer: &tokenizers::Tokenizer,
    prompts: &[impl AsRef<[u32]>],
    max_new_tokens: usize,
    params: SamplingParams,
    stop: &[impl AsRef<str>],
    batch_size: usize,
    mut on_token: impl FnMut(usize),
) -> Result<Vec<Generation>> {
    let eos = d.text().config().eos_token_id;
    let mut streams: Vec<_> = prompts
        .iter()
        .map(|_| TextStream::new(tokenizer, stop))
        .collect();
    let tokens = decode_batch(d, prompts, max_new_tokens, params, batch_size, |i, id| {
        on_token(i);
        if id == eos {
            return Ok(ControlFlow::Continue(()));
        }
        Ok(streams[i].push(id)?.1)
    })?;
    Ok(streams
        .into_iter()
        .zip(tokens)
        .zip(prompts)
        .map(|((stream, out), prompt)| Generation {
            finish_reason: FinishReason::of(&out, eos, &stream),
            generated_text: stream.into_text(),
            prompt_tokens: prompt.as_ref().len(),
            generated_tokens: out.len(),
        })
        .collect())
}
