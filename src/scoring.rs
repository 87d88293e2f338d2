//! Log-likelihood scoring: per-position log p(next token) of one sequence
//! (`tokenformer score`), and the batched scoring core of the evaluations:
//! log p(continuation | context) for many (context, continuation) token pairs,
//! with lm-evaluation-harness's truncation and greedy check
//! (<https://github.com/EleutherAI/lm-evaluation-harness>, `HFLM._loglikelihood_tokens`).
//!
//! Batches are right-padded: under the causal mask a real token never attends
//! to a later (pad) position, so padding cannot change a score. Only the scored
//! positions go through the output layer, in row chunks, and their
//! log-softmax is reduced to the target's value (and argmax) without
//! materialising a log-probability tensor.

use candle_core::{DType, Storage, Tensor, D};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::kernels::TargetLogprobs;
use crate::models::tokenformer::{AttentionMode, Rotary, TokenFormerLm};
use crate::models::vl::VisionLanguageModel;

/// Per-position scores of one sequence of ids.
#[derive(Clone, Debug, Serialize)]
pub struct SequenceScore {
    pub ids: Vec<u32>,
    /// `[t]` = log p(ids[t+1] | ids[..=t]).
    pub next_token_logprobs: Vec<f32>,
    /// `[t]` = argmax of the logits at position t.
    pub argmax: Vec<u32>,
    /// `[t]` = logsumexp of the logits at position t.
    pub logsumexp: Vec<f32>,
    /// −Σ next_token_logprobs.
    pub nll: f64,
    /// exp(nll / number of predictions).
    pub perplexity: f64,
}

/// Scores every next-token prediction of `ids` in one forward pass.
pub fn score_ids(model: &TokenFormerLm, ids: &[u32]) -> Result<SequenceScore> {
    check_scored(model, ids)?;
    sequence_score(ids, &forward_logits(model, ids)?)
}

/// [`score_ids`] for text after an image (pixels [1, C, H, W]) in a merged
/// model: each text token given the image and the text before it (the first
/// is context only, as in [`score_ids`]).
pub fn score_ids_after_image(
    model: &VisionLanguageModel,
    pixels: &Tensor,
    ids: &[u32],
) -> Result<SequenceScore> {
    let lm = model.language();
    check_scored(lm, ids)?;
    let input = Tensor::new(ids, lm.device())?.unsqueeze(0)?;
    // The text's logits only: the image's (the classifier head) are not needed.
    let logits = lm.head(&model.text_hidden(pixels, &input)?)?;
    sequence_score(ids, &logits.squeeze(0)?)
}

/// The next-token logits [t, vocab] (f32) at every position of `ids`, as
/// transformers' `model(ids).logits[0]`: row i scores the token after
/// `ids[..=i]`.
pub fn logits(model: &TokenFormerLm, ids: &[u32]) -> Result<Tensor> {
    if ids.is_empty() {
        return Err(Error::input("logits of no tokens: give at least one"));
    }
    check_fits(model, ids)?;
    forward_logits(model, ids)
}

/// The logits [t, vocab] (f32) of ids already checked.
fn forward_logits(model: &TokenFormerLm, ids: &[u32]) -> Result<Tensor> {
    let input = Tensor::new(ids, model.device())?.unsqueeze(0)?;
    Ok(model.forward(&input, None)?.squeeze(0)?)
}

/// Refuses what a model cannot score: fewer than 2 tokens, more than its
/// positions, ids outside its vocabulary.
fn check_scored(model: &TokenFormerLm, ids: &[u32]) -> Result<()> {
    if ids.len() < 2 {
        return Err(Error::input(format!(
            "scoring needs at least 2 tokens (got {}): the first token is only context",
            ids.len()
        )));
    }
    check_fits(model, ids)
}

/// Refuses more tokens than the model's positions and ids outside its
/// vocabulary.
fn check_fits(model: &TokenFormerLm, ids: &[u32]) -> Result<()> {
    let max = model.config().max_position_embeddings;
    if ids.len() > max {
        return Err(Error::TooLong {
            tokens: ids.len(),
            max,
        });
    }
    model.check_ids(ids)
}

