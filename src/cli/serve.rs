//! `tokenformer serve`: a language model behind the OpenAI completions API
//! (`POST /v1/completions`, `GET /v1/models`, `GET /health`), as vLLM and
//! `transformers serve` offer it, so OpenAI clients and lm-evaluation-harness's
//! `local-completions` model work unchanged. Requests are decoded together
//! by [`generate::serve_jobs`] (continuous batching); the HTTP side only
//! parses, checks, tokenizes and writes.

use std::io::{Read, Write};
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use clap::Args;
use serde::Deserialize;
use serde_json::{json, Value};
use tiny_http::{Header, Method, Request, Response, Server};
use tokenformer::generate::{self, Event, FinishReason, Job, Logprobs, SamplingParams};
use tokenformer::loader;
use tokenformer::models::tokenformer::TokenFormerLm;

use super::{DeviceArgs, KvDtypeArg, ModelArgs, WeightArgs};

/// A request body larger than this is refused (413) before it is read.
const MAX_BODY_BYTES: usize = 16 << 20;
/// Prompts one request may carry.
const MAX_PROMPTS: usize = 256;
/// Stop strings one request may carry, and the longest.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 1024;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub weights: WeightArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface, with no
    /// authentication).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The port (0: any free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The model's name in the API (`model` of requests and answers); default: --model as given.
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Sequences decoded together, across requests (continuous batching).
    #[arg(long, default_value_t = generate::DEFAULT_BATCH_SIZE, value_parser = super::positive::<usize>)]
    pub batch_size: usize,
    /// Requests handled at once (each holds a connection; more wait for one to finish).
    #[arg(long, default_value_t = 64, value_parser = super::positive::<usize>)]
    pub max_connections: usize,
    /// Keep the KV cache in f16 (see `generate --kv-dtype`).
    #[arg(long, value_enum, default_value_t)]
    pub kv_dtype: KvDtypeArg,
}

/// What every handler shares.
struct Served<'a> {
    name: String,
    model: &'a TokenFormerLm,
    tokenizer: &'a tokenizers::Tokenizer,
    jobs: Sender<Job>,
    /// A text prompt longer than this cannot fit the context (see
    /// [`max_prompt_bytes`]) and is refused before it is tokenized.
    max_prompt_bytes: usize,
}

pub fn serve_cmd(a: ServeArgs) -> Result<()> {
    let dev = a.device.open()?;
    let files = a.model.locate()?;
    let tokenizer = loader::load_tokenizer(&files)?;
    let model = a.weights.load_lm(&files, &dev)?;
    let server = Server::http((a.host.as_str(), a.port))
        .map_err(|e| anyhow::anyhow!("listening on {}:{}: {e}", a.host, a.port))?;
    let addr = server
        .server_addr()
        .to_ip()
        .context("the server has no IP address")?;
    let name = a.served_model_name.unwrap_or_else(|| a.model.model.clone());
    eprintln!("serving {name} on http://{addr}/v1 (POST /v1/completions; Ctrl-C ends)");
    let (jobs, queue) = mpsc::channel();
    let served = Served {
        name,
        model: &model,
        tokenizer: &tokenizer,
        jobs,
        max_prompt_bytes: max_prompt_bytes(&tokenizer, model.config().max_position_embeddings),
    };
    let (kv, batch) = (a.kv_dtype.into(), a.batch_size);
    std::thread::scope(|s| -> Result<()> {
        for _ in 0..a.max_connections {
            s.spawn(|| {
                while let Ok(request) = server.recv() {
                    handle(&served, request);
                }
            });
        }
        generate::serve_jobs(&model, &tokenizer, kv, batch, queue)?;
        Ok(())
    })
}

/// The most bytes a text of `positions` tokens can have: each token decodes
/// to at most the longest token's bytes, and Unicode normalisation (NFC
/// composes up to three code points into one) shrinks a text at most
/// threefold before it is split. A longer prompt is refused before the
/// tokenizer, which needs ~130 bytes of memory per byte of text, runs on it.
fn max_prompt_bytes(tokenizer: &tokenizers::Tokenizer, positions: usize) -> usize {
    let longest = (0..tokenizer.get_vocab_size(true) as u32)
        .filter_map(|id| tokenizer.decode(&[id], false).ok())
        .map(|t| t.len())
        .max()
        .unwrap_or(1);
    positions.saturating_mul(longest).saturating_mul(3)
}

/// An error answer: its status and message, written as the OpenAI API writes them.
struct Refusal(u16, String);

impl Refusal {
    fn bad(message: impl Into<String>) -> Self {
        Self(400, message.into())
    }
}

