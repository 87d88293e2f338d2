//! The `tokenformer` Python package's native module (`tokenformer._tokenformer`):
//! thin PyO3 wrappers over the library's facade ([`tokenformer::LanguageModel`],
//! [`tokenformer::ImageClassifier`], [`tokenformer::ImageTextModel`]). Compute runs with the GIL released;
//! library errors become `tokenformer.TokenFormerError` with the same message.

use std::path::PathBuf;

use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokenformer::generate::SamplingParams;
use tokenformer::{
    ComputeDtype, DeviceSpec, KvDtype, PretrainedOptions, SequenceScore, WeightPrecision,
};

create_exception!(
    _tokenformer,
    TokenFormerError,
    PyException,
    "An error of the tokenformer library (bad input, a missing file, a Hub failure)."
);

fn err(e: tokenformer::Error) -> PyErr {
    TokenFormerError::new_err(e.to_string())
}

fn options(
    tokenizer: Option<PathBuf>,
    config: Option<PathBuf>,
    weights: &str,
    kv_dtype: &str,
    device: &str,
    dtype: &str,
) -> PyResult<PretrainedOptions> {
    // Parsed here so a bad value is named before anything is loaded; the
    // library then refuses a device it cannot open.
    let device = device.parse::<DeviceSpec>().map_err(|e| err(e.into()))?;
    let dtype = dtype
        .parse::<ComputeDtype>()
        .map_err(TokenFormerError::new_err)?;
    let weights = match weights {
        "f32" => WeightPrecision::F32,
        "f16" => WeightPrecision::F16,
        "q8" => WeightPrecision::Q8,
        other => {
            return Err(TokenFormerError::new_err(format!(
                "weights must be \"f32\", \"f16\" or \"q8\", not {other:?}"
            )))
        }
    };
    let kv_cache = match kv_dtype {
        "f32" => KvDtype::F32,
        "f16" => KvDtype::F16,
        other => {
            return Err(TokenFormerError::new_err(format!(
                "kv_dtype must be \"f32\" or \"f16\", not {other:?}"
            )))
        }
    };
    Ok(PretrainedOptions {
        config,
        tokenizer,
        weights,
        dtype,
        kv_cache,
        hub: None,
        device,
    })
}

/// Per-token scores of one text: `ids`, `next_token_logprobs` (log p of
/// ids[t+1] given ids[..=t]), `argmax`, `logsumexp` as numpy arrays, and
/// `nll` and `perplexity`.
#[pyclass(module = "tokenformer", frozen)]
struct Score {
    inner: SequenceScore,
}

#[pymethods]
impl Score {
    #[getter]
    fn ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.inner.ids.clone().into_pyarray(py)
    }
    #[getter]
    fn next_token_logprobs<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        self.inner.next_token_logprobs.clone().into_pyarray(py)
    }
    #[getter]
    fn argmax<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.inner.argmax.clone().into_pyarray(py)
    }
    #[getter]
    fn logsumexp<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        self.inner.logsumexp.clone().into_pyarray(py)
    }
    #[getter]
    fn nll(&self) -> f64 {
        self.inner.nll
    }
    #[getter]
    fn perplexity(&self) -> f64 {
        self.inner.perplexity
    }
    fn __len__(&self) -> usize {
        self.inner.next_token_logprobs.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "Score(tokens={}, nll={:.4}, perplexity={:.4})",
            self.inner.ids.len(),
            self.inner.nll,
            self.inner.perplexity
        )
    }
}

/// One text or many.
#[derive(FromPyObject)]
enum Texts {
    One(String),
    Many(Vec<String>),
}

/// One file path (str or os.PathLike) or many.
#[derive(FromPyObject)]
enum Paths {
    One(PathBuf),
    Many(Vec<PathBuf>),
}

impl Paths {
    /// The paths as a list, and whether one was given (so one result, not a
    /// list, goes back).
    fn into_list(self) -> (Vec<PathBuf>, bool) {
        match self {
            Paths::One(p) => (vec![p], true),
            Paths::Many(ps) => (ps, false),
        }
    }
}

/// A text or its token ids.
#[derive(FromPyObject)]
enum TextOrIds {
    Text(String),
    Ids(Vec<u32>),
}

/// A prompt as text or as token ids, or many prompts.
#[derive(FromPyObject)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    ManyIds(Vec<Vec<u32>>),
}

/// A TokenFormer language model with its tokenizer.
#[pyclass(module = "tokenformer", frozen)]
struct LanguageModel {
    inner: tokenformer::LanguageModel,
}