/// The [`SequenceScore`] of `ids` from its logits [t, vocab] (f32).
fn sequence_score(ids: &[u32], logits: &Tensor) -> Result<SequenceScore> {
    let n = ids.len() - 1;
    let logits = logits.narrow(0, 0, n)?;
    let (lp, lse, argmax) = match fused_target_logprobs(&logits, &ids[1..])? {
        Some(r) => (r.logprob, r.logsumexp, r.argmax),
        None => {
            let lse = logsumexp(&logits)?;
            let targets = Tensor::new(&ids[1..], logits.device())?.unsqueeze(1)?;
            let picked = logits.gather(&targets, 1)?.squeeze(1)?;
            let lp = (picked - &lse)?.to_vec1::<f32>()?;
            let argmax = first_argmax(&logits)?.to_vec1::<u32>()?;
            (lp, lse.to_vec1::<f32>()?, argmax)
        }
    };
    if let Some(t) = lp.iter().position(|x| !x.is_finite()) {
        return Err(Error::input(format!(
            "the log-probability of token {} (id {}) given the {} before it is {}: the model \
             outputs non-finite values (NaN or infinity), so the text has no score",
            t + 1,
            ids[t + 1],
            t + 1,
            lp[t]
        )));
    }
    let nll = -lp.iter().map(|&x| x as f64).sum::<f64>();
    Ok(SequenceScore {
        ids: ids.to_vec(),
        perplexity: (nll / n as f64).exp(),
        nll,
        next_token_logprobs: lp,
        argmax,
        logsumexp: lse,
    })
}

/// log p(target), log-sum-exp and first argmax of each row of `logits` by the
/// GPU's fused log-softmax-gather kernel, where it is turned on
/// (`TOKENFORMER_CUDA_KERNELS=1`) and takes them; `None`: the caller computes
/// them with tensor ops.
#[cfg(feature = "cuda")]
fn fused_target_logprobs(logits: &Tensor, targets: &[u32]) -> Result<Option<TargetLogprobs>> {
    if !fused_serves(logits) {
        return Ok(None);
    }
    Ok(Some(crate::kernels::cuda::target_logprobs(
        logits, targets,
    )?))
}

/// Whether [`fused_target_logprobs`] takes `logits` as they are.
#[cfg(feature = "cuda")]
fn fused_serves(logits: &Tensor) -> bool {
    crate::kernels::logprob_cuda_serves(logits)
}

#[cfg(not(feature = "cuda"))]
fn fused_serves(_: &Tensor) -> bool {
    false
}

#[cfg(not(feature = "cuda"))]
fn fused_target_logprobs(_: &Tensor, _: &[u32]) -> Result<Option<TargetLogprobs>> {
    Ok(None)
}

/// logsumexp over the last axis, with the max subtracted for stability.
pub fn logsumexp(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let s = x
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?;
    Ok((s + max)?.squeeze(D::Minus1)?)
}

/// One scoring request in tokens, as the harness's `(context_enc, continuation_enc)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub context: Vec<u32>,
    pub continuation: Vec<u32>,
}

/// log p(continuation | context) and whether greedy decoding would produce it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Loglikelihood {
    pub logprob: f64,
    /// Every continuation token is the argmax (first index on ties, as torch).
    pub is_greedy: bool,
}

/// Output-layer rows per chunk: bounds the logits buffer to rows × vocab
/// floats whatever the batch (512 × 50k floats is 100 MB). Each chunk's
/// gemm re-packs the whole output matrix, so chunks should not be small;
/// beyond 512 rows the gain is lost in the noise.
const HEAD_ROWS: usize = 512;

/// The batched scoring core over one model.
pub struct Scorer<'m> {
    model: &'m TokenFormerLm,
    rotary: Rotary,
    max_length: usize,
    greedy: bool,
    batch_tokens: usize,
    /// A merged model and the image every request follows.
    image: Option<(&'m VisionLanguageModel, Tensor)>,
}

