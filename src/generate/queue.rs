//! Continuous batching over requests that keep arriving, as a server needs
//! it: [`serve_jobs`] takes [`Job`]s from a channel while others decode,
//! starts each as soon as a place in the batch is free, and sends each job's
//! tokens, text and end back on the job's own channel.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};

use candle_core::{DType, Tensor};

use super::batch::{run_batches, Start, Text};
use super::{check_prompt, FinishReason, SamplingParams, TextStream};
use crate::error::{Error, Result};
use crate::models::tokenformer::{KvDtype, TokenFormerLm};

/// The most alternatives a token's [`Logprobs::top`] may list (the OpenAI
/// API allows 5, vLLM 20).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generation for [`serve_jobs`].
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub params: SamplingParams,
    /// The text ends before the first of these (see [`TextStream`]).
    pub stop: Vec<String>,
    /// With `Some(k)`, each token comes with its log-probability and the
    /// `k` likeliest tokens' ([`Logprobs`]; `k` at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
    /// Whether the prompt's own tokens get theirs too ([`Event::Prompt`],
    /// from the prefill's logits of every position, so the prompt runs once).
    pub prompt_logprobs: bool,
    /// Where the job's [`Event`]s go; when the receiver is gone (a client
    /// that left) the job ends at its next token.
    pub events: Sender<Event>,
}

/// What [`serve_jobs`] sends about a job, in order: `Prompt` if asked for,
/// its tokens, then `End` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Each prompt token from the second on, with its log-probability after
    /// the tokens before it ([`Job::prompt_logprobs`]; the `k` of
    /// [`Job::logprobs`] alternatives, none without it).
    Prompt(Vec<(u32, Logprobs)>),
    Token {
        id: u32,
        /// The new text that is safe to show (may be empty: half a
        /// character, the start of a stop string, the end-of-text token).
        text: String,
        logprobs: Option<Logprobs>,
    },
    End {
        finish_reason: FinishReason,
        /// The text held back until the end (see [`TextStream::rest`]).
        text: String,
        /// Tokens the model produced, an end-of-text token included.
        generated_tokens: usize,
    },
    /// The job was refused or the model failed; nothing more follows.
    Failed(String),
}

/// A token's log-probability under the model (before any sampling setting)
/// and the `k` likeliest tokens' as `(id, logprob)`, likeliest first.
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl Logprobs {
    /// `token`'s log-probability and the `k` likeliest in one row of logits.
    pub fn of_row(row: &[f32], token: u32, k: usize) -> Self {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
        let lse = f64::from(max) + sum.ln();
        let lp = |i: usize| (f64::from(row[i]) - lse) as f32;
        let mut order: Vec<u32> = (0..row.len() as u32).collect();
        let k = k.min(row.len());
        let by_logit =
            |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        if k > 0 && k < order.len() {
            order.select_nth_unstable_by(k - 1, by_logit);
        }
        order.truncate(k);
        order.sort_by(by_logit);
        Self {
            logprob: row
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |_| lp(token as usize)),
            top: order.into_iter().map(|i| (i, lp(i as usize))).collect(),
        }
    }
}

/// A job in flight: its channel, text and settings.
struct Running<'t> {
    events: Sender<Event>,
    stream: TextStream<'t>,
    logprobs: Option<usize>,
}

/// The prompt's [`Event::Prompt`] from its logits [t, vocab].
fn prompt_logprobs(prompt: &[u32], logits: &Tensor, k: usize) -> Result<Vec<(u32, Logprobs)>> {
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .zip(&prompt[1..])
        .map(|(row, &next)| (next, Logprobs::of_row(row, next, k)))
        .collect())
}

