//! Text generation with a KV cache: the prompt is run once, then one token per
//! step. Sampling follows Hugging Face transformers' conventions: repetition
//! penalty, temperature, then top-k, then top-p (nucleus), greedy when
//! temperature is 0. A merged vision-language model generates the same way
//! after an image. [`TextStream`] turns the tokens into text as they come and
//! ends generation at a stop string.

use std::ops::ControlFlow;

use candle_core::{DType, Tensor, D};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::models::tokenformer::{Cache, KvDtype, Logits, TokenFormerLm};
use crate::models::vl::{VisionLanguageModel, VlCache};

mod batch;
mod queue;
pub use batch::{
    generate_batch, generate_batch_with_images, generate_texts, generate_texts_with_images,
    DEFAULT_BATCH_SIZE,
};
pub use queue::{serve_jobs, Event, Job, Logprobs, MAX_TOP_LOGPROBS};

#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
    /// Divides a positive logit (multiplies a negative one) of every token
    /// seen in the last `repeat_last_n` tokens, as transformers'
    /// `repetition_penalty` does; 1 is off.
    pub repeat_penalty: f32,
    /// How many of the latest tokens (prompt included) the penalty looks at;
    /// 0 means all of them, as in transformers.
    pub repeat_last_n: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 299_792_458,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
        }
    }
}

impl SamplingParams {
    /// Checks each setting's range, as transformers' logits processors do: a finite
    /// temperature ≥ 0, top_p in [0, 1], a finite repeat_penalty > 0.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::option(
                "temperature",
                format!("must be a finite number ≥ 0 (0: greedy), got {t}"),
            ));
        }
        if let Some(p) = self.top_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return Err(Error::option(
                "top_p",
                format!("must be between 0 and 1, got {p}"),
            ));
        }
        let r = self.repeat_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(Error::option(
                "repeat_penalty",
                format!("must be a positive number (1: off), got {r}"),
            ));
        }
        Ok(())
    }
}

/// Picks the next token from one row of logits.
pub(crate) struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// The index of the first largest value (0 for an empty row or one of NaNs;
/// a NaN never wins).
pub(crate) fn first_argmax<T: Copy + Into<f64>>(row: &[T]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f64::NEG_INFINITY), |best, (i, &v)| {
            let v = v.into();
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        })
        .0
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Self { params, rng }
    }

    /// The next token after `history` from the last position's logits
    /// [vocab] on any device. A greedy pick without a penalty on a GPU with
    /// the CUDA kernels on is the log-softmax-gather kernel's first argmax, so
    /// only the token comes back to the host; otherwise the row does and is
    /// [`Self::sample`]d.
    pub(crate) fn next(&mut self, last: &Tensor, history: &[u32]) -> Result<u32> {
        #[cfg(feature = "cuda")]
        if self.params.temperature <= 0.0 && self.params.repeat_penalty == 1.0 {
            let row = last.unsqueeze(0)?;
            if crate::kernels::logprob_cuda_serves(&row) {
                return Ok(crate::kernels::cuda::target_logprobs(&row, &[0])?.argmax[0]);
            }
        }
        let row = last.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        Ok(self.sample(&row, history))
    }

    /// The next token after `history` (the prompt and what was generated).
    pub(crate) fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let penalised;
        let logits = if self.params.repeat_penalty != 1.0 && !history.is_empty() {
            penalised = self.penalise(logits, history);
            &penalised[..]
        } else {
            logits
        };
        if self.params.temperature <= 0.0 {
            return first_argmax(logits) as u32;
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

    fn penalise(&self, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let (p, n) = (self.params.repeat_penalty, self.params.repeat_last_n);
        let window = if n == 0 {
            history
        } else {
            &history[history.len().saturating_sub(n)..]
        };
        let mut out = logits.to_vec();
        let mut seen = vec![false; out.len()];
        for &t in window {
            let Some(l) = out.get_mut(t as usize) else {
                continue;
            };
            if !std::mem::replace(&mut seen[t as usize], true) {
                *l = if *l < 0.0 { *l * p } else { *l / p };
            }
        }
        out
    }
}

