//! `tokenformer generate` and `tokenformer score`.

use std::io::{IsTerminal, Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use clap::Args;
use tokenformer::generate::{
    self, generate_with_image_kv, generate_with_kv, token_budget, FinishReason, Generation,
    SamplingParams, TextStream, DEFAULT_BATCH_SIZE,
};
use tokenformer::loader;
use tokenformer::models::tokenformer::TokenFormerLm;
use tokenformer::models::vl::{self, VisionLanguageModel};
use tokenformer::vision::EvalTransform;

use super::{DeviceArgs, KvDtypeArg, ModelArgs, WeightArgs};
use crate::cli::stdout::outln;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub weights: WeightArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The text to continue (or --prompt-file, or the prompt piped on stdin).
    #[arg(long, short, conflicts_with = "prompt_file")]
    pub prompt: Option<String>,
    /// A UTF-8 file holding the prompt, used as it is (a trailing newline is part of it); `-` is stdin.
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
    /// The most tokens to generate (fewer at EOS, a stop string or the end of the model's context).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample only among the K most likely tokens.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities add up to P (nucleus sampling).
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,
    /// Seed of the sampler: the same seed gives the same text.
    #[arg(long, default_value_t = 299_792_458)]
    pub seed: u64,
    /// End the text before this string (repeatable; the first one to appear wins).
    #[arg(long, value_name = "STR")]
    pub stop: Vec<String>,
    /// Penalise tokens already seen: divide a positive logit by it, multiply a negative one (1 = off; 1.1–1.3 is usual).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    pub repeat_penalty: f32,
    /// How many of the latest tokens the repeat penalty looks at (0 = all, prompt included).
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub repeat_last_n: usize,
    /// An image to condition on (tokenformer-vl models): the sequence is [image tokens; prompt].
    #[arg(long, value_name = "IMG")]
    pub image: Option<PathBuf>,
    /// Keep the KV cache in f16: half its memory and of the bytes each step reads from it
    /// (faster at long contexts), keys and values rounded to f16. The default, f32, rounds
    /// nothing: a model computing in bf16 or f16 keeps its own keys and values as they are.
    #[arg(long, value_enum, default_value_t)]
    pub kv_dtype: KvDtypeArg,
    /// Print JSON at the end instead of streaming the text: `generated_text` (the continuation),
    /// `finish_reason` (`eos_token`, `stop_sequence` or `length`), token counts and timings.
    #[arg(long)]
    pub json: bool,
    /// Many prompts: a .jsonl, .jsonl.zst or .parquet file with a `prompt` field per line (`-`:
    /// JSON lines on stdin); for a merged vision-language model a line may add an `image` path
    /// (relative to the file's folder). Prints one JSON line per prompt, in order: its `line`,
    /// `prompt`, `generated_text`, `finish_reason` and token counts. Sequences are decoded
    /// --batch-size at a time.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "prompt_file", "image", "json"])]
    pub prompts: Option<PathBuf>,
    /// With --prompts: sequences decoded together (default 8). A step reads the weights once for
    /// all of them (on 2 CPU cores, 8 made about 3× one's tokens per second); results change only in
    /// float rounding.
    #[arg(long, value_parser = super::positive::<usize>)]
    pub batch_size: Option<usize>,
    /// With --prompts: no progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// What `generate --json` prints. The names of the text, the finish reason
/// and the counts are those of text-generation-inference's `details`.
#[derive(serde::Serialize)]
struct GenerateReport<'a> {
    model: &'a str,
    prompt: &'a str,
    generated_text: String,
    finish_reason: FinishReason,
    prompt_tokens: usize,
    /// Tokens the model produced, an end-of-text token included.
    generated_tokens: usize,
    seed: u64,
    /// From the start of the prompt's forward pass to the first new token.
    first_token_seconds: f64,
    /// From the start of the prompt's forward pass to the last new token.
    seconds: f64,
    /// The tokens after the first, per second of their own (decoding alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_tokens_per_second: Option<f64>,
}

