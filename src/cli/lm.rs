//! `tokenformer generate` and `tokenformer score`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::Args;
use tokenformer::generate::{generate, generate_with_image, token_budget, SamplingParams};
use tokenformer::loader;
use tokenformer::models::tokenformer::TokenFormerLm;
use tokenformer::models::vl::{self, VisionLanguageModel};
use tokenformer::vision::EvalTransform;

use super::{ModelArgs, WeightArgs};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub weights: WeightArgs,
    /// The text to continue.
    #[arg(long, short)]
    pub prompt: String,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// 0 = greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long, default_value_t = 299_792_458)]
    pub seed: u64,
    /// An image to condition on (tokenformer-vl models): the sequence is [image tokens; prompt].
    #[arg(long, value_name = "IMG")]
    pub image: Option<PathBuf>,
}

/// What `generate` runs: a merged model with its preprocessed image, or a language model.
enum Generator {
    WithImage(Box<VisionLanguageModel>, Tensor),
    Text(Box<TokenFormerLm>),
}

pub fn generate_cmd(a: GenerateArgs) -> Result<()> {
    let files = a.model.locate()?;
    // Known before any weights are read, so a wrong --image fails fast.
    let arch = match &files.config {
        loader::ConfigSource::Json { value, .. } => loader::architecture(value).to_string(),
        loader::ConfigSource::OfficialYml(_) => {
            tokenformer::models::tokenformer::ARCHITECTURE.into()
        }
    };
    if a.image.is_some() && arch != vl::ARCHITECTURE {
        bail!(
            "--image needs a vision-language model (`{}`), but {} is `{arch}`: merge one with `tokenformer-convert merge`",
            vl::ARCHITECTURE,
            files.source
        );
    }
    let tokenizer = loader::load_tokenizer(&files)?;
    if a.prompt.is_empty() {
        bail!("the prompt is empty: pass --prompt TEXT");
    }
    let prompt = tokenizer
        .encode(a.prompt.as_str(), false)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
        .get_ids()
        .to_vec();
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    let dev = Device::Cpu;
    // Image + text runs the merged model; text alone runs a language model
    // (a merged model's language route when the folder is tokenformer-vl).
    let model = match &a.image {
        Some(path) => {
            let model = loader::load_vl(&files, &dev)?;
            let transform = EvalTransform::from_config(model.vision().config());
            let pixels = transform.batch(vec![transform.load(path)?], &dev)?;
            Generator::WithImage(Box::new(model), pixels)
        }
        None => Generator::Text(Box::new(a.weights.load_lm(&files)?)),
    };
    let text_cfg = match &model {
        Generator::WithImage(m, _) => m.language().config(),
        Generator::Text(m) => m.config(),
    };
    let (eos, max) = (text_cfg.eos_token_id, text_cfg.max_position_embeddings);
    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{}", a.prompt)?;
    stdout.flush()?;
    // Decode the growing suffix so multi-token characters print correctly.
    let mut generated: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let on_token = |tok: u32| {
        if tok == eos {
            return Ok(());
        }
        generated.push(tok);
        let text = tokenizer.decode(&generated, false).unwrap_or_default();
        if text.len() > printed && !text.ends_with('\u{FFFD}') && text.is_char_boundary(printed) {
            let _ = write!(stdout, "{}", &text[printed..]);
            let _ = stdout.flush();
            printed = text.len();
        }
        Ok(())
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
    match &model {
        Generator::WithImage(m, pixels) => {
            generate_with_image(m, pixels, &prompt, a.max_new_tokens, params, on_token)?
        }
        Generator::Text(m) => generate(m, &prompt, a.max_new_tokens, params, on_token)?,
    };
    writeln!(std::io::stdout())?;
    Ok(())
}

#[derive(Args, Debug)]
pub struct ScoreArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub weights: WeightArgs,
    /// Text to score.
    #[arg(long, conflicts_with_all = ["file", "ids"])]
    pub text: Option<String>,
    /// A UTF-8 text file to score.
    #[arg(long, conflicts_with = "ids")]
    pub file: Option<PathBuf>,
    /// Comma-separated token ids to score (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn score_cmd(a: ScoreArgs) -> Result<()> {
    let files = a.model.locate()?;
    let text = match (&a.text, &a.file) {
        (Some(t), _) => Some(t.clone()),
        // Bounded and regular files only: a FIFO or a huge file cannot hang or exhaust memory.
        (None, Some(f)) => Some(tokenformer::fsutil::read_to_string_bounded(
            f,
            tokenformer::eval::pile::DEFAULT_MAX_LINE_BYTES as u64,
        )?),
        _ => None,
    };
    let (ids, tokenizer) = match (text, a.ids) {
        (Some(t), _) => {
            let tok = loader::load_tokenizer(&files)?;
            let ids = tok
                .encode(t.as_str(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?
                .get_ids()
                .to_vec();
            (ids, Some(tok))
        }
        (None, Some(ids)) => (ids, None),
        (None, None) => bail!("give --text, --file or --ids"),
    };
    let model = a.weights.load_lm(&files)?;
    let s = tokenformer::scoring::score_ids(&model, &ids).with_context(|| match &a.file {
        Some(f) => format!("scoring {}", f.display()),
        None => "scoring the input".to_string(),
    })?;
    if a.json {
        println!("{}", serde_json::to_string(&s)?);
        return Ok(());
    }
    let piece = |id: u32| {
        tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .map(|p| format!("{p:?}"))
            .unwrap_or_else(|| id.to_string())
    };
    println!("{:>5}  {:<20} {:>10}  argmax", "pos", "next token", "log p");
    for t in 0..s.next_token_logprobs.len() {
        println!(
            "{:>5}  {:<20} {:>10.4}  {}",
            t,
            piece(s.ids[t + 1]),
            s.next_token_logprobs[t],
            piece(s.argmax[t])
        );
    }
    println!(
        "tokens scored {}  total NLL {:.4}  perplexity {:.4}",
        s.next_token_logprobs.len(),
        s.nll,
        s.perplexity
    );
    Ok(())
}
