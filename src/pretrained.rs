//! The library's front door, in the spirit of `from_pretrained`: a model and
//! its tokenizer (or preprocessing) loaded together by name — a zoo name, a
//! Hub repo id `owner/name[@revision]` or a local path — with the text or
//! image in and log-probabilities, text or classes out.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};

use crate::device::{ComputeDtype, DeviceSpec};
use crate::error::{Error, Result};
use crate::eval::imagenet::{self, Prediction};
use crate::eval::{pile, tasks};
use crate::generate::{self, Generation, SamplingParams};
use crate::hub::HubClient;
use crate::loader::{self, LocateOptions, ModelFiles};
use crate::models::lm::{KvDtype, TokenFormerLm};
use crate::models::vit::VisionTransformer;
use crate::models::vl::VisionLanguageModel;
use crate::scoring::{self, Loglikelihood, Scorer, SequenceScore};
use crate::vision::EvalTransform;

/// Requests per forward pass of the facade's harness-style scoring (also
/// bounded by the scorer's token cap).
const SCORE_BATCH: usize = 16;

/// Images [`ImageTextModel::generate_batch`] holds preprocessed at a time.
const IMAGES_PER_ROUND: usize = 64;

/// The precision a language model's weight matrices are kept in when it
/// computes in f32 (with bf16 or f16 computation they are kept in that).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightPrecision {
    #[default]
    F32,
    /// Half the memory; exact for fp16 checkpoints (all released ones).
    F16,
    /// 8-bit blocks quantised at load, a small accuracy cost.
    Q8,
}

/// How [`LanguageModel::from_pretrained`], [`ImageClassifier::from_pretrained`]
/// and [`ImageTextModel::from_pretrained`] find and load a model.
#[derive(Debug, Default)]
pub struct PretrainedOptions {
    /// An official yml or a config.json to use instead of the model's.
    pub config: Option<PathBuf>,
    /// A tokenizer.json to use instead of the model's.
    pub tokenizer: Option<PathBuf>,
    /// With f32 computation only (`Q8`: language models only).
    pub weights: WeightPrecision,
    /// The dtype the model computes in (f32 unless asked: bf16 or f16 on a GPU).
    pub dtype: ComputeDtype,
    /// The precision generation caches keys and values in (language and merged models).
    pub kv_cache: KvDtype,
    /// The Hub client for zoo names and repo ids; `None` builds one from the
    /// environment (`HF_ENDPOINT`, `HF_HOME`, ...) when a download is needed.
    pub hub: Option<HubClient>,
    /// Where the model runs; a device that cannot be opened is an error
    /// ([`DeviceError`](crate::DeviceError)) raised before anything is
    /// downloaded or loaded.
    pub device: DeviceSpec,
}

impl PretrainedOptions {
    /// `weights` other than f32 go with f32 computation only.
    fn check_weights(&self) -> Result<()> {
        if self.dtype != ComputeDtype::F32 && self.weights != WeightPrecision::F32 {
            return Err(Error::input(format!(
                "weights {:?} apply to f32 computation; computing in {} keeps the weights in it",
                self.weights, self.dtype
            )));
        }
        Ok(())
    }

    fn locate(&self, name: &str) -> Result<ModelFiles> {
        let opts = LocateOptions {
            config: self.config.clone(),
            tokenizer: self.tokenizer.clone(),
            progress: None,
        };
        match &self.hub {
            Some(hub) => loader::locate_with(name, &opts, Some(hub)),
            None => loader::locate(name, &opts),
        }
    }
}

/// A TokenFormer language model with its tokenizer.
pub struct LanguageModel {
    model: TokenFormerLm,
    tokenizer: tokenizers::Tokenizer,
    source: String,
    kv_cache: KvDtype,
}

impl LanguageModel {
    /// Loads a language model (or a merged model's language route) and its tokenizer.
    pub fn from_pretrained(name: &str, opts: &PretrainedOptions) -> Result<Self> {
        let device = opts.device.resolve()?;
        opts.check_weights()?;
        if opts.weights == WeightPrecision::Q8 && !device.is_cpu() {
            return Err(Error::input(
                "8-bit weights run on the CPU only (their kernels are CPU kernels)",
            ));
        }
        let files = opts.locate(name)?;
        let tokenizer = loader::load_tokenizer(&files)?;
        let model = match (opts.dtype, opts.weights) {
            (ComputeDtype::F32, WeightPrecision::F32) => {
                loader::load_lm_as(&files, &device, DType::F32)?
            }
            (ComputeDtype::F32, WeightPrecision::F16) => {
                loader::load_lm_as(&files, &device, DType::F16)?
            }
            (ComputeDtype::F32, WeightPrecision::Q8) => loader::load_lm_q8(&files, &device)?,
            (d, _) => loader::load_lm_in(&files, &device, d.dtype())?,
        };
        Ok(Self {
            model,
            tokenizer,
            source: files.source,
            kv_cache: opts.kv_cache,
        })
    }