#[pymethods]
impl LanguageModel {
    /// Loads a model by zoo name, Hub repo id `owner/name[@revision]` or local
    /// path, with its tokenizer. `device`: "cpu", "cuda", "cuda:N" or "auto"
    /// (CUDA needs a build with the `cuda` feature). `dtype`: what it
    /// computes in, "f32", "bf16" or "f16" (the latter two for GPUs).
    /// `weights` ("f32", "f16" or "q8", the last CPU only): how f32
    /// computation keeps its weight matrices. `kv_dtype`: the precision
    /// `generate` caches keys and values in, "f32" or "f16" ("f32" rounds
    /// nothing: a bf16 or f16 model keeps its own keys and values).
    #[staticmethod]
    #[pyo3(signature = (
        name, *, tokenizer=None, config=None, weights="f32", kv_dtype="f32", device="cpu",
        dtype="f32"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn from_pretrained(
        py: Python<'_>,
        name: &str,
        tokenizer: Option<PathBuf>,
        config: Option<PathBuf>,
        weights: &str,
        kv_dtype: &str,
        device: &str,
        dtype: &str,
    ) -> PyResult<Self> {
        let opts = options(tokenizer, config, weights, kv_dtype, device, dtype)?;
        let inner = py
            .detach(|| tokenformer::LanguageModel::from_pretrained(name, &opts))
            .map_err(err)?;
        Ok(Self { inner })
    }

    /// Where the model was loaded from (`owner/name@revision` or a path).
    #[getter]
    fn source(&self) -> String {
        self.inner.source().to_string()
    }

    /// The model's context length in tokens.
    #[getter]
    fn max_length(&self) -> usize {
        self.inner.model().config().max_position_embeddings
    }

    /// The end-of-text token id.
    #[getter]
    fn eot_token_id(&self) -> u32 {
        self.inner.model().config().eos_token_id
    }

    /// The token ids of `text` (no special tokens added).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        self.inner.encode(text).map_err(err)
    }

    /// The text of `ids`.
    fn decode(&self, ids: Vec<u32>) -> PyResult<String> {
        self.inner.decode(&ids).map_err(err)
    }

    /// The next-token logits at every position of a text or a list of token
    /// ids, a float32 array (tokens, vocabulary): transformers'
    /// `model(ids).logits[0]`.
    fn logits<'py>(&self, py: Python<'py>, text: TextOrIds) -> PyResult<Bound<'py, PyAny>> {
        let ids = match text {
            TextOrIds::Text(t) => self.inner.encode(&t).map_err(err)?,
            TextOrIds::Ids(ids) => ids,
        };
        let (shape, flat) = py
            .detach(|| {
                let l = self.inner.logits(&ids)?;
                Ok::<_, tokenformer::Error>((l.dims2()?, l.flatten_all()?.to_vec1::<f32>()?))
            })
            .map_err(err)?;
        let (rows, cols) = shape;
        Ok(PyArray1::from_vec(py, flat)
            .reshape([rows, cols])?
            .into_any())
    }

    /// Scores a text (a `Score`) or a list of texts (a list of `Score`s), as
    /// `tokenformer score --json` does.
    fn score(&self, py: Python<'_>, texts: Texts) -> PyResult<Py<PyAny>> {
        let (texts, one) = match texts {
            Texts::One(t) => (vec![t], true),
            Texts::Many(ts) => (ts, false),
        };
        let scored = py
            .detach(|| {
                texts
                    .iter()
                    .map(|t| self.inner.score(t))
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(err)?;
        scores(py, scored, one)
    }

    /// `(log p(continuation | context), is_greedy)` for each (context,
    /// continuation) pair: lm-evaluation-harness's `loglikelihood`.
    fn loglikelihood(
        &self,
        py: Python<'_>,
        pairs: Vec<(String, String)>,
    ) -> PyResult<Vec<(f64, bool)>> {
        let scored = py
            .detach(|| self.inner.loglikelihood(&pairs))
            .map_err(err)?;
        Ok(scored.iter().map(|l| (l.logprob, l.is_greedy)).collect())
    }

    /// The total log-likelihood of each text in windows of the model's
    /// context: lm-evaluation-harness's `loglikelihood_rolling`.
    fn loglikelihood_rolling(&self, py: Python<'_>, texts: Vec<String>) -> PyResult<Vec<f64>> {
        py.detach(|| self.inner.loglikelihood_rolling(&texts))
            .map_err(err)
    }

    /// Continues `prompt` (text or token ids) and returns the new text; a
    /// list of prompts gives a list of texts, `batch_size` sequences decoded
    /// together (each as it would be alone, up to float rounding). Greedy
    /// when `temperature` is 0; `stop` strings end the text before them.
    /// `details=True` gives a dict per prompt instead: `generated_text`,
    /// `finish_reason` ("eos_token", "stop_sequence" or "length"),
    /// `prompt_tokens` and `generated_tokens`.
    #[pyo3(signature = (
        prompt, max_new_tokens=64, *, temperature=0.0, top_k=None, top_p=None,
        seed=299_792_458, repeat_penalty=1.0, repeat_last_n=64, stop=None,
        batch_size=tokenformer::generate::DEFAULT_BATCH_SIZE, details=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: Prompt,
        max_new_tokens: usize,
        temperature: f64,
        top_k: Option<usize>,
        top_p: Option<f64>,
        seed: u64,
        repeat_penalty: f32,
        repeat_last_n: usize,
        stop: Option<Vec<String>>,
        batch_size: usize,
        details: bool,
    ) -> PyResult<Py<PyAny>> {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            repeat_penalty,
            repeat_last_n,
        };
        let stop = stop.unwrap_or_default();
        let lm = &self.inner;
        let batch = |ids: &[Vec<u32>], size: usize| {
            py.detach(|| {
                lm.generate_batch_from_ids(ids, max_new_tokens, params.clone(), &stop, size)
            })
            .map_err(err)
        };
        let text = match prompt {
            Prompt::Texts(ts) => {
                let ids = py.detach(|| {
                    ts.iter()
                        .map(|t| lm.encode(t))
                        .collect::<Result<Vec<_>, _>>()
                });
                return generations(py, batch(&ids.map_err(err)?, batch_size)?, details);
            }
            Prompt::ManyIds(ids) => return generations(py, batch(&ids, batch_size)?, details),
            Prompt::Text(t) if details => {
                let ids = py.detach(|| lm.encode(&t)).map_err(err)?;
                return generation(py, batch(&[ids], 1)?.remove(0));
            }
            Prompt::Ids(ids) if details => return generation(py, batch(&[ids], 1)?.remove(0)),
            Prompt::Text(t) => py.detach(|| lm.generate_until(&t, max_new_tokens, params, &stop)),
            Prompt::Ids(ids) => {
                py.detach(|| lm.generate_from_ids(&ids, max_new_tokens, params, &stop, |_| Ok(())))
            }
        };
        Ok(text.map_err(err)?.into_pyobject(py)?.into_any().unbind())
    }

    fn __repr__(&self) -> String {
        format!("LanguageModel({:?})", self.inner.source())
    }
}