/// What `generate` runs: a merged model with its preprocessed image, or a language model.
enum Generator {
    WithImage(Box<VisionLanguageModel>, Tensor),
    Text(Box<TokenFormerLm>),
}

pub fn generate_cmd(a: GenerateArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
    };
    // Before anything is downloaded or loaded.
    params.validate()?;
    let dev = a.device.open()?;
    if a.prompts.is_none() && (a.batch_size.is_some() || a.quiet) {
        // clap's `requires` gives way to the conflict between --prompts and --prompt.
        bail!(
            "--batch-size and --quiet are for --prompts: one prompt streams its text as it comes"
        );
    }
    if let Some(path) = &a.prompts {
        let data = open_lines(path)?;
        let files = a.model.locate()?;
        let tokenizer = loader::load_tokenizer(&files)?;
        let model = LineModels::new(&files, &a.weights, &dev);
        return generate_lines(&a, data, &model, &tokenizer, params);
    }
    let files = a.model.locate()?;
    // Known before any weights are read, so a wrong --image fails fast.
    if a.image.is_some() {
        check_merged(&files, &a.weights)?;
    }
    let tokenizer = loader::load_tokenizer(&files)?;
    let text = prompt_text(&a)?;
    if text.is_empty() {
        bail!("the prompt is empty: pass --prompt TEXT, --prompt-file FILE or pipe it on stdin");
    }
    let prompt = tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
        .get_ids()
        .to_vec();
    // Image + text runs the merged model; text alone runs a language model
    // (a merged model's language route when the folder is tokenformer-vl).
    let model = match &a.image {
        Some(path) => {
            let (model, pixels) = load_merged(&files, &a.weights, &dev, path)?;
            Generator::WithImage(Box::new(model), pixels)
        }
        None => Generator::Text(Box::new(a.weights.load_lm(&files, &dev)?)),
    };
    let text_cfg = match &model {
        Generator::WithImage(m, _) => m.language().config(),
        Generator::Text(m) => m.config(),
    };
    let (eos, max) = (text_cfg.eos_token_id, text_cfg.max_position_embeddings);
    let mut stdout = std::io::stdout().lock();
    if !a.json {
        write!(stdout, "{text}")?;
        stdout.flush()?;
    }
    let mut stream = TextStream::new(&tokenizer, &a.stop);
    let start = std::time::Instant::now();
    let mut first_token = None;
    let mut on_token = |tok: u32| {
        first_token.get_or_insert_with(|| start.elapsed());
        if tok == eos {
            return Ok(ControlFlow::Continue(()));
        }
        let (piece, flow) = stream.push(tok)?;
        if !a.json {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
        Ok(flow)
    };
    let budget = token_budget(max, prompt.len(), a.max_new_tokens);
    if prompt.len() < max && budget < a.max_new_tokens {
        // Stopping at the context is the honest alternative to positions the
        // model was never trained on; say so rather than stop silently.
        eprintln!(
            "note: generating at most {budget} tokens: the prompt has {} and the model's context is {max} positions",
            prompt.len()
        );
    }
    let (kv, n) = (a.kv_dtype.into(), a.max_new_tokens);
    let out = match &model {
        Generator::WithImage(m, pixels) => {
            generate_with_image_kv(m, kv, pixels, &prompt, n, params, &mut on_token)?
        }
        Generator::Text(m) => generate_with_kv(m, kv, &prompt, n, params, &mut on_token)?,
    };
    let seconds = start.elapsed().as_secs_f64();
    if !a.json {
        writeln!(std::io::stdout(), "{}", stream.rest())?;
        return Ok(());
    }
    let finish_reason = FinishReason::of(&out, eos, &stream);
    let first_token_seconds = first_token.map_or(seconds, |d| d.as_secs_f64());
    let decode_seconds = seconds - first_token_seconds;
    let report = GenerateReport {
        model: &files.source,
        prompt: &text,
        generated_text: stream.into_text(),
        finish_reason,
        prompt_tokens: prompt.len(),
        generated_tokens: out.len(),
        seed: a.seed,
        first_token_seconds,
        seconds,
        decode_tokens_per_second: (out.len() > 1 && decode_seconds > 0.0)
            .then(|| (out.len() - 1) as f64 / decode_seconds),
    };
    outln!("{}", serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

/// Prompts read before a batched generation starts: enough to keep
/// `--batch-size` sequences in flight, few enough to bound memory.
const PROMPTS_PER_ROUND: usize = 256;
/// As [`PROMPTS_PER_ROUND`] when lines may bring images, each held
/// preprocessed until its round is done.
const IMAGE_PROMPTS_PER_ROUND: usize = 64;

/// Why an image is refused with `--weight-dtype q8` (`--image`, or a
/// `--prompts` line's `image`).
const MERGED_WEIGHTS: &str = "runs the merged model, whose weights are not quantised: \
     --weight-dtype q8 is for language models (f16 halves the memory)";

/// Refuses `--image` for a model that is not a merged one, or with weights a
/// merged model does not take, before any weights are read.
fn check_merged(files: &loader::ModelFiles, weights: &WeightArgs) -> Result<()> {
    let arch = architecture(files);
    if arch != vl::ARCHITECTURE {
        bail!(
            "--image needs a vision-language model (`{}`), but {} is `{arch}`: merge one with `tokenformer-convert merge`",
            vl::ARCHITECTURE,
            files.source
        );
    }
    if !weights.merged_ok() {
        bail!("--image {MERGED_WEIGHTS}");
    }
    Ok(())
}

/// The merged model of `files` and the image at `path` preprocessed for it
/// ([1, C, H, W] on `dev`).
fn load_merged(
    files: &loader::ModelFiles,
    weights: &WeightArgs,
    dev: &candle_core::Device,
    path: &Path,
) -> Result<(VisionLanguageModel, Tensor)> {
    check_merged(files, weights)?;
    let model = weights.load_vl(files, dev)?;
    let transform = EvalTransform::from_config(model.vision().config());
    let pixels = transform.batch(vec![transform.load(path)?], dev)?;
    Ok((model, pixels))
}

/// The architecture a model folder's config names.
fn architecture(files: &loader::ModelFiles) -> String {
    match &files.config {
        loader::ConfigSource::Json { value, .. } => loader::architecture(value).to_string(),
        loader::ConfigSource::OfficialYml(_) => {
            tokenformer::models::tokenformer::ARCHITECTURE.into()
        }
    }
}

/// What `generate --prompts` runs: the language model for text lines (a
/// merged model's language route, as `generate` without `--image` runs), and
/// a merged model's whole model for lines with an `image`.
struct LineModels<'a> {
    merged: Option<Lazy<'a, (VisionLanguageModel, EvalTransform)>>,
    text: Lazy<'a, TokenFormerLm>,
    files: &'a loader::ModelFiles,
}

impl<'a> LineModels<'a> {
    /// The models of `files`, each loaded at the first line that needs it.
    fn new(
        files: &'a loader::ModelFiles,
        weights: &'a WeightArgs,
        dev: &'a candle_core::Device,
    ) -> Self {
        // A merged model runs whole for the lines that bring an image.
        let merged = architecture(files) == vl::ARCHITECTURE && weights.merged_ok();
        Self {
            merged: merged.then(|| {
                Lazy::new(Box::new(move || {
                    let model = weights.load_vl(files, dev)?;
                    let transform = EvalTransform::from_config(model.vision().config());
                    Ok((model, transform))
                }))
            }),
            text: Lazy::new(Box::new(move || weights.load_lm(files, dev))),
            files,
        }
    }

    /// The image a line's `image` field names (a path relative to `folder`),
    /// preprocessed for the merged model; `None` for a line without one.
    /// Errors name the line (`at`).
    fn line_image(
        &self,
        image: Option<&serde_json::Value>,
        folder: &Path,
        at: impl Fn() -> String,
    ) -> Result<Option<(&VisionLanguageModel, Tensor)>> {
        let file = match image {
            None => return Ok(None),
            Some(serde_json::Value::String(f)) => folder.join(f),
            Some(_) => bail!("{}: `image` is not a string (a file path)", at()),
        };
        let Some(merged) = &self.merged else {
            let arch = architecture(self.files);
            if arch == vl::ARCHITECTURE {
                bail!("{}: an `image` {MERGED_WEIGHTS}", at())
            }
            bail!(
                "{}: an `image` needs a vision-language model (`{}`), but {} is `{arch}`",
                at(),
                vl::ARCHITECTURE,
                self.files.source
            )
        };
        let (m, transform) = merged.get()?;
        let pixels = transform
            .load(&file)
            .and_then(|px| transform.batch(vec![px], m.language().device()))
            .with_context(at)?;
        Ok(Some((m, pixels)))
    }
}

/// A value made at its first use.
struct Lazy<'a, T> {
    cell: std::cell::OnceCell<T>,
    make: Box<dyn Fn() -> Result<T> + 'a>,
}