fn handle(served: &Served, mut request: Request) {
    let method = request.method().clone();
    let path = request
        .url()
        .split('?')
        .next()
        .unwrap_or_default()
        .to_string();
    let answer = match (&method, path.as_str()) {
        (Method::Get, "/health") => Ok(json!({})),
        (Method::Get, "/v1/models") => Ok(models(served)),
        (Method::Get, "/tokenizer_info") => Ok(tokenizer_info(served)),
        (Method::Post, "/v1/completions") => match read_body(&mut request) {
            Ok(body) => return completions(served, request, &body),
            Err(e) => Err(e),
        },
        (Method::Post, "/tokenize") => read_body(&mut request).and_then(|b| tokenize(served, &b)),
        (Method::Post, "/detokenize") => {
            read_body(&mut request).and_then(|b| detokenize(served, &b))
        }
        (
            _,
            "/health" | "/v1/models" | "/tokenizer_info" | "/v1/completions" | "/tokenize"
            | "/detokenize",
        ) => Err(Refusal(405, format!("{method} is not allowed on {path}"))),
        _ => Err(Refusal(404, format!("no such endpoint: {path}"))),
    };
    match answer {
        Ok(body) => reply(request, 200, &body),
        Err(refusal) => refuse(request, refusal),
    }
}

fn models(served: &Served) -> Value {
    json!({
        "object": "list",
        "data": [{
            "id": served.name,
            "object": "model",
            "created": now(),
            "owned_by": "tokenformer",
            "max_model_len": served.model.config().max_position_embeddings,
        }],
    })
}