/// Generations as a Python list: of their texts, or with `details` of
/// [`generation`]'s dicts.
fn generations(
    py: Python<'_>,
    done: Vec<tokenformer::Generation>,
    details: bool,
) -> PyResult<Py<PyAny>> {
    if details {
        let dicts = done
            .into_iter()
            .map(|g| generation(py, g))
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(dicts.into_pyobject(py)?.into_any().unbind());
    }
    let texts: Vec<String> = done.into_iter().map(|g| g.generated_text).collect();
    Ok(texts.into_pyobject(py)?.into_any().unbind())
}

/// One generation as a dict with the keys of `generate --prompts`' lines.
fn generation(py: Python<'_>, g: tokenformer::Generation) -> PyResult<Py<PyAny>> {
    let d = PyDict::new(py);
    d.set_item("generated_text", g.generated_text)?;
    d.set_item("finish_reason", g.finish_reason.as_str())?;
    d.set_item("prompt_tokens", g.prompt_tokens)?;
    d.set_item("generated_tokens", g.generated_tokens)?;
    Ok(d.into_any().unbind())
}

/// A TokenFormer image classifier with its preprocessing and class names.
#[pyclass(module = "tokenformer", frozen)]
struct ImageClassifier {
    inner: tokenformer::ImageClassifier,
}

#[pymethods]
impl ImageClassifier {
    /// Loads a classifier by zoo name, Hub repo id or local path. `device`:
    /// "cpu", "cuda", "cuda:N" or "auto"; `dtype`: "f32", "bf16" or "f16".
    #[staticmethod]
    #[pyo3(signature = (name, *, config=None, device="cpu", dtype="f32"))]
    fn from_pretrained(
        py: Python<'_>,
        name: &str,
        config: Option<PathBuf>,
        device: &str,
        dtype: &str,
    ) -> PyResult<Self> {
        let opts = options(None, config, "f32", "f32", device, dtype)?;
        let inner = py
            .detach(|| tokenformer::ImageClassifier::from_pretrained(name, &opts))
            .map_err(err)?;
        Ok(Self { inner })
    }

    /// Where the model was loaded from.
    #[getter]
    fn source(&self) -> String {
        self.inner.source().to_string()
    }