impl<'a, T> Lazy<'a, T> {
    fn new(make: Box<dyn Fn() -> Result<T> + 'a>) -> Self {
        Self {
            cell: std::cell::OnceCell::new(),
            make,
        }
    }

    fn get(&self) -> Result<&T> {
        if self.cell.get().is_none() {
            let _ = self.cell.set((self.make)()?);
        }
        Ok(self.cell.get().expect("set above"))
    }
}

/// `generate --prompts`: each `prompt` of a JSON-lines input continued, one
/// JSON line out per prompt in the input's order.
fn generate_lines(
    a: &GenerateArgs,
    data: tokenformer::eval::data::DataFile,
    model: &LineModels,
    tokenizer: &tokenizers::Tokenizer,
    params: SamplingParams,
) -> Result<()> {
    #[derive(serde::Serialize)]
    struct Line<'a> {
        line: usize,
        prompt: &'a str,
        #[serde(flatten)]
        generation: &'a Generation,
    }
    let path = data.path.display().to_string();
    let folder = lines_folder(&data);
    let bar = if a.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        super::progress::bar(
            data.size,
            "{elapsed_precise} [{bar:30}] {percent:>3}% of file {msg} ETA {eta}",
        )
    };
    let lines = tokenformer::eval::data::JsonLines::new(data);
    let position = lines.position();
    let (mut done, mut tokens) = (0usize, 0usize);
    let start = std::time::Instant::now();
    let mut out = std::io::stdout().lock();
    let mut lines = lines.peekable();
    let per_round = if model.merged.is_some() {
        IMAGE_PROMPTS_PER_ROUND
    } else {
        PROMPTS_PER_ROUND
    };
    while lines.peek().is_some() {
        // (line, prompt text, prompt ids, image) of this round.
        let mut round = Vec::with_capacity(per_round);
        for item in lines.by_ref().take(per_round) {
            let (n, value) = item?;
            let image = value.as_ref().ok().and_then(|v| v.get("image")).cloned();
            let (n, text, ids) = field_ids(&path, (n, value), "prompt", tokenizer)?;
            let at = || format!("{path} line {n}");
            let with_image = model.line_image(image.as_ref(), &folder, at)?;
            // Here, so that a bad prompt is named by its line: by the model that runs it.
            let runs = match &with_image {
                Some((m, _)) => m.language(),
                None => model.text.get()?,
            };
            let pixels = with_image.map(|(_, px)| px);
            tokenformer::generate::check_prompt(runs, &ids, a.max_new_tokens).with_context(at)?;
            round.push((n, text, ids, pixels));
        }
        let mut progress = |_| {
            tokens += 1;
            let secs = start.elapsed().as_secs_f64().max(1e-9);
            bar.set_position(position.load(std::sync::atomic::Ordering::Relaxed));
            bar.set_message(format!(
                "{done} prompts, {tokens} tokens, {:.1} tok/s",
                tokens as f64 / secs
            ));
        };
        let (kv, n, batch) = (
            a.kv_dtype.into(),
            a.max_new_tokens,
            a.batch_size.unwrap_or(DEFAULT_BATCH_SIZE),
        );
        // The lines with an image and those without, each group batched on its model.
        let (with, without): (Vec<usize>, Vec<usize>) =
            (0..round.len()).partition(|&i| round[i].3.is_some());
        let ids =
            |group: &[usize]| -> Vec<&[u32]> { group.iter().map(|&i| &round[i].2[..]).collect() };
        let mut generations: Vec<Option<Generation>> = vec![None; round.len()];
        if let (Some(merged), false) = (&model.merged, with.is_empty()) {
            let (m, _) = merged.get()?;
            let images: Vec<Tensor> = with.iter().filter_map(|&i| round[i].3.clone()).collect();
            let done = generate::generate_texts_with_images(
                m,
                tokenizer,
                kv,
                &images,
                &ids(&with),
                n,
                params.clone(),
                &a.stop,
                batch,
                &mut progress,
            )?;
            for (&i, g) in with.iter().zip(done) {
                generations[i] = Some(g);
            }
        }
        if !without.is_empty() {
            let done = generate::generate_texts(
                model.text.get()?,
                tokenizer,
                kv,
                &ids(&without),
                n,
                params.clone(),
                &a.stop,
                batch,
                &mut progress,
            )?;
            for (&i, g) in without.iter().zip(done) {
                generations[i] = Some(g);
            }
        }
        let generations = generations
            .into_iter()
            .map(|g| g.expect("every line generated"));
        for ((n, text, ..), generation) in round.iter().zip(generations) {
            let line = Line {
                line: *n,
                prompt: text,
                generation: &generation,
            };
            writeln!(out, "{}", serde_json::to_string(&line)?)?;
        }
        out.flush()?;
        done += round.len();
    }
    bar.finish_and_clear();
    Ok(())
}