impl<'m> Scorer<'m> {
    /// `max_length` defaults to the model's maximum positions (the harness's
    /// `max_length` for GPT-NeoX-style configs).
    pub fn new(model: &'m TokenFormerLm, max_length: Option<usize>) -> Result<Self> {
        let cfg = model.config();
        let max = cfg.max_position_embeddings;
        let max_length = max_length.unwrap_or(max);
        if max_length == 0 || max_length > max {
            return Err(Error::input(format!(
                "max length {max_length} must be between 1 and the model's {max} positions"
            )));
        }
        let rotary = Rotary::new(cfg.rotary_dims(), cfg.rotary_base, max, model.device())?;
        Ok(Self {
            model,
            rotary,
            max_length,
            greedy: false,
            batch_tokens: max_length,
            image: None,
        })
    }

    /// A scorer of text after one image (pixels [1, C, H, W]) in a merged
    /// model: each request's context and continuation follow the image, whose
    /// tokens are computed once per batch. Truncation counts text tokens only,
    /// as the text's positions do.
    pub fn after_image(
        model: &'m VisionLanguageModel,
        pixels: &Tensor,
        max_length: Option<usize>,
    ) -> Result<Self> {
        let images = pixels.dims().first().copied().unwrap_or(0);
        if pixels.rank() != 4 || images != 1 {
            return Err(Error::input(format!(
                "scoring after an image takes pixels [1, C, H, W], not {:?}",
                pixels.dims()
            )));
        }
        let mut scorer = Self::new(model.language(), max_length)?;
        scorer.image = Some((model, pixels.clone()));
        Ok(scorer)
    }

    /// Also compute `is_greedy` (costs one argmax per scored position).
    pub fn with_greedy(mut self, greedy: bool) -> Self {
        self.greedy = greedy;
        self
    }

    /// Caps a batch at `tokens` padded input tokens (at least one request):
    /// full-length windows go alone, short ones are packed. On CPU one
    /// full window already fills the matmuls, and the attention buffers grow
    /// with batch × length². On a GPU at most as many tokens as keep the
    /// logits (tokens × vocabulary) under 2^31 elements, the most candle's
    /// CUDA kernels index.
    pub fn with_batch_tokens(mut self, tokens: usize) -> Self {
        let most = crate::device::max_op_elements(self.model.device())
            / self.model.config().vocab_size.max(1);
        self.batch_tokens = tokens.min(most).max(1);
        self
    }

    pub fn max_length(&self) -> usize {
        self.max_length
    }

    pub fn model(&self) -> &TokenFormerLm {
        self.model
    }

    /// The model input of a request: `(context + continuation)[-(L+1):][:-1]`,
    /// the harness's left truncation; the continuation is its last positions.
    pub(crate) fn model_input(&self, r: &Request) -> Result<Vec<u32>> {
        if r.continuation.len() > self.max_length {
            return Err(Error::input(format!(
                "a continuation of {} tokens does not fit the maximum length {}",
                r.continuation.len(),
                self.max_length
            )));
        }
        if r.context.is_empty() && !r.continuation.is_empty() {
            return Err(Error::input(
                "a request needs at least one context token (use the EOS id as prefix)",
            ));
        }
        let total = r.context.len() + r.continuation.len();
        let start = total.saturating_sub(self.max_length + 1);
        Ok(r.context
            .iter()
            .chain(&r.continuation)
            .skip(start)
            .take(total - start - 1)
            .copied()
            .collect())
    }