    /// The `k` most likely classes of each image file (JPEG, PNG, WebP), most
    /// likely first: per path a list of dicts `index`, `prob` and, when the
    /// model has class names, `wnid` and `name`. One path gives one list.
    #[pyo3(signature = (paths, k=5))]
    fn classify(&self, py: Python<'_>, paths: Paths, k: usize) -> PyResult<Py<PyAny>> {
        let (files, one) = paths.into_list();
        let results = py
            .detach(|| {
                tokenformer::eval::imagenet::classify_files(self.inner.model(), &files, k, 32)
            })
            .map_err(err)?;
        let mut out = Vec::with_capacity(results.len());
        for (_, r) in results {
            // The error names the file already.
            let preds = r.map_err(err)?;
            let list = preds
                .iter()
                .map(|p| {
                    let d = PyDict::new(py);
                    d.set_item("index", p.index)?;
                    if let Some(w) = &p.wnid {
                        d.set_item("wnid", w)?;
                    }
                    if let Some(n) = &p.name {
                        d.set_item("name", n)?;
                    }
                    d.set_item("prob", p.prob)?;
                    Ok(d)
                })
                .collect::<PyResult<Vec<_>>>()?;
            out.push(list);
        }
        if one {
            Ok(out.remove(0).into_pyobject(py)?.into_any().unbind())
        } else {
            Ok(out.into_pyobject(py)?.into_any().unbind())
        }
    }

    /// The embedding of each image file: the pooled, normalised feature the
    /// classifier's head reads (timm's pre-logits), as a float32 array of
    /// shape (hidden_size,) for one path, (len(paths), hidden_size) for a list.
    fn embed<'py>(&self, py: Python<'py>, paths: Paths) -> PyResult<Bound<'py, PyAny>> {
        let (files, one) = paths.into_list();
        let model = self.inner.model();
        let results = py
            .detach(|| {
                tokenformer::eval::imagenet::embed_files(model, &files, 32, &Default::default())
            })
            .map_err(err)?;
        let d = model.config().hidden_size;
        let mut flat = Vec::with_capacity(results.len() * d);
        for (_, r) in results {
            // The error names the file already.
            flat.extend(r.map_err(err)?);
        }
        let array = PyArray1::from_vec(py, flat);
        if one {
            Ok(array.into_any())
        } else {
            Ok(array.reshape([files.len(), d])?.into_any())
        }
    }

    fn __repr__(&self) -> String {
        format!("ImageClassifier({:?})", self.inner.source())
    }
}

/// A merged vision-language TokenFormer (`tokenformer-vl`) with its tokenizer
/// and image preprocessing: text continued after an image. Text alone runs the
/// language route: `LanguageModel.from_pretrained` of the same name.
#[pyclass(module = "tokenformer", frozen)]
struct ImageTextModel {
    inner: tokenformer::ImageTextModel,
}

#[pymethods]
impl ImageTextModel {
    /// Loads a merged model by zoo name, Hub repo id or local path, with its
    /// tokenizer. `device`, `dtype` and `kv_dtype` as
    /// `LanguageModel.from_pretrained`; `weights`: "f32" or "f16" (8-bit
    /// weights quantise language models only).
    #[staticmethod]
    #[pyo3(signature = (
        name, *, tokenizer=None, config=None, weights="f32", kv_dtype="f32", device="cpu",
        dtype="f32"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn from_pretrained(
        py: Python<'_>,
        name: &str,
        tokenizer: Option<PathBuf>,
        config: Option<PathBuf>,
        weights: &str,
        kv_dtype: &str,
        device: &str,
        dtype: &str,
    ) -> PyResult<Self> {
        let opts = options(tokenizer, config, weights, kv_dtype, device, dtype)?;
        let inner = py
            .detach(|| tokenformer::ImageTextModel::from_pretrained(name, &opts))
            .map_err(err)?;
        Ok(Self { inner })
    }

    /// Where the model was loaded from.
    #[getter]
    fn source(&self) -> String {
        self.inner.source().to_string()
    }