/// The line number, the string `field` of a JSON line of the file `path`,
/// and its token ids; errors name the file and the line.
fn field_ids(
    path: &str,
    (n, value): tokenformer::eval::data::Line,
    field: &str,
    tokenizer: &tokenizers::Tokenizer,
) -> Result<(usize, String, Vec<u32>)> {
    let value = value.map_err(|e| anyhow::anyhow!("{path} line {n}: {e}"))?;
    let Some(text) = value.get(field).and_then(|t| t.as_str()) else {
        bail!("{path} line {n}: no `{field}` string field");
    };
    let ids = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("{path} line {n}: tokenizing: {e}"))?
        .get_ids()
        .to_vec();
    Ok((n, text.to_string(), ids))
}

/// The folder a JSON-lines input's `image` paths are relative to: the
/// file's own (stdin: the working folder).
fn lines_folder(data: &tokenformer::eval::data::DataFile) -> PathBuf {
    data.path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The endings of the files read as JSON lines (a parquet file's rows as JSON).
const LINE_FORMATS: [&str; 3] = [".jsonl", ".jsonl.zst", ".parquet"];

/// A JSON-lines input (`-`: stdin) for `generate --prompts`.
fn open_lines(path: &std::path::Path) -> Result<tokenformer::eval::data::DataFile> {
    use tokenformer::eval::data::{DataFile, DEFAULT_MAX_LINE_BYTES};
    if path.as_os_str() == "-" {
        return Ok(DataFile::stdin(DEFAULT_MAX_LINE_BYTES));
    }
    let name = path.to_string_lossy().to_lowercase();
    if !LINE_FORMATS.iter().any(|e| name.ends_with(e)) {
        bail!(
            "{}: --prompts takes a .jsonl, .jsonl.zst or .parquet file (a `prompt` field per line)",
            path.display()
        );
    }
    Ok(DataFile::open(path)?)
}

/// The prompt from --prompt, --prompt-file (`-` = stdin) or, when neither is
/// given and stdin is not a terminal, stdin; at most 16 MiB.
fn prompt_text(a: &GenerateArgs) -> Result<String> {
    const MAX: u64 = 16 << 20;
    match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => Ok(p.clone()),
        (None, Some(f)) if f.as_os_str() == "-" => read_stdin(MAX),
        (None, Some(f)) => Ok(tokenformer::fsutil::read_to_string_bounded(f, MAX)?),
        (None, None) if !std::io::stdin().is_terminal() => read_stdin(MAX),
        (None, None) => {
            bail!("no prompt: pass --prompt TEXT, --prompt-file FILE or pipe it on stdin")
        }
    }
}

/// All of stdin as UTF-8, refusing more than `max` bytes.
pub(crate) fn read_stdin(max: u64) -> Result<String> {
    let mut buf = Vec::new();
    std::io::stdin()
        .lock()
        .take(max + 1)
        .read_to_end(&mut buf)
        .context("reading stdin")?;
    if buf.len() as u64 > max {
        bail!("stdin: more than {max} bytes");
    }
    String::from_utf8(buf).map_err(|e| anyhow::anyhow!("stdin: not UTF-8 text ({e})"))
}

#[derive(Args, Debug)]
pub struct ScoreArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub weights: WeightArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Text to score.
    #[arg(long, conflicts_with_all = ["file", "ids"])]
    pub text: Option<String>,
    /// A UTF-8 text file to score as one text; a .jsonl, .jsonl.zst or .parquet file holds many
    /// (a `text` field per line, and for a merged vision-language model an optional `image` path
    /// relative to the file's folder), each scored on its own, one JSON line out per text.
    /// `-` reads stdin (as one text, or JSON lines with --jsonl); with no --text, --file or --ids,
    /// a piped stdin is read.
    #[arg(long, conflicts_with = "ids", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Read stdin as JSON lines (a `text` field per line) rather than as one text.
    #[arg(long)]
    pub jsonl: bool,
    /// Comma-separated token ids to score (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// An image the text follows (tokenformer-vl models): each token is scored given the image
    /// and the text before it. In a file of lines, a line's `image` field (relative to the file's
    /// folder) does this for its text.
    #[arg(long, value_name = "FILE")]
    pub image: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Where `score` reads its input.
enum ScoreInput {
    One(String),
    Lines(tokenformer::eval::data::DataFile),
    Ids(Vec<u32>),
}

fn score_input(a: &ScoreArgs) -> Result<ScoreInput> {
    use tokenformer::eval::data::{DataFile, DEFAULT_MAX_LINE_BYTES};
    let max = DEFAULT_MAX_LINE_BYTES as u64;
    let stdin = a.file.as_ref().is_some_and(|f| f.as_os_str() == "-")
        || (a.text.is_none() && a.file.is_none() && a.ids.is_none());
    if a.jsonl && !stdin {
        bail!("--jsonl is for stdin: a file's format comes from its name (.jsonl, .jsonl.zst, .parquet)");
    }
    Ok(match (&a.text, &a.file, &a.ids) {
        (Some(t), _, _) => ScoreInput::One(t.clone()),
        (None, None, Some(ids)) => ScoreInput::Ids(ids.clone()),
        _ if stdin && std::io::stdin().is_terminal() => {
            bail!("give --text, --file or --ids, or pipe the text on stdin")
        }
        _ if stdin && a.jsonl => ScoreInput::Lines(DataFile::stdin(max as usize)),
        _ if stdin => ScoreInput::One(read_stdin(max)?),
        (None, Some(f), _) => {
            let name = f.to_string_lossy().to_lowercase();
            if LINE_FORMATS.iter().any(|e| name.ends_with(e)) {
                ScoreInput::Lines(DataFile::open(f)?)
            } else {
                // Bounded and regular files only: a FIFO or a huge file cannot hang or exhaust memory.
                ScoreInput::One(tokenformer::fsutil::read_to_string_bounded(f, max)?)
            }
        }
        (None, None, None) => unreachable!("stdin was read above"),
    })
}

/// Scores each `text` of a JSON-lines input, after the line's `image` where
/// it names one (a merged model); prints one JSON line per text (the `score
/// --json` object and its line number) as it goes.
fn score_lines(
    file: tokenformer::eval::data::DataFile,
    models: &LineModels,
    tokenizer: &tokenizers::Tokenizer,
) -> Result<()> {
    let path = file.path.display().to_string();
    let folder = lines_folder(&file);
    let mut out = std::io::stdout().lock();
    for line in tokenformer::eval::data::JsonLines::new(file) {
        let (n, value) = line?;
        let image = value.as_ref().ok().and_then(|v| v.get("image")).cloned();
        let (n, _, ids) = field_ids(&path, (n, value), "text", tokenizer)?;
        let at = || format!("{path} line {n}");
        let s = match models.line_image(image.as_ref(), &folder, at)? {
            Some((m, pixels)) => tokenformer::scoring::score_ids_after_image(m, &pixels, &ids),
            None => tokenformer::scoring::score_ids(models.text.get()?, &ids),
        }
        .with_context(at)?;
        #[derive(serde::Serialize)]
        struct Scored<'a> {
            #[serde(flatten)]
            score: &'a tokenformer::SequenceScore,
            line: usize,
        }
        let json = serde_json::to_string(&Scored { score: &s, line: n })?;
        writeln!(out, "{json}")?;
    }
    Ok(())
}