    /// Scores `requests` in one padded forward pass.
    pub fn score_batch(&self, requests: &[&Request]) -> Result<Vec<Loglikelihood>> {
        let mut out = vec![
            Loglikelihood {
                logprob: 0.0,
                is_greedy: true,
            };
            requests.len()
        ];
        let live: Vec<usize> = (0..requests.len())
            .filter(|&i| !requests[i].continuation.is_empty())
            .collect();
        if live.is_empty() {
            return Ok(out);
        }
        let inputs = live
            .iter()
            .map(|&i| self.model_input(requests[i]))
            .collect::<Result<Vec<_>>>()?;
        let t_max = inputs.iter().map(Vec::len).max().unwrap_or(0);
        let b = inputs.len();
        let mut ids = vec![0u32; b * t_max];
        // Rows of the flattened [b·t, d] hidden states that predict a scored
        // token, their targets, and the request each belongs to.
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        let mut owner = Vec::new();
        for (k, (inp, &i)) in inputs.iter().zip(&live).enumerate() {
            ids[k * t_max..k * t_max + inp.len()].copy_from_slice(inp);
            let cont = &requests[i].continuation;
            let first = inp.len() - cont.len();
            for (j, &tok) in cont.iter().enumerate() {
                rows.push((k * t_max + first + j) as u32);
                targets.push(tok);
                owner.push(k);
            }
        }
        let dev = self.model.device();
        let ids = Tensor::from_vec(ids, (b, t_max), dev)?;
        let x = match &self.image {
            Some((vl, pixels)) => vl.text_hidden(pixels, &ids)?,
            None => {
                let mut x = self.model.embed(&ids)?;
                for layer in self.model.layers() {
                    let mode = AttentionMode::Causal {
                        rotary: &self.rotary,
                        offset: 0,
                        cache: None,
                    };
                    x = layer.forward(&x, mode)?;
                }
                x
            }
        };
        let d = x.dim(D::Minus1)?;
        let hidden = x.reshape((b * t_max, d))?;
        let mut logprob = vec![0f64; b];
        let mut greedy = vec![true; b];
        // In the compute dtype once for all chunks (a no-op for f32 weights).
        let output_matrix = self
            .model
            .output_matrix()
            .to_dtype(self.model.compute_dtype())?;
        // A GPU takes larger chunks: each is a few launches, and its memory holds them.
        let chunk = if dev.is_cpu() {
            HEAD_ROWS
        } else {
            8 * HEAD_ROWS
        };
        for start in (0..rows.len()).step_by(chunk) {
            let end = (start + chunk).min(rows.len());
            let sel = Tensor::new(&rows[start..end], dev)?;
            let h = hidden.index_select(&sel, 0)?.unsqueeze(0)?;
            let logits = self
                .model
                .head_in_compute_dtype(&h, &output_matrix)?
                .squeeze(0)?;
            let picked = target_logprobs(&logits, &targets[start..end], self.greedy)?;
            for (r, (lp, is_max)) in picked.into_iter().enumerate() {
                let k = owner[start + r];
                logprob[k] += lp;
                greedy[k] &= is_max;
            }
        }
        for (k, &i) in live.iter().enumerate() {
            out[i] = Loglikelihood {
                logprob: logprob[k],
                is_greedy: greedy[k],
            };
        }
        Ok(out)
    }

    /// Scores all `requests`, up to `batch_size` (and the token cap) at a
    /// time, longest inputs first so that a batch holds similar lengths
    /// (little padding); `progress` gets the number of scored tokens after
    /// each batch. Results are in input order.
    pub(crate) fn score_all(
        &self,
        requests: &[Request],
        batch_size: usize,
        mut progress: impl FnMut(usize),
    ) -> Result<Vec<Loglikelihood>> {
        let batch_size = batch_size.max(1);
        let mut order: Vec<usize> = (0..requests.len()).collect();
        let len = |r: &Request| (r.context.len() + r.continuation.len()).min(self.max_length + 1);
        order.sort_by_key(|&i| std::cmp::Reverse(len(&requests[i])));
        let mut out = vec![
            Loglikelihood {
                logprob: 0.0,
                is_greedy: true,
            };
            requests.len()
        ];
        let mut at = 0;
        while at < order.len() {
            // Sorted longest first: the chunk's first input sets its padded length.
            let padded = len(&requests[order[at]]).saturating_sub(1).max(1);
            let fit = (self.batch_tokens / padded).clamp(1, batch_size);
            let chunk = &order[at..(at + fit).min(order.len())];
            at += chunk.len();
            let batch: Vec<&Request> = chunk.iter().map(|&i| &requests[i]).collect();
            let scored = self.score_batch(&batch)?;
            for (&i, s) in chunk.iter().zip(scored) {
                out[i] = s;
            }
            progress(batch.iter().map(|r| r.continuation.len()).sum());
        }
        Ok(out)
    }
}