    /// Continues `prompt` after `image` (a file path: JPEG, PNG, WebP) and
    /// returns the new text, as `tokenformer generate --image` does. A list
    /// of images with a list of prompts of the same length gives a list,
    /// `batch_size` sequences decoded together (each pair as it would be
    /// alone, up to float rounding). Sampling, `stop` and `details` as
    /// `LanguageModel.generate`.
    #[pyo3(signature = (
        image, prompt, max_new_tokens=64, *, temperature=0.0, top_k=None, top_p=None,
        seed=299_792_458, repeat_penalty=1.0, repeat_last_n=64, stop=None,
        batch_size=tokenformer::generate::DEFAULT_BATCH_SIZE, details=false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        image: Paths,
        prompt: Texts,
        max_new_tokens: usize,
        temperature: f64,
        top_k: Option<usize>,
        top_p: Option<f64>,
        seed: u64,
        repeat_penalty: f32,
        repeat_last_n: usize,
        stop: Option<Vec<String>>,
        batch_size: usize,
        details: bool,
    ) -> PyResult<Py<PyAny>> {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            repeat_penalty,
            repeat_last_n,
        };
        let stop = stop.unwrap_or_default();
        let (images, prompts, one) = with_images(image, prompt, "prompt")?;
        let done = py
            .detach(|| {
                self.inner.generate_batch(
                    &images,
                    &prompts,
                    max_new_tokens,
                    params,
                    &stop,
                    batch_size,
                )
            })
            .map_err(err)?;
        match (one, details) {
            (true, true) => generation(py, done.into_iter().next().expect("one prompt")),
            (true, false) => {
                let text = done.into_iter().next().expect("one prompt").generated_text;
                Ok(text.into_pyobject(py)?.into_any().unbind())
            }
            (false, _) => generations(py, done, details),
        }
    }

    /// Scores `text` after `image` (a `Score`: each token given the image and
    /// the tokens before it, the first context only), as `tokenformer score
    /// --image` does. A list of images with a list of texts of the same
    /// length gives a list of `Score`s.
    fn score(&self, py: Python<'_>, image: Paths, text: Texts) -> PyResult<Py<PyAny>> {
        let (images, texts, one) = with_images(image, text, "text")?;
        let scored = py
            .detach(|| {
                images
                    .iter()
                    .zip(&texts)
                    .map(|(i, t)| self.inner.score(i, t))
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(err)?;
        scores(py, scored, one)
    }

    /// `(log p(continuation | image, context), is_greedy)` for each
    /// (context, continuation) pair after `image`: `LanguageModel.loglikelihood`
    /// with the image first. The captions of a list of classes, compared
    /// this way, classify the image zero-shot.
    fn loglikelihood(
        &self,
        py: Python<'_>,
        image: PathBuf,
        pairs: Vec<(String, String)>,
    ) -> PyResult<Vec<(f64, bool)>> {
        let scored = py
            .detach(|| self.inner.loglikelihood(&image, &pairs))
            .map_err(err)?;
        Ok(scored.iter().map(|l| (l.logprob, l.is_greedy)).collect())
    }

    fn __repr__(&self) -> String {
        format!("ImageTextModel({:?})", self.inner.source())
    }
}

/// (images, texts, whether one pair was given) of an `image` and a `text`
/// argument named `what`: one path with one text, or two lists of the same
/// length.
fn with_images(
    image: Paths,
    text: Texts,
    what: &str,
) -> PyResult<(Vec<PathBuf>, Vec<String>, bool)> {
    match (image, text) {
        (Paths::One(i), Texts::One(t)) => Ok((vec![i], vec![t], true)),
        (Paths::Many(i), Texts::Many(t)) if i.len() != t.len() => {
            Err(TokenFormerError::new_err(format!(
                "{} images for {} {what}s: each {what} goes with its own image",
                i.len(),
                t.len()
            )))
        }
        (Paths::Many(i), Texts::Many(t)) => Ok((i, t, false)),
        _ => Err(TokenFormerError::new_err(format!(
            "image and {what} go together: one path with one {what}, or a list of paths with a \
             list of {what}s of the same length"
        ))),
    }
}

/// One `Score`, or a list of them.
fn scores(py: Python<'_>, scored: Vec<SequenceScore>, one: bool) -> PyResult<Py<PyAny>> {
    let mut list = scored
        .into_iter()
        .map(|inner| Py::new(py, Score { inner }))
        .collect::<PyResult<Vec<_>>>()?;
    if one {
        return Ok(list.remove(0).into_any());
    }
    Ok(list.into_pyobject(py)?.into_any().unbind())
}

#[pymodule]
fn _tokenformer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TokenFormerError", m.py().get_type::<TokenFormerError>())?;
    m.add_class::<LanguageModel>()?;
    m.add_class::<ImageClassifier>()?;
    m.add_class::<ImageTextModel>()?;
    m.add_class::<Score>()?;
    // What `generate` takes for `batch_size`, for adapters that pick their own default.
    m.add(
        "DEFAULT_BATCH_SIZE",
        tokenformer::generate::DEFAULT_BATCH_SIZE,
    )?;
    Ok(())
}