/// Generated tokens as text, decoded as they come: [`push`](Self::push)
/// returns the text that is safe to show (never half a character, never
/// the start of what may become a stop string) and says when a stop string
/// was reached. The text ends before the stop string, as
/// lm-evaluation-harness's `until` and the OpenAI API do.
pub struct TextStream<'t> {
    tokenizer: &'t tokenizers::Tokenizer,
    stop: Vec<String>,
    ids: Vec<u32>,
    text: String,
    shown: usize,
    stopped: bool,
}

impl<'t> TextStream<'t> {
    /// Empty stop strings are ignored.
    pub fn new(tokenizer: &'t tokenizers::Tokenizer, stop: &[impl AsRef<str>]) -> Self {
        Self {
            tokenizer,
            stop: stop
                .iter()
                .map(|s| s.as_ref().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            ids: Vec::new(),
            text: String::new(),
            shown: 0,
            stopped: false,
        }
    }

    /// Adds one generated token: the new text to show, and `Break` once a
    /// stop string has appeared (later tokens are ignored).
    pub fn push(&mut self, id: u32) -> Result<(String, ControlFlow<()>)> {
        if self.stopped {
            return Ok((String::new(), ControlFlow::Break(())));
        }
        self.ids.push(id);
        self.text = self
            .tokenizer
            .decode(&self.ids, false)
            .map_err(|e| Error::input(format!("decoding the generated tokens: {e}")))?;
        let first_stop = self
            .stop
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min();
        let end = match first_stop {
            Some(at) => {
                self.text.truncate(at);
                self.stopped = true;
                at
            }
            None => self.safe_end(),
        };
        let new = match self.text.get(self.shown..end) {
            Some(piece) if end > self.shown => piece.to_string(),
            _ => String::new(),
        };
        self.shown = self.shown.max(end);
        let flow = if self.stopped {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        };
        Ok((new, flow))
    }

    /// What was held back when generation ended without a stop string.
    pub fn rest(&mut self) -> String {
        let rest = self.text.get(self.shown..).unwrap_or_default().to_string();
        self.shown = self.text.len();
        rest
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The whole generated text (up to the stop string, if one came).
    pub fn into_text(self) -> String {
        self.text
    }

    /// The end of the text that is safe to show now: before a trailing
    /// partial character (U+FFFD) and before a suffix that begins a stop string.
    fn safe_end(&self) -> usize {
        let text = self.text.trim_end_matches('\u{FFFD}');
        let hold = self
            .stop
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k) && text.ends_with(&s[..k]))
                    .max()
            })
            .max()
            .unwrap_or(0);
        text.len() - hold
    }
}

/// Why a generation ended, named as text-generation-inference names it
/// ([`FinishReason::as_str`], which is also its JSON form).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model chose its end-of-text token.
    EosToken,
    /// A stop string appeared (the text ends before it).
    StopSequence,
    /// The token budget (or the model's context) ran out.
    Length,
}

impl FinishReason {
    /// `eos_token`, `stop_sequence` or `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EosToken => "eos_token",
            Self::StopSequence => "stop_sequence",
            Self::Length => "length",
        }
    }

    /// Why the generation of `tokens`, decoded by `stream`, ended.
    pub fn of(tokens: &[u32], eos: u32, stream: &TextStream) -> Self {
        if stream.stopped() {
            Self::StopSequence
        } else if tokens.last() == Some(&eos) {
            Self::EosToken
        } else {
            Self::Length
        }
    }
}

impl serde::Serialize for FinishReason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// One prompt's finished generation.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Generation {
    /// The continuation (before a stop string, without the end-of-text token).
    pub generated_text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Tokens the model produced, an end-of-text token included.
    pub generated_tokens: usize,
}