/// The first index holding each row's maximum, as torch's argmax (and the CPU
/// path) picks it on ties: candle's GPU argmax keeps whichever thread saw a
/// tied maximum. Each maximum scores vocab − index, the first one the most.
fn first_argmax(logits: &Tensor) -> Result<Tensor> {
    let (_, vocab) = logits.dims2()?;
    let at_max = logits
        .broadcast_ge(&logits.max_keepdim(D::Minus1)?)?
        .to_dtype(DType::F32)?;
    let rank = Tensor::arange(0u32, vocab as u32, logits.device())?
        .to_dtype(DType::F32)?
        .affine(-1.0, vocab as f64)?;
    Ok(at_max.broadcast_mul(&rank)?.argmax(D::Minus1)?)
}

/// For each row of `logits` [n, vocab] (any float dtype): log-softmax at the
/// target and whether the target is the (first) argmax.
fn target_logprobs(logits: &Tensor, targets: &[u32], greedy: bool) -> Result<Vec<(f64, bool)>> {
    let (n, vocab) = logits.dims2()?;
    // The GPU kernel reads bf16/f16 logits as they are, in f32 (the values the
    // widening would give it); every other path reads f32.
    let logits = if fused_serves(logits) {
        logits.contiguous()?
    } else {
        logits.to_dtype(DType::F32)?.contiguous()?
    };
    let compute = |data: &[f32]| -> Vec<(f64, bool)> {
        data.par_chunks(vocab)
            .zip(targets.par_iter())
            .map(|(row, &t)| {
                let (max, sum) = crate::kernels::max_and_exp_sum(row);
                let lp = (row[t as usize] - max) as f64 - sum.ln();
                // The first index holding the maximum, as torch's argmax.
                let is_max = !greedy || row.iter().position(|&v| v == max) == Some(t as usize);
                (lp, is_max)
            })
            .collect()
    };
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::input(format!(
            "token id {bad} is outside the vocabulary (size {vocab})"
        )));
    }
    if crate::kernels::fused_on(&logits) {
        let (storage, layout) = logits.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            let data = &cpu.as_slice::<f32>()?[a..b];
            debug_assert_eq!(data.len(), n * vocab);
            return Ok(compute(data));
        }
        drop(storage);
        let data = logits.flatten_all()?.to_vec1::<f32>()?;
        return Ok(compute(&data));
    }
    if let Some(r) = fused_target_logprobs(&logits, targets)? {
        return Ok((0..n)
            .map(|i| {
                let is_max = !greedy || r.argmax[i] == targets[i];
                (r.logprob[i] as f64, is_max)
            })
            .collect());
    }
    // On a GPU the reductions run there; only three numbers a row come back.
    let lse = logsumexp(&logits)?.to_vec1::<f32>()?;
    let index = Tensor::new(targets, logits.device())?.unsqueeze(1)?;
    let picked = logits.gather(&index, 1)?.squeeze(1)?.to_vec1::<f32>()?;
    let argmax = if greedy {
        Some(first_argmax(&logits)?.to_vec1::<u32>()?)
    } else {
        None
    };
    Ok((0..n)
        .map(|r| {
            let is_max = argmax.as_ref().is_none_or(|a| a[r] == targets[r]);
            ((picked[r] - lse[r]) as f64, is_max)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Ties go to the first index, as torch's argmax (and the CPU path) decide.
    #[test]
    fn the_device_argmax_takes_the_first_of_tied_maxima() {
        let rows = [
            [0.5f32, 2.0, -1.0, 2.0, 2.0],
            [3.0, 3.0, 3.0, 3.0, 3.0],
            [-4.0, -3.0, -2.0, -1.0, -1.5],
        ];
        let t = Tensor::new(&rows, &Device::Cpu).unwrap();
        let got = first_argmax(&t).unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(got, [1, 0, 3]);
    }
}