/// vLLM's tokenizer endpoints, which lm-evaluation-harness's `local-completions`
/// uses (`tokenizer_backend=remote`, picked by itself when they answer), so
/// the harness needs no copy of the tokenizer.
fn tokenizer_info(served: &Served) -> Value {
    let cfg = served.model.config();
    json!({
        "eos_token": served.tokenizer.id_to_token(cfg.eos_token_id),
        "bos_token": null,
        "pad_token": null,
        "model_max_length": cfg.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
}

fn tokenize(served: &Served, body: &[u8]) -> Result<Value, Refusal> {
    #[derive(Deserialize)]
    struct Tokenize {
        prompt: String,
        #[serde(default)]
        add_special_tokens: bool,
    }
    let r: Tokenize = serde_json::from_slice(body)
        .map_err(|e| Refusal::bad(format!("the request body is not a tokenize request: {e}")))?;
    let ids = served
        .tokenizer
        .encode(r.prompt.as_str(), r.add_special_tokens)
        .map_err(|e| Refusal::bad(format!("tokenizing the prompt: {e}")))?
        .get_ids()
        .to_vec();
    Ok(json!({
        "count": ids.len(),
        "max_model_len": served.model.config().max_position_embeddings,
        "tokens": ids,
    }))
}

fn detokenize(served: &Served, body: &[u8]) -> Result<Value, Refusal> {
    #[derive(Deserialize)]
    struct Detokenize {
        tokens: Vec<u32>,
    }
    let r: Detokenize = serde_json::from_slice(body)
        .map_err(|e| Refusal::bad(format!("the request body is not a detokenize request: {e}")))?;
    let vocab = served.tokenizer.get_vocab_size(true) as u32;
    if let Some(bad) = r.tokens.iter().find(|&&t| t >= vocab) {
        return Err(Refusal::bad(format!(
            "token id {bad} is outside the tokenizer's {vocab} ids"
        )));
    }
    let text = served
        .tokenizer
        .decode(&r.tokens, false)
        .map_err(|e| Refusal::bad(format!("decoding the tokens: {e}")))?;
    Ok(json!({ "prompt": text }))
}

fn read_body(request: &mut Request) -> Result<Vec<u8>, Refusal> {
    let too_large = || {
        Refusal(
            413,
            format!("the request body is over {} MiB", MAX_BODY_BYTES >> 20),
        )
    };
    if request.body_length().is_some_and(|n| n > MAX_BODY_BYTES) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    request
        .as_reader()
        .take(MAX_BODY_BYTES as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| Refusal::bad(format!("reading the request body: {e}")))?;
    if body.len() > MAX_BODY_BYTES {
        return Err(too_large());
    }
    Ok(body)
}

/// One prompt or several, as text or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// A prompt as it came.
enum PromptIn {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The body of `POST /v1/completions`: the OpenAI fields, with vLLM's `top_k`
/// and `repetition_penalty`. Other fields are ignored, as the API servers
/// ignore them; settings this engine cannot honour are refused.
#[derive(Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Prompt,
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<u64>,
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    echo: bool,
    logprobs: Option<usize>,
    n: Option<usize>,
    best_of: Option<usize>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f32>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    suffix: Option<String>,
}

/// A request checked and tokenized, ready to run.
struct Completion {
    prompts: Vec<(String, Vec<u32>)>,
    max_tokens: usize,
    params: SamplingParams,
    stop: Vec<String>,
    echo: bool,
    logprobs: Option<usize>,
    stream: bool,
    include_usage: bool,
}

impl Completion {
    /// `echo` with `logprobs`: the prompt's tokens get theirs too.
    fn prompt_logprobs(&self) -> bool {
        self.echo && self.logprobs.is_some()
    }
}

fn completions(served: &Served, request: Request, body: &[u8]) {
    let completion = match parse(served, body) {
        Ok(c) => c,
        Err(refusal) => return refuse(request, refusal),
    };
    let id = format!("cmpl-{:032x}", rand::random::<u128>());
    // Every prompt is queued at once, so they decode together.
    let mut runs = Vec::with_capacity(completion.prompts.len());
    for (_, ids) in &completion.prompts {
        let (events, rx) = mpsc::channel();
        let job = Job {
            prompt: ids.clone(),
            max_new_tokens: completion.max_tokens,
            params: completion.params.clone(),
            stop: completion.stop.clone(),
            logprobs: completion.logprobs,
            prompt_logprobs: completion.prompt_logprobs(),
            events,
        };
        if served.jobs.send(job).is_err() {
            return refuse(request, Refusal(503, "the server is shutting down".into()));
        }
        runs.push(rx);
    }
    let head = Head {
        id: &id,
        created: now(),
        model: &served.name,
    };
    if completion.stream {
        stream(served, request, &completion, runs, &head);
        return;
    }
    let mut choices = Vec::with_capacity(runs.len());
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (index, ((text, ids), rx)) in completion.prompts.iter().zip(runs).enumerate() {
        let mut choice = Choice::new(index, &completion);
        if completion.echo {
            choice.echo(served, text, ids[0]);
        }
        for event in rx {
            match choice.take(served, event) {
                Ok(generated) => completion_tokens += generated.unwrap_or(0),
                Err(e) => return refuse(request, Refusal(500, e)),
            }
        }
        if choice.finish.is_none() {
            return refuse(request, Refusal(500, "the generation ended early".into()));
        }
        prompt_tokens += ids.len();
        choices.push(choice.json());
    }
    let mut body = head.json(choices);
    body["usage"] = usage(prompt_tokens, completion_tokens);
    reply(request, 200, &body);
}

fn parse(served: &Served, body: &[u8]) -> Result<Completion, Refusal> {
    let r: CompletionRequest = serde_json::from_slice(body)
        .map_err(|e| Refusal::bad(format!("the request body is not a completion request: {e}")))?;
    if let Some(m) = r.model.as_ref().filter(|m| **m != served.name) {
        return Err(Refusal(
            404,
            format!(
                "the model `{m}` does not exist; this server serves `{}`",
                served.name
            ),
        ));
    }
    for (name, ok) in [
        ("n", r.n.is_none_or(|n| n == 1)),
        ("best_of", r.best_of.is_none_or(|n| n == 1)),
        (
            "presence_penalty",
            r.presence_penalty.is_none_or(|p| p == 0.0),
        ),
        (
            "frequency_penalty",
            r.frequency_penalty.is_none_or(|p| p == 0.0),
        ),
        (
            "logit_bias",
            r.logit_bias.as_ref().is_none_or(|b| b.is_empty()),
        ),
        ("suffix", r.suffix.as_ref().is_none_or(|s| s.is_empty())),
    ] {
        if !ok {
            return Err(Refusal::bad(format!(
                "`{name}` is not supported by this server (leave it out or at its default)"
            )));
        }
    }
    let stop = match r.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOPS || stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(Refusal::bad(format!(
            "`stop`: at most {MAX_STOPS} strings of at most {MAX_STOP_BYTES} bytes"
        )));
    }
    let params = SamplingParams {
        temperature: r.temperature.unwrap_or(1.0),
        top_k: r.top_k.filter(|&k| k > 0).map(|k| k as usize),
        top_p: r.top_p,
        seed: r.seed.unwrap_or_else(rand::random),
        repeat_penalty: r.repetition_penalty.unwrap_or(1.0),
        repeat_last_n: 0,
    };
    params.validate().map_err(|e| Refusal::bad(e.to_string()))?;
    if let Some(k) = r.logprobs.filter(|&k| k > generate::MAX_TOP_LOGPROBS) {
        return Err(Refusal::bad(format!(
            "`logprobs`: at most {}, got {k}",
            generate::MAX_TOP_LOGPROBS
        )));
    }
    let max_tokens = r.max_tokens.unwrap_or(16);
    let (many, prompts) = match r.prompt {
        Prompt::Text(t) => (false, vec![PromptIn::Text(t)]),
        Prompt::Texts(v) => (true, v.into_iter().map(PromptIn::Text).collect()),
        Prompt::Ids(v) => (false, vec![PromptIn::Ids(v)]),
        Prompt::IdLists(v) => (true, v.into_iter().map(PromptIn::Ids).collect()),
    };
    match prompts.len() {
        0 => return Err(Refusal::bad("`prompt` is an empty list")),
        n if n > MAX_PROMPTS => {
            return Err(Refusal::bad(format!(
                "`prompt`: at most {MAX_PROMPTS} prompts a request, got {n}"
            )))
        }
        _ => {}
    }
    let prompts = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let named = |e: String| {
                Refusal::bad(if many {
                    format!("prompt #{}: {e}", i + 1)
                } else {
                    e
                })
            };
            let tokenizer = served.tokenizer;
            let ids = match &p {
                PromptIn::Text(t) if t.len() > served.max_prompt_bytes => {
                    return Err(named(format!(
                        "the prompt has {} bytes, more than {} tokens of this tokenizer can hold: \
                         it cannot fit the model's context",
                        t.len(),
                        served.model.config().max_position_embeddings
                    )))
                }
                PromptIn::Text(t) => tokenizer
                    .encode(t.as_str(), false)
                    .map_err(|e| named(format!("tokenizing the prompt: {e}")))?
                    .get_ids()
                    .to_vec(),
                PromptIn::Ids(ids) => ids.clone(),
            };
            generate::check_prompt(served.model, &ids, max_tokens)
                .map_err(|e| named(e.to_string()))?;
            let text = match p {
                PromptIn::Text(t) => t,
                PromptIn::Ids(_) => tokenizer
                    .decode(&ids, false)
                    .map_err(|e| named(format!("decoding the prompt's ids: {e}")))?,
            };
            Ok((text, ids))
        })
        .collect::<Result<Vec<_>, Refusal>>()?;
    Ok(Completion {
        prompts,
        max_tokens,
        params,
        stop,
        echo: r.echo,
        logprobs: r.logprobs,
        stream: r.stream,
        include_usage: r.stream_options.is_some_and(|o| o.include_usage),
    })
}