    /// Where it was loaded from (`owner/name@revision` or a path).
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn model(&self) -> &TokenFormerLm {
        &self.model
    }

    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// The token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        encode(&self.tokenizer, text)
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| Error::input(format!("decoding: {e}")))
    }

    /// The next-token logits [ids.len(), vocab] (f32, on the model's device)
    /// at every position of `ids`: transformers' `model(ids).logits[0]`.
    pub fn logits(&self, ids: &[u32]) -> Result<Tensor> {
        scoring::logits(&self.model, ids)
    }

    /// Scores `text`: the log-probability of each token given the ones
    /// before it (the first token is context only), the argmax, NLL and
    /// perplexity.
    pub fn score(&self, text: &str) -> Result<SequenceScore> {
        scoring::score_ids(&self.model, &self.encode(text)?)
    }

    /// log p(continuation | context) of each (context, continuation) pair and
    /// whether greedy decoding would produce the continuation: the
    /// lm-evaluation-harness `loglikelihood` request, with its tokenization
    /// (context whitespace moved to the continuation) and left truncation to
    /// the model's context.
    pub fn loglikelihood(
        &self,
        pairs: &[(impl AsRef<str>, impl AsRef<str>)],
    ) -> Result<Vec<Loglikelihood>> {
        let prefix = self.model.config().eos_token_id;
        let requests = pairs
            .iter()
            .map(|(c, x)| tasks::encode_pair(&self.tokenizer, prefix, c.as_ref(), x.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let scorer = Scorer::new(&self.model, None)?.with_greedy(true);
        scorer.score_all(&requests, SCORE_BATCH, |_| {})
    }

    /// The total log-likelihood of each text, every token scored once in
    /// windows of the model's context (the first given the end-of-text token):
    /// the lm-evaluation-harness `loglikelihood_rolling` request.
    pub fn loglikelihood_rolling(&self, texts: &[impl AsRef<str>]) -> Result<Vec<f64>> {
        let prefix = self.model.config().eos_token_id;
        let scorer = Scorer::new(&self.model, None)?;
        texts
            .iter()
            .map(|t| {
                let ids = self.encode(t.as_ref())?;
                let windows = pile::rolling_windows(&ids, prefix, scorer.max_length());
                let scored = scorer.score_all(&windows, SCORE_BATCH, |_| {})?;
                Ok(scored.iter().map(|l| l.logprob).sum())
            })
            .collect()
    }

    /// Continues `prompt` by up to `max_new_tokens` tokens (fewer at the end
    /// of the context or at the end-of-text token) and returns the new text.
    pub fn generate(
        &self,
        prompt: &str,
        max_new_tokens: usize,
        params: SamplingParams,
    ) -> Result<String> {
        self.generate_with(prompt, max_new_tokens, params, &[] as &[&str], |_| Ok(()))
    }

    /// [`generate`](Self::generate) that also ends at the first of the `stop`
    /// strings; the text returned stops before it.
    pub fn generate_until(
        &self,
        prompt: &str,
        max_new_tokens: usize,
        params: SamplingParams,
        stop: &[impl AsRef<str>],
    ) -> Result<String> {
        self.generate_with(prompt, max_new_tokens, params, stop, |_| Ok(()))
    }

    /// [`generate_until`](Self::generate_until), calling `on_text` with each
    /// new piece of text as soon as it is safe to show.
    pub fn generate_with(
        &self,
        prompt: &str,
        max_new_tokens: usize,
        params: SamplingParams,
        stop: &[impl AsRef<str>],
        on_text: impl FnMut(&str) -> Result<()>,
    ) -> Result<String> {
        self.generate_from_ids(&self.encode(prompt)?, max_new_tokens, params, stop, on_text)
    }

    /// [`generate_until`](Self::generate_until) for many prompts, `batch_size`
    /// sequences decoded together ([`generate::generate_batch`]): a step reads
    /// the weights once for all of them (on a 2-core CPU, 8 sequences of the
    /// 150M made about 3× the tokens per second of one). Each prompt gets
    /// what it would get alone (same seed), up to float rounding.
    pub fn generate_batch(
        &self,
        prompts: &[impl AsRef<str>],
        max_new_tokens: usize,
        params: SamplingParams,
        stop: &[impl AsRef<str>],
        batch_size: usize,
    ) -> Result<Vec<Generation>> {
        let ids = prompts
            .iter()
            .map(|p| self.encode(p.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        self.generate_batch_from_ids(&ids, max_new_tokens, params, stop, batch_size)
    }

    /// [`generate_batch`](Self::generate_batch) from prompts already in token ids.
    pub fn generate_batch_from_ids(
        &self,
        prompts: &[impl AsRef<[u32]>],
        max_new_tokens: usize,
        params: SamplingParams,
        stop: &[impl AsRef<str>],
        batch_size: usize,
    ) -> Result<Vec<Generation>> {
        generate::generate_texts(
            &self.model,
            &self.tokenizer,
            self.kv_cache,
            prompts,
            max_new_tokens,
            params,
            stop,
            batch_size,
            |_| {},
        )
    }

    /// [`generate_with`](Self::generate_with) from a prompt already in token ids.
    pub fn generate_from_ids(
        &self,
        ids: &[u32],
        max_new_tokens: usize,
        params: SamplingParams,
        stop: &[impl AsRef<str>],
        mut on_text: impl FnMut(&str) -> Result<()>,
    ) -> Result<String> {
        let eos = self.model.config().eos_token_id;
        let mut stream = generate::TextStream::new(&self.tokenizer, stop);
        let kv = self.kv_cache;
        generate::generate_with_kv(&self.model, kv, ids, max_new_tokens, params, |id| {
            if id == eos {
                return Ok(ControlFlow::Continue(()));
            }
            let (piece, flow) = stream.push(id)?;
            on_text(&piece)?;
            Ok(flow)
        })?;
        on_text(&stream.rest())?;
        Ok(stream.into_text())
    }
}

/// A TokenFormer image classifier with its preprocessing and class labels.
pub struct ImageClassifier {
    model: VisionTransformer,
    source: String,
}

impl ImageClassifier {
    /// Loads an image classifier (or a merged model's vision route).
    pub fn from_pretrained(name: &str, opts: &PretrainedOptions) -> Result<Self> {
        let device = opts.device.resolve()?;
        let files = opts.locate(name)?;
        Ok(Self {
            model: loader::load_vit_in(&files, &device, opts.dtype.dtype())?,
            source: files.source,
        })
    }

    /// Where it was loaded from.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn model(&self) -> &VisionTransformer {
        &self.model
    }

    /// The `k` most likely classes of the image file at `path` (JPEG, PNG,
    /// WebP), most likely first.
    pub fn classify(&self, path: impl AsRef<Path>, k: usize) -> Result<Vec<Prediction>> {
        let files = [path.as_ref().to_path_buf()];
        let mut results = imagenet::classify_files(&self.model, &files, k, 1)?;
        results.remove(0).1
    }

    /// The class logits of preprocessed pixels [batch, 3, size, size].
    pub fn logits(&self, pixels: &Tensor) -> Result<Tensor> {
        Ok(self.model.forward(pixels)?)
    }

    /// The embedding of the image file at `path`: the pooled, normalised
    /// feature the classifier's head reads (timm's pre-logits), `hidden_size`
    /// values.
    pub fn embed(&self, path: impl AsRef<Path>) -> Result<Vec<f32>> {
        let files = [path.as_ref().to_path_buf()];
        let mut results = imagenet::embed_files(&self.model, &files, 1, &Default::default())?;
        results.remove(0).1
    }
}

/// A merged vision-language TokenFormer (`tokenformer-vl`) with its tokenizer
/// and image preprocessing: text continued after an image, as `tokenformer
/// generate --image` does. Text alone runs the language route:
/// [`LanguageModel::from_pretrained`] of the same name.
///
/// ```
/// use tokenformer::{ImageTextModel, SamplingParams};
///
/// // A model shipped in the binary; a Hub repo id or a folder loads the same way.
/// let vl = ImageTextModel::from_pretrained("tiny-digits-vl", &Default::default())?;
/// let seven = concat!(env!("CARGO_MANIFEST_DIR"), "/zoo/examples/digits/seven/0005.png");
/// let none: &[&str] = &[];
/// let g = vl.generate(seven, "a handwritten", 2, SamplingParams::default(), none)?;
/// assert_eq!(g.generated_text, " seven");
/// # Ok::<(), tokenformer::Error>(())
/// ```
pub struct ImageTextModel {
    model: VisionLanguageModel,
    tokenizer: tokenizers::Tokenizer,
    transform: EvalTransform,
    source: String,
    kv_cache: KvDtype,
}

impl ImageTextModel {
    /// Loads a merged model and its tokenizer, computing in `opts.dtype`.
    pub fn from_pretrained(name: &str, opts: &PretrainedOptions) -> Result<Self> {
        let device = opts.device.resolve()?;
        opts.check_weights()?;
        // Before anything is downloaded.
        if opts.weights == WeightPrecision::Q8 {
            return Err(Error::input(
                "8-bit weights quantise language models only: a merged model takes F32 or F16",
            ));
        }
        let files = opts.locate(name)?;
        let tokenizer = loader::load_tokenizer(&files)?;
        let model = match (opts.dtype, opts.weights) {
            (ComputeDtype::F32, WeightPrecision::F16) => {
                loader::load_vl_as(&files, &device, DType::F16)?
            }
            (d, _) => loader::load_vl_in(&files, &device, d.dtype())?,
        };
        Ok(Self {
            transform: EvalTransform::from_config(model.vision().config()),
            model,
            tokenizer,
            source: files.source,
            kv_cache: opts.kv_cache,
        })
    }

    /// Where it was loaded from (`owner/name@revision` or a path).
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn model(&self) -> &VisionLanguageModel {
        &self.model
    }

    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// The image file at `path` (JPEG, PNG, WebP) preprocessed as the model's
    /// classifier was evaluated: pixels [1, 3, size, size] on its device.
    pub fn load_image(&self, path: impl AsRef<Path>) -> Result<Tensor> {
        let pixels = self.transform.load(path.as_ref())?;
        self.transform
            .batch(vec![pixels], self.model.language().device())
    }

    /// Scores `text` after the image at `image`: the log-probability of each
    /// token given the image and the tokens before it (the first token is
    /// context only, as in [`LanguageModel::score`]), the argmax, NLL and
    /// perplexity.
    pub fn score(&self, image: impl AsRef<Path>, text: &str) -> Result<SequenceScore> {
        let pixels = self.load_image(image)?;
        scoring::score_ids_after_image(&self.model, &pixels, &encode(&self.tokenizer, text)?)
    }

    /// log p(continuation | image, context) of each (context, continuation)
    /// pair after the image at `image`, and whether greedy decoding would
    /// produce the continuation: [`LanguageModel::loglikelihood`] with the
    /// image before every context (the same tokenization; an empty context
    /// starts from the end-of-text token). Comparing the captions of a list
    /// of classes this way classifies the image zero-shot.
    pub fn loglikelihood(
        &self,
        image: impl AsRef<Path>,
        pairs: &[(impl AsRef<str>, impl AsRef<str>)],
    ) -> Result<Vec<Loglikelihood>> {
        let pixels = self.load_image(image)?;
        let prefix = self.model.language().config().eos_token_id;
        let requests = pairs
            .iter()
            .map(|(c, x)| tasks::encode_pair(&self.tokenizer, prefix, c.as_ref(), x.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let scorer = Scorer::after_image(&self.model, &pixels, None)?.with_greedy(true);
        scorer.score_all(&requests, SCORE_BATCH, |_| {})
    }

    /// Continues `prompt` after the image at `image` by up to
    /// `max_new_tokens` tokens, ending at the first of the `stop` strings
    /// (before it).
    pub fn generate(
        &self,
        image: impl AsRef<Path>,
        prompt: &str,
        max_new_tokens: usize,
        params: SamplingParams,
        stop: &[impl AsRef<str>],
    ) -> Result<Generation> {
        let mut done = self.generate_batch(&[image], &[prompt], max_new_tokens, params, stop, 1)?;
        Ok(done.remove(0))
    }

    /// [`generate`](Self::generate) for many (image, prompt) pairs,
    /// `batch_size` sequences decoded together
    /// ([`generate::generate_texts_with_images`]): each pair gets what it
    /// would get alone (same seed), up to float rounding. The images are read
    /// a few dozen at a time, so a long list is not held in memory at once.
    pub fn generate_batch(
        &self,
        images: &[impl AsRef<Path>],
        prompts: &[impl AsRef<str>],
        max_new_tokens: usize,
        params: SamplingParams,
        stop: &[impl AsRef<str>],
        batch_size: usize,
    ) -> Result<Vec<Generation>> {
        if images.len() != prompts.len() {
            return Err(Error::input(format!(
                "{} images for {} prompts: each prompt continues after its own image",
                images.len(),
                prompts.len()
            )));
        }
        let mut done = Vec::with_capacity(prompts.len());
        for (imgs, texts) in images
            .chunks(IMAGES_PER_ROUND)
            .zip(prompts.chunks(IMAGES_PER_ROUND))
        {
            let pixels = imgs
                .iter()
                .map(|p| self.load_image(p))
                .collect::<Result<Vec<_>>>()?;
            let ids = texts
                .iter()
                .map(|t| encode(&self.tokenizer, t.as_ref()))
                .collect::<Result<Vec<_>>>()?;
            done.extend(generate::generate_texts_with_images(
                &self.model,
                &self.tokenizer,
                self.kv_cache,
                &pixels,
                &ids,
                max_new_tokens,
                params.clone(),
                stop,
                batch_size,
                |_| {},
            )?);
        }
        Ok(done)
    }
}

/// The token ids of `text` (no special tokens added).
fn encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tokenizer
        .encode(text, false)
        .map_err(|e| Error::input(format!("tokenizing: {e}")))?;
    Ok(enc.get_ids().to_vec())
}