pub fn score_cmd(a: ScoreArgs) -> Result<()> {
    let dev = a.device.open()?;
    let files = a.model.locate()?;
    if a.image.is_some() {
        check_merged(&files, &a.weights)?;
    }
    let (ids, tokenizer) = match score_input(&a)? {
        ScoreInput::One(t) => {
            let tok = loader::load_tokenizer(&files)?;
            let ids = tok
                .encode(t.as_str(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?
                .get_ids()
                .to_vec();
            (ids, Some(tok))
        }
        ScoreInput::Ids(ids) => (ids, None),
        ScoreInput::Lines(_) if a.image.is_some() => {
            bail!("--image goes with one text: in a file of lines, each line may name its `image`")
        }
        ScoreInput::Lines(data) => {
            let tok = loader::load_tokenizer(&files)?;
            return score_lines(data, &LineModels::new(&files, &a.weights, &dev), &tok);
        }
    };
    let s = match &a.image {
        Some(path) => {
            let (model, pixels) = load_merged(&files, &a.weights, &dev, path)?;
            tokenformer::scoring::score_ids_after_image(&model, &pixels, &ids)
        }
        None => tokenformer::scoring::score_ids(&a.weights.load_lm(&files, &dev)?, &ids),
    };
    let s = s.with_context(|| match &a.file {
        Some(f) => format!("scoring {}", f.display()),
        None => "scoring the input".to_string(),
    })?;
    if a.json {
        outln!("{}", serde_json::to_string(&s)?)?;
        return Ok(());
    }
    let piece = |id: u32| {
        tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .map(|p| format!("{p:?}"))
            .unwrap_or_else(|| id.to_string())
    };
    outln!("{:>5}  {:<20} {:>10}  argmax", "pos", "next token", "log p")?;
    for t in 0..s.next_token_logprobs.len() {
        outln!(
            "{:>5}  {:<20} {:>10.4}  {}",
            t,
            piece(s.ids[t + 1]),
            s.next_token_logprobs[t],
            piece(s.argmax[t])
        )?;
    }
    outln!(
        "tokens scored {}  total NLL {:.4}  perplexity {:.4}",
        s.next_token_logprobs.len(),
        s.nll,
        s.perplexity
    )?;
    Ok(())
}