/// Decodes the jobs that arrive on `jobs`, `batch_size` sequences at a time,
/// until the channel closes and the last job ends. Each job gets what
/// [`super::generate_with_kv`] gives its prompt alone, up to the float
/// rounding of batched products. A job whose prompt or settings are refused
/// gets `Failed` with the reason; if the model fails, every job in flight
/// gets `Failed` and the loop goes on with the next.
pub fn serve_jobs(
    model: &TokenFormerLm,
    tokenizer: &tokenizers::Tokenizer,
    kv: KvDtype,
    batch_size: usize,
    jobs: Receiver<Job>,
) -> Result<()> {
    if batch_size == 0 {
        return Err(Error::option("batch_size", "must be at least 1"));
    }
    let eos = model.config().eos_token_id;
    let text = Text { model, kv };
    // Shared by the three callbacks below, one at a time.
    let running: RefCell<HashMap<usize, Running>> = RefCell::new(HashMap::new());
    let mut keys = 0usize..;
    let mut closed = false;
    while !closed {
        let result = run_batches(
            &text,
            batch_size,
            |idle| loop {
                let job = if idle {
                    jobs.recv().ok()
                } else {
                    match jobs.try_recv() {
                        Ok(job) => Some(job),
                        Err(TryRecvError::Empty) => return None,
                        Err(TryRecvError::Disconnected) => None,
                    }
                };
                let Some(job) = job else {
                    closed = true;
                    return None;
                };
                match admit(model, &job) {
                    Ok(budget) => {
                        let key = keys.next().expect("an unbounded range");
                        running.borrow_mut().insert(
                            key,
                            Running {
                                events: job.events,
                                stream: TextStream::new(tokenizer, &job.stop),
                                logprobs: job.logprobs,
                            },
                        );
                        return Some(Start {
                            key,
                            prompt: job.prompt,
                            budget,
                            params: job.params,
                            prompt_logits: job.prompt_logprobs,
                        });
                    }
                    Err(e) => {
                        let _ = job.events.send(Event::Failed(e.to_string()));
                    }
                }
            },
            |key, prompt, logits| {
                let running = running.borrow();
                let Some(run) = running.get(&key) else {
                    return Ok(());
                };
                let k = run.logprobs.unwrap_or(0);
                // A client that left is noticed at the job's first token.
                let _ = run
                    .events
                    .send(Event::Prompt(prompt_logprobs(prompt, logits, k)?));
                Ok(())
            },
            |key, id, logits| {
                let mut running = running.borrow_mut();
                let Some(run) = running.get_mut(&key) else {
                    return Ok(ControlFlow::Break(()));
                };
                let (text, flow) = if id == eos {
                    (String::new(), ControlFlow::Continue(()))
                } else {
                    run.stream.push(id)?
                };
                let logprobs = match run.logprobs {
                    Some(k) => {
                        let row = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                        Some(Logprobs::of_row(&row, id, k))
                    }
                    None => None,
                };
                let event = Event::Token { id, text, logprobs };
                if run.events.send(event).is_err() {
                    return Ok(ControlFlow::Break(()));
                }
                Ok(flow)
            },
            |key, tokens| {
                let run = running.borrow_mut().remove(&key);
                if let Some(mut run) = run {
                    let text = run.stream.rest();
                    let end = Event::End {
                        finish_reason: FinishReason::of(&tokens, eos, &run.stream),
                        text,
                        generated_tokens: tokens.len(),
                    };
                    let _ = run.events.send(end);
                }
            },
        );
        if let Err(e) = result {
            // The jobs in flight are lost with the batch; say so to each.
            for (_, run) in running.borrow_mut().drain() {
                let _ = run
                    .events
                    .send(Event::Failed(format!("the model failed: {e}")));
            }
        }
    }
    Ok(())
}

/// Checks a job before it starts; its token budget.
fn admit(model: &TokenFormerLm, job: &Job) -> Result<usize> {
    job.params.validate()?;
    if let Some(k) = job.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
        return Err(Error::option(
            "logprobs",
            format!("at most {MAX_TOP_LOGPROBS} alternatives, got {k}"),
        ));
    }
    check_prompt(model, &job.prompt, job.max_new_tokens)
}