/// Generates up to `max_new_tokens` after `prompt`, calling `on_token` for each
/// new token as soon as it is chosen; stops after the EOS token or when
/// `on_token` says `Break` (e.g. at a stop string, see [`TextStream`]).
pub fn generate(
    model: &TokenFormerLm,
    prompt: &[u32],
    max_new_tokens: usize,
    params: SamplingParams,
    on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<u32>> {
    let cache = Cache::new(model.config());
    generate_in(model, cache, prompt, max_new_tokens, params, on_token)
}

/// [`generate`] with keys and values cached in `kv` precision.
pub fn generate_with_kv(
    model: &TokenFormerLm,
    kv: KvDtype,
    prompt: &[u32],
    max_new_tokens: usize,
    params: SamplingParams,
    on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<u32>> {
    let cache = Cache::with_dtype(model.config(), kv);
    generate_in(model, cache, prompt, max_new_tokens, params, on_token)
}

fn generate_in(
    model: &TokenFormerLm,
    mut cache: Cache,
    prompt: &[u32],
    max_new_tokens: usize,
    params: SamplingParams,
    on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<u32>> {
    decode(model, prompt, max_new_tokens, params, on_token, |ids| {
        let input = Tensor::new(ids, model.device())?.unsqueeze(0)?;
        model.forward_with(&input, Some(&mut cache), Logits::Last)
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
    on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<u32>> {
    let cache = model.new_cache();
    generate_with_image_in(
        model,
        cache,
        pixels,
        prompt,
        max_new_tokens,
        params,
        on_token,
    )
}

/// [`generate_with_image`] with keys and values cached in `kv` precision.
pub fn generate_with_image_kv(
    model: &VisionLanguageModel,
    kv: KvDtype,
    pixels: &Tensor,
    prompt: &[u32],
    max_new_tokens: usize,
    params: SamplingParams,
    on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<u32>> {
    let cache = model.new_cache_with_dtype(kv);
    generate_with_image_in(
        model,
        cache,
        pixels,
        prompt,
        max_new_tokens,
        params,
        on_token,
    )
}

fn generate_with_image_in(
    model: &VisionLanguageModel,
    mut cache: VlCache,
    pixels: &Tensor,
    prompt: &[u32],
    max_new_tokens: usize,
    params: SamplingParams,
    on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<Vec<u32>> {
    one_image(pixels)?;
    let text = model.language();
    let mut image = Some(pixels);
    decode(text, prompt, max_new_tokens, params, on_token, |ids| {
        let input = Tensor::new(ids, text.device())?.unsqueeze(0)?;
        // The image enters with the prompt, once; later steps read it from the cache.
        let (_, logits) =
            model.forward_mixed_with(image.take(), &input, Some(&mut cache), Logits::Last)?;
        Ok(logits)
    })
}

/// Refuses pixels [b, C, H, W] with b other than 1: a generation follows one image.
fn one_image(pixels: &Tensor) -> Result<()> {
    match pixels.dim(0)? {
        1 => Ok(()),
        n => Err(Error::input(format!(
            "generation takes one image, got a batch of {n}"
        ))),
    }
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
    mut on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
    mut step: impl FnMut(&[u32]) -> candle_core::Result<Tensor>,
) -> Result<Vec<u32>> {
    params.validate()?;
    let budget = check_prompt(text, prompt, max_new_tokens)?;
    if budget == 0 {
        return Ok(Vec::new());
    }
    let mut seq = Sequence::new(0, prompt, budget, &params);
    let eos = text.config().eos_token_id;
    let mut on_token = |_: usize, t: u32, _: &Tensor| on_token(t);
    let mut input = prompt.to_vec();
    loop {
        let logits = step(&input)?;
        let last = logits.squeeze(0)?.get(logits.dim(1)? - 1)?;
        if seq.take(&last, eos, &mut on_token)? {
            return Ok(seq.out);
        }
        input = vec![seq.last()];
    }
}

/// Checks a prompt for `text`'s generation (not empty, shorter than the
/// context, ids in the vocabulary) and returns its token budget.
pub fn check_prompt(text: &TokenFormerLm, prompt: &[u32], max_new_tokens: usize) -> Result<usize> {
    if prompt.is_empty() {
        return Err(Error::input("the prompt is empty: give at least one token"));
    }
    let max = text.config().max_position_embeddings;
    if prompt.len() >= max {
        return Err(Error::input(format!(
            "the prompt has {} tokens but the model's context is {max} positions: nothing can be generated",
            prompt.len()
        )));
    }
    text.check_ids(prompt)?;
    Ok(token_budget(max, prompt.len(), max_new_tokens))
}

/// A sequence being generated: its sampler, what it has chosen and when it ends.
struct Sequence {
    /// Its prompt's place (in [`generate_batch`]).
    index: usize,
    sampler: Sampler,
    /// The prompt and the tokens chosen so far.
    history: Vec<u32>,
    out: Vec<u32>,
    budget: usize,
}

impl Sequence {
    fn new(index: usize, prompt: &[u32], budget: usize, params: &SamplingParams) -> Self {
        Self {
            index,
            sampler: Sampler::new(params.clone()),
            history: prompt.to_vec(),
            out: Vec::with_capacity(budget),
            budget,
        }
    }

    /// The latest token (of the prompt, before any was chosen).
    fn last(&self) -> u32 {
        self.history[self.history.len() - 1]
    }

    /// Chooses the next token from the last position's logits [vocab]; true
    /// when the sequence has ended: `on_token` said `Break`, it was the EOS
    /// token, or the budget is spent.
    fn take(
        &mut self,
        last: &Tensor,
        eos: u32,
        on_token: &mut impl FnMut(usize, u32, &Tensor) -> Result<ControlFlow<()>>,
    ) -> Result<bool> {
        let next = self.sampler.next(last, &self.history)?;
        self.out.push(next);
        self.history.push(next);
        let stop = on_token(self.index, next, last)?.is_break();
        Ok(stop || next == eos || self.out.len() >= self.budget)
    }
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
    fn first_argmax_takes_the_first_of_ties_and_skips_nans() {
        assert_eq!(first_argmax(&[1.0f32, 3.0, 3.0, 2.0]), 1);
        assert_eq!(first_argmax(&[f32::NAN, 1.0, 2.0, f32::NAN]), 2);
        assert_eq!(first_argmax(&[0.5f64, f64::NEG_INFINITY]), 0);
        assert_eq!(first_argmax::<f32>(&[]), 0);
    }

    #[test]
    fn sampling_settings_out_of_range_are_refused_by_name() {
        let ok = SamplingParams::default();
        ok.validate().unwrap();
        for top_p in [0.0, 0.5, 1.0] {
            let p = SamplingParams {
                top_p: Some(top_p),
                temperature: 0.7,
                ..ok.clone()
            };
            p.validate().unwrap();
        }
        let bad = [
            (
                "temperature",
                SamplingParams {
                    temperature: -0.5,
                    ..ok.clone()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: f64::NAN,
                    ..ok.clone()
                },
            ),
            (
                "temperature",
                SamplingParams {
                    temperature: f64::INFINITY,
                    ..ok.clone()
                },
            ),
            (
                "top_p",
                SamplingParams {
                    top_p: Some(1.5),
                    ..ok.clone()
                },
            ),
            (
                "top_p",
                SamplingParams {
                    top_p: Some(-0.1),
                    ..ok.clone()
                },
            ),
            (
                "top_p",
                SamplingParams {
                    top_p: Some(f64::NAN),
                    ..ok.clone()
                },
            ),
            (
                "repeat_penalty",
                SamplingParams {
                    repeat_penalty: 0.0,
                    ..ok.clone()
                },
            ),
            (
                "repeat_penalty",
                SamplingParams {
                    repeat_penalty: f32::NAN,
                    ..ok.clone()
                },
            ),
        ];
        for (name, p) in bad {
            match p.validate() {
                Err(Error::Option { option, .. }) => assert_eq!(option, name, "{p:?}"),
                other => panic!("{p:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn greedy_and_filters() {
        let logits = [0.0f32, 3.0, 1.0, 2.9];
        assert_eq!(
            Sampler::new(SamplingParams::default()).sample(&logits, &[]),
            1
        );
        // top-k 1 is greedy whatever the temperature.
        let p = SamplingParams {
            temperature: 5.0,
            top_k: Some(1),
            ..Default::default()
        };
        assert_eq!(Sampler::new(p).sample(&logits, &[]), 1);
        // top-p keeps only tokens 1 and 3 (the two large logits).
        let p = SamplingParams {
            temperature: 1.0,
            top_p: Some(0.8),
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits, &[])).collect();
        assert!(picks.iter().all(|&t| t == 1 || t == 3));
        assert!(picks.contains(&1) && picks.contains(&3));
    }

    #[test]
    fn repetition_penalty() {
        let logits = [2.0f32, -1.0, 1.5];
        let p = SamplingParams {
            repeat_penalty: 2.0,
            ..Default::default()
        };
        let s = Sampler::new(p.clone());
        // Seen tokens: 2 → 1 (divided), −1 → −2 (multiplied), each once however often seen.
        assert_eq!(s.penalise(&logits, &[0, 1, 0, 0]), vec![1.0, -2.0, 1.5]);
        assert_eq!(Sampler::new(p.clone()).sample(&logits, &[0, 1]), 2);
        // Only the last token is in a window of 1, so token 0 keeps its lead.
        let last1 = SamplingParams {
            repeat_last_n: 1,
            ..p.clone()
        };
        assert_eq!(Sampler::new(last1).sample(&logits, &[0, 1]), 0);
        // The default window of 64 sees only the 2s; 0 = the whole history
        // sees the 0 too. Ids past the vocabulary are ignored.
        let logits = [2.0f32, 1.9, 1.0];
        let history: Vec<u32> = [0, 7].into_iter().chain([2; 70]).collect();
        assert_eq!(Sampler::new(p.clone()).sample(&logits, &history), 0);
        let all = SamplingParams {
            repeat_last_n: 0,
            ..p
        };
        assert_eq!(Sampler::new(all).sample(&logits, &history), 1);
    }

    fn tokenizer() -> tokenizers::Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/gpt-neox-20b-tokenizer.json"
        );
        tokenizers::Tokenizer::from_file(path).unwrap()
    }

    /// Streams `text`'s tokens with `stop`: (pieces shown, final text, token index that stopped).
    fn stream(
        tok: &tokenizers::Tokenizer,
        text: &str,
        stop: &[&str],
    ) -> (Vec<String>, String, Option<usize>) {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let mut s = TextStream::new(tok, stop);
        let (mut pieces, mut stopped_at) = (vec![], None);
        for (i, &id) in ids.iter().enumerate() {
            let (piece, flow) = s.push(id).unwrap();
            pieces.push(piece);
            if flow.is_break() {
                stopped_at = Some(i);
                break;
            }
        }
        pieces.push(s.rest());
        (pieces, s.into_text(), stopped_at)
    }

    #[test]
    fn stop_strings_end_the_text_before_them() {
        let tok = tokenizer();
        let text = "Question: what is 2+2?\nAnswer: 4\n\nQuestion: next";
        let (pieces, out, at) = stream(&tok, text, &["\n\n", "Question: n"]);
        assert_eq!(out, "Question: what is 2+2?\nAnswer: 4");
        assert_eq!(pieces.concat(), out);
        // The stream stops at the token that completes the stop string, not later.
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let first = (1..=ids.len())
            .find(|&n| tok.decode(&ids[..n], false).unwrap().contains("\n\n"))
            .unwrap();
        assert_eq!(at, Some(first - 1));
        // No stop string: everything comes out, in order.
        let (pieces, out, at) = stream(&tok, text, &["zebra"]);
        assert_eq!(
            (pieces.concat(), out.as_str(), at),
            (text.to_string(), text, None)
        );
    }

    #[test]
    fn stream_holds_back_a_possible_stop_and_partial_characters() {
        let tok = tokenizer();
        // "Ans" could begin "Answer:"; it is shown only once it cannot.
        let mut s = TextStream::new(&tok, &["Answer:"]);
        let ids = tok.encode("x Ans", false).unwrap().get_ids().to_vec();
        let shown: String = ids.iter().map(|&i| s.push(i).unwrap().0).collect();
        assert_eq!(shown, "x ");
        assert_eq!(s.rest(), "Ans");
        // A character split over byte tokens is never shown in halves.
        let mut s = TextStream::new(&tok, &[] as &[&str]);
        let ids = tok
            .encode("日本語のテキスト", false)
            .unwrap()
            .get_ids()
            .to_vec();
        let pieces: Vec<String> = ids.iter().map(|&i| s.push(i).unwrap().0).collect();
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!(pieces.concat() + &s.rest(), "日本語のテキスト");
    }
}