/// What every answer and chunk of one request starts with.
struct Head<'a> {
    id: &'a str,
    created: u64,
    model: &'a str,
}

impl Head<'_> {
    fn json(&self, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

/// One choice as it is built: its text, and its logprobs when asked for.
struct Choice {
    index: usize,
    text: String,
    logprobs: Option<LogprobLists>,
    finish: Option<FinishReason>,
}

/// The OpenAI completions `logprobs` object.
#[derive(Default)]
struct LogprobLists {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    text_offset: Vec<usize>,
    /// Characters so far, for `text_offset`.
    chars: usize,
}

impl LogprobLists {
    fn push(&mut self, served: &Served, id: u32, lp: Option<&Logprobs>) {
        let token = token_text(served, id);
        self.text_offset.push(self.chars);
        self.chars += token.chars().count();
        self.token_logprobs.push(lp.map(|l| l.logprob));
        self.top_logprobs.push(lp.map(|l| {
            // The chosen token is listed too, as the API servers list it.
            let mut top = serde_json::Map::new();
            for &(t, p) in &l.top {
                top.insert(token_text(served, t), json!(p));
            }
            top.entry(token.clone()).or_insert(json!(l.logprob));
            top
        }));
        self.tokens.push(token);
    }

    fn json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

fn token_text(served: &Served, id: u32) -> String {
    served.tokenizer.decode(&[id], false).unwrap_or_default()
}

impl Choice {
    fn new(index: usize, c: &Completion) -> Self {
        Self {
            index,
            text: String::new(),
            logprobs: c.logprobs.map(|_| LogprobLists::default()),
            finish: None,
        }
    }

    /// The prompt before the completion: its text and, with logprobs, its
    /// first token, which has none (the others come in [`Event::Prompt`]).
    fn echo(&mut self, served: &Served, text: &str, first: u32) {
        self.text.push_str(text);
        if let Some(lists) = &mut self.logprobs {
            lists.push(served, first, None);
        }
    }

    /// Adds one of the job's events: `Some(tokens generated)` at its end, the
    /// message if it failed.
    fn take(&mut self, served: &Served, event: Event) -> Result<Option<usize>, String> {
        match event {
            Event::Prompt(tokens) => {
                if let Some(lists) = &mut self.logprobs {
                    for (id, lp) in &tokens {
                        lists.push(served, *id, Some(lp));
                    }
                }
                Ok(None)
            }
            Event::Token { id, text, logprobs } => {
                self.text.push_str(&text);
                if let Some(lists) = &mut self.logprobs {
                    lists.push(served, id, logprobs.as_ref());
                }
                Ok(None)
            }
            Event::End {
                finish_reason,
                text,
                generated_tokens,
            } => {
                self.text.push_str(&text);
                self.finish = Some(finish_reason);
                Ok(Some(generated_tokens))
            }
            Event::Failed(e) => Err(e),
        }
    }

    fn json(&self) -> Value {
        json!({
            "index": self.index,
            "text": self.text,
            "logprobs": self.logprobs.as_ref().map(LogprobLists::json),
            "finish_reason": self.finish.map(finish_reason),
        })
    }
}

/// The API's two reasons: `stop` (the end-of-text token or a stop string) and `length`.
fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::EosToken | FinishReason::StopSequence => "stop",
        FinishReason::Length => "length",
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Server-sent events, one chunk per token, each prompt's in turn (they
/// decode together), then `data: [DONE]`. The events are written and flushed
/// as they come; a client that leaves ends its generations at their next token.
fn stream(
    served: &Served,
    request: Request,
    c: &Completion,
    runs: Vec<Receiver<Event>>,
    head: &Head,
) {
    let mut out = Chunked(request.into_writer());
    let start = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
                 Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n";
    if out.0.write_all(start.as_bytes()).is_err() {
        return;
    }
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (index, ((text, ids), rx)) in c.prompts.iter().zip(runs).enumerate() {
        let mut first = Choice::new(index, c);
        if c.echo {
            first.echo(served, text, ids[0]);
            // The prompt's log-probabilities come first, in one event: one chunk with the prompt.
            if c.prompt_logprobs() {
                let taken = match rx.recv() {
                    Ok(event) => first.take(served, event),
                    Err(_) => Err("the generation ended early".to_string()),
                };
                if let Err(e) = taken {
                    let _ = out.error(&e);
                    return;
                }
            }
            if out.event(&head.json(vec![first.json()])).is_err() {
                return;
            }
        }
        prompt_tokens += ids.len();
        for event in rx {
            let mut choice = Choice::new(index, c);
            match choice.take(served, event) {
                Ok(None) => {}
                Ok(Some(generated)) => {
                    // The last chunk: the held-back text and the reason, no token.
                    choice.logprobs = None;
                    completion_tokens += generated;
                }
                Err(e) => {
                    let _ = out.error(&e);
                    return;
                }
            }
            if out.event(&head.json(vec![choice.json()])).is_err() {
                return;
            }
        }
    }
    if c.include_usage {
        let mut last = head.json(Vec::new());
        last["usage"] = usage(prompt_tokens, completion_tokens);
        if out.event(&last).is_err() {
            return;
        }
    }
    let _ = out.data("[DONE]").and_then(|()| out.end());
}

/// An HTTP/1.1 chunked body written and flushed a piece at a time (tiny_http
/// buffers a streamed body in 8 KiB chunks, too late for token streaming).
struct Chunked(Box<dyn Write + Send>);

impl Chunked {
    fn event(&mut self, v: &Value) -> std::io::Result<()> {
        self.data(&v.to_string())
    }

    /// A failure after the answer began: an event with the API's error body.
    fn error(&mut self, message: &str) -> std::io::Result<()> {
        self.event(&json!({"error": {"message": message, "type": "server_error"}}))
    }

    fn data(&mut self, data: &str) -> std::io::Result<()> {
        let piece = format!("data: {data}\n\n");
        write!(self.0, "{:x}\r\n{piece}\r\n", piece.len())?;
        self.0.flush()
    }

    fn end(&mut self) -> std::io::Result<()> {
        self.0.write_all(b"0\r\n\r\n")?;
        self.0.flush()
    }
}

fn reply(request: Request, status: u16, body: &Value) {
    let header = Header::from_bytes("Content-Type", "application/json").expect("a valid header");
    let response = Response::from_string(body.to_string())
        .with_status_code(status)
        .with_header(header);
    // A client that left is no one's error.
    let _ = request.respond(response);
}

fn refuse(request: Request, Refusal(status, message): Refusal) {
    let kind = match status {
        400 | 413 => "invalid_request_error",
        404 => "not_found_error",
        405 => "method_not_allowed",
        _ => "server_error",
    };
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status}});
    reply(request, status, &body);
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
